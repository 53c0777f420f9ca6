//! The kubectl commands of containers/README.md: the list of them, the shell that runs them against the fake, and its helpers.

use super::*;

/// How each `kubectl` command that containers/README.md shows is checked. A command the README
/// gains must be added here (`readme_kubectl_commands_are_all_accounted_for`).
pub(crate) const README_KUBECTL: &[(&str, &str)] = &[
    (
        "kubectl apply -k containers/k8s",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl apply -k containers/k8s/group",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl apply -k containers/k8s/group-shared",
        "not run against the fake: sidecar_manifests' group_shared_* build it with kubectl kustomize and validate it; group_identity.rs runs its sidecars' settings",
    ),
    (
        "kubectl -n tunnelgate get secret tgp-identity -o jsonpath='{.data.public_key}' | base64 -d; echo",
        "not run: group_identity.rs checks the public_key the sidecars write to tgp-identity",
    ),
    (
        "kubectl -n tunnelgate create secret generic tgp-identity --from-file=private.key=tgp.key --from-literal=public_key=\"$(wg pubkey < tgp.key)\" --dry-run=client -o yaml | kubectl apply -f -",
        "run against the fake: readme_shared_identity_rotation_command",
    ),
    (
        "kubectl -n tunnelgate exec tgp-0 -c proxy -- tunnelgate check | sed -n '/^# client side/,$p'",
        "not run: needs a kubelet; group_identity.rs's group_shared_identity_prints_the_balancers_address_as_the_peers_endpoint renders the same section from each replica's config",
    ),
    (
        "kubectl -n tunnelgate get service tgp-wireguard -o jsonpath='{.status.loadBalancer.ingress[0].ip}'",
        "not run: needs a load balancer controller (the same read of tunnelgate-proxy-wireguard runs in readme_single_service_commands)",
    ),
    (
        "kubectl -n tunnelgate rollout status statefulset/tunnelgate-proxy",
        "not run: needs a StatefulSet controller and a kubelet",
    ),
    (
        "kubectl -n tunnelgate rollout status statefulset/tgp",
        "not run: needs a StatefulSet controller and a kubelet",
    ),
    (
        "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}' | base64 -d",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.device_ips}' | base64 -d",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get service tunnelgate-proxy-wireguard -o jsonpath='{.status.loadBalancer.ingress[0].ip}'",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate logs tunnelgate-proxy-0 -c sidecar",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate exec tunnelgate-proxy-0 -c proxy -- tunnelgate status",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate exec tunnelgate-proxy-0 -c proxy -- wg show tg0",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate describe service web",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate patch secret tunnelgate-proxy --type=json -p '[{\"op\":\"remove\",\"path\":\"/data/private.key\"}]'",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tgp-$i -o jsonpath='{.data.public_key}' | base64 -d; echo",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tgp-$i -o jsonpath='{.data.device_ips}' | base64 -d; echo",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate scale statefulset/tgp --replicas=3",
        "not run: the fake has no StatefulSet controller; group_scales_2_3_1_2_from_unchanged_manifests starts and stops the pods it would",
    ),
    (
        "kubectl -n apps describe service web2",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate exec tgp-0 -c proxy -- tunnelgate status",
        "not run: needs a kubelet; tests/netns_takeover.rs reads the same counters from a replica's tunnelgate status --json (the_group_exchange_refuses_and_counts_what_a_third_namespace_forges_or_replays)",
    ),
    (
        "kubectl -n tunnelgate rollout restart statefulset/tgp",
        "not run: needs a StatefulSet controller and a kubelet",
    ),
];

pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn readme() -> String {
    std::fs::read_to_string(repo().join("containers/README.md")).expect("containers/README.md")
}

/// The fenced blocks of containers/README.md in `lang`, as shown (indentation removed).
pub(crate) fn readme_blocks(lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in readme().lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        match &mut current {
            None if t == format!("```{lang}") => current = Some((indent, String::new())),
            Some(_) if t == "```" => blocks.push(current.take().expect("block").1),
            Some((ind, text)) => {
                text.push_str(line.get(*ind..).unwrap_or(t));
                text.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// A `sh` line of the README starting with `start`, as shown (its comment removed).
/// A line equal to `start` wins over longer ones.
pub(crate) fn readme_line(start: &str) -> String {
    let mut found: Vec<String> = readme_blocks("sh")
        .iter()
        .flat_map(|b| b.lines().map(without_comment).collect::<Vec<_>>())
        .filter(|l| l.starts_with(start))
        .collect();
    if found.iter().any(|l| l == start) {
        found.retain(|l| l == start);
    }
    assert_eq!(
        found.len(),
        1,
        "README lines starting with {start:?}: {found:?}"
    );
    found.remove(0)
}

/// A `sh` line without its indentation and a comment after the command (`cmd     # what it
/// shows`).
pub(crate) fn without_comment(line: &str) -> String {
    let line = line.trim();
    match line.find("  #") {
        Some(i) => line[..i].trim_end().to_string(),
        None => line.to_string(),
    }
}

/// Every `kubectl` command in the README's `sh` blocks (inside the `for` loop too).
pub(crate) fn readme_kubectl_lines() -> Vec<String> {
    readme_blocks("sh")
        .iter()
        .flat_map(|b| b.lines().map(str::to_string).collect::<Vec<_>>())
        .map(|l| without_comment(&l))
        .filter(|l| l.starts_with("kubectl "))
        .collect()
}

#[test]
fn readme_kubectl_commands_are_all_accounted_for() {
    let shown: BTreeSet<String> = readme_kubectl_lines().into_iter().collect();
    let known: BTreeSet<String> = README_KUBECTL.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(
        shown.difference(&known).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "kubectl commands in containers/README.md that no test accounts for"
    );
    assert_eq!(
        known.difference(&shown).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "commands accounted for that containers/README.md no longer shows"
    );
    // Each one the README's "What was checked here" names as run is run by the test named (in
    // any file of this test binary that holds tests).
    let this = [
        include_str!("single_service.rs"),
        include_str!("group.rs"),
        include_str!("group_scale.rs"),
        include_str!("group_kubectl_scale.rs"),
        include_str!("readme.rs"),
        include_str!("readme_commands.rs"),
        include_str!("pod_image.rs"),
    ]
    .concat();
    for (cmd, how) in README_KUBECTL {
        if let Some(test) = how.strip_prefix("run against the fake: ") {
            assert!(
                this.contains(&format!("async fn {test}()")),
                "{cmd}: no test {test}"
            );
        }
    }
}

/// Runs README commands with `sh` in a copy of the repository's `containers/` (so `apply -k
/// containers/k8s` works as shown), with the fake's kubeconfig, a `HOME` of its own and nothing
/// else of the environment: a real cluster's config is never read. `kubectl` on the PATH is a
/// wrapper adding `--request-timeout`.
pub(crate) struct Shell {
    pub(crate) root: PathBuf,
    pub(crate) env: Vec<(String, String)>,
}

impl Shell {
    pub(crate) fn new(inputs: &Inputs) -> Shell {
        let root = inputs.dir.join("repo");
        let bin = inputs.dir.join("bin");
        let home = inputs.dir.join("home");
        for d in [&bin, &home] {
            std::fs::create_dir_all(d).expect("dir");
        }
        copy_dir(&repo().join("containers"), &root.join("containers"));
        let kubectl = String::from_utf8(
            Command::new("sh")
                .args(["-c", "command -v kubectl"])
                .output()
                .expect("sh")
                .stdout,
        )
        .expect("path");
        let wrapper = bin.join("kubectl");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nexec {} --request-timeout=10s \"$@\"\n",
                kubectl.trim()
            ),
        )
        .expect("wrapper");
        let mut perms = std::fs::metadata(&wrapper).expect("meta").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&wrapper, perms).expect("chmod");
        let env = vec![
            (
                "PATH".into(),
                format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display()),
            ),
            ("HOME".into(), home.display().to_string()),
            (
                "KUBECONFIG".into(),
                inputs.dir.join("kubeconfig").display().to_string(),
            ),
        ];
        Shell { root, env }
    }

    /// Replaces `from` by `to` in a file of the copy, as a user editing it would.
    pub(crate) fn edit(&self, file: &str, from: &str, to: &str) {
        let path = self.root.join(file);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains(from), "{file} has no {from:?}");
        std::fs::write(&path, text.replace(from, to)).expect("write");
    }

    /// `sh -c script`: its stdout; panics with stderr when it fails.
    pub(crate) async fn run(&self, script: &str) -> String {
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new("sh")
                .args(["-c", script])
                .current_dir(&self.root)
                .env_clear()
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("timed out: {script}"))
        .expect("run sh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{script}\nfailed: {stderr}");
        String::from_utf8(out.stdout).expect("utf-8 output")
    }
}

pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        let target = to.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).expect("copy");
        }
    }
}

/// The placeholder of the base configs' peer key, which the README says to replace.
pub(crate) const PLACEHOLDER_KEY: &str = "REPLACE+ME+WITH+THE+PEERS+PUBLIC+KEY+000000=";

impl Fake {
    pub(crate) fn object(&self, coll: &str, ns: &str, name: &str) -> Value {
        self.lock()
            .objects
            .get(&(coll.to_string(), ns.to_string(), name.to_string()))
            .cloned()
            .unwrap_or_else(|| panic!("no {coll} {ns}/{name} in the fake"))
    }

    /// What a cloud controller does for a LoadBalancer Service.
    pub(crate) fn give_load_balancer_ip(&self, ns: &str, name: &str, ip: &str) {
        self.change(
            ns,
            name,
            |s| s["status"] = json!({"loadBalancer": {"ingress": [{"ip": ip}]}}),
            false,
        );
    }
}

/// Starts the sidecar of pod `pod` as the applied StatefulSet `set` runs it: its env (with the
/// downward API's pod name and namespace) and, at its base-config path, the applied ConfigMap's
/// `base.toml` (what the kubelet mounts).
pub(crate) fn sidecar_of(
    fake: &Fake,
    inputs: &Inputs,
    set: &str,
    configmap: &str,
    pod: &str,
) -> Sidecar {
    let set = fake.object("apis/apps/v1/statefulsets", "tunnelgate", set);
    let cm = fake.object("api/v1/configmaps", "tunnelgate", configmap);
    let base = cm["data"]["base.toml"].as_str().expect("base.toml");
    let config_dir = inputs.dir.join(format!("{pod}-volume"));
    sidecar_of_set(&set, base, inputs, pod, &config_dir, pod, &[])
}

/// Starts the sidecar of pod `pod` as StatefulSet `set` runs it, with `base` at its base-config
/// path and `config_dir` (created if missing: a new pod's empty volume) standing in for the
/// volume it shares with the proxy container.
pub(crate) fn sidecar_of_set(
    set: &Value,
    base: &str,
    inputs: &Inputs,
    pod: &str,
    config_dir: &Path,
    tag: &str,
    under: &[&str],
) -> Sidecar {
    let containers = set["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers");
    let sidecar = containers
        .iter()
        .find(|c| c["name"] == "sidecar")
        .expect("container sidecar")
        .clone();
    assert_eq!(sidecar["command"], json!(["tunnelgate-sidecar"]));
    let mut env: Vec<(String, String)> = Vec::new();
    for e in sidecar["env"].as_array().expect("env") {
        let name = e["name"].as_str().expect("name").to_string();
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("metadata.name") => pod.to_string(),
            Some("metadata.namespace") => "tunnelgate".to_string(),
            Some(other) => panic!("fieldRef {other}"),
            None => e["value"].as_str().expect("value").to_string(),
        };
        match name.as_str() {
            // The flag --base-config (a temp file) stands in for the mounted ConfigMap.
            "TUNNELGATE_BASE_CONFIG" => {}
            // A temp dir stands in for the shared volume, which the proxy mounts there too.
            "TUNNELGATE_CONFIG_DIR" => {
                let proxy = containers
                    .iter()
                    .find(|c| c["name"] == "proxy")
                    .expect("container proxy");
                let mounted = proxy["volumeMounts"]
                    .as_array()
                    .expect("proxy mounts")
                    .iter()
                    .any(|m| m["mountPath"] == value.as_str());
                assert!(mounted, "the proxy mounts {value}");
                std::fs::create_dir_all(config_dir).expect("config dir");
                env.push((name, config_dir.display().to_string()));
            }
            _ => env.push((name, value)),
        }
    }
    std::fs::write(inputs.base_path(), base).expect("base config");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sidecar::start_under(under, inputs, tag, &[], &env)
}

pub(crate) async fn wait_secret_written(fake: &Fake, sidecar: &Sidecar, name: &str) {
    wait_for(sidecar, &format!("Secret {name} written"), || {
        fake.secret_of("tunnelgate", name).len() == 4
    })
    .await;
}

pub(crate) fn stored_events(fake: &Fake, ns: &str, name: &str) -> usize {
    fake.lock()
        .objects
        .iter()
        .filter(|((c, n, _), e)| {
            c == "api/v1/events" && n == ns && e["involvedObject"]["name"] == name
        })
        .count()
}

/// The lines of `out` that contain `needle`.
pub(crate) fn lines_with<'a>(out: &'a str, needle: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.contains(needle)).collect()
}
