//! The local status socket behind `tunnelgate status`: the daemon serves one JSON [`Snapshot`]
//! per connection at `/var/run/tunnelgate/<interface>.sock` (mode 0600, so root only, like the
//! WireGuard UAPI socket), and [`query_status`] reads it.
//!
//! The protocol is deliberately trivial: connect, read to end of stream, parse JSON. The client
//! sends nothing.

use std::future::Future;
use std::io::{ErrorKind, Read as _};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::net::UnixListener;
use tokio::task::JoinSet;

use super::{Observe, Snapshot};
use crate::shell::unix_socket::{self, ClaimError, ClaimedPath};

/// Where status sockets live unless [`RUN_DIR_ENV`] says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/var/run/tunnelgate";
/// Overrides [`DEFAULT_RUN_DIR`] (tests, unprivileged runs).
pub const RUN_DIR_ENV: &str = "TUNNELGATE_RUN_DIR";

/// How long either side waits for the other.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the status socket could not be served or queried. Messages are complete sentences for
/// the user.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("no tunnelgate daemon for interface {interface}: {} not found (is it running?)", .path.display())]
    NotRunning { interface: String, path: PathBuf },
    #[error("no tunnelgate daemon for interface {interface}: nothing listens on {} (stale socket; is it running?)", .path.display())]
    Stale { interface: String, path: PathBuf },
    #[error("permission denied on {} (run as root)", .path.display())]
    PermissionDenied { path: PathBuf },
    #[error("{} is in use by another running tunnelgate daemon", .path.display())]
    InUse { path: PathBuf },
    #[error("{} exists and is not a socket; refusing to replace it", .path.display())]
    NotASocket { path: PathBuf },
    #[error("the daemon did not answer on {} within {} s", .path.display(), IO_TIMEOUT.as_secs())]
    Timeout { path: PathBuf },
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
    let dir = std::env::var_os(RUN_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR));
    status_socket_path_in(&dir, interface)
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
    /// Binds `path` with mode 0600 ([`unix_socket::claim`]), creating its directory (0755) if
    /// needed. A stale socket left by a dead daemon is replaced; a live one (something answers
    /// a connect) is not, nor is anything that is not a socket. Needs no runtime, so the daemon can call it before it
    /// reports ready and fail the start on an error.
    pub fn bind(path: &Path) -> Result<StatusSocket, StatusError> {
        let io = |what, path, source| StatusError::Io { what, path, source };
        let (listener, guard) = unix_socket::claim(path).map_err(|e| match e {
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

    /// Answers every connection with one JSON [`Snapshot`] until `shutdown` completes, then
    /// removes the socket file. Must run on a tokio runtime.
    pub async fn serve(
        self,
        observe: Arc<dyn Observe>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StatusError> {
        let StatusSocket { listener, guard } = self;
        let listener = UnixListener::from_std(listener).map_err(|source| StatusError::Io {
            what: "cannot listen on",
            path: guard.path().to_path_buf(),
            source,
        })?;
        let mut shutdown = pin!(shutdown);
        let mut conns = JoinSet::new();
        loop {
            while conns.try_join_next().is_some() {}
            let mut stream = tokio::select! {
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
            let observe = observe.clone();
            conns.spawn(async move {
                let mut body = match serde_json::to_vec(&observe.snapshot()) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, "status socket: cannot encode the snapshot");
                        return;
                    }
                };
                body.push(b'\n');
                let sent = tokio::time::timeout(IO_TIMEOUT, async {
                    stream.write_all(&body).await?;
                    stream.shutdown().await
                })
                .await;
                if !matches!(sent, Ok(Ok(()))) {
                    tracing::debug!("status socket: client went away");
                }
            });
        }
        drop(listener);
        conns.abort_all();
        drop(guard);
        Ok(())
    }
}

/// Binds `path` ([`StatusSocket::bind`]) and serves it ([`StatusSocket::serve`]) until
/// `shutdown`. Prefer the two steps when a bind error must fail the daemon's start.
pub async fn serve_status(
    path: &Path,
    observe: Arc<dyn Observe>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StatusError> {
    StatusSocket::bind(path)?.serve(observe, shutdown).await
}

/// Asks the daemon serving `path` for its [`Snapshot`] (blocking, at most a few seconds).
pub fn query_status(path: &Path) -> Result<Snapshot, StatusError> {
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
    stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).map_err(io)?;
    serde_json::from_slice(&buf).map_err(|source| StatusError::Decode {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::telemetry::tests::{sample_snapshot, FakeObserve};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new() -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "tg-status-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

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
        let dir = TempDir::new();
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
        let server = tokio::spawn(socket.serve(fake.clone(), async move {
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
        let dir = TempDir::new();
        std::fs::create_dir_all(&dir.0).expect("dir");
        let path = status_socket_path_in(&dir.0, "tg1");
        // A socket file nobody listens on, as a killed daemon leaves behind.
        drop(StdUnixListener::bind(&path).expect("bind"));
        let err = query_status(&path).expect_err("stale");
        assert!(matches!(err, StatusError::Stale { .. }), "{err}");

        let socket = StatusSocket::bind(&path).expect("replaces stale socket");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(socket.serve(Arc::new(FakeObserve::new()), async move {
            let _ = stop_rx.await;
        }));
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
        let dir = TempDir::new();
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
        let dir = TempDir::new();
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
        let dir = TempDir::new();
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
}
