//! Checks the example Kubernetes manifests in containers/k8s: every document parses; the Role
//! grants only what the sidecar needs (the one Secret by name); the proxy container has NET_ADMIN,
//! the Secret read-only with mode 0400 and probes on the health port the base config listens on;
//! the sidecar has no extra privileges and holds the only API token; and the base config in the
//! ConfigMap renders, with the example Service, into a configuration the daemon accepts.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tunnelgate::config::{Config, SecretFiles, SecretKey};
use tunnelgate::sidecar::{api::service_info, render};

const NS: &str = "tunnelgate";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("containers/k8s")
}

/// Every document of every manifest, with the file it came from.
fn documents() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
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

#[test]
fn proxy_has_net_admin_the_secret_read_only_and_probes_on_the_health_port() {
    let proxy = container("proxy");
    assert!(
        strs(&proxy["securityContext"]["capabilities"]["add"]).contains("NET_ADMIN"),
        "{proxy}"
    );
    assert_ne!(proxy["securityContext"]["privileged"], true);
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
