//! The peer table the packet workers read: an immutable snapshot swapped whole when peers
//! change, so a batch takes one `Arc` clone and no table lock; unchanged peers keep their
//! sessions. Each peer's live state (`core::peer::Peer`) sits behind its own lock, taken for
//! one call and never across a system call.

use crate::config::{PublicKey, SecretKey};
use crate::core::allowed_ips::AllowedIps;
use crate::core::control::{PeerChanges, PeerSpec, PeerUpsert, SessionEffect};
use crate::core::packet::{PeerLookup, PeerPath};
use crate::core::peer::Peer;
use crate::core::session_index::PeerIndices;
use crate::core::wg::Limiter;
use crate::shell::keys::GenerateKey as _;
use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

/// One peer of one table generation. A peer whose settings change but whose session stays
/// (allowed IPs, keepalive) gets a new slot sharing the old one's state, so a worker holding
/// the previous table keeps working on the same session.
pub(super) struct PeerSlot {
    public_key: PublicKey,
    index: u32,
    spec: PeerSpec,
    state: Arc<Mutex<Peer>>,
}

impl PeerSlot {
    pub(super) fn public_key(&self) -> &PublicKey {
        &self.public_key
    }

    /// The table index (`core::session_index`: the same for the same private key and peer in
    /// any process): its low byte picks the worker its datagrams arrive on.
    pub(super) fn index(&self) -> u32 {
        self.index
    }

    pub(super) fn spec(&self) -> &PeerSpec {
        &self.spec
    }

    /// The peer's live state. Bind the guard to a name and drop it before any system call.
    #[inline]
    pub(super) fn lock(&self) -> MutexGuard<'_, Peer> {
        self.state.lock()
    }
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

/// One consistent view of the interface's identity and peers.
pub(super) struct PeerTable {
    /// `None`: the key was removed over UAPI; the workers then drop everything, as a key-less
    /// wireguard-go does, and the peers wait for a key.
    private_key: Option<SecretKey>,
    /// The key the peers' sessions are built with: the private key, or a throwaway one while
    /// there is none (never used: nothing is processed without a key).
    tunnel_key: SecretKey,
    public_key: PublicKey,
    limiter: Arc<Limiter>,
    /// Derives the peers' table indices from the tunnel key.
    indices: PeerIndices,
    peers: BTreeMap<PublicKey, Arc<PeerSlot>>,
    by_index: HashMap<u32, Arc<PeerSlot>>,
    routes: AllowedIps<Arc<PeerSlot>>,
}

impl PeerTable {
    pub(super) fn empty(private_key: Option<SecretKey>) -> PeerTable {
        let tunnel_key = private_key.clone().unwrap_or_else(SecretKey::generate);
        let public_key = tunnel_key.public_key();
        PeerTable {
            // The OS supplies the randomness (cookie secrets here, ephemeral keys below).
            limiter: Arc::new(Limiter::new(&public_key, &mut rand_core::OsRng)),
            indices: PeerIndices::new(&tunnel_key),
            private_key,
            tunnel_key,
            public_key,
            peers: BTreeMap::new(),
            by_index: HashMap::new(),
            routes: AllowedIps::default(),
        }
    }

    pub(super) fn private_key(&self) -> Option<&SecretKey> {
        self.private_key.as_ref()
    }

    pub(super) fn public_key(&self) -> &PublicKey {
        &self.public_key
    }

    pub(super) fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    pub(super) fn peers(&self) -> impl Iterator<Item = &Arc<PeerSlot>> {
        self.peers.values()
    }

    /// The peer with `key`, if it is one.
    pub(super) fn slot(&self, key: &PublicKey) -> Option<&Arc<PeerSlot>> {
        self.peers.get(key)
    }

    /// Whether `slot` (perhaps of an older table) is still one of this table's peers: the
    /// same live state, not a peer removed or made again since.
    pub(super) fn holds(&self, slot: &PeerSlot) -> bool {
        self.peers
            .get(&slot.public_key)
            .is_some_and(|mine| Arc::ptr_eq(&mine.state, &slot.state))
    }

    /// The next table generation after `changes`. Peers not named keep their slot; an
    /// upserted peer keeps its session unless its preshared key changed; a changed interface
    /// key re-keys every kept session (boringtun keeps the session state).
    pub(super) fn apply(&self, changes: &PeerChanges) -> (PeerTable, TableChange) {
        let key_changed = changes.private_key.is_some();
        let mut next = match &changes.private_key {
            Some(key) => PeerTable::empty(key.clone()),
            None => PeerTable {
                private_key: self.private_key.clone(),
                tunnel_key: self.tunnel_key.clone(),
                public_key: self.public_key,
                limiter: self.limiter.clone(),
                indices: self.indices.clone(),
                peers: BTreeMap::new(),
                by_index: HashMap::new(),
                routes: AllowedIps::default(),
            },
        };
        let tunnel_key = next.tunnel_key.clone();
        let mut change = TableChange::default();
        let upserts: BTreeMap<PublicKey, &PeerUpsert> =
            changes.upsert.iter().map(|u| (u.public_key, u)).collect();
        // The first key (peers set before it over UAPI): no peer can have a session yet, so
        // each is made again with the index this identity gives it, as another process with
        // the same key and peers would (`core::session_index`).
        let first_key = key_changed && self.private_key.is_none();
        for (key, old) in &self.peers {
            if changes.remove.contains(key) || upserts.contains_key(key) {
                continue;
            }
            if first_key {
                let index = self.free_index(&next, key, true, changes);
                let mut peer = Peer::new(
                    &tunnel_key,
                    key,
                    &old.spec,
                    index,
                    &next.limiter,
                    old.lock().path(),
                    Box::new(rand_core::OsRng),
                );
                peer.inherit_known_endpoints(&old.lock());
                change.reset.push(*key);
                next.insert(Arc::new(PeerSlot {
                    public_key: *key,
                    index,
                    spec: old.spec.clone(),
                    state: Arc::new(Mutex::new(peer)),
                }));
                continue;
            }
            if key_changed {
                old.lock().set_private_key(&tunnel_key, &next.limiter);
                change.reset.push(*key);
            }
            next.insert(old.clone());
        }
        for (key, upsert) in upserts {
            let existing = self.peers.get(&key);
            let kept = existing
                .map(|old| (old, old.spec.update_to(&upsert.spec)))
                .filter(|(_, effect)| *effect != SessionEffect::NewSession && !first_key);
            let slot = match kept {
                Some((old, effect)) => {
                    let mut state = old.lock();
                    if key_changed {
                        state.set_private_key(&tunnel_key, &next.limiter);
                        change.reset.push(key);
                    } else if effect != SessionEffect::Unchanged {
                        change.updated.push(key);
                    }
                    if let SessionEffect::KeepSession {
                        keepalive_changed: true,
                    } = effect
                    {
                        state.set_keepalive(upsert.spec.persistent_keepalive);
                    }
                    if let Some(endpoint) = upsert.endpoint {
                        state.set_endpoint(PeerPath::to(endpoint));
                    }
                    drop(state);
                    Arc::new(PeerSlot {
                        public_key: key,
                        index: old.index,
                        spec: upsert.spec.clone(),
                        state: old.state.clone(),
                    })
                }
                None => {
                    if existing.is_some() {
                        change.reset.push(key);
                    } else {
                        change.added.push(key);
                    }
                    let roamed = existing.and_then(|o| o.lock().path());
                    let index = self.free_index(&next, &key, first_key, changes);
                    let mut peer = Peer::new(
                        &tunnel_key,
                        &key,
                        &upsert.spec,
                        index,
                        &next.limiter,
                        upsert.endpoint.map(PeerPath::to).or(roamed),
                        Box::new(rand_core::OsRng),
                    );
                    if let Some(old) = existing {
                        peer.inherit_known_endpoints(&old.lock());
                    }
                    Arc::new(PeerSlot {
                        public_key: key,
                        index,
                        spec: upsert.spec.clone(),
                        state: Arc::new(Mutex::new(peer)),
                    })
                }
            };
            next.insert(slot);
        }
        change.removed = changes
            .remove
            .iter()
            .filter(|k| self.peers.contains_key(k))
            .copied()
            .collect();
        (next, change)
    }

    /// `key`'s index in `next`: free there and, unless every peer is made again
    /// (`all_new`), not held by a peer of this table kept further on.
    fn free_index(
        &self,
        next: &PeerTable,
        key: &PublicKey,
        all_new: bool,
        changes: &PeerChanges,
    ) -> u32 {
        next.indices.index_of(key, |i| {
            next.by_index.contains_key(&i)
                || (!all_new
                    && self.by_index.get(&i).is_some_and(|s| {
                        s.public_key != *key && !changes.remove.contains(&s.public_key)
                    }))
        })
    }

    fn insert(&mut self, slot: Arc<PeerSlot>) {
        for net in &slot.spec.allowed_ips {
            self.routes.insert(*net, slot.clone());
        }
        self.by_index.insert(slot.index, slot.clone());
        self.peers.insert(slot.public_key, slot);
    }
}

/// The peer table as the packet decisions look peers up.
impl PeerLookup for PeerTable {
    type Peer = Arc<PeerSlot>;
    #[inline]
    fn by_key(&self, key: &PublicKey) -> Option<&Arc<PeerSlot>> {
        self.peers.get(key)
    }
    #[inline]
    fn by_index(&self, index: u32) -> Option<&Arc<PeerSlot>> {
        self.by_index.get(&index)
    }
    #[inline]
    fn by_address(&self, addr: IpAddr) -> Option<&Arc<PeerSlot>> {
        self.routes.lookup(addr)
    }
    #[inline]
    fn same(a: &Arc<PeerSlot>, b: &Arc<PeerSlot>) -> bool {
        Arc::ptr_eq(a, b)
    }
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
        let roamed = PeerPath {
            remote: "192.0.2.1:51820".parse().expect("addr"),
            local: Some("192.0.2.200".parse().expect("ip")),
        };
        first.lock().set_endpoint(roamed);

        let (table, change) = table.apply(&upsert(peer, spec(Some(5), &["10.0.1.0/24"], None)));
        assert_eq!(change.updated, vec![peer]);
        let second = table.peers[&peer].clone();
        assert!(Arc::ptr_eq(&first.state, &second.state), "same session");
        assert_eq!(second.index, first.index);
        assert_eq!(
            second.lock().path(),
            Some(roamed),
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
        let third = table.peers[&peer].clone();
        assert!(!Arc::ptr_eq(&third.state, &second.state));
        assert_eq!(
            third.lock().path(),
            Some(roamed),
            "a new session keeps the path"
        );

        let (table, change) = table.apply(&PeerChanges {
            remove: vec![peer],
            ..PeerChanges::default()
        });
        assert_eq!(change.removed, vec![peer]);
        assert!(table.peers.is_empty() && table.by_index.is_empty());
    }

    #[test]
    fn the_same_key_and_peers_give_the_same_indices_whatever_the_order_they_came_in() {
        let own = SecretKey::generate();
        let peers: Vec<PublicKey> = (0..50)
            .map(|_| SecretKey::generate().public_key())
            .collect();
        // As a config file gives them: key and peers at once.
        let all_at_once = PeerChanges {
            private_key: Some(Some(own.clone())),
            upsert: peers
                .iter()
                .map(|k| PeerUpsert {
                    public_key: *k,
                    spec: spec(None, &[], None),
                    endpoint: None,
                })
                .collect(),
            remove: vec![],
        };
        let (a, _) = PeerTable::empty(None).apply(&all_at_once);
        // Over UAPI, peers first (under a throwaway key), the key last.
        let mut b = PeerTable::empty(None);
        for k in &peers {
            b = b.apply(&upsert(*k, spec(None, &[], None))).0;
        }
        let (b, change) = b.apply(&PeerChanges {
            private_key: Some(Some(own)),
            ..PeerChanges::default()
        });
        assert_eq!(change.reset.len(), peers.len());
        for k in &peers {
            assert_eq!(a.peers[k].index, b.peers[k].index);
            assert!(Arc::ptr_eq(&b.by_index[&b.peers[k].index], &b.peers[k]));
        }
    }
}
