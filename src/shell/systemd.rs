//! systemd's side of the process: `sd_notify` (READY, RELOADING, STOPPING, WATCHDOG) and the
//! watchdog's pings. A leaf: it names nothing of the daemon but the liveness it is shown, and
//! only the composition root (`shell::process`) calls it, so the process's life is told to
//! systemd from one layer.

use crate::telemetry::Observe;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tells systemd (if it started us with `Type=notify`) about our state. Never blocks.
pub fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = PathBuf::from(path);
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(_) => return,
    };
    // A receiver that does not read (its queue full) must not block the runtime thread that
    // sends: the message is dropped instead, as a lost datagram would be.
    if sock.set_nonblocking(true).is_err() {
        return;
    }
    let target: &Path = &path;
    if let Some(abstract_name) = target.to_str().and_then(|s| s.strip_prefix('@')) {
        use std::os::linux::net::SocketAddrExt;
        if let Ok(addr) = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name) {
            let _ = sock.send_to_addr(state.as_bytes(), &addr);
        }
    } else {
        let _ = sock.send_to(state.as_bytes(), target);
    }
}

/// systemd's watchdog (`WatchdogSec=` in the unit): sends `WATCHDOG=1` at half of
/// `$WATCHDOG_USEC` while `observe`'s liveness (the event loop and every packet thread turned
/// recently, the data path has not failed) is Ok, until `shutdown`. A stalled event loop or a
/// wedged packet thread stops the pings and systemd kills and restarts the service. Returns at
/// once when no watchdog is wanted.
///
/// The ticks run on a thread of their own (the runtime's blocking pool), not on a runtime
/// worker: a blocking call that stalls the event loop holds one of the two workers, and a
/// task queued behind it may wait out the stall, so the tick that should have said why the
/// pings stop would never run (seen in CI: systemd's kill came with no word from the daemon).
pub async fn watchdog(observe: Arc<dyn Observe>, shutdown: impl Future<Output = ()>) {
    use crate::core::liveness::watchdog_interval;
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    let every = match watchdog_interval(usec.as_deref(), pid.as_deref(), std::process::id()) {
        Ok(Some(every)) => every,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %e, "systemd watchdog not served");
            return;
        }
    };
    tracing::info!(every = ?every, "Serving the systemd watchdog");
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let mut ticks = tokio::task::spawn_blocking(move || tick(&*observe, every, &stopped));
    let ended = tokio::select! {
        () = shutdown => {
            drop(stop);
            ticks.await
        }
        ended = &mut ticks => ended,
    };
    // A panic on the ticking thread is this part's panic: the caller records the death.
    if let Err(e) = ended {
        if let Ok(panic) = e.try_into_panic() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// The watchdog's ticks, on the calling thread, until `stopped` is closed.
fn tick(
    observe: &dyn Observe,
    every: std::time::Duration,
    stopped: &std::sync::mpsc::Receiver<()>,
) {
    use crate::core::liveness::WatchdogPings;
    use std::sync::mpsc::RecvTimeoutError;
    let mut pings = WatchdogPings::default();
    loop {
        let step = pings.on_tick(&observe.liveness());
        if let Some(line) = step.log {
            if step.ping {
                tracing::info!("{line}");
            } else {
                tracing::error!("{line}");
            }
        }
        if step.ping {
            sd_notify("WATCHDOG=1");
        }
        match stopped.recv_timeout(every) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
