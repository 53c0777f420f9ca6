//! The shared network-namespace test harness: namespaces, veth pairs, wireguard-go and tunnelgate peers, and traffic helpers.
//!
//! Every netns suite does `mod common;` and marks its tests `#[ignore = "needs root"]`; CI runs them
//! with `cargo test -- --ignored --test-threads=1`.
//!
//! Rules the harness keeps so suites cannot collide (with each other, or with a second test binary
//! running at the same time):
//! - every namespace and interface name is `<kind><pid>x<counter>` (≤ 15 characters): the UAPI socket
//!   folder `/var/run/wireguard/` is shared by every namespace;
//! - every guard cleans up on drop, also while a test panics: [`Netns`] kills whatever still runs inside
//!   it and deletes itself, [`Proc`] kills its process, [`WgGo`] and [`Tunnelgate`] stop their daemon and
//!   remove a socket it left behind, [`TempDir`] removes itself (kept when the test panics, for
//!   diagnostics);
//! - leftovers of an earlier run that was killed (its pid is gone) are swept before the first namespace
//!   is created.
//!
//! Code that must run *inside* a namespace (a TCP listener, an HTTP GET of `/readyz`, a UDP echo server)
//! runs in a thread of the test process that entered the namespace with `setns(2)`: see
//! [`Netns::in_ns`] and [`Netns::thread`]. No python, curl or ncat is needed.
#![allow(dead_code)]
// Each suite includes this file as its own private `mod common;`: `pub` is the harness API, not
// an export of the test crate.
#![allow(unreachable_pub)]

mod capture;
mod daemon;
mod dns;
mod firewall;
mod middlebox;
mod names;
mod netns;
mod notify;
mod pings;
mod process;
mod run_dir;
mod skip;
mod status;
mod traffic;
mod wg;

// A suite uses what it needs: the rest of the index is unused there.
#[allow(unused_imports)]
pub use self::{
    capture::*, daemon::*, dns::*, firewall::*, middlebox::*, names::*, netns::*, notify::*,
    pings::*, process::*, run_dir::*, skip::*, status::*, traffic::*, wg::*,
};
