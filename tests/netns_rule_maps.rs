//! Issue 22, nftables at scale: with 1,000 forwarded ports (one map element each) a connection
//! to one of them reaches its target with its bytes intact, IPv4 and IPv6; a reload that moves
//! one Service to another target changes only map elements (the table, its chains and rules
//! keep their handles), the moved Service reaches its new target, and a connection opened
//! before the reload, and new ones to other Services, keep working.
//!
//! Run as root: `cargo test --test netns_rule_maps -- --ignored --test-threads=1`.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

const CLIENT_LAN: &str = "192.168.74.1";
const PROXY_LAN: &str = "192.168.74.2";
const PROXY_CLUSTER_V4: &str = "10.97.0.1";
const PROXY_CLUSTER_V6: &str = "fd97::1";
/// Two backends in the cluster namespace; every Service starts on the first.
const BACKEND_A: &str = "10.97.0.10";
const BACKEND_B: &str = "10.97.0.11";
const BACKEND_V6: &str = "fd97::10";
const TG_V4: &str = "100.67.0.1";
const TG_V6: &str = "fd67::1";
const PEER_V4: &str = "100.67.0.2";
const PEER_V6: &str = "fd67::2";
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;
const ECHO_PORT: u16 = 9000;
/// Service i listens on FIRST_PORT + i.
const FIRST_PORT: u16 = 20_000;
const SERVICES: u16 = 1_000;
/// The Service the reload moves to BACKEND_B.
const MOVED: u16 = 500;
/// The IPv6 Service (beside the 1,000 IPv4 ones).
const V6_PORT: u16 = 30_000;

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

fn cidr(ip: &str) -> String {
    let bits = if ip.contains(':') { 128 } else { 32 };
    format!("{ip}/{bits}")
}

/// One `[[ingress]]` per Service, each on its own port; `moved` goes to BACKEND_B.
fn services_toml(moved: bool) -> String {
    let mut out = String::from("[firewall]\nmode = \"nftables\"\nrepair_interval = \"1h\"\n");
    for i in 0..SERVICES {
        let target = if moved && i == MOVED {
            BACKEND_B
        } else {
            BACKEND_A
        };
        out.push_str(&format!(
            "[[ingress]]\ntarget = \"{target}\"\nports = [\"{}:{ECHO_PORT}\"]\n",
            FIRST_PORT + i
        ));
    }
    out.push_str(&format!(
        "[[ingress]]\ntarget = \"{BACKEND_V6}\"\nports = [\"{V6_PORT}:{ECHO_PORT}\"]\n"
    ));
    out
}

/// 256 KB that are not all alike, so a reordered or truncated echo shows.
fn payload() -> Vec<u8> {
    (0..256 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn echo_intact(client: &Netns, to: SocketAddr, what: &str) {
    let data = payload();
    let mut last = String::new();
    let ok = poll_until(Duration::from_secs(5), || {
        match tcp_roundtrip(client, to, &data, Duration::from_secs(5)) {
            Ok(back) if back == data => true,
            Ok(back) => {
                last = format!("{} bytes back, not the {} sent", back.len(), data.len());
                false
            }
            Err(e) => {
                last = e;
                false
            }
        }
    });
    assert!(ok, "{what}: echo via {to}: {last}");
}

/// Handles of our table and its rules (`nft -a`): a full replace makes new ones, an element
/// change keeps them.
fn handles(proxy: &Netns, table: &str) -> Vec<String> {
    let tables = proxy.exec(&["nft", "-a", "list", "tables", "inet"]);
    let mut out: Vec<String> = tables
        .lines()
        .filter(|l| l.contains(table))
        .map(str::to_string)
        .collect();
    let listing = proxy.exec(&["nft", "-a", "-t", "list", "table", "inet", table]);
    out.extend(
        listing
            .lines()
            .filter(|l| l.contains("# handle") && !l.contains("elements"))
            .map(|l| l.trim().to_string()),
    );
    out
}

#[test]
#[ignore = "needs root"]
fn a_thousand_ports_forward_and_one_service_change_touches_only_its_elements() {
    let Lab3 {
        client,
        proxy,
        cluster,
    } = Lab3::new(
        &[&format!("{CLIENT_LAN}/24")],
        &[&format!("{PROXY_LAN}/24")],
        &[
            &format!("{PROXY_CLUSTER_V4}/24"),
            &format!("{PROXY_CLUSTER_V6}/64"),
        ],
        &[
            &format!("{BACKEND_A}/24"),
            &format!("{BACKEND_B}/24"),
            &format!("{BACKEND_V6}/64"),
        ],
    );
    let echo_a = TcpEcho::start(&cluster, sa(BACKEND_A, ECHO_PORT));
    let echo_b = TcpEcho::start(&cluster, sa(BACKEND_B, ECHO_PORT));
    let echo_v6 = TcpEcho::start(&cluster, sa(BACKEND_V6, ECHO_PORT));
    let wg = WgGo::start(&client, WG_PORT, &[&cidr(PEER_V4), &cidr(PEER_V6)]);
    let mut cfg = TgConfig::new(TG_PORT, &[&cidr(TG_V4), &cidr(TG_V6)]).peer(
        Peer::new(wg.public_key(), &[&cidr(PEER_V4), &cidr(PEER_V6)])
            .endpoint(&format!("{CLIENT_LAN}:{WG_PORT}")),
    );
    cfg.extra = services_toml(false);
    let iface = cfg.name.clone();
    let table = format!("tunnelgate_{iface}");
    let mut moved_cfg = cfg.clone();
    moved_cfg.extra = services_toml(true);
    let mut tg = Tunnelgate::spawn_env(&proxy, cfg, &[]);
    if let Err(e) = tg.wait_ready(Duration::from_secs(30)) {
        panic!("{e}");
    }
    wg.add_peer(
        &Peer::new(tg.public_key(), &[&cidr(TG_V4), &cidr(TG_V6)])
            .endpoint(&format!("{PROXY_LAN}:{TG_PORT}")),
    );
    assert!(
        ping_until(&client, TG_V4, Duration::from_secs(15)),
        "tunnel up; stderr:\n{}",
        tg.stderr()
    );

    // A handful of rules, the ports as elements.
    let listing = proxy.exec(&["nft", "list", "table", "inet", &table]);
    assert!(listing.contains("map @in4_tcp_dnat"), "{listing}");
    let dnat_rules = listing.lines().filter(|l| l.contains(" dnat ip")).count();
    assert_eq!(dnat_rules, 2, "one DNAT rule per family:\n{listing}");
    let moved_key = format!(
        "{TG_V4} . {} comment \"ingress[{MOVED}]\"",
        FIRST_PORT + MOVED
    );
    assert!(
        listing.contains(&format!("{moved_key} : {BACKEND_A} . {ECHO_PORT}")),
        "Service {MOVED} as an element: {listing}"
    );

    echo_intact(
        &client,
        sa(TG_V4, FIRST_PORT + MOVED),
        "Service 500 before the change",
    );
    echo_intact(
        &client,
        sa(TG_V4, FIRST_PORT + SERVICES - 1),
        "the last Service",
    );
    echo_intact(&client, sa(TG_V6, V6_PORT), "the IPv6 Service");
    assert!(!echo_v6.seen().is_empty(), "the IPv6 backend was reached");
    assert!(echo_b.seen().is_empty(), "nothing goes to backend B yet");
    for s in echo_a.seen() {
        assert_eq!(s.ip().to_string(), PROXY_CLUSTER_V4, "masqueraded: {s}");
    }
    // A port that is no Service's is not forwarded.
    let unlisted = tcp_roundtrip(
        &client,
        sa(TG_V4, FIRST_PORT + SERVICES),
        b"x",
        Duration::from_millis(1500),
    );
    assert!(unlisted.is_err(), "an unlisted port answered: {unlisted:?}");

    // A connection opened before the change, to another Service, kept open across it.
    let (go, wait) = mpsc::channel::<()>();
    let long_lived = client.thread(move || -> Result<Vec<u8>, String> {
        let to = sa(TG_V4, FIRST_PORT + 1);
        let mut s =
            TcpStream::connect_timeout(&to, Duration::from_secs(5)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut back = vec![0u8; 6];
        s.write_all(b"before").map_err(|e| e.to_string())?;
        s.read_exact(&mut back)
            .map_err(|e| format!("before: {e}"))?;
        wait.recv().map_err(|e| e.to_string())?;
        s.write_all(b"after!").map_err(|e| e.to_string())?;
        s.read_exact(&mut back[..])
            .map_err(|e| format!("after: {e}"))?;
        Ok(back)
    });
    std::thread::sleep(Duration::from_millis(300));

    let before = handles(&proxy, &table);
    tg.write_config(moved_cfg);
    let out = proxy.output(&[tunnelgate_bin(), "reload", "--interface", &iface]);
    assert!(out.success(), "reload: {out:?}\ndaemon:\n{}", tg.stderr());
    let after = handles(&proxy, &table);
    assert!(
        tg.stderr().contains("Only map elements differ"),
        "the reload took the element path; daemon:\n{}",
        tg.stderr()
    );
    assert_eq!(
        before, after,
        "the table, chains and rules were not recreated"
    );
    let listing = proxy.exec(&["nft", "list", "table", "inet", &table]);
    assert!(
        listing.contains(&format!("{moved_key} : {BACKEND_B} . {ECHO_PORT}")),
        "the moved Service's element: {listing}"
    );
    assert!(
        !listing.contains(&format!("{moved_key} : {BACKEND_A}")),
        "the old element is gone: {listing}"
    );

    go.send(()).expect("long-lived connection thread");
    let kept = long_lived.join().expect("thread");
    assert_eq!(
        kept.as_deref(),
        Ok(&b"after!"[..]),
        "the connection opened before the reload"
    );
    echo_intact(
        &client,
        sa(TG_V4, FIRST_PORT + MOVED),
        "Service 500 after the change",
    );
    assert!(
        !echo_b.seen().is_empty(),
        "the moved Service reaches backend B"
    );
    let a_before = echo_a.seen().len();
    echo_intact(
        &client,
        sa(TG_V4, FIRST_PORT + 2),
        "an unrelated Service after the change",
    );
    assert!(
        echo_a.seen().len() > a_before,
        "unrelated Services stay on backend A"
    );
    echo_intact(
        &client,
        sa(TG_V6, V6_PORT),
        "the IPv6 Service after the change",
    );
    drop(tg);
}
