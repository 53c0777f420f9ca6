//! The endpoints file on disk (`core::endpoints_file` decides what it holds): where it lives,
//! reading it back at start, and writing it whole and atomically. The file tells a restarted
//! daemon where its takeovers may go, so whoever could write it could aim this identity's fresh
//! initiations: it is read only when it and its folder belong to this process's user and no one
//! else may write them, never through a link, and only up to a bound.

use crate::config::{PublicKey, StateFile, Takeover};
use crate::core::endpoints_file::{self, Restored, MAX_BYTES};

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The folder used when neither `takeover.state_file`, `TUNNELGATE_STATE_DIR` nor systemd's
/// `STATE_DIRECTORY` says.
pub const DEFAULT_DIR: &str = "/var/lib/tunnelgate";

/// Where interface `name` keeps its endpoints, or `None` (`takeover.state_file = ""`).
pub fn path_for(takeover: &Takeover, name: &str) -> Option<PathBuf> {
    match &takeover.state_file {
        StateFile::Off => None,
        StateFile::Path(path) => Some(path.clone()),
        StateFile::Default => Some(
            crate::shell::tuning::state_dir()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR))
                .join(format!("{name}.endpoints")),
        ),
    }
}

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum NotRead {
    /// There is none yet (a first start).
    #[error("no file yet")]
    Missing,
    #[error("{0}")]
    Unsafe(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Refused(#[from] endpoints_file::Refused),
}

/// Reads the file at `path` for `identity`.
pub fn load(path: &Path, identity: &PublicKey) -> Result<Restored, NotRead> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(NotRead::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(NotRead::Unsafe("it is a symbolic link".into()))
        }
        Err(e) => return Err(e.into()),
    };
    let meta = file.metadata()?;
    trusted("it", &meta, true)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        trusted("its folder", &std::fs::metadata(dir)?, false)?;
    }
    if meta.len() > MAX_BYTES {
        return Err(NotRead::Unsafe(format!(
            "it holds {} bytes, more than the {MAX_BYTES} an endpoints file may",
            meta.len()
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(NotRead::Unsafe(format!(
            "it grew past the {MAX_BYTES} bytes an endpoints file may"
        )));
    }
    // Lines that are not UTF-8 are skipped by the parser like any other bad line.
    let text = String::from_utf8_lossy(&bytes);
    Ok(endpoints_file::parse(&text, identity)?)
}

/// Whether `meta` (of the file, `file`, or of its folder) belongs to this process's user and
/// no one else may write it.
fn trusted(what: &str, meta: &std::fs::Metadata, file: bool) -> Result<(), NotRead> {
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(NotRead::Unsafe(format!(
            "{what} belongs to uid {}, not to this process's uid {me}",
            meta.uid()
        )));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(NotRead::Unsafe(format!(
            "{what} may be written by others (mode {:04o})",
            meta.permissions().mode() & 0o7777
        )));
    }
    if file && !meta.file_type().is_file() {
        return Err(NotRead::Unsafe(format!("{what} is not a regular file")));
    }
    Ok(())
}

/// Writes `text` to `path` whole: a new file (0600) beside it, synced, renamed over it. The
/// folder is made (0700) when missing.
pub fn save(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("the endpoints file has no name"))?;
    let mut temporary = dir.join(format!(
        ".{}.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    // A leftover of a killed run of this same pid is ours to replace.
    let _ = std::fs::remove_file(&temporary);
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&temporary)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        temporary = PathBuf::new();
        Ok(())
    })();
    if !temporary.as_os_str().is_empty() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// Keeps the endpoints file of one interface: reads it once the interface has an identity
/// (at start, or once `wg set private-key` gives one), hands its endpoints to the data plane,
/// and writes the peers' learned endpoints back at most every `WRITE_EVERY` while they change,
/// and at a stop. Its writes run on the blocking threads, never on the event loop.
pub struct Keeper {
    path: Option<PathBuf>,
    dataplane: std::sync::Arc<crate::shell::dataplane::Dataplane>,
    /// The identity whose file was read (`None`: none yet).
    read_for: Option<PublicKey>,
    schedule: endpoints_file::WriteSchedule,
    writing: Option<tokio::task::JoinHandle<()>>,
    /// The last write's error, said once until it changes.
    last_error: std::sync::Arc<parking_lot::Mutex<Option<String>>>,
}

impl Keeper {
    pub fn new(
        path: Option<PathBuf>,
        dataplane: std::sync::Arc<crate::shell::dataplane::Dataplane>,
    ) -> Keeper {
        Keeper {
            path,
            dataplane,
            read_for: None,
            schedule: endpoints_file::WriteSchedule::default(),
            writing: None,
            last_error: Default::default(),
        }
    }

    /// Reads the file when the interface has an identity it was not read for.
    pub fn read_if_new_identity(&mut self) {
        let identity = self.dataplane.identity();
        if identity.private_key.is_none() || self.read_for == Some(identity.public_key) {
            return;
        }
        self.read_for = Some(identity.public_key);
        let Some(path) = &self.path else { return };
        match load(path, &identity.public_key) {
            Ok(restored) => {
                tracing::info!(
                    path = %path.display(),
                    peers = restored.peers.len(),
                    skipped = restored.skipped,
                    "Endpoints where peers authenticated before this start read back: takeovers may go there"
                );
                self.dataplane
                    .learn_endpoints(restored.peers, crate::core::takeover::Origin::Restored);
            }
            Err(NotRead::Missing) => {
                tracing::debug!(path = %path.display(), "No endpoints file yet")
            }
            Err(why) => tracing::warn!(
                path = %path.display(),
                error = %why,
                "Endpoints file not read: until peers authenticate again, takeovers go only to configured endpoints"
            ),
        }
    }

    /// A second's work on the event loop at `now`: notes what peers learned, and starts a
    /// write when one is due. Returns the peers' news (each one's newest learned endpoint), for
    /// the group's exchange.
    pub fn tick(
        &mut self,
        now: std::time::Instant,
    ) -> Vec<(PublicKey, crate::core::takeover::Learned)> {
        self.read_if_new_identity();
        let news = self.dataplane.learned_news();
        if !news.is_empty() {
            self.schedule.changed();
        }
        let busy = self.writing.as_ref().is_some_and(|w| !w.is_finished());
        if self.path.is_some() && !busy && self.schedule.due(now) {
            self.schedule.written(now);
            self.writing = Some(tokio::task::spawn_blocking(self.write_job()));
        }
        news
    }

    /// At a stop, once the packet threads are gone: writes what was not written yet.
    pub async fn save_at_stop(&mut self) {
        if let Some(w) = self.writing.take() {
            let _ = w.await;
        }
        if !self.dataplane.learned_news().is_empty() {
            self.schedule.changed();
        }
        if self.path.is_none() || !self.schedule.is_dirty() {
            return;
        }
        self.schedule.written(crate::shell::clock::now());
        let _ = tokio::task::spawn_blocking(self.write_job()).await;
    }

    fn write_job(&self) -> impl FnOnce() + Send + 'static {
        let path = self.path.clone();
        let dataplane = self.dataplane.clone();
        let last_error = self.last_error.clone();
        move || {
            let Some(path) = path else { return };
            let identity = dataplane.identity();
            if identity.private_key.is_none() {
                return;
            }
            let peers = dataplane.learned_endpoints();
            let text =
                endpoints_file::render(&identity.public_key, peers.iter().map(|(k, e)| (k, e)));
            let outcome = save(&path, &text).err().map(|e| e.to_string());
            let mut said = last_error.lock();
            if outcome != *said {
                match &outcome {
                    Some(error) => tracing::warn!(
                        path = %path.display(),
                        %error,
                        "Endpoints file not written: a restart will not know where peers authenticated"
                    ),
                    None if said.is_some() => {
                        tracing::info!(path = %path.display(), "Endpoints file written again")
                    }
                    None => {}
                }
                *said = outcome;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::endpoints_file::render;
    use std::net::SocketAddr;

    fn key(b: u8) -> PublicKey {
        PublicKey([b; 32])
    }

    fn mode_of(path: &Path) -> u32 {
        std::fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0)
    }

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "tg-endpoints-{}-{}",
            std::process::id(),
            crate::shell::clock::wall_now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&d)
            .expect("temp dir");
        d
    }

    fn text() -> String {
        let e = SocketAddr::from(([192, 0, 2, 1], 51820));
        render(&key(1), [(&key(2), &e)])
    }

    #[test]
    fn saved_whole_0600_in_a_new_0700_folder_and_read_back() {
        let top = dir();
        let path = top.join("state").join("tg0.endpoints");
        save(&path, &text()).expect("saved");
        assert_eq!(mode_of(&path), 0o600);
        assert_eq!(mode_of(path.parent().expect("dir")), 0o700);
        let restored = load(&path, &key(1)).expect("read");
        assert_eq!(restored.peers.len(), 1);
        save(&path, &text()).expect("replaced");
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("dir")
            .collect();
        assert_eq!(leftovers.len(), 1, "no temporary left behind");
        assert!(matches!(
            load(&top.join("none"), &key(1)),
            Err(NotRead::Missing)
        ));
        let _ = std::fs::remove_dir_all(top);
    }

    /// Whoever can write the file aims this identity's takeovers: a file others may write, a
    /// folder others may write, a link, something that is not a file, another identity's file,
    /// an endless file: each is refused, and said why.
    #[test]
    fn a_file_anyone_else_could_have_written_is_refused() {
        let top = dir();
        let path = top.join("tg0.endpoints");
        save(&path, &text()).expect("saved");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o622)).expect("chmod");
        let why = load(&path, &key(1))
            .expect_err("others may write it")
            .to_string();
        assert!(why.contains("written by others"), "{why}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let why = load(&path, &key(1)).expect_err("its folder").to_string();
        assert!(why.contains("its folder"), "{why}");
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let link = top.join("link.endpoints");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        let why = load(&link, &key(1)).expect_err("a link").to_string();
        assert!(why.contains("symbolic link"), "{why}");
        let fifo = top.join("fifo.endpoints");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        let why = load(&fifo, &key(1)).expect_err("a fifo").to_string();
        assert!(why.contains("not a regular file"), "{why}");
        let why = load(&path, &key(9))
            .expect_err("another identity")
            .to_string();
        assert!(why.contains("another identity"), "{why}");
        let big = top.join("big.endpoints");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&big)
            .expect("big");
        file.set_len(MAX_BYTES + 1).expect("sparse");
        let why = load(&big, &key(1)).expect_err("too big").to_string();
        assert!(why.contains("more than"), "{why}");
        let _ = std::fs::remove_dir_all(top);
    }

    #[test]
    fn the_path_follows_the_config_then_the_environment_then_the_default() {
        let off = Takeover {
            state_file: StateFile::Off,
            ..Takeover::default()
        };
        assert_eq!(path_for(&off, "tg0"), None);
        let given = Takeover {
            state_file: StateFile::Path("/srv/x.endpoints".into()),
            ..Takeover::default()
        };
        assert_eq!(
            path_for(&given, "tg0"),
            Some(PathBuf::from("/srv/x.endpoints"))
        );
        let default = path_for(&Takeover::default(), "tg0").expect("a path");
        assert!(default.ends_with("tg0.endpoints"), "{}", default.display());
    }
}
