//! The simulated peers' identities, derived from a seed so that the driver and the simulator
//! agree without a key file: peer `i`'s private key, its tunnel address and its underlay source
//! address are functions of (seed, i). Pure.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use blake2::{Blake2s256, Digest};
use boringtun::x25519::{PublicKey, StaticSecret};
use std::net::Ipv4Addr;

/// Domain separation for the key derivation (bump it and every key changes).
const KEY_LABEL: &[u8] = b"tunnelgate-peersim private key v1\0";

/// Tunnel addresses start at 10.200.0.0 and skip every .0 and .255: 254 per /24, 1,024 /24s
/// (10.200.0.0/14), so at most this many peers have one.
pub const MAX_PEERS: u32 = 254 * 1024;
const TUNNEL_BASE: u32 = u32::from_be_bytes([10, 200, 0, 0]);

/// Peer `index`'s private key for `seed`: BLAKE2s(label, seed length, seed, index), clamped
/// as X25519 (and `wg pubkey`) clamp it, so the base64 form is a canonical WireGuard key.
pub fn private_key(seed: &str, index: u32) -> [u8; 32] {
    let mut h = Blake2s256::new();
    h.update(KEY_LABEL);
    h.update((seed.len() as u64).to_le_bytes());
    h.update(seed.as_bytes());
    h.update(index.to_le_bytes());
    let mut key: [u8; 32] = h.finalize().into();
    key[0] &= 248;
    key[31] &= 127;
    key[31] |= 64;
    key
}

/// The X25519 public key of `private`.
pub fn public_key(private: &[u8; 32]) -> [u8; 32] {
    PublicKey::from(&StaticSecret::from(*private)).to_bytes()
}

/// Peer `index`'s tunnel address: 10.200.0.1 for peer 0, then on, 254 to a /24 (no .0, no
/// .255); `None` past [`MAX_PEERS`].
pub fn tunnel_addr(index: u32) -> Option<Ipv4Addr> {
    if index >= MAX_PEERS {
        return None;
    }
    let block = index / 254;
    let host = index % 254 + 1;
    Some(Ipv4Addr::from(TUNNEL_BASE + block * 256 + host))
}

/// The underlay source address of peer `index` in `net/prefix`: host number 1 + index modulo
/// the hosts the network holds (all but its first and last address), so peers get addresses
/// of their own while there are enough, and share them round-robin after. `None` for a prefix
/// too long to hold a host.
pub fn source_addr(net: Ipv4Addr, prefix: u8, index: u32) -> Option<Ipv4Addr> {
    if prefix > 30 {
        return None;
    }
    let size = 1u64 << (32 - u32::from(prefix));
    let hosts = size - 2;
    let base = u64::from(u32::from(net)) & !(size - 1);
    let addr = base + 1 + u64::from(index) % hosts;
    u32::try_from(addr).ok().map(Ipv4Addr::from)
}

/// A key in WireGuard's base64 form.
pub fn encode(key: &[u8; 32]) -> String {
    STANDARD.encode(key)
}

/// A 32-byte key from WireGuard's base64 form.
pub fn decode(text: &str) -> Result<[u8; 32], String> {
    let bytes = STANDARD
        .decode(text.trim())
        .map_err(|e| format!("not base64: {e}"))?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map_err(|_| format!("a key is 32 bytes, this is {}", bytes.len()))
}

/// "a.b.c.d/len" as (network address, prefix length).
pub fn parse_net(text: &str) -> Result<(Ipv4Addr, u8), String> {
    let (addr, len) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?}: expected ADDRESS/PREFIX"))?;
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|e| format!("{text:?}: bad address: {e}"))?;
    let len: u8 = len
        .parse()
        .map_err(|e| format!("{text:?}: bad prefix length: {e}"))?;
    if len > 32 {
        return Err(format!("{text:?}: prefix length over 32"));
    }
    Ok((addr, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_deterministic_and_distinct() {
        let a = private_key("s", 0);
        assert_eq!(a, private_key("s", 0));
        assert_ne!(a, private_key("s", 1));
        assert_ne!(a, private_key("t", 0));
        // The seed's length is hashed: ("ab", i) and ("a", ...) cannot collide by concatenation.
        assert_ne!(private_key("ab", 0), private_key("a", 0));
    }

    #[test]
    fn keys_are_clamped_and_match_x25519() {
        for i in 0..16 {
            let k = private_key("seed", i);
            assert_eq!(k[0] & 7, 0);
            assert_eq!(k[31] & 0xc0, 0x40);
            // The public key is that of the same secret through the fork's x25519 re-export.
            let expected = PublicKey::from(&StaticSecret::from(k)).to_bytes();
            assert_eq!(public_key(&k), expected);
        }
    }

    #[test]
    fn known_vector() {
        // RFC 7748 section 6.1: Alice's private key and public key.
        let private = decode("dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=").unwrap();
        assert_eq!(
            encode(&public_key(&private)),
            "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo="
        );
    }

    #[test]
    fn base64_round_trip_and_errors() {
        let k = private_key("x", 7);
        assert_eq!(decode(&encode(&k)).unwrap(), k);
        assert!(decode("not base64!").is_err());
        assert!(decode("AAAA").is_err());
    }

    #[test]
    fn tunnel_addresses_skip_zero_and_broadcast() {
        assert_eq!(tunnel_addr(0), Some(Ipv4Addr::new(10, 200, 0, 1)));
        assert_eq!(tunnel_addr(253), Some(Ipv4Addr::new(10, 200, 0, 254)));
        assert_eq!(tunnel_addr(254), Some(Ipv4Addr::new(10, 200, 1, 1)));
        assert_eq!(tunnel_addr(99_999), Some(Ipv4Addr::new(10, 201, 137, 178)));
        assert_eq!(
            tunnel_addr(MAX_PEERS - 1),
            Some(Ipv4Addr::new(10, 203, 255, 254))
        );
        assert_eq!(tunnel_addr(MAX_PEERS), None);
        let mut seen = std::collections::HashSet::new();
        for i in 0..5000 {
            let a = tunnel_addr(i).unwrap();
            assert!(a.octets()[3] != 0 && a.octets()[3] != 255);
            assert!(seen.insert(a));
        }
    }

    #[test]
    fn source_addresses_wrap_inside_the_network() {
        let net = Ipv4Addr::new(10, 97, 0, 0);
        assert_eq!(source_addr(net, 16, 0), Some(Ipv4Addr::new(10, 97, 0, 1)));
        assert_eq!(
            source_addr(net, 16, 65_533),
            Some(Ipv4Addr::new(10, 97, 255, 254))
        );
        assert_eq!(
            source_addr(net, 16, 65_534),
            Some(Ipv4Addr::new(10, 97, 0, 1))
        );
        assert_eq!(
            source_addr(Ipv4Addr::new(10, 97, 3, 9), 30, 2),
            Some(Ipv4Addr::new(10, 97, 3, 9))
        );
        assert_eq!(source_addr(net, 31, 0), None);
        assert_eq!(parse_net("10.97.0.0/16"), Ok((net, 16)));
        assert!(parse_net("10.97.0.0").is_err());
        assert!(parse_net("10.97.0.0/33").is_err());
    }
}
