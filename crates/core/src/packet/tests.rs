//! The packet decisions against real boringtun sessions and a fake peer table: every drop
//! reason, a handshake answered, delivery, and roaming only on authenticated datagrams.

use super::*;
use crate::allowed_ips::AllowedIps;
use crate::config::IpNet;
use crate::test_util::{ipv4_packet, rng, rng_mut};
use crate::wg::Tunnel;

/// Our side of the tunnel ("local", the daemon) and one remote peer, with real keys.
struct Setup {
    own_private: SecretKey,
    own_public: PublicKey,
    limiter: Limiter,
    peers: FakePeers,
    /// The local session with the remote peer (peer 0 of `peers`).
    local: Tunnel,
    /// The remote peer's own session with us.
    remote: Tunnel,
}

/// Peers are numbers; peer 0 is the remote of [`Setup`], peer 1 owns [`OTHER_PEER_IP`].
struct FakePeers {
    ids: [usize; 2],
    keys: [PublicKey; 2],
    indices: [u32; 2],
    routes: AllowedIps<usize>,
}

impl PeerLookup for FakePeers {
    type Peer = usize;
    fn by_key(&self, key: &PublicKey) -> Option<&usize> {
        self.keys
            .iter()
            .position(|k| k == key)
            .map(|i| &self.ids[i])
    }
    fn by_index(&self, index: u32) -> Option<&usize> {
        self.indices
            .iter()
            .position(|&i| i == index)
            .map(|i| &self.ids[i])
    }
    fn by_address(&self, addr: IpAddr) -> Option<&usize> {
        self.routes.lookup(addr)
    }
    fn same(a: &usize, b: &usize) -> bool {
        a == b
    }
}

const LOCAL_INDEX: u32 = 7;
const REMOTE_IP: [u8; 4] = [10, 0, 0, 2];
const OTHER_PEER_IP: [u8; 4] = [10, 0, 0, 3];
const LOCAL_IP: [u8; 4] = [10, 0, 0, 1];

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("network")
}

fn setup() -> Setup {
    let own_private = SecretKey::generate();
    let own_public = own_private.public_key();
    let remote_private = SecretKey::generate();
    let other = SecretKey::generate().public_key();
    let limiter = Limiter::new(&own_public, &mut rng_mut());
    let remote_limiter = Limiter::new(&remote_private.public_key(), &mut rng_mut());
    let mut routes = AllowedIps::default();
    routes.insert(net("10.0.0.2/32"), 0);
    routes.insert(net("10.0.0.3/32"), 1);
    let local = Tunnel::new(
        &own_private,
        &remote_private.public_key(),
        None,
        None,
        LOCAL_INDEX,
        &limiter,
        rng(),
    );
    let remote = Tunnel::new(
        &remote_private,
        &own_public,
        None,
        None,
        99,
        &remote_limiter,
        rng(),
    );
    Setup {
        peers: FakePeers {
            ids: [0, 1],
            keys: [remote_private.public_key(), other],
            indices: [LOCAL_INDEX, LOCAL_INDEX + 1],
            routes,
        },
        own_private,
        own_public,
        limiter,
        local,
        remote,
    }
}

impl Setup {
    /// Runs `datagram` from `from` through identify and decapsulate, as the UDP loop does.
    fn receive(&mut self, from: SocketAddr, datagram: &[u8], landing: &mut [u8]) -> Received {
        let mut cookie = [0u8; 64];
        let sender = identify(
            &self.peers,
            &self.limiter,
            &self.own_private,
            &self.own_public,
            from,
            datagram,
            &mut cookie,
        );
        let peer = match sender {
            Ok(Sender::Peer(p)) => *p,
            other => panic!("datagram not attributed to a peer: {other:?}"),
        };
        assert_eq!(peer, 0, "attributed to the wrong peer");
        decapsulate(&self.peers, &0, &mut self.local, from, datagram, landing)
    }

    /// The remote initiates; we answer; the remote's first data message confirms the session.
    /// Returns that first data message's decision.
    fn handshake(&mut self, from: SocketAddr) -> Received {
        let mut buf = vec![0u8; 2048];
        let mut landing = vec![0u8; 2048];
        let init = match self.remote.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("no initiation: {other:?}"),
        };
        let received = self.receive(from, &init, &mut landing);
        let Inbound::Reply(len) = received.action else {
            panic!("initiation not answered: {received:?}");
        };
        let response = landing[..len].to_vec();
        let _ = self.remote.decapsulate(from.ip(), &response, &mut buf);
        let data = self.remote_data(REMOTE_IP, b"first");
        self.receive(from, &data, &mut landing)
    }

    /// A data message from the remote carrying a packet with inner source `src`.
    fn remote_data(&mut self, src: [u8; 4], payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0u8; 2048];
        let packet = ipv4_packet(src, LOCAL_IP, payload);
        match self.remote.encapsulate(&packet, &mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("remote could not encrypt: {other:?}"),
        }
    }
}

#[test]
fn a_received_datagram_dropped_counts_its_packet_and_its_bytes() {
    let counters = DropCounters::default();
    counters.add_received(DropReason::Aqm, 1452);
    counters.add_received(DropReason::Aqm, 600);
    counters.add(DropReason::NoPeer, 3);
    let stats = counters.snapshot();
    let aqm = DropReason::Aqm as usize;
    assert_eq!((stats.aqm, stats.received_bytes[aqm]), (2, 2052));
    assert_eq!(stats.received_bytes_by_reason()[aqm], ("aqm", 2052));
    // A packet from the TUN device has no received bytes.
    assert_eq!(
        (
            stats.no_peer,
            stats.received_bytes[DropReason::NoPeer as usize]
        ),
        (3, 0)
    );
    let json = serde_json::to_value(stats).expect("json");
    assert_eq!(json["received_bytes"][aqm], 2052);
}

#[test]
fn reasons_have_a_fixed_order_and_their_labels_are_the_json_fields() {
    let counters = DropCounters::default();
    for (i, reason) in DropReason::ALL.into_iter().enumerate() {
        assert_eq!(DropReason::ALL[reason as usize], reason);
        counters.add(reason, i as u64 + 1);
    }
    let stats = counters.snapshot();
    let json = serde_json::to_value(stats).expect("json");
    let fields = json.as_object().expect("object");
    // One field per reason, and the received bytes dropped, by reason in the same order.
    assert_eq!(fields.len(), DropReason::COUNT + 1);
    for (i, (label, count)) in stats.by_reason().into_iter().enumerate() {
        assert_eq!(label, DropReason::ALL[i].label());
        assert_eq!(count, i as u64 + 1, "{label}");
        assert_eq!(
            fields.get(label),
            Some(&serde_json::json!(count)),
            "{label}"
        );
    }
    assert_eq!(
        stats.by_reason().map(|(l, _)| l),
        [
            "no_peer",
            "no_endpoint",
            "bad_source",
            "invalid",
            "unknown_peer",
            "tun_read",
            "tun_write",
            "udp_send",
            "link_local_multicast",
            "aqm",
            "handshake_queue_full",
            "handshake_limited"
        ]
    );
}

/// An IPv6 packet of `next_header` (58: ICMPv6, 0: hop-by-hop as MLD uses) with `payload`.
fn ipv6_packet(src: &str, dst: &str, next_header: u8, payload: &[u8]) -> Vec<u8> {
    let src: std::net::Ipv6Addr = src.parse().expect("source");
    let dst: std::net::Ipv6Addr = dst.parse().expect("destination");
    let mut p = vec![0u8; 40];
    p[0] = 0x60;
    let len = u16::try_from(payload.len()).expect("small packet");
    p[4..6].copy_from_slice(&len.to_be_bytes());
    p[6] = next_header;
    p[7] = 255;
    p[8..24].copy_from_slice(&src.octets());
    p[24..40].copy_from_slice(&dst.octets());
    p.extend_from_slice(payload);
    p
}

#[test]
fn the_kernels_link_chatter_is_not_a_no_peer_drop() {
    let s = setup();
    // What an idle TUN device with IPv6 sends: a router solicitation (ICMPv6 133) to all
    // routers, an MLDv2 report (143, behind a hop-by-hop router alert) to ff02::16, a duplicate
    // address detection probe (135) from :: to a solicited-node group.
    let kernel = [
        ipv6_packet("fe80::1", "ff02::2", 58, &[133, 0, 0, 0, 0, 0, 0, 0]),
        ipv6_packet("fe80::1", "ff02::16", 0, &[58, 0, 5, 2, 0, 0, 1, 0, 143]),
        ipv6_packet("::", "ff02::1:ff00:1", 58, &[135, 0, 0, 0]),
        // Interface-local scope, and IPv4's local network control block (IGMP, mDNS).
        ipv6_packet("fe80::1", "ff01::1", 58, &[130]),
        ipv4_packet([100, 64, 0, 1], [224, 0, 0, 22], b"igmp"),
        ipv4_packet([100, 64, 0, 1], [224, 0, 0, 251], b"mdns"),
    ];
    for packet in &kernel {
        assert_eq!(
            route_read(&s.peers, packet),
            Err(DropReason::LinkLocalMulticast),
            "{packet:02x?}"
        );
        assert_eq!(unsendable_read(packet), DropReason::LinkLocalMulticast);
    }
    // Traffic that was meant to go somewhere stays a no_peer drop: unicast of any scope,
    // and multicast of a wider scope (site ff05::, global ff0e::, IPv4 beyond 224.0.0.0/24),
    // which a peer could carry.
    let user = [
        ipv6_packet("fd00::1", "fd00::9", 58, &[128]),
        ipv6_packet("fe80::1", "fe80::2", 58, &[133]),
        ipv6_packet("fd00::1", "ff05::2", 58, &[143]),
        ipv6_packet("fd00::1", "ff0e::1", 17, b"x"),
        ipv6_packet("fd00::1", "ff15::1", 17, b"x"),
        ipv4_packet([100, 64, 0, 1], [224, 0, 1, 1], b"ntp"),
        ipv4_packet([100, 64, 0, 1], [239, 1, 1, 1], b"x"),
        ipv4_packet([100, 64, 0, 1], [192, 0, 2, 9], b"x"),
    ];
    for packet in &user {
        assert_eq!(
            route_read(&s.peers, packet),
            Err(DropReason::NoPeer),
            "{packet:02x?}"
        );
        assert_eq!(unsendable_read(packet), DropReason::NoPeer);
    }
    assert_eq!(unsendable_read(&[0x60, 0, 0]), DropReason::TunRead);
}

#[test]
fn a_peer_that_covers_a_link_local_group_gets_its_packets() {
    let mut s = setup();
    s.peers.routes.insert(net("ff02::/16"), 1);
    let rs = ipv6_packet("fe80::1", "ff02::2", 58, &[133, 0, 0, 0]);
    assert_eq!(route_read(&s.peers, &rs), Ok(&1));
}

#[test]
fn a_read_for_an_address_no_peer_covers_is_dropped_as_no_peer() {
    let s = setup();
    let to_remote = ipv4_packet(LOCAL_IP, REMOTE_IP, b"x");
    assert_eq!(route_read(&s.peers, &to_remote), Ok(&0));
    let nowhere = ipv4_packet(LOCAL_IP, [192, 0, 2, 9], b"x");
    assert_eq!(route_read(&s.peers, &nowhere), Err(DropReason::NoPeer));
    assert_eq!(
        route_read(&s.peers, &[0x45, 0, 0]),
        Err(DropReason::TunRead)
    );
}

#[test]
fn a_packet_for_a_peer_without_endpoint_is_dropped_as_no_endpoint() {
    let mut s = setup();
    let packet = ipv4_packet(LOCAL_IP, REMOTE_IP, b"x");
    let mut out = vec![0u8; 2048];
    // No session yet: the packet waits in the queue and a handshake initiation comes out,
    // which has nowhere to go.
    assert_eq!(
        encapsulate(&mut s.local, None, &packet, &mut out),
        Outbound::Drop(DropReason::NoEndpoint)
    );
    // The handshake is under way now: the next packet just waits for it.
    assert_eq!(
        encapsulate(&mut s.local, None, &packet, &mut out),
        Outbound::Nothing
    );
    // With an endpoint, the same first packet sends the initiation there.
    let mut s = setup();
    let to = PeerPath {
        remote: addr("192.0.2.7:51820"),
        local: Some("192.0.2.1".parse().expect("ip")),
    };
    assert_eq!(
        encapsulate(&mut s.local, Some(to), &packet, &mut out),
        Outbound::Send {
            len: wg::MIN_OUTPUT,
            to
        }
    );
}

#[test]
fn a_handshake_initiation_is_answered_and_data_is_delivered() {
    let mut s = setup();
    let from = addr("192.0.2.1:4000");
    let first = s.handshake(from);
    let expected = ipv4_packet(REMOTE_IP, LOCAL_IP, b"first");
    assert_eq!(
        first,
        Received {
            action: Inbound::Deliver(expected.len()),
            authenticated: true
        }
    );
    // Once the session is up, our own packets go out as data messages.
    let mut out = vec![0u8; 2048];
    let packet = ipv4_packet(LOCAL_IP, REMOTE_IP, b"reply");
    assert_eq!(
        encapsulate(&mut s.local, Some(PeerPath::to(from)), &packet, &mut out),
        Outbound::Send {
            len: packet.len() + wg::OVERHEAD,
            to: PeerPath::to(from)
        }
    );
}

#[test]
fn an_inner_source_outside_the_senders_allowed_ips_is_dropped_as_bad_source() {
    let mut s = setup();
    let from = addr("192.0.2.1:4000");
    s.handshake(from);
    let mut landing = vec![0u8; 2048];
    // Covered by another peer's allowed IPs, and by nobody's.
    for src in [OTHER_PEER_IP, [198, 51, 100, 1]] {
        let data = s.remote_data(src, b"spoofed");
        assert_eq!(
            s.receive(from, &data, &mut landing),
            Received {
                action: Inbound::Drop(DropReason::BadSource),
                authenticated: true
            },
            "source {src:?}"
        );
    }
}

#[test]
fn garbage_and_replays_are_dropped_as_invalid_and_never_authenticated() {
    let mut s = setup();
    let from = addr("192.0.2.1:4000");
    let mut cookie = [0u8; 64];
    for garbage in [
        &b""[..],
        &[0xffu8; 200][..],
        &[1u8; 148][..],
        &[4u8; 64][..],
    ] {
        let got = identify(
            &s.peers,
            &s.limiter,
            &s.own_private,
            &s.own_public,
            from,
            garbage,
            &mut cookie,
        );
        assert_eq!(got, Err(DropReason::Invalid), "{garbage:?}");
    }
    s.handshake(from);
    let data = s.remote_data(REMOTE_IP, b"once");
    let mut landing = vec![0u8; 2048];
    assert!(matches!(
        s.receive(from, &data, &mut landing).action,
        Inbound::Deliver(_)
    ));
    assert_eq!(
        s.receive(from, &data, &mut landing),
        Received {
            action: Inbound::Drop(DropReason::Invalid),
            authenticated: false
        }
    );
    // A data message naming our peer's index but made up: fails authentication.
    let mut forged = data.clone();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    assert!(!s.receive(from, &forged, &mut landing).authenticated);
}

#[test]
fn an_unknown_key_or_session_index_is_dropped_as_unknown_peer() {
    let s = setup();
    let from = addr("192.0.2.1:4000");
    let mut cookie = [0u8; 64];
    let mut buf = vec![0u8; 2048];
    // A well-formed initiation from a key that is not configured.
    let stranger = SecretKey::generate();
    let mut stranger_tunnel = Tunnel::new(
        &stranger,
        &s.own_public,
        None,
        None,
        5,
        &Limiter::new(&stranger.public_key(), &mut rng_mut()),
        rng(),
    );
    let init = match stranger_tunnel.initiate(&mut buf) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("no initiation: {other:?}"),
    };
    let who = |datagram: &[u8], cookie: &mut [u8]| {
        identify(
            &s.peers,
            &s.limiter,
            &s.own_private,
            &s.own_public,
            from,
            datagram,
            cookie,
        )
        .map(|_| ())
    };
    assert_eq!(who(&init, &mut cookie), Err(DropReason::UnknownPeer));
    // A data message for a session index nobody has (type 4, receiver index 0x424242).
    let mut data = vec![0u8; 32 + 16];
    data[0] = 4;
    data[4..8].copy_from_slice(&(0x42_4242u32 << 8).to_le_bytes());
    assert_eq!(who(&data, &mut cookie), Err(DropReason::UnknownPeer));
}

#[test]
fn only_an_authenticated_datagram_from_a_new_address_moves_the_endpoint() {
    let mut s = setup();
    let first = addr("192.0.2.1:4000");
    let roamed = addr("[2001:db8::5]:6000");
    let spoofer = addr("203.0.113.66:7000");
    let path = |remote: SocketAddr, local: &str| PeerPath {
        remote,
        local: Some(local.parse().expect("ip")),
    };
    let received = s.handshake(first);
    let first_path = path(first, "10.0.0.2");
    assert_eq!(
        roam(None, first_path, received.authenticated),
        Some(first_path)
    );
    let mut endpoint = Some(first_path);

    let data = s.remote_data(REMOTE_IP, b"from the new address");
    let mut landing = vec![0u8; 2048];
    let received = s.receive(roamed, &data, &mut landing);
    assert!(received.authenticated);
    let roamed_path = path(roamed, "2001:db8::1");
    assert_eq!(
        roam(endpoint, roamed_path, received.authenticated),
        Some(roamed_path)
    );
    endpoint = Some(roamed_path);
    // The same address again: nothing to change.
    let data = s.remote_data(REMOTE_IP, b"again");
    let received = s.receive(roamed, &data, &mut landing);
    assert_eq!(roam(endpoint, roamed_path, received.authenticated), None);
    // The same peer address, sent to another address of this host: replies follow it.
    let other_local = path(roamed, "2001:db8::2");
    assert_eq!(
        roam(endpoint, other_local, received.authenticated),
        Some(other_local)
    );

    // A replay of a genuine message from another address must not move the peer.
    let received = s.receive(spoofer, &data, &mut landing);
    assert!(!received.authenticated);
    assert_eq!(
        roam(endpoint, path(spoofer, "10.0.0.2"), received.authenticated),
        None
    );
    assert_eq!(
        roam(
            endpoint,
            path(roamed, "2001:db8::3"),
            received.authenticated
        ),
        None,
        "an unauthenticated datagram does not move the source either"
    );
}

#[test]
fn a_removed_source_address_falls_back_other_errors_do_not() {
    assert!(source_is_stale(libc::EINVAL), "address no longer local");
    assert!(source_is_stale(libc::EADDRNOTAVAIL));
    assert!(
        !source_is_stale(libc::EAGAIN),
        "a full buffer is not the source's fault"
    );
    assert!(
        source_is_stale(libc::ENETUNREACH),
        "IPv4 reports a source that is not ours as no route"
    );
    assert!(!source_is_stale(libc::EMSGSIZE));
    assert!(
        !source_is_stale(libc::EPERM),
        "a firewall drop is not the source's fault"
    );
}

#[test]
fn keepalive_starts_a_handshake_only_for_a_peer_without_a_session() {
    assert!(keepalive_handshake(true, false, false), "first start");
    assert!(!keepalive_handshake(true, true, false), "only once");
    assert!(
        !keepalive_handshake(false, false, false),
        "no keepalive, no eager handshake"
    );
    assert!(
        !keepalive_handshake(true, false, true),
        "keepalive turned on for a live peer keeps its session"
    );
}

#[test]
fn only_a_later_counter_or_a_later_session_counts_as_newer() {
    assert!(newer(None, (1, 0)));
    assert!(newer(Some((1, 5)), (1, 6)));
    assert!(!newer(Some((1, 5)), (1, 5)));
    assert!(!newer(Some((1, 5)), (1, 4)));
    // A rekey: the counters of two sessions say nothing about each other.
    assert!(newer(Some((1, 500)), (2, 0)));
    // A late batch of the session before: never newer, whatever its counter.
    assert!(!newer(Some((2, 0)), (1, 900)));
}
