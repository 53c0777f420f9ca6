//! Takeover behind a balancer that follows `/readyz`, as kube-proxy does: two tunnelgate
//! replicas with one key, a wireguard-go client pinging through the balancer every 100 ms; a
//! replica killed, and a rolling restart of both under a steady TCP stream.
//!
//! Topology (every part in its own network namespace):
//!
//! ```text
//!  client (wireguard-go)  --10.9.0.0/24--  lb  --10.9.1.0/24--  replica A (tunnelgate, health 10.9.1.2:9002)
//!  tunnel 100.64.7.2      endpoint          |  --10.9.2.0/24--  replica B (tunnelgate, health 10.9.2.2:9002)
//!                         10.9.0.1:51820    |  --10.9.5.0/24--  backend 10.9.5.2 (the rolling restart only)
//! ```
//!
//! The balancer ([`Balancer`]) is a thread of the test inside `lb`, a stand-in for kube-proxy
//! (with the kubelet's readiness probe folded in): every 500 ms it asks each replica's
//! `/readyz`; when the replica the client's flow goes to is not ready (503, or the port refuses:
//! the process is gone) and another is, it moves the DNAT of the WireGuard port to the ready
//! one and deletes the flow's conntrack entries (`conntrack -D -p udp --orig-port-dst 51820`).
//! For the rolling restart `lb` is also the backend's router, and the route back to the
//! tunnel's addresses moves with the DNAT: the HA pair of `docs/router.md`, with the
//! readiness probe as the thing that moves the address.
//!
//! Run as root: `cargo test --test netns_takeover_balancer -- --ignored --test-threads=1`.

#[path = "common/mod.rs"]
mod common;

use common::*;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tunnelgate::shell::clock;

const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;
const HEALTH_PORT: u16 = 9002;
/// The balancer's address: the client's endpoint.
const LB_FRONT: &str = "10.9.0.1";
const CLIENT_LAN: &str = "10.9.0.2";
/// The replicas' LAN addresses (`lb` is .1 on each link).
const REPLICA_LAN: [&str; 2] = ["10.9.1.2", "10.9.2.2"];
/// `lb`'s address on each replica's link: the replica's default gateway.
const REPLICA_GW: [&str; 2] = ["10.9.1.1", "10.9.2.1"];
const BACKEND: &str = "10.9.5.2";
const BACKEND_NET: &str = "10.9.5.0/24";
const TUN_NET: &str = "100.64.7.0/24";
const REPLICA_TUN: &str = "100.64.7.1";
const CLIENT_TUN: &str = "100.64.7.2";
/// How often the balancer asks each replica's `/readyz` (a readiness probe's `periodSeconds`
/// is coarser in a cluster; the takeover's share of the failover is what is measured here).
const PROBE_EVERY: Duration = Duration::from_millis(500);
const STREAM_PORT: u16 = 7100;

/// The namespaces and the balancer's front interface.
struct Lab {
    client: Netns,
    lb: Netns,
    replicas: [Netns; 2],
    /// The host behind the replicas (the rolling restart's stream ends there).
    backend: Option<Netns>,
    front_dev: String,
}

impl Lab {
    fn new(with_backend: bool) -> Lab {
        let (client, lb) = (Netns::new(), Netns::new());
        let replicas = [Netns::new(), Netns::new()];
        let front_dev = veth(
            &client,
            &[&format!("{CLIENT_LAN}/24")],
            &lb,
            &[&format!("{LB_FRONT}/24")],
        )
        .b_name;
        for ((r, lan), gateway) in replicas.iter().zip(REPLICA_LAN).zip(REPLICA_GW) {
            veth(r, &[&format!("{lan}/24")], &lb, &[&format!("{gateway}/24")]);
            r.exec(&["ip", "route", "add", "default", "via", gateway]);
            // The replicas find each other by one name, as a headless Service's resolves.
            r.hosts(&format!(
                "{} replicas.test\n{} replicas.test",
                REPLICA_LAN[0], REPLICA_LAN[1]
            ));
        }
        let backend = with_backend.then(|| {
            let backend = Netns::new();
            veth(&backend, &[&format!("{BACKEND}/24")], &lb, &["10.9.5.1/24"]);
            backend.exec(&["ip", "route", "add", "default", "via", "10.9.5.1"]);
            backend
        });
        lb.sysctl("net.ipv4.ip_forward", "1");
        Lab {
            client,
            lb,
            replicas,
            backend,
            front_dev,
        }
    }
}

/// Replica `i`'s configuration: the one key and address both replicas share, `client` as the
/// only peer (no endpoint: it is behind the balancer), health on the replica's LAN address
/// (where the balancer asks), and `extra` TOML.
fn replica_config(shared: &TgConfig, i: usize) -> TgConfig {
    let mut cfg = shared.clone();
    // Names differ: /var/run/wireguard is shared by every namespace.
    cfg.name = unique_name("tgd");
    cfg.health = Some(format!("{}:{HEALTH_PORT}", REPLICA_LAN[i]));
    cfg
}

/// The one configuration both replicas run: `client` as the only peer, the group's endpoint
/// exchange between the replicas (a takeover goes only where the client authenticated: at the
/// other replica, before the move), and `extra` TOML.
fn shared_config(client: &str, extra: &str) -> TgConfig {
    let mut cfg = TgConfig::new(TG_PORT, &[&format!("{REPLICA_TUN}/32")])
        .peer(Peer::new(client, &[&format!("{CLIENT_TUN}/32")]));
    cfg.workers = Some(1);
    cfg.extra = format!(
        "[takeover]\ngroup_listen = \"0.0.0.0:51822\"\ngroup_replicas = \"replicas.test:51822\"\n{extra}"
    );
    cfg
}

/// kube-proxy's part, in a thread of the test inside `lb` (see the file's doc). It starts with
/// the flow on replica 0 and moves it only when the replica it is on is not ready, as an
/// established UDP flow stays on its endpoint until that endpoint leaves.
struct Balancer {
    stop: Arc<AtomicBool>,
    /// (Unix time, replica) of every move after the first placement.
    moves: Arc<Mutex<Vec<(f64, usize)>>>,
    /// What the probes saw, as it changed, for failure messages.
    log: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

/// What the balancer points at a replica: the DNAT of the WireGuard port, and (for the
/// rolling restart) the route back to the tunnel's addresses.
struct Point {
    lb: String,
    front_dev: String,
    moves_route: bool,
}

impl Point {
    fn to(&self, replica: usize) {
        let lan = REPLICA_LAN[replica];
        let rules = format!(
            "table ip balancer\ndelete table ip balancer\ntable ip balancer {{\n\
             chain pre {{ type nat hook prerouting priority -100; \
             iifname \"{}\" udp dport {TG_PORT} dnat to {lan}:{TG_PORT}; }}\n}}\n",
            self.front_dev
        );
        self.run(&["nft", "-f", "-"], Some(&rules));
        if self.moves_route {
            self.run(&["ip", "route", "replace", TUN_NET, "via", lan], None);
        }
        // As kube-proxy does for an endpoint that leaves: the flow's next datagram is
        // balanced anew (nothing to delete is no error).
        forget_udp_flows(&self.lb, TG_PORT);
    }

    fn command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.lb]).args(args);
        cmd
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) {
        let out = output_of(self.command(args), stdin);
        assert!(
            out.success(),
            "balancer: `{}` failed: {}",
            args.join(" "),
            out.stderr
        );
    }
}

impl Balancer {
    /// Points the flow at replica 0 and starts probing. `moves_route`: move the route to
    /// [`TUN_NET`] with the DNAT.
    fn start(lab: &Lab, moves_route: bool) -> Balancer {
        let point = Point {
            lb: lab.lb.name().to_string(),
            front_dev: lab.front_dev.clone(),
            moves_route,
        };
        point.to(0);
        let stop = Arc::new(AtomicBool::new(false));
        let moves = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (stop2, moves2, log2) = (stop.clone(), moves.clone(), log.clone());
        let thread = lab.lb.thread(move || {
            let mut on = 0;
            let mut seen: Vec<Option<String>> = vec![None; REPLICA_LAN.len()];
            while !stop2.load(Ordering::Relaxed) {
                let started = clock::now();
                let probes: Vec<String> = REPLICA_LAN
                    .iter()
                    .map(|lan| {
                        let addr = SocketAddr::new(ip_of(lan), HEALTH_PORT);
                        match http_get(addr, "/readyz", Duration::from_millis(300)) {
                            Ok((code, _)) => code.to_string(),
                            Err(e) => e,
                        }
                    })
                    .collect();
                for (i, probe) in probes.iter().enumerate() {
                    if seen[i].as_ref() != Some(probe) {
                        if let Ok(mut l) = log2.lock() {
                            l.push(format!("{:.2} replica {i}: {probe}", unix_now()));
                        }
                        seen[i] = Some(probe.clone());
                    }
                }
                let ready: Vec<bool> = probes.iter().map(|p| p == "200").collect();
                if !ready[on] {
                    if let Some(to) = (0..ready.len()).find(|i| ready[*i]) {
                        point.to(to);
                        on = to;
                        if let Ok(mut m) = moves2.lock() {
                            m.push((unix_now(), to));
                        }
                    }
                }
                std::thread::sleep(PROBE_EVERY.saturating_sub(clock::now() - started));
            }
        });
        Balancer {
            stop,
            moves,
            log,
            thread: Some(thread),
        }
    }

    fn moves(&self) -> Vec<(f64, usize)> {
        self.moves.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// What the probes saw and the moves, one line each.
    fn log(&self) -> String {
        let mut lines = self.log.lock().map(|l| l.clone()).unwrap_or_default();
        lines.extend(
            self.moves()
                .iter()
                .map(|(at, to)| format!("{at:.2} moved to replica {to}")),
        );
        lines.sort();
        if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            lines.push(
                "the balancer's thread has ended (a failed nft, ip or conntrack panics it)".into(),
            );
        }
        lines.join("\n")
    }

    /// The first move at or after `t` (Unix seconds).
    fn moved_after(&self, t: f64) -> Option<(f64, usize)> {
        self.moves().into_iter().find(|(at, _)| *at >= t)
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The client's endpoint for the replicas' key, as wireguard-go has it now.
fn client_endpoint(wg: &WgGo, key: &str) -> Option<String> {
    wg.dump().peer(key).and_then(|p| p.endpoint.clone())
}

#[test]
#[ignore = "needs root"]
fn failover_behind_a_readiness_following_balancer_takes_the_peer_over_within_3_s() {
    let lab = Lab::new(false);
    let wg = WgGo::start(&lab.client, WG_PORT, &[&format!("{CLIENT_TUN}/32")]);
    let shared = shared_config(wg.public_key(), "");
    let mut first = Tunnelgate::start(&lab.replicas[0], replica_config(&shared, 0));
    let second = Tunnelgate::start(&lab.replicas[1], replica_config(&shared, 1));
    let balancer = Balancer::start(&lab, false);
    wg.add_peer(
        &Peer::new(&shared.key.public, &[&format!("{REPLICA_TUN}/32")])
            .endpoint(&format!("{LB_FRONT}:{TG_PORT}")),
    );
    let mut ping = lab
        .client
        .spawn(&["ping", "-n", "-D", "-i", "0.1", "-W", "1", REPLICA_TUN]);
    wait_handshake(wg.name(), &shared.key.public, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));

    let killed_at = unix_now();
    first.kill9();
    // Long enough for the client's own re-handshake (~15 s) to show if takeover did nothing.
    let deadline = clock::now() + Duration::from_secs(25);
    while clock::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        let after: Vec<f64> = reply_times(&ping.stdout())
            .into_iter()
            .filter(|t| *t > killed_at)
            .collect();
        if after
            .first()
            .zip(after.last())
            .is_some_and(|(f, l)| l - f > 2.0)
        {
            break;
        }
    }
    let _ = ping.kill9();
    let times = reply_times(&ping.stdout());
    let silence = longest_gap_after(&times, killed_at);
    let moves = balancer.moves();
    let first_after = times.iter().find(|t| **t > killed_at).copied();
    let Some(first_after) = first_after else {
        panic!(
            "no reply within 25 s of the kill; balancer:\n{}\n{}",
            balancer.log(),
            second.stderr()
        );
    };
    let moved = moves.first().map_or(f64::NAN, |(at, _)| at - killed_at);
    eprintln!(
        "failover behind a readiness-following balancer: longest silence {silence:.2} s \
         (last reply before the SIGKILL to the first after); the balancer moved {moved:.2} s \
         after the kill, the first reply came {:.2} s after the move",
        first_after - killed_at - moved
    );
    assert_eq!(
        moves.iter().map(|(_, to)| *to).collect::<Vec<_>>(),
        [1],
        "one move, to the other replica; balancer:\n{}",
        balancer.log()
    );
    assert!(
        silence <= 3.0,
        "the client went {silence:.2} s without a reply (balancer moved {moved:.2} s after \
         the kill)\nbalancer:\n{}\n{}",
        balancer.log(),
        second.stderr()
    );
    assert_eq!(
        client_endpoint(&wg, &shared.key.public).as_deref(),
        Some(format!("{LB_FRONT}:{TG_PORT}").as_str()),
        "the answer came through the balancer's address"
    );
    let status = second.status_json().expect("status JSON");
    assert_eq!(status["peers"][0]["takeovers_completed"], 1, "{status:#}");
}

/// A steady TCP stream of the harness's seeded bytes from the client to the backend, 16 KiB
/// every 10 ms, each byte checked at the receiver, which keeps the longest time it waited for
/// the next byte.
struct Stream {
    stop: Arc<AtomicBool>,
    abandon: Arc<AtomicBool>,
    /// Bytes received and the Unix time of the last read.
    progress: Arc<Mutex<(u64, f64)>>,
    writer: JoinHandle<Result<u64, String>>,
    reader: JoinHandle<Result<Received, String>>,
}

#[derive(Debug)]
struct Received {
    bytes: u64,
    /// The longest wait between two reads, and the Unix time it ended.
    stall: Duration,
    stall_ended: f64,
}

const SEED: u64 = 0x6261_6c61_6e63_6572; // "balancer"
const CHUNK: usize = 16 * 1024;
const CHUNK_EVERY: Duration = Duration::from_millis(10);

impl Stream {
    fn start(client: &Netns, backend: &Netns) -> Stream {
        let addr = SocketAddr::new(ip_of(BACKEND), STREAM_PORT);
        let listener = backend
            .in_ns(|| TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        let stop = Arc::new(AtomicBool::new(false));
        let abandon = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Mutex::new((0, unix_now())));
        let (abandon2, progress2) = (abandon.clone(), progress.clone());
        let reader = std::thread::spawn(move || receive(&listener, &abandon2, &progress2));
        let conn = client
            .in_ns(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("connect {addr} through the tunnel: {e}"));
        let stop2 = stop.clone();
        let writer = std::thread::spawn(move || send(conn, &stop2));
        Stream {
            stop,
            abandon,
            progress,
            writer,
            reader,
        }
    }

    /// (bytes received, Unix time of the last read).
    fn progress(&self) -> (u64, f64) {
        self.progress.lock().map(|p| *p).unwrap_or((0, 0.0))
    }

    /// Waits until bytes arrive after Unix time `t` and go on arriving for `then`; `Err` after
    /// `timeout`.
    fn flows_after(&self, t: f64, then: Duration, timeout: Duration) -> Result<(), String> {
        let deadline = clock::now() + timeout;
        let mut resumed: Option<(f64, u64)> = None;
        while clock::now() < deadline {
            let (bytes, last) = self.progress();
            match resumed {
                None if last > t => resumed = Some((last, bytes)),
                Some((at, b)) if last - at >= then.as_secs_f64() && bytes > b => return Ok(()),
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let (bytes, last) = self.progress();
        Err(format!(
            "the stream did not go on for {then:?} within {timeout:?}: {bytes} bytes received, \
             the last {:.2} s before the deadline",
            unix_now() - last
        ))
    }

    /// Stops the writer (which closes its side) and waits for the receiver's end of stream:
    /// (bytes sent, what arrived).
    fn finish(self) -> Result<(u64, Received), String> {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.writer.join().map_err(|_| "writer panicked")?;
        poll_until(Duration::from_secs(20), || self.reader.is_finished());
        self.abandon.store(true, Ordering::Relaxed);
        let received = self.reader.join().map_err(|_| "reader panicked")?;
        Ok((sent?, received?))
    }
}

/// The writer: CHUNK bytes every CHUNK_EVERY until `stop`, then a clean close. A write that
/// fails (a reset) ends it with `Err`.
fn send(mut conn: TcpStream, stop: &AtomicBool) -> Result<u64, String> {
    conn.set_write_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    let mut gen = PrngStream::new(SEED);
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    let mut due = clock::now();
    let mut stopped_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        gen.fill(&mut buf);
        let mut off = 0;
        while off < buf.len() {
            match conn.write(&buf[off..]) {
                Ok(n) => off += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    // The path is down and the send buffer full: keep the place and wait,
                    // unless the test has long given up.
                    if stop.load(Ordering::Relaxed) {
                        let at = *stopped_at.get_or_insert_with(clock::now);
                        if clock::now() - at > Duration::from_secs(20) {
                            return Err(format!("writer: stuck after {sent} bytes"));
                        }
                    }
                }
                Err(e) => {
                    return Err(format!(
                        "writer: write after {} bytes: {e}",
                        sent + off as u64
                    ))
                }
            }
        }
        sent += buf.len() as u64;
        due += CHUNK_EVERY;
        if let Some(wait) = due.checked_duration_since(clock::now()) {
            std::thread::sleep(wait);
        }
    }
    conn.shutdown(Shutdown::Write)
        .map_err(|e| format!("writer: close after {sent} bytes: {e}"))?;
    Ok(sent)
}

/// The receiver: accepts one connection and checks every byte against the seeded stream until
/// the end of stream; a reset, a wrong byte or `abandon` ends it with `Err`.
fn receive(
    listener: &TcpListener,
    abandon: &AtomicBool,
    progress: &Mutex<(u64, f64)>,
) -> Result<Received, String> {
    let (mut conn, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    let mut want = PrngStream::new(SEED);
    let (mut buf, mut expected) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let mut bytes = 0u64;
    let mut last = clock::now();
    let (mut stall, mut stall_ended) = (Duration::ZERO, 0.0);
    loop {
        match conn.read(&mut buf) {
            Ok(0) => {
                return Ok(Received {
                    bytes,
                    stall,
                    stall_ended,
                })
            }
            Ok(n) => {
                let now = clock::now();
                if now - last > stall {
                    stall = now - last;
                    stall_ended = unix_now();
                }
                last = now;
                want.fill(&mut expected[..n]);
                if let Some(i) = (0..n).find(|i| buf[*i] != expected[*i]) {
                    return Err(format!("receiver: byte {} differs", bytes + i as u64));
                }
                bytes += n as u64;
                if let Ok(mut p) = progress.lock() {
                    *p = (bytes, unix_now());
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if abandon.load(Ordering::Relaxed) {
                    return Err(format!("receiver: no end of stream after {bytes} bytes"));
                }
            }
            Err(e) => return Err(format!("receiver: read after {bytes} bytes: {e}")),
        }
    }
}

/// Two replicas with one key, routing the client's tunnel address to a backend on their LAN
/// side without NAT (a subnet router with `snat = false`), behind the balancer, which is also
/// the backend's router and moves the route to the tunnel's addresses with the DNAT (the HA
/// pair of `docs/router.md`). A TCP stream from the client to the backend runs while replica
/// A is restarted (SIGTERM, its exit, the balancer moving the flow to B, the same config
/// started again, ready), and then, once the stream goes on through B, replica B the same
/// way: the stream must go on through both, without a reset, every byte intact.
///
/// It survives the moves because no replica holds state the stream needs: no NAT, and the
/// forward rules let a mid-stream packet through on the replica that did not see the SYN
/// (conntrack picks the connection up, `nf_conntrack_tcp_loose`, and tunnelgate's forward
/// chain accepts the advertised route in any state, its policy accepts the way back).
#[test]
#[ignore = "needs root"]
fn a_rolling_restart_of_both_replicas_keeps_a_tcp_stream_going() {
    let lab = Lab::new(true);
    let backend = lab.backend.as_ref().expect("backend");
    let wg = WgGo::start(&lab.client, WG_PORT, &[&format!("{CLIENT_TUN}/32")]);
    let shared = shared_config(
        wg.public_key(),
        &format!("[router]\nadvertise_routes = [\"{BACKEND_NET}\"]\nsnat = false\n"),
    );
    let configs = [replica_config(&shared, 0), replica_config(&shared, 1)];
    let mut replicas = [
        Some(Tunnelgate::start(&lab.replicas[0], configs[0].clone())),
        Some(Tunnelgate::start(&lab.replicas[1], configs[1].clone())),
    ];
    let balancer = Balancer::start(&lab, true);
    wg.add_peer(
        &Peer::new(
            &shared.key.public,
            &[&format!("{REPLICA_TUN}/32"), BACKEND_NET],
        )
        .endpoint(&format!("{LB_FRONT}:{TG_PORT}")),
    );
    let mut ping = lab
        .client
        .spawn(&["ping", "-n", "-D", "-i", "0.1", "-W", "1", BACKEND]);
    wait_handshake(wg.name(), &shared.key.public, Duration::from_secs(10));
    let stream = Stream::start(&lab.client, backend);
    std::thread::sleep(Duration::from_secs(2));
    let started_at = unix_now();

    let mut takeovers = Vec::new();
    for (i, label) in [(0, "A"), (1, "B")] {
        let t = unix_now();
        let mut old = replicas[i].take().expect("replica");
        let status = old.sigterm();
        assert!(status.success(), "replica {label} exited with {status}");
        // The old guard goes first: on drop it removes the interface's UAPI socket path,
        // which the new process (the same name) is about to make its own.
        drop(old);
        // The endpoint leaves before the new process comes, as a terminating pod's does: a
        // restart in place faster than the probe period could slip between two probes.
        let moved = poll_until(Duration::from_secs(5), || balancer.moved_after(t).is_some());
        let (moved_at, to) = balancer.moved_after(t).unwrap_or((f64::NAN, usize::MAX));
        assert!(
            moved && to == 1 - i,
            "the balancer moved the flow off replica {label}:\n{}",
            balancer.log()
        );
        replicas[i] = Some(Tunnelgate::start(&lab.replicas[i], configs[i].clone()));
        let ready = unix_now();
        let other = replicas[1 - i].as_ref().expect("the other replica");
        if let Err(e) =
            stream.flows_after(moved_at, Duration::from_secs(2), Duration::from_secs(30))
        {
            panic!(
                "after restarting replica {label}: {e}\nbalancer:\n{}\nthe other replica:\n{}",
                balancer.log(),
                other.stderr()
            );
        }
        eprintln!(
            "replica {label}: SIGTERM to ready {:.2} s; the balancer moved {:.2} s after the SIGTERM",
            ready - t,
            moved_at - t
        );
        let status = other.status_json().expect("status JSON");
        takeovers.push(status["peers"][0]["takeovers_completed"].clone());
    }
    std::thread::sleep(Duration::from_secs(1));
    let _ = ping.kill9();
    let result = stream.finish();
    let times = reply_times(&ping.stdout());
    let silence = longest_gap_after(&times, started_at);
    let (sent, received) = result.unwrap_or_else(|e| panic!("the stream broke: {e}"));
    eprintln!(
        "rolling restart: {} bytes intact; the stream's longest stall {:.2} s (ended {:.2} s \
         after the first SIGTERM); the pings' longest silence {silence:.2} s",
        received.bytes,
        received.stall.as_secs_f64(),
        received.stall_ended - started_at
    );
    assert_eq!(received.bytes, sent, "every byte sent arrived");
    assert!(
        received.stall <= Duration::from_secs(5),
        "the stream stalled {:.2} s (ended at {:.2})\nbalancer:\n{}",
        received.stall.as_secs_f64(),
        received.stall_ended,
        balancer.log()
    );
    assert_eq!(
        takeovers,
        [1, 1],
        "each replica that got the flow took the client over once"
    );
    assert_eq!(
        client_endpoint(&wg, &shared.key.public).as_deref(),
        Some(format!("{LB_FRONT}:{TG_PORT}").as_str()),
        "the client still sends to the balancer's address"
    );
}
