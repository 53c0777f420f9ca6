#!/usr/bin/env python3
"""Where the cycles go during one tunnelgate single stream: `perf record` of the whole machine.

Starts the iperf3 benchmark's `tunnelgate` setup (benches/iperf/bench.py: two namespaces, a veth,
tunnelgate at both ends), runs one iperf3 TCP stream a -> b and records every CPU with `perf record
-a` for DURATION s in its middle. Then it sorts the samples into the categories the performance
docs use (cipher, copies, checksums, syscalls, locking, kernel TCP/IP, ...), per process
(tunnelgate a/b, iperf3, other), and prints a Markdown table; the JSON keeps the top symbols.

Usage: benches/profile/run.sh [--duration S] [--setup tunnelgate|wireguard-go-upstream|...] [--out FILE | --publish]
Needs root and perf (Debian: linux-perf).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from benchproc import add_output_args, git_commit, iperf3_server, log, results_path, stop_process  # noqa: E402

_spec = importlib.util.spec_from_file_location("iperf_bench", HERE.parent / "iperf" / "bench.py")
ib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ib)

# First match wins: (category, regex on the symbol).
CATEGORIES = [
    ("cipher (ChaCha20-Poly1305)", r"chacha|poly1305|ChaCha|Poly1305|aead|gcm|aes"),
    ("copies", r"memcpy|memmove|copy_user|copy_to_iter|copy_from_iter|_copy_|copy_page|rep_movs|skb_copy|csum_partial_copy"),
    ("checksums", r"csum|checksum"),
    ("locking and futex", r"spin_lock|spin_unlock|futex|mutex|_raw_spin|rwsem|pthread_mutex|parking_lot|lock_sock|release_sock"),
    ("syscall entry/exit", r"entry_SYSCALL|syscall_exit|syscall_return|do_syscall|__x64_sys|syscall_enter|__sys_|seccomp|__secure_computing|bpf_prog"),
    ("memory alloc/free", r"kmalloc|kfree|kmem_cache|__alloc|free_|page_frag|malloc|cfree|_int_free|slab|skb_release|consume_skb|__build_skb|napi_alloc"),
    ("scheduler and idle", r"schedule|switch_to|finish_task|pick_next|enqueue_|dequeue_|update_curr|idle|cpuidle|mwait|native_safe_halt|default_idle|poll_idle|psi_|ttwu|try_to_wake"),
    ("TUN device", r"tun_|tap_|virtio_net_hdr|vnet"),
    ("UDP and GSO/GRO", r"udp|gso|gro|segment"),
    ("TCP", r"tcp_"),
    ("IP, veth, netfilter, softirq", r"ip_|ipv6_|ip6_|veth|nf_|netif|__netif|net_rx|napi|dev_|sch_|qdisc|skb_|__skb|fib|dst_|neigh|do_softirq|__do_softirq|irq"),
    ("boringtun session logic", r"boringtun|Tunn|noise"),
    ("tunnelgate packet path", r"tunnelgate|offload|coalesc|dataplane"),
]


def categorize(sym: str, dso: str) -> str:
    for name, rx in CATEGORIES:
        if re.search(rx, sym):
            return name
    if "kernel" in dso:
        return "other kernel"
    return "other user space"


def parse_report(text: str) -> list[tuple[float, str, str, str]]:
    """Lines of `perf report --no-children --sort comm,dso,sym --stdio -g none`: (percent, comm, dso, symbol)."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+(\S+)\s+\[[.kgu]\]\s+(.*)$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()))
    return rows


def process_of(comm: str) -> str:
    if comm.startswith("tg-") or comm.startswith("tunnelgate"):
        return "tunnelgate"
    if comm.startswith("wireguard") or comm.startswith("boringtun") or comm.startswith("gotatun"):
        return "peer daemon"
    if comm.startswith("iperf3"):
        return "iperf3"
    if comm.startswith("swapper"):
        return "idle"
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds recorded (default 10), inside a stream 4 s longer")
    ap.add_argument("--setup", default="tunnelgate", help="a setup of benches/iperf (default tunnelgate)")
    ap.add_argument("--tunnelgate", help="tunnelgate binary (default target/release/tunnelgate)")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--frequency", type=int, default=999, help="perf -F (default 999 Hz per CPU)")
    ap.add_argument("--udp", metavar="RATE", help="profile a UDP stream of 1392-byte datagrams at RATE (iperf3 -b, e.g. 2.2G, the iperf benchmark's udpmax) instead of TCP")
    add_output_args(ap, "profile")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root")
    if not shutil.which("perf"):
        ap.error("perf is missing (apt-get install --no-install-recommends linux-perf)")
    out = results_path(args, "profile")
    args.workdir = tempfile.mkdtemp(prefix="tunnelgate-profile-")
    workdir = Path(args.workdir)
    ib.sweep_stale_runs()
    if "tunnelgate" in ib.SETUPS[args.setup][0]:
        ib.prepare_tunnelgate(args)
    setup = ib.Setup(0, args.setup, workdir)
    load_start = open("/proc/loadavg").read().split()[:3]
    try:
        setup.start()
        server = iperf3_server(setup.ns["b"], ib.IPERF_PORT)
        try:
            udp = ["-u", "-b", args.udp, "-l", "1392", "-w", "4M"] if args.udp else []
            stream = subprocess.Popen(["ip", "netns", "exec", setup.ns["a"], "iperf3", "-c", setup.target(), "-p", str(ib.IPERF_PORT), "-t", str(args.duration + 4), "-J", *udp],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(2)
            data = workdir / "perf.data"
            before = setup.cpu()
            subprocess.run(["perf", "record", "-a", "-F", str(args.frequency), "-o", str(data), "--", "sleep", str(args.duration)], capture_output=True, check=True)
            after = setup.cpu()
            so, _ = stream.communicate(timeout=args.duration + 30)
            end = json.loads(so)["end"]
            # UDP: what arrived ("sum"), and what was lost on the way.
            bps = end.get("sum_received", end.get("sum", {})).get("bits_per_second", 0)
            lost_percent = end["sum"].get("lost_percent") if args.udp else None
        finally:
            stop_process(server)
        rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "comm,dso,sym", "--stdio", "-g", "none", "--percent-limit", "0.01"],
                             capture_output=True, text=True, check=True).stdout
    finally:
        setup.teardown()
        ib.sweep_stale_runs()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = parse_report(rep)
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_proc_cat: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    by_proc: dict[str, float] = collections.defaultdict(float)
    for pct, comm, dso, sym in rows:
        proc = process_of(comm)
        cat = "idle" if proc == "idle" else categorize(sym, dso)
        by_cat[cat] += pct
        by_proc[proc] += pct
        by_proc_cat[proc][cat] += pct
    result = {
        "meta": {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(), "setup": args.setup,
                 "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(), "duration_s": args.duration,
                 "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3],
                 "stream": f"UDP 1392 B at {args.udp} offered" if args.udp else "TCP", "stream_gbps": round(bps / 1e9, 3),
                 "udp_lost_percent": lost_percent,
                 "daemon_cpu_s": {s: (after[s] - before[s]) / ib.CLK_TCK for s in before if before[s] is not None and after[s] is not None}},
        "by_category_percent": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "by_process_percent": dict(sorted(by_proc.items(), key=lambda kv: -kv[1])),
        "by_process_category_percent": {p: dict(sorted(c.items(), key=lambda kv: -kv[1])) for p, c in by_proc_cat.items()},
        "top_symbols": [{"percent": p, "comm": c, "dso": d, "symbol": s} for p, c, d, s in rows[:60]],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["meta"]
    print(f"perf record -a, {args.duration} s of one {m.get('stream', 'TCP')} stream through {args.setup} ({m['stream_gbps']} Gbit/s), commit {m['commit']}, load {' '.join(load_start)} -> {' '.join(m['loadavg_end'])}\n")
    procs = [p for p in ("tunnelgate", "peer daemon", "iperf3", "other", "idle") if p in by_proc]
    print("| category | all samples % | " + " | ".join(procs) + " |")
    print("|---|---|" + "---|" * len(procs))
    for cat, pct in result["by_category_percent"].items():
        print(f"| {cat} | {pct:.1f} | " + " | ".join(f"{by_proc_cat[p].get(cat, 0):.1f}" for p in procs) + " |")
    print("| **total** | 100 | " + " | ".join(f"{by_proc[p]:.1f}" for p in procs) + " |")
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
