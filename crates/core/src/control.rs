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

use crate::backoff::Backoff;
use crate::config::{Config, Endpoint, IpNet, PublicKey, SecretKey};
use crate::dns::{Outcome, Schedule, MAX_CONCURRENT_RESOLUTIONS, RESOLVE_TIMEOUT};
use crate::routes::{self, PlanDiff, RoutePlan};
use crate::rules::desired::{beyond_loopback, desired, forwarding_configured, RuntimeFacts};
use crate::rules::{Family, RuleSet};
use crate::uapi::{DeviceUpdate, UapiError};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod boundary;
mod configured;
mod decide;
mod peers;

pub use boundary::{
    Action, Executed, Lookup, NameView, PeerChanges, PeerSpec, PeerUpsert, Refused, Reload,
    RulesReport, RulesView, ServiceView, SessionEffect, View,
};

/// First retry after a failed apply of rules, routes or addresses; doubles per failure.
const APPLY_RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest wait between retries of a failing apply: a broken `nft` is retried twice a minute.
const APPLY_RETRY_CAP: Duration = Duration::from_secs(30);
/// Longest wait between retries of an endpoint name that does not resolve.
const ENDPOINT_RETRY_CAP: Duration = Duration::from_secs(300);
/// Longest wait between two reads of a forwarding sysctl that was off and could not be turned
/// on: it is one file read, and a pod whose sysctl is set from outside should be ready soon.
const FORWARDING_RETRY_CAP: Duration = Duration::from_secs(10);

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
    /// The installed rules as read back, normalized, after the last apply: each drift check
    /// compares with it. `None` right after an apply, until the read-back that takes it.
    fingerprint: Option<String>,
    /// The set an executor is applying now.
    in_flight: Option<RuleSet>,
    /// The set of the last failed attempt: the same set waits for the backoff, a new one not.
    failed: Option<RuleSet>,
    /// A [`Action::RemoveRules`] is in flight (the configuration needs no rules any more).
    removing: bool,
    /// The last removal failed: whatever is installed is unknown, and the removal is retried
    /// after the backoff.
    removal_failed: bool,
    /// A daemon's first step owes a [`Action::SweepRules`] if it needs no rule (an apply
    /// replaces whatever an earlier run left, a plain tunnel would otherwise keep it).
    sweep_pending: bool,
    checking: bool,
    retry: Retry,
    next_check: Option<Instant>,
    applies: u64,
    failures: u64,
    rule_count: usize,
    last_apply_seconds: f64,
    text: String,
    /// Families this daemon needs forwarding for (asked for with EnableForwarding, given up
    /// with RestoreForwarding).
    forwarding_requested: BTreeSet<Family>,
    /// Whether this run ever asked for forwarding: its record may exist even when it needs no
    /// family any more, so the stop still reads the records.
    forwarding_recorded: bool,
    /// Requested families whose sysctl is off and could not be turned on (read-only
    /// `/proc/sys` in a container), with the error: not ready until they are on, and asked
    /// again after [`FORWARDING_RETRY_CAP`] at most.
    forwarding_unavailable: BTreeMap<Family, String>,
    forwarding_retry: Retry,
    /// EnableForwarding actions not reported yet.
    forwarding_in_flight: u32,
}

/// The health endpoint's listener: what is bound, and a move to another address under way.
#[derive(Debug, Clone)]
struct HealthListener {
    /// The `health.listen` the current listener was bound for (`None`: no listener).
    requested: Option<SocketAddr>,
    /// The address actually bound (the port the kernel chose for port 0).
    bound: Option<SocketAddr>,
    /// A [`Action::ServeHealth`] is in flight, for this `health.listen`.
    in_flight: Option<Option<SocketAddr>>,
    /// The `health.listen` whose bind failed: not tried again until the file asks for
    /// another one.
    failed: Option<Option<SocketAddr>>,
}

#[derive(Debug, Clone)]
struct Routes {
    applied: RoutePlan,
    /// How many peers route each network (one, but for a moment while UAPI moves it): the
    /// routes wanted, kept as peers change rather than recomputed from every peer.
    desired: BTreeMap<IpNet, u32>,
    /// Networks whose wanted route may differ from the applied one: the next diff looks at
    /// these only.
    dirty: BTreeSet<IpNet>,
    /// The table the default routes were last diffed for (`interface.fwmark`, or 51820).
    default_table: u32,
    in_flight: Option<RoutesInFlight>,
    retry: Retry,
}

/// A route diff being applied: the networks it covers are dirty again if it fails.
#[derive(Debug, Clone)]
struct RoutesInFlight {
    diff: PlanDiff,
    nets: BTreeSet<IpNet>,
    fwmark: Option<u32>,
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

/// What runs: `tunnelgate run` or the wireguard-go drop-in. The one mode type of the core and
/// the shell: each asks the mode what it has instead of branching on it.
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

/// The name under which the binary behaves as `tunnelgate userspace` (a symlink that wg-quick
/// runs through `WG_QUICK_USERSPACE_IMPLEMENTATION`).
pub const WG_PROGRAM: &str = "tunnelgate-wg";

impl Mode {
    /// The program name its messages carry.
    pub fn program(self) -> &'static str {
        match self {
            Mode::Daemon => "tunnelgate",
            Mode::Userspace => WG_PROGRAM,
        }
    }

    /// A configuration file, polled for changes and reloaded on SIGHUP and `tunnelgate
    /// reload`. Without one, `wg setconf` is the way to change the device.
    pub fn has_config_file(self) -> bool {
        self == Mode::Daemon
    }

    /// systemd is told READY, RELOADING and STOPPING (`Type=notify` units run `tunnelgate
    /// run`); the watchdog is served in both modes when systemd asks for it.
    pub fn notifies_systemd(self) -> bool {
        self == Mode::Daemon
    }

    /// The device starts with the configuration's private key (the drop-in starts without one).
    pub fn starts_with_key(self) -> bool {
        self == Mode::Daemon
    }

    /// The host's addresses, routes, firewall rules and forwarding sysctls are installed here
    /// (in the drop-in, wg-quick or the administrator installs them).
    pub fn installs_host_state(self) -> bool {
        self == Mode::Daemon
    }

    /// Removing its UAPI socket stops the process, and the interface being deleted is a
    /// normal exit (wireguard-go's contract); the failure may also be said on stderr, since
    /// the drop-in's log may be gone with its terminal.
    pub fn follows_the_device(self) -> bool {
        self == Mode::Userspace
    }
}

/// The control core of one interface. See the module documentation for the call order.
#[derive(Debug)]
pub struct Control {
    mode: Mode,
    /// The running configuration without its `[[peer]]`s: those are `peers` (as the file or
    /// UAPI last set them), and `configured` is what the file gave. Shared with what the shell
    /// publishes: a turn of the event loop compares pointers.
    config: Arc<Config>,
    configured: configured::ConfiguredPeers,
    listen_port: u16,
    health: HealthListener,
    /// `None` after UAPI removed it (as wireguard-go allows).
    private_key: Option<SecretKey>,
    fwmark: Option<u32>,
    socket_mark: Option<u32>,
    /// Shared with the data plane's peer table (each [`PeerUpsert`] hands it the same `Arc`):
    /// one copy of each spec, not one per side.
    peers: BTreeMap<PublicKey, std::sync::Arc<PeerSpec>>,
    /// The peer each allowed IP belongs to (each belongs to one): UAPI moves a prefix from
    /// its owner without a scan of every peer.
    owners: BTreeMap<IpNet, PublicKey>,
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
    /// endpoint (if any) listens on `health_bound`, bound for `config.health.listen`. Its first
    /// actions bring everything up.
    pub fn new(
        config: Config,
        listen_port: u16,
        health_bound: Option<SocketAddr>,
        now: Instant,
    ) -> Self {
        Control::with_mode(Mode::Daemon, config, listen_port, health_bound, now)
    }

    /// The core of the wireguard-go drop-in for device `name` ([`Mode::Userspace`]): no file,
    /// so no configuration but the name ([`Config::device_only`]); the device starts without a
    /// key, peers or addresses until UAPI sets them.
    pub fn userspace(
        name: &str,
        listen_port: u16,
        health_bound: Option<SocketAddr>,
        now: Instant,
    ) -> Result<Self, crate::config::ConfigError> {
        let config = Config::device_only(name)?;
        Ok(Control::with_mode(
            Mode::Userspace,
            config,
            listen_port,
            health_bound,
            now,
        ))
    }

    /// [`Control::new`] in `mode`. In [`Mode::Userspace`] the configuration only names the
    /// interface (and its key is ignored: the device starts without one).
    pub fn with_mode(
        mode: Mode,
        mut config: Config,
        listen_port: u16,
        health_bound: Option<SocketAddr>,
        now: Instant,
    ) -> Self {
        let peers = std::mem::take(&mut config.peers);
        let config = Arc::new(config);
        let mut control = Control {
            mode,
            listen_port,
            health: HealthListener {
                // The shell bound (or, with `health_bound` None, does not serve) exactly the
                // address the file names: only a later file moves it.
                requested: config.health.listen,
                bound: health_bound,
                in_flight: None,
                failed: None,
            },
            private_key: mode
                .starts_with_key()
                .then(|| config.interface.private_key.clone()),
            fwmark: config.interface.fwmark,
            socket_mark: config.interface.fwmark,
            peers: BTreeMap::new(),
            owners: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            addresses: Addresses {
                applied: BTreeSet::new(),
                mtu: None,
                in_flight: None,
                retry: Retry::new(APPLY_RETRY_CAP),
            },
            routes: Routes {
                applied: RoutePlan::default(),
                desired: BTreeMap::new(),
                dirty: BTreeSet::new(),
                default_table: routes::default_table(config.interface.fwmark),
                in_flight: None,
                retry: Retry::new(APPLY_RETRY_CAP),
            },
            rules: Rules {
                applied: None,
                fingerprint: None,
                in_flight: None,
                failed: None,
                removing: false,
                removal_failed: false,
                sweep_pending: mode.installs_host_state(),
                checking: false,
                retry: Retry::new(APPLY_RETRY_CAP),
                next_check: config.firewall.repair_interval.map(|every| now + every),
                applies: 0,
                failures: 0,
                rule_count: 0,
                last_apply_seconds: 0.0,
                text: String::new(),
                forwarding_requested: BTreeSet::new(),
                forwarding_recorded: false,
                forwarding_unavailable: BTreeMap::new(),
                forwarding_retry: Retry::new(FORWARDING_RETRY_CAP),
                forwarding_in_flight: 0,
            },
            dns: Schedule::new(config.dns.reresolve_interval),
            names: BTreeMap::new(),
            actions: VecDeque::new(),
            reloads: 0,
            reload_failures: 0,
            stopping: false,
            config,
            configured: configured::ConfiguredPeers::default(),
        };
        control.set_peers(peers, None);
        control.track_names(now);
        control.step(now);
        control
    }

    // --- A. getters ----------------------------------------------------------------------

    /// The running (desired) configuration, but for its `[[peer]]`s: the peers are the core's
    /// ([`Control::peer_count`]; the data plane's table has them all), and a configuration is
    /// compared with [`Control::runs`].
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The running configuration, shared: the same pointer until a reload takes another.
    pub fn shared_config(&self) -> Arc<Config> {
        self.config.clone()
    }

    /// Whether `config` is the one running: a reload of it would change nothing.
    pub fn runs(&self, config: &Config) -> bool {
        configured::same_but_peers(config, &self.config) && self.configured.is(&config.peers)
    }

    /// How many peers the interface has (from the file, or as UAPI left them).
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// The `health.listen` the health endpoint is bound for now (`None`: it is off). A new
    /// config file that names another address moves it: the shell reserves that address
    /// before it hands the file over, and refuses the reload if it cannot.
    pub fn health_requested(&self) -> Option<SocketAddr> {
        self.health.requested
    }

    /// Ok when everything the configuration asks for is installed and every name resolved,
    /// except names that only a service's rules use under `health.readiness = "per-service"`:
    /// those are that service's problem ([`View::services`]), not this host's.
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
        } else if self.rules_installed() {
            // The old rules still forward what the configuration no longer allows.
            return Err(match &self.rules.retry.error {
                Some(e) => format!("rules: removing the rules no longer needed failed: {e}"),
                None => "rules: the rules no longer needed are not removed yet".into(),
            });
        }
        // Rules that DNAT into a namespace that does not forward drop every packet.
        if let Some(e) = self
            .rules
            .forwarding_retry
            .error
            .as_ref()
            .filter(|_| !self.rules.forwarding_unavailable.is_empty())
        {
            return Err(format!("forwarding: {e}"));
        }
        if let Some(n) = self
            .names
            .values()
            .find(|n| n.holds_readiness && n.last_resolved.is_none())
        {
            let why = n.last_error.as_deref().unwrap_or("not resolved yet");
            return Err(format!("dns: {}: {why}", n.name));
        }
        if self.rules_needed() && self.rules.applied.as_ref() != Some(&self.desired_rules()) {
            return Err("rules: the current config and DNS answers are not applied yet".into());
        }
        Ok(())
    }

    pub fn view(&self) -> View {
        // With no rules needed, "current" means none of ours is installed.
        let rules_current = if self.rules_needed() {
            self.rules.applied.as_ref() == Some(&self.desired_rules())
        } else {
            !self.rules_installed()
        };
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
            services: self.service_views(),
            reloads: self.reloads,
            reload_failures: self.reload_failures,
            listen_port: self.listen_port,
            fwmark: self.effective_fwmark(),
        }
    }

    /// Every `service` label of the rules with its names, and which of them never resolved.
    fn service_views(&self) -> Vec<ServiceView> {
        let mut services: BTreeMap<&str, ServiceView> = BTreeMap::new();
        for fwd in self.config.ingress.iter().chain(&self.config.egress) {
            if let Some(label) = &fwd.service {
                services.entry(label).or_insert_with(|| ServiceView {
                    service: label.clone(),
                    ..ServiceView::default()
                });
            }
        }
        for n in self.names.values() {
            for label in &n.services {
                if let Some(view) = services.get_mut(label.as_str()) {
                    view.names.push(n.name.clone());
                    if n.last_resolved.is_none() {
                        view.unresolved.push(n.name.clone());
                    }
                }
            }
        }
        services.into_values().collect()
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
    pub fn handle_config_loaded(
        &mut self,
        mut new: Config,
        now: Instant,
    ) -> Result<Reload, Refused> {
        if self.runs(&new) {
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
        if new.interface.workers != self.config.interface.workers {
            self.reload_failures += 1;
            return Err(Refused(format!(
                "interface.workers cannot change on reload ({} -> {}): restart the daemon",
                workers_text(self.config.interface.workers),
                workers_text(new.interface.workers)
            )));
        }
        if new.takeover != self.config.takeover {
            self.reload_failures += 1;
            return Err(Refused(
                "the [takeover] section cannot change on reload: restart the daemon (a restart costs a peer one round trip when its endpoint is known)".to_string(),
            ));
        }
        let peers = std::mem::take(&mut new.peers);
        let old = std::mem::replace(&mut self.config, Arc::new(new));
        let new = self.config.clone();
        if new.interface.listen_port != old.interface.listen_port {
            self.actions.push_back(Action::Rebind {
                port: new.interface.listen_port,
                fwmark: new.interface.fwmark.or(self.socket_mark),
            });
        }
        self.fwmark = new.interface.fwmark;
        let key = (Some(&new.interface.private_key) != self.private_key.as_ref())
            .then(|| Some(new.interface.private_key.clone()));
        self.set_peers(peers, key);
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

    /// What an executor reported, handed to the matching `handle_*` below.
    pub fn handle_executed(&mut self, executed: Executed, now: Instant) {
        match executed {
            Executed::Addresses(r) => self.handle_addresses_applied(r, now),
            Executed::Rebound(r) => self.handle_rebound(r, now),
            Executed::Routes(r) => self.handle_routes_applied(r, now),
            Executed::RulesApplied(r) => self.handle_rules_applied(r, now),
            Executed::RulesChecked(r) => self.handle_rules_checked(r, now),
            Executed::RulesRemoved(r) => self.handle_rules_removed(r, now),
            Executed::RulesSwept(r) => self.handle_rules_swept(r),
            Executed::HealthBound(r) => self.handle_health_bound(r, now),
            Executed::Forwarding(r) => self.handle_forwarding_enabled(r, now),
        }
    }

    /// The outcome of an [`Action::ServeHealth`]: the address now bound (the old listener is
    /// closed), or why the new one could not be bound (the old one keeps serving).
    pub fn handle_health_bound(
        &mut self,
        result: Result<Option<SocketAddr>, String>,
        now: Instant,
    ) {
        let Some(requested) = self.health.in_flight.take() else {
            return;
        };
        match result {
            Ok(bound) => {
                tracing::info!(listen = ?bound, "Health endpoint moved");
                self.health.requested = requested;
                self.health.bound = bound;
                self.health.failed = None;
            }
            Err(e) => {
                tracing::error!(error = %e, "Cannot move the health endpoint; the old listener stays");
                self.health.failed = Some(requested);
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::EnableForwarding`]: `Err` holds each family whose sysctl is
    /// still off, with the error of the write. Not ready until every requested family is on;
    /// the sysctls are read again with backoff, so one turned on from outside is seen.
    pub fn handle_forwarding_enabled(
        &mut self,
        result: Result<(), BTreeMap<Family, String>>,
        now: Instant,
    ) {
        self.rules.forwarding_in_flight = self.rules.forwarding_in_flight.saturating_sub(1);
        let mut missing = result.err().unwrap_or_default();
        missing.retain(|f, _| self.rules.forwarding_requested.contains(f));
        if missing.is_empty() {
            if !self.rules.forwarding_unavailable.is_empty() {
                tracing::info!("IP forwarding is on now");
            }
            self.rules.forwarding_unavailable.clear();
            self.rules.forwarding_retry.succeeded();
        } else {
            let reason =
                crate::forwarding::unavailable_reason(&missing, FORWARDING_RETRY_CAP.as_secs());
            // Once per distinct problem: the retries every few seconds say nothing new.
            if missing != self.rules.forwarding_unavailable {
                tracing::error!(reason = %reason, "Not ready: IP forwarding is off");
            }
            self.rules.forwarding_unavailable = missing;
            self.rules.forwarding_retry.failed(reason, now);
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
        let Some(flight) = self.routes.in_flight.take() else {
            return;
        };
        match result {
            Ok(()) => {
                let (applied, diff) = (&mut self.routes.applied, &flight.diff);
                for r in &diff.remove_routes {
                    applied.routes.remove(r);
                }
                applied.routes.extend(diff.add_routes.iter().copied());
                let size = applied.routes.len();
                if size >= COMPACT_MIN && diff.add_routes.len() * 2 >= size {
                    crate::cost::charge(size);
                    compact(&mut applied.routes);
                }
                for r in &diff.remove_rules {
                    applied.rules.remove(r);
                }
                applied.rules.extend(diff.add_rules.iter().copied());
                applied.fwmark = flight.fwmark;
                self.routes.retry.succeeded();
            }
            Err(e) => {
                // Adds and removes are idempotent, so a partly applied diff is simply
                // computed again from the old state and retried.
                tracing::error!(error = %e, "Route update failed; retrying");
                self.routes.dirty.extend(flight.nets);
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
                tracing::info!(seconds = report.seconds, "Rules applied");
                self.rules.applied = Some(set);
                self.rules.failed = None;
                self.rules.removal_failed = false;
                // The baseline for drift checks is read back next, at once, but as a timer
                // (see `handle_timeout`): not inside the apply a reload waits for (a quarter
                // of a second at 10,000 ports), and never later, so no hand edit slips into it.
                self.rules.fingerprint = None;
                if self.config.firewall.repair_interval.is_some() {
                    self.rules.next_check = Some(now);
                }
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

    /// The outcome of an [`Action::RemoveRules`] asked for because the configuration needs no
    /// rules any more. Success forgets what was applied; a failure is retried with backoff.
    /// (The removal at [`Control::teardown`] is not tracked: nothing follows a stop.)
    pub fn handle_rules_removed(&mut self, result: Result<(), String>, now: Instant) {
        if !self.rules.removing {
            return;
        }
        self.rules.removing = false;
        self.rules.applies += 1;
        match result {
            Ok(()) => {
                tracing::info!("Rules removed: the configuration needs none");
                self.rules.applied = None;
                self.rules.failed = None;
                self.rules.removal_failed = false;
                self.rules.fingerprint = None;
                self.rules.text.clear();
                self.rules.rule_count = 0;
                self.rules.retry.succeeded();
            }
            Err(e) => {
                tracing::error!(error = %e, "Removing the rules no longer needed failed; retrying");
                self.rules.failures += 1;
                // Partly removed, maybe: what is installed is unknown until a removal (or, after
                // a reload back to rules, an apply) succeeds.
                self.rules.applied = None;
                self.rules.removal_failed = true;
                self.rules.retry.failed(e, now);
            }
        }
        self.step(now);
    }

    /// The outcome of an [`Action::SweepRules`]: only logged, since this run installed nothing
    /// the sweep could have touched and readiness does not depend on an earlier run's leftovers.
    pub fn handle_rules_swept(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => tracing::debug!("No rule of an earlier run is left"),
            Err(e) => tracing::warn!(
                error = %e,
                "Could not remove rules an earlier run may have left; the next start that installs rules replaces them"
            ),
        }
    }

    /// The outcome of an [`Action::CheckRules`]: what is installed now, normalized.
    pub fn handle_rules_checked(&mut self, result: Result<String, String>, now: Instant) {
        if !self.rules.checking {
            return;
        }
        self.rules.checking = false;
        match result {
            // The first read-back after an apply is the baseline, unless our rules are not
            // there at all (removed between the apply and the read).
            Ok(installed) if self.rules.fingerprint.is_none() && !installed.is_empty() => {
                self.rules.rule_count = crate::rules::count_installed(&installed);
                self.rules.fingerprint = Some(installed);
            }
            Ok(installed) if self.rules.fingerprint.as_ref() == Some(&installed) => {}
            Ok(_) if self.rules_needed() => {
                tracing::warn!("Installed rules drifted from the applied ones; repairing");
                // Forget what was applied: the next step applies the desired set again.
                self.rules.applied = None;
                self.rules.fingerprint = None;
            }
            // A reload to a config without rules while the check ran: the next step removes
            // them whatever they look like now.
            Ok(_) => {}
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

    /// A UAPI `set` with wireguard-go's semantics, in time linear in the peers it names (a
    /// `replace_peers` names them all). Refused updates change nothing.
    pub fn handle_device_update(
        &mut self,
        update: &DeviceUpdate,
        now: Instant,
    ) -> Result<(), UapiError> {
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
        let new_key = match &update.private_key {
            Some(key) => key.clone(),
            None => self.private_key.clone(),
        };
        let own = new_key.as_ref().map(SecretKey::public_key);
        let mut staged = peers::Staged::new(self, update.replace_peers);
        // wireguard-go drops a peer whose key is the device's new public key.
        if let (Some(_), Some(own)) = (&update.private_key, own) {
            staged.remove(own);
        }
        for change in update.peers.iter().filter(|c| Some(c.public_key) != own) {
            staged.apply(change);
        }
        let (staged, cleared) = staged.into_peers();
        let explicit: BTreeMap<PublicKey, SocketAddr> = update
            .peers
            .iter()
            .filter(|p| Some(p.public_key) != own && !p.remove)
            .filter_map(|p| p.endpoint.map(|e| (p.public_key, e)))
            .collect();
        // No key (removed, as `wg setconf` of a file without one does) is a state of its own:
        // the device keeps its peers and simply has no identity until a key is set.
        let key = (new_key != self.private_key).then_some(new_key);
        // An endpoint set over UAPI replaces a configured name still being looked up.
        for k in explicit.keys() {
            self.endpoints.remove(k);
        }
        if cleared {
            self.endpoints
                .retain(|k, _| staged.get(k).is_some_and(Option::is_some));
        } else {
            for (k, spec) in &staged {
                if spec.is_none() {
                    self.endpoints.remove(k);
                }
            }
        }
        self.commit_peers(staged, cleared, &explicit, key);
        self.step(now);
        Ok(())
    }

    /// Stops every timer and returns what must be undone, in order: rules, forwarding, then
    /// policy rules and routes outside the main table (the device takes the rest with it).
    pub fn teardown(&mut self) -> Vec<Action> {
        self.stopping = true;
        self.actions.clear();
        let mut out = Vec::new();
        if self.rules_installed() {
            out.push(Action::RemoveRules);
        }
        // Every family, also those this run changed nothing for: another daemon that stopped
        // earlier, or an earlier run killed with -9, may have left a change for the last one
        // to put back.
        if self.rules.forwarding_recorded {
            out.push(Action::RestoreForwarding(Family::ALL.into()));
        }
        // The routes outside the main table (the device takes the rest with it), and a
        // half-applied diff's additions: whatever either state may have installed.
        let added = self.routes.in_flight.as_ref().map(|f| &f.diff);
        let applied = RoutePlan {
            routes: (self.routes.applied.routes.iter())
                .chain(added.into_iter().flat_map(|d| &d.add_routes))
                .filter(|r| r.table != routes::MAIN_TABLE)
                .copied()
                .collect(),
            rules: (self.routes.applied.rules.iter())
                .chain(added.into_iter().flat_map(|d| &d.add_rules))
                .copied()
                .collect(),
            fwmark: None,
        };
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
        at.extend(
            self.rules
                .retry
                .at
                .filter(|_| self.rules.failed.is_some() || self.rules.removal_failed),
        );
        at.extend(self.routes.retry.at);
        at.extend(self.addresses.retry.at);
        at.extend(
            self.rules
                .forwarding_retry
                .at
                .filter(|_| !self.rules.forwarding_unavailable.is_empty()),
        );
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
}

/// Below this many entries a map is not worth rebuilding ([`compact`]).
const COMPACT_MIN: usize = 1024;

/// Rebuilds a `BTreeMap` or `BTreeSet` with full nodes. Inserting keys in order (a start, a
/// reload, a `wg setconf`: the staged peers come sorted) splits each full node in two and
/// leaves it half full for good; built from a sorted run, every node is full. At 100,000
/// peers the core's four maps were about 9 MB larger than this. Linear: called after a pass
/// that touched at least half of the map.
fn compact<C: Default + IntoIterator + FromIterator<C::Item>>(map: &mut C) {
    *map = std::mem::take(map).into_iter().collect();
}

/// `interface.workers` as a user wrote it.
fn workers_text(workers: Option<u16>) -> String {
    workers.map_or_else(|| "automatic".into(), |n| n.to_string())
}

#[cfg(test)]
mod tests;
