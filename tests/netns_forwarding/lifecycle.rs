//! Rules that are idempotent, repaired and removed, and large transfers across an MTU mismatch, per backend.

use super::*;

/// The rule set after a reapply, a restart and a `kill -9` + start is byte-for-byte the one a
/// fresh start installs; a rule deleted by hand comes back; SIGTERM removes everything of ours
/// and nothing else.
pub(crate) fn rules_idempotent_repaired_and_removed(backend: Backend) {
    let t = Topo::new(backend);
    add_foreign_rules(&t.proxy, backend);
    let foreign = foreign_rules(&t.proxy, backend);
    let marker = match backend {
        Backend::Nftables => "\"foreign\"",
        _ => "FOREIGN-NAT",
    };
    assert!(
        foreign.contains(marker),
        "foreign rules not seen:\n{foreign}"
    );
    assert_eq!(
        owned_rules(&t.proxy, backend),
        "",
        "nothing of ours before the start"
    );

    let firewall = firewall_toml(backend, "1s");
    let body = |extra_egress: &[&str]| {
        let mut egress = vec!["5432", "8080:80"];
        egress.extend_from_slice(extra_egress);
        format!(
            "{firewall}\n{}\n{}",
            ingress_toml(&["443:8443", "53/udp"]),
            egress_toml(&egress)
        )
    };
    let cfg = t.config(body(&[]));
    let iface = cfg.name.clone();
    let mut graveyard = Vec::new();
    let mut tg = t.start(backend, cfg.clone());
    let fresh = owned_rules(&t.proxy, backend);
    assert!(!fresh.is_empty(), "no rules installed");
    let lines = owned_rule_lines(&t.proxy, backend);
    assert_eq!(
        duplicates(&lines),
        Vec::<String>::new(),
        "duplicate rules: {lines:#?}"
    );
    assert_mss_once(&t.proxy, backend, &iface);
    assert_eq!(
        foreign_rules(&t.proxy, backend),
        foreign,
        "foreign rules changed by the start"
    );
    t.connect_client(&tg, &[]);
    let backend_443 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 8443));

    // What status reports is what is installed.
    let status = status_json(&tg);
    let text = status["rules"]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!text.is_empty(), "status has no rules.text: {status}");
    match backend {
        Backend::Nftables => {
            let check = tunnelgate_cli_in(
                &t.proxy,
                &["check", "--config", &tg.config_path().display().to_string()],
            );
            assert!(check.success(), "tunnelgate check: {}", check.stderr);
            assert!(
                check.stdout.contains(text.trim()),
                "check does not print the applied rule text\n--- status rules.text\n{text}\n--- check\n{}",
                check.stdout
            );
        }
        _ => {
            for line in owned_rule_lines(&t.proxy, backend) {
                let rule = line.split_once(": ").map(|x| x.1).unwrap_or(&line);
                if rule.starts_with("-A TG-") {
                    assert!(
                        text.contains(rule),
                        "installed {rule:?} is not in status rules.text:\n{text}"
                    );
                }
            }
        }
    }

    // SIGHUP with the same config: nothing changes.
    let reloads = metric_now(&tg, "tunnelgate_config_reloads_total");
    tg.sighup();
    wait_metric(
        &tg,
        "tunnelgate_config_reloads_total",
        reloads + 1.0,
        "SIGHUP",
    );
    assert_eq!(owned_rules(&t.proxy, backend), fresh, "after SIGHUP");

    // A real reapply: a changed config, then the original again.
    let applies = metric_now(&tg, "tunnelgate_rule_applies_total");
    let mut changed = cfg.clone();
    changed.extra = body(&["6000"]);
    tg.write_config(changed);
    tg.sighup();
    wait_until(
        Duration::from_secs(10),
        "the changed rules are installed",
        || owned_rules(&t.proxy, backend).contains("6000"),
    );
    tg.write_config(cfg.clone());
    tg.sighup();
    wait_rules_equal(
        &t.proxy,
        backend,
        &fresh,
        Duration::from_secs(10),
        "after reapply",
    );
    wait_metric(
        &tg,
        "tunnelgate_rule_applies_total",
        applies + 2.0,
        "two reapplies",
    );

    // Drift: a rule deleted by hand is restored within a few repair intervals (1 s).
    // (Whether the deletion is seen before the repair is a race; the apply counter moving
    // without a config change is the proof that drift was repaired.)
    let applies = metric_now(&tg, "tunnelgate_rule_applies_total");
    delete_a_rule(&t.proxy, backend, &iface);
    wait_metric(
        &tg,
        "tunnelgate_rule_applies_total",
        applies + 1.0,
        "drift repair",
    );
    wait_rules_equal(
        &t.proxy,
        backend,
        &fresh,
        Duration::from_secs(5),
        "after drift repair",
    );
    echo_ok(&t.client, sa(TG_V4, 443), "ingress after drift repair");

    // SIGTERM removes everything of ours and nothing else.
    let status = tg.sigterm();
    assert!(status.success(), "SIGTERM exit status {status:?}");
    assert_nothing_of_ours(&t.proxy, backend, "after SIGTERM");
    assert_eq!(
        foreign_rules(&t.proxy, backend),
        foreign,
        "foreign rules after SIGTERM"
    );

    // Restart: the same rules as a fresh start.
    graveyard.push(std::mem::replace(&mut tg, t.start(backend, cfg.clone())));
    assert_eq!(owned_rules(&t.proxy, backend), fresh, "after restart");

    // kill -9: the rules stay (nobody removed them); a new start replaces them, no duplicates.
    tg.kill9();
    assert_eq!(
        owned_rules(&t.proxy, backend),
        fresh,
        "kill -9 leaves the rules as they were"
    );
    graveyard.push(std::mem::replace(&mut tg, t.start(backend, cfg.clone())));
    assert_eq!(
        owned_rules(&t.proxy, backend),
        fresh,
        "after kill -9 + start"
    );
    assert_mss_once(&t.proxy, backend, &iface);
    assert_eq!(
        foreign_rules(&t.proxy, backend),
        foreign,
        "foreign rules after kill -9 + start"
    );
    // The client still holds a session with the killed daemon: start a fresh one rather than
    // wait for wireguard-go's own 15 s recovery (what this test checks is the rules).
    t.wg.remove_peer(tg.public_key());
    t.connect_client(&tg, &[]);
    echo_ok(&t.client, sa(TG_V4, 443), "ingress after kill -9 + start");
    all_from(&backend_443.seen(), PROXY_CLUSTER_V4, "backend behind 443");

    let status = tg.sigterm();
    assert!(status.success(), "SIGTERM exit status {status:?}");
    assert_nothing_of_ours(&t.proxy, backend, "after the final SIGTERM");
    assert_eq!(
        foreign_rules(&t.proxy, backend),
        foreign,
        "foreign rules at the end"
    );
    drop(graveyard);
}

/// `tunnelgate ARGS` inside a namespace (for `check`, whose iptables text depends on the
/// namespace's current rules).
pub(crate) fn tunnelgate_cli_in(ns: &Netns, args: &[&str]) -> CmdOutput {
    let mut full = vec![tunnelgate_bin()];
    full.extend_from_slice(args);
    ns.output(&full)
}

/// Tunnel MTU 1280 (wireguard-go keeps its 1420), cluster link 1500 then 9000: 50 MB uploads and
/// downloads through ingress arrive intact; the MSS clamp is installed once per direction.
pub(crate) fn mtu_mismatch_large_transfers(backend: Backend) {
    let t = Topo::new(backend);
    let mut cfg = t.config(format!(
        "{}\n{}",
        firewall_toml(backend, "10s"),
        ingress_toml(&[])
    ));
    cfg.mtu = Some(1280);
    let iface = cfg.name.clone();
    let tg = t.start(backend, cfg);
    assert_mss_once(&t.proxy, backend, &iface);
    t.connect_client(&tg, &[]);

    let link = t.cluster_link.clone();
    // (cluster MTU, IPv4 bytes, IPv6 bytes), each sent both ways.
    for (mtu, v4_bytes, v6_bytes) in [(1500u32, 50 * MB, 10 * MB), (9000, 20 * MB, 10 * MB)] {
        t.proxy
            .exec(&["ip", "link", "set", &link.a_name, "mtu", &mtu.to_string()]);
        t.cluster
            .exec(&["ip", "link", "set", &link.b_name, "mtu", &mtu.to_string()]);
        for (fam, listen, connect, masq) in [
            (
                "v4",
                sa(BACKEND_V4, 9100),
                sa(TG_V4, 9100),
                PROXY_CLUSTER_V4,
            ),
            (
                "v6",
                sa(BACKEND_V6, 9100),
                sa(TG_V6, 9100),
                PROXY_CLUSTER_V6,
            ),
        ] {
            for dir in [TransferDir::ClientToServer, TransferDir::ServerToClient] {
                let n = if fam == "v4" { v4_bytes } else { v6_bytes };
                let (stats, from) = tcp_transfer_via(
                    &t.client,
                    &t.cluster,
                    listen,
                    connect,
                    dir,
                    n,
                    Duration::from_secs(120),
                )
                .unwrap_or_else(|e| {
                    panic!(
                        "{fam} {dir:?} {n} bytes, cluster mtu {mtu}: {e}\ntunnelgate stderr:\n{}",
                        tg.stderr()
                    )
                });
                assert_eq!(from.ip(), ip(masq), "backend sees the masqueraded source");
                eprintln!(
                    "{backend:?} cluster mtu {mtu} {fam} {dir:?}: {} MB in {:.1} s ({:.0} Mbit/s)",
                    n / MB,
                    stats.secs,
                    stats.mbit_per_s()
                );
            }
        }
    }
    assert_mss_once(&t.proxy, backend, &iface);
    drop(tg);
}
