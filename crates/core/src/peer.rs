//! One WireGuard peer as a sans-IO value: its session (through `core::wg`), the path it is
//! reached by, its counters and its timer bookkeeping (the first handshake of a keepalive peer,
//! expiry, which completed handshake was logged). `begin_send`/`encapsulate`,
//! `receiving`/`opened`/`decapsulate` and `on_tick` say what to send, what to deliver and what
//! to drop; the shell's data plane does the I/O.
//!
//! Data messages are sealed and opened outside the peer's lock: under it, `begin_send` reserves
//! counters on the current session (a [`SealBatch`] any thread may seal with) and `receiving`
//! finds the session a message names (an [`OpenKey`]); after opening, `opened` records it for
//! the timers, counts it and roams. Handshakes, cookies and packets waiting for a session go
//! through `encapsulate`/`decapsulate` whole, under the lock.
//!
//! Time is an argument: nothing here reads the clock (boringtun, inside `core::wg`, does for
//! its own handshake timers).

use crate::config::{PublicKey, SecretKey};
use crate::control::PeerSpec;
use crate::packet::{self, DropReason, Inbound, Outbound, PeerLookup, PeerPath};
use crate::takeover::{self, Answer, KnownEndpoints, Origin, Settle, Start, TakeoverState};
use crate::wg::{
    Handshake, Limiter, OpenKey, Opened, Outcome, Randomness, SealBatch, Session, Tunnel,
    TunnelError,
};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// A completed handshake seen again within this of the logged one is the same handshake: the
/// session reports its age, and `now - age` moves a little from tick to tick.
const SAME_HANDSHAKE: Duration = Duration::from_secs(1);

/// How often the shared handshake rate limiter forgets its count (boringtun expects about once
/// a second).
pub const LIMITER_RESET_EVERY: Duration = Duration::from_secs(1);

/// What one peer has moved, in WireGuard datagram bytes (what `wg show` reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerCounters {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    /// Handshake initiations this side sent (first contact, rekeys, retries).
    pub handshakes_initiated: u64,
    /// Handshake initiations of the peer this side answered.
    pub handshakes_answered: u64,
    /// Timer errors other than an expired session (the handshake gave up).
    pub handshake_failures: u64,
    /// Takeovers ([`crate::takeover`]): initiations sent to a known endpoint of a peer that
    /// named a session this process did not have, those a handshake followed within
    /// REKEY_TIMEOUT, those none did, and those asked for with no known endpoint to send to.
    pub takeovers_started: u64,
    pub takeovers_completed: u64,
    pub takeovers_failed: u64,
    pub takeovers_no_endpoint: u64,
    /// The time from a takeover's initiation to its handshake, summed over the completed
    /// ones, and the latest.
    pub takeover_time_total: Duration,
    pub takeover_time_last: Option<Duration>,
}

/// What every peer counts as it moves data; the takeover counts live in its
/// `TakeoverRecord`, made only for a peer that needs one.
#[derive(Debug, Clone, Copy, Default)]
struct Traffic {
    rx_bytes: u64,
    tx_bytes: u64,
    rx_packets: u64,
    tx_packets: u64,
    handshakes_initiated: u64,
    handshakes_answered: u64,
    handshake_failures: u64,
}

impl Traffic {
    /// `messages` data messages carrying `plaintext` bytes in all.
    fn sent_data(&mut self, messages: usize, plaintext: usize) {
        self.tx_bytes += (plaintext + messages * crate::wg::OVERHEAD) as u64;
        self.tx_packets += messages as u64;
    }

    fn sent(&mut self, message: &[u8]) {
        self.tx_bytes += message.len() as u64;
        self.tx_packets += 1;
        match Handshake::of(message) {
            Some(Handshake::Initiation) => self.handshakes_initiated += 1,
            Some(Handshake::Response) => self.handshakes_answered += 1,
            None => {}
        }
    }
}

/// A copy of what status, metrics and UAPI `get` show of a peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStats {
    pub counters: PeerCounters,
    pub path: Option<PeerPath>,
    pub since_last_handshake: Option<Duration>,
}

/// What to do with the segments of one TUN read, decided under the peer's lock.
#[derive(Debug)]
pub enum Sending {
    /// Seal segment `i` with `batch` (outside the lock, any thread) and send it to `to`.
    Seal { batch: SealBatch, to: PeerPath },
    /// No usable session yet, or no endpoint: hand each segment to [`Peer::encapsulate`], which
    /// queues it and starts a handshake (or drops it, with nowhere to send).
    Queue,
}

/// What a timer tick asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tick {
    /// Send the first `len` bytes of the output buffer on `path`.
    pub send: Option<(usize, PeerPath)>,
    /// A handshake completed since the last one reported: log it once.
    pub handshake_completed: bool,
}

/// One peer's live state. The data plane keeps one per peer behind a lock, takes it for one
/// call, and does the I/O after letting go. `S` is the WireGuard session: boringtun's
/// ([`Tunnel`]) in the daemon, a scripted one in tests.
pub struct Peer<S = Tunnel> {
    tunnel: S,
    path: Option<PeerPath>,
    counters: Traffic,
    keepalive: bool,
    /// A peer with persistent keepalive starts its first handshake from the timer, once.
    keepalive_started: bool,
    /// When the last logged handshake completed, on the caller's clock.
    logged_handshake: Option<Instant>,
    /// The newest data message opened outside the lock ([`Peer::opened`]): only a newer one
    /// may move the endpoint.
    newest: Option<packet::Sequence>,
    /// Made at the peer's first takeover request: most peers of a concentrator never need
    /// one, and inline it would cost each of 100,000 peers about 180 bytes.
    takeover: Option<Box<TakeoverRecord>>,
    /// Where a takeover may send: the configured endpoint and those the peer authenticated from.
    known: KnownEndpoints,
    /// The learned endpoints changed since [`Peer::take_learned_news`] last looked.
    learned_news: bool,
    /// The timer thread has this peer on its list ([`Peer::woke`], [`Peer::wants_ticks`]).
    on_timer_list: bool,
}

/// One peer's takeovers: the one under way and the counts.
#[derive(Debug, Default)]
struct TakeoverRecord {
    state: TakeoverState,
    /// When the latest takeover initiation went, on the caller's clock.
    started: Option<Instant>,
    /// When the latest takeover was started or found nowhere to go: the next request waits
    /// REKEY_TIMEOUT from it, so a peer that keeps sending costs one look per 5 s.
    decided: Option<Instant>,
    /// When a handshake response last completed a session this side initiated since the
    /// record was made, on the caller's clock ([`Peer::decapsulate_handshake`]). boringtun's
    /// own record of it moves only with its timer tick (100 ms), too coarse to time a takeover
    /// of a few milliseconds.
    response_completed_at: Option<Instant>,
    started_count: u64,
    completed: u64,
    failed: u64,
    no_endpoint: u64,
    time_total: Duration,
    time_last: Option<Duration>,
}

impl Peer<Tunnel> {
    /// A peer with no session yet (boringtun's state is built at the first message). `rng`
    /// gives its handshakes' ephemeral keys.
    pub fn new(
        own_private: &SecretKey,
        public_key: &PublicKey,
        spec: &PeerSpec,
        index: u32,
        limiter: &Limiter,
        path: Option<PeerPath>,
        rng: Randomness,
    ) -> Peer {
        let tunnel = Tunnel::new(
            own_private,
            public_key,
            spec.preshared_key.as_ref(),
            spec.persistent_keepalive,
            index,
            limiter,
            rng,
        );
        Peer::with_session(tunnel, spec.persistent_keepalive, path)
    }
}

impl<S: Session> Peer<S> {
    /// A peer around `session`, with persistent keepalive every `keepalive` seconds.
    pub fn with_session(session: S, keepalive: Option<u16>, path: Option<PeerPath>) -> Peer<S> {
        Peer {
            tunnel: session,
            path,
            counters: Traffic::default(),
            keepalive: keepalive.is_some_and(|s| s > 0),
            keepalive_started: false,
            logged_handshake: None,
            newest: None,
            takeover: None,
            // Where it was configured (or, made again, where it was reached) is known.
            known: KnownEndpoints::configured(path.map(|p| p.remote)),
            learned_news: false,
            on_timer_list: false,
        }
    }

    /// Whether the timer has anything to do for this peer: a session that ever woke (its
    /// handshakes, rekeys, keepalives and expiry), or a persistent keepalive's first handshake
    /// still to start. A concentrator's idle peers have none, so the timer walks only the
    /// peers that talk, not all 100,000 every 100 ms.
    fn needs_ticks(&self) -> bool {
        self.tunnel.is_awake() || (self.keepalive && !self.keepalive_started && self.path.is_some())
    }

    /// After a call that may have woken the session (a packet to send, a handshake message, a
    /// takeover): true once, when the peer now needs the timer and is not on its list yet. The
    /// caller then hands the peer to the timer thread.
    pub fn woke(&mut self) -> bool {
        if self.on_timer_list || !self.needs_ticks() {
            return false;
        }
        self.on_timer_list = true;
        true
    }

    /// On the timer thread, for a peer on (or handed to) its list: whether it stays there.
    /// A peer that needs no ticks leaves, and [`Peer::woke`] hands it over again when it does.
    pub fn wants_ticks(&mut self) -> bool {
        self.on_timer_list = self.needs_ticks();
        self.on_timer_list
    }

    /// Under the lock: `segments` data messages carrying `bytes` of plaintext in all are about
    /// to be sent. Reserves their counters on the current session (recorded for the timers and
    /// counted as sent now: sealing cannot fail), or says to queue them or drop them.
    #[inline]
    pub fn begin_send(&mut self, segments: usize, bytes: usize) -> Sending {
        let Some(to) = self.path else {
            return Sending::Queue;
        };
        match self.tunnel.reserve_send(segments, bytes) {
            Some(batch) => {
                self.counters.sent_data(segments, bytes);
                Sending::Seal { batch, to }
            }
            None => Sending::Queue,
        }
    }

    /// Under the lock: the session a data message names, to open it with outside the lock
    /// ([`OpenKey::open`]) and then report with [`Peer::opened`]. `None` for anything else
    /// (handshakes, cookies, a session no longer kept): use [`Peer::decapsulate`].
    #[inline]
    pub fn receiving(&self, datagram: &[u8]) -> Option<OpenKey> {
        self.tunnel.receiving(datagram)
    }

    /// Under the lock, after `datagram` from `from` (`datagram_len` bytes) was opened outside it
    /// with `plaintext` (`[..opened.len]` is the message's plaintext): records it for the
    /// timers, checks its inner source against `peers` (this peer is `me`), counts it and roams,
    /// as [`Peer::decapsulate`] does for a message opened under the lock.
    #[inline]
    pub fn opened<T: PeerLookup>(
        &mut self,
        peers: &T,
        me: &T::Peer,
        from: PeerPath,
        datagram_len: usize,
        opened: &Opened,
        plaintext: &[u8],
    ) -> Inbound {
        let received = packet::opened(peers, me, &mut self.tunnel, opened, plaintext);
        if received.authenticated {
            self.counters.rx_bytes += datagram_len as u64;
            self.counters.rx_packets += 1;
            // Only a message newer than every one seen may move the endpoint: batches opened
            // on several threads are recorded in the order they finish, not the order sent.
            let this = (opened.generation, opened.counter);
            if packet::newer(self.newest, this) {
                self.newest = Some(this);
                self.roam(from);
            }
        }
        received.action
    }

    /// Encrypts one TUN segment into `out` under the lock: data, or the handshake initiation it
    /// started while it waits in the session's queue. The path for segments [`Peer::begin_send`]
    /// says to queue.
    #[inline]
    pub fn encapsulate(&mut self, segment: &[u8], out: &mut [u8]) -> Outbound {
        let decision = packet::encapsulate(&mut self.tunnel, self.path, segment, out);
        if let Outbound::Send { len, .. } = decision {
            self.counters.sent(&out[..len]);
        }
        decision
    }

    /// Decrypts a datagram that `from` sent to this peer (`me` in `peers`) into `landing`,
    /// checks its inner source, counts it, and roams to `from` if it authenticated. A
    /// [`Inbound::Reply`] is counted as sent; the caller then calls [`Peer::flush_queued`].
    #[inline]
    pub fn decapsulate<T: PeerLookup>(
        &mut self,
        peers: &T,
        me: &T::Peer,
        from: PeerPath,
        datagram: &[u8],
        landing: &mut [u8],
        now: Instant,
    ) -> Inbound {
        let received =
            packet::decapsulate(peers, me, &mut self.tunnel, from.remote, datagram, landing);
        if !received.authenticated
            && takeover::is_data(datagram)
            && self.tunnel.receiving(datagram).is_none()
        {
            // Another process had this session (before a restart, or another replica).
            return self.ask_takeover(from, now);
        }
        if received.authenticated {
            self.counters.rx_bytes += datagram.len() as u64;
            self.counters.rx_packets += 1;
            self.roam(from);
        }
        if let Inbound::Reply(len) = received.action {
            self.counters.sent(&landing[..len]);
        }
        received.action
    }

    /// A data message from `from` named a session this side keeps, and did not authenticate
    /// under its keys ([`OpenKey::open`] refused it as a forgery, not as a replay): another
    /// process may have handed out the same index (a peer back from a replica that reused it).
    /// It asks for a takeover as a session this side does not have would; otherwise it is
    /// dropped as invalid.
    pub fn failed_open(&mut self, error: TunnelError, from: PeerPath, now: Instant) -> Inbound {
        match error {
            TunnelError::Forged => self.ask_takeover(from, now),
            _ => Inbound::Drop(DropReason::Invalid),
        }
    }

    /// A takeover's cue from `from`: news once per takeover (the caller hands the peer to the
    /// handshake thread), dropped as an unknown session otherwise.
    fn ask_takeover(&mut self, from: PeerPath, now: Instant) -> Inbound {
        let record = self.takeover.get_or_insert_with(Box::default);
        match record.state.request(from, now, record.decided) {
            true => Inbound::TakeOver,
            false => Inbound::Drop(DropReason::UnknownPeer),
        }
    }

    /// An authenticated datagram from `from`: the peer is reached there from now on, and a
    /// takeover may go there.
    fn roam(&mut self, from: PeerPath) {
        if let Some(path) = packet::roam(self.path, from, true) {
            self.path = Some(path);
        }
        if self.known.learn(from.remote, Origin::Authenticated) {
            self.learned_news = true;
        }
    }

    /// [`Peer::decapsulate`] for a handshake message on the handshake path at `now`: a
    /// response that completes this side's initiation (boringtun confirms it with a keepalive)
    /// is stamped with `now`, which times a takeover.
    pub fn decapsulate_handshake<T: PeerLookup>(
        &mut self,
        peers: &T,
        me: &T::Peer,
        from: PeerPath,
        datagram: &[u8],
        landing: &mut [u8],
        now: Instant,
    ) -> Inbound {
        let decision = self.decapsulate(peers, me, from, datagram, landing, now);
        if Handshake::of(datagram) == Some(Handshake::Response)
            && matches!(decision, Inbound::Reply(_))
        {
            if let Some(record) = self.takeover.as_deref_mut() {
                record.response_completed_at = Some(now);
            }
        }
        decision
    }

    /// The takeover was not handed to the handshake thread (its queue was full): a later data
    /// message asks again.
    pub fn withdraw_takeover(&mut self) {
        if let Some(record) = self.takeover.as_deref_mut() {
            record.state.withdraw();
        }
    }

    /// On the handshake thread at `now`: starts the requested takeover towards the endpoint
    /// [`takeover::target`] picks under `answer`. For [`Start::Initiate`], the initiation is the
    /// first `len` bytes of `out` (`None`: the session could not make one), counted as sent.
    pub fn start_takeover(
        &mut self,
        now: Instant,
        answer: Answer,
        out: &mut [u8],
    ) -> (Start, Option<usize>) {
        let Some(record) = self.takeover.as_deref_mut() else {
            return (Start::Nothing, None);
        };
        let start = record.state.start(now, self.path, &self.known, answer);
        if start != Start::Nothing {
            record.decided = Some(now);
        }
        let mut sent = None;
        match start {
            Start::Initiate { .. } => {
                record.started = Some(now);
                record.started_count += 1;
                if let Outcome::Network(m) = self.tunnel.initiate_anew(out) {
                    let len = m.len();
                    self.counters.sent(&out[..len]);
                    sent = Some(len);
                }
            }
            Start::NoKnownEndpoint { .. } => record.no_endpoint += 1,
            Start::Nothing => {}
        }
        (start, sent)
    }

    /// On the handshake thread at `now`: whether the started takeover completed (a handshake,
    /// whichever side initiated it) or failed, counted.
    pub fn settle_takeover(&mut self, now: Instant) -> Settle {
        let Some(record) = self.takeover.as_deref_mut() else {
            return Settle::Pending;
        };
        // A response stamped on this clock since the takeover started, else boringtun's own,
        // coarser record (a handshake the peer initiated, this side answering): a stamp older
        // than the takeover must not hide that record.
        let recorded = self
            .tunnel
            .since_last_handshake()
            .and_then(|since| now.checked_sub(since));
        let started = record.started;
        let stamped = record
            .response_completed_at
            .filter(|at| started.is_some_and(|started| *at >= started));
        let completed_at = stamped.or(recorded);
        let settle = record.state.settle(now, completed_at);
        match settle {
            Settle::Completed { after, .. } => {
                record.completed += 1;
                record.time_total += after;
                record.time_last = Some(after);
            }
            Settle::Failed { .. } => record.failed += 1,
            Settle::Pending => {}
        }
        settle
    }

    /// Records that this identity saw the peer authenticate at `addr` (`origin`: before a
    /// restart, or at another replica of the group): its newest, where a takeover may go.
    pub fn learn(&mut self, addr: std::net::SocketAddr, origin: Origin) {
        if self.known.learn(addr, origin) {
            self.learned_news = true;
        }
    }

    /// The endpoints a takeover may go to.
    pub fn known_endpoints(&self) -> &KnownEndpoints {
        &self.known
    }

    /// Whether the learned endpoints changed since the last call.
    pub fn take_learned_news(&mut self) -> bool {
        std::mem::take(&mut self.learned_news)
    }

    /// The next packet that waited in the session's queue for a handshake, encrypted into
    /// `out`: its length, counted as sent. `None` when the queue is empty.
    #[inline]
    pub fn flush_queued(&mut self, out: &mut [u8]) -> Option<usize> {
        match self.tunnel.flush(out) {
            Outcome::Network(m) => {
                let len = m.len();
                self.counters.sent(&out[..len]);
                Some(len)
            }
            _ => None,
        }
    }

    /// WireGuard's timers at `now`: handshake retries and rekeys, keepalives, the first
    /// handshake of a keepalive peer, expiry; and whether a newly completed handshake should
    /// be logged. At most one message per tick.
    pub fn on_tick(&mut self, now: Instant, out: &mut [u8]) -> Tick {
        let since = self.tunnel.since_last_handshake();
        let mut tick = Tick {
            handshake_completed: self.note_handshake(since, now),
            send: None,
        };
        let Some(path) = self.path else {
            // Nowhere to send: timers still run so the session expires on time.
            let _ = self.tunnel.update_timers(now, out);
            return tick;
        };
        let first = self.keepalive && !std::mem::replace(&mut self.keepalive_started, true);
        if packet::keepalive_handshake(self.keepalive, !first, since.is_some()) {
            if let Outcome::Network(m) = self.tunnel.initiate(out) {
                let len = m.len();
                self.counters.sent(&out[..len]);
                tick.send = Some((len, path));
                return tick;
            }
        }
        match self.tunnel.update_timers(now, out) {
            Outcome::Network(m) => {
                let len = m.len();
                self.counters.sent(&out[..len]);
                tick.send = Some((len, path));
            }
            Outcome::Error(TunnelError::Expired) => {}
            Outcome::Error(_) => self.counters.handshake_failures += 1,
            Outcome::Done | Outcome::Tunnel(..) => {}
        }
        tick
    }

    /// Whether the handshake that completed `since` ago is one not yet reported.
    fn note_handshake(&mut self, since: Option<Duration>, now: Instant) -> bool {
        let Some(at) = since.and_then(|s| now.checked_sub(s)) else {
            return false;
        };
        let new = self
            .logged_handshake
            .is_none_or(|logged| at > logged + SAME_HANDSHAKE);
        if new {
            self.logged_handshake = Some(at);
        }
        new
    }

    /// Forgets the local source `gone` (removed from this host) if replies leave from it.
    pub fn forget_source(&mut self, gone: IpAddr) {
        if let Some(p) = self.path.as_mut().filter(|p| p.local == Some(gone)) {
            p.local = None;
        }
    }

    /// Sets where the peer is reached (configured, or `wg set endpoint`): a takeover may go
    /// there too.
    pub fn set_endpoint(&mut self, path: PeerPath) {
        self.path = Some(path);
        self.known.set_configured(Some(path.remote));
    }

    /// Carries what a peer made again (a new preshared key) knew of where it is reached.
    pub fn inherit_known_endpoints<T>(&mut self, from: &Peer<T>) {
        self.known.inherit_learned(&from.known);
    }

    /// A new persistent keepalive interval for a live session.
    pub fn set_keepalive(&mut self, secs: Option<u16>) {
        self.keepalive = secs.is_some_and(|s| s > 0);
        self.tunnel.set_persistent_keepalive(secs);
    }

    /// The interface's key changed: the session keeps its state under the new identity.
    pub fn set_private_key(&mut self, own_private: &SecretKey, limiter: &Limiter) {
        self.tunnel.set_private_key(own_private, limiter);
    }

    pub fn path(&self) -> Option<PeerPath> {
        self.path
    }

    pub fn stats(&self) -> PeerStats {
        let t = self.counters;
        let mut counters = PeerCounters {
            rx_bytes: t.rx_bytes,
            tx_bytes: t.tx_bytes,
            rx_packets: t.rx_packets,
            tx_packets: t.tx_packets,
            handshakes_initiated: t.handshakes_initiated,
            handshakes_answered: t.handshakes_answered,
            handshake_failures: t.handshake_failures,
            ..PeerCounters::default()
        };
        if let Some(record) = self.takeover.as_deref() {
            counters.takeovers_started = record.started_count;
            counters.takeovers_completed = record.completed;
            counters.takeovers_failed = record.failed;
            counters.takeovers_no_endpoint = record.no_endpoint;
            counters.takeover_time_total = record.time_total;
            counters.takeover_time_last = record.time_last;
        }
        PeerStats {
            counters,
            path: self.path,
            since_last_handshake: self.tunnel.since_last_handshake(),
        }
    }
}

/// When the shared handshake rate limiter is due to forget its count.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimiterReset {
    last: Option<Instant>,
}

impl LimiterReset {
    /// Whether to reset at `now` (the first call only starts the interval).
    pub fn due(&mut self, now: Instant) -> bool {
        let last = *self.last.get_or_insert(now);
        let due = now.duration_since(last) >= LIMITER_RESET_EVERY;
        if due {
            self.last = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests;
