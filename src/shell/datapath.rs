//! The packet loops: TUN -> encrypt -> UDP and UDP -> decrypt -> TUN on their own threads, plus
//! the WireGuard timer thread, and their lifecycle ([`start`], [`Datapath::stop`], heartbeats,
//! the fatal error). What each packet means is decided by `core::packet`; this file owns the
//! threads, batches, buffers and locks. Buffers are allocated once per thread; a batch takes
//! one snapshot of the peer table; nothing here logs per packet.

use crate::config::PublicKey;
use crate::core::liveness::{Heartbeats, PacketThread, IDLE_WAKE, STALL_LIMIT};
use crate::core::offload::{self, Coalescer, VNET_HDR_LEN};
use crate::core::packet::{
    self, DropCounters, DropReason, Inbound, Outbound, PeerLookup, PeerPath, Sender,
};
use crate::core::wg::{self, Outcome, TunnelError};
use crate::shell::peers::{Peer, PeerTable};
use crate::shell::seccomp::{self, Confinement};
use crate::shell::tun;
use crate::shell::udp::{RecvBatch, SendBatch, WgSocket, MAX_DATAGRAM};
use parking_lot::{Mutex, RwLock};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tun_rs::SyncDevice;

/// How often WireGuard's handshake, rekey and keepalive timers are driven (boringtun expects
/// about every 100 ms; its own device uses 250 ms).
const TIMER_TICK: Duration = Duration::from_millis(100);
/// Largest packet the TUN device hands us in one read with offloads on.
const TUN_READ_BYTES: usize = VNET_HDR_LEN + 65535;
/// Super-packets assembled per batch of TUN writes on the receive path.
const COALESCE_SLOTS: usize = 16;
/// A busy TUN reader may never see an empty queue (and so never an idle wake): it also stamps
/// its heartbeat every this many reads, which keeps the clock read off the per-packet path.
const HEARTBEAT_EVERY_READS: u32 = 64;
/// How long [`Datapath::stop`] waits for the threads: one idle wake plus a loaded machine's
/// scheduling delay. A thread still running then is wedged; waiting longer would wedge the
/// caller too.
const STOP_WAIT: Duration = Duration::from_secs(3);

/// Everything the loops share.
pub struct Shared {
    pub table: RwLock<Arc<PeerTable>>,
    pub tun: Arc<SyncDevice>,
    pub socket: RwLock<Arc<WgSocket>>,
    pub drops: DropCounters,
    pub stop: AtomicBool,
    /// Milliseconds since `epoch` at which each packet thread last woke.
    heartbeats: Heartbeats,
    epoch: Instant,
    /// Every packet thread started (UDP readers of replaced sockets included), for the join.
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Set once when the data path cannot go on (the TUN device is gone).
    fatal: watch::Sender<Option<String>>,
}

impl Shared {
    pub fn new(table: PeerTable, tun: SyncDevice, socket: WgSocket) -> Shared {
        Shared {
            table: RwLock::new(Arc::new(table)),
            tun: Arc::new(tun),
            socket: RwLock::new(Arc::new(socket)),
            drops: DropCounters::default(),
            stop: AtomicBool::new(false),
            heartbeats: Heartbeats::default(),
            epoch: Instant::now(),
            threads: Mutex::new(Vec::new()),
            fatal: watch::Sender::new(None),
        }
    }

    pub fn snapshot(&self) -> Arc<PeerTable> {
        self.table.read().clone()
    }

    fn socket(&self) -> Arc<WgSocket> {
        self.socket.read().clone()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn beat(&self, thread: PacketThread) {
        self.heartbeats.beat(thread, self.now_ms());
    }

    /// Ok while every packet thread wakes within [`STALL_LIMIT`] and the data path has not
    /// failed; otherwise why not (a thread's name, or the fatal error). Cheap: what `/healthz`
    /// asks on every probe.
    pub fn liveness(&self) -> Result<(), String> {
        if let Some(why) = self.fatal.borrow().as_ref() {
            return Err(why.clone());
        }
        self.heartbeats.check(self.now_ms(), STALL_LIMIT)
    }

    /// The fatal error, once there is one.
    pub fn fatal(&self) -> Option<String> {
        self.fatal.borrow().clone()
    }

    /// Completes when the data path has failed for good (the TUN device was deleted), with the
    /// reason; the daemon should then exit non-zero. Pending forever otherwise.
    pub async fn fatal_error(&self) -> String {
        let mut rx = self.fatal.subscribe();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone(),
            // The sender lives in `self`, so it cannot be gone while we borrow it.
            Err(_) => None,
        };
        match why {
            Some(why) => why,
            None => std::future::pending().await,
        }
    }

    fn raise_fatal(&self, why: String) {
        tracing::error!(error = %why, "Data path stopped");
        self.fatal.send_if_modified(|slot| {
            let first = slot.is_none();
            if first {
                *slot = Some(why);
            }
            first
        });
    }

    fn spawn(
        self: &Arc<Self>,
        thread: PacketThread,
        body: impl FnOnce(&Shared) + Send + 'static,
    ) -> std::io::Result<()> {
        let shared = self.clone();
        let handle = std::thread::Builder::new()
            .name(thread.name().into())
            .spawn(move || body(&shared))?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(handle);
        Ok(())
    }
}

/// The peer table as the packet decisions look peers up.
impl PeerLookup for PeerTable {
    type Peer = Arc<Peer>;
    #[inline]
    fn by_key(&self, key: &PublicKey) -> Option<&Arc<Peer>> {
        self.peers.get(key)
    }
    #[inline]
    fn by_index(&self, index: u32) -> Option<&Arc<Peer>> {
        self.by_index.get(&index)
    }
    #[inline]
    fn by_address(&self, addr: IpAddr) -> Option<&Arc<Peer>> {
        self.routes.lookup(addr)
    }
    #[inline]
    fn same(a: &Arc<Peer>, b: &Arc<Peer>) -> bool {
        Arc::ptr_eq(a, b)
    }
}

/// The running packet threads. [`Datapath::stop`] (or dropping it) stops and joins them.
#[must_use = "dropping the handle stops the packet threads"]
pub struct Datapath {
    shared: Arc<Shared>,
    stopped: bool,
}

/// Packet threads that did not end within [`STOP_WAIT`] of a stop request; they are left
/// detached.
#[derive(Debug, thiserror::Error)]
#[error("packet threads still running after {STOP_WAIT:?}: {}", .0.join(", "))]
pub struct StillRunning(pub Vec<String>);

impl Datapath {
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops every packet thread (those started later by [`start_udp_reader`] too) and waits
    /// up to [`STOP_WAIT`] for them to end.
    pub fn stop(mut self) -> Result<(), StillRunning> {
        self.halt()
    }

    fn halt(&mut self) -> Result<(), StillRunning> {
        if std::mem::replace(&mut self.stopped, true) {
            return Ok(());
        }
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wakes the UDP reader now rather than at its next receive timeout.
        self.shared.socket().shutdown();
        let deadline = Instant::now() + STOP_WAIT;
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        while Instant::now() < deadline && !threads.iter().all(JoinHandle::is_finished) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut running = Vec::new();
        for t in threads {
            if t.is_finished() {
                let _ = t.join();
            } else {
                running.push(t.thread().name().unwrap_or("unnamed").to_string());
            }
        }
        if running.is_empty() {
            Ok(())
        } else {
            Err(StillRunning(running))
        }
    }
}

impl Drop for Datapath {
    fn drop(&mut self) {
        if let Err(e) = self.halt() {
            tracing::warn!(error = %e, "Packet threads did not stop");
        }
    }
}

/// Starts the TUN reader, the UDP reader and the timer thread. If one cannot be started, the
/// ones already running are stopped before the error is returned.
pub fn start(shared: Arc<Shared>) -> std::io::Result<Datapath> {
    // Dropped on the error paths below: stops and joins whatever did start.
    let datapath = Datapath {
        shared: shared.clone(),
        stopped: false,
    };
    shared.spawn(PacketThread::TunReader, tun_loop)?;
    shared.spawn(PacketThread::Timers, timer_loop)?;
    start_udp_reader(shared)?;
    Ok(datapath)
}

/// A UDP reader for the current socket; called again after the socket is replaced (new
/// listen port): the old reader ends when its socket is shut down.
pub fn start_udp_reader(shared: Arc<Shared>) -> std::io::Result<()> {
    // The socket of now, not of when the thread first runs: after two quick replacements,
    // two readers on the newest socket would reorder its flows.
    let socket = shared.socket();
    shared.spawn(PacketThread::UdpReader, move |shared| {
        udp_loop(shared, &socket)
    })
}

/// Confines the calling packet thread, once its setup is done, to the seccomp allow-list
/// (`core::seccomp`). The outcome is logged once per process; a thread that could not be
/// confined logs why and runs on without the filter (the packet path matters more).
fn confine(thread: PacketThread) {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    match seccomp::confine_current_thread() {
        Ok(Confinement::Filtered(policy)) => LOGGED.call_once(|| {
            tracing::info!(
                policy = %policy,
                allowed = crate::core::seccomp::allowed_names().len(),
                "Packet threads confined by seccomp"
            )
        }),
        Ok(Confinement::Off) => LOGGED.call_once(|| {
            tracing::warn!("Packet threads not confined: seccomp is off (--seccomp off)")
        }),
        Ok(Confinement::Unsupported) => LOGGED.call_once(|| {
            tracing::warn!("Packet threads not confined: no seccomp list for this architecture")
        }),
        Err(e) => tracing::warn!(
            thread = thread.name(),
            error = %e,
            "Packet thread not confined: the seccomp filter could not be installed"
        ),
    }
}

/// Errors of a TUN read that no retry can fix: the device was deleted (`ip link del`) or its
/// descriptor is unusable.
fn tun_is_gone(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBADFD | libc::ENODEV | libc::ENXIO | libc::EBADF)
    )
}

fn tun_loop(shared: &Shared) {
    let mut read = vec![0u8; TUN_READ_BYTES];
    let mut out = SendBatch::new(MAX_DATAGRAM);
    let mut reads_since_beat = 0u32;
    // Non-blocking reads drain whatever the kernel queued before one batched send: small
    // packets (UDP, ACKs) cost one system call per packet otherwise, and the TUN queue
    // overflows at high packet rates.
    if let Err(e) = shared.tun.set_nonblocking(true) {
        tracing::warn!(error = %e, "TUN device stays blocking: one send per read");
    }
    confine(PacketThread::TunReader);
    shared.beat(PacketThread::TunReader);
    while !shared.stop.load(Ordering::Relaxed) {
        let n = match shared.tun.recv(&mut read) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                flush(shared, &shared.socket(), &mut out);
                // Bounded, so an idle reader still stamps its heartbeat and sees `stop`.
                if let Err(e) = tun::wait_readable(&shared.tun, IDLE_WAKE) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        tracing::warn!(error = %e, "TUN poll failed");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                shared.beat(PacketThread::TunReader);
                reads_since_beat = 0;
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                if tun_is_gone(&e) {
                    shared.raise_fatal(format!("TUN device is gone: {e}"));
                    return;
                }
                tracing::warn!(error = %e, "TUN read failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        reads_since_beat += 1;
        if reads_since_beat == HEARTBEAT_EVERY_READS {
            shared.beat(PacketThread::TunReader);
            reads_since_beat = 0;
        }
        let read = &mut read[..n];
        let plan = match offload::plan_split(read) {
            Ok(plan) => plan,
            Err(e) => {
                shared.drops.add(DropReason::TunRead, 1);
                tracing::debug!(error = %e, "TUN read dropped");
                continue;
            }
        };
        let table = shared.snapshot();
        let socket = shared.socket();
        let count = plan.count();
        if table.private_key.is_none() {
            // No key, no identity: nothing can be sent (wireguard-go drops it too).
            shared.drops.add(DropReason::NoPeer, count as u64);
            continue;
        }
        // Every segment of one read goes to the same destination: one lookup per read.
        let mut read_peer = None;
        for i in 0..count {
            let range = plan.segment(read, i);
            let segment = &read[range];
            let peer = match read_peer {
                Some(p) => p,
                None => match packet::route_read(&*table, segment) {
                    Ok(p) => *read_peer.insert(p),
                    Err(reason) => {
                        shared.drops.add(reason, count as u64);
                        break;
                    }
                },
            };
            let endpoint = peer.path();
            match packet::encapsulate(&mut peer.tunnel.lock(), endpoint, segment, out.slot()) {
                Outbound::Send { len, to } => {
                    peer.counters.sent(len);
                    out.push(len, to);
                    if out.is_full() {
                        flush(shared, &socket, &mut out);
                    }
                }
                Outbound::Drop(reason) => shared.drops.add(reason, 1),
                Outbound::Nothing => {}
            }
        }
    }
}

fn flush(shared: &Shared, socket: &WgSocket, out: &mut SendBatch) {
    if !out.is_empty() {
        let dropped = socket.send_batch(out);
        if dropped > 0 {
            shared.drops.add(DropReason::UdpSend, dropped as u64);
        }
        if let Some(gone) = out.take_stale_source() {
            forget_source(shared, gone);
        }
    }
}

/// A local address peers replied from is gone: they fall back to the kernel's choice of
/// source until they send to another address of ours (rare: a walk over the table).
fn forget_source(shared: &Shared, gone: IpAddr) {
    tracing::info!(address = %gone, "Local address gone; replying from the kernel's choice");
    for peer in shared.snapshot().peers.values() {
        peer.forget_source(gone);
    }
}

fn udp_loop(shared: &Shared, socket: &WgSocket) {
    let mut batch = RecvBatch::default();
    let mut replies = SendBatch::new(MAX_DATAGRAM);
    let mut coalescer = Coalescer::new(COALESCE_SLOTS, shared.tun.udp_gso());
    let mut cookie = [0u8; 64];
    if let Err(e) = socket.set_receive_timeout(IDLE_WAKE) {
        tracing::warn!(error = %e, "UDP receive timeout not set: an idle reader looks stuck");
    }
    confine(PacketThread::UdpReader);
    shared.beat(PacketThread::UdpReader);
    while !shared.stop.load(Ordering::Relaxed) {
        let received = socket.recv_batch(&mut batch);
        shared.beat(PacketThread::UdpReader);
        match received {
            Ok(0) => return, // shut down: this socket was replaced or the daemon stops
            Ok(_) => {}
            // The receive timeout: an idle wake.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
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
        let Some(private_key) = table.private_key.as_ref() else {
            // No key: no handshake can be answered and no session is kept.
            shared
                .drops
                .add(DropReason::UnknownPeer, batch.datagrams().count() as u64);
            continue;
        };
        for (from, datagram) in batch.datagrams() {
            let identified = packet::identify(
                &*table,
                &table.limiter,
                private_key,
                &table.public_key,
                from.remote,
                datagram,
                &mut cookie,
            );
            let peer = match identified {
                Ok(Sender::Peer(peer)) => peer,
                Ok(Sender::Cookie(len)) => {
                    replies.slot()[..len].copy_from_slice(&cookie[..len]);
                    replies.push(len, from);
                    // A GRO batch holds more datagrams than a reply batch has room for.
                    if replies.is_full() {
                        flush(shared, socket, &mut replies);
                    }
                    continue;
                }
                Err(reason) => {
                    shared.drops.add(reason, 1);
                    continue;
                }
            };
            if coalescer.needs_drain() {
                write_tun(shared, &mut coalescer);
            }
            receive(
                shared,
                socket,
                &table,
                peer,
                from,
                datagram,
                &mut coalescer,
                &mut replies,
            );
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
            shared.drops.add(DropReason::TunWrite, 1);
            tracing::debug!(error = %e, "TUN write failed");
        }
    });
}

/// Decrypts one datagram of `peer` into the coalescer and carries out the decision: deliver,
/// answer (then send what queued up during the handshake), drop; count and roam.
#[allow(clippy::too_many_arguments)]
#[inline]
fn receive(
    shared: &Shared,
    socket: &WgSocket,
    table: &PeerTable,
    peer: &Arc<Peer>,
    from: PeerPath,
    datagram: &[u8],
    coalescer: &mut Coalescer,
    replies: &mut SendBatch,
) {
    let landing = coalescer.landing(datagram.len());
    let mut tunnel = peer.tunnel.lock();
    let received = packet::decapsulate(table, peer, &mut tunnel, from.remote, datagram, landing);
    match received.action {
        Inbound::Deliver(len) => {
            drop(tunnel);
            coalescer.commit(len);
        }
        Inbound::Reply(len) => {
            replies.slot()[..len].copy_from_slice(&landing[..len]);
            replies.push(len, from);
            peer.counters.sent(len);
            loop {
                if replies.is_full() {
                    flush(shared, socket, replies);
                }
                let Outcome::Network(queued) = tunnel.flush(replies.slot()) else {
                    break;
                };
                let len = queued.len();
                replies.push(len, from);
                peer.counters.sent(len);
            }
            drop(tunnel);
            coalescer.abandon();
        }
        Inbound::Nothing => {
            drop(tunnel);
            coalescer.abandon();
        }
        Inbound::Drop(reason) => {
            drop(tunnel);
            coalescer.abandon();
            shared.drops.add(reason, 1);
        }
    }
    if received.authenticated {
        peer.counters
            .rx_bytes
            .fetch_add(datagram.len() as u64, Ordering::Relaxed);
        peer.counters.rx_packets.fetch_add(1, Ordering::Relaxed);
        if let Some(endpoint) = packet::roam(peer.path(), from, received.authenticated) {
            *peer.endpoint.write() = Some(endpoint);
        }
    }
}

fn timer_loop(shared: &Shared) {
    let mut buf = vec![0u8; wg::MIN_OUTPUT.max(2048)];
    confine(PacketThread::Timers);
    let mut last_reset = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        shared.beat(PacketThread::Timers);
        std::thread::sleep(TIMER_TICK);
        let table = shared.snapshot();
        if last_reset.elapsed() >= Duration::from_secs(1) {
            table.limiter.reset_count();
            last_reset = Instant::now();
        }
        let socket = shared.socket();
        if table.private_key.is_none() {
            continue; // no key: no handshakes, no keepalives
        }
        let now = Instant::now();
        for peer in table.peers.values() {
            let endpoint = peer.path();
            let mut tunnel = peer.tunnel.lock();
            log_handshake(peer, tunnel.stats().since_last_handshake);
            if let Some(ep) = endpoint {
                let keepalive = peer.settings.persistent_keepalive.is_some();
                let has_session = tunnel.stats().since_last_handshake.is_some();
                let started = keepalive && peer.counters.initiated.swap(true, Ordering::Relaxed);
                if packet::keepalive_handshake(keepalive, started, has_session) {
                    if let Outcome::Network(m) = tunnel.initiate(&mut buf) {
                        peer.counters
                            .handshakes_sent
                            .fetch_add(1, Ordering::Relaxed);
                        peer.counters.sent(m.len());
                        if let Ok(true) = socket.send_one(m, ep) {
                            forget_source(shared, ep.local.unwrap_or(ep.remote.ip()));
                        }
                    }
                }
            }
            match tunnel.update_timers(now, &mut buf) {
                Outcome::Network(m) => {
                    let Some(ep) = endpoint else { continue };
                    if m.len() == 148 {
                        peer.counters
                            .handshakes_sent
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    peer.counters.sent(m.len());
                    match socket.send_one(m, ep) {
                        Ok(false) => {}
                        Ok(true) => forget_source(shared, ep.local.unwrap_or(ep.remote.ip())),
                        Err(e) => {
                            shared.drops.add(DropReason::UdpSend, 1);
                            tracing::debug!(error = %e, "timer send failed");
                        }
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
        let name = peer.settings.name.as_deref().unwrap_or("");
        tracing::info!(peer = %peer.public_key, peer_name = name, %endpoint, "Handshake completed");
    }
}
