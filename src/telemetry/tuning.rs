//! The tuning in force, as `tunnelgate status`, `tunnelgate check` and `/metrics` show it: the
//! packet readers' scheduling priority and why, their real-time budget and what they spent of
//! it, the AQM's target and interval, the workers, the socket and TUN queues. Pure: values in,
//! text and metrics out.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;

/// The tuning in force (or, from `check`, what a start would get).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TuningStatus {
    pub readers: ReadersStatus,
    /// CoDel on the receive queues, in microseconds; `None`: off.
    pub aqm_target_us: Option<u64>,
    pub aqm_interval_us: Option<u64>,
    /// Packet workers (each a TUN queue, a socket and two readers).
    pub workers: u32,
    /// Relay partners per packet reader (0: the relay is off).
    pub relay_partners: u32,
    /// At most how many were asked for (`TUNNELGATE_RELAY_PARTNERS`); `None`: as many as the
    /// CPUs allow.
    pub relay_asked: Option<u32>,
    /// Why fewer partners run than were asked for (`core::knobs::relay_lowered`); `None`: as
    /// asked.
    pub relay_lowered: Option<String>,
    /// Every `TUNNELGATE_*` variable set, as `NAME="value"`.
    pub environment: Vec<String>,
    /// Jobs the relay partners did so far: reads sealed, receive batches opened; `None` from
    /// `check` (nothing runs).
    pub relay_jobs_sealed: Option<u64>,
    pub relay_jobs_opened: Option<u64>,
    /// CPUs in the process's affinity mask.
    pub cpus: u32,
    /// The cgroup's CPU quota, thousandths of a CPU; `None`: no quota.
    pub cpu_quota_milli: Option<u64>,
    pub socket_buffer_bytes: u64,
    pub tun_txqueuelen: u32,
    pub udp_gro: bool,
    pub udp_gso: bool,
}

/// The packet readers' scheduling.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReadersStatus {
    /// The `SCHED_FIFO` priority they use when at real-time; `None`: they stay at normal
    /// priority (turned off, unavailable or refused).
    pub priority: Option<i32>,
    /// How they get it: `capability`, `rlimit`, or why not: `off`, `unavailable`, `refused`.
    pub access: String,
    /// The same in words (for `unavailable` and `refused`, what would allow it).
    pub why: String,
    /// Readers running; `None` from `check` (nothing runs).
    pub running: Option<u32>,
    /// Of them, at real-time priority now.
    pub realtime_now: Option<u32>,
    /// Percent of wall time one reader may spend at real-time priority.
    pub share_percent: u32,
    /// Of it, on work that does not authenticate.
    pub unauthenticated_percent: u32,
    /// The most CPU time a reader spends at real-time priority in one go, milliseconds.
    pub burst_ms: u64,
    /// What all readers together may spend at real-time priority, thousandths of a CPU.
    pub process_rate_milli: u64,
    /// CPU time the readers spent at real-time priority, seconds.
    pub realtime_cpu_seconds: f64,
    /// Of it, on work that did not authenticate.
    pub unauthenticated_cpu_seconds: f64,
    /// Step-downs from real-time priority, by reason.
    pub step_downs: BTreeMap<String, u64>,
}

/// The `tuning:` block of `status` and `check` text.
pub fn write_tuning(out: &mut String, t: &TuningStatus) -> std::fmt::Result {
    let r = &t.readers;
    writeln!(out, "tuning:")?;
    match r.priority {
        Some(p) => writeln!(
            out,
            "  packet readers: real-time (SCHED_FIFO {p}), {}",
            r.why
        )?,
        None => writeln!(out, "  packet readers: normal priority: {}", r.why)?,
    }
    if let (Some(running), Some(now)) = (r.running, r.realtime_now) {
        writeln!(out, "    at real-time now: {now} of {running}")?;
    }
    if r.priority.is_some() {
        writeln!(
            out,
            "    budget: {} % of the time each ({} % for unauthenticated work), {:.2} CPU for all, bursts of {} ms",
            r.share_percent,
            r.unauthenticated_percent,
            r.process_rate_milli as f64 / 1000.0,
            r.burst_ms
        )?;
    }
    if r.running.is_some() {
        let downs: Vec<String> = r
            .step_downs
            .iter()
            .map(|(w, n)| format!("{w} {n}"))
            .collect();
        writeln!(
            out,
            "    spent at real-time: {:.3} s of CPU ({:.3} s unauthenticated); step-downs: {}",
            r.realtime_cpu_seconds,
            r.unauthenticated_cpu_seconds,
            downs.join(", ")
        )?;
    }
    match (t.aqm_target_us, t.aqm_interval_us) {
        (Some(target), Some(interval)) => writeln!(
            out,
            "  receive queue AQM: CoDel, target {target} us, interval {interval} us"
        )?,
        _ => writeln!(out, "  receive queue AQM: off")?,
    }
    let quota = t.cpu_quota_milli.map_or_else(
        || "no CPU quota".to_string(),
        |q| format!("a CPU quota of {:.2}", q as f64 / 1000.0),
    );
    writeln!(out, "  workers: {} ({} CPUs, {quota})", t.workers, t.cpus)?;
    match (t.relay_partners, t.relay_asked) {
        (0, Some(0)) => writeln!(out, "  relay: off (TUNNELGATE_RELAY_PARTNERS=0)")?,
        (0, _) if t.workers <= 1 => writeln!(out, "  relay: off (one worker)")?,
        (0, _) => writeln!(out, "  relay: off (one CPU)")?,
        (1, _) => writeln!(out, "  relay: 1 partner thread per packet reader")?,
        (n, _) => writeln!(out, "  relay: {n} partner threads per packet reader")?,
    }
    if let Some(lowered) = &t.relay_lowered {
        writeln!(out, "    {lowered}")?;
    }
    if let (Some(sealed), Some(opened)) = (t.relay_jobs_sealed, t.relay_jobs_opened) {
        if t.relay_partners > 0 {
            writeln!(
                out,
                "    partners' jobs: {sealed} reads sealed, {opened} receive batches opened"
            )?;
        }
    }
    writeln!(
        out,
        "  queues: socket buffers {} bytes (GRO {}, GSO {}), TUN txqueuelen {}",
        t.socket_buffer_bytes,
        on_off(t.udp_gro),
        on_off(t.udp_gso),
        t.tun_txqueuelen
    )?;
    if t.environment.is_empty() {
        writeln!(out, "  environment: no TUNNELGATE_* variable set")
    } else {
        writeln!(out, "  environment: {}", t.environment.join(", "))
    }
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

type Labels = Vec<(String, String)>;

/// The readers' metrics: the priority they may use (by how they get it), how many run and how
/// many are at real-time now, CPU time at real-time, step-downs by reason.
pub fn register_metrics(reg: &mut Registry, t: &TuningStatus) {
    let r = &t.readers;
    let priority = Family::<Labels, Gauge>::default();
    priority
        .get_or_create(&vec![("access".to_string(), r.access.clone())])
        .set(i64::from(r.priority.unwrap_or(0)));
    reg.register(
        "packet_reader_priority",
        "The SCHED_FIFO priority the packet readers use at real-time (0: normal priority only), labelled by how they get it (capability, rlimit) or why not (off, unavailable, refused)",
        priority,
    );
    let gauge = |v: u32| {
        let g = Gauge::<i64>::default();
        g.set(i64::from(v));
        g
    };
    reg.register(
        "packet_readers",
        "Packet reader threads running",
        gauge(r.running.unwrap_or(0)),
    );
    reg.register(
        "packet_readers_realtime",
        "Packet reader threads at real-time priority now",
        gauge(r.realtime_now.unwrap_or(0)),
    );
    let cpu = Counter::<f64, std::sync::atomic::AtomicU64>::default();
    cpu.inc_by(r.realtime_cpu_seconds);
    reg.register(
        "packet_reader_realtime_cpu_seconds",
        "CPU time the packet readers spent at real-time priority",
        cpu,
    );
    let unauthenticated = Counter::<f64, std::sync::atomic::AtomicU64>::default();
    unauthenticated.inc_by(r.unauthenticated_cpu_seconds);
    reg.register(
        "packet_reader_unauthenticated_realtime_cpu_seconds",
        "Of the packet readers' CPU time at real-time priority, what went to work that did not authenticate (unknown senders, failed decryption, cookie replies)",
        unauthenticated,
    );
    let downs = Family::<Labels, Counter>::default();
    for (reason, n) in &r.step_downs {
        downs
            .get_or_create(&vec![("reason".to_string(), reason.clone())])
            .inc_by(*n);
    }
    reg.register(
        "packet_reader_step_downs",
        "Packet readers stepping down from real-time priority, by reason (budget: its own CPU time; unauthenticated: its CPU time on work that did not authenticate; process_budget: all readers' together; ping_pong: woken for nearly every packet)",
        downs,
    );
}
