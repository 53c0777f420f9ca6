//! Issue 15, the health endpoint under a slowloris: a real daemon in a network namespace, 1,000
//! connections held open against its health port (half of them silent, half dribbling one
//! header byte at a time, each reopened as soon as the daemon closes it), and `/readyz` still
//! answers 200 within a second, every time; the daemon's open descriptors stay bounded.
//!
//!
//! Issue 27, a reload equals a fresh start for `[health]` too: a wireguard-go peer asks the
//! gateway's tunnel address for `/metrics` before and after reloads that move the endpoint
//! between `0.0.0.0` and loopback, and never gets an answer.
//!
//! Run as root: `cargo test --all-features --test netns_health -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tunnelgate::shell::clock;

/// Connections the attacker keeps open.
const SLOW_CONNECTIONS: usize = 1000;
/// The daemon's connection cap (`telemetry::http::Limits::DEFAULT`).
const MAX_CONNECTIONS: usize = 256;

/// The daemon's open file descriptors.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Whether the server closed `s` (EOF or reset); `s` is non-blocking.
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

fn open(addr: SocketAddr, dribble: bool) -> Option<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_nonblocking(true).ok()?;
    if dribble {
        let _ = s.write(b"GET /readyz HTTP/1.1\r\nX-Slow: ");
    }
    Some(s)
}

/// Keeps [`SLOW_CONNECTIONS`] connections open to `addr` until `stop`: every 200 ms each
/// dribbler sends one more header byte, and every connection the daemon closed is reopened.
/// `opened` counts every connection made.
fn slowloris(addr: SocketAddr, stop: &AtomicBool, opened: &AtomicUsize) {
    let mut conns: Vec<(bool, Option<TcpStream>)> =
        (0..SLOW_CONNECTIONS).map(|i| (i % 2 == 1, None)).collect();
    while !stop.load(Ordering::Relaxed) {
        for (dribble, slot) in conns.iter_mut() {
            let alive = match slot {
                Some(s) => !closed(s) && (!*dribble || s.write(b"a").is_ok()),
                None => false,
            };
            if !alive {
                *slot = open(addr, *dribble);
                opened.fetch_add(1, Ordering::Relaxed);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Stops the attacker even when an assertion fails first.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
#[ignore = "needs root and network namespaces"]
fn readyz_answers_within_a_second_under_a_thousand_slow_connections() {
    require_root();
    let ns = Netns::new();
    let tg = Tunnelgate::start(&ns, TgConfig::new(0, &["100.64.0.1/32"]));
    let addr = tg.cfg.health_addr().expect("health enabled");
    let idle_fds = fd_count(tg.pid());
    assert!(idle_fds > 0, "cannot read /proc/{}/fd", tg.pid());

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let _stop_guard = StopOnDrop(stop.clone());
    let attacker = ns.thread({
        let (stop, opened) = (stop.clone(), opened.clone());
        move || slowloris(addr, &stop, &opened)
    });
    wait_until(
        Duration::from_secs(10),
        "the attacker opened its connections",
        || opened.load(Ordering::Relaxed) >= SLOW_CONNECTIONS,
    );

    // 20 probes over 10 s: past the daemon's 5 s idle timeout, so connections are both
    // evicted for newcomers and timed out while the attacker keeps reopening them.
    let mut max_fds = 0;
    let mut slowest = Duration::ZERO;
    for i in 0..20 {
        let started = clock::now();
        let r = http_get_in(ns.name(), addr, "/readyz", Duration::from_secs(1));
        let took = tunnelgate::shell::clock::since(started);
        assert_eq!(
            r.as_ref().map(|(status, _)| *status),
            Ok(200),
            "probe {i} after {took:?}: {r:?}"
        );
        assert!(took < Duration::from_secs(1), "probe {i} took {took:?}");
        slowest = slowest.max(took);
        max_fds = max_fds.max(fd_count(tg.pid()));
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, Ordering::Relaxed);
    attacker.join().expect("attacker");
    eprintln!(
        "slowest probe {slowest:?}; daemon fds idle {idle_fds}, at most {max_fds}; attacker connections made {}",
        opened.load(Ordering::Relaxed)
    );
    assert!(
        max_fds <= idle_fds + MAX_CONNECTIONS + 8,
        "the daemon holds {max_fds} descriptors (idle {idle_fds}, cap {MAX_CONNECTIONS})"
    );
    assert!(
        max_fds >= idle_fds + MAX_CONNECTIONS / 2,
        "the attack never filled the daemon's connection slots ({max_fds} fds): the test proves nothing"
    );
    assert!(
        opened.load(Ordering::Relaxed) > SLOW_CONNECTIONS,
        "the daemon never closed an attacker connection"
    );
}

// ---------------------------------------------------------------------------------------------
// Issue 27: reloading [health]
// ---------------------------------------------------------------------------------------------

const TH_A_LAN: &str = "10.93.0.1";
const TH_B_LAN: &str = "10.93.0.2";
const TH_A_TUN: &str = "100.64.93.1";
const TH_B_TUN: &str = "100.64.93.2";
const TH_TG_PORT: u16 = 51931;
const TH_WG_PORT: u16 = 51932;
/// How long a request that the input guard drops is given.
const DROPPED: Duration = Duration::from_millis(1500);

/// An interface name with this suite's `th` prefix, unique to this process.
fn th_name() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "th{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// `tunnelgate reload --interface NAME` in the daemon's namespace.
fn reload(ns: &Netns, name: &str) -> CmdOutput {
    output_of(
        ns.command(&[tunnelgate_bin(), "reload", "--interface", name]),
        None,
    )
}

/// Writes `health` as the config's `[health] listen` and reloads; asserts the outcome.
fn reload_health(ns: &Netns, tg: &mut Tunnelgate, health: Option<&str>) -> CmdOutput {
    let mut cfg = tg.cfg.clone();
    cfg.health = health.map(str::to_string);
    let text = cfg.render("private.key");
    tg.write_config_text(&text);
    let out = reload(ns, tg.name());
    if out.success() {
        tg.cfg = cfg;
    }
    out
}

/// What the tunnel peer gets for `/metrics` on the gateway's tunnel address.
fn metrics_from_peer(peer: &Netns, port: u16) -> Result<(u16, String), String> {
    let to: SocketAddr = format!("{TH_A_TUN}:{port}").parse().expect("addr");
    http_get_in(peer.name(), to, "/metrics", DROPPED)
}

fn assert_peer_refused(peer: &Netns, port: u16, tg: &Tunnelgate, when: &str) {
    let r = metrics_from_peer(peer, port);
    assert!(
        r.is_err(),
        "{when}: the tunnel peer fetched http://{TH_A_TUN}:{port}/metrics: {:?}\nstderr:\n{}",
        r.map(|(status, _)| status),
        tg.stderr()
    );
}

/// The gateway's own request (from its namespace) to `addr`.
fn own_get(ns: &Netns, addr: &str) -> Result<u16, String> {
    let to: SocketAddr = addr.parse().expect("addr");
    http_get_in(ns.name(), to, "/readyz", Duration::from_secs(2)).map(|(s, _)| s)
}

#[test]
#[ignore = "needs root and network namespaces"]
fn reloads_that_move_the_health_endpoint_never_open_it_to_the_tunnel() {
    require_root();
    let (a, b, _) = lan_pair_v4(TH_A_LAN, TH_B_LAN);
    let wg = WgGo::start(&b, TH_WG_PORT, &[&format!("{TH_B_TUN}/24")]);
    let mut cfg = TgConfig::new(TH_TG_PORT, &[&format!("{TH_A_TUN}/32")]).peer(
        Peer::new(wg.public_key(), &[&format!("{TH_B_TUN}/32")])
            .endpoint(&format!("{TH_B_LAN}:{TH_WG_PORT}")),
    );
    cfg.name = th_name();
    cfg.health = Some("0.0.0.0:9002".into());
    wg.add_peer(
        &Peer::new(cfg.public_key(), &[&format!("{TH_A_TUN}/32")])
            .endpoint(&format!("{TH_A_LAN}:{TH_TG_PORT}")),
    );
    let mut tg = Tunnelgate::start(&a, cfg);
    assert!(
        ping_until(&b, TH_A_TUN, Duration::from_secs(10)),
        "tunnel up; stderr:\n{}",
        tg.stderr()
    );
    assert_eq!(
        own_get(&a, &format!("{TH_A_TUN}:9002")),
        Ok(200),
        "listens on 0.0.0.0"
    );
    assert_peer_refused(&b, 9002, &tg, "at start, on 0.0.0.0 (guarded)");

    // Narrow to loopback: the listener moves, then the guard goes ("not needed").
    let out = reload_health(&a, &mut tg, Some("127.0.0.1:9002"));
    assert!(
        out.success(),
        "reload to loopback: {out:?}\n{}",
        tg.stderr()
    );
    assert_peer_refused(&b, 9002, &tg, "after the reload to 127.0.0.1");
    assert_eq!(own_get(&a, "127.0.0.1:9002"), Ok(200), "serves on loopback");
    assert!(
        own_get(&a, &format!("{TH_A_TUN}:9002")).is_err(),
        "the old 0.0.0.0 listener is closed"
    );
    let status = output_of(
        a.command(&[tunnelgate_bin(), "status", "--interface", tg.name()]),
        None,
    );
    assert!(status.success(), "{status:?}");

    // Widen again: the guard goes in before the listener leaves loopback.
    let out = reload_health(&a, &mut tg, Some("0.0.0.0:9002"));
    assert!(out.success(), "reload to 0.0.0.0: {out:?}\n{}", tg.stderr());
    assert_eq!(
        own_get(&a, &format!("{TH_A_TUN}:9002")),
        Ok(200),
        "moved to 0.0.0.0"
    );
    assert_peer_refused(&b, 9002, &tg, "after the reload back to 0.0.0.0");

    // An address that cannot be bound: refused with the reason, the old config runs on.
    let busy = a.in_ns(|| std::net::TcpListener::bind("127.0.0.1:9003").expect("bind 9003"));
    let out = reload_health(&a, &mut tg, Some("127.0.0.1:9003"));
    assert_eq!(
        out.code,
        Some(1),
        "a busy health.listen is refused: {out:?}"
    );
    assert!(
        out.stderr.contains("health.listen 127.0.0.1:9003") && out.stderr.contains("in use"),
        "the reason is given: {}",
        out.stderr
    );
    assert_eq!(
        own_get(&a, &format!("{TH_A_TUN}:9002")),
        Ok(200),
        "the old one serves"
    );
    assert_peer_refused(&b, 9002, &tg, "after the refused reload");

    // [health] off: nothing listens any more, and nothing was ever open to the tunnel.
    let out = reload_health(&a, &mut tg, None);
    assert!(
        out.success(),
        "reload without health: {out:?}\n{}",
        tg.stderr()
    );
    assert!(own_get(&a, &format!("{TH_A_TUN}:9002")).is_err(), "closed");
    assert_peer_refused(&b, 9002, &tg, "after [health] was removed");
    assert!(ping(&b, TH_A_TUN), "the tunnel still works");
    drop(busy);
}
