#!/usr/bin/env python3
"""The AQM at WAN round-trip times: one TCP stream through tunnelgate with a delay element between
the two ends, the AQM on and off.

This kernel has no netem, so the delay is a userspace UDP relay (benches/wan/relay, a small Rust
program this script builds) in a namespace of its own, which holds every datagram for RTT/2 each
way. Every setup gets three namespaces and its own daemons and relay:

    a 10.95.1.2 --- 10.95.1.1 relay 10.95.2.1 --- 10.95.2.2 b       tunnel 10.100.0.1 -> 10.100.0.2

Setups: aqm-on (the daemons' defaults), aqm-off (TUNNELGATE_AQM_TARGET_US=0), and any added with
--daemon-env NAME:K=V[,K=V] (e.g. interval-100ms:TUNNELGATE_AQM_INTERVAL_US=100000). In each round,
for every added RTT (--rtt, ms) and congestion control (--congestion), every setup in a rotating
order: 50 idle pings, then one iperf3 TCP stream a -> b for DURATION s with pings every 10 ms from
2 s after its start to 1 s before its end. Reported: the stream's throughput and retransmits, the
receiving daemon's `aqm` drops (tunnelgate status --json), loaded ping p50/p99, and how late the
relay sent against its schedule. First, the relay alone (no tunnel): a probe at --probe-rate
datagrams/s through it at each RTT, its loss and one-way delay beyond the set one.

Usage: benches/wan/run.sh [--quick] [--rounds N] [--duration S] [--rtt 20,80] [--daemon-env NAME:K=V] [--out FILE | --publish]
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
    PID, REPO, CommandFailed, Daemon, add_ns, add_output_args, build_release_tunnelgate, genkey, git_commit, iperf3_server, kill_ns, log, nsx,
    process_facts, raise_on_signals, results_path, run, stop_process, sweep_stale, tail, wait_for,
)

NS_PREFIX = "tgwan"  # tgwan<pid>s<i><a|r|b>
IF_PREFIX = "tw"  # tw<pid>s<i><a|b>
ADDR = {"a": "10.95.1.2", "ra": "10.95.1.1", "rb": "10.95.2.1", "b": "10.95.2.2"}
TUNNEL = {"a": "10.100.0.1", "b": "10.100.0.2"}
PORT = 51820
PROBE_PORT = 9000
IPERF_PORT = 5201
MTU = 1420
PING_INTERVAL = 0.01
LOST_PING_MS = 1000.0
RELAY_DIR = HERE / "relay"
RELAY_TARGET = REPO / "target" / "wan-relay"
DEFAULT_SETUPS = {"aqm-on": {}, "aqm-off": {"TUNNELGATE_AQM_TARGET_US": "0"}}
# TCP buffers in the two ends' namespaces: large enough that the window is not what limits one
# stream at 80 ms (the defaults, 6 MB, cap it near 300 Mbit/s there).
TCP_MEM = "4096 131072 67108864"


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


def build_relay(workdir: Path) -> str:
    log("==> cargo build --release (benches/wan/relay)")
    logfile = workdir / "relay-build.log"
    with open(logfile, "w") as out:
        rc = subprocess.call(["cargo", "build", "--release", "--manifest-path", str(RELAY_DIR / "Cargo.toml"), "--target-dir", str(RELAY_TARGET)],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        raise CommandFailed(f"building the relay failed ({rc}): {tail(logfile, 8)}")
    return str(RELAY_TARGET / "release" / "tg-wan-relay")


class Relay:
    """The relay process in namespace `ns`, driven through its standard input."""

    def __init__(self, binary: str, ns: str, port: int, delay_us: int, fifo: bool):
        args = ["ip", "netns", "exec", ns, *(["chrt", "-f", "1"] if fifo else []), binary, "relay",
                f"{ADDR['ra']}:{port}", f"{ADDR['a']}:{port}", f"{ADDR['rb']}:{port}", f"{ADDR['b']}:{port}", str(delay_us)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if line != "relaying":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise CommandFailed(f"the relay did not start: {line} {err.strip()[-300:]}")

    def command(self, cmd: str) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(3)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait()


class Tg(Daemon):
    kind = "tunnelgate"


def tg_config(ifname: str, keyfile: Path, side: str, peer_pub: str) -> str:
    other = "b" if side == "a" else "a"
    endpoint = ADDR["ra"] if side == "a" else ADDR["rb"]
    return f"""# written by benches/wan/bench.py
[interface]
name = "{ifname}"
private_key_file = "{keyfile}"
listen_port = {PORT}
addresses = ["{TUNNEL[side]}/32"]
mtu = {MTU}

[[peer]]
public_key = "{peer_pub}"
endpoint = "{endpoint}:{PORT}"
allowed_ips = ["{TUNNEL[other]}/32"]

[health]
listen = ""
"""


class Setup:
    def __init__(self, index: int, name: str, env: dict[str, str], workdir: Path):
        self.index, self.name, self.env = index, name, env
        self.ns = {k: f"{NS_PREFIX}{PID}s{index}{k}" for k in "arb"}
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.created: list[str] = []
        self.daemons: dict[str, Tg] = {}
        self.relay: Relay | None = None
        self.status, self.reason = "pending", ""
        self.runs: list[dict] = []
        self.facts: dict = {}

    def build_net(self) -> None:
        for k in "arb":
            add_ns(self.ns[k])
            self.created.append(self.ns[k])
        for side in "ab":
            vr, vs = f"{IF_PREFIX}{PID}s{self.index}r{side}", f"{IF_PREFIX}{PID}s{self.index}v{side}"
            run(["ip", "link", "add", vr, "netns", self.ns["r"], "type", "veth", "peer", "name", vs, "netns", self.ns[side]])
            nsx(self.ns["r"], "ip", "addr", "add", f"{ADDR['r' + side]}/24", "dev", vr)
            nsx(self.ns[side], "ip", "addr", "add", f"{ADDR[side]}/24", "dev", vs)
            nsx(self.ns["r"], "ip", "link", "set", vr, "up")
            nsx(self.ns[side], "ip", "link", "set", vs, "up")
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                nsx(self.ns[side], "sysctl", "-q", "-w", f"{key}={TCP_MEM}")

    def start(self, binary: str, relay_binary: str, delay_us: int, fifo: bool) -> None:
        self.build_net()
        self.relay = Relay(relay_binary, self.ns["r"], PORT, delay_us, fifo)
        keys = {s: genkey() for s in "ab"}
        for side in "ab":
            d = Tg(self.ns[side], f"{IF_PREFIX}{PID}s{self.index}{side}", self.workdir)
            keyfile = self.workdir / f"{side}.key"
            keyfile.write_text(keys[side][0] + "\n")
            keyfile.chmod(0o600)
            config = self.workdir / f"{side}.toml"
            config.write_text(tg_config(d.ifname, keyfile, side, keys["b" if side == "a" else "a"][1]))
            d.spawn([binary, "run", "--config", str(config)], {"RUST_LOG": os.environ.get("RUST_LOG", "warn"), **self.env})
            d.wait_configured()
            self.daemons[side] = d
        if not wait_for(lambda: nsx(self.ns["a"], "ping", "-c", "1", "-W", "2", TUNNEL["b"], check=False).returncode == 0, 20, 0.2):
            raise CommandFailed(f"no ping through the tunnel within 20 s: {tail(self.daemons['b'].logfile, 5)}")
        self.facts = {s: process_facts(d.pid) for s, d in self.daemons.items()}
        self.status = "ok"

    def check_alive(self) -> None:
        for s, d in self.daemons.items():
            if not d.alive():
                raise CommandFailed(f"tunnelgate on side {s} exited: {tail(d.logfile)}")
        if self.relay and self.relay.proc.poll() is not None:
            raise CommandFailed("the relay exited")

    def drops(self, binary: str, side: str) -> dict[str, int]:
        p = run([binary, "status", "--json", "--interface", self.daemons[side].ifname], check=False, timeout=10)
        try:
            j = json.loads(p.stdout)
        except json.JSONDecodeError:
            return {}
        j = j[0] if isinstance(j, list) and j else j
        d = find_key(j, "drops")
        return {k: v for k, v in d.items() if isinstance(v, int)} if isinstance(d, dict) else {}

    def teardown(self) -> None:
        for d in self.daemons.values():
            try:
                d.stop()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"warning: stopping tunnelgate: {e}")
        if self.relay:
            self.relay.stop()
        for ns in self.created:
            kill_ns(ns)
        self.created.clear()


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


def ping(ns: str, dst: str, count: int, interval: float) -> dict:
    p = nsx(ns, "ping", "-n", "-i", str(interval), "-c", str(count), "-W", "1", dst, check=False, timeout=count * interval + 30)
    rtts = [float(m) for m in re.findall(r"time=([\d.]+) ms", p.stdout)]
    sent = re.search(r"(\d+) packets transmitted", p.stdout)
    n = int(sent.group(1)) if sent else count
    return {"rtt_ms": rtts, "sent": n, "lost": max(0, n - len(rtts))}


def relay_alone(setup: Setup, relay_binary: str, delay_us: int, rate: int, size: int, seconds: float, fifo: bool) -> dict:
    """A probe through a second relay instance (port PROBE_PORT) of `setup`'s namespaces, no
    tunnel: the relay's own loss and its one-way delay beyond `delay_us`."""
    relay = Relay(relay_binary, setup.ns["r"], PROBE_PORT, delay_us, fifo)
    rt = ["chrt", "-f", "1"] if fifo else []  # the probe's ends as the relay: their own wake-ups are not the relay's
    sink = subprocess.Popen(["ip", "netns", "exec", setup.ns["b"], *rt, relay_binary, "sink", f"{ADDR['b']}:{PROBE_PORT}", str(seconds + delay_us / 1e6 + 1)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        if not sink.stdout or sink.stdout.readline().strip() != "listening":
            raise CommandFailed("the probe sink did not start")
        probe = nsx(setup.ns["a"], *rt, relay_binary, "probe", f"{ADDR['ra']}:{PROBE_PORT}", str(rate), str(size), str(seconds), timeout=seconds + 30)
        out, _ = sink.communicate(timeout=seconds + 30)
        got = json.loads(out.strip().splitlines()[-1])
        sent = json.loads(probe.stdout.strip().splitlines()[-1])
        stats = relay.command("stats")
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
        relay.stop()
    one_way = delay_us
    return {
        "delay_us": delay_us, "rate_pps": rate, "size": size, "mbit_s": round(rate * size * 8 / 1e6, 1),
        "sent": sent["sent"], "received": got["received"], "lost": sent["sent"] - got["received"], "reordered": got["reordered"],
        "extra_delay_us_p50": got["delay_us_p50"] - one_way, "extra_delay_us_p99": got["delay_us_p99"] - one_way,
        "extra_delay_us_p999": got["delay_us_p999"] - one_way, "extra_delay_us_max": got["delay_us_max"] - one_way,
        "relay": stats.get("a_to_b"),
    }


def stream(setup: Setup, duration: int, congestion: str | None) -> subprocess.Popen:
    args = ["iperf3", "-c", TUNNEL["b"], "-p", str(IPERF_PORT), "-t", str(duration), "-J", "--connect-timeout", "5000"]
    if congestion:
        args += ["-C", congestion]
    return subprocess.Popen(["ip", "netns", "exec", setup.ns["a"], *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def measure(setup: Setup, binary: str, duration: int, congestion: str | None, rtt_ms: float) -> dict:
    r: dict = {}
    idle = ping(setup.ns["a"], TUNNEL["b"], 50, 0.02)
    r["idle_ping"] = {"p50_ms": percentile(idle["rtt_ms"], 50), "p99_ms": percentile(idle["rtt_ms"], 99), "lost": idle["lost"]}
    server = iperf3_server(setup.ns["b"], IPERF_PORT)
    try:
        drops0 = {s: setup.drops(binary, s) for s in "ab"}
        assert setup.relay
        setup.relay.command("stats")  # resets its counters
        proc = stream(setup, duration, congestion)
        time.sleep(2.0)
        window = max(1.0, duration - 3.0)
        loaded = ping(setup.ns["a"], TUNNEL["b"], int(window / PING_INTERVAL), PING_INTERVAL)
        out, err = proc.communicate(timeout=duration + 30)
        relay_stats = setup.relay.command("stats")
        drops1 = {s: setup.drops(binary, s) for s in "ab"}
    finally:
        stop_process(server)
    try:
        j = json.loads(out)
        if "error" in j:
            raise ValueError(j["error"])
        end = j["end"]
        r["bps"] = end["sum_received"]["bits_per_second"]
        r["retransmits"] = end["sum_sent"].get("retransmits")
    except (json.JSONDecodeError, KeyError, ValueError) as e:
        r["error"] = f"iperf3: {e} {err.strip()[-200:]}"
    lp = loaded["rtt_ms"] + [LOST_PING_MS] * loaded["lost"]
    r["loaded_ping"] = {"p50_ms": percentile(lp, 50), "p99_ms": percentile(lp, 99), "lost": loaded["lost"], "sent": loaded["sent"]}
    r["drops"] = {s: {k: drops1[s][k] - drops0[s].get(k, 0) for k in drops1[s] if drops1[s][k] - drops0[s].get(k, 0)} for s in "ab"}
    r["aqm_drops_b"] = r["drops"]["b"].get("aqm", 0)
    r["relay"] = relay_stats
    return r


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "mbit_s": med([r["bps"] / 1e6 for r in ok]),
        "mbit_s_min": min([r["bps"] / 1e6 for r in ok], default=None), "mbit_s_max": max([r["bps"] / 1e6 for r in ok], default=None),
        "retransmits": med([r["retransmits"] for r in ok if r.get("retransmits") is not None]),
        "aqm_drops_b": med([r["aqm_drops_b"] for r in ok]),
        "loaded_ping_p50_ms": med([r["loaded_ping"]["p50_ms"] for r in ok if r["loaded_ping"]["p50_ms"] is not None]),
        "loaded_ping_p99_ms": med([r["loaded_ping"]["p99_ms"] for r in ok if r["loaded_ping"]["p99_ms"] is not None]),
        "idle_ping_p50_ms": med([r["idle_ping"]["p50_ms"] for r in ok if r["idle_ping"]["p50_ms"] is not None]),
        "relay_late_us_p99": med([max(r["relay"]["a_to_b"]["late_us_p99"], r["relay"]["b_to_a"]["late_us_p99"]) for r in ok if "a_to_b" in r.get("relay", {})]),
        "runs": len(ok), "errors": len(runs) - len(ok),
    }


def report(results: dict) -> str:
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    head = ("RTT +ms", "congestion", "setup", "Mbit/s median (min-max)", "vs aqm-off", "retransmits", "aqm drops (b)", "idle ping p50",
            "loaded ping p50/p99 ms", "relay late p99 us")
    rows = [head]
    table = results["summary"]
    for key in sorted(table, key=lambda k: (float(k.split("|")[0]), k.split("|")[1])):
        rtt, cc = key.split("|")
        base = table[key].get("aqm-off", {}).get("mbit_s")
        for name, m in table[key].items():
            ratio = f"{m['mbit_s'] / base * 100:.0f} %" if base and m["mbit_s"] is not None and name != "aqm-off" else "-"
            rows.append((rtt, cc, name, f"{f(m['mbit_s'], '{:.0f}')} ({f(m['mbit_s_min'], '{:.0f}')}-{f(m['mbit_s_max'], '{:.0f}')})", ratio,
                         f(m["retransmits"], "{:.0f}"), f(m["aqm_drops_b"], "{:.0f}"), f(m["idle_ping_p50_ms"]),
                         f"{f(m['loaded_ping_p50_ms'])} / {f(m['loaded_ping_p99_ms'])}", f(m["relay_late_us_p99"], "{:.0f}")))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    out = []
    for i, r in enumerate(rows):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    for a in results.get("relay_alone", []):
        out.append(f"relay alone at +{2 * a['delay_us'] / 1000:g} ms RTT, {a['rate_pps']} x {a['size']} B/s ({a['mbit_s']} Mbit/s): lost {a['lost']}/{a['sent']}, "
                   f"reordered {a['reordered']}, one-way delay beyond {a['delay_us'] / 1000:g} ms p50/p99/p99.9/max "
                   f"{a['extra_delay_us_p50']}/{a['extra_delay_us_p99']}/{a['extra_delay_us_p999']}/{a['extra_delay_us_max']} us")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across setups (default 3)")
    ap.add_argument("--duration", type=int, default=15, help="seconds per stream (default 15)")
    ap.add_argument("--quick", action="store_true", help="1 round of 6 s streams")
    ap.add_argument("--rtt", default="20,80", help="added round-trip times in ms (default %(default)s)")
    ap.add_argument("--congestion", default="cubic,default", help="the stream's congestion controls, 'default' = the machine's (default %(default)s)")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="NAME:K=V[,K=V]",
                    help="a setup NAME whose daemons get this environment (repeatable), beside aqm-on and aqm-off")
    ap.add_argument("--setups", help="comma-separated subset of the setups (default: all: aqm-on, aqm-off and every --daemon-env)")
    ap.add_argument("--probe-rate", type=int, default=25000, help="datagrams/s of the relay-alone probe (default %(default)s, x 1400 B = 280 Mbit/s)")
    ap.add_argument("--relay-normal", action="store_true", help="run the relay at normal priority (default: SCHED_FIFO 1, so the delay element is not starved by the CPU it shares)")
    ap.add_argument("--tunnelgate", help="tunnelgate binary (default target/release/tunnelgate, built first)")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    add_output_args(ap, "wan")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration = 1, 6
    setups_env = dict(DEFAULT_SETUPS)
    for item in args.daemon_env:
        name, _, kvs = item.partition(":")
        if not name or not kvs or "=" not in kvs:
            ap.error(f"--daemon-env {item}: want NAME:K=V[,K=V]")
        setups_env[name] = {**setups_env.get(name, {}), **dict(kv.split("=", 1) for kv in kvs.split(",") if "=" in kv)}
    names = [s.strip() for s in args.setups.split(",")] if args.setups else list(setups_env)
    if any(n not in setups_env for n in names):
        ap.error(f"--setups {args.setups}: known: {', '.join(setups_env)}")
    rtts = [float(x) for x in args.rtt.split(",")]
    default_cc = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    ccs = []
    for c in args.congestion.split(","):
        c = default_cc if c.strip() == "default" else c.strip()
        if c not in available:
            ap.error(f"--congestion {c}: not available here ({' '.join(available)})")
        if c not in ccs:
            ccs.append(c)
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces): run benches/wan/run.sh as root")
    missing = [t for t in ("iperf3", "ip", "wg", "ping", "chrt", "cargo") if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)} (benches/wan/run.sh installs them)")
    try:
        out = results_path(args, "wan")
    except CommandFailed as e:
        ap.error(str(e))

    raise_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="tunnelgate-wan-"))
    setups = [Setup(i, n, setups_env[n], workdir) for i, n in enumerate(names)]
    fifo = not args.relay_normal
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "loadavg_start": open("/proc/loadavg").read().split()[:3],
            "rounds": args.rounds, "duration_s": args.duration, "rtt_added_ms": rtts, "congestion": ccs, "mtu": MTU,
            "setups": {n: setups_env[n] for n in names}, "tcp_mem": TCP_MEM, "relay_priority": "SCHED_FIFO 1" if fifo else "normal",
            "ping_interval_s": PING_INTERVAL, "lost_ping_counts_as_ms": LOST_PING_MS,
        },
        "relay_alone": [], "setups": {}, "summary": {},
    }
    if float(results["meta"]["loadavg_start"][0]) > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {results['meta']['loadavg_start'][0]} before the benchmark: other work will skew the figures")
    interrupted = False
    try:
        sweep_stale(NS_PREFIX + r"(\d+)s\d+[arb]", IF_PREFIX + r"(\d+)s\d+[ab]\.sock")
        binary = args.tunnelgate or str(REPO / "target" / "release" / "tunnelgate")
        if not args.tunnelgate and not args.no_build:
            build_release_tunnelgate(workdir / "cargo-build.log")
        if not os.access(binary, os.X_OK):
            raise CommandFailed(f"no tunnelgate binary at {binary}")
        relay_binary = build_relay(workdir)
        results["meta"]["tunnelgate"] = binary
        for s in setups:
            log(f"==> starting {s.name} {s.env or ''}")
            try:
                s.start(binary, relay_binary, int(rtts[0] * 500), fifo)
            except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                s.status, s.reason = "failed", str(e)
                log(f"    {s.name} FAILED: {e}")
        live = [s for s in setups if s.status == "ok"]
        if live:
            for rtt in rtts:
                log(f"==> the relay alone at +{rtt:g} ms")
                try:
                    a = relay_alone(live[0], relay_binary, int(rtt * 500), args.probe_rate, 1400, 3.0 if args.quick else 10.0, fifo)
                    results["relay_alone"].append(a)
                    log(f"    lost {a['lost']}/{a['sent']}, extra one-way delay p99 {a['extra_delay_us_p99']} us, max {a['extra_delay_us_max']} us")
                except (CommandFailed, subprocess.SubprocessError, OSError, json.JSONDecodeError, IndexError) as e:
                    results["relay_alone"].append({"delay_us": int(rtt * 500), "error": str(e)})
                    log(f"    error: {e}")
        n = 0
        for rnd in range(1, args.rounds + 1):
            for rtt in rtts:
                for cc in ccs:
                    order = live[n % len(live):] + live[: n % len(live)] if live else []
                    n += 1
                    for s in order:
                        if s.status != "ok":
                            continue
                        assert s.relay
                        s.relay.command(f"delay {int(rtt * 500)}")
                        log(f"==> round {rnd}/{args.rounds}, +{rtt:g} ms, {cc}, {s.name}")
                        try:
                            r = measure(s, binary, args.duration, cc, rtt)
                        except (CommandFailed, subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
                            r = {"error": str(e)}
                        r.update(round=rnd, rtt_added_ms=rtt, congestion=cc)
                        s.runs.append(r)
                        if "error" in r:
                            log(f"    error: {r['error']}")
                        else:
                            log(f"    {r['bps'] / 1e6:.0f} Mbit/s, {r['retransmits']} retransmits, aqm drops {r['aqm_drops_b']}, "
                                f"loaded ping p50/p99 {r['loaded_ping']['p50_ms']}/{r['loaded_ping']['p99_ms']} ms, "
                                f"relay late p99 {r['relay']['a_to_b']['late_us_p99']}/{r['relay']['b_to_a']['late_us_p99']} us")
                        try:
                            s.check_alive()
                        except CommandFailed as e:
                            s.status, s.reason = "failed", f"round {rnd}: {e}"
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for s in setups:
            s.teardown()
        sweep_stale(NS_PREFIX + r"(\d+)s\d+[arb]", IF_PREFIX + r"(\d+)s\d+[ab]\.sock")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        shutil.rmtree(workdir, ignore_errors=True)

    m = results["meta"]
    m["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    m["interrupted"] = interrupted
    m["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    for s in setups:
        results["setups"][s.name] = {"status": s.status, "reason": s.reason, "env": s.env, "daemon_facts": s.facts, "runs": s.runs}
        for rtt in rtts:
            for cc in ccs:
                rs = [r for r in s.runs if r["rtt_added_ms"] == rtt and r["congestion"] == cc]
                if rs:
                    results["summary"].setdefault(f"{rtt:g}|{cc}", {})[s.name] = summarize(rs)
    if interrupted:
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nWAN benchmark: {m['rounds']} round(s) x {m['duration_s']} s, commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), "
          f"load {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}")
    print(f"one iperf3 TCP stream through tunnelgate and a relay that adds the RTT (relay {m['relay_priority']}); pings every 10 ms beside it\n")
    print(report(results))
    for s in setups:
        if s.status != "ok":
            print(f"{s.name}: FAILED: {s.reason}")
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
