//! The Debian package (scripts/deb.sh) in a clean Debian root: the booted-systemd tests' cached
//! debootstrap rootfs, copied (image.sh's minbase root has no systemd, so `systemd-analyze
//! verify` could not run there: "Unit sysinit.target not found").

use super::*;
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;

/// The package to test: `$TUNNELGATE_DEB`, else the one `scripts/deb.sh` wrote for this
/// version into the target directory. `None` (the test skips: [`skip`]) when there is none;
/// under `CI=true` the test fails instead, and scripts/test.sh builds it first.
fn package_or_skip() -> Option<PathBuf> {
    let path = std::env::var_os("TUNNELGATE_DEB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let arch = Command::new("dpkg")
                .arg("--print-architecture")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default();
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
            target.join(format!(
                "debian/tunnelgate_{}-1_{arch}.deb",
                env!("CARGO_PKG_VERSION")
            ))
        });
    if path.is_file() {
        return Some(path);
    }
    skip(format!("{} missing: run scripts/deb.sh", path.display()));
    None
}

/// `args` run in `root` (not booted) by systemd-nspawn, with the host's network (apt fetches
/// the dependencies from the root's Debian mirror).
fn in_root(root: &Path, args: &[&str]) -> CmdOutput {
    let mut c = Command::new("systemd-nspawn");
    c.args([
        "--quiet",
        "--register=no",
        "--keep-unit",
        "--console=pipe",
        "--setenv=DEBIAN_FRONTEND=noninteractive",
        "-D",
    ])
    .arg(root)
    .args(args);
    output_of(c, None)
}

fn in_root_ok(root: &Path, args: &[&str]) -> CmdOutput {
    let out = in_root(root, args);
    assert!(out.success(), "{args:?} in the root: {out:?}");
    out
}

/// The files of the package as `dpkg -L` lists them, with what each must be:
/// `(path, mode, symlink target)`; directories only where the package owns their mode.
const FILES: &[(&str, u32, Option<&str>)] = &[
    ("/etc/tunnelgate", 0o40700, None),
    ("/usr/bin/tunnelgate", 0o100755, None),
    ("/usr/bin/tunnelgate-wg", 0o120777, Some("tunnelgate")),
    ("/usr/lib/systemd/system/tunnelgate.service", 0o100644, None),
    (
        "/usr/lib/systemd/system/tunnelgate@.service",
        0o100644,
        None,
    ),
    ("/usr/share/doc/tunnelgate/README.md", 0o100644, None),
    ("/usr/share/doc/tunnelgate/router.md", 0o100644, None),
    ("/usr/share/doc/tunnelgate/copyright", 0o100644, None),
    (
        "/usr/share/doc/tunnelgate/config/minimal.toml",
        0o100644,
        None,
    ),
    (
        "/usr/share/doc/tunnelgate/config/example.toml",
        0o100644,
        None,
    ),
    (
        "/usr/share/doc/tunnelgate/config/subnet-router.toml",
        0o100644,
        None,
    ),
    (
        "/usr/share/doc/tunnelgate/config/exit-node.toml",
        0o100644,
        None,
    ),
    (
        "/usr/share/doc/tunnelgate/changelog.Debian.gz",
        0o100644,
        None,
    ),
    ("/usr/share/lintian/overrides/tunnelgate", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-run.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-check.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-status.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-reload.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-genkey.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-genpsk.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-pubkey.8.gz", 0o100644, None),
    ("/usr/share/man/man8/tunnelgate-import.8.gz", 0o100644, None),
    (
        "/usr/share/man/man8/tunnelgate-import-wg-quick.8.gz",
        0o100644,
        None,
    ),
    (
        "/usr/share/man/man8/tunnelgate-userspace.8.gz",
        0o100644,
        None,
    ),
    (
        "/usr/share/man/man8/tunnelgate-wg.8.gz",
        0o120777,
        Some("tunnelgate-userspace.8.gz"),
    ),
];

/// Where `path` of the root is on the host.
fn at(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// The package is installed as a user installs it (`apt install ./tunnelgate_*.deb`, which
/// pulls in nftables), over a copy of scripts/install.sh's in /usr/local/bin, which it names,
/// and without wireguard-tools, which it says is missing. It lists exactly its files with their
/// modes, its units name the binary where it is and pass `systemd-analyze verify`, and both
/// binaries run. Under a booted systemd the unit starts the packaged daemon (nothing enables
/// it); an upgrade restarts it and names a tunnelgate-wg daemon left on the replaced binary,
/// and one whose restart fails says so; `apt remove` stops the unit and the tunnelgate-wg
/// daemon, masks the unit and takes the binaries and units away; `apt purge` keeps the key and
/// config written beforehand, says so, and unmasks the unit. Then `dpkg -i`, `dpkg -r`,
/// `dpkg -P` again, and a purge with nothing of the admin's left takes the package's 0700
/// folder too.
#[test]
#[ignore = "needs root, systemd-nspawn, the package (scripts/deb.sh) and the Debian mirror"]
fn the_package_installs_runs_and_leaves_only_the_admins_files() {
    require_root();
    let Some(deb) = package_or_skip() else {
        return;
    };
    let Some(cached) = rootfs_or_skip() else {
        return;
    };
    let tmp = TempDir::new("tx-deb");
    let root = tmp.path().join("root");
    let copied = output_of(
        {
            let mut c = Command::new("cp");
            c.arg("-a").arg(&cached).arg(&root);
            c
        },
        None,
    );
    assert!(copied.success(), "{copied:?}");
    // Outside /tmp, which nspawn mounts afresh.
    std::fs::copy(&deb, root.join("var/tmp/tunnelgate.deb")).expect("the package into the root");

    // --- install, as a user does (the test root has no kernel package, so no Recommends: the
    // wireguard-tools recommended would pull one in through its own recommendation) ---
    in_root_ok(&root, &["apt-get", "update", "-qq"]);
    // A copy from scripts/install.sh, which comes first on PATH.
    let local_copy = at(&root, "/usr/local/bin/tunnelgate");
    std::fs::create_dir_all(local_copy.parent().expect("bin dir")).expect("/usr/local/bin");
    std::fs::write(&local_copy, "#!/bin/sh\n").expect("a copy in /usr/local/bin");
    // And its manual page, which `man` reads before the package's.
    let local_page = at(&root, "/usr/local/share/man/man8/tunnelgate.8.gz");
    std::fs::create_dir_all(local_page.parent().expect("man8")).expect("/usr/local/share/man");
    std::fs::write(&local_page, "").expect("a page in /usr/local/share/man");
    let installed = in_root_ok(
        &root,
        &[
            "apt-get",
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "/var/tmp/tunnelgate.deb",
        ],
    );
    assert!(
        root.join("usr/sbin/nft").exists(),
        "Depends pulled in nftables:\n{}",
        installed.stdout
    );
    let said = format!("{}{}", installed.stdout, installed.stderr);
    assert!(
        said.contains("another tunnelgate is installed")
            && said.contains("/usr/local/bin/tunnelgate")
            && said.contains("/usr/local/share/man/man8/tunnelgate.8.gz"),
        "the postinst names the copy and the page that hide the package's: {said}"
    );
    assert!(
        said.contains("wireguard-tools is not installed"),
        "--no-install-recommends left out wireguard-tools, and the postinst says so: {said}"
    );
    std::fs::remove_file(&local_copy).expect("rm the copy");
    std::fs::remove_file(&local_page).expect("rm the page");
    let fields = in_root_ok(
        &root,
        &[
            "dpkg-query",
            "-W",
            "-f",
            "${Status}\n${Depends}\n${Recommends}",
            "tunnelgate",
        ],
    )
    .stdout;
    let fields: Vec<&str> = fields.trim().lines().collect();
    assert_eq!(fields[0], "install ok installed", "{fields:?}");
    assert!(
        fields[1].contains("nftables | iptables") && fields[1].contains("libc6 (>= "),
        "Depends: what the daemon runs and the libraries it links: {fields:?}"
    );
    assert_eq!(fields[2], "wireguard-tools", "{fields:?}");

    // --- dpkg -L: exactly these files, with these modes, root's ---
    let listed: BTreeSet<String> = in_root_ok(&root, &["dpkg", "-L", "tunnelgate"])
        .stdout
        .lines()
        .map(str::to_string)
        .collect();
    for (path, mode, link) in FILES {
        assert!(listed.contains(*path), "dpkg -L lacks {path}: {listed:#?}");
        let meta =
            std::fs::symlink_metadata(at(&root, path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(meta.mode(), *mode, "{path}: mode {:o}", meta.mode());
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{path}");
        if let Some(target) = link {
            assert_eq!(
                std::fs::read_link(at(&root, path)).expect("link"),
                Path::new(target)
            );
        }
    }
    let files: Vec<&String> = listed.iter().filter(|p| !at(&root, p).is_dir()).collect();
    assert_eq!(
        files.len(),
        FILES.len() - 1,
        "no other file (no sidecar, nothing else): {files:#?}"
    );
    let unit = std::fs::read_to_string(at(&root, FILES[3].0)).expect("unit");
    let template = std::fs::read_to_string(at(&root, FILES[4].0)).expect("template");
    assert_eq!(
        unit_values_in(&unit, "Service", "ExecStart"),
        ["/usr/bin/tunnelgate run --config /etc/tunnelgate/tunnelgate.toml"]
    );
    assert_eq!(
        unit_values_in(&template, "Service", "ExecReload"),
        ["/usr/bin/tunnelgate reload --config /etc/tunnelgate/%i.toml"]
    );

    // --- the installed units pass systemd-analyze verify, with the root's systemd ---
    let verify = in_root(
        &root,
        &[
            "systemd-analyze",
            "verify",
            "--man=no",
            "tunnelgate.service",
            "tunnelgate@wg0.service",
        ],
    );
    let complaints: Vec<&str> = verify
        .stdout
        .lines()
        .chain(verify.stderr.lines())
        .filter(|l| l.contains("tunnelgate.service") || l.contains("tunnelgate@"))
        .collect();
    assert!(
        verify.success() && complaints.is_empty(),
        "systemd-analyze verify: {verify:?}"
    );

    // --- both binaries run ---
    let version = in_root_ok(&root, &["tunnelgate", "--version"]).stdout;
    assert_eq!(
        version.trim(),
        format!("tunnelgate {}", env!("CARGO_PKG_VERSION"))
    );
    let wg_version = in_root_ok(&root, &["tunnelgate-wg", "--version"]).stdout;
    assert_eq!(
        wg_version.trim(),
        format!("tunnelgate-wg {}", env!("CARGO_PKG_VERSION")),
        "the link runs the wireguard-go drop-in"
    );

    // --- an admin's key and config, then the unit under a booted systemd ---
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.83.7.1/32"]);
    cfg.health = None;
    let etc = at(&root, "/etc/tunnelgate");
    let key = format!("{}\n", cfg.key.private);
    let config = cfg.render("private.key");
    for (name, text) in [("private.key", &key), ("tunnelgate.toml", &config)] {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(etc.join(name))
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let container = boot(&root, &ns, tmp.path());
    let unit = "tunnelgate.service";
    assert_eq!(
        container.property(unit, "UnitFileState"),
        "disabled",
        "the package enables nothing"
    );
    assert_eq!(container.property(unit, "ActiveState"), "inactive");
    let started = container.inside(&["systemctl", "start", unit]);
    let journal = || {
        container
            .inside(&["journalctl", "-u", "tunnelgate", "--no-pager"])
            .stdout
    };
    assert!(started.success(), "{started:?}\n{}", journal());
    assert_eq!(container.property(unit, "ActiveState"), "active");
    assert!(
        ns.link_exists(&cfg.name),
        "the packaged daemon made its tunnel\n{}",
        journal()
    );
    // A wg-quick-style daemon: `tunnelgate-wg IF` goes to the background once its tunnel is up.
    let wg_if = unique_name("tgw");
    let wg = container.inside(&["tunnelgate-wg", &wg_if]);
    assert!(wg.success() && ns.link_exists(&wg_if), "{wg:?}");

    // --- an upgrade (the same package again: dpkg runs the upgrade's scripts) restarts the
    // unit on the new binary and names the tunnelgate-wg daemon still on the replaced one ---
    let before = container.property(unit, "MainPID");
    let upgraded = container.inside(&["dpkg", "-i", "/var/tmp/tunnelgate.deb"]);
    assert!(upgraded.success(), "{upgraded:?}");
    assert_eq!(
        container.property(unit, "ActiveState"),
        "active",
        "{upgraded:?}"
    );
    assert_ne!(
        container.property(unit, "MainPID"),
        before,
        "restarted: {upgraded:?}"
    );
    assert!(
        !upgraded.stderr.contains("failed"),
        "a good restart says nothing of a failure (the template's glob matches no instance): {upgraded:?}"
    );
    assert!(
        upgraded
            .stderr
            .contains("still running the replaced binary")
            && format!("{}{}", upgraded.stdout, upgraded.stderr)
                .contains(&format!("tunnelgate-wg {wg_if}")),
        "{upgraded:?}"
    );
    // An upgrade whose restart fails (the config the daemon took has become invalid since)
    // says so, and leaves the package configured.
    std::fs::write(etc.join("tunnelgate.toml"), "[interface\n").expect("a broken config");
    let upgraded = container.inside(&["dpkg", "-i", "/var/tmp/tunnelgate.deb"]);
    assert!(upgraded.success(), "{upgraded:?}");
    assert!(
        upgraded
            .stderr
            .contains("restart of the running tunnelgate units on the new binary failed"),
        "{upgraded:?}"
    );
    assert_ne!(container.property(unit, "ActiveState"), "active");
    std::fs::write(etc.join("tunnelgate.toml"), &config).expect("the config again");
    let started = container.inside(&["systemctl", "start", unit]);
    assert!(started.success(), "{started:?}\n{}", journal());

    // --- apt remove: the tunnel stops, binaries and units go, the admin's files stay ---
    let removed = container.inside(&[
        "env",
        "DEBIAN_FRONTEND=noninteractive",
        "apt-get",
        "remove",
        "-y",
        "-q",
        "tunnelgate",
    ]);
    assert!(removed.success(), "{removed:?}");
    assert!(
        poll_until(Duration::from_secs(10), || !ns.link_exists(&cfg.name)),
        "apt remove stopped the tunnel\n{}",
        journal()
    );
    assert_ne!(container.property(unit, "ActiveState"), "active");
    assert!(
        !ns.link_exists(&wg_if)
            && format!("{}{}", removed.stdout, removed.stderr)
                .contains(&format!("stopping tunnelgate-wg {wg_if}")),
        "apt remove stopped the tunnelgate-wg daemon too, and said so: {removed:?}"
    );
    let mask = at(&root, "/etc/systemd/system/tunnelgate.service");
    assert_eq!(
        std::fs::read_link(&mask).ok().as_deref(),
        Some(Path::new("/dev/null")),
        "a removed package's unit is masked, as dh_installsystemd does"
    );
    for (path, _, _) in &FILES[1..] {
        assert!(
            std::fs::symlink_metadata(at(&root, path)).is_err(),
            "{path} is left after remove"
        );
    }
    assert_eq!(
        std::fs::read_to_string(etc.join("private.key")).ok(),
        Some(key.clone())
    );
    let said = format!("{}{}", removed.stdout, removed.stderr);
    assert!(said.contains("kept /etc/tunnelgate"), "{said}");

    // --- apt purge: still the admin's files, and a message that names them ---
    let purged = container.inside(&[
        "env",
        "DEBIAN_FRONTEND=noninteractive",
        "apt-get",
        "purge",
        "-y",
        "-q",
        "tunnelgate",
    ]);
    assert!(purged.success(), "{purged:?}");
    let said = format!("{}{}", purged.stdout, purged.stderr);
    assert!(
        said.contains("kept /etc/tunnelgate") && said.contains("private.key"),
        "{said}"
    );
    assert_eq!(
        std::fs::read_to_string(etc.join("private.key")).ok(),
        Some(key.clone())
    );
    assert_eq!(
        std::fs::read_to_string(etc.join("tunnelgate.toml")).ok(),
        Some(config)
    );
    assert!(
        std::fs::symlink_metadata(&mask).is_err(),
        "the purge unmasked the unit"
    );
    container.poweroff();

    // --- the same with dpkg itself: -i over the kept folder, -r, -P ---
    in_root_ok(&root, &["dpkg", "-i", "/var/tmp/tunnelgate.deb"]);
    assert_eq!(
        std::fs::metadata(&etc).map(|m| m.mode() & 0o7777).ok(),
        Some(0o700)
    );
    in_root_ok(&root, &["dpkg", "-r", "tunnelgate"]);
    for (path, _, _) in &FILES[1..] {
        assert!(
            std::fs::symlink_metadata(at(&root, path)).is_err(),
            "{path} is left after dpkg -r"
        );
    }
    let purged = in_root_ok(&root, &["dpkg", "-P", "tunnelgate"]);
    let said = format!("{}{}", purged.stdout, purged.stderr);
    assert!(said.contains("kept /etc/tunnelgate"), "{said}");
    assert_eq!(
        std::fs::read_to_string(etc.join("private.key")).ok(),
        Some(key)
    );

    // What the package made goes with a purge when nothing of the admin's is in it.
    std::fs::remove_file(etc.join("private.key")).expect("rm key");
    std::fs::remove_file(etc.join("tunnelgate.toml")).expect("rm config");
    in_root_ok(&root, &["dpkg", "-i", "/var/tmp/tunnelgate.deb"]);
    let purged = in_root_ok(&root, &["dpkg", "-P", "tunnelgate"]);
    assert!(
        !etc.exists(),
        "the empty folder is the package's: {purged:?}"
    );
    let status = in_root(
        &root,
        &["dpkg-query", "-W", "-f", "${Status}", "tunnelgate"],
    );
    assert!(
        !status.stdout.contains("installed") && !status.stdout.contains("config-files"),
        "{status:?}"
    );
}

/// `root` booted by systemd-nspawn in the network namespace `ns`, with only what the unit needs
/// from the host (the TUN device, CAP_NET_ADMIN): nothing of the worktree is bound in.
fn boot(root: &Path, ns: &Netns, log_dir: &Path) -> Container {
    let mut cmd = Command::new("systemd-nspawn");
    cmd.args([
        "-b",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        "--capability=CAP_NET_ADMIN",
        &format!("--network-namespace-path=/run/netns/{}", ns.name()),
        "--bind=/dev/net/tun",
        "-D",
    ])
    .arg(root);
    let nspawn = Proc::spawn(cmd, "nspawn", log_dir);
    let nspawn_pid = nspawn.pid();
    wait_until(Duration::from_secs(20), "the container's PID 1", || {
        container_init(nspawn_pid).is_some()
    });
    let container = Container { nspawn };
    // systemd answers once it has loaded its units. Just after PID 1 starts, `is-system-running`
    // prints "offline", then nothing (no bus yet), then "initializing": `systemctl show` printed
    // nothing at "offline" (CI, 2026-12-02), so only a later state is ready.
    wait_until(
        Duration::from_secs(30),
        "systemctl in the container",
        || {
            let state = container.inside(&["systemctl", "is-system-running"]).stdout;
            !matches!(state.trim(), "" | "offline" | "unknown" | "initializing")
        },
    );
    container
}
