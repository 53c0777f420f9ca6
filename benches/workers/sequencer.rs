//! Per-peer release in sequence order, for the workers bench's `--shared` mode only (the
//! daemon's relay orders its emissions by turns instead: `shell::dataplane::relay`); its tests
//! run as `tests/bench_sequencer.rs`.
//! Several workers seal (or open) one peer's packets and Several workers seal (or open) one peer's packets and
//! finish in any order; the sequencer gives each packet a number when it is handed out and
//! releases the results in that order: outbound, sealed datagrams leave the socket in counter
//! order; inbound, opened packets reach the TUN in the order they arrived. Pure: the shell keeps
//! one per peer behind a lock taken for a `reserve`, a `complete` or a `release`, never across a
//! system call.
//!
//! - **Bounded.** At most `bound` numbers are in flight (reserved and not yet released); the ring
//!   of `bound` slots is allocated once, nothing per item.
//! - **A full sequencer refuses** ([`Sequencer::reserve`] returns `None`) rather than making the
//!   producer wait inside it: waiting here would mean holding the peer's lock across a wait, and
//!   the pure core has no way to wait. The producer (a TUN or socket reader) then waits itself:
//!   it releases what is ready and helps finish what is in flight before it reads more, so the
//!   backlog stays in the kernel's queue (where it is bounded and counted) instead of growing
//!   here, and nothing already numbered is dropped or reordered.
//! - **Exactly once, in order.** Every number reserved is completed once, with an item or with
//!   nothing (a packet that failed to seal or open, or was dropped), and released once, in
//!   order; a number completed with nothing releases as `None`, so a gap that will never be
//!   filled does not hold the others back.

/// Why [`Sequencer::complete`] refused a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SequenceError {
    /// Never reserved, or already released.
    #[error("sequence number {0} is not in flight")]
    NotInFlight(u64),
    /// Completed before.
    #[error("sequence number {0} was already completed")]
    AlreadyComplete(u64),
}

/// Results released in sequence order (see the module).
#[derive(Debug)]
pub struct Sequencer<T> {
    /// Slot `n % bound` belongs to number `n` while it is in flight: `None` until it completes,
    /// then `Some(result)`.
    slots: Box<[Option<Option<T>>]>,
    /// The next number to release: every number below it was released.
    head: u64,
    /// The next number to reserve: `head..tail` are in flight.
    tail: u64,
}

impl<T> Sequencer<T> {
    /// A sequencer with room for `bound` numbers in flight (at least 1).
    pub fn new(bound: usize) -> Sequencer<T> {
        let slots = (0..bound.max(1)).map(|_| None).collect();
        Sequencer {
            slots,
            head: 0,
            tail: 0,
        }
    }

    pub fn bound(&self) -> usize {
        self.slots.len()
    }

    /// Numbers reserved and not yet released.
    pub fn in_flight(&self) -> usize {
        (self.tail - self.head) as usize
    }

    /// The next number [`Sequencer::release`] would give out.
    pub fn next_release(&self) -> u64 {
        self.head
    }

    fn slot(&self, n: u64) -> usize {
        (n % self.slots.len() as u64) as usize
    }

    /// Reserves `n` consecutive numbers and returns the first; `None` (nothing reserved) when
    /// they would put more than the bound in flight.
    pub fn reserve(&mut self, n: usize) -> Option<u64> {
        if self.in_flight() + n > self.bound() {
            return None;
        }
        let first = self.tail;
        self.tail += n as u64;
        Some(first)
    }

    /// Number `n` is finished: with its `result`, or with nothing (`None`: dropped, failed).
    pub fn complete(&mut self, n: u64, result: Option<T>) -> Result<(), SequenceError> {
        if n < self.head || n >= self.tail {
            return Err(SequenceError::NotInFlight(n));
        }
        let slot = self.slot(n);
        if self.slots[slot].is_some() {
            return Err(SequenceError::AlreadyComplete(n));
        }
        self.slots[slot] = Some(result);
        Ok(())
    }

    /// The next number and its result, if it has completed: `(n, None)` for one completed with
    /// nothing. `None` while the next number is still in flight (or none is).
    pub fn release(&mut self) -> Option<(u64, Option<T>)> {
        if self.head == self.tail {
            return None;
        }
        let slot = self.slot(self.head);
        let result = self.slots[slot].take()?;
        let n = self.head;
        self.head += 1;
        Some((n, result))
    }
}
