//! The one place that reads the system clocks. Everything else takes time as an argument
//! (`now`) or asks here; `clippy.toml` disallows `Instant::now` and `SystemTime::now`
//! elsewhere, so no decision reads the clock behind a test's back. The pure core
//! (`src/core/`, `src/config*`, `src/rules*`) never calls it: its callers pass `now` in (its
//! tests may, to start a fake clock at some instant).

use std::time::{Instant, SystemTime};

/// The monotonic clock: for deadlines, intervals and ages.
#[allow(clippy::disallowed_methods)] // this module is where the clock may be read
#[must_use]
pub fn now() -> Instant {
    Instant::now()
}

/// The wall clock: only for what a user or a peer sees as a date (handshake times, Unix
/// timestamps in metrics), never for measuring an interval.
#[allow(clippy::disallowed_methods)] // this module is where the clock may be read
#[must_use]
pub fn wall_now() -> SystemTime {
    SystemTime::now()
}
