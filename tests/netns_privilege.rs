//! Issue 15, least privilege: a running daemon keeps only `CAP_NET_ADMIN` (plus `CAP_NET_RAW`
//! with iptables-legacy) in every thread's effective, permitted and bounding sets, and
//! `CAP_SYS_NICE` where real-time priority needs it in its packet readers alone (issue 38),
//! nothing inheritable or ambient, and no-new-privs; and with only that, the `nft` /
//! `iptables-restore` it runs still work: a reload that changes addresses and rules is
//! applied, and SIGTERM removes everything. The packet threads, and only they, run under the
//! seccomp allow-list (mode 2, one filter) unless `--seccomp off`.
//!
//! Run as root: `cargo test --all-features --test netns_privilege -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::time::Duration;

const CAP_NET_ADMIN: u64 = 1 << 12;
const CAP_NET_RAW: u64 = 1 << 13;

fn mask(v: u64) -> String {
    format!("{v:016x}")
}

fn ingress(ports: &[&str]) -> String {
    let ports: Vec<String> = ports.iter().map(|p| format!("{p:?}")).collect();
    format!(
        "[[ingress]]\ntarget = \"10.96.0.10\"\nports = [{}]\n",
        ports.join(", ")
    )
}

fn run(legacy: bool) {
    require_root();
    let ns = Netns::new();
    let firewall = if legacy {
        "[firewall]\nmode = \"iptables\"\n"
    } else {
        "[firewall]\nmode = \"nftables\"\n"
    };
    // With the relay asked for, so its partner threads are checked whatever the default.
    let relay = ("TUNNELGATE_RELAY_PARTNERS", "3");
    let env: &[(&str, &str)] = if legacy {
        &[("TUNNELGATE_IPTABLES", "legacy"), relay]
    } else {
        &[relay]
    };
    let mut cfg = TgConfig::new(0, &["100.64.0.1/32"]);
    cfg.health = Some("0.0.0.0:9002".into());
    cfg.extra = format!("{firewall}\n{}", ingress(&["80"]));
    let mut tg = Tunnelgate::spawn_env(&ns, cfg.clone(), env);
    if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
        panic!("{e}");
    }
    let name = tg.name().to_string();

    let want = if legacy {
        CAP_NET_ADMIN | CAP_NET_RAW
    } else {
        CAP_NET_ADMIN
    };
    let threads = thread_privileges_once_confined(tg.pid());
    assert!(
        threads.len() > 3,
        "expected the runtime and packet threads: {threads:#?}"
    );
    for (tid, f) in &threads {
        let get = |k: &str| f.get(k).map(String::as_str).unwrap_or("missing");
        let what = format!("thread {tid} ({})", get("Name"));
        // CAP_SYS_NICE, where real-time needs it, in the packet readers (and the thread that
        // starts them) alone, and never in the bounding set: no child can have it.
        let held = if holds_sys_nice(get("Name")) {
            want | realtime_kept_cap()
        } else {
            want
        };
        assert_eq!(get("CapEff"), mask(held), "{what} CapEff");
        assert_eq!(get("CapPrm"), mask(held), "{what} CapPrm");
        assert_eq!(get("CapBnd"), mask(want), "{what} CapBnd");
        assert_eq!(get("CapInh"), mask(0), "{what} CapInh");
        assert_eq!(get("CapAmb"), mask(0), "{what} CapAmb");
        assert_eq!(get("NoNewPrivs"), "1", "{what} NoNewPrivs");
        // 2 = SECCOMP_MODE_FILTER, with our one filter; the other threads (runtime, netlink)
        // must keep every call they need for reloads.
        let (mode, filters) = if is_packet_thread(get("Name")) {
            ("2", "1")
        } else {
            ("0", "0")
        };
        assert_eq!(get("Seccomp"), mode, "{what} Seccomp");
        assert_eq!(get("Seccomp_filters"), filters, "{what} Seccomp_filters");
    }
    let names: Vec<&str> = threads
        .values()
        .filter_map(|f| f.get("Name").map(String::as_str))
        .collect();
    for packet_thread in PACKET_THREADS {
        assert!(
            names.contains(&packet_thread),
            "no {packet_thread}: {names:?}"
        );
    }
    assert!(
        tg.stderr().contains("Packet threads confined by seccomp"),
        "{}",
        tg.stderr()
    );
    assert!(
        tg.stderr().contains("Capabilities dropped"),
        "{}",
        tg.stderr()
    );

    let rules = |ns: &Netns| {
        if legacy {
            ns.exec(&["iptables-legacy-save"])
        } else {
            ns.nft_tunnelgate_table()
        }
    };
    let has_port = |text: &str, port: u16| {
        nft_forwards_port(text, port) || text.contains(&format!("--dport {port} "))
    };
    assert!(has_port(&rules(&ns), 80), "{}", rules(&ns));
    assert!(!has_port(&rules(&ns), 8080));

    // A reload that needs the kept capabilities: a new address (netlink) and a new rule
    // (nft or iptables-legacy-restore, run as children of the reduced process).
    let mut next = cfg.clone();
    next.name = name.clone();
    next.addresses.push("100.64.0.3/32".into());
    next.extra = format!("{firewall}\n{}", ingress(&["80", "8080"]));
    tg.write_config(next);
    tg.sighup();
    let applied = poll_until(Duration::from_secs(15), || {
        ns.exec(&["ip", "-o", "addr", "show", "dev", &name])
            .contains("100.64.0.3/32")
            && has_port(&rules(&ns), 8080)
    });
    assert!(
        applied,
        "the reload was not applied:\naddresses {}\nrules {}\n{}",
        ns.exec(&["ip", "-o", "addr", "show", "dev", &name]),
        rules(&ns),
        tg.stderr()
    );
    assert!(
        !tg.stderr().contains("rejected") && !tg.stderr().contains("Permission denied"),
        "{}",
        tg.stderr()
    );
    wait_until(
        Duration::from_secs(10),
        "/readyz 200 after the reload",
        || tg.health_get("/readyz").map(|(s, _)| s) == Ok(200),
    );

    // Teardown also runs the tools: everything of ours goes.
    let status = tg.sigterm();
    assert!(status.success(), "exit {status:?}: {}", tg.stderr());
    assert!(!has_port(&rules(&ns), 80), "rules left: {}", rules(&ns));
    assert!(!ns.link_exists(&name), "the TUN device is left");
}

#[test]
#[ignore = "needs root and network namespaces"]
fn nftables_keeps_only_net_admin_and_reloads_still_work() {
    run(false);
}

#[test]
#[ignore = "needs root and network namespaces"]
fn iptables_legacy_keeps_net_admin_and_net_raw_and_reloads_still_work() {
    run(true);
}

#[test]
#[ignore = "needs root and network namespaces"]
fn seccomp_off_leaves_every_thread_unfiltered_and_says_so() {
    require_root();
    let ns = Netns::new();
    let cfg = TgConfig::new(0, &["100.64.0.1/32"]);
    let mut tg = Tunnelgate::spawn_env(&ns, cfg, &[("TUNNELGATE_SECCOMP", "off")]);
    if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
        panic!("{e}");
    }
    let threads = thread_privileges(tg.pid());
    assert!(
        threads
            .values()
            .any(|f| f.get("Name").is_some_and(|n| is_packet_thread(n))),
        "the packet threads are among those read: {threads:?}"
    );
    for (tid, f) in &threads {
        assert_eq!(
            f.get("Seccomp").map(String::as_str),
            Some("0"),
            "thread {tid} {f:?}"
        );
    }
    assert!(tg.stderr().contains("seccomp is off"), "{}", tg.stderr());
    let status = tg.sigterm();
    assert!(status.success(), "exit {status:?}: {}", tg.stderr());
}

/// `(thread name, scheduling policy)` of every thread of `pid`.
fn thread_policies(pid: u32) -> Vec<(String, u32)> {
    thread_scheduling(pid)
        .into_iter()
        .map(|(name, policy, _)| (name, policy))
        .collect()
}

/// Issue 29, latency under load: the packet readers run at real-time priority (`SCHED_FIFO`,
/// so a packet does not wait for a CPU behind other work), nothing else of the daemon does,
/// and `TUNNELGATE_RT_PRIORITY=0` keeps every thread at normal priority. As root the daemon
/// gets there by `RLIMIT_RTPRIO` or, where that cannot be raised, by keeping `CAP_SYS_NICE`;
/// where it has neither (a container without them), every thread stays at normal priority and
/// the log says why, once.
#[test]
#[ignore = "needs root"]
fn the_packet_readers_run_at_real_time_priority_unless_turned_off() {
    require_root();
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.64.0.1/32"]);
    cfg.workers = Some(2);
    let tg = Tunnelgate::start(&ns, cfg);
    if !realtime_possible() {
        let said = poll_until(Duration::from_secs(5), || {
            tg.stderr()
                .matches("Packet readers stay at normal priority")
                .count()
                == 1
        });
        let policies = thread_policies(tg.pid());
        assert!(said, "no one-line notice:\n{}", tg.stderr());
        assert!(
            policies.iter().all(|(_, p)| *p != SCHED_FIFO),
            "{policies:?}"
        );
        skip(
            "this process has neither CAP_SYS_NICE nor a way to raise RLIMIT_RTPRIO: only the \
             normal-priority fallback was checked, not the readers at real-time priority",
        );
        return;
    }
    let mut policies = Vec::new();
    let readers_up = poll_until(Duration::from_secs(5), || {
        policies = thread_policies(tg.pid());
        policies
            .iter()
            .filter(|(n, p)| n.starts_with("tg-") && n.contains("-rx-") && *p == SCHED_FIFO)
            .count()
            == 4
    });
    assert!(
        readers_up,
        "two workers' TUN and UDP readers at SCHED_FIFO: {policies:?}\n{}",
        tg.stderr()
    );
    for (name, policy) in &policies {
        if !name.contains("-rx-") {
            assert_ne!(*policy, SCHED_FIFO, "{name} is real-time: {policies:?}");
        }
    }
    // Status says so, and how.
    let status = tunnelgate_status_json(tg.name()).expect("status");
    let readers = &status["tuning"]["readers"];
    assert_eq!(readers["priority"], 1, "{status}");
    assert_eq!(readers["running"], 4, "{status}");
    let access = readers["access"].as_str().unwrap_or_default();
    assert!(access == "capability" || access == "rlimit", "{status}");
    drop(tg);

    // With the relay on, the readers' partners stay at normal priority (a waiting reader
    // lends them its priority through a priority-inheriting lock, which changes no policy):
    // still only the readers are real-time, and status counts the readers alone.
    let mut cfg = TgConfig::new(0, &["100.64.0.3/32"]);
    cfg.workers = Some(2);
    let relay = Tunnelgate::spawn_env(&ns, cfg, &[("TUNNELGATE_RELAY_PARTNERS", "3")]);
    relay.wait_ready(Duration::from_secs(15)).expect("ready");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let partners = 4 * (2usize.min(cpus) - 1);
    let up = poll_until(Duration::from_secs(5), || {
        policies = thread_policies(relay.pid());
        let readers = policies
            .iter()
            .filter(|(n, p)| is_packet_reader(n) && *p == SCHED_FIFO)
            .count();
        let started = policies.iter().filter(|(n, _)| is_relay_partner(n)).count();
        readers == 4 && started == partners
    });
    assert!(
        up,
        "4 readers at SCHED_FIFO and {partners} partners: {policies:?}\n{}",
        relay.stderr()
    );
    for (name, policy) in &policies {
        if !is_packet_reader(name) {
            assert_ne!(*policy, SCHED_FIFO, "{name} is real-time: {policies:?}");
        }
    }
    let status = tunnelgate_status_json(relay.name()).expect("status");
    assert_eq!(status["tuning"]["readers"]["running"], 4, "{status}");
    assert_eq!(status["tuning"]["relay_partners"], partners / 4, "{status}");
    drop(relay);

    let other_ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.64.0.2/32"]);
    cfg.workers = Some(2);
    let off = Tunnelgate::spawn_env(&other_ns, cfg, &[("TUNNELGATE_RT_PRIORITY", "0")]);
    off.wait_ready(Duration::from_secs(15)).expect("ready");
    std::thread::sleep(Duration::from_millis(500));
    let policies = thread_policies(off.pid());
    assert!(
        policies.iter().any(|(n, _)| n.starts_with("tg-udp-rx-")),
        "{policies:?}"
    );
    assert!(
        policies.iter().all(|(_, p)| *p != SCHED_FIFO),
        "TUNNELGATE_RT_PRIORITY=0, yet: {policies:?}"
    );
}

/// The manifest's proxy container (and the units) grant `CAP_NET_RAW` whatever the backend,
/// without `CAP_SETPCAP`: with nftables the daemon drops it from every set that grants it and
/// cannot take it out of the bounding set. That is said once, as information: no WARN line at
/// start for a capability the backend does not need (issue 37).
#[test]
#[ignore = "needs root and network namespaces"]
fn a_granted_capability_nftables_does_not_need_is_no_warning() {
    require_root();
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.64.0.1/32"]);
    cfg.extra = format!("[firewall]\nmode = \"nftables\"\n\n{}", ingress(&["80"]));
    let dir = TempDir::new("tx-bounding");
    dir.write_secret("private.key", &format!("{}\n", cfg.key.private));
    let config = dir.write("tunnelgate.toml", &cfg.render("private.key"));
    let config = config.display().to_string();
    // The pod's securityContext: drop ALL, add NET_ADMIN, NET_RAW and SYS_NICE; no-new-privs.
    let mut daemon = Proc::spawn(
        ns.command(&[
            "setpriv",
            "--bounding-set",
            "-all,+net_admin,+net_raw,+sys_nice",
            "--inh-caps",
            "-all",
            "--no-new-privs",
            "--",
            tunnelgate_bin(),
            "run",
            "--config",
            &config,
            "--log-format",
            "json",
        ]),
        "tunnelgate",
        dir.path(),
    );
    let ready = poll_until(Duration::from_secs(15), || {
        daemon.stderr().contains("\"Ready\"")
    });
    assert!(ready, "not ready:\n{}", daemon.stderr());
    let lines: Vec<serde_json::Value> = daemon
        .stderr()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let warnings: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
    let bounding = lines
        .iter()
        .find(|l| l["bounding"].is_string())
        .unwrap_or_else(|| panic!("the bounding set is not mentioned:\n{}", daemon.stderr()));
    assert_eq!(bounding["level"], "INFO", "{bounding}");
    // CAP_SYS_NICE is the packet readers' alone, and never a child's (no-new-privs; the
    // firewall tools are started without it): it stays in the bounding set all the same.
    assert_eq!(
        bounding["bounding"], "CAP_NET_RAW CAP_SYS_NICE",
        "{bounding}"
    );
    let status = daemon.sigterm(Duration::from_secs(10));
    assert!(status.success(), "exit {status:?}: {}", daemon.stderr());
}
