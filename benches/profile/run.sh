#!/usr/bin/env bash
# The profile benchmark, one command: benches/profile/run.sh [--duration S] [--setup NAME] [--out FILE | --publish] ...
# (see benches/profile/profile.py --help). Needs root: network namespaces.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/profile/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-tools iproute2 iputils-ping python3 linux-perf || true

exec python3 benches/profile/profile.py "$@"
