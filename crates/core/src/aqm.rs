//! Active queue management for the receive queue (the kernel's UDP socket buffer in front of
//! each `tg-udp-rx` thread): CoDel (RFC 8289) on the time the oldest datagram of a batch
//! waited, and which datagram to drop when CoDel says drop. Pure: the sojourn time and `now`
//! are arguments.
//!
//! Why here: under one saturating TCP stream the standing queue of a userspace tunnel sits in
//! the receiver's socket buffer (7 MB, sized so bursts are not lost). TCP fills any buffer its
//! window allows, so a ping waits behind megabytes. The kernel's own fq_codel never sees that
//! queue (it is a socket buffer, not a qdisc). Dropping one bulk datagram, before it is
//! decrypted, when the queue has stood above `target` for an `interval` tells the sender's
//! TCP to slow down; the queue then stays near the target instead of the buffer's size.

use std::time::{Duration, Instant};

/// The default target: a standing queue longer than this is too long. A tunnel's path inside a
/// host or a data centre has a base RTT well under a millisecond, so 1 ms of queue still keeps
/// a TCP stream busy (its window after one multiplicative decrease stays above the
/// bandwidth-delay product).
pub const DEFAULT_TARGET: Duration = Duration::from_millis(1);

/// CoDel's interval is the time a queue may stand above target before the first drop, and the
/// scale of the drop schedule; RFC 8289 asks for a worst-case RTT of the flows and publishes 100
/// ms. A site-to-site tunnel carries 20-150 ms flows: at 10 ms (the first choice, tuned on a
/// LAN) a cubic stream at +80 ms RTT kept 44 % of its throughput with the AQM on, at 100 ms
/// all of it (benches/wan, docs/performance.md). On a LAN the readers' real-time priority keeps
/// the queue short; the AQM is for when they cannot have it.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(100);

/// CoDel's two parameters (`TUNNELGATE_AQM_TARGET_US`, `TUNNELGATE_AQM_INTERVAL_US`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// The standing queue that is too long.
    pub target: Duration,
    /// How long it may stand above `target` before the first drop.
    pub interval: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            target: DEFAULT_TARGET,
            interval: DEFAULT_INTERVAL,
        }
    }
}

/// The CoDel state of one queue (RFC 8289 section 5, with one dequeue per batch).
#[derive(Debug, Clone)]
pub struct Codel {
    target: Duration,
    interval: Duration,
    /// When the sojourn time went above target (plus one interval): the earliest moment the
    /// first drop is allowed. `None` while below target.
    first_above: Option<Instant>,
    dropping: bool,
    drop_next: Option<Instant>,
    count: u32,
    last_count: u32,
}

impl Codel {
    pub fn new(settings: Settings) -> Codel {
        Codel {
            target: settings.target,
            interval: settings.interval,
            first_above: None,
            dropping: false,
            drop_next: None,
            count: 0,
            last_count: 0,
        }
    }

    /// One dequeue: the oldest datagram of the batch just taken waited `sojourn`. Returns how
    /// many datagrams of it to drop (0 almost always; 1, rarely more, while the queue stands
    /// above target).
    pub fn on_dequeue(&mut self, sojourn: Duration, now: Instant) -> u32 {
        let ok_to_drop = self.above_target_long_enough(sojourn, now);
        if self.dropping {
            if !ok_to_drop {
                self.dropping = false;
                return 0;
            }
            let mut drops = 0;
            // The control law: drops come closer together (interval / sqrt(count)) for as long
            // as the queue stands, which is what finds the rate that drains it.
            while let Some(next) = self.drop_next.filter(|next| now >= *next) {
                drops += 1;
                self.count = self.count.saturating_add(1);
                self.drop_next = Some(self.control_law(next));
                if drops == MAX_DROPS_PER_DEQUEUE {
                    break;
                }
            }
            drops
        } else if ok_to_drop {
            self.dropping = true;
            // Resume near the old rate if the queue came back soon after the last episode.
            let delta = self.count.saturating_sub(self.last_count);
            let recent = self
                .drop_next
                .is_some_and(|next| now.saturating_duration_since(next) < self.interval * 16);
            self.count = if delta > 1 && recent { delta } else { 1 };
            self.drop_next = Some(self.control_law(now));
            self.last_count = self.count;
            1
        } else {
            0
        }
    }

    /// Whether CoDel is in its dropping state (for tests and the status of a queue).
    pub fn dropping(&self) -> bool {
        self.dropping
    }

    fn above_target_long_enough(&mut self, sojourn: Duration, now: Instant) -> bool {
        if sojourn < self.target {
            self.first_above = None;
            return false;
        }
        match self.first_above {
            None => {
                self.first_above = Some(now + self.interval);
                false
            }
            Some(at) => now >= at,
        }
    }

    fn control_law(&self, from: Instant) -> Instant {
        from + self.interval.div_f64(f64::from(self.count.max(1)).sqrt())
    }
}

/// The AQM of one receive queue (the socket buffer in front of a `tg-udp-rx` thread): CoDel on
/// how long each batch's oldest datagram waited, and the drops it owes, taken from the next
/// full-size data messages of known peers ([`droppable`]).
#[derive(Debug, Clone)]
pub struct ReceiveQueue {
    codel: Option<Codel>,
    owed: u32,
}

impl ReceiveQueue {
    /// With `settings` `None` the queue is left alone (AQM off, or no receive timestamps).
    pub fn new(settings: Option<Settings>) -> ReceiveQueue {
        ReceiveQueue {
            codel: settings.map(Codel::new),
            owed: 0,
        }
    }

    /// Whether AQM runs on this queue (the caller may skip reading the clocks otherwise).
    pub fn is_on(&self) -> bool {
        self.codel.is_some()
    }

    /// One batch taken from the queue: its oldest datagram waited `waited` (`None`: unknown,
    /// no timestamp), at `now`.
    pub fn on_batch(&mut self, waited: Option<Duration>, now: Instant) {
        let (Some(codel), Some(waited)) = (&mut self.codel, waited) else {
            return;
        };
        let drops = codel.on_dequeue(waited, now);
        // Drops not taken (a batch of small packets only) wait for the next batches, but only
        // while CoDel still drops: a drained queue owes nothing.
        self.owed = if codel.dropping() {
            (self.owed + drops).min(MAX_OWED_DROPS)
        } else {
            0
        };
    }

    /// Whether to drop `datagram` (from a known peer) now, for the AQM.
    #[inline]
    pub fn take_drop(&mut self, datagram: &[u8]) -> bool {
        take_owed_drop(&mut self.owed, datagram)
    }

    /// The drops owed now, handed to whoever handles the batch just dequeued on another thread
    /// (it takes them with [`take_owed_drop`]); this queue owes none until it gets back what
    /// was not taken ([`ReceiveQueue::repay`]).
    pub fn lend(&mut self) -> u32 {
        std::mem::take(&mut self.owed)
    }

    /// Drops lent and not taken (the batch had too few droppable datagrams) are owed again,
    /// as if never lent; the next [`ReceiveQueue::on_batch`] forgets them if CoDel has
    /// stopped dropping.
    pub fn repay(&mut self, drops: u32) {
        self.owed = (self.owed + drops).min(MAX_OWED_DROPS);
    }
}

/// Whether to drop `datagram` (from a known peer) for the AQM, taking one of `owed` drops
/// ([`ReceiveQueue::take_drop`] on the queue's own count, or on a count it lent).
#[inline]
pub fn take_owed_drop(owed: &mut u32, datagram: &[u8]) -> bool {
    if *owed > 0 && droppable(datagram) {
        *owed -= 1;
        return true;
    }
    false
}

/// Drops owed across batches: a few, so a long run of small packets cannot bank a burst of
/// drops for the bulk flow's next packets.
const MAX_OWED_DROPS: u32 = 4;

/// One batch is one dequeue, so a late batch could owe many drops at once; a handful is enough
/// of a signal and never empties a batch.
const MAX_DROPS_PER_DEQUEUE: u32 = 4;

/// The smallest datagram AQM may drop. Sparse flows (pings, DNS, TCP ACKs and requests, a
/// handshake, a game's updates) send small packets, bulk flows full-size ones; dropping only
/// the large keeps the sparse flows whole while the bulk flow's window is what shrinks (the
/// flow-fair half of fq_codel's idea, without reading the encrypted inner headers).
pub const MIN_DROPPABLE_LEN: usize = 512;

/// Whether `datagram` may be dropped by AQM: a WireGuard transport data message (type 4) of at
/// least [`MIN_DROPPABLE_LEN`] bytes. Handshakes, cookies and keepalives never are.
pub fn droppable(datagram: &[u8]) -> bool {
    datagram.len() >= MIN_DROPPABLE_LEN && datagram.first() == Some(&DATA_MESSAGE_TYPE)
}

/// The message type of a WireGuard transport data message (the whitepaper, 5.4.6).
const DATA_MESSAGE_TYPE: u8 = 4;

#[cfg(test)]
mod tests;
