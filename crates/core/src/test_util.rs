//! Helpers for the core's unit tests only (compiled with `cfg(test)`).

use std::time::Instant;

/// An instant to start a test's fake clock at. Tests may read the clock for that (the code
/// under test never does: it takes `now`).
#[allow(clippy::disallowed_methods)] // a test's epoch, never a decision's input
pub(crate) fn now() -> Instant {
    Instant::now()
}

/// A minimal IPv4/UDP-protocol packet from `src` to `dst` carrying `payload` (no UDP header or
/// checksum: enough for the packet decisions, which read the version, length and addresses).
pub(crate) fn ipv4_packet(src: [u8; 4], dst: [u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 20];
    p[0] = 0x45;
    let len = u16::try_from(20 + payload.len()).expect("small packet");
    p[2..4].copy_from_slice(&len.to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src);
    p[16..20].copy_from_slice(&dst);
    p.extend_from_slice(payload);
    p
}

/// The random number generator the tests' sessions draw handshake keys from.
pub(crate) fn rng() -> crate::wg::Randomness {
    Box::new(rand_core::OsRng)
}

/// The same, borrowed, for a rate limiter's secrets.
pub(crate) fn rng_mut() -> rand_core::OsRng {
    rand_core::OsRng
}
