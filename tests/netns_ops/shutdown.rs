//! A handshake is logged once, packets never are, and SIGTERM under load exits 0 within 3 s.

use super::*;

/// Whether something listens on TCP `port` in `ns`.
pub(crate) fn tcp_listening(ns: &Netns, port: u16) -> bool {
    ns.try_exec(&["ss", "-Htln", &format!("sport = :{port}")])
        .is_ok_and(|s| !s.trim().is_empty())
}

/// At the default log level: wireguard-go starts the one handshake, a 10 s bidirectional iperf3
/// runs through the tunnel, and SIGTERM mid-transfer makes the daemon exit 0 within 3 s and
/// remove its device and socket. Its log holds exactly one "Handshake completed" line, naming the
/// peer (`peer=<base64>`), before "Shutting down", and fewer than 50 lines in all although
/// hundreds of thousands of packets went through.
#[test]
#[ignore = "needs root"]
fn handshake_is_logged_and_sigterm_is_quick_under_load() {
    const IPERF_PORT: u16 = 5201;
    let (a, b) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6)]);
    // RUST_LOG empty = the default level (info), whatever the test's environment says.
    let mut tg = start_tg(
        &a,
        tg_config(wg.public_key(), None),
        &[],
        &[("RUST_LOG", "")],
    );
    let iface = tg.name().to_string();
    add_tg_to_wggo(&wg, tg.public_key(), None);

    // Only wireguard-go initiates (tunnelgate has no keepalive and nothing to send yet).
    must_ping(&b, A_TUN4, "wireguard-go -> tunnelgate");
    wait_handshake(&iface, wg.public_key(), SHORT);
    let handshake_line = format!("peer={}", wg.public_key());
    wait_until(SHORT, "the handshake is logged", || {
        tg.stderr().contains("Handshake completed")
    });

    let _server = a.spawn(&["iperf3", "-s", "-1", "-p", &IPERF_PORT.to_string()]);
    wait_until(SHORT, "iperf3 listens", || tcp_listening(&a, IPERF_PORT));
    let (_, m0) = scrape(&tg);
    let [rx0, tx0, rxp0, txp0] = peer_counters(&m0, wg.public_key());
    let started = clock::now();
    let mut client = b.spawn(&[
        "iperf3",
        "-c",
        A_TUN4,
        "-p",
        &IPERF_PORT.to_string(),
        "-t",
        "10",
        "--bidir",
    ]);
    // Under load: both directions have moved at least 10 MB.
    let mut moved = (0.0, 0.0);
    let loaded = poll_until(Duration::from_secs(8), || {
        let (_, m) = scrape(&tg);
        let [rx, tx, ..] = peer_counters(&m, wg.public_key());
        moved = (rx - rx0, tx - tx0);
        moved.0 >= 10.0 * MB as f64 && moved.1 >= 10.0 * MB as f64
    });
    assert!(
        loaded,
        "no load through the tunnel (moved rx {} / tx {} bytes); iperf3: {}{}",
        moved.0,
        moved.1,
        client.stdout(),
        client.stderr()
    );
    // Mid-transfer: about 3 s into the 10.
    std::thread::sleep(
        Duration::from_secs(3).saturating_sub(tunnelgate::shell::clock::since(started)),
    );
    assert!(
        client.is_running(),
        "iperf3 finished before the SIGTERM: {}{}",
        client.stdout(),
        client.stderr()
    );
    let (_, m1) = scrape(&tg);
    let [_, _, rxp1, txp1] = peer_counters(&m1, wg.public_key());
    let packets = (rxp1 - rxp0) + (txp1 - txp0);

    let t0 = clock::now();
    let status = tg.sigterm();
    let took = tunnelgate::shell::clock::since(t0);
    let log = tg.stderr();
    eprintln!(
        "SIGTERM under load ({packets} packets so far) took {took:?}; log ({} lines):\n{log}",
        log.lines().count()
    );
    assert_eq!(status.code(), Some(0), "exit status {status:?}:\n{log}");
    assert!(took < Duration::from_secs(3), "exit took {took:?}");
    assert!(!a.link_exists(&iface), "the TUN device is still there");
    assert!(
        !wg_socket(&iface).exists(),
        "the UAPI socket is still there"
    );

    let (before, after) = log
        .split_once("Shutting down")
        .unwrap_or_else(|| panic!("no \"Shutting down\" in the log:\n{log}"));
    let shakes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Handshake completed"))
        .collect();
    assert_eq!(shakes.len(), 1, "handshake lines: {shakes:#?}");
    assert!(shakes[0].contains(&handshake_line), "{}", shakes[0]);
    assert!(before.contains("Handshake completed") && !after.contains("Handshake completed"));
    assert!(packets > 10_000.0, "only {packets} packets counted");
    let lines = log.lines().filter(|l| !l.trim().is_empty()).count();
    assert!(
        lines < 50,
        "{lines} log lines for {packets} packets:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        !log.contains("ERROR"),
        "an error was logged under load or at shutdown:\n{log}"
    );
    let _ = client.kill9();
}
