//! Pure decisions: WireGuard session wrapper, cryptokey routing, desired routes.

pub mod allowed_ips;
pub mod backoff;
pub mod dns;
pub mod offload;
pub mod plan;
pub mod routes;
pub mod wg;
