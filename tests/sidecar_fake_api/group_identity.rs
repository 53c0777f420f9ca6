//! Proxy groups with a shared identity: one key (Secret `tgp-identity`) and one set of addresses
//! for every replica, created once whatever the race, never overwritten, kept in no replica's
//! Secret, and a new key taken by every replica at once.

use super::*;
use crate::group_scale::served_services;

pub(crate) const IDENTITY: &str = "tgp-identity";

/// The in-memory volume replica `ordinal`'s sidecar shares with its proxy container (a directory
/// per pod: `tag` tells pods of one ordinal apart).
pub(crate) fn volume_of(inputs: &Inputs, ordinal: u32, tag: &str) -> PathBuf {
    let volume = inputs.dir.join(format!("{GROUP}-{ordinal}-{tag}-volume"));
    std::fs::create_dir_all(&volume).expect("volume");
    volume
}

/// Replica `ordinal` of the group with `--identity shared` (by its environment variable),
/// handing over to its volume ([`volume_of`]).
pub(crate) fn shared_replica(inputs: &Inputs, ordinal: u32, tag: &str) -> Sidecar {
    let volume = volume_of(inputs, ordinal, tag).display().to_string();
    replica_with(
        inputs,
        ordinal,
        tag,
        &[
            ("TUNNELGATE_GROUP_IDENTITY", "shared"),
            ("TUNNELGATE_CONFIG_DIR", volume.as_str()),
        ],
    )
}

/// The key replica `ordinal`'s proxy container would run now: the one in its volume.
fn volume_key(inputs: &Inputs, ordinal: u32, tag: &str) -> Option<String> {
    let file = inputs
        .dir
        .join(format!("{GROUP}-{ordinal}-{tag}-volume"))
        .join("private.key");
    std::fs::read_to_string(file).ok()
}

/// Replicas 0 and 1 with the shared identity, once each has written its Secret and handed the
/// key over to its volume.
async fn two_shared_replicas_written(fake: &Fake, inputs: &Inputs) -> [Sidecar; 2] {
    let replicas = [
        shared_replica(inputs, 0, "a"),
        shared_replica(inputs, 1, "a"),
    ];
    for (i, r) in replicas.iter().enumerate() {
        written_and_handed_over(fake, inputs, r, i as u32, "a").await;
    }
    replicas
}

/// Waits until replica `ordinal` has written its Secret and its volume holds a key.
async fn written_and_handed_over(
    fake: &Fake,
    inputs: &Inputs,
    replica: &Sidecar,
    ordinal: u32,
    tag: &str,
) {
    wait_for(
        replica,
        &format!("replica {ordinal}'s Secret and volume"),
        || replica_patches(fake, ordinal) >= 1 && volume_key(inputs, ordinal, tag).is_some(),
    )
    .await;
}

fn identity_secret(fake: &Fake) -> BTreeMap<String, Vec<u8>> {
    fake.secret_of(NS, IDENTITY)
}

/// A replica's Secret data with the identity Secret's key beside it, as its volume has them.
fn with_group_key(fake: &Fake, own: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    let mut data = own.clone();
    if let Some(key) = identity_secret(fake).get("private.key") {
        data.insert("private.key".into(), key.clone());
    }
    data
}

fn identity_posts(fake: &Fake) -> usize {
    fake.count(|r| {
        r.method == Method::POST
            && r.path == format!("/api/v1/namespaces/{NS}/secrets")
            && r.body.contains(&format!("\"name\":\"{IDENTITY}\""))
    })
}

fn identity_writes_other_than_create(fake: &Fake) -> usize {
    fake.count(|r| {
        r.method != Method::GET
            && r.method != Method::POST
            && r.path == format!("/api/v1/namespaces/{NS}/secrets/{IDENTITY}")
    })
}

/// Replica `ordinal` runs the group's key: its volume hands the identity Secret's key to the
/// proxy container, with a config the daemon loads (key file modes checked), host 1 of the
/// pool; its own Secret has the group's `public_key` and no copy of the private key.
fn runs_the_group_identity(fake: &Fake, inputs: &Inputs, ordinal: u32, tag: &str) {
    let group = identity_secret(fake);
    let own = replica_secret(fake, ordinal);
    assert_eq!(
        own.keys().map(String::as_str).collect::<Vec<_>>(),
        ["device_ips", "public_key", "tunnelgate.toml"],
        "replica {ordinal}'s Secret keeps no key"
    );
    assert_eq!(
        volume_key(inputs, ordinal, tag).as_deref(),
        Some(utf8(&group, "private.key").as_str()),
        "replica {ordinal}'s volume key"
    );
    assert_eq!(
        utf8(&own, "public_key"),
        utf8(&group, "public_key"),
        "replica {ordinal}'s public key"
    );
    assert_eq!(utf8(&own, "device_ips"), r#"["100.64.1.1"]"#);
    let volume = inputs.dir.join(format!("{GROUP}-{ordinal}-{tag}-volume"));
    let config = handed_over(&volume);
    assert_eq!(config, daemon_config(&with_group_key(fake, &own)));
    assert_eq!(
        config.interface.private_key.public_key().to_base64(),
        utf8(&group, "public_key")
    );
    assert_eq!(
        config
            .interface
            .addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["100.64.1.1/32"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_gives_every_replica_one_key_and_address_and_a_scaled_in_one_too() {
    // No Secret beforehand: the first replica creates the identity, each its own config Secret.
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "group-shared");
    let [r0, r1] = two_shared_replicas_written(&fake, &inputs).await;
    let group = identity_secret(&fake);
    assert_eq!(
        group.keys().map(String::as_str).collect::<Vec<_>>(),
        ["private.key", "public_key"]
    );
    let key = utf8(&group, "private.key");
    for i in 0..2 {
        runs_the_group_identity(&fake, &inputs, i, "a");
    }
    // Both still serve every Service of the group, on the one address.
    for i in 0..2 {
        assert_eq!(
            served_services(&with_group_key(&fake, &replica_secret(&fake, i))),
            BTreeSet::from(["apps/web".to_string(), "shop/db".to_string()])
        );
    }

    // A replica scaled in (tgp-2) reads the identity, creates nothing.
    let posts = identity_posts(&fake);
    let r2 = shared_replica(&inputs, 2, "a");
    written_and_handed_over(&fake, &inputs, &r2, 2, "a").await;
    runs_the_group_identity(&fake, &inputs, 2, "a");
    assert_eq!(
        identity_posts(&fake),
        posts,
        "replica 2 tried to create the identity"
    );
    // Nobody ever wrote the identity Secret but by creating it.
    assert_eq!(utf8(&identity_secret(&fake), "private.key"), key);
    assert_eq!(identity_writes_other_than_create(&fake), 0);

    // A restart keeps the key and writes nothing.
    let before = (0..3)
        .map(|i| replica_patches(&fake, i))
        .collect::<Vec<_>>();
    r0.stop();
    let r0 = shared_replica(&inputs, 0, "b");
    wait_for(&r0, "replica 0's restart to read its Secret", || {
        r0.log().contains("Secret is up to date")
    })
    .await;
    assert_eq!(
        (0..3)
            .map(|i| replica_patches(&fake, i))
            .collect::<Vec<_>>(),
        before
    );
    assert_eq!(utf8(&identity_secret(&fake), "private.key"), key);
    for r in [r0, r1, r2] {
        r.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_two_replicas_racing_to_create_it_end_with_one_key() {
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    // Each replica's first read finds no identity Secret, as two reads made before either
    // create would: both create, and the API server's 409 AlreadyExists settles it.
    fake.lock().absent_gets.insert(key(NS, IDENTITY), 2);
    let inputs = Inputs::new(&fake, "group-shared-race");
    let [r0, r1] = two_shared_replicas_written(&fake, &inputs).await;
    assert_eq!(fake.lock().absent_gets[&key(NS, IDENTITY)], 0);
    assert_eq!(identity_posts(&fake), 2, "both replicas tried to create it");
    for i in 0..2 {
        runs_the_group_identity(&fake, &inputs, i, "a");
    }
    assert_eq!(identity_writes_other_than_create(&fake), 0);
    let (log0, log1) = (r0.log(), r1.log());
    let created = [&log0, &log1]
        .iter()
        .filter(|l| l.contains("Group identity Secret created"))
        .count();
    let lost = [&log0, &log1]
        .iter()
        .filter(|l| l.contains("created by another replica first"))
        .count();
    assert_eq!(
        (created, lost),
        (1, 1),
        "one creates, the other reads its key; logs:\n{log0}\n---\n{log1}"
    );
    r0.stop();
    r1.stop();
}

/// A group identity Secret that holds no usable key (here, 16 bytes) is reported on the pod and
/// nothing is written: not the replica's Secret, not the identity. Fixed by hand, it is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_refuses_a_malformed_identity_secret_and_uses_it_once_fixed() {
    use base64::Engine as _;
    let short = base64::engine::general_purpose::STANDARD.encode([7u8; 16]);
    let secrets = BTreeMap::from([(
        key(NS, IDENTITY),
        BTreeMap::from([("private.key".to_string(), short.clone().into_bytes())]),
    )]);
    let fake = Fake::start_many(group_cluster(), secrets).await;
    let inputs = Inputs::new(&fake, "group-shared-bad");
    let r0 = shared_replica(&inputs, 0, "a");
    wait_for(&r0, "a Warning Event on the pod", || {
        events(&fake).iter().any(|e| {
            e["involvedObject"]["kind"] == "Pod"
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("group identity Secret tg/tgp-identity"))
        })
    })
    .await;
    let event = events(&fake)
        .into_iter()
        .find(|e| e["involvedObject"]["kind"] == "Pod")
        .expect("pod event");
    let message = event["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("decodes to 16 bytes"), "{message}");
    assert!(
        !message.contains(&short),
        "the Event shows the key: {message}"
    );
    assert_eq!(event["reason"], "InvalidTunnelgateConfig");
    assert_eq!(replica_patches(&fake, 0), 0);
    assert_eq!(identity_posts(&fake), 0);
    assert_eq!(identity_writes_other_than_create(&fake), 0);
    assert_eq!(utf8(&identity_secret(&fake), "private.key"), short);

    // Fixed by hand: a good key, and the replica runs it (retried after a backoff).
    let good = SecretKey([9; 32]);
    fake.lock().secrets.insert(
        key(NS, IDENTITY),
        BTreeMap::from([("private.key".to_string(), good.expose_base64().into_bytes())]),
    );
    wait_for(&r0, "replica 0's Secret and volume", || {
        replica_patches(&fake, 0) >= 1
            && volume_key(&inputs, 0, "a").as_deref() == Some(good.expose_base64().as_str())
    })
    .await;
    assert!(!replica_secret(&fake, 0).contains_key("private.key"));
    assert_eq!(
        utf8(&replica_secret(&fake, 0), "public_key"),
        good.public_key().to_base64()
    );
    r0.stop();
}

/// How soon every replica runs a new group key: a watch of the identity Secret, not the
/// 5-minute resync (a debounce of 200 ms, two reads, a write and the hand-over; well under a
/// second here).
const ROTATION_LIMIT: Duration = Duration::from_secs(2);

/// Waits until `f` holds, at most `limit` from now; panics with every replica's log after it.
async fn within(sidecars: &[&Sidecar], what: &str, limit: Duration, f: impl Fn() -> bool) {
    let start = tunnelgate::shell::clock::tokio_now();
    while !f() {
        if tunnelgate::shell::clock::tokio_now() - start > limit {
            let logs: Vec<String> = sidecars.iter().map(|s| s.log()).collect();
            panic!(
                "not within {limit:?}: {what}; logs:\n{}",
                logs.join("\n---\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "{what}: {:?}",
        tunnelgate::shell::clock::tokio_now() - start
    );
}

/// Every PATCH and POST the replicas sent to their own Secrets, as sent.
fn replica_writes(fake: &Fake) -> Vec<String> {
    fake.requests()
        .into_iter()
        .filter(|r| {
            r.method != Method::GET
                && r.path
                    .starts_with(&format!("/api/v1/namespaces/{NS}/secrets"))
                && !r.path.ends_with(IDENTITY)
                && !r.body.contains(&format!("\"name\":\"{IDENTITY}\""))
        })
        .map(|r| r.body)
        .collect()
}

/// The key of a shared identity lives in the identity Secret only: a replica's own Secret has
/// none, and a copy an older version put there is removed on the next write, whether server-side
/// apply drops it (the sidecar's apply alone owned it: tgp-0) or not (another manager owns it
/// too, as after a `kubectl edit`: tgp-1, removed with a merge patch). A copy put back later is
/// removed again; the proxy containers run the group's key all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_keeps_no_key_in_a_replica_secret_and_removes_an_older_copy() {
    use base64::Engine as _;
    let group = SecretKey([21; 32]);
    let identity = BTreeMap::from([
        (
            "private.key".to_string(),
            group.expose_base64().into_bytes(),
        ),
        (
            "public_key".to_string(),
            group.public_key().to_base64().into_bytes(),
        ),
    ]);
    // What an older version left in each replica's Secret: the group's key copied in.
    let older = |config: &str| {
        let mut d = identity.clone();
        d.insert("device_ips".into(), br#"["100.64.1.1"]"#.to_vec());
        d.insert("tunnelgate.toml".into(), config.as_bytes().to_vec());
        d
    };
    let secrets = BTreeMap::from([
        (key(NS, IDENTITY), identity.clone()),
        (key(NS, &format!("{GROUP}-0")), older("# older 0\n")),
        (key(NS, &format!("{GROUP}-1")), older("# older 1\n")),
    ]);
    let fake = Fake::start_many(group_cluster(), secrets).await;
    // tgp-0's keys were all written by the sidecar's server-side apply.
    fake.lock().applied_keys.insert(
        key(NS, &format!("{GROUP}-0")),
        older("").into_keys().collect(),
    );
    let inputs = Inputs::new(&fake, "group-shared-no-copy");
    let replicas = [
        shared_replica(&inputs, 0, "a"),
        shared_replica(&inputs, 1, "a"),
    ];
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("replica {i}'s Secret without the key"), || {
            let own = replica_secret(&fake, i as u32);
            !own.contains_key("private.key") && own.len() == 3
        })
        .await;
        wait_for(r, &format!("replica {i}'s volume"), || {
            volume_key(&inputs, i as u32, "a").is_some()
        })
        .await;
        runs_the_group_identity(&fake, &inputs, i as u32, "a");
    }
    let merge_patches = |ordinal: u32| {
        fake.count(|r| {
            is_patch_of(&format!("{GROUP}-{ordinal}"))(r) && r.body.contains("\"private.key\":null")
        })
    };
    assert_eq!(
        merge_patches(0),
        0,
        "server-side apply dropped tgp-0's copy"
    );
    assert_eq!(merge_patches(1), 1, "tgp-1's copy needed its own removal");
    // Someone copies the key back in: removed again within seconds (the Secret is watched).
    let patches = replica_patches(&fake, 0);
    fake.edit_secret(
        NS,
        &format!("{GROUP}-0"),
        "private.key",
        &identity["private.key"],
    );
    wait_for(&replicas[0], "the copy removed again", || {
        !replica_secret(&fake, 0).contains_key("private.key")
    })
    .await;
    assert!(replica_patches(&fake, 0) > patches);
    // Nothing the replicas sent to their Secrets ever carried the key, in any encoding.
    let b64 = base64::engine::general_purpose::STANDARD.encode(group.expose_base64());
    for body in replica_writes(&fake) {
        assert!(
            !body.contains(&b64) && !body.contains(&group.expose_base64()),
            "a replica wrote the group's key: {body}"
        );
    }
    assert_eq!(identity_writes_other_than_create(&fake), 0);
    assert_eq!(identity_posts(&fake), 0);
    for r in replicas {
        r.stop();
    }
}

/// An operator rotates the group's key: every replica's volume (what its proxy container runs,
/// and reloads within 2 s of the swap) carries the new key within [`ROTATION_LIMIT`], whether
/// the identity Secret is edited in place or deleted and created again. A malformed new key is
/// refused (a Warning Event on each pod, the Secret named in the log, the value never echoed)
/// and the running key stays; the fix is taken as fast, without waiting out a backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_rotation_reaches_every_replica_at_once() {
    use base64::Engine as _;
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "group-shared-rotate");
    let replicas = two_shared_replicas_written(&fake, &inputs).await;
    let all = [&replicas[0], &replicas[1]];
    let first = utf8(&identity_secret(&fake), "private.key");
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("replica {i}'s volume"), || {
            volume_key(&inputs, i as u32, "a").as_deref() == Some(first.as_str())
        })
        .await;
    }
    let every_volume_runs = |key: &SecretKey| {
        let text = key.expose_base64();
        (0..2).all(|i| {
            volume_key(&inputs, i, "a").is_some_and(|k| k.trim() == text)
                && utf8(&replica_secret(&fake, i), "public_key") == key.public_key().to_base64()
        })
    };

    // 1. Edited in place (`kubectl apply` of a new Secret over it).
    let second = SecretKey([31; 32]);
    let mut data = BTreeMap::from([(
        "private.key".to_string(),
        second.expose_base64().into_bytes(),
    )]);
    data.insert(
        "public_key".into(),
        second.public_key().to_base64().into_bytes(),
    );
    fake.put_secret(NS, IDENTITY, data);
    within(
        &all,
        "an edited key in every volume",
        ROTATION_LIMIT,
        || every_volume_runs(&second),
    )
    .await;
    for i in 0..2 {
        let config = handed_over(&inputs.dir.join(format!("{GROUP}-{i}-a-volume")));
        assert_eq!(config.interface.private_key, second, "replica {i} loads it");
        assert!(!replica_secret(&fake, i).contains_key("private.key"));
    }
    assert!(
        replicas[0].log().contains("rotated=true"),
        "{}",
        replicas[0].log()
    );

    // 2. A malformed new key (33 bytes): refused on each pod, the running key stays.
    let bad = base64::engine::general_purpose::STANDARD.encode([3u8; 33]);
    fake.put_secret(
        NS,
        IDENTITY,
        BTreeMap::from([("private.key".to_string(), bad.clone().into_bytes())]),
    );
    for (i, r) in replicas.iter().enumerate() {
        let pod = format!("{GROUP}-{i}");
        wait_for(r, &format!("a Warning Event on {pod}"), || {
            events(&fake).iter().any(|e| {
                e["involvedObject"]["name"] == pod.as_str()
                    && e["message"].as_str().is_some_and(|m| {
                        m.contains("group identity Secret tg/tgp-identity")
                            && m.contains("decodes to 33 bytes")
                    })
            })
        })
        .await;
    }
    // Refused again at each retry, backing off (0.2, 0.4, 0.8, 1.6, then 3.2 s): wait for the
    // fifth refusal, so that a fix that waited for the next retry would miss ROTATION_LIMIT.
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("replica {i}'s fifth refusal"), || {
            r.log()
                .matches("Replica configuration still invalid")
                .count()
                >= 4
        })
        .await;
    }
    assert!(every_volume_runs(&second), "the running key stays");
    for (i, r) in replicas.iter().enumerate() {
        let log = r.log();
        assert!(
            log.contains("group identity Secret tg/tgp-identity: private.key decodes to 33 bytes"),
            "replica {i}: {log}"
        );
        assert!(!log.contains(&bad[..20]), "replica {i} echoed the value");
    }
    for e in events(&fake) {
        let message = e["message"].as_str().unwrap_or_default();
        assert!(!message.contains(&bad[..20]), "an Event echoed the value");
    }

    // 3. Fixed by hand (`wg genkey` with its newline, no public_key): taken as fast, though the
    //    refusal's next retry is seconds away.
    let third = SecretKey([41; 32]);
    fake.put_secret(
        NS,
        IDENTITY,
        BTreeMap::from([(
            "private.key".to_string(),
            format!("{}\n", third.expose_base64()).into_bytes(),
        )]),
    );
    within(&all, "a fixed key in every volume", ROTATION_LIMIT, || {
        every_volume_runs(&third)
    })
    .await;

    // 4. Deleted, then created with a new key: no replica puts the old key back in between (its
    //    create would make the operator's fail), each keeps running it, then takes the new one.
    let posts = identity_posts(&fake);
    fake.delete_secret(NS, IDENTITY);
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("replica {i} to see it gone"), || {
            r.log().contains("Group identity Secret is missing")
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        identity_posts(&fake),
        posts,
        "a replica created it again at once"
    );
    assert!(every_volume_runs(&third), "the running key stays meanwhile");
    let fourth = SecretKey([51; 32]);
    fake.put_secret(
        NS,
        IDENTITY,
        BTreeMap::from([(
            "private.key".to_string(),
            fourth.expose_base64().into_bytes(),
        )]),
    );
    within(
        &all,
        "a re-created key in every volume",
        ROTATION_LIMIT,
        || every_volume_runs(&fourth),
    )
    .await;
    assert_eq!(identity_posts(&fake), posts);
    assert_eq!(identity_writes_other_than_create(&fake), 0);
    for r in replicas {
        r.stop();
    }
}

/// A deleted identity Secret that nobody creates again is created by a replica with the key the
/// group runs, once IDENTITY_RECREATE_AFTER (30 s) has passed: peers keep working, the volume
/// never changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_deleted_and_not_replaced_is_created_again_with_the_running_key() {
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "group-shared-recreate");
    let r0 = shared_replica(&inputs, 0, "a");
    wait_for(&r0, "replica 0's volume", || {
        volume_key(&inputs, 0, "a").is_some()
    })
    .await;
    let running = utf8(&identity_secret(&fake), "private.key");
    let posts = identity_posts(&fake);
    fake.delete_secret(NS, IDENTITY);
    let gone = tunnelgate::shell::clock::tokio_now();
    let deadline = gone + Duration::from_secs(45);
    while identity_posts(&fake) == posts {
        assert!(
            tunnelgate::shell::clock::tokio_now() < deadline,
            "not created again; log:\n{}",
            r0.log()
        );
        assert_eq!(
            volume_key(&inputs, 0, "a").as_deref(),
            Some(running.as_str())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = tunnelgate::shell::clock::tokio_now() - gone;
    assert!(
        after >= Duration::from_secs(29),
        "created again after {after:?}"
    );
    // The create's answer, then its log line.
    wait_for(&r0, "the identity Secret back, and said", || {
        !identity_secret(&fake).is_empty() && r0.log().contains("recreated=true")
    })
    .await;
    assert_eq!(utf8(&identity_secret(&fake), "private.key"), running);
    assert_eq!(
        volume_key(&inputs, 0, "a").as_deref(),
        Some(running.as_str())
    );
    r0.stop();
}

/// The flag and its environment variable take exactly `per-replica` or `shared`, only with a
/// proxy group, and a group name too long for its identity Secret's name is refused: exit 2,
/// before any API call.
/// The group's UDP load balancer (containers/k8s/group-shared/balancer.yaml), annotated for
/// group `group`, with `ingress` as its load balancer's addresses so far.
fn balancer_service(group: &str, created: u32, ingress: &[&str]) -> Value {
    let mut s = group_service(
        NS,
        &format!("{group}-wireguard"),
        None,
        created,
        json!({"tunnelgate.dev/proxy-group-balancer": group}),
    );
    s["spec"]["type"] = json!("LoadBalancer");
    s["spec"]["ports"] =
        json!([{"name": "wireguard", "port": 51820, "targetPort": "wireguard", "protocol": "UDP"}]);
    s["status"] = json!({"loadBalancer": {"ingress": ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}});
    s
}

/// The Endpoint a peer's `[Peer]` section gets from replica `ordinal`'s config, as `tunnelgate
/// check` prints it (`None`: only a comment, no Endpoint line).
fn printed_endpoint(fake: &Fake, ordinal: u32) -> Option<String> {
    let config = daemon_config(&with_group_key(fake, &replica_secret(fake, ordinal)));
    let plan = tunnelgate::core::check_report::render_plan(&config, None);
    let (_, client) = plan.split_once("# client side: ")?;
    client
        .lines()
        .find_map(|l| l.strip_prefix("Endpoint = "))
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_shared_identity_prints_the_balancers_address_as_the_peers_endpoint() {
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "group-balancer");
    let replicas = two_shared_replicas_written(&fake, &inputs).await;
    for i in 0..2 {
        assert_eq!(printed_endpoint(&fake, i), None, "no balancer yet");
    }
    // The balancer appears before its load balancer has an address, beside one of another
    // group: still nothing to print.
    fake.add(balancer_service(GROUP, 20, &[]), false);
    fake.add(balancer_service("another", 21, &["198.51.100.99"]), false);
    // Then the cloud gives it an address: every replica's client section names it, with the
    // group's key.
    fake.change(
        NS,
        &format!("{GROUP}-wireguard"),
        |s| s["status"]["loadBalancer"]["ingress"] = json!([{"ip": "203.0.113.10"}]),
        false,
    );
    for (i, r) in replicas.iter().enumerate() {
        wait_for(r, &format!("replica {i}'s endpoint"), || {
            printed_endpoint(&fake, i as u32).as_deref() == Some("203.0.113.10:51820")
        })
        .await;
        let plan = tunnelgate::core::check_report::render_plan(
            &daemon_config(&with_group_key(&fake, &replica_secret(&fake, i as u32))),
            None,
        );
        assert!(
            plan.contains(&format!(
                "[Peer]\nPublicKey = {}\nEndpoint = 203.0.113.10:51820\n",
                utf8(&identity_secret(&fake), "public_key")
            )),
            "{plan}"
        );
    }
    assert!(
        replicas[0].log().contains("203.0.113.10:51820"),
        "the log names the endpoint: {}",
        replicas[0].log()
    );
    // A balancer the peers cannot dial (two UDP ports) is named in the log and prints nothing.
    fake.change(
        NS,
        &format!("{GROUP}-wireguard"),
        |s| {
            s["spec"]["ports"] = json!([
                {"name": "a", "port": 51820, "protocol": "UDP"},
                {"name": "b", "port": 51821, "protocol": "UDP"}
            ])
        },
        false,
    );
    wait_for(&replicas[0], "the endpoint to go", || {
        printed_endpoint(&fake, 0).is_none()
    })
    .await;
    assert!(
        replicas[0].log().contains("has 2 UDP ports"),
        "{}",
        replicas[0].log()
    );
    for r in replicas {
        r.stop();
    }
}

#[test]
fn group_identity_bad_usage_exits_2() {
    use std::os::unix::ffi::OsStrExt as _;
    let run = |args: &[&str], env: &[(&str, &std::ffi::OsStr)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
            .args(args)
            .args(["--base-config", "/x"])
            .env_remove("TUNNELGATE_SECRET")
            .env_remove("TUNNELGATE_SERVICE")
            .env_remove("TUNNELGATE_PROXY_GROUP")
            .env_remove("TUNNELGATE_ADDRESS_POOLS")
            .env_remove("TUNNELGATE_GROUP_IDENTITY")
            .env_remove("TUNNELGATE_CONFIG_DIR")
            .env("POD_NAME", "tgp-0")
            // Nowhere to connect: a usage error must come before any API call.
            .env("KUBECONFIG", "/nonexistent")
            .envs(env.iter().copied())
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let os = std::ffi::OsStr::new;
    let long = "x".repeat(10_000);
    for value in [
        os("Shared"),
        os(""),
        os(" shared"),
        os("shared\n"),
        os("per_replica"),
        os(long.as_str()),
    ] {
        let (code, err) = run(
            &["--proxy-group", "tgp"],
            &[("TUNNELGATE_GROUP_IDENTITY", value)],
        );
        assert_eq!(code, Some(2), "{value:?}: {err}");
        assert!(
            err.contains("\"per-replica\" or \"shared\""),
            "{value:?}: {err}"
        );
    }
    // Not UTF-8.
    let (code, _) = run(
        &["--proxy-group", "tgp"],
        &[(
            "TUNNELGATE_GROUP_IDENTITY",
            std::ffi::OsStr::from_bytes(b"sh\xffred"),
        )],
    );
    assert_eq!(code, Some(2));
    let (code, err) = run(&["--proxy-group", "tgp", "--identity", "bogus"], &[]);
    assert_eq!(code, Some(2), "{err}");
    // Only with a proxy group.
    let (code, err) = run(
        &[
            "--service",
            "tg/web",
            "--secret",
            "tg/proxy-0",
            "--identity",
            "shared",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--proxy-group"), "{err}");
    // A group name whose identity Secret name would pass 253 characters.
    let group = "g".repeat(250);
    let (code, err) = run(&["--proxy-group", &group, "--identity", "shared"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("expected at most 244 characters"), "{err}");
    // Shared needs the volume: the group's key is kept in no replica's Secret.
    let (code, err) = run(&["--proxy-group", "tgp", "--identity", "shared"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--identity shared needs --config-dir"),
        "{err}"
    );
    let (code, err) = run(
        &["--proxy-group", "tgp"],
        &[("TUNNELGATE_GROUP_IDENTITY", os("shared"))],
    );
    assert_eq!(code, Some(2), "{err}");
    // The same name is fine per replica (its Secrets are named after the pods).
    let (code, err) = run(&["--proxy-group", &group], &[]);
    assert_ne!(code, Some(2), "{err}");
}
