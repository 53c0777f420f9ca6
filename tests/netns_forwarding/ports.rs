//! Ingress on all or mapped ports and egress on listed or all ports, per backend.

use super::*;

/// From the tunnel, any TCP or UDP port of tunnelgate's tunnel address (v4 and v6) reaches the
/// backend in the cluster, which sees the proxy's cluster-side address (masquerade).
pub(crate) fn ingress_all_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            ingress_toml(&[])
        )),
    );
    let tcp4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 7000));
    let tcp4b = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 22222));
    let tcp6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 7000));
    let udp4 = UdpEcho::start(&t.cluster, sa(BACKEND_V4, 5353));
    let udp6 = UdpEcho::start(&t.cluster, sa(BACKEND_V6, 5353));
    t.connect_client(&tg, &[]);

    echo_ok(&t.client, sa(TG_V4, 7000), "ingress v4 tcp 7000");
    echo_ok(&t.client, sa(TG_V4, 22222), "ingress v4 tcp 22222");
    echo_ok(&t.client, sa(TG_V6, 7000), "ingress v6 tcp 7000");
    udp_ok(&t.client, sa(TG_V4, 5353), "ingress v4 udp 5353");
    udp_ok(&t.client, sa(TG_V6, 5353), "ingress v6 udp 5353");

    all_from(&tcp4.seen(), PROXY_CLUSTER_V4, "v4 tcp backend");
    all_from(&tcp4b.seen(), PROXY_CLUSTER_V4, "v4 tcp backend, 2nd port");
    all_from(&tcp6.seen(), PROXY_CLUSTER_V6, "v6 tcp backend");
    all_from(&udp4.seen(), PROXY_CLUSTER_V4, "v4 udp backend");
    all_from(&udp6.seen(), PROXY_CLUSTER_V6, "v6 udp backend");
    drop(tg);
}

/// `ports = ["443:8443", "53/udp"]`: 443 reaches the backend's 8443, UDP 53 its 53; port 80,
/// TCP 53 and 8443 on the tunnel address are not forwarded, and neither is traffic from the
/// tunnel straight to the cluster network.
pub(crate) fn ingress_mapped_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            ingress_toml(&["443:8443", "53/udp"])
        )),
    );
    let https4 = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 8443));
    let https6 = TcpEcho::start(&t.cluster, sa(BACKEND_V6, 8443));
    let dns4 = UdpEcho::start(&t.cluster, sa(BACKEND_V4, 53));
    let dns6 = UdpEcho::start(&t.cluster, sa(BACKEND_V6, 53));
    let decoys: Vec<TcpEcho> = [
        sa(BACKEND_V4, 80),
        sa(BACKEND_V6, 80),
        sa(BACKEND_V4, 443),
        sa(BACKEND_V6, 443),
        sa(BACKEND_V4, 53),
    ]
    .into_iter()
    .map(|a| TcpEcho::start(&t.cluster, a))
    .collect();
    // The client may also send to the cluster network through the tunnel: only the listed
    // ports of tunnelgate's own address may be forwarded.
    t.connect_client(&tg, &["10.96.0.0/24", "fd96::/64"]);

    echo_ok(&t.client, sa(TG_V4, 443), "ingress v4 443 -> 8443");
    echo_ok(&t.client, sa(TG_V6, 443), "ingress v6 443 -> 8443");
    udp_ok(&t.client, sa(TG_V4, 53), "ingress v4 udp 53");
    udp_ok(&t.client, sa(TG_V6, 53), "ingress v6 udp 53");
    all_from(&https4.seen(), PROXY_CLUSTER_V4, "v4 backend 8443");
    all_from(&https6.seen(), PROXY_CLUSTER_V6, "v6 backend 8443");
    all_from(&dns4.seen(), PROXY_CLUSTER_V4, "v4 backend udp 53");
    all_from(&dns6.seen(), PROXY_CLUSTER_V6, "v6 backend udp 53");

    let started = clock::now();
    tcp_blocked(&t.client, sa(TG_V4, 80), "unlisted v4 port 80");
    tcp_blocked(&t.client, sa(TG_V6, 80), "unlisted v6 port 80");
    tcp_blocked(
        &t.client,
        sa(TG_V4, 8443),
        "v4 target port 8443 is not a listen port",
    );
    tcp_blocked(
        &t.client,
        sa(TG_V4, 53),
        "v4 TCP 53 (only UDP 53 is listed)",
    );
    assert!(
        tunnelgate::shell::clock::since(started) < BLOCKED * 2,
        "unlisted ports on tunnelgate's own address should fail fast (refused), took {:?}",
        tunnelgate::shell::clock::since(started)
    );
    // Routed into the tunnel by the client, dropped by the proxy (not unroutable).
    let e = tcp_blocked(
        &t.client,
        sa(BACKEND_V4, 8443),
        "tunnel -> cluster v4, not DNATed",
    );
    assert!(
        e.contains("timed out"),
        "tunnel -> cluster v4: expected a drop, got {e}"
    );
    // Routed into the tunnel by the client, dropped by the proxy (not unroutable).
    let e = tcp_blocked(
        &t.client,
        sa(BACKEND_V6, 8443),
        "tunnel -> cluster v6, not DNATed",
    );
    assert!(
        e.contains("timed out"),
        "tunnel -> cluster v6: expected a drop, got {e}"
    );
    for d in &decoys {
        assert!(
            d.seen().is_empty(),
            "{} got connections {:?}: an unlisted port was forwarded",
            d.addr(),
            d.seen()
        );
    }
    assert_eq!(
        https4.seen().len(),
        1,
        "only the DNATed v4 connection reached 8443"
    );
    assert_eq!(
        https6.seen().len(),
        1,
        "only the DNATed v6 connection reached 8443"
    );
    drop(tg);
}

/// `GET /healthz` on the pod-side address answers tunnelgate's own "ok".
pub(crate) fn health_answers_locally(t: &Topo, addr: SocketAddr) {
    let r = http_get_ns(&t.pod, addr, "/healthz");
    assert_eq!(
        r,
        Ok((200, "ok\n".to_string())),
        "GET /healthz on {addr} from the pod must be answered by tunnelgate itself"
    );
}

/// `ports = ["5432", "8080:80"]`: a pod reaches the server on the wireguard-go peer's tunnel
/// address through the proxy's pod-side address (v4 and v6), the server sees tunnelgate's
/// tunnel address; other ports are not captured and the health port answers locally.
pub(crate) fn egress_listed_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            egress_toml(&["5432", "8080:80"])
        )),
    );
    let pg4 = TcpEcho::start(&t.client, sa(PEER_V4, 5432));
    let pg6 = TcpEcho::start(&t.client, sa(PEER_V6, 5432));
    let web4 = TcpEcho::start(&t.client, sa(PEER_V4, 80));
    let web6 = TcpEcho::start(&t.client, sa(PEER_V6, 80));
    let decoys: Vec<TcpEcho> = [
        sa(PEER_V4, 9999),
        sa(PEER_V4, HEALTH_PORT),
        sa(PEER_V6, 8080),
    ]
    .into_iter()
    .map(|a| TcpEcho::start(&t.client, a))
    .collect();
    t.connect_client(&tg, &[]);

    echo_ok(&t.pod, sa(PROXY_POD_V4, 5432), "egress v4 5432");
    echo_ok(&t.pod, sa(PROXY_POD_V4, 8080), "egress v4 8080 -> 80");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 5432), "egress v6 5432");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 8080), "egress v6 8080 -> 80");
    all_from(&pg4.seen(), TG_V4, "v4 server on 5432");
    all_from(&web4.seen(), TG_V4, "v4 server on 80");
    all_from(&pg6.seen(), TG_V6, "v6 server on 5432");
    all_from(&web6.seen(), TG_V6, "v6 server on 80");

    tcp_blocked(&t.pod, sa(PROXY_POD_V4, 9999), "unlisted egress port 9999");
    health_answers_locally(&t, sa(PROXY_POD_V4, HEALTH_PORT));
    health_answers_locally(&t, sa(PROXY_POD_V6, HEALTH_PORT));
    for d in &decoys {
        assert!(
            d.seen().is_empty(),
            "{} got connections {:?}: egress captured a port it does not list",
            d.addr(),
            d.seen()
        );
    }
    drop(tg);
}

/// Egress without `ports` owns every port of the pod-side address, except the daemon's own:
/// the health port still answers locally (a decoy on the peer's address stays untouched) and the
/// WireGuard port still takes the client's handshake (otherwise the tunnel would not come up).
pub(crate) fn egress_all_ports_spares_daemon_ports(backend: Backend) {
    let t = Topo::new(backend);
    let tg = t.start(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "10s"),
            egress_toml(&[])
        )),
    );
    let decoy4 = TcpEcho::start(&t.client, sa(PEER_V4, HEALTH_PORT));
    let decoy6 = TcpEcho::start(&t.client, sa(PEER_V6, HEALTH_PORT));
    let tcp4 = TcpEcho::start(&t.client, sa(PEER_V4, 7000));
    let tcp6 = TcpEcho::start(&t.client, sa(PEER_V6, 7000));
    let udp4 = UdpEcho::start(&t.client, sa(PEER_V4, 5353));
    let udp6 = UdpEcho::start(&t.client, sa(PEER_V6, 5353));
    // The client initiates the handshake to the proxy's underlay address: a packet from a
    // non-tunnel interface to a local address, i.e. exactly what egress captures, unless the
    // WireGuard port is exempt.
    t.connect_client(&tg, &[]);

    echo_ok(&t.pod, sa(PROXY_POD_V4, 7000), "egress v4 tcp, all ports");
    echo_ok(&t.pod, sa(PROXY_POD_V6, 7000), "egress v6 tcp, all ports");
    udp_ok(&t.pod, sa(PROXY_POD_V4, 5353), "egress v4 udp, all ports");
    udp_ok(&t.pod, sa(PROXY_POD_V6, 5353), "egress v6 udp, all ports");
    all_from(&tcp4.seen(), TG_V4, "v4 tcp server");
    all_from(&tcp6.seen(), TG_V6, "v6 tcp server");
    all_from(&udp4.seen(), TG_V4, "v4 udp server");
    all_from(&udp6.seen(), TG_V6, "v6 udp server");

    health_answers_locally(&t, sa(PROXY_POD_V4, HEALTH_PORT));
    health_answers_locally(&t, sa(PROXY_POD_V6, HEALTH_PORT));
    assert!(
        decoy4.seen().is_empty() && decoy6.seen().is_empty(),
        "the health port was redirected to the peer: {:?} {:?}",
        decoy4.seen(),
        decoy6.seen()
    );
    // Loopback on the proxy is never captured either.
    assert_eq!(
        http_get_ns(&t.proxy, sa("127.0.0.1", HEALTH_PORT), "/healthz"),
        Ok((200, "ok\n".to_string()))
    );
    drop(tg);
}
