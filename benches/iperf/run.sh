#!/usr/bin/env bash
# The iperf3 benchmark, one command: benches/iperf/run.sh [--quick] [--rounds N] [--out FILE] ...
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

PKGS=(iperf3 wireguard-go wireguard-tools iproute2 iputils-ping python3)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null; then
    echo "==> installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
fi

exec python3 benches/iperf/bench.py "$@"
