//! Loads the configuration file from disk (and the key files it names, refusing those others can read).

use crate::config::{Config, ConfigErrors, SecretFiles};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub struct FsSecrets;

impl SecretFiles for FsSecrets {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "is readable by group or others (mode {mode:04o}): expected mode 0600 or 0400 (chmod 600 {})",
                path.display()
            ));
        }
        std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))
    }
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

/// Reads and validates the configuration at `path`.
pub fn load_config(path: &Path) -> Result<Config, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
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
