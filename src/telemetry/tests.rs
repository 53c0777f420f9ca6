//! Tests of the pure renderings, and the fixtures (a sample snapshot, a fake [`Observe`]) the
//! I/O tests of the submodules share.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use super::*;

pub(crate) const PEER_A: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
pub(crate) const PEER_B: &str = "TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0=";
pub(crate) const ENDPOINT_A: &str = "198.51.100.7:51820";
pub(crate) const ENDPOINT_B: &str = "[2001:db8::7]:51821";
pub(crate) const NOW: u64 = 1_700_000_000;

pub(crate) fn sample_snapshot() -> Snapshot {
    Snapshot {
        peer_totals: None,
        netns_id: Some("net:[4026531840]".into()),
        interface: InterfaceStatus {
            name: "tg0".into(),
            public_key: "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw=".into(),
            listen_port: 51820,
            addresses: vec!["100.64.0.1/32".into(), "fd7a:115c:a1e0::1/128".into()],
            mtu: 1420,
        },
        peers: vec![
            PeerStatus {
                public_key: PEER_A.into(),
                name: Some("office".into()),
                endpoint: Some(ENDPOINT_A.into()),
                allowed_ips: vec!["100.64.0.2/32".into(), "10.0.0.0/24".into()],
                latest_handshake_unix: Some(NOW - 65),
                rx_bytes: 123_456,
                tx_bytes: 789,
                rx_packets: 100,
                tx_packets: 7,
                handshake_attempts: 3,
                handshakes_answered: 2,
                handshake_failures: 1,
                takeovers_started: 2,
                takeovers_completed: 1,
                takeovers_failed: 1,
                takeovers_no_endpoint: 0,
                takeover_ms_total: 250,
                takeover_ms_last: Some(250),
                persistent_keepalive: Some(25),
            },
            PeerStatus {
                public_key: PEER_B.into(),
                endpoint: Some(ENDPOINT_B.into()),
                allowed_ips: vec![],
                latest_handshake_unix: None,
                ..PeerStatus::default()
            },
        ],
        drops: DropStats {
            no_peer: 4,
            invalid: 2,
            ..DropStats::default()
        },
        rules: RulesStatus {
            backend: "nftables".into(),
            needed: true,
            applied: true,
            rule_count: 12,
            applies: 5,
            failures: 1,
            last_error: Some("nft: Could not process rule: No such file or directory".into()),
            last_apply_seconds: 0.0125,
            text: "table inet tunnelgate_tg0 {\n}\n".into(),
        },
        names: vec![
            NameStatus {
                name: "db.example.internal".into(),
                addresses: vec!["10.1.2.3".into(), "10.1.2.4".into()],
                last_resolved_unix: Some(NOW - 30),
                last_error: None,
                resolutions: 9,
                failures: 2,
                services: vec!["apps/db".into()],
                per_service: true,
            },
            NameStatus {
                name: "gone.example".into(),
                addresses: vec![],
                last_resolved_unix: None,
                last_error: Some("no record found for Query { name: gone.example. }".into()),
                resolutions: 4,
                failures: 4,
                services: vec!["apps/gone".into()],
                per_service: true,
            },
        ],
        services: vec![
            ServiceStatus {
                service: "apps/db".into(),
                names: vec!["db.example.internal".into()],
                unresolved_names: vec![],
            },
            ServiceStatus {
                service: "apps/gone".into(),
                names: vec!["gone.example".into()],
                unresolved_names: vec!["gone.example".into()],
            },
            ServiceStatus {
                service: "apps/web".into(),
                names: vec![],
                unresolved_names: vec![],
            },
        ],
        reloads: 3,
        reload_failures: 1,
        ready: true,
        not_ready_reason: None,
        version: "0.1.0".into(),
        process: Some(crate::telemetry::process::ProcessStats {
            resident_memory_bytes: 12_582_912,
            virtual_memory_bytes: 104_857_600,
            cpu_seconds: 3.5,
            open_fds: 17,
            max_fds: 1024,
            start_time_seconds: 1_763_900_000.0,
        }),
        tuning: sample_tuning(),
        group_exchange: None,
    }
}

pub(crate) fn sample_tuning() -> tuning::TuningStatus {
    tuning::TuningStatus {
        readers: tuning::ReadersStatus {
            priority: Some(1),
            access: "capability".into(),
            why: "by CAP_SYS_NICE, held by the packet readers alone".into(),
            running: Some(4),
            realtime_now: Some(3),
            share_percent: 90,
            unauthenticated_percent: 25,
            burst_ms: 10,
            process_rate_milli: 1800,
            realtime_cpu_seconds: 2.5,
            unauthenticated_cpu_seconds: 0.5,
            step_downs: [
                ("budget", 7),
                ("unauthenticated", 3),
                ("process_budget", 0),
                ("ping_pong", 2),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        },
        aqm_target_us: Some(1000),
        aqm_interval_us: Some(10_000),
        workers: 2,
        relay_partners: 1,
        relay_asked: None,
        relay_lowered: None,
        environment: Vec::new(),
        relay_jobs_sealed: None,
        relay_jobs_opened: None,
        cpus: 2,
        cpu_quota_milli: Some(1500),
        socket_buffer_bytes: 7 << 20,
        tun_txqueuelen: 4096,
        udp_gro: true,
        udp_gso: false,
    }
}

/// An [`Observe`] whose readiness a test can flip.
pub(crate) struct FakeObserve {
    pub(crate) not_ready: Mutex<Option<String>>,
    pub(crate) not_alive: Mutex<Option<String>>,
}

impl FakeObserve {
    pub(crate) fn new() -> Self {
        FakeObserve {
            not_ready: Mutex::new(None),
            not_alive: Mutex::new(None),
        }
    }
    pub(crate) fn set_not_alive(&self, reason: Option<&str>) {
        *self.not_alive.lock().expect("lock") = reason.map(str::to_string);
    }
    pub(crate) fn set_not_ready(&self, reason: Option<&str>) {
        *self.not_ready.lock().expect("lock") = reason.map(str::to_string);
    }
}

impl Observe for FakeObserve {
    fn liveness(&self) -> Result<(), String> {
        match &*self.not_alive.lock().expect("lock") {
            None => Ok(()),
            Some(r) => Err(r.clone()),
        }
    }
    fn readiness(&self) -> Result<(), String> {
        match &*self.not_ready.lock().expect("lock") {
            None => Ok(()),
            Some(r) => Err(r.clone()),
        }
    }
    fn snapshot(&self) -> Snapshot {
        let mut s = sample_snapshot();
        s.set_readiness(self.readiness());
        s
    }
}

/// One sample of Prometheus text: name, labels, value.
#[derive(Debug)]
pub(crate) struct Sample {
    pub(crate) name: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) value: f64,
}

/// A small checker of the Prometheus text format: every non-comment line is
/// `name{label="value",...} value` with a float value, every sample belongs to a family that
/// has a `# TYPE` line (a counter `x` owns `x_total`), types are ones the classic parser knows.
pub(crate) fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        if line.is_empty() {
            return Err(format!("line {n}: empty line"));
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest
                .split_once(' ')
                .ok_or(format!("line {n}: bad TYPE line"))?;
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty) {
                return Err(format!("line {n}: type {ty} unknown to the classic parser"));
            }
            if types.insert(name.to_string(), ty.to_string()).is_some() {
                return Err(format!("line {n}: second TYPE for {name}"));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let sample = parse_sample(line).map_err(|e| format!("line {n}: {e}: {line}"))?;
        // OpenMetrics: `# TYPE x counter` owns `x_total`; classic: `# TYPE x_total counter`.
        let family_ok = match types.get(&sample.name) {
            Some(t) => t != "counter" || sample.name.ends_with("_total"),
            None => sample
                .name
                .strip_suffix("_total")
                .and_then(|base| types.get(base))
                .is_some_and(|t| t == "counter"),
        };
        if !family_ok {
            return Err(format!("line {n}: {} has no matching # TYPE", sample.name));
        }
        samples.push(sample);
    }
    Ok(samples)
}

fn valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return Err("no value".into()),
    };
    if !valid_name(name) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut labels = BTreeMap::new();
    let rest = if let Some(mut body) = rest.strip_prefix('{') {
        loop {
            if let Some(after) = body.strip_prefix('}') {
                break after;
            }
            let eq = body.find('=').ok_or("label without =")?;
            let key = &body[..eq];
            if !valid_name(key) {
                return Err(format!("bad label name {key:?}"));
            }
            let mut chars = body[eq + 1..]
                .strip_prefix('"')
                .ok_or("unquoted label")?
                .chars();
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")? {
                    '"' => break,
                    '\\' => match chars.next().ok_or("dangling escape")? {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        c => return Err(format!("bad escape \\{c}")),
                    },
                    c => value.push(c),
                }
            }
            labels.insert(key.to_string(), value);
            body = chars.as_str();
            body = body.strip_prefix(',').unwrap_or(body);
        }
    } else {
        rest
    };
    let value = rest.strip_prefix(' ').ok_or("no space before value")?;
    let value = value.split(' ').next().unwrap_or(value); // an optional timestamp may follow
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|_| format!("bad value {v:?}"))?,
    };
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The value of the one sample called `name` with exactly `labels`.
/// The value of the one sample of `name` whose labels include `labels` (`None` when there is
/// no such sample, or more than one).
pub(crate) fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .collect();
    match found.as_slice() {
        [v] => Some(*v),
        _ => None,
    }
}

#[test]
fn metrics_parse_as_prometheus_text() {
    let text = render_metrics(&sample_snapshot(), NOW);
    let samples = parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(samples.len() > 20, "{text}");
    // Every family has a HELP line too.
    let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
    let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
    assert_eq!(helps, types);
    // Every metric is ours, or one of the standard process metrics.
    assert!(samples
        .iter()
        .all(|s| s.name.starts_with("tunnelgate_") || s.name.starts_with("process_")));
}

#[test]
fn metrics_carry_the_snapshot_values() {
    let text = render_metrics(&sample_snapshot(), NOW);
    let s = parse_prometheus(&text).expect("parses");
    // A named peer carries its name; an unnamed one an empty (absent) peer_name.
    assert_eq!(
        value(
            &s,
            "tunnelgate_peer_rx_bytes_total",
            &[("peer", PEER_A), ("peer_name", "office")]
        ),
        Some(123_456.0)
    );
    assert_eq!(
        value(
            &s,
            "tunnelgate_peer_rx_bytes_total",
            &[("peer", PEER_B), ("peer_name", "")]
        ),
        Some(0.0)
    );
    let a = [("peer", PEER_A)];
    let b = [("peer", PEER_B)];
    let v = |name: &str, labels: &[(&str, &str)]| {
        value(&s, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing in\n{text}"))
    };
    assert_eq!(v("tunnelgate_build_info", &[("version", "0.1.0")]), 1.0);
    assert_eq!(v("tunnelgate_ready", &[]), 1.0);
    assert_eq!(v("tunnelgate_peers", &[]), 2.0);
    assert_eq!(v("tunnelgate_peer_rx_bytes_total", &a), 123_456.0);
    assert_eq!(v("tunnelgate_peer_tx_bytes_total", &a), 789.0);
    assert_eq!(v("tunnelgate_peer_rx_packets_total", &a), 100.0);
    assert_eq!(v("tunnelgate_peer_tx_packets_total", &a), 7.0);
    assert_eq!(v("tunnelgate_peer_rx_bytes_total", &b), 0.0);
    assert_eq!(v("tunnelgate_peer_handshake_attempts_total", &a), 3.0);
    assert_eq!(v("tunnelgate_peer_handshake_failures_total", &a), 1.0);
    let outcome = |o: &'static str| [a[0], ("outcome", o)];
    assert_eq!(
        v("tunnelgate_peer_takeovers_total", &outcome("started")),
        2.0
    );
    assert_eq!(
        v("tunnelgate_peer_takeovers_total", &outcome("completed")),
        1.0
    );
    assert_eq!(
        v("tunnelgate_peer_takeovers_total", &outcome("failed")),
        1.0
    );
    assert_eq!(v("tunnelgate_peer_takeover_seconds_total", &a), 0.25);
    assert_eq!(v("tunnelgate_peer_last_takeover_seconds", &a), 0.25);
    assert_eq!(v("tunnelgate_peer_last_handshake_age_seconds", &a), 65.0);
    assert_eq!(
        v("tunnelgate_peer_last_handshake_timestamp_seconds", &a),
        (NOW - 65) as f64
    );
    // A peer that never completed a handshake has no age rather than a made-up one, and its
    // handshake time is 0 from the start (a dashboard shows it as "never").
    assert_eq!(
        value(&s, "tunnelgate_peer_last_handshake_age_seconds", &b),
        None
    );
    assert_eq!(
        v("tunnelgate_peer_last_handshake_timestamp_seconds", &b),
        0.0
    );
    assert_eq!(
        v("tunnelgate_packets_dropped_total", &[("reason", "no_peer")]),
        4.0
    );
    assert_eq!(
        v("tunnelgate_packets_dropped_total", &[("reason", "invalid")]),
        2.0
    );
    // Every reason is present, zero or not, so rate() works from the first scrape.
    for (reason, _) in DropStats::default().by_reason() {
        v("tunnelgate_packets_dropped_total", &[("reason", reason)]);
    }
    let nft = [("backend", "nftables")];
    assert_eq!(v("tunnelgate_rule_applies_total", &nft), 5.0);
    assert_eq!(v("tunnelgate_rule_apply_failures_total", &nft), 1.0);
    assert_eq!(
        v("tunnelgate_rule_last_apply_duration_seconds", &nft),
        0.0125
    );
    assert_eq!(v("tunnelgate_rules_needed", &nft), 1.0);
    assert_eq!(v("tunnelgate_rules_applied", &nft), 1.0);
    assert_eq!(v("tunnelgate_rules_installed", &nft), 12.0);
    let db = [("name", "db.example.internal")];
    assert_eq!(v("tunnelgate_dns_resolutions_total", &db), 9.0);
    assert_eq!(v("tunnelgate_dns_resolution_failures_total", &db), 2.0);
    assert_eq!(v("tunnelgate_dns_addresses", &db), 2.0);
    assert_eq!(
        v("tunnelgate_dns_last_resolved_timestamp_seconds", &db),
        (NOW - 30) as f64
    );
    assert_eq!(
        v("tunnelgate_dns_addresses", &[("name", "gone.example")]),
        0.0
    );
    for (service, unresolved) in [("apps/db", 0.0), ("apps/gone", 1.0), ("apps/web", 0.0)] {
        assert_eq!(
            v(
                "tunnelgate_service_unresolved_names",
                &[("service", service)]
            ),
            unresolved,
            "{service}"
        );
    }
    assert_eq!(v("tunnelgate_config_reloads_total", &[]), 3.0);
    assert_eq!(v("tunnelgate_config_reload_failures_total", &[]), 1.0);
    assert_eq!(
        v(
            "tunnelgate_packet_reader_priority",
            &[("access", "capability")]
        ),
        1.0
    );
    assert_eq!(v("tunnelgate_packet_readers", &[]), 4.0);
    assert_eq!(v("tunnelgate_packet_readers_realtime", &[]), 3.0);
    assert_eq!(
        v("tunnelgate_packet_reader_realtime_cpu_seconds_total", &[]),
        2.5
    );
    assert_eq!(
        v(
            "tunnelgate_packet_reader_unauthenticated_realtime_cpu_seconds_total",
            &[]
        ),
        0.5
    );
    for (reason, n) in [
        ("budget", 7.0),
        ("unauthenticated", 3.0),
        ("process_budget", 0.0),
        ("ping_pong", 2.0),
    ] {
        assert_eq!(
            v(
                "tunnelgate_packet_reader_step_downs_total",
                &[("reason", reason)]
            ),
            n
        );
    }
}

#[test]
fn readers_that_cannot_have_real_time_show_priority_zero_and_why() {
    let mut snap = sample_snapshot();
    snap.tuning.readers.priority = None;
    snap.tuning.readers.access = "refused".into();
    snap.tuning.readers.why = "real-time scheduling was refused (Operation not permitted)".into();
    let text = render_metrics(&snap, NOW);
    let s = parse_prometheus(&text).expect("parses");
    assert_eq!(
        value(
            &s,
            "tunnelgate_packet_reader_priority",
            &[("access", "refused")]
        ),
        Some(0.0)
    );
    let status = render_status_text(&snap, NOW);
    assert!(
        status.lines().any(|l| l
            == "  packet readers: normal priority: real-time scheduling was refused (Operation not permitted)"),
        "{status}"
    );
    assert!(
        !status.contains("budget:"),
        "no budget for readers that never go up:\n{status}"
    );
}

#[test]
fn metrics_never_show_endpoints() {
    let text = render_metrics(&sample_snapshot(), NOW);
    for leak in [
        ENDPOINT_A,
        "198.51.100.7",
        ENDPOINT_B,
        "2001:db8::7",
        "51821",
    ] {
        assert!(!text.contains(leak), "{leak} in\n{text}");
    }
    // Nor rule text, nor error messages (those are for status and logs).
    assert!(!text.contains("table inet"));
    assert!(!text.contains("Could not process"));
}

#[test]
fn metrics_of_an_empty_snapshot_parse() {
    let snap = Snapshot::default();
    let text = render_metrics(&snap, 0);
    let s = parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(value(&s, "tunnelgate_ready", &[]), Some(0.0));
    assert_eq!(
        value(&s, "tunnelgate_rule_applies_total", &[("backend", "none")]),
        Some(0.0)
    );
}

#[test]
fn metrics_escape_label_values() {
    let mut snap = sample_snapshot();
    snap.version = "1.0 \"quoted\" \\ back\nslash".into();
    let text = render_metrics(&snap, NOW);
    let s = parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        value(
            &s,
            "tunnelgate_build_info",
            &[("version", "1.0 \"quoted\" \\ back\nslash")]
        ),
        Some(1.0)
    );
}

#[test]
fn handshake_in_the_future_is_age_zero() {
    let mut snap = sample_snapshot();
    snap.peers[0].latest_handshake_unix = Some(NOW + 100);
    let s = parse_prometheus(&render_metrics(&snap, NOW)).expect("parses");
    assert_eq!(
        value(
            &s,
            "tunnelgate_peer_last_handshake_age_seconds",
            &[("peer", PEER_A)]
        ),
        Some(0.0)
    );
}

#[test]
fn the_checker_rejects_bad_text() {
    assert!(parse_prometheus("# TYPE a gauge\na 1\n").is_ok());
    assert!(parse_prometheus("# TYPE a counter\na_total{x=\"1\"} 2\n").is_ok());
    assert!(parse_prometheus("a 1\n").is_err(), "no TYPE");
    assert!(
        parse_prometheus("# TYPE a gauge\na one\n").is_err(),
        "bad value"
    );
    assert!(
        parse_prometheus("# TYPE a gauge\na{x=1} 1\n").is_err(),
        "unquoted"
    );
    assert!(
        parse_prometheus("# TYPE a info\na 1\n").is_err(),
        "info type"
    );
    assert!(
        parse_prometheus("# TYPE a counter\na 1\n").is_err(),
        "counter w/o _total"
    );
}

#[test]
fn status_text_reads_like_wg_show() {
    let text = render_status_text(&sample_snapshot(), NOW);
    let expected_lines = [
        "interface: tg0",
        "  public key: HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw=",
        "  listening port: 51820",
        "  addresses: 100.64.0.1/32, fd7a:115c:a1e0::1/128",
        "  state: ready",
        &format!("peer: {PEER_A} (office)"),
        &format!("  endpoint: {ENDPOINT_A}"),
        "  allowed ips: 100.64.0.2/32, 10.0.0.0/24",
        "  latest handshake: 1 minute, 5 seconds ago",
        "  transfer: 120.56 KiB received, 789 B sent",
        "  takeovers: 2 started, 1 completed, 1 failed, latest in 250 ms",
        "  persistent keepalive: every 25 seconds",
        &format!("peer: {PEER_B}"),
        "  allowed ips: (none)",
        "  latest handshake: (none)",
        "rules: nftables",
        "  installed: 12 rules",
        "  applies: 5 (1 failed), last took 0.013 s",
        "  last error: nft: Could not process rule: No such file or directory",
        "dropped packets: no_peer 4, invalid 2",
        "names:",
        "  db.example.internal -> 10.1.2.3, 10.1.2.4",
        "    resolved: 30 seconds ago (9 resolutions, 2 failed)",
        "    services: apps/db (readiness does not wait for it)",
        "  gone.example -> (none)",
        "    resolved: never (4 resolutions, 4 failed)",
        "    last error: no record found for Query { name: gone.example. }",
        "services:",
        "  apps/db: names resolved",
        "  apps/gone: unresolved gone.example (its rules wait for it)",
        "  apps/web: no names to resolve",
        "tuning:",
        "  packet readers: real-time (SCHED_FIFO 1), by CAP_SYS_NICE, held by the packet readers alone",
        "    at real-time now: 3 of 4",
        "    budget: 90 % of the time each (25 % for unauthenticated work), 1.80 CPU for all, bursts of 10 ms",
        "    spent at real-time: 2.500 s of CPU (0.500 s unauthenticated); step-downs: budget 7, ping_pong 2, process_budget 0, unauthenticated 3",
        "  receive queue AQM: CoDel, target 1000 us, interval 10000 us",
        "  workers: 2 (2 CPUs, a CPU quota of 1.50)",
        "  relay: 1 partner thread per packet reader",
        "  queues: socket buffers 7340032 bytes (GRO on, GSO off), TUN txqueuelen 4096",
    ];
    let lines: BTreeSet<&str> = text.lines().collect();
    for want in expected_lines {
        assert!(lines.contains(want), "missing {want:?} in\n{text}");
    }
    // The interface comes first, peers in order, then rules, then names.
    let pos = |s: &str| text.find(s).unwrap_or_else(|| panic!("{s} in {text}"));
    assert!(pos("interface:") < pos(PEER_A));
    assert!(pos(PEER_A) < pos(PEER_B));
    assert!(pos(PEER_B) < pos("rules:"));
    assert!(pos("rules:") < pos("names:"));
    assert!(pos("names:") < pos("services:"));
    assert!(pos("services:") < pos("tuning:"));
    // A name the replica itself waits for says nothing about readiness.
    let mut own = sample_snapshot();
    own.names[0].per_service = false;
    let text = render_status_text(&own, NOW);
    assert!(text.lines().any(|l| l == "    services: apps/db"), "{text}");
}

#[test]
fn status_text_shows_why_not_ready() {
    let mut snap = sample_snapshot();
    snap.ready = false;
    snap.not_ready_reason = Some("dns: db.example.internal not resolved yet".into());
    snap.rules.applied = false;
    snap.rules.backend.clear();
    let text = render_status_text(&snap, NOW);
    assert!(
        text.contains("  state: not ready: dns: db.example.internal not resolved yet"),
        "{text}"
    );
    assert!(text.contains("rules: (none chosen)"), "{text}");
    assert!(text.contains("(not applied)"), "{text}");
}

/// Issue 23: a plain tunnel (or one reloaded to a config without rules) is not "0 rules, not
/// applied" with a backend "(none chosen)": it needs none, and metrics say so without a
/// rules_applied 0 that an alert would take for a failure.
#[test]
fn a_tunnel_that_needs_no_rules_says_so_in_status_and_metrics() {
    let mut snap = sample_snapshot();
    snap.rules = RulesStatus {
        needed: false,
        applied: true,
        ..RulesStatus::default()
    };
    let text = render_status_text(&snap, NOW);
    assert!(text.contains("\nrules: none needed\n"), "{text}");
    for wrong in ["(none chosen)", "not applied", "installed:", "last took"] {
        assert!(!text.contains(wrong), "{wrong:?} in\n{text}");
    }
    let s = parse_prometheus(&render_metrics(&snap, NOW)).expect("parses");
    let none = [("backend", "none")];
    assert_eq!(value(&s, "tunnelgate_rules_needed", &none), Some(0.0));
    assert_eq!(value(&s, "tunnelgate_rules_applied", &none), Some(1.0));
    assert_eq!(value(&s, "tunnelgate_rules_installed", &none), Some(0.0));

    // The old configuration's rules could not be removed yet: that is shown, not hidden.
    snap.rules.backend = "nftables".into();
    snap.rules.applied = false;
    snap.rules.rule_count = 31;
    snap.rules.last_error = Some("nftables: exit status 1".into());
    let text = render_status_text(&snap, NOW);
    assert!(
        text.contains("  still installed: 31 rules (being removed)"),
        "{text}"
    );
    assert!(
        text.contains("  last error: nftables: exit status 1"),
        "{text}"
    );
    let s = parse_prometheus(&render_metrics(&snap, NOW)).expect("parses");
    let nft = [("backend", "nftables")];
    assert_eq!(value(&s, "tunnelgate_rules_applied", &nft), Some(0.0));
    assert_eq!(value(&s, "tunnelgate_rules_installed", &nft), Some(31.0));
}

#[test]
fn status_json_of_a_daemon_that_does_not_send_needed_reads_as_needing_rules() {
    let old = r#"{"rules":{"backend":"nftables","applied":true,"rule_count":3}}"#;
    let snap: Snapshot = serde_json::from_str(old).expect("parses");
    assert!(snap.rules.needed);
    assert!(render_status_text(&snap, NOW).contains("  installed: 3 rules\n"));
}

#[test]
fn human_units() {
    assert_eq!(bytes(0), "0 B");
    assert_eq!(bytes(1023), "1023 B");
    assert_eq!(bytes(1024), "1.00 KiB");
    assert_eq!(bytes(5 * 1024 * 1024 + 512 * 1024), "5.50 MiB");
    assert_eq!(bytes(u64::MAX), "16384.00 PiB");
    assert_eq!(duration(0), "0 seconds");
    assert_eq!(duration(1), "1 second");
    assert_eq!(duration(3600 + 120 + 3), "1 hour, 2 minutes, 3 seconds");
    assert_eq!(duration(86_400 * 366), "1 year, 1 day");
    assert_eq!(ago(0), "just now");
    assert_eq!(ago(5), "5 seconds ago");
}

#[test]
fn snapshot_json_round_trips_and_holds_no_secret_fields() {
    let snap = sample_snapshot();
    let json = serde_json::to_string(&snap).expect("serializes");
    let back: Snapshot = serde_json::from_str(&json).expect("deserializes");
    assert_eq!(back, snap);
    let lower = json.to_lowercase();
    for word in ["private", "preshared", "secret"] {
        assert!(!lower.contains(word), "{word} in {json}");
    }
    // Tolerant of fields a neighbouring version adds or lacks.
    let partial: Snapshot =
        serde_json::from_str(r#"{"version":"9","ready":true,"future_field":1}"#).expect("parses");
    assert_eq!(partial.version, "9");
    assert!(partial.ready);
}

#[test]
fn every_series_has_the_interface_label_and_process_metrics_are_there() {
    let text = render_metrics(&sample_snapshot(), NOW);
    let s = parse_prometheus(&text).expect("parses");
    for sample in &s {
        assert_eq!(
            sample.labels.get("interface").map(String::as_str),
            Some("tg0"),
            "{} has no interface label",
            sample.name
        );
    }
    for (name, want) in [
        ("process_resident_memory_bytes", 12_582_912.0),
        ("process_virtual_memory_bytes", 104_857_600.0),
        ("process_cpu_seconds_total", 3.5),
        ("process_open_fds", 17.0),
        ("process_max_fds", 1024.0),
        ("process_start_time_seconds", 1_763_900_000.0),
    ] {
        assert_eq!(
            value(&s, name, &[("interface", "tg0")]),
            Some(want),
            "{name}\n{text}"
        );
    }
    // Every other family is ours.
    assert!(s
        .iter()
        .all(|x| x.name.starts_with("tunnelgate_") || x.name.starts_with("process_")));
}

#[test]
fn sample_order_does_not_depend_on_the_order_of_the_snapshot() {
    let snap = sample_snapshot();
    let mut reversed = snap.clone();
    reversed.peers.reverse();
    let first = render_metrics(&snap, NOW);
    for _ in 0..5 {
        assert_eq!(render_metrics(&reversed, NOW), first);
    }
    // Within a family, samples are sorted (drop reasons included).
    let drops: Vec<&str> = first
        .lines()
        .filter(|l| l.starts_with("tunnelgate_packets_dropped_total{"))
        .collect();
    let mut sorted = drops.clone();
    sorted.sort_unstable();
    assert!(drops.len() > 1);
    assert_eq!(drops, sorted);
}

/// The classic (0.0.4) body: a parser that types each sample by its exact name finds a
/// `# TYPE` for every one, counters included, and no OpenMetrics-only line.
#[test]
fn classic_text_types_every_sample_by_its_own_name() {
    let om = render_metrics(&sample_snapshot(), NOW);
    assert!(om.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    let classic = crate::telemetry::classic_text(&om);
    assert!(!classic.contains("# EOF") && !classic.contains("# UNIT"));
    let mut types: BTreeMap<&str, &str> = BTreeMap::new();
    for line in classic.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect("TYPE line");
            types.insert(name, ty);
        } else if !line.starts_with('#') {
            let name = &line[..line.find(['{', ' ']).expect("sample")];
            let ty = types.get(name).copied();
            assert!(
                ty.is_some(),
                "{name} has no # TYPE of its own name in\n{classic}"
            );
            if name.ends_with("_total") {
                assert_eq!(ty, Some("counter"), "{name}");
            }
        }
    }
    assert_eq!(
        types.get("tunnelgate_peer_rx_bytes_total"),
        Some(&"counter")
    );
    assert!(classic.contains("# HELP tunnelgate_peer_rx_bytes_total "));
    // The same samples either way.
    let a = parse_prometheus(&om).expect("OpenMetrics body");
    let samples = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#'))
            .map(String::from)
            .collect()
    };
    assert_eq!(samples(&om), samples(&classic));
    assert!(a.len() > 20);
}

/// Status says why the relay is off: turned off, one worker, or one CPU.
#[test]
fn the_relay_line_says_why_it_is_off() {
    let line = |relay_partners: u32, relay_asked: Option<u32>, workers: u32| {
        let t = tuning::TuningStatus {
            relay_partners,
            relay_asked,
            workers,
            ..sample_tuning()
        };
        let mut out = String::new();
        tuning::write_tuning(&mut out, &t).expect("written");
        out.lines()
            .find(|l| l.starts_with("  relay: "))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(line(0, None, 2), "  relay: off (one CPU)");
    assert_eq!(
        line(0, Some(0), 8),
        "  relay: off (TUNNELGATE_RELAY_PARTNERS=0)"
    );
    assert_eq!(line(0, None, 1), "  relay: off (one worker)");
    assert_eq!(line(0, Some(3), 1), "  relay: off (one worker)");
    assert_eq!(line(0, Some(3), 2), "  relay: off (one CPU)");
    assert_eq!(
        line(3, None, 8),
        "  relay: 3 partner threads per packet reader"
    );
}

/// A relay lowered to fit is shown lowered, with the reason, under the relay line; the
/// variables set are listed.
#[test]
fn a_lowered_relay_and_the_variables_set_are_shown() {
    let t = tuning::TuningStatus {
        relay_partners: 1,
        relay_asked: Some(3),
        relay_lowered: Some(
            "TUNNELGATE_RELAY_PARTNERS=3 lowered to 1: one partner per other CPU, 2 CPUs".into(),
        ),
        environment: vec!["TUNNELGATE_RELAY_PARTNERS=\"3\"".into()],
        ..sample_tuning()
    };
    let mut out = String::new();
    tuning::write_tuning(&mut out, &t).expect("written");
    assert!(
        out.contains("  relay: 1 partner thread per packet reader\n    TUNNELGATE_RELAY_PARTNERS=3 lowered to 1: one partner per other CPU, 2 CPUs\n"),
        "{out}"
    );
    assert!(
        out.contains("  environment: TUNNELGATE_RELAY_PARTNERS=\"3\"\n"),
        "{out}"
    );
    let running = tuning::TuningStatus {
        relay_jobs_sealed: Some(7),
        relay_jobs_opened: Some(9),
        ..sample_tuning()
    };
    let mut jobs = String::new();
    tuning::write_tuning(&mut jobs, &running).expect("written");
    assert!(
        jobs.contains("    partners' jobs: 7 reads sealed, 9 receive batches opened\n"),
        "{jobs}"
    );
    let mut none = String::new();
    tuning::write_tuning(&mut none, &sample_tuning()).expect("written");
    assert!(!none.contains("partners' jobs"), "{none}");
    assert!(
        none.contains("  environment: no TUNNELGATE_* variable set"),
        "{none}"
    );
}

/// At many peers `/metrics` lists the busiest `health.metrics_peers` and counts every peer in
/// the totals: 1,000 peers listed (the default) is a body of about 1.5 MB, under the 4 MiB
/// bound, whatever the number of peers configured.
#[test]
fn many_peers_give_totals_and_a_bounded_body() {
    let base = sample_snapshot().peers[0].clone();
    let listed: Vec<PeerStatus> = (0..1000u32)
        .map(|i| PeerStatus {
            public_key: crate::config::PublicKey([(i % 251) as u8; 32]).to_base64()[..40]
                .to_string()
                + &format!("{i:04}"),
            rx_bytes: u64::from(i),
            ..base.clone()
        })
        .collect();
    let mut snap = sample_snapshot();
    snap.peers = listed;
    snap.peer_totals = Some(PeerTotals {
        peers: 100_000,
        handshaked_recently: 7,
        rx_bytes: 123_456,
        ..PeerTotals::default()
    });
    let body = render_metrics(&snap, NOW);
    let v = |name: &str| {
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert_eq!(v("tunnelgate_peers"), 100_000.0);
    assert_eq!(v("tunnelgate_peer_series"), 1000.0);
    assert_eq!(v("tunnelgate_peers_handshaked"), 7.0);
    assert_eq!(v("tunnelgate_peers_rx_bytes_total"), 123_456.0);
    let per_peer = body
        .lines()
        .filter(|l| l.starts_with("tunnelgate_peer_rx_bytes_total{"))
        .count();
    assert_eq!(per_peer, 1000);
    assert!(
        body.len() < 2 << 20,
        "{} bytes for 1,000 peers listed: over 2 MiB",
        body.len()
    );
}

#[test]
fn the_busiest_are_chosen_most_bytes_first_then_by_key() {
    use crate::config::PublicKey;
    let k = |b: u8| PublicKey([b; 32]);
    let peers = vec![(5, k(1)), (9, k(2)), (5, k(0)), (0, k(3)), (9, k(4))];
    assert_eq!(
        busiest(peers.clone(), 3),
        [k(2), k(4), k(0)].into_iter().collect()
    );
    assert_eq!(busiest(peers.clone(), 0).len(), 0);
    assert_eq!(busiest(peers, 10).len(), 5);
}
