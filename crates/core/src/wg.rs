//! The only module that imports boringtun (our fork, `crates/boringtun`): one [`Tunnel`] per
//! peer, the shared handshake rate limiter, classification of incoming datagrams, and the
//! transport sessions handed out to seal ([`SealBatch`]) and open ([`OpenKey`]) data messages
//! outside the peer's lock. Swapping the Noise implementation is a change to this file alone.

use crate::config::{PublicKey, SecretKey};
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Packet, Tunn, TunnResult};
use boringtun::x25519;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Handshake messages per second (all peers together) before cookies are demanded. boringtun
/// counts a handshake twice here (our pre-check and its own), so this is twice the real limit.
const HANDSHAKES_PER_SECOND_BEFORE_COOKIES: u64 = 2 * 100;

/// Extra room a WireGuard data message needs over its plaintext.
pub const OVERHEAD: usize = 32;
/// Where a data message's plaintext starts: [`SealBatch::seal_in_place`] expects it there.
pub const DATA_OFFSET: usize = boringtun::noise::session::DATA_OFFSET;

/// Where handshakes draw their ephemeral keys and the rate limiter its cookie secrets: the
/// caller's generator (the shell passes the OS's, tests and fuzzers a seeded one). Nothing in
/// the core draws randomness of its own for a session.
pub type Randomness = boringtun::Rng;
/// The smallest output buffer any call may need (a handshake initiation).
pub const MIN_OUTPUT: usize = 148;

/// Why a datagram or timer tick went nowhere. Mirrors boringtun's error, which has no Display.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TunnelError {
    /// The message failed authentication, replay or counter checks (garbage, replay, wrong key).
    #[error("message rejected: {0}")]
    Rejected(&'static str),
    /// The session expired and no handshake has replaced it.
    #[error("connection expired")]
    Expired,
    /// Under handshake load and the sender has no valid cookie yet.
    #[error("under load")]
    UnderLoad,
    /// A data message whose tag did not verify under the keys of the session it names: a
    /// forgery, or another process's session that reused the index.
    #[error("message rejected: decryption failed")]
    Forged,
}

fn map_error(e: WireGuardError) -> TunnelError {
    match e {
        WireGuardError::ConnectionExpired => TunnelError::Expired,
        WireGuardError::UnderLoad => TunnelError::UnderLoad,
        WireGuardError::DestinationBufferTooSmall => TunnelError::Rejected("buffer too small"),
        WireGuardError::IncorrectPacketLength => TunnelError::Rejected("incorrect length"),
        WireGuardError::UnexpectedPacket => TunnelError::Rejected("unexpected packet"),
        WireGuardError::WrongPacketType => TunnelError::Rejected("wrong packet type"),
        WireGuardError::WrongIndex => TunnelError::Rejected("wrong index"),
        WireGuardError::WrongKey => TunnelError::Rejected("wrong key"),
        WireGuardError::InvalidTai64nTimestamp => TunnelError::Rejected("invalid timestamp"),
        WireGuardError::WrongTai64nTimestamp => TunnelError::Rejected("replayed handshake"),
        WireGuardError::InvalidMac => TunnelError::Rejected("invalid mac"),
        WireGuardError::InvalidAeadTag => TunnelError::Forged,
        WireGuardError::InvalidCounter => TunnelError::Rejected("invalid counter"),
        WireGuardError::DuplicateCounter => TunnelError::Rejected("replayed packet"),
        WireGuardError::InvalidPacket => TunnelError::Rejected("invalid packet"),
        WireGuardError::NoCurrentSession => TunnelError::Rejected("no session"),
        WireGuardError::LockFailed => TunnelError::Rejected("lock failed"),
    }
}

/// What to do with the output of one call.
#[derive(Debug)]
pub enum Outcome<'a> {
    /// Nothing to send.
    Done,
    /// Send these bytes to the peer's endpoint (a data, handshake, cookie or keepalive message).
    Network(&'a mut [u8]),
    /// A decrypted IP packet from the peer, with its inner source address.
    Tunnel(&'a mut [u8], IpAddr),
    Error(TunnelError),
}

impl<'a> From<TunnResult<'a>> for Outcome<'a> {
    fn from(r: TunnResult<'a>) -> Self {
        match r {
            TunnResult::Done => Outcome::Done,
            TunnResult::Err(e) => Outcome::Error(map_error(e)),
            TunnResult::WriteToNetwork(b) => Outcome::Network(b),
            TunnResult::WriteToTunnelV4(b, a) => Outcome::Tunnel(b, IpAddr::V4(a)),
            TunnResult::WriteToTunnelV6(b, a) => Outcome::Tunnel(b, IpAddr::V6(a)),
        }
    }
}

/// The shared handshake rate limiter of one interface (cookie replies under a flood).
pub struct Limiter(Arc<RateLimiter>);

impl Limiter {
    /// `rng` gives the cookie secrets, drawn once here.
    pub fn new(own_public: &PublicKey, rng: &mut dyn rand_core::CryptoRngCore) -> Limiter {
        let public = x25519::PublicKey::from(own_public.0);
        Limiter(Arc::new(RateLimiter::new(
            &public,
            HANDSHAKES_PER_SECOND_BEFORE_COOKIES,
            rng,
        )))
    }

    /// Call about once a second: the limit is per second.
    pub fn reset_count(&self) {
        self.0.reset_count();
    }

    /// Whether the handshake path counts itself under load (its queue is deep): while it does,
    /// every handshake message needs a valid mac2 (a cookie for its source address).
    pub fn set_under_load(&self, on: bool) {
        self.0.set_under_load(on);
    }

    /// The cookie of `source` now, for [`Limiter::mac2_is_valid`] and
    /// [`Limiter::write_cookie_reply`]: made once for a run of messages from one source.
    pub fn source_cookie(&self, source: IpAddr) -> SourceCookie {
        SourceCookie(self.0.source_cookie(source))
    }

    /// Whether `datagram` is an initiation or a response with a valid mac1 for our public key.
    pub fn mac1_is_valid(&self, datagram: &[u8]) -> bool {
        self.0.mac1_is_valid(datagram)
    }

    /// Whether `datagram` is an initiation or a response whose mac2 is valid for `cookie`'s
    /// source (it proved that address). A mac2 of zeros is no cookie, found without a MAC.
    pub fn mac2_is_valid(&self, cookie: &SourceCookie, datagram: &[u8]) -> bool {
        RateLimiter::mac2_is_valid(&cookie.0, datagram)
    }

    /// Writes into `out` the cookie reply to `datagram` (an initiation or a response whose
    /// mac1 the caller found valid) for `cookie`'s source: its length, or `None` if `datagram`
    /// is no such message or `out` is smaller than a reply (64 bytes).
    pub fn write_cookie_reply(
        &self,
        cookie: &SourceCookie,
        datagram: &[u8],
        out: &mut [u8],
    ) -> Option<usize> {
        self.0.write_cookie_reply(&cookie.0, datagram, out)
    }
}

/// Whether `datagram`, an initiation or a response by its size, carries a mac2 at all: an
/// initiator without a cookie sends zeros, which no cookie makes (so its source's cookie need
/// not be computed to refuse it).
#[inline]
pub fn carries_mac2(datagram: &[u8]) -> bool {
    matches!(datagram.len(), 148 | 92) && datagram[datagram.len() - 16..].iter().any(|b| *b != 0)
}

/// One source address's cookie, as the limiter computes it now ([`Limiter::source_cookie`]).
pub struct SourceCookie(boringtun::noise::rate_limiter::SourceCookie);

/// The peer index a cookie reply names (by its type and size alone; the index as
/// [`Incoming::Index`] gives it), or `None` for any other message.
#[inline]
pub fn cookie_reply_index(datagram: &[u8]) -> Option<u32> {
    if datagram.len() != 64 || datagram.get(..4) != Some(&[3, 0, 0, 0]) {
        return None;
    }
    let index = datagram.get(4..8)?;
    Some(u32::from_le_bytes([index[0], index[1], index[2], index[3]]) >> 8)
}

/// Whether `datagram` is a handshake message by its type and exact size alone (an initiation,
/// a response, a cookie reply): what a packet reader checks before it hands the datagram to
/// the handshake path, without any cryptography.
#[inline]
pub fn is_handshake(datagram: &[u8]) -> bool {
    const INITIATION: (u32, usize) = (1, 148);
    const RESPONSE: (u32, usize) = (2, 92);
    const COOKIE_REPLY: (u32, usize) = (3, 64);
    let Some(kind) = datagram.get(..4) else {
        return false;
    };
    let kind = u32::from_le_bytes([kind[0], kind[1], kind[2], kind[3]]);
    matches!((kind, datagram.len()), INITIATION | RESPONSE | COOKIE_REPLY)
}

/// Which peer an incoming datagram belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// A handshake initiation from this (authenticated) public key.
    Initiation(PublicKey),
    /// A response, cookie or data message for the local session index of this peer.
    Index(u32),
    /// Under load: send this cookie reply (in the buffer given) back to the sender.
    Cookie(usize),
    /// A handshake the caller's limit refused (see [`classify_charged`]).
    Limited,
}

/// Identifies the peer of `datagram` without touching any peer state. Checks mac1 (and, under
/// load, mac2) first so a flood of initiations costs no Diffie-Hellman.
pub fn classify(
    limiter: &Limiter,
    own_private: &SecretKey,
    own_public: &PublicKey,
    src: IpAddr,
    datagram: &[u8],
    cookie_out: &mut [u8],
) -> Result<Incoming, TunnelError> {
    classify_charged(
        limiter,
        own_private,
        own_public,
        src,
        datagram,
        cookie_out,
        |_| true,
    )
}

/// [`classify`], asking `may_cost(proved)` once the macs passed and before any Diffie-Hellman
/// whether this message may cost one (`proved`: its source proved its address with a valid
/// mac2, so the caller can charge that source). A refusal is [`Incoming::Limited`].
pub fn classify_charged(
    limiter: &Limiter,
    own_private: &SecretKey,
    own_public: &PublicKey,
    src: IpAddr,
    datagram: &[u8],
    cookie_out: &mut [u8],
    may_cost: impl FnOnce(bool) -> bool,
) -> Result<Incoming, TunnelError> {
    let verified = limiter
        .0
        .verify_packet_proving(Some(src), datagram, cookie_out);
    let verified = match verified {
        Ok((packet @ (Packet::HandshakeInit(_) | Packet::HandshakeResponse(_)), proved)) => {
            if !may_cost(proved) {
                return Ok(Incoming::Limited);
            }
            Ok(packet)
        }
        Ok((packet, _)) => Ok(packet),
        Err(e) => Err(e),
    };
    match verified {
        Ok(Packet::HandshakeInit(init)) => {
            let private = x25519::StaticSecret::from(own_private.0);
            let public = x25519::PublicKey::from(own_public.0);
            let half = parse_handshake_anon(&private, &public, &init).map_err(map_error)?;
            Ok(Incoming::Initiation(PublicKey(half.peer_static_public)))
        }
        Ok(Packet::HandshakeResponse(p)) => Ok(Incoming::Index(p.receiver_idx >> 8)),
        Ok(Packet::PacketCookieReply(p)) => Ok(Incoming::Index(p.receiver_idx >> 8)),
        Ok(Packet::PacketData(p)) => Ok(Incoming::Index(p.receiver_idx >> 8)),
        Err(TunnResult::WriteToNetwork(cookie)) => Ok(Incoming::Cookie(cookie.len())),
        Err(TunnResult::Err(e)) => Err(map_error(e)),
        Err(_) => Err(TunnelError::Rejected("invalid packet")),
    }
}

/// The Noise session state with one peer. boringtun's `Tunn` costs about 12 KB and a
/// Diffie-Hellman to create, so it is only built when the peer is first contacted or contacts
/// us: 10,000 configured but quiet peers cost neither memory nor start time.
pub struct Tunnel {
    state: State,
    /// Persistent keepalive, kept here rather than in boringtun (whose `Tunn` fixes it at
    /// creation) so that changing it keeps the session, as the kernel and wireguard-go do.
    keepalive_secs: Option<u16>,
    /// When the last keepalive went (or the interval started); `None` until the first timer
    /// tick, which starts the interval. Time comes from the caller.
    last_keepalive: Option<Instant>,
}

enum State {
    Dormant(Box<Params>),
    Active(Box<Tunn>),
    /// Only while [`Tunnel::active`] moves the parameters into the new `Tunn`.
    Building,
}

/// What `Tunn::new` needs, kept until the first use.
struct Params {
    own_private: SecretKey,
    peer: PublicKey,
    /// Boxed: most peers have none, and a dormant concentrator peer is mostly this struct.
    preshared: Option<Box<SecretKey>>,
    index: u32,
    limiter: Arc<RateLimiter>,
    rng: Randomness,
}

impl Params {
    fn build(self) -> Tunn {
        Tunn::new(
            x25519::StaticSecret::from(self.own_private.0),
            x25519::PublicKey::from(self.peer.0),
            self.preshared.as_ref().map(|k| k.0),
            TUNN_KEEPALIVE,
            self.index,
            Some(self.limiter),
            self.rng,
        )
    }
}

/// Counters reserved on a peer's current sending session (under the peer's lock, by
/// [`Session::reserve_send`]): message `i` of the batch, `i < len()`, is sealed with counter
/// `counter(i)` by any thread, outside the lock. A rekey meanwhile changes nothing for the
/// batch: it keeps its session until the last message is sealed.
#[derive(Debug, Clone)]
pub struct SealBatch {
    session: Arc<boringtun::noise::Session>,
    first: u64,
    count: usize,
}

impl SealBatch {
    /// How many messages the batch numbers.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The WireGuard counter of message `i`: the order the receiver should see them in.
    pub fn counter(&self, i: usize) -> u64 {
        self.first + i as u64
    }

    /// A counter outside the reservation would be another message's nonce: never.
    #[inline]
    fn checked_counter(&self, i: usize) -> u64 {
        assert!(i < self.count, "message {i} of a batch of {}", self.count);
        self.counter(i)
    }

    /// Seals message `i` in place: its plaintext is `message[DATA_OFFSET..DATA_OFFSET + len]`;
    /// the header goes before it and the tag after. Returns the datagram's length,
    /// `len + OVERHEAD`.
    ///
    /// # Panics
    /// If `i` is not in the batch or `message` has no room for the tag.
    #[inline]
    pub fn seal_in_place(&self, i: usize, message: &mut [u8], len: usize) -> usize {
        self.session
            .seal_in_place(self.checked_counter(i), message, len)
    }

    /// Seals message `i` from `plaintext` elsewhere into `message` (copying it first).
    ///
    /// # Panics
    /// As [`SealBatch::seal_in_place`].
    #[inline]
    pub fn seal(&self, i: usize, plaintext: &[u8], message: &mut [u8]) -> usize {
        self.session
            .seal(self.checked_counter(i), plaintext, message)
    }
}

/// The receiving session a data message names (found under the peer's lock by
/// [`Session::receiving`]), to open the message with outside it. Its replay window has a
/// lock of its own, held for a few instructions before and after decryption.
#[derive(Debug, Clone)]
pub struct OpenKey(Arc<boringtun::noise::Session>);

/// A data message that authenticated: its plaintext's length (padding included), its counter
/// and the session it came on (for [`Session::record_received`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub len: usize,
    pub counter: u64,
    pub session: u32,
    /// The session's place in the order its tunnel established sessions: higher is newer.
    pub generation: u64,
}

impl OpenKey {
    /// Opens `message` into `dst` (its ciphertext is copied there and decrypted in place):
    /// the plaintext is `dst[..len]`. Refuses replays, counters outside the window, forgeries.
    ///
    /// # Panics
    /// If `dst` is shorter than the message.
    #[inline]
    pub fn open(&self, message: &[u8], dst: &mut [u8]) -> Result<Opened, TunnelError> {
        let opened = self.0.open(message, dst).map_err(map_error)?;
        Ok(Opened {
            len: opened.len,
            counter: opened.counter,
            session: self.0.receiving_index(),
            generation: self.0.generation(),
        })
    }

    /// Opens `message` where it lies: the plaintext is `message[DATA_OFFSET..DATA_OFFSET + len]`.
    #[inline]
    pub fn open_in_place(&self, message: &mut [u8]) -> Result<Opened, TunnelError> {
        let opened = self.0.open_in_place(message).map_err(map_error)?;
        Ok(Opened {
            len: opened.len,
            counter: opened.counter,
            session: self.0.receiving_index(),
            generation: self.0.generation(),
        })
    }
}

/// What an opened data message holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inner {
    Keepalive,
    /// An IP packet: its first `len` bytes (by its header; the rest is padding), from `src`.
    Packet {
        len: usize,
        src: IpAddr,
    },
}

/// Checks the plaintext of an opened data message: a keepalive or an IP packet whose header
/// fits; anything else is rejected (it authenticated, but carries no packet).
#[inline]
pub fn inner_packet(plaintext: &[u8]) -> Result<Inner, TunnelError> {
    match Tunn::inner_packet(plaintext).map_err(map_error)? {
        boringtun::noise::Inner::Keepalive => Ok(Inner::Keepalive),
        boringtun::noise::Inner::Packet(len, src) => Ok(Inner::Packet { len, src }),
    }
}

/// boringtun's `Tunn` gets no keepalive of its own: [`Tunnel::update_timers`] sends it.
const TUNN_KEEPALIVE: Option<u16> = None;

/// WireGuard message type of a handshake initiation (the first byte, little-endian u32).
const MESSAGE_INITIATION: u8 = 1;
const MESSAGE_RESPONSE: u8 = 2;

/// Which handshake message a datagram is, by its type byte (the first of every message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    Initiation,
    Response,
}

impl Handshake {
    /// `Some` for a handshake initiation or response, `None` for data, cookies and garbage.
    #[inline]
    pub fn of(message: &[u8]) -> Option<Handshake> {
        match message.first() {
            Some(&MESSAGE_INITIATION) => Some(Handshake::Initiation),
            Some(&MESSAGE_RESPONSE) => Some(Handshake::Response),
            _ => None,
        }
    }
}

/// Traffic and handshake figures of one tunnel.
#[derive(Debug, Clone, Copy, Default)]
pub struct TunnelStats {
    pub since_last_handshake: Option<Duration>,
}

impl Tunnel {
    /// `index` is this peer's local identifier (24 bits are used); incoming messages carry it.
    /// `rng` gives the handshakes' ephemeral keys.
    pub fn new(
        own_private: &SecretKey,
        peer: &PublicKey,
        preshared: Option<&SecretKey>,
        keepalive_secs: Option<u16>,
        index: u32,
        limiter: &Limiter,
        rng: Randomness,
    ) -> Tunnel {
        Tunnel {
            state: State::Dormant(Box::new(Params {
                own_private: own_private.clone(),
                peer: *peer,
                preshared: preshared.cloned().map(Box::new),
                index,
                limiter: limiter.0.clone(),
                rng,
            })),
            keepalive_secs: keepalive_secs.filter(|s| *s > 0),
            last_keepalive: None,
        }
    }

    /// True once a packet, handshake or timer has needed the session state.
    pub fn is_active(&self) -> bool {
        matches!(self.state, State::Active(_))
    }

    fn active(&mut self) -> &mut Tunn {
        if let State::Dormant(_) = &self.state {
            if let State::Dormant(params) = std::mem::replace(&mut self.state, State::Building) {
                self.state = State::Active(Box::new(params.build()));
            }
        }
        match &mut self.state {
            State::Active(tunn) => tunn,
            State::Dormant(_) | State::Building => unreachable!("activated above"),
        }
    }

    /// Encrypts an IP packet from the TUN device. `dst` needs `src.len() + OVERHEAD` bytes and at
    /// least [`MIN_OUTPUT`]. Without a session the packet is queued and a handshake returned.
    #[inline]
    pub fn encapsulate<'a>(&mut self, src: &[u8], dst: &'a mut [u8]) -> Outcome<'a> {
        self.active().encapsulate(src, dst).into()
    }

    /// Processes a datagram from the network. After a [`Outcome::Network`] call
    /// [`Tunnel::flush`] until [`Outcome::Done`]: that sends packets queued during a handshake.
    #[inline]
    pub fn decapsulate<'a>(
        &mut self,
        src: IpAddr,
        datagram: &[u8],
        dst: &'a mut [u8],
    ) -> Outcome<'a> {
        // A peer we never talked to can only be starting a handshake; anything else names a
        // session it cannot have, and must not cost us a Diffie-Hellman.
        if !self.is_active() && datagram.first() != Some(&MESSAGE_INITIATION) {
            return Outcome::Error(TunnelError::Rejected("no session"));
        }
        self.active().decapsulate(Some(src), datagram, dst).into()
    }

    /// Sends one packet queued while the handshake was in progress.
    pub fn flush<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        match &mut self.state {
            State::Active(tunn) => tunn.decapsulate(None, &[], dst).into(),
            State::Dormant(_) | State::Building => Outcome::Done,
        }
    }

    /// The current sending session with `count` counters reserved for messages carrying
    /// `bytes` of plaintext, recorded for the timers as sent. `None` without a usable session
    /// (dormant, none yet, or worn out): [`Tunnel::encapsulate`] then queues and handshakes.
    #[inline]
    pub fn reserve_send(&mut self, count: usize, bytes: usize) -> Option<SealBatch> {
        let State::Active(tunn) = &mut self.state else {
            return None;
        };
        let reserved = tunn.reserve_send(count as u64, bytes)?;
        Some(SealBatch {
            session: reserved.session,
            first: reserved.first,
            count,
        })
    }

    /// The kept receiving session a data message names, if any.
    #[inline]
    pub fn receiving(&self, message: &[u8]) -> Option<OpenKey> {
        match &self.state {
            State::Active(tunn) => tunn.receiving_session(message).map(OpenKey),
            State::Dormant(_) | State::Building => None,
        }
    }

    /// Records for the timers a message `session` opened: `Some(len)` for an IP packet,
    /// `None` for a keepalive (or a plaintext that is no packet).
    #[inline]
    pub fn record_received(&mut self, session: u32, data_bytes: Option<usize>) {
        if let State::Active(tunn) = &mut self.state {
            tunn.record_received(session, data_bytes);
        }
    }

    /// Starts a handshake now (a peer with persistent keepalive is contacted at once, as
    /// wireguard-go and the kernel do, instead of after the first keepalive interval).
    pub fn initiate<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        self.active().format_handshake_initiation(dst, false).into()
    }

    /// A new handshake initiation now, even while one is under way (a takeover: the one under
    /// way went to another address).
    pub fn initiate_anew<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        self.active().format_handshake_initiation(dst, true).into()
    }

    /// Handshake retries, rekeys and keepalives; call every ~100 ms. A dormant tunnel has
    /// none: nothing was ever sent or queued.
    pub fn update_timers<'a>(&mut self, now: Instant, dst: &'a mut [u8]) -> Outcome<'a> {
        let since = *self.last_keepalive.get_or_insert(now);
        let keepalive_due = self
            .keepalive_secs
            .is_some_and(|secs| now.duration_since(since) >= Duration::from_secs(u64::from(secs)));
        match &mut self.state {
            State::Active(tunn) if keepalive_due => {
                self.last_keepalive = Some(now);
                // An empty data message is a keepalive; without a session it starts a
                // handshake, which is what a persistent keepalive is for.
                tunn.encapsulate(&[], dst).into()
            }
            State::Active(tunn) => tunn.update_timers(dst).into(),
            State::Dormant(_) | State::Building => Outcome::Done,
        }
    }

    /// Changes the persistent keepalive (`None` or 0: off) and keeps the session; the next
    /// interval starts at the next timer tick.
    pub fn set_persistent_keepalive(&mut self, secs: Option<u16>) {
        self.keepalive_secs = secs.filter(|s| *s > 0);
        self.last_keepalive = None;
    }

    pub fn set_private_key(&mut self, own_private: &SecretKey, limiter: &Limiter) {
        match &mut self.state {
            State::Dormant(params) => {
                params.own_private = own_private.clone();
                params.limiter = limiter.0.clone();
            }
            State::Active(tunn) => {
                let private = x25519::StaticSecret::from(own_private.0);
                let public = x25519::PublicKey::from(&private);
                tunn.set_static_private(private, public, Some(limiter.0.clone()));
            }
            State::Building => {}
        }
    }

    pub fn stats(&self) -> TunnelStats {
        match &self.state {
            State::Active(tunn) => {
                let (since_last_handshake, ..) = tunn.stats();
                TunnelStats {
                    since_last_handshake,
                }
            }
            State::Dormant(_) | State::Building => TunnelStats::default(),
        }
    }
}

/// The destination address of an IP packet, if it is one.
/// What the packet decisions ask of a WireGuard session. [`Tunnel`] is the real one (boringtun);
/// unit tests script their own to drive what boringtun decides on its own clock (rekeys,
/// expiry, giving up).
pub trait Session {
    fn encapsulate<'a>(&mut self, src: &[u8], dst: &'a mut [u8]) -> Outcome<'a>;
    fn decapsulate<'a>(&mut self, src: IpAddr, datagram: &[u8], dst: &'a mut [u8]) -> Outcome<'a>;
    /// The next packet queued while a handshake was under way.
    fn flush<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a>;
    /// A handshake initiation, now.
    fn initiate<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a>;
    /// A handshake initiation, now, even while another is under way (a takeover: the one
    /// under way went elsewhere).
    fn initiate_anew<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        self.initiate(dst)
    }
    /// Timers at `now`: handshake retries, rekeys, keepalives, expiry.
    fn update_timers<'a>(&mut self, now: Instant, dst: &'a mut [u8]) -> Outcome<'a>;
    fn set_persistent_keepalive(&mut self, secs: Option<u16>);
    fn set_private_key(&mut self, own_private: &SecretKey, limiter: &Limiter);
    fn since_last_handshake(&self) -> Option<Duration>;
    /// Counters for `count` messages of `bytes` plaintext on the current sending session, to
    /// seal outside the lock; `None`: use [`Session::encapsulate`] (it queues and handshakes).
    fn reserve_send(&mut self, count: usize, bytes: usize) -> Option<SealBatch>;
    /// The receiving session a data message names, to open it outside the lock; `None`: use
    /// [`Session::decapsulate`] (handshakes, cookies, unknown or retired sessions).
    fn receiving(&self, message: &[u8]) -> Option<OpenKey>;
    /// Records for the timers a message opened outside the lock.
    fn record_received(&mut self, session: u32, data_bytes: Option<usize>);
    /// Whether anything ever needed the session state: a session that never did has no
    /// timers to run.
    fn is_awake(&self) -> bool {
        true
    }
}

impl Session for Tunnel {
    #[inline]
    fn encapsulate<'a>(&mut self, src: &[u8], dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::encapsulate(self, src, dst)
    }
    #[inline]
    fn decapsulate<'a>(&mut self, src: IpAddr, datagram: &[u8], dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::decapsulate(self, src, datagram, dst)
    }
    fn flush<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::flush(self, dst)
    }
    fn initiate<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::initiate(self, dst)
    }
    fn initiate_anew<'a>(&mut self, dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::initiate_anew(self, dst)
    }
    fn update_timers<'a>(&mut self, now: Instant, dst: &'a mut [u8]) -> Outcome<'a> {
        Tunnel::update_timers(self, now, dst)
    }
    fn set_persistent_keepalive(&mut self, secs: Option<u16>) {
        Tunnel::set_persistent_keepalive(self, secs)
    }
    fn set_private_key(&mut self, own_private: &SecretKey, limiter: &Limiter) {
        Tunnel::set_private_key(self, own_private, limiter)
    }
    fn since_last_handshake(&self) -> Option<Duration> {
        self.stats().since_last_handshake
    }
    fn is_awake(&self) -> bool {
        self.is_active()
    }
    #[inline]
    fn reserve_send(&mut self, count: usize, bytes: usize) -> Option<SealBatch> {
        Tunnel::reserve_send(self, count, bytes)
    }
    #[inline]
    fn receiving(&self, message: &[u8]) -> Option<OpenKey> {
        Tunnel::receiving(self, message)
    }
    #[inline]
    fn record_received(&mut self, session: u32, data_bytes: Option<usize>) {
        Tunnel::record_received(self, session, data_bytes)
    }
}

#[inline]
pub fn packet_destination(packet: &[u8]) -> Option<IpAddr> {
    match packet.first()? >> 4 {
        4 if packet.len() >= 20 => {
            let b: [u8; 4] = packet[16..20].try_into().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(b)))
        }
        6 if packet.len() >= 40 => {
            let b: [u8; 16] = packet[24..40].try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{ipv4_packet, rng, rng_mut};

    fn pair() -> (Tunnel, Tunnel, Limiter, Limiter, SecretKey, SecretKey) {
        let a = SecretKey::generate();
        let b = SecretKey::generate();
        let la = Limiter::new(&a.public_key(), &mut rng_mut());
        let lb = Limiter::new(&b.public_key(), &mut rng_mut());
        let ta = Tunnel::new(&a, &b.public_key(), None, None, 1, &la, rng());
        let tb = Tunnel::new(&b, &a.public_key(), None, None, 2, &lb, rng());
        (ta, tb, la, lb, a, b)
    }

    #[test]
    fn handshake_then_data_round_trip() {
        let (mut ta, mut tb, _la, lb, _a, b) = pair();
        let packet = ipv4_packet([10, 0, 0, 1], [10, 0, 0, 2], b"hello through the tunnel");
        let mut buf = vec![0u8; 2048];
        let mut out = vec![0u8; 2048];
        // a has no session: the packet is queued and an initiation comes out.
        let init = match ta.encapsulate(&packet, &mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected initiation, got {other:?}"),
        };
        let src: IpAddr = "192.0.2.1".parse().expect("ip");
        let mut cookie = [0u8; 64];
        let who = classify(&lb, &b, &b.public_key(), src, &init, &mut cookie).expect("valid");
        assert_eq!(who, Incoming::Initiation(_a.public_key()));
        let resp = match tb.decapsulate(src, &init, &mut out) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected response, got {other:?}"),
        };
        // The response releases a's queued packet through flush.
        assert!(matches!(
            ta.decapsulate(src, &resp, &mut out),
            Outcome::Network(_) | Outcome::Done
        ));
        let data = match ta.flush(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected queued data, got {other:?}"),
        };
        match tb.decapsulate(src, &data, &mut out) {
            Outcome::Tunnel(p, from) => {
                assert_eq!(p, &packet[..]);
                assert_eq!(from, "10.0.0.1".parse::<IpAddr>().expect("ip"));
            }
            other => panic!("expected plaintext, got {other:?}"),
        }
        // Replaying the same data message is rejected, not delivered twice.
        assert!(matches!(
            tb.decapsulate(src, &data, &mut out),
            Outcome::Error(TunnelError::Rejected(_))
        ));
    }

    #[test]
    fn handshakes_are_told_apart_by_type_and_size_alone() {
        let (mut ta, ..) = pair();
        let mut buf = vec![0u8; 2048];
        let init = match ta.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected initiation, got {other:?}"),
        };
        assert!(is_handshake(&init));
        assert!(is_handshake(
            &[&[2u8, 0, 0, 0][..], &[0u8; 88][..]].concat()
        ));
        assert!(is_handshake(
            &[&[3u8, 0, 0, 0][..], &[0u8; 60][..]].concat()
        ));
        // A data message, a wrong size, a wrong type, too short to have a type.
        assert!(!is_handshake(
            &[&[4u8, 0, 0, 0][..], &[0u8; 28][..]].concat()
        ));
        assert!(!is_handshake(&init[..147]));
        assert!(!is_handshake(&[&[1u8, 0, 0, 1][..], &init[4..]].concat()));
        assert!(!is_handshake(&[1u8, 0]));
        let reply = [
            &[3u8, 0, 0, 0][..],
            &0x1234_56ffu32.to_le_bytes()[..],
            &[0u8; 56][..],
        ]
        .concat();
        assert_eq!(cookie_reply_index(&reply), Some(0x12_3456));
        assert_eq!(cookie_reply_index(&init), None);
        assert_eq!(cookie_reply_index(&reply[..63]), None);
    }

    /// Under load, a message without a valid mac2 gets a cookie and is never charged; one
    /// that carries the cookie is charged before any Diffie-Hellman, and a refusal stops it.
    #[test]
    fn under_load_a_proven_source_is_charged_before_the_diffie_hellman() {
        let (mut ta, _tb, _la, lb, _a, b) = pair();
        let src: IpAddr = "192.0.2.1".parse().expect("ip");
        let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
        let init = match ta.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected initiation, got {other:?}"),
        };
        // Not under load: passes without a charge question that proves anything.
        let mut asked = None;
        let who = classify_charged(&lb, &b, &b.public_key(), src, &init, &mut out, |p| {
            asked = Some(p);
            true
        });
        assert_eq!(who, Ok(Incoming::Initiation(_a.public_key())));
        assert_eq!(asked, Some(false));
        lb.set_under_load(true);
        let mut cookie = [0u8; 64];
        let who = classify_charged(&lb, &b, &b.public_key(), src, &init, &mut cookie, |_| {
            panic!("a message without mac2 is answered with a cookie, not charged")
        });
        let Ok(Incoming::Cookie(len)) = who else {
            panic!("expected a cookie reply, got {who:?}");
        };
        // The initiator takes the cookie and sends its initiation again, with mac2.
        assert!(matches!(
            ta.decapsulate(src, &cookie[..len], &mut out),
            Outcome::Done
        ));
        let again = match ta.active().format_handshake_initiation(&mut buf, true) {
            TunnResult::WriteToNetwork(m) => m.to_vec(),
            _ => panic!("expected an initiation with mac2"),
        };
        let refused = classify_charged(&lb, &b, &b.public_key(), src, &again, &mut out, |p| {
            assert!(p, "a valid mac2 proves the source");
            false
        });
        assert_eq!(refused, Ok(Incoming::Limited));
        let allowed = classify_charged(&lb, &b, &b.public_key(), src, &again, &mut out, |_| true);
        assert_eq!(allowed, Ok(Incoming::Initiation(_a.public_key())));
    }

    /// The checks a reader makes under load agree with the handshake path's: an initiation
    /// with a valid mac1 and no cookie gets a cookie reply its initiator takes, its retry
    /// proves the source (mac2), and a message with a bad mac1 passes neither.
    #[test]
    fn a_readers_mac_checks_and_cookie_reply_are_the_handshake_paths() {
        let (mut ta, _tb, _la, lb, _a, b) = pair();
        let src: IpAddr = "192.0.2.1".parse().expect("ip");
        let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
        let init = match ta.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected initiation, got {other:?}"),
        };
        let cookie = lb.source_cookie(src);
        assert!(lb.mac1_is_valid(&init));
        assert!(!lb.mac2_is_valid(&cookie, &init));
        assert!(!carries_mac2(&init), "no cookie yet: zeros");
        let mut garbage = init.clone();
        garbage[40] ^= 1;
        assert!(!lb.mac1_is_valid(&garbage));
        let mut reply = [0u8; 64];
        let len = lb.write_cookie_reply(&cookie, &init, &mut reply);
        assert_eq!(len, Some(64));
        assert!(lb
            .write_cookie_reply(&cookie, &init, &mut [0u8; 63])
            .is_none());
        assert!(matches!(
            ta.decapsulate(src, &reply, &mut out),
            Outcome::Done
        ));
        let again = match ta.active().format_handshake_initiation(&mut buf, true) {
            TunnResult::WriteToNetwork(m) => m.to_vec(),
            _ => panic!("expected an initiation with mac2"),
        };
        assert!(lb.mac1_is_valid(&again) && lb.mac2_is_valid(&cookie, &again));
        assert!(carries_mac2(&again));
        let elsewhere = lb.source_cookie("192.0.2.2".parse().expect("ip"));
        assert!(
            !lb.mac2_is_valid(&elsewhere, &again),
            "proves its own address only"
        );
        // The handshake path finds it proven too.
        lb.set_under_load(true);
        let mut proved = false;
        let who = classify_charged(&lb, &b, &b.public_key(), src, &again, &mut out, |p| {
            proved = p;
            true
        });
        assert_eq!(who, Ok(Incoming::Initiation(_a.public_key())));
        assert!(proved);
    }

    #[test]
    fn persistent_keepalive_follows_the_time_it_is_given() {
        let (mut ta, mut tb, ..) = pair();
        let src: IpAddr = "192.0.2.1".parse().expect("ip");
        let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
        let init = match ta.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected initiation, got {other:?}"),
        };
        let resp = match tb.decapsulate(src, &init, &mut out) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("expected response, got {other:?}"),
        };
        let _ = ta.decapsulate(src, &resp, &mut out);
        let t0 = crate::test_util::now();
        // Off: no keepalive however much time passes.
        assert!(!matches!(
            ta.update_timers(t0 + Duration::from_secs(60), &mut buf),
            Outcome::Network(m) if m.len() == 32
        ));
        ta.set_persistent_keepalive(Some(5));
        // The interval starts at the first tick after it was set, and a keepalive (an empty
        // data message: 32 bytes) goes once 5 s have passed, then 5 s later again.
        let is_keepalive = |o: Outcome<'_>| matches!(o, Outcome::Network(m) if m.len() == 32);
        assert!(!is_keepalive(ta.update_timers(t0, &mut buf)));
        assert!(!is_keepalive(
            ta.update_timers(t0 + Duration::from_millis(4900), &mut buf)
        ));
        assert!(is_keepalive(
            ta.update_timers(t0 + Duration::from_secs(5), &mut buf)
        ));
        assert!(!is_keepalive(
            ta.update_timers(t0 + Duration::from_secs(6), &mut buf)
        ));
        assert!(is_keepalive(
            ta.update_timers(t0 + Duration::from_secs(10), &mut buf)
        ));
    }

    #[test]
    fn garbage_and_truncated_messages_are_rejected() {
        let b = SecretKey::generate();
        let lb = Limiter::new(&b.public_key(), &mut rng_mut());
        let src: IpAddr = "192.0.2.1".parse().expect("ip");
        let mut cookie = [0u8; 64];
        for garbage in [
            &b""[..],
            b"\x01\x00\x00\x00short",
            &[0xffu8; 200][..],
            &[1u8; 148][..],
        ] {
            assert!(classify(&lb, &b, &b.public_key(), src, garbage, &mut cookie).is_err());
        }
    }

    #[test]
    fn destination_of_v4_and_v6_packets() {
        let p = ipv4_packet([10, 0, 0, 1], [10, 0, 0, 9], b"x");
        assert_eq!(
            packet_destination(&p),
            Some("10.0.0.9".parse().expect("ip"))
        );
        let mut v6 = vec![0u8; 40];
        v6[0] = 0x60;
        v6[39] = 1;
        assert_eq!(packet_destination(&v6), Some("::1".parse().expect("ip")));
        assert_eq!(packet_destination(&[0x45, 0]), None);
    }
}
