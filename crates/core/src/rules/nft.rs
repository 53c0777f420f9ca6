//! RuleSet -> nftables script text. Pure: the shell pipes [`render`] into `nft -f -`, which
//! replaces `table inet tunnelgate_<iface>` ([`nft_table`]) in one transaction; nothing outside
//! that table is touched, including another daemon's table for another interface.
//!
//! Forwarded ports live in maps ([`lower_mapped`]): 10,000 ports are a handful of rules and
//! 10,000 elements. When only elements differ from what is installed, [`render_update`] gives
//! a transaction of `delete element` / `add element` instead of a new table, so changing one
//! Service touches only its own elements.

use super::model::{
    is_host, lower_mapped, Chain, KeyField, Lowered, Map, MapElement, MapId, Match, Rule, Value,
    ValueKind, Verdict,
};
use super::{nft_table, Family, IpNet, RuleSet};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

/// The whole script: create the table if missing, delete it, create it again with every map
/// and rule. `nft -f` runs all of it as one transaction, so the table is replaced atomically,
/// whether or not it existed, and rendering the same set twice can never leave duplicates.
pub fn render(set: &RuleSet) -> String {
    let Lowered { rules, maps } = lower_mapped(set);
    let table = nft_table(&set.tunnel);
    let mut out = format!(
        "# tunnelgate: replaces table inet {table} in one transaction (nft -f -)\n\
         table inet {table} {{}}\n\
         delete table inet {table}\n\
         table inet {table} {{\n"
    );
    let mut first = true;
    for map in &maps {
        if !first {
            out.push('\n');
        }
        first = false;
        map_text(&mut out, map);
    }
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

/// The script that turns `installed` into `set` by changing map elements only, in one
/// transaction: every element that is gone or different is deleted, then every new or
/// different one added. `None` when more than elements differ (a rule, a map appearing or
/// going, another table): then only [`render`]'s full replace is right. A script with no
/// statement (only its header) means nothing differs.
pub fn render_update(installed: &RuleSet, set: &RuleSet) -> Option<String> {
    if installed.tunnel != set.tunnel {
        return None;
    }
    let (old, new) = (lower_mapped(installed), lower_mapped(set));
    let ids = |l: &Lowered| l.maps.iter().map(|m| m.id).collect::<Vec<MapId>>();
    if old.rules != new.rules || ids(&old) != ids(&new) {
        return None;
    }
    let table = nft_table(&set.tunnel);
    let mut out = format!(
        "# tunnelgate: changes map elements of table inet {table} in one transaction (nft -f -)\n"
    );
    let mut adds = String::new();
    for (before, after) in old.maps.iter().zip(&new.maps) {
        let changed = |from: &Map, to: &Map| -> Vec<String> {
            from.elements
                .iter()
                .filter(|(key, e)| to.elements.get(*key) != Some(*e))
                .map(|(key, e)| element_text(from, key, e))
                .collect()
        };
        let gone: Vec<String> = before
            .elements
            .iter()
            .filter(|(key, e)| after.elements.get(*key) != Some(*e))
            .map(|(key, _)| values_text(key))
            .collect();
        statement(&mut out, "delete", &table, &before.id, &gone);
        statement(&mut adds, "add", &table, &after.id, &changed(after, before));
    }
    out.push_str(&adds);
    Some(out)
}

/// Whether an [`render_update`] script changes anything (more than its header comment).
pub fn has_statements(script: &str) -> bool {
    script
        .lines()
        .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
}

fn statement(out: &mut String, verb: &str, table: &str, id: &MapId, elements: &[String]) {
    if elements.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "{verb} element inet {table} {} {{\n\t{}\n}}",
        id.name(),
        elements.join(",\n\t")
    );
}

/// `map in4_tcp_dnat { type ... ; elements = { ... } }`, one element per line.
fn map_text(out: &mut String, map: &Map) {
    let id = &map.id;
    let value = id.value();
    let addr_type = match id.family {
        Family::V4 => "ipv4_addr",
        Family::V6 => "ipv6_addr",
    };
    let key_type: Vec<&str> = id
        .key()
        .iter()
        .map(|f| {
            if f.is_addr() {
                addr_type
            } else {
                "inet_service"
            }
        })
        .collect();
    let value_type: Vec<&str> = value
        .iter()
        .map(|v| match v {
            ValueKind::Addr => addr_type,
            ValueKind::Port => "inet_service",
        })
        .collect();
    let (kind, typ) = if value.is_empty() {
        ("set", key_type.join(" . "))
    } else {
        (
            "map",
            format!("{} : {}", key_type.join(" . "), value_type.join(" . ")),
        )
    };
    let _ = writeln!(out, "\t{kind} {} {{", id.name());
    let _ = writeln!(out, "\t\ttype {typ}");
    let elements: Vec<String> = map
        .elements
        .iter()
        .map(|(key, e)| element_text(map, key, e))
        .collect();
    let _ = writeln!(
        out,
        "\t\telements = {{\n\t\t\t{}\n\t\t}}",
        elements.join(",\n\t\t\t")
    );
    out.push_str("\t}\n");
}

/// `100.64.0.1 . 80 comment "ingress[0]" : 10.96.0.10 . 8080` (no `: ...` in a set). nft lists
/// addresses and ports the same way, IPv6 compressed and without brackets.
fn element_text(map: &Map, key: &[Value], e: &MapElement) -> String {
    let mut text = format!("{} comment \"{}\"", values_text(key), e.comment);
    if !map.id.value().is_empty() {
        let _ = write!(text, " : {}", values_text(&e.value));
    }
    text
}

fn values_text(values: &[Value]) -> String {
    let parts: Vec<String> = values
        .iter()
        .map(|v| match v {
            Value::Addr(ip) => ip.to_string(),
            Value::Port(p) => p.to_string(),
        })
        .collect();
    parts.join(" . ")
}

/// What a packet is looked up by in `id`: `ip daddr . tcp dport`, or with the connection's
/// original destination `ct original ip daddr . ct original proto-dst . ip daddr . tcp dport`.
/// (nft 1.0.6 takes `ct original proto-dst` in a concatenation only once a protocol match
/// before it gives it a type, hence one map per protocol and the `meta l4proto` before it.)
fn key_text(id: &MapId) -> String {
    let word = proto_word(Some(id.family));
    let parts: Vec<String> = id
        .key()
        .iter()
        .map(|f| match f {
            KeyField::Daddr => format!("{word} daddr"),
            KeyField::Dport => format!("{} dport", id.proto),
            KeyField::OrigDaddr => format!("ct original {word} daddr"),
            KeyField::OrigDport => "ct original proto-dst".to_string(),
        })
        .collect();
    parts.join(" . ")
}

fn pins_family(id: &MapId) -> bool {
    id.key().iter().any(|f| f.is_addr())
}

/// Removes the table of the daemon for `tunnel` and everything in it; succeeds whether or not
/// it exists. Other tables, another tunnelgate's included, are not named.
pub fn render_delete(tunnel: &str) -> String {
    let table = nft_table(tunnel);
    format!("table inet {table} {{}}\ndelete table inet {table}\n")
}

/// How many rules an `nft list table` listing holds, as nft counts them (`nft -j list table`
/// has one `rule` object per rule): the statements of the chains, not the table, set, map and
/// chain lines, the elements of sets and maps, or a chain's `type ... hook ...; policy ...;`.
pub fn count_rules(listing: &str) -> usize {
    let mut in_chain = false;
    let mut rules = 0;
    for line in listing.lines() {
        let line = match line.find(" # handle ") {
            Some(i) => &line[..i],
            None => line,
        }
        .trim();
        if line.starts_with("chain ") && line.ends_with('{') {
            in_chain = true;
        } else if line == "}" {
            in_chain = false;
        } else if in_chain && !line.is_empty() && !is_chain_property(line) {
            rules += 1;
        }
    }
    rules
}

/// A line of a chain's body that is no rule: its hook and policy, or its comment and devices.
fn is_chain_property(line: &str) -> bool {
    ["type ", "policy ", "comment ", "devices ", "#"]
        .iter()
        .any(|p| line.starts_with(p))
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
        Match::InSet(id) => pins_family(id),
        _ => false,
    }) || matches!(&rule.verdict, Verdict::DnatMap(id) | Verdict::SnatMap(id) if pins_family(id));
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
        Match::InSet(id) => format!("{} @{}", key_text(id), id.name()),
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
        Verdict::DnatMap(id) => format!(
            "dnat {} to {} map @{}",
            proto_word(Some(id.family)),
            key_text(id),
            id.name()
        ),
        Verdict::SnatMap(id) => format!(
            "snat {} to {} map @{}",
            proto_word(Some(id.family)),
            key_text(id),
            id.name()
        ),
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
