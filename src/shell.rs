//! I/O around the pure core: TUN device, UDP socket, packet loops, netlink, firewall commands,
//! the local servers ([`serve`]), systemd's notifications ([`systemd`]) and the process that
//! assembles them ([`process`], the composition root: the only caller of [`systemd`]).

pub mod cgroup;
pub mod clock;
pub mod config_file;
pub mod daemon;
pub mod dataplane;
pub mod endpoints;
pub mod executor;
pub mod fatal;
pub mod firewall;
pub mod forwarding;
pub mod group;
pub mod import;
pub mod keys;
pub mod logging;
pub mod netlink;
pub mod observe;
pub mod pi_lock;
pub mod priority;
pub mod privilege;
pub mod process;
pub mod procfs;
pub mod resolver;
pub mod seccomp;
pub mod serve;
pub mod status_client;
pub mod systemd;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
pub mod tun;
pub mod tuning;
pub mod udp;
pub mod userspace;
