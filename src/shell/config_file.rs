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
/// [`Config::warnings`] and secrets inline in a file others can read. Never fatal.
pub fn warnings(path: &Path, config: &Config) -> Vec<String> {
    let mut out = config.warnings();
    if let (Ok(meta), Ok(text)) = (std::fs::metadata(path), std::fs::read_to_string(path)) {
        let mode = meta.permissions().mode();
        out.extend(crate::config::inline_secret_warning(&text, mode));
    }
    out
}

/// A configuration (plain, compressed or decompressed) larger than this is refused: a rendered
/// proxy group of 20,000 Services is about 2 MiB, so this leaves room and still stops a
/// decompression bomb or `--config /dev/zero`.
const MAX_DECOMPRESSED_BYTES: u64 = 64 << 20;

/// The configuration text at `path`: the file itself, gunzipped when its name ends in `.gz`;
/// when `path` does not exist, `path.gz` gunzipped.
pub fn read_config_text(path: &Path) -> Result<String, std::io::Error> {
    let is_gz = path.extension().is_some_and(|e| e == "gz");
    match read_bounded(path, MAX_DECOMPRESSED_BYTES) {
        Ok(bytes) if is_gz => gunzip(&bytes),
        Ok(bytes) => String::from_utf8(bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !is_gz => {
            let mut gz = path.as_os_str().to_os_string();
            gz.push(".gz");
            match read_bounded(Path::new(&gz), MAX_DECOMPRESSED_BYTES) {
                Ok(bytes) => gunzip(&bytes),
                // The plain name's error: that is the file the user named.
                Err(_) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

fn gunzip(bytes: &[u8]) -> Result<String, std::io::Error> {
    let mut text = String::new();
    let read = flate2::read::GzDecoder::new(bytes)
        .take(MAX_DECOMPRESSED_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("not a gzip-compressed UTF-8 configuration: {e}"),
            )
        })?;
    if read as u64 > MAX_DECOMPRESSED_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes: expected a tunnelgate configuration"),
        ));
    }
    Ok(text)
}

/// Reads and validates the configuration at `path` (or `path.gz`, see [`read_config_text`]).
pub fn load_config(path: &Path) -> Result<Config, LoadError> {
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
    Config::parse(&text, base, &FsSecrets).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })
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
