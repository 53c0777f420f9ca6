//! RuleSet -> nftables script text. Pure: the shell pipes [`render`] into `nft -f -`, which
//! replaces `table inet tunnelgate_<iface>` ([`nft_table`]) in one transaction; nothing outside
//! that table is touched, including another daemon's table for another interface.

use super::model::{is_host, lower, Chain, Match, Rule, Verdict};
use super::{nft_table, Family, IpNet, RuleSet};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

/// The whole script: create the table if missing, delete it, create it again with every rule.
/// `nft -f` runs all of it as one transaction, so the table is replaced atomically, whether or
/// not it existed, and rendering the same set twice can never leave duplicates.
pub fn render(set: &RuleSet) -> String {
    let rules = lower(set);
    let table = nft_table(&set.tunnel);
    let mut out = format!(
        "# tunnelgate: replaces table inet {table} in one transaction (nft -f -)\n\
         table inet {table} {{}}\n\
         delete table inet {table}\n\
         table inet {table} {{\n"
    );
    let mut first = true;
    for chain in Chain::ALL {
        let in_chain: Vec<&Rule> = rules.iter().filter(|r| r.chain == chain).collect();
        if in_chain.is_empty() {
            continue;
        }
        if !first {
            out.push('\n');
        }
        first = false;
        let (name, kind, hook, priority) = header(chain);
        let _ = writeln!(out, "\tchain {name} {{");
        let _ = writeln!(
            out,
            "\t\ttype {kind} hook {hook} priority {priority}; policy accept;"
        );
        for rule in in_chain {
            let _ = writeln!(out, "\t\t{}", rule_text(rule));
        }
        out.push_str("\t}\n");
    }
    out.push_str("}\n");
    out
}

/// Removes the table of the daemon for `tunnel` and everything in it; succeeds whether or not
/// it exists. Other tables, another tunnelgate's included, are not named.
pub fn render_delete(tunnel: &str) -> String {
    let table = nft_table(tunnel);
    format!("table inet {table} {{}}\ndelete table inet {table}\n")
}

/// `nft list table inet tunnelgate_<iface>` output without what changes on its own (rule handles,
/// counter values) or does not matter (blank lines, trailing spaces). Compare the value taken
/// right after an apply with a later one to detect drift.
pub fn normalize_listing(listing: &str) -> String {
    let mut out = String::new();
    for line in listing.lines() {
        let line = match line.find(" # handle ") {
            Some(i) => &line[..i],
            None => line,
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut kept = Vec::with_capacity(words.len());
        let mut i = 0;
        while i < words.len() {
            if words[i] == "counter" && words.get(i + 1) == Some(&"packets") {
                i += 5; // counter packets N bytes M
                continue;
            }
            kept.push(words[i]);
            i += 1;
        }
        if kept.is_empty() || kept[0].starts_with('#') {
            continue;
        }
        let indent: String = line.chars().take_while(|c| *c == '\t').collect();
        let _ = writeln!(out, "{indent}{}", kept.join(" "));
    }
    out
}

/// Chain name, type, hook and priority. (`fwd` is an nft keyword; these names are not.)
fn header(chain: Chain) -> (&'static str, &'static str, &'static str, &'static str) {
    match chain {
        Chain::Prerouting => ("prerouting", "nat", "prerouting", "dstnat"),
        Chain::Postrouting => ("postrouting", "nat", "postrouting", "srcnat"),
        Chain::Forward => ("forward", "filter", "forward", "filter"),
        Chain::Mss => ("mss", "filter", "forward", "mangle"),
        Chain::Input => ("input", "filter", "input", "filter"),
    }
}

fn rule_text(rule: &Rule) -> String {
    let mut parts: Vec<String> = Vec::new();
    // In an inet table a NAT statement needs its family pinned by some match. `meta l4proto
    // icmp` pins it too (nft lists such a rule back without the `meta nfproto`).
    let pinned = rule.matches.iter().any(|m| match m {
        Match::Daddr(_) | Match::Icmp => true,
        Match::CtDnat { orig_daddr, .. } => !orig_daddr.is_empty(),
        _ => false,
    });
    for m in &rule.matches {
        parts.push(match_text(m, rule.family));
    }
    if let (Some(f), false) = (rule.family, pinned) {
        // After the interface matches, before any port match.
        let at = rule
            .matches
            .iter()
            .take_while(|m| {
                matches!(
                    m,
                    Match::InIface { .. } | Match::OutIface { .. } | Match::LocalDaddrOnInIface
                )
            })
            .count();
        parts.insert(at, format!("meta nfproto {f}"));
    }
    parts.push(verdict_text(&rule.verdict));
    parts.push(format!("comment \"{}\"", rule.comment));
    parts.join(" ")
}

fn match_text(m: &Match, family: Option<Family>) -> String {
    match m {
        Match::InIface { name, negate } => format!("iifname {}\"{name}\"", neg(*negate)),
        Match::OutIface { name, negate } => format!("oifname {}\"{name}\"", neg(*negate)),
        Match::Daddr(nets) => {
            let f = nets.iter().next().map(Family::of_net).or(family);
            format!(
                "{} daddr {}",
                proto_word(f),
                set_text(nets.iter().map(net_text))
            )
        }
        Match::LocalDaddrOnInIface => "fib daddr . iif type local".into(),
        Match::Dport(proto, port) => format!("{proto} dport {port}"),
        Match::CtDnat {
            orig_daddr,
            orig_dport,
        } => {
            let mut text = "ct status dnat".to_string();
            if !orig_daddr.is_empty() {
                let f = orig_daddr.iter().next().map(|a| Family::of(*a)).or(family);
                let addrs = set_text(orig_daddr.iter().map(IpAddr::to_string));
                let _ = write!(text, " ct original {} daddr {addrs}", proto_word(f));
            }
            if let Some(port) = orig_dport {
                let _ = write!(text, " ct original proto-dst {port}");
            }
            text
        }
        Match::CtEstablished => "ct state established,related".into(),
        Match::TcpSyn => "tcp flags & (syn | rst) == syn".into(),
        Match::L4(proto) => format!("meta l4proto {proto}"),
        Match::Icmp => match family {
            Some(Family::V6) => "meta l4proto ipv6-icmp".into(),
            Some(Family::V4) | None => "meta l4proto icmp".into(),
        },
    }
}

fn verdict_text(v: &Verdict) -> String {
    match v {
        Verdict::Accept => "accept".into(),
        Verdict::Drop => "drop".into(),
        Verdict::Reject { tcp_reset: true } => "reject with tcp reset".into(),
        Verdict::Reject { tcp_reset: false } => "reject".into(),
        Verdict::Return => "return".into(),
        Verdict::Masquerade => "masquerade".into(),
        Verdict::ClampMssToPmtu => "tcp option maxseg size set rt mtu".into(),
        Verdict::Snat(ip) => format!("snat {} to {ip}", proto_word(Some(Family::of(*ip)))),
        Verdict::Dnat { targets, port } => dnat_text(targets, *port),
    }
}

/// `dnat ip to 10.0.0.1`, `dnat ip6 to [fd96::10]:80`, or for several targets
/// `dnat ip to numgen inc mod 2 map { 0 : 10.0.0.1, 1 : 10.0.0.2 }:8443`: a per-rule counter
/// picks the address of each new connection in turn; the port follows the whole map (an
/// `addr . port` map value compiles without the port flag on nft 1.0.6, so it is not used).
fn dnat_text(targets: &BTreeSet<IpAddr>, port: Option<u16>) -> String {
    let family = targets.iter().next().map(|a| Family::of(*a));
    let word = proto_word(family);
    let addr = match (targets.len(), targets.iter().next()) {
        (1, Some(ip)) => match (ip, port) {
            (IpAddr::V6(v6), Some(_)) => format!("[{v6}]"),
            _ => ip.to_string(),
        },
        (n, _) => {
            let entries: Vec<String> = targets
                .iter()
                .enumerate()
                .map(|(i, a)| format!("{i} : {a}"))
                .collect();
            format!("numgen inc mod {n} map {{ {} }}", entries.join(", "))
        }
    };
    match port {
        Some(p) => format!("dnat {word} to {addr}:{p}"),
        None => format!("dnat {word} to {addr}"),
    }
}

fn proto_word(family: Option<Family>) -> &'static str {
    match family {
        Some(Family::V6) => "ip6",
        Some(Family::V4) | None => "ip",
    }
}

fn neg(negate: bool) -> &'static str {
    if negate {
        "!= "
    } else {
        ""
    }
}

fn net_text(net: &IpNet) -> String {
    if is_host(net) {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

fn set_text(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    if items.len() == 1 {
        items.concat()
    } else {
        format!("{{ {} }}", items.join(", "))
    }
}
