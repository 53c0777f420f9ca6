//! The group's endpoint exchange: replicas that share one identity (one private key behind one
//! balancer) tell each other where they saw its peers authenticate, so that the replica a
//! balancer moves a peer to can take it over through an endpoint the identity has proven
//! (`crate::takeover`), never through an unproven source. It runs on a shared network (a pod
//! network), so every message is sealed and authenticated under a key derived from the group's
//! private key, which only its replicas hold, and carries its sender, a counter and a time:
//! anyone else on that network can neither inject an endpoint nor replay one past
//! [`MAX_AGE`] or twice. Session keys are never exchanged, only endpoints. This module decides
//! (the codec, the replay window, when to answer a hello); `shell::group` does the I/O.
//!
//! A datagram: `"TGX1"`, sender id (8), counter (8), unix time in ms (8), kind (1), then the
//! sealed entries and a 16-byte tag (XChaCha20-Poly1305, nonce = sender id ‖ counter ‖ 0,
//! the header as associated data). An entry: the peer's public key (32), an IPv4 or IPv6
//! address (16, mapped) and a port (2).

use crate::config::{PublicKey, SecretKey};
use blake2::{Blake2s256, Digest};
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// The label the exchange key is derived with from the private key: used for nothing else.
const LABEL: &[u8] = b"tunnelgate group endpoint exchange v1";
const MAGIC: &[u8; 4] = b"TGX1";
const HEADER_LEN: usize = 4 + 8 + 8 + 8 + 1;
const TAG_LEN: usize = 16;
const ENTRY_LEN: usize = 32 + 16 + 2;
/// The largest datagram sent: stays under a 1280-byte IPv6 minimum MTU with headers.
pub const MAX_DATAGRAM: usize = 1200;
/// Entries per datagram.
pub const ENTRIES_PER_DATAGRAM: usize = (MAX_DATAGRAM - HEADER_LEN - TAG_LEN) / ENTRY_LEN;
/// A message older (or further in the future) than this is refused: what a replay of a
/// captured message can still do is re-tell an endpoint a replica proved at most this long ago.
pub const MAX_AGE: Duration = Duration::from_secs(60);
/// Senders remembered (replicas of one group; a flood cannot add any: only sealed messages do).
pub const MAX_SENDERS: usize = 1024;
/// A replica answers one sender's hello with its whole list at most this often.
pub const DUMP_EVERY: Duration = Duration::from_secs(10);

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Endpoints the sender authenticated since its last message.
    News,
    /// A replica that just started: answer with everything known.
    Hello,
    /// An answer to a hello: everything the sender knows, newest first per peer.
    Dump,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::News => 1,
            Kind::Hello => 2,
            Kind::Dump => 3,
        }
    }

    fn of(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::News),
            2 => Some(Kind::Hello),
            3 => Some(Kind::Dump),
            _ => None,
        }
    }
}

/// One told endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub peer: PublicKey,
    pub endpoint: SocketAddr,
}

/// A message that opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub sender: u64,
    pub kind: Kind,
    pub entries: Vec<Entry>,
}

/// Why a datagram was refused, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Refusal {
    /// Not an exchange datagram, or of a size no message has.
    Malformed,
    /// Its tag did not verify: not sealed by a replica of this identity.
    Forged,
    /// Its time is more than [`MAX_AGE`] from this replica's clock.
    Stale,
    /// Its counter was seen (or is older than what this sender sent since).
    Replayed,
    /// This replica's own message, back through the group's name.
    Own,
}

impl Refusal {
    pub const ALL: [Refusal; 5] = [
        Refusal::Malformed,
        Refusal::Forged,
        Refusal::Stale,
        Refusal::Replayed,
        Refusal::Own,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Forged => "forged",
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::Own => "own",
        }
    }
}

/// One replica's end of the exchange: its key, its sender id, its counter, and what it
/// remembers of the others.
pub struct Exchange {
    cipher: XChaCha20Poly1305,
    sender: u64,
    counter: u64,
    /// Per sender: the highest counter taken and a window of the 64 below it.
    seen: HashMap<u64, Window>,
    /// When each sender's hello was last answered.
    dumped: HashMap<u64, Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    highest: u64,
    /// Bit `i`: counter `highest - i` was taken.
    bits: u64,
    last: Instant,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("sender", &self.sender)
            .field("counter", &self.counter)
            .field("senders", &self.seen.len())
            .finish()
    }
}

impl Exchange {
    /// The exchange of the identity `private`, as sender `sender` (random per process: the
    /// caller draws it).
    pub fn new(private: &SecretKey, sender: u64) -> Exchange {
        let mut hash = Blake2s256::new();
        hash.update(LABEL);
        hash.update(private.0);
        let key: [u8; 32] = hash.finalize().into();
        Exchange {
            cipher: XChaCha20Poly1305::new(&key.into()),
            sender,
            counter: 0,
            seen: HashMap::new(),
            dumped: HashMap::new(),
        }
    }

    pub fn sender(&self) -> u64 {
        self.sender
    }

    /// The datagrams telling `entries` (a hello has none), sealed at `unix_ms` (the wall clock:
    /// the replicas' clocks agree, as WireGuard's timestamps already ask of them).
    pub fn seal(&mut self, kind: Kind, entries: &[Entry], unix_ms: u64) -> Vec<Vec<u8>> {
        let chunks: Vec<&[Entry]> = if entries.is_empty() {
            vec![&[]]
        } else {
            entries.chunks(ENTRIES_PER_DATAGRAM).collect()
        };
        chunks
            .into_iter()
            .map(|chunk| {
                self.counter += 1;
                let mut out = Vec::with_capacity(HEADER_LEN + chunk.len() * ENTRY_LEN + TAG_LEN);
                out.extend_from_slice(MAGIC);
                out.extend_from_slice(&self.sender.to_le_bytes());
                out.extend_from_slice(&self.counter.to_le_bytes());
                out.extend_from_slice(&unix_ms.to_le_bytes());
                out.push(kind.byte());
                for e in chunk {
                    out.extend_from_slice(&e.peer.0);
                    let v6 = match e.endpoint.ip() {
                        IpAddr::V4(a) => a.to_ipv6_mapped(),
                        IpAddr::V6(a) => a,
                    };
                    out.extend_from_slice(&v6.octets());
                    out.extend_from_slice(&e.endpoint.port().to_be_bytes());
                }
                let (header, body) = out.split_at_mut(HEADER_LEN);
                let nonce = nonce(self.sender, self.counter);
                // Sealing in memory cannot fail for these sizes.
                let tag = self
                    .cipher
                    .encrypt_in_place_detached(&nonce, header, body)
                    .unwrap_or_default();
                out.extend_from_slice(&tag);
                out
            })
            .collect()
    }

    /// Opens `datagram`, received at `now` (`unix_ms` on the wall clock): a message of another
    /// replica of this identity, not seen before and not older than [`MAX_AGE`], or why not.
    /// A message is taken once.
    pub fn open(
        &mut self,
        datagram: &[u8],
        unix_ms: u64,
        now: Instant,
    ) -> Result<Message, Refusal> {
        let len = datagram.len();
        if !(HEADER_LEN + TAG_LEN..=MAX_DATAGRAM).contains(&len)
            || !(len - HEADER_LEN - TAG_LEN).is_multiple_of(ENTRY_LEN)
            || &datagram[..4] != MAGIC
        {
            return Err(Refusal::Malformed);
        }
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&datagram[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let (sender, counter, sent_ms) = (word(4), word(12), word(20));
        let kind = Kind::of(datagram[28]).ok_or(Refusal::Malformed)?;
        if sender == self.sender {
            return Err(Refusal::Own);
        }
        if sent_ms.abs_diff(unix_ms) > MAX_AGE.as_millis() as u64 {
            return Err(Refusal::Stale);
        }
        // Cheap before the decryption: a counter this sender's window already refuses.
        if self
            .seen
            .get(&sender)
            .is_some_and(|w| !w.would_take(counter))
        {
            return Err(Refusal::Replayed);
        }
        let mut body = datagram[HEADER_LEN..len - TAG_LEN].to_vec();
        let tag = chacha20poly1305::Tag::from_slice(&datagram[len - TAG_LEN..]);
        self.cipher
            .decrypt_in_place_detached(
                &nonce(sender, counter),
                &datagram[..HEADER_LEN],
                &mut body,
                tag,
            )
            .map_err(|_| Refusal::Forged)?;
        // Sealed by a replica: only now may it take a place in the table.
        if !self.seen.contains_key(&sender) && self.seen.len() >= MAX_SENDERS {
            let oldest = self
                .seen
                .iter()
                .min_by_key(|(_, w)| w.last)
                .map(|(s, _)| *s);
            if let Some(oldest) = oldest {
                self.seen.remove(&oldest);
            }
        }
        let window = self.seen.entry(sender).or_insert(Window {
            highest: 0,
            bits: 0,
            last: now,
        });
        if !window.take(counter, now) {
            return Err(Refusal::Replayed);
        }
        let entries = body
            .chunks_exact(ENTRY_LEN)
            .filter_map(|e| {
                let mut peer = [0u8; 32];
                peer.copy_from_slice(&e[..32]);
                let mut ip = [0u8; 16];
                ip.copy_from_slice(&e[32..48]);
                let ip = Ipv6Addr::from(ip);
                let ip = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
                let port = u16::from_be_bytes([e[48], e[49]]);
                (port != 0 && !ip.is_unspecified()).then_some(Entry {
                    peer: PublicKey(peer),
                    endpoint: SocketAddr::new(ip, port),
                })
            })
            .collect();
        Ok(Message {
            sender,
            kind,
            entries,
        })
    }

    /// Whether to answer `sender`'s hello at `now` with a dump: at most every [`DUMP_EVERY`].
    pub fn dump_due(&mut self, sender: u64, now: Instant) -> bool {
        let due = self
            .dumped
            .get(&sender)
            .is_none_or(|at| now.saturating_duration_since(*at) >= DUMP_EVERY);
        if due {
            if self.dumped.len() >= MAX_SENDERS {
                self.dumped
                    .retain(|_, at| now.saturating_duration_since(*at) < DUMP_EVERY);
            }
            self.dumped.insert(sender, now);
        }
        due
    }
}

impl Window {
    /// Whether `counter` would be taken (not seen, not too far below the highest).
    fn would_take(&self, counter: u64) -> bool {
        if counter > self.highest {
            return true;
        }
        let back = self.highest - counter;
        back < 64 && self.bits & (1 << back) == 0
    }

    /// Takes `counter` if it was not seen.
    fn take(&mut self, counter: u64, now: Instant) -> bool {
        if !self.would_take(counter) || counter == 0 {
            return false;
        }
        if counter > self.highest {
            let shift = counter - self.highest;
            self.bits = if shift >= 64 { 0 } else { self.bits << shift };
            self.bits |= 1;
            self.highest = counter;
        } else {
            self.bits |= 1 << (self.highest - counter);
        }
        self.last = now;
        true
    }
}

fn nonce(sender: u64, counter: u64) -> XNonce {
    let mut n = [0u8; 24];
    n[..8].copy_from_slice(&sender.to_le_bytes());
    n[8..16].copy_from_slice(&counter.to_le_bytes());
    XNonce::from(n)
}

#[cfg(test)]
mod tests;
