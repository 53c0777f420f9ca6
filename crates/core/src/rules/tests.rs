//! Rule model properties: planning is order-independent and never targets our own addresses,
//! rendering is deterministic, every DNAT has its SNAT/masquerade partner, and our iptables
//! jumps are recognised once installed. Plus the save/listing parsers on fixed text.

use super::desired::{desired, RuntimeFacts, MAX_ADDRESSES_PER_TARGET};
use super::iptables::{self, JumpState};
use super::model::{lower, lower_mapped, Chain, Match, Verdict};
use super::*;
use crate::config::{Config, SecretFiles};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

const KEY: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
const NAMES: [&str; 3] = ["a.example", "b.example", "c.example"];
const IPS: [&str; 6] = [
    "10.96.0.1",
    "10.96.0.2",
    "100.64.0.9",
    "fd96::1",
    "fd96::2",
    "fd7a::9",
];
/// DNS answers may hold anything, including our own addresses and unusable ones.
const ANSWERS: [&str; 12] = [
    "10.1.0.1",
    "10.1.0.2",
    "10.1.0.3",
    "100.64.0.1",
    "100.64.1.1",
    "127.0.0.1",
    "0.0.0.0",
    "fd96::a",
    "fd96::b",
    "fd7a::1",
    "ff02::1",
    "::ffff:10.1.0.9",
];
const ROUTES: [&str; 4] = [
    "10.40.0.0/14",
    "10.40.1.0/24",
    "192.168.0.0/16",
    "fd00:40::/48",
];

struct NoFiles;

impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("none".into())
    }
}

/// One `[[ingress]]`/`[[egress]]`: target (index into IPS, or a name), ports (proto, offset,
/// target) or every port.
#[derive(Debug, Clone)]
struct FwdSpec {
    target: Result<usize, usize>,
    ports: Option<Vec<(bool, u16, u16)>>,
}

#[derive(Debug, Clone)]
struct Spec {
    v6: bool,
    second_v4: bool,
    ingress: Vec<FwdSpec>,
    egress: Vec<FwdSpec>,
    routes: Vec<usize>,
    exit_node: bool,
    snat: bool,
    mss: bool,
    answers: Vec<(usize, Vec<usize>)>,
}

fn fwd_spec() -> impl Strategy<Value = FwdSpec> {
    let target = prop_oneof![(0..IPS.len()).prop_map(Ok), (0..NAMES.len()).prop_map(Err)];
    let port = (any::<bool>(), 1..50u16, 1..65535u16);
    let ports = proptest::option::weighted(0.8, proptest::collection::vec(port, 1..4));
    (target, ports).prop_map(|(target, ports)| FwdSpec { target, ports })
}

fn spec() -> impl Strategy<Value = Spec> {
    let fwds = || proptest::collection::vec(fwd_spec(), 0..4);
    let answers = proptest::collection::vec(
        (
            0..NAMES.len(),
            proptest::collection::vec(0..ANSWERS.len(), 0..8),
        ),
        0..4,
    );
    (
        (any::<bool>(), any::<bool>(), fwds(), fwds()),
        (
            proptest::collection::vec(0..ROUTES.len(), 0..4),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        answers,
    )
        .prop_map(
            |((v6, second_v4, ingress, egress), (routes, exit_node, snat, mss), answers)| Spec {
                v6,
                second_v4,
                ingress,
                egress,
                routes,
                exit_node,
                snat,
                mss,
                answers,
            },
        )
}

/// A deterministic shuffle, so a permuted copy of the same spec can be built.
fn permute<T: Clone>(items: &[T], seed: u64) -> Vec<T> {
    let mut v = items.to_vec();
    let mut s = seed | 1;
    for i in (1..v.len()).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (s >> 33) as usize % (i + 1));
    }
    v
}

fn fwd_toml(section: &str, i: usize, f: &FwdSpec, many: bool, seed: u64) -> String {
    let mut t = format!("[[{section}]]\n");
    match f.target {
        Ok(ip) => t += &format!("target = \"{}\"\n", IPS[ip]),
        Err(n) => t += &format!("target_fqdn = \"{}\"\n", NAMES[n]),
    }
    // Listen ports are unique per rule (overlap is a config error), and a rule without ports
    // only when it is alone in its section.
    let ports = match (&f.ports, many) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => Some(Vec::new()),
        (None, false) => None,
    };
    if let Some(ports) = ports {
        let mut list: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(j, (udp, _, target))| {
                let listen = 1000 * (i as u16 + 1) + j as u16;
                format!("\"{listen}:{target}/{}\"", if *udp { "udp" } else { "tcp" })
            })
            .collect();
        if list.is_empty() {
            list.push(format!("\"{}\"", 1000 * (i + 1)));
        }
        t += &format!("ports = [{}]\n", permute(&list, seed).join(", "));
    }
    t
}

/// The config text and DNS answers of `spec`, with every order that must not matter
/// (ports in a rule, advertised routes, addresses in an answer) shuffled by `seed`.
fn build(spec: &Spec, seed: u64) -> (Config, BTreeMap<String, Vec<IpAddr>>) {
    let mut addrs = vec!["\"100.64.0.1/32\""];
    if spec.second_v4 {
        addrs.push("\"100.64.1.1/32\"");
    }
    if spec.v6 {
        addrs.push("\"fd7a::1/128\"");
    }
    let mut text = format!(
        "[interface]\nprivate_key = \"{KEY}\"\nlisten_port = 51820\naddresses = [{}]\n\
         [firewall]\nmss_clamp = {}\n[router]\nexit_node = {}\nsnat = {}\nadvertise_routes = [{}]\n",
        addrs.join(", "),
        spec.mss,
        spec.exit_node,
        spec.snat,
        permute(&spec.routes, seed)
            .iter()
            .map(|r| format!("\"{}\"", ROUTES[*r]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (section, list) in [("ingress", &spec.ingress), ("egress", &spec.egress)] {
        for (i, f) in list.iter().enumerate() {
            text += &fwd_toml(section, i, f, list.len() > 1, seed);
        }
    }
    let config = match Config::parse(&text, Path::new("/"), &NoFiles) {
        Ok(c) => c,
        Err(e) => panic!("generated config is invalid: {e}\n{text}"),
    };
    let mut resolved: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for (name, answer) in &spec.answers {
        let ips = answer
            .iter()
            .filter_map(|a| ANSWERS[*a].parse::<IpAddr>().ok());
        resolved.entry(NAMES[*name].into()).or_default().extend(ips);
    }
    for v in resolved.values_mut() {
        let doubled: Vec<IpAddr> = v.iter().chain(v.iter()).copied().collect();
        *v = permute(&doubled, seed);
    }
    (config, resolved)
}

fn facts() -> RuntimeFacts {
    RuntimeFacts {
        wg_port: 51820,
        health_port: Some(9002),
        health_beyond_loopback: false,
    }
}

/// Drops IP targets whose family has no tunnel address (a config error, not a plan case).
fn valid(spec: &Spec) -> bool {
    let ok = |f: &FwdSpec| {
        f.target
            .map_or(true, |ip| spec.v6 || !IPS[ip].contains(':'))
    };
    spec.ingress.iter().all(ok) && spec.egress.iter().all(ok)
}

fn all_renders(set: &RuleSet) -> String {
    let fresh = JumpState::default();
    nft::render(set)
        + &iptables::render(set, Family::V4, &fresh)
        + &iptables::render(set, Family::V6, &fresh)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rendering_ignores_orders_that_do_not_matter(spec in spec(), seed in any::<u64>()) {
        prop_assume!(valid(&spec));
        let (c1, r1) = build(&spec, 0);
        let (c2, r2) = build(&spec, seed);
        let a = desired(&c1, &facts(), &r1);
        let b = desired(&c2, &facts(), &r2);
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(all_renders(&a), all_renders(&b));
        prop_assert_eq!(all_renders(&a), all_renders(&a.clone()));
    }

    /// `status` counts the rules of the read-back as nft does: one per rule of the model, not
    /// the lines of the table, its maps and sets, their elements or the chain headers.
    #[test]
    fn the_rule_count_of_a_listing_is_the_models(spec in spec()) {
        prop_assume!(valid(&spec));
        let (config, resolved) = build(&spec, 0);
        let set = desired(&config, &facts(), &resolved);
        let model = lower_mapped(&set).rules.len();
        prop_assert_eq!(nft::count_rules(&nft::render(&set)), model);
        prop_assert_eq!(count_installed(&nft::render(&set)), model);
    }

    #[test]
    fn plan_never_targets_our_own_or_unusable_addresses(spec in spec()) {
        prop_assume!(valid(&spec));
        let (config, resolved) = build(&spec, 0);
        let set = desired(&config, &facts(), &resolved);
        let own: Vec<IpAddr> = config.interface.addresses.iter().map(IpNet::addr).collect();
        let all = set.ingress.iter().map(|r| (r.family, &r.targets))
            .chain(set.egress.iter().map(|r| (r.family, &r.targets)));
        for (family, targets) in all {
            prop_assert!(!targets.is_empty() && targets.len() <= MAX_ADDRESSES_PER_TARGET);
            for t in targets {
                prop_assert!(!own.contains(t), "{} is our own address", t);
                prop_assert!(!t.is_loopback() && !t.is_unspecified() && !t.is_multicast());
                prop_assert_eq!(Family::of(*t), family);
                prop_assert_eq!(*t, t.to_canonical());
            }
        }
        for r in &set.egress {
            prop_assert!(own.contains(&r.snat_to) && Family::of(r.snat_to) == r.family);
        }
    }

    #[test]
    fn every_dnat_has_its_snat_or_masquerade_partner(spec in spec()) {
        prop_assume!(valid(&spec));
        let (config, resolved) = build(&spec, 0);
        let set = desired(&config, &facts(), &resolved);
        let rules = lower(&set);
        for dnat in rules.iter().filter(|r| matches!(r.verdict, Verdict::Dnat { .. })) {
            let Verdict::Dnat { targets, .. } = &dnat.verdict else { continue };
            let dst = Match::Daddr(targets.iter().map(|t| IpNet::from(*t)).collect());
            let partner = rules.iter().any(|r| {
                r.chain == Chain::Postrouting
                    && r.comment == dnat.comment
                    && matches!(r.verdict, Verdict::Snat(_) | Verdict::Masquerade)
                    && r.matches.contains(&dst)
            });
            prop_assert!(partner, "no partner for {:?}", dnat);
        }
        // The same holds in the rendered text, line by line and per comment.
        let nft_text = nft::render(&set);
        let (pre, post) = nft_text.split_once("chain postrouting").unwrap_or((&nft_text, ""));
        for line in pre.lines().filter(|l| l.contains(" dnat ")) {
            let comment = &line[line.find("comment").unwrap_or(0)..];
            prop_assert!(post.lines().any(|l| l.ends_with(comment)
                && (l.contains(" snat ") || l.contains(" masquerade "))), "{}", line);
        }
        for family in Family::ALL {
            let text = iptables::render(&set, family, &JumpState::default());
            for line in text.lines().filter(|l| l.contains("-j DNAT")) {
                let at = line.find("-m comment").unwrap_or(0);
                let comment = &line[at..line.find(" -j ").unwrap_or(line.len())];
                prop_assert!(text.lines().any(|l| l.starts_with("-A TG-tg0-POST ")
                    && l.contains(comment)
                    && (l.contains("-j SNAT") || l.contains("-j MASQUERADE"))), "{}", line);
            }
        }
    }

    #[test]
    fn installed_jumps_are_recognised_and_never_added_twice(spec in spec(), extra in 0..3usize) {
        prop_assume!(valid(&spec));
        let (config, resolved) = build(&spec, 0);
        let set = desired(&config, &facts(), &resolved);
        for family in Family::ALL {
            let first = iptables::render(&set, family, &JumpState::default());
            let state = iptables::parse_jumps(&set.tunnel, &fake_save(&first, extra));
            prop_assert_eq!(state.is_complete(), extra == 0);
            for c in Chain::ALL {
                prop_assert_eq!(state.jumps(c), 1 + extra);
            }
            let again = iptables::render(&set, family, &state);
            prop_assert!(!again.contains("-I "), "a jump was inserted again");
            let n = Chain::ALL.len();
            prop_assert_eq!(again.matches("-D ").count(), n * extra);
            let delete = iptables::render_delete(&set.tunnel, &state, family);
            prop_assert_eq!(delete.matches("-D ").count(), n * (1 + extra));
            prop_assert_eq!(delete.matches("-X ").count(), n);
        }
    }
}

/// What `iptables-save` would show after applying `restore` to an empty system, with the
/// jumps duplicated `extra` times, plus a foreign rule and counters.
fn fake_save(restore: &str, extra: usize) -> String {
    let mut out = String::from("# Generated by test\n");
    for line in restore.lines() {
        if let Some(rest) = line.strip_prefix("-I ") {
            let (builtin, target) = rest.split_once(" 1 ").unwrap_or((rest, ""));
            for _ in 0..=extra {
                out += &format!("[3:180] -A {builtin} {target}\n");
            }
            out += &format!("-A {builtin} -i eth9 {target}\n");
        } else if line.starts_with(':') {
            out += &line.replace("- [0:0]", "- [7:420]");
            out.push('\n');
        } else if !line.starts_with('#') {
            out += line;
            out.push('\n');
        }
    }
    out
}

fn rules_for(body: &str, resolved: &[(&str, Vec<IpAddr>)]) -> RuleSet {
    let text = format!(
        "[interface]\nprivate_key = \"{KEY}\"\naddresses = [\"100.64.0.1/32\", \"fd7a::1/128\"]\n{body}"
    );
    let config = Config::parse(&text, Path::new("/"), &NoFiles).expect("valid config");
    let resolved = resolved
        .iter()
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect();
    desired(&config, &facts(), &resolved)
}

#[test]
fn the_input_guard_comes_with_any_rule_and_with_a_health_port_beyond_loopback() {
    use crate::rules::desired::firewall_needed;
    let ingress = "[[ingress]]\ntarget = \"10.96.0.10\"\n";
    // (config after [interface], rules installed at all, input guard among them)
    let cases = [
        (String::new(), false, false), // health on 127.0.0.1:9002 by default
        ("[health]\nlisten = \"\"\n".into(), false, false),
        ("[health]\nlisten = \"[::1]:9002\"\n".into(), false, false),
        ("[health]\nlisten = \"0.0.0.0:9002\"\n".into(), true, true),
        ("[health]\nlisten = \"[::]:9002\"\n".into(), true, true),
        (
            "[health]\nlisten = \"100.64.0.1:9002\"\n".into(),
            true,
            true,
        ),
        (
            "[health]\nlisten = \"0.0.0.0:9002\"\nallow_from_tunnel = true\n".into(),
            false,
            false,
        ),
        (ingress.to_string(), true, true),
        ("[router]\nexit_node = true\n".into(), true, true),
        (
            format!("[health]\nlisten = \"[::]:9002\"\nallow_from_tunnel = true\n{ingress}"),
            true,
            false,
        ),
    ];
    for (body, needed, guard) in cases {
        let text = format!(
            "[interface]\nprivate_key = \"{KEY}\"\naddresses = [\"100.64.0.1/32\"]\n{body}"
        );
        let config = Config::parse(&text, Path::new("/"), &NoFiles).expect("valid config");
        assert_eq!(firewall_needed(&config), needed, "{body}");
        let facts = RuntimeFacts::fresh_start(&config, 51820);
        let set = desired(&config, &facts, &BTreeMap::new());
        assert_eq!(set.input_guard, guard, "{body}");
        let input: Vec<_> = lower(&set)
            .into_iter()
            .filter(|r| r.chain == Chain::Input)
            .collect();
        assert_eq!(!input.is_empty(), guard, "{body}");
        if guard {
            // The last word refuses everything else from the tunnel.
            let last = input.last().map(|r| (&r.matches, &r.verdict));
            let tunnel = Match::InIface {
                name: "tg0".into(),
                negate: false,
            };
            let reject = Verdict::Reject { tcp_reset: false };
            assert_eq!(last, Some((&vec![tunnel], &reject)), "{body}");
        }
    }
}

#[test]
fn a_huge_answer_is_capped_to_the_lowest_addresses_per_family() {
    let mut answer: Vec<IpAddr> = (0..=255u8)
        .rev()
        .map(|i| IpAddr::from([10, 0, 0, i]))
        .collect();
    answer.push("fd96::1".parse().expect("ip"));
    let set = rules_for(
        "[[ingress]]\ntarget_fqdn = \"big.example\"\n",
        &[("big.example", answer)],
    );
    let v4 = &set.ingress[0].targets;
    assert_eq!(v4.len(), MAX_ADDRESSES_PER_TARGET);
    assert_eq!(v4.iter().next(), Some(&IpAddr::from([10, 0, 0, 0])));
    assert_eq!(set.ingress[1].family, Family::V6, "v6 is not starved by v4");
}

#[test]
fn an_unresolved_name_gives_no_rule() {
    let set = rules_for("[[egress]]\ntarget_fqdn = \"later.example\"\n", &[]);
    assert!(set.egress.is_empty());
    let text = nft::render(&set);
    assert!(
        !text.contains("dnat") && !text.contains("egress: never"),
        "{text}"
    );
}

#[test]
fn owned_lines_keeps_only_our_chains_and_jumps_without_counters() {
    // Beside ours: kube-proxy's chains, a jump with matches, and the chains of two other
    // tunnelgates (`tg1`, and `tg0-PRE`, whose chain name starts with ours).
    let save = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [5:300]\n\
        :KUBE-SERVICES - [0:0]\n:TG-tg0-PRE - [2:120]\n:TG-tg1-PRE - [0:0]\n\
        :TG-tg0-PRE-PRE - [0:0]\n\
        [9:540] -A PREROUTING -j KUBE-SERVICES\n-A PREROUTING -j TG-tg1-PRE\n\
        -A PREROUTING -j TG-tg0-PRE-PRE\n[2:120] -A PREROUTING -j TG-tg0-PRE\n\
        -A PREROUTING -i eth0 -j TG-tg0-PRE\n\
        -A TG-tg1-PRE -d 100.64.1.1/32 -i tg1 -j DNAT --to-destination 10.0.0.2\n\
        -A TG-tg0-PRE-PRE -d 100.64.2.1/32 -i tg0-PRE -j DNAT --to-destination 10.0.0.3\n\
        [1:60] -A TG-tg0-PRE -d 100.64.0.1/32 -i tg0 -j DNAT --to-destination 10.0.0.1\n\
        COMMIT\n*filter\n:FORWARD DROP [0:0]\n-A FORWARD -j DOCKER-USER\nCOMMIT\n";
    assert_eq!(
        iptables::owned_lines("tg0", save),
        "*nat\n:TG-tg0-PRE - [0:0]\n-A PREROUTING -j TG-tg0-PRE\n\
         -A TG-tg0-PRE -d 100.64.0.1/32 -i tg0 -j DNAT --to-destination 10.0.0.1\n"
    );
    assert_eq!(
        iptables::owned_lines("tg1", save),
        "*nat\n:TG-tg1-PRE - [0:0]\n-A PREROUTING -j TG-tg1-PRE\n\
         -A TG-tg1-PRE -d 100.64.1.1/32 -i tg1 -j DNAT --to-destination 10.0.0.2\n"
    );
    assert_eq!(iptables::owned_lines("tg2", save), "", "nothing of tg2");
    let state = iptables::parse_jumps("tg0", save);
    assert_eq!(
        state.jumps(Chain::Prerouting),
        1,
        "a jump with matches is not ours"
    );
    assert!(state.has_chain(Chain::Prerouting) && !state.has_chain(Chain::Forward));
    assert!(!state.is_complete());
}

#[test]
fn rules_are_counted_as_nft_and_iptables_count_them() {
    // A listing as `nft list table` prints it: a map whose elements span lines, a chain
    // header with its policy, handles.
    let listing = "table inet tunnelgate_tg0 { # handle 7\n\
        \tmap eg4_tcp_dnat { # handle 2\n\t\ttype inet_service : ipv4_addr . inet_service\n\
        \t\telements = { 5432 : 100.64.0.2 . 5432,\n\t\t\t     8080 : 100.64.0.2 . 80 }\n\t}\n\n\
        \tchain prerouting { # handle 3\n\
        \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
        \t\tiifname \"lo\" return # handle 9\n\
        \t\tiifname != \"tg0\" dnat ip to tcp dport map @eg4_tcp_dnat # handle 10\n\t}\n\n\
        \tchain forward { # handle 4\n\
        \t\ttype filter hook forward priority filter; policy accept;\n\
        \t\tiifname \"tg0\" drop comment \"x\" # handle 11\n\t}\n}\n";
    assert_eq!(nft::count_rules(listing), 3);
    assert_eq!(nft::count_rules(&nft::normalize_listing(listing)), 3);
    assert_eq!(nft::count_rules(""), 0);
    let owned = "*nat\n:TG-tg0-PRE - [0:0]\n-A PREROUTING -j TG-tg0-PRE\n\
                 -A TG-tg0-PRE -i tg0 -j DNAT --to-destination 10.0.0.1\n*filter\n\
                 :TG-tg0-FWD - [0:0]\n-A TG-tg0-FWD -i tg0 -j DROP\n";
    assert_eq!(iptables::count_rules(owned), 3);
    assert_eq!(count_installed(owned), 3);
    assert_eq!(count_installed(listing), 3);
}

#[test]
fn nft_listing_normalization_drops_handles_and_counters() {
    let listing = "table inet tunnelgate_tg0 { # handle 7\n\tchain forward { # handle 3\n\
        \t\ttype filter hook forward priority filter; policy accept;\n\
        \t\tiifname \"tg0\" counter packets 12 bytes 3400 drop comment \"x\" # handle 9\n\t}\n}\n";
    assert_eq!(
        nft::normalize_listing(listing),
        "table inet tunnelgate_tg0 {\n\tchain forward {\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"tg0\" drop comment \"x\"\n\t}\n}\n"
    );
}

#[test]
fn delete_scripts_name_only_what_we_own() {
    assert_eq!(
        nft::render_delete("tg0"),
        "table inet tunnelgate_tg0 {}\ndelete table inet tunnelgate_tg0\n"
    );
    let text = iptables::render_delete("tg0", &JumpState::default(), Family::V4);
    assert!(!text.contains("-D "), "nothing to delete: {text}");
    for line in text.lines().filter(|l| l.starts_with([':', '-'])) {
        let name = line
            .trim_start_matches(':')
            .split_whitespace()
            .find(|w| w.starts_with("TG-"));
        assert!(
            matches!(
                name,
                Some("TG-tg0-PRE" | "TG-tg0-POST" | "TG-tg0-FWD" | "TG-tg0-MSS" | "TG-tg0-IN")
            ),
            "{line}"
        );
    }
}

mod instances;
mod maps;
