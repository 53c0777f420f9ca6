//! The WireGuard UDP socket: dual-stack bind, big kernel buffers, fwmark, and batched I/O:
//! `sendmmsg` with UDP GSO (`UDP_SEGMENT`: one system call and one trip through the stack for
//! a run of equal-size datagrams to one endpoint) and `recvmmsg` with UDP GRO (the kernel hands
//! over coalesced datagrams). Falls back to one datagram per message where GSO is refused.
//!
//! Every datagram received carries the local address it was sent to (`IP_PKTINFO` /
//! `IPV6_PKTINFO`), and every datagram sent may name its source the same way, so replies leave
//! from the address the peer used ([`PeerPath`]). The control messages live in the per-message
//! buffers allocated once per batch, so this costs no allocation and no system call.
#![allow(unsafe_code)]

use crate::core::packet::{source_is_stale, steering, PeerPath};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

/// How the WireGuard sockets are made (from `shell::tuning::Tuning`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketOptions {
    /// Send and receive buffer size.
    pub buffer_bytes: usize,
    /// Ask for UDP generic receive offload.
    pub gro: bool,
    /// Use UDP segmentation offload when the kernel has it.
    pub gso: bool,
    /// Stamp each received message with its arrival time (the AQM's input).
    pub timestamps: bool,
}

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
/// Room for the control messages of one message, 8-byte aligned: a UDP_GRO/UDP_SEGMENT value
/// (24 bytes with its header), an `in6_pktinfo` (40) or `in_pktinfo` (32), and a receive
/// timestamp (`SCM_TIMESTAMPNS`, 32), with room to spare.
type CmsgBuf = [u64; 16];

pub struct WgSocket {
    socket: Socket,
    dual_stack: bool,
    gso: AtomicBool,
    gro: bool,
    /// Whether the local address of each datagram is reported (`IP_PKTINFO`).
    pktinfo: bool,
    /// Whether each message carries the time the kernel received it (`SO_TIMESTAMPNS`), which
    /// is what the receive queue's AQM measures.
    timestamps: bool,
    /// Set by [`WgSocket::shutdown`]: a shut-down UDP socket does not make `recvmmsg` return 0
    /// (it returns empty "datagrams" at once, forever), so the reader must be told.
    closed: AtomicBool,
}

impl WgSocket {
    /// Binds `[::]:port` accepting IPv4 too, or `0.0.0.0:port` where IPv6 is disabled.
    pub fn bind(port: u16, fwmark: Option<u32>, options: &SocketOptions) -> io::Result<WgSocket> {
        WgSocket::bind_with(port, fwmark, false, options)
    }

    /// One socket per packet worker, all on `port` (`SO_REUSEPORT`), with a steering program
    /// that hands every datagram of a session to the worker that owns its peer
    /// ([`steering::Steering::program`]): a peer's datagrams stay in order on one worker. The
    /// group starts with `steering` (the plain modulo before the peers are known);
    /// [`WgSocket::steer`] shares out the peers once they are. One worker gets one plain socket.
    pub fn bind_group(
        port: u16,
        fwmark: Option<u32>,
        steering: &steering::Steering,
        options: &SocketOptions,
    ) -> io::Result<Vec<WgSocket>> {
        let workers = steering.workers();
        if workers <= 1 {
            return Ok(vec![WgSocket::bind(port, fwmark, options)?]);
        }
        // A plain bind first: a port another process holds is refused here, instead of this
        // group joining (as the same user may) an existing reuse-port group on it.
        let port = WgSocket::bind(port, None, options)?.local_port()?;
        let group = (0..workers)
            .map(|_| WgSocket::bind_with(port, fwmark, true, options))
            .collect::<io::Result<Vec<WgSocket>>>()?;
        if let Err(error) = WgSocket::steer(&group, steering) {
            // Without it the kernel spreads by a hash of the addresses: still one peer per
            // socket, only not evenly by peer.
            tracing::warn!(%error, "UDP steering program refused; the kernel spreads peers by address hash");
        }
        Ok(group)
    }

    /// Installs `steering` as the reuse-port program of `group` (a group from
    /// [`WgSocket::bind_group`]; one socket has nothing to steer). Replaces the program before:
    /// the kernel switches at once, so a peer whose owner moved may have a few datagrams
    /// opened out of order, which its replay window accepts.
    pub fn steer(group: &[WgSocket], steering: &steering::Steering) -> io::Result<()> {
        let Some(first) = group.first().filter(|_| group.len() > 1) else {
            return Ok(());
        };
        let program = steering.program();
        let prog = libc::sock_fprog {
            len: u16::try_from(program.len()).map_err(io::Error::other)?,
            // The kernel copies the program and never writes through this pointer.
            filter: program.as_ptr().cast::<libc::sock_filter>().cast_mut(),
        };
        // SAFETY: a valid fd and `prog` pointing at `len` instructions laid out as
        // `struct sock_filter` (`cbpf::Instruction` is repr(C) with the same fields), alive for
        // the call (the kernel copies them).
        let r = unsafe {
            libc::setsockopt(
                first.socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_REUSEPORT_CBPF,
                (&prog as *const libc::sock_fprog).cast(),
                size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn bind_with(
        port: u16,
        fwmark: Option<u32>,
        reuse_port: bool,
        options: &SocketOptions,
    ) -> io::Result<WgSocket> {
        let (socket, dual_stack) = match Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP))
        {
            Ok(s) => {
                s.set_only_v6(false)?;
                if reuse_port {
                    s.set_reuse_port(true)?;
                }
                s.bind(&SockAddr::from(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                    port,
                )))?;
                (s, true)
            }
            Err(_) => {
                let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
                if reuse_port {
                    s.set_reuse_port(true)?;
                }
                s.bind(&SockAddr::from(SocketAddr::from(([0, 0, 0, 0], port))))?;
                (s, false)
            }
        };
        // Force past rmem_max as root; fall back to the capped request otherwise.
        let buffer = options.buffer_bytes;
        if set_int(
            &socket,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            buffer as libc::c_int,
        )
        .is_err()
        {
            let _ = socket.set_recv_buffer_size(buffer);
        }
        if set_int(
            &socket,
            libc::SOL_SOCKET,
            libc::SO_SNDBUFFORCE,
            buffer as libc::c_int,
        )
        .is_err()
        {
            let _ = socket.set_send_buffer_size(buffer);
        }
        if let Some(mark) = fwmark {
            socket.set_mark(mark)?;
        }
        let gro = options.gro && set_int(&socket, libc::SOL_UDP, UDP_GRO, 1).is_ok();
        let gso = options.gso && gso_supported(&socket);
        // IPv4 (also v4-mapped on the dual-stack socket) and IPv6 destination addresses.
        let mut pktinfo = set_int(&socket, libc::IPPROTO_IP, libc::IP_PKTINFO, 1).is_ok();
        if dual_stack {
            pktinfo &= set_int(&socket, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1).is_ok();
        }
        if !pktinfo {
            tracing::warn!(
                "IP_PKTINFO unavailable: replies leave from the kernel's choice of source"
            );
        }
        // Each message's arrival time, for the receive queue's AQM (only when it is on: the
        // kernel then stamps every packet it receives, a small cost for everyone).
        let timestamps = options.timestamps
            && set_int(&socket, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1).is_ok();
        Ok(WgSocket {
            socket,
            dual_stack,
            gso: AtomicBool::new(gso),
            gro,
            pktinfo,
            timestamps,
            closed: AtomicBool::new(false),
        })
    }

    pub fn local_port(&self) -> io::Result<u16> {
        let addr = self.socket.local_addr()?;
        addr.as_socket()
            .map(|a| a.port())
            .ok_or_else(|| io::Error::other("socket has no inet address"))
    }

    /// Whether received messages carry their arrival time (the AQM's input).
    pub fn has_receive_timestamps(&self) -> bool {
        self.timestamps
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

    /// Sends one datagram (timers, off the hot path) from `to.local` if set. `Ok(true)`: that
    /// source address is gone from this host; the datagram left from the kernel's choice and
    /// the caller must forget the source.
    pub fn send_one(&self, data: &[u8], to: PeerPath) -> io::Result<bool> {
        let name = self.native(to.remote);
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut control: CmsgBuf = [0; 16];
        let mut local = to.local.filter(|_| self.pktinfo);
        loop {
            // SAFETY: msghdr is plain data; every pointer below outlives the call.
            let mut h: libc::msghdr = unsafe { zeroed() };
            h.msg_name = name.as_ptr() as *mut libc::c_void;
            h.msg_namelen = name.len();
            h.msg_iov = &mut iov;
            h.msg_iovlen = 1;
            if let Some(src) = local {
                h.msg_control = control.as_mut_ptr().cast();
                h.msg_controllen = size_of::<CmsgBuf>();
                // SAFETY: the buffer has room for one pktinfo message.
                h.msg_controllen = unsafe { write_pktinfo(&h, libc::CMSG_FIRSTHDR(&h), src) };
            }
            // SAFETY: a valid fd and the message built above.
            let r = unsafe { libc::sendmsg(self.socket.as_raw_fd(), &h, 0) };
            if r >= 0 {
                return Ok(to.local.is_some() && local.is_none());
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(e) if local.is_some() && source_is_stale(e) => local = None,
                _ => return Err(err),
            }
        }
    }

    /// Receives up to [`BATCH`] messages; returns how many. Blocks until at least one arrives
    /// (or the receive timeout passes: `WouldBlock`); 0 means the socket was shut down. Use
    /// [`RecvBatch::datagrams`] to walk what arrived.
    pub fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        for i in 0..BATCH {
            batch.msgs.iov[i] = libc::iovec {
                iov_base: batch.buf_mut(i).as_mut_ptr().cast(),
                iov_len: RECV_BUFFER,
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
                    BATCH as u32,
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
                    let (gro, local, arrived) = parse_cmsgs(&batch.msgs.hdrs[i].msg_hdr);
                    batch.from[i] = PeerPath {
                        remote: storage_to_addr(&batch.msgs.names[i]),
                        local,
                    };
                    batch.arrived[i] = arrived;
                    batch.segment[i] = gro.unwrap_or(batch.lens[i]).max(1);
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
                // The source address this peer last used is gone: forget it for every datagram
                // still queued and resend them from the kernel's choice.
                Some(e)
                    if source_is_stale(e) && batch.to[batch.msg_first[start]].local.is_some() =>
                {
                    let first = batch.msg_first[start];
                    let gone = batch.to[first].local;
                    for to in &mut batch.to[first..batch.count] {
                        if to.local == gone {
                            to.local = None;
                        }
                    }
                    batch.stale_source = gone;
                    batch.drop_before(first);
                    return dropped + self.send_batch(batch);
                }
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

/// From the control messages the kernel attached to a received message: the segment size of
/// a GRO-coalesced message (UDP_GRO), the local address the datagram was sent to
/// (IP_PKTINFO / IPV6_PKTINFO; a link-local one is not kept, it would need its interface), and
/// when the kernel received it (SCM_TIMESTAMPNS: wall-clock time since the Unix epoch).
fn parse_cmsgs(h: &libc::msghdr) -> (Option<usize>, Option<IpAddr>, Option<Duration>) {
    let (mut gro, mut local, mut arrived) = (None, None, None);
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, within msg_controllen;
    // each payload is read unaligned with the type its level and type say it has.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::SOL_UDP, UDP_GRO) => {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                    gro = usize::try_from(v).ok().filter(|v| *v > 0);
                }
                (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                    let p = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>());
                    local = Some(IpAddr::from(u32::from_be(p.ipi_addr.s_addr).to_be_bytes()));
                }
                (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                    let p =
                        std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in6_pktinfo>());
                    let ip = Ipv6Addr::from(p.ipi6_addr.s6_addr);
                    local = Some(match ip.to_ipv4_mapped() {
                        Some(v4) => IpAddr::V4(v4),
                        None => IpAddr::V6(ip),
                    });
                }
                (libc::SOL_SOCKET, libc::SCM_TIMESTAMPNS) => {
                    let t = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::timespec>());
                    arrived = u64::try_from(t.tv_sec)
                        .ok()
                        .zip(u32::try_from(t.tv_nsec).ok())
                        .map(|(secs, nanos)| Duration::new(secs, nanos));
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    let link_local = |ip: &IpAddr| match ip {
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
        IpAddr::V4(v4) => v4.is_unspecified(),
    };
    (gro, local.filter(|ip| !link_local(ip)), arrived)
}

/// Writes a pktinfo control message naming `src` as the source at `c` (inside `h`'s control
/// buffer, which must have room for it); returns the control length used up to its end.
///
/// # Safety
/// `c` must point into `h.msg_control` with `CMSG_SPACE(in6_pktinfo)` bytes left.
unsafe fn write_pktinfo(h: &libc::msghdr, c: *mut libc::cmsghdr, src: IpAddr) -> usize {
    let used = (c as usize) - (h.msg_control as usize);
    match src {
        IpAddr::V4(v4) => {
            let len = size_of::<libc::in_pktinfo>() as u32;
            (*c).cmsg_level = libc::IPPROTO_IP;
            (*c).cmsg_type = libc::IP_PKTINFO;
            (*c).cmsg_len = libc::CMSG_LEN(len) as usize;
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.octets()),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>(), info);
            used + libc::CMSG_SPACE(len) as usize
        }
        IpAddr::V6(v6) => {
            let len = size_of::<libc::in6_pktinfo>() as u32;
            (*c).cmsg_level = libc::IPPROTO_IPV6;
            (*c).cmsg_type = libc::IPV6_PKTINFO;
            (*c).cmsg_len = libc::CMSG_LEN(len) as usize;
            let info = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: v6.octets(),
                },
                ipi6_ifindex: 0,
            };
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::in6_pktinfo>(), info);
            used + libc::CMSG_SPACE(len) as usize
        }
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
            cmsgs: vec![[0; 16]; BATCH],
            // SAFETY: plain data, zero is valid.
            hdrs: (0..BATCH).map(|_| unsafe { zeroed() }).collect(),
        }
    }
}

/// Buffers for one `recvmmsg`, allocated once per receiving thread.
pub struct RecvBatch {
    /// [`BATCH`] receive buffers of [`RECV_BUFFER`] bytes, back to back in one allocation: the
    /// allocator maps it fresh and the kernel backs only the pages traffic touches. As 64
    /// separate 64 KB buffers (each below malloc's mmap threshold, so carved from the thread's
    /// arena) about 0.75 MB per receiving thread was resident on an idle tunnel: 1.5 MB of the
    /// daemon's idle RSS with two workers (10.9 -> 9.2 MiB, measured).
    bufs: Vec<u8>,
    lens: Vec<usize>,
    from: Vec<PeerPath>,
    segment: Vec<usize>,
    /// When the kernel received each message (since the Unix epoch), where it says.
    arrived: Vec<Option<Duration>>,
    count: usize,
    msgs: MmsgScratch,
}

// SAFETY: the raw pointers inside are scratch space rewritten before each call.
unsafe impl Send for RecvBatch {}

impl Default for RecvBatch {
    fn default() -> Self {
        RecvBatch {
            bufs: vec![0u8; BATCH * RECV_BUFFER],
            lens: vec![0; BATCH],
            from: vec![PeerPath::to(SocketAddr::from(([0, 0, 0, 0], 0))); BATCH],
            segment: vec![1; BATCH],
            arrived: vec![None; BATCH],
            count: 0,
            msgs: MmsgScratch::new(),
        }
    }
}

impl RecvBatch {
    fn buf(&self, i: usize) -> &[u8] {
        &self.bufs[i * RECV_BUFFER..(i + 1) * RECV_BUFFER]
    }

    fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.bufs[i * RECV_BUFFER..(i + 1) * RECV_BUFFER]
    }

    /// How many datagrams the batch holds, coalesced ones counted one by one (no copying).
    pub fn datagram_count(&self) -> usize {
        (0..self.count)
            .map(|i| self.lens[i].div_ceil(self.segment[i]))
            .sum()
    }

    /// How long the oldest message of the batch waited in the socket buffer before `now` (the
    /// wall clock, as the kernel's receive timestamps are); `None` without timestamps. A
    /// timestamp in the future (the wall clock stepped back) counts as no wait.
    pub fn oldest_wait(&self, now: SystemTime) -> Option<Duration> {
        let now = now.duration_since(SystemTime::UNIX_EPOCH).ok()?;
        let oldest = self.arrived[..self.count].iter().flatten().min()?;
        Some(now.saturating_sub(*oldest))
    }

    /// Every datagram received, with where it came from and the local address it was sent to;
    /// coalesced messages split at their segment size.
    pub fn datagrams(&self) -> impl Iterator<Item = (PeerPath, &[u8])> + '_ {
        (0..self.count).flat_map(move |i| {
            self.buf(i)[..self.lens[i]]
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
    to: Vec<PeerPath>,
    count: usize,
    msgs: MmsgScratch,
    /// A source address the kernel refused (removed from this host) during the last send;
    /// see [`SendBatch::take_stale_source`].
    stale_source: Option<IpAddr>,
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
            to: vec![PeerPath::to(SocketAddr::from(([0, 0, 0, 0], 0))); BATCH],
            count: 0,
            msgs: MmsgScratch::new(),
            stale_source: None,
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

    /// A source address that turned out to be gone while sending: the datagrams left from
    /// the kernel's choice instead, and peers that remember it must forget it.
    pub fn take_stale_source(&mut self) -> Option<IpAddr> {
        self.stale_source.take()
    }

    pub fn push(&mut self, len: usize, to: PeerPath) {
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
            let name = socket.native(self.to[i].remote);
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
            let local = self.to[i].local.filter(|_| socket.pktinfo);
            if j - i > 1 || local.is_some() {
                h.msg_control = self.msgs.cmsgs[msgs].as_mut_ptr().cast();
                h.msg_controllen = size_of::<CmsgBuf>();
                let mut used = 0;
                // SAFETY: CMSG_SPACE/LEN are pure arithmetic; the 128-byte buffer holds a
                // UDP_SEGMENT message (24 bytes) and a pktinfo (at most 40). The second header
                // is placed by hand: CMSG_NXTHDR would read the stale length left there by an
                // earlier batch.
                unsafe {
                    let mut c = libc::CMSG_FIRSTHDR(h);
                    if j - i > 1 {
                        (*c).cmsg_level = libc::SOL_UDP;
                        (*c).cmsg_type = UDP_SEGMENT;
                        (*c).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as usize;
                        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size as u16);
                        used = libc::CMSG_SPACE(size_of::<u16>() as u32) as usize;
                        c = c.cast::<u8>().add(used).cast::<libc::cmsghdr>();
                    }
                    if let Some(src) = local {
                        used = write_pktinfo(h, c, src);
                    }
                }
                h.msg_controllen = used;
            }
            self.msg_segments[msgs] = j - i;
            self.msg_first[msgs] = i;
            msgs += 1;
            i = j;
        }
        msgs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shell::clock;

    /// The AQM's input: how long the oldest datagram of a batch sat in the socket buffer, from
    /// the kernel's receive timestamps.
    #[test]
    fn a_batch_knows_how_long_its_oldest_datagram_waited() {
        let options = crate::shell::tuning::Tuning::default().socket_options();
        let socket = WgSocket::bind(0, None, &options).expect("bind");
        assert!(
            socket.has_receive_timestamps(),
            "AQM is on by default, so the socket asks for receive timestamps"
        );
        let port = socket.local_port().expect("port");
        // The kernel turns receive timestamping on from a work item, moments after the first
        // socket asks; until then packets are stamped when read, not when they arrive.
        std::thread::sleep(Duration::from_millis(100));
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        sender
            .send_to(&[4u8; 600], ("127.0.0.1", port))
            .expect("send");
        std::thread::sleep(Duration::from_millis(40));
        sender
            .send_to(&[4u8; 600], ("127.0.0.1", port))
            .expect("send");
        let mut batch = RecvBatch::default();
        // Both are queued; MSG_WAITFORONE takes them in one call on a loopback that delivered
        // them synchronously.
        socket.recv_batch(&mut batch).expect("receive");
        assert_eq!(batch.datagrams().count(), 2, "both datagrams in one batch");
        assert_eq!(batch.datagram_count(), 2);
        let waited = batch.oldest_wait(clock::wall_now()).expect("timestamps");
        assert!(
            waited >= Duration::from_millis(40) && waited < Duration::from_secs(10),
            "the first datagram waited {waited:?}"
        );
        // A wall clock stepped back behind the arrival counts as no wait, not as a huge one.
        let before = SystemTime::UNIX_EPOCH + Duration::from_secs(1);
        assert_eq!(batch.oldest_wait(before), Some(Duration::ZERO));
    }
}
