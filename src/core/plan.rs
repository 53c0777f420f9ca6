//! What `tunnelgate check` prints: the routes, policy rules, sysctls and firewall rules a
//! configuration would install. Pure: the same functions the daemon applies from.

use crate::config::Config;
use crate::core::routes;
use std::fmt::Write;

pub fn render_plan(config: &Config) -> String {
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
    out
}
