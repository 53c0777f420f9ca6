use super::handshake::{b2s_hash, constant_time_eq};
use crate::noise::handshake::{LABEL_COOKIE, LABEL_MAC1};
use crate::noise::{HandshakeInit, HandshakeResponse, Packet, Tunn, TunnResult, WireGuardError};

use std::convert::TryInto;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::sleepyinstant::Instant;

use aead::generic_array::GenericArray;
use blake2::digest::block_buffer::{BlockBuffer, Lazy};
use blake2::digest::core_api::{BlockSizeUser, UpdateCore, VariableOutputCore};
use blake2::Blake2sVarCore;
use parking_lot::Mutex;
use rand_core::CryptoRngCore;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

const COOKIE_REFRESH: u64 = 128; // Use 128 and not 120 so the compiler can optimize out the division
const COOKIE_SIZE: usize = 16;
const COOKIE_NONCE_SIZE: usize = 24;

/// How often should reset count in seconds
const RESET_PERIOD: u64 = 1;

type Cookie = [u8; COOKIE_SIZE];

/// BLAKE2s-128 keyed with one key, its key block compressed once (tunnelgate): mac1 (keyed with
/// a hash of our public key), the cookie (keyed with the secret) and a source's mac2 (keyed with
/// its cookie) are each computed from a copy, one compression of the three or four fewer.
#[derive(Clone)]
struct KeyedMac16 {
    core: Blake2sVarCore,
}

impl KeyedMac16 {
    /// `key`: 1 to 32 bytes (WireGuard's are 16 or 32).
    fn new(key: &[u8]) -> KeyedMac16 {
        let mut core = Blake2sVarCore::new_with_params(&[], &[], key.len(), COOKIE_SIZE);
        let mut block = GenericArray::<u8, <Blake2sVarCore as BlockSizeUser>::BlockSize>::default();
        block[..key.len()].copy_from_slice(key);
        core.update_blocks(std::slice::from_ref(&block));
        KeyedMac16 { core }
    }

    /// The MAC of `a` then `b`.
    fn mac(&self, a: &[u8], b: &[u8]) -> [u8; COOKIE_SIZE] {
        let mut core = self.core.clone();
        let mut buffer = BlockBuffer::<_, Lazy>::default();
        buffer.digest_blocks(a, |blocks| core.update_blocks(blocks));
        buffer.digest_blocks(b, |blocks| core.update_blocks(blocks));
        let mut out = GenericArray::default();
        core.finalize_variable_core(&mut buffer, &mut out);
        let mut mac = [0u8; COOKIE_SIZE];
        mac.copy_from_slice(&out[..COOKIE_SIZE]);
        mac
    }
}

/// One source address's cookie as the responder computes it now, with mac2's key state made from
/// it (tunnelgate): computed once for a run of messages from one source (a GRO train), then
/// [`RateLimiter::mac2_is_valid`] and [`RateLimiter::write_cookie_reply`] for each.
#[derive(Clone)]
pub struct SourceCookie {
    cookie: Cookie,
    mac2: KeyedMac16,
}

/// There are two places where WireGuard requires "randomness" for cookies
/// * The 24 byte nonce in the cookie massage - here the only goal is to avoid nonce reuse
/// * A secret value that changes every two minutes
///
/// Because the main goal of the cookie is simply for a party to prove ownership of an IP address
/// we can relax the randomness definition a bit, in order to avoid locking, because using less
/// resources is the main goal of any DoS prevention mechanism.
/// In order to avoid locking and calls to rand we derive pseudo random values using the AEAD and
/// some counters.
pub struct RateLimiter {
    /// The cookie secret's MAC, its key block done (tunnelgate: was the secret itself)
    secret: KeyedMac16,
    start_time: Instant,
    /// The cookie reply's nonce is this prefix and a counter (tunnelgate; upstream hashed the
    /// counter with a key): a fixed prefix makes XChaCha20's subkey a constant, made once.
    nonce_prefix: [u8; 16],
    /// A single 64 bit counter (should suffice for many years), from a random start
    nonce_ctr: AtomicU64,
    /// mac1's MAC, keyed with HASH(LABEL_MAC1 || our public key), its key block done
    mac1: KeyedMac16,
    /// ChaCha20-Poly1305 under XChaCha20's subkey of HASH(LABEL_COOKIE || our public key) for
    /// `nonce_prefix`: what XChaCha20-Poly1305 with that key and nonce does, without an HChaCha20
    /// per reply
    cookie_seal: LessSafeKey,
    limit: u64,
    /// The counter since last reset
    count: AtomicU64,
    /// The time last reset was performed on this rate limiter
    last_reset: Mutex<Instant>,
    /// Under load by the caller's measure (tunnelgate: the depth of its handshake queue), on
    /// top of the count above, which stays as a backstop.
    under_load: AtomicBool,
}

impl RateLimiter {
    /// `rng` gives the cookie secrets (drawn once, here).
    pub fn new(
        public_key: &crate::x25519::PublicKey,
        limit: u64,
        rng: &mut dyn CryptoRngCore,
    ) -> Self {
        let mut secret_key = [0u8; 16];
        rng.fill_bytes(&mut secret_key);
        let mut nonce_prefix = [0u8; 16];
        rng.fill_bytes(&mut nonce_prefix);
        let nonce_start = rng.next_u64();
        let cookie_key = b2s_hash(LABEL_COOKIE, public_key.as_bytes());
        let subkey = chacha20::hchacha::<chacha20::cipher::consts::U10>(
            GenericArray::from_slice(&cookie_key),
            GenericArray::from_slice(&nonce_prefix),
        );
        // A 32-byte key is all CHACHA20_POLY1305 asks for.
        let cookie_seal = LessSafeKey::new(
            UnboundKey::new(&CHACHA20_POLY1305, &subkey).expect("a 32-byte ChaCha20 key"),
        );
        RateLimiter {
            secret: KeyedMac16::new(&secret_key),
            start_time: Instant::now(),
            nonce_prefix,
            nonce_ctr: AtomicU64::new(nonce_start),
            mac1: KeyedMac16::new(&b2s_hash(LABEL_MAC1, public_key.as_bytes())),
            cookie_seal,
            limit,
            count: AtomicU64::new(0),
            last_reset: Mutex::new(Instant::now()),
            under_load: AtomicBool::new(false),
        }
    }

    /// Reset packet count (ideally should be called with a period of 1 second)
    pub fn reset_count(&self) {
        // The rate limiter is not very accurate, but at the scale we care about it doesn't matter much
        let current_time = Instant::now();
        let mut last_reset_time = self.last_reset.lock();
        if current_time.duration_since(*last_reset_time).as_secs() >= RESET_PERIOD {
            self.count.store(0, Ordering::SeqCst);
            *last_reset_time = current_time;
        }
    }

    /// Compute the correct cookie value based on the current secret value and the source IP
    fn current_cookie(&self, addr: IpAddr) -> Cookie {
        let mut addr_bytes = [0u8; 16];

        match addr {
            IpAddr::V4(a) => addr_bytes[..4].copy_from_slice(&a.octets()[..]),
            IpAddr::V6(a) => addr_bytes[..].copy_from_slice(&a.octets()[..]),
        }

        // The current cookie for a given IP is the MAC(responder.changing_secret_every_two_minutes, initiator.ip_address)
        // First we derive the secret from the current time, the value of cur_counter would change with time.
        let cur_counter = Instant::now().duration_since(self.start_time).as_secs() / COOKIE_REFRESH;

        // Next we derive the cookie
        self.secret.mac(&cur_counter.to_le_bytes(), &addr_bytes)
    }

    /// The cookie of `addr` now, for [`RateLimiter::mac2_is_valid`] and
    /// [`RateLimiter::write_cookie_reply`] (tunnelgate).
    pub fn source_cookie(&self, addr: IpAddr) -> SourceCookie {
        let cookie = self.current_cookie(addr);
        SourceCookie {
            cookie,
            mac2: KeyedMac16::new(&cookie),
        }
    }

    /// Whether `message` (an initiation or a response, by its type and size) carries a valid
    /// mac1 for our public key (tunnelgate). Anything else is `false`.
    pub fn mac1_is_valid(&self, message: &[u8]) -> bool {
        let Some((msg, mac1, _)) = split_macs(message) else {
            return false;
        };
        constant_time_eq(&self.mac1.mac(msg, &[]), mac1)
    }

    /// Whether `message` (an initiation or a response) carries a valid mac2 for `source`'s
    /// cookie (tunnelgate). A mac2 of zeros is no cookie (an initiator without one sends
    /// zeros): `false` without a MAC.
    pub fn mac2_is_valid(source: &SourceCookie, message: &[u8]) -> bool {
        let Some((_, _, mac2)) = split_macs(message) else {
            return false;
        };
        if mac2.iter().all(|b| *b == 0) {
            return false;
        }
        let covered = &message[..message.len() - COOKIE_SIZE];
        constant_time_eq(&source.mac2.mac(covered, &[]), mac2)
    }

    /// Writes into `dst` the cookie reply to `message` (an initiation or a response: the reply
    /// names its sender index and binds its mac1) for `source`'s cookie (tunnelgate). The
    /// caller checked mac1. `None`: not such a message, or `dst` too small.
    pub fn write_cookie_reply(
        &self,
        source: &SourceCookie,
        message: &[u8],
        dst: &mut [u8],
    ) -> Option<usize> {
        let (_, mac1, _) = split_macs(message)?;
        let index = u32::from_le_bytes(message.get(4..8)?.try_into().ok()?);
        self.format_cookie_reply(index, source.cookie, mac1, dst)
            .ok()
            .map(|reply| reply.len())
    }

    fn nonce(&self) -> ([u8; COOKIE_NONCE_SIZE], [u8; 8]) {
        let ctr = self.nonce_ctr.fetch_add(1, Ordering::Relaxed).to_le_bytes();
        let mut nonce = [0u8; COOKIE_NONCE_SIZE];
        nonce[..16].copy_from_slice(&self.nonce_prefix);
        nonce[16..].copy_from_slice(&ctr);
        (nonce, ctr)
    }

    /// Whether a handshake message of kind `initiation` (else a response) must prove its
    /// source now. Only initiations count towards the per-second limit (tunnelgate): a
    /// response answers an initiation this side sent (to a peer it chose; it costs a
    /// Diffie-Hellman only if it names a handshake in flight), and counting them put the
    /// answers to a restart's thousands of takeovers, or to thousands of rekeys, through a
    /// cookie round each. The caller's own load (its queue's depth) covers both.
    fn is_under_load(&self, initiation: bool) -> bool {
        let over_count = initiation && self.count.fetch_add(1, Ordering::SeqCst) >= self.limit;
        over_count || self.under_load.load(Ordering::Relaxed)
    }

    /// Says whether the caller counts itself under load: while it does, every handshake
    /// message must carry a valid mac2 (a cookie for its source address).
    pub fn set_under_load(&self, on: bool) {
        self.under_load.store(on, Ordering::Relaxed);
    }

    pub(crate) fn format_cookie_reply<'a>(
        &self,
        idx: u32,
        cookie: Cookie,
        mac1: &[u8],
        dst: &'a mut [u8],
    ) -> Result<&'a mut [u8], WireGuardError> {
        if dst.len() < super::COOKIE_REPLY_SZ {
            return Err(WireGuardError::DestinationBufferTooSmall);
        }

        let (message_type, rest) = dst.split_at_mut(4);
        let (receiver_index, rest) = rest.split_at_mut(4);
        let (nonce, rest) = rest.split_at_mut(24);
        let (encrypted_cookie, _) = rest.split_at_mut(16 + 16);

        // msg.message_type = 3
        // msg.reserved_zero = { 0, 0, 0 }
        message_type.copy_from_slice(&super::COOKIE_REPLY.to_le_bytes());
        // msg.receiver_index = little_endian(initiator.sender_index)
        receiver_index.copy_from_slice(&idx.to_le_bytes());
        let (full_nonce, counter) = self.nonce();
        nonce.copy_from_slice(&full_nonce);

        // XChaCha20-Poly1305(key, prefix || counter) is ChaCha20-Poly1305 under HChaCha20(key,
        // prefix) with the nonce 0^4 || counter: the subkey is made once, in `new`.
        let mut ietf_nonce = [0u8; 12];
        ietf_nonce[4..].copy_from_slice(&counter);
        encrypted_cookie[..16].copy_from_slice(&cookie);
        let tag = self
            .cookie_seal
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(ietf_nonce),
                Aad::from(mac1),
                &mut encrypted_cookie[..16],
            )
            .map_err(|_| WireGuardError::DestinationBufferTooSmall)?;

        encrypted_cookie[16..].copy_from_slice(tag.as_ref());

        Ok(&mut dst[..super::COOKIE_REPLY_SZ])
    }

    /// Verify the MAC fields on the datagram, and apply rate limiting if needed
    pub fn verify_packet<'a, 'b>(
        &self,
        src_addr: Option<IpAddr>,
        src: &'a [u8],
        dst: &'b mut [u8],
    ) -> Result<Packet<'a>, TunnResult<'b>> {
        self.verify_packet_proving(src_addr, src, dst)
            .map(|(packet, _)| packet)
    }

    /// As [`RateLimiter::verify_packet`], and says whether the message proved its source
    /// address (a valid mac2 was demanded and found), so the caller may charge that source.
    pub fn verify_packet_proving<'a, 'b>(
        &self,
        src_addr: Option<IpAddr>,
        src: &'a [u8],
        dst: &'b mut [u8],
    ) -> Result<(Packet<'a>, bool), TunnResult<'b>> {
        let packet = Tunn::parse_incoming_packet(src)?;
        let mut proved = false;

        // Verify and rate limit handshake messages only
        if let Packet::HandshakeInit(HandshakeInit { sender_idx, .. })
        | Packet::HandshakeResponse(HandshakeResponse { sender_idx, .. }) = packet
        {
            let (msg, macs) = src.split_at(src.len() - 32);
            let (mac1, mac2) = macs.split_at(16);

            let computed_mac1 = self.mac1.mac(msg, &[]);
            if !constant_time_eq(&computed_mac1[..16], mac1) {
                return Err(TunnResult::Err(WireGuardError::InvalidMac));
            }

            if self.is_under_load(matches!(packet, Packet::HandshakeInit(_))) {
                let addr = match src_addr {
                    None => return Err(TunnResult::Err(WireGuardError::UnderLoad)),
                    Some(addr) => addr,
                };

                // Only given an address can we validate mac2
                let cookie = self.current_cookie(addr);
                let computed_mac2 = KeyedMac16::new(&cookie).mac(msg, mac1);

                if !constant_time_eq(&computed_mac2[..16], mac2) {
                    let cookie_packet = self
                        .format_cookie_reply(sender_idx, cookie, mac1, dst)
                        .map_err(TunnResult::Err)?;
                    return Err(TunnResult::WriteToNetwork(cookie_packet));
                }
                proved = true;
            }
        }

        Ok((packet, proved))
    }
}

/// An initiation's or a response's bytes before mac1, mac1 and mac2 (by type and size alone).
fn split_macs(message: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let kind = u32::from_le_bytes(message.get(..4)?.try_into().ok()?);
    let expected = match kind {
        super::HANDSHAKE_INIT => super::HANDSHAKE_INIT_SZ,
        super::HANDSHAKE_RESP => super::HANDSHAKE_RESP_SZ,
        _ => return None,
    };
    if message.len() != expected {
        return None;
    }
    let (msg, macs) = message.split_at(message.len() - 2 * COOKIE_SIZE);
    let (mac1, mac2) = macs.split_at(COOKIE_SIZE);
    Some((msg, mac1, mac2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::noise::handshake::{b2s_keyed_mac_16, b2s_keyed_mac_16_2};
    use aead::{Aead, KeyInit, Payload};
    use chacha20poly1305::XChaCha20Poly1305;

    fn limiter() -> (RateLimiter, crate::x25519::PublicKey) {
        let secret = crate::x25519::StaticSecret::random_from_rng(rand_core::OsRng);
        let public = crate::x25519::PublicKey::from(&secret);
        (RateLimiter::new(&public, 10, &mut rand_core::OsRng), public)
    }

    /// An initiation with a valid mac1 for `public` and the given mac2.
    fn initiation(public: &crate::x25519::PublicKey, mac2: [u8; 16]) -> Vec<u8> {
        let mut m = vec![7u8; 148];
        m[..4].copy_from_slice(&1u32.to_le_bytes());
        let mac1 = b2s_keyed_mac_16(&b2s_hash(LABEL_MAC1, public.as_bytes()), &m[..116]);
        m[116..132].copy_from_slice(&mac1);
        m[132..].copy_from_slice(&mac2);
        m
    }

    /// A response with a valid mac1 for `public` and no mac2.
    fn response(public: &crate::x25519::PublicKey) -> Vec<u8> {
        let mut m = vec![7u8; 92];
        m[..4].copy_from_slice(&2u32.to_le_bytes());
        let mac1 = b2s_keyed_mac_16(&b2s_hash(LABEL_MAC1, public.as_bytes()), &m[..60]);
        m[60..76].copy_from_slice(&mac1);
        m[76..].fill(0);
        m
    }

    /// Past the per-second count, an initiation without a cookie gets a cookie reply; a
    /// response never does for the count alone (it answers this side's own initiation), only
    /// while the caller says it is under load.
    #[test]
    fn only_initiations_count_towards_the_per_second_limit() {
        let (limiter, public) = limiter();
        let addr: IpAddr = "192.0.2.1".parse().expect("ip");
        let mut out = [0u8; 128];
        let init = initiation(&public, [0; 16]);
        let resp = response(&public);
        for _ in 0..50 {
            assert!(
                limiter
                    .verify_packet_proving(Some(addr), &resp, &mut out)
                    .is_ok(),
                "responses are not counted"
            );
        }
        let answered = (0..20)
            .filter(|_| {
                limiter
                    .verify_packet_proving(Some(addr), &init, &mut out)
                    .is_ok()
            })
            .count();
        assert_eq!(answered, 10, "the limit of 10 a second, then cookies");
        assert!(limiter
            .verify_packet_proving(Some(addr), &resp, &mut out)
            .is_ok());
        limiter.set_under_load(true);
        assert!(
            matches!(
                limiter.verify_packet_proving(Some(addr), &resp, &mut out),
                Err(TunnResult::WriteToNetwork(_))
            ),
            "under the caller's load a response proves its source too"
        );
    }

    /// The precomputed MAC states give upstream's values, and the reply made with the fixed
    /// prefix and the precomputed subkey opens as any XChaCha20-Poly1305 reply does.
    #[test]
    fn precomputed_macs_and_the_cookie_reply_are_wireguards() {
        let (limiter, public) = limiter();
        let addr: IpAddr = "192.0.2.1".parse().expect("ip");
        let source = limiter.source_cookie(addr);
        let good = initiation(&public, [0; 16]);
        assert!(limiter.mac1_is_valid(&good));
        let mut bad = good.clone();
        bad[20] ^= 1;
        assert!(!limiter.mac1_is_valid(&bad));
        assert!(!limiter.mac1_is_valid(&good[..147]));
        assert!(
            !RateLimiter::mac2_is_valid(&source, &good),
            "zeros are no cookie"
        );
        let mac2 = b2s_keyed_mac_16_2(&source.cookie, &good[..116], &good[116..132]);
        let signed = initiation(&public, mac2);
        assert!(RateLimiter::mac2_is_valid(&source, &signed));
        let other = limiter.source_cookie("192.0.2.2".parse().expect("ip"));
        assert!(
            !RateLimiter::mac2_is_valid(&other, &signed),
            "another address's cookie"
        );

        let mut replies = [[0u8; 64]; 2];
        for reply in &mut replies {
            let len = limiter.write_cookie_reply(&source, &good, reply);
            assert_eq!(len, Some(64));
            assert_eq!(&reply[4..8], &good[4..8], "names the initiation's sender");
            let key = b2s_hash(LABEL_COOKIE, public.as_bytes());
            let opened = XChaCha20Poly1305::new_from_slice(&key)
                .expect("a 32-byte key")
                .decrypt(
                    GenericArray::from_slice(&reply[8..32]),
                    Payload {
                        msg: &reply[32..64],
                        aad: &good[116..132],
                    },
                )
                .expect("the reply opens");
            assert_eq!(opened, source.cookie);
        }
        assert_ne!(
            replies[0][8..32],
            replies[1][8..32],
            "a nonce is never reused"
        );
    }
}
