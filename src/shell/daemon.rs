//! The running daemon: brings the tunnel up (tearing down whatever was installed if any step
//! fails), then runs the event loop that feeds the control core ([`Control`]) and executes its
//! actions, and removes everything it installed when stopped. Nothing here decides: reloads,
//! diffs, retries, DNS scheduling and readiness are the core's.
//!
//! The loop never blocks: the config file is read and every firewall command runs on the
//! blocking threads (each command under its timeout), and the loop stamps its pulse
//! ([`LoopPulse`]) on every turn and every [`LOOP_TURN`] while it awaits one, so `/healthz` and
//! the systemd watchdog see a stalled loop, not only a stuck packet thread.

use crate::config::{Config, FirewallMode};
use crate::core::control::{Action, Control, Executed, Lookup, Mode, Refused, Reload, View};
use crate::core::liveness::{LoopPulse, LOOP_TURN};
use crate::core::packet::steering::Steering;
use crate::shell::config_file::Fingerprint;
use crate::shell::dataplane::{self, Dataplane, ThreadSetup};
use crate::shell::executor::Executor;
use crate::shell::netlink::Netlink;
use crate::shell::serve::health::HealthEndpoint;
use crate::shell::serve::local_socket::{CloseFirst, CloseRequest};
use crate::shell::udp::WgSocket;
use crate::uapi::{DeviceUpdate, UapiError};
use anyhow::{Context, Result};
use parking_lot::Mutex;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// How often the config file is compared with the running configuration. Polling (not
/// inotify) also catches Kubernetes' atomic `..data` symlink swap and key-file changes.
const CONFIG_POLL: Duration = Duration::from_secs(2);
/// How often the peers' learned endpoints are looked at (the endpoints file, the group).
const ENDPOINTS_TICK: Duration = Duration::from_secs(1);
/// Commands (reloads, UAPI sets) that may wait for the event loop at once.
const COMMAND_QUEUE: usize = 16;
/// How long one config-file poll waits for its read (microseconds on a sane filesystem); a read
/// that takes longer is collected by a later poll, and no second one is started meanwhile.
const CONFIG_POLL_READ_WAIT: Duration = Duration::from_secs(1);
/// How long a reload waits for the config file to be read before it is refused.
const RELOAD_READ_WAIT: Duration = crate::shell::firewall::COMMAND_TIMEOUT;

/// The config file as read on a blocking thread, with its warnings and fingerprint; `Ok(None)`:
/// unchanged since the fingerprint the read was given (not parsed again); `Err`: why it cannot
/// be used, as the log shows it.
type ConfigRead = Result<Option<(Config, Vec<String>, Fingerprint)>, String>;

/// A request to the event loop, answered when its actions have run.
enum Command {
    Reload {
        reason: &'static str,
        reply: oneshot::Sender<Result<Reload, String>>,
    },
    Uapi {
        update: DeviceUpdate,
        reply: oneshot::Sender<Result<(), UapiError>>,
    },
}

/// What the event loop last published: the core's view and the configuration it runs.
pub(crate) struct Published {
    pub(crate) view: View,
    /// The core's own (shared, not copied: 100,000 peers are not compared on every turn).
    pub(crate) config: Arc<Config>,
    /// The firewall backend in use (empty until rules are first needed).
    pub(crate) backend: String,
}

/// The daemon as the UAPI server, the status socket and the health endpoint see it: the
/// data plane, the last published view, and a way to send commands.
pub struct Handle {
    pub(crate) dataplane: Arc<Dataplane>,
    pub(crate) published: Mutex<Published>,
    commands: mpsc::Sender<Command>,
    /// The UAPI and status sockets, closed first when the daemon stops.
    local_sockets: CloseFirst,
    /// The event loop's heartbeat, which `/healthz` and the watchdog check.
    pub(crate) event_loop: Arc<LoopPulse>,
    /// What the group's endpoint exchange counted, once it runs.
    pub(crate) group_stats: std::sync::OnceLock<Arc<crate::shell::group::GroupStats>>,
}

impl Handle {
    /// Asks the event loop to reload the config file and waits for the outcome.
    pub async fn reload(&self, reason: &'static str) -> Result<Reload, String> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Reload { reason, reply })
            .await
            .map_err(|_| "the daemon is stopping".to_string())?;
        answer
            .await
            .map_err(|_| "the daemon is stopping".to_string())?
    }

    /// A UAPI `set`, from a blocking thread: waits until the peer table has changed, so a
    /// `wg show` right after `wg set` sees the result.
    pub(crate) fn set_blocking(&self, update: DeviceUpdate) -> Result<(), UapiError> {
        let stopping = || UapiError::new(crate::uapi::Errno::EIO, "the daemon is stopping");
        let (reply, answer) = oneshot::channel();
        self.commands
            .blocking_send(Command::Uapi { update, reply })
            .map_err(|_| stopping())?;
        answer.blocking_recv().map_err(|_| stopping())?
    }

    pub fn name(&self) -> String {
        self.published.lock().config.interface.name.clone()
    }

    /// The shutdown future to serve a local socket (UAPI, status) with: it resolves when the
    /// daemon stops, before anything else is torn down, and the stop waits (up to a second)
    /// until the server has closed its socket and dropped it.
    pub fn close_request(&self) -> CloseRequest {
        self.local_sockets.request()
    }

    /// The local sockets' closing, which `shell::process` runs first when the daemon stops.
    pub(crate) fn local_sockets(&self) -> &CloseFirst {
        &self.local_sockets
    }

    pub fn listen_port(&self) -> u16 {
        self.dataplane.listen_port()
    }
}

/// A tunnel that is up, with its control core, before its event loop runs.
pub struct Daemon {
    handle: Arc<Handle>,
    control: Control,
    executor: Executor,
    commands: mpsc::Receiver<Command>,
    /// `None` in userspace mode: no file, nothing to reload.
    config_path: Option<PathBuf>,
    /// The health endpoint (`[health] listen`), moved on reload as the core asks.
    health: HealthEndpoint,
    /// A config-file read that outlived its poll's wait, collected by the next poll.
    config_read: Option<JoinHandle<ConfigRead>>,
    /// What the file (and its key files) held when the running configuration was last read
    /// from it: a poll that finds the same parses nothing.
    config_seen: Option<Fingerprint>,
    /// The endpoints file: where peers authenticated, for takeovers after a restart.
    endpoints: crate::shell::endpoints::Keeper,
    /// The group's endpoint exchange (`takeover.group_listen`), once started.
    group: Option<crate::shell::group::Group>,
}

/// A start that failed: why, and the daemon when it got as far as existing (its packet threads
/// may run and rules may be installed), for the caller to stop.
pub struct StartFailed {
    pub error: anyhow::Error,
    pub daemon: Option<Box<Daemon>>,
}

impl StartFailed {
    fn early(error: anyhow::Error) -> StartFailed {
        StartFailed {
            error,
            daemon: None,
        }
    }

    fn with(daemon: Daemon, error: anyhow::Error) -> StartFailed {
        StartFailed {
            error,
            daemon: Some(Box::new(daemon)),
        }
    }
}

impl Daemon {
    /// Brings the tunnel up: device, socket, addresses, peers, routes, rules, packet loops.
    /// `health_bound` is where the health endpoint's listener (bound for
    /// `config.health.listen`, served with [`Daemon::serve_health`]) is, if any.
    /// On an error once the daemon exists, it comes back in the [`StartFailed`] for the caller
    /// to stop the one way a stop goes (`shell::process::stop_in_order`).
    pub async fn start(
        config: Config,
        config_path: PathBuf,
        health_bound: Option<SocketAddr>,
        threads: ThreadSetup,
    ) -> Result<Daemon, StartFailed> {
        Daemon::start_in(
            Mode::Daemon,
            config,
            Some(config_path),
            health_bound,
            threads,
        )
        .await
    }

    /// The wireguard-go drop-in (`tunnelgate userspace IFNAME`): creates the TUN device and
    /// the WireGuard socket (random port) and nothing else; the device has no key, no peers
    /// and no addresses until `wg` and `ip` (or wg-quick) configure it. Its health endpoint,
    /// when served, never moves: there is no file to reload.
    pub async fn start_userspace(
        name: &str,
        health_bound: Option<SocketAddr>,
        answer: crate::core::takeover::Answer,
        threads: ThreadSetup,
    ) -> Result<Daemon, StartFailed> {
        let mut config = Config::device_only(name)
            .map_err(|e| StartFailed::early(anyhow::anyhow!("interface name {name:?}: {e}")))?;
        config.takeover.answer = answer;
        Daemon::start_in(Mode::Userspace, config, None, health_bound, threads).await
    }

    async fn start_in(
        mode: Mode,
        config: Config,
        config_path: Option<PathBuf>,
        health_bound: Option<SocketAddr>,
        threads: ThreadSetup,
    ) -> Result<Daemon, StartFailed> {
        let (mut daemon, dataplane) =
            Daemon::build(mode, config, config_path, health_bound, threads)
                .await
                .map_err(StartFailed::early)?;
        // Failures are in the core, which says below whether the start must be abandoned.
        let _ = daemon.drain().await;
        // Before the first datagram: a takeover right after a restart needs the endpoints.
        daemon.endpoints.read_if_new_identity();
        if let Some(settings) = daemon.control.config().takeover.group.clone() {
            let fatals = dataplane.thread_setup().fatals.clone();
            match crate::shell::group::Group::start(&settings, dataplane.clone(), fatals).await {
                Ok(group) => {
                    let _ = daemon.handle.group_stats.set(group.stats.clone());
                    daemon.group = Some(group);
                }
                Err(e) => return Err(StartFailed::with(daemon, e)),
            }
        }
        if let Some(why) = daemon.control.start_failure() {
            return Err(StartFailed::with(daemon, anyhow::anyhow!("{why}")));
        }
        if let Err(e) = dataplane.start() {
            let e = anyhow::Error::new(e).context("starting the packet loops");
            return Err(StartFailed::with(daemon, e));
        }
        daemon.publish();
        // The configuration's parse and the first table are big passes at many peers.
        if daemon.control.peer_count() >= crate::shell::procfs::MANY_PEERS {
            crate::shell::procfs::give_back_free_heap();
        }
        // The loop's first turn is due now, not counted from the start of a slow start.
        daemon.handle.event_loop.beat(crate::shell::clock::now());
        let (listen_port, workers) = (daemon.handle.listen_port(), dataplane.workers());
        tracing::info!(interface = %daemon.handle.name(), listen_port, workers, "Tunnel up");
        Ok(daemon)
    }

    /// The daemon, its device, sockets and data plane made (not started), nothing installed.
    async fn build(
        mode: Mode,
        config: Config,
        config_path: Option<PathBuf>,
        health_bound: Option<SocketAddr>,
        threads: ThreadSetup,
    ) -> Result<(Daemon, Arc<Dataplane>)> {
        let iface = &config.interface;
        let workers = iface
            .workers
            .map_or_else(dataplane::default_workers, usize::from);
        let tuning = threads.tuning.clone();
        let queues = crate::shell::tun::create_queues(
            &iface.name,
            iface.mtu,
            workers,
            tuning.tun_txqueuelen,
        )?;
        // From here on, dropping `queues` deletes the device and with it its addresses and routes.
        let fatals = threads.fatals.clone();
        let netlink = Netlink::connect(&fatals)?;
        let link_index = netlink.link_index(&iface.name).await?;
        let sockets = WgSocket::bind_group(
            iface.listen_port,
            iface.fwmark,
            &Steering::plain(workers),
            &tuning.socket_options(),
        )
        .with_context(|| format!("cannot bind the WireGuard UDP port {}", iface.listen_port))?;
        let listen_port = sockets[0].local_port()?;
        let key = mode.starts_with_key().then(|| iface.private_key.clone());
        let dataplane = Arc::new(Dataplane::new(queues, sockets, key, threads)?);
        dataplane.set_takeover_answer(config.takeover.answer);
        let endpoints = crate::shell::endpoints::Keeper::new(
            crate::shell::endpoints::path_for(&config.takeover, &iface.name),
            dataplane.clone(),
        );
        let firewall_mode: FirewallMode = config.firewall.mode;
        let now = crate::shell::clock::now();
        let control = match mode {
            // Moved, not cloned: at 100,000 peers a second copy alive during the start is
            // tens of megabytes of peak that the heap keeps.
            Mode::Daemon => Control::new(config, listen_port, health_bound, now),
            Mode::Userspace => {
                Control::userspace(&config.interface.name, listen_port, health_bound, now)?
            }
        };
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let handle = Arc::new(Handle {
            dataplane: dataplane.clone(),
            published: Mutex::new(Published {
                // Not ready until the first publish, so that publish logs "Ready" for every
                // daemon, also a plain tunnel that is ready from the start (no rules to apply).
                view: View {
                    readiness: Err("starting".into()),
                    ..control.view()
                },
                config: control.shared_config(),
                backend: String::new(),
            }),
            commands: tx,
            local_sockets: CloseFirst::default(),
            event_loop: Arc::new(LoopPulse::new(crate::shell::clock::now())),
            group_stats: std::sync::OnceLock::new(),
        });
        let observe: Arc<dyn crate::telemetry::Observe> = handle.clone();
        // What the configuration was started from, so the first poll parses nothing.
        let config_seen = config_path
            .as_deref()
            .and_then(crate::shell::config_file::take_loaded);
        let daemon = Daemon {
            executor: Executor::new(dataplane.clone(), netlink, link_index, firewall_mode),
            handle,
            control,
            commands: rx,
            config_path,
            health: HealthEndpoint::new(observe, fatals),
            config_read: None,
            config_seen,
            endpoints,
            group: None,
        };
        Ok((daemon, dataplane))
    }

    pub fn handle(&self) -> Arc<Handle> {
        self.handle.clone()
    }

    /// The event loop: until `shutdown` completes, feeds timers, lookups, commands and config
    /// file changes to the core and runs what it asks for. Returns the fatal error that ended it
    /// early (a part of the process died, or the TUN device was deleted: `shell::fatal`), if
    /// any: the process then stops, and its mode decides the exit code. Nothing is torn down here: the caller closes the local sockets
    /// and then stops the rest (`shell::process::stop_in_order` owns that order).
    ///
    /// A shutdown kills the firewall command that runs at that moment (the turn in progress
    /// ends at once, its apply reported failed), so a hung `nft` delays a stop by at most the
    /// teardown's own commands, each under its timeout.
    pub async fn run(&mut self, shutdown: impl Future<Output = ()>) -> Result<(), String> {
        let mut shutdown = std::pin::pin!(shutdown);
        let pulse = self.handle.event_loop.clone();
        let give_up = self.executor.give_up_flag();
        let (stopping_tx, stopping) = watch::channel(false);
        let mut turns = std::pin::pin!(self.turns(stopping));
        let mut beat = tokio::time::interval(LOOP_TURN);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_asked = false;
        loop {
            tokio::select! {
                outcome = &mut turns => break outcome,
                () = &mut shutdown, if !stop_asked => {
                    stop_asked = true;
                    give_up.store(true, Ordering::Relaxed);
                    let _ = stopping_tx.send(true);
                }
                // Polled here, beside the turn in progress: awaiting a command is alive,
                // a turn that blocks the thread is not (this branch cannot run then).
                _ = beat.tick() => pulse.beat(crate::shell::clock::now()),
            }
        }
    }

    /// Serves the health endpoint on `listener` (bound by the composition root for the
    /// configuration's `health.listen`, or `--health`); moved later as the core asks.
    pub fn serve_health(&mut self, listener: tokio::net::TcpListener) -> Result<()> {
        self.health.serve(listener)?;
        Ok(())
    }

    /// Stop, step 2 (after the local sockets, `shell::process::stop_in_order`): closes the
    /// health listener before the teardown removes the input guard, so the endpoint never
    /// listens unguarded.
    pub fn close_health(&mut self) {
        self.health.close();
    }

    /// Stop, step 3: stops and joins the packet threads, so nothing leaves the tunnel while
    /// the rules (SNAT/masquerade among them) go.
    pub async fn stop_dataplane(&mut self) {
        let pulse = self.handle.event_loop.clone();
        with_pulse(&pulse, self.stop_packet_threads()).await;
        // Nothing moves now: what the peers learned last is what the next start reads.
        with_pulse(&pulse, self.endpoints.save_at_stop()).await;
    }

    /// Stop, step 4: removes what the core says was installed (rules, forwarding, routes),
    /// each command under its timeout (the shutdown's give-up is lifted for them).
    pub async fn remove_installed(&mut self) {
        self.executor.give_up_flag().store(false, Ordering::Relaxed);
        let pulse = self.handle.event_loop.clone();
        with_pulse(&pulse, self.undo_installed()).await;
    }

    /// Stop, step 5: waits (bounded) for the health requests in flight.
    pub async fn drain_health(&mut self) {
        self.health.stop().await;
    }

    /// The turns of the event loop, until `stopping` or the data plane's fatal error.
    async fn turns(&mut self, mut stopping: watch::Receiver<bool>) -> Result<(), String> {
        let mut config_poll = tokio::time::interval(CONFIG_POLL);
        config_poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_file_error = String::new();
        let mut endpoints_tick = tokio::time::interval(ENDPOINTS_TICK);
        endpoints_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let dataplane = self.handle.dataplane.clone();
        let mut fatal = std::pin::pin!(dataplane.fatal_error());
        #[cfg(feature = "test-hooks")]
        let stall_hook = crate::shell::test_hooks::StallLoop::from_env();
        loop {
            if *stopping.borrow() {
                return Ok(());
            }
            self.handle.event_loop.beat(crate::shell::clock::now());
            #[cfg(feature = "test-hooks")]
            stall_hook.block_while_asked();
            // Executors report failures to the core, which retries them on its timer.
            let _ = self.drain().await;
            // A timer already due (the read-back right after an apply) runs now, not after a
            // trip through the runtime's timer wheel.
            let now = crate::shell::clock::now();
            if self.control.poll_timeout().is_some_and(|at| at <= now) {
                self.control.handle_timeout(now);
                let _ = self.drain().await;
            }
            self.publish();
            let wake = self
                .control
                .poll_timeout()
                .unwrap_or_else(|| crate::shell::clock::now() + Duration::from_secs(3600));
            tokio::select! {
                Ok(()) = stopping.changed() => return Ok(()),
                // Whoever recorded it logged it; the caller stops and reports the exit.
                why = &mut fatal => return Err(why),
                () = tokio::time::sleep_until(wake.into()) => {
                    self.control.handle_timeout(crate::shell::clock::now());
                }
                Some(done) = self.executor.next_lookup() => {
                    let (lookup, result): (Lookup, Result<Vec<IpAddr>, String>) = done;
                    self.control.handle_resolved(lookup, result, crate::shell::clock::now());
                }
                Some(command) = self.commands.recv() => self.command(command).await,
                _ = config_poll.tick() => self.poll_config_file(&mut last_file_error).await,
                _ = endpoints_tick.tick() => {
                    let news = self.endpoints.tick(crate::shell::clock::now());
                    if let Some(group) = &self.group {
                        group.tell(&news);
                    }
                }
            }
        }
    }

    async fn command(&mut self, command: Command) {
        match command {
            Command::Reload { reason, reply } => {
                let outcome = self.reload(reason).await;
                let _ = reply.send(outcome);
            }
            Command::Uapi { update, reply } => {
                let many =
                    update.replace_peers || update.peers.len() >= crate::shell::procfs::MANY_PEERS;
                let outcome = self
                    .control
                    .handle_device_update(&update, crate::shell::clock::now());
                drop(update);
                let outcome = match outcome {
                    Ok(()) => self
                        .drain()
                        .await
                        .map_err(|e| UapiError::new(crate::uapi::Errno::EADDRINUSE, e)),
                    Err(e) => Err(e),
                };
                // A key set over UAPI (the drop-in's first `wg set`, or a new key): the
                // endpoints file of that identity, before the peers' first data arrives.
                self.endpoints.read_if_new_identity();
                self.publish();
                let _ = reply.send(outcome);
                if many {
                    crate::shell::procfs::give_back_free_heap();
                }
            }
        }
    }

    /// Re-reads the config file; the core takes it or refuses it (then the old one runs on).
    async fn reload(&mut self, reason: &'static str) -> Result<Reload, String> {
        let Some(path) = self.config_path.clone() else {
            return Err("no configuration file to reload (userspace mode: use wg setconf)".into());
        };
        let read = match finish_read(read_config(path, None), RELOAD_READ_WAIT).await {
            Ok(read) => read,
            Err(_still_running) => Err(format!(
                "reading the config file did not finish within {} s",
                RELOAD_READ_WAIT.as_secs()
            )),
        };
        let (config, warnings, seen) = match read {
            Ok(Some(c)) => c,
            Ok(None) => {
                tracing::info!(reason, "Reload: the configuration is unchanged");
                return Ok(Reload::Unchanged);
            }
            Err(e) => {
                self.control.handle_config_invalid();
                tracing::error!(error = %e, reason, "Reload rejected: keeping the running configuration");
                return Err(e);
            }
        };
        for warning in warnings {
            tracing::warn!(warning = %warning, "Configuration warning");
        }
        let taken = self.take_config(config);
        if taken.is_ok() {
            self.config_seen = Some(seen);
        }
        match taken {
            Ok(Reload::Unchanged) => {
                tracing::info!(reason, "Reload: the configuration is unchanged");
                Ok(Reload::Unchanged)
            }
            Ok(Reload::Applied) => {
                let applied = self.drain().await;
                self.publish();
                match applied {
                    Ok(()) => {
                        tracing::info!(reason, "Configuration reloaded");
                        Ok(Reload::Applied)
                    }
                    Err(e) => {
                        tracing::error!(error = %e, reason, "Reload taken, but part of it failed; retrying");
                        Err(e)
                    }
                }
            }
            Err(refused) => {
                tracing::error!(error = %refused, reason, "Reload refused: keeping the running configuration");
                Err(refused.to_string())
            }
        }
    }

    /// Compares the config file with the running configuration, read on a blocking thread: a
    /// file on a hung filesystem delays polls, never the loop.
    async fn poll_config_file(&mut self, last_error: &mut String) {
        let Some(path) = self.config_path.clone() else {
            return;
        };
        let read = self
            .config_read
            .take()
            .unwrap_or_else(|| read_config(path.clone(), self.config_seen.clone()));
        let read = match finish_read(read, CONFIG_POLL_READ_WAIT).await {
            Ok(read) => read,
            Err(still_running) => {
                if self.config_read.replace(still_running).is_none() {
                    tracing::warn!(path = %path.display(), "Reading the config file takes more than {CONFIG_POLL_READ_WAIT:?}; the next polls collect it");
                }
                return;
            }
        };
        match read {
            Ok(None) => last_error.clear(),
            Ok(Some((c, _, seen))) if self.control.runs(&c) => {
                last_error.clear();
                self.config_seen = Some(seen);
                drop(c);
                // The first poll after a start parses the file once more.
                if self.control.peer_count() >= crate::shell::procfs::MANY_PEERS {
                    crate::shell::procfs::give_back_free_heap();
                }
            }
            Ok(Some((c, warnings, seen))) => {
                last_error.clear();
                tracing::info!(path = %path.display(), "Config file changed");
                for warning in warnings {
                    tracing::warn!(warning = %warning, "Configuration warning");
                }
                match self.take_config(c) {
                    Ok(_) => self.config_seen = Some(seen),
                    Err(refused) => {
                        tracing::error!(error = %refused, "Reload refused: keeping the running configuration")
                    }
                }
            }
            Err(text) => {
                if text != *last_error {
                    self.control.handle_config_invalid();
                    tracing::error!(error = %text, "Config file is invalid: keeping the running configuration");
                    *last_error = text;
                }
            }
        }
    }

    /// Hands a new configuration to the core, after taking the health address it names (a
    /// reload to one that cannot be bound is refused, and the old configuration runs on).
    fn take_config(&mut self, config: Config) -> Result<Reload, Refused> {
        let taken = self.take_config_only(config);
        if self.control.peer_count() >= crate::shell::procfs::MANY_PEERS {
            crate::shell::procfs::give_back_free_heap();
        }
        taken
    }

    fn take_config_only(&mut self, config: Config) -> Result<Reload, Refused> {
        let current = self.control.health_requested();
        if let Err(e) = self.health.prepare(current, config.health.listen) {
            self.control.handle_config_invalid();
            return Err(Refused(e));
        }
        let taken = self
            .control
            .handle_config_loaded(config, crate::shell::clock::now());
        if !matches!(taken, Ok(Reload::Applied)) {
            self.health.forget_reservation();
        }
        taken
    }

    /// Runs every action the core has queued, handing each outcome back to it. Returns the
    /// first error an executor reported (the core has it too, and retries).
    async fn drain(&mut self) -> Result<(), String> {
        let mut first_error = Ok(());
        while let Some(action) = self.control.poll_action() {
            let executed = match action {
                // The listener is the daemon's, not an executor's.
                Action::ServeHealth(want) => Some(Executed::HealthBound(self.health.switch(want))),
                action => self.executor.execute(action, self.control.config()).await,
            };
            let Some(executed) = executed else { continue };
            if let (Some(e), Ok(())) = (executed.error(), &first_error) {
                first_error = Err(e.to_string());
            }
            self.control
                .handle_executed(executed, crate::shell::clock::now());
        }
        first_error
    }

    fn publish(&self) {
        let view = self.control.view();
        let mut published = self.handle.published.lock();
        if view.readiness != published.view.readiness {
            match &view.readiness {
                Ok(()) => tracing::info!("Ready"),
                Err(why) => tracing::info!(reason = %why, "Not ready"),
            }
        }
        published.view = view;
        if !Arc::ptr_eq(&published.config, &self.control.shared_config()) {
            published.config = self.control.shared_config();
        }
        published.backend = self.executor.backend_name();
    }

    /// Stop, step 3 of a failed start (`shell::process::stop_in_order`): the packet threads
    /// joined here, not on a blocking thread: a failed start serves nothing yet. Under a pids
    /// limit at the edge, `nft` could not be forked (EAGAIN) now and then once the packet
    /// threads were joined on the pool; our reading (not measured) is that a pool thread made
    /// for the join, the last one not yet idle again, took the task `nft` needed.
    pub(crate) fn stop_dataplane_in_place(&mut self) {
        if let Err(e) = self.handle.dataplane.stop() {
            tracing::warn!(error = %e, "Packet threads did not stop");
        }
    }

    /// Undoes what the core says was installed (collecting, not stopping at, errors), after
    /// the packet threads: nothing comes out of the tunnel while the SNAT/masquerade rules go,
    /// and a start that failed for want of threads (a pids limit) has the stopped threads'
    /// room for `nft`. A route whose device is already gone (`ip link del`) counts as removed;
    /// firewall rules and forwarding sysctls do not depend on the device. Actions the core
    /// still asks for afterwards are dropped.
    async fn undo_installed(&mut self) {
        for action in self.control.teardown() {
            let executed = self.executor.execute(action, self.control.config()).await;
            if let Some(executed) = executed {
                if let Some(e) = executed.error() {
                    tracing::error!(
                        error = %e,
                        "Left in place at stop; the next start of this interface replaces it"
                    );
                }
                self.control
                    .handle_executed(executed, crate::shell::clock::now());
            }
        }
        let leftover = std::iter::from_fn(|| self.control.poll_action()).count();
        if leftover > 0 {
            tracing::debug!(count = leftover, "Actions dropped at teardown");
        }
    }

    /// Stops and joins the packet threads.
    async fn stop_packet_threads(&mut self) {
        // Joining waits up to a second for the loops' next wake: off the runtime.
        let dataplane = self.handle.dataplane.clone();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || dataplane.stop()).await {
            tracing::warn!(error = %e, "Packet threads did not stop");
        }
    }
}

/// Reads and validates the config file (and its warnings) on a blocking thread; with
/// `skip_if`, first compares the file and its key files with that fingerprint, and parses
/// nothing when they are the same.
fn read_config(path: PathBuf, skip_if: Option<Fingerprint>) -> JoinHandle<ConfigRead> {
    tokio::task::spawn_blocking(move || {
        if skip_if.is_some_and(|seen| crate::shell::config_file::unchanged(&path, &seen)) {
            return Ok(None);
        }
        let (config, seen) =
            crate::shell::config_file::load_config_noted(&path).map_err(|e| e.to_string())?;
        let warnings = crate::shell::config_file::warnings(&path, &config);
        Ok(Some((config, warnings, seen)))
    })
}

/// Awaits a [`read_config`] for at most `wait`; the read back when it still runs.
async fn finish_read(
    mut read: JoinHandle<ConfigRead>,
    wait: Duration,
) -> Result<ConfigRead, JoinHandle<ConfigRead>> {
    match tokio::time::timeout(wait, &mut read).await {
        Ok(Ok(read)) => Ok(read),
        Ok(Err(e)) => Ok(Err(format!("reading the config file failed: {e}"))),
        Err(_) => Err(read),
    }
}

/// Awaits `work` while stamping `pulse` every [`LOOP_TURN`]: the loop awaits, it is not stuck.
async fn with_pulse<T>(pulse: &LoopPulse, work: impl Future<Output = T>) -> T {
    let mut work = std::pin::pin!(work);
    let mut beat = tokio::time::interval(LOOP_TURN);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = beat.tick() => pulse.beat(crate::shell::clock::now()),
        }
    }
}
