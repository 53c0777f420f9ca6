#!/usr/bin/env python3
"""Soak: N minutes (default 10) of iperf3 through tunnelgate's ingress while the daemon reloads
every second (the config alternates between one and two ingress rules, so every reload applies a
rule diff) and the DNS answer for its `target_fqdn` changes every 10 s (dnsmasq, SIGHUP).

Topology, one network namespace each:

    client (wireguard-go, iperf3 -c) --192.168.80.0/24-- proxy (tunnelgate) --10.80.0.0/24-- backend
    tunnel 100.80.0.2                                   tunnel 100.80.0.1     iperf3 -s on .11 and .12
                                                              |
                                                        10.83.0.0/24 -- dns (dnsmasq, svc.soak.internal)

Reports the daemon's RSS, open fds and threads at the start and at the end (and every 10 s), the
throughput per 10 s, and the reload and resolution counters. Results are JSON, outside the tree
unless --publish. The bar: no growth beyond noise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CommandFailed, add_ns, add_output_args, results_path, log, run, nsx, wait_for, pid_alive, status_kib, tail, kill_ns, genkey, git_commit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAME = "svc.soak.internal"
BACKENDS = ("10.80.0.11", "10.80.0.12")
PORT = 5201
IFACE = f"tgsoak{os.getpid() % 100000}"


def ns_name(role: str) -> str:
    return f"tgsoak-{os.getpid()}-{role}"


def veth(a: str, a_addr: str, b: str, b_addrs: list[str], tag: str) -> None:
    va, vb = f"vs{tag}a{os.getpid() % 10000}", f"vs{tag}b{os.getpid() % 10000}"
    run(["ip", "link", "add", va, "netns", a, "type", "veth", "peer", vb, "netns", b])
    nsx(a, "ip", "addr", "add", a_addr, "dev", va)
    for addr in b_addrs:
        nsx(b, "ip", "addr", "add", addr, "dev", vb)
    nsx(a, "ip", "link", "set", va, "up")
    nsx(b, "ip", "link", "set", vb, "up")


def config(keyfile: Path, peer_pub: str, extra_rule: bool) -> str:
    extra = '[[ingress]]\ntarget = "10.80.0.11"\nports = ["9000"]\n\n' if extra_rule else ""
    return f"""# written by benches/soak/soak.py
[interface]
name = "{IFACE}"
private_key_file = "{keyfile}"
listen_port = 51820
addresses = ["100.80.0.1/32"]

[[peer]]
public_key = "{peer_pub}"
allowed_ips = ["100.80.0.2/32"]

[[ingress]]
target_fqdn = "{NAME}"
ports = ["{PORT}"]

{extra}[firewall]
mode = "nftables"

[dns]
nameservers = ["10.83.0.1"]
reresolve_interval = "2s"

[health]
listen = "127.0.0.1:9002"
"""


def sample(pid: int) -> dict:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = None
    return {
        "rss_kib": status_kib(pid, "VmRSS"),
        "fds": fds,
        "threads": status_kib(pid, "Threads"),
    }


def metrics(ns: str) -> dict[str, float]:
    p = nsx(ns, "curl", "-s", "--max-time", "2", "http://127.0.0.1:9002/metrics", check=False)
    out: dict[str, float] = {}
    for line in p.stdout.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        try:
            out[base] = out.get(base, 0.0) + float(value)
        except ValueError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="soak length (default 10)")
    ap.add_argument("--rate", default="",
                    help="iperf3 -b target, e.g. 200M (default: unlimited). A long soak hunts leaks, "
                         "not speed; a capped rate leaves the machine usable meanwhile")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    ap.add_argument("--tunnelgate", default=str(REPO / "target" / "release" / "tunnelgate"))
    add_output_args(ap, "soak")
    args = ap.parse_args()
    out_path = results_path(args, "soak")
    if not args.no_build:
        log("==> cargo build --release --bin tunnelgate")
        run(["cargo", "build", "--release", "--bin", "tunnelgate"], cwd=REPO, timeout=1800)
    seconds = int(args.minutes * 60)
    work = Path(tempfile.mkdtemp(prefix="tunnelgate-soak-"))
    log(f"==> logs in {work} (removed after a successful run)")
    roles = ("client", "proxy", "backend", "dns")
    ns = {r: ns_name(r) for r in roles}
    procs: list[subprocess.Popen] = []
    try:
        for n in ns.values():
            add_ns(n)
        veth(ns["proxy"], "192.168.80.1/24", ns["client"], ["192.168.80.2/24"], "c")
        veth(ns["proxy"], "10.80.0.1/24", ns["backend"], [f"{b}/24" for b in BACKENDS], "b")
        veth(ns["proxy"], "10.83.0.2/24", ns["dns"], ["10.83.0.1/24"], "d")
        nsx(ns["backend"], "ip", "route", "add", "default", "via", "10.80.0.1")
        for b in BACKENDS:
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns["backend"], "iperf3", "-s", "-B", b, "-p", str(PORT)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        hosts = work / "hosts"
        hosts.write_text(f"{BACKENDS[0]} {NAME}\n")
        dnsmasq = subprocess.Popen(
            ["ip", "netns", "exec", ns["dns"], "dnsmasq", "--conf-file=/dev/null", "--user=root", "--no-daemon",
             "--no-resolv", "--no-hosts", "--listen-address=10.83.0.1", "--bind-interfaces",
             f"--addn-hosts={hosts}", "--local=/soak.internal/"],
            stdout=subprocess.DEVNULL, stderr=open(work / "dnsmasq.log", "w"))
        procs.append(dnsmasq)
        # The client: wireguard-go.
        ckey, cpub = genkey()
        (work / "client.key").write_text(ckey + "\n")
        wg_env = dict(os.environ, WG_PROCESS_FOREGROUND="1")
        cif = f"wgsoak{os.getpid() % 100000}"
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns["client"], "wireguard-go", "-f", cif], env=wg_env,
                                      stdout=subprocess.DEVNULL, stderr=open(work / "wg.log", "w")))
        if not wait_for(lambda: Path(f"/var/run/wireguard/{cif}.sock").exists(), 10):
            raise CommandFailed(f"wireguard-go did not start: {tail(work / 'wg.log')}")
        # The proxy: tunnelgate.
        tkey, tpub = genkey()
        keyfile = work / "tg.key"
        keyfile.write_text(tkey + "\n")
        keyfile.chmod(0o600)
        cfg = work / "tg.toml"
        cfg.write_text(config(keyfile, cpub, False))
        tg = subprocess.Popen(["ip", "netns", "exec", ns["proxy"], args.tunnelgate, "run", "--config", str(cfg)],
                              stdout=subprocess.DEVNULL, stderr=open(work / "tg.log", "w"))
        procs.append(tg)
        ready = lambda: nsx(ns["proxy"], "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "1",
                            "http://127.0.0.1:9002/readyz", check=False).stdout == "200"  # noqa: E731
        if not wait_for(ready, 20, 0.2):
            raise CommandFailed(f"tunnelgate not ready: {tail(work / 'tg.log')}")
        nsx(ns["client"], "wg", "set", cif, "private-key", str(work / "client.key"), "peer", tpub,
            "endpoint", "192.168.80.1:51820", "allowed-ips", "100.80.0.1/32", "persistent-keepalive", "1")
        nsx(ns["client"], "ip", "addr", "add", "100.80.0.2/32", "dev", cif)
        nsx(ns["client"], "ip", "link", "set", cif, "mtu", "1420", "up")
        nsx(ns["client"], "ip", "route", "add", "100.80.0.1/32", "dev", cif)
        if not wait_for(lambda: nsx(ns["client"], "ping", "-c", "1", "-W", "1", "100.80.0.1", check=False).returncode == 0, 15, 0.2):
            raise CommandFailed("no ping through the tunnel")
        # The tunnelgate process itself (ip netns exec execs, so the Popen pid is the daemon).
        pid = tg.pid
        time.sleep(1)
        start = {"t": 0, **sample(pid)}
        m0 = metrics(ns["proxy"])
        log(f"==> soak {seconds} s: start {start}")
        iperf = subprocess.Popen(["ip", "netns", "exec", ns["client"], "iperf3", "-c", "100.80.0.1", "-p", str(PORT),
                                  "-t", str(seconds), "-i", "10", "-J",
                                  *(["-b", args.rate] if args.rate else [])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        samples = [start]
        t0 = time.monotonic()
        tick = 0
        reloads = 0
        answer = 0
        while iperf.poll() is None and time.monotonic() - t0 < seconds + 30:
            tick += 1
            time.sleep(max(0.0, t0 + tick - time.monotonic()))
            cfg.write_text(config(keyfile, cpub, tick % 2 == 1))
            os.kill(pid, signal.SIGHUP)
            reloads += 1
            if tick % 10 == 0:
                answer ^= 1
                hosts.write_text(f"{BACKENDS[answer]} {NAME}\n")
                os.kill(dnsmasq.pid, signal.SIGHUP)
                s = {"t": tick, **sample(pid)}
                samples.append(s)
                log(f"  t={tick:4d}s rss={s['rss_kib']} KiB fds={s['fds']} threads={s['threads']}")
            if not pid_alive(pid):
                raise CommandFailed(f"tunnelgate died: {tail(work / 'tg.log')}")
        out, err = iperf.communicate(timeout=60)
        time.sleep(2)  # let the last reload settle before the end sample
        end = {"t": round(time.monotonic() - t0), **sample(pid)}
        m1 = metrics(ns["proxy"])
        try:
            ij = json.loads(out)
            per10 = [round(i["sum"]["bits_per_second"] / 1e9, 3) for i in ij["intervals"]]
            total = round(ij["end"]["sum_received"]["bits_per_second"] / 1e9, 3)
        except (ValueError, KeyError) as e:
            raise CommandFailed(f"iperf3 output unreadable ({e}): {err.strip() or out[:500]}")
        delta = {k: m1.get(k, 0) - m0.get(k, 0) for k in (
            "tunnelgate_config_reloads_total", "tunnelgate_config_reload_failures_total", "tunnelgate_dns_resolutions_total",
            "tunnelgate_dns_resolution_failures_total", "tunnelgate_rule_applies_total",
            "tunnelgate_rule_apply_failures_total") if k in m1}
        result = {
            "benchmark": "soak",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
            "seconds": seconds,
            "iperf3_rate": args.rate or "unlimited",
            "reloads_sent": reloads,
            "dns_changes": tick // 10,
            "start": start,
            "end": end,
            "samples": samples,
            "throughput_gbit_per_10s": per10,
            "throughput_gbit_mean": total,
            "metrics_delta": delta,
            "log_lines": len((work / "tg.log").read_text(errors="replace").splitlines()),
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        log(f"==> start {start}\n==> end   {end}\n==> Gbit/s per 10 s: {per10} (mean {total})\n==> {delta}")
        log(f"==> wrote {out_path}")
        shutil.rmtree(work, ignore_errors=True)  # kept only when the run fails, for its logs
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
        for n in ns.values():
            kill_ns(n)


if __name__ == "__main__":
    sys.exit(main())
