//! Issue 23, drops that mean something: an idle tunnel with IPv6 addresses (and a peer that
//! covers only IPv4) shows `no_peer` 0, because the kernel's own link chatter on the TUN device
//! (router solicitations, MLD reports) is counted as `link_local_multicast`; and traffic a user
//! sent to an address no peer covers is still a `no_peer` drop.
//!
//! Run as root: `cargo test --test netns_drops -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::time::Duration;

/// `tunnelgate_packets_dropped_total{reason="REASON"}`, or why it cannot be read (a failed
/// scrape, or no such sample: every reason is exported from the start). Never a 0 standing in
/// for a failed read, so `no_peer == 0` means the daemon said 0.
fn dropped(tg: &Tunnelgate, reason: &str) -> Result<u64, String> {
    let body = tg.metrics()?;
    metric(
        &body,
        "tunnelgate_packets_dropped_total",
        &format!("reason=\"{reason}\""),
    )
    .map(|v| v as u64)
    .ok_or_else(|| format!("no {reason} sample in /metrics:\n{body}"))
}

#[test]
#[ignore = "needs root"]
fn an_idle_ipv6_tunnel_counts_no_user_drops() {
    require_root();
    let ns = Netns::new();
    let peer = Keypair::generate();
    let cfg = TgConfig::new(0, &["100.85.0.1/32", "fd85::1/128"])
        .peer(Peer::new(&peer.public, &["100.85.0.2/32"]));
    let tg = Tunnelgate::start(&ns, cfg);
    // The kernel solicits routers (and reports its multicast groups) as the link comes up:
    // a flap makes it start over, so it happens within seconds whatever the timing so far.
    ns.exec(&["ip", "link", "set", tg.name(), "down"]);
    ns.exec(&["ip", "link", "set", tg.name(), "up"]);
    let chatter = poll_until(Duration::from_secs(20), || {
        dropped(&tg, "link_local_multicast").is_ok_and(|n| n > 0)
    });
    let body = tg.metrics().unwrap_or_default();
    assert!(
        chatter,
        "no link-local multicast seen from the kernel on {}: the test proves nothing\n{body}\n{}",
        tg.name(),
        tg.stderr()
    );
    // Idle a little longer: whatever the kernel sends is still not a user drop.
    std::thread::sleep(Duration::from_secs(5));
    let body = tg.metrics().unwrap_or_default();
    assert_eq!(
        dropped(&tg, "no_peer"),
        Ok(0),
        "an idle tunnel counts no_peer drops:\n{body}"
    );
    let status = tg.status_json().expect("status");
    assert_eq!(status["drops"]["no_peer"], 0, "{status}");
    assert!(
        status["drops"]["link_local_multicast"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "{status}"
    );

    // A user's packet to an address no peer covers is still a no_peer drop.
    ns.exec(&["ip", "-6", "route", "add", "fd86::/64", "dev", tg.name()]);
    let _ = ns.output(&["ping", "-6", "-c", "1", "-W", "1", "fd86::9"]);
    assert!(
        poll_until(Duration::from_secs(5), || dropped(&tg, "no_peer")
            .is_ok_and(|n| n >= 1)),
        "a packet to fd86::9 is a no_peer drop:\n{}",
        tg.metrics().unwrap_or_default()
    );
}
