//! gzip configs, and hostile environment values.

use super::*;

pub(crate) fn gzip(text: &str) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut encoder, text.as_bytes()).expect("gzip");
    encoder.finish().expect("gzip")
}

pub(crate) fn write_bytes_mode(dir: &TempDir, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

/// A `.gz` config is read whole (every member, as `cat a.gz b.gz` makes) or refused: nothing
/// after the last member is dropped silently.
#[test]
fn a_gz_config_is_read_whole_or_refused() {
    let tmp = TempDir::new("gz-whole");
    let interface = format!(
        "[interface]\nname = \"tggz0\"\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let peer = format!("[[peer]]\npublic_key = \"{PUB_B}\"\nallowed_ips = [\"10.77.0.0/16\"]\n");
    let two = [gzip(&interface), gzip(&peer)].concat();
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &two, 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains("10.77.0.0/16"),
        "the second member: {}",
        out.stdout
    );

    // The same, with bytes after the last member: refused with exit 2, saying so.
    let cfg = write_bytes_mode(
        &tmp,
        "garbage.toml.gz",
        &[&two[..], b"oops"].concat(),
        0o600,
    );
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr
            .contains("4 bytes of trailing data after gzip member 2"),
        "{}",
        out.stderr
    );
    // A second member cut short is refused too, not read as far as it goes.
    let cfg = write_bytes_mode(&tmp, "cut.toml.gz", &two[..two.len() - 4], 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("gzip member 2"), "{}", out.stderr);
}

/// The inline-secret warning holds for a `.gz` config as for a plain one.
#[test]
fn inline_private_key_in_a_readable_gz_is_a_warning() {
    let tmp = TempDir::new("inline-gz");
    let text = format!(
        "[interface]\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &gzip(&text), 0o644);
    // Named directly, and found as the `.gz` twin of the plain name.
    for named in [cfg.clone(), tmp.path().join("tunnelgate.toml")] {
        let out = cli(&["check", "--config", &named.display().to_string()], None);
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        assert!(
            out.stderr
                .contains("warning: interface.private_key: a secret written inline")
                && out.stderr.contains("0644"),
            "{}: {}",
            named.display(),
            out.stderr
        );
    }
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &gzip(&text), 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert!(!out.stderr.contains("inline"), "{}", out.stderr);
}

/// Hostile environment values (not UTF-8, huge, garbage) in what systemd, journald and the
/// operator set: a clear error naming the variable, or the documented ignore; never a panic.
#[test]
fn hostile_environment_values_get_an_error_or_are_ignored_never_a_panic() {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::process::CommandExt as _;
    let bytes = |b: &[u8]| std::ffi::OsStr::from_bytes(b).to_owned();
    let case = Case::new();
    let path = case.write("listen_port = 51820", "listen_port = 51820");

    // Ignored by `check` (and harmless to the daemon): notify and watchdog targets, the
    // journal's stream, RUST_LOG; our own (the GRO switch, a typo'd iptables flavour) are
    // warned of and their defaults stay.
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(["check", "--config", &path.display().to_string()])
        .env("NOTIFY_SOCKET", bytes(b"@garbage\xff"))
        .env("WATCHDOG_USEC", "18446744073709551616")
        .env("WATCHDOG_PID", "-1")
        .env("JOURNAL_STREAM", "garbage:\u{1b}[2J")
        .env("TUNNELGATE_NO_UDP_GRO", bytes(b"\xff"))
        .env("TUNNELGATE_IPTABLES", "x".repeat(100_000))
        .env("RUST_LOG", bytes(b"\xff"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(0), "{out:?}");
    // Ours are named, shortened, in a warning each.
    for name in ["TUNNELGATE_NO_UDP_GRO=", "TUNNELGATE_IPTABLES=\"xxxx"] {
        assert_eq!(out.stderr.matches(name).count(), 1, "{name}: {out:?}");
    }
    assert!(out.stderr.len() < 2000, "{out:?}");

    // A config path that is not UTF-8 is a path like any other: named, not found.
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.arg("check")
        .env("TUNNELGATE_CONFIG", bytes(b"/nonexistent-ts/\xff.toml"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("/nonexistent-ts/"), "{out:?}");

    // `tunnelgate-wg` reads its seccomp policy from the environment only: a value that is
    // not one of its words (here not even UTF-8) stops it before anything else (not the
    // default policy taken in silence).
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.arg0("tunnelgate-wg")
        .arg("ts/bad")
        .env("WG_PROCESS_FOREGROUND", "1")
        .env("TUNNELGATE_SECCOMP", bytes(b"of\xff"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("TUNNELGATE_SECCOMP=\"of")
            && out
                .stderr
                .contains("expected one of \"enforce\", \"log\", \"off\""),
        "{out:?}"
    );
}
