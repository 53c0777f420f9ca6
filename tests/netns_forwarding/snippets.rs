//! Daemon observations (metrics, status) and the configuration snippets the tests combine.

use super::*;

/// The sum of every series of `name` in `/metrics` (0 when absent).
pub(crate) fn metric_now(tg: &Tunnelgate, name: &str) -> f64 {
    metric_sum(&scrape(tg), name)
}

pub(crate) fn scrape(tg: &Tunnelgate) -> String {
    tg.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}"))
}

/// `tunnelgate status --json` of the running daemon.
pub(crate) fn status_json(tg: &Tunnelgate) -> Value {
    let out = tunnelgate_cli(&["status", "--json", "--interface", tg.name()], None);
    assert!(out.success(), "tunnelgate status --json: {}", out.stderr);
    serde_json::from_str(&out.stdout).expect("status --json is JSON")
}

/// Waits until `/metrics` shows `name` (for our backend) at least `at_least`.
pub(crate) fn wait_metric(tg: &Tunnelgate, name: &str, at_least: f64, what: &str) {
    let mut last = 0.0;
    let ok = poll_until(Duration::from_secs(10), || {
        last = metric_now(tg, name);
        last >= at_least
    });
    assert!(
        ok,
        "{what}: {name} stayed at {last}, expected >= {at_least}"
    );
}

pub(crate) fn ports_toml(ports: &[&str]) -> String {
    if ports.is_empty() {
        String::new()
    } else {
        let q: Vec<String> = ports.iter().map(|p| format!("{p:?}")).collect();
        format!("ports = [{}]\n", q.join(", "))
    }
}

/// `[[ingress]]` to the IPv4 and the IPv6 backend.
pub(crate) fn ingress_toml(ports: &[&str]) -> String {
    let p = ports_toml(ports);
    format!(
        "[[ingress]]\ntarget = \"{BACKEND_V4}\"\n{p}\n[[ingress]]\ntarget = \"{BACKEND_V6}\"\n{p}\n"
    )
}

/// `[[egress]]` to the wireguard-go peer's IPv4 and IPv6 tunnel addresses.
pub(crate) fn egress_toml(ports: &[&str]) -> String {
    let p = ports_toml(ports);
    format!("[[egress]]\ntarget = \"{PEER_V4}\"\n{p}\n[[egress]]\ntarget = \"{PEER_V6}\"\n{p}\n")
}
