//! `scripts/install.sh`, the README's Install section: run into a `DESTDIR` with the binary this
//! test suite built (`--prebuilt`, so no release build is needed here), it puts `tunnelgate`
//! where the units look for it, the `tunnelgate-wg` link beside it, the units, the docs and
//! example configs, and a 0700 `/etc/tunnelgate`; `PREFIX` and `SYSCONFDIR` move the paths in
//! the units too; a second run keeps the keys an admin put in `/etc/tunnelgate`.

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
