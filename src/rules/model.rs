//! Chain-level rules: the one place that decides what each [`RuleSet`] entry means as packet
//! matches and verdicts. Both renderers spell these [`Rule`]s and add no meaning of their own,
//! so nftables and iptables install the same policy. Pure.

use super::{Family, IpNet, Proto, RuleSet};
use std::collections::BTreeSet;
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
}

/// What happens to a matching packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
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

/// Every rule of `set`, grouped by chain in [`Chain::ALL`] order, each chain in evaluation order.
pub fn lower(set: &RuleSet) -> Vec<Rule> {
    let mut out = Vec::new();
    let tun = set.tunnel.as_str();
    let iif = || Match::InIface {
        name: tun.into(),
        negate: false,
    };
    let not_iif = |name: &str| Match::InIface {
        name: name.into(),
        negate: true,
    };
    let oif = || Match::OutIface {
        name: tun.into(),
        negate: false,
    };
    let not_oif = || Match::OutIface {
        name: tun.into(),
        negate: true,
    };
    let mut push = |chain, family, matches: Vec<Match>, verdict, comment: String| {
        out.push(Rule {
            chain,
            family,
            matches,
            verdict,
            comment,
        })
    };

    // Prerouting: ingress first (only from the tunnel), then egress (only from elsewhere),
    // each egress rule behind the exemptions that keep the daemon's own ports reachable.
    for r in &set.ingress {
        let mut m = vec![iif(), Match::Daddr(hosts(&r.tunnel_addrs))];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.listen)));
        let verdict = dnat(r.port, &r.targets);
        push(
            Chain::Prerouting,
            Some(r.family),
            m,
            verdict,
            r.origin.to_string(),
        );
    }
    // Exemptions apply to the families that have egress rules (`None`: both).
    let egress_families: BTreeSet<Family> = set.egress.iter().map(|r| r.family).collect();
    if !egress_families.is_empty() {
        let family = match egress_families.len() {
            1 => egress_families.first().copied(),
            _ => None,
        };
        let lo = Match::InIface {
            name: "lo".into(),
            negate: false,
        };
        let c = COMMENT_LOOPBACK.into();
        push(Chain::Prerouting, family, vec![lo], Verdict::Return, c);
        let exempt = [
            (set.exemptions.wg_udp_port, Proto::Udp, COMMENT_WG_PORT),
            (
                set.exemptions.health_tcp_port,
                Proto::Tcp,
                COMMENT_HEALTH_PORT,
            ),
        ];
        for (port, proto, comment) in exempt {
            if let Some(port) = port {
                let m = vec![not_iif(tun), Match::Dport(proto, port)];
                push(
                    Chain::Prerouting,
                    family,
                    m,
                    Verdict::Return,
                    comment.into(),
                );
            }
        }
    }
    for r in &set.egress {
        let mut m = vec![not_iif(tun), Match::LocalDaddrOnInIface];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.listen)));
        let verdict = dnat(r.port, &r.targets);
        push(
            Chain::Prerouting,
            Some(r.family),
            m,
            verdict,
            r.origin.to_string(),
        );
    }

    // Postrouting: each DNAT's partner, matching the translated destination.
    for r in &set.ingress {
        let mut m = vec![iif(), not_oif(), Match::Daddr(hosts(&r.targets))];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
        m.push(Match::CtDnat {
            orig_daddr: r.tunnel_addrs.clone(),
            orig_dport: r.port.map(|p| p.listen),
        });
        let c = r.origin.to_string();
        push(
            Chain::Postrouting,
            Some(r.family),
            m,
            Verdict::Masquerade,
            c,
        );
    }
    for r in &set.egress {
        let mut m = vec![not_iif(tun), oif(), Match::Daddr(hosts(&r.targets))];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
        m.push(Match::CtDnat {
            orig_daddr: BTreeSet::new(),
            orig_dport: r.port.map(|p| p.listen),
        });
        let c = r.origin.to_string();
        push(
            Chain::Postrouting,
            Some(r.family),
            m,
            Verdict::Snat(r.snat_to),
            c,
        );
    }
    if set.router.snat {
        for (family, dst, comment) in router_scopes(set) {
            let mut m = vec![iif(), not_oif()];
            m.extend(dst);
            push(Chain::Postrouting, family, m, Verdict::Masquerade, comment);
        }
    }

    // Forward: replies first, then what the config grants; everything else from the tunnel
    // is dropped (an exit node grants everything, so it has no drop).
    for dir in [iif(), oif()] {
        let m = vec![dir, Match::CtEstablished];
        push(
            Chain::Forward,
            None,
            m,
            Verdict::Accept,
            COMMENT_RETURN.into(),
        );
    }
    for r in &set.ingress {
        let mut m = vec![iif(), Match::Daddr(hosts(&r.targets))];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
        m.push(Match::CtDnat {
            orig_daddr: r.tunnel_addrs.clone(),
            orig_dport: r.port.map(|p| p.listen),
        });
        let c = r.origin.to_string();
        push(Chain::Forward, Some(r.family), m, Verdict::Accept, c);
    }
    for r in &set.egress {
        let mut m = vec![not_iif(tun), oif(), Match::Daddr(hosts(&r.targets))];
        m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
        m.push(Match::CtDnat {
            orig_daddr: BTreeSet::new(),
            orig_dport: r.port.map(|p| p.listen),
        });
        let c = r.origin.to_string();
        push(Chain::Forward, Some(r.family), m, Verdict::Accept, c);
    }
    if set.router.exit_node && !set.router.exit_node_lan {
        // Before the exit node's "anywhere": its advertised networks stay reachable, the other
        // private ranges do not.
        for (family, dst, comment) in advertised_scopes(set) {
            let mut m = vec![iif()];
            m.extend(dst);
            push(Chain::Forward, family, m, Verdict::Accept, comment);
        }
        for f in Family::ALL {
            let m = vec![iif(), Match::Daddr(private_networks(f))];
            let c = COMMENT_EXIT_LAN.into();
            push(Chain::Forward, Some(f), m, Verdict::Drop, c);
        }
    }
    for (family, dst, comment) in router_scopes(set) {
        let mut m = vec![iif()];
        m.extend(dst);
        push(Chain::Forward, family, m, Verdict::Accept, comment);
    }
    if !set.router.exit_node {
        let c = COMMENT_DROP.into();
        push(Chain::Forward, None, vec![iif()], Verdict::Drop, c);
    }

    // Input: the tunnel reaches no listener of this host (the health port, sshd, ...): only
    // replies to connections the host opened, ICMP, and connections our ingress DNAT sent to
    // a target that is a local address. Forwarded ingress never passes here.
    if set.input_guard {
        let m = vec![iif(), Match::CtEstablished];
        let c = COMMENT_INPUT_RETURN.into();
        push(Chain::Input, None, m, Verdict::Accept, c);
        for f in Family::ALL {
            let c = COMMENT_INPUT_ICMP.into();
            push(
                Chain::Input,
                Some(f),
                vec![iif(), Match::Icmp],
                Verdict::Accept,
                c,
            );
        }
        for r in &set.ingress {
            let mut m = vec![iif(), Match::Daddr(hosts(&r.targets))];
            m.extend(r.port.map(|p| Match::Dport(p.proto, p.target)));
            m.push(Match::CtDnat {
                orig_daddr: r.tunnel_addrs.clone(),
                orig_dport: r.port.map(|p| p.listen),
            });
            // Its own comment: the same matches as the forward accept, in another chain.
            let c = format!("{} to this host", r.origin);
            push(Chain::Input, Some(r.family), m, Verdict::Accept, c);
        }
        // Refused rather than dropped: unreachable either way, and a peer that connects to
        // an unlisted port of the tunnel address fails at once, as it did before the guard.
        let m = vec![iif(), Match::L4(Proto::Tcp)];
        let (c, reject) = (COMMENT_INPUT_DROP, Verdict::Reject { tcp_reset: true });
        push(Chain::Input, None, m, reject, c.into());
        let reject = Verdict::Reject { tcp_reset: false };
        push(Chain::Input, None, vec![iif()], reject, c.into());
    }

    // MSS: exactly one rule per direction.
    if set.mss_clamp {
        for dir in [iif(), oif()] {
            let m = vec![dir, Match::TcpSyn];
            push(
                Chain::Mss,
                None,
                m,
                Verdict::ClampMssToPmtu,
                COMMENT_MSS.into(),
            );
        }
    }
    out
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

/// Whether a network is a single address (rendered without a prefix length in nftables).
/// DNAT to `targets`, rewriting the port only where the mapping changes it.
fn dnat(port: Option<crate::config::PortMap>, targets: &BTreeSet<IpAddr>) -> Verdict {
    Verdict::Dnat {
        targets: targets.clone(),
        port: port.filter(|p| p.target != p.listen).map(|p| p.target),
    }
}

pub fn is_host(net: &IpNet) -> bool {
    net.prefix_len() == net.max_prefix_len()
}
