//! A handshake flood (issue 15): thousands of handshake initiations with a valid mac1 (made by
//! real WireGuard sessions for random keys towards the daemon's public key) from a test
//! namespace, at a bounded rate for a few seconds. An established peer's ping must keep
//! answering, the daemon must answer the flood with cookie replies (proof that mac1 passed and
//! the load limit kicked in), and it must log nothing per packet.
//!
//! ```text
//!  client (wireguard-go) --192.168.75.0/24-- proxy (tunnelgate) --192.168.76.0/24-- flooder
//!  tunnel 100.75.0.2                         tunnel 100.75.0.1                    (this test)
//! ```
//!
//! Run as root: `cargo test --all-features --test netns_flood -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::net::UdpSocket;
use std::time::Duration;
use tunnelgate::config::{decode_key, PublicKey, SecretKey};
use tunnelgate::core::wg::{Limiter, Outcome, Tunnel, MIN_OUTPUT};
use tunnelgate::shell::clock;
use tunnelgate::shell::keys::GenerateKey as _;

/// Distinct initiations made up front, then sent round-robin.
const DISTINCT: usize = 300;
/// Packets per second and seconds of flood: 1,000/s is 5x the daemon's cookie threshold (200/s).
const RATE: u32 = 1000;
const SECONDS: u32 = 4;

/// `DISTINCT` handshake initiations from fresh random keys to `responder`.
fn initiations(responder: &PublicKey) -> Vec<Vec<u8>> {
    (0..DISTINCT)
        .filter_map(|i| {
            let key = SecretKey::generate();
            let limiter = Limiter::new(&key.public_key(), &mut rand_core::OsRng);
            let mut t = Tunnel::new(
                &key,
                responder,
                None,
                None,
                i as u32 + 1,
                &limiter,
                Box::new(rand_core::OsRng),
            );
            let mut buf = vec![0u8; MIN_OUTPUT];
            match t.initiate(&mut buf) {
                Outcome::Network(m) => Some(m.to_vec()),
                _ => None,
            }
        })
        .collect()
}

#[test]
#[ignore = "needs root"]
fn handshake_flood_keeps_an_established_peer_and_the_log_quiet() {
    let client = Netns::new();
    let proxy = Netns::new();
    let flooder = Netns::new();
    veth(&proxy, &["192.168.75.1/24"], &client, &["192.168.75.2/24"]);
    veth(&proxy, &["192.168.76.1/24"], &flooder, &["192.168.76.2/24"]);
    let wg = WgGo::start(&client, 0, &["100.75.0.2/32"]);
    let cfg = TgConfig::new(51820, &["100.75.0.1/32"])
        .peer(Peer::new(wg.public_key(), &["100.75.0.2/32"]));
    let tg = Tunnelgate::start(&proxy, cfg);
    wg.add_peer(
        &Peer::new(tg.public_key(), &["100.75.0.1/32"])
            .endpoint("192.168.75.1:51820")
            .keepalive(1),
    );
    wait_handshake(wg.name(), tg.public_key(), Duration::from_secs(10));
    assert!(ping_until(&client, "100.75.0.1", Duration::from_secs(5)));

    let responder = PublicKey(decode_key(tg.public_key()).expect("daemon public key"));
    let packets = initiations(&responder);
    assert_eq!(packets.len(), DISTINCT, "boringtun made every initiation");
    let log_before = tg.stderr().lines().count();
    let cpu_before = cpu_ticks(tg.pid()).unwrap_or(0);

    let flood = flooder.thread(move || -> Result<(u64, u64), String> {
        let sock = UdpSocket::bind("192.168.76.2:0").map_err(|e| e.to_string())?;
        sock.set_nonblocking(true).map_err(|e| e.to_string())?;
        let to = "192.168.76.1:51820";
        let (mut sent, mut cookies) = (0u64, 0u64);
        let mut buf = [0u8; 256];
        let start = clock::now();
        let batch = RATE / 100;
        for tick in 0..(SECONDS * 100) {
            for i in 0..batch {
                let p = &packets[(tick * batch + i) as usize % packets.len()];
                if sock.send_to(p, to).is_ok() {
                    sent += 1;
                }
            }
            while let Ok((n, _)) = sock.recv_from(&mut buf) {
                if n == 64 && buf[0] == 3 {
                    cookies += 1;
                }
            }
            // Pace at RATE: sleep until this tick's slot is over.
            let due = Duration::from_millis(10 * u64::from(tick + 1));
            if let Some(wait) = due.checked_sub(tunnelgate::shell::clock::since(start)) {
                std::thread::sleep(wait);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        while let Ok((n, _)) = sock.recv_from(&mut buf) {
            if n == 64 && buf[0] == 3 {
                cookies += 1;
            }
        }
        Ok((sent, cookies))
    });

    // The established peer keeps answering throughout.
    let (mut pings, mut answered) = (0, 0);
    let start = clock::now();
    while tunnelgate::shell::clock::since(start) < Duration::from_secs(u64::from(SECONDS)) {
        pings += 1;
        // One probe: up to 3 echo requests, answered within 2 s (single pings are lost to a
        // loaded 2-core machine's scheduling even without a flood).
        let probe = client.output(&[
            "ping",
            "-n",
            "-q",
            "-c",
            "3",
            "-i",
            "0.2",
            "-w",
            "2",
            "100.75.0.1",
        ]);
        if probe.success() {
            answered += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (sent, cookies) = flood.join().expect("flood thread").expect("flood socket");
    let cpu = cpu_ticks(tg.pid()).unwrap_or(0) - cpu_before;
    let drops: Vec<String> = tg
        .metrics()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("tunnelgate_") && l.contains("drop"))
        .map(String::from)
        .collect();
    eprintln!(
        "flood: {sent} initiations, {cookies} cookie replies, {answered}/{pings} pings, \
         daemon CPU {cpu} ticks; drops:\n{}",
        drops.join("\n")
    );
    assert!(
        sent >= u64::from(RATE * SECONDS) * 9 / 10,
        "the flood went out: {sent} initiations"
    );
    assert!(
        answered * 100 >= pings * 95,
        "the established peer answered {answered}/{pings} probes during the flood"
    );
    assert!(
        cookies > 0,
        "the daemon answers a flood of valid-mac1 initiations with cookie replies ({sent} sent)"
    );
    let logged: Vec<String> = tg
        .stderr()
        .lines()
        .skip(log_before)
        .map(String::from)
        .collect();
    assert!(
        logged.len() <= 5,
        "{sent} flood packets gave {} log lines (none per packet):\n{}",
        logged.len(),
        logged.join("\n")
    );
    assert!(tg.health_get("/healthz").map(|r| r.0) == Ok(200));
}
