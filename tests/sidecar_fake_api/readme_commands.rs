//! The README's single-Service and proxy-group commands run as shown against the fake, and its peer config brought up by wg-quick.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_single_service_commands() {
    if !kubectl_or_skip() {
        return;
    }
    let fake = Fake::start_many(Vec::new(), BTreeMap::new()).await;
    // As the Role: get and patch on the Secret, no create.
    fake.lock().may_create_secrets = false;
    let inputs = Inputs::new(&fake, "readme-single");
    let sh = Shell::new(&inputs);
    sh.edit("containers/k8s/config.yaml", PLACEHOLDER_KEY, &peer_key());

    // Step 4: apply.
    let out = sh
        .run(&readme_line("kubectl apply -k containers/k8s"))
        .await;
    println!("{out}");
    let objects = SINGLE_OBJECTS.iter().map(|o| format!("{o} created\n"));
    assert_eq!(out, objects.collect::<String>());

    let sidecar = sidecar_of(
        &fake,
        &inputs,
        "tunnelgate-proxy",
        "tunnelgate-base",
        "tunnelgate-proxy-0",
    );
    wait_secret_written(&fake, &sidecar, "tunnelgate-proxy").await;
    fake.give_load_balancer_ip("tunnelgate", "tunnelgate-proxy-wireguard", "203.0.113.7");

    // Step 5: what the peer needs.
    let data = fake.secret_of("tunnelgate", "tunnelgate-proxy");
    let public_key = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}'",
        ))
        .await;
    assert_eq!(public_key, utf8(&data, "public_key"));
    assert_eq!(
        public_key,
        daemon_config(&data)
            .interface
            .private_key
            .public_key()
            .to_base64()
    );
    let device_ips = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.device_ips}'",
        ))
        .await;
    assert_eq!(device_ips, r#"["100.64.0.1","fd7a:115c:a1e0::1"]"#);
    let lb = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get service tunnelgate-proxy-wireguard",
        ))
        .await;
    assert_eq!(lb, "203.0.113.7");
    // The README's `wg set` line routes exactly those addresses to the proxy.
    let wg_set = readme_line("wg set wg0 peer <public_key>");
    assert!(
        wg_set.contains(
            " allowed-ips 100.64.0.1/32,fd7a:115c:a1e0::1/128 endpoint <load balancer IP>:51820"
        ),
        "{wg_set}"
    );

    // Bad input: a Warning Event that `describe` shows.
    fake.change(
        "tunnelgate",
        "web",
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-ip"] = json!("100.64.0.300"),
        false,
    );
    wait_for(&sidecar, "the Event", || {
        stored_events(&fake, "tunnelgate", "web") == 1
    })
    .await;
    let out = sh
        .run(&readme_line("kubectl -n tunnelgate describe service web"))
        .await;
    println!("{out}");
    let warnings = lines_with(&out, "Warning  InvalidTunnelgateConfig");
    assert_eq!(warnings.len(), 1, "{out}");
    assert!(warnings[0].contains("tunnelgate-sidecar"), "{out}");
    assert!(
        warnings[0].contains("\"100.64.0.300\" is not an IP address"),
        "{out}"
    );
    fake.change(
        "tunnelgate",
        "web",
        |s| {
            s["metadata"]["annotations"]
                .as_object_mut()
                .expect("annotations")
                .remove("tunnelgate.dev/tunnel-ip");
        },
        false,
    );

    // Rotating the key: removed, then a new one on the next pass. A change of the Service's
    // annotations makes one (a label would not: the sidecar does not render labels).
    let out = sh
        .run(&readme_line(
            "kubectl -n tunnelgate patch secret tunnelgate-proxy",
        ))
        .await;
    assert_eq!(out, "secret/tunnelgate-proxy patched\n");
    assert!(!fake
        .secret_of("tunnelgate", "tunnelgate-proxy")
        .contains_key("private.key"));
    fake.change(
        "tunnelgate",
        "web",
        |s| s["metadata"]["annotations"]["example.com/note"] = json!("rotate"),
        false,
    );
    wait_secret_written(&fake, &sidecar, "tunnelgate-proxy").await;
    let rotated = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}'",
        ))
        .await;
    assert_ne!(rotated, public_key, "a new key");
    let data = fake.secret_of("tunnelgate", "tunnelgate-proxy");
    assert_eq!(
        rotated,
        daemon_config(&data)
            .interface
            .private_key
            .public_key()
            .to_base64()
    );
    sidecar.stop();
}

/// What `kubectl apply -k containers/k8s` prints (kustomize's order).
pub(crate) const SINGLE_OBJECTS: &[&str] = &[
    "namespace/tunnelgate",
    "serviceaccount/tunnelgate-proxy",
    "role.rbac.authorization.k8s.io/tunnelgate-proxy",
    "rolebinding.rbac.authorization.k8s.io/tunnelgate-proxy",
    "configmap/tunnelgate-base",
    "secret/tunnelgate-proxy",
    "service/tunnelgate-proxy",
    "service/tunnelgate-proxy-wireguard",
    "service/web",
    "deployment.apps/web",
    "statefulset.apps/tunnelgate-proxy",
];

/// What `kubectl apply -k containers/k8s/group` prints (kustomize's order).
pub(crate) const GROUP_OBJECTS: &[&str] = &[
    "namespace/apps",
    "namespace/shop",
    "namespace/tunnelgate",
    "serviceaccount/tgp",
    "role.rbac.authorization.k8s.io/tgp",
    "clusterrole.rbac.authorization.k8s.io/tunnelgate-proxy-group",
    "rolebinding.rbac.authorization.k8s.io/tgp",
    "clusterrolebinding.rbac.authorization.k8s.io/tunnelgate-proxy-group-tgp",
    "configmap/tgp-base",
    "service/web",
    "service/db",
    "service/db",
    "service/tgp",
    "deployment.apps/web",
    "statefulset.apps/tgp",
    "poddisruptionbudget.policy/tgp",
    "networkpolicy.networking.k8s.io/tgp",
];

/// The peer of the README (its private key).
pub(crate) fn peer_secret() -> SecretKey {
    SecretKey([7; 32])
}

/// A group deployed from the README: applied, both replicas' sidecars running, load balancers
/// given addresses; what the README's loop printed, and the README's peer config filled in
/// with it.
pub(crate) struct GroupDeployed {
    pub(crate) fake: Arc<Fake>,
    pub(crate) sh: Shell,
    pub(crate) replicas: [Sidecar; 2],
    pub(crate) loop_output: String,
    pub(crate) peer_config: String,
    pub(crate) _inputs: Inputs,
}

pub(crate) async fn readme_group_deployed(tag: &str) -> GroupDeployed {
    let fake = Fake::start_many(Vec::new(), BTreeMap::new()).await;
    // No Secret beforehand: the Role lets each sidecar create its own.
    fake.lock().may_create_secrets = group_role_secret_verbs().contains("create");
    let inputs = Inputs::new(&fake, tag);
    let sh = Shell::new(&inputs);
    // "edit k8s/group/config.yaml: the peer's public key, its endpoint and allowed_ips"
    sh.edit(
        "containers/k8s/group/config.yaml",
        PLACEHOLDER_KEY,
        &peer_key(),
    );
    let out = sh
        .run(&readme_line("kubectl apply -k containers/k8s/group"))
        .await;
    let objects = GROUP_OBJECTS.iter().map(|o| format!("{o} created\n"));
    assert_eq!(out, objects.collect::<String>());

    let replicas = ["tgp-0", "tgp-1"].map(|pod| sidecar_of(&fake, &inputs, "tgp", "tgp-base", pod));
    for (r, name) in replicas.iter().zip(["tgp-0", "tgp-1"]) {
        wait_secret_written(&fake, r, name).await;
    }

    let block = readme_blocks("sh")
        .into_iter()
        .find(|b| b.starts_with("for i in 0 1; do"))
        .expect("the README's loop over the replicas");
    let loop_output = sh.run(&block).await;
    let lines: Vec<&str> = loop_output.lines().collect();
    assert_eq!(lines.len(), 4, "{loop_output}");

    // The per-replica group's peer config (the shared identity's is the other one).
    let ini: Vec<String> = readme_blocks("ini")
        .into_iter()
        .filter(|b| b.contains("<public_key of tgp-0>"))
        .collect();
    assert_eq!(ini.len(), 1, "one per-replica peer config in the README");
    let peer_config = ini[0]
        .replace("<the peer's private key>", &peer_secret().expose_base64())
        .replace("<public_key of tgp-0>", lines[0])
        .replace("<public_key of tgp-1>", lines[2]);
    assert!(
        !peer_config.contains('<'),
        "a placeholder left:\n{peer_config}"
    );
    GroupDeployed {
        fake,
        sh,
        replicas,
        loop_output,
        peer_config,
        _inputs: inputs,
    }
}

/// `[Peer]` sections of a wg-quick config: (PublicKey, Endpoint, AllowedIPs, PersistentKeepalive).
pub(crate) fn config_peers(conf: &str) -> Vec<[String; 4]> {
    let mut peers = Vec::new();
    for section in conf.split("[Peer]").skip(1) {
        let get = |k: &str| {
            section
                .lines()
                .find_map(|l| l.strip_prefix(k)?.trim_start().strip_prefix('='))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        peers.push([
            get("PublicKey"),
            get("Endpoint"),
            get("AllowedIPs"),
            get("PersistentKeepalive"),
        ]);
    }
    peers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_proxy_group_commands() {
    if !kubectl_or_skip() {
        return;
    }
    let g = readme_group_deployed("readme-group").await;
    let fake = &g.fake;
    let (s0, s1) = (
        fake.secret_of("tunnelgate", "tgp-0"),
        fake.secret_of("tunnelgate", "tgp-1"),
    );
    let (pk0, pk1) = (utf8(&s0, "public_key"), utf8(&s1, "public_key"));
    assert_eq!(
        g.loop_output,
        format!("{pk0}\n[\"100.64.1.1\"]\n{pk1}\n[\"100.64.1.2\"]\n")
    );
    // The examples are served: apps/web (its ClusterIP from the fake) and the egress Service db.
    let web_ip = fake.lock().services[&key("apps", "web")]["spec"]["clusterIP"]
        .as_str()
        .expect("ClusterIP")
        .to_string();
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        assert_eq!(
            c.interface.private_key.public_key().to_base64(),
            utf8(s, "public_key")
        );
        assert_eq!(rule_lines(&c.ingress), [format!("{web_ip} 80/tcp")]);
        assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
        assert_eq!(c.peers[0].public_key.to_base64(), peer_key());
    }
    // The README's peer config, filled in: one peer per replica, with its key and its
    // address, and no endpoint: the replicas dial the peer at the base config's endpoint, whose
    // port is the peer's ListenPort.
    assert_eq!(
        config_peers(&g.peer_config),
        [
            [pk0, String::new(), "100.64.1.1/32".into(), String::new()],
            [pk1, String::new(), "100.64.1.2/32".into(), String::new()],
        ]
    );
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        let endpoint = c.peers[0]
            .endpoint
            .as_ref()
            .expect("the replica dials the peer");
        let port = match endpoint {
            tunnelgate::config::Endpoint::Addr(a) => a.port(),
            tunnelgate::config::Endpoint::Host { port, .. } => *port,
        };
        assert!(
            g.peer_config.contains(&format!("\nListenPort = {port}\n")),
            "{}",
            g.peer_config
        );
        assert!(c.peers[0].persistent_keepalive.is_some_and(|k| k > 0));
    }
    // Its Address is what the base config's peer allows, and the egress target.
    assert!(
        g.peer_config.contains("\nAddress = 100.64.0.2/32\n"),
        "{}",
        g.peer_config
    );
    assert_eq!(
        daemon_config(&s0).peers[0]
            .allowed_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["100.64.0.2/32"]
    );

    // A second Service on port 80, newer than apps/web: left out, with an Event from each
    // replica that `describe` shows.
    let mut web2 = group_ingress("apps", "web2", 0, 80);
    web2["metadata"]["creationTimestamp"] = json!("2025-01-03T00:00:00Z");
    fake.add(web2, false);
    wait_for(&g.replicas[0], "an Event from each replica", || {
        stored_events(fake, "apps", "web2") == 2
    })
    .await;
    let out =
        g.sh.run(&readme_line("kubectl -n apps describe service web2"))
            .await;
    println!("{out}");
    let warnings = lines_with(&out, "Warning  TunnelgateServiceLeftOut");
    assert_eq!(warnings.len(), 2, "{out}");
    for w in warnings {
        assert!(
            w.contains("port 80/tcp on the tunnel addresses is already served by Service apps/web"),
            "{out}"
        );
    }
    let [r0, r1] = g.replicas;
    r0.stop();
    r1.stop();
}

/// The README's peer config, filled in from the fake's Secrets, is a config `wg-quick` brings up
/// (wireguard-go where the kernel has no WireGuard), with one peer per replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn readme_peer_config_is_brought_up_by_wg_quick() {
    common::require_root();
    if !kubectl_or_skip() {
        return;
    }
    let g = readme_group_deployed("readme-wg").await;
    let ns = common::Netns::new();
    let dev = common::unique_name("tgw");
    let conf = ns.dir().write(&format!("{dev}.conf"), &g.peer_config);
    let conf = conf.display().to_string();
    ns.exec(&[
        "env",
        "WG_QUICK_USERSPACE_IMPLEMENTATION=wireguard-go",
        "wg-quick",
        "up",
        &conf,
    ]);
    let dump = ns.exec(&["wg", "show", &dev, "dump"]);
    let mut lines = dump.lines().map(|l| l.split('\t').collect::<Vec<_>>());
    let interface = lines.next().expect("interface line");
    assert_eq!(interface[1], peer_key(), "{dump}");
    assert_eq!(interface[2], "51820", "{dump}");
    let mut peers: Vec<[String; 4]> = lines
        // `wg` shows an unset endpoint as "(none)" and an unset keepalive as "off".
        .map(|p| [p[0], p[2], p[3], p[7]].map(|f| f.replace("(none)", "").replace("off", "")))
        .collect();
    // `wg show` sorts peers by their last handshake, and neither has one: their order is
    // wireguard-go's map order, so both sides are compared sorted.
    let mut expected = config_peers(&g.peer_config);
    peers.sort();
    expected.sort();
    assert_eq!(peers, expected, "{dump}");
    assert_eq!(peers.len(), 2);
    let addr = ns.exec(&["ip", "-o", "addr", "show", "dev", &dev]);
    assert!(addr.contains(" 100.64.0.2/32 "), "{addr}");
    let routes = ns.exec(&["ip", "route", "show", "dev", &dev]);
    for ip in ["100.64.1.1", "100.64.1.2"] {
        assert!(routes.contains(ip), "{routes}");
    }
    ns.exec(&["wg-quick", "down", &conf]);
    let [r0, r1] = g.replicas;
    r0.stop();
    r1.stop();
}

/// "Rotating the group's key": the README's commands, run as shown (`wg genkey`, `kubectl create
/// secret ... --dry-run=client -o yaml | kubectl apply -f -`) against two replicas of a shared
/// identity in namespace tunnelgate, put a new key and its public key in `tgp-identity`; both
/// replicas' volumes run it within 2 s, their Secrets get its public key and no private key, and
/// the key file is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_shared_identity_rotation_command() {
    if !kubectl_or_skip() {
        return;
    }
    let wg = Command::new("wg")
        .arg("--version")
        .output()
        .map_err(|e| format!("wg (wireguard-tools) is not installed: {e}"));
    if crate::common::ok_or_skip(wg).is_none() {
        return;
    }
    let ns = "tunnelgate";
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "readme-rotate");
    let volume = |i: u32| inputs.dir.join(format!("tgp-{i}-volume"));
    let volume_key = |i: u32| std::fs::read_to_string(volume(i).join("private.key")).ok();
    let replicas = [0, 1].map(|i| {
        let pod = format!("tgp-{i}");
        std::fs::create_dir_all(volume(i)).expect("volume");
        let dir = volume(i).display().to_string();
        Sidecar::start_with(
            &inputs,
            &pod,
            &["--proxy-group", "tgp"],
            &[
                ("POD_NAME", pod.as_str()),
                ("POD_NAMESPACE", ns),
                ("TUNNELGATE_ADDRESS_POOLS", POOL),
                ("TUNNELGATE_GROUP_IDENTITY", "shared"),
                ("TUNNELGATE_CONFIG_DIR", dir.as_str()),
            ],
        )
    });
    let identity = || fake.secret_of(ns, "tgp-identity");
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("tgp-{i}'s volume"), || {
            volume_key(i as u32).is_some()
        })
        .await;
    }
    let old = utf8(&identity(), "private.key");

    let sh = Shell::new(&inputs);
    let block = readme_blocks("sh")
        .into_iter()
        .find(|b| b.starts_with("(umask 077; wg genkey > tgp.key)"))
        .expect("the README's rotation");
    let out = sh.run(&block).await;
    assert_eq!(out, "secret/tgp-identity configured\n");
    assert!(!sh.root.join("tgp.key").exists(), "the key file is removed");
    let new = utf8(&identity(), "private.key");
    assert_ne!(new.trim(), old.trim(), "a new key");
    let new_key = SecretKey(
        tunnelgate::config::decode_key(new.trim()).expect("the README's key is a WireGuard key"),
    );
    assert_eq!(
        utf8(&identity(), "public_key").trim(),
        new_key.public_key().to_base64()
    );
    let start = clock::tokio_now();
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("tgp-{i} running the new key"), || {
            volume_key(i as u32).as_deref() == Some(new_key.expose_base64().as_str())
                && utf8(&fake.secret_of(ns, &format!("tgp-{i}")), "public_key")
                    == new_key.public_key().to_base64()
        })
        .await;
        assert!(!fake
            .secret_of(ns, &format!("tgp-{i}"))
            .contains_key("private.key"));
        assert_eq!(
            handed_over(&volume(i as u32)).interface.private_key,
            new_key
        );
    }
    let took = clock::tokio_now() - start;
    assert!(took < Duration::from_secs(2), "took {took:?}");
    for r in replicas {
        r.stop();
    }
}
