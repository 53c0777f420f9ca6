//! Pure decisions: the control core, WireGuard session wrapper, cryptokey routing, desired
//! routes, DNS schedule, offload split/coalesce, shared ownership of the forwarding sysctls.
//! Nothing here does I/O or reads the clock: time is an argument. (boringtun, which `wg` wraps,
//! reads it for its own handshake timers; the wrapper does not.)

pub mod allowed_ips;
pub mod backoff;
pub mod check_report;
pub mod control;
pub mod dns;
pub mod forwarding;
pub mod liveness;
pub mod offload;
pub mod packet;
pub mod peer;
pub mod routes;
pub mod seccomp;
pub mod socket_handover;
pub mod wg;
