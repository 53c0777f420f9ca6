//! Chain-level rules: the one place that decides what each [`RuleSet`] entry means as packet
//! matches and verdicts. Both renderers spell these [`Rule`]s and add no meaning of their own,
//! so nftables and iptables install the same policy. Pure.
//!
//! [`lower`] gives one rule per forwarded port (iptables). [`lower_mapped`] gives the same
//! policy with the per-port rules of single-target ports folded into [`Map`]s (nftables): a
//! handful of lookup rules, one lookup per packet, whatever the number of ports, and a
//! change of one port changes only map elements.

use super::{Family, IpNet, Proto, RuleSet, Section};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// The five chains the daemon owns (one base chain per hook in nftables, one `TG-<iface>-*`
/// chain jumped to from the built-in chain in iptables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Chain {
    /// nat, prerouting, dstnat: ingress and egress DNAT.
    Prerouting,
    /// nat, postrouting, srcnat: the SNAT/masquerade partner of every DNAT, router masquerade.
    Postrouting,
    /// filter, forward: what may be forwarded from the tunnel.
    Forward,
    /// filter, forward, priority mangle: TCP MSS clamping, before any filter verdict.
    Mss,
    /// filter, input: what the tunnel may reach on this host (the daemon's own listeners).
    Input,
}

impl Chain {
    pub const ALL: [Chain; 5] = [
        Chain::Prerouting,
        Chain::Postrouting,
        Chain::Forward,
        Chain::Mss,
        Chain::Input,
    ];
}

/// One condition on a packet. A rule matches when all its conditions hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    /// Arrived on the interface `name` (`negate`: on any other, or locally generated).
    InIface { name: String, negate: bool },
    /// Leaves on the interface `name` (`negate`: on any other).
    OutIface { name: String, negate: bool },
    /// Destination in one of these networks, all of the rule's family, never empty.
    Daddr(BTreeSet<IpNet>),
    /// Destination is an address of the interface the packet arrived on.
    LocalDaddrOnInIface,
    /// Protocol and destination port.
    Dport(Proto, u16),
    /// The connection was DNATed; its original destination was one of `orig_daddr` (if not
    /// empty) and port `orig_dport` (if set). This ties a partner rule to its own DNAT.
    CtDnat {
        orig_daddr: BTreeSet<IpAddr>,
        orig_dport: Option<u16>,
    },
    /// A packet of a known connection (replies included) or related to one (ICMP errors).
    CtEstablished,
    /// A TCP segment with SYN set and RST clear.
    TcpSyn,
    /// This layer-4 protocol, any port.
    L4(Proto),
    /// ICMP of the rule's family (ICMPv6 for IPv6: neighbour discovery, path MTU, ping).
    Icmp,
    /// The packet's key ([`MapId::key`]) is an element of this set.
    InSet(MapId),
}

/// What happens to a matching packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// DNAT new connections to the address and port the [`MapKind::IngressDnat`] or
    /// [`MapKind::EgressDnat`] map gives for the packet's key; no element: no match.
    DnatMap(MapId),
    /// SNAT to the address the [`MapKind::EgressSnat`] map gives for the packet's key.
    SnatMap(MapId),
    Accept,
    Drop,
    /// Refuse: a TCP reset (`tcp_reset`, for TCP rules only) or an ICMP port unreachable,
    /// so the sender fails at once instead of timing out.
    Reject {
        tcp_reset: bool,
    },
    /// Stop evaluating this chain.
    Return,
    /// New connections spread round-robin over `targets` (never empty); `port` rewrites the
    /// destination port, `None` keeps it.
    Dnat {
        targets: BTreeSet<IpAddr>,
        port: Option<u16>,
    },
    Snat(IpAddr),
    Masquerade,
    /// Rewrite the TCP MSS option to fit the route's MTU.
    ClampMssToPmtu,
}

/// One rule in one chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub chain: Chain,
    /// `None`: both families.
    pub family: Option<Family>,
    pub matches: Vec<Match>,
    pub verdict: Verdict,
    /// Which config key the rule implements, or why it exists.
    pub comment: String,
}

pub const COMMENT_LOOPBACK: &str = "egress: never from loopback";
pub const COMMENT_WG_PORT: &str = "egress: never the wireguard port";
pub const COMMENT_GROUP_PORT: &str = "egress: never the group exchange port";
pub const COMMENT_HEALTH_PORT: &str = "egress: never the health port";
pub const COMMENT_RETURN: &str = "return traffic";
pub const COMMENT_DROP: &str = "nothing else from the tunnel";
pub const COMMENT_ROUTES: &str = "router.advertise_routes";
pub const COMMENT_EXIT: &str = "router.exit_node";
pub const COMMENT_EXIT_LAN: &str = "router.exit_node_lan = false";

/// What `router.exit_node_lan = false` keeps an exit node's peers out of: the private and
/// link-local ranges a host's LAN, its router's admin page and its neighbours live in. The
/// shared range 100.64.0.0/10 (CGNAT, and many tunnels' own addresses) is not among them.
pub const PRIVATE_NETWORKS: [&str; 6] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "169.254.0.0/16",
    "fc00::/7",
    "fe80::/10",
];
pub const COMMENT_MSS: &str = "firewall.mss_clamp";
pub const COMMENT_INPUT_RETURN: &str = "input: replies to connections this host opened";
pub const COMMENT_INPUT_ICMP: &str = "input: icmp";
pub const COMMENT_INPUT_DROP: &str = "input: nothing else from the tunnel to this host";

/// Every rule of `set`, grouped by chain (Prerouting, Postrouting, Forward, Input, Mss: the
/// order of [`lower_with`]'s steps), each chain in evaluation order: one rule per forwarded port (what iptables installs).
pub fn lower(set: &RuleSet) -> Vec<Rule> {
    lower_with(set, &BTreeMap::new())
}

/// The rules and maps of `set` for nftables: every port forwarded to a single address is an
/// element of its [`Map`]s instead of a rule of its own; the rest (all-port rules, several
/// targets spread by `numgen`) are rules as in [`lower`]. Rules in the same order as
/// [`lower`]'s, each group's lookup rule where its first port's rule would be.
pub fn lower_mapped(set: &RuleSet) -> Lowered {
    let maps = maps_of(set);
    let rules = lower_with(set, &maps);
    Lowered {
        rules,
        maps: maps.into_values().collect(),
    }
}

/// The rules of `set` in order: prerouting, postrouting, forward, input, then MSS, each chain
/// in evaluation order. A port of a group in `maps` is that group's one lookup rule per chain,
/// where the group's first port's rule would be; every other entry is a rule of its own.
fn lower_with(set: &RuleSet, maps: &BTreeMap<MapId, Map>) -> Vec<Rule> {
    let mut l = Lowering {
        set,
        maps,
        emitted: BTreeSet::new(),
        out: Vec::new(),
    };
    // Prerouting: ingress first (only from the tunnel), then egress (only from elsewhere),
    // each egress rule behind the exemptions that keep the daemon's own ports reachable.
    l.ingress_dnat();
    l.egress_exemptions();
    l.egress_dnat();
    // Postrouting: each DNAT's partner, matching the translated destination.
    l.ingress_masquerade();
    l.egress_snat();
    l.router_masquerade();
    // Forward: replies first, then what the config grants; everything else from the tunnel
    // is dropped (an exit node grants everything, so it has no drop).
    l.forward_replies();
    l.forward_ingress();
    l.forward_egress();
    l.forward_exit_node_lan();
    l.forward_router();
    // Input, then MSS.
    l.input_guard();
    l.mss_clamp();
    l.out
}

/// One run of [`lower_with`]: the rules so far, in order, and which map groups already have
/// their rule in each chain.
struct Lowering<'a> {
    set: &'a RuleSet,
    /// Empty for [`lower`]: every port is a rule of its own.
    maps: &'a BTreeMap<MapId, Map>,
    /// Each group's rules are emitted once, where its first port's rule would be.
    emitted: BTreeSet<(Chain, MapId)>,
    out: Vec<Rule>,
}

impl Lowering<'_> {
    /// The map group that holds an entry with `port` and `n` targets, if it is in one: only a
    /// single-target port of a group that has a map.
    fn mapped(
        &self,
        section: Section,
        family: Family,
        port: Option<crate::config::PortMap>,
        n: usize,
    ) -> Option<MapId> {
        port.filter(|_| n == 1)
            .map(|p| MapId::group(section, family, p.proto))
            .filter(|id| self.maps.contains_key(id))
    }

    /// Whether `id`'s rule in `chain` is still to be emitted (true once per chain and group).
    fn first(&mut self, chain: Chain, id: MapId) -> bool {
        self.emitted.insert((chain, id))
    }

    fn push(
        &mut self,
        chain: Chain,
        family: Option<Family>,
        matches: Vec<Match>,
        verdict: Verdict,
        comment: String,
    ) {
        self.out.push(Rule {
            chain,
            family,
            matches,
            verdict,
            comment,
        })
    }

    /// Arrived on the tunnel.
    fn iif(&self) -> Match {
        Match::InIface {
            name: self.set.tunnel.clone(),
            negate: false,
        }
    }

    /// Arrived on any other interface (or locally generated).
    fn not_iif(&self) -> Match {
        Match::InIface {
            name: self.set.tunnel.clone(),
            negate: true,
        }
    }

    /// Leaves on the tunnel.
    fn oif(&self) -> Match {
        Match::OutIface {
            name: self.set.tunnel.clone(),
            negate: false,
        }
    }

    /// Leaves on any other interface.
    fn not_oif(&self) -> Match {
        Match::OutIface {
            name: self.set.tunnel.clone(),
            negate: true,
        }
    }

    /// Prerouting, ingress: what arrives on the tunnel for a tunnel address (and port) is
    /// DNATed to its targets; a mapped group is one map lookup.
    fn ingress_dnat(&mut self) {
        let set = self.set;
        for r in &set.ingress {
            if let Some(g) = self.mapped(Section::Ingress, r.family, r.port, r.targets.len()) {
                if self.first(Chain::Prerouting, g) {
                    let v = Verdict::DnatMap(g);
                    let m = vec![self.iif()];
                    self.push(Chain::Prerouting, Some(g.family), m, v, g.comment());
                }
                continue;
            }
            let mut m = vec![self.iif(), Match::Daddr(hosts(&r.tunnel_addrs))];
            m.extend(r.port.map(|p| Match::Dport(p.proto, p.listen)));
            let verdict = dnat(r.port, &r.targets);
            let c = r.origin.to_string();
            self.push(Chain::Prerouting, Some(r.family), m, verdict, c);
        }
    }

    /// Prerouting, before any egress DNAT: loopback, the WireGuard port, the health port and
    /// the group exchange's port are never captured. Only when there is egress, for the families that have it (`None`:
    /// both).
    fn egress_exemptions(&mut self) {
        let set = self.set;
        let egress_families: BTreeSet<Family> = set.egress.iter().map(|r| r.family).collect();
        if egress_families.is_empty() {
            return;
        }
        let family = match egress_families.len() {
            1 => egress_families.first().copied(),
            _ => None,
        };
        let lo = Match::InIface {
            name: "lo".into(),
            negate: false,
        };
        let c = COMMENT_LOOPBACK.into();
        self.push(Chain::Prerouting, family, vec![lo], Verdict::Return, c);
        let exempt = [
            (set.exemptions.wg_udp_port, Proto::Udp, COMMENT_WG_PORT),
            (
                set.exemptions.health_tcp_port,
                Proto::Tcp,
                COMMENT_HEALTH_PORT,
            ),
            (
                set.exemptions.group_udp_port,
                Proto::Udp,
                COMMENT_GROUP_PORT,
            ),
        ];
        for (port, proto, comment) in exempt {
            if let Some(port) = port {
                let m = vec![self.not_iif(), Match::Dport(proto, port)];
                self.push(
                    Chain::Prerouting,
                    family,
                    m,
                    Verdict::Return,
                    comment.into(),
                );
            }
        }
    }

    /// Prerouting, egress: what arrives elsewhere for a local address of its interface (and
    /// port) is DNATed across the tunnel to its targets; a mapped group is one map lookup.
    fn egress_dnat(&mut self) {
        let set = self.set;
        for r in &set.egress {
            if let Some(g) = self.mapped(Section::Egress, r.family, r.port, r.targets.len()) {
                if self.first(Chain::Prerouting, g) {
                    let m = vec![self.not_iif(), Match::LocalDaddrOnInIface];
                    let v = Verdict::DnatMap(g);
                    self.push(Chain::Prerouting, Some(g.family), m, v, g.comment());
                }
                continue;
            }
            let mut m = vec![self.not_iif(), Match::LocalDaddrOnInIface];
            m.extend(r.port.map(|p| Match::Dport(p.proto, p.listen)));
            let verdict = dnat(r.port, &r.targets);
            let c = r.origin.to_string();
            self.push(Chain::Prerouting, Some(r.family), m, verdict, c);
        }
    }

    /// Postrouting, ingress: a connection the ingress DNAT sent off the tunnel is masqueraded,
    /// matched on its target and its original tunnel address and port.
    fn ingress_masquerade(&mut self) {
        let ifaces = vec![self.iif(), self.not_oif()];
        self.dnatted_connections(
            Section::Ingress,
            Chain::Postrouting,
            ifaces,
            Verdict::Masquerade,
            "",
        );
    }

    /// Postrouting, egress: a connection the egress DNAT sent into the tunnel is SNATed to the
    /// tunnel address, matched on its target and its original port.
    fn egress_snat(&mut self) {
        let set = self.set;
        for r in &set.egress {
            if let Some(g) = self.mapped(Section::Egress, r.family, r.port, r.targets.len()) {
                if self.first(Chain::Postrouting, g) {
                    let m = vec![self.not_iif(), self.oif(), Match::L4(g.proto), ct_dnat()];
                    let v = Verdict::SnatMap(g.with(MapKind::EgressSnat));
                    self.push(Chain::Postrouting, Some(g.family), m, v, g.comment());
                }
                continue;
            }
            let mut m = vec![self.not_iif(), self.oif(), Match::Daddr(hosts(&r.targets))];
            m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
            m.push(Match::CtDnat {
                orig_daddr: BTreeSet::new(),
                orig_dport: r.port.map(|p| p.listen),
            });
            let c = r.origin.to_string();
            let v = Verdict::Snat(r.snat_to);
            self.push(Chain::Postrouting, Some(r.family), m, v, c);
        }
    }

    /// Postrouting, `router.snat`: tunnel traffic routed out of another interface, to where
    /// `[router]` lets it go, is masqueraded.
    fn router_masquerade(&mut self) {
        if !self.set.router.snat {
            return;
        }
        for (family, dst, comment) in router_scopes(self.set) {
            let mut m = vec![self.iif(), self.not_oif()];
            m.extend(dst);
            self.push(Chain::Postrouting, family, m, Verdict::Masquerade, comment);
        }
    }

    /// Forward: packets of known connections, either way, pass before any other rule.
    fn forward_replies(&mut self) {
        for dir in [self.iif(), self.oif()] {
            let m = vec![dir, Match::CtEstablished];
            let c = COMMENT_RETURN.into();
            self.push(Chain::Forward, None, m, Verdict::Accept, c);
        }
    }

    /// Forward, ingress: exactly the connections the ingress DNAT sent, to their targets.
    fn forward_ingress(&mut self) {
        let ifaces = vec![self.iif()];
        self.dnatted_connections(
            Section::Ingress,
            Chain::Forward,
            ifaces,
            Verdict::Accept,
            "",
        );
    }

    /// Forward, egress: exactly the connections the egress DNAT sent into the tunnel.
    fn forward_egress(&mut self) {
        let ifaces = vec![self.not_iif(), self.oif()];
        self.dnatted_connections(Section::Egress, Chain::Forward, ifaces, Verdict::Accept, "");
    }

    /// Forward, `router.exit_node_lan = false`: before the exit node's "anywhere", its
    /// advertised networks stay reachable, the other private ranges do not.
    fn forward_exit_node_lan(&mut self) {
        if !self.set.router.exit_node || self.set.router.exit_node_lan {
            return;
        }
        for (family, dst, comment) in advertised_scopes(self.set) {
            let mut m = vec![self.iif()];
            m.extend(dst);
            self.push(Chain::Forward, family, m, Verdict::Accept, comment);
        }
        for f in Family::ALL {
            let m = vec![self.iif(), Match::Daddr(private_networks(f))];
            let c = COMMENT_EXIT_LAN.into();
            self.push(Chain::Forward, Some(f), m, Verdict::Drop, c);
        }
    }

    /// Forward, `[router]`: tunnel traffic may go where the router grants (anywhere for an
    /// exit node); everything else from the tunnel is dropped, except on an exit node.
    fn forward_router(&mut self) {
        for (family, dst, comment) in router_scopes(self.set) {
            let mut m = vec![self.iif()];
            m.extend(dst);
            self.push(Chain::Forward, family, m, Verdict::Accept, comment);
        }
        if !self.set.router.exit_node {
            let c = COMMENT_DROP.into();
            self.push(Chain::Forward, None, vec![self.iif()], Verdict::Drop, c);
        }
    }

    /// Input, `input_guard`: the tunnel reaches no listener of this host (the health port,
    /// sshd, ...): only replies to connections the host opened, ICMP, and connections our
    /// ingress DNAT sent to a target that is a local address. Forwarded ingress never passes
    /// here. The rest is refused rather than dropped: unreachable either way, and a peer that
    /// connects to an unlisted port of the tunnel address fails at once, as it did before the
    /// guard.
    fn input_guard(&mut self) {
        if !self.set.input_guard {
            return;
        }
        let m = vec![self.iif(), Match::CtEstablished];
        let c = COMMENT_INPUT_RETURN.into();
        self.push(Chain::Input, None, m, Verdict::Accept, c);
        for f in Family::ALL {
            let m = vec![self.iif(), Match::Icmp];
            let c = COMMENT_INPUT_ICMP.into();
            self.push(Chain::Input, Some(f), m, Verdict::Accept, c);
        }
        self.input_ingress();
        let m = vec![self.iif(), Match::L4(Proto::Tcp)];
        let (c, reject) = (COMMENT_INPUT_DROP, Verdict::Reject { tcp_reset: true });
        self.push(Chain::Input, None, m, reject, c.into());
        let reject = Verdict::Reject { tcp_reset: false };
        self.push(Chain::Input, None, vec![self.iif()], reject, c.into());
    }

    /// Input, ingress to a local target: the forward accepts' matches, each with its own
    /// comment ("... to this host").
    fn input_ingress(&mut self) {
        let ifaces = vec![self.iif()];
        let suffix = " to this host";
        self.dnatted_connections(
            Section::Ingress,
            Chain::Input,
            ifaces,
            Verdict::Accept,
            suffix,
        );
    }

    /// One rule per DNATed connection of `section` (ingress or egress) in `chain`: `ifaces`,
    /// then either its map group's protocol and connection set (once per group) or its
    /// targets, port and original destination; `verdict`, and its comment with `suffix`.
    fn dnatted_connections(
        &mut self,
        section: Section,
        chain: Chain,
        ifaces: Vec<Match>,
        verdict: Verdict,
        suffix: &str,
    ) {
        for d in dnatted(self.set, section) {
            if let Some(g) = self.mapped(section, d.family, d.port, d.targets.len()) {
                if self.first(chain, g) {
                    let conn = Match::InSet(g.with(d.conn_map));
                    let mut m = ifaces.clone();
                    m.extend([Match::L4(g.proto), ct_dnat(), conn]);
                    let c = format!("{}{suffix}", g.comment());
                    self.push(chain, Some(g.family), m, verdict.clone(), c);
                }
                continue;
            }
            let mut m = ifaces.clone();
            m.push(Match::Daddr(hosts(d.targets)));
            m.extend(d.port.map(|p| Match::Dport(p.proto, p.target)));
            m.push(Match::CtDnat {
                orig_daddr: d.orig_daddr.clone(),
                orig_dport: d.port.map(|p| p.listen),
            });
            let c = format!("{}{suffix}", d.origin);
            self.push(chain, Some(d.family), m, verdict.clone(), c);
        }
    }

    /// MSS, `firewall.mss_clamp`: exactly one rule per direction.
    fn mss_clamp(&mut self) {
        if !self.set.mss_clamp {
            return;
        }
        for dir in [self.iif(), self.oif()] {
            let m = vec![dir, Match::TcpSyn];
            let c = COMMENT_MSS.into();
            self.push(Chain::Mss, None, m, Verdict::ClampMssToPmtu, c);
        }
    }
}

fn private_networks(family: Family) -> BTreeSet<IpNet> {
    PRIVATE_NETWORKS
        .iter()
        .filter_map(|n| n.parse::<IpNet>().ok())
        .filter(|n| Family::of_net(n) == family)
        .collect()
}

/// Where `[router]` lets tunnel traffic go: anywhere (exit node), or the advertised networks
/// of each family (one destination match per family).
fn router_scopes(set: &RuleSet) -> Vec<(Option<Family>, Option<Match>, String)> {
    if set.router.exit_node {
        return vec![(None, None, COMMENT_EXIT.into())];
    }
    advertised_scopes(set)
}

fn advertised_scopes(set: &RuleSet) -> Vec<(Option<Family>, Option<Match>, String)> {
    Family::ALL
        .into_iter()
        .filter_map(|f| {
            let nets: BTreeSet<IpNet> = set
                .router
                .networks
                .iter()
                .filter(|n| Family::of_net(n) == f)
                .copied()
                .collect();
            (!nets.is_empty()).then(|| (Some(f), Some(Match::Daddr(nets)), COMMENT_ROUTES.into()))
        })
        .collect()
}

fn hosts(addrs: &BTreeSet<IpAddr>) -> BTreeSet<IpNet> {
    addrs.iter().map(|a| IpNet::from(*a)).collect()
}

/// DNAT to `targets`, rewriting the port only where the mapping changes it.
fn dnat(port: Option<crate::config::PortMap>, targets: &BTreeSet<IpAddr>) -> Verdict {
    Verdict::Dnat {
        targets: targets.clone(),
        port: port.filter(|p| p.target != p.listen).map(|p| p.target),
    }
}

/// Whether a network is a single address (rendered without a prefix length in nftables).
pub fn is_host(net: &IpNet) -> bool {
    net.prefix_len() == net.max_prefix_len()
}

/// What the rules after a DNAT need of one ingress or egress rule.
struct Dnatted<'a> {
    family: Family,
    port: Option<crate::config::PortMap>,
    targets: &'a BTreeSet<IpAddr>,
    /// The destination before the DNAT: the tunnel addresses (ingress), any (egress).
    orig_daddr: BTreeSet<IpAddr>,
    origin: &'a super::Origin,
    /// The set of a map group's connections.
    conn_map: MapKind,
}

/// The ingress or egress rules of `set`, as the rules after their DNAT see them.
fn dnatted(set: &RuleSet, section: Section) -> Vec<Dnatted<'_>> {
    match section {
        Section::Ingress => set
            .ingress
            .iter()
            .map(|r| Dnatted {
                family: r.family,
                port: r.port,
                targets: &r.targets,
                orig_daddr: r.tunnel_addrs.clone(),
                origin: &r.origin,
                conn_map: MapKind::IngressConn,
            })
            .collect(),
        Section::Egress => set
            .egress
            .iter()
            .map(|r| Dnatted {
                family: r.family,
                port: r.port,
                targets: &r.targets,
                orig_daddr: BTreeSet::new(),
                origin: &r.origin,
                conn_map: MapKind::EgressConn,
            })
            .collect(),
    }
}

/// A DNATed connection, whatever its original destination (a map lookup says which).
fn ct_dnat() -> Match {
    Match::CtDnat {
        orig_daddr: BTreeSet::new(),
        orig_dport: None,
    }
}

/// The nftables rules and maps of a [`RuleSet`] ([`lower_mapped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lowered {
    pub rules: Vec<Rule>,
    /// Sorted by [`MapId`]; only maps with elements.
    pub maps: Vec<Map>,
}

/// What a map or set of ours holds. Each ingress or egress group (family and protocol) has a
/// DNAT map, read by the one prerouting rule, and the partner lookups of the rules that
/// follow the DNAT (masquerade or SNAT, forward and input accepts), so those match exactly
/// the connections the map DNATed: original destination and port, and where they went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapKind {
    /// tunnel address . listen port : target . target port
    IngressDnat,
    /// original tunnel address . original listen port . target . target port
    IngressConn,
    /// listen port : target . target port (the destination is any local address)
    EgressDnat,
    /// original listen port . target . target port : the tunnel address to SNAT to
    EgressSnat,
    /// original listen port . target . target port
    EgressConn,
}

/// One part of a map's key, read from the packet or its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyField {
    /// The (translated) destination address.
    Daddr,
    /// The (translated) destination port of the map's protocol.
    Dport,
    /// The connection's original destination address, before DNAT.
    OrigDaddr,
    /// The connection's original destination port, before DNAT.
    OrigDport,
}

impl KeyField {
    pub fn is_addr(self) -> bool {
        matches!(self, KeyField::Daddr | KeyField::OrigDaddr)
    }
}

/// One map or set of ours: what it holds, for which family and protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MapId {
    pub kind: MapKind,
    pub family: Family,
    pub proto: Proto,
}

impl MapId {
    /// The DNAT map of a section's group; its partners are [`MapId::with`] another kind.
    pub fn group(section: Section, family: Family, proto: Proto) -> MapId {
        let kind = match section {
            Section::Ingress => MapKind::IngressDnat,
            Section::Egress => MapKind::EgressDnat,
        };
        MapId {
            kind,
            family,
            proto,
        }
    }

    /// The map of the same family and protocol holding `kind`.
    pub fn with(self, kind: MapKind) -> MapId {
        MapId { kind, ..self }
    }

    /// `in4_tcp_dnat`, `in6_udp_conn`, `eg4_tcp_snat`, ...
    pub fn name(&self) -> String {
        let (section, what) = match self.kind {
            MapKind::IngressDnat => ("in", "dnat"),
            MapKind::IngressConn => ("in", "conn"),
            MapKind::EgressDnat => ("eg", "dnat"),
            MapKind::EgressSnat => ("eg", "snat"),
            MapKind::EgressConn => ("eg", "conn"),
        };
        let family = match self.family {
            Family::V4 => 4,
            Family::V6 => 6,
        };
        format!("{section}{family}_{}_{what}", self.proto)
    }

    /// The comment of the rules that read this group's maps: `ingress ipv4 tcp ports`.
    pub fn comment(&self) -> String {
        let section = match self.kind {
            MapKind::IngressDnat | MapKind::IngressConn => "ingress",
            MapKind::EgressDnat | MapKind::EgressSnat | MapKind::EgressConn => "egress",
        };
        format!("{section} {} {} ports", self.family, self.proto)
    }

    /// What a packet is looked up by, in order.
    pub fn key(&self) -> &'static [KeyField] {
        use KeyField::*;
        match self.kind {
            MapKind::IngressDnat => &[Daddr, Dport],
            MapKind::IngressConn => &[OrigDaddr, OrigDport, Daddr, Dport],
            MapKind::EgressDnat => &[Dport],
            MapKind::EgressSnat | MapKind::EgressConn => &[OrigDport, Daddr, Dport],
        }
    }

    /// What an element maps its key to; empty for a set.
    pub fn value(&self) -> &'static [ValueKind] {
        match self.kind {
            MapKind::IngressDnat | MapKind::EgressDnat => &[ValueKind::Addr, ValueKind::Port],
            MapKind::EgressSnat => &[ValueKind::Addr],
            MapKind::IngressConn | MapKind::EgressConn => &[],
        }
    }
}

/// The type of one part of a map's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    Addr,
    Port,
}

/// One part of an element's key or value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    Addr(IpAddr),
    Port(u16),
}

/// An element's value (empty in a set) and the config key it implements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapElement {
    pub value: Vec<Value>,
    pub comment: String,
}

/// A map (or set) with its elements, by key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Map {
    pub id: MapId,
    pub elements: BTreeMap<Vec<Value>, MapElement>,
}

/// Every element of every map of `set`: each ingress or egress port forwarded to exactly
/// one address. A port to several addresses keeps its own `numgen` rule, and a rule for
/// every port has no port to be looked up by. Validation makes keys unique (no two rules
/// share a listen port on one address); were one repeated, the first rule's element wins,
/// as the first rule would.
fn maps_of(set: &RuleSet) -> BTreeMap<MapId, Map> {
    let mut maps: BTreeMap<MapId, Map> = BTreeMap::new();
    let mut add = |id: MapId, key: Vec<Value>, value: Vec<Value>, comment: &str| {
        maps.entry(id)
            .or_insert_with(|| Map {
                id,
                elements: BTreeMap::new(),
            })
            .elements
            .entry(key)
            .or_insert_with(|| MapElement {
                value,
                comment: comment.to_string(),
            });
    };
    use Value::{Addr, Port};
    for r in &set.ingress {
        let (Some(p), Some(target), 1) = (r.port, r.targets.first(), r.targets.len()) else {
            continue;
        };
        let g = MapId::group(Section::Ingress, r.family, p.proto);
        let c = r.origin.to_string();
        let to = vec![Addr(*target), Port(p.target)];
        for a in &r.tunnel_addrs {
            add(g, vec![Addr(*a), Port(p.listen)], to.clone(), &c);
            let conn = vec![Addr(*a), Port(p.listen), Addr(*target), Port(p.target)];
            add(g.with(MapKind::IngressConn), conn, Vec::new(), &c);
        }
    }
    for r in &set.egress {
        let (Some(p), Some(target), 1) = (r.port, r.targets.first(), r.targets.len()) else {
            continue;
        };
        let g = MapId::group(Section::Egress, r.family, p.proto);
        let c = r.origin.to_string();
        add(
            g,
            vec![Port(p.listen)],
            vec![Addr(*target), Port(p.target)],
            &c,
        );
        let conn = vec![Port(p.listen), Addr(*target), Port(p.target)];
        let snat = vec![Addr(r.snat_to)];
        add(g.with(MapKind::EgressSnat), conn.clone(), snat, &c);
        add(g.with(MapKind::EgressConn), conn, Vec::new(), &c);
    }
    maps
}
