//! End to end without root: a worker's peers against a small gateway of the fork's `Tunn`s on
//! loopback, which answers their pings as a host's kernel would. Checks the handshake wave, the
//! replies, a rekey of everyone, and a restart of the gateway (fresh `Tunn`s that take the
//! sessions over by initiating to the address a stale data message came from).

use crate::icmp;
use crate::keys;
use crate::worker::{self, Cmd, Handle, Msg, Setup};
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Duration;

const PEERS: u32 = 5;
const SEED: &str = "e2e";
const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

/// What a host's kernel answers to an echo request: addresses swapped, type 0, checksums redone.
fn echo_reply(request: &[u8]) -> Option<Vec<u8>> {
    if request.len() < 28 || request[0] != 0x45 || request[9] != 1 || request[20] != 8 {
        return None;
    }
    let mut r = request.to_vec();
    r[12..16].copy_from_slice(&request[16..20]);
    r[16..20].copy_from_slice(&request[12..16]);
    r[10..12].copy_from_slice(&[0, 0]);
    let c = icmp::checksum(&r[..20]);
    r[10..12].copy_from_slice(&c.to_be_bytes());
    r[20] = 0;
    r[22..24].copy_from_slice(&[0, 0]);
    let c = icmp::checksum(&r[20..]);
    r[22..24].copy_from_slice(&c.to_be_bytes());
    Some(r)
}

fn gateway_tunns(secret: &[u8; 32]) -> Vec<Tunn> {
    (0..PEERS)
        .map(|i| {
            let peer = PublicKey::from(keys::public_key(&keys::private_key(SEED, i)));
            Tunn::new(
                StaticSecret::from(*secret),
                peer,
                None,
                None,
                1000 + i,
                None,
                Box::new(rand_core::OsRng),
            )
        })
        .collect()
}

/// The gateway: one socket; a peer is found by trying its initiation on every `Tunn`, then by
/// its address. `restart` replaces every `Tunn` (sessions lost, addresses kept: the colleague's
/// state file, or the source of a stale data message, which is the same address here).
fn gateway(sock: UdpSocket, secret: [u8; 32], stop: Arc<AtomicBool>, restart: Arc<AtomicU32>) {
    let mut tunns = gateway_tunns(&secret);
    let mut by_addr: HashMap<SocketAddr, usize> = HashMap::new();
    let mut generation = 0;
    let (mut buf, mut out) = ([0u8; 2048], [0u8; 2048]);
    let send = |out: &[u8], to: SocketAddr| {
        let _ = sock.send_to(out, to);
    };
    while !stop.load(Ordering::Relaxed) {
        if restart.load(Ordering::Relaxed) != generation {
            generation = restart.load(Ordering::Relaxed);
            tunns = gateway_tunns(&secret);
        }
        let Ok((n, from)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let candidates: Vec<usize> = match by_addr.get(&from) {
            Some(&i) if buf[0] != 1 => vec![i],
            _ => (0..tunns.len()).collect(),
        };
        for i in candidates {
            let t = &mut tunns[i];
            match t.decapsulate(Some(from.ip()), &buf[..n], &mut out) {
                TunnResult::WriteToNetwork(p) => {
                    send(p, from);
                    while let TunnResult::WriteToNetwork(p) = t.decapsulate(None, &[], &mut out) {
                        send(p, from);
                    }
                }
                TunnResult::WriteToTunnelV4(p, _) => {
                    if let Some(reply) = echo_reply(p) {
                        if let TunnResult::WriteToNetwork(p) = t.encapsulate(&reply, &mut out) {
                            send(p, from);
                        }
                    }
                }
                TunnResult::Err(_) if buf[0] == 4 => {
                    // A data message of a session this (restarted) gateway does not have: take
                    // the peer over, as tunnelgate does, by initiating to where it came from.
                    if let TunnResult::WriteToNetwork(p) =
                        t.format_handshake_initiation(&mut out, false)
                    {
                        send(p, from);
                    }
                    continue;
                }
                TunnResult::Err(_) => continue,
                _ => {}
            }
            by_addr.insert(from, i);
            break;
        }
    }
}

/// The worker's messages, with the gateway-initiated handshakes it answered counted on the way.
struct Watch {
    rx: Receiver<Msg>,
    answered: u64,
}

impl Watch {
    fn expect(&mut self, what: &str, mut pred: impl FnMut(&Msg) -> bool) -> Msg {
        loop {
            let m = match self.rx.recv_timeout(Duration::from_secs(20)) {
                Ok(m) => m,
                Err(e) => panic!("waiting for {what}: {e}"),
            };
            match &m {
                Msg::Failed { error, .. } => panic!("worker failed: {error}"),
                Msg::Stats { report, .. } => self.answered += report.counters.hs_answered,
                _ => {}
            }
            if pred(&m) {
                return m;
            }
        }
    }
}

#[test]
fn peers_handshake_ping_rekey_and_come_back_after_a_restart() {
    let gw_secret = keys::private_key("e2e-gateway", 0);
    let gw_sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    gw_sock
        .set_read_timeout(Some(Duration::from_millis(5)))
        .unwrap();
    let endpoint = match gw_sock.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let restart = Arc::new(AtomicU32::new(0));
    let gw = {
        let (stop, restart) = (Arc::clone(&stop), Arc::clone(&restart));
        std::thread::spawn(move || gateway(gw_sock, gw_secret, stop, restart))
    };

    let setup = Setup {
        seed: SEED.into(),
        gateway_key: keys::public_key(&gw_secret),
        endpoint,
        gateway_ip: GATEWAY_IP,
        source: None,
        keepalive: 25,
        ping_ns: 100_000_000,
        tick_ns: 10_000_000,
        stats_ns: 200_000_000,
        working_ns: 300_000_000,
    };
    let (ctx, crx) = mpsc::channel();
    let wake = Arc::new(crate::sys::EventFd::new().unwrap());
    let handle = Handle {
        thread: 0,
        peers: 0..PEERS,
        commands: crx,
        wake: Arc::clone(&wake),
    };
    let (tx, rx) = mpsc::channel();
    let mut rx = Watch { rx, answered: 0 };
    let w = std::thread::spawn(move || worker::run(setup, handle, tx));
    let cmd = |c: Cmd| {
        ctx.send(c).unwrap();
        wake.signal();
    };

    rx.expect(
        "ready",
        |m| matches!(m, Msg::Ready { peers, .. } if *peers == PEERS as usize),
    );
    cmd(Cmd::Start {
        t0: crate::sys::now_ns(),
        burst: true,
    });
    // Every peer handshakes (the burst) and then gets replies.
    rx.expect("all handshaked", |m| matches!(m, Msg::MarkHandshaked { mark: 0, delays_us, .. } if delays_us.len() == PEERS as usize));
    rx.expect("all replied", |m| matches!(m, Msg::MarkReplied { mark: 0, delays_us, .. } if delays_us.len() == PEERS as usize));

    // Everyone rekeys at once: all handshake again, and the pings go on.
    cmd(Cmd::WindowStart {
        t: crate::sys::now_ns(),
    });
    cmd(Cmd::Rekey {
        mark: 1,
        t: crate::sys::now_ns(),
    });
    rx.expect("rekey burst", |m| matches!(m, Msg::Burst { kind: "rekey", initiations, .. } if *initiations == u64::from(PEERS)));
    rx.expect("all rekeyed", |m| matches!(m, Msg::MarkHandshaked { mark: 1, delays_us, .. } if delays_us.len() == PEERS as usize));
    std::thread::sleep(Duration::from_millis(300));
    cmd(Cmd::WindowStop);
    let Msg::Window { counters, rtt, .. } =
        rx.expect("window", |m| matches!(m, Msg::Window { .. }))
    else {
        unreachable!()
    };
    assert!(
        counters.pings_sent > 0 && counters.replies > 0,
        "pings go on during the rekey"
    );
    assert!(rtt.quantile(0.5).is_some());

    // The gateway restarts: its sessions are gone; it takes each peer over when the peer's
    // next ping (on the old session) arrives, and every peer gets replies again.
    assert_eq!(
        rx.answered, 0,
        "no gateway-initiated handshake before the restart"
    );
    restart.store(1, Ordering::Relaxed);
    let t = crate::sys::now_ns();
    cmd(Cmd::Mark { mark: 2, t });
    let Msg::MarkReplied { last_ns, .. } = rx.expect("all back", |m| matches!(m, Msg::MarkReplied { mark: 2, delays_us, .. } if delays_us.len() == PEERS as usize)) else {
        unreachable!()
    };
    assert!(last_ns > t);
    // ... and those were handshakes the gateway initiated, which the peers answered (their own
    // timer would wait 15 s), counted in the stats up to the dump.
    cmd(Cmd::Dump);
    let Msg::Dump { peers, .. } = rx.expect("dump", |m| matches!(m, Msg::Dump { .. })) else {
        unreachable!()
    };
    assert_eq!(peers.len(), PEERS as usize);
    assert!(peers
        .iter()
        .all(|p| p.session && p.replies > 0 && p.handshakes >= 3));
    rx.expect("a stats line", |m| matches!(m, Msg::Stats { .. }));
    rx.expect("a stats line", |m| matches!(m, Msg::Stats { .. }));
    assert!(
        rx.answered >= u64::from(PEERS),
        "takeover initiations answered: {}",
        rx.answered
    );

    cmd(Cmd::Quit);
    rx.expect("stopped", |m| matches!(m, Msg::Stopped));
    w.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    gw.join().unwrap();
}
