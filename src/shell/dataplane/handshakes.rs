//! The handshake path, apart from the packet readers: the bounded queue the readers hand
//! handshake messages to (initiations, responses, cookie replies; never blocking, a full queue
//! drops and counts), and the work the timer thread does with them at normal priority: mac1,
//! and under load mac2 and the per-source limit (decided in `core::handshake`), then the
//! Diffie-Hellman and the reply. A packet reader so never runs a Diffie-Hellman and never waits
//! behind one, however many initiations arrive.

use super::send::send_one;
use super::table::PeerTable;
use super::Inner;
use crate::core::handshake::{Admission, SourceLimiter, UnderLoad, QUEUE_CAPACITY};
use crate::core::packet::{self, DropReason, Inbound, PeerPath, Sender};
use crate::shell::udp::{WgSocket, MAX_DATAGRAM};
use crossbeam_queue::ArrayQueue;
use std::cell::RefCell;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The largest handshake message (an initiation); a response is 92 bytes, a cookie reply 64.
const LARGEST: usize = 148;

/// Handshake messages the timer thread takes from the queue before it looks at its timers
/// again: about 10 ms of Diffie-Hellman on this VM, so a flood never holds keepalives and
/// rekeys back longer than that.
pub(super) const PER_ROUND: usize = 64;

/// One queued handshake message: where it came from, which worker's socket took it (the reply
/// leaves by the same), and its bytes (copied: the reader's batch is reused at once).
struct Queued {
    from: PeerPath,
    worker: usize,
    len: u8,
    bytes: [u8; LARGEST],
}

/// The queue between the readers (many producers: readers and relay partners) and the timer
/// thread (the one consumer). Lock-free, so a real-time reader never waits on a lock the
/// normal-priority consumer holds.
pub(super) struct HandshakeQueue {
    queue: ArrayQueue<Queued>,
    /// Whether the interface is under load, as the timer thread last decided it: the readers
    /// then charge each source before queueing ([`HandshakeQueue::admit`]).
    under_load: AtomicBool,
    /// Set by a reader that refused a source its share; the timer thread takes it as load (so
    /// a flood the readers keep out of the queue still keeps the interface under load).
    refused: AtomicBool,
}

std::thread_local! {
    /// Each packet thread's own share table (made at its first message under load): no lock
    /// between readers, and a source keeps to one reader's socket by the kernel's hash.
    static ADMISSION: RefCell<Option<Admission>> = const { RefCell::new(None) };
}

impl HandshakeQueue {
    pub(super) fn new() -> HandshakeQueue {
        HandshakeQueue {
            queue: ArrayQueue::new(QUEUE_CAPACITY),
            under_load: AtomicBool::new(false),
            refused: AtomicBool::new(false),
        }
    }

    /// Whether a handshake message from `source` may be queued: always, unless under load;
    /// then as the source's share allows ([`Admission`], this thread's table).
    /// `now` is asked only under load (a reader reads the clock once per batch).
    pub(super) fn admit(&self, source: IpAddr, now: impl FnOnce() -> Instant) -> bool {
        if !self.under_load.load(Ordering::Relaxed) {
            return true;
        }
        let now = now();
        let admitted = ADMISSION.with(|table| {
            table
                .borrow_mut()
                .get_or_insert_with(Admission::new)
                .admit(source, now)
        });
        // Stored only when not yet set: readers refusing a million messages a second do
        // not write the shared line each time.
        if !admitted && !self.refused.load(Ordering::Relaxed) {
            self.refused.store(true, Ordering::Relaxed);
        }
        admitted
    }

    /// Whether the interface is under load, as the timer thread last found it.
    pub(super) fn under_load(&self) -> bool {
        self.under_load.load(Ordering::Relaxed)
    }

    /// Queues `datagram` (a handshake message by [`crate::core::wg::is_handshake`]), received
    /// on `worker`'s socket from `from`. `false`: the queue is full and it was not taken.
    pub(super) fn push(&self, from: PeerPath, worker: usize, datagram: &[u8]) -> bool {
        let Ok(len) = u8::try_from(datagram.len()) else {
            return false;
        };
        if usize::from(len) > LARGEST {
            return false;
        }
        let mut bytes = [0u8; LARGEST];
        bytes[..datagram.len()].copy_from_slice(datagram);
        self.queue
            .push(Queued {
                from,
                worker,
                len,
                bytes,
            })
            .is_ok()
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
    pub(super) fn round(&mut self, inner: &Inner, table: &PeerTable, now: Instant) -> bool {
        let queue = &inner.handshakes;
        let depth = queue.depth();
        // A source the readers refused counts as a deep queue: the flood is still on.
        let refused = queue.refused.swap(false, Ordering::Relaxed);
        let seen = if refused { QUEUE_CAPACITY } else { depth };
        let under_load = self.load.observe(seen, QUEUE_CAPACITY, now);
        queue.under_load.store(under_load, Ordering::Relaxed);
        table.limiter().set_under_load(under_load);
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
            // Under load a message that proved its address is charged to it; one that did
            // not prove it was answered with a cookie and costs nothing.
            |proved| !proved || sources.allow(source, now),
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
        let decision = {
            let mut peer = slot.lock();
            peer.decapsulate_handshake(table, slot, q.from, datagram, &mut self.out, now)
        };
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

    #[test]
    fn a_full_queue_refuses_without_blocking_and_keeps_what_it_has() {
        let queue = HandshakeQueue::new();
        let initiation = [1u8; 148];
        for _ in 0..QUEUE_CAPACITY {
            assert!(queue.push(from(), 0, &initiation));
        }
        assert!(
            !queue.push(from(), 0, &initiation),
            "a full queue takes no more"
        );
        assert_eq!(queue.depth(), QUEUE_CAPACITY);
        let first = queue.queue.pop().expect("queued");
        assert_eq!(&first.bytes[..usize::from(first.len)], &initiation[..]);
        assert!(
            queue.push(from(), 1, &[2u8; 92]),
            "room again after one is taken"
        );
    }

    /// Not under load every message may be queued; under load a source gets its burst, is
    /// then refused (and the refusal is left for the timer thread to see as load), while a
    /// source that sent nothing yet still gets in.
    #[test]
    fn under_load_a_source_past_its_share_is_refused_and_a_new_one_admitted() {
        use crate::core::handshake::PER_SOURCE_BURST;
        let queue = HandshakeQueue::new();
        let flooder = from().remote.ip();
        let now = crate::shell::clock::now;
        assert!(
            (0..100).all(|_| queue.admit(flooder, now)),
            "no load, no limit"
        );
        assert!(!queue.refused.load(Ordering::Relaxed));
        queue.under_load.store(true, Ordering::Relaxed);
        let admitted = (0..100).filter(|_| queue.admit(flooder, now)).count();
        // The burst (a few more if the test's own clock refilled one meanwhile).
        assert!(
            (PER_SOURCE_BURST as usize..PER_SOURCE_BURST as usize + 3).contains(&admitted),
            "{admitted}"
        );
        assert!(queue.refused.load(Ordering::Relaxed), "the refusal is told");
        assert!(
            queue.admit(IpAddr::from([203, 0, 113, 7]), now),
            "a newcomer gets in"
        );
    }

    #[test]
    fn a_datagram_larger_than_an_initiation_is_refused() {
        let queue = HandshakeQueue::new();
        assert!(!queue.push(from(), 0, &[1u8; 149]));
        assert!(!queue.push(from(), 0, &[1u8; 300]));
        assert_eq!(queue.depth(), 0);
    }
}
