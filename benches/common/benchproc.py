"""Process, namespace and /proc helpers shared by the benchmarks (benches/iperf, benches/peers,
benches/control, ...): running commands in namespaces, tunnel daemons as child processes, per-thread
CPU accounting, iperf3 servers, cleanup of what an earlier killed run left behind, result paths."""

from __future__ import annotations

import argparse
import os
import re
import signal
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PID = os.getpid()
# Where results go by default: outside the tree, so a run leaves `git status` clean.
OUT_ENV = "TUNNELGATE_BENCH_OUT"
DEFAULT_OUT_ROOT = Path("/tmp/tunnelgate-bench")
# The UAPI socket folder: shared by every network namespace, so interface names must be unique.
WG_SOCKET_DIR = Path("/var/run/wireguard")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class CommandFailed(Exception):
    """A command the benchmark needed failed; the message says which and why."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Runs a command, captures its output; standard input is empty unless `stdin`/`input` say otherwise."""
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise CommandFailed(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def nsx(ns: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run(["ip", "netns", "exec", ns, *args], **kw)


def wait_for(pred, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of all threads (fields 14 and 15 of /proc/PID/stat), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Every thread of `pid`: tid -> (thread name, utime + stime in clock ticks), from
    /proc/PID/task/*/stat. A thread that ends while this reads is left out."""
    threads: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            threads[int(tid)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return threads


def thread_cpu_delta(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    """CPU ticks each thread used between two `thread_cpu_ticks` snapshots; a thread born in
    between counts from zero, one that ended in between is lost (its ticks are not in `after`)."""
    return {tid: (name, ticks - before.get(tid, (name, 0))[1]) for tid, (name, ticks) in after.items()}


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat: how loaded the whole
    machine was over an interval, the benchmark's own processes included."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def add_ns(ns: str) -> str:
    """Creates network namespace `ns` with its loopback up (the benchmarks' one way to make
    one; kill_ns removes it)."""
    run(["ip", "netns", "add", ns])
    nsx(ns, "ip", "link", "set", "lo", "up")
    return ns


def sweep_stale(ns_pattern: str, sock_pattern: str | None = None) -> None:
    """Removes the namespaces (and UAPI sockets) an earlier, killed run left behind: those whose
    name fully matches the pattern and whose first group, the pid of the run that made them, is
    no longer alive."""
    for line in run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(ns_pattern, name)
        if m and not pid_alive(int(m.group(1))):
            kill_ns(name)
    if sock_pattern and WG_SOCKET_DIR.is_dir():
        for sock in WG_SOCKET_DIR.glob("*.sock"):
            m = re.fullmatch(sock_pattern, sock.name)
            if m and not pid_alive(int(m.group(1))):
                sock.unlink(missing_ok=True)


def raise_on_signals() -> None:
    """Turns SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt, so a benchmark's `finally` cleans up.
    Explicitly for SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps that."""

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def ns_pids(ns: str) -> list[int]:
    p = run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != PID]


def kill_ns(ns: str) -> None:
    """Ends every process in the namespace (TERM, then KILL), then deletes it."""
    pids = ns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if wait_for(lambda: not ns_pids(ns), 3.0):
            break
        pids = ns_pids(ns)
    run(["ip", "netns", "del", ns], check=False)


class Daemon:
    """One tunnel endpoint process (tunnelgate, wireguard-go, boringtun-cli, ...) in a namespace,
    with its output in `workdir/<ifname>.log`. Subclasses say how to start and configure it."""

    kind = "?"

    def __init__(self, ns: str, ifname: str, workdir: Path):
        self.ns, self.ifname, self.workdir = ns, ifname, workdir
        self.proc: subprocess.Popen | None = None
        self.logfile = workdir / f"{ifname}.log"
        self.key = self.pub = ""
        self.port = 0
        self.cpus = ""  # when set, started under `taskset -c CPUS` (all its threads, from the start)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def spawn(self, args: list[str], env: dict[str, str] | None = None) -> None:
        e = dict(os.environ)
        e.update(env or {})
        if self.cpus:
            args = ["taskset", "-c", self.cpus, *args]
        with open(self.logfile, "w") as out:
            # `ip netns exec NS cmd` execs cmd itself: proc.pid is the daemon.
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=e,
                start_new_session=True,  # Ctrl-C goes to us; we stop the daemon ourselves
            )

    def sock(self) -> Path:
        return WG_SOCKET_DIR / f"{self.ifname}.sock"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_note(self, timeout: float) -> str:
        code = self.proc.poll() if self.proc else None
        return f"exited {code}" if code is not None else f"timeout after {timeout:g} s"

    def wait_socket(self, timeout: float = 10) -> None:
        if not wait_for(lambda: self.sock().exists() or not self.alive(), timeout) or not self.alive():
            raise CommandFailed(f"{self.kind} did not create {self.sock()} ({self.exit_note(timeout)}): {tail(self.logfile)}")

    def link_up(self) -> bool:
        p = nsx(self.ns, "ip", "-o", "link", "show", "dev", self.ifname, check=False)
        m = re.search(r"<([^>]*)>", p.stdout)
        return p.returncode == 0 and m is not None and "UP" in m.group(1).split(",")

    def wait_configured(self, timeout: float = 10) -> None:
        """For `tunnelgate run`, which configures its interface itself: ready once the UAPI socket
        exists and the interface is up."""
        ready = lambda: self.alive() and self.sock().exists() and self.link_up()  # noqa: E731
        if not wait_for(lambda: ready() or not self.alive(), timeout) or not self.alive():
            raise CommandFailed(f"{self.kind} not ready ({self.exit_note(timeout)}): {tail(self.logfile) or '(no output)'}")

    def configure_wg(self, peers: list[tuple[str, list[str], str | None]], addresses: list[str], routes: list[str], mtu: int) -> None:
        """For a bare interface (wireguard-go, boringtun-cli, `tunnelgate userspace`): the key,
        port and peers (public key, allowed IPs, endpoint or None) with `wg set`, then addresses,
        extra routes and MTU with `ip`."""
        keyfile = self.workdir / f"{self.ifname}.key"
        keyfile.write_text(self.key + "\n")
        keyfile.chmod(0o600)
        wg = ["wg", "set", self.ifname, "private-key", str(keyfile), "listen-port", str(self.port)]
        for pub, allowed, endpoint in peers:
            wg += ["peer", pub, "allowed-ips", ",".join(allowed)] + (["endpoint", endpoint] if endpoint else [])
        nsx(self.ns, *wg)
        for addr in addresses:
            v6 = ":" in addr
            nsx(self.ns, "ip", *(["-6"] if v6 else []), "addr", "add", addr, "dev", self.ifname, *(["nodad"] if v6 else []))
        nsx(self.ns, "ip", "link", "set", "dev", self.ifname, "mtu", str(mtu), "up")
        for route in routes:
            nsx(self.ns, "ip", "route", "add", route, "dev", self.ifname)

    def stop(self) -> None:
        if self.proc is not None:
            terminate_process(self.proc)
        self.sock().unlink(missing_ok=True)


def iperf3_server(ns: str, port: int, bind: str | None = None, timeout: float = 5) -> subprocess.Popen:
    """Starts `iperf3 -s -1` (one test, then it exits) in `ns` and waits until it listens; the
    caller kills it when done (`stop_process`)."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, "iperf3", "-s", "-1", "-p", str(port), *(["-B", bind] if bind else [])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    listening = lambda: f":{port}" in nsx(ns, "ss", "-Hltn", f"sport = :{port}", check=False).stdout  # noqa: E731
    if not wait_for(lambda: listening() or server.poll() is not None, timeout) or server.poll() is not None:
        stop_process(server)
        raise CommandFailed(f"iperf3 server on port {port} in {ns} did not start")
    return server


def terminate_process(proc: subprocess.Popen, grace: float = 5) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def build_release_tunnelgate(buildlog: Path) -> str:
    """`cargo build --release --bin tunnelgate` in this tree, output to `buildlog`; returns the
    binary's path. Raises CommandFailed with the build's last lines when it fails."""
    log("==> cargo build --release --bin tunnelgate")
    with open(buildlog, "w") as out:
        rc = subprocess.call(["cargo", "build", "--release", "--bin", "tunnelgate"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        raise CommandFailed(f"cargo build --release failed ({rc}): {tail(buildlog, 8)}")
    return str(REPO / "target" / "release" / "tunnelgate")


def genkey() -> tuple[str, str]:
    key = run(["wg", "genkey"]).stdout.strip()
    pub = run(["wg", "pubkey"], input=key).stdout.strip()
    return key, pub


def git_commit() -> str:
    p = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False)
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], check=False)
    return p.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def med_spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """The median, and min-max in brackets when there is more than one value."""
    if not xs:
        return "-"
    m = fmt.format(statistics.median(xs) / scale)
    if len(xs) == 1:
        return m
    return f"{m} ({fmt.format(min(xs) / scale)}–{fmt.format(max(xs) / scale)})"


def add_output_args(ap: argparse.ArgumentParser, name: str) -> None:
    """--out FILE and --publish, shared by every benchmark (resolve them with `results_path`)."""
    published = f"benches/{name}/results/latest.json"
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--out",
        metavar="FILE",
        help=f"results JSON (default ${OUT_ENV}/{name}/latest.json, else {DEFAULT_OUT_ROOT}/{name}/latest.json: "
        "outside the source tree)",
    )
    g.add_argument(
        "--publish",
        action="store_true",
        help=f"write {published}, the committed figures the READMEs quote (do it when you commit new figures)",
    )


def results_path(args: argparse.Namespace, name: str) -> Path:
    """The results file `add_output_args` chose: --out, --publish's committed file, else
    $TUNNELGATE_BENCH_OUT/<name>/latest.json, else /tmp/tunnelgate-bench/<name>/latest.json. That
    last one is created here and must be a real directory owned by us: a benchmark runs as root, and
    /tmp is shared with everyone."""
    if args.out:
        return Path(args.out)
    if args.publish:
        return REPO / "benches" / name / "results" / "latest.json"
    if os.environ.get(OUT_ENV):
        return Path(os.environ[OUT_ENV]) / name / "latest.json"
    d = DEFAULT_OUT_ROOT / name
    for part in (DEFAULT_OUT_ROOT, d):
        try:
            part.mkdir(mode=0o755)
        except FileExistsError:
            pass
        st = os.lstat(part)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise CommandFailed(
                f"{part} is not a directory owned by uid {os.geteuid()}; remove it, or choose another "
                f"place with ${OUT_ENV}=DIR or --out FILE"
            )
    return d / "latest.json"


# --------------------------------------------------------------------------------------------------
# Scheduling: what class the packet threads are in, and how much CPU they take
# --------------------------------------------------------------------------------------------------

# /proc/PID/task/TID/stat field 41 (policy): 0 SCHED_OTHER, 1 SCHED_FIFO, 2 SCHED_RR, 3 SCHED_BATCH,
# 5 SCHED_IDLE, 6 SCHED_DEADLINE.
POLICY_NAMES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}
# tunnelgate's packet readers, the threads that ask for real-time priority (core::liveness names them).
READER_PREFIXES = ("tg-tun-rx-", "tg-udp-rx-")


def thread_sched(pid: int, tid: int) -> tuple[str, int, int, int] | None:
    """(name, policy, rt_priority, CPU nanoseconds) of one thread; None when it is gone. The CPU
    time is the first field of /proc/PID/task/TID/schedstat (exact, where utime+stime is in 10 ms ticks)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            head, rest = f.read().rsplit(")", 1)
        fields = rest.split()
        name = head.split("(", 1)[1]
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            cpu_ns = (int(fields[11]) + int(fields[12])) * (1_000_000_000 // CLK_TCK)
        # Fields after ")" start at field 3 (state): rt_priority is field 40, policy field 41.
        return name, int(fields[38]), int(fields[37]), cpu_ns
    except (OSError, IndexError, ValueError):
        return None


def threads_named(pid: int, prefixes: tuple[str, ...] = READER_PREFIXES) -> dict[int, str]:
    """tid -> name of the threads of `pid` whose name starts with one of `prefixes`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(prefixes):
            out[int(tid)] = name
    return out


class ThreadSampler:
    """Samples, every `interval` s in a background thread, the scheduling class of the named
    threads of some processes (by default tunnelgate's readers), and takes their CPU time at the
    start and the end: `stop()` returns, per process label, per thread, the fraction of samples at
    SCHED_FIFO and the share of one CPU the thread used over the window."""

    def __init__(self, pids: dict[str, int], interval: float = 0.01, prefixes: tuple[str, ...] = READER_PREFIXES):
        import threading

        self.pids, self.interval, self.prefixes = pids, interval, prefixes
        self.threads = {label: threads_named(pid, prefixes) for label, pid in pids.items()}
        self.counts: dict[tuple[str, int], dict[str, int]] = {}
        self.start_cpu: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def __enter__(self) -> "ThreadSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self.stop()

    def start(self) -> None:
        for label, tids in self.threads.items():
            for tid in tids:
                s = thread_sched(self.pids[label], tid)
                if s:
                    self.start_cpu[(label, tid)] = s[3]
        self.t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for label, tids in self.threads.items():
                for tid in tids:
                    s = thread_sched(self.pids[label], tid)
                    if s is None:
                        continue
                    c = self.counts.setdefault((label, tid), {})
                    key = POLICY_NAMES.get(s[1], str(s[1]))
                    c[key] = c.get(key, 0) + 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.monotonic() - self.t0
        out: dict = {}
        for label, tids in self.threads.items():
            per = {}
            for tid, name in sorted(tids.items(), key=lambda kv: kv[1]):
                s = thread_sched(self.pids[label], tid)
                c = self.counts.get((label, tid), {})
                n = sum(c.values())
                cpu = (s[3] - self.start_cpu[(label, tid)]) / 1e9 if s and (label, tid) in self.start_cpu else None
                per[name] = {
                    "samples": n,
                    "classes": c,
                    "fifo_fraction": round(c.get("fifo", 0) / n, 3) if n else None,
                    "cpu_share": round(cpu / wall, 3) if cpu is not None and wall > 0 else None,
                }
            n_all = sum(t["samples"] for t in per.values())
            fifo_all = sum((t["classes"].get("fifo", 0)) for t in per.values())
            out[label] = {
                "window_s": round(wall, 2),
                "interval_s": self.interval,
                "fifo_fraction": round(fifo_all / n_all, 3) if n_all else None,
                "cpu_share": round(sum(t["cpu_share"] or 0 for t in per.values()), 3) if per else None,
                "threads": per,
            }
        return out


def cpu_cgroup(pid: int) -> dict:
    """The cpu controller's cgroup of `pid` (cgroup v1 here) with its real-time runtime and CFS
    quota: what decides whether SCHED_FIFO is allowed (RT group scheduling) and what a CPU limit is."""
    out: dict = {}
    try:
        for line in open(f"/proc/{pid}/cgroup"):
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if "cpu" in ctrls.split(","):
                out["path"] = path
            elif ctrls == "" and "path" not in out:
                out["v2_path"] = path
    except OSError:
        return out
    if "path" in out:
        d = Path("/sys/fs/cgroup/cpu") / out["path"].lstrip("/")
        for f in ("cpu.rt_runtime_us", "cpu.rt_period_us", "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"):
            try:
                out[f] = int((d / f).read_text())
            except (OSError, ValueError):
                pass
    return out


def process_facts(pid: int) -> dict:
    """What a daemon process runs with, read from /proc: capabilities of its main thread and of
    its first reader (capabilities are per thread), no-new-privs, seccomp mode, RLIMIT_RTPRIO and
    its cpu cgroup. Evidence for 'measured as users run it'."""
    def status(p: str) -> dict:
        out = {}
        try:
            for line in open(p):
                k, _, v = line.partition(":")
                if k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Cpus_allowed_list", "NSpid"):
                    out[k] = v.strip()
        except OSError:
            pass
        return out

    facts: dict = {"main": status(f"/proc/{pid}/status")}
    readers = threads_named(pid)
    for tid, name in sorted(readers.items(), key=lambda kv: kv[1])[:1]:
        facts["reader"] = {"name": name, **status(f"/proc/{pid}/task/{tid}/status")}
    try:
        for line in open(f"/proc/{pid}/limits"):
            if line.startswith("Max realtime priority"):
                parts = line.split()
                facts["rlimit_rtprio"] = {"soft": parts[3], "hard": parts[4]}
    except OSError:
        pass
    facts["cpu_cgroup"] = cpu_cgroup(pid)
    return facts
