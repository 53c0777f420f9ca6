// Copyright (c) 2019 Cloudflare, Inc. All rights reserved.
// SPDX-License-Identifier: BSD-3-Clause

mod aead;
pub mod errors;
pub mod handshake;
pub mod rate_limiter;

pub mod session;
mod timers;

pub use session::{Opened, Session};

use crate::noise::errors::WireGuardError;
use crate::noise::handshake::Handshake;
use crate::noise::rate_limiter::RateLimiter;
use crate::noise::timers::{TimerName, Timers};
use crate::x25519;
use crate::Rng;

use std::collections::VecDeque;
use std::convert::{TryFrom, TryInto};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

/// The default value to use for rate limiting, when no other rate limiter is defined
const PEER_HANDSHAKE_RATE_LIMIT: u64 = 10;

const IPV4_MIN_HEADER_SIZE: usize = 20;
const IPV4_LEN_OFF: usize = 2;
const IPV4_SRC_IP_OFF: usize = 12;
const IPV4_DST_IP_OFF: usize = 16;
const IPV4_IP_SZ: usize = 4;

const IPV6_MIN_HEADER_SIZE: usize = 40;
const IPV6_LEN_OFF: usize = 4;
const IPV6_SRC_IP_OFF: usize = 8;
const IPV6_DST_IP_OFF: usize = 24;
const IPV6_IP_SZ: usize = 16;

const IP_LEN_SZ: usize = 2;

const MAX_QUEUE_DEPTH: usize = 256;
/// number of sessions in the ring, better keep a PoT
const N_SESSIONS: usize = 8;

#[derive(Debug)]
pub enum TunnResult<'a> {
    Done,
    Err(WireGuardError),
    WriteToNetwork(&'a mut [u8]),
    WriteToTunnelV4(&'a mut [u8], Ipv4Addr),
    WriteToTunnelV6(&'a mut [u8], Ipv6Addr),
}

impl<'a> From<WireGuardError> for TunnResult<'a> {
    fn from(err: WireGuardError) -> TunnResult<'a> {
        TunnResult::Err(err)
    }
}

/// Tunnel represents a point-to-point WireGuard connection
pub struct Tunn {
    /// The handshake currently in progress
    handshake: handshake::Handshake,
    /// The N_SESSIONS most recent sessions, index is session id modulo N_SESSIONS; shared with
    /// the threads sealing and opening on them
    sessions: [Option<Arc<session::Session>>; N_SESSIONS],
    /// Index of most recently used session
    current: usize,
    /// Queue to store blocked packets
    packet_queue: VecDeque<Vec<u8>>,
    /// Keeps tabs on the expiring timers
    timers: timers::Timers,
    tx_bytes: usize,
    rx_bytes: usize,
    rate_limiter: Arc<RateLimiter>,
    /// Ephemeral keys (and a rate limiter of its own, without a shared one) come from here
    rng: Rng,
    /// Sessions established so far: the next one's generation is one more.
    generations: u64,
}

/// Counters reserved on the current sending session by [`Tunn::reserve_send`]: seal message `i`
/// of the batch (`i < count`) with counter `first + i`, on any thread.
#[derive(Debug, Clone)]
pub struct Reserved {
    pub session: Arc<session::Session>,
    pub first: u64,
    pub count: u64,
}

/// A decrypted data message's content, checked: a keepalive, or an IP packet's length (from its
/// header) and source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inner {
    Keepalive,
    Packet(usize, IpAddr),
}

/// The receiver index of a data message (bytes 4..8; the caller checked its length).
fn packet_index(message: &[u8]) -> u32 {
    let mut index = [0u8; 4];
    index.copy_from_slice(&message[4..8]);
    u32::from_le_bytes(index)
}

type MessageType = u32;
const HANDSHAKE_INIT: MessageType = 1;
const HANDSHAKE_RESP: MessageType = 2;
const COOKIE_REPLY: MessageType = 3;
const DATA: MessageType = 4;

const HANDSHAKE_INIT_SZ: usize = 148;
const HANDSHAKE_RESP_SZ: usize = 92;
const COOKIE_REPLY_SZ: usize = 64;
const DATA_OVERHEAD_SZ: usize = 32;

#[derive(Debug)]
pub struct HandshakeInit<'a> {
    sender_idx: u32,
    unencrypted_ephemeral: &'a [u8; 32],
    encrypted_static: &'a [u8],
    encrypted_timestamp: &'a [u8],
}

#[derive(Debug)]
pub struct HandshakeResponse<'a> {
    sender_idx: u32,
    pub receiver_idx: u32,
    unencrypted_ephemeral: &'a [u8; 32],
    encrypted_nothing: &'a [u8],
}

#[derive(Debug)]
pub struct PacketCookieReply<'a> {
    pub receiver_idx: u32,
    nonce: &'a [u8],
    encrypted_cookie: &'a [u8],
}

#[derive(Debug)]
pub struct PacketData<'a> {
    pub receiver_idx: u32,
    pub counter: u64,
    pub encrypted_encapsulated_packet: &'a [u8],
}

/// Describes a packet from network
#[derive(Debug)]
pub enum Packet<'a> {
    HandshakeInit(HandshakeInit<'a>),
    HandshakeResponse(HandshakeResponse<'a>),
    PacketCookieReply(PacketCookieReply<'a>),
    PacketData(PacketData<'a>),
}

impl Tunn {
    #[inline(always)]
    pub fn parse_incoming_packet(src: &[u8]) -> Result<Packet<'_>, WireGuardError> {
        if src.len() < 4 {
            return Err(WireGuardError::InvalidPacket);
        }

        // Checks the type, as well as the reserved zero fields
        let packet_type = u32::from_le_bytes(src[0..4].try_into().unwrap());

        Ok(match (packet_type, src.len()) {
            (HANDSHAKE_INIT, HANDSHAKE_INIT_SZ) => Packet::HandshakeInit(HandshakeInit {
                sender_idx: u32::from_le_bytes(src[4..8].try_into().unwrap()),
                unencrypted_ephemeral: <&[u8; 32] as TryFrom<&[u8]>>::try_from(&src[8..40])
                    .expect("length already checked above"),
                encrypted_static: &src[40..88],
                encrypted_timestamp: &src[88..116],
            }),
            (HANDSHAKE_RESP, HANDSHAKE_RESP_SZ) => Packet::HandshakeResponse(HandshakeResponse {
                sender_idx: u32::from_le_bytes(src[4..8].try_into().unwrap()),
                receiver_idx: u32::from_le_bytes(src[8..12].try_into().unwrap()),
                unencrypted_ephemeral: <&[u8; 32] as TryFrom<&[u8]>>::try_from(&src[12..44])
                    .expect("length already checked above"),
                encrypted_nothing: &src[44..60],
            }),
            (COOKIE_REPLY, COOKIE_REPLY_SZ) => Packet::PacketCookieReply(PacketCookieReply {
                receiver_idx: u32::from_le_bytes(src[4..8].try_into().unwrap()),
                nonce: &src[8..32],
                encrypted_cookie: &src[32..64],
            }),
            (DATA, DATA_OVERHEAD_SZ..=std::usize::MAX) => Packet::PacketData(PacketData {
                receiver_idx: u32::from_le_bytes(src[4..8].try_into().unwrap()),
                counter: u64::from_le_bytes(src[8..16].try_into().unwrap()),
                encrypted_encapsulated_packet: &src[16..],
            }),
            _ => return Err(WireGuardError::InvalidPacket),
        })
    }

    pub fn is_expired(&self) -> bool {
        self.handshake.is_expired()
    }

    pub fn dst_address(packet: &[u8]) -> Option<IpAddr> {
        if packet.is_empty() {
            return None;
        }

        match packet[0] >> 4 {
            4 if packet.len() >= IPV4_MIN_HEADER_SIZE => {
                let addr_bytes: [u8; IPV4_IP_SZ] = packet
                    [IPV4_DST_IP_OFF..IPV4_DST_IP_OFF + IPV4_IP_SZ]
                    .try_into()
                    .unwrap();
                Some(IpAddr::from(addr_bytes))
            }
            6 if packet.len() >= IPV6_MIN_HEADER_SIZE => {
                let addr_bytes: [u8; IPV6_IP_SZ] = packet
                    [IPV6_DST_IP_OFF..IPV6_DST_IP_OFF + IPV6_IP_SZ]
                    .try_into()
                    .unwrap();
                Some(IpAddr::from(addr_bytes))
            }
            _ => None,
        }
    }

    /// Create a new tunnel using own private key and the peer public key
    pub fn new(
        static_private: x25519::StaticSecret,
        peer_static_public: x25519::PublicKey,
        preshared_key: Option<[u8; 32]>,
        persistent_keepalive: Option<u16>,
        index: u32,
        rate_limiter: Option<Arc<RateLimiter>>,
        mut rng: Rng,
    ) -> Self {
        let static_public = x25519::PublicKey::from(&static_private);
        let rate_limiter = rate_limiter.map_or_else(
            || {
                (
                    true,
                    Arc::new(RateLimiter::new(
                        &static_public,
                        PEER_HANDSHAKE_RATE_LIMIT,
                        &mut *rng,
                    )),
                )
            },
            |shared| (false, shared),
        );

        // The session part (the low byte) starts at a random value: two processes that give a
        // peer the same 24-bit index (the caller's) then give its sessions different indices,
        // so a session one of them established is never mistaken for the other's.
        let start = rand_core::RngCore::next_u32(&mut *rng) & 0xff;
        Tunn {
            handshake: Handshake::new(
                static_private,
                static_public,
                peer_static_public,
                (index << 8) | start,
                preshared_key,
            ),
            sessions: Default::default(),
            current: Default::default(),
            tx_bytes: Default::default(),
            rx_bytes: Default::default(),

            packet_queue: VecDeque::new(),
            timers: Timers::new(persistent_keepalive, rate_limiter.0),

            rate_limiter: rate_limiter.1,
            rng,
            generations: 0,
        }
    }

    /// The generation of the session being established now.
    fn next_generation(&mut self) -> u64 {
        self.generations += 1;
        self.generations
    }

    /// Update the private key and clear existing sessions
    pub fn set_static_private(
        &mut self,
        static_private: x25519::StaticSecret,
        static_public: x25519::PublicKey,
        rate_limiter: Option<Arc<RateLimiter>>,
    ) {
        self.timers.should_reset_rr = rate_limiter.is_none();
        let rng = &mut *self.rng;
        self.rate_limiter = rate_limiter.unwrap_or_else(|| {
            Arc::new(RateLimiter::new(
                &static_public,
                PEER_HANDSHAKE_RATE_LIMIT,
                rng,
            ))
        });
        self.handshake
            .set_static_private(static_private, static_public);
        for s in &mut self.sessions {
            *s = None;
        }
    }

    /// Encapsulate a single packet from the tunnel interface.
    /// Returns TunnResult.
    ///
    /// # Panics
    /// Panics if dst buffer is too small.
    /// Size of dst should be at least src.len() + 32, and no less than 148 bytes.
    pub fn encapsulate<'a>(&mut self, src: &[u8], dst: &'a mut [u8]) -> TunnResult<'a> {
        if let Some(reserved) = self.reserve_send(1, src.len()) {
            // Send the packet using an established session
            let n = reserved.session.seal(reserved.first, src, dst);
            return TunnResult::WriteToNetwork(&mut dst[..n]);
        }

        // If there is no session (or it is worn out), queue the packet for future retry
        self.queue_packet(src);
        // Initiate a new handshake if none is in progress
        self.format_handshake_initiation(dst, false)
    }

    /// The current sending session with `count` counters reserved for `count` messages carrying
    /// `bytes` of plaintext in all (0: keepalives), recorded for the timers as sent now.
    /// `None` without a usable session (none yet, or its counters are spent): then
    /// [`Tunn::encapsulate`] queues the packets and starts a handshake.
    pub fn reserve_send(&mut self, count: u64, bytes: usize) -> Option<Reserved> {
        let session = self.sessions[self.current % N_SESSIONS].as_ref()?;
        let first = session.reserve(count)?;
        let session = Arc::clone(session);
        self.timer_tick(TimerName::TimeLastPacketSent);
        // Exclude Keepalive packets from timer update.
        if bytes > 0 {
            self.timer_tick(TimerName::TimeLastDataPacketSent);
        }
        self.tx_bytes += bytes;
        Some(Reserved {
            session,
            first,
            count,
        })
    }

    /// The session a data message names by its receiver index, if it is one of ours still
    /// kept (not retired by a newer handshake or by expiry). Opening it is the caller's:
    /// outside any lock, then [`Tunn::record_received`].
    pub fn receiving_session(&self, message: &[u8]) -> Option<Arc<session::Session>> {
        let header = session::data_header(message).ok()?;
        let r_idx = header.receiver_idx as usize;
        self.sessions[r_idx % N_SESSIONS]
            .as_ref()
            .filter(|s| s.receiving_index == header.receiver_idx)
            .cloned()
    }

    /// Records for the timers a data message that `session_index`'s session opened: its
    /// plaintext, checked by [`Tunn::inner_packet`], was a keepalive (`None`) or an IP packet of
    /// `Some(len)` bytes. A message whose plaintext is no IP packet is recorded with `None` too:
    /// it authenticated (as upstream's `decapsulate` records it).
    pub fn record_received(&mut self, session_index: u32, data_bytes: Option<usize>) {
        self.set_current_session(session_index as usize);
        self.timer_tick(TimerName::TimeLastPacketReceived);
        if let Some(len) = data_bytes {
            self.timer_tick(TimerName::TimeLastDataPacketReceived);
            self.rx_bytes += len;
        }
    }

    /// What a decrypted data message holds: a keepalive, or an IPv4 or IPv6 packet whose header
    /// gives a length within the plaintext (the packet is its first `len` bytes; the rest is
    /// padding). `Err` for anything else.
    pub fn inner_packet(plaintext: &[u8]) -> Result<Inner, WireGuardError> {
        let (computed_len, src_ip_address) = match plaintext.len() {
            0 => return Ok(Inner::Keepalive),
            _ if plaintext[0] >> 4 == 4 && plaintext.len() >= IPV4_MIN_HEADER_SIZE => {
                let len_bytes: [u8; IP_LEN_SZ] = plaintext[IPV4_LEN_OFF..IPV4_LEN_OFF + IP_LEN_SZ]
                    .try_into()
                    .unwrap();
                let addr_bytes: [u8; IPV4_IP_SZ] = plaintext
                    [IPV4_SRC_IP_OFF..IPV4_SRC_IP_OFF + IPV4_IP_SZ]
                    .try_into()
                    .unwrap();
                (
                    u16::from_be_bytes(len_bytes) as usize,
                    IpAddr::from(addr_bytes),
                )
            }
            _ if plaintext[0] >> 4 == 6 && plaintext.len() >= IPV6_MIN_HEADER_SIZE => {
                let len_bytes: [u8; IP_LEN_SZ] = plaintext[IPV6_LEN_OFF..IPV6_LEN_OFF + IP_LEN_SZ]
                    .try_into()
                    .unwrap();
                let addr_bytes: [u8; IPV6_IP_SZ] = plaintext
                    [IPV6_SRC_IP_OFF..IPV6_SRC_IP_OFF + IPV6_IP_SZ]
                    .try_into()
                    .unwrap();
                (
                    u16::from_be_bytes(len_bytes) as usize + IPV6_MIN_HEADER_SIZE,
                    IpAddr::from(addr_bytes),
                )
            }
            _ => return Err(WireGuardError::InvalidPacket),
        };

        if computed_len > plaintext.len() {
            return Err(WireGuardError::InvalidPacket);
        }
        Ok(Inner::Packet(computed_len, src_ip_address))
    }

    /// Receives a UDP datagram from the network and parses it.
    /// Returns TunnResult.
    ///
    /// If the result is of type TunnResult::WriteToNetwork, should repeat the call with empty datagram,
    /// until TunnResult::Done is returned. If batch processing packets, it is OK to defer until last
    /// packet is processed.
    pub fn decapsulate<'a>(
        &mut self,
        src_addr: Option<IpAddr>,
        datagram: &[u8],
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        if datagram.is_empty() {
            // Indicates a repeated call
            return self.send_queued_packet(dst);
        }

        let mut cookie = [0u8; COOKIE_REPLY_SZ];
        let packet = match self
            .rate_limiter
            .verify_packet(src_addr, datagram, &mut cookie)
        {
            Ok(packet) => packet,
            Err(TunnResult::WriteToNetwork(cookie)) => {
                dst[..cookie.len()].copy_from_slice(cookie);
                return TunnResult::WriteToNetwork(&mut dst[..cookie.len()]);
            }
            Err(TunnResult::Err(e)) => return TunnResult::Err(e),
            _ => unreachable!(),
        };

        self.handle_verified_packet(packet, datagram, dst)
    }

    pub(crate) fn handle_verified_packet<'a>(
        &mut self,
        packet: Packet,
        datagram: &[u8],
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        match packet {
            Packet::HandshakeInit(p) => self.handle_handshake_init(p, dst),
            Packet::HandshakeResponse(p) => self.handle_handshake_response(p, dst),
            Packet::PacketCookieReply(p) => self.handle_cookie_reply(p),
            Packet::PacketData(_) => self.handle_data(datagram, dst),
        }
        .unwrap_or_else(TunnResult::from)
    }

    fn handle_handshake_init<'a>(
        &mut self,
        p: HandshakeInit,
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, WireGuardError> {
        tracing::debug!(
            message = "Received handshake_initiation",
            remote_idx = p.sender_idx
        );

        let (packet, session) =
            self.handshake
                .receive_handshake_initialization(p, dst, &mut *self.rng)?;

        // Store new session in ring buffer
        let index = session.local_index();
        let session = session.with_generation(self.next_generation());
        self.sessions[index % N_SESSIONS] = Some(Arc::new(session));

        self.timer_tick(TimerName::TimeLastPacketReceived);
        self.timer_tick(TimerName::TimeLastPacketSent);
        self.timer_tick_session_established(false, index); // New session established, we are not the initiator

        tracing::debug!(message = "Sending handshake_response", local_idx = index);

        Ok(TunnResult::WriteToNetwork(packet))
    }

    fn handle_handshake_response<'a>(
        &mut self,
        p: HandshakeResponse,
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, WireGuardError> {
        tracing::debug!(
            message = "Received handshake_response",
            local_idx = p.receiver_idx,
            remote_idx = p.sender_idx
        );

        let session = self.handshake.receive_handshake_response(p)?;

        // A fresh session: counter 0 is free.
        let counter = session.reserve(1).ok_or(WireGuardError::InvalidCounter)?;
        let keepalive_len = session.seal(counter, &[], dst);
        let keepalive_packet = &mut dst[..keepalive_len];
        // Store new session in ring buffer
        let l_idx = session.local_index();
        let index = l_idx % N_SESSIONS;
        let session = session.with_generation(self.next_generation());
        self.sessions[index] = Some(Arc::new(session));

        self.timer_tick(TimerName::TimeLastPacketReceived);
        self.timer_tick_session_established(true, index); // New session established, we are the initiator
        self.set_current_session(l_idx);

        tracing::debug!("Sending keepalive");

        Ok(TunnResult::WriteToNetwork(keepalive_packet)) // Send a keepalive as a response
    }

    fn handle_cookie_reply<'a>(
        &mut self,
        p: PacketCookieReply,
    ) -> Result<TunnResult<'a>, WireGuardError> {
        tracing::debug!(
            message = "Received cookie_reply",
            local_idx = p.receiver_idx
        );

        self.handshake.receive_cookie_reply(p)?;
        self.timer_tick(TimerName::TimeLastPacketReceived);
        self.timer_tick(TimerName::TimeCookieReceived);

        tracing::debug!("Did set cookie");

        Ok(TunnResult::Done)
    }

    /// Update the index of the currently used session, if needed
    fn set_current_session(&mut self, new_idx: usize) {
        let cur_idx = self.current;
        if cur_idx == new_idx {
            // There is nothing to do, already using this session, this is the common case
            return;
        }
        if self.sessions[cur_idx % N_SESSIONS].is_none()
            || self.timers.session_timers[new_idx % N_SESSIONS]
                >= self.timers.session_timers[cur_idx % N_SESSIONS]
        {
            self.current = new_idx;
            tracing::debug!(message = "New session", session = new_idx);
        }
    }

    /// Decrypts a data packet, and stores the decapsulated packet in dst.
    fn handle_data<'a>(
        &mut self,
        packet: &[u8],
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, WireGuardError> {
        let r_idx = packet_index(packet) as usize;
        let idx = r_idx % N_SESSIONS;

        // Get the (probably) right session
        let opened = {
            let session = self.sessions[idx].as_ref();
            let session = session.ok_or_else(|| {
                tracing::trace!(message = "No current session available", remote_idx = r_idx);
                WireGuardError::NoCurrentSession
            })?;
            session.open(packet, dst)?
        };
        let plaintext = &mut dst[..opened.len];
        match Self::inner_packet(plaintext) {
            Ok(Inner::Keepalive) => {
                self.record_received(packet_index(packet), None);
                Ok(TunnResult::Done) // This is keepalive, and not an error
            }
            Ok(Inner::Packet(len, src)) => {
                self.record_received(packet_index(packet), Some(len));
                Ok(match src {
                    IpAddr::V4(addr) => TunnResult::WriteToTunnelV4(&mut plaintext[..len], addr),
                    IpAddr::V6(addr) => TunnResult::WriteToTunnelV6(&mut plaintext[..len], addr),
                })
            }
            Err(e) => {
                self.record_received(packet_index(packet), None);
                Err(e)
            }
        }
    }

    /// Formats a new handshake initiation message and store it in dst. If force_resend is true will send
    /// a new handshake, even if a handshake is already in progress (for example when a handshake times out)
    pub fn format_handshake_initiation<'a>(
        &mut self,
        dst: &'a mut [u8],
        force_resend: bool,
    ) -> TunnResult<'a> {
        if self.handshake.is_in_progress() && !force_resend {
            return TunnResult::Done;
        }

        if self.handshake.is_expired() {
            self.timers.clear();
        }

        let starting_new_handshake = !self.handshake.is_in_progress();

        match self
            .handshake
            .format_handshake_initiation(dst, &mut *self.rng)
        {
            Ok(packet) => {
                tracing::debug!("Sending handshake_initiation");

                if starting_new_handshake {
                    self.timer_tick(TimerName::TimeLastHandshakeStarted);
                }
                self.timer_tick(TimerName::TimeLastPacketSent);
                TunnResult::WriteToNetwork(packet)
            }
            Err(e) => TunnResult::Err(e),
        }
    }

    /// Get a packet from the queue, and try to encapsulate it
    fn send_queued_packet<'a>(&mut self, dst: &'a mut [u8]) -> TunnResult<'a> {
        if let Some(packet) = self.dequeue_packet() {
            match self.encapsulate(&packet, dst) {
                TunnResult::Err(_) => {
                    // On error, return packet to the queue
                    self.requeue_packet(packet);
                }
                r => return r,
            }
        }
        TunnResult::Done
    }

    /// Push packet to the back of the queue
    fn queue_packet(&mut self, packet: &[u8]) {
        if self.packet_queue.len() < MAX_QUEUE_DEPTH {
            // Drop if too many are already in queue
            self.packet_queue.push_back(packet.to_vec());
        }
    }

    /// Push packet to the front of the queue
    fn requeue_packet(&mut self, packet: Vec<u8>) {
        if self.packet_queue.len() < MAX_QUEUE_DEPTH {
            // Drop if too many are already in queue
            self.packet_queue.push_front(packet);
        }
    }

    fn dequeue_packet(&mut self) -> Option<Vec<u8>> {
        self.packet_queue.pop_front()
    }

    fn estimate_loss(&self) -> f32 {
        let session_idx = self.current;

        let mut weight = 9.0;
        let mut cur_avg = 0.0;
        let mut total_weight = 0.0;

        for i in 0..N_SESSIONS {
            if let Some(ref session) = self.sessions[(session_idx.wrapping_sub(i)) % N_SESSIONS] {
                let (expected, received) = session.current_packet_cnt();

                let loss = if expected == 0 {
                    0.0
                } else {
                    1.0 - received as f32 / expected as f32
                };

                cur_avg += loss * weight;
                total_weight += weight;
                weight /= 3.0;
            }
        }

        if total_weight == 0.0 {
            0.0
        } else {
            cur_avg / total_weight
        }
    }

    /// Return stats from the tunnel:
    /// * Time since last handshake in seconds
    /// * Data bytes sent
    /// * Data bytes received
    pub fn stats(&self) -> (Option<Duration>, usize, usize, f32, Option<u32>) {
        let time = self.time_since_last_handshake();
        let tx_bytes = self.tx_bytes;
        let rx_bytes = self.rx_bytes;
        let loss = self.estimate_loss();
        let rtt = self.handshake.last_rtt;

        (time, tx_bytes, rx_bytes, loss, rtt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::{OsRng, RngCore};

    fn create_two_tuns() -> (Tunn, Tunn) {
        let my_secret_key = x25519_dalek::StaticSecret::random_from_rng(OsRng);
        let my_public_key = x25519_dalek::PublicKey::from(&my_secret_key);
        let my_idx = OsRng.next_u32();

        let their_secret_key = x25519_dalek::StaticSecret::random_from_rng(OsRng);
        let their_public_key = x25519_dalek::PublicKey::from(&their_secret_key);
        let their_idx = OsRng.next_u32();

        let my_tun = Tunn::new(
            my_secret_key,
            their_public_key,
            None,
            None,
            my_idx,
            None,
            Box::new(OsRng),
        );

        let their_tun = Tunn::new(
            their_secret_key,
            my_public_key,
            None,
            None,
            their_idx,
            None,
            Box::new(OsRng),
        );

        (my_tun, their_tun)
    }

    /// Randomness whose first word is fixed (the session byte's start), then the OS's.
    struct FirstWord(Option<u32>);

    impl RngCore for FirstWord {
        fn next_u32(&mut self) -> u32 {
            self.0.take().unwrap_or_else(|| OsRng.next_u32())
        }
        fn next_u64(&mut self) -> u64 {
            OsRng.next_u64()
        }
        fn fill_bytes(&mut self, dest: &mut [u8]) {
            OsRng.fill_bytes(dest)
        }
        fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand_core::Error> {
            OsRng.try_fill_bytes(dest)
        }
    }

    impl rand_core::CryptoRng for FirstWord {}

    /// Two processes that give a peer the same index (a restarted one, another replica) start
    /// its sessions' byte apart, so one never takes the other's session for its own; the peer
    /// part stays the caller's.
    #[test]
    fn the_session_byte_starts_at_random_and_the_peer_part_is_kept() {
        let their = x25519_dalek::StaticSecret::random_from_rng(OsRng);
        let their_public = x25519_dalek::PublicKey::from(&their);
        let first_sender_index = |first_word: u32| {
            let mine = x25519_dalek::StaticSecret::random_from_rng(OsRng);
            let mut tun = Tunn::new(
                mine,
                their_public,
                None,
                None,
                0xab_cdef,
                None,
                Box::new(FirstWord(Some(first_word))),
            );
            let init = create_handshake_init(&mut tun);
            u32::from_le_bytes([init[4], init[5], init[6], init[7]])
        };
        let (a, b) = (first_sender_index(0x10), first_sender_index(0x7f));
        assert_eq!((a >> 8, b >> 8), (0xab_cdef, 0xab_cdef));
        assert_eq!((a & 0xff, b & 0xff), (0x11, 0x80), "the start, plus one");
    }

    fn create_handshake_init(tun: &mut Tunn) -> Vec<u8> {
        let mut dst = vec![0u8; 2048];
        let handshake_init = tun.format_handshake_initiation(&mut dst, false);
        assert!(matches!(handshake_init, TunnResult::WriteToNetwork(_)));
        let handshake_init = if let TunnResult::WriteToNetwork(sent) = handshake_init {
            sent
        } else {
            unreachable!();
        };

        handshake_init.into()
    }

    fn create_handshake_response(tun: &mut Tunn, handshake_init: &[u8]) -> Vec<u8> {
        let mut dst = vec![0u8; 2048];
        let handshake_resp = tun.decapsulate(None, handshake_init, &mut dst);
        assert!(matches!(handshake_resp, TunnResult::WriteToNetwork(_)));

        let handshake_resp = if let TunnResult::WriteToNetwork(sent) = handshake_resp {
            sent
        } else {
            unreachable!();
        };

        handshake_resp.into()
    }

    fn parse_handshake_resp(tun: &mut Tunn, handshake_resp: &[u8]) -> Vec<u8> {
        let mut dst = vec![0u8; 2048];
        let keepalive = tun.decapsulate(None, handshake_resp, &mut dst);
        assert!(matches!(keepalive, TunnResult::WriteToNetwork(_)));

        let keepalive = if let TunnResult::WriteToNetwork(sent) = keepalive {
            sent
        } else {
            unreachable!();
        };

        keepalive.into()
    }

    fn parse_keepalive(tun: &mut Tunn, keepalive: &[u8]) {
        let mut dst = vec![0u8; 2048];
        let keepalive = tun.decapsulate(None, keepalive, &mut dst);
        assert!(matches!(keepalive, TunnResult::Done));
    }

    fn create_two_tuns_and_handshake() -> (Tunn, Tunn) {
        let (mut my_tun, mut their_tun) = create_two_tuns();
        let init = create_handshake_init(&mut my_tun);
        let resp = create_handshake_response(&mut their_tun, &init);
        let keepalive = parse_handshake_resp(&mut my_tun, &resp);
        parse_keepalive(&mut their_tun, &keepalive);

        (my_tun, their_tun)
    }

    fn create_ipv4_udp_packet() -> Vec<u8> {
        // IPv4 (no options), UDP 5678 -> 23 from 192.168.1.2 to 192.168.1.3, payload 0 1 2 3;
        // checksums are not looked at.
        let mut packet = vec![0u8; 20 + 8 + 4];
        packet[0] = 0x45;
        packet[2..4].copy_from_slice(&32u16.to_be_bytes());
        packet[8] = 5;
        packet[9] = 17;
        packet[12..16].copy_from_slice(&[192, 168, 1, 2]);
        packet[16..20].copy_from_slice(&[192, 168, 1, 3]);
        packet[20..22].copy_from_slice(&5678u16.to_be_bytes());
        packet[22..24].copy_from_slice(&23u16.to_be_bytes());
        packet[24..26].copy_from_slice(&12u16.to_be_bytes());
        packet[28..32].copy_from_slice(&[0, 1, 2, 3]);
        packet
    }

    #[test]
    fn reserved_counters_seal_outside_the_tunnel_and_open_by_index() {
        let (mut my_tun, mut their_tun) = create_two_tuns_and_handshake();
        let packet = create_ipv4_udp_packet();
        let reserved = my_tun.reserve_send(3, 3 * packet.len()).expect("a session");
        assert_eq!(reserved.count, 3);
        // Sealed in reverse order on the shared session, in place.
        let mut messages: Vec<Vec<u8>> = (0..3)
            .rev()
            .map(|i| {
                let mut m = vec![0u8; packet.len() + 32];
                m[16..16 + packet.len()].copy_from_slice(&packet);
                let n = reserved
                    .session
                    .seal_in_place(reserved.first + i, &mut m, packet.len());
                m.truncate(n);
                m
            })
            .collect();
        for message in &mut messages {
            let session = their_tun.receiving_session(message).expect("known index");
            let opened = session.open_in_place(message).expect("authentic");
            let plain = &message[16..16 + opened.len];
            let Ok(Inner::Packet(len, src)) = Tunn::inner_packet(plain) else {
                panic!("an IPv4 packet");
            };
            assert_eq!(
                (&plain[..len], src),
                (&packet[..], "192.168.1.2".parse().unwrap())
            );
            their_tun.record_received(session.receiving_index(), Some(len));
        }
        // A message naming an index we never gave out finds no session.
        let mut stranger = messages[0].clone();
        stranger[4..8].copy_from_slice(&0xdead_beefu32.to_le_bytes());
        assert!(their_tun.receiving_session(&stranger).is_none());
        assert!(
            their_tun.receiving_session(&[4, 0, 0, 0]).is_none(),
            "too short"
        );
    }

    #[test]
    fn a_session_past_rekey_after_messages_asks_for_a_handshake_and_a_spent_one_queues() {
        let (mut my_tun, _their_tun) = create_two_tuns_and_handshake();
        let mut dst = vec![0u8; 2048];
        assert!(matches!(my_tun.update_timers(&mut dst), TunnResult::Done));
        let session = my_tun.sessions[my_tun.current % N_SESSIONS]
            .clone()
            .expect("current session");
        session.set_sending_counter_for_test(session::REKEY_AFTER_MESSAGES);
        let TunnResult::WriteToNetwork(init) = my_tun.update_timers(&mut dst) else {
            panic!("a rekey");
        };
        assert!(matches!(
            Tunn::parse_incoming_packet(init),
            Ok(Packet::HandshakeInit(_))
        ));
        // Spent: nothing more is sealed on it; the packet waits for the new session.
        session.set_sending_counter_for_test(session::REJECT_AFTER_MESSAGES);
        assert!(my_tun.reserve_send(1, 10).is_none());
        let queued = my_tun.packet_queue.len();
        let _ = my_tun.encapsulate(&create_ipv4_udp_packet(), &mut dst);
        assert_eq!(my_tun.packet_queue.len(), queued + 1);
    }

    #[test]
    fn create_two_tunnels_linked_to_eachother() {
        let (_my_tun, _their_tun) = create_two_tuns();
    }

    #[test]
    fn handshake_init() {
        let (mut my_tun, _their_tun) = create_two_tuns();
        let init = create_handshake_init(&mut my_tun);
        let packet = Tunn::parse_incoming_packet(&init).unwrap();
        assert!(matches!(packet, Packet::HandshakeInit(_)));
    }

    #[test]
    fn handshake_init_and_response() {
        let (mut my_tun, mut their_tun) = create_two_tuns();
        let init = create_handshake_init(&mut my_tun);
        let resp = create_handshake_response(&mut their_tun, &init);
        let packet = Tunn::parse_incoming_packet(&resp).unwrap();
        assert!(matches!(packet, Packet::HandshakeResponse(_)));
    }

    #[test]
    fn full_handshake() {
        let (mut my_tun, mut their_tun) = create_two_tuns();
        let init = create_handshake_init(&mut my_tun);
        let resp = create_handshake_response(&mut their_tun, &init);
        let keepalive = parse_handshake_resp(&mut my_tun, &resp);
        let packet = Tunn::parse_incoming_packet(&keepalive).unwrap();
        assert!(matches!(packet, Packet::PacketData(_)));
    }

    #[test]
    fn full_handshake_plus_timers() {
        let (mut my_tun, mut their_tun) = create_two_tuns_and_handshake();
        // Time has not yet advanced so their is nothing to do
        assert!(matches!(my_tun.update_timers(&mut []), TunnResult::Done));
        assert!(matches!(their_tun.update_timers(&mut []), TunnResult::Done));
    }

    #[test]
    fn one_ip_packet() {
        let (mut my_tun, mut their_tun) = create_two_tuns_and_handshake();
        let mut my_dst = [0u8; 1024];
        let mut their_dst = [0u8; 1024];

        let sent_packet_buf = create_ipv4_udp_packet();

        let data = my_tun.encapsulate(&sent_packet_buf, &mut my_dst);
        assert!(matches!(data, TunnResult::WriteToNetwork(_)));
        let data = if let TunnResult::WriteToNetwork(sent) = data {
            sent
        } else {
            unreachable!();
        };

        let data = their_tun.decapsulate(None, data, &mut their_dst);
        assert!(matches!(data, TunnResult::WriteToTunnelV4(..)));
        let recv_packet_buf = if let TunnResult::WriteToTunnelV4(recv, _addr) = data {
            recv
        } else {
            unreachable!();
        };
        assert_eq!(sent_packet_buf, recv_packet_buf);
    }
}
