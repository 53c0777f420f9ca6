//! The local servers: UAPI ([`uapi`]), the status socket ([`status`]) and the health endpoint
//! ([`health`]), and the claiming of their Unix socket paths ([`local_socket`]).

pub mod health;
pub mod local_socket;
pub mod status;
pub mod uapi;
