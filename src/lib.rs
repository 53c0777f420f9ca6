//! tunnelgate: a node-level WireGuard data-plane proxy.
//!
//! # Layout
//! - [`config`]: the validated configuration (pure).
//! - [`telemetry`]: health endpoint, Prometheus metrics, `tunnelgate status`, logging.
//! - [`uapi`]: the WireGuard cross-platform userspace API (`wg show` / `wg set`).
#![forbid(unsafe_code)]

pub mod config;
pub mod telemetry;
pub mod uapi;
