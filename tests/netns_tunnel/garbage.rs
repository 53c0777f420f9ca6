//! Garbage, truncated and replayed UDP, and malformed UAPI requests.

use super::*;

/// Datagrams to tunnelgate's port captured in `ns` with a raw socket (IPv4, UDP).
pub(crate) struct Capture {
    pub(crate) sock: socket2::Socket,
}

impl Capture {
    pub(crate) fn open(ns: &Netns) -> Capture {
        let sock = ns
            .in_ns(|| {
                socket2::Socket::new(
                    socket2::Domain::IPV4,
                    socket2::Type::RAW,
                    Some(socket2::Protocol::UDP),
                )
            })
            .expect("raw socket");
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        Capture { sock }
    }

    /// The WireGuard payloads sent to `port` seen within `timeout`, until `enough` says stop.
    pub(crate) fn collect(
        &mut self,
        port: u16,
        timeout: Duration,
        mut enough: impl FnMut(&[Vec<u8>]) -> bool,
    ) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65536];
        let deadline = clock::now() + timeout;
        while clock::now() < deadline && !enough(&out) {
            let n = match self.sock.read(&mut buf) {
                Ok(n) => n,
                Err(_) => continue,
            };
            let pkt = &buf[..n];
            if n < 28 || pkt[9] != 17 {
                continue;
            }
            let ihl = usize::from(pkt[0] & 0x0f) * 4;
            if n < ihl + 8 || u16::from_be_bytes([pkt[ihl + 2], pkt[ihl + 3]]) != port {
                continue;
            }
            out.push(pkt[ihl + 8..].to_vec());
        }
        out
    }
}

#[test]
#[ignore = "needs root"]
fn garbage_truncated_and_replayed_udp_is_dropped_and_counted() {
    let (a, b) = lan();
    let mut cap = Capture::open(&a);
    let (mut tg, wg) = tg_and_wggo(&a, &b);
    // b initiates (so its initiation can be captured), then data flows both ways.
    assert!(ping_until(&b, A_TUN4, SHORT), "b -> a");
    assert_pings_both_ways(&a, &b, "before the garbage");
    let has = |v: &[Vec<u8>], t: u8| v.iter().any(|d| d.first() == Some(&t));
    let mut captured = cap.collect(TG_PORT, Duration::from_secs(2), |v| {
        has(v, 1) && v.iter().filter(|d| d.first() == Some(&4)).count() >= 3
    });
    drop(cap);
    assert!(
        has(&captured, 1),
        "no initiation captured ({} datagrams)",
        captured.len()
    );
    assert!(has(&captured, 4), "no data message captured");
    captured.retain(|d| matches!(d.first(), Some(1) | Some(4)));
    let endpoint_before = tg
        .dump()
        .peer(wg.public_key())
        .and_then(|p| p.endpoint.clone());

    let counted = |tg: &Tunnelgate| dropped(tg, "invalid") + dropped(tg, "unknown_peer");
    let before = counted(&tg);
    let to: SocketAddr = format!("{A_LAN4}:{TG_PORT}").parse().expect("addr");
    let to6: SocketAddr = format!("[{A_LAN6}]:{TG_PORT}").parse().expect("addr");
    let (sent, s, s6) = b.in_ns(|| {
        let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
        let s6 = UdpSocket::bind("[::]:0").expect("bind v6");
        let mut rng = PrngStream::new(0x6761_7262_6167_6521);
        let mut word = [0u8; 8];
        let mut next = |max: usize| {
            rng.fill(&mut word);
            (u64::from_le_bytes(word) % max as u64) as usize
        };
        let mut sent = 0u64;
        let mut send = |d: &[u8], i: usize| {
            let r = if i.is_multiple_of(5) {
                s6.send_to(d, to6)
            } else {
                s.send_to(d, to)
            };
            if r.is_ok() {
                sent += 1;
            }
            // Keep below the socket buffer: a short pause every 50 datagrams.
            if i % 50 == 49 {
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        let mut rng2 = PrngStream::new(42);
        for i in 0..1000 {
            let (kind, len) = match i % 8 {
                0 => (None, 1 + next(1400)),     // random bytes
                1 => (Some(1u8), 148),           // initiation-sized
                2 => (Some(2), 92),              // response-sized
                3 => (Some(3), 64),              // cookie-reply-sized
                4 => (Some(4), 32 + next(1400)), // data with a random index
                5 => (Some(1), 1 + next(147)),   // truncated initiation
                6 => (Some(2), 1 + next(91)),    // truncated response
                _ => (Some(4), 1 + next(31)),    // truncated data
            };
            let mut d = vec![0u8; len];
            rng2.fill(&mut d);
            if let Some(t) = kind {
                d[0] = t;
                for x in d.iter_mut().take(4).skip(1) {
                    *x = 0;
                }
            }
            send(&d, i);
        }
        // Replays of real, captured messages (from another source port: an attacker's).
        for round in 0..20 {
            for d in &captured {
                send(d, 1000 + round);
            }
        }
        (sent, s, s6)
    });
    assert!(sent >= 1000, "sent {sent} datagrams");

    // Wait until the daemon has worked through them all (the count stops moving).
    let deadline = clock::now() + SHORT;
    let mut last = (counted(&tg), clock::now());
    while counted(&tg) - before < sent && clock::now() < deadline {
        std::thread::sleep(POLL);
        let c = counted(&tg);
        if c != last.0 {
            last = (c, clock::now());
        } else if tunnelgate::shell::clock::since(last.1) > Duration::from_millis(500) {
            break;
        }
    }
    let got = counted(&tg) - before;
    // Handshake messages with a valid MAC1 (the replayed initiation) may be answered with a
    // cookie reply instead (the rate limiter under load): that is not a drop, but a reply.
    let mut replies = 0u64;
    let mut buf = [0u8; 2048];
    for sock in [&s, &s6] {
        sock.set_nonblocking(true).expect("nonblocking");
        while let Ok((n, _)) = sock.recv_from(&mut buf) {
            assert_eq!(
                (n, buf[0]),
                (64, 3),
                "only cookie replies go back to garbage"
            );
            replies += 1;
        }
    }
    eprintln!(
        "garbage: sent {sent}, counted {got} (invalid {}, unknown_peer {}), cookie replies {replies}",
        dropped(&tg, "invalid"),
        dropped(&tg, "unknown_peer")
    );
    assert!(
        got + replies >= sent,
        "only {got} of {sent} bad datagrams were counted ({replies} cookie replies)"
    );

    assert!(tg.is_running(), "tunnelgate died:\n{}", tg.stderr());
    // The replays did not move the peer's endpoint nor start a new session.
    let p = tg.dump();
    let p = p.peer(wg.public_key()).expect("peer");
    assert_eq!(p.endpoint, endpoint_before, "a replay moved the endpoint");
    assert_pings_both_ways(&a, &b, "after the garbage");
    tcp_transfer(&a, &b, ip_of(B_TUN4), 0, 5 * MB, SHORT).expect("5 MB after the garbage");
    let (code, _) = tg.health_get("/healthz").expect("healthz");
    assert_eq!(code, 200);
}

#[test]
#[ignore = "needs root"]
fn malformed_uapi_requests_get_an_errno_and_the_daemon_keeps_serving() {
    let (a, b) = lan();
    let (mut tg, wg) = tg_and_wggo(&a, &b);
    let iface = tg.name().to_string();
    assert_pings_both_ways(&a, &b, "before the bad requests");
    let before = tg.dump();
    // UAPI keys are hex on the wire.
    let peer_hex = hex::encode(
        base64::engine::general_purpose::STANDARD
            .decode(wg.public_key())
            .expect("base64 key"),
    );
    assert_eq!(peer_hex.len(), 64, "hex of the peer key: {peer_hex:?}");

    // The exact request of the brief, on its own connection.
    let reply = uapi_request(&iface, b"set=1\nbogus=1\n\n");
    let errno = errno_of(&reply).unwrap_or_else(|| panic!("no errno in reply {reply:?}"));
    assert_ne!(errno, 0, "bogus key accepted: {reply:?}");

    for request in [
        "set=1\nprivate_key=zz\n\n".to_string(),
        "set=1\nlisten_port=notaport\n\n".to_string(),
        "set=1\nlisten_port=99999\n\n".to_string(),
        format!("set=1\npublic_key={peer_hex}\nallowed_ip=not-a-cidr\n\n"),
        format!("set=1\npublic_key={peer_hex}\nendpoint=nowhere\n\n"),
        format!("set=1\npublic_key={peer_hex}\npersistent_keepalive_interval=-5\n\n"),
        "set=1\npublic_key=abcd\n\n".to_string(),
        "set=1\nno-equals-sign\n\n".to_string(),
    ] {
        let reply = uapi_request(&iface, request.as_bytes());
        let errno = errno_of(&reply);
        assert!(
            errno.is_some_and(|e| e != 0),
            "request {request:?} got {reply:?}"
        );
    }

    // On one connection: a bad request, then a good one is still answered.
    let mut s = UnixStream::connect(wg_socket(&iface)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(b"set=1\nbogus=1\n\n").expect("write");
    let r = read_reply(&mut s);
    assert!(errno_of(&r).is_some_and(|e| e != 0), "{r:?}");
    s.write_all(b"get=1\n\n").expect("write");
    let r = read_reply(&mut s);
    assert!(
        r.contains(&format!("listen_port={TG_PORT}")) && r.ends_with("errno=0\n\n"),
        "get after a bad set on the same connection: {r:?}"
    );
    drop(s);

    // Binary garbage and a connection closed mid-request, then a huge line: no crash.
    for junk in [
        &[0u8, 159, 146, 150, 255, 10, 10][..],
        b"get=1\n",
        b"set=1\npublic_key=",
    ] {
        let mut s = UnixStream::connect(wg_socket(&iface)).expect("connect");
        let _ = s.write_all(junk);
    }
    let big = vec![b'a'; 4 * 1024 * 1024];
    let _ = uapi_request(&iface, &big);

    // Still serving, and nothing was changed by the bad requests.
    assert!(tg.is_running(), "tunnelgate died:\n{}", tg.stderr());
    let after = tg.dump();
    assert_eq!(after.listen_port, before.listen_port);
    assert_eq!(after.private_key, before.private_key);
    assert_eq!(after.peers.len(), 1);
    let p = after.peer(wg.public_key()).expect("peer");
    assert_eq!(p.allowed_ips, vec![cidr(B_TUN4), cidr(B_TUN6)]);
    assert_eq!(
        p.endpoint,
        before
            .peer(wg.public_key())
            .and_then(|p| p.endpoint.clone())
    );
    assert!(wg_show(&iface).contains(&format!("peer: {}", wg.public_key())));
    assert_pings_both_ways(&a, &b, "after the bad requests");
}
