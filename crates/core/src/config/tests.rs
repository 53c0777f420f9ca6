//! Config validation: every key's good and bad values, errors naming key, value and expectation.

use super::*;
use std::collections::BTreeMap;
use std::path::PathBuf;

const KEY_A: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
const PUB_B: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const PUB_C: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

struct MapFiles(BTreeMap<PathBuf, Result<String, String>>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(path)
            .cloned()
            .unwrap_or_else(|| Err("no such file".into()))
    }
}

fn no_files() -> MapFiles {
    MapFiles(BTreeMap::new())
}

fn parse(text: &str) -> Result<Config, ConfigErrors> {
    Config::parse(text, Path::new("/etc/tg"), &no_files())
}

fn minimal(extra: &str) -> String {
    format!("[interface]\nprivate_key = \"{KEY_A}\"\naddresses = [\"100.64.0.1/32\", \"fd7a::1/128\"]\n{extra}")
}

/// Asserts that parsing fails with an error on `key` whose text contains every `needle`.
fn assert_error(text: &str, key: &str, needles: &[&str]) {
    let errs = parse(text).expect_err("config should be invalid").0;
    let hit = errs.iter().find(|e| e.key == key);
    let hit = hit.unwrap_or_else(|| panic!("no error for {key}; got {errs:?}"));
    for n in needles {
        assert!(
            hit.problem.contains(n),
            "error for {key} lacks {n:?}: {}",
            hit.problem
        );
    }
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(&minimal("")).expect("valid");
    assert_eq!(c.interface.name, "tg0");
    assert_eq!(c.interface.mtu, DEFAULT_MTU);
    assert_eq!(c.interface.listen_port, 0);
    assert!(c.peers.is_empty(), "a config with no peers is valid");
    assert_eq!(c.firewall.mode, FirewallMode::Auto);
    assert!(c.firewall.mss_clamp);
    assert_eq!(c.dns.reresolve_interval, DEFAULT_RERESOLVE_INTERVAL);
    assert!(c.router.snat && !c.router.exit_node);
    assert_eq!(
        c.health.listen,
        Some("127.0.0.1:9002".parse().expect("addr"))
    );
}

#[test]
fn example_files_parse() {
    // The repository's shipped configs (this crate lives in crates/core).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
    let mut files = BTreeMap::new();
    files.insert(dir.join("private.key"), Ok(KEY_A.to_string()));
    files.insert(dir.join("psk"), Ok(PUB_C.to_string()));
    let files = MapFiles(files);
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("config dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).expect("read");
            if let Err(e) = Config::parse(&text, &dir, &files) {
                panic!("{}: {e}", path.display());
            }
            seen += 1;
        }
    }
    assert!(seen >= 1);
}

#[test]
fn key_file_is_read_relative_to_config() {
    let mut files = BTreeMap::new();
    files.insert(
        PathBuf::from("/etc/tg/private.key"),
        Ok(format!("{KEY_A}\n")),
    );
    let text = "[interface]\nprivate_key_file = \"private.key\"\naddresses = [\"100.64.0.1/32\"]\n";
    let c = Config::parse(text, Path::new("/etc/tg"), &MapFiles(files)).expect("valid");
    assert_eq!(c.interface.private_key.expose_base64(), KEY_A);
    let mut files = BTreeMap::new();
    files.insert(
        PathBuf::from("/etc/tg/private.key"),
        Err("is readable by group or others (mode 0644): expected mode 0600".to_string()),
    );
    let errs = Config::parse(text, Path::new("/etc/tg"), &MapFiles(files)).expect_err("open key");
    assert_eq!(errs.0[0].key, "interface.private_key_file");
    assert!(errs.0[0].problem.contains("0600"));
}

#[test]
fn secret_values_are_never_echoed() {
    let text = "[interface]\nprivate_key = \"c2VjcmV0LXZhbHVlLXNob3VsZC1ub3QtbGVhaw==\"\naddresses = [\"100.64.0.1/32\"]\n";
    let msg = parse(text).expect_err("short key").to_string();
    assert!(!msg.contains("c2VjcmV0"), "{msg}");
    assert!(msg.contains("interface.private_key"), "{msg}");
    assert!(!format!("{:?}", parse(&minimal("")).expect("valid")).contains(KEY_A));
}

#[test]
fn bad_interface_values_name_their_key() {
    assert_error(
        "[interface]\naddresses=[\"100.64.0.1/32\"]\n",
        "interface.private_key",
        &["missing"],
    );
    assert_error(
        &minimal("name = \"a-very-long-interface-name\""),
        "interface.name",
        &["a-very-long", "15"],
    );
    assert_error(
        &minimal("listen_port = 70000"),
        "interface.listen_port",
        &["70000", "65535"],
    );
    assert_error(&minimal("mtu = 1000"), "interface.mtu", &["1000", "1280"]);
    assert_error(
        &format!("[interface]\nprivate_key = \"{KEY_A}\"\naddresses = [\"100.64.0.300/32\"]\n"),
        "interface.addresses[0]",
        &["100.64.0.300"],
    );
    assert_error(
        &minimal("colour = \"blue\""),
        "interface.colour",
        &["unknown field", "colour"],
    );
    assert_error(
        &minimal("listen_port = \"abc\""),
        "interface.listen_port",
        &["\"abc\"", "expected"],
    );
}

#[test]
fn bad_takeover_values_name_their_key() {
    let with = |extra: &str| minimal("").to_string() + "\n[takeover]\n" + extra + "\n";
    assert_error(
        &with("group_listen = \"not an address\""),
        "takeover.group_listen",
        &["not an address", "IP:port"],
    );
    assert_error(
        &with("group_listen = \"[::]:51821\""),
        "takeover.group_replicas",
        &["missing"],
    );
    assert_error(
        &with("group_replicas = \"tgp.default.svc:51821\""),
        "takeover.group_listen",
        &["missing"],
    );
    assert_error(
        &with("group_listen = \"[::]:51821\"\ngroup_replicas = \"tgp:0\""),
        "takeover.group_replicas",
        &["tgp:0"],
    );
    assert_error(
        &with("state_file = \"/var/lib/tunnelgate/\""),
        "takeover.state_file",
        &["not a file path"],
    );
    assert_error(
        &with("answer_any_source = 1"),
        "takeover.answer_any_source",
        &["expected"],
    );
    assert_error(&with("colour = 1"), "takeover.colour", &["unknown field"]);
    let fine = parse(&with(
        "answer_any_source = true\nstate_file = \"tg0.endpoints\"\ngroup_listen = \"[::]:51821\"\ngroup_replicas = \"tgp.default.svc:51821\"",
    ))
    .expect("valid");
    assert_eq!(fine.takeover.answer, crate::takeover::Answer::AnySource);
    assert_eq!(
        fine.takeover.state_file,
        StateFile::Path(PathBuf::from("/etc/tg/tg0.endpoints")),
        "relative to the config file"
    );
    assert_eq!(fine.takeover.group.map(|g| g.listen.port()), Some(51821));
    let off = parse(&with("state_file = \"\"")).expect("valid");
    assert_eq!(off.takeover.state_file, StateFile::Off);
    assert_eq!(
        parse(&minimal("")).expect("valid").takeover,
        Takeover::default()
    );
}

/// `[peer]` for `[[peer]]` is the classic TOML slip: the error says which section and the fix,
/// not serde's "invalid type: map, expected a sequence".
#[test]
fn a_single_table_where_an_array_of_tables_is_meant_says_use_double_brackets() {
    let text = minimal(&format!(
        "[peer]\npublic_key = \"{PUB_B}\"\nallowed_ips = [\"100.64.0.2/32\"]\n"
    ));
    let errs = parse(&text).expect_err("[peer] is refused").0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].key, "peer");
    assert!(
        errs[0]
            .problem
            .contains("use [[peer]] (an array of tables)"),
        "{}",
        errs[0].problem
    );
    assert!(
        !errs[0].problem.contains("invalid type"),
        "{}",
        errs[0].problem
    );
    assert_error(
        &minimal("[ingress]\ntarget = \"10.0.0.1\"\n"),
        "ingress",
        &["use [[ingress]]"],
    );
    assert_error(
        &minimal("[egress]\ntarget = \"100.64.0.2\"\n"),
        "egress",
        &["use [[egress]]"],
    );
}

#[test]
fn bad_peers_name_their_key() {
    let peer = |body: &str| minimal(&format!("[[peer]]\n{body}\n"));
    assert_error(&peer("allowed_ips=[]"), "peer[0].public_key", &["missing"]);
    assert_error(
        &peer("public_key = \"abc\""),
        "peer[0].public_key",
        &["\"abc\"", "base64"],
    );
    let typed = format!(
        "[[peer]]\npublic_key = \"{PUB_B}\"\n[[peer]]\npublic_key = \"{PUB_C}\"\npersistent_keepalive = \"25\"\n"
    );
    assert_error(
        &minimal(&typed),
        "peer[1].persistent_keepalive",
        &["\"25\""],
    );
    assert_error(
        &peer(&format!(
            "public_key = \"{PUB_B}\"\nallowed_ips = [\"10.0.0.1/33\"]"
        )),
        "peer[0].allowed_ips[0]",
        &["10.0.0.1/33", "CIDR"],
    );
    assert_error(
        &peer(&format!(
            "public_key = \"{PUB_B}\"\nallowed_ips = [\"10.0.0.1/8\"]"
        )),
        "peer[0].allowed_ips[0]",
        &["host bits", "10.0.0.0/8"],
    );
    assert_error(
        &peer(&format!("public_key = \"{PUB_B}\"\nendpoint = \"1.2.3.4\"")),
        "peer[0].endpoint",
        &["port"],
    );
    assert_error(
        &peer(&format!(
            "public_key = \"{PUB_B}\"\nendpoint = \"1.2.3.4:0\""
        )),
        "peer[0].endpoint",
        &["no valid port"],
    );
    assert_error(
        &peer(&format!(
            "public_key = \"{PUB_B}\"\npersistent_keepalive = -1"
        )),
        "peer[0].persistent_keepalive",
        &["-1"],
    );
    let dup = minimal(&format!(
        "[[peer]]\npublic_key = \"{PUB_B}\"\n[[peer]]\npublic_key = \"{PUB_B}\"\n"
    ));
    assert_error(&dup, "peer[1].public_key", &["peer[0]"]);
    let same_net = minimal(&format!(
        "[[peer]]\npublic_key = \"{PUB_B}\"\nallowed_ips=[\"10.0.0.0/24\"]\n[[peer]]\npublic_key = \"{PUB_C}\"\nallowed_ips=[\"10.0.0.0/24\"]\n"
    ));
    assert_error(&same_net, "peer[1].allowed_ips[0]", &["peer[0]"]);
}

#[test]
fn peer_endpoints_accept_addresses_and_names() {
    let c = parse(&minimal(&format!(
        "[[peer]]\npublic_key = \"{PUB_B}\"\nendpoint = \"[2001:db8::1]:51820\"\n[[peer]]\npublic_key = \"{PUB_C}\"\nendpoint = \"VPN.example.com.:51820\"\n"
    )))
    .expect("valid");
    assert_eq!(
        c.peers[0].endpoint,
        Some(Endpoint::Addr("[2001:db8::1]:51820".parse().expect("addr")))
    );
    assert_eq!(
        c.peers[1].endpoint,
        Some(Endpoint::Host {
            host: "vpn.example.com".into(),
            port: 51820
        })
    );
}

#[test]
fn forwarding_rules_are_checked() {
    assert_error(
        &minimal("[[ingress]]\ntarget = \"100.64.0.1\""),
        "ingress[0].target",
        &["own tunnel"],
    );
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nports = [\"80/sctp\"]"),
        "ingress[0].ports[0]",
        &["sctp"],
    );
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nports = [\"99999\"]"),
        "ingress[0].ports[0]",
        &["99999"],
    );
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nports=[\"80\"]\n[[ingress]]\ntarget = \"10.0.0.2\"\nports=[\"80:81\"]"),
        "ingress[1].ports",
        &["ingress[0]"],
    );
    assert_error(&minimal("[[ingress]]\ntarget = \"10.0.0.1\"\n[[ingress]]\ntarget = \"10.0.0.2\"\nports=[\"81\"]"), "ingress[1].ports", &["overlap"]);
    // The error names the port and the address both rules listen on.
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nports=[\"443\", \"80\"]\n[[ingress]]\ntarget = \"10.0.0.2\"\nports=[\"8080\", \"80:81\"]"),
        "ingress[1].ports",
        &["ingress[0]", "port 80/tcp", "100.64.0.1"],
    );
    assert_error(
        &minimal("[[ingress]]\ntarget = \"fd96::1\"\n[[ingress]]\ntarget_fqdn = \"db.example\"\nports=[\"53/udp\"]"),
        "ingress[1].ports",
        &["port 53/udp", "fd7a::1"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget = \"100.64.0.2\"\nports=[\"5432\"]\n[[egress]]\ntarget = \"100.64.0.3\"\nports=[\"5432:5433\"]"),
        "egress[1].ports",
        &["egress[0]", "port 5432/tcp", "this host's IPv4 addresses"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget_fqdn = \"bad..name\""),
        "egress[0].target_fqdn",
        &["bad..name"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget = \"10.0.0.1\"\ntarget_fqdn = \"a.b\""),
        "egress[0]",
        &["exactly one"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget = \"100.64.0.2\"\nports = [\"9002\"]"),
        "egress[0].ports[0]",
        &["health"],
    );
    // A rule repeating its own listen port names the repeat; the same port on the other
    // protocol, or the same target port twice, is fine.
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nports = [\"80\", \"81\", \"80:8080\"]"),
        "ingress[0].ports[2]",
        &["\"80:8080\"", "repeats a listen port"],
    );
    let ok = parse(&minimal(
        "[[ingress]]\ntarget = \"10.0.0.1\"\nports = [\"80\", \"80/udp\", \"81:80\"]",
    ));
    assert!(ok.is_ok(), "{ok:?}");
    let v4_only = format!("[interface]\nprivate_key = \"{KEY_A}\"\naddresses = [\"100.64.0.1/32\"]\n[[ingress]]\ntarget = \"fd96::10\"\n");
    assert_error(&v4_only, "ingress[0].target", &["IPv6"]);
    // Different families or different ports on one rule set do not overlap.
    let ok = parse(&minimal(
        "[[ingress]]\ntarget = \"10.0.0.1\"\n[[ingress]]\ntarget = \"fd96::10\"\n[[egress]]\ntarget = \"100.64.0.2\"\nports=[\"80\"]\n[[egress]]\ntarget = \"100.64.0.3\"\nports=[\"80/udp\",\"8080:80\"]",
    ));
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn router_dns_health_and_firewall_are_checked() {
    assert_error(
        &minimal("[router]\nexit_node_lan = false"),
        "router.exit_node_lan",
        &["exit_node = true"],
    );
    let c = parse(&minimal(
        "[router]\nexit_node = true\nexit_node_lan = false",
    ))
    .expect("valid");
    assert!(c.router.exit_node && !c.router.exit_node_lan);
    let c = parse(&minimal("[router]\nexit_node = true")).expect("valid");
    assert!(c.router.exit_node_lan, "the LAN stays reachable by default");
    assert_error(
        &minimal("[router]\nadvertise_routes = [\"10.0.0.1/8\"]"),
        "router.advertise_routes[0]",
        &["10.0.0.0/8"],
    );
    assert_error(
        &minimal("[router]\nadvertise_routes = [\"100.64.0.0/10\"]"),
        "router.advertise_routes[0]",
        &["tunnel address"],
    );
    assert_error(
        &minimal("[dns]\nreresolve_interval = \"ten minutes\""),
        "dns.reresolve_interval",
        &["ten minutes", "10m"],
    );
    assert_error(
        &minimal("[dns]\nnameservers = [\"dns.google\"]"),
        "dns.nameservers[0]",
        &["dns.google"],
    );
    assert_error(
        &minimal("[health]\nlisten = \"localhost\""),
        "health.listen",
        &["localhost"],
    );
    assert_error(
        &minimal("[firewall]\nmode = \"pf\""),
        "firewall.mode",
        &["pf", "nftables"],
    );
    let c = parse(&minimal(
        "[dns]\nreresolve_interval = \"1h30m\"\nnameservers=[\"10.0.0.53\"]\n[health]\nlisten=\"\"",
    ))
    .expect("valid");
    assert_eq!(c.dns.reresolve_interval.as_secs(), 5400);
    assert_eq!(c.dns.nameservers[0].port(), 53);
    assert_eq!(c.health.listen, None);
}

#[test]
fn every_error_is_reported_at_once() {
    let errs = parse("[interface]\nname=\"\"\naddresses=[\"x\"]\nmtu=1\n")
        .expect_err("bad")
        .0;
    assert!(errs.len() >= 4, "{errs:?}");
}

#[test]
fn interface_name_is_read_from_an_otherwise_invalid_file() {
    use crate::config::interface_name_of;
    assert_eq!(
        interface_name_of("[interface]\nname = \"wg7\"\nbogus = 1\n[[peer]]\npublic_key = \"x\"\n"),
        Some("wg7".to_string())
    );
    assert_eq!(interface_name_of("[interface]\nlisten_port = 1\n"), None);
    assert_eq!(interface_name_of("[interface\nname = \"wg7\""), None);
}

#[test]
fn peer_names_are_short_printable_and_unique() {
    let key_a = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
    let key_b = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";
    let two = |a: &str, b: &str| {
        minimal(&format!(
            "[[peer]]\nname = {a}\npublic_key = \"{key_a}\"\nallowed_ips = [\"100.64.9.1/32\"]\n\n\
             [[peer]]\nname = {b}\npublic_key = \"{key_b}\"\nallowed_ips = [\"100.64.9.2/32\"]\n"
        ))
    };
    let c = parse(&two("\"office\"", "\"laptop of Ann\"")).expect("valid names");
    let names: Vec<Option<&str>> = c.peers.iter().map(|p| p.name.as_deref()).collect();
    assert!(
        names.ends_with(&[Some("office"), Some("laptop of Ann")]),
        "{names:?}"
    );
    assert_error(
        &two("\"a\"", "\"a\""),
        "peer[1].name",
        &["already the name of peer["],
    );
    assert_error(&two("\"\"", "\"b\""), "peer[0].name", &["expected 1 to 32"]);
    assert_error(
        &two(&format!("\"{}\"", "x".repeat(33)), "\"b\""),
        "peer[0].name",
        &["33 characters"],
    );
    assert_error(
        &two("\"a\\nb\"", "\"b\""),
        "peer[0].name",
        &["control character"],
    );
    assert_error(&two("\" a\"", "\"b\""), "peer[0].name", &["space"]);
}

#[test]
fn placeholder_keys_are_recognised() {
    use crate::config::{decode_key, key_looks_like_placeholder};
    for text in [
        "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
        "REPLACE+ME+WITH+THE+PEERS+PUBLIC+KEY+AAAAAA=",
        "CHANGEMEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    ] {
        let bytes = decode_key(text).expect("valid base64 key");
        assert!(key_looks_like_placeholder(&bytes, text), "{text}");
    }
    let real = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
    let bytes = decode_key(real).expect("key");
    assert!(!key_looks_like_placeholder(&bytes, real));
    let c = parse(&minimal(
        "[[peer]]\npublic_key = \"REPLACE+ME+WITH+THE+PEERS+PUBLIC+KEY+AAAAAA=\"\nallowed_ips = [\"100.64.9.1/32\"]\n",
    ))
    .expect("a placeholder is valid");
    let w = c.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("peer[0].public_key:") && w.contains("placeholder")),
        "{w:?}"
    );
}

#[test]
fn rules_carry_a_service_label_and_readiness_chooses_who_waits_for_names() {
    let c = parse(&minimal(
        "[[ingress]]\ntarget_fqdn = \"web.example\"\nports = [\"80\"]\nservice = \"apps/web\"\n\
         [[egress]]\ntarget_fqdn = \"web.example\"\nports = [\"8080\"]\nservice = \"apps/web-out\"\n\
         [[egress]]\ntarget_fqdn = \"db.example\"\nports = [\"5432\"]\n",
    ))
    .expect("valid");
    assert_eq!(c.ingress[0].service.as_deref(), Some("apps/web"));
    assert_eq!(c.egress[1].service, None, "the label is optional");
    assert_eq!(c.health.readiness, Readiness::All, "the default");
    let users = c.fqdn_users();
    assert_eq!(users["web.example"].services, ["apps/web", "apps/web-out"]);
    assert!(
        users["web.example"].holds_readiness,
        "with readiness = all every name holds /readyz"
    );

    let c = parse(&minimal(
        "[[ingress]]\ntarget_fqdn = \"web.example\"\nports = [\"80\"]\nservice = \"apps/web\"\n\
         [[egress]]\ntarget_fqdn = \"db.example\"\nports = [\"5432\"]\n\
         [[egress]]\ntarget_fqdn = \"db.example\"\nports = [\"5433\"]\nservice = \"apps/db\"\n\
         [health]\nreadiness = \"per-service\"\n",
    ))
    .expect("valid");
    assert_eq!(c.health.readiness, Readiness::PerService);
    let users = c.fqdn_users();
    assert!(
        !users["web.example"].holds_readiness,
        "only labelled rules use it: that service's problem"
    );
    assert!(
        users["db.example"].holds_readiness,
        "an unlabelled rule uses it too: the host's own problem"
    );
    assert_eq!(users["db.example"].services, ["apps/db"]);

    assert_error(
        &minimal("[health]\nreadiness = \"some\""),
        "health.readiness",
        &["\"some\"", "\"all\"", "\"per-service\""],
    );
    assert_error(
        &minimal("[[ingress]]\ntarget = \"10.0.0.1\"\nservice = \"\""),
        "ingress[0].service",
        &["\"\"", "expected 1 to 253"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget = \"100.64.0.2\"\nports = [\"80\"]\nservice = \" apps/db\""),
        "egress[0].service",
        &["\" apps/db\"", "space"],
    );
    assert_error(
        &minimal("[[egress]]\ntarget = \"100.64.0.2\"\nports = [\"80\"]\nservice = 7"),
        "egress[0].service",
        &["string"],
    );
}

/// Issue 27: an ingress to loopback, or to this gateway's own health endpoint, is accepted
/// (never refused) with a warning that names the rule and says why.
#[test]
fn ingress_to_loopback_or_to_the_own_health_endpoint_is_warned_about() {
    let host: std::collections::BTreeSet<IpAddr> = ["10.0.0.5".parse().expect("ip")].into();
    let warned = |extra: &str| -> Vec<String> {
        let c = parse(&minimal(extra)).expect("a warning never refuses the file");
        ingress_warnings(&c, &host)
    };
    // Loopback, either family, any ports.
    for target in ["127.0.0.1", "127.0.0.53", "::1"] {
        let w = warned(&format!(
            "[[ingress]]\ntarget = \"{target}\"\nports = [\"80\"]\n"
        ));
        assert_eq!(w.len(), 1, "{target}: {w:?}");
        assert!(w[0].starts_with("ingress[0].target:"), "{w:?}");
        assert!(
            w[0].contains("loopback") && w[0].contains("never work"),
            "{w:?}"
        );
    }
    // The health endpoint's own address and port; or a host address, with it on 0.0.0.0.
    let own = [
        "[health]\nlisten = \"10.0.0.5:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\nports = [\"9002\"]\n",
        "[health]\nlisten = \"0.0.0.0:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\nports = [\"80:9002\"]\n",
        "[health]\nlisten = \"[::]:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\n",
    ];
    for extra in own {
        let w = warned(extra);
        assert_eq!(w.len(), 1, "{extra}: {w:?}");
        assert!(w[0].contains("/metrics") && w[0].contains("9002"), "{w:?}");
    }
    // Not the health endpoint: another port, UDP, another host, another address it does not
    // listen on, or no endpoint at all.
    let fine = [
        "[health]\nlisten = \"0.0.0.0:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\nports = [\"9002:80\"]\n",
        "[health]\nlisten = \"0.0.0.0:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\nports = [\"9002/udp\"]\n",
        "[health]\nlisten = \"0.0.0.0:9002\"\n[[ingress]]\ntarget = \"10.96.0.10\"\n",
        "[health]\nlisten = \"10.0.0.6:9002\"\n[[ingress]]\ntarget = \"10.0.0.5\"\n",
        "[health]\nlisten = \"\"\n[[ingress]]\ntarget = \"10.0.0.5\"\n",
        "[[ingress]]\ntarget_fqdn = \"db.example.internal\"\n",
    ];
    for extra in fine {
        assert_eq!(warned(extra), Vec::<String>::new(), "{extra}");
    }
}

/// The drop-in's configuration is every section's default with only the name set: what a file
/// naming the device (and, since validation wants them, a key and an address) parses to, minus
/// the address and the key, which nothing reads in userspace mode.
#[test]
fn a_device_only_config_is_the_defaults_with_a_name() {
    let device = Config::device_only("wg-test0").expect("a valid name");
    let mut parsed = parse(&format!(
        "[interface]\nname = \"wg-test0\"\nprivate_key = \"{KEY_A}\"\naddresses = [\"100.64.0.1/32\"]\n\
         [health]\nlisten = \"\"\n"
    ))
    .expect("valid");
    parsed.interface.addresses.clear();
    parsed.interface.private_key = device.interface.private_key.clone();
    assert_eq!(device, parsed);
    assert_eq!(
        device.health.listen, None,
        "no health endpoint unless --health"
    );
    assert!(device.interface.addresses.is_empty());
}

#[test]
fn a_device_only_config_refuses_a_bad_name() {
    let err = Config::device_only("a-name-much-too-long").expect_err("16+ characters");
    assert_eq!(err.key, "interface.name");
    assert!(err.problem.contains("not a valid interface name"), "{err}");
    assert!(Config::device_only("").is_err(), "empty");
}

#[test]
fn a_public_endpoint_is_an_address_or_a_name_with_a_port() {
    for (text, shown) in [
        ("203.0.113.10:51820", "203.0.113.10:51820"),
        ("[2001:db8::10]:51820", "[2001:db8::10]:51820"),
        ("VPN.Example.com.:443", "vpn.example.com:443"),
    ] {
        let c = parse(&minimal(&format!("public_endpoint = \"{text}\"\n"))).expect("valid");
        let endpoint = c.interface.public_endpoint.expect("an endpoint");
        assert_eq!(endpoint.to_string(), shown, "{text}");
    }
    assert_eq!(
        parse(&minimal(""))
            .expect("valid")
            .interface
            .public_endpoint,
        None
    );
    for (text, needle) in [
        ("203.0.113.10", "no port"),
        ("203.0.113.10:0", "no valid port"),
        ("lb.example.com:70000", "no valid port"),
        ("", "no port"),
        ("bad host!:51820", "not a valid DNS name"),
        ("[2001:db8::10:51820", "not a valid DNS name"),
    ] {
        assert_error(
            &minimal(&format!("public_endpoint = \"{text}\"\n")),
            "interface.public_endpoint",
            &[needle],
        );
    }
}
