//! Takeover: the process that receives a peer's data messages for a session it does not have
//! (it was restarted, or it is another replica of the same identity behind one address)
//! initiates a handshake with that peer at once, instead of letting the peer wait out
//! KEEPALIVE_TIMEOUT + REKEY_TIMEOUT (about 15 s) before it re-handshakes on its own.
//!
//! WireGuard's promise is that no one without a key moves a tunnel, and a fresh initiation is a
//! capability: whoever holds one can deliver it to the peer from an address of their own, and the
//! peer then moves its endpoint there (it roams on any message that authenticates). So the
//! initiation goes only to an endpoint where this identity has seen the peer authenticate
//! ([`KnownEndpoints`]: the configured endpoint, and the newest endpoint the peer authenticated
//! from: at this process, before a restart, or at another replica of its group), never to the
//! unproven source of the data message that asked for it, unless that source is one of them.
//! With no known endpoint the peer waits for its own rekey, as with every WireGuard. Only an
//! explicit opt-in ([`Answer::AnySource`]) answers any source, for closed networks.
//!
//! The receive path only records, under the peer's lock, that a takeover is wanted
//! ([`TakeoverState::request`], at most once per peer per [`REKEY_TIMEOUT`]); the handshake
//! thread picks the endpoint and sends ([`TakeoverState::start`]) while it has room
//! ([`IN_FLIGHT`] takeovers at once, none while the interface is under load), then settles it
//! ([`TakeoverState::settle`]). Time is an argument.

use crate::packet::PeerPath;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// WireGuard's REKEY_TIMEOUT: at most one takeover initiation per peer in this time, and a
/// takeover that no handshake completed within it has failed.
pub const REKEY_TIMEOUT: Duration = Duration::from_secs(5);
/// Takeovers started and not yet settled at once, per process. Each one's answer (a handshake
/// response, two Diffie-Hellmans) comes back through the handshake queue: this many answers
/// arriving together stay below the depth that puts the interface under load (an eighth of
/// 4,096), so a restart's takeovers never make their own answers wait for cookies.
pub const IN_FLIGHT: usize = 256;
/// A data message's type byte and its smallest size (header, counter and tag; a keepalive).
pub const DATA_TYPE: u8 = 4;
pub const DATA_MIN_LEN: usize = 32;
/// An initiation's size: the bytes a takeover sends.
pub const INITIATION_LEN: usize = 148;

/// Which sources a takeover may answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Answer {
    /// Only endpoints where this identity has seen the peer authenticate (the default).
    #[default]
    KnownEndpoints,
    /// Any source, proven or not (`takeover.answer_any_source`): an off-path attacker who saw
    /// one data message can then move the tunnel through itself. For closed networks only.
    AnySource,
}

/// How this identity came to know a peer's endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Origin {
    /// This process authenticated a datagram of the peer from it.
    Authenticated,
    /// This process's predecessor did (the state file, read at start).
    Restored,
    /// A replica of the same identity did (the group's exchange).
    Group,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::Authenticated => "authenticated",
            Origin::Restored => "restored",
            Origin::Group => "group",
        }
    }
}

/// One endpoint this identity saw the peer authenticate from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learned {
    pub addr: SocketAddr,
    pub origin: Origin,
}

/// The endpoints a takeover may send to: the configured one (`endpoint`, or `wg set endpoint`)
/// and the newest one this identity saw the peer authenticate from. Only the newest: an address
/// the peer has left (a NAT mapping that expired, an address given to someone else since) is
/// no proof that the peer is there. A peer that never authenticated holds no learned endpoint
/// at all (no allocation), so 100,000 configured but quiet peers cost a pointer each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownEndpoints {
    configured: Option<SocketAddr>,
    learned: Option<Box<Learned>>,
}

impl KnownEndpoints {
    pub fn configured(configured: Option<SocketAddr>) -> KnownEndpoints {
        KnownEndpoints {
            configured,
            learned: None,
        }
    }

    pub fn set_configured(&mut self, configured: Option<SocketAddr>) {
        self.configured = configured;
    }

    /// Records that the peer authenticated from `addr` (by `origin`): the newest learned
    /// endpoint. The same address told from further away (a file, another replica) keeps the
    /// closer origin. Returns whether it changed.
    pub fn learn(&mut self, addr: SocketAddr, origin: Origin) -> bool {
        match self.learned.as_deref_mut() {
            Some(newest) if newest.addr == addr => {
                let closer = origin < newest.origin;
                if closer {
                    newest.origin = origin;
                }
                closer
            }
            Some(newest) => {
                *newest = Learned { addr, origin };
                true
            }
            None => {
                self.learned = Some(Box::new(Learned { addr, origin }));
                true
            }
        }
    }

    /// Takes `other`'s learned endpoint (a peer made again keeps what it knew).
    pub fn inherit_learned(&mut self, other: &KnownEndpoints) {
        self.learned.clone_from(&other.learned);
    }

    /// Whether a takeover may answer `addr` itself: the configured or the newest learned
    /// endpoint.
    pub fn contains(&self, addr: SocketAddr) -> bool {
        self.configured == Some(addr) || self.newest().is_some_and(|e| e.addr == addr)
    }

    /// The newest endpoint this identity saw the peer authenticate from.
    pub fn newest(&self) -> Option<Learned> {
        self.learned.as_deref().copied()
    }

    /// Where a takeover goes without a better cue: the newest learned endpoint, else the
    /// configured one.
    pub fn best(&self) -> Option<SocketAddr> {
        self.newest().map(|e| e.addr).or(self.configured)
    }
}

/// Where a takeover asked for by a data message from `cue` goes: `cue` itself when it is a
/// known endpoint (or with [`Answer::AnySource`]), else the best known endpoint (from the
/// local address the peer was last reached from, when it is that one), else nowhere.
pub fn target(
    cue: PeerPath,
    path: Option<PeerPath>,
    known: &KnownEndpoints,
    answer: Answer,
) -> Option<PeerPath> {
    if answer == Answer::AnySource || known.contains(cue.remote) {
        return Some(cue);
    }
    let best = known.best()?;
    Some(match path {
        Some(p) if p.remote == best => p,
        _ => PeerPath::to(best),
    })
}

/// Whether `datagram` can be a takeover's cue: a data message (a response or cookie does not:
/// those answer our own initiations).
pub fn is_data(datagram: &[u8]) -> bool {
    datagram.first() == Some(&DATA_TYPE) && datagram.len() >= DATA_MIN_LEN
}

/// One peer's takeover.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TakeoverState {
    #[default]
    Idle,
    /// Wanted: a data message from `cue` named a session this process does not have.
    Requested { cue: PeerPath, at: Instant },
    /// An initiation went to `to` at `at`; waiting for a handshake to complete.
    Started { at: Instant, to: PeerPath },
}

/// What [`TakeoverState::start`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Nothing was requested (or it was settled meanwhile).
    Nothing,
    /// Send an initiation to `to` now.
    Initiate { to: PeerPath },
    /// No endpoint is known where the peer authenticated: it waits for its own rekey.
    NoKnownEndpoint { cue: PeerPath },
}

/// What [`TakeoverState::settle`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Not started, or still waiting.
    Pending,
    /// A handshake completed this long after the takeover's initiation.
    Completed { to: PeerPath, after: Duration },
    /// No handshake completed within [`REKEY_TIMEOUT`].
    Failed { to: PeerPath },
}

impl TakeoverState {
    /// On the receive path at `now`, under the peer's lock: a data message from `cue` named a
    /// session this process does not have. `last_started` is when this peer's previous takeover
    /// started (or found no endpoint): at most one per [`REKEY_TIMEOUT`]. Returns whether this is news, so the
    /// handshake thread is handed the peer once, not per datagram.
    pub fn request(&mut self, cue: PeerPath, now: Instant, last_started: Option<Instant>) -> bool {
        let spaced =
            last_started.is_none_or(|last| now.saturating_duration_since(last) >= REKEY_TIMEOUT);
        match self {
            TakeoverState::Idle if spaced => {
                *self = TakeoverState::Requested { cue, at: now };
                true
            }
            _ => false,
        }
    }

    /// The request was not handed over (the hand-off queue was full): a later data message
    /// asks again.
    pub fn withdraw(&mut self) {
        if matches!(self, TakeoverState::Requested { .. }) {
            *self = TakeoverState::Idle;
        }
    }

    /// On the handshake thread at `now`: where the requested takeover goes ([`target`]). An
    /// initiation to send makes it `Started`; with nowhere to send it is over.
    pub fn start(
        &mut self,
        now: Instant,
        path: Option<PeerPath>,
        known: &KnownEndpoints,
        answer: Answer,
    ) -> Start {
        let TakeoverState::Requested { cue, .. } = *self else {
            return Start::Nothing;
        };
        match target(cue, path, known, answer) {
            Some(to) => {
                *self = TakeoverState::Started { at: now, to };
                Start::Initiate { to }
            }
            None => {
                *self = TakeoverState::Idle;
                Start::NoKnownEndpoint { cue }
            }
        }
    }

    /// On the handshake thread at `now`: `completed_at` is when the peer's latest handshake
    /// completed (on the same clock), whichever side initiated it.
    pub fn settle(&mut self, now: Instant, completed_at: Option<Instant>) -> Settle {
        let TakeoverState::Started { at, to } = *self else {
            return Settle::Pending;
        };
        if let Some(done) = completed_at.filter(|done| *done >= at) {
            *self = TakeoverState::Idle;
            Settle::Completed {
                to,
                after: done.saturating_duration_since(at),
            }
        } else if now.saturating_duration_since(at) >= REKEY_TIMEOUT {
            *self = TakeoverState::Idle;
            Settle::Failed { to }
        } else {
            Settle::Pending
        }
    }
}

#[cfg(test)]
mod tests;
