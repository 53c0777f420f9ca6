//! The `tunnelgate` command: parse the CLI, load the config, and run, check or query the daemon.

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tunnelgate::config::decode_key;
use tunnelgate::config::SecretKey;
use tunnelgate::shell::daemon::{sd_notify, Daemon};
use tunnelgate::shell::files::{load_config, LoadError};

const DEFAULT_CONFIG: &str = "/etc/tunnelgate/tunnelgate.toml";

#[derive(Parser)]
#[command(
    name = "tunnelgate",
    version,
    about = "WireGuard data-plane proxy: tunnel, ingress/egress NAT, subnet router, exit node"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon in the foreground.
    Run {
        #[arg(long, env = "TUNNELGATE_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Validate the configuration and print what would be installed, changing nothing.
    Check {
        #[arg(long, env = "TUNNELGATE_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Print a new base64 private key (like `wg genkey`).
    Genkey,
    /// Read a base64 private key on stdin, print its public key (like `wg pubkey`).
    Pubkey,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match cli.command {
        Command::Genkey => {
            println!("{}", SecretKey::generate().expose_base64());
            ExitCode::SUCCESS
        }
        Command::Pubkey => pubkey(),
        Command::Check { config } => match load_config(&config) {
            Ok(c) => {
                let _ = writeln!(
                    std::io::stdout(),
                    "{}",
                    tunnelgate::core::plan::render_plan(&c)
                );
                ExitCode::SUCCESS
            }
            Err(e) => config_error(&e),
        },
        Command::Run { config } => run(config),
    }
}

fn pubkey() -> ExitCode {
    let mut text = String::new();
    if std::io::stdin().read_to_string(&mut text).is_err() {
        eprintln!("tunnelgate pubkey: cannot read stdin");
        return ExitCode::from(2);
    }
    match decode_key(text.trim()) {
        Ok(k) => {
            println!("{}", SecretKey(k).public_key());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tunnelgate pubkey: the private key on stdin {e}");
            ExitCode::from(2)
        }
    }
}

fn config_error(e: &LoadError) -> ExitCode {
    eprintln!("tunnelgate: {e}");
    match e {
        LoadError::Invalid { .. } => ExitCode::from(2),
        LoadError::Read { .. } => ExitCode::from(2),
    }
}

fn run(path: PathBuf) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(e) => return config_error(&e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tunnelgate: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(serve(config, path)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "tunnelgate failed");
            ExitCode::from(1)
        }
    }
}

async fn serve(config: tunnelgate::config::Config, path: PathBuf) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;
    let name = config.interface.name.clone();
    let uapi = tunnelgate::uapi::server::UapiServer::bind(&name)
        .with_context(|| format!("UAPI socket for {name}"))?;
    let daemon = Daemon::start(config, path).await?;
    let handler: Arc<dyn tunnelgate::uapi::UapiHandler> = daemon.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let uapi_task = tokio::spawn(uapi.run(handler, async move {
        let _ = stop_rx.await;
    }));
    tokio::spawn(daemon.clone().route_task());
    tokio::spawn(daemon.clone().watch_config());
    sd_notify("READY=1\nSTATUS=tunnel up");
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => {
                sd_notify("RELOADING=1");
                daemon.reload("SIGHUP").await;
                sd_notify("READY=1");
            }
        }
    }
    sd_notify("STOPPING=1");
    tracing::info!("Shutting down");
    daemon.teardown().await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), uapi_task).await;
    Ok(())
}
