//! Unknown keys and spoofed inner sources are refused; a peer that roams is followed.

use super::*;

#[test]
#[ignore = "needs root"]
fn unknown_key_gets_no_handshake_and_spoofed_source_is_dropped() {
    let (a, b) = lan();
    let c = Netns::new();
    veth(&a, &["192.168.51.1/24"], &c, &["192.168.51.2/24"]);
    let (mut tg, wg) = tg_and_wggo(&a, &b);
    assert_pings_both_ways(&a, &b, "the configured peer");

    // A wireguard-go with a key tunnelgate does not know, claiming the configured peer's
    // tunnel address, pointed at tunnelgate.
    let unknown_before = dropped(&tg, "unknown_peer") + dropped(&tg, "invalid");
    let rogue = WgGo::start(&c, 51823, &[&cidr(B_TUN4)]);
    rogue.add_peer(
        &Peer::new(tg.public_key(), &[&cidr(A_TUN4)]).endpoint(&format!("192.168.51.1:{TG_PORT}")),
    );
    assert!(
        !any_ping(&c, A_TUN4, 3),
        "a peer with an unknown key got through"
    );
    let rd = rogue.dump();
    let rp = rd.peer(tg.public_key()).expect("rogue lists tunnelgate");
    assert_eq!(rp.latest_handshake, 0, "rogue completed a handshake");
    assert_eq!(rp.rx_bytes, 0, "tunnelgate answered the rogue");
    let dump = tg.dump();
    assert_eq!(dump.peers.len(), 1, "tunnelgate learned a peer: {dump:?}");
    assert!(dump.peer(rogue.public_key()).is_none());
    wait_until(SHORT, "the rogue's initiations are counted", || {
        dropped(&tg, "unknown_peer") + dropped(&tg, "invalid") > unknown_before
    });
    // The real peer is unaffected.
    assert!(ping(&a, B_TUN4));

    // An inner source outside the sender's allowed IPs is dropped.
    let spoof = "100.64.9.9";
    b.exec(&["ip", "addr", "add", &cidr(spoof), "dev", wg.name()]);
    let bad_before = dropped(&tg, "bad_source");
    assert!(
        ping_from(&b, B_TUN4, A_TUN4),
        "ping from the allowed source"
    );
    assert!(
        !(0..3).any(|_| ping_from(&b, spoof, A_TUN4)),
        "ping from a source outside allowed_ips got an answer"
    );
    wait_until(SHORT, "bad_source drops are counted", || {
        dropped(&tg, "bad_source") >= bad_before + 3
    });
    // Direct proof that the spoofed packets never reached tunnelgate's side: a UDP receiver
    // sees the allowed source only.
    let rx = a
        .in_ns(|| UdpSocket::bind(SocketAddr::new(ip_of(A_TUN4), 0)))
        .expect("bind receiver");
    rx.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let to = rx.local_addr().expect("addr");
    b.in_ns(|| {
        for (src, msg) in [(spoof, &b"spoofed"[..]), (B_TUN4, &b"legit"[..])] {
            let s = UdpSocket::bind(SocketAddr::new(ip_of(src), 0)).expect("bind sender");
            for _ in 0..5 {
                s.send_to(msg, to).expect("send");
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = clock::now() + Duration::from_secs(3);
    let mut buf = [0u8; 64];
    while clock::now() < deadline && seen.len() < 5 {
        if let Ok((n, from)) = rx.recv_from(&mut buf) {
            seen.push((buf[..n].to_vec(), from.ip()));
        }
    }
    assert!(
        seen.iter()
            .any(|(m, ip)| m == b"legit" && *ip == ip_of(B_TUN4)),
        "the allowed source's datagrams arrive: {seen:?}"
    );
    assert!(
        !seen.iter().any(|(m, _)| m == b"spoofed"),
        "a spoofed datagram arrived: {seen:?}"
    );
    assert!(tg.is_running());
}

#[test]
#[ignore = "needs root"]
fn peer_that_moves_to_a_new_port_and_address_keeps_working() {
    let (a, b) = lan();
    let (tg, wg) = tg_and_wggo(&a, &b);
    assert_pings_both_ways(&a, &b, "before roaming");
    let ep = |tg: &Tunnelgate| {
        tg.dump()
            .peer(wg.public_key())
            .and_then(|p| p.endpoint.clone())
    };
    assert_eq!(ep(&tg).as_deref(), Some(&*format!("{B_LAN4}:{WG_PORT}")));

    // New UDP port.
    let roamed: u16 = 51899;
    wg.wg(&["set", wg.name(), "listen-port", &roamed.to_string()]);
    assert_eq!(wg.listen_port(), roamed);
    assert!(
        ping_until(&b, A_TUN4, SHORT),
        "b -> a after b moved to port {roamed}"
    );
    let want = format!("{B_LAN4}:{roamed}");
    wait_until(SHORT, "tunnelgate learns the new port", || {
        ep(&tg).as_deref() == Some(want.as_str())
    });
    assert!(wg_show(tg.name()).contains(&format!("endpoint: {want}")));
    assert!(ping(&a, B_TUN4), "a -> b after roaming");
    assert!(ping(&a, B_TUN6), "a -> b v6 after roaming");
    tcp_transfer(&a, &b, ip_of(B_TUN4), 0, 5 * MB, SHORT).expect("5 MB after roaming");

    // New address too (the peer's network changed), over IPv6 this time.
    let link = b
        .exec(&["ip", "-o", "-4", "addr", "show"])
        .lines()
        .find(|l| l.contains(B_LAN4))
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
        .expect("b's veth");
    b.exec(&["ip", "addr", "del", &format!("{B_LAN4}/24"), "dev", &link]);
    wg.wg(&[
        "set",
        wg.name(),
        "peer",
        tg.public_key(),
        "endpoint",
        &format!("[{A_LAN6}]:{TG_PORT}"),
    ]);
    assert!(
        ping_until(&b, A_TUN4, SHORT),
        "b -> a after b moved to IPv6"
    );
    let want6 = format!("[{B_LAN6}]:{roamed}");
    wait_until(SHORT, "tunnelgate learns the new address", || {
        ep(&tg).as_deref() == Some(want6.as_str())
    });
    assert!(ping(&a, B_TUN4), "a -> b after the address change");
}
