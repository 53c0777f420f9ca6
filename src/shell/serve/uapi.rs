//! The UAPI Unix socket (`/var/run/wireguard/<name>.sock`): claiming it (through
//! [`super::local_socket`]), serving `get`/`set` to a [`UapiHandler`] in the accept loop of
//! [`super::accept`], removing it on shutdown; plus a small client for the same socket. Thin I/O: every byte of protocol is
//! parsed and formatted by [`crate::uapi`].

use super::accept::{self, Conn, Ended, LocalListener, Policy};
use super::local_socket::{self, ClaimFailed, Claimant, ClaimedPath};
use crate::uapi::{format_errno, format_set, parse_get_response, parse_request};
use crate::uapi::{DeviceSnapshot, DeviceUpdate, Errno, Request, UapiHandler};
use std::future::Future;
use std::io;
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Where `wg(8)` looks for userspace interfaces. Shared by every network namespace of the host.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/wireguard";
/// The largest request accepted; a bigger one gets `errno=-EMSGSIZE` and the connection closes.
/// Far above any real configuration (`wg setconf` of one peer with 130k allowed IPs is about
/// 3 MB; this is 10M allowed IPs), and only root can connect: the bound that protects the daemon
/// from a runaway client is [`MAX_LINE_BYTES`].
pub const MAX_REQUEST_BYTES: usize = super::policy::UAPI.max_request_bytes;
/// The longest line accepted. The longest legitimate one is a key line (75 bytes) or an
/// IPv6 endpoint with a scope (about 70).
pub const MAX_LINE_BYTES: usize = 4096;
/// The largest `get` reply the client reads.
const MAX_REPLY_BYTES: usize = 64 << 20;
/// The UAPI server's connection policy (its values and why: [`super::policy::UAPI`]).
pub const POLICY: Policy = super::policy::UAPI.connections;
/// Linux `IFNAMSIZ - 1`.
const MAX_NAME_LEN: usize = 15;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid interface name {name:?} for the UAPI socket: {why}")]
    InvalidName { name: String, why: &'static str },
    /// The socket path could not be claimed (worded by [`local_socket`] for both servers).
    #[error(transparent)]
    Claim(ClaimFailed),
    #[error("the UAPI socket {} was removed or replaced by someone else", path.display())]
    SocketRemoved { path: PathBuf },
    #[error("UAPI socket {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// `<dir>/<name>.sock`.
pub fn socket_path_in(dir: &Path, interface_name: &str) -> PathBuf {
    dir.join(format!("{interface_name}.sock"))
}

/// `/var/run/wireguard/<name>.sock`.
pub fn socket_path(interface_name: &str) -> PathBuf {
    socket_path_in(Path::new(DEFAULT_SOCKET_DIR), interface_name)
}

/// A bound UAPI socket, not yet serving. Dropping it (or the end of [`UapiServer::run`])
/// removes the socket file, unless someone else has replaced it meanwhile.
#[derive(Debug)]
pub struct UapiServer {
    listener: StdUnixListener,
    file: ClaimedPath,
    name: String,
}

impl UapiServer {
    /// Claims `/var/run/wireguard/<interface_name>.sock`. Needs no async runtime.
    pub fn bind(interface_name: &str) -> Result<UapiServer, ServerError> {
        UapiServer::bind_in(Path::new(DEFAULT_SOCKET_DIR), interface_name)
    }

    /// Claims `<dir>/<interface_name>.sock` with [`local_socket::claim_for_interface`]:
    /// creates `dir` (mode 0755) if missing, removes a stale socket file that nothing answers
    /// on, waits up to a second for a holder whose interface is gone (an instance shutting
    /// down), refuses if a live process answers, and publishes the socket with mode 0600 (it
    /// never exists under that name with other modes).
    pub fn bind_in(dir: &Path, interface_name: &str) -> Result<UapiServer, ServerError> {
        validate_name(interface_name)?;
        let path = socket_path_in(dir, interface_name);
        let claimed = local_socket::claim_for_interface(&path, interface_name);
        let (listener, file) = claimed.map_err(|e| {
            ServerError::Claim(ClaimFailed::new(
                e,
                &Claimant {
                    socket: "UAPI socket",
                    servers: "tunnelgate or wireguard-go",
                    interface: Some(interface_name),
                },
            ))
        })?;
        Ok(UapiServer {
            listener,
            file,
            name: interface_name.to_string(),
        })
    }

    /// The socket file this server owns.
    pub fn socket_path(&self) -> &Path {
        self.file.path()
    }

    /// Serves until `shutdown` completes (then returns `Ok`) or the socket file is deleted or
    /// replaced (then returns [`ServerError::SocketRemoved`]; the xplatform spec says a
    /// userspace implementation should then exit), in the accept loop of [`super::accept`]
    /// under [`POLICY`]. Either way the listener is closed and the socket file removed (if it
    /// is still ours) first, then `shutdown` is dropped (a [`local_socket::CloseRequest`] so
    /// tells its sender the socket is gone), then open connections are closed. Must run inside
    /// a tokio runtime.
    pub async fn run<F>(self, handler: Arc<dyn UapiHandler>, shutdown: F) -> Result<(), ServerError>
    where
        F: Future<Output = ()>,
    {
        self.run_with(handler, shutdown, super::policy::UAPI).await
    }

    /// [`UapiServer::run`] under another policy (the policy walk's short limits).
    pub(crate) async fn run_with<F>(
        self,
        handler: Arc<dyn UapiHandler>,
        shutdown: F,
        policy: super::policy::ServerPolicy,
    ) -> Result<(), ServerError>
    where
        F: Future<Output = ()>,
    {
        let UapiServer {
            listener,
            file,
            name,
        } = self;
        let path = file.path().to_path_buf();
        let listener =
            LocalListener::new(listener, file, true).map_err(|source| ServerError::Io {
                path: path.clone(),
                source,
            })?;
        tracing::info!(interface = %name, socket = %path.display(), "UAPI listening");
        let ended = accept::serve(
            "UAPI",
            listener,
            policy.connections,
            move |stream, conn| {
                serve_connection(stream, handler.clone(), conn, policy.max_request_bytes)
            },
            shutdown,
        )
        .await;
        tracing::info!(interface = %name, "UAPI stopped");
        match ended {
            Ended::Shutdown => Ok(()),
            Ended::Removed => Err(ServerError::SocketRemoved { path }),
        }
    }
}

fn validate_name(name: &str) -> Result<(), ServerError> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("it is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("it is a path component")
    } else if name
        .bytes()
        .any(|b| b == b'/' || b.is_ascii_whitespace() || b.is_ascii_control() || b == b':')
    {
        Some("it contains '/', ':', whitespace or a control character")
    } else {
        None
    };
    match why {
        Some(why) => Err(ServerError::InvalidName {
            name: name.to_string(),
            why,
        }),
        None => Ok(()),
    }
}

/// The end of the first request in `buf`: just past the first empty line. Searching starts at
/// `from` (everything before it was searched already).
fn request_end(buf: &[u8], from: usize) -> Option<usize> {
    (from..buf.len())
        .find(|&i| buf[i] == b'\n' && (i == 0 || buf[i - 1] == b'\n'))
        .map(|i| i + 1)
}

enum Framed {
    /// A complete request of this many bytes at the start of the buffer.
    Request(usize),
    /// The client closed its side; whatever is buffered is all there is.
    Eof,
    /// Over the size limit.
    TooBig,
    /// Read error: just close.
    Gone,
}

/// Whether `buf[from..]` (where the line that was open at `from` started at `line_start`) has a
/// line longer than `max`; returns the start of the last (open) line.
fn open_line_start(buf: &[u8], from: usize, line_start: usize) -> usize {
    buf[from..]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(line_start, |i| from + i + 1)
}

/// Reads until `buf` holds a whole request (or cannot); `on_read` is called for every chunk
/// that arrives.
async fn next_request(
    stream: &mut UnixStream,
    buf: &mut Vec<u8>,
    limit: usize,
    on_read: &(dyn Fn() + Sync),
) -> Framed {
    let mut searched = 0;
    let mut line_start = 0;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if let Some(end) = request_end(buf, searched) {
            return Framed::Request(end);
        }
        // No complete line may be longer than the line bound either: check each line as
        // it arrives, and the line still open.
        let mut start = line_start;
        for (i, &b) in buf[searched..].iter().enumerate() {
            if b == b'\n' {
                if searched + i - start > MAX_LINE_BYTES {
                    return Framed::TooBig;
                }
                start = searched + i + 1;
            }
        }
        line_start = open_line_start(buf, searched, line_start);
        searched = buf.len();
        if buf.len() > limit || buf.len() - line_start > MAX_LINE_BYTES {
            return Framed::TooBig;
        }
        // No deadline of its own: the accept loop closes a connection that shows no activity
        // (`on_read`) for the idle timeout, the request's one deadline.
        match stream.read(&mut chunk).await {
            Ok(0) => return Framed::Eof,
            Ok(n) => {
                on_read();
                buf.extend_from_slice(&chunk[..n]);
            }
            Err(_) => return Framed::Gone,
        }
    }
}

async fn serve_connection(
    mut stream: UnixStream,
    handler: Arc<dyn UapiHandler>,
    conn: Conn,
    max_request_bytes: usize,
) {
    let mut buf = Vec::new();
    loop {
        let framed = next_request(&mut stream, &mut buf, max_request_bytes, &|| conn.touch()).await;
        let (request, last) = match framed {
            Framed::Request(end) => (buf.drain(..end).collect::<Vec<u8>>(), false),
            Framed::Eof if buf.is_empty() => return,
            // A request cut short: tell the client what is wrong with it, then close.
            Framed::Eof => (std::mem::take(&mut buf), true),
            Framed::TooBig => {
                tracing::warn!(
                    "UAPI request over {max_request_bytes} bytes or with a line over \
                     {MAX_LINE_BYTES}; closing"
                );
                let _ = stream
                    .write_all(format_errno(Err(Errno::EMSGSIZE)).as_bytes())
                    .await;
                return;
            }
            Framed::Gone => return,
        };
        // Busy until the reply is out: never evicted in the middle of a `set`.
        let Some(busy) = conn.busy() else {
            return; // evicted; the loop closes it
        };
        let sent = match respond(&request, &handler).await {
            Reply::Whole(reply) => stream.write_all(reply.as_bytes()).await,
            Reply::Pieces(mut pieces, maker) => {
                let mut sent = Ok(());
                while let Some(piece) = pieces.recv().await {
                    sent = stream.write_all(piece.as_bytes()).await;
                    if sent.is_err() {
                        break;
                    }
                }
                // Closed, the channel stops the maker at its next piece.
                drop(pieces);
                if maker.await.is_err() {
                    tracing::error!("UAPI get: the handler panicked");
                }
                sent
            }
        };
        drop(busy);
        if sent.is_err() || last {
            return;
        }
    }
}

/// A `get` reply's pieces in flight between the blocking thread that makes them and the
/// connection that writes them: with pieces of a few hundred peers, a reply of 100,000 peers
/// holds a few hundred kilobytes at a time, never the whole text.
const GET_PIECES_IN_FLIGHT: usize = 4;

/// What a request is answered with.
enum Reply {
    Whole(String),
    /// A `get` reply, piece by piece as the handler makes them on a blocking thread (a
    /// panic there ends the pieces early: the client sees a reply without its errno line).
    Pieces(
        tokio::sync::mpsc::Receiver<String>,
        tokio::task::JoinHandle<()>,
    ),
}

/// One request to one reply. Never fails: every problem becomes an errno.
async fn respond(request: &[u8], handler: &Arc<dyn UapiHandler>) -> Reply {
    let Ok(text) = std::str::from_utf8(request) else {
        tracing::warn!("UAPI request rejected: not UTF-8");
        return Reply::Whole(format_errno(Err(Errno::EINVAL)));
    };
    match parse_request(text) {
        Ok(Request::Get) => {
            let handler = handler.clone();
            let (pieces, receiver) = tokio::sync::mpsc::channel(GET_PIECES_IN_FLIGHT);
            let maker = tokio::task::spawn_blocking(move || {
                handler.get_in_pieces(&mut |piece| pieces.blocking_send(piece).is_ok());
            });
            Reply::Pieces(receiver, maker)
        }
        Ok(Request::Set(update)) => {
            let peers = update.peers.len();
            let handler = handler.clone();
            Reply::Whole(
                match tokio::task::spawn_blocking(move || handler.set(update)).await {
                    Ok(Ok(())) => {
                        tracing::info!(peers, "UAPI set applied");
                        format_errno(Ok(()))
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "UAPI set refused");
                        format_errno(Err(e.errno))
                    }
                    Err(_) => {
                        tracing::error!("UAPI set: the handler panicked");
                        format_errno(Err(Errno::EIO))
                    }
                },
            )
        }
        Err(e) => {
            tracing::warn!(error = %e, "UAPI request rejected");
            Reply::Whole(format_errno(Err(e.errno)))
        }
    }
}

/// Client side: `get=1` on `socket` (e.g. [`socket_path`]), as `wg show` does.
pub async fn client_get(socket: &Path) -> io::Result<DeviceSnapshot> {
    let reply = exchange(socket, "get=1\n\n").await?;
    parse_get_response(&reply).map_err(client_error)
}

/// Client side: a `set=1` with `update`, as `wg set` does. A refusal comes back as the OS error
/// of its errno (e.g. `InvalidInput` for `EINVAL`).
pub async fn client_set(socket: &Path, update: &DeviceUpdate) -> io::Result<()> {
    let reply = exchange(socket, &format_set(update)).await?;
    match reply.trim_end_matches('\n').strip_prefix("errno=") {
        Some("0") => Ok(()),
        Some(n) => match n.parse::<i32>() {
            Ok(n) => Err(io::Error::from_raw_os_error(n.saturating_abs())),
            Err(_) => Err(bad_reply(&reply)),
        },
        None => Err(bad_reply(&reply)),
    }
}

async fn exchange(socket: &Path, request: &str) -> io::Result<String> {
    let mut stream = UnixStream::connect(socket).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    match next_request(&mut stream, &mut buf, MAX_REPLY_BYTES, &|| {}).await {
        Framed::Request(end) => {
            buf.truncate(end);
            String::from_utf8(buf).map_err(|_| bad_reply("(not UTF-8)"))
        }
        Framed::Eof => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the UAPI server closed the connection without a complete reply",
        )),
        Framed::TooBig => Err(bad_reply("(too large)")),
        Framed::Gone => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no reply from the UAPI server",
        )),
    }
}

fn client_error(e: crate::uapi::UapiError) -> io::Error {
    let kind = io::Error::from_raw_os_error(e.errno.code()).kind();
    io::Error::new(kind, e.to_string())
}

fn bad_reply(reply: &str) -> io::Error {
    let shown: String = reply.chars().take(64).collect();
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed UAPI reply: {shown:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PublicKey, SecretKey};
    use crate::shell::serve::local_socket::ClaimError;
    use crate::uapi::{PeerSnapshot, PeerUpdate, UapiError};
    use parking_lot::Mutex;
    use std::fs;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::time::Duration;

    use tokio::sync::oneshot;

    use crate::test_util::TempDir;

    #[derive(Default)]
    struct Fake {
        device: Mutex<DeviceSnapshot>,
        updates: Mutex<Vec<DeviceUpdate>>,
        refuse: Mutex<Option<Errno>>,
    }
    impl UapiHandler for Fake {
        fn get(&self) -> DeviceSnapshot {
            self.device.lock().clone()
        }
        fn set(&self, update: DeviceUpdate) -> Result<(), UapiError> {
            let refused = *self.refuse.lock();
            if let Some(errno) = refused {
                return Err(UapiError::new(errno, "refused by test"));
            }
            self.device.lock().apply(&update);
            self.updates.lock().push(update);
            Ok(())
        }
    }

    struct Running {
        path: PathBuf,
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<Result<(), ServerError>>,
    }
    impl Running {
        async fn stop(mut self) -> Result<(), ServerError> {
            if let Some(tx) = self.stop.take() {
                let _ = tx.send(());
            }
            self.task.await.expect("server task")
        }
    }

    fn start(dir: &Path, name: &str, fake: Arc<Fake>) -> Running {
        let server = UapiServer::bind_in(dir, name).expect("bind");
        let path = server.socket_path().to_path_buf();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(fake, async move {
            let _ = rx.await;
        }));
        Running {
            path,
            stop: Some(tx),
            task,
        }
    }

    async fn talk(stream: &mut UnixStream, request: &[u8]) -> String {
        stream.write_all(request).await.expect("write");
        let mut buf = Vec::new();
        match next_request(stream, &mut buf, MAX_REPLY_BYTES, &|| {}).await {
            Framed::Request(end) => String::from_utf8(buf[..end].to_vec()).expect("utf8"),
            _ => panic!("no reply; got {:?}", String::from_utf8_lossy(&buf)),
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("stat").permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn bind_creates_dir_and_0600_socket_and_removes_it() {
        let tmp = TempDir::created("bind");
        let dir = tmp.0.join("nested/wireguard");
        let fake = Arc::new(Fake::default());
        let server = start(&dir, "tg0", fake);
        assert_eq!(mode(&dir), 0o755);
        assert_eq!(server.path, dir.join("tg0.sock"));
        assert_eq!(mode(&server.path), 0o600);
        assert!(fs::symlink_metadata(&server.path)
            .expect("stat")
            .file_type()
            .is_socket());
        // Only the socket is left in the directory: the staging directory is gone.
        let entries: Vec<_> = fs::read_dir(&dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(entries, vec![std::ffi::OsString::from("tg0.sock")]);
        server.stop().await.expect("clean stop");
        assert!(!dir.join("tg0.sock").exists());
    }

    #[tokio::test]
    async fn drop_without_run_removes_socket() {
        let tmp = TempDir::created("drop");
        let server = UapiServer::bind_in(&tmp.0, "tg0").expect("bind");
        let path = server.socket_path().to_path_buf();
        assert!(path.exists());
        drop(server);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn stale_socket_is_replaced_live_one_is_refused() {
        // Named after `lo`, which exists: a live holder whose interface is here is refused
        // without the handover wait (which would block this single-threaded runtime).
        let tmp = TempDir::created("stale");
        let path = tmp.0.join("lo.sock");
        drop(StdUnixListener::bind(&path).expect("stale bind"));
        assert!(path.exists());
        let first = start(&tmp.0, "lo", Arc::new(Fake::default()));

        let err = UapiServer::bind_in(&tmp.0, "lo").expect_err("live socket must be refused");
        assert!(
            matches!(&err, ServerError::Claim(c) if matches!(c.error, ClaimError::InUse { .. })),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains("another live process"), "{err}");
        assert!(text.contains("another network namespace"), "{err}");
        assert!(text.contains("\"lo\""), "names the interface: {err}");
        // The refused attempt left the live socket alone.
        let mut s = UnixStream::connect(&path).await.expect("still served");
        assert!(talk(&mut s, b"get=1\n\n").await.ends_with("errno=0\n\n"));
        first.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn non_socket_is_not_removed() {
        let tmp = TempDir::created("file");
        let path = tmp.0.join("tg0.sock");
        fs::write(&path, "precious").expect("write");
        let err = UapiServer::bind_in(&tmp.0, "tg0").expect_err("must refuse");
        assert!(
            matches!(&err, ServerError::Claim(c) if matches!(c.error, ClaimError::NotASocket { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(fs::read_to_string(&path).expect("read"), "precious");
    }

    #[test]
    fn names_are_validated() {
        let tmp = TempDir::created("names");
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "sixteen-chars-xx",
            "a b",
            "a\nb",
            "wg:0",
        ] {
            let err = UapiServer::bind_in(&tmp.0, bad).expect_err(bad);
            assert!(
                matches!(err, ServerError::InvalidName { .. }),
                "{bad:?}: {err}"
            );
        }
        assert!(UapiServer::bind_in(&tmp.0, "fifteen-chars-x").is_ok());
    }

    #[tokio::test]
    async fn get_and_set_many_requests_on_one_connection() {
        let tmp = TempDir::created("conn");
        let fake = Arc::new(Fake::default());
        let pk = PublicKey([7; 32]);
        {
            let mut dev = fake.device.lock();
            dev.listen_port = 51820;
            let mut peer = PeerSnapshot::new(pk);
            peer.tx_bytes = 5;
            dev.peers.push(peer);
        }
        let server = start(&tmp.0, "tg1", fake.clone());
        let mut s = UnixStream::connect(&server.path).await.expect("connect");

        let reply = talk(&mut s, b"get=1\n\n").await;
        assert_eq!(reply, crate::uapi::format_get(&fake.get()));
        assert!(reply.contains("tx_bytes=5\n"));

        let set = format!(
            "set=1\nprivate_key={}\npublic_key={}\nallowed_ip=10.9.0.1/24\n\n",
            hex::encode([1u8; 32]),
            hex::encode(pk.0)
        );
        assert_eq!(talk(&mut s, set.as_bytes()).await, "errno=0\n\n");
        assert_eq!(fake.updates.lock().len(), 1);
        let reply = talk(&mut s, b"get=1\n\n").await;
        assert!(reply.contains("allowed_ip=10.9.0.0/24\n"), "{reply}");
        assert!(reply.starts_with(&format!("private_key={}\n", hex::encode([1u8; 32]))));

        // Two requests in one write are answered in order.
        s.write_all(b"get=1\n\nset=1\nlisten_port=1\n\n")
            .await
            .expect("write");
        let mut buf = Vec::new();
        let Framed::Request(end) = next_request(&mut s, &mut buf, MAX_REPLY_BYTES, &|| {}).await
        else {
            panic!("no first reply");
        };
        assert!(String::from_utf8_lossy(&buf[..end]).ends_with("errno=0\n\n"));
        buf.drain(..end);
        let Framed::Request(end) = next_request(&mut s, &mut buf, MAX_REPLY_BYTES, &|| {}).await
        else {
            panic!("no second reply");
        };
        assert_eq!(&buf[..end], b"errno=0\n\n");
        assert_eq!(fake.get().listen_port, 1);
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn bad_requests_get_errno_and_the_connection_keeps_working() {
        let tmp = TempDir::created("bad");
        let fake = Arc::new(Fake::default());
        let server = start(&tmp.0, "tg2", fake.clone());
        let mut s = UnixStream::connect(&server.path).await.expect("connect");
        let cases: &[(&[u8], &str)] = &[
            (b"set=1\nbogus=1\n\n", "errno=-22\n\n"),
            (b"set=1\nlisten_port=65536\n\n", "errno=-22\n\n"),
            (b"set=1\nlisten_port\n\n", "errno=-71\n\n"),
            (b"frobnicate=1\n\n", "errno=-71\n\n"),
            (b"get=1\nx=1\n\n", "errno=-22\n\n"),
            (b"set=1\nlisten_port=\xff\xfe\n\n", "errno=-22\n\n"),
            (b"\n", "errno=-71\n\n"),
        ];
        for (request, expected) in cases {
            assert_eq!(
                talk(&mut s, request).await,
                *expected,
                "{:?}",
                String::from_utf8_lossy(request)
            );
            assert!(talk(&mut s, b"get=1\n\n").await.ends_with("errno=0\n\n"));
        }
        assert!(fake.updates.lock().is_empty(), "nothing bad was applied");

        // The handler's own errno reaches the client.
        *fake.refuse.lock() = Some(Errno::EADDRINUSE);
        assert_eq!(
            talk(&mut s, b"set=1\nlisten_port=1\n\n").await,
            "errno=-98\n\n"
        );
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn cut_short_request_gets_eproto_then_close() {
        let tmp = TempDir::created("eof");
        let server = start(&tmp.0, "tg3", Arc::new(Fake::default()));
        let mut s = UnixStream::connect(&server.path).await.expect("connect");
        s.write_all(b"set=1\nlisten_port=1\n").await.expect("write");
        s.shutdown().await.expect("half-close");
        let mut reply = String::new();
        s.read_to_string(&mut reply).await.expect("read");
        assert_eq!(reply, "errno=-71\n\n");
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn a_large_request_is_served_whole() {
        let tmp = TempDir::created("large");
        let fake = Arc::new(Fake::default());
        let server = start(&tmp.0, "tg8", fake.clone());
        let mut s = UnixStream::connect(&server.path).await.expect("connect");
        // One peer with 130k allowed IPs: about 3 MB, the size of a big `wg setconf`.
        let mut request = format!("set=1\npublic_key={}\n", "11".repeat(32));
        for i in 0u32..130_000 {
            let [_, b, c, d] = i.to_be_bytes();
            request.push_str(&format!("allowed_ip=10.{b}.{c}.{d}/32\n"));
        }
        request.push('\n');
        assert!(request.len() > 2 << 20);
        assert_eq!(talk(&mut s, request.as_bytes()).await, "errno=0\n\n");
        assert_eq!(fake.get().peers[0].allowed_ips.len(), 130_000);
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn an_overlong_line_is_refused_and_server_survives() {
        let tmp = TempDir::created("big");
        let server = start(&tmp.0, "tg4", Arc::new(Fake::default()));
        let mut s = UnixStream::connect(&server.path).await.expect("connect");
        // Lines are bounded, not the request: one line of 1 MB without a newline.
        let mut request = b"set=1\nlisten_port=".to_vec();
        request.extend_from_slice("1".repeat(1 << 20).as_bytes());
        assert!(request.len() > MAX_LINE_BYTES);
        // The server may close while we still write: ignore write errors.
        let _ = s.write_all(&request).await;
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply).await;
        assert_eq!(String::from_utf8_lossy(&reply), "errno=-90\n\n");
        let snapshot = client_get(&server.path).await.expect("still serving");
        assert_eq!(snapshot, DeviceSnapshot::default());
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn idle_connections_at_the_cap_do_not_lock_wg_out() {
        let tmp = TempDir::created("ts-cap");
        let server = start(&tmp.0, "ts9", Arc::new(Fake::default()));
        // Clients that connect and say nothing, more than the cap.
        let mut idle = Vec::new();
        for _ in 0..POLICY.max_connections + 10 {
            idle.push(UnixStream::connect(&server.path).await.expect("connect"));
        }
        let got = tokio::time::timeout(Duration::from_secs(1), client_get(&server.path))
            .await
            .expect("answered within a second");
        assert_eq!(got.expect("get"), DeviceSnapshot::default());
        // The longest idle made room and were closed; the server holds no more than its cap.
        let mut closed = 0;
        for s in &mut idle {
            let mut byte = [0u8; 1];
            if let Ok(Ok(0)) =
                tokio::time::timeout(Duration::from_millis(20), s.read(&mut byte)).await
            {
                closed += 1;
            }
        }
        assert!(closed >= 11, "only {closed} idle connections closed");
        server.stop().await.expect("stop");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unprivileged_caller_cannot_connect() {
        let tmp = TempDir::created("ts-nobody");
        let server = start(&tmp.0, "ts11", Arc::new(Fake::default()));
        let p = server.path.clone();
        let outcome = tokio::task::spawn_blocking(move || crate::test_util::connect_as_nobody(&p))
            .await
            .expect("client");
        match outcome {
            Some(outcome) => assert_eq!(outcome, "EACCES"),
            None => crate::test_util::skip("needs root and /usr/bin/python3"),
        }
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn racing_setters_each_get_their_answer_and_apply_whole() {
        let tmp = TempDir::created("ts-race");
        let fake = Arc::new(Fake::default());
        let server = start(&tmp.0, "ts10", fake.clone());
        let setter = |key: u8, net: u8| {
            let path = server.path.clone();
            async move {
                let mut s = UnixStream::connect(&path).await.expect("connect");
                for i in 0..50u16 {
                    let set = format!(
                        "set=1\nlisten_port={}\npublic_key={}\nreplace_allowed_ips=true\n\
                         allowed_ip=10.{net}.0.0/16\nallowed_ip=fd{net:02x}::/64\n\n",
                        1000 + i,
                        hex::encode([key; 32])
                    );
                    assert_eq!(talk(&mut s, set.as_bytes()).await, "errno=0\n\n");
                }
            }
        };
        tokio::join!(setter(1, 1), setter(2, 2));
        let updates = fake.updates.lock().clone();
        assert_eq!(updates.len(), 100);
        // Every update arrived whole: each peer only ever got its own networks.
        for u in &updates {
            assert_eq!(u.peers.len(), 1);
            let net = u.peers[0].public_key.0[0];
            let want: Vec<ipnet::IpNet> = vec![
                format!("10.{net}.0.0/16").parse().expect("v4"),
                format!("fd{net:02x}::/64").parse().expect("v6"),
            ];
            assert_eq!(u.peers[0].allowed_ips, want);
        }
        let device = fake.get();
        assert_eq!(device.peers.len(), 2);
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn a_request_over_the_size_limit_is_refused_before_it_is_all_read() {
        let (mut client, mut server) = UnixStream::pair().expect("pair");
        // Short lines, never an empty one: only the request bound stops this.
        let writer = tokio::spawn(async move {
            let line = b"allowed_ip=10.0.0.1/32\n".repeat(1024);
            let mut sent = 0usize;
            while sent < 16 << 20 {
                match client.write_all(&line).await {
                    Ok(()) => sent += line.len(),
                    Err(_) => break,
                }
            }
            sent
        });
        let mut buf = Vec::new();
        let framed = next_request(&mut server, &mut buf, 256 << 10, &|| {}).await;
        assert!(matches!(framed, Framed::TooBig));
        assert!(
            buf.len() < (256 << 10) + 64 * 1024 + 1,
            "read {} bytes",
            buf.len()
        );
        drop(server);
        assert!(writer.await.expect("writer") < 16 << 20);
    }

    #[tokio::test]
    async fn client_round_trip() {
        let tmp = TempDir::created("client");
        let fake = Arc::new(Fake::default());
        let server = start(&tmp.0, "tg5", fake.clone());
        let mut peer = PeerUpdate::new(PublicKey([3; 32]));
        peer.preshared_key = Some(Some(SecretKey([4; 32])));
        peer.endpoint = Some("[::1]:5000".parse().expect("addr"));
        peer.allowed_ips = vec!["fd00::/64".parse().expect("net")];
        let update = DeviceUpdate {
            listen_port: Some(4444),
            peers: vec![peer],
            ..Default::default()
        };
        client_set(&server.path, &update).await.expect("set");
        assert_eq!(fake.updates.lock().as_slice(), &[update]);
        let got = client_get(&server.path).await.expect("get");
        assert_eq!(got, fake.get());
        assert_eq!(got.listen_port, 4444);

        *fake.refuse.lock() = Some(Errno::EADDRINUSE);
        let err = client_set(&server.path, &DeviceUpdate::default())
            .await
            .expect_err("refused");
        assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE));
        server.stop().await.expect("stop");
    }

    #[tokio::test]
    async fn shutdown_closes_open_connections() {
        let tmp = TempDir::created("idle");
        let server = start(&tmp.0, "tg6", Arc::new(Fake::default()));
        let mut s = UnixStream::connect(&server.path).await.expect("connect");
        s.write_all(b"get=1\n").await.expect("write half a request");
        let path = server.path.clone();
        tokio::time::timeout(Duration::from_secs(5), server.stop())
            .await
            .expect("stops promptly")
            .expect("clean");
        let mut rest = Vec::new();
        let n = s.read_to_end(&mut rest).await.unwrap_or(0);
        assert_eq!(n, 0);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn a_close_request_returns_once_the_socket_is_gone_not_after_connections() {
        let tmp = TempDir::created("closefirst");
        let server = UapiServer::bind_in(&tmp.0, "tg8").expect("bind");
        let path = server.socket_path().to_path_buf();
        let sockets = crate::shell::serve::local_socket::CloseFirst::default();
        let task = tokio::spawn(server.run(Arc::new(Fake::default()), sockets.request()));
        // An open connection in the middle of a request.
        let mut s = UnixStream::connect(&path).await.expect("connect");
        s.write_all(b"get=1\n").await.expect("write half a request");
        assert!(
            sockets.close(Duration::from_secs(5)).await,
            "closed in time"
        );
        assert!(!path.exists(), "unlinked by the time close returns");
        assert!(
            std::os::unix::net::UnixStream::connect(&path).is_err(),
            "nothing answers on the path"
        );
        task.await.expect("task").expect("clean stop");
    }

    #[tokio::test]
    async fn deleting_the_socket_stops_the_server_and_spares_a_successor() {
        let tmp = TempDir::created("deleted");
        let server = start(&tmp.0, "tg7", Arc::new(Fake::default()));
        fs::remove_file(&server.path).expect("rm");
        // A successor takes the name before the old server notices.
        let successor = UapiServer::bind_in(&tmp.0, "tg7").expect("successor binds");
        let result = tokio::time::timeout(super::super::accept::WATCH_INTERVAL * 3, server.task)
            .await
            .expect("server noticed")
            .expect("task");
        assert!(matches!(result, Err(ServerError::SocketRemoved { .. })));
        assert!(successor.socket_path().exists(), "successor's socket kept");
    }

    #[test]
    fn request_end_finds_first_empty_line() {
        assert_eq!(request_end(b"get=1\n\n", 0), Some(7));
        assert_eq!(request_end(b"get=1\n", 0), None);
        assert_eq!(request_end(b"\nx", 0), Some(1));
        assert_eq!(request_end(b"a=1\nb=2\n\nget=1\n\n", 0), Some(9));
        // Resuming a search where the previous one stopped still sees a split "\n" + "\n".
        assert_eq!(request_end(b"get=1\n\n", 6), Some(7));
    }

    #[test]
    fn the_open_line_is_tracked_across_reads() {
        assert_eq!(open_line_start(b"a=1\nb=", 0, 0), 4);
        assert_eq!(
            open_line_start(b"a=1\nb=22", 6, 4),
            4,
            "no newline in the new data"
        );
        assert_eq!(open_line_start(b"a=1\nb=2\n", 6, 4), 8);
    }
}
