//! `kubectl kustomize` builds every object the README applies, and the resource requests and limits.

use super::*;

/// `(kind, namespace, name)` of each object.
pub(crate) fn ids(objects: &[Value]) -> Vec<(String, String, String)> {
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
/// kubectl the test skips ([`common::skip`]: a failure under `CI=true`).
#[test]
fn kustomize_builds_every_object_the_readme_applies() {
    if !kubectl_or_skip() {
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
pub(crate) fn millicores(q: &Value) -> Option<u64> {
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
pub(crate) fn bytes(q: &Value) -> Option<u64> {
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
