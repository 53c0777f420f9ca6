#!/usr/bin/env python3
"""Flood benchmark: how much of its CPU a tunnelgate UDP reader at real-time priority leaves to a
normal-priority neighbour while it is flooded, and what the flood costs the tunnel.

Four namespaces: a client (tunnelgate, the established peer), the proxy (the tunnelgate under test,
one worker), a flooder and a joiner (a new wireguard-go peer), joined to the proxy by veth pairs:

    client 10.97.0.2 --- 10.97.0.1 proxy 10.96.0.1 --- 10.96.0.2.. flooder (--sources addresses)
    tunnel 10.100.0.1             tunnel 10.100.0.2
                                        10.98.0.1 --- 10.98.0.2 joiner, tunnel 10.100.0.3

The proxy's UDP reader (tg-udp-rx-0) is pinned to the first CPU (taskset on that thread), and so is
a busy loop at normal priority (the neighbour); everything else (the proxy's other threads, the
client, the flood generators, this script) runs on the other CPUs. Floods, from the flooder to the
proxy's port:

  init    handshake initiations with a valid mac1 (anyone can compute it from the public key)
  init2   the same with a valid mac2, from sources that fetched and opened a cookie each
  data    data messages to receiver indices nobody holds
  cookie  cookie replies to receiver indices nobody holds

First, per flood, the reader's capacity: offered rates doubling (no neighbour) until the proxy's
socket drops more than 2 % of what was offered; the capacity is the rate the reader then took in.
Then, per flood, at rates around it (--rates, fractions of the capacity), with the readers at the
default real-time priority and again with TUNNELGATE_RT_PRIORITY=0 (a fresh daemon each), for
DURATION s: the neighbour's loop rate against the same loop with no flood (a window just before)
and its longest stall, the reader's CPU share and the fraction of 10 ms samples (/proc) in which
it was at SCHED_FIFO, the proxy's socket drops, what the generator sent and got back, the
established peer's ping (every 10 ms), and in the init and init2 windows the time a new
wireguard-go peer, given the proxy as its peer 1.5 s into the flood, takes to complete its
handshake. Then the GRO-sized floods (--bound-floods, unpaced, --bound-gso datagrams per send: a
receive batch of 64 x 64), against the real-time bound; and, at real-time priority, an iperf3
stream through the tunnel without and with each flood (stream kept = the ratio).

Usage: benches/flood/run.sh [--quick] [--rounds N] [--duration S] [--floods init,init2] [--out FILE | --publish]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from benchproc import (  # noqa: E402
    terminate_process,
    CLK_TCK, PID, REPO, CommandFailed, Daemon, ThreadSampler, add_ns, add_output_args, build_release_tunnelgate, genkey, git_commit, kill_ns, log,
    WG_SOCKET_DIR, iperf3_server, nsx, process_facts, raise_on_signals, results_path, run, stop_process, sweep_stale, tail, thread_sched,
    threads_named, wait_for,
)

GEN = HERE / "floodgen.py"
NS_PREFIX = "tgflood"  # tgflood<pid><c|p|f>
IF_PREFIX = "tf"  # tf<pid><c|p>, veths tf<pid>v<x>
ADDR = {"c": "10.97.0.2", "pc": "10.97.0.1", "pf": "10.96.0.1", "f": "10.96.0.2", "pj": "10.98.0.1", "j": "10.98.0.2"}
TUNNEL = {"c": "10.100.0.1", "p": "10.100.0.2", "j": "10.100.0.3"}
PORT = 51820
SINK_PORT = 9999
STREAM_PORT = 5201
# The decoy: the same generator at the same rate, to an address behind a veth into a namespace of
# its own whose ingress hook drops everything at once (this kernel has no dummy device). The
# stream's control window: the generator takes its CPU as in the flood window, and nothing
# reaches the proxy.
DECOY_NET, DECOY_TARGET = "198.18.0.1/24", "198.18.0.2"
# The joining peer: it is given the proxy's endpoint JOIN_AT s into a flood window, which then
# runs on for at least JOIN_WINDOW s: its first initiation, a cookie reply, and its first retry
# REKEY_TIMEOUT (5 s) plus up to 1/3 s of jitter later. It is waited for JOIN_LIMIT s in all
# (the flood over or not: two more retries).
JOIN_FLOODS = ("init", "init2")  # the floods whose windows a new peer joins in
JOIN_AT = 1.5
JOIN_WINDOW = 6.5
JOIN_LIMIT = 16.0
REKEY_TIMEOUT = 5.0
# The real-time bound (docs/security.md "Real-time priority, and its bound"): the burst and the
# longest batch the property tests allow (4,096 datagrams with GRO), and the unauthenticated share.
BURST_MS = 10.0
BATCH_MS_MAX = 20.0
UNAUTHENTICATED_SHARE = 0.25
# The reader's capacity before handshakes had their own path (results/2026-11-27-0a05297.json:
# initiations with a valid mac1, where the proxy's socket dropped more than 2 %): the rates the
# flood targets name ("1x and 2x the old reader's capacity").
OLD_CAPACITY = {"init": 600860, "init2": 600860}
FLOODS = ("init", "init2", "data", "cookie")
MODES = {"rt": {}, "normal": {"TUNNELGATE_RT_PRIORITY": "0"}}
PING_INTERVAL = 0.01
DROP_LIMIT = 0.02  # the ramp stops where the proxy's socket drops more than this share of the offer


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


def udp_drops(ns: str, port: int) -> int:
    """Drops counted on the UDP sockets bound to `port` in `ns` (/proc/net/udp and udp6, the last
    column: the socket's receive buffer was full)."""
    p = nsx(ns, "cat", "/proc/net/udp", "/proc/net/udp6", check=False)
    total = 0
    for line in p.stdout.splitlines():
        f = line.split()
        if len(f) >= 13 and ":" in f[1] and f[0].endswith(":") and int(f[1].rsplit(":", 1)[1], 16) == port:
            total += int(f[12])
    return total


class Tg(Daemon):
    kind = "tunnelgate"

    def start_tg(self, binary: str, config: str, env: dict[str, str]) -> None:
        path = self.workdir / f"{self.ifname}.toml"
        path.write_text(config)
        self.spawn([binary, "run", "--config", str(path)], {"RUST_LOG": os.environ.get("RUST_LOG", "warn"), **env})
        self.wait_configured()


def tg_config(ifname: str, keyfile: Path, addr: str, peers: list[tuple[str, str | None, str]], workers: int) -> str:
    """A tunnelgate config; `peers` are (public key, endpoint or None, allowed address)."""
    blocks = []
    for pub, endpoint, allowed in peers:
        ep = f'endpoint = "{endpoint}"\npersistent_keepalive = 5\n' if endpoint else ""
        blocks.append(f'[[peer]]\npublic_key = "{pub}"\n{ep}allowed_ips = ["{allowed}/32"]\n')
    peer_text = "\n".join(blocks)
    return f"""# written by benches/flood/bench.py
[interface]
name = "{ifname}"
private_key_file = "{keyfile}"
listen_port = {PORT}
addresses = ["{addr}/32"]
mtu = 1420
workers = {workers}

{peer_text}
[health]
listen = ""
"""


class Rig:
    """The three namespaces and two daemons; `start(mode_env)` starts the daemons afresh."""

    def __init__(self, workdir: Path, binary: str, workers: int, reader_cpu: int, other_cpus: str, extra_env: dict[str, str]):
        self.workdir, self.binary, self.workers = workdir, binary, workers
        self.reader_cpu, self.other_cpus, self.extra_env = reader_cpu, other_cpus, extra_env
        self.ns = {k: f"{NS_PREFIX}{PID}{k}" for k in "cpfjx"}
        self.created: list[str] = []
        # j: the joining peer, which the proxy's config lists from the start.
        self.keys = {k: genkey() for k in "cpj"}
        self.daemons: dict[str, Tg] = {}
        self.reader_tid: int | None = None

    def build(self) -> None:
        for k in "cpfjx":
            add_ns(self.ns[k])
            self.created.append(self.ns[k])
        for other, mine, theirs in (("c", "pc", "c"), ("f", "pf", "f"), ("j", "pj", "j")):
            vp, vo = f"{IF_PREFIX}{PID}v{other}p", f"{IF_PREFIX}{PID}v{other}"
            run(["ip", "link", "add", vp, "netns", self.ns["p"], "type", "veth", "peer", "name", vo, "netns", self.ns[other]])
            nsx(self.ns["p"], "ip", "addr", "add", f"{ADDR[mine]}/24", "dev", vp)
            nsx(self.ns[other], "ip", "addr", "add", f"{ADDR[theirs]}/24", "dev", vo)
            nsx(self.ns["p"], "ip", "link", "set", vp, "up")
            nsx(self.ns[other], "ip", "link", "set", vo, "up")
        # The flood's source addresses, each its own sender to the proxy (and, for init2, each
        # with a cookie of its own).
        vf = f"{IF_PREFIX}{PID}vf"
        for a in flood_sources():
            nsx(self.ns["f"], "ip", "addr", "add", f"{a}/24", "dev", vf)
        # x: the decoy, reached from f by a veth whose far end drops every frame at ingress.
        vd, vx = f"{IF_PREFIX}{PID}vd", f"{IF_PREFIX}{PID}vx"
        run(["ip", "link", "add", vd, "netns", self.ns["f"], "type", "veth", "peer", "name", vx, "netns", self.ns["x"]])
        nsx(self.ns["f"], "ip", "addr", "add", DECOY_NET, "dev", vd)
        nsx(self.ns["f"], "ip", "link", "set", vd, "up")
        nsx(self.ns["x"], "ip", "link", "set", vx, "up")
        mac = json.loads(nsx(self.ns["x"], "ip", "-j", "link", "show", vx).stdout)[0]["address"]
        nsx(self.ns["f"], "ip", "neigh", "replace", DECOY_TARGET, "lladdr", mac, "dev", vd, "nud", "permanent")
        nsx(self.ns["x"], "nft", "-f", "-", input=f"table netdev decoy {{\n chain in {{\n  type filter hook ingress device {vx} priority 0; policy drop;\n }}\n}}\n")

    def start(self, env: dict[str, str]) -> None:
        self.stop()
        for k in "cp":
            key, _ = self.keys[k]
            keyfile = self.workdir / f"{k}.key"
            keyfile.write_text(key + "\n")
            keyfile.chmod(0o600)
        c = Tg(self.ns["c"], f"{IF_PREFIX}{PID}c", self.workdir)
        p = Tg(self.ns["p"], f"{IF_PREFIX}{PID}p", self.workdir)
        c.cpus = p.cpus = self.other_cpus
        p.start_tg(self.binary, tg_config(p.ifname, self.workdir / "p.key", TUNNEL["p"],
                                          [(self.keys["c"][1], None, TUNNEL["c"]), (self.keys["j"][1], None, TUNNEL["j"])], self.workers),
                   {**self.extra_env, **env})
        c.start_tg(self.binary, tg_config(c.ifname, self.workdir / "c.key", TUNNEL["c"], [(self.keys["p"][1], f"{ADDR['pc']}:{PORT}", TUNNEL["p"])], 1),
                   self.extra_env)
        self.daemons = {"c": c, "p": p}
        if not wait_for(lambda: nsx(self.ns["c"], "ping", "-c", "1", "-W", "1", TUNNEL["p"], check=False).returncode == 0, 15, 0.2):
            raise CommandFailed(f"no ping through the tunnel within 15 s: {tail(p.logfile, 5)} {tail(c.logfile, 5)}")
        readers = {tid: n for tid, n in threads_named(p.pid, ("tg-udp-rx-",)).items()}
        if len(readers) != 1:
            raise CommandFailed(f"expected one UDP reader in the proxy (workers = {self.workers}), found {sorted(readers.values())}")
        self.reader_tid = next(iter(readers))
        run(["taskset", "-p", "-c", str(self.reader_cpu), str(self.reader_tid)])

    def stop(self) -> None:
        for d in self.daemons.values():
            d.stop()
        self.daemons = {}

    def teardown(self) -> None:
        self.stop()
        for ns in self.created:
            kill_ns(ns)
        self.created.clear()

    @property
    def proxy(self) -> Tg:
        return self.daemons["p"]

    def drop_counters(self) -> dict[str, int]:
        """The proxy's drop counters by reason (`tunnelgate status --json`)."""
        p = run([self.binary, "status", "--json", "--interface", self.proxy.ifname], check=False, timeout=10)
        try:
            j = json.loads(p.stdout)
        except json.JSONDecodeError:
            return {}
        j = j[0] if isinstance(j, list) and j else j
        drops = find_key(j, "drops")
        return {k: v for k, v in drops.items() if isinstance(v, int)} if isinstance(drops, dict) else {}


def find_key(j, key: str):
    if isinstance(j, dict):
        if key in j:
            return j[key]
        for v in j.values():
            r = find_key(v, key)
            if r is not None:
                return r
    elif isinstance(j, list):
        for v in j:
            r = find_key(v, key)
            if r is not None:
                return r
    return None


GSO = [8]  # messages per send (--gso)
SOURCES = [8]  # flood source addresses (--sources)


def flood_sources() -> list[str]:
    """The flooder's source addresses: 10.96.0.10 and up, in the proxy's /24."""
    return [f"10.96.0.{10 + i}" for i in range(SOURCES[0])]


def start_gens(rig: Rig, kind: str, rate: float, seconds: float, procs: int, size: int, target: str | None = None,
               gso: int | None = None) -> list[subprocess.Popen]:
    to = target or f"{ADDR['pf']}:{PORT}"
    gso = gso or GSO[0]
    per = rate / procs if rate > 0 else 0
    sources = flood_sources()
    # Each generator process sends from its share of the sources, in turn.
    shares = [",".join(sources[i::procs]) for i in range(procs)]
    return [subprocess.Popen(["ip", "netns", "exec", rig.ns["f"], "env", f"GEN_SOURCES={shares[i]}", "taskset", "-c", rig.other_cpus,
                              sys.executable, str(GEN), "gen", kind, to, rig.keys["p"][1], str(per), str(seconds), str(size), str(gso)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
            for i in range(procs)]


def gens_result(gens: list[subprocess.Popen], seconds: float) -> dict:
    outs = []
    for g in gens:
        out, err = g.communicate(timeout=seconds + 30)
        try:
            outs.append(json.loads(out.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            raise CommandFailed(f"flood generator exited {g.returncode}: {err.strip()[-300:]}")
        if "error" in outs[-1]:
            raise CommandFailed(f"flood generator: {outs[-1]['error']}")
    sent = sum(o["sent"] for o in outs)
    wall = max(o["seconds"] for o in outs)
    return {"sent": sent, "pps": round(sent / wall) if wall else 0, "replies": sum(o["replies"] for o in outs),
            "send_errors": sum(o["send_errors"] for o in outs), "procs": len(outs), "bytes": outs[0]["bytes"], "gso": outs[0]["gso"]}


def generator_ceiling(rig: Rig, kind: str, seconds: float, procs: int, size: int) -> dict:
    """What the generator sends when unpaced, to a port in the proxy's namespace nobody reads."""
    sink = subprocess.Popen(["ip", "netns", "exec", rig.ns["p"], "taskset", "-c", rig.other_cpus, sys.executable, str(GEN), "sink", str(SINK_PORT), str(seconds + 5)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, stdin=subprocess.DEVNULL)
    try:
        if not sink.stdout or sink.stdout.readline().strip() != "listening":
            raise CommandFailed("the sink did not start")
        # The sink answers nothing, so it hands out no cookie: init2's messages are init's size.
        sink_kind = "init" if kind == "init2" else kind
        return gens_result(start_gens(rig, sink_kind, 0, seconds, procs, size, f"{ADDR['pf']}:{SINK_PORT}"), seconds)
    finally:
        sink.kill()
        sink.wait()


def reader_cpu_ns(rig: Rig) -> int:
    s = thread_sched(rig.proxy.pid, rig.reader_tid) if rig.reader_tid else None
    return s[3] if s else 0


def ramp(rig: Rig, kind: str, step_s: float, procs: int, size: int, ceiling: float) -> dict:
    """Offered rates doubling from 5,000/s until the proxy's socket drops more than DROP_LIMIT of
    the offer, or the generator cannot send what is asked; no neighbour."""
    steps = []
    rate = 5000.0
    capacity = None
    while True:
        d0, c0, t0 = udp_drops(rig.ns["p"], PORT), reader_cpu_ns(rig), time.monotonic()
        g = gens_result(start_gens(rig, kind, rate, step_s, procs, size), step_s)
        time.sleep(0.2)
        drops = udp_drops(rig.ns["p"], PORT) - d0
        wall = time.monotonic() - t0
        step = {"offered_pps": rate, "sent_pps": g["pps"], "socket_drops": drops, "drop_fraction": round(drops / max(1, g["sent"]), 4),
                "taken_pps": round((g["sent"] - drops) / step_s), "reader_cpu_share": round((reader_cpu_ns(rig) - c0) / 1e9 / wall, 3), "replies": g["replies"]}
        steps.append(step)
        log(f"    ramp {kind} {rate:>9.0f}/s: sent {g['pps']}/s, socket drops {step['drop_fraction'] * 100:.1f} %, reader CPU {step['reader_cpu_share'] * 100:.0f} %")
        if step["drop_fraction"] > DROP_LIMIT:
            capacity = {"pps": step["taken_pps"], "by": "socket drops"}
            break
        if g["pps"] < 0.9 * rate or rate * 2 > ceiling * 1.05:
            capacity = {"pps": g["pps"], "by": "the generator's ceiling (the reader kept up)"}
            break
        rate *= 2
    return {"steps": steps, "capacity": capacity}


def ping_start(rig: Rig, seconds: float, dst: str = TUNNEL["p"], interval: float = PING_INTERVAL) -> subprocess.Popen:
    count = max(1, int(seconds / interval))
    return subprocess.Popen(["ip", "netns", "exec", rig.ns["c"], "ping", "-n", "-i", str(interval), "-c", str(count), "-W", "1", dst],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def ping_result(p: subprocess.Popen, seconds: float) -> dict:
    out, _ = p.communicate(timeout=seconds + 30)
    rtts = [float(m) for m in re.findall(r"time=([\d.]+) ms", out)]
    sent = re.search(r"(\d+) packets transmitted", out)
    n = int(sent.group(1)) if sent else 0
    return {"sent": n, "lost": max(0, n - len(rtts)), "p50_ms": percentile(rtts, 50), "p99_ms": percentile(rtts, 99), "max_ms": max(rtts) if rtts else None}


class Joiner:
    """A new peer: Debian's wireguard-go (what a user's peer runs) in its own namespace, behind a
    veth of its own to the proxy, with its own key, which the proxy's config lists from the start.
    `start()` brings its interface up with no peer; `join()` gives it the proxy as its peer (endpoint,
    allowed IPs, persistent keepalive 1 s: wireguard-go sends a keepalive at once, which starts the
    handshake); `result()` waits for the handshake. Its verbose log, read as it comes with this
    process's clock, says when it sent each initiation and got each cookie reply."""

    def __init__(self, rig: Rig):
        self.rig = rig
        self.ifname = f"{IF_PREFIX}{PID}j"
        self.ns = rig.ns["j"]
        self.proc: subprocess.Popen | None = None
        self.lines: list[tuple[float, str]] = []
        self.joined = 0.0
        self.reader = None

    def start(self) -> None:
        import threading

        self.stop()
        self.lines = []
        self.joined = 0.0
        env = dict(os.environ, LOG_LEVEL="verbose", WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD="1")
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, "taskset", "-c", self.rig.other_cpus, "wireguard-go", "-f", self.ifname],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)

        def read(out) -> None:
            for line in out:
                self.lines.append((time.monotonic(), line.rstrip()))

        self.reader = threading.Thread(target=read, args=(self.proc.stdout,), daemon=True)
        self.reader.start()
        sock = WG_SOCKET_DIR / f"{self.ifname}.sock"
        if not wait_for(lambda: sock.exists() or self.proc.poll() is not None, 10) or self.proc.poll() is not None:
            raise CommandFailed(f"wireguard-go did not start: {' | '.join(l for _, l in self.lines[-5:])}")
        keyfile = self.rig.workdir / "j.key"
        keyfile.write_text(self.rig.keys["j"][0] + "\n")
        keyfile.chmod(0o600)
        nsx(self.ns, "wg", "set", self.ifname, "private-key", str(keyfile))
        nsx(self.ns, "ip", "addr", "add", f"{TUNNEL['j']}/32", "dev", self.ifname)
        nsx(self.ns, "ip", "link", "set", "dev", self.ifname, "mtu", "1420", "up")
        nsx(self.ns, "ip", "route", "add", f"{TUNNEL['p']}/32", "dev", self.ifname)

    def join(self) -> None:
        self.joined = time.monotonic()
        nsx(self.ns, "wg", "set", self.ifname, "peer", self.rig.keys["p"][1], "endpoint", f"{ADDR['pj']}:{PORT}",
            "allowed-ips", f"{TUNNEL['p']}/32", "persistent-keepalive", "1")

    def _events(self) -> dict[str, list[float]]:
        ev: dict[str, list[float]] = {"initiation": [], "cookie": [], "response": []}
        for t, line in list(self.lines):
            if "Sending handshake initiation" in line:
                ev["initiation"].append(t)
            elif "Receiving cookie response" in line:
                ev["cookie"].append(t)
            elif "Received handshake response" in line:
                ev["response"].append(t)
        return ev

    def result(self, flood_end: float) -> dict:
        """Waits until the handshake completes or JOIN_LIMIT s after the join; `flood_end`: when the
        flood stopped (monotonic), to say whether the handshake completed during it."""
        done = wait_for(lambda: bool(self._events()["response"]) or not self.alive(), max(0.0, self.joined + JOIN_LIMIT - time.monotonic()), 0.05)
        ev = self._events()
        r: dict = {"limit_s": JOIN_LIMIT}
        first = ev["initiation"][0] if ev["initiation"] else None
        if done and ev["response"]:
            t = ev["response"][0]
            r["handshake_s"] = round(t - self.joined, 3)
            r["from_first_initiation_s"] = round(t - first, 3) if first else None
            r["initiations"] = sum(1 for x in ev["initiation"] if x <= t)
            r["cookie_replies"] = sum(1 for x in ev["cookie"] if x <= t)
            r["during_flood"] = t <= flood_end
            # Through the cookie on its first retry: a cookie reply to its first initiation, and
            # the second initiation (mac2, REKEY_TIMEOUT later) answered.
            r["first_retry_through_cookie"] = r["initiations"] == 2 and r["cookie_replies"] >= 1
            p = nsx(self.ns, "ping", "-c", "1", "-W", "2", TUNNEL["p"], check=False)
            r["ping_after"] = p.returncode == 0
        else:
            r["handshake_s"] = None
            r["initiations"] = len(ev["initiation"])
            r["cookie_replies"] = len(ev["cookie"])
            r["error"] = "wireguard-go exited" if not self.alive() else f"no handshake within {JOIN_LIMIT:g} s"
        r["first_initiation_after_join_s"] = round(first - self.joined, 3) if first else None
        # What it sent and got, in seconds after the join: which initiation the cookie answered.
        r["timeline"] = sorted([(round(t - self.joined, 3), name) for name, ts in ev.items() for t in ts], key=lambda x: x[0])[:12]
        return r

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            terminate_process(self.proc)
        self.proc = None
        (WG_SOCKET_DIR / f"{self.ifname}.sock").unlink(missing_ok=True)


def measure(rig: Rig, kind: str | None, rate: float, seconds: float, procs: int, size: int, gso: int | None = None,
            joiner: Joiner | None = None) -> dict:
    """One window of `seconds`: the neighbour on the reader's CPU, the ping, and a flood of `kind`
    at `rate` (none when kind is None; 0: unpaced), `gso` messages per send; with `joiner`, the
    new peer joins JOIN_AT s in."""
    d0, drops0 = udp_drops(rig.ns["p"], PORT), rig.drop_counters()
    if joiner:
        joiner.start()
    neighbour = subprocess.Popen(["taskset", "-c", str(rig.reader_cpu), sys.executable, str(GEN), "neighbour", str(seconds)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    gens = start_gens(rig, kind, rate, seconds, procs, size, gso=gso) if kind else []
    flood_start = time.monotonic()
    time.sleep(0.3)  # the window starts once everything runs
    window = seconds - 0.6
    pinger = ping_start(rig, window)
    # The same path without the tunnel: what the rig itself adds (the second CPU is busy with the generator).
    underlay = ping_start(rig, window, ADDR["pc"], 0.02)
    queue: list[int] = []
    txq: list[int] = []
    with ThreadSampler({"reader": rig.proxy.pid}, prefixes=("tg-udp-rx-",)) as sampler:
        threads0 = proxy_threads_ns(rig)
        cpu0 = cpu_times(rig.reader_cpu)
        end = time.monotonic() + window
        while time.monotonic() < end:
            if joiner and not joiner.joined and time.monotonic() >= flood_start + JOIN_AT:
                joiner.join()
            q = socket_queue(rig.proxy.pid, PORT)
            if q is not None:
                queue.append(q[0])
                txq.append(q[1])
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        readers = sampler.stop()
        threads1 = proxy_threads_ns(rig)
        cpu1 = cpu_times(rig.reader_cpu)
    if joiner and not joiner.joined:  # a window shorter than JOIN_AT
        joiner.join()
    threads = {name: round((ns - threads0.get(name, 0)) / 1e9 / window, 3) for name, ns in threads1.items()}
    daemon_cpu = sum(threads.values())
    r: dict = {"flood": kind, "offered_pps": rate}
    r["ping"] = ping_result(pinger, window)
    r["underlay_ping"] = ping_result(underlay, window)
    out, err = neighbour.communicate(timeout=seconds + 30)
    try:
        r["neighbour"] = json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise CommandFailed(f"neighbour exited {neighbour.returncode}: {err.strip()[-300:]}")
    if gens:
        r["generator"] = gens_result(gens, seconds)
        r["gso"] = r["generator"]["gso"]
    if joiner:
        r["joiner"] = joiner.result(flood_start + seconds)
        joiner.stop()
    time.sleep(0.2)
    r["socket_drops"] = udp_drops(rig.ns["p"], PORT) - d0
    drops1 = rig.drop_counters()
    r["daemon_drops"] = {k: drops1[k] - drops0.get(k, 0) for k in drops1 if drops1[k] - drops0.get(k, 0)}
    rd = readers.get("reader", {})
    r["reader"] = {"fifo_fraction": rd.get("fifo_fraction"), "cpu_share": rd.get("cpu_share"), "samples": sum(t["samples"] for t in rd.get("threads", {}).values())}
    r["proxy_cpu_share"] = round(daemon_cpu, 3)
    # Where the reader's CPU went (/proc/stat): a stall of the neighbour that neither the reader
    # nor the neighbour's own CPU time explains was softirq, another process, or the hypervisor.
    r["reader_cpu_time"] = cpu_delta(cpu0, cpu1)
    ct = r["reader_cpu_time"]
    if ct and r["reader"]["cpu_share"] is not None:
        busy = 1 - ct["idle"] - ct["iowait"]
        # What neither the reader nor the neighbour used of the CPU they share (softirq and
        # steal included): other threads, the kernel's receive work, the hypervisor.
        r["reader_cpu_time"]["others"] = round(max(0.0, busy - r["reader"]["cpu_share"] - r["neighbour"]["cpu_share"]), 3)
    r["proxy_threads_cpu_share"] = {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.005}
    r["socket_queue_bytes"] = {"max": max(queue, default=None), "median": statistics.median(queue) if queue else None, "samples": len(queue),
                               "tx_max": max(txq, default=None)}
    return r


def stream(rig: Rig, kind: str | None, rate: float, seconds: float, procs: int, size: int, cpu: str, decoy: bool = False) -> dict:
    """One window of `seconds` with an iperf3 TCP stream from the client through the tunnel to the
    proxy's tunnel address, and a flood of `kind` at `rate` (none when kind is None); no
    neighbour. The stream's two iperf3 ends and the client's tunnelgate run on `cpu` (taskset),
    the generator where it always runs. `decoy`: the generator sends to the decoy address instead
    of the proxy (init2 as init: the decoy hands out no cookie)."""
    server = iperf3_server(rig.ns["p"], STREAM_PORT, TUNNEL["p"])
    client_pid = rig.daemons["c"].pid
    try:
        run(["taskset", "-a", "-p", "-c", cpu, str(server.pid)])
        run(["taskset", "-a", "-p", "-c", cpu, str(client_pid)])
        d0 = udp_drops(rig.ns["p"], PORT)
        if kind and decoy:
            gens = start_gens(rig, "init" if kind == "init2" else kind, rate, seconds, procs, size, f"{DECOY_TARGET}:{PORT}")
        else:
            gens = start_gens(rig, kind, rate, seconds, procs, size) if kind else []
        time.sleep(0.3)
        window = max(1, int(round(seconds - 0.6)))
        with ThreadSampler({"reader": rig.proxy.pid}, prefixes=("tg-udp-rx-",)) as sampler:
            p = run(["ip", "netns", "exec", rig.ns["c"], "taskset", "-c", cpu, "iperf3", "-c", TUNNEL["p"], "-p", str(STREAM_PORT),
                     "-t", str(window), "-J"], check=False, timeout=window + 30)
            readers = sampler.stop()
        r: dict = {"flood": kind, "offered_pps": rate, "window": "stream", "stream_cpu": cpu, "decoy": decoy}
        if gens:
            r["generator"] = gens_result(gens, seconds)
        try:
            j = json.loads(p.stdout)
            end = j["end"]
            r["stream"] = {"mbps": round(end["sum_received"]["bits_per_second"] / 1e6, 1), "seconds": window,
                           "retransmits": end.get("sum_sent", {}).get("retransmits")}
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CommandFailed(f"iperf3 through the tunnel failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}")
        rd = readers.get("reader", {})
        r["reader"] = {"fifo_fraction": rd.get("fifo_fraction"), "cpu_share": rd.get("cpu_share")}
        r["socket_drops"] = udp_drops(rig.ns["p"], PORT) - d0
        return r
    finally:
        stop_process(server)
        run(["taskset", "-a", "-p", "-c", rig.other_cpus, str(client_pid)], check=False)


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(cpu: int) -> dict[str, int] | None:
    """The clock ticks of one CPU by kind, from /proc/stat's cpuN line; also the CPU time of its
    ksoftirqd thread, in ns (softirq work deferred to a thread)."""
    try:
        for line in open("/proc/stat"):
            if line.startswith(f"cpu{cpu} "):
                out = dict(zip(CPU_FIELDS, map(int, line.split()[1:9])))
                break
        else:
            return None
    except OSError:
        return None
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == f"ksoftirqd/{cpu}":
                    out["ksoftirqd_ns"] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
                    break
            except (OSError, ValueError, IndexError):
                continue
    return out


def cpu_delta(a: dict | None, b: dict | None) -> dict | None:
    """Shares of the interval between two `cpu_times` by kind, and ksoftirqd's share."""
    if not a or not b:
        return None
    d = {k: b[k] - a[k] for k in CPU_FIELDS}
    total = sum(d.values()) or 1
    out = {k: round(v / total, 3) for k, v in d.items()}
    if "ksoftirqd_ns" in a and "ksoftirqd_ns" in b:
        out["ksoftirqd"] = round((b["ksoftirqd_ns"] - a["ksoftirqd_ns"]) / 1e9 / (total / CLK_TCK), 3)
    return out


def proxy_threads_ns(rig: Rig) -> dict[str, int]:
    """CPU nanoseconds of every thread of the proxy, by "name/tid"."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{rig.proxy.pid}/task")
    except OSError:
        return out
    for tid in tids:
        s = thread_sched(rig.proxy.pid, int(tid))
        if s:
            out[f"{s[0]}/{tid}"] = s[3]
    return out


def socket_queue(pid: int, port: int) -> tuple[int, int] | None:
    """Bytes waiting in the receive queue and the send queue of the UDP socket(s) on `port` in
    `pid`'s namespace (/proc/PID/net/udp's rx_queue and tx_queue): a queue that stands is what a
    datagram behind it waits for."""
    try:
        lines = Path(f"/proc/{pid}/net/udp").read_text().splitlines()[1:] + Path(f"/proc/{pid}/net/udp6").read_text().splitlines()[1:]
    except OSError:
        return None
    rx = tx = 0
    for line in lines:
        f = line.split()
        if len(f) > 4 and int(f[1].rsplit(":", 1)[1], 16) == port:
            tx += int(f[4].split(":")[0], 16)
            rx += int(f[4].split(":")[1], 16)
    return rx, tx


def proxy_facts(rig: Rig) -> dict:
    """process_facts of the proxy, with the pinned UDP reader's CPUs and scheduling."""
    f = process_facts(rig.proxy.pid)
    try:
        status = Path(f"/proc/{rig.proxy.pid}/task/{rig.reader_tid}/status").read_text()
        f["udp_reader"] = {"tid": rig.reader_tid, "cpus": re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)}
    except (OSError, AttributeError):
        pass
    return f


def sweep_stale_runs() -> None:
    sweep_stale(NS_PREFIX + r"(\d+)[cpfjx]", IF_PREFIX + r"(\d+)[cpj]\.sock")


def flood_name(r: dict) -> str:
    """A window's flood as the tables name it: the kind, with its GSO when it is a GRO-sized one."""
    return r["flood"] + (f" gso{r.get('gso')}" if r.get("bound_window") else "")


def flood_order(name: str) -> tuple[int, str]:
    base = name.split()[0]
    return (FLOODS.index(base) if base in FLOODS else len(FLOODS), name)


def stall_bound_ms(share: float = UNAUTHENTICATED_SHARE) -> dict:
    """The longest a normal-priority thread on the reader's CPU may wait for it, by the stated
    bound: the burst plus one batch; and the longest continuous hold the budget allows, where the
    share the reader earns while it holds the CPU counts too: L <= share * L + burst + batch."""
    b = BURST_MS + BATCH_MS_MAX
    return {"burst_plus_batch": b, "continuous_hold": round(b / (1 - share), 1)}


def summarize(results: dict) -> list[dict]:
    """Per flood and rate: medians over rounds, the neighbour's share against no flood (same mode,
    same round) and against the same flood at normal priority, its longest stall, the joiner; the
    stream windows' rows after, with `window` "stream"."""
    rows = []
    runs = results["runs"]
    keyed: dict = {}
    streams: dict = {}
    for r in runs:
        if r.get("flood") is None or "error" in r:
            continue
        if r.get("window") == "stream":
            streams.setdefault((r["flood"], r["rate_label"], r["mode"]), []).append(r)
            continue
        b = r.get("neighbour_alone_iterations_per_s")
        share = r["neighbour"]["iterations_per_s"] / b if b else None
        keyed.setdefault((flood_name(r), r["rate_label"], r["mode"]), []).append((r, share))
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    for (flood, label, mode), items in sorted(keyed.items(), key=lambda kv: (flood_order(kv[0][0]), kv[0][1], kv[0][2] != "rt")):
        rs = [r for r, _ in items]
        joins = [r["joiner"] for r in rs if "joiner" in r]
        stalls = [r["neighbour"]["longest_stall_ms"] for r in rs if r["neighbour"].get("longest_stall_ms") is not None]
        alone_stalls = [r["neighbour_alone_longest_stall_ms"] for r in rs if r.get("neighbour_alone_longest_stall_ms") is not None]
        row = {
            "window": "neighbour", "flood": flood, "rate": label, "mode": mode,
            "offered_pps": med([r["offered_pps"] for r in rs]),
            "sent_pps": med([r.get("generator", {}).get("pps", 0) for r in rs]),
            "neighbour_share": med([s for _, s in items if s is not None]),
            "neighbour_cpu_share": med([r["neighbour"]["cpu_share"] for r in rs]),
            "neighbour_longest_stall_ms": max(stalls) if stalls else None,
            "neighbour_longest_stall_median_ms": med(stalls),
            "neighbour_alone_longest_stall_ms": max(alone_stalls) if alone_stalls else None,
            "reader_cpu_share": med([r["reader"]["cpu_share"] for r in rs if r["reader"]["cpu_share"] is not None]),
            "reader_fifo_fraction": med([r["reader"]["fifo_fraction"] for r in rs if r["reader"]["fifo_fraction"] is not None]),
            "cpu_others_share": med([r["reader_cpu_time"]["others"] for r in rs if (r.get("reader_cpu_time") or {}).get("others") is not None]),
            "socket_drop_fraction": med([r["socket_drops"] / max(1, r.get("generator", {}).get("sent", 1)) for r in rs]),
            "replies": med([r.get("generator", {}).get("replies", 0) for r in rs]),
            "socket_queue_max_kb": med([r["socket_queue_bytes"]["max"] / 1024 for r in rs if r.get("socket_queue_bytes", {}).get("max") is not None]),
            "ping_p50_ms": med([r["ping"]["p50_ms"] for r in rs if r["ping"]["p50_ms"] is not None]),
            "ping_p99_ms": med([r["ping"]["p99_ms"] for r in rs if r["ping"]["p99_ms"] is not None]),
            "ping_p99_max_ms": max([r["ping"]["p99_ms"] for r in rs if r["ping"]["p99_ms"] is not None], default=None),
            "ping_lost": sum(r["ping"]["lost"] for r in rs), "ping_sent": sum(r["ping"]["sent"] for r in rs),
            "underlay_ping_p99_ms": med([r["underlay_ping"]["p99_ms"] for r in rs if r.get("underlay_ping", {}).get("p99_ms") is not None]),
            "rounds": len(rs),
        }
        if joins:
            times = [j["handshake_s"] for j in joins if j.get("handshake_s") is not None]
            row["joiner_handshake_s"] = med(times)
            row["joiner_handshake_max_s"] = None if len(times) < len(joins) else max(times)
            row["joiner_joins"] = len(joins)
            row["joiner_first_retry_through_cookie"] = sum(1 for j in joins if j.get("first_retry_through_cookie"))
            row["joiner_within_6s"] = sum(1 for t in times if t <= REKEY_TIMEOUT + 1)
            row["joiner_during_flood"] = sum(1 for j in joins if j.get("during_flood"))
        old = OLD_CAPACITY.get(flood)
        row["sent_x_old_capacity"] = round(row["sent_pps"] / old, 2) if old and row["sent_pps"] else None
        rows.append(row)
    # Against the same flood at normal priority.
    normal = {(r["flood"], r["rate"]): r["neighbour_share"] for r in rows if r["mode"] == "normal"}
    for r in rows:
        n = normal.get((r["flood"], r["rate"]))
        r["neighbour_vs_normal"] = r["neighbour_share"] / n if r["neighbour_share"] is not None and n else None
    for (flood, label, mode), rs in sorted(streams.items(), key=lambda kv: (flood_order(kv[0][0]), kv[0][1], kv[0][2] != "rt")):
        rs = [r for r in rs if not r.get("decoy")]
        kept = [r["stream_kept"] for r in rs if r.get("stream_kept") is not None]
        kept_quiet = [r["stream_kept_vs_quiet"] for r in rs if r.get("stream_kept_vs_quiet") is not None]
        old = OLD_CAPACITY.get(flood)
        sent = med([r.get("generator", {}).get("pps", 0) for r in rs])
        rows.append({
            "window": "stream", "flood": flood, "rate": label, "mode": mode,
            "sent_pps": sent, "sent_x_old_capacity": round(sent / old, 2) if old and sent else None,
            "stream_alone_mbps": med([r["stream_alone_mbps"] for r in rs if r.get("stream_alone_mbps")]),
            "stream_decoy_mbps": med([r["stream_decoy_mbps"] for r in rs if r.get("stream_decoy_mbps")]),
            "stream_mbps": med([r["stream"]["mbps"] for r in rs]),
            "stream_kept": med(kept), "stream_kept_min": min(kept) if kept else None,
            "stream_kept_vs_quiet": med(kept_quiet), "stream_kept_vs_quiet_min": min(kept_quiet) if kept_quiet else None,
            "reader_cpu_share": med([r["reader"]["cpu_share"] for r in rs if r["reader"]["cpu_share"] is not None]),
            "rounds": len(rs),
        })
    return rows


def table(head: tuple, body: list[tuple]) -> list[str]:
    out = [head, *body]
    widths = [max(len(str(x[i])) for x in out) for i in range(len(head))]
    lines = []
    for i, row in enumerate(out):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def done_when(rows: list[dict]) -> list[str]:
    """Issue 44's done-when, row by row at the default (real-time) priority: what the figures say,
    not a judgement of the rig (a rate the generator did not reach is said as such)."""
    ok = lambda c: "yes" if c else "NO"  # noqa: E731
    out = ["the flood targets, readers at real-time priority:"]
    streams = {(r["flood"], r["rate"]): r for r in rows if r["window"] == "stream" and r["mode"] == "rt"}
    want = {"1x": 1.0, "2x": 2.0}
    for r in rows:
        if r["window"] != "neighbour" or r["mode"] != "rt" or r["flood"] not in JOIN_FLOODS:
            continue
        lost = r["ping_lost"] / max(1, r["ping_sent"])
        parts = [f"sent {r['sent_x_old_capacity'] or 0:.2f}x the old capacity ({ok((r['sent_x_old_capacity'] or 0) >= 0.97 * want.get(r['rate'], 0))})",
                 f"ping p99 {r['ping_p99_max_ms'] or 0:.2f} ms (worst round), lost {lost * 100:.1f} % ({ok((r['ping_p99_max_ms'] or 1e9) <= 5 and lost <= 0.01)})"]
        if "joiner_joins" in r:
            parts.append(f"joiner through the cookie on its first retry in {r['joiner_first_retry_through_cookie']}/{r['joiner_joins']}, "
                         f"longest {r['joiner_handshake_max_s'] if r['joiner_handshake_max_s'] is not None else '-'} s, "
                         f"{r['joiner_during_flood']}/{r['joiner_joins']} before the flood ended "
                         f"({ok(r['joiner_first_retry_through_cookie'] == r['joiner_joins'] and (r['joiner_handshake_max_s'] or 1e9) <= REKEY_TIMEOUT + 1)})")
        st = streams.get((r["flood"], r["rate"]))
        if st and st["stream_kept_min"] is not None:
            parts.append(f"stream kept {st['stream_kept_min']:.2f} (least; against the decoy window, "
                         f"{st['stream_kept_vs_quiet_min'] or 0:.2f} against a quiet machine) ({ok(st['stream_kept_min'] >= 0.8)})")
        out.append(f"  {r['flood']} {r['rate']}: " + "; ".join(parts))
    b = stall_bound_ms()["burst_plus_batch"]
    for r in rows:
        if r["window"] == "neighbour" and r["mode"] == "rt" and " gso" in r["flood"] and r["neighbour_longest_stall_ms"] is not None:
            out.append(f"  {r['flood']} (GRO-sized): neighbour's longest stall {r['neighbour_longest_stall_ms']:.1f} ms against {b:g} ms "
                       f"({ok(r['neighbour_longest_stall_ms'] <= b)})")
    return out


def report(rows: list[dict], results: dict) -> str:
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
    pct = lambda v: "-" if v is None else f"{v * 100:.0f} %"  # noqa: E731
    body = []
    for r in rows:
        if r["window"] != "neighbour":
            continue
        join = "-"
        if "joiner_joins" in r:
            join = (f"{f(r['joiner_handshake_s'], '{:.1f}')} (max {f(r['joiner_handshake_max_s'], '{:.1f}')}), "
                    f"{r['joiner_first_retry_through_cookie']}/{r['joiner_joins']} cookie+1st retry, "
                    f"{r['joiner_during_flood']}/{r['joiner_joins']} during the flood")
        body.append((r["flood"], r["rate"], r["mode"], f(r["offered_pps"], "{:.0f}"), f(r["sent_pps"], "{:.0f}"), f(r["sent_x_old_capacity"], "{:.2f}x"),
                     pct(r["neighbour_share"]), f(r["neighbour_vs_normal"], "{:.2f}x"),
                     f"{f(r['neighbour_longest_stall_ms'], '{:.1f}')} ({f(r['neighbour_alone_longest_stall_ms'], '{:.1f}')})",
                     pct(r["reader_cpu_share"]), pct(r["reader_fifo_fraction"]), pct(r["cpu_others_share"]),
                     pct(r["socket_drop_fraction"]), f(r["socket_queue_max_kb"], "{:.0f}"), f(r["replies"], "{:.0f}"),
                     f"{f(r['ping_p50_ms'])} / {f(r['ping_p99_ms'])}", f"{r['ping_lost']}/{r['ping_sent']}", f(r["underlay_ping_p99_ms"]), join))
    lines = table(("flood", "rate", "priority", "offered/s", "sent/s", "x old cap", "neighbour kept", "vs normal prio", "longest stall ms (no flood)",
                   "reader CPU", "reader at FIFO", "rest of CPU", "socket drops", "queue max KB", "replies", "ping p50/p99 ms", "ping lost", "underlay p99",
                   "joiner handshake s"), body)
    sbody = [(r["flood"], r["rate"], r["mode"], f(r["sent_pps"], "{:.0f}"), f(r["sent_x_old_capacity"], "{:.2f}x"), f(r["stream_alone_mbps"], "{:.0f}"),
              f(r.get("stream_decoy_mbps"), "{:.0f}"), f(r["stream_mbps"], "{:.0f}"), f"{f(r['stream_kept'])} (min {f(r['stream_kept_min'])})",
              f"{f(r.get('stream_kept_vs_quiet'))} (min {f(r.get('stream_kept_vs_quiet_min'))})", pct(r["reader_cpu_share"]))
             for r in rows if r["window"] == "stream"]
    if sbody:
        cpu = results["meta"].get("stream_cpu")
        lines += ["", f"stream through the tunnel (iperf3 TCP, client -> proxy; its ends and the client's tunnelgate on the {cpu} CPU; no neighbour):"]
        lines += table(("flood", "rate", "priority", "sent/s", "x old cap", "Mbit/s quiet", "Mbit/s decoy", "Mbit/s flood", "stream kept (vs decoy)",
                        "kept vs quiet", "reader CPU"), sbody)
    b = stall_bound_ms()
    lines.append("")
    lines.append(f"real-time bound: burst {BURST_MS:g} ms + one batch (<= {BATCH_MS_MAX:g} ms, 4,096 datagrams) = {b['burst_plus_batch']:g} ms; "
                 f"a continuous hold of unauthenticated work, with the {UNAUTHENTICATED_SHARE * 100:.0f} % share it earns meanwhile: "
                 f"<= {b['continuous_hold']:g} ms. Longest stall = the neighbour's longest gap (max over rounds).")
    for r in rows:
        if r["window"] == "neighbour" and r["mode"] == "rt" and r["neighbour_longest_stall_ms"] is not None:
            over = r["neighbour_longest_stall_ms"] - b["burst_plus_batch"]
            if over > 0:
                lines.append(f"  {r['flood']} {r['rate']} rt: longest stall {r['neighbour_longest_stall_ms']:.1f} ms, "
                             f"{over:.1f} ms over burst + one batch (no-flood window: {f(r['neighbour_alone_longest_stall_ms'], '{:.1f}')} ms)")
    lines += ["", *done_when(rows)]
    caps = results.get("capacity", {})
    lines.append("")
    for kind, c in caps.items():
        cap = c.get("ramp", {}).get("capacity") or {}
        lines.append(f"{kind}: reader capacity {cap.get('pps', '?')}/s ({cap.get('by', '?')}); generator ceiling {c.get('generator', {}).get('pps', '?')}/s")
    lines.append(f"old reader capacity (initiations, before the handshake path): {OLD_CAPACITY['init']}/s")
    alone = [r["neighbour"]["iterations_per_s"] for r in results["runs"] if r.get("flood") is None and "neighbour" in r]
    if alone:
        lines.append(f"neighbour alone (the window before each flood window): {min(alone) / 1e6:.1f}-{max(alone) / 1e6:.1f} M iterations/s, "
                     f"median {statistics.median(alone) / 1e6:.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 epilog="The default run is the flood targets' run; --quick is one round of it (see benches/flood/README.md).")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each mode in turn (default 3)")
    ap.add_argument("--duration", type=float, default=8, help="seconds per measurement window (default 8)")
    ap.add_argument("--ramp-step", type=float, default=2, help="seconds per rate of the capacity ramp (default 2)")
    ap.add_argument("--quick", action="store_true", help="1 round, 3 s windows, 1 s ramp steps")
    ap.add_argument("--floods", default="init,init2", help=f"comma-separated subset of {','.join(FLOODS)} (default %(default)s)")
    ap.add_argument("--rates", default="1,2", help="the rates to measure, as multiples of --rate-base, capped at the generator's "
                                                   "ceiling (default %(default)s)")
    ap.add_argument("--rate-base", choices=("old", "capacity"), default="old",
                    help="what --rates multiply: 'old', the reader's capacity for initiations before handshakes had their own path "
                         f"({OLD_CAPACITY['init']}/s, for init and init2; the other floods: the capacity measured now), or 'capacity', "
                         "the capacity the ramp measures now (default %(default)s)")
    ap.add_argument("--bound-floods", default="data,init",
                    help="the GRO-sized floods for the real-time bound: unpaced, --bound-gso messages per send, each with the neighbour's "
                         "longest stall (default %(default)s; '' for none)")
    ap.add_argument("--bound-gso", type=int, default=64, help="messages per send of the GRO-sized floods (default %(default)s: 64 x 64 per receive batch)")
    ap.add_argument("--no-joiner", action="store_true", help="no new wireguard-go peer joining in the init and init2 windows")
    ap.add_argument("--no-stream", action="store_true", help="no iperf3 stream windows")
    ap.add_argument("--stream-cpu", choices=("reader", "other"), default="reader",
                    help="where the stream's iperf3 ends and the client's tunnelgate run in the stream windows: on the reader's CPU "
                         "(default: the generator does not take their CPU) or the other CPUs (with the generator)")
    ap.add_argument("--gen-procs", type=int, default=2, help="flood generator processes (default %(default)s)")
    ap.add_argument("--sources", type=int, default=64, help="flood source addresses, shared among the generator processes (default %(default)s)")
    ap.add_argument("--data-size", type=int, default=64, help="bytes per data message of the data flood (default %(default)s)")
    ap.add_argument("--gso", type=int, default=16,
                    help="messages per send, as one UDP_SEGMENT train that the proxy's UDP_GRO socket takes in one piece, as a NIC's GRO "
                         "coalesces a burst from one source (default %(default)s: 8 does not reach 2x the old capacity on a 2-vCPU machine; 1: one datagram per send)")
    ap.add_argument("--workers", type=int, default=1, help="the proxy's interface.workers (default 1: one UDP reader, pinned)")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="K=V", help="extra environment of both daemons in every mode (repeatable)")
    ap.add_argument("--tunnelgate", help="tunnelgate binary (default target/release/tunnelgate, built first)")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    add_output_args(ap, "flood")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration, args.ramp_step = 1, 3, 1
    floods = [f.strip() for f in args.floods.split(",") if f.strip()]
    bound_floods = [f.strip() for f in args.bound_floods.split(",") if f.strip()]
    if any(f not in FLOODS for f in floods + bound_floods):
        ap.error(f"--floods {args.floods} / --bound-floods {args.bound_floods}: known: {', '.join(FLOODS)}")
    if "init2" in bound_floods:
        ap.error("--bound-floods: init2 needs cookies, which the GRO-sized windows do not fetch; use init")
    stream_floods = [] if args.no_stream else floods
    rates = [float(x) for x in args.rates.split(",")]
    GSO[0] = max(1, min(64, args.gso))
    args.bound_gso = max(1, min(64, args.bound_gso))
    SOURCES[0] = max(1, min(200, args.sources))
    extra_env = dict(kv.split("=", 1) for kv in args.daemon_env if "=" in kv)
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces): run benches/flood/run.sh as root")
    tools = ["ip", "wg", "ping", "taskset"] + ([] if args.no_joiner else ["wireguard-go"]) + ([] if args.no_stream else ["iperf3"])
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)} (benches/flood/run.sh installs them)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        ap.error(f"needs 2 CPUs (the reader's and the rest), this process may use {cpus}")
    reader_cpu, other_cpus = cpus[0], ",".join(map(str, cpus[1:]))
    try:
        out = results_path(args, "flood")
    except CommandFailed as e:
        ap.error(str(e))

    raise_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="tunnelgate-flood-"))
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "loadavg_start": open("/proc/loadavg").read().split()[:3],
            "rounds": args.rounds, "duration_s": args.duration, "ramp_step_s": args.ramp_step, "floods": floods, "rates_x_capacity": rates, "rate_base": args.rate_base,
            "gen_procs": args.gen_procs, "sources": SOURCES[0], "gso": GSO[0], "bound_floods": bound_floods, "bound_gso": args.bound_gso,
            "joiner": None if args.no_joiner else {"at_s": JOIN_AT, "window_s": JOIN_WINDOW, "limit_s": JOIN_LIMIT, "peer": "Debian wireguard-go"},
            "stream_floods": stream_floods, "stream_cpu": args.stream_cpu,
            "bound_ms": {"burst": BURST_MS, "batch_max": BATCH_MS_MAX, "unauthenticated_share": UNAUTHENTICATED_SHARE},
            "old_capacity_pps": OLD_CAPACITY, "data_size": args.data_size, "workers": args.workers, "daemon_env": extra_env,
            "reader_cpu": reader_cpu, "other_cpus": other_cpus, "modes": MODES, "ping_interval_s": PING_INTERVAL, "drop_limit": DROP_LIMIT,
        },
        "capacity": {}, "runs": [], "daemon_facts": {},
    }
    if float(results["meta"]["loadavg_start"][0]) > 0.5 * len(cpus):
        log(f"warning: load average {results['meta']['loadavg_start'][0]} before the benchmark: other work will skew the figures")
    interrupted = False
    rig = None
    joiner = None
    try:
        sweep_stale_runs()
        binary = args.tunnelgate or str(REPO / "target" / "release" / "tunnelgate")
        if not args.tunnelgate and not args.no_build:
            build_release_tunnelgate(workdir / "cargo-build.log")
        if not os.access(binary, os.X_OK):
            raise CommandFailed(f"no tunnelgate binary at {binary}")
        results["meta"]["tunnelgate"] = binary
        # This process samples /proc and starts the rest: off the reader's CPU.
        os.sched_setaffinity(0, {int(c) for c in other_cpus.split(",")})
        rig = Rig(workdir, binary, args.workers, reader_cpu, other_cpus, extra_env)
        rig.build()
        joiner = Joiner(rig) if not args.no_joiner else None
        stream_cpu = str(reader_cpu) if args.stream_cpu == "reader" else other_cpus
        rig.start(MODES["rt"])
        results["daemon_facts"]["rt"] = proxy_facts(rig)
        for kind in floods:
            log(f"==> {kind}: the generator's ceiling, then the reader's capacity")
            ceiling = generator_ceiling(rig, kind, args.ramp_step, args.gen_procs, args.data_size)
            log(f"    generator ceiling {ceiling['pps']}/s ({args.gen_procs} processes)")
            rig.start(MODES["rt"])  # a fresh daemon: the ceiling run left nothing, but the ramp starts clean
            results["capacity"][kind] = {"generator": ceiling, "ramp": ramp(rig, kind, args.ramp_step, args.gen_procs, args.data_size, ceiling["pps"])}
        plan = {}
        for kind in floods:
            cap = results["capacity"][kind]["ramp"]["capacity"]["pps"]
            if args.rate_base == "old" and kind in OLD_CAPACITY:
                cap = OLD_CAPACITY[kind]
            ceiling = results["capacity"][kind]["generator"]["pps"]
            plan[kind] = [(f"{x:g}x", min(cap * x, ceiling)) for x in rates]
            if cap * max(rates) > ceiling:
                log(f"    {kind}: the generator's ceiling ({ceiling}/s) is below {max(rates):g}x {cap}/s: that window offers the ceiling")
        results["meta"]["plan"] = plan
        modes = list(MODES)
        for rnd in range(1, args.rounds + 1):
            for mode in modes[(rnd - 1) % 2:] + modes[: (rnd - 1) % 2]:
                log(f"==> round {rnd}/{args.rounds}, readers {mode}")
                rig.start(MODES[mode])
                if mode not in results["daemon_facts"]:
                    results["daemon_facts"][mode] = proxy_facts(rig)
                # Every flood window right after a window without flood: the neighbour's own rate
                # drifts with whatever else the machine runs, so each share is against its neighbour.
                # The floods of the plan, then the GRO-sized ones (unpaced, --bound-gso per send).
                windows = [(k, lab, r, None) for k in floods for lab, r in plan[k]]
                windows += [(k, "max", 0.0, args.bound_gso) for k in bound_floods]
                for kind, label, rate, gso in windows:
                    with_joiner = joiner if kind in JOIN_FLOODS and gso is None else None
                    # A window with the joiner lasts until its first retry is due (and then some).
                    seconds = max(args.duration, JOIN_AT + JOIN_WINDOW + 0.6) if with_joiner else args.duration
                    pair = []
                    for k, lab, rt in ((None, "none", 0.0), (kind, label, rate)):
                        try:
                            r = measure(rig, k, rt, seconds, args.gen_procs, args.data_size, gso=gso if k else None,
                                        joiner=with_joiner if k else None)
                        except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                            r = {"flood": k, "error": str(e)}
                        r.update(mode=mode, round=rnd, rate_label=lab, pair=f"{kind}-{label}" + (f"-gso{gso}" if gso else ""), window="neighbour")
                        if k and gso:
                            r["bound_window"] = True
                        pair.append(r)
                        results["runs"].append(r)
                        if "error" in r:
                            log(f"    {k} {lab}: error {r['error']}")
                        else:
                            j = r.get("joiner")
                            log(f"    {k or 'no flood':8} {lab:5} {'gso ' + str(r['gso']) if k else '':6} sent {r.get('generator', {}).get('pps', 0):>7}/s: "
                                f"neighbour {r['neighbour']['iterations_per_s'] / 1e6:.1f} M/s "
                                f"(CPU {r['neighbour']['cpu_share'] * 100:.0f} %, longest stall {r['neighbour'].get('longest_stall_ms')} ms), "
                                f"reader CPU {(r['reader']['cpu_share'] or 0) * 100:.0f} % at FIFO "
                                f"{(r['reader']['fifo_fraction'] or 0) * 100:.0f} % of samples, ping p99 {r['ping']['p99_ms']} ms, lost {r['ping']['lost']}"
                                + (f"; the rest of CPU {rig.reader_cpu}: {ct.get('others', 0) * 100:.0f} % (softirq {ct['softirq'] * 100:.0f} %, "
                                   f"steal {ct['steal'] * 100:.0f} %)" if (ct := r.get("reader_cpu_time")) else "")
                                + (f"; joiner {j.get('handshake_s')} s ({j.get('initiations')} initiations, {j.get('cookie_replies')} cookie replies)" if j else ""))
                        if not rig.proxy.alive():
                            raise CommandFailed(f"the proxy exited: {tail(rig.proxy.logfile)}")
                    if "error" not in pair[0] and "error" not in pair[1]:
                        pair[1]["neighbour_alone_iterations_per_s"] = pair[0]["neighbour"]["iterations_per_s"]
                        pair[1]["neighbour_alone_longest_stall_ms"] = pair[0]["neighbour"].get("longest_stall_ms")
                # The stream through the tunnel without and with each flood of the plan, in
                # windows of their own (no neighbour: see the README), at the default priority.
                if stream_floods and mode == "rt":
                    for kind, label, rate in [(k, lab, r) for k in stream_floods for lab, r in plan[k]]:
                        pair = []
                        for k, lab, rt, decoy in ((None, "none", 0.0, False), (kind, label, rate, True), (kind, label, rate, False)):
                            try:
                                r = stream(rig, k, rt, args.duration, args.gen_procs, args.data_size, stream_cpu, decoy)
                            except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                                r = {"flood": k, "window": "stream", "error": str(e)}
                            r.update(mode=mode, round=rnd, rate_label=lab, pair=f"stream-{kind}-{label}")
                            pair.append(r)
                            results["runs"].append(r)
                            if "error" in r:
                                log(f"    stream {k} {lab}: error {r['error']}")
                            else:
                                log(f"    stream, {k or 'no flood':8} {lab:5} {'to the decoy ' if decoy else ''}sent {r.get('generator', {}).get('pps', 0):>7}/s: {r['stream']['mbps']} Mbit/s "
                                    f"({r['stream']['retransmits']} retransmits), reader CPU {(r['reader']['cpu_share'] or 0) * 100:.0f} %")
                            if not rig.proxy.alive():
                                raise CommandFailed(f"the proxy exited: {tail(rig.proxy.logfile)}")
                        quiet, decoyed, flooded = pair
                        if not any("error" in r for r in pair) and quiet["stream"]["mbps"] and decoyed["stream"]["mbps"]:
                            flooded["stream_alone_mbps"] = quiet["stream"]["mbps"]
                            flooded["stream_decoy_mbps"] = decoyed["stream"]["mbps"]
                            flooded["stream_kept"] = round(flooded["stream"]["mbps"] / decoyed["stream"]["mbps"], 3)
                            flooded["stream_kept_vs_quiet"] = round(flooded["stream"]["mbps"] / quiet["stream"]["mbps"], 3)
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if joiner:
            joiner.stop()
        if rig:
            rig.teardown()
        sweep_stale_runs()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        shutil.rmtree(workdir, ignore_errors=True)

    m = results["meta"]
    m["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    m["interrupted"] = interrupted
    m["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    rows = summarize(results)
    results["summary"] = rows
    if interrupted:
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nflood benchmark: {m['rounds']} round(s) x {m['duration_s']} s windows, commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), "
          f"load {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}")
    print(f"the proxy's UDP reader and a normal-priority busy loop share CPU {reader_cpu}; neighbour kept = its loop rate against the "
          f"window just before without flood; vs normal prio = that against the same flood with TUNNELGATE_RT_PRIORITY=0\n")
    print(report(rows, results))
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
