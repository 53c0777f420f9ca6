//! Setup helpers: two namespaces on a LAN, a tunnelgate and a wireguard-go peer configured for each other.

use super::*;

/// Two namespaces joined by a veth pair with v4 and v6 underlay addresses.
pub(crate) fn lan() -> (Netns, Netns) {
    let (a, b, _) = lan_veth();
    (a, b)
}

/// [`lan`], and the veth pair (its `a_name` end is in `a`).
pub(crate) fn lan_veth() -> (Netns, Netns, Veth) {
    lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6)
}

pub(crate) fn cidr(ip: &str) -> String {
    if ip.contains(':') {
        format!("{ip}/128")
    } else {
        format!("{ip}/32")
    }
}

/// tunnelgate's config: one peer, the wireguard-go at `b` (no keepalive: idle counters stay
/// still), with an optional preshared key.
pub(crate) fn tg_config(wg_public: &str, psk: Option<&str>) -> TgConfig {
    let mut peer = Peer::new(wg_public, &[&cidr(B_TUN4), &cidr(B_TUN6)])
        .endpoint(&format!("{B_LAN4}:{WG_PORT}"));
    if let Some(psk) = psk {
        peer = peer.preshared_key(psk);
    }
    TgConfig::new(TG_PORT, &[&cidr(A_TUN4), &cidr(A_TUN6)]).peer(peer)
}

/// Tells the wireguard-go in `b` about tunnelgate (endpoint, same preshared key).
pub(crate) fn add_tg_to_wggo(wg: &WgGo, tg_public: &str, psk: Option<&str>) {
    let mut peer = Peer::new(tg_public, &[&cidr(A_TUN4), &cidr(A_TUN6)])
        .endpoint(&format!("{A_LAN4}:{TG_PORT}"));
    if let Some(psk) = psk {
        peer = peer.preshared_key(psk);
    }
    wg.add_peer(&peer);
}

/// Starts tunnelgate with extra arguments and environment and waits until it is ready.
pub(crate) fn start_tg(
    ns: &Netns,
    cfg: TgConfig,
    args: &[&str],
    env: &[(&str, &str)],
) -> Tunnelgate {
    let tg = Tunnelgate::spawn_args_env(ns, cfg, args, env);
    if let Err(e) = tg.wait_ready(SHORT) {
        panic!("{e}");
    }
    tg
}

/// Pings until one answers, panicking with `what` otherwise.
pub(crate) fn must_ping(from: &Netns, to: &str, what: &str) {
    assert!(ping_until(from, to, SHORT), "{what}: ping {to} failed");
}
