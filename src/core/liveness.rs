//! Whether the packet threads are alive: each stamps a heartbeat on every wake (a batch, or an
//! idle timeout), and `/healthz` fails when one has not stamped for [`STALL_LIMIT`]. Time is an
//! argument (milliseconds on the shell's monotonic clock); this file never reads a clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
}

impl PacketThread {
    /// Every packet thread of a data plane with `workers` workers.
    pub fn all(workers: usize) -> impl Iterator<Item = PacketThread> {
        (0..workers)
            .flat_map(|w| [PacketThread::TunReader(w), PacketThread::UdpReader(w)])
            .chain(std::iter::once(PacketThread::Timers))
    }

    /// The OS thread name (at most 15 bytes for any worker number below 10,000).
    pub fn name(self) -> String {
        match self {
            PacketThread::TunReader(w) => format!("tg-tun-rx-{w}"),
            PacketThread::UdpReader(w) => format!("tg-udp-rx-{w}"),
            PacketThread::Timers => "tg-timers".into(),
        }
    }

    /// Where the thread's stamp lives in [`Heartbeats`] of `workers` workers.
    fn slot(self, workers: usize) -> usize {
        match self {
            PacketThread::TunReader(w) => 2 * w,
            PacketThread::UdpReader(w) => 2 * w + 1,
            PacketThread::Timers => 2 * workers,
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
            stamps: (0..=2 * workers).map(|_| AtomicU64::new(0)).collect(),
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let names: Vec<String> = PacketThread::all(2).map(PacketThread::name).collect();
        assert_eq!(
            names,
            [
                "tg-tun-rx-0",
                "tg-udp-rx-0",
                "tg-tun-rx-1",
                "tg-udp-rx-1",
                "tg-timers"
            ]
        );
    }

    #[test]
    fn a_stamp_newer_than_now_is_fresh() {
        assert_eq!(check([(PacketThread::Timers, 2_000)], 1_000, LIMIT), Ok(()));
    }
}
