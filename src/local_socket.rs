//! Claiming a Unix socket path for a local server (the UAPI socket and the status socket): the
//! directory, the stale-or-live check, a race-free 0600 bind, and removal on drop only while the
//! file is still ours. It owns no protocol and no error wording a user sees: each server maps
//! [`ClaimError`] into its own error type.

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The socket's mode: only root (the owner) may connect.
const SOCKET_MODE: u32 = 0o600;
/// The mode of a directory this module creates: clients must be able to traverse it.
const DIR_MODE: u32 = 0o755;

/// Why a socket path could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The socket's directory is missing and cannot be created, or is not a directory.
    #[error("cannot create the socket directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Something other than a socket is at the path; it is left alone.
    #[error("{} exists and is not a socket; refusing to replace it", path.display())]
    NotASocket { path: PathBuf },
    /// A live process answered a connect on the path, or won the race to publish its socket.
    #[error("{} is in use by another live process", path.display())]
    InUse { path: PathBuf },
    /// Connecting to the existing socket was refused for lack of permission (not root?).
    #[error("permission denied on {} (run as root)", path.display())]
    PermissionDenied { path: PathBuf },
    /// The existing socket could not be inspected, checked or removed.
    #[error("cannot check or remove the stale socket {}: {source}", path.display())]
    Stale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Binding, restricting or publishing the new socket failed.
    #[error("cannot create the socket {}: {source}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
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
    let dir = parent_dir(path);
    ensure_dir(dir)?;
    remove_if_stale(path)?;
    bind_and_publish(dir, path)
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

/// Removes `path` if it is a socket nothing answers on; refuses if something answers or if it
/// is not a socket.
fn remove_if_stale(path: &Path) -> Result<(), ClaimError> {
    let stale = |source| ClaimError::Stale {
        path: path.to_path_buf(),
        source,
    };
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(stale(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(ClaimError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ClaimError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(socket = %path.display(), "removing stale socket");
            match fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(stale(e)),
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            Err(ClaimError::PermissionDenied {
                path: path.to_path_buf(),
            })
        }
        Err(e) => Err(stale(e)),
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
}
