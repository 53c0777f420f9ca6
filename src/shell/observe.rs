//! What the running daemon shows: readiness with a reason, the snapshot behind `/metrics` and
//! `tunnelgate status`, and the UAPI `get`/`set` of [`Handle`]. Copies what the event loop
//! published and the live counters; never waits on I/O.

use crate::shell::daemon::Handle;
use crate::telemetry::{
    InterfaceStatus, NameStatus, Observe, PeerStatus, RulesStatus, ServiceStatus, Snapshot,
};
use crate::uapi::{DeviceSnapshot, DeviceUpdate, PeerSnapshot, UapiError, UapiHandler};
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

fn unix_secs(t: SystemTime) -> Option<u64> {
    t.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs())
}

/// The wall-clock time of a monotonic instant in the past.
fn wall_time_of(at: Instant) -> SystemTime {
    SystemTime::now() - at.elapsed()
}

impl Observe for Handle {
    fn liveness(&self) -> Result<(), String> {
        self.shared.liveness()
    }

    fn readiness(&self) -> Result<(), String> {
        self.published.lock().view.readiness.clone()
    }

    fn snapshot(&self) -> Snapshot {
        let table = self.shared.snapshot();
        let now = SystemTime::now();
        let peers = table
            .peers
            .values()
            .map(|p| {
                let since = p.tunnel.lock().stats().since_last_handshake;
                let c = &p.counters;
                PeerStatus {
                    public_key: p.public_key.to_base64(),
                    name: p.settings.name.clone(),
                    endpoint: p.endpoint().map(|e| e.to_string()),
                    allowed_ips: p
                        .settings
                        .allowed_ips
                        .iter()
                        .map(ToString::to_string)
                        .collect(),
                    latest_handshake_unix: since
                        .and_then(|d| now.checked_sub(d))
                        .and_then(unix_secs),
                    rx_bytes: c.rx_bytes.load(Ordering::Relaxed),
                    tx_bytes: c.tx_bytes.load(Ordering::Relaxed),
                    rx_packets: c.rx_packets.load(Ordering::Relaxed),
                    tx_packets: c.tx_packets.load(Ordering::Relaxed),
                    handshake_attempts: c.handshakes_sent.load(Ordering::Relaxed),
                    handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
                    persistent_keepalive: p.settings.persistent_keepalive,
                }
            })
            .collect();
        let drops = self.shared.drops.snapshot();
        let published = self.published.lock();
        let (view, config) = (&published.view, &published.config);
        let mut snap = Snapshot {
            process: crate::telemetry::process::read(),
            interface: InterfaceStatus {
                name: config.interface.name.clone(),
                public_key: table.public_key.to_base64(),
                listen_port: self.listen_port(),
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
                applied: view.rules.needed && view.rules.last_error.is_none() && view.rules.current,
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
        snap.set_readiness(view.readiness.clone());
        snap
    }
}

impl UapiHandler for Handle {
    fn get(&self) -> DeviceSnapshot {
        let table = self.shared.snapshot();
        let now = SystemTime::now();
        let fwmark = self.published.lock().view.fwmark;
        DeviceSnapshot {
            private_key: table.private_key.clone(),
            listen_port: self.listen_port(),
            fwmark,
            peers: table
                .peers
                .values()
                .map(|p| {
                    let stats = p.tunnel.lock().stats();
                    PeerSnapshot {
                        public_key: p.public_key,
                        preshared_key: p.settings.preshared_key.clone(),
                        endpoint: p.endpoint(),
                        last_handshake: stats.since_last_handshake.and_then(|d| now.checked_sub(d)),
                        tx_bytes: p.counters.tx_bytes.load(Ordering::Relaxed),
                        rx_bytes: p.counters.rx_bytes.load(Ordering::Relaxed),
                        persistent_keepalive: p.settings.persistent_keepalive,
                        allowed_ips: p.settings.allowed_ips.clone(),
                    }
                })
                .collect(),
        }
    }

    /// Handed to the event loop, which runs it through the control core.
    fn set(&self, update: DeviceUpdate) -> Result<(), UapiError> {
        self.set_blocking(update)
    }
}
