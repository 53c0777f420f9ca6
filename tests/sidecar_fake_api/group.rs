//! Proxy groups: replicas that each write their own Secret for the Services of several namespaces.

use super::*;

pub(crate) const GROUP: &str = "tgp";
pub(crate) const POOL: &str = "100.64.1.0/24";

/// A Service of `group` (or of none) in `ns`, created at `created` (seconds into the day).
pub(crate) fn group_service(
    ns: &str,
    name: &str,
    group: Option<&str>,
    created: u32,
    annotations: Value,
) -> Value {
    let mut annotations = annotations;
    if let Some(g) = group {
        annotations["tunnelgate.dev/proxy-group"] = json!(g);
    }
    json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {
            "name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"),
            "creationTimestamp": format!("2025-01-01T00:00:{created:02}Z"),
            "annotations": annotations,
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": format!("10.96.0.{created}"),
            "clusterIPs": [format!("10.96.0.{created}")],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    })
}

pub(crate) fn group_ingress(ns: &str, name: &str, created: u32, port: u16) -> Value {
    let mut s = group_service(
        ns,
        name,
        Some(GROUP),
        created,
        json!({"tunnelgate.dev/expose": "true"}),
    );
    s["spec"]["ports"][0]["port"] = json!(port);
    s
}

pub(crate) fn group_egress(
    ns: &str,
    name: &str,
    created: u32,
    target: &str,
    port: u16,
    target_port: u16,
) -> Value {
    let mut s = group_service(
        ns,
        name,
        Some(GROUP),
        created,
        json!({"tunnelgate.dev/tunnel-ip": target}),
    );
    s["spec"]["ports"][0] =
        json!({"name": "db", "port": port, "targetPort": target_port, "protocol": "TCP"});
    s
}

/// Two namespaces: an ingress Service in `apps`, an egress one in `shop`, one of another group and
/// one of none (both on the same port as the ingress, so serving them would clash).
pub(crate) fn group_cluster() -> Vec<Value> {
    vec![
        group_ingress("apps", "web", 10, 80),
        group_egress("shop", "db", 11, "100.64.0.2", 5432, 15432),
        group_service(
            "apps",
            "other",
            Some("another"),
            12,
            json!({"tunnelgate.dev/expose": "true"}),
        ),
        group_service(
            "apps",
            "plain",
            None,
            13,
            json!({"tunnelgate.dev/expose": "true"}),
        ),
    ]
}

/// The replicas' Secrets, created empty beforehand as the manifests do.
pub(crate) fn replica_secrets(n: u32) -> BTreeMap<Key, BTreeMap<String, Vec<u8>>> {
    (0..n)
        .map(|i| (key(NS, &format!("{GROUP}-{i}")), BTreeMap::new()))
        .collect()
}

pub(crate) fn replica(inputs: &Inputs, ordinal: u32, tag: &str) -> Sidecar {
    replica_with(inputs, ordinal, tag, &[])
}

/// Replica `ordinal` of the group, with `extra` environment beside the pod's.
pub(crate) fn replica_with(
    inputs: &Inputs,
    ordinal: u32,
    tag: &str,
    extra: &[(&str, &str)],
) -> Sidecar {
    let pod = format!("{GROUP}-{ordinal}");
    let mut env = vec![
        ("POD_NAME", pod.as_str()),
        ("POD_NAMESPACE", NS),
        ("TUNNELGATE_ADDRESS_POOLS", POOL),
    ];
    env.extend_from_slice(extra);
    Sidecar::start_with(
        inputs,
        &format!("{pod}-{tag}"),
        &["--proxy-group", GROUP],
        &env,
    )
}

/// Replica 0 of the group, with a `resolv.conf` whose name server (127.0.0.1:53, where nothing
/// listens) answers nothing: only `/etc/hosts` names resolve.
pub(crate) fn replica_without_dns(inputs: &Inputs, tag: &str) -> Sidecar {
    let resolv = inputs.dir.join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.0.1\n").expect("resolv.conf");
    let resolv = resolv.display().to_string();
    let pod = format!("{GROUP}-0");
    Sidecar::start_with(
        inputs,
        &format!("{pod}-{tag}"),
        &["--proxy-group", GROUP],
        &[
            ("POD_NAME", pod.as_str()),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
            ("TUNNELGATE_RESOLV_CONF", resolv.as_str()),
        ],
    )
}

pub(crate) fn is_patch_of(name: &str) -> impl Fn(&Recorded) -> bool + '_ {
    move |r| {
        r.method == Method::PATCH && r.path == format!("/api/v1/namespaces/{NS}/secrets/{name}")
    }
}

pub(crate) fn replica_patches(fake: &Fake, ordinal: u32) -> usize {
    fake.count(is_patch_of(&format!("{GROUP}-{ordinal}")))
}

pub(crate) fn replica_secret(fake: &Fake, ordinal: u32) -> BTreeMap<String, Vec<u8>> {
    fake.secret_of(NS, &format!("{GROUP}-{ordinal}"))
}

/// `target ports` of each rule, e.g. `10.96.0.10 80/tcp`.
pub(crate) fn rule_lines(fwds: &[tunnelgate::config::Forward]) -> Vec<String> {
    fwds.iter()
        .map(|f| {
            let target = match &f.target {
                tunnelgate::config::Target::Ip(ip) => ip.to_string(),
                tunnelgate::config::Target::Fqdn(n) => n.clone(),
            };
            let ports: Vec<String> = f.ports.iter().map(ToString::to_string).collect();
            format!("{target} {}", ports.join(","))
        })
        .collect()
}

pub(crate) fn events(fake: &Fake) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(Recorded::is_event)
        .map(|r| serde_json::from_str(&r.body).expect("event JSON"))
        .collect()
}

/// Waits until both replicas have written `n` times in all and opened their watch.
pub(crate) async fn both_written(fake: &Fake, sidecars: &[&Sidecar; 2], n: usize) {
    for (i, s) in sidecars.iter().enumerate() {
        wait_for(s, &format!("replica {i}'s write number {n}"), || {
            replica_patches(fake, i as u32) == n
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_of_two_replicas_serves_the_services_of_two_namespaces() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "group");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    both_written(&fake, &[&r0, &r1], 1).await;
    wait_for(&r0, "two open watches", || fake.lock().watchers.len() == 2).await;

    // Cluster-wide list and watch: the group spans namespaces.
    assert!(fake
        .requests()
        .iter()
        .any(|r| r.path == "/api/v1/services" && r.query.contains("watch=true")));
    // Each replica wrote only its own Secret.
    let patched: BTreeSet<String> = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path)
        .collect();
    assert_eq!(
        patched,
        BTreeSet::from([
            format!("/api/v1/namespaces/{NS}/secrets/tgp-0"),
            format!("/api/v1/namespaces/{NS}/secrets/tgp-1"),
        ])
    );

    let (s0, s1) = (replica_secret(&fake, 0), replica_secret(&fake, 1));
    assert_eq!(utf8(&s0, "device_ips"), r#"["100.64.1.1"]"#);
    assert_eq!(utf8(&s1, "device_ips"), r#"["100.64.1.2"]"#);
    assert_ne!(utf8(&s0, "private.key"), utf8(&s1, "private.key"));
    assert_ne!(utf8(&s0, "public_key"), utf8(&s1, "public_key"));
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        assert_eq!(
            utf8(s, "public_key"),
            c.interface.private_key.public_key().to_base64()
        );
        // apps/web only: apps/other (another group) and apps/plain (no group) are ignored.
        assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
        assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
    }
    assert!(events(&fake).is_empty(), "{:?}", events(&fake));

    // A Service joins (in a third namespace): one write per replica.
    fake.add(group_ingress("blog", "api", 20, 443), false);
    both_written(&fake, &[&r0, &r1], 2).await;
    for i in 0..2 {
        let c = daemon_config(&replica_secret(&fake, i));
        assert_eq!(
            rule_lines(&c.ingress),
            ["10.96.0.10 80/tcp", "10.96.0.20 443/tcp"]
        );
    }

    // One changes: its new port is written.
    fake.change(
        "shop",
        "db",
        |s| s["spec"]["ports"][0]["targetPort"] = json!(15433),
        false,
    );
    both_written(&fake, &[&r0, &r1], 3).await;
    let c = daemon_config(&replica_secret(&fake, 1));
    assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15433:5432/tcp"]);

    // A later Service on port 80: an Event from each replica on it, and no write; the others
    // keep working.
    fake.add(group_ingress("blog", "clash", 30, 80), false);
    wait_for(&r0, "an Event from each replica", || {
        events(&fake).len() == 2
    })
    .await;
    for e in events(&fake) {
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["reason"], "TunnelgateServiceLeftOut");
        assert_eq!(e["involvedObject"]["kind"], "Service");
        assert_eq!(e["involvedObject"]["namespace"], "blog");
        assert_eq!(e["involvedObject"]["name"], "clash");
        assert_eq!(e["involvedObject"]["uid"], "uid-blog-clash");
        assert_eq!(e["metadata"]["namespace"], "blog");
        let m = e["message"].as_str().unwrap_or_default();
        assert!(
            m.contains("port 80/tcp on the tunnel addresses is already served by Service apps/web"),
            "{m}"
        );
    }
    // A bad annotation on another Service: its own Event, still no write.
    fake.add(
        group_service(
            "shop",
            "bad",
            Some(GROUP),
            31,
            json!({"tunnelgate.dev/tunnel-ip": "100.64.0.300"}),
        ),
        false,
    );
    wait_for(&r1, "Events on the bad Service", || {
        events(&fake).len() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        (replica_patches(&fake, 0), replica_patches(&fake, 1)),
        (3, 3)
    );
    assert_eq!(
        events(&fake).len(),
        4,
        "each problem reported once per replica"
    );

    // Leaving: deleted, and re-annotated to another group.
    fake.delete("blog", "api");
    both_written(&fake, &[&r0, &r1], 4).await;
    fake.change(
        "shop",
        "db",
        |s| s["metadata"]["annotations"]["tunnelgate.dev/proxy-group"] = json!("another"),
        false,
    );
    both_written(&fake, &[&r0, &r1], 5).await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
    assert!(c.egress.is_empty());

    // The clashing Service's rival leaves: it is served now.
    fake.delete("apps", "web");
    both_written(&fake, &[&r0, &r1], 6).await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(rule_lines(&c.ingress), ["10.96.0.30 80/tcp"]);

    let keys = [replica_secret(&fake, 0), replica_secret(&fake, 1)];
    r0.stop();
    r1.stop();

    // Restarted with nothing changed: both read, neither writes, the keys stay.
    let before = (replica_patches(&fake, 0), replica_patches(&fake, 1));
    let secret_get = |i: u32| {
        move |r: &Recorded| {
            r.method == Method::GET && r.path == format!("/api/v1/namespaces/{NS}/secrets/tgp-{i}")
        }
    };
    let gets = [fake.count(secret_get(0)), fake.count(secret_get(1))];
    let r0 = replica(&inputs, 0, "b");
    let r1 = replica(&inputs, 1, "b");
    for (i, s) in [&r0, &r1].iter().enumerate() {
        wait_for(s, "the Secret read", || {
            fake.count(secret_get(i as u32)) > gets[i]
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        (replica_patches(&fake, 0), replica_patches(&fake, 1)),
        before,
        "a restart with nothing changed writes nothing; logs:\n{}\n{}",
        r0.log(),
        r1.log()
    );
    assert_eq!([replica_secret(&fake, 0), replica_secret(&fake, 1)], keys);
    r0.stop();
    r1.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_expired_cluster_wide_watch_lists_again() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-expired");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    wait_for(&r0, "an open watch", || !fake.lock().watchers.is_empty()).await;
    let is_list =
        |r: &Recorded| r.method == Method::GET && r.path == "/api/v1/services" && !r.is_watch();
    assert_eq!(fake.count(is_list), 1);

    // Joined and left while the watch was expiring: only the new list shows it.
    fake.add(group_ingress("blog", "api", 20, 443), true);
    fake.lock().services.remove(&key("shop", "db"));
    fake.expire_watches();
    wait_for(&r0, "a new list", || fake.count(is_list) == 2).await;
    wait_for(&r0, "the write after the relist", || {
        replica_patches(&fake, 0) == 2
    })
    .await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(
        rule_lines(&c.ingress),
        ["10.96.0.10 80/tcp", "10.96.0.20 443/tcp"]
    );
    assert!(c.egress.is_empty(), "the Service deleted unseen is gone");
    wait_for(&r0, "a new watch", || !fake.lock().watchers.is_empty()).await;
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_that_does_not_exist_needs_create() {
    // No Secret, and (as with the example Role) no `create` on secrets.
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    fake.lock().may_create_secrets = false;
    let inputs = Inputs::new(&fake, "group-create");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "a refused apply", || replica_patches(&fake, 0) >= 1).await;
    wait_for(&r0, "the log naming the fix", || {
        r0.log()
            .contains("a Secret that does not exist yet needs create too")
    })
    .await;
    assert!(replica_secret(&fake, 0).is_empty());

    // Granting create (or creating the Secret) is enough: the retry writes it.
    fake.lock().may_create_secrets = true;
    wait_for(&r0, "the Secret created by apply", || {
        replica_secret(&fake, 0).len() == 4
    })
    .await;
    daemon_config(&replica_secret(&fake, 0));
    r0.stop();
}

/// An exposed ExternalName Service of the group: ingress to `external_name` on `port`.
pub(crate) fn group_external(
    ns: &str,
    name: &str,
    created: u32,
    external_name: &str,
    port: u16,
) -> Value {
    let mut s = group_ingress(ns, name, created, port);
    s["spec"] = json!({
        "type": "ExternalName",
        "externalName": external_name,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    });
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_service_whose_name_does_not_resolve_gets_a_warning_event() {
    let services = vec![
        group_ingress("apps", "web", 10, 80),
        group_external("apps", "gone", 11, "gone.invalid", 81),
        group_external("apps", "local", 12, "localhost", 82),
    ];
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-dns");
    // The pod's DNS: /etc/hosts answers `localhost`; the name server (nothing listens on
    // 127.0.0.1:53) answers nothing else.
    let r0 = replica_without_dns(&inputs, "dns");
    let pod = format!("{GROUP}-0");
    let name_events = || -> Vec<Value> {
        events(&fake)
            .into_iter()
            .filter(|e| e["reason"] == "TunnelgateNameUnresolved")
            .collect()
    };
    wait_for(&r0, "the Warning Event on apps/gone", || {
        !name_events().is_empty()
    })
    .await;

    // The Secret serves all three, and the daemon is told the name is that Service's problem.
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(
        rule_lines(&c.ingress),
        [
            "10.96.0.10 80/tcp",
            "gone.invalid 81/tcp",
            "localhost 82/tcp"
        ]
    );
    let labels: Vec<Option<&str>> = c.ingress.iter().map(|f| f.service.as_deref()).collect();
    assert_eq!(
        labels,
        [Some("apps/web"), Some("apps/gone"), Some("apps/local")]
    );
    assert_eq!(
        c.health.readiness,
        tunnelgate::config::Readiness::PerService
    );

    let e = &name_events()[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["involvedObject"]["kind"], "Service");
    assert_eq!(e["involvedObject"]["namespace"], "apps");
    assert_eq!(e["involvedObject"]["name"], "gone");
    assert_eq!(e["involvedObject"]["uid"], "uid-apps-gone");
    let m = e["message"].as_str().unwrap_or_default();
    assert!(
        m.contains("target name gone.invalid (") && m.contains("replica 0 of proxy group tgp"),
        "{m}"
    );
    // After the Secret write, never before it.
    let order: Vec<bool> = fake
        .requests()
        .into_iter()
        .filter(|r| is_patch_of(&pod)(r) || r.is_event())
        .map(|r| r.is_event())
        .collect();
    assert_eq!(
        order.first(),
        Some(&false),
        "the write comes first: {order:?}"
    );

    // Another Service joins, with a name of its own: a new write and a new check, and the
    // persisting problem is not reported again.
    let checks = || r0.log().matches("Services' names checked").count();
    let before = checks();
    fake.add(group_external("apps", "local2", 13, "localhost", 83), false);
    wait_for(&r0, "the second write", || replica_patches(&fake, 0) == 2).await;
    wait_for(&r0, "the next check", || checks() > before).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = events(&fake);
    assert_eq!(
        all.len(),
        1,
        "one Event, on apps/gone only (localhost resolves, apps/web has no name): {all:?}"
    );
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_in_listed_namespaces_only_watches_those() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-ns");
    let r0 = Sidecar::start_with(
        &inputs,
        "ns",
        &["--proxy-group", GROUP, "--namespace", "shop"],
        &[
            ("POD_NAME", "tgp-0"),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
        ],
    );
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    assert!(fake.requests().iter().all(|r| r.path != "/api/v1/services"));
    let c = daemon_config(&replica_secret(&fake, 0));
    assert!(
        c.ingress.is_empty(),
        "apps/web is in a namespace not listed"
    );
    assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
    r0.stop();
}

/// `--secret NS/NAME` names the replica's Secret instead of `$POD_NAMESPACE/$POD_NAME`; a problem
/// of the replica itself (here a broken `private.key` in that Secret) is a Warning Event on its
/// Pod, said once, and nothing is written until it is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_flag_and_a_replica_problem_warned_on_its_pod() {
    let mut secrets = BTreeMap::new();
    secrets.insert(
        key(NS, "custom-0"),
        BTreeMap::from([("private.key".to_string(), b"not a key".to_vec())]),
    );
    let fake = Fake::start_many(group_cluster(), secrets).await;
    let inputs = Inputs::new(&fake, "group-secret-flag");
    let secret_flag = format!("{NS}/custom-0");
    let r0 = Sidecar::start_with(
        &inputs,
        "secret-flag",
        &["--proxy-group", GROUP, "--secret", &secret_flag],
        &[
            ("POD_NAME", "tgp-0"),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
        ],
    );
    let pod_warning = |fake: &Fake| {
        events(fake).into_iter().find(|e| {
            e["involvedObject"]["kind"] == "Pod" && e["involvedObject"]["name"] == "tgp-0"
        })
    };
    wait_for(&r0, "a Warning Event on the pod", || {
        pod_warning(&fake).is_some()
    })
    .await;
    let e = pod_warning(&fake).expect("event");
    assert_eq!(e["type"], "Warning", "{e}");
    assert_eq!(e["involvedObject"]["namespace"], NS, "{e}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains("private.key"), "{message}");
    assert_eq!(fake.count(is_patch_of("custom-0")), 0, "nothing written");

    // Fixed (the key deleted, so one is generated): the named Secret is written, and never
    // the pod-named one.
    fake.lock()
        .secrets
        .insert(key(NS, "custom-0"), BTreeMap::new());
    // (The sidecar reads the Secret on its next pass: a Service event here, else its 5-minute
    // resync.)
    fake.add(group_ingress("blog", "api", 20, 443), false);
    wait_for(&r0, "the write to custom-0", || {
        fake.count(is_patch_of("custom-0")) == 1
    })
    .await;
    let written = fake.secret_of(NS, "custom-0");
    assert_eq!(daemon_config(&written).interface.addresses.len(), 1);
    assert_eq!(
        fake.count(is_patch_of("tgp-0")),
        0,
        "the pod-named Secret untouched"
    );
    let pod_events = events(&fake)
        .into_iter()
        .filter(|e| e["involvedObject"]["kind"] == "Pod")
        .count();
    assert_eq!(pod_events, 1, "the problem was said once");
    r0.stop();
}

#[test]
fn group_bad_usage_exits_2() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
            .args(args)
            .args(["--base-config", "/x"])
            .env_remove("POD_NAME")
            .env_remove("TUNNELGATE_SECRET")
            .env_remove("TUNNELGATE_SERVICE")
            .env_remove("TUNNELGATE_PROXY_GROUP")
            .env_remove("TUNNELGATE_ADDRESS_POOLS")
            .envs(env.iter().copied())
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // A pool needs an ordinal.
    let (code, err) = run(
        &["--proxy-group", "tgp", "--address-pool", POOL],
        &[("POD_NAME", "tgp")],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("has no ordinal suffix"), "{err}");
    // Replica 300 does not fit a /24.
    let (code, err) = run(
        &["--proxy-group", "tgp"],
        &[("POD_NAME", "tgp-300"), ("TUNNELGATE_ADDRESS_POOLS", POOL)],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("replica 300 needs host 301"), "{err}");
    // Both modes, or neither.
    let (code, _) = run(
        &["--proxy-group", "tgp", "--service", "tg/web"],
        &[("POD_NAME", "tgp-0")],
    );
    assert_eq!(code, Some(2));
    let (code, _) = run(&[], &[("POD_NAME", "tgp-0")]);
    assert_eq!(code, Some(2));
    // No Secret to write.
    let (code, err) = run(&["--proxy-group", "tgp"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("POD_NAME"), "{err}");
}
