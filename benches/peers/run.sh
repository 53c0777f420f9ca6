#!/usr/bin/env bash
# The many-peers benchmark, one command: benches/peers/run.sh [--quick] [--peers 1,4,16]
# [--binary [LABEL=]PATH ...] [--out FILE | --publish] (see benches/peers/bench.py --help). Needs root:
# network namespaces. Installs the missing Debian packages (--no-install-recommends); bench.py builds
# target/release/tunnelgate first unless --binary or --no-build is given.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/peers/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping nftables python3 || true

exec python3 benches/peers/bench.py "$@"
