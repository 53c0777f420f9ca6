//! Hooks that only tests may pull (compiled with `--features test-hooks`, never in the
//! daemon's release build): stand-ins for faults a test cannot cause from outside.

use std::path::{Path, PathBuf};
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

/// A job number, from 1: the relay partner that starts that job (counted over every partner of
/// the process) panics in it, as a bug in sealing or opening would; the data plane must make
/// it its fatal error (`tests/netns_faults.rs`).
pub const PANIC_PARTNER_ENV: &str = "TUNNELGATE_TEST_PANIC_PARTNER";

/// Names a file: while it exists, the event loop that heard the data plane's fatal error
/// waits before it returns it (and the daemon stops), so a test can read `/healthz` meanwhile.
pub const HOLD_FATAL_ENV: &str = "TUNNELGATE_TEST_HOLD_FATAL";

/// The [`PANIC_PARTNER_ENV`] hook: called by a partner as it starts each job.
pub fn partner_job_starts() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static JOBS: AtomicU64 = AtomicU64::new(0);
    let at = AT.get_or_init(|| {
        std::env::var(PANIC_PARTNER_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
    });
    if let Some(at) = *at {
        if JOBS.fetch_add(1, Ordering::Relaxed) + 1 == at {
            panic!("{PANIC_PARTNER_ENV}: relay partner job {at} panics on purpose");
        }
    }
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
