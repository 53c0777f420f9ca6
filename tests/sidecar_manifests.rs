//! Checks the example Kubernetes manifests in containers/k8s (one Service) and
//! containers/k8s/group (a proxy group of 2 replicas): every document parses and is valid against
//! the Kubernetes 1.33 OpenAPI schemas (`kubernetes-validate --strict`); the Role grants only what
//! the sidecar needs (the one Secret by name; for the group, each replica's Secret by name and
//! Services cluster-wide); the proxy container has NET_ADMIN, the Secret read-only with mode 0400
//! and probes on the health port the base config listens on; images are not pulled when present;
//! the sidecar has no extra privileges and holds the only API token; the group has a PDB,
//! anti-affinity over nodes, a UDP LoadBalancer per replica and a NetworkPolicy keeping the health
//! port to the nodes and the monitoring namespace; and the base config in the ConfigMap renders,
//! with the example Services, into a configuration the daemon accepts (for each replica);
//! `kubectl kustomize` of each example (what `apply -k` sends) holds exactly the files' objects.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use tunnelgate::config::{Config, SecretFiles, SecretKey};
use tunnelgate::sidecar::{api::service_info, render};

const NS: &str = "tunnelgate";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("containers/k8s")
}

fn group_dir() -> PathBuf {
    dir().join("group")
}

/// Every document of every manifest, with the file it came from.
fn documents() -> Vec<(String, Value)> {
    documents_in(&dir())
}

fn documents_in(dir: &Path) -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("containers/k8s")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read");
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let parsed: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{name} does not parse: {e}"));
        for v in parsed.into_iter().filter(|v| !v.is_null()) {
            docs.push((name.clone(), v));
        }
    }
    docs
}

fn objects() -> Vec<Value> {
    documents()
        .into_iter()
        .filter(|(f, _)| f != "kustomization.yaml")
        .map(|(_, v)| v)
        .collect()
}

fn find(kind: &str, name: &str) -> Value {
    objects()
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn strs(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn pod() -> Value {
    find("StatefulSet", "tunnelgate-proxy")["spec"]["template"]["spec"].clone()
}

fn container(name: &str) -> Value {
    pod()["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn env(c: &Value, name: &str) -> String {
    c["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == name))
        .and_then(|v| v["value"].as_str())
        .unwrap_or_else(|| panic!("no env {name}"))
        .to_string()
}

fn volume(name: &str) -> Value {
    pod()["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn mount<'a>(c: &'a Value, volume: &str) -> Option<&'a Value> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == volume)
}

/// The base config text from the ConfigMap the sidecar reads.
fn base_config() -> String {
    let sidecar = container("sidecar");
    let path = env(&sidecar, "TUNNELGATE_BASE_CONFIG");
    let cm_volume = pod()["volumes"]
        .as_array()
        .and_then(|vs| {
            vs.iter()
                .find(|v| {
                    v["configMap"].is_object()
                        && mount(&sidecar, v["name"].as_str().unwrap_or_default()).is_some_and(
                            |m| path.starts_with(m["mountPath"].as_str().unwrap_or("-")),
                        )
                })
                .cloned()
        })
        .expect("the base config path is in a ConfigMap mount of the sidecar");
    let mount_path = mount(&sidecar, cm_volume["name"].as_str().unwrap_or_default())
        .and_then(|m| m["mountPath"].as_str())
        .expect("mount path")
        .to_string();
    let key = path
        .strip_prefix(&format!("{mount_path}/"))
        .expect("file in mount");
    let cm = find(
        "ConfigMap",
        cm_volume["configMap"]["name"].as_str().expect("name"),
    );
    cm["data"][key]
        .as_str()
        .expect("base config key")
        .to_string()
}

#[test]
fn every_document_parses_and_names_its_object() {
    let docs = documents();
    for (file, doc) in &docs {
        assert!(doc["apiVersion"].is_string(), "{file}: no apiVersion");
        assert!(doc["kind"].is_string(), "{file}: no kind");
        if file != "kustomization.yaml" {
            assert!(doc["metadata"]["name"].is_string(), "{file}: no name");
            if doc["kind"] != "Namespace" {
                assert_eq!(doc["metadata"]["namespace"], NS, "{file}: {}", doc["kind"]);
            }
        }
    }
    let kinds: BTreeSet<String> = objects()
        .iter()
        .filter_map(|o| o["kind"].as_str().map(str::to_string))
        .collect();
    for k in [
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Secret",
        "ConfigMap",
        "StatefulSet",
        "Service",
    ] {
        assert!(kinds.contains(k), "no {k} in the manifests");
    }
    // The kustomization names every manifest file.
    let kust = docs
        .iter()
        .find(|(f, _)| f == "kustomization.yaml")
        .map(|(_, v)| strs(&v["resources"]))
        .expect("kustomization");
    let files: BTreeSet<String> = docs
        .iter()
        .map(|(f, _)| f.clone())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    assert_eq!(kust, files);
}

#[test]
fn role_grants_only_the_one_secret_and_the_service() {
    let secret_name = volume("config")["secret"]["secretName"]
        .as_str()
        .expect("secret volume")
        .to_string();
    let sidecar = container("sidecar");
    assert_eq!(env(&sidecar, "TUNNELGATE_SECRET"), secret_name);
    find("Secret", &secret_name);

    let role = find("Role", "tunnelgate-proxy");
    let rules = role["rules"].as_array().expect("rules");
    let mut seen = BTreeSet::new();
    for rule in rules {
        assert_eq!(strs(&rule["apiGroups"]), BTreeSet::from([String::new()]));
        let resources = strs(&rule["resources"]);
        let verbs = strs(&rule["verbs"]);
        assert!(
            !verbs.contains("*") && !resources.contains("*"),
            "wildcard: {rule}"
        );
        assert_eq!(resources.len(), 1, "one resource per rule: {rule}");
        let resource = resources.iter().next().cloned().unwrap_or_default();
        let names = strs(&rule["resourceNames"]);
        match resource.as_str() {
            "secrets" => {
                assert_eq!(names, BTreeSet::from([secret_name.clone()]));
                assert_eq!(verbs, BTreeSet::from(["get".into(), "patch".into()]));
            }
            "services" => {
                for v in &verbs {
                    assert!(["get", "list", "watch"].contains(&v.as_str()), "{v}");
                }
                assert!(verbs.contains("get") && verbs.contains("watch"));
                if !names.is_empty() {
                    assert_eq!(names, BTreeSet::from([env(&sidecar, "TUNNELGATE_SERVICE")]));
                }
            }
            "events" => assert_eq!(verbs, BTreeSet::from(["create".into()])),
            other => panic!("the Role grants {other}"),
        }
        seen.insert(resource);
    }
    assert_eq!(seen.len(), 3, "secrets, services and events");

    let binding = find("RoleBinding", "tunnelgate-proxy");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], "tunnelgate-proxy");
    let sa = pod()["serviceAccountName"].clone();
    assert!(binding["subjects"]
        .as_array()
        .expect("subjects")
        .iter()
        .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == NS));
    find("ServiceAccount", sa.as_str().expect("service account"));
}

/// Issue 15: the proxy container drops every capability but the two the daemon may keep
/// (it drops further itself), cannot gain privileges and runs under the runtime's seccomp
/// profile.
fn assert_least_privilege(proxy: &Value) {
    let sc = &proxy["securityContext"];
    let set =
        |names: &[&str]| -> BTreeSet<String> { names.iter().map(|s| s.to_string()).collect() };
    assert_eq!(strs(&sc["capabilities"]["drop"]), set(&["ALL"]), "{sc}");
    let add = strs(&sc["capabilities"]["add"]);
    assert_eq!(add, set(&["NET_ADMIN", "NET_RAW"]), "{sc}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc}");
    assert_ne!(sc["privileged"], true, "{sc}");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{sc}");
}

/// The one privileged container in either StatefulSet is the init container that turns
/// forwarding on (`/proc/sys` is read-only otherwise): it runs before the daemon, writes the two
/// forwarding sysctls and nothing else, and gets no service-account token.
fn assert_only_the_sysctl_init_container_is_privileged(pod: &Value) {
    let init = pod["initContainers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let containers = pod["containers"].as_array().cloned().unwrap_or_default();
    for c in &containers {
        assert_ne!(c["securityContext"]["privileged"], true, "{}", c["name"]);
    }
    let privileged: Vec<&Value> = init
        .iter()
        .filter(|c| c["securityContext"]["privileged"] == true)
        .collect();
    assert_eq!(
        privileged.len(),
        1,
        "one privileged init container: {init:?}"
    );
    let sysctls = privileged[0];
    assert_eq!(sysctls["name"], "sysctls");
    let script = sysctls["command"]
        .as_array()
        .and_then(|c| c.last())
        .and_then(Value::as_str)
        .unwrap_or_default();
    let writes: BTreeSet<&str> = script.split("&&").map(str::trim).collect();
    assert_eq!(
        writes,
        BTreeSet::from([
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
            "echo 1 > /proc/sys/net/ipv6/conf/all/forwarding",
        ]),
        "the init container does only the forwarding sysctls: {script}"
    );
    assert!(sysctls["volumeMounts"].is_null(), "no volumes: {sysctls}");
    assert!(sysctls["env"].is_null(), "no environment: {sysctls}");
    assert_eq!(
        pod["automountServiceAccountToken"], false,
        "no token by default"
    );
}

#[test]
fn only_the_forwarding_init_container_is_privileged() {
    assert_only_the_sysctl_init_container_is_privileged(&pod());
    assert_only_the_sysctl_init_container_is_privileged(&group_pod());
}

#[test]
fn proxy_has_net_admin_the_secret_read_only_and_probes_on_the_health_port() {
    let proxy = container("proxy");
    assert_least_privilege(&proxy);
    let config = volume("config");
    assert_eq!(config["secret"]["defaultMode"], 0o400, "defaultMode 0400");
    let m = mount(&proxy, "config").expect("config mount");
    assert_eq!(m["mountPath"], "/etc/tunnelgate");
    assert_eq!(m["readOnly"], true);
    assert!(
        mount(&proxy, "dev-net-tun").is_some(),
        "the TUN device is mounted"
    );

    // The health port: the container port the probes name, and the one the config listens on.
    let base = base_config();
    let listen = base
        .lines()
        .find_map(|l| l.trim().strip_prefix("listen = "))
        .expect("[health] listen in the base config")
        .trim_matches('"')
        .to_string();
    let listen: std::net::SocketAddr = listen.parse().expect("listen address");
    assert!(
        listen.ip().is_unspecified(),
        "the kubelet probes the pod IP: {listen}"
    );
    let health_port = proxy["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "health"))
        .and_then(|p| p["containerPort"].as_u64())
        .expect("health port");
    assert_eq!(health_port, u64::from(listen.port()));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &proxy[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert!(
            get["port"] == "health" || get["port"].as_u64() == Some(health_port),
            "{probe} port {}",
            get["port"]
        );
    }
}

#[test]
fn sidecar_has_no_extra_privileges_and_the_only_token() {
    let sidecar = container("sidecar");
    let sc = &sidecar["securityContext"];
    assert_ne!(sc["privileged"], true);
    assert!(sc["capabilities"]["add"].is_null(), "{sc}");
    assert!(strs(&sc["capabilities"]["drop"]).contains("ALL"));
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["runAsNonRoot"], true);
    assert!(
        mount(&sidecar, "config").is_none(),
        "it writes through the API"
    );
    // Only the sidecar gets API credentials.
    assert_eq!(pod()["automountServiceAccountToken"], false);
    let token = volume("kube-api-access");
    assert!(token["projected"]["sources"]
        .as_array()
        .expect("sources")
        .iter()
        .any(|s| s["serviceAccountToken"].is_object()));
    assert!(mount(&sidecar, "kube-api-access").is_some());
    assert!(mount(&container("proxy"), "kube-api-access").is_none());
}

struct MapFiles(BTreeMap<String, String>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| "no such file".into())
    }
}

#[test]
fn base_config_and_example_service_render_a_valid_config() {
    let name = env(&container("sidecar"), "TUNNELGATE_SERVICE");
    let mut svc = find("Service", &name);
    assert_eq!(
        svc["metadata"]["annotations"]["tunnelgate.dev/expose"],
        "true"
    );
    // What the API server adds.
    svc["spec"]["clusterIP"] = "10.96.0.10".into();
    svc["spec"]["clusterIPs"] = serde_json::json!(["10.96.0.10"]);
    let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(svc).expect("Service");
    let key = SecretKey([5; 32]);
    let r = render(
        &service_info(&svc),
        &base_config(),
        &BTreeMap::new(),
        || key.clone(),
    )
    .expect("renders");
    let text = String::from_utf8(r.data["tunnelgate.toml"].clone()).expect("utf-8");
    let files = MapFiles(BTreeMap::from([(
        "/etc/tunnelgate/private.key".to_string(),
        key.expose_base64(),
    )]));
    let c = Config::parse(&text, Path::new("/etc/tunnelgate"), &files).expect("valid");
    assert_eq!(c.ingress.len(), 1);
    assert_eq!(c.ingress[0].ports[0].to_string(), "80/tcp");
}

// ------------------------------------------------------------------------------------------------
// Schemas
// ------------------------------------------------------------------------------------------------

/// `kubernetes-validate --strict -k 1.33.0` on every manifest (but the kustomizations): each
/// object is valid against the real OpenAPI schemas. Without the tool (`pip install
/// kubernetes-validate`) the test is skipped with a note, except in CI, where it fails.
#[test]
fn every_manifest_is_valid_against_the_kubernetes_schemas() {
    if Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "kubernetes-validate is not installed: pip install kubernetes-validate"
        );
        eprintln!(
            "SKIPPED: kubernetes-validate is not installed (pip install kubernetes-validate)"
        );
        return;
    }
    let mut checked = 0;
    for d in [dir(), group_dir()] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&d)
            .expect("manifest dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .filter(|p| !p.ends_with("kustomization.yaml"))
            .collect();
        files.sort();
        for f in files {
            let out = Command::new("kubernetes-validate")
                .args(["--strict", "-k", "1.33.0"])
                .arg(&f)
                .output()
                .expect("run kubernetes-validate");
            assert!(
                out.status.success(),
                "{} is not valid:\n{}{}",
                f.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 11, "{checked} files");
}

#[test]
fn images_are_not_pulled_when_present() {
    for docs in [documents(), documents_in(&group_dir())] {
        for (file, doc) in docs {
            let spec = &doc["spec"]["template"]["spec"];
            for c in ["initContainers", "containers"]
                .iter()
                .filter_map(|k| spec[*k].as_array())
                .flatten()
                // The locally built (`kind load`) image; public ones may be pulled.
                .filter(|c| {
                    c["image"]
                        .as_str()
                        .is_some_and(|i| i.starts_with("tunnelgate:"))
                })
            {
                assert_eq!(
                    c["imagePullPolicy"], "IfNotPresent",
                    "{file}: container {}",
                    c["name"]
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The proxy group (containers/k8s/group)
// ------------------------------------------------------------------------------------------------

const GROUP_NS: &str = "tunnelgate";

fn group_objects() -> Vec<Value> {
    documents_in(&group_dir())
        .into_iter()
        .filter(|(f, _)| f != "kustomization.yaml")
        .map(|(_, v)| v)
        .collect()
}

fn group_find(kind: &str, ns: Option<&str>, name: &str) -> Value {
    group_objects()
        .into_iter()
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && ns.is_none_or(|ns| o["metadata"]["namespace"] == ns)
        })
        .unwrap_or_else(|| panic!("no {kind} {ns:?}/{name} in containers/k8s/group"))
}

fn group_set() -> Value {
    group_find("StatefulSet", Some(GROUP_NS), "tgp")
}

fn group_pod() -> Value {
    group_set()["spec"]["template"]["spec"].clone()
}

fn group_container(name: &str) -> Value {
    group_pod()["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// tgp-0, tgp-1, ...: the pods (and Secrets) of the StatefulSet.
fn replica_names() -> Vec<String> {
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
    let kust = docs
        .iter()
        .find(|(f, _)| f == "kustomization.yaml")
        .map(|(_, v)| strs(&v["resources"]))
        .expect("kustomization");
    let files: BTreeSet<String> = docs
        .iter()
        .map(|(f, _)| f.clone())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    assert_eq!(kust, files);
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
fn all_strings(v: &Value, out: &mut Vec<String>) {
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

/// `(kind, namespace, name)` of each object.
fn ids(objects: &[Value]) -> Vec<(String, String, String)> {
    objects
        .iter()
        .map(|o| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (
                s(&o["kind"]),
                s(&o["metadata"]["namespace"]),
                s(&o["metadata"]["name"]),
            )
        })
        .collect()
}

/// `kubectl kustomize` (offline) of both examples: what `kubectl apply -k` sends. Every object of
/// the files is in it unchanged, nothing else, and the objects the README names exist. Without
/// kubectl the test is skipped with a note, except in CI, where it fails.
#[test]
fn kustomize_builds_every_object_the_readme_applies() {
    if !Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "kubectl is not installed"
        );
        eprintln!("SKIPPED: kubectl is not installed");
        return;
    }
    let readme = std::fs::read_to_string(dir().join("../README.md")).expect("README");
    for (d, named) in [
        (
            dir(),
            &[
                ("StatefulSet", "tunnelgate-proxy"),
                ("Secret", "tunnelgate-proxy"),
                ("Service", "tunnelgate-proxy-wireguard"),
                ("Service", "web"),
            ][..],
        ),
        (
            group_dir(),
            &[
                ("StatefulSet", "tgp"),
                ("ConfigMap", "tgp-base"),
                ("Service", "web"),
            ][..],
        ),
    ] {
        // Run from the repository root, as the README does.
        let rel = d
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .expect("in the repository")
            .display()
            .to_string();
        assert!(
            readme.contains(&format!("kubectl apply -k {rel}\n")),
            "{rel}"
        );
        let out = Command::new("kubectl")
            .args(["kustomize", &rel])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("KUBECONFIG", "/dev/null")
            .output()
            .expect("kubectl kustomize");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let built: Vec<Value> =
            serde_saphyr::from_multiple(&String::from_utf8(out.stdout).expect("utf-8"))
                .expect("kustomize output parses");
        let files: Vec<Value> = documents_in(&d)
            .into_iter()
            .filter(|(f, _)| f != "kustomization.yaml")
            .map(|(_, v)| v)
            .collect();
        let (mut a, mut b) = (ids(&built), ids(&files));
        a.sort();
        b.sort();
        assert_eq!(a, b, "{rel}: kustomize builds exactly the files' objects");
        for o in &built {
            let id = &ids(std::slice::from_ref(o))[0];
            let same: Vec<&Value> = files
                .iter()
                .filter(|f| &ids(std::slice::from_ref(*f))[0] == id)
                .collect();
            assert!(same.contains(&o), "{rel}: {id:?} changed by kustomize");
        }
        for (kind, name) in named {
            assert!(
                a.iter().any(|(k, _, n)| k == kind && n == name),
                "{rel}: no {kind} {name}"
            );
        }
    }
}

/// A quantity of CPU (`"2"`, `250m`) in millicores.
fn millicores(q: &Value) -> Option<u64> {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    match text.strip_suffix('m') {
        Some(m) => m.parse().ok(),
        None => text.parse::<u64>().ok().map(|cpus| cpus * 1000),
    }
}

/// A quantity of memory (`64Mi`) in bytes.
fn bytes(q: &Value) -> Option<u64> {
    let text = q.as_str()?;
    let (n, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit())?);
    let unit = match unit {
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return None,
    };
    n.parse::<u64>().ok().map(|n| n * unit)
}

/// The proxy's packet workers follow its CPU limit (`interface.workers` unset): both pods
/// request CPU and limit it to a whole number of CPUs, so a replica runs as many workers as it
/// may use and never one per core of a large node; the sidecar keeps the 64 MiB its tests at
/// 20,000 Services measure against.
#[test]
fn proxy_cpu_is_requested_and_limited_to_whole_cpus_and_the_sidecar_to_64_mib() {
    for (what, proxy, sidecar) in [
        ("single", container("proxy"), container("sidecar")),
        (
            "group",
            group_container("proxy"),
            group_container("sidecar"),
        ),
    ] {
        let r = &proxy["resources"];
        let request = millicores(&r["requests"]["cpu"]).expect("proxy CPU request");
        let limit = millicores(&r["limits"]["cpu"]).expect("proxy CPU limit");
        assert!(
            request > 0 && request <= limit,
            "{what}: proxy CPU request {request}m, limit {limit}m"
        );
        assert_eq!(
            limit % 1000,
            0,
            "{what}: a proxy CPU limit of {limit}m gives {} workers: expected whole CPUs",
            limit / 1000
        );
        assert_eq!(
            bytes(&sidecar["resources"]["limits"]["memory"]),
            Some(64 << 20),
            "{what}: sidecar memory limit"
        );
    }
    let base = base_config();
    assert!(
        !base.contains("workers"),
        "the example base config leaves workers to the CPU limit"
    );
}
