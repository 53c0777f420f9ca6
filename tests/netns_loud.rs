//! Every death is loud, in every mode: a long-lived part of the process (a packet thread, the
//! reader spawner, the UAPI, status or health server, the netlink connection's driver, the
//! systemd watchdog, the event loop) that panics ends the process with exit 1 and an error line
//! naming the part and the panic, and `/healthz` names it (503) while the process goes down.
//! Checked in `tunnelgate run`, `tunnelgate userspace -f`, the forking `tunnelgate userspace`
//! (the background process exits 1; a death before it is ready makes the parent exit 1) and
//! `tunnelgate-wg` (a symlink to the binary, forking as wg-quick runs it), each part in a fresh
//! daemon, panicked by the test hook `TUNNELGATE_TEST_PANIC` (built only with `--features
//! test-hooks`). And the one end that is not a failure: the drop-in's interface deleted, or
//! its UAPI socket removed, exits 0 (in `run`, a removed UAPI socket is its server's death).
//!
//! The forking modes' background process is reparented to this test process (a subreaper), so
//! its exit status can be read; it keeps its stderr (test hook `TUNNELGATE_TEST_KEEP_STDERR`).
//!
//! Run as root: `cargo test --all-features --test netns_loud -- --ignored --test-threads=1`.

mod common;

use common::*;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::net::SocketAddr;
use std::time::Duration;
use tunnelgate::shell::clock;
use tunnelgate::shell::fatal::Part;

/// How long a daemon gets to come up and its part to die.
const UP: Duration = Duration::from_secs(20);
/// How long a daemon gets to go down once the test lets it.
const DOWN: Duration = Duration::from_secs(20);
/// The health endpoint of every daemon here, in its namespace (one daemon at a time).
const HEALTH: &str = "127.0.0.1:9402";

/// How the daemon is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `tunnelgate run --config FILE`.
    Run,
    /// `tunnelgate userspace -f NAME`.
    Foreground,
    /// `tunnelgate userspace NAME`: the parent waits for the background process's readiness.
    Forking,
    /// `tunnelgate-wg NAME` (a symlink), forking, with `TUNNELGATE_HEALTH`.
    Wg,
}

impl Mode {
    fn forks(self) -> bool {
        matches!(self, Mode::Forking | Mode::Wg)
    }
}

/// When the part panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// Once the process has reported itself ready.
    Ready,
    /// At its first look, with the readiness held until it has (`@start`).
    Start,
}

fn health() -> SocketAddr {
    HEALTH.parse().expect("address")
}

/// A daemon of one of the modes, in `ns`.
struct Daemon {
    mode: Mode,
    name: String,
    ns: String,
    /// `run`: the daemon (its own logs in its temp dir).
    run: Option<Tunnelgate>,
    /// The drop-in: the process started (in the forking modes, the parent).
    proc: Option<Proc>,
    /// The forking modes: the background process, this test's child once its parent exited.
    child: Option<i32>,
    /// The exit status of the process that serves the interface, once read.
    status: Option<WaitStatus>,
    _dirs: Vec<TempDir>,
}

impl Daemon {
    /// Starts the daemon with `env`; with `prefix`, run through it (`setpriv ... --`).
    fn spawn(ns: &Netns, mode: Mode, env: &[(&str, String)], prefix: &[&str]) -> Daemon {
        if mode == Mode::Run {
            let mut cfg = TgConfig::new(0, &["100.64.91.1/32"]);
            cfg.health = Some(HEALTH.into());
            // The group's endpoint exchange, a part of its own (telling itself).
            cfg.extra = "[takeover]\ngroup_listen = \"127.0.0.1:51899\"\ngroup_replicas = \"127.0.0.1:51899\"\n".into();
            // Two workers: a relay partner per reader wherever there are two CPUs.
            cfg.workers = Some(2);
            let name = cfg.name.clone();
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            assert!(prefix.is_empty(), "run mode takes no prefix here");
            let tg = Tunnelgate::spawn_env(ns, cfg, &env);
            return Daemon {
                mode,
                name,
                ns: ns.name().to_string(),
                run: Some(tg),
                proc: None,
                child: None,
                status: None,
                _dirs: Vec::new(),
            };
        }
        let name = unique_name("tgd");
        let dir = TempDir::new("tgloud");
        let link = dir.path().join("tunnelgate-wg");
        std::os::unix::fs::symlink(tunnelgate_bin(), &link).expect("symlink tunnelgate-wg");
        let link = link.display().to_string();
        let mut args: Vec<&str> = prefix.to_vec();
        match mode {
            Mode::Foreground => args.extend([
                tunnelgate_bin(),
                "userspace",
                "-f",
                &name,
                "--health",
                HEALTH,
            ]),
            Mode::Forking => {
                args.extend([tunnelgate_bin(), "userspace", &name, "--health", HEALTH])
            }
            Mode::Wg => args.extend([link.as_str(), &name]),
            Mode::Run => unreachable!("handled above"),
        }
        let mut cmd = ns.command(&args);
        cmd.env_remove("WG_PROCESS_FOREGROUND")
            .env("TUNNELGATE_HEALTH", HEALTH)
            .env("TUNNELGATE_TEST_KEEP_STDERR", "1")
            .env("RUST_BACKTRACE", "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(cmd, "userspace", dir.path());
        Daemon {
            mode,
            name,
            ns: ns.name().to_string(),
            run: None,
            proc: Some(proc),
            child: None,
            status: None,
            _dirs: vec![dir],
        }
    }

    /// Everything logged (in the forking modes, the parent's and the background process's).
    fn log(&self) -> String {
        match (&self.run, &self.proc) {
            (Some(tg), _) => tg.stderr(),
            (None, Some(p)) => p.stderr(),
            (None, None) => String::new(),
        }
    }

    /// In the forking modes: waits for the parent's exit and returns its code, and (if it said
    /// ready) finds the background process. The other modes: `None`.
    fn parent_exit(&mut self, ns: &Netns) -> Option<i32> {
        if !self.mode.forks() {
            return None;
        }
        let proc = self.proc.as_mut().expect("the parent");
        let status = proc
            .wait_timeout(UP)
            .unwrap_or_else(|| panic!("the parent did not exit:\n{}", proc.stderr()));
        let code = status.code();
        if code == Some(0) {
            self.child = Some(self.find_child(ns));
        }
        code
    }

    /// The background process: the tunnelgate in the namespace that serves the interface.
    fn find_child(&self, ns: &Netns) -> i32 {
        let found: Vec<i32> = ns
            .pids()
            .into_iter()
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&self.name))
                    .unwrap_or(false)
            })
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one background process serves {}: {found:?}\n{}",
            self.name,
            self.log()
        );
        found[0]
    }

    /// Waits up to `timeout` for the process that serves the interface to exit; its exit
    /// code (`None`: killed by a signal, or still running).
    fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        if let Some(tg) = &mut self.run {
            return tg.wait_exit(timeout).and_then(|s| s.code());
        }
        let Some(child) = self.child else {
            let proc = self.proc.as_mut().expect("the daemon");
            return proc.wait_timeout(timeout).and_then(|s| s.code());
        };
        let deadline = clock::now() + timeout;
        while self.status.is_none() {
            match waitpid(Pid::from_raw(child), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(status) => self.status = Some(status),
                Err(e) => panic!(
                    "waitpid({child}): {e} (is this test not its subreaper?)\n{}",
                    self.log()
                ),
            }
            if clock::now() >= deadline {
                break;
            }
            std::thread::sleep(POLL);
        }
        match self.status {
            Some(WaitStatus::Exited(_, code)) => Some(code),
            Some(other) => panic!("the background process ended by {other:?}\n{}", self.log()),
            None => None,
        }
    }

    fn health_get(&self, path: &str) -> Result<(u16, String), String> {
        http_get_in(&self.ns, health(), path, Duration::from_secs(2))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = self.child.filter(|_| self.status.is_none()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(child), nix::sys::signal::SIGKILL);
            let _ = waitpid(Pid::from_raw(child), None);
        }
        let _ = std::fs::remove_file(wg_socket(&self.name));
    }
}

/// Whether `line` names `part`'s death by the test hook's panic.
fn names_the_death(line: &str, part: Part) -> bool {
    let panic = format!("TUNNELGATE_TEST_PANIC: {} panics on purpose", part.word());
    let who = match part {
        Part::TunReader => line.contains("packet thread tg-tun-rx-"),
        Part::UdpReader => line.contains("packet thread tg-udp-rx-"),
        Part::Partner => {
            line.contains("packet thread tg-tun-h") || line.contains("packet thread tg-udp-h")
        }
        Part::Timers => line.contains("packet thread tg-timers"),
        _ => line.contains(part.name()),
    };
    who && line.contains(&panic) && line.contains("panicked")
}

/// How `Part::Spawner`'s daemon is started so that it has a `tg-spawner` thread (which exists
/// only where the readers reach real-time priority by `CAP_SYS_NICE` alone): as it is where
/// this process cannot raise `RLIMIT_RTPRIO`, else without `CAP_SYS_RESOURCE` and with a hard
/// limit of 0. `None`: real-time priority cannot be had here at all.
fn spawner_prefix() -> Option<Vec<&'static str>> {
    if realtime_kept_cap() != 0 {
        Some(Vec::new())
    } else if realtime_possible() {
        Some(vec![
            "setpriv",
            "--bounding-set",
            "-sys_resource",
            "--",
            "prlimit",
            "--rtprio=0:0",
            "--",
        ])
    } else {
        None
    }
}

/// One daemon in `mode` whose `part` panics `when`: exit 1 and an error line naming the part
/// and the panic; after readiness, `/healthz` 503 naming it while the exit is held (not for the
/// health server itself: nothing answers then); before it, the forking parent exits 1 naming it.
/// The stop still ran: interface and UAPI socket gone. `false` when the part cannot exist here
/// (said on stderr).
fn a_part_that_panics_is_loud_or_skip(ns: &Netns, mode: Mode, part: Part, when: When) -> bool {
    let what = format!("{mode:?}, {} ({})", part.word(), part.name());
    let prefix = match part {
        Part::Spawner => match spawner_prefix() {
            Some(p) => p,
            None => {
                skip(format!(
                    "{what}: no real-time priority here (no tg-spawner)"
                ));
                return false;
            }
        },
        _ => Vec::new(),
    };
    if part == Part::Partner && std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(format!("{what}: one CPU (no relay partners)"));
        return false;
    }
    let prefix = if mode == Mode::Run {
        Vec::new()
    } else {
        prefix
    };
    let hold_dir = TempDir::new("tgloudhold");
    let hold = hold_dir.write("hold", "");
    let held = when == When::Ready && part != Part::Health;
    let word = match when {
        When::Ready => part.word().to_string(),
        When::Start => format!("{}@start", part.word()),
    };
    let mut env = vec![("TUNNELGATE_TEST_PANIC", word)];
    if held {
        env.push(("TUNNELGATE_TEST_HOLD_FATAL", hold.display().to_string()));
    }
    if part == Part::Watchdog {
        // Served (WATCHDOG=1 every second, to no one: no NOTIFY_SOCKET).
        env.push(("WATCHDOG_USEC", "2000000".into()));
    }
    let mut daemon = Daemon::spawn(ns, mode, &env, &prefix);
    let parent = daemon.parent_exit(ns);
    if when == When::Start {
        // Never ready: the forking parent hears of the death and exits 1 naming it.
        if mode.forks() {
            assert_eq!(
                parent,
                Some(1),
                "{what}: the parent's exit\n{}",
                daemon.log()
            );
            let said = daemon.proc.as_ref().map(Proc::stderr).unwrap_or_default();
            assert!(
                said.lines()
                    .any(|l| l.starts_with("tunnelgate-wg: ") && names_the_death(l, part)),
                "{what}: the parent names the death on stderr:\n{said}"
            );
            // The background process, this test's child now, exited 1 too.
            let code = reap_any_child(DOWN);
            assert_eq!(code, Some(1), "{what}: the background process's exit");
            return true;
        }
    } else if mode.forks() {
        assert_eq!(parent, Some(0), "{what}: ready\n{}", daemon.log());
    }
    if held {
        let mut said = String::new();
        let failed = poll_until(UP, || match daemon.health_get("/healthz") {
            Ok((503, body)) => {
                said = body;
                true
            }
            _ => false,
        });
        if !failed
            && part == Part::Spawner
            && !daemon.log().contains("held by the packet readers alone")
        {
            skip(format!(
                "{what}: the readers did not get CAP_SYS_NICE (no tg-spawner)"
            ));
            return false;
        }
        assert!(failed, "{what}: /healthz never failed\n{}", daemon.log());
        assert!(
            names_the_death(&said, part),
            "{what}: /healthz names the death: {said}"
        );
        std::fs::remove_file(&hold).expect("remove the hold file");
    }
    let code = daemon.wait_exit(if held { DOWN } else { UP + DOWN });
    let log = daemon.log();
    assert_eq!(code, Some(1), "{what}: the exit\n{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && names_the_death(l, part)),
        "{what}: an error line names the death\n{log}"
    );
    // It stopped the one way a stop goes: the interface and its UAPI socket are gone.
    assert!(
        !ns.link_exists(&daemon.name),
        "{what}: interface left behind"
    );
    assert!(
        !wg_socket(&daemon.name).exists(),
        "{what}: UAPI socket left behind"
    );
    true
}

/// Reaps this process's next child to exit (the forking parent is reaped already; the
/// background process is the only other child): its exit code.
fn reap_any_child(timeout: Duration) -> Option<i32> {
    let deadline = clock::now() + timeout;
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => return Some(code),
            Ok(WaitStatus::StillAlive) => {}
            Ok(other) => panic!("the background process ended by {other:?}"),
            Err(e) => panic!("waitpid(-1): {e}"),
        }
        if clock::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// Every kind of part, each in a fresh daemon of `mode`, panics after readiness; then `early`
/// parts panic before it.
fn every_part_is_loud_in(mode: Mode, early: &[Part]) {
    require_root();
    if !cfg!(feature = "test-hooks") {
        panic!("the panic hook is compiled only with --features test-hooks (or --all-features)");
    }
    if mode.forks() {
        nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
    }
    let ns = Netns::new();
    let (mut checked, mut failed) = (Vec::new(), Vec::new());
    // The group's endpoint exchange runs only with a `[takeover]` group: `run` mode's.
    let cases = Part::ALL
        .into_iter()
        .filter(|part| *part != Part::GroupExchange || mode == Mode::Run)
        .map(|part| (part, When::Ready))
        .chain(early.iter().map(|&part| (part, When::Start)));
    // Every case runs, and the failures are listed together.
    for (part, when) in cases {
        let case = format!(
            "{}{}",
            part.word(),
            if when == When::Start { "@start" } else { "" }
        );
        match std::panic::catch_unwind(|| a_part_that_panics_is_loud_or_skip(&ns, mode, part, when))
        {
            Ok(true) => checked.push(case),
            Ok(false) => {}
            Err(_) => failed.push(case),
        }
    }
    eprintln!("{mode:?}: loud deaths of {checked:?}");
    assert!(
        failed.is_empty(),
        "{mode:?}: not loud: {failed:?} (each said above)"
    );
}

#[test]
#[ignore = "needs root"]
fn every_part_that_panics_ends_tunnelgate_run_with_exit_1_and_says_which() {
    every_part_is_loud_in(Mode::Run, &[]);
}

#[test]
#[ignore = "needs root"]
fn every_part_that_panics_ends_userspace_in_the_foreground_with_exit_1_and_says_which() {
    every_part_is_loud_in(Mode::Foreground, &[Part::Uapi]);
}

#[test]
#[ignore = "needs root"]
fn every_part_that_panics_ends_the_background_userspace_with_exit_1_and_says_which() {
    every_part_is_loud_in(Mode::Forking, &[Part::UdpReader]);
}

#[test]
#[ignore = "needs root"]
fn every_part_that_panics_ends_tunnelgate_wg_with_exit_1_and_says_which() {
    every_part_is_loud_in(Mode::Wg, &[Part::EventLoop]);
}

/// The drop-in's interface deleted (`ip link del`, what `wg-quick down` does) or its UAPI
/// socket removed is the normal way for it to stop: exit 0, no error line. In `run`, a removed
/// UAPI socket is its server's end: exit 1, said.
#[test]
#[ignore = "needs root"]
fn the_drop_in_exits_0_when_its_interface_goes_and_run_exits_1_when_its_uapi_socket_goes() {
    require_root();
    let ns = Netns::new();
    let clean = |daemon: &mut Daemon, what: &str| {
        let code = daemon.wait_exit(DOWN);
        let log = daemon.log();
        assert_eq!(code, Some(0), "{what}: exit 0\n{log}");
        assert!(
            !log.lines().any(|l| l.contains("ERROR")),
            "{what}: no error line\n{log}"
        );
        assert!(log.contains("Interface gone; exiting"), "{what}:\n{log}");
        assert!(
            !wg_socket(&daemon.name).exists(),
            "{what}: UAPI socket left"
        );
    };
    let up = |daemon: &Daemon| {
        wait_until(UP, "the drop-in serves", || {
            wg_socket(&daemon.name).exists() && daemon.health_get("/healthz").is_ok()
        });
    };

    let mut deleted = Daemon::spawn(&ns, Mode::Foreground, &[], &[]);
    up(&deleted);
    ns.exec(&["ip", "link", "del", &deleted.name]);
    clean(&mut deleted, "ip link del");
    drop(deleted);

    let mut removed = Daemon::spawn(&ns, Mode::Foreground, &[], &[]);
    up(&removed);
    std::fs::remove_file(wg_socket(&removed.name)).expect("remove the UAPI socket");
    clean(&mut removed, "UAPI socket removed");
    assert!(!ns.link_exists(&removed.name), "interface left behind");
    drop(removed);

    let mut run = Daemon::spawn(&ns, Mode::Run, &[], &[]);
    run.run
        .as_ref()
        .expect("run")
        .wait_ready(UP)
        .unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_file(wg_socket(&run.name)).expect("remove the UAPI socket");
    let code = run.wait_exit(DOWN);
    let log = run.log();
    assert_eq!(code, Some(1), "run: exit 1\n{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("UAPI socket") && l.contains("was removed")),
        "run: an error line says the UAPI socket went\n{log}"
    );
    assert!(!ns.link_exists(&run.name), "interface left behind");
}
