//! The live peer table the packet loops read: an immutable snapshot swapped whole when peers
//! change, so a batch takes one `Arc` clone and no lock; unchanged peers keep their sessions.

use crate::config::{PublicKey, SecretKey};
use crate::core::allowed_ips::AllowedIps;
use crate::core::control::{PeerChanges, PeerSpec, PeerUpsert, SessionEffect};
use crate::core::packet::PeerPath;
use crate::core::wg::{Limiter, Tunnel};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Traffic counters of one peer, in WireGuard datagram bytes (what `wg show` reports).
#[derive(Debug, Default)]
pub struct PeerCounters {
    pub rx_bytes: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_packets: AtomicU64,
    pub tx_packets: AtomicU64,
    pub handshakes_sent: AtomicU64,
    pub handshake_failures: AtomicU64,
    /// Unix milliseconds of the last handshake that was logged (0 = none yet).
    pub handshake_logged_ms: AtomicU64,
    /// Whether the first handshake was started for a peer with persistent keepalive.
    pub initiated: std::sync::atomic::AtomicBool,
}

/// The settings of a peer, as configured or set over UAPI (decided by the control core).
pub type PeerSettings = PeerSpec;

/// One peer of one table generation. A peer whose settings change but whose session stays
/// (allowed IPs, keepalive) gets a new `Peer` sharing the old one's session, endpoint and
/// counters, so a packet loop holding the previous table keeps working on the same session.
pub struct Peer {
    pub public_key: PublicKey,
    pub index: u32,
    pub settings: PeerSettings,
    pub tunnel: Arc<Mutex<Tunnel>>,
    /// Where the peer is reached, and the local address replies leave from.
    pub endpoint: Arc<RwLock<Option<PeerPath>>>,
    pub counters: Arc<PeerCounters>,
}

impl Peer {
    /// The peer's address (what `wg show` calls its endpoint).
    pub fn endpoint(&self) -> Option<SocketAddr> {
        self.endpoint.read().map(|p| p.remote)
    }

    /// Its address and the local address replies leave from.
    pub fn path(&self) -> Option<PeerPath> {
        *self.endpoint.read()
    }

    /// Forgets the local source `gone` (removed from this host) if this peer replies from it.
    pub fn forget_source(&self, gone: std::net::IpAddr) {
        let mut path = self.endpoint.write();
        if let Some(p) = path.as_mut().filter(|p| p.local == Some(gone)) {
            p.local = None;
        }
    }
}

/// One consistent view of the interface's identity and peers.
pub struct PeerTable {
    /// `None`: the key was removed over UAPI; the packet loops then drop everything, as a
    /// key-less wireguard-go does, and the peers wait for a key.
    pub private_key: Option<SecretKey>,
    /// The key the peers' tunnels are built with: the private key, or a throwaway one while
    /// there is none (never used: nothing is processed without a key).
    tunnel_key: SecretKey,
    pub public_key: PublicKey,
    pub limiter: Arc<Limiter>,
    pub peers: BTreeMap<PublicKey, Arc<Peer>>,
    pub by_index: HashMap<u32, Arc<Peer>>,
    pub routes: AllowedIps<Arc<Peer>>,
}

/// What a change to the table did, for logs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TableChange {
    pub added: Vec<PublicKey>,
    pub removed: Vec<PublicKey>,
    /// New session (preshared key or interface key changed).
    pub reset: Vec<PublicKey>,
    /// Settings changed, session kept (allowed IPs, keepalive).
    pub updated: Vec<PublicKey>,
}

impl PeerCounters {
    /// One datagram of `len` bytes sent to the peer (data, handshake or keepalive alike).
    pub fn sent(&self, len: usize) {
        self.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.tx_packets.fetch_add(1, Ordering::Relaxed);
    }
}

static NEXT_INDEX: AtomicU32 = AtomicU32::new(1);

fn next_index() -> u32 {
    // 24 bits identify a peer in message indices; wrap-around needs 16M peer (re)creations.
    NEXT_INDEX.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff
}

impl PeerTable {
    pub fn empty(private_key: Option<SecretKey>) -> PeerTable {
        let tunnel_key = private_key.clone().unwrap_or_else(SecretKey::generate);
        let public_key = tunnel_key.public_key();
        PeerTable {
            limiter: Arc::new(Limiter::new(&public_key)),
            private_key,
            tunnel_key,
            public_key,
            peers: BTreeMap::new(),
            by_index: HashMap::new(),
            routes: AllowedIps::default(),
        }
    }

    /// The next table generation after `changes`. Peers not named keep their `Arc`; an
    /// upserted peer keeps its session unless its preshared key changed; a changed interface
    /// key re-keys every kept session (boringtun keeps the session state).
    pub fn apply(&self, changes: &PeerChanges) -> (PeerTable, TableChange) {
        let key_changed = changes.private_key.is_some();
        let mut next = match &changes.private_key {
            Some(key) => PeerTable::empty(key.clone()),
            None => PeerTable {
                private_key: self.private_key.clone(),
                tunnel_key: self.tunnel_key.clone(),
                public_key: self.public_key,
                limiter: self.limiter.clone(),
                peers: BTreeMap::new(),
                by_index: HashMap::new(),
                routes: AllowedIps::default(),
            },
        };
        let private_key = &next.tunnel_key.clone();
        let mut change = TableChange::default();
        let upserts: BTreeMap<PublicKey, &PeerUpsert> =
            changes.upsert.iter().map(|u| (u.public_key, u)).collect();
        for (key, old) in &self.peers {
            if changes.remove.contains(key) || upserts.contains_key(key) {
                continue;
            }
            if key_changed {
                old.tunnel
                    .lock()
                    .set_private_key(private_key, &next.limiter);
                change.reset.push(*key);
            }
            next.insert(old.clone());
        }
        for (key, upsert) in upserts {
            let existing = self.peers.get(&key);
            let kept = existing
                .map(|old| (old, old.settings.update_to(&upsert.spec)))
                .filter(|(_, effect)| *effect != SessionEffect::NewSession);
            let peer = match kept {
                Some((old, effect)) => {
                    if key_changed {
                        old.tunnel
                            .lock()
                            .set_private_key(private_key, &next.limiter);
                        change.reset.push(key);
                    } else if effect != SessionEffect::Unchanged {
                        change.updated.push(key);
                    }
                    if effect
                        == (SessionEffect::KeepSession {
                            keepalive_changed: true,
                        })
                    {
                        old.tunnel
                            .lock()
                            .set_persistent_keepalive(upsert.spec.persistent_keepalive);
                    }
                    if upsert.endpoint.is_some() {
                        *old.endpoint.write() = upsert.endpoint.map(PeerPath::to);
                    }
                    Arc::new(Peer {
                        public_key: key,
                        index: old.index,
                        settings: upsert.spec.clone(),
                        tunnel: old.tunnel.clone(),
                        endpoint: old.endpoint.clone(),
                        counters: old.counters.clone(),
                    })
                }
                None => {
                    if existing.is_some() {
                        change.reset.push(key);
                    } else {
                        change.added.push(key);
                    }
                    let roamed = existing.and_then(|o| o.path());
                    new_peer(
                        &key,
                        &upsert.spec,
                        upsert.endpoint.map(PeerPath::to).or(roamed),
                        private_key,
                        &next.limiter,
                    )
                }
            };
            next.insert(peer);
        }
        change.removed = changes
            .remove
            .iter()
            .filter(|k| self.peers.contains_key(k))
            .copied()
            .collect();
        (next, change)
    }

    fn insert(&mut self, peer: Arc<Peer>) {
        for net in &peer.settings.allowed_ips {
            self.routes.insert(*net, peer.clone());
        }
        self.by_index.insert(peer.index, peer.clone());
        self.peers.insert(peer.public_key, peer);
    }
}

fn new_peer(
    key: &PublicKey,
    spec: &PeerSpec,
    endpoint: Option<PeerPath>,
    private_key: &SecretKey,
    limiter: &Arc<Limiter>,
) -> Arc<Peer> {
    let index = next_index();
    Arc::new(Peer {
        public_key: *key,
        index,
        tunnel: Arc::new(Mutex::new(Tunnel::new(
            private_key,
            key,
            spec.preshared_key.as_ref(),
            spec.persistent_keepalive,
            index,
            limiter,
        ))),
        endpoint: Arc::new(RwLock::new(endpoint)),
        settings: spec.clone(),
        counters: Arc::new(PeerCounters::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::IpNet;

    fn spec(keepalive: Option<u16>, nets: &[&str], psk: Option<SecretKey>) -> PeerSpec {
        PeerSpec {
            name: None,
            preshared_key: psk,
            persistent_keepalive: keepalive,
            allowed_ips: nets
                .iter()
                .map(|n| n.parse::<IpNet>().expect("net"))
                .collect(),
        }
    }

    fn upsert(key: PublicKey, spec: PeerSpec) -> PeerChanges {
        PeerChanges {
            private_key: None,
            upsert: vec![PeerUpsert {
                public_key: key,
                spec,
                endpoint: None,
            }],
            remove: vec![],
        }
    }

    #[test]
    fn settings_changes_keep_the_session_and_a_new_psk_does_not() {
        let own = SecretKey::generate();
        let peer = SecretKey::generate().public_key();
        let table = PeerTable::empty(Some(own));
        let (table, change) = table.apply(&upsert(peer, spec(Some(25), &["10.0.0.0/24"], None)));
        assert_eq!(change.added, vec![peer]);
        let first = table.peers[&peer].clone();
        *first.endpoint.write() = Some(PeerPath {
            remote: "192.0.2.1:51820".parse().expect("addr"),
            local: Some("192.0.2.200".parse().expect("ip")),
        });

        let (table, change) = table.apply(&upsert(peer, spec(Some(5), &["10.0.1.0/24"], None)));
        assert_eq!(change.updated, vec![peer]);
        let second = table.peers[&peer].clone();
        assert!(Arc::ptr_eq(&first.tunnel, &second.tunnel), "same session");
        assert!(Arc::ptr_eq(&first.counters, &second.counters));
        assert_eq!(second.index, first.index);
        assert_eq!(
            second.path(),
            first.path(),
            "roamed endpoint and source kept"
        );
        let looked_up = table.routes.lookup("10.0.1.7".parse().expect("ip"));
        assert!(looked_up.is_some_and(|p| Arc::ptr_eq(p, &second)));
        assert!(table
            .routes
            .lookup("10.0.0.7".parse().expect("ip"))
            .is_none());

        let psk = Some(SecretKey::generate());
        let (table, change) = table.apply(&upsert(peer, spec(Some(5), &["10.0.1.0/24"], psk)));
        assert_eq!(change.reset, vec![peer]);
        assert!(!Arc::ptr_eq(&table.peers[&peer].tunnel, &second.tunnel));

        let (table, change) = table.apply(&PeerChanges {
            remove: vec![peer],
            ..PeerChanges::default()
        });
        assert_eq!(change.removed, vec![peer]);
        assert!(table.peers.is_empty() && table.by_index.is_empty());
    }
}
