#!/usr/bin/env bash
# The demo: builds tunnelgate, then in three network namespaces
#   peer (wireguard-go) --veth-- proxy (tunnelgate) --veth-- cluster (a web server + iperf3)
# connects a standard WireGuard peer, exposes the cluster's service through tunnelgate's ingress
# (the peer talks to the proxy's tunnel address; tunnelgate DNATs it to the "ClusterIP"), shows
# `wg show` and `tunnelgate status` against the daemon, and ends with an iperf3 figure.
# Needs root (namespaces): `sudo scripts/demo.sh`. It builds with the cargo of the user who ran
# sudo, as that user (`--print-cargo` says which cargo and exits). Everything it creates is
# removed on exit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[[ "$(id -u)" == "0" ]] || { echo "demo: run as root: sudo scripts/demo.sh (it creates network namespaces)" >&2; exit 1; }

# Built with the cargo of whoever ran sudo, as them (sudo's PATH has no ~/.cargo/bin).
source scripts/cargo-user.sh
if [[ "${1:-}" == "--print-cargo" ]]; then # how it would build, then exit
    describe_cargo user scripts/demo.sh
    exit
fi
[[ $# -eq 0 ]] || { echo "usage: sudo scripts/demo.sh [--print-cargo]" >&2; exit 2; }
describe_cargo user scripts/demo.sh >/dev/null

source scripts/packages.sh
install_missing wireguard-go wireguard-tools iperf3 nftables iproute2 python3

echo "==> building tunnelgate (release; the first build takes about 5 minutes on 2 quiet cores)"
cargo_as_user build --release --quiet --bin tunnelgate
BIN="$PWD/target/release/tunnelgate"

P=tgdemo-peer X=tgdemo-proxy C=tgdemo-cluster
WORK="$(mktemp -d /tmp/tunnelgate-demo.XXXXXX)"
chmod 700 "$WORK"
cleanup() {
    for ns in $P $X $C; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    done
    sleep 0.5
    for ns in $P $X $C; do ip netns del "$ns" 2>/dev/null || true; done
    rm -f /var/run/wireguard/tgdemo0.sock /var/run/wireguard/tgdemo1.sock
    rm -rf "$WORK"
}
trap cleanup EXIT
cleanup 2>/dev/null || true
WORK="$(mktemp -d /tmp/tunnelgate-demo.XXXXXX)"

nsx() { local ns="$1"; shift; ip netns exec "$ns" "$@"; }
for ns in $P $X $C; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip link add tgd-p netns $P type veth peer name tgd-xp netns $X
ip link add tgd-c netns $C type veth peer name tgd-xc netns $X
ip -n $P addr add 192.0.2.2/24 dev tgd-p;  ip -n $X addr add 192.0.2.1/24 dev tgd-xp
ip -n $C addr add 10.96.0.10/24 dev tgd-c;  ip -n $X addr add 10.96.0.1/24 dev tgd-xc
for l in "$P tgd-p" "$X tgd-xp" "$C tgd-c" "$X tgd-xc"; do set -- $l; ip -n "$1" link set "$2" up; done

echo "==> keys"
umask 077
"$BIN" genkey > "$WORK/proxy.key"
wg genkey > "$WORK/peer.key"
PROXY_PUB="$("$BIN" pubkey < "$WORK/proxy.key")"
PEER_PUB="$(wg pubkey < "$WORK/peer.key")"

cat > "$WORK/tunnelgate.toml" <<EOF
[interface]
name = "tgdemo0"
private_key_file = "proxy.key"
listen_port = 51820
addresses = ["100.64.0.1/32"]

[[peer]]
public_key = "$PEER_PUB"
allowed_ips = ["100.64.0.2/32"]

[[ingress]]                 # the peer reaches the "ClusterIP" through the proxy's tunnel address
target = "10.96.0.10"
ports = ["80:8080", "5201"]

[health]
listen = "127.0.0.1:9002"
EOF

echo "==> tunnelgate check (what it will install)"
"$BIN" check --config "$WORK/tunnelgate.toml" | sed 's/^/    /'

echo "==> cluster: a web server on 10.96.0.10:8080 and an iperf3 server"
echo "hello from the cluster, via tunnelgate ingress" > "$WORK/index.html"
(cd "$WORK" && nsx $C python3 -m http.server 8080 --bind 10.96.0.10 >/dev/null 2>&1 &)
nsx $C iperf3 -s -D --bind 10.96.0.10

echo "==> proxy: tunnelgate run"
nsx $X "$BIN" run --config "$WORK/tunnelgate.toml" 2>"$WORK/tunnelgate.log" &
for _ in $(seq 50); do
    nsx $X python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9002/readyz').status==200 else 1)" 2>/dev/null && break
    sleep 0.1
done

echo "==> peer: a standard wireguard-go configured with wg"
WG_PROCESS_FOREGROUND=1 nsx $P wireguard-go -f tgdemo1 >/dev/null 2>&1 &
for _ in $(seq 50); do [[ -S /var/run/wireguard/tgdemo1.sock ]] && break; sleep 0.1; done
nsx $P wg set tgdemo1 private-key "$WORK/peer.key" peer "$PROXY_PUB" endpoint 192.0.2.1:51820 allowed-ips 100.64.0.1/32
nsx $P ip addr add 100.64.0.2/32 dev tgdemo1
nsx $P ip link set tgdemo1 up
nsx $P ip route add 100.64.0.1/32 dev tgdemo1

echo "==> peer fetches http://100.64.0.1/ (DNATed to 10.96.0.10:8080)"
BODY="$(nsx $P python3 -c "import urllib.request; print(urllib.request.urlopen('http://100.64.0.1/', timeout=5).read().decode().strip())")"
echo "    $BODY"
[[ "$BODY" == "hello from the cluster, via tunnelgate ingress" ]] || { echo "demo: ingress failed" >&2; cat "$WORK/tunnelgate.log" >&2; exit 1; }

echo "==> wg show tgdemo0 (the real wg tool, talking to tunnelgate's UAPI socket)"
nsx $X wg show tgdemo0 | sed 's/^/    /'
echo "==> tunnelgate status"
nsx $X "$BIN" status --interface tgdemo0 | sed 's/^/    /'

echo "==> iperf3: peer -> 100.64.0.1:5201 (through the tunnel and the ingress DNAT), 5 s"
nsx $P iperf3 -c 100.64.0.1 -t 5 -f g | grep -E 'sender|receiver' | sed 's/^/    /'
# The README's figure, from the same run file its Performance table cites.
RUN_FILE=benches/iperf/results/2026-11-29-final-c415529.json
BOTH_ENDS="$(python3 -c 'import json, statistics, sys
runs = json.load(open(sys.argv[1]))["setups"]["tunnelgate"]["runs"]
print("%.2f" % (statistics.median(r["bps"] for r in runs if r["test"] == "tcp1") / 1e9))' "$RUN_FILE")"
echo "    That is one TCP stream from Debian's wireguard-go (no offloads) to tunnelgate, with both"
echo "    ends and iperf3 on this machine's CPUs: the wireguard-go end bounds it (about 0.3 Gbit/s"
echo "    with wireguard-go at both ends). With tunnelgate at both ends, one stream carried"
echo "    $BOTH_ENDS Gbit/s on a 2-vCPU VM ($RUN_FILE);"
echo "    to measure this machine: sudo benches/iperf/run.sh"
