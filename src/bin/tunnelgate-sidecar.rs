//! The `tunnelgate-sidecar` command: parse the flags (or their environment variables), find the
//! API server, and keep the proxy's config Secret in step with its Service and base config until
//! SIGTERM. Exit codes: 0 stopped, 1 runtime failure, 2 bad usage.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use tunnelgate::sidecar::api::{connect, ObjRef};
use tunnelgate::sidecar::parse_object_ref;
use tunnelgate::sidecar::run::{run, Settings};
use tunnelgate::telemetry::{init_logging, LogFormat};

#[derive(Parser)]
#[command(
    name = "tunnelgate-sidecar",
    version,
    about = "Writes the tunnelgate proxy's config Secret from its Service and a base config"
)]
struct Cli {
    /// The config Secret to write: NAMESPACE/NAME, or NAME in the pod's namespace.
    #[arg(long, env = "TUNNELGATE_SECRET", value_name = "NS/NAME")]
    secret: String,
    /// The parent Service to read: NAMESPACE/NAME, or NAME in the pod's namespace.
    #[arg(long, env = "TUNNELGATE_SERVICE", value_name = "NS/NAME")]
    service: String,
    /// The base configuration (TOML: interface addresses, peers, shared settings).
    #[arg(long, env = "TUNNELGATE_BASE_CONFIG", value_name = "FILE")]
    base_config: PathBuf,
    /// Log format: human (default) or json. Level comes from RUST_LOG (default info).
    #[arg(long, value_enum, env = tunnelgate::telemetry::logging::LOG_FORMAT_ENV, default_value_t)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let cli: Cli = match tunnelgate::cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let (secret, service) = match (
        parse_object_ref(&cli.secret),
        parse_object_ref(&cli.service),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) => return usage(&format!("--secret: {e}")),
        (_, Err(e)) => return usage(&format!("--service: {e}")),
    };
    init_logging(cli.log_format);
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
        let settings = Settings {
            secret: obj(secret),
            service: obj(service),
            base_config: cli.base_config,
        };
        match run(client, settings, shutdown()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "Sidecar failed");
                ExitCode::from(1)
            }
        }
    })
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
