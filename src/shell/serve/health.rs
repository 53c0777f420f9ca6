//! The health endpoint (`[health] listen`): `GET /healthz`, `GET /readyz`, `GET /metrics`, and
//! its listener while the daemon runs ([`HealthEndpoint`]: served at start, moved when a reload
//! names another `health.listen`; when to move it is the core's call, `Action::ServeHealth`).
//!
//! `/healthz` asks [`Observe::liveness`]: 200 while the daemon's event loop and every packet
//! thread have turned within their stall limit, 503 with the reason otherwise ("event loop
//! stalled for 7.2 s", "packet thread tg-tun-rx-0 stuck for 5.1 s"). Being answered at all only
//! proves that some thread of the tokio runtime is free; the event loop (a task on the same
//! runtime, which a blocking call would hold) and the packet loops (threads of their own, which
//! a lock or a blocking write can wedge) can be stuck while this server answers happily, so
//! their heartbeats are checked.
//!
//! `/readyz` asks [`Observe::readiness`]; `/metrics` renders [`Observe::snapshot`] with
//! [`render_metrics`], which never emits keys or peer endpoints. Bodies are plain text.
//!
//! Hostile or broken clients (issue 15) cannot starve the probes; connections follow the one
//! policy of the accept loop ([`super::accept`]) with the values of [`Limits::DEFAULT`]:
//! - every connection gets the policy's idle timeout from its accept, or from its last
//!   request, to deliver a complete request head and take the response; one that sends
//!   nothing, or dribbles bytes, is closed then. That is each request's one deadline: hyper's
//!   own header timer is off;
//! - at most its `max_connections` are open; a new connection at the cap closes the one idle
//!   longest ([`accept::pick_eviction`]) at once instead of waiting in the backlog, so a probe
//!   always gets in and is the last to be evicted; at most one descriptor beyond the cap;
//! - a `/metrics` body longer than [`Limits::max_metrics_bytes`] is cut at a line boundary
//!   and ends with a `# tunnelgate: /metrics truncated ...` comment ([`bound_metrics`]).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;

use super::accept::{self, Conn, Policy};

use crate::shell::fatal::{guarded, Fatals, Part};
use crate::telemetry::http::{bound_metrics, OPENMETRICS_TEXT, PLAIN_TEXT, PROMETHEUS_TEXT};
use crate::telemetry::{render_metrics, Observe};

/// How much the health endpoint gives each client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The connection policy. Its idle timeout runs from the accept, or from the last request,
    /// until a complete request head has arrived and the response to it has been handed to the
    /// kernel; its drain timeout is how long open connections get to finish at shutdown.
    pub policy: Policy,
    /// The longest `/metrics` body.
    pub max_metrics_bytes: usize,
}

impl Limits {
    /// What the daemon uses. 256 connections is far more than any set of probes and scrapers,
    /// and few enough descriptors for the default 1024 limit. 5 s covers a slow scraper on a
    /// loaded node; the kubelet's probes time out after 1 s by default and send their request
    /// at once. 4 MiB holds the metrics of thousands of peers.
    pub const DEFAULT: Limits = Limits {
        policy: super::policy::HEALTH.connections,
        max_metrics_bytes: 4 * 1024 * 1024,
    };
}

/// The listen backlog of the health port: a slowloris fills the accept queue while the
/// accept loop makes room, and a full queue drops the probes' SYNs (the standard library's
/// and mio's default is 128). The kernel caps it at `net.core.somaxconn` (4096 by default).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Serves the health endpoint on `listener` until `shutdown` completes, then stops accepting,
/// lets in-flight requests finish for up to a second and returns. The daemon binds the listener
/// itself, so a bad or busy address fails the start rather than this task.
pub async fn serve_health(
    listener: TcpListener,
    observe: Arc<dyn Observe>,
    shutdown: impl Future<Output = ()>,
) {
    serve_health_with(listener, observe, shutdown, Limits::DEFAULT).await;
}

/// [`serve_health`] with other [`Limits`] (tests use short timeouts).
pub async fn serve_health_with(
    listener: TcpListener,
    observe: Arc<dyn Observe>,
    shutdown: impl Future<Output = ()>,
    limits: Limits,
) {
    accept::serve(
        "health endpoint",
        listener,
        limits.policy,
        move |stream, conn| serve_connection(stream, conn, observe.clone(), limits),
        shutdown,
    )
    .await;
}

/// One connection: HTTP/1.1 with keep-alive, until the client leaves or shutdown starts (the
/// accept loop closes it when it idles past the limit or is evicted).
async fn serve_connection(
    stream: tokio::net::TcpStream,
    mut conn: Conn,
    observe: Arc<dyn Observe>,
    limits: Limits,
) {
    let service = {
        let active = conn.activity();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            active.touch();
            let resp = route(&req, &*observe, limits.max_metrics_bytes);
            async move { Ok::<_, Infallible>(resp) }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        // One deadline per request, the policy table's idle timeout, which the accept loop
        // runs from the accept or the last request: no second timer for the head beside it
        // (hyper's default, 30 s, would need a timer; none is given).
        .header_read_timeout(None)
        .max_buf_size(super::policy::HEALTH.max_request_bytes);
    let http = builder.serve_connection(TokioIo::new(stream), service);
    let mut http = pin!(http);
    tokio::select! {
        // Errors here are clients misbehaving (bad requests, resets, timeouts).
        res = http.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(error = %e, "health endpoint: connection ended");
            }
        }
        () = conn.stopping() => {
            http.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.policy.drain_timeout, http.as_mut()).await;
        }
    }
}

/// The response to one request. Only the method, path and `Accept` header matter.
fn route<B>(
    req: &Request<B>,
    observe: &dyn Observe,
    max_metrics_bytes: usize,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let known = matches!(path, "/healthz" | "/readyz" | "/metrics");
    if !known {
        return text(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match path {
        "/healthz" => match observe.liveness() {
            Ok(()) => text(StatusCode::OK, "ok\n"),
            Err(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not alive: {}\n", one_line(&reason)),
            ),
        },
        "/readyz" => match observe.readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {}\n", one_line(&reason)),
            ),
        },
        _ => {
            let body = bound_metrics(
                render_metrics(&observe.metrics_snapshot(), crate::shell::clock::unix_now()),
                max_metrics_bytes,
            );
            let openmetrics = req
                .headers()
                .get_all(ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/openmetrics-text"));
            let (body, ct) = if openmetrics {
                (body, OPENMETRICS_TEXT)
            } else {
                (crate::telemetry::classic_text(&body), PROMETHEUS_TEXT)
            };
            let mut r = text(StatusCode::OK, body);
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            r
        }
    }
}

/// Keeps a multi-line reason on one line, as probes and `curl` users expect.
fn one_line(s: &str) -> String {
    s.trim().replace(['\r', '\n'], " ")
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PLAIN_TEXT));
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// How long a stop waits for the closed listeners' open requests to finish.
const RETIRED_DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Binds `addr` for the health endpoint without listening yet: the address is taken (a busy
/// one fails here), and a connection to it is refused until [`listen`].
pub fn reserve(addr: SocketAddr) -> io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // A listener this daemon closed on the same port does not block the next one.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// Listens on a [`reserve`]d socket with the health endpoint's backlog.
pub fn listen(socket: TcpSocket) -> io::Result<TcpListener> {
    socket.listen(LISTEN_BACKLOG)
}

/// [`reserve`] and [`listen`]: the listener the daemon binds at start, before the tunnel comes
/// up, so a busy address fails the start.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    listen(reserve(addr)?)
}

/// One listener being served.
struct Serving {
    addr: SocketAddr,
    /// A duplicate of the listener's descriptor: `shutdown(2)` on it stops the listener at
    /// once (new connections are refused), whatever the serving task is doing.
    close: OwnedFd,
    stop: oneshot::Sender<()>,
    done: Done,
}

/// A listener's serving thread, awaited from the daemon's runtime: it says when it is done,
/// and is joined then.
struct Done {
    finished: oneshot::Receiver<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Done {
    fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    async fn wait(self) {
        let _ = self.finished.await;
        // Its last act was to say so: the join waits for nothing but the thread's exit.
        let _ = self.thread.join();
    }
}

/// The daemon's health endpoint: at most one listener, moved by [`HealthEndpoint::switch`].
/// Its serving task's panic is recorded as its death (`shell::fatal`): the process stops, exit
/// 1, rather than run on with probes that find nothing listening.
pub struct HealthEndpoint {
    observe: Arc<dyn Observe>,
    fatals: Fatals,
    serving: Option<Serving>,
    /// The address a reload reserved before the core took the new file.
    reserved: Option<(SocketAddr, TcpSocket)>,
    /// Threads of closed listeners, still answering the requests they had accepted.
    retired: Vec<Done>,
}

impl HealthEndpoint {
    pub fn new(observe: Arc<dyn Observe>, fatals: Fatals) -> HealthEndpoint {
        HealthEndpoint {
            observe,
            fatals,
            serving: None,
            reserved: None,
            retired: Vec::new(),
        }
    }

    /// Starts serving `listener` (made on a tokio runtime) on a thread of its own, with a
    /// runtime of its own: the endpoint that says the event loop stalled must not wait on the
    /// runtime that loop stalls (a blocking call holds one of its two workers, and the other
    /// may sleep with nobody polling the sockets: `/healthz` then went unanswered for the
    /// whole stall).
    pub fn serve(&mut self, listener: TcpListener) -> io::Result<SocketAddr> {
        let addr = listener.local_addr()?;
        let close = listener.as_fd().try_clone_to_owned()?;
        let listener = listener.into_std()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let (finished, finished_rx) = oneshot::channel::<()>();
        let observe = self.observe.clone();
        let fatals = self.fatals.clone();
        let thread = std::thread::Builder::new()
            .name("tg-health".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => runtime.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                let _ = fatals.died(format!("{} failed: {e}", Part::Health.name()));
                                return;
                            }
                        };
                        let served = serve_health(listener, observe, async move {
                            let _ = stopped.await;
                        });
                        // Ends at a stop or a move; a panic is the death `guarded` records.
                        let _ = guarded(&fatals, Part::Health, served).await;
                    }),
                    Err(e) => {
                        let _ = fatals.died(format!(
                            "{} failed: cannot start its runtime: {e}",
                            Part::Health.name()
                        ));
                    }
                }
                let _ = finished.send(());
            })?;
        self.close_current();
        self.serving = Some(Serving {
            addr,
            close,
            stop,
            done: Done {
                finished: finished_rx,
                thread,
            },
        });
        Ok(addr)
    }

    /// Before a new file is handed to the core: when it names another address than
    /// `current` (the one served now), take that address, so that a reload to an address
    /// that cannot be bound is refused while the old configuration still runs. An address
    /// busy only because our own listener holds its port is moved by closing that first.
    pub fn prepare(
        &mut self,
        current: Option<SocketAddr>,
        want: Option<SocketAddr>,
    ) -> Result<(), String> {
        self.reserved = None;
        let Some(addr) = want.filter(|w| Some(*w) != current) else {
            return Ok(());
        };
        match reserve(addr) {
            Ok(socket) => {
                self.reserved = Some((addr, socket));
                Ok(())
            }
            Err(e) if self.holds_port_of(addr, &e) => Ok(()),
            Err(e) => Err(format!("health.listen {addr}: cannot bind: {e}")),
        }
    }

    /// Forgets a reservation the core did not use (it refused the file).
    pub fn forget_reservation(&mut self) {
        self.reserved = None;
    }

    /// Moves the endpoint to `want` (`None`: stops it): binds the new listener, then closes
    /// the old one. When the old one holds the port, it is closed first; if the new one then
    /// cannot be bound, the old address is bound again. Returns the address now served.
    pub fn switch(&mut self, want: Option<SocketAddr>) -> Result<Option<SocketAddr>, String> {
        let Some(addr) = want else {
            self.close_current();
            return Ok(None);
        };
        let reserved = self.reserved.take().filter(|(a, _)| *a == addr);
        let socket = match reserved.map_or_else(|| reserve(addr), |(_, s)| Ok(s)) {
            Ok(s) => s,
            Err(e) if self.holds_port_of(addr, &e) => {
                let old = self.serving.as_ref().map(|s| s.addr);
                self.close_current();
                match reserve(addr) {
                    Ok(s) => s,
                    Err(e) => {
                        if let Some(old) = old {
                            if let Err(again) = bind(old).and_then(|l| self.serve(l)) {
                                tracing::error!(listen = %old, error = %again, "Cannot bind the old health address again: the health endpoint is off");
                            }
                        }
                        return Err(format!("health.listen {addr}: cannot bind: {e}"));
                    }
                }
            }
            Err(e) => return Err(format!("health.listen {addr}: cannot bind: {e}")),
        };
        let listener = listen(socket).map_err(|e| format!("health.listen {addr}: {e}"))?;
        let bound = self
            .serve(listener)
            .map_err(|e| format!("health.listen {addr}: {e}"))?;
        Ok(Some(bound))
    }

    /// Stops the listener at once (the requests it had accepted are still answered): a stop
    /// does it before the input guard is removed.
    pub fn close(&mut self) {
        self.close_current();
    }

    /// Closes the listener and waits (a bounded time) for the requests it had accepted.
    pub async fn stop(&mut self) {
        self.close_current();
        let retired = std::mem::take(&mut self.retired);
        let waits = retired.into_iter().map(Done::wait);
        let _ = tokio::time::timeout(RETIRED_DRAIN_WAIT, futures::future::join_all(waits)).await;
    }

    /// Whether `error` binding `addr` comes from our own listener holding that port.
    fn holds_port_of(&self, addr: SocketAddr, error: &io::Error) -> bool {
        error.kind() == io::ErrorKind::AddrInUse
            && self
                .serving
                .as_ref()
                .is_some_and(|s| s.addr.port() == addr.port())
    }

    /// Stops the current listener at once (its task finishes the requests it had accepted).
    fn close_current(&mut self) {
        let Some(old) = self.serving.take() else {
            return;
        };
        if let Err(e) =
            nix::sys::socket::shutdown(old.close.as_raw_fd(), nix::sys::socket::Shutdown::Both)
        {
            tracing::warn!(listen = %old.addr, error = %e, "Cannot shut the old health listener down");
        }
        let _ = old.stop.send(());
        self.retired.retain(|t| !t.is_finished());
        self.retired.push(old.done);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;
    use crate::telemetry::tests::{
        parse_prometheus, value, FakeObserve, ENDPOINT_A, ENDPOINT_B, PEER_A,
    };

    struct Reply {
        status: u16,
        head: String,
        body: String,
    }

    /// One HTTP/1.1 request on a fresh blocking connection; reads until the server closes.
    fn raw(addr: std::net::SocketAddr, request: &str) -> Reply {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(request.as_bytes()).expect("write");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("read");
        let text = String::from_utf8(buf).expect("utf-8");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("status code");
        Reply {
            status,
            head: head.to_string(),
            body: body.to_string(),
        }
    }

    fn get(addr: std::net::SocketAddr, path: &str) -> Reply {
        raw(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
    }

    /// Runs a blocking client closure off the runtime thread.
    async fn call<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        tokio::task::spawn_blocking(f).await.expect("client")
    }

    #[tokio::test]
    async fn serves_health_ready_and_metrics() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let fake = Arc::new(FakeObserve::new());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_health(listener, fake.clone(), async move {
            let _ = stop_rx.await;
        }));

        let r = call(move || get(addr, "/healthz")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "ok\n");

        let r = call(move || get(addr, "/readyz")).await;
        assert_eq!((r.status, r.body.as_str()), (200, "ready\n"));

        fake.set_not_ready(Some("rules: apply failed: nft: exit status 1\nmore"));
        let r = call(move || get(addr, "/readyz")).await;
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body,
            "not ready: rules: apply failed: nft: exit status 1 more\n"
        );
        // Liveness does not depend on readiness.
        let r = call(move || get(addr, "/healthz")).await;
        assert_eq!(r.status, 200);
        fake.set_not_alive(Some("packet thread tg-tun-rx stuck for 7.0 s"));
        let r = call(move || get(addr, "/healthz")).await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (503, "not alive: packet thread tg-tun-rx stuck for 7.0 s\n")
        );
        fake.set_not_alive(None);
        let r = call(move || get(addr, "/healthz")).await;
        assert_eq!(r.status, 200);

        let r = call(move || get(addr, "/metrics")).await;
        assert_eq!(r.status, 200);
        let head = r.head.to_ascii_lowercase();
        assert!(
            head.contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        let samples = parse_prometheus(&r.body).unwrap_or_else(|e| panic!("{e}\n{}", r.body));
        assert_eq!(value(&samples, "tunnelgate_ready", &[]), Some(0.0));
        assert_eq!(
            value(
                &samples,
                "tunnelgate_peer_rx_bytes_total",
                &[("peer", PEER_A)]
            ),
            Some(123_456.0)
        );
        for leak in [ENDPOINT_A, ENDPOINT_B] {
            assert!(!r.body.contains(leak));
        }

        let r = call(move || {
            raw(
                addr,
                "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\nConnection: close\r\n\r\n",
            )
        })
        .await;
        assert!(r
            .head
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"));

        let r = call(move || get(addr, "/nope")).await;
        assert_eq!(r.status, 404);
        let r = call(move || get(addr, "/healthz?verbose=1")).await;
        assert_eq!(r.status, 200);
        let r = call(move || {
            raw(
                addr,
                "POST /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
        })
        .await;
        assert_eq!(r.status, 405);
        assert!(r.head.to_ascii_lowercase().contains("allow: get, head"));
        let r = call(move || {
            raw(
                addr,
                "HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
        })
        .await;
        assert_eq!((r.status, r.body.as_str()), (200, ""));

        // Garbage gets a 400 (or a closed connection), and the server keeps serving.
        let _ = call(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let _ = s.write_all(b"\x16\x03\x01\x00\xa5garbage\r\n\r\n");
            let mut buf = Vec::new();
            let _ = s.read_to_end(&mut buf);
            buf
        })
        .await;
        // A client that connects and says nothing does not block others.
        let idle = std::net::TcpStream::connect(addr).expect("connect");
        let r = call(move || get(addr, "/healthz")).await;
        assert_eq!(r.status, 200);

        let _ = stop_tx.send(());
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("stops promptly despite an idle client")
            .expect("no panic");
        drop(idle);
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "still listening"
        );
    }

    #[tokio::test]
    async fn keep_alive_connections_serve_several_requests() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_health(
            listener,
            Arc::new(FakeObserve::new()),
            async move {
                let _ = stop_rx.await;
            },
        ));
        let body = call(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            s.write_all(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
            .expect("write");
            let mut buf = String::new();
            s.read_to_string(&mut buf).expect("read");
            buf
        })
        .await;
        assert_eq!(body.matches("HTTP/1.1 200 OK").count(), 2, "{body}");
        assert!(body.ends_with("ready\n"), "{body}");
        let _ = stop_tx.send(());
        server.await.expect("no panic");
    }

    /// The server with short limits on an ephemeral port; the sender stops it.
    async fn start_with(
        limits: Limits,
    ) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_health_with(
            listener,
            Arc::new(FakeObserve::new()),
            async move {
                let _ = stop_rx.await;
            },
            limits,
        ));
        (addr, stop_tx)
    }

    /// Whether the server closed `s` within `within` (EOF or reset), reading whatever it sent.
    fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
        s.set_read_timeout(Some(within)).expect("timeout");
        let mut buf = [0u8; 512];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
                Err(_) => return true,
            }
        }
    }

    #[tokio::test]
    async fn silent_and_dribbling_clients_are_closed_after_the_idle_timeout() {
        let limits = Limits {
            policy: Policy {
                idle_timeout: Duration::from_millis(300),
                ..Limits::DEFAULT.policy
            },
            ..Limits::DEFAULT
        };
        let (addr, _stop) = start_with(limits).await;
        let (silent, dribbled) = call(move || {
            let mut silent = std::net::TcpStream::connect(addr).expect("connect");
            let mut dribbler = std::net::TcpStream::connect(addr).expect("connect");
            let started = crate::shell::clock::now();
            // One byte every 50 ms: never a complete head.
            let mut dribble_closed = false;
            while crate::shell::clock::since(started) < Duration::from_secs(3) {
                if dribbler.write_all(b"G").is_err() {
                    dribble_closed = true;
                    break;
                }
                if closed_within(&mut dribbler, Duration::from_millis(50)) {
                    dribble_closed = true;
                    break;
                }
            }
            let dribbled = dribble_closed.then(|| crate::shell::clock::since(started));
            (closed_within(&mut silent, Duration::from_secs(2)), dribbled)
        })
        .await;
        assert!(silent, "a client that sends nothing is closed");
        let dribbled = dribbled.expect("a client that dribbles bytes is closed");
        assert!(dribbled < Duration::from_secs(2), "{dribbled:?}");
    }

    #[tokio::test]
    async fn at_the_cap_the_longest_idle_connection_makes_room() {
        let limits = Limits {
            policy: Policy {
                max_connections: 4,
                ..Limits::DEFAULT.policy
            },
            ..Limits::DEFAULT
        };
        let (addr, _stop) = start_with(limits).await;
        let r = call(move || {
            let mut idle: Vec<std::net::TcpStream> = (0..4)
                .map(|_| {
                    let s = std::net::TcpStream::connect(addr).expect("connect");
                    std::thread::sleep(Duration::from_millis(20));
                    s
                })
                .collect();
            // A fifth client is served at once, and the first idle one was closed for it.
            let r = get(addr, "/readyz");
            let first_closed = closed_within(&mut idle[0], Duration::from_secs(1));
            let last_open = !closed_within(&mut idle[3], Duration::from_millis(200));
            (r.status, first_closed, last_open)
        })
        .await;
        assert_eq!(r, (200, true, true));
    }
}
