//! The handshake thread's part of takeovers (`core::takeover`): the readers hand over a peer
//! whose data named a session this process does not have ([`Requests`]); each round, the
//! started takeovers that completed or failed are settled, then, unless the interface is under
//! load, new ones start while fewer than `IN_FLIGHT` are open: under the peer's lock, the
//! endpoint (a known one: `core::takeover::target`) and the initiation; the send after the lock
//! is let go. Lines at info say what happened, at most [`LINES_PER_SECOND`] a second, then one
//! line with the rest counted.

use super::send::send_one;
use super::table::{PeerSlot, PeerTable};
use super::Inner;
use crate::core::takeover::{Answer, Settle, Start, IN_FLIGHT, REKEY_TIMEOUT};
use crossbeam_queue::ArrayQueue;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Peers handed over by the readers and not yet taken by the handshake thread. A reader whose
/// hand-over finds it full withdraws the request (the peer's next data message asks again).
const REQUESTS: usize = 65_536;

/// Takeover lines at info per second; past it, one line a second counts the rest.
const LINES_PER_SECOND: u32 = 16;

/// The hand-off from the packet readers to the handshake thread, and the policy it follows.
pub(super) struct Requests {
    queue: ArrayQueue<Arc<PeerSlot>>,
    /// [`Answer`] as a byte: set by the configuration, read by the handshake thread.
    answer: AtomicU8,
}

impl Requests {
    pub(super) fn new() -> Requests {
        Requests {
            queue: ArrayQueue::new(REQUESTS),
            answer: AtomicU8::new(0),
        }
    }

    /// Hands `slot`'s takeover to the handshake thread; `false` when the queue is full.
    pub(super) fn hand_over(&self, slot: &Arc<PeerSlot>) -> bool {
        self.queue.push(slot.clone()).is_ok()
    }

    pub(super) fn set_answer(&self, answer: Answer) {
        let byte = match answer {
            Answer::KnownEndpoints => 0,
            Answer::AnySource => 1,
        };
        self.answer.store(byte, Ordering::Relaxed);
    }

    pub(super) fn answer(&self) -> Answer {
        match self.answer.load(Ordering::Relaxed) {
            1 => Answer::AnySource,
            _ => Answer::KnownEndpoints,
        }
    }
}

/// What the handshake thread keeps for takeovers.
pub(super) struct TakeoverWork {
    /// Taken from [`Requests`] but not started: the bounds said wait.
    waiting: VecDeque<Arc<PeerSlot>>,
    /// Started and not settled, oldest first.
    in_flight: VecDeque<Arc<PeerSlot>>,
    /// This thread's share of `IN_FLIGHT`.
    room: usize,
    buf: Vec<u8>,
    lines: Lines,
}

impl TakeoverWork {
    /// The takeovers of one of `threads` handshake threads (each may have its share of
    /// `IN_FLIGHT` open).
    pub(super) fn new(threads: usize) -> TakeoverWork {
        TakeoverWork {
            waiting: VecDeque::new(),
            in_flight: VecDeque::new(),
            room: (IN_FLIGHT / threads.max(1)).max(1),
            buf: vec![0u8; crate::core::wg::MIN_OUTPUT],
            lines: Lines::default(),
        }
    }

    /// One round at `now` under `table`: settles, then starts what the bounds allow (nothing
    /// `under_load`). Returns whether requests wait that could start at once.
    pub(super) fn round(
        &mut self,
        inner: &Inner,
        table: &PeerTable,
        under_load: bool,
        now: Instant,
    ) -> bool {
        self.settle(now);
        if table.private_key().is_none() {
            return false;
        }
        let answer = inner.takeovers.answer();
        while self.in_flight.len() < self.room && !under_load {
            let Some(slot) = self
                .waiting
                .pop_front()
                .or_else(|| inner.takeovers.queue.pop())
            else {
                break;
            };
            // A peer removed since it asked: its slot is of an older table.
            if !table.holds(&slot) {
                continue;
            }
            self.start(inner, &slot, answer, now);
        }
        let more = !under_load && self.in_flight.len() < self.room;
        if !more {
            // Bounded by the queue's size: what a reader handed over stays in line here.
            while let Some(slot) = inner.takeovers.queue.pop() {
                self.waiting.push_back(slot);
            }
        }
        self.lines.flush(now);
        more && !(self.waiting.is_empty() && inner.takeovers.queue.is_empty())
    }

    fn start(&mut self, inner: &Inner, slot: &Arc<PeerSlot>, answer: Answer, now: Instant) {
        let (start, sent, woke) = {
            let mut peer = slot.lock();
            let (start, sent) = peer.start_takeover(now, answer, &mut self.buf);
            (start, sent, peer.woke())
        };
        inner.hand_to_timer(woke, slot.public_key());
        let name = slot.spec().name.as_deref().unwrap_or("");
        match start {
            Start::Nothing => {}
            Start::Initiate { to } => {
                self.in_flight.push_back(slot.clone());
                if self.lines.take(now) {
                    tracing::info!(
                        peer = %slot.public_key(),
                        peer_name = name,
                        endpoint = %to.remote,
                        "Takeover: the peer sends on a session this process does not have; initiating a handshake to an endpoint where it authenticated"
                    );
                }
                let Some(len) = sent else { return };
                let sockets = inner.sockets();
                let steering = inner.steering();
                let socket = &sockets[steering.worker_of_peer(slot.index()) % sockets.len()];
                send_one(inner, socket, &self.buf[..len], to);
            }
            Start::NoKnownEndpoint { cue } => {
                if self.lines.take(now) {
                    tracing::info!(
                        peer = %slot.public_key(),
                        peer_name = name,
                        source = %cue.remote,
                        "Takeover not started: no endpoint where this peer authenticated is known (the data came from an unproven source); the peer re-handshakes on its own timer"
                    );
                }
            }
        }
    }

    /// Settles every started takeover that completed or failed.
    fn settle(&mut self, now: Instant) {
        let lines = &mut self.lines;
        self.in_flight.retain(|slot| {
            let settled = {
                let mut peer = slot.lock();
                peer.settle_takeover(now)
            };
            let name = slot.spec().name.as_deref().unwrap_or("");
            match settled {
                Settle::Pending => return true,
                Settle::Completed { to, after } => {
                    if lines.take(now) {
                        tracing::info!(
                            peer = %slot.public_key(),
                            peer_name = name,
                            endpoint = %to.remote,
                            ms = after.as_millis() as u64,
                            "Takeover completed: the peer moved to a new session"
                        );
                    }
                }
                Settle::Failed { to } => {
                    if lines.take(now) {
                        tracing::info!(
                            peer = %slot.public_key(),
                            peer_name = name,
                            endpoint = %to.remote,
                            wait_s = REKEY_TIMEOUT.as_secs(),
                            "Takeover failed: no handshake followed the initiation. Likely: the peer is no longer at that endpoint, or it accepted a newer handshake from this key (another replica's clock is ahead of this one: replicas need synchronised clocks)"
                        );
                    }
                }
            }
            false
        });
    }
}

/// At most [`LINES_PER_SECOND`] lines a second; the rest are counted and said once.
#[derive(Default)]
struct Lines {
    since: Option<Instant>,
    said: u32,
    held: u64,
}

impl Lines {
    /// Whether one more line may go now.
    fn take(&mut self, now: Instant) -> bool {
        self.flush(now);
        self.since.get_or_insert(now);
        if self.said < LINES_PER_SECOND {
            self.said += 1;
            true
        } else {
            self.held += 1;
            false
        }
    }

    /// At the end of a second, says how many lines were held back.
    fn flush(&mut self, now: Instant) {
        let Some(since) = self.since else { return };
        if now.saturating_duration_since(since) < Duration::from_secs(1) {
            return;
        }
        if self.held > 0 {
            tracing::info!(
                more = self.held,
                "Takeovers: more started, completed or failed in the last second than logged (status and /metrics count them all)"
            );
        }
        *self = Lines::default();
    }
}
