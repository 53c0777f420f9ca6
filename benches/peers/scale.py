#!/usr/bin/env python3
"""Concentrator benchmark: one WireGuard gateway with 1,000 / 10,000 / 100,000 configured peers, of
which 1,000 or 10,000 are active, simulated by `peersim` (benches/peers/sim): real WireGuard sessions,
one key, UDP socket, source address and tunnel address per peer, from one process.

Topology (namespaces and interfaces carry this run's pid):

  peers ns tgscale<pid>p                         gateway ns tgscale<pid>g
  peersim: peer i binds 10.97.x.y (one source    10.96.0.1 --- the gateway on UDP 51820, tunnel
  address per peer: `local 10.97.0.0/16 dev lo`) address 10.100.0.1; peer i is 10.200.x.y/32
  10.96.0.2 ------------ veth ------------------ (route 10.97.0.0/16 via 10.96.0.2)

Steps, for each configured count N (--configured) and, where A <= N, each active count A (--active):

  uapi     `tunnelgate userspace -f` and wireguard-go-upstream (same UAPI, same code): time of
           `wg setconf` of N peers, of `wg syncconf` with nothing changed, of one `wg set` of one
           peer among N, `wg show dump`, RSS after setconf (/proc VmRSS), stop time (SIGTERM).
  config   `tunnelgate run --config` with N [[peer]]s: start to UAPI socket and to /readyz 200,
           RSS, a /metrics scrape's size and time, `wg show dump`, stop time (SIGTERM to exit).
  active   tunnelgate (`run --config`) and wireguard-go-upstream with N peers configured and A
           simulated: the handshake wave (all A initiate at once: time until all have
           handshaked, peak and mean rate, cookie replies), ping round trips at rest and while
           all A rekey at once, and the time until every peer has a reply again to a ping sent
           after the gateway was SIGKILLed and restarted with the same key and config
           (wireguard-go: killed, restarted and given its config again with `wg setconf`).

wireguard-go refuses more than 65,536 peers: its steps past that are skipped, saying so. Every figure
is measured in this run; a step that could not run says why in the JSON. Cleanup: every namespace
and process goes at the end, also on Ctrl-C, SIGTERM or an error; a later run sweeps what a killed
run (kill -9) left.

Usage: benches/peers/scale.py [--quick] [--configured 1000,10000,100000] [--active 1000,10000]
       [--steps uapi,config,active] [--binary PATH | --no-build] [--out FILE | --publish]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CLK_TCK, REPO, WG_SOCKET_DIR, CommandFailed, Daemon, add_ns, add_output_args, build_release_tunnelgate  # noqa: E402
from benchproc import cpu_ticks, genkey, git_commit, kill_ns, log, nsx, raise_on_signals, results_path, run, status_kib  # noqa: E402
from benchproc import sweep_stale, tail, terminate_process, wait_for  # noqa: E402

PID = os.getpid()
NS_PREFIX = "tgscale"  # tgscale<pid>g (gateway), tgscale<pid>p (peers)
IF_PREFIX = "ts"  # ts<pid>t (tunnel), ts<pid>a / ts<pid>b (veth); <= 15 chars
GW_UNDERLAY, SIM_UNDERLAY = "10.96.0.1", "10.96.0.2"
SOURCE_NET = "10.97.0.0/16"  # one source address per simulated peer (65,534 before they share)
GATEWAY_TUNNEL = "10.100.0.1"
PEER_NET = "10.200.0.0/14"  # peersim's tunnel addresses (keys.rs: 10.200.0.1 on, no .0/.255)
WG_PORT = 51820
HEALTH_PORT = 9102
MTU = 1420
WGGO_MAX_PEERS = 65536  # wireguard-go's device.MaxPeers: it refuses a peer past it
SIM_DIR = Path(__file__).resolve().parent / "sim"
WGGO = "wireguard-go-upstream"

# Run inside the gateway namespace: GET one path once (timed), or poll /readyz until 200. Both
# print one JSON line; the poller first prints "polling" once it is up, so that the time to
# ready excludes its own start.
NS_HTTP = r"""
import http.client, json, sys, time
port, path, mode, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
def get():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t = time.monotonic()
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    took = time.monotonic() - t
    c.close()
    return r.status, body, took
if mode == "poll":
    print("polling", flush=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, body, _ = get()
            if status == 200:
                print(json.dumps({"ready_mono": time.monotonic()}), flush=True)
                sys.exit(0)
        except OSError:
            pass
        time.sleep(0.01)
    print(json.dumps({"error": f"/readyz not 200 within {timeout:g} s"}), flush=True)
    sys.exit(1)
t = time.monotonic()
try:
    status, body, took = get()
except (OSError, http.client.HTTPException) as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}", "seconds": round(time.monotonic() - t, 4)}))
    sys.exit(0)
print(json.dumps({"status": status, "bytes": len(body), "seconds": round(took, 4), "lines": body.count(b"\n"), "truncated": b"/metrics truncated" in body[-300:]}))
"""


def r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def timed(fn) -> tuple[float, object]:
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def rss_mib(pid: int, key: str = "VmRSS") -> float | None:
    kib = status_kib(pid, key)
    return None if kib is None else round(kib / 1024, 1)


def wggo_path(explicit: str | None) -> str:
    if explicit:
        return explicit
    for d in (REPO.parent / "shared" / "bin", REPO.parents[1] / "shared" / "bin"):
        if os.access(d / WGGO, os.X_OK):
            return str(d / WGGO)
    raise CommandFailed(f"no {WGGO} in ../shared/bin (give --wggo PATH)")


def version_of(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        return ((p.stdout or p.stderr).strip().splitlines() or ["?"])[0]
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# --------------------------------------------------------------------------------------------------
# The run's context: namespaces, keys, config files
# --------------------------------------------------------------------------------------------------


class Context:
    def __init__(self, args: argparse.Namespace, workdir: Path, tunnelgate: str, wggo: str | None, sim: str):
        self.args, self.workdir = args, workdir
        self.tunnelgate, self.wggo, self.sim = tunnelgate, wggo, sim
        self.gw_ns, self.peers_ns = f"{NS_PREFIX}{PID}g", f"{NS_PREFIX}{PID}p"
        self.ifname = f"{IF_PREFIX}{PID}t"
        self.created: list[str] = []
        self.seed = f"tunnelgate-scale-{PID}-{int(time.time())}"
        self.gw_key, self.gw_pub = genkey()
        self.keys: list[tuple[str, str]] = []  # (public key, tunnel address) per peer index
        self.keyfile = workdir / "gateway.key"
        self.keyfile.write_text(self.gw_key + "\n")
        self.keyfile.chmod(0o600)
        self._wg_conf: dict[int, Path] = {}
        self._toml: dict[int, Path] = {}

    def setup(self) -> None:
        for ns in (self.gw_ns, self.peers_ns):
            add_ns(ns)
            self.created.append(ns)
        a, b = f"{IF_PREFIX}{PID}a", f"{IF_PREFIX}{PID}b"
        run(["ip", "link", "add", a, "netns", self.gw_ns, "type", "veth", "peer", "name", b, "netns", self.peers_ns])
        nsx(self.gw_ns, "ip", "addr", "add", f"{GW_UNDERLAY}/24", "dev", a)
        nsx(self.gw_ns, "ip", "link", "set", a, "up")
        nsx(self.gw_ns, "ip", "route", "add", SOURCE_NET, "via", SIM_UNDERLAY)
        nsx(self.peers_ns, "ip", "addr", "add", f"{SIM_UNDERLAY}/24", "dev", b)
        nsx(self.peers_ns, "ip", "link", "set", b, "up")
        # Any address of the source network is this namespace's own: each peer binds one.
        nsx(self.peers_ns, "ip", "route", "add", "local", SOURCE_NET, "dev", "lo")

    def teardown(self) -> None:
        for ns in self.created:
            kill_ns(ns)
        self.created.clear()
        (WG_SOCKET_DIR / f"{self.ifname}.sock").unlink(missing_ok=True)

    def make_keys(self, count: int) -> float:
        """The public keys and tunnel addresses of peers 0 .. count-1, from `peersim keys`; returns
        how long that took."""
        t0 = time.monotonic()
        p = run([self.sim, "keys", "--seed", self.seed, "--count", str(count)], timeout=600)
        took = time.monotonic() - t0
        self.keys = [tuple(line.split("\t")[:2]) for line in p.stdout.splitlines()]  # type: ignore[misc]
        if len(self.keys) != count:
            raise CommandFailed(f"peersim keys printed {len(self.keys)} keys, not {count}")
        return took

    def wg_conf(self, n: int) -> Path:
        """A `wg setconf` file: the gateway's key and port, N peers with their /32."""
        if n not in self._wg_conf:
            path = self.workdir / f"wg-{n}.conf"
            lines = ["[Interface]", f"PrivateKey = {self.gw_key}", f"ListenPort = {WG_PORT}", ""]
            for pub, addr in self.keys[:n]:
                lines += ["[Peer]", f"PublicKey = {pub}", f"AllowedIPs = {addr}/32", ""]
            path.write_text("\n".join(lines))
            path.chmod(0o600)
            self._wg_conf[n] = path
        return self._wg_conf[n]

    def toml(self, n: int) -> Path:
        """A `tunnelgate run` config: the tunnel, N [[peer]]s, the health endpoint on loopback."""
        if n not in self._toml:
            path = self.workdir / f"tunnelgate-{n}.toml"
            parts = [
                "# written by benches/peers/scale.py\n[interface]\n",
                f'name = "{self.ifname}"\nprivate_key_file = "{self.keyfile}"\nlisten_port = {WG_PORT}\n',
                f'addresses = ["{GATEWAY_TUNNEL}/32"]\nmtu = {MTU}\n\n',
                f'[health]\nlisten = "127.0.0.1:{HEALTH_PORT}"\n\n',
            ]
            parts += [f'[[peer]]\npublic_key = "{pub}"\nallowed_ips = ["{addr}/32"]\n\n' for pub, addr in self.keys[:n]]
            path.write_text("".join(parts))
            self._toml[n] = path
        return self._toml[n]


# --------------------------------------------------------------------------------------------------
# Gateways
# --------------------------------------------------------------------------------------------------


class UapiGateway(Daemon):
    """A bare interface configured with `wg`: `tunnelgate userspace -f` or wireguard-go."""

    def __init__(self, ctx: Context, impl: str):
        super().__init__(ctx.gw_ns, ctx.ifname, ctx.workdir)
        self.ctx, self.kind = ctx, impl
        self.logfile = ctx.workdir / f"{impl}.log"

    def start(self) -> float:
        """Starts the process; returns the seconds until its UAPI socket exists."""
        self.sock().unlink(missing_ok=True)  # a SIGKILLed one leaves it behind
        t0 = time.monotonic()
        if self.kind == "tunnelgate":
            self.spawn([self.ctx.tunnelgate, "userspace", "-f", self.ifname], {"RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        else:
            assert self.ctx.wggo
            self.spawn([self.ctx.wggo, "-f", self.ifname], {"WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"})
        self.wait_socket(30)
        return time.monotonic() - t0

    def wg(self, *args: str, timeout: float = 900) -> tuple[float, subprocess.CompletedProcess]:
        return timed(lambda: nsx(self.ns, "wg", *args, timeout=timeout))

    def configure(self, n: int) -> float:
        """`wg setconf` of N peers (returns its time), then the address, MTU and a route to the peers."""
        took, _ = self.wg("setconf", self.ifname, str(self.ctx.wg_conf(n)))
        nsx(self.ns, "ip", "addr", "add", f"{GATEWAY_TUNNEL}/32", "dev", self.ifname)
        nsx(self.ns, "ip", "link", "set", "dev", self.ifname, "mtu", str(MTU), "up")
        nsx(self.ns, "ip", "route", "add", PEER_NET, "dev", self.ifname)
        return took


class ConfigGateway(Daemon):
    """`tunnelgate run --config` with N [[peer]]s; ready when /readyz says 200."""

    kind = "tunnelgate-run"

    def __init__(self, ctx: Context, n: int):
        super().__init__(ctx.gw_ns, ctx.ifname, ctx.workdir)
        self.ctx, self.n = ctx, n
        self.logfile = ctx.workdir / f"tunnelgate-run-{n}.log"

    def poller(self, timeout: float) -> subprocess.Popen:
        """A /readyz poller in the namespace, up and polling when this returns (so that a start's
        time to ready excludes the poller's own start, and a restart need not wait for it)."""
        poller = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "python3", "-c", NS_HTTP, str(HEALTH_PORT), "/readyz", "poll", str(timeout)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert poller.stdout is not None
        if poller.stdout.readline().strip() != "polling":
            terminate_process(poller, 1)
            raise CommandFailed("the /readyz poller did not start")
        return poller

    def start(self, timeout: float, poller: subprocess.Popen | None = None) -> dict:
        """Starts it; returns the seconds to its UAPI socket and to /readyz 200 (from the spawn).
        `poller`: one started beforehand (`poller()`), else one is started first."""
        config = self.ctx.toml(self.n)
        self.sock().unlink(missing_ok=True)
        poller = poller or self.poller(timeout)
        try:
            assert poller.stdout is not None
            t0 = time.monotonic()
            # A stale log (from an earlier start of the same N) must not be appended to.
            self.spawn([self.ctx.tunnelgate, "run", "--config", str(config)], {"RUST_LOG": os.environ.get("RUST_LOG", "warn")})
            socket_s = None
            if wait_for(lambda: self.sock().exists() or not self.alive(), timeout, 0.01) and self.alive():
                socket_s = time.monotonic() - t0
            line = poller.stdout.readline()
            try:
                answer = json.loads(line) if line else {"error": "the poller exited"}
            except json.JSONDecodeError:
                answer = {"error": f"poller: {line.strip()}"}
            if "ready_mono" not in answer or not self.alive():
                raise CommandFailed(f"tunnelgate run not ready: {answer.get('error', 'exited')}: {tail(self.logfile, 6)}")
            return {"to_socket_s": r3(socket_s), "to_ready_s": r3(answer["ready_mono"] - t0), "spawn_mono": t0, "ready_mono": answer["ready_mono"]}
        finally:
            terminate_process(poller, 1)

    def http(self, path: str) -> dict:
        p = nsx(self.ns, "python3", "-c", NS_HTTP, str(HEALTH_PORT), path, "get", "0", timeout=120, check=False)
        try:
            return json.loads(p.stdout)
        except json.JSONDecodeError:
            return {"error": (p.stderr or p.stdout).strip()[-300:]}


def stop_timed(d: Daemon, grace: float = 60) -> float | None:
    """SIGTERM, and the seconds until the process exited (None: it had to be killed)."""
    if d.proc is None or d.proc.poll() is not None:
        return None
    t0 = time.monotonic()
    d.proc.terminate()
    try:
        d.proc.wait(grace)
        took: float | None = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        d.proc.kill()
        d.proc.wait()
        took = None
    d.sock().unlink(missing_ok=True)
    return took


def kill_hard(d: Daemon) -> float:
    """SIGKILL; returns the monotonic time at which the process was gone."""
    assert d.proc is not None
    d.proc.kill()
    d.proc.wait()
    return time.monotonic()


# --------------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------------


class Sim:
    """`peersim run` in the peers namespace: its JSON lines collected by a reader thread."""

    def __init__(self, ctx: Context, active: int, gateway_pub: str):
        a = ctx.args
        self.log = ctx.workdir / f"peersim-{active}.err"
        cmd = [
            "ip", "netns", "exec", ctx.peers_ns, ctx.sim, "run",
            "--seed", ctx.seed, "--count", str(active),
            "--gateway-key", gateway_pub, "--endpoint", f"{GW_UNDERLAY}:{WG_PORT}", "--gateway-ip", GATEWAY_TUNNEL,
            "--source-net", SOURCE_NET, "--threads", str(a.sim_threads),
            "--ping-interval", str(a.ping_interval), "--keepalive", "25",
        ]  # fmt: skip
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, start_new_session=True)
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.events.append(ev)
                self.cond.notify_all()
        with self.cond:
            self.events.append({"event": "eof"})
            self.cond.notify_all()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, pred, timeout: float, since: int = 0) -> dict | None:
        """The first event from index `since` on that satisfies `pred`, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        i = since
        with self.cond:
            while True:
                while i < len(self.events):
                    ev = self.events[i]
                    i += 1
                    if pred(ev):
                        return ev
                    if ev["event"] == "eof":
                        return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def count(self) -> int:
        with self.cond:
            return len(self.events)

    def stats_between(self, t0: float, t1: float) -> list[dict]:
        with self.cond:
            return [e for e in self.events if e["event"] == "stats" and t0 <= e["mono"] <= t1]

    def settle(self, t: float, timeout: float = 5) -> None:
        """Waits until the stats line of the interval that holds monotonic time `t` is in (the
        line comes at the interval's end: an event inside it is known before its counts are)."""
        self.wait(lambda e: e["event"] == "stats" and e["mono"] >= t, timeout)

    def last_stats(self) -> dict | None:
        with self.cond:
            return next((e for e in reversed(self.events) if e["event"] == "stats"), None)

    def stop(self) -> dict | None:
        """Closes stdin (peersim stops) and returns its exit event."""
        n = self.count()
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        ev = self.wait(lambda e: e["event"] == "exit", 15, n)
        terminate_process(self.proc, 5)
        return ev


TIMELINE_KEYS = ("working", "with_session", "init_sent", "hs_done", "hs_answered", "cookies", "pings", "pings_unsent", "replies", "mark", "mark_handshaked", "mark_replied")


def timeline(sim: Sim) -> dict:
    """peersim's stats lines, compact: one row per interval (columns named in `columns`), and
    its other events; times in seconds from its start."""
    with sim.cond:
        events = list(sim.events)
    start = next((e["mono"] for e in events if e["event"] == "start"), None)
    if start is None:
        return {}
    rows, other = [], []
    for e in events:
        if e["event"] == "stats":
            rows.append([round(e["mono"] - start, 3), *(e.get(k) for k in TIMELINE_KEYS), e["rtt_ms"]["p99"], e["cpu_s"], e["rss_mib"], e.get("errors") or None])
        elif e["event"] not in ("peer", "eof"):
            other.append({**e, "t": round(e["mono"] - start, 3)} if "mono" in e else e)
    return {"columns": ["t", *TIMELINE_KEYS, "rtt_p99_ms", "sim_cpu_s", "sim_rss_mib", "errors"], "rows": rows, "events": other}


def sum_stats(lines: list[dict], key: str) -> int:
    return sum(e.get(key, 0) for e in lines)


def sim_cpu_rate(lines: list[dict]) -> float | None:
    """peersim's CPU seconds per second over the stats lines (first to last)."""
    if len(lines) < 2 or lines[-1]["mono"] <= lines[0]["mono"]:
        return None
    return round((lines[-1]["cpu_s"] - lines[0]["cpu_s"]) / (lines[-1]["mono"] - lines[0]["mono"]), 3)


# --------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------


# `wg set` of one peer among N: how many times (the median is reported).
SET_ONE_SAMPLES = 5


def uapi_step(ctx: Context, impl: str, n: int) -> dict:
    r: dict = {"step": "uapi", "impl": impl if impl == "tunnelgate" else WGGO, "configured": n}
    if impl == "tunnelgate":
        r["daemon"] = "tunnelgate userspace -f"
    if impl != "tunnelgate" and n > WGGO_MAX_PEERS:
        return {**r, "status": "skipped", "reason": f"wireguard-go refuses more than {WGGO_MAX_PEERS} peers (device.MaxPeers)"}
    d = UapiGateway(ctx, impl)
    try:
        r["start_to_socket_s"] = r3(d.start())
        r["rss_idle_mib"] = rss_mib(d.pid)
        took, _ = d.wg("setconf", d.ifname, str(ctx.wg_conf(n)))
        r["setconf_s"] = r3(took)
        r["rss_after_setconf_mib"] = rss_mib(d.pid)
        took, _ = d.wg("syncconf", d.ifname, str(ctx.wg_conf(n)))
        r["syncconf_unchanged_s"] = r3(took)
        # One `wg set` is a few milliseconds, of which the `wg` process is most: one sample is
        # noise (the other CPU busy for a moment), so the median of five, alternating the
        # peer's second allowed IP so each set changes something.
        pub, addr = ctx.keys[n // 2]
        sets = []
        for i in range(SET_ONE_SAMPLES):
            took, _ = d.wg("set", d.ifname, "peer", pub, "allowed-ips", f"{addr}/32,10.204.0.{1 + i}/32")
            sets.append(r3(took))
        r["set_one_peer_samples_s"] = sets
        r["set_one_peer_s"] = statistics.median(sets)
        took, p = d.wg("show", d.ifname, "dump")
        r["show_dump_s"] = r3(took)
        r["dump_peers"] = len(p.stdout.splitlines()) - 1
        if r["dump_peers"] != n:
            raise CommandFailed(f"wg show dump listed {r['dump_peers']} peers, not {n}")
        r["rss_end_mib"] = rss_mib(d.pid)
        r["peak_rss_mib"] = rss_mib(d.pid, "VmHWM")
        cpu = cpu_ticks(d.pid)
        r["cpu_s"] = None if cpu is None else round(cpu / CLK_TCK, 2)
        r["stop_s"] = r3(stop_timed(d))
        r["status"] = "ok"
    except (CommandFailed, subprocess.SubprocessError, OSError) as e:
        r.update(status="error", reason=f"{e}"[:1000] + (f"; log: {tail(d.logfile, 5)}" if d.proc else ""))
    finally:
        d.stop()
    return r


# Seconds of rest over which the config step measures the gateway's CPU with no traffic.
IDLE_WINDOW_S = 10


def config_step(ctx: Context, n: int) -> dict:
    r: dict = {"step": "config", "impl": "tunnelgate", "daemon": "tunnelgate run --config", "configured": n}
    d = ConfigGateway(ctx, n)
    try:
        started = d.start(ctx.args.ready_timeout)
        r["start_to_socket_s"], r["start_to_ready_s"] = started["to_socket_s"], started["to_ready_s"]
        r["rss_ready_mib"] = rss_mib(d.pid)
        r["metrics_first"] = d.http("/metrics")
        r["metrics"] = d.http("/metrics")
        took, p = timed(lambda: nsx(d.ns, "wg", "show", d.ifname, "dump", timeout=900))
        r["show_dump_s"] = r3(took)
        r["dump_peers"] = len(p.stdout.splitlines()) - 1
        routes = nsx(d.ns, "ip", "-4", "route", "show", "dev", d.ifname, timeout=120, check=False).stdout
        r["routes_installed"] = len(routes.splitlines())
        # At rest: N configured peers and no traffic should cost (next to) nothing; a timer that
        # walked every peer each 100 ms took 29 % of a core at 100,000.
        before = cpu_ticks(d.pid)
        time.sleep(IDLE_WINDOW_S)
        after = cpu_ticks(d.pid)
        r["idle_cpu_share"] = None if before is None or after is None else round((after - before) / CLK_TCK / IDLE_WINDOW_S, 3)
        r["rss_end_mib"] = rss_mib(d.pid)
        r["peak_rss_mib"] = rss_mib(d.pid, "VmHWM")
        cpu = cpu_ticks(d.pid)
        r["cpu_s"] = None if cpu is None else round(cpu / CLK_TCK, 2)
        r["stop_s"] = r3(stop_timed(d))
        r["status"] = "ok"
    except (CommandFailed, subprocess.SubprocessError, OSError) as e:
        r.update(status="error", reason=f"{e}"[:1000])
    finally:
        d.stop()
    return r


class ActiveGateway:
    """The gateway of an active step, startable again after a SIGKILL with the same key and config."""

    def __init__(self, ctx: Context, impl: str, n: int):
        self.ctx, self.impl, self.n = ctx, impl, n
        self.d: Daemon | None = None
        self.next_poller: subprocess.Popen | None = None

    def prepare(self) -> None:
        """Before a kill: what the restart needs ready, so it follows the kill at once."""
        if self.impl == "tunnelgate":
            self.next_poller = ConfigGateway(self.ctx, self.n).poller(self.ctx.args.ready_timeout)

    def start(self) -> dict:
        """Returns {'to_ready_s': seconds from the spawn to ready, 'spawn_mono', 'ready_mono': when}."""
        if self.impl == "tunnelgate":
            g = ConfigGateway(self.ctx, self.n)
            self.d = g
            poller, self.next_poller = self.next_poller, None
            return g.start(self.ctx.args.ready_timeout, poller)
        u = UapiGateway(self.ctx, self.impl)
        self.d = u
        t0 = time.monotonic()
        u.start()
        u.configure(self.n)
        t1 = time.monotonic()
        return {"to_ready_s": r3(t1 - t0), "spawn_mono": t0, "ready_mono": t1}

    @property
    def pid(self) -> int:
        assert self.d is not None
        return self.d.pid

    def stop(self) -> None:
        if self.next_poller is not None:
            terminate_process(self.next_poller, 1)
        if self.d is not None:
            self.d.stop()


def active_step(ctx: Context, impl: str, n: int, a: int) -> dict:
    args = ctx.args
    r: dict = {"step": "active", "impl": impl if impl == "tunnelgate" else WGGO, "configured": n, "active": a}
    if impl == "tunnelgate":
        r["daemon"] = "tunnelgate run --config"
    if impl != "tunnelgate" and n > WGGO_MAX_PEERS:
        return {**r, "status": "skipped", "reason": f"wireguard-go refuses more than {WGGO_MAX_PEERS} peers (device.MaxPeers)"}
    gw = ActiveGateway(ctx, impl, n)
    sim: Sim | None = None
    try:
        r["gateway_start"] = {k: v for k, v in gw.start().items() if not k.endswith("_mono")}
        r["gateway_rss_idle_mib"] = rss_mib(gw.pid)
        sim = Sim(ctx, a, ctx.gw_pub)
        ready = sim.wait(lambda e: e["event"] in ("ready", "error"), 120)
        if not ready or ready["event"] != "ready":
            raise CommandFailed(f"peersim did not start: {ready or tail(sim.log, 5)}")
        r["sim_setup_s"] = ready["setup_s"]
        start = sim.wait(lambda e: e["event"] == "start", 10)
        if not start:
            raise CommandFailed("peersim did not start its peers")
        t_start = start["mono"]
        gw_cpu0 = cpu_ticks(gw.pid) or 0

        # 1. The handshake wave: every peer initiated at t_start.
        ev = sim.wait(lambda e: e["event"] == "all_handshaked" and e["mark"] == 0, args.wave_timeout)
        t_end = ev["at_mono"] if ev else time.monotonic()
        sim.settle(t_end)
        lines = sim.stats_between(t_start, t_end + 1.01)
        burst = sim.wait(lambda e: e["event"] == "burst" and e["kind"] == "start", 1)
        wave: dict = {
            "initiations_burst_s": burst["took_s"] if burst else None,
            "initiations_sent": sum_stats(lines, "init_sent"),
            "cookie_replies": sum_stats(lines, "cookies"),
            "peak_handshakes_per_s": max((e["hs_done"] + e["hs_answered"] for e in lines), default=0),
        }
        if ev:
            wave.update(complete=True, all_handshaked_s=ev["after_s"], mean_rate_per_s=round(a / ev["after_s"], 1) if ev["after_s"] > 0 else None, per_peer_s=ev["per_peer_s"])
        else:
            last = sim.last_stats()
            wave.update(complete=False, reason=f"not every peer handshaked within {args.wave_timeout:g} s", handshaked=last and last["mark_handshaked"])
        wave["gateway_cpu_s"] = round(((cpu_ticks(gw.pid) or 0) - gw_cpu0) / CLK_TCK, 2)
        wave["sim_cpu_per_s"] = sim_cpu_rate(sim.stats_between(t_start - 1, t_end + 1.01))
        r["handshake_wave"] = wave
        back = sim.wait(lambda e: e["event"] == "all_replied" and e["mark"] == 0, args.wave_timeout)
        if not back:
            last = sim.last_stats()
            raise CommandFailed(f"not every peer had a ping reply within {args.wave_timeout:g} s of the start ({last and last['working']} of {a} working)")
        r["all_replied_after_start_s"] = back["after_s"]

        # 2. Round trips at rest.
        n0 = sim.count()
        sim.send("window-start rest")
        gw_cpu0 = cpu_ticks(gw.pid) or 0
        t0 = time.monotonic()
        time.sleep(args.window)
        sim.send("window-stop")
        w = sim.wait(lambda e: e["event"] == "window", 10, n0)
        t1 = time.monotonic()
        rest_lines = sim.stats_between(t0, t1)
        r["rest"] = {
            "window": w,
            "gateway_cpu_per_s": round(((cpu_ticks(gw.pid) or 0) - gw_cpu0) / CLK_TCK / (t1 - t0), 3),
            "sim_cpu_per_s": sim_cpu_rate(rest_lines),
            "sim_rss_mib": max((e["rss_mib"] for e in rest_lines), default=None),
            "working_min": min((e["working"] for e in rest_lines), default=None),
        }
        r["gateway_rss_active_mib"] = rss_mib(gw.pid)

        # 3. Everyone rekeys at once; the round trips of the pings sent meanwhile.
        n0 = sim.count()
        sim.send("window-start rekey")
        gw_cpu0 = cpu_ticks(gw.pid) or 0
        sim.send("rekey")
        rk = sim.wait(lambda e: e["event"] == "rekey", 10, n0)
        if not rk:
            raise CommandFailed("peersim did not acknowledge the rekey")
        ev = sim.wait(lambda e: e["event"] == "all_handshaked" and e["mark"] == rk["mark"], args.wave_timeout, n0)
        t_hs = ev["at_mono"] if ev else time.monotonic()
        # The pings sent until then need a round trip to come back.
        time.sleep(2 * args.ping_interval + 0.5)
        sim.send("window-stop")
        w = sim.wait(lambda e: e["event"] == "window" and e["label"] == "rekey", 10, n0)
        sim.settle(t_hs)
        lines = sim.stats_between(rk["mono"], t_hs + 1.01)
        burst = sim.wait(lambda e: e["event"] == "burst" and e["kind"] == "rekey", 1, n0)
        rekey: dict = {
            "window": w,
            "initiations_burst_s": burst["took_s"] if burst else None,
            "cookie_replies": sum_stats(lines, "cookies"),
            "peak_handshakes_per_s": max((e["hs_done"] + e["hs_answered"] for e in lines), default=0),
            "gateway_cpu_s": round(((cpu_ticks(gw.pid) or 0) - gw_cpu0) / CLK_TCK, 2),
            "sim_cpu_per_s": sim_cpu_rate(sim.stats_between(rk["mono"] - 1, t_hs + 1.01)),
        }
        if ev:
            rekey.update(complete=True, all_handshaked_s=ev["after_s"], mean_rate_per_s=round(a / ev["after_s"], 1) if ev["after_s"] > 0 else None, per_peer_s=ev["per_peer_s"])
        else:
            last = sim.last_stats()
            rekey.update(complete=False, reason=f"not every peer handshaked within {args.wave_timeout:g} s", handshaked=last and last["mark_handshaked"])
        r["rekey"] = rekey
        # Let stragglers (cookie retries) settle before the restart.
        settled = sim.wait(lambda e: e["event"] == "stats" and e["working"] == a, 30, sim.count())
        last = settled or sim.last_stats()

        # 4. SIGKILL and restart; until every peer has a reply to a ping sent after the kill.
        gw.prepare()
        n0 = sim.count()
        t_dead = kill_hard(gw.d)  # type: ignore[arg-type]
        sim.send(f"mark {t_dead:.6f}")
        mk = sim.wait(lambda e: e["event"] == "mark", 10, n0)
        if not mk:
            raise CommandFailed("peersim did not acknowledge the mark")
        if args.restart_delay > 0:
            time.sleep(args.restart_delay)
        started = gw.start()
        ev = sim.wait(lambda e: e["event"] == "all_replied" and e["mark"] == mk["mark"], args.restart_timeout, n0)
        t_back = ev["at_mono"] if ev else time.monotonic()
        sim.settle(t_back)
        lines = sim.stats_between(t_dead, t_back + 1.01)
        restart: dict = {
            "working_before_kill": last and last["working"],
            "kill_to_restart_s": r3(started["spawn_mono"] - t_dead),
            "restart_to_ready_s": started["to_ready_s"],
            "takeover_handshakes": sum_stats(lines, "hs_answered"),
            "cookie_replies": sum_stats(lines, "cookies"),
            "peer_initiated_handshakes": sum_stats(lines, "hs_done"),
            "ping_interval_s": args.ping_interval,
        }
        if ev:
            restart.update(
                complete=True,
                all_back_after_kill_s=ev["after_s"],
                all_back_after_ready_s=r3(ev["at_mono"] - started["ready_mono"]),
                per_peer_after_kill_s=ev["per_peer_s"],
            )
        else:
            last = sim.last_stats()
            restart.update(complete=False, reason=f"not every peer had a reply within {args.restart_timeout:g} s", back=last and last["mark_replied"])
        r["restart"] = restart
        r["gateway_rss_end_mib"] = rss_mib(gw.pid)
        r["status"] = "ok"
    except (CommandFailed, subprocess.SubprocessError, OSError) as e:
        r.update(status="error", reason=f"{e}"[:1000])
    finally:
        if sim is not None:
            ex = sim.stop()
            r["sim_exit"] = ex
            r["timeline"] = timeline(sim)
            r["sim_peak_rss_mib"] = max((e.get("rss_mib", 0) for e in sim.events if e["event"] == "stats"), default=None)
        gw.stop()
    return r


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def fmt(x, unit: str = "", digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def report(results: dict) -> str:
    out = []
    uapi = [r for r in results["steps"] if r["step"] == "uapi"]
    if uapi:
        out.append("UAPI (wg) against a bare interface: seconds, RSS in MiB")
        head = ("impl", "N", "setconf", "syncconf (same)", "set 1 peer", "show dump", "RSS after setconf", "stop")
        rows = [head]
        for r in uapi:
            if r["status"] != "ok":
                rows.append((r["impl"], str(r["configured"]), f"{r['status']}: {r.get('reason', '')[:90]}"))
                continue
            rows.append((r["impl"], str(r["configured"]), fmt(r["setconf_s"], "", 3), fmt(r["syncconf_unchanged_s"], "", 3), fmt(r["set_one_peer_s"], "", 3),
                         fmt(r["show_dump_s"], "", 3), fmt(r["rss_after_setconf_mib"], "", 1), fmt(r["stop_s"], "", 3)))  # fmt: skip
        out += table(rows) + [""]
    cfg = [r for r in results["steps"] if r["step"] == "config"]
    if cfg:
        out.append("tunnelgate run --config with N [[peer]]s: seconds, RSS in MiB")
        head = ("N", "to socket", "to /readyz 200", "RSS", "/metrics bytes", "/metrics s", "show dump", "routes", "idle CPU", "stop")
        rows = [head]
        for r in cfg:
            if r["status"] != "ok":
                rows.append((str(r["configured"]), f"{r['status']}: {r.get('reason', '')[:90]}"))
                continue
            m = r.get("metrics") or {}
            if "error" in m:
                m = {"bytes": f"error after {m.get('seconds')} s"}
            rows.append((str(r["configured"]), fmt(r["start_to_socket_s"], "", 3), fmt(r["start_to_ready_s"], "", 3), fmt(r["rss_ready_mib"], "", 1), fmt(m.get("bytes")) + (" (cut)" if m.get("truncated") else ""),
                         fmt(m.get("seconds"), "", 3), fmt(r["show_dump_s"], "", 3), fmt(r["routes_installed"]), fmt(r.get("idle_cpu_share"), "", 3), fmt(r["stop_s"], "", 3)))  # fmt: skip
        out += table(rows) + [""]
    act = [r for r in results["steps"] if r["step"] == "active"]
    if act:
        out.append("active peers (peersim): handshake wave (all at once), ping RTT ms at rest and while all rekey, all back after SIGKILL + restart")
        head = ("impl", "N", "A", "wave: all in s", "rate/s mean/peak", "cookies", "rest p50/p99", "rekey: all in s", "rekey p99/max", "restart: ready s", "all back s (after kill)", "by takeover/own", "sim CPU/RSS")
        rows = [head]
        for r in act:
            if r["status"] == "skipped":
                rows.append((r["impl"], str(r["configured"]), str(r["active"]), f"skipped: {r['reason'][:90]}"))
                continue
            wv, rs, rk, rt = r.get("handshake_wave", {}), r.get("rest", {}), r.get("rekey", {}), r.get("restart", {})
            rw = (rs.get("window") or {}).get("rtt_ms", {})
            kw = (rk.get("window") or {}).get("rtt_ms", {})
            row = (
                r["impl"], str(r["configured"]), str(r["active"]),
                fmt(wv.get("all_handshaked_s"), "", 2) if wv.get("complete") else f"incomplete ({wv.get('handshaked')})" if wv else "-",
                f"{fmt(wv.get('mean_rate_per_s'), '', 0)}/{fmt(wv.get('peak_handshakes_per_s'))}" if wv else "-",
                fmt(wv.get("cookie_replies")),
                f"{fmt(rw.get('p50'), '', 2)}/{fmt(rw.get('p99'), '', 2)}" if rw else "-",
                fmt(rk.get("all_handshaked_s"), "", 2) if rk.get("complete") else f"incomplete ({rk.get('handshaked')})" if rk else "-",
                f"{fmt(kw.get('p99'), '', 1)}/{fmt(kw.get('max'), '', 1)}" if kw else "-",
                fmt(rt.get("restart_to_ready_s"), "", 2),
                fmt(rt.get("all_back_after_kill_s"), "", 2) if rt.get("complete") else f"incomplete ({rt.get('back')})" if rt else "-",
                f"{fmt(rt.get('takeover_handshakes'))}/{fmt(rt.get('peer_initiated_handshakes'))}" if rt else "-",
                f"{fmt(rs.get('sim_cpu_per_s'), '', 2)}/{fmt(rs.get('sim_rss_mib'), '', 0)}" if rs else "-",
            )  # fmt: skip
            rows.append(row)
            if r["status"] != "ok":
                rows.append(("", "", "", f"error: {r.get('reason', '')[:150]}"))
        out += table(rows)
    return "\n".join(out)


def table(rows: list[tuple]) -> list[str]:
    full = [r for r in rows if len(r) == len(rows[0])]
    widths = [max(len(r[i]) for r in full) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        if len(r) == len(rows[0]):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
        if r is rows[0]:
            lines.append("  ".join("-" * w for w in widths))
    return lines


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def build_sim(workdir: Path) -> str:
    log("==> cargo build --release --manifest-path benches/peers/sim/Cargo.toml")
    logf = workdir / "sim-build.log"
    with open(logf, "w") as out:
        rc = subprocess.call(["cargo", "build", "--release", "--manifest-path", str(SIM_DIR / "Cargo.toml")], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        raise CommandFailed(f"building peersim failed ({rc}): {tail(logf, 8)}")
    return str(SIM_DIR / "target" / "release" / "peersim")


def counts(text: str, what: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--{what} {text}: expected numbers like 1000,10000")
    if not xs or xs[0] < 1 or xs[-1] > 260_096:
        ap.error(f"--{what}: counts from 1 to 260,096 (peersim's tunnel addresses)")
    return xs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configured", default="1000,10000,100000", help="configured peer counts N (default %(default)s)")
    ap.add_argument("--active", default="1000,10000", help="active (simulated) peer counts A, each run with every N >= A (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="N 1000,10000 and A 1000, shorter windows")
    ap.add_argument("--steps", default="uapi,config,active", help="which steps (default %(default)s)")
    ap.add_argument("--impls", default=f"tunnelgate,{WGGO}", help="gateways (default %(default)s)")
    ap.add_argument("--binary", metavar="PATH", help="the tunnelgate to measure (default: this tree's target/release/tunnelgate, built first)")
    ap.add_argument("--no-build", action="store_true", help="use target/release/tunnelgate and the peersim build as they are")
    ap.add_argument("--wggo", metavar="PATH", help=f"the {WGGO} binary (default ../shared/bin/{WGGO})")
    ap.add_argument("--sim", metavar="PATH", help="the peersim binary (default: benches/peers/sim, built first)")
    ap.add_argument("--sim-threads", type=int, default=1, help="peersim's worker threads (default 1: on 2 CPUs the other is the gateway's)")
    ap.add_argument("--ping-interval", type=float, default=1.0, help="seconds between one peer's pings (default 1)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of pings at rest (default 10; --quick 5)")
    ap.add_argument("--wave-timeout", type=float, default=120.0, help="seconds for all peers to handshake (default 120; --quick 60)")
    ap.add_argument("--restart-timeout", type=float, default=120.0, help="seconds for all peers to be back after a restart (default 120; --quick 60)")
    ap.add_argument("--restart-delay", type=float, default=0.0, help="seconds between the SIGKILL and the restart (default 0)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for tunnelgate run to be ready (default 600)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs and configs")
    add_output_args(ap, "peers")
    for action in ap._actions:  # the shared --publish names bench.py's file: this one writes its own
        if "--publish" in action.option_strings:
            action.help = "write benches/peers/results/scale-latest.json, the committed figures (do it when you commit new figures)"
        elif "--out" in action.option_strings:
            action.help = "results JSON (default $TUNNELGATE_BENCH_OUT/peers/scale-latest.json, else /tmp/tunnelgate-bench/peers/scale-latest.json)"
    args = ap.parse_args()
    if args.quick:
        args.configured, args.active = "1000,10000", "1000"
        args.window, args.wave_timeout, args.restart_timeout = 5.0, 60.0, 60.0
    configured = counts(args.configured, "configured", ap)
    active = counts(args.active, "active", ap)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if any(s not in ("uapi", "config", "active") for s in steps):
        ap.error("--steps: a subset of uapi,config,active")
    if any(i not in ("tunnelgate", WGGO) for i in impls):
        ap.error(f"--impls: a subset of tunnelgate,{WGGO}")
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces)")
    missing = [t for t in ("wg", "ip", "python3") if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)}")
    # Beside bench.py's results, under a name of its own (never its latest.json).
    try:
        if args.publish:
            out = REPO / "benches" / "peers" / "results" / "scale-latest.json"
        else:
            out = results_path(args, "peers")
            if not args.out:
                out = out.with_name("scale-latest.json")
    except CommandFailed as e:
        ap.error(str(e))

    raise_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="tunnelgate-scale-"))
    load_start = open("/proc/loadavg").read().split()[:3]
    if float(load_start[0]) > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_start[0]} before the benchmark: other work will skew the figures")
    results: dict = {
        "meta": {
            "benchmark": "peers/scale (concentrator)",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "configured": configured,
            "active": active,
            "steps": steps,
            "impls": impls,
            "quick": args.quick,
            "ping_interval_s": args.ping_interval,
            "sim_threads": args.sim_threads,
            "window_s": args.window,
            "loadavg_start": load_start,
            "topology": {"gateway_underlay": GW_UNDERLAY, "sim_underlay": SIM_UNDERLAY, "sim_sources": SOURCE_NET, "gateway_tunnel": GATEWAY_TUNNEL, "peer_tunnels": PEER_NET},
        },
        "steps": [],
    }
    ctx: Context | None = None
    interrupted = False
    try:
        sweep_stale(NS_PREFIX + r"(\d+)[gp]", IF_PREFIX + r"(\d+)t\.sock")
        tunnelgate = args.binary or str(REPO / "target" / "release" / "tunnelgate")
        if not args.binary and not args.no_build:
            tunnelgate = build_release_tunnelgate(workdir / "cargo-build.log")
        sim = args.sim or (str(SIM_DIR / "target" / "release" / "peersim") if args.no_build else build_sim(workdir))
        for path, what in ((tunnelgate, "tunnelgate"), (sim, "peersim")):
            if not os.access(path, os.X_OK):
                raise CommandFailed(f"{what}: {path} is not an executable")
        wggo = None
        if WGGO in impls:
            wggo = wggo_path(args.wggo)
        results["meta"]["binaries"] = {
            "tunnelgate": tunnelgate,
            "tunnelgate_version": version_of([tunnelgate, "--version"]),
            "tunnelgate_is_this_tree": not args.binary,
            WGGO: wggo,
            f"{WGGO}_version": version_of([wggo, "--version"]) if wggo else None,
            "peersim": sim,
            "wg": version_of(["wg", "--version"]),
        }
        ctx = Context(args, workdir, tunnelgate, wggo, sim)
        ctx.setup()
        results["meta"]["keygen_s"] = r3(ctx.make_keys(max(configured)))
        log(f"==> {max(configured)} peer keys in {results['meta']['keygen_s']} s")
        for n in configured:
            plan = []
            if "uapi" in steps:
                plan += [("uapi", i, n, None) for i in impls]
            if "config" in steps and "tunnelgate" in impls:
                plan.append(("config", "tunnelgate", n, None))
            if "active" in steps:
                plan += [("active", i, n, a) for a in active if a <= n for i in impls]
            for step, impl, n_, a in plan:
                log(f"==> {step} {impl} N={n_}" + (f" A={a}" if a else ""))
                if step == "uapi":
                    r = uapi_step(ctx, impl, n_)
                elif step == "config":
                    r = config_step(ctx, n_)
                else:
                    r = active_step(ctx, impl, n_, a)  # type: ignore[arg-type]
                results["steps"].append(r)
                log("    " + summary(r))
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        results["meta"]["error"] = traceback.format_exc()[-2000:]
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ctx is not None:
            ctx.teardown()
        sweep_stale(NS_PREFIX + r"(\d+)[gp]", IF_PREFIX + r"(\d+)t\.sock")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if args.keep_logs:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    results["meta"]["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["meta"]["interrupted"] = interrupted
    results["meta"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    if interrupted:  # never replace complete figures with a partial run
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    m = results["meta"]
    print(f"\nconcentrator benchmark: commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, load {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}")
    print(f"peersim: {m['sim_threads']} thread(s), one ping per peer every {m['ping_interval_s']:g} s\n")
    print(report(results))
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


def summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('reason', '')[:300]}"
    if r["step"] == "uapi":
        return f"setconf {r['setconf_s']} s, syncconf {r['syncconf_unchanged_s']} s, set one {r['set_one_peer_s']} s, dump {r['show_dump_s']} s, RSS {r['rss_after_setconf_mib']} MiB"
    if r["step"] == "config":
        return f"ready in {r['start_to_ready_s']} s, RSS {r['rss_ready_mib']} MiB, /metrics {r['metrics'].get('bytes')} B in {r['metrics'].get('seconds')} s, stop {r['stop_s']} s"
    wv, rk, rt, rs = r["handshake_wave"], r["rekey"], r["restart"], r["rest"]
    return (
        f"wave {wv.get('all_handshaked_s')} s ({wv.get('cookie_replies')} cookies), rest p99 {rs['window']['rtt_ms']['p99'] if rs.get('window') else '-'} ms, "
        f"rekey {rk.get('all_handshaked_s')} s p99 {rk['window']['rtt_ms']['p99'] if rk.get('window') else '-'} ms, "
        f"all back {rt.get('all_back_after_kill_s')} s after kill, sim {rs.get('sim_cpu_per_s')} CPU"
    )


if __name__ == "__main__":
    sys.exit(main())
