//! The process around the data plane, the one composition root of `tunnelgate run` and
//! `tunnelgate userspace` / `tunnelgate-wg`: claims the local sockets, starts the daemon, serves
//! UAPI, the status socket and the systemd watchdog, listens for signals, and stops everything in
//! one order ([`stop_in_order`]: the local sockets close first). It also stops when a long-lived
//! part dies (a panic or a fatal error of a packet thread, a server task, the netlink driver, the
//! reader spawner, the watchdog or the event loop: `shell::fatal`), in every mode, with exit 1
//! and an error line naming the part; only the interface's deletion ends the drop-in with 0.
//! `bin/` only parses arguments and `shell::userspace` only goes to the background; both end
//! here.

use crate::config::Config;
use crate::core::control::{Mode, Reload};
use crate::core::liveness::Fatal;
use crate::shell::daemon::{Daemon, Handle, StartFailed};
use crate::shell::dataplane::ThreadSetup;
use crate::shell::fatal::{guarded, panic_message, Fatals, Part};
use crate::shell::serve::local_socket::CloseFirst;
use crate::shell::serve::status::StatusSocket;
use crate::shell::serve::uapi::{ServerError, UapiServer};
use crate::shell::systemd;
use crate::shell::tuning::Tuning;
use crate::telemetry::status::{ReloadOutcome, Reloader};
use crate::telemetry::Observe;
use anyhow::Context;
use futures::FutureExt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::task::JoinHandle;

/// How long a stop waits for the local sockets to close before it goes on without them
/// (they close in microseconds; this only bounds a stuck server).
const SOCKETS_CLOSE_WAIT: Duration = Duration::from_secs(1);
/// How long a stop waits for the side tasks (servers, watchdog) once the daemon is down.
const SIDE_TASKS_WAIT: Duration = Duration::from_secs(2);

/// Tells the forking parent of `tunnelgate userspace` how the start went: `Ok`, or why not.
pub type OnReady = Box<dyn FnOnce(Result<(), String>) + Send>;

/// What to start: a [`Mode`] and what that mode starts from.
pub enum Launch {
    /// `tunnelgate run` ([`Mode::Daemon`]): a config file, reloaded on SIGHUP, `tunnelgate
    /// reload` and change.
    Run { config: Box<Config>, path: PathBuf },
    /// `tunnelgate userspace` ([`Mode::Userspace`], wireguard-go's drop-in): a device name.
    Userspace {
        name: String,
        health: Option<SocketAddr>,
        /// Which sources a takeover may answer (`--takeover-any-source`).
        answer: crate::core::takeover::Answer,
        /// The readiness pipe to the forking parent (`None` in the foreground).
        ready: Option<OnReady>,
    },
}

impl Launch {
    /// The mode, which the rest of the process asks what it has.
    pub fn mode(&self) -> Mode {
        match self {
            Launch::Run { .. } => Mode::Daemon,
            Launch::Userspace { .. } => Mode::Userspace,
        }
    }

    /// The configuration file's contents, in the mode that has one.
    fn config(&self) -> Option<&Config> {
        match self {
            Launch::Run { config, .. } => Some(&**config),
            Launch::Userspace { .. } => None,
        }
    }

    /// The interface's name.
    fn name(&self) -> &str {
        match self {
            Launch::Run { config, .. } => &config.interface.name,
            Launch::Userspace { name, .. } => name,
        }
    }

    /// Where the health endpoint listens, and which setting said so.
    fn health(&self) -> (Option<SocketAddr>, &'static str) {
        match self {
            Launch::Run { config, .. } => (config.health.listen, "health.listen"),
            Launch::Userspace { health, .. } => (*health, "--health"),
        }
    }

    /// The readiness pipe to the forking parent, taken once.
    fn take_ready(&mut self) -> Option<OnReady> {
        match self {
            Launch::Userspace { ready, .. } => ready.take(),
            Launch::Run { .. } => None,
        }
    }
}

/// Runs `launch` to its end: drops privileges (before any thread: capabilities are per
/// thread), starts the runtime and [`serve`]s. Exit 0 on a clean stop (and, in the drop-in, on
/// its interface's deletion), 1 on a failure, a part's death included (said in the log, and on
/// stderr where the log may be gone: [`Mode::follows_the_device`]).
pub fn main(mut launch: Launch) -> ExitCode {
    use crate::shell::priority;
    let mode = launch.mode();
    let program = mode.program();
    #[cfg(feature = "test-hooks")]
    crate::shell::test_hooks::read_panic_hook();
    // The knobs, read once here and passed down; nothing below reads them again.
    let tuning = Tuning::from_env();
    for warning in &tuning.warnings {
        tracing::warn!("{warning}");
    }
    let access = priority::prepare_realtime(&tuning);
    let realtime = priority::keeps(&access);
    let dropped = match launch.config() {
        Some(config) => crate::shell::privilege::drop_for(
            config,
            crate::shell::firewall::uses_legacy_iptables(config.firewall.mode),
            realtime,
        ),
        None => crate::shell::privilege::drop_for_userspace(realtime),
    };
    if let Err(e) = dropped {
        return failed_before_start(&mut launch, format!("cannot drop privileges: {e}"));
    }
    // The record every long-lived part reports its death to, from the first thread on.
    let fatals = Fatals::new();
    // Before any other thread: from here on only the packet readers may hold CAP_SYS_NICE.
    let (spawner, spawner_thread) = match priority::ReaderSpawner::start(&access, &fatals) {
        Ok(started) => started,
        Err(e) => {
            return failed_before_start(
                &mut launch,
                format!("cannot start the reader spawner: {e}"),
            )
        }
    };
    priority::log_access(&access, tuning.rt_priority);
    let threads = ThreadSetup {
        tuning: Arc::new(tuning),
        access,
        spawner,
        fatals,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            return failed_before_start(&mut launch, format!("cannot start the runtime: {e}"))
        }
    };
    // A panic of the root itself is a death too: said, exit 1 (what it started ends with the
    // runtime and the process).
    let served = runtime
        .block_on(std::panic::AssertUnwindSafe(serve(launch, threads)).catch_unwind())
        .unwrap_or_else(|panic| {
            Err(anyhow::anyhow!(
                "the process's composition root panicked: {}",
                panic_message(panic.as_ref())
            ))
        });
    // Every task ends with the runtime (bounded: a hung blocking call is left to the exit);
    // the spawner's last sender went with the data plane.
    runtime.shutdown_timeout(SIDE_TASKS_WAIT);
    spawner_thread.join(SIDE_TASKS_WAIT);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "{program} failed");
            // `run` logs to stderr already; the drop-in's log may be gone with its terminal.
            if mode.follows_the_device() {
                eprintln!("{program}: {e:#}");
            }
            ExitCode::from(1)
        }
    }
}

fn failed_before_start(launch: &mut Launch, why: String) -> ExitCode {
    if let Some(ready) = launch.take_ready() {
        ready(Err(why.clone()));
    }
    eprintln!("{}: {why}", launch.mode().program());
    ExitCode::from(1)
}

/// Tells systemd `state` in the mode that reports to it ([`Mode::notifies_systemd`]).
fn notify(mode: Mode, state: &str) {
    if mode.notifies_systemd() {
        systemd::sd_notify(state);
    }
}

/// What [`start`] claimed and brought up.
struct Started {
    uapi: UapiServer,
    status: StatusSocket,
    daemon: Daemon,
}

/// Claims everything that can be refused (the UAPI and status sockets, the health address)
/// before the tunnel comes up, so a failed start changes nothing on the system; then brings
/// the tunnel up and serves the health endpoint.
async fn start(launch: &mut Launch, threads: ThreadSetup) -> anyhow::Result<Started> {
    let name = launch.name();
    let uapi = UapiServer::bind(name).with_context(|| format!("UAPI socket for {name}"))?;
    let status_path = crate::shell::status_client::status_socket_path(name);
    let status = StatusSocket::bind_for_interface(&status_path, name)
        .with_context(|| format!("status socket for {name}"))?;
    let (health, setting) = launch.health();
    let health = bind_health(health, setting)?;
    let health_bound = match &health {
        Some(listener) => Some(listener.local_addr().context("health listener")?),
        None => None,
    };
    let started = match launch {
        Launch::Run { config, path } => {
            // The peers move to the daemon: the launch keeps what names the process, and
            // 100,000 peers kept twice would be tens of megabytes held for nothing.
            let peers = std::mem::take(&mut config.peers);
            let given = Config {
                peers,
                ..(**config).clone()
            };
            Daemon::start(given, path.clone(), health_bound, threads).await
        }
        Launch::Userspace { name, answer, .. } => {
            Daemon::start_userspace(name, health_bound, *answer, threads).await
        }
    };
    let mut daemon = match started {
        Ok(daemon) => daemon,
        Err(StartFailed { error, daemon }) => {
            if let Some(daemon) = daemon {
                stop_failed_start(daemon).await;
            }
            return Err(error);
        }
    };
    if let Some(listener) = health {
        // The daemon moves it when a reload names another address.
        if let Err(e) = daemon.serve_health(listener) {
            stop_failed_start(Box::new(daemon)).await;
            return Err(e.context("serving the health endpoint"));
        }
    }
    Ok(Started {
        uapi,
        status,
        daemon,
    })
}

/// A start that failed once the daemon existed stops the one way a stop goes
/// ([`stop_in_order`]), with nothing served yet: no side tasks, and the packet threads joined in
/// place ([`Daemon::stop_dataplane_in_place`]).
async fn stop_failed_start(daemon: Box<Daemon>) {
    stop_in_order(&mut Running {
        handle: daemon.handle(),
        daemon: Some(daemon),
        watchdog_stop: None,
        side_tasks: Vec::new(),
        serving: false,
    })
    .await;
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
    /// `None` without a config file: there is nothing to reload.
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

/// SIGHUP; never without a handler (no config file).
async fn reload_signal(hup: &mut Option<Signal>) {
    match hup {
        Some(hup) => {
            hup.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// `tunnelgate reload` over the status socket: the same reload as SIGHUP, told to systemd the
/// same way (from here, the root), with the outcome returned to the client.
struct NotifyingReloader {
    handle: Arc<Handle>,
    mode: Mode,
}

impl Reloader for NotifyingReloader {
    fn reload(
        &self,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ReloadOutcome, String>> + Send + '_>,
    > {
        Box::pin(async move {
            notify(self.mode, "RELOADING=1");
            let outcome = self.handle.reload("tunnelgate reload").await;
            notify(self.mode, "READY=1");
            outcome.map(|r| match r {
                Reload::Applied => ReloadOutcome::Applied,
                Reload::Unchanged => ReloadOutcome::Unchanged,
            })
        })
    }
}

/// Why the process stops.
enum Ended {
    /// SIGTERM or SIGINT.
    Signal,
    /// Something fatal is recorded ([`Fatals`]): a part died, or the interface was deleted.
    Fatal,
    /// The event loop's task ended by itself: on something fatal, its own panic (both
    /// recorded), or its task failed.
    EventLoop(Result<Box<Daemon>, tokio::task::JoinError>),
}

/// Serves `launch` until a signal or something fatal ([`Fatals`]: a long-lived part's death,
/// the interface's deletion: its TUN device gone or, for the drop-in too, its UAPI socket
/// removed), then stops in order. The one `serve` of both modes: it starts every long-lived
/// part (the tunnel and its data plane, the health endpoint, the event loop, the UAPI and
/// status servers, the systemd watchdog), each under [`guarded`] or reporting its own death,
/// and stops them all with [`stop_in_order`]. `Err` when the exit is a failure: a death in any
/// mode, a deletion where the mode keeps its device ([`Fatal::is_failure`]).
pub async fn serve(mut launch: Launch, threads: ThreadSetup) -> anyhow::Result<()> {
    let mode = launch.mode();
    let ready = launch.take_ready();
    let fatals = threads.fatals.clone();
    let started = async {
        let signals = Signals::install(mode.has_config_file())?;
        Ok::<_, anyhow::Error>((signals, start(&mut launch, threads).await?))
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
            // A part that died while the tunnel came up is the likelier cause: named first.
            let e = match fatals.get() {
                Some(fatal) => e.context(fatal.to_string()),
                None => e,
            };
            if let Some(ready) = ready {
                ready(Err(format!("{e:#}")));
            }
            return Err(e);
        }
    };
    let handle = daemon.handle();
    let observe: Arc<dyn Observe> = handle.clone();
    // The UAPI and status sockets are served until the stop closes them, first thing. Their
    // servers end by themselves only by dying (a panic or an error) or, for UAPI, when its
    // socket is removed: the interface's deletion, as wireguard-go takes it.
    let mut side_tasks = vec![tokio::spawn({
        let (handler, stop, fatals) = (handle.clone(), handle.close_request(), fatals.clone());
        async move {
            let closing = handler.clone();
            match guarded(&fatals, Part::Uapi, uapi.run(handler, stop)).await {
                Some(Ok(())) => ended_by_itself(&fatals, Part::Uapi, &closing),
                Some(Err(removed @ ServerError::SocketRemoved { .. })) => {
                    fatals.raise(Fatal::Deleted(removed.to_string()));
                }
                Some(Err(e)) => {
                    fatals.died(format!("{} failed: {e}", Part::Uapi.name()));
                }
                // Its panic, recorded.
                None => {}
            }
        }
    })];
    // No reloader without a file (`wg setconf` is the way).
    let reloader: Option<Arc<dyn Reloader>> = mode.has_config_file().then(|| {
        Arc::new(NotifyingReloader {
            handle: handle.clone(),
            mode,
        }) as _
    });
    side_tasks.push(tokio::spawn({
        let (stop, observe, fatals) = (handle.close_request(), observe.clone(), fatals.clone());
        let closing = handle.clone();
        async move {
            let served = status.serve(observe, reloader, stop);
            match guarded(&fatals, Part::Status, served).await {
                Some(Ok(())) => ended_by_itself(&fatals, Part::Status, &closing),
                Some(Err(e)) => {
                    fatals.died(format!("{} failed: {e}", Part::Status.name()));
                }
                // Its panic, recorded.
                None => {}
            }
        }
    }));
    let (watchdog_stop, watchdog_stopped) = tokio::sync::oneshot::channel::<()>();
    side_tasks.push(tokio::spawn({
        let fatals = fatals.clone();
        // Returns at once when systemd asks for no watchdog: that is not a death.
        let watchdog = systemd::watchdog(observe, async move {
            let _ = watchdog_stopped.await;
        });
        async move {
            let _ = guarded(&fatals, Part::Watchdog, watchdog).await;
        }
    }));
    let (loop_stop, loop_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut event_loop = tokio::spawn({
        let fatals = fatals.clone();
        async move {
            let mut daemon = Box::new(daemon);
            // A panic leaves the daemon here, so the stop still removes what it installed.
            let _ = guarded(
                &fatals,
                Part::EventLoop,
                daemon.run(async move {
                    let _ = loop_stopped.await;
                }),
            )
            .await;
            daemon
        }
    });
    // A part that died before this point (as the tunnel came up) is a failed start: the
    // forking parent is told so, and systemd is never told READY=1.
    #[cfg(feature = "test-hooks")]
    crate::shell::test_hooks::hold_ready_for_an_early_death(&fatals).await;
    let early = fatals.get();
    match (ready, &early) {
        (Some(ready), None) => ready(Ok(())),
        (Some(ready), Some(fatal)) => ready(Err(fatal.to_string())),
        (None, None) => notify(mode, "READY=1\nSTATUS=tunnel up"),
        (None, Some(_)) => {}
    }
    if early.is_none() && mode.follows_the_device() {
        tracing::info!(interface = %launch.name(), "Interface and UAPI socket ready");
    }
    #[cfg(feature = "test-hooks")]
    if early.is_none() {
        crate::shell::test_hooks::process_ready();
    }
    let ended = loop {
        tokio::select! {
            () = stop_signal(&mut signals.term, &mut signals.int) => break Ended::Signal,
            _ = fatals.wait() => break Ended::Fatal,
            ended = &mut event_loop => break Ended::EventLoop(ended),
            () = reload_signal(&mut signals.hup) => {
                notify(mode, "RELOADING=1");
                // The event loop logs the outcome; `tunnelgate reload` is the way to wait on
                // it. A stop is heard while the reload runs (its commands may hang up to their
                // timeout): the event loop then cuts the reload short.
                tokio::select! {
                    _ = handle.reload("SIGHUP") => {}
                    () = stop_signal(&mut signals.term, &mut signals.int) => break Ended::Signal,
                    _ = fatals.wait() => break Ended::Fatal,
                }
                notify(mode, "READY=1");
            }
        }
    };
    if let Ended::EventLoop(ended) = &ended {
        // It ends by itself only on something fatal, which it recorded or heard of; said
        // here if not (before the hold, so `/healthz` names it too).
        match ended {
            Err(e) => event_loop_failed(&fatals, e),
            Ok(_) if fatals.get().is_none() => {
                fatals.died(format!("{} ended by itself", Part::EventLoop.name()));
            }
            Ok(_) => {}
        }
    }
    if !matches!(ended, Ended::Signal) {
        #[cfg(feature = "test-hooks")]
        crate::shell::test_hooks::hold_fatal_while_asked().await;
    }
    notify(mode, "STOPPING=1");
    tracing::info!("Shutting down");
    let _ = loop_stop.send(());
    let daemon = match ended {
        Ended::EventLoop(ended) => ended.ok(),
        Ended::Signal | Ended::Fatal => event_loop
            .await
            .inspect_err(|e| event_loop_failed(&fatals, e))
            .ok(),
    };
    stop_in_order(&mut Running {
        handle: handle.clone(),
        daemon,
        watchdog_stop: Some(watchdog_stop),
        side_tasks,
        serving: true,
    })
    .await;
    match fatals.get() {
        // A stop that was asked for.
        None => Ok(()),
        Some(fatal) if fatal.is_failure(mode) => Err(anyhow::anyhow!(fatal)),
        // The interface was deleted (`ip link del`, `wg-quick down`): the normal way for the
        // drop-in to stop.
        Some(gone) => {
            tracing::info!(reason = %gone, "Interface gone; exiting");
            Ok(())
        }
    }
}

/// A local server (UAPI, status) that returned: the stop closed it, or, if no stop asked,
/// it ended by itself, which is its death.
fn ended_by_itself(fatals: &Fatals, part: Part, handle: &Handle) {
    if !handle.local_sockets().asked() {
        fatals.died(format!("{} ended by itself", part.name()));
    }
}

/// The event loop's task failed outside [`guarded`] (it cannot panic there, but its failure is
/// not thrown away): its death, and no daemon to stop but what the drop does.
fn event_loop_failed(fatals: &Fatals, e: &tokio::task::JoinError) {
    fatals.died(format!("{}'s task failed: {e}", Part::EventLoop.name()));
}

/// The long-lived parts as a stop ends them, one method per step; [`stop_in_order`] is the one
/// place of their order.
pub(crate) trait Parts {
    /// The UAPI and status sockets: closed and unlinked (a stuck server is left behind after
    /// [`SOCKETS_CLOSE_WAIT`]).
    async fn close_local_sockets(&mut self);
    /// The health listener: closed while the input guard still stands, so the endpoint never
    /// listens unguarded.
    async fn close_health_listener(&mut self);
    /// The packet threads, joined: nothing leaves the tunnel from here on.
    async fn stop_dataplane(&mut self);
    /// What the core says was installed: rules, forwarding sysctls, routes (each command under
    /// its timeout; a route whose device is already gone counts as removed).
    async fn remove_installed(&mut self);
    /// The health requests in flight, waited for (bounded).
    async fn drain_health(&mut self);
    /// The watchdog, and the status and UAPI servers' tasks, joined (bounded).
    async fn join_side_tasks(&mut self);
}

/// The stop order, in one place for both modes: the local sockets (UAPI, status) are closed
/// and unlinked first, so that `ip link del X` followed at once by a new instance of `X` finds
/// the names free; then the health listener (before the rules take its input guard away), the
/// packet threads, what was installed (rules, forwarding, routes), the health requests still in
/// flight, and last the side tasks (the watchdog, the servers' tasks). The packet threads stop
/// before the rules go: a packet the tunnel delivers once the SNAT/masquerade rules are gone
/// would be forwarded with its tunnel address onto the LAN.
pub(crate) async fn stop_in_order(parts: &mut impl Parts) {
    parts.close_local_sockets().await;
    parts.close_health_listener().await;
    parts.stop_dataplane().await;
    parts.remove_installed().await;
    parts.drain_health().await;
    parts.join_side_tasks().await;
}

/// What [`serve`] runs once its loop has ended, or what a failed start got as far as: the
/// daemon (`None` if its task failed) and the side tasks.
struct Running {
    handle: Arc<Handle>,
    daemon: Option<Box<Daemon>>,
    watchdog_stop: Option<tokio::sync::oneshot::Sender<()>>,
    side_tasks: Vec<JoinHandle<()>>,
    /// Whether it served (a stop), or failed to start.
    serving: bool,
}

impl Parts for Running {
    async fn close_local_sockets(&mut self) {
        close_local_sockets(self.handle.local_sockets(), SOCKETS_CLOSE_WAIT).await;
    }

    async fn close_health_listener(&mut self) {
        if let Some(daemon) = &mut self.daemon {
            daemon.close_health();
        }
    }

    async fn stop_dataplane(&mut self) {
        match &mut self.daemon {
            Some(daemon) if self.serving => daemon.stop_dataplane().await,
            Some(daemon) => daemon.stop_dataplane_in_place(),
            None => {}
        }
    }

    async fn remove_installed(&mut self) {
        if let Some(daemon) = &mut self.daemon {
            daemon.remove_installed().await;
        }
    }

    async fn drain_health(&mut self) {
        if let Some(daemon) = &mut self.daemon {
            daemon.drain_health().await;
        }
    }

    async fn join_side_tasks(&mut self) {
        if let Some(stop) = self.watchdog_stop.take() {
            let _ = stop.send(());
        }
        let tasks = std::mem::take(&mut self.side_tasks);
        let _ = tokio::time::timeout(SIDE_TASKS_WAIT, futures::future::join_all(tasks)).await;
    }
}

/// Asks the local servers to close and waits for them, at most `wait`: a server that does
/// not close is left behind (said in the log) and the stop goes on. Returns whether all closed.
async fn close_local_sockets(sockets: &CloseFirst, wait: Duration) -> bool {
    let closed = sockets.close(wait).await;
    if !closed {
        tracing::warn!("A local socket did not close within {wait:?}; stopping anyway");
    }
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    // The stop's order is tested on the real parts, in namespaces:
    // tests/netns_control.rs `a_stop_removes_the_uapi_socket_then_joins_the_packet_threads_then_removes_the_rules`.

    /// A server that never closes does not hold the stop: it is given up after the wait and
    /// the rest of the stop runs. (No claim on how long the wait took: only that it ends.)
    #[tokio::test]
    async fn a_stuck_server_does_not_hold_the_stop() {
        let sockets = CloseFirst::default();
        // Never dropped until the test ends: a server that does not close.
        let _stuck = sockets.request();
        let wait = Duration::from_millis(20);
        let closed =
            tokio::time::timeout(Duration::from_secs(30), close_local_sockets(&sockets, wait))
                .await
                .expect("the close gave up on the stuck server");
        assert!(!closed, "a stuck server was reported closed");
    }
}
