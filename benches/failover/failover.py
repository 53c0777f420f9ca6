#!/usr/bin/env python3
"""Longest silence a WireGuard peer sees when the endpoint it talks to restarts or fails over.

A wireguard-go client pings the tunnel address every 100 ms through a UDP balancer namespace
(nft DNAT, as kube-proxy does) to one of two replicas that hold the same private key, and
this measures the longest gap between ping replies around:

  restart   the replica is killed with SIGKILL and the same config started again at once;
  failover  the replica is killed, the balancer moves to the other one at once and flushes
            its conntrack entries (what kube-proxy does when an endpoint leaves).

Each case runs with tunnelgate replicas and with wireguard-go replicas, in one run. Needs root.
"""
import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

NS = {"client": "fo-client", "lb": "fo-lb", "r1": "fo-r1", "r2": "fo-r2"}
LB_ADDR, CLIENT_ADDR = "10.9.0.1", "10.9.0.2"
REPLICA_ADDR = {"r1": "10.9.1.2", "r2": "10.9.2.2"}
LB_SIDE = {"r1": "10.9.1.1", "r2": "10.9.2.1"}
TUN_SERVER, TUN_CLIENT = "100.64.9.1", "100.64.9.2"
PORT = 51820
WG_ENV = dict(os.environ, WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD="1")


def sh(*args, check=True, **kw):
    r = subprocess.run(args, check=False, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def nsx(ns, *args, check=True):
    return sh("ip", "netns", "exec", NS[ns], *args, check=check)


def genkey():
    private = sh("wg", "genkey").stdout.strip()
    public = subprocess.run(["wg", "pubkey"], input=private, capture_output=True, text=True,
                            check=True).stdout.strip()
    return private, public


def teardown():
    for ns in NS.values():
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", ns, check=False)
    # A process killed with SIGKILL leaves its UAPI socket: the next one would be waited for
    # by a stale file.
    for name in ("wgfoc", "wgfo1", "wgfo2", "tgfo1", "tgfo2"):
        try:
            os.unlink(f"/var/run/wireguard/{name}.sock")
        except FileNotFoundError:
            pass


def lab():
    teardown()
    for ns in NS.values():
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "fo-c", "netns", NS["client"], "type", "veth", "peer", "name", "fo-lbc",
       "netns", NS["lb"])
    nsx("client", "ip", "addr", "add", f"{CLIENT_ADDR}/24", "dev", "fo-c")
    nsx("client", "ip", "link", "set", "fo-c", "up")
    nsx("lb", "ip", "addr", "add", f"{LB_ADDR}/24", "dev", "fo-lbc")
    nsx("lb", "ip", "link", "set", "fo-lbc", "up")
    for r in ("r1", "r2"):
        sh("ip", "link", "add", f"fo-{r}", "netns", NS[r], "type", "veth", "peer", "name",
           f"fo-lb{r}", "netns", NS["lb"])
        nsx(r, "ip", "addr", "add", f"{REPLICA_ADDR[r]}/24", "dev", f"fo-{r}")
        nsx(r, "ip", "link", "set", f"fo-{r}", "up")
        nsx(r, "ip", "route", "add", "default", "via", LB_SIDE[r])
        nsx("lb", "ip", "addr", "add", f"{LB_SIDE[r]}/24", "dev", f"fo-lb{r}")
        nsx("lb", "ip", "link", "set", f"fo-lb{r}", "up")
    nsx("lb", "sysctl", "-qw", "net.ipv4.ip_forward=1")
    point_balancer("r1", flush=False)


def point_balancer(replica, flush=True):
    rules = f"""
table ip fo_lb
delete table ip fo_lb
table ip fo_lb {{
    chain pre {{
        type nat hook prerouting priority -100;
        iifname "fo-lbc" udp dport {PORT} dnat to {REPLICA_ADDR[replica]}:{PORT}
    }}
}}
"""
    subprocess.run(["ip", "netns", "exec", NS["lb"], "nft", "-f", "-"], input=rules, text=True,
                   check=True, capture_output=True)
    if flush:
        nsx("lb", "conntrack", "-D", "-p", "udp", "--orig-port-dst", str(PORT), check=False)


class Replica:
    """One replica: tunnelgate (`run --config`) or wireguard-go configured with `wg set`."""

    def __init__(self, kind, where, key, client_public, binary, workdir):
        self.kind, self.where, self.key, self.client_public = kind, where, key, client_public
        self.binary, self.workdir = binary, workdir
        self.name = f"{'tg' if kind == 'tunnelgate' else 'wg'}fo{where[-1]}"
        self.proc = None

    def start(self):
        log = open(os.path.join(self.workdir, f"{self.name}.log"), "a")
        if self.kind == "tunnelgate":
            keyfile = os.path.join(self.workdir, f"{self.name}.key")
            with open(os.open(keyfile, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:
                f.write(self.key[0] + "\n")
            cfg = os.path.join(self.workdir, f"{self.name}.toml")
            with open(cfg, "w") as f:
                f.write(f"""[interface]
name = "{self.name}"
private_key_file = "{keyfile}"
listen_port = {PORT}
addresses = ["{TUN_SERVER}/32"]
workers = 1

[[peer]]
public_key = "{self.client_public}"
allowed_ips = ["{TUN_CLIENT}/32"]

[health]
listen = ""
""")
            self.proc = subprocess.Popen(["ip", "netns", "exec", NS[self.where], self.binary, "run",
                                          "--config", cfg], stdout=log, stderr=log)
            wait_for(lambda: os.path.exists(f"/var/run/wireguard/{self.name}.sock")
                     and nsx(self.where, "ip", "link", "show", self.name, check=False).returncode == 0)
        else:
            self.proc = subprocess.Popen(["ip", "netns", "exec", NS[self.where], "wireguard-go", "-f",
                                          self.name], stdout=log, stderr=log, env=WG_ENV)
            wait_for(lambda: os.path.exists(f"/var/run/wireguard/{self.name}.sock"))
            configure_wg(self.where, self.name, self.key[0], TUN_SERVER, self.client_public,
                         TUN_CLIENT, None)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for leftover in (f"/var/run/wireguard/{self.name}.sock",):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        nsx(self.where, "ip", "link", "del", self.name, check=False)


def configure_wg(where, name, private, address, peer_public, peer_allowed, endpoint):
    with tempfile.NamedTemporaryFile("w", delete=False) as f:
        f.write(private)
        keyfile = f.name
    args = ["wg", "set", name, "private-key", keyfile, "peer", peer_public, "allowed-ips",
            f"{peer_allowed}/32"]
    if endpoint:
        args += ["endpoint", endpoint]
    else:
        args[5:5] = ["listen-port", str(PORT)]
    nsx(where, *args)
    os.unlink(keyfile)
    nsx(where, "ip", "addr", "add", f"{address}/32", "dev", name)
    nsx(where, "ip", "link", "set", name, "up")
    nsx(where, "ip", "route", "add", f"{peer_allowed}/32", "dev", name)


def wait_for(cond, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise RuntimeError("timed out waiting for a replica")


def reply_times(text):
    return [float(m.group(1)) for m in re.finditer(r"^\[(\d+\.\d+)\] \d+ bytes from", text, re.M)]


def measure(kind, case, binary, workdir, window):
    """One case with one kind of replica: the longest silence after the event, in seconds."""
    lab()
    server_key, client_key = genkey(), genkey()
    replicas = {r: Replica(kind, r, server_key, client_key[1], binary, workdir) for r in ("r1", "r2")}
    replicas["r1"].start()
    if case == "failover":
        replicas["r2"].start()
    client = subprocess.Popen(["ip", "netns", "exec", NS["client"], "wireguard-go", "-f", "wgfoc"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=WG_ENV)
    wait_for(lambda: os.path.exists("/var/run/wireguard/wgfoc.sock"))
    configure_wg("client", "wgfoc", client_key[0], TUN_CLIENT, server_key[1], TUN_SERVER,
                 f"{LB_ADDR}:{PORT}")
    pinglog = os.path.join(workdir, f"ping-{kind}-{case}.log")
    with open(pinglog, "w") as out:
        ping = subprocess.Popen(["ip", "netns", "exec", NS["client"], "ping", "-n", "-D", "-i", "0.1",
                                 "-W", "1", TUN_SERVER], stdout=out, stderr=subprocess.DEVNULL)
        time.sleep(3)
        event = time.time()
        replicas["r1"].kill()
        if case == "restart":
            replicas["r1"].start()
        else:
            point_balancer("r2")
        ready = time.time()
        end = event + window
        while time.time() < end:
            time.sleep(0.2)
            times = [t for t in reply_times(open(pinglog).read()) if t > event]
            if times and times[-1] - times[0] > 2.0:
                break
        ping.send_signal(signal.SIGINT)
        ping.wait()
    times = reply_times(open(pinglog).read())
    before = [t for t in times if t <= event]
    after = [t for t in times if t > event]
    client.send_signal(signal.SIGKILL)
    for r in replicas.values():
        if r.proc and r.proc.poll() is None:
            r.kill()
    teardown()
    if not before:
        raise RuntimeError(f"{kind} {case}: no ping answered before the event")
    silence = (after[0] - before[-1]) if after else None
    return {
        "replicas": kind,
        "case": case,
        "longest_silence_s": round(silence, 2) if silence is not None else None,
        "after_ready_s": round(after[0] - ready, 2) if after else None,
        "ready_after_event_s": round(ready - event, 2),
        "window_s": window,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bin", default="target/release/tunnelgate")
    ap.add_argument("--window", type=float, default=25.0, help="seconds to wait for replies")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    binary = os.path.abspath(args.bin)
    commit = sh("git", "rev-parse", "--short", "HEAD", check=False).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="failover-") as workdir:
        try:
            for case in ("restart", "failover"):
                for kind in ("tunnelgate", "wireguard-go"):
                    row = measure(kind, case, binary, workdir, args.window)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            teardown()
    result = {"commit": commit, "binary": args.bin, "client": "wireguard-go (Debian)",
              "ping_interval_s": 0.1, "rows": rows}
    print()
    print("| replicas | case | longest silence | after the new one was ready |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['replicas']} | {r['case']} | {r['longest_silence_s']} s | {r['after_ready_s']} s |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
