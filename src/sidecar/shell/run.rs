//! The sidecar's control loop: watch the parent Service, poll the base configuration file, and
//! bring the config Secret up to date whenever either changes. Writes only when the rendered data
//! differs from the Secret's (no write loops); retries API failures with exponential backoff;
//! reports bad input once per distinct problem as a log line and a Warning Event on the Service,
//! keeping the last good Secret.

use super::api::{record_warning, secret_write_failed, service_info, ObjRef, SecretStore};
use crate::config::SecretKey;
use crate::shell::keys::GenerateKey as _;
use crate::sidecar::{changed_keys, render, Backoff, Rejected, ServiceInfo};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::{Api, Client};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

/// How often the base configuration file is read again (a mounted ConfigMap changes by an
/// atomic symlink swap, which a content comparison sees without inotify).
pub const BASE_CONFIG_POLL: Duration = Duration::from_secs(2);
/// How often the Secret is compared even without a change, to repair edits or a deleted key.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(300);
/// First retry delay after a failed API call; doubles up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_millis(200);
pub const RETRY_MAX: Duration = Duration::from_secs(30);
/// Event reason for a configuration the sidecar refused to write.
pub const REASON_INVALID: &str = "InvalidTunnelgateConfig";

/// What the sidecar works on.
#[derive(Debug, Clone)]
pub struct Settings {
    pub secret: ObjRef,
    pub service: ObjRef,
    pub base_config: PathBuf,
}

/// The Service as last seen by the watch.
enum Seen {
    /// No answer from the API server yet.
    Unknown,
    Absent,
    Present {
        info: Box<ServiceInfo>,
        uid: Option<String>,
    },
}

/// Why a pass did not finish.
enum Failure {
    /// The inputs cannot give a valid configuration: wait for them to change.
    Rejected(Rejected),
    /// The API call failed: retry later.
    Api(Box<kube::Error>),
}

struct Loop {
    client: Client,
    settings: Settings,
    secret: SecretStore,
    service: Seen,
    base: Result<String, String>,
    /// The problem last reported, so a persisting one is reported once.
    reported: Option<String>,
    backoff: Backoff,
}

/// Runs until `shutdown` completes; errors only if the watch stream ends, which it never should.
pub async fn run(
    client: Client,
    settings: Settings,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let services: Api<Service> = Api::namespaced(client.clone(), &settings.service.namespace);
    let mut watch = watcher::watch_object(services, &settings.service.name)
        .backoff(super::api::WatchBackoff::default())
        .boxed();
    let mut this = Loop {
        secret: SecretStore::new(client.clone(), settings.secret.clone()),
        client,
        base: read_base(&settings.base_config).await,
        settings,
        service: Seen::Unknown,
        reported: None,
        backoff: Backoff::new(RETRY_MIN, RETRY_MAX),
    };
    tracing::info!(
        service = %this.settings.service,
        secret = %this.settings.secret,
        base_config = %this.settings.base_config.display(),
        "Sidecar started"
    );
    let mut base_tick = tokio::time::interval(BASE_CONFIG_POLL);
    let mut resync = tokio::time::interval(RESYNC_INTERVAL);
    for t in [&mut base_tick, &mut resync] {
        t.set_missed_tick_behavior(MissedTickBehavior::Delay);
        t.reset();
    }
    let mut dirty = false;
    let mut retry_at: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        if dirty && retry_at.is_none() && matches!(this.service, Seen::Present { .. }) {
            dirty = false;
            if let Some(delay) = this.pass().await {
                retry_at = Some(crate::shell::clock::tokio_now() + delay);
            }
        }
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut shutdown => {
                tracing::info!("Sidecar stopping");
                return Ok(());
            }
            event = watch.next() => match event {
                Some(Ok(svc)) => dirty |= this.service_seen(svc),
                Some(Err(e)) => tracing::warn!(error = %super::api::describe_watch(&e), service = %this.settings.service, "Watch of the Service failed: retrying"),
                None => anyhow::bail!("the watch of Service {} ended", this.settings.service),
            },
            _ = base_tick.tick() => {
                let base = read_base(&this.settings.base_config).await;
                if base != this.base {
                    tracing::info!(path = %this.settings.base_config.display(), "Base config changed");
                    this.base = base;
                    dirty = true;
                }
            }
            _ = resync.tick() => dirty = true,
            () = retry => {
                retry_at = None;
                dirty = true;
            }
        }
    }
}

impl Loop {
    /// Takes in what the watch reports; true when it may change the rendered configuration.
    fn service_seen(&mut self, svc: Option<Service>) -> bool {
        match svc {
            Some(svc) => {
                let info = service_info(&svc);
                let uid = svc.metadata.uid.clone();
                let changed =
                    !matches!(&self.service, Seen::Present { info: old, .. } if **old == info);
                if changed {
                    tracing::info!(service = %self.settings.service, "Service changed");
                }
                self.service = Seen::Present {
                    info: Box::new(info),
                    uid,
                };
                changed
            }
            None => {
                if !matches!(self.service, Seen::Absent) {
                    tracing::warn!(service = %self.settings.service, "Service not found: keeping the Secret as it is until it exists");
                }
                self.service = Seen::Absent;
                false
            }
        }
    }

    /// One reconcile pass; `Some(delay)` asks for a retry after it.
    async fn pass(&mut self) -> Option<Duration> {
        match self.reconcile().await {
            Ok(()) => {
                if self.reported.take().is_some() {
                    tracing::info!(service = %self.settings.service, "Configuration is valid again");
                }
                self.backoff.reset();
                None
            }
            Err(Failure::Rejected(r)) => {
                self.backoff.reset();
                self.report(r).await;
                None
            }
            Err(Failure::Api(e)) => Some(secret_write_failed(
                &e,
                &self.settings.secret,
                &mut self.backoff,
            )),
        }
    }

    async fn reconcile(&mut self) -> Result<(), Failure> {
        let Seen::Present { info, .. } = &self.service else {
            return Ok(());
        };
        let base = self
            .base
            .clone()
            .map_err(|e| Failure::Rejected(Rejected(vec![e])))?;
        let current = self
            .secret
            .data()
            .await
            .map_err(|e| Failure::Api(Box::new(e)))?;
        let rendered =
            render(info, &base, &current, SecretKey::generate).map_err(Failure::Rejected)?;
        for note in &rendered.notes {
            tracing::info!(note = %note, "Rendering note");
        }
        let changed = changed_keys(&rendered.data, &current);
        if changed.is_empty() {
            tracing::debug!(secret = %self.settings.secret, "Secret is up to date");
            return Ok(());
        }
        self.secret
            .apply(&rendered.data)
            .await
            .map_err(|e| Failure::Api(Box::new(e)))?;
        tracing::info!(
            secret = %self.settings.secret,
            keys = %changed.join(","),
            generated_key = rendered.generated_key,
            "Secret updated"
        );
        Ok(())
    }

    /// Logs and records a problem once; the same problem again is only logged at debug level.
    async fn report(&mut self, r: Rejected) {
        let message = r.to_string();
        if self.reported.as_deref() == Some(message.as_str()) {
            tracing::debug!(problem = %message, "Configuration still invalid");
            return;
        }
        tracing::error!(problem = %message, service = %self.settings.service, "Not writing an invalid configuration: keeping the last good Secret");
        let uid = match &self.service {
            Seen::Present { uid, .. } => uid.clone(),
            _ => None,
        };
        let text = format!("tunnelgate config not updated, the last good one stays: {message}");
        if let Err(e) = record_warning(
            self.client.clone(),
            &self.settings.service,
            uid,
            REASON_INVALID,
            &text,
        )
        .await
        {
            tracing::warn!(error = %e, "Recording the Event failed");
        }
        self.reported = Some(message);
    }
}

pub(crate) async fn read_base(path: &std::path::Path) -> Result<String, String> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|e| format!("base config {} cannot be read: {e}", path.display()))
}
