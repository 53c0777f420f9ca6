use super::*;
use crate::test_util::rng_mut;
use std::collections::HashMap;

fn key() -> SecretKey {
    SecretKey::random(&mut rng_mut())
}

/// Known answers: every process, of every build, that holds this private key and this peer
/// gives the peer these indices. Recomputing in this process would prove nothing; a build whose
/// derivation drifted (label, hash, byte order, truncation) fails here, and its replicas or
/// restarts would no longer trace each other's indices.
#[test]
fn the_same_key_and_peer_give_the_same_index_in_any_process() {
    let own = PeerIndices::new(&SecretKey([7u8; 32]));
    assert_eq!(own.candidate(&PublicKey([9u8; 32]), 0), 0x28_56bb);
    assert_eq!(own.candidate(&PublicKey([9u8; 32]), 1), 0xe6_12f3);
    assert_eq!(own.candidate(&PublicKey([1u8; 32]), 0), 0x37_8d02);
    assert_eq!(own.index_of(&PublicKey([9u8; 32]), |_| false), 0x28_56bb);
}

#[test]
fn indices_trace_back_to_their_peers_and_not_under_another_key() {
    let own = PeerIndices::new(&key());
    let other = PeerIndices::new(&key());
    let peers: Vec<PublicKey> = (0..200).map(|_| key().public_key()).collect();
    // What a process builds from its peer list: index -> peer.
    let mut table: HashMap<u32, PublicKey> = HashMap::new();
    for p in &peers {
        let index = own.index_of(p, |i| table.contains_key(&i));
        table.insert(index, *p);
    }
    // A second process, same key, same peers: every index traces to the same peer.
    let mut again: HashMap<u32, PublicKey> = HashMap::new();
    for p in &peers {
        let index = own.index_of(p, |i| again.contains_key(&i));
        again.insert(index, *p);
    }
    assert_eq!(table, again);
    // Under an unrelated key the indices name nobody (200 peers in 2^24: a chance hit is
    // about 1 in 400 per index, so the test allows a couple).
    let strays = peers
        .iter()
        .filter(|p| table.contains_key(&other.index_of(p, |_| false)))
        .count();
    assert!(strays <= 3, "{strays} indices of another key traced");
}

#[test]
fn a_collision_moves_the_later_peer_to_its_next_candidate() {
    let own = PeerIndices::new(&key());
    let peer = key().public_key();
    let first = own.candidate(&peer, 0);
    let moved = own.index_of(&peer, |i| i == first);
    assert_eq!(moved, own.candidate(&peer, 1));
    assert_ne!(moved, first);
}

#[test]
fn peer_part_is_the_top_24_bits() {
    assert_eq!(peer_part(0xabcd_ef12), 0x00ab_cdef);
}

proptest::proptest! {
    #[test]
    fn indices_spread_over_24_bits(seed in proptest::prelude::any::<[u8; 32]>()) {
        let own = PeerIndices::new(&SecretKey(seed));
        let peer = PublicKey(seed);
        let index = own.candidate(&peer, 0);
        proptest::prop_assert!(index <= PEER_INDEX_MASK);
        proptest::prop_assert_ne!(index, own.candidate(&peer, 1));
    }
}
