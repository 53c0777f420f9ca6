//! The `tunnelgate` command: parse the CLI, load the config, and run, check or query the daemon.

use clap::{Parser, Subcommand};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use tunnelgate::config::decode_key;
use tunnelgate::config::SecretKey;
use tunnelgate::shell::clock::unix_now as now_unix;
use tunnelgate::shell::config_file::{load_config, LoadError};
use tunnelgate::shell::keys::GenerateKey as _;
use tunnelgate::shell::logging::{init_logging, LogFormat};
use tunnelgate::shell::status_client::{query_status, status_socket_path};
use tunnelgate::telemetry::render_status_text;

const DEFAULT_CONFIG: &str = "/etc/tunnelgate/tunnelgate.toml";

#[derive(Parser)]
#[command(
    name = "tunnelgate",
    version,
    about = "WireGuard data-plane proxy: tunnel, ingress/egress NAT, subnet router, exit node",
    // Our own `help` subcommand, so that `tunnelgate help --help` works like every other one.
    disable_help_subcommand = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`, on the subcommands that log (the others print their result and errors).
#[derive(clap::Args)]
struct LogArgs {
    /// Log format: human, json or journal (human turns into journal entries by itself when
    /// stderr is the systemd journal). The level comes from RUST_LOG (default info).
    #[arg(long, value_enum, env = tunnelgate::shell::logging::LOG_FORMAT_ENV, default_value_t)]
    log_format: LogFormat,
}

/// `--seccomp`, on the subcommands that run packet threads.
#[derive(clap::Args)]
struct SeccompArgs {
    /// What the packet threads' seccomp allow-list does with a system call outside it:
    /// enforce (kill the process; the kernel logs the call), log (allow it and let the kernel
    /// log it), or off.
    #[arg(long, env = tunnelgate::shell::seccomp::POLICY_ENV, default_value_t)]
    seccomp: tunnelgate::core::seccomp::Policy,
}

/// The formats `tunnelgate import` reads.
#[derive(Subcommand)]
enum Import {
    /// Print the tunnelgate TOML equivalent of a wg-quick file.
    ///
    /// FILE is wg-quick's /etc/wireguard/NAME.conf; the interface is named NAME. The private key goes to --key-file (mode 0600), each
    /// preshared key to a 0600 file beside it (KEYFILE-STEM.peerN.psk); the TOML names them
    /// by absolute path. Keys with no tunnelgate equivalent (DNS, Table, PostUp, SaveConfig,
    /// ...) are named on stderr with their line. Every value is checked as `check` would.
    /// The key files are written all or none, and an existing one is never replaced without
    /// --force. Exit 2 when FILE is not a wg-quick config (or larger than 1 MiB), holds a value
    /// `check` refuses, or an output path is FILE; exit 1 when a key file exists or cannot be
    /// written; nothing is written then.
    #[command(name = "wg-quick")]
    WgQuick {
        /// The wg-quick INI file.
        file: PathBuf,
        /// Where to write the private key (default: FILE with the extension .key).
        #[arg(long, value_name = "PATH")]
        key_file: Option<PathBuf>,
        /// Replace key files that exist already (without it, an existing file is an error).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon in the foreground.
    Run {
        /// The configuration file (TOML; a wg-quick file: see `tunnelgate help import`).
        #[arg(long, env = "TUNNELGATE_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        #[command(flatten)]
        log: LogArgs,
        #[command(flatten)]
        seccomp: SeccompArgs,
    },
    /// Validate the configuration and print what would be installed, changing nothing.
    Check {
        /// The configuration file to validate (TOML).
        #[arg(long, env = "TUNNELGATE_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Print JSON: the plan's text, the firewall backend and the tuning a start would get.
        #[arg(long)]
        json: bool,
    },
    /// Show the running daemon's interface, peers, rules and resolved names. With neither
    /// --interface nor --config (nor $TUNNELGATE_CONFIG): every tunnelgate running in this
    /// network namespace, like `wg show` (--all: in every namespace).
    Status {
        /// The daemon running this config file (its interface.name).
        #[arg(long, env = "TUNNELGATE_CONFIG", conflicts_with = "interface")]
        config: Option<PathBuf>,
        /// The interface to query.
        #[arg(long)]
        interface: Option<String>,
        /// Every tunnelgate of every network namespace, each naming its namespace (its
        /// `ip netns` name, else the kernel's `net:[INODE]`).
        #[arg(long, conflicts_with_all = ["interface", "config"])]
        all: bool,
        /// Print JSON instead of text (an array of daemons when every daemon is shown; each
        /// with a `netns` field).
        #[arg(long)]
        json: bool,
    },
    /// Ask the running daemon to reload its config file and wait for the outcome: exit 0 when
    /// applied or unchanged, 1 when refused (the old configuration keeps running).
    Reload {
        /// The daemon running this config file (its interface.name).
        #[arg(long, env = "TUNNELGATE_CONFIG", conflicts_with = "interface")]
        config: Option<PathBuf>,
        /// The daemon of this interface. With neither flag: the only daemon running in this
        /// network namespace.
        #[arg(long)]
        interface: Option<String>,
    },
    /// Print a new base64 private key (like `wg genkey`).
    Genkey,
    /// Print a new base64 preshared key (like `wg genpsk`).
    Genpsk,
    /// Print this message or the help of the given subcommand.
    Help {
        /// The subcommand to explain (`help import wg-quick` for a nested one).
        command: Vec<String>,
    },
    /// Convert another tool's configuration to tunnelgate's TOML, printed on stdout.
    #[command(subcommand)]
    Import(Import),
    /// Read a base64 private key on stdin, print its public key (like `wg pubkey`).
    Pubkey,
    /// A drop-in for `wireguard-go IFNAME` (also run as `tunnelgate-wg`): create the
    /// interface, serve UAPI, nothing else; go to the background once ready.
    Userspace {
        /// Stay in the foreground (also WG_PROCESS_FOREGROUND=1).
        #[arg(short = 'f', long)]
        foreground: bool,
        /// The interface to create.
        interface: String,
        /// Serve /healthz, /readyz and /metrics on this address (e.g. 127.0.0.1:9002).
        #[arg(long, env = tunnelgate::shell::userspace::HEALTH_ENV, value_name = "ADDR")]
        health: Option<std::net::SocketAddr>,
        #[command(flatten)]
        takeover: tunnelgate::shell::userspace::TakeoverArgs,
        #[command(flatten)]
        log: LogArgs,
        #[command(flatten)]
        seccomp: SeccompArgs,
    },
    /// Write the manual pages (tunnelgate(8) and one per command) into DIR, which must exist
    /// and hold none of them yet.
    /// For packaging: scripts/install.sh runs it, and so scripts/deb.sh.
    #[command(hide = true)]
    Man {
        /// The folder to write them into (e.g. a staging man8/).
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    // Run as `tunnelgate-wg` (wg-quick's WG_QUICK_USERSPACE_IMPLEMENTATION): wireguard-go's
    // command line, `tunnelgate userspace` behaviour.
    if std::env::args_os()
        .next()
        .is_some_and(|a| tunnelgate::shell::userspace::is_wg_name(&a))
    {
        // wireguard-go's command line has no room for flags: the environment only.
        match tunnelgate::shell::tuning::seccomp_policy() {
            Ok(policy) => tunnelgate::shell::seccomp::set_policy(policy),
            Err(e) => {
                eprintln!("tunnelgate-wg: {e}");
                return ExitCode::from(2);
            }
        }
        return tunnelgate::shell::userspace::wg_main();
    }
    let cli: Cli = match tunnelgate::cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    match cli.command {
        Command::Genkey => {
            println!("{}", SecretKey::generate().expose_base64());
            ExitCode::SUCCESS
        }
        Command::Pubkey => pubkey(),
        Command::Genpsk => {
            println!("{}", SecretKey::generate_preshared().expose_base64());
            ExitCode::SUCCESS
        }
        Command::Import(Import::WgQuick {
            file,
            key_file,
            force,
        }) => tunnelgate::shell::import::wg_quick(&file, key_file.as_deref(), force),
        Command::Userspace {
            foreground,
            interface,
            health,
            takeover,
            log,
            seccomp,
        } => {
            tunnelgate::shell::seccomp::set_policy(seccomp.seccomp);
            tunnelgate::shell::userspace::run(
                foreground,
                &interface,
                health,
                takeover.answer(),
                log.log_format,
            )
        }
        Command::Help { command } => help(&command),
        Command::Man { dir } => man(&dir),
        Command::Check { config, json } => match load_config(&config) {
            Ok(c) => check(&config, &c, json),
            Err(e) => config_error(&e),
        },
        Command::Run {
            config,
            log,
            seccomp,
        } => {
            init_logging(log.log_format);
            tunnelgate::shell::seccomp::set_policy(seccomp.seccomp);
            run(config)
        }
        Command::Status {
            config,
            interface,
            all,
            json,
        } => status(config, interface, all, json),
        Command::Reload { config, interface } => reload(config, interface),
    }
}

/// Which daemon a command means: `--interface`, else the interface.name of `--config` (read
/// leniently: a reload must find the daemon even when the file it is asked to take is
/// invalid), else `None` (every daemon).
fn chosen_interface(
    what: &str,
    config: Option<PathBuf>,
    interface: Option<String>,
) -> Result<Option<String>, ExitCode> {
    if let Some(n) = interface {
        return Ok(Some(n));
    }
    let Some(path) = config else {
        return Ok(None);
    };
    let text = tunnelgate::shell::config_file::read_config_text(&path).map_err(|e| {
        eprintln!(
            "tunnelgate {what}: cannot read {}: {e} (or name the interface with --interface)",
            path.display()
        );
        ExitCode::from(2)
    })?;
    match tunnelgate::config::interface_name_of(&text) {
        Some(name) => Ok(Some(name)),
        None => {
            // Say what is wrong with the file, as `check` would.
            match load_config(&path) {
                Err(e) => eprintln!("tunnelgate {what}: {e}"),
                Ok(_) => eprintln!("tunnelgate {what}: {}: no interface.name", path.display()),
            }
            eprintln!(
                "tunnelgate {what}: cannot tell which daemon runs {}; name it with --interface",
                path.display()
            );
            Err(ExitCode::from(1))
        }
    }
}

fn reload(config: Option<PathBuf>, interface: Option<String>) -> ExitCode {
    use tunnelgate::shell::status_client::request_reload;
    use tunnelgate::telemetry::status::ReloadOutcome;
    let name = match chosen_interface("reload", config, interface) {
        Ok(Some(n)) => n,
        Ok(None) => match live_daemons(false).all_answered("reload") {
            Err(code) => return code,
            Ok(daemons) => match daemons.as_slice() {
                [daemon] => daemon.name.clone(),
                [] => {
                    eprintln!(
                    "tunnelgate reload: no tunnelgate daemon is running in this network namespace (no live socket in {})",
                    tunnelgate::shell::status_client::run_dir().display()
                );
                    return ExitCode::from(1);
                }
                several => {
                    let names: Vec<&str> = several.iter().map(|d| d.name.as_str()).collect();
                    eprintln!(
                    "tunnelgate reload: several daemons run in this network namespace ({}); name one with --interface or --config",
                    names.join(", ")
                );
                    return ExitCode::from(2);
                }
            },
        },
        Err(code) => return code,
    };
    match request_reload(&status_socket_path(&name)) {
        Ok(Ok(ReloadOutcome::Applied)) => {
            println!("{name}: configuration reloaded");
            ExitCode::SUCCESS
        }
        Ok(Ok(ReloadOutcome::Unchanged)) => {
            println!("{name}: configuration unchanged");
            ExitCode::SUCCESS
        }
        Ok(Err(why)) => {
            eprintln!(
                "tunnelgate reload: {name}: refused, the running configuration is kept: {why}"
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("tunnelgate reload: {e}");
            ExitCode::from(1)
        }
    }
}

/// One daemon that answered on its status socket.
struct LiveDaemon {
    name: String,
    snapshot: tunnelgate::telemetry::Snapshot,
}

/// The daemons found in the run directory, and the sockets (or the directory) this user may
/// not open: those may be daemons too, so they are never taken for "none running".
struct Found {
    daemons: Vec<LiveDaemon>,
    denied: Vec<PathBuf>,
}

impl Found {
    /// The daemons, or (having said so on stderr) exit 1 when a socket could not be opened
    /// for lack of permission.
    fn all_answered(self, what: &str) -> Result<Vec<LiveDaemon>, ExitCode> {
        if self.denied.is_empty() {
            return Ok(self.daemons);
        }
        for path in &self.denied {
            eprintln!(
                "tunnelgate {what}: permission denied: run as root (cannot open {})",
                path.display()
            );
        }
        Err(ExitCode::from(1))
    }
}

/// Every daemon that answers on its status socket, with its snapshot; stale sockets skipped.
/// Without `every_netns`, only those of this network namespace (the socket folder is shared
/// by every namespace, like wireguard-go's).
fn live_daemons(every_netns: bool) -> Found {
    use tunnelgate::shell::status_client::{own_netns_id, run_dir, status_sockets_in};
    use tunnelgate::telemetry::status::same_netns;
    use tunnelgate::telemetry::status::StatusError;
    let own = own_netns_id();
    let dir = run_dir();
    let mut denied = Vec::new();
    if let Err(e) = std::fs::read_dir(&dir) {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            denied.push(dir.clone());
        }
    }
    let daemons = status_sockets_in(&dir)
        .into_iter()
        .filter_map(|path| match query_status(&path) {
            Ok(snapshot) => Some(LiveDaemon {
                name: snapshot.interface.name.clone(),
                snapshot,
            }),
            Err(StatusError::PermissionDenied { path }) => {
                denied.push(path);
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "skipping a status socket");
                None
            }
        })
        .filter(|d| every_netns || same_netns(d.snapshot.netns_id.as_deref(), own.as_deref()))
        .collect();
    Found { daemons, denied }
}

/// A snapshot as JSON, with `netns`: the daemon's namespace as status names it.
fn snapshot_json(
    snap: &tunnelgate::telemetry::Snapshot,
    named: &[(String, u64)],
) -> Result<serde_json::Value, serde_json::Error> {
    let mut value = serde_json::to_value(snap)?;
    if let serde_json::Value::Object(map) = &mut value {
        let netns = tunnelgate::telemetry::status::netns_display(snap.netns_id.as_deref(), named);
        map.insert("netns".into(), serde_json::Value::String(netns));
    }
    Ok(value)
}

fn print_json(value: &serde_json::Value) -> ExitCode {
    match serde_json::to_string_pretty(value) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tunnelgate status: {e}");
            ExitCode::from(1)
        }
    }
}

/// `tunnelgate status` with no daemon named: every daemon of this namespace (`--all`: of
/// every namespace, each with a `netns:` line), like `wg show`.
fn status_all(every_netns: bool, json: bool) -> ExitCode {
    use tunnelgate::shell::status_client::{named_netns, run_dir};
    use tunnelgate::telemetry::status::netns_display;
    let daemons = match live_daemons(every_netns).all_answered("status") {
        Ok(d) => d,
        Err(code) => return code,
    };
    let named = named_netns();
    if json {
        let values: Result<Vec<serde_json::Value>, _> = daemons
            .iter()
            .map(|d| snapshot_json(&d.snapshot, &named))
            .collect();
        return match values {
            Ok(v) => print_json(&serde_json::Value::Array(v)),
            Err(e) => {
                eprintln!("tunnelgate status: {e}");
                ExitCode::from(1)
            }
        };
    }
    if daemons.is_empty() {
        let scope = if every_netns {
            "on this host"
        } else {
            "in this network namespace (--all: in any)"
        };
        println!(
            "no tunnelgate daemon is running {scope}: no live socket in {}",
            run_dir().display()
        );
        return ExitCode::SUCCESS;
    }
    let now = now_unix();
    let texts: Vec<String> = daemons
        .iter()
        .map(|d| {
            let text = render_status_text(&d.snapshot, now);
            if !every_netns {
                return text;
            }
            // The namespace goes right under the `interface:` line.
            let netns = netns_display(d.snapshot.netns_id.as_deref(), &named);
            match text.split_once('\n') {
                Some((first, rest)) => format!("{first}\n  netns: {netns}\n{rest}"),
                None => format!("{text}\n  netns: {netns}\n"),
            }
        })
        .collect();
    print!("{}", texts.join("\n"));
    ExitCode::SUCCESS
}

fn status(config: Option<PathBuf>, interface: Option<String>, all: bool, json: bool) -> ExitCode {
    let name = match chosen_interface("status", config, interface) {
        Ok(Some(n)) => n,
        Ok(None) => return status_all(all, json),
        Err(code) => return code,
    };
    match query_status(&status_socket_path(&name)) {
        Ok(snap) if json => {
            let named = tunnelgate::shell::status_client::named_netns();
            match snapshot_json(&snap, &named) {
                Ok(value) => print_json(&value),
                Err(e) => {
                    eprintln!("tunnelgate status: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Ok(snap) => {
            print!("{}", render_status_text(&snap, now_unix()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tunnelgate status: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints the plan: routes, sysctls, the exact firewall text for the chosen backend, and the
/// tuning a start would get (the environment's knobs, the packet readers' priority and why).
fn check(path: &std::path::Path, config: &tunnelgate::config::Config, json: bool) -> ExitCode {
    use tunnelgate::rules::desired::firewall_needed;
    let tuning = tunnelgate::shell::tuning::Tuning::from_env();
    for w in tunnelgate::shell::config_file::warnings(path, config)
        .into_iter()
        .chain(tuning.warnings.iter().cloned())
    {
        eprintln!("tunnelgate check: warning: {w}");
    }
    let firewall = if firewall_needed(config) {
        match tunnelgate::shell::firewall::choose(config.firewall.mode) {
            Ok(backend) => {
                // Ports the daemon would bind: the configured ones (a random port shows as 0).
                let facts = tunnelgate::rules::desired::RuntimeFacts::fresh_start(
                    config,
                    config.interface.listen_port,
                );
                let set = tunnelgate::rules::desired::desired(config, &facts, &Default::default());
                Some((backend.to_string(), backend.render(&set)))
            }
            Err(e) => {
                eprintln!("tunnelgate check: firewall.mode: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let mut plan = tunnelgate::core::check_report::render_plan(
        config,
        firewall.as_ref().map(|(b, t)| (b.as_str(), t.as_str())),
    );
    let tuning = check_tuning(config, tuning);
    if json {
        return print_json(&serde_json::json!({
            "interface": config.interface.name,
            "firewall_backend": firewall.as_ref().map(|(b, _)| b),
            "plan": plan,
            "tuning": tuning,
        }));
    }
    plan.push('\n');
    let _ = tunnelgate::telemetry::tuning::write_tuning(&mut plan, &tuning);
    let _ = std::io::stdout().write_all(plan.as_bytes());
    ExitCode::SUCCESS
}

/// The tuning a start of `config` would get here: `tuning`, the workers it would run, and how
/// its packet readers would reach real-time priority (read from this process, nothing changed).
fn check_tuning(
    config: &tunnelgate::config::Config,
    tuning: tunnelgate::shell::tuning::Tuning,
) -> tunnelgate::telemetry::tuning::TuningStatus {
    use tunnelgate::shell::dataplane::{default_workers, ThreadSetup};
    let facts = tunnelgate::shell::priority::facts(&tuning);
    let access = tunnelgate::core::priority::access::access(tuning.rt_priority, &facts);
    let workers = config
        .interface
        .workers
        .map_or_else(default_workers, usize::from);
    let setup = ThreadSetup {
        access,
        ..ThreadSetup::normal_priority(tuning)
    };
    tunnelgate::shell::observe::tuning_status(&setup, workers, None)
}

/// `tunnelgate help [COMMAND...]`: exactly what `tunnelgate COMMAND... --help` prints.
fn help(command: &[String]) -> ExitCode {
    use clap::CommandFactory;
    let mut args = vec!["tunnelgate".to_string()];
    args.extend(command.iter().cloned());
    args.push("--help".into());
    match Cli::command().try_get_matches_from(args) {
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        Err(_) => {
            eprintln!(
                "tunnelgate help: no subcommand {:?}: expected one of those `tunnelgate help` lists",
                command.join(" ")
            );
            ExitCode::from(2)
        }
        // `--help` always ends the parse; nothing else is printed.
        Ok(_) => ExitCode::SUCCESS,
    }
}

/// `tunnelgate man DIR`: the manual pages, from this command line's own definition. DIR must be
/// a folder already: a missing one is said so, with the command that makes it (the pages are
/// written by root into staging folders, so this makes no folder on its own).
fn man(dir: &std::path::Path) -> ExitCode {
    use clap::CommandFactory;
    if !dir.is_dir() {
        let why = if dir.exists() {
            "is not a folder"
        } else {
            "does not exist"
        };
        eprintln!(
            "tunnelgate man: {} {why}: give a folder that exists (mkdir -p {0} makes one)",
            dir.display()
        );
        return ExitCode::from(1);
    }
    let written = tunnelgate::cli::man_pages(Cli::command()).and_then(|pages| {
        pages
            .into_iter()
            .map(|(file, page)| {
                // A new file only: never through a link planted in DIR, never over a page
                // already there.
                let path = dir.join(&file);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, &page))
                    .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
                    .map(|()| file)
            })
            .collect::<std::io::Result<Vec<String>>>()
    });
    match written {
        Ok(pages) => {
            for page in pages {
                println!("{page}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tunnelgate man: cannot write a page: {e}");
            ExitCode::from(1)
        }
    }
}

/// A private key is 44 characters; `wg genkey` output, a newline and stray whitespace fit in
/// this many bytes. More is not a key, and `pubkey < /dev/zero` must not read forever.
const PUBKEY_INPUT_LIMIT: u64 = 4096;

fn pubkey() -> ExitCode {
    let mut bytes = Vec::new();
    if std::io::stdin()
        .take(PUBKEY_INPUT_LIMIT + 1)
        .read_to_end(&mut bytes)
        .is_err()
    {
        eprintln!("tunnelgate pubkey: cannot read stdin");
        return ExitCode::from(2);
    }
    if bytes.len() as u64 > PUBKEY_INPUT_LIMIT {
        eprintln!(
            "tunnelgate pubkey: more than {PUBKEY_INPUT_LIMIT} bytes on stdin: expected one base64 private key"
        );
        return ExitCode::from(2);
    }
    let text = String::from_utf8_lossy(&bytes);
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
    use tunnelgate::shell::privilege;
    if let Some(hint) = privilege::run_refusal(privilege::permitted_now()) {
        eprintln!("tunnelgate: {hint}");
        return ExitCode::from(1);
    }
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(e) => return config_error(&e),
    };
    for w in tunnelgate::shell::config_file::warnings(&path, &config) {
        tracing::warn!("{w}");
    }
    tunnelgate::shell::process::main(tunnelgate::shell::process::Launch::Run {
        config: Box::new(config),
        path,
    })
}
