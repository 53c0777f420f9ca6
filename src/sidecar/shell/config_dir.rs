//! The config directory a proxy-group sidecar shares with its proxy container (an in-memory
//! `emptyDir`): what goes in it ([`volume_files`], pure) and how it is swapped in atomically
//! ([`ConfigDir::write`]), the way the kubelet updates a mounted Secret: the files go into a new
//! hidden directory, the `..data` symlink is renamed over to point at it, and each visible name
//! (`tunnelgate.toml`, `private.key`, ...) is a symlink through `..data`. The daemon therefore
//! never reads a half-written file or a config with another config's key, and notices the swap
//! with the same poll that notices a Secret volume's.
//!
//! Why a volume and not the Secret: a StatefulSet's pod template cannot mount a different Secret
//! in each pod, so with per-replica Secrets mounted, every replica needs its own volume and mount
//! in the manifests, and `kubectl scale` alone cannot add one. The Secret stays the durable
//! record (the key survives the pod; peers read `public_key` from it); the volume is the hand-off.
//! With a group's shared identity the replica's Secret holds no key: the volume's `private.key`
//! is the group's, from its identity Secret, the one place the API keeps it.

use crate::config::SecretKey;
use crate::shell::config_file::{gunzip_bounded, MAX_DECOMPRESSED_BYTES};
use crate::sidecar::{KEY_CONFIG, KEY_CONFIG_GZ, KEY_DEVICE_IPS, KEY_PRIVATE, KEY_PUBLIC};
use std::collections::BTreeMap;
use std::io::{self, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The symlink that names the current generation of files.
const DATA: &str = "..data";
/// Prefix of each generation's hidden directory.
const GENERATION_PREFIX: &str = "..tg-";
/// Files are readable by their owner (the sidecar) and group (which the proxy container is given
/// as a supplementary group), by nobody else, and writable by nobody: the daemon's
/// `key_files_readable_by_group` accepts exactly this.
const FILE_MODE: u32 = 0o440;
/// Each generation's directory: the group may list and enter it.
const DIR_MODE: u32 = 0o750;

/// What the proxy container reads, from the Secret data the sidecar wrote (or found up to date):
/// the configuration as plain `tunnelgate.toml` (gunzipped when the Secret holds the `.gz` form:
/// a file has no 1 MiB limit), the private key, and the two keys peers need. The key is
/// `group_key` when the replica runs the group's shared identity (its Secret holds none, and a
/// `private.key` found there anyway is never handed over), else the Secret's own.
pub fn volume_files(
    data: &BTreeMap<String, Vec<u8>>,
    group_key: Option<&SecretKey>,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let config = match (data.get(KEY_CONFIG), data.get(KEY_CONFIG_GZ)) {
        (Some(plain), _) => plain.clone(),
        // Bounded like the daemon's own read of a `.gz`: a bomb in the Secret stops here.
        (None, Some(gz)) => gunzip_bounded(gz, MAX_DECOMPRESSED_BYTES)
            .map_err(|e| format!("{KEY_CONFIG_GZ}: {e}"))?,
        (None, None) => return Err(format!("no {KEY_CONFIG} to hand over")),
    };
    let private = match group_key {
        Some(key) => key.expose_base64().into_bytes(),
        None => data
            .get(KEY_PRIVATE)
            .cloned()
            .ok_or_else(|| format!("no {KEY_PRIVATE} to hand over"))?,
    };
    let mut files = BTreeMap::from([
        (KEY_CONFIG.to_string(), config),
        (KEY_PRIVATE.to_string(), private),
    ]);
    for key in [KEY_PUBLIC, KEY_DEVICE_IPS] {
        let value = data
            .get(key)
            .ok_or_else(|| format!("no {key} to hand over"))?;
        files.insert(key.to_string(), value.clone());
    }
    Ok(files)
}

/// The shared directory, and what it holds.
#[derive(Debug, Clone)]
pub struct ConfigDir {
    path: PathBuf,
    /// What was last handed over (by this sidecar, or its previous run in the same pod).
    held: Option<BTreeMap<String, Vec<u8>>>,
}

impl ConfigDir {
    pub fn open(path: PathBuf) -> ConfigDir {
        let mut dir = ConfigDir { path, held: None };
        dir.held = dir.read();
        dir
    }

    /// Hands `files` over unless the directory holds them already; true when it wrote.
    pub fn update(&mut self, files: BTreeMap<String, Vec<u8>>) -> io::Result<bool> {
        if self.held.as_ref() == Some(&files) {
            return Ok(false);
        }
        self.write(&files)?;
        self.held = Some(files);
        Ok(true)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The files of the current generation, if there is one (a sidecar that restarts in a pod
    /// that kept its volume finds what it handed over before).
    pub fn read(&self) -> Option<BTreeMap<String, Vec<u8>>> {
        let data = self.path.join(DATA);
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(&data).ok()? {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            files.insert(name, std::fs::read(entry.path()).ok()?);
        }
        Some(files)
    }

    /// Makes `files` the directory's content in one step: a new generation, `..data` renamed
    /// over to it, a symlink per name, then the old generation and names no longer handed over
    /// removed.
    pub fn write(&self, files: &BTreeMap<String, Vec<u8>>) -> io::Result<()> {
        static GENERATION: AtomicU64 = AtomicU64::new(0);
        let generation = format!(
            "{GENERATION_PREFIX}{}-{}",
            std::process::id(),
            GENERATION.fetch_add(1, Ordering::Relaxed)
        );
        let dir = self.path.join(&generation);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(DIR_MODE))?;
        for (name, bytes) in files {
            if name.contains('/') || name.starts_with('.') {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{name:?} is not a plain file name"),
                ));
            }
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(FILE_MODE)
                .open(dir.join(name))?;
            file.write_all(bytes)?;
            file.sync_all()?;
            // The umask may have taken bits off the mode asked for; the group needs its read.
            file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
        }
        replace_symlink(&self.path, DATA, Path::new(&generation))?;
        for name in files.keys() {
            let target = Path::new(DATA).join(name);
            if std::fs::read_link(self.path.join(name)).ok().as_deref() != Some(&target) {
                replace_symlink(&self.path, name, &target)?;
            }
        }
        // Cleanup: a failure here leaves stale files, never a wrong configuration.
        for entry in std::fs::read_dir(&self.path)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with(GENERATION_PREFIX) && name != generation {
                let _ = std::fs::remove_dir_all(&path);
            } else if !name.starts_with('.') && !files.contains_key(&name) {
                let into_data = std::fs::read_link(&path).is_ok_and(|t| t.starts_with(DATA));
                if into_data {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }
}

/// Points `dir/name` at `target` atomically (a temporary symlink renamed over it).
fn replace_symlink(dir: &Path, name: &str, target: &Path) -> io::Result<()> {
    let tmp = dir.join(format!("..{name}_tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(config_key: &str, config: Vec<u8>) -> BTreeMap<String, Vec<u8>> {
        BTreeMap::from([
            (config_key.to_string(), config),
            (KEY_PRIVATE.to_string(), b"key".to_vec()),
            (KEY_PUBLIC.to_string(), b"pub".to_vec()),
            (KEY_DEVICE_IPS.to_string(), b"[\"100.64.1.1\"]".to_vec()),
        ])
    }

    #[test]
    fn the_volume_gets_the_plain_config_whichever_form_the_secret_holds() {
        let plain =
            volume_files(&data(KEY_CONFIG, b"[interface]\n".to_vec()), None).expect("plain");
        let gz = volume_files(
            &data(KEY_CONFIG_GZ, crate::sidecar::gzip(b"[interface]\n")),
            None,
        )
        .expect("gz");
        assert_eq!(plain, gz);
        assert_eq!(
            plain.keys().map(String::as_str).collect::<Vec<_>>(),
            [KEY_DEVICE_IPS, KEY_PRIVATE, KEY_PUBLIC, KEY_CONFIG]
        );
        assert_eq!(plain[KEY_CONFIG], b"[interface]\n");
        let err =
            volume_files(&data(KEY_CONFIG_GZ, b"not gzip".to_vec()), None).expect_err("bad gz");
        assert!(err.contains("not a gzip-compressed"), "{err}");
        // Bounded like the daemon's read: a bomb in the Secret is refused, not unpacked.
        let mib = crate::sidecar::gzip(&vec![b' '; 1 << 20]);
        let bomb = mib.repeat((MAX_DECOMPRESSED_BYTES >> 20) as usize + 1);
        let err = volume_files(&data(KEY_CONFIG_GZ, bomb), None).expect_err("a bomb");
        assert!(err.contains("more than 67108864 bytes"), "{err}");
        // Every member, as the daemon reads them; garbage after the last is refused.
        let two = [
            crate::sidecar::gzip(b"[interface]\n"),
            crate::sidecar::gzip(b"[[peer]]\n"),
        ]
        .concat();
        let files = volume_files(&data(KEY_CONFIG_GZ, two.clone()), None).expect("two members");
        assert_eq!(files[KEY_CONFIG], b"[interface]\n[[peer]]\n");
        let err = volume_files(&data(KEY_CONFIG_GZ, [&two[..], b"junk"].concat()), None)
            .expect_err("trailing garbage");
        assert!(err.contains("trailing data"), "{err}");
        let mut no_key = data(KEY_CONFIG, Vec::new());
        no_key.remove(KEY_PRIVATE);
        assert_eq!(
            volume_files(&no_key, None).expect_err("no key"),
            "no private.key to hand over"
        );
    }

    /// With a shared identity the replica's Secret holds no key: the volume gets the group's,
    /// and a `private.key` still in the Secret (an older version's copy, or anyone's edit) is
    /// never what the proxy runs.
    #[test]
    fn with_a_shared_identity_the_volume_gets_the_group_key_not_the_secrets() {
        let group = SecretKey([5; 32]);
        let mut secret = data(KEY_CONFIG, b"[interface]\n".to_vec());
        secret.remove(KEY_PRIVATE);
        let files = volume_files(&secret, Some(&group)).expect("no key in the Secret");
        assert_eq!(files[KEY_PRIVATE], group.expose_base64().into_bytes());
        secret.insert(
            KEY_PRIVATE.into(),
            SecretKey([6; 32]).expose_base64().into_bytes(),
        );
        let files = volume_files(&secret, Some(&group)).expect("a stale key in the Secret");
        assert_eq!(files[KEY_PRIVATE], group.expose_base64().into_bytes());
        assert_eq!(
            files.keys().map(String::as_str).collect::<Vec<_>>(),
            [KEY_DEVICE_IPS, KEY_PRIVATE, KEY_PUBLIC, KEY_CONFIG]
        );
    }

    #[test]
    fn a_write_swaps_every_file_at_once_and_leaves_one_generation() {
        let root = std::env::temp_dir().join(format!("tg-config-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("dir");
        let dir = ConfigDir::open(root.clone());
        assert_eq!(dir.read(), None, "nothing handed over yet");

        let first = BTreeMap::from([
            ("tunnelgate.toml".to_string(), b"one".to_vec()),
            ("private.key".to_string(), b"k1".to_vec()),
            ("old".to_string(), b"gone next".to_vec()),
        ]);
        // Each write reads back whole, the config file under its plain name.
        let hand_over = |data: &BTreeMap<String, Vec<u8>>, config: &[u8]| {
            dir.write(data).expect("write");
            assert_eq!(dir.read().as_ref(), Some(data));
            assert_eq!(
                std::fs::read(root.join("tunnelgate.toml")).expect("read"),
                config
            );
        };
        hand_over(&first, b"one");
        let mode = std::fs::metadata(root.join("private.key"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, FILE_MODE);

        let second = BTreeMap::from([
            ("tunnelgate.toml".to_string(), b"two".to_vec()),
            ("private.key".to_string(), b"k1".to_vec()),
        ]);
        hand_over(&second, b"two");
        assert!(
            std::fs::symlink_metadata(root.join("old")).is_err(),
            "a name no longer handed over is removed"
        );
        let mut names: Vec<String> = std::fs::read_dir(&root)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let generations = names
            .iter()
            .filter(|n| n.starts_with(GENERATION_PREFIX))
            .count();
        assert_eq!(generations, 1, "{names:?}");
        assert_eq!(
            names
                .iter()
                .filter(|n| !n.starts_with(GENERATION_PREFIX))
                .collect::<Vec<_>>(),
            ["..data", "private.key", "tunnelgate.toml"]
        );
        // A name that would escape the directory is refused, and the last generation stays.
        let bad = BTreeMap::from([("../x".to_string(), Vec::new())]);
        assert!(dir.write(&bad).is_err());
        assert_eq!(dir.read().as_ref(), Some(&second));
        // Unchanged content is not written again, also by a sidecar that restarts.
        let mut reopened = ConfigDir::open(root.clone());
        let before = std::fs::read_link(root.join(DATA)).expect("..data");
        assert!(!reopened.update(second.clone()).expect("update"));
        assert_eq!(std::fs::read_link(root.join(DATA)).expect("..data"), before);
        assert!(reopened.update(first).expect("update"));
        assert_ne!(std::fs::read_link(root.join(DATA)).expect("..data"), before);
        let _ = std::fs::remove_dir_all(&root);
    }
}
