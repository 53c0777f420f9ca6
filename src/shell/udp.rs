//! The WireGuard UDP socket: dual-stack bind, big kernel buffers, fwmark, and batched I/O:
//! `sendmmsg` with UDP GSO (`UDP_SEGMENT`: one system call and one trip through the stack for
//! a run of equal-size datagrams to one endpoint) and `recvmmsg` with UDP GRO (the kernel hands
//! over coalesced datagrams). Falls back to one datagram per message where GSO is refused.
#![allow(unsafe_code)]

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Kernel socket buffer size. The default ~208 KB drops packets at a few hundred Mbit/s;
/// wireguard-go upstream settled on 7 MB.
const SOCKET_BUFFER_BYTES: usize = 7 << 20;
/// Messages moved per system call.
pub const BATCH: usize = 64;
/// Largest datagram we accept in one piece.
pub const MAX_DATAGRAM: usize = 65535 + 32;
/// Receive buffer per message: a GRO-coalesced message can be up to 64 KB.
const RECV_BUFFER: usize = 65535;
/// The kernel refuses GSO sends of more than 64 segments (UDP_MAX_SEGMENTS) or 64 KB.
const GSO_MAX_SEGMENTS: usize = 64;
const GSO_MAX_BYTES: usize = 65000;
/// Not exported by the libc crate for glibc targets (linux/udp.h).
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Room for one cmsg carrying a u16/int, 8-byte aligned.
type CmsgBuf = [u64; 4];

pub struct WgSocket {
    socket: Socket,
    dual_stack: bool,
    gso: AtomicBool,
    gro: bool,
    /// Set by [`WgSocket::shutdown`]: a shut-down UDP socket does not make `recvmmsg` return 0
    /// (it returns empty "datagrams" at once, forever), so the reader must be told.
    closed: AtomicBool,
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
        if set_int(
            &socket,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            SOCKET_BUFFER_BYTES as libc::c_int,
        )
        .is_err()
        {
            let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
        }
        if set_int(
            &socket,
            libc::SOL_SOCKET,
            libc::SO_SNDBUFFORCE,
            SOCKET_BUFFER_BYTES as libc::c_int,
        )
        .is_err()
        {
            let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
        }
        if let Some(mark) = fwmark {
            socket.set_mark(mark)?;
        }
        let gro = std::env::var_os("TUNNELGATE_NO_UDP_GRO").is_none()
            && set_int(&socket, libc::SOL_UDP, UDP_GRO, 1).is_ok();
        let gso = std::env::var_os("TUNNELGATE_NO_UDP_GSO").is_none() && gso_supported(&socket);
        Ok(WgSocket {
            socket,
            dual_stack,
            gso: AtomicBool::new(gso),
            gro,
            closed: AtomicBool::new(false),
        })
    }

    pub fn local_port(&self) -> io::Result<u16> {
        let addr = self.socket.local_addr()?;
        addr.as_socket()
            .map(|a| a.port())
            .ok_or_else(|| io::Error::other("socket has no inet address"))
    }

    /// Whether segmentation and coalescing offloads are in use, for the startup log.
    pub fn offloads(&self) -> (bool, bool) {
        (self.gso.load(Ordering::Relaxed), self.gro)
    }

    pub fn set_mark(&self, mark: u32) -> io::Result<()> {
        self.socket.set_mark(mark)
    }

    /// Makes [`WgSocket::recv_batch`] give up with [`io::ErrorKind::WouldBlock`] after
    /// `timeout` without a datagram, so the reader wakes on an idle tunnel too.
    pub fn set_receive_timeout(&self, timeout: std::time::Duration) -> io::Result<()> {
        self.socket.set_read_timeout(Some(timeout))
    }

    /// Unblocks a thread sitting in [`WgSocket::recv_batch`] (used at shutdown).
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
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

    /// Sends one datagram (timers, off the hot path).
    pub fn send_one(&self, data: &[u8], to: SocketAddr) -> io::Result<()> {
        self.socket.send_to(data, &self.native(to)).map(|_| ())
    }

    /// Receives up to [`BATCH`] messages; returns how many. Blocks until at least one arrives
    /// (or the receive timeout passes: `WouldBlock`); 0 means the socket was shut down. Use
    /// [`RecvBatch::datagrams`] to walk what arrived.
    pub fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = batch.bufs.len();
        for i in 0..n {
            batch.msgs.iov[i] = libc::iovec {
                iov_base: batch.bufs[i].as_mut_ptr().cast(),
                iov_len: batch.bufs[i].len(),
            };
            // SAFETY: msghdr is plain data; the fields we need are set below.
            batch.msgs.hdrs[i] = libc::mmsghdr {
                msg_hdr: unsafe { zeroed() },
                msg_len: 0,
            };
            let h = &mut batch.msgs.hdrs[i].msg_hdr;
            h.msg_name = (&mut batch.msgs.names[i] as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = size_of::<libc::sockaddr_storage>() as u32;
            h.msg_iov = &mut batch.msgs.iov[i];
            h.msg_iovlen = 1;
            h.msg_control = batch.msgs.cmsgs[i].as_mut_ptr().cast();
            h.msg_controllen = size_of::<CmsgBuf>();
        }
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Ok(0);
            }
            // SAFETY: every pointer set above points into `batch`, which outlives the call,
            // with the lengths given.
            let r = unsafe {
                libc::recvmmsg(
                    self.socket.as_raw_fd(),
                    batch.msgs.hdrs.as_mut_ptr(),
                    n as u32,
                    libc::MSG_WAITFORONE,
                    std::ptr::null_mut(),
                )
            };
            if r >= 0 && self.closed.load(Ordering::Acquire) {
                return Ok(0);
            }
            if r >= 0 {
                let got = r as usize;
                for i in 0..got {
                    batch.lens[i] = batch.msgs.hdrs[i].msg_len as usize;
                    batch.from[i] = storage_to_addr(&batch.msgs.names[i]);
                    batch.segment[i] = gro_size(&batch.msgs.hdrs[i].msg_hdr)
                        .unwrap_or(batch.lens[i])
                        .max(1);
                }
                batch.count = got;
                return Ok(got);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }

    /// Sends every queued datagram of `batch` and clears it. Runs of equal-size datagrams to
    /// one endpoint go out as one GSO message. A message the kernel refuses drops only itself;
    /// the number of datagrams dropped is returned.
    pub fn send_batch(&self, batch: &mut SendBatch) -> usize {
        if batch.count == 0 {
            return 0;
        }
        let gso = self.gso.load(Ordering::Relaxed);
        let msgs = batch.build_messages(self, gso);
        let mut dropped = 0;
        let mut start = 0;
        while start < msgs {
            // SAFETY: the headers, iovecs, names and cmsgs built above point into `batch`.
            let r = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    batch.msgs.hdrs[start..].as_mut_ptr(),
                    (msgs - start) as u32,
                    0,
                )
            };
            if r > 0 {
                start += r as usize;
                continue;
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) => std::thread::yield_now(),
                // The device on this path cannot segment: turn GSO off and resend the rest
                // one datagram per message.
                Some(libc::EIO) | Some(libc::EINVAL) if gso && batch.msg_segments[start] > 1 => {
                    tracing::warn!("UDP GSO refused by the kernel; sending without it");
                    self.gso.store(false, Ordering::Relaxed);
                    let rest = batch.msg_first[start];
                    batch.drop_before(rest);
                    return dropped + self.send_batch(batch);
                }
                _ => {
                    dropped += batch.msg_segments[start];
                    start += 1;
                }
            }
        }
        batch.clear();
        dropped
    }
}

fn gso_supported(socket: &Socket) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: valid fd, pointer to a c_int and its length.
    unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_UDP,
            UDP_SEGMENT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        ) == 0
    }
}

fn set_int(
    socket: &Socket,
    level: libc::c_int,
    opt: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a valid fd and a pointer to a c_int of the size given.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            opt,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as u32,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The segment size of a GRO-coalesced message, from its UDP_GRO control message.
fn gro_size(h: &libc::msghdr) -> Option<usize> {
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return usize::try_from(v).ok().filter(|v| *v > 0);
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
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

/// The per-message headers, addresses, control data and iovecs of one `recvmmsg` or
/// `sendmmsg`: rewritten before every call, allocated once.
struct MmsgScratch {
    iov: Vec<libc::iovec>,
    names: Vec<libc::sockaddr_storage>,
    cmsgs: Vec<CmsgBuf>,
    hdrs: Vec<libc::mmsghdr>,
}

impl MmsgScratch {
    fn new() -> MmsgScratch {
        MmsgScratch {
            iov: (0..BATCH)
                .map(|_| libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                })
                .collect(),
            // SAFETY: plain data, zero is valid.
            names: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
            cmsgs: vec![[0; 4]; BATCH],
            // SAFETY: plain data, zero is valid.
            hdrs: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
        }
    }
}

/// Buffers for one `recvmmsg`, allocated once per receiving thread.
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    lens: Vec<usize>,
    from: Vec<SocketAddr>,
    segment: Vec<usize>,
    count: usize,
    msgs: MmsgScratch,
}

// SAFETY: the raw pointers inside are scratch space rewritten before each call.
unsafe impl Send for RecvBatch {}

impl Default for RecvBatch {
    fn default() -> Self {
        RecvBatch {
            bufs: (0..BATCH).map(|_| vec![0u8; RECV_BUFFER]).collect(),
            lens: vec![0; BATCH],
            from: vec![SocketAddr::from(([0, 0, 0, 0], 0)); BATCH],
            segment: vec![1; BATCH],
            count: 0,
            msgs: MmsgScratch::new(),
        }
    }
}

impl RecvBatch {
    /// Every datagram received, coalesced messages split at their segment size.
    pub fn datagrams(&self) -> impl Iterator<Item = (SocketAddr, &[u8])> + '_ {
        (0..self.count).flat_map(move |i| {
            self.bufs[i][..self.lens[i]]
                .chunks(self.segment[i])
                .map(move |d| (self.from[i], d))
        })
    }
}

/// Outgoing datagrams, packed back to back so a run of them can be one GSO message.
pub struct SendBatch {
    data: Vec<u8>,
    max_datagram: usize,
    cursor: usize,
    starts: Vec<usize>,
    lens: Vec<usize>,
    to: Vec<SocketAddr>,
    count: usize,
    msgs: MmsgScratch,
    /// Per message: datagrams in it and the index of its first one.
    msg_segments: Vec<usize>,
    msg_first: Vec<usize>,
}

// SAFETY: as for RecvBatch.
unsafe impl Send for SendBatch {}

impl SendBatch {
    /// Room for [`BATCH`] datagrams of up to `max_datagram` bytes.
    pub fn new(max_datagram: usize) -> SendBatch {
        SendBatch {
            data: vec![0u8; max_datagram * BATCH],
            max_datagram,
            cursor: 0,
            starts: vec![0; BATCH],
            lens: vec![0; BATCH],
            to: vec![SocketAddr::from(([0, 0, 0, 0], 0)); BATCH],
            count: 0,
            msgs: MmsgScratch::new(),
            msg_segments: vec![0; BATCH],
            msg_first: vec![0; BATCH],
        }
    }

    pub fn is_full(&self) -> bool {
        self.count == BATCH
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Space for the next datagram; commit it with [`SendBatch::push`].
    pub fn slot(&mut self) -> &mut [u8] {
        &mut self.data[self.cursor..self.cursor + self.max_datagram]
    }

    pub fn push(&mut self, len: usize, to: SocketAddr) {
        self.starts[self.count] = self.cursor;
        self.lens[self.count] = len;
        self.to[self.count] = to;
        self.cursor += len;
        self.count += 1;
    }

    fn clear(&mut self) {
        self.count = 0;
        self.cursor = 0;
    }

    /// Forgets the datagrams before `first` (already sent), keeping the rest in place.
    fn drop_before(&mut self, first: usize) {
        let n = self.count - first;
        self.starts.copy_within(first..self.count, 0);
        self.lens.copy_within(first..self.count, 0);
        self.to.copy_within(first..self.count, 0);
        self.count = n;
    }

    /// Fills the message headers; returns the number of messages.
    fn build_messages(&mut self, socket: &WgSocket, gso: bool) -> usize {
        let mut msgs = 0;
        let mut i = 0;
        while i < self.count {
            // A GSO run: same endpoint, same size, contiguous; only its last may be shorter.
            let size = self.lens[i];
            let mut j = i + 1;
            let mut bytes = size;
            if gso {
                while j < self.count
                    && self.to[j] == self.to[i]
                    && self.lens[j] <= size
                    && self.starts[j] == self.starts[j - 1] + self.lens[j - 1]
                    && j - i < GSO_MAX_SEGMENTS
                    && bytes + self.lens[j] <= GSO_MAX_BYTES
                {
                    bytes += self.lens[j];
                    j += 1;
                    if self.lens[j - 1] < size {
                        break;
                    }
                }
            }
            let name = socket.native(self.to[i]);
            // SAFETY: `name` is a valid sockaddr no larger than sockaddr_storage.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    name.as_ptr().cast::<u8>(),
                    (&mut self.msgs.names[msgs] as *mut libc::sockaddr_storage).cast::<u8>(),
                    name.len() as usize,
                );
            }
            self.msgs.iov[msgs] = libc::iovec {
                iov_base: self.data[self.starts[i]..].as_mut_ptr().cast(),
                iov_len: bytes,
            };
            // SAFETY: msghdr is plain data.
            self.msgs.hdrs[msgs] = libc::mmsghdr {
                msg_hdr: unsafe { zeroed() },
                msg_len: 0,
            };
            let h = &mut self.msgs.hdrs[msgs].msg_hdr;
            h.msg_name = (&mut self.msgs.names[msgs] as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = name.len();
            h.msg_iov = &mut self.msgs.iov[msgs];
            h.msg_iovlen = 1;
            if j - i > 1 {
                h.msg_control = self.msgs.cmsgs[msgs].as_mut_ptr().cast();
                // SAFETY: CMSG_SPACE/LEN are pure arithmetic; the buffer is 32 bytes, enough for
                // one header plus a u16, and CMSG_FIRSTHDR points at its start.
                unsafe {
                    h.msg_controllen = libc::CMSG_SPACE(size_of::<u16>() as u32) as usize;
                    let c = libc::CMSG_FIRSTHDR(h);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as usize;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size as u16);
                }
            }
            self.msg_segments[msgs] = j - i;
            self.msg_first[msgs] = i;
            msgs += 1;
            i = j;
        }
        msgs
    }
}
