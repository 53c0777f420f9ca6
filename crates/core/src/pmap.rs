//! A persistent hash map (a hash array mapped trie): a clone costs one reference count, and a
//! change to a clone copies only the path to the entry it changes (a few nodes of at most 16
//! children and one leaf of at most [`LEAF_MAX`] entries), never the other entries. So the
//! data plane's peer table stays one immutable snapshot that a packet reader takes with one
//! `Arc` clone, while a change to one peer among 100,000 copies a few dozen pointers.
//!
//! Lookups walk at most 16 levels (about four at 100,000 entries), allocate nothing and charge
//! nothing; changes charge the work meter ([`crate::cost`]) with what they copy. The map is
//! ordered by [`TrieKey::trie_hash`], then by the key: a hash that keeps the key's order (a
//! public key's first bytes) iterates in key order.

use crate::cost;
use std::sync::Arc;

/// A key of a [`PMap`].
pub trait TrieKey: Ord + Clone {
    /// 64 well-spread bits; the map iterates in their order (then the key's).
    fn trie_hash(&self) -> u64;
}

/// Bits of the hash per level: 16 children per branch.
const BITS: u32 = 4;
/// Levels that consume hash bits; a leaf at this depth holds every key of one full hash.
const MAX_DEPTH: u32 = u64::BITS / BITS;
/// Entries a leaf holds before it splits into a branch. A leaf costs two allocations whatever it
/// holds, so small leaves cost more than their entries: with 8, 100,000 random keys reach the
/// fourth level and sit about 1.5 to a leaf, and the data plane's three maps held 33 MB; with
/// 32 they stay at the third level, about 24 to a leaf, in 11 MB. A change copies one leaf
/// more (at most 32 entries), and a lookup halves it (binary search).
pub const LEAF_MAX: usize = 32;

#[derive(Clone)]
enum Node<K, V> {
    /// Sorted by (hash, key).
    Leaf(Vec<(u64, K, V)>),
    /// `children[i]` holds the `i`-th set bit of `bitmap`'s digit.
    Branch {
        bitmap: u16,
        children: Vec<Arc<Node<K, V>>>,
    },
}

impl<K, V> Node<K, V> {
    fn width(&self) -> usize {
        match self {
            Node::Leaf(entries) => entries.len(),
            Node::Branch { children, .. } => children.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.width() == 0
    }
}

/// The digit of `hash` at `depth`, most significant first (so the map is in hash order).
fn digit(hash: u64, depth: u32) -> u32 {
    ((hash >> (u64::BITS - BITS * (depth + 1))) & ((1 << BITS) - 1)) as u32
}

/// Where the child of `digit` is (or would go) among a branch's children.
fn slot(bitmap: u16, digit: u32) -> usize {
    (bitmap & ((1u16 << digit) - 1)).count_ones() as usize
}

/// `node`, copied first if another map shares it (charged: the entries or children copied).
fn unshare<K: Clone, V: Clone>(node: &mut Arc<Node<K, V>>) -> &mut Node<K, V> {
    if Arc::get_mut(node).is_none() {
        cost::charge(node.width());
    }
    Arc::make_mut(node)
}

/// A persistent map from `K` to `V`. See the module documentation.
pub struct PMap<K, V> {
    root: Option<Arc<Node<K, V>>>,
    len: usize,
}

impl<K, V> Clone for PMap<K, V> {
    fn clone(&self) -> Self {
        PMap {
            root: self.root.clone(),
            len: self.len,
        }
    }
}

impl<K, V> Default for PMap<K, V> {
    fn default() -> Self {
        PMap { root: None, len: 0 }
    }
}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for PMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K, V> PMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry, in (hash, key) order.
    pub fn iter(&self) -> Iter<'_, K, V> {
        let mut iter = Iter {
            stack: Vec::new(),
            leaf: [].iter(),
        };
        match self.root.as_deref() {
            Some(Node::Leaf(entries)) => iter.leaf = entries.iter(),
            Some(Node::Branch { children, .. }) => iter.stack.push(children.iter()),
            None => {}
        }
        iter
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }
}

impl<K, V> PMap<K, V> {
    /// The bytes its nodes hold on the heap (each node's `Arc` and the room of its `Vec`),
    /// not counting what the values own.
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        fn node<K, V>(n: &Node<K, V>) -> usize {
            let arc = 2 * std::mem::size_of::<usize>() + std::mem::size_of::<Node<K, V>>();
            arc + match n {
                Node::Leaf(entries) => entries.capacity() * std::mem::size_of::<(u64, K, V)>(),
                Node::Branch { children, .. } => {
                    children.capacity() * std::mem::size_of::<Arc<Node<K, V>>>()
                        + children.iter().map(|c| node(c)).sum::<usize>()
                }
            }
        }
        self.root.as_deref().map_or(0, node)
    }
}

impl<K: TrieKey, V> PMap<K, V> {
    /// The value of `key`. Allocates nothing.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        let hash = key.trie_hash();
        let mut node = self.root.as_deref()?;
        let mut depth = 0;
        loop {
            match node {
                Node::Leaf(entries) => {
                    return entries
                        .binary_search_by(|(h, k, _)| (*h, k).cmp(&(hash, key)))
                        .ok()
                        .map(|i| &entries[i].2)
                }
                Node::Branch { bitmap, children } => {
                    let d = digit(hash, depth);
                    if bitmap & (1 << d) == 0 {
                        return None;
                    }
                    node = &children[slot(*bitmap, d)];
                    depth += 1;
                }
            }
        }
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }
}

impl<K: TrieKey, V: Clone> PMap<K, V> {
    /// Sets `key` to `value`, returning the value it replaced. Copies only the path to it
    /// where a clone shares it.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = key.trie_hash();
        cost::charge(1);
        let old = match &mut self.root {
            None => {
                self.root = Some(Arc::new(Node::Leaf(vec![(hash, key, value)])));
                None
            }
            Some(root) => insert_at(unshare(root), 0, hash, key, value),
        };
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Removes `key`, returning its value. A key that is not there copies nothing.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        if !self.contains_key(key) {
            return None;
        }
        cost::charge(1);
        let hash = key.trie_hash();
        let root = self.root.as_mut()?;
        let removed = remove_at(unshare(root), 0, hash, key);
        if removed.is_some() {
            self.len -= 1;
            if self.len == 0 {
                self.root = None;
            }
        }
        removed
    }
}

fn insert_at<K: TrieKey, V: Clone>(
    node: &mut Node<K, V>,
    depth: u32,
    hash: u64,
    key: K,
    value: V,
) -> Option<V> {
    match node {
        Node::Leaf(entries) => {
            match entries.binary_search_by(|(h, k, _)| (*h, k).cmp(&(hash, &key))) {
                Ok(i) => Some(std::mem::replace(&mut entries[i].2, value)),
                Err(i) => {
                    // Exactly one more: a leaf is copied (exactly) on most changes anyway, and
                    // doubling would leave up to half of each of thousands of leaves empty.
                    entries.reserve_exact(1);
                    entries.insert(i, (hash, key, value));
                    if entries.len() > LEAF_MAX && depth < MAX_DEPTH {
                        let full = std::mem::take(entries);
                        *node = split(full, depth);
                    }
                    None
                }
            }
        }
        Node::Branch { bitmap, children } => {
            let d = digit(hash, depth);
            let pos = slot(*bitmap, d);
            if *bitmap & (1 << d) != 0 {
                insert_at(unshare(&mut children[pos]), depth + 1, hash, key, value)
            } else {
                *bitmap |= 1 << d;
                children.insert(pos, Arc::new(Node::Leaf(vec![(hash, key, value)])));
                None
            }
        }
    }
}

/// A branch at `depth` over `entries` (sorted by hash, so each digit's entries are one run).
fn split<K, V>(entries: Vec<(u64, K, V)>, depth: u32) -> Node<K, V> {
    let mut bitmap = 0u16;
    let mut children = Vec::new();
    let mut run: Vec<(u64, K, V)> = Vec::new();
    let mut current = None;
    for entry in entries {
        let d = digit(entry.0, depth);
        if current != Some(d) {
            if !run.is_empty() {
                children.push(Arc::new(leaf_at(std::mem::take(&mut run), depth + 1)));
            }
            bitmap |= 1 << d;
            current = Some(d);
        }
        run.push(entry);
    }
    if !run.is_empty() {
        children.push(Arc::new(leaf_at(run, depth + 1)));
    }
    Node::Branch { bitmap, children }
}

/// A leaf of `entries` at `depth`, split while it is too full and hash bits are left.
fn leaf_at<K, V>(mut entries: Vec<(u64, K, V)>, depth: u32) -> Node<K, V> {
    if entries.len() > LEAF_MAX && depth < MAX_DEPTH {
        split(entries, depth)
    } else {
        entries.shrink_to_fit();
        Node::Leaf(entries)
    }
}

fn remove_at<K: TrieKey, V: Clone>(
    node: &mut Node<K, V>,
    depth: u32,
    hash: u64,
    key: &K,
) -> Option<V> {
    match node {
        Node::Leaf(entries) => {
            let i = entries
                .binary_search_by(|(h, k, _)| (*h, k).cmp(&(hash, key)))
                .ok()?;
            Some(entries.remove(i).2)
        }
        Node::Branch { bitmap, children } => {
            let d = digit(hash, depth);
            if *bitmap & (1 << d) == 0 {
                return None;
            }
            let pos = slot(*bitmap, d);
            let removed = remove_at(unshare(&mut children[pos]), depth + 1, hash, key)?;
            if children[pos].is_empty() {
                children.remove(pos);
                *bitmap &= !(1 << d);
            }
            // A branch of a few entries in leaves becomes one leaf again (at half a leaf, so a
            // key added and removed at the edge does not split and merge every time).
            let small = children.iter().try_fold(0usize, |n, c| match &**c {
                Node::Leaf(e) => Some(n + e.len()),
                Node::Branch { .. } => None,
            });
            if small.is_some_and(|n| n <= LEAF_MAX / 2) {
                let mut merged = Vec::new();
                for child in std::mem::take(children) {
                    let child = Arc::try_unwrap(child).unwrap_or_else(|shared| {
                        cost::charge(shared.width());
                        (*shared).clone()
                    });
                    if let Node::Leaf(entries) = child {
                        merged.extend(entries);
                    }
                }
                merged.shrink_to_fit();
                *node = Node::Leaf(merged);
            }
            Some(removed)
        }
    }
}

/// The entries of a [`PMap`], in (hash, key) order.
pub struct Iter<'a, K, V> {
    stack: Vec<std::slice::Iter<'a, Arc<Node<K, V>>>>,
    leaf: std::slice::Iter<'a, (u64, K, V)>,
}

impl<'a, K, V> Iterator for Iter<'a, K, V> {
    type Item = (&'a K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((_, k, v)) = self.leaf.next() {
                return Some((k, v));
            }
            let top = self.stack.last_mut()?;
            match top.next().map(|c| &**c) {
                None => {
                    self.stack.pop();
                }
                Some(Node::Leaf(entries)) => self.leaf = entries.iter(),
                Some(Node::Branch { children, .. }) => self.stack.push(children.iter()),
            }
        }
    }
}

/// splitmix64's finalizer: spreads keys whose bits are not random (addresses, indices).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl TrieKey for u32 {
    #[inline]
    fn trie_hash(&self) -> u64 {
        mix64(u64::from(*self))
    }
}

impl TrieKey for u128 {
    #[inline]
    fn trie_hash(&self) -> u64 {
        mix64((*self as u64) ^ mix64((*self >> 64) as u64).rotate_left(17))
    }
}

/// Public keys are uniformly random: their first bytes spread them, and keep their order.
impl TrieKey for crate::config::PublicKey {
    #[inline]
    fn trie_hash(&self) -> u64 {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.0[..8]);
        u64::from_be_bytes(first)
    }
}

#[cfg(test)]
mod tests;
