#!/usr/bin/env python3
"""Longest silence a WireGuard peer sees when the endpoint it talks to restarts or fails over.

A wireguard-go client pings the tunnel address every 100 ms through a UDP balancer namespace
(nft DNAT, as kube-proxy does) to one of two replicas that hold the same private key, and
this measures the longest gap between ping replies around:

  restart          the replica is killed with SIGKILL and the same config started again at once;
  failover         the replica is killed, the balancer moves to the other one at once and flushes
                   its conntrack entries (what kube-proxy does when an endpoint leaves);
  failover-readyz  the replica is killed, and a balancer that follows readiness (a stand-in for
                   kubelet's probe plus kube-proxy) polls every replica every 500 ms: when the one
                   it points at is not ready, it moves to a ready one and flushes conntrack.
                   tunnelgate replicas are probed with GET /readyz; wireguard-go has no health
                   endpoint, so its replicas count as ready while their process lives.
  failback         nothing dies: the balancer moves the client to the other replica at once, and
                   DWELL seconds later (well within the 180 s a session lives) back to the first,
                   which still holds its old session; the figure is the move back's.

tunnelgate replicas run as shipped: a takeover goes only where the client authenticated, which
a restarted replica reads from its endpoints file (`takeover.state_file`, kept in the bench's
work folder across the restart) and a replica that never saw the client learns from the other
over the group's endpoint exchange (`takeover.group_listen`, the replicas found by one name that
resolves to both, as a headless Service's does).

Each case runs with tunnelgate replicas and with wireguard-go replicas, in one run, --rounds
times (default 3); the table reports the largest figure over the rounds. The tunnelgate binary
is `cargo build --release` of this tree unless --bin names one. Needs root.
"""
import argparse
import ctypes
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CommandFailed, add_output_args, build_release_tunnelgate, git_commit, results_path  # noqa: E402

NS = {"client": "fo-client", "lb": "fo-lb", "r1": "fo-r1", "r2": "fo-r2"}
LB_ADDR, CLIENT_ADDR = "10.9.0.1", "10.9.0.2"
REPLICA_ADDR = {"r1": "10.9.1.2", "r2": "10.9.2.2"}
LB_SIDE = {"r1": "10.9.1.1", "r2": "10.9.2.1"}
TUN_SERVER, TUN_CLIENT = "100.64.9.1", "100.64.9.2"
PORT = 51820
HEALTH_PORT = 9002
PROBE_PERIOD = 0.5  # the readiness-following balancer's poll period, seconds
PROBE_TIMEOUT = 0.4
CASES = ("restart", "failover", "failover-readyz", "failback")
GROUP_PORT = 51822
DWELL = 5.0  # failback: seconds on the other replica before the move back
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
        sh("rm", "-rf", f"/etc/netns/{ns}", check=False)
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
    # The replicas find each other by one name (`ip netns exec` mounts /etc/netns/NS/hosts).
    for r in ("r1", "r2"):
        os.makedirs(f"/etc/netns/{NS[r]}", exist_ok=True)
        with open(f"/etc/netns/{NS[r]}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} replicas.fo\n" for a in REPLICA_ADDR.values()))
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
        # It exits 1 when it deleted nothing, as `ip netns exec` does for a missing program:
        # its count line is what says it ran, and without it the old flow would stay.
        out = nsx("lb", "conntrack", "-D", "-p", "udp", "--orig-port-dst", str(PORT), check=False)
        if "flow entries have been deleted" not in out.stderr:
            raise RuntimeError(f"conntrack did not run in the balancer's namespace: "
                               f"{out.stderr.strip()}")


LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def enter_netns(name):
    """Moves the calling thread (only it) into namespace `name`: its sockets live there."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if LIBC.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def readyz_ok(addr):
    """GET http://ADDR:9002/readyz from the calling thread's namespace: 200 is ready; an error,
    a timeout or any other status is not."""
    conn = http.client.HTTPConnection(addr, HEALTH_PORT, timeout=PROBE_TIMEOUT)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class ReadinessBalancer(threading.Thread):
    """A stand-in for a readiness probe plus kube-proxy, in the balancer namespace: every
    PROBE_PERIOD it asks each replica whether it is ready (tunnelgate: GET /readyz; wireguard-go,
    which has no health endpoint: its process lives), and when the replica the DNAT points at is
    not, points the DNAT at a ready one and deletes the flow's conntrack entries. One failed
    probe moves it (kubelet's default failureThreshold is 3, at a 10 s period)."""

    def __init__(self, replicas, owner):
        super().__init__(daemon=True)
        self.replicas, self.owner = replicas, owner
        self.stopping = threading.Event()
        self.all_ready = threading.Event()  # one probe round found every replica ready
        self.moves = []  # (unix time, from, to)
        self.error = None

    def ready(self, name):
        replica = self.replicas[name]
        if replica.kind == "tunnelgate":
            return readyz_ok(REPLICA_ADDR[name])
        return replica.proc is not None and replica.proc.poll() is None

    def run(self):
        try:
            enter_netns(NS["lb"])
            while not self.stopping.is_set():
                started = time.monotonic()
                states = {name: self.ready(name) for name in self.replicas}
                if all(states.values()):
                    self.all_ready.set()
                if self.all_ready.is_set() and not states[self.owner]:
                    to = next((name for name, ok in states.items() if ok), None)
                    if to is not None:
                        point_balancer(to)
                        self.moves.append((time.time(), self.owner, to))
                        self.owner = to
                self.stopping.wait(max(0.0, PROBE_PERIOD - (time.monotonic() - started)))
        except Exception as e:  # reported by the measurement
            self.error = e

    def stop(self):
        self.stopping.set()
        self.join(5)


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
listen = "{REPLICA_ADDR[self.where]}:{HEALTH_PORT}"

[takeover]
state_file = "{os.path.join(self.workdir, self.name + '.endpoints')}"
group_listen = "0.0.0.0:{GROUP_PORT}"
group_replicas = "replicas.fo:{GROUP_PORT}"
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
    """One round of one case with one kind of replica: the silences after the event, in seconds."""
    lab()
    server_key, client_key = genkey(), genkey()
    replicas = {r: Replica(kind, r, server_key, client_key[1], binary, workdir) for r in ("r1", "r2")}
    replicas["r1"].start()
    if case != "restart":
        replicas["r2"].start()
    balancer = None
    if case == "failover-readyz":
        balancer = ReadinessBalancer(replicas, "r1")
        balancer.start()
        if not balancer.all_ready.wait(10):
            raise RuntimeError(f"{kind} {case}: the balancer never found both replicas ready ({balancer.error})")
    client = subprocess.Popen(["ip", "netns", "exec", NS["client"], "wireguard-go", "-f", "wgfoc"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=WG_ENV)
    wait_for(lambda: os.path.exists("/var/run/wireguard/wgfoc.sock"))
    configure_wg("client", "wgfoc", client_key[0], TUN_CLIENT, server_key[1], TUN_SERVER,
                 f"{LB_ADDR}:{PORT}")
    pinglog = os.path.join(workdir, f"ping-{kind}-{case}.log")
    with open(pinglog, "w") as out:
        ping = subprocess.Popen(["ip", "netns", "exec", NS["client"], "ping", "-n", "-D", "-i", "0.1",
                                 "-W", "1", TUN_SERVER], stdout=out, stderr=subprocess.DEVNULL)
        # The probe's phase against the crash is random in a cluster: so it is here (a fixed
        # wait would kill at the same point of the probe period every round).
        time.sleep(3 + (random.uniform(0, PROBE_PERIOD) if balancer else 0))
        moved_away = None
        if case == "failback":
            # Away to the second replica (a takeover there), and back after DWELL seconds.
            moved_away = time.time()
            point_balancer("r2")
            time.sleep(DWELL)
            event = time.time()
            point_balancer("r1")
        else:
            event = time.time()
            replicas["r1"].kill()
        if case == "restart":
            replicas["r1"].start()
        elif case == "failover":
            point_balancer("r2")
        ready = time.time()  # failover-readyz: replaced by the balancer's move below
        end = event + window
        while time.time() < end:
            time.sleep(0.2)
            times = [t for t in reply_times(open(pinglog).read()) if t > event]
            if times and times[-1] - times[0] > 2.0:
                break
        ping.send_signal(signal.SIGINT)
        ping.wait()
    if balancer is not None:
        balancer.stop()
        if balancer.error is not None:
            raise RuntimeError(f"{kind} {case}: the balancer failed: {balancer.error}")
        if not balancer.moves:
            raise RuntimeError(f"{kind} {case}: the balancer never moved")
        ready = balancer.moves[0][0]
    times = reply_times(open(pinglog).read())
    before = [t for t in times if t <= event]
    after = [t for t in times if t > event]
    away = None
    if moved_away is not None:
        went = [t for t in times if moved_away < t <= event]
        there = [t for t in times if t <= moved_away]
        away = round(went[0] - there[-1], 2) if went and there else None
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
        **({"move_away_silence_s": away, "dwell_s": DWELL} if moved_away is not None else {}),
    }


def worst(values):
    """The largest of a case's figures over the rounds; None (no reply within the window) is
    the worst of all."""
    return None if any(v is None for v in values) else max(values)


def build_profile(binary):
    """`release` or `debug` for a binary under a cargo target directory, else `unknown`."""
    parent = Path(binary).parent.name
    return parent if parent in ("release", "debug") else "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bin", help="tunnelgate binary (default: `cargo build --release` of this tree)")
    ap.add_argument("--window", type=float, default=25.0, help="seconds to wait for replies")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every case (default 3)")
    ap.add_argument("--case", action="append", choices=CASES, help="only this case (repeatable)")
    add_output_args(ap, "failover")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    out = results_path(args, "failover")
    cases = args.case or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="failover-") as workdir:
        if args.bin:
            binary = os.path.abspath(args.bin)
        else:
            try:
                binary = build_release_tunnelgate(Path(workdir) / "cargo-build.log")
            except CommandFailed as e:
                sys.exit(str(e))
        try:
            for rnd in range(1, args.rounds + 1):
                for case in cases:
                    for kind in ("tunnelgate", "wireguard-go"):
                        row = dict(measure(kind, case, binary, workdir, args.window), round=rnd)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
        finally:
            teardown()
    summary = []
    for case in cases:
        for kind in ("tunnelgate", "wireguard-go"):
            mine = [r for r in rows if r["case"] == case and r["replicas"] == kind]
            summary.append({
                "replicas": kind,
                "case": case,
                "rounds": len(mine),
                "longest_silence_max_s": worst([r["longest_silence_s"] for r in mine]),
                "after_ready_max_s": worst([r["after_ready_s"] for r in mine]),
                "longest_silence_s": [r["longest_silence_s"] for r in mine],
            })
    result = {
        "commit": git_commit(),
        "build_profile": build_profile(binary),
        "binary": binary,
        "client": "wireguard-go (Debian)",
        "ping_interval_s": 0.1,
        "probe_period_s": PROBE_PERIOD,
        "rounds": args.rounds,
        "summary": summary,
        "rows": rows,
    }
    fmt = lambda v: "no reply" if v is None else f"{v} s"  # noqa: E731
    print()
    print(f"max over {args.rounds} round(s), {result['build_profile']} build of {result['commit']}:")
    print("| replicas | case | longest silence | after the new one was ready | each round |")
    print("|---|---|---|---|---|")
    for r in summary:
        each = ", ".join(fmt(v) for v in r["longest_silence_s"])
        print(f"| {r['replicas']} | {r['case']} | {fmt(r['longest_silence_max_s'])} | {fmt(r['after_ready_max_s'])} | {each} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
