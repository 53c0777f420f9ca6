//! The decisions of the handshake path, apart from the packet readers: when the interface is
//! "under load" (from the depth of its handshake queue, as the kernel decides it), what a reader
//! does with a handshake message under load ([`Gate`]), and how many handshakes one source may
//! cost per second. Time comes in as `now`.
//!
//! Not under load, the readers queue handshake messages (initiations, responses, cookie
//! replies) as they come; one thread of normal priority takes them from the queue, checks mac1
//! and runs the handshake. Under load, a reader checks the macs itself, as the kernel and
//! wireguard-go do it on their handshake path: a message whose mac2 proves its source address
//! (a cookie for it) is charged to that source, [`PER_SOURCE_PER_SECOND`] after a burst of
//! [`PER_SOURCE_BURST`], and queued; one without gets a cookie reply, from a budget for the
//! whole interface ([`COOKIE_REPLIES_PER_SECOND`]) and, once that is spent, from a small
//! reserve of its source's ([`RESERVE_PER_SECOND`]), and is never queued nor charged to
//! anyone; one with a bad mac1 is dropped. The values are wireguard-go's (`ratelimiter.go`:
//! 20/s, burst 5, IPv6 sources counted per /64) and the kernel's
//! (`MAX_QUEUED_INCOMING_HANDSHAKES` 4,096, under load from an eighth of it, held one second).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// The handshake thread's token bucket per proven source, for the messages it finds proven
/// that no reader charged (queued before the readers saw the load): [`PER_SOURCE_BURST`]
/// tokens, refilled at [`PER_SOURCE_PER_SECOND`]. Tokens are counted in nanoseconds of refill
/// time so that the arithmetic stays in integers.
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

/// How often idle buckets (full again) are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Bucket {
    fn full(now: Instant, rate: Rate) -> Bucket {
        Bucket {
            banked: rate.bank,
            last: now,
        }
    }

    /// The refill banked by `now`, up to a full bucket.
    fn banked_at(&self, now: Instant, rate: Rate) -> u64 {
        let refill =
            u64::try_from(now.saturating_duration_since(self.last).as_nanos()).unwrap_or(u64::MAX);
        self.banked.saturating_add(refill).min(rate.bank)
    }

    /// Refills to `now` and takes one token: whether there was one.
    fn take(&mut self, now: Instant, rate: Rate) -> bool {
        self.banked = self.banked_at(now, rate);
        self.last = now;
        if self.banked >= rate.cost {
            self.banked -= rate.cost;
            true
        } else {
            false
        }
    }
}

/// Sources one packet thread's tables hold (its [`Gate`]'s shares and reserves): sets of
/// [`TABLE_WAYS`].
pub const TABLE_SLOTS: usize = 4096;

/// Sources per set of a [`Gate`]'s tables: a source lands in one set by a keyed hash and takes
/// the place of the idlest there, so sources that share a set do not reset each other's buckets.
pub const TABLE_WAYS: usize = 4;

/// Cookie replies per second the packet threads together send under load from the interface's
/// budget, after a burst of [`COOKIE_REPLIES_BURST`]. Each costs a reader a mac1, its source's
/// cookie and a seal (about 0.8 us here) and a send of its own (a few us more: replies to a
/// flood's many sources rarely share a GSO send); the budget bounds that and what spoofed
/// sources can make the interface send to the addresses they name (64 bytes for each 148 they
/// send). A new peer does not depend on it: its reserve answers it once the budget is spent.
pub const COOKIE_REPLIES_PER_SECOND: u64 = 2_000;
pub const COOKIE_REPLIES_BURST: u64 = 1_000;

/// A source's reserve of cookie replies, drawn only once the interface's budget is spent: its
/// first [`RESERVE_BURST`], then one a second. A new peer needs one cookie reply per initiation
/// it sends without a cookie (one each REKEY_TIMEOUT, 5 s).
pub const RESERVE_PER_SECOND: u32 = 1;
pub const RESERVE_BURST: u32 = 2;

/// All the reserves together, per second (and their burst): sources spoofed at random each
/// find a reserve of their own, so their sum is bounded too.
pub const RESERVES_PER_SECOND: u64 = 4_096;

/// The rate of a token bucket: one token costs `cost` nanoseconds of refill, and a full bucket
/// holds `bank` of them.
#[derive(Debug, Clone, Copy)]
struct Rate {
    cost: u64,
    bank: u64,
}

impl Rate {
    const fn per_second(per_second: u32, burst: u32) -> Rate {
        let cost = 1_000_000_000 / per_second as u64;
        Rate {
            cost,
            bank: cost * burst as u64,
        }
    }
}

const SHARE: Rate = Rate::per_second(PER_SOURCE_PER_SECOND, PER_SOURCE_BURST);
const RESERVE: Rate = Rate::per_second(RESERVE_PER_SECOND, RESERVE_BURST);

/// A token bucket for the whole interface, shared by the packet threads without a lock (the
/// generic cell rate algorithm: one atomic, the time at which the bucket is next full, in
/// nanoseconds since `epoch`).
#[derive(Debug)]
pub struct SharedBucket {
    epoch: Instant,
    /// Nanoseconds of refill per token.
    interval: u64,
    /// How far ahead of now the next-full time may run: `(burst - 1) * interval`.
    tolerance: u64,
    next: AtomicU64,
}

impl SharedBucket {
    /// `per_second` tokens a second after a burst of `burst`, full at `epoch`.
    pub fn new(epoch: Instant, per_second: u64, burst: u64) -> SharedBucket {
        let interval = 1_000_000_000 / per_second.max(1);
        SharedBucket {
            epoch,
            interval,
            tolerance: interval.saturating_mul(burst.max(1) - 1),
            next: AtomicU64::new(0),
        }
    }

    fn at(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether a token is there at `now` (another thread may take it first).
    pub fn available(&self, now: Instant) -> bool {
        let t = self.at(now);
        self.next.load(Ordering::Relaxed).saturating_sub(t) <= self.tolerance
    }

    /// Takes a token at `now`: whether there was one.
    pub fn take(&self, now: Instant) -> bool {
        let t = self.at(now);
        let mut next = self.next.load(Ordering::Relaxed);
        loop {
            let start = next.max(t);
            if start - t > self.tolerance {
                return false;
            }
            match self.next.compare_exchange_weak(
                next,
                start.saturating_add(self.interval),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(seen) => next = seen,
            }
        }
    }
}

/// What the packet threads and the handshake thread share: whether the interface is under load
/// (decided from the queue's depth alone), and the two budgets of cookie replies.
#[derive(Debug)]
pub struct Shared {
    under_load: AtomicBool,
    /// A reader found the queue at an eighth of its capacity or more since the handshake
    /// thread last looked.
    deep: AtomicBool,
    cookies: SharedBucket,
    reserves: SharedBucket,
}

impl Shared {
    pub fn new(now: Instant) -> Shared {
        Shared {
            under_load: AtomicBool::new(false),
            deep: AtomicBool::new(false),
            cookies: SharedBucket::new(now, COOKIE_REPLIES_PER_SECOND, COOKIE_REPLIES_BURST),
            reserves: SharedBucket::new(now, RESERVES_PER_SECOND, RESERVES_PER_SECOND),
        }
    }

    /// Whether the interface is under load, as last decided.
    pub fn under_load(&self) -> bool {
        self.under_load.load(Ordering::Relaxed)
    }

    /// A reader queued a message and the queue then held `depth`: at an eighth of
    /// [`QUEUE_CAPACITY`] or more, the interface is under load from now on (the readers' next
    /// messages see it, before the queue can fill), and the handshake thread hears of the depth
    /// at its next look, however much it has taken from the queue by then.
    pub fn queued(&self, depth: usize) {
        if depth >= DEEP && !self.deep.load(Ordering::Relaxed) {
            self.deep.store(true, Ordering::Relaxed);
            self.under_load.store(true, Ordering::Relaxed);
        }
    }

    /// The handshake thread's look at the queue, once per round: its `depth` now, and what the
    /// readers saw of it since the last look. Nothing else keeps the interface under load: it
    /// ends [`UNDER_LOAD_HOLD`] after the queue was last deep.
    pub fn observe(&self, load: &mut UnderLoad, depth: usize, now: Instant) -> bool {
        let deep = self.deep.swap(false, Ordering::Relaxed);
        let seen = if deep { depth.max(DEEP) } else { depth };
        let on = load.observe(seen, QUEUE_CAPACITY, now);
        self.under_load.store(on, Ordering::Relaxed);
        on
    }
}

/// The depth from which the interface is under load.
const DEEP: usize = QUEUE_CAPACITY / 8;

/// What a packet reader does with a handshake message (an initiation or a response) under
/// load ([`Gate::admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Queue it: its mac2 proved its source's address, and the source was charged its share.
    Queue,
    /// Answer it with a cookie reply (its mac1 is valid; it proved nothing).
    Cookie,
    /// Drop it: its mac1 is wrong. No one was charged.
    Invalid,
    /// Drop it: its source's share is spent and no cookie reply is left to give it, or it
    /// proved nothing and none is left. No one was charged.
    Limited,
}

/// One packet thread's decisions under load, with its two tables: each proven source's share
/// of the queue and each source's reserve of cookie replies.
///
/// A message may be queued only if its source has a share left and its mac2 is valid (mac2 is
/// checked only then); then mac1, and only a message with both is charged to its source. Any
/// other message is treated as one without a cookie: a cookie reply from the interface's
/// budget, or, once that is spent, from its source's reserve (and the reserves' own budget),
/// each after mac1 is found valid; else it is dropped. So a source is charged only for what its
/// mac2 proved it sent, and a message that did not prove its source costs that source nothing
/// but the reserve, which is drawn only when the budget every source shares is spent: a
/// spoofer that empties a victim's reserve leaves the victim where a design without reserves
/// would, with the budget, never worse. A source past its share is treated as one without a
/// cookie: it may get a cookie reply it already holds, never a place in the queue.
pub struct Gate {
    shares: SourceTable,
    reserves: SourceTable,
    hasher: RandomState,
    /// The last source and its tag: a GRO train is one source's.
    last: Option<(IpAddr, u64)>,
    /// What was found for the last source at the last instant ([`Memo`]).
    memo: Option<Memo>,
    /// Off only in tests: the design without reserves, to compare with.
    with_reserves: bool,
}

/// What a [`Gate`] found for one source at one instant. A receive batch's clock does not move,
/// and nothing but this gate's own decisions for that source could change the answers within
/// it (the budgets only empty at a given instant), so the rest of a GRO train, one source's, is
/// decided without the tables: whether the source's share has a token, and whether no cookie
/// reply was left for it. (Another source taking a place in the same set could only have made
/// the tables more generous; the memo is never less strict than they are.)
#[derive(Debug, Clone, Copy)]
struct Memo {
    tag: u64,
    at: Instant,
    share_left: bool,
    no_cookie: bool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            shares: SourceTable::new(SHARE),
            reserves: SourceTable::new(RESERVE),
            hasher: RandomState::new(),
            last: None,
            memo: None,
            with_reserves: true,
        }
    }

    /// The decision for one message from `source` at `now`: `mac2_valid` and `mac1_valid` check
    /// the message's macs, and are asked only when the answer matters (and mac1 before anything
    /// is given or charged).
    pub fn admit(
        &mut self,
        shared: &Shared,
        source: IpAddr,
        now: Instant,
        mac2_valid: impl FnOnce() -> bool,
        mac1_valid: impl FnOnce() -> bool,
    ) -> Admit {
        let tag = self.tag(source);
        let memo = self.memo.filter(|m| m.tag == tag && m.at == now);
        let share_left = match memo {
            Some(m) => m.share_left,
            None => self.shares.has_token(tag, now),
        };
        if share_left && mac2_valid() {
            self.memo = None;
            if !mac1_valid() {
                return Admit::Invalid;
            }
            self.shares.take(tag, now);
            return Admit::Queue;
        }
        let remember = |no_cookie| {
            Some(Memo {
                tag,
                at: now,
                share_left,
                no_cookie,
            })
        };
        if memo.is_some_and(|m| m.no_cookie) {
            return Admit::Limited;
        }
        let from_budget = shared.cookies.available(now);
        let from_reserve = !from_budget
            && self.with_reserves
            && self.reserves.has_token(tag, now)
            && shared.reserves.available(now);
        if !from_budget && !from_reserve {
            self.memo = remember(true);
            return Admit::Limited;
        }
        self.memo = remember(false);
        if !mac1_valid() {
            return Admit::Invalid;
        }
        if shared.cookies.take(now) {
            return Admit::Cookie;
        }
        // Another thread took the budget's last token meanwhile: the reserve, as above.
        if self.with_reserves && self.reserves.has_token(tag, now) && shared.reserves.take(now) {
            self.reserves.take(tag, now);
            return Admit::Cookie;
        }
        self.memo = remember(true);
        Admit::Limited
    }

    fn tag(&mut self, source: IpAddr) -> u64 {
        match self.last {
            Some((last, tag)) if last == source => tag,
            _ => {
                let tag = self.hasher.hash_one(SourceKey::of(source));
                self.last = Some((source, tag));
                tag
            }
        }
    }

    /// Sources the share table holds (at most [`TABLE_SLOTS`]).
    pub fn charged_sources(&self) -> usize {
        self.shares.sources()
    }

    #[cfg(test)]
    fn without_reserves() -> Gate {
        Gate {
            with_reserves: false,
            ..Gate::new()
        }
    }
}

/// A fixed table of token buckets per source (by a keyed hash: an attacker cannot aim at a
/// victim's set); a new source in a full set takes the place of the one whose bucket is fullest
/// (the idlest), with a full bucket of its own.
struct SourceTable {
    rate: Rate,
    sets: Vec<[Option<(u64, Bucket)>; TABLE_WAYS]>,
}

impl SourceTable {
    fn new(rate: Rate) -> SourceTable {
        SourceTable {
            rate,
            sets: vec![[None; TABLE_WAYS]; TABLE_SLOTS / TABLE_WAYS],
        }
    }

    fn set(&mut self, tag: u64) -> &mut [Option<(u64, Bucket)>; TABLE_WAYS] {
        let sets = self.sets.len() as u64;
        &mut self.sets[(tag % sets) as usize]
    }

    /// Whether `tag`'s source has a token at `now` (a source not in the table would start full).
    fn has_token(&mut self, tag: u64, now: Instant) -> bool {
        let rate = self.rate;
        match self
            .set(tag)
            .iter()
            .flatten()
            .find(|(held, _)| *held == tag)
        {
            Some((_, bucket)) => bucket.banked_at(now, rate) >= rate.cost,
            None => true,
        }
    }

    /// Takes a token of `tag`'s source at `now`: whether there was one.
    fn take(&mut self, tag: u64, now: Instant) -> bool {
        let rate = self.rate;
        let set = self.set(tag);
        if let Some((_, bucket)) = set.iter_mut().flatten().find(|(held, _)| *held == tag) {
            return bucket.take(now, rate);
        }
        // A free place, else the idlest source's: the one with the most refill banked by now.
        let place = set.iter().position(Option::is_none).unwrap_or_else(|| {
            (0..TABLE_WAYS)
                .max_by_key(|&w| set[w].map_or(u64::MAX, |(_, b)| b.banked_at(now, rate)))
                .unwrap_or(0)
        });
        let mut bucket = Bucket::full(now, rate);
        let taken = bucket.take(now, rate);
        set[place] = Some((tag, bucket));
        taken
    }

    fn sources(&self) -> usize {
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
            .or_insert(Bucket::full(now, SHARE))
            .take(now, SHARE)
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
            b.banked.saturating_add(refill) < SHARE.bank
        });
    }
}
