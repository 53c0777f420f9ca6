//! I/O around the pure core: TUN device, UDP socket, packet loops, netlink, firewall commands.

pub mod clock;
pub mod config_file;
pub mod daemon;
pub mod dataplane;
pub mod executor;
pub mod firewall;
pub mod forwarding;
pub mod health;
pub mod import;
pub mod logging;
pub mod netlink;
pub mod observe;
pub mod privilege;
pub mod resolver;
pub mod seccomp;
pub mod tun;
pub mod udp;
pub mod userspace;
