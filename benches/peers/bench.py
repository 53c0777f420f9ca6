#!/usr/bin/env python3
"""Many-peers benchmark: one tunnelgate gateway, 1, 4, 16 ... WireGuard client peers, each pushing an
iperf3 TCP stream through the gateway at once; owns the topology, the measurement and the report.

Topology, one per gateway build (`--binary`, repeatable, so one run compares builds):

  client ns c<i> --veth 10.97.<i>.2/.1--> gateway ns --veth 10.102.0.1/.2--> server ns
  (tunnel 10.101.0.<10+i>)                (tunnel 10.101.0.1, subnet router     (iperf3 servers,
                                           for 10.102.0.0/24, SNAT)              one port per client)

Every client has its own veth into the gateway namespace (no bridge: one hop less, and the gateway's
one UDP socket still serves all peers). The gateway is `tunnelgate run` with a TOML config listing
every client as a `[[peer]]` and `[router] advertise_routes` for the server's subnet: the traffic is
forwarded, as a node-level gateway forwards to the services behind it. `--server-at gateway` puts
the iperf3 servers on the gateway's own tunnel address instead (no forwarding, no nftables work).

Clients are `tunnelgate userspace` (default; a fixed binary for every gateway build, so only the
gateway changes between builds) or Debian's wireguard-go (`--client wireguard-go`). As many clients
as the largest peer count are started once per gateway; a measurement with k peers drives the first
k of them, the others stay idle (no keepalive, so they cost the gateway nothing but table entries).

Per measurement (gateway build x peer count x direction, rounds interleaved in a rotating order):
the aggregate throughput (sum of the clients' received rates), the slowest and fastest peer, the
gateway's CPU seconds per GB, its CPU per thread (utime+stime deltas from /proc/PID/task/*/stat,
grouped by thread name) and the largest thread's share of the gateway's CPU, the clients' CPU, and
how busy the whole machine was. Direction `up` is client -> server (the gateway decrypts), `down`
is iperf3 -R (the gateway encrypts).

Every namespace and process the benchmark made is removed at the end, also on Ctrl-C, SIGTERM or an
error; namespaces and interfaces carry the run's pid, so concurrent runs never collide and a later
run sweeps what a killed one left. Traffic goes only to addresses inside these namespaces.

Usage: benches/peers/run.sh [--quick] [--peers 1,4,16] [--binary [LABEL=]PATH ...] [--out FILE | --publish]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CLK_TCK, REPO, CommandFailed, Daemon, add_ns, add_output_args, build_release_tunnelgate, cpu_ticks  # noqa: E402
from benchproc import genkey, git_commit, iperf3_server, kill_ns, log, machine_busy_ticks, med_spread, nsx, raise_on_signals  # noqa: E402
from benchproc import results_path, run, stop_process, sweep_stale, tail, thread_cpu_delta, thread_cpu_ticks, wait_for  # noqa: E402

PID = os.getpid()
NS_PREFIX = "tgpeers"  # namespaces: tgpeers<pid>g<gateway>[s | c<client>]
IF_PREFIX = "tp"  # interfaces: tp<pid>g<gateway>[c<client> | v<client> | u<client> | sa | sb] (<= 15 chars)
MAX_PEERS = 64  # client i gets 10.97.<i>.0/24 and tunnel address 10.101.0.<10+i>

GATEWAY_TUNNEL = "10.101.0.1"
SERVER_NET, GATEWAY_LAN, SERVER_ADDR = "10.102.0.0/24", "10.102.0.1", "10.102.0.2"
WG_PORT = 51820
MTU = 1420
IPERF_BASE_PORT = 5201
DIRECTIONS = ("up", "down")


def client_tunnel_addr(i: int) -> str:
    return f"10.101.0.{10 + i}"


def client_underlay(i: int) -> tuple[str, str]:
    """(the gateway's end, the client's end) of client i's veth."""
    return f"10.97.{i}.1", f"10.97.{i}.2"


# --------------------------------------------------------------------------------------------------
# Daemons
# --------------------------------------------------------------------------------------------------


class Gateway(Daemon):
    """`tunnelgate run` with every client as a peer, routing the server's subnet."""

    kind = "tunnelgate-gateway"

    def __init__(self, ns: str, ifname: str, workdir: Path, binary: str, workers: int | None):
        super().__init__(ns, ifname, workdir)
        self.binary, self.workers = binary, workers

    def start(self, client_pubs: list[str], server_at: str) -> None:
        keyfile = self.workdir / f"{self.ifname}.key"
        keyfile.write_text(self.key + "\n")
        keyfile.chmod(0o600)
        peers = "".join(f'\n[[peer]]\npublic_key = "{pub}"\nallowed_ips = ["{client_tunnel_addr(i)}/32"]\n' for i, pub in enumerate(client_pubs))
        # The subnet router forwards to the servers; with the servers on the gateway itself, its
        # input guard must let the tunnel reach local listeners instead.
        tail_section = f'[router]\nadvertise_routes = ["{SERVER_NET}"]\n\n[health]\nlisten = ""\n' if server_at == "subnet" else '[health]\nlisten = ""\nallow_from_tunnel = true\n'
        config = self.workdir / f"{self.ifname}.toml"
        config.write_text(
            f"""# written by benches/peers/bench.py
[interface]
name = "{self.ifname}"
private_key_file = "{keyfile}"
listen_port = {self.port}
addresses = ["{GATEWAY_TUNNEL}/32"]
mtu = {MTU}
{f"workers = {self.workers}" if self.workers else ""}
{peers}
{tail_section}"""
        )
        self.spawn([self.binary, "run", "--config", str(config)], {"RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        self.wait_configured()


WGGO_BUILDS = ("wireguard-go-upstream", "wireguard-go-tailscale")


def wggo_binary(kind: str) -> str:
    """Debian's wireguard-go (PATH), or one of the builds with offloads in ../shared/bin beside the
    repository (a worktree under wt/ looks one level higher), or $TUNNELGATE_PEERS_BIN."""
    if kind == "wireguard-go":
        return "wireguard-go"
    env = os.environ.get("TUNNELGATE_PEERS_BIN")
    dirs = ([Path(env)] if env else []) + [REPO.parent / "shared" / "bin", REPO.parents[1] / "shared" / "bin"]
    for d in dirs:
        if os.access(d / kind, os.X_OK):
            return str(d / kind)
    raise CommandFailed(f"skipped: no {kind} binary in ../shared/bin or $TUNNELGATE_PEERS_BIN (see shared/bin/README.md)")


class Client(Daemon):
    """One client peer: a bare interface (`tunnelgate userspace` or wireguard-go) set up with `wg`
    and `ip`, whose tunnel routes the gateway's address and the server subnet."""

    def __init__(self, ns: str, ifname: str, workdir: Path, index: int, kind: str, binary: str):
        super().__init__(ns, ifname, workdir)
        self.index, self.kind, self.binary = index, kind, binary

    def start(self, gateway_pub: str) -> None:
        if self.kind.startswith("wireguard-go"):
            self.spawn([wggo_binary(self.kind), "-f", self.ifname], {"WG_PROCESS_FOREGROUND": "1"})
        else:
            self.spawn([self.binary, "userspace", "-f", self.ifname], {"RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        self.wait_socket()
        routes = [f"{GATEWAY_TUNNEL}/32", SERVER_NET]
        gateway_end, _ = client_underlay(self.index)
        self.configure_wg([(gateway_pub, routes, f"{gateway_end}:{WG_PORT}")], [f"{client_tunnel_addr(self.index)}/32"], routes, MTU)


# --------------------------------------------------------------------------------------------------
# Topology: one gateway build, its clients and its iperf3 server namespace
# --------------------------------------------------------------------------------------------------


class Topology:
    def __init__(self, index: int, label: str, binary: str, workers: int | None, clients: int, args: argparse.Namespace, workdir: Path):
        self.index, self.label, self.binary, self.workers = index, label, binary, workers
        self.client_count, self.client_kind, self.client_binary = clients, args.client, args.client_binary
        self.server_at = args.server_at
        self.workdir = workdir / f"g{index}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = f"{NS_PREFIX}{PID}g{index}"
        self.gw_ns, self.server_ns = base, base + "s"
        self.client_ns = [f"{base}c{i}" for i in range(clients)]
        self.ifbase = f"{IF_PREFIX}{PID}g{index}"
        assert len(self.ifbase) + 3 <= 15, self.ifbase
        self.created_ns: list[str] = []
        self.gateway: Gateway | None = None
        self.clients: list[Client] = []
        self.status, self.reason = "pending", ""
        self.runs: list[dict] = []

    @property
    def target(self) -> str:
        return SERVER_ADDR if self.server_at == "subnet" else GATEWAY_TUNNEL

    @property
    def target_ns(self) -> str:
        return self.server_ns if self.server_at == "subnet" else self.gw_ns

    def make_ns(self, ns: str) -> None:
        add_ns(ns)
        self.created_ns.append(ns)

    def veth(self, ns_a: str, if_a: str, addr_a: str, ns_b: str, if_b: str, addr_b: str) -> None:
        run(["ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b])
        for ns, dev, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
            nsx(ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            nsx(ns, "ip", "link", "set", "dev", dev, "up")

    def start(self) -> None:
        self.make_ns(self.gw_ns)
        if self.server_at == "subnet":
            self.make_ns(self.server_ns)
            self.veth(self.gw_ns, f"{self.ifbase}sa", GATEWAY_LAN, self.server_ns, f"{self.ifbase}sb", SERVER_ADDR)
            nsx(self.server_ns, "ip", "route", "add", "default", "via", GATEWAY_LAN)
        for i, ns in enumerate(self.client_ns):
            self.make_ns(ns)
            gateway_end, client_end = client_underlay(i)
            self.veth(self.gw_ns, f"{self.ifbase}v{i}", gateway_end, ns, f"{self.ifbase}u{i}", client_end)
        self.gateway = Gateway(self.gw_ns, self.ifbase, self.workdir, self.binary, self.workers)
        self.gateway.key, self.gateway.pub = genkey()
        self.gateway.port = WG_PORT
        for i, ns in enumerate(self.client_ns):
            c = Client(ns, f"{self.ifbase}c{i}", self.workdir, i, self.client_kind, self.client_binary)
            c.key, c.pub = genkey()
            c.port = WG_PORT
            self.clients.append(c)
        self.gateway.start([c.pub for c in self.clients], self.server_at)
        for c in self.clients:
            c.start(self.gateway.pub)
        # The first packet triggers each client's handshake; every client must reach the target.
        for c in self.clients:
            if not wait_for(lambda: self.ping_once(c), 15, 0.2):
                raise CommandFailed(f"client {c.index} got no ping reply from {self.target} within 15 s" + self.daemon_notes())
        self.check_alive()
        self.status = "ok"

    def ping_once(self, c: Client) -> bool:
        return nsx(c.ns, "ping", "-n", "-q", "-c", "1", "-W", "1", self.target, check=False, timeout=5).returncode == 0

    def daemons(self) -> list[Daemon]:
        return ([self.gateway] if self.gateway else []) + list(self.clients)

    def daemon_notes(self) -> str:
        notes = [f"{d.kind} {d.ifname} exited: {tail(d.logfile, 5)}" for d in self.daemons() if d.proc and not d.alive()]
        return ("; " + "; ".join(notes)) if notes else ""

    def check_alive(self) -> None:
        for d in self.daemons():
            if not d.alive():
                raise CommandFailed(f"{d.kind} {d.ifname} exited ({d.proc.poll() if d.proc else '?'}): {tail(d.logfile)}")

    def teardown(self) -> None:
        for d in self.daemons():
            try:
                d.stop()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"warning: stopping {d.kind} {d.ifname}: {e}")
        for ns in self.created_ns:
            kill_ns(ns)
        self.created_ns.clear()


def sweep_stale_runs() -> None:
    sweep_stale(NS_PREFIX + r"(\d+)g\d+(?:s|c\d+)?", IF_PREFIX + r"(\d+)g\d+(?:c\d+)?\.sock")


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def per_thread(delta: dict[int, tuple[str, int]], total_ticks: int) -> tuple[dict, dict]:
    """The gateway's CPU grouped by thread name ({name: {threads, cpu_s, share}}), and its busiest
    single thread ({name, tid, cpu_s, share}); shares are of the whole process's CPU."""
    groups: dict[str, dict] = {}
    for _tid, (name, ticks) in delta.items():
        g = groups.setdefault(name, {"threads": 0, "ticks": 0})
        g["threads"] += 1
        g["ticks"] += ticks
    denom = max(total_ticks, 1)
    by_name = {
        name: {"threads": g["threads"], "cpu_s": round(g["ticks"] / CLK_TCK, 3), "share": round(g["ticks"] / denom, 4)}
        for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["ticks"])
    }
    tid, (name, ticks) = max(delta.items(), key=lambda kv: kv[1][1], default=(0, ("-", 0)))
    top = {"name": name, "tid": tid, "cpu_s": round(ticks / CLK_TCK, 3), "share": round(ticks / denom, 4)}
    return by_name, top


def jain_fairness(xs: list[float]) -> float | None:
    """1.0 when every peer got the same rate, 1/n when one peer got everything."""
    if not xs or not any(xs):
        return None
    return round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 4)


REORDER_COUNTERS = ("TCPSACKReorder", "TCPTSReorder", "TCPRenoReorder")


def tcp_reorder_events(namespaces: list[str]) -> int:
    """Reordering the TCP senders in `namespaces` detected so far (TcpExt TCPSACKReorder +
    TCPTSReorder + TCPRenoReorder of /proc/net/netstat, which is per network namespace)."""
    total = 0
    for ns in namespaces:
        text = nsx(ns, "cat", "/proc/net/netstat", check=False, timeout=5).stdout
        lines = [l.split() for l in text.splitlines() if l.startswith("TcpExt:")]
        if len(lines) >= 2:
            fields = dict(zip(lines[0][1:], lines[1][1:]))
            total += sum(int(fields.get(k, 0)) for k in REORDER_COUNTERS)
    return total


def measure(topo: Topology, peers: int, direction: str, duration: int, streams: int) -> dict:
    """k iperf3 clients at once, each to its own iperf3 server port, while the gateway's threads
    and the machine are sampled before and after."""
    servers: list[subprocess.Popen] = []
    clients: list[subprocess.Popen] = []
    try:
        for i in range(peers):
            servers.append(iperf3_server(topo.target_ns, IPERF_BASE_PORT + i, bind=topo.target))
        gw = topo.gateway
        assert gw is not None
        active = topo.clients[:peers]
        threads_before, gw_before = thread_cpu_ticks(gw.pid), cpu_ticks(gw.pid)
        clients_before = [cpu_ticks(c.pid) or 0 for c in active]
        senders = [c.ns for c in active] + [topo.target_ns]
        reorder_before = tcp_reorder_events(senders)
        busy_before, machine_before = machine_busy_ticks()
        t0 = time.monotonic()
        for i, c in enumerate(active):
            cmd = ["ip", "netns", "exec", c.ns, "iperf3", "-c", topo.target, "-p", str(IPERF_BASE_PORT + i), "-t", str(duration), "-J", "--connect-timeout", "5000"]
            cmd += ["-P", str(streams)] + (["-R"] if direction == "down" else [])
            clients.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
        outputs = []
        for p in clients:
            try:
                out, err = p.communicate(timeout=max(1.0, duration + 30 - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                return {"error": f"an iperf3 client did not finish within {duration + 30} s"}
            outputs.append((p.returncode, out, err))
        wall = time.monotonic() - t0
        threads_after, gw_after = thread_cpu_ticks(gw.pid), cpu_ticks(gw.pid)
        clients_after = [cpu_ticks(c.pid) or 0 for c in active]
        busy_after, machine_after = machine_busy_ticks()
        reorder = tcp_reorder_events(senders) - reorder_before

        per_peer_bps, total_bytes, retransmits = [], 0, 0
        for i, (rc, out, err) in enumerate(outputs):
            try:
                j = json.loads(out)
            except json.JSONDecodeError:
                return {"error": f"iperf3 client {i} exited {rc}: {err.strip() or out.strip()[:300]}"}
            if "error" in j:
                return {"error": f"iperf3 client {i}: {j['error']}"}
            recv = j.get("end", {}).get("sum_received", {})
            per_peer_bps.append(recv.get("bits_per_second") or 0.0)
            total_bytes += recv.get("bytes") or 0
            # The sender's count (iperf3 reports the server's with -R).
            retransmits += j.get("end", {}).get("sum_sent", {}).get("retransmits") or 0
        if gw_before is None or gw_after is None:
            return {"error": "the gateway exited during the run"}
        gw_ticks = gw_after - gw_before
        by_name, top = per_thread(thread_cpu_delta(threads_before, threads_after), gw_ticks)
        gw_cpu_s = gw_ticks / CLK_TCK
        return {
            "wall_s": round(wall, 3),
            "bps": sum(per_peer_bps),
            "bytes": total_bytes,
            "per_peer_bps": per_peer_bps,
            "fairness": jain_fairness(per_peer_bps),
            "gateway_cpu_s": round(gw_cpu_s, 3),
            "gateway_cpu_s_per_gb": round(gw_cpu_s / (total_bytes / 1e9), 3) if total_bytes else None,
            # In CPUs: 1.0 = one core busy all the time.
            "gateway_cpus": round(gw_cpu_s / wall, 3),
            "gateway_threads": by_name,
            "top_thread": top,
            "clients_cpu_s": round(sum(a - b for a, b in zip(clients_after, clients_before)) / CLK_TCK, 3),
            "machine_busy_percent": round(100 * (busy_after - busy_before) / max(machine_after - machine_before, 1), 1),
            # Reordering the TCP senders detected (SACK, timestamps, Reno): a data plane that
            # spreads one flow over threads out of order raises it.
            "tcp_reorder_events": reorder,
            "tcp_retransmits": retransmits,
        }
    finally:
        for p in clients + servers:
            stop_process(p)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def runs_of(g: dict, peers: int, direction: str) -> list[dict]:
    return [r for r in g["runs"] if r["peers"] == peers and r["direction"] == direction and "error" not in r]


def report(results: dict) -> str:
    head = ("gateway", "peers", "dir", "Gbit/s total", "slowest/fastest peer", "fairness", "gw CPU s/GB", "gw CPUs", "top thread (share of gw CPU)", "TCP reorder", "retransmits", "machine busy %")
    rows = [head]
    failed, threads = [], []
    for label, g in results["gateways"].items():
        if g["status"] != "ok":
            failed.append(f"{label}: FAILED: {g['reason'][:300]}")
            continue
        for peers in results["meta"]["peer_counts"]:
            for direction in results["meta"]["directions"]:
                rs = runs_of(g, peers, direction)
                if not rs:
                    errors = [r["error"] for r in g["runs"] if r["peers"] == peers and r["direction"] == direction and "error" in r]
                    rows.append((label, str(peers), direction, "no result: " + (errors[0][:150] if errors else "not run"), "", "", "", "", "", "", "", ""))
                    continue
                last = rs[-1]
                top_names = [r["top_thread"]["name"] for r in rs]
                top_name = max(set(top_names), key=top_names.count)
                rows.append(
                    (
                        label,
                        str(peers),
                        direction,
                        med_spread([r["bps"] for r in rs], 1e9),
                        f"{statistics.median(min(r['per_peer_bps']) for r in rs) / 1e9:.2f}/{statistics.median(max(r['per_peer_bps']) for r in rs) / 1e9:.2f}",
                        med_spread([r["fairness"] for r in rs if r["fairness"] is not None], 1, "{:.2f}"),
                        med_spread([r["gateway_cpu_s_per_gb"] for r in rs if r["gateway_cpu_s_per_gb"]], 1, "{:.2f}"),
                        med_spread([r["gateway_cpus"] for r in rs], 1, "{:.2f}"),
                        f"{top_name} " + med_spread([100 * r["top_thread"]["share"] for r in rs], 1, "{:.0f}%"),
                        med_spread([r.get("tcp_reorder_events", 0) for r in rs], 1, "{:.0f}"),
                        med_spread([r.get("tcp_retransmits", 0) for r in rs], 1, "{:.0f}"),
                        med_spread([r["machine_busy_percent"] for r in rs], 1, "{:.0f}"),
                    )
                )
                groups = ", ".join(
                    f"{name}{'×' + str(v['threads']) if v['threads'] > 1 else ''} {100 * v['share']:.0f}%" for name, v in last["gateway_threads"].items() if v["share"] >= 0.005
                )
                threads.append(f"  {label} {peers} peer(s) {direction}: {groups or '-'}")
    widths = [max(len(r[i]) for r in rows if not r[3].startswith("no result") or i < 3) for i in range(len(head))]
    out = []
    for r in rows:
        if r[3].startswith("no result"):
            out.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        else:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if r is head:
            out.append("  ".join("-" * w for w in widths))
    out += failed
    if threads:
        out += ["", "gateway CPU by thread name (last round; ×N = N threads of that name):"] + threads
    ratio = compare_builds(results)
    if ratio:
        out += ["", ratio]
    return "\n".join(out)


def compare_builds(results: dict) -> str:
    """With several gateway builds: each one's median throughput and CPU s/GB relative to the first."""
    ok = [(label, g) for label, g in results["gateways"].items() if g["status"] == "ok"]
    if len(ok) < 2:
        return ""
    (first, g0), rest = ok[0], ok[1:]
    out = [f"relative to {first} (throughput ratio, CPU s/GB ratio; > 1 throughput and < 1 CPU are better):"]
    for label, g in rest:
        for peers in results["meta"]["peer_counts"]:
            for direction in results["meta"]["directions"]:
                a, b = runs_of(g0, peers, direction), runs_of(g, peers, direction)
                if a and b:
                    tput = statistics.median(r["bps"] for r in b) / statistics.median(r["bps"] for r in a)
                    cpu_a = [r["gateway_cpu_s_per_gb"] for r in a if r["gateway_cpu_s_per_gb"]]
                    cpu_b = [r["gateway_cpu_s_per_gb"] for r in b if r["gateway_cpu_s_per_gb"]]
                    cpu = f"{statistics.median(cpu_b) / statistics.median(cpu_a):.2f}x" if cpu_a and cpu_b else "-"
                    out.append(f"  {label} / {first}  {peers:>2} peer(s) {direction:<4}  throughput {tput:.2f}x  CPU/GB {cpu}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def gateway_builds(specs: list[str] | None, args: argparse.Namespace, workdir: Path) -> list[tuple[str, str]]:
    """(label, path) per `--binary [LABEL=]PATH`; none given: this tree's release build, built first
    (unless --no-build). A label defaults to the checkout the binary was built in (the directory
    holding `target/`), else the file name."""
    if not specs:
        path = str(REPO / "target" / "release" / "tunnelgate")
        if not args.no_build:
            path = build_release_tunnelgate(workdir / "cargo-build.log")
        specs = [f"this-tree={path}"]
    builds: list[tuple[str, str]] = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            path = spec
            p = Path(spec).resolve()
            label = p.parents[2].name if len(p.parents) > 2 and p.parents[1].name == "target" else p.name
        if not os.access(path, os.X_OK):
            raise CommandFailed(f"--binary {spec}: {path} is not an executable")
        while label in (l for l, _ in builds):
            label += "'"
        builds.append((label, os.path.abspath(path)))
    return builds


def version_of(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        return (p.stdout or p.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default="1,4,16", help="comma-separated peer counts (default %(default)s)")
    ap.add_argument("--directions", default="up,down", help="up (client -> server: the gateway decrypts), down (iperf3 -R: it encrypts); default %(default)s")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across builds, peer counts and directions (default 3)")
    ap.add_argument("--duration", type=int, default=10, help="seconds per iperf3 run (default 10)")
    ap.add_argument("--quick", action="store_true", help="1 round of 5 s runs")
    ap.add_argument("--streams", type=int, default=1, help="TCP streams per client (iperf3 -P; default 1)")
    ap.add_argument(
        "--binary",
        action="append",
        metavar="[LABEL=]PATH",
        help="a tunnelgate build to run as the gateway; repeat it to compare builds in one run (default: this tree's target/release/tunnelgate, built first)",
    )
    ap.add_argument("--no-build", action="store_true", help="without --binary: use target/release/tunnelgate as it is")
    ap.add_argument(
        "--workers",
        metavar="N[,M...]",
        help="run each gateway build with interface.workers = N, then M, ... (labels get /wN); default: the daemon's own default",
    )
    ap.add_argument("--client", choices=("tunnelgate", "wireguard-go") + WGGO_BUILDS, default="tunnelgate", help="what the client peers run (default %(default)s: `tunnelgate userspace`)")
    ap.add_argument("--client-binary", metavar="PATH", help="the tunnelgate for `--client tunnelgate` (default: the first gateway build)")
    ap.add_argument("--server-at", choices=("subnet", "gateway"), default="subnet", help="iperf3 servers in a namespace behind the gateway (default) or on its tunnel address")
    add_output_args(ap, "peers")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs and configs")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration = 1, 5
    try:
        peer_counts = sorted({int(x) for x in args.peers.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--peers {args.peers}: expected numbers like 1,4,16")
    if not peer_counts or peer_counts[0] < 1 or peer_counts[-1] > MAX_PEERS:
        ap.error(f"--peers: counts from 1 to {MAX_PEERS}")
    worker_counts: list[int | None] = [None]
    if args.workers:
        try:
            worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--workers {args.workers}: expected numbers like 1,2")
        # The upper bound is the daemon's to check (`interface.workers`): it names it at start.
        if not worker_counts or min(worker_counts) < 1:
            ap.error("--workers: counts of at least 1 (0 is the daemon's default: leave --workers out)")
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    if not directions or any(d not in DIRECTIONS for d in directions):
        ap.error(f"--directions: a comma-separated subset of {', '.join(DIRECTIONS)}")
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces): run benches/peers/run.sh as root")
    needed = ("iperf3", "wg", "ip", "ping", "ss", "nft") + (("wireguard-go",) if args.client == "wireguard-go" else ())
    if args.client in WGGO_BUILDS:
        try:
            wggo_binary(args.client)
        except CommandFailed as e:
            ap.error(str(e))
    missing = [t for t in needed if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)} (benches/peers/run.sh installs them)")
    try:
        out = results_path(args, "peers")
    except CommandFailed as e:
        ap.error(str(e))

    raise_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="tunnelgate-peers-"))
    topologies: list[Topology] = []
    load_start = open("/proc/loadavg").read().split()[:3]
    if float(load_start[0]) > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_start[0]} before the benchmark: other work will skew the figures")
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "rounds": args.rounds,
            "duration_s": args.duration,
            "peer_counts": peer_counts,
            "directions": directions,
            "streams_per_peer": args.streams,
            "gateway_workers": worker_counts if args.workers else "default",
            "client": args.client,
            "server_at": args.server_at,
            "mtu": MTU,
            "loadavg_start": load_start,
        },
        "gateways": {},
    }
    interrupted = False
    try:
        sweep_stale_runs()
        builds = gateway_builds(args.binary, args, workdir)
        args.client_binary = args.client_binary or builds[0][1]
        results["meta"]["gateway_binaries"] = dict(builds)
        results["meta"]["versions"] = {
            "iperf3": version_of(["iperf3", "--version"]),
            "client": version_of([wggo_binary(args.client), "--version"]) if args.client.startswith("wireguard-go") else args.client_binary,
        }
        gateways = [(f"{label}/w{w}" if w else label, path, w) for label, path in builds for w in worker_counts]
        topologies = [Topology(i, label, path, w, peer_counts[-1], args, workdir) for i, (label, path, w) in enumerate(gateways)]
        for t in topologies:
            log(f"==> starting gateway {t.label} with {t.client_count} {args.client} client(s)")
            try:
                t.start()
            except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                t.status, t.reason = "failed", str(e)
                log(f"    {t.label} FAILED: {e}")
                t.teardown()
        combos = [(t, k, d) for t in topologies if t.status == "ok" for k in peer_counts for d in directions]
        total, n = args.rounds * len(combos), 0
        for rnd in range(args.rounds):
            shift = rnd % len(combos) if combos else 0
            for t, peers, direction in combos[shift:] + combos[:shift]:
                if t.status != "ok":
                    continue
                n += 1
                log(f"==> round {rnd + 1}/{args.rounds}, {t.label}, {peers} peer(s) {direction} ({n}/{total})")
                try:
                    r = measure(t, peers, direction, args.duration, args.streams)
                except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                    r = {"error": str(e)}
                r.update(round=rnd + 1, peers=peers, direction=direction)
                t.runs.append(r)
                if "error" in r:
                    log(f"    error: {r['error']}")
                else:
                    log(
                        f"    {r['bps'] / 1e9:.2f} Gbit/s, gw {r['gateway_cpu_s_per_gb']} CPU s/GB, {r['gateway_cpus']} CPUs, "
                        f"top thread {r['top_thread']['name']} {100 * r['top_thread']['share']:.0f}%, machine {r['machine_busy_percent']}% busy"
                    )
                try:
                    t.check_alive()
                except CommandFailed as e:
                    t.status, t.reason = "failed", f"during round {rnd + 1}, {peers} peer(s) {direction}: {e}"
                    log(f"    {t.label} FAILED: {t.reason}")
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for t in topologies:
            t.teardown()
        sweep_stale_runs()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if args.keep_logs:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    results["meta"]["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["meta"]["interrupted"] = interrupted
    results["meta"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    for t in topologies:
        results["gateways"][t.label] = {"binary": t.binary, "status": "ok" if t.status == "ok" else "failed", "reason": t.reason, "runs": t.runs}
    if interrupted:  # never replace complete figures with a partial run
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    m = results["meta"]
    print(f"\nmany-peers benchmark: {m['rounds']} round(s) x {m['duration_s']} s, commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']}")
    print(f"clients: {m['client']}, {m['streams_per_peer']} TCP stream(s) each; iperf3 servers: {'behind the gateway (forwarded)' if m['server_at'] == 'subnet' else 'on the gateway'}")
    print("medians (min–max) over the rounds; gw CPUs = gateway CPU seconds per second (1.0 = one core)\n")
    print(report(results))
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
