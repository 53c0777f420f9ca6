//! The packet loops: TUN -> encrypt -> UDP and UDP -> decrypt -> TUN on their own threads, plus
//! the WireGuard timer thread. Buffers are allocated once per thread; a batch takes one
//! snapshot of the peer table; nothing here logs per packet.

use crate::core::offload::{self, Coalescer, VNET_HDR_LEN};
use crate::core::wg::{self, Incoming, Outcome, TunnelError};
use crate::shell::peers::{Peer, PeerTable};
use crate::shell::tun;
use crate::shell::udp::{RecvBatch, SendBatch, WgSocket, MAX_DATAGRAM};
use parking_lot::RwLock;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tun_rs::SyncDevice;

/// How often WireGuard's handshake, rekey and keepalive timers are driven (boringtun expects
/// about every 100 ms; its own device uses 250 ms).
const TIMER_TICK: Duration = Duration::from_millis(100);
/// Largest packet the TUN device hands us in one read with offloads on.
const TUN_READ_BYTES: usize = VNET_HDR_LEN + 65535;
/// Super-packets assembled per batch of TUN writes on the receive path.
const COALESCE_SLOTS: usize = 16;

/// Packets dropped, by reason: what `/metrics` exports.
#[derive(Debug, Default)]
pub struct DropCounters {
    /// Outgoing packet to an address no peer's allowed IPs cover.
    pub no_peer: AtomicU64,
    /// Outgoing packet for a peer with no known endpoint.
    pub no_endpoint: AtomicU64,
    /// Decrypted packet whose inner source is outside the sender's allowed IPs.
    pub bad_source: AtomicU64,
    /// Datagram that failed parsing, authentication or replay checks.
    pub invalid: AtomicU64,
    /// Datagram for a session index or key no peer has.
    pub unknown_peer: AtomicU64,
    /// TUN read that could not be split into packets.
    pub tun_read: AtomicU64,
    pub tun_write: AtomicU64,
    pub udp_send: AtomicU64,
}

/// Everything the loops share.
pub struct Shared {
    pub table: RwLock<Arc<PeerTable>>,
    pub tun: Arc<SyncDevice>,
    pub socket: RwLock<Arc<WgSocket>>,
    pub drops: DropCounters,
    pub stop: AtomicBool,
}

impl Shared {
    pub fn snapshot(&self) -> Arc<PeerTable> {
        self.table.read().clone()
    }

    fn socket(&self) -> Arc<WgSocket> {
        self.socket.read().clone()
    }
}

/// Starts the TUN reader, one UDP reader per socket generation and the timer thread.
pub fn start(shared: Arc<Shared>) -> std::io::Result<()> {
    let s = shared.clone();
    std::thread::Builder::new()
        .name("tg-tun-rx".into())
        .spawn(move || tun_loop(&s))?;
    let s = shared.clone();
    std::thread::Builder::new()
        .name("tg-timers".into())
        .spawn(move || timer_loop(&s))?;
    start_udp_reader(shared)
}

/// A UDP reader for the current socket; called again after the socket is replaced (new
/// listen port): the old reader ends when its socket is shut down.
pub fn start_udp_reader(shared: Arc<Shared>) -> std::io::Result<()> {
    let socket = shared.socket();
    std::thread::Builder::new()
        .name("tg-udp-rx".into())
        .spawn(move || udp_loop(&shared, &socket))?;
    Ok(())
}

fn tun_loop(shared: &Shared) {
    let mut read = vec![0u8; TUN_READ_BYTES];
    let mut out = SendBatch::new(MAX_DATAGRAM);
    // Non-blocking reads drain whatever the kernel queued before one batched send: small
    // packets (UDP, ACKs) cost one system call per packet otherwise, and the TUN queue
    // overflows at high packet rates.
    if let Err(e) = shared.tun.set_nonblocking(true) {
        tracing::warn!(error = %e, "TUN device stays blocking: one send per read");
    }
    while !shared.stop.load(Ordering::Relaxed) {
        let n = match shared.tun.recv(&mut read) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                flush(shared, &shared.socket(), &mut out);
                if let Err(e) = tun::wait_readable(&shared.tun) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        tracing::warn!(error = %e, "TUN poll failed");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                tracing::warn!(error = %e, "TUN read failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let read = &mut read[..n];
        let plan = match offload::plan_split(read) {
            Ok(plan) => plan,
            Err(e) => {
                shared.drops.tun_read.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "TUN read dropped");
                continue;
            }
        };
        let table = shared.snapshot();
        let socket = shared.socket();
        // Every segment of one read goes to the same destination: one lookup per read.
        let mut read_peer = None;
        for i in 0..plan.count() {
            let range = plan.segment(read, i);
            let packet = &read[range];
            let peer = match read_peer {
                Some(p) => p,
                None => {
                    let Some(dst) = wg::packet_destination(packet) else {
                        break;
                    };
                    let Some(p) = table.routes.lookup(dst) else {
                        shared
                            .drops
                            .no_peer
                            .fetch_add(plan.count() as u64, Ordering::Relaxed);
                        break;
                    };
                    *read_peer.insert(p)
                }
            };
            let endpoint = peer.endpoint();
            let sent = match peer.tunnel.lock().encapsulate(packet, out.slot()) {
                Outcome::Network(m) => Some(m.len()),
                _ => None,
            };
            match (sent, endpoint) {
                (Some(len), Some(ep)) => {
                    peer.counters.sent(len);
                    out.push(len, ep);
                    if out.is_full() {
                        flush(shared, &socket, &mut out);
                    }
                }
                (Some(_), None) => {
                    shared.drops.no_endpoint.fetch_add(1, Ordering::Relaxed);
                }
                (None, _) => {}
            }
        }
    }
}

fn flush(shared: &Shared, socket: &WgSocket, out: &mut SendBatch) {
    if !out.is_empty() {
        let dropped = socket.send_batch(out);
        if dropped > 0 {
            shared
                .drops
                .udp_send
                .fetch_add(dropped as u64, Ordering::Relaxed);
        }
    }
}

fn udp_loop(shared: &Shared, socket: &WgSocket) {
    let mut batch = RecvBatch::default();
    let mut replies = SendBatch::new(MAX_DATAGRAM);
    let mut coalescer = Coalescer::new(COALESCE_SLOTS, shared.tun.udp_gso());
    let mut cookie = [0u8; 64];
    while !shared.stop.load(Ordering::Relaxed) {
        match socket.recv_batch(&mut batch) {
            Ok(0) => return, // shut down: this socket was replaced or the daemon stops
            Ok(_) => {}
            Err(e) => {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                tracing::warn!(error = %e, "UDP receive failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        }
        let table = shared.snapshot();
        for (from, datagram) in batch.datagrams() {
            let peer = match wg::classify(
                &table.limiter,
                &table.private_key,
                &table.public_key,
                from.ip(),
                datagram,
                &mut cookie,
            ) {
                Ok(Incoming::Initiation(key)) => table.peers.get(&key),
                Ok(Incoming::Index(index)) => table.by_index.get(&index),
                Ok(Incoming::Cookie(len)) => {
                    replies.slot()[..len].copy_from_slice(&cookie[..len]);
                    replies.push(len, from);
                    continue;
                }
                Err(_) => {
                    shared.drops.invalid.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let Some(peer) = peer else {
                shared.drops.unknown_peer.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if coalescer.needs_drain() {
                write_tun(shared, &mut coalescer);
            }
            let landing = coalescer.landing(datagram.len());
            match receive(shared, peer, from, datagram, landing, &mut replies, &table) {
                Some(len) => coalescer.commit(len),
                None => coalescer.abandon(),
            }
            if replies.is_full() {
                flush(shared, socket, &mut replies);
            }
        }
        flush(shared, socket, &mut replies);
        write_tun(shared, &mut coalescer);
    }
}

/// Writes the decrypted packets to the TUN device: one write per coalesced super-packet.
fn write_tun(shared: &Shared, coalescer: &mut Coalescer) {
    coalescer.drain(|bytes| {
        if let Err(e) = shared.tun.send(bytes) {
            shared.drops.tun_write.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "TUN write failed");
        }
    });
}

/// Decrypts one datagram of `peer`. Returns the length of the packet for the TUN device that
/// `dst` then starts with, if any.
fn receive(
    shared: &Shared,
    peer: &Arc<Peer>,
    from: SocketAddr,
    datagram: &[u8],
    dst: &mut [u8],
    replies: &mut SendBatch,
    table: &PeerTable,
) -> Option<usize> {
    let mut tunnel = peer.tunnel.lock();
    let plain_len = match tunnel.decapsulate(from.ip(), datagram, dst) {
        Outcome::Tunnel(packet, src) => {
            let len = packet.len();
            match table.routes.lookup(src) {
                Some(owner) if Arc::ptr_eq(owner, peer) => Some(len),
                _ => {
                    shared.drops.bad_source.fetch_add(1, Ordering::Relaxed);
                    None
                }
            }
        }
        Outcome::Network(reply) => {
            // A handshake message: answer it, then send what queued up during the handshake.
            let len = reply.len();
            replies.slot()[..len].copy_from_slice(reply);
            replies.push(len, from);
            peer.counters.sent(len);
            while let Outcome::Network(queued) = tunnel.flush(replies.slot()) {
                let len = queued.len();
                replies.push(len, from);
                peer.counters.sent(len);
                if replies.is_full() {
                    break;
                }
            }
            None
        }
        Outcome::Done => None,
        Outcome::Error(_) => {
            shared.drops.invalid.fetch_add(1, Ordering::Relaxed);
            return None;
        }
    };
    drop(tunnel);
    // Authenticated: count it and follow the peer to its new address (roaming).
    peer.counters
        .rx_bytes
        .fetch_add(datagram.len() as u64, Ordering::Relaxed);
    peer.counters.rx_packets.fetch_add(1, Ordering::Relaxed);
    if peer.endpoint() != Some(from) {
        *peer.endpoint.write() = Some(from);
    }
    plain_len.filter(|&len| len > 0)
}

fn timer_loop(shared: &Shared) {
    let mut buf = vec![0u8; wg::MIN_OUTPUT.max(2048)];
    let mut last_reset = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(TIMER_TICK);
        let table = shared.snapshot();
        if last_reset.elapsed() >= Duration::from_secs(1) {
            table.limiter.reset_count();
            last_reset = Instant::now();
        }
        let socket = shared.socket();
        for peer in table.peers.values() {
            let endpoint = peer.endpoint();
            let mut tunnel = peer.tunnel.lock();
            log_handshake(peer, tunnel.stats().since_last_handshake);
            if let Some(ep) = endpoint {
                if peer.settings.persistent_keepalive.is_some()
                    && !peer.counters.initiated.swap(true, Ordering::Relaxed)
                {
                    if let Outcome::Network(m) = tunnel.initiate(&mut buf) {
                        peer.counters
                            .handshakes_sent
                            .fetch_add(1, Ordering::Relaxed);
                        peer.counters.sent(m.len());
                        let _ = socket.send_one(m, ep);
                    }
                }
            }
            match tunnel.update_timers(&mut buf) {
                Outcome::Network(m) => {
                    let Some(ep) = endpoint else { continue };
                    if m.len() == 148 {
                        peer.counters
                            .handshakes_sent
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    peer.counters.sent(m.len());
                    if let Err(e) = socket.send_one(m, ep) {
                        shared.drops.udp_send.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "timer send failed");
                    }
                }
                Outcome::Error(TunnelError::Expired) => {}
                Outcome::Error(_) => {
                    peer.counters
                        .handshake_failures
                        .fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Done | Outcome::Tunnel(..) => {}
            }
        }
    }
}

/// Logs a completed handshake once (timers see it within one tick).
fn log_handshake(peer: &Peer, since: Option<Duration>) {
    let Some(since) = since else { return };
    let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) else {
        return;
    };
    let at_ms = now.saturating_sub(since).as_millis() as u64;
    let logged = peer.counters.handshake_logged_ms.load(Ordering::Relaxed);
    // The same handshake is seen on every tick with slightly different arithmetic.
    if at_ms > logged + 1000 {
        peer.counters
            .handshake_logged_ms
            .store(at_ms, Ordering::Relaxed);
        let endpoint = peer
            .endpoint()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "none".into());
        tracing::info!(peer = %peer.public_key, %endpoint, "Handshake completed");
    }
}
