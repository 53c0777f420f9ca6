//! Helpers: namespaces, peers and daemons set up for the tunnel tests.

use super::*;

/// Two namespaces joined by a veth pair with v4 and v6 underlay addresses.
pub(crate) fn lan() -> (Netns, Netns) {
    let (a, b, _) = lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6);
    (a, b)
}

pub(crate) fn cidr(ip: &str) -> String {
    if ip.contains(':') {
        format!("{ip}/128")
    } else {
        format!("{ip}/32")
    }
}

/// tunnelgate's config in `a` with one peer: the wireguard-go (or tunnelgate) at `b`'s
/// underlay address on `peer_port`.
pub(crate) fn tg_config(peer_public: &str, peer_port: u16) -> TgConfig {
    TgConfig::new(TG_PORT, &[&cidr(A_TUN4), &cidr(A_TUN6)]).peer(
        Peer::new(peer_public, &[&cidr(B_TUN4), &cidr(B_TUN6)])
            .endpoint(&format!("{B_LAN4}:{peer_port}")),
    )
}

/// A wireguard-go in `b` and tunnelgate in `a`, each configured with the other, endpoints
/// both ways.
pub(crate) fn tg_and_wggo(a: &Netns, b: &Netns) -> (Tunnelgate, WgGo) {
    let wg = WgGo::start(b, WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6)]);
    let tg = Tunnelgate::start(a, tg_config(wg.public_key(), WG_PORT));
    wg.add_peer(
        &Peer::new(tg.public_key(), &[&cidr(A_TUN4), &cidr(A_TUN6)])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    (tg, wg)
}

/// Pings both ways over both families; the first ping may wait for the handshake.
pub(crate) fn assert_pings_both_ways(a: &Netns, b: &Netns, what: &str) {
    for (from, to, label) in [
        (a, B_TUN4, "a -> b v4"),
        (b, A_TUN4, "b -> a v4"),
        (a, B_TUN6, "a -> b v6"),
        (b, A_TUN6, "b -> a v6"),
    ] {
        assert!(
            ping_until(from, to, SHORT),
            "{what}: tunnel ping {label} ({to}) failed"
        );
    }
}

/// One tunnel ping attempt per second for `tries` seconds; true if any answered.
pub(crate) fn any_ping(ns: &Netns, to: &str, tries: u32) -> bool {
    (0..tries).any(|_| ping(ns, to))
}

/// `ping -I SRC` (the inner source address) once, 1 s timeout.
pub(crate) fn ping_from(ns: &Netns, src: &str, to: &str) -> bool {
    ns.output(&["ping", "-n", "-q", "-c", "1", "-W", "1", "-I", src, to])
        .success()
}

/// `tunnelgate_packets_dropped_total{reason="REASON"}` from tunnelgate's /metrics.
pub(crate) fn dropped(tg: &Tunnelgate, reason: &str) -> u64 {
    let body = tg.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    let labels = format!("reason=\"{reason}\"");
    metric(&body, "tunnelgate_packets_dropped_total", &labels)
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no series of {labels} in /metrics:\n{body}"))
}

/// `ip rule` and `ip -6 rule` of a namespace.
pub(crate) fn ip_rules(ns: &Netns) -> (String, String) {
    (
        ns.exec(&["ip", "rule", "show"]),
        ns.exec(&["ip", "-6", "rule", "show"]),
    )
}

/// Every route of every table, both families (what must be restored after a stop), minus
/// the local routes of IPv6 link-local addresses, which the kernel adds on its own schedule.
pub(crate) fn all_routes(ns: &Netns) -> String {
    ns.routes()
        .lines()
        .filter(|l| !l.starts_with("local fe80:"))
        .map(|l| format!("{}\n", l.trim_end()))
        .collect()
}

/// The UDP ports something listens on in `ns` (from /proc/net/udp and udp6).
pub(crate) fn udp_ports(ns: &Netns) -> Vec<u16> {
    let mut ports = Vec::new();
    for file in ["/proc/net/udp", "/proc/net/udp6"] {
        for line in ns.exec(&["cat", file]).lines().skip(1) {
            let local = line.split_whitespace().nth(1).unwrap_or("");
            if let Some((_, port)) = local.rsplit_once(':') {
                if let Ok(p) = u16::from_str_radix(port, 16) {
                    ports.push(p);
                }
            }
        }
    }
    ports
}

/// One UAPI request on a fresh connection; the reply up to the empty line, or what came
/// before the daemon closed the connection.
pub(crate) fn uapi_request(iface: &str, request: &[u8]) -> String {
    let mut s = UnixStream::connect(wg_socket(iface)).expect("connect to the UAPI socket");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.set_write_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // The daemon may answer (and close) before reading everything of a huge request.
    let _ = s.write_all(request);
    read_reply(&mut s)
}

pub(crate) fn read_reply(s: &mut UnixStream) -> String {
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while !(reply.ends_with(b"\n\n") || reply == b"\n") {
        match s.read(&mut byte) {
            Ok(1) => reply.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&reply).into_owned()
}

/// The errno of a UAPI reply (`errno=N` line).
pub(crate) fn errno_of(reply: &str) -> Option<i64> {
    reply
        .lines()
        .find_map(|l| l.strip_prefix("errno="))
        .and_then(|v| v.trim().parse().ok())
}

/// The `wg show IFACE` text (via the UAPI socket, from the root namespace).
pub(crate) fn wg_show(iface: &str) -> String {
    run(&["wg", "show", iface])
}
