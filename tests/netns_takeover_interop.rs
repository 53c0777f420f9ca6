//! Takeover against other WireGuard implementations than wireguard-go: tunnelgate killed
//! (SIGKILL) and started again with the same config, while a boringtun-cli (or gotatun) peer
//! pings it every 100 ms, takes the peer's session over in one round trip: no silence over 1 s
//! once the new process is ready. The wireguard-go and tunnelgate peers are in netns_takeover.rs.
//!
//! The peers come from `cargo install boringtun-cli` / `gotatun-cli` into
//! `${XDG_CACHE_HOME:-$HOME/.cache}/tunnelgate-bench`, or PATH. A test whose peer is missing is
//! skipped with a note; under `CI=true` it fails instead (scripts/test.sh installs both).
//!
//! Run as root: `cargo test --test netns_takeover_interop -- --ignored --test-threads=1`.

mod common;

use common::*;

const A_LAN4: &str = "192.168.58.1";
const B_LAN4: &str = "192.168.58.2";
const A_LAN6: &str = "fd58::1";
const B_LAN6: &str = "fd58::2";
const A_TUN4: &str = "100.64.8.1";
const B_TUN4: &str = "100.64.8.2";
const TG_PORT: u16 = 51820;
const PEER_PORT: u16 = 51821;
/// The longest the peer may go unanswered once the new process is ready: a round trip and a
/// ping interval, with room for a loaded CI machine; the peer's own re-handshake takes ~15 s.
const MAX_SILENCE_AFTER_READY: f64 = 1.0;

/// tunnelgate in `a`, the peer `imp` in `b` with tunnelgate's endpoint (it is the client, and
/// keeps sending), then the restart.
fn restart_against(imp: WgImpl) {
    require_root();
    if !imp.available_or_skip() {
        return;
    }
    let (a, b, _) = lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6);
    let peer = WgGo::start_impl(
        &b,
        imp,
        Keypair::generate(),
        PEER_PORT,
        &[&format!("{B_TUN4}/32")],
    );
    let mut cfg = TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/32")])
        .peer(Peer::new(peer.public_key(), &[&format!("{B_TUN4}/32")]));
    cfg.workers = Some(1);
    peer.add_peer(
        &Peer::new(&cfg.key.public, &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    let target = PingTarget {
        peer_iface: peer.name(),
        peer_public: peer.public_key(),
        peer_kind: imp.label(),
        to: A_TUN4,
    };
    let silence = restart_under_pings(&a, &b, cfg, &target);
    assert!(
        silence.after_ready <= MAX_SILENCE_AFTER_READY,
        "{} went {:.2} s without a reply after the new process was ready (bound \
         {MAX_SILENCE_AFTER_READY} s)\n{}:\n{}",
        imp.label(),
        silence.after_ready,
        imp.label(),
        peer.logs()
    );
}

#[test]
#[ignore = "needs root"]
fn a_restarted_tunnelgate_takes_a_boringtun_client_over_at_once() {
    restart_against(WgImpl::Boringtun);
}

#[test]
#[ignore = "needs root"]
fn a_restarted_tunnelgate_takes_a_gotatun_client_over_at_once() {
    restart_against(WgImpl::Gotatun);
}
