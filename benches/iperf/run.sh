#!/usr/bin/env bash
# The iperf3 benchmark, one command: benches/iperf/run.sh [--quick] [--rounds N] [--out FILE | --publish] ...
# (see benches/iperf/bench.py --help). Needs root: network namespaces. Installs the missing Debian
# packages (--no-install-recommends); bench.py builds target/release/tunnelgate and installs
# boringtun-cli into ~/.cache/tunnelgate-bench if it is not on PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/iperf/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping python3 ethtool || true

exec python3 benches/iperf/bench.py "$@"
