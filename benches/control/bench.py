#!/usr/bin/env python3
"""Control-plane and memory benchmark of tunnelgate: RSS, start-to-ready, rule apply, re-resolution.

Measures the project's targets, each in namespaces of its own (names tgcb<pid>x<seq><role>):

  idle_rss          two daemons joined by veth, one peer each, one ping through the tunnel (the
                    handshake is done), 2 s idle: VmRSS, VmHWM, RssAnon, RssFile   target <= 10 MB
  rss_10k_peers     one daemon with 10,000 [[peer]] entries (random keys, one /32 each from
                    10.128.0.0/9, no endpoint): VmRSS/VmHWM after READY=1, and the
                    start-to-ready time                                              target <= 64 MB
  start_ready_100   spawn -> READY=1 (sd_notify) with the tunnel up and 100 ingress ports, a fresh
                    namespace per start, for nftables, iptables-nft, iptables-legacy  target <= 200 ms
  apply_1000        500 ingress + 500 egress ports applied in the start's one transaction: the
                    daemon's tunnelgate_rule_last_apply_duration_seconds gauge, and spawn -> READY=1
                                                                                     target <= 1 s
  reresolve_100     daemon B re-resolves 100 target_fqdn names (dnsmasq in its namespace) every
                    second while iperf3 (TCP, 1 stream) runs A -> B through the tunnel; interleaved
                    with runs of the same config without the names. Medians, their ratio, the
                    lowest 1-s interval, and B's DNS resolution counter during each run.
                    target: no stall (no 1-s interval below 50 % of the median without names)
  rules_scale       per size (100, 1,000, 10,000, 50,000 ingress ports; --quick 100, 1,000) and
                    backend: start -> READY=1 and the apply gauge, connect latency of new TCP
                    connections through the tunnel and the DNAT, and one Service moved to another
                    target by `tunnelgate reload` (wall time and apply gauge).
                    target: nftables, 10,000 ports: apply <= 1 s, one-Service change <= 50 ms

Prints a table (figure | target | met?) and writes JSON. A measurement that fails is reported as
failed with the reason; the others still run. Namespaces, daemons, dnsmasq, iperf3 and sockets are
removed at the end, also on Ctrl-C, SIGTERM or an error (an interrupted run writes *.partial.json).

Needs root, iproute2, wireguard-tools (wg genkey), iputils-ping, iperf3, dnsmasq, nftables,
iptables (nft and legacy), curl. Uses target/release/tunnelgate as it is (run.sh builds it when missing).
Usage: benches/control/run.sh [--quick] [--repeats N] [--out FILE | --publish] [--tunnelgate PATH]
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import functools
import hashlib
import json
import os
import platform
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CommandFailed as Failed  # noqa: E402
from benchproc import add_ns, add_output_args, results_path, log, run, nsx, wait_for, pid_alive, cpu_ticks, tail, kill_ns, genkey, git_commit, med_spread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WG_SOCKET_DIR = Path("/var/run/wireguard")
TG_RUN_DIR_DEFAULT = Path("/var/run/tunnelgate")
PID = os.getpid()
PREFIX = "tgcb"  # namespaces and interfaces: tgcb<pid>x<seq base36><role> (<= 15 chars)
CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1024.0  # KiB per MiB: "MB" in this benchmark is 2^20 bytes

UNDERLAY = {"a": "10.99.0.1", "b": "10.99.0.2"}
TUNNEL = {"a": ("10.100.0.1", "fd00:100::1"), "b": ("10.100.0.2", "fd00:100::2")}
TARGET_NET = "10.77.0.1/24"  # on a veth inside the namespace; ingress targets live here
INGRESS_TARGET = "10.77.0.10"
DNS_ADDR = "10.53.0.1"
DOMAIN = "bench.internal"
HEALTH = "127.0.0.1:9002"
WG_PORT = 51820
IPERF_PORT = 5201
MTU = 1420

# firewall variant -> (firewall.mode, TUNNELGATE_IPTABLES)
BACKENDS = {
    "nftables": ("nftables", None),
    "iptables-nft": ("iptables", "nft"),
    "iptables-legacy": ("iptables", "legacy"),
}

TARGETS = {
    "idle_rss": "<= 10 MB",
    "rss_10k_peers": "<= 64 MB",
    "start_ready_100": "<= 200 ms",
    "apply_1000": "<= 1 s",
    "reresolve_100": "no stall",
    "rules_scale": "nftables, 10,000 ports: apply <= 1 s, one-Service change <= 50 ms",
}


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


spread = functools.partial(med_spread, fmt="{:.1f}")


def b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


# --------------------------------------------------------------------------------------------------
# Cleanup: everything created is registered here and removed whatever happens
# --------------------------------------------------------------------------------------------------


class Registry:
    def __init__(self) -> None:
        self.seq = 0
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.paths: list[Path] = []

    def name(self, seq: int, role: str) -> str:
        n = f"{PREFIX}{PID}x{b36(seq)}{role}"
        assert len(n) <= 15, n
        return n

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def add_ns(self, seq: int, role: str) -> str:
        ns = self.name(seq, role)
        add_ns(ns)
        self.namespaces.append(ns)
        return ns

    def del_ns(self, ns: str) -> None:
        kill_ns(ns)
        if ns in self.namespaces:
            self.namespaces.remove(ns)

    def stop_proc(self, p: subprocess.Popen, timeout: float = 5) -> None:
        if p.poll() is None:
            try:
                p.terminate()
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def cleanup(self) -> None:
        for p in list(self.procs):
            try:
                self.stop_proc(p)
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"warning: stopping pid {p.pid}: {e}")
        for ns in list(self.namespaces):
            try:
                self.del_ns(ns)
            except Exception as e:  # noqa: BLE001
                log(f"warning: deleting namespace {ns}: {e}")
        for path in self.paths:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        sweep_stale()


REG = Registry()


def sweep_stale() -> None:
    """Removes namespaces and sockets that an earlier, killed run of this benchmark left behind
    (their pid is not alive any more) and this run's own leftovers."""
    own = re.compile(PREFIX + r"(\d+)x[0-9a-z]+")

    def stale(name: str) -> bool:
        m = own.fullmatch(name)
        return bool(m) and (int(m.group(1)) == PID or not pid_alive(int(m.group(1))))

    for line in run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(name):
            kill_ns(name)
    for d in (WG_SOCKET_DIR, TG_RUN_DIR_DEFAULT):
        if d.is_dir():
            for sock in d.glob(PREFIX + "*.sock"):
                if stale(sock.name[: -len(".sock")]):
                    sock.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------
# Topologies
# --------------------------------------------------------------------------------------------------


def single_ns(seq: int) -> str:
    """One namespace with a link holding the ingress targets' network."""
    ns = REG.add_ns(seq, "s")
    target_link(ns, seq)
    return ns


def target_link(ns: str, seq: int, extra: tuple[str, ...] = ()) -> None:
    """A veth pair inside `ns` (this kernel may lack the dummy driver) holding TARGET_NET."""
    d, e = REG.name(seq, "d"), REG.name(seq, "e")
    nsx(ns, "ip", "link", "add", d, "type", "veth", "peer", "name", e)
    for net in (TARGET_NET, *extra):
        nsx(ns, "ip", "addr", "add", net, "dev", d)
    nsx(ns, "ip", "link", "set", e, "up")
    nsx(ns, "ip", "link", "set", d, "up")


def pair_ns(seq: int) -> dict[str, str]:
    """Two namespaces a, b joined by veth (10.99.0.1/.2); b also has the target network and DNS_ADDR."""
    ns = {s: REG.add_ns(seq, s) for s in "ab"}
    va, vb = REG.name(seq, "v"), REG.name(seq, "w")
    run(["ip", "link", "add", va, "netns", ns["a"], "type", "veth", "peer", "name", vb, "netns", ns["b"]])
    for s, dev in (("a", va), ("b", vb)):
        nsx(ns[s], "ip", "addr", "add", f"{UNDERLAY[s]}/24", "dev", dev)
        nsx(ns[s], "ip", "link", "set", dev, "up")
    target_link(ns["b"], seq, (f"{DNS_ADDR}/32",))
    return ns


def fake_pub() -> str:
    return base64.b64encode(os.urandom(32)).decode()


# --------------------------------------------------------------------------------------------------
# The daemon
# --------------------------------------------------------------------------------------------------


def tg_config(
    ifname: str,
    keyfile: Path,
    addresses: tuple[str, str],
    peers: str,
    *,
    health: str = "",
    mode: str | None = None,
    extra: str = "",
) -> str:
    fw = f'[firewall]\nmode = "{mode}"\n\n' if mode else ""
    return f"""# written by benches/control/bench.py
[interface]
name = "{ifname}"
private_key_file = "{keyfile}"
listen_port = {WG_PORT}
addresses = ["{addresses[0]}/32", "{addresses[1]}/128"]
mtu = {MTU}

{peers}
{fw}{extra}
[health]
listen = "{health}"
"""


def peer_block(pub: str, allowed: list[str], endpoint: str | None = None) -> str:
    ep = f'endpoint = "{endpoint}"\n' if endpoint else ""
    ips = ", ".join(f'"{a}"' for a in allowed)
    return f'[[peer]]\npublic_key = "{pub}"\n{ep}allowed_ips = [{ips}]\n'


def ports_list(ports) -> str:
    return "[" + ", ".join(f'"{p}"' for p in ports) + "]"


class Tunnelgate:
    binary = ""

    def __init__(self, ns: str, ifname: str, workdir: Path, key: str | None = None):
        self.ns, self.ifname, self.workdir = ns, ifname, workdir
        if key is None:
            key, pub = genkey()
        else:
            pub = run(["wg", "pubkey"], stdin=None, input=key).stdout.strip()
        self.key, self.pub = key, pub
        self.keyfile = workdir / f"{ifname}.key"
        self.keyfile.write_text(key + "\n")
        self.keyfile.chmod(0o600)
        self.config = workdir / f"{ifname}.toml"
        self.logfile = workdir / f"{ifname}.log"
        self.proc: subprocess.Popen | None = None
        self.notify: socket.socket | None = None
        self.notify_path = workdir / f"{ifname}.notify"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, config_text: str, env: dict[str, str] | None = None, timeout: float = 30) -> float:
        """Spawns the daemon and returns the seconds from spawn to its READY=1 datagram."""
        self.config.write_text(config_text)
        self.notify_path.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        REG.paths.append(self.notify_path)
        e = dict(os.environ)
        e.update(
            {
                "RUST_LOG": os.environ.get("RUST_LOG", "info"),
                "NOTIFY_SOCKET": str(self.notify_path),
                "TUNNELGATE_RUN_DIR": str(self.workdir),
            }
        )
        e.pop("TUNNELGATE_IPTABLES", None)
        e.update(env or {})
        out = open(self.logfile, "w")
        self.spawned_unix = time.time()
        t0 = time.monotonic()
        # `ip netns exec NS cmd` execs cmd itself: proc.pid is the daemon.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, Tunnelgate.binary, "run", "--config", str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,  # Ctrl-C goes to us; we stop the daemon ourselves
        )
        out.close()
        REG.procs.append(self.proc)
        deadline = t0 + timeout
        while True:
            r, _, _ = select.select([self.notify], [], [], 0.05)
            if r:
                now = time.monotonic()
                msg = self.notify.recv(4096).decode(errors="replace")
                if "READY=1" in msg.split("\n"):
                    return now - t0
                continue
            if self.proc.poll() is not None:
                raise Failed(f"tunnelgate exited {self.proc.returncode} before READY=1: {tail(self.logfile) or '(no output)'}")
            if time.monotonic() > deadline:
                raise Failed(f"no READY=1 within {timeout:.0f} s: {tail(self.logfile) or '(no output)'}")

    def stop(self) -> float | None:
        """SIGTERM, wait for the exit; returns the seconds it took (None if it was not running)."""
        took = None
        if self.proc is not None:
            if self.proc.poll() is None:
                t0 = time.monotonic()
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                    took = time.monotonic() - t0
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    log(f"warning: {self.ifname} did not exit within 15 s of SIGTERM: killed")
            if self.proc in REG.procs:
                REG.procs.remove(self.proc)
        if self.notify is not None:
            self.notify.close()
            self.notify = None
        self.notify_path.unlink(missing_ok=True)
        (WG_SOCKET_DIR / f"{self.ifname}.sock").unlink(missing_ok=True)
        return took

    def memory(self) -> dict:
        return memory_of(self.pid)

    def phases(self) -> dict[str, float]:
        """Milliseconds from spawn to the first log line with each message (the log's UTC stamps)."""
        out: dict[str, float] = {}
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return out
        for line in lines:
            m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z\s+\w+\s+\S+:\s+(.*)", line)
            if not m:
                continue
            for msg in ("Routes applied", "Rules applied", "Tunnel up"):
                if m.group(2).startswith(msg) and msg not in out:
                    stamp = dt.datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=dt.timezone.utc).timestamp()
                    out[msg] = round((stamp - self.spawned_unix) * 1000, 1)
        return out

    def metrics(self) -> dict[str, float]:
        return fetch_metrics(self.ns)


def memory_of(pid: int) -> dict:
    out: dict = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSize"):
                out[k + "_kib"] = int(v.split()[0])
            elif k == "Threads":
                out["threads"] = int(v)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Pss", "Pss_Anon", "Pss_File"):
                    out[k + "_kib"] = int(v.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    out["smaps_top"] = smaps_top(pid)
    return out


def smaps_top(pid: int, n: int = 10) -> list[dict]:
    """Rss by mapping, summed per file and permissions (anonymous mappings together), largest first."""
    sums: dict[str, list[int]] = {}
    name = ""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                fields = line.split()
                if not fields:
                    continue
                if re.match(r"^[0-9a-f]+-[0-9a-f]+$", fields[0]):
                    name = fields[5] if len(fields) > 5 else "[anon]"
                    if name.startswith("/"):
                        name = f"{os.path.basename(name)} {fields[1]}"  # per permission: text, rodata, data
                    sums.setdefault(name, [0, 0, 0])[2] += 1
                elif fields[0] == "Rss:":
                    sums[name][0] += int(fields[1])
                elif fields[0] == "Anonymous:":
                    sums[name][1] += int(fields[1])
    except OSError:
        return []
    top = sorted(sums.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"mapping": k, "rss_kib": v[0], "anon_kib": v[1], "regions": v[2]} for k, v in top if v[0]]


def fetch_metrics(ns: str) -> dict[str, float]:
    """The daemon's /metrics as {'name{labels}': value}."""
    p = nsx(ns, "curl", "-sS", "-m", "5", f"http://{HEALTH}/metrics", check=False, timeout=10)
    if p.returncode != 0:
        raise Failed(f"GET /metrics failed: {p.stderr.strip()}")
    out = {}
    for line in p.stdout.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            pass
    return out


def metric_sum(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def metric_with(m: dict[str, float], name: str, label: str) -> float | None:
    for k, v in m.items():
        if k.startswith(name + "{") and label in k:
            return v
    return None


def readyz(ns: str) -> tuple[int, str]:
    p = nsx(ns, "curl", "-sS", "-m", "3", "-o", "/dev/stdout", "-w", "\n%{http_code}", f"http://{HEALTH}/readyz", check=False, timeout=10)
    body, _, code = p.stdout.rpartition("\n")
    return (int(code) if code.isdigit() else 0), body.strip()


def ping_once(ns: str, dst: str) -> bool:
    return nsx(ns, "ping", "-n", "-q", "-c", "1", "-W", "1", dst, check=False, timeout=5).returncode == 0


def spawn_baseline(ns: str, n: int = 5) -> list[float]:
    """Seconds from spawn to exit of `ip netns exec NS true`: the floor under every start time."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run(["ip", "netns", "exec", ns, "true"], stdin=subprocess.DEVNULL, capture_output=True)
        out.append(time.monotonic() - t0)
    return out


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def m_idle_rss(args, workdir: Path) -> dict:
    """Two daemons, one peer each, handshake done, 2 s idle."""
    runs = []
    for r in range(args.repeats):
        seq = REG.next_seq()
        ns = pair_ns(seq)
        d = {s: Tunnelgate(ns[s], REG.name(seq, s), workdir) for s in "ab"}
        try:
            for s, o in (("a", "b"), ("b", "a")):
                peers = peer_block(d[o].pub, [f"{TUNNEL[o][0]}/32", f"{TUNNEL[o][1]}/128"], f"{UNDERLAY[o]}:{WG_PORT}")
                d[s].start(tg_config(d[s].ifname, d[s].keyfile, TUNNEL[s], peers))
            if not wait_for(lambda: ping_once(ns["a"], TUNNEL["b"][0]), 15, 0.2):
                raise Failed("no ping reply through the tunnel within 15 s")
            time.sleep(2)
            run_ = {"round": r + 1}
            for s in "ab":
                run_[s] = d[s].memory()
            runs.append(run_)
            log(f"    round {r + 1}: VmRSS a/b {run_['a']['VmRSS_kib'] / MIB:.2f}/{run_['b']['VmRSS_kib'] / MIB:.2f} MB, "
                f"VmHWM {run_['a']['VmHWM_kib'] / MIB:.2f}/{run_['b']['VmHWM_kib'] / MIB:.2f} MB")
        finally:
            for x in d.values():
                x.stop()
            for x in ns.values():
                REG.del_ns(x)
    vals = {k: [run_[s][k] for run_ in runs for s in "ab"] for k in ("VmRSS_kib", "VmHWM_kib", "RssAnon_kib", "RssFile_kib")}
    rss = med(vals["VmRSS_kib"])
    return {
        "figure_kib": rss,
        "figure": f"VmRSS {rss / MIB:.2f} MB (HWM {med(vals['VmHWM_kib']) / MIB:.2f}, anon {med(vals['RssAnon_kib']) / MIB:.2f}, file {med(vals['RssFile_kib']) / MIB:.2f})",
        "met": rss <= 10 * MIB,
        "median_kib": {k: med(v) for k, v in vals.items()},
        "max_kib": {k: max(v) for k, v in vals.items()},
        "runs": runs,
    }


def m_rss_10k(args, workdir: Path) -> dict:
    """One daemon with 10,000 peers (random keys, one /32 each, no endpoint)."""
    npeers = 10_000
    runs = []
    for r in range(args.repeats_10k):
        seq = REG.next_seq()
        ns = single_ns(seq)
        tg = Tunnelgate(ns, REG.name(seq, "t"), workdir)
        try:
            blocks = []
            for i in range(npeers):
                n = (128 << 16) + i + 1  # 10.128.0.1 .. within 10.128.0.0/9
                blocks.append(f'[[peer]]\npublic_key = "{fake_pub()}"\nallowed_ips = ["10.{n >> 16}.{(n >> 8) & 255}.{n & 255}/32"]\n')
            cfg = tg_config(tg.ifname, tg.keyfile, TUNNEL["a"], "\n".join(blocks))
            ready = tg.start(cfg, timeout=args.slow_timeout)
            at_ready = tg.memory()
            time.sleep(2)
            idle = tg.memory()
            routes = len(nsx(ns, "ip", "-4", "route", "show", "dev", tg.ifname).stdout.splitlines())
            wg_peers = len(nsx(ns, "wg", "show", tg.ifname, "peers", check=False).stdout.split())
            stop = tg.stop()
            phases = tg.phases()
            runs.append({"round": r + 1, "ready_s": ready, "phases_ms": phases, "stop_s": stop, "at_ready": at_ready, "after_2s": idle, "routes": routes, "wg_show_peers": wg_peers, "config_bytes": len(cfg)})
            log(f"    round {r + 1}: ready {ready * 1000:.0f} ms {phases}, VmRSS {idle['VmRSS_kib'] / MIB:.1f} MB, VmHWM {idle['VmHWM_kib'] / MIB:.1f} MB, "
                f"{routes} routes, {wg_peers} peers in wg show, stop {stop if stop is None else round(stop * 1000)} ms")
        finally:
            tg.stop()
            REG.del_ns(ns)
    # Diagnostic, once: the same number of peers without allowed IPs (so no routes, no
    # allowed-IP table): what the peers themselves cost in memory and start time.
    seq = REG.next_seq()
    ns = single_ns(seq)
    tg = Tunnelgate(ns, REG.name(seq, "t"), workdir)
    try:
        blocks = [f'[[peer]]\npublic_key = "{fake_pub()}"\nallowed_ips = []\n' for _ in range(npeers)]
        ready0 = tg.start(tg_config(tg.ifname, tg.keyfile, TUNNEL["a"], "\n".join(blocks)), timeout=args.slow_timeout)
        time.sleep(2)
        peers_only = {"ready_s": ready0, "phases_ms": None, "after_2s": tg.memory()}
        tg.stop()
        peers_only["phases_ms"] = tg.phases()
        log(f"    peers only (no allowed_ips, no routes): ready {ready0 * 1000:.0f} ms, VmRSS {peers_only['after_2s']['VmRSS_kib'] / MIB:.1f} MB")
    finally:
        tg.stop()
        REG.del_ns(ns)
    rss = [x["after_2s"]["VmRSS_kib"] for x in runs]
    hwm = [x["after_2s"]["VmHWM_kib"] for x in runs]
    ready = [x["ready_s"] for x in runs]
    worst = max(med(rss), med(hwm))
    return {
        "peers_without_allowed_ips": peers_only,
        "figure_kib": med(rss),
        "figure": f"VmRSS {med(rss) / MIB:.1f} MB, HWM {med(hwm) / MIB:.1f} MB; ready {spread(ready, 1e-3, '{:.0f}')} ms",
        "met": worst <= 64 * MIB,
        "ready_s": ready,
        "runs": runs,
    }


def rule_start(args, workdir: Path, backend: str, n_ingress: int, n_egress: int) -> dict:
    """One start in a fresh namespace: spawn -> READY=1, then the apply gauge, then SIGTERM."""
    mode, flavour = BACKENDS[backend]
    seq = REG.next_seq()
    ns = single_ns(seq)
    tg = Tunnelgate(ns, REG.name(seq, "t"), workdir)
    try:
        _, peer_pub = genkey()
        peers = peer_block(peer_pub, [f"{TUNNEL['b'][0]}/32", f"{TUNNEL['b'][1]}/128"])
        extra = f'[[ingress]]\ntarget = "{INGRESS_TARGET}"\nports = {ports_list(range(10001, 10001 + n_ingress))}\n\n'
        if n_egress:
            extra += f'[[egress]]\ntarget = "{TUNNEL["b"][0]}"\nports = {ports_list(range(20001, 20001 + n_egress))}\n\n'
        cfg = tg_config(tg.ifname, tg.keyfile, TUNNEL["a"], peers, health=HEALTH, mode=mode, extra=extra)
        env = {"TUNNELGATE_IPTABLES": flavour} if flavour else {}
        ready = tg.start(cfg, env, timeout=args.slow_timeout)
        m = tg.metrics()
        r = {
            "ready_s": ready,
            "backend_reported": next((k.split('"')[1] for k in m if k.startswith("tunnelgate_rules_applied{")), None),
            "last_apply_s": metric_sum(m, "tunnelgate_rule_last_apply_duration_seconds"),
            "rule_applies": metric_sum(m, "tunnelgate_rule_applies_total"),
            "rule_apply_failures": metric_sum(m, "tunnelgate_rule_apply_failures_total"),
            "rules_applied": metric_sum(m, "tunnelgate_rules_applied"),
            "rules_installed": metric_sum(m, "tunnelgate_rules_installed"),
        }
        r["stop_s"] = tg.stop()
        r["phases_ms"] = tg.phases()
        if r["rules_applied"] != 1:
            raise Failed(f"rules not applied at READY=1 ({backend}): {tail(tg.logfile, 5)}")
        return r
    finally:
        tg.stop()
        REG.del_ns(ns)


def m_rules(args, workdir: Path, n_ingress: int, n_egress: int, key: str, limit_s: float) -> dict:
    per: dict[str, dict] = {b: {"runs": [], "errors": []} for b in args.backends}
    order = list(args.backends)
    for r in range(args.repeats):
        rot = order[r % len(order):] + order[: r % len(order)]
        for b in rot:
            try:
                x = rule_start(args, workdir, b, n_ingress, n_egress)
                x["round"] = r + 1
                per[b]["runs"].append(x)
                log(f"    round {r + 1} {b:15} ready {x['ready_s'] * 1000:7.1f} ms, apply {x['last_apply_s'] * 1000:7.1f} ms, "
                    f"{x['rules_installed']:.0f} rule lines, applies {x['rule_applies']:.0f}, stop {x['stop_s'] * 1000 if x['stop_s'] else float('nan'):.0f} ms, log {x['phases_ms']}")
            except (Failed, subprocess.SubprocessError, OSError) as e:
                per[b]["errors"].append(f"round {r + 1}: {e}")
                log(f"    round {r + 1} {b:15} FAILED: {e}")
    rows = []
    for b, v in per.items():
        ready = [x["ready_s"] for x in v["runs"]]
        apply_ = [x["last_apply_s"] for x in v["runs"]]
        v["ready_s"], v["last_apply_s"] = ready, apply_
        if not v["runs"]:
            v["status"], v["met"] = "failed", None
            v["reason"] = "; ".join(v["errors"])[:500]
            continue
        v["status"] = "ok" if not v["errors"] else "partial"
        fig = med(ready) if key == "ready" else med(apply_)
        v["met"] = fig <= limit_s
        v["figure"] = (
            f"ready {spread(ready, 1e-3)} ms (apply {spread(apply_, 1e-3)} ms)"
            if key == "ready"
            else f"apply {spread(apply_, 1e-3)} ms (ready {spread(ready, 1e-3)} ms)"
        )
        rows.append(b)
    if not rows:
        raise Failed("every backend failed: " + "; ".join(f"{b}: {v.get('reason', '')}" for b, v in per.items()))
    return {"backends": per, "met": all(per[b]["met"] for b in rows) and len(rows) == len(per)}


CONNECT_PROBE = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
for _ in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3)
    t0 = time.monotonic()
    s.connect((host, port))
    out.append(time.monotonic() - t0)
    s.close()
print(" ".join(f"{x:.6f}" for x in out))
"""

SCALE_TARGET_A, SCALE_TARGET_B, SCALE_PORT = "10.77.0.10", "10.77.0.11", 7000


def scale_run(args, workdir: Path, backend: str, n_ports: int) -> dict:
    """Daemon b forwards n_ports ingress ports (10001.. -> INGRESS_TARGET:7000, a local listener)
    plus one moved Service (port 9999); daemon a is its tunnel peer and opens the connections."""
    mode, flavour = BACKENDS[backend]
    seq = REG.next_seq()
    ns = pair_ns(seq)
    server = None
    a = Tunnelgate(ns["a"], REG.name(seq, "a"), workdir)
    b = Tunnelgate(ns["b"], REG.name(seq, "b"), workdir)
    try:
        for ip in (SCALE_TARGET_A, SCALE_TARGET_B):
            nsx(ns["b"], "ip", "addr", "add", f"{ip}/32", "dev", REG.name(seq, "d"))
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns["b"], "python3", "-c",
             "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
             f"s.bind(('0.0.0.0',{SCALE_PORT}))\ns.listen(1024)\nwhile True:\n c,_=s.accept()\n c.close()"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        REG.procs.append(server)
        cfg_a = tg_config(a.ifname, a.keyfile, TUNNEL["a"], peer_block(b.pub, [f"{TUNNEL['b'][0]}/32", f"{TUNNEL['b'][1]}/128"], f"{UNDERLAY['b']}:{WG_PORT}"))
        peers_b = peer_block(a.pub, [f"{TUNNEL['a'][0]}/32", f"{TUNNEL['a'][1]}/128"], f"{UNDERLAY['a']}:{WG_PORT}")
        ports = ports_list(f"{p}:{SCALE_PORT}" for p in range(10001, 10001 + n_ports))
        bulk = f'[[ingress]]\ntarget = "{SCALE_TARGET_A}"\nports = {ports}\n\n'
        moved = lambda t: f'[[ingress]]\ntarget = "{t}"\nports = ["9999:{SCALE_PORT}"]\n\n'  # noqa: E731
        cfg_b = lambda t: tg_config(b.ifname, b.keyfile, TUNNEL["b"], peers_b, health=HEALTH, mode=mode, extra=bulk + moved(t))  # noqa: E731
        env = {"TUNNELGATE_IPTABLES": flavour} if flavour else {}
        a.start(cfg_a)
        ready = b.start(cfg_b(SCALE_TARGET_A), env, timeout=args.slow_timeout)
        m = b.metrics()
        r: dict = {"ports": n_ports, "ready_s": ready, "start_apply_s": metric_sum(m, "tunnelgate_rule_last_apply_duration_seconds")}
        # Connect latency through the DNAT: a fresh connection each time, to a port in the middle.
        probe_port = 10001 + n_ports // 2
        if not wait_for(lambda: nsx(ns["a"], "python3", "-c", CONNECT_PROBE, TUNNEL["b"][0], str(probe_port), "1", check=False, timeout=10).returncode == 0, 15, 0.3):
            raise Failed(f"no connection through the DNAT to {TUNNEL['b'][0]}:{probe_port}: {tail(b.logfile, 5)}")
        out = nsx(ns["a"], "python3", "-c", CONNECT_PROBE, TUNNEL["b"][0], str(probe_port), str(args.connects), timeout=120).stdout.split()
        r["connect_s"] = [float(x) for x in out]
        # One Service changes, in steady state: after the start's read-back of the table (the
        # drift baseline, which the daemon takes right after an apply and which shows as
        # tunnelgate_rules_installed > 0), so the change is not queued behind it.
        if not wait_for(lambda: metric_sum(b.metrics(), "tunnelgate_rules_installed") > 0, args.slow_timeout, 0.05):
            raise Failed(f"the start's rules were never read back: {tail(b.logfile, 5)}")
        b.config.write_text(cfg_b(SCALE_TARGET_B))
        t0 = time.monotonic()
        # The daemon's control socket is in its run directory (TUNNELGATE_RUN_DIR, see start()).
        nsx(ns["b"], Tunnelgate.binary, "reload", "--interface", b.ifname, timeout=args.slow_timeout,
            env={**os.environ, "TUNNELGATE_RUN_DIR": str(workdir)})
        r["change_reload_s"] = time.monotonic() - t0
        r["change_apply_s"] = metric_sum(b.metrics(), "tunnelgate_rule_last_apply_duration_seconds")
        if nsx(ns["a"], "python3", "-c", CONNECT_PROBE, TUNNEL["b"][0], "9999", "1", check=False, timeout=10).returncode != 0:
            raise Failed("the moved Service does not answer after the change")
        return r
    finally:
        a.stop()
        b.stop()
        if server is not None:
            REG.stop_proc(server)
        for x in ns.values():
            REG.del_ns(x)


def m_rules_scale(args, workdir: Path) -> dict:
    sizes = [int(x) for x in args.scale_sizes.split(",")]
    per: dict = {}
    for n in sizes:
        for bk in args.backends:
            key = f"{n}/{bk}"
            runs, errors = [], []
            for r in range(args.repeats):
                try:
                    x = scale_run(args, workdir, bk, n)
                    runs.append(x)
                    log(f"    {n:6} ports {bk:15} round {r + 1}: ready {x['ready_s'] * 1000:8.1f} ms (apply {x['start_apply_s'] * 1000:8.1f}), "
                        f"one-Service change {x['change_reload_s'] * 1000:7.1f} ms (apply {x['change_apply_s'] * 1000:7.1f}), "
                        f"connect median {med(x['connect_s']) * 1000:.3f} ms")
                except (Failed, subprocess.SubprocessError, OSError) as e:
                    errors.append(f"round {r + 1}: {e}")
                    log(f"    {n:6} ports {bk:15} round {r + 1}: FAILED: {e}")
            v: dict = {"runs": runs, "errors": errors, "status": "ok" if runs and not errors else ("partial" if runs else "failed")}
            if runs:
                v["ready_s"] = med([x["ready_s"] for x in runs])
                v["start_apply_s"] = med([x["start_apply_s"] for x in runs])
                v["change_reload_s"] = med([x["change_reload_s"] for x in runs])
                v["change_apply_s"] = med([x["change_apply_s"] for x in runs])
                v["connect_s"] = med([c for x in runs for c in x["connect_s"]])
                v["figure"] = (f"ready {v['ready_s'] * 1000:.0f} ms (apply {v['start_apply_s'] * 1000:.0f}), change {v['change_reload_s'] * 1000:.0f} ms "
                               f"(apply {v['change_apply_s'] * 1000:.1f}), connect {v['connect_s'] * 1000:.3f} ms")
                if n == 10000 and bk == "nftables":
                    v["met"] = v["start_apply_s"] <= 1.0 and v["change_apply_s"] <= 0.050
            else:
                v["reason"] = "; ".join(errors)[:500]
            per[key] = v
    if all(v["status"] == "failed" for v in per.values()):
        raise Failed("every size failed: " + "; ".join(f"{k}: {v.get('reason', '')}" for k, v in per.items())[:600])
    met = [v["met"] for v in per.values() if "met" in v]
    return {"sizes": per, "met": all(met) if met else None}


DNS_PROBE = r"""
import socket, struct, sys, random
name, server = sys.argv[1], sys.argv[2]
qid = random.randrange(65536)
q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1)
s.sendto(q, (server, 53))
r = s.recv(4096)
rid, flags, qd, an = struct.unpack(">HHHH", r[:8])
print(flags & 15, an)
sys.exit(0 if rid == qid and flags & 15 == 0 and an > 0 else 1)
"""


def iperf_run(ns: dict[str, str], duration: int) -> dict:
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns["b"], "iperf3", "-s", "-1", "-p", str(IPERF_PORT)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    REG.procs.append(server)
    try:
        if not wait_for(lambda: str(IPERF_PORT) in nsx(ns["b"], "ss", "-Hltn", f"sport = :{IPERF_PORT}", check=False).stdout, 5):
            raise Failed("iperf3 server did not start")
        p = nsx(
            ns["a"], "iperf3", "-c", TUNNEL["b"][0], "-p", str(IPERF_PORT), "-t", str(duration), "-J", "--connect-timeout", "5000",
            check=False, timeout=duration + 30,
        )  # fmt: skip
        try:
            j = json.loads(p.stdout)
        except json.JSONDecodeError:
            raise Failed(f"iperf3 exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()[:300]}")
        if "error" in j:
            raise Failed(f"iperf3: {j['error']}")
        end = j.get("end", {})
        intervals = [iv["sum"]["bits_per_second"] for iv in j.get("intervals", [])]
        return {
            "bps": end.get("sum_received", {}).get("bits_per_second"),
            "retransmits": end.get("sum_sent", {}).get("retransmits"),
            "interval_bps": intervals,
            "min_interval_bps": min(intervals) if intervals else None,
            "min_interval_bps_after_first": min(intervals[1:]) if len(intervals) > 1 else None,
        }
    finally:
        REG.stop_proc(server)


def m_reresolve(args, workdir: Path) -> dict:
    n_names = 100
    seq = REG.next_seq()
    ns = pair_ns(seq)
    dnsmasq = None
    try:
        hosts = workdir / "hosts"
        hosts.write_text("".join(f"10.77.{i // 200 + 1}.{i % 200 + 20} svc{i:03d}.{DOMAIN}\n10.77.{i // 200 + 3}.{i % 200 + 20} svc{i:03d}.{DOMAIN}\n" for i in range(n_names)))
        dnslog = workdir / "dnsmasq.log"
        with open(dnslog, "w") as out:
            dnsmasq = subprocess.Popen(
                ["ip", "netns", "exec", ns["b"], "dnsmasq", "--conf-file=/dev/null", "--user=root", "--no-daemon", "--no-resolv",
                 "--no-hosts", "--port=53", f"--listen-address={DNS_ADDR}", "--bind-interfaces", f"--addn-hosts={hosts}",
                 f"--local=/{DOMAIN}/", "--pid-file=", "--log-facility=-"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        REG.procs.append(dnsmasq)
        probe = lambda: nsx(ns["b"], "python3", "-c", DNS_PROBE, f"svc099.{DOMAIN}", DNS_ADDR, check=False, timeout=5).returncode == 0  # noqa: E731
        if not wait_for(lambda: dnsmasq.poll() is not None or probe(), 10, 0.2) or dnsmasq.poll() is not None:
            raise Failed(f"dnsmasq did not answer: {tail(dnslog)}")

        a = Tunnelgate(ns["a"], REG.name(seq, "a"), workdir)
        b = Tunnelgate(ns["b"], REG.name(seq, "b"), workdir)
        cfg_a = tg_config(a.ifname, a.keyfile, TUNNEL["a"], peer_block(b.pub, [f"{TUNNEL['b'][0]}/32", f"{TUNNEL['b'][1]}/128"], f"{UNDERLAY['b']}:{WG_PORT}"))
        dns = f'[dns]\nnameservers = ["{DNS_ADDR}"]\nreresolve_interval = "1s"\n\n'
        fqdn = "".join(f'[[ingress]]\ntarget_fqdn = "svc{i:03d}.{DOMAIN}"\nports = ["{30001 + i}"]\n\n' for i in range(n_names))
        peers_b = peer_block(a.pub, [f"{TUNNEL['a'][0]}/32", f"{TUNNEL['a'][1]}/128"], f"{UNDERLAY['a']}:{WG_PORT}")
        cfgs = {
            "without": tg_config(b.ifname, b.keyfile, TUNNEL["b"], peers_b, health=HEALTH, mode="nftables", extra=dns),
            "with": tg_config(b.ifname, b.keyfile, TUNNEL["b"], peers_b, health=HEALTH, mode="nftables", extra=fqdn + dns),
        }
        runs: dict[str, list] = {"without": [], "with": []}
        errors = []
        for r in range(args.repeats):
            for variant in ("without", "with"):
                try:
                    x = reresolve_run(args, ns, a, b, cfg_a, cfgs[variant], variant, n_names)
                    x["round"] = r + 1
                    runs[variant].append(x)
                    log(f"    round {r + 1} {variant:7}: {x['bps'] / 1e9:.3f} Gbit/s, min 1-s interval {x['min_interval_bps_after_first'] / 1e9:.3f} "
                        f"(first {x['interval_bps'][0] / 1e9:.3f}), retr {x['retransmits']}, resolutions +{x['resolutions_during']:.0f} "
                        f"(failed +{x['resolution_failures_during']:.0f}), rule applies +{x['rule_applies_during']:.0f}, B CPU {x['cpu_b_s']:.2f} s")
                except (Failed, subprocess.SubprocessError, OSError) as e:
                    errors.append(f"round {r + 1} {variant}: {e}")
                    log(f"    round {r + 1} {variant:7}: FAILED: {e}")
                finally:
                    a.stop()
                    b.stop()
        if not runs["with"] or not runs["without"]:
            raise Failed("; ".join(errors)[:600] or "no runs")
        mw = med([x["bps"] for x in runs["with"]])
        mo = med([x["bps"] for x in runs["without"]])
        min_with = min(x["min_interval_bps_after_first"] for x in runs["with"])
        min_without = min(x["min_interval_bps_after_first"] for x in runs["without"])
        res = [x["resolutions_during"] for x in runs["with"]]
        resolved = all(v >= n_names for v in res)
        met = resolved and min_with >= 0.5 * mo
        return {
            "figure": f"with/without {mw / mo:.2f} ({mw / 1e9:.3f}/{mo / 1e9:.3f} Gbit/s); min 1-s {min_with / 1e9:.3f}/{min_without / 1e9:.3f}; "
            f"resolutions per run {spread(res, 1, '{:.0f}')}",
            "met": met,
            "criterion": "every 1-s interval (after the first) of the runs with names >= 50 % of the median without, and >= 100 resolutions in each run",
            "median_bps": {"with": mw, "without": mo},
            "ratio": mw / mo,
            "min_interval_bps_after_first": {"with": min_with, "without": min_without},
            "resolutions_during": res,
            "errors": errors,
            "runs": runs,
        }
    finally:
        if dnsmasq is not None:
            REG.stop_proc(dnsmasq)
        for x in ns.values():
            REG.del_ns(x)


def reresolve_run(args, ns, a: Tunnelgate, b: Tunnelgate, cfg_a: str, cfg_b: str, variant: str, n_names: int) -> dict:
    a.start(cfg_a)
    ready_b = b.start(cfg_b, timeout=args.slow_timeout)
    extra: dict = {}
    if variant == "with":
        last = [0, ""]

        def names_ready() -> bool:
            last[:] = readyz(ns["b"])
            return last[0] == 200

        t0 = time.monotonic()
        if not wait_for(names_ready, 20, 0.02):
            raise Failed(f"B not ready (every name resolved) within 20 s: /readyz {last[0]} {last[1][:200]}")
        t_ready = time.monotonic()
        m = b.metrics()
        extra["readyz_200_after_s"] = t_ready - t0
        extra["at_readyz_200"] = {
            "rule_applies": metric_sum(m, "tunnelgate_rule_applies_total"),
            "rules_installed": metric_sum(m, "tunnelgate_rules_installed"),
        }
        # The start applies the rules without the names; the first answers make a second apply.
        # Measure steady-state re-resolution only: wait for that apply before the traffic.
        if not wait_for(lambda: metric_sum(b.metrics(), "tunnelgate_rule_applies_total") >= 2, 20, 0.02):
            raise Failed("B never applied the rules for the resolved names (rule_applies_total < 2 after 20 s)")
        m = b.metrics()
        extra["name_rules_applied_after_readyz_s"] = time.monotonic() - t_ready
        extra["after_name_apply"] = {
            "rule_applies": metric_sum(m, "tunnelgate_rule_applies_total"),
            "rules_installed": metric_sum(m, "tunnelgate_rules_installed"),
            "last_apply_s": metric_sum(m, "tunnelgate_rule_last_apply_duration_seconds"),
        }
    if not wait_for(lambda: ping_once(ns["a"], TUNNEL["b"][0]), 15, 0.2):
        raise Failed("no ping reply through the tunnel within 15 s")
    m0 = b.metrics()
    cpu0 = cpu_ticks(b.pid)
    it = iperf_run(ns, args.duration)
    cpu1 = cpu_ticks(b.pid)
    m1 = b.metrics()
    if not b.alive():
        raise Failed(f"B exited during the run: {tail(b.logfile)}")
    d = lambda name: metric_sum(m1, name) - metric_sum(m0, name)  # noqa: E731
    it.update(
        ready_b_s=ready_b,
        resolutions_during=d("tunnelgate_dns_resolutions_total"),
        resolution_failures_during=d("tunnelgate_dns_resolution_failures_total"),
        rule_applies_during=d("tunnelgate_rule_applies_total"),
        names_tracked=sum(1 for k in m1 if k.startswith("tunnelgate_dns_resolutions_total{")),
        cpu_b_s=(cpu1 - cpu0) / CLK_TCK if cpu0 is not None and cpu1 is not None else None,
        memory_b=b.memory(),
        **extra,
    )
    return it


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def table(results: dict) -> str:
    rows = [("measurement", "figure", "target", "met?")]
    ms = results["measurements"]

    def add(label: str, m: dict | None, target: str, figure: str | None = None, met=None):
        if m is None:
            return
        if m.get("status") == "failed":
            rows.append((label, f"FAILED: {m.get('reason', '')[:160]}", target, "-"))
        else:
            rows.append((label, figure if figure is not None else m.get("figure", "-"), target, "-" if met is None else ("yes" if met else "NO")))

    add("idle RSS, 1 peer (median of both daemons)", ms.get("idle_rss"), TARGETS["idle_rss"], met=ms.get("idle_rss", {}).get("met"))
    add("RSS, 10,000 peers (after ready + 2 s)", ms.get("rss_10k_peers"), TARGETS["rss_10k_peers"], met=ms.get("rss_10k_peers", {}).get("met"))
    for key, label, tgt in (("start_ready_100", "start -> READY=1, 100 ports", TARGETS["start_ready_100"]), ("apply_1000", "apply 1,000 ports (gauge)", TARGETS["apply_1000"])):
        m = ms.get(key)
        if m is None:
            continue
        if m.get("status") == "failed":
            add(label, m, tgt)
            continue
        for b, v in m["backends"].items():
            if v["status"] == "failed":
                rows.append((f"{label}, {b}", f"FAILED: {v.get('reason', '')[:160]}", tgt, "-"))
            else:
                rows.append((f"{label}, {b}", v["figure"], tgt, "yes" if v["met"] else "NO"))
    add("iperf3 TCP while re-resolving 100 names/s", ms.get("reresolve_100"), TARGETS["reresolve_100"], met=ms.get("reresolve_100", {}).get("met"))
    scale = ms.get("rules_scale")
    if scale is not None and scale.get("status") == "failed":
        add("port rules at scale", scale, TARGETS["rules_scale"])
    elif scale is not None:
        for k, v in scale["sizes"].items():
            fig = v.get("figure") or f"FAILED: {v.get('reason', '')[:160]}"
            rows.append((f"{k.replace('/', ' ports, ')}", fig, TARGETS["rules_scale"] if "met" in v else "-", "-" if "met" not in v else ("yes" if v["met"] else "NO")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    widths[1] = min(widths[1], 110)
    rows = [(r[0], r[1] if len(r[1]) <= widths[1] else r[1][: widths[1] - 1] + "…", r[2], r[3]) for r in rows]
    out = []
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if r is rows[0]:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def binary_facts(path: str) -> dict:
    try:
        st = os.stat(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        ver = run([path, "--version"], check=False).stdout.strip()
        return {
            "path": path,
            "version": ver,
            "sha256": h.hexdigest()[:16],
            "mtime": dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc).isoformat(timespec="seconds"),
            "size_bytes": st.st_size,
        }
    except OSError as e:
        return {"path": path, "error": str(e)}


MEASUREMENTS = ("idle_rss", "rss_10k_peers", "start_ready_100", "apply_1000", "reresolve_100", "rules_scale")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tunnelgate", default=str(REPO / "target" / "release" / "tunnelgate"), help="tunnelgate binary (default %(default)s; never built here)")
    ap.add_argument("--repeats", type=int, default=5, help="starts per backend / RSS rounds / with+without iperf3 pairs (default 5)")
    ap.add_argument("--quick", action="store_true", help="2 repeats, 1 start with 10,000 peers, 5 s iperf3 runs")
    ap.add_argument("--duration", type=int, default=10, help="seconds per iperf3 run (default 10)")
    ap.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated subset of: {', '.join(MEASUREMENTS)}")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"firewall variants for start/apply (default: {', '.join(BACKENDS)})")
    add_output_args(ap, "control")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs and configs")
    ap.add_argument("--scale-sizes", default=None, help="rules_scale: comma-separated port counts (default 100,1000,10000,50000; --quick 100,1000)")
    ap.add_argument("--connects", type=int, default=50, help="rules_scale: new connections timed per run (default 50)")
    args = ap.parse_args()
    if args.scale_sizes is None:
        args.scale_sizes = "100,1000" if args.quick else "100,1000,10000,50000"
    args.repeats = max(1, args.repeats)
    if args.quick:
        args.repeats, args.duration = 2, 5
    args.repeats_10k = 1 if args.quick else min(args.repeats, 3)
    args.slow_timeout = 120.0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := [s for s in only if s not in MEASUREMENTS]:
        ap.error(f"unknown measurement(s) {unknown}; known: {', '.join(MEASUREMENTS)}")
    args.backends = [s.strip() for s in args.backends.split(",") if s.strip()]
    if unknown := [s for s in args.backends if s not in BACKENDS]:
        ap.error(f"unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces): run benches/control/run.sh as root")
    missing = [t for t in ("ip", "wg", "ping", "ss", "curl", "iperf3", "dnsmasq", "nft") if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)} (benches/control/run.sh installs them)")
    try:
        out = results_path(args, "control")
    except Failed as e:
        ap.error(str(e))

    # Explicitly: a shell starts background jobs with SIGINT ignored, and Python keeps that.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="tgcb-"))
    workdir.chmod(0o700)
    Tunnelgate.binary = args.tunnelgate
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "loadavg_start": open("/proc/loadavg").read().split()[:3],
            "repeats": args.repeats,
            "repeats_10k_peers": args.repeats_10k,
            "iperf_duration_s": args.duration,
            "quick": args.quick,
            "mb": "2^20 bytes",
            "tunnelgate": binary_facts(args.tunnelgate),
            "versions": {
                "iperf3": run(["iperf3", "--version"], check=False).stdout.strip().splitlines()[0],
                "nft": run(["nft", "--version"], check=False).stdout.strip(),
                "iptables": run(["iptables", "--version"], check=False).stdout.strip(),
                "dnsmasq": run(["dnsmasq", "--version"], check=False).stdout.strip().splitlines()[0],
            },
            "targets": TARGETS,
        },
        "measurements": {},
    }
    load1 = float(results["meta"]["loadavg_start"][0])
    if load1 > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load1} before the benchmark: other work will skew the figures")
    interrupted = False
    try:
        sweep_stale()
        if not os.access(args.tunnelgate, os.X_OK):
            raise Failed(f"no tunnelgate binary at {args.tunnelgate}")
        seq = REG.next_seq()
        ns = single_ns(seq)
        base = spawn_baseline(ns)
        REG.del_ns(ns)
        results["meta"]["ip_netns_exec_true_s"] = base
        log(f"==> floor: `ip netns exec NS true` spawn to exit {statistics.median(base) * 1000:.1f} ms (median of {len(base)})")
        funcs = {
            "idle_rss": lambda: m_idle_rss(args, workdir),
            "rss_10k_peers": lambda: m_rss_10k(args, workdir),
            "start_ready_100": lambda: m_rules(args, workdir, 100, 0, "ready", 0.200),
            "apply_1000": lambda: m_rules(args, workdir, 500, 500, "apply", 1.0),
            "reresolve_100": lambda: m_reresolve(args, workdir),
            "rules_scale": lambda: m_rules_scale(args, workdir),
        }
        for name in only:
            log(f"==> {name} (target {TARGETS[name]})")
            t0 = time.monotonic()
            try:
                r = funcs[name]()
                r["status"] = "ok"
            except (Failed, subprocess.SubprocessError, OSError) as e:
                r = {"status": "failed", "reason": str(e)}
                log(f"    {name} FAILED: {e}")
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - a bug in one measurement must not stop the others
                r = {"status": "failed", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                log(traceback.format_exc())
            r["target"] = TARGETS[name]
            r["wall_s"] = round(time.monotonic() - t0, 1)
            results["measurements"][name] = r
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Failed as e:
        interrupted = True
        log(f"cannot run: {e}")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        REG.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep_logs:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    results["meta"]["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["meta"]["interrupted"] = interrupted
    results["meta"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    after = binary_facts(args.tunnelgate)
    if after.get("sha256") != results["meta"]["tunnelgate"].get("sha256"):
        results["meta"]["tunnelgate_changed_during_run"] = after
        log("warning: the tunnelgate binary changed during the run (rebuilt?): the figures may mix two builds")
    if interrupted:  # never replace complete figures with a partial run
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    m = results["meta"]
    print(
        f"\ncontrol-plane benchmark: commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, "
        f"load {' '.join(m['loadavg_start'])} at start, {m['repeats']} repeat(s)"
    )
    print("medians (min–max); MB = 2^20 bytes; start times are spawn of `ip netns exec` -> READY=1 datagram\n")
    print(table(results))
    print(f"\nresults: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
