//! The persistent map against `BTreeMap`, its persistence, and what one change costs.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// A key whose hash is its low nibble only: every key of a nibble collides in all 64 bits.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Colliding(u16);

impl TrieKey for Colliding {
    fn trie_hash(&self) -> u64 {
        u64::from(self.0 & 0xf) << 60
    }
}

fn sorted<K: TrieKey, V: Clone>(m: &BTreeMap<K, V>) -> Vec<(K, V)> {
    let mut v: Vec<(K, V)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort_by(|a, b| (a.0.trie_hash(), &a.0).cmp(&(b.0.trie_hash(), &b.0)));
    v
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u32, u32),
    Remove(u32),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            (0u32..300, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            (0u32..300).prop_map(Op::Remove),
        ],
        0..600,
    )
}

proptest! {
    /// Any sequence of inserts and removes leaves the map equal to a `BTreeMap` that saw the
    /// same, iterating in hash order; a clone taken half-way is not changed by the rest.
    #[test]
    fn matches_a_btreemap_and_clones_stay_as_they_were(ops in ops()) {
        let mut map = PMap::default();
        let mut model = BTreeMap::new();
        let mut frozen: Option<(PMap<u32, u32>, BTreeMap<u32, u32>)> = None;
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Insert(k, v) => prop_assert_eq!(map.insert(k, v), model.insert(k, v)),
                Op::Remove(k) => prop_assert_eq!(map.remove(&k), model.remove(&k)),
            }
            prop_assert_eq!(map.len(), model.len());
            if i == ops.len() / 2 {
                frozen = Some((map.clone(), model.clone()));
            }
        }
        for k in 0..300 {
            prop_assert_eq!(map.get(&k), model.get(&k));
        }
        let listed: Vec<(u32, u32)> = map.iter().map(|(k, v)| (*k, *v)).collect();
        prop_assert_eq!(listed, sorted(&model));
        if let Some((map, model)) = frozen {
            let listed: Vec<(u32, u32)> = map.iter().map(|(k, v)| (*k, *v)).collect();
            prop_assert_eq!(listed, sorted(&model));
        }
    }

    /// Keys that collide in all 64 bits share a leaf at the bottom and are still told apart.
    #[test]
    fn full_hash_collisions_are_told_apart(keys in prop::collection::vec(0u16..200, 0..200)) {
        let mut map = PMap::default();
        let mut model = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            if i % 3 == 2 {
                prop_assert_eq!(map.remove(&Colliding(*k)), model.remove(&Colliding(*k)));
            } else {
                prop_assert_eq!(map.insert(Colliding(*k), i), model.insert(Colliding(*k), i));
            }
        }
        for k in 0..200 {
            prop_assert_eq!(map.get(&Colliding(k)), model.get(&Colliding(k)));
        }
        prop_assert_eq!(map.iter().count(), model.len());
    }
}

#[test]
fn public_keys_iterate_in_key_order() {
    use crate::config::PublicKey;
    let mut map = PMap::default();
    let mut keys: Vec<PublicKey> = (0..2000u32)
        .map(|i| {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&mix64(u64::from(i)).to_be_bytes());
            k[31] = i as u8;
            PublicKey(k)
        })
        .collect();
    for k in &keys {
        map.insert(*k, ());
    }
    keys.sort();
    let listed: Vec<PublicKey> = map.keys().copied().collect();
    assert_eq!(listed, keys);
}

/// What one insert, one replace and one remove copy in a clone of a map of `n` entries.
fn one_change_costs(n: u32) -> u64 {
    let mut map = PMap::default();
    for i in 0..n {
        map.insert(i, i);
    }
    let base = map.clone();
    let mut next = base.clone();
    let ((), spent) = cost::of(|| {
        next.insert(n + 1, 0);
        next.insert(n / 2, 7);
        next.remove(&(n / 3));
    });
    assert_eq!(base.len(), n as usize, "the clone is untouched");
    assert_eq!(base.get(&(n / 2)), Some(&(n / 2)));
    assert_eq!(next.get(&(n / 2)), Some(&7));
    spent
}

/// A change to a shared map copies the path to the entry, not the map: the same few dozen
/// units at 1,000 and at 100,000 entries (a copy of the map would charge 100,000 and more).
#[test]
fn a_change_to_a_clone_costs_its_path_not_the_map() {
    let small = one_change_costs(1_000);
    let large = one_change_costs(100_000);
    // Three changes, each at most one root-to-leaf path: depth <= 6 here, 16 children a
    // branch, LEAF_MAX entries a leaf.
    let bound = 3 * (6 * 16 + LEAF_MAX as u64 + 1);
    assert!(small <= bound, "1,000 entries: {small} > {bound}");
    assert!(large <= bound, "100,000 entries: {large} > {bound}");
}

/// 100,000 entries cost little more than the entries: the data plane keeps three such maps
/// of every peer, and small leaves (two allocations each, whatever they hold) cost more than
/// their entries. With leaves of at most 8 this is 56 bytes an entry of 24 (before the
/// allocator's own header on each); with 32, 28.
#[test]
fn a_hundred_thousand_entries_cost_little_more_than_the_entries() {
    let entry = std::mem::size_of::<(u64, u32, u64)>();
    for shared in [false, true] {
        let mut map = PMap::default();
        for k in 0..100_000u32 {
            // A change to a shared map (the data plane's way: each change is made on a clone
            // of the table the packet threads read) copies the leaf it changes.
            let keep = shared.then(|| map.clone());
            map.insert(k, u64::from(k));
            drop(keep);
        }
        let per_entry = map.heap_bytes() / map.len();
        assert!(
            per_entry <= entry + entry / 2,
            "shared {shared}: {per_entry} bytes an entry of {entry}"
        );
    }
}
