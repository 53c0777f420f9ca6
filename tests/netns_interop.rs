//! The interop matrix: tunnelgate against wireguard-go and against itself, each side
//! initiating, with and without a preshared key, over IPv4 and IPv6 outer transport. Every
//! cell is a fresh pair of namespaces: the initiator pings first (so it must make the
//! handshake: only it knows the other's endpoint), then pings come back the other way and
//! 256 KB cross byte for byte; the responder must have learnt the initiator's endpoint in the
//! right family, and both sides must agree on the preshared key.
//!
//! Run as root: `cargo test --test netns_interop -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::net::IpAddr;
use std::time::Duration;

const A_LAN4: &str = "192.168.71.1";
const B_LAN4: &str = "192.168.71.2";
const A_LAN6: &str = "fd71::1";
const B_LAN6: &str = "fd71::2";
const A_TUN: &str = "100.64.71.1";
const B_TUN: &str = "100.64.71.2";
const A_PORT: u16 = 51820;
const B_PORT: u16 = 51821;
const HANDSHAKE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Other {
    WireguardGo,
    Tunnelgate,
}

#[derive(Debug, Clone, Copy)]
struct Cell {
    other: Other,
    tunnelgate_initiates: bool,
    psk: bool,
    outer_v6: bool,
}

/// The other side's running daemon (kept alive for the cell).
enum Running {
    WireguardGo(WgGo),
    Tunnelgate(Tunnelgate),
}

impl Running {
    fn dump(&self) -> WgDump {
        match self {
            Running::WireguardGo(w) => w.dump(),
            Running::Tunnelgate(t) => t.dump(),
        }
    }
}

fn endpoint(v6: bool, lan4: &str, lan6: &str, port: u16) -> String {
    if v6 {
        format!("[{lan6}]:{port}")
    } else {
        format!("{lan4}:{port}")
    }
}

fn run_cell(cell: Cell) {
    let label = format!("{cell:?}");
    let (a, b, _veth) = lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6);
    let psk = cell.psk.then(wg_genpsk);
    let a_endpoint = endpoint(cell.outer_v6, A_LAN4, A_LAN6, A_PORT);
    let b_endpoint = endpoint(cell.outer_v6, B_LAN4, B_LAN6, B_PORT);
    let b_key = Keypair::generate();
    let a_cfg = TgConfig::new(A_PORT, &[&format!("{A_TUN}/32")]);
    let a_public = a_cfg.public_key().to_string();

    // Only the initiator knows where the other one is.
    let mut peer_of_a = Peer::new(&b_key.public, &[&format!("{B_TUN}/32")]);
    let mut peer_of_b = Peer::new(&a_public, &[&format!("{A_TUN}/32")]);
    if cell.tunnelgate_initiates {
        peer_of_a = peer_of_a.endpoint(&b_endpoint);
    } else {
        peer_of_b = peer_of_b.endpoint(&a_endpoint);
    }
    if let Some(k) = &psk {
        peer_of_a = peer_of_a.preshared_key(k);
        peer_of_b = peer_of_b.preshared_key(k);
    }
    let other = match cell.other {
        Other::WireguardGo => {
            let w = WgGo::start_with_key(&b, b_key.clone(), B_PORT, &[&format!("{B_TUN}/32")]);
            w.add_peer(&peer_of_b);
            Running::WireguardGo(w)
        }
        Other::Tunnelgate => {
            let mut cfg = TgConfig::new(B_PORT, &[&format!("{B_TUN}/32")]).peer(peer_of_b);
            cfg.key = b_key.clone();
            Running::Tunnelgate(Tunnelgate::start(&b, cfg))
        }
    };
    let tg = Tunnelgate::start(&a, a_cfg.peer(peer_of_a));

    let (first, first_to, second, second_to) = if cell.tunnelgate_initiates {
        (&a, B_TUN, &b, A_TUN)
    } else {
        (&b, A_TUN, &a, B_TUN)
    };
    assert!(
        ping_until(first, first_to, HANDSHAKE),
        "{label}: the initiator's ping got no answer"
    );
    assert!(ping(second, second_to), "{label}: no ping back");
    let to: IpAddr = first_to.parse().expect("tunnel address");
    tcp_transfer(first, second, to, 0, 256 * 1024, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{label}: transfer through the tunnel: {e}"));

    // The responder learnt the initiator's endpoint, in the outer family of the cell.
    let (responder_dump, initiator_public) = if cell.tunnelgate_initiates {
        (other.dump(), a_public.as_str())
    } else {
        (tg.dump(), b_key.public.as_str())
    };
    let learnt = responder_dump
        .peer(initiator_public)
        .and_then(|p| p.endpoint.clone())
        .unwrap_or_else(|| panic!("{label}: the responder has no endpoint for the initiator"));
    assert_eq!(learnt.starts_with('['), cell.outer_v6, "{label}: {learnt}");
    // Both sides agree on the preshared key (and so the handshake used it).
    let a_psk = tg
        .dump()
        .peer(&b_key.public)
        .and_then(|p| p.preshared_key.clone());
    let b_psk = other
        .dump()
        .peer(&a_public)
        .and_then(|p| p.preshared_key.clone());
    assert_eq!(a_psk, psk, "{label}: tunnelgate's preshared key");
    assert_eq!(b_psk, psk, "{label}: the other side's preshared key");
}

fn matrix(other: Other) {
    require_root();
    for tunnelgate_initiates in [true, false] {
        for psk in [false, true] {
            for outer_v6 in [false, true] {
                run_cell(Cell {
                    other,
                    tunnelgate_initiates,
                    psk,
                    outer_v6,
                });
            }
        }
    }
}

#[test]
#[ignore = "needs root"]
fn tunnelgate_and_wireguard_go_each_initiating_with_and_without_psk_over_v4_and_v6() {
    matrix(Other::WireguardGo);
}

#[test]
#[ignore = "needs root"]
fn tunnelgate_and_tunnelgate_each_initiating_with_and_without_psk_over_v4_and_v6() {
    matrix(Other::Tunnelgate);
}
