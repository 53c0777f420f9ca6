//! tunnelgate against wireguard-go, and tunnelgate against tunnelgate.

use super::*;

#[test]
#[ignore = "needs root"]
fn tunnelgate_and_wireguard_go_pass_pings_and_100mb_byte_identical() {
    let (a, b) = lan();
    let (tg, wg) = tg_and_wggo(&a, &b);
    assert_pings_both_ways(&a, &b, "tunnelgate <-> wireguard-go");
    wait_handshake(tg.name(), wg.public_key(), SHORT);
    wait_handshake(wg.name(), tg.public_key(), SHORT);

    let t = tcp_transfer(&a, &b, ip_of(B_TUN4), 0, 100 * MB, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("100 MB tunnelgate -> wireguard-go over v4: {e}"));
    assert_eq!(t.bytes, 100 * MB);
    eprintln!(
        "100 MB tunnelgate -> wireguard-go: {:.0} Mbit/s ({:.1} s)",
        t.mbit_per_s(),
        t.secs
    );
    let t = tcp_transfer(&b, &a, ip_of(A_TUN6), 0, 20 * MB, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("20 MB wireguard-go -> tunnelgate over v6: {e}"));
    assert_eq!(t.bytes, 20 * MB);
    eprintln!(
        "20 MB wireguard-go -> tunnelgate (v6): {:.0} Mbit/s ({:.1} s)",
        t.mbit_per_s(),
        t.secs
    );
    assert_eq!(dropped(&tg, "bad_source"), 0);
}

#[test]
#[ignore = "needs root"]
fn two_tunnelgates_pass_pings_and_a_byte_identical_transfer() {
    let (a, b) = lan();
    let cfg_b_key = Keypair::generate();
    let cfg_a = tg_config(&cfg_b_key.public, WG_PORT);
    let mut cfg_b = TgConfig::new(WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6)]).peer(
        Peer::new(cfg_a.public_key(), &[&cidr(A_TUN4), &cidr(A_TUN6)])
            .endpoint(&format!("[{A_LAN6}]:{TG_PORT}")),
    );
    cfg_b.key = cfg_b_key;
    let tg_a = Tunnelgate::start(&a, cfg_a);
    let tg_b = Tunnelgate::start(&b, cfg_b);

    assert_pings_both_ways(&a, &b, "tunnelgate <-> tunnelgate");
    wait_handshake(tg_a.name(), tg_b.public_key(), SHORT);
    wait_handshake(tg_b.name(), tg_a.public_key(), SHORT);

    let t = tcp_transfer(&a, &b, ip_of(B_TUN4), 0, 100 * MB, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("100 MB a -> b over v4: {e}"));
    eprintln!(
        "100 MB tunnelgate -> tunnelgate: {:.0} Mbit/s ({:.1} s)",
        t.mbit_per_s(),
        t.secs
    );
    let t = tcp_transfer(&b, &a, ip_of(A_TUN6), 0, 20 * MB, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("20 MB b -> a over v6: {e}"));
    assert_eq!(t.bytes, 20 * MB);

    udp_burst_arrives_whole_and_in_order(&a, &b, tg_b.name());

    let da = tg_a.dump();
    let pa = da.peer(tg_b.public_key()).expect("a lists b");
    assert!(pa.latest_handshake > 0 && pa.rx_bytes > 20 * MB && pa.tx_bytes > 100 * MB);
    let pb = tg_b.dump();
    let pb = pb.peer(tg_a.public_key()).expect("b lists a");
    assert!(pb.rx_bytes > 100 * MB && pb.tx_bytes > 20 * MB);
}

/// One UDP GSO send of 40 x 1200 bytes from `a` to `b` through the tunnel: the sending daemon
/// splits the USO super-packet it reads, the receiving one coalesces the decrypted datagrams into
/// one TUN write where the kernel takes USO (6.2+). Every datagram must arrive intact, in order.
pub(crate) fn udp_burst_arrives_whole_and_in_order(a: &Netns, b: &Netns, b_tun: &str) {
    const SEGMENT: usize = 1200;
    const COUNT: usize = 40;
    let rx = b
        .in_ns(|| UdpSocket::bind((ip_of(B_TUN4), 0)))
        .expect("bind the UDP receiver");
    socket2::SockRef::from(&rx)
        .set_recv_buffer_size(4 << 20)
        .expect("receive buffer");
    rx.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    let to = rx.local_addr().expect("receiver address");
    let tx = a
        .in_ns(|| UdpSocket::bind((ip_of(A_TUN4), 0)))
        .expect("bind the UDP sender");
    nix::sys::socket::setsockopt(
        &tx,
        nix::sys::socket::sockopt::UdpGsoSegment,
        &(SEGMENT as i32),
    )
    .expect("UDP_SEGMENT");
    let payload: Vec<u8> = (0..SEGMENT * COUNT)
        .map(|i| (i / SEGMENT) as u8 ^ (i as u8).wrapping_mul(7))
        .collect();
    let rx_packets = |ns: &Netns| -> u64 {
        ns.exec(&[
            "cat",
            &format!("/sys/class/net/{b_tun}/statistics/rx_packets"),
        ])
        .trim()
        .parse()
        .unwrap_or(0)
    };
    let written_before = rx_packets(b);
    tx.send_to(&payload, to).expect("one GSO send");
    let mut buf = [0u8; 2048];
    for i in 0..COUNT {
        let n = rx
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("datagram {i} of {COUNT} never arrived: {e}"));
        assert_eq!(
            &buf[..n],
            &payload[i * SEGMENT..(i + 1) * SEGMENT],
            "datagram {i} differs or is out of order"
        );
    }
    // For the log: how many TUN writes the receiving daemon needed for the 40 datagrams.
    eprintln!(
        "UDP burst: {COUNT} datagrams in {} TUN write(s)",
        rx_packets(b) - written_before
    );
}
