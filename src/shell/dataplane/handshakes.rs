//! The handshake path, apart from the packet readers: the bounded queue the readers hand
//! handshake messages to (initiations, responses, cookie replies; never blocking, a full queue
//! drops and counts), the state the readers share for it (under load, the cookie budgets) and
//! each packet thread's gate under load (decided in `core::handshake`: a reader queues only
//! messages whose mac2 proved their source, charged to it, and answers the others with cookie
//! replies itself), and the work the timer thread does with the queue at normal priority: mac1,
//! and under load mac2 and, for a proven source no reader charged, the per-source limit, then
//! the Diffie-Hellman and the reply. A packet reader so never runs a Diffie-Hellman and never
//! waits behind one, however many initiations arrive.

use super::send::send_one;
use super::table::PeerTable;
use super::Inner;
use crate::core::handshake::{Admit, Gate, Shared, SourceLimiter, UnderLoad, QUEUE_CAPACITY};
use crate::core::packet::{self, DropReason, Inbound, PeerPath, Sender};
use crate::shell::udp::{WgSocket, MAX_DATAGRAM};
use crossbeam_queue::ArrayQueue;
use std::cell::RefCell;
use std::net::IpAddr;
use std::time::Instant;

/// The largest handshake message (an initiation); a response is 92 bytes, a cookie reply 64.
const LARGEST: usize = 148;

/// Handshake messages the timer thread takes from the queue before it looks at its timers
/// again: about 10 ms of Diffie-Hellman on this VM, so a flood never holds keepalives and
/// rekeys back longer than that.
pub(super) const PER_ROUND: usize = 64;

/// One queued handshake message: where it came from, which worker's socket took it (the reply
/// leaves by the same), whether a reader charged its proven source already, and its bytes
/// (copied: the reader's batch is reused at once).
struct Queued {
    from: PeerPath,
    worker: usize,
    len: u8,
    charged: bool,
    bytes: [u8; LARGEST],
}

/// The queue between the readers (many producers: readers and relay partners) and the timer
/// thread (the one consumer). Lock-free, so a real-time reader never waits on a lock the
/// normal-priority consumer holds.
pub(super) struct HandshakeQueue {
    queue: ArrayQueue<Queued>,
    /// Under load (from the queue's depth alone) and the cookie budgets, shared by the packet
    /// threads and the timer thread.
    shared: Shared,
}

std::thread_local! {
    /// Each packet thread's own gate (its share and reserve tables, made at its first message
    /// under load): no lock between readers, and a source keeps to one reader's socket by the
    /// kernel's hash.
    static GATE: RefCell<Option<Gate>> = const { RefCell::new(None) };
}

impl HandshakeQueue {
    pub(super) fn new(now: Instant) -> HandshakeQueue {
        HandshakeQueue {
            queue: ArrayQueue::new(QUEUE_CAPACITY),
            shared: Shared::new(now),
        }
    }

    /// Under load, what this packet thread does with an initiation or a response from
    /// `source` at `now` ([`Gate::admit`], this thread's gate): the macs are checked by the
    /// closures, only when the answer matters.
    pub(super) fn admit(
        &self,
        source: IpAddr,
        now: Instant,
        mac2_valid: impl FnOnce() -> bool,
        mac1_valid: impl FnOnce() -> bool,
    ) -> Admit {
        GATE.with(|gate| {
            gate.borrow_mut().get_or_insert_with(Gate::new).admit(
                &self.shared,
                source,
                now,
                mac2_valid,
                mac1_valid,
            )
        })
    }

    /// Whether the interface is under load, as last decided.
    pub(super) fn under_load(&self) -> bool {
        self.shared.under_load()
    }

    /// Queues `datagram` (a handshake message by [`crate::core::wg::is_handshake`]), received
    /// on `worker`'s socket from `from` (`charged`: its proven source was charged by the
    /// reader). `false`: the queue is full and it was not taken. A push that leaves the queue
    /// deep puts the interface under load at once.
    pub(super) fn push(
        &self,
        from: PeerPath,
        worker: usize,
        datagram: &[u8],
        charged: bool,
    ) -> bool {
        let Ok(len) = u8::try_from(datagram.len()) else {
            return false;
        };
        if usize::from(len) > LARGEST {
            return false;
        }
        let mut bytes = [0u8; LARGEST];
        bytes[..datagram.len()].copy_from_slice(datagram);
        let pushed = self
            .queue
            .push(Queued {
                from,
                worker,
                len,
                charged,
                bytes,
            })
            .is_ok();
        self.shared.queued(self.queue.len());
        pushed
    }

    pub(super) fn depth(&self) -> usize {
        self.queue.len()
    }
}

/// What the timer thread keeps for the handshake path: whether it is under load, the
/// per-source limiter, and its buffers (made once).
pub(super) struct HandshakeWork {
    load: UnderLoad,
    sources: SourceLimiter,
    out: Vec<u8>,
    cookie: [u8; 64],
}

impl HandshakeWork {
    pub(super) fn new() -> HandshakeWork {
        HandshakeWork {
            load: UnderLoad::default(),
            sources: SourceLimiter::new(),
            out: vec![0u8; MAX_DATAGRAM],
            cookie: [0u8; 64],
        }
    }

    /// Handles up to [`PER_ROUND`] queued messages under `table`. Returns whether any are
    /// left (the caller comes back at once, after its timers).
    pub(super) fn round(
        &mut self,
        inner: &Inner,
        table: &PeerTable,
        decides_load: bool,
        now: Instant,
    ) -> bool {
        let queue = &inner.handshakes;
        let depth = queue.depth();
        // From the queue's depth alone (and what the readers saw of it since the last round):
        // refused and answered messages never reach the queue and keep nothing on. One thread
        // decides it (`decides_load`: the timer thread); the others share the queue.
        if decides_load {
            let under_load = queue.shared.observe(&mut self.load, depth, now);
            table.limiter().set_under_load(under_load);
        }
        if depth == 0 {
            return false;
        }
        let Some(private_key) = table.private_key() else {
            // No key: nothing can be answered (the readers drop before queueing, but a key
            // removed since leaves some behind).
            while let Some(q) = queue.queue.pop() {
                inner
                    .drops
                    .add_received(DropReason::UnknownPeer, usize::from(q.len));
            }
            return false;
        };
        let sockets = inner.sockets();
        for _ in 0..PER_ROUND {
            let Some(q) = queue.queue.pop() else {
                return false;
            };
            let Some(socket) = sockets.get(q.worker % sockets.len().max(1)) else {
                return false; // stopping: the sockets are gone
            };
            self.handle(inner, table, private_key, socket, &q, now);
        }
        !queue.queue.is_empty()
    }

    fn handle(
        &mut self,
        inner: &Inner,
        table: &PeerTable,
        private_key: &crate::config::SecretKey,
        socket: &WgSocket,
        q: &Queued,
        now: Instant,
    ) {
        let datagram = &q.bytes[..usize::from(q.len)];
        let sources = &mut self.sources;
        let source = q.from.remote.ip();
        let identified = packet::identify_charged(
            table,
            table.limiter(),
            private_key,
            table.public_key(),
            q.from.remote,
            datagram,
            &mut self.cookie,
            // Under load a message that proved its address is charged to it, unless the reader
            // that queued it did; one that did not prove it was answered with a cookie and
            // costs nothing.
            |proved| !proved || q.charged || sources.allow(source, now),
        );
        let slot = match identified {
            Ok(Sender::Peer(slot)) => slot,
            Ok(Sender::Cookie(len)) => {
                send_one(inner, socket, &self.cookie[..len], q.from);
                return;
            }
            Err(reason) => {
                inner.drops.add_received(reason, datagram.len());
                return;
            }
        };
        let (decision, woke) = {
            let mut peer = slot.lock();
            let decision =
                peer.decapsulate_handshake(table, slot, q.from, datagram, &mut self.out, now);
            (decision, peer.woke())
        };
        inner.hand_to_timer(woke, slot.public_key());
        match decision {
            Inbound::Reply(len) => {
                send_one(inner, socket, &self.out[..len], q.from);
                // What queued up for the peer while it had no session goes now.
                loop {
                    let queued = {
                        let mut peer = slot.lock();
                        peer.flush_queued(&mut self.out)
                    };
                    let Some(len) = queued else { break };
                    send_one(inner, socket, &self.out[..len], q.from);
                }
            }
            Inbound::Drop(reason) if reason.after_authentication() => {
                inner.drops.add(reason, 1);
            }
            Inbound::Drop(reason) => inner.drops.add_received(reason, datagram.len()),
            // A handshake message delivers nothing to the TUN device, and only a data message
            // asks for a takeover.
            Inbound::Deliver(_) | Inbound::Nothing | Inbound::TakeOver => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn from() -> PeerPath {
        PeerPath::to(SocketAddr::from(([192, 0, 2, 1], 51820)))
    }

    fn now() -> Instant {
        crate::shell::clock::now()
    }

    #[test]
    fn a_full_queue_refuses_without_blocking_and_keeps_what_it_has() {
        let queue = HandshakeQueue::new(now());
        let initiation = [1u8; 148];
        for _ in 0..QUEUE_CAPACITY {
            assert!(queue.push(from(), 0, &initiation, false));
        }
        assert!(
            !queue.push(from(), 0, &initiation, false),
            "a full queue takes no more"
        );
        assert_eq!(queue.depth(), QUEUE_CAPACITY);
        let first = queue.queue.pop().expect("queued");
        assert_eq!(&first.bytes[..usize::from(first.len)], &initiation[..]);
        assert!(
            queue.push(from(), 1, &[2u8; 92], false),
            "room again after one is taken"
        );
    }

    /// A push that leaves the queue at an eighth of its capacity puts the interface under
    /// load at once, before the timer thread's next look; under load a thread's gate charges
    /// only a proven source, and answers a message without a cookie.
    #[test]
    fn a_deep_push_puts_the_interface_under_load_and_only_proof_is_charged() {
        use crate::core::handshake::PER_SOURCE_BURST;
        let queue = HandshakeQueue::new(now());
        for _ in 0..QUEUE_CAPACITY / 8 - 1 {
            assert!(queue.push(from(), 0, &[1u8; 148], false));
        }
        assert!(!queue.under_load());
        assert!(queue.push(from(), 0, &[1u8; 148], false));
        assert!(queue.under_load(), "deep: under load at once");
        let source = from().remote.ip();
        let at = now();
        let answers: Vec<Admit> = (0..100)
            .map(|_| queue.admit(source, at, || false, || true))
            .collect();
        assert!(answers.iter().all(|a| *a == Admit::Cookie), "{answers:?}");
        let queued = (0..100)
            .filter(|_| queue.admit(source, at, || true, || true) == Admit::Queue)
            .count();
        assert_eq!(queued, PER_SOURCE_BURST as usize, "its whole share");
    }

    #[test]
    fn a_datagram_larger_than_an_initiation_is_refused() {
        let queue = HandshakeQueue::new(now());
        assert!(!queue.push(from(), 0, &[1u8; 149], false));
        assert!(!queue.push(from(), 0, &[1u8; 300], false));
        assert_eq!(queue.depth(), 0);
    }
}
