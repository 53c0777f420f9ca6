#!/usr/bin/env bash
# The control-plane and memory benchmark, one command: benches/control/run.sh [--quick] [--repeats N]
# [--out FILE | --publish] [--tunnelgate PATH] (see benches/control/bench.py --help). Needs root: network
# namespaces. Installs the missing Debian packages (--no-install-recommends); builds
# target/release/tunnelgate only when it is missing (a fresh clone), else uses it as it is.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null; then
        exec sudo -E env "PATH=$PATH" "$0" "$@"
    fi
    echo "benches/control/run.sh needs root (network namespaces)" >&2
    exit 2
fi

source scripts/packages.sh
install_missing iperf3 dnsmasq-base wireguard-tools iproute2 iputils-ping nftables iptables curl python3 || true

if [[ ! -x target/release/tunnelgate && " $* " != *" --tunnelgate "* ]]; then
    echo "==> building target/release/tunnelgate" >&2
    cargo build --release --bin tunnelgate
fi

exec python3 benches/control/bench.py "$@"
