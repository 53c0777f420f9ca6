//! What `tunnelgate check` prints: the routes, policy rules, sysctls and firewall rules a
//! configuration would install. Pure: the same functions the daemon applies from.

use crate::config::Config;
use crate::routes;
use std::fmt::Write;

/// `firewall` is the rendered rule text for the chosen backend (None: no rules needed).
pub fn render_plan(config: &Config, firewall: Option<(&str, &str)>) -> String {
    let mut out = String::new();
    let iface = &config.interface;
    let _ = writeln!(
        out,
        "# interface {} (mtu {}), public key {}",
        iface.name,
        iface.mtu,
        iface.private_key.public_key()
    );
    for a in &iface.addresses {
        let _ = writeln!(out, "ip address add {a} dev {}", iface.name);
    }
    let nets: Vec<_> = config
        .peers
        .iter()
        .flat_map(|p| p.allowed_ips.iter().copied())
        .collect();
    let plan = routes::plan(&nets, iface.fwmark);
    let _ = writeln!(out, "\n# routes");
    for r in &plan.routes {
        let table = if r.table == routes::MAIN_TABLE {
            String::new()
        } else {
            format!(" table {}", r.table)
        };
        let _ = writeln!(out, "ip route add {} dev {}{table}", r.net, iface.name);
    }
    for r in &plan.rules {
        let fam = if r.v6 { "-6" } else { "-4" };
        let _ = match r.kind {
            routes::RuleKind::SuppressDefault => writeln!(
                out,
                "ip {fam} rule add pref {} table main suppress_prefixlength 0",
                r.priority
            ),
            routes::RuleKind::NotFwmark(m) => writeln!(
                out,
                "ip {fam} rule add pref {} not fwmark {m:#x} table {}",
                r.priority, r.table
            ),
        };
    }
    let _ = writeln!(out, "\n# sysctls");
    let mut families = std::collections::BTreeSet::new();
    for f in config.ingress.iter().chain(&config.egress) {
        match &f.target {
            crate::config::Target::Ip(ip) => {
                families.insert(if ip.is_ipv6() { 6 } else { 4 });
            }
            crate::config::Target::Fqdn(_) => {
                families.extend(config.interface.addresses.iter().map(|a| {
                    if a.addr().is_ipv6() {
                        6
                    } else {
                        4
                    }
                }));
            }
        }
    }
    families.extend(config.router.advertise_routes.iter().map(|n| {
        if n.addr().is_ipv6() {
            6
        } else {
            4
        }
    }));
    if config.router.exit_node {
        families.extend([4, 6]);
    }
    for f in families {
        let key = if f == 4 {
            "net.ipv4.ip_forward"
        } else {
            "net.ipv6.conf.all.forwarding"
        };
        let _ = writeln!(out, "{key} = 1   (only if not already on)");
    }
    if plan.rules.iter().any(|r| !r.v6) {
        let _ = writeln!(out, "net.ipv4.conf.all.src_valid_mark = 1");
    }
    let names = config.fqdn_targets();
    if !names.is_empty() {
        let _ = writeln!(
            out,
            "\n# resolved at run time (rules for them appear once resolved): {}",
            names.join(", ")
        );
    }
    match firewall {
        Some((backend, text)) => {
            let _ = writeln!(out, "\n# firewall ({backend}), applied in one transaction");
            out.push_str(text);
        }
        None => {
            let _ = writeln!(out, "\n# firewall: none (nothing is forwarded)");
        }
    }
    if !config.peers.is_empty() {
        let _ = writeln!(
            out,
            "\n# client side: AllowedIPs for each peer (the [Peer] section for this host in its wg-quick config)"
        );
        let allowed: Vec<String> = client_allowed_ips(config)
            .iter()
            .map(ToString::to_string)
            .collect();
        for (i, peer) in config.peers.iter().enumerate() {
            let here: Vec<String> = peer.allowed_ips.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "# peer[{i}] {} (its allowed_ips here: {})",
                peer.public_key,
                here.join(", ")
            );
            let _ = writeln!(out, "AllowedIPs = {}", allowed.join(", "));
        }
    }
    out
}

/// What a peer must route through the tunnel to this host: every address and network this
/// host serves. An exit node serves everything (0.0.0.0/0, ::/0); otherwise the tunnel
/// addresses (as /32 and /128) and the advertised routes (subnet router).
pub fn client_allowed_ips(config: &Config) -> Vec<crate::config::IpNet> {
    use crate::config::IpNet;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    if config.router.exit_node {
        return vec![
            IpNet::new_assert(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            IpNet::new_assert(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
        ];
    }
    let mut out: Vec<IpNet> = Vec::new();
    let own = config
        .interface
        .addresses
        .iter()
        .map(|a| IpNet::from(a.addr()));
    for net in own.chain(config.router.advertise_routes.iter().copied()) {
        if !out.contains(&net) {
            out.push(net);
        }
    }
    out
}
