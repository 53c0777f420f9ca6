//! A booted systemd in systemd-nspawn on a debootstrapped rootfs: the cache, the container, its processes and threads.

use super::*;

/// Where the booted-systemd test keeps its Debian rootfs between runs (outside the repo):
/// `$TUNNELGATE_TEST_ROOTFS`, else `/var/tmp/tunnelgate-test-rootfs`.
pub(crate) fn rootfs_cache() -> PathBuf {
    std::env::var_os("TUNNELGATE_TEST_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/tunnelgate-test-rootfs"))
}

/// The cached rootfs, built with debootstrap (a few minutes, once) if it is missing; `Err` says
/// why it cannot be had.
pub(crate) fn booting_rootfs() -> Result<PathBuf, String> {
    let root = rootfs_cache();
    if root.join("usr/lib/systemd/systemd").exists() {
        return Ok(root);
    }
    for tool in ["systemd-nspawn", "debootstrap"] {
        if !have(tool) {
            return Err(format!(
                "{tool} missing (apt-get install --no-install-recommends systemd-container debootstrap)"
            ));
        }
    }
    let partial = root.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let out = output_of(
        {
            let mut c = Command::new("debootstrap");
            c.args([
                "--variant=minbase",
                "--include=systemd,systemd-sysv,dbus",
                "bookworm",
            ])
            .arg(&partial)
            .arg("http://deb.debian.org/debian");
            c
        },
        None,
    );
    if !out.success() {
        return Err(format!("debootstrap failed: {}", out.stderr.trim()));
    }
    std::fs::rename(&partial, &root).map_err(|e| format!("rename {}: {e}", partial.display()))?;
    Ok(root)
}

/// The container's PID 1: the `systemd` process among the descendants of `pid` (nspawn forks
/// an intermediate child first, so the first child is not always it).
pub(crate) fn container_init(pid: u32) -> Option<u32> {
    let children = |p: u32| -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{p}/task/{p}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse().ok())
            .collect()
    };
    let mut todo = children(pid);
    while let Some(p) = todo.pop() {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        if comm.trim() == "systemd" {
            return Some(p);
        }
        todo.extend(children(p));
    }
    None
}

/// A Debian rootfs booted by systemd-nspawn in the network namespace `ns`, with this
/// worktree's binary and units, and `etc` as /etc/tunnelgate; tunnelgate.service is wanted at boot.
pub(crate) struct Container {
    pub(crate) nspawn: Proc,
}

impl Container {
    pub(crate) fn boot(rootfs: &Path, ns: &Netns, etc: &TempDir) -> Container {
        Container::boot_with(rootfs, ns, etc, &[])
    }

    /// [`Container::boot`] with more `systemd-nspawn` arguments before `-D` (e.g. a drop-in
    /// directory bound in).
    pub(crate) fn boot_with(
        rootfs: &Path,
        ns: &Netns,
        etc: &TempDir,
        extra: &[String],
    ) -> Container {
        let mut cmd = Command::new("systemd-nspawn");
        cmd.args([
            "-b",
            "--register=no",
            "--keep-unit",
            "--volatile=overlay",
            "--console=passive",
            "--capability=CAP_NET_ADMIN",
            &format!("--network-namespace-path=/run/netns/{}", ns.name()),
            "--bind=/dev/net/tun",
            &format!("--bind-ro={}:/usr/local/bin/tunnelgate", tunnelgate_bin()),
            &format!(
                "--bind-ro={}:/etc/systemd/system/tunnelgate.service",
                unit_path().display()
            ),
            &format!(
                "--bind-ro={}/systemd/tunnelgate@.service:/etc/systemd/system/tunnelgate@.service",
                env!("CARGO_MANIFEST_DIR")
            ),
            &format!("--bind={}:/etc/tunnelgate", etc.path().display()),
        ])
        .args(extra)
        .arg("-D")
        .arg(rootfs)
        .arg("systemd.wants=tunnelgate.service");
        let nspawn = Proc::spawn(cmd, "nspawn", etc.path());
        let nspawn_pid = nspawn.pid();
        wait_until(Duration::from_secs(20), "the container's PID 1", || {
            container_init(nspawn_pid).is_some()
        });
        Container { nspawn }
    }

    /// Runs `args` in every namespace of the container (as `machinectl shell` would).
    pub(crate) fn inside(&self, args: &[&str]) -> CmdOutput {
        let leader = container_init(self.nspawn.pid())
            .map(|l| l.to_string())
            .unwrap_or_default();
        let mut c = Command::new("nsenter");
        c.args(["-t", &leader, "-a", "--"]).args(args);
        output_of(c, None)
    }

    /// A property of a unit (`systemctl show -p NAME --value`).
    pub(crate) fn property(&self, unit: &str, name: &str) -> String {
        self.inside(&["systemctl", "show", "-p", name, "--value", unit])
            .stdout
            .trim()
            .to_string()
    }

    /// Waits up to 60 s for `unit` to be active, checks that systemd took `watchdog` as its
    /// `WatchdogSec` (from `source`: "the unit's", "the drop-in's"), and returns the unit's
    /// main pid and restart count.
    pub(crate) fn active_with_watchdog(
        &self,
        unit: &str,
        watchdog: Duration,
        source: &str,
    ) -> (String, u32) {
        let journal = || {
            self.inside(&["journalctl", "-u", "tunnelgate", "--no-pager"])
                .stdout
        };
        let booted = poll_until(Duration::from_secs(60), || {
            self.property(unit, "ActiveState") == "active"
        });
        assert!(
            booted,
            "{unit} active: {}\n{}",
            journal(),
            self.nspawn.stderr()
        );
        assert_eq!(
            self.property(unit, "WatchdogUSec"),
            format!("{}s", watchdog.as_secs()),
            "systemd took {source} WatchdogSec"
        );
        let first_pid = self.property(unit, "MainPID");
        let restarts_before: u32 = self.property(unit, "NRestarts").parse().expect("NRestarts");
        (first_pid, restarts_before)
    }

    /// The host's process id of the container's process `pid_inside` (its PID namespace's id).
    pub(crate) fn host_pid(&self, pid_inside: &str) -> Option<u32> {
        let init = container_init(self.nspawn.pid())?;
        descendants(init).into_iter().find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|ids| ids.split_whitespace().last().map(str::to_string))
                .as_deref()
                == Some(pid_inside)
        })
    }

    pub(crate) fn poweroff(mut self) {
        let _ = self.inside(&["systemctl", "poweroff"]);
        let stopped = self.nspawn.wait_timeout(Duration::from_secs(30));
        assert!(stopped.is_some(), "container powered off");
    }
}

/// Every descendant of `pid`.
pub(crate) fn descendants(pid: u32) -> Vec<u32> {
    let children = |p: u32| -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{p}/task/{p}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse().ok())
            .collect()
    };
    let mut out = vec![];
    let mut todo = children(pid);
    while let Some(p) = todo.pop() {
        todo.extend(children(p));
        out.push(p);
    }
    out
}

/// The booted rootfs, or `None` (the test skips: [`skip`]) on a developer machine that cannot
/// build it; under `CI=true` the test fails instead.
pub(crate) fn rootfs_or_skip() -> Option<PathBuf> {
    ok_or_skip(booting_rootfs())
}

/// The thread ids of the threads of host process `pid` named `name`.
pub(crate) fn threads_named(pid: u32, name: &str) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![];
    };
    tasks
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

/// Freezes one thread of another process with ptrace (`PTRACE_SEIZE` + `PTRACE_INTERRUPT`: only
/// that thread stops, as a deadlock or a stuck system call looks from outside; the rest of the
/// process, its watchdog task included, runs on) on a thread of its own, which also reaps the
/// frozen thread when the process is killed: a traced thread that died stays a zombie until
/// its tracer waits for it, and until then its process has not exited for systemd either.
/// Holds the thread for at most `limit`, then lets it go. Returns whether the thread died
/// frozen (the process was killed while it was stuck).
pub(crate) fn freeze_until_killed(
    tid: i32,
    limit: Duration,
) -> std::thread::JoinHandle<Result<bool, String>> {
    std::thread::spawn(move || {
        // SAFETY: ptrace and waitpid on a thread id; `status` outlives each call.
        unsafe {
            if libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) != 0 {
                return Err(format!(
                    "PTRACE_SEIZE {tid}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            if libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) != 0 {
                return Err(format!(
                    "PTRACE_INTERRUPT {tid}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let deadline = clock::now() + limit;
            while clock::now() < deadline {
                let mut status = 0;
                let got = libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG);
                if got == tid && (libc::WIFEXITED(status) || libc::WIFSIGNALED(status)) {
                    return Ok(true);
                }
                if got < 0 {
                    return Err(format!(
                        "waitpid {tid}: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                // Stopped (the interrupt, or a signal meant for it): it stays stopped.
                std::thread::sleep(Duration::from_millis(50));
            }
            libc::ptrace(libc::PTRACE_DETACH, tid, 0usize, 0usize);
            Ok(false)
        }
    })
}
