//! I/O around the pure core: TUN device, UDP socket, packet loops, netlink, firewall commands.

pub mod daemon;
pub mod datapath;
pub mod files;
pub mod netlink;
pub mod peers;
pub mod tun;
pub mod udp;
