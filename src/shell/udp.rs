//! The WireGuard UDP socket: dual-stack bind, big kernel buffers, fwmark, and batched
//! `recvmmsg`/`sendmmsg` into buffers allocated once. The only unsafe code outside the TUN crate.
#![allow(unsafe_code)]

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::AsRawFd;

/// Kernel socket buffer size. The default ~208 KB drops packets at a few hundred Mbit/s;
/// wireguard-go upstream settled on 7 MB.
const SOCKET_BUFFER_BYTES: usize = 7 << 20;
/// Datagrams moved per system call.
pub const BATCH: usize = 64;
/// Largest datagram we accept (a full 64 KB IP packet never comes in one WireGuard message,
/// but the MTU is configurable up to 65535).
pub const MAX_DATAGRAM: usize = 65535 + 32;

pub struct WgSocket {
    socket: Socket,
    dual_stack: bool,
}

impl WgSocket {
    /// Binds `[::]:port` accepting IPv4 too, or `0.0.0.0:port` where IPv6 is disabled.
    pub fn bind(port: u16, fwmark: Option<u32>) -> io::Result<WgSocket> {
        let (socket, dual_stack) = match Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP))
        {
            Ok(s) => {
                s.set_only_v6(false)?;
                s.bind(&SockAddr::from(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                    port,
                )))?;
                (s, true)
            }
            Err(_) => {
                let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
                s.bind(&SockAddr::from(SocketAddr::from(([0, 0, 0, 0], port))))?;
                (s, false)
            }
        };
        // Force past rmem_max as root; fall back to the capped request otherwise.
        if set_int(&socket, libc::SO_RCVBUFFORCE, SOCKET_BUFFER_BYTES).is_err() {
            let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
        }
        if set_int(&socket, libc::SO_SNDBUFFORCE, SOCKET_BUFFER_BYTES).is_err() {
            let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
        }
        if let Some(mark) = fwmark {
            socket.set_mark(mark)?;
        }
        Ok(WgSocket { socket, dual_stack })
    }

    pub fn local_port(&self) -> io::Result<u16> {
        let addr = self.socket.local_addr()?;
        addr.as_socket()
            .map(|a| a.port())
            .ok_or_else(|| io::Error::other("socket has no inet address"))
    }

    pub fn set_mark(&self, mark: u32) -> io::Result<()> {
        self.socket.set_mark(mark)
    }

    pub fn try_clone(&self) -> io::Result<WgSocket> {
        Ok(WgSocket {
            socket: self.socket.try_clone()?,
            dual_stack: self.dual_stack,
        })
    }

    /// Unblocks a thread sitting in [`WgSocket::recv_batch`] (used at shutdown).
    pub fn shutdown(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Read);
    }

    fn native(&self, addr: SocketAddr) -> SockAddr {
        match addr {
            SocketAddr::V4(v4) if self.dual_stack => {
                SockAddr::from(SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0))
            }
            other => SockAddr::from(other),
        }
    }

    /// Sends one datagram (timers and handshakes, off the hot path).
    pub fn send_one(&self, data: &[u8], to: SocketAddr) -> io::Result<()> {
        self.socket.send_to(data, &self.native(to)).map(|_| ())
    }

    /// Receives up to [`BATCH`] datagrams; returns how many. Blocks until at least one arrives.
    pub fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = batch.bufs.len();
        for i in 0..n {
            batch.iov[i] = libc::iovec {
                iov_base: batch.bufs[i].as_mut_ptr().cast(),
                iov_len: batch.bufs[i].len(),
            };
            // SAFETY: zeroed sockaddr_storage is a valid "empty" address.
            batch.names[i] = unsafe { zeroed() };
            batch.hdrs[i] = libc::mmsghdr {
                // SAFETY: msghdr is plain data; every field we need is set below.
                msg_hdr: unsafe { zeroed() },
                msg_len: 0,
            };
            batch.hdrs[i].msg_hdr.msg_name =
                (&mut batch.names[i] as *mut libc::sockaddr_storage).cast();
            batch.hdrs[i].msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as u32;
            batch.hdrs[i].msg_hdr.msg_iov = &mut batch.iov[i];
            batch.hdrs[i].msg_hdr.msg_iovlen = 1;
        }
        loop {
            // SAFETY: hdrs, iov, names and bufs live in `batch` for the whole call and every
            // pointer above points into them with the lengths given.
            let r = unsafe {
                libc::recvmmsg(
                    self.socket.as_raw_fd(),
                    batch.hdrs.as_mut_ptr(),
                    n as u32,
                    libc::MSG_WAITFORONE,
                    std::ptr::null_mut(),
                )
            };
            if r >= 0 {
                let got = r as usize;
                for i in 0..got {
                    batch.lens[i] = batch.hdrs[i].msg_len as usize;
                    batch.from[i] = storage_to_addr(&batch.names[i]);
                }
                return Ok(got);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }

    /// Sends every queued datagram of `batch` and clears it. Per-datagram errors (an unreachable
    /// endpoint) drop that datagram only; the count of dropped ones is returned.
    pub fn send_batch(&self, batch: &mut SendBatch) -> usize {
        let mut dropped = 0;
        let mut start = 0;
        let count = batch.count;
        for i in 0..count {
            let off = i * batch.stride;
            batch.iov[i] = libc::iovec {
                iov_base: batch.data[off..].as_mut_ptr().cast(),
                iov_len: batch.lens[i],
            };
            let name = self.native(batch.to[i]);
            // SAFETY: `name` is a valid sockaddr of `name.len()` bytes, no larger than storage.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    name.as_ptr().cast::<u8>(),
                    (&mut batch.names[i] as *mut libc::sockaddr_storage).cast::<u8>(),
                    name.len() as usize,
                );
            }
            // SAFETY: msghdr is plain data.
            batch.hdrs[i] = libc::mmsghdr {
                msg_hdr: unsafe { zeroed() },
                msg_len: 0,
            };
            batch.hdrs[i].msg_hdr.msg_name =
                (&mut batch.names[i] as *mut libc::sockaddr_storage).cast();
            batch.hdrs[i].msg_hdr.msg_namelen = name.len();
            batch.hdrs[i].msg_hdr.msg_iov = &mut batch.iov[i];
            batch.hdrs[i].msg_hdr.msg_iovlen = 1;
        }
        while start < count {
            // SAFETY: as in recv_batch, all pointers point into `batch`, alive for the call.
            let r = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    batch.hdrs[start..].as_mut_ptr(),
                    (count - start) as u32,
                    0,
                )
            };
            if r > 0 {
                start += r as usize;
            } else if r == 0 {
                break;
            } else {
                let err = io::Error::last_os_error();
                match err.kind() {
                    io::ErrorKind::Interrupted => {}
                    io::ErrorKind::WouldBlock => std::thread::yield_now(),
                    // The first datagram failed (no route, bad address): drop it, go on.
                    _ => {
                        dropped += 1;
                        start += 1;
                    }
                }
            }
        }
        batch.count = 0;
        dropped
    }
}

fn set_int(socket: &Socket, opt: libc::c_int, value: usize) -> io::Result<()> {
    let v = value as libc::c_int;
    // SAFETY: a valid fd and a pointer to a c_int of the size given.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as u32,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn storage_to_addr(s: &libc::sockaddr_storage) -> SocketAddr {
    match s.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let a: &libc::sockaddr_in = unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            SocketAddr::from((
                u32::from_be(a.sin_addr.s_addr).to_be_bytes(),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this storage holds a sockaddr_in6.
            let a: &libc::sockaddr_in6 = unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            let port = u16::from_be(a.sin6_port);
            match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::from((v4, port)),
                None => SocketAddr::V6(SocketAddrV6::new(ip, port, 0, a.sin6_scope_id)),
            }
        }
        _ => SocketAddr::from(([0, 0, 0, 0], 0)),
    }
}

/// Buffers for one `recvmmsg`, allocated once per receiving thread.
pub struct RecvBatch {
    pub bufs: Vec<Vec<u8>>,
    pub lens: Vec<usize>,
    pub from: Vec<SocketAddr>,
    iov: Vec<libc::iovec>,
    names: Vec<libc::sockaddr_storage>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside are only scratch space rewritten before each call.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub fn new(datagram_size: usize) -> RecvBatch {
        RecvBatch {
            bufs: (0..BATCH).map(|_| vec![0u8; datagram_size]).collect(),
            lens: vec![0; BATCH],
            from: vec![SocketAddr::from(([0, 0, 0, 0], 0)); BATCH],
            iov: (0..BATCH)
                .map(|_| libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                })
                .collect(),
            // SAFETY: plain data, zero is valid.
            names: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
            // SAFETY: plain data, zero is valid.
            hdrs: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
        }
    }
}

/// Outgoing datagrams for one `sendmmsg`: a flat buffer of fixed-size slots.
pub struct SendBatch {
    data: Vec<u8>,
    stride: usize,
    lens: Vec<usize>,
    to: Vec<SocketAddr>,
    count: usize,
    iov: Vec<libc::iovec>,
    names: Vec<libc::sockaddr_storage>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: as for RecvBatch.
unsafe impl Send for SendBatch {}

impl SendBatch {
    pub fn new(slot_size: usize) -> SendBatch {
        SendBatch {
            data: vec![0u8; slot_size * BATCH],
            stride: slot_size,
            lens: vec![0; BATCH],
            to: vec![SocketAddr::from(([0, 0, 0, 0], 0)); BATCH],
            count: 0,
            iov: (0..BATCH)
                .map(|_| libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                })
                .collect(),
            // SAFETY: plain data, zero is valid.
            names: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
            // SAFETY: plain data, zero is valid.
            hdrs: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
        }
    }

    pub fn is_full(&self) -> bool {
        self.count == BATCH
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The next free slot to write a datagram into; commit it with [`SendBatch::push`].
    pub fn slot(&mut self) -> &mut [u8] {
        let off = self.count * self.stride;
        &mut self.data[off..off + self.stride]
    }

    pub fn push(&mut self, len: usize, to: SocketAddr) {
        self.lens[self.count] = len;
        self.to[self.count] = to;
        self.count += 1;
    }
}
