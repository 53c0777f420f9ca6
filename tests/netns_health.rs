//! Issue 15, the health endpoint under a slowloris: a real daemon in a network namespace, 1,000
//! connections held open against its health port (half of them silent, half dribbling one
//! header byte at a time, each reopened as soon as the daemon closes it), and `/readyz` still
//! answers 200 within a second, every time; the daemon's open descriptors stay bounded.
//!
//! Run as root: `cargo test --all-features --test netns_health -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tunnelgate::clock;

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
        let took = started.elapsed();
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
