//! Config + runtime facts + current DNS answers -> the desired [`RuleSet`]. Pure: the shell
//! supplies the bound ports and the resolved addresses; nothing here resolves or binds.

use super::{Egress, Exemptions, Family, Ingress, Origin, RouterRules, RuleSet, Section};
use crate::config::{Config, Forward, IpNet, PortMap, Target};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// At most this many addresses of one family are used for one `target_fqdn`. Every address
/// becomes an element of a DNAT map and a SNAT/accept set (and in iptables one rule each),
/// so a huge DNS answer, hostile or mistaken, must not produce a huge rule set. The lowest
/// addresses are kept: DNS servers rotate answers, and sorting first keeps the chosen subset
/// (and so the installed rules) stable between resolutions.
pub const MAX_ADDRESSES_PER_TARGET: usize = 64;

/// What only the running daemon knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeFacts {
    /// The UDP port the WireGuard socket is actually bound to (`listen_port = 0` picks one).
    pub wg_port: u16,
    /// The TCP port of the health endpoint, if it runs.
    pub health_port: Option<u16>,
    /// Whether the health endpoint listens beyond loopback, or is about to (a reload that
    /// moves it there binds only once the guard is in): decided from what is bound, not
    /// from the file alone, so a reload that has not yet moved the listener keeps the guard.
    pub health_beyond_loopback: bool,
}

impl RuntimeFacts {
    /// The facts of a fresh start of `config` (its health address bound as written), as
    /// `check` plans it.
    pub fn fresh_start(config: &Config, wg_port: u16) -> RuntimeFacts {
        RuntimeFacts {
            wg_port,
            health_port: config.health.listen.map(|a| a.port()),
            health_beyond_loopback: health_beyond_loopback(config),
        }
    }
}

/// The rules that `config` asks for, given the current answers for each `target_fqdn`. A name
/// missing from `resolved`, or without addresses of a family, gives no rule for that family,
/// and neither does a family without a tunnel address.
pub fn desired(
    config: &Config,
    facts: &RuntimeFacts,
    resolved: &BTreeMap<String, Vec<IpAddr>>,
) -> RuleSet {
    let own: BTreeSet<IpAddr> = config.interface.addresses.iter().map(IpNet::addr).collect();
    let tunnel_addrs = |f: Family| -> BTreeSet<IpAddr> {
        own.iter()
            .copied()
            .filter(|a| Family::of(*a) == f)
            .collect()
    };
    let mut ingress = Vec::new();
    for (index, fwd) in config.ingress.iter().enumerate() {
        let origin = Origin {
            section: Section::Ingress,
            index,
        };
        for (family, targets) in targets_by_family(fwd, resolved, &own) {
            let tunnel_addrs = tunnel_addrs(family);
            if tunnel_addrs.is_empty() {
                continue;
            }
            for port in ports(fwd) {
                ingress.push(Ingress {
                    origin,
                    family,
                    tunnel_addrs: tunnel_addrs.clone(),
                    port,
                    targets: targets.clone(),
                });
            }
        }
    }
    let mut egress = Vec::new();
    for (index, fwd) in config.egress.iter().enumerate() {
        let origin = Origin {
            section: Section::Egress,
            index,
        };
        for (family, targets) in targets_by_family(fwd, resolved, &own) {
            let Some(snat_to) = config.tunnel_address(family == Family::V6) else {
                continue;
            };
            for port in ports(fwd) {
                egress.push(Egress {
                    origin,
                    family,
                    port,
                    targets: targets.clone(),
                    snat_to,
                });
            }
        }
    }
    RuleSet {
        tunnel: config.interface.name.clone(),
        ingress,
        egress,
        exemptions: Exemptions {
            wg_udp_port: (facts.wg_port != 0).then_some(facts.wg_port),
            health_tcp_port: facts.health_port.filter(|p| *p != 0),
            group_udp_port: config
                .takeover
                .group
                .as_ref()
                .map(|g| g.listen.port())
                .filter(|p| *p != 0),
        },
        router: RouterRules {
            networks: outermost(&config.router.advertise_routes),
            exit_node: config.router.exit_node,
            exit_node_lan: config.router.exit_node_lan,
            snat: config.router.snat,
        },
        mss_clamp: config.firewall.mss_clamp,
        input_guard: (forwarding_configured(config) || facts.health_beyond_loopback)
            && !config.health.allow_from_tunnel,
    }
}

/// One entry per rule: every listed port (sorted, so their order in the file does not
/// matter), or `None` for every port and protocol.
fn ports(fwd: &Forward) -> Vec<Option<PortMap>> {
    if fwd.ports.is_empty() {
        return vec![None];
    }
    let set: BTreeSet<PortMap> = fwd.ports.iter().copied().collect();
    set.into_iter().map(Some).collect()
}

/// The target addresses of each family, never empty, never one of our own addresses.
fn targets_by_family(
    fwd: &Forward,
    resolved: &BTreeMap<String, Vec<IpAddr>>,
    own: &BTreeSet<IpAddr>,
) -> Vec<(Family, BTreeSet<IpAddr>)> {
    let addrs: BTreeSet<IpAddr> = match &fwd.target {
        Target::Ip(ip) => [ip.to_canonical()].into(),
        Target::Fqdn(name) => resolved
            .get(name)
            .into_iter()
            .flatten()
            .map(IpAddr::to_canonical)
            .filter(usable_answer)
            .collect(),
    };
    Family::ALL
        .into_iter()
        .filter_map(|f| {
            let set: BTreeSet<IpAddr> = addrs
                .iter()
                .copied()
                .filter(|a| Family::of(*a) == f && !own.contains(a))
                .take(MAX_ADDRESSES_PER_TARGET)
                .collect();
            (!set.is_empty()).then_some((f, set))
        })
        .collect()
}

/// Whether an address from a DNS answer can be a DNAT target. DNS is outside input: an
/// unspecified, loopback, multicast, broadcast or IPv6 link-local address (which needs a
/// zone) would be dropped by the kernel after DNAT or reach the wrong host, so it is skipped.
fn usable_answer(ip: &IpAddr) -> bool {
    let common = !ip.is_unspecified() && !ip.is_loopback() && !ip.is_multicast();
    match ip {
        IpAddr::V4(v4) => common && !v4.is_broadcast(),
        IpAddr::V6(v6) => common && (v6.segments()[0] & 0xffc0) != 0xfe80,
    }
}

/// The networks not contained in another listed network: older nft refuses overlapping
/// intervals in one set, and a contained network adds nothing.
fn outermost(nets: &[IpNet]) -> BTreeSet<IpNet> {
    let all: BTreeSet<IpNet> = nets.iter().map(IpNet::trunc).collect();
    all.iter()
        .filter(|n| !all.iter().any(|o| o != *n && o.contains(*n)))
        .copied()
        .collect()
}

/// Whether a configuration needs firewall rules at all: when it forwards anything, or when
/// the health endpoint listens beyond loopback (so a tunnel peer could reach it) and
/// `health.allow_from_tunnel` does not allow that. A plain tunnel with the health endpoint
/// on loopback, or off, needs none and runs on a host without nft or iptables. Whenever
/// rules are installed, they include the input guard (unless `allow_from_tunnel`), so the
/// tunnel reaches no listener of this host.
pub fn firewall_needed(config: &Config) -> bool {
    forwarding_configured(config)
        || (health_beyond_loopback(config) && !config.health.allow_from_tunnel)
}

/// Whether `[[ingress]]`, `[[egress]]` or `[router]` forwards anything.
pub fn forwarding_configured(config: &Config) -> bool {
    !config.ingress.is_empty()
        || !config.egress.is_empty()
        || !config.router.advertise_routes.is_empty()
        || config.router.exit_node
}

/// Whether the health endpoint listens on an address other than loopback (`0.0.0.0`, `::`
/// or a specific address, which Linux answers on every interface, the tunnel included).
/// Packets from the tunnel to a loopback address are dropped by the kernel as martians.
pub fn health_beyond_loopback(config: &Config) -> bool {
    beyond_loopback(config.health.listen)
}

/// Whether a listener on `addr` (none: no listener) answers on more than loopback.
pub fn beyond_loopback(addr: Option<std::net::SocketAddr>) -> bool {
    addr.is_some_and(|a| !a.ip().to_canonical().is_loopback())
}
