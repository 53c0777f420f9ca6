//! Pure decisions: WireGuard session wrapper, cryptokey routing, desired routes.

pub mod allowed_ips;
pub mod backoff;
pub mod dns;
pub mod liveness;
pub mod offload;
pub mod packet;
pub mod plan;
pub mod routes;
pub mod wg;
