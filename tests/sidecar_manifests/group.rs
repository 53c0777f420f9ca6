//! The proxy group (containers/k8s/group): RBAC, replicas, the shared config volume, spreading, peers, the network policy, the rendered configs.

use super::*;

pub(crate) const GROUP_NS: &str = "tunnelgate";

pub(crate) fn group_objects() -> Vec<Value> {
    documents_in(&group_dir())
        .into_iter()
        .filter(|(f, _)| f != "kustomization.yaml")
        .map(|(_, v)| v)
        .collect()
}

pub(crate) fn group_find(kind: &str, ns: Option<&str>, name: &str) -> Value {
    group_objects()
        .into_iter()
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && ns.is_none_or(|ns| o["metadata"]["namespace"] == ns)
        })
        .unwrap_or_else(|| panic!("no {kind} {ns:?}/{name} in containers/k8s/group"))
}

pub(crate) fn group_set() -> Value {
    group_find("StatefulSet", Some(GROUP_NS), "tgp")
}

pub(crate) fn group_pod() -> Value {
    group_set()["spec"]["template"]["spec"].clone()
}

pub(crate) fn group_container(name: &str) -> Value {
    group_pod()["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// tgp-0, tgp-1, ...: the pods (and Secrets) of the StatefulSet.
pub(crate) fn replica_names() -> Vec<String> {
    let n = group_set()["spec"]["replicas"].as_u64().expect("replicas");
    (0..n).map(|i| format!("tgp-{i}")).collect()
}

#[test]
fn group_documents_parse_and_the_kustomization_names_them() {
    let docs = documents_in(&group_dir());
    for (file, doc) in &docs {
        assert!(doc["apiVersion"].is_string(), "{file}: no apiVersion");
        assert!(doc["kind"].is_string(), "{file}: no kind");
    }
    assert_kustomization_names_every_file(&docs);
    assert_eq!(replica_names(), ["tgp-0", "tgp-1"], "a group of 2 replicas");
}

#[test]
fn group_rbac_is_services_cluster_wide_and_secrets_of_its_own_namespace() {
    let sa = group_pod()["serviceAccountName"]
        .as_str()
        .expect("service account")
        .to_string();
    group_find("ServiceAccount", Some(GROUP_NS), &sa);
    let bound_to_sa = |b: &Value| {
        b["subjects"].as_array().is_some_and(|s| {
            s.iter().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == GROUP_NS
            })
        })
    };
    // Every role bound to the service account, and what it grants.
    let mut cluster_rules = Vec::new();
    let mut ns_rules = Vec::new();
    for b in group_objects().iter().filter(|o| {
        (o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding") && bound_to_sa(o)
    }) {
        let role_kind = b["roleRef"]["kind"].as_str().expect("roleRef kind");
        let role_name = b["roleRef"]["name"].as_str().expect("roleRef name");
        let ns = (role_kind == "Role").then(|| b["metadata"]["namespace"].as_str().unwrap_or(""));
        let role = group_find(role_kind, ns, role_name);
        let rules = role["rules"].as_array().cloned().unwrap_or_default();
        if b["kind"] == "ClusterRoleBinding" {
            cluster_rules.extend(rules);
        } else {
            assert_eq!(b["metadata"]["namespace"], GROUP_NS);
            ns_rules.extend(rules);
        }
    }
    let grants = |rules: &[Value]| -> BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)> {
        rules
            .iter()
            .map(|r| {
                assert_eq!(
                    strs(&r["apiGroups"]),
                    BTreeSet::from([String::new()]),
                    "{r}"
                );
                let res = strs(&r["resources"]);
                assert_eq!(res.len(), 1, "one resource per rule: {r}");
                let verbs = strs(&r["verbs"]);
                assert!(!verbs.contains("*"), "{r}");
                (
                    res.into_iter().next().unwrap_or_default(),
                    (verbs, strs(&r["resourceNames"])),
                )
            })
            .collect()
    };
    let set = |v: &[&str]| {
        v.iter()
            .map(|s| s.to_string())
            .collect::<BTreeSet<String>>()
    };
    // Cluster-wide: read Services (the group spans namespaces) and report on them.
    assert_eq!(
        grants(&cluster_rules),
        BTreeMap::from([
            (
                "services".to_string(),
                (set(&["get", "list", "watch"]), set(&[]))
            ),
            ("events".to_string(), (set(&["create"]), set(&[]))),
        ])
    );
    // In the proxies' namespace only: each sidecar creates, reads, patches and watches its own
    // Secret, whose name (the pod's) no manifest can list ahead of `kubectl scale`; no delete,
    // so a replica scaled away keeps its key for when it returns.
    assert_eq!(
        grants(&ns_rules),
        BTreeMap::from([(
            "secrets".to_string(),
            (set(&["create", "get", "patch", "list", "watch"]), set(&[]))
        )])
    );
    // The trade-off is written where the grant is.
    let rbac = std::fs::read_to_string(group_dir().join("rbac.yaml")).expect("rbac.yaml");
    assert!(rbac.contains("The trade-off:"), "{rbac}");
    // And the manifests create no Secret: the sidecars do.
    assert!(!group_objects().iter().any(|o| o["kind"] == "Secret"));
}

/// Every string of `v` (keys and values), depth first.
pub(crate) fn all_strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| all_strings(x, out)),
        Value::Object(m) => m.iter().for_each(|(k, x)| {
            out.push(k.clone());
            all_strings(x, out)
        }),
        _ => {}
    }
}

/// `kubectl scale statefulset/tgp --replicas=N` is all it takes: no object, name, selector,
/// volume or mount of the manifests names one replica (`tgp-0`, `tgp-1`, ...), so the number of
/// replicas is said once, in the StatefulSet.
#[test]
fn group_manifests_name_no_replica() {
    let replica_name = |s: &str| {
        s.match_indices("tgp-")
            .any(|(i, _)| s[i + 4..].starts_with(|c: char| c.is_ascii_digit()))
    };
    for (file, doc) in documents_in(&group_dir()) {
        let mut strings = Vec::new();
        all_strings(&doc, &mut strings);
        let named: Vec<&String> = strings.iter().filter(|s| replica_name(s)).collect();
        assert!(named.is_empty(), "{file} names a replica: {named:?}");
    }
    // Nor does anything depend on the count: one volume and one mount per pod, whatever it is.
    let pod = group_pod();
    let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
    assert!(
        volumes.iter().all(|v| v["secret"].is_null()),
        "no Secret volume: {volumes:?}"
    );
    assert_eq!(group_set()["spec"]["replicas"], 2);
}

#[test]
fn group_pods_share_one_in_memory_config_volume_and_run_what_the_sidecar_hands_over() {
    let proxy = group_container("proxy");
    let sidecar = group_container("sidecar");
    let config = group_pod()["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == "config").cloned())
        .expect("volume config");
    assert_eq!(config["emptyDir"]["medium"], "Memory", "{config}");
    let proxy_mount = mount(&proxy, "config").expect("proxy mounts config");
    assert_eq!(proxy_mount["readOnly"], true);
    let sidecar_mount = mount(&sidecar, "config").expect("sidecar mounts config");
    assert_ne!(sidecar_mount["readOnly"], true);
    assert_eq!(proxy_mount["mountPath"], "/etc/tunnelgate");
    assert_eq!(env(&sidecar, "TUNNELGATE_CONFIG_DIR"), "/etc/tunnelgate");
    assert_eq!(sidecar_mount["mountPath"], "/etc/tunnelgate");
    // The proxy (root without CAP_DAC_OVERRIDE) reads the sidecar's 0440 files through the
    // sidecar's group.
    let gid = &sidecar["securityContext"]["runAsGroup"];
    assert_eq!(gid, 65532);
    assert!(
        group_pod()["securityContext"]["supplementalGroups"]
            .as_array()
            .is_some_and(|g| g.contains(gid)),
        "the proxy is in the sidecar's group"
    );
    assert_eq!(proxy["securityContext"]["runAsUser"], 0);
    let script = proxy["command"]
        .as_array()
        .and_then(|c| c.last())
        .and_then(Value::as_str)
        .expect("proxy script");
    assert!(
        script.contains("config=/etc/tunnelgate/tunnelgate.toml"),
        "{script}"
    );
    assert!(
        script.contains("exec tunnelgate run --config \"$config\""),
        "{script}"
    );
    for c in [&proxy, &sidecar] {
        let pod_name = c["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == "POD_NAME"))
            .expect("POD_NAME");
        assert_eq!(
            pod_name["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.name"
        );
    }
    assert_eq!(env(&sidecar, "TUNNELGATE_PROXY_GROUP"), "tgp");
    assert!(
        sidecar["env"].as_array().is_some_and(|e| e
            .iter()
            .all(|v| v["name"] != "TUNNELGATE_SECRET" && v["name"] != "TUNNELGATE_SERVICE")),
        "the Secret comes from POD_NAME"
    );
    assert_eq!(group_pod()["automountServiceAccountToken"], false);
    assert!(mount(&sidecar, "kube-api-access").is_some());
    assert!(mount(&proxy, "kube-api-access").is_none());
    assert_least_privilege(&proxy);
    assert_eq!(sidecar["securityContext"]["runAsNonRoot"], true);
    for (probe, path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        assert_eq!(proxy[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(proxy[probe]["httpGet"]["port"], "health", "{probe}");
    }
    let health = proxy["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "health"))
        .expect("health port");
    assert_eq!(health["containerPort"], 9002);
}

#[test]
fn group_spreads_over_nodes_and_keeps_one_replica_through_disruptions() {
    let labels = group_set()["spec"]["template"]["metadata"]["labels"].clone();
    let terms = group_pod()["affinity"]["podAntiAffinity"]
        ["preferredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .cloned()
        .expect("pod anti-affinity");
    assert!(terms.iter().any(|t| {
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            && t["podAffinityTerm"]["labelSelector"]["matchLabels"] == labels
    }));
    let pdb = group_find("PodDisruptionBudget", Some(GROUP_NS), "tgp");
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], labels);
    let replicas = replica_names().len() as u64;
    let keeps = match (
        pdb["spec"]["maxUnavailable"].as_u64(),
        pdb["spec"]["minAvailable"].as_u64(),
    ) {
        (Some(max), None) => replicas - max,
        (None, Some(min)) => min,
        other => panic!("PDB: {other:?}"),
    };
    assert!(
        keeps >= 1 && keeps < replicas,
        "a drain keeps {keeps} of {replicas}"
    );
}

/// No Service per replica: each replica dials the peer (an endpoint and a keepalive in the
/// base config), so a replica that `kubectl scale` adds is reached without a new object.
#[test]
fn group_replicas_dial_their_peer() {
    let cm = group_find("ConfigMap", Some(GROUP_NS), "tgp-base");
    let base: toml::Table = cm["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .parse()
        .expect("TOML");
    let peers = base["peer"].as_array().expect("[[peer]]");
    assert_eq!(peers.len(), 1);
    assert!(peers[0]
        .get("endpoint")
        .and_then(toml::Value::as_str)
        .is_some());
    assert!(peers[0]
        .get("persistent_keepalive")
        .and_then(toml::Value::as_integer)
        .is_some_and(|k| k > 0));
    assert!(!group_objects()
        .iter()
        .any(|o| o["kind"] == "Service" && o["spec"]["type"] == "LoadBalancer"));
}

#[test]
fn group_network_policy_keeps_the_health_port_to_nodes_and_monitoring() {
    let np = group_find("NetworkPolicy", Some(GROUP_NS), "tgp");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        group_set()["spec"]["template"]["metadata"]["labels"]
    );
    assert!(strs(&np["spec"]["policyTypes"]).contains("Ingress"));
    let rules = np["spec"]["ingress"]
        .as_array()
        .cloned()
        .expect("ingress rules");
    let opens = |port: u64, proto: &str| -> Vec<Value> {
        rules
            .iter()
            .filter(|r| {
                r["ports"].as_array().is_some_and(|ps| {
                    ps.iter()
                        .any(|p| p["port"].as_u64() == Some(port) && p["protocol"] == proto)
                })
            })
            .cloned()
            .collect()
    };
    // WireGuard from anywhere.
    assert!(opens(51820, "UDP").iter().any(|r| r["from"].is_null()));
    // Health: never from anywhere; from an ipBlock (nodes) and the monitoring namespace only.
    let health = opens(9002, "TCP");
    assert!(!health.is_empty());
    let mut peers = Vec::new();
    for r in &health {
        let from = r["from"].as_array().cloned().expect("health rule has from");
        peers.extend(from);
    }
    assert!(peers.iter().any(|p| p["ipBlock"]["cidr"].is_string()));
    assert!(peers.iter().any(|p| {
        p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "monitoring"
    }));
    assert!(peers.iter().all(|p| p["ipBlock"].is_object()
        || p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "monitoring"));
    // The egress Service's targetPort is open to its users.
    let db = group_find("Service", Some(GROUP_NS), "db");
    let target = db["spec"]["ports"][0]["targetPort"]
        .as_u64()
        .expect("targetPort");
    assert!(!opens(target, "TCP").is_empty(), "targetPort {target}");
}

#[test]
fn group_base_config_and_examples_render_for_each_replica() {
    use tunnelgate::sidecar::group::{render_group, Replica};
    let sidecar = group_container("sidecar");
    let cm = group_find("ConfigMap", Some(GROUP_NS), "tgp-base");
    assert_eq!(
        env(&sidecar, "TUNNELGATE_BASE_CONFIG"),
        "/etc/tunnelgate-base/base.toml"
    );
    let base = cm["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let pools: Vec<tunnelgate::config::IpNet> = env(&sidecar, "TUNNELGATE_ADDRESS_POOLS")
        .split(',')
        .map(|p| p.parse().expect("pool"))
        .collect();
    // The example Services as the API server returns them.
    let mut services = Vec::new();
    for (i, mut svc) in group_objects()
        .into_iter()
        .filter(|o| o["kind"] == "Service")
        .enumerate()
    {
        if svc["spec"]["type"] != "ExternalName" && svc["spec"]["clusterIP"].is_null() {
            svc["spec"]["clusterIP"] = format!("10.96.0.{}", 10 + i).into();
            svc["spec"]["clusterIPs"] = serde_json::json!([format!("10.96.0.{}", 10 + i)]);
        }
        let svc: k8s_openapi::api::core::v1::Service =
            serde_json::from_value(svc).expect("Service");
        services.push(service_info(&svc));
    }
    let mut keys = BTreeSet::new();
    for (ordinal, name) in replica_names().iter().enumerate() {
        let replica = Replica {
            group: env(&sidecar, "TUNNELGATE_PROXY_GROUP"),
            ordinal: ordinal as u32,
            pools: pools.clone(),
            identity: tunnelgate::sidecar::group::Identity::PerReplica,
            endpoint: None,
        };
        let key = SecretKey([ordinal as u8 + 1; 32]);
        let out = render_group(&replica, &services, &base, &BTreeMap::new(), || key.clone())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.refused.is_empty(), "{:?}", out.refused);
        assert_eq!(out.served, ["apps/web", "tunnelgate/db"]);
        let text = String::from_utf8(out.rendered.data["tunnelgate.toml"].clone()).expect("utf-8");
        let files = MapFiles(BTreeMap::from([(
            "/etc/tunnelgate/private.key".to_string(),
            key.expose_base64(),
        )]));
        let c = Config::parse(&text, Path::new("/etc/tunnelgate"), &files).expect("valid");
        assert_eq!(
            c.interface
                .addresses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            [format!("100.64.1.{}/32", ordinal + 1)]
        );
        assert_eq!(c.ingress.len(), 1);
        assert_eq!(c.ingress[0].ports[0].to_string(), "80/tcp");
        assert_eq!(c.egress.len(), 1);
        assert_eq!(c.egress[0].ports[0].to_string(), "15432:5432/tcp");
        keys.insert(c.interface.private_key.public_key().to_base64());
        // The proxy container declares the egress port the replica listens on.
        assert!(group_container("proxy")["ports"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["containerPort"] == 15432)));
    }
    assert_eq!(keys.len(), 2);
}
