//! Proves the netns test harness (tests/common): two wireguard-go peers in two namespaces joined by
//! veth pass IPv4/IPv6 pings, a byte-identical 20 MB TCP transfer and UDP, and leave nothing behind.
//!
//! Run as root: `cargo test --test netns_harness -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::Duration;

const MB: u64 = 1024 * 1024;

#[test]
#[ignore = "needs root"]
fn two_wireguard_go_peers_over_veth() {
    let (ns_names, ifaces, pids);
    {
        let a = Netns::new();
        let b = Netns::new();
        let link = veth(
            &a,
            &["192.168.77.1/24", "fd77::1/64"],
            &b,
            &["192.168.77.2/24", "fd77::2/64"],
        );
        assert!(a.link_is_up(&link.a_name) && b.link_is_up(&link.b_name));
        assert!(ping(&a, "192.168.77.2"), "underlay v4 ping");
        assert!(
            ping_until(&a, "fd77::2", Duration::from_secs(5)),
            "underlay v6 ping"
        );

        let wa = WgGo::start(&a, 51820, &["100.90.0.1/32", "fd90::1/128"]);
        let wb = WgGo::start(&b, 0, &["100.90.0.2/32", "fd90::2/128"]);
        let b_port = wb.listen_port();
        assert_ne!(b_port, 0, "random listen port is reported");
        // b over IPv6 underlay, a over IPv4: both families of endpoint work.
        wa.add_peer(
            &Peer::new(wb.public_key(), &["100.90.0.2/32", "fd90::2/128"])
                .endpoint(&format!("[fd77::2]:{b_port}")),
        );
        wb.add_peer(
            &Peer::new(wa.public_key(), &["100.90.0.1/32", "fd90::1/128"])
                .endpoint("192.168.77.1:51820")
                .keepalive(25),
        );

        assert!(
            ping_until(&a, "100.90.0.2", Duration::from_secs(10)),
            "tunnel v4 a->b"
        );
        assert!(ping(&b, "100.90.0.1"), "tunnel v4 b->a");
        assert!(
            ping_until(&a, "fd90::2", Duration::from_secs(5)),
            "tunnel v6 a->b"
        );
        assert!(ping(&b, "fd90::1"), "tunnel v6 b->a");
        wait_handshake(wa.name(), wb.public_key(), Duration::from_secs(5));

        let dump = wa.dump();
        assert_eq!(dump.public_key, wa.public_key());
        assert_eq!(dump.listen_port, 51820);
        let peer = dump.peer(wb.public_key()).expect("a lists b");
        // b's keepalive makes it initiate over IPv4, so a may have roamed b's endpoint to v4.
        let ep = peer.endpoint.as_deref().expect("a knows b's endpoint");
        assert!(
            [
                format!("[fd77::2]:{b_port}"),
                format!("192.168.77.2:{b_port}")
            ]
            .contains(&ep.into()),
            "endpoint {ep}"
        );
        assert_eq!(peer.allowed_ips, vec!["100.90.0.2/32", "fd90::2/128"]);
        assert!(peer.rx_bytes > 0 && peer.tx_bytes > 0);
        assert_eq!(
            wb.dump()
                .peer(wa.public_key())
                .expect("b lists a")
                .persistent_keepalive,
            Some(25)
        );

        let t = tcp_transfer(
            &a,
            &b,
            ip_of("100.90.0.2"),
            0,
            20 * MB,
            Duration::from_secs(60),
        )
        .expect("20 MB over the v4 tunnel");
        assert_eq!(t.bytes, 20 * MB);
        eprintln!("20 MB a->b over wireguard-go: {:.0} Mbit/s", t.mbit_per_s());
        let t6 = tcp_transfer(&b, &a, ip_of("fd90::1"), 0, 4 * MB, Duration::from_secs(30))
            .expect("4 MB over the v6 tunnel");
        assert_eq!(t6.checksum, {
            let mut c = Checksum::default();
            let mut s = PrngStream::new(0x7475_6e6e_656c_6761);
            let mut buf = vec![0u8; (4 * MB) as usize];
            s.fill(&mut buf);
            c.update(&buf);
            c.finish()
        });

        let echo = UdpEcho::start(&b, "[fd90::2]:0".parse().expect("addr"));
        let reply = udp_roundtrip(&a, echo.addr(), b"hello", Duration::from_secs(5));
        assert_eq!(
            reply.as_deref(),
            Some(&b"hello"[..]),
            "udp echo over the tunnel"
        );
        assert_eq!(echo.seen(), vec![echo.seen()[0]]);
        assert_eq!(echo.seen()[0].ip(), ip_of("fd90::1"));

        let tcp = TcpEcho::start(&b, SocketAddr::new(ip_of("100.90.0.2"), 0));
        let back = tcp_roundtrip(&a, tcp.addr(), b"ping over tcp", Duration::from_secs(5))
            .expect("tcp echo");
        assert_eq!(back, b"ping over tcp");
        assert_eq!(tcp.seen()[0].ip(), ip_of("100.90.0.1"));

        // A removed peer passes nothing.
        wa.remove_peer(wb.public_key());
        assert!(!ping(&a, "100.90.0.2"), "removed peer still reachable");

        // A stray process (no guard) is killed with its namespace.
        let stray = a.spawn(&["sleep", "1000"]);
        let stray_pid = stray.pid();
        std::mem::forget(stray);

        ns_names = [a.name().to_string(), b.name().to_string()];
        ifaces = [wa.name().to_string(), wb.name().to_string()];
        pids = [wa.pid(), wb.pid(), stray_pid];
        for i in &ifaces {
            assert!(wg_socket(i).exists());
        }
    }
    for n in &ns_names {
        assert!(!netns_exists(n), "namespace {n} left behind");
    }
    for i in &ifaces {
        assert!(!wg_socket(i).exists(), "socket of {i} left behind");
    }
    for p in pids {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        let alive = stat
            .rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'));
        assert!(!alive, "process {p} left running");
    }
}

#[test]
#[ignore = "needs root"]
fn killed_daemon_socket_is_removed_by_the_guard() {
    let ns = Netns::new();
    let mut wg = WgGo::start(&ns, 0, &["100.91.0.1/32"]);
    let name = wg.name().to_string();
    assert!(!wg.kill9().success());
    assert!(
        wg_socket(&name).exists(),
        "SIGKILL leaves the socket, as a crash would"
    );
    drop(wg);
    assert!(!wg_socket(&name).exists());
}

#[test]
#[ignore = "needs root"]
fn sigterm_reports_exit_status_and_cleans_socket() {
    let ns = Netns::new();
    let mut wg = WgGo::start(&ns, 0, &["100.92.0.1/32"]);
    let name = wg.name().to_string();
    let status = wg.sigterm();
    assert!(
        status.success(),
        "wireguard-go exits 0 on SIGTERM: {status:?}"
    );
    assert!(!wg_socket(&name).exists());
    assert!(!ns.link_exists(&name));
}

#[test]
fn names_are_unique_and_short() {
    let a = unique_name("tgw");
    let b = unique_name("tgw");
    assert_ne!(a, b);
    assert!(a.len() <= 15);
}

#[test]
fn wg_dump_parses() {
    let text = "cHJpdg==\tcHVi\t51820\toff\n\
                cGVlcg==\t(none)\t10.0.0.2:51820\t100.64.0.2/32,fd7a::2/128\t1700000000\t100\t200\t25\n\
                cGVlcjI=\t(none)\t(none)\t(none)\t0\t0\t0\toff\n";
    let d = parse_wg_dump(text).expect("parses");
    assert_eq!(d.listen_port, 51820);
    assert_eq!(d.peers.len(), 2);
    let p = d.peer("cGVlcg==").expect("peer");
    assert_eq!(p.endpoint.as_deref(), Some("10.0.0.2:51820"));
    assert_eq!(p.allowed_ips, vec!["100.64.0.2/32", "fd7a::2/128"]);
    assert_eq!(
        (p.latest_handshake, p.rx_bytes, p.tx_bytes),
        (1700000000, 100, 200)
    );
    assert_eq!(p.persistent_keepalive, Some(25));
    let q = d.peer("cGVlcjI=").expect("peer 2");
    assert!(q.endpoint.is_none() && q.allowed_ips.is_empty() && q.persistent_keepalive.is_none());
}

#[test]
fn prng_and_checksum_do_not_depend_on_chunking() {
    let mut whole = vec![0u8; 1000];
    PrngStream::new(7).fill(&mut whole);
    let mut parts = vec![0u8; 1000];
    let mut s = PrngStream::new(7);
    let mut c = Checksum::default();
    for (lo, hi) in [(0, 3), (3, 11), (11, 500), (500, 501), (501, 1000)] {
        s.fill(&mut parts[lo..hi]);
        c.update(&parts[lo..hi]);
    }
    assert_eq!(whole, parts);
    let mut c2 = Checksum::default();
    c2.update(&whole);
    assert_eq!(c.finish(), c2.finish());
}

#[test]
fn prometheus_samples_are_read_by_name_and_labels() {
    let text = "# HELP a_total An a.\n# TYPE a_total counter\n\
                a_total{x=\"1\"} 2\n\
                a_total{x=\"}\\\" \"} 3 1700000000\n\
                a_totally 100\n\
                b 1.5e3\n";
    assert_eq!(metric(text, "a_total", "x=\"1\""), Some(2.0));
    assert_eq!(metric(text, "a_total", "x=\"}\\\" \""), Some(3.0));
    assert_eq!(metric(text, "a_total", ""), None);
    assert_eq!(metric(text, "b", ""), Some(1500.0));
    assert_eq!(metric_sum(text, "a_total"), 5.0);
    assert_eq!(metric_sum(text, "c"), 0.0);
}
