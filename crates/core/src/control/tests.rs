//! The control core against a simulated system: every test runs without root, sockets or a
//! clock, in milliseconds. [`Sim`] plays the executors (it applies what the core asks for to a
//! model of the kernel and the firewall, and can be told to fail) and owns a fake clock.

use super::*;
use crate::config::SecretFiles;
use crate::uapi::PeerUpdate;
use std::path::Path;

const KEY: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
const PEER_B: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const PEER_C: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

struct NoFiles;

impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("no files in these tests".into())
    }
}

fn config(text: &str) -> Config {
    let full = format!("[interface]\nname = \"tgsim\"\nprivate_key = \"{KEY}\"\n{text}");
    match Config::parse(&full, Path::new("/etc/tg"), &NoFiles) {
        Ok(c) => c,
        Err(e) => panic!("test config invalid: {e}\n{full}"),
    }
}

fn key(b64: &str) -> PublicKey {
    PublicKey(crate::config::decode_key(b64).expect("test key"))
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test network")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

/// A model of what the executors changed on the system, and a fake clock.
struct Sim {
    control: Control,
    now: Instant,
    addresses: BTreeSet<IpNet>,
    routes: BTreeSet<routes::Route>,
    policy_rules: BTreeSet<routes::PolicyRule>,
    rules: Option<RuleSet>,
    /// The families this daemon has asked forwarding for and not given up (what its shared
    /// record says it needs).
    forwarding: BTreeSet<Family>,
    /// What the "kernel" has installed; differs from `rules` after a hand edit.
    installed_fingerprint: String,
    /// Peer sessions: a new number each time a peer is (re)created with a new session.
    sessions: BTreeMap<PublicKey, (PeerSpec, u32)>,
    next_session: u32,
    endpoints: BTreeMap<PublicKey, SocketAddr>,
    lookups: Vec<(Lookup, Instant)>,
    rules_fail: bool,
    /// The next applied set is gone again before anyone reads it back (removed by hand).
    lose_next_apply: bool,
    remove_fail: bool,
    routes_fail: bool,
    /// Where the health endpoint listens (`None`: it is off).
    health: Option<SocketAddr>,
    /// The next health bind fails (address in use).
    health_fail: bool,
    /// Started: the packet threads run, so tunnel peers reach this host from now on (the
    /// daemon starts them after its first actions ran).
    started: bool,
    /// How many [`Action::SweepRules`] ran.
    swept: usize,
    /// `/proc/sys` is read-only (a container without its init container): forwarding that is
    /// not on already cannot be turned on.
    sysctls_read_only: bool,
    /// The forwarding sysctls that are on, whoever turned them on.
    sysctls_on: BTreeSet<Family>,
    log: Vec<Action>,
}

impl Sim {
    fn new(text: &str) -> Sim {
        Sim::with_config(config(text))
    }

    fn with_config(config: Config) -> Sim {
        Sim::build(config, false)
    }

    /// [`Sim::new`] in a namespace whose `/proc/sys` is read-only, with forwarding off.
    fn read_only_sysctls(text: &str) -> Sim {
        Sim::build(config(text), true)
    }

    fn build(config: Config, sysctls_read_only: bool) -> Sim {
        let now = crate::test_util::now();
        // The port the shell would have bound (a random one for 0: here always 51820).
        let port = match config.interface.listen_port {
            0 => 51820,
            p => p,
        };
        // The shell binds the health endpoint before the core starts.
        let health = config.health.listen;
        let mut sim = Sim {
            control: Control::new(config, port, health, now),
            now,
            addresses: BTreeSet::new(),
            routes: BTreeSet::new(),
            policy_rules: BTreeSet::new(),
            rules: None,
            forwarding: BTreeSet::new(),
            installed_fingerprint: String::new(),
            sessions: BTreeMap::new(),
            next_session: 0,
            endpoints: BTreeMap::new(),
            lookups: Vec::new(),
            rules_fail: false,
            lose_next_apply: false,
            remove_fail: false,
            routes_fail: false,
            health,
            health_fail: false,
            started: false,
            swept: 0,
            sysctls_read_only,
            sysctls_on: BTreeSet::new(),
            log: Vec::new(),
        };
        sim.drive();
        sim.started = true;
        sim.assert_health_guarded();
        sim
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.control.handle_timeout(self.now);
        self.drive();
    }

    /// Runs every queued action, as the shell would, until none is left; then, like the
    /// daemon's loop, fires a timer already due (the drift baseline after an apply) once and
    /// runs what that queued. (Once: a lookup the test leaves unanswered past its deadline
    /// stays due.)
    fn drive(&mut self) {
        self.run_queue();
        if self.control.poll_timeout().is_some_and(|at| at <= self.now) {
            self.control.handle_timeout(self.now);
            self.run_queue();
        }
    }

    fn run_queue(&mut self) {
        while let Some(action) = self.control.poll_action() {
            self.log.push(action.clone());
            self.execute(action);
            self.assert_health_guarded();
        }
    }

    /// Issue 27: at no point does the health endpoint listen beyond loopback while the
    /// installed rules lack the input guard (unless the file allows the tunnel in).
    fn assert_health_guarded(&self) {
        if !self.started {
            return;
        }
        let exposed = crate::rules::desired::beyond_loopback(self.health)
            && !self.control.config().health.allow_from_tunnel;
        let guarded = self.rules.as_ref().is_some_and(|r| r.input_guard);
        assert!(
            !exposed || guarded,
            "health on {:?} without the input guard; actions so far: {:?}",
            self.health,
            self.log
        );
    }

    fn execute(&mut self, action: Action) {
        let now = self.now;
        match action {
            Action::SetMtu(_) | Action::SetFwmark { .. } => {}
            Action::SetAddresses { add, remove } => {
                for a in remove {
                    assert!(
                        self.addresses.remove(&a),
                        "removed {a} that was never added"
                    );
                }
                self.addresses.extend(add);
                self.control.handle_addresses_applied(Ok(()), now);
            }
            Action::UpdatePeers(changes) => {
                for k in &changes.remove {
                    self.sessions.remove(k);
                }
                for u in changes.upsert {
                    let keep = self
                        .sessions
                        .get(&u.public_key)
                        .filter(|(old, _)| old.update_to(&u.spec) != SessionEffect::NewSession)
                        .map(|(_, s)| *s);
                    let session = keep.unwrap_or_else(|| {
                        self.next_session += 1;
                        self.next_session
                    });
                    if let Some(e) = u.endpoint {
                        self.endpoints.insert(u.public_key, e);
                    }
                    self.sessions
                        .insert(u.public_key, (PeerSpec::clone(&u.spec), session));
                }
            }
            Action::Rebind { port, .. } => self.control.handle_rebound(Ok(port), now),
            Action::ApplyRoutes(diff) => {
                if self.routes_fail {
                    self.control
                        .handle_routes_applied(Err("netlink: EPERM".into()), now);
                    return;
                }
                for r in &diff.remove_routes {
                    self.routes.remove(r);
                }
                for r in &diff.remove_rules {
                    self.policy_rules.remove(r);
                }
                self.routes.extend(diff.add_routes.iter().copied());
                self.policy_rules.extend(diff.add_rules.iter().copied());
                self.control.handle_routes_applied(Ok(()), now);
            }
            Action::Resolve { lookup, deadline } => self.lookups.push((lookup, deadline)),
            Action::EnableForwarding(families) => {
                let off: BTreeMap<Family, String> = families
                    .iter()
                    .filter(|f| !self.sysctls_on.contains(f))
                    .filter(|_| self.sysctls_read_only)
                    .map(|f| (*f, "Read-only file system (os error 30)".to_string()))
                    .collect();
                self.sysctls_on
                    .extend(families.iter().filter(|f| !off.contains_key(f)));
                self.forwarding.extend(families);
                let result = if off.is_empty() { Ok(()) } else { Err(off) };
                self.control.handle_forwarding_enabled(result, now);
            }
            Action::ApplyRules { set, .. } => {
                if self.rules_fail {
                    self.control
                        .handle_rules_applied(Err("nft: Operation not permitted".into()), now);
                    return;
                }
                // What `nft list table` shows of it (the read-back the daemon counts rules in).
                self.installed_fingerprint = crate::rules::nft::render(&set);
                if std::mem::take(&mut self.lose_next_apply) {
                    self.installed_fingerprint.clear();
                }
                self.rules = Some(set);
                let report = RulesReport {
                    seconds: 0.01,
                    text: String::new(),
                };
                self.control.handle_rules_applied(Ok(report), now);
            }
            Action::CheckRules => {
                let installed = self.installed_fingerprint.clone();
                self.control.handle_rules_checked(Ok(installed), now);
            }
            Action::RemoveRules => {
                if self.remove_fail {
                    self.control
                        .handle_rules_removed(Err("nft: Operation not permitted".into()), now);
                    return;
                }
                self.rules = None;
                self.installed_fingerprint.clear();
                self.control.handle_rules_removed(Ok(()), now);
            }
            Action::SweepRules => {
                self.swept += 1;
                self.rules = None;
                self.control.handle_rules_swept(Ok(()));
            }
            Action::RestoreForwarding(families) => {
                self.forwarding.retain(|f| !families.contains(f));
            }
            Action::ServeHealth(addr) => {
                if std::mem::take(&mut self.health_fail) {
                    self.control
                        .handle_health_bound(Err("Address already in use".into()), now);
                    return;
                }
                self.health = addr;
                self.control.handle_health_bound(Ok(addr), now);
            }
        }
    }

    /// Answers the oldest pending lookup of `name` (a target or an endpoint host).
    fn answer(&mut self, name: &str, result: Result<Vec<&str>, &str>) {
        let at = self
            .lookups
            .iter()
            .position(|(l, _)| match l {
                Lookup::Target(n) => n == name,
                Lookup::Endpoint { host, .. } => host == name,
            })
            .unwrap_or_else(|| panic!("no lookup of {name} pending: {:?}", self.lookups));
        let (lookup, _) = self.lookups.remove(at);
        let result = result
            .map(|v| v.into_iter().map(ip).collect())
            .map_err(str::to_string);
        self.control.handle_resolved(lookup, result, self.now);
        self.drive();
    }

    /// A UAPI `set` of one peer section, carried out.
    fn uapi_set(&mut self, update: PeerUpdate) {
        let update = DeviceUpdate {
            peers: vec![update],
            ..DeviceUpdate::default()
        };
        self.control
            .handle_device_update(&update, self.now)
            .expect("uapi set");
        self.drive();
    }

    fn reload(&mut self, text: &str) -> Result<Reload, Refused> {
        let r = self.control.handle_config_loaded(config(text), self.now);
        self.drive();
        r
    }

    /// How many rules the model of the installed set has (what `nft` would count).
    fn model_rules(&self) -> usize {
        let set = self.rules.as_ref().expect("rules installed");
        crate::rules::model::lower_mapped(set).rules.len()
    }

    fn targets_in_rules(&self) -> BTreeSet<IpAddr> {
        let set = self.rules.as_ref().expect("rules installed");
        set.ingress
            .iter()
            .flat_map(|i| i.targets.iter().copied())
            .chain(set.egress.iter().flat_map(|e| e.targets.iter().copied()))
            .collect()
    }

    fn session(&self, k: &str) -> u32 {
        self.sessions.get(&key(k)).expect("peer present").1
    }
}

const BASE: &str = r#"addresses = ["100.64.0.1/32", "fd7a::1/128"]

[[peer]]
public_key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="
allowed_ips = ["100.64.0.2/32", "10.0.0.0/24"]
persistent_keepalive = 25

[[ingress]]
target = "10.96.0.10"
"#;

#[test]
fn start_installs_everything_and_becomes_ready() {
    let sim = Sim::new(BASE);
    assert_eq!(
        sim.addresses,
        [net("100.64.0.1/32"), net("fd7a::1/128")].into()
    );
    assert_eq!(sim.routes.len(), 2, "one route per allowed IP");
    assert!(sim.rules.is_some());
    assert_eq!(sim.sessions.len(), 1);
    assert_eq!(sim.control.readiness(), Ok(()));
    assert_eq!(sim.control.start_failure(), None);
    // The drift baseline was read right after the apply; then the checks every 30 s.
    assert_eq!(sim.control.view().rules.rule_count, sim.model_rules());
    assert_eq!(
        sim.control.poll_timeout(),
        Some(sim.now + Duration::from_secs(30))
    );
}

#[test]
fn reload_adds_and_removes_addresses_peers_rules_and_names() {
    let mut sim = Sim::new(BASE);
    let peer_b_session = sim.session(PEER_B);
    let next = r#"addresses = ["100.64.0.9/32", "fd7a::1/128"]

[[peer]]
public_key = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI="
allowed_ips = ["100.64.0.3/32"]

[[egress]]
target_fqdn = "db.example"
ports = ["5432"]
"#;
    assert_eq!(sim.reload(next), Ok(Reload::Applied));
    // The address that left the config is gone (the old daemon only ever added).
    assert_eq!(
        sim.addresses,
        [net("100.64.0.9/32"), net("fd7a::1/128")].into()
    );
    assert!(!sim.sessions.contains_key(&key(PEER_B)));
    assert!(sim.sessions.contains_key(&key(PEER_C)));
    assert_ne!(sim.session(PEER_C), peer_b_session);
    let nets: BTreeSet<IpNet> = sim.routes.iter().map(|r| r.net).collect();
    assert_eq!(
        nets,
        [net("100.64.0.3/32")].into(),
        "old peer's routes removed"
    );
    // The ingress rule left; the egress rule waits for its name.
    let rules = sim.rules.clone().expect("rules");
    assert!(rules.ingress.is_empty() && rules.egress.is_empty());
    assert!(sim
        .control
        .readiness()
        .is_err_and(|e| e.contains("db.example")));
    sim.answer("db.example", Ok(vec!["10.1.0.5"]));
    assert_eq!(sim.targets_in_rules(), [ip("10.1.0.5")].into());
    assert_eq!(sim.control.readiness(), Ok(()));

    // And back: the name is no longer tracked, the ingress returns.
    assert_eq!(sim.reload(BASE), Ok(Reload::Applied));
    assert_eq!(sim.targets_in_rules(), [ip("10.96.0.10")].into());
    assert!(sim.control.view().names.is_empty());
    assert_eq!(sim.control.view().reloads, 2);
    let actions = sim.log.len();
    assert_eq!(sim.reload(BASE), Ok(Reload::Unchanged));
    assert_eq!(
        sim.log.len(),
        actions,
        "an unchanged reload asks for nothing"
    );
    assert_eq!(sim.control.view().reloads, 3, "but it counts as a reload");
}

#[test]
fn a_renamed_interface_is_refused_and_changes_nothing() {
    let mut sim = Sim::new(BASE);
    let before = sim.log.len();
    let renamed = config(BASE);
    let mut renamed = renamed;
    renamed.interface.name = "tgother".into();
    let r = sim.control.handle_config_loaded(renamed, sim.now);
    assert!(r.is_err_and(|e| e.0.contains("interface.name cannot change")));
    sim.drive();
    assert_eq!(sim.log.len(), before, "a refused reload asks for nothing");
    assert_eq!(sim.control.view().reload_failures, 1);
}

#[test]
fn a_reload_that_changes_the_worker_count_is_refused_and_changes_nothing() {
    let mut sim = Sim::new(BASE);
    sim.drive();
    let before = sim.log.len();
    let mut more = config(BASE);
    more.interface.workers = Some(4);
    let r = sim.control.handle_config_loaded(more, sim.now);
    assert!(r
        .is_err_and(|e| e.0
            == "interface.workers cannot change on reload (automatic -> 4): restart the daemon"));
    sim.drive();
    assert_eq!(sim.log.len(), before, "a refused reload asks for nothing");
    assert_eq!(sim.control.config().interface.workers, None);
}

#[test]
fn a_reload_that_changes_the_takeover_section_is_refused_and_changes_nothing() {
    let mut sim = Sim::new(BASE);
    sim.drive();
    let before = sim.log.len();
    let mut open = config(BASE);
    open.takeover.answer = crate::takeover::Answer::AnySource;
    let r = sim.control.handle_config_loaded(open, sim.now);
    assert!(r.is_err_and(|e| e.0.contains("[takeover] section cannot change on reload")));
    sim.drive();
    assert_eq!(sim.log.len(), before, "a refused reload asks for nothing");
    assert_eq!(
        sim.control.config().takeover.answer,
        crate::takeover::Answer::KnownEndpoints
    );
}

const FQDN: &str = r#"addresses = ["100.64.0.1/32"]
[dns]
reresolve_interval = "60s"
[[ingress]]
target_fqdn = "web.example"
"#;

#[test]
fn a_dns_answer_change_replaces_the_rules_within_the_interval() {
    let mut sim = Sim::new(FQDN);
    assert!(sim
        .control
        .readiness()
        .is_err_and(|e| e.contains("web.example")));
    sim.answer("web.example", Ok(vec!["10.0.0.1", "10.0.0.2"]));
    assert_eq!(
        sim.targets_in_rules(),
        [ip("10.0.0.1"), ip("10.0.0.2")].into()
    );
    assert_eq!(sim.control.readiness(), Ok(()));
    assert_eq!(
        sim.control.poll_timeout(),
        Some(sim.now + Duration::from_secs(30))
    );
    sim.advance(Duration::from_secs(60));
    let (_, deadline) = sim.lookups.first().expect("re-resolution due").clone();
    assert_eq!(deadline, sim.now + RESOLVE_TIMEOUT);
    sim.answer("web.example", Ok(vec!["10.0.0.3"]));
    assert_eq!(sim.targets_in_rules(), [ip("10.0.0.3")].into());
}

#[test]
fn a_dns_outage_keeps_the_last_good_rules_and_backs_off() {
    let mut sim = Sim::new(FQDN);
    sim.answer("web.example", Ok(vec!["10.0.0.1"]));
    let applies = sim.control.view().rules.applies;
    sim.advance(Duration::from_secs(60));
    let mut waits = Vec::new();
    for _ in 0..4 {
        sim.answer("web.example", Err("timed out after 5.0s"));
        let next = sim.control.poll_timeout().expect("retry scheduled");
        waits.push((next - sim.now).as_secs());
        sim.advance(next - sim.now);
    }
    // Retries back off (the 30 s drift check also wakes the loop, but asks no lookup).
    assert!(waits.starts_with(&[1, 2, 4]), "{waits:?}");
    assert_eq!(sim.targets_in_rules(), [ip("10.0.0.1")].into());
    assert_eq!(sim.control.view().rules.applies, applies, "no re-apply");
    assert_eq!(
        sim.control.readiness(),
        Ok(()),
        "once resolved, an outage keeps it ready"
    );
    let view = sim.control.view();
    assert_eq!(view.names[0].failures, 4);
    assert!(view.names[0].last_error.as_deref() == Some("timed out after 5.0s"));
}

#[test]
fn a_failed_rule_apply_drops_readiness_and_retries_with_backoff() {
    let mut sim = Sim::new(BASE);
    assert_eq!(sim.control.readiness(), Ok(()));
    sim.rules_fail = true;
    let next = BASE.replace("10.96.0.10", "10.96.0.11");
    assert_eq!(sim.reload(&next), Ok(Reload::Applied));
    let why = sim
        .control
        .readiness()
        .expect_err("not ready after a failed apply");
    assert!(why.contains("Operation not permitted"), "{why}");
    assert_eq!(
        sim.targets_in_rules(),
        [ip("10.96.0.10")].into(),
        "old rules stay"
    );
    let mut waits = Vec::new();
    for _ in 0..3 {
        let next = sim.control.poll_timeout().expect("retry scheduled");
        waits.push((next - sim.now).as_secs());
        sim.advance(next - sim.now);
    }
    assert_eq!(waits, vec![1, 2, 4]);
    assert_eq!(sim.control.view().rules.failures, 4);
    sim.rules_fail = false;
    let next_try = sim.control.poll_timeout().expect("retry scheduled");
    sim.advance(next_try - sim.now);
    assert_eq!(sim.targets_in_rules(), [ip("10.96.0.11")].into());
    assert_eq!(sim.control.readiness(), Ok(()));
}

#[test]
fn readiness_goes_back_to_not_ready_and_recovers_on_drift() {
    let mut sim = Sim::new(BASE);
    assert_eq!(sim.control.readiness(), Ok(()));
    // Someone deletes our table by hand: the next drift check repairs it.
    sim.installed_fingerprint.clear();
    sim.rules_fail = true;
    sim.advance(Duration::from_secs(30));
    assert!(sim.log.contains(&Action::CheckRules));
    let why = sim
        .control
        .readiness()
        .expect_err("drifted and repair failed");
    assert!(why.starts_with("rules:"), "{why}");
    sim.rules_fail = false;
    sim.advance(Duration::from_secs(1));
    assert_eq!(sim.control.readiness(), Ok(()));
    assert!(!sim.installed_fingerprint.is_empty());
}

#[test]
fn an_apply_reports_before_the_read_back_which_is_the_drift_baseline() {
    let mut sim = Sim::new(BASE);
    let kinds = |log: &[Action]| -> Vec<&'static str> {
        log.iter()
            .filter_map(|a| match a {
                Action::ApplyRules { .. } => Some("apply"),
                Action::CheckRules => Some("check"),
                _ => None,
            })
            .collect()
    };
    // The start applies, then reads the table back once: the baseline.
    assert_eq!(kinds(&sim.log), ["apply", "check"]);
    assert_eq!(sim.control.view().rules.rule_count, sim.model_rules());
    // A reload that changes the rules runs the apply alone: what the caller of the reload
    // waits for (the daemon drains the queue) holds no read-back of the whole table ...
    sim.log.clear();
    let next = BASE.replace("10.96.0.10", "10.96.0.11");
    assert_eq!(
        sim.control.handle_config_loaded(config(&next), sim.now),
        Ok(Reload::Applied)
    );
    sim.run_queue();
    assert_eq!(kinds(&sim.log), ["apply"]);
    assert_eq!(sim.control.readiness(), Ok(()));
    // ... which is due at once, after it.
    assert_eq!(sim.control.poll_timeout(), Some(sim.now));
    sim.drive();
    assert_eq!(kinds(&sim.log), ["apply", "check"]);
    // Drift from that baseline is repaired at the next periodic check, not before.
    sim.log.clear();
    sim.installed_fingerprint = "edited by hand".into();
    sim.advance(Duration::from_secs(29));
    assert!(sim.log.is_empty(), "{:?}", sim.log);
    sim.advance(Duration::from_secs(1));
    assert_eq!(kinds(&sim.log), ["check", "apply", "check"]);
    assert_eq!(sim.targets_in_rules(), [ip("10.96.0.11")].into());
}

#[test]
fn rules_gone_before_the_baseline_read_are_applied_again() {
    let mut sim = Sim::new(BASE);
    sim.log.clear();
    sim.lose_next_apply = true;
    sim.reload(&BASE.replace("10.96.0.10", "10.96.0.11"))
        .expect("reload taken");
    let applies = sim
        .log
        .iter()
        .filter(|a| matches!(a, Action::ApplyRules { .. }))
        .count();
    assert_eq!(applies, 2, "{:?}", sim.log);
    let applied = sim.rules.as_ref().expect("rules installed");
    assert_eq!(
        sim.installed_fingerprint,
        crate::rules::nft::render(applied)
    );
    assert_eq!(sim.control.readiness(), Ok(()));
}

#[test]
fn failed_routes_drop_readiness_and_fail_a_start() {
    let now = crate::test_util::now();
    let mut control = Control::new(config(BASE), 51820, None, now);
    while let Some(a) = control.poll_action() {
        match a {
            Action::ApplyRoutes(_) => control.handle_routes_applied(Err("EPERM".into()), now),
            Action::SetAddresses { .. } => control.handle_addresses_applied(Ok(()), now),
            Action::ApplyRules { .. } => control.handle_rules_applied(
                Ok(RulesReport {
                    seconds: 0.0,
                    text: String::new(),
                }),
                now,
            ),
            _ => {}
        }
    }
    assert_eq!(control.start_failure().as_deref(), Some("routes: EPERM"));
    assert!(control.readiness().is_err_and(|e| e.starts_with("routes:")));
    // Teardown undoes the rules that did go in; routes in the main table go with the device.
    let undo = control.teardown();
    assert_eq!(undo.first(), Some(&Action::RemoveRules));
    assert!(
        undo.iter()
            .any(|a| matches!(a, Action::RestoreForwarding(_)))
            || undo.len() == 1
    );
    assert_eq!(control.poll_timeout(), None, "no timer after teardown");
}

#[test]
fn teardown_removes_default_route_policy_rules() {
    let exit = r#"addresses = ["100.64.0.1/32"]
[[peer]]
public_key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="
allowed_ips = ["0.0.0.0/0"]
"#;
    let mut sim = Sim::new(exit);
    assert!(sim.log.iter().any(|a| matches!(
        a,
        Action::SetFwmark {
            mark: 51820,
            src_valid_mark: true
        }
    )));
    let undo = sim.control.teardown();
    let Some(Action::ApplyRoutes(diff)) = undo.last() else {
        panic!("teardown must remove the policy rules: {undo:?}");
    };
    assert_eq!(diff.remove_rules.len(), 2);
    assert_eq!(diff.remove_routes.len(), 1, "the table-51820 default route");
    assert!(diff.add_routes.is_empty() && diff.add_rules.is_empty());
}

#[test]
fn keepalive_or_allowed_ips_changes_keep_the_session() {
    let mut sim = Sim::new(BASE);
    let session = sim.session(PEER_B);
    let next = BASE.replace("persistent_keepalive = 25", "persistent_keepalive = 5");
    sim.reload(&next).expect("reload");
    assert_eq!(
        sim.session(PEER_B),
        session,
        "keepalive change kept the session"
    );
    let last = sim.log.iter().rev().find_map(|a| match a {
        Action::UpdatePeers(c) => Some(c.clone()),
        _ => None,
    });
    let changes = last.expect("peer update");
    assert!(
        changes.remove.is_empty(),
        "the peer is updated, not removed"
    );
    assert_eq!(changes.upsert[0].spec.persistent_keepalive, Some(5));
    assert_eq!(
        changes.upsert[0].endpoint, None,
        "a roamed endpoint is kept"
    );

    // Over UAPI too: `wg set tg0 peer B allowed-ips ...` keeps the session.
    let mut update = PeerUpdate::new(key(PEER_B));
    update.replace_allowed_ips = true;
    update.allowed_ips = vec![net("100.64.0.2/32"), net("10.0.1.0/24")];
    sim.uapi_set(update);
    assert_eq!(sim.session(PEER_B), session);
    let nets: BTreeSet<IpNet> = sim.routes.iter().map(|r| r.net).collect();
    assert!(nets.contains(&net("10.0.1.0/24")) && !nets.contains(&net("10.0.0.0/24")));

    // A new preshared key is a new session.
    let psk = "AwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwM=";
    let with_psk = next.replace(
        "persistent_keepalive = 5",
        &format!("persistent_keepalive = 5\npreshared_key = \"{psk}\""),
    );
    sim.reload(&with_psk).expect("reload");
    assert_ne!(sim.session(PEER_B), session);
}

/// The core keeps no copy of the file's peers (at 100,000 that was 20 MB), yet tells the
/// file it runs from another: the same peers are no change, even after UAPI changed a peer
/// (the file wins only when it changes, as before); a changed endpoint in the file is set;
/// an endpoint the file kept is left where the peer roamed.
#[test]
fn a_reload_tells_the_files_peers_apart_without_a_copy_of_them() {
    let with_endpoint = BASE.replace(
        "persistent_keepalive = 25",
        "persistent_keepalive = 25\nendpoint = \"192.0.2.7:51820\"",
    );
    let mut sim = Sim::new(&with_endpoint);
    assert!(sim.control.config().peers.is_empty(), "no copy kept");
    assert_eq!(sim.control.peer_count(), 1);
    assert!(sim.control.runs(&config(&with_endpoint)));

    let mut update = PeerUpdate::new(key(PEER_B));
    update.persistent_keepalive = Some(7);
    sim.uapi_set(update);
    assert_eq!(sim.reload(&with_endpoint), Ok(Reload::Unchanged));
    let upserts = |sim: &Sim| -> Vec<PeerUpsert> {
        sim.log
            .iter()
            .filter_map(|a| match a {
                Action::UpdatePeers(c) => Some(c.upsert.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    };
    let last = upserts(&sim).last().cloned().expect("the UAPI change");
    assert_eq!(
        last.spec.persistent_keepalive,
        Some(7),
        "UAPI's change stays"
    );

    // The name changes, the endpoint stays: the peer keeps where it roamed.
    let renamed = with_endpoint.replace(
        "persistent_keepalive = 25",
        "persistent_keepalive = 25\nname = \"b\"",
    );
    assert!(!sim.control.runs(&config(&renamed)));
    assert_eq!(sim.reload(&renamed), Ok(Reload::Applied));
    let last = upserts(&sim).last().cloned().expect("the reload's change");
    assert_eq!(last.spec.name.as_deref(), Some("b"));
    assert_eq!(last.spec.persistent_keepalive, Some(25), "the file wins");
    assert_eq!(last.endpoint, None, "a roamed endpoint is kept");

    // The endpoint changes: it is set.
    let moved = renamed.replace("192.0.2.7:51820", "192.0.2.8:51820");
    assert_eq!(sim.reload(&moved), Ok(Reload::Applied));
    let last = upserts(&sim).last().cloned().expect("the reload's change");
    assert_eq!(
        last.endpoint,
        Some("192.0.2.8:51820".parse().expect("address"))
    );
}

#[test]
fn uapi_may_remove_the_key_and_set_it_again_like_wireguard_go() {
    let mut sim = Sim::new(BASE);
    let before = sim.log.len();
    // What `wg setconf` of a file without PrivateKey sends.
    let update = DeviceUpdate {
        private_key: Some(None),
        listen_port: None,
        fwmark: None,
        replace_peers: true,
        peers: vec![PeerUpdate::new(key(PEER_B))],
    };
    sim.control
        .handle_device_update(&update, sim.now)
        .expect("accepted, as by wireguard-go and the kernel");
    sim.drive();
    let removed = sim.log[before..]
        .iter()
        .any(|a| matches!(a, Action::UpdatePeers(c) if c.private_key == Some(None)));
    assert!(removed, "the peer table is told the key is gone");
    assert_eq!(
        sim.sessions.keys().copied().collect::<Vec<_>>(),
        vec![key(PEER_B)],
        "the peers named stay"
    );

    let own = SecretKey([7; 32]);
    let update = DeviceUpdate {
        private_key: Some(Some(own.clone())),
        ..DeviceUpdate::default()
    };
    sim.control
        .handle_device_update(&update, sim.now)
        .expect("key set");
    sim.drive();
    assert!(sim
        .log
        .iter()
        .any(|a| matches!(a, Action::UpdatePeers(c) if c.private_key == Some(Some(own.clone())))));
}

#[test]
fn a_new_listen_port_rebinds_and_follows_into_the_rules() {
    let mut sim = Sim::new(BASE);
    let next = format!("listen_port = 51999\n{BASE}");
    sim.reload(&next).expect("reload");
    assert!(sim
        .log
        .iter()
        .any(|a| matches!(a, Action::Rebind { port: 51999, .. })));
    let rules = sim.rules.as_ref().expect("rules");
    assert_eq!(rules.exemptions.wg_udp_port, Some(51999));
    assert_eq!(sim.control.view().listen_port, 51999);
}

#[test]
fn lookups_run_at_most_sixteen_at_once_each_with_its_deadline() {
    let mut text = String::from("addresses = [\"100.64.0.1/32\"]\n");
    for i in 0..40 {
        text.push_str(&format!(
            "[[ingress]]\ntarget_fqdn = \"n{i}.example\"\nports = [\"{}\"]\n",
            1000 + i
        ));
    }
    let mut sim = Sim::new(&text);
    assert_eq!(sim.lookups.len(), MAX_CONCURRENT_RESOLUTIONS);
    assert!(sim
        .lookups
        .iter()
        .all(|(_, d)| *d == sim.now + RESOLVE_TIMEOUT));
    // Each answer (or failure) frees a slot for the next name.
    sim.answer("n0.example", Err("timed out"));
    assert_eq!(sim.lookups.len(), MAX_CONCURRENT_RESOLUTIONS);
    for _ in 0..60 {
        let Some((Lookup::Target(name), _)) = sim.lookups.first().cloned() else {
            break;
        };
        sim.answer(&name, Ok(vec!["10.9.0.1"]));
        assert!(sim.lookups.len() <= MAX_CONCURRENT_RESOLUTIONS);
    }
    let resolved = sim
        .control
        .view()
        .names
        .iter()
        .filter(|n| n.last_resolved.is_some())
        .count();
    assert_eq!(resolved, 39, "every name but the failed one resolved");
}

#[test]
fn an_endpoint_name_is_resolved_through_the_same_lookups() {
    let text = r#"addresses = ["100.64.0.1/32"]
[[peer]]
public_key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="
endpoint = "peer.example:51820"
allowed_ips = ["100.64.0.2/32"]
"#;
    let mut sim = Sim::new(text);
    assert!(sim.endpoints.is_empty());
    sim.answer("peer.example", Err("SERVFAIL"));
    assert_eq!(
        sim.control.poll_timeout(),
        Some(sim.now + Duration::from_secs(1))
    );
    sim.advance(Duration::from_secs(1));
    sim.answer("peer.example", Ok(vec!["192.0.2.7"]));
    assert_eq!(
        sim.endpoints.get(&key(PEER_B)),
        Some(&"192.0.2.7:51820".parse().expect("addr"))
    );
    assert_eq!(sim.control.poll_timeout(), None, "nothing left to do");
}

/// The shared forwarding records decide what goes back, so teardown gives up every family, not
/// only the one this daemon needed and even though the simulated executor reports no change of
/// its own: another daemon (or an earlier run killed with -9) may have left a change of either
/// family for the last one to put back.
#[test]
fn teardown_gives_up_every_forwarding_family() {
    let mut sim = Sim::new(BASE);
    assert!(sim
        .log
        .iter()
        .any(|a| *a == Action::EnableForwarding([Family::V4].into())));
    let undo = sim.control.teardown();
    assert_eq!(undo.first(), Some(&Action::RemoveRules));
    assert!(
        undo.contains(&Action::RestoreForwarding(Family::ALL.into())),
        "{undo:?}"
    );
}

/// A daemon that never forwarded has no record to read at stop.
#[test]
fn teardown_of_a_plain_tunnel_touches_no_forwarding() {
    let mut sim = Sim::new(NO_RULES);
    assert!(sim.forwarding.is_empty());
    let undo = sim.control.teardown();
    assert!(
        !undo
            .iter()
            .any(|a| matches!(a, Action::RemoveRules | Action::RestoreForwarding(_))),
        "{undo:?}"
    );
}

/// BASE without its ingress: a plain tunnel, no rule needed.
const NO_RULES: &str = r#"addresses = ["100.64.0.1/32", "fd7a::1/128"]

[[peer]]
public_key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="
allowed_ips = ["100.64.0.2/32", "10.0.0.0/24"]
persistent_keepalive = 25
"#;

/// Issue 27: a start that needs no rule still removes what an earlier run of the interface
/// left (killed, or stopped while `nft` hung), once, as the stop's log promises; a start that
/// needs rules replaces them with its apply and sweeps nothing, and neither does a reload.
#[test]
fn a_start_without_rules_sweeps_an_earlier_runs_leftovers_once() {
    let mut plain = Sim::new(NO_RULES);
    assert_eq!(plain.swept, 1, "{:?}", plain.log);
    assert!(
        plain.control.readiness().is_ok(),
        "{:?}",
        plain.control.readiness()
    );
    assert!(plain.reload(BASE).is_ok());
    assert!(plain.rules.is_some());
    assert!(plain.reload(NO_RULES).is_ok());
    assert!(plain.rules.is_none());
    assert_eq!(
        plain.swept, 1,
        "a reload removes, never sweeps: {:?}",
        plain.log
    );

    let with_rules = Sim::new(BASE);
    assert_eq!(with_rules.swept, 0, "{:?}", with_rules.log);
    assert!(with_rules.rules.is_some());
}

/// Issue 23: deleting the last `[[ingress]]` and reloading removes its rules and gives up the
/// forwarding it needed, as a fresh start of the new file would have neither.
#[test]
fn a_reload_to_no_rules_removes_them_and_gives_up_forwarding() {
    let mut sim = Sim::new(BASE);
    assert!(sim.rules.is_some());
    assert_eq!(sim.forwarding, [Family::V4].into());
    let before = sim.log.len();

    assert_eq!(sim.reload(NO_RULES), Ok(Reload::Applied));
    assert_eq!(sim.rules, None, "the ingress rule is gone");
    assert!(sim.forwarding.is_empty(), "forwarding given up");
    let asked = &sim.log[before..];
    let removed = asked.iter().position(|a| *a == Action::RemoveRules);
    let restored = asked
        .iter()
        .position(|a| *a == Action::RestoreForwarding([Family::V4].into()));
    assert!(
        matches!((removed, restored), (Some(r), Some(f)) if r < f),
        "rules removed, then forwarding given up: {asked:?}"
    );
    assert_eq!(sim.control.readiness(), Ok(()));
    let view = sim.control.view().rules;
    assert!(!view.needed && view.current, "{view:?}");
    assert_eq!(view.rule_count, 0);
    assert!(view.text.is_empty() && view.last_error.is_none());
    assert_eq!(
        sim.control.poll_timeout(),
        None,
        "no drift check of rules that are not there"
    );
    // Nothing is left for the stop either.
    let undo = sim.control.teardown();
    assert!(!undo.contains(&Action::RemoveRules), "{undo:?}");
}

#[test]
fn a_failed_removal_keeps_readiness_down_and_is_retried_with_backoff() {
    let mut sim = Sim::new(BASE);
    sim.remove_fail = true;
    assert_eq!(sim.reload(NO_RULES), Ok(Reload::Applied));
    assert!(sim.rules.is_some(), "the simulated removal failed");
    let why = sim
        .control
        .readiness()
        .expect_err("the old rules still forward");
    assert!(
        why.starts_with("rules: removing") && why.contains("Operation not permitted"),
        "{why}"
    );
    assert!(
        !sim.log
            .iter()
            .any(|a| matches!(a, Action::RestoreForwarding(_))),
        "forwarding stays while the rules that need it stay"
    );
    assert!(!sim.control.view().rules.current);
    let mut waits = Vec::new();
    for _ in 0..3 {
        let next = sim.control.poll_timeout().expect("retry scheduled");
        waits.push((next - sim.now).as_secs());
        sim.advance(next - sim.now);
    }
    assert_eq!(waits, vec![1, 2, 4]);
    let removals = sim
        .log
        .iter()
        .filter(|a| **a == Action::RemoveRules)
        .count();
    assert_eq!(removals, 4, "the first try and three retries");
    assert_eq!(sim.control.view().rules.failures, 4);

    sim.remove_fail = false;
    let next = sim.control.poll_timeout().expect("retry scheduled");
    sim.advance(next - sim.now);
    assert_eq!(sim.rules, None);
    assert!(sim.forwarding.is_empty());
    assert_eq!(sim.control.readiness(), Ok(()));
    assert_eq!(sim.control.poll_timeout(), None, "no more retries");
}

#[test]
fn a_reload_back_to_rules_applies_them_again() {
    let mut sim = Sim::new(BASE);
    sim.reload(NO_RULES).expect("reload");
    assert_eq!(sim.rules, None);
    sim.reload(BASE).expect("reload");
    assert_eq!(sim.targets_in_rules(), [ip("10.96.0.10")].into());
    assert_eq!(sim.forwarding, [Family::V4].into());
    assert_eq!(sim.control.readiness(), Ok(()));
    let view = sim.control.view().rules;
    assert!(view.needed && view.current);
    assert_eq!(
        view.rule_count,
        sim.model_rules(),
        "counted from the read-back"
    );

    // Also after a removal that failed: whatever it left is replaced by the new set.
    sim.remove_fail = true;
    sim.reload(NO_RULES).expect("reload");
    assert!(sim.control.readiness().is_err());
    sim.remove_fail = false;
    sim.reload(BASE).expect("reload");
    assert_eq!(sim.targets_in_rules(), [ip("10.96.0.10")].into());
    assert_eq!(sim.control.readiness(), Ok(()));
    assert_eq!(
        sim.control.poll_timeout(),
        Some(sim.now + Duration::from_secs(30)),
        "the drift check, no removal retry"
    );
}

/// A reload that drops every IPv6 rule gives up IPv6 forwarding only once the new rules are in.
#[test]
fn a_reload_to_fewer_families_gives_up_only_those() {
    let both = format!(
        "{BASE}
[[ingress]]
target = \"fd96::10\"\nports = [\"80\"]\n"
    );
    let mut sim = Sim::new(&both);
    assert_eq!(sim.forwarding, Family::ALL.into());
    let before = sim.log.len();
    sim.reload(BASE).expect("reload");
    assert_eq!(sim.forwarding, [Family::V4].into());
    let asked = &sim.log[before..];
    let applied = asked
        .iter()
        .position(|a| matches!(a, Action::ApplyRules { .. }));
    let restored = asked
        .iter()
        .position(|a| *a == Action::RestoreForwarding([Family::V6].into()));
    assert!(
        matches!((applied, restored), (Some(a), Some(r)) if a < r),
        "{asked:?}"
    );
    assert!(
        !asked.contains(&Action::RemoveRules),
        "rules replaced in one go"
    );
}

mod reload_equivalence;
mod scale;

#[test]
fn userspace_mode_installs_no_addresses_routes_or_rules_and_starts_without_a_key() {
    // A configuration that would install all of them in daemon mode.
    let text = "[interface]\nname = \"tgsim\"\nprivate_key = \"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"\n\
                addresses = [\"100.64.0.1/32\"]\n\
                [[peer]]\npublic_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"\n\
                allowed_ips = [\"10.0.0.0/24\", \"0.0.0.0/0\"]\n\
                [[ingress]]\ntarget = \"10.96.0.10\"\n";
    let config = Config::parse(text, Path::new("/"), &NoFiles).expect("valid");
    let now = crate::test_util::now();
    let mut daemon = Control::with_mode(Mode::Daemon, config.clone(), 51820, None, now);
    let daemon_actions: Vec<Action> = std::iter::from_fn(|| daemon.poll_action()).collect();
    assert!(
        daemon_actions
            .iter()
            .any(|a| matches!(a, Action::ApplyRoutes(_))),
        "daemon mode routes the allowed IPs: {daemon_actions:?}"
    );

    let mut user = Control::with_mode(Mode::Userspace, config, 51820, None, now);
    let actions: Vec<Action> = std::iter::from_fn(|| user.poll_action()).collect();
    // Not vacuous: the file's peer is set up, and nothing else is asked for.
    assert!(
        matches!(actions.as_slice(), [Action::UpdatePeers(u)] if u.upsert.len() == 1 && !matches!(u.private_key, Some(Some(_)))),
        "userspace mode only sets up peers (without a key): {actions:?}"
    );
    assert!(user.readiness().is_ok(), "{:?}", user.readiness());
    // A UAPI set with peers and allowed IPs (what wg-quick's `wg setconf` does) routes nothing.
    let mut peer = PeerUpdate::new(PublicKey([3; 32]));
    peer.allowed_ips = vec![net("10.9.0.0/16"), net("::/0")];
    let update = DeviceUpdate {
        private_key: Some(Some(SecretKey([9; 32]))),
        peers: vec![peer],
        ..DeviceUpdate::default()
    };
    user.handle_device_update(&update, now).expect("set");
    let actions: Vec<Action> = std::iter::from_fn(|| user.poll_action()).collect();
    // The set itself is carried out (the key and the new peer), and it routes nothing.
    assert!(
        !actions.is_empty() && actions.iter().all(|a| matches!(a, Action::UpdatePeers(_))),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|a| matches!(a, Action::UpdatePeers(u)
            if matches!(u.private_key, Some(Some(_)))
                && u.upsert.iter().any(|p| p.public_key == PublicKey([3; 32])))),
        "the set's key and peer reach the data plane: {actions:?}"
    );
    assert!(user.teardown().is_empty(), "nothing to undo");
}

#[test]
fn the_drop_in_core_starts_from_a_name_alone() {
    let now = crate::test_util::now();
    let mut user = Control::userspace("tgsim", 51820, None, now).expect("a valid name");
    assert_eq!(user.config().interface.name, "tgsim");
    let actions: Vec<Action> = std::iter::from_fn(|| user.poll_action()).collect();
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::SetAddresses { .. }
                | Action::ApplyRoutes(_)
                | Action::ApplyRules { .. }
                | Action::SweepRules
                | Action::EnableForwarding(_)
        )),
        "a name alone installs nothing on the host: {actions:?}"
    );
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, Action::UpdatePeers(u) if matches!(u.private_key, Some(Some(_))))),
        "no key until UAPI sets one: {actions:?}"
    );
    assert!(user.readiness().is_ok(), "{:?}", user.readiness());
    assert!(user.teardown().is_empty(), "nothing to undo");
    assert!(Control::userspace("not a valid name", 51820, None, now).is_err());
}

#[test]
fn only_a_new_preshared_key_takes_a_new_session() {
    let base = PeerSpec {
        preshared_key: None,
        persistent_keepalive: None,
        allowed_ips: vec!["100.64.0.2/32".parse().expect("net")],
        name: None,
    };
    assert_eq!(base.update_to(&base.clone()), SessionEffect::Unchanged);
    let keepalive = PeerSpec {
        persistent_keepalive: Some(25),
        ..base.clone()
    };
    assert_eq!(
        base.update_to(&keepalive),
        SessionEffect::KeepSession {
            keepalive_changed: true
        }
    );
    let more_ips = PeerSpec {
        allowed_ips: vec![
            "100.64.0.2/32".parse().expect("net"),
            "10.0.0.0/24".parse().expect("net"),
        ],
        name: Some("office".into()),
        ..base.clone()
    };
    assert_eq!(
        base.update_to(&more_ips),
        SessionEffect::KeepSession {
            keepalive_changed: false
        }
    );
    let psk = PeerSpec {
        preshared_key: Some(SecretKey::generate()),
        ..base.clone()
    };
    assert_eq!(base.update_to(&psk), SessionEffect::NewSession);
    assert_eq!(psk.update_to(&base), SessionEffect::NewSession);
}

/// A proxy-group replica: two Services' rules, each labelled, and readiness per service.
const GROUP: &str = r#"addresses = ["100.64.0.1/32"]
[[ingress]]
target_fqdn = "web.example"
ports = ["80"]
service = "apps/web"
[[ingress]]
target_fqdn = "gone.example"
ports = ["81"]
service = "apps/gone"
[health]
readiness = "per-service"
"#;

#[test]
fn per_service_readiness_reports_a_services_unresolved_name_and_stays_ready() {
    let mut sim = Sim::new(GROUP);
    sim.answer("web.example", Ok(vec!["10.0.0.1"]));
    sim.answer("gone.example", Err("NXDOMAIN"));
    assert_eq!(
        sim.control.readiness(),
        Ok(()),
        "one Service's name is not the replica's problem"
    );
    assert_eq!(
        sim.targets_in_rules(),
        [ip("10.0.0.1")].into(),
        "the other Service is served"
    );
    let view = sim.control.view();
    assert_eq!(view.readiness, Ok(()));
    let services: Vec<(&str, Vec<&str>, Vec<&str>)> = view
        .services
        .iter()
        .map(|s| {
            (
                s.service.as_str(),
                s.names.iter().map(String::as_str).collect(),
                s.unresolved.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        services,
        [
            ("apps/gone", vec!["gone.example"], vec!["gone.example"]),
            ("apps/web", vec!["web.example"], vec![]),
        ]
    );
    let gone = view
        .names
        .iter()
        .find(|n| n.name == "gone.example")
        .expect("tracked");
    assert_eq!(gone.services, ["apps/gone"]);
    assert!(!gone.holds_readiness);
    assert_eq!(gone.last_error.as_deref(), Some("NXDOMAIN"));

    // It is still retried, and once it resolves its rule follows.
    let next = sim.control.poll_timeout().expect("a retry is scheduled");
    sim.advance(next - sim.now);
    sim.answer("gone.example", Ok(vec!["10.0.0.2"]));
    assert_eq!(
        sim.targets_in_rules(),
        [ip("10.0.0.1"), ip("10.0.0.2")].into()
    );
    assert!(sim
        .control
        .view()
        .services
        .iter()
        .all(|s| s.unresolved.is_empty()));
}

#[test]
fn per_service_readiness_is_still_honest_about_rules_and_unlabelled_names() {
    // The replica's own rule (no service label) still holds readiness.
    let own = format!("{GROUP}[[egress]]\ntarget_fqdn = \"own.example\"\nports = [\"5432\"]\n");
    let mut sim = Sim::new(&own);
    sim.answer("web.example", Ok(vec!["10.0.0.1"]));
    sim.answer("gone.example", Err("NXDOMAIN"));
    sim.answer("own.example", Err("NXDOMAIN"));
    assert!(
        sim.control
            .readiness()
            .is_err_and(|e| e.contains("own.example") && e.contains("NXDOMAIN")),
        "{:?}",
        sim.control.readiness()
    );
    // A name both a labelled and an unlabelled rule use is the replica's too.
    let shared = format!("{GROUP}[[egress]]\ntarget_fqdn = \"gone.example\"\nports = [\"5432\"]\n");
    assert_eq!(sim.reload(&shared), Ok(Reload::Applied));
    assert!(sim
        .control
        .readiness()
        .is_err_and(|e| e.contains("gone.example")));

    // A failing rule apply makes it NotReady whatever the names do.
    let mut sim = Sim::new(GROUP);
    sim.answer("web.example", Ok(vec!["10.0.0.1"]));
    sim.answer("gone.example", Err("NXDOMAIN"));
    assert_eq!(sim.control.readiness(), Ok(()));
    sim.rules_fail = true;
    let _ = sim.reload(&GROUP.replace("\"80\"", "\"8080\""));
    assert!(sim
        .control
        .readiness()
        .is_err_and(|e| e.starts_with("rules:")));
}

#[test]
fn without_per_service_readiness_one_unresolved_name_is_not_ready() {
    // A single-Service proxy (the sidecar labels its rules but keeps readiness = "all"): its
    // one Service not resolving means it serves nothing, and /readyz says so.
    let single = GROUP.replace("readiness = \"per-service\"", "readiness = \"all\"");
    let mut sim = Sim::new(&single);
    sim.answer("web.example", Ok(vec!["10.0.0.1"]));
    sim.answer("gone.example", Err("NXDOMAIN"));
    assert!(sim
        .control
        .readiness()
        .is_err_and(|e| e.contains("gone.example") && e.contains("NXDOMAIN")));
    assert_eq!(sim.control.view().services[0].unresolved, ["gone.example"]);
    // A reload to the per-service policy takes the name's weight off readiness at once.
    assert_eq!(sim.reload(GROUP), Ok(Reload::Applied));
    assert_eq!(sim.control.readiness(), Ok(()));
    assert_eq!(
        sim.control.view().services[0].unresolved,
        ["gone.example"],
        "the reload kept what is known about the name"
    );
}

/// A plain tunnel (no forwarding) with the health endpoint on `listen`.
fn plain_with_health(listen: &str) -> String {
    format!(
        "addresses = [\"100.64.0.1/32\"]\n\n[[peer]]\npublic_key = \"{PEER_B}\"\nallowed_ips = [\"100.64.0.2/32\"]\n\n[health]\nlisten = \"{listen}\"\n"
    )
}

/// The position in the log of the first action `matches` accepts.
fn position(log: &[Action], matches: impl Fn(&Action) -> bool) -> usize {
    log.iter()
        .position(matches)
        .unwrap_or_else(|| panic!("action not found in {log:?}"))
}

fn sock(s: &str) -> SocketAddr {
    s.parse().expect("test socket address")
}

#[test]
fn a_reload_that_narrows_the_health_endpoint_moves_it_before_the_guard_goes() {
    let mut sim = Sim::new(&plain_with_health("0.0.0.0:9002"));
    assert!(sim.rules.as_ref().is_some_and(|r| r.input_guard));
    for to in ["127.0.0.1:9002", ""] {
        let mut sim_to = Sim::new(&plain_with_health("0.0.0.0:9002"));
        sim_to.log.clear();
        assert_eq!(sim_to.reload(&plain_with_health(to)), Ok(Reload::Applied));
        let want = (!to.is_empty()).then(|| sock(to));
        let moved = position(&sim_to.log, |a| *a == Action::ServeHealth(want));
        let removed = position(&sim_to.log, |a| *a == Action::RemoveRules);
        assert!(moved < removed, "rebind first: {:?}", sim_to.log);
        assert_eq!(sim_to.health, want);
        assert_eq!(sim_to.rules, None, "no rule is needed any more");
        assert_eq!(sim_to.control.readiness(), Ok(()));
        assert!(!sim_to.control.view().rules.needed);
    }
    // And back: the guard goes in before the listener leaves loopback.
    sim.reload(&plain_with_health("127.0.0.1:9002"))
        .expect("narrowed");
    sim.log.clear();
    assert_eq!(
        sim.reload(&plain_with_health("0.0.0.0:9002")),
        Ok(Reload::Applied)
    );
    let guarded = position(
        &sim.log,
        |a| matches!(a, Action::ApplyRules { set, .. } if set.input_guard),
    );
    let moved = position(&sim.log, |a| {
        *a == Action::ServeHealth(Some(sock("0.0.0.0:9002")))
    });
    assert!(guarded < moved, "guard first: {:?}", sim.log);
    assert_eq!(sim.health, Some(sock("0.0.0.0:9002")));
}

#[test]
fn a_health_bind_that_fails_keeps_the_old_listener_and_its_guard() {
    let mut sim = Sim::new(&plain_with_health("0.0.0.0:9002"));
    sim.health_fail = true;
    sim.reload(&plain_with_health("127.0.0.1:9002"))
        .expect("taken");
    assert_eq!(sim.health, Some(sock("0.0.0.0:9002")), "the old one serves");
    assert!(
        sim.rules.as_ref().is_some_and(|r| r.input_guard),
        "the guard stays while 0.0.0.0 is bound"
    );
    // It is not retried in a loop, but a new file is tried again.
    sim.log.clear();
    sim.advance(Duration::from_secs(60));
    assert!(!sim.log.iter().any(|a| matches!(a, Action::ServeHealth(_))));
    sim.reload(&plain_with_health("127.0.0.1:9003"))
        .expect("taken");
    assert_eq!(sim.health, Some(sock("127.0.0.1:9003")));
    assert_eq!(sim.rules, None);
}

#[test]
fn a_health_endpoint_widened_while_rules_fail_stays_on_loopback() {
    let mut sim = Sim::new(&plain_with_health("127.0.0.1:9002"));
    assert_eq!(sim.rules, None);
    sim.rules_fail = true;
    sim.reload(&plain_with_health("0.0.0.0:9002"))
        .expect("taken");
    assert_eq!(
        sim.health,
        Some(sock("127.0.0.1:9002")),
        "no guard, no move"
    );
    assert!(sim.control.readiness().is_err());
    sim.rules_fail = false;
    sim.advance(Duration::from_secs(2));
    assert_eq!(sim.health, Some(sock("0.0.0.0:9002")), "moved once guarded");
    assert_eq!(sim.control.readiness(), Ok(()));
}

#[test]
fn a_health_port_change_follows_into_the_rules_exemption() {
    let base = format!("{BASE}\n[health]\nlisten = \"0.0.0.0:9002\"\n");
    let mut sim = Sim::new(&base);
    assert_eq!(
        sim.rules.as_ref().map(|r| r.exemptions.health_tcp_port),
        Some(Some(9002))
    );
    sim.reload(&base.replace("9002", "9003")).expect("taken");
    assert_eq!(sim.health, Some(sock("0.0.0.0:9003")));
    assert_eq!(
        sim.rules.as_ref().map(|r| r.exemptions.health_tcp_port),
        Some(Some(9003))
    );
}
/// A proxy container without its init container: `/proc/sys` is read-only and forwarding is
/// off. The rules go in, but the daemon is not ready, and the reason names the sysctl, the
/// error and the fix; the sysctl is read again with backoff (at most 10 s apart), so once it
/// is turned on from outside the daemon becomes ready without a restart.
#[test]
fn forwarding_that_cannot_be_turned_on_holds_readiness_until_it_is_on() {
    let mut sim = Sim::read_only_sysctls(BASE);
    assert!(sim.rules.is_some(), "the rules are installed all the same");
    let why = sim
        .control
        .readiness()
        .expect_err("not ready without forwarding");
    assert!(
        why.starts_with("forwarding: net.ipv4.ip_forward is off"),
        "{why}"
    );
    for part in [
        "Read-only file system",
        "init container",
        "securityContext.sysctls",
        "sysctl -w net.ipv4.ip_forward=1",
    ] {
        assert!(why.contains(part), "{part:?} missing from {why:?}");
    }
    assert_eq!(sim.control.view().readiness, Err(why.clone()));

    // Still off: asked again, with backoff, never more than 10 s apart.
    let asks = |sim: &Sim| {
        sim.log
            .iter()
            .filter(|a| matches!(a, Action::EnableForwarding(_)))
            .count()
    };
    let first = asks(&sim);
    for _ in 0..6 {
        let next = sim.control.poll_timeout().expect("a retry is scheduled");
        assert!(
            next - sim.now <= Duration::from_secs(10),
            "{:?}",
            next - sim.now
        );
        sim.advance(next - sim.now);
    }
    // (One of the wake-ups may be the drift check instead.)
    assert!(asks(&sim) >= first + 5, "{} -> {}", first, asks(&sim));
    assert!(sim.control.readiness().is_err());

    // `ip netns exec NS sysctl -w net.ipv4.ip_forward=1`: ready at the next read.
    sim.sysctls_on.insert(Family::V4);
    let next = sim.control.poll_timeout().expect("a retry is scheduled");
    sim.advance(next - sim.now);
    assert_eq!(sim.control.readiness(), Ok(()));
    let on = asks(&sim);
    sim.advance(Duration::from_secs(60));
    assert_eq!(asks(&sim), on, "no more reads of the sysctl once it is on");
}

/// Forwarding that is already on in a read-only `/proc/sys` (the init container ran) is all a
/// daemon needs: ready at once.
#[test]
fn forwarding_already_on_in_a_read_only_namespace_is_ready() {
    let mut sim = Sim::build(config(NO_RULES), true);
    sim.sysctls_on.insert(Family::V4);
    sim.reload(BASE).expect("reload");
    assert_eq!(sim.control.readiness(), Ok(()));
}
