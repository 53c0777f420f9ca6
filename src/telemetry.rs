//! Telemetry: what the daemon reports about itself ([`Observe`], [`Snapshot`]) and the pure
//! renderings of it: Prometheus text for `/metrics` and the `wg show`-like `tunnelgate status`.
//!
//! The I/O lives in the submodules: [`http`] serves `/healthz`, `/readyz` and `/metrics`,
//! [`status`] serves and queries the local status socket, [`logging`] sets up tracing.
//!
//! Secrets: a [`Snapshot`] has no field that can hold a private or preshared key. Peer endpoints
//! are in it (the status socket is local and root-only, like `wg show`), but [`render_metrics`]
//! never emits them.

pub mod http;
pub mod process;
pub mod status;
pub mod tuning;

use std::fmt::Write as _;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::core::packet::{DropReason, DropStats};

/// What the daemon exposes to the health endpoint, metrics and status. Implemented by the daemon.
///
/// All methods are called on the tokio runtime for every request, so they must be cheap and
/// must not block (take a short lock and copy counters; never wait on I/O). Strings they return
/// are shown to whoever can reach the health endpoint: never put a key or a peer endpoint in them.
pub trait Observe: Send + Sync + 'static {
    /// Ok(()) while the process does its job; Err(short reason) when it should be restarted:
    /// a packet thread has stopped making progress ("packet thread tg-tun-rx stuck for 7.0
    /// s") or the data path failed for good. Answers `/healthz`.
    fn liveness(&self) -> Result<(), String>;
    /// Ok(()) when ready; Err(short plain-text reason) otherwise (e.g. "rules: apply failed:
    /// nft: ...", "dns: db.example.internal not resolved yet").
    fn readiness(&self) -> Result<(), String>;
    /// A point-in-time snapshot of everything /metrics and `tunnelgate status` show.
    fn snapshot(&self) -> Snapshot;
    /// What `/metrics` shows: the snapshot with only the peers that get series of their own
    /// (`health.metrics_peers`, the busiest) listed, and [`Snapshot::peer_totals`] over all.
    fn metrics_snapshot(&self) -> Snapshot {
        self.snapshot()
    }
}

/// Everything `/metrics` and `tunnelgate status` show, at one moment. Sent as JSON over the
/// status socket; unknown or missing fields are tolerated so a client and a daemon of
/// neighbouring versions still understand each other.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Snapshot {
    pub interface: InterfaceStatus,
    pub peers: Vec<PeerStatus>,
    /// Every configured peer added up (`peers` may list only some: `/metrics` lists the
    /// busiest `health.metrics_peers`). `None`: add up `peers`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_totals: Option<PeerTotals>,
    pub drops: DropStats,
    pub rules: RulesStatus,
    pub names: Vec<NameStatus>,
    /// Every `service` label of the forwarding rules, and which of its names do not resolve.
    pub services: Vec<ServiceStatus>,
    /// Configuration reloads applied (SIGHUP or a change of the file).
    pub reloads: u64,
    /// Reloads refused (invalid configuration) or failed to apply.
    pub reload_failures: u64,
    pub ready: bool,
    /// Why not ready (the `Err` of [`Observe::readiness`]); `None` when ready.
    pub not_ready_reason: Option<String>,
    /// The daemon's version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The daemon process's memory, CPU and file descriptors (`None`: unknown).
    pub process: Option<process::ProcessStats>,
    /// The daemon's network namespace as the kernel names it (`net:[4026531840]`, the link
    /// of `/proc/self/ns/net`), so `tunnelgate status` can show only the daemons of its own
    /// namespace: the socket folder is shared by all of them. `None`: unknown (an older daemon).
    pub netns_id: Option<String>,
    /// The tuning in force: the packet readers' priority and why, the AQM, the workers.
    pub tuning: tuning::TuningStatus,
    /// The group's endpoint exchange (`takeover.group_listen`); `None` without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_exchange: Option<GroupExchangeStatus>,
}

/// What the group's endpoint exchange did: datagrams taken from other replicas, endpoints they
/// told, datagrams sent, the replicas its name resolves to, and the datagrams refused by why
/// (`forged`: not sealed by a replica of this identity; `replayed`; `stale`; `malformed`;
/// `own`: this replica's own, back through the group's name; `over_rate`: past the bound of
/// datagrams opened per second, unopened; `unknown_replica`: a genuine hello from an address
/// the group's name does not give, not answered).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GroupExchangeStatus {
    pub replicas: u64,
    pub accepted: u64,
    pub endpoints_learned: u64,
    pub sent: u64,
    pub refused: BTreeMap<String, u64>,
}

impl Snapshot {
    /// Fills `ready` and `not_ready_reason` from an [`Observe::readiness`] answer.
    pub fn set_readiness(&mut self, readiness: Result<(), String>) {
        self.not_ready_reason = readiness.err();
        self.ready = self.not_ready_reason.is_none();
    }
}

/// Every configured peer's counters added up (and those of peers removed since the start, so
/// the totals only grow), and how many peers there are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PeerTotals {
    pub peers: u64,
    /// Peers whose latest handshake is at most [`RECENT_HANDSHAKE_SECS`] old.
    pub handshaked_recently: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub handshake_attempts: u64,
    pub handshakes_answered: u64,
    pub handshake_failures: u64,
    pub takeovers_started: u64,
    pub takeovers_completed: u64,
    pub takeovers_failed: u64,
    pub takeovers_no_endpoint: u64,
}

/// The `limit` busiest of `peers` (each with its bytes moved): the most bytes first, ties by
/// key, so two scrapes of idle peers choose the same ones.
pub fn busiest(
    mut peers: Vec<(u64, crate::config::PublicKey)>,
    limit: usize,
) -> std::collections::BTreeSet<crate::config::PublicKey> {
    let order = |a: &(u64, crate::config::PublicKey), b: &(u64, crate::config::PublicKey)| {
        b.0.cmp(&a.0).then(a.1.cmp(&b.1))
    };
    if peers.len() > limit {
        if limit == 0 {
            return Default::default();
        }
        peers.select_nth_unstable_by(limit - 1, order);
        peers.truncate(limit);
    }
    peers.into_iter().map(|(_, k)| k).collect()
}

/// A session lives at most this long without a new handshake (WireGuard's REJECT_AFTER_TIME):
/// a peer whose latest handshake is younger has, or just had, a working session.
pub const RECENT_HANDSHAKE_SECS: u64 = 180;

impl PeerTotals {
    /// `peers` added up (what a snapshot that lists every peer has).
    pub fn of(peers: &[PeerStatus], now_unix: u64) -> PeerTotals {
        let mut t = PeerTotals::default();
        for p in peers {
            t.add(p, now_unix);
        }
        t
    }

    /// Counts `p` in.
    pub fn add(&mut self, p: &PeerStatus, now_unix: u64) {
        self.count_peer(p.latest_handshake_unix, now_unix);
        self.add_counters(&crate::core::peer::PeerCounters {
            rx_bytes: p.rx_bytes,
            tx_bytes: p.tx_bytes,
            rx_packets: p.rx_packets,
            tx_packets: p.tx_packets,
            handshakes_initiated: p.handshake_attempts,
            handshakes_answered: p.handshakes_answered,
            handshake_failures: p.handshake_failures,
            takeovers_started: p.takeovers_started,
            takeovers_completed: p.takeovers_completed,
            takeovers_failed: p.takeovers_failed,
            takeovers_no_endpoint: p.takeovers_no_endpoint,
            ..Default::default()
        });
    }

    /// Counts one peer whose latest handshake was at `latest_handshake_unix`.
    pub fn count_peer(&mut self, latest_handshake_unix: Option<u64>, now_unix: u64) {
        self.peers += 1;
        let recent = latest_handshake_unix
            .is_some_and(|t| now_unix.saturating_sub(t) <= RECENT_HANDSHAKE_SECS);
        self.handshaked_recently += u64::from(recent);
    }

    /// Adds `c` (a peer's counters, or those of peers removed) to the sums.
    pub fn add_counters(&mut self, c: &crate::core::peer::PeerCounters) {
        let sums = [
            (&mut self.rx_bytes, c.rx_bytes),
            (&mut self.tx_bytes, c.tx_bytes),
            (&mut self.rx_packets, c.rx_packets),
            (&mut self.tx_packets, c.tx_packets),
            (&mut self.handshake_attempts, c.handshakes_initiated),
            (&mut self.handshakes_answered, c.handshakes_answered),
            (&mut self.handshake_failures, c.handshake_failures),
            (&mut self.takeovers_started, c.takeovers_started),
            (&mut self.takeovers_completed, c.takeovers_completed),
            (&mut self.takeovers_failed, c.takeovers_failed),
            (&mut self.takeovers_no_endpoint, c.takeovers_no_endpoint),
        ];
        for (sum, n) in sums {
            *sum = sum.saturating_add(n);
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct InterfaceStatus {
    pub name: String,
    /// Base64 X25519 public key.
    pub public_key: String,
    pub listen_port: u16,
    /// CIDR strings, e.g. `100.64.0.1/32`.
    pub addresses: Vec<String>,
    pub mtu: u16,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PeerStatus {
    /// Base64 X25519 public key.
    pub public_key: String,
    /// `peer[].name` from the configuration, if any.
    pub name: Option<String>,
    /// `ip:port` currently used (status only; never in metrics).
    pub endpoint: Option<String>,
    /// CIDR strings.
    pub allowed_ips: Vec<String>,
    /// Unix time (seconds) of the latest completed handshake.
    pub latest_handshake_unix: Option<u64>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    /// Handshakes this side initiated (first contact, rekeys, retries).
    pub handshake_attempts: u64,
    /// Handshakes the peer initiated and this side answered.
    pub handshakes_answered: u64,
    pub handshake_failures: u64,
    /// Takeovers: handshakes this side initiated to the source of data for a session it did
    /// not have (after a restart, or on another replica), those that completed, those that
    /// got no answer within REKEY_TIMEOUT.
    pub takeovers_started: u64,
    pub takeovers_completed: u64,
    pub takeovers_failed: u64,
    /// Takeovers asked for when no endpoint where the peer authenticated was known: none sent.
    #[serde(default)]
    pub takeovers_no_endpoint: u64,
    /// Milliseconds from initiation to handshake, summed over the completed takeovers.
    pub takeover_ms_total: u64,
    /// The same for the latest completed takeover.
    pub takeover_ms_last: Option<u64>,
    /// Seconds.
    pub persistent_keepalive: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RulesStatus {
    /// `nftables` or `iptables` (empty before one is chosen).
    pub backend: String,
    /// Whether the configuration asks for any rule. `false`: a plain tunnel, nothing to
    /// forward; status says "none needed", not "0 applied". A daemon too old to send it needed
    /// rules whenever it showed any, so it defaults to `true`.
    pub needed: bool,
    /// Whether the desired rules are installed right now (with none needed: whether none of
    /// ours is left installed).
    pub applied: bool,
    pub rule_count: usize,
    pub applies: u64,
    pub failures: u64,
    pub last_error: Option<String>,
    pub last_apply_seconds: f64,
    /// The installed rule text (nft script or iptables-restore input).
    pub text: String,
}

impl Default for RulesStatus {
    fn default() -> Self {
        RulesStatus {
            backend: String::new(),
            needed: true,
            applied: false,
            rule_count: 0,
            applies: 0,
            failures: 0,
            last_error: None,
            last_apply_seconds: 0.0,
            text: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NameStatus {
    /// A `target_fqdn`.
    pub name: String,
    /// The addresses it currently resolves to.
    pub addresses: Vec<String>,
    pub last_resolved_unix: Option<u64>,
    pub last_error: Option<String>,
    pub resolutions: u64,
    pub failures: u64,
    /// The `service` labels of the rules that use the name.
    pub services: Vec<String>,
    /// True when not resolving does not hold `/readyz` back (`health.readiness =
    /// "per-service"` and only labelled rules use it): it is those services' problem.
    pub per_service: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServiceStatus {
    /// A rule's `service` label (`NAMESPACE/NAME` when the Kubernetes sidecar wrote it).
    pub service: String,
    /// The `target_fqdn` names of its rules.
    pub names: Vec<String>,
    /// Those that have not resolved since they were configured: their rules are not
    /// installed, so the service is not served here.
    pub unresolved_names: Vec<String>,
}

/// Renders `snap` as Prometheus text (the OpenMetrics subset the classic `text/plain;
/// version=0.0.4` parser also accepts: only counters and gauges). `now_unix` is the current
/// Unix time, for "seconds since the last handshake". Never emits an endpoint or a key other
/// than peers' public keys.
///
/// Every series carries `interface="<name>"`, so several daemons on one host can be scraped
/// into one view; the samples of each family are sorted, so two scrapes list them in the same
/// order. The text is OpenMetrics (`_total` samples under `# TYPE x counter`, `# EOF`); use
/// [`classic_text`] for a scraper that does not ask for OpenMetrics.
pub fn render_metrics(snap: &Snapshot, now_unix: u64) -> String {
    let mut root = Registry::with_labels(std::iter::once((
        std::borrow::Cow::Borrowed("interface"),
        std::borrow::Cow::Owned(snap.interface.name.clone()),
    )));
    if let Some(p) = &snap.process {
        render_process_metrics(&mut root, p);
    }
    let reg = root.sub_registry_with_prefix("tunnelgate");

    let build = Family::<Labels, Gauge>::default();
    build
        .get_or_create(&vec![("version".to_string(), snap.version.clone())])
        .set(1);
    reg.register(
        "build_info",
        "Build information; the value is always 1",
        build,
    );

    let ready = Gauge::<i64>::default();
    ready.set(i64::from(snap.ready));
    reg.register(
        "ready",
        "1 when /readyz answers 200: tunnel up, rules applied, every name resolved (with health.readiness = per-service: every name not only a service's)",
        ready,
    );

    let totals =
        (snap.peer_totals.clone()).unwrap_or_else(|| PeerTotals::of(&snap.peers, now_unix));
    render_peer_totals(reg, &totals, snap.peers.len());
    render_peer_metrics(reg, &snap.peers, now_unix);

    let dropped = Family::<Labels, Counter>::default();
    for (reason, n) in snap.drops.by_reason() {
        dropped.get_or_create(&label("reason", reason)).inc_by(n);
    }
    reg.register("packets_dropped", "Packets dropped, by reason", dropped);
    let dropped_bytes = Family::<Labels, Counter>::default();
    for (reason, n) in snap.drops.received_bytes_by_reason() {
        dropped_bytes
            .get_or_create(&label("reason", reason))
            .inc_by(n);
    }
    reg.register(
        "received_bytes_dropped",
        "Bytes of received WireGuard datagrams dropped before they counted as a peer's rx bytes (unknown sender, failed authentication, AQM), by reason: with the peers' rx bytes, what arrived adds up",
        dropped_bytes,
    );

    render_rule_metrics(reg, &snap.rules);
    tuning::register_metrics(reg, &snap.tuning);
    render_name_metrics(reg, &snap.names);
    render_service_metrics(reg, &snap.services);

    if let Some(g) = &snap.group_exchange {
        render_group_metrics(reg, g);
    }

    let reloads = Counter::<u64>::default();
    reloads.inc_by(snap.reloads);
    reg.register("config_reloads", "Configuration reloads applied", reloads);
    let reload_failures = Counter::<u64>::default();
    reload_failures.inc_by(snap.reload_failures);
    reg.register(
        "config_reload_failures",
        "Configuration reloads refused or failed",
        reload_failures,
    );

    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &root);
    sort_samples(&out)
}

/// The standard `process_*` metrics (no prefix: dashboards and alerts expect these names).
fn render_process_metrics(reg: &mut Registry, p: &process::ProcessStats) {
    use std::sync::atomic::AtomicU64;
    let gauge = |v: f64| {
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(v);
        g
    };
    reg.register(
        "process_resident_memory_bytes",
        "Resident memory size in bytes",
        gauge(p.resident_memory_bytes as f64),
    );
    reg.register(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes",
        gauge(p.virtual_memory_bytes as f64),
    );
    let cpu = Counter::<f64, AtomicU64>::default();
    cpu.inc_by(p.cpu_seconds);
    reg.register(
        "process_cpu_seconds",
        "Total user and system CPU time spent in seconds",
        cpu,
    );
    reg.register(
        "process_open_fds",
        "Number of open file descriptors",
        gauge(p.open_fds as f64),
    );
    if p.max_fds > 0 {
        reg.register(
            "process_max_fds",
            "Maximum number of open file descriptors",
            gauge(p.max_fds as f64),
        );
    }
    reg.register(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds",
        gauge(p.start_time_seconds),
    );
}

/// `text` with the sample lines of each family sorted (comment lines stay where they are).
pub fn sort_samples(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run: Vec<&str> = Vec::new();
    let flush = |run: &mut Vec<&str>, out: &mut String| {
        run.sort_unstable();
        for l in run.drain(..) {
            out.push_str(l);
            out.push('\n');
        }
    };
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut run, &mut out);
            out.push_str(line);
            out.push('\n');
        } else {
            run.push(line);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// The classic Prometheus text format (`text/plain; version=0.0.4`) of [`render_metrics`]'s
/// OpenMetrics text: a counter's `# HELP`/`# TYPE` lines name its `_total` samples (the classic
/// parsers type a sample by its exact name), and the OpenMetrics-only `# EOF` and `# UNIT`
/// lines go.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 64);
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|kind| {
            let rest = line.strip_prefix(kind)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{kind}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(l.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

type Labels = Vec<(String, String)>;

fn label(key: &str, value: &str) -> Labels {
    vec![(key.to_string(), value.to_string())]
}

/// The series over every peer, whatever `health.metrics_peers` leaves out: a dashboard of a
/// concentrator's 100,000 peers is drawn from these.
fn render_peer_totals(reg: &mut Registry, t: &PeerTotals, listed: usize) {
    let gauge = |n: u64| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(n).unwrap_or(i64::MAX));
        g
    };
    let counter = |n: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(n);
        c
    };
    reg.register("peers", "Configured peers", gauge(t.peers));
    reg.register(
        "peer_series",
        "Peers with series of their own in this scrape (the busiest health.metrics_peers); the peers_* totals count every peer",
        gauge(listed as u64),
    );
    reg.register(
        "peers_handshaked",
        "Peers whose latest handshake is at most 180 s old (a session in use or usable)",
        gauge(t.handshaked_recently),
    );
    for (name, help, n) in [
        (
            "peers_rx_bytes",
            "Bytes received from every peer (removed peers' included): WireGuard datagrams",
            t.rx_bytes,
        ),
        (
            "peers_tx_bytes",
            "Bytes sent to every peer (removed peers' included): WireGuard datagrams",
            t.tx_bytes,
        ),
        (
            "peers_rx_packets",
            "Packets received from every peer (removed peers' included)",
            t.rx_packets,
        ),
        (
            "peers_tx_packets",
            "Packets sent to every peer (removed peers' included)",
            t.tx_packets,
        ),
        (
            "peers_handshake_attempts",
            "Handshakes initiated with any peer",
            t.handshake_attempts,
        ),
        (
            "peers_handshakes_answered",
            "Handshakes any peer initiated and this side answered",
            t.handshakes_answered,
        ),
        (
            "peers_handshake_failures",
            "Handshakes with any peer that failed or timed out",
            t.handshake_failures,
        ),
    ] {
        reg.register(name, help, counter(n));
    }
    let takeovers = Family::<Labels, Counter>::default();
    for (outcome, n) in [
        ("started", t.takeovers_started),
        ("completed", t.takeovers_completed),
        ("failed", t.takeovers_failed),
        ("no_endpoint", t.takeovers_no_endpoint),
    ] {
        takeovers
            .get_or_create(&label("outcome", outcome))
            .inc_by(n);
    }
    reg.register(
        "peers_takeovers",
        "Takeovers of any peer's session, by outcome: started, completed, failed, no_endpoint",
        takeovers,
    );
}

/// The series of each peer listed (all of them, or the busiest `health.metrics_peers`).
fn render_peer_metrics(reg: &mut Registry, peers: &[PeerStatus], now_unix: u64) {
    let rx_bytes = Family::<Labels, Counter>::default();
    let tx_bytes = Family::<Labels, Counter>::default();
    let rx_packets = Family::<Labels, Counter>::default();
    let tx_packets = Family::<Labels, Counter>::default();
    let attempts = Family::<Labels, Counter>::default();
    let answered = Family::<Labels, Counter>::default();
    let failures = Family::<Labels, Counter>::default();
    let takeovers = Family::<Vec<(String, String)>, Counter>::default();
    let takeover_time = Family::<Labels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
    let takeover_last = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let age = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let stamp = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for p in peers {
        // `peer_name` is "" (the same as absent to Prometheus) for a peer without a name.
        let l = vec![
            ("peer".to_string(), p.public_key.clone()),
            ("peer_name".to_string(), p.name.clone().unwrap_or_default()),
        ];
        rx_bytes.get_or_create(&l).inc_by(p.rx_bytes);
        tx_bytes.get_or_create(&l).inc_by(p.tx_bytes);
        rx_packets.get_or_create(&l).inc_by(p.rx_packets);
        tx_packets.get_or_create(&l).inc_by(p.tx_packets);
        attempts.get_or_create(&l).inc_by(p.handshake_attempts);
        answered.get_or_create(&l).inc_by(p.handshakes_answered);
        failures.get_or_create(&l).inc_by(p.handshake_failures);
        for (outcome, n) in [
            ("started", p.takeovers_started),
            ("completed", p.takeovers_completed),
            ("failed", p.takeovers_failed),
            ("no_endpoint", p.takeovers_no_endpoint),
        ] {
            let mut with = l.clone();
            with.push(("outcome".to_string(), outcome.to_string()));
            takeovers.get_or_create(&with).inc_by(n);
        }
        takeover_time
            .get_or_create(&l)
            .inc_by(p.takeover_ms_total as f64 / 1000.0);
        if let Some(ms) = p.takeover_ms_last {
            takeover_last.get_or_create(&l).set(ms as f64 / 1000.0);
        }
        // The time is there from the start, 0 until the first handshake (as `wg show dump`
        // says "never"), so a dashboard shows a peer that never connected; an age would be
        // made up, so there is none until then.
        stamp
            .get_or_create(&l)
            .set(p.latest_handshake_unix.unwrap_or(0) as f64);
        if let Some(t) = p.latest_handshake_unix {
            // A handshake "in the future" (clock stepped back) counts as just now.
            age.get_or_create(&l).set(now_unix.saturating_sub(t) as f64);
        }
    }
    reg.register(
        "peer_rx_bytes",
        "Bytes received from the peer: WireGuard datagrams, as `wg show` counts them",
        rx_bytes,
    );
    reg.register(
        "peer_tx_bytes",
        "Bytes sent to the peer: WireGuard datagrams, as `wg show` counts them",
        tx_bytes,
    );
    reg.register(
        "peer_rx_packets",
        "Packets received from the peer",
        rx_packets,
    );
    reg.register("peer_tx_packets", "Packets sent to the peer", tx_packets);
    reg.register(
        "peer_handshake_attempts",
        "Handshakes initiated with the peer",
        attempts,
    );
    reg.register(
        "peer_handshakes_answered",
        "Handshakes the peer initiated and this side answered",
        answered,
    );
    reg.register(
        "peer_handshake_failures",
        "Handshakes with the peer that failed or timed out",
        failures,
    );
    reg.register(
        "peer_takeovers",
        "Takeovers of the peer's session (a handshake this side initiated to the source of data \
         for a session it did not have), by outcome: started, completed, failed",
        takeovers,
    );
    reg.register(
        "peer_takeover_seconds",
        "Seconds from takeover initiation to handshake, summed over completed takeovers",
        takeover_time,
    );
    reg.register(
        "peer_last_takeover_seconds",
        "Seconds from initiation to handshake of the latest completed takeover (absent: none)",
        takeover_last,
    );
    reg.register(
        "peer_last_handshake_age_seconds",
        "Seconds since the latest completed handshake (absent: never)",
        age,
    );
    reg.register(
        "peer_last_handshake_timestamp_seconds",
        "Unix time of the latest completed handshake (0: never)",
        stamp,
    );
}

fn render_rule_metrics(reg: &mut Registry, rules: &RulesStatus) {
    let backend = if rules.backend.is_empty() {
        "none"
    } else {
        rules.backend.as_str()
    };
    let l = label("backend", backend);

    let applies = Family::<Labels, Counter>::default();
    applies.get_or_create(&l).inc_by(rules.applies);
    reg.register("rule_applies", "Rule set applies attempted", applies);

    let failures = Family::<Labels, Counter>::default();
    failures.get_or_create(&l).inc_by(rules.failures);
    reg.register(
        "rule_apply_failures",
        "Rule set applies that failed",
        failures,
    );

    let duration = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    duration.get_or_create(&l).set(rules.last_apply_seconds);
    reg.register(
        "rule_last_apply_duration_seconds",
        "How long the latest rule set apply took",
        duration,
    );

    let needed = Family::<Labels, Gauge>::default();
    needed.get_or_create(&l).set(i64::from(rules.needed));
    reg.register(
        "rules_needed",
        "1 when the configuration asks for firewall rules; 0 for a plain tunnel",
        needed,
    );

    let applied = Family::<Labels, Gauge>::default();
    applied.get_or_create(&l).set(i64::from(rules.applied));
    reg.register(
        "rules_applied",
        "1 when the desired rules are installed (with none needed: when none is left installed)",
        applied,
    );

    let count = Family::<Labels, Gauge>::default();
    count
        .get_or_create(&l)
        .set(i64::try_from(rules.rule_count).unwrap_or(i64::MAX));
    reg.register("rules_installed", "Rules installed", count);
}

fn render_name_metrics(reg: &mut Registry, names: &[NameStatus]) {
    let resolutions = Family::<Labels, Counter>::default();
    let failures = Family::<Labels, Counter>::default();
    let addresses = Family::<Labels, Gauge>::default();
    let stamp = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for n in names {
        let l = label("name", &n.name);
        resolutions.get_or_create(&l).inc_by(n.resolutions);
        failures.get_or_create(&l).inc_by(n.failures);
        addresses
            .get_or_create(&l)
            .set(i64::try_from(n.addresses.len()).unwrap_or(i64::MAX));
        if let Some(t) = n.last_resolved_unix {
            stamp.get_or_create(&l).set(t as f64);
        }
    }
    reg.register(
        "dns_resolutions",
        "Resolutions of a target name attempted",
        resolutions,
    );
    reg.register(
        "dns_resolution_failures",
        "Resolutions of a target name that failed",
        failures,
    );
    reg.register(
        "dns_addresses",
        "Addresses a target name currently resolves to",
        addresses,
    );
    reg.register(
        "dns_last_resolved_timestamp_seconds",
        "Unix time of the latest successful resolution (absent: never)",
        stamp,
    );
}

fn render_group_metrics(reg: &mut Registry, g: &GroupExchangeStatus) {
    let datagrams = Family::<Labels, Counter>::default();
    datagrams
        .get_or_create(&label("result", "accepted"))
        .inc_by(g.accepted);
    for (why, n) in &g.refused {
        datagrams.get_or_create(&label("result", why)).inc_by(*n);
    }
    reg.register(
        "group_exchange_received",
        "Datagrams the group's endpoint exchange received: accepted, or refused and why",
        datagrams,
    );
    let learned = Counter::<u64>::default();
    learned.inc_by(g.endpoints_learned);
    reg.register(
        "group_exchange_endpoints_learned",
        "Endpoints other replicas of this identity told, where its peers authenticated",
        learned,
    );
    let sent = Counter::<u64>::default();
    sent.inc_by(g.sent);
    reg.register(
        "group_exchange_sent",
        "Datagrams the group's endpoint exchange sent",
        sent,
    );
    let replicas = Gauge::<i64>::default();
    replicas.set(i64::try_from(g.replicas).unwrap_or(i64::MAX));
    reg.register(
        "group_exchange_replicas",
        "Addresses the group's replica name resolves to (this replica's own included)",
        replicas,
    );
}

/// One series per `service` label: how many of its names do not resolve (0: every rule of
/// it is installed). Alert on `> 0`: that Service is not served, while `/readyz` may be 200.
fn render_service_metrics(reg: &mut Registry, services: &[ServiceStatus]) {
    let unresolved = Family::<Labels, Gauge>::default();
    for s in services {
        unresolved
            .get_or_create(&label("service", &s.service))
            .set(i64::try_from(s.unresolved_names.len()).unwrap_or(i64::MAX));
    }
    reg.register(
        "service_unresolved_names",
        "Target names of a service's rules that have not resolved (its rules wait for them)",
        unresolved,
    );
}

/// Renders `snap` for people, like `wg show`: the interface, each peer, then the rules and the
/// resolved names. `now_unix` is the current Unix time, for "N seconds ago".
pub fn render_status_text(snap: &Snapshot, now_unix: u64) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; `let _` keeps clippy quiet about the Result.
    let _ = write_status(&mut out, snap, now_unix);
    out
}

fn write_status(out: &mut String, snap: &Snapshot, now: u64) -> std::fmt::Result {
    let i = &snap.interface;
    writeln!(out, "interface: {}", i.name)?;
    writeln!(out, "  public key: {}", i.public_key)?;
    writeln!(out, "  listening port: {}", i.listen_port)?;
    writeln!(out, "  addresses: {}", list_or_none(&i.addresses))?;
    writeln!(out, "  mtu: {}", i.mtu)?;
    match (&snap.ready, &snap.not_ready_reason) {
        (true, _) => writeln!(out, "  state: ready")?,
        (false, Some(r)) => writeln!(out, "  state: not ready: {r}")?,
        (false, None) => writeln!(out, "  state: not ready")?,
    }
    writeln!(
        out,
        "  reloads: {} ({} failed)",
        snap.reloads, snap.reload_failures
    )?;
    if let Some(g) = &snap.group_exchange {
        let refused: Vec<String> = g
            .refused
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(why, n)| format!("{n} {why}"))
            .collect();
        writeln!(
            out,
            "  group exchange: {} replicas, {} accepted ({} endpoints), {} sent, refused: {}",
            g.replicas,
            g.accepted,
            g.endpoints_learned,
            g.sent,
            if refused.is_empty() {
                "none".to_string()
            } else {
                refused.join(", ")
            }
        )?;
    }
    if !snap.version.is_empty() {
        writeln!(out, "  version: {}", snap.version)?;
    }

    for p in &snap.peers {
        writeln!(out)?;
        match &p.name {
            Some(name) => writeln!(out, "peer: {} ({name})", p.public_key)?,
            None => writeln!(out, "peer: {}", p.public_key)?,
        }
        if let Some(e) = &p.endpoint {
            writeln!(out, "  endpoint: {e}")?;
        }
        writeln!(out, "  allowed ips: {}", list_or_none(&p.allowed_ips))?;
        match p.latest_handshake_unix {
            Some(t) => writeln!(out, "  latest handshake: {}", ago(now.saturating_sub(t)))?,
            None => writeln!(out, "  latest handshake: (none)")?,
        }
        writeln!(
            out,
            "  transfer: {} received, {} sent",
            bytes(p.rx_bytes),
            bytes(p.tx_bytes)
        )?;
        writeln!(
            out,
            "  packets: {} received, {} sent",
            p.rx_packets, p.tx_packets
        )?;
        writeln!(
            out,
            "  handshakes: {} initiated, {} answered, {} failed",
            p.handshake_attempts, p.handshakes_answered, p.handshake_failures
        )?;
        if p.takeovers_started + p.takeovers_no_endpoint > 0 {
            let last = p
                .takeover_ms_last
                .map_or_else(String::new, |ms| format!(", latest in {ms} ms"));
            let unknown = match p.takeovers_no_endpoint {
                0 => String::new(),
                n => format!(", {n} without a known endpoint"),
            };
            writeln!(
                out,
                "  takeovers: {} started, {} completed, {} failed{unknown}{last}",
                p.takeovers_started, p.takeovers_completed, p.takeovers_failed
            )?;
        }
        if let Some(k) = p.persistent_keepalive.filter(|k| *k > 0) {
            writeln!(
                out,
                "  persistent keepalive: every {}",
                duration(u64::from(k))
            )?;
        }
    }

    writeln!(out)?;
    write_rules(out, &snap.rules)?;

    let dropped: Vec<String> = snap
        .drops
        .by_reason()
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(reason, n)| format!("{reason} {n}"))
        .collect();
    if !dropped.is_empty() {
        writeln!(out)?;
        writeln!(out, "dropped packets: {}", dropped.join(", "))?;
    }

    if !snap.names.is_empty() {
        writeln!(out)?;
        writeln!(out, "names:")?;
        for n in &snap.names {
            writeln!(out, "  {} -> {}", n.name, list_or_none(&n.addresses))?;
            let when = match n.last_resolved_unix {
                Some(t) => ago(now.saturating_sub(t)),
                None => "never".to_string(),
            };
            writeln!(
                out,
                "    resolved: {when} ({} resolutions, {} failed)",
                n.resolutions, n.failures
            )?;
            if let Some(e) = &n.last_error {
                writeln!(out, "    last error: {e}")?;
            }
            if !n.services.is_empty() {
                writeln!(
                    out,
                    "    services: {}{}",
                    n.services.join(", "),
                    if n.per_service {
                        " (readiness does not wait for it)"
                    } else {
                        ""
                    }
                )?;
            }
        }
    }

    if !snap.services.is_empty() {
        writeln!(out)?;
        writeln!(out, "services:")?;
        for s in &snap.services {
            match (s.names.is_empty(), s.unresolved_names.is_empty()) {
                (true, _) => writeln!(out, "  {}: no names to resolve", s.service)?,
                (false, true) => writeln!(out, "  {}: names resolved", s.service)?,
                (false, false) => writeln!(
                    out,
                    "  {}: unresolved {} (its rules wait for it)",
                    s.service,
                    s.unresolved_names.join(", ")
                )?,
            }
        }
    }

    // A daemon too old to send its tuning sends no workers.
    if snap.tuning.workers > 0 {
        writeln!(out)?;
        tuning::write_tuning(out, &snap.tuning)?;
    }
    Ok(())
}

/// The rules block of the status text. A tunnel that needs no rules says so, instead of
/// "0 rules (not applied)" and a backend it never chose.
fn write_rules(out: &mut String, r: &RulesStatus) -> std::fmt::Result {
    let rules = |n: usize| if n == 1 { "rule" } else { "rules" };
    if !r.needed {
        writeln!(out, "rules: none needed")?;
        if !r.applied {
            // Rules of an earlier configuration that could not be removed yet.
            writeln!(
                out,
                "  still installed: {} {} (being removed)",
                r.rule_count,
                rules(r.rule_count)
            )?;
        }
        if let Some(e) = &r.last_error {
            writeln!(out, "  last error: {e}")?;
        }
        return Ok(());
    }
    let backend = if r.backend.is_empty() {
        "(none chosen)"
    } else {
        &r.backend
    };
    writeln!(out, "rules: {backend}")?;
    writeln!(
        out,
        "  installed: {} {}{}",
        r.rule_count,
        rules(r.rule_count),
        if r.applied { "" } else { " (not applied)" }
    )?;
    if r.applies == 0 {
        writeln!(out, "  applies: none yet")?;
    } else {
        writeln!(
            out,
            "  applies: {} ({} failed), last took {:.3} s",
            r.applies, r.failures, r.last_apply_seconds
        )?;
    }
    if let Some(e) = &r.last_error {
        writeln!(out, "  last error: {e}")?;
    }
    Ok(())
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "(none)".to_string()
    } else {
        items.join(", ")
    }
}

/// `wg show`'s byte counts: `512 B`, `1.21 KiB`, `3.40 MiB`, ...
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// `wg show`'s durations: `1 hour, 2 minutes, 3 seconds`.
fn duration(secs: u64) -> String {
    let parts = [
        (secs / (365 * 86_400), "year"),
        (secs % (365 * 86_400) / 86_400, "day"),
        (secs % 86_400 / 3600, "hour"),
        (secs % 3600 / 60, "minute"),
        (secs % 60, "second"),
    ];
    let words: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n} {unit}{}", if *n == 1 { "" } else { "s" }))
        .collect();
    if words.is_empty() {
        "0 seconds".to_string()
    } else {
        words.join(", ")
    }
}

fn ago(secs: u64) -> String {
    if secs == 0 {
        "just now".to_string()
    } else {
        format!("{} ago", duration(secs))
    }
}

#[cfg(test)]
pub(crate) mod tests;
