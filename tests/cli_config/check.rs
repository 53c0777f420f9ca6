//! `tunnelgate check`: the example's plan, warnings, shipped configs, log format and help.

use super::*;

#[test]
fn check_on_the_example_prints_the_plan_and_changes_nothing() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/example.toml");
    let text = std::fs::read_to_string(&example).expect("config/example.toml");
    let dir = TempDir::new("example");
    let private = genkey();
    dir.write_secret("private.key", &format!("{private}\n"));
    dir.write_secret("psk", &format!("{}\n", genkey()));
    let path = dir.write("tunnelgate.toml", &text);
    let name = "tg0"; // interface.name of the example
    let existed = net_devices().contains(name);
    let socket_existed = wg_socket(name).exists();

    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "check of the example: {out:?}");
    let plan = &out.stdout;
    let public = pubkey(&private).stdout.trim().to_string();
    assert!(
        plan.contains(&public),
        "the plan shows the public key: {plan}"
    );
    for line in [
        "ip address add 100.64.0.1/32 dev tg0",
        "ip address add fd7a:115c:a1e0::1/128 dev tg0",
        "ip route add 100.64.0.2/32 dev tg0",
        "ip route add fd7a:115c:a1e0::2/128 dev tg0",
        "ip route add 10.0.0.0/24 dev tg0",
    ] {
        assert!(
            plan.lines().any(|l| l.trim() == line),
            "{line:?} missing from the plan:\n{plan}"
        );
    }
    assert!(
        plan.contains("ip_forward"),
        "the plan names the sysctls: {plan}"
    );
    // The firewall text of whichever backend was chosen.
    let (_, firewall) = plan
        .split_once("# firewall (")
        .unwrap_or_else(|| panic!("no firewall section in the plan:\n{plan}"));
    let nft = firewall.starts_with("nftables");
    let ipt = firewall.starts_with("iptables");
    assert!(nft || ipt, "unknown backend in the plan: {firewall}");
    if nft {
        // The table is named after the interface, so daemons for other interfaces coexist.
        assert!(
            firewall.contains("table inet tunnelgate_tg0 {"),
            "{firewall}"
        );
        // Forwarded ports are map elements, read by one rule per family and protocol.
        assert!(
            firewall.contains(" . 443 comment \"ingress[0]\" : 10.96.0.10 . 8443"),
            "{firewall}"
        );
        assert!(
            firewall.contains("8080 comment \"egress[0]\" : 100.64.0.2 . 80"),
            "{firewall}"
        );
        assert!(
            firewall.contains("dnat ip to ip daddr . tcp dport map @in4_tcp_dnat"),
            "{firewall}"
        );
    } else {
        assert!(firewall.contains("*nat"), "{firewall}");
        assert!(firewall.contains(":TG-tg0-PRE - [0:0]"), "{firewall}");
        assert!(firewall.contains("COMMIT"), "{firewall}");
        assert!(firewall.contains("10.96.0.10"), "{firewall}");
    }
    assert!(
        firewall.contains("tg0"),
        "rules are scoped to the tunnel: {firewall}"
    );

    // Nothing changed: no interface, no socket.
    assert_eq!(
        net_devices().contains(name),
        existed,
        "check created the interface"
    );
    assert_eq!(
        wg_socket(name).exists(),
        socket_existed,
        "check created a UAPI socket"
    );
}

#[test]
fn check_of_a_config_without_rules_prints_no_firewall() {
    let case = Case::new();
    let path = case.write("listen_port = 51820", "listen_port = 51820");
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        !out.stdout.contains("table inet tunnelgate_") && !out.stdout.contains("*nat"),
        "a plain tunnel installs no firewall rules:\n{}",
        out.stdout
    );
    assert!(out
        .stdout
        .contains(&format!("ip route add 10.0.0.0/24 dev {}", case.name)));
}

/// Issue 27: `check` warns (exit 0, never refuses) about an ingress to loopback, which can
/// never work, and to the gateway's own health endpoint, which would hand `/metrics` to the
/// tunnel; a sound ingress gets no such word.
#[test]
fn check_warns_about_an_ingress_to_loopback_or_to_its_own_health_port() {
    let case = Case::new();
    let cases = [
        (
            "[[ingress]]\ntarget = \"127.0.0.1\"\nports = [\"8080\"]\n",
            "listen = \"\"",
            "ingress[0].target: 127.0.0.1 is a loopback address",
        ),
        (
            "[[ingress]]\ntarget = \"192.0.2.50\"\nports = [\"80:9102\"]\n",
            "listen = \"192.0.2.50:9102\"",
            "this gateway's own health endpoint",
        ),
    ];
    for (ingress, health, warning) in cases {
        let text = format!(
            "{}\n{ingress}",
            case.base().replace("listen = \"\"", health)
        );
        let path = case.dir.write("tunnelgate.toml", &text);
        let out = cli(&["check", "--config", &path.display().to_string()], None);
        assert_eq!(out.code, Some(0), "a warning, not an error: {out:?}");
        assert!(
            out.stderr.contains("warning:") && out.stderr.contains(warning),
            "{ingress}: {}",
            out.stderr
        );
    }
    let text = format!(
        "{}\n[[ingress]]\ntarget = \"192.0.2.60\"\nports = [\"80\"]\n",
        case.base()
    );
    let path = case.dir.write("tunnelgate.toml", &text);
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stderr.contains("ingress[0]"), "{}", out.stderr);
}

/// `--log-format` belongs to the subcommands that log: `run` takes it; the others refuse it as
/// a usage error instead of silently ignoring it.
#[test]
fn log_format_is_only_on_run() {
    let help = cli(&["run", "--help"], None);
    assert_eq!(help.code, Some(0), "{help:?}");
    assert!(help.stdout.contains("--log-format"), "{}", help.stdout);
    for sub in ["check", "status", "reload", "genkey"] {
        let out = cli(&[sub, "--log-format", "json"], None);
        assert_eq!(out.code, Some(2), "{sub} --log-format: {out:?}");
        let help = cli(&[sub, "--help"], None);
        assert!(
            !help.stdout.contains("--log-format"),
            "{sub}: {}",
            help.stdout
        );
    }
}

/// Every file in `config/` passes `tunnelgate check` once the steps in its header comment are
/// done: each key file it names is created by one of them (`(umask 077; tunnelgate genkey >
/// .../NAME)`).
/// The placeholder peer keys they ship with are a warning, not an error.
#[test]
fn every_shipped_config_passes_check() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("config/")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read");
        let tmp = TempDir::new("shipped");
        let created: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with('#'))
            .filter_map(|l| l.split_once("> /etc/tunnelgate/"))
            .filter_map(|(_, rest)| rest.split([';', ' ', ')']).next())
            .collect();
        for name in &created {
            tmp.write_secret(name, &genkey());
        }
        let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o600);
        let out = cli(&["check", "--config", &cfg.display().to_string()], None);
        assert_eq!(
            out.code,
            Some(0),
            "{} after its header steps (created {created:?}): {}",
            file.display(),
            out.stderr
        );
        assert!(
            out.stderr.contains("looks like a placeholder"),
            "{}: its placeholder keys are pointed out: {}",
            file.display(),
            out.stderr
        );
    }
}

/// A secret written inline in a file others can read is a warning (the daemon still starts).
#[test]
fn inline_private_key_in_a_readable_file_is_a_warning() {
    let tmp = TempDir::new("inline");
    let text = format!(
        "[interface]\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o644);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("warning: interface.private_key: a secret written inline")
            && out.stderr.contains("0644"),
        "{}",
        out.stderr
    );
    let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert!(!out.stderr.contains("inline"), "{}", out.stderr);
}

#[test]
fn help_of_help_exits_0() {
    for args in [
        &["help", "--help"][..],
        &["help"],
        &["help", "reload"],
        &["--help"],
    ] {
        let out = cli(args, None);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
    assert_eq!(cli(&["help", "nosuch"], None).code, Some(2));
}

/// Issue 38: `check` shows the tuning a start would get, in text and JSON: the packet readers'
/// priority and how they would get it (or why not), their budget, the AQM, the workers; the
/// knobs come from the environment, each bad value named once.
#[test]
fn check_shows_the_tuning_a_start_would_get_in_text_and_json() {
    let dir = TempDir::new("check-tuning");
    dir.write_secret("private.key", &format!("{}\n", genkey()));
    let path = dir.write(
        "tunnelgate.toml",
        "[interface]\nname = \"tgcheck0\"\nprivate_key_file = \"private.key\"\n\
         addresses = [\"100.64.0.1/32\"]\nworkers = 3\n",
    );
    let path = path.display().to_string();
    let check = |env: &[(&str, &str)], json: bool| -> CmdOutput {
        let mut cmd = Command::new(tunnelgate_bin());
        cmd.args(["check", "--config", &path]);
        if json {
            cmd.arg("--json");
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        common::output_of(cmd, None)
    };

    let out = check(
        &[
            ("TUNNELGATE_AQM_INTERVAL_US", "20000"),
            ("TUNNELGATE_RT_SHARE_PERCENT", "80"),
        ],
        false,
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let tuning = out
        .stdout
        .split_once("\ntuning:\n")
        .map(|(_, t)| t.to_string())
        .unwrap_or_else(|| panic!("no tuning block:\n{}", out.stdout));
    assert!(tuning.contains("packet readers: "), "{tuning}");
    assert!(
        tuning.contains("receive queue AQM: CoDel, target 1000 us, interval 20000 us"),
        "{tuning}"
    );
    assert!(tuning.contains("  workers: 3 ("), "{tuning}");
    // On by default: a partner per other CPU the 3 workers may use.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let by_default = cpus.min(3) - 1;
    let relay_line = match by_default {
        0 => "  relay: off (one CPU)".to_string(),
        1 => "  relay: 1 partner thread per packet reader".to_string(),
        n => format!("  relay: {n} partner threads per packet reader"),
    };
    assert!(tuning.contains(&relay_line), "{cpus} CPUs: {tuning}");
    // Whatever this process may do, the readers' line says which and why.
    let readers = tuning.lines().next().unwrap_or_default();
    assert!(
        readers.starts_with("  packet readers: real-time (SCHED_FIFO 1), by ")
            || readers.starts_with("  packet readers: normal priority: running as "),
        "{readers}"
    );
    // The budget is shown exactly when the readers may use real-time priority.
    assert_eq!(
        tuning.contains("    budget: 80 % of the time each"),
        readers.contains("real-time"),
        "{tuning}"
    );
    assert!(
        tuning.contains(
            "  environment: TUNNELGATE_AQM_INTERVAL_US=\"20000\", TUNNELGATE_RT_SHARE_PERCENT=\"80\"\n"
        ),
        "{tuning}"
    );

    let out = check(
        &[
            ("TUNNELGATE_RT_PRIORITY", "0"),
            ("TUNNELGATE_AQM_TARGET_US", "0"),
        ],
        true,
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_str(&out.stdout).expect("check --json");
    assert_eq!(json["interface"], "tgcheck0");
    assert!(
        json["plan"]
            .as_str()
            .is_some_and(|p| p.contains("ip address add")),
        "{json}"
    );
    let tuning = &json["tuning"];
    assert_eq!(tuning["readers"]["access"], "off", "{tuning}");
    assert_eq!(
        tuning["readers"]["priority"],
        serde_json::Value::Null,
        "{tuning}"
    );
    assert_eq!(
        tuning["readers"]["running"],
        serde_json::Value::Null,
        "nothing runs: {tuning}"
    );
    assert_eq!(tuning["aqm_target_us"], serde_json::Value::Null, "{tuning}");
    assert_eq!(tuning["workers"], 3, "{tuning}");
    assert_eq!(tuning["relay_partners"], by_default, "{tuning}");
    assert_eq!(tuning["relay_asked"], serde_json::Value::Null, "{tuning}");

    // Asked for, the relay gets a partner per other CPU the 3 workers may use, at most the 3
    // asked for; 0 turns it off whatever the CPUs.
    let out = check(&[("TUNNELGATE_RELAY_PARTNERS", "0")], false);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains("  relay: off (TUNNELGATE_RELAY_PARTNERS=0)"),
        "{}",
        out.stdout
    );
    let out = check(&[("TUNNELGATE_RELAY_PARTNERS", "3")], true);
    assert_eq!(out.code, Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_str(&out.stdout).expect("check --json");
    assert_eq!(json["tuning"]["relay_asked"], 3, "{}", json["tuning"]);
    assert_eq!(
        json["tuning"]["relay_partners"],
        cpus.min(3) - 1,
        "{cpus} CPUs: {}",
        json["tuning"]
    );

    // A bad value is named once, on stderr, and the default stays.
    let out = check(&[("TUNNELGATE_RT_SHARE_PERCENT", "100")], true);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stderr
            .matches("TUNNELGATE_RT_SHARE_PERCENT=\"100\": expected a number from 5 to 95")
            .count(),
        1,
        "{}",
        out.stderr
    );
    let json: serde_json::Value = serde_json::from_str(&out.stdout).expect("check --json");
    // The default share, whether or not this process may use real-time priority.
    assert_eq!(json["tuning"]["readers"]["share_percent"], 90, "{json}");
}

/// Every knob is read strictly and `check` says so: a sign, an empty value, a word that is
/// not the knob's, a flag that is not 1/0/true/false each get the one warning; a flag of 0
/// leaves the offload on; a relay asked past the CPUs is shown lowered, with the reason.
#[test]
fn check_warns_of_every_value_not_taken_and_shows_what_was_lowered() {
    let dir = TempDir::new("check-knobs");
    dir.write_secret("private.key", &format!("{}\n", genkey()));
    let path = dir.write(
        "tunnelgate.toml",
        "[interface]\nname = \"tgknobs0\"\nprivate_key_file = \"private.key\"\n\
         addresses = [\"100.64.0.1/32\"]\nworkers = 2\n",
    );
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(["check", "--config", &path.display().to_string()])
        .env("TUNNELGATE_RT_PRIORITY", "+2")
        .env("TUNNELGATE_SOCKET_BUFFER", "")
        .env("TUNNELGATE_SECCOMP", "bogus")
        .env("TUNNELGATE_IPTABLES", "bogus")
        .env("TUNNELGATE_NO_UDP_GRO", "0")
        .env("TUNNELGATE_NO_UDP_GSO", "yes")
        .env("TUNNELGATE_RELAY_PARTNERS", "3");
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(0), "{out:?}");
    for warning in [
        "TUNNELGATE_RT_PRIORITY=\"+2\": expected a number from 0 to 49; using the default 1",
        "TUNNELGATE_SOCKET_BUFFER=\"\": expected a number from 65536 to 67108864",
        "TUNNELGATE_SECCOMP=\"bogus\": expected one of \"enforce\", \"log\", \"off\"",
        "TUNNELGATE_IPTABLES=\"bogus\": expected one of \"legacy\", \"nft\"",
        "TUNNELGATE_NO_UDP_GSO=\"yes\": expected 1, 0, true or false",
    ] {
        assert_eq!(
            out.stderr
                .matches(&format!("tunnelgate check: warning: {warning}"))
                .count(),
            1,
            "{warning}: {}",
            out.stderr
        );
    }
    assert!(
        !out.stderr.contains("TUNNELGATE_NO_UDP_GRO"),
        "{}",
        out.stderr
    );
    assert!(
        out.stdout.contains("(GRO on, GSO on)"),
        "0 leaves GRO on, a refused value GSO: {}",
        out.stdout
    );
    // Two workers give one partner at most (one per other worker), whatever the CPUs.
    assert!(
        out.stdout
            .contains("    TUNNELGATE_RELAY_PARTNERS=3 lowered to 1: "),
        "{}",
        out.stdout
    );
}
