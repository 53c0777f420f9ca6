//! Issue 16, WireGuard conformance, end to end in network namespaces: what users of the kernel
//! module and wireguard-go expect from `wg set/setconf` against tunnelgate (a live peer's
//! settings change without losing its session, a key-less device, very large configs), replies
//! leaving from the address a peer sent to, and the `tunnelgate userspace` / `tunnelgate-wg`
//! drop-in for wireguard-go driven by Debian's `wg-quick`.
//!
//! Run as root: `cargo test --all-features --test netns_conformance -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::time::{Duration, UNIX_EPOCH};
use tunnelgate::shell::clock;

const A_LAN4: &str = "192.168.61.1";
const B_LAN4: &str = "192.168.61.2";
const A_LAN6: &str = "fd61::1";
const B_LAN6: &str = "fd61::2";
const A_TUN4: &str = "100.65.0.1";
const B_TUN4: &str = "100.65.0.2";
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;
const SHORT: Duration = Duration::from_secs(10);

/// Two namespaces joined by a veth pair with v4 and v6 underlay addresses.
fn lan() -> (Netns, Netns, Veth) {
    lan_pair(A_LAN4, A_LAN6, B_LAN4, B_LAN6)
}

/// `tunnelgate_packets_dropped_total{reason="REASON"}`.
fn dropped(tg: &Tunnelgate, reason: &str) -> u64 {
    let body = tg.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    let labels = format!("reason=\"{reason}\"");
    metric(&body, "tunnelgate_packets_dropped_total", &labels)
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no series of {labels} in /metrics:\n{body}"))
}

/// Sleeps until just past the next whole second of the wall clock (`wg show` has second
/// resolution: a new handshake in the same second as the old one would look the same).
fn sleep_past_second_boundary() {
    let now = clock::wall_now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let rest = Duration::from_secs(1) - Duration::from_nanos(u64::from(now.subsec_nanos()));
    std::thread::sleep(rest + Duration::from_millis(200));
}

/// `ping` with `count` echoes every 0.2 s from `ns` to `to`, in a thread; the result is the
/// number of replies received.
fn ping_in_background(ns: &Netns, to: &str, count: u32) -> std::thread::JoinHandle<(u32, String)> {
    let cmd = ns.command(&[
        "ping",
        "-n",
        "-i",
        "0.2",
        "-W",
        "1",
        "-c",
        &count.to_string(),
        to,
    ]);
    std::thread::spawn(move || {
        let out = output_of(cmd, None);
        // "25 packets transmitted, 25 received, 0% packet loss, ..."
        let received = out
            .stdout
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .and_then(|l| l.split(", ").nth(1))
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        (received, out.stdout)
    })
}

// ---------------------------------------------------------------------------------------------
// 1. `wg set` on a live peer keeps its session
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs root"]
fn wg_set_allowed_ips_and_keepalive_on_a_live_peer_keep_its_session() {
    require_root();
    let (a, b, _v) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/24")]);
    let tg = Tunnelgate::start(
        &a,
        TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/24")]).peer(
            Peer::new(wg.public_key(), &[&format!("{B_TUN4}/32")])
                .endpoint(&format!("{B_LAN4}:{WG_PORT}")),
        ),
    );
    wg.add_peer(
        &Peer::new(tg.public_key(), &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    assert!(ping_until(&a, B_TUN4, SHORT), "no tunnel before the change");
    wait_handshake(tg.name(), wg.public_key(), SHORT);
    let before = tg.dump();
    let peer_before = before.peer(wg.public_key()).expect("peer listed").clone();
    let unknown_before = dropped(&tg, "unknown_peer");
    sleep_past_second_boundary();

    // Traffic both ways across the changes.
    let from_b = ping_in_background(&b, A_TUN4, 25);
    let from_a = ping_in_background(&a, B_TUN4, 25);
    std::thread::sleep(Duration::from_millis(1000));
    let pk = wg.public_key().to_string();
    run(&[
        "wg",
        "set",
        tg.name(),
        "peer",
        &pk,
        "allowed-ips",
        &format!("{B_TUN4}/32,10.77.0.0/16,fd77::/64"),
    ]);
    std::thread::sleep(Duration::from_millis(1500));
    run(&[
        "wg",
        "set",
        tg.name(),
        "peer",
        &pk,
        "persistent-keepalive",
        "7",
    ]);
    let keepalive_set = tg.dump().peer(&pk).and_then(|p| p.persistent_keepalive);
    std::thread::sleep(Duration::from_millis(1000));
    run(&[
        "wg",
        "set",
        tg.name(),
        "peer",
        &pk,
        "persistent-keepalive",
        "off",
    ]);
    let (got_b, text_b) = from_b.join().expect("ping thread");
    let (got_a, text_a) = from_a.join().expect("ping thread");

    let after = tg.dump();
    let peer = after.peer(&pk).expect("peer still listed");
    let mut allowed = peer.allowed_ips.clone();
    allowed.sort();
    assert_eq!(
        allowed,
        vec![
            "10.77.0.0/16".to_string(),
            format!("{B_TUN4}/32"),
            "fd77::/64".into()
        ],
        "wg show lists the new allowed IPs"
    );
    assert_eq!(
        peer.persistent_keepalive, None,
        "keepalive turned off again"
    );
    assert_eq!(
        peer.latest_handshake, peer_before.latest_handshake,
        "the session was kept: no new handshake"
    );
    assert!(
        peer.rx_bytes > peer_before.rx_bytes && peer.tx_bytes > peer_before.tx_bytes,
        "counters kept and growing: before {peer_before:?}, after {peer:?}"
    );
    assert_eq!(
        dropped(&tg, "unknown_peer"),
        unknown_before,
        "no packet of the old session was refused"
    );
    assert_eq!(got_b, 25, "pings from the peer were lost:\n{text_b}");
    assert_eq!(got_a, 25, "pings to the peer were lost:\n{text_a}");
    assert_eq!(
        keepalive_set,
        Some(7),
        "wg show showed the keepalive while it was set"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Replies leave from the address the peer sent to
// ---------------------------------------------------------------------------------------------

/// The source address the kernel of `ns` picks for `to` (`ip route get`).
fn kernel_source(ns: &Netns, to: &str) -> String {
    let out = ns.exec(&["ip", "route", "get", to]);
    let mut words = out.split_whitespace();
    while let Some(w) = words.next() {
        if w == "src" {
            return words.next().unwrap_or_default().to_string();
        }
    }
    panic!("no src in `ip route get {to}`: {out}")
}

/// The endpoint wireguard-go in `wg` has for `peer`.
fn endpoint_at(wg: &WgGo, peer: &str) -> Option<String> {
    wg.dump().peer(peer).and_then(|p| p.endpoint.clone())
}

fn bracket(ip: &str) -> String {
    if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

#[test]
#[ignore = "needs root"]
fn replies_leave_from_the_address_the_peer_used_and_fall_back_when_it_goes() {
    require_root();
    let (a, b, v) = lan();
    // A second address of each family on tunnelgate's uplink.
    add_addr(&a, &v.a_name, "192.168.61.3/24");
    add_addr(&a, &v.a_name, "fd61::3/64");
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/24")]);
    // No endpoint for the peer: tunnelgate learns it from the peer's first handshake.
    let tg = Tunnelgate::start(
        &a,
        TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/24")])
            .peer(Peer::new(wg.public_key(), &[&format!("{B_TUN4}/32")])),
    );
    let tg_key = tg.public_key().to_string();
    wg.add_peer(&Peer::new(&tg_key, &[&format!("{A_TUN4}/32")]));
    for (family, all, peer_lan) in [
        ("IPv4", ["192.168.61.1", "192.168.61.3"], B_LAN4),
        ("IPv6", ["fd61::1", "fd61::3"], B_LAN6),
    ] {
        // The peer talks to the address the kernel would not choose as the source.
        let default = kernel_source(&a, peer_lan);
        let used = all
            .iter()
            .find(|ip| **ip != default)
            .expect("a second address")
            .to_string();
        let expected = format!("{}:{TG_PORT}", bracket(&used));
        wg.wg(&["set", wg.name(), "peer", &tg_key, "endpoint", &expected]);
        assert!(
            ping_until(&b, A_TUN4, SHORT),
            "{family}: peer -> tunnelgate via {used}"
        );
        assert_eq!(
            endpoint_at(&wg, &tg_key).as_deref(),
            Some(expected.as_str()),
            "{family}: the answer came from {used}, the address the peer sent to"
        );
        // Traffic that tunnelgate starts leaves from the same address.
        for _ in 0..3 {
            assert!(ping(&a, B_TUN4), "{family}: tunnelgate -> peer");
        }
        assert_eq!(
            endpoint_at(&wg, &tg_key).as_deref(),
            Some(expected.as_str()),
            "{family}: tunnelgate's own packets came from {used}"
        );

        // The address goes: tunnelgate falls back to the kernel's choice, and the peer roams.
        let prefix = if used.contains(':') { 64 } else { 24 };
        a.exec(&[
            "ip",
            "addr",
            "del",
            &format!("{used}/{prefix}"),
            "dev",
            &v.a_name,
        ]);
        assert!(
            ping_until(&a, B_TUN4, SHORT),
            "{family}: tunnelgate -> peer after {used} was removed"
        );
        let fallback = format!("{}:{TG_PORT}", bracket(&default));
        assert_eq!(
            endpoint_at(&wg, &tg_key).as_deref(),
            Some(fallback.as_str()),
            "{family}: after {used} went, replies come from {default}"
        );
        assert!(
            ping(&b, A_TUN4),
            "{family}: peer -> tunnelgate after the fallback"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 3. A very large `wg setconf`
// ---------------------------------------------------------------------------------------------

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `n` distinct /32s in 10.0.0.0/8.
fn many_prefixes(n: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            let [_, b, c, d] = i.to_be_bytes();
            format!("10.{b}.{c}.{d}/32")
        })
        .collect()
}

#[test]
#[ignore = "needs root"]
fn wg_setconf_with_130k_allowed_ips_applies_and_wg_show_lists_them_all() {
    require_root();
    let ns = Netns::new();
    let tg = Tunnelgate::start(&ns, TgConfig::new(0, &["100.66.0.1/32"]));
    let peer = Keypair::generate();
    let prefixes = many_prefixes(130_000);
    let conf = format!(
        "[Interface]\nPrivateKey = {}\n\n[Peer]\nPublicKey = {}\nAllowedIPs = {}\n",
        tg.cfg.key.private,
        peer.public,
        prefixes.join(", ")
    );
    let file = tg.dir().write_secret("big.conf", &conf);
    let (rss_before, _) = memory_kib(tg.pid());
    let started = clock::now();
    run(&["wg", "setconf", tg.name(), &file.display().to_string()]);
    let took = tunnelgate::shell::clock::since(started);
    let (rss_after, hwm) = memory_kib(tg.pid());
    let listed = run(&["wg", "show", tg.name(), "allowed-ips"]);
    let line = listed
        .lines()
        .find(|l| l.starts_with(&peer.public))
        .unwrap_or_else(|| panic!("peer not listed by wg show allowed-ips"));
    let mut shown: Vec<&str> = line.split_whitespace().skip(1).collect();
    let mut expected: Vec<&str> = prefixes.iter().map(String::as_str).collect();
    shown.sort_unstable();
    expected.sort_unstable();
    assert_eq!(shown.len(), 130_000, "every allowed IP is listed");
    assert!(shown == expected, "the listed allowed IPs are the ones set");
    // Routed through the tunnel as well (tunnelgate's `run` mode installs routes).
    let routes = ns.exec(&["ip", "route", "show", "dev", tg.name()]);
    assert!(routes.lines().count() >= 130_000, "routes installed");
    eprintln!(
        "setconf of {} bytes, 130000 allowed IPs: {:.2} s; RSS {} -> {} KiB (peak {} KiB)",
        conf.len(),
        took.as_secs_f64(),
        rss_before,
        rss_after,
        hwm
    );
    assert!(took < Duration::from_secs(60), "setconf took {took:?}");
}

// ---------------------------------------------------------------------------------------------
// 4. `wg setconf` without a private key
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs root"]
fn wg_setconf_without_a_private_key_leaves_the_device_keyless_until_one_is_set() {
    require_root();
    let (a, b, _v) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/24")]);
    let tg = Tunnelgate::start(&a, TgConfig::new(TG_PORT, &[&format!("{A_TUN4}/24")]));
    wg.add_peer(
        &Peer::new(tg.public_key(), &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    // A file with a peer but no PrivateKey, as `wg showconf` of a key-less device prints.
    let conf = format!(
        "[Interface]\nListenPort = {TG_PORT}\n\n[Peer]\nPublicKey = {}\nAllowedIPs = {B_TUN4}/32\nEndpoint = {B_LAN4}:{WG_PORT}\n",
        wg.public_key()
    );
    let file = tg.dir().write_secret("nokey.conf", &conf);
    let out = a.output(&["wg", "setconf", tg.name(), &file.display().to_string()]);
    assert!(
        out.success(),
        "wg setconf without a key refused: {}",
        out.stderr
    );
    let dump = tg.dump();
    assert_eq!(dump.private_key, "(none)", "no key after setconf");
    assert_eq!(dump.public_key, "(none)");
    assert!(dump.peer(wg.public_key()).is_some(), "the peer was set");
    assert!(!ping(&a, B_TUN4), "a key-less device passes no traffic");

    // Setting a key brings the tunnel up.
    let key = tg.dir().write_secret("key", &tg.cfg.key.private);
    run(&[
        "wg",
        "set",
        tg.name(),
        "private-key",
        &key.display().to_string(),
    ]);
    assert_eq!(tg.dump().public_key, tg.public_key());
    assert!(
        ping_until(&a, B_TUN4, SHORT),
        "tunnel after the key was set"
    );
    assert!(ping(&b, A_TUN4), "and back");
}

// ---------------------------------------------------------------------------------------------
// 5. `tunnelgate userspace` / `tunnelgate-wg`: the wireguard-go drop-in, under wg-quick
// ---------------------------------------------------------------------------------------------

/// A directory with `tunnelgate-wg` (a symlink to the tunnelgate binary), to put first in PATH.
fn wg_symlink_dir() -> TempDir {
    let dir = TempDir::new("tgwg");
    std::os::unix::fs::symlink(tunnelgate_bin(), dir.path().join("tunnelgate-wg"))
        .expect("symlink tunnelgate-wg");
    dir
}

fn path_with(dir: &TempDir) -> String {
    format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
#[ignore = "needs root"]
fn wg_quick_up_and_down_with_tunnelgate_wg_as_the_userspace_implementation() {
    require_root();
    let (a, b, _v) = lan();
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/24")]);
    let name = unique_name("tgd");
    let key = Keypair::generate();
    let bin = wg_symlink_dir();
    let conf = bin.write_secret(
        &format!("{name}.conf"),
        &format!(
            "[Interface]\nPrivateKey = {}\nAddress = {A_TUN4}/24\nListenPort = {TG_PORT}\n\n\
             [Peer]\nPublicKey = {}\nAllowedIPs = {B_TUN4}/32, 10.88.0.0/16\nEndpoint = {B_LAN4}:{WG_PORT}\n",
            key.private,
            wg.public_key()
        ),
    );
    wg.add_peer(
        &Peer::new(&key.public, &[&format!("{A_TUN4}/32")])
            .endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    let routes_before = a.exec(&["ip", "route", "show"]);
    let path = path_with(&bin);
    // tunnelgate-wg takes wireguard-go's command line: the health endpoint comes from the env.
    let health: std::net::SocketAddr = "127.0.0.1:9402".parse().expect("address");
    let conf_arg = conf.display().to_string();
    let wg_quick = |verb: &str| {
        let mut cmd = a.command(&["wg-quick", verb, &conf_arg]);
        cmd.env("WG_QUICK_USERSPACE_IMPLEMENTATION", "tunnelgate-wg")
            .env("PATH", &path)
            .env("TUNNELGATE_HEALTH", health.to_string())
            .env_remove("WG_PROCESS_FOREGROUND");
        output_of(cmd, None)
    };

    let started = clock::now();
    let up = wg_quick("up");
    assert!(
        up.success(),
        "wg-quick up failed:\n{}\n{}",
        up.stdout,
        up.stderr
    );
    assert!(
        up.stderr.contains("tunnelgate-wg"),
        "wg-quick used tunnelgate-wg:\n{}",
        up.stderr
    );
    eprintln!(
        "wg-quick up took {:?}",
        tunnelgate::shell::clock::since(started)
    );
    let daemons = a.pids();
    assert_eq!(
        daemons.len(),
        1,
        "one background daemon in the namespace: {daemons:?}"
    );
    // wg-quick configured it through wg and ip: key, peer, address, routes.
    let dump = wg_dump(&name);
    assert_eq!(dump.public_key, key.public);
    assert_eq!(dump.listen_port, TG_PORT);
    assert!(dump.peer(wg.public_key()).is_some());
    let addr = a.exec(&["ip", "-o", "addr", "show", "dev", &name]);
    assert!(addr.contains(&format!("{A_TUN4}/24")), "{addr}");
    let routes = a.exec(&["ip", "route", "show", "dev", &name]);
    assert!(
        routes.contains("10.88.0.0/16"),
        "wg-quick's route: {routes}"
    );
    assert!(ping_until(&a, B_TUN4, SHORT), "tunnel to the peer");
    assert!(ping(&b, A_TUN4), "tunnel from the peer");
    wait_handshake(&name, wg.public_key(), SHORT);

    // `tunnelgate status` and metrics work for wg-quick users too: the drop-in serves the
    // status socket, and the health endpoint it was asked for.
    let status = tunnelgate_status_json(&name).expect("tunnelgate status --json of the drop-in");
    assert_eq!(status["interface"]["name"], name.as_str(), "{status}");
    let peers = status["peers"].as_array().cloned().unwrap_or_default();
    assert_eq!(peers.len(), 1, "{status}");
    assert_eq!(peers[0]["public_key"], wg.public_key(), "{status}");
    assert!(
        peers[0]["rx_bytes"].as_u64().unwrap_or(0) > 0
            && peers[0]["latest_handshake_unix"].as_u64().is_some(),
        "traffic and a handshake in the status: {status}"
    );
    let text = tunnelgate_cli(&["status", "--interface", &name], None);
    assert!(
        text.success() && text.stdout.contains(wg.public_key()),
        "tunnelgate status --interface {name}: {text:?}"
    );
    let (code, body) = http_get_ns(&a, health, "/metrics").expect("GET /metrics of the drop-in");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.lines().any(|l| {
            l.starts_with("tunnelgate_peer_last_handshake_age_seconds{")
                && l.contains(&format!("peer=\"{}\"", wg.public_key()))
        }),
        "the peer's handshake age in /metrics:\n{body}"
    );
    assert_eq!(http_get_ns(&a, health, "/healthz").map(|r| r.0), Ok(200));

    let down = wg_quick("down");
    assert!(
        down.success(),
        "wg-quick down failed:\n{}\n{}",
        down.stdout,
        down.stderr
    );
    assert!(
        poll_until(SHORT, || a.pids().is_empty()),
        "the daemon exits when wg-quick deletes the interface: {:?}",
        a.pids()
    );
    assert!(!a.link_exists(&name), "interface gone");
    assert!(!wg_socket(&name).exists(), "UAPI socket removed");
    assert!(
        tunnelgate_status_json(&name).is_err(),
        "no status socket left behind"
    );
    assert_eq!(
        a.exec(&["ip", "route", "show"]),
        routes_before,
        "routes as before"
    );
}

#[test]
#[ignore = "needs root"]
fn userspace_foreground_creates_a_bare_interface_and_sigterm_removes_it() {
    require_root();
    let ns = Netns::new();
    let name = unique_name("tgd");
    let dir = TempDir::new("tgus");
    let mut proc = Proc::spawn(
        ns.command(&[tunnelgate_bin(), "userspace", "-f", &name]),
        "userspace",
        dir.path(),
    );
    wait_until(SHORT, "UAPI socket", || wg_socket(&name).exists());
    // The sockets are claimed before the device is built, so a client may see the UAPI socket
    // before the packet threads exist (its requests wait in the backlog): wait for them too,
    // or "every packet thread is confined" below would hold for none.
    wait_until(SHORT, "packet threads", || {
        let names: Vec<String> = thread_privileges(proc.pid())
            .into_values()
            .filter_map(|f| f.get("Name").cloned())
            .collect();
        PACKET_THREADS.iter().all(|t| names.iter().any(|n| n == t))
    });
    // Least privilege as in `run`: CAP_NET_ADMIN (TUN, fwmark) and CAP_NET_BIND_SERVICE (a
    // listen-port below 1024) in every thread, CAP_SYS_NICE (where real-time needs it) in the
    // packet readers alone and never in the bounding set, no-new-privs, the packet threads
    // under seccomp.
    let base = (1u64 << 12) | (1u64 << 10);
    let want = format!("{base:016x}");
    let threads = thread_privileges_once_confined(proc.pid());
    for (tid, f) in &threads {
        let get = |k: &str| f.get(k).map(String::as_str).unwrap_or("missing");
        let what = format!("thread {tid} ({})", get("Name"));
        let held = if holds_sys_nice(get("Name")) {
            format!("{:016x}", base | realtime_kept_cap())
        } else {
            want.clone()
        };
        assert_eq!(get("CapEff"), held, "{what} CapEff");
        assert_eq!(get("CapPrm"), held, "{what} CapPrm");
        assert_eq!(get("CapBnd"), want, "{what} CapBnd");
        assert_eq!(get("CapInh"), "0000000000000000", "{what} CapInh");
        assert_eq!(get("CapAmb"), "0000000000000000", "{what} CapAmb");
        assert_eq!(get("NoNewPrivs"), "1", "{what} NoNewPrivs");
        let filtered = is_packet_thread(get("Name"));
        assert_eq!(get("Seccomp"), if filtered { "2" } else { "0" }, "{what}");
    }
    for packet_thread in PACKET_THREADS {
        assert!(
            threads
                .values()
                .any(|f| f.get("Name").map(String::as_str) == Some(packet_thread)),
            "no {packet_thread}: {threads:?}"
        );
    }
    let dump = wg_dump(&name);
    assert_eq!(
        dump.private_key, "(none)",
        "starts without a key, like wireguard-go"
    );
    assert!(dump.peers.is_empty());
    let addr = ns.exec(&["ip", "-o", "addr", "show", "dev", &name]);
    // (The kernel's own IPv6 link-local address may be there; nothing else.)
    assert!(
        !addr.contains("inet ") && !addr.contains("scope global"),
        "no address installed: {addr}"
    );
    // Peers with allowed IPs get no routes: that is wg-quick's job in this mode.
    let peer = Keypair::generate();
    run(&[
        "wg",
        "set",
        &name,
        "peer",
        &peer.public,
        "allowed-ips",
        "10.99.0.0/16,::/0",
    ]);
    let routes = ns.exec(&["ip", "route", "show", "table", "all"]);
    assert!(
        !routes.contains("10.99.0.0"),
        "no route installed: {routes}"
    );
    assert!(
        ns.exec(&["ip", "rule", "show"]).lines().count() <= 3,
        "no policy rule"
    );
    let status = proc.sigterm(SHORT);
    assert!(
        status.success(),
        "SIGTERM exits 0: {status:?}\n{}",
        proc.stderr()
    );
    assert!(!ns.link_exists(&name), "interface removed");
    assert!(!wg_socket(&name).exists(), "UAPI socket removed");
}

/// `WG_PROCESS_FOREGROUND=1` keeps `tunnelgate userspace` in the foreground without `-f`, as it
/// does wireguard-go: the process started is the one serving the interface, until SIGTERM.
#[test]
#[ignore = "needs root"]
fn userspace_honours_wg_process_foreground() {
    require_root();
    let ns = Netns::new();
    let name = unique_name("tgd");
    let dir = TempDir::new("tgusf");
    let mut cmd = ns.command(&[tunnelgate_bin(), "userspace", &name]);
    cmd.env("WG_PROCESS_FOREGROUND", "1");
    let mut proc = Proc::spawn(cmd, "userspace", dir.path());
    wait_until(SHORT, "UAPI socket", || wg_socket(&name).exists());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        proc.is_running(),
        "went to the background despite WG_PROCESS_FOREGROUND=1: {:?}\n{}",
        proc.try_wait(),
        proc.stderr()
    );
    assert_eq!(wg_dump(&name).private_key, "(none)", "it serves UAPI");
    let status = proc.sigterm(SHORT);
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
    assert!(!ns.link_exists(&name), "interface removed");
    assert!(!wg_socket(&name).exists(), "UAPI socket removed");
}
