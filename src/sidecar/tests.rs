//! Unit tests of the sidecar's pure renderer: every kind of Service, and every bad input.

use super::*;
use crate::config::{Forward, PortMap, Target};

struct MapFiles(BTreeMap<String, String>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| "no such file".to_string())
    }
}

fn peer_key() -> String {
    SecretKey([7; 32]).public_key().to_base64()
}

fn base() -> String {
    format!(
        r#"
[interface]
name = "tg0"
listen_port = 51820
addresses = ["100.64.0.1/32", "fd7a:115c:a1e0::1/128"]

[[peer]]
public_key = "{}"
endpoint = "198.51.100.7:51820"
allowed_ips = ["100.64.0.2/32", "fd7a:115c:a1e0::2/128"]

[health]
listen = "0.0.0.0:9002"
"#,
        peer_key()
    )
}

fn base_v4_only() -> String {
    base().replace(", \"fd7a:115c:a1e0::1/128\"", "")
}

fn svc() -> ServiceInfo {
    ServiceInfo {
        namespace: "apps".into(),
        name: "web".into(),
        type_: Some("ClusterIP".into()),
        cluster_ips: vec!["10.96.0.10".into()],
        ports: vec![
            ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(TargetPort::Number(8080)),
                protocol: Some("TCP".into()),
            },
            ServicePort {
                name: Some("dns".into()),
                port: 53,
                target_port: None,
                protocol: Some("UDP".into()),
            },
        ],
        ..ServiceInfo::default()
    }
}

fn annotated(mut s: ServiceInfo, pairs: &[(&str, &str)]) -> ServiceInfo {
    for (k, v) in pairs {
        s.annotations.insert(k.to_string(), v.to_string());
    }
    s
}

fn exposed() -> ServiceInfo {
    annotated(svc(), &[(ANNOTATION_EXPOSE, "true")])
}

fn fixed_key() -> SecretKey {
    SecretKey([42; 32])
}

fn ok(svc: &ServiceInfo, base: &str) -> Rendered {
    render(svc, base, &BTreeMap::new(), fixed_key).expect("renders")
}

fn rejected(svc: &ServiceInfo, base: &str) -> String {
    render(svc, base, &BTreeMap::new(), fixed_key)
        .expect_err("rejected")
        .to_string()
}

fn text(r: &Rendered, key: &str) -> String {
    String::from_utf8(r.data[key].clone()).expect("utf-8")
}

/// What the daemon would load from the mounted Secret.
fn daemon_view(r: &Rendered) -> Config {
    let files = MapFiles(BTreeMap::from([(
        format!("{MOUNT_DIR}/{KEY_PRIVATE}"),
        text(r, KEY_PRIVATE),
    )]));
    Config::parse(&text(r, KEY_CONFIG), Path::new(MOUNT_DIR), &files).expect("daemon accepts it")
}

/// A rule of Service `apps/web` (every rule the sidecar renders names its Service).
fn fwd(target: Target, ports: &[&str]) -> Forward {
    Forward {
        target,
        ports: ports
            .iter()
            .map(|p| p.parse::<PortMap>().expect("port"))
            .collect(),
        service: Some("apps/web".into()),
    }
}

fn ip(s: &str) -> Target {
    Target::Ip(s.parse().expect("ip"))
}

#[test]
fn clusterip_ingress_with_the_service_ports() {
    let r = ok(&exposed(), &base());
    assert!(r.generated_key);
    let c = daemon_view(&r);
    assert_eq!(
        c.ingress,
        vec![fwd(ip("10.96.0.10"), &["80/tcp", "53/udp"])]
    );
    assert!(c.egress.is_empty());
    assert_eq!(
        c.health.readiness,
        crate::config::Readiness::All,
        "a single-Service proxy whose one Service is not served stays NotReady"
    );
    assert_eq!(c.interface.private_key, fixed_key());
    assert_eq!(c.peers.len(), 1);
    assert!(text(&r, KEY_CONFIG).contains("private_key_file = \"private.key\""));
    assert_eq!(text(&r, KEY_PRIVATE), fixed_key().expose_base64());
    assert_eq!(text(&r, KEY_PUBLIC), fixed_key().public_key().to_base64());
    assert_eq!(
        text(&r, KEY_DEVICE_IPS),
        r#"["100.64.0.1","fd7a:115c:a1e0::1"]"#
    );
}

#[test]
fn service_without_ports_forwards_every_port() {
    let mut s = exposed();
    s.ports.clear();
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(c.ingress, vec![fwd(ip("10.96.0.10"), &[])]);
}

#[test]
fn load_balancer_class_exposes_without_the_annotation() {
    let mut s = svc();
    s.type_ = Some("LoadBalancer".into());
    s.load_balancer_class = Some("tunnelgate".into());
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(c.ingress.len(), 1);
    s.load_balancer_class = Some("other".into());
    let c = daemon_view(&ok(&s, &base()));
    assert!(c.ingress.is_empty(), "another class is not ours");
    let c = daemon_view(&ok(&svc(), &base()));
    assert!(c.ingress.is_empty() && c.egress.is_empty(), "plain Service");
}

#[test]
fn external_name_gives_target_fqdn() {
    let mut s = exposed();
    s.type_ = Some("ExternalName".into());
    s.cluster_ips.clear();
    s.external_name = Some("DB.Example.com.".into());
    s.ports.truncate(1);
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(
        c.ingress,
        vec![fwd(Target::Fqdn("db.example.com".into()), &["80/tcp"])]
    );
    s.external_name = None;
    assert!(rejected(&s, &base()).contains("without spec.externalName"));
}

#[test]
fn egress_by_ip_maps_target_port_to_port() {
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.2")]);
    let c = daemon_view(&ok(&s, &base()));
    assert!(c.ingress.is_empty());
    assert_eq!(
        c.egress,
        vec![fwd(ip("100.64.0.2"), &["8080:80/tcp", "53/udp"])]
    );
}

#[test]
fn egress_by_fqdn_without_ports_takes_every_port() {
    let mut s = annotated(svc(), &[(ANNOTATION_TUNNEL_FQDN, "db.tailnet.internal")]);
    s.ports.clear();
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(
        c.egress,
        vec![fwd(Target::Fqdn("db.tailnet.internal".into()), &[])]
    );
}

#[test]
fn ingress_and_egress_together() {
    let s = annotated(exposed(), &[(ANNOTATION_TUNNEL_IP, "fd7a:115c:a1e0::2")]);
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(c.ingress.len(), 1);
    assert_eq!(c.egress[0].target, ip("fd7a:115c:a1e0::2"));
}

#[test]
fn dual_stack_gives_one_rule_per_cluster_ip() {
    let mut s = exposed();
    s.cluster_ips = vec!["10.96.0.10".into(), "fd96::10".into()];
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(
        c.ingress,
        vec![
            fwd(ip("10.96.0.10"), &["80/tcp", "53/udp"]),
            fwd(ip("fd96::10"), &["80/tcp", "53/udp"]),
        ]
    );
    // A v4-only tunnel skips the v6 ClusterIP, and says so.
    let r = ok(&s, &base_v4_only());
    assert_eq!(daemon_view(&r).ingress.len(), 1);
    assert!(
        r.notes.iter().any(|n| n.contains("fd96::10")),
        "{:?}",
        r.notes
    );
    // IPv6-only Service behind a v4-only tunnel: nothing to forward from.
    s.cluster_ips = vec!["fd96::10".into()];
    assert!(rejected(&s, &base_v4_only()).contains("no ClusterIP (fd96::10) is of a family"));
    let c = daemon_view(&ok(&s, &base()));
    assert_eq!(c.ingress[0].target, ip("fd96::10"));
}

#[test]
fn base_config_rules_are_kept_and_ours_appended() {
    let base = format!(
        "{}\n[[egress]]\ntarget = \"100.64.0.9\"\nports = [\"22\"]\n",
        base()
    );
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.2")]);
    let c = daemon_view(&ok(&s, &base));
    assert_eq!(c.egress.len(), 2);
    assert_eq!(c.egress[0].target, ip("100.64.0.9"));
}

#[test]
fn existing_key_is_kept_byte_for_byte() {
    let existing = format!("{}\n", SecretKey([9; 32]).expose_base64());
    let current = BTreeMap::from([(KEY_PRIVATE.to_string(), existing.clone().into_bytes())]);
    let r = render(&exposed(), &base(), &current, || panic!("no new key")).expect("renders");
    assert!(!r.generated_key);
    assert_eq!(text(&r, KEY_PRIVATE), existing);
    assert_eq!(
        text(&r, KEY_PUBLIC),
        SecretKey([9; 32]).public_key().to_base64()
    );
}

#[test]
fn same_inputs_change_nothing_and_a_service_change_only_the_config() {
    let first = ok(&exposed(), &base());
    let again = render(&exposed(), &base(), &first.data, || panic!("no new key")).expect("renders");
    assert_eq!(again.data, first.data, "rendering is deterministic");
    assert!(changed_keys(&again.data, &first.data).is_empty());
    let mut s = exposed();
    s.ports.truncate(1);
    let changed = render(&s, &base(), &first.data, || panic!("no new key")).expect("renders");
    assert_eq!(changed_keys(&changed.data, &first.data), vec![KEY_CONFIG]);
    assert_eq!(
        changed_keys(&first.data, &BTreeMap::new()).len(),
        4,
        "an empty Secret needs every key"
    );
}

#[test]
fn service_without_cluster_ip_is_rejected() {
    for ips in [vec!["None".to_string()], vec![], vec![String::new()]] {
        let mut s = exposed();
        s.cluster_ips = ips;
        let e = rejected(&s, &base());
        assert!(e.contains("Service apps/web has no ClusterIP"), "{e}");
    }
    let mut s = exposed();
    s.cluster_ips = vec!["10.96.0.300".into()];
    assert!(rejected(&s, &base()).contains("\"10.96.0.300\" is not an IP address"));
}

#[test]
fn conflicting_egress_annotations_are_rejected() {
    let s = annotated(
        svc(),
        &[
            (ANNOTATION_TUNNEL_IP, "100.64.0.2"),
            (ANNOTATION_TUNNEL_FQDN, "db.tailnet.internal"),
        ],
    );
    let e = rejected(&s, &base());
    assert!(e.contains("are both set: expected one of them"), "{e}");
}

#[test]
fn invalid_ip_annotation_is_rejected() {
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.300")]);
    let e = rejected(&s, &base());
    assert!(
        e.contains("tunnelgate.dev/tunnel-ip \"100.64.0.300\" is not an IP address"),
        "{e}"
    );
}

#[test]
fn bad_fqdn_annotation_is_rejected_by_validation() {
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_FQDN, "not a name")]);
    let e = rejected(&s, &base());
    assert!(
        e.contains("rendered tunnelgate.toml is invalid: egress[0].target_fqdn"),
        "{e}"
    );
}

#[test]
fn invalid_expose_value_is_rejected() {
    let s = annotated(svc(), &[(ANNOTATION_EXPOSE, "yes")]);
    assert!(rejected(&s, &base()).contains("expected \"true\" or \"false\""));
    let s = annotated(svc(), &[(ANNOTATION_EXPOSE, "false")]);
    assert!(daemon_view(&ok(&s, &base())).ingress.is_empty());
}

#[test]
fn base_config_that_does_not_parse_is_rejected() {
    let e = rejected(&exposed(), "[interface\nname = 1");
    assert!(e.starts_with("base config does not parse"), "{e}");
    let e = rejected(&exposed(), &format!("{}\nunknown = 1\n", base()));
    assert!(
        e.contains("rendered tunnelgate.toml is invalid") && e.contains("unknown"),
        "{e}"
    );
    let e = rejected(&exposed(), "");
    assert!(e.contains("interface.addresses"), "{e}");
}

/// The base config's `[takeover]` (the endpoints file, a shared-identity group's endpoint
/// exchange) reaches the daemon as written, after the sections the sidecar renders; one the
/// daemon would refuse is refused here, naming its key, before any write.
#[test]
fn a_base_configs_takeover_section_reaches_the_daemon_as_written() {
    let takeover = "\n[takeover]\nstate_file = \"/var/lib/tunnelgate/endpoints/tg0.endpoints\"\n\
                    group_listen = \"0.0.0.0:51822\"\n\
                    group_replicas = \"tgp.tunnelgate.svc.cluster.local:51822\"\n";
    let r = ok(&exposed(), &format!("{}{takeover}", base()));
    let c = daemon_view(&r);
    assert_eq!(
        c.takeover.state_file,
        crate::config::StateFile::Path("/var/lib/tunnelgate/endpoints/tg0.endpoints".into())
    );
    let group = c.takeover.group.as_ref().expect("the group exchange");
    assert_eq!(group.listen.to_string(), "0.0.0.0:51822");
    assert_eq!(
        group.replicas.to_string(),
        "tgp.tunnelgate.svc.cluster.local:51822"
    );
    assert_eq!(
        c.takeover.answer,
        crate::core::takeover::Answer::KnownEndpoints
    );
    // Last, after the rules and [health]: the order of the contract's example, then this.
    let rendered = text(&r, KEY_CONFIG);
    let at = |section: &str| {
        rendered
            .find(section)
            .unwrap_or_else(|| panic!("{section}"))
    };
    assert!(at("[takeover]") > at("[health]"), "{rendered}");
    assert!(at("[takeover]") > at("[[ingress]]"), "{rendered}");
    // Half an exchange is the daemon's error, and so the sidecar's.
    let half = format!("{}\n[takeover]\ngroup_listen = \"0.0.0.0:51822\"\n", base());
    let why = rejected(&exposed(), &half);
    assert!(why.contains("takeover.group_replicas"), "{why}");
}

#[test]
fn base_config_must_not_set_a_private_key() {
    let b = base().replace("name = \"tg0\"", "name = \"tg0\"\nprivate_key = \"x\"");
    let e = rejected(&exposed(), &b);
    assert!(e.contains("interface.private_key is set"), "{e}");
}

#[test]
fn relative_key_files_other_than_ours_are_rejected() {
    let b = base().replace("endpoint =", "preshared_key_file = \"psk\"\nendpoint =");
    let e = rejected(&exposed(), &b);
    assert!(
        e.contains("peer[0].preshared_key_file") && e.contains("not a key of the config Secret"),
        "{e}"
    );
    let b = base().replace(
        "endpoint =",
        "preshared_key_file = \"/etc/psk/psk\"\nendpoint =",
    );
    ok(&exposed(), &b);
}

#[test]
fn corrupt_existing_key_is_rejected_not_replaced() {
    let current = BTreeMap::from([(KEY_PRIVATE.to_string(), b"garbage".to_vec())]);
    let e = render(&exposed(), &base(), &current, || panic!("must not replace"))
        .expect_err("rejected")
        .to_string();
    assert!(
        e.contains("Secret key private.key is not valid base64"),
        "{e}"
    );
}

#[test]
fn unsupported_ports_are_rejected() {
    let mut s = exposed();
    s.ports[0].protocol = Some("SCTP".into());
    assert!(rejected(&s, &base()).contains("spec.ports[0].protocol SCTP is not supported"));
    let mut s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.2")]);
    s.ports[0].target_port = Some(TargetPort::Name("http".into()));
    assert!(rejected(&s, &base()).contains("targetPort is the name \"http\""));
}

#[test]
fn rules_the_daemon_would_refuse_are_rejected() {
    // Egress to the tunnel's own address.
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.1")]);
    let e = rejected(&s, &base());
    assert!(
        e.contains("egress[0].target") && e.contains("own tunnel addresses"),
        "{e}"
    );
    // Egress that would capture the health port.
    let mut s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.2")]);
    s.ports = vec![ServicePort {
        port: 9002,
        ..ServicePort::default()
    }];
    assert!(rejected(&s, &base()).contains("health port"));
}

#[test]
fn every_problem_is_reported_at_once() {
    let s = annotated(
        exposed(),
        &[
            (ANNOTATION_EXPOSE, "maybe"),
            (ANNOTATION_TUNNEL_IP, "x"),
            (ANNOTATION_TUNNEL_FQDN, "y"),
        ],
    );
    let r = render(&s, "[", &BTreeMap::new(), fixed_key).expect_err("rejected");
    assert_eq!(r.0.len(), 3, "{r}");
}

#[test]
fn hostile_annotation_values_are_quoted_short_and_on_one_line() {
    let huge = format!("100.64.0.2\n{}", "x".repeat(256 << 10));
    for key in [
        ANNOTATION_EXPOSE,
        ANNOTATION_TUNNEL_IP,
        ANNOTATION_TUNNEL_FQDN,
    ] {
        let s = annotated(svc(), &[(key, huge.as_str())]);
        let e = rejected(&s, &base());
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.len() < 1024, "{key}: the error is {} bytes", e.len());
        assert!(!e.contains('\n'), "{key}: {e}");
        assert!(e.contains("\\n"), "{key}: the newline is escaped: {e}");
    }
    // A name with a newline never becomes TOML of its own (a forged [health] table).
    let forged = "db.example\n[health]\nlisten = \"0.0.0.0:9002\"";
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_FQDN, forged)]);
    let e = rejected(&s, &base());
    assert!(e.contains("is not a DNS name"), "{e}");
    // Not UTF-8 cannot reach us (the API server's strings are UTF-8); NUL and other
    // control characters can, and are refused the same way.
    let s = annotated(svc(), &[(ANNOTATION_TUNNEL_IP, "100.64.0.2\0")]);
    assert!(rejected(&s, &base()).contains("\\0"));
}

#[test]
fn a_stored_private_key_that_is_not_a_key_is_refused_and_never_echoed() {
    use base64::Engine as _;
    let short = base64::engine::general_purpose::STANDARD.encode([7u8; 31]);
    let huge = "QUFB".repeat(256 << 10);
    let cases: [(&[u8], &str); 5] = [
        (
            b"\xff\xfe\x00garbage",
            "private.key is not UTF-8: expected a 44-character",
        ),
        (short.as_bytes(), "decodes to 31 bytes"),
        (huge.as_bytes(), "bytes: expected a 32-byte WireGuard key"),
        (b"", "decodes to 0 bytes"),
        (b"c2VjcmV0LXZhbHVl!!", "is not valid base64"),
    ];
    for (stored, want) in cases {
        let current = BTreeMap::from([(KEY_PRIVATE.to_string(), stored.to_vec())]);
        let e = render(&exposed(), &base(), &current, || panic!("must not replace"))
            .expect_err("rejected")
            .to_string();
        assert!(e.contains(want), "{want}: {e}");
        assert!(
            e.contains("delete the key to have a new one generated"),
            "{e}"
        );
        assert!(e.len() < 512, "{} bytes", e.len());
        assert!(
            !e.contains("c2VjcmV0") && !e.contains(short.as_str()),
            "{e}"
        );
    }
    // A key stored with a trailing newline (as `tunnelgate genkey > file` writes) is kept.
    let key = base64::engine::general_purpose::STANDARD.encode(fixed_key().0);
    let current = BTreeMap::from([(KEY_PRIVATE.to_string(), format!("{key}\n").into_bytes())]);
    let r = render(&exposed(), &base(), &current, || panic!("must not replace")).expect("kept");
    assert!(!r.generated_key);
}

#[test]
fn object_refs() {
    assert_eq!(
        parse_object_ref("tunnelgate/proxy-0").expect("valid"),
        (Some("tunnelgate".into()), "proxy-0".into())
    );
    assert_eq!(
        parse_object_ref("web.v2").expect("valid"),
        (None, "web.v2".into())
    );
    for bad in ["", "/x", "ns/", "Ns/x", "a/b/c", "ns/-x", "n.s/x", "ns/x_y"] {
        assert!(parse_object_ref(bad).is_err(), "{bad} accepted");
    }
}
