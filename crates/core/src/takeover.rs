//! Takeover: the process that receives a peer's data messages for a session it does not have
//! (it was restarted, or it is another replica of the same identity behind one address)
//! initiates a handshake to their source at once, instead of letting the peer wait out
//! KEEPALIVE_TIMEOUT + REKEY_TIMEOUT (about 15 s) before it re-handshakes on its own.
//!
//! The receive path only records, under the peer's lock, that a takeover is wanted and from
//! where ([`TakeoverState::request`]); the timer thread decides and sends
//! ([`TakeoverState::due`]), within two bounds: one takeover initiation per peer per
//! [`REKEY_TIMEOUT`], and [`GLOBAL_PER_SECOND`] in all ([`TokenBucket`]). A datagram can name a
//! session index only if it traces to a configured peer ([`crate::session_index`]); anything
//! else is dropped as before. Time is an argument.

use crate::packet::PeerPath;
use std::time::{Duration, Instant};

/// WireGuard's REKEY_TIMEOUT: at most one takeover initiation per peer in this time, and a
/// takeover that no handshake completed within it has failed.
pub const REKEY_TIMEOUT: Duration = Duration::from_secs(5);
/// At most this many takeover initiations per second from the whole process (burst as many):
/// what a spoofed victim can receive at most, whatever the number of peers.
pub const GLOBAL_PER_SECOND: u32 = 100;
/// A session whose handshake is older than this is gone (WireGuard's REJECT_AFTER_TIME).
pub const SESSION_LIFETIME: Duration = Duration::from_secs(180);
/// A data message's type byte and its smallest size (header, counter and tag; a keepalive).
pub const DATA_TYPE: u8 = 4;
pub const DATA_MIN_LEN: usize = 32;
/// An initiation's size: the bytes a takeover sends for a data message it received.
pub const INITIATION_LEN: usize = 148;

/// A token bucket refilled at `per_second`, holding at most one second's worth.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_second: u32,
    /// Refill banked, at most one second.
    banked: Duration,
    last: Option<Instant>,
}

impl TokenBucket {
    /// A full bucket of `per_second` tokens (0: never allows).
    pub fn new(per_second: u32) -> TokenBucket {
        TokenBucket {
            per_second,
            banked: Duration::from_secs(1),
            last: None,
        }
    }

    /// Takes one token at `now`, if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        if self.per_second == 0 {
            return false;
        }
        let since = self
            .last
            .map_or(Duration::ZERO, |last| now.saturating_duration_since(last));
        self.last = Some(now);
        self.banked = (self.banked + since).min(Duration::from_secs(1));
        let cost = Duration::from_secs(1) / self.per_second;
        match self.banked.checked_sub(cost) {
            Some(left) => {
                self.banked = left;
                true
            }
            None => false,
        }
    }
}

/// Whether `datagram`, which names a session the peer does not have, asks for a takeover:
/// a data message (a response or cookie does not: those answer our own initiations), from a
/// source with which the peer has no live session (`session_age`: since its last handshake,
/// `path`: where it is reached). A stale message of an old session from the peer's current
/// source is no reason.
pub fn wants_takeover(
    datagram: &[u8],
    from: PeerPath,
    path: Option<PeerPath>,
    session_age: Option<Duration>,
) -> bool {
    let data = datagram.first() == Some(&DATA_TYPE) && datagram.len() >= DATA_MIN_LEN;
    let live = session_age.is_some_and(|age| age < SESSION_LIFETIME);
    let same_source = path.is_some_and(|p| p.remote == from.remote);
    data && !(live && same_source)
}

/// One peer's takeover.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TakeoverState {
    #[default]
    Idle,
    /// Wanted, towards this source (the first one seen); the timer thread sends it.
    Requested(PeerPath),
    /// An initiation went to `to` at `at`; waiting for a handshake to complete.
    Started { at: Instant, to: PeerPath },
}

/// What the timer thread does about one peer's takeover at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverStep {
    Nothing,
    /// Send an initiation to this source now (the bounds allowed it).
    Initiate(PeerPath),
    /// A handshake completed this long after the takeover's initiation.
    Completed {
        to: PeerPath,
        after: Duration,
    },
    /// No handshake completed within [`REKEY_TIMEOUT`].
    Failed(PeerPath),
}

impl TakeoverState {
    /// On the receive path, under the peer's lock: a takeover towards `from` is wanted.
    /// Returns whether this is news, so the timer thread is woken once, not per datagram.
    pub fn request(&mut self, from: PeerPath) -> bool {
        match self {
            TakeoverState::Idle => {
                *self = TakeoverState::Requested(from);
                true
            }
            TakeoverState::Requested(_) | TakeoverState::Started { .. } => false,
        }
    }

    /// On the timer thread at `now`: `last_started` is when this peer's previous takeover
    /// started, `completed_at` when its latest handshake completed (on the same clock), and
    /// `global` the process-wide bucket. An allowed request becomes `Started` (the caller
    /// sends the initiation); a refused one waits for a later tick.
    pub fn due(
        &mut self,
        now: Instant,
        last_started: Option<Instant>,
        completed_at: Option<Instant>,
        global: &mut TokenBucket,
    ) -> TakeoverStep {
        match *self {
            TakeoverState::Idle => TakeoverStep::Nothing,
            TakeoverState::Requested(to) => {
                let spaced = last_started
                    .is_none_or(|last| now.saturating_duration_since(last) >= REKEY_TIMEOUT);
                if spaced && global.take(now) {
                    *self = TakeoverState::Started { at: now, to };
                    TakeoverStep::Initiate(to)
                } else {
                    TakeoverStep::Nothing
                }
            }
            TakeoverState::Started { at, to } => {
                if let Some(done) = completed_at.filter(|done| *done >= at) {
                    *self = TakeoverState::Idle;
                    TakeoverStep::Completed {
                        to,
                        after: done.saturating_duration_since(at),
                    }
                } else if now.saturating_duration_since(at) >= REKEY_TIMEOUT {
                    *self = TakeoverState::Idle;
                    TakeoverStep::Failed(to)
                } else {
                    TakeoverStep::Nothing
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
