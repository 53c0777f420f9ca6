//! Traffic through the tunnel: ping, HTTP GET, checksummed TCP transfers and UDP/TCP echo servers.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tunnelgate::shell::clock;

use super::*;

/// One ping (1 s timeout) from `ns` to `addr` (v4 or v6).
pub fn ping(ns: &Netns, addr: &str) -> bool {
    ns.output(&["ping", "-n", "-q", "-c", "1", "-W", "1", addr])
        .success()
}

/// Pings until one answers or `timeout` passes.
pub fn ping_until(ns: &Netns, addr: &str, timeout: Duration) -> bool {
    poll_until(timeout, || ping(ns, addr))
}

/// `GET path` over HTTP/1.1 to `addr` from inside namespace `ns_name`: (status, body).
pub fn http_get_in(
    ns_name: &str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let nspath = PathBuf::from(format!("/var/run/netns/{ns_name}"));
    let path = path.to_string();
    std::thread::spawn(move || {
        enter_ns(&nspath);
        http_get(addr, &path, timeout)
    })
    .join()
    .map_err(|_| "http_get thread panicked".to_string())?
}

/// `GET path` from inside `ns`: (status, body).
pub fn http_get_ns(ns: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    http_get_in(&ns.name, addr, path, Duration::from_secs(2))
}

/// A plain HTTP/1.1 GET from the calling thread's namespace.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    // One write: a server that reads the request once must see all of it.
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("{addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}: no HTTP header in {text:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr}: bad status line in {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    Ok((code, if chunked { dechunk(body) } else { body.into() }))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The deterministic pseudo-random byte stream the transfer helpers send (splitmix64, little endian).
pub struct PrngStream {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl PrngStream {
    pub fn new(seed: u64) -> PrngStream {
        PrngStream {
            state: seed,
            word: [0; 8],
            used: 8,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fills `out` with the next bytes of the stream.
    pub fn fill(&mut self, out: &mut [u8]) {
        let mut i = 0;
        while i < out.len() && self.used < 8 {
            out[i] = self.word[self.used];
            self.used += 1;
            i += 1;
        }
        let mut chunks = out[i..].chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            self.word = self.next_u64().to_le_bytes();
            let n = tail.len();
            tail.copy_from_slice(&self.word[..n]);
            self.used = n;
        }
    }
}

/// A streaming 64-bit checksum (FNV-1a over 8-byte words; independent of how reads split the
/// stream).
pub struct Checksum {
    h: u64,
    pending: [u8; 8],
    n: usize,
}

impl Default for Checksum {
    fn default() -> Self {
        Checksum {
            h: 0xcbf2_9ce4_8422_2325,
            pending: [0; 8],
            n: 0,
        }
    }
}

impl Checksum {
    fn mix(&mut self, w: u64) {
        self.h = (self.h ^ w).wrapping_mul(0x0000_0100_0000_01B3);
    }

    pub fn update(&mut self, mut data: &[u8]) {
        while self.n > 0 && !data.is_empty() {
            self.pending[self.n] = data[0];
            self.n = (self.n + 1) % 8;
            data = &data[1..];
            if self.n == 0 {
                let w = u64::from_le_bytes(self.pending);
                self.mix(w);
            }
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            self.mix(u64::from_le_bytes(b));
        }
        for &b in chunks.remainder() {
            self.pending[self.n] = b;
            self.n += 1;
        }
    }

    pub fn finish(mut self) -> u64 {
        let n = self.n as u64;
        for i in self.n..8 {
            self.pending[i] = 0;
        }
        if self.n > 0 {
            let w = u64::from_le_bytes(self.pending);
            self.mix(w);
        }
        self.mix(n);
        self.h
    }
}

/// What a TCP transfer moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    pub bytes: u64,
    pub checksum: u64,
    pub secs: f64,
}

impl TransferStats {
    pub fn mbit_per_s(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e6 / self.secs.max(1e-9)
    }
}

/// Sends `bytes` of the seeded pseudo-random stream over TCP from namespace `src` to a listener on
/// `dst_addr:port` in `dst` (port 0 = any), and checks that exactly those bytes arrived, in order
/// (compared byte for byte and by checksum). `Err` says what went wrong (refused, timeout, short,
/// first differing offset). `timeout` bounds the whole transfer.
pub fn tcp_transfer(
    src: &Netns,
    dst: &Netns,
    dst_addr: IpAddr,
    port: u16,
    bytes: u64,
    timeout: Duration,
) -> Result<TransferStats, String> {
    let addr = SocketAddr::new(dst_addr, port);
    tcp_transfer_via(
        src,
        dst,
        addr,
        addr,
        TransferDir::ClientToServer,
        bytes,
        timeout,
    )
    .map(|(stats, _)| stats)
}

/// The background thread of a test server: runs until its owner is dropped, and keeps what the
/// server records about each client.
pub(super) struct ServerThread<T> {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<T>>>,
    handle: Option<JoinHandle<()>>,
}

impl<T: Clone + Send + 'static> ServerThread<T> {
    /// Runs `serve(stop, seen)` on a new thread; `serve` returns once `stop` is set.
    pub(super) fn spawn(
        serve: impl FnOnce(&AtomicBool, &Mutex<Vec<T>>) + Send + 'static,
    ) -> ServerThread<T> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let handle = std::thread::spawn(move || serve(&stop2, &seen2));
        ServerThread {
            stop,
            seen,
            handle: Some(handle),
        }
    }

    pub(super) fn seen(&self) -> Vec<T> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// A TCP listener bound inside `ns`, non-blocking so a server loop can check its stop flag.
pub(super) fn nonblocking_listener(
    ns: &Netns,
    bind: SocketAddr,
    what: &str,
) -> (TcpListener, SocketAddr) {
    let l = ns
        .in_ns(|| TcpListener::bind(bind))
        .unwrap_or_else(|e| panic!("{what}: bind {bind} in {}: {e}", ns.name));
    let addr = l.local_addr().expect("listener local addr");
    l.set_nonblocking(true).expect("listener nonblocking");
    (l, addr)
}

pub(super) fn record<T>(seen: &Mutex<Vec<T>>, item: T) {
    if let Ok(mut s) = seen.lock() {
        s.push(item);
    }
}

impl<T> Drop for ServerThread<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A UDP echo server in a namespace: answers every datagram with the same bytes, and records the
/// source addresses it saw. Stopped on drop.
pub struct UdpEcho {
    addr: SocketAddr,
    thread: ServerThread<SocketAddr>,
}

impl UdpEcho {
    /// Binds `bind` (port 0 = any) inside `ns`.
    pub fn start(ns: &Netns, bind: SocketAddr) -> UdpEcho {
        let sock = ns
            .in_ns(|| UdpSocket::bind(bind))
            .unwrap_or_else(|e| panic!("udp echo: bind {bind} in {}: {e}", ns.name));
        let addr = sock.local_addr().expect("udp echo local addr");
        sock.set_read_timeout(Some(POLL))
            .expect("udp echo read timeout");
        let thread = ServerThread::spawn(move |stop, seen| {
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    record(seen, from);
                    let _ = sock.send_to(&buf[..n], from);
                }
            }
        });
        UdpEcho { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Distinct source addresses seen so far, in order of first appearance.
    pub fn seen(&self) -> Vec<SocketAddr> {
        let all = self.thread.seen();
        let mut uniq = HashSet::new();
        all.into_iter().filter(|a| uniq.insert(*a)).collect()
    }
}

/// Sends `payload` from `ns` to `to` over UDP and returns the first reply within `timeout`
/// (retrying the send every 200 ms), or `None`.
pub fn udp_roundtrip(
    ns: &Netns,
    to: SocketAddr,
    payload: &[u8],
    timeout: Duration,
) -> Option<Vec<u8>> {
    ns.in_ns(|| {
        let bind: SocketAddr = if to.is_ipv4() {
            "0.0.0.0:0".parse().ok()?
        } else {
            "[::]:0".parse().ok()?
        };
        let s = UdpSocket::bind(bind).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(200))).ok()?;
        let deadline = clock::now() + timeout;
        let mut buf = vec![0u8; 65536];
        while clock::now() < deadline {
            let _ = s.send_to(payload, to);
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                if from == to {
                    return Some(buf[..n].to_vec());
                }
            }
        }
        None
    })
}

/// A TCP echo server in a namespace (a thread per connection), recording client addresses.
/// Stopped on drop.
pub struct TcpEcho {
    addr: SocketAddr,
    thread: ServerThread<SocketAddr>,
}

impl TcpEcho {
    pub fn start(ns: &Netns, bind: SocketAddr) -> TcpEcho {
        let (l, addr) = nonblocking_listener(ns, bind, "tcp echo");
        let thread = ServerThread::spawn(move |stop, seen| {
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, from)) => {
                        record(seen, from);
                        std::thread::spawn(move || {
                            let _ = c.set_nonblocking(false);
                            let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = c.read(&mut buf) {
                                if n == 0 || c.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        TcpEcho { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Client addresses seen so far (one per connection).
    pub fn seen(&self) -> Vec<SocketAddr> {
        self.thread.seen()
    }
}

/// Connects from `ns` to `to`, sends `payload`, half-closes, and returns everything read back.
pub fn tcp_roundtrip(
    ns: &Netns,
    to: SocketAddr,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    ns.in_ns(|| {
        let mut s = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("{to}: {e}"))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        s.write_all(payload).map_err(|e| format!("{to}: {e}"))?;
        s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).map_err(|e| format!("{to}: {e}"))?;
        Ok(out)
    })
}
