//! The 24-bit peer part of this side's session indices (the receiver index every response,
//! cookie and data message names; boringtun keeps the low 8 bits for its session ring): a keyed
//! hash of the peer's public key under a key derived from the interface's private key.
//!
//! Any process that holds the same private key and peer list computes the same index for the
//! same peer, with nothing shared at run time: a restarted daemon or another replica behind one
//! address traces a stranger's receiver index to its peer by looking it up in its own table
//! (see [`crate::takeover`]). Without the key the indices look random and link nothing: not one
//! peer to another, not a peer across key changes, not the order peers were added in.
//!
//! Two peers whose hashes collide in 24 bits are told apart by a retry counter in the hash
//! ([`PeerIndices::index_of`]); which one got the first value depends on the order they were
//! added, so such a peer (about one pair in 3 among 10,000 peers) may trace differently in a
//! process that was given its peers in another order: its takeover initiation then goes to the
//! wrong key and is ignored, and it waits for its own handshake, as without takeover.

use crate::config::{PublicKey, SecretKey};
use blake2::digest::{FixedOutput, KeyInit, Update};
use blake2::{Blake2s256, Blake2sMac256, Digest};

/// Bits of a session index that name the peer (the rest is boringtun's session slot).
pub const PEER_INDEX_BITS: u32 = 24;
/// Mask of the peer part.
pub const PEER_INDEX_MASK: u32 = (1 << PEER_INDEX_BITS) - 1;
/// The label the index key is derived with: it is used for nothing else.
const LABEL: &[u8] = b"tunnelgate session index v1";

/// The index key of one interface identity.
#[derive(Clone)]
pub struct PeerIndices {
    key: [u8; 32],
}

impl std::fmt::Debug for PeerIndices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerIndices(..)")
    }
}

impl PeerIndices {
    /// The index key of `own_private`: BLAKE2s over a label and the key, so the index key
    /// reveals nothing of the private key and differs from every other key derived from it.
    pub fn new(own_private: &SecretKey) -> PeerIndices {
        let mut hash = Blake2s256::new();
        Digest::update(&mut hash, LABEL);
        Digest::update(&mut hash, own_private.0);
        PeerIndices {
            key: hash.finalize().into(),
        }
    }

    /// The peer index (24 bits) of `peer`'s `attempt`-th candidate: keyed BLAKE2s of the
    /// public key and the attempt number, truncated.
    pub fn candidate(&self, peer: &PublicKey, attempt: u32) -> u32 {
        // A 32-byte key always fits BLAKE2s's 32-byte key limit.
        let mut mac = <Blake2sMac256 as KeyInit>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("a 32-byte key fits BLAKE2s"));
        mac.update(&peer.0);
        mac.update(&attempt.to_le_bytes());
        let out = mac.finalize_fixed();
        u32::from_le_bytes([out[0], out[1], out[2], 0]) & PEER_INDEX_MASK
    }

    /// The peer index of `peer`: its first candidate that `taken` does not hold (another peer's
    /// index). Deterministic given the peers already placed.
    pub fn index_of(&self, peer: &PublicKey, taken: impl Fn(u32) -> bool) -> u32 {
        (0..)
            .map(|attempt| self.candidate(peer, attempt))
            .find(|index| !taken(*index))
            .unwrap_or_else(|| unreachable!("fewer than 2^24 peers leave a free index"))
    }
}

/// The peer part of a session index (what the peer table is keyed by).
#[inline]
pub const fn peer_part(session_index: u32) -> u32 {
    session_index >> (32 - PEER_INDEX_BITS)
}

#[cfg(test)]
mod tests;
