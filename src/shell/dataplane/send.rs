//! Single datagrams the handshake thread sends (a timer's message, a handshake reply, a
//! takeover's initiation), and what a send that names a source address gone from this host
//! does to every peer: a leaf the packet loops, the handshake path and takeover all call.

use super::Inner;
use crate::core::packet::{DropReason, PeerPath};
use crate::shell::udp::WgSocket;
use std::net::IpAddr;

/// Sends `bytes` to `to` on `socket`; a source address gone from this host is forgotten by
/// every peer, a failure counted.
pub(super) fn send_one(inner: &Inner, socket: &WgSocket, bytes: &[u8], to: PeerPath) {
    match socket.send_one(bytes, to) {
        Ok(false) => {}
        Ok(true) => forget_source(inner, to.local.unwrap_or(to.remote.ip())),
        Err(e) => {
            inner.drops.add(DropReason::UdpSend, 1);
            tracing::debug!(error = %e, "send from the timer thread failed");
        }
    }
}

/// A local address peers replied from is gone: they fall back to the kernel's choice of
/// source until they send to another address of ours (rare: a walk over the table).
pub(super) fn forget_source(inner: &Inner, gone: IpAddr) {
    tracing::info!(address = %gone, "Local address gone; replying from the kernel's choice");
    for slot in inner.snapshot().peers() {
        slot.lock().forget_source(gone);
    }
}
