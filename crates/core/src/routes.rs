//! Desired routes and policy rules for the tunnel, and the diff between two such sets. Pure.
//!
//! Every allowed IP of every peer is routed through the TUN device in the main table, except
//! default routes (`0.0.0.0/0`, `::/0`): those go into a table of their own, selected by a
//! policy rule for packets that do NOT carry the WireGuard socket's fwmark, so the encrypted
//! packets to the peers' endpoints still leave by the normal default route (what wg-quick does).

use ipnet::IpNet;
use std::collections::BTreeSet;

/// The kernel's main routing table.
pub const MAIN_TABLE: u32 = 254;
/// Table and fwmark used for default routes unless `interface.fwmark` says otherwise
/// (wg-quick's default, 51820).
pub const DEFAULT_FWMARK: u32 = 51820;
/// Policy rule priorities: below the kernel's main (32766) rule, clear of common users.
const PRIORITY_SUPPRESS: u32 = 5250;
const PRIORITY_NOT_FWMARK: u32 = 5251;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub net: IpNet,
    pub table: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RuleKind {
    /// `lookup main suppress_prefixlength 0`: use main unless its answer is the default route.
    SuppressDefault,
    /// `not fwmark M lookup T`: everything except the tunnel's own encrypted packets.
    NotFwmark(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyRule {
    pub v6: bool,
    pub priority: u32,
    pub table: u32,
    pub kind: RuleKind,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutePlan {
    pub routes: BTreeSet<Route>,
    pub rules: BTreeSet<PolicyRule>,
    /// The mark the WireGuard socket needs (set when any default route is present).
    pub fwmark: Option<u32>,
}

/// The two default routes, IPv4's and IPv6's.
pub const DEFAULT_ROUTES: [IpNet; 2] = [
    IpNet::V4(ipnet::Ipv4Net::new_assert(
        std::net::Ipv4Addr::UNSPECIFIED,
        0,
    )),
    IpNet::V6(ipnet::Ipv6Net::new_assert(
        std::net::Ipv6Addr::UNSPECIFIED,
        0,
    )),
];

/// The table of the default routes, which is also the mark of the tunnel's own packets:
/// `interface.fwmark`, else [`DEFAULT_FWMARK`].
pub fn default_table(fwmark: Option<u32>) -> u32 {
    fwmark.unwrap_or(DEFAULT_FWMARK)
}

/// The route of one allowed IP: a default route goes into `default_table`, the rest into
/// the main table.
pub fn route_for(net: IpNet, default_table: u32) -> Route {
    let net = net.trunc();
    let table = if net.prefix_len() == 0 {
        default_table
    } else {
        MAIN_TABLE
    };
    Route { net, table }
}

/// Every route of `net`, whatever its table, as a range of an ordered set of routes.
pub fn routes_of(net: IpNet) -> std::ops::RangeInclusive<Route> {
    Route { net, table: 0 }..=Route {
        net,
        table: u32::MAX,
    }
}

/// The policy rules the default routes present (IPv4's, IPv6's) need.
pub fn default_rules(v4: bool, v6: bool, table: u32) -> BTreeSet<PolicyRule> {
    let mut rules = BTreeSet::new();
    for v6 in [false, true]
        .into_iter()
        .filter(|f| if *f { v6 } else { v4 })
    {
        rules.insert(PolicyRule {
            v6,
            priority: PRIORITY_SUPPRESS,
            table: MAIN_TABLE,
            kind: RuleKind::SuppressDefault,
        });
        rules.insert(PolicyRule {
            v6,
            priority: PRIORITY_NOT_FWMARK,
            table,
            kind: RuleKind::NotFwmark(table),
        });
    }
    rules
}

/// Routes for `allowed_ips` (all peers together). `fwmark` is the configured mark, if any.
pub fn plan<'a>(
    allowed_ips: impl IntoIterator<Item = &'a IpNet>,
    fwmark: Option<u32>,
) -> RoutePlan {
    let table = default_table(fwmark);
    let mut plan = RoutePlan {
        fwmark,
        ..RoutePlan::default()
    };
    let (mut v4, mut v6) = (false, false);
    for net in allowed_ips {
        crate::cost::charge(1);
        let route = route_for(*net, table);
        if route.net.prefix_len() == 0 {
            match route.net {
                IpNet::V4(_) => v4 = true,
                IpNet::V6(_) => v6 = true,
            }
            plan.fwmark = Some(table);
        }
        plan.routes.insert(route);
    }
    plan.rules = default_rules(v4, v6, table);
    plan
}

/// What to remove and add to go from `current` to `desired`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanDiff {
    pub remove_routes: Vec<Route>,
    pub add_routes: Vec<Route>,
    pub remove_rules: Vec<PolicyRule>,
    pub add_rules: Vec<PolicyRule>,
}

impl PlanDiff {
    pub fn is_empty(&self) -> bool {
        self.remove_routes.is_empty()
            && self.add_routes.is_empty()
            && self.remove_rules.is_empty()
            && self.add_rules.is_empty()
    }
}

pub fn diff(current: &RoutePlan, desired: &RoutePlan) -> PlanDiff {
    PlanDiff {
        remove_routes: current
            .routes
            .difference(&desired.routes)
            .copied()
            .collect(),
        add_routes: desired
            .routes
            .difference(&current.routes)
            .copied()
            .collect(),
        remove_rules: current.rules.difference(&desired.rules).copied().collect(),
        add_rules: desired.rules.difference(&current.rules).copied().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().expect("net")).collect()
    }

    #[test]
    fn plain_networks_go_to_main() {
        let p = plan(&nets(&["10.0.0.0/24", "fd00::/64"]), None);
        assert_eq!(p.routes.len(), 2);
        assert!(p.routes.iter().all(|r| r.table == MAIN_TABLE));
        assert!(p.rules.is_empty());
        assert_eq!(p.fwmark, None);
    }

    #[test]
    fn default_route_gets_its_table_rules_and_mark() {
        let p = plan(&nets(&["0.0.0.0/0", "::/0", "10.0.0.0/24"]), None);
        assert_eq!(p.fwmark, Some(DEFAULT_FWMARK));
        assert!(p.routes.contains(&Route {
            net: "0.0.0.0/0".parse().expect("net"),
            table: DEFAULT_FWMARK
        }));
        assert_eq!(p.rules.len(), 4, "suppress + not-fwmark, per family");
        let custom = plan(&nets(&["0.0.0.0/0"]), Some(0x1234));
        assert!(custom
            .rules
            .iter()
            .any(|r| r.kind == RuleKind::NotFwmark(0x1234)));
    }

    fn arb_plan() -> impl Strategy<Value = RoutePlan> {
        prop::collection::vec((any::<u32>(), 0u8..=32), 0..12).prop_map(|v| {
            let list: Vec<IpNet> = v
                .into_iter()
                .map(|(b, l)| IpNet::new(std::net::IpAddr::from(b.to_be_bytes()), l).expect("len"))
                .collect();
            plan(&list, None)
        })
    }

    proptest! {
        /// Applying diff(a, b) to a gives exactly b.
        #[test]
        fn diff_applied_to_a_gives_b(a in arb_plan(), b in arb_plan()) {
            let d = diff(&a, &b);
            let mut routes = a.routes.clone();
            for r in &d.remove_routes { routes.remove(r); }
            routes.extend(d.add_routes.iter().copied());
            let mut rules = a.rules.clone();
            for r in &d.remove_rules { rules.remove(r); }
            rules.extend(d.add_rules.iter().copied());
            prop_assert_eq!(routes, b.routes.clone());
            prop_assert_eq!(rules, b.rules.clone());
            prop_assert!(diff(&b, &b).is_empty());
        }
    }
}
