//! The proxy-group control loop: watch every Service the sidecar may list (cluster-wide, or the
//! namespaces it is given), keep those of its group, poll the base configuration, and bring this
//! replica's own Secret up to date when the rendering changes. Writes only on change; a Service
//! that cannot be served gets one Warning Event per distinct problem and never blocks the others.
//! What to render is decided by the pure [`crate::sidecar::group::render_group`].
//!
//! With a shared identity, each pass first reads the group's identity Secret; when there is none
//! it creates it (never overwriting: when another replica won the race, the API server answers
//! 409 AlreadyExists and this one reads the winner's key). Every replica renders that key, hands
//! it to its proxy container through the shared volume and keeps no copy of it in its own
//! Secret. The identity Secret is watched by name, so a new key (a rotation) reaches every
//! replica at once; a malformed one is refused and the running key stays. When it is deleted,
//! the running key stays for [`crate::sidecar::group::IDENTITY_RECREATE_AFTER`] (a rotation may
//! be creating it anew), then the Secret is created again with it.
//!
//! After each write, the served Services' target names are looked up in the background, in the
//! pod's DNS with the daemon's own resolver settings (the daemon's state is not visible from
//! here), and each Service whose names do not resolve gets a Warning Event: the daemon keeps the
//! replica Ready for the others (`health.readiness = "per-service"`), so the Event and the
//! daemon's status and metrics are where it shows.
//!
//! At scale: a burst of Service changes is written once (a [`DEBOUNCE`] after the last change, at
//! most [`MAX_DELAY`] after the first); Events go out after the write, in the background
//! ([`EventRecorder`]); the replica's own Secret is watched, so a deleted or edited Secret is put
//! back within seconds, with the key it had; the watches retry within a second
//! ([`WatchBackoff`]), so the group converges seconds after an API server outage.

use super::api::{
    describe_watch, secret_data, secret_write_failed, service_info, watch_forbidden, EventRecorder,
    ObjRef, PendingEvent, SecretStore, WatchBackoff,
};
use super::config_dir::{volume_files, ConfigDir};
use super::run::{
    read_base, BASE_CONFIG_POLL, REASON_INVALID, RESYNC_INTERVAL, RETRY_MAX, RETRY_MIN,
};
use crate::config::SecretKey;
use crate::core::dns::{MAX_CONCURRENT_RESOLUTIONS, RESOLVE_TIMEOUT};
use crate::shell::keys::GenerateKey as _;
use crate::shell::resolver::Resolver;
use crate::sidecar::group::{
    balancer_endpoint, group_key, identity_data, identity_step, is_balancer, is_member,
    render_group, with_group_key, Identity, IdentityStep, Replica,
};
use crate::sidecar::{changed_keys, stale_keys, Backoff, Rejected, ServiceInfo, KEY_PRIVATE};
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::{Api, Client};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

/// Event reason for a Service of the group that this replica leaves out.
pub const REASON_LEFT_OUT: &str = "TunnelgateServiceLeftOut";
/// Event reason for a Service of the group whose target name does not resolve.
pub const REASON_NAME_UNRESOLVED: &str = "TunnelgateNameUnresolved";
/// Event reason, on the replica's pod, for a group with more Services than its Secret can hold.
pub const REASON_OVER_LIMIT: &str = "TunnelgateConfigOverLimit";

/// A change is written this long after the last change of a burst...
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// ...and at most this long after the first one, however long the burst goes on.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// When a pending change is written: [`DEBOUNCE`] after the `last` change, but no later than
/// [`MAX_DELAY`] after the `first`.
pub fn write_at(first: Instant, last: Instant) -> Instant {
    (last + DEBOUNCE).min(first + MAX_DELAY)
}

/// What a replica of a proxy group works on.
#[derive(Debug, Clone)]
pub struct GroupSettings {
    pub replica: Replica,
    /// This replica's own config Secret.
    pub secret: ObjRef,
    /// With a shared identity: the group's identity Secret, `$POD_NAMESPACE/<group>-identity`.
    pub identity: Option<ObjRef>,
    /// The pod, for Events about the replica itself (bad base config, pool too small).
    pub pod: Option<ObjRef>,
    /// Empty: every namespace (a cluster-wide list and watch).
    pub namespaces: Vec<String>,
    pub base_config: PathBuf,
    /// The directory shared with the proxy container, if any: each Secret content that is
    /// written (or found up to date) is handed over there too, after the Secret holds it.
    pub config_dir: Option<PathBuf>,
}

type Key = (String, String);

/// A Service of the group as last seen, with its uid for Events.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    /// Boxed: the map's nodes, half empty, then hold a pointer instead of the whole Service.
    info: Box<ServiceInfo>,
    uid: Option<String>,
}

/// One watch: a namespace, or `None` for all of them.
type Scoped = (
    Option<String>,
    Result<watcher::Event<Service>, watcher::Error>,
);

struct GroupLoop {
    events: EventRecorder,
    settings: GroupSettings,
    secret: SecretStore,
    members: BTreeMap<Key, Member>,
    /// Per watch scope: the list being received since its last `Init`.
    relisting: BTreeMap<Option<String>, BTreeMap<Key, Member>>,
    /// Watch scopes whose first list is complete; nothing is written before all are.
    synced: Vec<Option<String>>,
    base: Result<String, String>,
    /// Problems last reported, per Service, so a persisting one is reported once.
    reported: BTreeMap<Key, String>,
    /// A problem of the replica itself last reported.
    reported_replica: Option<String>,
    backoff: Backoff,
    checks: NameChecks,
    /// What this sidecar last wrote (or found up to date): a watch event showing anything else
    /// is an edit or a deletion to repair.
    written: Option<BTreeMap<String, Vec<u8>>>,
    /// The private key last seen in the Secret: a deleted Secret comes back with it. (Deleting
    /// only the key from the Secret still asks for a new one.)
    known_key: Option<Vec<u8>>,
    /// With a shared identity: the group's identity Secret.
    identity: Option<SecretStore>,
    /// The group key last read or created: a deleted identity Secret is created again with it,
    /// so the replicas that are running keep one key.
    known_group_key: Option<SecretKey>,
    /// Since when the identity Secret has been seen missing (while a key runs).
    identity_missing_since: Option<Instant>,
    /// When to look at a missing identity Secret again (and create it with the running key).
    identity_recheck_at: Option<Instant>,
    /// The over-limit problem last said on the pod.
    reported_over_limit: Option<String>,
    /// With a shared identity: the group balancer's endpoint and problems last said.
    reported_balancer: (Option<String>, Vec<String>),
    /// The directory shared with the proxy container, if any.
    config_dir: Option<ConfigDir>,
}

/// The background check of the served Services' target names.
#[derive(Debug, Default)]
struct NameChecks {
    /// From the last rendering written (or found up to date): `NS/NAME` -> its names. Shared
    /// with the running check, not copied for it (20,000 Services' names).
    names: Arc<BTreeMap<String, Vec<String>>>,
    nameservers: Vec<SocketAddr>,
    every: Duration,
    /// When the next check starts (once the running one, if any, is done); `None` with
    /// nothing to check, or while one runs and nothing changed since it started.
    next: Option<Instant>,
    running: bool,
    /// Per Service (`NS/NAME`): the unresolved names its last Event named.
    reported: BTreeMap<String, Vec<String>>,
}

/// What one check looked at, and each name's answer.
struct Checked {
    names: Arc<BTreeMap<String, Vec<String>>>,
    answers: BTreeMap<String, Result<(), String>>,
}

impl NameChecks {
    /// Takes a new rendering's names; a change is checked at once, else on the schedule.
    fn rendered(
        &mut self,
        names: BTreeMap<String, Vec<String>>,
        nameservers: Vec<SocketAddr>,
        every: Duration,
    ) {
        let changed = names != *self.names || nameservers != self.nameservers;
        self.names = Arc::new(names);
        self.nameservers = nameservers;
        self.every = every;
        // A Service no longer served is no longer reported on.
        self.reported
            .retain(|service, _| self.names.contains_key(service));
        if self.names.is_empty() {
            self.next = None;
        } else if changed || (self.next.is_none() && !self.running) {
            self.next = Some(crate::shell::clock::tokio_now());
        }
    }

    fn started(&mut self) {
        self.running = true;
        self.next = None;
    }

    /// The next check: one asked for while this one ran, else one interval from now.
    fn finished(&mut self) {
        self.running = false;
        if !self.names.is_empty() {
            self.next = self
                .next
                .or(Some(crate::shell::clock::tokio_now() + self.every));
        }
    }
}

/// Runs until `shutdown` completes; errors only if a watch stream ends, which it never should.
pub async fn run_group(
    client: Client,
    settings: GroupSettings,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let scopes: Vec<Option<String>> = if settings.namespaces.is_empty() {
        vec![None]
    } else {
        settings.namespaces.iter().cloned().map(Some).collect()
    };
    let streams: Vec<Pin<Box<dyn Stream<Item = Scoped> + Send>>> = scopes
        .iter()
        .map(|scope| {
            let api: Api<Service> = match scope {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::all(client.clone()),
            };
            let scope = scope.clone();
            watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::default())
                .map(move |e| (scope.clone(), e))
                .boxed()
        })
        .collect();
    let mut watch = futures::stream::select_all(streams);
    let secret = SecretStore::new(client.clone(), settings.secret.clone());
    // Its own Secret, by name (RBAC can limit list and watch to it with resourceNames).
    let mut secret_watch = watcher(
        secret.api(),
        watcher::Config::default().fields(&format!("metadata.name={}", settings.secret.name)),
    )
    .backoff(WatchBackoff::default())
    .boxed();
    let config_dir = settings.config_dir.clone().map(ConfigDir::open);
    let identity = settings
        .identity
        .clone()
        .map(|obj| SecretStore::new(client.clone(), obj));
    // The group's identity Secret, by name (RBAC can limit list and watch to it): a new key
    // reaches this replica at once, not at the next resync.
    let mut identity_watch = match &settings.identity {
        Some(obj) => watcher(
            Api::<Secret>::namespaced(client.clone(), &obj.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", obj.name)),
        )
        .backoff(WatchBackoff::default())
        .boxed(),
        None => futures::stream::pending().boxed(),
    };
    let mut this = GroupLoop {
        identity,
        known_group_key: None,
        identity_missing_since: None,
        identity_recheck_at: None,
        config_dir,
        secret,
        events: EventRecorder::start(client),
        base: read_base(&settings.base_config).await,
        settings,
        members: BTreeMap::new(),
        relisting: BTreeMap::new(),
        synced: Vec::new(),
        reported: BTreeMap::new(),
        reported_replica: None,
        backoff: Backoff::new(RETRY_MIN, RETRY_MAX),
        checks: NameChecks::default(),
        written: None,
        known_key: None,
        reported_balancer: (None, Vec::new()),
        reported_over_limit: None,
    };
    tracing::info!(
        proxy_group = %this.settings.replica.group,
        ordinal = this.settings.replica.ordinal,
        secret = %this.settings.secret,
        identity = %this.settings.replica.identity,
        identity_secret = %this.settings.identity.as_ref().map_or("none".into(), ToString::to_string),
        namespaces = %if this.settings.namespaces.is_empty() { "all".to_string() } else { this.settings.namespaces.join(",") },
        base_config = %this.settings.base_config.display(),
        config_dir = %this.settings.config_dir.as_deref().map_or("none".into(), |d| d.display().to_string()),
        "Sidecar started for a proxy group"
    );
    let mut base_tick = tokio::time::interval(BASE_CONFIG_POLL);
    let mut resync = tokio::time::interval(RESYNC_INTERVAL);
    for t in [&mut base_tick, &mut resync] {
        t.set_missed_tick_behavior(MissedTickBehavior::Delay);
        t.reset();
    }
    // A change not written yet: when the first and the last of its burst came.
    let mut pending: Option<(Instant, Instant)> = None;
    let mark = |pending: &mut Option<(Instant, Instant)>| {
        let now = crate::shell::clock::tokio_now();
        *pending = Some(pending.map_or((now, now), |(first, _)| (first, now)));
    };
    let mut retry_at: Option<Instant> = None;
    // The running name check: a task of its own, so a slow name server never delays a write.
    let mut check: Option<tokio::task::JoinHandle<Checked>> = None;
    tokio::pin!(shutdown);
    loop {
        let synced = scopes.iter().all(|s| this.synced.contains(s));
        let due = pending
            .filter(|_| synced && retry_at.is_none())
            .map(|(first, last)| write_at(first, last));
        if due.is_some_and(|at| at <= crate::shell::clock::tokio_now()) {
            pending = None;
            if let Some(delay) = this.pass().await {
                retry_at = Some(crate::shell::clock::tokio_now() + delay);
            }
            continue;
        }
        let write_due = async {
            match due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let check_at = this.checks.next.filter(|_| check.is_none());
        let check_due = async {
            match check_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let identity_recheck = async {
            match this.identity_recheck_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let checked = async {
            match check.as_mut() {
                Some(task) => task.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut shutdown => {
                tracing::info!("Sidecar stopping");
                return Ok(());
            }
            () = write_due => {}
            event = watch.next() => match event {
                Some((scope, Ok(e))) => if this.seen(scope, e) { mark(&mut pending) },
                Some((scope, Err(e))) if watch_forbidden(&e) => tracing::error!(
                    error = %describe_watch(&e),
                    namespace = %scope.as_deref().unwrap_or("all"),
                    "Watch of the Services refused: retrying (the sidecar needs list and watch on services{})",
                    if scope.is_none() { " cluster-wide, or --namespace" } else { " in this namespace" }
                ),
                Some((scope, Err(e))) => tracing::warn!(
                    error = %describe_watch(&e),
                    namespace = %scope.as_deref().unwrap_or("all"),
                    "Watch of the Services failed: retrying"
                ),
                None => anyhow::bail!("the watch of the Services ended"),
            },
            event = secret_watch.next() => match event {
                Some(Ok(e)) => {
                    // The Secret exists (again): a write waiting out a refusal (a deleted Secret
                    // without RBAC create) is tried now.
                    let exists = matches!(e, watcher::Event::Apply(_));
                    if this.secret_seen(e) || (exists && retry_at.is_some()) {
                        retry_at = None;
                        mark(&mut pending);
                    }
                }
                Some(Err(e)) if watch_forbidden(&e) => tracing::warn!(
                    error = %describe_watch(&e),
                    secret = %this.settings.secret,
                    "Watch of the replica's Secret refused: an edit or a deletion is repaired only at the next resync (the sidecar needs list and watch on this Secret)"
                ),
                Some(Err(e)) => tracing::debug!(error = %describe_watch(&e), "Watch of the replica's Secret failed: retrying"),
                None => anyhow::bail!("the watch of the Secret ended"),
            },
            event = identity_watch.next() => match event {
                // A new key (or a malformed one, or the Secret gone): a pass now, even while a
                // retry waits out a refusal of the old content.
                Some(Ok(e)) => if this.identity_seen(e) {
                    retry_at = None;
                    mark(&mut pending);
                },
                Some(Err(e)) if watch_forbidden(&e) => tracing::warn!(
                    error = %describe_watch(&e),
                    secret = %this.settings.identity.as_ref().map_or(String::new(), ToString::to_string),
                    "Watch of the group identity Secret refused: a new key reaches this replica only at its next pass (the sidecar needs list and watch on this Secret)"
                ),
                Some(Err(e)) => tracing::debug!(error = %describe_watch(&e), "Watch of the group identity Secret failed: retrying"),
                None => anyhow::bail!("the watch of the group identity Secret ended"),
            },
            () = identity_recheck => {
                this.identity_recheck_at = None;
                mark(&mut pending);
            }
            _ = base_tick.tick() => {
                let base = read_base(&this.settings.base_config).await;
                if base != this.base {
                    tracing::info!(path = %this.settings.base_config.display(), "Base config changed");
                    this.base = base;
                    mark(&mut pending);
                }
            }
            _ = resync.tick() => mark(&mut pending),
            () = retry => {
                retry_at = None;
                mark(&mut pending);
            }
            () = check_due => {
                this.checks.started();
                check = Some(tokio::spawn(check_names(
                    this.checks.names.clone(),
                    this.checks.nameservers.clone(),
                )));
            }
            done = checked => {
                check = None;
                this.checks.finished();
                match done {
                    Ok(done) => this.names_checked(done),
                    Err(e) => tracing::warn!(error = %e, "The check of the Services' names failed"),
                }
            }
        }
    }
}

/// Looks up every name of `names` in the pod's DNS, as the daemon does (its resolver, its
/// `dns.nameservers`, its deadline per lookup, at most as many at once).
async fn check_names(
    names: Arc<BTreeMap<String, Vec<String>>>,
    nameservers: Vec<SocketAddr>,
) -> Checked {
    let unique: BTreeSet<String> = names.values().flatten().cloned().collect();
    let resolver = match Resolver::new(&nameservers) {
        Ok(r) => r,
        Err(e) => {
            // Not one Service's problem: the daemon cannot resolve either, and says so.
            tracing::error!(error = %e, "Cannot check the Services' names: no resolver");
            return Checked {
                names,
                answers: BTreeMap::new(),
            };
        }
    };
    let resolver = &resolver;
    let answers = futures::stream::iter(unique)
        .map(|name| async move {
            let deadline = crate::shell::clock::now() + RESOLVE_TIMEOUT;
            let answer = match resolver.resolve(&name, deadline).await {
                Ok(addrs) if addrs.is_empty() => Err("no addresses in the answer".to_string()),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            (name, answer)
        })
        .buffer_unordered(MAX_CONCURRENT_RESOLUTIONS)
        .collect()
        .await;
    Checked { names, answers }
}

impl GroupLoop {
    fn member(&self, svc: &Service) -> Option<(Key, Member)> {
        let mut info = service_info(svc);
        info.keep_what_a_group_reads();
        // With a shared identity the group's balancer too: its address is the group's
        // endpoint (render_group reads only members).
        let group = &self.settings.replica.group;
        let balancer =
            self.settings.replica.identity == Identity::Shared && is_balancer(&info, group);
        (is_member(&info, group) || balancer).then(|| {
            (
                (info.namespace.clone(), info.name.clone()),
                Member {
                    uid: svc.metadata.uid.clone(),
                    info: Box::new(info),
                },
            )
        })
    }

    fn key_of(svc: &Service) -> Key {
        (
            svc.metadata.namespace.clone().unwrap_or_default(),
            svc.metadata.name.clone().unwrap_or_default(),
        )
    }

    /// Takes in one watch event; true when the group's Services changed.
    fn seen(&mut self, scope: Option<String>, event: watcher::Event<Service>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relisting.insert(scope, BTreeMap::new());
                false
            }
            watcher::Event::InitApply(svc) => {
                if let Some((k, m)) = self.member(&svc) {
                    self.relisting.entry(scope).or_default().insert(k, m);
                }
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.remove(&scope).unwrap_or_default();
                let mut next: BTreeMap<Key, Member> = self
                    .members
                    .iter()
                    .filter(|((ns, _), _)| scope.as_ref().is_some_and(|s| s != ns))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                next.extend(listed);
                if !self.synced.contains(&scope) {
                    self.synced.push(scope);
                }
                self.replace(next)
            }
            // One Service: changed in place (a copy of every member per event would cost
            // O(Services) each, at 10,000 Services a burst's worth of copies).
            watcher::Event::Apply(svc) => match self.member(&svc) {
                Some((k, m)) => {
                    if self.members.get(&k) == Some(&m) {
                        return false;
                    }
                    if !self.members.contains_key(&k) {
                        tracing::info!(service = %format!("{}/{}", k.0, k.1), "Service joined the proxy group");
                    }
                    self.members.insert(k, m);
                    true
                }
                // It left the group (its annotation changed).
                None => self.remove(&Self::key_of(&svc)),
            },
            watcher::Event::Delete(svc) => self.remove(&Self::key_of(&svc)),
        }
    }

    fn remove(&mut self, k: &Key) -> bool {
        if self.members.remove(k).is_none() {
            return false;
        }
        tracing::info!(service = %format!("{}/{}", k.0, k.1), "Service left the proxy group");
        self.reported.remove(k);
        self.checks.reported.remove(&format!("{}/{}", k.0, k.1));
        true
    }

    /// Takes in one event of the replica's own Secret; true when it no longer holds what this
    /// sidecar wrote (edited, or deleted), so it must be written again.
    fn secret_seen(&mut self, event: watcher::Event<Secret>) -> bool {
        let data = match event {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => Some(secret_data(&s)),
            watcher::Event::Delete(_) => None,
            watcher::Event::Init | watcher::Event::InitDone => return false,
        };
        // With a shared identity the Secret holds no key of the replica's own.
        if !self.shared() {
            if let Some(key) = data.as_ref().and_then(|d| d.get(KEY_PRIVATE)) {
                self.known_key = Some(key.clone());
            }
        }
        let Some(written) = &self.written else {
            return false; // nothing written yet: the first pass reads it anyway
        };
        // A key added that this sidecar does not write (the group's key copied back in) counts.
        let intact = data.as_ref().is_some_and(|d| {
            changed_keys(written, d).is_empty() && stale_keys(written, d).is_empty()
        });
        if !intact {
            tracing::warn!(
                secret = %self.settings.secret,
                deleted = data.is_none(),
                "The replica's Secret was changed by someone else: writing it again"
            );
            self.written = None;
        }
        !intact
    }

    fn shared(&self) -> bool {
        self.settings.replica.identity == Identity::Shared
    }

    /// Takes in one event of the group's identity Secret; true when a pass must look at it: it
    /// holds another key than the one running (a rotation), a malformed one, or it is gone.
    fn identity_seen(&mut self, event: watcher::Event<Secret>) -> bool {
        let data = match event {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => secret_data(&s),
            watcher::Event::Delete(_) => {
                if self.known_group_key.is_some() {
                    let now = crate::shell::clock::tokio_now();
                    self.identity_missing_since.get_or_insert(now);
                }
                return true;
            }
            watcher::Event::Init | watcher::Event::InitDone => return false,
        };
        let name = self
            .settings
            .identity
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let seen = group_key(&name, Some(&data));
        seen != Ok(self.known_group_key.clone())
    }

    fn replace(&mut self, next: BTreeMap<Key, Member>) -> bool {
        if next == self.members {
            return false;
        }
        log_membership(
            "joined",
            membership_log(next.keys().filter(|k| !self.members.contains_key(*k))),
        );
        log_membership(
            "left",
            membership_log(self.members.keys().filter(|k| !next.contains_key(*k))),
        );
        for k in self.members.keys().filter(|k| !next.contains_key(*k)) {
            self.reported.remove(k);
            self.checks.reported.remove(&format!("{}/{}", k.0, k.1));
        }
        self.members = next;
        true
    }

    /// One reconcile pass; `Some(delay)` asks for a retry after it.
    async fn pass(&mut self) -> Option<Duration> {
        match self.reconcile().await {
            Ok(()) => {
                if self.reported_replica.take().is_some() {
                    tracing::info!("Replica configuration is valid again");
                }
                self.backoff.reset();
                None
            }
            Err(Failure::Rejected(r)) => {
                self.backoff.reset();
                self.report_replica(r);
                None
            }
            Err(Failure::Identity(r)) => {
                self.report_replica(r);
                Some(self.backoff.next_delay())
            }
            Err(Failure::IdentityApi(e)) => {
                let identity = self.settings.identity.as_ref();
                Some(secret_write_failed(
                    &e,
                    identity.unwrap_or(&self.settings.secret),
                    &mut self.backoff,
                ))
            }
            Err(Failure::Api(e)) => Some(secret_write_failed(
                &e,
                &self.settings.secret,
                &mut self.backoff,
            )),
            Err(Failure::Volume(e)) => {
                let delay = self.backoff.next_delay();
                tracing::error!(
                    error = %e,
                    retry_in = ?delay,
                    "Cannot hand the configuration over to the proxy container: retrying"
                );
                Some(delay)
            }
        }
    }

    async fn reconcile(&mut self) -> Result<(), Failure> {
        let base = self
            .base
            .clone()
            .map_err(|e| Failure::Rejected(Rejected(vec![e])))?;
        // What the Secret holds; deleted, it comes back with the key it had, if this sidecar
        // saw it (per replica: with a shared identity `known_key` stays empty).
        let stored = match self
            .secret
            .data_if_exists()
            .await
            .map_err(|e| Failure::Api(Box::new(e)))?
        {
            Some(data) => data,
            None => self
                .known_key
                .iter()
                .map(|k| (KEY_PRIVATE.to_string(), k.clone()))
                .collect(),
        };
        let group_key = self.group_key().await?;
        // Rendering reads the key from here: the group's in place of any the Secret holds.
        let current = match &group_key {
            Some(key) => std::borrow::Cow::Owned(with_group_key(&stored, key)),
            None => std::borrow::Cow::Borrowed(&stored),
        };
        let replica = Replica {
            endpoint: self.balancer_endpoint(),
            ..self.settings.replica.clone()
        };
        let out = render_group(
            &replica,
            self.members.values().map(|m| &*m.info),
            &base,
            &current,
            SecretKey::generate,
        )
        .map_err(Failure::Rejected)?;
        drop(current);
        if let Some(key) = out.rendered.data.get(KEY_PRIVATE) {
            self.known_key = Some(key.clone());
        }
        for note in &out.rendered.notes {
            tracing::info!(note = %note, "Rendering note");
        }
        // A key this sidecar no longer sends must go too: the config's other form (plain after
        // gz, or gz after plain), or, with a shared identity, a copy of the group's key that an
        // older version wrote. The apply drops what only it owned; the rest is removed after it.
        let stale = stale_keys(&out.rendered.data, &stored);
        let changed = changed_keys(&out.rendered.data, &stored).join(",");
        if changed.is_empty() && stale.is_empty() {
            tracing::debug!(secret = %self.settings.secret, "Secret is up to date");
            self.hand_over(&out.rendered.data, group_key.as_ref())?;
            self.written = Some(out.rendered.data);
            self.checks
                .rendered(out.names, out.nameservers, out.reresolve_interval);
            self.report_refusals(&out.refused, out.over_limit);
            return Ok(());
        }
        let written = self.secret.apply(&out.rendered.data).await;
        // Events after the write, and whether or not it worked: never before it.
        self.report_refusals(&out.refused, out.over_limit);
        let held = written.map_err(|e| Failure::Api(Box::new(e)))?;
        let left = stale_keys(&out.rendered.data, &held);
        if !left.is_empty() {
            self.secret
                .remove_keys(&left)
                .await
                .map_err(|e| Failure::Api(Box::new(e)))?;
        }
        // The Secret (or, with a shared identity, the identity Secret) holds the key now: only
        // then may the proxy start using it.
        let handed = self.hand_over(&out.rendered.data, group_key.as_ref());
        self.written = Some(out.rendered.data);
        self.checks
            .rendered(out.names, out.nameservers, out.reresolve_interval);
        tracing::info!(
            secret = %self.settings.secret,
            keys = %changed,
            removed = %stale.join(","),
            generated_key = out.rendered.generated_key,
            services = out.served.len(),
            left_out = out.refused.len(),
            "Secret updated"
        );
        handed
    }

    /// With a shared identity, where peers reach the group: its balancer's address, said in the
    /// log when it changes (and its problems, once each). `None` in a per-replica group.
    fn balancer_endpoint(&mut self) -> Option<String> {
        if self.settings.replica.identity != Identity::Shared {
            return None;
        }
        let (endpoint, problems) = balancer_endpoint(
            self.members.values().map(|m| &*m.info),
            &self.settings.replica.group,
        );
        let (said_endpoint, said_problems) = &self.reported_balancer;
        for problem in problems.iter().filter(|p| !said_problems.contains(p)) {
            tracing::warn!(problem = %problem, "Group balancer");
        }
        if *said_endpoint != endpoint {
            match &endpoint {
                Some(e) => tracing::info!(
                    endpoint = %e,
                    "Peers reach the group at its balancer's address: the Endpoint of their [Peer] section (`tunnelgate check` prints the section)"
                ),
                None => tracing::info!(
                    annotation = crate::sidecar::group::ANNOTATION_GROUP_BALANCER,
                    "No group balancer address (yet): no Service so annotated, or its load balancer has none"
                ),
            }
        }
        self.reported_balancer = (endpoint.clone(), problems);
        endpoint
    }

    /// With a shared identity, the group's key: read from its identity Secret, or, when there is
    /// none, created there (with the key this replica runs, else a new one). When the API server
    /// answers that another replica created it meanwhile, that one's key is read and used. A
    /// Secret that holds no usable key is refused, never overwritten, and the running key stays.
    /// A Secret seen missing while a key runs is created again only
    /// [`crate::sidecar::group::IDENTITY_RECREATE_AFTER`] later (the running key stays
    /// meanwhile): a rotation may be creating it with a new key.
    async fn group_key(&mut self) -> Result<Option<SecretKey>, Failure> {
        let Some(store) = &self.identity else {
            return Ok(None);
        };
        let name = self
            .settings
            .identity
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let api = |e| Failure::IdentityApi(Box::new(e));
        let refused = |e| Failure::Identity(Rejected(vec![e]));
        let found = store.data_if_exists().await.map_err(api)?;
        let now = crate::shell::clock::tokio_now();
        if found.is_some() {
            self.identity_missing_since = None;
            self.identity_recheck_at = None;
        } else if self.known_group_key.is_some() {
            self.identity_missing_since.get_or_insert(now);
        }
        let missing_for = self
            .identity_missing_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        let step = identity_step(
            &name,
            found.as_ref(),
            self.known_group_key.as_ref(),
            missing_for,
            SecretKey::generate,
        )
        .map_err(refused)?;
        let key = match step {
            IdentityStep::Use(key) => key,
            IdentityStep::Wait { key, remaining } => {
                if self.identity_recheck_at.is_none() {
                    tracing::warn!(
                        secret = %name,
                        recreate_in = ?remaining,
                        "Group identity Secret is missing: running the group's key meanwhile; it is created again with that key unless someone creates it first (a rotation: then its key is taken)"
                    );
                }
                self.identity_recheck_at = Some(now + remaining);
                key
            }
            IdentityStep::Create { key, recreated } => {
                if store.create(&identity_data(&key)).await.map_err(api)? {
                    tracing::info!(
                        secret = %name,
                        public_key = %key.public_key().to_base64(),
                        recreated,
                        "Group identity Secret created: every replica of the group runs with this key"
                    );
                    self.identity_missing_since = None;
                    key
                } else {
                    // Another replica created it between the read and the create: its key stands.
                    let theirs = store.data_if_exists().await.map_err(api)?;
                    let key = group_key(&name, theirs.as_ref()).map_err(refused)?;
                    let Some(key) = key else {
                        return Err(refused(format!(
                            "group identity Secret {name} already exists, the API server says, but reading it found none"
                        )));
                    };
                    tracing::info!(
                        secret = %name,
                        public_key = %key.public_key().to_base64(),
                        "Group identity Secret was created by another replica first: using its key"
                    );
                    self.identity_missing_since = None;
                    key
                }
            }
        };
        if self.known_group_key.as_ref() != Some(&key) {
            tracing::info!(
                secret = %name,
                public_key = %key.public_key().to_base64(),
                rotated = self.known_group_key.is_some(),
                "Running with the group's shared identity: peers configure one peer with this public key, and the group's UDP load balancer as its Endpoint"
            );
            self.known_group_key = Some(key.clone());
        }
        Ok(Some(key))
    }

    /// Writes what the Secret now holds to the shared directory, when it differs from what is
    /// there, with `group_key` as the key when the replica runs the group's shared identity.
    /// Called only once the Secret holds it, so the proxy never runs a key that is not kept in
    /// the API (a replica that comes back must find it).
    fn hand_over(
        &mut self,
        data: &BTreeMap<String, Vec<u8>>,
        group_key: Option<&SecretKey>,
    ) -> Result<(), Failure> {
        let Some(dir) = &mut self.config_dir else {
            return Ok(());
        };
        let files = volume_files(data, group_key).map_err(Failure::Volume)?;
        let wrote = dir
            .update(files)
            .map_err(|e| Failure::Volume(format!("{}: {e}", dir.path().display())))?;
        if wrote {
            tracing::info!(dir = %dir.path().display(), "Configuration handed over to the proxy container");
        }
        Ok(())
    }

    /// A Warning Event on each Service left out, once per distinct reason, and on the pod when
    /// the group does not fit its Secret; queued, so they never delay a write.
    fn report_refusals(
        &mut self,
        refused: &[crate::sidecar::group::Refusal],
        over_limit: Option<String>,
    ) {
        if over_limit != self.reported_over_limit {
            match (&over_limit, &self.settings.pod) {
                (Some(text), Some(pod)) => {
                    tracing::error!(problem = %text, "Not every Service of the group fits the config Secret");
                    self.events.record(PendingEvent {
                        kind: "Pod",
                        object: pod.clone(),
                        uid: None,
                        reason: REASON_OVER_LIMIT,
                        message: text.clone(),
                    });
                }
                (Some(text), None) => {
                    tracing::error!(problem = %text, "Not every Service of the group fits the config Secret")
                }
                (None, _) => {
                    tracing::info!("Every Service of the group fits the config Secret again")
                }
            }
            self.reported_over_limit = over_limit;
        }
        let now: BTreeMap<Key, &str> = refused
            .iter()
            .map(|r| ((r.namespace.clone(), r.name.clone()), r.reason.as_str()))
            .collect();
        self.reported.retain(|k, _| now.contains_key(k));
        for (k, reason) in now {
            if self.reported.get(&k).map(String::as_str) == Some(reason) {
                continue;
            }
            tracing::error!(service = %format!("{}/{}", k.0, k.1), problem = %reason, "Service left out of the proxy group");
            let uid = self.members.get(&k).and_then(|m| m.uid.clone());
            let obj = ObjRef {
                namespace: k.0.clone(),
                name: k.1.clone(),
            };
            let text = format!(
                "not served by {} (replica {} of proxy group {}): {reason}",
                self.settings.secret, self.settings.replica.ordinal, self.settings.replica.group
            );
            self.events.record(PendingEvent {
                kind: "Service",
                object: obj,
                uid,
                reason: REASON_LEFT_OUT,
                message: text,
            });
            self.reported.insert(k, reason.to_string());
        }
    }

    /// After a check: a Warning Event on each served Service whose names do not resolve, once
    /// per distinct set of names. Recorded in the background: an Event never delays a write.
    fn names_checked(&mut self, checked: Checked) {
        let unresolved =
            crate::sidecar::group::unresolved_services(&checked.names, &checked.answers);
        tracing::debug!(
            services = checked.names.len(),
            unresolved = unresolved.len(),
            "Services' names checked"
        );
        let checks = &mut self.checks;
        checks.reported.retain(|service, _| {
            let still = unresolved.contains_key(service) || !checked.names.contains_key(service);
            if !still {
                tracing::info!(service = %service, "The Service's names resolve again");
            }
            still
        });
        for (service, failed) in unresolved {
            // A Service that left while the check ran is not reported on.
            if !checks.names.contains_key(&service) {
                continue;
            }
            let names: Vec<String> = failed.iter().map(|(n, _)| n.clone()).collect();
            if checks.reported.get(&service) == Some(&names) {
                continue;
            }
            let problems: Vec<String> = failed.iter().map(|(n, e)| format!("{n} ({e})")).collect();
            tracing::warn!(service = %service, names = %problems.join(", "), "A Service's target name does not resolve");
            checks.reported.insert(service.clone(), names);
            let Some((ns, name)) = service.split_once('/') else {
                continue; // a label of the base config's own, not a Service
            };
            let key = (ns.to_string(), name.to_string());
            let Some(member) = self.members.get(&key) else {
                continue;
            };
            let text = format!(
                "target name {} does not resolve in the DNS of {} (replica {} of proxy group {}): this Service's rules wait for it (the proxy retries); the replica stays Ready for the group's other Services",
                problems.join(", "),
                self.settings.secret,
                self.settings.replica.ordinal,
                self.settings.replica.group
            );
            let obj = ObjRef {
                namespace: key.0,
                name: key.1,
            };
            self.events.record(PendingEvent {
                kind: "Service",
                object: obj,
                uid: member.uid.clone(),
                reason: REASON_NAME_UNRESOLVED,
                message: text,
            });
        }
    }

    /// Logs a problem of the replica itself once, with a Warning Event on its pod.
    fn report_replica(&mut self, r: Rejected) {
        let message = r.to_string();
        if self.reported_replica.as_deref() == Some(message.as_str()) {
            tracing::debug!(problem = %message, "Replica configuration still invalid");
            return;
        }
        tracing::error!(problem = %message, secret = %self.settings.secret, "Not writing an invalid configuration: keeping the last good Secret");
        if let Some(pod) = &self.settings.pod {
            let text = format!("tunnelgate config not updated, the last good one stays: {message}");
            self.events.record(PendingEvent {
                kind: "Pod",
                object: pod.clone(),
                uid: None,
                reason: REASON_INVALID,
                message: text,
            });
        }
        self.reported_replica = Some(message);
    }
}

/// Up to this many Services that join (or leave) in one listing are logged one line each; more
/// are one summary line, so a start at 20,000 Services logs one line, not 20,000.
const MEMBERSHIP_LINES_MAX: usize = 5;

/// How one listing's joins (or leaves) are logged.
#[derive(Debug, PartialEq, Eq)]
enum MembershipLog {
    /// One line per Service (`NAMESPACE/NAME`).
    Each(Vec<String>),
    /// "N Services joined", naming the first few.
    Summary { count: usize, first: Vec<String> },
}

fn membership_log<'a>(keys: impl Iterator<Item = &'a Key> + Clone) -> MembershipLog {
    let name = |k: &Key| format!("{}/{}", k.0, k.1);
    let count = keys.clone().count();
    if count <= MEMBERSHIP_LINES_MAX {
        MembershipLog::Each(keys.map(name).collect())
    } else {
        MembershipLog::Summary {
            count,
            first: keys.take(3).map(name).collect(),
        }
    }
}

/// `change`: "joined" or "left".
fn log_membership(change: &str, log: MembershipLog) {
    match log {
        MembershipLog::Each(services) => {
            for service in services {
                tracing::info!(service = %service, "Service {change} the proxy group");
            }
        }
        MembershipLog::Summary { count, first } => tracing::info!(
            count,
            first = %first.join(", "),
            "{count} Services {change} the proxy group"
        ),
    }
}

/// Why a pass did not finish.
enum Failure {
    Rejected(Rejected),
    /// The group's identity Secret holds no usable key: nothing is written, and it is read
    /// again after a backoff (someone may fix or delete it).
    Identity(Rejected),
    /// Reading or creating the group's identity Secret failed.
    IdentityApi(Box<kube::Error>),
    Api(Box<kube::Error>),
    /// The shared directory could not be written.
    Volume(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_written_after_its_last_change_but_never_later_than_max_delay() {
        let t = crate::shell::clock::tokio_now();
        let ms = Duration::from_millis;
        // A lone change: one debounce later.
        assert_eq!(write_at(t, t), t + DEBOUNCE);
        // Changes keep coming: each one pushes the write back...
        assert_eq!(write_at(t, t + ms(300)), t + ms(300) + DEBOUNCE);
        // ...until the first has waited MAX_DELAY.
        assert_eq!(write_at(t, t + ms(950)), t + MAX_DELAY);
        assert_eq!(write_at(t, t + ms(5_000)), t + MAX_DELAY);
    }

    /// A start at 20,000 Services logs one summary line, not one line per Service; a few
    /// changes (a relist after an outage) still name each Service.
    #[test]
    fn a_listing_of_many_services_is_logged_as_one_summary_line() {
        let keys: Vec<Key> = (0..20_000)
            .map(|i| (format!("ns{}", i % 20), format!("svc{i:05}")))
            .collect();
        assert_eq!(
            membership_log(keys.iter()),
            MembershipLog::Summary {
                count: 20_000,
                first: vec![
                    "ns0/svc00000".to_string(),
                    "ns1/svc00001".to_string(),
                    "ns2/svc00002".to_string()
                ],
            }
        );
        assert_eq!(
            membership_log(keys.iter().take(2)),
            MembershipLog::Each(vec!["ns0/svc00000".to_string(), "ns1/svc00001".to_string()])
        );
        assert_eq!(
            membership_log(keys.iter().take(0)),
            MembershipLog::Each(vec![])
        );
    }
}
