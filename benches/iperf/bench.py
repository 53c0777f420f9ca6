#!/usr/bin/env python3
"""iperf3 benchmark of tunnelgate against plain veth, wireguard-go, boringtun-cli and gotatun.

Every setup gets its own pair of network namespaces joined by a veth pair (underlay 10.99.0.1/.2,
fd00:99::1/2); the tunnel between them uses 10.100.0.1/.2 and fd00:100::1/2, MTU 1420. In each round,
every setup runs, in turn (the order rotates from round to round):

  tcp1  iperf3 TCP, 1 stream          tcp4  iperf3 TCP, 4 streams (-P 4)
  udp   iperf3 UDP at 1 Gbit/s offered (-u -b 1G): loss %
  ping  20 pings, average RTT

For every daemon it records CPU seconds (utime+stime from /proc/PID/stat, all threads) per GB moved,
and peak RSS (VmHWM). It prints a table of medians with the spread (min-max), and the ratios of
tunnelgate to every other setup for single-stream TCP, and writes the raw results as JSON.

A setup that cannot start (say, tunnelgate is not built yet) is reported as failed with the reason;
the others still run. Everything the benchmark creates (namespaces, daemons, sockets) is removed at
the end, also on Ctrl-C, SIGTERM or an error.

Needs root, iperf3, wireguard-go, wireguard-tools, iproute2, iputils-ping; boringtun-cli and gotatun
(Mullvad's fork of boringtun, crate gotatun-cli) are installed with `cargo install CRATE --locked`
into a cache directory when they are not on PATH.
Usage: benches/iperf/run.sh [--quick] [--rounds N] [--duration S] [--setups a,b] [--out FILE | --publish]
"""

from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from benchproc import CommandFailed as SetupFailed  # noqa: E402
from benchproc import CLK_TCK, Daemon, add_ns, add_output_args, results_path, log, run, nsx, cpu_ticks, status_kib, tail, wait_for, kill_ns, genkey, git_commit, med_spread  # noqa: E402
from benchproc import build_release_tunnelgate, iperf3_server, pid_alive, process_facts, raise_on_signals, stop_process, sweep_stale  # noqa: E402
import shipped  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tunnelgate-bench"
PID = os.getpid()
NS_PREFIX = "tgbench"  # namespaces: tgbench<pid>s<i><a|b>
IF_PREFIX = "tb"  # interfaces: tb<pid>s<i><a|b> (<= 15 chars; the UAPI folder is shared)

UNDERLAY = {"a": ("10.99.0.1", "fd00:99::1"), "b": ("10.99.0.2", "fd00:99::2")}
TUNNEL = {"a": ("10.100.0.1", "fd00:100::1"), "b": ("10.100.0.2", "fd00:100::2")}
MTU = 1420
IPERF_PORT = 5201

# name -> (daemon kind on side a, daemon kind on side b); None = plain veth
SETUPS = {
    "veth": (None, None),
    "tunnelgate": ("tunnelgate", "tunnelgate"),
    # The price of the packet threads' seccomp filter: the same daemon with --seccomp off.
    "tunnelgate-noseccomp": ("tunnelgate-noseccomp", "tunnelgate-noseccomp"),
    # One packet worker (`interface.workers = 1`): what the default's extra workers cost a
    # single stream, which runs on one worker either way.
    "tunnelgate-1worker": ("tunnelgate-1worker", "tunnelgate-1worker"),
    "wireguard-go": ("wireguard-go", "wireguard-go"),
    # wireguard-go with TUN offloads (GSO/GRO), the strongest userspace peers: upstream master and
    # Tailscale's fork, built in ../shared/bin (see its README). Skipped, with the reason, when absent.
    "wireguard-go-upstream": ("wireguard-go-upstream", "wireguard-go-upstream"),
    "wireguard-go-tailscale": ("wireguard-go-tailscale", "wireguard-go-tailscale"),
    "boringtun": ("boringtun", "boringtun"),
    "boringtun-t1": ("boringtun-t1", "boringtun-t1"),
    # Mullvad's fork of boringtun (gotatun-cli 0.10 has no --threads option).
    "gotatun": ("gotatun", "gotatun"),
    "tunnelgate-wggo": ("tunnelgate", "wireguard-go"),
    # As users run it (issue 38): both ends under the repository's systemd unit, booted by systemd
    # in systemd-nspawn; the receiving end (b: the proxy, whose ingress the stream is) as the
    # Kubernetes proxy container run by podman with the manifest's securityContext and a CPU
    # limit of 2 or 1, its peer (a) an ordinary tunnelgate elsewhere (benches/common/shipped.py).
    # One container, so this kernel's real-time group scheduling can give it nearly all the
    # real-time time the root has (two would split it, a limit Kubernetes nodes do not have).
    "unit": ("tunnelgate-unit", "tunnelgate-unit"),
    "pod-cpu2": ("tunnelgate", "tunnelgate-pod-cpu2"),
    "pod-cpu1": ("tunnelgate", "tunnelgate-pod-cpu1"),
    # As a gateway runs: the receiving end (b) alone on a CPU of its own, the sender and the
    # benchmark's own processes (iperf3 ends, ping) on the others (GATEWAY_SETUPS).
    "gateway": ("tunnelgate", "tunnelgate"),
    "gateway-wireguard-go-upstream": ("wireguard-go-upstream", "wireguard-go-upstream"),
    "gateway-wireguard-go-tailscale": ("wireguard-go-tailscale", "wireguard-go-tailscale"),
}
GATEWAY_SETUPS = ("gateway", "gateway-wireguard-go-upstream", "gateway-wireguard-go-tailscale")
POD_SETUPS = ("pod-cpu2", "pod-cpu1")
# --daemon-env SETUP:K=V,...: extra environment of a setup's tunnelgate daemons.
SETUP_ENV: dict[str, dict[str, str]] = {}


def needs_tunnelgate(names: list[str]) -> bool:
    return any(k and k.startswith("tunnelgate") for n in names for k in SETUPS[n])


def gateway_cpus() -> tuple[str, str]:
    """(the gateway's CPU, the others) for the gateway setups: the last CPU this process may use,
    and the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SetupFailed(f"the gateway setups need 2 CPUs, this process may use {cpus}")
    return str(cpus[-1]), ",".join(map(str, cpus[:-1]))
# With --baseline BIN: the same tunnelgate setup run by an earlier build, in the same run, to
# show a change kept the packet path's speed on this very machine.
BASELINE_SETUP = "tunnelgate-baseline"
# udpmax: iperf3 UDP with 1392-byte datagrams at about the rate plain veth carries (--udp-max-rate);
# pps64/pps64r: 64-byte UDP datagrams as fast as iperf3 sends them, a -> b and b -> a (-R).
TESTS = ("tcp1", "tcp4", "udp", "udpmax", "ping")
# uso/uso-off: a UDP_SEGMENT sender (benches/iperf/udpgso.py, as QUIC stacks send) a -> b, with
# the tunnel interface's UDP segmentation offload (USO) on, and off (`ethtool -K IF
# tx-udp-segmentation off`: the kernel then splits each super-datagram before the daemon sees it).
ALL_TESTS = TESTS + ("pps64", "pps64r", "uso", "uso-off")
UDPGSO = Path(__file__).resolve().parent / "udpgso.py"
USO_PORT = 5301
# The wireguard-go builds with offloads; headline ratios are against the faster of them.
WGGO_STRONG = ("wireguard-go-upstream", "wireguard-go-tailscale")
UDP_MAX_RATE = ["2.2G"]  # set by --udp-max-rate


def shared_bin_dir() -> Path | None:
    """../shared/bin beside the repository (a worktree under wt/ looks one level higher too), or
    $TUNNELGATE_PEERS_BIN."""
    env = os.environ.get("TUNNELGATE_PEERS_BIN")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "bin", REPO.parents[1] / "shared" / "bin"]
    return next((c for c in candidates if c.is_dir()), None)


# --------------------------------------------------------------------------------------------------
# Cleanup: every namespace and process goes, whatever happens
# --------------------------------------------------------------------------------------------------


def sweep_stale_runs() -> None:
    """Removes namespaces and sockets that an earlier, killed benchmark run left behind."""
    sweep_stale(NS_PREFIX + r"(\d+)s\d+[ab]", IF_PREFIX + r"(\d+)s\d+[ab]\.sock")
    shipped.sweep_stale_pods()


# --------------------------------------------------------------------------------------------------
# Daemons
# --------------------------------------------------------------------------------------------------


class WgStyle(Daemon):
    """wireguard-go, boringtun-cli and gotatun: an empty interface, configured with `wg set` and `ip`."""

    def start(self, side: str, peer_pub: str, peer_port: int) -> None:
        raise NotImplementedError

    def configure(self, side: str, peer_pub: str, peer_port: int) -> None:
        other = "b" if side == "a" else "a"
        self.configure_wg(
            [(peer_pub, [f"{TUNNEL[other][0]}/32", f"{TUNNEL[other][1]}/128"], f"{UNDERLAY[other][0]}:{peer_port}")],
            [f"{TUNNEL[side][0]}/24", f"{TUNNEL[side][1]}/64"],
            [],
            MTU,
        )


class WireguardGo(WgStyle):
    """Debian's wireguard-go (PATH), or a build from ../shared/bin (`kind` names it)."""

    kind = "wireguard-go"

    def __init__(self, ns, ifname, workdir, kind: str = "wireguard-go"):
        super().__init__(ns, ifname, workdir)
        self.kind = kind

    def binary(self) -> str:
        if self.kind == "wireguard-go":
            return "wireguard-go"
        d = shared_bin_dir()
        path = d / self.kind if d else None
        if path is None or not os.access(path, os.X_OK):
            raise SetupFailed(f"skipped: no {self.kind} binary in ../shared/bin or $TUNNELGATE_PEERS_BIN (see shared/bin/README.md)")
        return str(path)

    def start(self, side, peer_pub, peer_port):
        self.spawn([self.binary(), "-f", self.ifname], {"WG_PROCESS_FOREGROUND": "1"})
        self.wait_socket()
        self.configure(side, peer_pub, peer_port)


class Boringtun(WgStyle):
    """boringtun-cli; its fork gotatun (below) takes the same flags."""

    kind = "boringtun"
    crate, command = "boringtun-cli", "boringtun-cli"
    binary = ""  # set by prepare_cargo_tool, per class

    def __init__(self, ns, ifname, workdir, threads: int | None):
        super().__init__(ns, ifname, workdir)
        self.threads = threads
        if threads:
            self.kind = f"{type(self).kind}-t{threads}"

    def start(self, side, peer_pub, peer_port):
        binary = type(self).binary
        if not binary:
            raise SetupFailed(f"{self.command} is not available (see the install error above)")
        args = [binary, "--foreground", "--disable-drop-privileges", "--log", str(self.logfile)]
        if self.threads:
            args += ["--threads", str(self.threads)]
        self.spawn(args + [self.ifname], {"WG_SUDO": "1"})
        self.wait_socket()
        self.configure(side, peer_pub, peer_port)


class Gotatun(Boringtun):
    kind = "gotatun"
    crate, command = "gotatun-cli", "gotatun"
    binary = ""


class Tunnelgate(Daemon):
    kind = "tunnelgate"
    binary = ""
    unavailable = ""

    baseline = ""
    baseline_env: dict[str, str] = {}

    def __init__(self, ns, ifname, workdir, seccomp: str = "enforce", baseline: bool = False, workers: int = 0):
        super().__init__(ns, ifname, workdir)
        self.seccomp = seccomp
        self.use_baseline = baseline
        self.workers = workers
        self.extra_env: dict[str, str] = {}
        if seccomp == "off":
            self.kind = "tunnelgate-noseccomp"
        if workers == 1:
            self.kind = "tunnelgate-1worker"
        if baseline:
            self.kind = BASELINE_SETUP

    def config_text(self, side: str, peer_pub: str, peer_port: int, keyfile: str) -> str:
        other = "b" if side == "a" else "a"
        return f"""# written by benches/iperf/bench.py
[interface]
name = "{self.ifname}"
private_key_file = "{keyfile}"
listen_port = {self.port}
addresses = ["{TUNNEL[side][0]}/32", "{TUNNEL[side][1]}/128"]
mtu = {MTU}
{f"workers = {self.workers}" if self.workers else ""}

[[peer]]
public_key = "{peer_pub}"
endpoint = "{UNDERLAY[other][0]}:{peer_port}"
allowed_ips = ["{TUNNEL[other][0]}/32", "{TUNNEL[other][1]}/128"]

[health]
listen = ""
"""

    def env(self, quiet_log: bool = True) -> dict[str, str]:
        """The daemon's environment beyond what it inherits: RUST_LOG (warn unless set; not for
        the shipped setups, which log as users see it), the baseline's --baseline-env, and the
        setup's --daemon-env."""
        env = {"RUST_LOG": os.environ.get("RUST_LOG", "warn")} if quiet_log or "RUST_LOG" in os.environ else {}
        if self.use_baseline:
            env.update(Tunnelgate.baseline_env)
        env.update(self.extra_env)
        return env

    def start(self, side, peer_pub, peer_port):
        if Tunnelgate.unavailable:
            raise SetupFailed(Tunnelgate.unavailable)
        keyfile = self.workdir / f"{self.ifname}.key"
        keyfile.write_text(self.key + "\n")
        keyfile.chmod(0o600)
        config = self.workdir / f"{self.ifname}.toml"
        config.write_text(self.config_text(side, peer_pub, peer_port, str(keyfile)))
        # An earlier build may predate --seccomp: it runs with its own defaults.
        command = ([Tunnelgate.baseline, "run", "--config", str(config)] if self.use_baseline
                   else [Tunnelgate.binary, "run", "--config", str(config), "--seccomp", self.seccomp])
        self.spawn(command, self.env())

        self.wait_configured()

    def facts(self) -> dict:
        return process_facts(self.pid)


class UnitTunnelgate(Tunnelgate):
    """tunnelgate under the repository's systemd unit, started by systemd booted in a
    systemd-nspawn container that joins the setup's namespace (benches/common/shipped.py)."""

    kind = "tunnelgate-unit"
    rootfs: Path | None = None

    def __init__(self, ns, ifname, workdir):
        super().__init__(ns, ifname, workdir)
        self.kind = "tunnelgate-unit"
        self.container: shipped.NspawnUnit | None = None
        self.host_pid: int | None = None

    @property
    def pid(self) -> int:
        assert self.host_pid is not None
        return self.host_pid

    def alive(self) -> bool:
        return self.host_pid is not None and pid_alive(self.host_pid)

    def start(self, side, peer_pub, peer_port):
        if Tunnelgate.unavailable:
            raise SetupFailed(Tunnelgate.unavailable)
        if UnitTunnelgate.rootfs is None:
            raise SetupFailed("no rootfs for systemd-nspawn (see the error above)")
        etc = self.workdir / f"etc-{self.ifname}"
        etc.mkdir(mode=0o700, exist_ok=True)
        (etc / "private.key").write_text(self.key + "\n")
        (etc / "private.key").chmod(0o600)
        (etc / "tunnelgate.toml").write_text(self.config_text(side, peer_pub, peer_port, "/etc/tunnelgate/private.key"))
        self.container = shipped.NspawnUnit(self.ns, UnitTunnelgate.rootfs, Tunnelgate.binary, etc, self.workdir, self.env(quiet_log=False))
        self.container.boot()
        self.host_pid = self.container.wait_active()
        if not wait_for(lambda: self.link_up() or not self.alive(), 15) or not self.alive():
            raise SetupFailed(f"tunnelgate.service: {self.ifname} not up: {self.container.journal()[-600:]}")

    def facts(self) -> dict:
        f = process_facts(self.pid)
        if self.container:
            init = self.container.init_pid()
            # What the container allows at most: a unit cannot keep a capability nspawn dropped.
            f["container_init"] = process_facts(init)["main"] if init else None
            f["unit"] = self.container.properties()
            f["how"] = shipped.unit_reproduction_note()
            f["unit_log"] = [l for l in self.container.journal().splitlines() if "priority" in l.lower() or "realtime" in l.lower() or "real-time" in l.lower()][-5:]
        return f

    def stop(self) -> None:
        if self.container:
            self.container.stop()
        self.host_pid = None


class PodTunnelgate(Tunnelgate):
    """tunnelgate as the Kubernetes proxy container (containers/k8s/statefulset.yaml's
    securityContext), run by podman with CPU limit `cpus`, joined to the setup's namespace."""

    image = "localhost/tunnelgate-bench:latest"
    bind_binary = True
    rt: shipped.RtCgroup | None = None

    def __init__(self, ns, ifname, workdir, cpus: int):
        super().__init__(ns, ifname, workdir)
        self.kind = f"tunnelgate-pod-cpu{cpus}"
        self.pod_cpus = cpus
        self.container: shipped.PodContainer | None = None
        self.host_pid: int | None = None

    @property
    def pid(self) -> int:
        assert self.host_pid is not None
        return self.host_pid

    def alive(self) -> bool:
        return self.host_pid is not None and pid_alive(self.host_pid)

    def start(self, side, peer_pub, peer_port):
        if Tunnelgate.unavailable:
            raise SetupFailed(Tunnelgate.unavailable)
        if PodTunnelgate.rt is None:
            raise SetupFailed("no image for the pod setups (see the error above)")
        etc = self.workdir / f"etc-{self.ifname}"
        etc.mkdir(mode=0o700, exist_ok=True)
        (etc / "private.key").write_text(self.key + "\n")
        (etc / "private.key").chmod(0o400)
        (etc / "tunnelgate.toml").write_text(self.config_text(side, peer_pub, peer_port, "/etc/tunnelgate/private.key"))
        self.container = shipped.PodContainer(self.ns, self.ns, PodTunnelgate.image, etc, Tunnelgate.binary if PodTunnelgate.bind_binary else None,
                                              self.pod_cpus, self.env(quiet_log=False), PodTunnelgate.rt)
        self.container.start()
        self.host_pid = shipped.wait_pod_pid(self.container)
        PodTunnelgate.rt.add(self.container.name, self.host_pid)
        if not wait_for(lambda: self.link_up() or not self.alive(), 15) or not self.alive():
            raise SetupFailed(f"pod {self.container.name}: {self.ifname} not up: {self.container.logs()[-600:]}")

    def facts(self) -> dict:
        f = process_facts(self.pid)
        if self.container:
            f["podman"] = self.container.notes
            f["log"] = [l for l in self.container.logs().splitlines() if "priority" in l.lower() or "real" in l.lower()][-5:]
        return f

    def stop(self) -> None:
        if self.container:
            self.container.stop()
        self.host_pid = None


# --------------------------------------------------------------------------------------------------
# Setups
# --------------------------------------------------------------------------------------------------


class Setup:
    def __init__(self, index: int, name: str, workdir: Path):
        self.index, self.name = index, name
        self.ns = {s: f"{NS_PREFIX}{PID}s{index}{s}" for s in "ab"}
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.daemons: dict[str, Daemon] = {}
        self.created_ns: list[str] = []
        self.status = "pending"
        self.reason = ""
        self.runs: list[dict] = []
        self.idle_rss: dict[str, int | None] = {}
        self.peak_rss: dict[str, int | None] = {}
        self.facts: dict[str, dict] = {}
        self.cpus: dict[str, str] = {}
        if name in GATEWAY_SETUPS:
            gw, rest = gateway_cpus()
            self.cpus = {"a": rest, "b": gw}

    @property
    def tunneled(self) -> bool:
        return SETUPS[self.name][0] is not None

    def target(self, v6: bool = False) -> str:
        addrs = TUNNEL["b"] if self.tunneled else UNDERLAY["b"]
        return addrs[1 if v6 else 0]

    def make_daemon(self, kind: str, side: str) -> Daemon:
        ifname = f"{IF_PREFIX}{PID}s{self.index}{side}"
        assert len(ifname) <= 15, ifname
        ns = self.ns[side]
        if kind in ("wireguard-go",) + WGGO_STRONG:
            return WireguardGo(ns, ifname, self.workdir, kind)
        if kind == "boringtun":
            return Boringtun(ns, ifname, self.workdir, None)
        if kind == "boringtun-t1":
            return Boringtun(ns, ifname, self.workdir, 1)
        if kind == "gotatun":
            return Gotatun(ns, ifname, self.workdir, None)
        if kind == "tunnelgate":
            return Tunnelgate(ns, ifname, self.workdir)
        if kind == "tunnelgate-noseccomp":
            return Tunnelgate(ns, ifname, self.workdir, seccomp="off")
        if kind == "tunnelgate-1worker":
            return Tunnelgate(ns, ifname, self.workdir, workers=1)
        if kind == BASELINE_SETUP:
            return Tunnelgate(ns, ifname, self.workdir, baseline=True)
        if kind == "tunnelgate-unit":
            return UnitTunnelgate(ns, ifname, self.workdir)
        if kind.startswith("tunnelgate-pod-cpu"):
            return PodTunnelgate(ns, ifname, self.workdir, int(kind.rsplit("cpu", 1)[1]))
        raise ValueError(kind)

    def start(self) -> None:
        for s in "ab":
            add_ns(self.ns[s])
            self.created_ns.append(self.ns[s])
        va, vb = f"{IF_PREFIX}{PID}s{self.index}va", f"{IF_PREFIX}{PID}s{self.index}vb"
        run(["ip", "link", "add", va, "netns", self.ns["a"], "type", "veth", "peer", "name", vb, "netns", self.ns["b"]])
        for s, dev in (("a", va), ("b", vb)):
            nsx(self.ns[s], "ip", "addr", "add", f"{UNDERLAY[s][0]}/24", "dev", dev)
            nsx(self.ns[s], "ip", "-6", "addr", "add", f"{UNDERLAY[s][1]}/64", "dev", dev, "nodad")
            nsx(self.ns[s], "ip", "link", "set", "dev", dev, "up")
        kinds = SETUPS[self.name]
        if kinds[0] is not None:
            for s, kind in zip("ab", kinds):
                d = self.make_daemon(kind, s)
                d.key, d.pub = genkey()
                d.port = 51820
                if isinstance(d, Tunnelgate):
                    d.extra_env = dict(SETUP_ENV.get(self.name, {}))
                if self.name in GATEWAY_SETUPS:
                    d.cpus = self.cpus[s]
                self.daemons[s] = d
            a, b = self.daemons["a"], self.daemons["b"]
            a.start("a", b.pub, b.port)
            b.start("b", a.pub, a.port)
        # The first packets trigger the handshake; wait until the path works both ways (v4 and v6).
        for v6 in (False, True):
            dst = self.target(v6)
            if not wait_for(lambda: self.ping_once(dst), 15, 0.2):
                raise SetupFailed(f"no ping reply from {dst} within 15 s" + self.daemon_notes())
        self.check_alive()
        for s, d in self.daemons.items():
            self.idle_rss[s] = status_kib(d.pid, "VmRSS")
            self.facts[s] = d.facts() if isinstance(d, Tunnelgate) else process_facts(d.pid)
            self.facts[s]["kind"] = d.kind
            if d.cpus:
                self.facts[s]["taskset"] = d.cpus
            if isinstance(d, Tunnelgate) and d.extra_env:
                self.facts[s]["env"] = d.extra_env
        self.status = "ok"

    def tunnelgate_pids(self) -> dict[str, int]:
        """side -> pid of the tunnelgate daemons (whose readers can be sampled)."""
        return {s: d.pid for s, d in self.daemons.items() if isinstance(d, Tunnelgate) and d.alive()}

    @contextlib.contextmanager
    def measuring(self):
        """Around one measurement: for a gateway setup the benchmark (and every process it starts:
        iperf3, ping) runs on the CPUs other than the gateway's; for a pod setup its containers get
        the real-time runtime (shipped.RtCgroup). Yields notes for the results."""
        notes: dict = {}
        old = os.sched_getaffinity(0)
        try:
            if self.name in GATEWAY_SETUPS:
                os.sched_setaffinity(0, {int(c) for c in self.cpus["a"].split(",")})
                notes["bench_cpus"] = self.cpus["a"]
            if self.name in POD_SETUPS and PodTunnelgate.rt is not None:
                names = [d.container.name for d in self.daemons.values() if isinstance(d, PodTunnelgate) and d.container]
                rts = PodTunnelgate.rt.focus(names)
                notes["rt_runtime_us"] = {c: rts.get(c) for c in names}
            yield notes
        finally:
            os.sched_setaffinity(0, old)

    def ping_once(self, dst: str) -> bool:
        return nsx(self.ns["a"], "ping", "-n", "-q", "-c", "1", "-W", "1", dst, check=False, timeout=5).returncode == 0

    def daemon_notes(self) -> str:
        notes = []
        for s, d in self.daemons.items():
            if not d.alive():
                notes.append(f"{d.kind} ({s}) exited: {tail(d.logfile, 5)}")
        return ("; " + "; ".join(notes)) if notes else ""

    def check_alive(self) -> None:
        for s, d in self.daemons.items():
            if not d.alive():
                raise SetupFailed(f"{d.kind} on side {s} exited ({d.proc.poll() if d.proc else '?'}): {tail(d.logfile)}")

    def cpu(self) -> dict[str, int | None]:
        return {s: cpu_ticks(d.pid) for s, d in self.daemons.items()}

    def record_peak(self) -> None:
        for s, d in self.daemons.items():
            v = status_kib(d.pid, "VmHWM")
            if v is not None:
                self.peak_rss[s] = max(v, self.peak_rss.get(s) or 0)

    def teardown(self) -> None:
        try:
            self.record_peak()
        except Exception:  # noqa: BLE001 - best effort
            pass
        for d in self.daemons.values():
            try:
                d.stop()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"warning: stopping {d.kind}: {e}")
        for ns in self.created_ns:
            kill_ns(ns)
        self.created_ns.clear()


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def udp_counters(ns: str, port: int) -> tuple[int, int]:
    """(RcvbufErrors of the namespace, drops of the UDP sockets bound to `port` in it)."""
    rcvbuf = drops = 0
    p = nsx(ns, "cat", "/proc/net/snmp", "/proc/net/udp", "/proc/net/udp6", check=False)
    hdr = None
    for line in p.stdout.splitlines():
        f = line.split()
        if f[:1] == ["Udp:"]:
            if hdr is None:
                hdr = f
            elif "RcvbufErrors" in hdr:
                rcvbuf = int(f[hdr.index("RcvbufErrors")])
        elif len(f) >= 13 and ":" in f[1] and f[0].endswith(":"):
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                drops += int(f[12])
    return rcvbuf, drops


def tun_dropped(setup: Setup) -> dict[str, int]:
    """Per side, the packets the kernel dropped on the tunnel interface (tx_dropped: its queue to
    the daemon, the TUN ring of txqueuelen packets, was full; plus rx_dropped)."""
    out = {}
    for side, d in setup.daemons.items():
        p = nsx(setup.ns[side], "cat", f"/sys/class/net/{d.ifname}/statistics/tx_dropped", f"/sys/class/net/{d.ifname}/statistics/rx_dropped", check=False)
        nums = [int(x) for x in p.stdout.split() if x.isdigit()]
        out[side] = sum(nums) if p.returncode == 0 else 0
    return out


def iperf(setup: Setup, test: str, duration: int, udp_window: str) -> dict:
    try:
        server = iperf3_server(setup.ns["b"], IPERF_PORT)
    except SetupFailed as e:
        return {"error": str(e)}
    try:
        args = ["iperf3", "-c", setup.target(), "-p", str(IPERF_PORT), "-t", str(duration), "-J"]
        args += ["--connect-timeout", "5000"]
        if test == "tcp4":
            args += ["-P", "4"]
        elif test in ("udp", "udpmax", "pps64", "pps64r"):
            rate = {"udp": "1G", "udpmax": UDP_MAX_RATE[0], "pps64": "0", "pps64r": "0"}[test]
            args += ["-u", "-b", rate]
            if test == "udpmax":
                args += ["-l", "1392"]
            elif test.startswith("pps64"):
                args += ["-l", "64"] + (["-R"] if test == "pps64r" else [])
            if udp_window not in ("", "0"):
                args += ["-w", udp_window]
        before = setup.cpu()
        counters_before = {side: udp_counters(setup.ns[side], 51820) for side in "ab"}
        tun_before = tun_dropped(setup)
        t0 = time.monotonic()
        try:
            p = nsx(setup.ns["a"], *args, check=False, timeout=duration + 30)
        except subprocess.TimeoutExpired:
            return {"error": f"iperf3 client did not finish within {duration + 30} s"}
        wall = time.monotonic() - t0
        after = setup.cpu()
        counters_after = {side: udp_counters(setup.ns[side], 51820) for side in "ab"}
        tun_after = tun_dropped(setup)
        try:
            j = json.loads(p.stdout)
        except json.JSONDecodeError:
            return {"error": f"iperf3 exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()[:300]}"}
        if "error" in j:
            return {"error": f"iperf3: {j['error']}"}
        end = j.get("end", {})
        r: dict = {"wall_s": round(wall, 3)}
        if test != "tcp1" and test != "tcp4":
            s = end.get("sum", {})
            recv = end.get("sum_received", s)
            r.update(
                bps=recv.get("bits_per_second", s.get("bits_per_second")),
                bytes=s.get("bytes"),
                lost_percent=s.get("lost_percent"),
                lost_packets=s.get("lost_packets"),
                packets=s.get("packets"),
                jitter_ms=s.get("jitter_ms"),
                blksize=j.get("start", {}).get("test_start", {}).get("blksize"),
            )
            # Datagrams delivered per second (the receiver's count: sent minus lost).
            if s.get("packets") is not None and s.get("lost_packets") is not None and s.get("seconds"):
                r["pps"] = round((s["packets"] - s["lost_packets"]) / s["seconds"])
        else:
            recv, sent = end.get("sum_received", {}), end.get("sum_sent", {})
            r.update(bps=recv.get("bits_per_second"), bytes=recv.get("bytes"), retransmits=sent.get("retransmits"))
        cpu = {}
        for s in before:
            if before[s] is not None and after[s] is not None:
                cpu[s] = (after[s] - before[s]) / CLK_TCK
        r["cpu_s"] = cpu
        # Where UDP datagrams were dropped for a full socket buffer: the daemons' sockets (port
        # 51820) and, on side b, everything else (the iperf3 server's socket).
        d_rcv = {k: counters_after[k][0] - counters_before[k][0] for k in "ab"}
        d_sock = {k: counters_after[k][1] - counters_before[k][1] for k in "ab"}
        r["udp_rcvbuf_drops"] = {
            "daemon_a": d_sock["a"] if setup.tunneled else None,
            "daemon_b": d_sock["b"] if setup.tunneled else None,
            "other_b": d_rcv["b"] - (d_sock["b"] if setup.tunneled else 0),
        }
        r["tun_dropped"] = {k: tun_after[k] - tun_before.get(k, 0) for k in tun_after}
        if cpu and r.get("bytes"):
            r["cpu_s_per_gb"] = round(sum(cpu.values()) / (r["bytes"] / 1e9), 3)
        return r
    finally:
        stop_process(server)


def ping_rtt(setup: Setup) -> dict:
    p = nsx(setup.ns["a"], "ping", "-n", "-q", "-c", "20", "-i", "0.05", "-W", "1", setup.target(), check=False, timeout=30)
    m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", p.stdout)
    loss = re.search(r"([\d.]+)% packet loss", p.stdout)
    if not m:
        return {"error": f"ping failed: {p.stdout.strip()[-200:]} {p.stderr.strip()}"}
    return {
        "rtt_min_ms": float(m.group(1)),
        "rtt_avg_ms": float(m.group(2)),
        "rtt_max_ms": float(m.group(3)),
        "loss_percent": float(loss.group(1)) if loss else None,
    }


def uso_run(setup: Setup, duration: int, off: bool) -> dict:
    """Delivered Gbit/s of a UDP_SEGMENT sender through the tunnel, USO on or off on side a's
    tunnel interface (for plain veth: the veth's)."""
    dev = setup.daemons["a"].ifname if setup.tunneled else f"{IF_PREFIX}{PID}s{setup.index}va"
    r: dict = {}
    if off:
        p = nsx(setup.ns["a"], "ethtool", "-K", dev, "tx-udp-segmentation", "off", check=False)
        if p.returncode != 0:
            return {"error": f"ethtool -K {dev} tx-udp-segmentation off: {(p.stderr or p.stdout).strip()[:200]}"}
    r["uso_feature"] = nsx(setup.ns["a"], "ethtool", "-k", dev, check=False).stdout.count("tx-udp-segmentation: on") > 0
    server = subprocess.Popen(["ip", "netns", "exec", setup.ns["b"], sys.executable, str(UDPGSO), "server", str(USO_PORT), str(duration)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        if not server.stdout or server.stdout.readline().strip() != "listening":
            return {"error": f"udpgso server did not start: {server.stderr.read()[-200:] if server.stderr else ''}"}
        before = setup.cpu()
        client = nsx(setup.ns["a"], sys.executable, str(UDPGSO), "client", setup.target(), str(USO_PORT), str(duration), check=False, timeout=duration + 30)
        after = setup.cpu()
        out, _ = server.communicate(timeout=duration + 30)
        got, sent = json.loads(out.strip().splitlines()[-1]), json.loads(client.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError, subprocess.TimeoutExpired) as e:
        return {"error": f"udpgso: {e}"}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if off:
            nsx(setup.ns["a"], "ethtool", "-K", dev, "tx-udp-segmentation", "on", check=False)
    r.update(bps=got["bytes"] * 8 / got["seconds"] if got["seconds"] else None, bytes=got["bytes"],
             offered_bps=sent["bytes"] * 8 / sent["seconds"] if sent["seconds"] else None,
             lost_percent=round(100 * (1 - got["bytes"] / sent["bytes"]), 2) if sent["bytes"] else None)
    cpu = {k: (after[k] - before[k]) / CLK_TCK for k in before if before[k] is not None and after[k] is not None}
    r["cpu_s"] = cpu
    if cpu and got["bytes"]:
        r["cpu_s_per_gb"] = round(sum(cpu.values()) / (got["bytes"] / 1e9), 3)
    return r


def measure(setup: Setup, test: str, duration: int, udp_window: str) -> dict:
    try:
        if test.startswith("uso"):
            r = uso_run(setup, duration, off=test == "uso-off")
            setup.record_peak()
            return r
        r = ping_rtt(setup) if test == "ping" else iperf(setup, test, duration, udp_window)
    except (subprocess.SubprocessError, OSError, SetupFailed) as e:
        r = {"error": f"{test}: {e}"}
    setup.record_peak()
    return r


# --------------------------------------------------------------------------------------------------
# Preparation: binaries
# --------------------------------------------------------------------------------------------------


def prepare_tunnelgate(args) -> None:
    if args.tunnelgate:
        Tunnelgate.binary = args.tunnelgate
    else:
        Tunnelgate.binary = str(REPO / "target" / "release" / "tunnelgate")
        if not args.no_build:
            try:
                build_release_tunnelgate(Path(args.workdir) / "cargo-build.log")
            except SetupFailed as e:
                Tunnelgate.unavailable = str(e)
                log(Tunnelgate.unavailable)
                return
    if not os.access(Tunnelgate.binary, os.X_OK):
        Tunnelgate.unavailable = f"no tunnelgate binary at {Tunnelgate.binary}"


def add_shipped_args(ap: argparse.ArgumentParser) -> None:
    """Options of the unit, pod and gateway setups and of --daemon-env (shared with benches/latency)."""
    g = ap.add_argument_group("setups as users run tunnelgate (unit, pod-cpu2, pod-cpu1, gateway)")
    g.add_argument("--nspawn-rootfs", type=Path, default=shipped.nspawn_rootfs_default(),
                   help="the Debian rootfs with systemd that the unit setup boots (default: the booted-systemd tests' cache, "
                        "$TUNNELGATE_TEST_ROOTFS else %(default)s; debootstrapped when missing)")
    g.add_argument("--unit-file", type=Path, default=shipped.UNIT_FILE,
                   help="the systemd unit the unit setup runs (default: the repository's, %(default)s)")
    g.add_argument("--image", default=PodTunnelgate.image,
                   help="the podman image of the pod setups (default %(default)s; built with scripts/image.sh when missing, "
                        "its debootstrap base in $TUNNELGATE_IMAGE_ROOTFS else /var/tmp/tg-bench-rootfs)")
    g.add_argument("--rebuild-image", action="store_true", help="run scripts/image.sh for --image even if it exists")
    g.add_argument("--manifest", type=Path, default=shipped.MANIFEST,
                   help="the StatefulSet whose proxy container the pod setups reproduce (default: the repository's, %(default)s)")
    g.add_argument("--pod-binary", choices=("host", "image"), default="host",
                   help="host: bind the benchmarked tunnelgate over the image's (default: the same build as every other setup); image: the image's own")
    g.add_argument("--pod-rt", default="split", metavar="split|focus|none|US",
                   help="real-time runtime of the pod containers' cpu cgroups (this kernel has RT group scheduling, cgroup v1): "
                        "split (default: every container its equal part of what the root group has left, from its start; "
                        "the daemon reads its cgroup's runtime once), focus (the measured setup's containers share it, the others keep 1 %%: "
                        "a runtime that changes under the daemons), "
                        "none (0: SCHED_FIFO refused, what a node with this kernel gives a pod), or US per container per period")
    g.add_argument("--pod-rt-period", type=int, default=10000, metavar="US",
                   help="cpu.rt_period_us of the pod containers (default %(default)s: a container past its runtime is throttled, not stepped down, until the period ends; a short period keeps those stalls short)")
    g.add_argument("--daemon-env", action="append", default=[], metavar="SETUP:K=V[,K=V]",
                   help="extra environment of one setup's tunnelgate daemons (repeatable), e.g. gateway:TUNNELGATE_RT_PRIORITY=0")


def use_daemon_env(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for item in args.daemon_env:
        setup, _, kvs = item.partition(":")
        if setup not in SETUPS or not kvs:
            ap.error(f"--daemon-env {item}: want SETUP:K=V[,K=V] with a known setup")
        env = dict(kv.split("=", 1) for kv in kvs.split(",") if "=" in kv)
        SETUP_ENV.setdefault(setup, {}).update(env)
    if args.pod_rt not in ("split", "focus", "none") and not args.pod_rt.isdigit():
        ap.error(f"--pod-rt {args.pod_rt}: split, focus, none or a number of microseconds")


def prepare_shipped(args, names: list[str], workdir: Path) -> None:
    """The unit setup's rootfs and the pod setups' image and cgroup parent; what cannot be had
    fails those setups (with the reason), not the run."""
    if "unit" in names:
        shipped.UNIT_FILE = args.unit_file.resolve()
        try:
            UnitTunnelgate.rootfs = shipped.ensure_nspawn_rootfs(args.nspawn_rootfs)
        except (SetupFailed, subprocess.SubprocessError, OSError) as e:
            log(f"unit setup: {e}")
    if any(n in POD_SETUPS for n in names):
        try:
            if not shutil.which("podman"):
                raise SetupFailed("podman missing (apt-get install --no-install-recommends podman runc)")
            if args.rebuild_image or not shipped.image_exists(args.image):
                shipped.build_image(args.image, workdir / "image-build.log")
            PodTunnelgate.image = args.image
            shipped.MANIFEST = args.manifest.resolve()
            PodTunnelgate.bind_binary = args.pod_binary == "host"
            rt = shipped.RtCgroup(args.pod_rt, args.pod_rt_period)
            # One container per pod setup (side b).
            rt.containers = sum(1 for n in names if n in POD_SETUPS)
            PodTunnelgate.rt = rt  # before prepare(): the run's cleanup removes what it made
            rt.prepare()
        except (SetupFailed, subprocess.SubprocessError, OSError) as e:
            log(f"pod setups: {e}")
            if PodTunnelgate.rt is not None:
                PodTunnelgate.rt.cleanup()
                PodTunnelgate.rt = None


def shipped_meta(args, names: list[str]) -> dict:
    """What the shipped setups were run with, for the results."""
    m: dict = {}
    if "unit" in names:
        m["unit"] = {"file": str(shipped.UNIT_FILE.relative_to(REPO)) if shipped.UNIT_FILE.is_relative_to(REPO) else str(shipped.UNIT_FILE), "rootfs": str(args.nspawn_rootfs), "how": shipped.unit_reproduction_note()}
    if any(n in POD_SETUPS for n in names):
        rt = PodTunnelgate.rt
        m["pod"] = {"manifest": str(shipped.MANIFEST.relative_to(REPO)) if shipped.MANIFEST.is_relative_to(REPO) else str(shipped.MANIFEST), "image": args.image, "binary": args.pod_binary,
                    "rt_mode": rt.mode if rt else None, "rt_period_us": args.pod_rt_period,
                    "rt_parent": str(rt.dir) if rt else None, "rt_parent_ratio": round(rt.ratio, 4) if rt else None,
                    "not_reproduced": "the kubelet (probes, the pod's cpu.shares from its request), the sidecar and the init container "
                                      "(forwarding is not needed by this benchmark)"}
    if any(n in GATEWAY_SETUPS for n in names):
        gw, rest = gateway_cpus()
        m["gateway"] = {"side_b_cpus": gw, "side_a_and_bench_cpus": rest}
    if SETUP_ENV:
        m["daemon_env"] = SETUP_ENV
    return m


def prepare_cargo_tool(cls: type[Boringtun], override: str | None) -> None:
    """Finds `cls.command`: the path given, else PATH, else the cache; when it is nowhere,
    `cargo install cls.crate --locked` into the cache. A failed install leaves `cls.binary` empty
    and its setups fail with the reason; the others still run."""
    cached = CACHE / "bin" / cls.command
    found = override or shutil.which(cls.command) or (str(cached) if cached.exists() else "")
    if not found:
        log(f"==> cargo install {cls.crate} --locked --root {CACHE}")
        p = subprocess.run(["cargo", "install", cls.crate, "--locked", "--root", str(CACHE)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            log(f"{cls.crate} install failed: {p.stderr.strip()[-500:]}")
            return
        found = str(cached)
    cls.binary = found


def version_of(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        return (p.stdout or p.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def values(setup: dict, test: str, key: str) -> list[float]:
    return [r[key] for r in setup["runs"] if r["test"] == test and isinstance(r.get(key), (int, float))]


def report(results: dict) -> str:
    m = results.get("meta", {})
    rows = [("setup", "TCP 1 Gbit/s", "TCP 4 Gbit/s", "UDP 1G loss %", "UDP Gbit/s", f"UDP {m.get('udpmax_offered', '?')} 1392B Gbit/s", "loss %",
             "64B kpps a>b", "64B kpps b>a", "UDP_SEGMENT sender Gbit/s USO on/off", "RTT ms", "CPU s/GB tcp1 (a+b)", "peak RSS MB a/b")]
    for name, s in results["setups"].items():
        if s["status"] != "ok":
            rows.append((name, f"FAILED: {s['reason'][:200]}") + ("",) * (len(rows[0]) - 2))
            continue
        rss = s.get("peak_rss_kib", {})
        rss_s = "/".join(f"{rss[k] / 1024:.1f}" if rss.get(k) else "-" for k in sorted(rss)) or "-"
        rows.append(
            (
                name,
                med_spread(values(s, "tcp1", "bps"), 1e9),
                med_spread(values(s, "tcp4", "bps"), 1e9),
                med_spread(values(s, "udp", "lost_percent"), 1, "{:.2f}"),
                med_spread(values(s, "udp", "bps"), 1e9),
                med_spread(values(s, "udpmax", "bps"), 1e9),
                med_spread(values(s, "udpmax", "lost_percent"), 1, "{:.2f}"),
                med_spread(values(s, "pps64", "pps"), 1e3, "{:.0f}"),
                med_spread(values(s, "pps64r", "pps"), 1e3, "{:.0f}"),
                med_spread(values(s, "uso", "bps"), 1e9) + " / " + med_spread(values(s, "uso-off", "bps"), 1e9),
                med_spread(values(s, "ping", "rtt_avg_ms"), 1, "{:.3f}"),
                med_spread(values(s, "tcp1", "cpu_s_per_gb"), 1, "{:.2f}") if s["daemons"] else "-",
                rss_s if s["daemons"] else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows if not r[1].startswith("FAILED") or i == 0) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        if r[1].startswith("FAILED"):
            out.append(f"{r[0]:<{widths[0]}}  {r[1]}")
        else:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if r is rows[0]:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    tg = results["setups"].get("tunnelgate", {})
    tg1 = values(tg, "tcp1", "bps") if tg.get("status") == "ok" else []
    if tg1:
        out.append("TCP single-stream, median ratio tunnelgate / other:")
        width = max(len(name) for name in results["setups"])
        for name, s in results["setups"].items():
            other = values(s, "tcp1", "bps") if s["status"] == "ok" else []
            if name != "tunnelgate" and other:
                out.append(f"  tunnelgate / {name:<{width}} {statistics.median(tg1) / statistics.median(other):6.2f}x")
        strong = {n: statistics.median(v) for n in WGGO_STRONG
                  if results["setups"].get(n, {}).get("status") == "ok" and (v := values(results["setups"][n], "tcp1", "bps"))}
        if strong:
            best = max(strong, key=strong.get)
            out.append(f"Headline: tunnelgate / the faster wireguard-go with offloads ({best}) = {statistics.median(tg1) / strong[best]:.2f}x single stream")
            cpu = {n: values(results["setups"][n], "tcp1", "cpu_s_per_gb") for n in [best, "tunnelgate"]}
            if all(cpu.values()):
                out.append(f"  CPU s/GB (both daemons): tunnelgate {statistics.median(cpu['tunnelgate']):.2f}, {best} {statistics.median(cpu[best]):.2f}")
        else:
            out.append("Headline: no wireguard-go build with offloads ran (../shared/bin missing?): no headline ratio.")
    else:
        out.append("TCP single-stream ratios: no tunnelgate figures (the tunnelgate setup did not run).")
    return "\n".join(out)


def svg_chart(results: dict) -> str:
    """The table's throughput columns as an SVG bar chart (median TCP 1 and 4 streams, UDP),
    one group of bars per setup; pure Python, no dependencies."""
    series = [("tcp1", "TCP, 1 stream", "#1f77b4"), ("tcp4", "TCP, 4 streams", "#ff7f0e"), ("udp", "UDP, 1 Gbit/s offered", "#2ca02c")]
    rows = []
    for name, s in results["setups"].items():
        if s.get("status") != "ok":
            continue
        meds = [statistics.median(v) / 1e9 if (v := values(s, test, "bps")) else None for test, _, _ in series]
        rows.append((name, meds))
    top = max([m for _, meds in rows for m in meds if m] + [1.0])
    label_w, bar_h, gap, chart_w, head = 150, 14, 12, 520, 56
    height = head + len(rows) * (len(series) * bar_h + gap) + 30
    width = label_w + chart_w + 90
    esc = lambda t: str(t).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    m = results.get("meta", {})
    title = f"iperf3 through each setup: median Gbit/s ({m.get('rounds', '?')} rounds x {m.get('duration_s', '?')} s, {m.get('cpus', '?')} CPUs, commit {m.get('commit', '?')})"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{esc(title)}</text>',
    ]
    for i, (_, label, color) in enumerate(series):
        x = label_w + i * 170
        out.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{color}"/><text x="{x + 16}" y="43">{esc(label)}</text>')
    y = head
    for name, meds in rows:
        out.append(f'<text x="{label_w - 8}" y="{y + len(series) * bar_h / 2 + 4:.0f}" text-anchor="end">{esc(name)}</text>')
        for (test, _, color), med in zip(series, meds):
            if med is not None:
                w = chart_w * med / top
                out.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{color}"><title>{esc(name)} {test}: {med:.2f} Gbit/s</title></rect>')
                out.append(f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 4}" font-size="10">{med:.2f}</text>')
            y += bar_h
        y += gap
    out.append(f'<line x1="{label_w}" y1="{head - 4}" x2="{label_w}" y2="{y}" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def use_baseline(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--baseline BIN (shared with benches/latency): adds the setup tunnelgate-baseline, both
    ends that binary, with --baseline-env in its daemons' environment."""
    if not args.baseline:
        return
    if not os.access(args.baseline, os.X_OK):
        ap.error(f"--baseline {args.baseline}: not an executable")
    Tunnelgate.baseline = os.path.abspath(args.baseline)
    Tunnelgate.baseline_env = dict(kv.split("=", 1) for kv in args.baseline_env.split(",") if "=" in kv)
    SETUPS[BASELINE_SETUP] = (BASELINE_SETUP, BASELINE_SETUP)
    if BASELINE_SETUP not in args.setups:
        args.setups += f",{BASELINE_SETUP}"


def checked_setups(ap: argparse.ArgumentParser, args: argparse.Namespace, bench: str) -> list[str]:
    """The setups --setups names (shared with benches/latency), once each is known, we are
    root and the tools they need are installed (benches/BENCH/run.sh installs them)."""
    names = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        ap.error(f"unknown setup(s) {unknown}; known: {', '.join(SETUPS)}")
    if os.geteuid() != 0:
        ap.error(f"needs root (network namespaces): run benches/{bench}/run.sh as root")
    wggo = ("wireguard-go",) if any("wireguard-go" in SETUPS[n] for n in names) else ()
    missing = [t for t in ("iperf3", "wg", "ip", "ping", "ss") + wggo if not shutil.which(t)]
    if missing:
        ap.error(f"missing tools: {', '.join(missing)} (benches/{bench}/run.sh installs them)")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across setups (default 3)")
    ap.add_argument("--duration", type=int, default=10, help="seconds per iperf3 run (default 10)")
    ap.add_argument("--quick", action="store_true", help="1 round of 5 s runs")
    ap.add_argument(
        "--udp-window",
        default="4M",
        help="iperf3 -w for the UDP test (default %(default)s; 0 = iperf3's default, whose ~208 KB "
        "receive buffer drops datagrams in the iperf3 server itself, even on plain veth)",
    )
    ap.add_argument("--udp-max-rate", default="2.2G", help="iperf3 -b of the udpmax test (1392-byte datagrams; default %(default)s, about what plain veth carries here)")
    ap.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated subset of: {', '.join(ALL_TESTS)} (default %(default)s)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of: {', '.join(SETUPS)}")
    add_output_args(ap, "iperf")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    ap.add_argument("--baseline", metavar="BIN", help=f"an earlier tunnelgate binary: adds setup {BASELINE_SETUP} (tunnelgate <-> tunnelgate with it)")
    ap.add_argument("--baseline-env", default="", metavar="K=V,...", help=f"environment of the {BASELINE_SETUP} daemons only (e.g. the same binary with TUNNELGATE_SOCKET_BUFFER=... to compare queue sizes)")
    ap.add_argument("--tunnelgate", help="tunnelgate binary (default target/release/tunnelgate, built first)")
    ap.add_argument("--boringtun", help="boringtun-cli binary (default: PATH, else cargo install into the cache)")
    ap.add_argument("--gotatun", help="gotatun binary (default: PATH, else cargo install gotatun-cli into the cache)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs and configs")
    ap.add_argument("--svg-from", metavar="JSON", help="only write the SVG chart of an earlier run's JSON (next to it) and exit")
    add_shipped_args(ap)
    args = ap.parse_args()
    if args.svg_from:
        src = Path(args.svg_from)
        svg = src.with_suffix(".svg")
        svg.write_text(svg_chart(json.loads(src.read_text())))
        print(f"chart: {svg}")
        return 0
    if args.quick:
        args.rounds, args.duration = 1, 5
    use_baseline(ap, args)
    use_daemon_env(ap, args)
    UDP_MAX_RATE[0] = args.udp_max_rate
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    if any(t not in ALL_TESTS for t in tests):
        ap.error(f"unknown test(s) in {args.tests}; known: {', '.join(ALL_TESTS)}")
    names = checked_setups(ap, args, "iperf")
    try:
        out = results_path(args, "iperf")
    except SetupFailed as e:
        ap.error(str(e))

    raise_on_signals()
    args.workdir = tempfile.mkdtemp(prefix="tunnelgate-bench-")
    workdir = Path(args.workdir)
    setups = [Setup(i, n, workdir) for i, n in enumerate(names)]
    results: dict = {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "rounds": args.rounds,
            "duration_s": args.duration,
            "loadavg_start": open("/proc/loadavg").read().split()[:3],
            "mtu": MTU,
            "udp_offered": "1G",
            "udpmax_offered": args.udp_max_rate,
            "tests": tests,
            "wireguard_go_builds": str(shared_bin_dir() or ""),
            "udp_window": args.udp_window,
        },
        "setups": {},
    }
    interrupted = False
    load1 = float(results["meta"]["loadavg_start"][0])
    if load1 > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load1} before the benchmark: other work will skew the figures")
    try:
        sweep_stale_runs()
        if needs_tunnelgate(names):
            prepare_tunnelgate(args)
            prepare_shipped(args, names, workdir)
        for cls, override in ((Boringtun, args.boringtun), (Gotatun, args.gotatun)):
            if any(k and k.startswith(cls.kind) for n in names for k in SETUPS[n]):
                prepare_cargo_tool(cls, override)
        results["meta"]["versions"] = {
            "iperf3": version_of(["iperf3", "--version"]),
            "wireguard-go": version_of(["wireguard-go", "--version"]),
            **{k: version_of([str(d / k), "--version"]) for d in [shared_bin_dir()] if d for k in WGGO_STRONG if (d / k).exists()},
            "boringtun-cli": version_of([Boringtun.binary, "--version"]) if Boringtun.binary else None,
            "gotatun": version_of([Gotatun.binary, "--version"]) if Gotatun.binary else None,
            "tunnelgate": Tunnelgate.binary or None,
            BASELINE_SETUP: Tunnelgate.baseline or None,
            BASELINE_SETUP + "-env": Tunnelgate.baseline_env or None,
        }
        results["meta"]["shipped"] = shipped_meta(args, names)
        for s in setups:
            log(f"==> starting {s.name}")
            try:
                s.start()
            except (SetupFailed, subprocess.SubprocessError, OSError) as e:
                s.status, s.reason = "failed", str(e)
                log(f"    {s.name} FAILED: {e}")
                s.teardown()
        live = [s for s in setups if s.status == "ok"]
        total = args.rounds * len(live)
        n = 0
        for rnd in range(args.rounds):
            order = live[rnd % len(live):] + live[: rnd % len(live)] if live else []
            for s in order:
                if s.status != "ok":
                    continue
                n += 1
                log(f"==> round {rnd + 1}/{args.rounds}, {s.name} ({n}/{total})")
                for test in tests:
                    with s.measuring() as notes:
                        r = measure(s, test, args.duration, args.udp_window)
                    r.update(notes)
                    r.update(round=rnd + 1, test=test)
                    s.runs.append(r)
                    summary = r.get("error") or ", ".join(
                        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in r.items()
                        if k in ("bps", "lost_percent", "rtt_avg_ms", "cpu_s_per_gb", "retransmits", "pps")
                    )
                    drops = r.get("udp_rcvbuf_drops") or {}
                    if any(drops.values()):
                        summary += ", rcvbuf drops " + " ".join(f"{k}={v}" for k, v in drops.items() if v)
                    if any((r.get("tun_dropped") or {}).values()):
                        summary += ", tun drops " + " ".join(f"{k}={v}" for k, v in r["tun_dropped"].items() if v)
                    log(f"    {test:5} {summary}")
                    try:
                        s.check_alive()
                    except SetupFailed as e:
                        s.status, s.reason = "failed", f"during round {rnd + 1} {test}: {e}"
                        log(f"    {s.name} FAILED: {s.reason}")
                        break
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
        sweep_stale_runs()
        if PodTunnelgate.rt is not None:
            PodTunnelgate.rt.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")

    results["meta"]["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["meta"]["interrupted"] = interrupted
    results["meta"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    for s in setups:
        results["setups"][s.name] = {
            "status": "ok" if s.status == "ok" else "failed",
            "reason": s.reason,
            "daemons": {side: d.kind for side, d in s.daemons.items()},
            "idle_rss_kib": s.idle_rss,
            "peak_rss_kib": s.peak_rss,
            "daemon_facts": s.facts,
            "runs": s.runs,
        }
    if interrupted:  # never replace complete figures with a partial run
        out = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".svg").write_text(svg_chart(results))
    m = results["meta"]
    print(f"\niperf3 benchmark: {m['rounds']} round(s) x {m['duration_s']} s, commit {m['commit']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, MTU {MTU}")
    print("medians (min–max); CPU = daemon user+sys seconds per GB received, both sides; a = client side\n")
    print(report(results))
    print(f"\nraw results: {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
