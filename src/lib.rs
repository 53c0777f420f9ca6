//! tunnelgate: a node-level WireGuard data-plane proxy.
//!
//! # Layout
//! - [`config`]: the validated configuration (pure).
//! - [`rules`]: the firewall rule model and its nftables / iptables renderers (pure).
//! - [`core`]: pure decisions: the boringtun wrapper, allowed-IP routing, desired routes.
//! - [`shell`]: I/O: TUN, UDP, packet loops, netlink, firewall commands, the local servers
//!   (`shell::serve`: UAPI, status, health, one accept loop) and the process that assembles
//!   them (`shell::process`, used by both modes of the binary).
//! - [`uapi`]: the WireGuard cross-platform userspace API (`wg show` / `wg set`).
//! - [`telemetry`]: what the health endpoint and `tunnelgate status` show, as pure values and
//!   text (Prometheus metrics, the status protocol).
//! - [`clock`]: the only reader of the system clocks (`clippy.toml` disallows them elsewhere).
//! - [`cli`]: exit statuses for command-line parse failures, shared by both binaries.
//! - [`sidecar`]: the Kubernetes sidecar: Service + base config -> the config Secret (pure), and
//!   its kube I/O (`tunnelgate-sidecar` only, built with `--features sidecar`; the daemon
//!   never calls it and its default build compiles no Kubernetes crate).
#![deny(unsafe_code)]

pub mod cli;
pub mod clock;
pub mod config;
pub mod core;
#[doc(hidden)]
pub mod fuzzing;
pub mod rules;
pub mod shell;
#[cfg(feature = "sidecar")]
pub mod sidecar;
pub mod telemetry;
#[cfg(test)]
mod test_util;
pub mod uapi;
