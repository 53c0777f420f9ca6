//! Spawning the tunnelgate daemon under test ([`Tunnelgate`], [`TgConfig`]) and what its threads may do.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;
use tunnelgate::shell::clock;

use nix::sys::signal::Signal;

use super::*;

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
        Tunnelgate::spawn_args_env(ns, cfg, &[], env)
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
        // What a daemon killed with -9 could not remove (its forwarding record goes with its
        // namespace: a later daemon of the namespace may still need it).
        let _ = fs::remove_file(status_socket(&self.cfg.name));
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

/// Whether a thread of the daemon is a packet thread (the ones under seccomp), of any worker:
/// the readers, the timers, the handshake threads of workers past the first (`tg-hs-N`) and
/// the readers' relay partners (`tg-tun-hN-I`, `tg-udp-hN-I`).
pub fn is_packet_thread(name: &str) -> bool {
    let worker = |prefix: &str| name.strip_prefix(prefix).is_some_and(is_number);
    worker("tg-tun-rx-")
        || worker("tg-udp-rx-")
        || worker("tg-hs-")
        || is_relay_partner(name)
        || name == "tg-timers"
}

fn is_number(n: &str) -> bool {
    !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
}

/// A packet reader's relay partner: `tg-tun-hN-I` or `tg-udp-hN-I` (partner I of worker N's
/// reader).
pub fn is_relay_partner(name: &str) -> bool {
    let partner = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|n| n.split_once('-'))
            .is_some_and(|(w, i)| is_number(w) && is_number(i))
    };
    partner("tg-tun-h") || partner("tg-udp-h")
}

/// Capability bits of `/proc/PID/status` (`CapEff:`) that real-time priority depends on.
const CAP_SYS_NICE: u64 = 1 << 23;
const CAP_SYS_RESOURCE: u64 = 1 << 24;

/// Whether a daemon started by this test process can put its packet readers at real-time
/// priority at all: it has `CAP_SYS_NICE`, or can raise `RLIMIT_RTPRIO` (`CAP_SYS_RESOURCE`, or
/// a hard limit of at least 1 already).
pub fn realtime_possible() -> bool {
    let (effective, rtprio_hard) = caps_and_rtprio();
    effective & CAP_SYS_NICE != 0 || realtime_by_limit(effective, rtprio_hard)
}

fn realtime_by_limit(effective: u64, rtprio_hard: u64) -> bool {
    effective & CAP_SYS_RESOURCE != 0 || rtprio_hard >= 1
}

/// This process's effective capabilities and `RLIMIT_RTPRIO` hard limit.
fn caps_and_rtprio() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let rtprio_hard = limits
        .lines()
        .find(|l| l.starts_with("Max realtime priority"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    (effective, rtprio_hard)
}

/// `CAP_SYS_NICE` (bit 23) when a daemon started by this test process keeps it for its packet
/// readers' real-time priority (`core::priority::Access::Capability`): it cannot raise
/// `RLIMIT_RTPRIO` (no `CAP_SYS_RESOURCE`, a hard limit of 0: some sandboxes and containers)
/// but has `CAP_SYS_NICE`. 0 otherwise (a host's root raises the limit instead). Only the
/// packet readers and the thread that starts them (`tg-spawner`) hold it, never in the
/// bounding set: see [`holds_sys_nice`].
pub fn realtime_kept_cap() -> u64 {
    let (effective, rtprio_hard) = caps_and_rtprio();
    if realtime_by_limit(effective, rtprio_hard) {
        0
    } else {
        effective & CAP_SYS_NICE
    }
}

/// Whether a thread of this name may hold `CAP_SYS_NICE` (where [`realtime_kept_cap`] says the
/// daemon keeps it): the packet readers and their spawner.
pub fn holds_sys_nice(thread: &str) -> bool {
    thread == "tg-spawner" || is_packet_reader(thread)
}

/// A packet reader: `tg-tun-rx-N` or `tg-udp-rx-N`.
pub fn is_packet_reader(thread: &str) -> bool {
    thread.starts_with("tg-tun-rx-") || thread.starts_with("tg-udp-rx-")
}

/// `SCHED_FIFO` in `/proc/PID/task/TID/stat`'s policy field.
pub const SCHED_FIFO: u32 = 1;

/// `(thread name, scheduling policy, real-time priority)` of every thread of `pid`, from
/// `/proc/PID/task/TID/stat` (fields 41 and 40; policy 0 normal, 1 `SCHED_FIFO`).
pub fn thread_scheduling(pid: u32) -> Vec<(String, u32, u32)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/<pid>/task");
    tasks
        .flatten()
        .filter_map(|t| {
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // Fields after the command's closing parenthesis start at field 3.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let rt_priority = fields.get(40 - 3)?.parse().ok()?;
            let policy = fields.get(41 - 3)?.parse().ok()?;
            Some((name.trim_end().to_string(), policy, rt_priority))
        })
        .collect()
}

/// [`thread_privileges`] once every packet thread runs under its seccomp filter (or after 5 s):
/// each confines itself when its own setup is done, which may be a moment after the daemon
/// says it is ready or serves UAPI.
pub fn thread_privileges_once_confined(pid: u32) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut threads = thread_privileges(pid);
    poll_until(Duration::from_secs(5), || {
        threads = thread_privileges(pid);
        let names: Vec<&str> = threads
            .values()
            .filter_map(|f| f.get("Name").map(String::as_str))
            .collect();
        // A reader the spawner has just started still carries the spawner's name: wait until
        // each packet thread has its own name, and then for its filter.
        PACKET_THREADS.iter().all(|t| names.contains(t))
            && threads.values().all(|f| {
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
