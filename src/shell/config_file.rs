//! Loads the configuration file from disk (and the key files it names, refusing those others can read).
//! A gzip-compressed configuration is read too: a path ending in `.gz`, or `PATH.gz` when `PATH`
//! does not exist (the proxy-group sidecar stores `tunnelgate.toml.gz` in the config Secret
//! instead of `tunnelgate.toml` when the plain text would not fit the API server's 1 MiB limit).

use crate::config::{Config, ConfigErrors, SecretFiles};
use std::io::Read as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub struct FsSecrets;

impl SecretFiles for FsSecrets {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        read_key_file(path, 0o077, "0600 or 0400 (chmod 600")
    }

    fn read_secret_readable_by_group(&self, path: &Path) -> Result<String, String> {
        read_key_file(path, 0o037, "0640, 0600, 0440 or 0400 (chmod 640")
    }
}

/// Reads a key file whose mode has none of the bits of `refused`.
fn read_key_file(path: &Path, refused: u32, expected: &str) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & refused != 0 {
        let who = if refused & 0o040 == 0 {
            "writable by group, or readable by others"
        } else {
            "readable by group or others"
        };
        return Err(format!(
            "is {who} (mode {mode:04o}): expected mode {expected} {})",
            path.display()
        ));
    }
    let bytes = read_bounded(path, MAX_KEY_FILE_BYTES).map_err(|e| format!("cannot read: {e}"))?;
    String::from_utf8(bytes).map_err(|_| "is not UTF-8: expected a base64 WireGuard key".into())
}

/// A key file larger than this is refused unread: a key is 44 characters and a newline.
const MAX_KEY_FILE_BYTES: u64 = 4096;

/// The first `max` bytes of `path`, or an error when it holds more: `--config /dev/zero`, or
/// a key file that is a multi-gigabyte mistake, must not take the memory of the node.
fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, std::io::Error> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max} bytes"),
        ));
    }
    Ok(bytes)
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read configuration {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {errors}")]
    Invalid { path: PathBuf, errors: ConfigErrors },
}

/// Everything worth a warning about the configuration at `path` (already loaded as `config`):
/// [`Config::warnings`] and secrets inline in a file others can read (the `.gz` form too: its
/// mode is that of the file read). Never fatal.
pub fn warnings(path: &Path, config: &Config) -> Vec<String> {
    let mut out = config.warnings();
    out.extend(crate::config::ingress_warnings(config, &host_addresses()));
    let meta = std::fs::metadata(path).or_else(|e| match gz_twin(path) {
        Some(gz) if e.kind() == std::io::ErrorKind::NotFound => std::fs::metadata(gz),
        _ => Err(e),
    });
    if let (Ok(meta), Ok(text)) = (meta, read_config_text(path)) {
        let mode = meta.permissions().mode();
        out.extend(crate::config::inline_secret_warning(&text, mode));
    }
    out
}

/// A configuration (plain, compressed or decompressed) larger than this is refused: a rendered
/// proxy group of 20,000 Services is about 2 MiB, so this leaves room and still stops a
/// decompression bomb or `--config /dev/zero`. The sidecar's hand-over to its proxy container
/// uses the same bound.
pub const MAX_DECOMPRESSED_BYTES: u64 = 64 << 20;

/// `path.gz`, the name read when `path` itself does not exist (none for a `.gz` path).
fn gz_twin(path: &Path) -> Option<PathBuf> {
    if path.extension().is_some_and(|e| e == "gz") {
        return None;
    }
    let mut gz = path.as_os_str().to_os_string();
    gz.push(".gz");
    Some(PathBuf::from(gz))
}

/// The configuration text at `path`: the file itself, gunzipped when its name ends in `.gz`;
/// when `path` does not exist, `path.gz` gunzipped.
pub fn read_config_text(path: &Path) -> Result<String, std::io::Error> {
    let is_gz = path.extension().is_some_and(|e| e == "gz");
    match read_bounded(path, MAX_DECOMPRESSED_BYTES) {
        Ok(bytes) if is_gz => gunzip(&bytes),
        Ok(bytes) => String::from_utf8(bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !is_gz => {
            match gz_twin(path).map(|gz| read_bounded(&gz, MAX_DECOMPRESSED_BYTES)) {
                Some(Ok(bytes)) => gunzip(&bytes),
                // The plain name's error: that is the file the user named.
                _ => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

fn gunzip(bytes: &[u8]) -> Result<String, std::io::Error> {
    let invalid = |problem: String| std::io::Error::new(std::io::ErrorKind::InvalidData, problem);
    let text = gunzip_bounded(bytes, MAX_DECOMPRESSED_BYTES).map_err(invalid)?;
    String::from_utf8(text).map_err(|e| {
        invalid(format!(
            "decompresses to text that is not UTF-8 (at byte {}): expected a tunnelgate \
             configuration",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Every gzip member of `bytes`, decompressed and joined (as `gzip -d` reads `cat a.gz b.gz`),
/// never more than `limit` bytes. Refused: no gzip at all, a corrupt or cut member, and
/// anything after the last member that is not another member (the file was cut or added to).
pub fn gunzip_bounded(bytes: &[u8], limit: u64) -> Result<Vec<u8>, String> {
    const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
    if bytes.is_empty() {
        return Err("not a gzip-compressed configuration: the file is empty".into());
    }
    let mut out = Vec::new();
    let mut rest = bytes;
    for member in 1.. {
        let at = bytes.len() - rest.len();
        let mut decoder = flate2::bufread::GzDecoder::new(rest);
        let room = limit.saturating_add(1).saturating_sub(out.len() as u64);
        let read = (&mut decoder).take(room).read_to_end(&mut out);
        if out.len() as u64 > limit {
            return Err(format!(
                "decompresses to more than {limit} bytes: expected a tunnelgate configuration"
            ));
        }
        if let Err(e) = read {
            return Err(if member == 1 {
                format!("not a gzip-compressed configuration: {e}")
            } else {
                format!("gzip member {member} (at byte {at}) is corrupt: {e}")
            });
        }
        rest = decoder.into_inner();
        if rest.is_empty() {
            break;
        }
        if !rest.starts_with(&GZIP_MAGIC) {
            return Err(format!(
                "{} bytes of trailing data after gzip member {member} (at byte {}): expected \
                 nothing but gzip members (a cut or appended file?)",
                rest.len(),
                bytes.len() - rest.len()
            ));
        }
    }
    Ok(out)
}

/// What a configuration was read from: a digest of its text and of each key file it read, so
/// that the 2-second poll can tell an unchanged file without parsing it again (at 100,000
/// peers a parse is a second of CPU and a hundred megabytes of heap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    text: u128,
    /// Each key file read, whether its group may read it, and what it held (0: unreadable).
    secrets: Vec<(PathBuf, bool, u128)>,
}

/// A 128-bit digest (two keyed SipHashes): a changed file is told from an unchanged one.
fn digest(bytes: &[u8]) -> u128 {
    use std::hash::{Hash, Hasher};
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut h);
        bytes.hash(&mut h);
        h.finish()
    };
    (u128::from(half(0x7467_636f_6e66_6967)) << 64) | u128::from(half(0x6b65_7966_696c_6573))
}

/// The key files' reader that notes what it read.
struct Noting {
    read: std::cell::RefCell<Vec<(PathBuf, bool, u128)>>,
}

/// A key file as [`FsSecrets`] reads it (`group`: readable by its group too), as a digest.
fn secret_digest(path: &Path, group: bool) -> u128 {
    let got = if group {
        FsSecrets.read_secret_readable_by_group(path)
    } else {
        FsSecrets.read_secret(path)
    };
    got.map_or(0, |text| digest(text.as_bytes()))
}

impl Noting {
    fn note(&self, path: &Path, group: bool) -> Result<String, String> {
        let got = if group {
            FsSecrets.read_secret_readable_by_group(path)
        } else {
            FsSecrets.read_secret(path)
        };
        let seen = got.as_ref().map_or(0, |text| digest(text.as_bytes()));
        self.read
            .borrow_mut()
            .push((path.to_path_buf(), group, seen));
        got
    }
}

impl SecretFiles for Noting {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.note(path, false)
    }

    fn read_secret_readable_by_group(&self, path: &Path) -> Result<String, String> {
        self.note(path, true)
    }
}

/// Whether the configuration at `path` and every key file it names read the same as when
/// `seen` was taken (a file that cannot be read is not the same).
pub fn unchanged(path: &Path, seen: &Fingerprint) -> bool {
    let Ok(text) = read_config_text(path) else {
        return false;
    };
    digest(text.as_bytes()) == seen.text
        && (seen.secrets.iter())
            // Mode and content both count: a key file made readable by others is refused.
            .all(|(file, group, was)| secret_digest(file, *group) == *was)
}

/// Reads and validates the configuration at `path` (or `path.gz`, see [`read_config_text`]).
/// Its [`Fingerprint`] is kept for [`take_loaded`]: the configuration `tunnelgate run` starts
/// from is loaded here, and the daemon's first poll then parses nothing if the file is the same.
pub fn load_config(path: &Path) -> Result<Config, LoadError> {
    let (config, seen) = load_config_noted(path)?;
    *LOADED.lock() = Some((path.to_path_buf(), seen));
    Ok(config)
}

/// The fingerprint of the last [`load_config`], and of which path.
static LOADED: parking_lot::Mutex<Option<(PathBuf, Fingerprint)>> = parking_lot::Mutex::new(None);

/// The fingerprint of what the last [`load_config`] of `path` read (taken: once).
pub fn take_loaded(path: &Path) -> Option<Fingerprint> {
    let mut loaded = LOADED.lock();
    match loaded.take() {
        Some((p, seen)) if p == path => Some(seen),
        other => {
            *loaded = other;
            None
        }
    }
}

/// [`load_config`], with the [`Fingerprint`] of what it read.
pub fn load_config_noted(path: &Path) -> Result<(Config, Fingerprint), LoadError> {
    let text = read_config_text(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if crate::config::wgquick::looks_like_wg_quick(&text) {
        return Err(LoadError::Invalid {
            path: path.to_path_buf(),
            errors: ConfigErrors(vec![crate::config::wgquick::not_toml_error(
                &path.display().to_string(),
            )]),
        });
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let noting = Noting {
        read: Default::default(),
    };
    let config = Config::parse(&text, base, &noting).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })?;
    let fingerprint = Fingerprint {
        text: digest(text.as_bytes()),
        secrets: noting.read.into_inner(),
    };
    Ok((config, fingerprint))
}

/// The addresses of this host's interfaces (empty when they cannot be listed).
fn host_addresses() -> std::collections::BTreeSet<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Default::default();
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| std::net::IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_or_huge_config_or_key_file_is_refused_unread() {
        let err = read_config_text(Path::new("/dev/zero")).expect_err("endless");
        assert!(
            err.to_string().contains("larger than 67108864 bytes"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("tg-ts-bounded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        // Sparse: 8 GiB on paper, nothing on disk.
        let huge = dir.join("tunnelgate.toml");
        std::fs::File::create(&huge)
            .and_then(|f| f.set_len(8 << 30))
            .expect("sparse file");
        let err = load_config(&huge).expect_err("huge");
        assert!(err.to_string().contains("larger than"), "{err}");
        let key = dir.join("private.key");
        std::fs::File::create(&key)
            .and_then(|f| f.set_len(1 << 20))
            .expect("sparse key");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let err = FsSecrets.read_secret(&key).expect_err("huge key file");
        assert!(err.contains("larger than 4096 bytes"), "{err}");
        std::fs::write(&key, b"\xff\xfe\n").expect("write");
        let err = FsSecrets.read_secret(&key).expect_err("not UTF-8");
        assert!(err.contains("not UTF-8"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_plain_config_is_read_from_its_gz_twin_and_a_gz_path_directly() {
        let dir = std::env::temp_dir().join(format!("tg-config-gz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let text = "[interface]\nname = \"tg0\"\n";
        let gz = dir.join("tunnelgate.toml.gz");
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut encoder, text.as_bytes()).expect("gzip");
        std::fs::write(&gz, encoder.finish().expect("gzip")).expect("write");
        assert_eq!(
            read_config_text(&dir.join("tunnelgate.toml")).expect("via .gz"),
            text
        );
        assert_eq!(read_config_text(&gz).expect("named .gz"), text);
        // The plain file wins when both exist.
        std::fs::write(dir.join("tunnelgate.toml"), "plain").expect("write");
        assert_eq!(
            read_config_text(&dir.join("tunnelgate.toml")).expect("plain"),
            "plain"
        );
        // A missing file is reported under the name the user gave.
        let missing = read_config_text(&dir.join("other.toml")).expect_err("missing");
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        // A .gz that is not gzip says so.
        std::fs::write(&gz, "not gzip").expect("write");
        let bad = read_config_text(&gz).expect_err("not gzip");
        assert!(bad.to_string().contains("not a gzip-compressed"), "{bad}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn gzip(text: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut encoder, text).expect("gzip");
        encoder.finish().expect("gzip")
    }

    #[test]
    fn every_gzip_member_is_read_and_trailing_bytes_are_refused() {
        let (a, b) = (&b"[interface]\nname = \"tg0\"\n"[..], &b"[[peer]]\n"[..]);
        // `cat a.gz b.gz`: gzip -d reads both, so does the daemon.
        let two = [gzip(a), gzip(b)].concat();
        assert_eq!(
            gunzip_bounded(&two, MAX_DECOMPRESSED_BYTES).expect("two members"),
            [a, b].concat()
        );
        for (garbage, what) in [
            (&b"x"[..], "1 bytes of trailing data after gzip member 2"),
            (&b"\0\0\0\0"[..], "4 bytes of trailing data"),
        ] {
            let err = gunzip_bounded(&[&two[..], garbage].concat(), MAX_DECOMPRESSED_BYTES)
                .expect_err("trailing garbage");
            assert!(err.contains(what), "{err}");
        }
        // A second member cut short is refused, not read as far as it goes.
        let cut = &two[..two.len() - 3];
        let err = gunzip_bounded(cut, MAX_DECOMPRESSED_BYTES).expect_err("cut");
        assert!(err.contains("gzip member 2"), "{err}");
        assert!(gunzip_bounded(b"", MAX_DECOMPRESSED_BYTES).is_err());
    }

    #[test]
    fn the_size_limit_counts_bytes_of_multi_byte_text() {
        // 3-byte characters: the limit falls inside one, which must not turn the refusal
        // into a UTF-8 error (or let it through).
        let text = "€".repeat(400);
        let gz = gzip(text.as_bytes());
        let err = gunzip_bounded(&gz, 1000).expect_err("1200 bytes");
        assert!(err.contains("more than 1000 bytes"), "{err}");
        assert_eq!(gunzip_bounded(&gz, 1200).expect("fits"), text.as_bytes());
        // Across members the bound is the sum.
        let two = [gzip(&[b'a'; 600]), gzip(&[b'b'; 600])].concat();
        assert!(gunzip_bounded(&two, 1000).is_err());
        let dir = std::env::temp_dir().join(format!("tg-config-gz-mb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("c.toml.gz");
        std::fs::write(&path, gzip(&[0xe2, 0x82])).expect("write");
        let err = read_config_text(&path).expect_err("not UTF-8");
        assert!(err.to_string().contains("not UTF-8"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_inline_secret_in_a_readable_gz_is_a_warning_too() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("tg-config-gz-warn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let text = format!(
            "[interface]\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
            crate::config::SecretKey([7; 32]).expose_base64()
        );
        let gz = dir.join("tunnelgate.toml.gz");
        std::fs::write(&gz, gzip(text.as_bytes())).expect("write");
        std::fs::set_permissions(&gz, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        // Named as the .gz, and found as the twin of the plain name.
        for path in [gz.clone(), dir.join("tunnelgate.toml")] {
            let config = load_config(&path).expect("valid");
            let found = warnings(&path, &config);
            assert!(
                found.iter().any(
                    |w| w.contains("interface.private_key: a secret written inline")
                        && w.contains("0644")
                ),
                "{}: {found:?}",
                path.display()
            );
        }
        std::fs::set_permissions(&gz, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let config = load_config(&gz).expect("valid");
        assert!(!warnings(&gz, &config).iter().any(|w| w.contains("inline")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The poll's shortcut: the same file and key file read the same fingerprint; a changed
    /// text, a changed key or a key made readable by others does not.
    #[test]
    fn a_fingerprint_tells_a_changed_file_or_key_file_from_an_unchanged_one() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("tg-config-seen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let key = dir.join("private.key");
        let write_key = |b: u8| {
            std::fs::write(
                &key,
                format!("{}\n", crate::config::SecretKey([b; 32]).expose_base64()),
            )
            .expect("key");
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        };
        write_key(3);
        let config = dir.join("tunnelgate.toml");
        let text =
            "[interface]\nprivate_key_file = \"private.key\"\naddresses = [\"100.64.0.1/32\"]\n";
        std::fs::write(&config, text).expect("config");
        let (_, seen) = load_config_noted(&config).expect("valid");
        assert!(unchanged(&config, &seen), "nothing changed");
        write_key(4);
        assert!(!unchanged(&config, &seen), "a new key");
        write_key(3);
        assert!(unchanged(&config, &seen), "the key back as it was");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(
            !unchanged(&config, &seen),
            "a key others may read is refused now"
        );
        write_key(3);
        std::fs::write(&config, format!("{text}mtu = 1400\n")).expect("config");
        assert!(!unchanged(&config, &seen), "a new text");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_file_its_group_reads_is_refused_unless_the_config_allows_group_read() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("tg-config-keymode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let key = dir.join("private.key");
        std::fs::write(
            &key,
            format!("{}\n", crate::config::SecretKey([3; 32]).expose_base64()),
        )
        .expect("key");
        let config = dir.join("tunnelgate.toml");
        let write = |extra: &str| {
            let text = format!(
                "[interface]\nprivate_key_file = \"private.key\"\naddresses = [\"100.64.0.1/32\"]\n{extra}"
            );
            std::fs::write(&config, text).expect("config");
        };
        let chmod = |mode: u32| {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).expect("chmod")
        };
        let refusal = |e: LoadError| e.to_string();

        write("");
        chmod(0o440);
        let err = refusal(load_config(&config).expect_err("group-readable key, no opt-in"));
        assert!(
            err.contains("interface.private_key_file")
                && err.contains("readable by group or others (mode 0440)"),
            "{err}"
        );
        chmod(0o600);
        load_config(&config).expect("owner-only key");

        write("key_files_readable_by_group = true\n");
        for mode in [0o440, 0o640, 0o400, 0o600] {
            chmod(mode);
            load_config(&config).unwrap_or_else(|e| panic!("mode {mode:o}: {e}"));
        }
        // Never readable by others, never writable by the group.
        for (mode, shown) in [(0o444, "0444"), (0o660, "0660"), (0o604, "0604")] {
            chmod(mode);
            let err = refusal(load_config(&config).expect_err("refused"));
            assert!(
                err.contains(&format!(
                    "writable by group, or readable by others (mode {shown})"
                )),
                "{err}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
