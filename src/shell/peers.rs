//! The live peer table the packet loops read: an immutable snapshot swapped whole when peers
//! change, so a batch takes one `Arc` clone and no lock; unchanged peers keep their sessions.

use crate::config::{IpNet, Peer as PeerConfig, PublicKey, SecretKey};
use crate::core::allowed_ips::AllowedIps;
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

/// The desired settings of a peer, as configured or set over UAPI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSettings {
    pub preshared_key: Option<SecretKey>,
    pub persistent_keepalive: Option<u16>,
    pub allowed_ips: Vec<IpNet>,
}

pub struct Peer {
    pub public_key: PublicKey,
    pub index: u32,
    pub settings: PeerSettings,
    pub tunnel: Mutex<Tunnel>,
    pub endpoint: RwLock<Option<SocketAddr>>,
    pub counters: PeerCounters,
}

impl Peer {
    pub fn endpoint(&self) -> Option<SocketAddr> {
        *self.endpoint.read()
    }
}

/// One consistent view of the interface's identity and peers.
pub struct PeerTable {
    pub private_key: SecretKey,
    pub public_key: PublicKey,
    pub limiter: Arc<Limiter>,
    pub peers: BTreeMap<PublicKey, Arc<Peer>>,
    pub by_index: HashMap<u32, Arc<Peer>>,
    pub routes: AllowedIps<Arc<Peer>>,
}

/// What a change to the table did, for logs and the route layer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TableChange {
    pub added: Vec<PublicKey>,
    pub removed: Vec<PublicKey>,
    pub reset: Vec<PublicKey>,
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
    pub fn empty(private_key: SecretKey) -> PeerTable {
        let public_key = private_key.public_key();
        PeerTable {
            limiter: Arc::new(Limiter::new(&public_key)),
            private_key,
            public_key,
            peers: BTreeMap::new(),
            by_index: HashMap::new(),
            routes: AllowedIps::default(),
        }
    }

    /// A new table with `private_key` and `desired` peers. Peers whose key and settings are
    /// unchanged are carried over with their sessions and counters. An endpoint of `Some` sets
    /// the peer's endpoint; `None` keeps the current (possibly roamed) one.
    pub fn rebuild(
        &self,
        private_key: &SecretKey,
        desired: &BTreeMap<PublicKey, (PeerSettings, Option<SocketAddr>)>,
    ) -> (PeerTable, TableChange) {
        let key_changed = *private_key != self.private_key;
        let mut next = if key_changed {
            PeerTable::empty(private_key.clone())
        } else {
            PeerTable {
                private_key: self.private_key.clone(),
                public_key: self.public_key,
                limiter: self.limiter.clone(),
                peers: BTreeMap::new(),
                by_index: HashMap::new(),
                routes: AllowedIps::default(),
            }
        };
        let mut change = TableChange::default();
        for (key, (settings, endpoint)) in desired {
            let peer = match self.peers.get(key) {
                Some(old) if old.settings == *settings => {
                    if key_changed {
                        old.tunnel
                            .lock()
                            .set_private_key(private_key, &next.limiter);
                        change.reset.push(*key);
                    }
                    if endpoint.is_some() {
                        *old.endpoint.write() = *endpoint;
                    }
                    old.clone()
                }
                old => {
                    if old.is_some() {
                        change.reset.push(*key);
                    } else {
                        change.added.push(*key);
                    }
                    let index = next_index();
                    let roamed = old.and_then(|o| o.endpoint());
                    Arc::new(Peer {
                        public_key: *key,
                        index,
                        tunnel: Mutex::new(Tunnel::new(
                            private_key,
                            key,
                            settings.preshared_key.as_ref(),
                            settings.persistent_keepalive,
                            index,
                            &next.limiter,
                        )),
                        endpoint: RwLock::new(endpoint.or(roamed)),
                        settings: settings.clone(),
                        counters: PeerCounters::default(),
                    })
                }
            };
            next.insert(peer);
        }
        change.removed = self
            .peers
            .keys()
            .filter(|k| !desired.contains_key(k))
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

    /// The settings of every peer, to derive a modified desired state from. Endpoints are
    /// `None` (= keep the current one) so a rebuild never undoes roaming.
    pub fn desired(&self) -> BTreeMap<PublicKey, (PeerSettings, Option<SocketAddr>)> {
        self.peers
            .iter()
            .map(|(k, p)| (*k, (p.settings.clone(), None)))
            .collect()
    }
}

/// The peer settings a configuration asks for.
pub fn settings_of(peer: &PeerConfig) -> PeerSettings {
    PeerSettings {
        preshared_key: peer.preshared_key.clone(),
        persistent_keepalive: peer.persistent_keepalive,
        allowed_ips: peer.allowed_ips.clone(),
    }
}
