//! The control loop has a pulse (issue 27): an `nft` that hangs is killed after its timeout and
//! its apply reported failed (`/readyz` 503 naming it), while the event loop stays alive (the
//! systemd watchdog keeps being pinged, `/healthz` stays 200); SIGTERM ends the daemon in
//! bounded time even while a command hangs, logs what it could not remove, and the next start
//! replaces the leftover rules. And a stalled event loop (blocked by a test hook, as a hung
//! blocking call would) fails `/healthz` and stops `WATCHDOG=1`.
//!
//! The daemon runs with `PATH` starting at a shim directory whose `nft` runs the real one, or,
//! while a flag file exists, a `sleep` that never ends (in a child of the shell, so killing only
//! the shell would leave it behind holding the pipes).
//!
//! Run as root: `cargo test --all-features --test netns_pulse -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::path::PathBuf;
use std::time::Duration;
use tunnelgate::shell::clock;

/// The ingress target: never reached, the rules only have to be applied.
const TARGET: &str = "10.74.0.10";
/// The argument of the shim's hanging `sleep`, to find its processes.
const HANG_MARK: &str = "4242.5";
/// The daemon's command timeout (`firewall::COMMAND_TIMEOUT`).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// An interface name unique to this test process, with the prefix of this suite (`tp`).
fn iface(n: u32) -> String {
    format!("tp{}x{n}", std::process::id())
}

fn rules(ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(|p| format!("\"{p}\"")).collect();
    format!(
        "[[ingress]]\ntarget = \"{TARGET}\"\nports = [{}]\n\n[firewall]\nmode = \"nftables\"\n\
         repair_interval = \"0s\"\n",
        ports.join(", ")
    )
}

/// The zombie children of `pid` (commands it did not reap).
fn zombie_children(pid: u32) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    procs
        .filter_map(Result::ok)
        .filter_map(|p| {
            let child: u32 = p.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(p.path().join("stat")).ok()?;
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
            let state = fields.next()?;
            let ppid: u32 = fields.next()?.parse().ok()?;
            (ppid == pid && state == "Z").then_some(child)
        })
        .collect()
}

#[test]
#[ignore = "needs root"]
fn a_hung_nft_is_killed_reported_and_does_not_stall_the_loop_or_the_stop() {
    require_root();
    let ns = Netns::new();
    let shim = PathShim::new("nft", ShimFault::Hang(HANG_MARK));
    let dir = TempDir::new("tppulse");
    let mut notify = NotifySocket::bind(&dir);
    let notify_path = notify.path.display().to_string();
    let path = shim.path_env();
    let mut cfg = TgConfig::new(0, &["100.74.0.1/32"]);
    cfg.name = iface(0);
    cfg.extra = rules(&[8080]);
    let env = [
        ("PATH", path.as_str()),
        ("NOTIFY_SOCKET", notify_path.as_str()),
        // 2 s: a ping every second.
        ("WATCHDOG_USEC", "2000000"),
    ];
    let mut tg = Tunnelgate::spawn_env(&ns, cfg.clone(), &env);
    tg.wait_ready(Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e}"));
    notify.expect("READY=1", Duration::from_secs(5), || tg.stderr());
    let installed = ns.nft_table_of(&cfg.name);
    assert!(nft_forwards_port(&installed, 8080), "{installed}");

    // nft hangs; a reload (SIGHUP) asks for a second port.
    shim.set_faulty(true);
    let mut next = cfg.clone();
    next.extra = rules(&[8080, 9090]);
    tg.write_config(next.clone());
    let hung = clock::now();
    tg.sighup();
    // While the command hangs, the loop awaits it: alive, pinging, /healthz 200.
    notify.drain();
    let pings = notify.count("WATCHDOG=1", Duration::from_secs(6));
    assert!(
        pings >= 4,
        "WATCHDOG=1 keeps coming while nft hangs: {pings} in 6 s; {:?}\n{}",
        notify.log,
        tg.stderr()
    );
    assert!(
        !PathShim::hanging_sleeps(HANG_MARK).is_empty(),
        "the shim's nft hangs now: {}",
        tg.stderr()
    );
    assert_eq!(
        tg.health_get("/healthz").map(|r| r.0),
        Ok(200),
        "the loop is alive while it awaits a command"
    );
    // Killed after its timeout: the apply has failed, /readyz says why.
    let mut reason = String::new();
    wait_until(
        COMMAND_TIMEOUT + Duration::from_secs(5),
        "/readyz drops to 503",
        || match tg.health_get("/readyz") {
            Ok((503, body)) => {
                reason = body;
                true
            }
            _ => false,
        },
    );
    let failed_after = tunnelgate::shell::clock::since(hung);
    assert!(
        failed_after >= COMMAND_TIMEOUT - Duration::from_millis(500),
        "reported only after the timeout: {failed_after:?}"
    );
    assert!(
        reason.contains("nft") && reason.contains("did not finish within 10 s"),
        "/readyz names the command and its timeout: {reason}"
    );
    let log = tg.stderr();
    assert!(
        log.contains("nft did not finish within 10 s and was killed"),
        "the log says so: {log}"
    );
    assert_eq!(
        tg.health_get("/healthz").map(|r| r.0),
        Ok(200),
        "a failed apply is not a dead daemon"
    );
    assert!(tg.is_running(), "the daemon runs on");
    assert_eq!(
        ns.nft_table_of(&cfg.name),
        installed,
        "the old rules stay in place"
    );
    assert_eq!(zombie_children(tg.pid()), Vec::<u32>::new(), "reaped");
    // The retries (1 s, 2 s, ... apart) hang too, one at a time; each is killed whole.
    for _ in 0..20 {
        let sleeps = PathShim::hanging_sleeps(HANG_MARK);
        assert!(sleeps.len() <= 1, "killed commands are gone: {sleeps:?}");
        std::thread::sleep(Duration::from_millis(250));
    }

    // SIGTERM while a retry hangs: the stop does not wait behind it, and its own removal of
    // the rules is killed after the timeout and logged.
    wait_until(Duration::from_secs(35), "a retry that hangs", || {
        !PathShim::hanging_sleeps(HANG_MARK).is_empty()
    });
    let stopping = clock::now();
    let status = tg.sigterm_within(Duration::from_secs(20));
    let stop_took = tunnelgate::shell::clock::since(stopping);
    let log = tg.stderr();
    assert!(
        stop_took < Duration::from_secs(15),
        "SIGTERM with a hung nft took {stop_took:?}:\n{log}"
    );
    assert!(status.success(), "exit status {status:?}:\n{log}");
    assert!(
        log.contains("Left in place at stop") && log.contains("nft"),
        "the log names what it could not remove: {log}"
    );
    assert_eq!(
        PathShim::hanging_sleeps(HANG_MARK),
        Vec::<u32>::new(),
        "no command outlives the daemon"
    );
    let leftover = ns.nft_table_of(&cfg.name);
    assert!(
        nft_forwards_port(&leftover, 8080),
        "the rules it could not remove are still there: {leftover}"
    );
    drop(tg);

    // A normal start (real nft) replaces the leftover table, and its stop removes it.
    shim.set_faulty(false);
    let mut tg = Tunnelgate::spawn_env(&ns, next.clone(), &env);
    tg.wait_ready(Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e}"));
    let table = ns.nft_table_of(&cfg.name);
    assert!(
        nft_forwards_port(&table, 8080) && nft_forwards_port(&table, 9090),
        "the new start's rules: {table}"
    );
    assert_eq!(
        ns.nft_tunnelgate_tables(),
        vec![format!("tunnelgate_{}", cfg.name)],
        "one table"
    );
    let status = tg.sigterm();
    assert!(status.success(), "{}", tg.stderr());
    assert_eq!(ns.nft_table_of(&cfg.name), "", "removed at a normal stop");
}

#[test]
#[ignore = "needs root"]
fn a_stalled_event_loop_fails_healthz_and_stops_the_watchdog() {
    require_root();
    if !cfg!(feature = "test-hooks") {
        panic!("the stall hook is compiled only with --features test-hooks (or --all-features)");
    }
    let ns = Netns::new();
    let dir = TempDir::new("tpstall");
    let stall: PathBuf = dir.path().join("stall");
    let stall_env = stall.display().to_string();
    let mut notify = NotifySocket::bind(&dir);
    let notify_path = notify.path.display().to_string();
    let mut cfg = TgConfig::new(0, &["100.74.1.1/32"]);
    cfg.name = iface(1);
    let tg = Tunnelgate::spawn_env(
        &ns,
        cfg,
        &[
            ("NOTIFY_SOCKET", &notify_path),
            ("WATCHDOG_USEC", "2000000"),
            ("TUNNELGATE_TEST_STALL_LOOP", &stall_env),
        ],
    );
    tg.wait_ready(Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e}"));
    notify.expect("WATCHDOG=1", Duration::from_secs(3), || tg.stderr());
    assert_eq!(tg.health_get("/healthz").map(|r| r.0), Ok(200));

    // Block the loop (the hook blocks its thread on its next turn, within the 2 s poll).
    dir.write("stall", "");
    let mut reason = String::new();
    // The next turn (within the 2 s poll) blocks; 5 s later the pulse is stale. The margin is
    // for a loaded CI machine, where the debug build's turns and the probes are slow.
    wait_until(Duration::from_secs(20), "/healthz fails", || {
        match tg.health_get("/healthz") {
            Ok((503, body)) => {
                reason = body;
                true
            }
            _ => false,
        }
    });
    assert!(
        reason.contains("event loop stalled for"),
        "/healthz says why: {reason}"
    );
    notify.drain();
    assert!(
        notify.quiet("WATCHDOG=1", Duration::from_secs(3)),
        "pinged with a stalled event loop: {:?}\n{}",
        notify.log,
        tg.stderr()
    );

    // Unblocked: alive again.
    std::fs::remove_file(&stall).expect("remove the stall file");
    notify.expect("WATCHDOG=1", Duration::from_secs(4), || tg.stderr());
    assert_eq!(tg.health_get("/healthz").map(|r| r.0), Ok(200));
    let log = tg.stderr();
    assert!(
        log.contains("event loop stalled for")
            && log.contains("withholding systemd watchdog pings")
            && log.contains("pings resume"),
        "{log}"
    );
}
