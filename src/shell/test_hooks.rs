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
