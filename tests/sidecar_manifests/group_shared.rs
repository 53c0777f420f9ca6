//! The proxy group with a shared identity (containers/k8s/group-shared, an overlay of ../group):
//! what `kubectl kustomize` builds is valid, the sidecar runs with `--identity shared`, one UDP
//! load balancer with client affinity and the clients' own addresses fronts the ready replicas,
//! rolling updates and disruptions take one replica at a time, the Role reads the identity by
//! name, and every replica renders the same key and address from the base config.

use super::schemas::validate;
use super::*;
use tunnelgate::sidecar::group::{render_group, with_group_key, Identity, Replica};

pub(crate) fn shared_dir() -> PathBuf {
    dir().join("group-shared")
}

/// What `kubectl kustomize containers/k8s/group-shared` prints; `None` without kubectl (the
/// test skips: [`kubectl_or_skip`]).
fn kustomized_or_skip() -> Option<String> {
    if !kubectl_or_skip() {
        return None;
    }
    let out = Command::new("kubectl")
        .args(["kustomize", "containers/k8s/group-shared"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("KUBECONFIG", "/dev/null")
        .output()
        .expect("kubectl kustomize");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).expect("utf-8"))
}

/// The objects of [`kustomized_or_skip`].
fn built_or_skip() -> Option<Vec<Value>> {
    let text = kustomized_or_skip()?;
    Some(serde_saphyr::from_multiple(&text).expect("kustomize output parses"))
}

fn one<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in group-shared"))
}

fn in_list<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .and_then(|l| l.iter().find(|i| i["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

/// Every object `kubectl apply -k containers/k8s/group-shared` sends is valid against the
/// Kubernetes 1.33 schemas (`kubernetes-validate --strict`).
#[test]
fn group_shared_builds_and_every_object_is_valid() {
    let Some(text) = kustomized_or_skip() else {
        return;
    };
    let objects: Vec<Value> = serde_saphyr::from_multiple(&text).expect("kustomize output parses");
    assert!(objects.len() >= 15, "{} objects", objects.len());
    assert!(shared_dir().join("kustomization.yaml").is_file());
    let Some(validator) = validator_or_skip() else {
        return;
    };
    let tmp = common::TempDir::new("tg-group-shared");
    let file = tmp.path().join("group-shared.yaml");
    std::fs::write(&file, &text).expect("write");
    if let Err(report) = validate(&validator, &file) {
        panic!("{report}");
    }
}

#[test]
fn group_shared_runs_one_identity_behind_one_udp_balancer() {
    let Some(objects) = built_or_skip() else {
        return;
    };
    let set = one(&objects, "StatefulSet", "tgp");
    let pod = &set["spec"]["template"]["spec"];
    let sidecar = in_list(&pod["containers"], "sidecar");
    assert_eq!(
        in_list(&sidecar["env"], "TUNNELGATE_GROUP_IDENTITY")["value"],
        "shared"
    );
    assert_eq!(
        Identity::parse(
            in_list(&sidecar["env"], "TUNNELGATE_GROUP_IDENTITY")["value"]
                .as_str()
                .unwrap_or_default()
        ),
        Ok(Identity::Shared)
    );
    // The balancer: UDP, client affinity, the client's address kept, the ready replicas.
    let lb = one(&objects, "Service", "tgp-wireguard");
    assert_eq!(lb["metadata"]["namespace"], NS);
    assert_eq!(lb["spec"]["type"], "LoadBalancer");
    assert_eq!(lb["spec"]["sessionAffinity"], "ClientIP");
    assert_eq!(lb["spec"]["externalTrafficPolicy"], "Local");
    assert_eq!(lb["spec"]["publishNotReadyAddresses"], Value::Null);
    // Annotated for the group: the sidecar prints its address as the peers' Endpoint.
    assert_eq!(
        lb["metadata"]["annotations"][tunnelgate::sidecar::group::ANNOTATION_GROUP_BALANCER],
        "tgp"
    );
    let labels = &set["spec"]["template"]["metadata"]["labels"];
    for (k, v) in lb["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(&labels[k], v, "the balancer selects the replicas");
    }
    let ports = lb["spec"]["ports"].as_array().expect("ports");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0]["protocol"], "UDP");
    let proxy = in_list(&pod["containers"], "proxy");
    let target = in_list(
        &proxy["ports"],
        ports[0]["targetPort"].as_str().expect("named"),
    );
    assert_eq!(target["protocol"], "UDP");
    assert_eq!(target["containerPort"], 51820);
    // Readiness from /readyz takes a dead replica out; preStop keeps a stopping one serving
    // while that spreads; one replica at a time in a rolling update and a disruption.
    assert_eq!(proxy["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(proxy["lifecycle"]["preStop"].is_object(), "preStop");
    let strategy = &set["spec"]["updateStrategy"];
    assert!(
        strategy.is_null() || strategy["type"] == "RollingUpdate",
        "{strategy}"
    );
    assert!(
        strategy["rollingUpdate"]["maxUnavailable"].is_null()
            || strategy["rollingUpdate"]["maxUnavailable"] == 1
    );
    let pdb = one(&objects, "PodDisruptionBudget", "tgp");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], *labels);
    // No egress example: a peer's session is with one replica at a time.
    assert!(!objects.iter().any(|o| o["kind"] == "Service"
        && o["metadata"]["annotations"]["tunnelgate.dev/tunnel-ip"].is_string()));
    assert!(!objects
        .iter()
        .any(|o| o["kind"] == "Service" && o["metadata"]["name"] == "db"));
}

/// The Role reads and watches the identity Secret by name and may create it; it can never
/// overwrite it, and reads no other Secret.
#[test]
fn group_shared_role_gets_the_identity_by_name_and_never_writes_it() {
    let Some(objects) = built_or_skip() else {
        return;
    };
    let role = one(&objects, "Role", "tgp-identity");
    assert_eq!(role["metadata"]["namespace"], NS);
    let rules = role["rules"].as_array().expect("rules");
    // The sidecar watches it with a metadata.name field selector: list and watch by name.
    for verb in ["get", "list", "watch"] {
        let rule = rules
            .iter()
            .find(|r| strs(&r["verbs"]).contains(verb))
            .unwrap_or_else(|| panic!("{verb}"));
        assert_eq!(
            strs(&rule["resourceNames"]),
            BTreeSet::from(["tgp-identity".to_string()]),
            "{verb}"
        );
        assert_eq!(
            strs(&rule["resources"]),
            BTreeSet::from(["secrets".to_string()])
        );
    }
    let create = rules
        .iter()
        .find(|r| strs(&r["verbs"]).contains("create"))
        .expect("create");
    // RBAC cannot limit create by name: a resourceNames here would deny every create.
    assert!(create["resourceNames"].is_null());
    for r in rules {
        for verb in ["update", "patch", "delete", "*"] {
            assert!(!strs(&r["verbs"]).contains(verb), "{verb}: {r}");
        }
    }
    let binding = one(&objects, "RoleBinding", "tgp-identity");
    assert_eq!(binding["roleRef"]["name"], "tgp-identity");
    let sa = set_sa(&objects);
    assert!(binding["subjects"]
        .as_array()
        .is_some_and(|s| s.iter().any(|s| s["name"] == sa && s["namespace"] == NS)));
}

fn set_sa(objects: &[Value]) -> String {
    one(objects, "StatefulSet", "tgp")["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("service account")
        .to_string()
}

/// The base config of the overlay renders, with the group's Services, into the same key and
/// address for every replica, and its peer has no endpoint (the peer dials the balancer).
#[test]
fn group_shared_base_config_renders_one_key_and_address_for_every_replica() {
    let Some(objects) = built_or_skip() else {
        return;
    };
    let base = one(&objects, "ConfigMap", "tgp-base")["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let parsed: toml::Table = base.parse().expect("toml");
    for peer in parsed["peer"].as_array().expect("peers") {
        assert!(peer.get("endpoint").is_none(), "{peer}");
        assert!(peer.get("persistent_keepalive").is_none(), "{peer}");
    }
    let set = one(&objects, "StatefulSet", "tgp");
    let sidecar = in_list(&set["spec"]["template"]["spec"]["containers"], "sidecar");
    let pools: Vec<tunnelgate::config::IpNet> =
        in_list(&sidecar["env"], "TUNNELGATE_ADDRESS_POOLS")["value"]
            .as_str()
            .expect("pools")
            .split(',')
            .map(|p| p.parse().expect("pool"))
            .collect();
    let mut services = Vec::new();
    for (i, mut svc) in objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .cloned()
        .enumerate()
    {
        if svc["spec"]["clusterIP"].is_null() {
            svc["spec"]["clusterIP"] = format!("10.96.0.{}", 10 + i).into();
        }
        let svc: k8s_openapi::api::core::v1::Service =
            serde_json::from_value(svc).expect("Service");
        services.push(service_info(&svc));
    }
    let group = SecretKey([77; 32]);
    let replicas = set["spec"]["replicas"].as_u64().expect("replicas") as u32;
    let mut seen = BTreeSet::new();
    for ordinal in 0..replicas + 1 {
        let replica = Replica {
            group: "tgp".into(),
            ordinal,
            pools: pools.clone(),
            identity: Identity::Shared,
            endpoint: None,
        };
        let current = with_group_key(&BTreeMap::new(), &group);
        let out = render_group(&replica, &services, &base, &current, || {
            panic!("a replica generated its own key")
        })
        .unwrap_or_else(|e| panic!("replica {ordinal}: {e}"));
        assert!(out.refused.is_empty(), "{:?}", out.refused);
        assert_eq!(out.served, ["apps/web"]);
        let data = &out.rendered.data;
        // The group's key is kept in its identity Secret only, never in a replica's.
        assert!(!data.contains_key("private.key"), "replica {ordinal}");
        seen.insert((data["public_key"].clone(), data["device_ips"].clone()));
        assert_eq!(
            data["public_key"],
            group.public_key().to_base64().as_bytes()
        );
        assert_eq!(data["device_ips"], br#"["100.64.1.1"]"#);
    }
    assert_eq!(seen.len(), 1, "every replica renders the same identity");
}

/// Every policy of `objects` that selects pods labelled `labels`, and each of its ingress rules
/// that lets UDP `port` in (a rule without ports lets every port in).
fn rules_opening<'a>(
    objects: &'a [Value],
    labels: &Value,
    port: u64,
) -> Vec<(&'a Value, &'a Value)> {
    let selects = |np: &Value| {
        np["spec"]["podSelector"]["matchLabels"]
            .as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| &labels[k] == v))
    };
    let opens = |rule: &Value| match rule["ports"].as_array() {
        None => true,
        Some(ports) => ports.iter().any(|p| {
            (p["protocol"].is_null() || p["protocol"] == "UDP")
                && (p["port"].is_null()
                    || p["port"].as_u64() == Some(port)
                    || p["port"] == "group-exchange"
                    || p["endPort"].as_u64().is_some_and(|end| {
                        p["port"].as_u64().is_some_and(|s| s <= port) && port <= end
                    }))
        }),
    };
    objects
        .iter()
        .filter(|o| o["kind"] == "NetworkPolicy" && selects(o))
        .flat_map(|np| {
            np["spec"]["ingress"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| opens(r))
                .map(move |r| (np, r))
        })
        .collect()
}

/// The replicas tell each other where peers authenticated (the base config's `[takeover]`
/// group exchange): `group_replicas` is the StatefulSet's headless Service, which lists
/// replicas before they are ready and names the exchange port (UDP, not the WireGuard port),
/// the proxy declares it, and the network policies open it to the group's pods and no one
/// else; every replica's daemon runs the exchange; the endpoints file is on a volume.
#[test]
fn group_shared_replicas_tell_each_other_where_peers_authenticated() {
    let Some(objects) = built_or_skip() else {
        return;
    };
    let base = one(&objects, "ConfigMap", "tgp-base")["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let parsed: toml::Table = base.parse().expect("toml");
    let takeover = parsed
        .get("takeover")
        .and_then(toml::Value::as_table)
        .expect("the base config's [takeover]: the group's endpoint exchange");
    assert!(
        takeover.get("answer_any_source").is_none(),
        "the unsafe opt-in stays off"
    );
    let listen: std::net::SocketAddr = takeover
        .get("group_listen")
        .and_then(toml::Value::as_str)
        .expect("group_listen")
        .parse()
        .expect("an address");
    let port = u64::from(listen.port());
    assert_ne!(
        port, 51820,
        "not the WireGuard port, which is open to anyone"
    );
    let (host, replicas_port) = takeover
        .get("group_replicas")
        .and_then(toml::Value::as_str)
        .expect("group_replicas")
        .rsplit_once(':')
        .expect("host:port");
    assert_eq!(replicas_port.parse::<u64>().ok(), Some(port));

    // The name is the StatefulSet's headless Service, which lists not-ready replicas too.
    let set = one(&objects, "StatefulSet", "tgp");
    let service_name = set["spec"]["serviceName"].as_str().expect("serviceName");
    assert_eq!(host, format!("{service_name}.{NS}.svc.cluster.local"));
    let headless = one(&objects, "Service", service_name);
    assert_eq!(headless["metadata"]["namespace"], NS);
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(headless["spec"]["publishNotReadyAddresses"], true);
    let labels = &set["spec"]["template"]["metadata"]["labels"];
    for (k, v) in headless["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(&labels[k], v, "the headless Service selects the replicas");
    }
    let service_port = headless["spec"]["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["port"].as_u64() == Some(port)))
        .expect("the exchange port on the headless Service");
    assert_eq!(service_port["protocol"], "UDP");
    let name = service_port["name"].as_str().expect("a named port");
    let pod = &set["spec"]["template"]["spec"];
    let proxy = in_list(&pod["containers"], "proxy");
    let declared = in_list(&proxy["ports"], name);
    assert_eq!(declared["containerPort"].as_u64(), Some(port));
    assert_eq!(declared["protocol"], "UDP");
    // Peers never reach it: no balancer forwards it.
    let lb = one(&objects, "Service", "tgp-wireguard");
    assert!(lb["spec"]["ports"].as_array().is_some_and(|ps| ps
        .iter()
        .all(|p| p["port"].as_u64() != Some(port)
            && p["targetPort"] != name
            && p["targetPort"].as_u64() != Some(port))));

    // Open to the group's own pods, in this namespace, and to no one else.
    let open = rules_opening(&objects, labels, port);
    assert!(!open.is_empty(), "no policy opens UDP {port}");
    for (np, rule) in &open {
        let from = rule["from"]
            .as_array()
            .unwrap_or_else(|| panic!("{} opens UDP {port} to anyone", np["metadata"]["name"]));
        assert!(
            !from.is_empty(),
            "{} opens UDP {port} to anyone",
            np["metadata"]["name"]
        );
        for peer in from {
            assert!(
                peer["namespaceSelector"].is_null() && peer["ipBlock"].is_null(),
                "{}: {peer}",
                np["metadata"]["name"]
            );
            assert_eq!(peer["podSelector"]["matchLabels"], *labels, "{peer}");
        }
        assert_eq!(np["metadata"]["namespace"], NS);
    }

    // Every replica's daemon runs the exchange.
    let group = SecretKey([77; 32]);
    for ordinal in 0..2 {
        let replica = Replica {
            group: "tgp".into(),
            ordinal,
            pools: vec!["100.64.1.0/24".parse().expect("pool")],
            identity: Identity::Shared,
            endpoint: None,
        };
        let out = render_group(
            &replica,
            &[],
            &base,
            &with_group_key(&BTreeMap::new(), &group),
            || panic!("a replica generated its own key"),
        )
        .unwrap_or_else(|e| panic!("replica {ordinal}: {e}"));
        let text = String::from_utf8(out.rendered.data["tunnelgate.toml"].clone()).expect("utf-8");
        let files = MapFiles(BTreeMap::from([(
            "/etc/tunnelgate/private.key".to_string(),
            group.expose_base64(),
        )]));
        let config = Config::parse(&text, Path::new("/etc/tunnelgate"), &files).expect("valid");
        let exchange = config.takeover.group.expect("the group exchange");
        assert_eq!(exchange.listen, listen);
        assert_eq!(
            config.takeover.answer,
            tunnelgate::core::takeover::Answer::KnownEndpoints
        );
    }

    // And the endpoints file outlives a restart of the proxy container.
    super::state::assert_endpoints_kept_across_a_container_restart("group-shared", pod, &base);
}

/// The UDP balancers in front of the proxies (the single proxy's and the shared identity's)
/// keep the peer's own address (`externalTrafficPolicy: Local`). With `Cluster`, kube-proxy
/// SNATs every peer to a node's address and a port the node picks: the replicas would learn
/// and tell each other `node:port` endpoints, where a takeover goes nowhere (another node's
/// port, or a flow gone with the old replica) or, once the node has given that port to
/// another client's flow, hands that client a fresh initiation it can use to pull the peer's
/// endpoint to itself.
#[test]
fn wireguard_balancers_keep_the_peers_own_address() {
    let Some(shared) = built_or_skip() else {
        return;
    };
    let mut checked = Vec::new();
    for (what, objects) in [("containers/k8s", objects()), ("group-shared", shared)] {
        for svc in objects.iter().filter(|o| {
            o["kind"] == "Service"
                && (o["spec"]["type"] == "LoadBalancer" || o["spec"]["type"] == "NodePort")
                && o["spec"]["ports"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().any(|p| p["protocol"] == "UDP"))
        }) {
            assert_eq!(
                svc["spec"]["externalTrafficPolicy"], "Local",
                "{what}: {} must keep the peer's own address: with Cluster the replicas learn \
                 node:port endpoints, and a takeover sent to one can reach another client",
                svc["metadata"]["name"]
            );
            checked.push(format!(
                "{what}: {}",
                svc["metadata"]["name"].as_str().unwrap_or_default()
            ));
        }
    }
    assert_eq!(
        checked,
        [
            "containers/k8s: tunnelgate-proxy-wireguard",
            "group-shared: tgp-wireguard"
        ]
    );
}
