//! Traffic through a translating middlebox (DNAT): transfers to an address that is not the one bound, and the "who am I" server.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tunnelgate::shell::clock;

use super::*;

/// Which end of a [`tcp_transfer_via`] connection sends the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferDir {
    /// The connecting side sends (an upload to the server).
    ClientToServer,
    /// The accepting side sends (a download from the server).
    ServerToClient,
}

/// What one end of a [`tcp_transfer_via`] did: the checksum it sent, or (bytes, checksum) it
/// received.
struct TransferSide {
    sent: Option<u64>,
    received: Option<(u64, u64)>,
}

/// A TCP transfer where the listener binds `listen` in `server` while the client in `client`
/// dials `connect` (e.g. a proxy address DNATed to `listen`; port 0 = the listener's port),
/// and `dir` chooses which end sends. Sends `bytes` of the seeded stream and checks every byte and the checksum on the
/// receiving end. Returns the stats and the peer address the server saw.
pub fn tcp_transfer_via(
    client: &Netns,
    server: &Netns,
    listen: SocketAddr,
    connect: SocketAddr,
    dir: TransferDir,
    bytes: u64,
    timeout: Duration,
) -> Result<(TransferStats, SocketAddr), String> {
    const SEED: u64 = 0x7475_6e6e_656c_6761; // "tunnelga"
    const CHUNK: usize = 64 * 1024;
    let deadline = clock::now() + timeout;
    let io_timeout = timeout.min(Duration::from_secs(10));

    fn send(s: &mut TcpStream, bytes: u64) -> Result<u64, String> {
        let mut gen = PrngStream::new(SEED);
        let mut sum = Checksum::default();
        let mut buf = vec![0u8; CHUNK];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            gen.fill(&mut buf[..n]);
            s.write_all(&buf[..n])
                .map_err(|e| format!("sender: write after {} bytes: {e}", bytes - left))?;
            sum.update(&buf[..n]);
            left -= n as u64;
        }
        s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
        Ok(sum.finish())
    }
    fn receive(s: &mut TcpStream, bytes: u64, deadline: Instant) -> Result<(u64, u64), String> {
        let mut expect = PrngStream::new(SEED);
        let mut sum = Checksum::default();
        let mut buf = vec![0u8; CHUNK];
        let mut want = vec![0u8; CHUNK];
        let mut got: u64 = 0;
        loop {
            if clock::now() >= deadline {
                return Err(format!("receiver: only {got} of {bytes} bytes in time"));
            }
            let n = match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => return Err(format!("receiver: read after {got} bytes: {e}")),
            };
            expect.fill(&mut want[..n]);
            if buf[..n] != want[..n] {
                let i = (0..n).find(|&i| buf[i] != want[i]).unwrap_or(0);
                return Err(format!(
                    "receiver: data differs at offset {}",
                    got + i as u64
                ));
            }
            sum.update(&buf[..n]);
            got += n as u64;
        }
        Ok((got, sum.finish()))
    }

    let listener = server
        .in_ns(|| TcpListener::bind(listen))
        .map_err(|e| format!("bind {listen} in {}: {e}", server.name))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    // Port 0 in `connect` means the port the listener was given (`listen` port 0 = any).
    let connect = match listener.local_addr() {
        Ok(bound) if connect.port() == 0 => SocketAddr::new(connect.ip(), bound.port()),
        _ => connect,
    };
    let accepted = std::thread::spawn(move || -> Result<(SocketAddr, TransferSide), String> {
        let (mut conn, from) = loop {
            match listener.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if clock::now() >= deadline {
                        return Err(format!("no connection to {listen} within {timeout:?}"));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(format!("accept on {listen}: {e}")),
            }
        };
        conn.set_nonblocking(false).map_err(|e| e.to_string())?;
        conn.set_read_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        conn.set_write_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        match dir {
            TransferDir::ClientToServer => Ok((
                from,
                TransferSide {
                    sent: None,
                    received: Some(receive(&mut conn, bytes, deadline)?),
                },
            )),
            TransferDir::ServerToClient => {
                let sum = send(&mut conn, bytes)?;
                // Wait for the client's EOF so the data is not cut by our close.
                let mut rest = [0u8; 1];
                let _ = conn.read(&mut rest);
                Ok((
                    from,
                    TransferSide {
                        sent: Some(sum),
                        received: None,
                    },
                ))
            }
        }
    });

    let start = clock::now();
    let client_side = client.in_ns(|| -> Result<TransferSide, String> {
        let mut s = TcpStream::connect_timeout(&connect, io_timeout)
            .map_err(|e| format!("client: connect {connect} from {}: {e}", client.name))?;
        s.set_read_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(io_timeout))
            .map_err(|e| e.to_string())?;
        match dir {
            TransferDir::ClientToServer => Ok(TransferSide {
                sent: Some(send(&mut s, bytes)?),
                received: None,
            }),
            TransferDir::ServerToClient => {
                let r = receive(&mut s, bytes, deadline)?;
                let _ = s.shutdown(Shutdown::Write);
                Ok(TransferSide {
                    sent: None,
                    received: Some(r),
                })
            }
        }
    });
    let server_side = accepted
        .join()
        .map_err(|_| "server thread panicked".to_string())?;
    let secs = tunnelgate::shell::clock::since(start).as_secs_f64();
    let c = client_side?;
    let (from, s) = server_side?;
    let (sent, (got, got_sum)) = match (c.sent.or(s.sent), s.received.or(c.received)) {
        (Some(s), Some(r)) => (s, r),
        _ => return Err("transfer: a side did not report".into()),
    };
    if got != bytes {
        return Err(format!("sent {bytes} bytes, received {got}"));
    }
    if got_sum != sent {
        return Err(format!(
            "checksum differs: sent {sent:016x}, received {got_sum:016x}"
        ));
    }
    Ok((
        TransferStats {
            bytes,
            checksum: got_sum,
            secs,
        },
        from,
    ))
}

/// A TCP server in a namespace that answers every connection with one line, `LOCAL PEER\n`
/// (the address the client reached, the source address the server saw; IPv4-mapped addresses
/// shown as IPv4), then closes. Bind `[::]:PORT` to serve every address of both families.
/// Records what it saw; stopped on drop.
pub struct TcpWhoami {
    addr: SocketAddr,
    thread: ServerThread<(SocketAddr, SocketAddr)>,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl TcpWhoami {
    pub fn start(ns: &Netns, bind: SocketAddr) -> TcpWhoami {
        let (l, addr) = nonblocking_listener(ns, bind, "whoami");
        let thread = ServerThread::spawn(move |stop, seen| {
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, peer)) => {
                        let local = c.local_addr().map(canonical).unwrap_or(addr);
                        let peer = canonical(peer);
                        record(seen, (local, peer));
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
                        let _ = c.write_all(format!("{local} {peer}\n").as_bytes());
                        let _ = c.shutdown(Shutdown::Both);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        TcpWhoami { addr, thread }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// (local, peer) of every connection so far.
    pub fn seen(&self) -> Vec<(SocketAddr, SocketAddr)> {
        self.thread.seen()
    }
}

/// Connects from `ns` to a [`TcpWhoami`] (possibly through NAT) at `to`: (the address the
/// server was reached at, the source address it saw).
pub fn whoami(
    ns: &Netns,
    to: SocketAddr,
    timeout: Duration,
) -> Result<(SocketAddr, SocketAddr), String> {
    let line = ns.in_ns(|| -> Result<String, String> {
        let mut s = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("{to}: {e}"))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let mut out = String::new();
        s.read_to_string(&mut out)
            .map_err(|e| format!("{to}: {e}"))?;
        Ok(out)
    })?;
    let mut parts = line.split_whitespace().map(|p| p.parse::<SocketAddr>());
    match (parts.next(), parts.next()) {
        (Some(Ok(local)), Some(Ok(peer))) => Ok((local, peer)),
        _ => Err(format!("{to}: unexpected answer {line:?}")),
    }
}
