//! What to do with one packet, decided without I/O: a TUN segment is sent to a peer or dropped;
//! a datagram is delivered to the TUN device, answered (handshake, cookie) or dropped, and
//! tells whether the sender's endpoint roams. Also the one drop-reason vocabulary and its
//! counters, from the packet loops to `/metrics`.
//!
//! The shell (`shell::dataplane`) owns threads, batches, buffers and locks; it calls these per
//! packet, so they allocate nothing, take no lock and stay `#[inline]`.

use crate::config::{PublicKey, SecretKey};
use crate::wg::{self, Incoming, Limiter, Outcome, Session};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a packet was dropped. The order is the order of `/metrics` and of [`DropStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// From the TUN device to an address no peer's allowed IPs cover.
    NoPeer,
    /// To a peer that has no endpoint yet.
    NoEndpoint,
    /// Decrypted from a peer, but the inner source is outside that peer's allowed IPs.
    BadSource,
    /// Malformed, or failing decryption, authentication or replay checks.
    Invalid,
    /// A handshake or data message for a key or session index no peer has.
    UnknownPeer,
    /// A read from the TUN device that could not be split into IP packets.
    TunRead,
    /// Writing a decrypted packet to the TUN device failed.
    TunWrite,
    /// Sending an encrypted packet on the UDP socket failed.
    UdpSend,
    /// From the TUN device to a link-scoped multicast group no peer covers: the kernel's own
    /// link chatter on any interface with IPv6 (router solicitations to ff02::2, MLD reports to
    /// ff02::16, duplicate address detection to ff02::1:ff00:0/104), or IPv4's local network
    /// control block (224.0.0.0/24). Such a packet never leaves its link by definition (RFC
    /// 4291 2.7, RFC 5771 4), so no user traffic is lost: counted apart from `no_peer`, so an
    /// alert on user drops stays quiet on a healthy idle tunnel. Last, so earlier reasons keep
    /// their place in `/metrics` and [`DropStats`].
    LinkLocalMulticast,
    /// A full-size data message dropped before decryption by the receive queue's AQM
    /// ([`crate::aqm`]): the queue in front of the reader stood above its target, and one drop
    /// tells the bulk flow's sender to slow down. Deliberate, like a router's: counted apart
    /// from faults. Last, so earlier reasons keep their place.
    Aqm,
    /// A handshake message the packet readers could not hand to the handshake path: its queue
    /// was full (a flood; the kernel and wireguard-go drop there too). Last, so earlier
    /// reasons keep their place.
    HandshakeQueueFull,
    /// A handshake message whose source, under load, had already spent its share of
    /// handshakes (`core::handshake::SourceLimiter`), dropped before any Diffie-Hellman.
    HandshakeLimited,
}

impl DropReason {
    pub const COUNT: usize = 12;
    /// Every reason, in the fixed order (`ALL[r as usize] == r`).
    pub const ALL: [DropReason; DropReason::COUNT] = [
        DropReason::NoPeer,
        DropReason::NoEndpoint,
        DropReason::BadSource,
        DropReason::Invalid,
        DropReason::UnknownPeer,
        DropReason::TunRead,
        DropReason::TunWrite,
        DropReason::UdpSend,
        DropReason::LinkLocalMulticast,
        DropReason::Aqm,
        DropReason::HandshakeQueueFull,
        DropReason::HandshakeLimited,
    ];

    /// Whether a received datagram dropped for this reason had authenticated first, and so
    /// already counts in its peer's `rx_bytes` (an inner source outside the peer's allowed IPs).
    pub const fn after_authentication(self) -> bool {
        matches!(self, DropReason::BadSource)
    }

    /// The `reason` label in metrics and the field name in the status JSON.
    pub const fn label(self) -> &'static str {
        match self {
            DropReason::NoPeer => "no_peer",
            DropReason::NoEndpoint => "no_endpoint",
            DropReason::BadSource => "bad_source",
            DropReason::Invalid => "invalid",
            DropReason::UnknownPeer => "unknown_peer",
            DropReason::TunRead => "tun_read",
            DropReason::TunWrite => "tun_write",
            DropReason::UdpSend => "udp_send",
            DropReason::LinkLocalMulticast => "link_local_multicast",
            DropReason::Aqm => "aqm",
            DropReason::HandshakeQueueFull => "handshake_queue_full",
            DropReason::HandshakeLimited => "handshake_limited",
        }
    }
}

/// The live drop counters the packet loops bump: one relaxed atomic per [`DropReason`], and
/// the bytes of the received WireGuard datagrams among them.
#[derive(Debug, Default)]
pub struct DropCounters {
    packets: [AtomicU64; DropReason::COUNT],
    received_bytes: [AtomicU64; DropReason::COUNT],
}

impl DropCounters {
    #[inline]
    pub fn add(&self, reason: DropReason, packets: u64) {
        self.packets[reason as usize].fetch_add(packets, Ordering::Relaxed);
    }

    /// A received WireGuard datagram of `bytes` dropped before it counted as received (a
    /// peer's `rx_bytes` counts only what authenticated): with these, what crossed the wire
    /// adds up.
    #[inline]
    pub fn add_received(&self, reason: DropReason, bytes: usize) {
        self.add(reason, 1);
        self.received_bytes[reason as usize].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `packets` received WireGuard datagrams of `bytes` in all, dropped for one reason:
    /// [`DropCounters::add_received`] for a batch at once.
    #[inline]
    pub fn add_received_many(&self, reason: DropReason, packets: u64, bytes: u64) {
        self.add(reason, packets);
        self.received_bytes[reason as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// What `/metrics` and `tunnelgate status` show.
    pub fn snapshot(&self) -> DropStats {
        let mut stats = DropStats::default();
        for reason in DropReason::ALL {
            let i = reason as usize;
            *stats.count_mut(reason) = self.packets[i].load(Ordering::Relaxed);
            stats.received_bytes[i] = self.received_bytes[i].load(Ordering::Relaxed);
        }
        stats
    }
}

/// Packets dropped, by reason, at one moment. Each field name is the [`DropReason::label`]: the
/// `reason` label in metrics and the key in the status JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DropStats {
    pub no_peer: u64,
    pub no_endpoint: u64,
    pub bad_source: u64,
    pub invalid: u64,
    pub unknown_peer: u64,
    pub tun_read: u64,
    pub tun_write: u64,
    pub udp_send: u64,
    pub link_local_multicast: u64,
    pub aqm: u64,
    pub handshake_queue_full: u64,
    pub handshake_limited: u64,
    /// Bytes of received WireGuard datagrams dropped, by reason in [`DropReason::ALL`] order.
    pub received_bytes: [u64; DropReason::COUNT],
}

impl DropStats {
    pub fn count(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::NoPeer => self.no_peer,
            DropReason::NoEndpoint => self.no_endpoint,
            DropReason::BadSource => self.bad_source,
            DropReason::Invalid => self.invalid,
            DropReason::UnknownPeer => self.unknown_peer,
            DropReason::TunRead => self.tun_read,
            DropReason::TunWrite => self.tun_write,
            DropReason::UdpSend => self.udp_send,
            DropReason::LinkLocalMulticast => self.link_local_multicast,
            DropReason::Aqm => self.aqm,
            DropReason::HandshakeQueueFull => self.handshake_queue_full,
            DropReason::HandshakeLimited => self.handshake_limited,
        }
    }

    fn count_mut(&mut self, reason: DropReason) -> &mut u64 {
        match reason {
            DropReason::NoPeer => &mut self.no_peer,
            DropReason::NoEndpoint => &mut self.no_endpoint,
            DropReason::BadSource => &mut self.bad_source,
            DropReason::Invalid => &mut self.invalid,
            DropReason::UnknownPeer => &mut self.unknown_peer,
            DropReason::TunRead => &mut self.tun_read,
            DropReason::TunWrite => &mut self.tun_write,
            DropReason::UdpSend => &mut self.udp_send,
            DropReason::LinkLocalMulticast => &mut self.link_local_multicast,
            DropReason::Aqm => &mut self.aqm,
            DropReason::HandshakeQueueFull => &mut self.handshake_queue_full,
            DropReason::HandshakeLimited => &mut self.handshake_limited,
        }
    }

    /// `(reason, count)` for every reason, in the fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); DropReason::COUNT] {
        DropReason::ALL.map(|r| (r.label(), self.count(r)))
    }

    /// `(reason, bytes of received datagrams dropped)` for every reason, in the fixed order.
    pub fn received_bytes_by_reason(&self) -> [(&'static str, u64); DropReason::COUNT] {
        DropReason::ALL.map(|r| (r.label(), self.received_bytes[r as usize]))
    }
}

/// The peers as the decisions see them. The shell's peer table implements it; tests use a
/// small fake. `Peer` is whatever the shell keeps per peer (an `Arc`, an index).
pub trait PeerLookup {
    type Peer;
    /// The peer a handshake initiation from `key` belongs to.
    fn by_key(&self, key: &PublicKey) -> Option<&Self::Peer>;
    /// The peer whose local session index a response, cookie or data message names.
    fn by_index(&self, index: u32) -> Option<&Self::Peer>;
    /// The peer whose allowed IPs cover `addr` (longest prefix).
    fn by_address(&self, addr: IpAddr) -> Option<&Self::Peer>;
    /// Whether `a` and `b` are the same peer (not merely equal settings).
    fn same(a: &Self::Peer, b: &Self::Peer) -> bool;
}

/// The peer every segment of one TUN read goes to: segments of one read share their
/// destination, so this runs once per read. A read that is not an IP packet counts as a
/// TUN read drop.
#[inline]
pub fn route_read<'t, T: PeerLookup>(
    peers: &'t T,
    first_segment: &[u8],
) -> Result<&'t T::Peer, DropReason> {
    let dst = wg::packet_destination(first_segment).ok_or(DropReason::TunRead)?;
    peers.by_address(dst).ok_or_else(|| unroutable(dst))
}

/// Why a TUN packet to `dst` that no peer takes is dropped: link-scoped multicast is the
/// kernel's (or a link-local service's) chatter and stays on the link by definition; anything
/// else was meant to go somewhere ([`DropReason::NoPeer`]).
#[inline]
pub fn unroutable(dst: IpAddr) -> DropReason {
    if is_link_scoped_multicast(dst) {
        DropReason::LinkLocalMulticast
    } else {
        DropReason::NoPeer
    }
}

/// The reason for a TUN read the data plane cannot send at all (no private key yet, as a
/// `tunnelgate userspace` device before `wg setconf`): as [`unroutable`] for an IP packet.
#[inline]
pub fn unsendable_read(first_segment: &[u8]) -> DropReason {
    wg::packet_destination(first_segment).map_or(DropReason::TunRead, unroutable)
}

/// IPv6 multicast of interface- or link-local scope (ff01::/16, ff02::/16, and the reserved
/// scope 0), or IPv4's local network control block 224.0.0.0/24, which routers never forward.
#[inline]
pub fn is_link_scoped_multicast(dst: IpAddr) -> bool {
    match dst {
        IpAddr::V6(v6) => {
            let [first, flags_scope, ..] = v6.octets();
            first == 0xff && flags_scope & 0x0f <= 2
        }
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            (a, b, c) == (224, 0, 0)
        }
    }
}

/// How a peer is reached: its address, and the local address it last sent to. Replies leave
/// from that local address (`IP_PKTINFO` / `IPV6_PKTINFO`), as the kernel and wireguard-go do, so
/// a peer talking to one of several addresses of this host gets answers from the address it
/// expects and does not roam away. `local: None`: the kernel picks the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerPath {
    pub remote: SocketAddr,
    pub local: Option<IpAddr>,
}

impl PeerPath {
    /// A path whose source the kernel chooses (configured endpoints, `wg set endpoint`).
    pub fn to(remote: SocketAddr) -> PeerPath {
        PeerPath {
            remote,
            local: None,
        }
    }
}

/// Whether a send that named `local` as its source and failed with `errno` must be retried
/// with the kernel's choice of source: the address was removed from this host (or is no longer
/// usable): IPv6 reports `EINVAL`, IPv4 `ENETUNREACH` (no route from a source that is not
/// ours). The remembered source is then forgotten; should the route really be gone, the retry
/// fails too and nothing of value was forgotten (the peer's next datagram sets it again).
#[inline]
pub fn source_is_stale(errno: i32) -> bool {
    matches!(
        errno,
        libc::EINVAL | libc::EADDRNOTAVAIL | libc::ENETUNREACH
    )
}

/// Whether the timer must start a handshake now because the peer has persistent keepalive
/// (`keepalive`) and none was started for it yet (`started`). A peer that already has a
/// session (keepalive turned on with `wg set` on a live peer) keeps it: the kernel and
/// wireguard-go send a keepalive on that session, never a new handshake.
#[inline]
pub fn keepalive_handshake(keepalive: bool, started: bool, has_session: bool) -> bool {
    keepalive && !started && !has_session
}

/// What became of one TUN segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outbound {
    /// Send the first `len` bytes of the output buffer to `to` (data, or a handshake the
    /// segment started while it waits in the session's queue).
    Send {
        len: usize,
        to: PeerPath,
    },
    /// Nothing to send now (queued, or the session is expired and waiting).
    Nothing,
    Drop(DropReason),
}

/// Encrypts one segment for a peer whose endpoint is `endpoint` into `out`.
#[inline]
pub fn encapsulate(
    tunnel: &mut impl Session,
    endpoint: Option<PeerPath>,
    segment: &[u8],
    out: &mut [u8],
) -> Outbound {
    let len = match tunnel.encapsulate(segment, out) {
        Outcome::Network(m) => m.len(),
        _ => return Outbound::Nothing,
    };
    match endpoint {
        Some(to) => Outbound::Send { len, to },
        None => Outbound::Drop(DropReason::NoEndpoint),
    }
}

/// Who sent a datagram, before any session state is touched.
#[derive(Debug, PartialEq, Eq)]
pub enum Sender<'t, P> {
    Peer(&'t P),
    /// Under handshake load: send the first `len` bytes of the cookie buffer back.
    Cookie(usize),
}

/// The peer a datagram from `from` belongs to. Checks MACs before any Diffie-Hellman (see
/// [`wg::classify`]); `cookie_out` receives a cookie reply under load.
#[inline]
pub fn identify<'t, T: PeerLookup>(
    peers: &'t T,
    limiter: &Limiter,
    own_private: &SecretKey,
    own_public: &PublicKey,
    from: SocketAddr,
    datagram: &[u8],
    cookie_out: &mut [u8],
) -> Result<Sender<'t, T::Peer>, DropReason> {
    identify_charged(
        peers,
        limiter,
        own_private,
        own_public,
        from,
        datagram,
        cookie_out,
        |_| true,
    )
}

/// [`identify`] on the handshake path: `may_cost(proved)` says, before any Diffie-Hellman,
/// whether a handshake that passed its macs may cost one (see [`wg::classify_charged`]); a
/// refusal drops it as [`DropReason::HandshakeLimited`].
#[allow(clippy::too_many_arguments)]
pub fn identify_charged<'t, T: PeerLookup>(
    peers: &'t T,
    limiter: &Limiter,
    own_private: &SecretKey,
    own_public: &PublicKey,
    from: SocketAddr,
    datagram: &[u8],
    cookie_out: &mut [u8],
    may_cost: impl FnOnce(bool) -> bool,
) -> Result<Sender<'t, T::Peer>, DropReason> {
    let peer = match wg::classify_charged(
        limiter,
        own_private,
        own_public,
        from.ip(),
        datagram,
        cookie_out,
        may_cost,
    ) {
        Ok(Incoming::Initiation(key)) => peers.by_key(&key),
        Ok(Incoming::Index(index)) => peers.by_index(index),
        Ok(Incoming::Cookie(len)) => return Ok(Sender::Cookie(len)),
        Ok(Incoming::Limited) => return Err(DropReason::HandshakeLimited),
        Err(_) => return Err(DropReason::Invalid),
    };
    peer.map(Sender::Peer).ok_or(DropReason::UnknownPeer)
}

/// What to do with a datagram of a known peer after decryption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbound {
    /// Write the first `len` bytes of the landing buffer to the TUN device.
    Deliver(usize),
    /// Send the first `len` bytes of the landing buffer back to the sender (a handshake
    /// response), then flush the session's queue ([`Session::flush`]) to the same address.
    Reply(usize),
    /// Authenticated, nothing to deliver (a keepalive, a handshake response we asked for).
    Nothing,
    Drop(DropReason),
    /// A data message naming a session this side does not have, from a source the peer has
    /// no live session with: dropped (counted as [`DropReason::UnknownPeer`]), and a takeover
    /// was requested ([`crate::takeover`]): wake the thread that sends it.
    TakeOver,
}

/// The decision on one datagram of `peer`, and whether it proved to come from that peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    pub action: Inbound,
    /// The datagram passed the session's authentication: its sender may roam (see [`roam`]).
    /// True also for a bad inner source: the peer's key made it, as in the kernel.
    pub authenticated: bool,
}

/// Decrypts a datagram of `peer` (its `tunnel`, locked by the caller) into `landing` and checks
/// the inner source against the peer's allowed IPs.
#[inline]
pub fn decapsulate<T: PeerLookup>(
    peers: &T,
    peer: &T::Peer,
    tunnel: &mut impl Session,
    from: SocketAddr,
    datagram: &[u8],
    landing: &mut [u8],
) -> Received {
    let action = match tunnel.decapsulate(from.ip(), datagram, landing) {
        Outcome::Tunnel(packet, src) => inner_source(peers, peer, packet.len(), src),
        Outcome::Network(reply) => Inbound::Reply(reply.len()),
        Outcome::Done => Inbound::Nothing,
        Outcome::Error(_) => {
            return Received {
                action: Inbound::Drop(DropReason::Invalid),
                authenticated: false,
            }
        }
    };
    Received {
        action,
        authenticated: true,
    }
}

/// A decrypted packet of `len` bytes from `src` that `peer`'s session opened: delivered if
/// `src` is within the peer's allowed IPs.
#[inline]
fn inner_source<T: PeerLookup>(peers: &T, peer: &T::Peer, len: usize, src: IpAddr) -> Inbound {
    match peers.by_address(src) {
        _ if len == 0 => Inbound::Nothing,
        Some(owner) if T::same(owner, peer) => Inbound::Deliver(len),
        _ => Inbound::Drop(DropReason::BadSource),
    }
}

/// The decision on a data message of `peer` that its session opened outside the peer's lock
/// (`plaintext[..opened.len]`), recorded in `tunnel` (locked again by the caller) for the
/// timers. The same decision [`decapsulate`] makes on a message opened under the lock: an IP
/// packet from the peer's allowed IPs is delivered, a keepalive authenticates and delivers
/// nothing, a plaintext that is no IP packet is dropped as invalid.
#[inline]
pub fn opened<T: PeerLookup>(
    peers: &T,
    peer: &T::Peer,
    tunnel: &mut impl Session,
    opened: &wg::Opened,
    plaintext: &[u8],
) -> Received {
    match wg::inner_packet(&plaintext[..opened.len]) {
        Ok(wg::Inner::Packet { len, src }) => {
            tunnel.record_received(opened.session, Some(len));
            Received {
                action: inner_source(peers, peer, len, src),
                authenticated: true,
            }
        }
        Ok(wg::Inner::Keepalive) => {
            tunnel.record_received(opened.session, None);
            Received {
                action: Inbound::Nothing,
                authenticated: true,
            }
        }
        Err(_) => {
            // boringtun records it as received (it authenticated) but reports an error, which
            // neither counts nor roams: the same here.
            tunnel.record_received(opened.session, None);
            Received {
                action: Inbound::Drop(DropReason::Invalid),
                authenticated: false,
            }
        }
    }
}

/// The path to switch to after a datagram that came from `from.remote` to `from.local`: only an
/// authenticated datagram from a new address, or to a new local address, moves the peer
/// (WireGuard's roaming; the local address is where replies leave from). `None` = keep
/// `current`.
#[inline]
pub fn roam(current: Option<PeerPath>, from: PeerPath, authenticated: bool) -> Option<PeerPath> {
    (authenticated && current != Some(from)).then_some(from)
}

/// A data message's place in its sender's order: the generation of the session it came on (the
/// order this side established its sessions in) and its counter.
pub type Sequence = (u64, u64);

/// Whether a data message at `this` is newer than `newest`, the newest one a peer has seen
/// (`None`: none yet), and so may move its endpoint ([`roam`]): a later session, or a later
/// counter of the same one. Batches opened on several threads finish out of order: without
/// this, an older batch that finishes later would set the endpoint back to an address the peer
/// has left, also a late batch of a session the peer has since rekeyed away from.
#[inline]
pub fn newer(newest: Option<Sequence>, this: Sequence) -> bool {
    newest.is_none_or(|newest| this > newest)
}

pub mod steering;

#[cfg(test)]
mod tests;
