//! Longest-prefix match from an IP address to the peer that owns it (WireGuard's cryptokey
//! routing table). Pure; lookups allocate nothing. Persistent ([`PMap`] per prefix length): a
//! clone is a few reference counts and a change copies one path, so the data plane's table can
//! change one peer's prefixes without copying every other peer's.

use crate::pmap::PMap;
use ipnet::IpNet;
use std::net::IpAddr;

/// The prefixes of one length, by their masked bits.
type OfLength<T> = (u8, PMap<u128, T>);

/// Prefixes grouped by length, longest first, so a lookup tries at most one probe per
/// distinct prefix length present (a handful in practice, at most 33 or 129).
#[derive(Debug, Clone)]
pub struct AllowedIps<T> {
    v4: Vec<OfLength<T>>,
    v6: Vec<OfLength<T>>,
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

/// The table of `net`'s family, its width, and `net`'s masked bits.
fn place<T>(t: &AllowedIps<T>, net: IpNet) -> (&[OfLength<T>], u128) {
    match net {
        IpNet::V4(_) => (&t.v4, mask(key(net.addr()), net.prefix_len(), 32)),
        IpNet::V6(_) => (&t.v6, mask(key(net.addr()), net.prefix_len(), 128)),
    }
}

impl<T: Clone> AllowedIps<T> {
    /// Adds `net` for `value`, replacing any previous owner of exactly that network.
    pub fn insert(&mut self, net: IpNet, value: T) -> Option<T> {
        let (table, width) = match net {
            IpNet::V4(_) => (&mut self.v4, 32),
            IpNet::V6(_) => (&mut self.v6, 128),
        };
        let len = net.prefix_len();
        let bits = mask(key(net.addr()), len, width);
        let pos = match table.binary_search_by(|(l, _)| len.cmp(l)) {
            Ok(p) => p,
            Err(p) => {
                table.insert(p, (len, PMap::default()));
                p
            }
        };
        table[pos].1.insert(bits, value)
    }

    /// Removes exactly `net`, returning its owner.
    pub fn remove(&mut self, net: IpNet) -> Option<T> {
        let (table, width) = match net {
            IpNet::V4(_) => (&mut self.v4, 32),
            IpNet::V6(_) => (&mut self.v6, 128),
        };
        let len = net.prefix_len();
        let bits = mask(key(net.addr()), len, width);
        let pos = table.binary_search_by(|(l, _)| len.cmp(l)).ok()?;
        let removed = table[pos].1.remove(&bits);
        if table[pos].1.is_empty() {
            table.remove(pos);
        }
        removed
    }

    /// Drops every prefix whose owner matches `pred`.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for table in [&mut self.v4, &mut self.v6] {
            for (_, map) in table.iter_mut() {
                let gone: Vec<u128> = map
                    .iter()
                    .filter(|(_, v)| !keep(v))
                    .map(|(k, _)| *k)
                    .collect();
                for k in gone {
                    map.remove(&k);
                }
            }
            table.retain(|(_, map)| !map.is_empty());
        }
    }
}

impl<T> AllowedIps<T> {
    /// The owner of exactly `net`.
    pub fn get(&self, net: IpNet) -> Option<&T> {
        let (table, bits) = place(self, net);
        let len = net.prefix_len();
        let pos = table.binary_search_by(|(l, _)| len.cmp(l)).ok()?;
        table[pos].1.get(&bits)
    }

    /// The owner of the longest prefix containing `addr`.
    #[inline]
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

    #[test]
    fn remove_takes_exactly_one_prefix_and_clones_keep_theirs() {
        let mut t = AllowedIps::default();
        t.insert(net("10.0.0.0/8"), 1);
        t.insert(net("10.1.0.0/16"), 2);
        let before = t.clone();
        assert_eq!(t.remove(net("10.1.0.0/16")), Some(2));
        assert_eq!(t.remove(net("10.1.0.0/16")), None);
        assert_eq!(t.get(net("10.0.0.0/8")), Some(&1));
        assert_eq!(t.lookup(ip("10.1.0.1")), Some(&1));
        assert_eq!(
            before.lookup(ip("10.1.0.1")),
            Some(&2),
            "the clone is untouched"
        );
        assert_eq!(t.len(), 1);
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
