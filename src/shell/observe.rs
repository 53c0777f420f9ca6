//! What the running daemon shows: readiness with a reason, the snapshot behind `/metrics` and
//! `tunnelgate status`, and the UAPI `get`/`set` of [`Handle`]. Copies what the event loop
//! published and the live counters; never waits on I/O.

use crate::shell::daemon::Handle;
use crate::telemetry::{
    InterfaceStatus, NameStatus, Observe, PeerStatus, RulesStatus, ServiceStatus, Snapshot,
};
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
        let identity = self.dataplane.identity();
        let now = crate::shell::clock::wall_now();
        let peers = self
            .dataplane
            .peers()
            .into_iter()
            .map(|p| {
                let c = p.stats.counters;
                PeerStatus {
                    public_key: p.public_key.to_base64(),
                    name: p.spec.name,
                    endpoint: p.stats.path.map(|e| e.remote.to_string()),
                    allowed_ips: p.spec.allowed_ips.iter().map(ToString::to_string).collect(),
                    latest_handshake_unix: p
                        .stats
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
                    persistent_keepalive: p.spec.persistent_keepalive,
                }
            })
            .collect();
        let drops = self.dataplane.drops();
        // System calls first: the published view's lock is held for copying only.
        let process = crate::shell::procfs::read();
        let netns_id = crate::shell::status_client::own_netns_id();
        let listen_port = self.listen_port();
        let published = self.published.lock();
        let (view, config) = (&published.view, &published.config);
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
        };
        let readiness = view.readiness.clone();
        drop(published);
        snap.set_readiness(readiness);
        snap
    }
}

impl UapiHandler for Handle {
    fn get(&self) -> DeviceSnapshot {
        let identity = self.dataplane.identity();
        let now = crate::shell::clock::wall_now();
        let fwmark = self.published.lock().view.fwmark;
        DeviceSnapshot {
            private_key: identity.private_key,
            listen_port: self.listen_port(),
            fwmark,
            peers: self
                .dataplane
                .peers()
                .into_iter()
                .map(|p| PeerSnapshot {
                    public_key: p.public_key,
                    preshared_key: p.spec.preshared_key,
                    endpoint: p.stats.path.map(|e| e.remote),
                    last_handshake: p
                        .stats
                        .since_last_handshake
                        .and_then(|d| now.checked_sub(d)),
                    tx_bytes: p.stats.counters.tx_bytes,
                    rx_bytes: p.stats.counters.rx_bytes,
                    persistent_keepalive: p.spec.persistent_keepalive,
                    allowed_ips: p.spec.allowed_ips,
                })
                .collect(),
        }
    }

    /// Handed to the event loop, which runs it through the control core.
    fn set(&self, update: DeviceUpdate) -> Result<(), UapiError> {
        self.set_blocking(update)
    }
}
