//! The protocol of the local status socket behind `tunnelgate status`, as pure values: the
//! daemon serves one JSON [`Snapshot`](super::Snapshot) per connection at
//! `/var/run/tunnelgate/<interface>.sock` (mode 0600, so root only, like the WireGuard UAPI
//! socket). The server is `shell::serve::status`, the clients `shell::status_client`.
//!
//! The protocol is deliberately trivial: connect, optionally send one request line, read to end
//! of stream, parse JSON. The request is `status` (the default: a client that sends nothing, or
//! closes its side, or says nothing within [`REQUEST_WAIT`], gets the snapshot as before) or
//! `reload`: the daemon re-reads its config file and answers one JSON [`ReloadAnswer`] once the
//! outcome is known. The socket is root only, so asking for a reload needs no other check.
//! Limits: a request line of at most [`MAX_REQUEST_BYTES`] and [`MAX_STATUS_CONNECTIONS`]
//! connections at once; a line too long, not UTF-8 or cut off gets an error answer.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where status sockets live unless [`RUN_DIR_ENV`] says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/var/run/tunnelgate";
/// Overrides [`DEFAULT_RUN_DIR`] (tests, unprivileged runs).
pub const RUN_DIR_ENV: &str = "TUNNELGATE_RUN_DIR";

/// How long either side waits for the other.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the daemon waits for a request line before answering with the snapshot (clients
/// older than the request line send nothing and keep their side open).
pub const REQUEST_WAIT: Duration = Duration::from_millis(300);
/// How long `tunnelgate reload` waits for the outcome (rules, routes and peers are applied
/// before the daemon answers).
pub const RELOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest request line the daemon reads, its newline included (`reload` is 7 bytes):
/// a longer one is refused after this many bytes, so no client makes the daemon hold more.
pub const MAX_REQUEST_BYTES: usize = 4096;
/// How many connections the status socket holds at once. A `status` or `reload` takes one
/// for well under a second (a reload: until it is applied); at the cap a newcomer closes the
/// connection that has waited longest for its request line, so a client that connects and
/// says nothing cannot lock the others out, and a reload in progress is never cut.
pub const MAX_STATUS_CONNECTIONS: usize = 64;

/// What a client asks for, as its first line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    Status,
    Reload,
}

/// The request a client's first line (without its newline) names. An empty line, or none at
/// all, is a status request.
pub fn parse_request(line: &str) -> Result<Request, String> {
    match line.trim() {
        "" | "status" => Ok(Request::Status),
        "reload" => Ok(Request::Reload),
        other => Err(format!(
            "unknown request {other:?} (expected \"status\" or \"reload\")"
        )),
    }
}

/// How a reload ended, when it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReloadOutcome {
    /// The new configuration is running.
    Applied,
    /// The file says what already runs.
    Unchanged,
}

/// The daemon's answer to `reload`: exactly one of the two is set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReloadAnswer {
    pub outcome: Option<ReloadOutcome>,
    /// Why the reload was refused (the old configuration keeps running).
    pub error: Option<String>,
}

impl ReloadAnswer {
    /// The answer for a reload's outcome.
    pub fn from_result(r: Result<ReloadOutcome, String>) -> ReloadAnswer {
        match r {
            Ok(o) => ReloadAnswer {
                outcome: Some(o),
                error: None,
            },
            Err(e) => ReloadAnswer {
                outcome: None,
                error: Some(e),
            },
        }
    }

    /// The outcome, or the refusal's reason.
    pub fn into_result(self) -> Result<ReloadOutcome, String> {
        match (self.outcome, self.error) {
            (_, Some(e)) => Err(e),
            (Some(o), None) => Ok(o),
            (None, None) => Err("the daemon's answer names no outcome".into()),
        }
    }
}

/// What the status socket calls to reload the daemon's configuration.
pub trait Reloader: Send + Sync + 'static {
    /// Re-reads the config file, applies the difference and returns once done.
    fn reload(&self) -> Pin<Box<dyn Future<Output = Result<ReloadOutcome, String>> + Send + '_>>;
}

/// Why the status socket could not be served or queried. Messages are complete sentences for
/// the user.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("no tunnelgate daemon for interface {interface}: {} not found (is it running?)", .path.display())]
    NotRunning { interface: String, path: PathBuf },
    #[error("no tunnelgate daemon for interface {interface}: nothing listens on {} (stale socket; is it running?)", .path.display())]
    Stale { interface: String, path: PathBuf },
    #[error("permission denied: run as root (cannot open {})", .path.display())]
    PermissionDenied { path: PathBuf },
    #[error("the daemon did not answer on {} within {} s", .path.display(), IO_TIMEOUT.as_secs())]
    Timeout { path: PathBuf },
    #[error("the daemon on {} does not take reload requests (is it older than this client?)", .path.display())]
    Unsupported { path: PathBuf },
    #[error("bad answer from the daemon on {}: {source}", .path.display())]
    Decode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `<dir>/<interface>.sock`.
pub fn status_socket_path_in(dir: &Path, interface: &str) -> PathBuf {
    dir.join(format!("{interface}.sock"))
}

/// The request a client sent as `bytes` (read up to its first newline, its end of stream, or
/// one byte past [`MAX_REQUEST_BYTES`]); `timed_out` when [`REQUEST_WAIT`] passed first.
/// Nothing at all is a status request (older clients send nothing); part of a line that
/// stops without its newline, a line longer than the limit and bytes that are not UTF-8 are
/// refused with the reason.
pub fn request_from_bytes(bytes: &[u8], timed_out: bool) -> Result<Request, String> {
    if bytes.len() > MAX_REQUEST_BYTES {
        return Err(format!(
            "request line longer than {MAX_REQUEST_BYTES} bytes (expected \"status\" or \"reload\")"
        ));
    }
    if timed_out && !bytes.is_empty() {
        return Err(format!(
            "incomplete request: no end of line within {} ms",
            REQUEST_WAIT.as_millis()
        ));
    }
    let line = std::str::from_utf8(bytes)
        .map_err(|_| "the request is not UTF-8 (expected \"status\" or \"reload\")".to_string())?;
    parse_request(line)
}

/// The inode of a namespace id `net:[INODE]`.
pub fn netns_inode(id: &str) -> Option<u64> {
    id.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// How status names a daemon's namespace: its `ip netns` name when one of `named` is it, else
/// the kernel's id; `unknown` for a daemon that does not report one.
pub fn netns_display(id: Option<&str>, named: &[(String, u64)]) -> String {
    let Some(id) = id else {
        return "unknown".into();
    };
    netns_inode(id)
        .and_then(|ino| named.iter().find(|(_, i)| *i == ino))
        .map_or_else(|| id.to_string(), |(name, _)| name.clone())
}

/// Whether a daemon in namespace `daemon` counts as in this one (`own`). A daemon that does
/// not say (older than the field) or a client that cannot tell counts as here, as before.
pub fn same_netns(daemon: Option<&str>, own: Option<&str>) -> bool {
    match (daemon, own) {
        (Some(d), Some(o)) => d == o,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_layout() {
        assert_eq!(
            status_socket_path_in(Path::new("/var/run/tunnelgate"), "tg0"),
            PathBuf::from("/var/run/tunnelgate/tg0.sock")
        );
    }

    #[test]
    fn request_lines() {
        assert_eq!(parse_request(""), Ok(Request::Status));
        assert_eq!(parse_request("status\n"), Ok(Request::Status));
        assert_eq!(parse_request("reload\n"), Ok(Request::Reload));
        let err = parse_request("restart\n").expect_err("unknown");
        assert!(err.contains("\"restart\""), "{err}");
    }

    #[test]
    fn request_lines_too_long_not_utf8_or_cut_off_are_refused() {
        assert_eq!(request_from_bytes(b"", false), Ok(Request::Status));
        assert_eq!(request_from_bytes(b"", true), Ok(Request::Status));
        assert_eq!(request_from_bytes(b"reload\n", false), Ok(Request::Reload));
        // Cut off by the end of the stream: what arrived is the request.
        assert_eq!(request_from_bytes(b"reload", false), Ok(Request::Reload));
        let long = vec![b'a'; MAX_REQUEST_BYTES + 1];
        let err = request_from_bytes(&long, false).expect_err("too long");
        assert!(err.contains("longer than 4096 bytes"), "{err}");
        let err = request_from_bytes(b"\xff\xfe\n", false).expect_err("not UTF-8");
        assert!(err.contains("not UTF-8"), "{err}");
        let err = request_from_bytes(b"rel", true).expect_err("cut off");
        assert!(err.contains("incomplete request"), "{err}");
    }

    #[test]
    fn namespaces_are_named_like_ip_netns_and_compared_by_id() {
        assert_eq!(netns_inode("net:[4026531840]"), Some(4026531840));
        assert_eq!(netns_inode("mnt:[4026531840]"), None);
        assert_eq!(netns_inode("net:[x]"), None);
        let named = vec![
            ("blue".to_string(), 4026532001),
            ("red".to_string(), 4026532002),
        ];
        assert_eq!(netns_display(Some("net:[4026532002]"), &named), "red");
        assert_eq!(
            netns_display(Some("net:[4026531840]"), &named),
            "net:[4026531840]"
        );
        assert_eq!(netns_display(None, &named), "unknown");
        assert!(same_netns(Some("net:[1]"), Some("net:[1]")));
        assert!(!same_netns(Some("net:[1]"), Some("net:[2]")));
        assert!(same_netns(None, Some("net:[2]")));
    }
}
