//! `tunnelgate import wg-quick`: reads the wg-quick file (bounded), has `config::wgquick` map and
//! validate it, writes the key files it names (mode 0600) and prints the TOML. Nothing is
//! written unless the whole file imports; the key files are written all or none (temporaries
//! beside them, renamed at the end, removed on any failure); an existing file is replaced only
//! with `--force`, and never the input or one output with another.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::config::wgquick::{
    escape_controls, excerpt, import, interface_name_from_stem, parse_ini, KeyFiles,
};
use crate::config::SecretKey;

/// A wg-quick file larger than this is refused unread: a real one is a few KiB even with
/// hundreds of peers, and reading a 2 GiB file whole would cost gigabytes of memory.
pub const MAX_INPUT_BYTES: u64 = 1 << 20;

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

/// Runs the import; the exit status is the command's (0; 1 when a key file exists and
/// `force` is off, or a write fails; 2 on a file that is not a wg-quick config, holds a bad
/// value, or names an output that is the input or another output).
pub fn wg_quick(file: &Path, key_file: Option<&Path>, force: bool) -> ExitCode {
    let what = format!(
        "tunnelgate import wg-quick: {}",
        escape_controls(&file.display().to_string())
    );
    let text = match read_bounded(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{what}: {e}");
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
            "{what}: wg-quick names the interface after the file, and {} is not an \
             interface name: expected 1-15 of a-z A-Z 0-9 _ = + . - (rename it, e.g. wg0.conf)",
            excerpt(&stem)
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
    // The TOML names the file by this text: it must be the path written, byte for byte.
    let Some(key_text) = key_file.to_str().map(str::to_string) else {
        eprintln!(
            "{what}: --key-file {}: not UTF-8: expected a path the TOML can name",
            escape_controls(&key_file.display().to_string())
        );
        return ExitCode::from(2);
    };
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
            eprintln!("{what}: nothing was written");
            return ExitCode::from(2);
        }
    };
    let mut secrets: Vec<(PathBuf, &SecretKey)> = vec![(key_file.clone(), &imported.private_key)];
    for (i, psk) in &imported.preshared_keys {
        secrets.push((preshared_key_file(&key_file, *i), psk));
    }
    let outputs: Vec<&Path> = secrets.iter().map(|(p, _)| p.as_path()).collect();
    if let Some(clash) = clashing_output(file, &outputs) {
        eprintln!("{what}: {clash}: expected another --key-file; nothing was written");
        return ExitCode::from(2);
    }
    if !force {
        let existing: Vec<String> = outputs
            .iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .map(|p| escape_controls(&p.display().to_string()))
            .collect();
        if !existing.is_empty() {
            eprintln!(
                "{what}: {} already exists: not replaced, nothing was written (another \
                 --key-file, or --force to replace it)",
                existing.join(", ")
            );
            return ExitCode::from(1);
        }
    }
    let replaced = match write_secrets(&secrets, force) {
        Ok(replaced) => replaced,
        Err(e) => {
            eprintln!("{what}: {e}");
            return ExitCode::from(1);
        }
    };
    for u in &imported.unmapped {
        eprintln!("{what}: {u}");
    }
    for n in &imported.notes {
        eprintln!("{what}: note: {n}");
    }
    for (path, _) in &secrets {
        let verb = if replaced.contains(path) {
            "replaced"
        } else {
            "wrote"
        };
        eprintln!("{what}: {verb} {} (mode 0600)", path.display());
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(imported.toml.as_bytes())
        .and_then(|()| stdout.flush())
    {
        eprintln!(
            "{what}: the key files were written, but the TOML could not be printed: {e} \
             (run the import again with --force)"
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// The text of `file`, read no further than [`MAX_INPUT_BYTES`] (plus one byte, to tell).
fn read_bounded(file: &Path) -> Result<String, String> {
    let mut bytes = Vec::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(MAX_INPUT_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        return Err(format!(
            "is larger than {MAX_INPUT_BYTES} bytes: expected a wg-quick config (a few KiB)"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "is not UTF-8 text (byte {}): expected a wg-quick config",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Where `path` leads: the file it names with every symlink and `..` resolved, or (when it
/// does not exist yet) its resolved folder and its name.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = std::fs::canonicalize(path) {
        return real;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// Why one of `outputs` may not be written: it is `input` (however spelt: `..`, symlinks) or
/// another output.
fn clashing_output(input: &Path, outputs: &[&Path]) -> Option<String> {
    let input_real = resolved(input);
    let reals: Vec<PathBuf> = outputs.iter().map(|p| resolved(p)).collect();
    for (i, (out, real)) in outputs.iter().zip(&reals).enumerate() {
        let shown = escape_controls(&out.display().to_string());
        if *real == input_real {
            return Some(format!("{shown} is the file being imported"));
        }
        if let Some(j) = reals[..i].iter().position(|r| r == real) {
            return Some(format!(
                "{shown} is the same file as {}",
                escape_controls(&outputs[j].display().to_string())
            ));
        }
    }
    None
}

/// A temporary file beside `path`, hidden, named after it and this process.
fn temporary_beside(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "key".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{what}{}", std::process::id()))
}

/// Writes every secret as base64 plus a newline to its path, mode 0600, all or none: first
/// each to a new temporary file beside it, then each put in place (without `force` by a hard
/// link, which fails on an existing file instead of replacing it; with `force` by a rename, a
/// copy of the old file kept until every secret is in place). On a failure every file put in
/// place is taken back (the old ones restored) and every temporary removed; the error says
/// what, if anything, stayed changed. Ok: the paths that replaced an existing file.
fn write_secrets(secrets: &[(PathBuf, &SecretKey)], force: bool) -> Result<Vec<PathBuf>, String> {
    let mut temps: Vec<PathBuf> = Vec::new();
    // (path, its old file's copy, if it had one)
    let mut backups: Vec<(&Path, Option<PathBuf>)> = Vec::new();
    let remove_all = |files: &[PathBuf]| {
        for f in files {
            let _ = std::fs::remove_file(f);
        }
    };
    let shown = |p: &Path| escape_controls(&p.display().to_string());
    for (path, key) in secrets {
        let temp = temporary_beside(path, "tg-import");
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
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                let _ = std::fs::remove_file(&temp);
            }
            remove_all(&temps);
            return Err(format!(
                "cannot write {}: {e}; nothing was written",
                shown(path)
            ));
        }
        temps.push(temp);
    }
    if force {
        for (path, _) in secrets {
            if std::fs::symlink_metadata(path).is_err() {
                backups.push((path, None));
                continue;
            }
            let backup = temporary_beside(path, "tg-import-old");
            if let Err(e) = std::fs::hard_link(path, &backup) {
                remove_all(&temps);
                let kept: Vec<PathBuf> = backups.iter().filter_map(|(_, b)| b.clone()).collect();
                remove_all(&kept);
                return Err(format!(
                    "cannot keep a copy of {} while it is replaced: {e}; nothing was written",
                    shown(path)
                ));
            }
            backups.push((path, Some(backup)));
        }
    }
    let mut placed: Vec<usize> = Vec::new();
    for (i, ((path, _), temp)) in secrets.iter().zip(&temps).enumerate() {
        let put = if force {
            std::fs::rename(temp, path)
        } else {
            std::fs::hard_link(temp, path)
        };
        if let Err(e) = put {
            let mut left = Vec::new();
            for &j in &placed {
                let path = &secrets[j].0;
                let undone = match backups.get(j).and_then(|(_, b)| b.as_ref()) {
                    Some(old) => std::fs::rename(old, path),
                    None => std::fs::remove_file(path),
                };
                if let Err(e) = undone {
                    left.push(format!("{} ({e})", shown(path)));
                }
            }
            remove_all(&temps);
            let kept: Vec<PathBuf> = backups.iter().filter_map(|(_, b)| b.clone()).collect();
            remove_all(&kept);
            let outcome = if left.is_empty() {
                "nothing was written".to_string()
            } else {
                format!("could not take back: {}", left.join(", "))
            };
            return Err(format!("cannot write {}: {e}; {outcome}", shown(path)));
        }
        placed.push(i);
    }
    // Without force each temporary is a second name of a placed file; with force, gone already.
    remove_all(&temps);
    let mut replaced = Vec::new();
    for (path, backup) in backups {
        if let Some(old) = backup {
            let _ = std::fs::remove_file(old);
            replaced.push(path.to_path_buf());
        }
    }
    Ok(replaced)
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

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tg-import-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn an_output_that_resolves_to_the_input_or_another_output_is_found() {
        let dir = temp_dir("clash");
        let sub = dir.join("sub");
        std::fs::create_dir_all(&sub).expect("sub");
        let input = dir.join("wg0.conf");
        std::fs::write(&input, "[Interface]\n").expect("input");
        std::os::unix::fs::symlink(&input, dir.join("link.key")).expect("symlink");
        let dotdot = sub.join("../wg0.conf");
        let clash = clashing_output(&input, &[&dotdot]).expect("`..` leads to the input");
        assert!(clash.contains("is the file being imported"), "{clash}");
        let via_link = dir.join("link.key");
        assert!(clashing_output(&input, &[&via_link]).is_some());
        // Two spellings of one file that does not exist yet.
        let a = dir.join("new.key");
        let b = sub.join("../new.key");
        let clash = clashing_output(&input, &[&a, &b]).expect("one file twice");
        assert!(clash.contains("is the same file as"), "{clash}");
        assert_eq!(clashing_output(&input, &[&a, &sub.join("new.key")]), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failure_half_way_takes_back_what_was_put_in_place() {
        let dir = temp_dir("rollback");
        let (first, second) = (dir.join("wg0.key"), dir.join("wg0.peer0.psk"));
        // Created after the command looked: placing the second file fails, not replacing it.
        std::fs::write(&second, "someone else's\n").expect("write");
        let (k1, k2) = (SecretKey([1; 32]), SecretKey([2; 32]));
        let err = write_secrets(&[(first.clone(), &k1), (second.clone(), &k2)], false)
            .expect_err("the second exists");
        assert!(err.contains("nothing was written"), "{err}");
        assert_eq!(
            std::fs::read_to_string(&second).expect("kept"),
            "someone else's\n"
        );
        assert_eq!(
            names_in(&dir),
            ["wg0.peer0.psk"],
            "no key, no temporary left"
        );

        // With force, the old files are replaced and no copy or temporary stays behind.
        std::fs::write(&first, "old\n").expect("write");
        let replaced =
            write_secrets(&[(first.clone(), &k1), (second.clone(), &k2)], true).expect("force");
        assert_eq!(replaced, [first.clone(), second.clone()]);
        assert_eq!(
            std::fs::read_to_string(&first).expect("key").trim(),
            k1.expose_base64()
        );
        assert_eq!(names_in(&dir), ["wg0.key", "wg0.peer0.psk"]);

        // A file it cannot keep a copy of (a directory) is found before anything changes.
        std::fs::remove_file(&second).expect("rm");
        std::fs::create_dir(&second).expect("dir");
        let err = write_secrets(&[(first.clone(), &k2), (second.clone(), &k2)], true)
            .expect_err("a directory");
        assert!(err.contains("nothing was written"), "{err}");
        assert_eq!(
            std::fs::read_to_string(&first).expect("key").trim(),
            k1.expose_base64()
        );
        assert_eq!(names_in(&dir), ["wg0.key", "wg0.peer0.psk"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_input_past_the_limit_is_refused_without_reading_it_whole() {
        let dir = temp_dir("big");
        let big = dir.join("wg0.conf");
        let file = std::fs::File::create(&big).expect("create");
        // Sparse: 2 GiB on the disk's books, nothing written.
        file.set_len(2 << 30).expect("set_len");
        let err = read_bounded(&big).expect_err("too big");
        assert!(err.contains("larger than 1048576 bytes"), "{err}");
        file.set_len(MAX_INPUT_BYTES).expect("set_len");
        assert!(read_bounded(&big).is_ok(), "exactly the limit is read");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
