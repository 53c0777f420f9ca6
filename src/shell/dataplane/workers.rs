//! The packet loops of one worker (TUN queue -> encrypt -> UDP, UDP -> decrypt -> TUN queue),
//! their relay partners (a whole read handed to an idle partner, emitted in read order:
//! [`super::relay`]) and the timer thread, which also runs the handshake path
//! ([`super::handshakes`]). Buffers are allocated once per thread; a batch takes
//! one snapshot of the peer table; a peer's lock is held for one call into `core::peer` and
//! released before any send or write; nothing here logs per packet.

use super::readers::ThreadPriority;
use super::relay::{Busy, Cores, Relay, Stopper, TakeBack, Turn};
use super::send::forget_source;
use super::table::{PeerSlot, PeerTable};
use super::Inner;
use crate::core::aqm;
use crate::core::handshake::{self, Admit};
use crate::core::liveness::{PacketThread, IDLE_WAKE};
use crate::core::offload::{self, Coalescer, SplitPlan, VNET_HDR_LEN};
use crate::core::packet::{self, DropReason, Inbound, Outbound, PeerLookup, PeerPath, Sender};
use crate::core::peer::Sending;
use crate::core::relay::{hands_off_batch, hands_off_read, opens_after_in_flight};
use crate::core::wg::{self, SealBatch};
use crate::shell::seccomp::{self, Confinement};
use crate::shell::udp::{RecvBatch, SendBatch, WgSocket, BATCH, MAX_DATAGRAM};
use crate::shell::{clock, tun};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest packet the TUN device hands us in one read with offloads on.
const TUN_READ_BYTES: usize = VNET_HDR_LEN + 65535;
/// Super-packets assembled per batch of TUN writes on the receive path.
const COALESCE_SLOTS: usize = 16;
/// A busy TUN reader may never see an empty queue (and so never an idle wake): it also stamps
/// its heartbeat and pays its real-time budget every this many reads, or this many segments
/// (64 full-size segments are about 0.1 ms of sealing), which keeps the clock reads off the
/// per-packet path and bounds what one charge can come late by.
const CHECK_EVERY_READS: u32 = 64;
const CHECK_EVERY_SEGMENTS: u32 = 64;

/// A TUN read handed from its reader to a partner: the read buffer (swapped with the
/// reader's, never copied), its length, and what the reader decided for it.
pub(super) struct SealJob {
    read: Vec<u8>,
    len: usize,
    work: Option<SealWork>,
    /// Where it is sealed, by its partner or by the reader taking it back: made at the first
    /// job, once, so a daemon that never sees a large read pays nothing for it.
    out: Option<SendBatch>,
}

/// What the reader decided for a handed-off read: how it splits, the counters reserved for
/// its segments (in read order, under the peer's lock) and where they go.
struct SealWork {
    plan: SplitPlan,
    batch: SealBatch,
    to: PeerPath,
}

impl SealJob {
    pub(super) fn new() -> SealJob {
        SealJob {
            read: vec![0u8; TUN_READ_BYTES],
            len: 0,
            work: None,
            out: None,
        }
    }
}

/// A TUN reader's relay: its partners seal whole reads and send them in read order.
pub(super) type TunRelay = Relay<SealJob>;

/// Confines the calling packet thread, once its setup is done, to the seccomp allow-list
/// (`core::seccomp`). The outcome is logged once per process; a thread that could not be
/// confined logs why and runs on without the filter (the packet path matters more).
pub(super) fn confine(thread: &str) {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    let confined = seccomp::confine_current_thread();
    if matches!(confined, Ok(Confinement::Filtered(_))) {
        super::mark_confined();
    }
    match confined {
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
            thread = %thread,
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

/// Worker `worker`'s TUN reader: read, split, seal, send; with `relay`, a read of many
/// segments for a peer with a session goes whole to an idle partner (after its counters are
/// reserved here, in read order), and every batch this thread sends waits for its turn.
pub(super) fn tun_loop(inner: &Inner, worker: usize, relay: Option<&TunRelay>) {
    // However this thread ends, its partners end with it.
    let _stopper = Stopper(relay);
    // Busy from a read that returned data until the queue is empty.
    let mut busy = Busy::new(relay.map(|r| r.cores()));
    // A read whose partner has not started it when this reader would wait for its turn is
    // sealed here (on the 2-vCPU VM the partner often waits for a CPU the application or the
    // other end holds).
    let take_back =
        |job: &mut SealJob, turn: &mut Turn<'_, SealJob>| seal_job(inner, worker, job, turn);
    let order = TunOrder {
        relay,
        take_back: &take_back,
    };
    let thread = PacketThread::TunReader(worker);
    let tun = &inner.queues[worker];
    let mut read_buf = vec![0u8; TUN_READ_BYTES];
    let mut out = SendBatch::new(MAX_DATAGRAM);
    let (mut reads_since_check, mut segments_since_check) = (0u32, 0u32);
    let mut priority = ThreadPriority::new(inner, thread).lending(relay.map(|r| r.lent()));
    priority.drained(clock::now());
    // Non-blocking reads drain whatever the kernel queued before one batched send: small
    // packets (UDP, ACKs) cost one system call per packet otherwise, and the TUN queue
    // overflows at high packet rates.
    if let Err(e) = tun.set_nonblocking(true) {
        tracing::warn!(error = %e, "TUN device stays blocking: one send per read");
    }
    confine(&thread.name());
    inner.beat(thread);
    while !inner.stop.load(Ordering::Relaxed) {
        let n = match tun.recv(&mut read_buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                flush_in_turn(inner, &inner.sockets()[worker], &mut out, &order);
                busy.set(false);
                priority.drained(clock::now());
                // Bounded, so an idle reader still stamps its heartbeat and sees `stop`.
                if let Err(e) = tun::wait_readable(tun, IDLE_WAKE) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        tracing::warn!(error = %e, "TUN poll failed");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                inner.beat(thread);
                (reads_since_check, segments_since_check) = (0, 0);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                if inner.stop.load(Ordering::Relaxed) {
                    return;
                }
                if tun_is_gone(&e) {
                    inner.device_gone(format!("TUN device is gone: {e}"));
                    return;
                }
                tracing::warn!(error = %e, "TUN read failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        busy.set(true);
        reads_since_check += 1;
        if reads_since_check == CHECK_EVERY_READS || segments_since_check >= CHECK_EVERY_SEGMENTS {
            inner.beat(thread);
            priority.busy(clock::now());
            (reads_since_check, segments_since_check) = (0, 0);
        }
        let read = &mut read_buf[..n];
        let plan = match offload::plan_split(read) {
            Ok(plan) => plan,
            Err(e) => {
                inner.drops.add(DropReason::TunRead, 1);
                tracing::debug!(error = %e, "TUN read dropped");
                continue;
            }
        };
        let table = inner.snapshot();
        let count = plan.count();
        priority.handled(count as u64);
        segments_since_check =
            segments_since_check.saturating_add(u32::try_from(count).unwrap_or(u32::MAX));
        if table.private_key().is_none() {
            // No key, no identity: nothing can be sent (wireguard-go drops it too).
            let first = plan.segment(read, 0);
            inner
                .drops
                .add(packet::unsendable_read(&read[first]), count as u64);
            priority.unauthenticated(count as u64);
            continue;
        }
        let sockets = inner.sockets();
        let socket = &sockets[worker];
        // Every segment of one read goes to the same destination: one lookup per read, on the
        // first segment, made in its send slot behind the header's room (the read is left as
        // it is, so any segment can be made in any order).
        let first = plan.segment_into(read, 0, &mut out.slot()[wg::DATA_OFFSET..]);
        let routed = packet::route_read(&*table, &out.slot()[wg::DATA_OFFSET..][..first]);
        let slot = match routed {
            Ok(slot) => slot,
            Err(reason) => {
                inner.drops.add(reason, count as u64);
                priority.unauthenticated(count as u64);
                continue;
            }
        };
        // A read worth a partner claims an idle one before its counters are reserved, so a
        // read no partner takes is sealed here as always.
        let claim = relay
            .filter(|_| hands_off_read(count))
            .and_then(|r| r.claim());
        // One lock per read, for the counters of all its segments; each is then sealed in
        // place in its send slot with no lock held.
        let sending = {
            let mut peer = slot.lock();
            peer.begin_send(count, plan.plaintext_bytes())
        };
        let Sending::Seal { batch, to } = sending else {
            drop(claim);
            let dropped = queue_segments(inner, socket, slot, &plan, read, &mut out, &order);
            priority.unauthenticated(dropped);
            continue;
        };
        if let Some(mut claim) = claim {
            // What this thread sealed before holds lower counters: its turn comes first.
            let mut pending = (!out.is_empty()).then(|| order.turn());
            let job = claim.job();
            std::mem::swap(&mut job.read, &mut read_buf);
            job.len = n;
            job.work = Some(SealWork { plan, batch, to });
            claim.post(count);
            if let Some(turn) = pending.as_mut() {
                turn.hold();
                flush(inner, socket, &mut out);
            }
            continue;
        }
        for i in 0..count {
            let message = out.slot();
            let len = match i {
                0 => first,
                _ => plan.segment_into(read, i, &mut message[wg::DATA_OFFSET..]),
            };
            let len = batch.seal_in_place(i, message, len);
            out.push(len, to);
            if out.is_full() {
                flush_in_turn(inner, socket, &mut out, &order);
            }
        }
    }
}

/// Partner `me` of worker `worker`'s TUN reader: seals each read handed to it
/// ([`seal_job`]).
pub(super) fn tun_partner(inner: &Inner, worker: usize, relay: &TunRelay, me: usize, name: &str) {
    confine(name);
    let served = relay.serve(me, |job, turn| {
        #[cfg(feature = "test-hooks")]
        crate::shell::test_hooks::partner_job_starts();
        inner.partner_jobs.sealed.fetch_add(1, Ordering::Relaxed);
        seal_job(inner, worker, job, turn)
    });
    if let Err(e) = served {
        inner.raise_fatal(format!("relay partner {name} failed: {e}"));
    }
}

/// Makes and seals the segments of a handed-off read into the job's own send batch and sends
/// them on the read's turn: a partner's work, and the reader's when it takes the job back.
fn seal_job(inner: &Inner, worker: usize, job: &mut SealJob, turn: &mut Turn<'_, SealJob>) {
    let Some(SealWork { plan, batch, to }) = job.work.take() else {
        return;
    };
    let sockets = inner.sockets();
    // No socket: the data plane is stopping.
    let Some(socket) = sockets.get(worker) else {
        return;
    };
    let out = job.out.get_or_insert_with(|| SendBatch::new(MAX_DATAGRAM));
    let read = &job.read[..job.len];
    for i in 0..plan.count() {
        let message = out.slot();
        let len = plan.segment_into(read, i, &mut message[wg::DATA_OFFSET..]);
        let len = batch.seal_in_place(i, message, len);
        out.push(len, to);
        if out.is_full() {
            turn.hold();
            flush(inner, socket, out);
        }
    }
    turn.hold();
    flush(inner, socket, out);
}

/// A TUN reader's place among its relay's reads: its relay (none without partners) and the
/// work it does on a read it takes back.
struct TunOrder<'a> {
    relay: Option<&'a TunRelay>,
    take_back: TakeBack<'a, SealJob>,
}

impl<'a> TunOrder<'a> {
    /// The turn of the reader's next emission.
    fn turn(&self) -> Turn<'a, SealJob> {
        Turn::of_taking_back(self.relay, self.take_back)
    }
}

/// Sends what `out` holds on its turn among the reads of the reader's relay (at once without
/// one).
fn flush_in_turn(inner: &Inner, socket: &WgSocket, out: &mut SendBatch, order: &TunOrder<'_>) {
    if !out.is_empty() {
        let mut turn = order.turn();
        turn.hold();
        flush(inner, socket, out);
    }
}

/// The segments of a read for a peer without a session (or endpoint) yet: each goes through
/// the peer under its lock, which queues it and starts a handshake (rare: once per handshake).
/// Returns how many were dropped.
fn queue_segments(
    inner: &Inner,
    socket: &WgSocket,
    slot: &PeerSlot,
    plan: &offload::SplitPlan,
    read: &mut [u8],
    out: &mut SendBatch,
    order: &TunOrder<'_>,
) -> u64 {
    let mut dropped = 0;
    for i in 0..plan.count() {
        let range = plan.segment(read, i);
        let (decision, woke) = {
            let mut peer = slot.lock();
            let decision = peer.encapsulate(&read[range], out.slot());
            (decision, peer.woke())
        };
        inner.hand_to_timer(woke, slot.public_key());
        match decision {
            Outbound::Send { len, to } => {
                out.push(len, to);
                if out.is_full() {
                    flush_in_turn(inner, socket, out, order);
                }
            }
            Outbound::Drop(reason) => {
                inner.drops.add(reason, 1);
                dropped += 1;
            }
            Outbound::Nothing => {}
        }
    }
    dropped
}

/// Sends what `out` holds. Called with no peer lock held.
fn flush(inner: &Inner, socket: &WgSocket, out: &mut SendBatch) {
    if !out.is_empty() {
        let dropped = socket.send_batch(out);
        if dropped > 0 {
            inner.drops.add(DropReason::UdpSend, dropped as u64);
        }
        if let Some(gone) = out.take_stale_source() {
            forget_source(inner, gone);
        }
    }
}

/// Worker `worker`'s UDP reader: receive, open, coalesce, write the TUN queue; with `relay`, a
/// receive batch of many datagrams goes whole to an idle partner (after the AQM's and the
/// priority guard's bookkeeping here), and every batch's writes and replies wait for its turn.
pub(super) fn udp_loop(inner: &Inner, worker: usize, socket: &WgSocket, relay: Option<&UdpRelay>) {
    // However this thread ends (its socket replaced, a stop), its partners end with it.
    let _stopper = Stopper(relay.map(|r| &r.relay));
    // Busy from a batch received until one comes short (the socket's queue is empty: the next
    // receive will likely block).
    let mut busy = Busy::new(relay.map(|r| r.relay.cores()));
    let mut drained = true;
    let thread = PacketThread::UdpReader(worker);
    let mut batch = RecvBatch::default();
    let opener = Opener::new(inner, worker, socket);
    let mut buffers = OpenBuffers::new(opener.tun);
    // A batch whose partner has not started it when this reader would wait for its turn is
    // opened here (see `tun_loop`).
    let take_back = |job: &mut OpenJob, turn: &mut Turn<'_, OpenJob>| {
        if let Some(relay) = relay {
            open_job(&opener, relay, job, turn);
        }
    };
    // AQM on the socket buffer in front of this thread (off without receive timestamps).
    let mut queue = aqm::ReceiveQueue::new(
        inner
            .threads
            .tuning
            .aqm
            .filter(|_| socket.has_receive_timestamps()),
    );
    let mut priority = ThreadPriority::new(inner, thread).lending(relay.map(|r| r.relay.lent()));
    priority.drained(clock::now());
    if let Err(e) = socket.set_receive_timeout(IDLE_WAKE) {
        tracing::warn!(error = %e, "UDP receive timeout not set: an idle reader looks stuck");
    }
    confine(&thread.name());
    inner.beat(thread);
    while !inner.stop.load(Ordering::Relaxed) {
        if drained {
            busy.set(false);
        }
        let received = socket.recv_batch(&mut batch);
        inner.beat(thread);
        let now = clock::now();
        match received {
            Ok(0) => return, // shut down: this socket was replaced or the daemon stops
            Ok(n) => {
                busy.set(true);
                drained = n < BATCH;
                // A short batch emptied the socket's queue; a full one may have left more.
                // (The guard pays for the batch before this one, whose packets it was told.)
                if n < BATCH {
                    priority.drained(now);
                } else {
                    priority.busy(now);
                }
                priority.handled(batch.datagram_count() as u64);
            }
            // The receive timeout: an idle wake.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                busy.set(false);
                priority.drained(now);
                continue;
            }
            Err(e) => {
                if inner.stop.load(Ordering::Relaxed) {
                    return;
                }
                tracing::warn!(error = %e, "UDP receive failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        }
        let table = inner.snapshot();
        let Some(private_key) = table.private_key() else {
            // No key: no handshake can be answered and no session is kept.
            for (_, datagram) in batch.datagrams() {
                inner
                    .drops
                    .add_received(DropReason::UnknownPeer, datagram.len());
            }
            priority.unauthenticated(batch.datagram_count() as u64);
            continue;
        };
        if let Some(relay) = relay {
            // What of the batches its partners opened did not authenticate: the reader's
            // guard pays for the time it lent them, and splits it by these counts.
            priority.unauthenticated(relay.unauthenticated_back.swap(0, Ordering::Relaxed));
        }
        if queue.is_on() {
            if let Some(relay) = relay {
                queue.repay(relay.owed_back.swap(0, Ordering::Relaxed));
            }
            // One more clock read per batch, none per datagram.
            queue.on_batch(batch.oldest_wait(clock::wall_now()), now);
        }
        let datagrams = batch.datagram_count();
        // Under load, a batch of nothing but handshakes (a flood's) is gated here (macs, cookie
        // replies, the proven queued): a partner would only add a hand-off to that work, mostly
        // drops, and the batch's size would hold this reader back from opening the next (the
        // replay-window rule).
        let under_load = inner.handshakes.under_load();
        let handshakes_only = under_load
            && batch
                .datagrams()
                .all(|(_, datagram)| wg::is_handshake(datagram));
        let claim = relay
            .filter(|r| !handshakes_only && hands_off_batch(r.relay.in_flight(), datagrams))
            .and_then(|r| r.relay.claim());
        if let Some(mut claim) = claim {
            // The partner opens it; the drops the AQM owes now go with it (and what it does
            // not take comes back through `owed_back`, what did not authenticate through
            // `unauthenticated_back`).
            let job = claim.job();
            std::mem::swap(&mut job.batch, &mut batch);
            job.owed = queue.lend();
            job.table = Some(table);
            claim.post(datagrams);
            continue;
        }
        let mut turn = Turn::of_taking_back(relay.map(|r| &r.relay), &take_back);
        if let Some(relay) = relay.filter(|_| !handshakes_only) {
            // Opened beside the batches in flight, this one's counters would run too far
            // ahead of theirs for the replay window: open it after them. (Handshakes have no
            // counters.)
            if opens_after_in_flight(relay.relay.in_flight(), datagrams) {
                turn.hold();
            }
        }
        let unauthenticated = opener.open(
            &mut buffers,
            &table,
            private_key,
            &batch,
            |datagram| queue.take_drop(datagram),
            &mut turn,
        );
        priority.unauthenticated(unauthenticated);
        drop(turn);
        // A flood's trains then arrive a few per wake-up (see `flood_nap`).
        let nap = handshake::flood_nap(under_load, drained, datagrams as u64, unauthenticated);
        if let Some(nap) = nap {
            std::thread::sleep(nap);
        }
    }
}

/// A receive batch handed from a UDP reader to a partner: the batch (swapped with the
/// reader's, never copied), the peer table it was received under, and the drops the AQM owed
/// when it was handed off.
pub(super) struct OpenJob {
    batch: RecvBatch,
    table: Option<Arc<PeerTable>>,
    owed: u32,
    /// Where it is opened, by its partner or by the reader taking it back: made at the first
    /// job, once (see [`SealJob`]'s `out`).
    buffers: Option<OpenBuffers>,
}

impl OpenJob {
    pub(super) fn new() -> OpenJob {
        OpenJob {
            batch: RecvBatch::default(),
            table: None,
            owed: 0,
            buffers: None,
        }
    }
}

/// A UDP reader's relay: its partners open whole receive batches and write them in receive
/// order; AQM drops a partner was lent and did not take come back to the reader, and so does
/// the count of datagrams that did not authenticate (for the reader's priority guard).
pub(super) struct UdpRelay {
    relay: Relay<OpenJob>,
    owed_back: AtomicU32,
    unauthenticated_back: AtomicU64,
}

impl UdpRelay {
    /// Stops its partners (and every wait for a turn), whether or not its reader has exited.
    pub(super) fn stop(&self) {
        self.relay.stop();
    }

    pub(super) fn new(partners: usize, cores: Arc<Cores>) -> UdpRelay {
        UdpRelay {
            relay: Relay::new(partners, cores, OpenJob::new),
            owed_back: AtomicU32::new(0),
            unauthenticated_back: AtomicU64::new(0),
        }
    }
}

/// Partner `me` of worker `worker`'s UDP reader (on `socket`): opens each batch handed to it
/// ([`open_job`]).
pub(super) fn udp_partner(
    inner: &Inner,
    worker: usize,
    socket: &WgSocket,
    relay: &UdpRelay,
    me: usize,
    name: &str,
) {
    let opener = Opener::new(inner, worker, socket);
    confine(name);
    let served = relay.relay.serve(me, |job, turn| {
        #[cfg(feature = "test-hooks")]
        crate::shell::test_hooks::partner_job_starts();
        inner.partner_jobs.opened.fetch_add(1, Ordering::Relaxed);
        open_job(&opener, relay, job, turn)
    });
    if let Err(e) = served {
        inner.raise_fatal(format!("relay partner {name} failed: {e}"));
    }
}

/// Opens a handed-off receive batch into the job's own buffers and writes it (and sends its
/// replies) on the batch's turn, giving back the AQM drops it was lent and did not take: a
/// partner's work, and the reader's when it takes the job back.
fn open_job(
    opener: &Opener<'_>,
    relay: &UdpRelay,
    job: &mut OpenJob,
    turn: &mut Turn<'_, OpenJob>,
) {
    let Some(table) = job.table.take() else {
        return;
    };
    let Some(private_key) = table.private_key() else {
        return;
    };
    let mut owed = std::mem::take(&mut job.owed);
    let buffers = job
        .buffers
        .get_or_insert_with(|| OpenBuffers::new(opener.tun));
    let unauthenticated = opener.open(
        buffers,
        &table,
        private_key,
        &job.batch,
        |datagram| aqm::take_owed_drop(&mut owed, datagram),
        turn,
    );
    if owed > 0 {
        relay.owed_back.fetch_add(owed, Ordering::Relaxed);
    }
    if unauthenticated > 0 {
        relay
            .unauthenticated_back
            .fetch_add(unauthenticated, Ordering::Relaxed);
    }
}

/// Where a thread that opens receive batches sends the results: worker `worker`'s TUN queue
/// and its socket (handshake and cookie replies).
struct Opener<'a> {
    inner: &'a Inner,
    worker: usize,
    tun: &'a tun_rs::SyncDevice,
    socket: &'a WgSocket,
}

/// The buffers one receive batch is opened into: the coalescer in front of the TUN queue, the
/// replies, the cookie reply being made. Made once per thread (the reader's) or per job buffer.
pub(super) struct OpenBuffers {
    coalescer: Coalescer,
    replies: SendBatch,
    cookie: [u8; 64],
}

impl OpenBuffers {
    fn new(tun: &tun_rs::SyncDevice) -> OpenBuffers {
        OpenBuffers {
            coalescer: Coalescer::new(COALESCE_SLOTS, tun.udp_gso()),
            replies: SendBatch::new(MAX_DATAGRAM),
            cookie: [0u8; 64],
        }
    }
}

impl<'a> Opener<'a> {
    fn new(inner: &'a Inner, worker: usize, socket: &'a WgSocket) -> Opener<'a> {
        Opener {
            inner,
            worker,
            tun: &inner.queues[worker],
            socket,
        }
    }

    /// Opens `batch` into `buffers` (see [`open_batch`]); its writes and replies go out on
    /// `turn`.
    fn open(
        &self,
        buffers: &mut OpenBuffers,
        table: &Arc<PeerTable>,
        private_key: &crate::config::SecretKey,
        batch: &RecvBatch,
        take_drop: impl FnMut(&[u8]) -> bool,
        turn: &mut Turn<'_, OpenJob>,
    ) -> u64 {
        let mut emit = Emit {
            inner: self.inner,
            worker: self.worker,
            tun: self.tun,
            socket: self.socket,
            coalescer: &mut buffers.coalescer,
            replies: &mut buffers.replies,
            turn,
        };
        open_batch(
            table,
            private_key,
            batch,
            take_drop,
            &mut buffers.cookie,
            &mut emit,
        )
    }
}

/// Where one receive batch's results go, on its turn: the TUN queue (through the coalescer)
/// and the socket (handshake and cookie replies).
struct Emit<'a, 't> {
    inner: &'a Inner,
    /// The worker whose socket received the batch: handshake replies leave by it.
    worker: usize,
    tun: &'a tun_rs::SyncDevice,
    socket: &'a WgSocket,
    coalescer: &'a mut Coalescer,
    replies: &'a mut SendBatch,
    turn: &'a mut Turn<'t, OpenJob>,
}

impl Emit<'_, '_> {
    /// Sends the replies gathered so far, on the batch's turn.
    fn flush_replies(&mut self) {
        if !self.replies.is_empty() {
            self.turn.hold();
            flush(self.inner, self.socket, self.replies);
        }
    }

    /// Writes what the coalescer holds, on the batch's turn.
    fn write_tun(&mut self) {
        self.turn.hold();
        write_tun(self.inner, self.tun, self.coalescer);
    }
}

/// Identifies, opens and carries out every datagram of `batch` (received under `table`),
/// dropping for the AQM those `take_drop` says; writes and replies through `emit`, all of them
/// on the batch's turn. Returns how many did not authenticate.
fn open_batch(
    table: &Arc<PeerTable>,
    private_key: &crate::config::SecretKey,
    batch: &RecvBatch,
    mut take_drop: impl FnMut(&[u8]) -> bool,
    cookie: &mut [u8; 64],
    emit: &mut Emit<'_, '_>,
) -> u64 {
    let inner = emit.inner;
    let mut unauthenticated = 0;
    let mut queued_handshakes = false;
    // Under load: the batch's time for the gate (read once), the cookie of the source last
    // seen (a GRO train is one source's), and the messages dropped, counted once at the end
    // (a flood is a million a second).
    let mut batch_now = None;
    let mut source_cookie: Option<(IpAddr, wg::SourceCookie)> = None;
    let (mut limited, mut limited_bytes) = (0u64, 0u64);
    let (mut invalid, mut invalid_bytes) = (0u64, 0u64);
    for (from, datagram) in batch.datagrams() {
        // Handshakes go to their own path (the timer thread, at normal priority): a reader
        // never runs a Diffie-Hellman. Not under load it checks their type and size only;
        // under load it checks their macs itself (`core::handshake::Gate`).
        if wg::is_handshake(datagram) {
            unauthenticated += 1;
            let handshakes = &inner.handshakes;
            let charged = if !handshakes.under_load() {
                false
            } else if let Some(index) = wg::cookie_reply_index(datagram) {
                // A cookie reply: queued only if it names a peer of ours.
                if table.by_index(index).is_none() {
                    inner
                        .drops
                        .add_received(DropReason::UnknownPeer, datagram.len());
                    continue;
                }
                false
            } else {
                // An initiation or a response: queued only if its mac2 proved its source,
                // which is charged its share; else a cookie reply from here, or a drop.
                let source = from.remote.ip();
                let now = *batch_now.get_or_insert_with(crate::shell::clock::now);
                let limiter = table.limiter();
                let admit = handshakes.admit(
                    source,
                    now,
                    // A mac2 of zeros is no cookie: its source's cookie is not needed.
                    || {
                        wg::carries_mac2(datagram)
                            && limiter.mac2_is_valid(
                                cookie_of(&mut source_cookie, limiter, source),
                                datagram,
                            )
                    },
                    || limiter.mac1_is_valid(datagram),
                );
                match admit {
                    Admit::Queue => true,
                    Admit::Cookie => {
                        let cookie = cookie_of(&mut source_cookie, limiter, source);
                        let reply =
                            limiter.write_cookie_reply(cookie, datagram, emit.replies.slot());
                        if let Some(len) = reply {
                            emit.replies.push(len, from);
                            // A GRO batch holds more datagrams than a reply batch has room for.
                            if emit.replies.is_full() {
                                emit.flush_replies();
                            }
                        }
                        continue;
                    }
                    Admit::Invalid => {
                        invalid += 1;
                        invalid_bytes += datagram.len() as u64;
                        continue;
                    }
                    Admit::Limited => {
                        limited += 1;
                        limited_bytes += datagram.len() as u64;
                        continue;
                    }
                }
            };
            if handshakes.push(from, emit.worker, datagram, charged) {
                queued_handshakes = true;
            } else {
                inner
                    .drops
                    .add_received(DropReason::HandshakeQueueFull, datagram.len());
            }
            continue;
        }
        let identified = packet::identify(
            &**table,
            table.limiter(),
            private_key,
            table.public_key(),
            from.remote,
            datagram,
            cookie,
        );
        let slot = match identified {
            Ok(Sender::Peer(slot)) => slot,
            Ok(Sender::Cookie(len)) => {
                unauthenticated += 1;
                emit.replies.slot()[..len].copy_from_slice(&cookie[..len]);
                emit.replies.push(len, from);
                // A GRO batch holds more datagrams than a reply batch has room for.
                if emit.replies.is_full() {
                    emit.flush_replies();
                }
                continue;
            }
            Err(reason) => {
                inner.drops.add_received(reason, datagram.len());
                unauthenticated += 1;
                continue;
            }
        };
        if take_drop(datagram) {
            inner.drops.add_received(DropReason::Aqm, datagram.len());
            unauthenticated += 1;
            continue;
        }
        if emit.coalescer.needs_drain() {
            emit.write_tun();
        }
        let received = Received {
            table,
            slot,
            from,
            datagram,
        };
        if !received.carry_out(emit) {
            unauthenticated += 1;
        }
        if emit.replies.is_full() {
            emit.flush_replies();
        }
    }
    if limited > 0 {
        inner
            .drops
            .add_received_many(DropReason::HandshakeLimited, limited, limited_bytes);
    }
    if invalid > 0 {
        inner
            .drops
            .add_received_many(DropReason::Invalid, invalid, invalid_bytes);
    }
    emit.flush_replies();
    emit.write_tun();
    if queued_handshakes {
        inner.wake_timers();
    }
    unauthenticated
}

/// The cookie of `source` now, made once for a run of its messages (`cache`: the last source's).
fn cookie_of<'c>(
    cache: &'c mut Option<(IpAddr, wg::SourceCookie)>,
    limiter: &wg::Limiter,
    source: IpAddr,
) -> &'c wg::SourceCookie {
    if !matches!(cache, Some((held, _)) if *held == source) {
        *cache = Some((source, limiter.source_cookie(source)));
    }
    &cache
        .get_or_insert_with(|| (source, limiter.source_cookie(source)))
        .1
}

/// Writes the decrypted packets to the TUN queue: one write per coalesced super-packet.
fn write_tun(inner: &Inner, tun: &tun_rs::SyncDevice, coalescer: &mut Coalescer) {
    coalescer.drain(|bytes| {
        if let Err(e) = tun.send(bytes) {
            inner.drops.add(DropReason::TunWrite, 1);
            tracing::debug!(error = %e, "TUN write failed");
        }
    });
}

/// One datagram of a known peer, about to be decrypted.
struct Received<'a> {
    table: &'a PeerTable,
    slot: &'a Arc<PeerSlot>,
    from: PeerPath,
    datagram: &'a [u8],
}

impl Received<'_> {
    /// Decrypts into the coalescer and carries out the peer's decision: deliver, answer (then
    /// send what queued up during the handshake), or drop. Returns whether the datagram
    /// authenticated.
    #[inline]
    fn carry_out(self, emit: &mut Emit<'_, '_>) -> bool {
        let inner = emit.inner;
        let landing = emit.coalescer.landing(self.datagram.len());
        // A data message of a kept session is opened with no lock held: the peer's lock is
        // taken to find the session, then to record what was opened. Anything else
        // (handshakes, cookies, unknown sessions) goes through the peer under its lock.
        let key = {
            let peer = self.slot.lock();
            peer.receiving(self.datagram)
        };
        let decision = match key.map(|key| key.open(self.datagram, landing)) {
            Some(Ok(opened)) => {
                let mut peer = self.slot.lock();
                peer.opened(
                    self.table,
                    self.slot,
                    self.from,
                    self.datagram.len(),
                    &opened,
                    landing,
                )
            }
            Some(Err(error)) => {
                // A forgery, or a session another process gave the same index: a takeover's
                // cue, like a session this process does not have.
                let now = clock::now();
                let mut peer = self.slot.lock();
                peer.failed_open(error, self.from, now)
            }
            None => {
                let now = clock::now();
                let (decision, woke) = {
                    let mut peer = self.slot.lock();
                    let decision = peer.decapsulate(
                        self.table,
                        self.slot,
                        self.from,
                        self.datagram,
                        landing,
                        now,
                    );
                    (decision, peer.woke())
                };
                inner.hand_to_timer(woke, self.slot.public_key());
                decision
            }
        };
        match decision {
            Inbound::Deliver(len) => emit.coalescer.commit(len),
            Inbound::Reply(len) => {
                emit.replies.slot()[..len].copy_from_slice(&landing[..len]);
                emit.replies.push(len, self.from);
                emit.coalescer.abandon();
                loop {
                    if emit.replies.is_full() {
                        emit.flush_replies();
                    }
                    let queued = {
                        let mut peer = self.slot.lock();
                        peer.flush_queued(emit.replies.slot())
                    };
                    let Some(len) = queued else { break };
                    emit.replies.push(len, self.from);
                }
            }
            Inbound::Nothing => emit.coalescer.abandon(),
            Inbound::Drop(reason) if reason.after_authentication() => {
                emit.coalescer.abandon();
                inner.drops.add(reason, 1);
            }
            Inbound::Drop(reason) => {
                emit.coalescer.abandon();
                inner.drops.add_received(reason, self.datagram.len());
                return false;
            }
            Inbound::TakeOver => {
                // Once per takeover: the handshake thread sends the initiation now, to an
                // endpoint where the peer authenticated.
                emit.coalescer.abandon();
                inner
                    .drops
                    .add_received(DropReason::UnknownPeer, self.datagram.len());
                if inner.takeovers.hand_over(self.slot) {
                    inner.wake_timers();
                } else {
                    self.slot.lock().withdraw_takeover();
                }
                return false;
            }
        }
        true
    }
}
