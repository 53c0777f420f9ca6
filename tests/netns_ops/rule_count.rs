//! `tunnelgate status` (text and `--json`) and `/metrics` count the installed rules as the
//! firewall tool counts them: one per `rule` object of `nft -j list table`, one per `-A` line of
//! `iptables-save` for iptables, not the lines of the table, its maps, sets and elements, chain
//! headers or declarations (issue 37: `installed: 28 rules` where nft showed 14).

use super::*;

/// A configuration with maps and sets (egress ports), several chains and both families.
fn config(firewall: &str) -> TgConfig {
    let mut cfg = TgConfig::new(0, &[&cidr(A_TUN4), &cidr(A_TUN6)]);
    cfg.health = Some("127.0.0.1:9002".into());
    cfg.extra = format!(
        "[firewall]\nmode = \"{firewall}\"\n\n\
         [[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"80\", \"443:8443\", \"53/udp\"]\n\n\
         [[egress]]\ntarget = \"100.64.0.2\"\nports = [\"5432\", \"8080:80\"]\n\n\
         [[egress]]\ntarget = \"fd7a::2\"\nports = [\"53/udp\"]\n\n\
         [router]\nadvertise_routes = [\"10.40.0.0/24\"]\n"
    );
    cfg
}

/// What status, its text and the metric say, once the rules have been read back.
fn counted(tg: &Tunnelgate) -> (u64, String, f64) {
    let mut last = Value::Null;
    let read_back = poll_until(SHORT, || {
        last = tunnelgate_status_json(tg.name()).unwrap_or_default();
        last["rules"]["rule_count"].as_u64().is_some_and(|n| n > 0)
    });
    assert!(read_back, "no rule count: {last}\n{}", tg.stderr());
    let text = tunnelgate_cli(&["status", "--interface", tg.name()], None);
    assert!(text.success(), "{}", text.stderr);
    let installed = text
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("installed: "))
        .unwrap_or_else(|| panic!("no installed: line in\n{}", text.stdout))
        .to_string();
    let metrics = tg.metrics().expect("metrics");
    let metric = metrics
        .lines()
        .find(|l| l.starts_with("tunnelgate_rules_installed{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no tunnelgate_rules_installed in\n{metrics}"));
    (
        last["rules"]["rule_count"].as_u64().expect("count"),
        installed,
        metric,
    )
}

#[test]
#[ignore = "needs root"]
fn status_counts_rules_as_nft_does() {
    let (a, _b) = lan();
    let tg = Tunnelgate::start(&a, config("nftables"));
    let (count, text, metric) = counted(&tg);
    let listing: Value = serde_json::from_str(&a.exec(&[
        "nft",
        "-j",
        "list",
        "table",
        "inet",
        &format!("tunnelgate_{}", tg.name()),
    ]))
    .expect("nft -j");
    let objects = listing["nftables"].as_array().expect("nftables array");
    let nft_rules = objects.iter().filter(|o| o.get("rule").is_some()).count() as u64;
    let maps_and_sets = objects
        .iter()
        .filter(|o| o.get("map").is_some() || o.get("set").is_some())
        .count();
    assert!(
        maps_and_sets > 0,
        "the case has maps and sets, whose lines are no rules"
    );
    assert!(nft_rules > 5, "{listing}");
    assert_eq!(count, nft_rules, "status --json against nft -j");
    assert_eq!(text, format!("{nft_rules} rules"), "status text");
    assert_eq!(metric, nft_rules as f64, "tunnelgate_rules_installed");
}

#[test]
#[ignore = "needs root"]
fn status_counts_rules_as_iptables_does() {
    let (a, _b) = lan();
    let tg = Tunnelgate::start(&a, config("iptables"));
    let (count, text, metric) = counted(&tg);
    // Ours: the rules of our chains and the jumps to them, in both families.
    let ours = format!("TG-{}-", tg.name());
    let saved = a.exec(&["iptables-save"]) + &a.exec(&["ip6tables-save"]);
    let iptables_rules = saved
        .lines()
        .filter(|l| l.starts_with("-A ") && l.contains(&ours))
        .count() as u64;
    assert!(iptables_rules > 5, "{saved}");
    assert_eq!(count, iptables_rules, "status --json against iptables-save");
    assert_eq!(text, format!("{iptables_rules} rules"), "status text");
    assert_eq!(metric, iptables_rules as f64, "tunnelgate_rules_installed");
}
