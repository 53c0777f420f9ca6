"""tunnelgate run the ways it ships, for the benchmarks: under the systemd unit (systemd/tunnelgate.service,
booted by systemd in a systemd-nspawn container) and as the Kubernetes proxy container
(containers/k8s/statefulset.yaml's securityContext, run by podman). Both read the repository's
files when a run starts, so a benchmark follows the unit and the manifest as they change.

Each joins a network namespace the benchmark made; the daemon's host pid is found so the caller
can read its threads from /proc.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from benchproc import PID, REPO, CommandFailed, log, pid_alive, run, tail, wait_for

UNIT_FILE = REPO / "systemd" / "tunnelgate.service"
MANIFEST = REPO / "containers" / "k8s" / "statefulset.yaml"
# podman as PITFALLS says it works here: runc (crun refuses these hybrid cgroups), cgroupfs, and
# explicit ulimits (the defaults cannot be set here).
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
PODMAN_ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]
NAME_PREFIX = "tgbench"  # containers tgbench<pid>..., cgroup parents /tgbench<pid>


# --------------------------------------------------------------------------------------------------
# The systemd unit, booted in systemd-nspawn
# --------------------------------------------------------------------------------------------------


def nspawn_rootfs_default() -> Path:
    """The booted-systemd tests' rootfs cache (tests/systemd_unit/container.rs), shared with them."""
    return Path(os.environ.get("TUNNELGATE_TEST_ROOTFS", "/var/tmp/tunnelgate-test-rootfs"))


def ensure_nspawn_rootfs(root: Path) -> Path:
    """The Debian rootfs with systemd that nspawn boots; built with debootstrap (a few minutes,
    once) when missing, into a directory of its own then renamed, so a test building the same
    cache at the same time is not disturbed."""
    if (root / "usr/lib/systemd/systemd").exists():
        return root
    for tool in ("systemd-nspawn", "debootstrap"):
        if not shutil.which(tool):
            raise CommandFailed(f"{tool} missing (apt-get install --no-install-recommends systemd-container debootstrap)")
    partial = root.with_name(f"{root.name}.bench{PID}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"==> debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus bookworm {root} (once, a few minutes)")
    run(["debootstrap", "--variant=minbase", "--include=systemd,systemd-sysv,dbus", "bookworm", str(partial),
         "http://deb.debian.org/debian"], timeout=1800)
    try:
        partial.rename(root)
    except OSError:  # someone else finished first
        shutil.rmtree(partial, ignore_errors=True)
    if not (root / "usr/lib/systemd/systemd").exists():
        raise CommandFailed(f"{root}: no systemd after debootstrap")
    return root


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class NspawnUnit:
    """A Debian rootfs booted by systemd-nspawn in network namespace `ns` (the flags of
    tests/systemd_unit: PITFALLS), with the repository's unit as tunnelgate.service, `binary` as
    /usr/local/bin/tunnelgate and `etc` as /etc/tunnelgate; the unit is wanted at boot. `env` goes
    into a drop-in's Environment= (nothing else is changed in the unit)."""

    def __init__(self, ns: str, rootfs: Path, binary: str, etc: Path, workdir: Path, env: dict[str, str]):
        self.ns, self.rootfs, self.binary, self.etc, self.workdir, self.env = ns, rootfs, binary, etc, workdir, env
        self.proc: subprocess.Popen | None = None
        self.logfile = workdir / f"nspawn-{ns}.log"

    def boot(self) -> None:
        args = [
            "systemd-nspawn", "-b", "--register=no", "--keep-unit", "--volatile=overlay", "--console=passive",
            "--capability=CAP_NET_ADMIN", f"--network-namespace-path=/run/netns/{self.ns}", "--bind=/dev/net/tun",
            f"--bind-ro={self.binary}:/usr/local/bin/tunnelgate",
            f"--bind-ro={UNIT_FILE}:/etc/systemd/system/tunnelgate.service",
            f"--bind={self.etc}:/etc/tunnelgate",
        ]
        if self.env:
            dropin = self.workdir / f"dropin-{self.ns}"
            dropin.mkdir(exist_ok=True)
            lines = "".join(f'Environment="{k}={v}"\n' for k, v in self.env.items())
            (dropin / "bench-env.conf").write_text(f"# written by the benchmark: environment only\n[Service]\n{lines}")
            args.append(f"--bind-ro={dropin}:/etc/systemd/system/tunnelgate.service.d")
        args += ["-D", str(self.rootfs), "systemd.wants=tunnelgate.service"]
        with open(self.logfile, "w") as out:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def init_pid(self) -> int | None:
        if self.proc is None:
            return None
        return next((p for p in descendants(self.proc.pid) if comm(p) == "systemd"), None)

    def daemon_pid(self) -> int | None:
        """The host pid of tunnelgate.service's main process."""
        init = self.init_pid()
        if init is None:
            return None
        return next((p for p in descendants(init) if comm(p) == "tunnelgate"), None)

    def inside(self, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
        init = self.init_pid()
        if init is None:
            raise CommandFailed("the container's systemd is not running")
        return run(["nsenter", "-t", str(init), "-a", "--", *args], check=False, timeout=timeout)

    def wait_active(self, timeout: float = 90) -> int:
        """Waits for tunnelgate.service to be active; returns the daemon's host pid."""
        def active() -> bool:
            if self.proc is None or self.proc.poll() is not None or self.init_pid() is None:
                return False
            return self.inside("systemctl", "is-active", "tunnelgate.service").stdout.strip() in ("active", "failed")
        ok = wait_for(lambda: active() or (self.proc is not None and self.proc.poll() is not None), timeout, 0.5)
        state = self.inside("systemctl", "is-active", "tunnelgate.service").stdout.strip() if self.init_pid() else "no container"
        pid = self.daemon_pid()
        if not ok or state != "active" or pid is None:
            raise CommandFailed(f"tunnelgate.service in the container: {state or 'not started'} within {timeout:g} s; "
                                f"journal: {self.journal()[-800:]}; nspawn: {tail(self.logfile, 5)}")
        return pid

    def journal(self) -> str:
        try:
            return self.inside("journalctl", "-u", "tunnelgate", "--no-pager", "-o", "cat").stdout
        except CommandFailed as e:
            return str(e)

    def properties(self) -> dict[str, str]:
        """What systemd made of the unit: the properties that decide the readers' priority."""
        names = ["RestrictRealtime", "LimitRTPRIO", "LimitRTPRIOSoft", "CapabilityBoundingSet", "AmbientCapabilities",
                 "NoNewPrivileges", "SystemCallFilter", "CPUSchedulingPolicy", "Environment"]
        p = self.inside("systemctl", "show", "tunnelgate.service", *[f"-p{n}" for n in names])
        out = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
        if len(out.get("SystemCallFilter", "")) > 200:
            out["SystemCallFilter"] = out["SystemCallFilter"][:200] + "..."
        out["systemd"] = self.inside("systemctl", "--version").stdout.split("\n", 1)[0]
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.inside("systemctl", "poweroff", "--no-block", timeout=10)
        except (CommandFailed, subprocess.SubprocessError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def unit_reproduction_note() -> str:
    return ("systemd-nspawn boots Debian's systemd, which starts the repository's systemd/tunnelgate.service as "
            "written (bounding set, ambient capabilities, no-new-privs, rlimits, RestrictRealtime's seccomp filter, "
            "every other sandbox setting). Not as on a host: the container's own bounding set (nspawn's default plus "
            "CAP_NET_ADMIN; this machine's root has no CAP_SYS_RESOURCE, so systemd cannot raise a LimitRTPRIO= hard "
            "limit above the host's 0), and on this cgroup-v1 host the service gets no cpu cgroup of its own (it "
            "stays in the host's root cpu group, with the host's real-time runtime).")


# --------------------------------------------------------------------------------------------------
# The Kubernetes proxy container, run by podman
# --------------------------------------------------------------------------------------------------


def proxy_container(manifest: Path | None = None, name: str = "proxy") -> tuple[dict, list[dict]]:
    """The StatefulSet's container `name` (the daemon's) and the pod's volumes, from the manifest
    (`MANIFEST`, which --manifest may point elsewhere)."""
    import yaml  # PyYAML: benches/latency/run.sh installs it when missing

    manifest = manifest or MANIFEST
    for doc in yaml.safe_load_all(manifest.read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "StatefulSet":
            spec = doc["spec"]["template"]["spec"]
            for c in spec.get("containers", []):
                if c.get("name") == name:
                    return c, spec.get("volumes", [])
    raise CommandFailed(f"{manifest}: no StatefulSet container named {name!r}")


def memory_limit(v: str) -> str:
    """A Kubernetes quantity (256Mi, 1Gi, 500M) as podman's --memory (bytes)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|K|M|G)?", str(v))
    if not m:
        raise CommandFailed(f"memory limit {v!r}: not a quantity this benchmark knows")
    mult = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "K": 1000, "M": 1000**2, "G": 1000**3}[m.group(2)]
    return str(int(m.group(1)) * mult)


def podman_security_args(container: dict) -> tuple[list[str], list[str]]:
    """podman flags for the container's securityContext, and what was applied, in words. A key
    this function does not know stops the benchmark: the manifest grew something it would not reproduce."""
    sc = dict(container.get("securityContext") or {})
    args, said = [], []
    if "runAsUser" in sc:
        u = sc.pop("runAsUser")
        args += ["--user", str(u) + (f":{sc.pop('runAsGroup')}" if "runAsGroup" in sc else "")]
        said.append(f"runAsUser {u}")
    if sc.pop("runAsNonRoot", False):
        said.append("runAsNonRoot (checked by the kubelet only)")
    if sc.pop("allowPrivilegeEscalation", True) is False:
        args += ["--security-opt", "no-new-privileges"]
        said.append("allowPrivilegeEscalation false: --security-opt no-new-privileges")
    if sc.pop("readOnlyRootFilesystem", False):
        # No tmpfs podman would add on its own: only the manifest's volumes are writable.
        args += ["--read-only", "--read-only-tmpfs=false"]
        said.append("readOnlyRootFilesystem: --read-only --read-only-tmpfs=false")
    if sc.pop("privileged", False):
        args.append("--privileged")
        said.append("privileged")
    caps = sc.pop("capabilities", {}) or {}
    for c in caps.get("drop", []):
        args += ["--cap-drop", c.lower()]
    for c in caps.get("add", []):
        args += ["--cap-add", c.lower()]
    said.append(f"capabilities drop {caps.get('drop', [])} add {caps.get('add', [])}")
    seccomp = (sc.pop("seccompProfile", {}) or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise CommandFailed(f"seccompProfile {seccomp}: the benchmark reproduces RuntimeDefault and Unconfined only")
    said.append(f"seccompProfile {seccomp}" + (" (podman's default profile)" if seccomp == "RuntimeDefault" else ""))
    if sc:
        raise CommandFailed(f"{MANIFEST}: securityContext keys the benchmark does not reproduce: {sorted(sc)}")
    return args, said


def podman_volume_args(container: dict, volumes: list[dict], config_dir: Path) -> tuple[list[str], list[str]]:
    """The proxy container's volume mounts: the config Secret as `config_dir` (read-only), a
    hostPath character device as --device, an emptyDir as a tmpfs."""
    by_name = {v["name"]: v for v in volumes}
    args, said = [], []
    for m in container.get("volumeMounts", []):
        v, path = by_name.get(m["name"], {}), m["mountPath"]
        if "secret" in v:
            args += ["-v", f"{config_dir}:{path}:ro"]
            said.append(f"{path}: the bench's config and key (Secret {v['secret'].get('secretName')})")
        elif "hostPath" in v and v["hostPath"].get("type") == "CharDevice":
            args += ["--device", f"{v['hostPath']['path']}:{path}"]
            said.append(f"{path}: --device")
        elif "emptyDir" in v:
            args += ["--tmpfs", f"{path}:rw,size=64m"]
            said.append(f"{path}: tmpfs (emptyDir)")
        else:
            raise CommandFailed(f"{MANIFEST}: volume {m['name']} of the proxy container: a kind the benchmark does not reproduce")
    return args, said


def image_exists(image: str) -> bool:
    return run([*PODMAN, "image", "exists", image], check=False).returncode == 0


def build_image(image: str, logfile: Path) -> None:
    """scripts/image.sh IMAGE, with its debootstrap base in $TUNNELGATE_IMAGE_ROOTFS, else
    /var/tmp/tg-bench-rootfs (not the packaging work's cache, which may be rebuilt meanwhile)."""
    env = dict(os.environ)
    env.setdefault("TUNNELGATE_IMAGE_ROOTFS", "/var/tmp/tg-bench-rootfs")
    log(f"==> scripts/image.sh {image} (base rootfs {env['TUNNELGATE_IMAGE_ROOTFS']})")
    with open(logfile, "w") as out:
        rc = subprocess.call([str(REPO / "scripts" / "image.sh"), image], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        raise CommandFailed(f"scripts/image.sh {image} failed ({rc}): {tail(logfile, 8)}")


class RtCgroup:
    """The cpu cgroup the benchmark's containers go under (`--cgroup-parent /tgbench<pid>`).

    This kernel has CONFIG_RT_GROUP_SCHED and cgroup v1 for cpu: a cgroup's tasks may enter
    SCHED_FIFO only if its cpu.rt_runtime_us (and every parent's) is above 0, and podman's own
    parent (libpod_parent) has 0, so `--cpu-rt-runtime` alone is refused by runc (EINVAL). This
    parent gets what the root group has left (the root's 950000 of 1000000 us, less its other
    children's), and the containers share it: `mode` "split" (the default) gives each of the
    run's `containers` its equal part from its start, as a runtime that stays (the daemon reads
    its cgroup's real-time runtime once, at start, and keeps its readers' budget within it: run
    one pod setup at a time for the whole of it); "focus" gives each container 1 % until a setup
    is measured, then the measured setup's containers the rest in equal parts (a runtime that
    changes under the daemon, so its budget follows the 1 % it started with); an integer gives
    every container that many us per `period`; "none" gives 0 (what a Kubernetes node on such a
    kernel gives a pod: its readers are refused real-time)."""

    MIN_RATIO = 0.01

    def __init__(self, mode: str, period_us: int):
        self.mode, self.period = mode, period_us
        self.name = f"{NAME_PREFIX}{PID}"
        self.dir = Path("/sys/fs/cgroup/cpu") / self.name
        self.members: dict[str, Path] = {}  # container name -> its cpu cgroup dir
        self.ratio = 0.0
        self.containers = 1  # how many containers the run starts (mode "split")

    def available_ratio(self) -> float:
        root = Path("/sys/fs/cgroup/cpu")
        total = int((root / "cpu.rt_runtime_us").read_text()) / int((root / "cpu.rt_period_us").read_text())
        used = 0.0
        for d in root.iterdir():
            if d.is_dir() and d != self.dir and (d / "cpu.rt_runtime_us").exists():
                rt = int((d / "cpu.rt_runtime_us").read_text())
                if rt > 0:
                    used += rt / int((d / "cpu.rt_period_us").read_text())
        return max(0.0, total - used)

    def prepare(self) -> None:
        if not (Path("/sys/fs/cgroup/cpu") / "cpu.rt_runtime_us").exists():
            self.mode = "none-needed"  # no RT group scheduling (cgroup v2 or the option off): nothing to give
            return
        self.dir.mkdir(exist_ok=True)
        if self.mode == "none":
            return
        parent_period = int((self.dir / "cpu.rt_period_us").read_text())
        # A cpu cgroup removed a moment ago (an earlier run's) keeps its runtime reserved until
        # the kernel has taken it offline, which it does asynchronously: try again for a while.
        deadline = time.monotonic() + 10
        while True:
            self.ratio = self.available_ratio() * 0.99
            try:
                (self.dir / "cpu.rt_runtime_us").write_text(str(int(self.ratio * parent_period)))
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise CommandFailed(f"{self.dir}/cpu.rt_runtime_us = {int(self.ratio * parent_period)}: {e}")
                time.sleep(0.5)

    def initial_runtime(self) -> int:
        """--cpu-rt-runtime for a new container."""
        if self.mode in ("none", "none-needed"):
            return 0
        if self.mode == "focus":
            return int(self.period * self.MIN_RATIO)
        if self.mode == "split":
            return int(self.period * self.ratio / max(1, self.containers))
        return int(self.mode)

    def podman_args(self) -> list[str]:
        if self.mode == "none-needed":
            return []
        args = ["--cgroup-parent", f"/{self.name}"]
        if self.initial_runtime():
            args += ["--cpu-rt-period", str(self.period), "--cpu-rt-runtime", str(self.initial_runtime())]
        return args

    def add(self, container: str, pid: int) -> None:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if "cpu" in ctrls.split(","):
                self.members[container] = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")

    def remove(self, container: str) -> None:
        self.members.pop(container, None)

    def unfocus(self) -> None:
        """Every member back to the minimum (before a new container asks for its share)."""
        if self.mode == "focus":
            for c in self.members:
                self._write(c, int(self.period * self.MIN_RATIO))

    def focus(self, containers: list[str]) -> dict[str, int]:
        """Gives `containers` the parent's real-time runtime in equal parts (mode "focus"); returns
        every member's runtime in us per period."""
        if self.mode != "focus" or not self.members:
            return self.runtimes()
        low = int(self.period * self.MIN_RATIO)
        focused = [c for c in containers if c in self.members]
        others = [c for c in self.members if c not in focused]
        for c in others:  # lower first: the parent's sum must hold after every write
            self._write(c, low)
        if focused:
            share = int(self.period * (self.ratio - self.MIN_RATIO * len(others)) / len(focused))
            for c in focused:
                self._write(c, max(low, share))
        return self.runtimes()

    def _write(self, container: str, runtime: int) -> None:
        try:
            (self.members[container] / "cpu.rt_runtime_us").write_text(str(runtime))
        except OSError as e:
            raise CommandFailed(f"{self.members[container]}/cpu.rt_runtime_us = {runtime}: {e}")

    def runtimes(self) -> dict[str, int]:
        out = {}
        for c, d in self.members.items():
            try:
                out[c] = int((d / "cpu.rt_runtime_us").read_text())
            except (OSError, ValueError):
                pass
        return out

    def cleanup(self) -> None:
        remove_cgroup_dirs(self.name)


def remove_cgroup_dirs(name: str) -> None:
    """Removes /sys/fs/cgroup/*/NAME and what is left under it (podman's conmon groups), deepest first."""
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        top = ctrl / name
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
            try:
                d.rmdir()
            except OSError:
                pass


def sweep_stale_pods() -> None:
    """Containers and cgroup parents an earlier, killed benchmark run left behind."""
    if shutil.which("podman"):
        p = run([*PODMAN, "ps", "-a", "--format", "{{.Names}}"], check=False, timeout=60)
        for name in p.stdout.split():
            m = re.fullmatch(NAME_PREFIX + r"(\d+)\S*", name)
            if m and not pid_alive(int(m.group(1))):
                run([*PODMAN, "rm", "-f", "-t", "2", name], check=False, timeout=60)
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        try:
            entries = list(ctrl.iterdir()) if ctrl.is_dir() else []
        except OSError:
            continue
        for d in entries:
            m = re.fullmatch(NAME_PREFIX + r"(\d+)", d.name)
            if m and d.is_dir() and not pid_alive(int(m.group(1))):
                remove_cgroup_dirs(d.name)


class PodContainer:
    """The proxy container of containers/k8s/statefulset.yaml run by podman in network namespace
    `ns`: its securityContext, volumes, environment, memory limit and command, with `cpus` as its
    CPU limit (`--cpus`), the config directory as its Secret, and `binary` bound over the image's
    /usr/local/bin/tunnelgate (None: the image's own)."""

    def __init__(self, name: str, ns: str, image: str, config_dir: Path, binary: str | None, cpus: float,
                 env: dict[str, str], rt: RtCgroup):
        self.name, self.ns, self.image, self.config_dir, self.binary, self.cpus, self.env, self.rt = name, ns, image, config_dir, binary, cpus, env, rt
        self.started = False
        self.notes: list[str] = []

    def args(self) -> list[str]:
        c, volumes = proxy_container()
        sec, said = podman_security_args(c)
        vol, vsaid = podman_volume_args(c, volumes, self.config_dir)
        args = [*PODMAN, "run", "-d", "--name", self.name, *PODMAN_ULIMITS, "--network", f"ns:/var/run/netns/{self.ns}",
                *sec, *vol, "--cpus", str(self.cpus)]
        mem = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if mem:
            args += ["--memory", memory_limit(mem)]
        for e in c.get("env", []):
            if "value" in e:
                args += ["-e", f"{e['name']}={e['value']}"]
        for k, v in self.env.items():
            args += ["-e", f"{k}={v}"]
        if self.binary:
            args += ["-v", f"{self.binary}:/usr/local/bin/tunnelgate:ro"]
        args += self.rt.podman_args()
        command = c.get("command") or ["tunnelgate", "run", "--config", "/etc/tunnelgate/tunnelgate.toml"]
        args += ["--entrypoint", command[0], self.image, *command[1:], *(c.get("args") or [])]
        self.notes = said + vsaid + [f"--cpus {self.cpus:g}", f"memory limit {mem}" if mem else "no memory limit",
                                     "the binary: " + ("the benchmark's, bound over the image's" if self.binary else "the image's")]
        return args

    def start(self) -> None:
        args = self.args()
        self.rt.unfocus()
        self.started = True
        p = run(args, check=False, timeout=120)
        if p.returncode != 0:
            raise CommandFailed(f"podman run {self.name}: {(p.stderr or p.stdout).strip()[-600:]}")

    def pid(self) -> int | None:
        p = run([*PODMAN, "inspect", "-f", "{{.State.Pid}}", self.name], check=False, timeout=30)
        try:
            pid = int(p.stdout.strip())
        except ValueError:
            return None
        return pid if pid > 0 else None

    def running(self) -> bool:
        p = run([*PODMAN, "inspect", "-f", "{{.State.Running}}", self.name], check=False, timeout=30)
        return p.stdout.strip() == "true"

    def logs(self) -> str:
        p = run([*PODMAN, "logs", "--tail", "20", self.name], check=False, timeout=30)
        return (p.stdout + p.stderr).strip()

    def stop(self) -> None:
        if self.started:
            run([*PODMAN, "rm", "-f", "-t", "3", self.name], check=False, timeout=60)
            self.started = False
        self.rt.remove(self.name)


def wait_pod_pid(c: PodContainer, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = c.pid()
        if pid and comm(pid) == "tunnelgate":
            return pid
        if not c.running() and c.pid() is None:
            break
        time.sleep(0.2)
    raise CommandFailed(f"container {c.name}: no tunnelgate process within {timeout:g} s: {c.logs()[-600:]}")
