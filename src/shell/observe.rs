//! What the daemon reports about itself: readiness with a reason, and the snapshot behind
//! `/metrics` and `tunnelgate status`. Copies counters only; never waits on I/O.

use crate::shell::daemon::Daemon;
use crate::telemetry::{InterfaceStatus, Observe, PeerStatus, Snapshot};
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

impl Observe for Daemon {
    fn liveness(&self) -> Result<(), String> {
        self.shared().liveness()
    }

    fn readiness(&self) -> Result<(), String> {
        let status = self.status.lock();
        if status.firewall_needed && !status.rules.applied {
            let why = status
                .rules
                .last_error
                .clone()
                .unwrap_or_else(|| "not applied yet".into());
            return Err(format!("rules ({}): {why}", status.rules.backend));
        }
        if let Some(n) = status
            .names
            .values()
            .find(|n| n.last_resolved_unix.is_none())
        {
            let why = n
                .last_error
                .clone()
                .unwrap_or_else(|| "not resolved yet".into());
            return Err(format!("dns: {}: {why}", n.name));
        }
        let (needed, backend) = (status.firewall_needed, status.rules.backend.clone());
        drop(status);
        // Applied is not enough: the rules must be the ones the current config and DNS answers
        // ask for (the first answers arrive after the first apply, and a reload or a changed
        // answer is applied a moment later).
        if needed {
            let want = self.desired_rules();
            let current = self
                .firewall
                .lock()
                .as_ref()
                .is_some_and(|f| f.applied.as_ref().is_some_and(|(set, _)| *set == want));
            if !current {
                return Err(format!(
                    "rules ({backend}): the current config and DNS answers are not applied yet"
                ));
            }
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        let table = self.shared().snapshot();
        let config = self.config();
        let now = SystemTime::now();
        let peers = table
            .peers
            .values()
            .map(|p| {
                let since = p.tunnel.lock().stats().since_last_handshake;
                let c = &p.counters;
                PeerStatus {
                    public_key: p.public_key.to_base64(),
                    endpoint: p.endpoint().map(|e| e.to_string()),
                    allowed_ips: p
                        .settings
                        .allowed_ips
                        .iter()
                        .map(ToString::to_string)
                        .collect(),
                    latest_handshake_unix: since
                        .and_then(|d| now.checked_sub(d))
                        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                        .map(|d| d.as_secs()),
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
        let status = self.status.lock();
        let mut snap = Snapshot {
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
            drops: self.shared().drops.snapshot(),
            rules: status.rules.clone(),
            names: status.names.values().cloned().collect(),
            reloads: self.reloads.load(Ordering::Relaxed),
            reload_failures: self.reload_failures.load(Ordering::Relaxed),
            ready: false,
            not_ready_reason: None,
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        drop(status);
        snap.set_readiness(self.readiness());
        snap
    }
}
