//! Issue 14: `tunnelgate reload` and `tunnelgate status` with no daemon named.

use super::*;

/// Peers' public keys in a status JSON object.
pub(crate) fn status_peers(status: &Value) -> BTreeSet<String> {
    status["peers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p["public_key"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
#[ignore = "needs root"]
fn reload_cli_applies_a_good_change_and_refuses_a_broken_file() {
    let a = Netns::new();
    let first = Keypair::generate();
    let second = Keypair::generate();
    let cfg =
        TgConfig::new(0, &["100.67.0.1/32"]).peer(Peer::new(&first.public, &["100.67.0.2/32"]));
    let mut tg = start_tg(&a, cfg.clone(), &[], &[]);
    let name = tg.name().to_string();
    let config = tg.config_path().display().to_string();

    // A good change: exit 0, and the daemon runs it when the command returns.
    let added = cfg
        .clone()
        .peer(Peer::new(&second.public, &["100.67.0.3/32"]));
    tg.write_config(added.clone());
    // The new peer has a name, for status and metrics.
    let named = added.render("private.key").replace(
        &format!("public_key = \"{}\"", second.public),
        &format!("name = \"office\"\npublic_key = \"{}\"", second.public),
    );
    tg.write_config_text(&named);
    let out = tunnelgate_cli(&["reload", "--config", &config], None);
    assert_eq!(
        out.code,
        Some(0),
        "reload of a good change: {out:?}\n{}",
        tg.stderr()
    );
    let status = tunnelgate_status_json(&name).expect("status");
    assert_eq!(
        status_peers(&status),
        BTreeSet::from([first.public.clone(), second.public.clone()]),
        "{status}"
    );
    let office = status["peers"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["public_key"] == second.public.as_str()))
        .map(|p| p["name"].clone());
    assert_eq!(office, Some(Value::from("office")), "{status}");
    let text = tunnelgate_cli(&["status", "--interface", &name], None).stdout;
    assert!(
        text.contains(&format!("peer: {} (office)", second.public)),
        "{text}"
    );
    let (_, metrics) = scrape(&tg);
    assert!(
        metrics
            .value(
                "tunnelgate_peer_rx_bytes_total",
                &[("peer", &second.public), ("peer_name", "office")]
            )
            .is_some(),
        "peer_name label on the per-peer metrics"
    );

    // Nothing changed: still 0.
    let out = tunnelgate_cli(&["reload", "--interface", &name], None);
    assert_eq!(out.code, Some(0), "{out:?}");

    // A broken file: exit 1 naming the key, and the old configuration keeps running.
    let broken = added
        .render("private.key")
        .replace("\"100.67.0.3/32\"", "\"100.67.0.300/32\"");
    tg.write_config_text(&broken);
    for args in [
        ["reload", "--interface", name.as_str()],
        ["reload", "--config", config.as_str()],
    ] {
        let out = tunnelgate_cli(&args, None);
        assert_eq!(out.code, Some(1), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("peer[1].allowed_ips") && out.stderr.contains("100.67.0.300"),
            "the refusal names the key and the value: {}",
            out.stderr
        );
    }
    assert!(tg.is_running(), "{}", tg.stderr());
    let status = tunnelgate_status_json(&name).expect("status");
    assert_eq!(
        status_peers(&status).len(),
        2,
        "old config still served: {status}"
    );

    // Bad usage: 2.
    let out = tunnelgate_cli(&["reload", "--interface", &name, "--config", &config], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    // No such daemon: 1.
    let out = tunnelgate_cli(&["reload", "--interface", &unique_name("tgt")], None);
    assert_eq!(out.code, Some(1), "{out:?}");

    // SIGHUP with nothing changed says so in one line.
    tg.write_config(added);
    let out = tunnelgate_cli(&["reload", "--interface", &name], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    tg.sighup();
    wait_until(SHORT, "the SIGHUP reload is logged", || {
        tg.stderr()
            .lines()
            .any(|l| l.contains("unchanged") && l.contains("SIGHUP"))
    });
    let lines: Vec<String> = tg
        .stderr()
        .lines()
        .filter(|l| l.contains("SIGHUP"))
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 1, "one line per SIGHUP: {lines:#?}");
    assert!(tg.sigterm().success());
}

#[test]
#[ignore = "needs root"]
fn status_all_lists_every_daemon_and_skips_stale_sockets() {
    let a = Netns::new();
    let b = Netns::new();
    let mut one = TgConfig::new(0, &["100.68.0.1/32"]);
    one.health = None;
    let mut two = TgConfig::new(0, &["100.68.1.1/32"]);
    two.health = None;
    let tg1 = start_tg(&a, one, &[], &[]);
    let tg2 = start_tg(&b, two, &[], &[]);
    // A socket left behind by a killed daemon.
    let stale_name = unique_name("tgt");
    let stale = std::path::Path::new("/var/run/tunnelgate").join(format!("{stale_name}.sock"));
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("stale socket"));

    // The daemons run in other namespaces than this test: `--all` (plain `status` shows only
    // this namespace's, see tests/netns_wgquick.rs).
    let out = tunnelgate_cli(&["status", "--all", "--json"], None);
    let _ = std::fs::remove_file(&stale);
    assert_eq!(out.code, Some(0), "{out:?}");
    let all: Value = serde_json::from_str(&out.stdout).expect("a JSON array");
    let names: BTreeSet<String> = all
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|d| d["interface"]["name"].as_str().map(String::from))
        .collect();
    assert!(
        names.contains(tg1.name()) && names.contains(tg2.name()),
        "{names:?}"
    );
    assert!(!names.contains(&stale_name), "{names:?}");
    for d in all.as_array().into_iter().flatten() {
        if d["interface"]["name"] == tg1.name() {
            assert_eq!(d["interface"]["addresses"][0], "100.68.0.1/32", "{d}");
        }
    }

    let out = tunnelgate_cli(&["status", "--all"], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    // `wg show`-like: one block per daemon, its own key and port under its name.
    for tg in [&tg1, &tg2] {
        let n = tg.name();
        let block = out
            .stdout
            .split("interface: ")
            .find(|b| b.starts_with(&format!("{n}\n")))
            .unwrap_or_else(|| panic!("no `interface: {n}` block in:\n{}", out.stdout));
        assert!(
            block.contains(&format!("\n  public key: {}\n", tg.public_key()))
                && block.contains("\n  listening port: "),
            "{n}'s block:\n{block}"
        );
    }
}

/// What a `wg set` change is worth after a reload, as README says: it lasts until the next
/// reload that changes the file; then the file wins (like `wg syncconf`).
#[test]
#[ignore = "needs root"]
fn wg_set_changes_last_until_a_changed_file_is_reloaded() {
    let a = Netns::new();
    let first = Keypair::generate();
    let by_hand = Keypair::generate();
    let later = Keypair::generate();
    let cfg =
        TgConfig::new(0, &["100.69.0.1/32"]).peer(Peer::new(&first.public, &["100.69.0.2/32"]));
    let mut tg = start_tg(&a, cfg.clone(), &[], &[]);
    let name = tg.name().to_string();
    run(&[
        "wg",
        "set",
        &name,
        "peer",
        &by_hand.public,
        "allowed-ips",
        "100.69.0.3/32",
    ]);
    let peers = |tg: &Tunnelgate| status_peers(&tg.status_json().expect("status"));
    assert!(peers(&tg).contains(&by_hand.public));

    // An unchanged file: nothing is applied, the hand-made peer stays.
    let out = tunnelgate_cli(&["reload", "--interface", &name], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    let now = peers(&tg);
    println!("after an unchanged reload: {now:?}");
    let survived_unchanged = now.contains(&by_hand.public);

    // A changed file: the file's peers, and only those.
    tg.write_config(cfg.peer(Peer::new(&later.public, &["100.69.0.4/32"])));
    let out = tunnelgate_cli(&["reload", "--interface", &name], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    let now = peers(&tg);
    println!("after a changed reload: {now:?}");
    assert_eq!(
        now,
        BTreeSet::from([first.public.clone(), later.public.clone()]),
        "the file wins on a reload that changes it"
    );
    assert!(
        survived_unchanged,
        "a reload of an unchanged file keeps wg set changes"
    );
}
