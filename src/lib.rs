//! tunnelgate: a node-level WireGuard data-plane proxy.
//!
//! # Layout
//! - [`config`]: the validated configuration (pure).
//! - [`rules`]: the firewall rule model and its nftables / iptables renderers (pure).
//! - [`core`]: pure decisions: the boringtun wrapper, allowed-IP routing, desired routes.
//! - [`shell`]: I/O: TUN, UDP, packet loops, netlink, firewall commands.
//! - [`uapi`]: the WireGuard cross-platform userspace API (`wg show` / `wg set`).
//! - [`telemetry`]: health endpoint, Prometheus metrics, `tunnelgate status`, logging.
//! - [`local_socket`]: claiming the path of a local Unix-socket server (I/O), shared by the UAPI
//!   server and the status socket.
//! - [`cli`]: exit statuses for command-line parse failures, shared by both binaries.
//! - [`sidecar`]: the Kubernetes sidecar: Service + base config -> the config Secret (pure), and
//!   its kube I/O (`tunnelgate-sidecar` only, built with `--features sidecar`; the daemon
//!   never calls it and its default build compiles no Kubernetes crate).
#![deny(unsafe_code)]

pub mod cli;
/// The pure core (its own crate, `crates/core`): the control core and its helpers at its root.
pub use tunnelgate_core as core;
pub use tunnelgate_core::config;
#[doc(hidden)]
pub mod fuzzing;
pub mod local_socket;
pub use tunnelgate_core::rules;
pub mod shell;
#[cfg(feature = "sidecar")]
pub mod sidecar;
pub mod telemetry;
#[cfg(test)]
mod test_util;
pub mod uapi;
