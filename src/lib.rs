//! tunnelgate: a node-level WireGuard data-plane proxy.
//!
//! # Layout
//! - [`config`]: the validated configuration (pure).
#![forbid(unsafe_code)]

pub mod config;
