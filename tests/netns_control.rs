//! The control core's decisions seen from outside, against the real daemon in namespaces: a
//! reload removes what left the config, a keepalive-only change keeps the peer's session, and
//! names that never answer are resolved concurrently, each with its own deadline.
//!
//! Run as root: `cargo test --test netns_control -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::net::UdpSocket;
use std::time::Duration;
use tunnelgate::shell::clock;

const A_LAN4: &str = "192.168.61.1";
const B_LAN4: &str = "192.168.61.2";
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;
const SHORT: Duration = Duration::from_secs(10);

/// The daemon's addresses on its TUN device, as `ip` lists them.
fn device_addresses(ns: &Netns, dev: &str) -> Vec<String> {
    let text = ns.exec(&["ip", "-o", "addr", "show", "dev", dev]);
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            words.next().map(str::to_string)
        })
        .filter(|a| !a.starts_with("fe80"))
        .collect();
    out.sort();
    out
}

#[test]
#[ignore = "needs root"]
fn a_reload_removes_a_tunnel_address_that_left_the_config() {
    require_root();
    let ns = Netns::new();
    let cfg = TgConfig::new(0, &["100.64.7.1/32", "100.64.7.2/32", "fd7a:7::1/128"]);
    let mut tg = Tunnelgate::start(&ns, cfg.clone());
    let name = tg.name().to_string();
    assert_eq!(
        device_addresses(&ns, &name),
        vec!["100.64.7.1/32", "100.64.7.2/32", "fd7a:7::1/128"]
    );
    let mut next = cfg;
    next.addresses = vec!["100.64.7.1/32".into(), "fd7a:7::9/128".into()];
    tg.write_config(next);
    tg.sighup();
    wait_until(SHORT, "the reload to replace the addresses", || {
        device_addresses(&ns, &name) == vec!["100.64.7.1/32", "fd7a:7::9/128"]
    });
}

#[test]
#[ignore = "needs root"]
fn a_keepalive_only_change_keeps_the_session() {
    require_root();
    let (a, b, _) = lan_pair_v4(A_LAN4, B_LAN4);
    let wg = WgGo::start(&b, WG_PORT, &["100.64.8.2/32"]);
    let cfg = TgConfig::new(TG_PORT, &["100.64.8.1/32"]).peer(
        Peer::new(wg.public_key(), &["100.64.8.2/32"])
            .endpoint(&format!("{B_LAN4}:{WG_PORT}"))
            .keepalive(25)
            .name("lab"),
    );
    wg.add_peer(
        &Peer::new(cfg.public_key(), &["100.64.8.1/32"]).endpoint(&format!("{A_LAN4}:{TG_PORT}")),
    );
    let mut tg = Tunnelgate::start(&a, cfg.clone());
    assert!(
        ping_until(&a, "100.64.8.2", SHORT),
        "no ping through the tunnel"
    );
    // The peer's configured name is in the handshake's log line.
    wait_until(SHORT, "the handshake log line", || {
        tg.stderr()
            .lines()
            .any(|l| l.contains("Handshake completed") && l.contains("peer_name=\"lab\""))
    });
    // wg show counts handshakes in whole seconds: a new one must land in a later second.
    std::thread::sleep(Duration::from_millis(2100));
    let before = tg.dump();
    let peer = before.peer(wg.public_key()).expect("peer").clone();
    assert!(peer.latest_handshake > 0);

    let mut next = cfg.clone();
    next.peers[0].keepalive = Some(7);
    tg.write_config(next);
    tg.sighup();
    wait_until(SHORT, "the new keepalive in wg show", || {
        tg.dump()
            .peer(wg.public_key())
            .is_some_and(|p| p.persistent_keepalive == Some(7))
    });
    assert!(ping(&a, "100.64.8.2"), "traffic after the change");
    let after = tg.dump();
    let kept = after.peer(wg.public_key()).expect("peer");
    assert_eq!(
        kept.latest_handshake, peer.latest_handshake,
        "a keepalive change must not start a new handshake"
    );
    assert!(kept.rx_bytes >= peer.rx_bytes, "counters were reset");
    let metrics = tg.metrics().expect("metrics");
    assert_eq!(
        metric(
            &metrics,
            "tunnelgate_packets_dropped_total",
            "reason=\"unknown_peer\""
        ),
        Some(0.0),
        "packets of the old session were dropped"
    );
}

#[test]
#[ignore = "needs root"]
fn names_that_never_answer_are_resolved_concurrently() {
    require_root();
    let ns = Netns::new();
    // A name server that reads every query and never answers.
    let silent = ns.thread(|| {
        let socket = UdpSocket::bind("127.0.0.53:53").expect("bind the silent server");
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut buf = [0u8; 1500];
        while socket.recv_from(&mut buf).is_ok() {}
    });
    const NAMES: usize = 20;
    let mut cfg = TgConfig::new(0, &["100.64.9.1/32"]);
    cfg.extra = String::from("[dns]\nnameservers = [\"127.0.0.53:53\"]\n");
    for i in 0..NAMES {
        cfg.extra.push_str(&format!(
            "\n[[ingress]]\ntarget_fqdn = \"dead{i}.example\"\nports = [\"{}\"]\n",
            2000 + i
        ));
    }
    let tg = Tunnelgate::spawn(&ns, cfg);
    let started = clock::now();
    // One after another, 20 lookups of 5 s each would take 100 s; 16 at a time, 10 s.
    wait_until(Duration::from_secs(20), "every name to fail once", || {
        tg.status_json().is_ok_and(|s| {
            s["names"].as_array().is_some_and(|names| {
                names.len() == NAMES && names.iter().all(|n| n["failures"].as_u64() >= Some(1))
            })
        })
    });
    let took = tunnelgate::shell::clock::since(started);
    let status = tg.status_json().expect("status");
    let error = status["names"][0]["last_error"]
        .as_str()
        .unwrap_or_default();
    assert!(error.contains("timed out"), "{error}");
    let (code, body) = tg.health_get("/readyz").expect("readyz");
    assert_eq!(code, 503);
    assert!(body.contains("dns: dead"), "{body}");
    eprintln!("20 dead names failed once within {took:?}");
    drop(tg);
    drop(silent);
}

/// A pids cgroup (v1 or v2) that limits how many threads the processes put in it may have.
struct TaskLimit(std::path::PathBuf);

impl TaskLimit {
    fn new(max: u32) -> Option<TaskLimit> {
        let root = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"]
            .iter()
            .map(std::path::Path::new)
            .find(|p| p.join("cgroup.procs").exists())?;
        let dir = root.join(unique_name("tgd"));
        std::fs::create_dir(&dir).ok()?;
        let limit = TaskLimit(dir);
        std::fs::write(limit.0.join("pids.max"), max.to_string()).ok()?;
        Some(limit)
    }

    fn procs(&self) -> String {
        self.0.join("cgroup.procs").display().to_string()
    }
}

impl Drop for TaskLimit {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The packet threads are the last thing a start makes: when they cannot be spawned, the start
/// fails, and everything already installed (device, policy rules, firewall rules) is removed.
/// The thread count is limited with a pids cgroup; the limit that fails exactly there is found
/// by trying each in turn.
#[test]
#[ignore = "needs root"]
fn a_start_whose_packet_threads_cannot_start_leaves_nothing_behind() {
    require_root();
    let mut hit = false;
    for max in 2..=24 {
        let Some(limit) = TaskLimit::new(max) else {
            panic!("no pids cgroup to limit the daemon's threads");
        };
        let ns = Netns::new();
        let mut cfg = TgConfig::new(0, &["100.64.10.1/32"])
            .peer(Peer::new(&Keypair::generate().public, &["0.0.0.0/0"]));
        cfg.extra = "[[ingress]]\ntarget = \"10.96.0.10\"\n".into();
        let dir = TempDir::new("tgd-limit");
        dir.write_secret("private.key", &format!("{}\n", cfg.key.private));
        let config = dir.write("tunnelgate.toml", &cfg.render("private.key"));
        // Joined from the root namespace: `ip netns exec` mounts its own /sys, without cgroups.
        let script = format!(
            "echo $$ > {} && exec ip netns exec {} {} run --config {}",
            limit.procs(),
            ns.name(),
            tunnelgate_bin(),
            config.display()
        );
        let mut cmd = std::process::Command::new("timeout");
        cmd.args(["10", "sh", "-c", &script]);
        let out = output_of(cmd, None);
        if out.success() || !out.stderr.contains("starting the packet loops") {
            continue; // failed earlier (runtime, socket) or started: not the path under test
        }
        hit = true;
        assert!(!ns.link_exists(&cfg.name), "TUN device left behind");
        let rules = ns.exec(&["ip", "rule", "show"]);
        assert!(
            !rules.contains("51820"),
            "policy rules left behind:\n{rules}"
        );
        let tables = ns.exec(&["nft", "list", "tables"]);
        assert!(
            !tables.contains("tunnelgate"),
            "firewall left behind:\n{tables}\ndaemon stderr:\n{}",
            out.stderr
        );
        assert!(!wg_socket(&cfg.name).exists(), "UAPI socket left behind");
        break;
    }
    assert!(hit, "no thread limit made the packet threads fail to start");
}

/// The real stop's order (`shell::process::stop_in_order` run on the daemon's own parts), seen
/// from outside while a SIGTERM stops it: the UAPI socket is gone before the packet threads, and
/// the packet threads are gone before the firewall table (nothing leaves the tunnel
/// un-masqueraded). Each moment is taken by a watcher of its own: the socket's path and the
/// threads in `/proc/PID/task` polled every 200 us, the table's deletion from `nft monitor`.
#[test]
#[ignore = "needs root"]
fn a_stop_removes_the_uapi_socket_then_joins_the_packet_threads_then_removes_the_rules() {
    use std::io::BufRead as _;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    require_root();
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.64.11.1/32"])
        .peer(Peer::new(&Keypair::generate().public, &["100.64.11.2/32"]));
    cfg.extra = "[[ingress]]\ntarget = \"10.96.0.10\"\n".into();
    let table = format!("tunnelgate_{}", cfg.name);
    let mut tg = Tunnelgate::start(&ns, cfg);
    let pid = tg.pid();
    let socket = wg_socket(&tg.cfg.name);
    assert!(socket.exists(), "UAPI socket up");
    let packet_threads = move || -> usize {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return 0;
        };
        tasks
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.starts_with("tg-tun") || c.starts_with("tg-udp"))
            })
            .count()
    };
    assert!(packet_threads() > 0, "no packet threads found by name");
    assert!(
        ns.exec(&["nft", "list", "tables"]).contains(&table),
        "the ingress installs {table}"
    );

    // The table's deletion, as nftables announces it.
    let mut monitor = ns
        .command(&["nft", "monitor", "tables"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("nft monitor");
    let events = std::io::BufReader::new(monitor.stdout.take().expect("monitor stdout"));
    let table_gone = std::thread::spawn({
        let table = table.clone();
        move || {
            events
                .lines()
                .map_while(Result::ok)
                .find(|l| l.starts_with("delete table") && l.contains(&table))
                .map(|_| clock::now())
        }
    });
    // Let the monitor subscribe before the stop.
    std::thread::sleep(Duration::from_millis(300));
    let stop = Arc::new(AtomicBool::new(false));
    let poll = |check: Box<dyn Fn() -> bool + Send>| {
        let stop = stop.clone();
        std::thread::spawn(move || loop {
            if check() {
                return Some(clock::now());
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        })
    };
    let socket_gone = poll(Box::new(move || !socket.exists()));
    let threads_gone = poll(Box::new(move || packet_threads() == 0));
    let status = tg.sigterm();
    assert!(status.success(), "{status:?}: {}", tg.stderr());
    stop.store(true, Ordering::Relaxed);
    let socket_gone = socket_gone
        .join()
        .expect("socket watcher")
        .expect("UAPI socket removed");
    let threads_gone = threads_gone
        .join()
        .expect("thread watcher")
        .expect("packet threads joined");
    let _ = monitor.kill();
    let _ = monitor.wait();
    let table_gone = table_gone
        .join()
        .expect("monitor reader")
        .expect("the table's deletion announced");
    assert!(
        socket_gone <= threads_gone,
        "the packet threads went {:?} before the UAPI socket",
        socket_gone - threads_gone
    );
    assert!(
        threads_gone <= table_gone,
        "the rules went {:?} before the packet threads stopped",
        threads_gone - table_gone
    );
}
