#!/usr/bin/env python3
"""Rekey under traffic: iperf3 through a tunnelgate <-> wireguard-go tunnel for longer than
REKEY_AFTER_TIME (120 s), sampling `wg show latest-handshakes` on both sides every second and
iperf3's throughput every second. A rekey that works shows the handshake time moving (about
every two minutes) while no one-second interval drops to zero.

Topology: namespace `a` runs tunnelgate (`tunnelgate run`), `b` runs wireguard-go; a veth pair
joins them. iperf3 -s listens on b's tunnel address, iperf3 -c runs in a.

Not a CI test (it takes minutes); results are JSON outside the tree unless --publish.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import add_ns, add_output_args, results_path, log, run, nsx, wait_for, kill_ns, genkey, git_commit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PID = os.getpid()
NS_A, NS_B = f"tgrk-{PID}-a", f"tgrk-{PID}-b"
TG_IF, WG_IF = f"tgrk{PID % 10000}a", f"tgrk{PID % 10000}b"
A_LAN, B_LAN = "192.168.90.1", "192.168.90.2"
A_TUN, B_TUN = "100.90.0.1", "100.90.0.2"


def handshake(ns: str, iface: str) -> int:
    out = nsx(ns, "wg", "show", iface, "latest-handshakes", check=False).stdout.split()
    return int(out[1]) if len(out) >= 2 and out[1].isdigit() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=150, help="iperf3 run length (default 150 s, past one rekey)")
    ap.add_argument("--tunnelgate", default=str(REPO / "target/release/tunnelgate"))
    ap.add_argument("--rate", default="200M", help="iperf3 -b: offered rate (default 200M; 0 = as fast as it goes)")
    add_output_args(ap, "rekey")
    args = ap.parse_args()
    out_path = results_path(args, "rekey")
    work = Path(tempfile.mkdtemp(prefix="tgrk-"))
    procs: list[subprocess.Popen] = []
    try:
        for ns in (NS_A, NS_B):
            add_ns(ns)
        run(["ip", "link", "add", "vrk0a", "netns", NS_A, "type", "veth", "peer", "vrk0b", "netns", NS_B])
        nsx(NS_A, "ip", "addr", "add", f"{A_LAN}/24", "dev", "vrk0a")
        nsx(NS_B, "ip", "addr", "add", f"{B_LAN}/24", "dev", "vrk0b")
        nsx(NS_A, "ip", "link", "set", "vrk0a", "up")
        nsx(NS_B, "ip", "link", "set", "vrk0b", "up")
        a_priv, a_pub = genkey()
        b_priv, b_pub = genkey()
        keyfile = work / "a.key"
        keyfile.write_text(a_priv + "\n")
        keyfile.chmod(0o600)
        cfg = work / "a.toml"
        cfg.write_text(
            f'[interface]\nname = "{TG_IF}"\nprivate_key_file = "{keyfile}"\nlisten_port = 51820\n'
            f'addresses = ["{A_TUN}/32"]\n\n[[peer]]\npublic_key = "{b_pub}"\n'
            f'endpoint = "{B_LAN}:51821"\nallowed_ips = ["{B_TUN}/32"]\n\n[health]\nlisten = ""\n'
        )
        procs.append(subprocess.Popen(["ip", "netns", "exec", NS_B, "wireguard-go", "-f", WG_IF],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={**os.environ, "WG_PROCESS_FOREGROUND": "1"}))
        if not wait_for(lambda: Path(f"/var/run/wireguard/{WG_IF}.sock").exists(), 10):
            raise RuntimeError("wireguard-go did not start")
        bkey = work / "b.key"
        bkey.write_text(b_priv + "\n")
        bkey.chmod(0o600)
        nsx(NS_B, "wg", "set", WG_IF, "private-key", str(bkey), "listen-port", "51821",
            "peer", a_pub, "allowed-ips", f"{A_TUN}/32", "endpoint", f"{A_LAN}:51820")
        nsx(NS_B, "ip", "addr", "add", f"{B_TUN}/32", "dev", WG_IF)
        nsx(NS_B, "ip", "link", "set", WG_IF, "up")
        nsx(NS_B, "ip", "route", "add", f"{A_TUN}/32", "dev", WG_IF)
        procs.append(subprocess.Popen(["ip", "netns", "exec", NS_A, args.tunnelgate, "run", "--config", str(cfg)],
                                      stdout=subprocess.DEVNULL, stderr=open(work / "tunnelgate.log", "w")))
        if not wait_for(lambda: nsx(NS_A, "ping", "-c", "1", "-W", "1", B_TUN, check=False).returncode == 0, 15):
            raise RuntimeError("no ping through the tunnel")
        procs.append(subprocess.Popen(["ip", "netns", "exec", NS_B, "iperf3", "-s", "-B", B_TUN],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        log(f"==> iperf3 {args.seconds} s through the tunnel, sampling handshakes every second")
        # To a file, not a pipe: the JSON report comes at the end and is larger than a pipe holds.
        report_file = work / "iperf3.json"
        client = subprocess.Popen(["ip", "netns", "exec", NS_A, "iperf3", "-c", B_TUN, "-t", str(args.seconds), "-i", "1", "-b", args.rate, "--json"],
                                  stdout=open(report_file, "w"), stderr=subprocess.DEVNULL)
        samples = []
        start = time.time()
        while client.poll() is None:
            samples.append({"t": round(time.time() - start, 1), "tunnelgate": handshake(NS_A, TG_IF),
                            "wireguard_go": handshake(NS_B, WG_IF)})
            time.sleep(1)
        report = json.loads(report_file.read_text() or "{}")
        intervals = [i["sum"]["bits_per_second"] / 1e9 for i in report.get("intervals", [])]
        distinct = sorted({s["tunnelgate"] for s in samples if s["tunnelgate"]})
        result = {
            "commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": args.seconds, "handshakes_seen": distinct,
            "handshake_gaps_s": [b - a for a, b in zip(distinct, distinct[1:])],
            "interval_gbit_min": min(intervals, default=0.0), "interval_gbit_median": sorted(intervals)[len(intervals) // 2] if intervals else 0.0,
            "zero_intervals": sum(1 for x in intervals if x == 0.0), "samples": samples, "intervals_gbit": intervals,
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"handshakes (tunnelgate side, unix s): {distinct}; gaps {result['handshake_gaps_s']}")
        log(f"1 s intervals: min {result['interval_gbit_min']:.2f} Gbit/s, median {result['interval_gbit_median']:.2f}, zero {result['zero_intervals']}")
        log(f"results: {out_path}")
        ok = len(distinct) >= 2 and result["zero_intervals"] == 0
        log("rekey under traffic: " + ("ok" if ok else "NOT observed cleanly"))
        return 0 if ok else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        for ns in (NS_A, NS_B):
            kill_ns(ns)
            run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
