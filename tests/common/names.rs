//! Unique namespace and interface names, the stale-leftover sweep, root checks and the polling waits every helper uses.

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;
use std::time::Duration;
use tunnelgate::shell::clock;

use super::*;

/// How often every waiting helper polls.
pub const POLL: Duration = Duration::from_millis(50);
/// Where wireguard-go, boringtun and tunnelgate put their UAPI sockets (shared by all namespaces).
pub const WG_SOCKET_DIR: &str = "/var/run/wireguard";
/// The name kinds the harness generates (see [`unique_name`]).
const KINDS: [&str; 5] = ["tgn", "tgv", "tgw", "tgd", "tgt"];

pub(super) static COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// Panics with a clear message unless the test runs as root (netns suites need it).
pub fn require_root() {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the effective uid.
    let euid = fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    assert!(
        euid == 0,
        "this test needs root (network namespaces, TUN, veth): run it as root with \
         `cargo test -- --ignored --test-threads=1`"
    );
}

/// A name unique to this process and call: `<kind><pid>x<n>`, at most 15 characters, so it is a
/// valid interface name and UAPI socket name. `kind` is one of `tgn` (namespace), `tgv` (veth),
/// `tgw` (wireguard-go), `tgd` (tunnelgate), `tgt` (anything else).
pub fn unique_name(kind: &str) -> String {
    assert!(KINDS.contains(&kind), "unknown name kind {kind:?}");
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("{kind}{}x{n}", std::process::id());
    assert!(name.len() <= 15, "generated name {name} is longer than 15");
    name
}

/// The pid that generated a harness name, if `name` has the harness's shape.
fn owner_pid(name: &str) -> Option<u32> {
    let kind = KINDS.iter().find(|k| name.starts_with(*k))?;
    let rest = &name[kind.len()..];
    let (pid, n) = rest.split_once('x')?;
    if pid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether this test process generated `name` ([`unique_name`]).
pub(super) fn made_here(name: &str) -> bool {
    owner_pid(name) == Some(std::process::id())
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes namespaces, UAPI sockets, status sockets and forwarding records that an earlier,
/// killed harness run left behind.
pub(super) fn sweep_stale() {
    SWEEP.call_once(|| {
        let stale = |name: &str| owner_pid(name).is_some_and(|p| p > 1 && !pid_alive(p));
        if let Ok(list) = try_run(&["ip", "netns", "list"]) {
            for line in list.lines() {
                let name = line.split_whitespace().next().unwrap_or("");
                if stale(name) {
                    kill_ns_processes(name);
                    let _ = try_run(&["ip", "netns", "del", name]);
                }
            }
        }
        if let Ok(dir) = fs::read_dir(WG_SOCKET_DIR) {
            for entry in dir.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if file.strip_suffix(".sock").is_some_and(stale) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        sweep_run_dir(stale);
    });
}

/// Polls `f` every [`POLL`] until it is true or `timeout` passes; returns whether it became true.
pub fn poll_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = clock::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if clock::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Like [`poll_until`], but panics with `what` when the time is up.
pub fn wait_until(timeout: Duration, what: &str, f: impl FnMut() -> bool) {
    assert!(
        poll_until(timeout, f),
        "timed out after {timeout:?} waiting until {what}"
    );
}
