//! The local servers: UAPI ([`uapi`]), the status socket ([`status`]) and the health endpoint
//! ([`health`]), each a handler of the one accept loop and connection policy of [`accept`], and
//! the claiming of their Unix socket paths ([`local_socket`]). Their limits are one table,
//! [`policy`].

pub mod accept;
pub mod health;
pub mod local_socket;
pub mod policy;
pub mod status;
pub mod uapi;
