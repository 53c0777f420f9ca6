//! tunnelgate: a node-level WireGuard data-plane proxy.
//!
//! # Layout
//! The pure core is its own crate, `tunnelgate-core` (`crates/core`), re-exported here:
//! - [`config`]: the validated configuration.
//! - [`rules`]: the firewall rule model and its nftables / iptables renderers.
//! - [`uapi`]: the WireGuard cross-platform userspace API protocol (`wg show` / `wg set`).
//! - [`core`]: the control core and its pure helpers: the boringtun wrapper, allowed-IP
//!   routing, desired routes, the DNS schedule, offload split/coalesce.
//!
//! This crate adds:
//! - [`shell`]: all of the daemon's I/O: TUN, UDP, packet loops, netlink, firewall commands,
//!   the clock, logging, the local servers (`shell::serve`: UAPI, status, health, one accept
//!   loop) and the process that assembles them (`shell::process`, used by both modes).
//! - [`telemetry`]: what the health endpoint and `tunnelgate status` show, as pure values and
//!   text (Prometheus metrics, the status protocol).
//! - [`cli`]: exit statuses for command-line parse failures, shared by both binaries.
//! - [`sidecar`]: the Kubernetes sidecar: Service + base config -> the config Secret (pure), and
//!   its kube I/O in `sidecar::shell` (`tunnelgate-sidecar` only, built with `--features
//!   sidecar`; the daemon never calls it and its default build compiles no Kubernetes crate).
//!
//! `tests/architecture.rs` holds the line: no module outside a `shell` or `bin` folder names
//! tokio, files, processes, sockets or the environment.
#![deny(unsafe_code)]

pub mod cli;
/// The pure core (its own crate, `crates/core`): the control core and its helpers at its root.
pub use tunnelgate_core as core;
pub use tunnelgate_core::config;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub use tunnelgate_core::rules;
pub mod shell;
#[cfg(feature = "sidecar")]
pub mod sidecar;
pub mod telemetry;
#[cfg(test)]
mod test_util;
pub use tunnelgate_core::uapi;
