//! The `tunnelgate-sidecar` command: parse the flags (or their environment variables), find the
//! API server, and keep the proxy's config Secret in step with its Service (or with every Service
//! of its proxy group) and base config until SIGTERM. Exit codes: 0 stopped, 1 runtime failure,
//! 2 bad usage.

use clap::{ArgGroup, Parser};
use std::path::PathBuf;
use std::process::ExitCode;
use tunnelgate::config::IpNet;
use tunnelgate::shell::logging::{init_logging, LogFormat};
use tunnelgate::sidecar::api::{connect, ObjRef};
use tunnelgate::sidecar::group::{
    identity_secret_name, ordinal_of, pool_address, Identity, Replica,
};
use tunnelgate::sidecar::parse_object_ref;
use tunnelgate::sidecar::run::{run, Settings};
use tunnelgate::sidecar::run_group::{run_group, GroupSettings};

#[derive(Parser)]
#[command(
    name = "tunnelgate-sidecar",
    version,
    about = "Writes the tunnelgate proxy's config Secret from its Service (or its proxy group's Services) and a base config"
)]
#[command(group(ArgGroup::new("mode").required(true).args(["service", "proxy_group"])))]
struct Cli {
    /// The config Secret to write: NAMESPACE/NAME, or NAME in the pod's namespace. With
    /// --proxy-group it defaults to $POD_NAMESPACE/$POD_NAME.
    #[arg(long, env = "TUNNELGATE_SECRET", value_name = "NS/NAME")]
    secret: Option<String>,
    /// The parent Service to read: NAMESPACE/NAME, or NAME in the pod's namespace.
    #[arg(long, env = "TUNNELGATE_SERVICE", value_name = "NS/NAME")]
    service: Option<String>,
    /// Serve every Service annotated tunnelgate.dev/proxy-group: NAME, as one replica of the group.
    #[arg(long, env = "TUNNELGATE_PROXY_GROUP", value_name = "NAME")]
    proxy_group: Option<String>,
    /// With --proxy-group: the replica (ordinal N of $POD_NAME) gets host N+1 of each pool as its
    /// tunnel addresses. Repeatable; the env var is comma-separated.
    #[arg(
        long = "address-pool",
        env = "TUNNELGATE_ADDRESS_POOLS",
        value_name = "CIDR",
        value_delimiter = ',',
        requires = "proxy_group"
    )]
    address_pools: Vec<IpNet>,
    /// With --proxy-group: list and watch Services only in these namespaces (a namespaced Role
    /// is then enough). Default: every namespace. Repeatable; the env var is comma-separated.
    #[arg(
        long = "namespace",
        env = "TUNNELGATE_NAMESPACES",
        value_name = "NS",
        value_delimiter = ',',
        requires = "proxy_group"
    )]
    namespaces: Vec<String>,
    /// With --proxy-group: also write the configuration, key, public key and tunnel addresses
    /// to this directory (a volume shared with the proxy container, which runs
    /// `tunnelgate run --config DIR/tunnelgate.toml`), swapped in atomically once the Secret
    /// holds them. The manifests then need no per-replica Secret volume: `kubectl scale` is
    /// enough.
    #[arg(
        long,
        env = "TUNNELGATE_CONFIG_DIR",
        value_name = "DIR",
        requires = "proxy_group"
    )]
    config_dir: Option<PathBuf>,
    /// With --proxy-group: per-replica (each replica its own key, Secret and addresses) or
    /// shared (every replica the group's key, kept in Secret $POD_NAMESPACE/<group>-identity,
    /// and the same addresses: host 1 of each pool, or the base config's), for one peer entry
    /// behind one UDP load balancer; shared needs --config-dir, the one way the group's key
    /// reaches the proxy container. Default: per-replica.
    #[arg(
        long,
        env = "TUNNELGATE_GROUP_IDENTITY",
        value_name = "MODE",
        value_parser = Identity::parse,
        requires = "proxy_group"
    )]
    identity: Option<Identity>,
    /// The base configuration (TOML: interface addresses, peers, shared settings).
    #[arg(long, env = "TUNNELGATE_BASE_CONFIG", value_name = "FILE")]
    base_config: PathBuf,
    /// Log format: human (one readable line per event; the default), json (one JSON object
    /// per line, for log collectors) or journal (systemd journal entries). The level comes
    /// from RUST_LOG (default info).
    #[arg(long, value_enum, env = tunnelgate::shell::logging::LOG_FORMAT_ENV, default_value_t)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let cli: Cli = match tunnelgate::cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let secret = match cli.secret.as_deref().map(parse_object_ref).transpose() {
        Ok(s) => s,
        Err(e) => return usage(&format!("--secret: {e}")),
    };
    let service = match cli.service.as_deref().map(parse_object_ref).transpose() {
        Ok(s) => s,
        Err(e) => return usage(&format!("--service: {e}")),
    };
    // Checked here: clap's `requires` lets it through without --proxy-group.
    if cli.identity.is_some() && cli.proxy_group.is_none() {
        return usage(
            "--identity (TUNNELGATE_GROUP_IDENTITY) is set without --proxy-group: expected it only for a proxy group",
        );
    }
    let pod_name = std::env::var("POD_NAME").ok().filter(|s| !s.is_empty());
    let group = match &cli.proxy_group {
        None => None,
        Some(name) => match group_replica(name, pod_name.as_deref(), &cli) {
            Ok(r) => Some(r),
            Err(e) => return usage(&e),
        },
    };
    if let Some(ns) = cli.namespaces.iter().find(|ns| {
        parse_object_ref(ns)
            .map(|(n, _)| n.is_some())
            .unwrap_or(true)
    }) {
        return usage(&format!(
            "--namespace: \"{ns}\" is not a namespace name: expected lower-case letters, digits and '-'"
        ));
    }
    if let Some(dir) = cli.config_dir.as_ref().filter(|d| !d.is_dir()) {
        return usage(&format!(
            "--config-dir: {} is not a directory: expected the volume shared with the proxy container",
            dir.display()
        ));
    }
    // The group's key is kept in its identity Secret only, never in the replica's own Secret:
    // the volume is the one way it reaches the proxy container.
    if group
        .as_ref()
        .is_some_and(|r| r.identity == Identity::Shared)
        && cli.config_dir.is_none()
    {
        return usage(
            "--identity shared needs --config-dir (TUNNELGATE_CONFIG_DIR): the group's key is kept in its identity Secret only, not in the replica's Secret, and reaches the proxy container through that shared volume",
        );
    }
    if secret.is_none() && pod_name.is_none() {
        return usage(
            "--secret is not set and POD_NAME is empty: expected --secret NS/NAME, or POD_NAME from the downward API",
        );
    }
    init_logging(cli.log_format);
    tunnelgate::shell::procfs::return_large_buffers_to_the_kernel();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "Cannot start the async runtime");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let client = match connect().await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "Cannot reach the Kubernetes API");
                return ExitCode::from(1);
            }
        };
        // A bare NAME lives in the pod's namespace (POD_NAMESPACE from the downward API), else in
        // the client's default namespace (the service account's, or the kubeconfig context's).
        let default_ns = std::env::var("POD_NAMESPACE")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| client.default_namespace().to_string());
        let obj = |(ns, name): (Option<String>, String)| ObjRef {
            namespace: ns.unwrap_or_else(|| default_ns.clone()),
            name,
        };
        let secret = obj(secret.unwrap_or_else(|| (None, pod_name.clone().unwrap_or_default())));
        let result = match (group, service) {
            (Some(replica), _) => {
                let identity = match replica.identity {
                    Identity::PerReplica => None,
                    Identity::Shared => Some(ObjRef {
                        namespace: default_ns.clone(),
                        name: identity_secret_name(&replica.group).unwrap_or_default(),
                    }),
                };
                let settings = GroupSettings {
                    replica,
                    identity,
                    secret,
                    pod: pod_name.map(|name| ObjRef {
                        namespace: default_ns.clone(),
                        name,
                    }),
                    namespaces: cli.namespaces,
                    base_config: cli.base_config,
                    config_dir: cli.config_dir,
                };
                run_group(client, settings, shutdown()).await
            }
            (None, Some(service)) => {
                let settings = Settings {
                    secret,
                    service: obj(service),
                    base_config: cli.base_config,
                };
                run(client, settings, shutdown()).await
            }
            (None, None) => Ok(()),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "Sidecar failed");
                ExitCode::from(1)
            }
        }
    })
}

/// The replica this sidecar runs for: the group, its ordinal (from the pod name) and pools, each
/// pool checked to have a host for the ordinal.
fn group_replica(group: &str, pod_name: Option<&str>, cli: &Cli) -> Result<Replica, String> {
    if parse_object_ref(group).map(|(ns, _)| ns.is_some()) != Ok(false) {
        return Err(format!(
            "--proxy-group: \"{group}\" is not a group name: expected lower-case letters, digits, '-' and '.'"
        ));
    }
    if cli.identity == Some(Identity::Shared) {
        identity_secret_name(group).map_err(|e| format!("--proxy-group: {e}"))?;
    }
    // With a shared identity every replica takes host 1 of each pool: the ordinal, like
    // without pools, only names the replica in the rendered file's header.
    let needs_ordinal = !cli.address_pools.is_empty() && cli.identity != Some(Identity::Shared);
    let ordinal = match (pod_name, needs_ordinal) {
        (Some(pod), true) => ordinal_of(pod).map_err(|e| format!("POD_NAME: {e}"))?,
        (Some(pod), false) => ordinal_of(pod).unwrap_or(0),
        (None, false) => 0,
        (None, true) => {
            return Err(
                "--address-pool needs the replica's ordinal: POD_NAME is empty, expected the StatefulSet pod name from the downward API".into(),
            )
        }
    };
    let replica = Replica {
        group: group.to_string(),
        ordinal,
        pools: cli.address_pools.clone(),
        identity: cli.identity.unwrap_or_default(),
        endpoint: None,
    };
    for pool in &cli.address_pools {
        pool_address(pool, replica.address_ordinal())
            .map_err(|e| format!("--address-pool: {e}"))?;
    }
    Ok(replica)
}

fn usage(message: &str) -> ExitCode {
    eprintln!("tunnelgate-sidecar: {message}");
    ExitCode::from(2)
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            tracing::warn!("Cannot install signal handlers: stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
