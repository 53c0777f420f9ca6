//! DNS-named targets (`target_fqdn`, issue 4) end to end, with a real dnsmasq serving the names.
//!
//! Topology (every part in its own network namespace):
//!
//! ```text
//!  client (wireguard-go)  --veth 192.168.60.0/24--  proxy (tunnelgate)  --veth 10.50.0.0/24, fd50::/64--  backend
//!  tunnel 100.70.0.2, fd70::2                       tunnel 100.70.0.1,     (whoami server on [::]:8080,
//!                                                   fd70::1                 addresses .11 .12 .13, fd50::21)
//!                                                        |
//!                                                   veth 10.53.0.0/24
//!                                                        |
//!                                                   dns (dnsmasq on 10.53.0.1, answers *.test.internal)
//! ```
//!
//! The proxy has `[[ingress]] target_fqdn = NAME, ports = ["8080"]` and `[dns] nameservers =
//! ["10.53.0.1"]`, `reresolve_interval = "2s"`. The client connects to the proxy's tunnel address
//! on port 8080 and the backend's whoami server tells which of its addresses was reached.
//!
//! Run as root: `cargo test --test netns_dns -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tunnelgate::shell::clock;

const DOMAIN: &str = "test.internal";
const PORT: u16 = 8080;
const INTERVAL: Duration = Duration::from_secs(2);
const TUNNEL_V4: &str = "100.70.0.1";
const TUNNEL_V6: &str = "fd70::1";
const DNS_ADDR: &str = "10.53.0.1";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// The namespaces, dnsmasq, the wireguard-go client and the backend server of one test.
struct Lab {
    client: Netns,
    proxy: Netns,
    backend: Netns,
    dns_ns: Netns,
    dnsmasq: Dnsmasq,
    wg: WgGo,
    server: TcpWhoami,
}

impl Lab {
    /// Builds the topology with dnsmasq serving `hosts`.
    fn new(hosts: &str) -> Lab {
        let client = Netns::new();
        let proxy = Netns::new();
        let backend = Netns::new();
        let dns_ns = Netns::new();
        veth(&proxy, &["192.168.60.1/24"], &client, &["192.168.60.2/24"]);
        veth(
            &proxy,
            &["10.50.0.1/24", "fd50::1/64"],
            &backend,
            &[
                "10.50.0.11/24",
                "10.50.0.12/24",
                "10.50.0.13/24",
                "fd50::21/64",
                "fd50::22/64",
            ],
        );
        veth(&proxy, &["10.53.0.2/24"], &dns_ns, &["10.53.0.1/24"]);
        let dnsmasq = Dnsmasq::start(&dns_ns, ip(DNS_ADDR), DOMAIN, hosts);
        let server = TcpWhoami::start(&backend, SocketAddr::new(ip("::"), PORT));
        let wg = WgGo::start(&client, 0, &["100.70.0.2/32", "fd70::2/128"]);
        Lab {
            client,
            proxy,
            backend,
            dns_ns,
            dnsmasq,
            wg,
            server,
        }
    }

    /// The proxy's configuration: one ingress rule per `(name, port)`, the lab's name server and
    /// the shortened interval. `extra` is appended (e.g. `[firewall]`).
    fn config(&self, names: &[(&str, u16)], extra: &str) -> TgConfig {
        let mut cfg = TgConfig::new(51820, &["100.70.0.1/32", "fd70::1/128"]).peer(Peer::new(
            self.wg.public_key(),
            &["100.70.0.2/32", "fd70::2/128"],
        ));
        for (name, port) in names {
            cfg.extra.push_str(&format!(
                "[[ingress]]\ntarget_fqdn = \"{name}\"\nports = [\"{port}\"]\n\n"
            ));
        }
        cfg.extra.push_str(&format!(
            "[dns]\nnameservers = [\"{DNS_ADDR}\"]\nreresolve_interval = \"{}s\"\n\n{extra}",
            INTERVAL.as_secs()
        ));
        cfg
    }

    /// Points the client at the proxy and waits for the handshake.
    fn connect(&self, tg: &Tunnelgate) {
        self.wg.add_peer(
            &Peer::new(tg.public_key(), &["100.70.0.1/32", "fd70::1/128"])
                .endpoint("192.168.60.1:51820")
                .keepalive(1),
        );
        wait_handshake(self.wg.name(), tg.public_key(), Duration::from_secs(10));
    }

    /// Which backend address one new connection from the client to `to` lands on.
    fn landing(&self, to: IpAddr) -> Result<IpAddr, String> {
        whoami(
            &self.client,
            SocketAddr::new(to, PORT),
            Duration::from_secs(3),
        )
        .map(|(local, _)| local.ip())
    }
}

/// Starts the proxy and waits until it is ready and `name` resolved to `expect`.
fn start_proxy(lab: &Lab, cfg: TgConfig, name: &str, expect: &[&str]) -> Tunnelgate {
    let tg = Tunnelgate::start(&lab.proxy, cfg);
    wait_resolved(&tg, name, expect);
    tg
}

fn wait_resolved(tg: &Tunnelgate, name: &str, expect: &[&str]) {
    let mut want: Vec<String> = expect.iter().map(|s| s.to_string()).collect();
    want.sort();
    // Resolved, and the rules for the answer applied.
    let ok = poll_until(Duration::from_secs(15), || {
        tg.name_addresses(name) == want && {
            let text = rules_text(tg);
            want.iter().all(|a| text.contains(a.as_str()))
        }
    });
    assert!(
        ok,
        "{name} never showed {want:?} in the status and rules (now {:?}); stderr:\n{}",
        tg.name_status(name),
        tg.stderr()
    );
}

/// The status' `rules.text` (what was applied, as the backend sees it).
fn rules_text(tg: &Tunnelgate) -> String {
    tg.status_json().unwrap_or_default()["rules"]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
#[ignore = "needs root"]
fn changed_answer_moves_new_connections_and_leaves_no_stale_rule() {
    let name = format!("svc.{DOMAIN}");
    let mut lab = Lab::new(&format!("10.50.0.11 {name}\n"));
    let cfg = lab.config(&[(&name, PORT)], "");
    let mut tg = start_proxy(&lab, cfg.clone(), &name, &["10.50.0.11"]);
    lab.connect(&tg);
    assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.11")));

    // The answer changes; within one interval (plus the time to apply) new connections go to
    // the new address.
    lab.dnsmasq
        .set_hosts(&format!("10.50.0.12 {name}\n"), &name, &[ip("10.50.0.12")]);
    let changed = clock::now();
    let mut last = String::new();
    let moved = poll_until(INTERVAL * 3, || match lab.landing(ip(TUNNEL_V4)) {
        Ok(a) if a == ip("10.50.0.12") => true,
        other => {
            last = format!("{other:?}");
            false
        }
    });
    let took = tunnelgate::shell::clock::since(changed);
    assert!(
        moved,
        "new connections still land on {last} {:?} after the change; stderr:\n{}",
        INTERVAL * 3,
        tg.stderr()
    );
    assert!(
        took <= INTERVAL + Duration::from_millis(1500),
        "took {took:?} to follow the new answer (interval {INTERVAL:?})"
    );
    for _ in 0..5 {
        assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.12")));
    }
    wait_resolved(&tg, &name, &["10.50.0.12"]);

    // The old rule is gone: nothing mentions the old address, in the kernel or in the status.
    let after_change = lab.proxy.nft_tunnelgate_table();
    assert!(after_change.contains("10.50.0.12"), "{after_change}");
    assert!(!after_change.contains("10.50.0.11"), "{after_change}");
    let text_after_change = rules_text(&tg);
    assert!(!text_after_change.contains("10.50.0.11"));

    // And the rule set equals a fresh start with the new answer.
    assert!(tg.sigterm().success(), "stderr:\n{}", tg.stderr());
    assert_eq!(
        lab.proxy.nft_tunnelgate_table(),
        "",
        "table removed on exit"
    );
    let fresh = start_proxy(&lab, cfg, &name, &["10.50.0.12"]);
    wait_until(
        Duration::from_secs(5),
        "the fresh daemon applied rules",
        || lab.proxy.nft_tunnelgate_table().contains("10.50.0.12"),
    );
    assert_eq!(lab.proxy.nft_tunnelgate_table(), after_change);
    assert_eq!(rules_text(&fresh), text_after_change);
    let _ = &lab.dns_ns;
}

/// Thirty connections through a name with three A records: each backend sees some.
fn three_a_records(firewall: &str) {
    let name = format!("pool.{DOMAIN}");
    let lab = Lab::new(&format!(
        "10.50.0.11 {name}\n10.50.0.12 {name}\n10.50.0.13 {name}\n"
    ));
    let cfg = lab.config(&[(&name, PORT)], firewall);
    let tg = start_proxy(
        &lab,
        cfg,
        &name,
        &["10.50.0.11", "10.50.0.12", "10.50.0.13"],
    );
    lab.connect(&tg);
    let mut hits: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for i in 0..30 {
        let at = lab
            .landing(ip(TUNNEL_V4))
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        *hits.entry(at).or_default() += 1;
    }
    let backends: Vec<IpAddr> = ["10.50.0.11", "10.50.0.12", "10.50.0.13"]
        .iter()
        .map(|s| ip(s))
        .collect();
    for b in &backends {
        assert!(
            hits.get(b).copied().unwrap_or(0) >= 1,
            "backend {b} saw no connection: {hits:?}"
        );
    }
    assert_eq!(hits.values().sum::<u32>(), 30, "{hits:?}");
    assert!(hits.keys().all(|k| backends.contains(k)), "{hits:?}");
    // The server saw the same (the proxy masquerades: every source is its LAN address).
    let seen = lab.server.seen();
    assert_eq!(seen.len(), 30);
    assert!(seen.iter().all(|(_, peer)| peer.ip() == ip("10.50.0.1")));
    let _ = &lab.backend;
}

#[test]
#[ignore = "needs root"]
fn three_a_records_spread_connections_nftables() {
    three_a_records("[firewall]\nmode = \"nftables\"\n");
}

#[test]
#[ignore = "needs root"]
fn three_a_records_spread_connections_iptables() {
    three_a_records("[firewall]\nmode = \"iptables\"\n");
}

#[test]
#[ignore = "needs root"]
fn aaaa_only_name_works_over_ipv6() {
    let name = format!("v6only.{DOMAIN}");
    let lab = Lab::new(&format!("fd50::21 {name}\n"));
    let cfg = lab.config(&[(&name, PORT)], "");
    let tg = start_proxy(&lab, cfg, &name, &["fd50::21"]);
    lab.connect(&tg);
    for _ in 0..3 {
        assert_eq!(lab.landing(ip(TUNNEL_V6)), Ok(ip("fd50::21")));
    }
    let (_, peer) = lab.server.seen()[0];
    assert_eq!(peer.ip(), ip("fd50::1"), "masqueraded behind the proxy");
    let table = lab.proxy.nft_tunnelgate_table();
    assert!(table.contains("dnat ip6 to"), "{table}");
    assert!(!table.contains("dnat ip to"), "no IPv4 rule: {table}");
    // No IPv4 rule: IPv4 to the tunnel address on that port reaches nobody.
    assert!(lab.landing(ip(TUNNEL_V4)).is_err());
}

#[test]
#[ignore = "needs root"]
fn dns_outage_keeps_last_good_rules_and_recovers() {
    let name = format!("svc.{DOMAIN}");
    let mut lab = Lab::new(&format!("10.50.0.11 {name}\n"));
    let cfg = lab.config(&[(&name, PORT)], "");
    let tg = start_proxy(&lab, cfg, &name, &["10.50.0.11"]);
    lab.connect(&tg);
    assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.11")));
    let label = format!("name=\"{name}\"");
    let failures = || {
        tg.metrics()
            .ok()
            .and_then(|m| metric(&m, "tunnelgate_dns_resolution_failures_total", &label))
            .unwrap_or(-1.0)
    };
    assert_eq!(failures(), 0.0);
    let rules_before = lab.proxy.nft_tunnelgate_table();

    lab.dnsmasq.stop();
    // Retries: at least three failed resolutions, counted and logged, while traffic flows.
    let mut flowed = 0;
    let retried = poll_until(Duration::from_secs(30), || {
        if lab.landing(ip(TUNNEL_V4)) == Ok(ip("10.50.0.11")) {
            flowed += 1;
        }
        failures() >= 3.0
    });
    assert!(
        retried,
        "failures counted: {}; status {:?}; stderr:\n{}",
        failures(),
        tg.name_status(&name),
        tg.stderr()
    );
    assert!(flowed >= 1);
    for _ in 0..3 {
        assert_eq!(
            lab.landing(ip(TUNNEL_V4)),
            Ok(ip("10.50.0.11")),
            "traffic flows on the last good rules"
        );
    }
    assert_eq!(lab.proxy.nft_tunnelgate_table(), rules_before);
    let status = tg.name_status(&name).expect("name in status");
    assert!(status["last_error"].is_string(), "{status}");
    assert_eq!(tg.name_addresses(&name), ["10.50.0.11"]);
    let logged = tg
        .stderr()
        .lines()
        .filter(|l| l.contains("Resolution failed") && l.contains(name.as_str()))
        .filter(|l| l.contains("keeping the last good addresses") && l.contains("kept=1"))
        .count();
    assert!(
        logged >= 3,
        "retries logged {logged} times:\n{}",
        tg.stderr()
    );
    // Once resolved, a DNS outage does not make the proxy unready.
    assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(200));

    // dnsmasq back: the next resolution succeeds and the error is cleared.
    let resolutions_at_restart = status["resolutions"].as_u64().unwrap_or(0);
    let failures_at_restart = failures();
    lab.dnsmasq.start_again();
    wait_until(
        INTERVAL * 3,
        "a successful resolution clears last_error",
        || {
            tg.name_status(&name).is_some_and(|n| {
                n["last_error"].is_null()
                    && n["resolutions"].as_u64() > Some(resolutions_at_restart)
            })
        },
    );
    let after = tg.name_status(&name).expect("name in status");
    assert!(after["last_resolved_unix"].as_u64().is_some(), "{after}");
    assert_eq!(tg.name_addresses(&name), ["10.50.0.11"]);
    assert!(
        failures() <= failures_at_restart + 1.0,
        "failures stop growing"
    );
    assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.11")));
    assert!(
        lab.dnsmasq.logs().contains(&name),
        "the query reached dnsmasq"
    );
}

#[test]
#[ignore = "needs root"]
fn nxdomain_name_keeps_readyz_503_and_shows_in_status() {
    let good = format!("svc.{DOMAIN}");
    let missing = format!("missing.{DOMAIN}");
    let lab = Lab::new(&format!("10.50.0.11 {good}\n"));
    let cfg = lab.config(&[(&good, PORT), (&missing, 9090)], "");
    let tg = Tunnelgate::spawn(&lab.proxy, cfg);
    let nx = dns_query_in(lab.dns_ns.name(), lab.dnsmasq.addr(), &missing, QTYPE_A)
        .expect("dnsmasq answers");
    assert_eq!(nx.rcode, 3, "dnsmasq says NXDOMAIN for {missing}");

    // /readyz is never 200; once the name has failed it is 503 naming it.
    let mut codes = Vec::new();
    let named = poll_until(Duration::from_secs(15), || match tg.health_get("/readyz") {
        Ok((code, body)) => {
            codes.push(code);
            code == 503 && body.contains(&format!("dns: {missing}"))
        }
        Err(_) => false,
    });
    assert!(
        named,
        "/readyz never named {missing}: {:?}; stderr:\n{}",
        tg.health_get("/readyz"),
        tg.stderr()
    );
    assert!(!codes.contains(&200), "/readyz answered 200: {codes:?}");
    wait_resolved(&tg, &good, &["10.50.0.11"]);

    // It keeps retrying, and the status shows the error.
    wait_until(
        Duration::from_secs(15),
        "three failures of the name",
        || {
            tg.name_status(&missing)
                .is_some_and(|n| n["failures"].as_u64() >= Some(3))
        },
    );
    let n = tg.name_status(&missing).expect("missing name in status");
    assert!(
        n["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{n}"
    );
    assert!(n["last_resolved_unix"].is_null(), "{n}");
    assert_eq!(n["addresses"].as_array().map(Vec::len), Some(0), "{n}");
    let (code, body) = tg.health_get("/readyz").expect("readyz");
    assert_eq!(code, 503);
    assert!(body.contains(&format!("dns: {missing}")), "{body}");
    assert!(!body.contains(&good), "{body}");
    let text = tunnelgate_cli(&["status", "--interface", tg.name()], None);
    assert!(text.success(), "{}", text.stderr);
    assert!(text.stdout.contains(&missing), "{}", text.stdout);
    assert!(text.stdout.contains("last error:"), "{}", text.stdout);
    assert!(text.stdout.contains("resolved: never"), "{}", text.stdout);
    // The log says what a failure leaves in place: here nothing, so no "last good addresses".
    let failed: Vec<String> = tg
        .stderr()
        .lines()
        .filter(|l| l.contains("Resolution failed") && l.contains(missing.as_str()))
        .map(str::to_string)
        .collect();
    assert!(!failed.is_empty(), "no failure logged:\n{}", tg.stderr());
    for line in &failed {
        assert!(
            line.contains("the name has no address yet, so its rules wait for the first answer")
                && !line.contains("last good"),
            "{line}"
        );
    }

    // The name that did resolve is served meanwhile.
    lab.connect(&tg);
    assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.11")));
}

/// A proxy-group replica as the sidecar renders it (every rule labelled with its Service,
/// `health.readiness = "per-service"`): one Service's name is NXDOMAIN. The replica stays
/// Ready, serves the other Service through the tunnel, and shows the name on its Service in
/// `tunnelgate status` (human and JSON) and `/metrics`. (Without the policy the same name
/// keeps `/readyz` at 503: `nxdomain_name_keeps_readyz_503_and_shows_in_status`.)
#[test]
#[ignore = "needs root"]
fn unresolved_service_name_keeps_the_replica_ready_and_is_reported_per_service() {
    let good = format!("web.{DOMAIN}");
    let missing = format!("gone.{DOMAIN}");
    let lab = Lab::new(&format!("10.50.0.11 {good}\n"));
    let rules = format!(
        "[[ingress]]\ntarget_fqdn = \"{good}\"\nports = [\"{PORT}\"]\nservice = \"apps/web\"\n\n\
         [[ingress]]\ntarget_fqdn = \"{missing}\"\nports = [\"9090\"]\nservice = \"apps/gone\"\n"
    );
    let mut cfg = lab.config(&[], &rules);
    // The harness writes `[health] listen` right before `extra`: a leading key lands in [health].
    cfg.extra = format!("readiness = \"per-service\"\n\n{}", cfg.extra);
    let tg = Tunnelgate::start(&lab.proxy, cfg);
    wait_resolved(&tg, &good, &["10.50.0.11"]);
    wait_until(
        Duration::from_secs(15),
        "two failed resolutions of the missing name",
        || {
            tg.name_status(&missing)
                .is_some_and(|n| n["failures"].as_u64() >= Some(2))
        },
    );

    // Ready, and nothing about the name in the answer.
    let (code, body) = tg.health_get("/readyz").expect("readyz");
    assert_eq!(code, 200, "{body}; stderr:\n{}", tg.stderr());
    assert!(!body.contains(&missing), "{body}");

    // The other Service is served: bytes cross the tunnel from the wireguard-go peer.
    lab.connect(&tg);
    for _ in 0..3 {
        assert_eq!(lab.landing(ip(TUNNEL_V4)), Ok(ip("10.50.0.11")));
    }
    assert_eq!(lab.server.seen().len(), 3);

    // Status (JSON): per Service, and the name says readiness does not wait for it.
    let status = tg.status_json().expect("status --json");
    assert_eq!(status["ready"], true, "{status}");
    let services = status["services"].as_array().cloned().unwrap_or_default();
    let of = |svc: &str| {
        services
            .iter()
            .find(|s| s["service"] == svc)
            .cloned()
            .unwrap_or_else(|| panic!("{svc} not in {status}"))
    };
    assert_eq!(
        of("apps/gone")["unresolved_names"],
        serde_json::json!([missing])
    );
    assert_eq!(of("apps/web")["unresolved_names"], serde_json::json!([]));
    assert_eq!(of("apps/web")["names"], serde_json::json!([good]));
    let n = tg.name_status(&missing).expect("missing name in status");
    assert_eq!(n["services"], serde_json::json!(["apps/gone"]), "{n}");
    assert_eq!(n["per_service"], true, "{n}");
    assert!(
        n["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{n}"
    );

    // Status (human).
    let text = tunnelgate_cli(&["status", "--interface", tg.name()], None);
    assert!(text.success(), "{}", text.stderr);
    for line in [
        "  state: ready".to_string(),
        "services:".to_string(),
        format!("  apps/gone: unresolved {missing} (its rules wait for it)"),
        "  apps/web: names resolved".to_string(),
        "    services: apps/gone (readiness does not wait for it)".to_string(),
    ] {
        assert!(
            text.stdout.lines().any(|l| l == line),
            "{line:?} not in:\n{}",
            text.stdout
        );
    }

    // Metrics.
    let m = tg.metrics().expect("metrics");
    assert_eq!(metric(&m, "tunnelgate_ready", ""), Some(1.0), "{m}");
    assert_eq!(
        metric(
            &m,
            "tunnelgate_service_unresolved_names",
            "service=\"apps/gone\""
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "tunnelgate_service_unresolved_names",
            "service=\"apps/web\""
        ),
        Some(0.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "tunnelgate_dns_resolution_failures_total",
            &format!("name=\"{missing}\"")
        )
        .is_some_and(|f| f >= 2.0),
        "{m}"
    );
    // No rule for the missing name: nothing listens on its port.
    assert!(!lab.proxy.nft_tunnelgate_table().contains("9090"));
    let _ = (&lab.dns_ns, &lab.backend);
}

#[test]
#[ignore = "needs root"]
fn readyz_waits_for_a_slow_first_answer() {
    let name = format!("slow.{DOMAIN}");
    let lab = Lab::new(&format!("10.50.0.11 {name}\n"));
    // The name server swallows every query: the first resolution only ends with its timeout.
    lab.dns_ns.sh("nft add table inet blackhole && \
         nft add chain inet blackhole input '{ type filter hook input priority 0; }' && \
         nft add rule inet blackhole input udp dport 53 drop && \
         nft add rule inet blackhole input tcp dport 53 drop");
    let tg = Tunnelgate::spawn(&lab.proxy, lab.config(&[(&name, PORT)], ""));
    let start = clock::now();
    let mut codes = Vec::new();
    while tunnelgate::shell::clock::since(start) < Duration::from_secs(4) {
        if let Ok((code, body)) = tg.health_get("/readyz") {
            assert_ne!(
                code,
                200,
                "/readyz is 200 {:?} after start although {name} never resolved: {body}",
                tunnelgate::shell::clock::since(start)
            );
            codes.push(code);
        }
        std::thread::sleep(POLL);
    }
    assert!(codes.contains(&503), "{codes:?}");
    let n = tg
        .name_status(&name)
        .expect("the status lists the name before its first answer");
    assert!(n["last_resolved_unix"].is_null(), "{n}");
}

#[test]
#[ignore = "needs root"]
fn readyz_is_200_only_once_the_answers_are_in_the_installed_rules() {
    let name = format!("db.{DOMAIN}");
    let lab = Lab::new(&format!("10.50.0.11 {name}\n"));
    // 600 more port rules make every apply take a while: the window this test looks into.
    let ports: Vec<String> = (20000..20600).map(|p| format!("\"{p}\"")).collect();
    let extra = format!(
        "[[ingress]]\ntarget = \"10.50.0.99\"\nports = [{}]\n",
        ports.join(", ")
    );
    let tg = Tunnelgate::spawn(&lab.proxy, lab.config(&[(&name, PORT)], &extra));
    // Poll fast: the first answer used to be applied an apply's time after /readyz said 200.
    let mut first_ready = None;
    let start = clock::now();
    while first_ready.is_none() && tunnelgate::shell::clock::since(start) < Duration::from_secs(15)
    {
        if let Ok((200, _)) = tg.health_get("/readyz") {
            // What the kernel has right now, not what the daemon says.
            first_ready = Some(lab.proxy.nft_tunnelgate_table());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let installed =
        first_ready.unwrap_or_else(|| panic!("/readyz never 200; stderr:\n{}", tg.stderr()));
    assert!(
        installed.contains("10.50.0.11"),
        "/readyz said 200 before the rules for {name} were installed:\n{installed}"
    );
}

/// Without `dns.nameservers`, a short name resolves the way getaddrinfo would resolve it in a
/// pod: through resolv.conf's `search` domain (`ndots:5`). With the same server named in
/// `dns.nameservers`, names stay absolute and the short name does not resolve. The resolv.conf
/// is the test's own, via `TUNNELGATE_RESOLV_CONF` (the host's is left alone).
#[test]
#[ignore = "needs root"]
fn short_name_resolves_through_the_resolv_conf_search_domain() {
    let proxy = Netns::new();
    let dns_ns = Netns::new();
    veth(&proxy, &["10.54.0.2/24"], &dns_ns, &["10.54.0.1/24"]);
    let _dnsmasq = Dnsmasq::start(
        &dns_ns,
        ip("10.54.0.1"),
        "svc.cluster.test",
        "10.50.0.31 db.prod.svc.cluster.test\n",
    );
    let dir = TempDir::new("resolvconf");
    let resolv = dir.write(
        "resolv.conf",
        "nameserver 10.54.0.1\nsearch svc.cluster.test\noptions ndots:5\n",
    );
    let resolv = resolv.display().to_string();
    let config = |dns: &str| {
        let mut cfg = TgConfig::new(0, &["100.71.0.1/32"]);
        cfg.health = None;
        cfg.extra = format!(
            "[[ingress]]\ntarget_fqdn = \"db.prod\"\nports = [\"8080\"]\n\n[dns]\nreresolve_interval = \"2s\"\n{dns}\n"
        );
        cfg
    };
    let system = Tunnelgate::spawn_env(&proxy, config(""), &[("TUNNELGATE_RESOLV_CONF", &resolv)]);
    let explicit = Tunnelgate::spawn_env(
        &proxy,
        config("nameservers = [\"10.54.0.1\"]"),
        &[("TUNNELGATE_RESOLV_CONF", &resolv)],
    );
    let resolved = poll_until(Duration::from_secs(15), || {
        system.name_addresses("db.prod") == ["10.50.0.31"]
    });
    assert!(
        resolved,
        "db.prod via the search domain: {:?}\n{}",
        system.name_status("db.prod"),
        system.stderr()
    );
    // The explicit server answers the same question asked absolutely: no such name.
    let failed = poll_until(Duration::from_secs(15), || {
        explicit
            .name_status("db.prod")
            .is_some_and(|n| !n["last_error"].is_null())
    });
    assert!(
        failed && explicit.name_addresses("db.prod").is_empty(),
        "absolute with dns.nameservers: {:?}\n{}",
        explicit.name_status("db.prod"),
        explicit.stderr()
    );
}
