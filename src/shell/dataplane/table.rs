//! The peer table the packet workers read: an immutable snapshot that a batch takes with one
//! `Arc` clone and no table lock. Its maps are persistent ([`PMap`], [`AllowedIps`]): the next
//! generation is a clone that shares every node the change does not touch, so a change to one
//! peer among 100,000 copies a few paths of pointers, not the table, and unchanged peers keep
//! their slots and sessions. Each peer's live state (`core::peer::Peer`) sits behind its own
//! lock, taken for one call and never across a system call.

use crate::config::{PublicKey, SecretKey};
use crate::core::allowed_ips::AllowedIps;
use crate::core::control::{PeerChanges, PeerSpec, PeerUpsert, SessionEffect};
use crate::core::packet::steering::Steering;
use crate::core::packet::{PeerLookup, PeerPath};
use crate::core::peer::Peer;
use crate::core::pmap::PMap;
use crate::core::session_index::PeerIndices;
use crate::core::wg::Limiter;
use crate::shell::keys::GenerateKey as _;
use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

/// One peer of one table generation. A peer whose settings change but whose session stays
/// (allowed IPs, keepalive) gets a new slot sharing the old one's state, so a worker holding
/// the previous table keeps working on the same session.
pub(super) struct PeerSlot {
    public_key: PublicKey,
    index: u32,
    spec: Arc<PeerSpec>,
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

    /// This peer with `spec`'s settings, the same session: a worker holding the old slot
    /// keeps working on it.
    fn with_spec(&self, spec: &Arc<PeerSpec>) -> Arc<PeerSlot> {
        Arc::new(PeerSlot {
            public_key: self.public_key,
            index: self.index,
            spec: spec.clone(),
            state: self.state.clone(),
        })
    }
}

/// What `upsert` changes of a peer whose session stays: its keepalive, when `effect` says it
/// changed, and its endpoint, when it names one.
fn keep_session(state: &mut Peer, effect: SessionEffect, upsert: &PeerUpsert) {
    if let SessionEffect::KeepSession {
        keepalive_changed: true,
    } = effect
    {
        state.set_keepalive(upsert.spec.persistent_keepalive);
    }
    if let Some(endpoint) = upsert.endpoint {
        state.set_endpoint(PeerPath::to(endpoint));
    }
}

/// Where a peer made again is reached: the endpoint `upsert` names, else where the peer it
/// replaces (`old`) was reached.
fn endpoint_of(upsert: &PeerUpsert, old: Option<&PeerSlot>) -> Option<PeerPath> {
    upsert
        .endpoint
        .map(PeerPath::to)
        .or_else(|| old.and_then(|o| o.lock().path()))
}

/// A slot with a new session for `(key, index)`: `spec`'s settings, reached at `endpoint`, and
/// where a takeover may go, what the peer it replaces (`old`) knew.
fn new_session(
    tunnel_key: &SecretKey,
    limiter: &Limiter,
    (key, index): (PublicKey, u32),
    spec: &Arc<PeerSpec>,
    endpoint: Option<PeerPath>,
    old: Option<&PeerSlot>,
) -> Arc<PeerSlot> {
    let mut peer = Peer::new(
        tunnel_key,
        &key,
        spec,
        index,
        limiter,
        endpoint,
        Box::new(rand_core::OsRng),
    );
    if let Some(old) = old {
        peer.inherit_known_endpoints(&old.lock());
    }
    Arc::new(PeerSlot {
        public_key: key,
        index,
        spec: spec.clone(),
        state: Arc::new(Mutex::new(peer)),
    })
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

impl TableChange {
    /// Whether a peer came, went or got a new index: who owns which worker may change.
    pub fn moves_peers(&self) -> bool {
        !self.added.is_empty() || !self.removed.is_empty() || !self.reset.is_empty()
    }
}

/// One consistent view of the interface's identity and peers. A clone shares everything.
#[derive(Clone)]
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
    peers: PMap<PublicKey, Arc<PeerSlot>>,
    by_index: PMap<u32, Arc<PeerSlot>>,
    routes: AllowedIps<Arc<PeerSlot>>,
    /// Peers per value of the steering byte (the low byte of their index), kept as peers come
    /// and go, so sharing them out over the workers never walks the peers.
    peers_of_byte: [usize; 256],
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
            peers: PMap::default(),
            by_index: PMap::default(),
            routes: AllowedIps::default(),
            peers_of_byte: [0; 256],
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

    /// Every peer, in public key order.
    pub(super) fn peers(&self) -> impl Iterator<Item = &Arc<PeerSlot>> {
        self.peers.values()
    }

    pub(super) fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// How the peers are to be shared out over `workers` after `change` made this table
    /// (`None`: as before). Never walks the peers: the table counts them per byte value.
    pub(super) fn steering_after(&self, change: &TableChange, workers: usize) -> Option<Steering> {
        change
            .moves_peers()
            .then(|| Steering::balanced_tally(&self.peers_of_byte, workers))
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

    /// The next table generation after `changes`: a clone of this one with only the named
    /// peers taken out and put in (a new interface key re-keys every peer, so it walks them
    /// all). Peers not named keep their slot; an upserted peer keeps its session unless its
    /// preshared key changed.
    pub(super) fn apply(&self, changes: &PeerChanges) -> (PeerTable, TableChange) {
        if changes.private_key.is_some() {
            return self.rekeyed(changes);
        }
        let mut next = self.clone();
        let mut change = TableChange::default();
        // Removals first: their indices and prefixes are free for what follows.
        for key in &changes.remove {
            if let Some(old) = next.peers.get(key).cloned() {
                next.take_out(&old);
                change.removed.push(*key);
            }
        }
        // In key order (the last upsert of a key wins): the same changes give the same
        // indices in any process.
        let upserts: BTreeMap<PublicKey, &PeerUpsert> =
            changes.upsert.iter().map(|u| (u.public_key, u)).collect();
        for (key, upsert) in upserts {
            let existing = next.peers.get(&key).cloned();
            let kept = existing
                .as_ref()
                .map(|old| (old, old.spec.update_to(&upsert.spec)))
                .filter(|(_, effect)| *effect != SessionEffect::NewSession);
            let slot = match kept {
                Some((old, effect)) => {
                    keep_session(&mut old.lock(), effect, upsert);
                    if effect == SessionEffect::Unchanged {
                        // Only the endpoint, if anything: the slot stays as it is.
                        continue;
                    }
                    change.updated.push(key);
                    next.take_out(old);
                    old.with_spec(&upsert.spec)
                }
                None => {
                    let endpoint = endpoint_of(upsert, existing.as_deref());
                    match &existing {
                        Some(old) => {
                            change.reset.push(key);
                            next.take_out(old);
                        }
                        None => change.added.push(key),
                    }
                    let index = next.free_index(&key);
                    new_session(
                        &next.tunnel_key,
                        &next.limiter,
                        (key, index),
                        &upsert.spec,
                        endpoint,
                        existing.as_deref(),
                    )
                }
            };
            next.put_in(slot);
        }
        (next, change)
    }

    /// A new interface key (or the key removed): every peer's session is re-keyed (boringtun
    /// keeps the session state), so this walks every peer. The first key (peers set before it
    /// over UAPI) makes each peer again with the index this identity gives it, as another
    /// process with the same key and peers would (`core::session_index`).
    fn rekeyed(&self, changes: &PeerChanges) -> (PeerTable, TableChange) {
        let key = changes.private_key.clone().flatten();
        let mut next = PeerTable::empty(key);
        let tunnel_key = next.tunnel_key.clone();
        let mut change = TableChange::default();
        let upserts: BTreeMap<PublicKey, &PeerUpsert> =
            changes.upsert.iter().map(|u| (u.public_key, u)).collect();
        let removed: BTreeSet<PublicKey> = changes.remove.iter().copied().collect();
        let first_key = self.private_key.is_none();
        // The indices of the peers kept as they are: a peer made again takes a free one.
        let kept = |key: &PublicKey| !removed.contains(key) && !upserts.contains_key(key);
        for (key, old) in self.peers.iter() {
            if !kept(key) {
                continue;
            }
            if first_key {
                // Every index comes from the new key: only those given out so far are taken.
                let index = next.free_index_among(key, self, &|_: &PublicKey| false);
                let endpoint = old.lock().path();
                change.reset.push(*key);
                let slot = new_session(
                    &tunnel_key,
                    &next.limiter,
                    (*key, index),
                    &old.spec,
                    endpoint,
                    Some(old),
                );
                next.put_in(slot);
                continue;
            }
            old.lock().set_private_key(&tunnel_key, &next.limiter);
            change.reset.push(*key);
            next.put_in(old.clone());
        }
        for (&key, &upsert) in &upserts {
            let existing = self.peers.get(&key);
            let kept_session = existing
                .map(|old| (old, old.spec.update_to(&upsert.spec)))
                .filter(|(_, effect)| *effect != SessionEffect::NewSession && !first_key);
            let slot = match kept_session {
                Some((old, effect)) => {
                    let mut state = old.lock();
                    state.set_private_key(&tunnel_key, &next.limiter);
                    keep_session(&mut state, effect, upsert);
                    drop(state);
                    change.reset.push(key);
                    old.with_spec(&upsert.spec)
                }
                None => {
                    if existing.is_some() {
                        change.reset.push(key);
                    } else {
                        change.added.push(key);
                    }
                    let endpoint = endpoint_of(upsert, existing.map(|o| &**o));
                    let index =
                        next.free_index_among(&key, self, &|k: &PublicKey| !first_key && kept(k));
                    new_session(
                        &tunnel_key,
                        &next.limiter,
                        (key, index),
                        &upsert.spec,
                        endpoint,
                        existing.map(|o| &**o),
                    )
                }
            };
            next.put_in(slot);
        }
        change.removed = changes
            .remove
            .iter()
            .filter(|k| self.peers.contains_key(k))
            .copied()
            .collect();
        (next, change)
    }

    /// `key`'s index in this table: one no other peer of it holds.
    fn free_index(&self, key: &PublicKey) -> u32 {
        self.indices.index_of(key, |i| {
            self.by_index.get(&i).is_some_and(|s| s.public_key != *key)
        })
    }

    /// `key`'s index in this table (being filled), also not held in `old` by a peer that
    /// `still_here` says is kept and not put in yet.
    fn free_index_among(
        &self,
        key: &PublicKey,
        old: &PeerTable,
        still_here: &dyn Fn(&PublicKey) -> bool,
    ) -> u32 {
        self.indices.index_of(key, |i| {
            self.by_index.contains_key(&i)
                || old
                    .by_index
                    .get(&i)
                    .is_some_and(|s| s.public_key != *key && still_here(&s.public_key))
        })
    }

    /// Adds `slot`: its key, its index and its prefixes (each taken from whoever had it).
    fn put_in(&mut self, slot: Arc<PeerSlot>) {
        for net in &slot.spec.allowed_ips {
            self.routes.insert(*net, slot.clone());
        }
        self.by_index.insert(slot.index, slot.clone());
        self.peers_of_byte[(slot.index & 0xff) as usize] += 1;
        self.peers.insert(slot.public_key, slot);
    }

    /// Removes `slot`: its key, and its index and prefixes where they are still its own (a
    /// prefix another peer took in the same change stays with that peer).
    fn take_out(&mut self, slot: &PeerSlot) {
        let mine = |s: &Arc<PeerSlot>| s.public_key == slot.public_key;
        for net in &slot.spec.allowed_ips {
            if self.routes.get(*net).is_some_and(mine) {
                self.routes.remove(*net);
            }
        }
        if self.by_index.get(&slot.index).is_some_and(mine) {
            self.by_index.remove(&slot.index);
        }
        if self.peers.remove(&slot.public_key).is_some() {
            let byte = &mut self.peers_of_byte[(slot.index & 0xff) as usize];
            *byte = byte.saturating_sub(1);
        }
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
                spec: spec.into(),
                endpoint: None,
            }],
            remove: vec![],
        }
    }

    /// A public key for peer `i` (random-looking, and cheap: no Curve25519).
    fn peer_key(i: u64) -> PublicKey {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&crate::core::pmap::mix64(i).to_be_bytes());
        k[8..16].copy_from_slice(&i.to_be_bytes());
        PublicKey(k)
    }

    fn peer_net(i: u64) -> String {
        format!("10.{}.{}.{}/32", 64 + (i >> 16), (i >> 8) & 0xff, i & 0xff)
    }

    /// A table of `n` peers, one /32 each, keyed by `own`.
    fn table_of(n: u64, own: &SecretKey) -> PeerTable {
        let all = PeerChanges {
            private_key: None,
            upsert: (0..n)
                .map(|i| PeerUpsert {
                    public_key: peer_key(i),
                    spec: spec(None, &[&peer_net(i)], None).into(),
                    endpoint: None,
                })
                .collect(),
            remove: vec![],
        };
        PeerTable::empty(Some(own.clone())).apply(&all).0
    }

    /// The work (entries copied, inserted, removed and tallied: `core::cost`) of three
    /// transactions on a table of `n` peers, each naming one peer: its allowed IPs changed,
    /// one added, one removed; with the steering each asks for.
    fn one_peer_transactions_cost(n: u64) -> u64 {
        let own = SecretKey::generate();
        let table = table_of(n, &own);
        let moved = peer_key(n / 2);
        let ((), spent) = crate::core::cost::of(|| {
            let (t1, c1) = table.apply(&upsert(moved, spec(None, &["10.250.0.1/32"], None)));
            assert_eq!(c1.updated, vec![moved]);
            assert!(t1.steering_after(&c1, 2).is_none(), "nobody moved");
            let (t2, c2) = t1.apply(&upsert(
                peer_key(n + 7),
                spec(None, &["10.251.0.1/32"], None),
            ));
            assert_eq!(c2.added.len(), 1);
            let _ = t2.steering_after(&c2, 2);
            let (t3, c3) = t2.apply(&PeerChanges {
                remove: vec![peer_key(1)],
                ..PeerChanges::default()
            });
            assert_eq!(c3.removed, vec![peer_key(1)]);
            let _ = t3.steering_after(&c3, 2);
            // Each generation answers for what it holds, the first one unchanged.
            let at = |t: &PeerTable, a: &str| {
                t.routes
                    .lookup(a.parse().expect("ip"))
                    .map(|s| s.public_key)
            };
            assert_eq!(at(&t3, "10.250.0.1"), Some(moved));
            assert_eq!(at(&table, "10.250.0.1"), None);
            assert_eq!(at(&t3, "10.251.0.1"), Some(peer_key(n + 7)));
            assert_eq!(at(&t3, &peer_net(1).replace("/32", "")), None);
            assert_eq!(at(&t2, &peer_net(1).replace("/32", "")), Some(peer_key(1)));
            assert_eq!(t3.peer_count() as u64, n);
            let mut tally = [0usize; 256];
            for slot in t3.peers() {
                tally[(slot.index & 0xff) as usize] += 1;
            }
            assert_eq!(
                tally, t3.peers_of_byte,
                "the count per byte follows the peers"
            );
        });
        spent
    }

    /// A counting test (no timer): one-peer changes cost the same few hundred units of work
    /// at 2,000 and at 20,000 peers. A table rebuilt whole, or steering tallied over every
    /// peer, per change would charge at least the peer count.
    #[test]
    fn a_one_peer_change_costs_the_same_whatever_the_number_of_peers() {
        let small = one_peer_transactions_cost(2_000);
        let large = one_peer_transactions_cost(20_000);
        // Three transactions, each a few root-to-leaf paths (of 16 children and 8 entries)
        // in three maps: far below 2,000.
        let bound = 1_000;
        assert!(small <= bound, "2,000 peers: {small} units > {bound}");
        assert!(large <= bound, "20,000 peers: {large} units > {bound}");
    }

    #[test]
    fn settings_changes_keep_the_session_and_a_new_psk_does_not() {
        let own = SecretKey::generate();
        let peer = SecretKey::generate().public_key();
        let table = PeerTable::empty(Some(own));
        let (table, change) = table.apply(&upsert(peer, spec(Some(25), &["10.0.0.0/24"], None)));
        assert_eq!(change.added, vec![peer]);
        let first = table.peers.get(&peer).expect("peer").clone();
        let roamed = PeerPath {
            remote: "192.0.2.1:51820".parse().expect("addr"),
            local: Some("192.0.2.200".parse().expect("ip")),
        };
        first.lock().set_endpoint(roamed);

        let (table, change) = table.apply(&upsert(peer, spec(Some(5), &["10.0.1.0/24"], None)));
        assert_eq!(change.updated, vec![peer]);
        let second = table.peers.get(&peer).expect("peer").clone();
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
        let third = table.peers.get(&peer).expect("peer").clone();
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
                    spec: spec(None, &[], None).into(),
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
            let (a, b_slot) = (a.peers.get(k).expect("a"), b.peers.get(k).expect("b"));
            assert_eq!(a.index, b_slot.index);
            assert!(Arc::ptr_eq(
                b.by_index.get(&b_slot.index).expect("index"),
                b_slot
            ));
        }
    }
}
