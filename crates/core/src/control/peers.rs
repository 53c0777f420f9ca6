//! How the control core changes its peers in time linear in what a change names: a UAPI `set`
//! is staged peer by peer over the current set (wireguard-go's semantics, with an index from
//! each allowed IP to its peer, so taking a prefix from another peer finds it without a scan),
//! then committed as one diff: the peers named, their prefixes' routes, one `UpdatePeers`. A
//! configuration (start, reload) is the same commit with every peer named. Nothing here walks
//! the peers that a change does not name, except what must: `replace_peers` and a config file
//! name them all, and a new interface key re-keys them all.

use super::*;
use crate::cost;
use crate::uapi::PeerUpdate;
use std::collections::HashSet;

/// A UAPI `set` being staged over the current peers: what it makes of each peer it touches,
/// and of each prefix whose owner it changes.
pub(super) struct Staged<'a> {
    control: &'a Control,
    /// `replace_peers`: every peer not named again is gone.
    cleared: bool,
    /// The new spec of each peer touched (`None`: removed).
    peers: BTreeMap<PublicKey, Option<PeerSpec>>,
    /// The new owner of each prefix whose owner changed (`None`: no one).
    owners: BTreeMap<IpNet, Option<PublicKey>>,
}

impl<'a> Staged<'a> {
    pub(super) fn new(control: &'a Control, cleared: bool) -> Staged<'a> {
        Staged {
            control,
            cleared,
            peers: BTreeMap::new(),
            owners: BTreeMap::new(),
        }
    }

    /// The peer's spec as staged so far.
    fn current(&self, key: &PublicKey) -> Option<PeerSpec> {
        match self.peers.get(key) {
            Some(staged) => staged.clone(),
            None if self.cleared => None,
            None => self
                .control
                .peers
                .get(key)
                .map(|spec| PeerSpec::clone(spec)),
        }
    }

    /// Who has `net` as staged so far.
    fn owner(&self, net: &IpNet) -> Option<PublicKey> {
        match self.owners.get(net) {
            Some(staged) => *staged,
            None if self.cleared => None,
            None => self.control.owners.get(net).copied(),
        }
    }

    pub(super) fn remove(&mut self, key: PublicKey) {
        if let Some(spec) = self.current(&key) {
            cost::charge(spec.allowed_ips.len());
            for net in &spec.allowed_ips {
                if self.owner(net) == Some(key) {
                    self.owners.insert(*net, None);
                }
            }
        }
        self.peers.insert(key, None);
    }

    /// One peer section, as wireguard-go applies it: create (unless `update_only`), set
    /// what is given, replace or add allowed IPs (a prefix added here leaves whoever had it,
    /// and goes to the end of this peer's list). `name` keeps the name the config gave it.
    pub(super) fn apply(&mut self, change: &PeerUpdate) {
        let key = change.public_key;
        cost::charge(1);
        if change.remove {
            self.remove(key);
            return;
        }
        let mut spec = match self.current(&key) {
            Some(spec) => spec,
            None if change.update_only => return,
            None => PeerSpec {
                preshared_key: None,
                persistent_keepalive: None,
                allowed_ips: Vec::new(),
                // UAPI has no names: a peer keeps the one its config gave it.
                name: self.control.peers.get(&key).and_then(|s| s.name.clone()),
            },
        };
        if let Some(psk) = &change.preshared_key {
            spec.preshared_key = psk.clone();
        }
        if let Some(secs) = change.persistent_keepalive {
            spec.persistent_keepalive = (secs != 0).then_some(secs);
        }
        if change.replace_allowed_ips {
            for net in std::mem::take(&mut spec.allowed_ips) {
                if self.owner(&net) == Some(key) {
                    self.owners.insert(net, None);
                }
            }
        }
        if !change.allowed_ips.is_empty() {
            self.add_allowed_ips(key, &mut spec, &change.allowed_ips);
        }
        cost::charge(spec.allowed_ips.len());
        self.peers.insert(key, Some(spec));
    }

    /// Adds `nets` (in the order of their last appearance) to `key`'s `spec`, taking each from
    /// the peer that has it: one pass over each such peer's list, whatever the count.
    fn add_allowed_ips(&mut self, key: PublicKey, spec: &mut PeerSpec, nets: &[IpNet]) {
        let added: HashSet<IpNet> = nets.iter().map(IpNet::trunc).collect();
        let mut seen = HashSet::with_capacity(added.len());
        let mut fresh: Vec<IpNet> = nets
            .iter()
            .rev()
            .map(IpNet::trunc)
            .filter(|n| seen.insert(*n))
            .collect();
        fresh.reverse();
        cost::charge(fresh.len());
        let losers: BTreeSet<PublicKey> = fresh
            .iter()
            .filter_map(|n| self.owner(n))
            .filter(|owner| *owner != key)
            .collect();
        for loser in losers {
            if let Some(mut theirs) = self.current(&loser) {
                cost::charge(theirs.allowed_ips.len());
                theirs.allowed_ips.retain(|n| !added.contains(n));
                self.peers.insert(loser, Some(theirs));
            }
        }
        spec.allowed_ips.retain(|n| !added.contains(n));
        for net in &fresh {
            self.owners.insert(*net, Some(key));
        }
        spec.allowed_ips.extend(fresh);
        // A growing Vec takes room for four: a concentrator's peer has one prefix, and
        // 100,000 of them would carry 5 MB of empty room.
        spec.allowed_ips.shrink_to_fit();
    }

    /// The staged peers, and whether every peer not among them goes.
    pub(super) fn into_peers(self) -> (BTreeMap<PublicKey, Option<PeerSpec>>, bool) {
        (self.peers, self.cleared)
    }
}

impl Control {
    /// Makes `staged` the peers (with `cleared`, every peer not in it goes) and queues the
    /// change: the peers whose spec changed, or whose endpoint is set, or every peer when the
    /// interface key changes (`key`); their prefixes' routes follow. Walks only the staged
    /// peers, unless `cleared` or `key` ask for all.
    pub(super) fn commit_peers(
        &mut self,
        staged: BTreeMap<PublicKey, Option<PeerSpec>>,
        cleared: bool,
        endpoints: &BTreeMap<PublicKey, SocketAddr>,
        key: Option<Option<SecretKey>>,
    ) {
        let mut changes = PeerChanges {
            private_key: key.clone(),
            ..PeerChanges::default()
        };
        let mut gone: Vec<PublicKey> = staged
            .iter()
            .filter(|(k, spec)| spec.is_none() && self.peers.contains_key(k))
            .map(|(k, _)| *k)
            .collect();
        if cleared {
            cost::charge(self.peers.len());
            gone.extend(self.peers.keys().filter(|k| !staged.contains_key(k)));
            gone.sort_unstable();
        }
        for k in &gone {
            if let Some(old) = self.peers.remove(k) {
                self.unroute(k, &old.allowed_ips);
            }
        }
        changes.remove = gone;
        let named = if cleared { self.peers.len() } else { 0 }.max(staged.len());
        for (k, spec) in staged {
            let Some(spec) = spec else { continue };
            cost::charge(1);
            let old = self.peers.get(&k);
            let same = old.is_some_and(|old| **old == spec);
            // The same spec keeps its one copy; a new one is shared from here on.
            let spec = match old {
                Some(old) if same => old.clone(),
                _ => std::sync::Arc::new(spec),
            };
            let endpoint = endpoints.get(&k).copied();
            if !same || endpoint.is_some() || key.is_some() {
                changes.upsert.push(PeerUpsert {
                    public_key: k,
                    spec: spec.clone(),
                    endpoint,
                });
            }
            if same {
                continue;
            }
            let before: Vec<IpNet> = old.map(|o| o.allowed_ips.clone()).unwrap_or_default();
            let after: BTreeSet<IpNet> = spec.allowed_ips.iter().copied().collect();
            let left: Vec<IpNet> = before
                .iter()
                .filter(|n| !after.contains(n))
                .copied()
                .collect();
            self.unroute(&k, &left);
            let before: BTreeSet<IpNet> = before.into_iter().collect();
            for net in spec.allowed_ips.iter().filter(|n| !before.contains(n)) {
                self.route(k, *net);
            }
            self.peers.insert(k, spec);
        }
        if key.is_some() {
            // A new interface key re-keys every session: every peer is part of the change.
            let named: BTreeSet<PublicKey> = changes.upsert.iter().map(|u| u.public_key).collect();
            cost::charge(self.peers.len());
            changes
                .upsert
                .extend(
                    self.peers
                        .iter()
                        .filter(|(k, _)| !named.contains(k))
                        .map(|(k, spec)| PeerUpsert {
                            public_key: *k,
                            spec: spec.clone(),
                            endpoint: None,
                        }),
                );
            changes.upsert.sort_by_key(|u| u.public_key);
        }
        if let Some(k) = key {
            self.private_key = k;
        }
        let size = self.peers.len();
        if size >= COMPACT_MIN && named * 2 >= size {
            cost::charge(size);
            compact(&mut self.peers);
            compact(&mut self.owners);
            compact(&mut self.routes.desired);
        }
        if !changes.is_empty() {
            self.actions.push_back(Action::UpdatePeers(changes));
        }
    }

    /// `net` is `key`'s now: it owns it, and its route is wanted.
    fn route(&mut self, key: PublicKey, net: IpNet) {
        cost::charge(1);
        self.owners.insert(net, key);
        if self.mode.installs_host_state() {
            *self.routes.desired.entry(net).or_insert(0) += 1;
            self.routes.dirty.insert(net);
        }
    }

    /// `key` no longer has `nets`: each is no one's (unless another peer took it already),
    /// and its route is not wanted for `key` any more.
    fn unroute(&mut self, key: &PublicKey, nets: &[IpNet]) {
        cost::charge(nets.len());
        for net in nets {
            if self.owners.get(net) == Some(key) {
                self.owners.remove(net);
            }
            if !self.mode.installs_host_state() {
                continue;
            }
            if let Some(n) = self.routes.desired.get_mut(net) {
                *n -= 1;
                if *n == 0 {
                    self.routes.desired.remove(net);
                }
                self.routes.dirty.insert(*net);
            }
        }
    }

    /// The configuration's peers replace the current ones (the file wins, like `wg syncconf`).
    /// A configured endpoint is set only where it differs from the one the file gave before,
    /// so a reload keeps where a peer roamed to.
    pub(super) fn set_peers(
        &mut self,
        peers: Vec<crate::config::Peer>,
        key: Option<Option<SecretKey>>,
    ) {
        let first = self.peers.is_empty() && key.is_none();
        let taken = super::configured::ConfiguredPeers::of(&peers);
        let before = std::mem::replace(&mut self.configured, taken).endpoints;
        let desired = PeerSpec::take_all(peers);
        let mut staged = BTreeMap::new();
        let mut endpoints = BTreeMap::new();
        for (public_key, (spec, endpoint)) in desired {
            let known = before.get(&public_key);
            let changed =
                first || !self.peers.contains_key(&public_key) || known != endpoint.as_ref();
            if changed {
                self.endpoints.remove(&public_key);
                match endpoint {
                    Some(Endpoint::Addr(a)) => {
                        endpoints.insert(public_key, a);
                    }
                    Some(Endpoint::Host { host, port }) => {
                        self.endpoints.insert(
                            public_key,
                            EndpointLookup {
                                host,
                                port,
                                in_flight: false,
                                retry: Retry::new(ENDPOINT_RETRY_CAP),
                            },
                        );
                    }
                    None => {}
                }
            }
            staged.insert(public_key, Some(spec));
        }
        self.endpoints.retain(|k, _| staged.contains_key(k));
        self.commit_peers(staged, true, &endpoints, key);
    }
}
