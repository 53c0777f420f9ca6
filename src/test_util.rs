//! Helpers for the library's unit tests only (compiled with `cfg(test)`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

// The one way a test skips a check (a failure under `CI=true`), shared with the integration
// tests: tests/skips.rs holds both to it.
#[allow(unreachable_pub, dead_code)]
#[path = "../tests/common/skip.rs"]
mod skip;
pub(crate) use skip::skip;

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

/// How a connect to the Unix socket `path` by an unprivileged user (uid and gid 65534, no
/// supplementary groups) ends: `"EACCES"`, `"connected"` or another error's name. `None` when
/// this cannot be tried here (not root, or no `/usr/bin/python3`).
pub(crate) fn connect_as_nobody(path: &std::path::Path) -> Option<String> {
    use std::os::unix::process::CommandExt as _;
    let python = std::path::Path::new("/usr/bin/python3");
    // /proc/self belongs to our effective uid.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| {
        use std::os::unix::fs::MetadataExt as _;
        m.uid() == 0
    });
    if !root || !python.exists() {
        return None;
    }
    let script = "import socket, sys\n\
                  s = socket.socket(socket.AF_UNIX)\n\
                  try:\n    s.connect(sys.argv[1]); print('connected')\n\
                  except PermissionError: print('EACCES')\n\
                  except Exception as e: print(type(e).__name__)\n";
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(path)
        .current_dir("/")
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run python3 as nobody");
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
