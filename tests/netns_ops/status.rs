//! `tunnelgate status --json` matches `wg show dump`.

use super::*;

pub(crate) fn set_of(v: &[String]) -> BTreeSet<String> {
    v.iter().cloned().collect()
}

pub(crate) fn json_strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Differences between a status snapshot and a `wg show dump` of the same interface (empty
/// when they agree). Handshake times may differ by one second (taken at different moments).
pub(crate) fn status_vs_dump(status: &Value, dump: &WgDump) -> Vec<String> {
    let mut diffs = Vec::new();
    let mut diff = |what: String, s: String, w: String| {
        if s != w {
            diffs.push(format!("{what}: status {s}, wg show {w}"));
        }
    };
    diff(
        "public key".into(),
        status["interface"]["public_key"].to_string(),
        Value::from(dump.public_key.clone()).to_string(),
    );
    diff(
        "listen port".into(),
        status["interface"]["listen_port"].to_string(),
        dump.listen_port.to_string(),
    );
    let peers = status["peers"].as_array().cloned().unwrap_or_default();
    let status_keys: BTreeSet<String> = peers
        .iter()
        .filter_map(|p| p["public_key"].as_str().map(String::from))
        .collect();
    let dump_keys: BTreeSet<String> = dump.peers.iter().map(|p| p.public_key.clone()).collect();
    diff(
        "peers".into(),
        format!("{status_keys:?}"),
        format!("{dump_keys:?}"),
    );
    assert_eq!(peers.len(), status_keys.len(), "a peer twice in {status}");
    for w in &dump.peers {
        let Some(s) = peers
            .iter()
            .find(|p| p["public_key"] == w.public_key.as_str())
        else {
            continue;
        };
        let k = &w.public_key[..8];
        diff(
            format!("{k} endpoint"),
            format!("{:?}", s["endpoint"].as_str()),
            format!("{:?}", w.endpoint.as_deref()),
        );
        diff(
            format!("{k} allowed ips"),
            format!("{:?}", set_of(&json_strings(&s["allowed_ips"]))),
            format!("{:?}", set_of(&w.allowed_ips)),
        );
        let shake = s["latest_handshake_unix"].as_u64().unwrap_or(0);
        if shake.abs_diff(w.latest_handshake) > 1 || (shake == 0) != (w.latest_handshake == 0) {
            diff(
                format!("{k} latest handshake (±1 s)"),
                shake.to_string(),
                w.latest_handshake.to_string(),
            );
        }
        diff(
            format!("{k} rx bytes"),
            s["rx_bytes"].to_string(),
            w.rx_bytes.to_string(),
        );
        diff(
            format!("{k} tx bytes"),
            s["tx_bytes"].to_string(),
            w.tx_bytes.to_string(),
        );
        diff(
            format!("{k} persistent keepalive"),
            format!("{:?}", s["persistent_keepalive"].as_u64()),
            format!("{:?}", w.persistent_keepalive.map(u64::from)),
        );
    }
    diffs
}

#[test]
fn status_vs_dump_spots_each_difference() {
    let dump = parse_wg_dump(
        "cHJpdmF0ZQ==\tcHVibGlj\t51820\toff\n\
         cGVlcg==\t(none)\t192.168.70.2:51821\t100.64.0.2/32,fd7a::2/128\t1700000000\t100\t200\t25\n",
    )
    .expect("a dump");
    let good = serde_json::json!({
        "interface": {"public_key": "cHVibGlj", "listen_port": 51820},
        "peers": [{
            "public_key": "cGVlcg==",
            "endpoint": "192.168.70.2:51821",
            "allowed_ips": ["fd7a::2/128", "100.64.0.2/32"],
            "latest_handshake_unix": 1_700_000_001u64,
            "rx_bytes": 100,
            "tx_bytes": 200,
            "persistent_keepalive": 25
        }]
    });
    assert_eq!(status_vs_dump(&good, &dump), Vec::<String>::new());
    for (pointer, bad) in [
        ("/interface/public_key", serde_json::json!("b3RoZXI=")),
        ("/interface/listen_port", serde_json::json!(51821)),
        ("/peers/0/endpoint", serde_json::json!("192.168.70.2:1")),
        ("/peers/0/endpoint", Value::Null),
        ("/peers/0/allowed_ips", serde_json::json!(["100.64.0.2/32"])),
        (
            "/peers/0/latest_handshake_unix",
            serde_json::json!(1_700_000_002u64),
        ),
        ("/peers/0/latest_handshake_unix", Value::Null),
        ("/peers/0/rx_bytes", serde_json::json!(101)),
        ("/peers/0/tx_bytes", serde_json::json!(199)),
        ("/peers/0/persistent_keepalive", Value::Null),
        ("/peers/0/public_key", serde_json::json!("b3RoZXI=")),
    ] {
        let mut status = good.clone();
        *status.pointer_mut(pointer).expect("field") = bad.clone();
        assert!(
            !status_vs_dump(&status, &dump).is_empty(),
            "{pointer} = {bad} not noticed"
        );
    }
}

/// Takes `wg show dump`, the status, and `wg show dump` again until both dumps agree on the
/// counters (nothing moved in between), then compares the status with them; panics with the
/// differences if they never agree within 30 s.
pub(crate) fn assert_status_matches_wg_show(iface: &str, what: &str) -> (Value, WgDump) {
    let counters = |d: &WgDump| -> Vec<(String, u64, u64, u64)> {
        d.peers
            .iter()
            .map(|p| {
                (
                    p.public_key.clone(),
                    p.rx_bytes,
                    p.tx_bytes,
                    p.latest_handshake,
                )
            })
            .collect()
    };
    let deadline = clock::now() + Duration::from_secs(30);
    let mut last = Vec::new();
    loop {
        let before = wg_dump(iface);
        let status = tunnelgate_status_json(iface).unwrap_or_else(|e| panic!("{e}"));
        let after = wg_dump(iface);
        if counters(&before) == counters(&after) {
            let diffs = status_vs_dump(&status, &after);
            if diffs.is_empty() {
                return (status, after);
            }
            last = diffs;
        }
        assert!(
            clock::now() < deadline,
            "{what}: `tunnelgate status --json` and `wg show {iface} dump` never agreed: {last:#?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// After traffic both ways, `tunnelgate status --json` and `wg show NAME dump` (taken back to
/// back, traffic stopped) agree on the interface's public key and listen port and, per peer, on
/// public key, endpoint, allowed IPs (as sets), latest handshake (±1 s), rx and tx bytes and
/// persistent keepalive: for the live wireguard-go peer, a configured peer that never connected
/// (no endpoint, keepalive set) and a peer added with `wg set`. The interface part also matches
/// the kernel (addresses, MTU).
#[test]
#[ignore = "needs root"]
fn status_json_matches_wg_show() {
    let (a, b) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6), "10.77.0.1/24"]);
    let idle = Keypair::generate();
    let mut cfg = tg_config(wg.public_key(), None);
    cfg.peers[0].allowed_ips.push("10.77.0.0/24".into());
    // No endpoint: it never sends anything, so its keepalive cannot move a counter.
    let cfg = cfg.peer(Peer::new(&idle.public, &["100.64.0.9/32", "fd7a::9/128"]).keepalive(25));
    let tg = Tunnelgate::start(&a, cfg);
    let iface = tg.name().to_string();
    add_tg_to_wggo(&wg, tg.public_key(), None);

    // Before any traffic: no handshake anywhere, both views say so.
    let (status, dump) = assert_status_matches_wg_show(&iface, "before traffic");
    assert_eq!(dump.peers.len(), 2);
    assert!(status["peers"]
        .as_array()
        .is_some_and(|p| p.iter().all(|p| p["latest_handshake_unix"].is_null())));

    must_ping(&b, A_TUN4, "wireguard-go -> tunnelgate");
    must_ping(&a, B_TUN6, "tunnelgate -> wireguard-go");
    tcp_transfer(&a, &b, ip_of(B_TUN4), 0, 5 * MB, SHORT).expect("5 MB to the peer");
    tcp_transfer(&b, &a, ip_of(A_TUN6), 0, 3 * MB, SHORT).expect("3 MB from the peer");

    let (status, dump) = assert_status_matches_wg_show(&iface, "after traffic");
    let live = dump.peer(wg.public_key()).expect("the live peer");
    assert!(live.latest_handshake > 0 && live.rx_bytes > 3 * MB && live.tx_bytes > 5 * MB);
    assert_eq!(
        live.endpoint.as_deref(),
        Some(&*format!("{B_LAN4}:{WG_PORT}"))
    );
    let quiet = dump.peer(&idle.public).expect("the idle peer");
    assert_eq!(
        (quiet.latest_handshake, quiet.rx_bytes, quiet.tx_bytes),
        (0, 0, 0)
    );
    assert_eq!(quiet.persistent_keepalive, Some(25));

    // The interface part against the kernel.
    assert_eq!(status["interface"]["name"], iface.as_str());
    assert_eq!(status["interface"]["public_key"], tg.public_key());
    assert_eq!(status["interface"]["listen_port"], TG_PORT);
    let link: Value = serde_json::from_str(&a.exec(&["ip", "-j", "addr", "show", "dev", &iface]))
        .expect("ip -j addr");
    assert_eq!(status["interface"]["mtu"], link[0]["mtu"]);
    let kernel: BTreeSet<String> = link[0]["addr_info"]
        .as_array()
        .expect("addr_info")
        .iter()
        .filter(|a| a["scope"] != "link")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect();
    assert_eq!(
        set_of(&json_strings(&status["interface"]["addresses"])),
        kernel
    );

    // A peer added with `wg set` shows up the same in both views.
    let added = Keypair::generate();
    run(&[
        "wg",
        "set",
        &iface,
        "peer",
        &added.public,
        "endpoint",
        &format!("[{B_LAN6}]:51999"),
        "allowed-ips",
        "100.64.0.40/32,10.88.0.0/16",
    ]);
    let (_, dump) = assert_status_matches_wg_show(&iface, "after wg set");
    assert_eq!(dump.peers.len(), 3);
    let p = dump.peer(&added.public).expect("the added peer");
    assert_eq!(p.endpoint.as_deref(), Some(&*format!("[{B_LAN6}]:51999")));
    assert_eq!(p.allowed_ips.len(), 2);
}
