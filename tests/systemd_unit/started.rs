//! The daemon started as the unit starts it (no real systemd): watchdog pings, sd_notify
//! states, iptables-legacy with the unit's capabilities, the packet readers at real-time
//! priority and the firewall tools without it.

use super::*;
use std::collections::BTreeMap;

/// `WATCHDOG=1` goes out at half of `$WATCHDOG_USEC` while every packet thread is alive, stops
/// while one is frozen (and the daemon logs which), resumes when it runs again; none is sent
/// when `$WATCHDOG_PID` names another process.
#[test]
#[ignore = "needs root"]
fn watchdog_pings_only_while_every_packet_thread_is_alive() {
    let ns = Netns::new();
    let dir = TempDir::new("unit-watchdog");
    let mut notify = NotifySocket::bind(&dir);
    let notify_path = notify.path.display().to_string();
    let mut cfg = TgConfig::new(0, &["100.82.3.1/32"]);
    cfg.health = None;
    // 2 s: a ping every second.
    let mut tg = Tunnelgate::spawn_env(
        &ns,
        cfg,
        &[
            ("NOTIFY_SOCKET", &notify_path),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    notify.expect("READY=1", Duration::from_secs(15), || tg.stderr());
    for _ in 0..3 {
        notify.expect("WATCHDOG=1", Duration::from_millis(1500), || tg.stderr());
    }
    let tids = threads_named(tg.pid(), "tg-udp-rx-0");
    assert_eq!(tids.len(), 1, "tg-udp-rx-0: {tids:?}");
    // Held for 12 s: the stall limit (5 s), then a window of 6 s without a ping.
    let frozen = freeze_until_killed(tids[0], Duration::from_secs(12));
    std::thread::sleep(Duration::from_secs(5) + Duration::from_millis(1500));
    // The pings of the first seconds of the freeze, while it was not yet a stall, are queued.
    notify.drain();
    let log_len = notify.log.len();
    assert!(
        notify.quiet("WATCHDOG=1", Duration::from_secs(4)),
        "pinged with a frozen packet thread: {:?}\n{}",
        &notify.log[log_len..],
        tg.stderr()
    );
    assert_eq!(frozen.join().expect("freezer"), Ok(false), "detached alive");
    notify.expect("WATCHDOG=1", Duration::from_secs(3), || tg.stderr());
    let log = tg.stderr();
    assert!(
        log.contains("packet thread tg-udp-rx-0 stuck for")
            && log.contains("withholding systemd watchdog pings")
            && log.contains("pings resume"),
        "{log}"
    );
    tg.sigterm();

    // WATCHDOG_PID names another process (a parent that forked us): not our watchdog.
    let mut cfg = TgConfig::new(0, &["100.82.4.1/32"]);
    cfg.health = None;
    let tg = Tunnelgate::spawn_env(
        &ns,
        cfg,
        &[
            ("NOTIFY_SOCKET", &notify_path),
            ("WATCHDOG_USEC", "1000000"),
            ("WATCHDOG_PID", "1"),
        ],
    );
    notify.expect("READY=1", Duration::from_secs(15), || tg.stderr());
    assert!(
        notify.quiet("WATCHDOG=1", Duration::from_secs(2)),
        "pinged for another process: {:?}",
        notify.log
    );
}

#[test]
#[ignore = "needs root"]
fn daemon_started_like_the_unit_notifies_ready_reloading_stopping() {
    started_like_the_unit("", &[]);
}

/// The same with iptables-legacy rules: the one backend that needs CAP_NET_RAW.
#[test]
#[ignore = "needs root"]
fn iptables_legacy_works_with_the_unit_capabilities() {
    started_like_the_unit(
        "[firewall]\nmode = \"iptables\"\n",
        &[("TUNNELGATE_IPTABLES", "legacy")],
    );
}

/// Starts the daemon as the unit does (plus `firewall` config and `env`) and follows its
/// notifications through start, reload and stop.
pub(crate) fn started_like_the_unit(firewall: &str, env: &[(&str, &str)]) {
    let ns = Netns::new();
    let lan = Netns::new();
    veth(
        &ns,
        &["10.40.0.1/24", "fd40::1/64"],
        &lan,
        &["10.40.0.10/24"],
    );
    let peer = Keypair::generate();
    let mut cfg = TgConfig::new(51820, &["100.82.0.1/32", "fd82::1/128"])
        .peer(Peer::new(&peer.public, &["100.82.0.2/32", "fd82::2/128"]));
    cfg.extra =
        format!("[router]\nadvertise_routes = [\"10.40.0.0/24\", \"fd40::/64\"]\n\n{firewall}");
    let dir = TempDir::new("unit-notify");
    dir.write_secret("private.key", &cfg.key.private);
    let config = dir.write("tunnelgate.toml", &cfg.render("private.key"));
    let mut notify = NotifySocket::bind(&dir);

    // ExecStart, with the binary under test and the test's config file.
    let exec = service("ExecStart");
    let mut argv: Vec<String> = exec.split_whitespace().map(String::from).collect();
    assert_eq!(
        argv[1..],
        ["run", "--config", "/etc/tunnelgate/tunnelgate.toml"]
    );
    argv[0] = tunnelgate_bin().to_string();
    argv[3] = config.display().to_string();
    // Only the unit's capabilities: the bounding set limits what root (and nft) may use.
    let caps: Vec<String> = service_words("CapabilityBoundingSet")
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let bounding = format!("-all,{}", caps.join(","));
    let mut args = vec![
        "setpriv",
        "--bounding-set",
        &bounding,
        "--no-new-privs",
        "--",
    ];
    args.extend(argv.iter().map(String::as_str));
    let mut cmd = ns.command(&args);
    cmd.env("NOTIFY_SOCKET", &notify.path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Every firewall tool the daemon runs goes through a shim that records what it was given.
    let shims = FirewallShims::install(&dir);
    cmd.env("PATH", shims.path());
    let mut daemon = Proc::spawn(cmd, "tunnelgate", dir.path());
    let pid = daemon.pid();
    let stderr = || std::fs::read_to_string(dir.path().join("tunnelgate.err")).unwrap_or_default();

    notify.expect("READY=1", Duration::from_secs(15), stderr);
    // READY means up: the tunnel, its routes, its rules and forwarding, at that moment.
    assert!(ns.link_is_up(&cfg.name), "TUN device up at READY=1");
    let routes = ns.routes();
    assert!(
        routes.contains(&format!("100.82.0.2 dev {}", cfg.name)),
        "{routes}"
    );
    let status = tunnelgate_status_json(&cfg.name).expect("status");
    assert_eq!(
        status["rules"]["applied"], true,
        "rules at READY=1: {status}"
    );
    assert!(
        status["rules"]["text"]
            .as_str()
            .is_some_and(|t| t.contains("router.advertise_routes")),
        "{status}"
    );
    if firewall.is_empty() {
        assert!(ns
            .nft_tunnelgate_table()
            .contains("router.advertise_routes"));
    } else {
        let saved = ns.exec(&["iptables-legacy-save"]);
        assert!(saved.contains("router.advertise_routes"), "{saved}");
    }
    assert_eq!(ns.sysctl_get("net.ipv4.ip_forward"), "1");
    assert_eq!(ns.sysctl_get("net.ipv6.conf.all.forwarding"), "1");
    let caps_now = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let bnd = caps_now
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .map(str::trim)
        .unwrap_or_default()
        .to_string();
    // CAP_NET_BIND_SERVICE is bit 10, CAP_NET_ADMIN bit 12, CAP_NET_RAW bit 13, CAP_SYS_NICE 23.
    assert_eq!(
        bnd, "0000000000803400",
        "the daemon ran with the unit's bounding set"
    );
    // Within it, the daemon keeps only what it uses: CAP_NET_RAW only for iptables-legacy.
    // (Without CAP_SETPCAP it cannot shrink the bounding set further; no-new-privs keeps its
    // children from gaining what it dropped.)
    let field = |k: &str| {
        caps_now
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    let kept = if firewall.is_empty() {
        "0000000000001000"
    } else {
        "0000000000003000"
    };
    assert_eq!(field("CapEff:"), kept, "effective capabilities");
    assert_eq!(field("CapPrm:"), kept, "permitted capabilities");
    assert_eq!(field("NoNewPrivs:"), "1");

    // The unit keeps CAP_SYS_NICE for the packet readers (this machine's root cannot raise
    // RLIMIT_RTPRIO): they run at SCHED_FIFO 1, nothing else of the daemon does, and the
    // firewall tools it ran got neither the capability nor a real-time limit.
    let mut scheduling = Vec::new();
    let readers_up = poll_until(Duration::from_secs(5), || {
        scheduling = thread_scheduling(pid);
        scheduling
            .iter()
            .filter(|(name, policy, priority)| {
                is_packet_reader(name) && *policy == SCHED_FIFO && *priority == 1
            })
            .count()
            >= 2
    });
    assert!(
        readers_up,
        "readers at SCHED_FIFO 1: {scheduling:?}\n{}",
        stderr()
    );
    for (name, policy, _) in &scheduling {
        assert!(
            is_packet_reader(name) || *policy != SCHED_FIFO,
            "{name} is real-time: {scheduling:?}"
        );
    }
    let children = shims.runs();
    assert!(
        !children.is_empty(),
        "no firewall tool ran through the shims"
    );
    for run in &children {
        let tool = &run.tool;
        assert_eq!(run.cap("CapEff") & CAP_SYS_NICE_BIT, 0, "{tool}: {run:?}");
        assert_eq!(run.cap("CapPrm") & CAP_SYS_NICE_BIT, 0, "{tool}: {run:?}");
        assert_eq!(run.rtprio.as_deref(), Some("0 0"), "{tool}: {run:?}");
    }

    // ExecReload, as systemd runs it (binary and file are the test's): exit 0 around
    // RELOADING=1 / READY=1; with a refused file, non-zero and the daemon runs on.
    let reload = |config: &Path| -> CmdOutput {
        let exec = service("ExecReload");
        let mut argv: Vec<String> = exec.split_whitespace().map(String::from).collect();
        assert_eq!(
            argv[1..],
            ["reload", "--config", "/etc/tunnelgate/tunnelgate.toml"]
        );
        argv[0] = tunnelgate_bin().to_string();
        argv[3] = config.display().to_string();
        let args: Vec<&str> = argv.iter().map(String::as_str).collect();
        output_of(ns.command(&args), None)
    };
    let out = reload(&config);
    assert_eq!(out.code, Some(0), "{out:?}");
    notify.expect("RELOADING=1", Duration::from_secs(10), stderr);
    notify.expect("READY=1", Duration::from_secs(10), stderr);
    let good = std::fs::read_to_string(&config).expect("config");
    std::fs::write(
        &config,
        good.replace("listen_port = 51820", "listen_port = \"x\""),
    )
    .expect("break the file");
    let out = reload(&config);
    assert_eq!(out.code, Some(1), "a refused reload fails: {out:?}");
    assert!(
        out.stderr.contains("interface.listen_port"),
        "{}",
        out.stderr
    );
    assert!(daemon.is_running(), "still running after reload");
    std::fs::write(&config, good).expect("restore the file");

    // systemctl stop: SIGTERM.
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    notify.expect("STOPPING=1", Duration::from_secs(10), stderr);
    let status = daemon
        .wait_timeout(Duration::from_secs(10))
        .expect("exits after SIGTERM");
    assert!(status.success(), "exit status {status:?}: {}", stderr());
    assert!(!ns.link_exists(&cfg.name), "TUN device removed");
    assert_eq!(ns.nft_tunnelgate_table(), "", "rules removed");
    assert!(!ns
        .exec(&["iptables-legacy-save"])
        .contains("router.advertise_routes"));
}

/// `CAP_SYS_NICE` in a `/proc/PID/status` capability mask.
const CAP_SYS_NICE_BIT: u64 = 1 << 23;

/// The firewall tools (`nft`, the iptables family) as shims in a folder put first on the
/// daemon's `PATH`: each records its capabilities and `RLIMIT_RTPRIO`, then runs the real tool.
struct FirewallShims {
    dir: PathBuf,
    log: PathBuf,
}

/// What one shimmed tool was started with.
#[derive(Debug)]
struct ShimRun {
    tool: String,
    caps: BTreeMap<String, u64>,
    /// `Max realtime priority` soft and hard, as `/proc/PID/limits` shows them.
    rtprio: Option<String>,
}

impl ShimRun {
    fn cap(&self, set: &str) -> u64 {
        *self.caps.get(set).unwrap_or(&u64::MAX)
    }
}

impl FirewallShims {
    const TOOLS: [&'static str; 7] = [
        "nft",
        "iptables-restore",
        "ip6tables-restore",
        "iptables-legacy-restore",
        "ip6tables-legacy-restore",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ];

    fn install(dir: &TempDir) -> FirewallShims {
        let shims = dir.path().join("shims");
        std::fs::create_dir_all(&shims).expect("shim folder");
        let log = dir.path().join("shims.log");
        for tool in Self::TOOLS {
            let Ok(real) = which(tool) else { continue };
            let script = format!(
                "#!/bin/sh\n{{ echo \"tool {tool}\"; grep -E '^Cap(Eff|Prm)' /proc/$$/status; \
                 grep 'Max realtime priority' /proc/$$/limits; echo end; }} >> {log}\n\
                 exec {real} \"$@\"\n",
                log = log.display(),
            );
            let path = shims.join(tool);
            std::fs::write(&path, script).expect("write shim");
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                .expect("chmod shim");
        }
        FirewallShims { dir: shims, log }
    }

    /// The shims first, then the usual places.
    fn path(&self) -> String {
        format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.dir.display()
        )
    }

    fn runs(&self) -> Vec<ShimRun> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut runs = Vec::new();
        let mut current: Option<ShimRun> = None;
        for line in text.lines() {
            if let Some(tool) = line.strip_prefix("tool ") {
                current = Some(ShimRun {
                    tool: tool.to_string(),
                    caps: BTreeMap::new(),
                    rtprio: None,
                });
            } else if line == "end" {
                runs.extend(current.take());
            } else if let Some(run) = current.as_mut() {
                if let Some((set, value)) = line.split_once(':') {
                    if let Ok(mask) = u64::from_str_radix(value.trim(), 16) {
                        run.caps.insert(set.to_string(), mask);
                        continue;
                    }
                }
                if let Some(rest) = line.strip_prefix("Max realtime priority") {
                    let words: Vec<&str> = rest.split_whitespace().collect();
                    run.rtprio = Some(words.iter().take(2).copied().collect::<Vec<_>>().join(" "));
                }
            }
        }
        runs
    }
}

/// The absolute path of `tool` on this machine's `PATH`.
fn which(tool: &str) -> Result<String, String> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map_err(|e| e.to_string())?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() && path.starts_with('/') {
        Ok(path)
    } else {
        Err(format!("{tool} not found"))
    }
}
