//! The one place that reads the system clocks. Everything else takes time as an argument
//! (`now`) or asks here; `clippy.toml` disallows `Instant::now`, `SystemTime::now`, their
//! `elapsed` and tokio's `Instant::now` elsewhere, so no decision reads the clock behind a
//! test's back. The pure core (`crates/core`) never calls it: its callers pass `now` in.

use std::time::{Duration, Instant, SystemTime};

/// The monotonic clock: for deadlines, intervals and ages.
#[allow(clippy::disallowed_methods)] // this module is where the clock may be read
#[must_use]
pub fn now() -> Instant {
    Instant::now()
}

/// How long ago `earlier` was (zero if it is in the future): `Instant::elapsed` through the
/// one clock.
#[must_use]
pub fn since(earlier: Instant) -> Duration {
    now().saturating_duration_since(earlier)
}

/// The monotonic clock as tokio's `Instant`, for `sleep_until` deadlines. The same clock as
/// [`now`] (tokio's is std's, unless a test pauses it, which ours do not).
#[must_use]
pub fn tokio_now() -> tokio::time::Instant {
    tokio::time::Instant::from_std(now())
}

/// The wall clock: only for what a user or a peer sees as a date (handshake times, Unix
/// timestamps in metrics), never for measuring an interval.
#[allow(clippy::disallowed_methods)] // this module is where the clock may be read
#[must_use]
pub fn wall_now() -> SystemTime {
    SystemTime::now()
}

/// The current Unix time in seconds (0 if the clock is before 1970): the `now` that the pure
/// telemetry renders "N seconds ago" and handshake ages against.
pub fn unix_now() -> u64 {
    wall_now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The calling thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`): the CPU time it has used, what
/// the packet readers' real-time budget is counted in. A system call (the vDSO does not serve
/// this clock): the readers read it once per batch, and only at real-time priority.
#[must_use]
pub fn thread_cpu() -> Duration {
    nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID
        .now()
        .map_or(Duration::ZERO, Duration::from)
}
