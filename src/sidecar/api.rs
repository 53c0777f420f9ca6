//! The sidecar's Kubernetes API calls: finding the API server, reading the Service and the config
//! Secret, writing the Secret with server-side apply, and recording Events. I/O only: what to
//! write is decided by the pure [`crate::sidecar::render`].

use super::{Backoff, ServiceInfo, ServicePort, TargetPort};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Config};
use std::collections::BTreeMap;
use std::time::Duration;

/// The field manager of every write: the sidecar is the only writer of the config Secret.
pub const FIELD_MANAGER: &str = "tunnelgate-sidecar";
/// Kubernetes refuses Event messages much longer than this; ours are cut to fit.
const EVENT_MESSAGE_MAX_BYTES: usize = 1024;

/// A namespaced object the sidecar works on.
#[derive(Debug, Clone, PartialEq, Eq)]
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
        annotations: svc.metadata.annotations.clone().unwrap_or_default(),
        ports,
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
        let secret = self.api.get_opt(&self.obj.name).await?;
        Ok(secret
            .and_then(|s| s.data)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect())
    }

    /// Server-side apply of `data` under [`FIELD_MANAGER`], forced: the sidecar is the only writer
    /// of these keys, so it takes them over from whoever created the Secret.
    pub async fn apply(&self, data: &BTreeMap<String, Vec<u8>>) -> Result<(), kube::Error> {
        let secret = Secret {
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
        };
        let params = PatchParams::apply(FIELD_MANAGER).force();
        self.api
            .patch(&self.obj.name, &params, &Patch::Apply(&secret))
            .await
            .map(|_| ())
    }
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

/// Whether retrying the same call later can succeed: conflicts, throttling, server errors and
/// transport failures can; a refused request (403, 404, 422) needs a change elsewhere first, so
/// it is retried too, but slowly.
pub fn is_transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => status.code == 409 || status.code == 429 || status.code >= 500,
        _ => true,
    }
}

/// After a failed Secret write: logs why (a refusal names the Role's missing verbs) and returns
/// how long to wait before the next attempt. Both sidecar modes retry this way.
pub fn secret_write_failed(e: &kube::Error, secret: &ObjRef, backoff: &mut Backoff) -> Duration {
    let delay = backoff.next_delay();
    if is_transient(e) {
        tracing::warn!(error = %e, secret = %secret, retry_in = ?delay, "Updating the Secret failed: retrying");
    } else {
        tracing::error!(error = %e, secret = %secret, retry_in = ?delay, "Updating the Secret was refused: retrying (check the Role: get and patch on this Secret; a Secret that does not exist yet needs create too, or create it beforehand)");
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
