//! The one accept loop of the local servers (UAPI, status, health), over a Unix or a TCP
//! listener, with one connection [`Policy`]:
//! - at most [`Policy::max_connections`] open; a newcomer at the cap closes the connections
//!   idle longest ([`pick_eviction`]; a few at once, so a flood of new connections is drained
//!   faster than it fills the backlog) and waits for a slot, so a real client (which sends its
//!   request at once and is then the most recently active) always gets in; a connection busy
//!   with a request ([`Conn::busy`]: a reload in progress, a `set` waiting for the event loop)
//!   is never evicted, and when every connection is busy the newcomer is closed instead;
//! - a connection that is not busy and shows no activity ([`Conn::touch`]) for
//!   [`Policy::idle_timeout`] is closed;
//! - at shutdown the listener is closed (and a Unix socket's file unlinked) and the shutdown
//!   future dropped before anything else, then open connections get [`Policy::drain_timeout`]
//!   ([`Conn::stopping`]) and are aborted.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::local_socket::ClaimedPath;

/// How often a listener that can be taken away ([`Listener::still_ours`]) is checked.
pub(crate) const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// How much a server gives its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Connections open at once (each holds one file descriptor).
    pub max_connections: usize,
    /// How long a connection that is not busy may show no activity before it is closed.
    pub idle_timeout: Duration,
    /// How long open connections get to finish once the server stops (zero: closed at once).
    pub drain_timeout: Duration,
}

impl Policy {
    /// How many of the longest idle connections one newcomer at the cap closes.
    pub fn eviction_batch(&self) -> usize {
        (self.max_connections / 16).max(1)
    }
}

/// What the accept loop listens on.
pub trait Listener: Send + 'static {
    type Stream: Send + 'static;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
    /// Whether the listener's address is still this server's (checked every two seconds; a
    /// Unix socket file deleted or replaced by someone else ends the loop).
    fn still_ours(&self) -> bool {
        true
    }
}

impl Listener for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept(&self) -> io::Result<Self::Stream> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// A claimed Unix socket being served: dropping it unlinks the file (while it is still ours)
/// and closes the listener.
pub struct LocalListener {
    // Declared first, dropped first: unlinked, then closed.
    file: ClaimedPath,
    listener: tokio::net::UnixListener,
    stop_when_removed: bool,
}

impl LocalListener {
    /// Serves `listener` (from [`super::local_socket::claim`]); with `stop_when_removed`, the
    /// loop ends when `file` is deleted or replaced. Must run on a tokio runtime.
    pub fn new(
        listener: std::os::unix::net::UnixListener,
        file: ClaimedPath,
        stop_when_removed: bool,
    ) -> io::Result<LocalListener> {
        Ok(LocalListener {
            listener: tokio::net::UnixListener::from_std(listener)?,
            file,
            stop_when_removed,
        })
    }
}

impl Listener for LocalListener {
    type Stream = tokio::net::UnixStream;
    async fn accept(&self) -> io::Result<Self::Stream> {
        self.listener.accept().await.map(|(s, _)| s)
    }
    fn still_ours(&self) -> bool {
        !self.stop_when_removed || self.file.still_ours()
    }
}

/// Why the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The shutdown future completed, or the listener was shut down under it.
    Shutdown,
    /// [`Listener::still_ours`] said no.
    Removed,
}

const IDLE: u8 = 0;
const BUSY: u8 = 1;
const EVICTED: u8 = 2;

/// One open connection, as the accept loop and its handler share it.
struct ConnState {
    /// The accept, or the handler's last [`Conn::touch`].
    last_active: Mutex<Instant>,
    /// [`IDLE`], [`BUSY`] or [`EVICTED`]: whoever moves it off `IDLE` first owns the
    /// connection (the loop evicts it, or its handler goes on with a request).
    phase: AtomicU8,
    /// Notified when the connection is evicted.
    close: Notify,
}

impl ConnState {
    fn idle_deadline(&self, idle: Duration) -> Instant {
        if self.phase.load(Ordering::Acquire) == BUSY {
            crate::shell::clock::tokio_now() + idle
        } else {
            *self.last_active.lock() + idle
        }
    }
}

/// A handler's view of its connection.
pub struct Conn {
    state: Arc<ConnState>,
    stopping: watch::Receiver<bool>,
}

impl Conn {
    /// The client did something: the idle clock starts again, and the connection goes to the
    /// back of the eviction line.
    pub fn touch(&self) {
        *self.state.last_active.lock() = crate::shell::clock::tokio_now();
    }

    /// A handle that only [`Activity::touch`]es, for a callback that cannot borrow the
    /// connection (hyper's service).
    pub fn activity(&self) -> Activity {
        Activity(self.state.clone())
    }

    /// Marks the connection busy with a request until the guard is dropped: it is then neither
    /// evicted nor closed as idle. `None` when the loop has just evicted it (the handler ends).
    pub fn busy(&self) -> Option<Busy<'_>> {
        self.state
            .phase
            .compare_exchange(IDLE, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Busy(self))
    }

    /// Resolves when the server stops; the handler has [`Policy::drain_timeout`] to finish.
    pub async fn stopping(&mut self) {
        let _ = self.stopping.wait_for(|s| *s).await;
    }
}

/// See [`Conn::activity`].
#[derive(Clone)]
pub struct Activity(Arc<ConnState>);

impl Activity {
    /// As [`Conn::touch`].
    pub fn touch(&self) {
        *self.0.last_active.lock() = crate::shell::clock::tokio_now();
    }
}

/// See [`Conn::busy`].
pub struct Busy<'a>(&'a Conn);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.state.phase.store(IDLE, Ordering::Release);
    }
}

/// The open connections by id.
#[derive(Default)]
struct Open {
    next_id: u64,
    conns: HashMap<u64, Arc<ConnState>>,
}

/// Removes a connection from [`Open`] and frees its slot when its task ends, however it ends.
struct Registered {
    open: Arc<Mutex<Open>>,
    id: u64,
    _slot: OwnedSemaphorePermit,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.open.lock().conns.remove(&self.id);
    }
}

/// Which of the `open` connections (id, last activity) to close when a new one arrives at the
/// cap: the one idle longest (ties: the older id). A client is active the moment its request
/// arrives, so silent and dribbling clients go first.
pub fn pick_eviction(open: impl Iterator<Item = (u64, Instant)>) -> Option<u64> {
    open.min_by_key(|(id, at)| (*at, *id)).map(|(id, _)| id)
}

/// Asks up to `n` connections idle longest, and not busy, to close. False when none could be.
fn evict_longest_idle(open: &Mutex<Open>, n: usize) -> bool {
    let mut o = open.lock();
    let mut evicted = Vec::with_capacity(n);
    for _ in 0..n {
        let candidates = o
            .conns
            .iter()
            .filter(|(_, c)| c.phase.load(Ordering::Acquire) == IDLE)
            .map(|(id, c)| (*id, *c.last_active.lock()));
        let Some(id) = pick_eviction(candidates) else {
            break;
        };
        let Some(old) = o.conns.remove(&id) else {
            break;
        };
        // Lost to its handler, which has just taken a request: keep it.
        if old
            .phase
            .compare_exchange(IDLE, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            o.conns.insert(id, old);
            continue;
        }
        evicted.push(old);
    }
    // Notify after releasing the lock: a woken task ends by taking it (`Registered`'s drop).
    drop(o);
    let any = !evicted.is_empty();
    for old in evicted {
        // A stored permit: the task closes even if it is not waiting yet.
        old.close.notify_one();
    }
    any
}

/// Serves `listener` with `handler` (one task per connection) under `policy` until `shutdown`
/// completes or the listener is taken away. `server` names it in the log.
pub async fn serve<L, H, Fut>(
    server: &'static str,
    listener: L,
    policy: Policy,
    handler: H,
    shutdown: impl Future<Output = ()>,
) -> Ended
where
    L: Listener,
    H: Fn(L::Stream, Conn) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    // Boxed, not pinned on the stack, so it can be dropped as soon as the listener is closed.
    let mut shutdown = Box::pin(shutdown);
    let (stop_tx, stop_rx) = watch::channel(false);
    let open = Arc::new(Mutex::new(Open::default()));
    let slots = Arc::new(Semaphore::new(policy.max_connections.max(1)));
    let mut conns = JoinSet::new();
    let mut watch = tokio::time::interval(WATCH_INTERVAL);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let ended = loop {
        // Reap finished connection tasks so the set does not grow.
        while conns.try_join_next().is_some() {}
        let stream = tokio::select! {
            () = &mut shutdown => break Ended::Shutdown,
            _ = watch.tick() => {
                if !listener.still_ours() {
                    break Ended::Removed;
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok(stream) => stream,
                // The listener was shut down (a reload moved the health endpoint).
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break Ended::Shutdown,
                Err(e) => {
                    // Out of file descriptors and the like: back off rather than spin.
                    tracing::warn!(server, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // At the cap, the connections idle longest are closed to make room; their tasks end
        // at once and hand back their slots, so at most one descriptor beyond the cap is open.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if !evict_longest_idle(&open, policy.eviction_batch()) {
                    tracing::warn!(
                        server,
                        connections = policy.max_connections,
                        "every connection is busy with a request; closing a new one"
                    );
                    drop(stream);
                    continue;
                }
                tracing::debug!(server, "connection cap reached; closed the longest idle");
                tokio::select! {
                    () = &mut shutdown => break Ended::Shutdown,
                    p = slots.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break Ended::Shutdown, // the semaphore is never closed
                    },
                }
            }
        };
        let state = Arc::new(ConnState {
            last_active: Mutex::new(crate::shell::clock::tokio_now()),
            phase: AtomicU8::new(IDLE),
            close: Notify::new(),
        });
        let id = {
            let mut o = open.lock();
            let id = o.next_id;
            o.next_id += 1;
            o.conns.insert(id, state.clone());
            id
        };
        let conn = Conn {
            state: state.clone(),
            stopping: stop_rx.clone(),
        };
        conns.spawn(run_connection(
            server,
            handler(stream, conn),
            state,
            Registered {
                open: open.clone(),
                id,
                _slot: permit,
            },
            policy.idle_timeout,
        ));
        // Let the new connection read its request before the next accept: a real client sends
        // it at once and is then the most recently active, last in line for eviction. Without
        // this, a burst of accepts could evict it before its task ever ran.
        tokio::task::yield_now().await;
    };
    // Closed (and unlinked) before anything slow, so clients and a successor see it gone at
    // once; then the shutdown future goes (a `CloseRequest` so tells the stop it is closed).
    drop(listener);
    drop(shutdown);
    let _ = stop_tx.send(true);
    if !policy.drain_timeout.is_zero() {
        let _ = tokio::time::timeout(policy.drain_timeout, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
    }
    conns.shutdown().await;
    ended
}

/// One connection's task: its handler, until it ends, the connection is evicted, or it is
/// idle (and not busy) past `idle`.
async fn run_connection(
    server: &'static str,
    handler: impl Future<Output = ()>,
    state: Arc<ConnState>,
    _registered: Registered,
    idle: Duration,
) {
    let mut handler = pin!(handler);
    loop {
        let deadline = state.idle_deadline(idle);
        tokio::select! {
            () = &mut handler => return,
            () = state.close.notified() => {
                tracing::debug!(server, "idle connection closed for a new one");
                return;
            }
            () = tokio::time::sleep_until(deadline) => {
                // Activity in between moved the deadline: wait again.
                if state.phase.load(Ordering::Acquire) != BUSY
                    && *state.last_active.lock() + idle <= crate::shell::clock::tokio_now()
                {
                    tracing::debug!(server, "idle connection timed out");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_picks_the_longest_idle() {
        let t0 = crate::shell::clock::tokio_now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let open = [(1, at(30)), (2, at(10)), (3, at(20))];
        assert_eq!(pick_eviction(open.into_iter()), Some(2));
        assert_eq!(pick_eviction([(7, at(5)), (3, at(5))].into_iter()), Some(3));
        assert_eq!(pick_eviction(std::iter::empty()), None);
    }

    fn state(ms_ago: u64, phase: u8) -> Arc<ConnState> {
        Arc::new(ConnState {
            last_active: Mutex::new(
                crate::shell::clock::tokio_now() - Duration::from_millis(ms_ago),
            ),
            phase: AtomicU8::new(phase),
            close: Notify::new(),
        })
    }

    #[test]
    fn a_busy_connection_is_never_evicted() {
        let open = Mutex::new(Open::default());
        let (busy, idle) = (state(500, BUSY), state(10, IDLE));
        open.lock().conns.insert(1, busy.clone());
        open.lock().conns.insert(2, idle.clone());
        // The busy one is idle longer, but only the other one may go.
        assert!(evict_longest_idle(&open, 2));
        assert_eq!(busy.phase.load(Ordering::Acquire), BUSY);
        assert_eq!(idle.phase.load(Ordering::Acquire), EVICTED);
        assert_eq!(open.lock().conns.keys().copied().collect::<Vec<_>>(), [1]);
        // Only busy connections left: the newcomer is the one to close.
        assert!(!evict_longest_idle(&open, 1));
    }
}
