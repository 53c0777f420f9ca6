//! Executes the control core's actions against the system (netlink, the peer table, the UDP
//! socket, `nft`/`iptables-restore`, sysctls, DNS) and returns each outcome ([`Executed`]) for
//! the daemon to hand to the core; it never holds the core. Decides nothing: what to do, when,
//! and what a failure means are the core's.
//!
//! Nothing here blocks the event loop: netlink is async, and every blocking step (the firewall
//! programs, each with its timeout, the sysctl and forwarding-record files) runs on the blocking
//! threads while the loop awaits it.

use crate::config::Config;
use crate::config::FirewallMode;
use crate::core::control::{Action, Executed, Lookup, PeerChanges, RulesReport};
use crate::rules::{Family, RuleSet};
use crate::shell::dataplane::Dataplane;
use crate::shell::firewall::{self, Backend, Limits};
use crate::shell::forwarding::SharedForwarding;
use crate::shell::netlink::Netlink;
use crate::shell::resolver::Resolver;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio::task::JoinSet;

type LookupResult = (Lookup, Result<Vec<IpAddr>, String>);

pub(crate) struct Executor {
    dataplane: Arc<Dataplane>,
    netlink: Netlink,
    link_index: u32,
    firewall_mode: FirewallMode,
    backend: Option<Backend>,
    resolver: Option<(Vec<SocketAddr>, Arc<Resolver>)>,
    lookups: JoinSet<LookupResult>,
    /// An MTU change that failed, reported with the address change that follows it.
    mtu_error: Option<String>,
    /// The forwarding sysctls shared with other tunnelgates; made on first use.
    forwarding: Option<SharedForwarding>,
    /// The timeout of every firewall command, and the flag that kills a running one at a stop.
    limits: Limits,
}

impl Executor {
    pub(crate) fn new(
        dataplane: Arc<Dataplane>,
        netlink: Netlink,
        link_index: u32,
        firewall_mode: FirewallMode,
    ) -> Executor {
        Executor {
            dataplane,
            netlink,
            link_index,
            firewall_mode,
            backend: None,
            resolver: None,
            lookups: JoinSet::new(),
            mtu_error: None,
            forwarding: None,
            limits: Limits::default(),
        }
    }

    /// The flag that, while set, kills the firewall command that runs now and fails each one
    /// started later: the daemon is stopping and its teardown must not wait behind a hung
    /// `nft`. The teardown's own commands run with it cleared again, each under its timeout.
    pub(crate) fn give_up_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.limits.stop.clone()
    }

    pub(crate) fn backend_name(&self) -> String {
        self.backend.map(|b| b.to_string()).unwrap_or_default()
    }

    /// The next finished lookup; pending forever while none runs.
    pub(crate) async fn next_lookup(&mut self) -> Option<LookupResult> {
        if self.lookups.is_empty() {
            return std::future::pending().await;
        }
        match self.lookups.join_next().await {
            Some(Ok(done)) => Some(done),
            Some(Err(e)) => {
                tracing::error!(error = %e, "DNS lookup task failed");
                None
            }
            None => None,
        }
    }

    /// Runs `action` for the running `config` and returns what the core must hear of it
    /// (`None` for actions that cannot fail). Decides nothing.
    pub(crate) async fn execute(&mut self, action: Action, config: &Config) -> Option<Executed> {
        match action {
            Action::SetMtu(mtu) => {
                self.mtu_error = self
                    .netlink
                    .link_up(self.link_index, mtu)
                    .await
                    .err()
                    .map(|e| e.to_string());
                None
            }
            Action::SetAddresses { add, remove } => {
                Some(Executed::Addresses(self.set_addresses(&add, &remove).await))
            }
            Action::UpdatePeers(changes) => {
                self.update_peers(&changes);
                None
            }
            Action::Rebind { port, fwmark } => Some(Executed::Rebound(self.rebind(port, fwmark))),
            Action::SetFwmark {
                mark,
                src_valid_mark,
            } => {
                if let Err(e) = self.dataplane.set_mark(mark) {
                    tracing::error!(error = %e, mark, "Cannot mark the WireGuard socket");
                }
                if src_valid_mark {
                    // Replies to marked packets must pass reverse-path filtering (wg-quick
                    // does this too).
                    let _ = tokio::task::spawn_blocking(|| {
                        std::fs::write("/proc/sys/net/ipv4/conf/all/src_valid_mark", "1")
                    })
                    .await;
                }
                None
            }
            Action::ApplyRoutes(diff) => Some(Executed::Routes(self.apply_routes(&diff).await)),
            Action::Resolve { lookup, deadline } => {
                let resolver = self.resolver(&config.dns.nameservers);
                self.lookups.spawn(async move {
                    let name = match &lookup {
                        Lookup::Target(name) => name.clone(),
                        Lookup::Endpoint { host, .. } => host.clone(),
                    };
                    let result = match resolver {
                        Ok(r) => r.resolve(&name, deadline).await,
                        Err(e) => Err(e),
                    };
                    (lookup, result)
                });
                None
            }
            Action::EnableForwarding(families) => {
                // Under a lock shared with other tunnelgates: off the event loop.
                let asked = families.clone();
                let result = self
                    .with_forwarding(&config.interface.name, move |f| f.enable(&families))
                    .await
                    .unwrap_or_else(|| {
                        Err(asked
                            .into_iter()
                            .map(|f| (f, "the forwarding task failed".to_string()))
                            .collect())
                    });
                Some(Executed::Forwarding(result))
            }
            Action::ApplyRules { set, installed } => Some(Executed::RulesApplied(
                self.apply_rules(set, installed).await,
            )),
            Action::CheckRules => {
                let tunnel = config.interface.name.clone();
                let limits = self.limits.clone();
                let result = match self.backend {
                    Some(backend) => blocking(move || backend.installed(&tunnel, &limits)).await,
                    None => Ok(String::new()),
                };
                Some(Executed::RulesChecked(result))
            }
            Action::RemoveRules => Some(Executed::RulesRemoved(
                self.remove_rules(&config.interface.name).await,
            )),
            Action::SweepRules => Some(Executed::RulesSwept(
                self.sweep_rules(&config.interface.name).await,
            )),
            Action::RestoreForwarding(families) => {
                // A previous run killed with -9 may have left a change for this interface, so
                // the records are read even when this run enabled nothing itself.
                self.with_forwarding(&config.interface.name, move |f| f.release(&families))
                    .await;
                None
            }
            // The daemon owns the health listener and runs this itself.
            Action::ServeHealth(_) => {
                tracing::error!("ServeHealth reached the executor; ignored");
                None
            }
        }
    }

    /// Removes every rule of ours; nothing to do when no backend was ever chosen (this run
    /// installed nothing).
    async fn remove_rules(&self, tunnel: &str) -> Result<(), String> {
        let Some(backend) = self.backend else {
            return Ok(());
        };
        let tunnel = tunnel.to_string();
        let limits = self.limits.clone();
        let result = blocking(move || backend.remove(&tunnel, &limits)).await;
        match &result {
            Ok(()) => tracing::info!(backend = %backend, "Rules removed"),
            Err(e) => {
                tracing::error!(backend = %backend, error = %e, "Could not remove rules")
            }
        }
        result.map_err(|e| format!("{backend}: {e}"))
    }

    /// Removes whatever of ours an earlier run left, with the backend an apply would choose
    /// (the one that earlier run chose on this host); none to be had: nothing can be left.
    async fn sweep_rules(&self, tunnel: &str) -> Result<(), String> {
        let mode = self.firewall_mode;
        let limits = self.limits.clone();
        let tunnel = tunnel.to_string();
        blocking(move || match firewall::choose_within(mode, &limits) {
            Ok(backend) => backend
                .remove(&tunnel, &limits)
                .map_err(|e| format!("{backend}: {e}")),
            Err(_) => Ok(()),
        })
        .await
    }

    async fn set_addresses(
        &mut self,
        add: &[crate::config::IpNet],
        remove: &[crate::config::IpNet],
    ) -> Result<(), String> {
        if let Some(e) = self.mtu_error.take() {
            return Err(format!("setting the MTU: {e}"));
        }
        for net in remove {
            self.netlink
                .del_address(self.link_index, *net)
                .await
                .map_err(|e| e.to_string())?;
        }
        for net in add {
            self.netlink
                .add_address(self.link_index, *net)
                .await
                .map_err(|e| e.to_string())?;
        }
        if !add.is_empty() || !remove.is_empty() {
            tracing::info!(
                added = add.len(),
                removed = remove.len(),
                "Addresses applied"
            );
        }
        Ok(())
    }

    fn update_peers(&mut self, changes: &PeerChanges) {
        let change = self.dataplane.apply_peers(changes);
        tracing::info!(
            added = change.added.len(),
            removed = change.removed.len(),
            updated = change.updated.len(),
            reset = change.reset.len(),
            "Peers applied"
        );
    }

    /// Replaces the UDP sockets (new listen port); the old reader threads end with them.
    fn rebind(&mut self, port: u16, fwmark: Option<u32>) -> Result<u16, String> {
        let bound = self
            .dataplane
            .rebind(port, fwmark)
            .map_err(|e| format!("cannot bind UDP port {port}: {e}"))?;
        tracing::info!(listen_port = bound, "WireGuard socket rebound");
        Ok(bound)
    }

    /// Applies a route diff: policy rules removed, routes removed, routes added, policy rules
    /// added, in that order; within each step up to [`ROUTES_IN_FLIGHT`] requests at once on
    /// the one netlink socket (a start with 100,000 allowed IPs waited for 100,000 round trips
    /// one after the other).
    async fn apply_routes(&self, diff: &crate::core::routes::PlanDiff) -> Result<(), String> {
        let nl = &self.netlink;
        let index = self.link_index;
        // Each step's requests made a batch at a time (not lazily: closures held across the
        // await would make the event loop's future not `Send`; not all at once: 100,000
        // request futures are tens of megabytes).
        for batch in diff.remove_rules.chunks(ROUTES_BATCH) {
            all_of(batch.iter().map(|r| nl.del_rule(r)).collect()).await?;
        }
        for batch in diff.remove_routes.chunks(ROUTES_BATCH) {
            all_of(batch.iter().map(|r| nl.del_route(index, r)).collect()).await?;
        }
        for batch in diff.add_routes.chunks(ROUTES_BATCH) {
            all_of(batch.iter().map(|r| nl.add_route(index, r)).collect()).await?;
        }
        for batch in diff.add_rules.chunks(ROUTES_BATCH) {
            all_of(batch.iter().map(|r| nl.add_rule(r)).collect()).await?;
        }
        tracing::info!(
            added = diff.add_routes.len() + diff.add_rules.len(),
            removed = diff.remove_routes.len() + diff.remove_rules.len(),
            "Routes applied"
        );
        Ok(())
    }

    async fn apply_rules(
        &mut self,
        set: RuleSet,
        installed: Option<RuleSet>,
    ) -> Result<RulesReport, String> {
        let backend = match self.backend {
            Some(b) => b,
            None => {
                let mode = self.firewall_mode;
                let limits = self.limits.clone();
                let chosen = blocking(move || firewall::choose_within(mode, &limits)).await?;
                tracing::info!(backend = %chosen, "Firewall backend chosen");
                self.backend = Some(chosen);
                chosen
            }
        };
        let started = crate::shell::clock::now();
        let limits = self.limits.clone();
        blocking(move || {
            backend.apply(&set, installed.as_ref(), &limits)?;
            Ok::<_, firewall::FirewallError>(RulesReport {
                seconds: crate::shell::clock::since(started).as_secs_f64(),
                text: backend_text(backend, &set),
            })
        })
        .await
        .map_err(|e| format!("{backend}: {e}"))
    }

    /// Runs `f` on the shared forwarding state (made on first use) on a blocking thread: it
    /// takes a file lock another tunnelgate may hold, and writes sysctls and records.
    async fn with_forwarding<T: Send + 'static>(
        &mut self,
        interface: &str,
        f: impl FnOnce(&mut SharedForwarding) -> T + Send + 'static,
    ) -> Option<T> {
        let mut shared = self
            .forwarding
            .take()
            .unwrap_or_else(|| SharedForwarding::new(interface));
        match tokio::task::spawn_blocking(move || {
            let out = f(&mut shared);
            (shared, out)
        })
        .await
        {
            Ok((shared, out)) => {
                self.forwarding = Some(shared);
                Some(out)
            }
            // Logged by the runtime; a fresh state reads the records again.
            Err(e) => {
                tracing::error!(error = %e, "Forwarding sysctl task failed");
                None
            }
        }
    }

    /// The resolver for `nameservers`, made once and again only when they change.
    fn resolver(&mut self, nameservers: &[SocketAddr]) -> Result<Arc<Resolver>, String> {
        if let Some((ns, r)) = &self.resolver {
            if ns == nameservers {
                return Ok(r.clone());
            }
        }
        let r = Arc::new(Resolver::new(nameservers)?);
        self.resolver = Some((nameservers.to_vec(), r.clone()));
        Ok(r)
    }
}

/// Netlink requests of one route diff in flight at once. The kernel answers them in order and
/// applies each in microseconds: the round trip, not the kernel, bounded one at a time. A
/// window keeps the socket's receive buffer clear of a flood of answers.
const ROUTES_IN_FLIGHT: usize = 256;
/// Requests of one step made at once (a few windows' worth).
const ROUTES_BATCH: usize = 4 * ROUTES_IN_FLIGHT;

/// Awaits `requests`, up to [`ROUTES_IN_FLIGHT`] at once; the first error, once all that
/// started have answered.
async fn all_of<F>(requests: Vec<F>) -> Result<(), String>
where
    F: std::future::Future<Output = Result<(), crate::shell::netlink::NetlinkError>>,
{
    use futures::StreamExt as _;
    let mut answers = futures::stream::iter(requests).buffer_unordered(ROUTES_IN_FLIGHT);
    let mut first_error = None;
    while let Some(answer) = answers.next().await {
        if let (Err(e), None) = (answer, &first_error) {
            first_error = Some(e.to_string());
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Runs a firewall command off the async workers.
async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, String>
where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// The rule text for status: exactly what was applied for nftables.
fn backend_text(backend: Backend, set: &RuleSet) -> String {
    match backend {
        Backend::Nftables => crate::rules::nft::render(set),
        Backend::Iptables { .. } => [Family::V4, Family::V6]
            .iter()
            .map(|f| crate::rules::iptables::render(set, *f, &Default::default()))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}
