//! The three-namespace topology (client, proxy, backend) and the traffic checks run through it.

use super::*;

pub(crate) fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

pub(crate) fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// The four namespaces and the wireguard-go peer (dropped first: fields drop in order).
pub(crate) struct Topo {
    pub(crate) wg: WgGo,
    pub(crate) client: Netns,
    pub(crate) proxy: Netns,
    pub(crate) cluster: Netns,
    pub(crate) pod: Netns,
    /// proxy end (`a_name`) and cluster end (`b_name`).
    pub(crate) cluster_link: Veth,
}

impl Topo {
    pub(crate) fn new(backend: Backend) -> Topo {
        require_root();
        backend.check_tools();
        let client = Netns::new();
        let proxy = Netns::new();
        let cluster = Netns::new();
        let pod = Netns::new();
        veth(
            &client,
            &[&format!("{CLIENT_UNDERLAY}/24")],
            &proxy,
            &[&format!("{PROXY_UNDERLAY}/24")],
        );
        let cluster_link = veth(
            &proxy,
            &[
                &format!("{PROXY_CLUSTER_V4}/24"),
                &format!("{PROXY_CLUSTER_V6}/64"),
            ],
            &cluster,
            &[&format!("{BACKEND_V4}/24"), &format!("{BACKEND_V6}/64")],
        );
        veth(
            &proxy,
            &[&format!("{PROXY_POD_V4}/24"), &format!("{PROXY_POD_V6}/64")],
            &pod,
            &["10.244.0.2/24", "fd44::2/64"],
        );
        pod.exec(&["ip", "route", "add", "default", "via", PROXY_POD_V4]);
        pod.exec(&["ip", "-6", "route", "add", "default", "via", PROXY_POD_V6]);
        let wg = WgGo::start(
            &client,
            WG_GO_PORT,
            &[&format!("{PEER_V4}/32"), &format!("{PEER_V6}/128")],
        );
        Topo {
            wg,
            client,
            proxy,
            cluster,
            pod,
            cluster_link,
        }
    }

    /// A tunnelgate config for the proxy: its peer is the wireguard-go client; `extra` holds
    /// `[firewall]`, `[[ingress]]`, `[[egress]]`.
    pub(crate) fn config(&self, extra: String) -> TgConfig {
        let mut cfg = TgConfig::new(TG_PORT, &[&format!("{TG_V4}/32"), &format!("{TG_V6}/128")])
            .peer(
                Peer::new(
                    self.wg.public_key(),
                    &[&format!("{PEER_V4}/32"), &format!("{PEER_V6}/128")],
                )
                .endpoint(&format!("{CLIENT_UNDERLAY}:{WG_GO_PORT}")),
            );
        cfg.health = Some(HEALTH.into());
        cfg.extra = extra;
        cfg
    }

    /// Starts tunnelgate with `backend`'s environment and waits until `/readyz` is 200.
    pub(crate) fn start(&self, backend: Backend, cfg: TgConfig) -> Tunnelgate {
        self.start_env(backend, cfg, &[])
    }

    pub(crate) fn start_env(
        &self,
        backend: Backend,
        cfg: TgConfig,
        env: &[(&str, &str)],
    ) -> Tunnelgate {
        let mut all = backend.env();
        all.extend_from_slice(env);
        let tg = Tunnelgate::spawn_env(&self.proxy, cfg, &all);
        if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
            panic!("{e}");
        }
        tg
    }

    /// Points the client at tunnelgate (routes to its tunnel addresses, plus `extra` networks)
    /// and waits until a ping through the tunnel answers: the handshake is done.
    pub(crate) fn connect_client(&self, tg: &Tunnelgate, extra: &[&str]) {
        let mut nets = vec![format!("{TG_V4}/32"), format!("{TG_V6}/128")];
        nets.extend(extra.iter().map(|s| s.to_string()));
        let nets: Vec<&str> = nets.iter().map(String::as_str).collect();
        self.wg.add_peer(
            &Peer::new(tg.public_key(), &nets).endpoint(&format!("{PROXY_UNDERLAY}:{TG_PORT}")),
        );
        assert!(
            ping_until(&self.client, TG_V4, Duration::from_secs(15)),
            "no ping through the tunnel to {TG_V4}; tunnelgate stderr:\n{}",
            tg.stderr()
        );
        assert!(
            ping_until(&self.client, TG_V6, Duration::from_secs(5)),
            "no IPv6 ping through the tunnel to {TG_V6}"
        );
    }
}

/// A TCP echo round trip from `ns` to `to` must succeed.
pub(crate) fn echo_ok(ns: &Netns, to: SocketAddr, what: &str) {
    let payload = format!("tunnelgate test: {what}");
    let mut last = String::new();
    // The first connection may race a handshake: retry briefly.
    let ok = poll_until(Duration::from_secs(5), || {
        match tcp_roundtrip(ns, to, payload.as_bytes(), Duration::from_secs(3)) {
            Ok(back) if back == payload.as_bytes() => true,
            Ok(back) => {
                last = format!("echo returned {:?}", String::from_utf8_lossy(&back));
                false
            }
            Err(e) => {
                last = e;
                false
            }
        }
    });
    assert!(ok, "{what}: TCP echo via {to} failed: {last}");
}

/// A UDP echo round trip from `ns` to `to` must succeed.
pub(crate) fn udp_ok(ns: &Netns, to: SocketAddr, what: &str) {
    let payload = format!("tunnelgate udp test: {what}");
    let reply = udp_roundtrip(ns, to, payload.as_bytes(), Duration::from_secs(5));
    assert_eq!(
        reply.as_deref(),
        Some(payload.as_bytes()),
        "{what}: UDP echo via {to} failed"
    );
}

/// A TCP connection from `ns` to `to` must not get through (refused or timed out).
pub(crate) fn tcp_blocked(ns: &Netns, to: SocketAddr, what: &str) -> String {
    let r = tcp_roundtrip(ns, to, b"must not arrive", BLOCKED);
    assert!(
        r.is_err(),
        "{what}: {to} answered {r:?}, expected no forwarding"
    );
    r.err().unwrap_or_default()
}

/// Every source address `seen` is exactly `want`.
pub(crate) fn all_from(seen: &[SocketAddr], want: &str, what: &str) {
    assert!(!seen.is_empty(), "{what}: the server saw no client");
    for s in seen {
        assert_eq!(
            s.ip(),
            ip(want),
            "{what}: source seen by the server {seen:?}"
        );
    }
}
