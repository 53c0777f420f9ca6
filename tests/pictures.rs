//! The pictures: `contrib/grafana/tunnelgate.json` only queries metrics a real daemon's
//! `/metrics` has (with the labels it groups by), draws one line per instance (the replicas of a
//! proxy group all name their interface alike), shows answered handshakes and unresolved names,
//! shows a peer that never connected as "never" (from a real scrape with such a peer), and has
//! no template input it does not use; and `benches/iperf/results/latest.svg` is the
//! chart `bench.py` draws from the committed `latest.json`.
//!
//! The dashboard test needs root (a daemon in a namespace):
//! `cargo test --all-features --test pictures -- --include-ignored --test-threads=1`.

mod common;

use common::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Every `expr` of every panel.
fn dashboard_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(repo("contrib/grafana/tunnelgate.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8, "{} panels", panels.len());
    panels
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(String::from))
        .collect()
}

/// Metric names in a PromQL expression (ours and the process ones).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let word_start = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let rest = &expr[i..];
        if word_start && (rest.starts_with("tunnelgate_") || rest.starts_with("process_")) {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            out.insert(rest[..end].to_string());
            i += end;
        } else {
            i += 1;
        }
    }
    out
}

/// Labels Prometheus adds to every series of a scrape target (not in `/metrics` itself).
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(repo("contrib/grafana/tunnelgate.json")).expect("dashboard");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// The labels of `by (...)` clauses.
fn grouped_labels(expr: &str) -> BTreeSet<String> {
    expr.match_indices("by (")
        .filter_map(|(i, m)| {
            let rest = &expr[i + m.len()..];
            rest.find(')').map(|end| rest[..end].to_string())
        })
        .flat_map(|l| {
            l.split(',')
                .map(|s| s.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_query_readers_find_names_and_labels() {
    let e = "sum by (interface, reason) (rate(tunnelgate_packets_dropped_total{x=\"1\"}[5m])) + process_open_fds";
    assert_eq!(
        metric_names(e),
        BTreeSet::from([
            "tunnelgate_packets_dropped_total".to_string(),
            "process_open_fds".to_string()
        ])
    );
    assert_eq!(
        grouped_labels(e),
        BTreeSet::from(["interface".to_string(), "reason".to_string()])
    );
}

#[test]
fn references_finds_grafana_variables() {
    assert!(references("x{a=~\"$instance\"}", "instance"));
    assert!(references("{\"uid\":\"${datasource}\"}", "datasource"));
    assert!(!references("$instances", "instance"));
    assert!(!references("no variable", "instance"));
}

#[test]
fn the_dashboard_shows_each_peers_latest_handshake_age() {
    let text = std::fs::read_to_string(repo("contrib/grafana/tunnelgate.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().expect("panels");
    let age = panels
        .iter()
        .find(|p| {
            p["targets"].as_array().is_some_and(|t| {
                t.iter().any(|t| {
                    t["expr"]
                        .as_str()
                        .is_some_and(|e| e.contains("tunnelgate_peer_last_handshake_age_seconds"))
                })
            })
        })
        .expect("a panel queries tunnelgate_peer_last_handshake_age_seconds");
    let expr = age["targets"][0]["expr"].as_str().unwrap_or_default();
    let labels = grouped_labels(expr);
    assert!(
        labels.contains("peer") && labels.contains("interface"),
        "one line per peer of each interface: {expr}"
    );
    assert_eq!(age["fieldConfig"]["defaults"]["unit"], "s", "{age}");
    // Panel ids are unique and no two panels overlap on the grid.
    let ids: BTreeSet<u64> = panels.iter().filter_map(|p| p["id"].as_u64()).collect();
    assert_eq!(ids.len(), panels.len(), "unique panel ids");
    let cells = |p: &serde_json::Value| -> Vec<(u64, u64)> {
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap_or(0),
            g["y"].as_u64().unwrap_or(0),
            g["w"].as_u64().unwrap_or(0),
            g["h"].as_u64().unwrap_or(0),
        );
        assert!(x + w <= 24, "inside the 24-column grid: {p}");
        (x..x + w)
            .flat_map(|c| (y..y + h).map(move |r| (c, r)))
            .collect()
    };
    let mut taken = BTreeSet::new();
    for p in panels {
        for cell in cells(p) {
            assert!(taken.insert(cell), "{} overlaps another panel", p["title"]);
        }
    }
}

/// A proxy group's replicas all run `tg0`: a query that sums by `interface` alone merges them
/// into one line. Every aggregation keeps `instance`, every query selects on `$instance`, and
/// each legend names it.
#[test]
fn the_dashboard_draws_one_line_per_instance() {
    let dash = dashboard();
    for panel in dash["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            let aggregates = ["sum", "max", "min", "avg", "count"]
                .iter()
                .any(|f| expr.contains(&format!("{f} (")) || expr.contains(&format!("{f}(")));
            if aggregates || expr.contains(" by (") {
                assert!(
                    grouped_labels(expr).contains("instance"),
                    "{}: aggregates away the instance: {expr}",
                    panel["title"]
                );
            }
            assert!(
                expr.contains("instance=~\"$instance\""),
                "{}: {expr}",
                panel["title"]
            );
            assert!(
                t["legendFormat"]
                    .as_str()
                    .is_some_and(|l| l.contains("{{instance}}")),
                "{}: the legend names the instance: {t}",
                panel["title"]
            );
        }
    }
}

/// What a gateway does: it mostly answers handshakes (its peers initiate), and a Service whose
/// name does not resolve is not served while `/readyz` may be 200.
#[test]
fn the_dashboard_shows_answered_handshakes_and_unresolved_names() {
    let exprs = dashboard_exprs();
    for metric in [
        "tunnelgate_peer_handshakes_answered_total",
        "tunnelgate_peer_handshake_attempts_total",
        "tunnelgate_service_unresolved_names",
    ] {
        assert!(
            exprs.iter().any(|e| metric_names(e).contains(metric)),
            "no panel queries {metric}"
        );
    }
    let unresolved = exprs
        .iter()
        .find(|e| e.contains("tunnelgate_service_unresolved_names"))
        .expect("unresolved names panel");
    assert!(
        grouped_labels(unresolved).contains("service"),
        "{unresolved}"
    );
}

/// Whether `text` references the Grafana variable `name`: `$name` (not the start of a longer
/// name) or `${name}` / `${name:format}`.
fn references(text: &str, name: &str) -> bool {
    let plain = format!("${name}");
    text.match_indices(&plain).any(|(i, m)| {
        !text[i + m.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    }) || text.contains(&format!("${{{name}}}"))
        || text.contains(&format!("${{{name}:"))
}

/// Every template variable is used by some query or data source, and the dashboard asks for no
/// import input (`__inputs`) it never references: Grafana's import would prompt for it.
#[test]
fn the_dashboard_has_no_unused_template_inputs() {
    let dash = dashboard();
    let panels = serde_json::to_string(&dash["panels"]).expect("panels");
    let templating = dash["templating"]["list"].as_array().expect("templating");
    let others = |name: &str| -> String {
        let rest: Vec<&serde_json::Value> =
            templating.iter().filter(|v| v["name"] != name).collect();
        serde_json::to_string(&rest).expect("variables")
    };
    for var in templating {
        let name = var["name"].as_str().expect("variable name");
        let used = |text: &str| references(text, name);
        assert!(
            used(&panels) || used(&others(name)),
            "template variable {name} is not used"
        );
    }
    for input in dash["__inputs"].as_array().into_iter().flatten() {
        let name = input["name"].as_str().expect("input name");
        let whole = serde_json::to_string(&dash).expect("dashboard");
        assert!(
            whole.contains(&format!("${{{name}}}")),
            "import input {name} is never used"
        );
    }
}

#[test]
#[ignore = "needs root"]
fn every_metric_the_dashboard_queries_is_in_a_real_scrape() {
    let ns = Netns::new();
    // A wireguard-go peer in the same namespace (over loopback) that completes a handshake, so
    // the per-peer handshake families (absent until the first one) are in the scrape too.
    let wg = WgGo::start(&ns, 0, &["100.84.0.2/32"]);
    // And a peer that never connects (no endpoint, nobody has its key): the one an operator
    // most needs to see.
    let never = Keypair::generate();
    let mut cfg = TgConfig::new(0, &["100.84.0.1/32"])
        .peer(
            Peer::new(wg.public_key(), &["100.84.0.2/32"])
                .endpoint(&format!("127.0.0.1:{}", wg.listen_port()))
                .keepalive(1),
        )
        .peer(Peer::new(&never.public, &["100.84.0.3/32"]));
    // A DNS-named target, so the dns_* families exist (nothing answers: they count failures).
    // Labelled with a service, so the per-service unresolved-names gauge is there too.
    cfg.extra = "[[ingress]]\ntarget_fqdn = \"db.example.internal\"\nports = [\"8080\"]\n\
                 service = \"apps/txdb\"\n\n\
                 [dns]\nnameservers = [\"127.0.0.1:5399\"]\n"
        .to_string();
    let tg = Tunnelgate::spawn(&ns, cfg);
    wg.add_peer(&Peer::new(tg.public_key(), &["100.84.0.1/32"]));
    let mut text = String::new();
    let scraped = poll_until(Duration::from_secs(15), || {
        text = tg.metrics().unwrap_or_default();
        text.contains("tunnelgate_dns_resolution_failures_total{")
            && text.contains("tunnelgate_rule_applies_total{")
            && text.contains("tunnelgate_peer_last_handshake_age_seconds{")
            && text.contains("tunnelgate_service_unresolved_names{")
    });
    assert!(scraped, "no full scrape:\n{text}\n{}", tg.stderr());
    let samples: Vec<(String, String)> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let end = l.find(['{', ' '])?;
            let labels = l[end..].strip_prefix('{').and_then(|r| r.split_once('}'));
            Some((
                l[..end].to_string(),
                labels.map(|(x, _)| x.to_string()).unwrap_or_default(),
            ))
        })
        .collect();
    let exprs = dashboard_exprs();
    let mut checked = 0;
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "a query without a metric: {expr}");
        for name in names {
            let series: Vec<&String> = samples
                .iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, l)| l)
                .collect();
            assert!(
                !series.is_empty(),
                "{name} (in {expr}) is not in /metrics:\n{text}"
            );
            for label in grouped_labels(expr) {
                if TARGET_LABELS.contains(&label.as_str()) {
                    continue;
                }
                assert!(
                    series.iter().all(|l| l.contains(&format!("{label}=\""))),
                    "{name} has no label {label} (grouped by in {expr})"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "{checked} metric uses checked");

    // The never-connected peer is on the dashboard from the first scrape: the handshake time
    // panel has a series for it, 0, which the panel shows as "never"; the connected one's is
    // a real time.
    let stamp = |peer: &str| -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with("tunnelgate_peer_last_handshake_timestamp_seconds{"))
            .find(|l| l.contains(&format!("peer=\"{peer}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    assert_eq!(stamp(&never.public), Some(0.0), "{text}");
    assert!(stamp(wg.public_key()).is_some_and(|t| t > 1.0e9), "{text}");
    assert!(
        !text.lines().any(
            |l| l.starts_with("tunnelgate_peer_last_handshake_age_seconds{")
                && l.contains(&format!("peer=\"{}\"", never.public))
        ),
        "no made-up age for the peer that never connected:\n{text}"
    );
    let panel = never_panel(&dashboard());
    assert!(
        grouped_labels(panel["targets"][0]["expr"].as_str().unwrap_or_default()).contains("peer"),
        "{panel}"
    );
}

/// The panel that shows each peer's latest handshake time, mapping 0 to "never".
fn never_panel(dash: &serde_json::Value) -> serde_json::Value {
    let panel = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .find(|p| {
            p["targets"][0]["expr"]
                .as_str()
                .is_some_and(|e| e.contains("tunnelgate_peer_last_handshake_timestamp_seconds"))
        })
        .expect("a panel queries tunnelgate_peer_last_handshake_timestamp_seconds")
        .clone();
    let never = panel["fieldConfig"]["defaults"]["mappings"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|m| m["options"]["0"]["text"].as_str().map(str::to_string));
    assert_eq!(
        never.as_deref(),
        Some("never"),
        "0 is shown as never: {panel}"
    );
    panel
}

#[test]
fn the_dashboard_shows_a_peer_that_never_connected_as_never() {
    let panel = never_panel(&dashboard());
    let expr = panel["targets"][0]["expr"].as_str().unwrap_or_default();
    // Scaled to milliseconds for the "from now" unit: 0 stays 0, so "never" stays never.
    assert!(expr.ends_with(") * 1000"), "{expr}");
    assert_eq!(panel["fieldConfig"]["defaults"]["unit"], "dateTimeFromNow");
}

/// `bench.py --svg-from latest.json` draws the committed `latest.svg`: one group of bars per
/// setup that ran, with its median single-stream TCP figure.
#[test]
fn the_iperf_chart_is_drawn_from_the_committed_results() {
    let tmp = TempDir::new("svg");
    let json = tmp.path().join("latest.json");
    std::fs::copy(repo("benches/iperf/results/latest.json"), &json).expect("copy");
    let out = std::process::Command::new("python3")
        .arg(repo("benches/iperf/bench.py"))
        .arg("--svg-from")
        .arg(&json)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let drawn = std::fs::read_to_string(tmp.path().join("latest.svg")).expect("svg written");
    let committed =
        std::fs::read_to_string(repo("benches/iperf/results/latest.svg")).expect("latest.svg");
    assert_eq!(
        drawn, committed,
        "regenerate: python3 benches/iperf/bench.py --svg-from benches/iperf/results/latest.json"
    );
    assert!(drawn.starts_with("<svg ") && drawn.trim_end().ends_with("</svg>"));
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("json");
    for (name, setup) in results["setups"].as_object().expect("setups") {
        if setup["status"] == "ok" {
            assert!(
                drawn.contains(&format!(">{name}</text>")),
                "{name} in the chart"
            );
        }
    }
    assert!(
        drawn.contains("tunnelgate tcp1: "),
        "the tunnelgate single-stream bar"
    );
}
