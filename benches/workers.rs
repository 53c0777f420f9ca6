//! The data plane's packet work spread over workers, in process, with no kernel in the way: K
//! peers with established sessions, owned by N worker threads the way the daemon steers them
//! (`core::packet::steering::worker_of_peer`), each worker encrypting and decrypting its peers'
//! packets through `core::peer::Peer` behind one lock per peer, as the daemon's workers do.
//! Prints aggregate throughput per worker count and the speed-up over one worker.
//!
//! Run: `cargo bench --bench workers -- [--peers K] [--seconds S] [--max-workers N] [--json FILE]`
//! (defaults: 16 peers, 2 s per point, 1 to 16 workers).

use parking_lot::Mutex;
use rand_core::OsRng;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tunnelgate::config::{PublicKey, SecretKey};
use tunnelgate::core::control::PeerSpec;
use tunnelgate::core::packet::steering::worker_of_peer;
use tunnelgate::core::packet::{Inbound, Outbound, PeerLookup, PeerPath};
use tunnelgate::core::peer::Peer;
use tunnelgate::core::wg::Limiter;

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

/// The daemon's side of one peer and the peer's own side, with a session between them.
struct Pair {
    local: Mutex<Peer>,
    remote: Mutex<Peer>,
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
    let Inbound::Reply(len) =
        local.decapsulate(&Anyone, &(), at("192.0.2.2:1"), &wire[..len], &mut plain)
    else {
        panic!("no response");
    };
    let _ = remote.decapsulate(&Anyone, &(), at("192.0.2.1:1"), &plain[..len], &mut wire);
    let len = remote.flush_queued(&mut wire).expect("queued data");
    let delivered = local.decapsulate(&Anyone, &(), at("192.0.2.2:1"), &wire[..len], &mut plain);
    assert!(
        matches!(delivered, Inbound::Deliver(_)),
        "session not confirmed"
    );
    Pair {
        local: Mutex::new(local),
        remote: Mutex::new(remote),
        _limiters: (la, lb),
    }
}

/// One round trip through `pair`: the peer encrypts, we decrypt; we encrypt, the peer decrypts.
/// Each lock is held for one call, as in the daemon.
fn round_trip(pair: &Pair, packet: &[u8], wire: &mut [u8], plain: &mut [u8]) -> u64 {
    let from_remote = at("192.0.2.2:1");
    let from_local = at("192.0.2.1:1");
    let sent = pair.remote.lock().encapsulate(packet, wire);
    let Outbound::Send { len, .. } = sent else {
        return 0;
    };
    let got = pair
        .local
        .lock()
        .decapsulate(&Anyone, &(), from_remote, &wire[..len], plain);
    let mut moved = matches!(got, Inbound::Deliver(_)) as u64;
    let sent = pair.local.lock().encapsulate(packet, wire);
    if let Outbound::Send { len, .. } = sent {
        let got = pair
            .remote
            .lock()
            .decapsulate(&Anyone, &(), from_local, &wire[..len], plain);
        moved += matches!(got, Inbound::Deliver(_)) as u64;
    }
    moved * PACKET as u64
}

/// Bytes per second moved by `workers` threads over `pairs` for `duration`.
fn measure(pairs: &Arc<Vec<Pair>>, workers: usize, duration: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let (pairs, stop, moved) = (pairs.clone(), stop.clone(), moved.clone());
            std::thread::spawn(move || {
                let owned: Vec<&Pair> = pairs
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| worker_of_peer(*i as u32 + 1, workers) == w)
                    .map(|(_, p)| p)
                    .collect();
                // A worker that owns no peer has nothing to do: the daemon's blocks in
                // poll/recvmmsg. Spinning here instead would take the CPU from the busy ones.
                if owned.is_empty() {
                    return;
                }
                let packet = packet();
                let (mut wire, mut plain) = (vec![0u8; 2048], vec![0u8; 2048]);
                let mut bytes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for pair in &owned {
                        bytes += round_trip(pair, &packet, &mut wire, &mut plain);
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
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pairs = Arc::new((1..=peers as u32).map(pair).collect::<Vec<_>>());
    println!("in-process data plane: {peers} peers, {PACKET}-byte packets, {cpus} CPUs");
    println!("{:>8} {:>12} {:>10}", "workers", "Gbit/s", "speed-up");
    let mut rows = Vec::new();
    let mut one = None;
    for workers in 1..=max_workers {
        let rate = measure(&pairs, workers, Duration::from_secs_f64(seconds));
        let gbits = rate * 8.0 / 1e9;
        let speedup = gbits / *one.get_or_insert(gbits);
        println!("{workers:>8} {gbits:>12.2} {speedup:>9.2}x");
        rows.push(format!(
            "{{\"workers\": {workers}, \"gbit_per_s\": {gbits:.3}, \"speedup\": {speedup:.3}}}"
        ));
    }
    if let Some(path) = arg(&args, "--json") {
        let json = format!(
            "{{\"peers\": {peers}, \"packet_bytes\": {PACKET}, \"cpus\": {cpus}, \"seconds\": {seconds}, \"points\": [{}]}}\n",
            rows.join(", ")
        );
        std::fs::write(&path, json).expect("write the JSON results");
    }
}
