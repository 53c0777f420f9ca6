//! Every local server's limits in one table, beside the accept loop ([`super::accept`]) that
//! enforces their connection part: how many connections at once (a newcomer at the cap closes
//! the idle-longest, [`Policy::eviction_batch`] at a time, never one busy with a request), how
//! long one may show no activity, and how long open ones get at shutdown; and how large one
//! request may be, which each server's framing enforces. A server's values are changed here,
//! not in its module.
//!
//! The idle timeout is each request's one deadline: from the accept, or from the last request
//! (its head), a client has that long to complete its next request (the accept loop closes
//! the connection then). No handler adds a read deadline of its own: the health endpoint turns
//! hyper's header timer off. The one other wait is the status protocol's own
//! (`telemetry::status::REQUEST_WAIT`, 300 ms), which is not a limit: a client that has said
//! nothing by then (older clients send no request line) is answered with the status, and one
//! that has sent part of a line is told it was incomplete.

use std::time::Duration;

use super::accept::Policy;

/// One local server's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerPolicy {
    /// The server, as its log lines name it.
    pub server: &'static str,
    /// Connection cap, idle timeout (each request's one deadline), drain time at stop.
    pub connections: Policy,
    /// The largest request: past it the server answers with an error (UAPI `-EMSGSIZE`, the
    /// status protocol's error line; hyper refuses an oversized HTTP head) and closes the connection.
    pub max_request_bytes: usize,
}

/// UAPI (`/var/run/wireguard/<name>.sock`): a `wg` command's connection lasts milliseconds
/// and is the most recently active, so clients that connect and say nothing cannot lock `wg`
/// out; 30 s is how long the client side waits for a reply too. A request may be large (`wg
/// setconf` of one peer with 130k allowed IPs is about 3 MB; this is 10M allowed IPs) and only
/// root can connect: the bound that protects the daemon from a runaway client is the line
/// length (`serve::uapi::MAX_LINE_BYTES`).
pub const UAPI: ServerPolicy = ServerPolicy {
    server: "UAPI",
    connections: Policy {
        max_connections: 64,
        idle_timeout: Duration::from_secs(30),
        drain_timeout: Duration::ZERO,
    },
    max_request_bytes: 256 << 20,
};

/// The status socket: a `status` or `reload` holds a connection for well under a second (a
/// reload: until it is applied); at the cap a newcomer closes the connection that has waited
/// longest for its request line, and a reload in progress is never cut. The values are the
/// status protocol's (`telemetry::status`), which its client shares; the protocol's 300 ms
/// wait for a request line decides what was asked, within the idle timeout (see above), and
/// the answer's write, made while the connection is busy and so out of the idle timer's reach,
/// is bounded by the same 5 s (`IO_TIMEOUT`).
pub const STATUS: ServerPolicy = ServerPolicy {
    server: "status socket",
    connections: Policy {
        max_connections: crate::telemetry::status::MAX_STATUS_CONNECTIONS,
        idle_timeout: crate::telemetry::status::IO_TIMEOUT,
        drain_timeout: Duration::ZERO,
    },
    max_request_bytes: crate::telemetry::status::MAX_REQUEST_BYTES,
};

/// The health endpoint (`/healthz`, `/readyz`, `/metrics`): 256 connections is far more than
/// any set of probes and scrapers, and few enough descriptors for the default 1024 limit; 5 s
/// covers a slow scraper on a loaded node (the kubelet's probes time out after 1 s by default
/// and send their request at once); in-flight requests get 1 s at stop. A request head is
/// bounded by hyper's read buffer, and has the idle timeout to arrive (hyper's header timer
/// is off).
pub const HEALTH: ServerPolicy = ServerPolicy {
    server: "health endpoint",
    connections: Policy {
        max_connections: 256,
        idle_timeout: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(1),
    },
    max_request_bytes: 16 * 1024,
};

/// The table.
pub const ALL: [ServerPolicy; 3] = [UAPI, STATUS, HEALTH];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shell::serve::health::{serve_health_with, Limits};
    use crate::shell::serve::status::StatusSocket;
    use crate::shell::serve::uapi::UapiServer;
    use crate::telemetry::tests::FakeObserve;
    use crate::test_util::TempDir;
    use crate::uapi::{DeviceSnapshot, DeviceUpdate, UapiError, UapiHandler};
    use std::path::PathBuf;
    use std::sync::Arc;
    use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

    /// A server's own row with walkable limits: 2 connections, 300 ms idle.
    fn short(row: ServerPolicy, max_request_bytes: usize) -> ServerPolicy {
        ServerPolicy {
            connections: Policy {
                max_connections: 2,
                idle_timeout: Duration::from_millis(300),
                ..row.connections
            },
            max_request_bytes,
            ..row
        }
    }

    /// How long a step waits for what its limit promises (idle is 300 ms).
    const WITHIN: Duration = Duration::from_secs(3);

    trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
    impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

    enum Address {
        Unix(PathBuf),
        Tcp(std::net::SocketAddr),
    }

    /// One server under walk: where it listens, and what its protocol looks like.
    struct Walked {
        policy: ServerPolicy,
        address: Address,
        /// A complete request, answered at once.
        request: Vec<u8>,
        /// The start of a request, never completed.
        partial: Vec<u8>,
        /// Whether `reply` answers `request`.
        answered: fn(&[u8]) -> bool,
        /// A request over `policy.max_request_bytes`.
        oversized: Vec<u8>,
        /// Whether `reply` refuses `oversized`.
        refused: fn(&[u8]) -> bool,
        _stop: tokio::sync::oneshot::Sender<()>,
        _dir: Option<TempDir>,
    }

    impl Walked {
        async fn connect(&self) -> Box<dyn Duplex> {
            match &self.address {
                Address::Unix(path) => Box::new(
                    tokio::net::UnixStream::connect(path)
                        .await
                        .expect("connect"),
                ),
                Address::Tcp(addr) => {
                    Box::new(tokio::net::TcpStream::connect(addr).await.expect("connect"))
                }
            }
        }
    }

    /// Everything the server sent until it closed `stream`, or `None` if it is still open
    /// after `within`.
    async fn closed_within(stream: &mut dyn Duplex, within: Duration) -> Option<Vec<u8>> {
        let deadline = crate::shell::clock::tokio_now() + within;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                Err(_) => return None,
                Ok(Ok(0) | Err(_)) => return Some(got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    struct Device;

    impl UapiHandler for Device {
        fn get(&self) -> DeviceSnapshot {
            DeviceSnapshot::default()
        }
        fn set(&self, _: DeviceUpdate) -> Result<(), UapiError> {
            Ok(())
        }
    }

    fn stop_pair() -> (
        tokio::sync::oneshot::Sender<()>,
        impl std::future::Future<Output = ()>,
    ) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        (stop, async move {
            let _ = stopped.await;
        })
    }

    fn uapi() -> Walked {
        let policy = short(UAPI, 64 * 1024);
        let dir = TempDir::new("policy-uapi");
        let server = UapiServer::bind_in(&dir.0, "tgwalk0").expect("bind");
        let path = server.socket_path().to_path_buf();
        let (stop, stopped) = stop_pair();
        tokio::spawn(server.run_with(Arc::new(Device), stopped, policy));
        // Short lines (the line bound is not what is walked here), past the request bound.
        let mut oversized = b"set=1\n".to_vec();
        while oversized.len() <= policy.max_request_bytes {
            oversized.extend_from_slice(b"listen_port=1\n");
        }
        Walked {
            policy,
            address: Address::Unix(path),
            request: b"get=1\n\n".to_vec(),
            partial: b"get=1\n".to_vec(),
            answered: |reply| reply.ends_with(b"errno=0\n\n"),
            oversized,
            refused: |reply| reply.starts_with(b"errno=-") && !reply.ends_with(b"errno=0\n\n"),
            _stop: stop,
            _dir: Some(dir),
        }
    }

    fn status() -> Walked {
        // The request bound is the status protocol's own (its client shares it).
        let policy = short(STATUS, STATUS.max_request_bytes);
        let dir = TempDir::created("policy-status");
        let path = dir.0.join("tgwalk0.sock");
        let socket = StatusSocket::bind(&path).expect("bind");
        let (stop, stopped) = stop_pair();
        tokio::spawn(socket.serve_with(
            Arc::new(FakeObserve::new()),
            None,
            stopped,
            policy.connections,
        ));
        let mut oversized = vec![b'x'; policy.max_request_bytes + 1];
        oversized.push(b'\n');
        Walked {
            policy,
            address: Address::Unix(path),
            request: b"status\n".to_vec(),
            partial: b"sta".to_vec(),
            answered: |reply| reply.starts_with(b"{\"interface\""),
            oversized,
            refused: |reply| String::from_utf8_lossy(reply).contains("longer than"),
            _stop: stop,
            _dir: Some(dir),
        }
    }

    async fn health() -> Walked {
        let policy = short(HEALTH, HEALTH.max_request_bytes);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = stop_pair();
        tokio::spawn(serve_health_with(
            listener,
            Arc::new(FakeObserve::new()),
            stopped,
            Limits {
                policy: policy.connections,
                ..Limits::DEFAULT
            },
        ));
        let mut oversized = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ".to_vec();
        oversized.resize(policy.max_request_bytes + 1024, b'a');
        oversized.extend_from_slice(b"\r\n\r\n");
        Walked {
            policy,
            address: Address::Tcp(addr),
            request: b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            partial: b"GET /healthz HTTP/1.1\r\n".to_vec(),
            answered: |reply| reply.starts_with(b"HTTP/1.1 200"),
            oversized,
            refused: |reply| !reply.starts_with(b"HTTP/1.1 200"),
            _stop: stop,
            _dir: None,
        }
    }

    /// The table's promises, server by server: at the cap a newcomer is still served (the
    /// idle-longest make room), a connection idle past the timeout is closed, and a request
    /// over the bound is refused and its connection closed.
    async fn walk(server: Walked) {
        let name = server.policy.server;
        let cap = server.policy.connections.max_connections;
        // Cap: `cap` connections that started a request and went quiet...
        let mut quiet = Vec::new();
        for _ in 0..cap {
            let mut s = server.connect().await;
            s.write_all(&server.partial).await.expect("write");
            quiet.push(s);
        }
        // ...do not lock a real client out.
        let mut client = server.connect().await;
        client.write_all(&server.request).await.expect("write");
        if !matches!(server.address, Address::Tcp(_)) {
            let _ = client.shutdown().await;
        }
        let mut reply = Vec::new();
        let mut buf = [0u8; 4096];
        let answered = tokio::time::timeout(WITHIN, async {
            while !(server.answered)(&reply) {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => reply.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        assert!(
            answered.is_ok() && (server.answered)(&reply),
            "{name}: a client at the cap of {cap} is not served: {:?}",
            String::from_utf8_lossy(&reply)
        );
        drop(client);
        // Idle: each quiet connection is closed (evicted for the newcomer, or idle too long).
        for (i, s) in quiet.iter_mut().enumerate() {
            assert!(
                closed_within(s.as_mut(), WITHIN).await.is_some(),
                "{name}: quiet connection {i} still open after {WITHIN:?} (idle timeout {:?})",
                server.policy.connections.idle_timeout
            );
        }
        // A connection that says nothing at all is closed too.
        let mut silent = server.connect().await;
        assert!(
            closed_within(silent.as_mut(), WITHIN).await.is_some(),
            "{name}: a silent connection still open after {WITHIN:?}"
        );
        // Request bound: refused, and closed.
        let mut big = server.connect().await;
        let _ = big.write_all(&server.oversized).await;
        let reply = closed_within(big.as_mut(), WITHIN).await;
        assert!(
            reply.as_deref().is_some_and(server.refused),
            "{name}: a request of {} bytes (bound {}) was not refused and closed: {:?}",
            server.oversized.len(),
            server.policy.max_request_bytes,
            reply.map(|r| String::from_utf8_lossy(&r).into_owned())
        );
    }

    #[tokio::test]
    async fn each_server_keeps_its_cap_idle_timeout_and_request_bound() {
        let walked = [uapi(), status(), health().await];
        let names: Vec<&str> = walked.iter().map(|w| w.policy.server).collect();
        let table: Vec<&str> = ALL.iter().map(|p| p.server).collect();
        assert_eq!(names, table, "every row of the table is walked");
        for server in walked {
            walk(server).await;
        }
    }
}
