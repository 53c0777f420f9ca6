//! Golden files for the firewall renderers: each case's rendered nftables script and
//! iptables-restore input must equal `tests/golden/<case>.nft` / `.iptables` byte for byte.
//! `UPDATE_GOLDEN=1 cargo test --test rules_golden` rewrites them; review the diff by eye.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use tunnelgate::config::{Config, SecretFiles};
use tunnelgate::rules::desired::{desired, RuntimeFacts};
use tunnelgate::rules::iptables::{self, JumpState};
use tunnelgate::rules::{nft, Family, RuleSet};

const KEY: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";

struct NoFiles;

impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("no files in golden tests".into())
    }
}

/// A config with a v4 and a v6 tunnel address, WireGuard on 51820 and health on 9002.
fn config(body: &str) -> Config {
    let text = format!(
        "[interface]\nname = \"tg0\"\nprivate_key = \"{KEY}\"\nlisten_port = 51820\n\
         addresses = [\"100.64.0.1/32\", \"fd7a:115c:a1e0::1/128\"]\n{body}"
    );
    Config::parse(&text, Path::new("/etc/tunnelgate"), &NoFiles).expect("golden config is valid")
}

fn rules(body: &str, resolved: &[(&str, &[&str])]) -> RuleSet {
    let resolved: BTreeMap<String, Vec<IpAddr>> = resolved
        .iter()
        .map(|(name, ips)| {
            let ips = ips
                .iter()
                .map(|s| s.parse().expect("test address"))
                .collect();
            (name.to_string(), ips)
        })
        .collect();
    let config = config(body);
    let facts = RuntimeFacts {
        wg_port: 51820,
        health_port: Some(9002),
        health_beyond_loopback: tunnelgate::rules::desired::health_beyond_loopback(&config),
    };
    desired(&config, &facts, &resolved)
}

/// Every case: (name, config after [interface], DNS answers).
pub fn cases() -> Vec<(&'static str, RuleSet)> {
    vec![
        ("baseline", rules("", &[])),
        (
            "ingress_all_ports",
            rules(
                "[[ingress]]\ntarget = \"10.96.0.10\"\n[[ingress]]\ntarget = \"fd96::10\"\n",
                &[],
            ),
        ),
        (
            "ingress_mapped_ports",
            rules(
                "[[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"443:8443\", \"80\", \"5353:53/udp\", \"53/udp\"]\n\
                 [[ingress]]\ntarget = \"fd96::10\"\nports = [\"80:8080\"]\n",
                &[],
            ),
        ),
        (
            "egress_ports",
            rules(
                "[[egress]]\ntarget = \"100.64.0.2\"\nports = [\"5432\", \"8080:80\"]\n\
                 [[egress]]\ntarget = \"fd7a:115c:a1e0::2\"\nports = [\"53/udp\"]\n",
                &[],
            ),
        ),
        // Kubernetes at scale in miniature: several Services per family, TCP and UDP, both
        // directions, beside a Service spread over two addresses (a rule of its own).
        (
            "services_maps_both_families",
            rules(
                "[[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"80\", \"443:8443\", \"53/udp\"]\n\
                 [[ingress]]\ntarget = \"10.96.0.11\"\nports = [\"8080:80\"]\n\
                 [[ingress]]\ntarget = \"fd96::10\"\nports = [\"81:80\", \"5353:53/udp\"]\n\
                 [[ingress]]\ntarget = \"fd96::11\"\nports = [\"82\"]\n\
                 [[ingress]]\ntarget_fqdn = \"spread.example\"\nports = [\"9000\"]\n\
                 [[egress]]\ntarget = \"100.64.0.2\"\nports = [\"5432\", \"8081:80\"]\n\
                 [[egress]]\ntarget = \"fd7a:115c:a1e0::2\"\nports = [\"5433:5432\", \"54/udp\"]\n",
                &[("spread.example", &["10.1.0.1", "10.1.0.2"])],
            ),
        ),
        (
            "egress_all_ports",
            rules("[[egress]]\ntarget = \"100.64.0.2\"\n", &[]),
        ),
        (
            "fqdn_three_v4",
            rules(
                "[[ingress]]\ntarget_fqdn = \"db.example.internal\"\nports = [\"443:8443\"]\n\
                 [[egress]]\ntarget_fqdn = \"api.peer.internal\"\n",
                &[
                    ("db.example.internal", &["10.1.0.3", "10.1.0.1", "10.1.0.2"]),
                    ("api.peer.internal", &["100.64.0.7", "100.64.0.5", "100.64.0.6"]),
                ],
            ),
        ),
        (
            "fqdn_aaaa_only",
            rules(
                "[[ingress]]\ntarget_fqdn = \"v6only.example.internal\"\nports = [\"80\"]\n",
                &[("v6only.example.internal", &["fd96::b", "fd96::a"])],
            ),
        ),
        (
            "router_snat",
            rules(
                "[router]\nadvertise_routes = [\"10.40.0.0/14\", \"192.168.7.0/24\", \"fd00:40::/48\"]\n",
                &[],
            ),
        ),
        (
            "router_no_snat",
            rules(
                "[router]\nadvertise_routes = [\"10.40.0.0/14\", \"fd00:40::/48\"]\nsnat = false\n",
                &[],
            ),
        ),
        ("exit_node", rules("[router]\nexit_node = true\n", &[])),
        // An exit node kept off the private networks, except the one LAN it advertises.
        (
            "exit_node_no_lan",
            rules(
                "[router]\nexit_node = true\nexit_node_lan = false\nadvertise_routes = [\"192.168.1.0/24\"]\n",
                &[],
            ),
        ),
        (
            "mss_clamp_off",
            rules(
                "[firewall]\nmss_clamp = false\n[[ingress]]\ntarget = \"10.96.0.10\"\n",
                &[],
            ),
        ),
        // No forwarding, but the health endpoint on every address: only the input guard
        // (and the forward baseline) are installed.
        (
            "health_exposed",
            rules("[health]\nlisten = \"0.0.0.0:9002\"\n", &[]),
        ),
        (
            "allow_from_tunnel",
            rules(
                "[health]\nlisten = \"[::]:9002\"\nallow_from_tunnel = true\n\
                 [[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"80\"]\n",
                &[],
            ),
        ),
    ]
}

/// Both families in one file, each part starting with its `# tunnelgate: ipvN` header line.
pub fn render_iptables(set: &RuleSet) -> String {
    let fresh = JumpState::default();
    iptables::render(set, Family::V4, &fresh) + &iptables::render(set, Family::V6, &fresh)
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn check(path: &Path, actual: &str, failures: &mut Vec<String>) {
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(path, actual).expect("write golden file");
        return;
    }
    match std::fs::read_to_string(path) {
        Ok(expected) if expected == actual => {}
        Ok(expected) => failures.push(format!(
            "{} differs (UPDATE_GOLDEN=1 to rewrite):\n--- expected\n{expected}\n--- actual\n{actual}",
            path.display()
        )),
        Err(e) => failures.push(format!("{}: {e}", path.display())),
    }
}

#[test]
fn renderers_match_golden_files() {
    let mut failures = Vec::new();
    for (name, set) in cases() {
        let dir = golden_dir();
        check(
            &dir.join(format!("{name}.nft")),
            &nft::render(&set),
            &mut failures,
        );
        check(
            &dir.join(format!("{name}.iptables")),
            &render_iptables(&set),
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_golden_file_belongs_to_a_case() {
    let names: Vec<String> = cases().iter().map(|(n, _)| n.to_string()).collect();
    for entry in std::fs::read_dir(golden_dir()).expect("golden dir") {
        let path = entry.expect("dir entry").path();
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        assert!(
            names.iter().any(|n| n == stem),
            "{} has no case: delete it or add the case",
            path.display()
        );
    }
}
