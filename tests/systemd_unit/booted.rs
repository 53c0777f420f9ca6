//! Under a real booted systemd: the watchdog restarts the service for a wedged packet thread or a stalled event loop; a refused reload fails.

use super::*;

/// The systemd watchdog under a real systemd: the shipped unit's `WatchdogSec=` is honoured (the
/// daemon's pings move the unit's watchdog timestamp), and when one packet thread of the running
/// service is frozen, the pings stop, systemd kills the service for a watchdog timeout and
/// restarts it: a new main process, `NRestarts` up by one, the journal says why.
#[test]
#[ignore = "needs root, systemd-nspawn and a Debian rootfs (built once with debootstrap)"]
fn a_wedged_packet_thread_gets_the_service_restarted_by_the_systemd_watchdog() {
    require_root();
    let Some(rootfs) = rootfs_or_skip() else {
        return;
    };
    let watchdog = Duration::from_secs(
        service("WatchdogSec")
            .trim_end_matches('s')
            .parse()
            .expect("WatchdogSec in seconds"),
    );
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.83.2.1/32"]);
    cfg.health = None;
    let etc = TempDir::new("nspawn-watchdog");
    etc.write_secret("private.key", &cfg.key.private);
    etc.write_secret("tunnelgate.toml", &cfg.render("private.key"));
    let container = Container::boot(&rootfs, &ns, &etc);
    let unit = "tunnelgate.service";
    let journal = || {
        container
            .inside(&["journalctl", "-u", "tunnelgate", "--no-pager"])
            .stdout
    };
    let (first_pid, restarts_before) = container.active_with_watchdog(unit, watchdog, "the unit's");

    // Alive: the daemon pings at half the interval, and each ping moves the unit's watchdog
    // timestamp.
    let stamp = || container.property(unit, "WatchdogTimestampMonotonic");
    let stamp0 = stamp();
    assert!(
        poll_until(watchdog / 2 + Duration::from_secs(3), || {
            let s = stamp();
            s != stamp0 && s != "0"
        }),
        "no WATCHDOG=1 within {:?}: the timestamp stays {stamp0}\n{}",
        watchdog / 2 + Duration::from_secs(3),
        journal()
    );
    assert_eq!(container.property(unit, "MainPID"), first_pid);

    // Wedge the first TUN reader of the running service.
    let host_pid = container
        .host_pid(&first_pid)
        .unwrap_or_else(|| panic!("the host's id of the container's process {first_pid}"));
    let tids = threads_named(host_pid, "tg-tun-rx-0");
    assert_eq!(tids.len(), 1, "tg-tun-rx-0 of {host_pid}: {tids:?}");
    // Stuck after STALL_LIMIT (5 s), pings stop; systemd waits WatchdogSec from the last one.
    let budget = watchdog + Duration::from_secs(5 + 15);
    let frozen = freeze_until_killed(tids[0], budget + Duration::from_secs(5));
    let restarted = poll_until(budget, || {
        let pid = container.property(unit, "MainPID");
        pid != first_pid && pid != "0" && container.property(unit, "ActiveState") == "active"
    });
    let died_frozen = frozen.join().expect("the freezing thread");
    let log = journal();
    assert!(
        restarted,
        "{unit} was not restarted within {budget:?} of a frozen packet thread:\n{log}"
    );
    assert_eq!(
        died_frozen,
        Ok(true),
        "the process was killed with its thread still frozen"
    );
    assert_eq!(
        container.property(unit, "NRestarts"),
        (restarts_before + 1).to_string(),
        "{log}"
    );
    assert!(
        log.contains("Watchdog timeout"),
        "the journal says it was the watchdog:\n{log}"
    );
    assert!(
        log.contains("withholding systemd watchdog pings") && log.contains("tg-tun-rx-0"),
        "the daemon said which thread stopped the pings:\n{log}"
    );
    eprintln!("journal of {unit}:\n{log}");
    // The new process serves the watchdog too: it is not killed again.
    std::thread::sleep(watchdog / 2 + Duration::from_secs(2));
    assert_eq!(container.property(unit, "ActiveState"), "active");
    assert_eq!(
        container.property(unit, "NRestarts"),
        (restarts_before + 1).to_string()
    );
    container.poweroff();
}

/// The systemd watchdog sees the event loop too (issue 27): when the daemon's event loop stalls
/// (a blocking call on its thread, here the `TUNNELGATE_TEST_STALL_LOOP` test hook, set by a
/// drop-in with a short `WatchdogSec=`) while every packet thread runs on, the pings stop,
/// systemd kills the service for a watchdog timeout and restarts it: `NRestarts` up by one, the
/// journal says the loop stalled.
#[test]
#[ignore = "needs root, systemd-nspawn and a Debian rootfs (built once with debootstrap)"]
fn a_stalled_event_loop_gets_the_service_restarted_by_the_systemd_watchdog() {
    if !cfg!(feature = "test-hooks") {
        panic!("the stall hook is compiled only with --features test-hooks (or --all-features)");
    }
    require_root();
    let Some(rootfs) = rootfs_or_skip() else {
        return;
    };
    let watchdog = Duration::from_secs(6);
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.83.4.1/32"]);
    cfg.health = None;
    let etc = TempDir::new("nspawn-stall");
    etc.write_secret("private.key", &cfg.key.private);
    etc.write_secret("tunnelgate.toml", &cfg.render("private.key"));
    let dropin = TempDir::new("nspawn-stall-dropin");
    dropin.write(
        "stall.conf",
        &format!(
            "[Service]\nEnvironment=TUNNELGATE_TEST_STALL_LOOP=/etc/tunnelgate/stall-loop\n\
             WatchdogSec={}s\n",
            watchdog.as_secs()
        ),
    );
    let container = Container::boot_with(
        &rootfs,
        &ns,
        &etc,
        &[format!(
            "--bind-ro={}:/etc/systemd/system/tunnelgate.service.d",
            dropin.path().display()
        )],
    );
    let unit = "tunnelgate.service";
    let journal = || {
        container
            .inside(&["journalctl", "-u", "tunnelgate", "--no-pager"])
            .stdout
    };
    let (first_pid, restarts_before) =
        container.active_with_watchdog(unit, watchdog, "the drop-in's");
    // Alive and pinging before the stall.
    std::thread::sleep(watchdog);
    assert_eq!(
        container.property(unit, "MainPID"),
        first_pid,
        "{}",
        journal()
    );

    // Stall the loop: its next turn (within the 2 s config poll) blocks; after the stall limit
    // (5 s) the pings stop, and systemd waits WatchdogSec from the last one.
    etc.write("stall-loop", "");
    let budget = Duration::from_secs(2 + 5) + watchdog + Duration::from_secs(15);
    let restarted = poll_until(budget, || {
        let pid = container.property(unit, "MainPID");
        pid != first_pid && pid != "0"
    });
    // The new process must not stall too.
    std::fs::remove_file(etc.path().join("stall-loop")).expect("remove the stall file");
    let log = journal();
    assert!(
        restarted,
        "{unit} was not restarted within {budget:?} of a stalled event loop:\n{log}"
    );
    assert!(
        poll_until(Duration::from_secs(20), || container
            .property(unit, "ActiveState")
            == "active"),
        "active again:\n{}",
        journal()
    );
    let log = journal();
    eprintln!("journal of {unit}:\n{log}");
    assert_eq!(
        container.property(unit, "NRestarts"),
        (restarts_before + 1).to_string(),
        "{log}"
    );
    assert!(
        log.contains("Watchdog timeout"),
        "the journal says it was the watchdog:\n{log}"
    );
    assert!(
        log.contains("event loop stalled for")
            && log.contains("withholding systemd watchdog pings"),
        "the daemon said the loop stopped the pings:\n{log}"
    );
    // The new process serves the watchdog: it is not killed again.
    std::thread::sleep(watchdog + Duration::from_secs(2));
    assert_eq!(container.property(unit, "ActiveState"), "active");
    assert_eq!(
        container.property(unit, "NRestarts"),
        (restarts_before + 1).to_string(),
        "{}",
        journal()
    );
    container.poweroff();
}

/// `systemctl reload` under a real systemd (PID 1 of a systemd-nspawn container in a test
/// namespace) runs the unit's ExecReload: 0 for a good file, non-zero for a refused one, and the
/// service stays active on its old configuration.
#[test]
#[ignore = "needs root, systemd-nspawn and a Debian rootfs (built once with debootstrap)"]
fn systemctl_reload_under_real_systemd_fails_on_a_refused_file() {
    require_root();
    // Skipped with a note on a developer machine without the tools; CI must run it.
    let Some(rootfs) = rootfs_or_skip() else {
        return;
    };
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.83.0.1/32"]);
    cfg.health = None;
    let etc = TempDir::new("nspawn-etc");
    etc.write_secret("private.key", &cfg.key.private);
    let good = cfg.render("private.key");
    etc.write_secret("tunnelgate.toml", &good);
    let container = Container::boot(&rootfs, &ns, &etc);
    let inside = |args: &[&str]| container.inside(args);
    let active = || inside(&["systemctl", "is-active", "tunnelgate.service"]).stdout;
    let booted = poll_until(Duration::from_secs(60), || active().trim() == "active");
    let journal = || inside(&["journalctl", "-u", "tunnelgate", "--no-pager"]).stdout;
    assert!(
        booted,
        "tunnelgate.service active under systemd: {}\n{}\n{}",
        active(),
        journal(),
        container.nspawn.stderr()
    );

    let out = inside(&["systemctl", "reload", "tunnelgate.service"]);
    assert!(
        out.success(),
        "reload of an unchanged file: {out:?}\n{}",
        journal()
    );
    etc.write_secret(
        "tunnelgate.toml",
        &good.replace("listen_port = 0", "listen_port = \"x\""),
    );
    let out = inside(&["systemctl", "reload", "tunnelgate.service"]);
    assert!(
        !out.success(),
        "systemctl reload of a refused file fails: {out:?}"
    );
    assert_eq!(active().trim(), "active", "{}", journal());
    let log = journal();
    assert!(
        log.contains("interface.listen_port"),
        "the journal says why:\n{log}"
    );
    eprintln!("journal of tunnelgate.service:\n{log}");
    // The daemon's own entries: a priority from the level, one entry for the multi-line
    // refusal, and no second timestamp.
    let entries: Vec<serde_json::Value> = inside(&[
        "journalctl",
        "-u",
        "tunnelgate",
        "-o",
        "json",
        "--no-pager",
        "_COMM=tunnelgate",
    ])
    .stdout
    .lines()
    .filter_map(|l| serde_json::from_str(l).ok())
    .collect();
    let entry = |needle: &str| -> serde_json::Value {
        entries
            .iter()
            .find(|e| e["MESSAGE"].as_str().is_some_and(|m| m.contains(needle)))
            .cloned()
            .unwrap_or_else(|| panic!("no journal entry with {needle:?}: {entries:#?}"))
    };
    let refused = entry("Reload rejected");
    assert_eq!(refused["PRIORITY"], "3", "error priority: {refused}");
    assert!(
        refused["MESSAGE"]
            .as_str()
            .is_some_and(|m| m.contains("interface.listen_port")),
        "the whole error in one entry: {refused}"
    );
    let up = entry("Tunnel up");
    assert_eq!(up["PRIORITY"], "6", "info priority: {up}");
    for e in &entries {
        let m = e["MESSAGE"].as_str().unwrap_or_default();
        assert!(
            !m.starts_with("20") && !m.contains(" INFO ") && !m.starts_with('<'),
            "no timestamp, level word or raw prefix in the message: {m:?}"
        );
    }

    // The template unit: a second instance beside the first, from /etc/tunnelgate/office.toml.
    let mut office = TgConfig::new(0, &["100.83.1.1/32"]);
    office.health = None;
    etc.write_secret("office.key", &office.key.private);
    etc.write_secret("office.toml", &office.render("office.key"));
    let office_journal = || inside(&["journalctl", "-u", "tunnelgate@office", "--no-pager"]).stdout;
    let office_active = || inside(&["systemctl", "is-active", "tunnelgate@office.service"]).stdout;
    let out = inside(&["systemctl", "start", "tunnelgate@office.service"]);
    assert!(
        out.success(),
        "start tunnelgate@office: {out:?}\n{}",
        office_journal()
    );
    assert_eq!(office_active().trim(), "active", "{}", office_journal());
    assert_eq!(active().trim(), "active", "the first instance runs on");
    // (The container shares the test namespace's network.)
    let link = |name: &str| ns.link_exists(name);
    assert!(link(&office.name) && link(&cfg.name), "both tunnels up");
    let out = inside(&["systemctl", "reload", "tunnelgate@office.service"]);
    assert!(
        out.success(),
        "reload tunnelgate@office: {out:?}\n{}",
        office_journal()
    );
    let out = inside(&["systemctl", "stop", "tunnelgate@office.service"]);
    assert!(out.success(), "stop tunnelgate@office: {out:?}");
    assert_ne!(office_active().trim(), "active");
    assert!(!link(&office.name), "the stopped instance's tunnel is gone");
    assert!(link(&cfg.name), "the other instance's tunnel stays");
    assert_eq!(active().trim(), "active", "{}", journal());

    container.poweroff();
}
