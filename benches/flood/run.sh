#!/usr/bin/env bash
# The flood benchmark, one command: benches/flood/run.sh [--quick] [--rounds N] [--out FILE | --publish] ...
# (see benches/flood/bench.py --help). Needs root: network namespaces.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/flood/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing wireguard-tools wireguard-go iperf3 iproute2 iputils-ping util-linux python3 || true

exec python3 benches/flood/bench.py "$@"
