//! What the config file's `[[peer]]` list was when the core last took it, kept without the
//! list itself: a digest that tells an unchanged list from a changed one, and the endpoints
//! the file gave (which a reload compares, so that a peer keeps where it roamed). The peers
//! themselves live once, as the core's specs; at 100,000 peers a second copy of the list was
//! 20 MB held only to be compared.

use crate::config::{Config, Endpoint, IpNet, Peer, PublicKey};
use blake2::{Blake2s256, Digest};
use std::collections::BTreeMap;

/// See the module documentation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct ConfiguredPeers {
    /// [`digest`] of the list, in the file's order (as `Vec` equality compared it).
    digest: [u8; 32],
    /// The endpoint of each peer the file gave one.
    pub(super) endpoints: BTreeMap<PublicKey, Endpoint>,
}

impl ConfiguredPeers {
    pub(super) fn of(peers: &[Peer]) -> ConfiguredPeers {
        ConfiguredPeers {
            digest: digest(peers),
            endpoints: peers
                .iter()
                .filter_map(|p| Some((p.public_key, p.endpoint.clone()?)))
                .collect(),
        }
    }

    /// Whether `peers` is the list this was taken from.
    pub(super) fn is(&self, peers: &[Peer]) -> bool {
        digest(peers) == self.digest
    }
}

/// Whether `a` and `b` are the same but for their peers. Every field is named, so a field
/// added to [`Config`] is compared or consciously left out.
pub(super) fn same_but_peers(a: &Config, b: &Config) -> bool {
    let Config {
        interface,
        peers: _,
        firewall,
        ingress,
        egress,
        router,
        dns,
        health,
        takeover,
    } = a;
    *interface == b.interface
        && *firewall == b.firewall
        && *ingress == b.ingress
        && *egress == b.egress
        && *router == b.router
        && *dns == b.dns
        && *health == b.health
        && *takeover == b.takeover
}

/// A digest of every field of every peer, in order, each field tagged and each variable part
/// length-prefixed, so two different lists cannot encode alike.
fn digest(peers: &[Peer]) -> [u8; 32] {
    let mut hash = Blake2s256::new();
    hash.update((peers.len() as u64).to_le_bytes());
    for p in peers {
        // Destructured, so a field added to `Peer` is hashed or consciously left out.
        let Peer {
            name,
            public_key,
            preshared_key,
            endpoint,
            allowed_ips,
            persistent_keepalive,
        } = p;
        hash.update(public_key.0);
        bytes(&mut hash, name.as_deref().map(str::as_bytes));
        bytes(&mut hash, preshared_key.as_ref().map(|k| &k.0[..]));
        match endpoint {
            None => hash.update([0]),
            Some(Endpoint::Addr(addr)) => {
                hash.update([1]);
                bytes(&mut hash, Some(addr.to_string().as_bytes()));
            }
            Some(Endpoint::Host { host, port }) => {
                hash.update([2]);
                bytes(&mut hash, Some(host.as_bytes()));
                hash.update(port.to_le_bytes());
            }
        }
        hash.update((allowed_ips.len() as u64).to_le_bytes());
        for net in allowed_ips {
            match net {
                IpNet::V4(n) => {
                    hash.update([4, n.prefix_len()]);
                    hash.update(n.addr().octets());
                }
                IpNet::V6(n) => {
                    hash.update([6, n.prefix_len()]);
                    hash.update(n.addr().octets());
                }
            }
        }
        match persistent_keepalive {
            None => hash.update([0]),
            Some(secs) => {
                hash.update([1]);
                hash.update(secs.to_le_bytes());
            }
        }
    }
    hash.finalize().into()
}

/// `None`, or the bytes with their length before them.
fn bytes(hash: &mut Blake2s256, part: Option<&[u8]>) {
    match part {
        None => hash.update([0]),
        Some(b) => {
            hash.update([1]);
            hash.update((b.len() as u64).to_le_bytes());
            hash.update(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SecretKey;

    /// One change to a list of peers, named.
    type Change = (&'static str, Box<dyn Fn(&mut Vec<Peer>)>);

    fn peer(byte: u8) -> Peer {
        Peer {
            name: None,
            public_key: PublicKey([byte; 32]),
            preshared_key: None,
            endpoint: None,
            allowed_ips: vec!["10.0.0.1/32".parse().expect("test address")],
            persistent_keepalive: None,
        }
    }

    /// Each field of a peer, and the list's order, tell a list from the one it was taken from;
    /// the same list (another copy) is the same.
    #[test]
    fn any_change_to_any_peer_is_a_different_list() {
        let base = vec![peer(1), peer(2)];
        let taken = ConfiguredPeers::of(&base);
        assert!(taken.is(&base.clone()));
        let changes: Vec<Change> = vec![
            ("name", Box::new(|l| l[0].name = Some("a".into()))),
            ("empty name", Box::new(|l| l[0].name = Some(String::new()))),
            ("key", Box::new(|l| l[1].public_key = PublicKey([3; 32]))),
            (
                "preshared key",
                Box::new(|l| l[0].preshared_key = Some(SecretKey([0; 32]))),
            ),
            (
                "endpoint",
                Box::new(|l| {
                    l[0].endpoint = Some(Endpoint::Addr("[::1]:1".parse().expect("test address")))
                }),
            ),
            (
                "endpoint name",
                Box::new(|l| {
                    l[0].endpoint = Some(Endpoint::Host {
                        host: "a".into(),
                        port: 1,
                    })
                }),
            ),
            (
                "allowed IPs",
                Box::new(|l| l[0].allowed_ips = vec!["10.0.0.1/31".parse().expect("test address")]),
            ),
            ("no allowed IPs", Box::new(|l| l[0].allowed_ips.clear())),
            (
                "an allowed IP more",
                Box::new(|l| l[0].allowed_ips.push("::/0".parse().expect("test address"))),
            ),
            (
                "keepalive",
                Box::new(|l| l[0].persistent_keepalive = Some(0)),
            ),
            ("order", Box::new(|l| l.swap(0, 1))),
            ("a peer less", Box::new(|l| drop(l.pop()))),
            ("a peer more", Box::new(|l| l.push(peer(9)))),
        ];
        for (what, change) in changes {
            let mut list = base.clone();
            change(&mut list);
            assert!(!taken.is(&list), "{what}: taken as the same list");
        }
    }

    /// Two names (or a name and a host) that concatenate alike are still told apart.
    #[test]
    fn variable_parts_cannot_run_into_each_other() {
        let mut a = peer(1);
        a.name = Some("ab".into());
        a.endpoint = Some(Endpoint::Host {
            host: "c".into(),
            port: 1,
        });
        let mut b = peer(1);
        b.name = Some("a".into());
        b.endpoint = Some(Endpoint::Host {
            host: "bc".into(),
            port: 1,
        });
        assert!(!ConfiguredPeers::of(&[a]).is(&[b]));
    }

    /// Only peers with an endpoint are kept, with it.
    #[test]
    fn keeps_the_endpoints_the_file_gave() {
        let mut with = peer(1);
        with.endpoint = Some(Endpoint::Addr(
            "192.0.2.1:51820".parse().expect("test address"),
        ));
        let taken = ConfiguredPeers::of(&[with.clone(), peer(2)]);
        assert_eq!(
            taken.endpoints,
            BTreeMap::from([(with.public_key, with.endpoint.expect("set above"))])
        );
    }
}
