//! The sans-IO peer without threads or root: real boringtun sessions for handshakes, data,
//! keepalives and drops; a scripted session for what boringtun decides on its own clock
//! (rekeys, expiry, giving up).

use super::*;
use crate::allowed_ips::AllowedIps;
use crate::config::IpNet;
use crate::packet::DropReason;
use crate::peer::Sending;
use crate::takeover::{Answer, Settle, Start};
use crate::test_util::{ipv4_packet, rng, rng_mut};
use crate::wg::Limiter;
use std::net::SocketAddr;

/// The peer table as the decisions see it: peer 0 is the remote, owning `10.0.0.2/32`.
struct OnePeer(AllowedIps<usize>);

impl PeerLookup for OnePeer {
    type Peer = usize;
    fn by_key(&self, _: &PublicKey) -> Option<&usize> {
        None
    }
    fn by_index(&self, _: u32) -> Option<&usize> {
        None
    }
    fn by_address(&self, addr: IpAddr) -> Option<&usize> {
        self.0.lookup(addr)
    }
    fn same(a: &usize, b: &usize) -> bool {
        a == b
    }
}

fn table() -> OnePeer {
    let mut routes = AllowedIps::default();
    routes.insert("10.0.0.2/32".parse::<IpNet>().expect("net"), 0usize);
    OnePeer(routes)
}

fn path(s: &str) -> PeerPath {
    PeerPath::to(s.parse::<SocketAddr>().expect("socket address"))
}

fn spec(keepalive: Option<u16>) -> PeerSpec {
    PeerSpec {
        preshared_key: None,
        persistent_keepalive: keepalive,
        allowed_ips: Vec::new(),
        name: None,
    }
}

/// The daemon's peer (`local`, reached at REMOTE) and the remote's own peer for us.
struct Pair {
    local: Peer,
    remote: Peer,
    _limiters: (Limiter, Limiter),
}

const REMOTE: &str = "192.0.2.2:51820";
const LOCAL: &str = "192.0.2.1:51820";

fn pair(local_keepalive: Option<u16>, local_path: Option<PeerPath>) -> Pair {
    let (a, b) = (SecretKey::generate(), SecretKey::generate());
    let (la, lb) = (
        Limiter::new(&a.public_key(), &mut rng_mut()),
        Limiter::new(&b.public_key(), &mut rng_mut()),
    );
    let local = Peer::new(
        &a,
        &b.public_key(),
        &spec(local_keepalive),
        1,
        &la,
        local_path,
        rng(),
    );
    let remote = Peer::new(
        &b,
        &a.public_key(),
        &spec(None),
        2,
        &lb,
        Some(path(LOCAL)),
        rng(),
    );
    Pair {
        local,
        remote,
        _limiters: (la, lb),
    }
}

/// Runs one handshake the remote starts; returns the local peer's decision on the initiation.
fn remote_initiates(p: &mut Pair, buf: &mut [u8], landing: &mut [u8]) -> Inbound {
    let init = match p
        .remote
        .encapsulate(&ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"hi"), buf)
    {
        Outbound::Send { len, .. } => buf[..len].to_vec(),
        other => panic!("expected an initiation, got {other:?}"),
    };
    p.local.decapsulate(
        &table(),
        &0,
        path(REMOTE),
        &init,
        landing,
        crate::test_util::now(),
    )
}

/// A handshake the remote starts on a live session (a rekey), completed both ways.
fn rekey(p: &mut Pair, buf: &mut [u8], landing: &mut [u8]) {
    let Outcome::Network(init) = p.remote.tunnel.initiate_anew(buf) else {
        panic!("the remote initiates");
    };
    let init = init.to_vec();
    let now = crate::test_util::now();
    let Inbound::Reply(len) = p
        .local
        .decapsulate(&table(), &0, path(REMOTE), &init, landing, now)
    else {
        panic!("expected a response");
    };
    let response = landing[..len].to_vec();
    let mut out = vec![0u8; 2048];
    let _ = p
        .remote
        .decapsulate(&table(), &0, path(LOCAL), &response, &mut out, now);
}

/// A whole handshake the remote starts, confirmed by its first data message.
fn establish(p: &mut Pair, buf: &mut [u8], landing: &mut [u8]) {
    let Inbound::Reply(len) = remote_initiates(p, buf, landing) else {
        panic!("expected a response");
    };
    let response = landing[..len].to_vec();
    let _ = p.remote.decapsulate(
        &table(),
        &0,
        path(LOCAL),
        &response,
        landing,
        crate::test_util::now(),
    );
    let queued = p.remote.flush_queued(buf).expect("the queued packet");
    let data = buf[..queued].to_vec();
    let delivered = p.local.decapsulate(
        &table(),
        &0,
        path(REMOTE),
        &data,
        landing,
        crate::test_util::now(),
    );
    assert!(matches!(delivered, Inbound::Deliver(_)), "{delivered:?}");
}

#[test]
fn a_handshake_the_peer_initiated_is_answered_counted_and_roams_to_its_sender() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    let reply = remote_initiates(&mut p, &mut buf, &mut landing);
    let Inbound::Reply(len) = reply else {
        panic!("expected a handshake response, got {reply:?}");
    };
    assert_eq!(Handshake::of(&landing[..len]), Some(Handshake::Response));
    let stats = p.local.stats();
    assert_eq!(stats.counters.handshakes_answered, 1);
    assert_eq!(stats.counters.handshakes_initiated, 0);
    assert_eq!(
        (stats.counters.rx_packets, stats.counters.tx_packets),
        (1, 1)
    );
    assert_eq!(stats.counters.tx_bytes, len as u64);
    assert_eq!(
        stats.path,
        Some(path(REMOTE)),
        "authenticated: roams to the sender"
    );

    // The response completes the remote's handshake and releases its queued packet, which
    // the local peer delivers.
    let response = landing[..len].to_vec();
    let _ = p.remote.decapsulate(
        &table(),
        &0,
        path(LOCAL),
        &response,
        &mut landing,
        crate::test_util::now(),
    );
    let queued = p.remote.flush_queued(&mut buf).expect("the queued packet");
    let delivered = p.local.decapsulate(
        &table(),
        &0,
        path(REMOTE),
        &buf[..queued],
        &mut landing,
        crate::test_util::now(),
    );
    assert!(
        matches!(delivered, Inbound::Deliver(n) if landing[..n] == ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"hi"))
    );
    assert!(
        p.local.flush_queued(&mut buf).is_none(),
        "nothing was queued locally"
    );
}

#[test]
fn a_keepalive_peer_starts_its_first_handshake_from_the_timer_once() {
    let mut p = pair(Some(25), Some(path(REMOTE)));
    let mut buf = vec![0u8; 2048];
    let t0 = crate::test_util::now();
    let tick = p.local.on_tick(t0, &mut buf);
    let (len, to) = tick.send.expect("a handshake initiation");
    assert_eq!(Handshake::of(&buf[..len]), Some(Handshake::Initiation));
    assert_eq!(to, path(REMOTE));
    assert_eq!(p.local.stats().counters.handshakes_initiated, 1);
    // The next tick does not start another one (boringtun retries on its own schedule).
    let again = p.local.on_tick(t0 + Duration::from_millis(100), &mut buf);
    assert_eq!(again.send, None);
    assert_eq!(p.local.stats().counters.handshakes_initiated, 1);
}

#[test]
fn a_peer_without_keepalive_or_endpoint_sends_nothing_from_its_timer() {
    let mut p = pair(Some(25), None);
    let mut buf = vec![0u8; 2048];
    let tick = p.local.on_tick(crate::test_util::now(), &mut buf);
    assert_eq!(tick, Tick::default());
    let mut p = pair(None, Some(path(REMOTE)));
    assert_eq!(
        p.local.on_tick(crate::test_util::now(), &mut buf),
        Tick::default()
    );
}

#[test]
fn keepalives_follow_the_time_given_and_a_completed_handshake_is_reported_once() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let t0 = crate::test_util::now();
    assert!(p.local.on_tick(t0, &mut buf).handshake_completed);
    assert!(
        !p.local
            .on_tick(t0 + Duration::from_millis(100), &mut buf)
            .handshake_completed
    );

    p.local.set_keepalive(Some(5));
    let keepalive = |tick: Tick| tick.send.is_some_and(|(len, _)| len == 32);
    assert!(!keepalive(p.local.on_tick(t0, &mut buf)));
    assert!(!keepalive(
        p.local.on_tick(t0 + Duration::from_millis(4900), &mut buf)
    ));
    assert!(keepalive(
        p.local.on_tick(t0 + Duration::from_secs(5), &mut buf)
    ));
    assert!(!keepalive(
        p.local.on_tick(t0 + Duration::from_secs(6), &mut buf)
    ));
    assert!(keepalive(
        p.local.on_tick(t0 + Duration::from_secs(10), &mut buf)
    ));
    let c = p.local.stats().counters;
    assert_eq!(c.handshakes_initiated, 0, "keepalives are not handshakes");
    assert_eq!(c.tx_packets, 3, "the response and two keepalives");
}

#[test]
fn garbage_is_invalid_and_neither_counted_nor_roamed() {
    let mut p = pair(None, Some(path(REMOTE)));
    let mut landing = vec![0u8; 2048];
    let mut garbage = vec![4u8; 64];
    garbage[1..4].fill(0);
    let decision = p.local.decapsulate(
        &table(),
        &0,
        path("198.51.100.9:1"),
        &garbage,
        &mut landing,
        crate::test_util::now(),
    );
    // A data message for a session this side lacks may be another process's session: a
    // takeover's cue (sent later, within its bounds), never an authenticated datagram.
    assert_eq!(decision, Inbound::TakeOver);
    garbage[0] = 9;
    let decision = p.local.decapsulate(
        &table(),
        &0,
        path("198.51.100.9:1"),
        &garbage,
        &mut landing,
        crate::test_util::now(),
    );
    assert_eq!(decision, Inbound::Drop(DropReason::Invalid));
    let stats = p.local.stats();
    assert_eq!(stats.counters, PeerCounters::default());
    assert_eq!(stats.path, Some(path(REMOTE)));
}

#[test]
fn an_inner_source_outside_the_allowed_ips_is_dropped_but_authenticated() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    let Inbound::Reply(len) = remote_initiates(&mut p, &mut buf, &mut landing) else {
        panic!("expected a response");
    };
    let response = landing[..len].to_vec();
    let _ = p.remote.decapsulate(
        &table(),
        &0,
        path(LOCAL),
        &response,
        &mut landing,
        crate::test_util::now(),
    );
    let _ = p.remote.flush_queued(&mut buf);
    let spoofed = ipv4_packet([10, 0, 0, 99], [10, 0, 0, 1], b"not yours");
    let Outbound::Send { len, .. } = p.remote.encapsulate(&spoofed, &mut buf) else {
        panic!("expected data");
    };
    let roamed = path("192.0.2.77:4000");
    let before = p.local.stats().counters.rx_packets;
    let decision = p.local.decapsulate(
        &table(),
        &0,
        roamed,
        &buf[..len],
        &mut landing,
        crate::test_util::now(),
    );
    assert_eq!(decision, Inbound::Drop(DropReason::BadSource));
    assert_eq!(p.local.stats().counters.rx_packets, before + 1);
    assert_eq!(
        p.local.path(),
        Some(roamed),
        "the key made it: the peer roams"
    );
}

/// A session that answers as scripted, for what boringtun decides on its own clock.
#[derive(Default)]
struct Scripted {
    timer: Option<Result<Vec<u8>, TunnelError>>,
    encapsulated: Option<Vec<u8>>,
}

impl Session for Scripted {
    fn encapsulate<'a>(&mut self, _: &[u8], dst: &'a mut [u8]) -> Outcome<'a> {
        match &self.encapsulated {
            Some(m) => {
                dst[..m.len()].copy_from_slice(m);
                Outcome::Network(&mut dst[..m.len()])
            }
            None => Outcome::Done,
        }
    }
    fn decapsulate<'a>(&mut self, _: IpAddr, _: &[u8], _: &'a mut [u8]) -> Outcome<'a> {
        Outcome::Done
    }
    fn flush<'a>(&mut self, _: &'a mut [u8]) -> Outcome<'a> {
        Outcome::Done
    }
    fn initiate<'a>(&mut self, _: &'a mut [u8]) -> Outcome<'a> {
        Outcome::Done
    }
    fn update_timers<'a>(&mut self, _: Instant, dst: &'a mut [u8]) -> Outcome<'a> {
        match self.timer.take() {
            Some(Ok(m)) => {
                dst[..m.len()].copy_from_slice(&m);
                Outcome::Network(&mut dst[..m.len()])
            }
            Some(Err(e)) => Outcome::Error(e),
            None => Outcome::Done,
        }
    }
    fn set_persistent_keepalive(&mut self, _: Option<u16>) {}
    fn set_private_key(&mut self, _: &SecretKey, _: &Limiter) {}
    fn since_last_handshake(&self) -> Option<Duration> {
        Some(Duration::from_secs(130))
    }
    fn reserve_send(&mut self, _: usize, _: usize) -> Option<crate::wg::SealBatch> {
        None
    }
    fn receiving(&self, _: &[u8]) -> Option<OpenKey> {
        None
    }
    fn record_received(&mut self, _: u32, _: Option<usize>) {}
}

fn initiation() -> Vec<u8> {
    let mut m = vec![0u8; 148];
    m[0] = 1;
    m
}

#[test]
fn a_rekey_is_sent_to_the_peer_and_counted_as_initiated() {
    let session = Scripted {
        timer: Some(Ok(initiation())),
        ..Scripted::default()
    };
    let mut peer = Peer::with_session(session, None, Some(path(REMOTE)));
    let mut buf = vec![0u8; 2048];
    let tick = peer.on_tick(crate::test_util::now(), &mut buf);
    assert_eq!(tick.send, Some((148, path(REMOTE))));
    let c = peer.stats().counters;
    assert_eq!(
        (c.handshakes_initiated, c.tx_packets, c.tx_bytes),
        (1, 1, 148)
    );
}

#[test]
fn a_rekey_without_an_endpoint_goes_nowhere_and_is_not_counted() {
    let session = Scripted {
        timer: Some(Ok(initiation())),
        ..Scripted::default()
    };
    let mut peer = Peer::with_session(session, None, None);
    let tick = peer.on_tick(crate::test_util::now(), &mut vec![0u8; 2048]);
    assert_eq!(tick.send, None);
    assert_eq!(peer.stats().counters, PeerCounters::default());
}

#[test]
fn an_expired_session_is_not_a_failure_and_giving_up_is() {
    let mut buf = vec![0u8; 2048];
    let expired = Scripted {
        timer: Some(Err(TunnelError::Expired)),
        ..Scripted::default()
    };
    let mut peer = Peer::with_session(expired, None, Some(path(REMOTE)));
    assert_eq!(peer.on_tick(crate::test_util::now(), &mut buf).send, None);
    assert_eq!(peer.stats().counters.handshake_failures, 0);

    let gave_up = Scripted {
        timer: Some(Err(TunnelError::Rejected("handshake timed out"))),
        ..Scripted::default()
    };
    let mut peer = Peer::with_session(gave_up, None, Some(path(REMOTE)));
    assert_eq!(peer.on_tick(crate::test_util::now(), &mut buf).send, None);
    assert_eq!(peer.stats().counters.handshake_failures, 1);
}

#[test]
fn data_for_a_peer_without_an_endpoint_is_dropped_uncounted() {
    let session = Scripted {
        encapsulated: Some(vec![4u8; 60]),
        ..Scripted::default()
    };
    let mut peer = Peer::with_session(session, None, None);
    let decision = peer.encapsulate(&[0x45; 40], &mut vec![0u8; 2048]);
    assert_eq!(decision, Outbound::Drop(DropReason::NoEndpoint));
    assert_eq!(peer.stats().counters, PeerCounters::default());
    peer.set_endpoint(path(REMOTE));
    let decision = peer.encapsulate(&[0x45; 40], &mut vec![0u8; 2048]);
    assert_eq!(
        decision,
        Outbound::Send {
            len: 60,
            to: path(REMOTE)
        }
    );
    assert_eq!(peer.stats().counters.tx_bytes, 60);
}

#[test]
fn a_removed_local_source_is_forgotten_only_by_peers_that_used_it() {
    let gone: IpAddr = "192.0.2.1".parse().expect("ip");
    let mut via_gone = path(REMOTE);
    via_gone.local = Some(gone);
    let mut peer = Peer::with_session(Scripted::default(), None, Some(via_gone));
    peer.forget_source("192.0.2.50".parse().expect("ip"));
    assert_eq!(peer.path(), Some(via_gone));
    peer.forget_source(gone);
    assert_eq!(peer.path(), Some(path(REMOTE)));
}

#[test]
fn the_limiter_resets_once_a_second_of_the_time_given() {
    let mut reset = LimiterReset::default();
    let t0 = crate::test_util::now();
    assert!(!reset.due(t0), "the first call starts the interval");
    assert!(!reset.due(t0 + Duration::from_millis(900)));
    assert!(reset.due(t0 + Duration::from_secs(1)));
    assert!(!reset.due(t0 + Duration::from_millis(1500)));
    assert!(reset.due(t0 + Duration::from_millis(2100)));
}

#[test]
fn every_message_of_a_session_is_steered_to_the_worker_that_owns_its_peer() {
    use crate::packet::steering::Steering;
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    let Inbound::Reply(len) = remote_initiates(&mut p, &mut buf, &mut landing) else {
        panic!("expected a response");
    };
    let response = landing[..len].to_vec();
    let _ = p.remote.decapsulate(
        &table(),
        &0,
        path(LOCAL),
        &response,
        &mut landing,
        crate::test_util::now(),
    );
    let data = p.remote.flush_queued(&mut buf).expect("queued data");
    // The local peer was made with table index 1: its session index is 1 << 8 (+ a counter).
    for workers in [1usize, 2, 3, 8] {
        for steering in [
            Steering::plain(workers),
            Steering::balanced([1, 3, 5, 7], workers),
        ] {
            assert_eq!(
                steering.owning_worker(&buf[..data]),
                steering.worker_of_peer(1),
                "{steering:?}"
            );
        }
    }
}

/// Seals `packets` on one reservation of `from`, in reverse order (as parallel workers might
/// finish), each in place in its own buffer.
fn seal_batch(from: &mut Peer, packets: &[Vec<u8>]) -> (Vec<Vec<u8>>, PeerPath) {
    let bytes = packets.iter().map(Vec::len).sum();
    let Sending::Seal { batch, to } = from.begin_send(packets.len(), bytes) else {
        panic!("expected a session to seal with");
    };
    assert_eq!(batch.len(), packets.len());
    let mut sealed = vec![Vec::new(); packets.len()];
    for i in (0..packets.len()).rev() {
        let mut message = vec![0u8; packets[i].len() + crate::wg::OVERHEAD];
        message[crate::wg::DATA_OFFSET..][..packets[i].len()].copy_from_slice(&packets[i]);
        let len = batch.seal_in_place(i, &mut message, packets[i].len());
        assert_eq!(len, message.len());
        sealed[i] = message;
    }
    (sealed, to)
}

/// The daemon's receive path: the session found under the lock, opened outside it, recorded.
fn open_outside(to: &mut Peer, from: PeerPath, message: &[u8], landing: &mut [u8]) -> Inbound {
    let Some(key) = to.receiving(message) else {
        return to.decapsulate(
            &table(),
            &0,
            from,
            message,
            landing,
            crate::test_util::now(),
        );
    };
    match key.open(message, landing) {
        Ok(opened) => to.opened(&table(), &0, from, message.len(), &opened, landing),
        Err(_) => Inbound::Drop(DropReason::Invalid),
    }
}

#[test]
fn a_batch_sealed_outside_the_lock_opens_outside_it_once_each_counted_and_roaming() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let before = (p.remote.stats().counters, p.local.stats().counters);
    let packets: Vec<Vec<u8>> = (0..3u8)
        .map(|i| ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], &[i; 100]))
        .collect();
    let (sealed, to) = seal_batch(&mut p.remote, &packets);
    assert_eq!(to, path(LOCAL));
    let sent = p.remote.stats().counters;
    assert_eq!(sent.tx_packets, before.0.tx_packets + 3);
    assert_eq!(
        sent.tx_bytes,
        before.0.tx_bytes + sealed.iter().map(|m| m.len() as u64).sum::<u64>()
    );
    // Delivered out of order, from a new address: each opens once and the peer roams.
    let roamed = path("192.0.2.99:7000");
    for i in [2, 0, 1] {
        let got = open_outside(&mut p.local, roamed, &sealed[i], &mut landing);
        assert_eq!(got, Inbound::Deliver(packets[i].len()));
        assert_eq!(landing[..packets[i].len()], packets[i][..]);
    }
    let c = p.local.stats().counters;
    assert_eq!(c.rx_packets, before.1.rx_packets + 3);
    assert_eq!(p.local.path(), Some(roamed));
    for message in &sealed {
        assert_eq!(
            open_outside(&mut p.local, roamed, message, &mut landing),
            Inbound::Drop(DropReason::Invalid),
            "a replay"
        );
    }
    assert_eq!(p.local.stats().counters.rx_packets, c.rx_packets);
}

#[test]
fn opened_outside_the_lock_a_foreign_source_is_dropped_and_a_keepalive_delivers_nothing() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let spoofed = ipv4_packet([10, 0, 0, 99], [10, 0, 0, 1], b"not yours");
    let (sealed, _) = seal_batch(&mut p.remote, &[spoofed, Vec::new()]);
    assert_eq!(
        open_outside(&mut p.local, path(REMOTE), &sealed[0], &mut landing),
        Inbound::Drop(DropReason::BadSource)
    );
    assert_eq!(
        open_outside(&mut p.local, path(REMOTE), &sealed[1], &mut landing),
        Inbound::Nothing
    );
}

#[test]
fn without_a_session_or_an_endpoint_segments_go_through_the_lock_to_be_queued() {
    let mut p = pair(None, None);
    assert!(matches!(p.local.begin_send(4, 4000), Sending::Queue));
    p.local.set_endpoint(path(REMOTE));
    assert!(matches!(p.local.begin_send(4, 4000), Sending::Queue));
    assert_eq!(p.local.stats().counters, PeerCounters::default());
    // Nothing is opened outside the lock before a session exists.
    assert!(p.local.receiving(&[4, 0, 0, 0, 1, 1, 0, 0]).is_none());
}

#[test]
fn two_threads_seal_one_batch_and_two_open_it_each_message_once() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let packets: Vec<Vec<u8>> = (0..64u8)
        .map(|i| ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], &[i; 300]))
        .collect();
    let bytes = packets.iter().map(Vec::len).sum();
    let Sending::Seal { batch, .. } = p.remote.begin_send(packets.len(), bytes) else {
        panic!("a session");
    };
    // Even and odd segments sealed on two threads with the one reservation, no lock.
    let sealed: Vec<(usize, Vec<u8>)> = std::thread::scope(|s| {
        let halves: Vec<_> = (0..2)
            .map(|half| {
                let (batch, packets) = (&batch, &packets);
                s.spawn(move || {
                    (half..packets.len())
                        .step_by(2)
                        .map(|i| {
                            let mut m = vec![0u8; packets[i].len() + crate::wg::OVERHEAD];
                            batch.seal(i, &packets[i], &mut m);
                            (i, m)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        halves
            .into_iter()
            .flat_map(|h| h.join().expect("sealer"))
            .collect()
    });
    // Opened on two threads, each message twice (once per thread): the peer behind a lock
    // taken only to find the session and to record.
    let local = std::sync::Mutex::new(p.local);
    let delivered: Vec<usize> = std::thread::scope(|s| {
        let openers: Vec<_> = (0..2)
            .map(|_| {
                let (local, sealed) = (&local, &sealed);
                s.spawn(move || {
                    let mut landing = vec![0u8; 2048];
                    let mut got = Vec::new();
                    for (i, message) in sealed {
                        let key = local.lock().expect("lock").receiving(message);
                        let opened = key.and_then(|k| k.open(message, &mut landing).ok());
                        if let Some(opened) = opened {
                            let decision = local.lock().expect("lock").opened(
                                &table(),
                                &0,
                                path(REMOTE),
                                message.len(),
                                &opened,
                                &landing,
                            );
                            assert_eq!(decision, Inbound::Deliver(300 + 20));
                            got.push(*i);
                        }
                    }
                    got
                })
            })
            .collect();
        openers
            .into_iter()
            .flat_map(|o| o.join().expect("opener"))
            .collect()
    });
    let mut delivered = delivered;
    delivered.sort_unstable();
    assert_eq!(delivered, (0..64).collect::<Vec<_>>(), "each exactly once");
}

/// Two receive batches opened on two threads: the newer one (sent after the peer moved)
/// finishes first, the older one (from the address it left) later. The endpoint stays where the
/// newer one came from.
#[test]
fn an_older_batch_finishing_later_does_not_move_the_endpoint_back() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let packets: Vec<Vec<u8>> = (0..4u8)
        .map(|i| ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], &[i; 100]))
        .collect();
    let (sealed, _) = seal_batch(&mut p.remote, &packets);
    let (left, moved_to) = (path("192.0.2.7:5000"), path("192.0.2.99:7000"));
    // The newer batch (messages 2 and 3, from the new address) is recorded first.
    for i in [2, 3] {
        let got = open_outside(&mut p.local, moved_to, &sealed[i], &mut landing);
        assert_eq!(got, Inbound::Deliver(packets[i].len()));
    }
    assert_eq!(p.local.path(), Some(moved_to));
    // The older batch (0 and 1, sent from the address the peer left) finishes later: delivered
    // and counted, but the endpoint stays.
    for i in [0, 1] {
        let got = open_outside(&mut p.local, left, &sealed[i], &mut landing);
        assert_eq!(got, Inbound::Deliver(packets[i].len()));
    }
    assert_eq!(
        p.local.path(),
        Some(moved_to),
        "moved back by an older batch"
    );
    // A newer message from another address still roams.
    let (more, _) = seal_batch(&mut p.remote, &packets[..1]);
    let again = path("192.0.2.100:7001");
    open_outside(&mut p.local, again, &more[0], &mut landing);
    assert_eq!(p.local.path(), Some(again));
}

/// A restarted side (same key, same peer, no session) whose peer keeps sending: the cue may
/// come through an off-path attacker's address (it relayed one data message), but the
/// initiation goes to where the peer authenticated (here its configured endpoint), and the
/// peer's answer from there completes it; the attacker's address is never sent to, nor roamed
/// to. Completion is timed from the response.
#[test]
fn a_restarted_side_takes_over_through_the_known_endpoint_never_the_cues_source() {
    let (a, b) = (SecretKey::generate(), SecretKey::generate());
    let (la, lb) = (
        Limiter::new(&a.public_key(), &mut rng_mut()),
        Limiter::new(&b.public_key(), &mut rng_mut()),
    );
    let local = |path| Peer::new(&a, &b.public_key(), &spec(None), 1, &la, path, rng());
    let remote = Peer::new(
        &b,
        &a.public_key(),
        &spec(None),
        2,
        &lb,
        Some(path(LOCAL)),
        rng(),
    );
    let mut p = Pair {
        local: local(None),
        remote,
        // The sessions hold the limiters above; these only fill the slot.
        _limiters: (
            Limiter::new(&a.public_key(), &mut rng_mut()),
            Limiter::new(&b.public_key(), &mut rng_mut()),
        ),
    };
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);

    // The local process restarts: same key, same peer (configured at REMOTE), no session.
    p.local = local(Some(path(REMOTE)));
    let attacker = path("198.51.100.9:40000");
    let mut data = || {
        let Sending::Seal { batch, .. } = p.remote.begin_send(1, 20) else {
            panic!("the remote has a session");
        };
        let plain = ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"ping");
        let len = batch.seal(0, &plain, &mut buf);
        buf[..len].to_vec()
    };
    let (first, second) = (data(), data());
    let mut new_local = std::mem::replace(&mut p.local, local(None));
    let t0 = crate::test_util::now();
    assert_eq!(
        new_local.decapsulate(&table(), &0, attacker, &first, &mut landing, t0),
        Inbound::TakeOver,
        "the first names a session this side lacks: take over"
    );
    assert_eq!(
        new_local.decapsulate(&table(), &0, attacker, &second, &mut landing, t0),
        Inbound::Drop(DropReason::UnknownPeer),
        "one hand-over per takeover"
    );
    assert_eq!(
        new_local.path(),
        Some(path(REMOTE)),
        "no roam on a stranger's word"
    );

    let (start, sent) = new_local.start_takeover(t0, Answer::KnownEndpoints, &mut buf);
    assert_eq!(
        start,
        Start::Initiate { to: path(REMOTE) },
        "to where the peer authenticated, not to the cue's source"
    );
    let len = sent.expect("an initiation");
    assert_eq!(Handshake::of(&buf[..len]), Some(Handshake::Initiation));
    let initiation = buf[..len].to_vec();
    let Inbound::Reply(len) =
        p.remote
            .decapsulate(&table(), &0, path(LOCAL), &initiation, &mut landing, t0)
    else {
        panic!("the remote answers a newer initiation from the same key");
    };
    let response = landing[..len].to_vec();
    // The response is handled on the handshake path 37 ms after the initiation went.
    let answered = t0 + Duration::from_millis(37);
    let confirmed = new_local.decapsulate_handshake(
        &table(),
        &0,
        path(REMOTE),
        &response,
        &mut landing,
        answered,
    );
    assert!(
        matches!(confirmed, Inbound::Reply(_)),
        "a keepalive confirms: {confirmed:?}"
    );
    assert_eq!(new_local.path(), Some(path(REMOTE)));

    // Settled later: the time is the response's.
    assert_eq!(
        new_local.settle_takeover(answered + Duration::from_millis(60)),
        Settle::Completed {
            to: path(REMOTE),
            after: Duration::from_millis(37)
        }
    );
    let c = new_local.stats().counters;
    assert_eq!(
        (
            c.takeovers_started,
            c.takeovers_completed,
            c.takeovers_failed,
            c.takeovers_no_endpoint
        ),
        (1, 1, 0, 0)
    );
    assert_eq!(c.takeover_time_last, Some(Duration::from_millis(37)));
    assert_eq!(c.takeover_time_total, Duration::from_millis(37));

    // Ten seconds on, another takeover, which the peer completes by initiating itself (this
    // side answers): the older response stamp must not hide that handshake.
    let t1 = t0 + Duration::from_secs(10);
    let third = {
        let Sending::Seal { batch, .. } = p.remote.begin_send(1, 20) else {
            panic!("the remote has a session");
        };
        let len = batch.seal(
            0,
            &ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"x"),
            &mut buf,
        );
        let mut m = buf[..len].to_vec();
        m[4] ^= 0x40; // names a session this side does not have
        m
    };
    assert_eq!(
        new_local.decapsulate(&table(), &0, path(REMOTE), &third, &mut landing, t1),
        Inbound::TakeOver
    );
    assert!(matches!(
        new_local
            .start_takeover(t1, Answer::KnownEndpoints, &mut buf)
            .0,
        Start::Initiate { .. }
    ));
    let Outcome::Network(init) = p.remote.tunnel.initiate_anew(&mut buf) else {
        panic!("the remote initiates");
    };
    let init = init.to_vec();
    assert!(matches!(
        new_local.decapsulate_handshake(&table(), &0, path(REMOTE), &init, &mut landing, t1),
        Inbound::Reply(_)
    ));
    assert!(
        matches!(
            new_local.settle_takeover(t1 + Duration::from_millis(100)),
            Settle::Completed { .. }
        ),
        "completed by the peer's own handshake"
    );
    assert_eq!(new_local.stats().counters.takeovers_failed, 0);
}

/// With no endpoint known (none configured, none authenticated, none restored or told), a cue
/// sends nothing: the peer waits for its own rekey. The opt-in answers the cue's source.
#[test]
fn with_no_known_endpoint_a_takeover_sends_nothing_unless_any_source_is_allowed() {
    let mut p = pair(None, Some(path(REMOTE)));
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let Sending::Seal { batch, .. } = p.remote.begin_send(1, 20) else {
        panic!("a session");
    };
    let len = batch.seal(
        0,
        &ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"x"),
        &mut buf,
    );
    let message = buf[..len].to_vec();
    let cue = path("198.51.100.9:40000");
    let t0 = crate::test_util::now();
    for (answer, expected) in [
        (Answer::KnownEndpoints, Start::NoKnownEndpoint { cue }),
        (Answer::AnySource, Start::Initiate { to: cue }),
    ] {
        // A fresh process: nothing known.
        let (a, b) = (SecretKey::generate(), SecretKey::generate());
        let limiter = Limiter::new(&a.public_key(), &mut rng_mut());
        let mut fresh = Peer::new(&a, &b.public_key(), &spec(None), 1, &limiter, None, rng());
        assert_eq!(
            fresh.decapsulate(&table(), &0, cue, &message, &mut landing, t0),
            Inbound::TakeOver
        );
        let (start, sent) = fresh.start_takeover(t0, answer, &mut buf);
        assert_eq!(start, expected, "{answer:?}");
        assert_eq!(sent.is_some(), answer == Answer::AnySource);
        assert_eq!(
            fresh.stats().counters.takeovers_no_endpoint,
            u64::from(answer == Answer::KnownEndpoints)
        );
        // A peer that keeps sending asks again only after REKEY_TIMEOUT: one look per 5 s.
        let soon = t0 + Duration::from_secs(1);
        assert_eq!(
            fresh.decapsulate(&table(), &0, cue, &message, &mut landing, soon),
            Inbound::Drop(DropReason::UnknownPeer)
        );
    }
}

/// A peer back from another process that handed out the same session index (a fail-back to a
/// replica that still holds an older session under that index): the message does not open
/// under this side's keys, and that is a takeover's cue like a session this side lacks. A
/// replay of a genuine message is not.
#[test]
fn a_message_that_names_a_kept_session_but_does_not_open_asks_for_a_takeover() {
    let mut p = pair(None, Some(path(REMOTE)));
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let Sending::Seal { batch, .. } = p.remote.begin_send(1, 20) else {
        panic!("a session");
    };
    let len = batch.seal(
        0,
        &ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], b"x"),
        &mut buf,
    );
    let genuine = buf[..len].to_vec();
    let mut forged = genuine.clone();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    let key = p.local.receiving(&forged).expect("names a kept session");
    let error = key.open(&forged, &mut landing).expect_err("does not open");
    let t0 = crate::test_util::now();
    assert_eq!(
        p.local.failed_open(error, path(REMOTE), t0),
        Inbound::TakeOver
    );
    let key = p.local.receiving(&genuine).expect("kept");
    key.open(&genuine, &mut landing).expect("opens once");
    let replayed = key.open(&genuine, &mut landing).expect_err("a replay");
    assert_eq!(
        p.local.failed_open(replayed, path(REMOTE), t0),
        Inbound::Drop(DropReason::Invalid),
        "a replay is no cue"
    );
}

/// Sessions only move forward: after a rekey, a late batch of the session before (sent from the
/// address the peer has since left) is delivered but never moves the endpoint back.
#[test]
fn a_late_batch_of_the_session_before_a_rekey_does_not_move_the_endpoint_back() {
    let mut p = pair(None, None);
    let (mut buf, mut landing) = (vec![0u8; 2048], vec![0u8; 2048]);
    establish(&mut p, &mut buf, &mut landing);
    let packet = ipv4_packet([10, 0, 0, 2], [10, 0, 0, 1], &[7; 100]);
    let (old, _) = seal_batch(&mut p.remote, std::slice::from_ref(&packet));
    // A rekey: a second handshake, then a message of the new session from a new address.
    rekey(&mut p, &mut buf, &mut landing);
    let (new, _) = seal_batch(&mut p.remote, std::slice::from_ref(&packet));
    let (left, moved_to) = (path("192.0.2.7:5000"), path("192.0.2.99:7000"));
    assert_eq!(
        open_outside(&mut p.local, moved_to, &new[0], &mut landing),
        Inbound::Deliver(packet.len())
    );
    assert_eq!(
        open_outside(&mut p.local, left, &old[0], &mut landing),
        Inbound::Deliver(packet.len()),
        "delivered: the old session is still kept"
    );
    assert_eq!(p.local.path(), Some(moved_to), "moved back by a late batch");
}

/// A concentrator holds 100,000 of these (each behind its own lock, most never used): what
/// only some peers need (a takeover's state and counts, a preshared key, boringtun's session)
/// is boxed when first needed, so the peer itself stays small (issue 51: 150 MB at 100,000
/// peers). Grows past the bound only on purpose.
#[test]
fn a_peer_that_never_took_over_stays_small() {
    let size = std::mem::size_of::<Peer>();
    assert!(size <= 256, "Peer is {size} bytes");
}

/// The timer ticks only the peers that need it (issue 51): a configured peer that never talked
/// needs nothing, and is not on its list; the first packet to send wakes it, once; a
/// persistent keepalive with an endpoint needs the timer for its first handshake; a peer the
/// timer finds needing nothing leaves the list and is handed over again when it wakes.
#[test]
fn only_peers_that_woke_or_start_a_keepalive_need_the_timer() {
    let mut buf = vec![0u8; 2048];
    let mut p = pair(None, Some(path(REMOTE)));
    assert!(!p.local.woke(), "an idle peer is not handed to the timer");
    assert!(!p.local.wants_ticks(), "nor kept on its list");
    let _ = p
        .local
        .encapsulate(&ipv4_packet([10, 0, 0, 1], [10, 0, 0, 2], b"hi"), &mut buf);
    assert!(p.local.woke(), "a packet to send woke the session");
    assert!(!p.local.woke(), "handed over once");
    assert!(p.local.wants_ticks());

    let mut k = pair(Some(25), None);
    assert!(!k.local.woke(), "a keepalive with nowhere to send waits");
    k.local.set_endpoint(path(REMOTE));
    assert!(
        k.local.wants_ticks(),
        "a keepalive with an endpoint starts its handshake"
    );
    let tick = k.local.on_tick(crate::test_util::now(), &mut buf);
    assert!(tick.send.is_some(), "the first handshake went: {tick:?}");
    assert!(
        k.local.wants_ticks(),
        "and the woken session keeps its timers"
    );
}
