//! Unit tests of the proxy-group renderer: ordinals, pool addresses, membership, ingress and
//! egress of many Services, clashes and bad Services left out while the rest is served.

use super::*;
use crate::config::{Config, SecretFiles};
use crate::sidecar::{
    ServicePort, TargetPort, ANNOTATION_EXPOSE, ANNOTATION_TUNNEL_IP, KEY_CONFIG, KEY_CONFIG_GZ,
    KEY_DEVICE_IPS, KEY_PRIVATE, KEY_PUBLIC, MOUNT_DIR,
};
use std::path::Path;

struct MapFiles(BTreeMap<String, String>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| "no such file".to_string())
    }
}

const GROUP: &str = "tgp";

fn base() -> String {
    format!(
        r#"
[interface]
name = "tg0"
listen_port = 51820
addresses = ["100.64.9.9/32"]

[[peer]]
public_key = "{}"
allowed_ips = ["100.64.0.2/32"]

[health]
listen = "0.0.0.0:9002"
"#,
        SecretKey([7; 32]).public_key().to_base64()
    )
}

fn replica(ordinal: u32) -> Replica {
    Replica {
        group: GROUP.into(),
        ordinal,
        pools: vec![
            "100.64.1.0/24".parse().expect("pool"),
            "fd7a:115c:a1e0:1::/64".parse().expect("pool"),
        ],
        identity: Identity::PerReplica,
        endpoint: None,
    }
}

fn port(port: i32, target: Option<i32>, proto: &str) -> ServicePort {
    ServicePort {
        name: None,
        port,
        target_port: target.map(TargetPort::Number),
        protocol: Some(proto.into()),
    }
}

fn service(ns: &str, name: &str, created: i64, annotations: &[(&str, &str)]) -> ServiceInfo {
    let mut s = ServiceInfo {
        namespace: ns.into(),
        name: name.into(),
        type_: Some("ClusterIP".into()),
        cluster_ips: vec!["10.96.0.10".into()],
        ports: vec![port(80, Some(8080), "TCP")],
        created: Some(created),
        ..ServiceInfo::default()
    };
    s.annotations
        .insert(ANNOTATION_PROXY_GROUP.into(), GROUP.into());
    for (k, v) in annotations {
        s.annotations.insert(k.to_string(), v.to_string());
    }
    s
}

fn ingress(ns: &str, name: &str, created: i64, ip: &str, ports: Vec<ServicePort>) -> ServiceInfo {
    let mut s = service(ns, name, created, &[(ANNOTATION_EXPOSE, "true")]);
    s.cluster_ips = vec![ip.into()];
    s.ports = ports;
    s
}

fn egress(
    ns: &str,
    name: &str,
    created: i64,
    target: &str,
    ports: Vec<ServicePort>,
) -> ServiceInfo {
    let mut s = service(ns, name, created, &[(ANNOTATION_TUNNEL_IP, target)]);
    s.ports = ports;
    s
}

fn key(n: u8) -> SecretKey {
    SecretKey([n; 32])
}

fn render(r: &Replica, services: &[ServiceInfo]) -> GroupRendered {
    render_group(r, services, &base(), &BTreeMap::new(), || {
        key(40 + r.ordinal as u8)
    })
    .expect("renders")
}

fn text(r: &GroupRendered, k: &str) -> String {
    String::from_utf8(r.rendered.data[k].clone()).expect("utf-8")
}

fn daemon_view(r: &GroupRendered) -> Config {
    daemon_view_with(r, &text(r, KEY_PRIVATE))
}

/// What the daemon loads with `key` as its key file: with a shared identity, the group's key
/// that the shell hands over beside the rendered config.
fn daemon_view_with(r: &GroupRendered, key: &str) -> Config {
    let files = MapFiles(BTreeMap::from([(
        format!("{MOUNT_DIR}/{KEY_PRIVATE}"),
        key.to_string(),
    )]));
    Config::parse(&text(r, KEY_CONFIG), Path::new(MOUNT_DIR), &files).expect("daemon accepts it")
}

/// `target ports` of every rule, e.g. `10.96.0.10 80/tcp,53/udp`.
fn rules(fwds: &[crate::config::Forward]) -> Vec<String> {
    fwds.iter()
        .map(|f| {
            let ports: Vec<String> = f.ports.iter().map(ToString::to_string).collect();
            let target = match &f.target {
                crate::config::Target::Ip(ip) => ip.to_string(),
                crate::config::Target::Fqdn(name) => name.clone(),
            };
            format!("{target} {}", ports.join(","))
        })
        .collect()
}

#[test]
fn ordinal_is_the_numeric_suffix_of_the_pod_name() {
    assert_eq!(ordinal_of("tgp-0"), Ok(0));
    assert_eq!(ordinal_of("my-proxy-group-12"), Ok(12));
    for bad in ["tgp", "tgp-", "tgp-x1", "tgp-1a", "tgp-99999999999"] {
        let e = ordinal_of(bad).expect_err(bad);
        assert!(e.contains(&format!("\"{bad}\"")), "{e}");
    }
}

#[test]
fn pool_address_is_host_ordinal_plus_one() {
    let pool: IpNet = "100.64.1.0/24".parse().expect("pool");
    assert_eq!(
        pool_address(&pool, 0).map(|a| a.to_string()),
        Ok("100.64.1.1/32".into())
    );
    assert_eq!(
        pool_address(&pool, 1).map(|a| a.to_string()),
        Ok("100.64.1.2/32".into())
    );
    assert_eq!(
        pool_address(&pool, 253).map(|a| a.to_string()),
        Ok("100.64.1.254/32".into())
    );
    // .255 is the broadcast address.
    let e = pool_address(&pool, 254).expect_err("too big");
    assert!(
        e.contains("has 254 host addresses: replica 254 needs host 255"),
        "{e}"
    );
    let v6: IpNet = "fd7a:115c:a1e0:1::/64".parse().expect("pool");
    assert_eq!(
        pool_address(&v6, 1).map(|a| a.to_string()),
        Ok("fd7a:115c:a1e0:1::2/128".into())
    );
    let host_bits: IpNet = "100.64.1.5/24".parse().expect("pool");
    let e = pool_address(&host_bits, 0).expect_err("host bits");
    assert!(
        e.contains("expected the network address 100.64.1.0/24"),
        "{e}"
    );
    let single: IpNet = "100.64.1.7/32".parse().expect("pool");
    assert!(pool_address(&single, 0).is_err());
}

#[test]
fn two_replicas_get_their_own_addresses_and_the_same_rules() {
    let services = [
        ingress(
            "apps",
            "web",
            1,
            "10.96.0.10",
            vec![port(80, Some(8080), "TCP")],
        ),
        ingress("shop", "api", 2, "10.96.0.11", vec![port(443, None, "TCP")]),
        egress(
            "apps",
            "db",
            3,
            "100.64.0.2",
            vec![port(5432, Some(15432), "TCP")],
        ),
    ];
    let r0 = render(&replica(0), &services);
    let r1 = render(&replica(1), &services);
    assert_eq!(
        text(&r0, KEY_DEVICE_IPS),
        r#"["100.64.1.1","fd7a:115c:a1e0:1::1"]"#
    );
    assert_eq!(
        text(&r1, KEY_DEVICE_IPS),
        r#"["100.64.1.2","fd7a:115c:a1e0:1::2"]"#
    );
    assert_ne!(text(&r0, KEY_PUBLIC), text(&r1, KEY_PUBLIC));
    assert_eq!(text(&r1, KEY_PUBLIC), key(41).public_key().to_base64());
    for r in [&r0, &r1] {
        let c = daemon_view(r);
        assert_eq!(
            rules(&c.ingress),
            ["10.96.0.10 80/tcp", "10.96.0.11 443/tcp"]
        );
        assert_eq!(rules(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
        assert_eq!(r.served, ["apps/web", "shop/api", "apps/db"]);
        assert!(r.refused.is_empty());
        assert!(text(r, KEY_CONFIG).contains("Services: apps/web, shop/api, apps/db."));
    }
}

#[test]
fn without_pools_the_base_addresses_are_kept() {
    let mut r = replica(3);
    r.pools.clear();
    let g = render(&r, &[]);
    assert_eq!(text(&g, KEY_DEVICE_IPS), r#"["100.64.9.9"]"#);
}

#[test]
fn other_groups_and_unannotated_services_are_ignored() {
    let mut other = ingress(
        "apps",
        "other",
        1,
        "10.96.0.20",
        vec![port(80, None, "TCP")],
    );
    other
        .annotations
        .insert(ANNOTATION_PROXY_GROUP.into(), "another".into());
    let mut none = ingress(
        "apps",
        "plain",
        1,
        "10.96.0.21",
        vec![port(81, None, "TCP")],
    );
    none.annotations.remove(ANNOTATION_PROXY_GROUP);
    let mine = ingress("apps", "web", 2, "10.96.0.10", vec![port(80, None, "TCP")]);
    let g = render(&replica(0), &[other, none, mine]);
    assert_eq!(g.served, ["apps/web"]);
    assert!(g.refused.is_empty());
    assert_eq!(rules(&daemon_view(&g).ingress), ["10.96.0.10 80/tcp"]);
}

#[test]
fn an_empty_group_still_gives_the_replica_its_key_and_addresses() {
    let g = render(&replica(0), &[]);
    let c = daemon_view(&g);
    assert!(c.ingress.is_empty() && c.egress.is_empty());
    assert!(g.rendered.generated_key);
    assert!(text(&g, KEY_CONFIG).contains("Services: none."));
}

#[test]
fn the_later_of_two_services_on_one_port_is_left_out_and_the_rest_served() {
    let older = ingress("apps", "web", 10, "10.96.0.10", vec![port(80, None, "TCP")]);
    // Created later, but sorted first by name: age decides, not the name.
    let newer = ingress("aaa", "web2", 20, "10.96.0.11", vec![port(80, None, "TCP")]);
    let udp = ingress("apps", "dns", 30, "10.96.0.12", vec![port(80, None, "UDP")]);
    let g = render(&replica(0), &[newer, older, udp]);
    assert_eq!(g.served, ["apps/web", "apps/dns"]);
    assert_eq!(g.refused.len(), 1);
    let r = &g.refused[0];
    assert_eq!((r.namespace.as_str(), r.name.as_str()), ("aaa", "web2"));
    assert!(
        r.reason
            .contains("port 80/tcp on the tunnel addresses is already served by Service apps/web"),
        "{}",
        r.reason
    );
    assert_eq!(
        rules(&daemon_view(&g).ingress),
        ["10.96.0.10 80/tcp", "10.96.0.12 80/udp"]
    );
}

#[test]
fn egress_clashes_on_the_pod_port_not_on_the_target_port() {
    let a = egress(
        "apps",
        "db",
        1,
        "100.64.0.2",
        vec![port(5432, Some(15432), "TCP")],
    );
    // Same target port on another target: fine, the pod listens on another port.
    let b = egress(
        "apps",
        "db2",
        2,
        "100.64.0.3",
        vec![port(5432, Some(15433), "TCP")],
    );
    // Same pod port: clash.
    let c = egress(
        "shop",
        "db3",
        3,
        "100.64.0.4",
        vec![port(3306, Some(15432), "TCP")],
    );
    // An ingress on 15432 listens on the tunnel address: no clash with egress.
    let d = ingress(
        "apps",
        "web",
        4,
        "10.96.0.10",
        vec![port(15432, None, "TCP")],
    );
    let g = render(&replica(1), &[a, b, c, d]);
    assert_eq!(g.served, ["apps/db", "apps/db2", "apps/web"]);
    assert_eq!(g.refused.len(), 1);
    assert_eq!(g.refused[0].name, "db3");
    assert!(
        g.refused[0]
            .reason
            .contains("port 15432/tcp on the pod address is already served by Service apps/db"),
        "{}",
        g.refused[0].reason
    );
}

#[test]
fn a_bad_annotation_refuses_that_service_only() {
    let good = ingress("apps", "web", 1, "10.96.0.10", vec![port(80, None, "TCP")]);
    let bad = egress(
        "apps",
        "db",
        2,
        "100.64.0.300",
        vec![port(5432, None, "TCP")],
    );
    let nothing = service("apps", "idle", 3, &[]);
    let mut portless = egress("apps", "portless", 4, "100.64.0.2", vec![]);
    portless.type_ = Some("ExternalName".into());
    let g = render(&replica(0), &[good, bad, nothing, portless]);
    assert_eq!(g.served, ["apps/web"]);
    let reasons: BTreeMap<&str, &str> = g
        .refused
        .iter()
        .map(|r| (r.name.as_str(), r.reason.as_str()))
        .collect();
    assert!(
        reasons["db"].contains("\"100.64.0.300\" is not an IP address"),
        "{reasons:?}"
    );
    assert!(reasons["idle"].contains("asks for nothing"), "{reasons:?}");
    assert!(reasons["portless"].contains("has no ports"), "{reasons:?}");
    assert_eq!(rules(&daemon_view(&g).ingress), ["10.96.0.10 80/tcp"]);
}

#[test]
fn a_service_the_daemon_would_refuse_is_left_out_by_trial() {
    // The health port is never captured: the daemon refuses an egress rule on 9002.
    let good = egress(
        "apps",
        "db",
        1,
        "100.64.0.2",
        vec![port(5432, Some(15432), "TCP")],
    );
    let health = egress(
        "apps",
        "sneaky",
        2,
        "100.64.0.3",
        vec![port(80, Some(9002), "TCP")],
    );
    let g = render(&replica(0), &[good, health]);
    assert_eq!(g.served, ["apps/db"]);
    assert_eq!(g.refused.len(), 1);
    assert_eq!(g.refused[0].name, "sneaky");
    assert!(
        g.refused[0]
            .reason
            .contains("with it the configuration is invalid"),
        "{}",
        g.refused[0].reason
    );
    assert!(!text(&g, KEY_CONFIG).contains("sneaky"));
    assert_eq!(
        rules(&daemon_view(&g).egress),
        ["100.64.0.2 15432:5432/tcp"]
    );
}

#[test]
fn replica_problems_refuse_the_whole_rendering() {
    let e = render_group(&replica(300), &[], &base(), &BTreeMap::new(), || key(1))
        .expect_err("pool too small");
    assert!(e.to_string().contains("replica 300 needs host 301"), "{e}");
    let e = render_group(&replica(0), &[], "[interface", &BTreeMap::new(), || key(1))
        .expect_err("bad base");
    assert!(e.to_string().contains("base config does not parse"), "{e}");
}

#[test]
fn the_existing_key_is_kept_and_a_second_rendering_is_identical() {
    let services = [ingress(
        "apps",
        "web",
        1,
        "10.96.0.10",
        vec![port(80, None, "TCP")],
    )];
    let first = render(&replica(0), &services);
    let again = render_group(
        &replica(0),
        &services,
        &base(),
        &first.rendered.data,
        || panic!("no new key when one exists"),
    )
    .expect("renders");
    assert!(!again.rendered.generated_key);
    assert!(crate::sidecar::changed_keys(&again.rendered.data, &first.rendered.data).is_empty());
}

/// An ExternalName Service of the group, exposed: ingress to `external`.
fn external(ns: &str, name: &str, created: i64, external: &str, port80: u16) -> ServiceInfo {
    let mut s = service(ns, name, created, &[(ANNOTATION_EXPOSE, "true")]);
    s.type_ = Some("ExternalName".into());
    s.cluster_ips.clear();
    s.external_name = Some(external.into());
    s.ports = vec![port(i32::from(port80), None, "TCP")];
    s
}

#[test]
fn every_rule_names_its_service_and_a_replica_is_ready_per_service() {
    let services = [
        ingress("apps", "web", 1, "10.96.0.10", vec![port(80, None, "TCP")]),
        external("apps", "gone", 2, "Gone.Example.", 81),
        egress(
            "apps",
            "db",
            3,
            "100.64.0.2",
            vec![port(5432, Some(15432), "TCP")],
        ),
        external("shop", "api", 4, "api.example", 82),
    ];
    let r = render(&replica(0), &services);
    let c = daemon_view(&r);
    let labels = |fwds: &[crate::config::Forward]| -> Vec<(String, Option<String>)> {
        fwds.iter()
            .map(|f| (rules(std::slice::from_ref(f)).remove(0), f.service.clone()))
            .collect()
    };
    assert_eq!(
        labels(&c.ingress),
        [
            (
                "10.96.0.10 80/tcp".to_string(),
                Some("apps/web".to_string())
            ),
            ("gone.example 81/tcp".into(), Some("apps/gone".into())),
            ("api.example 82/tcp".into(), Some("shop/api".into())),
        ]
    );
    assert_eq!(
        labels(&c.egress),
        [(
            "100.64.0.2 15432:5432/tcp".to_string(),
            Some("apps/db".to_string())
        )]
    );
    assert_eq!(
        c.health.readiness,
        crate::config::Readiness::PerService,
        "one Service's name must not make the replica NotReady"
    );
    assert_eq!(
        c.health.listen,
        Some("0.0.0.0:9002".parse().expect("addr")),
        "the base config's other health keys stay"
    );
    assert_eq!(
        r.names,
        BTreeMap::from([
            ("apps/gone".to_string(), vec!["gone.example".to_string()]),
            ("shop/api".into(), vec!["api.example".into()]),
        ]),
        "the names to check, as the daemon resolves them"
    );
    assert!(
        r.rendered.notes.is_empty(),
        "nothing overridden: {:?}",
        r.rendered.notes
    );
}

#[test]
fn a_base_config_asking_for_readiness_all_is_overridden_with_a_note() {
    let base = format!("{}readiness = \"all\"\n", base());
    let r = render_group(&replica(0), &[], &base, &BTreeMap::new(), || key(40)).expect("renders");
    assert_eq!(
        daemon_view(&r).health.readiness,
        crate::config::Readiness::PerService
    );
    assert!(
        r.rendered
            .notes
            .iter()
            .any(|n| n.contains("health.readiness") && n.contains("\"all\"")),
        "{:?}",
        r.rendered.notes
    );
    // A base config without [health] gets one.
    let bare = base.replace(
        "[health]\nlisten = \"0.0.0.0:9002\"\nreadiness = \"all\"\n",
        "",
    );
    assert!(!bare.contains("[health]"), "{bare}");
    let r = render_group(&replica(0), &[], &bare, &BTreeMap::new(), || key(40)).expect("renders");
    assert_eq!(
        daemon_view(&r).health.readiness,
        crate::config::Readiness::PerService
    );
}

#[test]
fn a_service_is_unresolved_when_any_of_its_names_fails() {
    let names = BTreeMap::from([
        ("apps/web".to_string(), vec!["web.example".to_string()]),
        (
            "apps/two".into(),
            vec!["web.example".into(), "gone.example".into()],
        ),
        ("apps/later".into(), vec!["unasked.example".into()]),
    ]);
    let answers = BTreeMap::from([
        ("web.example".to_string(), Ok(())),
        ("gone.example".into(), Err("NXDOMAIN".to_string())),
    ]);
    assert_eq!(
        unresolved_services(&names, &answers),
        BTreeMap::from([(
            "apps/two".to_string(),
            vec![("gone.example".to_string(), "NXDOMAIN".to_string())]
        )]),
        "a name without an answer is not reported"
    );
}

/// `n` ingress Services, the i-th created at second i, on port 1000 + i with its own ClusterIP.
fn many_ingress(n: u16) -> Vec<ServiceInfo> {
    (0..n)
        .map(|i| {
            let ip = format!("10.{}.{}.{}", 96 + i / 65_025, (i / 255) % 255, i % 255 + 1);
            let name = format!("svc-{i:05}");
            ingress(
                "apps",
                &name,
                i64::from(i),
                &ip,
                vec![port(1000 + i32::from(i), None, "TCP")],
            )
        })
        .collect()
}

fn render_within(services: &[ServiceInfo], max_bytes: usize) -> GroupRendered {
    render_group_within(
        &replica(0),
        services,
        &base(),
        &BTreeMap::new(),
        || key(40),
        max_bytes,
    )
    .expect("renders")
}

fn gunzipped(r: &GroupRendered) -> String {
    use std::io::Read as _;
    let mut out = String::new();
    flate2::read::GzDecoder::new(&r.rendered.data[KEY_CONFIG_GZ][..])
        .read_to_string(&mut out)
        .expect("gzip");
    out
}

#[test]
fn a_config_too_large_for_plain_text_is_stored_gzip_compressed_with_every_service() {
    let services = many_ingress(200);
    let plain = render_within(&services, SECRET_MAX_BYTES);
    let plain_text = text(&plain, KEY_CONFIG);
    assert!(!plain.rendered.data.contains_key(KEY_CONFIG_GZ));
    // A limit the plain text passes but its compressed form fits.
    let max = plain_text.len() / 2;
    let g = render_within(&services, max);
    assert!(
        !g.rendered.data.contains_key(KEY_CONFIG),
        "plain key dropped"
    );
    assert_eq!(
        gunzipped(&g),
        plain_text,
        "the same configuration, compressed"
    );
    assert_eq!(g.served.len(), 200);
    assert!(g.refused.is_empty() && g.over_limit.is_none());
    assert!(crate::sidecar::data_size(&g.rendered.data) <= max);
    // Deterministic: the same input gives the same bytes, so nothing is written again.
    assert_eq!(render_within(&services, max).rendered.data, g.rendered.data);
}

#[test]
fn past_the_limit_the_oldest_services_are_served_and_each_newer_one_is_refused() {
    let services = many_ingress(2_000);
    let all = render_within(&services, SECRET_MAX_BYTES);
    let full_gz = crate::sidecar::gzip(text(&all, KEY_CONFIG).as_bytes()).len();
    let max = full_gz * 2 / 3;
    // Newest first in the input: the order given must not matter, only creation time.
    let mut shuffled = services.clone();
    shuffled.reverse();
    let g = render_within(&shuffled, max);
    assert!(
        crate::sidecar::data_size(&g.rendered.data) <= max,
        "never over the limit"
    );
    let served = g.served.len();
    assert!(served > 1_000 && served < 2_000, "served {served}");
    let expected: Vec<String> = services[..served]
        .iter()
        .map(|s| format!("apps/{}", s.name))
        .collect();
    assert_eq!(g.served, expected, "the oldest ones, in order");
    assert_eq!(g.refused.len(), 2_000 - served);
    for (r, s) in g.refused.iter().zip(&services[served..]) {
        assert_eq!(r.name, s.name);
        assert!(r.reason.contains("limit of"), "{}", r.reason);
    }
    let note = g.over_limit.as_deref().expect("said on the pod");
    assert!(
        note.contains(&format!("the {served} oldest of 2000")),
        "{note}"
    );
    // The largest prefix: one more Service would not fit.
    let one_more = render_within(&services[..=served], max + 1_000_000);
    let one_more_gz = crate::sidecar::gzip(text(&one_more, KEY_CONFIG).as_bytes()).len();
    assert!(
        one_more_gz + KEY_CONFIG_GZ.len() + 200 > max,
        "{one_more_gz} vs {max}"
    );
}

#[test]
fn past_the_limit_an_unrelated_change_of_a_served_service_is_still_applied() {
    let mut services = many_ingress(2_000);
    let all = render_within(&services, SECRET_MAX_BYTES);
    let max = crate::sidecar::gzip(text(&all, KEY_CONFIG).as_bytes()).len() * 2 / 3;
    let before = render_within(&services, max);
    services[3].ports = vec![port(999, None, "UDP")];
    let after = render_within(&services, max);
    assert!(
        gunzipped(&after).contains("\"999/udp\""),
        "the change is in"
    );
    assert!(!gunzipped(&before).contains("\"999/udp\""));
    assert!(crate::sidecar::data_size(&after.rendered.data) <= max);
}

#[test]
fn twenty_thousand_services_fit_the_real_limit() {
    let services = many_ingress(20_000);
    let g = render_within(&services, SECRET_MAX_BYTES);
    assert_eq!(g.served.len(), 20_000);
    assert!(g.refused.is_empty());
    let size = crate::sidecar::data_size(&g.rendered.data);
    assert!(size <= SECRET_MAX_BYTES, "{size}");
}

#[test]
fn among_thousands_a_service_the_daemon_would_refuse_is_pinned_by_its_error() {
    // Left out by the error's key (egress[0].ports), not by checking 3,000 Services one by one.
    let mut services = many_ingress(3_000);
    services.push(egress(
        "apps",
        "sneaky",
        1_500,
        "100.64.0.3",
        vec![port(80, Some(9002), "TCP")],
    ));
    let g = render_within(&services, SECRET_MAX_BYTES);
    assert_eq!(g.served.len(), 3_000);
    assert_eq!(g.refused.len(), 1);
    assert_eq!(g.refused[0].name, "sneaky");
    assert!(
        g.refused[0].reason.contains("egress[0].ports"),
        "{}",
        g.refused[0].reason
    );
}

fn shared(ordinal: u32) -> Replica {
    Replica {
        identity: Identity::Shared,
        ..replica(ordinal)
    }
}

/// A replica's rendering with the group's key, as the shell passes it: over `own` (its Secret's
/// data, maybe with a key of its own from before). A new key is never asked for.
fn render_shared(r: &Replica, own: &BTreeMap<String, Vec<u8>>, group: &SecretKey) -> GroupRendered {
    let current = with_group_key(own, group);
    render_group(r, &[], &base(), &current, || {
        panic!("a replica with a shared identity generated a key of its own")
    })
    .expect("renders")
}

#[test]
fn the_identity_flag_takes_exactly_its_two_values() {
    assert_eq!(Identity::parse("per-replica"), Ok(Identity::PerReplica));
    assert_eq!(Identity::parse("shared"), Ok(Identity::Shared));
    assert_eq!(Identity::default(), Identity::PerReplica);
    for i in [Identity::PerReplica, Identity::Shared] {
        assert_eq!(Identity::parse(&i.to_string()), Ok(i));
    }
    let long = "s".repeat(100_000);
    for hostile in [
        "",
        "Shared",
        "SHARED",
        " shared",
        "shared ",
        "shared\n",
        "shared\0",
        "per_replica",
        "perreplica",
        "shared,per-replica",
        "ѕhared", // Cyrillic s
        long.as_str(),
    ] {
        let e = Identity::parse(hostile).expect_err(hostile);
        assert!(e.contains("\"per-replica\" or \"shared\""), "{e}");
        // The reason never echoes the value (clap names it, once).
        assert!(e.len() < 100, "{e}");
    }
}

#[test]
fn replicas_of_a_shared_identity_render_the_same_key_and_addresses() {
    let group = key(90);
    let empty = BTreeMap::new();
    let outs: Vec<GroupRendered> = [0, 1, 7]
        .into_iter()
        .map(|n| render_shared(&shared(n), &empty, &group))
        .collect();
    for out in &outs {
        // The group's key is kept in its identity Secret alone: the replica's has none.
        assert_eq!(
            out.rendered
                .data
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            [KEY_DEVICE_IPS, KEY_PUBLIC, KEY_CONFIG]
        );
        assert_eq!(text(out, KEY_PUBLIC), group.public_key().to_base64());
        // Host 1 of each pool, whatever the ordinal.
        assert_eq!(
            text(out, KEY_DEVICE_IPS),
            r#"["100.64.1.1","fd7a:115c:a1e0:1::1"]"#
        );
        assert_eq!(
            daemon_view_with(out, &group.expose_base64())
                .interface
                .private_key
                .expose_base64(),
            group.expose_base64()
        );
        assert!(!out.rendered.generated_key);
    }
    // Without pools: the base config's addresses, for every replica.
    let mut r = shared(3);
    r.pools.clear();
    assert_eq!(
        text(&render_shared(&r, &empty, &group), KEY_DEVICE_IPS),
        r#"["100.64.9.9"]"#
    );
    // Per replica, the same ordinal has its own host and its own key.
    let own = render(&replica(7), &[]);
    assert_eq!(
        text(&own, KEY_DEVICE_IPS),
        r#"["100.64.1.8","fd7a:115c:a1e0:1::8"]"#
    );
    assert_ne!(text(&own, KEY_PUBLIC), group.public_key().to_base64());
}

/// A replica switched to a shared identity (or whose Secret an older version wrote with a copy
/// of the group's key) renders the group's public key and no `private.key`: the key it had is
/// stale, so the shell removes it from the Secret.
#[test]
fn a_replica_switched_to_a_shared_identity_renders_the_group_key_over_its_own() {
    let before = render(&replica(1), &[]);
    let group = key(91);
    let after = render_shared(&shared(1), &before.rendered.data, &group);
    assert!(!after.rendered.data.contains_key(KEY_PRIVATE));
    assert_eq!(text(&after, KEY_PUBLIC), group.public_key().to_base64());
    assert_eq!(
        text(&after, KEY_DEVICE_IPS),
        text(&render(&replica(0), &[]), KEY_DEVICE_IPS)
    );
    assert_eq!(
        crate::sidecar::stale_keys(&after.rendered.data, &before.rendered.data),
        [KEY_PRIVATE]
    );
    // An older version's copy of the group's key: the same.
    let copied = with_group_key(&after.rendered.data, &group);
    let again = render_shared(&shared(1), &copied, &group);
    assert_eq!(again.rendered.data, after.rendered.data);
    assert_eq!(
        crate::sidecar::stale_keys(&again.rendered.data, &copied),
        [KEY_PRIVATE]
    );
    assert!(crate::sidecar::changed_keys(&again.rendered.data, &copied).is_empty());
    // Per replica, the Secret keeps its own key, and nothing is stale.
    let kept = render_group(&replica(1), &[], &base(), &before.rendered.data, || {
        panic!("a new key for a replica that has one")
    })
    .expect("renders");
    assert_eq!(kept.rendered.data, before.rendered.data);
    assert!(crate::sidecar::stale_keys(&kept.rendered.data, &before.rendered.data).is_empty());
}

/// Past the size limit the rendering is done again for the oldest Services: that one too keeps
/// no copy of the group's key.
#[test]
fn a_shared_identity_past_the_limit_still_keeps_no_key_in_the_replicas_secret() {
    let services = many_ingress(2_000);
    let group = key(96);
    let current = with_group_key(&BTreeMap::new(), &group);
    let within = |max| {
        render_group_within(
            &shared(1),
            &services,
            &base(),
            &current,
            || panic!("no key generated"),
            max,
        )
        .expect("renders")
    };
    let all = within(SECRET_MAX_BYTES);
    let max = crate::sidecar::gzip(text(&all, KEY_CONFIG).as_bytes()).len() * 2 / 3;
    let g = within(max);
    assert!(g.over_limit.is_some() && g.served.len() < 2_000);
    assert!(!g.rendered.data.contains_key(KEY_PRIVATE));
    assert_eq!(text(&g, KEY_PUBLIC), group.public_key().to_base64());
    assert!(crate::sidecar::data_size(&g.rendered.data) <= max);
}

#[test]
fn the_identity_secret_is_named_after_the_group_and_fits_a_secret_name() {
    assert_eq!(identity_secret_name("tgp").as_deref(), Ok("tgp-identity"));
    let longest = "a".repeat(SECRET_NAME_MAX - "-identity".len());
    assert_eq!(
        identity_secret_name(&longest).map(|n| n.len()),
        Ok(SECRET_NAME_MAX)
    );
    let e = identity_secret_name(&format!("{longest}a")).expect_err("too long");
    assert!(e.contains("expected at most 244 characters"), "{e}");
}

#[test]
fn a_new_identity_secret_holds_the_key_and_its_public_key_and_reads_back() {
    let k = key(92);
    let data = identity_data(&k);
    assert_eq!(
        data.keys().map(String::as_str).collect::<Vec<_>>(),
        [KEY_PRIVATE, KEY_PUBLIC]
    );
    assert_eq!(group_key("tg/tgp-identity", Some(&data)), Ok(Some(k)));
    assert_eq!(group_key("tg/tgp-identity", None), Ok(None));
}

/// A group identity Secret made by hand (`kubectl create secret generic --from-file` of
/// `wg genkey`'s output, with its newline), or without `public_key`, is used as it is.
#[test]
fn a_hand_made_identity_secret_with_a_newline_or_no_public_key_is_used() {
    let k = key(93);
    let with_newline = BTreeMap::from([(
        KEY_PRIVATE.to_string(),
        format!("{}\n", k.expose_base64()).into_bytes(),
    )]);
    assert_eq!(group_key("s", Some(&with_newline)), Ok(Some(k.clone())));
    let mut both = identity_data(&k);
    both.insert(
        KEY_PUBLIC.into(),
        format!("{}\n", k.public_key().to_base64()).into_bytes(),
    );
    assert_eq!(group_key("s", Some(&both)), Ok(Some(k)));
}

/// A malformed or foreign identity Secret is refused with a reason naming the Secret and what it
/// lacks, never used and never "repaired": the shell then writes nothing.
#[test]
fn a_malformed_or_foreign_identity_secret_is_refused() {
    use base64::Engine as _;
    let b64 = |b: &[u8]| {
        base64::engine::general_purpose::STANDARD
            .encode(b)
            .into_bytes()
    };
    let k = key(94);
    let with = |private: Option<Vec<u8>>, public: Option<Vec<u8>>| {
        let mut d = BTreeMap::new();
        if let Some(p) = private {
            d.insert(KEY_PRIVATE.to_string(), p);
        }
        if let Some(p) = public {
            d.insert(KEY_PUBLIC.to_string(), p);
        }
        d
    };
    let tls = BTreeMap::from([
        (
            "tls.crt".to_string(),
            b"-----BEGIN CERTIFICATE-----".to_vec(),
        ),
        (
            "tls.key".to_string(),
            b"-----BEGIN PRIVATE KEY-----".to_vec(),
        ),
    ]);
    let many: BTreeMap<String, Vec<u8>> = (0..1000).map(|i| (format!("k{i:04}"), vec![])).collect();
    type Data = BTreeMap<String, Vec<u8>>;
    let cases: Vec<(&str, Data, &str)> = vec![
        (
            "empty Secret",
            BTreeMap::new(),
            "has no private.key (keys: none)",
        ),
        (
            "a TLS Secret of the same name",
            tls,
            "has no private.key (keys: tls.crt, tls.key)",
        ),
        ("1000 other keys", many, "k0007, ..."),
        (
            "only a public key",
            with(None, Some(k.public_key().to_base64().into_bytes())),
            "has no private.key",
        ),
        (
            "a 16-byte key",
            with(Some(b64(&[1; 16])), None),
            "decodes to 16 bytes",
        ),
        (
            "a 33-byte key",
            with(Some(b64(&[1; 33])), None),
            "decodes to 33 bytes",
        ),
        (
            "an empty key",
            with(Some(vec![]), None),
            "decodes to 0 bytes",
        ),
        (
            "not base64",
            with(Some(b"not base64 at all!!".to_vec()), None),
            "is not valid base64",
        ),
        (
            "not UTF-8",
            with(Some(vec![0xff, 0xfe, 0x00, 0x80]), None),
            "is not UTF-8",
        ),
        (
            "1 MiB of junk",
            with(Some(vec![b'A'; 1 << 20]), None),
            "decodes to",
        ),
        (
            "another key's public key",
            with(
                Some(k.expose_base64().into_bytes()),
                Some(key(95).public_key().to_base64().into_bytes()),
            ),
            "public_key does not belong to its private.key",
        ),
        (
            "a public key that is not UTF-8",
            with(Some(k.expose_base64().into_bytes()), Some(vec![0xff; 44])),
            "public_key does not belong",
        ),
    ];
    for (what, data, expected) in cases {
        let e = group_key("tg/tgp-identity", Some(&data)).expect_err(what);
        assert!(e.contains(expected), "{what}: {e}");
        assert!(
            e.starts_with("group identity Secret tg/tgp-identity"),
            "{what}: {e}"
        );
        assert!(e.contains("never overwritten"), "{what}: {e}");
        // Short, whatever the Secret holds: no value is echoed.
        assert!(e.len() < 400, "{what}: {} bytes", e.len());
        assert!(
            !e.contains(&k.expose_base64()),
            "{what}: the reason shows the key"
        );
    }
}

/// What a replica does about the identity: runs the key the Secret holds; creates one when
/// there is none and it runs none; while it runs one and the Secret has been gone less than
/// IDENTITY_RECREATE_AFTER, keeps running it and waits (a rotation may be creating it), then
/// creates it again with that key; a malformed Secret is refused whatever runs, so the shell
/// keeps the running key.
#[test]
fn a_missing_identity_is_waited_for_then_created_again_with_the_running_key() {
    let running = key(97);
    let rotated = key(98);
    let never = || -> SecretKey { panic!("a new key while one runs") };
    let s = "tg/tgp-identity";
    let secs = Duration::from_secs;
    // Present: its key, whatever runs (a rotation).
    assert_eq!(
        identity_step(
            s,
            Some(&identity_data(&rotated)),
            Some(&running),
            secs(0),
            never
        ),
        Ok(IdentityStep::Use(rotated.clone()))
    );
    // Absent, nothing runs (the first replica): a new key, at once.
    assert_eq!(
        identity_step(s, None, None, secs(0), || rotated.clone()),
        Ok(IdentityStep::Create {
            key: rotated.clone(),
            recreated: false
        })
    );
    // Absent while a key runs: wait, keep it.
    for (gone, left) in [(0, 30), (1, 29), (29, 1)] {
        assert_eq!(
            identity_step(s, None, Some(&running), secs(gone), never),
            Ok(IdentityStep::Wait {
                key: running.clone(),
                remaining: secs(left)
            }),
            "gone for {gone} s"
        );
    }
    assert_eq!(IDENTITY_RECREATE_AFTER, secs(30));
    // Then create it again with that key.
    for gone in [30, 31, 100_000] {
        assert_eq!(
            identity_step(s, None, Some(&running), secs(gone), never),
            Ok(IdentityStep::Create {
                key: running.clone(),
                recreated: true
            }),
            "gone for {gone} s"
        );
    }
    // Malformed (a rotation gone wrong): refused, naming the Secret, never the key, and
    // never replaced by a create.
    let bad = BTreeMap::from([(
        KEY_PRIVATE.to_string(),
        format!("{}x", rotated.expose_base64()).into_bytes(),
    )]);
    let e = identity_step(s, Some(&bad), Some(&running), secs(0), never).expect_err("bad");
    assert!(
        e.starts_with("group identity Secret tg/tgp-identity"),
        "{e}"
    );
    assert!(e.contains("the replicas keep the key they run"), "{e}");
    assert!(!e.contains(&rotated.expose_base64()[..20]), "{e}");
    assert!(!e.contains(&running.expose_base64()[..20]), "{e}");
}

/// The group's UDP load balancer, annotated for the group, with `ingress` as the addresses
/// its load balancer has so far.
fn balancer(name: &str, created: i64, ports: Vec<ServicePort>, ingress: &[&str]) -> ServiceInfo {
    let mut s = ServiceInfo {
        namespace: "tunnelgate".into(),
        name: name.into(),
        type_: Some("LoadBalancer".into()),
        ports,
        load_balancer_ingress: ingress.iter().map(|a| a.to_string()).collect(),
        created: Some(created),
        ..ServiceInfo::default()
    };
    s.annotations
        .insert(ANNOTATION_GROUP_BALANCER.into(), GROUP.into());
    s
}

#[test]
fn the_groups_endpoint_is_its_balancers_first_address_with_its_udp_port() {
    let udp = || vec![port(51820, None, "UDP")];
    let member = service("apps", "web", 1, &[(ANNOTATION_EXPOSE, "true")]);
    for (ingress, expected) in [
        (&["203.0.113.10"][..], Some("203.0.113.10:51820")),
        (
            &["2001:db8::10", "203.0.113.10"][..],
            Some("[2001:db8::10]:51820"),
        ),
        (&["LB-1.Example.com"][..], Some("lb-1.example.com:51820")),
        // Not assigned yet: no endpoint, and nothing wrong.
        (&[][..], None),
    ] {
        let services = [member.clone(), balancer("tgp-wireguard", 5, udp(), ingress)];
        let (endpoint, problems) = balancer_endpoint(&services, GROUP);
        assert_eq!(endpoint.as_deref(), expected, "{ingress:?}");
        assert!(problems.is_empty(), "{problems:?}");
    }
    // No balancer, or one of another group: nothing.
    assert_eq!(
        balancer_endpoint(std::slice::from_ref(&member), GROUP),
        (None, vec![])
    );
    let mut other = balancer("other-wireguard", 5, udp(), &["203.0.113.10"]);
    other
        .annotations
        .insert(ANNOTATION_GROUP_BALANCER.into(), "other".into());
    assert_eq!(balancer_endpoint(&[other], GROUP), (None, vec![]));
}

/// Hostile or mistaken balancers never refuse a rendering: each gives no endpoint (or the
/// older balancer's) and a problem naming the Service.
#[test]
fn a_balancer_that_gives_no_dialable_endpoint_is_named_and_ignored() {
    let udp = || vec![port(51820, None, "UDP")];
    let cases: Vec<(Vec<ServiceInfo>, Option<&str>, &str)> = vec![
        (
            vec![balancer("lb", 5, vec![port(80, None, "TCP")], &["203.0.113.10"])],
            None,
            "tunnelgate/lb has no UDP port",
        ),
        (
            vec![balancer(
                "lb",
                5,
                vec![port(51820, None, "UDP"), port(51821, None, "UDP")],
                &["203.0.113.10"],
            )],
            None,
            "tunnelgate/lb has 2 UDP ports",
        ),
        (
            vec![balancer("lb", 5, udp(), &["not a host!"])],
            None,
            "tunnelgate/lb's address is not an endpoint",
        ),
        (
            vec![balancer("lb", 5, vec![port(0, None, "UDP")], &["203.0.113.10"])],
            None,
            "no valid port",
        ),
        (
            vec![balancer("lb", 5, vec![port(70000, None, "UDP")], &["203.0.113.10"])],
            None,
            "no valid port",
        ),
        (
            vec![balancer("lb", 5, udp(), &[&"a".repeat(300)])],
            None,
            "not a valid DNS name",
        ),
        (
            vec![
                balancer("newer", 9, udp(), &["198.51.100.1"]),
                balancer("older", 2, udp(), &["203.0.113.10"]),
            ],
            Some("203.0.113.10:51820"),
            "tunnelgate/newer is annotated tunnelgate.dev/proxy-group-balancer: tgp too; the older tunnelgate/older",
        ),
    ];
    for (services, expected, needle) in cases {
        let (endpoint, problems) = balancer_endpoint(&services, GROUP);
        assert_eq!(endpoint.as_deref(), expected, "{problems:?}");
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "{needle:?} not in {problems:?}"
        );
        // The replica renders the same, with the endpoint if any.
        let mut r = shared(1);
        r.endpoint = endpoint;
        let out = render_shared(&r, &BTreeMap::new(), &key(90));
        assert_eq!(
            daemon_view_with(&out, &key(90).expose_base64())
                .interface
                .public_endpoint
                .map(|e| e.to_string())
                .as_deref(),
            expected
        );
    }
}

#[test]
fn every_replica_renders_the_balancers_address_as_its_public_endpoint_unless_the_base_names_one() {
    let group = key(90);
    let empty = BTreeMap::new();
    for n in [0, 1, 5] {
        let mut r = shared(n);
        r.endpoint = Some("203.0.113.10:51820".into());
        let out = render_shared(&r, &empty, &group);
        let config = daemon_view_with(&out, &group.expose_base64());
        assert_eq!(
            config
                .interface
                .public_endpoint
                .as_ref()
                .map(|e| e.to_string()),
            Some("203.0.113.10:51820".into())
        );
        // What `tunnelgate check` prints for a peer: the group's key and the balancer.
        let plan = crate::core::check_report::render_plan(&config, None);
        assert!(
            plan.contains(&format!(
                "[Peer]\nPublicKey = {}\nEndpoint = 203.0.113.10:51820\n",
                group.public_key()
            )),
            "{plan}"
        );
    }
    // The operator's own public_endpoint in the base stands, and a note says so.
    let base_with = base().replace(
        "listen_port = 51820\n",
        "listen_port = 51820\npublic_endpoint = \"vpn.example.com:51820\"\n",
    );
    let mut r = shared(1);
    r.endpoint = Some("203.0.113.10:51820".into());
    let out = render_group(&r, &[], &base_with, &with_group_key(&empty, &group), || {
        panic!("no key generated")
    })
    .expect("renders");
    assert_eq!(
        daemon_view_with(&out, &group.expose_base64())
            .interface
            .public_endpoint
            .map(|e| e.to_string()),
        Some("vpn.example.com:51820".into())
    );
    assert!(
        out.rendered
            .notes
            .iter()
            .any(|n| n.contains("\"vpn.example.com:51820\" of the base config stands")),
        "{:?}",
        out.rendered.notes
    );
}

/// With a shared identity every replica renders the base config's `[takeover]` as written (its
/// endpoint exchange names the group's headless Service, the same for all): the sidecar's own
/// settings for a replica (addresses, readiness, key files) leave it alone.
#[test]
fn every_replica_of_a_shared_identity_runs_the_base_configs_endpoint_exchange() {
    let group = key(9);
    let base_with = format!(
        "{}\n[takeover]\ngroup_listen = \"0.0.0.0:51822\"\n\
         group_replicas = \"tgp.tunnelgate.svc.cluster.local:51822\"\n",
        base()
    );
    let mut seen = std::collections::BTreeSet::new();
    for ordinal in 0..3 {
        let out = render_group(
            &shared(ordinal),
            &[],
            &base_with,
            &with_group_key(&BTreeMap::new(), &group),
            || panic!("no key generated"),
        )
        .expect("renders");
        let config = daemon_view_with(&out, &group.expose_base64());
        let exchange = config.takeover.group.expect("the group exchange");
        seen.insert((exchange.listen.to_string(), exchange.replicas.to_string()));
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        [(
            "0.0.0.0:51822".to_string(),
            "tgp.tunnelgate.svc.cluster.local:51822".to_string()
        )]
    );
}
