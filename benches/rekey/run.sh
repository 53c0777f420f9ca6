#!/usr/bin/env bash
# Rekey under traffic, one command: benches/rekey/run.sh [--seconds N] [--rate R] [--out FILE | --publish]
# (see benches/rekey/rekey.py --help). Needs root (network namespaces) and a release build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ "$(id -u)" != "0" ]]; then
    echo "benches/rekey/run.sh needs root (network namespaces)" >&2
    exit 2
fi
source scripts/packages.sh
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping python3 || true
[[ -x target/release/tunnelgate ]] || cargo build --release --bin tunnelgate
exec python3 benches/rekey/rekey.py "$@"
