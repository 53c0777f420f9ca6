#!/usr/bin/env bash
# The control-plane and memory benchmark, one command: benches/control/run.sh [--quick] [--repeats N]
# [--out FILE] [--tunnelgate PATH] (see benches/control/bench.py --help). Needs root: network
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

PKGS=(iperf3 dnsmasq-base wireguard-tools iproute2 iputils-ping nftables iptables curl python3)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null; then
    echo "==> installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
fi

if [[ ! -x target/release/tunnelgate && " $* " != *" --tunnelgate "* ]]; then
    echo "==> building target/release/tunnelgate" >&2
    cargo build --release --bin tunnelgate
fi

exec python3 benches/control/bench.py "$@"
