//! Inspecting the rules a backend installed: ours, foreign ones, MSS clamping, and deleting one behind the daemon's back.

use super::*;

/// Removes what changes without the rules changing: handles, counters, nft's metainfo.
pub(crate) fn strip_volatile(v: &mut Value) {
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
pub(crate) fn strip_counters(line: &str) -> String {
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
pub(crate) fn iptables_lines(ns: &Netns, backend: Backend, v6: bool) -> Vec<(String, String)> {
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
pub(crate) fn is_tunnelgate_line(line: &str) -> bool {
    line.split_whitespace()
        .any(|w| w.trim_start_matches(':').starts_with("TG-"))
}

/// Everything of tunnelgate's that is installed, normalized: the `nft -j` listing of its table
/// `tunnelgate_<iface>` (minus handles and counters), or its `TG-<iface>-*` chains and jumps in
/// both families' `iptables-save`. Empty when nothing of it is installed. One daemon per
/// namespace in this suite, so every tunnelgate table or chain is that daemon's.
pub(crate) fn owned_rules(ns: &Netns, backend: Backend) -> String {
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
pub(crate) fn owned_rule_lines(ns: &Netns, backend: Backend) -> Vec<String> {
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
pub(crate) fn foreign_rules(ns: &Netns, backend: Backend) -> String {
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
pub(crate) fn add_foreign_rules(ns: &Netns, backend: Backend) {
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
pub(crate) fn assert_nothing_of_ours(ns: &Netns, backend: Backend, when: &str) {
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
pub(crate) fn duplicates(lines: &[String]) -> Vec<String> {
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
pub(crate) fn wait_rules_equal(
    ns: &Netns,
    backend: Backend,
    want: &str,
    timeout: Duration,
    what: &str,
) {
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
pub(crate) fn assert_mss_once(ns: &Netns, backend: Backend, iface: &str) {
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
pub(crate) fn delete_a_rule(ns: &Netns, backend: Backend, iface: &str) {
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
