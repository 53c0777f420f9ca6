"""Process, namespace and /proc helpers shared by the benchmarks (benches/iperf, benches/control)."""

from __future__ import annotations

import argparse
import os
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
