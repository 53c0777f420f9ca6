//! What a newcomer hits first (issue 28): `tunnelgate run` without privileges says once what it
//! needs instead of "Permission denied" twice, and a plain tunnel (no rules) logs "Ready" like
//! every other configuration.
//!
//! Needs root (it drops to another user, and starts a daemon in a namespace):
//! `cargo test --all-features --test netns_newcomer -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

#[test]
#[ignore = "needs root"]
fn run_without_root_prints_one_hint_and_exits_1() {
    require_root();
    let dir = TempDir::new("tx-nonroot");
    let cfg = TgConfig::new(0, &["100.86.0.1/32"]);
    dir.write_secret("private.key", &format!("{}\n", cfg.key.private));
    let config = dir.write("tunnelgate.toml", &cfg.render("private.key"));
    // Readable by the user it runs as: the refusal must come from the privileges alone.
    for path in [
        dir.path().to_path_buf(),
        config.clone(),
        dir.path().join("private.key"),
    ] {
        let _ = Command::new("chown").arg("65534:65534").arg(&path).status();
    }
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
        tunnelgate_bin(),
        "run",
        "--config",
        &config.display().to_string(),
    ]);
    let out = output_of(cmd, None);
    assert_eq!(out.code, Some(1), "{out:?}");
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {}", out.stderr);
    assert!(
        lines[0].contains("tunnelgate run needs root or CAP_NET_ADMIN"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("Permission denied"), "{}", out.stderr);
    assert!(
        !wg_socket(&cfg.name).exists(),
        "nothing was created: {}",
        out.stderr
    );
}

#[test]
#[ignore = "needs root"]
fn a_plain_tunnel_logs_ready() {
    require_root();
    let ns = Netns::new();
    let peer = Keypair::generate();
    let cfg =
        TgConfig::new(0, &["100.86.1.1/32"]).peer(Peer::new(&peer.public, &["100.86.1.2/32"]));
    let tg = Tunnelgate::start(&ns, cfg);
    let logged = poll_until(Duration::from_secs(5), || {
        tg.stderr().lines().any(|l| l.contains("Ready"))
    });
    assert!(logged, "no Ready line:\n{}", tg.stderr());
    assert!(
        !tg.stderr().contains("Not ready"),
        "a plain tunnel is ready from the start:\n{}",
        tg.stderr()
    );
}
