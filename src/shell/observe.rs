//! What the running daemon shows: readiness with a reason, the snapshot behind `/metrics` and
//! `tunnelgate status`, and the UAPI `get`/`set` of [`Handle`]. Copies what the event loop
//! published and the live counters; never waits on I/O.

use crate::config::PublicKey;
use crate::core::control::PeerSpec;
use crate::core::peer::PeerStats;
use crate::core::priority::{Access, StepDown};
use crate::shell::daemon::Handle;
use crate::shell::dataplane::{ReadersView, ThreadSetup};
use crate::telemetry::tuning::{ReadersStatus, TuningStatus};
use crate::telemetry::{
    InterfaceStatus, NameStatus, Observe, PeerStatus, PeerTotals, RulesStatus, ServiceStatus,
    Snapshot,
};
use crate::uapi::{format_get_device, format_get_peer, GET_END};
use crate::uapi::{DeviceSnapshot, DeviceUpdate, PeerSnapshot, UapiError, UapiHandler};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

fn unix_secs(t: SystemTime) -> Option<u64> {
    t.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs())
}

/// The wall-clock time of a monotonic instant in the past.
fn wall_time_of(at: Instant) -> SystemTime {
    crate::shell::clock::wall_now() - crate::shell::clock::since(at)
}

impl Observe for Handle {
    fn liveness(&self) -> Result<(), String> {
        self.dataplane.liveness()?;
        self.event_loop.check(
            crate::shell::clock::now(),
            crate::core::liveness::STALL_LIMIT,
        )
    }

    fn readiness(&self) -> Result<(), String> {
        self.published.lock().view.readiness.clone()
    }

    fn snapshot(&self) -> Snapshot {
        self.snapshot_of(None)
    }

    fn metrics_snapshot(&self) -> Snapshot {
        let limit = self.published.lock().config.health.metrics_peers;
        self.snapshot_of(Some(limit))
    }
}

/// One peer as status and metrics show it.
fn peer_status(key: &PublicKey, spec: &PeerSpec, stats: &PeerStats, now: SystemTime) -> PeerStatus {
    let c = stats.counters;
    PeerStatus {
        public_key: key.to_base64(),
        name: spec.name.clone(),
        endpoint: stats.path.map(|e| e.remote.to_string()),
        allowed_ips: spec.allowed_ips.iter().map(ToString::to_string).collect(),
        latest_handshake_unix: stats
            .since_last_handshake
            .and_then(|d| now.checked_sub(d))
            .and_then(unix_secs),
        rx_bytes: c.rx_bytes,
        tx_bytes: c.tx_bytes,
        rx_packets: c.rx_packets,
        tx_packets: c.tx_packets,
        handshake_attempts: c.handshakes_initiated,
        handshakes_answered: c.handshakes_answered,
        handshake_failures: c.handshake_failures,
        takeovers_started: c.takeovers_started,
        takeovers_completed: c.takeovers_completed,
        takeovers_failed: c.takeovers_failed,
        takeovers_no_endpoint: c.takeovers_no_endpoint,
        takeover_ms_total: millis(c.takeover_time_total),
        takeover_ms_last: c.takeover_time_last.map(millis),
        persistent_keepalive: spec.persistent_keepalive,
    }
}

impl Handle {
    /// The snapshot with every peer listed (`limit` None: status), or only the `limit`
    /// busiest (most bytes moved; ties by key) with every peer in its totals (`/metrics`). The
    /// peers are read twice from the table, the second time only those chosen: nothing of
    /// the others is copied but their counters.
    fn snapshot_of(&self, limit: Option<usize>) -> Snapshot {
        let identity = self.dataplane.identity();
        let now = crate::shell::clock::wall_now();
        let now_unix = unix_secs(now).unwrap_or(0);
        let mut totals = PeerTotals::default();
        totals.add_counters(&self.dataplane.departed());
        let mut peers = Vec::new();
        let mut busy: Vec<(u64, PublicKey)> = Vec::new();
        self.dataplane.for_each_peer(|key, spec, stats| {
            let latest = (stats.since_last_handshake)
                .and_then(|d| now.checked_sub(d))
                .and_then(unix_secs);
            totals.count_peer(latest, now_unix);
            totals.add_counters(&stats.counters);
            match limit {
                None => peers.push(peer_status(key, spec, &stats, now)),
                Some(_) => {
                    let c = stats.counters;
                    busy.push((c.rx_bytes.saturating_add(c.tx_bytes), *key));
                }
            }
        });
        if let Some(limit) = limit {
            let chosen = crate::telemetry::busiest(busy, limit);
            self.dataplane.for_each_peer(|key, spec, stats| {
                if chosen.contains(key) {
                    peers.push(peer_status(key, spec, &stats, now));
                }
            });
        }
        let drops = self.dataplane.drops();
        let mut tuning = tuning_status(
            self.dataplane.thread_setup(),
            self.dataplane.workers(),
            Some(&self.dataplane.readers()),
        );
        let (sealed, opened) = self.dataplane.partner_jobs();
        tuning.relay_jobs_sealed = Some(sealed);
        tuning.relay_jobs_opened = Some(opened);
        // System calls first: the published view's lock is held for copying only.
        let process = crate::shell::procfs::read();
        let netns_id = crate::shell::status_client::own_netns_id();
        let listen_port = self.listen_port();
        let published = self.published.lock();
        let (view, config) = (&published.view, &published.config);
        let totals_peers = usize::try_from(totals.peers).unwrap_or(usize::MAX);
        let mut snap = Snapshot {
            process,
            netns_id,
            interface: InterfaceStatus {
                name: config.interface.name.clone(),
                public_key: identity.public_key.to_base64(),
                listen_port,
                addresses: config
                    .interface
                    .addresses
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
                mtu: config.interface.mtu,
            },
            peers,
            peer_totals: Some(totals),
            drops,
            rules: RulesStatus {
                backend: published.backend.clone(),
                needed: view.rules.needed,
                applied: view.rules.last_error.is_none() && view.rules.current,
                rule_count: view.rules.rule_count,
                applies: view.rules.applies,
                failures: view.rules.failures,
                last_error: view.rules.last_error.clone(),
                last_apply_seconds: view.rules.last_apply_seconds,
                text: view.rules.text.clone(),
            },
            names: view
                .names
                .iter()
                .map(|n| NameStatus {
                    name: n.name.clone(),
                    addresses: n.addresses.iter().map(ToString::to_string).collect(),
                    last_resolved_unix: n.last_resolved.map(wall_time_of).and_then(unix_secs),
                    last_error: n.last_error.clone(),
                    resolutions: n.resolutions,
                    failures: n.failures,
                    services: n.services.clone(),
                    per_service: !n.holds_readiness,
                })
                .collect(),
            services: view
                .services
                .iter()
                .map(|s| ServiceStatus {
                    service: s.service.clone(),
                    names: s.names.clone(),
                    unresolved_names: s.unresolved.clone(),
                })
                .collect(),
            reloads: view.reloads,
            reload_failures: view.reload_failures,
            ready: false,
            not_ready_reason: None,
            version: env!("CARGO_PKG_VERSION").to_string(),
            tuning,
            group_exchange: self.group_stats.get().map(|g| {
                use std::sync::atomic::Ordering::Relaxed;
                crate::telemetry::GroupExchangeStatus {
                    replicas: g.replicas.load(Relaxed),
                    accepted: g.accepted.load(Relaxed),
                    endpoints_learned: g.endpoints_learned.load(Relaxed),
                    sent: g.sent.load(Relaxed),
                    refused: g
                        .refusals()
                        .into_iter()
                        .map(|(why, n)| (why.to_string(), n))
                        .chain([
                            ("over_rate".to_string(), g.over_rate.load(Relaxed)),
                            (
                                "unknown_replica".to_string(),
                                g.unknown_replica.load(Relaxed),
                            ),
                        ])
                        .collect(),
                }
            }),
        };
        let readiness = view.readiness.clone();
        drop(published);
        snap.set_readiness(readiness);
        if totals_peers >= crate::shell::procfs::MANY_PEERS {
            crate::shell::procfs::give_back_free_heap();
        }
        snap
    }
}

/// The tuning in force as status, metrics and `check` show it: `setup` and the `workers` the
/// data plane runs, with what its readers did (`None` from `check`: nothing runs).
pub fn tuning_status(
    setup: &ThreadSetup,
    workers: usize,
    readers: Option<&ReadersView>,
) -> TuningStatus {
    let t = &setup.tuning;
    let refused = readers.and_then(|r| r.refused.clone());
    let (priority, access, why) = match (&setup.access, refused) {
        (_, Some(why)) => (None, "refused".to_string(), why),
        (access @ (Access::Limit | Access::Capability), None) => (
            t.rt_priority,
            access.label().to_string(),
            access.to_string(),
        ),
        (access, None) => (None, access.label().to_string(), access.to_string()),
    };
    let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    TuningStatus {
        readers: ReadersStatus {
            priority,
            access,
            why,
            running: readers.map(|r| r.count),
            realtime_now: readers.map(|r| r.realtime),
            share_percent: t.rt_budget.share_percent,
            unauthenticated_percent: t.rt_budget.unauthenticated_percent,
            burst_ms: u64::try_from(t.rt_budget.burst.as_millis()).unwrap_or(u64::MAX),
            process_rate_milli: t.rt_budget.process_rate(t.usable_cpus_milli()),
            realtime_cpu_seconds: readers.map_or(0.0, |r| r.realtime_cpu_ns as f64 / 1e9),
            unauthenticated_cpu_seconds: readers
                .map_or(0.0, |r| r.unauthenticated_cpu_ns as f64 / 1e9),
            step_downs: StepDown::ALL
                .iter()
                .zip(readers.map_or([0; StepDown::ALL.len()], |r| r.step_downs))
                .map(|(why, n)| (why.label().to_string(), n))
                .collect(),
        },
        aqm_target_us: t.aqm.map(|a| micros(a.target)),
        aqm_interval_us: t.aqm.map(|a| micros(a.interval)),
        workers: u32::try_from(workers).unwrap_or(u32::MAX),
        relay_partners: u32::try_from(crate::shell::dataplane::relay_partners(t, workers))
            .unwrap_or(u32::MAX),
        relay_asked: t
            .relay_partners
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        relay_lowered: crate::core::knobs::relay_lowered(
            t.relay_partners,
            workers,
            crate::shell::dataplane::usable_cpus(t),
        ),
        environment: t.environment.clone(),
        relay_jobs_sealed: None,
        relay_jobs_opened: None,
        cpus: u32::try_from(t.cpus.affinity).unwrap_or(u32::MAX),
        cpu_quota_milli: t.cpus.quota_milli,
        socket_buffer_bytes: u64::try_from(t.socket_buffer_bytes).unwrap_or(u64::MAX),
        tun_txqueuelen: t.tun_txqueuelen,
        udp_gro: t.udp_gro,
        udp_gso: t.udp_gso,
    }
}

/// How large a piece of a `get` reply grows before it is handed to the connection: a few
/// hundred peers.
const GET_PIECE_BYTES: usize = 64 * 1024;

/// One peer as a `get` reply shows it, `now` being the wall clock.
fn peer_snapshot(
    key: &PublicKey,
    spec: &PeerSpec,
    stats: &PeerStats,
    now: SystemTime,
) -> PeerSnapshot {
    PeerSnapshot {
        public_key: *key,
        preshared_key: spec.preshared_key.clone(),
        endpoint: stats.path.map(|e| e.remote),
        last_handshake: stats.since_last_handshake.and_then(|d| now.checked_sub(d)),
        tx_bytes: stats.counters.tx_bytes,
        rx_bytes: stats.counters.rx_bytes,
        persistent_keepalive: spec.persistent_keepalive,
        allowed_ips: spec.allowed_ips.clone(),
    }
}

impl UapiHandler for Handle {
    fn get(&self) -> DeviceSnapshot {
        let identity = self.dataplane.identity();
        let now = crate::shell::clock::wall_now();
        let fwmark = self.published.lock().view.fwmark;
        let mut peers = Vec::new();
        self.dataplane.for_each_peer(|key, spec, stats| {
            peers.push(peer_snapshot(key, spec, &stats, now));
        });
        DeviceSnapshot {
            private_key: identity.private_key,
            listen_port: self.listen_port(),
            fwmark,
            peers,
        }
    }

    /// Piece by piece from one snapshot of the peer table: at 100,000 peers the reply is
    /// never one string (it was 30 MB, and a copy of every peer's view besides).
    fn get_in_pieces(&self, out: &mut dyn FnMut(String) -> bool) {
        let identity = self.dataplane.identity();
        let now = crate::shell::clock::wall_now();
        let fwmark = self.published.lock().view.fwmark;
        let fresh = || String::with_capacity(GET_PIECE_BYTES + 4096);
        let mut piece = fresh();
        format_get_device(
            &mut piece,
            identity.private_key.as_ref(),
            self.listen_port(),
            fwmark,
        );
        let mut gone = false;
        self.dataplane.for_each_peer(|key, spec, stats| {
            if gone {
                return;
            }
            format_get_peer(&mut piece, &peer_snapshot(key, spec, &stats, now));
            if piece.len() >= GET_PIECE_BYTES {
                gone = !out(std::mem::replace(&mut piece, fresh()));
            }
        });
        if !gone {
            piece.push_str(GET_END);
            out(piece);
        }
        if self.dataplane.peer_count() >= crate::shell::procfs::MANY_PEERS {
            crate::shell::procfs::give_back_free_heap();
        }
    }

    /// Handed to the event loop, which runs it through the control core.
    fn set(&self, update: DeviceUpdate) -> Result<(), UapiError> {
        self.set_blocking(update)
    }
}

/// Whole milliseconds, saturating.
fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
