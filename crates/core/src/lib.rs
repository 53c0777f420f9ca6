//! tunnelgate's pure core: every decision the daemon makes, with no I/O. The configuration
//! model and its validation ([`config`]), the firewall rule model and its nftables / iptables
//! renderers ([`rules`]), the WireGuard cross-platform userspace API protocol ([`uapi`]), and
//! the control core with its helpers: the WireGuard session wrapper, cryptokey routing, desired
//! routes, the DNS schedule, offload split/coalesce, shared ownership of the forwarding sysctls.
//!
//! A crate of its own so that its purity is held by the compiler, not by convention: its
//! `Cargo.toml` names no tokio, no process and no filesystem crate, and `clippy.toml` bans the
//! clocks (`Instant::now`, `elapsed`, tokio's clock). Time is an argument (`now`). (boringtun,
//! which [`wg`] wraps, reads the clock for its own handshake timers; the wrapper does not.)
//! `libc` is here for constants only (errno and syscall numbers); `tests/architecture.rs`
//! checks that no module calls it.
#![deny(unsafe_code)]

pub mod allowed_ips;
pub mod aqm;
pub mod backoff;
pub mod cbpf;
pub mod cgroup;
pub mod check_report;
pub mod config;
pub mod control;
pub mod cost;
pub mod dns;
pub mod endpoints_file;
pub mod forwarding;
pub mod group_exchange;
pub mod handshake;
pub mod knobs;
pub mod liveness;
pub mod offload;
pub mod packet;
pub mod peer;
pub mod pmap;
pub mod priority;
pub mod relay;
pub mod routes;
pub mod rules;
pub mod seccomp;
pub mod session_index;
pub mod socket_handover;
pub mod takeover;
#[cfg(test)]
mod test_util;
pub mod uapi;
pub mod wg;
