//! Issue 2, end to end in network namespaces: tunnelgate against a real wireguard-go peer
//! (configured with `wg`) and against itself; `wg show/showconf/set` on its UAPI socket; peers
//! that must be refused (unknown key, spoofed inner source); roaming; a clean SIGTERM (also on
//! the fwmark/policy-rule path of a default route); garbage UDP and malformed UAPI requests; and
//! starts that fail without leaving anything behind.
//!
//! Run as root: `cargo test --test netns_tunnel -- --ignored --test-threads=1`.

#[path = "../common/mod.rs"]
mod common;

use base64::Engine as _;
use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::unix::net::UnixStream;
use std::time::Duration;
use tunnelgate::shell::clock;

const MB: u64 = 1024 * 1024;

/// The underlay (veth) addresses of the two main namespaces.
const A_LAN4: &str = "192.168.50.1";
const B_LAN4: &str = "192.168.50.2";
const A_LAN6: &str = "fd50::1";
const B_LAN6: &str = "fd50::2";

/// Tunnel addresses: tunnelgate (`a`), its wireguard-go peer (`b`), a third peer (`c`).
const A_TUN4: &str = "100.64.0.1";
const A_TUN6: &str = "fd7a::1";
const B_TUN4: &str = "100.64.0.2";
const B_TUN6: &str = "fd7a::2";
const C_TUN4: &str = "100.64.0.3";

/// The listen ports used in these tests.
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;

const SHORT: Duration = Duration::from_secs(10);

mod cleanup;
mod garbage;
mod peers;
mod refused;
mod setup;
mod wg_tools;

use setup::*;
