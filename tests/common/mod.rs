//! The shared network-namespace test harness: namespaces, veth pairs, wireguard-go and tunnelgate peers, and traffic helpers.
//!
//! Every netns suite does `mod common;` and marks its tests `#[ignore = "needs root"]`; CI runs them
//! with `cargo test -- --ignored --test-threads=1`.
//!
//! Rules the harness keeps so suites cannot collide (with each other, or with a second test binary
//! running at the same time):
//! - every namespace and interface name is `<kind><pid>x<counter>` (≤ 15 characters): the UAPI socket
//!   folder `/var/run/wireguard/` is shared by every namespace;
//! - every guard cleans up on drop, also while a test panics: [`Netns`] kills whatever still runs inside
//!   it and deletes itself, [`Proc`] kills its process, [`WgGo`] and [`Tunnelgate`] stop their daemon and
//!   remove a socket it left behind, [`TempDir`] removes itself (kept when the test panics, for
//!   diagnostics);
//! - leftovers of an earlier run that was killed (its pid is gone) are swept before the first namespace
//!   is created.
//!
//! Code that must run *inside* a namespace (a TCP listener, an HTTP GET of `/readyz`, a UDP echo server)
//! runs in a thread of the test process that entered the namespace with `setns(2)`: see
//! [`Netns::in_ns`] and [`Netns::thread`]. No python, curl or ncat is needed.
#![allow(dead_code)]
// Each suite includes this file as its own private `mod common;`: `pub` is the harness API, not
// an export of the test crate.
#![allow(unreachable_pub)]

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tunnelgate::clock;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How often every waiting helper polls.
pub const POLL: Duration = Duration::from_millis(50);
/// Where wireguard-go, boringtun and tunnelgate put their UAPI sockets (shared by all namespaces).
pub const WG_SOCKET_DIR: &str = "/var/run/wireguard";
/// The name kinds the harness generates (see [`unique_name`]).
const KINDS: [&str; 5] = ["tgn", "tgv", "tgw", "tgd", "tgt"];

static COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

// ---------------------------------------------------------------------------------------------
// Names, root, waiting
// ---------------------------------------------------------------------------------------------

/// Panics with a clear message unless the test runs as root (netns suites need it).
pub fn require_root() {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the effective uid.
    let euid = fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    assert!(
        euid == 0,
        "this test needs root (network namespaces, TUN, veth): run it as root with \
         `cargo test -- --ignored --test-threads=1`"
    );
}

/// A name unique to this process and call: `<kind><pid>x<n>`, at most 15 characters, so it is a
/// valid interface name and UAPI socket name. `kind` is one of `tgn` (namespace), `tgv` (veth),
/// `tgw` (wireguard-go), `tgd` (tunnelgate), `tgt` (anything else).
pub fn unique_name(kind: &str) -> String {
    assert!(KINDS.contains(&kind), "unknown name kind {kind:?}");
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("{kind}{}x{n}", std::process::id());
    assert!(name.len() <= 15, "generated name {name} is longer than 15");
    name
}

/// The pid that generated a harness name, if `name` has the harness's shape.
fn owner_pid(name: &str) -> Option<u32> {
    let kind = KINDS.iter().find(|k| name.starts_with(*k))?;
    let rest = &name[kind.len()..];
    let (pid, n) = rest.split_once('x')?;
    if pid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes namespaces and UAPI sockets that an earlier, killed harness run left behind.
fn sweep_stale() {
    SWEEP.call_once(|| {
        let stale = |name: &str| owner_pid(name).is_some_and(|p| p > 1 && !pid_alive(p));
        if let Ok(list) = try_run(&["ip", "netns", "list"]) {
            for line in list.lines() {
                let name = line.split_whitespace().next().unwrap_or("");
                if stale(name) {
                    kill_ns_processes(name);
                    let _ = try_run(&["ip", "netns", "del", name]);
                }
            }
        }
        if let Ok(dir) = fs::read_dir(WG_SOCKET_DIR) {
            for entry in dir.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if file.strip_suffix(".sock").is_some_and(stale) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
    });
}

/// Polls `f` every [`POLL`] until it is true or `timeout` passes; returns whether it became true.
pub fn poll_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = clock::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if clock::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Like [`poll_until`], but panics with `what` when the time is up.
pub fn wait_until(timeout: Duration, what: &str, f: impl FnMut() -> bool) {
    assert!(
        poll_until(timeout, f),
        "timed out after {timeout:?} waiting until {what}"
    );
}

// ---------------------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Temporary directories
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// A running process that is killed (SIGKILL) and reaped when dropped. Its stdout and stderr go to
/// files (see [`Proc::stdout`], [`Proc::stderr`]).
#[derive(Debug)]
pub struct Proc {
    child: Child,
    label: String,
    out: PathBuf,
    err: PathBuf,
    status: Option<ExitStatus>,
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
    fn stop_quietly(&mut self, grace: Duration) {
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

// ---------------------------------------------------------------------------------------------
// Namespaces
// ---------------------------------------------------------------------------------------------

fn ns_pids(ns: &str) -> Vec<i32> {
    try_run(&["ip", "netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| *p as u32 != std::process::id())
        .collect()
}

/// SIGTERM to every process in `ns`, up to 2 s for them to go, then SIGKILL.
fn kill_ns_processes(ns: &str) {
    let pids = ns_pids(ns);
    if pids.is_empty() {
        return;
    }
    for p in &pids {
        let _ = kill(Pid::from_raw(*p), Signal::SIGTERM);
    }
    if !poll_until(Duration::from_secs(2), || ns_pids(ns).is_empty()) {
        for p in ns_pids(ns) {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        poll_until(Duration::from_secs(2), || ns_pids(ns).is_empty());
    }
}

/// A network namespace with `lo` up, deleted on drop after every process still inside it is
/// stopped. It owns a [`TempDir`] for the logs and files of what runs in it.
#[derive(Debug)]
pub struct Netns {
    name: String,
    dir: TempDir,
}

impl Netns {
    pub fn new() -> Netns {
        require_root();
        sweep_stale();
        let name = unique_name("tgn");
        run(&["ip", "netns", "add", &name]);
        let ns = Netns {
            dir: TempDir::new(&name),
            name,
        };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's scratch directory (logs, configs).
    pub fn dir(&self) -> &TempDir {
        &self.dir
    }

    /// A `Command` for `ip netns exec NAME args...`: the process is `args[0]` itself (no shell, no
    /// fork), so its pid is the one to signal.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd
    }

    /// Runs `args` in the namespace to completion, whatever its exit code.
    pub fn output(&self, args: &[&str]) -> CmdOutput {
        output_of(self.command(args), None)
    }

    /// Runs `args` in the namespace; `Ok(stdout)` on exit 0, else `Err` naming command and stderr.
    pub fn try_exec(&self, args: &[&str]) -> Result<String, String> {
        self.try_exec_with(args, None)
    }

    /// [`Netns::try_exec`] with `stdin` written to the command's standard input (e.g. a rule
    /// set for `nft -f -`).
    pub fn try_exec_stdin(&self, args: &[&str], stdin: &str) -> Result<String, String> {
        self.try_exec_with(args, Some(stdin))
    }

    /// [`Netns::try_exec_stdin`] that panics, showing the input, if the command fails.
    pub fn exec_stdin(&self, args: &[&str], stdin: &str) -> String {
        self.try_exec_stdin(args, stdin)
            .unwrap_or_else(|e| panic!("{e}\n--- stdin\n{stdin}"))
    }

    fn try_exec_with(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let out = output_of(self.command(args), stdin);
        if out.success() {
            Ok(out.stdout)
        } else {
            Err(format!(
                "`ip netns exec {} {}` failed ({:?}): {}",
                self.name,
                args.join(" "),
                out.code,
                out.stderr.trim()
            ))
        }
    }

    /// Runs `args` in the namespace and returns stdout; panics if it fails.
    pub fn exec(&self, args: &[&str]) -> String {
        self.try_exec(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `sh -c script` in the namespace and returns stdout; panics if it fails. A background
    /// job in `script` must redirect its output (`>/dev/null 2>&1 &`), or this waits for it.
    pub fn sh(&self, script: &str) -> String {
        self.exec(&["sh", "-c", script])
    }

    pub fn try_sh(&self, script: &str) -> Result<String, String> {
        self.try_exec(&["sh", "-c", script])
    }

    /// Starts `args` in the namespace; logs go to `dir()/<args[0]>-<n>.out|.err`. The guard kills
    /// the process on drop (and dropping the namespace kills anything left inside).
    pub fn spawn(&self, args: &[&str]) -> Proc {
        let base = Path::new(args[0])
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "proc".into());
        let label = format!("{base}-{}", COUNTER.fetch_add(1, Ordering::Relaxed));
        Proc::spawn(self.command(args), &label, self.dir.path())
    }

    /// Runs `f` on a thread that has entered this namespace (`setns(2)`) and returns its result.
    /// Sockets `f` creates live in the namespace. A panic in `f` propagates.
    pub fn in_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = self.ns_path();
        std::thread::scope(|s| {
            let h = s.spawn(move || {
                enter_ns(&path);
                f()
            });
            match h.join() {
                Ok(v) => v,
                Err(p) => std::panic::resume_unwind(p),
            }
        })
    }

    /// Starts a thread inside this namespace (for servers that outlive one call).
    pub fn thread<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        let path = self.ns_path();
        std::thread::spawn(move || {
            enter_ns(&path);
            f()
        })
    }

    fn ns_path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.name))
    }

    /// Whether `dev` exists in the namespace.
    pub fn link_exists(&self, dev: &str) -> bool {
        self.try_exec(&["ip", "link", "show", "dev", dev]).is_ok()
    }

    /// Whether `dev` exists and is administratively up.
    pub fn link_is_up(&self, dev: &str) -> bool {
        self.try_exec(&["ip", "-o", "link", "show", "dev", dev])
            .map(|s| {
                s.split_once('<')
                    .and_then(|(_, r)| r.split_once('>'))
                    .is_some_and(|(flags, _)| flags.split(',').any(|f| f == "UP"))
            })
            .unwrap_or(false)
    }

    /// `ip route show` (v4) and `ip -6 route show` of the namespace, concatenated.
    pub fn routes(&self) -> String {
        let mut s = self.exec(&["ip", "route", "show", "table", "all"]);
        s.push_str(&self.exec(&["ip", "-6", "route", "show", "table", "all"]));
        s
    }

    /// Sets a sysctl in the namespace (e.g. `net.ipv4.ip_forward`).
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec(&["sysctl", "-q", "-w", &format!("{key}={value}")]);
    }

    /// Reads a sysctl in the namespace.
    pub fn sysctl_get(&self, key: &str) -> String {
        self.exec(&["sysctl", "-n", key]).trim().to_string()
    }

    /// The process ids inside the namespace.
    pub fn pids(&self) -> Vec<i32> {
        ns_pids(&self.name)
    }
}

impl Default for Netns {
    fn default() -> Self {
        Netns::new()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        kill_ns_processes(&self.name);
        if let Err(e) = try_run(&["ip", "netns", "del", &self.name]) {
            eprintln!("harness: {e}");
        }
    }
}

/// Moves the calling thread into the network namespace mounted at `path`.
fn enter_ns(path: &Path) {
    let f = fs::File::open(path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns({}) failed: {e}", path.display()));
}

/// Whether the namespace `name` is still listed by `ip netns list`.
pub fn netns_exists(name: &str) -> bool {
    run(&["ip", "netns", "list"])
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

/// The UAPI socket path of interface `name`.
pub fn wg_socket(name: &str) -> PathBuf {
    Path::new(WG_SOCKET_DIR).join(format!("{name}.sock"))
}

// ---------------------------------------------------------------------------------------------
// veth
// ---------------------------------------------------------------------------------------------

/// A veth pair: `a_name` in namespace `a`, `b_name` in `b`. It goes away with either namespace.
#[derive(Debug, Clone)]
pub struct Veth {
    pub a_name: String,
    pub b_name: String,
}

/// Joins `a` and `b` with a veth pair, gives each end its addresses (CIDR, v4 or v6; v6 with
/// `nodad`, so usable at once) and brings both ends up.
pub fn veth(a: &Netns, a_addrs: &[&str], b: &Netns, b_addrs: &[&str]) -> Veth {
    let a_name = unique_name("tgv");
    let b_name = unique_name("tgv");
    run(&[
        "ip", "link", "add", &a_name, "netns", &a.name, "type", "veth", "peer", "name", &b_name,
        "netns", &b.name,
    ]);
    for (ns, dev, addrs) in [(a, &a_name, a_addrs), (b, &b_name, b_addrs)] {
        for addr in addrs {
            add_addr(ns, dev, addr);
        }
        ns.exec(&["ip", "link", "set", dev, "up"]);
    }
    Veth { a_name, b_name }
}

/// Two fresh namespaces joined by a veth pair: `a` gets `a4/24` and `a6/64`, `b` gets `b4/24` and
/// `b6/64` (the underlay most suites need).
pub fn lan_pair(a4: &str, a6: &str, b4: &str, b6: &str) -> (Netns, Netns, Veth) {
    let a = Netns::new();
    let b = Netns::new();
    let v = veth(
        &a,
        &[&format!("{a4}/24"), &format!("{a6}/64")],
        &b,
        &[&format!("{b4}/24"), &format!("{b6}/64")],
    );
    (a, b, v)
}

/// `ip addr add ADDR dev DEV` (with `nodad` for IPv6).
pub fn add_addr(ns: &Netns, dev: &str, addr: &str) {
    if addr.contains(':') {
        ns.exec(&["ip", "-6", "addr", "add", addr, "dev", dev, "nodad"]);
    } else {
        ns.exec(&["ip", "addr", "add", addr, "dev", dev]);
    }
}

/// The address part of a CIDR ("10.0.0.1/24" -> 10.0.0.1).
pub fn ip_of(cidr: &str) -> IpAddr {
    cidr.split('/')
        .next()
        .unwrap_or(cidr)
        .parse()
        .unwrap_or_else(|e| panic!("{cidr:?} is not an address: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Keys and `wg`
// ---------------------------------------------------------------------------------------------

/// A WireGuard key pair, base64, made by `wg genkey` / `wg pubkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keypair {
    pub private: String,
    pub public: String,
}

impl Keypair {
    pub fn generate() -> Keypair {
        let private = run(&["wg", "genkey"]).trim().to_string();
        let public = wg_pubkey(&private);
        Keypair { private, public }
    }
}

/// `wg pubkey` of a base64 private key.
pub fn wg_pubkey(private: &str) -> String {
    let mut cmd = Command::new("wg");
    cmd.arg("pubkey");
    let out = output_of(cmd, Some(private));
    assert!(out.success(), "wg pubkey failed: {}", out.stderr);
    out.stdout.trim().to_string()
}

/// `wg genpsk`.
pub fn wg_genpsk() -> String {
    run(&["wg", "genpsk"]).trim().to_string()
}

/// A peer as configured on the other side: its public key and where/what it may send.
#[derive(Debug, Clone, Default)]
pub struct Peer {
    pub public_key: String,
    /// `host:port`, `[v6]:port`.
    pub endpoint: Option<String>,
    /// CIDRs.
    pub allowed_ips: Vec<String>,
    pub keepalive: Option<u16>,
    /// base64
    pub preshared_key: Option<String>,
    /// `peer[].name` (tunnelgate configs only; `wg` has no names).
    pub name: Option<String>,
}

impl Peer {
    pub fn new(public_key: &str, allowed_ips: &[&str]) -> Peer {
        Peer {
            public_key: public_key.to_string(),
            allowed_ips: allowed_ips.iter().map(|s| s.to_string()).collect(),
            ..Peer::default()
        }
    }

    pub fn endpoint(mut self, endpoint: &str) -> Peer {
        self.endpoint = Some(endpoint.to_string());
        self
    }

    pub fn keepalive(mut self, secs: u16) -> Peer {
        self.keepalive = Some(secs);
        self
    }

    pub fn preshared_key(mut self, psk: &str) -> Peer {
        self.preshared_key = Some(psk.to_string());
        self
    }

    pub fn name(mut self, name: &str) -> Peer {
        self.name = Some(name.to_string());
        self
    }
}

/// `wg show NAME dump`, parsed.
#[derive(Debug, Clone, Default)]
pub struct WgDump {
    pub private_key: String,
    pub public_key: String,
    pub listen_port: u16,
    /// "off" or the mark.
    pub fwmark: String,
    pub peers: Vec<WgPeerDump>,
}

/// One peer line of `wg show NAME dump`.
#[derive(Debug, Clone, Default)]
pub struct WgPeerDump {
    pub public_key: String,
    pub preshared_key: Option<String>,
    pub endpoint: Option<String>,
    pub allowed_ips: Vec<String>,
    /// Unix seconds, 0 = never.
    pub latest_handshake: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub persistent_keepalive: Option<u16>,
}

impl WgDump {
    pub fn peer(&self, public_key: &str) -> Option<&WgPeerDump> {
        self.peers.iter().find(|p| p.public_key == public_key)
    }
}

fn none_or(s: &str) -> Option<String> {
    (s != "(none)" && s != "off").then(|| s.to_string())
}

/// Parses the output of `wg show NAME dump`.
pub fn parse_wg_dump(text: &str) -> Result<WgDump, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().ok_or("empty `wg show dump`")?;
    let f: Vec<&str> = first.split('\t').collect();
    if f.len() != 4 {
        return Err(format!("bad interface line {first:?}"));
    }
    let mut dump = WgDump {
        private_key: f[0].into(),
        public_key: f[1].into(),
        listen_port: f[2]
            .parse()
            .map_err(|e| format!("listen port {:?}: {e}", f[2]))?,
        fwmark: f[3].into(),
        peers: vec![],
    };
    for line in lines {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 8 {
            return Err(format!("bad peer line {line:?}"));
        }
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|e| format!("{s:?} in {line:?}: {e}"))
        };
        dump.peers.push(WgPeerDump {
            public_key: f[0].into(),
            preshared_key: none_or(f[1]),
            endpoint: none_or(f[2]),
            allowed_ips: none_or(f[3])
                .map(|s| s.split(',').map(|s| s.to_string()).collect())
                .unwrap_or_default(),
            latest_handshake: num(f[4])?,
            rx_bytes: num(f[5])?,
            tx_bytes: num(f[6])?,
            persistent_keepalive: none_or(f[7]).and_then(|s| s.parse().ok()),
        });
    }
    Ok(dump)
}

/// `wg show NAME dump` against the UAPI socket of `iface` (any daemon), parsed; `Err` if `wg` fails.
pub fn try_wg_dump(iface: &str) -> Result<WgDump, String> {
    parse_wg_dump(&try_run(&["wg", "show", iface, "dump"])?)
}

/// [`try_wg_dump`], panicking on failure.
pub fn wg_dump(iface: &str) -> WgDump {
    try_wg_dump(iface).unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until interface `iface` reports a handshake with `peer_public`.
pub fn wait_handshake(iface: &str, peer_public: &str, timeout: Duration) {
    wait_until(
        timeout,
        &format!("{iface} has a handshake with {peer_public}"),
        || {
            try_wg_dump(iface)
                .ok()
                .and_then(|d| d.peer(peer_public).map(|p| p.latest_handshake > 0))
                .unwrap_or(false)
        },
    );
}

/// `wg set IFACE peer ...` arguments for `peer` (key files written to `dir`).
fn wg_set_peer_args(peer: &Peer, dir: &TempDir) -> Vec<String> {
    let mut a = vec!["peer".to_string(), peer.public_key.clone()];
    if let Some(psk) = &peer.preshared_key {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let f = dir.write_secret(&format!("psk-{n}"), psk);
        a.extend(["preshared-key".into(), f.display().to_string()]);
    }
    if let Some(ep) = &peer.endpoint {
        a.extend(["endpoint".into(), ep.clone()]);
    }
    if let Some(k) = peer.keepalive {
        a.extend(["persistent-keepalive".into(), k.to_string()]);
    }
    a.extend(["allowed-ips".into(), peer.allowed_ips.join(",")]);
    a
}

// ---------------------------------------------------------------------------------------------
// wireguard-go
// ---------------------------------------------------------------------------------------------

/// A wireguard-go peer running in a namespace (`wireguard-go -f NAME`), configured with `wg`.
/// Dropping it stops the daemon (SIGTERM, then SIGKILL) and removes its socket if left behind.
#[derive(Debug)]
pub struct WgGo {
    ns: String,
    name: String,
    pub key: Keypair,
    proc: Proc,
    dir: TempDir,
}

impl WgGo {
    /// Starts wireguard-go with a fresh key, `listen_port` (0 = random) and tunnel `addresses`
    /// (CIDRs; their prefixes give connected routes), and brings the interface up.
    pub fn start(ns: &Netns, listen_port: u16, addresses: &[&str]) -> WgGo {
        WgGo::start_with_key(ns, Keypair::generate(), listen_port, addresses)
    }

    pub fn start_with_key(ns: &Netns, key: Keypair, listen_port: u16, addresses: &[&str]) -> WgGo {
        let name = unique_name("tgw");
        let dir = TempDir::new(&name);
        let mut cmd = ns.command(&["wireguard-go", "-f", &name]);
        cmd.env("WG_PROCESS_FOREGROUND", "1");
        let mut proc = Proc::spawn(cmd, &name, dir.path());
        let sock = wg_socket(&name);
        let up = poll_until(Duration::from_secs(10), || {
            sock.exists() || !proc.is_running()
        });
        if !up || !sock.exists() {
            let _ = proc.kill9();
            panic!(
                "wireguard-go {name} did not create {} (exited: {:?}); stdout:\n{}\nstderr:\n{}",
                sock.display(),
                proc.try_wait(),
                proc.stdout(),
                proc.stderr()
            );
        }
        let wg = WgGo {
            ns: ns.name.clone(),
            name,
            key,
            proc,
            dir,
        };
        let keyfile = wg.dir.write_secret("private.key", &wg.key.private);
        wg.wg(&[
            "set",
            &wg.name,
            "private-key",
            &keyfile.display().to_string(),
            "listen-port",
            &listen_port.to_string(),
        ]);
        for addr in addresses {
            let v6 = addr.contains(':');
            let mut args = vec!["ip"];
            if v6 {
                args.push("-6");
            }
            args.extend(["addr", "add", addr, "dev", &wg.name]);
            if v6 {
                args.push("nodad");
            }
            wg.ns_exec(&args);
        }
        wg.ns_exec(&["ip", "link", "set", &wg.name, "up"]);
        wg
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn public_key(&self) -> &str {
        &self.key.public
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The actual listen port (useful after starting with 0).
    pub fn listen_port(&self) -> u16 {
        self.dump().listen_port
    }

    fn ns_exec(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).args(args);
        let out = output_of(cmd, None);
        assert!(
            out.success(),
            "`ip netns exec {} {}` failed: {}",
            self.ns,
            args.join(" "),
            out.stderr
        );
        out.stdout
    }

    /// Runs `wg ARGS` (in the daemon's namespace) and returns stdout; panics on failure.
    pub fn wg(&self, args: &[&str]) -> String {
        let mut full = vec!["wg"];
        full.extend_from_slice(args);
        self.ns_exec(&full)
    }

    /// Adds (or updates) a peer with `wg set`, and routes its allowed IPs through the interface
    /// (`ip route replace`; a /0 is skipped: add default routes yourself).
    pub fn add_peer(&self, peer: &Peer) {
        let args = wg_set_peer_args(peer, &self.dir);
        let mut full = vec!["set", self.name.as_str()];
        full.extend(args.iter().map(|s| s.as_str()));
        self.wg(&full);
        for net in &peer.allowed_ips {
            if net.ends_with("/0") {
                continue;
            }
            let fam = if net.contains(':') { "-6" } else { "-4" };
            self.ns_exec(&["ip", fam, "route", "replace", net, "dev", &self.name]);
        }
    }

    /// `wg set NAME peer KEY remove`.
    pub fn remove_peer(&self, public_key: &str) {
        self.wg(&["set", &self.name, "peer", public_key, "remove"]);
    }

    pub fn dump(&self) -> WgDump {
        wg_dump(&self.name)
    }

    /// Daemon output so far (stdout and stderr).
    pub fn logs(&self) -> String {
        format!("{}{}", self.proc.stdout(), self.proc.stderr())
    }

    /// SIGTERM and wait for the exit status.
    pub fn sigterm(&mut self) -> ExitStatus {
        self.proc.sigterm(Duration::from_secs(10))
    }

    /// SIGKILL (leaves the socket file behind, as a crash would).
    pub fn kill9(&mut self) -> ExitStatus {
        self.proc.kill9()
    }
}

impl Drop for WgGo {
    fn drop(&mut self) {
        self.proc.stop_quietly(Duration::from_secs(3));
        let _ = fs::remove_file(wg_socket(&self.name));
    }
}

// ---------------------------------------------------------------------------------------------
// tunnelgate
// ---------------------------------------------------------------------------------------------

/// The daemon binary under test.
pub fn tunnelgate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_tunnelgate")
}

/// Runs `tunnelgate ARGS` (root namespace) with optional stdin and returns its output.
pub fn tunnelgate_cli(args: &[&str], stdin: Option<&str>) -> CmdOutput {
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(args);
    output_of(cmd, stdin)
}

/// What the harness writes into a tunnelgate configuration file.
#[derive(Debug, Clone)]
pub struct TgConfig {
    /// `interface.name` (unique by default).
    pub name: String,
    pub key: Keypair,
    /// 0 = random.
    pub listen_port: u16,
    pub addresses: Vec<String>,
    pub mtu: Option<u32>,
    pub peers: Vec<Peer>,
    /// `health.listen`; `None` writes `listen = ""` (disabled). Default `127.0.0.1:9002` (namespace
    /// local, so no clash). When set, readiness also waits for `GET /readyz` = 200.
    pub health: Option<String>,
    /// Raw TOML appended verbatim (`[firewall]`, `[[ingress]]`, `[router]`, ...).
    pub extra: String,
    /// `interface.workers`; `None` leaves it to the daemon (the CPUs it may use).
    pub workers: Option<u16>,
}

impl TgConfig {
    /// A configuration with a unique interface name and a fresh key.
    pub fn new(listen_port: u16, addresses: &[&str]) -> TgConfig {
        TgConfig {
            name: unique_name("tgd"),
            key: Keypair::generate(),
            listen_port,
            addresses: addresses.iter().map(|s| s.to_string()).collect(),
            mtu: None,
            peers: vec![],
            health: Some("127.0.0.1:9002".into()),
            extra: String::new(),
            workers: None,
        }
    }

    pub fn peer(mut self, peer: Peer) -> TgConfig {
        self.peers.push(peer);
        self
    }

    pub fn public_key(&self) -> &str {
        &self.key.public
    }

    /// The health endpoint address, if enabled.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health.as_deref().and_then(|h| h.parse().ok())
    }

    /// The TOML text, with the private key read from `private_key_file`.
    pub fn render(&self, private_key_file: &str) -> String {
        let q = |v: &[String]| {
            v.iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut t = String::new();
        let _ = writeln!(t, "[interface]");
        let _ = writeln!(t, "name = {:?}", self.name);
        let _ = writeln!(t, "private_key_file = {private_key_file:?}");
        let _ = writeln!(t, "listen_port = {}", self.listen_port);
        let _ = writeln!(t, "addresses = [{}]", q(&self.addresses));
        if let Some(mtu) = self.mtu {
            let _ = writeln!(t, "mtu = {mtu}");
        }
        if let Some(workers) = self.workers {
            let _ = writeln!(t, "workers = {workers}");
        }
        for p in &self.peers {
            let _ = writeln!(t, "\n[[peer]]");
            let _ = writeln!(t, "public_key = {:?}", p.public_key);
            if let Some(name) = &p.name {
                let _ = writeln!(t, "name = {name:?}");
            }
            if let Some(psk) = &p.preshared_key {
                let _ = writeln!(t, "preshared_key = {psk:?}");
            }
            if let Some(ep) = &p.endpoint {
                let _ = writeln!(t, "endpoint = {ep:?}");
            }
            let _ = writeln!(t, "allowed_ips = [{}]", q(&p.allowed_ips));
            if let Some(k) = p.keepalive {
                let _ = writeln!(t, "persistent_keepalive = {k}");
            }
        }
        let _ = writeln!(t, "\n[health]");
        let _ = writeln!(
            t,
            "listen = {:?}",
            self.health.as_deref().unwrap_or_default()
        );
        if !self.extra.is_empty() {
            let _ = writeln!(t, "\n{}", self.extra);
        }
        t
    }
}

/// A tunnelgate daemon (`tunnelgate run --config FILE`) in a namespace. Its config and key file
/// (0600) live in its own temp dir, with its stdout/stderr. Dropping it stops the daemon (SIGTERM,
/// then SIGKILL) and removes a socket it left behind.
#[derive(Debug)]
pub struct Tunnelgate {
    ns: String,
    pub cfg: TgConfig,
    dir: TempDir,
    config_path: PathBuf,
    proc: Proc,
}

impl Tunnelgate {
    /// Writes the config, starts the daemon and waits (10 s) until it is ready; panics with its
    /// stderr if it is not.
    pub fn start(ns: &Netns, cfg: TgConfig) -> Tunnelgate {
        let tg = Tunnelgate::spawn(ns, cfg);
        if let Err(e) = tg.wait_ready(Duration::from_secs(10)) {
            panic!("{e}");
        }
        tg
    }

    /// Writes the config and starts the daemon without waiting.
    pub fn spawn(ns: &Netns, cfg: TgConfig) -> Tunnelgate {
        Tunnelgate::spawn_env(ns, cfg, &[])
    }

    /// [`Tunnelgate::spawn`] with extra environment variables (e.g. `RUST_LOG`).
    pub fn spawn_env(ns: &Netns, cfg: TgConfig, env: &[(&str, &str)]) -> Tunnelgate {
        let dir = TempDir::new(&cfg.name);
        dir.write_secret("private.key", &format!("{}\n", cfg.key.private));
        let config_path = dir.write("tunnelgate.toml", &cfg.render("private.key"));
        let mut cmd = ns.command(&[
            tunnelgate_bin(),
            "run",
            "--config",
            &config_path.display().to_string(),
        ]);
        cmd.env("RUST_BACKTRACE", "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(cmd, "tunnelgate", dir.path());
        Tunnelgate {
            ns: ns.name.clone(),
            cfg,
            dir,
            config_path,
            proc,
        }
    }

    /// Waits until the TUN device is up, the UAPI socket exists and (if health is enabled)
    /// `GET /readyz` answers 200. `Err` (with the daemon's stderr) on exit or timeout.
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let deadline = clock::now() + timeout;
        let sock = wg_socket(&self.cfg.name);
        let ns = NsRef(&self.ns);
        let mut last = String::from("nothing checked yet");
        loop {
            // A Proc needs &mut to reap; peek at /proc instead (a zombie counts as exited).
            if !pid_running(self.proc.pid()) {
                return Err(format!(
                    "tunnelgate {} exited before it was ready ({last}); stderr:\n{}\nstdout:\n{}",
                    self.cfg.name,
                    self.stderr(),
                    self.stdout()
                ));
            }
            let ready = if !ns.link_is_up(&self.cfg.name) {
                last = format!("TUN device {} not up", self.cfg.name);
                false
            } else if !sock.exists() {
                last = format!("no socket {}", sock.display());
                false
            } else if let Some(addr) = self.cfg.health_addr() {
                match http_get_in(&self.ns, addr, "/readyz", Duration::from_secs(1)) {
                    Ok((200, _)) => true,
                    Ok((code, body)) => {
                        last = format!("/readyz answered {code}: {}", body.trim());
                        false
                    }
                    Err(e) => {
                        last = format!("/readyz: {e}");
                        false
                    }
                }
            } else {
                true
            };
            if ready {
                return Ok(());
            }
            if clock::now() >= deadline {
                return Err(format!(
                    "tunnelgate {} not ready after {timeout:?} ({last}); stderr:\n{}\nstdout:\n{}",
                    self.cfg.name,
                    self.stderr(),
                    self.stdout()
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    pub fn public_key(&self) -> &str {
        &self.cfg.key.public
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The daemon's temp dir (config, key, logs).
    pub fn dir(&self) -> &TempDir {
        &self.dir
    }

    /// Rewrites the config file in place (not atomically; use [`TempDir::write`] + rename for that).
    pub fn write_config(&mut self, cfg: TgConfig) {
        self.dir
            .write("tunnelgate.toml", &cfg.render("private.key"));
        self.cfg = cfg;
    }

    /// Writes arbitrary text as the config file.
    pub fn write_config_text(&self, text: &str) {
        self.dir.write("tunnelgate.toml", text);
    }

    pub fn sighup(&mut self) {
        self.proc.signal(Signal::SIGHUP);
    }

    /// SIGTERM and wait (10 s) for the exit status.
    pub fn sigterm(&mut self) -> ExitStatus {
        self.proc.sigterm(Duration::from_secs(10))
    }

    /// [`Tunnelgate::sigterm`], waiting up to `timeout` for the exit.
    pub fn sigterm_within(&mut self, timeout: Duration) -> ExitStatus {
        self.proc.sigterm(timeout)
    }

    /// SIGKILL and reap (leaves behind whatever a crash would).
    pub fn kill9(&mut self) -> ExitStatus {
        self.proc.kill9()
    }

    pub fn is_running(&mut self) -> bool {
        self.proc.is_running()
    }

    /// Waits up to `timeout` for the daemon to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.proc.wait_timeout(timeout)
    }

    pub fn stderr(&self) -> String {
        self.proc.stderr()
    }

    pub fn stdout(&self) -> String {
        self.proc.stdout()
    }

    /// `wg show NAME dump` against the daemon's UAPI socket.
    pub fn dump(&self) -> WgDump {
        wg_dump(&self.cfg.name)
    }

    /// `GET path` on the health endpoint (inside the namespace).
    pub fn health_get(&self, path: &str) -> Result<(u16, String), String> {
        let addr = self
            .cfg
            .health_addr()
            .ok_or("health is disabled in this config")?;
        http_get_in(&self.ns, addr, path, Duration::from_secs(2))
    }
}

impl Drop for Tunnelgate {
    fn drop(&mut self) {
        self.proc.stop_quietly(Duration::from_secs(5));
        let _ = fs::remove_file(wg_socket(&self.cfg.name));
        // Every suite runs the daemon under the packet threads' seccomp filter: a call missing
        // from its list kills the daemon with SIGSYS, maybe only on the way out, where the
        // test itself may not look. That must fail the test.
        use std::os::unix::process::ExitStatusExt;
        let sigsys = self.proc.status.and_then(|s| s.signal()) == Some(libc::SIGSYS);
        if sigsys && !std::thread::panicking() {
            panic!(
                "{} was killed by its seccomp filter (SIGSYS): a packet thread made a call \
                 that is not on the list (dmesg: type=1326 names it); stderr:\n{}",
                self.proc.label,
                self.proc.stderr()
            );
        }
    }
}

/// Whether `pid` runs and is not a zombie.
fn pid_running(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// A borrowed namespace name, for helpers that only need to run commands in it.
struct NsRef<'a>(&'a str);

impl NsRef<'_> {
    fn link_is_up(&self, dev: &str) -> bool {
        let mut cmd = Command::new("ip");
        cmd.args(["-n", self.0, "-o", "link", "show", "dev", dev]);
        let out = output_of(cmd, None);
        out.success()
            && out
                .stdout
                .split_once('<')
                .and_then(|(_, r)| r.split_once('>'))
                .is_some_and(|(flags, _)| flags.split(',').any(|f| f == "UP"))
    }
}

// ---------------------------------------------------------------------------------------------
// Traffic
// ---------------------------------------------------------------------------------------------

/// One ping (1 s timeout) from `ns` to `addr` (v4 or v6).
pub fn ping(ns: &Netns, addr: &str) -> bool {
    ns.output(&["ping", "-n", "-q", "-c", "1", "-W", "1", addr])
        .success()
}

/// Pings until one answers or `timeout` passes.
pub fn ping_until(ns: &Netns, addr: &str, timeout: Duration) -> bool {
    poll_until(timeout, || ping(ns, addr))
}

/// `GET path` over HTTP/1.1 to `addr` from inside namespace `ns_name`: (status, body).
pub fn http_get_in(
    ns_name: &str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let nspath = PathBuf::from(format!("/var/run/netns/{ns_name}"));
    let path = path.to_string();
    std::thread::spawn(move || {
        enter_ns(&nspath);
        http_get(addr, &path, timeout)
    })
    .join()
    .map_err(|_| "http_get thread panicked".to_string())?
}

/// `GET path` from inside `ns`: (status, body).
pub fn http_get_ns(ns: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    http_get_in(&ns.name, addr, path, Duration::from_secs(2))
}

/// A plain HTTP/1.1 GET from the calling thread's namespace.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    // One write: a server that reads the request once must see all of it.
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("{addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}: no HTTP header in {text:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr}: bad status line in {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    Ok((code, if chunked { dechunk(body) } else { body.into() }))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The deterministic pseudo-random byte stream the transfer helpers send (splitmix64, little endian).
pub struct PrngStream {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl PrngStream {
    pub fn new(seed: u64) -> PrngStream {
        PrngStream {
            state: seed,
            word: [0; 8],
            used: 8,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fills `out` with the next bytes of the stream.
    pub fn fill(&mut self, out: &mut [u8]) {
        let mut i = 0;
        while i < out.len() && self.used < 8 {
            out[i] = self.word[self.used];
            self.used += 1;
            i += 1;
        }
        let mut chunks = out[i..].chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            self.word = self.next_u64().to_le_bytes();
            let n = tail.len();
            tail.copy_from_slice(&self.word[..n]);
            self.used = n;
        }
    }
}

/// A streaming 64-bit checksum (FNV-1a over 8-byte words; independent of how reads split the
/// stream).
pub struct Checksum {
    h: u64,
    pending: [u8; 8],
    n: usize,
}

impl Default for Checksum {
    fn default() -> Self {
        Checksum {
            h: 0xcbf2_9ce4_8422_2325,
            pending: [0; 8],
            n: 0,
        }
    }
}

impl Checksum {
    fn mix(&mut self, w: u64) {
        self.h = (self.h ^ w).wrapping_mul(0x0000_0100_0000_01B3);
    }

    pub fn update(&mut self, mut data: &[u8]) {
        while self.n > 0 && !data.is_empty() {
            self.pending[self.n] = data[0];
            self.n = (self.n + 1) % 8;
            data = &data[1..];
            if self.n == 0 {
                let w = u64::from_le_bytes(self.pending);
                self.mix(w);
            }
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            self.mix(u64::from_le_bytes(b));
        }
        for &b in chunks.remainder() {
            self.pending[self.n] = b;
            self.n += 1;
        }
    }

    pub fn finish(mut self) -> u64 {
        let n = self.n as u64;
        for i in self.n..8 {
            self.pending[i] = 0;
        }
        if self.n > 0 {
            let w = u64::from_le_bytes(self.pending);
            self.mix(w);
        }
        self.mix(n);
        self.h
    }
}

/// What a TCP transfer moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    pub bytes: u64,
    pub checksum: u64,
    pub secs: f64,
}

impl TransferStats {
    pub fn mbit_per_s(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e6 / self.secs.max(1e-9)
    }
}

/// Sends `bytes` of the seeded pseudo-random stream over TCP from namespace `src` to a listener on
/// `dst_addr:port` in `dst` (port 0 = any), and checks that exactly those bytes arrived, in order
/// (compared byte for byte and by checksum). `Err` says what went wrong (refused, timeout, short,
/// first differing offset). `timeout` bounds the whole transfer.
pub fn tcp_transfer(
    src: &Netns,
    dst: &Netns,
    dst_addr: IpAddr,
    port: u16,
    bytes: u64,
    timeout: Duration,
) -> Result<TransferStats, String> {
    let addr = SocketAddr::new(dst_addr, port);
    tcp_transfer_via(
        src,
        dst,
        addr,
        addr,
        TransferDir::ClientToServer,
        bytes,
        timeout,
    )
    .map(|(stats, _)| stats)
}

/// The background thread of a test server: runs until its owner is dropped, and keeps what the
/// server records about each client.
struct ServerThread<T> {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<T>>>,
    handle: Option<JoinHandle<()>>,
}

impl<T: Clone + Send + 'static> ServerThread<T> {
    /// Runs `serve(stop, seen)` on a new thread; `serve` returns once `stop` is set.
    fn spawn(serve: impl FnOnce(&AtomicBool, &Mutex<Vec<T>>) + Send + 'static) -> ServerThread<T> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let handle = std::thread::spawn(move || serve(&stop2, &seen2));
        ServerThread {
            stop,
            seen,
            handle: Some(handle),
        }
    }

    fn seen(&self) -> Vec<T> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// A TCP listener bound inside `ns`, non-blocking so a server loop can check its stop flag.
fn nonblocking_listener(ns: &Netns, bind: SocketAddr, what: &str) -> (TcpListener, SocketAddr) {
    let l = ns
        .in_ns(|| TcpListener::bind(bind))
        .unwrap_or_else(|e| panic!("{what}: bind {bind} in {}: {e}", ns.name));
    let addr = l.local_addr().expect("listener local addr");
    l.set_nonblocking(true).expect("listener nonblocking");
    (l, addr)
}

fn record<T>(seen: &Mutex<Vec<T>>, item: T) {
    if let Ok(mut s) = seen.lock() {
        s.push(item);
    }
}

impl<T> Drop for ServerThread<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A UDP echo server in a namespace: answers every datagram with the same bytes, and records the
/// source addresses it saw. Stopped on drop.
pub struct UdpEcho {
    addr: SocketAddr,
    thread: ServerThread<SocketAddr>,
}

impl UdpEcho {
    /// Binds `bind` (port 0 = any) inside `ns`.
    pub fn start(ns: &Netns, bind: SocketAddr) -> UdpEcho {
        let sock = ns
            .in_ns(|| UdpSocket::bind(bind))
            .unwrap_or_else(|e| panic!("udp echo: bind {bind} in {}: {e}", ns.name));
        let addr = sock.local_addr().expect("udp echo local addr");
        sock.set_read_timeout(Some(POLL))
            .expect("udp echo read timeout");
        let thread = ServerThread::spawn(move |stop, seen| {
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    record(seen, from);
                    let _ = sock.send_to(&buf[..n], from);
                }
            }
        });
        UdpEcho { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Distinct source addresses seen so far, in order of first appearance.
    pub fn seen(&self) -> Vec<SocketAddr> {
        let all = self.thread.seen();
        let mut uniq = HashSet::new();
        all.into_iter().filter(|a| uniq.insert(*a)).collect()
    }
}

/// Sends `payload` from `ns` to `to` over UDP and returns the first reply within `timeout`
/// (retrying the send every 200 ms), or `None`.
pub fn udp_roundtrip(
    ns: &Netns,
    to: SocketAddr,
    payload: &[u8],
    timeout: Duration,
) -> Option<Vec<u8>> {
    ns.in_ns(|| {
        let bind: SocketAddr = if to.is_ipv4() {
            "0.0.0.0:0".parse().ok()?
        } else {
            "[::]:0".parse().ok()?
        };
        let s = UdpSocket::bind(bind).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(200))).ok()?;
        let deadline = clock::now() + timeout;
        let mut buf = vec![0u8; 65536];
        while clock::now() < deadline {
            let _ = s.send_to(payload, to);
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                if from == to {
                    return Some(buf[..n].to_vec());
                }
            }
        }
        None
    })
}

/// A TCP echo server in a namespace (a thread per connection), recording client addresses.
/// Stopped on drop.
pub struct TcpEcho {
    addr: SocketAddr,
    thread: ServerThread<SocketAddr>,
}

impl TcpEcho {
    pub fn start(ns: &Netns, bind: SocketAddr) -> TcpEcho {
        let (l, addr) = nonblocking_listener(ns, bind, "tcp echo");
        let thread = ServerThread::spawn(move |stop, seen| {
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, from)) => {
                        record(seen, from);
                        std::thread::spawn(move || {
                            let _ = c.set_nonblocking(false);
                            let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = c.read(&mut buf) {
                                if n == 0 || c.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        TcpEcho { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Client addresses seen so far (one per connection).
    pub fn seen(&self) -> Vec<SocketAddr> {
        self.thread.seen()
    }
}

/// Connects from `ns` to `to`, sends `payload`, half-closes, and returns everything read back.
pub fn tcp_roundtrip(
    ns: &Netns,
    to: SocketAddr,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    ns.in_ns(|| {
        let mut s = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("{to}: {e}"))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        s.write_all(payload).map_err(|e| format!("{to}: {e}"))?;
        s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).map_err(|e| format!("{to}: {e}"))?;
        Ok(out)
    })
}

// ---------------------------------------------------------------------------------------------
// /proc
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Transfers through a translating middlebox (DNAT: the address dialled is not the one bound)
// ---------------------------------------------------------------------------------------------

/// Which end of a [`tcp_transfer_via`] connection sends the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferDir {
    /// The connecting side sends (an upload to the server).
    ClientToServer,
    /// The accepting side sends (a download from the server).
    ServerToClient,
}

/// What one end of a [`tcp_transfer_via`] did: the checksum it sent, or (bytes, checksum) it
/// received.
struct TransferSide {
    sent: Option<u64>,
    received: Option<(u64, u64)>,
}

/// A TCP transfer where the listener binds `listen` in `server` while the client in `client`
/// dials `connect` (e.g. a proxy address DNATed to `listen`; port 0 = the listener's port),
/// and `dir` chooses which end sends. Sends `bytes` of the seeded stream and checks every byte and the checksum on the
/// receiving end. Returns the stats and the peer address the server saw.
pub fn tcp_transfer_via(
    client: &Netns,
    server: &Netns,
    listen: SocketAddr,
    connect: SocketAddr,
    dir: TransferDir,
    bytes: u64,
    timeout: Duration,
) -> Result<(TransferStats, SocketAddr), String> {
    const SEED: u64 = 0x7475_6e6e_656c_6761; // "tunnelga"
    const CHUNK: usize = 64 * 1024;
    let deadline = clock::now() + timeout;
    let io_timeout = timeout.min(Duration::from_secs(10));

    fn send(s: &mut TcpStream, bytes: u64) -> Result<u64, String> {
        let mut gen = PrngStream::new(SEED);
        let mut sum = Checksum::default();
        let mut buf = vec![0u8; CHUNK];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            gen.fill(&mut buf[..n]);
            s.write_all(&buf[..n])
                .map_err(|e| format!("sender: write after {} bytes: {e}", bytes - left))?;
            sum.update(&buf[..n]);
            left -= n as u64;
        }
        s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
        Ok(sum.finish())
    }
    fn receive(s: &mut TcpStream, bytes: u64, deadline: Instant) -> Result<(u64, u64), String> {
        let mut expect = PrngStream::new(SEED);
        let mut sum = Checksum::default();
        let mut buf = vec![0u8; CHUNK];
        let mut want = vec![0u8; CHUNK];
        let mut got: u64 = 0;
        loop {
            if clock::now() >= deadline {
                return Err(format!("receiver: only {got} of {bytes} bytes in time"));
            }
            let n = match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => return Err(format!("receiver: read after {got} bytes: {e}")),
            };
            expect.fill(&mut want[..n]);
            if buf[..n] != want[..n] {
                let i = (0..n).find(|&i| buf[i] != want[i]).unwrap_or(0);
                return Err(format!(
                    "receiver: data differs at offset {}",
                    got + i as u64
                ));
            }
            sum.update(&buf[..n]);
            got += n as u64;
        }
        Ok((got, sum.finish()))
    }

    let listener = server
        .in_ns(|| TcpListener::bind(listen))
        .map_err(|e| format!("bind {listen} in {}: {e}", server.name))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    // Port 0 in `connect` means the port the listener was given (`listen` port 0 = any).
    let connect = match listener.local_addr() {
        Ok(bound) if connect.port() == 0 => SocketAddr::new(connect.ip(), bound.port()),
        _ => connect,
    };
    let accepted = std::thread::spawn(move || -> Result<(SocketAddr, TransferSide), String> {
        let (mut conn, from) = loop {
            match listener.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if clock::now() >= deadline {
                        return Err(format!("no connection to {listen} within {timeout:?}"));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(format!("accept on {listen}: {e}")),
            }
        };
        conn.set_nonblocking(false).map_err(|e| e.to_string())?;
        conn.set_read_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        conn.set_write_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        match dir {
            TransferDir::ClientToServer => Ok((
                from,
                TransferSide {
                    sent: None,
                    received: Some(receive(&mut conn, bytes, deadline)?),
                },
            )),
            TransferDir::ServerToClient => {
                let sum = send(&mut conn, bytes)?;
                // Wait for the client's EOF so the data is not cut by our close.
                let mut rest = [0u8; 1];
                let _ = conn.read(&mut rest);
                Ok((
                    from,
                    TransferSide {
                        sent: Some(sum),
                        received: None,
                    },
                ))
            }
        }
    });

    let start = clock::now();
    let client_side = client.in_ns(|| -> Result<TransferSide, String> {
        let mut s = TcpStream::connect_timeout(&connect, io_timeout)
            .map_err(|e| format!("client: connect {connect} from {}: {e}", client.name))?;
        s.set_read_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        match dir {
            TransferDir::ClientToServer => Ok(TransferSide {
                sent: Some(send(&mut s, bytes)?),
                received: None,
            }),
            TransferDir::ServerToClient => {
                let r = receive(&mut s, bytes, deadline)?;
                let _ = s.shutdown(Shutdown::Write);
                Ok(TransferSide {
                    sent: None,
                    received: Some(r),
                })
            }
        }
    });
    let server_side = accepted
        .join()
        .map_err(|_| "server thread panicked".to_string())?;
    let secs = start.elapsed().as_secs_f64();
    let c = client_side?;
    let (from, s) = server_side?;
    let (sent, (got, got_sum)) = match (c.sent.or(s.sent), s.received.or(c.received)) {
        (Some(s), Some(r)) => (s, r),
        _ => return Err("transfer: a side did not report".into()),
    };
    if got != bytes {
        return Err(format!("sent {bytes} bytes, received {got}"));
    }
    if got_sum != sent {
        return Err(format!(
            "checksum differs: sent {sent:016x}, received {got_sum:016x}"
        ));
    }
    Ok((
        TransferStats {
            bytes,
            checksum: got_sum,
            secs,
        },
        from,
    ))
}

// ---------------------------------------------------------------------------------------------
// DNS: a dnsmasq name server and a minimal DNS client
// ---------------------------------------------------------------------------------------------

/// DNS record type A.
pub const QTYPE_A: u16 = 1;
/// DNS record type AAAA.
pub const QTYPE_AAAA: u16 = 28;

/// A dnsmasq in a namespace, answering for `*.DOMAIN` from a hosts file only (`--local=/DOMAIN/`:
/// a name missing from the file is NXDOMAIN, never forwarded). Runs as root (so it can read its
/// files), in the foreground, logging every query to its stderr. Stopped on drop.
pub struct Dnsmasq {
    ns_name: String,
    listen: IpAddr,
    domain: String,
    dir: TempDir,
    proc: Option<Proc>,
    /// Log files of earlier runs (stopped and started again).
    old_logs: Vec<String>,
}

impl Dnsmasq {
    /// Starts dnsmasq on `listen`:53 (the address must already be on an interface of `ns`)
    /// serving `hosts` (hosts-file lines) for `domain`, and waits until it answers.
    pub fn start(ns: &Netns, listen: IpAddr, domain: &str, hosts: &str) -> Dnsmasq {
        let dir = TempDir::new(&format!("dnsmasq-{}", ns.name()));
        dir.write("hosts", hosts);
        let mut d = Dnsmasq {
            ns_name: ns.name().to_string(),
            listen,
            domain: domain.to_string(),
            dir,
            proc: None,
            old_logs: vec![],
        };
        d.start_again();
        d
    }

    /// The `host:53` address clients query.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.listen, 53)
    }

    /// Starts the server again after [`Dnsmasq::stop`] (same address, same hosts file).
    pub fn start_again(&mut self) {
        assert!(self.proc.is_none(), "dnsmasq is already running");
        let hosts = self.dir.path().join("hosts");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns_name, "dnsmasq"]).args([
            "--conf-file=/dev/null".to_string(),
            "--user=root".to_string(),
            "--no-daemon".to_string(),
            "--no-resolv".to_string(),
            "--no-hosts".to_string(),
            "--port=53".to_string(),
            format!("--listen-address={}", self.listen),
            "--bind-interfaces".to_string(),
            format!("--addn-hosts={}", hosts.display()),
            format!("--local=/{}/", self.domain),
            "--log-queries".to_string(),
            "--log-facility=-".to_string(),
        ]);
        let label = format!("dnsmasq-{}", COUNTER.fetch_add(1, Ordering::Relaxed));
        let mut proc = Proc::spawn(cmd, &label, self.dir.path());
        let probe = format!("probe.{}", self.domain);
        let up = poll_until(Duration::from_secs(10), || {
            !proc.is_running() || dns_query_in(&self.ns_name, self.addr(), &probe, QTYPE_A).is_ok()
        });
        if !up || !proc.is_running() {
            let _ = proc.kill9();
            panic!(
                "dnsmasq on {} did not answer (exited: {:?}); stderr:\n{}",
                self.addr(),
                proc.try_wait(),
                proc.stderr()
            );
        }
        self.proc = Some(proc);
    }

    /// SIGTERM and wait: queries go unanswered (ICMP port unreachable) until started again.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.sigterm(Duration::from_secs(5));
            self.old_logs.push(p.stderr());
        }
    }

    /// Replaces the hosts file and tells dnsmasq to re-read it (SIGHUP); returns once a query for
    /// `name` answers `expect` (A and AAAA together, any order).
    pub fn set_hosts(&mut self, hosts: &str, name: &str, expect: &[IpAddr]) {
        self.dir.write("hosts.new", hosts);
        fs::rename(
            self.dir.path().join("hosts.new"),
            self.dir.path().join("hosts"),
        )
        .expect("rename hosts file");
        if let Some(p) = self.proc.as_mut() {
            p.signal(Signal::SIGHUP);
        }
        let mut want: Vec<IpAddr> = expect.to_vec();
        want.sort();
        let mut last = String::new();
        let ok = poll_until(Duration::from_secs(10), || {
            match dns_lookup_in(&self.ns_name, self.addr(), name) {
                Ok(got) if got == want => true,
                Ok(got) => {
                    last = format!("{got:?}");
                    false
                }
                Err(e) => {
                    last = e;
                    false
                }
            }
        });
        assert!(
            ok,
            "dnsmasq does not answer {want:?} for {name} (last: {last}); log:\n{}",
            self.logs()
        );
    }

    /// Everything dnsmasq logged (every run so far).
    pub fn logs(&self) -> String {
        let mut s = self.old_logs.join("");
        if let Some(p) = &self.proc {
            s.push_str(&p.stderr());
        }
        s
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        if let Some(p) = self.proc.as_mut() {
            p.stop_quietly(Duration::from_secs(3));
        }
    }
}

/// One DNS answer: the response code (0 NOERROR, 3 NXDOMAIN, ...) and the A/AAAA addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsAnswer {
    pub rcode: u8,
    pub addrs: Vec<IpAddr>,
}

/// Asks `server` (UDP, 2 s) for `name`/`qtype` from inside namespace `ns_name`.
pub fn dns_query_in(
    ns_name: &str,
    server: SocketAddr,
    name: &str,
    qtype: u16,
) -> Result<DnsAnswer, String> {
    let nspath = PathBuf::from(format!("/var/run/netns/{ns_name}"));
    let name = name.to_string();
    std::thread::spawn(move || {
        enter_ns(&nspath);
        dns_query(server, &name, qtype)
    })
    .join()
    .map_err(|_| "dns query thread panicked".to_string())?
}

/// A and AAAA of `name`, sorted; `Err` unless both queries answer NOERROR.
pub fn dns_lookup_in(ns_name: &str, server: SocketAddr, name: &str) -> Result<Vec<IpAddr>, String> {
    let mut all = Vec::new();
    for qtype in [QTYPE_A, QTYPE_AAAA] {
        let a = dns_query_in(ns_name, server, name, qtype)?;
        if a.rcode != 0 {
            return Err(format!("{name} type {qtype}: rcode {}", a.rcode));
        }
        all.extend(a.addrs);
    }
    all.sort();
    Ok(all)
}

/// A minimal DNS client over UDP from the calling thread's namespace.
pub fn dns_query(server: SocketAddr, name: &str, qtype: u16) -> Result<DnsAnswer, String> {
    let id: u16 = (std::process::id() as u16) ^ (COUNTER.fetch_add(1, Ordering::Relaxed) as u16);
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes()); // IN
    let bind: SocketAddr = if server.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    s.send_to(&q, server)
        .map_err(|e| format!("{server}: {e}"))?;
    let mut buf = [0u8; 4096];
    let n = loop {
        let (n, from) = s
            .recv_from(&mut buf)
            .map_err(|e| format!("{server}: {e}"))?;
        if from == server && n >= 12 && buf[..2] == id.to_be_bytes() {
            break n;
        }
    };
    parse_dns_answer(&buf[..n])
}

fn parse_dns_answer(m: &[u8]) -> Result<DnsAnswer, String> {
    let short = || "short DNS message".to_string();
    let u16_at = |i: usize| -> Result<u16, String> {
        Ok(u16::from_be_bytes([
            *m.get(i).ok_or_else(short)?,
            *m.get(i + 1).ok_or_else(short)?,
        ]))
    };
    // Skips a (possibly compressed) name starting at i; returns the offset after it.
    let skip_name = |mut i: usize| -> Result<usize, String> {
        loop {
            let len = *m.get(i).ok_or_else(short)?;
            if len & 0xc0 == 0xc0 {
                return Ok(i + 2);
            }
            if len == 0 {
                return Ok(i + 1);
            }
            i += 1 + len as usize;
        }
    };
    let rcode = m.get(3).ok_or_else(short)? & 0x0f;
    let qd = u16_at(4)?;
    let an = u16_at(6)?;
    let mut i = 12;
    for _ in 0..qd {
        i = skip_name(i)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        i = skip_name(i)?;
        let rtype = u16_at(i)?;
        let rdlen = u16_at(i + 8)? as usize;
        let data = m.get(i + 10..i + 10 + rdlen).ok_or_else(short)?;
        match (rtype, rdlen) {
            (QTYPE_A, 4) => addrs.push(IpAddr::from(
                <[u8; 4]>::try_from(data).map_err(|_| short())?,
            )),
            (QTYPE_AAAA, 16) => addrs.push(IpAddr::from(
                <[u8; 16]>::try_from(data).map_err(|_| short())?,
            )),
            _ => {}
        }
        i += 10 + rdlen;
    }
    Ok(DnsAnswer { rcode, addrs })
}

// ---------------------------------------------------------------------------------------------
// "Who am I" TCP server: tells each client which address it reached and which address it saw
// ---------------------------------------------------------------------------------------------

/// A TCP server in a namespace that answers every connection with one line, `LOCAL PEER\n`
/// (the address the client reached, the source address the server saw; IPv4-mapped addresses
/// shown as IPv4), then closes. Bind `[::]:PORT` to serve every address of both families.
/// Records what it saw; stopped on drop.
pub struct TcpWhoami {
    addr: SocketAddr,
    thread: ServerThread<(SocketAddr, SocketAddr)>,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl TcpWhoami {
    pub fn start(ns: &Netns, bind: SocketAddr) -> TcpWhoami {
        let (l, addr) = nonblocking_listener(ns, bind, "whoami");
        let thread = ServerThread::spawn(move |stop, seen| {
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, peer)) => {
                        let local = c.local_addr().map(canonical).unwrap_or(addr);
                        let peer = canonical(peer);
                        record(seen, (local, peer));
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
                        let _ = c.write_all(format!("{local} {peer}\n").as_bytes());
                        let _ = c.shutdown(Shutdown::Both);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        TcpWhoami { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// (local, peer) of every connection so far.
    pub fn seen(&self) -> Vec<(SocketAddr, SocketAddr)> {
        self.thread.seen()
    }
}

/// Connects from `ns` to a [`TcpWhoami`] (possibly through NAT) at `to`: (the address the
/// server was reached at, the source address it saw).
pub fn whoami(
    ns: &Netns,
    to: SocketAddr,
    timeout: Duration,
) -> Result<(SocketAddr, SocketAddr), String> {
    let line = ns.in_ns(|| -> Result<String, String> {
        let mut s = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("{to}: {e}"))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let mut out = String::new();
        s.read_to_string(&mut out)
            .map_err(|e| format!("{to}: {e}"))?;
        Ok(out)
    })?;
    let mut parts = line.split_whitespace().map(|p| p.parse::<SocketAddr>());
    match (parts.next(), parts.next()) {
        (Some(Ok(local)), Some(Ok(peer))) => Ok((local, peer)),
        _ => Err(format!("{to}: unexpected answer {line:?}")),
    }
}

// ---------------------------------------------------------------------------------------------
// tunnelgate status, metrics, installed rules
// ---------------------------------------------------------------------------------------------

/// `tunnelgate status --json --interface IFACE` of a running daemon, parsed.
pub fn tunnelgate_status_json(iface: &str) -> Result<serde_json::Value, String> {
    let out = tunnelgate_cli(&["status", "--json", "--interface", iface], None);
    if !out.success() {
        return Err(format!(
            "tunnelgate status --interface {iface} failed ({:?}): {}",
            out.code,
            out.stderr.trim()
        ));
    }
    serde_json::from_str(&out.stdout).map_err(|e| format!("status JSON: {e}: {}", out.stdout))
}

/// One Prometheus sample line, parsed.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

// The one Prometheus text parser of the suites: `metric`/`metric_sum` read samples with it, and
// `netns_ops` builds its strict whole-exposition check (families, types, order) on it.

pub fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A sample value: a Go-style float (`1`, `-2.5e3`, `+Inf`, `-Inf`, `NaN`).
fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        // Rust also accepts "inf", "infinity" and "nan" in any case: the format does not.
        _ if v
            .chars()
            .any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E') =>
        {
            Err(format!("bad value {v:?}"))
        }
        _ => v.parse().map_err(|_| format!("bad value {v:?}")),
    }
}

/// `name{k="v",...} value [timestamp]`.
pub fn parse_sample_line(line: &str) -> Result<Sample, String> {
    let end = line.find(['{', ' ']).ok_or("no value")?;
    let (name, mut rest) = line.split_at(end);
    if !valid_metric_name(name) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.chars();
        loop {
            let remaining = chars.as_str();
            if let Some(after) = remaining.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = remaining.find('=').ok_or("label without =")?;
            let key = &remaining[..eq];
            if !valid_label_name(key) {
                return Err(format!("bad label name {key:?}"));
            }
            chars = remaining[eq + 1..]
                .strip_prefix('"')
                .ok_or_else(|| format!("label {key} is not quoted"))?
                .chars();
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")? {
                    '"' => break,
                    '\\' => match chars.next().ok_or("dangling escape")? {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        c => return Err(format!("bad escape \\{c}")),
                    },
                    '\n' => return Err("raw newline in a label value".into()),
                    c => value.push(c),
                }
            }
            if labels.insert(key.to_string(), value).is_some() {
                return Err(format!("label {key} given twice"));
            }
            let after = chars.as_str();
            if let Some(more) = after.strip_prefix(',') {
                chars = more.chars();
            } else if !after.starts_with('}') {
                return Err("expected , or } after a label".into());
            }
        }
    }
    let rest = rest
        .strip_prefix(' ')
        .ok_or("no single space before the value")?;
    let mut fields = rest.split(' ');
    let value = parse_value(fields.next().unwrap_or(""))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("bad timestamp {ts:?}"))?;
    }
    if fields.next().is_some() {
        return Err("trailing fields".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The samples of an exposition, comments and lines that do not parse skipped.
fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| parse_sample_line(l).ok())
}

/// The value of one Prometheus sample: `name` with exactly `labels` as the daemon writes them
/// (e.g. `name="a.b"`; "" for none) in exposition text.
/// (Every series also has the daemon's `interface="..."` label first; `labels` leaves it out.)
pub fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    let want = parse_sample_line(&format!("x{{{labels}}} 0"))
        .unwrap_or_else(|e| panic!("bad label text {labels:?}: {e}"))
        .labels;
    samples(text)
        .find(|s| {
            let mut have = s.labels.clone();
            have.remove("interface");
            s.name == name && have == want
        })
        .map(|s| s.value)
}

/// The sum of every sample of `name`, whatever its labels (0 when there is none).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    samples(text)
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

impl Tunnelgate {
    /// `tunnelgate status --json` of this daemon.
    pub fn status_json(&self) -> Result<serde_json::Value, String> {
        tunnelgate_status_json(&self.cfg.name)
    }

    /// The `names[]` entry for `name` in the status, if the daemon lists it.
    pub fn name_status(&self, name: &str) -> Option<serde_json::Value> {
        let s = self.status_json().ok()?;
        s["names"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == name)
            .cloned()
    }

    /// The addresses the status shows for `name` (sorted; empty if not listed).
    pub fn name_addresses(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .name_status(name)
            .and_then(|n| {
                n["addresses"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// `GET /metrics`.
    pub fn metrics(&self) -> Result<String, String> {
        match self.health_get("/metrics")? {
            (200, body) => Ok(body),
            (code, body) => Err(format!("/metrics answered {code}: {body}")),
        }
    }
}

impl Netns {
    /// `nft list table inet tunnelgate_<iface>` for every tunnelgate table in the namespace,
    /// concatenated ("" when there is none). One daemon per namespace: its table.
    pub fn nft_tunnelgate_table(&self) -> String {
        self.nft_tunnelgate_tables()
            .iter()
            .map(|t| {
                self.try_exec(&["nft", "list", "table", "inet", t])
                    .unwrap_or_default()
            })
            .collect()
    }

    /// The names of the `inet` tables of tunnelgate daemons in the namespace
    /// (`tunnelgate_<iface>`), sorted.
    pub fn nft_tunnelgate_tables(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .try_exec(&["nft", "list", "tables", "inet"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("table inet "))
            .filter(|n| n.starts_with("tunnelgate_"))
            .map(str::to_string)
            .collect();
        names.sort();
        names
    }

    /// `nft list table inet tunnelgate_<iface>`: the table of the daemon for `iface` ("" when
    /// it does not exist).
    pub fn nft_table_of(&self, iface: &str) -> String {
        self.try_exec(&[
            "nft",
            "list",
            "table",
            "inet",
            &format!("tunnelgate_{iface}"),
        ])
        .unwrap_or_default()
    }
}

impl Tunnelgate {
    /// [`Tunnelgate::spawn_env`] with extra arguments after `run --config FILE` (e.g.
    /// `--log-format json`).
    pub fn spawn_args_env(
        ns: &Netns,
        cfg: TgConfig,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Tunnelgate {
        let dir = TempDir::new(&cfg.name);
        dir.write_secret("private.key", &format!("{}\n", cfg.key.private));
        let config_path = dir.write("tunnelgate.toml", &cfg.render("private.key"));
        let config_arg = config_path.display().to_string();
        let mut full = vec![tunnelgate_bin(), "run", "--config", &config_arg];
        full.extend_from_slice(args);
        let mut cmd = ns.command(&full);
        cmd.env("RUST_BACKTRACE", "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(cmd, "tunnelgate", dir.path());
        Tunnelgate {
            ns: ns.name.clone(),
            cfg,
            dir,
            config_path,
            proc,
        }
    }
}

/// The packet threads every daemon has (`core::liveness::PacketThread`): the first worker's two
/// readers and the timer thread. More workers add `tg-tun-rx-N` and `tg-udp-rx-N`.
pub const PACKET_THREADS: [&str; 3] = ["tg-tun-rx-0", "tg-udp-rx-0", "tg-timers"];

/// Whether a thread of the daemon is a packet thread (the ones under seccomp), of any worker.
pub fn is_packet_thread(name: &str) -> bool {
    let worker = |prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    worker("tg-tun-rx-") || worker("tg-udp-rx-") || name == "tg-timers"
}

/// [`thread_privileges`] once every packet thread runs under its seccomp filter (or after 5 s):
/// each confines itself when its own setup is done, which may be a moment after the daemon
/// says it is ready or serves UAPI.
pub fn thread_privileges_once_confined(pid: u32) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut threads = thread_privileges(pid);
    poll_until(Duration::from_secs(5), || {
        threads = thread_privileges(pid);
        threads.values().all(|f| {
            let name = f.get("Name").map(String::as_str).unwrap_or_default();
            !is_packet_thread(name) || f.get("Seccomp").map(String::as_str) == Some("2")
        })
    });
    threads
}

/// `Cap*`, `Seccomp*` and `NoNewPrivs` of every thread of `pid`, by thread id.
pub fn thread_privileges(pid: u32) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/<pid>/task");
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        let fields: BTreeMap<String, String> = status
            .lines()
            .filter_map(|l| l.split_once(':'))
            .filter(|(k, _)| {
                k.starts_with("Cap")
                    || k.starts_with("Seccomp")
                    || *k == "NoNewPrivs"
                    || *k == "Name"
            })
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect();
        out.insert(task.file_name().to_string_lossy().into_owned(), fields);
    }
    out
}

/// Whether an nftables listing of our table forwards `port`: a rule matching `dport PORT`, or
/// an element of a DNAT map keyed on that port (`... . PORT comment "..." : target . port`),
/// the form port rules take since they became map elements.
pub fn nft_forwards_port(listing: &str, port: u16) -> bool {
    if listing.contains(&format!("dport {port} ")) {
        return true;
    }
    let key = format!(". {port} ");
    listing.match_indices(&key).any(|(at, _)| {
        let rest = &listing[at + key.len()..];
        let rest = match rest.strip_prefix("comment \"") {
            Some(commented) => commented.split_once('"').map_or("", |(_, after)| after),
            None => rest,
        };
        rest.trim_start().starts_with(':')
    })
}

// ---------------------------------------------------------------------------------------------
// Firewall backends, for suites that run the same body once per backend
// ---------------------------------------------------------------------------------------------

/// The firewall backends a daemon can use (each suite writes its own `[firewall]` section with
/// [`Backend::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    IptablesNft,
    IptablesLegacy,
}

impl Backend {
    /// `firewall.mode` selecting this backend (the iptables flavour comes from [`Backend::env`]).
    pub fn mode(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            _ => "iptables",
        }
    }

    /// The daemon's environment for this backend.
    pub fn env(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Backend::Nftables => vec![],
            Backend::IptablesNft => vec![("TUNNELGATE_IPTABLES", "nft")],
            Backend::IptablesLegacy => vec![("TUNNELGATE_IPTABLES", "legacy")],
        }
    }

    /// The `backend` label of the rule metrics.
    pub fn label(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            Backend::IptablesNft => "iptables",
            Backend::IptablesLegacy => "iptables-legacy",
        }
    }

    pub fn is_iptables(self) -> bool {
        self != Backend::Nftables
    }

    /// `iptables` / `ip6tables` of this flavour.
    pub fn iptables(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy",
            (_, false) => "iptables",
            (_, true) => "ip6tables",
        }
    }

    pub fn iptables_save(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy-save",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy-save",
            (_, false) => "iptables-save",
            (_, true) => "ip6tables-save",
        }
    }

    /// The programs the daemon runs to change rules (what a failing backend means).
    pub fn apply_programs(self) -> &'static [&'static str] {
        match self {
            Backend::Nftables => &["nft"],
            Backend::IptablesNft => &["iptables-restore", "ip6tables-restore"],
            Backend::IptablesLegacy => &["iptables-legacy-restore", "ip6tables-legacy-restore"],
        }
    }

    /// Checks that this machine's tools are what the backend's name promises.
    pub fn check_tools(self) {
        if self == Backend::IptablesNft {
            let v = run(&["iptables", "--version"]);
            assert!(
                v.contains("nf_tables"),
                "`iptables` is not iptables-nft here: {v}"
            );
        }
    }
}

/// Makes one `#[test]` per backend for each named test body `fn NAME(Backend)` of the suite.
#[allow(unused_macros)] // every suite compiles the harness; only some run per backend
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod nftables {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::Nftables) })*
        }
        mod iptables_nft {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesNft) })*
        }
        mod iptables_legacy {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesLegacy) })*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_backend;

/// Receives sd_notify datagrams on a socket the test binds, like systemd does.
pub struct NotifySocket {
    sock: std::os::unix::net::UnixDatagram,
    pub path: PathBuf,
    /// Every datagram received so far, in order.
    pub log: Vec<String>,
}

impl NotifySocket {
    pub fn bind(dir: &TempDir) -> NotifySocket {
        let path = dir.path().join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("read timeout");
        NotifySocket {
            sock,
            path,
            log: vec![],
        }
    }

    /// Waits for a datagram with the line `want` (e.g. `READY=1`); returns the datagram.
    pub fn expect(&mut self, want: &str, timeout: Duration, stderr: impl Fn() -> String) -> String {
        self.wait_for(want, timeout).unwrap_or_else(|| {
            panic!(
                "no {want} within {timeout:?}; received {:?}; daemon stderr:\n{}",
                self.log,
                stderr()
            )
        })
    }

    /// The first datagram with the line `want` within `window`, logging every one read.
    fn wait_for(&mut self, want: &str, window: Duration) -> Option<String> {
        let deadline = clock::now() + window;
        let mut buf = [0u8; 4096];
        while clock::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.log.push(msg.clone());
                if msg.lines().any(|l| l == want) {
                    return Some(msg);
                }
            }
        }
        None
    }
}

impl NotifySocket {
    /// Reads (and logs) what has queued up so far, so what follows is only what comes next.
    pub fn drain(&mut self) {
        let mut buf = [0u8; 4096];
        // Nothing for one read timeout (200 ms): the queue is empty.
        while let Ok(n) = self.sock.recv(&mut buf) {
            self.log
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }

    /// Whether no datagram with the line `want` arrives during `window` (others are logged).
    pub fn quiet(&mut self, want: &str, window: Duration) -> bool {
        self.wait_for(want, window).is_none()
    }
}

impl NotifySocket {
    /// How many datagrams with the line `want` arrive during `window` (all are logged).
    pub fn count(&mut self, want: &str, window: Duration) -> usize {
        let deadline = clock::now() + window;
        let mut buf = [0u8; 4096];
        let mut seen = 0;
        while clock::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                if msg.lines().any(|l| l == want) {
                    seen += 1;
                }
                self.log.push(msg);
            }
        }
        seen
    }
}
