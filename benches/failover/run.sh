#!/usr/bin/env bash
# Restart and failover silence, tunnelgate and wireguard-go replicas in one run:
# benches/failover/run.sh [--bin PATH] [--rounds N] [--case C] [--window S] [--out FILE | --publish]
# (see failover.py --help). failover.py builds the release binary (`cargo build --release`)
# unless --bin names one. Needs root (network namespaces), nft and conntrack.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ "$(id -u)" != "0" ]]; then
    echo "benches/failover/run.sh needs root (network namespaces)" >&2
    exit 2
fi
source scripts/packages.sh
install_missing wireguard-go wireguard-tools iproute2 iputils-ping nftables conntrack python3 || true
exec python3 benches/failover/failover.py "$@"
