//! `scripts/install.sh`, the README's Install section: run into a `DESTDIR` with the binary this
//! test suite built (`--prebuilt`, so no release build is needed here), it puts `tunnelgate`
//! where the units look for it, the `tunnelgate-wg` link beside it, the units, the docs and
//! example configs, and a 0700 `/etc/tunnelgate`; `PREFIX` and `SYSCONFDIR` move the paths in
//! the units too; a second run keeps the keys an admin put in `/etc/tunnelgate`; `--uninstall`
//! with the same variables takes out every file it installed and keeps the keys and configs.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A directory holding the binary under test as `tunnelgate` (what `--prebuilt` takes): a
/// link, since a debug build is 250 MB and `install` copies what a link points to.
fn prebuilt(tmp: &TempDir) -> PathBuf {
    let dir = tmp.path().join("prebuilt");
    std::fs::create_dir_all(&dir).expect("prebuilt dir");
    std::os::unix::fs::symlink(tunnelgate_bin(), dir.join("tunnelgate")).expect("link the binary");
    dir
}

fn install(args: &[&str], env: &[(&str, &Path)]) -> CmdOutput {
    let mut cmd = Command::new(repo("scripts/install.sh"));
    cmd.args(args);
    for var in [
        "PREFIX",
        "BINDIR",
        "UNITDIR",
        "SYSCONFDIR",
        "DOCDIR",
        "DESTDIR",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    output_of(cmd, None)
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn install_sh_puts_binaries_link_units_and_a_private_config_dir_in_place() {
    let tmp = TempDir::new("tx-install");
    let bin_dir = prebuilt(&tmp);
    let root = tmp.path().join("root");
    let out = install(
        &["--prebuilt", &bin_dir.display().to_string()],
        &[("DESTDIR", &root)],
    );
    assert!(out.success(), "{out:?}");

    // The binary, where the units' ExecStart finds it.
    let tunnelgate = root.join("usr/local/bin/tunnelgate");
    assert_eq!(mode(&tunnelgate), 0o755);
    assert_eq!(
        std::fs::read(&tunnelgate).expect("installed binary"),
        std::fs::read(tunnelgate_bin()).expect("built binary"),
        "the binary installed is the one given"
    );
    let genkey = output_of(
        {
            let mut c = Command::new(&tunnelgate);
            c.arg("genkey");
            c
        },
        None,
    );
    assert!(genkey.success(), "{genkey:?}");
    assert_eq!(genkey.stdout.trim().len(), 44, "a base64 key: {genkey:?}");

    // The link, relative so it stays right wherever the tree is moved to.
    let link = root.join("usr/local/bin/tunnelgate-wg");
    assert_eq!(
        std::fs::read_link(&link).expect("tunnelgate-wg is a symlink"),
        Path::new("tunnelgate")
    );
    assert_eq!(
        std::fs::canonicalize(&link).expect("link resolves"),
        std::fs::canonicalize(&tunnelgate).expect("binary")
    );

    // The units, unchanged at the default paths.
    for unit in ["tunnelgate.service", "tunnelgate@.service"] {
        let installed = root.join("etc/systemd/system").join(unit);
        assert_eq!(mode(&installed), 0o644, "{unit}");
        assert_eq!(
            std::fs::read_to_string(&installed).expect("unit"),
            std::fs::read_to_string(repo(&format!("systemd/{unit}"))).expect("repo unit"),
            "{unit} installed as shipped"
        );
    }

    // Keys go here: root only.
    let etc = root.join("etc/tunnelgate");
    assert!(etc.is_dir());
    assert_eq!(mode(&etc), 0o700);

    // The docs the units' Documentation= names, and the example configs.
    for doc in [
        "README.md",
        "router.md",
        "config/minimal.toml",
        "config/subnet-router.toml",
    ] {
        let path = root.join("usr/share/doc/tunnelgate").join(doc);
        assert_eq!(mode(&path), 0o644, "{doc}");
    }
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/tunnelgate.service")).expect("unit");
    assert!(unit.contains("file:/usr/share/doc/tunnelgate/README.md"));

    // A second run (an upgrade) keeps what the admin put into /etc/tunnelgate.
    std::fs::write(etc.join("private.key"), "kept\n").expect("a key");
    let again = install(
        &["--prebuilt", &bin_dir.display().to_string()],
        &[("DESTDIR", &root)],
    );
    assert!(again.success(), "{again:?}");
    assert_eq!(
        std::fs::read_to_string(etc.join("private.key")).expect("key"),
        "kept\n"
    );
    assert_eq!(mode(&etc), 0o700);
}

#[test]
fn install_sh_follows_prefix_and_sysconfdir_in_the_units() {
    let tmp = TempDir::new("tx-install-prefix");
    let bin_dir = prebuilt(&tmp);
    let root = tmp.path().join("root");
    let out = install(
        &["--prebuilt", &bin_dir.display().to_string()],
        &[
            ("DESTDIR", &root),
            ("PREFIX", Path::new("/opt/tg")),
            ("SYSCONFDIR", Path::new("/srv/etc")),
            ("UNITDIR", Path::new("/lib/systemd/system")),
        ],
    );
    assert!(out.success(), "{out:?}");
    assert_eq!(mode(&root.join("opt/tg/bin/tunnelgate")), 0o755);
    assert!(root.join("opt/tg/bin/tunnelgate-wg").is_symlink());
    assert_eq!(mode(&root.join("srv/etc/tunnelgate")), 0o700);
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/tunnelgate@.service"))
        .expect("unit in UNITDIR");
    let exec: Vec<&str> = unit
        .lines()
        .filter(|l| l.starts_with("ExecStart=") || l.starts_with("ExecReload="))
        .collect();
    assert_eq!(
        exec,
        [
            "ExecStart=/opt/tg/bin/tunnelgate run --config /srv/etc/tunnelgate/%i.toml",
            "ExecReload=/opt/tg/bin/tunnelgate reload --config /srv/etc/tunnelgate/%i.toml",
        ]
    );
    assert!(!unit.contains("/usr/local/bin"), "{unit}");
}

/// `--prebuilt` and `DESTDIR` given relative to where it is called from (the script itself
/// works from the checkout).
#[test]
fn install_sh_takes_paths_relative_to_the_caller() {
    let tmp = TempDir::new("tx-install-relative");
    prebuilt(&tmp);
    let mut cmd = Command::new(repo("scripts/install.sh"));
    cmd.args(["--prebuilt", "prebuilt"])
        .env("DESTDIR", "root")
        .current_dir(tmp.path());
    for var in ["PREFIX", "BINDIR", "UNITDIR", "SYSCONFDIR", "DOCDIR"] {
        cmd.env_remove(var);
    }
    let out = output_of(cmd, None);
    assert!(out.success(), "{out:?}");
    assert_eq!(
        mode(&tmp.path().join("root/usr/local/bin/tunnelgate")),
        0o755
    );
    assert_eq!(mode(&tmp.path().join("root/etc/tunnelgate")), 0o700);
}

#[test]
fn install_sh_refuses_a_missing_binary_and_installs_nothing() {
    let tmp = TempDir::new("tx-install-missing");
    let bin_dir = prebuilt(&tmp);
    let root = tmp.path().join("root");
    // --sidecar wants tunnelgate-sidecar too, which is not there.
    let out = install(
        &["--sidecar", "--prebuilt", &bin_dir.display().to_string()],
        &[("DESTDIR", &root)],
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("tunnelgate-sidecar is missing"),
        "{out:?}"
    );
    assert!(!root.exists(), "nothing installed");
    let out = install(&["--no-such-flag"], &[("DESTDIR", &root)]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("--no-such-flag"), "{out:?}");
}

/// Every file and link under `root` (not directories), relative to it.
fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() && !path.is_symlink() {
                todo.push(path);
            } else {
                out.push(path.strip_prefix(root).expect("under root").to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// `--uninstall` with the same variables takes out every file the install put in place (the
/// sidecar too) and the docs folder, and keeps what the admin wrote: the key and config in
/// `/etc/tunnelgate` (named in its output) and a unit edited in place. A second `--uninstall`
/// finds nothing more to do.
#[test]
fn install_sh_uninstall_removes_what_it_installed_and_keeps_keys_and_configs() {
    let tmp = TempDir::new("tx-uninstall");
    let bin_dir = prebuilt(&tmp);
    std::os::unix::fs::symlink(tunnelgate_bin(), bin_dir.join("tunnelgate-sidecar"))
        .expect("a sidecar binary");
    let root = tmp.path().join("root");
    let vars = [
        ("DESTDIR", root.as_path()),
        ("PREFIX", Path::new("/opt/tg")),
        ("SYSCONFDIR", Path::new("/srv/etc")),
    ];
    let out = install(
        &["--sidecar", "--prebuilt", &bin_dir.display().to_string()],
        &vars,
    );
    assert!(out.success(), "{out:?}");
    assert!(
        out.stderr.contains("scripts/install.sh --uninstall"),
        "the way out is named: {out:?}"
    );
    let installed = files_under(&root);
    assert!(installed.len() >= 10, "{installed:#?}");
    assert!(installed.contains(&PathBuf::from("opt/tg/bin/tunnelgate-sidecar")));

    // The admin's: a key and a config, and a drop-in beside the unit.
    let etc = root.join("srv/etc/tunnelgate");
    std::fs::write(etc.join("private.key"), "key\n").expect("key");
    std::fs::write(etc.join("tunnelgate.toml"), "[interface]\n").expect("config");
    let dropin = root.join("etc/systemd/system/tunnelgate.service.d");
    std::fs::create_dir_all(&dropin).expect("drop-in dir");
    std::fs::write(dropin.join("override.conf"), "[Service]\n").expect("drop-in");

    let out = install(&["--uninstall"], &vars);
    assert!(out.success(), "{out:?}");
    let left = files_under(&root);
    assert_eq!(
        left,
        [
            PathBuf::from("etc/systemd/system/tunnelgate.service.d/override.conf"),
            PathBuf::from("srv/etc/tunnelgate/private.key"),
            PathBuf::from("srv/etc/tunnelgate/tunnelgate.toml"),
        ],
        "{out:?}"
    );
    assert_eq!(
        std::fs::read_to_string(etc.join("private.key")).expect("key"),
        "key\n"
    );
    assert_eq!(mode(&etc), 0o700);
    assert!(
        !root.join("usr/share/doc/tunnelgate").exists(),
        "the docs folder goes"
    );
    assert!(
        out.stderr
            .contains(&format!("{} with what you put there", etc.display()))
            && out.stderr.contains("private.key")
            && out.stderr.contains("tunnelgate.toml"),
        "it says what it keeps: {out:?}"
    );

    let again = install(&["--uninstall"], &vars);
    assert!(again.success(), "{again:?}");
    assert_eq!(files_under(&root), left);
}

/// A unit the admin edited in place is the admin's: kept, and named; an untouched one goes. An
/// emptied `/etc/tunnelgate` goes too (only the install made it).
#[test]
fn install_sh_uninstall_keeps_an_edited_unit_and_removes_an_empty_config_dir() {
    let tmp = TempDir::new("tx-uninstall-edited");
    let bin_dir = prebuilt(&tmp);
    let root = tmp.path().join("root");
    let out = install(
        &["--prebuilt", &bin_dir.display().to_string()],
        &[("DESTDIR", &root)],
    );
    assert!(out.success(), "{out:?}");
    let edited = root.join("etc/systemd/system/tunnelgate@.service");
    let text = std::fs::read_to_string(&edited).expect("unit");
    std::fs::write(&edited, format!("{text}# edited by the admin\n")).expect("edit");

    let out = install(&["--uninstall"], &[("DESTDIR", &root)]);
    assert!(out.success(), "{out:?}");
    assert_eq!(
        files_under(&root),
        [PathBuf::from("etc/systemd/system/tunnelgate@.service")]
    );
    assert!(
        out.stderr.contains(&format!(
            "{} (differs from what this checkout installs",
            edited.display()
        )),
        "{out:?}"
    );
    assert!(
        !root.join("etc/tunnelgate").exists(),
        "the empty config dir goes"
    );
    assert!(!root.join("etc/systemd/system/tunnelgate.service").exists());

    // --uninstall takes no install option.
    let out = install(&["--uninstall", "--sidecar"], &[("DESTDIR", &root)]);
    assert_eq!(out.code, Some(2), "{out:?}");
}
