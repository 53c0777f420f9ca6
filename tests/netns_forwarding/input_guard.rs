//! Issue 15, the input guard: the tunnel reaches no local listener, per backend.

use super::*;

/// With the health endpoint on every address (`[::]:9002`) and ingress on one port, a tunnel
/// peer reaches neither `/metrics` nor any other TCP or UDP listener of the proxy host, on
/// either family, while ingress, ping, the host's own `/readyz` and the host's own
/// connections through the tunnel keep working. `health.allow_from_tunnel = true`, applied
/// by a reload, opens the health port to the tunnel: the blocked requests were real ones.
pub(crate) fn tunnel_reaches_no_local_listener(backend: Backend) {
    let t = Topo::new(backend);
    let body = format!(
        "{}\n{}",
        firewall_toml(backend, "10s"),
        ingress_toml(&["7000"])
    );
    let mut tg = t.start(backend, t.config(body));
    let ingress4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 7000));
    let _ingress6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 7000));
    // Listeners of the proxy host itself, on every address.
    let _local_tcp4 = TcpEcho::start(&t.proxy, sa("0.0.0.0", 7001));
    let _local_tcp6 = TcpEcho::start(&t.proxy, sa("::", 7002));
    let _local_udp4 = UdpEcho::start(&t.proxy, sa("0.0.0.0", 5301));
    let _local_udp6 = UdpEcho::start(&t.proxy, sa("::", 5302));
    // A server on the peer's side, for the proxy host's own connection through the tunnel.
    let _peer_server = TcpEcho::start(&t.client, sa(PEER_V4, 7100));
    // The peer may also send to the proxy's cluster-side address through the tunnel.
    t.connect_client(&tg, &[&format!("{PROXY_CLUSTER_V4}/32")]);

    echo_ok(&t.client, sa(TG_V4, 7000), "ingress v4 still works");
    echo_ok(&t.client, sa(TG_V6, 7000), "ingress v6 still works");
    all_from(&ingress4.seen(), PROXY_CLUSTER_V4, "v4 ingress backend");
    echo_ok(
        &t.proxy,
        sa(PEER_V4, 7100),
        "the host's own connection through the tunnel",
    );
    assert_eq!(
        tg.health_get("/readyz").map(|(s, _)| s),
        Ok(200),
        "the host's own /readyz"
    );
    // The host's own /metrics on its tunnel address works too (from the host, not the tunnel).
    let own = http_get_in(t.proxy.name(), sa(TG_V4, HEALTH_PORT), "/metrics", BLOCKED);
    assert_eq!(
        own.map(|(s, _)| s),
        Ok(200),
        "/metrics from the host itself"
    );

    for to in [
        sa(TG_V4, HEALTH_PORT),
        sa(TG_V6, HEALTH_PORT),
        sa(PROXY_CLUSTER_V4, HEALTH_PORT),
    ] {
        let r = http_get_in(t.client.name(), to, "/metrics", BLOCKED);
        assert!(
            r.is_err(),
            "a tunnel peer fetched http://{to}/metrics: {r:?}"
        );
    }
    tcp_blocked(&t.client, sa(TG_V4, 7001), "local tcp listener, v4");
    tcp_blocked(&t.client, sa(TG_V6, 7002), "local tcp listener, v6");
    for to in [sa(TG_V4, 5301), sa(TG_V6, 5302)] {
        let r = udp_roundtrip(&t.client, to, b"must not arrive", BLOCKED);
        assert_eq!(r, None, "local udp listener {to} answered the tunnel");
    }
    // Replies and ICMP still pass: a ping through the tunnel answers.
    assert!(ping(&t.client, TG_V4), "ping v4 through the tunnel");
    assert!(ping(&t.client, TG_V6), "ping v6 through the tunnel");

    // On purpose: the switch opens the health port to the tunnel, after a reload.
    let text = tg.cfg.render("private.key");
    assert!(text.contains("[health]\n"), "{text}");
    tg.write_config_text(&text.replace("[health]\n", "[health]\nallow_from_tunnel = true\n"));
    tg.sighup();
    let mut last = String::new();
    let opened = poll_until(Duration::from_secs(10), || {
        match http_get_in(t.client.name(), sa(TG_V4, HEALTH_PORT), "/metrics", BLOCKED) {
            Ok((200, _)) => true,
            other => {
                last = format!("{other:?}");
                false
            }
        }
    });
    assert!(
        opened,
        "allow_from_tunnel did not open /metrics to the tunnel: {last}\n{}",
        tg.stderr()
    );
    echo_ok(&t.client, sa(TG_V4, 7000), "ingress after the reload");
}
