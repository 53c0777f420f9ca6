//! One worker thread: a share of the simulated peers, each a `Tunn` towards the gateway with a
//! UDP socket of its own, driven by one level-triggered epoll loop. The loop runs every peer's
//! timers (`update_timers` every `tick` per peer, the peers' turns spread evenly over the
//! period), sends each peer's ICMP echo every `ping` (spread the same way), answers whatever
//! the gateway sends (responses, its own initiations, cookies, data) and reports counters to
//! the main thread once per stats interval. Nothing is allocated per packet: the buffers are
//! the worker's, and pings are sealed straight into the send buffer on the current session.

use crate::icmp::{self, ECHO_LEN};
use crate::keys;
use crate::stats::{Counters, Histogram};
use crate::sys::{self, Epoll, EventFd};
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;

/// What every worker is told at the start.
#[derive(Clone)]
pub struct Setup {
    pub seed: String,
    pub gateway_key: [u8; 32],
    pub endpoint: SocketAddrV4,
    /// The gateway's tunnel address: the pings' destination.
    pub gateway_ip: Ipv4Addr,
    /// Where the peers' sockets bind: one address each in this network (round-robin past its
    /// size), or the wildcard.
    pub source: Option<(Ipv4Addr, u8)>,
    /// Persistent keepalive in seconds, 0 = off.
    pub keepalive: u16,
    /// Every peer pings every this many ns; 0 = no pings.
    pub ping_ns: u64,
    pub tick_ns: u64,
    pub stats_ns: u64,
    /// A peer counts as working while its last reply is at most this old.
    pub working_ns: u64,
}

/// From the main thread to a worker.
#[derive(Clone, Debug)]
pub enum Cmd {
    /// Start the schedules at `t0`; with `burst`, every peer initiates a handshake at once.
    Start {
        t0: u64,
        burst: bool,
    },
    /// A new mark at `t`: count again which peers have had a handshake, and a reply to a ping
    /// sent at or after `t`.
    Mark {
        mark: u32,
        t: u64,
    },
    /// A mark at `t`, and every peer starts a new handshake now.
    Rekey {
        mark: u32,
        t: u64,
    },
    WindowStart {
        t: u64,
    },
    WindowStop,
    Dump,
    Quit,
}

/// One peer's state, for a dump.
pub struct PeerLine {
    pub index: u32,
    pub addr: Ipv4Addr,
    pub port: u16,
    pub last_reply_ns: u64,
    pub last_handshake_ns: u64,
    pub pings: u32,
    pub replies: u32,
    pub handshakes: u32,
    pub session: bool,
}

/// What one worker counted in one stats interval, and its peers' state at its end.
#[derive(Default)]
pub struct Report {
    pub counters: Counters,
    pub rtt: Histogram,
    /// Initiation (first try) to completion, of the handshakes completed as initiator.
    pub hs_time: Histogram,
    pub peers: u64,
    pub working: u64,
    pub with_session: u64,
    pub never_replied: u64,
    /// The oldest last reply among peers that have had one (ns ago).
    pub max_reply_age_ns: u64,
    pub mark: u32,
    pub mark_replied: u64,
    pub mark_handshaked: u64,
}

/// From a worker to the main thread.
pub enum Msg {
    Ready {
        peers: usize,
        setup_s: f64,
    },
    Failed {
        thread: usize,
        error: String,
    },
    Stats {
        thread: usize,
        interval: u64,
        report: Box<Report>,
    },
    /// Every peer of the worker has had a reply to a ping sent since the mark; `last_ns` when
    /// the last did, `delays_us` each peer's time from the mark.
    MarkReplied {
        thread: usize,
        mark: u32,
        last_ns: u64,
        delays_us: Vec<u64>,
    },
    MarkHandshaked {
        thread: usize,
        mark: u32,
        last_ns: u64,
        delays_us: Vec<u64>,
    },
    /// A burst (start, rekey) of `initiations` sent, taking `took_ns`.
    Burst {
        thread: usize,
        kind: &'static str,
        initiations: u64,
        took_ns: u64,
    },
    Window {
        thread: usize,
        counters: Box<Counters>,
        rtt: Box<Histogram>,
    },
    Dump {
        thread: usize,
        peers: Vec<PeerLine>,
    },
    Stopped,
}

/// What the main thread hands a worker: its peers, its commands and how to wake it.
pub struct Handle {
    pub thread: usize,
    pub peers: Range<u32>,
    pub commands: Receiver<Cmd>,
    /// An eventfd the main thread writes to after each command (the worker's epoll sees it).
    pub wake: Arc<EventFd>,
}

struct Peer {
    tunn: Tunn,
    sock: UdpSocket,
    index: u32,
    addr: Ipv4Addr,
    seq: u16,
    last_reply_ns: u64,
    /// When the handshake under way was first initiated (0: none).
    hs_started_ns: u64,
    last_hs_ns: u64,
    pings: u32,
    replies: u32,
    handshakes: u32,
    mark_replied: bool,
    mark_handshaked: bool,
}

/// The worker's buffers: one receive, one send, one for ping plaintext.
struct Bufs {
    rx: [u8; 2048],
    tx: [u8; 2048],
    ping: [u8; ECHO_LEN],
}

/// Everything but the peers and the buffers, so they can be borrowed apart.
struct State {
    thread: usize,
    /// The worker's peers.
    n: usize,
    gateway_ip: Ipv4Addr,
    underlay_ip: IpAddr,
    out: Sender<Msg>,
    c: Counters,
    rtt: Histogram,
    hs_time: Histogram,
    mark: u32,
    mark_t: u64,
    mark_replied: Vec<u64>,
    mark_handshaked: Vec<u64>,
    mark_replied_last: u64,
    mark_handshaked_last: u64,
    window: Option<Window>,
}

struct Window {
    t: u64,
    c: Counters,
    rtt: Histogram,
}

/// Evenly spread turns: turn `e` (peer `e % n`) is due at `t0 + e * period / n`.
#[derive(Clone, Copy)]
struct Schedule {
    t0: u64,
    period: u64,
    n: u64,
    done: u64,
}

impl Schedule {
    fn new(t0: u64, period: u64, n: usize) -> Schedule {
        Schedule {
            t0,
            period,
            n: n as u64,
            done: 0,
        }
    }

    /// When turn `e` is due.
    fn due_at(&self, e: u64) -> u64 {
        self.t0 + (u128::from(e) * u128::from(self.period) / u128::from(self.n.max(1))) as u64
    }

    /// The next due turn's peer, advancing past it, if one is due by `now`.
    fn next(&mut self, now: u64) -> Option<usize> {
        if self.n == 0 || self.period == 0 || self.due_at(self.done) > now {
            return None;
        }
        let peer = (self.done % self.n) as usize;
        self.done += 1;
        Some(peer)
    }

    /// When the next turn is due (`u64::MAX`: never).
    fn next_due(&self) -> u64 {
        if self.n == 0 || self.period == 0 {
            u64::MAX
        } else {
            self.due_at(self.done)
        }
    }
}

const WAKE_TOKEN: u64 = u64::MAX;
/// Datagrams read from one socket per readiness event (level-triggered: the rest come next).
const READS_PER_EVENT: usize = 4;

/// Runs one worker until `Quit` or the main thread goes away; reports failures as `Failed`.
pub fn run(setup: Setup, h: Handle, out: Sender<Msg>) {
    let thread = h.thread;
    if let Err(e) = run_inner(&setup, h, out.clone()) {
        let _ = out.send(Msg::Failed {
            thread,
            error: e.to_string(),
        });
    }
}

fn make_peer(setup: &Setup, index: u32) -> io::Result<Peer> {
    let addr = keys::tunnel_addr(index).ok_or_else(|| {
        io::Error::other(format!(
            "peer {index}: no tunnel address (at most {})",
            keys::MAX_PEERS
        ))
    })?;
    let bind = match setup.source {
        Some((net, prefix)) => keys::source_addr(net, prefix, index)
            .ok_or_else(|| io::Error::other("source network too small"))?,
        None => Ipv4Addr::UNSPECIFIED,
    };
    let sock = UdpSocket::bind(SocketAddrV4::new(bind, 0))
        .map_err(|e| io::Error::new(e.kind(), format!("peer {index}: bind {bind}: {e}")))?;
    sock.connect(setup.endpoint)?;
    sock.set_nonblocking(true)?;
    sys::enable_rx_timestamps(sock.as_raw_fd())?;
    let private = StaticSecret::from(keys::private_key(&setup.seed, index));
    let tunn = Tunn::new(
        private,
        PublicKey::from(setup.gateway_key),
        None,
        (setup.keepalive > 0).then_some(setup.keepalive),
        index,
        None,
        Box::new(rand_core::OsRng),
    );
    Ok(Peer {
        tunn,
        sock,
        index,
        addr,
        seq: 0,
        last_reply_ns: 0,
        hs_started_ns: 0,
        last_hs_ns: 0,
        pings: 0,
        replies: 0,
        handshakes: 0,
        mark_replied: false,
        mark_handshaked: false,
    })
}

fn run_inner(setup: &Setup, h: Handle, out: Sender<Msg>) -> io::Result<()> {
    let started = sys::now_ns();
    let epoll = Epoll::new()?;
    epoll.add(h.wake.fd(), WAKE_TOKEN)?;
    let mut peers = Vec::with_capacity(h.peers.len());
    for index in h.peers.clone() {
        let p = make_peer(setup, index)?;
        epoll.add(p.sock.as_raw_fd(), peers.len() as u64)?;
        peers.push(p);
    }
    let n = peers.len();
    let _ = out.send(Msg::Ready {
        peers: n,
        setup_s: (sys::now_ns() - started) as f64 / 1e9,
    });

    // Wait for the start (or an early quit).
    let (t0, burst) = loop {
        match h.commands.recv() {
            Ok(Cmd::Start { t0, burst }) => break (t0, burst),
            Ok(Cmd::Quit) | Err(_) => return Ok(()),
            Ok(_) => continue,
        }
    };
    h.wake.drain();

    let mut st = State {
        thread: h.thread,
        n,
        gateway_ip: setup.gateway_ip,
        underlay_ip: IpAddr::V4(*setup.endpoint.ip()),
        out,
        c: Counters::default(),
        rtt: Histogram::default(),
        hs_time: Histogram::default(),
        mark: 0,
        mark_t: t0,
        mark_replied: Vec::with_capacity(n),
        mark_handshaked: Vec::with_capacity(n),
        mark_replied_last: 0,
        mark_handshaked_last: 0,
        window: None,
    };
    let mut bufs = Bufs {
        rx: [0; 2048],
        tx: [0; 2048],
        ping: [0; ECHO_LEN],
    };
    st.set_mark(0, t0, &mut peers);
    if burst {
        initiate_all(&mut peers, &mut bufs, &mut st, "start");
    }

    let mut ticks = Schedule::new(t0, setup.tick_ns, n);
    let mut pings = Schedule::new(t0 + setup.ping_ns / 2, setup.ping_ns, n);
    let mut next_stats = t0 + setup.stats_ns;
    let mut events = sys::events(256);
    loop {
        // Commands first.
        loop {
            match h.commands.try_recv() {
                Ok(Cmd::Quit) | Err(TryRecvError::Disconnected) => {
                    let _ = st.out.send(Msg::Stopped);
                    return Ok(());
                }
                Ok(cmd) => st.command(cmd, &mut peers, &mut bufs),
                Err(TryRecvError::Empty) => break,
            }
        }
        let now = sys::now_ns();
        while let Some(i) = ticks.next(now) {
            tick(&mut peers[i], &mut bufs, &mut st);
        }
        while let Some(i) = pings.next(now) {
            ping(&mut peers[i], &mut bufs, &mut st);
        }
        if now >= next_stats {
            let interval = (now - t0) / setup.stats_ns;
            st.report(interval, &peers, setup.working_ns, setup.ping_ns > 0);
            next_stats = t0 + (interval + 1) * setup.stats_ns;
        }

        let due = ticks.next_due().min(pings.next_due()).min(next_stats);
        let now = sys::now_ns();
        let timeout_ms = if due <= now {
            0
        } else {
            // At least 1 ms: turns due within it are taken together at the wake-up.
            (due - now).div_ceil(1_000_000).min(1000) as i32
        };
        let k = epoll.wait(&mut events, timeout_ms)?;
        for ev in &events[..k] {
            let token = sys::token(ev);
            if token == WAKE_TOKEN {
                h.wake.drain();
                continue;
            }
            let Some(peer) = peers.get_mut(token as usize) else {
                continue;
            };
            for _ in 0..READS_PER_EVENT {
                match sys::recv_stamped(peer.sock.as_raw_fd(), &mut bufs.rx) {
                    Ok((len, stamp)) => {
                        let now = sys::now_ns();
                        // The arrival on the monotonic clock: the kernel's stamp moved by the
                        // clocks' offset now (read back to back), never later than now.
                        let arrived = stamp
                            .map(|real| real.saturating_sub(sys::realtime_ns().saturating_sub(now)))
                            .filter(|&t| t <= now)
                            .unwrap_or(now);
                        on_datagram(peer, len, arrived, &mut bufs, &mut st)
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                        // An ICMP port unreachable from the gateway's host (it is down).
                        st.c.error("recv_refused");
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

/// A datagram that could not go out: counted by kind. A connected socket reports a pending ICMP
/// error (the gateway was down) on the next send, which then sends nothing: try once more.
fn send(sock: &UdpSocket, packet: &[u8], c: &mut Counters) {
    match sock.send(packet) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            c.error("send_refused");
            if sock.send(packet).is_err() {
                c.error("send_other");
            }
        }
        Err(_) => c.error("send_other"),
    }
}

/// Counts what is going out: initiations (and when a handshake attempt began), keepalives.
fn note_sent(peer: &mut Peer, packet: &[u8], now: u64, c: &mut Counters) {
    match packet.first() {
        Some(1) => {
            c.init_sent += 1;
            if peer.hs_started_ns == 0 {
                peer.hs_started_ns = now;
            }
        }
        Some(4) if packet.len() == 32 => c.keepalives_sent += 1,
        _ => {}
    }
}

fn error_name(e: WireGuardError) -> &'static str {
    match e {
        WireGuardError::DestinationBufferTooSmall => "destination_buffer_too_small",
        WireGuardError::IncorrectPacketLength => "incorrect_packet_length",
        WireGuardError::UnexpectedPacket => "unexpected_packet",
        WireGuardError::WrongPacketType => "wrong_packet_type",
        WireGuardError::WrongIndex => "wrong_index",
        WireGuardError::WrongKey => "wrong_key",
        WireGuardError::InvalidTai64nTimestamp => "invalid_tai64n_timestamp",
        WireGuardError::WrongTai64nTimestamp => "wrong_tai64n_timestamp",
        WireGuardError::InvalidMac => "invalid_mac",
        WireGuardError::InvalidAeadTag => "invalid_aead_tag",
        WireGuardError::InvalidCounter => "invalid_counter",
        WireGuardError::DuplicateCounter => "duplicate_counter",
        WireGuardError::InvalidPacket => "invalid_packet",
        WireGuardError::NoCurrentSession => "no_current_session",
        WireGuardError::LockFailed => "lock_failed",
        WireGuardError::ConnectionExpired => "connection_expired",
        WireGuardError::UnderLoad => "under_load",
    }
}

/// Every peer initiates a handshake now (one already under way is left to its retries).
fn initiate_all(peers: &mut [Peer], bufs: &mut Bufs, st: &mut State, kind: &'static str) {
    let t = sys::now_ns();
    let mut sent = 0;
    for peer in peers.iter_mut() {
        let now = sys::now_ns();
        if let TunnResult::WriteToNetwork(p) =
            peer.tunn.format_handshake_initiation(&mut bufs.tx, false)
        {
            note_sent(peer, p, now, &mut st.c);
            send(&peer.sock, p, &mut st.c);
            sent += 1;
        }
    }
    let _ = st.out.send(Msg::Burst {
        thread: st.thread,
        kind,
        initiations: sent,
        took_ns: sys::now_ns() - t,
    });
}

fn tick(peer: &mut Peer, bufs: &mut Bufs, st: &mut State) {
    let now = sys::now_ns();
    match peer.tunn.update_timers(&mut bufs.tx) {
        TunnResult::WriteToNetwork(p) => {
            note_sent(peer, p, now, &mut st.c);
            send(&peer.sock, p, &mut st.c);
        }
        TunnResult::Err(WireGuardError::ConnectionExpired) => {
            // The handshake gave up (REKEY_ATTEMPT_TIME) or the session is long dead; the next
            // ping starts a new one. Counted once per tick, so: per peer-tick while expired.
            st.c.error("connection_expired");
        }
        TunnResult::Err(e) => st.c.error(error_name(e)),
        _ => {}
    }
}

/// Sends the peer's next echo request on its current session, or, without one, starts a
/// handshake instead (a ping is never queued: its round trip would include the handshake).
fn ping(peer: &mut Peer, bufs: &mut Bufs, st: &mut State) {
    let now = sys::now_ns();
    match peer.tunn.reserve_send(1, ECHO_LEN) {
        Some(r) => {
            peer.seq = peer.seq.wrapping_add(1);
            icmp::build_echo(
                &mut bufs.ping,
                peer.addr,
                st.gateway_ip,
                peer.index,
                peer.seq,
                now,
            );
            let n = r.session.seal(r.first, &bufs.ping, &mut bufs.tx);
            send(&peer.sock, &bufs.tx[..n], &mut st.c);
            peer.pings += 1;
            st.c.pings_sent += 1;
            if let Some(w) = st.window.as_mut() {
                w.c.pings_sent += 1;
            }
        }
        None => {
            st.c.pings_unsent += 1;
            if let Some(w) = st.window.as_mut() {
                w.c.pings_unsent += 1;
            }
            if let TunnResult::WriteToNetwork(p) =
                peer.tunn.format_handshake_initiation(&mut bufs.tx, false)
            {
                note_sent(peer, p, now, &mut st.c);
                send(&peer.sock, p, &mut st.c);
            }
        }
    }
}

/// One datagram from the gateway, `arrived` (monotonic ns) by the kernel's stamp.
fn on_datagram(peer: &mut Peer, len: usize, arrived: u64, bufs: &mut Bufs, st: &mut State) {
    let now = sys::now_ns();
    st.c.datagrams_received += 1;
    let kind = bufs.rx[0];
    let (rx, tx) = (&bufs.rx[..len], &mut bufs.tx);
    match peer.tunn.decapsulate(Some(st.underlay_ip), rx, tx) {
        TunnResult::WriteToNetwork(p) => {
            send(&peer.sock, p, &mut st.c);
            match kind {
                2 => {
                    // Our initiation answered: the keepalive that confirms it went out.
                    st.c.hs_done += 1;
                    st.c.keepalives_sent += 1;
                    if peer.hs_started_ns != 0 {
                        st.hs_time.record((now - peer.hs_started_ns) / 1000);
                    }
                    st.handshake_done(peer, now);
                }
                1 => {
                    // The gateway initiated (a takeover, or its own rekey): we answered.
                    st.c.hs_answered += 1;
                    st.handshake_done(peer, now);
                }
                3 => st.c.cookies += 1,
                _ => {}
            }
            // Flush what the fork queued (keepalives without a session; pings are never queued).
            while let TunnResult::WriteToNetwork(p) = peer.tunn.decapsulate(None, &[], &mut bufs.tx)
            {
                note_sent(peer, p, now, &mut st.c);
                send(&peer.sock, p, &mut st.c);
            }
        }
        TunnResult::WriteToTunnelV4(packet, _src) => {
            if let Some(echo) = icmp::parse_echo_reply(packet, st.gateway_ip, peer.addr, peer.index)
            {
                // A stamp before the send can only be the clocks' offset moving (a step of the
                // real-time clock): then the time it was read.
                let t = if arrived >= echo.sent_ns {
                    arrived
                } else {
                    now
                };
                st.on_reply(peer, echo.sent_ns, t);
            }
        }
        TunnResult::WriteToTunnelV6(..) => {}
        TunnResult::Done => match kind {
            3 => st.c.cookies += 1,
            4 => st.c.keepalives_received += 1,
            _ => {}
        },
        TunnResult::Err(e) => st.c.error(error_name(e)),
    }
}

impl State {
    fn set_mark(&mut self, mark: u32, t: u64, peers: &mut [Peer]) {
        self.mark = mark;
        self.mark_t = t;
        self.mark_replied.clear();
        self.mark_handshaked.clear();
        self.mark_replied_last = 0;
        self.mark_handshaked_last = 0;
        for p in peers.iter_mut() {
            p.mark_replied = false;
            p.mark_handshaked = false;
        }
        if peers.is_empty() {
            self.mark_complete(true, 0);
            self.mark_complete(false, 0);
        }
    }

    fn mark_complete(&mut self, replied: bool, n: usize) {
        let (thread, mark) = (self.thread, self.mark);
        let msg = if replied {
            Msg::MarkReplied {
                thread,
                mark,
                last_ns: self.mark_replied_last,
                delays_us: std::mem::replace(&mut self.mark_replied, Vec::with_capacity(n)),
            }
        } else {
            Msg::MarkHandshaked {
                thread,
                mark,
                last_ns: self.mark_handshaked_last,
                delays_us: std::mem::replace(&mut self.mark_handshaked, Vec::with_capacity(n)),
            }
        };
        let _ = self.out.send(msg);
    }

    fn handshake_done(&mut self, peer: &mut Peer, now: u64) {
        peer.hs_started_ns = 0;
        peer.last_hs_ns = now;
        peer.handshakes += 1;
        if !peer.mark_handshaked && now >= self.mark_t {
            peer.mark_handshaked = true;
            self.mark_handshaked.push((now - self.mark_t) / 1000);
            self.mark_handshaked_last = now;
            if self.mark_handshaked.len() == self.n {
                self.mark_complete(false, self.n);
            }
        }
    }

    fn on_reply(&mut self, peer: &mut Peer, sent_ns: u64, now: u64) {
        if sent_ns > now {
            return;
        }
        let rtt_us = (now - sent_ns) / 1000;
        self.rtt.record(rtt_us);
        self.c.replies += 1;
        peer.replies += 1;
        peer.last_reply_ns = now;
        if let Some(w) = self.window.as_mut() {
            if sent_ns >= w.t {
                w.c.replies += 1;
                w.rtt.record(rtt_us);
            }
        }
        if !peer.mark_replied && sent_ns >= self.mark_t {
            peer.mark_replied = true;
            self.mark_replied.push((now - self.mark_t) / 1000);
            self.mark_replied_last = now;
            if self.mark_replied.len() == self.n {
                self.mark_complete(true, self.n);
            }
        }
    }

    fn command(&mut self, cmd: Cmd, peers: &mut [Peer], bufs: &mut Bufs) {
        match cmd {
            Cmd::Mark { mark, t } => self.set_mark(mark, t, peers),
            Cmd::Rekey { mark, t } => {
                self.set_mark(mark, t, peers);
                initiate_all(peers, bufs, self, "rekey");
            }
            Cmd::WindowStart { t } => {
                self.window = Some(Window {
                    t,
                    c: Counters::default(),
                    rtt: Histogram::default(),
                })
            }
            Cmd::WindowStop => {
                let w = self.window.take().unwrap_or(Window {
                    t: 0,
                    c: Counters::default(),
                    rtt: Histogram::default(),
                });
                let _ = self.out.send(Msg::Window {
                    thread: self.thread,
                    counters: Box::new(w.c),
                    rtt: Box::new(w.rtt),
                });
            }
            Cmd::Dump => {
                let lines = peers
                    .iter()
                    .map(|p| PeerLine {
                        index: p.index,
                        addr: p.addr,
                        port: match p.sock.local_addr() {
                            Ok(SocketAddr::V4(a)) => a.port(),
                            _ => 0,
                        },
                        last_reply_ns: p.last_reply_ns,
                        last_handshake_ns: p.last_hs_ns,
                        pings: p.pings,
                        replies: p.replies,
                        handshakes: p.handshakes,
                        session: p.tunn.time_since_last_handshake().is_some(),
                    })
                    .collect();
                let _ = self.out.send(Msg::Dump {
                    thread: self.thread,
                    peers: lines,
                });
            }
            Cmd::Start { .. } | Cmd::Quit => {}
        }
    }

    fn report(&mut self, interval: u64, peers: &[Peer], working_ns: u64, pinging: bool) {
        let now = sys::now_ns();
        let mut r = Box::new(Report {
            counters: std::mem::take(&mut self.c),
            rtt: std::mem::take(&mut self.rtt),
            hs_time: std::mem::take(&mut self.hs_time),
            peers: peers.len() as u64,
            mark: self.mark,
            mark_replied: self.mark_replied_count(peers),
            mark_handshaked: peers.iter().filter(|p| p.mark_handshaked).count() as u64,
            ..Report::default()
        });
        for p in peers {
            let session = p.tunn.time_since_last_handshake().is_some();
            if session {
                r.with_session += 1;
            }
            if p.last_reply_ns == 0 {
                r.never_replied += 1;
            } else {
                let age = now.saturating_sub(p.last_reply_ns);
                r.max_reply_age_ns = r.max_reply_age_ns.max(age);
                if pinging && age <= working_ns {
                    r.working += 1;
                }
            }
            if !pinging && session {
                r.working += 1;
            }
        }
        let _ = self.out.send(Msg::Stats {
            thread: self.thread,
            interval,
            report: r,
        });
    }

    fn mark_replied_count(&self, peers: &[Peer]) -> u64 {
        peers.iter().filter(|p| p.mark_replied).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_spreads_turns_evenly() {
        let mut s = Schedule::new(1_000, 100, 4);
        assert_eq!(s.next(999), None);
        assert_eq!(s.next(1_000), Some(0));
        assert_eq!(s.next(1_000), None);
        assert_eq!(s.next_due(), 1_025);
        assert_eq!(s.next(1_050), Some(1));
        assert_eq!(s.next(1_050), Some(2));
        assert_eq!(s.next(1_050), None);
        // A late wake-up catches up turn by turn, and peers come round again.
        let got: Vec<_> = std::iter::from_fn(|| s.next(1_200)).collect();
        assert_eq!(got, vec![3, 0, 1, 2, 3, 0]);
        assert_eq!(s.next_due(), 1_225);
    }

    #[test]
    fn every_error_is_counted_by_name() {
        use WireGuardError::*;
        let all = [
            DestinationBufferTooSmall,
            IncorrectPacketLength,
            UnexpectedPacket,
            WrongPacketType,
            WrongIndex,
            WrongKey,
            InvalidTai64nTimestamp,
            WrongTai64nTimestamp,
            InvalidMac,
            InvalidAeadTag,
            InvalidCounter,
            DuplicateCounter,
            InvalidPacket,
            NoCurrentSession,
            LockFailed,
            ConnectionExpired,
            UnderLoad,
        ];
        for e in all {
            let mut c = Counters::default();
            c.error(error_name(e));
            assert_eq!(c.errors.iter().sum::<u64>(), 1, "{e:?} has no counter");
        }
    }

    #[test]
    fn schedule_without_peers_or_period_never_fires() {
        let mut s = Schedule::new(0, 100, 0);
        assert_eq!(s.next(u64::MAX / 2), None);
        assert_eq!(s.next_due(), u64::MAX);
        let mut s = Schedule::new(0, 0, 5);
        assert_eq!(s.next(10), None);
        assert_eq!(s.next_due(), u64::MAX);
    }
}
