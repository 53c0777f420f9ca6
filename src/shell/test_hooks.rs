//! Hooks that only tests may pull (compiled with `--features test-hooks`, never in the
//! daemon's release build): stand-ins for faults a test cannot cause from outside.

use crate::shell::fatal::{Fatals, Part};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Names a file: while it exists, each turn of the event loop blocks its thread, as a hung
/// blocking call on the runtime would; `/healthz` and the watchdog must then report the stall
/// (`tests/netns_pulse.rs`, `tests/systemd_unit/booted.rs`).
pub const STALL_LOOP_ENV: &str = "TUNNELGATE_TEST_STALL_LOOP";

/// The [`STALL_LOOP_ENV`] hook, read once when the event loop starts.
pub struct StallLoop(Option<PathBuf>);

impl StallLoop {
    pub fn from_env() -> StallLoop {
        StallLoop(std::env::var_os(STALL_LOOP_ENV).map(PathBuf::from))
    }

    /// Blocks the calling thread (on purpose: the event loop's) while the file exists.
    pub fn block_while_asked(&self) {
        if let Some(path) = &self.0 {
            stall_while_exists(path);
        }
    }
}

fn stall_while_exists(path: &Path) {
    if !path.exists() {
        return;
    }
    tracing::warn!(path = %path.display(), "{STALL_LOOP_ENV}: blocking the event loop while this file exists");
    while path.exists() {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Names a part of the process that panics, as a bug there would: a [`Part`]'s word (`tun-rx`,
/// `udp-rx`, `partner`, `timers`, `spawner`, `uapi`, `status`, `health`, `netlink`,
/// `watchdog`, `event-loop`), or `partner-job` (a relay partner as it starts a job, which needs
/// traffic: `partner` panics as the partner thread starts). The part panics once the process
/// has reported itself ready, at its next look (a packet reader's or the timers' heartbeat, a
/// task's 20 ms poll, the spawner's wake); with `@start` after the word, at its first look, and
/// the process holds its readiness until a death is recorded (at most 10 s), so a death before
/// readiness is a fact, not a race. Only one part panics, once. The process must then end with
/// exit 1 and say which part died (`tests/netns_loud.rs`, `tests/netns_faults.rs`).
pub const PANIC_ENV: &str = "TUNNELGATE_TEST_PANIC";

/// Names a file: while it exists, the process that heard of a fatal error waits before it
/// stops, so a test can read `/healthz` meanwhile.
pub const HOLD_FATAL_ENV: &str = "TUNNELGATE_TEST_HOLD_FATAL";

/// `1`: the background process of `tunnelgate userspace` keeps its stderr (the test's log file)
/// instead of `/dev/null`, so a test can read what it logs after the parent exited.
pub const KEEP_STDERR_ENV: &str = "TUNNELGATE_TEST_KEEP_STDERR";

/// Where a [`PANIC_ENV`] panic happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    Part(Part),
    /// A relay partner starting a job.
    PartnerJob,
}

/// What [`PANIC_ENV`] asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Asked {
    point: Point,
    /// At the point's first look, before the process is ready.
    at_start: bool,
}

/// Parses a [`PANIC_ENV`] value; `Err` names what is wrong.
fn parse_asked(value: &str) -> Result<Asked, String> {
    let (word, at_start) = match value.split_once('@') {
        Some((word, "start")) => (word, true),
        Some(_) => {
            return Err(format!(
                "{PANIC_ENV}={value:?}: only @start may follow the part"
            ))
        }
        None => (value, false),
    };
    let point = match word {
        "partner-job" => Point::PartnerJob,
        _ => Part::ALL
            .into_iter()
            .find(|p| p.word() == word)
            .map(Point::Part)
            .ok_or_else(|| {
                format!("{PANIC_ENV}={value:?}: no such part (expected one of `Part::word`, or partner-job)")
            })?,
    };
    Ok(Asked { point, at_start })
}

/// The [`PANIC_ENV`] hook, read once (a bad value is said once and ignored).
fn asked() -> Option<Asked> {
    static ASKED: OnceLock<Option<Asked>> = OnceLock::new();
    *ASKED.get_or_init(|| {
        let value = std::env::var(PANIC_ENV).ok()?;
        parse_asked(&value).map_err(|e| tracing::warn!("{e}")).ok()
    })
}

/// Set once the process has reported itself ready.
static READY: AtomicBool = AtomicBool::new(false);
/// Set once the asked part has panicked.
static FIRED: AtomicBool = AtomicBool::new(false);

/// Reads the [`PANIC_ENV`] hook now (at start, so a bad value is said at once and no packet
/// thread reads the environment).
pub fn read_panic_hook() {
    let _ = asked();
}

/// Called by the composition root once it has reported the process ready.
pub fn process_ready() {
    READY.store(true, Ordering::SeqCst);
}

/// Whether `point` is asked for.
fn asks_for(point: Point) -> Option<Asked> {
    asked().filter(|a| a.point == point)
}

/// Panics if `point` is asked for and due, and nothing panicked for the hook before.
fn fire(point: Point) {
    let Some(asked) = asks_for(point) else {
        return;
    };
    if (asked.at_start || READY.load(Ordering::SeqCst)) && !FIRED.swap(true, Ordering::SeqCst) {
        let word = match point {
            Point::Part(part) => part.word(),
            Point::PartnerJob => "partner-job",
        };
        panic!("{PANIC_ENV}: {word} panics on purpose");
    }
}

/// The hook's point in a thread that looks again and again (a packet reader's or the timers'
/// heartbeat, the spawner's wake).
pub fn panic_point(part: Part) {
    fire(Point::Part(part));
}

/// The hook's point in a relay partner as it starts each job (`partner-job`).
pub fn partner_job_starts() {
    fire(Point::PartnerJob);
}

/// The hook's point in a relay partner thread as it starts (`partner`): when asked, waits (it
/// has no heartbeat to look at again) until the process is ready, then panics; returns at once
/// when not asked, or when `stop` is set first.
pub fn partner_starts(stop: &AtomicBool) {
    let Some(asked) = asks_for(Point::Part(Part::Partner)) else {
        return;
    };
    while !asked.at_start && !READY.load(Ordering::SeqCst) {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    fire(Point::Part(Part::Partner));
}

/// The hook's point in a task (`shell::fatal::guarded` runs it beside the task, in the task):
/// never completes, and panics when `part` is asked for and due.
pub async fn panic_when_asked(part: Part) -> Infallible {
    if asks_for(Point::Part(part)).is_some() {
        while !FIRED.load(Ordering::SeqCst) {
            fire(Point::Part(part));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    std::future::pending().await
}

/// With `@start`: holds the readiness until a death is recorded (at most 10 s), so the process
/// reports the death instead of being ready.
pub async fn hold_ready_for_an_early_death(fatals: &Fatals) {
    if !asked().is_some_and(|a| a.at_start) {
        return;
    }
    tracing::warn!("{PANIC_ENV}: holding readiness until the part dies");
    let _ = tokio::time::timeout(Duration::from_secs(10), fatals.wait()).await;
}

/// The [`KEEP_STDERR_ENV`] hook.
pub fn keeps_stderr() -> bool {
    std::env::var(KEEP_STDERR_ENV).is_ok_and(|v| v == "1")
}

/// The [`HOLD_FATAL_ENV`] hook: waits (without blocking the event loop's thread) while the
/// file exists.
pub async fn hold_fatal_while_asked() {
    let Some(path) = std::env::var_os(HOLD_FATAL_ENV).map(PathBuf::from) else {
        return;
    };
    if path.exists() {
        tracing::warn!(path = %path.display(), "{HOLD_FATAL_ENV}: holding the exit while this file exists");
    }
    while path.exists() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_panic_hook_takes_a_parts_word_and_at_start_only() {
        for part in Part::ALL {
            assert_eq!(
                parse_asked(part.word()),
                Ok(Asked {
                    point: Point::Part(part),
                    at_start: false
                })
            );
            let early = parse_asked(&format!("{}@start", part.word())).expect("@start");
            assert!(early.at_start);
        }
        assert_eq!(
            parse_asked("partner-job").map(|a| a.point),
            Ok(Point::PartnerJob)
        );
        for bad in ["", "uapi@later", "UAPI", "tg-udp-rx-0", "uapi@"] {
            assert!(parse_asked(bad).is_err(), "{bad:?}");
        }
    }
}
