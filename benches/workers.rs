//! The data plane's packet work spread over workers, in process, with no kernel in the way: K
//! peers with established sessions, each worker sealing and opening batches of its peers'
//! packets through `core::peer::Peer` the way the daemon's workers do: one lock per batch to
//! reserve its counters (`begin_send`), the sealing in place with no lock held, and per
//! message a lock to find the session (`receiving`), the opening with none, a lock to record
//! it (`opened`). Prints aggregate throughput per worker count and the speed-up over one.
//!
//! Two ways to give peers to workers:
//! - default: each peer is owned by one worker, as the daemon steers them
//!   (`core::packet::steering::Steering`): one peer never uses more than one worker;
//! - `--shared`: every worker works on every peer, and each peer's batches are put back in
//!   order by a `sequencer::Sequencer` (`benches/workers/sequencer.rs`) per direction (numbers reserved under the peer's
//!   lock with the counters, released once sealed and opened): what one peer on several workers
//!   costs and gains;
//! - `--relay`: each peer has one reader (its owning worker), as the daemon steers it, and the
//!   other workers are its partners. The reader "reads" a batch (copies the packets into a free
//!   batch buffer), reserves its counters under the peer's lock, and hands the whole batch to an
//!   idle partner, or seals and opens it itself when none is idle; whoever finishes a batch
//!   emits it (the daemon's `sendmmsg` or TUN write) only on its turn, in read order. The unit
//!   of hand-off is a whole read (some 65 microseconds of work), not a few packets. The relay
//!   is the daemon's own (`shell::dataplane::relay`), with as many partners per reader as the
//!   daemon gives (`core::relay::partners`: one per other CPU, capped), and a batch goes to a
//!   partner only while a CPU is free for it (every reader counts as busy).
//!
//! Run: `cargo bench --bench workers -- [--peers K] [--shared | --relay] [--seconds S]
//! [--max-workers N] [--json FILE]` (defaults: 16 peers, 2 s per point, 1 to 16 workers).

use parking_lot::Mutex;
use rand_core::OsRng;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tunnelgate::config::{PublicKey, SecretKey};
use tunnelgate::core::control::PeerSpec;
use tunnelgate::core::packet::steering::Steering;
use tunnelgate::core::packet::{Inbound, Outbound, PeerLookup, PeerPath};
use tunnelgate::core::peer::{Peer, Sending};
use tunnelgate::core::relay;
// Its `next_release` and error type serve its tests (`tests/bench_sequencer.rs`).
#[allow(unreachable_pub, dead_code)]
#[path = "workers/sequencer.rs"]
mod sequencer;
use sequencer::Sequencer;
use tunnelgate::core::wg::{Limiter, SealBatch, DATA_OFFSET};
use tunnelgate::shell::dataplane::relay::{Busy, Cores, Relay, Turn};
use tunnelgate::shell::keys::GenerateKey as _;

/// Inner packet size: a full 1420-MTU IPv4 packet.
const PACKET: usize = 1420;

/// A peer table of one: every inner source belongs to the peer being decrypted.
struct Anyone;

impl PeerLookup for Anyone {
    type Peer = ();
    fn by_key(&self, _: &PublicKey) -> Option<&()> {
        Some(&())
    }
    fn by_index(&self, _: u32) -> Option<&()> {
        Some(&())
    }
    fn by_address(&self, _: IpAddr) -> Option<&()> {
        Some(&())
    }
    fn same(_: &(), _: &()) -> bool {
        true
    }
}

/// Segments per batch: what one TUN read of a 64 KB TSO super-packet gives at this MTU.
const BATCH: usize = 46;

/// The daemon's side of one peer and the peer's own side, with a session between them, and a
/// sequencer per direction (used with `--shared`).
struct Pair {
    local: Mutex<Peer>,
    remote: Mutex<Peer>,
    to_local: Mutex<Sequencer<()>>,
    to_remote: Mutex<Sequencer<()>>,
    _limiters: (Limiter, Limiter),
}

fn spec() -> PeerSpec {
    PeerSpec {
        preshared_key: None,
        persistent_keepalive: None,
        allowed_ips: Vec::new(),
        name: None,
    }
}

fn packet() -> Vec<u8> {
    let mut p = vec![0x42u8; PACKET];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(PACKET as u16).to_be_bytes());
    p[12..16].copy_from_slice(&[100, 64, 0, 2]);
    p[16..20].copy_from_slice(&[100, 64, 0, 1]);
    p
}

fn at(s: &str) -> PeerPath {
    PeerPath::to(s.parse::<SocketAddr>().expect("address"))
}

fn pair(index: u32) -> Pair {
    let (a, b) = (SecretKey::generate(), SecretKey::generate());
    let (la, lb) = (
        Limiter::new(&a.public_key(), &mut OsRng),
        Limiter::new(&b.public_key(), &mut OsRng),
    );
    let mut local = Peer::new(
        &a,
        &b.public_key(),
        &spec(),
        index,
        &la,
        None,
        Box::new(OsRng),
    );
    let mut remote = Peer::new(
        &b,
        &a.public_key(),
        &spec(),
        index,
        &lb,
        Some(at("192.0.2.1:1")),
        Box::new(OsRng),
    );
    let (mut wire, mut plain) = (vec![0u8; 2048], vec![0u8; 2048]);
    let Outbound::Send { len, .. } = remote.encapsulate(&packet(), &mut wire) else {
        panic!("no initiation");
    };
    let now = tunnelgate::shell::clock::now();
    let Inbound::Reply(len) = local.decapsulate(
        &Anyone,
        &(),
        at("192.0.2.2:1"),
        &wire[..len],
        &mut plain,
        now,
    ) else {
        panic!("no response");
    };
    let _ = remote.decapsulate(
        &Anyone,
        &(),
        at("192.0.2.1:1"),
        &plain[..len],
        &mut wire,
        now,
    );
    let len = remote.flush_queued(&mut wire).expect("queued data");
    let delivered = local.decapsulate(
        &Anyone,
        &(),
        at("192.0.2.2:1"),
        &wire[..len],
        &mut plain,
        now,
    );
    assert!(
        matches!(delivered, Inbound::Deliver(_)),
        "session not confirmed"
    );
    Pair {
        local: Mutex::new(local),
        remote: Mutex::new(remote),
        to_local: Mutex::new(Sequencer::new(SEQUENCER_BOUND)),
        to_remote: Mutex::new(Sequencer::new(SEQUENCER_BOUND)),
        _limiters: (la, lb),
    }
}

/// Numbers a peer's sequencer may have in flight: room for a batch of every worker.
const SEQUENCER_BOUND: usize = 16 * BATCH;

/// A worker's buffers: one send slot per segment of a batch, and a landing for opening.
struct Buffers {
    slots: Vec<Vec<u8>>,
    landing: Vec<u8>,
}

impl Buffers {
    fn new() -> Buffers {
        Buffers {
            slots: vec![vec![0u8; PACKET + 64]; BATCH],
            landing: vec![0u8; PACKET + 64],
        }
    }
}

/// One batch from `sender` to `receiver`: its counters (and, `shared`, its sequence numbers in
/// `order`) reserved under the sender's lock, each segment sealed in place with no lock held,
/// then opened on the receiver (lock, open with none, lock), and released in order. Returns the
/// bytes delivered.
fn one_way(
    sender: &Mutex<Peer>,
    receiver: &Mutex<Peer>,
    order: Option<&Mutex<Sequencer<()>>>,
    from: PeerPath,
    packet: &[u8],
    buffers: &mut Buffers,
) -> u64 {
    let (sending, first) = {
        let mut peer = sender.lock();
        let first = match order {
            // Full: the other workers' batches are still out; come back later.
            Some(order) => {
                let reserved = order.lock().reserve(BATCH);
                match reserved {
                    Some(first) => Some(first),
                    None => return 0,
                }
            }
            None => None,
        };
        (peer.begin_send(BATCH, BATCH * packet.len()), first)
    };
    let Sending::Seal { batch, .. } = sending else {
        return 0;
    };
    for slot in buffers.slots.iter_mut() {
        slot[DATA_OFFSET..DATA_OFFSET + packet.len()].copy_from_slice(packet);
    }
    seal_slots(&batch, packet.len(), buffers);
    let mut delivered = 0u64;
    for (i, slot) in buffers.slots.iter_mut().enumerate() {
        let ok = open_slot(receiver, from, slot, &mut buffers.landing);
        delivered += ok as u64;
        if let (Some(order), Some(first)) = (order, first) {
            let mut order = order.lock();
            order
                .complete(first + i as u64, ok.then_some(()))
                .expect("a number of this batch");
            while order.release().is_some() {}
        }
    }
    delivered * PACKET as u64
}

/// Seals every slot of `buffers` (each holding a `packet_len`-byte packet behind the header's
/// room) in place with `batch`, message `i` in slot `i`.
fn seal_slots(batch: &SealBatch, packet_len: usize, buffers: &mut Buffers) {
    for (i, slot) in buffers.slots.iter_mut().enumerate() {
        let len = batch.seal_in_place(i, slot, packet_len);
        slot.truncate(len);
    }
}

/// Opens one sealed message on `receiver` as the daemon's UDP reader does (lock to find the
/// session, open with no lock, lock to record it), then gives the slot its full size back.
/// Returns whether it was delivered.
fn open_slot(
    receiver: &Mutex<Peer>,
    from: PeerPath,
    slot: &mut Vec<u8>,
    landing: &mut [u8],
) -> bool {
    let key = receiver.lock().receiving(slot);
    let opened = key.and_then(|key| key.open(slot, landing).ok());
    let got = opened.map(|opened| {
        receiver
            .lock()
            .opened(&Anyone, &(), from, slot.len(), &opened, landing)
    });
    slot.resize(PACKET + 64, 0);
    matches!(got, Some(Inbound::Deliver(_)))
}

/// Seals every slot of `buffers` (already holding the packets) with `batch`, then opens each on
/// `receiver`. Returns the messages delivered.
fn seal_and_open(
    batch: &SealBatch,
    receiver: &Mutex<Peer>,
    from: PeerPath,
    packet_len: usize,
    buffers: &mut Buffers,
) -> u64 {
    seal_slots(batch, packet_len, buffers);
    buffers
        .slots
        .iter_mut()
        .map(|slot| open_slot(receiver, from, slot, &mut buffers.landing) as u64)
        .sum()
}

/// A batch handed from a reader to a partner (`--relay`): its buffers (the packets read) and
/// its counters.
struct Job {
    buffers: Buffers,
    batch: Option<SealBatch>,
}

/// A reader's relay (`--relay`): the daemon's own (`shell::dataplane::relay`), with the same
/// claim, hand-off, turns and sleep as its TUN and UDP readers use.
type PeerRelay = Relay<Job>;

fn new_relay(partners: usize, cores: &Arc<Cores>) -> PeerRelay {
    // One batch in hand per partner: the bound on batches in flight.
    Relay::new(partners, cores.clone(), || Job {
        buffers: Buffers::new(),
        batch: None,
    })
}

/// A partner's loop: wait for a job, do it ([`do_job`]), give the buffers back. Returns the
/// bytes delivered.
fn relay_partner(relay: &PeerRelay, me: usize, pair: &Pair, from: PeerPath) -> u64 {
    let mut bytes = 0u64;
    relay
        .serve(me, |job, turn| bytes += do_job(job, turn, pair, from))
        .expect("a partner's lock");
    bytes
}

/// A handed-off batch sealed and opened, emitted on its turn (here: nothing; in the daemon the
/// send or the write): a partner's work, and the reader's when it takes the job back. Returns
/// the bytes delivered.
fn do_job(job: &mut Job, turn: &mut Turn<'_, Job>, pair: &Pair, from: PeerPath) -> u64 {
    let Some(batch) = job.batch.take() else {
        return 0;
    };
    let delivered = seal_and_open(&batch, &pair.local, from, PACKET, &mut job.buffers);
    turn.hold();
    delivered * PACKET as u64
}

/// The reader of `pair` under `--relay`, one direction (the peer's side sends to the daemon's,
/// which opens): read a batch (into a claimed partner's buffer when one is idle, else its
/// own), reserve its counters, hand it off or do it, on its turn; a batch no partner started
/// by then it takes back, as the daemon's readers do.
fn relay_reader(relay: &PeerRelay, pair: &Pair, from: PeerPath, stop: &AtomicBool) -> u64 {
    // Always busy: it never waits for packets.
    let mut busy = Busy::new(Some(relay.cores()));
    busy.set(true);
    let packet = packet();
    let mut own = Buffers::new();
    let taken_back = std::cell::Cell::new(0u64);
    let take_back = |job: &mut Job, turn: &mut Turn<'_, Job>| {
        taken_back.set(taken_back.get() + do_job(job, turn, pair, from));
    };
    let mut bytes = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut claim = relay.claim();
        let buffers = match claim.as_mut() {
            Some(claim) => &mut claim.job().buffers,
            None => &mut own,
        };
        // The read.
        for slot in buffers.slots.iter_mut() {
            slot[DATA_OFFSET..DATA_OFFSET + PACKET].copy_from_slice(&packet);
        }
        let sending = pair.remote.lock().begin_send(BATCH, BATCH * PACKET);
        let Sending::Seal { batch, .. } = sending else {
            break;
        };
        if let Some(mut claim) = claim {
            claim.job().batch = Some(batch);
            claim.post(BATCH);
            continue;
        }
        let mut turn = relay.issue_taking_back(&take_back);
        let delivered = seal_and_open(&batch, &pair.local, from, PACKET, &mut own);
        turn.hold();
        bytes += delivered * PACKET as u64;
    }
    bytes + taken_back.get()
}

/// Bytes per second moved by one reader and `workers - 1` partners per peer (`--relay`), and
/// the share of them the partners moved.
fn measure_relay(pairs: &Arc<Vec<Pair>>, workers: usize, duration: Duration) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let by_partners = Arc::new(AtomicU64::new(0));
    // Partners beyond the CPUs only take the CPU from the one whose turn it is: a reader gets
    // the daemon's number of partners (one per other CPU, capped).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let partners = relay::partners(workers, cpus);
    // The CPUs every reader and partner share, as the daemon's data plane does: a batch goes
    // to a partner only while one is free.
    let cores = Arc::new(Cores::new(cpus));
    let relays: Arc<Vec<PeerRelay>> =
        Arc::new(pairs.iter().map(|_| new_relay(partners, &cores)).collect());
    let from = at("192.0.2.2:1");
    let mut threads = Vec::new();
    for p in 0..pairs.len() {
        for partner in 0..partners {
            let (pairs, relays, moved, by_partners) = (
                pairs.clone(),
                relays.clone(),
                moved.clone(),
                by_partners.clone(),
            );
            threads.push(std::thread::spawn(move || {
                let bytes = relay_partner(&relays[p], partner, &pairs[p], from);
                moved.fetch_add(bytes, Ordering::Relaxed);
                by_partners.fetch_add(bytes, Ordering::Relaxed);
            }));
        }
        let (pairs, relays, moved, stop) =
            (pairs.clone(), relays.clone(), moved.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let bytes = relay_reader(&relays[p], &pairs[p], from, &stop);
            moved.fetch_add(bytes, Ordering::Relaxed);
        }));
    }
    let started = tunnelgate::shell::clock::now();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    // A stop also ends every wait for a turn: nothing waits for a reader gone.
    for relay in relays.iter() {
        relay.stop();
    }
    for t in threads {
        t.join().expect("relay thread");
    }
    let total = moved.load(Ordering::Relaxed);
    let share = by_partners.load(Ordering::Relaxed) as f64 / total.max(1) as f64;
    (
        total as f64 / tunnelgate::shell::clock::since(started).as_secs_f64(),
        share,
    )
}

/// One batch each way through `pair`.
fn round_trip(pair: &Pair, shared: bool, packet: &[u8], buffers: &mut Buffers) -> u64 {
    let (to_local, to_remote) = if shared {
        (Some(&pair.to_local), Some(&pair.to_remote))
    } else {
        (None, None)
    };
    one_way(
        &pair.remote,
        &pair.local,
        to_local,
        at("192.0.2.2:1"),
        packet,
        buffers,
    ) + one_way(
        &pair.local,
        &pair.remote,
        to_remote,
        at("192.0.2.1:1"),
        packet,
        buffers,
    )
}

/// Bytes per second moved by `workers` threads over `pairs` for `duration`.
fn measure(pairs: &Arc<Vec<Pair>>, workers: usize, shared: bool, duration: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let steering = Arc::new(Steering::balanced(1..=pairs.len() as u32, workers));
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let (pairs, stop, moved) = (pairs.clone(), stop.clone(), moved.clone());
            let steering = steering.clone();
            std::thread::spawn(move || {
                let owned: Vec<&Pair> = pairs
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| shared || steering.worker_of_peer(*i as u32 + 1) == w)
                    .map(|(_, p)| p)
                    .collect();
                // A worker that owns no peer has nothing to do: the daemon's blocks in
                // poll/recvmmsg. Spinning here instead would take the CPU from the busy ones.
                if owned.is_empty() {
                    return;
                }
                let packet = packet();
                let mut buffers = Buffers::new();
                let mut bytes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for pair in &owned {
                        bytes += round_trip(pair, shared, &packet, &mut buffers);
                    }
                }
                moved.fetch_add(bytes, Ordering::Relaxed);
            })
        })
        .collect();
    let started = tunnelgate::shell::clock::now();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("worker");
    }
    moved.load(Ordering::Relaxed) as f64 / tunnelgate::shell::clock::since(started).as_secs_f64()
}

/// User and system CPU time this process has used (`/proc/self/stat`, in clock ticks of
/// 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at its closing parenthesis.
    let rest = stat.rsplit(')').next().unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let peers: usize = arg(&args, "--peers")
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let seconds: f64 = arg(&args, "--seconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    let max_workers: usize = arg(&args, "--max-workers")
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let shared = args.iter().any(|a| a == "--shared");
    let relay = args.iter().any(|a| a == "--relay");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pairs = Arc::new((1..=peers as u32).map(pair).collect::<Vec<_>>());
    let mode = if shared {
        "every worker on every peer, in order through a sequencer"
    } else if relay {
        "each peer's reader handing whole batches to the other workers, emitted in read order"
    } else {
        "each peer on its one worker"
    };
    println!("in-process data plane: {peers} peers ({mode}), {PACKET}-byte packets in batches of {BATCH}, {cpus} CPUs");
    // With a busy reader on every CPU no CPU is ever free for a partner: the relay never
    // engages, and every row would measure the readers alone (a speed-up of 1.00x that
    // cannot come out otherwise). Nothing to measure, so no figure.
    if relay && peers >= cpus {
        println!(
            "--relay with {peers} peers on {cpus} CPUs: every CPU has a busy reader, so no read ever goes to a partner; run it with fewer peers than CPUs"
        );
        std::process::exit(2);
    }
    println!(
        "{:>8} {:>12} {:>10} {:>8} {:>12} {:>9}",
        "workers", "Gbit/s", "speed-up", "CPU s", "Gbit/CPU-s", "partners"
    );
    let load_start = loadavg();
    let mut rows = Vec::new();
    let mut one = None;
    for workers in 1..=max_workers {
        let cpu_before = cpu_seconds();
        let duration = Duration::from_secs_f64(seconds);
        // The share of the bytes that partners moved (`--relay`): 0 at one worker.
        let (rate, by_partners) = if relay {
            measure_relay(&pairs, workers, duration)
        } else {
            (measure(&pairs, workers, shared, duration), 0.0)
        };
        let cpu = cpu_seconds() - cpu_before;
        let gbits = rate * 8.0 / 1e9;
        let speedup = gbits / *one.get_or_insert(gbits);
        // Bits per CPU-second: on a machine others share, the CPU the workers got bounds the
        // rate; this says what each CPU-second of theirs carried (the cost of sharing a peer).
        let per_cpu = gbits * seconds / cpu.max(1e-3);
        let partners = if relay {
            format!("{:.0} %", by_partners * 100.0)
        } else {
            "-".to_string()
        };
        println!(
            "{workers:>8} {gbits:>12.2} {speedup:>9.2}x {cpu:>8.2} {per_cpu:>12.2} {partners:>9}"
        );
        rows.push(format!(
            "{{\"workers\": {workers}, \"gbit_per_s\": {gbits:.3}, \"speedup\": {speedup:.3}, \"cpu_s\": {cpu:.3}, \"gbit_per_cpu_s\": {per_cpu:.3}, \"partners_share\": {by_partners:.3}}}"
        ));
    }
    if let Some(path) = arg(&args, "--json") {
        let json = format!(
            "{{\"peers\": {peers}, \"shared\": {shared}, \"relay\": {relay}, \"packet_bytes\": {PACKET}, \"batch\": {BATCH}, \"cpus\": {cpus}, \"seconds\": {seconds}, \"loadavg_start\": \"{load_start}\", \"loadavg_end\": \"{}\", \"points\": [{}]}}\n",
            loadavg(),
            rows.join(", ")
        );
        std::fs::write(&path, json).expect("write the JSON results");
    }
}
