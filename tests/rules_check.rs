//! The rendered rules against the real tools, each test in its own throwaway network
//! namespace (the harness's `Netns`, deleted afterwards): every golden file is accepted
//! by `nft -c` / `iptables-restore --test`, applying twice leaves no duplicates, a changed set
//! replaces the old one exactly, and removal leaves nothing of ours and every foreign rule.
//! Needs root, `ip`, `nft` and `iptables`: run with `cargo test --test rules_check -- --ignored`.

mod common;

use common::Netns;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::process::Command;
use tunnelgate::config::{Config, SecretFiles};
use tunnelgate::rules::desired::{desired, RuntimeFacts};
use tunnelgate::rules::iptables::{self, JumpState};
use tunnelgate::rules::{model, nft, Family, RuleSet};

const KEY: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";

/// `program args` with `stdin` in the namespace (the harness's [`Netns`]); panics with its
/// stderr on failure.
trait RunIn {
    fn run(&self, program: &str, args: &[&str], stdin: &str) -> String;
    fn try_run(&self, program: &str, args: &[&str], stdin: &str) -> Result<String, String>;
}

impl RunIn for Netns {
    fn run(&self, program: &str, args: &[&str], stdin: &str) -> String {
        self.try_run(program, args, stdin)
            .unwrap_or_else(|e| panic!("{program} {args:?} failed: {e}\n--- stdin\n{stdin}"))
    }

    fn try_run(&self, program: &str, args: &[&str], stdin: &str) -> Result<String, String> {
        let mut all = vec![program];
        all.extend_from_slice(args);
        self.try_exec_stdin(&all, stdin)
    }
}

struct NoFiles;

impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("none".into())
    }
}

fn rules(body: &str, resolved: &[(&str, &[&str])]) -> RuleSet {
    let text = format!(
        "[interface]\nprivate_key = \"{KEY}\"\nlisten_port = 51820\n\
         addresses = [\"100.64.0.1/32\", \"fd7a::1/128\"]\n{body}"
    );
    let config = Config::parse(&text, Path::new("/"), &NoFiles).expect("valid config");
    let resolved: BTreeMap<String, Vec<IpAddr>> = resolved
        .iter()
        .map(|(n, ips)| {
            let ips = ips
                .iter()
                .map(|s| s.parse().expect("test address"))
                .collect();
            (n.to_string(), ips)
        })
        .collect();
    let facts = RuntimeFacts {
        wg_port: 51820,
        health_port: Some(9002),
        health_beyond_loopback: tunnelgate::rules::desired::health_beyond_loopback(&config),
    };
    desired(&config, &facts, &resolved)
}

/// Every rule kind at once, v4 and v6, several targets, mapped ports.
fn set_a() -> RuleSet {
    rules(
        "[[ingress]]\ntarget_fqdn = \"db.example\"\nports = [\"443:8443\", \"53/udp\"]\n\
         [[egress]]\ntarget = \"100.64.0.2\"\nports = [\"5432\"]\n\
         [[egress]]\ntarget = \"fd7a::2\"\n\
         [router]\nadvertise_routes = [\"10.40.0.0/14\", \"fd00:40::/48\"]\n",
        &[(
            "db.example",
            &["10.1.0.1", "10.1.0.2", "10.1.0.3", "fd96::a"],
        )],
    )
}

/// A changed set: a name re-resolved, a rule gone, exit node on, MSS clamp off.
fn set_b() -> RuleSet {
    rules(
        "[firewall]\nmss_clamp = false\n\
         [[ingress]]\ntarget_fqdn = \"db.example\"\nports = [\"443:8443\", \"53/udp\"]\n\
         [router]\nexit_node = true\n",
        &[("db.example", &["10.1.0.2", "10.1.0.4"])],
    )
}

fn golden_files(ext: &str) -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("golden dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no golden .{ext} files");
    files
}

#[test]
#[ignore = "needs root and nft/iptables"]
fn every_golden_file_is_accepted_by_the_real_tools() {
    let ns = Netns::new();
    for path in golden_files("nft") {
        let text = std::fs::read_to_string(&path).expect("read golden");
        ns.run("nft", &["-c", "-f", "-"], &text);
    }
    for path in golden_files("iptables") {
        let text = std::fs::read_to_string(&path).expect("read golden");
        let at = text
            .find("# tunnelgate: ipv6")
            .unwrap_or_else(|| panic!("{} has no ipv6 part", path.display()));
        let (v4, v6) = text.split_at(at);
        ns.run("iptables-restore", &["--test", "--noflush"], v4);
        ns.run("ip6tables-restore", &["--test", "--noflush"], v6);
    }
}

/// The rule lines of our table as nft lists them; the rendered MSS match is spelled the way
/// older nft versions also accept, which nft 1.0.6+ lists in its newer form. A map's elements
/// (rendered one per line, listed as many per line as fit) become one sorted line, and the
/// `meta l4proto` that gives `ct original proto-dst` its type in a lookup key (which nft lists
/// without, the port match implying it) is dropped.
fn nft_rule_lines(text: &str) -> Vec<String> {
    let start = text.rfind("table inet tunnelgate_tg0 {\n").unwrap_or(0);
    let listing = nft::normalize_listing(&text[start..])
        .replace("tcp flags & (syn | rst) == syn", "tcp flags syn / syn,rst")
        .replace("meta l4proto tcp ct status dnat", "ct status dnat")
        .replace("meta l4proto udp ct status dnat", "ct status dnat");
    let mut out = Vec::new();
    let mut elements: Option<String> = None;
    for line in listing.lines() {
        let t = line.trim();
        let acc = match (elements.as_mut(), t.strip_prefix("elements = {")) {
            (Some(acc), _) => {
                acc.push(' ');
                acc.push_str(t);
                acc
            }
            (None, Some(rest)) => elements.insert(rest.to_string()),
            (None, None) => {
                out.push(line.to_string());
                continue;
            }
        };
        if acc.trim_end().ends_with('}') {
            let inner = acc.trim().trim_end_matches('}');
            let mut items: Vec<&str> = inner
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .collect();
            items.sort_unstable();
            out.push(format!("elements = {{ {} }}", items.join(", ")));
            elements = None;
        }
    }
    out
}

#[test]
#[ignore = "needs root and nft/iptables"]
fn nft_apply_replaces_the_table_atomically_and_removal_keeps_foreign_rules() {
    let ns = Netns::new();
    let foreign = "table inet foreign {\n\tchain forward {\n\
        \t\ttype filter hook forward priority filter; policy accept;\n\
        \t\tiifname \"eth9\" accept\n\t}\n}\n";
    ns.run("nft", &["-f", "-"], foreign);
    // Another tunnelgate, for interface tg1, runs beside us: we never touch its table.
    let neighbour = other_instance();
    ns.run("nft", &["-f", "-"], &nft::render(&neighbour));
    let list_neighbour = || ns.run("nft", &["list", "table", "inet", "tunnelgate_tg1"], "");
    let neighbour_before = nft::normalize_listing(&list_neighbour());
    let list = || ns.run("nft", &["list", "table", "inet", "tunnelgate_tg0"], "");
    let (a, b) = (set_a(), set_b());

    ns.run("nft", &["-f", "-"], &nft::render(&a));
    let first = nft::normalize_listing(&list());
    assert_eq!(nft_rule_lines(&first), nft_rule_lines(&nft::render(&a)));
    let lowered = model::lower_mapped(&a);
    let elements: usize = lowered.maps.iter().map(|m| m.elements.len()).sum();
    assert_eq!(
        first.matches(" comment \"").count(),
        lowered.rules.len() + elements,
        "one installed rule per model rule, one element per map element"
    );
    ns.run("nft", &["-f", "-"], &nft::render(&a));
    assert_eq!(
        nft::normalize_listing(&list()),
        first,
        "reapply changed something"
    );

    ns.run("nft", &["-f", "-"], &nft::render(&b));
    let changed = nft::normalize_listing(&list());
    ns.run("nft", &["-f", "-"], &nft::render_delete("tg0"));
    ns.run("nft", &["-f", "-"], &nft::render(&b));
    assert_eq!(
        nft::normalize_listing(&list()),
        changed,
        "update differs from fresh"
    );

    ns.run("nft", &["-f", "-"], &nft::render_delete("tg0"));
    ns.run("nft", &["-f", "-"], &nft::render_delete("tg0"));
    let tables = ns.run("nft", &["list", "tables"], "");
    assert!(!tables.contains("tunnelgate_tg0"), "{tables}");
    let left = ns.run("nft", &["list", "table", "inet", "foreign"], "");
    assert_eq!(
        nft::normalize_listing(&left),
        nft::normalize_listing(foreign)
    );
    assert_eq!(
        nft::normalize_listing(&list_neighbour()),
        neighbour_before,
        "tg1's table changed"
    );
}

/// `set_a` as the daemon for interface `tg1` would install it.
fn other_instance() -> RuleSet {
    let mut set = set_a();
    set.tunnel = "tg1".into();
    set
}

/// The restore and save tools of each family, for the default and (if present) legacy iptables.
fn iptables_tools() -> Vec<(Family, String, String)> {
    let mut tools = Vec::new();
    for variant in ["", "-legacy"] {
        for (family, base) in [(Family::V4, "iptables"), (Family::V6, "ip6tables")] {
            let restore = format!("{base}{variant}-restore");
            let found = Command::new(&restore)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if found || variant.is_empty() {
                tools.push((family, restore, format!("{base}{variant}-save")));
            }
        }
    }
    tools
}

#[test]
#[ignore = "needs root and nft/iptables"]
fn iptables_apply_is_idempotent_and_removal_keeps_foreign_rules() {
    for (family, restore, save) in iptables_tools() {
        let ns = Netns::new();
        let foreign = "*nat\n:FOREIGN - [0:0]\n-A PREROUTING -j FOREIGN\n\
            -A FOREIGN -i eth9 -j RETURN\nCOMMIT\n*filter\n-A FORWARD -i eth9 -j ACCEPT\nCOMMIT\n";
        ns.run(&restore, &["--noflush"], foreign);
        let neighbour = other_instance();
        let fresh = JumpState::default();
        ns.run(
            &restore,
            &["--noflush"],
            &iptables::render(&neighbour, family, &fresh),
        );
        let saved = || ns.run(&save, &[], "");
        let neighbour_before = iptables::owned_lines("tg1", &saved());
        assert!(iptables::parse_jumps("tg1", &saved()).is_complete());
        let foreign_lines = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.contains("FOREIGN") || l.contains("eth9"))
                .map(str::to_string)
                .collect()
        };
        let before = foreign_lines(&saved());
        let apply = |set: &RuleSet| {
            let state = iptables::parse_jumps("tg0", &saved());
            let text = iptables::render(set, family, &state);
            ns.run(&restore, &["--noflush"], &text);
            text
        };
        let (a, b) = (set_a(), set_b());

        let text = apply(&a);
        let first = iptables::owned_lines("tg0", &saved());
        assert!(
            iptables::parse_jumps("tg0", &saved()).is_complete(),
            "{restore}: {first}"
        );
        let our_rules = |t: &str| -> Vec<String> {
            let mut v: Vec<String> = t
                .lines()
                .filter(|l| l.starts_with("-A TG-tg0-"))
                .map(str::to_string)
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            our_rules(&first),
            our_rules(&text),
            "{restore}: saved != rendered"
        );
        apply(&a);
        assert_eq!(
            iptables::owned_lines("tg0", &saved()),
            first,
            "{restore}: reapply"
        );

        apply(&b);
        let changed = iptables::owned_lines("tg0", &saved());
        let state = iptables::parse_jumps("tg0", &saved());
        ns.run(
            &restore,
            &["--noflush"],
            &iptables::render_delete("tg0", &state, family),
        );
        apply(&b);
        assert_eq!(
            iptables::owned_lines("tg0", &saved()),
            changed,
            "{restore}: update != fresh"
        );

        for _ in 0..2 {
            let state = iptables::parse_jumps("tg0", &saved());
            ns.run(
                &restore,
                &["--noflush"],
                &iptables::render_delete("tg0", &state, family),
            );
        }
        assert_eq!(
            iptables::owned_lines("tg0", &saved()),
            "",
            "{restore}: removal left rules"
        );
        assert_eq!(iptables::parse_jumps("tg0", &saved()), JumpState::default());
        assert_eq!(
            foreign_lines(&saved()),
            before,
            "{restore}: foreign rules changed"
        );
        assert_eq!(
            iptables::owned_lines("tg1", &saved()),
            neighbour_before,
            "{restore}: tg1's chains changed"
        );
    }
}
