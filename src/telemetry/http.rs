//! The health endpoint (`[health] listen`): `GET /healthz`, `GET /readyz`, `GET /metrics`.
//!
//! `/healthz` asks [`Observe::liveness`]: 200 while every packet thread has woken within its
//! stall limit, 503 with the stuck thread's name otherwise. Being answered at all only proves
//! the tokio runtime is alive; the packet loops run on their own threads and can wedge (a lock,
//! a blocking write) while this runtime answers happily, so their heartbeats are checked.
//!
//! `/readyz` asks [`Observe::readiness`]; `/metrics` renders [`Observe::snapshot`] with
//! [`render_metrics`], which never emits keys or peer endpoints. Bodies are plain text.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use super::{now_unix, render_metrics, Observe};

/// The classic Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// OpenMetrics text, for scrapers that ask for it (the classic body is
/// [`super::classic_text`] of it).
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PLAIN_TEXT: &str = "text/plain; charset=utf-8";

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;
/// A client that has not sent a complete request head by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long open connections get to finish once shutdown starts.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Serves the health endpoint on `listener` until `shutdown` completes, then stops accepting,
/// lets in-flight requests finish for up to a second and returns. The daemon binds the listener
/// itself, so a bad or busy address fails the start rather than this task.
pub async fn serve_health(
    listener: TcpListener,
    observe: Arc<dyn Observe>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = pin!(shutdown);
    let (stop_tx, stop_rx) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut conns = JoinSet::new();
    loop {
        // Reap finished connection tasks so the set does not grow.
        while conns.try_join_next().is_some() {}
        let permit = tokio::select! {
            () = &mut shutdown => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // the semaphore is never closed
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off rather than spin.
                    tracing::warn!(error = %e, "health endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let observe = observe.clone();
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let resp = route(&req, &*observe);
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(16 * 1024);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = pin!(conn);
            tokio::select! {
                // Errors here are clients misbehaving (bad requests, resets, timeouts).
                res = conn.as_mut() => {
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "health endpoint: connection ended");
                    }
                }
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        conns.abort_all();
    }
}

/// The response to one request. Only the method, path and `Accept` header matter.
fn route<B>(req: &Request<B>, observe: &dyn Observe) -> Response<Full<Bytes>> {
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
            let body = render_metrics(&observe.snapshot(), now_unix());
            let openmetrics = req
                .headers()
                .get_all(ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/openmetrics-text"));
            let (body, ct) = if openmetrics {
                (body, OPENMETRICS_TEXT)
            } else {
                (super::classic_text(&body), PROMETHEUS_TEXT)
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
}
