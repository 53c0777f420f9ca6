//! Reading the wire as anyone on a path may: the first IPv4 UDP datagram crossing a namespace
//! that matches a filter ([`capture_udp`]), through a packet socket (`AF_PACKET`) in a thread of
//! the test process that entered the namespace.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use super::*;
use tunnelgate::shell::clock;

/// One UDP datagram seen on the wire: its source, destination and payload.
#[derive(Debug, Clone)]
pub struct Seen {
    pub from: SocketAddrV4,
    pub to: SocketAddrV4,
    pub payload: Vec<u8>,
}

/// The first IPv4 UDP datagram crossing `ns` within `within` for which `wanted` is true.
/// Panics when none came.
pub fn capture_udp(
    ns: &Netns,
    within: Duration,
    wanted: impl Fn(&Seen) -> bool + Send + Sync,
) -> Seen {
    use nix::sys::socket::{
        recv, setsockopt, socket, sockopt, AddressFamily, MsgFlags, SockFlag, SockProtocol,
        SockType,
    };
    ns.in_ns(|| {
        let fd = socket(
            AddressFamily::Packet,
            SockType::Datagram,
            SockFlag::empty(),
            SockProtocol::EthAll,
        )
        .expect("a packet socket (root)");
        setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(0, 200_000),
        )
        .expect("timeout");
        let deadline = clock::now() + within;
        let mut buf = [0u8; 2048];
        while clock::now() < deadline {
            let Ok(n) = recv(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                &mut buf,
                MsgFlags::empty(),
            ) else {
                continue;
            };
            let ip = &buf[..n];
            if ip.len() < 28 || ip[0] >> 4 != 4 || ip[9] != 17 {
                continue;
            }
            let header = usize::from(ip[0] & 0x0f) * 4;
            let Some(udp) = ip.get(header..).filter(|u| u.len() >= 8) else {
                continue;
            };
            let seen = Seen {
                from: SocketAddrV4::new(
                    Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
                    u16::from_be_bytes([udp[0], udp[1]]),
                ),
                to: SocketAddrV4::new(
                    Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
                    u16::from_be_bytes([udp[2], udp[3]]),
                ),
                payload: udp[8..].to_vec(),
            };
            if wanted(&seen) {
                return seen;
            }
        }
        panic!("no matching UDP datagram crossed the namespace within {within:?}");
    })
}
