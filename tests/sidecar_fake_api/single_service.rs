//! One sidecar and one Service: first run, idempotence, one apply per change, conflicts, watches, restarts, bad input.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_run_creates_the_key_and_a_second_run_writes_nothing() {
    // The Secret exists, empty, as the manifests create it.
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "first");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "the first apply", || patches(&fake) == 1).await;

    let patch = fake
        .requests()
        .into_iter()
        .find(Recorded::is_secret_patch)
        .expect("patch");
    assert!(
        patch.query.contains("fieldManager=tunnelgate-sidecar"),
        "{}",
        patch.query
    );
    assert!(patch.query.contains("force=true"), "{}", patch.query);
    let body: Value = serde_json::from_str(&patch.body).expect("apply body is JSON");
    assert_eq!(body["kind"], "Secret");
    assert_eq!(body["metadata"]["name"], SECRET);

    let data = fake.secret();
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["device_ips", "private.key", "public_key", "tunnelgate.toml"]
    );
    let config = daemon_config(&data);
    assert_eq!(
        utf8(&data, "public_key"),
        config.interface.private_key.public_key().to_base64()
    );
    assert_eq!(
        utf8(&data, "device_ips"),
        r#"["100.64.0.1","fd7a:115c:a1e0::1"]"#
    );
    assert_eq!(config.ingress.len(), 1);
    assert_eq!(config.ingress[0].ports[0].to_string(), "80/tcp");
    sidecar.stop();

    // Same inputs again: it reads the Secret, finds it up to date, and writes nothing.
    fake.lock().requests.clear();
    let second = Sidecar::start(&inputs, 2);
    wait_for(&second, "the Secret read", || {
        fake.count(Recorded::is_secret_get) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        patches(&fake),
        0,
        "second run wrote; log:\n{}",
        second.log()
    );
    assert_eq!(fake.secret(), data, "the Secret is untouched");
    second.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_created_by_apply() {
    let fake = Fake::start(exposed(), None).await;
    let inputs = Inputs::new(&fake, "create");
    let sidecar = started(&fake, &inputs).await;
    assert_eq!(fake.secret().len(), 4);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_change_gives_exactly_one_apply() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "change");
    let sidecar = started(&fake, &inputs).await;
    let key = utf8(&fake.secret(), "private.key");

    fake.change_service(
        |s| {
            s["spec"]["ports"]
                .as_array_mut()
                .expect("ports")
                .push(json!({"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}))
        },
        false,
    );
    wait_for(&sidecar, "the second apply", || patches(&fake) == 2).await;
    // A change that does not touch the rendered config writes nothing.
    fake.change_service(
        |s| s["metadata"]["annotations"]["other"] = json!("x"),
        false,
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(patches(&fake), 2, "log:\n{}", sidecar.log());

    let data = fake.secret();
    let ports: Vec<String> = daemon_config(&data).ingress[0]
        .ports
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ports, ["80/tcp", "443/tcp"]);
    assert_eq!(utf8(&data, "private.key"), key, "the key is never replaced");
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflict_is_retried_and_recovered() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    fake.lock().conflicts = 2;
    let inputs = Inputs::new(&fake, "conflict");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "the Secret written", || fake.secret().len() == 4).await;
    assert_eq!(patches(&fake), 3, "two 409s, then success");
    daemon_config(&fake.secret());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(patches(&fake), 3, "no more writes once it succeeded");
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watch_is_resumed() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "dropped");
    let sidecar = started(&fake, &inputs).await;
    let watches = fake.count(Recorded::is_watch);

    fake.drop_watches();
    wait_for(&sidecar, "a new watch", || {
        fake.count(Recorded::is_watch) > watches && !fake.lock().watchers.is_empty()
    })
    .await;
    let resumed = fake
        .requests()
        .into_iter()
        .rfind(Recorded::is_watch)
        .expect("watch");
    assert!(
        resumed.query.contains("resourceVersion="),
        "{}",
        resumed.query
    );

    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(81), false);
    wait_for(&sidecar, "the apply after the resumed watch", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 81);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_watch_lists_again() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "expired");
    let sidecar = started(&fake, &inputs).await;
    let is_list =
        |r: &Recorded| r.method == Method::GET && r.path.ends_with("/services") && !r.is_watch();
    assert_eq!(fake.count(is_list), 1);

    // Changed while the watch was expiring: only the new list shows it.
    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(83), true);
    fake.expire_watches();
    wait_for(&sidecar, "a new list", || fake.count(is_list) == 2).await;
    wait_for(&sidecar, "the apply after the relist", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 83);
    wait_for(&sidecar, "a new watch", || !fake.lock().watchers.is_empty()).await;
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_restart_is_survived() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "restart");
    let sidecar = started(&fake, &inputs).await;

    fake.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Changed while the sidecar could not see it.
    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(82), true);
    fake.restart().await;
    wait_for(&sidecar, "the apply after the restart", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 82);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_config_change_is_rendered() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "base");
    let sidecar = started(&fake, &inputs).await;
    // Atomically, as a ConfigMap mount changes.
    let tmp = inputs.dir.join("base.toml.new");
    std::fs::write(&tmp, base_config(true)).expect("write");
    std::fs::rename(&tmp, inputs.base_path()).expect("rename");
    wait_for(&sidecar, "the apply of the new base config", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).peers.len(), 2);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_annotation_records_an_event_and_keeps_the_secret() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "bad");
    let sidecar = started(&fake, &inputs).await;
    let good = fake.secret();

    fake.change_service(
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-ip"] = json!("100.64.0.300"),
        false,
    );
    wait_for(&sidecar, "an Event", || fake.count(Recorded::is_event) == 1).await;
    let event: Value = serde_json::from_str(
        &fake
            .requests()
            .into_iter()
            .find(Recorded::is_event)
            .expect("event")
            .body,
    )
    .expect("event JSON");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["kind"], "Service");
    assert_eq!(event["involvedObject"]["name"], SERVICE);
    assert_eq!(event["involvedObject"]["uid"], "0b7c5f3e-uid");
    let message = event["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("\"100.64.0.300\" is not an IP address"),
        "{message}"
    );

    // Conflicting annotations: a second, different problem, a second Event.
    fake.change_service(
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-fqdn"] = json!("db.internal"),
        false,
    );
    wait_for(&sidecar, "a second Event", || {
        fake.count(Recorded::is_event) == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(patches(&fake), 1, "nothing written for bad input");
    assert_eq!(fake.secret(), good, "the last good Secret stays");

    // Fixed: written again, and no more Events.
    fake.change_service(
        |s| {
            let a = s["metadata"]["annotations"]
                .as_object_mut()
                .expect("annotations");
            a.remove("tunnelgate.dev/tunnel-fqdn");
            a.insert("tunnelgate.dev/tunnel-ip".into(), json!("100.64.0.2"));
        },
        false,
    );
    wait_for(&sidecar, "the apply of the fixed Service", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).egress.len(), 1);
    assert_eq!(fake.count(Recorded::is_event), 2);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_the_first_run_writes_nothing() {
    // Exposed, but headless: no ClusterIP to forward to.
    let mut svc = exposed();
    svc["spec"]["clusterIP"] = json!("None");
    svc["spec"]["clusterIPs"] = json!(["None"]);
    let fake = Fake::start(svc, Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "headless");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "an Event", || fake.count(Recorded::is_event) == 1).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(patches(&fake), 0);
    assert!(fake.secret().is_empty(), "no key, no config written");
    assert_eq!(fake.count(Recorded::is_event), 1, "reported once");
    assert!(
        sidecar.log().contains("has no ClusterIP"),
        "{}",
        sidecar.log()
    );
    sidecar.stop();
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
        .args([
            "--secret",
            "Bad/Name",
            "--service",
            "tg/web",
            "--base-config",
            "/x",
        ])
        .env_remove("TUNNELGATE_SECRET")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret"));
}
