//! The health endpoint's listener while the daemon runs: serves the one bound at start and
//! moves it when a reload names another `health.listen` (bind the new listener, then close
//! the old one). When to move it is the core's call ([`Action::ServeHealth`], after the input
//! guard is in when it leaves loopback); this file only binds, serves and closes.
//!
//! [`Action::ServeHealth`]: crate::core::control::Action::ServeHealth

use crate::telemetry::http::{serve_health, LISTEN_BACKLOG};
use crate::telemetry::Observe;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a stop waits for the closed listeners' open requests to finish.
const RETIRED_DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Binds `addr` for the health endpoint without listening yet: the address is taken (a busy
/// one fails here), and a connection to it is refused until [`listen`].
pub fn reserve(addr: SocketAddr) -> io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // A listener this daemon closed on the same port does not block the next one.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// Listens on a [`reserve`]d socket with the health endpoint's backlog.
pub fn listen(socket: TcpSocket) -> io::Result<TcpListener> {
    socket.listen(LISTEN_BACKLOG)
}

/// [`reserve`] and [`listen`]: the listener the daemon binds at start, before the tunnel comes
/// up, so a busy address fails the start.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    listen(reserve(addr)?)
}

/// One listener being served.
struct Serving {
    addr: SocketAddr,
    /// A duplicate of the listener's descriptor: `shutdown(2)` on it stops the listener at
    /// once (new connections are refused), whatever the serving task is doing.
    close: OwnedFd,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// The daemon's health endpoint: at most one listener, moved by [`HealthEndpoint::switch`].
pub struct HealthEndpoint {
    observe: Arc<dyn Observe>,
    serving: Option<Serving>,
    /// The address a reload reserved before the core took the new file.
    reserved: Option<(SocketAddr, TcpSocket)>,
    /// Tasks of closed listeners, still answering the requests they had accepted.
    retired: Vec<JoinHandle<()>>,
}

impl HealthEndpoint {
    pub fn new(observe: Arc<dyn Observe>) -> HealthEndpoint {
        HealthEndpoint {
            observe,
            serving: None,
            reserved: None,
            retired: Vec::new(),
        }
    }

    /// Starts serving `listener`. Must run on a tokio runtime.
    pub fn serve(&mut self, listener: TcpListener) -> io::Result<SocketAddr> {
        let addr = listener.local_addr()?;
        let close = listener.as_fd().try_clone_to_owned()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_health(listener, self.observe.clone(), async move {
            let _ = stopped.await;
        }));
        self.close_current();
        self.serving = Some(Serving {
            addr,
            close,
            stop,
            task,
        });
        Ok(addr)
    }

    /// Before a new file is handed to the core: when it names another address than
    /// `current` (the one served now), take that address, so that a reload to an address
    /// that cannot be bound is refused while the old configuration still runs. An address
    /// busy only because our own listener holds its port is moved by closing that first.
    pub fn prepare(
        &mut self,
        current: Option<SocketAddr>,
        want: Option<SocketAddr>,
    ) -> Result<(), String> {
        self.reserved = None;
        let Some(addr) = want.filter(|w| Some(*w) != current) else {
            return Ok(());
        };
        match reserve(addr) {
            Ok(socket) => {
                self.reserved = Some((addr, socket));
                Ok(())
            }
            Err(e) if self.holds_port_of(addr, &e) => Ok(()),
            Err(e) => Err(format!("health.listen {addr}: cannot bind: {e}")),
        }
    }

    /// Forgets a reservation the core did not use (it refused the file).
    pub fn forget_reservation(&mut self) {
        self.reserved = None;
    }

    /// Moves the endpoint to `want` (`None`: stops it): binds the new listener, then closes
    /// the old one. When the old one holds the port, it is closed first; if the new one then
    /// cannot be bound, the old address is bound again. Returns the address now served.
    pub fn switch(&mut self, want: Option<SocketAddr>) -> Result<Option<SocketAddr>, String> {
        let Some(addr) = want else {
            self.close_current();
            return Ok(None);
        };
        let reserved = self.reserved.take().filter(|(a, _)| *a == addr);
        let socket = match reserved.map_or_else(|| reserve(addr), |(_, s)| Ok(s)) {
            Ok(s) => s,
            Err(e) if self.holds_port_of(addr, &e) => {
                let old = self.serving.as_ref().map(|s| s.addr);
                self.close_current();
                match reserve(addr) {
                    Ok(s) => s,
                    Err(e) => {
                        if let Some(old) = old {
                            if let Err(again) = bind(old).and_then(|l| self.serve(l)) {
                                tracing::error!(listen = %old, error = %again, "Cannot bind the old health address again: the health endpoint is off");
                            }
                        }
                        return Err(format!("health.listen {addr}: cannot bind: {e}"));
                    }
                }
            }
            Err(e) => return Err(format!("health.listen {addr}: cannot bind: {e}")),
        };
        let listener = listen(socket).map_err(|e| format!("health.listen {addr}: {e}"))?;
        let bound = self
            .serve(listener)
            .map_err(|e| format!("health.listen {addr}: {e}"))?;
        Ok(Some(bound))
    }

    /// Stops the listener at once (the requests it had accepted are still answered): a stop
    /// does it before the input guard is removed.
    pub fn close(&mut self) {
        self.close_current();
    }

    /// Closes the listener and waits (a bounded time) for the requests it had accepted.
    pub async fn stop(&mut self) {
        self.close_current();
        let retired = std::mem::take(&mut self.retired);
        let _ = tokio::time::timeout(RETIRED_DRAIN_WAIT, futures::future::join_all(retired)).await;
    }

    /// Whether `error` binding `addr` comes from our own listener holding that port.
    fn holds_port_of(&self, addr: SocketAddr, error: &io::Error) -> bool {
        error.kind() == io::ErrorKind::AddrInUse
            && self
                .serving
                .as_ref()
                .is_some_and(|s| s.addr.port() == addr.port())
    }

    /// Stops the current listener at once (its task finishes the requests it had accepted).
    fn close_current(&mut self) {
        let Some(old) = self.serving.take() else {
            return;
        };
        if let Err(e) =
            nix::sys::socket::shutdown(old.close.as_raw_fd(), nix::sys::socket::Shutdown::Both)
        {
            tracing::warn!(listen = %old.addr, error = %e, "Cannot shut the old health listener down");
        }
        let _ = old.stop.send(());
        self.retired.retain(|t| !t.is_finished());
        self.retired.push(old.task);
    }
}
