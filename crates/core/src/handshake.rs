//! The decisions of the handshake path, apart from the packet readers: when the interface is
//! "under load" (from the depth of its handshake queue, as the kernel decides it), and how
//! many handshakes one source may cost per second once it is. Time comes in as `now`.
//!
//! The readers only queue handshake messages (initiations, responses, cookie replies), and
//! under load only each source's share of them ([`Admission`]); one
//! thread of normal priority takes them from the queue, checks mac1, and, under load, demands
//! a cookie (mac2) and charges the source here before any Diffie-Hellman. A source that holds
//! a cookie can thus buy at most [`PER_SOURCE_PER_SECOND`] handshakes a second (after a burst
//! of [`PER_SOURCE_BURST`]), whatever it sends; the global limit of the rate limiter stays
//! behind it as a backstop. The values are wireguard-go's (`ratelimiter.go`: 20/s, burst 5,
//! IPv6 sources counted per /64) and the kernel's (`MAX_QUEUED_INCOMING_HANDSHAKES` 4,096,
//! under load from an eighth of it, held one second).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

/// Handshake messages the queue holds before it drops (the kernel's 4,096 per device).
pub const QUEUE_CAPACITY: usize = 4096;

/// How long the interface stays under load after the queue was last seen deep.
pub const UNDER_LOAD_HOLD: Duration = Duration::from_secs(1);

/// Handshakes per second one source may cost under load, after its burst.
pub const PER_SOURCE_PER_SECOND: u32 = 20;

/// Handshakes one idle source may cost at once under load.
pub const PER_SOURCE_BURST: u32 = 5;

/// Sources the per-source limiter remembers at once. Only sources that proved their address
/// (a valid mac2: the cookie is bound to it) are charged, so spoofed sources cannot fill it; a
/// source past this many is refused until the next sweep frees a place.
pub const MAX_SOURCES: usize = 65_536;

/// Whether the interface is under load: the queue's depth reached an eighth of its capacity
/// within the last [`UNDER_LOAD_HOLD`].
#[derive(Debug, Default, Clone, Copy)]
pub struct UnderLoad {
    until: Option<Instant>,
}

impl UnderLoad {
    /// Records the queue's depth at `now` and says whether the interface is under load.
    pub fn observe(&mut self, depth: usize, capacity: usize, now: Instant) -> bool {
        if depth >= (capacity / 8).max(1) {
            self.until = Some(now + UNDER_LOAD_HOLD);
        }
        self.is_under_load(now)
    }

    pub fn is_under_load(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now < until)
    }
}

/// How long a packet reader waits before its next receive after a batch that brought nothing
/// but refused or queued handshakes and emptied its socket, while the interface is under load
/// ([`flood_nap`]).
pub const FLOOD_NAP: Duration = Duration::from_micros(200);

/// Whether a reader should wait [`FLOOD_NAP`] before it receives again, given the batch it just
/// handled: under load (a handshake flood), with its socket emptied (`drained`), and nothing in
/// the batch that authenticated (`unauthenticated == datagrams`). A flood's trains then reach the
/// reader a few at a time, one wake-up per nap, instead of each waking it: on a shared CPU each
/// wake-up of a real-time reader preempts whatever runs there (the stream's own ends, on a
/// small gateway). What it costs: a datagram of an established peer that arrives during the
/// nap waits for its end, at most [`FLOOD_NAP`]; a batch with anything that authenticated, or
/// one that left datagrams in the socket, never naps.
pub fn flood_nap(
    under_load: bool,
    drained: bool,
    datagrams: u64,
    unauthenticated: u64,
) -> Option<Duration> {
    (under_load && drained && datagrams > 0 && unauthenticated >= datagrams).then_some(FLOOD_NAP)
}

/// What the limiter counts a source by: an IPv4 address, or an IPv6 /64 (one host's share of
/// a network, as wireguard-go counts it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceKey {
    V4([u8; 4]),
    V6([u8; 8]),
}

impl SourceKey {
    pub fn of(addr: IpAddr) -> SourceKey {
        match addr {
            IpAddr::V4(a) => SourceKey::V4(a.octets()),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => SourceKey::V4(v4.octets()),
                None => {
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&a.octets()[..8]);
                    SourceKey::V6(prefix)
                }
            },
        }
    }
}

/// A token bucket per source: [`PER_SOURCE_BURST`] tokens, refilled at
/// [`PER_SOURCE_PER_SECOND`]. Tokens are counted in nanoseconds of refill time so that the
/// arithmetic stays in integers.
#[derive(Debug)]
pub struct SourceLimiter {
    buckets: HashMap<SourceKey, Bucket>,
    last_sweep: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Refill time banked, in nanoseconds: one token is `COST` of it.
    banked: u64,
    last: Instant,
}

const COST: u64 = 1_000_000_000 / PER_SOURCE_PER_SECOND as u64;
const BANK_MAX: u64 = COST * PER_SOURCE_BURST as u64;
/// How often idle buckets (full again) are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Bucket {
    fn full(now: Instant) -> Bucket {
        Bucket {
            banked: BANK_MAX,
            last: now,
        }
    }

    /// The refill banked by `now`, up to a full bucket.
    fn banked_at(&self, now: Instant) -> u64 {
        let refill =
            u64::try_from(now.saturating_duration_since(self.last).as_nanos()).unwrap_or(u64::MAX);
        self.banked.saturating_add(refill).min(BANK_MAX)
    }

    /// Refills to `now` and takes one token: whether there was one.
    fn take(&mut self, now: Instant) -> bool {
        self.banked = self.banked_at(now);
        self.last = now;
        if self.banked >= COST {
            self.banked -= COST;
            true
        } else {
            false
        }
    }
}

/// Sources one packet reader's [`Admission`] table holds: sets of [`ADMISSION_WAYS`].
pub const ADMISSION_SLOTS: usize = 4096;

/// Sources per set of an [`Admission`] table: a source lands in one set by a keyed hash and
/// takes the place of the idlest there, so sources that share a set do not reset each
/// other's buckets.
pub const ADMISSION_WAYS: usize = 4;

/// A packet reader's share per source of the handshake queue, under load: before a handshake
/// message is queued, its source (IPv6 per /64) is charged [`PER_SOURCE_PER_SECOND`] with a
/// burst of [`PER_SOURCE_BURST`], as the handshake path charges a proven source. So sources
/// that flood cannot fill the queue that a new peer's initiation, and then its retry with the
/// cookie, must pass through: the queue holds their share and the newcomer's.
///
/// The address is not proven here (a reader checks no mac): a source may be spoofed. Spoofing
/// a victim's address can spend its share, but only while the interface is under load, which
/// any flood already brings about; spoofing many addresses gets each its own share, and that
/// is no worse than no admission at all. The shell keeps one table per packet thread, so a
/// source whose datagrams one reader and its relay partners open gets a share from each (at
/// most 4). Bounded: a fixed table of sets, chosen by a hash keyed
/// per table (an attacker cannot aim at a victim's set); a new source in a full set takes the
/// place of the one whose bucket is fullest (the idlest), with a full bucket of its own.
pub struct Admission {
    sets: Vec<[Option<(u64, Bucket)>; ADMISSION_WAYS]>,
    hasher: RandomState,
}

impl Default for Admission {
    fn default() -> Self {
        Admission::new()
    }
}

impl Admission {
    pub fn new() -> Admission {
        Admission {
            sets: vec![[None; ADMISSION_WAYS]; ADMISSION_SLOTS / ADMISSION_WAYS],
            hasher: RandomState::new(),
        }
    }

    /// Charges `source` one handshake message at `now`: whether it may be queued.
    pub fn admit(&mut self, source: IpAddr, now: Instant) -> bool {
        let tag = self.hasher.hash_one(SourceKey::of(source));
        let set = &mut self.sets[(tag % (ADMISSION_SLOTS / ADMISSION_WAYS) as u64) as usize];
        if let Some((_, bucket)) = set.iter_mut().flatten().find(|(held, _)| *held == tag) {
            return bucket.take(now);
        }
        // A free place, else the idlest source's: the one with the most refill banked by now.
        let place = set.iter().position(Option::is_none).unwrap_or_else(|| {
            (0..ADMISSION_WAYS)
                .max_by_key(|&w| set[w].map_or(u64::MAX, |(_, b)| b.banked_at(now)))
                .unwrap_or(0)
        });
        let mut bucket = Bucket::full(now);
        let admitted = bucket.take(now);
        set[place] = Some((tag, bucket));
        admitted
    }

    /// Sources the table holds (at most [`ADMISSION_SLOTS`]).
    pub fn sources(&self) -> usize {
        self.sets.iter().flatten().flatten().count()
    }
}

impl Default for SourceLimiter {
    fn default() -> Self {
        SourceLimiter::new()
    }
}

impl SourceLimiter {
    pub fn new() -> SourceLimiter {
        SourceLimiter {
            buckets: HashMap::new(),
            last_sweep: None,
        }
    }

    /// Charges `source` one handshake at `now`: whether it may have it.
    pub fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        self.sweep(now);
        let key = SourceKey::of(source);
        if !self.buckets.contains_key(&key) && self.buckets.len() >= MAX_SOURCES {
            return false;
        }
        self.buckets
            .entry(key)
            .or_insert(Bucket::full(now))
            .take(now)
    }

    /// Sources remembered now.
    pub fn sources(&self) -> usize {
        self.buckets.len()
    }

    /// Forgets, at most once a second, every source whose bucket has refilled: it would start
    /// full anyway.
    fn sweep(&mut self, now: Instant) {
        if self
            .last_sweep
            .is_some_and(|last| now.saturating_duration_since(last) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        self.buckets.retain(|_, b| {
            let refill =
                u64::try_from(now.saturating_duration_since(b.last).as_nanos()).unwrap_or(u64::MAX);
            b.banked.saturating_add(refill) < BANK_MAX
        });
    }
}
