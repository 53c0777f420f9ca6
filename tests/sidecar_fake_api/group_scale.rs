//! Proxy groups at scale: size, coalescing, Events after the Secret, its own Secret, outages.

use super::*;

/// Services of the group as a cluster at scale has them: spread over 20 namespaces, 70 % ingress
/// and 30 % egress, 1 to 3 ports each. Service `i` is created at second `i` of the day. Every
/// port is its own (taken from `next_port`), except that with `clash_every` > 0 every such-th
/// Service takes the ports of the one before it: it clashes and is left out. `long_names`: a
/// name of 63 characters that do not compress, to fill the Secret with fewer Services.
pub(crate) fn scale_services(
    from: u32,
    n: u32,
    clash_every: u32,
    next_port: &mut u32,
    long_names: bool,
) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for i in from..from + n {
        let ns = format!("ns-{}", i % 20);
        let name = if long_names {
            // A cheap hash of i: hex digits with no pattern gzip can use.
            let mut h = u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD_BEEF;
            let mut name = format!("s{i:06}-");
            while name.len() < 63 {
                h ^= h << 13;
                h ^= h >> 7;
                h ^= h << 17;
                name.push_str(&format!("{h:016x}"));
            }
            name.truncate(63);
            name
        } else {
            format!("svc-{i}")
        };
        let clash = clash_every > 0 && i % clash_every == clash_every - 1 && !out.is_empty();
        let (ingress, ports): (bool, Vec<u32>) = match out.last() {
            Some(prev) if clash => {
                let ingress = prev["metadata"]["annotations"]["tunnelgate.dev/expose"] == "true";
                let field = if ingress { "port" } else { "targetPort" };
                let ports = prev["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p[field].as_u64())
                    .map(|p| p as u32)
                    .collect();
                (ingress, ports)
            }
            _ => {
                let ports = (0..1 + i % 3)
                    .map(|_| {
                        // Never the health port (9002) or WireGuard's (51820): the daemon
                        // refuses an egress rule on those, and these Services are all valid.
                        while [9002, 51820].contains(next_port) {
                            *next_port += 1;
                        }
                        *next_port += 1;
                        *next_port - 1
                    })
                    .collect();
                (i % 10 < 7, ports)
            }
        };
        assert!(*next_port < 65_000, "out of ports");
        let annotations = if ingress {
            json!({"tunnelgate.dev/proxy-group": GROUP, "tunnelgate.dev/expose": "true"})
        } else {
            json!({"tunnelgate.dev/proxy-group": GROUP, "tunnelgate.dev/tunnel-ip": "100.64.0.2"})
        };
        let spec_ports: Vec<Value> = ports
            .iter()
            .enumerate()
            .map(|(k, p)| {
                if ingress {
                    json!({"name": format!("p{k}"), "port": p, "targetPort": p, "protocol": "TCP"})
                } else {
                    json!({"name": format!("p{k}"), "port": 5432 + k, "targetPort": p, "protocol": "TCP"})
                }
            })
            .collect();
        let ip = format!("10.{}.{}.{}", 96 + i / 65_536, (i / 256) % 256, i % 256);
        out.push(json!({
            "kind": "Service", "apiVersion": "v1",
            "metadata": {
                "name": name, "namespace": ns, "uid": format!("uid-{i}"),
                "creationTimestamp": format!(
                    "2025-01-0{}T{:02}:{:02}:{:02}Z", 1 + i / 86_400, (i / 3600) % 24, (i / 60) % 60, i % 60
                ),
                "annotations": annotations,
            },
            "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": spec_ports},
        }));
    }
    out
}

/// The Services (`NS/NAME`) a replica's Secret serves, as the daemon would load it.
pub(crate) fn served_services(data: &BTreeMap<String, Vec<u8>>) -> BTreeSet<String> {
    if data.is_empty() {
        return BTreeSet::new();
    }
    let c = daemon_config(data);
    c.ingress
        .iter()
        .chain(&c.egress)
        .filter_map(|f| f.service.clone())
        .collect()
}

/// How long a test at scale waits: a debug build lists and renders 10,000 Services about ten
/// times slower than a release build.
pub(crate) const SCALE_WAIT: Duration = Duration::from_secs(180);

/// Whether the time and memory bounds of the tests at scale are checked: in a release build
/// (`cargo test --release`), where they are the figures the README gives. A debug build checks
/// everything else and prints its timings and memory.
pub(crate) const TIMED: bool = !cfg!(debug_assertions);

/// Polls `f` until it holds, for up to [`SCALE_WAIT`].
pub(crate) async fn wait_long(sidecar: &Sidecar, what: &str, f: impl Fn() -> bool) {
    let deadline = tunnelgate::shell::clock::tokio_now() + SCALE_WAIT;
    while !f() {
        assert!(
            tunnelgate::shell::clock::tokio_now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until replica `ordinal` has written at least `writes` times and serves `n` Services.
pub(crate) async fn serves(fake: &Fake, sidecar: &Sidecar, ordinal: u32, writes: usize, n: usize) {
    let what = format!("replica {ordinal} serving {n} Services");
    let deadline = tunnelgate::shell::clock::tokio_now() + SCALE_WAIT;
    loop {
        if replica_patches(fake, ordinal) >= writes
            && served_services(&replica_secret(fake, ordinal)).len() == n
        {
            return;
        }
        assert!(
            tunnelgate::shell::clock::tokio_now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The peak resident memory of a process (`VmHWM`), in bytes.
pub(crate) fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

pub(crate) fn secret_size(data: &BTreeMap<String, Vec<u8>>) -> usize {
    data.values().map(Vec::len).sum()
}

/// Where in the fake's log of requests the first one matching `f` is.
pub(crate) fn first_request(fake: &Fake, f: impl Fn(&Recorded) -> bool) -> Option<usize> {
    fake.requests().iter().position(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_10000_services_a_burst_is_coalesced_and_memory_stays_under_64_mib() {
    let mut next_port = 1024;
    let services = scale_services(0, 10_000, 0, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "scale-burst");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    serves(&fake, &r0, 0, 1, 10_000).await;
    serves(&fake, &r1, 1, 1, 10_000).await;
    let before = [replica_patches(&fake, 0), replica_patches(&fake, 1)];

    // 50 new Services, one every 20 ms.
    for svc in scale_services(10_000, 50, 0, &mut next_port, false) {
        fake.add(svc, false);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serves(&fake, &r0, 0, before[0] + 1, 10_050).await;
    serves(&fake, &r1, 1, before[1] + 1, 10_050).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        let writes = replica_patches(&fake, i as u32) - before[i];
        let rss = peak_rss(r.child.id());
        eprintln!(
            "replica {i}: {writes} writes for 50 Services, peak RSS {} MiB",
            rss >> 20
        );
        assert!(
            writes <= 10,
            "replica {i}: {writes} writes for a burst of 50 Services"
        );
        // A debug build takes more memory; the bound is the release build's.
        assert!(
            !TIMED || rss <= 64 << 20,
            "replica {i}: peak RSS {} MiB",
            rss >> 20
        );
    }
    r0.stop();
    r1.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_10000_services_with_20_percent_clashes_converges_and_events_follow() {
    let mut next_port = 1024;
    let services = scale_services(0, 10_000, 5, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "scale-clash");
    let started = tunnelgate::shell::clock::now();
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    wait_long(&r0, "both Secrets written", || {
        replica_patches(&fake, 0) >= 1 && replica_patches(&fake, 1) >= 1
    })
    .await;
    let converged = tunnelgate::shell::clock::since(started);
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        serves(&fake, r, i as u32, 1, 8_000).await;
        // The Secret went out before any Event about a Service left out.
        let patch = first_request(&fake, is_patch_of(&format!("{GROUP}-{i}"))).expect("patch");
        let event = first_request(&fake, |r| {
            r.is_event() && r.body.contains(&format!("replica {i} of proxy group"))
        });
        assert!(
            event.is_none_or(|e| e > patch),
            "replica {i}: Event before the Secret"
        );
    }
    eprintln!("10,000 Services, 2,000 clashes: both replicas written {converged:?} after start");
    assert!(
        !TIMED || converged <= Duration::from_secs(2),
        "converged after {converged:?}"
    );
    // The Events follow, at a bounded rate: a burst, then about 10 a second per replica.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = events(&fake).len();
    let elapsed = tunnelgate::shell::clock::since(started).as_secs_f64();
    assert!(sent >= 20, "only {sent} Events");
    assert!(
        (sent as f64) <= 2.0 * (25.0 + 10.0 * elapsed) + 2.0,
        "{sent} Events in {elapsed:.1} s: not rate-limited"
    );
    let reasons: BTreeSet<String> = events(&fake)
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        reasons,
        BTreeSet::from(["TunnelgateServiceLeftOut".to_string()])
    );
    r0.stop();
    r1.stop();
}

/// `services` with every egress Service's `tunnel-ip` replaced by a `tunnel-fqdn` that does not
/// resolve (`NAME.NS.invalid`): each gets a Warning Event, queued behind the others.
pub(crate) fn with_unresolvable_names(mut services: Vec<Value>) -> Vec<Value> {
    for svc in &mut services {
        let meta = &mut svc["metadata"];
        let name = format!(
            "{}.{}.invalid",
            meta["name"].as_str().unwrap_or_default(),
            meta["namespace"].as_str().unwrap_or_default()
        );
        if let Some(a) = meta["annotations"].as_object_mut() {
            if a.remove("tunnelgate.dev/tunnel-ip").is_some() {
                a.insert("tunnelgate.dev/tunnel-fqdn".into(), json!(name));
            }
        }
    }
    services
}

/// 20,000 Services over the sidecar's whole life within the manifests' 64 MiB limit: the list
/// at start, the Secret (gzip-compressed), a check of 6,000 names that do not resolve and their
/// queued Events, a burst of 50 new Services, then three single adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_20000_services_fits_the_secret_and_memory_stays_under_64_mib() {
    let mut next_port = 1024;
    let services = with_unresolvable_names(scale_services(0, 20_000, 0, &mut next_port, false));
    let fqdn_services = services
        .iter()
        .filter(|s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-fqdn"].is_string())
        .count();
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "scale-20k");
    // The pod's DNS: nothing listens on 127.0.0.1:53, so no name resolves.
    let r0 = replica_without_dns(&inputs, "20k");
    let started = tunnelgate::shell::clock::now();
    serves(&fake, &r0, 0, 1, 20_000).await;
    let converged = tunnelgate::shell::clock::since(started);
    let converged_rss = peak_rss(r0.child.id());
    let data = replica_secret(&fake, 0);
    assert!(data.contains_key("tunnelgate.toml.gz"), "{:?}", data.keys());
    let size = secret_size(&data);
    assert!(size <= SECRET_LIMIT);
    // The names were checked and their Events queued (sent at about 10 a second).
    let unresolved = || {
        events(&fake)
            .iter()
            .filter(|e| e["reason"] == "TunnelgateNameUnresolved")
            .count()
    };
    wait_long(&r0, "the first Events on names that do not resolve", || {
        unresolved() >= 20
    })
    .await;

    // A burst of 50, then three single adds (each one a pass and a check of every name). Only
    // in a release build, whose bound this is: a debug build takes a minute per pass here.
    if !TIMED {
        r0.stop();
        common::skip(format!(
            "20,000 Services: written {converged:?} after start, Secret {size} bytes, peak RSS {} \
             MiB; the burst and the adds are checked in a release build only (cargo test --release)",
            converged_rss >> 20
        ));
        return;
    }
    let before = replica_patches(&fake, 0);
    for svc in with_unresolvable_names(scale_services(20_000, 50, 0, &mut next_port, false)) {
        fake.add(svc, false);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serves(&fake, &r0, 0, before + 1, 20_050).await;
    for k in 0..3 {
        let writes = replica_patches(&fake, 0);
        let svc = with_unresolvable_names(scale_services(20_050 + k, 1, 0, &mut next_port, false));
        fake.add(svc.into_iter().next().expect("one Service"), false);
        serves(&fake, &r0, 0, writes + 1, 20_051 + k as usize).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss = peak_rss(r0.child.id());
    eprintln!(
        "20,000 Services: written {converged:?} after start, Secret {size} bytes ({} bytes of TOML), peak RSS {} MiB converged, {} MiB after {fqdn_services} names checked, a burst of 50 and 3 adds",
        config_text(&data).len(),
        converged_rss >> 20,
        rss >> 20
    );
    let reasons: BTreeSet<String> = events(&fake)
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        reasons,
        BTreeSet::from(["TunnelgateNameUnresolved".to_string()])
    );
    // A debug build takes more memory; the bound is the release build's (the manifests' limit).
    assert!(!TIMED || rss <= 64 << 20, "peak RSS {} MiB", rss >> 20);
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_past_the_size_limit_serves_the_oldest_and_still_applies_changes() {
    let mut next_port = 1024;
    let n = 20_000;
    let services = scale_services(0, n, 0, &mut next_port, true);
    let names: Vec<String> = services
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                s["metadata"]["namespace"].as_str().unwrap_or_default(),
                s["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "scale-over");
    let r0 = replica(&inputs, 0, "a");
    wait_long(&r0, "the first write", || replica_patches(&fake, 0) >= 1).await;
    let data = replica_secret(&fake, 0);
    assert!(secret_size(&data) <= SECRET_LIMIT);
    let served = served_services(&data);
    let k = served.len();
    assert!(k > 1_000 && k < n as usize, "{k} of {n} served");
    // Exactly the k oldest.
    assert_eq!(served, names[..k].iter().cloned().collect::<BTreeSet<_>>());
    eprintln!(
        "past the limit: the {k} oldest of {n} Services served, Secret {} bytes",
        secret_size(&data)
    );
    // A Warning on the pod, then on the Services left out (rate-limited: the first ones).
    wait_long(&r0, "Events", || events(&fake).len() >= 5).await;
    let ev = events(&fake);
    assert_eq!(ev[0]["involvedObject"]["kind"], "Pod");
    assert_eq!(ev[0]["reason"], "TunnelgateConfigOverLimit");
    for e in &ev[1..] {
        assert_eq!(e["reason"], "TunnelgateServiceLeftOut");
        let who = format!(
            "{}/{}",
            e["involvedObject"]["namespace"]
                .as_str()
                .unwrap_or_default(),
            e["involvedObject"]["name"].as_str().unwrap_or_default()
        );
        assert!(!served.contains(&who), "{who} is served and got an Event");
        assert!(
            e["message"].as_str().unwrap_or_default().contains("limit"),
            "{e}"
        );
    }
    // An unrelated change of a served Service is applied.
    let (ns, name) = names[3].split_once('/').expect("NS/NAME");
    let writes = replica_patches(&fake, 0);
    fake.change(
        ns,
        name,
        |s| s["spec"]["clusterIPs"] = json!(["10.99.99.99"]),
        false,
    );
    wait_long(&r0, "the change applied", || {
        replica_patches(&fake, 0) > writes
            && config_text(&replica_secret(&fake, 0)).contains("10.99.99.99")
    })
    .await;
    assert!(secret_size(&replica_secret(&fake, 0)) <= SECRET_LIMIT);
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_deleted_or_edited_is_restored_with_its_key() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "own-secret");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    wait_for(&r0, "the Secret's watch", || {
        !fake.lock().secret_watchers.is_empty()
    })
    .await;
    let first = replica_secret(&fake, 0);

    let deleted = tunnelgate::shell::clock::now();
    fake.delete_secret(NS, "tgp-0");
    wait_for(&r0, "the Secret restored", || {
        replica_secret(&fake, 0) == first
    })
    .await;
    let restored = tunnelgate::shell::clock::since(deleted);
    assert!(
        restored <= Duration::from_secs(3),
        "restored after {restored:?}"
    );

    fake.edit_secret(NS, "tgp-0", "public_key", b"edited");
    wait_for(&r0, "the edit repaired", || {
        replica_secret(&fake, 0) == first
    })
    .await;
    assert_eq!(replica_patches(&fake, 0), 3, "one write per repair");
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_converges_within_5_s_after_a_10_s_api_outage() {
    let mut next_port = 1024;
    let services = scale_services(0, 1_000, 0, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "outage");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    serves(&fake, &r0, 0, 1, 1_000).await;
    serves(&fake, &r1, 1, 1, 1_000).await;

    fake.stop();
    // While it is down, a Service changes and one is added (no watch sees them).
    fake.change(
        "ns-3",
        "svc-3",
        |s| s["spec"]["clusterIPs"] = json!(["10.99.99.99"]),
        true,
    );
    for svc in scale_services(1_000, 1, 0, &mut next_port, false) {
        fake.add(svc, true);
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    fake.restart().await;
    let back = tunnelgate::shell::clock::now();
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        serves(&fake, r, i as u32, 2, 1_001).await;
        assert!(config_text(&replica_secret(&fake, i as u32)).contains("10.99.99.99"));
    }
    let converged = tunnelgate::shell::clock::since(back);
    eprintln!("converged {converged:?} after the API server came back");
    assert!(
        !TIMED || converged <= Duration::from_secs(5),
        "converged {converged:?} after the outage"
    );
    for r in [&r0, &r1] {
        let log = r.log();
        assert!(log.contains("cannot be reached"), "{log}");
        assert!(
            !log.contains("RBAC") && !log.contains("check the Role"),
            "blames RBAC:\n{log}"
        );
    }
    r0.stop();
    r1.stop();
}
