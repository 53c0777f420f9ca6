//! `tunnelgate import wg-quick`: reads the wg-quick file, has `config::wgquick` map it, writes
//! the key files it names (mode 0600) and prints the TOML. Nothing is written unless the whole
//! file imports, and every key file is written completely or not at all.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::config::wgquick::{import, interface_name_from_stem, parse_ini, KeyFiles};
use crate::config::SecretKey;

/// The default key file: FILE with the extension `.key` (`wg0.conf` -> `wg0.key`), or FILE
/// with `.key` appended when that would be FILE itself.
pub fn default_key_file(file: &Path) -> PathBuf {
    let swapped = file.with_extension("key");
    if swapped == file {
        let mut appended = file.as_os_str().to_owned();
        appended.push(".key");
        PathBuf::from(appended)
    } else {
        swapped
    }
}

/// The preshared key file of peer `index`, beside the private key file:
/// `/etc/wireguard/wg0.key` -> `/etc/wireguard/wg0.peer0.psk`.
pub fn preshared_key_file(key_file: &Path, index: usize) -> PathBuf {
    let stem = key_file
        .file_stem()
        .map_or_else(|| "key".into(), |s| s.to_string_lossy().into_owned());
    key_file.with_file_name(format!("{stem}.peer{index}.psk"))
}

/// Runs the import; the exit status is the command's (0, 1 on a write failure, 2 on a file
/// that is not a wg-quick config or holds a bad value).
pub fn wg_quick(file: &Path, key_file: Option<&Path>) -> ExitCode {
    let what = format!("tunnelgate import wg-quick: {}", file.display());
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{what}: cannot read: {e}");
            return ExitCode::from(2);
        }
    };
    let ini = match parse_ini(&text) {
        Ok(ini) => ini,
        Err(e) => {
            eprintln!("{what}: not a wg-quick config: {e}");
            return ExitCode::from(2);
        }
    };
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some(name) = interface_name_from_stem(&stem) else {
        eprintln!(
            "{what}: wg-quick names the interface after the file, and {stem:?} is not an \
             interface name: expected 1-15 of a-z A-Z 0-9 _ = + . - (rename it, e.g. wg0.conf)"
        );
        return ExitCode::from(2);
    };
    let key_file = key_file.map_or_else(|| default_key_file(file), Path::to_path_buf);
    // The TOML goes to stdout, wherever the user saves it: name the keys by absolute path.
    let key_file = match std::path::absolute(&key_file) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{what}: --key-file {}: {e}", key_file.display());
            return ExitCode::from(2);
        }
    };
    if key_file == std::path::absolute(file).unwrap_or_default() {
        eprintln!("{what}: --key-file is the file being imported: expected another path");
        return ExitCode::from(2);
    }
    let key_text = key_file.display().to_string();
    let psk_name = |i: usize| preshared_key_file(&key_file, i).display().to_string();
    let imported = match import(
        &ini,
        &name,
        &file.display().to_string(),
        &KeyFiles {
            private_key: &key_text,
            preshared_key: &psk_name,
        },
    ) {
        Ok(i) => i,
        Err(errors) => {
            for e in errors {
                eprintln!("{what}: {e}");
            }
            return ExitCode::from(2);
        }
    };
    let mut secrets: Vec<(PathBuf, &SecretKey)> = vec![(key_file.clone(), &imported.private_key)];
    for (i, psk) in &imported.preshared_keys {
        secrets.push((preshared_key_file(&key_file, *i), psk));
    }
    if let Err(e) = write_secrets(&secrets) {
        eprintln!("{what}: {e}; nothing was written");
        return ExitCode::from(1);
    }
    for u in &imported.unmapped {
        eprintln!("{what}: {u}");
    }
    for n in &imported.notes {
        eprintln!("{what}: note: {n}");
    }
    for (path, _) in &secrets {
        eprintln!("{what}: wrote {} (mode 0600)", path.display());
    }
    let mut stdout = std::io::stdout().lock();
    if stdout.write_all(imported.toml.as_bytes()).is_err() || stdout.flush().is_err() {
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// Writes every secret as base64 plus a newline to its path, mode 0600: first each to a new
/// temporary file beside it, then renames them all, so a failure leaves no partial key.
fn write_secrets(secrets: &[(PathBuf, &SecretKey)]) -> Result<(), String> {
    let mut temps: Vec<(PathBuf, &Path)> = Vec::new();
    let cleanup = |temps: &[(PathBuf, &Path)]| {
        for (t, _) in temps {
            let _ = std::fs::remove_file(t);
        }
    };
    for (path, key) in secrets {
        let mut temp_name = path.as_os_str().to_owned();
        temp_name.push(format!(".tmp{}", std::process::id()));
        let temp = PathBuf::from(temp_name);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .and_then(|mut f| {
                f.write_all(format!("{}\n", key.expose_base64()).as_bytes())?;
                f.sync_all()
            });
        if let Err(e) = written {
            cleanup(&temps);
            let _ = std::fs::remove_file(&temp);
            return Err(format!("cannot write {}: {e}", path.display()));
        }
        temps.push((temp, path));
    }
    for (temp, path) in &temps {
        if let Err(e) = std::fs::rename(temp, path) {
            cleanup(&temps);
            return Err(format!("cannot write {}: {e}", path.display()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_names() {
        assert_eq!(
            default_key_file(Path::new("/etc/wireguard/wg0.conf")),
            PathBuf::from("/etc/wireguard/wg0.key")
        );
        assert_eq!(default_key_file(Path::new("wg0")), PathBuf::from("wg0.key"));
        assert_eq!(
            default_key_file(Path::new("/x/wg0.key")),
            PathBuf::from("/x/wg0.key.key")
        );
        assert_eq!(
            preshared_key_file(Path::new("/etc/wireguard/wg0.key"), 2),
            PathBuf::from("/etc/wireguard/wg0.peer2.psk")
        );
    }
}
