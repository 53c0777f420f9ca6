//! Takeover end to end in network namespaces, against a real wireguard-go peer pinging the
//! tunnel every 100 ms: tunnelgate killed (SIGKILL) and started again with the same config
//! takes the peer's session over in one round trip instead of the peer's ~15 s; a flood of
//! data messages with random receiver indices from a spoofed source draws no initiation, and
//! one with valid indices draws no more than the stated bounds; two replicas with one key behind
//! a balancer that moves at once hand the client over in one round trip.
//!
//! Run as root: `cargo test --test netns_takeover -- --ignored --test-threads=1`.

#[path = "common/mod.rs"]
mod common;

use base64::Engine as _;
use common::*;
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use tunnelgate::config::{PublicKey, SecretKey};
use tunnelgate::core::session_index::PeerIndices;
use tunnelgate::core::takeover::GLOBAL_PER_SECOND;
use tunnelgate::shell::clock;

const A_LAN4: &str = "192.168.57.1";
const B_LAN4: &str = "192.168.57.2";
const A_LAN6: &str = "fd57::1";
const B_LAN6: &str = "fd57::2";
const A_TUN4: &str = "100.64.7.1";
const B_TUN4: &str = "100.64.7.2";
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;

fn key_bytes(b64: &str) -> [u8; 32] {
    let v = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64 key");
    <[u8; 32]>::try_from(v.as_slice()).expect("32-byte key")
}

/// tunnelgate in `a` with the wireguard-go in `b` as its peer (endpoint both ways), plus
/// `extra` peers that exist only in the config.
fn setup(extra: usize) -> (Netns, Netns, TgConfig, WgGo) {
    let (a, b, _) = lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6);
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/32")]);
    let mut cfg = TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/32")]).peer(
        Peer::new(wg.public_key(), &[&format!("{B_TUN4}/32")])
            .endpoint(&format!("{B_LAN4}:{WG_PORT}")),
    );
    for i in 0..extra {
        let k = Keypair::generate();
        cfg = cfg.peer(Peer::new(
            &k.public,
            &[&format!("10.{}.{}.0/24", 100 + i / 250, i % 250)],
        ));
    }
    cfg.workers = Some(1);
    wg.add_peer(
        &Peer::new(&cfg.key.public, &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    (a, b, cfg, wg)
}

#[test]
#[ignore = "needs root"]
fn a_restarted_tunnelgate_takes_the_pinging_peer_over_at_once() {
    let (a, b, cfg, wg) = setup(0);
    restart_under_pings(&a, &b, cfg, wg.name(), wg.public_key(), "wireguard-go");
}

/// The same with tunnelgate as the client: the peer that keeps sending is tunnelgate too.
#[test]
#[ignore = "needs root"]
fn a_restarted_tunnelgate_takes_a_tunnelgate_client_over_at_once() {
    let (a, b, _) = lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6);
    let client_key = Keypair::generate();
    let mut cfg = TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/32")])
        .peer(Peer::new(&client_key.public, &[&format!("{B_TUN4}/32")]));
    cfg.workers = Some(1);
    let mut client_cfg = TgConfig::new(WG_PORT, &[&format!("{B_TUN4}/32")]).peer(
        Peer::new(&cfg.key.public, &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    client_cfg.key = client_key;
    client_cfg.workers = Some(1);
    let client = Tunnelgate::start(&b, client_cfg);
    restart_under_pings(
        &a,
        &b,
        cfg,
        client.name(),
        client.public_key(),
        "tunnelgate",
    );
}

/// Starts tunnelgate in `a` with `cfg`; while the peer in `b` (interface `peer_iface`, key
/// `peer_public`) pings it every 100 ms, kills it with SIGKILL and starts the same config
/// again; reports the longest silence and asserts the peer was answered soon after the new
/// process was ready, by a takeover it counts.
fn restart_under_pings(
    a: &Netns,
    b: &Netns,
    cfg: TgConfig,
    peer_iface: &str,
    peer_public: &str,
    peer_kind: &str,
) {
    let mut tg = Tunnelgate::start(a, cfg.clone());
    let mut ping = b.spawn(&["ping", "-n", "-D", "-i", "0.1", "-W", "1", A_TUN4]);
    wait_handshake(peer_iface, &cfg.key.public, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));

    let killed_at = unix_now();
    tg.kill9();
    drop(tg); // its UAPI socket goes before the new process makes its own
    let tg = Tunnelgate::spawn(a, cfg.clone());
    tg.wait_ready(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("restart: {e}"));
    let ready_at = unix_now();
    // Long enough for the peer's own re-handshake (~15 s) to show if takeover did nothing.
    let deadline = clock::now() + Duration::from_secs(20);
    let mut first_after = None;
    while clock::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        let times = reply_times(&ping.stdout());
        if let Some(t) = times.iter().find(|t| **t > killed_at) {
            first_after = Some(*t);
            if times.last().is_some_and(|last| *last > t + 2.0) {
                break;
            }
        }
    }
    let _ = ping.kill9();
    let times = reply_times(&ping.stdout());
    let silence = longest_gap_after(&times, killed_at);
    let first = first_after.unwrap_or_else(|| {
        panic!(
            "no ping answered within 20 s of the restart\ntunnelgate:\n{}",
            tg.stderr()
        )
    });
    let after_ready = first - ready_at;
    eprintln!(
        "restart against {peer_kind}: longest silence {silence:.2} s (SIGKILL to first \
         reply); {after_ready:.2} s after the new process was ready ({:.2} s to start)",
        ready_at - killed_at
    );
    assert!(
        after_ready <= 2.0,
        "the peer waited {after_ready:.2} s after the new process was ready\n{}",
        tg.stderr()
    );
    assert!(
        tg.stderr().contains("Takeover"),
        "a takeover line at info:\n{}",
        tg.stderr()
    );
    let status = tg.status_json().expect("status JSON");
    let peer = &status["peers"][0];
    assert_eq!(peer["takeovers_started"], 1, "{status:#}");
    assert_eq!(peer["takeovers_completed"], 1, "{status:#}");
    let metrics = tg.metrics().expect("/metrics");
    let completed = metric(
        &metrics,
        "tunnelgate_peer_takeovers_total",
        &format!("peer=\"{peer_public}\",peer_name=\"\",outcome=\"completed\""),
    );
    assert_eq!(completed, Some(1.0), "{metrics}");
}

/// A data message (type 4) naming `receiver`, with a zero counter and a junk tag.
fn data_message(receiver: u32) -> [u8; 32] {
    let mut m = [0u8; 32];
    m[0] = 4;
    m[4..8].copy_from_slice(&receiver.to_le_bytes());
    m
}

/// Sends `messages` from `socket` to tunnelgate over `secs` seconds, evenly, and counts the
/// handshake initiations (type 1, 148 bytes) that come back to it meanwhile and for a second
/// after.
fn flood(socket: &UdpSocket, messages: &[[u8; 32]], secs: f64) -> (usize, usize) {
    let to: SocketAddr = format!("{A_LAN4}:{TG_PORT}").parse().expect("addr");
    socket
        .set_read_timeout(Some(Duration::from_millis(1)))
        .expect("timeout");
    let start = clock::now();
    let per = Duration::from_secs_f64(secs / messages.len().max(1) as f64);
    let (mut initiations, mut other) = (0, 0);
    let mut buf = [0u8; 2048];
    let mut count = |socket: &UdpSocket| {
        while let Ok((n, _)) = socket.recv_from(&mut buf) {
            if n == 148 && buf[0] == 1 {
                initiations += 1;
            } else {
                other += 1;
            }
        }
    };
    for (i, m) in messages.iter().enumerate() {
        let _ = socket.send_to(m, to);
        let due = start + per * (i as u32 + 1);
        if i % 64 == 0 {
            count(socket);
        }
        if let Some(wait) = due.checked_duration_since(clock::now()) {
            std::thread::sleep(wait);
        }
    }
    let end = clock::now() + Duration::from_secs(1);
    while clock::now() < end {
        count(socket);
    }
    (initiations, other)
}

#[test]
#[ignore = "needs root"]
fn spoofed_indices_draw_no_initiation_unless_they_trace_and_then_within_the_bounds() {
    const PEERS: usize = 400;
    let (a, b, cfg, _wg) = setup(PEERS);
    let tg = Tunnelgate::start(&a, cfg.clone());
    let indices = PeerIndices::new(&SecretKey(key_bytes(&cfg.key.private)));
    // The "victim": a socket in `b` whose address the flood claims as its source.
    b.in_ns(|| {
        let victim = UdpSocket::bind(format!("{B_LAN4}:40000")).expect("bind");

        // Valid indices of every configured peer, each several times over one second: at most
        // one initiation per peer per REKEY_TIMEOUT, and the global cap in all.
        let mut valid = Vec::new();
        let mut placed = std::collections::HashSet::new();
        let mut keys: Vec<PublicKey> = cfg
            .peers
            .iter()
            .map(|p| PublicKey(key_bytes(&p.public_key)))
            .collect();
        keys.sort();
        for k in &keys {
            let i = indices.index_of(k, |i| placed.contains(&i));
            placed.insert(i);
            valid.push(i);
        }
        // Random indices: those that trace to no peer (all but a chance few of 400 in 2^24,
        // left out here) draw nothing.
        let mut seed = 0x9e37_79b9_u32;
        let random: Vec<[u8; 32]> = (0..20_000)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed
            })
            .filter(|i| !placed.contains(&(i >> 8)))
            .map(data_message)
            .collect();
        let (initiations, other) = flood(&victim, &random, 2.0);
        eprintln!("random indices: 20000 data messages in 2 s drew {initiations} initiations, {other} other");
        assert_eq!((initiations, other), (0, 0), "an untraced index is dropped");

        let messages: Vec<[u8; 32]> = (0..10)
            .flat_map(|round| valid.iter().map(move |i| data_message((i << 8) | (round + 1))))
            .collect();
        let sent = messages.len();
        let started = clock::now();
        let (initiations, other) = flood(&victim, &messages, 1.0);
        let secs = (clock::now() - started).as_secs_f64();
        let bytes_in = sent * 32;
        let bytes_out = initiations * 148;
        eprintln!(
            "valid indices of {} peers: {sent} data messages ({bytes_in} B) in {secs:.1} s drew \
             {initiations} initiations ({bytes_out} B, {:.3} B out per B in), {other} other",
            valid.len(),
            bytes_out as f64 / bytes_in as f64
        );
        // A full bucket (one second's worth) plus the refill over the window, and a little
        // for the window's edges.
        let cap = GLOBAL_PER_SECOND as f64 * (1.0 + secs) + 5.0;
        assert!(initiations >= 1, "traced indices take over");
        assert!(
            initiations as f64 <= cap,
            "{initiations} initiations in {secs:.1} s: above the cap ({GLOBAL_PER_SECOND}/s + burst)"
        );
        assert!(initiations <= valid.len(), "at most one per peer per REKEY_TIMEOUT");
    });
    drop(tg);
}

/// Two tunnelgate replicas with one key behind a UDP balancer (nft DNAT, as kube-proxy does);
/// the owner is killed and the balancer moves to the other at once, deleting the flow's
/// conntrack entries. The other replica takes the pinging wireguard-go client over through the
/// balancer's address.
#[test]
#[ignore = "needs root"]
fn failover_behind_an_instant_balancer_takes_the_peer_over_at_once() {
    let (client, lb, r1, r2) = (Netns::new(), Netns::new(), Netns::new(), Netns::new());
    let lb_dev = veth(&client, &["10.9.0.2/24"], &lb, &["10.9.0.1/24"]).b_name;
    veth(&r1, &["10.9.1.2/24"], &lb, &["10.9.1.1/24"]);
    veth(&r2, &["10.9.2.2/24"], &lb, &["10.9.2.1/24"]);
    r1.exec(&["ip", "route", "add", "default", "via", "10.9.1.1"]);
    r2.exec(&["ip", "route", "add", "default", "via", "10.9.2.1"]);
    lb.sysctl("net.ipv4.ip_forward", "1");
    let point = |to: &str| {
        lb.exec_stdin(
            &["nft", "-f", "-"],
            &format!(
                "table ip balancer\ndelete table ip balancer\ntable ip balancer {{\n\
                 chain pre {{ type nat hook prerouting priority -100; \
                 iifname \"{lb_dev}\" udp dport {TG_PORT} dnat to {to}:{TG_PORT}; }}\n}}\n"
            ),
        );
    };
    point("10.9.1.2");

    let wg = WgGo::start(&client, WG_PORT, &[&format!("{B_TUN4}/32")]);
    let mut cfg = TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/32")])
        .peer(Peer::new(wg.public_key(), &[&format!("{B_TUN4}/32")]));
    cfg.workers = Some(1);
    let mut second = cfg.clone();
    second.name = unique_name("tgd");
    let mut first = Tunnelgate::start(&r1, cfg.clone());
    let other = Tunnelgate::start(&r2, second);
    wg.add_peer(
        &Peer::new(&cfg.key.public, &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("10.9.0.1:{TG_PORT}")),
    );
    let mut ping = client.spawn(&["ping", "-n", "-D", "-i", "0.1", "-W", "1", A_TUN4]);
    wait_handshake(wg.name(), &cfg.key.public, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));

    let moved_at = unix_now();
    first.kill9();
    point("10.9.2.2");
    let _ = lb.output(&[
        "conntrack",
        "-D",
        "-p",
        "udp",
        "--orig-port-dst",
        &TG_PORT.to_string(),
    ]);
    let deadline = clock::now() + Duration::from_secs(20);
    while clock::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        let times = reply_times(&ping.stdout());
        let after: Vec<f64> = times.into_iter().filter(|t| *t > moved_at).collect();
        if after
            .last()
            .zip(after.first())
            .is_some_and(|(l, f)| l - f > 2.0)
        {
            break;
        }
    }
    let _ = ping.kill9();
    let times = reply_times(&ping.stdout());
    let silence = longest_gap_after(&times, moved_at);
    let first_after = times.iter().find(|t| **t > moved_at).copied();
    let Some(first_after) = first_after else {
        panic!("no reply within 20 s of the move\n{}", other.stderr());
    };
    eprintln!(
        "failover behind an instant balancer: longest silence {silence:.2} s, first reply {:.2} s after the move",
        first_after - moved_at
    );
    assert!(
        first_after - moved_at <= 1.0,
        "the peer waited {:.2} s\n{}",
        first_after - moved_at,
        other.stderr()
    );
    let endpoint = wg
        .dump()
        .peer(&cfg.key.public)
        .and_then(|p| p.endpoint.clone());
    assert_eq!(
        endpoint.as_deref(),
        Some(format!("10.9.0.1:{TG_PORT}").as_str()),
        "the answer came through the balancer's address"
    );
    let status = other.status_json().expect("status JSON");
    assert_eq!(status["peers"][0]["takeovers_completed"], 1, "{status:#}");
}
