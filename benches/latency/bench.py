#!/usr/bin/env python3
"""Latency under load: ping and a sparse TCP flow through the tunnel while one TCP stream saturates it.

Every setup gets the iperf3 benchmark's two namespaces and tunnel (benches/iperf/bench.py: the same
daemons, addresses and MTU). In each round, every setup runs, in a rotating order:

  idle    200 pings at 10 ms intervals through the idle tunnel: p50/p99 RTT
  alone   iperf3 TCP, 1 stream, DURATION s: the stream's throughput on its own
  loaded  the same stream again and, from 1 s after its start until 1 s before its end, pings every
          10 ms and a sparse TCP flow (one connection, a 64-byte request every 20 ms, timed until
          its 64-byte answer is back: benches/latency/sparse.py) beside it

Reported per setup: ping p50/p99 and the sparse flow's p50/p99 under load (all rounds' samples
together; a lost ping counts as its 1 s timeout), the stream's throughput under load and the share
of its throughput alone it kept (median over rounds). Bufferbloat shows as a high p99 under load; a
data path that keeps sparse flows out of the bulk flow's queue keeps it near the idle figure.

Usage: benches/latency/run.sh [--quick] [--rounds N] [--duration S] [--setups a,b] [--out FILE | --publish]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
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
from benchproc import CommandFailed, ThreadSampler, add_output_args, git_commit, iperf3_server, log, nsx, raise_on_signals, results_path, stop_process, wait_for  # noqa: E402

_spec = importlib.util.spec_from_file_location("iperf_bench", HERE.parent / "iperf" / "bench.py")
ib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ib)

SETUPS = ["veth", "tunnelgate", "wireguard-go-upstream", "wireguard-go-tailscale", "wireguard-go"]
SPARSE_PORT = 7777
PING_INTERVAL = 0.01
SPARSE_INTERVAL = 0.02
LOST_PING_MS = 1000.0


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def ping(setup, count: int) -> dict:
    p = nsx(setup.ns["a"], "ping", "-n", "-i", str(PING_INTERVAL), "-c", str(count), "-W", "1", setup.target(), check=False, timeout=count * PING_INTERVAL + 30)
    rtts = [float(m) for m in re.findall(r"time=([\d.]+) ms", p.stdout)]
    sent = re.search(r"(\d+) packets transmitted", p.stdout)
    sent_n = int(sent.group(1)) if sent else count
    return {"rtt_ms": rtts, "sent": sent_n, "lost": max(0, sent_n - len(rtts))}


def with_lost(r: dict) -> list[float]:
    return r["rtt_ms"] + [LOST_PING_MS] * r["lost"]


# The stream's TCP congestion control: the machine's default unless --congestion names one.
CONGESTION: str | None = None


def default_congestion() -> str:
    try:
        return open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    except OSError:
        return "?"


def tcp_stream(setup, duration: int) -> subprocess.Popen:
    args = ["iperf3", "-c", setup.target(), "-p", str(ib.IPERF_PORT), "-t", str(duration), "-J", "--connect-timeout", "5000"]
    if CONGESTION:
        args += ["-C", CONGESTION]
    return subprocess.Popen(["ip", "netns", "exec", setup.ns["a"], *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def stream_result(proc: subprocess.Popen, duration: int) -> dict:
    out, err = proc.communicate(timeout=duration + 30)
    try:
        j = json.loads(out)
    except json.JSONDecodeError:
        return {"error": f"iperf3 exited {proc.returncode}: {err.strip()[-300:]}"}
    if "error" in j:
        return {"error": f"iperf3: {j['error']}"}
    end = j.get("end", {})
    return {"bps": end.get("sum_received", {}).get("bits_per_second"), "retransmits": end.get("sum_sent", {}).get("retransmits")}


def measure_round(setup, duration: int) -> dict:
    r: dict = {}
    idle = ping(setup, 200)
    r["idle_ping"] = idle
    server = iperf3_server(setup.ns["b"], ib.IPERF_PORT)
    try:
        r["alone"] = stream_result(tcp_stream(setup, duration), duration)
    finally:
        stop_process(server)
    server = iperf3_server(setup.ns["b"], ib.IPERF_PORT)
    try:
        before = setup.cpu()
        stream = tcp_stream(setup, duration)
        time.sleep(1.0)
        window = max(1.0, duration - 2.0)
        # The readers' scheduling class every 10 ms and their CPU, over the loaded window.
        sampler = ThreadSampler(setup.tunnelgate_pids())
        sampler.start()
        sparse = subprocess.Popen(
            ["ip", "netns", "exec", setup.ns["a"], sys.executable, str(HERE / "sparse.py"), "client", setup.target(), str(SPARSE_PORT), str(window), str(SPARSE_INTERVAL)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )
        r["loaded_ping"] = ping(setup, int(window / PING_INTERVAL))
        r["readers"] = sampler.stop()
        out, err = sparse.communicate(timeout=window + 30)
        try:
            r["loaded_sparse"] = json.loads(out)
        except json.JSONDecodeError:
            r["loaded_sparse"] = {"error": f"sparse client exited {sparse.returncode}: {err.strip()[-300:]}", "rtt_ms": []}
        r["loaded"] = stream_result(stream, duration)
        after = setup.cpu()
        r["cpu_s"] = {s: (after[s] - before[s]) / ib.CLK_TCK for s in before if before[s] is not None and after[s] is not None}
    finally:
        stop_process(server)
    setup.record_peak()
    return r


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    idle = [x for r in ok for x in with_lost(r["idle_ping"])]
    loaded = [x for r in ok for x in with_lost(r["loaded_ping"])]
    sparse = [x for r in ok for x in r.get("loaded_sparse", {}).get("rtt_ms", [])]
    kept = [r["loaded"]["bps"] / r["alone"]["bps"] for r in ok if r.get("loaded", {}).get("bps") and r.get("alone", {}).get("bps")]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    readers = {}
    for side in "ab":
        fifo = [r["readers"][side]["fifo_fraction"] for r in ok if r.get("readers", {}).get(side, {}).get("fifo_fraction") is not None]
        cpu = [r["readers"][side]["cpu_share"] for r in ok if r.get("readers", {}).get(side, {}).get("cpu_share") is not None]
        if fifo or cpu:
            readers[side] = {"fifo_fraction": med(fifo), "cpu_share": med(cpu)}
    return {
        "readers": readers,
        "idle_ping_p50_ms": percentile(idle, 50), "idle_ping_p99_ms": percentile(idle, 99),
        "loaded_ping_p50_ms": percentile(loaded, 50), "loaded_ping_p99_ms": percentile(loaded, 99),
        "loaded_ping_lost": sum(r["loaded_ping"]["lost"] for r in ok), "loaded_ping_sent": sum(r["loaded_ping"]["sent"] for r in ok),
        "sparse_tcp_p50_ms": percentile(sparse, 50), "sparse_tcp_p99_ms": percentile(sparse, 99), "sparse_tcp_samples": len(sparse),
        "alone_gbps": med([r["alone"]["bps"] / 1e9 for r in ok if r.get("alone", {}).get("bps")]),
        "loaded_gbps": med([r["loaded"]["bps"] / 1e9 for r in ok if r.get("loaded", {}).get("bps")]),
        "kept_fraction": med(kept),
    }


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f} %"


def report(results: dict) -> str:
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
    rows = [("setup", "idle ping p50/p99 ms", "loaded ping p50/p99 ms", "ping lost", "sparse TCP p50/p99 ms", "stream alone Gbit/s", "under load", "kept",
             "readers at FIFO a/b", "reader CPU a/b")]
    for name, s in results["setups"].items():
        if s["status"] != "ok":
            rows.append((name, f"FAILED: {s['reason'][:160]}") + ("",) * 8)
            continue
        m = s["summary"]
        rows.append((
            name,
            f"{f(m['idle_ping_p50_ms'], '{:.3f}')} / {f(m['idle_ping_p99_ms'], '{:.3f}')}",
            f"{f(m['loaded_ping_p50_ms'])} / {f(m['loaded_ping_p99_ms'])}",
            f"{m['loaded_ping_lost']}/{m['loaded_ping_sent']}",
            f"{f(m['sparse_tcp_p50_ms'])} / {f(m['sparse_tcp_p99_ms'])}",
            f(m["alone_gbps"]), f(m["loaded_gbps"]),
            "-" if m["kept_fraction"] is None else f"{m['kept_fraction'] * 100:.0f} %",
            "/".join(pct(m.get("readers", {}).get(side, {}).get("fifo_fraction")) for side in "ab") if m.get("readers") else "-",
            "/".join(pct(m.get("readers", {}).get(side, {}).get("cpu_share")) for side in "ab") if m.get("readers") else "-",
        ))
    widths = [max(len(r[i]) for r in rows if not r[1].startswith("FAILED") or i == 0) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        out.append(f"{r[0]:<{widths[0]}}  {r[1]}" if r[1].startswith("FAILED") else "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if r is rows[0]:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across setups (default 3)")
    ap.add_argument("--duration", type=int, default=10, help="seconds per iperf3 stream (default 10)")
    ap.add_argument("--quick", action="store_true", help="1 round of 6 s")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of: {', '.join(ib.SETUPS)} (default %(default)s)")
    ap.add_argument("--baseline", metavar="BIN", help=f"an earlier tunnelgate binary: adds setup {ib.BASELINE_SETUP}")
    ap.add_argument("--baseline-env", default="", metavar="K=V,...", help=f"environment of the {ib.BASELINE_SETUP} daemons only")
    ap.add_argument("--tunnelgate", help="tunnelgate binary (default target/release/tunnelgate, built first)")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    ap.add_argument("--congestion", metavar="ALG", help="the stream's TCP congestion control (iperf3 -C), e.g. cubic or bbr (default: the machine's, recorded)")
    add_output_args(ap, "latency")
    ib.add_shipped_args(ap)
    args = ap.parse_args()
    global CONGESTION
    if args.congestion:
        available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
        if args.congestion not in available:
            ap.error(f"--congestion {args.congestion}: not available here (tcp_available_congestion_control: {' '.join(available)})")
        CONGESTION = args.congestion
    if args.quick:
        args.rounds, args.duration = 1, 6
    ib.use_baseline(ap, args)
    ib.use_daemon_env(ap, args)
    names = ib.checked_setups(ap, args, "latency")
    try:
        out = results_path(args, "latency")
    except CommandFailed as e:
        ap.error(str(e))

    raise_on_signals()
    args.workdir = tempfile.mkdtemp(prefix="tunnelgate-latency-")
    workdir = Path(args.workdir)
    setups = [ib.Setup(i, n, workdir) for i, n in enumerate(names)]
    servers: list[subprocess.Popen] = []
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "rounds": args.rounds, "duration_s": args.duration, "mtu": ib.MTU,
            "congestion": CONGESTION or default_congestion(),
            "ping_interval_s": PING_INTERVAL, "sparse_interval_s": SPARSE_INTERVAL, "lost_ping_counts_as_ms": LOST_PING_MS,
            "loadavg_start": open("/proc/loadavg").read().split()[:3],
            "wireguard_go_builds": str(ib.shared_bin_dir() or ""),
            "baseline": ib.Tunnelgate.baseline or None, "baseline_env": ib.Tunnelgate.baseline_env or None,
        },
        "setups": {},
    }
    if float(results["meta"]["loadavg_start"][0]) > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {results['meta']['loadavg_start'][0]} before the benchmark: other work will skew the figures")
    interrupted = False
    try:
        ib.sweep_stale_runs()
        if ib.needs_tunnelgate(names):
            ib.prepare_tunnelgate(args)
            ib.prepare_shipped(args, names, workdir)
        results["meta"]["shipped"] = ib.shipped_meta(args, names)
        for s in setups:
            log(f"==> starting {s.name}")
            try:
                s.start()
                with s.measuring():  # a gateway setup's sparse server runs beside the benchmark, off the gateway's CPU
                    srv = subprocess.Popen(["ip", "netns", "exec", s.ns["b"], sys.executable, str(HERE / "sparse.py"), "server", str(SPARSE_PORT)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
                servers.append(srv)
                if not wait_for(lambda: f":{SPARSE_PORT}" in nsx(s.ns["b"], "ss", "-Hltn", f"sport = :{SPARSE_PORT}", check=False).stdout, 5):
                    raise CommandFailed("the sparse flow's server did not start")
            except (CommandFailed, subprocess.SubprocessError, OSError) as e:
                s.status, s.reason = "failed", str(e)
                log(f"    {s.name} FAILED: {e}")
                s.teardown()
        live = [s for s in setups if s.status == "ok"]
        for rnd in range(args.rounds):
            for s in live[rnd % len(live):] + live[: rnd % len(live)] if live else []:
                if s.status != "ok":
                    continue
                log(f"==> round {rnd + 1}/{args.rounds}, {s.name}")
                try:
                    with s.measuring() as notes:
                        r = measure_round(s, args.duration)
                    r.update(notes)
                except (subprocess.SubprocessError, OSError, CommandFailed) as e:
                    r = {"error": str(e)}
                r["round"] = rnd + 1
                s.runs.append(r)
                if "error" in r:
                    log(f"    error: {r['error']}")
                else:
                    one = summarize([r])
                    log(f"    idle ping p99 {one['idle_ping_p99_ms']:.3f} ms; loaded ping p50/p99 {one['loaded_ping_p50_ms']:.2f}/{one['loaded_ping_p99_ms']:.2f} ms, "
                        f"sparse TCP p50/p99 {one['sparse_tcp_p50_ms'] or 0:.2f}/{one['sparse_tcp_p99_ms'] or 0:.2f} ms; "
                        f"stream {one['alone_gbps'] or 0:.2f} alone, {one['loaded_gbps'] or 0:.2f} loaded Gbit/s")
                try:
                    s.check_alive()
                except CommandFailed as e:
                    s.status, s.reason = "failed", f"during round {rnd + 1}: {e}"
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    except Exception:  # noqa: BLE001 - report, clean up, exit non-zero
        interrupted = True
        log(traceback.format_exc())
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for srv in servers:
            stop_process(srv)
        for s in setups:
            s.teardown()
        ib.sweep_stale_runs()
        if ib.PodTunnelgate.rt is not None:
            ib.PodTunnelgate.rt.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        shutil.rmtree(workdir, ignore_errors=True)

    m = results["meta"]
    m["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    m["interrupted"] = interrupted
    m["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    for s in setups:
        results["setups"][s.name] = {
            "status": "ok" if s.status == "ok" else "failed", "reason": s.reason,
            "daemons": {side: d.kind for side, d in s.daemons.items()},
            "idle_rss_kib": s.idle_rss, "peak_rss_kib": s.peak_rss, "daemon_facts": s.facts,
            "summary": summarize(s.runs) if s.status == "ok" else {},
            "runs": s.runs,
        }
    if interrupted:
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nlatency under load: {m['rounds']} round(s) x {m['duration_s']} s, commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), "
          f"load {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}")
    print(f"pings every 10 ms and a 64-byte TCP request every 20 ms while one iperf3 TCP stream ({m.get('congestion', '?')}) runs; a lost ping counts as 1 s\n")
    print(report(results))
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
