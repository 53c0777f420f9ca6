//! Claiming a Unix socket path for a local server (the UAPI socket and the status socket): the
//! directory, the stale-or-live check, a race-free 0600 bind, and removal on drop only while the
//! file is still ours; and the one wording of a refused claim ([`ClaimFailed`], made from a
//! [`ClaimError`] and the [`Claimant`] that asked), which both servers return. It owns no
//! protocol.

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::core::socket_handover::{
    self, InterfaceHere, SocketState, Step, HANDOVER_POLL, HANDOVER_WAIT,
};

/// The socket's mode: only root (the owner) may connect.
const SOCKET_MODE: u32 = 0o600;
/// The mode of a directory this module creates: clients must be able to traverse it.
const DIR_MODE: u32 = 0o755;

/// Why a socket path could not be claimed. What a user reads is [`ClaimFailed`]: this says
/// what happened, that says to whom.
#[derive(Debug)]
pub enum ClaimError {
    /// The socket's directory is missing and cannot be created, or is not a directory.
    CreateDir { path: PathBuf, source: io::Error },
    /// Something other than a socket is at the path; it is left alone.
    NotASocket { path: PathBuf },
    /// A live process answered a connect on the path, or won the race to publish its socket.
    InUse { path: PathBuf },
    /// Connecting to the existing socket was refused for lack of permission (not root?).
    PermissionDenied { path: PathBuf },
    /// The existing socket could not be inspected, checked or removed.
    Stale { path: PathBuf, source: io::Error },
    /// Binding, restricting or publishing the new socket failed.
    Bind { path: PathBuf, source: io::Error },
}

impl std::fmt::Display for ClaimError {
    /// The same words as [`ClaimFailed`], for a claimant that is only "socket".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&describe(self, &Claimant::ANY))
    }
}

impl std::error::Error for ClaimError {}

/// Which local server asked for a socket path: the words a refused claim is told in.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    /// The socket as the user knows it: "UAPI socket", "status socket".
    pub socket: &'static str,
    /// The programs that serve such a socket: "tunnelgate or wireguard-go".
    pub servers: &'static str,
    /// The interface the socket is named after, if it is: a live holder then serves that
    /// interface, perhaps from another network namespace (the socket directories under
    /// `/var/run` are shared by all of them).
    pub interface: Option<&'a str>,
}

impl Claimant<'_> {
    /// A socket of no particular server.
    pub const ANY: Claimant<'static> = Claimant {
        socket: "socket",
        servers: "a local server",
        interface: None,
    };
}

/// A refused claim as the user reads it: what happened ([`ClaimFailed::error`]) and the one
/// message for it, worded by [`describe`] for the server that asked.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ClaimFailed {
    pub error: ClaimError,
    message: String,
}

impl ClaimFailed {
    pub fn new(error: ClaimError, claimant: &Claimant<'_>) -> ClaimFailed {
        let message = describe(&error, claimant);
        ClaimFailed { error, message }
    }
}

/// The one mapping of a [`ClaimError`] to what the user reads, for both local servers.
fn describe(error: &ClaimError, who: &Claimant<'_>) -> String {
    let socket = who.socket;
    match error {
        ClaimError::CreateDir { path, source } => format!(
            "cannot create the {socket} directory {}: {source}",
            path.display()
        ),
        ClaimError::NotASocket { path } => format!(
            "{} exists and is not a socket; refusing to replace it with the {socket}",
            path.display()
        ),
        ClaimError::InUse { path } => match who.interface {
            Some(name) => format!(
                "{} is in use: another live process ({}) serves interface {name:?}, possibly in \
                 another network namespace, since {} is shared by all of them; stop it or \
                 choose another interface name",
                path.display(),
                who.servers,
                parent_dir(path).display()
            ),
            None => format!(
                "{} is in use by another live process ({})",
                path.display(),
                who.servers
            ),
        },
        ClaimError::PermissionDenied { path } => format!(
            "permission denied: run as root (cannot check the {socket} {})",
            path.display()
        ),
        ClaimError::Stale { path, source } => format!(
            "cannot check or remove the stale {socket} {}: {source}",
            path.display()
        ),
        ClaimError::Bind { path, source } => {
            format!("cannot create the {socket} {}: {source}", path.display())
        }
    }
}

/// The socket file a [`claim`] published, identified by device and inode. Dropping it removes
/// the file, but only while it is still this one: a successor's socket is never deleted.
#[derive(Debug)]
pub struct ClaimedPath {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl ClaimedPath {
    /// The claimed path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file at the path is still the socket we published (not deleted, not replaced).
    pub fn still_ours(&self) -> bool {
        fs::symlink_metadata(&self.path)
            .map(|m| m.dev() == self.dev && m.ino() == self.ino)
            .unwrap_or(false)
    }
}

impl Drop for ClaimedPath {
    fn drop(&mut self) {
        if self.still_ours() {
            if let Err(e) = fs::remove_file(&self.path) {
                tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove socket");
            }
        }
    }
}

/// Claims `path` for a server and returns its listener (non-blocking, ready for
/// `tokio::net::UnixListener::from_std`) and the guard that removes the file on drop.
///
/// Creates the parent directory (mode 0755) if missing; refuses a path that is not a socket
/// ([`ClaimError::NotASocket`]) or that a live process answers on ([`ClaimError::InUse`]);
/// removes a stale socket nothing answers on. The new socket is bound in a private directory
/// beside it, restricted to 0600, then hard-linked into place, so it never exists at `path`
/// with a wider mode, and `link(2)` fails instead of replacing the socket of a process that
/// claimed the path in the meantime. Needs no async runtime.
pub fn claim(path: &Path) -> Result<(UnixListener, ClaimedPath), ClaimError> {
    claim_with(path, None)
}

/// [`claim`] for a socket named after the network interface `interface`: a holder that still
/// answers while `interface` does not exist in this network namespace is going away (its device
/// was deleted), so this waits for it up to [`HANDOVER_WAIT`] before refusing
/// (`core::socket_handover` decides). A holder whose interface exists is refused at once.
/// Blocks the calling thread while it waits.
pub fn claim_for_interface(
    path: &Path,
    interface: &str,
) -> Result<(UnixListener, ClaimedPath), ClaimError> {
    claim_with(path, Some(interface))
}

fn claim_with(
    path: &Path,
    interface: Option<&str>,
) -> Result<(UnixListener, ClaimedPath), ClaimError> {
    let dir = parent_dir(path);
    ensure_dir(dir)?;
    let started = crate::shell::clock::now();
    let mut waited = std::time::Duration::ZERO;
    loop {
        let state = probe(path)?;
        let here = match (state, interface) {
            (SocketState::Answers, Some(name)) => interface_here(name),
            _ => InterfaceHere::NotApplicable,
        };
        match socket_handover::decide(state, here, waited, HANDOVER_WAIT) {
            Step::Claim => break,
            Step::RemoveStale => {
                remove_stale(path)?;
                break;
            }
            Step::Wait => {
                std::thread::sleep(HANDOVER_POLL);
                waited = crate::shell::clock::now().saturating_duration_since(started);
            }
            Step::Refuse(why) => {
                tracing::debug!(socket = %path.display(), ?why, ?waited, "socket held by a live process");
                return Err(ClaimError::InUse {
                    path: path.to_path_buf(),
                });
            }
        }
    }
    if !waited.is_zero() {
        tracing::info!(
            socket = %path.display(),
            waited_ms = waited.as_millis(),
            "took over the socket from an instance that was shutting down"
        );
    }
    bind_and_publish(dir, path)
}

/// Whether `name` is a network interface of this process's network namespace.
fn interface_here(name: &str) -> InterfaceHere {
    match nix::net::if_::if_nametoindex(name) {
        Ok(_) => InterfaceHere::Present,
        Err(_) => InterfaceHere::Absent,
    }
}

fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn ensure_dir(dir: &Path) -> Result<(), ClaimError> {
    let err = |source| ClaimError::CreateDir {
        path: dir.to_path_buf(),
        source,
    };
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a directory",
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    match DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(err(e)),
    }
    // The umask may have narrowed it; clients must traverse it.
    fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE)).map_err(err)
}

/// What is at `path`: nothing, a socket nothing answers on, or one a process answers on.
/// Refuses anything that is not a socket.
fn probe(path: &Path) -> Result<SocketState, ClaimError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(SocketState::Absent),
        Err(source) => {
            return Err(ClaimError::Stale {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(ClaimError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match connect_nonblocking(path) {
        Ok(()) => Ok(SocketState::Answers),
        // Its accept queue is full: a process listens on it (busy, or stuck); a blocking
        // connect would wait until it accepts, which it may never do.
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(SocketState::Answers),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(SocketState::Refused),
        // Unlinked between the stat and the connect: its holder just went.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(SocketState::Absent),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            Err(ClaimError::PermissionDenied {
                path: path.to_path_buf(),
            })
        }
        Err(source) => Err(ClaimError::Stale {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A `connect(2)` to a Unix stream socket that never waits: it is queued at once, or fails
/// with `WouldBlock` when the listener's accept queue is full, so a probe of a holder that
/// no longer accepts returns at once and the claim keeps its time limit.
fn connect_nonblocking(path: &Path) -> io::Result<()> {
    let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.connect(&socket2::SockAddr::unix(path)?)
}

fn remove_stale(path: &Path) -> Result<(), ClaimError> {
    tracing::info!(socket = %path.display(), "removing stale socket");
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ClaimError::Stale {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Binds in a private staging directory, sets the mode, then hard-links the socket to `path`.
fn bind_and_publish(dir: &Path, path: &Path) -> Result<(UnixListener, ClaimedPath), ClaimError> {
    let bind_err = |source| ClaimError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let staging = Staging::create(dir).map_err(bind_err)?;
    let listener = UnixListener::bind(&staging.socket).map_err(bind_err)?;
    fs::set_permissions(&staging.socket, fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(bind_err)?;
    match fs::hard_link(&staging.socket, path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(ClaimError::InUse {
                path: path.to_path_buf(),
            })
        }
        Err(e) => return Err(bind_err(e)),
    }
    drop(staging);
    // Built before anything else can fail, so an error below still removes the published file.
    let meta = fs::symlink_metadata(path).map_err(bind_err)?;
    let claimed = ClaimedPath {
        path: path.to_path_buf(),
        dev: meta.dev(),
        ino: meta.ino(),
    };
    listener.set_nonblocking(true).map_err(bind_err)?;
    Ok((listener, claimed))
}

/// How a daemon closes its local sockets (UAPI, status) before the rest of its stop, so that a
/// successor started the moment the interface is deleted finds the paths free: each server
/// serves until its [`CloseRequest`] resolves and drops the request once its socket is closed
/// and unlinked; [`CloseFirst::close`] asks them all and waits for every request to be dropped.
#[derive(Debug)]
pub struct CloseFirst {
    asked: tokio::sync::watch::Sender<bool>,
    /// Cloned into every request; taken by `close`, so the receiver ends once every request is gone.
    open: parking_lot::Mutex<Option<tokio::sync::mpsc::Sender<()>>>,
    closed: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<()>>,
}

impl Default for CloseFirst {
    fn default() -> Self {
        let (open, closed) = tokio::sync::mpsc::channel(1);
        CloseFirst {
            asked: tokio::sync::watch::Sender::new(false),
            open: parking_lot::Mutex::new(Some(open)),
            closed: tokio::sync::Mutex::new(closed),
        }
    }
}

impl CloseFirst {
    /// The shutdown future for one server. A request made after [`CloseFirst::close`] is
    /// already resolved.
    pub fn request(&self) -> CloseRequest {
        let mut asked = self.asked.subscribe();
        CloseRequest {
            asked: Box::pin(async move {
                let _ = asked.wait_for(|a| *a).await;
            }),
            _open: self.open.lock().clone(),
        }
    }

    /// Whether [`CloseFirst::close`] was called: a server that ended before it ended by itself.
    pub fn asked(&self) -> bool {
        *self.asked.borrow()
    }

    /// Asks every server to close and waits until each has dropped its request, or `limit`
    /// passes (then returns false: a server is stuck, and the stop goes on without it). Later
    /// calls find nothing open and return at once.
    pub async fn close(&self, limit: std::time::Duration) -> bool {
        self.asked.send_replace(true);
        drop(self.open.lock().take());
        let mut closed = self.closed.lock().await;
        tokio::time::timeout(limit, async { while closed.recv().await.is_some() {} })
            .await
            .is_ok()
    }
}

/// Resolves when the server holding it must close; dropping it tells [`CloseFirst::close`]
/// that this server's socket is closed. A server therefore keeps it until its listener is
/// closed and its file unlinked, and drops it before anything slower (open connections).
pub struct CloseRequest {
    asked: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    _open: Option<tokio::sync::mpsc::Sender<()>>,
}

impl std::future::Future for CloseRequest {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.get_mut().asked.as_mut().poll(cx)
    }
}

/// A private (0700) directory beside the socket, where it is bound before it is published.
struct Staging {
    dir: PathBuf,
    socket: PathBuf,
}

impl Staging {
    fn create(parent: &Path) -> io::Result<Staging> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        // Not `*.sock`, so `wg` never lists it.
        let dir = parent.join(format!(".tg-{}-{n}", std::process::id()));
        DirBuilder::new().mode(0o700).create(&dir)?;
        let socket = dir.join("s");
        Ok(Staging { dir, socket })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.socket);
        let _ = fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    use crate::test_util::TempDir;

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path)
            .expect("stat")
            .permissions()
            .mode()
            & 0o777
    }

    #[test]
    fn creates_the_dir_0755_and_a_0600_socket_and_nothing_else() {
        let tmp = TempDir::new("claim");
        let dir = tmp.0.join("run/deeper");
        let path = dir.join("tg0.sock");
        let (_listener, claimed) = claim(&path).expect("claim");
        assert_eq!(claimed.path(), path);
        assert!(fs::symlink_metadata(&path)
            .expect("stat")
            .file_type()
            .is_socket());
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir), 0o755);
        // The staging directory is gone.
        assert_eq!(fs::read_dir(&dir).expect("dir").count(), 1);
        assert!(claimed.still_ours());
        // A client can connect.
        UnixStream::connect(&path).expect("connect");
    }

    #[test]
    fn a_stale_socket_is_replaced() {
        let tmp = TempDir::new("claim");
        fs::create_dir_all(&tmp.0).expect("dir");
        let path = tmp.0.join("tg1.sock");
        // A socket file nobody listens on, as a killed daemon leaves behind.
        drop(UnixListener::bind(&path).expect("bind"));
        let old_ino = fs::symlink_metadata(&path).expect("stat").ino();
        let (_listener, claimed) = claim(&path).expect("replaces the stale socket");
        assert_ne!(fs::symlink_metadata(&path).expect("stat").ino(), old_ino);
        assert!(claimed.still_ours());
        UnixStream::connect(&path).expect("connect");
    }

    #[test]
    fn a_live_socket_is_refused_and_kept() {
        let tmp = TempDir::new("claim");
        let path = tmp.0.join("tg2.sock");
        let (_listener, first) = claim(&path).expect("first");
        let err = claim(&path).expect_err("second claim");
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert!(err.to_string().contains("in use"), "{err}");
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
        assert!(first.still_ours(), "the live socket was not touched");
    }

    #[test]
    fn a_regular_file_is_refused_and_kept() {
        let tmp = TempDir::new("claim");
        fs::create_dir_all(&tmp.0).expect("dir");
        let path = tmp.0.join("tg3.sock");
        fs::write(&path, "precious").expect("write");
        let err = claim(&path).expect_err("not a socket");
        assert!(matches!(err, ClaimError::NotASocket { .. }), "{err}");
        assert_eq!(fs::read_to_string(&path).expect("kept"), "precious");
    }

    #[test]
    fn a_file_as_the_directory_is_refused() {
        let tmp = TempDir::new("claim");
        fs::create_dir_all(&tmp.0).expect("dir");
        fs::write(tmp.0.join("run"), "x").expect("write");
        let err = claim(&tmp.0.join("run/tg4.sock")).expect_err("dir is a file");
        assert!(matches!(err, ClaimError::CreateDir { .. }), "{err}");
    }

    #[test]
    fn losing_the_race_does_not_replace_the_winner() {
        // The winner published between our stale check and our link: link(2) must fail.
        let tmp = TempDir::new("claim");
        fs::create_dir_all(&tmp.0).expect("dir");
        let path = tmp.0.join("tg5.sock");
        let _winner = UnixListener::bind(&path).expect("winner");
        let ino = fs::symlink_metadata(&path).expect("stat").ino();
        let err = bind_and_publish(&tmp.0, &path).expect_err("lost the race");
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert_eq!(fs::symlink_metadata(&path).expect("stat").ino(), ino);
        assert_eq!(
            fs::read_dir(&tmp.0).expect("dir").count(),
            1,
            "no staging left"
        );
    }

    #[test]
    fn drop_removes_the_socket_only_while_it_is_ours() {
        let tmp = TempDir::new("claim");
        let path = tmp.0.join("tg6.sock");
        let (listener, claimed) = claim(&path).expect("claim");
        drop(listener);
        drop(claimed);
        assert!(!path.exists(), "removed on drop");

        let (_listener, claimed) = claim(&path).expect("claim again");
        // Someone else took the path over (e.g. a newer daemon after removing ours).
        fs::remove_file(&path).expect("rm");
        fs::write(&path, "other").expect("write");
        assert!(!claimed.still_ours());
        drop(claimed);
        assert_eq!(fs::read_to_string(&path).expect("spared"), "other");
    }

    /// An interface name that exists in no namespace.
    const GONE: &str = "tgnoiface0";

    #[test]
    fn a_holder_whose_interface_is_gone_is_waited_for_and_then_replaced() {
        let tmp = TempDir::new("claim");
        let path = tmp.0.join("tg7.sock");
        let (holder, _claimed) = claim(&path).expect("holder");
        // The holder closes a little later, as an instance does once it sees its device gone.
        let closer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(150));
            drop(holder);
        });
        let started = crate::shell::clock::now();
        let (_listener, successor) = claim_for_interface(&path, GONE).expect("waits, then claims");
        let waited = crate::shell::clock::now() - started;
        closer.join().expect("closer");
        assert!(
            waited >= std::time::Duration::from_millis(100),
            "it waited: {waited:?}"
        );
        assert!(waited < HANDOVER_WAIT, "no longer than needed: {waited:?}");
        assert!(successor.still_ours());
        UnixStream::connect(&path).expect("the successor answers");
    }

    #[test]
    fn a_holder_whose_interface_exists_is_refused_at_once() {
        let tmp = TempDir::new("claim");
        let path = tmp.0.join("tg8.sock");
        let (_holder, first) = claim(&path).expect("holder");
        let started = crate::shell::clock::now();
        // `lo` exists in every network namespace.
        let err = claim_for_interface(&path, "lo").expect_err("live");
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert!(
            crate::shell::clock::now() - started < HANDOVER_WAIT / 2,
            "no wait"
        );
        assert!(first.still_ours());
    }

    #[test]
    fn a_holder_that_stays_is_refused_after_the_wait() {
        let tmp = TempDir::new("claim");
        let path = tmp.0.join("tg9.sock");
        let (_holder, first) = claim(&path).expect("holder");
        let started = crate::shell::clock::now();
        let err = claim_for_interface(&path, GONE).expect_err("still live after the wait");
        let waited = crate::shell::clock::now() - started;
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert!(waited >= HANDOVER_WAIT, "{waited:?}");
        assert!(waited < HANDOVER_WAIT * 3, "{waited:?}");
        assert!(first.still_ours(), "the live socket was not touched");
    }

    /// A listener whose accept queue is full, as an old instance that stopped accepting has.
    fn full_listener(path: &Path) -> (socket2::Socket, Vec<socket2::Socket>) {
        use socket2::{Domain, SockAddr, Socket, Type};
        let listener = Socket::new(Domain::UNIX, Type::STREAM, None).expect("socket");
        listener
            .bind(&SockAddr::unix(path).expect("addr"))
            .expect("bind");
        listener.listen(0).expect("listen");
        let mut queued = Vec::new();
        for _ in 0..64 {
            let c = Socket::new(Domain::UNIX, Type::STREAM, None).expect("socket");
            c.set_nonblocking(true).expect("nonblocking");
            match c.connect(&SockAddr::unix(path).expect("addr")) {
                Ok(()) => queued.push(c),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return (listener, queued),
                Err(e) => panic!("filling the backlog: {e}"),
            }
        }
        panic!("the accept queue never filled");
    }

    /// Runs `f` on a thread and gives up after `limit` (a blocking connect would hang the test).
    fn within<T: Send + 'static>(
        limit: std::time::Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit)
            .expect("the claim blocked on a listener that never accepts")
    }

    #[test]
    fn a_holder_with_a_full_backlog_does_not_block_a_start() {
        // Issue 27: the probe's connect waited for an accept that never came.
        let tmp = TempDir::new("claim");
        fs::create_dir_all(&tmp.0).expect("dir");
        let path = tmp.0.join("tg10.sock");
        let (_listener, _queued) = full_listener(&path);
        let p = path.clone();
        let started = crate::shell::clock::now();
        let err = within(HANDOVER_WAIT * 5, move || claim_for_interface(&p, GONE))
            .expect_err("a live holder is refused");
        let waited = crate::shell::clock::now() - started;
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert!(
            waited < HANDOVER_WAIT * 3,
            "the 1 s promise holds: {waited:?}"
        );
        let p = path.clone();
        let err = within(HANDOVER_WAIT, move || claim(&p)).expect_err("refused at once");
        assert!(matches!(err, ClaimError::InUse { .. }), "{err}");
        assert!(path.exists(), "the holder's socket is kept");
    }

    #[tokio::test]
    async fn close_first_waits_until_every_server_has_dropped_its_request() {
        let sockets = CloseFirst::default();
        assert!(
            !sockets.asked(),
            "no stop asked yet: a server ending now ends by itself"
        );
        let (closed_tx, mut closed_rx) = tokio::sync::mpsc::unbounded_channel();
        for n in 0..2u64 {
            let request = sockets.request();
            let closed_tx = closed_tx.clone();
            tokio::spawn(async move {
                let mut request = request;
                (&mut request).await;
                // Closing takes a while; the request is held until it is done.
                tokio::time::sleep(std::time::Duration::from_millis(50 * (n + 1))).await;
                let _ = closed_tx.send(n);
                drop(request);
            });
        }
        drop(closed_tx);
        assert!(sockets.close(std::time::Duration::from_secs(5)).await);
        assert!(sockets.asked());
        let mut done = Vec::new();
        while let Ok(n) = closed_rx.try_recv() {
            done.push(n);
        }
        assert_eq!(
            done,
            vec![0, 1],
            "close returned only after both servers closed"
        );
        // A later call, and a later request, find it closed already.
        assert!(sockets.close(std::time::Duration::from_millis(1)).await);
        tokio::time::timeout(std::time::Duration::from_secs(1), sockets.request())
            .await
            .expect("a late request is resolved");
    }

    #[tokio::test]
    async fn close_first_gives_up_on_a_stuck_server() {
        let sockets = CloseFirst::default();
        let _stuck = sockets.request();
        assert!(!sockets.close(std::time::Duration::from_millis(50)).await);
    }
}
