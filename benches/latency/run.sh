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
install_missing iperf3 wireguard-go wireguard-tools iproute2 iputils-ping util-linux python3 || true
# The unit setup boots systemd in systemd-nspawn on a debootstrapped rootfs; the pod setups run
# podman (with runc) and read the manifest with PyYAML.
case " $* " in
*unit*) install_missing systemd-container debootstrap || true ;;
esac
case " $* " in
*pod-*)
    install_missing podman runc debootstrap || true
    python3 -c 'import yaml' 2>/dev/null || python3 -m pip install --quiet pyyaml || true
    ;;
esac

exec python3 benches/latency/bench.py "$@"
