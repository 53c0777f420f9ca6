//! Reading the manifests: the documents of containers/k8s, their objects, the pod, its containers, env, volumes and mounts.

use super::*;

pub(crate) fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("containers/k8s")
}

pub(crate) fn group_dir() -> PathBuf {
    dir().join("group")
}

/// Every document of every manifest, with the file it came from.
pub(crate) fn documents() -> Vec<(String, Value)> {
    documents_in(&dir())
}

pub(crate) fn documents_in(dir: &Path) -> Vec<(String, Value)> {
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

pub(crate) fn objects() -> Vec<Value> {
    documents()
        .into_iter()
        .filter(|(f, _)| f != "kustomization.yaml")
        .map(|(_, v)| v)
        .collect()
}

pub(crate) fn find(kind: &str, name: &str) -> Value {
    objects()
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

pub(crate) fn strs(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn pod() -> Value {
    find("StatefulSet", "tunnelgate-proxy")["spec"]["template"]["spec"].clone()
}

pub(crate) fn container(name: &str) -> Value {
    pod()["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no container {name}"))
}

pub(crate) fn env(c: &Value, name: &str) -> String {
    c["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == name))
        .and_then(|v| v["value"].as_str())
        .unwrap_or_else(|| panic!("no env {name}"))
        .to_string()
}

pub(crate) fn volume(name: &str) -> Value {
    pod()["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no volume {name}"))
}

pub(crate) fn mount<'a>(c: &'a Value, volume: &str) -> Option<&'a Value> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == volume)
}

/// The base config text from the ConfigMap the sidecar reads.
pub(crate) fn base_config() -> String {
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

/// The `kustomization.yaml` among `docs` lists every other file as a resource, and no more.
pub(crate) fn assert_kustomization_names_every_file(docs: &[(String, Value)]) {
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
