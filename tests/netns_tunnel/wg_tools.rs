//! `wg show`, `showconf` and `set` against tunnelgate.

use super::*;

#[test]
#[ignore = "needs root"]
fn wg_show_showconf_and_set_work_against_tunnelgate() {
    let (a, b) = lan();
    let c = Netns::new();
    veth(&a, &["192.168.51.1/24"], &c, &["192.168.51.2/24"]);
    let (tg, wg) = tg_and_wggo(&a, &b);
    let iface = tg.name().to_string();
    assert_pings_both_ways(&a, &b, "before wg show");

    // wg show: the peer with endpoint, handshake and transfer.
    let text = wg_show(&iface);
    for want in [
        format!("interface: {iface}"),
        format!("public key: {}", tg.public_key()),
        format!("listening port: {TG_PORT}"),
        format!("peer: {}", wg.public_key()),
        format!("endpoint: {B_LAN4}:{WG_PORT}"),
        format!("allowed ips: {}, {}", cidr(B_TUN4), cidr(B_TUN6)),
        "latest handshake: ".to_string(),
        "transfer: ".to_string(),
    ] {
        assert!(text.contains(&want), "`wg show` lacks {want:?}:\n{text}");
    }
    let dump = tg.dump();
    assert_eq!(dump.public_key, tg.public_key());
    assert_eq!(dump.private_key, tg.cfg.key.private);
    assert_eq!(dump.listen_port, TG_PORT);
    let p = dump.peer(wg.public_key()).expect("dump lists the peer");
    assert_eq!(p.endpoint.as_deref(), Some(&*format!("{B_LAN4}:{WG_PORT}")));
    assert_eq!(p.allowed_ips, vec![cidr(B_TUN4), cidr(B_TUN6)]);
    let now = clock::wall_now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    assert!(
        p.latest_handshake > 0 && p.latest_handshake <= now + 1 && now - p.latest_handshake < 60,
        "latest handshake {} (now {now})",
        p.latest_handshake
    );
    assert!(p.rx_bytes > 0 && p.tx_bytes > 0, "transfer counters: {p:?}");
    // The counters grow with traffic.
    tcp_transfer(&a, &b, ip_of(B_TUN4), 0, MB, SHORT).expect("1 MB");
    let after = tg.dump();
    let q = after.peer(wg.public_key()).expect("peer");
    assert!(q.tx_bytes >= p.tx_bytes + MB && q.rx_bytes > p.rx_bytes);

    // wg showconf
    let conf = run(&["wg", "showconf", &iface]);
    for want in [
        "[Interface]".to_string(),
        format!("ListenPort = {TG_PORT}"),
        format!("PrivateKey = {}", tg.cfg.key.private),
        "[Peer]".to_string(),
        format!("PublicKey = {}", wg.public_key()),
        format!("AllowedIPs = {}, {}", cidr(B_TUN4), cidr(B_TUN6)),
        format!("Endpoint = {B_LAN4}:{WG_PORT}"),
    ] {
        assert!(
            conf.contains(&want),
            "`wg showconf` lacks {want:?}:\n{conf}"
        );
    }

    // A peer added at runtime passes traffic.
    let wc = WgGo::start(&c, 51822, &[&cidr(C_TUN4)]);
    wc.add_peer(
        &Peer::new(tg.public_key(), &[&cidr(A_TUN4)]).endpoint(&format!("192.168.51.1:{TG_PORT}")),
    );
    assert!(!ping(&a, C_TUN4), "c is reachable before it was added");
    run(&[
        "wg",
        "set",
        &iface,
        "peer",
        wc.public_key(),
        "allowed-ips",
        &cidr(C_TUN4),
        "endpoint",
        "192.168.51.2:51822",
    ]);
    assert!(
        ping_until(&a, C_TUN4, SHORT),
        "peer added with `wg set` is not reachable; stderr:\n{}",
        tg.stderr()
    );
    assert!(ping(&c, A_TUN4), "peer added with `wg set` cannot reach us");
    wait_handshake(&iface, wc.public_key(), SHORT);
    assert!(
        a.exec(&["ip", "route", "show", "dev", &iface])
            .contains(C_TUN4),
        "route for the added peer"
    );

    // ... and a removed one cannot.
    run(&["wg", "set", &iface, "peer", wc.public_key(), "remove"]);
    assert!(
        tg.dump().peer(wc.public_key()).is_none(),
        "peer still listed"
    );
    assert!(!any_ping(&a, C_TUN4, 2), "removed peer still reachable");
    assert!(!any_ping(&c, A_TUN4, 2), "removed peer still gets through");
    wait_until(SHORT, "the removed peer's route is gone", || {
        !a.exec(&["ip", "route", "show", "dev", &iface])
            .contains(C_TUN4)
    });
    // The other peer was not disturbed.
    assert!(ping(&a, B_TUN4));

    // listen-port moves the socket; the peer, told the new port, keeps working.
    let new_port: u16 = 51830;
    run(&["wg", "set", &iface, "listen-port", &new_port.to_string()]);
    assert_eq!(tg.dump().listen_port, new_port);
    assert!(wg_show(&iface).contains(&format!("listening port: {new_port}")));
    let ports = udp_ports(&a);
    assert!(
        ports.contains(&new_port),
        "nothing bound to {new_port}: {ports:?}"
    );
    let released = poll_until(SHORT, || !udp_ports(&a).contains(&TG_PORT));
    assert!(
        released,
        "old port {TG_PORT} still bound after {SHORT:?}: {:?}",
        udp_ports(&a)
    );
    // The old socket's reader thread ended rather than spinning (it once did, at 100% CPU):
    // an idle daemon uses next to no CPU over one second (100 ticks = one core).
    let t0 = cpu_ticks(tg.pid()).expect("cpu ticks");
    std::thread::sleep(Duration::from_secs(1));
    let idle = cpu_ticks(tg.pid()).expect("cpu ticks") - t0;
    assert!(
        idle < 50,
        "idle daemon used {idle} ticks in 1 s after listen-port"
    );
    wg.wg(&[
        "set",
        wg.name(),
        "peer",
        tg.public_key(),
        "endpoint",
        &format!("{A_LAN4}:{new_port}"),
    ]);
    assert!(
        ping_until(&b, A_TUN4, SHORT),
        "b -> a after listen-port change"
    );
    assert!(ping(&a, B_TUN4), "a -> b after listen-port change");
    tcp_transfer(&b, &a, ip_of(A_TUN4), 0, MB, SHORT).expect("1 MB after listen-port change");

    // private-key changes the public key `wg show` prints, and peers must use the new one.
    let new_key = Keypair::generate();
    let key_dir = TempDir::new("newkey");
    let key_file = key_dir.write_secret("private.key", &new_key.private);
    run(&[
        "wg",
        "set",
        &iface,
        "private-key",
        &key_file.display().to_string(),
    ]);
    assert_eq!(
        run(&["wg", "show", &iface, "public-key"]).trim(),
        new_key.public
    );
    assert_eq!(tg.dump().private_key, new_key.private);
    assert!(wg_show(&iface).contains(&format!("public key: {}", new_key.public)));
    wg.remove_peer(tg.public_key());
    wg.add_peer(
        &Peer::new(&new_key.public, &[&cidr(A_TUN4), &cidr(A_TUN6)])
            .endpoint(&format!("{A_LAN4}:{new_port}")),
    );
    assert!(
        ping_until(&b, A_TUN4, SHORT),
        "b -> a with tunnelgate's new key"
    );
    assert!(ping(&a, B_TUN6), "a -> b with the new key");
    wait_handshake(wg.name(), &new_key.public, SHORT);
}
