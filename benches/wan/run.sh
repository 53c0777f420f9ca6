#!/usr/bin/env bash
# The WAN benchmark (the AQM at 20 and 80 ms added RTT), one command:
#   benches/wan/run.sh [--quick] [--rounds N] [--daemon-env NAME:K=V] [--out FILE | --publish] ...
# (see benches/wan/bench.py --help). Needs root: network namespaces. Builds target/release/tunnelgate
# and the relay (benches/wan/relay, into target/wan-relay).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/wan/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-tools iproute2 iputils-ping util-linux procps python3 || true

exec python3 benches/wan/bench.py "$@"
