//! The control core: one value that owns the desired configuration, what is applied (addresses,
//! routes, peers, rules, forwarding, resolved names), readiness and the DNS, retry and repair
//! schedules. Sans-IO: no tokio, no files, no processes, no clock; time comes in as `now`.
//!
//! The shell drives it in the order quinn-proto uses:
//! - A. getters ([`Control::view`], [`Control::config`], [`Control::readiness`]);
//! - B. inputs from the system, `handle_*(.., now)`: a config loaded, names resolved, rules,
//!   routes or addresses applied (or not), a socket rebound, a timer fired;
//! - C. commands: [`Control::handle_device_update`] (UAPI `set`), [`Control::teardown`];
//! - D. outputs: [`Control::poll_action`] until `None`, then [`Control::poll_timeout`].
//!
//! Every change it asks for is a diff in both directions (what to add and what to remove), and
//! each executor reports back, so "applied" always means "an executor said so".

use crate::config::{Config, Endpoint, IpNet, PublicKey, SecretKey};
use crate::core::backoff::Backoff;
use crate::core::dns::{Outcome, Schedule, MAX_CONCURRENT_RESOLUTIONS, RESOLVE_TIMEOUT};
use crate::core::routes::{self, PlanDiff, RoutePlan};
use crate::rules::desired::{desired, firewall_needed, RuntimeFacts};
use crate::rules::{Family, RuleSet};
use crate::uapi::{DeviceSnapshot, DeviceUpdate, PeerSnapshot, UapiError};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// First retry after a failed apply of rules, routes or addresses; doubles per failure.
const APPLY_RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest wait between retries of a failing apply: a broken `nft` is retried twice a minute.
const APPLY_RETRY_CAP: Duration = Duration::from_secs(30);
/// Longest wait between retries of an endpoint name that does not resolve.
const ENDPOINT_RETRY_CAP: Duration = Duration::from_secs(300);

/// What one peer is configured with (by the file or over UAPI). The live endpoint (roaming) and
/// the session belong to the shell's peer table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub preshared_key: Option<SecretKey>,
    pub persistent_keepalive: Option<u16>,
    pub allowed_ips: Vec<IpNet>,
}

/// A peer to add, or an existing one whose spec changed. The shell keeps the session of an
/// existing peer unless its preshared key (or the interface key) changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUpsert {
    pub public_key: PublicKey,
    pub spec: PeerSpec,
    /// `Some`: set the endpoint; `None`: keep the current (possibly roamed) one.
    pub endpoint: Option<SocketAddr>,
}

/// How the peer table must change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerChanges {
    /// `Some`: the interface's private key changed; `Some(None)`: it was removed (`wg setconf`
    /// of a file without `PrivateKey`): the device has no identity until a key is set.
    pub private_key: Option<Option<SecretKey>>,
    pub upsert: Vec<PeerUpsert>,
    pub remove: Vec<PublicKey>,
}

impl PeerChanges {
    pub fn is_empty(&self) -> bool {
        self.private_key.is_none() && self.upsert.is_empty() && self.remove.is_empty()
    }
}

/// Something to look up in DNS.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lookup {
    /// A `target_fqdn`: every address is used.
    Target(String),
    /// A peer's `endpoint = "host:port"`: the first address is used.
    Endpoint {
        peer: PublicKey,
        host: String,
        port: u16,
    },
}

/// What the shell must do next. Executors decide nothing: they do it and report the result
/// through the matching `handle_*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Add and remove tunnel addresses; report with [`Control::handle_addresses_applied`].
    SetAddresses { add: Vec<IpNet>, remove: Vec<IpNet> },
    /// Set the link's MTU (and bring it up); reported with the addresses.
    SetMtu(u16),
    /// Change the peer table; cannot fail.
    UpdatePeers(PeerChanges),
    /// Bind the WireGuard socket to a new port (0: any); report with [`Control::handle_rebound`].
    Rebind { port: u16, fwmark: Option<u32> },
    /// Put this mark on the WireGuard socket; `src_valid_mark`: let replies to marked IPv4
    /// packets through reverse-path filtering (`net.ipv4.conf.all.src_valid_mark = 1`).
    SetFwmark { mark: u32, src_valid_mark: bool },
    /// Apply a route and policy-rule diff; report with [`Control::handle_routes_applied`].
    ApplyRoutes(PlanDiff),
    /// Resolve, giving up at `deadline`; report with [`Control::handle_resolved`].
    Resolve { lookup: Lookup, deadline: Instant },
    /// Turn forwarding on for these families unless already on, and record that this daemon
    /// needs them (and which it changed) where every tunnelgate of the namespace sees it
    /// ([`crate::core::forwarding`]). Nothing to report.
    EnableForwarding(BTreeSet<Family>),
    /// Replace our rules with this set in one transaction; report with
    /// [`Control::handle_rules_applied`].
    ApplyRules(RuleSet),
    /// Read our installed rules back; report with [`Control::handle_rules_checked`].
    CheckRules,
    /// Remove every rule of ours (teardown).
    RemoveRules,
    /// Teardown of a daemon that needed forwarding for these families: put back to off each
    /// one tunnelgate changed that no other running tunnelgate still needs
    /// ([`crate::core::forwarding::on_stop`] decides, from the shared records).
    RestoreForwarding(BTreeSet<Family>),
}

/// What an executor reports after applying rules.
#[derive(Debug, Clone, PartialEq)]
pub struct RulesReport {
    /// The installed rules as read back, normalized: compared on each drift check.
    pub fingerprint: String,
    pub rule_count: usize,
    pub seconds: f64,
    /// The applied text, for `tunnelgate status`.
    pub text: String,
}

/// Why a configuration was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The result of a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    Applied,
    Unchanged,
}

/// A DNS-named target as status and readiness see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameView {
    pub name: String,
    pub addresses: Vec<IpAddr>,
    pub last_resolved: Option<Instant>,
    pub last_error: Option<String>,
    pub resolutions: u64,
    pub failures: u64,
}

/// Firewall figures for status and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RulesView {
    pub needed: bool,
    /// Whether the rules the current config and answers ask for are installed.
    pub current: bool,
    pub applies: u64,
    pub failures: u64,
    pub rule_count: usize,
    pub last_error: Option<String>,
    pub last_apply_seconds: f64,
    pub text: String,
}

/// Everything the shell publishes for `/readyz`, `/metrics`, `status` and UAPI `get`.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub readiness: Result<(), String>,
    pub rules: RulesView,
    pub names: Vec<NameView>,
    pub reloads: u64,
    pub reload_failures: u64,
    pub listen_port: u16,
    /// The mark the WireGuard socket carries (configured, or chosen for a default route).
    pub fwmark: Option<u32>,
}

/// One apply that can fail and is retried with backoff.
#[derive(Debug, Clone)]
struct Retry {
    backoff: Backoff,
    at: Option<Instant>,
    error: Option<String>,
}

impl Retry {
    fn new(cap: Duration) -> Retry {
        Retry {
            backoff: Backoff::new(APPLY_RETRY_FIRST, cap),
            at: None,
            error: None,
        }
    }

    fn failed(&mut self, error: String, now: Instant) {
        self.at = Some(now + self.backoff.next_delay());
        self.error = Some(error);
    }

    fn succeeded(&mut self) {
        self.backoff.reset();
        self.at = None;
        self.error = None;
    }

    /// Whether an attempt may start now (never failed, or the backoff has passed).
    fn may_try(&self, now: Instant) -> bool {
        self.at.is_none_or(|at| now >= at)
    }
}

#[derive(Debug, Clone)]
struct Rules {
    applied: Option<RuleSet>,
    fingerprint: String,
    /// The set an executor is applying now.
    in_flight: Option<RuleSet>,
    /// The set of the last failed attempt: the same set waits for the backoff, a new one not.
    failed: Option<RuleSet>,
    checking: bool,
    retry: Retry,
    next_check: Option<Instant>,
    applies: u64,
    failures: u64,
    rule_count: usize,
    last_apply_seconds: f64,
    text: String,
    /// Families this daemon needs forwarding for (asked for with EnableForwarding).
    forwarding_requested: BTreeSet<Family>,
}

#[derive(Debug, Clone)]
struct Routes {
    applied: RoutePlan,
    in_flight: Option<RoutePlan>,
    retry: Retry,
}

#[derive(Debug, Clone)]
struct Addresses {
    applied: BTreeSet<IpNet>,
    mtu: Option<u16>,
    in_flight: Option<(BTreeSet<IpNet>, u16)>,
    retry: Retry,
}

#[derive(Debug, Clone)]
struct EndpointLookup {
    host: String,
    port: u16,
    in_flight: bool,
    retry: Retry,
}

/// What the daemon manages besides the tunnel itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `tunnelgate run`: the configuration's addresses, MTU, routes for every allowed IP,
    /// firewall rules and forwarding.
    Daemon,
    /// `tunnelgate userspace` (a drop-in for wireguard-go): the TUN device and WireGuard only.
    /// No addresses, routes or rules: wg-quick or the administrator installs them. The
    /// device starts without a private key, as wireguard-go does.
    Userspace,
}

/// The control core of one interface. See the module documentation for the call order.
#[derive(Debug)]
pub struct Control {
    mode: Mode,
    config: Config,
    listen_port: u16,
    health_port: Option<u16>,
    /// `None` after UAPI removed it (as wireguard-go allows).
    private_key: Option<SecretKey>,
    fwmark: Option<u32>,
    socket_mark: Option<u32>,
    peers: BTreeMap<PublicKey, PeerSpec>,
    endpoints: BTreeMap<PublicKey, EndpointLookup>,
    addresses: Addresses,
    routes: Routes,
    rules: Rules,
    dns: Schedule,
    names: BTreeMap<String, NameView>,
    actions: VecDeque<Action>,
    reloads: u64,
    reload_failures: u64,
    stopping: bool,
}

impl Control {
    /// The core for a daemon whose WireGuard socket is bound to `listen_port` and whose health
    /// endpoint (if any) listens on `health_port`. Its first actions bring everything up.
    pub fn new(config: Config, listen_port: u16, health_port: Option<u16>, now: Instant) -> Self {
        Control::with_mode(Mode::Daemon, config, listen_port, health_port, now)
    }

    /// [`Control::new`] in `mode`. In [`Mode::Userspace`] the configuration only names the
    /// interface (and its key is ignored: the device starts without one).
    pub fn with_mode(
        mode: Mode,
        config: Config,
        listen_port: u16,
        health_port: Option<u16>,
        now: Instant,
    ) -> Self {
        let userspace = mode == Mode::Userspace;
        let mut control = Control {
            mode,
            listen_port,
            health_port,
            private_key: (!userspace).then(|| config.interface.private_key.clone()),
            fwmark: config.interface.fwmark,
            socket_mark: config.interface.fwmark,
            peers: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            addresses: Addresses {
                applied: BTreeSet::new(),
                mtu: None,
                in_flight: None,
                retry: Retry::new(APPLY_RETRY_CAP),
            },
            routes: Routes {
                applied: RoutePlan::default(),
                in_flight: None,
                retry: Retry::new(APPLY_RETRY_CAP),
            },
            rules: Rules {
                applied: None,
                fingerprint: String::new(),
                in_flight: None,
                failed: None,
                checking: false,
                retry: Retry::new(APPLY_RETRY_CAP),
                next_check: config.firewall.repair_interval.map(|every| now + every),
                applies: 0,
                failures: 0,
                rule_count: 0,
                last_apply_seconds: 0.0,
                text: String::new(),
                forwarding_requested: BTreeSet::new(),
            },
            dns: Schedule::new(config.dns.reresolve_interval),
            names: BTreeMap::new(),
            actions: VecDeque::new(),
            reloads: 0,
            reload_failures: 0,
            stopping: false,
            config: config.clone(),
        };
        let peers = peers_of(&config);
        control.set_peers(peers, None, &config, now);
        control.track_names(now);
        control.step(now);
        control
    }

    // --- A. getters ----------------------------------------------------------------------

    /// The running (desired) configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Ok when everything the configuration asks for is installed and every name resolved.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(e) = &self.addresses.retry.error {
            return Err(format!("addresses: {e}"));
        }
        if let Some(e) = &self.routes.retry.error {
            return Err(format!("routes: {e}"));
        }
        if self.rules_needed() {
            if let Some(e) = &self.rules.retry.error {
                return Err(format!("rules: {e}"));
            }
            if self.rules.applied.is_none() {
                return Err("rules: not applied yet".into());
            }
        }
        if let Some(n) = self.names.values().find(|n| n.last_resolved.is_none()) {
            let why = n.last_error.as_deref().unwrap_or("not resolved yet");
            return Err(format!("dns: {}: {why}", n.name));
        }
        if self.rules_needed() && self.rules.applied.as_ref() != Some(&self.desired_rules()) {
            return Err("rules: the current config and DNS answers are not applied yet".into());
        }
        Ok(())
    }

    pub fn view(&self) -> View {
        let rules_current =
            self.rules_needed() && self.rules.applied.as_ref() == Some(&self.desired_rules());
        View {
            readiness: self.readiness(),
            rules: RulesView {
                needed: self.rules_needed(),
                current: rules_current,
                applies: self.rules.applies,
                failures: self.rules.failures,
                rule_count: self.rules.rule_count,
                last_error: self.rules.retry.error.clone(),
                last_apply_seconds: self.rules.last_apply_seconds,
                text: self.rules.text.clone(),
            },
            names: self.names.values().cloned().collect(),
            reloads: self.reloads,
            reload_failures: self.reload_failures,
            listen_port: self.listen_port,
            fwmark: self.effective_fwmark(),
        }
    }

    /// Why the start must be abandoned: an address, route or rule apply failed while bringing
    /// the tunnel up (names still resolving are not a reason; readiness waits for them).
    pub fn start_failure(&self) -> Option<String> {
        let failed = [
            ("addresses", &self.addresses.retry.error),
            ("routes", &self.routes.retry.error),
            ("rules", &self.rules.retry.error),
        ];
        failed
            .into_iter()
            .find_map(|(what, e)| e.as_ref().map(|e| format!("{what}: {e}")))
    }

    // --- B. inputs -------------------------------------------------------------------------

    /// A configuration file was read and validated: take it, or refuse it and keep running
    /// the old one. A refusal changes nothing. Every reload taken counts, a no-op one too.
    pub fn handle_config_loaded(&mut self, new: Config, now: Instant) -> Result<Reload, Refused> {
        if new == self.config {
            self.reloads += 1;
            return Ok(Reload::Unchanged);
        }
        if new.interface.name != self.config.interface.name {
            self.reload_failures += 1;
            return Err(Refused(format!(
                "interface.name cannot change on reload (\"{}\" -> \"{}\"): restart the daemon",
                self.config.interface.name, new.interface.name
            )));
        }
        let old = std::mem::replace(&mut self.config, new.clone());
        if new.interface.listen_port != old.interface.listen_port {
            self.actions.push_back(Action::Rebind {
                port: new.interface.listen_port,
                fwmark: new.interface.fwmark.or(self.socket_mark),
            });
        }
        self.fwmark = new.interface.fwmark;
        let key = (Some(&new.interface.private_key) != self.private_key.as_ref())
            .then(|| Some(new.interface.private_key.clone()));
        self.set_peers(peers_of(&new), key, &old, now);
        self.dns.set_interval(new.dns.reresolve_interval);
        self.track_names(now);
        if new.firewall.repair_interval != old.firewall.repair_interval {
            self.rules.next_check = new.firewall.repair_interval.map(|every| now + every);
        }
        self.reloads += 1;
        self.step(now);
        Ok(Reload::Applied)
    }

    /// A configuration file could not be read or is invalid: counted, nothing else changes.
    pub fn handle_config_invalid(&mut self) {
        self.reload_failures += 1;
    }

    /// The outcome of a [`Action::Resolve`].
    pub fn handle_resolved(
        &mut self,
        lookup: Lookup,
        result: Result<Vec<IpAddr>, String>,
        now: Instant,
    ) {
        match lookup {
            Lookup::Target(name) => self.target_resolved(&name, result, now),
            Lookup::Endpoint { peer, host, port } => {
                self.endpoint_resolved(peer, &host, port, result, now)
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::SetAddresses`] (and the [`Action::SetMtu`] before it).
    pub fn handle_addresses_applied(&mut self, result: Result<(), String>, now: Instant) {
        let Some((addresses, mtu)) = self.addresses.in_flight.take() else {
            return;
        };
        match result {
            Ok(()) => {
                self.addresses.applied = addresses;
                self.addresses.mtu = Some(mtu);
                self.addresses.retry.succeeded();
            }
            Err(e) => {
                tracing::error!(error = %e, "Address change failed; retrying");
                self.addresses.retry.failed(e, now);
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::ApplyRoutes`].
    pub fn handle_routes_applied(&mut self, result: Result<(), String>, now: Instant) {
        let Some(plan) = self.routes.in_flight.take() else {
            return;
        };
        match result {
            Ok(()) => {
                self.routes.applied = plan;
                self.routes.retry.succeeded();
            }
            Err(e) => {
                // Adds and removes are idempotent, so a partly applied diff is simply
                // computed again from the old state and retried.
                tracing::error!(error = %e, "Route update failed; retrying");
                self.routes.retry.failed(e, now);
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::Rebind`]: the port actually bound, or why not.
    pub fn handle_rebound(&mut self, result: Result<u16, String>, now: Instant) {
        match result {
            Ok(port) => self.listen_port = port,
            Err(e) => {
                tracing::error!(error = %e, "Cannot bind the new listen port; keeping the old one")
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::ApplyRules`].
    pub fn handle_rules_applied(&mut self, result: Result<RulesReport, String>, now: Instant) {
        let Some(set) = self.rules.in_flight.take() else {
            return;
        };
        self.rules.applies += 1;
        match result {
            Ok(report) => {
                tracing::info!(
                    lines = report.rule_count,
                    seconds = report.seconds,
                    "Rules applied"
                );
                self.rules.applied = Some(set);
                self.rules.failed = None;
                self.rules.fingerprint = report.fingerprint;
                self.rules.rule_count = report.rule_count;
                self.rules.last_apply_seconds = report.seconds;
                self.rules.text = report.text;
                self.rules.retry.succeeded();
            }
            Err(e) => {
                tracing::error!(error = %e, "Rule apply failed; the previous rules stay in place");
                self.rules.failures += 1;
                self.rules.failed = Some(set);
                self.rules.retry.failed(e, now);
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::CheckRules`]: what is installed now, normalized.
    pub fn handle_rules_checked(&mut self, result: Result<String, String>, now: Instant) {
        if !self.rules.checking {
            return;
        }
        self.rules.checking = false;
        match result {
            Ok(installed) if installed == self.rules.fingerprint => {}
            Ok(_) => {
                tracing::warn!("Installed rules drifted from the applied ones; repairing");
                // Forget what was applied: the next step applies the desired set again.
                self.rules.applied = None;
            }
            Err(e) => {
                self.rules.failures += 1;
                tracing::error!(error = %e, "Cannot read the installed rules back");
                self.rules.retry.failed(e, now);
            }
        }
        self.step(now);
    }

    /// A timer set by [`Control::poll_timeout`] fired (or any other wake-up).
    pub fn handle_timeout(&mut self, now: Instant) {
        if let (Some(at), Some(every)) =
            (self.rules.next_check, self.config.firewall.repair_interval)
        {
            if now >= at {
                self.rules.next_check = Some(now + every);
                if self.rules_needed()
                    && self.rules.applied.is_some()
                    && self.rules.in_flight.is_none()
                    && !self.rules.checking
                {
                    self.rules.checking = true;
                    self.actions.push_back(Action::CheckRules);
                }
            }
        }
        self.step(now);
    }

    // --- C. commands -----------------------------------------------------------------------

    /// A UAPI `set` with wireguard-go's semantics. Refused updates change nothing.
    pub fn handle_device_update(
        &mut self,
        update: &DeviceUpdate,
        now: Instant,
    ) -> Result<(), UapiError> {
        let mut model = self.device_model();
        model.apply(update);
        if let Some(port) = update.listen_port {
            if port != self.listen_port || port == 0 {
                self.actions.push_back(Action::Rebind {
                    port,
                    fwmark: self.effective_fwmark(),
                });
            }
        }
        if let Some(mark) = update.fwmark {
            self.fwmark = mark;
        }
        let explicit: BTreeMap<PublicKey, SocketAddr> = update
            .peers
            .iter()
            .filter_map(|p| p.endpoint.map(|e| (p.public_key, e)))
            .collect();
        let desired: BTreeMap<PublicKey, (PeerSpec, Option<SocketAddr>)> = model
            .peers
            .iter()
            .map(|p| {
                let spec = PeerSpec {
                    preshared_key: p.preshared_key.clone(),
                    persistent_keepalive: p.persistent_keepalive.filter(|s| *s > 0),
                    allowed_ips: p.allowed_ips.iter().map(IpNet::trunc).collect(),
                };
                (p.public_key, (spec, explicit.get(&p.public_key).copied()))
            })
            .collect();
        // No key (removed, as `wg setconf` of a file without one does) is a state of its own:
        // the device keeps its peers and simply has no identity until a key is set.
        let key = (model.private_key != self.private_key).then(|| model.private_key.clone());
        // An endpoint set over UAPI replaces a configured name still being looked up.
        for k in explicit.keys() {
            self.endpoints.remove(k);
        }
        self.apply_peers(desired, key);
        self.step(now);
        Ok(())
    }

    /// Stops every timer and returns what must be undone, in order: rules, forwarding, then
    /// policy rules and routes outside the main table (the device takes the rest with it).
    pub fn teardown(&mut self) -> Vec<Action> {
        self.stopping = true;
        self.actions.clear();
        let mut out = Vec::new();
        if self.rules.applied.is_some()
            || self.rules.failed.is_some()
            || self.rules.in_flight.is_some()
        {
            out.push(Action::RemoveRules);
        }
        // Also when this run changed nothing: another daemon that stopped earlier may have
        // left a change for the last one to put back.
        if !self.rules.forwarding_requested.is_empty() {
            out.push(Action::RestoreForwarding(
                self.rules.forwarding_requested.clone(),
            ));
        }
        let mut applied = self.routes.applied.clone();
        if let Some(in_flight) = &self.routes.in_flight {
            // A half-applied diff: remove whatever either state may have installed.
            applied.routes.extend(in_flight.routes.iter().copied());
            applied.rules.extend(in_flight.rules.iter().copied());
        }
        applied.routes.retain(|r| r.table != routes::MAIN_TABLE);
        let gone = routes::diff(&applied, &RoutePlan::default());
        if !gone.is_empty() {
            out.push(Action::ApplyRoutes(gone));
        }
        out
    }

    // --- D. outputs ------------------------------------------------------------------------

    /// The next thing to do. Poll again after every `handle_*` call.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Control::handle_timeout`] must be called next, if ever.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.stopping {
            return None;
        }
        let mut at: Vec<Instant> = Vec::new();
        at.extend(self.dns.next_deadline());
        at.extend(self.rules.retry.at.filter(|_| self.rules.failed.is_some()));
        at.extend(self.routes.retry.at);
        at.extend(self.addresses.retry.at);
        at.extend(
            self.endpoints
                .values()
                .filter(|e| !e.in_flight)
                .filter_map(|e| e.retry.at),
        );
        if self.rules_needed() {
            at.extend(self.rules.next_check);
        }
        at.into_iter().min()
    }

    // --- decisions -------------------------------------------------------------------------

    fn rules_needed(&self) -> bool {
        self.mode == Mode::Daemon && firewall_needed(&self.config)
    }

    fn desired_rules(&self) -> RuleSet {
        let facts = RuntimeFacts {
            wg_port: self.listen_port,
            health_port: self.health_port,
        };
        desired(&self.config, &facts, &self.dns.resolved())
    }

    /// The mark on the WireGuard socket: the configured one, else the one routes chose.
    fn effective_fwmark(&self) -> Option<u32> {
        self.fwmark.or(self.routes.applied.fwmark)
    }

    fn desired_routes(&self) -> RoutePlan {
        if self.mode == Mode::Userspace {
            // wg-quick routes the allowed IPs itself (and sets the fwmark for a default route).
            return routes::plan(&[], self.fwmark);
        }
        let nets: Vec<IpNet> = self
            .peers
            .values()
            .flat_map(|p| p.allowed_ips.iter().copied())
            .collect();
        routes::plan(&nets, self.fwmark)
    }

    /// Everything that is due now and not in flight: the one place that emits applies.
    fn step(&mut self, now: Instant) {
        if self.stopping {
            return;
        }
        self.step_addresses(now);
        self.step_routes(now);
        self.step_resolutions(now);
        self.step_rules(now);
    }

    fn step_addresses(&mut self, now: Instant) {
        if self.mode == Mode::Userspace
            || self.addresses.in_flight.is_some()
            || !self.addresses.retry.may_try(now)
        {
            return;
        }
        let want: BTreeSet<IpNet> = self.config.interface.addresses.iter().copied().collect();
        let mtu = self.config.interface.mtu;
        if want == self.addresses.applied && Some(mtu) == self.addresses.mtu {
            return;
        }
        if Some(mtu) != self.addresses.mtu {
            self.actions.push_back(Action::SetMtu(mtu));
        }
        let add: Vec<IpNet> = want.difference(&self.addresses.applied).copied().collect();
        let remove: Vec<IpNet> = self.addresses.applied.difference(&want).copied().collect();
        self.actions.push_back(Action::SetAddresses { add, remove });
        self.addresses.in_flight = Some((want, mtu));
    }

    fn step_routes(&mut self, now: Instant) {
        if self.routes.in_flight.is_some() || !self.routes.retry.may_try(now) {
            return;
        }
        let want = self.desired_routes();
        let diff = routes::diff(&self.routes.applied, &want);
        let mark = want.fwmark;
        if let Some(m) = mark.filter(|m| Some(*m) != self.socket_mark) {
            self.socket_mark = Some(m);
            self.actions.push_back(Action::SetFwmark {
                mark: m,
                src_valid_mark: want.rules.iter().any(|r| !r.v6),
            });
        }
        if diff.is_empty() {
            self.routes.applied.fwmark = want.fwmark;
            return;
        }
        self.actions.push_back(Action::ApplyRoutes(diff));
        self.routes.in_flight = Some(want);
    }

    fn step_resolutions(&mut self, now: Instant) {
        let in_flight =
            self.dns.in_flight() + self.endpoints.values().filter(|e| e.in_flight).count();
        let room = MAX_CONCURRENT_RESOLUTIONS.saturating_sub(in_flight);
        let deadline = now + RESOLVE_TIMEOUT;
        let mut started = 0;
        for (peer, lookup) in self.endpoints.iter_mut() {
            if started >= room {
                break;
            }
            if !lookup.in_flight && lookup.retry.may_try(now) {
                lookup.in_flight = true;
                started += 1;
                self.actions.push_back(Action::Resolve {
                    lookup: Lookup::Endpoint {
                        peer: *peer,
                        host: lookup.host.clone(),
                        port: lookup.port,
                    },
                    deadline,
                });
            }
        }
        for name in self.dns.start_due(now, room - started) {
            self.actions.push_back(Action::Resolve {
                lookup: Lookup::Target(name),
                deadline,
            });
        }
    }

    fn step_rules(&mut self, now: Instant) {
        if !self.rules_needed() || self.rules.in_flight.is_some() || self.rules.checking {
            return;
        }
        let want = self.desired_rules();
        if self.rules.applied.as_ref() == Some(&want) {
            return;
        }
        // The same set that just failed waits for its backoff; a different one (a reload,
        // a new answer) may fix the failure, so it is tried at once.
        if self.rules.failed.as_ref() == Some(&want) && !self.rules.retry.may_try(now) {
            return;
        }
        let families = forwarding_families(&want);
        if !families.is_subset(&self.rules.forwarding_requested) {
            self.rules
                .forwarding_requested
                .extend(families.iter().copied());
            self.actions.push_back(Action::EnableForwarding(families));
        }
        self.actions.push_back(Action::ApplyRules(want.clone()));
        self.rules.in_flight = Some(want);
    }

    fn track_names(&mut self, now: Instant) {
        let names = self.config.fqdn_targets();
        self.dns.set_names(&names, now);
        self.names.retain(|n, _| names.contains(n));
        for name in names {
            self.names.entry(name.clone()).or_insert_with(|| NameView {
                name,
                ..NameView::default()
            });
        }
    }

    fn target_resolved(&mut self, name: &str, result: Result<Vec<IpAddr>, String>, now: Instant) {
        let error = result.as_ref().err().cloned();
        let outcome = self.dns.on_result(name, result, now);
        let Some(view) = self.names.get_mut(name) else {
            return; // the name left the configuration while it was being resolved
        };
        view.resolutions += 1;
        match outcome {
            Outcome::Changed { old, new } => {
                tracing::info!(name, ?old, ?new, "Name re-resolved");
            }
            Outcome::Unchanged => {}
            Outcome::Failed { retry_in } => {
                view.failures += 1;
                let error = error.as_deref().unwrap_or("no addresses in the answer");
                tracing::warn!(
                    name,
                    error,
                    retry_in_secs = retry_in.as_secs(),
                    "Resolution failed; keeping the last good addresses"
                );
            }
        }
        if let Some(state) = self.dns.get(name) {
            view.addresses = state.addresses.clone();
            view.last_error = state.last_error.clone();
            if state.failures == 0 {
                view.last_resolved = Some(now);
            }
        }
    }

    fn endpoint_resolved(
        &mut self,
        peer: PublicKey,
        host: &str,
        port: u16,
        result: Result<Vec<IpAddr>, String>,
        now: Instant,
    ) {
        let Some(lookup) = self.endpoints.get_mut(&peer) else {
            return;
        };
        if lookup.host != host || lookup.port != port {
            return; // the configured endpoint changed while this lookup ran
        }
        lookup.in_flight = false;
        match result.map(|a| a.first().copied()) {
            Ok(Some(ip)) => {
                self.endpoints.remove(&peer);
                if let Some(spec) = self.peers.get(&peer) {
                    self.actions.push_back(Action::UpdatePeers(PeerChanges {
                        private_key: None,
                        upsert: vec![PeerUpsert {
                            public_key: peer,
                            spec: spec.clone(),
                            endpoint: Some(SocketAddr::new(ip, port)),
                        }],
                        remove: Vec::new(),
                    }));
                }
            }
            Ok(None) => lookup
                .retry
                .failed("no addresses in the answer".into(), now),
            Err(e) => {
                tracing::warn!(host, error = %e, "Cannot resolve peer endpoint; retrying, and waiting for the peer to connect");
                lookup.retry.failed(e, now);
            }
        }
    }

    /// The configuration's peers replace the current ones (the file wins, like `wg syncconf`).
    /// A configured endpoint is set only where it differs from `previous`, so a reload keeps
    /// where a peer roamed to.
    fn set_peers(
        &mut self,
        desired: BTreeMap<PublicKey, (PeerSpec, Option<Endpoint>)>,
        key: Option<Option<SecretKey>>,
        previous: &Config,
        _now: Instant,
    ) {
        let first = self.peers.is_empty() && key.is_none();
        let mut with_addrs = BTreeMap::new();
        for (public_key, (spec, endpoint)) in desired {
            let before = previous
                .peers
                .iter()
                .find(|p| p.public_key == public_key)
                .and_then(|p| p.endpoint.clone());
            let changed = first || !self.peers.contains_key(&public_key) || before != endpoint;
            let mut addr = None;
            if changed {
                self.endpoints.remove(&public_key);
                match endpoint {
                    Some(Endpoint::Addr(a)) => addr = Some(a),
                    Some(Endpoint::Host { host, port }) => {
                        self.endpoints.insert(
                            public_key,
                            EndpointLookup {
                                host,
                                port,
                                in_flight: false,
                                retry: Retry::new(ENDPOINT_RETRY_CAP),
                            },
                        );
                    }
                    None => {}
                }
            }
            with_addrs.insert(public_key, (spec, addr));
        }
        self.endpoints.retain(|k, _| with_addrs.contains_key(k));
        self.apply_peers(with_addrs, key);
    }

    /// Diffs `desired` against the current peers and queues the change.
    fn apply_peers(
        &mut self,
        desired: BTreeMap<PublicKey, (PeerSpec, Option<SocketAddr>)>,
        key: Option<Option<SecretKey>>,
    ) {
        let mut changes = PeerChanges {
            private_key: key.clone(),
            ..PeerChanges::default()
        };
        for (public_key, (spec, endpoint)) in &desired {
            let same = self.peers.get(public_key) == Some(spec);
            if !same || endpoint.is_some() || key.is_some() {
                changes.upsert.push(PeerUpsert {
                    public_key: *public_key,
                    spec: spec.clone(),
                    endpoint: *endpoint,
                });
            }
        }
        changes.remove = self
            .peers
            .keys()
            .filter(|k| !desired.contains_key(k))
            .copied()
            .collect();
        if let Some(k) = key {
            self.private_key = k;
        }
        self.peers = desired.into_iter().map(|(k, (s, _))| (k, s)).collect();
        if !changes.is_empty() {
            self.actions.push_back(Action::UpdatePeers(changes));
        }
    }

    /// The device as UAPI sees it, from the core's side (no live endpoints or counters).
    fn device_model(&self) -> DeviceSnapshot {
        DeviceSnapshot {
            private_key: self.private_key.clone(),
            listen_port: self.listen_port,
            fwmark: self.effective_fwmark(),
            peers: self
                .peers
                .iter()
                .map(|(k, spec)| PeerSnapshot {
                    preshared_key: spec.preshared_key.clone(),
                    persistent_keepalive: spec.persistent_keepalive,
                    allowed_ips: spec.allowed_ips.clone(),
                    ..PeerSnapshot::new(*k)
                })
                .collect(),
        }
    }
}

/// The peers a configuration asks for, with their configured endpoints.
fn peers_of(config: &Config) -> BTreeMap<PublicKey, (PeerSpec, Option<Endpoint>)> {
    config
        .peers
        .iter()
        .map(|p| {
            (
                p.public_key,
                (
                    PeerSpec {
                        preshared_key: p.preshared_key.clone(),
                        persistent_keepalive: p.persistent_keepalive,
                        allowed_ips: p.allowed_ips.clone(),
                    },
                    p.endpoint.clone(),
                ),
            )
        })
        .collect()
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

#[cfg(test)]
mod tests;
