//! The data plane's one owner: the TUN queues, the WireGuard sockets, the peer table, the
//! packet workers and the timer thread, behind a small API (apply peers, rebind, set mark,
//! stats, liveness, stop). Its fields are private; what each packet means is decided by
//! `core::packet` and `core::peer`; the loops live in [`workers`].
//!
//! Threads: each of N workers has a TUN reader (its own TUN queue: read, split, encrypt, send)
//! and a UDP reader (its own socket of a reuse-port group: receive, decrypt, write to its TUN
//! queue); one timer thread drives every peer's handshakes and keepalives. The kernel keeps a
//! flow on one TUN queue and the steering program sends a peer's datagrams to one socket, so a
//! flow's packets stay in order. Beside each reader, with more than one worker, up to
//! `min(workers, CPUs) - 1` partners (`core::relay::partners`) take whole
//! reads from it and emit them in read order ([`relay`]), so one peer's traffic uses more than
//! one core. No lock guard lives across a system call: a peer's lock is taken to reserve a
//! read's counters, or for one decrypt's lookup and record, and the batch is sent after.

mod handshakes;
mod readers;
pub mod relay;
mod send;
mod table;
mod takeover;
mod timers;
mod workers;

pub use readers::ReadersView;
pub use table::TableChange;

use crate::config::{PublicKey, SecretKey};
use crate::core::control::{PeerChanges, PeerSpec};
use crate::core::liveness::{Fatal, Heartbeats, PacketThread, STALL_LIMIT};
use crate::core::packet::steering::Steering;
use crate::core::packet::{DropCounters, DropStats};
use crate::core::peer::{PeerCounters, PeerStats};
use crate::core::priority::{Access, SharedBudget};
use crate::core::takeover::{Answer, Learned, Origin};
use crate::shell::fatal::{panic_message, Fatals};
use crate::shell::priority::ReaderSpawner;
use crate::shell::tuning::Tuning;
use crate::shell::udp::WgSocket;
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use table::PeerTable;
use tun_rs::SyncDevice;

/// How long [`Dataplane::stop`] waits for the threads: one idle wake plus a loaded machine's
/// scheduling delay. A thread still running then is wedged; waiting longer would wedge the
/// caller too.
const STOP_WAIT: Duration = Duration::from_secs(3);

/// Peers not configured (yet) whose learned endpoints are kept for when they are added: the
/// kernel's peer limit.
const LEARNED_FOR_LATER: usize = 1 << 20;

/// Most packet workers the default picks, whatever the machine: past this, more threads on one
/// TUN device only contend.
const MAX_DEFAULT_WORKERS: usize = 16;

/// The workers a data plane gets when the configuration does not say: the CPUs this process
/// may use (its affinity mask and cgroup quota, so a pod limited to `cpu: 2` gets 2).
pub fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_DEFAULT_WORKERS)
}

/// Whole CPUs the packet threads may use (affinity or quota, whichever is lower).
pub fn usable_cpus(tuning: &Tuning) -> usize {
    usize::try_from(tuning.usable_cpus_milli() / 1000).unwrap_or(1)
}

/// Relay partners per packet reader with `workers` workers under `tuning`: one per other CPU
/// the workers may use, capped, none with one worker (`core::relay::partners`), and at most
/// what the tuning allows (`core::relay::allowed`: on unless turned off).
pub fn relay_partners(tuning: &Tuning, workers: usize) -> usize {
    crate::core::relay::partners(workers, usable_cpus(tuning))
        .min(crate::core::relay::allowed(tuning.relay_partners))
}

/// How the packet threads run, decided once at start by the composition root: the tuning in
/// force, how the readers reach real-time priority, what starts them, and where a thread's
/// death (or the TUN device's) is recorded: the process's one record, which the other
/// long-lived parts report to as well.
#[derive(Clone)]
pub struct ThreadSetup {
    pub tuning: Arc<Tuning>,
    pub access: Access,
    pub spawner: ReaderSpawner,
    pub fatals: Fatals,
}

impl ThreadSetup {
    /// `tuning` with the readers at normal priority, started like any thread: for tests and
    /// benches that build a data plane without the composition root.
    pub fn normal_priority(tuning: Tuning) -> ThreadSetup {
        ThreadSetup {
            tuning: Arc::new(tuning),
            access: Access::Off,
            spawner: ReaderSpawner::default(),
            fatals: Fatals::new(),
        }
    }
}

/// One peer as status, metrics and UAPI `get` see it.
#[derive(Debug, Clone)]
pub struct PeerView {
    pub public_key: PublicKey,
    pub spec: PeerSpec,
    pub stats: PeerStats,
}

/// The interface's identity as the data plane runs it.
#[derive(Debug, Clone)]
pub struct Identity {
    /// `None` after UAPI removed the key.
    pub private_key: Option<SecretKey>,
    pub public_key: PublicKey,
}

/// Packet threads that did not end within [`STOP_WAIT`] of a stop request; they are left
/// detached.
#[derive(Debug, thiserror::Error)]
#[error("packet threads still running after {STOP_WAIT:?}: {}", .0.join(", "))]
pub struct StillRunning(pub Vec<String>);

/// The data plane. Made with its devices and sockets, it moves packets from [`Dataplane::start`]
/// until [`Dataplane::stop`] (or drop).
pub struct Dataplane {
    inner: Arc<Inner>,
    stopped: AtomicBool,
}

/// What the threads share. Private to the data plane: the workers read it, the owner changes it.
/// Jobs relay partners did, counted once a job, where a partner takes it up.
#[derive(Default)]
struct PartnerJobs {
    sealed: AtomicU64,
    opened: AtomicU64,
}

struct Inner {
    table: RwLock<Arc<PeerTable>>,
    /// One TUN queue per worker.
    queues: Vec<SyncDevice>,
    /// One socket per worker (a reuse-port group), replaced whole on rebind.
    sockets: RwLock<Arc<Vec<WgSocket>>>,
    drops: DropCounters,
    stop: AtomicBool,
    /// Milliseconds since `epoch` at which each packet thread last woke.
    heartbeats: Heartbeats,
    epoch: Instant,
    /// Every packet thread started (UDP readers of replaced sockets included), for the join.
    handles: Mutex<Vec<JoinHandle<()>>>,
    /// Stops each relay started, for [`Dataplane::stop`]: a relay's partners end when it stops,
    /// not only when its reader exits (a reader stuck in a wait would keep them).
    relay_stops: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
    /// How the packet threads run, and the process's record of fatal errors
    /// (`threads.fatals`): a packet thread's panic, the TUN device gone.
    threads: ThreadSetup,
    /// What all packet readers together may spend at real-time priority.
    realtime_budget: SharedBudget,
    /// Each reader's priority as it runs.
    readers: readers::ReaderStates,
    /// Jobs relay partners did: reads sealed and receive batches opened (not those their
    /// readers took back).
    partner_jobs: PartnerJobs,
    /// The CPUs the packet threads may use and how many are busy: relay partners take one only
    /// while one is free.
    cores: Arc<relay::Cores>,
    /// Handshake messages on their way from the readers to the timer thread.
    handshakes: handshakes::HandshakeQueue,
    /// The timer thread, once started: a reader that queued a handshake or asks for a
    /// takeover wakes it.
    timers: std::sync::OnceLock<std::thread::Thread>,
    /// The further handshake threads (`tg-hs-N`), woken with the timer thread.
    handshake_threads: Mutex<Vec<std::thread::Thread>>,
    /// Peers whose data named a session this process does not have, on their way from the
    /// readers to the handshake thread, and which sources a takeover may answer.
    takeovers: takeover::Requests,
    /// The counters of peers removed (or made again with a new session) since the start: with
    /// the live peers', the interface's totals, which so only grow.
    departed: Mutex<PeerCounters>,
    /// Endpoints learned of peers not configured yet, for when they are added.
    learned_for_later: Mutex<HashMap<PublicKey, (SocketAddr, Origin)>>,
    /// Peers handed to the timer thread since it last looked: woken by a packet, a handshake
    /// or a takeover ([`crate::core::peer::Peer::woke`]), or changed by a peer update. The
    /// timer walks only the peers on its list ([`timers`]).
    woke: Mutex<Vec<PublicKey>>,
    /// Which worker owns which peer: the program installed on the sockets, kept to pick the
    /// socket a peer's timer messages leave from and to install again on new sockets.
    steering: RwLock<Arc<Steering>>,
}

impl Dataplane {
    /// A data plane over `queues` (one TUN queue per worker) and `sockets` (one per worker,
    /// from [`WgSocket::bind_group`]), with no peers yet. Nothing moves until
    /// [`Dataplane::start`].
    pub fn new(
        queues: Vec<SyncDevice>,
        sockets: Vec<WgSocket>,
        private_key: Option<SecretKey>,
        threads: ThreadSetup,
    ) -> std::io::Result<Dataplane> {
        if queues.is_empty() || queues.len() != sockets.len() {
            return Err(std::io::Error::other(format!(
                "{} TUN queues for {} sockets: one of each per worker",
                queues.len(),
                sockets.len()
            )));
        }
        let workers = queues.len();
        let cores = Arc::new(relay::Cores::new(usable_cpus(&threads.tuning)));
        let epoch = crate::shell::clock::now();
        let realtime_budget = SharedBudget::new(
            threads.tuning.rt_budget,
            threads.tuning.usable_cpus_milli(),
            epoch,
        );
        Ok(Dataplane {
            inner: Arc::new(Inner {
                table: RwLock::new(Arc::new(PeerTable::empty(private_key))),
                queues,
                sockets: RwLock::new(Arc::new(sockets)),
                drops: DropCounters::default(),
                stop: AtomicBool::new(false),
                heartbeats: Heartbeats::new(workers),
                epoch,
                handles: Mutex::new(Vec::new()),
                relay_stops: Mutex::new(Vec::new()),
                threads,
                realtime_budget,
                readers: readers::ReaderStates::new(workers),
                partner_jobs: PartnerJobs::default(),
                cores,
                handshakes: handshakes::HandshakeQueue::new(epoch),
                timers: std::sync::OnceLock::new(),
                handshake_threads: Mutex::new(Vec::new()),
                takeovers: takeover::Requests::new(),
                departed: Mutex::new(PeerCounters::default()),
                learned_for_later: Mutex::new(HashMap::new()),
                woke: Mutex::new(Vec::new()),
                steering: RwLock::new(Arc::new(Steering::plain(workers))),
            }),
            stopped: AtomicBool::new(false),
        })
    }

    /// Starts every worker's TUN and UDP readers and the timer thread. If one cannot be
    /// started, the ones already running are stopped before the error is returned.
    pub fn start(&self) -> std::io::Result<()> {
        install_panic_hook();
        if let Some(lowered) = crate::core::knobs::relay_lowered(
            self.inner.threads.tuning.relay_partners,
            self.workers(),
            usable_cpus(&self.inner.threads.tuning),
        ) {
            tracing::warn!("{lowered}");
        }
        let started = (|| {
            let partners = self.inner.partners();
            for worker in 0..self.workers() {
                let relay = (partners > 0).then(|| {
                    Arc::new(workers::TunRelay::new(
                        partners,
                        self.inner.cores.clone(),
                        workers::SealJob::new,
                    ))
                });
                if let Some(relay) = &relay {
                    // Weak: a relay gone with its reader and partners is not kept for this.
                    let relay = Arc::downgrade(relay);
                    self.inner.relay_stops.lock().push(Box::new(move || {
                        if let Some(relay) = relay.upgrade() {
                            relay.stop();
                        }
                    }));
                }
                let reader_relay = relay.clone();
                // The reader first: partners whose reader never started would wait for ever.
                self.inner
                    .spawn(PacketThread::TunReader(worker), move |inner| {
                        workers::tun_loop(inner, worker, reader_relay.as_deref())
                    })?;
                for me in 0..partners {
                    let relay = relay.clone().expect("partners have a relay");
                    let name = format!("tg-tun-h{worker}-{me}");
                    self.inner.spawn_partner(name.clone(), move |inner| {
                        workers::tun_partner(inner, worker, &relay, me, &name)
                    })?;
                }
            }
            self.inner.spawn(PacketThread::Timers, timers::timer_loop)?;
            // Handshakes and takeovers also on a thread per further worker: a restart's
            // thousands of takeovers, or a thousand peers rekeying at once, use every CPU.
            for me in 1..self.workers() {
                self.inner
                    .spawn(PacketThread::Handshakes(me), move |inner| {
                        timers::handshake_loop(inner, me)
                    })?;
            }
            Inner::start_udp_readers(&self.inner)
        })();
        if started.is_err() {
            let _ = self.stop();
        }
        started
    }

    pub fn workers(&self) -> usize {
        self.inner.queues.len()
    }

    /// Carries out a peer change from the control core in time linear in what it names (the
    /// next table shares every untouched peer with the current one), and shares the peers out
    /// over the workers again ([`Steering::balanced_tally`]) when that changes who owns what. A peer added
    /// gets what was learned of it before it existed ([`Dataplane::learn_endpoints`]).
    pub fn apply_peers(&self, changes: &PeerChanges) -> TableChange {
        let current = self.inner.snapshot();
        let (next, change) = current.apply(changes);
        let waited: Vec<_> = {
            let mut waiting = self.inner.learned_for_later.lock();
            if waiting.is_empty() {
                Vec::new()
            } else {
                change
                    .added
                    .iter()
                    .filter_map(|key| waiting.remove(key).map(|learned| (*key, learned)))
                    .collect()
            }
        };
        for (key, (endpoint, origin)) in waited {
            if let Some(slot) = next.slot(&key) {
                slot.lock().learn(endpoint, origin);
            }
        }
        // Who owns which worker changes only when a peer comes, goes or gets a new index, and
        // then from the table's count per byte value: never a walk over the peers.
        // What the peers that go (or start a new session) moved stays in the totals.
        let gone: Vec<PeerCounters> = (change.removed.iter().chain(&change.reset))
            .filter_map(|key| current.slot(key))
            .filter(|slot| !next.holds(slot))
            .map(|slot| slot.lock().stats().counters)
            .collect();
        if !gone.is_empty() {
            let mut departed = self.inner.departed.lock();
            for c in &gone {
                add_counters(&mut departed, c);
            }
        }
        let steering = next.steering_after(&change, self.workers());
        *self.inner.table.write() = Arc::new(next);
        // A peer made or changed may need the timer at once (a persistent keepalive's first
        // handshake); the timer looks and keeps only those that do. O(changed).
        self.inner
            .woke
            .lock()
            .extend(changes.upsert.iter().map(|u| u.public_key));
        if let Some(steering) = steering {
            if steering != **self.inner.steering.read() {
                self.inner.steer(steering);
            }
        }
        change
    }

    /// Replaces the sockets with a new group on `port` (0: any); the old readers end with their
    /// sockets. Returns the port bound.
    pub fn rebind(&self, port: u16, fwmark: Option<u32>) -> std::io::Result<u16> {
        let options = self.inner.threads.tuning.socket_options();
        let group = WgSocket::bind_group(port, fwmark, &self.inner.steering(), &options)?;
        let bound = group[0].local_port()?;
        let old = std::mem::replace(&mut *self.inner.sockets.write(), Arc::new(group));
        for socket in old.iter() {
            socket.shutdown();
        }
        Inner::start_udp_readers(&self.inner)?;
        Ok(bound)
    }

    /// Marks every WireGuard socket (policy routing of the tunnel's own traffic).
    pub fn set_mark(&self, mark: u32) -> std::io::Result<()> {
        self.inner
            .sockets()
            .iter()
            .try_for_each(|s| s.set_mark(mark))
    }

    pub fn listen_port(&self) -> u16 {
        self.inner
            .sockets()
            .first()
            .and_then(|s| s.local_port().ok())
            .unwrap_or(0)
    }

    /// Whether segmentation and coalescing offloads are in use, for the startup log.
    pub fn offloads(&self) -> (bool, bool) {
        self.inner
            .sockets()
            .first()
            .map_or((false, false), |s| s.offloads())
    }

    pub fn identity(&self) -> Identity {
        let table = self.inner.snapshot();
        Identity {
            private_key: table.private_key().cloned(),
            public_key: *table.public_key(),
        }
    }

    /// Which sources a takeover may answer (`takeover.answer_any_source`).
    pub fn set_takeover_answer(&self, answer: Answer) {
        self.inner.takeovers.set_answer(answer);
    }

    /// Endpoints where this identity saw peers authenticate, by `origin` (before a restart, or
    /// at another replica): each the peer's newest, where a takeover may go. A peer not (yet)
    /// configured gets its endpoint when it is added (at most [`LEARNED_FOR_LATER`] such peers
    /// are kept).
    pub fn learn_endpoints(&self, peers: BTreeMap<PublicKey, SocketAddr>, origin: Origin) {
        let table = self.inner.snapshot();
        let mut later = Vec::new();
        for (key, endpoint) in peers {
            match table.slot(&key) {
                Some(slot) => slot.lock().learn(endpoint, origin),
                None => later.push((key, endpoint)),
            }
        }
        if !later.is_empty() {
            let mut waiting = self.inner.learned_for_later.lock();
            for (key, endpoint) in later {
                if waiting.len() < LEARNED_FOR_LATER || waiting.contains_key(&key) {
                    waiting.insert(key, (endpoint, origin));
                }
            }
        }
    }

    /// The peers whose learned endpoints changed since the last call, each with its newest.
    pub fn learned_news(&self) -> Vec<(PublicKey, Learned)> {
        let table = self.inner.snapshot();
        table
            .peers()
            .filter_map(|slot| {
                let newest = {
                    let mut peer = slot.lock();
                    if !peer.take_learned_news() {
                        return None;
                    }
                    let newest = peer.known_endpoints().newest();
                    newest
                };
                newest.map(|e| (*slot.public_key(), e))
            })
            .collect()
    }

    /// Every peer's newest learned endpoint (peers that learned none are left out).
    pub fn learned_endpoints(&self) -> Vec<(PublicKey, SocketAddr)> {
        let table = self.inner.snapshot();
        table
            .peers()
            .filter_map(|slot| {
                let newest = {
                    let peer = slot.lock();
                    let newest = peer.known_endpoints().newest();
                    newest
                };
                newest.map(|e| (*slot.public_key(), e.addr))
            })
            .collect()
    }

    /// The counters of the peers removed (or made again) since the start, added up.
    pub fn departed(&self) -> PeerCounters {
        *self.inner.departed.lock()
    }

    /// How many peers there are.
    pub fn peer_count(&self) -> usize {
        self.inner.snapshot().peer_count()
    }

    /// Every peer with a copy of its counters and path.
    pub fn peers(&self) -> Vec<PeerView> {
        let mut out = Vec::new();
        self.for_each_peer(|public_key, spec, stats| {
            out.push(PeerView {
                public_key: *public_key,
                spec: spec.clone(),
                stats,
            });
        });
        out
    }

    /// Calls `f` with each peer's key, spec and a copy of its counters and path, in key order,
    /// from one snapshot of the table, collecting nothing: a caller with 100,000 peers makes
    /// its output piece by piece. Each peer's lock is held only to copy its counters.
    pub fn for_each_peer(&self, mut f: impl FnMut(&PublicKey, &PeerSpec, PeerStats)) {
        let table = self.inner.snapshot();
        for slot in table.peers() {
            let stats = slot.lock().stats();
            f(slot.public_key(), slot.spec(), stats);
        }
    }

    pub fn drops(&self) -> DropStats {
        self.inner.drops.snapshot()
    }

    /// The packet readers' priority as they run.
    pub fn readers(&self) -> ReadersView {
        self.inner.readers.view()
    }

    /// Jobs relay partners did so far: (reads sealed, receive batches opened).
    pub fn partner_jobs(&self) -> (u64, u64) {
        let jobs = &self.inner.partner_jobs;
        (
            jobs.sealed.load(Ordering::Relaxed),
            jobs.opened.load(Ordering::Relaxed),
        )
    }

    /// How the packet threads run (the tuning in force, the readers' real-time access).
    pub fn thread_setup(&self) -> &ThreadSetup {
        &self.inner.threads
    }

    /// Ok while every packet thread wakes within [`STALL_LIMIT`] and nothing fatal is
    /// recorded; otherwise why not (a thread's name, or the fatal error: a part of the process
    /// that died, whichever, or the TUN device gone). Cheap: what `/healthz` asks on every
    /// probe.
    pub fn liveness(&self) -> Result<(), String> {
        if let Some(fatal) = self.inner.threads.fatals.get() {
            return Err(fatal.to_string());
        }
        self.inner
            .heartbeats
            .check(self.inner.now_ms(), STALL_LIMIT)
    }

    /// The fatal error, once there is one.
    pub fn fatal(&self) -> Option<Fatal> {
        self.inner.threads.fatals.get()
    }

    /// Completes once something fatal is recorded (a packet thread died, the TUN device was
    /// deleted, or any other long-lived part of the process died), with the reason; the
    /// process then stops. Pending forever otherwise.
    pub async fn fatal_error(&self) -> String {
        self.inner.threads.fatals.wait().await.to_string()
    }

    /// Stops every packet thread (UDP readers of replaced sockets too) and waits up to
    /// [`STOP_WAIT`] for them to end. Later calls do nothing.
    pub fn stop(&self) -> Result<(), StillRunning> {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.inner.stop.store(true, Ordering::Relaxed);
        // Wakes the UDP readers now rather than at their next receive timeout.
        for socket in self.inner.sockets().iter() {
            socket.shutdown();
        }
        // The relays' partners, and every wait for a turn, end now, whatever their readers do.
        for stop in std::mem::take(&mut *self.inner.relay_stops.lock()) {
            stop();
        }
        let deadline = crate::shell::clock::now() + STOP_WAIT;
        let threads = std::mem::take(&mut *self.inner.handles.lock());
        // The timer thread waits for its tick parked: wake it now.
        for t in &threads {
            t.thread().unpark();
        }
        while crate::shell::clock::now() < deadline && !threads.iter().all(JoinHandle::is_finished)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut running = Vec::new();
        for t in threads {
            if t.is_finished() {
                self.inner.reap(t);
            } else {
                running.push(t.thread().name().unwrap_or("unnamed").to_string());
            }
        }
        if !running.is_empty() {
            return Err(StillRunning(running));
        }
        // Every reader is gone: close the sockets now, so the port is free at once for a new
        // instance of this interface (WireGuard's own tests delete one and start the next
        // at once), not only when the rest of the teardown is done.
        *self.inner.sockets.write() = Arc::new(Vec::new());
        Ok(())
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "Packet threads did not stop");
        }
    }
}

/// Adds `c`'s counts to `sum` (durations and the latest takeover are not sums: left alone).
fn add_counters(sum: &mut PeerCounters, c: &PeerCounters) {
    for (s, n) in [
        (&mut sum.rx_bytes, c.rx_bytes),
        (&mut sum.tx_bytes, c.tx_bytes),
        (&mut sum.rx_packets, c.rx_packets),
        (&mut sum.tx_packets, c.tx_packets),
        (&mut sum.handshakes_initiated, c.handshakes_initiated),
        (&mut sum.handshakes_answered, c.handshakes_answered),
        (&mut sum.handshake_failures, c.handshake_failures),
        (&mut sum.takeovers_started, c.takeovers_started),
        (&mut sum.takeovers_completed, c.takeovers_completed),
        (&mut sum.takeovers_failed, c.takeovers_failed),
        (&mut sum.takeovers_no_endpoint, c.takeovers_no_endpoint),
    ] {
        *s = s.saturating_add(n);
    }
}

std::thread_local! {
    /// Whether this thread is a packet thread under its seccomp filter.
    static CONFINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling packet thread as confined by seccomp: a panic in it is then said without a
/// backtrace ([`install_panic_hook`]).
fn mark_confined() {
    CONFINED.with(|c| c.set(true));
}

/// Installs, once per process, a panic hook under which a confined packet thread's panic is
/// logged with its message and place but no backtrace. std's own hook, with `RUST_BACKTRACE`
/// set, reads the working directory and the executable to print one: system calls the packet
/// threads' seccomp filter kills the process for (`SIGSYS`), before the panic could reach
/// [`Inner::run_guarded`] and become the fatal error `/healthz` names. Other threads keep
/// std's hook.
fn install_panic_hook() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let std_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CONFINED.with(std::cell::Cell::get) {
                let thread = std::thread::current();
                tracing::error!(
                    thread = thread.name().unwrap_or("unnamed"),
                    "Packet thread {info}"
                );
            } else {
                std_hook(info);
            }
        }));
    });
}

impl Inner {
    /// `woke` (from [`crate::core::peer::Peer::woke`], under the peer's lock, let go since):
    /// the timer thread takes the peer on its list at its next tick.
    pub(super) fn hand_to_timer(&self, woke: bool, key: &PublicKey) {
        if woke {
            self.woke.lock().push(*key);
        }
    }

    fn snapshot(&self) -> Arc<PeerTable> {
        self.table.read().clone()
    }

    fn sockets(&self) -> Arc<Vec<WgSocket>> {
        self.sockets.read().clone()
    }

    fn steering(&self) -> Arc<Steering> {
        self.steering.read().clone()
    }

    /// Installs `steering` on the sockets and keeps it. Refused, the sockets keep the program
    /// they have and the steering it stands for.
    fn steer(&self, steering: Steering) {
        match WgSocket::steer(&self.sockets(), &steering) {
            Ok(()) => {
                tracing::debug!(
                    moved = steering.moved().len(),
                    "Peers shared out over the workers"
                );
                *self.steering.write() = Arc::new(steering);
            }
            Err(error) => {
                tracing::warn!(%error, "UDP steering program refused; peers stay on the workers they had");
            }
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(crate::shell::clock::since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// Wakes the timer thread and the other handshake threads now (handshakes were queued, or
    /// a takeover was asked for), rather than at their next wake; no system call for one that
    /// is not parked.
    fn wake_timers(&self) {
        if let Some(t) = self.timers.get() {
            t.unpark();
        }
        let helpers = self.handshake_threads.lock();
        for t in helpers.iter() {
            t.unpark();
        }
    }

    fn beat(&self, thread: PacketThread) {
        #[cfg(feature = "test-hooks")]
        {
            use crate::shell::fatal::Part;
            let part = match thread {
                PacketThread::TunReader(_) => Some(Part::TunReader),
                PacketThread::UdpReader(_) => Some(Part::UdpReader),
                PacketThread::Timers => Some(Part::Timers),
                // The `timers` hook is the timer thread's: were a handshake thread to answer it
                // too, which of them died first would be a race.
                PacketThread::Handshakes(_) => None,
            };
            if let Some(part) = part {
                crate::shell::test_hooks::panic_point(part);
            }
        }
        self.heartbeats.beat(thread, self.now_ms());
    }

    /// Records a packet thread's death (`why` names it: a relay partner that failed); the
    /// process stops on it, exit 1, and `/healthz` says it meanwhile.
    fn raise_fatal(&self, why: String) {
        self.threads.fatals.died(why);
    }

    /// Records that the TUN device is gone (deleted under the process); only the first
    /// reason counts (every worker's TUN reader sees the device go). A normal end in userspace
    /// mode, a failure of `run` (`core::liveness::Fatal::is_failure`).
    fn device_gone(&self, why: String) {
        self.threads.fatals.raise(Fatal::Deleted(why));
    }

    /// One UDP reader per socket of the current group. The group of now, not of when the
    /// threads first run: after two quick replacements, two readers on the newest socket would
    /// reorder its flows.
    fn start_udp_readers(inner: &Arc<Inner>) -> std::io::Result<()> {
        let group = inner.sockets();
        let partners = inner.partners();
        for worker in 0..group.len() {
            let relay = (partners > 0)
                .then(|| Arc::new(workers::UdpRelay::new(partners, inner.cores.clone())));
            if let Some(relay) = &relay {
                // Weak: the relays of a replaced socket group go with their threads.
                let relay = Arc::downgrade(relay);
                inner.relay_stops.lock().push(Box::new(move || {
                    if let Some(relay) = relay.upgrade() {
                        relay.stop();
                    }
                }));
            }
            let (reader_group, reader_relay) = (group.clone(), relay.clone());
            // The reader first: partners whose reader never started would wait for ever.
            inner.spawn(PacketThread::UdpReader(worker), move |inner| {
                workers::udp_loop(
                    inner,
                    worker,
                    &reader_group[worker],
                    reader_relay.as_deref(),
                )
            })?;
            for me in 0..partners {
                let (group, relay) = (group.clone(), relay.clone().expect("partners have a relay"));
                let name = format!("tg-udp-h{worker}-{me}");
                inner.spawn_partner(name.clone(), move |inner| {
                    workers::udp_partner(inner, worker, &group[worker], &relay, me, &name)
                })?;
            }
        }
        Ok(())
    }

    /// Partners per packet reader: one per other CPU the workers may use, capped, none with
    /// one worker (`core::relay::partners`), and at most what the tuning allows (none by
    /// default).
    fn partners(&self) -> usize {
        relay_partners(&self.threads.tuning, self.queues.len())
    }

    /// Starts a relay partner named `name`: at normal priority, started here and not by the
    /// reader spawner, so it never holds `CAP_SYS_NICE` (its CPU time is not the readers'
    /// real-time budget's); joined by [`Dataplane::stop`] like the readers.
    fn spawn_partner(
        self: &Arc<Self>,
        name: String,
        body: impl FnOnce(&Inner) + Send + 'static,
    ) -> std::io::Result<()> {
        let inner = self.clone();
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                inner.run_guarded(&name, |inner| {
                    #[cfg(feature = "test-hooks")]
                    crate::shell::test_hooks::partner_starts(&inner.stop);
                    body(inner);
                });
            })?;
        self.keep_for_the_join(handle);
        Ok(())
    }

    /// Keeps a started packet thread's handle for [`Dataplane::stop`] to join (and joins
    /// those that have ended).
    fn keep_for_the_join(&self, handle: JoinHandle<()>) {
        let ended: Vec<JoinHandle<()>> = {
            let mut threads = self.handles.lock();
            let (ended, running) = std::mem::take(&mut *threads)
                .into_iter()
                .partition(JoinHandle::is_finished);
            *threads = running;
            threads.push(handle);
            ended
        };
        for t in ended {
            self.reap(t);
        }
    }

    /// Joins an ended packet thread: one that panicked past [`Inner::run_guarded`] (it
    /// cannot, but its result is not thrown away) is the data plane's fatal error.
    fn reap(&self, thread: JoinHandle<()>) {
        let name = thread.thread().name().unwrap_or("unnamed").to_string();
        if let Err(panic) = thread.join() {
            self.raise_fatal(format!(
                "packet thread {name} panicked: {}",
                panic_message(panic.as_ref())
            ));
        }
    }

    /// Runs a packet thread's `body`: a panic in it (a reader's, a relay partner's, the
    /// timers') is recorded as the thread's death, so `/healthz` fails with it and the process
    /// exits non-zero, in every mode, rather than run on with a data path that moves less, or
    /// nothing.
    fn run_guarded(&self, name: &str, body: impl FnOnce(&Inner)) {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(self)));
        if let Err(panic) = ran {
            self.raise_fatal(format!(
                "packet thread {name} panicked: {}",
                panic_message(panic.as_ref())
            ));
        }
    }

    /// Starts `thread`: a packet reader through the reader spawner (where only the readers may
    /// hold `CAP_SYS_NICE`), the timer thread directly.
    fn spawn(
        self: &Arc<Self>,
        thread: PacketThread,
        body: impl FnOnce(&Inner) + Send + 'static,
    ) -> std::io::Result<()> {
        let inner = self.clone();
        let name = thread.name();
        let run = move || inner.run_guarded(&name, body);
        let handle = match thread {
            PacketThread::Timers => {
                let handle = std::thread::Builder::new().name(thread.name()).spawn(run)?;
                let _ = self.timers.set(handle.thread().clone());
                handle
            }
            PacketThread::Handshakes(_) => {
                let handle = std::thread::Builder::new().name(thread.name()).spawn(run)?;
                self.handshake_threads.lock().push(handle.thread().clone());
                handle
            }
            PacketThread::TunReader(_) | PacketThread::UdpReader(_) => {
                self.threads.spawner.spawn(thread.name(), run)?
            }
        };
        self.keep_for_the_join(handle);
        Ok(())
    }
}
