//! L3 ingress and egress through a real tunnel (issue 3) and the honesty of `/readyz` about rules
//! (issue 7), each test run once per firewall backend: nftables, iptables-nft, iptables-legacy.
//!
//! Topology (fresh namespaces per test):
//!
//! ```text
//!  client ──veth 192.168.60.0/24── proxy ──veth 10.96.0.0/24, fd96::/64── cluster
//!  wireguard-go                    tunnelgate                              backends .10 / ::10
//!  100.64.0.2, fd7a::2             100.64.0.1, fd7a::1
//!                                    └──veth 10.244.0.0/24, fd44::/64── pod (egress clients)
//! ```
//!
//! Run as root: `cargo test --test netns_forwarding -- --ignored --test-threads=1`
//! (one backend: append `nftables::`, `iptables_nft::` or `iptables_legacy::`).

mod common;

use common::*;
use serde_json::Value;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tunnelgate::clock;

const MB: u64 = 1024 * 1024;
const TG_PORT: u16 = 51820;
const WG_GO_PORT: u16 = 51821;
const HEALTH: &str = "[::]:9002";
const HEALTH_PORT: u16 = 9002;
const CLIENT_UNDERLAY: &str = "192.168.60.1";
const PROXY_UNDERLAY: &str = "192.168.60.2";
const TG_V4: &str = "100.64.0.1";
const TG_V6: &str = "fd7a::1";
const PEER_V4: &str = "100.64.0.2";
const PEER_V6: &str = "fd7a::2";
const PROXY_CLUSTER_V4: &str = "10.96.0.1";
const PROXY_CLUSTER_V6: &str = "fd96::1";
const BACKEND_V4: &str = "10.96.0.10";
const BACKEND_V6: &str = "fd96::10";
const PROXY_POD_V4: &str = "10.244.0.1";
const PROXY_POD_V6: &str = "fd44::1";
/// How long a connection that must not be forwarded is given before it counts as blocked.
const BLOCKED: Duration = Duration::from_millis(1500);

// ---------------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------------

/// The `[firewall]` section selecting `backend`.
fn firewall_toml(backend: Backend, repair_interval: &str) -> String {
    format!(
        "[firewall]\nmode = \"{}\"\nmss_clamp = true\nrepair_interval = \"{repair_interval}\"\n",
        backend.mode()
    )
}

per_backend!(
    ingress_all_ports,
    ingress_mapped_ports,
    egress_listed_ports,
    egress_all_ports_spares_daemon_ports,
    rules_idempotent_repaired_and_removed,
    mtu_mismatch_large_transfers,
    readiness_follows_rule_failures,
    tunnel_reaches_no_local_listener,
);

// ---------------------------------------------------------------------------------------------
// Topology
// ---------------------------------------------------------------------------------------------

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// The four namespaces and the wireguard-go peer (dropped first: fields drop in order).
struct Topo {
    wg: WgGo,
    client: Netns,
    proxy: Netns,
    cluster: Netns,
    pod: Netns,
    /// proxy end (`a_name`) and cluster end (`b_name`).
    cluster_link: Veth,
}

impl Topo {
    fn new(backend: Backend) -> Topo {
        require_root();
        backend.check_tools();
        let client = Netns::new();
        let proxy = Netns::new();
        let cluster = Netns::new();
        let pod = Netns::new();
        veth(
            &client,
            &[&format!("{CLIENT_UNDERLAY}/24")],
            &proxy,
            &[&format!("{PROXY_UNDERLAY}/24")],
        );
        let cluster_link = veth(
            &proxy,
            &[
                &format!("{PROXY_CLUSTER_V4}/24"),
                &format!("{PROXY_CLUSTER_V6}/64"),
            ],
            &cluster,
            &[&format!("{BACKEND_V4}/24"), &format!("{BACKEND_V6}/64")],
        );
        veth(
            &proxy,
            &[&format!("{PROXY_POD_V4}/24"), &format!("{PROXY_POD_V6}/64")],
            &pod,
            &["10.244.0.2/24", "fd44::2/64"],
        );
        pod.exec(&["ip", "route", "add", "default", "via", PROXY_POD_V4]);
        pod.exec(&["ip", "-6", "route", "add", "default", "via", PROXY_POD_V6]);
        let wg = WgGo::start(
            &client,
            WG_GO_PORT,
            &[&format!("{PEER_V4}/32"), &format!("{PEER_V6}/128")],
        );
        Topo {
            wg,
            client,
            proxy,
            cluster,
            pod,
            cluster_link,
        }
    }

    /// A tunnelgate config for the proxy: its peer is the wireguard-go client; `extra` holds
    /// `[firewall]`, `[[ingress]]`, `[[egress]]`.
    fn config(&self, extra: String) -> TgConfig {
        let mut cfg = TgConfig::new(TG_PORT, &[&format!("{TG_V4}/32"), &format!("{TG_V6}/128")])
            .peer(
                Peer::new(
                    self.wg.public_key(),
                    &[&format!("{PEER_V4}/32"), &format!("{PEER_V6}/128")],
                )
                .endpoint(&format!("{CLIENT_UNDERLAY}:{WG_GO_PORT}")),
            );
        cfg.health = Some(HEALTH.into());
        cfg.extra = extra;
        cfg
    }

    /// Starts tunnelgate with `backend`'s environment and waits until `/readyz` is 200.
    fn start(&self, backend: Backend, cfg: TgConfig) -> Tunnelgate {
        self.start_env(backend, cfg, &[])
    }

    fn start_env(&self, backend: Backend, cfg: TgConfig, env: &[(&str, &str)]) -> Tunnelgate {
        let mut all = backend.env();
        all.extend_from_slice(env);
        let tg = Tunnelgate::spawn_env(&self.proxy, cfg, &all);
        if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
            panic!("{e}");
        }
        tg
    }

    /// Points the client at tunnelgate (routes to its tunnel addresses, plus `extra` networks)
    /// and waits until a ping through the tunnel answers: the handshake is done.
    fn connect_client(&self, tg: &Tunnelgate, extra: &[&str]) {
        let mut nets = vec![format!("{TG_V4}/32"), format!("{TG_V6}/128")];
        nets.extend(extra.iter().map(|s| s.to_string()));
        let nets: Vec<&str> = nets.iter().map(String::as_str).collect();
        self.wg.add_peer(
            &Peer::new(tg.public_key(), &nets).endpoint(&format!("{PROXY_UNDERLAY}:{TG_PORT}")),
        );
        assert!(
            ping_until(&self.client, TG_V4, Duration::from_secs(15)),
            "no ping through the tunnel to {TG_V4}; tunnelgate stderr:\n{}",
            tg.stderr()
        );
        assert!(
            ping_until(&self.client, TG_V6, Duration::from_secs(5)),
            "no IPv6 ping through the tunnel to {TG_V6}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Traffic checks
// ---------------------------------------------------------------------------------------------

/// A TCP echo round trip from `ns` to `to` must succeed.
fn echo_ok(ns: &Netns, to: SocketAddr, what: &str) {
    let payload = format!("tunnelgate test: {what}");
    let mut last = String::new();
    // The first connection may race a handshake: retry briefly.
    let ok = poll_until(Duration::from_secs(5), || {
        match tcp_roundtrip(ns, to, payload.as_bytes(), Duration::from_secs(3)) {
            Ok(back) if back == payload.as_bytes() => true,
            Ok(back) => {
                last = format!("echo returned {:?}", String::from_utf8_lossy(&back));
                false
            }
            Err(e) => {
                last = e;
                false
            }
        }
    });
    assert!(ok, "{what}: TCP echo via {to} failed: {last}");
}

/// A UDP echo round trip from `ns` to `to` must succeed.
fn udp_ok(ns: &Netns, to: SocketAddr, what: &str) {
    let payload = format!("tunnelgate udp test: {what}");
    let reply = udp_roundtrip(ns, to, payload.as_bytes(), Duration::from_secs(5));
    assert_eq!(
        reply.as_deref(),
        Some(payload.as_bytes()),
        "{what}: UDP echo via {to} failed"
    );
}

/// A TCP connection from `ns` to `to` must not get through (refused or timed out).
fn tcp_blocked(ns: &Netns, to: SocketAddr, what: &str) -> String {
    let r = tcp_roundtrip(ns, to, b"must not arrive", BLOCKED);
    assert!(
        r.is_err(),
        "{what}: {to} answered {r:?}, expected no forwarding"
    );
    r.err().unwrap_or_default()
}

/// Every source address `seen` is exactly `want`.
fn all_from(seen: &[SocketAddr], want: &str, what: &str) {
    assert!(!seen.is_empty(), "{what}: the server saw no client");
    for s in seen {
        assert_eq!(
            s.ip(),
            ip(want),
            "{what}: source seen by the server {seen:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Rule inspection
// ---------------------------------------------------------------------------------------------

/// Removes what changes without the rules changing: handles, counters, nft's metainfo.
fn strip_volatile(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.remove("handle");
            if let Some(Value::Object(c)) = map.get_mut("counter") {
                c.insert("packets".into(), 0.into());
                c.insert("bytes".into(), 0.into());
            }
            for x in map.values_mut() {
                strip_volatile(x);
            }
        }
        Value::Array(items) => {
            items.retain(|i| i.get("metainfo").is_none());
            for x in items {
                strip_volatile(x);
            }
        }
        _ => {}
    }
}

/// Drops `[packets:bytes]` counters from an iptables-save line.
fn strip_counters(line: &str) -> String {
    let is_counter = |s: &str| {
        s.split(':').count() == 2
            && s.split(':')
                .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(i) = rest.find('[') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        match tail.find(']') {
            Some(j) if is_counter(&tail[1..j]) => rest = &tail[j + 1..],
            _ => {
                out.push('[');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out.trim_end().to_string()
}

/// `iptables-save` of one family as `(table, line)` pairs, counters stripped.
fn iptables_lines(ns: &Netns, backend: Backend, v6: bool) -> Vec<(String, String)> {
    let text = ns.exec(&[backend.iptables_save(v6)]);
    let mut table = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_string();
        } else if line.starts_with('-') || line.starts_with(':') {
            out.push((table.clone(), strip_counters(line)));
        }
    }
    out
}

/// Whether an `iptables-save` line declares, fills or jumps to a tunnelgate chain
/// (`TG-<iface>-*`).
fn is_tunnelgate_line(line: &str) -> bool {
    line.split_whitespace()
        .any(|w| w.trim_start_matches(':').starts_with("TG-"))
}

/// Everything of tunnelgate's that is installed, normalized: the `nft -j` listing of its table
/// `tunnelgate_<iface>` (minus handles and counters), or its `TG-<iface>-*` chains and jumps in
/// both families' `iptables-save`. Empty when nothing of it is installed. One daemon per
/// namespace in this suite, so every tunnelgate table or chain is that daemon's.
fn owned_rules(ns: &Netns, backend: Backend) -> String {
    match backend {
        Backend::Nftables => {
            let mut out = String::new();
            for table in ns.nft_tunnelgate_tables() {
                if let Ok(json) = ns.try_exec(&["nft", "-j", "list", "table", "inet", &table]) {
                    let mut v: Value = serde_json::from_str(&json).expect("nft -j output is JSON");
                    strip_volatile(&mut v);
                    out += &serde_json::to_string_pretty(&v).expect("json");
                }
            }
            out
        }
        _ => {
            let mut out = String::new();
            for v6 in [false, true] {
                for (table, line) in iptables_lines(ns, backend, v6) {
                    if is_tunnelgate_line(&line) {
                        out.push_str(&format!("{} {table}: {line}\n", if v6 { 6 } else { 4 }));
                    }
                }
            }
            out
        }
    }
}

/// The installed rules as readable lines (one per rule or jump), for counting.
fn owned_rule_lines(ns: &Netns, backend: Backend) -> Vec<String> {
    match backend {
        Backend::Nftables => ns
            .nft_tunnelgate_table()
            .lines()
            .map(str::trim)
            .filter(|l| {
                !l.is_empty()
                    && !l.starts_with("table ")
                    && !l.starts_with("chain ")
                    && !l.starts_with("type ")
                    && *l != "}"
            })
            .map(String::from)
            .collect(),
        _ => owned_rules(ns, backend)
            .lines()
            .filter(|l| l.contains(" -A "))
            .map(String::from)
            .collect(),
    }
}

/// Everything installed that is *not* tunnelgate's (normalized), to prove it is left alone.
fn foreign_rules(ns: &Netns, backend: Backend) -> String {
    match backend {
        Backend::Nftables => {
            let json = ns.exec(&["nft", "-j", "list", "ruleset"]);
            let mut v: Value = serde_json::from_str(&json).expect("nft -j output is JSON");
            if let Some(items) = v.get_mut("nftables").and_then(Value::as_array_mut) {
                items.retain(|i| {
                    !i.as_object()
                        .and_then(|o| o.values().next())
                        .is_some_and(|o| {
                            let ours = |k: &str| {
                                o.get(k)
                                    .and_then(Value::as_str)
                                    .is_some_and(|t| t.starts_with("tunnelgate_"))
                            };
                            ours("table") || ours("name")
                        })
                });
            }
            strip_volatile(&mut v);
            serde_json::to_string_pretty(&v).expect("json")
        }
        _ => {
            const BUILTIN: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
            let mut out = String::new();
            for v6 in [false, true] {
                for (table, line) in iptables_lines(ns, backend, v6) {
                    if is_tunnelgate_line(&line) {
                        continue;
                    }
                    // Built-in chains appear or not depending on whether the table was used;
                    // their rules are what matters.
                    let builtin_decl = line
                        .strip_prefix(':')
                        .and_then(|l| l.split_whitespace().next())
                        .is_some_and(|c| BUILTIN.contains(&c));
                    if !builtin_decl {
                        out.push_str(&format!("{} {table}: {line}\n", if v6 { 6 } else { 4 }));
                    }
                }
            }
            out
        }
    }
}

/// Installs rules that tunnelgate does not own, before it starts.
fn add_foreign_rules(ns: &Netns, backend: Backend) {
    match backend {
        Backend::Nftables => {
            ns.exec(&["nft", "add", "table", "inet", "foreign"]);
            ns.exec(&["nft", "add", "chain", "inet", "foreign", "c"]);
            ns.exec(&["nft", "add", "rule", "inet", "foreign", "c", "counter"]);
            ns.exec(&[
                "nft",
                "add chain inet foreign fwd_hook { type filter hook forward priority 10; policy accept; }",
            ]);
            ns.exec(&[
                "nft",
                "add",
                "rule",
                "inet",
                "foreign",
                "fwd_hook",
                "ip saddr 198.51.100.0/24 counter accept",
            ]);
        }
        _ => {
            for (v6, net) in [(false, "198.51.100.0/24"), (true, "2001:db8::/32")] {
                let ipt = backend.iptables(v6);
                ns.exec(&[ipt, "-A", "FORWARD", "-s", net, "-j", "ACCEPT"]);
                ns.exec(&[ipt, "-t", "nat", "-N", "FOREIGN-NAT"]);
                ns.exec(&[
                    ipt,
                    "-t",
                    "nat",
                    "-A",
                    "FOREIGN-NAT",
                    "-s",
                    net,
                    "-j",
                    "RETURN",
                ]);
                ns.exec(&[ipt, "-t", "nat", "-A", "PREROUTING", "-j", "FOREIGN-NAT"]);
                ns.exec(&[
                    ipt, "-t", "mangle", "-A", "FORWARD", "-s", net, "-j", "ACCEPT",
                ]);
            }
        }
    }
}

/// Nothing of tunnelgate's in any table of either iptables flavour or nftables.
fn assert_nothing_of_ours(ns: &Netns, backend: Backend, when: &str) {
    assert_eq!(
        owned_rules(ns, backend),
        "",
        "{when}: tunnelgate's rules remain"
    );
    let ruleset = ns.exec(&["nft", "list", "ruleset"]);
    assert!(
        !ruleset.contains("tunnelgate_") && !ruleset.contains("TG-"),
        "{when}: nft list ruleset still has tunnelgate's rules:\n{ruleset}"
    );
    if backend.is_iptables() {
        for v6 in [false, true] {
            let save = ns.exec(&[backend.iptables_save(v6)]);
            assert!(
                !save.lines().any(is_tunnelgate_line),
                "{when}: {} still lists tunnelgate's chains:\n{save}",
                backend.iptables_save(v6)
            );
        }
    }
}

/// Lines that appear more than once.
fn duplicates(lines: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut dups: Vec<String> = lines
        .iter()
        .filter(|l| !seen.insert(l.as_str()))
        .cloned()
        .collect();
    dups.dedup();
    dups
}

/// Waits until the installed rules equal `want`; panics with both on timeout.
fn wait_rules_equal(ns: &Netns, backend: Backend, want: &str, timeout: Duration, what: &str) {
    let mut now = String::new();
    let ok = poll_until(timeout, || {
        now = owned_rules(ns, backend);
        now == want
    });
    assert!(
        ok,
        "{what}: rules differ from a fresh start after {timeout:?}\n--- fresh\n{want}\n--- now\n{now}"
    );
}

/// The MSS clamp rules: exactly one per direction (per family for iptables), one jump each.
fn assert_mss_once(ns: &Netns, backend: Backend, iface: &str) {
    let lines = owned_rule_lines(ns, backend);
    match backend {
        Backend::Nftables => {
            let mss: Vec<&String> = lines.iter().filter(|l| l.contains("maxseg")).collect();
            assert_eq!(mss.len(), 2, "MSS clamp rules: {mss:#?}");
            assert_eq!(
                mss.iter()
                    .filter(|l| l.contains(&format!("iifname \"{iface}\"")))
                    .count(),
                1,
                "one clamp for packets from the tunnel: {mss:#?}"
            );
            assert_eq!(
                mss.iter()
                    .filter(|l| l.contains(&format!("oifname \"{iface}\"")))
                    .count(),
                1,
                "one clamp for packets into the tunnel: {mss:#?}"
            );
        }
        _ => {
            for fam in ["4 ", "6 "] {
                let mss: Vec<&String> = lines
                    .iter()
                    .filter(|l| l.starts_with(fam) && l.contains("TCPMSS"))
                    .collect();
                assert_eq!(mss.len(), 2, "IPv{fam}MSS clamp rules: {mss:#?}");
                assert_eq!(
                    mss.iter()
                        .filter(|l| l.contains(&format!(" -i {iface} ")))
                        .count(),
                    1,
                    "IPv{fam}one clamp for packets from the tunnel: {mss:#?}"
                );
                assert_eq!(
                    mss.iter()
                        .filter(|l| l.contains(&format!(" -o {iface} ")))
                        .count(),
                    1,
                    "IPv{fam}one clamp for packets into the tunnel: {mss:#?}"
                );
                let jump = format!("-A FORWARD -j TG-{iface}-MSS");
                let jumps = lines
                    .iter()
                    .filter(|l| l.starts_with(fam) && l.ends_with(&jump))
                    .count();
                assert_eq!(jumps, 1, "IPv{fam}jumps to TG-{iface}-MSS: {lines:#?}");
            }
        }
    }
}

/// Deletes one of the rules of the daemon for `iface` by hand (and for iptables a jump too).
fn delete_a_rule(ns: &Netns, backend: Backend, iface: &str) {
    let table = format!("tunnelgate_{iface}");
    match backend {
        Backend::Nftables => {
            let json = ns.exec(&[
                "nft",
                "-j",
                "-a",
                "list",
                "chain",
                "inet",
                &table,
                "prerouting",
            ]);
            let v: Value = serde_json::from_str(&json).expect("nft -j output is JSON");
            let handle = v["nftables"]
                .as_array()
                .into_iter()
                .flatten()
                .find_map(|i| i.get("rule").and_then(|r| r.get("handle")).cloned())
                .expect("a rule in chain prerouting");
            ns.exec(&[
                "nft",
                "delete",
                "rule",
                "inet",
                &table,
                "prerouting",
                "handle",
                &handle.to_string(),
            ]);
        }
        _ => {
            ns.exec(&[
                backend.iptables(false),
                "-t",
                "nat",
                "-D",
                &format!("TG-{iface}-PRE"),
                "1",
            ]);
            ns.exec(&[
                backend.iptables(true),
                "-t",
                "mangle",
                "-D",
                "FORWARD",
                "-j",
                &format!("TG-{iface}-MSS"),
            ]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Daemon observations
// ---------------------------------------------------------------------------------------------

/// The sum of every series of `name` in `/metrics` (0 when absent).
fn metric_now(tg: &Tunnelgate, name: &str) -> f64 {
    metric_sum(&scrape(tg), name)
}

fn scrape(tg: &Tunnelgate) -> String {
    tg.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}"))
}

/// `tunnelgate status --json` of the running daemon.
fn status_json(tg: &Tunnelgate) -> Value {
    let out = tunnelgate_cli(&["status", "--json", "--interface", tg.name()], None);
    assert!(out.success(), "tunnelgate status --json: {}", out.stderr);
    serde_json::from_str(&out.stdout).expect("status --json is JSON")
}

/// Waits until `/metrics` shows `name` (for our backend) at least `at_least`.
fn wait_metric(tg: &Tunnelgate, name: &str, at_least: f64, what: &str) {
    let mut last = 0.0;
    let ok = poll_until(Duration::from_secs(10), || {
        last = metric_now(tg, name);
        last >= at_least
    });
    assert!(
        ok,
        "{what}: {name} stayed at {last}, expected >= {at_least}"
    );
}

// ---------------------------------------------------------------------------------------------
// Configuration snippets
// ---------------------------------------------------------------------------------------------

fn ports_toml(ports: &[&str]) -> String {
    if ports.is_empty() {
        String::new()
    } else {
        let q: Vec<String> = ports.iter().map(|p| format!("{p:?}")).collect();
        format!("ports = [{}]\n", q.join(", "))
    }
}

/// `[[ingress]]` to the IPv4 and the IPv6 backend.
fn ingress_toml(ports: &[&str]) -> String {
    let p = ports_toml(ports);
    format!(
        "[[ingress]]\ntarget = \"{BACKEND_V4}\"\n{p}\n[[ingress]]\ntarget = \"{BACKEND_V6}\"\n{p}\n"
    )
}

/// `[[egress]]` to the wireguard-go peer's IPv4 and IPv6 tunnel addresses.
fn egress_toml(ports: &[&str]) -> String {
    let p = ports_toml(ports);
    format!("[[egress]]\ntarget = \"{PEER_V4}\"\n{p}\n[[egress]]\ntarget = \"{PEER_V6}\"\n{p}\n")
}

// ---------------------------------------------------------------------------------------------
// 1. Ingress, every port
// ---------------------------------------------------------------------------------------------

/// From the tunnel, any TCP or UDP port of tunnelgate's tunnel address (v4 and v6) reaches the
/// backend in the cluster, which sees the proxy's cluster-side address (masquerade).
fn ingress_all_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            ingress_toml(&[])
        )),
    );
    let tcp4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 7000));
    let tcp4b = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 22222));
    let tcp6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 7000));
    let udp4 = UdpEcho::start(&t.cluster, sa(BACKEND_V4, 5353));
    let udp6 = UdpEcho::start(&t.cluster, sa(BACKEND_V6, 5353));
    t.connect_client(&tg, &[]);

    echo_ok(&t.client, sa(TG_V4, 7000), "ingress v4 tcp 7000");
    echo_ok(&t.client, sa(TG_V4, 22222), "ingress v4 tcp 22222");
    echo_ok(&t.client, sa(TG_V6, 7000), "ingress v6 tcp 7000");
    udp_ok(&t.client, sa(TG_V4, 5353), "ingress v4 udp 5353");
    udp_ok(&t.client, sa(TG_V6, 5353), "ingress v6 udp 5353");

    all_from(&tcp4.seen(), PROXY_CLUSTER_V4, "v4 tcp backend");
    all_from(&tcp4b.seen(), PROXY_CLUSTER_V4, "v4 tcp backend, 2nd port");
    all_from(&tcp6.seen(), PROXY_CLUSTER_V6, "v6 tcp backend");
    all_from(&udp4.seen(), PROXY_CLUSTER_V4, "v4 udp backend");
    all_from(&udp6.seen(), PROXY_CLUSTER_V6, "v6 udp backend");
    drop(tg);
}

// ---------------------------------------------------------------------------------------------
// 2. Ingress, mapped ports
// ---------------------------------------------------------------------------------------------

/// `ports = ["443:8443", "53/udp"]`: 443 reaches the backend's 8443, UDP 53 its 53; port 80,
/// TCP 53 and 8443 on the tunnel address are not forwarded, and neither is traffic from the
/// tunnel straight to the cluster network.
fn ingress_mapped_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            ingress_toml(&["443:8443", "53/udp"])
        )),
    );
    let https4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 8443));
    let https6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 8443));
    let dns4 = UdpEcho::start(&t.cluster, sa(BACKEND_V4, 53));
    let dns6 = UdpEcho::start(&t.cluster, sa(BACKEND_V6, 53));
    let decoys: Vec<TcpEcho> = [
        sa(BACKEND_V4, 80),
        sa(BACKEND_V6, 80),
        sa(BACKEND_V4, 443),
        sa(BACKEND_V6, 443),
        sa(BACKEND_V4, 53),
    ]
    .into_iter()
    .map(|a| TcpEcho::start(&t.cluster, a))
    .collect();
    // The client may also send to the cluster network through the tunnel: only the listed
    // ports of tunnelgate's own address may be forwarded.
    t.connect_client(&tg, &["10.96.0.0/24", "fd96::/64"]);

    echo_ok(&t.client, sa(TG_V4, 443), "ingress v4 443 -> 8443");
    echo_ok(&t.client, sa(TG_V6, 443), "ingress v6 443 -> 8443");
    udp_ok(&t.client, sa(TG_V4, 53), "ingress v4 udp 53");
    udp_ok(&t.client, sa(TG_V6, 53), "ingress v6 udp 53");
    all_from(&https4.seen(), PROXY_CLUSTER_V4, "v4 backend 8443");
    all_from(&https6.seen(), PROXY_CLUSTER_V6, "v6 backend 8443");
    all_from(&dns4.seen(), PROXY_CLUSTER_V4, "v4 backend udp 53");
    all_from(&dns6.seen(), PROXY_CLUSTER_V6, "v6 backend udp 53");

    let started = clock::now();
    tcp_blocked(&t.client, sa(TG_V4, 80), "unlisted v4 port 80");
    tcp_blocked(&t.client, sa(TG_V6, 80), "unlisted v6 port 80");
    tcp_blocked(
        &t.client,
        sa(TG_V4, 8443),
        "v4 target port 8443 is not a listen port",
    );
    tcp_blocked(
        &t.client,
        sa(TG_V4, 53),
        "v4 TCP 53 (only UDP 53 is listed)",
    );
    assert!(
        started.elapsed() < BLOCKED * 2,
        "unlisted ports on tunnelgate's own address should fail fast (refused), took {:?}",
        started.elapsed()
    );
    // Routed into the tunnel by the client, dropped by the proxy (not unroutable).
    let e = tcp_blocked(
        &t.client,
        sa(BACKEND_V4, 8443),
        "tunnel -> cluster v4, not DNATed",
    );
    assert!(
        e.contains("timed out"),
        "tunnel -> cluster v4: expected a drop, got {e}"
    );
    // Routed into the tunnel by the client, dropped by the proxy (not unroutable).
    let e = tcp_blocked(
        &t.client,
        sa(BACKEND_V6, 8443),
        "tunnel -> cluster v6, not DNATed",
    );
    assert!(
        e.contains("timed out"),
        "tunnel -> cluster v6: expected a drop, got {e}"
    );
    for d in &decoys {
        assert!(
            d.seen().is_empty(),
            "{} got connections {:?}: an unlisted port was forwarded",
            d.addr(),
            d.seen()
        );
    }
    assert_eq!(
        https4.seen().len(),
        1,
        "only the DNATed v4 connection reached 8443"
    );
    assert_eq!(
        https6.seen().len(),
        1,
        "only the DNATed v6 connection reached 8443"
    );
    drop(tg);
}

// ---------------------------------------------------------------------------------------------
// 3. Egress
// ---------------------------------------------------------------------------------------------

/// `GET /healthz` on the pod-side address answers tunnelgate's own "ok".
fn health_answers_locally(t: &Topo, addr: SocketAddr) {
    let r = http_get_ns(&t.pod, addr, "/healthz");
    assert_eq!(
        r,
        Ok((200, "ok\n".to_string())),
        "GET /healthz on {addr} from the pod must be answered by tunnelgate itself"
    );
}

/// `ports = ["5432", "8080:80"]`: a pod reaches the server on the wireguard-go peer's tunnel
/// address through the proxy's pod-side address (v4 and v6), the server sees tunnelgate's
/// tunnel address; other ports are not captured and the health port answers locally.
fn egress_listed_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            egress_toml(&["5432", "8080:80"])
        )),
    );
    let pg4 = TcpEcho::start(&t.client, sa(PEER_V4, 5432));
    let pg6 = TcpEcho::start(&t.client, sa(PEER_V6, 5432));
    let web4 = TcpEcho::start(&t.client, sa(PEER_V4, 80));
    let web6 = TcpEcho::start(&t.client, sa(PEER_V6, 80));
    let decoys: Vec<TcpEcho> = [
        sa(PEER_V4, 9999),
        sa(PEER_V4, HEALTH_PORT),
        sa(PEER_V6, 8080),
    ]
    .into_iter()
    .map(|a| TcpEcho::start(&t.client, a))
    .collect();
    t.connect_client(&tg, &[]);

    echo_ok(&t.pod, sa(PROXY_POD_V4, 5432), "egress v4 5432");
    echo_ok(&t.pod, sa(PROXY_POD_V4, 8080), "egress v4 8080 -> 80");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 5432), "egress v6 5432");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 8080), "egress v6 8080 -> 80");
    all_from(&pg4.seen(), TG_V4, "v4 server on 5432");
    all_from(&web4.seen(), TG_V4, "v4 server on 80");
    all_from(&pg6.seen(), TG_V6, "v6 server on 5432");
    all_from(&web6.seen(), TG_V6, "v6 server on 80");

    tcp_blocked(&t.pod, sa(PROXY_POD_V4, 9999), "unlisted egress port 9999");
    health_answers_locally(&t, sa(PROXY_POD_V4, HEALTH_PORT));
    health_answers_locally(&t, sa(PROXY_POD_V6, HEALTH_PORT));
    for d in &decoys {
        assert!(
            d.seen().is_empty(),
            "{} got connections {:?}: egress captured a port it does not list",
            d.addr(),
            d.seen()
        );
    }
    drop(tg);
}

/// Egress without `ports` owns every port of the pod-side address, except the daemon's own:
/// the health port still answers locally (a decoy on the peer's address stays untouched) and the
/// WireGuard port still takes the client's handshake (otherwise the tunnel would not come up).
fn egress_all_ports_spares_daemon_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            egress_toml(&[])
        )),
    );
    let decoy4 = TcpEcho::start(&t.client, sa(PEER_V4, HEALTH_PORT));
    let decoy6 = TcpEcho::start(&t.client, sa(PEER_V6, HEALTH_PORT));
    let tcp4 = TcpEcho::start(&t.client, sa(PEER_V4, 7000));
    let tcp6 = TcpEcho::start(&t.client, sa(PEER_V6, 7000));
    let udp4 = UdpEcho::start(&t.client, sa(PEER_V4, 5353));
    let udp6 = UdpEcho::start(&t.client, sa(PEER_V6, 5353));
    // The client initiates the handshake to the proxy's underlay address: a packet from a
    // non-tunnel interface to a local address, i.e. exactly what egress captures, unless the
    // WireGuard port is exempt.
    t.connect_client(&tg, &[]);

    echo_ok(&t.pod, sa(PROXY_POD_V4, 7000), "egress v4 tcp, all ports");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 7000), "egress v6 tcp, all ports");
    udp_ok(&t.pod, sa(PROXY_POD_V4, 5353), "egress v4 udp, all ports");
    udp_ok(&t.pod, sa(PROXY_POD_V6, 5353), "egress v6 udp, all ports");
    all_from(&tcp4.seen(), TG_V4, "v4 tcp server");
    all_from(&tcp6.seen(), TG_V6, "v6 tcp server");
    all_from(&udp4.seen(), TG_V4, "v4 udp server");
    all_from(&udp6.seen(), TG_V6, "v6 udp server");

    health_answers_locally(&t, sa(PROXY_POD_V4, HEALTH_PORT));
    health_answers_locally(&t, sa(PROXY_POD_V6, HEALTH_PORT));
    assert!(
        decoy4.seen().is_empty() && decoy6.seen().is_empty(),
        "the health port was redirected to the peer: {:?} {:?}",
        decoy4.seen(),
        decoy6.seen()
    );
    // Loopback on the proxy is never captured either.
    assert_eq!(
        http_get_ns(&t.proxy, sa("127.0.0.1", HEALTH_PORT), "/healthz"),
        Ok((200, "ok\n".to_string()))
    );
    drop(tg);
}

// ---------------------------------------------------------------------------------------------
// 4. Idempotency, drift repair, removal
// ---------------------------------------------------------------------------------------------

/// The rule set after a reapply, a restart and a `kill -9` + start is byte-for-byte the one a
/// fresh start installs; a rule deleted by hand comes back; SIGTERM removes everything of ours
/// and nothing else.
fn rules_idempotent_repaired_and_removed(backend: Backend) {
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
fn tunnelgate_cli_in(ns: &Netns, args: &[&str]) -> CmdOutput {
    let mut full = vec![tunnelgate_bin()];
    full.extend_from_slice(args);
    ns.output(&full)
}

// ---------------------------------------------------------------------------------------------
// 5. MTU mismatch
// ---------------------------------------------------------------------------------------------

/// Tunnel MTU 1280 (wireguard-go keeps its 1420), cluster link 1500 then 9000: 50 MB uploads and
/// downloads through ingress arrive intact; the MSS clamp is installed once per direction.
fn mtu_mismatch_large_transfers(backend: Backend) {
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

// ---------------------------------------------------------------------------------------------
// 6. Readiness follows rule failures (issue 7)
// ---------------------------------------------------------------------------------------------

/// Finds `program` on the test's PATH.
fn which(program: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} not found"))
}

/// Writes `dir/<program>` scripts that run the real program unless `flag` exists, in which
/// case they fail with a message, as a broken backend would.
fn failing_wrappers(dir: &TempDir, programs: &[&str], flag: &Path) {
    for p in programs {
        let real = which(p);
        dir.write_mode(
            p,
            &format!(
                "#!/bin/sh\nif [ -e '{}' ]; then\n  echo '{p}: injected failure (tunnelgate test)' >&2\n  exit 1\nfi\nexec '{}' \"$@\"\n",
                flag.display(),
                real.display()
            ),
            0o755,
        );
    }
}

/// With the backend's apply program failing, a hand-made drift cannot be repaired: `/readyz`
/// goes to 503 naming the rules, the failure counter moves; once the program works again the
/// rules come back and `/readyz` is 200.
fn readiness_follows_rule_failures(backend: Backend) {
    let t = Topo::new(backend);
    let bin = TempDir::new("fakebin");
    let flag = bin.path().join("fail");
    failing_wrappers(&bin, backend.apply_programs(), &flag);
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
    );
    let mut tg = t.start_env(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "1s"),
            ingress_toml(&["443:8443"])
        )),
        &[("PATH", &path)],
    );
    let fresh = owned_rules(&t.proxy, backend);
    assert!(!fresh.is_empty());
    assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(200));
    let m = scrape(&tg);
    let failures = metric_sum(&m, "tunnelgate_rule_apply_failures_total");
    assert_eq!(failures, 0.0, "no failures yet:\n{m}");
    assert!(
        m.contains(&format!("backend=\"{}\"", backend.label())),
        "rule metrics carry backend {}:\n{m}",
        backend.label()
    );

    // Break the backend, then drift the rules.
    std::fs::write(&flag, "").expect("flag file");
    match backend {
        Backend::Nftables => {
            let table = format!("tunnelgate_{}", tg.name());
            t.proxy.exec(&["nft", "delete", "table", "inet", &table]);
        }
        _ => delete_a_rule(&t.proxy, backend, tg.name()),
    }
    let mut last = None;
    let went_down = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let down = matches!(&r, Ok((503, body)) if body.contains("rules"));
        last = Some(r);
        down
    });
    assert!(
        went_down,
        "/readyz did not go to 503 naming the rules: {last:?}\nstderr:\n{}",
        tg.stderr()
    );
    eprintln!("{backend:?}: /readyz while broken: {last:?}");
    // The reason is the backend's own error message, not a side effect of how it failed.
    assert!(
        matches!(&last, Some(Ok((_, body))) if body.contains("injected failure")),
        "/readyz should carry the failing program's message: {last:?}"
    );
    let m = scrape(&tg);
    assert!(
        metric_sum(&m, "tunnelgate_rule_apply_failures_total") > failures,
        "tunnelgate_rule_apply_failures_total did not move:\n{m}"
    );
    assert_eq!(
        metric_sum(&m, "tunnelgate_rules_applied"),
        0.0,
        "rules_applied:\n{m}"
    );
    assert_eq!(metric_sum(&m, "tunnelgate_ready"), 0.0, "ready gauge:\n{m}");
    // It stays down while the backend fails (the repair keeps failing).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(503));

    // Fix the backend: the next repair restores the rules and readiness.
    std::fs::remove_file(&flag).expect("remove flag");
    let mut last = None;
    let back = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let ok = matches!(r, Ok((200, _)));
        last = Some(r);
        ok
    });
    assert!(back, "/readyz did not come back to 200: {last:?}");
    wait_rules_equal(
        &t.proxy,
        backend,
        &fresh,
        Duration::from_secs(5),
        "after repair",
    );
    let m = scrape(&tg);
    assert_eq!(
        metric_sum(&m, "tunnelgate_rules_applied"),
        1.0,
        "rules_applied:\n{m}"
    );

    // A reload while the backend fails: the running rules stay exactly as they are and keep
    // carrying traffic, readiness names the failure, and the new rule arrives once the tool
    // works again.
    let _https = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 8443));
    let _alt = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 9443));
    t.connect_client(&tg, &[]);
    echo_ok(&t.client, sa(TG_V4, 443), "443 before the failing reload");
    std::fs::write(&flag, "").expect("flag file");
    let mut changed = tg.cfg.clone();
    changed.extra = format!(
        "{}\n{}",
        firewall_toml(backend, "1s"),
        ingress_toml(&["443:8443", "9443"])
    );
    tg.write_config(changed);
    tg.sighup();
    let mut last = None;
    let refused = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let down = matches!(&r, Ok((503, body)) if body.contains("injected failure"));
        last = Some(r);
        down
    });
    assert!(refused, "/readyz during the failing reload: {last:?}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        owned_rules(&t.proxy, backend),
        fresh,
        "the rules running before the failing reload are untouched"
    );
    echo_ok(&t.client, sa(TG_V4, 443), "443 while the backend fails");
    tcp_blocked(&t.client, sa(TG_V4, 9443), "9443 before it is applied");
    std::fs::remove_file(&flag).expect("remove flag");
    let back = poll_until(Duration::from_secs(35), || {
        matches!(tg.health_get("/readyz"), Ok((200, _)))
    });
    assert!(back, "/readyz after the backend works again");
    assert_ne!(owned_rules(&t.proxy, backend), fresh, "the reload's rules");
    echo_ok(&t.client, sa(TG_V4, 443), "443 after recovery");
    echo_ok(
        &t.client,
        sa(TG_V4, 9443),
        "9443, the reloaded rule, after recovery",
    );
    drop(tg);
}

// ---------------------------------------------------------------------------------------------
// Issue 15: the input guard
// ---------------------------------------------------------------------------------------------

/// With the health endpoint on every address (`[::]:9002`) and ingress on one port, a tunnel
/// peer reaches neither `/metrics` nor any other TCP or UDP listener of the proxy host, on
/// either family, while ingress, ping, the host's own `/readyz` and the host's own
/// connections through the tunnel keep working. `health.allow_from_tunnel = true`, applied
/// by a reload, opens the health port to the tunnel: the blocked requests were real ones.
fn tunnel_reaches_no_local_listener(backend: Backend) {
    let t = Topo::new(backend);
    let body = format!(
        "{}\n{}",
        firewall_toml(backend, "10s"),
        ingress_toml(&["7000"])
    );
    let mut tg = t.start(backend, t.config(body));
    let ingress4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 7000));
    let _ingress6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 7000));
    // Listeners of the proxy host itself, on every address.
    let _local_tcp4 = TcpEcho::start(&t.proxy, sa("0.0.0.0", 7001));
    let _local_tcp6 = TcpEcho::start(&t.proxy, sa("::", 7002));
    let _local_udp4 = UdpEcho::start(&t.proxy, sa("0.0.0.0", 5301));
    let _local_udp6 = UdpEcho::start(&t.proxy, sa("::", 5302));
    // A server on the peer's side, for the proxy host's own connection through the tunnel.
    let _peer_server = TcpEcho::start(&t.client, sa(PEER_V4, 7100));
    // The peer may also send to the proxy's cluster-side address through the tunnel.
    t.connect_client(&tg, &[&format!("{PROXY_CLUSTER_V4}/32")]);

    echo_ok(&t.client, sa(TG_V4, 7000), "ingress v4 still works");
    echo_ok(&t.client, sa(TG_V6, 7000), "ingress v6 still works");
    all_from(&ingress4.seen(), PROXY_CLUSTER_V4, "v4 ingress backend");
    echo_ok(
        &t.proxy,
        sa(PEER_V4, 7100),
        "the host's own connection through the tunnel",
    );
    assert_eq!(
        tg.health_get("/readyz").map(|(s, _)| s),
        Ok(200),
        "the host's own /readyz"
    );
    // The host's own /metrics on its tunnel address works too (from the host, not the tunnel).
    let own = http_get_in(t.proxy.name(), sa(TG_V4, HEALTH_PORT), "/metrics", BLOCKED);
    assert_eq!(
        own.map(|(s, _)| s),
        Ok(200),
        "/metrics from the host itself"
    );

    for to in [
        sa(TG_V4, HEALTH_PORT),
        sa(TG_V6, HEALTH_PORT),
        sa(PROXY_CLUSTER_V4, HEALTH_PORT),
    ] {
        let r = http_get_in(t.client.name(), to, "/metrics", BLOCKED);
        assert!(
            r.is_err(),
            "a tunnel peer fetched http://{to}/metrics: {r:?}"
        );
    }
    tcp_blocked(&t.client, sa(TG_V4, 7001), "local tcp listener, v4");
    tcp_blocked(&t.client, sa(TG_V6, 7002), "local tcp listener, v6");
    for to in [sa(TG_V4, 5301), sa(TG_V6, 5302)] {
        let r = udp_roundtrip(&t.client, to, b"must not arrive", BLOCKED);
        assert_eq!(r, None, "local udp listener {to} answered the tunnel");
    }
    // Replies and ICMP still pass: a ping through the tunnel answers.
    assert!(ping(&t.client, TG_V4), "ping v4 through the tunnel");
    assert!(ping(&t.client, TG_V6), "ping v6 through the tunnel");

    // On purpose: the switch opens the health port to the tunnel, after a reload.
    let text = tg.cfg.render("private.key");
    assert!(text.contains("[health]\n"), "{text}");
    tg.write_config_text(&text.replace("[health]\n", "[health]\nallow_from_tunnel = true\n"));
    tg.sighup();
    let mut last = String::new();
    let opened = poll_until(Duration::from_secs(10), || {
        match http_get_in(t.client.name(), sa(TG_V4, HEALTH_PORT), "/metrics", BLOCKED) {
            Ok((200, _)) => true,
            other => {
                last = format!("{other:?}");
                false
            }
        }
    });
    assert!(
        opened,
        "allow_from_tunnel did not open /metrics to the tunnel: {last}\n{}",
        tg.stderr()
    );
    echo_ok(&t.client, sa(TG_V4, 7000), "ingress after the reload");
}
