//! The timer thread's part of a takeover (`core::takeover`): for each peer, under its lock,
//! the next step; then, with the lock let go, the initiation sent to the source the peer's
//! data came from (through the local address it arrived on), and a line at info for each
//! takeover started, completed or failed.

use super::table::PeerSlot;
use super::Inner;
use crate::core::packet::steering::Steering;
use crate::core::takeover::{TakeoverStep, TokenBucket, REKEY_TIMEOUT};
use crate::shell::udp::WgSocket;
use std::time::Instant;

/// Takes one step of `slot`'s takeover at `now` (`buf` holds the initiation).
pub(super) fn step(
    inner: &Inner,
    sockets: &[WgSocket],
    steering: &Steering,
    slot: &PeerSlot,
    now: Instant,
    global: &mut TokenBucket,
    buf: &mut [u8],
) {
    let (step, sent) = {
        let mut peer = slot.lock();
        peer.on_takeover(now, global, buf)
    };
    let name = slot.spec().name.as_deref().unwrap_or("");
    match step {
        TakeoverStep::Nothing => {}
        TakeoverStep::Initiate(to) => {
            tracing::info!(
                peer = %slot.public_key(),
                peer_name = name,
                source = %to.remote,
                "Takeover: the peer sends on a session this process does not have; initiating a handshake to its source"
            );
            let Some(len) = sent else { return };
            let socket = &sockets[steering.worker_of_peer(slot.index()) % sockets.len()];
            super::workers::send_one(inner, socket, &buf[..len], to);
        }
        TakeoverStep::Completed { to, after } => tracing::info!(
            peer = %slot.public_key(),
            peer_name = name,
            source = %to.remote,
            ms = after.as_millis() as u64,
            "Takeover completed: the peer moved to a new session"
        ),
        TakeoverStep::Failed(to) => tracing::info!(
            peer = %slot.public_key(),
            peer_name = name,
            source = %to.remote,
            wait_s = REKEY_TIMEOUT.as_secs(),
            "Takeover failed: no handshake followed the initiation. Likely: the peer accepted a \
             newer handshake from this key (another replica's clock is ahead of this one: \
             replicas need synchronised clocks), or the datagram's source was spoofed"
        ),
    }
}
