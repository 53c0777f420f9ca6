//! The daemons' run directory, `/run/tunnelgate`, as the suites leave it: holding nothing of
//! theirs. A daemon removes its status socket and forwarding record when it stops; one killed
//! with -9 cannot, so the guards do: `Tunnelgate`'s drop removes its status socket,
//! `Netns`'s drop the sockets of the interfaces this process made in it (whatever started
//! their daemons, also while a test panics) and every forwarding record written in it (whose
//! sysctls die with it), and the sweep what a killed test process left.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where the daemons the harness starts keep their status sockets and forwarding records (the
/// harness does not set `TUNNELGATE_RUN_DIR`).
pub const RUN_DIR: &str = "/run/tunnelgate";

/// The status socket of interface `name` (`tunnelgate status --interface NAME`).
pub fn status_socket(name: &str) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{name}.sock"))
}

/// The forwarding record of interface `name`.
pub fn forwarding_record(name: &str) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{name}.forwarding"))
}

/// The network namespace `name` as a forwarding record names it: `net:[INODE]`.
pub(super) fn netns_id(name: &str) -> Option<String> {
    let meta = fs::metadata(Path::new("/run/netns").join(name)).ok()?;
    Some(format!("net:[{}]", meta.ino()))
}

/// Removes every forwarding record written in the namespace `id` (`net:[INODE]`), under the
/// daemons' lock on the run directory.
pub(super) fn remove_records_of(id: &str) {
    let Ok(dir) = fs::File::open(RUN_DIR) else {
        return;
    };
    if dir.lock().is_err() {
        return;
    }
    for (path, text) in records() {
        if text.lines().any(|l| l.trim() == format!("netns={id}")) {
            let _ = fs::remove_file(path);
        }
    }
}

/// Every forwarding record and its text.
fn records() -> Vec<(PathBuf, String)> {
    let Ok(entries) = fs::read_dir(RUN_DIR) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "forwarding"))
        .filter_map(|p| Some((p.clone(), fs::read_to_string(&p).ok()?)))
        .collect()
}

/// Removes the status sockets and forwarding records of interfaces whose name `stale` says an
/// earlier, killed test process made.
pub(super) fn sweep_run_dir(stale: impl Fn(&str) -> bool) {
    let Ok(entries) = fs::read_dir(RUN_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let interface = file
            .strip_suffix(".sock")
            .or_else(|| file.strip_suffix(".forwarding"));
        if interface.is_some_and(&stale) {
            let _ = fs::remove_file(entry.path());
        }
    }
}
