//! The map-based nftables lowering means what the per-rule one means (every single-target
//! port is an element with its partners, nothing else moves), and the element diff of two
//! rule sets turns the installed maps into the new ones exactly, or refuses when more changed.

use super::super::desired::desired;
use super::super::model::{lower, lower_mapped, MapKind, Match, Value, Verdict};
use super::super::{nft, RuleSet};
use super::{build, facts, rules_for, spec, valid};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// Whether a rule reads a map (only [`lower_mapped`] makes those).
fn reads_map(r: &super::super::model::Rule) -> bool {
    r.matches.iter().any(|m| matches!(m, Match::InSet(_)))
        || matches!(r.verdict, Verdict::DnatMap(_) | Verdict::SnatMap(_))
}

/// Ingress with `ports` (listen:target) to one target, `n` ingress Services on 100.64.0.1.
fn services(ports: &[(u16, u16, &str)]) -> RuleSet {
    let mut body = String::new();
    for (listen, target, ip) in ports {
        body.push_str(&format!(
            "[[ingress]]\ntarget = \"{ip}\"\nports = [\"{listen}:{target}\"]\n"
        ));
    }
    rules_for(&body, &[])
}

/// Per map name: the element lines as rendered in the full script.
fn rendered_elements(script: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in script.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("map ").or_else(|| t.strip_prefix("set ")) {
            current = rest.split_whitespace().next().map(str::to_string);
        } else if t == "}" || t.starts_with("chain ") {
            if t.starts_with("chain ") {
                current = None;
            }
        } else if let (Some(name), false) = (
            &current,
            t.starts_with("type ") || t.starts_with("elements"),
        ) {
            out.entry(name.clone())
                .or_default()
                .insert(t.trim_end_matches(',').to_string());
        }
    }
    out
}

/// Applies an update script to the element lines of each map: a deleted key removes the
/// element whose text starts with it; an added line is inserted.
fn apply_update(
    mut maps: BTreeMap<String, BTreeSet<String>>,
    script: &str,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut verb_map: Option<(bool, String)> = None;
    for line in script.lines() {
        if line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix("delete element inet ") {
            let name = rest
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string();
            verb_map = Some((false, name));
        } else if let Some(rest) = line.strip_prefix("add element inet ") {
            let name = rest
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string();
            verb_map = Some((true, name));
        } else if line == "}" {
            verb_map = None;
        } else if let Some((add, name)) = &verb_map {
            let item = line.trim().trim_end_matches(',').to_string();
            let elements = maps.entry(name.clone()).or_default();
            if *add {
                assert!(elements.insert(item.clone()), "added twice: {item}");
            } else {
                let key = format!("{item} comment ");
                let before = elements.len();
                elements.retain(|e| !e.starts_with(&key));
                assert_eq!(elements.len() + 1, before, "deleted a missing key {item}");
            }
        }
    }
    maps.retain(|_, v| !v.is_empty());
    maps
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The rules that read no map are exactly the per-rule lowering's rules minus those of
    /// mapped ports, and every mapped port is an element of its DNAT map and its partner set
    /// (and, for egress, its SNAT map), with its config key as the comment.
    #[test]
    fn mapped_lowering_keeps_every_rule_and_port(spec in spec()) {
        prop_assume!(valid(&spec));
        let (config, resolved) = build(&spec, 0);
        let set = desired(&config, &facts(), &resolved);
        let mapped = lower_mapped(&set);
        let per_rule = lower(&set);
        for r in mapped.rules.iter().filter(|r| !reads_map(r)) {
            prop_assert!(per_rule.contains(r), "{r:?} is not a per-rule rule");
        }
        let element = |kind: MapKind, f, p, key: &[Value]| {
            mapped.maps.iter().find(|m| m.id.kind == kind && m.id.family == f && m.id.proto == p)
                .and_then(|m| m.elements.get(key).cloned())
        };
        let mut expected = 0;
        for r in &set.ingress {
            let (Some(p), 1) = (r.port, r.targets.len()) else { continue };
            let t = *r.targets.first().unwrap_or(&IpAddr::from([0, 0, 0, 0]));
            for a in &r.tunnel_addrs {
                expected += 2;
                let key = [Value::Addr(*a), Value::Port(p.listen)];
                let e = element(MapKind::IngressDnat, r.family, p.proto, &key);
                prop_assert_eq!(e.as_ref().map(|e| e.value.clone()), Some(vec![Value::Addr(t), Value::Port(p.target)]));
                prop_assert_eq!(e.map(|e| e.comment), Some(r.origin.to_string()));
                let conn = [Value::Addr(*a), Value::Port(p.listen), Value::Addr(t), Value::Port(p.target)];
                prop_assert!(element(MapKind::IngressConn, r.family, p.proto, &conn).is_some());
            }
        }
        for r in &set.egress {
            let (Some(p), 1) = (r.port, r.targets.len()) else { continue };
            let t = *r.targets.first().unwrap_or(&IpAddr::from([0, 0, 0, 0]));
            expected += 3;
            let e = element(MapKind::EgressDnat, r.family, p.proto, &[Value::Port(p.listen)]);
            prop_assert_eq!(e.map(|e| e.value), Some(vec![Value::Addr(t), Value::Port(p.target)]));
            let conn = [Value::Port(p.listen), Value::Addr(t), Value::Port(p.target)];
            let snat = element(MapKind::EgressSnat, r.family, p.proto, &conn);
            prop_assert_eq!(snat.map(|e| e.value), Some(vec![Value::Addr(r.snat_to)]));
            prop_assert!(element(MapKind::EgressConn, r.family, p.proto, &conn).is_some());
        }
        let total: usize = mapped.maps.iter().map(|m| m.elements.len()).sum();
        prop_assert_eq!(total, expected, "no element without its port");
        // Every DNAT map is read by one prerouting rule and has its partner rules.
        for m in mapped.maps.iter().filter(|m| matches!(m.id.kind, MapKind::IngressDnat | MapKind::EgressDnat)) {
            let dnat = mapped.rules.iter().filter(|r| r.verdict == Verdict::DnatMap(m.id)).count();
            prop_assert_eq!(dnat, 1);
            let partner = mapped.rules.iter().any(|r| r.comment == m.id.comment()
                && matches!(r.verdict, Verdict::Masquerade | Verdict::SnatMap(_)));
            prop_assert!(partner, "no masquerade/SNAT for {:?}", m.id);
        }
    }

    /// Any change of ports and targets among single-target Services of the same protocols:
    /// the update script turns the installed elements into exactly the new ones.
    #[test]
    fn element_update_turns_old_maps_into_new_ones(
        old in proptest::collection::btree_map(1000u16..1040, (1u16..4, 0u8..3), 1..20),
        new in proptest::collection::btree_map(1000u16..1040, (1u16..4, 0u8..3), 1..20),
    ) {
        let spec = |m: &BTreeMap<u16, (u16, u8)>| -> Vec<(u16, u16, String)> {
            m.iter().map(|(l, (t, ip))| (*l, 8000 + *t, format!("10.96.0.{}", ip + 1))).collect()
        };
        let (a, b) = (spec(&old), spec(&new));
        let refs = |v: &Vec<(u16, u16, String)>| -> RuleSet {
            services(&v.iter().map(|(l, t, ip)| (*l, *t, ip.as_str())).collect::<Vec<_>>())
        };
        let (before, after) = (refs(&a), refs(&b));
        let script = nft::render_update(&before, &after);
        prop_assert!(script.is_some(), "only elements differ");
        let script = script.unwrap_or_default();
        let got = apply_update(rendered_elements(&nft::render(&before)), &script);
        prop_assert_eq!(got, rendered_elements(&nft::render(&after)), "{}", script);
        prop_assert_eq!(nft::has_statements(&script), nft::render(&before) != nft::render(&after));
    }
}

#[test]
fn one_service_changed_is_two_deletes_and_two_adds() {
    let before = services(&[(1000, 80, "10.96.0.1"), (1001, 80, "10.96.0.2")]);
    let after = services(&[(1000, 80, "10.96.0.1"), (1001, 80, "10.96.0.9")]);
    let script = nft::render_update(&before, &after).expect("elements only");
    assert_eq!(
        script,
        "# tunnelgate: changes map elements of table inet tunnelgate_tg0 in one transaction (nft -f -)\n\
         delete element inet tunnelgate_tg0 in4_tcp_dnat {\n\t100.64.0.1 . 1001\n}\n\
         delete element inet tunnelgate_tg0 in4_tcp_conn {\n\t100.64.0.1 . 1001 . 10.96.0.2 . 80\n}\n\
         add element inet tunnelgate_tg0 in4_tcp_dnat {\n\t100.64.0.1 . 1001 comment \"ingress[1]\" : 10.96.0.9 . 80\n}\n\
         add element inet tunnelgate_tg0 in4_tcp_conn {\n\t100.64.0.1 . 1001 . 10.96.0.9 . 80 comment \"ingress[1]\"\n}\n"
    );
    let same = nft::render_update(&before, &before).expect("nothing differs");
    assert!(!nft::has_statements(&same), "{same}");
}

#[test]
fn a_change_beyond_elements_is_a_full_replace() {
    let tcp = services(&[(1000, 80, "10.96.0.1")]);
    // A new protocol: a new map and its rules.
    let udp = rules_for(
        "[[ingress]]\ntarget = \"10.96.0.1\"\nports = [\"1000:80\", \"53/udp\"]\n",
        &[],
    );
    assert!(nft::render_update(&tcp, &udp).is_none());
    // The last element of a map goes: the map and its rules go.
    let v6_only = rules_for(
        "[[ingress]]\ntarget = \"fd96::1\"\nports = [\"1000:80\"]\n",
        &[],
    );
    assert!(nft::render_update(&tcp, &v6_only).is_none());
    // A Service whose name resolves to two addresses is a numgen rule of its own.
    let one = rules_for(
        "[[ingress]]\ntarget_fqdn = \"db.example\"\nports = [\"1000:80\"]\n[[ingress]]\ntarget = \"10.96.0.1\"\nports = [\"2000\"]\n",
        &[("db.example", vec!["10.96.0.5".parse().expect("ip")])],
    );
    let two = rules_for(
        "[[ingress]]\ntarget_fqdn = \"db.example\"\nports = [\"1000:80\"]\n[[ingress]]\ntarget = \"10.96.0.1\"\nports = [\"2000\"]\n",
        &[("db.example", vec!["10.96.0.5".parse().expect("ip"), "10.96.0.6".parse().expect("ip")])],
    );
    assert!(nft::render_update(&one, &two).is_none());
    assert!(nft::render_update(&two, &one).is_none());
    // Another interface's table is never patched.
    let mut other = tcp.clone();
    other.tunnel = "tg1".into();
    assert!(nft::render_update(&tcp, &other).is_none());
}

#[test]
fn ten_thousand_ports_are_a_handful_of_rules() {
    // 250 Services of 40 ports each.
    let mut body = String::new();
    for s in 0..250u16 {
        let ports: Vec<String> = (0..40u16)
            .map(|p| format!("\"{}:80\"", 10_000 + s * 40 + p))
            .collect();
        body.push_str(&format!(
            "[[ingress]]\ntarget = \"10.96.{}.{}\"\nports = [{}]\n",
            s / 200,
            s % 200 + 1,
            ports.join(", ")
        ));
    }
    let set = rules_for(&body, &[]);
    let lowered = lower_mapped(&set);
    let rules_reading_maps = lowered.rules.iter().filter(|r| reads_map(r)).count();
    assert_eq!(
        rules_reading_maps, 4,
        "dnat, masquerade, forward and input accepts"
    );
    let elements: usize = lowered.maps.iter().map(|m| m.elements.len()).sum();
    assert_eq!(
        elements, 20_000,
        "one dnat and one partner element per port"
    );
    assert!(lowered.rules.len() < 20, "{} rules", lowered.rules.len());
}
