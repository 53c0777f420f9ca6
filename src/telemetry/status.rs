//! The local status socket behind `tunnelgate status`: the daemon serves one JSON [`Snapshot`]
//! per connection at `/var/run/tunnelgate/<interface>.sock` (mode 0600, so root only, like the
//! WireGuard UAPI socket), and [`query_status`] reads it.
//!
//! The protocol is deliberately trivial: connect, optionally send one request line, read to end
//! of stream, parse JSON. The request is `status` (the default: a client that sends nothing, or
//! closes its side, or says nothing within [`REQUEST_WAIT`], gets the snapshot as before) or
//! `reload`: the daemon re-reads its config file and answers one JSON [`ReloadAnswer`] once the
//! outcome is known. The socket is root only, so asking for a reload needs no other check.
//! Limits: a request line of at most [`MAX_REQUEST_BYTES`] and [`MAX_STATUS_CONNECTIONS`]
//! connections at once; a line too long, not UTF-8 or cut off gets an error answer.

use std::collections::VecDeque;
use std::future::Future;
use std::io::{ErrorKind, Read as _};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::{AbortHandle, JoinSet};

use super::{Observe, Snapshot};
use crate::local_socket::{self, ClaimError, ClaimedPath};

/// Where status sockets live unless [`RUN_DIR_ENV`] says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/var/run/tunnelgate";
/// Overrides [`DEFAULT_RUN_DIR`] (tests, unprivileged runs).
pub const RUN_DIR_ENV: &str = "TUNNELGATE_RUN_DIR";

/// How long either side waits for the other.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the daemon waits for a request line before answering with the snapshot (clients
/// older than the request line send nothing and keep their side open).
pub const REQUEST_WAIT: Duration = Duration::from_millis(300);
/// How long `tunnelgate reload` waits for the outcome (rules, routes and peers are applied
/// before the daemon answers).
const RELOAD_TIMEOUT: Duration = Duration::from_secs(60);
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
    fn from_result(r: Result<ReloadOutcome, String>) -> ReloadAnswer {
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
    #[error("{} is in use by another running tunnelgate daemon", .path.display())]
    InUse { path: PathBuf },
    #[error("{} exists and is not a socket; refusing to replace it", .path.display())]
    NotASocket { path: PathBuf },
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

/// `/var/run/tunnelgate/<interface>.sock`, or under `$TUNNELGATE_RUN_DIR` when set.
pub fn status_socket_path(interface: &str) -> PathBuf {
    status_socket_path_in(&run_dir(), interface)
}

/// `<dir>/<interface>.sock`.
pub fn status_socket_path_in(dir: &Path, interface: &str) -> PathBuf {
    dir.join(format!("{interface}.sock"))
}

/// The interface a socket path is for (its file stem), for messages.
fn interface_of(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// A bound status socket. Dropping it (or the end of [`StatusSocket::serve`]) removes the
/// socket file, unless another process has replaced it since.
#[derive(Debug)]
pub struct StatusSocket {
    listener: StdUnixListener,
    guard: ClaimedPath,
}

impl StatusSocket {
    /// Binds `path` with mode 0600 ([`local_socket::claim`]), creating its directory (0755) if
    /// needed. A stale socket left by a dead daemon is replaced; a live one (something answers
    /// a connect) is not, nor is anything that is not a socket. Needs no runtime, so the daemon can call it before it
    /// reports ready and fail the start on an error.
    pub fn bind(path: &Path) -> Result<StatusSocket, StatusError> {
        StatusSocket::bind_with(local_socket::claim(path))
    }

    /// [`StatusSocket::bind`] for the status socket of interface `interface`: a holder whose
    /// interface is gone (a daemon shutting down) is waited for up to a second
    /// ([`local_socket::claim_for_interface`]).
    pub fn bind_for_interface(path: &Path, interface: &str) -> Result<StatusSocket, StatusError> {
        StatusSocket::bind_with(local_socket::claim_for_interface(path, interface))
    }

    fn bind_with(
        claimed: Result<(StdUnixListener, ClaimedPath), ClaimError>,
    ) -> Result<StatusSocket, StatusError> {
        let io = |what, path, source| StatusError::Io { what, path, source };
        let (listener, guard) = claimed.map_err(|e| match e {
            ClaimError::CreateDir { path, source } => io("cannot create directory", path, source),
            ClaimError::NotASocket { path } => StatusError::NotASocket { path },
            ClaimError::InUse { path } => StatusError::InUse { path },
            ClaimError::PermissionDenied { path } => StatusError::PermissionDenied { path },
            ClaimError::Stale { path, source } => io("cannot remove stale socket", path, source),
            ClaimError::Bind { path, source } => io("cannot create", path, source),
        })?;
        Ok(StatusSocket { listener, guard })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.guard.path()
    }

    /// Answers every connection's request (a JSON [`Snapshot`], or a reload through
    /// `reloader` and its [`ReloadAnswer`]) until `shutdown` completes, then closes the
    /// listener, removes the socket file and drops `shutdown` (a
    /// [`local_socket::CloseRequest`] so tells its sender the socket is gone) before it
    /// aborts open connections. Must run on a tokio runtime.
    pub async fn serve(
        self,
        observe: Arc<dyn Observe>,
        reloader: Option<Arc<dyn Reloader>>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StatusError> {
        let StatusSocket { listener, guard } = self;
        let listener = UnixListener::from_std(listener).map_err(|source| StatusError::Io {
            what: "cannot listen on",
            path: guard.path().to_path_buf(),
            source,
        })?;
        // Boxed, not pinned on the stack, so it can be dropped as soon as the socket is closed.
        let mut shutdown = Box::pin(shutdown);
        let mut conns = JoinSet::new();
        // The connections being answered, oldest first.
        let mut open: VecDeque<OpenConnection> = VecDeque::new();
        loop {
            while let Some(done) = conns.try_join_next_with_id() {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                open.retain(|c| c.id != id);
            }
            let stream = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "status socket: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            if open.len() >= MAX_STATUS_CONNECTIONS && !evict_longest_waiting(&mut open) {
                tracing::warn!(
                    connections = open.len(),
                    "status socket: every connection is busy with a request, closing a new one"
                );
                drop(stream);
                continue;
            }
            let waiting = Arc::new(AtomicBool::new(true));
            let handle = conns.spawn(answer_connection(
                stream,
                observe.clone(),
                reloader.clone(),
                waiting.clone(),
            ));
            open.push_back(OpenConnection {
                id: handle.id(),
                waiting,
                handle,
            });
            // Let the new connection read its request before the next accept: a real client
            // sends it at once and is then past eviction. Without this, a burst of accepts
            // could evict it before its task ever ran.
            tokio::task::yield_now().await;
        }
        drop(guard);
        drop(listener);
        drop(shutdown);
        conns.abort_all();
        Ok(())
    }
}

/// One connection of the status socket, as the accept loop sees it.
struct OpenConnection {
    id: tokio::task::Id,
    /// True until its request line is in (or the loop evicts it, which sets it false first).
    waiting: Arc<AtomicBool>,
    handle: AbortHandle,
}

/// Closes the connection that has waited longest for its request line, to make room for a
/// new one. A connection past its request (a reload in progress, an answer being sent) is
/// never closed. False when every connection is past its request.
fn evict_longest_waiting(open: &mut VecDeque<OpenConnection>) -> bool {
    // Whoever flips `waiting` first owns the connection: the loop evicts it, or its task
    // goes on to answer.
    let victim = open.iter().position(|c| {
        c.waiting
            .compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    });
    match victim.and_then(|i| open.remove(i)) {
        Some(old) => {
            old.handle.abort();
            true
        }
        None => false,
    }
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

/// Reads one connection's request (at most [`MAX_REQUEST_BYTES`], within [`REQUEST_WAIT`])
/// and answers it: a JSON [`Snapshot`], or a [`ReloadAnswer`] for a reload or a refused
/// request. Ends without an answer when the accept loop evicted it while it waited.
async fn answer_connection(
    mut stream: UnixStream,
    observe: Arc<dyn Observe>,
    reloader: Option<Arc<dyn Reloader>>,
    waiting: Arc<AtomicBool>,
) {
    let (read, mut write) = stream.split();
    let mut reader = tokio::io::BufReader::new(read.take(MAX_REQUEST_BYTES as u64 + 1));
    let mut line = Vec::new();
    // `read_until` keeps what it read when the timeout cancels it.
    let timed_out =
        match tokio::time::timeout(REQUEST_WAIT, reader.read_until(b'\n', &mut line)).await {
            Ok(Ok(_)) => false,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "status socket: cannot read the request");
                return;
            }
            Err(_) => true,
        };
    if waiting
        .compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return; // evicted; the abort is on its way
    }
    let body = match request_from_bytes(&line, timed_out) {
        Ok(Request::Status) => serde_json::to_vec(&observe.snapshot()),
        Ok(Request::Reload) => {
            let answer = match &reloader {
                Some(r) => r.reload().await,
                None => Err("this daemon cannot reload".to_string()),
            };
            serde_json::to_vec(&ReloadAnswer::from_result(answer))
        }
        Err(e) => serde_json::to_vec(&ReloadAnswer::from_result(Err(e))),
    };
    let mut body = match body {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "status socket: cannot encode the answer");
            return;
        }
    };
    body.push(b'\n');
    let sent = tokio::time::timeout(IO_TIMEOUT, async {
        write.write_all(&body).await?;
        write.shutdown().await
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        tracing::debug!("status socket: client went away");
    }
}

/// Binds `path` ([`StatusSocket::bind`]) and serves it ([`StatusSocket::serve`]) until
/// `shutdown`. Prefer the two steps when a bind error must fail the daemon's start.
pub async fn serve_status(
    path: &Path,
    observe: Arc<dyn Observe>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StatusError> {
    StatusSocket::bind(path)?
        .serve(observe, None, shutdown)
        .await
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
    std::env::var_os(RUN_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR))
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

/// The inode of a namespace id `net:[INODE]`.
pub fn netns_inode(id: &str) -> Option<u64> {
    id.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
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
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::telemetry::tests::{sample_snapshot, FakeObserve};

    use crate::test_util::TempDir;

    #[test]
    fn path_layout() {
        assert_eq!(
            status_socket_path_in(Path::new("/var/run/tunnelgate"), "tg0"),
            PathBuf::from("/var/run/tunnelgate/tg0.sock")
        );
        assert_eq!(interface_of(Path::new("/x/tg0.sock")), "tg0");
        // The real function only differs by the directory it picks.
        assert_eq!(
            status_socket_path("tg0").file_name(),
            Some(std::ffi::OsStr::new("tg0.sock"))
        );
    }

    #[tokio::test]
    async fn round_trip_and_cleanup() {
        let dir = TempDir::new("status");
        let path = status_socket_path_in(&dir.0.join("run"), "tg0");
        let fake = Arc::new(FakeObserve::new());
        fake.set_not_ready(Some("dns: db.example.internal not resolved yet"));
        let socket = StatusSocket::bind(&path).expect("bind");

        let meta = std::fs::metadata(&path).expect("socket exists");
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let dir_mode = std::fs::metadata(dir.0.join("run"))
            .expect("dir")
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o755);
        // No temporary name is left behind.
        assert_eq!(
            std::fs::read_dir(dir.0.join("run")).expect("dir").count(),
            1
        );

        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(socket.serve(fake.clone(), None, async move {
            let _ = stop_rx.await;
        }));

        for _ in 0..2 {
            let p = path.clone();
            let snap = tokio::task::spawn_blocking(move || query_status(&p))
                .await
                .expect("client")
                .expect("status");
            let mut want = sample_snapshot();
            want.ready = false;
            want.not_ready_reason = Some("dns: db.example.internal not resolved yet".into());
            assert_eq!(snap, want);
        }

        // A second daemon for the same interface is refused while the first is alive.
        match StatusSocket::bind(&path) {
            Err(StatusError::InUse { .. }) => {}
            other => panic!("expected InUse, got {other:?}"),
        }

        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
        assert!(!path.exists(), "socket removed on shutdown");

        let err = query_status(&path).expect_err("no daemon");
        assert!(matches!(err, StatusError::NotRunning { .. }));
        assert_eq!(
            err.to_string(),
            format!(
                "no tunnelgate daemon for interface tg0: {} not found (is it running?)",
                path.display()
            )
        );
    }

    #[tokio::test]
    async fn replaces_a_stale_socket() {
        let dir = TempDir::new("status");
        std::fs::create_dir_all(&dir.0).expect("dir");
        let path = status_socket_path_in(&dir.0, "tg1");
        // A socket file nobody listens on, as a killed daemon leaves behind.
        drop(StdUnixListener::bind(&path).expect("bind"));
        let err = query_status(&path).expect_err("stale");
        assert!(matches!(err, StatusError::Stale { .. }), "{err}");

        let socket = StatusSocket::bind(&path).expect("replaces stale socket");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            socket.serve(Arc::new(FakeObserve::new()), None, async move {
                let _ = stop_rx.await;
            }),
        );
        let p = path.clone();
        let snap = tokio::task::spawn_blocking(move || query_status(&p))
            .await
            .expect("client")
            .expect("status");
        assert!(snap.ready);
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
    }

    #[test]
    fn refuses_to_replace_a_regular_file() {
        let dir = TempDir::new("status");
        std::fs::create_dir_all(&dir.0).expect("dir");
        let path = status_socket_path_in(&dir.0, "tg2");
        std::fs::write(&path, "precious").expect("write");
        assert!(matches!(
            StatusSocket::bind(&path),
            Err(StatusError::NotASocket { .. })
        ));
        assert_eq!(std::fs::read_to_string(&path).expect("kept"), "precious");
    }

    #[test]
    fn dropping_the_socket_leaves_a_replacement_alone() {
        let dir = TempDir::new("status");
        let path = status_socket_path_in(&dir.0, "tg3");
        let socket = StatusSocket::bind(&path).expect("bind");
        // Someone else took the path over (e.g. a newer daemon after removing ours).
        std::fs::remove_file(&path).expect("rm");
        std::fs::write(&path, "other").expect("write");
        drop(socket);
        assert!(path.exists());
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

    /// Answers every reload with the next of its results and counts the calls.
    struct FakeReloader {
        answers: parking_lot::Mutex<Vec<Result<ReloadOutcome, String>>>,
        calls: AtomicUsize,
    }
    impl Reloader for FakeReloader {
        fn reload(
            &self,
        ) -> Pin<Box<dyn Future<Output = Result<ReloadOutcome, String>> + Send + '_>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let next = self.answers.lock().remove(0);
            Box::pin(async move {
                // The client waits for the outcome, not just for the request to be queued.
                tokio::time::sleep(Duration::from_millis(50)).await;
                next
            })
        }
    }

    #[test]
    fn request_lines() {
        assert_eq!(parse_request(""), Ok(Request::Status));
        assert_eq!(parse_request("status\n"), Ok(Request::Status));
        assert_eq!(parse_request("reload\n"), Ok(Request::Reload));
        let err = parse_request("restart\n").expect_err("unknown");
        assert!(err.contains("\"restart\""), "{err}");
    }

    #[tokio::test]
    async fn reload_requests_get_the_outcome_and_old_clients_the_snapshot() {
        let dir = TempDir::new("status");
        let path = status_socket_path_in(&dir.0, "tg5");
        let socket = StatusSocket::bind(&path).expect("bind");
        let reloader = Arc::new(FakeReloader {
            answers: parking_lot::Mutex::new(vec![
                Ok(ReloadOutcome::Applied),
                Err("peer[0].public_key: not base64".into()),
                Ok(ReloadOutcome::Unchanged),
            ]),
            calls: AtomicUsize::new(0),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(socket.serve(
            Arc::new(FakeObserve::new()),
            Some(reloader.clone()),
            async move {
                let _ = stop_rx.await;
            },
        ));
        let ask = |p: PathBuf| tokio::task::spawn_blocking(move || request_reload(&p));
        assert_eq!(
            ask(path.clone()).await.expect("client").expect("exchange"),
            Ok(ReloadOutcome::Applied)
        );
        assert_eq!(
            ask(path.clone()).await.expect("client").expect("exchange"),
            Err("peer[0].public_key: not base64".to_string())
        );
        assert_eq!(
            ask(path.clone()).await.expect("client").expect("exchange"),
            Ok(ReloadOutcome::Unchanged)
        );
        assert_eq!(reloader.calls.load(Ordering::Relaxed), 3);

        // A client that sends nothing and keeps its side open (the old protocol) still gets
        // the snapshot, after REQUEST_WAIT.
        let p = path.clone();
        let old = tokio::task::spawn_blocking(move || {
            let mut s = StdUnixStream::connect(&p).expect("connect");
            s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).expect("read");
            serde_json::from_slice::<Snapshot>(&buf).expect("snapshot")
        })
        .await
        .expect("client");
        assert_eq!(old, sample_snapshot());
        // Status requests never reload.
        let p = path.clone();
        tokio::task::spawn_blocking(move || query_status(&p))
            .await
            .expect("client")
            .expect("status");
        assert_eq!(reloader.calls.load(Ordering::Relaxed), 3);
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
    }

    #[tokio::test]
    async fn a_daemon_without_reload_refuses_it() {
        let dir = TempDir::new("status");
        let path = status_socket_path_in(&dir.0, "tg6");
        let socket = StatusSocket::bind(&path).expect("bind");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            socket.serve(Arc::new(FakeObserve::new()), None, async move {
                let _ = stop_rx.await;
            }),
        );
        let p = path.clone();
        let answer = tokio::task::spawn_blocking(move || request_reload(&p))
            .await
            .expect("client")
            .expect("exchange");
        assert_eq!(answer, Err("this daemon cannot reload".to_string()));
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
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
        let own = own_netns_id().expect("procfs");
        assert!(netns_inode(&own).is_some(), "{own}");
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

    /// Connects to `path`, sends `request` (then closes our side unless `hold_open`) and
    /// returns what the server answered before it closed. Blocking.
    fn raw_exchange(path: &Path, request: &[u8], hold_open: bool) -> Vec<u8> {
        use std::io::Write as _;
        let mut s = StdUnixStream::connect(path).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        s.write_all(request).expect("write");
        if !hold_open {
            s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        }
        read_answer(&mut s)
    }

    /// Reads to the end of the stream. A server that closes with our bytes unread resets the
    /// connection after its answer: what came before the reset is the answer.
    fn read_answer(s: &mut StdUnixStream) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk) {
                Ok(0) => return buf,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return buf,
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    fn refusal(answer: &[u8]) -> String {
        let answer: ReloadAnswer = serde_json::from_slice(answer)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(answer)));
        answer.into_result().expect_err("refused")
    }

    async fn serve_in(
        dir: &TempDir,
        interface: &str,
    ) -> (
        PathBuf,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), StatusError>>,
    ) {
        let path = status_socket_path_in(&dir.0, interface);
        let socket = StatusSocket::bind(&path).expect("bind");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            socket.serve(Arc::new(FakeObserve::new()), None, async move {
                let _ = stop_rx.await;
            }),
        );
        (path, stop_tx, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unprivileged_caller_cannot_connect() {
        let dir = TempDir::new("ts-status");
        let (path, stop_tx, server) = serve_in(&dir, "ts2").await;
        let p = path.clone();
        let outcome = tokio::task::spawn_blocking(move || crate::test_util::connect_as_nobody(&p))
            .await
            .expect("client");
        match outcome {
            Some(outcome) => assert_eq!(outcome, "EACCES"),
            None => eprintln!("skipped: needs root and /usr/bin/python3"),
        }
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_requests_get_an_error_and_the_server_keeps_answering() {
        let dir = TempDir::new("ts-status");
        let (path, stop_tx, server) = serve_in(&dir, "ts0").await;
        let p = path.clone();
        tokio::task::spawn_blocking(move || {
            // 64 MiB without a newline, as fast as the socket takes it: refused after 4 KiB,
            // the writer gets a broken pipe instead of the daemon a 64 MiB buffer.
            use std::io::Write as _;
            let mut s = StdUnixStream::connect(&p).expect("connect");
            s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
            let mut writer = s.try_clone().expect("clone");
            let flood = std::thread::spawn(move || {
                let chunk = vec![b'a'; 1 << 20];
                let mut sent = 0usize;
                while sent < 64 << 20 {
                    match writer.write(&chunk) {
                        Ok(n) => sent += n,
                        Err(_) => break,
                    }
                }
                sent
            });
            let err = refusal(&read_answer(&mut s));
            assert!(err.contains("longer than 4096 bytes"), "{err}");
            drop(s);
            let sent = flood.join().expect("writer");
            assert!(sent < 64 << 20, "the daemon read all {sent} bytes");

            let err = refusal(&raw_exchange(&p, b"\xff\xfe\xfdreload\n", false));
            assert!(err.contains("not UTF-8"), "{err}");
            // Part of a line, and the client waits: refused once REQUEST_WAIT has passed.
            let err = refusal(&raw_exchange(&p, b"rel", true));
            assert!(err.contains("incomplete request"), "{err}");
            // Part of a line, then the end of the stream: an unknown request.
            let err = refusal(&raw_exchange(&p, b"relo", false));
            assert!(err.contains("unknown request \"relo\""), "{err}");
            // A NUL and control characters are echoed escaped, on one line.
            let answer = raw_exchange(&p, b"st\0a\x1btus\n", false);
            assert_eq!(answer.iter().filter(|b| **b == b'\n').count(), 1);
            assert!(refusal(&answer).contains("unknown request"));
            // And the server still answers a real client.
            assert!(query_status(&p).expect("status").ready);
        })
        .await
        .expect("client");
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_hundred_idle_connections_neither_lock_out_a_client_nor_pile_up() {
        let dir = TempDir::new("ts-status");
        let (path, stop_tx, server) = serve_in(&dir, "ts1").await;
        let p = path.clone();
        tokio::task::spawn_blocking(move || {
            // Clients that connect and say nothing, as a stuck script leaves them.
            let idle: Vec<StdUnixStream> = (0..500)
                .map(|_| StdUnixStream::connect(&p).expect("connect"))
                .collect();
            let start = crate::shell::clock::now();
            let snap = query_status(&p).expect("status");
            assert!(snap.ready);
            let took = crate::shell::clock::since(start);
            assert!(took < Duration::from_secs(1), "status took {took:?}");
            // The daemon held at most its cap: the idle connections beyond it were closed
            // without an answer (end of stream), not queued for one. An answer counts as held.
            std::thread::sleep(Duration::from_millis(200));
            let mut still_held = 0;
            for mut s in idle {
                s.set_nonblocking(true).expect("nonblocking");
                let mut byte = [0u8; 1];
                match s.read(&mut byte) {
                    Ok(0) => {}
                    Ok(_) => still_held += 1,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => still_held += 1,
                    Err(e) => panic!("read: {e}"),
                }
            }
            assert!(
                still_held <= MAX_STATUS_CONNECTIONS,
                "{still_held} idle connections held open"
            );
        })
        .await
        .expect("client");
        let _ = stop_tx.send(());
        server.await.expect("no panic").expect("served");
    }
}
