#!/usr/bin/env bash
# The latency-under-load benchmark, one command: benches/latency/run.sh [--quick] [--rounds N] [--out FILE | --publish] ...
# (see benches/latency/bench.py --help). Needs root: network namespaces.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/latency/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping python3 || true

exec python3 benches/latency/bench.py "$@"
