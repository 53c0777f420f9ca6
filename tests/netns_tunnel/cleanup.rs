//! SIGTERM, and a start that fails, leave nothing behind.

use super::*;

/// What a namespace's routing state looks like (rules of both families and every route).
pub(crate) fn routing_state(ns: &Netns) -> (String, String, String) {
    let (r4, r6) = ip_rules(ns);
    (r4, r6, all_routes(ns))
}

pub(crate) fn assert_nothing_left(ns: &Netns, iface: &str, before: &(String, String, String)) {
    assert!(!ns.link_exists(iface), "TUN device {iface} left behind");
    assert!(!wg_socket(iface).exists(), "UAPI socket of {iface} left");
    assert!(
        !status_socket(iface).exists(),
        "status socket of {iface} left"
    );
    let after = routing_state(ns);
    assert_eq!(after.0, before.0, "`ip rule` differs after the stop");
    assert_eq!(after.1, before.1, "`ip -6 rule` differs after the stop");
    assert_eq!(after.2, before.2, "routes differ after the stop");
    assert!(!after.2.contains(iface), "a route via {iface} is left");
}

#[test]
#[ignore = "needs root"]
fn sigterm_and_sigint_remove_device_routes_and_sockets() {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let (a, b) = lan();
        let before = routing_state(&a);
        let (mut tg, _wg) = tg_and_wggo(&a, &b);
        let iface = tg.name().to_string();
        assert_pings_both_ways(&a, &b, "before the stop");
        assert!(wg_socket(&iface).exists());
        assert!(
            status_socket(&iface).exists(),
            "status socket while running"
        );
        assert!(a.routes().contains(&iface), "routes while running");

        let status = if signal == Signal::SIGTERM {
            tg.sigterm()
        } else {
            kill(Pid::from_raw(tg.pid() as i32), signal).expect("kill");
            tg.wait_exit(SHORT).expect("exit after SIGINT")
        };
        assert!(
            status.success(),
            "exit status after {signal}: {status:?}; stderr:\n{}",
            tg.stderr()
        );
        assert_nothing_left(&a, &iface, &before);
    }
}

#[test]
#[ignore = "needs root"]
fn default_route_peer_keeps_its_endpoint_reachable_and_sigterm_restores_rules() {
    let (a, b) = lan();
    // The peer's endpoint is reachable only through a's default route (another network), so
    // a default route into the tunnel would cut tunnelgate off from it without the fwmark rule.
    let endpoint4 = "198.51.100.7";
    b.exec(&["ip", "addr", "add", &cidr(endpoint4), "dev", "lo"]);
    a.exec(&["ip", "route", "add", "default", "via", B_LAN4]);
    a.exec(&["ip", "-6", "route", "add", "default", "via", B_LAN6]);
    let before = routing_state(&a);

    let wg = WgGo::start(&b, WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6)]);
    let cfg = TgConfig::new(TG_PORT, &[&cidr(A_TUN4), &cidr(A_TUN6)]).peer(
        Peer::new(wg.public_key(), &["0.0.0.0/0", "::/0"])
            .endpoint(&format!("{endpoint4}:{WG_PORT}")),
    );
    let mut tg = Tunnelgate::start(&a, cfg);
    let iface = tg.name().to_string();
    wg.add_peer(&Peer::new(tg.public_key(), &[&cidr(A_TUN4), &cidr(A_TUN6)]));

    let (r4, r6) = ip_rules(&a);
    for (fam, rules) in [("ip rule", &r4), ("ip -6 rule", &r6)] {
        assert!(
            rules.contains("suppress_prefixlength 0"),
            "`{fam}` lacks the suppress rule:\n{rules}"
        );
        assert!(
            rules
                .lines()
                .any(|l| l.contains("not from all fwmark") && l.contains("lookup")),
            "`{fam}` lacks the fwmark rule:\n{rules}"
        );
    }
    let mark_table = r4
        .lines()
        .find(|l| l.contains("not from all fwmark"))
        .and_then(|l| l.split_whitespace().last())
        .expect("table of the fwmark rule")
        .to_string();
    let table = a.exec(&["ip", "route", "show", "table", &mark_table]);
    assert!(
        table.contains(&format!("default dev {iface}")),
        "table {mark_table}: {table}"
    );
    let table6 = a.exec(&["ip", "-6", "route", "show", "table", &mark_table]);
    assert!(
        table6.contains(&format!("default dev {iface}")),
        "v6 table {mark_table}: {table6}"
    );
    assert_ne!(
        tg.dump().fwmark,
        "off",
        "the WireGuard socket carries a mark"
    );

    // tunnelgate initiates (wireguard-go has no endpoint for it): its encrypted packets must
    // leave by the real default route, not its own tunnel.
    assert!(
        ping_until(&a, B_TUN4, SHORT),
        "a -> b through the default-route peer; stderr:\n{}",
        tg.stderr()
    );
    wait_handshake(&iface, wg.public_key(), SHORT);
    assert!(ping(&a, B_TUN6), "a -> b v6");
    assert!(ping(&b, A_TUN4), "b -> a");
    // Anything else also goes into the tunnel now (that is what a default route means): the
    // peer's own underlay address, unmarked, is routed through it too.
    let tun_tx_before = tg.dump().peer(wg.public_key()).expect("peer").tx_bytes;
    let _ = ping(&a, "203.0.113.1");
    assert!(
        tg.dump().peer(wg.public_key()).expect("peer").tx_bytes > tun_tx_before,
        "traffic to an arbitrary address was not routed into the tunnel"
    );

    let status = tg.sigterm();
    assert!(status.success(), "exit status {status:?}:\n{}", tg.stderr());
    assert_nothing_left(&a, &iface, &before);
    assert!(
        a.exec(&["ip", "route", "show", "table", &mark_table])
            .trim()
            .is_empty(),
        "table {mark_table} is not empty"
    );
}

/// Starts tunnelgate in `ns` expecting it to fail: returns its stderr after checking exit 1.
pub(crate) fn start_expecting_failure(ns: &Netns, cfg: TgConfig) -> String {
    let mut tg = Tunnelgate::spawn(ns, cfg);
    let status = tg.wait_exit(SHORT).unwrap_or_else(|| {
        panic!(
            "tunnelgate should have failed to start; stderr:\n{}",
            tg.stderr()
        )
    });
    let stderr = tg.stderr();
    assert_eq!(status.code(), Some(1), "exit code; stderr:\n{stderr}");
    stderr
}

pub(crate) fn assert_no_trace(ns: &Netns, iface: &str, before: &(String, String, String)) {
    assert!(!wg_socket(iface).exists(), "UAPI socket {iface} left");
    assert!(!status_socket(iface).exists(), "status socket {iface} left");
    let after = routing_state(ns);
    assert_eq!(after, *before, "routes or rules changed");
}

#[test]
#[ignore = "needs root"]
fn failed_starts_leave_nothing_behind() {
    let (a, b) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&cidr(B_TUN4)]);

    // The interface name is taken by another link: refused, the link untouched.
    let cfg = tg_config(wg.public_key(), WG_PORT);
    let name = cfg.name.clone();
    // (A veth: the dummy module is not available everywhere.)
    let other_end = unique_name("tgv");
    a.exec(&[
        "ip", "link", "add", &name, "type", "veth", "peer", "name", &other_end,
    ]);
    a.exec(&["ip", "addr", "add", "10.255.0.1/24", "dev", &name]);
    let link_before = a.exec(&["ip", "-d", "addr", "show", "dev", &name]);
    let before = routing_state(&a);
    let stderr = start_expecting_failure(&a, cfg);
    assert!(
        stderr.contains(&name) && stderr.contains("already exists"),
        "the error names the interface: {stderr}"
    );
    assert_eq!(
        a.exec(&["ip", "-d", "addr", "show", "dev", &name]),
        link_before,
        "the existing link was changed"
    );
    assert!(link_before.contains("veth") && link_before.contains("10.255.0.1/24"));
    assert_no_trace(&a, &name, &before);
    a.exec(&["ip", "link", "del", &name]);

    // The health port is taken.
    let before = routing_state(&a);
    let health = a
        .in_ns(|| TcpListener::bind("127.0.0.1:9002"))
        .expect("occupy the health port");
    let cfg = tg_config(wg.public_key(), WG_PORT);
    let name = cfg.name.clone();
    let stderr = start_expecting_failure(&a, cfg);
    assert!(
        stderr.contains("health.listen") && stderr.contains("9002"),
        "the error names the health address: {stderr}"
    );
    assert!(
        !a.link_exists(&name),
        "TUN device left after a failed start"
    );
    assert_no_trace(&a, &name, &before);
    drop(health);

    // The WireGuard port is taken: this fails after the TUN device was created, which must
    // be rolled back.
    let udp = a
        .in_ns(|| UdpSocket::bind(("::", TG_PORT)))
        .expect("occupy the WireGuard port");
    let cfg = tg_config(wg.public_key(), WG_PORT);
    let name = cfg.name.clone();
    let stderr = start_expecting_failure(&a, cfg);
    assert!(
        stderr.contains(&TG_PORT.to_string()),
        "the error names the port: {stderr}"
    );
    assert!(
        !a.link_exists(&name),
        "TUN device left after a failed start"
    );
    assert_no_trace(&a, &name, &before);
    drop(udp);

    // And with everything free, the same configuration starts.
    let tg = Tunnelgate::start(&a, tg_config(wg.public_key(), WG_PORT));
    assert!(a.link_is_up(tg.name()));
}
