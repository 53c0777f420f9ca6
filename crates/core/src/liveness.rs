//! Whether the daemon is alive: each packet thread stamps a heartbeat on every wake (a batch, or
//! an idle timeout), the event loop on every turn ([`LoopPulse`]), and `/healthz` fails when one
//! has not stamped for [`STALL_LIMIT`]; and the systemd watchdog built on it
//! ([`watchdog_interval`], [`WatchdogPings`]); and how the process ends when something ends
//! it before a stop was asked for ([`Fatal`]: a part that died, or the interface deleted). Time
//! is an argument (milliseconds on the shell's monotonic clock, or an `Instant` passed in); this
//! file never reads a clock or the environment.

use crate::control::Mode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often an idle packet thread wakes by itself (TUN poll timeout, UDP receive timeout),
/// so its heartbeat moves and it notices a stop request without traffic.
pub const IDLE_WAKE: Duration = Duration::from_secs(1);

/// A packet thread that has not stamped its heartbeat for this long is reported stuck. Five
/// idle wakes: a loaded machine can delay a wake by a scheduling slice or a blocking write,
/// never by seconds; and it is well inside a Kubernetes liveness probe's default budget
/// (3 failures, 10 s apart), so a wedged daemon is restarted within about half a minute.
pub const STALL_LIMIT: Duration = Duration::from_secs(5);

/// The threads that move packets; their names are the OS thread names (`ps -T`, `top -H`).
/// Each worker has a TUN reader and a UDP reader; one timer thread serves every peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketThread {
    TunReader(usize),
    UdpReader(usize),
    Timers,
    /// A further handshake thread (`1..workers`; the timer thread is the first): handshakes and
    /// takeovers spread over the CPUs.
    Handshakes(usize),
}

impl PacketThread {
    /// Every packet thread of a data plane with `workers` workers.
    pub fn all(workers: usize) -> impl Iterator<Item = PacketThread> {
        (0..workers)
            .flat_map(|w| [PacketThread::TunReader(w), PacketThread::UdpReader(w)])
            .chain(std::iter::once(PacketThread::Timers))
            .chain((1..workers).map(PacketThread::Handshakes))
    }

    /// The OS thread name (at most 15 bytes for any worker number below 10,000).
    pub fn name(self) -> String {
        match self {
            PacketThread::TunReader(w) => format!("tg-tun-rx-{w}"),
            PacketThread::UdpReader(w) => format!("tg-udp-rx-{w}"),
            PacketThread::Timers => "tg-timers".into(),
            PacketThread::Handshakes(w) => format!("tg-hs-{w}"),
        }
    }

    /// Where the thread's stamp lives in [`Heartbeats`] of `workers` workers.
    fn slot(self, workers: usize) -> usize {
        match self {
            PacketThread::TunReader(w) => 2 * w,
            PacketThread::UdpReader(w) => 2 * w + 1,
            PacketThread::Timers => 2 * workers,
            PacketThread::Handshakes(w) => 2 * workers + w,
        }
    }
}

/// The latest stamp of every packet thread, in milliseconds since the shell's epoch. Starts at
/// 0 (the epoch): a thread that never ran is stuck once the epoch is [`STALL_LIMIT`] old.
#[derive(Debug)]
pub struct Heartbeats {
    workers: usize,
    stamps: Box<[AtomicU64]>,
}

impl Heartbeats {
    pub fn new(workers: usize) -> Heartbeats {
        Heartbeats {
            workers,
            stamps: (0..3 * workers.max(1)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// One relaxed store; call once per wake or batch, not per packet.
    #[inline]
    pub fn beat(&self, thread: PacketThread, now_ms: u64) {
        if let Some(stamp) = self.stamps.get(thread.slot(self.workers)) {
            stamp.store(now_ms, Ordering::Relaxed);
        }
    }

    pub fn last(&self, thread: PacketThread) -> u64 {
        self.stamps
            .get(thread.slot(self.workers))
            .map_or(0, |s| s.load(Ordering::Relaxed))
    }

    /// Ok when every thread stamped within `limit` of `now_ms`; otherwise the first stuck
    /// thread's name and for how long, e.g. "packet thread tg-tun-rx-0 stuck for 7.2 s".
    pub fn check(&self, now_ms: u64, limit: Duration) -> Result<(), String> {
        check(
            PacketThread::all(self.workers).map(|t| (t, self.last(t))),
            now_ms,
            limit,
        )
    }
}

/// The liveness decision over `(thread name, last stamp)` pairs.
pub fn check(
    stamps: impl IntoIterator<Item = (PacketThread, u64)>,
    now_ms: u64,
    limit: Duration,
) -> Result<(), String> {
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    for (thread, last_ms) in stamps {
        // A stamp "from the future" (a thread racing this check) is fresh, not stuck.
        let silent_ms = now_ms.saturating_sub(last_ms);
        if silent_ms > limit_ms {
            return Err(format!(
                "packet thread {} stuck for {:.1} s",
                thread.name(),
                silent_ms as f64 / 1000.0
            ));
        }
    }
    Ok(())
}

/// How often the event loop turns by itself when nothing happens (a timer), so its pulse moves
/// while it is idle, and while it awaits a command (an `nft` that runs up to its timeout).
pub const LOOP_TURN: Duration = Duration::from_secs(1);

/// The event loop's heartbeat: the loop stamps it on every turn, and a timer makes it turn at
/// least every [`LOOP_TURN`], also while it awaits an external command (awaiting is not being
/// stuck: every command has a deadline). A call that blocks the loop's thread (a hung read on
/// the runtime) stops the stamps; [`LoopPulse::check`] then names the stall, which fails
/// `/healthz` and withholds `WATCHDOG=1`. Starts at `epoch` (a loop that never turned is stalled
/// once the epoch is [`STALL_LIMIT`] old).
#[derive(Debug)]
pub struct LoopPulse {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last turn.
    last_ms: AtomicU64,
}

impl LoopPulse {
    pub fn new(epoch: Instant) -> LoopPulse {
        LoopPulse {
            epoch,
            last_ms: AtomicU64::new(0),
        }
    }

    /// One relaxed store; call on every turn of the loop.
    pub fn beat(&self, now: Instant) {
        self.last_ms.store(self.millis(now), Ordering::Relaxed);
    }

    /// Ok when the loop turned within `limit` of `now`; otherwise for how long it has not, e.g.
    /// "event loop stalled for 7.2 s".
    pub fn check(&self, now: Instant, limit: Duration) -> Result<(), String> {
        loop_check(
            self.last_ms.load(Ordering::Relaxed),
            self.millis(now),
            limit,
        )
    }

    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }
}

/// The event loop's liveness decision: its last turn at `last_ms`, now `now_ms`.
pub fn loop_check(last_ms: u64, now_ms: u64, limit: Duration) -> Result<(), String> {
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    // A turn "from the future" (the loop racing this check) is fresh, not stuck.
    let silent_ms = now_ms.saturating_sub(last_ms);
    if silent_ms > limit_ms {
        return Err(format!(
            "event loop stalled for {:.1} s",
            silent_ms as f64 / 1000.0
        ));
    }
    Ok(())
}

/// How often to send systemd `WATCHDOG=1`, from the environment systemd gives a service with
/// `WatchdogSec=`: half of `$WATCHDOG_USEC` (what sd_watchdog_enabled(3) advises), and only when
/// `$WATCHDOG_PID` is unset or names this process (`own_pid`): a child the service forked (the
/// background `tunnelgate userspace`) must not ping for its parent. `Ok(None)`: no watchdog
/// wanted. `Err`: a value systemd would never set, naming the variable and what was expected.
pub fn watchdog_interval(
    watchdog_usec: Option<&str>,
    watchdog_pid: Option<&str>,
    own_pid: u32,
) -> Result<Option<Duration>, String> {
    let Some(usec) = watchdog_usec else {
        return Ok(None);
    };
    if let Some(pid) = watchdog_pid {
        let pid: u32 = pid.trim().parse().map_err(|_| {
            format!("WATCHDOG_PID={pid:?}: expected a process id (a positive integer)")
        })?;
        if pid != own_pid {
            return Ok(None);
        }
    }
    let usec: u64 = usec.trim().parse().map_err(|_| {
        format!("WATCHDOG_USEC={usec:?}: expected microseconds (a non-negative integer)")
    })?;
    if usec == 0 {
        // systemd's "watchdog off".
        return Ok(None);
    }
    Ok(Some(Duration::from_micros(usec / 2)))
}

/// What one watchdog tick does: ping or not, and what to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogStep {
    /// Send `WATCHDOG=1`: only while every packet thread is alive, so a wedged one stops the
    /// pings and systemd kills and restarts the service (`Restart=on-failure`).
    pub ping: bool,
    /// Log this once, when the liveness changes (not on every tick).
    pub log: Option<String>,
}

/// The watchdog's decision on each tick, from the liveness check ([`Heartbeats::check`] or
/// the data plane's fatal error). Remembers only whether the last tick was alive, to log the
/// change once.
#[derive(Debug, Default)]
pub struct WatchdogPings {
    withheld: bool,
}

impl WatchdogPings {
    pub fn on_tick(&mut self, liveness: &Result<(), String>) -> WatchdogStep {
        let was_withheld = std::mem::replace(&mut self.withheld, liveness.is_err());
        match liveness {
            Ok(()) => WatchdogStep {
                ping: true,
                log: was_withheld.then(|| "alive again: systemd watchdog pings resume".into()),
            },
            Err(why) => WatchdogStep {
                ping: false,
                log: (!was_withheld).then(|| format!("{why}: withholding systemd watchdog pings")),
            },
        }
    }
}

/// Why the process ends before anyone asked it to stop: the first of its long-lived parts to
/// die, or its interface deleted under it. The text names the part (`packet thread tg-udp-rx-0
/// panicked: ...`, `UAPI server failed: ...`) or the deletion (`TUN device is gone: ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fatal {
    /// The interface was deleted from outside: its TUN device is gone (`ip link del`,
    /// `wg-quick down`), or its UAPI socket was removed (wireguard-go's signal to exit).
    Deleted(String),
    /// A long-lived part (a packet thread, a server task, the netlink connection's driver, the
    /// reader spawner, the watchdog, the event loop) panicked, failed or ended by itself.
    Died(String),
}

impl Fatal {
    /// Whether the process's exit is a failure (exit 1, said at error level): always for a
    /// death, whatever the mode, so a supervisor restarts it; for a deletion only where the
    /// device's end is not the mode's normal way to stop ([`Mode::follows_the_device`]: the
    /// drop-in exits 0 when its interface is deleted, as wireguard-go does; `run` was started
    /// to keep its interface, and its supervisor should bring it back).
    pub fn is_failure(&self, mode: Mode) -> bool {
        match self {
            Fatal::Deleted(_) => !mode.follows_the_device(),
            Fatal::Died(_) => true,
        }
    }
}

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fatal::Deleted(why) | Fatal::Died(why) => f.write_str(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every death fails the process in every mode; only the drop-in takes its interface's
    /// deletion as the normal way to stop.
    #[test]
    fn a_death_always_fails_and_a_deletion_only_where_the_mode_keeps_its_device() {
        let died = Fatal::Died("UAPI server panicked: boom".into());
        let deleted = Fatal::Deleted("TUN device is gone: No such device".into());
        for mode in [Mode::Daemon, Mode::Userspace] {
            assert!(died.is_failure(mode), "{mode:?}: {died}");
        }
        assert!(deleted.is_failure(Mode::Daemon));
        assert!(!deleted.is_failure(Mode::Userspace));
        assert_eq!(died.to_string(), "UAPI server panicked: boom");
        assert_eq!(deleted.to_string(), "TUN device is gone: No such device");
    }

    #[test]
    fn the_watchdog_pings_at_half_the_interval_systemd_gives() {
        let me = 4242;
        assert_eq!(
            watchdog_interval(Some("20000000"), None, me),
            Ok(Some(Duration::from_secs(10)))
        );
        assert_eq!(
            watchdog_interval(Some("20000000"), Some("4242"), me),
            Ok(Some(Duration::from_secs(10)))
        );
        assert_eq!(
            watchdog_interval(Some("3"), None, me),
            Ok(Some(Duration::from_micros(1)))
        );
        // Unset, off, or meant for another process (our parent, before a fork).
        assert_eq!(watchdog_interval(None, None, me), Ok(None));
        assert_eq!(watchdog_interval(None, Some("4242"), me), Ok(None));
        assert_eq!(watchdog_interval(Some("0"), None, me), Ok(None));
        assert_eq!(watchdog_interval(Some("20000000"), Some("1"), me), Ok(None));
    }

    #[test]
    fn a_watchdog_value_systemd_never_sets_is_named() {
        let err = watchdog_interval(Some("20s"), None, 1).expect_err("not a number");
        assert!(
            err.contains("WATCHDOG_USEC=\"20s\"") && err.contains("microseconds"),
            "{err}"
        );
        let err = watchdog_interval(Some("-5"), None, 1).expect_err("negative");
        assert!(err.contains("WATCHDOG_USEC"), "{err}");
        let err = watchdog_interval(Some("1000"), Some("me"), 1).expect_err("not a pid");
        assert!(
            err.contains("WATCHDOG_PID=\"me\"") && err.contains("process id"),
            "{err}"
        );
    }

    #[test]
    fn pings_stop_while_a_thread_is_stuck_and_each_change_is_logged_once() {
        let mut pings = WatchdogPings::default();
        let alive = Ok(());
        let stuck = Err("packet thread tg-tun-rx-0 stuck for 5.1 s".to_string());
        assert_eq!(
            pings.on_tick(&alive),
            WatchdogStep {
                ping: true,
                log: None
            }
        );
        let step = pings.on_tick(&stuck);
        assert!(!step.ping);
        assert_eq!(
            step.log.as_deref(),
            Some("packet thread tg-tun-rx-0 stuck for 5.1 s: withholding systemd watchdog pings")
        );
        assert_eq!(
            pings.on_tick(&stuck),
            WatchdogStep {
                ping: false,
                log: None
            },
            "logged once"
        );
        let step = pings.on_tick(&alive);
        assert!(step.ping);
        assert!(step.log.is_some_and(|l| l.contains("resume")));
        assert_eq!(pings.on_tick(&alive).log, None);
    }

    const LIMIT: Duration = Duration::from_secs(5);

    #[test]
    fn fresh_threads_are_alive_and_a_silent_one_is_named() {
        let beats = Heartbeats::new(1);
        for t in PacketThread::all(1) {
            beats.beat(t, 10_000);
        }
        assert_eq!(beats.check(10_000, LIMIT), Ok(()));
        assert_eq!(
            beats.check(15_000, LIMIT),
            Ok(()),
            "exactly the limit is alive"
        );
        beats.beat(PacketThread::TunReader(0), 14_000);
        beats.beat(PacketThread::Timers, 15_000);
        assert_eq!(
            beats.check(15_001, LIMIT),
            Err("packet thread tg-udp-rx-0 stuck for 5.0 s".to_string())
        );
        beats.beat(PacketThread::UdpReader(0), 15_001);
        assert_eq!(beats.check(15_001, LIMIT), Ok(()));
        assert_eq!(
            beats.check(21_000, LIMIT),
            Err("packet thread tg-tun-rx-0 stuck for 7.0 s".to_string())
        );
    }

    #[test]
    fn threads_that_never_ran_get_the_limit_from_the_epoch() {
        let beats = Heartbeats::new(2);
        assert_eq!(beats.check(4_000, LIMIT), Ok(()));
        assert!(beats
            .check(5_001, LIMIT)
            .is_err_and(|e| e.contains("tg-tun-rx-0")));
    }

    #[test]
    fn every_worker_has_its_own_stamp_and_name() {
        let beats = Heartbeats::new(2);
        for t in PacketThread::all(2) {
            beats.beat(t, 10_000);
        }
        beats.beat(PacketThread::UdpReader(1), 1_000);
        assert_eq!(
            beats.check(10_000, LIMIT),
            Err("packet thread tg-udp-rx-1 stuck for 9.0 s".to_string())
        );
        beats.beat(PacketThread::UdpReader(1), 10_000);
        beats.beat(PacketThread::Handshakes(1), 2_000);
        assert_eq!(
            beats.check(10_000, LIMIT),
            Err("packet thread tg-hs-1 stuck for 8.0 s".to_string()),
            "the further handshake thread has a stamp of its own"
        );
        let names: Vec<String> = PacketThread::all(2).map(PacketThread::name).collect();
        assert_eq!(
            names,
            [
                "tg-tun-rx-0",
                "tg-udp-rx-0",
                "tg-tun-rx-1",
                "tg-udp-rx-1",
                "tg-timers",
                "tg-hs-1"
            ]
        );
    }

    #[test]
    fn a_stamp_newer_than_now_is_fresh() {
        assert_eq!(check([(PacketThread::Timers, 2_000)], 1_000, LIMIT), Ok(()));
    }

    #[test]
    fn a_loop_that_turns_is_alive_and_a_stalled_one_says_for_how_long() {
        let epoch = crate::test_util::now();
        let at = |ms: u64| epoch + Duration::from_millis(ms);
        let pulse = LoopPulse::new(epoch);
        assert_eq!(
            pulse.check(at(5_000), LIMIT),
            Ok(()),
            "the limit from the epoch"
        );
        assert_eq!(
            pulse.check(at(5_001), LIMIT),
            Err("event loop stalled for 5.0 s".to_string()),
            "a loop that never turned"
        );
        pulse.beat(at(10_000));
        assert_eq!(pulse.check(at(10_000), LIMIT), Ok(()));
        assert_eq!(pulse.check(at(15_000), LIMIT), Ok(()), "exactly the limit");
        assert_eq!(
            pulse.check(at(17_250), LIMIT),
            Err("event loop stalled for 7.2 s".to_string())
        );
        // Turning again (the blocking call returned) is alive again at once.
        pulse.beat(at(17_300));
        assert_eq!(pulse.check(at(17_300), LIMIT), Ok(()));
    }

    #[test]
    fn a_turn_newer_than_now_or_a_now_before_the_epoch_is_fresh() {
        assert_eq!(loop_check(2_000, 1_000, LIMIT), Ok(()));
        let epoch = crate::test_util::now() + Duration::from_secs(60);
        let pulse = LoopPulse::new(epoch);
        assert_eq!(pulse.check(epoch - Duration::from_secs(30), LIMIT), Ok(()));
    }

    #[test]
    fn a_stalled_loop_withholds_the_watchdog_like_a_stuck_thread() {
        let epoch = crate::test_util::now();
        let pulse = LoopPulse::new(epoch);
        let mut pings = WatchdogPings::default();
        pulse.beat(epoch + Duration::from_secs(1));
        let alive = pulse.check(epoch + Duration::from_secs(2), LIMIT);
        assert!(pings.on_tick(&alive).ping);
        let stalled = pulse.check(epoch + Duration::from_secs(9), LIMIT);
        let step = pings.on_tick(&stalled);
        assert!(!step.ping);
        assert_eq!(
            step.log.as_deref(),
            Some("event loop stalled for 8.0 s: withholding systemd watchdog pings")
        );
    }
}
