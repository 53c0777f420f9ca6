//! A UDP relay that holds each datagram for a set time, both ways: the delay element of the WAN
//! benchmark (this kernel has no netem). Also a probe sender and sink to measure the relay alone.
//!
//! ```text
//! tg-wan-relay relay A_LISTEN A_PEER B_LISTEN B_PEER DELAY_US   datagrams to A_LISTEN go to B_PEER
//!                                                                from B_LISTEN, and back, each
//!                                                                after DELAY_US
//! tg-wan-relay probe TARGET RATE SIZE SECONDS                    numbered, timestamped datagrams
//! tg-wan-relay sink LISTEN SECONDS                               their one-way delay and loss, as JSON
//! ```
//!
//! The relay reads commands on standard input: `delay US` (for datagrams arriving from then on),
//! `stats` (prints one JSON line: per direction datagrams in and out, the largest queue, and how
//! late the sends were against their due time, then resets them). It exits when standard input
//! closes, so it never outlives the benchmark that started it.

use std::collections::VecDeque;
use std::io::BufRead;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAX_DATAGRAM: usize = 65536;
const SOCKET_BUFFER: libc::c_int = 16 << 20;

/// The relay's one reading of the clock (tunnelgate's own code reads it through
/// `shell::clock`, which this separate program does not link).
#[allow(clippy::disallowed_methods)]
fn now() -> Instant {
    Instant::now()
}

fn since(t: Instant) -> Duration {
    now().saturating_duration_since(t)
}

/// Nanoseconds on CLOCK_MONOTONIC: the same clock in every process of the machine, so a probe's
/// send time and its sink's receive time compare.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Large socket buffers (forced: the relay runs as root in its namespace), so a burst waits in
/// the relay's queue instead of being dropped by its socket.
fn big_buffers(sock: &UdpSocket) {
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: setsockopt on an open socket with a pointer to a local int.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &SOCKET_BUFFER as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// Sleeps wake within a few microseconds of when asked, not the default 50 us slack.
fn tight_timers() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0u64, 0u64, 0u64) };
}

/// Lateness histogram: 1 us buckets up to 100 ms, then one overflow bucket.
struct Lateness {
    buckets: Vec<u64>,
    max_us: u64,
}

impl Lateness {
    fn new() -> Lateness {
        Lateness {
            buckets: vec![0; 100_001],
            max_us: 0,
        }
    }
    fn add(&mut self, us: u64) {
        let i = (us as usize).min(self.buckets.len() - 1);
        self.buckets[i] += 1;
        self.max_us = self.max_us.max(us);
    }
    fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
    fn percentile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q / 100.0) * n as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return i as u64;
            }
        }
        self.max_us
    }
}

#[derive(Default)]
struct DirStats {
    received: u64,
    trains: u64,
    sent: u64,
    send_errors: u64,
    max_queue: usize,
}

struct Direction {
    name: &'static str,
    queue: Mutex<VecDeque<(Instant, Train)>>,
    ready: Condvar,
    stats: Mutex<(DirStats, Lateness)>,
}

const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Room for one control message carrying an int (UDP_GRO in, UDP_SEGMENT out), 8-byte aligned.
const CMSG_ROOM: usize = 64;

/// Takes datagrams in coalesced trains (UDP_GRO), as a router's NIC would: the daemons send
/// trains (UDP_SEGMENT), and the relay handles a train, not each of its datagrams.
fn enable_gro(sock: &UdpSocket) {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt on an open socket with a pointer to a local int.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            UDP_GRO,
            &on as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// One datagram or train: its bytes and, for a train, the size of each datagram in it.
struct Train {
    bytes: Vec<u8>,
    segment: u16,
}

impl Train {
    fn datagrams(&self) -> u64 {
        match self.segment {
            0 => 1,
            s => self.bytes.len().div_ceil(usize::from(s)) as u64,
        }
    }
}

/// recvmsg with room for the UDP_GRO control message: the bytes read and the segment size of a
/// coalesced train (0 for a single datagram).
fn recv_train(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, u16)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: a zeroed msghdr is valid; its pointers are set to live locals below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM;
    // SAFETY: recvmsg writes at most iov_len bytes into buf and msg_controllen into control.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut segment = 0u16;
    // SAFETY: the CMSG_* walk stays within msg_controllen bytes of `control`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                segment = u16::try_from(v).unwrap_or(0);
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, segment))
}

/// sendmsg of one datagram or train to `to` (IPv4), a train with UDP_SEGMENT.
fn send_train(sock: &UdpSocket, to: &libc::sockaddr_in, train: &Train) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: train.bytes.as_ptr() as *mut libc::c_void,
        iov_len: train.bytes.len(),
    };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: a zeroed msghdr is valid; its pointers are set to live locals below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = to as *const libc::sockaddr_in as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if train.segment > 0 && train.bytes.len() > usize::from(train.segment) {
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE of a u16 fits in CMSG_ROOM; the header and data are written
        // within `control`.
        unsafe {
            msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, train.segment);
        }
    }
    // SAFETY: sendmsg reads the buffers msg points to, all alive for the call.
    let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn sockaddr_v4(addr: SocketAddr) -> Result<libc::sockaddr_in, String> {
    let SocketAddr::V4(a) = addr else {
        return Err(format!("{addr}: the relay forwards to IPv4 addresses only"));
    };
    // SAFETY: a zeroed sockaddr_in is valid; its fields are set below.
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::AF_INET as libc::sa_family_t;
    s.sin_port = a.port().to_be();
    s.sin_addr.s_addr = u32::from(*a.ip()).to_be();
    Ok(s)
}

fn receiver(dir: Arc<Direction>, sock: UdpSocket, delay_us: Arc<AtomicU64>) {
    enable_gro(&sock);
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (n, segment) = match recv_train(&sock, &mut buf) {
            Ok(r) => r,
            Err(_) => continue,
        };
        let due = now() + Duration::from_micros(delay_us.load(Ordering::Relaxed));
        let train = Train {
            bytes: buf[..n].to_vec(),
            segment,
        };
        let datagrams = train.datagrams();
        let len = {
            let mut q = dir.queue.lock().expect("queue");
            q.push_back((due, train));
            q.len()
        };
        dir.ready.notify_one();
        let mut s = dir.stats.lock().expect("stats");
        s.0.received += datagrams;
        s.0.trains += 1;
        s.0.max_queue = s.0.max_queue.max(len);
    }
}

fn sender(dir: Arc<Direction>, sock: UdpSocket, to: libc::sockaddr_in) {
    tight_timers();
    loop {
        let (due, train) = {
            let mut q = dir.queue.lock().expect("queue");
            while q.is_empty() {
                q = dir.ready.wait(q).expect("queue");
            }
            let due = q.front().map(|(d, _)| *d).expect("not empty");
            let t = now();
            if due > t {
                drop(q);
                std::thread::sleep(due - t);
                continue;
            }
            q.pop_front().expect("not empty")
        };
        let ok = send_train(&sock, &to, &train).is_ok();
        let late = now().saturating_duration_since(due).as_micros() as u64;
        let mut s = dir.stats.lock().expect("stats");
        if ok {
            s.0.sent += train.datagrams();
        } else {
            s.0.send_errors += 1;
        }
        s.1.add(late);
    }
}

fn stats_json(dirs: &[Arc<Direction>], delay_us: u64) -> String {
    let mut parts = Vec::new();
    for d in dirs {
        let mut s = d.stats.lock().expect("stats");
        let (st, late) = &*s;
        parts.push(format!(
            "\"{}\":{{\"received\":{},\"trains\":{},\"sent\":{},\"send_errors\":{},\"max_queue\":{},\"late_us_p50\":{},\"late_us_p99\":{},\"late_us_p999\":{},\"late_us_max\":{}}}",
            d.name,
            st.received,
            st.trains,
            st.sent,
            st.send_errors,
            st.max_queue,
            late.percentile(50.0),
            late.percentile(99.0),
            late.percentile(99.9),
            late.max_us
        ));
        *s = (DirStats::default(), Lateness::new());
    }
    format!("{{\"delay_us\":{delay_us},{}}}", parts.join(","))
}

fn relay(
    a_listen: &str,
    a_peer: &str,
    b_listen: &str,
    b_peer: &str,
    delay: u64,
) -> Result<(), String> {
    let parse = |s: &str| s.parse::<SocketAddr>().map_err(|e| format!("{s}: {e}"));
    let (a_peer, b_peer) = (sockaddr_v4(parse(a_peer)?)?, sockaddr_v4(parse(b_peer)?)?);
    let sock_a = UdpSocket::bind(parse(a_listen)?).map_err(|e| format!("bind {a_listen}: {e}"))?;
    let sock_b = UdpSocket::bind(parse(b_listen)?).map_err(|e| format!("bind {b_listen}: {e}"))?;
    big_buffers(&sock_a);
    big_buffers(&sock_b);
    let delay_us = Arc::new(AtomicU64::new(delay));
    let new_dir = |name| {
        Arc::new(Direction {
            name,
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            stats: Mutex::new((DirStats::default(), Lateness::new())),
        })
    };
    let (a_to_b, b_to_a) = (new_dir("a_to_b"), new_dir("b_to_a"));
    let clone = |s: &UdpSocket| s.try_clone().map_err(|e| e.to_string());
    let spawn = |f: Box<dyn FnOnce() + Send>| std::thread::spawn(f);
    {
        let (d, s, dl) = (a_to_b.clone(), clone(&sock_a)?, delay_us.clone());
        spawn(Box::new(move || receiver(d, s, dl)));
        let (d, s) = (a_to_b.clone(), clone(&sock_b)?);
        spawn(Box::new(move || sender(d, s, b_peer)));
        let (d, s, dl) = (b_to_a.clone(), clone(&sock_b)?, delay_us.clone());
        spawn(Box::new(move || receiver(d, s, dl)));
        let (d, s) = (b_to_a.clone(), clone(&sock_a)?);
        spawn(Box::new(move || sender(d, s, a_peer)));
    }
    println!("relaying");
    let dirs = [a_to_b, b_to_a];
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["delay", us] => match us.parse() {
                Ok(v) => {
                    delay_us.store(v, Ordering::Relaxed);
                    println!("{{\"delay_us\":{v}}}");
                }
                Err(_) => println!("{{\"error\":\"delay wants microseconds\"}}"),
            },
            ["stats"] => println!("{}", stats_json(&dirs, delay_us.load(Ordering::Relaxed))),
            _ => println!("{{\"error\":\"unknown command\"}}"),
        }
    }
    Ok(())
}

fn probe(target: &str, rate: f64, size: usize, seconds: f64) -> Result<(), String> {
    let sock = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    sock.connect(target).map_err(|e| format!("{target}: {e}"))?;
    big_buffers(&sock);
    tight_timers();
    let mut buf = vec![0u8; size.max(16)];
    let start = now();
    let mut seq: u64 = 0;
    while since(start).as_secs_f64() < seconds {
        let due = Duration::from_secs_f64(seq as f64 / rate);
        let elapsed = since(start);
        if due > elapsed {
            std::thread::sleep(due - elapsed);
        }
        buf[..8].copy_from_slice(&seq.to_le_bytes());
        buf[8..16].copy_from_slice(&monotonic_ns().to_le_bytes());
        let _ = sock.send(&buf);
        seq += 1;
    }
    println!(
        "{{\"sent\":{seq},\"seconds\":{:.3}}}",
        since(start).as_secs_f64()
    );
    Ok(())
}

fn sink(listen: &str, seconds: f64) -> Result<(), String> {
    let sock = UdpSocket::bind(listen).map_err(|e| format!("bind {listen}: {e}"))?;
    big_buffers(&sock);
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    println!("listening");
    let mut delays = Lateness::new();
    let (mut received, mut reordered, mut highest) = (0u64, 0u64, None::<u64>);
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let start = now();
    while since(start).as_secs_f64() < seconds {
        let Ok(n) = sock.recv(&mut buf) else { continue };
        if n < 16 {
            continue;
        }
        let now = monotonic_ns();
        let seq = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        let sent = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
        received += 1;
        match highest {
            Some(h) if seq < h => reordered += 1,
            _ => highest = Some(seq),
        }
        delays.add(now.saturating_sub(sent) / 1000);
    }
    let expected = highest.map_or(0, |h| h + 1);
    println!(
        "{{\"received\":{received},\"expected\":{expected},\"lost\":{},\"reordered\":{reordered},\"delay_us_p50\":{},\"delay_us_p99\":{},\"delay_us_p999\":{},\"delay_us_max\":{}}}",
        expected.saturating_sub(received),
        delays.percentile(50.0),
        delays.percentile(99.0),
        delays.percentile(99.9),
        delays.max_us
    );
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let num = |s: &str| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
    let result = match a.as_slice() {
        ["relay", al, ap, bl, bp, d] => d
            .parse()
            .map_err(|e| format!("{d}: {e}"))
            .and_then(|d| relay(al, ap, bl, bp, d)),
        ["probe", t, r, s, secs] => (|| probe(t, num(r)?, num(s)? as usize, num(secs)?))(),
        ["sink", l, secs] => num(secs).and_then(|s| sink(l, s)),
        _ => Err("usage: tg-wan-relay relay A_LISTEN A_PEER B_LISTEN B_PEER DELAY_US | probe TARGET RATE SIZE SECONDS | sink LISTEN SECONDS".into()),
    };
    if let Err(e) = result {
        eprintln!("tg-wan-relay: {e}");
        std::process::exit(2);
    }
}
