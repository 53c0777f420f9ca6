//! `kubectl scale`: the group's manifests, unchanged, at 2, 3, 1 and 2 replicas.

use super::*;

/// The object of `kind` named `name` in containers/k8s/group's files.
pub(crate) fn group_manifest(kind: &str, name: &str) -> Value {
    let dir = repo().join("containers/k8s/group");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("containers/k8s/group")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("manifest");
            serde_saphyr::from_multiple::<Value>(&text).expect("YAML")
        })
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in containers/k8s/group"))
}

/// What the group's Role lets a sidecar do to Secrets.
pub(crate) fn group_role_secret_verbs() -> BTreeSet<String> {
    let role = group_manifest("Role", "tgp");
    role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| r["resources"] == json!(["secrets"]))
        .flat_map(|r| r["verbs"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// One pod of the StatefulSet: its sidecar, and its volume (a fresh one per pod).
pub(crate) struct ScaledPod {
    pub(crate) sidecar: Sidecar,
    pub(crate) volume: PathBuf,
}

/// What a pod's proxy container would run: the config in its volume, loaded as the daemon loads
/// it (key file modes checked).
pub(crate) fn handed_over(volume: &Path) -> Config {
    tunnelgate::shell::config_file::load_config(&volume.join("tunnelgate.toml"))
        .unwrap_or_else(|e| panic!("{}: {e}", volume.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_scales_2_3_1_2_from_unchanged_manifests() {
    // No Secret exists: the sidecars create their own, as the Role allows.
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let verbs = group_role_secret_verbs();
    fake.lock().may_create_secrets = verbs.contains("create");
    for verb in ["get", "patch", "list", "watch"] {
        assert!(verbs.contains(verb), "the Role grants {verb}: {verbs:?}");
    }
    let inputs = Inputs::new(&fake, "scale");
    let set = group_manifest("StatefulSet", "tgp");
    let cm = group_manifest("ConfigMap", "tgp-base");
    let base = cm["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let mut generation = 0;
    let mut start = |ordinal: u32| {
        generation += 1;
        let pod = format!("{GROUP}-{ordinal}");
        // A new pod: a new, empty volume.
        let volume = inputs.dir.join(format!("{pod}-volume-{generation}"));
        let tag = format!("{pod}-{generation}");
        let sidecar = sidecar_of_set(&set, &base, &inputs, &pod, &volume, &tag, &[]);
        ScaledPod { sidecar, volume }
    };
    let secret = |ordinal: u32| fake.secret_of("tunnelgate", &format!("{GROUP}-{ordinal}"));
    // A replica is up when its Secret is written and its volume holds what the Secret holds.
    async fn up(fake: &Fake, p: &ScaledPod, ordinal: u32) -> Config {
        let name = format!("{GROUP}-{ordinal}");
        wait_for(&p.sidecar, &format!("{name}'s Secret and volume"), || {
            fake.secret_of("tunnelgate", &name).len() == 4
                && p.volume.join("tunnelgate.toml").exists()
        })
        .await;
        let data = fake.secret_of("tunnelgate", &name);
        let config = handed_over(&p.volume);
        assert_eq!(
            config.interface.private_key.public_key().to_base64(),
            utf8(&data, "public_key"),
            "{name}: the volume's key is the Secret's"
        );
        assert_eq!(
            config,
            daemon_config(&data),
            "{name}: the volume runs the Secret's config"
        );
        assert_eq!(
            utf8(&data, "device_ips"),
            format!("[\"100.64.1.{}\"]", ordinal + 1),
            "{name}: host N+1 of the pool"
        );
        config
    }
    let public_key = |ordinal: u32| utf8(&secret(ordinal), "public_key");

    // 2 replicas.
    let mut pods: BTreeMap<u32, ScaledPod> = BTreeMap::new();
    for i in 0..2 {
        pods.insert(i, start(i));
    }
    for i in 0..2 {
        let c = up(&fake, &pods[&i], i).await;
        assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
    }
    let first_keys: Vec<String> = (0..2).map(public_key).collect();
    assert_ne!(first_keys[0], first_keys[1], "each replica its own key");

    // kubectl scale --replicas=3: a third pod, nothing else.
    pods.insert(2, start(2));
    up(&fake, &pods[&2], 2).await;
    let key_2 = public_key(2);
    assert!(!first_keys.contains(&key_2));

    // --replicas=1: the StatefulSet stops the highest ordinals; their Secrets stay.
    for i in [2, 1] {
        pods.remove(&i).expect("pod").sidecar.stop();
    }
    assert_eq!(public_key(1), first_keys[1]);
    assert_eq!(public_key(2), key_2);
    // The remaining replica goes on serving: a new Service reaches it.
    fake.add(group_ingress("apps", "api", 20, 8080), false);
    wait_for(&pods[&0].sidecar, "tgp-0 serves apps/api", || {
        handed_over(&pods[&0].volume).ingress.len() == 2
    })
    .await;

    // --replicas=2: ordinal 1 comes back in a new pod (an empty volume) with its key and
    // address, and finds its Secret behind by the change made while it was away.
    let patches_of_1 = || {
        fake.count(|r| {
            r.method == Method::PATCH
                && r.path == format!("/api/v1/namespaces/tunnelgate/secrets/{GROUP}-1")
        })
    };
    let patches_before = patches_of_1();
    pods.insert(1, start(1));
    let c = up(&fake, &pods[&1], 1).await;
    assert_eq!(
        public_key(1),
        first_keys[1],
        "a returning ordinal keeps its key"
    );
    assert_eq!(
        rule_lines(&c.ingress).len(),
        2,
        "it serves the group as it is now"
    );
    assert!(patches_of_1() > patches_before);
    for p in pods.into_values() {
        p.sidecar.stop();
    }
}

/// The pod's users as the group's StatefulSet file sets them, on the real kernel: the sidecar runs
/// as its non-root user and group; the proxy runs as root with only its capabilities (no
/// `CAP_DAC_OVERRIDE`) and the pod's supplementary groups, and loads what the sidecar handed over.
/// Without the supplementary group it could not: the files are the sidecar's, mode 0440.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn group_proxy_without_dac_override_reads_what_its_sidecar_hands_over() {
    common::require_root();
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "pod-users");
    let set = group_manifest("StatefulSet", "tgp");
    let base = group_manifest("ConfigMap", "tgp-base")["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let pod = &set["spec"]["template"]["spec"];
    let container = |name: &str| {
        pod["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
            .unwrap_or_else(|| panic!("container {name}"))
    };
    let (sidecar, proxy) = (container("sidecar"), container("proxy"));
    let id = |v: &Value| v.as_u64().expect("a numeric id").to_string();
    let (uid, gid) = (
        id(&sidecar["securityContext"]["runAsUser"]),
        id(&sidecar["securityContext"]["runAsGroup"]),
    );
    let groups: Vec<String> = pod["securityContext"]["supplementalGroups"]
        .as_array()
        .expect("supplementalGroups")
        .iter()
        .map(id)
        .collect();
    assert_eq!(id(&proxy["securityContext"]["runAsUser"]), "0");
    assert_eq!(
        proxy["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    let proxy_caps: Vec<String> = proxy["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("capabilities")
        .iter()
        .map(|c| format!("+{}", c.as_str().expect("cap").to_lowercase()))
        .collect();

    // An emptyDir is mode 0777; the base config and kubeconfig are readable by anyone.
    let volume = inputs.dir.join("tgp-0-volume");
    std::fs::create_dir_all(&volume).expect("volume");
    for dir in [&inputs.dir, &volume] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
    }
    let as_sidecar = [
        "setpriv",
        &format!("--reuid={uid}"),
        &format!("--regid={gid}"),
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ];
    let r0 = sidecar_of_set(&set, &base, &inputs, "tgp-0", &volume, "tgp-0", &as_sidecar);
    wait_for(&r0, "the handed-over config", || {
        volume.join("tunnelgate.toml").exists()
    })
    .await;
    for file in ["tunnelgate.toml", "private.key"] {
        let meta = std::fs::metadata(volume.join(file)).expect("stat");
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        assert_eq!(meta.uid().to_string(), uid, "{file} is the sidecar's");
        assert_eq!(meta.gid().to_string(), gid, "{file}");
        assert_eq!(meta.permissions().mode() & 0o777, 0o440, "{file}");
    }
    let config = volume.join("tunnelgate.toml").display().to_string();
    let check_as_proxy = |groups: &str| {
        Command::new("setpriv")
            .args([
                "--reuid=0",
                "--regid=0",
                groups,
                "--inh-caps=-all",
                "--no-new-privs",
            ])
            .arg(format!("--bounding-set=-all,{}", proxy_caps.join(",")))
            .args([
                env!("CARGO_BIN_EXE_tunnelgate"),
                "check",
                "--config",
                &config,
            ])
            .output()
            .expect("setpriv")
    };
    let out = check_as_proxy(&format!("--groups={}", groups.join(",")));
    assert!(
        out.status.success(),
        "the proxy loads the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check_as_proxy("--clear-groups");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Permission denied"),
        "without the group the files are closed to it: {err}"
    );
    r0.stop();
}
