//! The WireGuard cross-platform userspace API: the pure protocol is the core's
//! ([`tunnelgate_core::uapi`], re-exported here), the socket server is [`server`].

pub use tunnelgate_core::uapi::*;
pub mod server;
