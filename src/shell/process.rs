//! The process around the data plane, the one composition root of `tunnelgate run` and
//! `tunnelgate userspace` / `tunnelgate-wg`: claims the local sockets, starts the daemon, serves
//! UAPI, the status socket and the systemd watchdog, listens for signals, and stops everything in
//! one order ([`stop_in_order`]: the local sockets close first). `bin/` only parses arguments and
//! `shell::userspace` only goes to the background; both end here.

use crate::config::Config;
use crate::shell::daemon::Daemon;
use crate::shell::dataplane::ThreadSetup;
use crate::shell::serve::local_socket::CloseFirst;
use crate::shell::serve::status::StatusSocket;
use crate::shell::serve::uapi::UapiServer;
use crate::shell::tuning::Tuning;
use crate::telemetry::status::Reloader;
use crate::telemetry::Observe;
use anyhow::Context;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How long a stop waits for the local sockets to close before it goes on without them
/// (they close in microseconds; this only bounds a stuck server).
const SOCKETS_CLOSE_WAIT: Duration = Duration::from_secs(1);
/// How long a stop waits for the side tasks (servers, watchdog) once the daemon is down.
const SIDE_TASKS_WAIT: Duration = Duration::from_secs(2);

/// Tells the forking parent of `tunnelgate userspace` how the start went: `Ok`, or why not.
pub type OnReady = Box<dyn FnOnce(Result<(), String>) + Send>;

/// What to run.
pub enum Mode {
    /// `tunnelgate run`: a config file, reloaded on SIGHUP, `tunnelgate reload` and change;
    /// systemd is told READY, RELOADING and STOPPING.
    Run { config: Box<Config>, path: PathBuf },
    /// `tunnelgate userspace` (wireguard-go's drop-in): no file, nothing to reload; stops when
    /// its UAPI socket is deleted, and the interface being deleted is a normal exit.
    Userspace {
        name: String,
        health: Option<SocketAddr>,
        /// The readiness pipe to the forking parent (`None` in the foreground).
        ready: Option<OnReady>,
    },
}

impl Mode {
    fn program(&self) -> &'static str {
        match self {
            Mode::Run { .. } => "tunnelgate",
            Mode::Userspace { .. } => crate::shell::userspace::WG_NAME,
        }
    }
}

/// Runs `mode` to its end: drops privileges (before any thread: capabilities are per thread),
/// starts the runtime and [`serve`]s. Exit 0 on a clean stop, 1 on a failure (said in the log,
/// and on stderr in userspace mode).
pub fn main(mut mode: Mode) -> ExitCode {
    use crate::shell::priority;
    let program = mode.program();
    let userspace = matches!(mode, Mode::Userspace { .. });
    // The knobs, read once here and passed down; nothing below reads them again.
    let tuning = Tuning::from_env();
    for warning in &tuning.warnings {
        tracing::warn!("{warning}");
    }
    let access = priority::prepare_realtime(&tuning);
    let realtime = priority::keeps(&access);
    let dropped = match &mode {
        Mode::Run { config, .. } => crate::shell::privilege::drop_for(config, realtime),
        Mode::Userspace { .. } => crate::shell::privilege::drop_for_userspace(realtime),
    };
    if let Err(e) = dropped {
        return failed_before_start(&mut mode, format!("cannot drop privileges: {e}"));
    }
    // Before any other thread: from here on only the packet readers may hold CAP_SYS_NICE.
    let spawner = match priority::ReaderSpawner::start(&access) {
        Ok(spawner) => spawner,
        Err(e) => {
            return failed_before_start(&mut mode, format!("cannot start the reader spawner: {e}"))
        }
    };
    priority::log_access(&access, tuning.rt_priority);
    let threads = ThreadSetup {
        tuning: Arc::new(tuning),
        access,
        spawner,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return failed_before_start(&mut mode, format!("cannot start the runtime: {e}")),
    };
    match runtime.block_on(serve(mode, threads)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "{program} failed");
            // `run` logs to stderr already; the drop-in's log may be gone with its terminal.
            if userspace {
                eprintln!("{program}: {e:#}");
            }
            ExitCode::from(1)
        }
    }
}

fn failed_before_start(mode: &mut Mode, why: String) -> ExitCode {
    if let Mode::Userspace { ready, .. } = mode {
        if let Some(ready) = ready.take() {
            ready(Err(why.clone()));
        }
    }
    eprintln!("{}: {why}", mode.program());
    ExitCode::from(1)
}

/// What [`start`] claimed and brought up.
struct Started {
    uapi: UapiServer,
    status: StatusSocket,
    daemon: Daemon,
}

/// Claims everything that can be refused (the UAPI and status sockets, the health address)
/// before the tunnel comes up, so a failed start changes nothing on the system; then starts it.
async fn start(mode: &Mode, threads: ThreadSetup) -> anyhow::Result<Started> {
    let name = match mode {
        Mode::Run { config, .. } => config.interface.name.as_str(),
        Mode::Userspace { name, .. } => name.as_str(),
    };
    let uapi = UapiServer::bind(name).with_context(|| format!("UAPI socket for {name}"))?;
    let status_path = crate::shell::status_client::status_socket_path(name);
    let status = StatusSocket::bind_for_interface(&status_path, name)
        .with_context(|| format!("status socket for {name}"))?;
    let daemon = match mode {
        Mode::Run { config, path } => {
            let health = bind_health(config.health.listen, "health.listen")?;
            // The daemon serves it (and moves it when a reload names another address).
            Daemon::start((**config).clone(), path.clone(), health, threads).await?
        }
        Mode::Userspace { name, health, .. } => {
            let health = bind_health(*health, "--health")?;
            Daemon::start_userspace(name, health, threads).await?
        }
    };
    Ok(Started {
        uapi,
        status,
        daemon,
    })
}

fn bind_health(
    addr: Option<SocketAddr>,
    what: &str,
) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    addr.map(|addr| {
        crate::shell::serve::health::bind(addr).with_context(|| format!("{what} {addr}"))
    })
    .transpose()
}

/// The signals a process stops (and, in `run`, reloads) on.
struct Signals {
    term: Signal,
    int: Signal,
    /// `None` in userspace mode: there is nothing to reload.
    hup: Option<Signal>,
}

impl Signals {
    fn install(reloads: bool) -> anyhow::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
            hup: if reloads {
                Some(signal(SignalKind::hangup()).context("installing SIGHUP handler")?)
            } else {
                None
            },
        })
    }
}

/// SIGTERM or SIGINT.
async fn stop_signal(term: &mut Signal, int: &mut Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// SIGHUP; never without a handler (userspace mode).
async fn reload_signal(hup: &mut Option<Signal>) {
    match hup {
        Some(hup) => {
            hup.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Why the process stops.
enum Ended {
    /// SIGTERM or SIGINT.
    Signal,
    /// The event loop ended by itself: the data plane's fatal error, or the task failed.
    EventLoop(Result<(Box<Daemon>, Result<(), String>), tokio::task::JoinError>),
    /// Userspace mode: the UAPI socket was deleted (or its server failed).
    UapiGone,
}

/// Serves `mode` until a signal, the daemon's fatal error or (userspace) the UAPI socket's
/// removal, then stops in order. The one `serve` of both modes.
pub async fn serve(mut mode: Mode, threads: ThreadSetup) -> anyhow::Result<()> {
    let ready = match &mut mode {
        Mode::Userspace { ready, .. } => ready.take(),
        Mode::Run { .. } => None,
    };
    let userspace = matches!(mode, Mode::Userspace { .. });
    let started = async {
        let signals = Signals::install(!userspace)?;
        Ok::<_, anyhow::Error>((signals, start(&mode, threads).await?))
    };
    let (
        mut signals,
        Started {
            uapi,
            status,
            daemon,
        },
    ) = match started.await {
        Ok(s) => s,
        Err(e) => {
            if let Some(ready) = ready {
                ready(Err(format!("{e:#}")));
            }
            return Err(e);
        }
    };
    let handle = daemon.handle();
    let observe: Arc<dyn Observe> = handle.clone();
    // The UAPI and status sockets are served until the stop closes them, first thing.
    let mut uapi_task = tokio::spawn({
        let (handler, stop) = (handle.clone(), handle.close_request());
        async move { uapi.run(handler, stop).await }
    });
    // No reloader in userspace mode: there is no file to reload (`wg setconf` is the way).
    let reloader: Option<Arc<dyn Reloader>> = (!userspace).then(|| handle.clone() as _);
    let mut side_tasks = vec![tokio::spawn({
        let (stop, observe) = (handle.close_request(), observe.clone());
        async move {
            if let Err(e) = status.serve(observe, reloader, stop).await {
                tracing::error!(error = %e, "status socket failed");
            }
        }
    })];
    let (watchdog_stop, watchdog_stopped) = tokio::sync::oneshot::channel::<()>();
    side_tasks.push(tokio::spawn(systemd_watchdog(observe, async move {
        let _ = watchdog_stopped.await;
    })));
    let (loop_stop, loop_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut event_loop = tokio::spawn(async move {
        let mut daemon = Box::new(daemon);
        let outcome = daemon
            .run(async move {
                let _ = loop_stopped.await;
            })
            .await;
        (daemon, outcome)
    });
    match ready {
        Some(ready) => ready(Ok(())),
        None if !userspace => sd_notify("READY=1\nSTATUS=tunnel up"),
        None => {}
    }
    if let Mode::Userspace { name, .. } = &mode {
        tracing::info!(interface = %name, "Interface and UAPI socket ready");
    }
    let mut uapi_ended = false;
    let ended = loop {
        tokio::select! {
            () = stop_signal(&mut signals.term, &mut signals.int) => break Ended::Signal,
            ended = &mut event_loop => break Ended::EventLoop(ended),
            served = &mut uapi_task, if !uapi_ended => {
                uapi_ended = true;
                match served {
                    Ok(Err(e)) if userspace => tracing::info!(error = %e, "UAPI socket gone; stopping"),
                    Ok(Err(e)) => tracing::error!(error = %e, "UAPI server failed"),
                    Ok(Ok(())) | Err(_) => {}
                }
                if userspace {
                    break Ended::UapiGone;
                }
            }
            () = reload_signal(&mut signals.hup) => {
                sd_notify("RELOADING=1");
                // The event loop logs the outcome; `tunnelgate reload` is the way to wait on
                // it. A stop is heard while the reload runs (its commands may hang up to their
                // timeout): the event loop then cuts the reload short.
                tokio::select! {
                    _ = handle.reload("SIGHUP") => {}
                    () = stop_signal(&mut signals.term, &mut signals.int) => break Ended::Signal,
                }
                sd_notify("READY=1");
            }
        }
    };
    if !userspace {
        sd_notify("STOPPING=1");
    }
    tracing::info!("Shutting down");
    let _ = loop_stop.send(());
    let ended = match ended {
        Ended::EventLoop(ended) => ended,
        Ended::Signal | Ended::UapiGone => event_loop.await,
    };
    let (daemon, outcome) = match ended {
        Ok((daemon, outcome)) => (Some(daemon), Ok(outcome)),
        Err(e) => (None, Err(e)),
    };
    stop_in_order(handle.local_sockets(), async move {
        if let Some(daemon) = daemon {
            daemon.stop().await;
        }
    })
    .await;
    let _ = watchdog_stop.send(());
    if !uapi_ended {
        side_tasks.push(tokio::spawn(async move {
            if let Ok(Err(e)) = uapi_task.await {
                tracing::error!(error = %e, "UAPI server failed");
            }
        }));
    }
    let _ = tokio::time::timeout(SIDE_TASKS_WAIT, futures::future::join_all(side_tasks)).await;
    match outcome {
        Ok(Ok(())) => Ok(()),
        // The interface was deleted (`ip link del`, `wg-quick down`): the normal way for the
        // drop-in to stop.
        Ok(Err(why)) if userspace => {
            tracing::info!(reason = %why, "Interface gone; exiting");
            Ok(())
        }
        Ok(Err(why)) => Err(anyhow::anyhow!(why)),
        Err(e) => Err(anyhow::anyhow!("the event loop failed: {e}")),
    }
}

/// The stop order, in one place for both modes: the local sockets (UAPI, status) are closed
/// and unlinked first, so that `ip link del X` followed at once by a new instance of `X` finds
/// the names free, and only then does `teardown` (the health listener, rules, routes, packet
/// threads) run. A server that does not close within [`SOCKETS_CLOSE_WAIT`] is left behind.
pub(crate) async fn stop_in_order(sockets: &CloseFirst, teardown: impl Future<Output = ()>) {
    if !sockets.close(SOCKETS_CLOSE_WAIT).await {
        tracing::warn!(
            "A local socket did not close within {SOCKETS_CLOSE_WAIT:?}; stopping anyway"
        );
    }
    teardown.await;
}

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
pub async fn systemd_watchdog(observe: Arc<dyn Observe>, shutdown: impl Future<Output = ()>) {
    use crate::core::liveness::{watchdog_interval, WatchdogPings};
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
    let mut shutdown = std::pin::pin!(shutdown);
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pings = WatchdogPings::default();
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = ticks.tick() => {}
        }
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The rule both modes rely on: every local socket is closed (its server has dropped its
    /// close request) before the teardown starts, and a stuck server delays it only boundedly.
    #[tokio::test]
    async fn local_sockets_close_before_the_teardown_starts() {
        let sockets = CloseFirst::default();
        let closed = Arc::new(AtomicBool::new(false));
        let server = tokio::spawn({
            let (mut request, closed) = (sockets.request(), closed.clone());
            async move {
                (&mut request).await;
                // A server unlinks its socket a moment after it is asked, then drops the
                // request.
                tokio::time::sleep(Duration::from_millis(50)).await;
                closed.store(true, Ordering::SeqCst);
                drop(request);
            }
        });
        let torn_down = Arc::new(AtomicBool::new(false));
        stop_in_order(&sockets, {
            let (closed, torn_down) = (closed.clone(), torn_down.clone());
            async move {
                assert!(
                    closed.load(Ordering::SeqCst),
                    "teardown before the sockets closed"
                );
                torn_down.store(true, Ordering::SeqCst);
            }
        })
        .await;
        assert!(torn_down.load(Ordering::SeqCst));
        server.await.expect("server task");
    }

    #[tokio::test]
    async fn a_stuck_server_delays_the_teardown_by_at_most_the_close_wait() {
        let sockets = CloseFirst::default();
        // Never dropped until the test ends: a server that does not close.
        let _stuck = sockets.request();
        let started = crate::shell::clock::now();
        stop_in_order(&sockets, async {}).await;
        let took = crate::shell::clock::since(started);
        assert!(
            took >= SOCKETS_CLOSE_WAIT && took < SOCKETS_CLOSE_WAIT * 2,
            "{took:?}"
        );
    }
}
