//! peersim: thousands of simulated WireGuard peers of one gateway, from one process, for the
//! concentrator benchmark (benches/peers/scale.py).
//!
//! `peersim keys --seed S --count N [--first F]` prints, per peer, its public key and tunnel
//! address (for the gateway's configuration); `peersim run --seed S --count N ...` runs those
//! peers: each has its own static key (derived from the seed), its own UDP socket and source
//! port (and, with `--source-net`, source address), its own tunnel address, and one `Tunn` of
//! the project's boringtun fork towards the gateway. Each handshakes as initiator, answers the
//! gateway's initiations, runs the fork's timers, sends persistent keepalives and pings the
//! gateway's tunnel address every `--ping-interval` seconds, recording the round trips.
//!
//! Output: JSON lines on stdout (events and a stats line per interval); control: one command
//! per line on stdin (see `HELP`). Closing stdin stops it.

// Tests may unwrap: a panic is their failure report.
#![cfg_attr(test, allow(clippy::unwrap_used))]

#[cfg(test)]
mod e2e_tests;
mod icmp;
mod keys;
mod stats;
mod sys;
mod worker;

use stats::{exact_quantile, Counters, Histogram, Obj};
use std::collections::{BTreeMap, VecDeque};
use std::io::{self, BufRead, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::ExitCode;
use std::sync::{mpsc, Arc};
use worker::{Cmd, Handle, Msg, PeerLine, Report, Setup};

const HELP: &str = "\
peersim: simulated WireGuard peers of one gateway (tunnelgate's concentrator benchmark)

  peersim keys --seed S --count N [--first F] [--private]
      one line per peer: PUBLIC_KEY TUNNEL_ADDRESS (tab-separated; with --private a third
      column, the private key). Peer i's key is derived from (S, i); its tunnel address is
      10.200.0.1 for i = 0, then on, skipping .0 and .255 (at most 260,096 peers).

  peersim run --seed S --count N [--first F] --gateway-key B64 --endpoint IP:PORT
              --gateway-ip IP [--source-net NET/LEN] [--threads T] [--ping-interval SECONDS]
              [--keepalive SECONDS] [--tick SECONDS] [--stats-interval SECONDS] [--no-burst]
      runs peers F .. F+N-1 (own key, UDP socket and tunnel address each) against the gateway
      whose public key is B64, at IP:PORT, pinging its tunnel address IP. Defaults: T 2, ping
      every 1 s (0: never), keepalive 25 s (0: off), timers every 0.1 s per peer, stats every
      1 s; every peer initiates at the start unless --no-burst. --source-net binds peer i to an
      address of its own in NET (the namespace must route NET locally: `ip route add local NET
      dev lo`), so the gateway sees one source address per peer as on the Internet.

  Output: JSON lines on stdout: {\"event\": \"ready\" | \"start\" | \"stats\" | \"burst\" | \"mark\" |
  \"all_handshaked\" | \"all_replied\" | \"window\" | \"peer\" | \"peers_end\" | \"error\" | \"exit\", ...}.
  Commands, one per line on stdin:
      rekey               a new mark now, and every peer starts a new handshake at once
      mark [T]            a new mark at T (CLOCK_MONOTONIC seconds, Python's time.monotonic();
                          default now): all_handshaked / all_replied report when every peer
                          has had a handshake / a reply to a ping sent at or after T
      window-start [L]    start collecting the round trips of pings sent from now
      window-stop         report them as a \"window\" event (label L)
      peers               one \"peer\" line per peer (last reply and handshake ages, counts)
      quit                stop (so does closing stdin)
";

struct Args {
    seed: String,
    count: u32,
    first: u32,
    private: bool,
    gateway_key: Option<[u8; 32]>,
    endpoint: Option<SocketAddrV4>,
    gateway_ip: Option<Ipv4Addr>,
    source: Option<(Ipv4Addr, u8)>,
    threads: usize,
    ping: f64,
    keepalive: u16,
    tick: f64,
    stats: f64,
    burst: bool,
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut a = Args {
        seed: String::new(),
        count: 0,
        first: 0,
        private: false,
        gateway_key: None,
        endpoint: None,
        gateway_ip: None,
        source: None,
        threads: 2,
        ping: 1.0,
        keepalive: 25,
        tick: 0.1,
        stats: 1.0,
        burst: true,
    };
    let mut seed = None;
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seed" => seed = Some(value()?.clone()),
            "--count" => a.count = num(flag, value()?)?,
            "--first" => a.first = num(flag, value()?)?,
            "--private" => a.private = true,
            "--gateway-key" => {
                a.gateway_key =
                    Some(keys::decode(value()?).map_err(|e| format!("--gateway-key: {e}"))?)
            }
            "--endpoint" => {
                a.endpoint = Some(value()?.parse().map_err(|e| format!("--endpoint: {e}"))?)
            }
            "--gateway-ip" => {
                a.gateway_ip = Some(value()?.parse().map_err(|e| format!("--gateway-ip: {e}"))?)
            }
            "--source-net" => a.source = Some(keys::parse_net(value()?)?),
            "--threads" => a.threads = num(flag, value()?)?,
            "--ping-interval" => a.ping = num(flag, value()?)?,
            "--keepalive" => a.keepalive = num(flag, value()?)?,
            "--tick" => a.tick = num(flag, value()?)?,
            "--stats-interval" => a.stats = num(flag, value()?)?,
            "--no-burst" => a.burst = false,
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    a.seed = seed.ok_or("--seed is required")?;
    if a.count == 0 {
        return Err("--count must be at least 1".into());
    }
    let last = a
        .first
        .checked_add(a.count - 1)
        .ok_or("--first + --count overflows")?;
    if last >= keys::MAX_PEERS {
        return Err(format!(
            "peers up to {last}: at most {} have a tunnel address",
            keys::MAX_PEERS
        ));
    }
    if a.threads == 0 || a.threads > 64 {
        return Err("--threads must be 1..64".into());
    }
    if !(a.ping == 0.0 || (0.001..=3600.0).contains(&a.ping)) {
        return Err("--ping-interval must be 0 or 0.001..3600 s".into());
    }
    if !(0.001..=10.0).contains(&a.tick) || !(0.01..=3600.0).contains(&a.stats) {
        return Err("--tick must be 0.001..10 s and --stats-interval 0.01..3600 s".into());
    }
    Ok(a)
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first() else {
        eprint!("{HELP}");
        return ExitCode::from(2);
    };
    if cmd == "--help" || cmd == "-h" || cmd == "help" {
        print!("{HELP}");
        return ExitCode::SUCCESS;
    }
    let args = match parse_args(&argv[1..]) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("peersim: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cmd.as_str() {
        "keys" => print_keys(&args),
        "run" => run(&args),
        other => Err(format!("unknown command {other:?} (see --help)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peersim: {e}");
            ExitCode::from(1)
        }
    }
}

/// The public keys (and tunnel addresses) of peers first .. first+count, computed on every
/// CPU, printed in order.
fn print_keys(a: &Args) -> Result<(), String> {
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    let per = a.count.div_ceil(cpus as u32);
    let chunks: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cpus as u32)
            .map(|c| {
                let start = a.first + c * per;
                let end = (start + per).min(a.first + a.count);
                s.spawn(move || {
                    let mut out = String::with_capacity((end.saturating_sub(start) as usize) * 80);
                    for i in start..end {
                        let private = keys::private_key(&a.seed, i);
                        out.push_str(&keys::encode(&keys::public_key(&private)));
                        out.push('\t');
                        // `parse_args` bounded the indices: every one has an address.
                        if let Some(addr) = keys::tunnel_addr(i) {
                            out.push_str(&addr.to_string());
                        }
                        if a.private {
                            out.push('\t');
                            out.push_str(&keys::encode(&private));
                        }
                        out.push('\n');
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut stdout = io::stdout().lock();
    for c in chunks {
        stdout.write_all(c.as_bytes()).map_err(|e| e.to_string())?;
    }
    stdout.flush().map_err(|e| e.to_string())
}

/// What the main thread waits on: the workers' messages and the lines of stdin.
enum Input {
    Worker(Msg),
    Line(String),
    Eof,
}

/// Where a mark stands: which workers have reported all their peers back / handshaked.
struct MarkState {
    t: u64,
    replied: Vec<Option<(u64, Vec<u64>)>>,
    handshaked: Vec<Option<(u64, Vec<u64>)>>,
}

/// A window being collected: label, start, each worker's part once it reported.
type OpenWindow = (String, u64, Vec<Option<(Box<Counters>, Box<Histogram>)>>);

struct Main {
    out: io::StdoutLock<'static>,
    t0: u64,
    threads: usize,
    peers: u32,
    ping_s: f64,
    pending: Vec<VecDeque<(u64, Box<Report>)>>,
    marks: BTreeMap<u32, MarkState>,
    next_mark: u32,
    window: Option<OpenWindow>,
    dumps: Vec<Option<Vec<PeerLine>>>,
    bursts: Vec<Option<(&'static str, u64, u64)>>,
    hs_total: u64,
    replies_total: u64,
}

fn run(a: &Args) -> Result<(), String> {
    let gateway_key = a.gateway_key.ok_or("run needs --gateway-key")?;
    let endpoint = a.endpoint.ok_or("run needs --endpoint")?;
    let gateway_ip = a.gateway_ip.ok_or("run needs --gateway-ip")?;
    if let Some((net, prefix)) = a.source {
        keys::source_addr(net, prefix, 0).ok_or("--source-net: prefix too long to hold a host")?;
    }
    let limit =
        sys::raise_nofile(u64::from(a.count) + 64).map_err(|e| format!("RLIMIT_NOFILE: {e}"))?;
    if limit < u64::from(a.count) + 16 {
        return Err(format!(
            "RLIMIT_NOFILE is {limit}: not enough for {} sockets",
            a.count
        ));
    }
    let secs = |s: f64| (s * 1e9) as u64;
    let setup = Setup {
        seed: a.seed.clone(),
        gateway_key,
        endpoint,
        gateway_ip,
        source: a.source,
        keepalive: a.keepalive,
        ping_ns: secs(a.ping),
        tick_ns: secs(a.tick),
        stats_ns: secs(a.stats),
        working_ns: if a.ping > 0.0 {
            secs((3.0 * a.ping).max(2.0))
        } else {
            0
        },
    };
    let threads = a.threads.min(a.count as usize);
    let (tx, rx) = mpsc::channel::<Input>();
    let mut commands = Vec::new();
    let mut wakes = Vec::new();
    let per = a.count.div_ceil(threads as u32);
    let mut joins = Vec::new();
    for t in 0..threads {
        let start = a.first + t as u32 * per;
        let end = (start + per).min(a.first + a.count);
        let (ctx, crx) = mpsc::channel();
        let wake = Arc::new(sys::EventFd::new().map_err(|e| format!("eventfd: {e}"))?);
        wakes.push(Arc::clone(&wake));
        let handle = Handle {
            thread: t,
            peers: start..end,
            commands: crx,
            wake,
        };
        commands.push(ctx);
        let (wtx, wrx) = mpsc::channel::<Msg>();
        let fwd = tx.clone();
        // Forward the worker's messages into the main queue.
        std::thread::Builder::new()
            .name(format!("peersim-fwd-{t}"))
            .spawn(move || {
                for m in wrx {
                    if fwd.send(Input::Worker(m)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let setup = setup.clone();
        joins.push(
            std::thread::Builder::new()
                .name(format!("peersim-{t}"))
                .spawn(move || worker::run(setup, handle, wtx))
                .map_err(|e| e.to_string())?,
        );
    }
    let signal_all = |wakes: &[Arc<sys::EventFd>]| {
        for w in wakes {
            w.signal();
        }
    };

    let mut m = Main {
        out: io::stdout().lock(),
        t0: 0,
        threads,
        peers: a.count,
        ping_s: a.ping,
        pending: (0..threads).map(|_| VecDeque::new()).collect(),
        marks: BTreeMap::new(),
        next_mark: 1,
        window: None,
        dumps: (0..threads).map(|_| None).collect(),
        bursts: (0..threads).map(|_| None).collect(),
        hs_total: 0,
        replies_total: 0,
    };

    // Every worker sets its peers up (keys, sockets), then all start together.
    let mut ready = 0;
    let mut setup_s: f64 = 0.0;
    let mut set_up = 0;
    while ready < threads {
        match rx.recv() {
            Ok(Input::Worker(Msg::Ready { peers, setup_s: s })) => {
                ready += 1;
                set_up += peers as u64;
                setup_s = setup_s.max(s);
            }
            Ok(Input::Worker(Msg::Failed { thread, error })) => {
                for c in &commands {
                    let _ = c.send(Cmd::Quit);
                }
                return Err(format!("worker {thread}: {error}"));
            }
            Ok(_) => {}
            Err(_) => return Err("every worker stopped during setup".into()),
        }
    }
    m.emit(
        Obj::new()
            .str("event", "ready")
            .u64("peers", set_up)
            .u64("first", u64::from(a.first))
            .u64("threads", threads as u64)
            .f64("setup_s", setup_s, 3)
            .f64("rss_mib", sys::rss_mib().unwrap_or(f64::NAN), 1)
            .f64("cpu_s", sys::cpu_seconds(), 3)
            .u64("nofile", limit),
    );
    let t0 = sys::now_ns();
    m.t0 = t0;
    m.marks.insert(
        0,
        MarkState {
            t: t0,
            replied: vec![None; threads],
            handshaked: vec![None; threads],
        },
    );
    for c in &commands {
        let _ = c.send(Cmd::Start { t0, burst: a.burst });
    }
    signal_all(&wakes);
    m.emit(
        Obj::new()
            .str("event", "start")
            .u64("mark", 0)
            .f64("mono", t0 as f64 / 1e9, 6)
            .bool("burst", a.burst),
    );

    // stdin: one command per line.
    let stdin_tx = tx.clone();
    std::thread::Builder::new()
        .name("peersim-stdin".into())
        .spawn(move || {
            for line in io::stdin().lock().lines() {
                match line {
                    Ok(l) => {
                        if stdin_tx.send(Input::Line(l)).is_err() {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
            let _ = stdin_tx.send(Input::Eof);
        })
        .map_err(|e| e.to_string())?;
    drop(tx);

    let mut stopped = 0;
    let mut quitting = false;
    let mut failure = None;
    while stopped < threads {
        let Ok(input) = rx.recv() else { break };
        match input {
            Input::Line(l) => {
                let l = l.trim().to_string();
                if l.is_empty() {
                    continue;
                }
                if l == "quit" {
                    quitting = true;
                } else {
                    match m.command(&l) {
                        Ok(Some(cmd)) => {
                            for c in &commands {
                                let _ = c.send(cmd.clone());
                            }
                            signal_all(&wakes);
                        }
                        Ok(None) => {}
                        Err(e) => m.emit(Obj::new().str("event", "error").str("error", &e)),
                    }
                }
            }
            Input::Eof => quitting = true,
            Input::Worker(Msg::Stopped) => stopped += 1,
            Input::Worker(Msg::Failed { thread, error }) => {
                m.emit(
                    Obj::new()
                        .str("event", "error")
                        .u64("thread", thread as u64)
                        .str("error", &error),
                );
                failure = Some(format!("worker {thread}: {error}"));
                stopped += 1;
                quitting = true;
            }
            Input::Worker(msg) => m.worker(msg),
        }
        if quitting {
            for c in &commands {
                let _ = c.send(Cmd::Quit);
            }
            signal_all(&wakes);
        }
    }
    for j in joins {
        let _ = j.join();
    }
    m.emit(
        Obj::new()
            .str("event", "exit")
            .f64("t", (sys::now_ns() - t0) as f64 / 1e9, 3)
            .f64("cpu_s", sys::cpu_seconds(), 3)
            .f64("rss_mib", sys::rss_mib().unwrap_or(f64::NAN), 1)
            .u64("handshakes", m.hs_total)
            .u64("replies", m.replies_total),
    );
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl Main {
    fn emit(&mut self, o: &mut Obj) {
        let line = o.finish();
        // A driver that went away: nothing more to say, and closing stdin stops us anyway.
        let _ = writeln!(self.out, "{line}");
        let _ = self.out.flush();
    }

    fn new_mark(&mut self, t: u64) -> u32 {
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(
            id,
            MarkState {
                t,
                replied: vec![None; self.threads],
                handshaked: vec![None; self.threads],
            },
        );
        // Older marks can no longer complete (the workers moved on): forget them.
        self.marks.retain(|&k, _| k == id);
        id
    }

    /// A command line: the worker command to broadcast, if any.
    fn command(&mut self, line: &str) -> Result<Option<Cmd>, String> {
        let mut words = line.split_whitespace();
        let verb = words.next().unwrap_or_default();
        let arg = words.next();
        let now = sys::now_ns();
        match verb {
            "rekey" => {
                let mark = self.new_mark(now);
                self.emit(
                    Obj::new()
                        .str("event", "rekey")
                        .u64("mark", u64::from(mark))
                        .f64("mono", now as f64 / 1e9, 6),
                );
                Ok(Some(Cmd::Rekey { mark, t: now }))
            }
            "mark" => {
                let t = match arg {
                    Some(s) => {
                        let secs: f64 = s.parse().map_err(|e| format!("mark {s:?}: {e}"))?;
                        if !(secs.is_finite() && secs > 0.0) {
                            return Err(format!("mark {s:?}: not a time"));
                        }
                        (secs * 1e9) as u64
                    }
                    None => now,
                };
                let mark = self.new_mark(t);
                self.emit(
                    Obj::new()
                        .str("event", "mark")
                        .u64("mark", u64::from(mark))
                        .f64("mono", t as f64 / 1e9, 6),
                );
                Ok(Some(Cmd::Mark { mark, t }))
            }
            "window-start" => {
                let label = arg.unwrap_or("window").to_string();
                self.window = Some((
                    label.clone(),
                    now,
                    (0..self.threads).map(|_| None).collect(),
                ));
                self.emit(
                    Obj::new()
                        .str("event", "window_start")
                        .str("label", &label)
                        .f64("mono", now as f64 / 1e9, 6),
                );
                Ok(Some(Cmd::WindowStart { t: now }))
            }
            "window-stop" => {
                if self.window.is_none() {
                    return Err("window-stop without window-start".into());
                }
                Ok(Some(Cmd::WindowStop))
            }
            "peers" => Ok(Some(Cmd::Dump)),
            other => Err(format!("unknown command {other:?}")),
        }
    }

    fn worker(&mut self, msg: Msg) {
        match msg {
            Msg::Stats {
                thread,
                interval,
                report,
            } => {
                if let Some(q) = self.pending.get_mut(thread) {
                    q.push_back((interval, report));
                }
                while self.pending.iter().all(|q| !q.is_empty()) {
                    let mut merged = Report::default();
                    let mut interval = 0;
                    for q in self.pending.iter_mut() {
                        if let Some((i, r)) = q.pop_front() {
                            interval = interval.max(i);
                            merge_report(&mut merged, &r);
                        }
                    }
                    self.stats_line(interval, &merged);
                }
            }
            Msg::MarkReplied {
                thread,
                mark,
                last_ns,
                delays_us,
            } => self.mark_part(true, thread, mark, last_ns, delays_us),
            Msg::MarkHandshaked {
                thread,
                mark,
                last_ns,
                delays_us,
            } => self.mark_part(false, thread, mark, last_ns, delays_us),
            Msg::Burst {
                thread,
                kind,
                initiations,
                took_ns,
            } => {
                if let Some(slot) = self.bursts.get_mut(thread) {
                    *slot = Some((kind, initiations, took_ns));
                }
                if self.bursts.iter().all(Option::is_some) {
                    let (mut sent, mut took) = (0, 0);
                    for (_, s, t) in self.bursts.iter().flatten() {
                        sent += s;
                        took = took.max(*t);
                    }
                    self.emit(
                        Obj::new()
                            .str("event", "burst")
                            .str("kind", kind)
                            .u64("initiations", sent)
                            .f64("took_s", took as f64 / 1e9, 3),
                    );
                    self.bursts.iter_mut().for_each(|b| *b = None);
                }
            }
            Msg::Window {
                thread,
                counters,
                rtt,
            } => {
                let Some((label, t, parts)) = self.window.as_mut() else {
                    return;
                };
                if let Some(slot) = parts.get_mut(thread) {
                    *slot = Some((counters, rtt));
                }
                if parts.iter().all(Option::is_some) {
                    let (label, t) = (label.clone(), *t);
                    let mut c = Counters::default();
                    let mut h = Histogram::default();
                    for (pc, ph) in parts.iter().flatten() {
                        c.merge(pc);
                        h.merge(ph);
                    }
                    self.window = None;
                    let now = sys::now_ns();
                    let mut o = Obj::new();
                    o.str("event", "window")
                        .str("label", &label)
                        .f64("start_mono", t as f64 / 1e9, 6)
                        .f64("duration_s", (now - t) as f64 / 1e9, 3)
                        .u64("pings", c.pings_sent)
                        .u64("pings_unsent", c.pings_unsent)
                        .u64("replies", c.replies)
                        .raw("rtt_ms", &h.json_ms());
                    self.emit(&mut o);
                }
            }
            Msg::Dump { thread, peers } => {
                if let Some(slot) = self.dumps.get_mut(thread) {
                    *slot = Some(peers);
                }
                if self.dumps.iter().all(Option::is_some) {
                    let now = sys::now_ns();
                    let dumps: Vec<_> = self.dumps.iter_mut().filter_map(Option::take).collect();
                    for p in dumps.iter().flatten() {
                        let age = |t: u64| (t > 0).then(|| now.saturating_sub(t) as f64 / 1e9);
                        let mut o = Obj::new();
                        o.str("event", "peer")
                            .u64("index", u64::from(p.index))
                            .str("tunnel", &p.addr.to_string())
                            .u64("port", u64::from(p.port))
                            .opt_f64("last_reply_age_s", age(p.last_reply_ns), 3)
                            .opt_f64("last_handshake_age_s", age(p.last_handshake_ns), 3)
                            .u64("pings", u64::from(p.pings))
                            .u64("replies", u64::from(p.replies))
                            .u64("handshakes", u64::from(p.handshakes))
                            .bool("session", p.session);
                        self.emit(&mut o);
                    }
                    self.emit(
                        Obj::new()
                            .str("event", "peers_end")
                            .u64("peers", u64::from(self.peers)),
                    );
                }
            }
            Msg::Ready { .. } | Msg::Failed { .. } | Msg::Stopped => {}
        }
    }

    fn mark_part(
        &mut self,
        replied: bool,
        thread: usize,
        mark: u32,
        last_ns: u64,
        delays: Vec<u64>,
    ) {
        let Some(ms) = self.marks.get_mut(&mark) else {
            return;
        };
        let parts = if replied {
            &mut ms.replied
        } else {
            &mut ms.handshaked
        };
        if let Some(slot) = parts.get_mut(thread) {
            *slot = Some((last_ns, delays));
        }
        if !parts.iter().all(Option::is_some) {
            return;
        }
        let t = ms.t;
        let mut last = 0;
        let mut all: Vec<u64> = Vec::new();
        for (l, d) in parts.iter().flatten() {
            last = last.max(*l);
            all.extend_from_slice(d);
        }
        parts.iter_mut().for_each(|p| *p = None);
        let n = all.len() as u64;
        let mut per = Obj::new();
        for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)] {
            per.opt_f64(
                name,
                exact_quantile(&mut all, q).map(|us| us as f64 / 1e6),
                3,
            );
        }
        let mut o = Obj::new();
        o.str(
            "event",
            if replied {
                "all_replied"
            } else {
                "all_handshaked"
            },
        )
        .u64("mark", u64::from(mark))
        .u64("peers", n)
        .f64("mark_mono", t as f64 / 1e9, 6)
        .f64("at_mono", last.max(t) as f64 / 1e9, 6)
        .f64("after_s", last.saturating_sub(t) as f64 / 1e9, 3)
        .raw("per_peer_s", &per.finish());
        self.emit(&mut o);
    }

    fn stats_line(&mut self, interval: u64, r: &Report) {
        self.hs_total += r.counters.hs_done + r.counters.hs_answered;
        self.replies_total += r.counters.replies;
        let now = sys::now_ns();
        let mut o = Obj::new();
        o.str("event", "stats")
            .u64("interval", interval)
            .f64("t", (now - self.t0) as f64 / 1e9, 3)
            .f64("mono", now as f64 / 1e9, 6)
            .u64("peers", r.peers)
            .u64("working", r.working)
            .u64("with_session", r.with_session)
            .u64("never_replied", r.never_replied)
            .f64("max_reply_age_s", r.max_reply_age_ns as f64 / 1e9, 3)
            .f64("ping_interval_s", self.ping_s, 3);
        r.counters.write(&mut o);
        o.raw("rtt_ms", &r.rtt.json_ms())
            .raw("handshake_ms", &r.hs_time.json_ms())
            .u64("mark", u64::from(r.mark))
            .u64("mark_replied", r.mark_replied)
            .u64("mark_handshaked", r.mark_handshaked)
            .u64("handshakes_total", self.hs_total)
            .f64("cpu_s", sys::cpu_seconds(), 3)
            .f64("rss_mib", sys::rss_mib().unwrap_or(f64::NAN), 1);
        self.emit(&mut o);
    }
}

fn merge_report(into: &mut Report, r: &Report) {
    into.counters.merge(&r.counters);
    into.rtt.merge(&r.rtt);
    into.hs_time.merge(&r.hs_time);
    into.peers += r.peers;
    into.working += r.working;
    into.with_session += r.with_session;
    into.never_replied += r.never_replied;
    into.max_reply_age_ns = into.max_reply_age_ns.max(r.max_reply_age_ns);
    into.mark = into.mark.max(r.mark);
    into.mark_replied += r.mark_replied;
    into.mark_handshaked += r.mark_handshaked;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Args, String> {
        let v: Vec<String> = s.split_whitespace().map(String::from).collect();
        parse_args(&v)
    }

    #[test]
    fn arguments() {
        let a = args("--seed x --count 10 --first 5 --threads 3 --ping-interval 0.5 --no-burst")
            .unwrap();
        assert_eq!(
            (
                a.seed.as_str(),
                a.count,
                a.first,
                a.threads,
                a.ping,
                a.burst
            ),
            ("x", 10, 5, 3, 0.5, false)
        );
        assert!(args("--count 10").is_err(), "no seed");
        assert!(args("--seed x").is_err(), "no count");
        assert!(args("--seed x --count 10 --threads 0").is_err());
        assert!(args("--seed x --count 10 --ping-interval -1").is_err());
        assert!(args("--seed x --count 10 --bogus").is_err());
        assert!(args("--seed x --count").is_err(), "flag without value");
        assert!(args(&format!(
            "--seed x --count 2 --first {}",
            keys::MAX_PEERS - 1
        ))
        .is_err());
        assert!(args("--seed x --count 1 --gateway-key AAAA").is_err());
        let a = args("--seed x --count 1 --endpoint 10.96.0.1:51820 --gateway-ip 10.100.0.1 --source-net 10.97.0.0/16").unwrap();
        assert_eq!(a.endpoint, Some("10.96.0.1:51820".parse().unwrap()));
        assert_eq!(a.source, Some((Ipv4Addr::new(10, 97, 0, 0), 16)));
    }
}
