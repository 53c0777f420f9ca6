//! Keeps the firewall equal to the desired rule set: resolves target names on schedule,
//! re-renders when config or answers change, applies in one transaction, and repairs drift.

use crate::config::Config;
use crate::core::dns::Outcome;
use crate::rules::plan::{desired, RuntimeFacts};
use crate::rules::{Family, RuleSet};
use crate::shell::daemon::Daemon;
use crate::shell::firewall::{self, Backend};
use crate::shell::resolver::Resolver;
use crate::telemetry::NameStatus;
use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Firewall state of a running daemon.
pub struct FirewallState {
    pub backend: Backend,
    /// The rule set last applied successfully, and its read-back fingerprint.
    pub applied: Option<(RuleSet, String)>,
    /// Families whose forwarding sysctl we turned on (to turn off again on exit).
    pub forwarding_enabled: BTreeSet<Family>,
}

/// Whether a configuration asks for any forwarding, and so for firewall rules at all.
pub fn firewall_needed(config: &Config) -> bool {
    !config.ingress.is_empty()
        || !config.egress.is_empty()
        || !config.router.advertise_routes.is_empty()
        || config.router.exit_node
}

/// The families that need IP forwarding for `set`.
fn forwarding_families(set: &RuleSet) -> BTreeSet<Family> {
    let mut out: BTreeSet<Family> = set
        .ingress
        .iter()
        .map(|i| i.family)
        .chain(set.egress.iter().map(|e| e.family))
        .collect();
    out.extend(set.router.networks.iter().map(Family::of_net));
    if set.router.exit_node {
        out.extend(Family::ALL);
    }
    out
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Daemon {
    fn facts(&self, config: &Config) -> RuntimeFacts {
        RuntimeFacts {
            wg_port: self.listen_port(),
            health_port: config.health.listen.map(|a| a.port()),
        }
    }

    /// The rule set the current config and DNS answers ask for.
    pub fn desired_rules(&self) -> RuleSet {
        let config = self.config();
        let resolved = self.dns.lock().resolved();
        desired(&config, &self.facts(&config), &resolved)
    }

    /// Applies the desired rules if they differ from what was applied, or if what is
    /// installed no longer matches what was applied (`check_drift`). Errors are recorded in
    /// the status (readiness, metrics) and returned.
    pub async fn reconcile_rules(&self, check_drift: bool) -> Result<(), String> {
        let Some(backend) = self.firewall.lock().as_ref().map(|f| f.backend) else {
            return Ok(());
        };
        let want = self.desired_rules();
        let previous = self
            .firewall
            .lock()
            .as_ref()
            .and_then(|f| f.applied.clone());
        let reason = match &previous {
            Some((set, _)) if *set != want => "changed",
            None => "initial",
            Some((_, fingerprint)) if check_drift => {
                let fp = fingerprint.clone();
                match tokio::task::spawn_blocking(move || backend.installed()).await {
                    Ok(Ok(now)) if now == fp => return Ok(()),
                    Ok(Ok(_)) => "drifted",
                    Ok(Err(e)) => return Err(self.record_failure(backend, e.to_string())),
                    Err(e) => return Err(self.record_failure(backend, e.to_string())),
                }
            }
            Some(_) => return Ok(()),
        };
        for family in forwarding_families(&want) {
            match firewall::enable_forwarding(family) {
                Ok(true) => {
                    tracing::info!(?family, "Enabled IP forwarding");
                    if let Some(f) = self.firewall.lock().as_mut() {
                        f.forwarding_enabled.insert(family);
                    }
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(?family, error = %e, "Cannot enable IP forwarding"),
            }
        }
        let started = Instant::now();
        let set = want.clone();
        let result = tokio::task::spawn_blocking(move || backend.apply(&set)).await;
        let seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(Ok(fingerprint)) => {
                let count = fingerprint.lines().filter(|l| !l.trim().is_empty()).count();
                tracing::info!(backend = %backend, lines = count, reason, seconds, "Rules applied");
                let text = backend_text(backend, &want);
                if let Some(f) = self.firewall.lock().as_mut() {
                    f.applied = Some((want, fingerprint));
                }
                let mut status = self.status.lock();
                status.rules.applied = true;
                status.rules.applies += 1;
                status.rules.rule_count = count;
                status.rules.last_error = None;
                status.rules.last_apply_seconds = seconds;
                status.rules.text = text;
                Ok(())
            }
            Ok(Err(e)) => Err(self.record_failure(backend, e.to_string())),
            Err(e) => Err(self.record_failure(backend, e.to_string())),
        }
    }

    fn record_failure(&self, backend: Backend, error: String) -> String {
        tracing::error!(backend = %backend, error = %error, "Rule apply failed; the previous rules stay in place");
        let mut status = self.status.lock();
        status.rules.applied = false;
        status.rules.applies += 1;
        status.rules.failures += 1;
        status.rules.last_error = Some(error.clone());
        error
    }

    /// Resolves every name that is due and records the results; returns whether any
    /// address set changed.
    pub async fn resolve_due(&self, resolver: &Resolver) -> bool {
        let due = self.dns.lock().due(Instant::now());
        let mut changed = false;
        for name in due {
            let result = resolver.resolve(&name).await;
            let now = Instant::now();
            let outcome = self.dns.lock().on_result(&name, result.clone(), now);
            let mut status = self.status.lock();
            let entry = status
                .names
                .entry(name.clone())
                .or_insert_with(|| NameStatus {
                    name: name.clone(),
                    ..NameStatus::default()
                });
            entry.resolutions += 1;
            match outcome {
                Outcome::Changed { old, new } => {
                    tracing::info!(name = %name, old = ?old, new = ?new, "Name re-resolved");
                    changed = true;
                }
                Outcome::Unchanged => {}
                Outcome::Failed { retry_in } => {
                    entry.failures += 1;
                    tracing::warn!(name = %name, error = %result.as_ref().err().map(String::as_str).unwrap_or("no addresses"), retry_in_secs = retry_in.as_secs(), "Resolution failed; keeping the last good addresses");
                }
            }
            if let Some(state) = self.dns.lock().get(&name) {
                entry.addresses = state.addresses.iter().map(ToString::to_string).collect();
                entry.last_error = state.last_error.clone();
                if outcome_succeeded(state) {
                    entry.last_resolved_unix = Some(unix_now());
                }
            }
        }
        changed
    }

    /// Tracks the names of the current config (after start and each reload).
    pub fn track_names(&self) {
        let config = self.config();
        let names = config.fqdn_targets();
        self.dns
            .lock()
            .set_names(&names, config.dns.reresolve_interval, Instant::now());
        let mut status = self.status.lock();
        status.names.retain(|n, _| names.contains(n));
        // Listed before the first answer, so readiness waits for it.
        for name in &names {
            status
                .names
                .entry(name.clone())
                .or_insert_with(|| NameStatus {
                    name: name.clone(),
                    ..NameStatus::default()
                });
        }
    }

    /// Re-resolves names on schedule and repairs drift, until the daemon stops.
    pub async fn rules_task(self: std::sync::Arc<Self>) {
        let mut resolver_for: Option<(Vec<std::net::SocketAddr>, Resolver)> = None;
        let mut next_repair = Instant::now();
        loop {
            let config = self.config();
            if resolver_for
                .as_ref()
                .is_none_or(|(ns, _)| *ns != config.dns.nameservers)
            {
                match Resolver::new(&config.dns.nameservers) {
                    Ok(r) => resolver_for = Some((config.dns.nameservers.clone(), r)),
                    Err(e) => tracing::error!(error = %e, "Cannot set up DNS resolution"),
                }
            }
            let mut changed = false;
            if let Some((_, resolver)) = &resolver_for {
                changed = self.resolve_due(resolver).await;
            }
            let repair = config
                .firewall
                .repair_interval
                .filter(|_| Instant::now() >= next_repair);
            if changed
                || repair.is_some()
                || self
                    .rules_dirty
                    .swap(false, std::sync::atomic::Ordering::Relaxed)
            {
                let _ = self.reconcile_rules(repair.is_some()).await;
            }
            if let Some(every) = config.firewall.repair_interval {
                if Instant::now() >= next_repair {
                    next_repair = Instant::now() + every;
                }
            }
            let mut wake = Instant::now() + Duration::from_secs(60);
            if let Some(d) = self.dns.lock().next_deadline() {
                wake = wake.min(d);
            }
            if config.firewall.repair_interval.is_some() {
                wake = wake.min(next_repair);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = self.rules_changed.notified() => {}
            }
        }
    }

    /// Removes our rules and restores forwarding sysctls we changed.
    pub async fn remove_rules(&self) {
        let Some(state) = self.firewall.lock().take() else {
            return;
        };
        let backend = state.backend;
        match tokio::task::spawn_blocking(move || backend.remove()).await {
            Ok(Ok(())) => tracing::info!(backend = %backend, "Rules removed"),
            Ok(Err(e)) => tracing::error!(backend = %backend, error = %e, "Could not remove rules"),
            Err(e) => tracing::error!(error = %e, "Could not remove rules"),
        }
        for family in state.forwarding_enabled {
            if let Err(e) = firewall::disable_forwarding(family) {
                tracing::warn!(?family, error = %e, "Could not restore the forwarding sysctl");
            }
        }
    }
}

fn outcome_succeeded(state: &crate::core::dns::NameState) -> bool {
    state.ever_resolved && state.failures == 0
}

/// The rule text for status: exactly what was applied for nftables.
fn backend_text(backend: Backend, set: &RuleSet) -> String {
    match backend {
        Backend::Nftables => crate::rules::nft::render(set),
        Backend::Iptables { .. } => [Family::V4, Family::V6]
            .iter()
            .map(|f| crate::rules::iptables::render(set, *f, &Default::default()))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}
