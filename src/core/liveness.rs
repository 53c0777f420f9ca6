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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketThread {
    TunReader,
    UdpReader,
    Timers,
}

impl PacketThread {
    pub const COUNT: usize = 3;
    pub const ALL: [PacketThread; PacketThread::COUNT] = [
        PacketThread::TunReader,
        PacketThread::UdpReader,
        PacketThread::Timers,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            PacketThread::TunReader => "tg-tun-rx",
            PacketThread::UdpReader => "tg-udp-rx",
            PacketThread::Timers => "tg-timers",
        }
    }
}

/// The latest stamp of every packet thread, in milliseconds since the shell's epoch. Starts at
/// 0 (the epoch): a thread that never ran is stuck once the epoch is [`STALL_LIMIT`] old.
#[derive(Debug, Default)]
pub struct Heartbeats([AtomicU64; PacketThread::COUNT]);

impl Heartbeats {
    /// One relaxed store; call once per wake or batch, not per packet.
    #[inline]
    pub fn beat(&self, thread: PacketThread, now_ms: u64) {
        self.0[thread as usize].store(now_ms, Ordering::Relaxed);
    }

    pub fn last(&self, thread: PacketThread) -> u64 {
        self.0[thread as usize].load(Ordering::Relaxed)
    }

    /// Ok when every thread stamped within `limit` of `now_ms`; otherwise the first stuck
    /// thread's name and for how long, e.g. "packet thread tg-tun-rx stuck for 7.2 s".
    pub fn check(&self, now_ms: u64, limit: Duration) -> Result<(), String> {
        check(
            PacketThread::ALL.map(|t| (t.name(), self.last(t))),
            now_ms,
            limit,
        )
    }
}

/// The liveness decision over `(thread name, last stamp)` pairs.
pub fn check(
    stamps: impl IntoIterator<Item = (&'static str, u64)>,
    now_ms: u64,
    limit: Duration,
) -> Result<(), String> {
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    for (name, last_ms) in stamps {
        // A stamp "from the future" (a thread racing this check) is fresh, not stuck.
        let silent_ms = now_ms.saturating_sub(last_ms);
        if silent_ms > limit_ms {
            return Err(format!(
                "packet thread {name} stuck for {:.1} s",
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
        let beats = Heartbeats::default();
        for t in PacketThread::ALL {
            beats.beat(t, 10_000);
        }
        assert_eq!(beats.check(10_000, LIMIT), Ok(()));
        assert_eq!(
            beats.check(15_000, LIMIT),
            Ok(()),
            "exactly the limit is alive"
        );
        beats.beat(PacketThread::TunReader, 14_000);
        beats.beat(PacketThread::Timers, 15_000);
        assert_eq!(
            beats.check(15_001, LIMIT),
            Err("packet thread tg-udp-rx stuck for 5.0 s".to_string())
        );
        beats.beat(PacketThread::UdpReader, 15_001);
        assert_eq!(beats.check(15_001, LIMIT), Ok(()));
        assert_eq!(
            beats.check(21_000, LIMIT),
            Err("packet thread tg-tun-rx stuck for 7.0 s".to_string())
        );
    }

    #[test]
    fn threads_that_never_ran_get_the_limit_from_the_epoch() {
        let beats = Heartbeats::default();
        assert_eq!(beats.check(4_000, LIMIT), Ok(()));
        assert!(beats
            .check(5_001, LIMIT)
            .is_err_and(|e| e.contains("tg-tun-rx")));
    }

    #[test]
    fn a_stamp_newer_than_now_is_fresh() {
        assert_eq!(check([("t", 2_000)], 1_000, LIMIT), Ok(()));
    }
}
