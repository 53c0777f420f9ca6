//! Running commands, temporary directories, spawned processes ([`Proc`]) and what `/proc` says about them.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::*;

/// The result of a finished command.
#[derive(Debug, Clone)]
pub struct CmdOutput {
    /// The exit code (`None` when killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Runs a command to completion (stdin closed) and returns its output, whatever its exit code.
pub fn output_of(mut cmd: Command, stdin: Option<&str>) -> CmdOutput {
    let label = format!("{cmd:?}");
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {label}: {e}"));
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin was piped");
        pipe.write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("cannot write stdin of {label}: {e}"));
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("cannot wait for {label}: {e}"));
    CmdOutput {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `args` (in the current, root namespace); `Ok(stdout)` on exit 0, else `Err` with the
/// command, exit code and stderr.
pub fn try_run(args: &[&str]) -> Result<String, String> {
    let mut cmd = Command::new(args[0]);
    cmd.args(&args[1..]);
    let out = output_of(cmd, None);
    if out.success() {
        Ok(out.stdout)
    } else {
        Err(format!(
            "`{}` failed ({:?}): {}{}",
            args.join(" "),
            out.code,
            out.stderr.trim(),
            if out.stdout.trim().is_empty() {
                String::new()
            } else {
                format!(" (stdout: {})", out.stdout.trim())
            }
        ))
    }
}

/// Runs `args` in the root namespace and returns stdout; panics if it fails.
pub fn run(args: &[&str]) -> String {
    try_run(args).unwrap_or_else(|e| panic!("{e}"))
}

/// A directory under the system temp dir, removed on drop (kept, with a note on stderr, when the
/// test is panicking so its logs can be read).
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("tunnelgate-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `contents` to `name` in the directory (mode 0644) and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        self.write_mode(name, contents, 0o644)
    }

    /// Writes a secret (a key file): mode 0600.
    pub fn write_secret(&self, name: &str, contents: &str) -> PathBuf {
        self.write_mode(name, contents, 0o600)
    }

    /// Writes `contents` with exactly `mode` (replacing a file that is there).
    pub fn write_mode(&self, name: &str, contents: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.path.join(name);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        f.write_all(contents.as_bytes())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
        path
    }

    /// The contents of `name` in the directory ("" if it does not exist).
    pub fn read(&self, name: &str) -> String {
        fs::read(self.path.join(name))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("harness: keeping {} for diagnostics", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A running process that is killed (SIGKILL) and reaped when dropped. Its stdout and stderr go to
/// files (see [`Proc::stdout`], [`Proc::stderr`]).
#[derive(Debug)]
pub struct Proc {
    child: Child,
    pub(super) label: String,
    out: PathBuf,
    err: PathBuf,
    pub(super) status: Option<ExitStatus>,
}

impl Proc {
    /// Spawns `cmd` with stdin closed and stdout/stderr written to `<log_dir>/<label>.out|.err`.
    pub fn spawn(mut cmd: Command, label: &str, log_dir: &Path) -> Proc {
        let out = log_dir.join(format!("{label}.out"));
        let err = log_dir.join(format!("{label}.err"));
        let file = |p: &Path| {
            fs::File::create(p).unwrap_or_else(|e| panic!("cannot create {}: {e}", p.display()))
        };
        cmd.stdin(Stdio::null())
            .stdout(file(&out))
            .stderr(file(&err));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {label} ({cmd:?}): {e}"));
        Proc {
            child,
            label: label.to_string(),
            out,
            err,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Everything the process wrote to stdout so far.
    pub fn stdout(&self) -> String {
        fs::read(&self.out)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read(&self.err)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The exit status if the process has exited (reaping it).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    pub fn is_running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// Sends `sig` (ignored if the process has already exited).
    pub fn signal(&mut self, sig: Signal) {
        if self.is_running() {
            let _ = kill(Pid::from_raw(self.pid() as i32), sig);
        }
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        poll_until(timeout, || self.try_wait().is_some());
        self.try_wait()
    }

    /// SIGTERM, then waits up to `timeout` for the exit status; panics (after a SIGKILL) with the
    /// process's stderr if it does not exit in time.
    pub fn sigterm(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        match self.wait_timeout(timeout) {
            Some(s) => s,
            None => {
                let _ = self.kill9();
                panic!(
                    "{} did not exit within {timeout:?} of SIGTERM; stderr:\n{}",
                    self.label,
                    self.stderr()
                );
            }
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) -> ExitStatus {
        if let Some(s) = self.try_wait() {
            return s;
        }
        let _ = self.child.kill();
        let s = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("cannot reap {}: {e}", self.label));
        self.status = Some(s);
        s
    }

    /// SIGTERM, a grace period, then SIGKILL: the polite stop used by the drop guards.
    pub(super) fn stop_quietly(&mut self, grace: Duration) {
        if self.is_running() {
            self.signal(Signal::SIGTERM);
            if self.wait_timeout(grace).is_none() {
                let _ = self.kill9();
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.is_running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Peak RSS (VmHWM) of `pid` in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

/// Current RSS (VmRSS) of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// User + system CPU time of `pid` (all threads), in clock ticks (100 per second).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Whether kubectl runs (Debian's kubernetes-client: scripts/test.sh installs it); without it
/// the test [`skip`]s (a failure under `CI=true`).
pub fn kubectl_or_skip() -> bool {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        skip(
            "kubectl is not installed (apt-get install --no-install-recommends kubernetes-client)",
        );
    }
    found
}
