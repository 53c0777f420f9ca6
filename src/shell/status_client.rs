//! The clients of the status socket (`tunnelgate status`, `tunnelgate reload`) and what they
//! read around it: the run directory, the sockets in it, and the network namespaces
//! (`/proc/self/ns/net`, `/run/netns`). The protocol is `telemetry::status`; the server is
//! `shell::serve::status`.

use std::io::{ErrorKind, Read as _};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::telemetry::status::{
    status_socket_path_in, ReloadAnswer, ReloadOutcome, Request, StatusError, DEFAULT_RUN_DIR,
    IO_TIMEOUT, RELOAD_TIMEOUT,
};
use crate::telemetry::Snapshot;

/// `/var/run/tunnelgate/<interface>.sock`, or under `$TUNNELGATE_RUN_DIR` when set.
pub fn status_socket_path(interface: &str) -> PathBuf {
    status_socket_path_in(&run_dir(), interface)
}

/// The interface a socket path is for (its file stem), for messages.
fn interface_of(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// Asks the daemon serving `path` for its [`Snapshot`] (blocking, at most a few seconds).
/// A daemon too old to report its network namespace gets the one its process is in, read
/// through the socket's peer credentials (`SO_PEERCRED` pid -> `/proc/PID/ns/net`).
pub fn query_status(path: &Path) -> Result<Snapshot, StatusError> {
    let (buf, peer_pid) = exchange_with_peer(path, Request::Status, IO_TIMEOUT)?;
    let mut snap: Snapshot =
        serde_json::from_slice(&buf).map_err(|source| StatusError::Decode {
            path: path.to_path_buf(),
            source,
        })?;
    if snap.netns_id.is_none() {
        snap.netns_id = peer_pid.and_then(|pid| {
            std::fs::read_link(format!("/proc/{pid}/ns/net"))
                .ok()
                .map(|p| p.to_string_lossy().into_owned())
        });
    }
    Ok(snap)
}

/// Asks the daemon serving `path` to reload its config file and waits for the outcome
/// (blocking, at most a minute). The outer error is the exchange's; the inner one is the
/// daemon's refusal, for the user.
pub fn request_reload(path: &Path) -> Result<Result<ReloadOutcome, String>, StatusError> {
    let buf = exchange(path, Request::Reload, RELOAD_TIMEOUT)?;
    // A daemon that predates the request line answers a snapshot instead.
    let value: serde_json::Value =
        serde_json::from_slice(&buf).map_err(|source| StatusError::Decode {
            path: path.to_path_buf(),
            source,
        })?;
    if value.get("interface").is_some() && value.get("outcome").is_none() {
        return Err(StatusError::Unsupported {
            path: path.to_path_buf(),
        });
    }
    let answer: ReloadAnswer =
        serde_json::from_value(value).map_err(|source| StatusError::Decode {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(answer.into_result())
}

/// Every status socket in `dir` (`*.sock`), sorted by name; none when `dir` does not exist.
pub fn status_sockets_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    out.sort();
    out
}

/// The run directory: `$TUNNELGATE_RUN_DIR`, else [`DEFAULT_RUN_DIR`].
pub fn run_dir() -> PathBuf {
    crate::shell::tuning::run_dir().unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR))
}

/// Where `ip netns add NAME` bind-mounts its namespaces.
pub const NAMED_NETNS_DIR: &str = "/run/netns";

/// This process's network namespace as the kernel names it (`net:[4026531840]`, the link of
/// `/proc/self/ns/net`); `None` when procfs cannot tell.
pub fn own_netns_id() -> Option<String> {
    std::fs::read_link("/proc/self/ns/net")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// Every `ip netns` name with the inode of its namespace (a bind mount of the namespace
/// file has the namespace's inode), sorted by name; none when the folder is absent.
pub fn named_netns() -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(entries) = std::fs::read_dir(NAMED_NETNS_DIR) else {
        return Vec::new();
    };
    let mut out: Vec<(String, u64)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let meta = std::fs::metadata(e.path()).ok()?;
            Some((e.file_name().to_string_lossy().into_owned(), meta.ino()))
        })
        .collect();
    out.sort();
    out
}

/// Sends `request`, closes our side, reads the answer to its end.
fn exchange(path: &Path, request: Request, timeout: Duration) -> Result<Vec<u8>, StatusError> {
    exchange_with_peer(path, request, timeout).map(|(buf, _)| buf)
}

/// [`exchange`], also giving the pid of the process that answered (`None` when the kernel
/// cannot name it in our pid namespace).
fn exchange_with_peer(
    path: &Path,
    request: Request,
    timeout: Duration,
) -> Result<(Vec<u8>, Option<u32>), StatusError> {
    use std::io::Write as _;
    let mut stream = StdUnixStream::connect(path).map_err(|e| match e.kind() {
        ErrorKind::NotFound => StatusError::NotRunning {
            interface: interface_of(path),
            path: path.to_path_buf(),
        },
        ErrorKind::ConnectionRefused => StatusError::Stale {
            interface: interface_of(path),
            path: path.to_path_buf(),
        },
        ErrorKind::PermissionDenied => StatusError::PermissionDenied {
            path: path.to_path_buf(),
        },
        _ => StatusError::Io {
            what: "cannot connect to",
            path: path.to_path_buf(),
            source: e,
        },
    })?;
    let peer_pid =
        nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
            .ok()
            .and_then(|c| u32::try_from(c.pid()).ok())
            .filter(|pid| *pid > 0);
    let io = |source: std::io::Error| {
        if matches!(source.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            StatusError::Timeout {
                path: path.to_path_buf(),
            }
        } else {
            StatusError::Io {
                what: "cannot read from",
                path: path.to_path_buf(),
                source,
            }
        }
    };
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    // A status request is no line at all, only the end of our side: a daemon older than the
    // request line never reads, and a Unix socket closed with unread data resets its peer.
    if request == Request::Reload {
        // A daemon that answers without reading may already have closed its side.
        let _ = stream.write_all(b"reload\n");
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut buf = Vec::new();
    match stream.read_to_end(&mut buf) {
        Ok(_) => Ok((buf, peer_pid)),
        // An older daemon answered a snapshot and closed with our request unread.
        Err(e) if request == Request::Reload && e.kind() == ErrorKind::ConnectionReset => {
            Err(StatusError::Unsupported {
                path: path.to_path_buf(),
            })
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener as StdUnixListener;

    use super::*;
    use crate::telemetry::status::netns_inode;
    use crate::telemetry::tests::sample_snapshot;
    use crate::test_util::TempDir;

    #[test]
    fn path_layout() {
        assert_eq!(interface_of(Path::new("/x/tg0.sock")), "tg0");
        // The real function only differs by the directory it picks.
        assert_eq!(
            status_socket_path("tg0").file_name(),
            Some(std::ffi::OsStr::new("tg0.sock"))
        );
    }

    #[test]
    fn this_process_has_a_namespace_id() {
        let own = own_netns_id().expect("procfs");
        assert!(netns_inode(&own).is_some(), "{own}");
    }

    #[test]
    fn garbage_answer_is_a_decode_error() {
        let dir = TempDir::new("status");
        std::fs::create_dir_all(&dir.0).expect("dir");
        let path = status_socket_path_in(&dir.0, "tg4");
        let listener = StdUnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            use std::io::Write as _;
            let (mut s, _) = listener.accept().expect("accept");
            s.write_all(b"not json").expect("write");
        });
        let err = query_status(&path).expect_err("garbage");
        assert!(matches!(err, StatusError::Decode { .. }), "{err}");
        server.join().expect("server");
    }

    #[test]
    fn an_old_daemon_answering_a_snapshot_to_reload_is_unsupported() {
        let dir = TempDir::new("status");
        std::fs::create_dir_all(&dir.0).expect("dir");
        let path = status_socket_path_in(&dir.0, "tg7");
        let listener = StdUnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            use std::io::Write as _;
            let (mut s, _) = listener.accept().expect("accept");
            let snap = serde_json::to_vec(&sample_snapshot()).expect("json");
            s.write_all(&snap).expect("write");
        });
        let err = request_reload(&path).expect_err("old daemon");
        assert!(matches!(err, StatusError::Unsupported { .. }), "{err}");
        server.join().expect("server");
    }

    #[test]
    fn lists_the_sockets_of_a_run_dir() {
        let dir = TempDir::new("status");
        assert!(status_sockets_in(&dir.0).is_empty());
        std::fs::create_dir_all(&dir.0).expect("dir");
        for f in ["wg1.sock", "wg0.sock", "forwarding-wg0.json"] {
            std::fs::write(dir.0.join(f), "").expect("write");
        }
        assert_eq!(
            status_sockets_in(&dir.0),
            [dir.0.join("wg0.sock"), dir.0.join("wg1.sock")]
        );
    }
}
