//! The sidecar's Kubernetes API calls: finding the API server, reading the Service and the config
//! Secret, writing the Secret with server-side apply (and creating a group's identity Secret only
//! where none exists), and recording Events (in the background, de-duplicated and rate-limited,
//! so an Event never delays a write). I/O only: what to write is
//! decided by the pure [`crate::sidecar::render`]. Also what an API failure means in words
//! (an unreachable server is not a missing Role) and the watches' capped backoff.

use crate::sidecar::{Backoff, ServiceInfo, ServicePort, TargetPort};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Config};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// The field manager of every write: the sidecar is the only writer of the config Secret.
pub const FIELD_MANAGER: &str = "tunnelgate-sidecar";
/// Kubernetes refuses Event messages much longer than this; ours are cut to fit.
const EVENT_MESSAGE_MAX_BYTES: usize = 1024;

/// A namespaced object the sidecar works on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ObjRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The API server the standard way: in-cluster (service account) config, else `KUBECONFIG` or
/// `~/.kube/config`.
pub async fn connect() -> anyhow::Result<Client> {
    let config = match Config::incluster() {
        Ok(c) => c,
        Err(in_cluster) => Config::from_kubeconfig(&kube::config::KubeConfigOptions::default())
            .await
            .map_err(|kubeconfig| {
                anyhow::anyhow!(
                    "no API server: not in a cluster ({in_cluster}) and no usable kubeconfig ({kubeconfig})"
                )
            })?,
    };
    Ok(Client::try_from(config)?)
}

/// The parts of a Service that [`crate::sidecar::render`] reads.
pub fn service_info(svc: &Service) -> ServiceInfo {
    let spec = svc.spec.clone().unwrap_or_default();
    let cluster_ips = match spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips,
        _ => spec.cluster_ip.into_iter().collect(),
    };
    let ports = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .map(|p| ServicePort {
            name: p.name,
            port: p.port,
            target_port: p.target_port.map(|t| match t {
                IntOrString::Int(n) => TargetPort::Number(n),
                IntOrString::String(s) => match s.parse::<i32>() {
                    Ok(n) => TargetPort::Number(n),
                    Err(_) => TargetPort::Name(s),
                },
            }),
            protocol: p.protocol,
        })
        .collect();
    ServiceInfo {
        namespace: svc.metadata.namespace.clone().unwrap_or_default(),
        name: svc.metadata.name.clone().unwrap_or_default(),
        type_: spec.type_,
        cluster_ips,
        external_name: spec.external_name,
        load_balancer_class: spec.load_balancer_class,
        annotations: svc
            .metadata
            .annotations
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        ports,
        load_balancer_ingress: svc
            .status
            .iter()
            .flat_map(|s| s.load_balancer.iter())
            .flat_map(|lb| lb.ingress.iter().flatten())
            .filter_map(|i| i.ip.clone().or_else(|| i.hostname.clone()))
            .collect(),
        created: svc
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second()),
    }
}

/// The config Secret.
pub struct SecretStore {
    api: Api<Secret>,
    obj: ObjRef,
}

impl SecretStore {
    pub fn new(client: Client, obj: ObjRef) -> SecretStore {
        SecretStore {
            api: Api::namespaced(client, &obj.namespace),
            obj,
        }
    }

    /// The Secret's data; empty when the Secret does not exist yet (apply creates it).
    pub async fn data(&self) -> Result<BTreeMap<String, Vec<u8>>, kube::Error> {
        Ok(self.data_if_exists().await?.unwrap_or_default())
    }

    /// The Secret's data, or `None` when the Secret does not exist.
    pub async fn data_if_exists(&self) -> Result<Option<BTreeMap<String, Vec<u8>>>, kube::Error> {
        let secret = self.api.get_opt(&self.obj.name).await?;
        Ok(secret.map(|s| secret_data(&s)))
    }

    /// The Secret's API, for its watch.
    pub fn api(&self) -> Api<Secret> {
        self.api.clone()
    }

    /// This Secret (its name and namespace) holding `data`.
    fn secret_with(&self, data: &BTreeMap<String, Vec<u8>>) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(self.obj.name.clone()),
                namespace: Some(self.obj.namespace.clone()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.clone(), ByteString(v.clone())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    /// Creates the Secret with `data`, never touching one that exists: `Ok(true)` created,
    /// `Ok(false)` when the API server answers that it already exists (409 AlreadyExists: another
    /// writer created it first, and theirs stands).
    pub async fn create(&self, data: &BTreeMap<String, Vec<u8>>) -> Result<bool, kube::Error> {
        let secret = self.secret_with(data);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        match self.api.create(&params, &secret).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists" => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Server-side apply of `data` under [`FIELD_MANAGER`], forced: the sidecar is the only writer
    /// of these keys, so it takes them over from whoever created the Secret. Returns what the
    /// Secret holds after it.
    pub async fn apply(
        &self,
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<BTreeMap<String, Vec<u8>>, kube::Error> {
        let secret = self.secret_with(data);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        self.api
            .patch(&self.obj.name, &params, &Patch::Apply(&secret))
            .await
            .map(|s| secret_data(&s))
    }

    /// Removes `keys` from the Secret's data (a JSON merge patch setting each to null, which
    /// removes a key whoever wrote it, and is a no-op for one already gone). Server-side apply
    /// drops a key its manager stops sending only when no other manager owns it too: a key that
    /// `kubectl edit` touched, say, stays until removed this way.
    pub async fn remove_keys(&self, keys: &[&str]) -> Result<(), kube::Error> {
        let nulls: serde_json::Map<String, serde_json::Value> = keys
            .iter()
            .map(|k| ((*k).to_string(), serde_json::Value::Null))
            .collect();
        let patch = serde_json::json!({ "data": nulls });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        self.api
            .patch(&self.obj.name, &params, &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }
}

/// A Secret's data, decoded.
pub fn secret_data(secret: &Secret) -> BTreeMap<String, Vec<u8>> {
    secret
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect()
}

/// Records a Warning Event on the Service (core/v1), so `kubectl describe service` shows why the
/// proxy's configuration was not updated. Best effort: a failure is returned for logging only.
pub async fn record_warning(
    client: Client,
    service: &ObjRef,
    uid: Option<String>,
    reason: &str,
    message: &str,
) -> Result<(), kube::Error> {
    record_warning_on(client, "Service", service, uid, reason, message).await
}

/// Records a Warning Event on a core/v1 object of `kind` (`Service`, `Pod`).
pub async fn record_warning_on(
    client: Client,
    kind: &str,
    service: &ObjRef,
    uid: Option<String>,
    reason: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let stamp = now.0.as_nanosecond();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{stamp:x}", service.name)),
            namespace: Some(service.namespace.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some(kind.into()),
            name: Some(service.name.clone()),
            namespace: Some(service.namespace.clone()),
            uid,
            ..ObjectReference::default()
        },
        reason: Some(reason.into()),
        message: Some(truncate(message, EVENT_MESSAGE_MAX_BYTES)),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some(FIELD_MANAGER.into()),
            host: None,
        }),
        reporting_component: Some(FIELD_MANAGER.into()),
        reporting_instance: std::env::var("POD_NAME").ok(),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Event::default()
    };
    let api: Api<Event> = Api::namespaced(client, &service.namespace);
    api.create(&PostParams::default(), &event).await.map(|_| ())
}

/// What an API failure means, in words a user can act on: an API server that cannot be reached
/// (refused, reset, timed out) is said to be unreachable, and only a 403 names the Role.
pub fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => match status.code {
            401 => format!(
                "not authenticated (401: {}): check the service account token",
                status.message
            ),
            403 => format!(
                "forbidden by RBAC (403: {}): check the Role",
                status.message
            ),
            404 => format!("not found (404: {})", status.message),
            409 => format!(
                "conflict (409: {}): another writer changed it",
                status.message
            ),
            410 => format!("expired (410: {}): listing again", status.message),
            422 => format!("refused as invalid (422: {})", status.message),
            429 => format!("throttled by the API server (429: {})", status.message),
            code => format!("the API server failed ({code}: {})", status.message),
        },
        other => {
            // The whole chain: "connection refused" is at its end.
            let mut text = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(s) = source {
                let part = s.to_string();
                if !text.contains(&part) {
                    text.push_str(": ");
                    text.push_str(&part);
                }
                source = s.source();
            }
            format!("the API server cannot be reached or did not answer ({text})")
        }
    }
}

/// [`describe`] for a watch's failure.
pub fn describe_watch(e: &kube::runtime::watcher::Error) -> String {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(e) => format!("listing failed: {}", describe(e)),
        W::WatchStartFailed(e) | W::WatchFailed(e) => format!("watching failed: {}", describe(e)),
        W::WatchError(status) => describe(&kube::Error::Api(status.clone())),
        other => other.to_string(),
    }
}

/// Whether a watch failure is a refusal by RBAC (403), which the log then blames on the Role.
pub fn watch_forbidden(e: &kube::runtime::watcher::Error) -> bool {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(kube::Error::Api(s))
        | W::WatchStartFailed(kube::Error::Api(s))
        | W::WatchFailed(kube::Error::Api(s)) => s.code == 403,
        W::WatchError(s) => s.code == 403,
        _ => false,
    }
}

/// The watches' retry delays: from [`WATCH_RETRY_MIN`], doubling up to [`WATCH_RETRY_MAX`], back
/// to the start after a success. kube's default grows to 30 s, so a group would converge tens of
/// seconds after an API server outage; capped at 1 s it reconnects within a second of the return.
pub struct WatchBackoff(Backoff);

/// The first delay after a watch fails.
pub const WATCH_RETRY_MIN: Duration = Duration::from_millis(100);
/// The longest delay between two attempts to watch again.
pub const WATCH_RETRY_MAX: Duration = Duration::from_secs(1);

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff(Backoff::new(WATCH_RETRY_MIN, WATCH_RETRY_MAX))
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.0.next_delay())
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}

/// A Warning Event waiting to be recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingEvent {
    /// `Service` or `Pod`.
    pub kind: &'static str,
    pub object: ObjRef,
    pub uid: Option<String>,
    pub reason: &'static str,
    pub message: String,
}

/// Events queued per object and reason: a newer message replaces one not yet sent.
const EVENT_QUEUE_MAX: usize = 20_000;
/// At most this many Events at once, then [`EVENTS_PER_SECOND`] (client-go's recorder allows a
/// burst of 25 per object; this is for the whole sidecar, so a flood of left-out Services cannot
/// crowd out the API server).
const EVENT_BURST: f64 = 25.0;
const EVENTS_PER_SECOND: f64 = 10.0;

/// Records Warning Events in the background: [`EventRecorder::record`] never waits, identical
/// ones queued for the same object and reason are sent once (the newest message wins), and they
/// go out at a bounded rate. The Secret write is never behind an Event.
#[derive(Clone)]
pub struct EventRecorder {
    tx: mpsc::UnboundedSender<PendingEvent>,
}

impl EventRecorder {
    /// Starts the background sender on the current runtime.
    pub fn start(client: Client) -> EventRecorder {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_events(client, rx));
        EventRecorder { tx }
    }

    pub fn record(&self, event: PendingEvent) {
        // The receiver lives as long as the runtime.
        let _ = self.tx.send(event);
    }
}

/// The queue of [`EventRecorder`]: in arrival order, one entry per (kind, object, reason). An
/// entry is found again by a hash of that key, not by copies of it: at 20,000 queued Events (a
/// group whose names do not resolve) a map keyed by copies took a third of the sidecar's memory.
#[derive(Default)]
struct EventQueue {
    /// The Events waiting, oldest first; the front one is number `first` of all ever queued.
    waiting: std::collections::VecDeque<Box<PendingEvent>>,
    first: u64,
    /// The hash of an Event's key -> the number of the waiting Event with that key.
    by_key: std::collections::HashMap<u64, u64>,
    dropped: u64,
}

impl EventQueue {
    fn key_hash(e: &PendingEvent) -> u64 {
        use std::hash::{Hash as _, Hasher as _};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (e.kind, &e.object, e.reason).hash(&mut h);
        h.finish()
    }

    fn push(&mut self, e: PendingEvent) {
        let hash = Self::key_hash(&e);
        if let Some(&n) = self.by_key.get(&hash) {
            let queued = &mut self.waiting[(n - self.first) as usize];
            // Two keys of one hash are queued apart, never merged.
            if (queued.kind, &queued.object, queued.reason) == (e.kind, &e.object, e.reason) {
                **queued = e;
                return;
            }
        }
        if self.waiting.len() >= EVENT_QUEUE_MAX {
            self.dropped += 1;
            return;
        }
        let n = self.first + self.waiting.len() as u64;
        self.by_key.entry(hash).or_insert(n);
        self.waiting.push_back(Box::new(e));
    }

    fn pop(&mut self) -> Option<PendingEvent> {
        let e = self.waiting.pop_front()?;
        let hash = Self::key_hash(&e);
        if self.by_key.get(&hash) == Some(&self.first) {
            self.by_key.remove(&hash);
        }
        self.first += 1;
        if self.waiting.is_empty() {
            // A flood's worth of room is not kept for the next one.
            self.waiting.shrink_to(64);
            self.by_key.shrink_to(64);
        }
        Some(*e)
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

async fn send_events(client: Client, mut rx: mpsc::UnboundedReceiver<PendingEvent>) {
    let mut queue = EventQueue::default();
    let mut tokens = EVENT_BURST;
    let mut refilled = crate::shell::clock::now();
    loop {
        if queue.is_empty() {
            match rx.recv().await {
                Some(e) => queue.push(e),
                None => return,
            }
        }
        while let Ok(e) = rx.try_recv() {
            queue.push(e);
        }
        if queue.dropped > 0 {
            tracing::warn!(
                dropped = queue.dropped,
                "Too many Events waiting: some were not recorded"
            );
            queue.dropped = 0;
        }
        let now = crate::shell::clock::now();
        tokens = (tokens + (now - refilled).as_secs_f64() * EVENTS_PER_SECOND).min(EVENT_BURST);
        refilled = now;
        if tokens < 1.0 {
            let wait = Duration::from_secs_f64((1.0 - tokens) / EVENTS_PER_SECOND);
            tokio::time::sleep(wait).await;
            continue;
        }
        let Some(e) = queue.pop() else { continue };
        tokens -= 1.0;
        if let Err(err) = record_warning_on(
            client.clone(),
            e.kind,
            &e.object,
            e.uid.clone(),
            e.reason,
            &e.message,
        )
        .await
        {
            tracing::warn!(error = %describe(&err), object = %e.object, reason = %e.reason, "Recording the Event failed");
        }
    }
}

/// Whether retrying the same call later can succeed: conflicts, throttling, server errors and
/// transport failures can; a refused request (403, 404, 422) needs a change elsewhere first, so
/// it is retried too, but slowly.
pub fn is_transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => status.code == 409 || status.code == 429 || status.code >= 500,
        _ => true,
    }
}

/// The longest wait before retrying a write that failed for a reason that passes by itself (an
/// unreachable API server, a conflict, throttling): short, so the Secret converges within
/// seconds once the API server is back. A refusal backs off further, to [`super::run::RETRY_MAX`].
pub const TRANSIENT_RETRY_MAX: Duration = Duration::from_secs(1);

/// After a failed Secret write: logs what happened (only a 403 names the Role's verbs) and
/// returns how long to wait before the next attempt. Both sidecar modes retry this way.
pub fn secret_write_failed(e: &kube::Error, secret: &ObjRef, backoff: &mut Backoff) -> Duration {
    let delay = backoff.next_delay();
    let what = describe(e);
    if is_transient(e) {
        let delay = delay.min(TRANSIENT_RETRY_MAX);
        tracing::warn!(error = %what, secret = %secret, retry_in = ?delay, "Updating the Secret failed: retrying");
        return delay;
    }
    match e {
        kube::Error::Api(s) if s.code == 403 => {
            tracing::error!(error = %what, secret = %secret, retry_in = ?delay, "Updating the Secret was refused: retrying (check the Role: get and patch on this Secret; a Secret that does not exist yet needs create too, or create it beforehand)")
        }
        _ => {
            tracing::error!(error = %what, secret = %secret, retry_in = ?delay, "Updating the Secret was refused: retrying")
        }
    }
    delay
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max - 3;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, reason: &'static str, message: &str) -> PendingEvent {
        PendingEvent {
            kind: "Service",
            object: ObjRef {
                namespace: "apps".into(),
                name: name.into(),
            },
            uid: None,
            reason,
            message: message.into(),
        }
    }

    #[test]
    fn a_group_member_keeps_only_the_annotations_the_sidecar_reads() {
        let mut svc = Service::default();
        svc.metadata.annotations = Some(
            [
                ("tunnelgate.dev/proxy-group", "tgp"),
                (
                    "kubectl.kubernetes.io/last-applied-configuration",
                    "{\"huge\": 1}",
                ),
                ("tunnelgate.dev/expose", "true"),
                ("example.com/owner", "team-a"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        );
        let mut info = service_info(&svc);
        // A single Service's sidecar keeps them all: a change of any annotation is a pass,
        // which is how containers/README.md has a removed key rotated.
        assert_eq!(
            info.annotations
                .get("example.com/owner")
                .map(String::as_str),
            Some("team-a")
        );
        info.annotations.retain_own();
        let mut expected = crate::sidecar::Annotations::default();
        expected.insert("tunnelgate.dev/expose".into(), "true".into());
        expected.insert("tunnelgate.dev/proxy-group".into(), "tgp".into());
        assert_eq!(info.annotations, expected);
        assert_eq!(
            info.annotations
                .get("tunnelgate.dev/proxy-group")
                .map(String::as_str),
            Some("tgp")
        );
        assert_eq!(info.annotations.get("example.com/owner"), None);
        let mut a = info.annotations;
        assert_eq!(a.remove("tunnelgate.dev/expose").as_deref(), Some("true"));
        a.insert("tunnelgate.dev/proxy-group".into(), "other".into());
        assert_eq!(
            a.get("tunnelgate.dev/proxy-group").map(String::as_str),
            Some("other")
        );
        assert_eq!(a.get("tunnelgate.dev/expose"), None);
    }

    #[test]
    fn queued_events_of_one_object_and_reason_are_sent_once_with_the_newest_message() {
        let mut q = EventQueue::default();
        q.push(event("web", "LeftOut", "port 80 taken"));
        q.push(event("db", "LeftOut", "port 5432 taken"));
        q.push(event("web", "LeftOut", "port 443 taken"));
        q.push(event("web", "NameUnresolved", "no such name"));
        let sent: Vec<(String, String)> = std::iter::from_fn(|| q.pop())
            .map(|e| (e.object.name, e.message))
            .collect();
        assert_eq!(
            sent,
            [
                ("web".to_string(), "port 443 taken".to_string()),
                ("db".to_string(), "port 5432 taken".to_string()),
                ("web".to_string(), "no such name".to_string()),
            ]
        );
    }

    #[test]
    fn the_watch_backoff_is_capped_at_a_second_and_resets() {
        use kube::runtime::utils::Backoff as _;
        let mut b = WatchBackoff::default();
        let delays: Vec<Duration> = b.by_ref().take(8).collect();
        assert_eq!(delays[0], WATCH_RETRY_MIN);
        assert!(delays.iter().all(|d| *d <= WATCH_RETRY_MAX));
        assert_eq!(delays[7], WATCH_RETRY_MAX);
        b.reset();
        assert_eq!(b.next(), Some(WATCH_RETRY_MIN));
    }
}
