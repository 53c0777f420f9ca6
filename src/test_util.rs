//! Helpers for the library's unit tests only (compiled with `cfg(test)`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh path under the system temp dir (not created: code under test may create it),
/// removed with everything in it on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tg-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }

    /// [`TempDir::new`], with the directory made.
    pub(crate) fn created(tag: &str) -> TempDir {
        let dir = TempDir::new(tag);
        std::fs::create_dir_all(&dir.0).expect("temp dir");
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
