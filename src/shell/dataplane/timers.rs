//! The timer thread (`tg-timers`): every peer's handshake, rekey and keepalive timers each
//! [`TIMER_TICK`], the handshake path ([`super::handshakes`]) and takeovers
//! ([`super::takeover`]); and the further handshake threads (`tg-hs-N`, one per worker after
//! the first), which share the handshake path's queue and the takeovers with it. The readers
//! wake them when they queue a handshake message or hand over a takeover; each works a round
//! at a time. Their sends leave after every peer lock is let go ([`super::send`]).

use super::handshakes::HandshakeWork;
use super::send::send_one;
use super::table::PeerSlot;
use super::takeover::TakeoverWork;
use super::Inner;
use crate::config::PublicKey;
use crate::core::liveness::PacketThread;
use crate::core::peer::LimiterReset;
use crate::core::wg;
use crate::shell::clock;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How often WireGuard's handshake, rekey and keepalive timers are driven (boringtun expects
/// about every 100 ms; its own device uses 250 ms).
const TIMER_TICK: Duration = Duration::from_millis(100);

/// How often the timer also looks at every peer, for one that woke unseen: a backstop, not the
/// way peers come on its list (that is [`crate::core::peer::Peer::woke`], where they wake).
/// At 100,000 peers a look at each costs the timer tens of milliseconds.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The peers the timer ticks: the ones that woke (a packet, a handshake, a takeover) and the
/// ones a peer update named, until a tick finds they need nothing. Idle peers are not on it,
/// so a tick costs the peers that talk, not every configured one.
#[derive(Default)]
struct TimerList {
    keys: Vec<PublicKey>,
    on: HashSet<PublicKey>,
}

impl TimerList {
    fn add(&mut self, key: PublicKey) {
        if self.on.insert(key) {
            self.keys.push(key);
        }
    }

    fn remove_at(&mut self, i: usize) {
        let key = self.keys.swap_remove(i);
        self.on.remove(&key);
    }

    /// Gives back the room a burst left: a start or a sync of 100,000 peers puts them all on
    /// the list for one tick, and the list and its set would hold 8 MB of room from then on.
    fn shrink(&mut self) {
        if self.keys.capacity() > 1024 && self.keys.len() < self.keys.capacity() / 4 {
            self.keys.shrink_to(self.keys.len() * 2);
            self.on.shrink_to(self.keys.len() * 2);
        }
    }
}

/// The timer thread's loop, until the data plane stops.
pub(super) fn timer_loop(inner: &Inner) {
    let mut buf = vec![0u8; wg::MIN_OUTPUT.max(2048)];
    super::workers::confine(&PacketThread::Timers.name());
    let mut limiter_reset = LimiterReset::default();
    let mut handshakes = HandshakeWork::new();
    let mut takeovers = TakeoverWork::new(inner.queues.len());
    let mut next_tick = clock::now();
    let mut list = TimerList::default();
    let mut next_sweep = next_tick + SWEEP_EVERY;
    let mut more = false;
    while !inner.stop.load(Ordering::Relaxed) {
        inner.beat(PacketThread::Timers);
        if !more {
            // Parked, not asleep: `Dataplane::stop`, a reader that queued a handshake and a
            // reader that hands over a takeover unpark it.
            std::thread::park_timeout(next_tick.saturating_duration_since(clock::now()));
        }
        let now = clock::now();
        let table = inner.snapshot();
        more = handshakes.round(inner, &table, true, now);
        // Answering a peer's own handshake first: under load, takeovers wait.
        more |= takeovers.round(inner, &table, inner.handshakes.under_load(), now);
        if now < next_tick {
            continue;
        }
        next_tick = now + TIMER_TICK;
        if limiter_reset.due(now) {
            table.limiter().reset_count();
        }
        if table.private_key().is_none() {
            continue; // no key: no handshakes, no keepalives
        }
        let news = std::mem::take(&mut *inner.woke.lock());
        for key in news {
            list.add(key);
        }
        if now >= next_sweep {
            next_sweep = now + SWEEP_EVERY;
            for slot in table.peers() {
                let woke = slot.lock().woke();
                if woke {
                    list.add(*slot.public_key());
                }
            }
        }
        let sockets = inner.sockets();
        let steering = inner.steering();
        let mut i = 0;
        while i < list.keys.len() {
            let Some(slot) = table.slot(&list.keys[i]) else {
                list.remove_at(i); // removed from the table
                continue;
            };
            let tick = {
                let mut peer = slot.lock();
                peer.wants_ticks().then(|| peer.on_tick(now, &mut buf))
            };
            let Some(tick) = tick else {
                list.remove_at(i);
                continue;
            };
            i += 1;
            if tick.handshake_completed {
                log_handshake(slot);
            }
            let Some((len, to)) = tick.send else { continue };
            let socket = &sockets[steering.worker_of_peer(slot.index()) % sockets.len()];
            send_one(inner, socket, &buf[..len], to);
        }
        list.shrink();
    }
}

fn log_handshake(slot: &PeerSlot) {
    let endpoint = slot.lock().path();
    let endpoint = endpoint.map_or_else(|| "none".into(), |p| p.remote.to_string());
    let name = slot.spec().name.as_deref().unwrap_or("");
    tracing::info!(peer = %slot.public_key(), peer_name = name, %endpoint, "Handshake completed");
}

/// A further handshake thread (`tg-hs-N`, one per worker after the first): the handshake
/// path's queue and takeovers, beside the timer thread, so they use every CPU. The timer thread
/// alone decides whether the interface is under load; this one reads it.
pub(super) fn handshake_loop(inner: &Inner, me: usize) {
    let thread = PacketThread::Handshakes(me);
    super::workers::confine(&thread.name());
    let mut handshakes = HandshakeWork::new();
    let mut takeovers = TakeoverWork::new(inner.queues.len());
    let mut more = false;
    while !inner.stop.load(Ordering::Relaxed) {
        inner.beat(thread);
        if !more {
            // Parked until a reader queues a handshake or hands over a takeover, or a stop;
            // an idle wake keeps the heartbeat.
            std::thread::park_timeout(crate::core::liveness::IDLE_WAKE);
        }
        let now = clock::now();
        let table = inner.snapshot();
        more = handshakes.round(inner, &table, false, now);
        more |= takeovers.round(inner, &table, inner.handshakes.under_load(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a burst (every peer of a start on the list for one tick) the list keeps room for
    /// what it holds, not for the burst.
    #[test]
    fn the_timer_list_gives_back_a_bursts_room() {
        let mut list = TimerList::default();
        for i in 0..100_000u32 {
            let mut key = [0u8; 32];
            key[..4].copy_from_slice(&i.to_be_bytes());
            list.add(PublicKey(key));
        }
        while list.keys.len() > 10 {
            list.remove_at(0);
        }
        list.shrink();
        assert_eq!(list.keys.len(), 10);
        assert!(list.keys.capacity() <= 64, "{}", list.keys.capacity());
        assert!(list.on.capacity() <= 64, "{}", list.on.capacity());
        assert!(list.keys.iter().all(|k| list.on.contains(k)));
    }
}
