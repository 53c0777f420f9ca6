//! Pings through a tunnel and the silences in them (`ping -D` reply times, the longest gap), and
//! the restart-under-pings scenario the takeover suites share ([`restart_under_pings`]).

use std::time::Duration;
use tunnelgate::shell::clock;

use super::*;

/// Reply times (Unix seconds) in `ping -D` output.
pub fn reply_times(out: &str) -> Vec<f64> {
    out.lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse().ok())
        .collect()
}

pub fn unix_now() -> f64 {
    clock::wall_now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The longest gap between replies in `times` that ends after `after`.
pub fn longest_gap_after(times: &[f64], after: f64) -> f64 {
    times
        .windows(2)
        .filter(|w| w[1] > after)
        .map(|w| w[1] - w[0])
        .fold(0.0, f64::max)
}

/// The longest time without a reply counted from `from` on: a gap that began earlier counts
/// only its part after `from`.
pub fn longest_silence_from(times: &[f64], from: f64) -> f64 {
    times
        .windows(2)
        .filter(|w| w[1] > from)
        .map(|w| w[1] - w[0].max(from))
        .fold(0.0, f64::max)
}

/// What [`restart_under_pings`] measured, in seconds.
#[derive(Debug, Clone, Copy)]
pub struct RestartSilence {
    /// The longest gap between replies from the SIGKILL on (the start included).
    pub longest: f64,
    /// The longest time without a reply from the moment the new process was ready.
    pub after_ready: f64,
    /// From the new process's readiness to the first reply.
    pub first_after_ready: f64,
    /// From the SIGKILL to the new process's readiness.
    pub start: f64,
}

/// The tunnel addresses [`restart_under_pings`] pings: tunnelgate's, from the peer's namespace.
pub struct PingTarget<'a> {
    /// The peer's interface (any daemon that serves UAPI) and its public key.
    pub peer_iface: &'a str,
    pub peer_public: &'a str,
    /// Named in the report.
    pub peer_kind: &'a str,
    /// tunnelgate's tunnel address.
    pub to: &'a str,
}

/// Starts tunnelgate in `a` with `cfg`; while the peer in `b` pings it every 100 ms, kills it
/// with SIGKILL and starts the same config again; reports the silences and asserts the peer was
/// answered soon after the new process was ready, by a takeover it counts.
pub fn restart_under_pings(
    a: &Netns,
    b: &Netns,
    cfg: TgConfig,
    target: &PingTarget<'_>,
) -> RestartSilence {
    let PingTarget {
        peer_iface,
        peer_public,
        peer_kind,
        to,
    } = *target;
    let mut tg = Tunnelgate::start(a, cfg.clone());
    let mut ping = b.spawn(&["ping", "-n", "-D", "-i", "0.1", "-W", "1", to]);
    wait_handshake(peer_iface, &cfg.key.public, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));

    let killed_at = unix_now();
    tg.kill9();
    drop(tg); // its UAPI socket goes before the new process makes its own
    let tg = Tunnelgate::spawn(a, cfg.clone());
    tg.wait_ready(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("restart: {e}"));
    let ready_at = unix_now();
    // Long enough for the peer's own re-handshake (~15 s) to show if takeover did nothing.
    let deadline = clock::now() + Duration::from_secs(20);
    let mut first_after = None;
    while clock::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        let times = reply_times(&ping.stdout());
        if let Some(t) = times.iter().find(|t| **t > killed_at) {
            first_after = Some(*t);
            if times.last().is_some_and(|last| *last > t + 2.0) {
                break;
            }
        }
    }
    let _ = ping.kill9();
    let times = reply_times(&ping.stdout());
    let silence = longest_gap_after(&times, killed_at);
    let first = first_after.unwrap_or_else(|| {
        panic!(
            "no ping answered within 20 s of the restart\ntunnelgate:\n{}",
            tg.stderr()
        )
    });
    let measured = RestartSilence {
        longest: silence,
        after_ready: longest_silence_from(&times, ready_at),
        first_after_ready: first - ready_at,
        start: ready_at - killed_at,
    };
    eprintln!(
        "restart against {peer_kind}: longest silence {silence:.2} s (SIGKILL to first \
         reply); {:.2} s after the new process was ready ({:.2} s to start); longest silence \
         after ready {:.2} s",
        measured.first_after_ready, measured.start, measured.after_ready
    );
    assert!(
        measured.first_after_ready <= 2.0,
        "the peer waited {:.2} s after the new process was ready\n{}",
        measured.first_after_ready,
        tg.stderr()
    );
    assert!(
        tg.stderr().contains("Takeover"),
        "a takeover line at info:\n{}",
        tg.stderr()
    );
    let status = tg.status_json().expect("status JSON");
    let peer = &status["peers"][0];
    assert_eq!(peer["takeovers_started"], 1, "{status:#}");
    assert_eq!(peer["takeovers_completed"], 1, "{status:#}");
    let metrics = tg.metrics().expect("/metrics");
    let completed = metric(
        &metrics,
        "tunnelgate_peer_takeovers_total",
        &format!("peer=\"{peer_public}\",peer_name=\"\",outcome=\"completed\""),
    );
    assert_eq!(completed, Some(1.0), "{metrics}");
    measured
}
