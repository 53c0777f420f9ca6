#!/usr/bin/env python3
"""Reload churn: N reloads (default 10,000) as fast as the daemon applies them, no traffic, and the
daemon's RSS after every 1,000. The 10-minute soak changes too little to tell allocator warm-up
from a leak of a few bytes per reload; this makes a per-reload leak the dominant term.

One namespace, tunnelgate with one peer and one or two IP-target ingress rules, alternating; each
SIGHUP is an nftables diff. The next SIGHUP is sent once tunnelgate_config_reloads_total has moved.

Usage (root): benches/soak/churn.py [--reloads N] [--tunnelgate PATH] [--out FILE | --publish].
Prints one line per 1,000 reloads and a JSON summary on the last line. --out also writes that JSON to
FILE; --publish writes it to benches/soak/results/churn.json, the figures the README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import add_ns, genkey, git_commit, kill_ns, log, nsx, run, status_kib, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IFACE = f"tgch{os.getpid() % 100000}"
NS = f"tgchurn{os.getpid()}"


def config(keyfile: Path, peer_pub: str, two_rules: bool) -> str:
    extra = '[[ingress]]\ntarget = "10.80.0.12"\nports = ["9000"]\n\n' if two_rules else ""
    return f"""# written by benches/soak/churn.py
[interface]
name = "{IFACE}"
private_key_file = "{keyfile}"
listen_port = 51830
addresses = ["100.81.0.1/32"]

[[peer]]
public_key = "{peer_pub}"
allowed_ips = ["100.81.0.2/32"]

[[ingress]]
target = "10.80.0.11"
ports = ["5201"]

{extra}[firewall]
mode = "nftables"

[health]
listen = "127.0.0.1:9003"
"""


def reloads(ns: str) -> float:
    p = nsx(ns, "curl", "-s", "--max-time", "2", "http://127.0.0.1:9003/metrics", check=False)
    for line in p.stdout.splitlines():
        if line.startswith("tunnelgate_config_reloads_total"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reloads", type=int, default=10_000)
    ap.add_argument("--tunnelgate", default=str(REPO / "target" / "release" / "tunnelgate"))
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--out", metavar="FILE", help="also write the JSON summary to FILE")
    out.add_argument("--publish", action="store_true", help="write benches/soak/results/churn.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tunnelgate-churn-"))
    key, _ = genkey()
    _, peer_pub = genkey()
    keyfile = work / "key"
    keyfile.write_text(key + "\n")
    keyfile.chmod(0o600)
    cfg = work / "tg.toml"
    cfg.write_text(config(keyfile, peer_pub, False))
    add_ns(NS)
    proc = None
    try:
        with open(work / "tg.log", "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", NS, args.tunnelgate, "run", "--config", str(cfg)],
                                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
        if not wait_for(lambda: reloads(NS) >= 0, 15):
            raise SystemExit(f"tunnelgate did not come up: {(work / 'tg.log').read_text()[-2000:]}")
        samples = [{"reloads": 0, "rss_kib": status_kib(proc.pid, "VmRSS")}]
        log(f"==> start rss {samples[0]['rss_kib']} KiB")
        t0 = time.monotonic()
        done = 0
        for i in range(1, args.reloads + 1):
            before = reloads(NS)
            cfg.write_text(config(keyfile, peer_pub, i % 2 == 1))
            os.kill(proc.pid, signal.SIGHUP)
            if not wait_for(lambda: reloads(NS) > before, 10):
                raise SystemExit(f"reload {i} not applied: {(work / 'tg.log').read_text()[-2000:]}")
            done = i
            if i % 1000 == 0:
                s = {"reloads": i, "rss_kib": status_kib(proc.pid, "VmRSS"),
                     "fds": len(os.listdir(f"/proc/{proc.pid}/fd")), "seconds": round(time.monotonic() - t0)}
                samples.append(s)
                log(f"  {s}")
        first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
        per_reload = (last["rss_kib"] - first["rss_kib"]) * 1024 / max(1, last["reloads"] - first["reloads"])
        summary = json.dumps({"commit": git_commit(), "reloads": done, "samples": samples,
                              "bytes_per_reload_after_first_1000": round(per_reload, 1)})
        print(summary)
        target = REPO / "benches" / "soak" / "results" / "churn.json" if args.publish else args.out
        if target:
            Path(target).write_text(summary + "\n")
        return 0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        kill_ns(NS)


if __name__ == "__main__":
    sys.exit(main())
