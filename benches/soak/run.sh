#!/usr/bin/env bash
# The soak benchmark, one command: benches/soak/run.sh [--minutes N] [--out FILE | --publish]
# (see benches/soak/soak.py --help). Needs root: network namespaces. Installs the missing Debian
# packages (--no-install-recommends); soak.py builds target/release/tunnelgate first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/soak/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping nftables dnsmasq curl python3 || true

exec python3 benches/soak/soak.py "$@"
