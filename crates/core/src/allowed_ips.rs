//! Longest-prefix match from an IP address to the peer that owns it (WireGuard's cryptokey
//! routing table). Pure; lookups allocate nothing.

use ipnet::IpNet;
use std::collections::HashMap;
use std::net::IpAddr;

/// Prefixes grouped by length, longest first, so a lookup tries at most one hash probe per
/// distinct prefix length present (a handful in practice, at most 33 or 129).
#[derive(Debug, Clone)]
pub struct AllowedIps<T> {
    v4: Vec<(u8, HashMap<u128, T>)>,
    v6: Vec<(u8, HashMap<u128, T>)>,
}

impl<T> Default for AllowedIps<T> {
    fn default() -> Self {
        AllowedIps {
            v4: Vec::new(),
            v6: Vec::new(),
        }
    }
}

fn key(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u32::from(a).into(),
        IpAddr::V6(a) => u128::from(a),
    }
}

fn mask(bits: u128, len: u8, width: u8) -> u128 {
    if len == 0 {
        0
    } else {
        let shift = width - len;
        (bits >> shift) << shift
    }
}

impl<T> AllowedIps<T> {
    /// Adds `net` for `value`, replacing any previous owner of exactly that network.
    pub fn insert(&mut self, net: IpNet, value: T) {
        let (table, width) = match net {
            IpNet::V4(_) => (&mut self.v4, 32),
            IpNet::V6(_) => (&mut self.v6, 128),
        };
        let len = net.prefix_len();
        let bits = mask(key(net.addr()), len, width);
        let pos = match table.binary_search_by(|(l, _)| len.cmp(l)) {
            Ok(p) => p,
            Err(p) => {
                table.insert(p, (len, HashMap::new()));
                p
            }
        };
        table[pos].1.insert(bits, value);
    }

    /// The owner of the longest prefix containing `addr`.
    pub fn lookup(&self, addr: IpAddr) -> Option<&T> {
        let (table, width) = match addr {
            IpAddr::V4(_) => (&self.v4, 32),
            IpAddr::V6(_) => (&self.v6, 128),
        };
        let bits = key(addr);
        table
            .iter()
            .find_map(|(len, map)| map.get(&mask(bits, *len, width)))
    }

    /// Drops every prefix whose owner matches `pred`.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for table in [&mut self.v4, &mut self.v6] {
            for (_, map) in table.iter_mut() {
                map.retain(|_, v| keep(v));
            }
            table.retain(|(_, map)| !map.is_empty());
        }
    }

    pub fn len(&self) -> usize {
        self.v4.iter().chain(&self.v6).map(|(_, m)| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("network")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn longest_prefix_wins() {
        let mut t = AllowedIps::default();
        t.insert(net("0.0.0.0/0"), 'd');
        t.insert(net("10.0.0.0/8"), 'a');
        t.insert(net("10.1.0.0/16"), 'b');
        t.insert(net("10.1.2.3/32"), 'c');
        t.insert(net("fd00::/64"), 'v');
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(&'c'));
        assert_eq!(t.lookup(ip("10.1.2.4")), Some(&'b'));
        assert_eq!(t.lookup(ip("10.2.0.1")), Some(&'a'));
        assert_eq!(t.lookup(ip("192.0.2.1")), Some(&'d'));
        assert_eq!(t.lookup(ip("fd00::1")), Some(&'v'));
        assert_eq!(
            t.lookup(ip("fd01::1")),
            None,
            "v4 default must not match v6"
        );
    }

    #[test]
    fn retain_removes_a_peer_everywhere() {
        let mut t = AllowedIps::default();
        t.insert(net("10.0.0.0/8"), 1);
        t.insert(net("fd00::/8"), 1);
        t.insert(net("10.1.0.0/16"), 2);
        t.retain(|v| *v != 1);
        assert_eq!(t.len(), 1);
        assert_eq!(t.lookup(ip("10.2.0.1")), None);
        assert_eq!(t.lookup(ip("10.1.0.1")), Some(&2));
    }

    proptest! {
        /// The table agrees with a brute-force scan over the inserted networks.
        #[test]
        fn matches_brute_force(nets in prop::collection::vec((any::<u32>(), 0u8..=32), 1..40), probes in prop::collection::vec(any::<u32>(), 1..40)) {
            let mut t = AllowedIps::default();
            let mut list: Vec<(IpNet, usize)> = Vec::new();
            for (i, (bits, len)) in nets.iter().enumerate() {
                let n = IpNet::new(IpAddr::from(bits.to_be_bytes()), *len).expect("len").trunc();
                t.insert(n, i);
                list.retain(|(m, _)| *m != n);
                list.push((n, i));
            }
            for p in probes {
                let a = IpAddr::from(p.to_be_bytes());
                let expected = list.iter().filter(|(n, _)| n.contains(&a)).max_by_key(|(n, _)| n.prefix_len()).map(|(_, v)| v);
                prop_assert_eq!(t.lookup(a), expected);
            }
        }
    }
}
