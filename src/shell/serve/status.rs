//! The status socket's server (`/var/run/tunnelgate/<interface>.sock`): one JSON
//! [`Snapshot`](crate::telemetry::Snapshot) per connection, or a reload and its [`ReloadAnswer`]. The protocol is
//! [`crate::telemetry::status`]; limits: a request line of at most [`MAX_REQUEST_BYTES`] and
//! [`super::policy::STATUS`]'s connections at once; a line too long, not UTF-8 or cut off gets
//! an error answer.

use std::future::Future;
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

use super::accept::{self, Conn, LocalListener, Policy};
use super::local_socket::{self, ClaimError, ClaimFailed, Claimant, ClaimedPath};
use crate::telemetry::status::{
    request_from_bytes, ReloadAnswer, Reloader, Request, StatusError, IO_TIMEOUT,
    MAX_REQUEST_BYTES, REQUEST_WAIT,
};
use crate::telemetry::Observe;

/// The status socket's connection policy. A `status` or `reload` holds a connection for well
/// under a second (a reload: until it is applied); at the cap a newcomer closes the connection
/// that has waited longest for its request line, so a client that connects and says nothing
/// cannot lock the others out, and a reload in progress is never cut.
pub const POLICY: Policy = super::policy::STATUS.connections;

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
    pub fn bind(path: &Path) -> Result<StatusSocket, ClaimFailed> {
        StatusSocket::bind_with(local_socket::claim(path), None)
    }

    /// [`StatusSocket::bind`] for the status socket of interface `interface`: a holder whose
    /// interface is gone (a daemon shutting down) is waited for up to a second
    /// ([`local_socket::claim_for_interface`]).
    pub fn bind_for_interface(path: &Path, interface: &str) -> Result<StatusSocket, ClaimFailed> {
        StatusSocket::bind_with(
            local_socket::claim_for_interface(path, interface),
            Some(interface),
        )
    }

    fn bind_with(
        claimed: Result<(StdUnixListener, ClaimedPath), ClaimError>,
        interface: Option<&str>,
    ) -> Result<StatusSocket, ClaimFailed> {
        let (listener, guard) = claimed.map_err(|e| {
            ClaimFailed::new(
                e,
                &Claimant {
                    socket: "status socket",
                    servers: "tunnelgate",
                    interface,
                },
            )
        })?;
        Ok(StatusSocket { listener, guard })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.guard.path()
    }

    /// Answers every connection's request (a JSON [`Snapshot`](crate::telemetry::Snapshot), or a reload through
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
        self.serve_with(observe, reloader, shutdown, POLICY).await
    }

    /// [`StatusSocket::serve`] under another connection policy (the policy walk's short
    /// limits).
    pub(crate) async fn serve_with(
        self,
        observe: Arc<dyn Observe>,
        reloader: Option<Arc<dyn Reloader>>,
        shutdown: impl Future<Output = ()>,
        policy: Policy,
    ) -> Result<(), StatusError> {
        let StatusSocket { listener, guard } = self;
        let path = guard.path().to_path_buf();
        let listener =
            LocalListener::new(listener, guard, false).map_err(|source| StatusError::Io {
                what: "cannot listen on",
                path,
                source,
            })?;
        accept::serve(
            "status socket",
            listener,
            policy,
            move |stream, conn| answer_connection(stream, observe.clone(), reloader.clone(), conn),
            shutdown,
        )
        .await;
        Ok(())
    }
}

/// Reads one connection's request (at most [`MAX_REQUEST_BYTES`], within [`REQUEST_WAIT`])
/// and answers it: a JSON [`Snapshot`](crate::telemetry::Snapshot), or a [`ReloadAnswer`] for a reload or a refused
/// request. Ends without an answer when the accept loop evicted it while it waited.
async fn answer_connection(
    mut stream: UnixStream,
    observe: Arc<dyn Observe>,
    reloader: Option<Arc<dyn Reloader>>,
    conn: Conn,
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
    // Past its request: a reload in progress is never cut for a newcomer.
    let Some(_busy) = conn.busy() else {
        return; // evicted; the loop closes it
    };
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

#[cfg(test)]
mod tests {
    use crate::telemetry::status::MAX_STATUS_CONNECTIONS;
    use std::io::{ErrorKind, Read as _};
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    use std::os::unix::net::UnixStream as StdUnixStream;
    use std::path::PathBuf;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::shell::status_client::{query_status, request_reload};
    use crate::telemetry::status::{status_socket_path_in, ReloadOutcome};
    use crate::telemetry::tests::{sample_snapshot, FakeObserve};
    use crate::telemetry::Snapshot;
    use crate::test_util::TempDir;

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
            Err(e) if matches!(e.error, ClaimError::InUse { .. }) => {
                assert!(e.to_string().contains("in use"), "{e}");
            }
            other => panic!("expected InUse, got {other:?}"),
        }
        // Named after its interface, the same socket is refused with the hint that the
        // holder may serve that interface from another network namespace.
        match StatusSocket::bind_for_interface(&path, "lo") {
            Err(e) if matches!(e.error, ClaimError::InUse { .. }) => {
                let text = e.to_string();
                assert!(text.contains("\"lo\""), "names the interface: {e}");
                assert!(text.contains("another network namespace"), "{e}");
            }
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
        let err = StatusSocket::bind(&path).expect_err("not a socket");
        assert!(matches!(err.error, ClaimError::NotASocket { .. }), "{err}");
        assert!(err.to_string().contains("not a socket"), "{err}");
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
            None => crate::test_util::skip("needs root and /usr/bin/python3"),
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
