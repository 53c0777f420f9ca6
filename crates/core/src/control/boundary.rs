//! Everything that crosses the boundary between the control core and the shell: the actions
//! the core asks for, what executors report back, and the view the shell publishes.

use crate::config::{Endpoint, IpNet, PublicKey, SecretKey};
use crate::routes::PlanDiff;
use crate::rules::{Family, RuleSet};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// What one peer is configured with (by the file or over UAPI). The live endpoint (roaming) and
/// the session belong to the shell's peer table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub preshared_key: Option<SecretKey>,
    pub persistent_keepalive: Option<u16>,
    pub allowed_ips: Vec<IpNet>,
    /// `peer[].name`, for logs, status and metrics.
    pub name: Option<String>,
}

impl PeerSpec {
    /// The peers a configuration asks for (moved, not copied), with their configured
    /// endpoints.
    pub(super) fn take_all(
        peers: Vec<crate::config::Peer>,
    ) -> BTreeMap<PublicKey, (PeerSpec, Option<Endpoint>)> {
        peers
            .into_iter()
            .map(|mut p| {
                // Kept for the life of the peer: without the parser's spare room.
                p.allowed_ips.shrink_to_fit();
                let spec = PeerSpec {
                    preshared_key: p.preshared_key,
                    persistent_keepalive: p.persistent_keepalive,
                    allowed_ips: p.allowed_ips,
                    name: p.name,
                };
                (p.public_key, (spec, p.endpoint))
            })
            .collect()
    }

    /// What changing an existing peer from `self` to `new` does to its WireGuard session. As in
    /// the kernel and wireguard-go, allowed IPs, keepalive and name are plain fields: the session,
    /// its counters and the roamed endpoint stay. A different preshared key changes the
    /// handshake's keys, so it takes a new session.
    pub fn update_to(&self, new: &PeerSpec) -> SessionEffect {
        if self.preshared_key != new.preshared_key {
            SessionEffect::NewSession
        } else if self == new {
            SessionEffect::Unchanged
        } else {
            SessionEffect::KeepSession {
                keepalive_changed: self.persistent_keepalive != new.persistent_keepalive,
            }
        }
    }
}

/// See [`PeerSpec::update_to`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEffect {
    Unchanged,
    KeepSession { keepalive_changed: bool },
    NewSession,
}

/// A peer to add, or an existing one whose spec changed: [`PeerSpec::update_to`] says whether
/// its session survives. A new interface key ([`PeerChanges::private_key`]) resets every
/// session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUpsert {
    pub public_key: PublicKey,
    /// The control's own copy, shared.
    pub spec: std::sync::Arc<PeerSpec>,
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
    /// ([`crate::forwarding`]); report with [`Control::handle_forwarding_enabled`]
    /// which families are still off, and why.
    EnableForwarding(BTreeSet<Family>),
    /// Replace our rules with `set` in one transaction; report with
    /// [`Control::handle_rules_applied`]. `installed` is the set known to be installed now
    /// (the last one applied, with no failed apply or detected drift since), so a backend
    /// may change only what differs (nftables map elements); `None`: replace everything.
    ApplyRules {
        set: RuleSet,
        installed: Option<RuleSet>,
    },
    /// Read our installed rules back; report with [`Control::handle_rules_checked`].
    CheckRules,
    /// Remove every rule of ours: at teardown, or when a reload leaves no rule needed; report
    /// with [`Control::handle_rules_removed`].
    RemoveRules,
    /// At start, when the configuration needs no rule: remove any rule of ours an earlier run
    /// of this interface left behind (killed with -9, or stopped while a firewall command
    /// hung); report with [`Control::handle_rules_swept`]. Nothing of this run depends on it,
    /// so a failure is only logged.
    SweepRules,
    /// This daemon no longer needs forwarding for these families (a reload that needs fewer,
    /// or every family at teardown): put back to off each of them tunnelgate changed that no
    /// other running tunnelgate still needs, and update the shared records
    /// ([`crate::forwarding::on_release`] decides). Nothing to report.
    RestoreForwarding(BTreeSet<Family>),
    /// Serve the health endpoint on this address (`None`: stop serving it): bind the new
    /// listener, then close the old one; report with [`Control::handle_health_bound`]. Asked
    /// for only once the input guard is installed when the new address is beyond loopback,
    /// and before the guard goes when it moves back to loopback.
    ServeHealth(Option<SocketAddr>),
}

/// What an executor reports after applying rules. It reports as soon as the transaction is
/// in: reading the table back (a quarter of a second at 10,000 ports) is a [`Action::CheckRules`]
/// of its own that the core asks for next, off the path of the reload that waits for this.
#[derive(Debug, Clone, PartialEq)]
pub struct RulesReport {
    pub seconds: f64,
    /// The applied text, for `tunnelgate status`.
    pub text: String,
}

/// What an executor reports after an action that can fail: the daemon hands it to
/// [`Control::handle_executed`], so executors never hold the core.
///
/// [`Control::handle_executed`]: super::Control::handle_executed
#[derive(Debug, Clone, PartialEq)]
pub enum Executed {
    /// [`Action::SetAddresses`] (and the [`Action::SetMtu`] before it).
    Addresses(Result<(), String>),
    /// [`Action::Rebind`]: the port bound.
    Rebound(Result<u16, String>),
    /// [`Action::ApplyRoutes`].
    Routes(Result<(), String>),
    /// [`Action::ApplyRules`].
    RulesApplied(Result<RulesReport, String>),
    /// [`Action::CheckRules`]: what is installed now, normalized (empty: nothing of ours).
    RulesChecked(Result<String, String>),
    /// [`Action::RemoveRules`].
    RulesRemoved(Result<(), String>),
    /// [`Action::SweepRules`].
    RulesSwept(Result<(), String>),
    /// [`Action::ServeHealth`]: the address bound.
    HealthBound(Result<Option<SocketAddr>, String>),
    /// [`Action::EnableForwarding`]: `Err` names each family still off, with the error.
    Forwarding(Result<(), BTreeMap<Family, String>>),
}

impl Executed {
    /// The failure a caller waiting on this action (a reload, a UAPI `set`) is told about. A
    /// drift check that could not read the rules back fails nothing the caller asked for.
    pub fn error(&self) -> Option<&str> {
        match self {
            Executed::Addresses(Err(e))
            | Executed::Rebound(Err(e))
            | Executed::Routes(Err(e))
            | Executed::RulesApplied(Err(e))
            | Executed::RulesRemoved(Err(e))
            | Executed::HealthBound(Err(e)) => Some(e),
            _ => None,
        }
    }
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
    /// The `service` labels of the rules that use the name, sorted.
    pub services: Vec<String>,
    /// Whether `/readyz` waits for it to resolve (`health.readiness`).
    pub holds_readiness: bool,
}

/// One `service` label of the forwarding rules, as status and metrics see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceView {
    /// The label (`NAMESPACE/NAME` when the sidecar wrote it).
    pub service: String,
    /// The `target_fqdn` names of its rules.
    pub names: Vec<String>,
    /// Those names that have not resolved since they were configured: their rules are not
    /// installed, so this service is not served (whatever `/readyz` says).
    pub unresolved: Vec<String>,
}

/// Firewall figures for status and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RulesView {
    /// Whether the configuration asks for any rule (forwarding, or the health port's guard).
    pub needed: bool,
    /// Whether the rules the current config and answers ask for are installed; with none
    /// needed, whether none of ours is installed.
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
    /// Every `service` label of the rules, sorted.
    pub services: Vec<ServiceView>,
    pub reloads: u64,
    pub reload_failures: u64,
    pub listen_port: u16,
    /// The mark the WireGuard socket carries (configured, or chosen for a default route).
    pub fwmark: Option<u32>,
}
