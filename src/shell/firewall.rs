//! Runs the rendered rule text: one `nft -f -` transaction on our table, or one
//! `iptables-restore --noflush` per family on our chains (both named after the tunnel
//! interface, so another daemon's are never read or touched); reads what is installed back for
//! drift checks; removes it all on shutdown. No rule decisions here (the forwarding sysctls are in
//! [`super::forwarding`]).
//!
//! Every program runs under [`Limits`]: in a process group of its own, killed (the whole group)
//! and reaped once it has run for [`COMMAND_TIMEOUT`] or the daemon stops, so a hung `nft` is a
//! failed apply that names it, never a stuck daemon.

use crate::config::FirewallMode;
use crate::rules::{iptables, nft, Family, RuleSet};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one external command (`nft`, `iptables-restore`, `iptables-save`) may run before it
/// is killed. A 10,000-port apply takes a fifth of a second; ten seconds is a command that will
/// not finish.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a running command's stop flag is looked at.
const STOP_CHECK: Duration = Duration::from_millis(100);
/// How long a killed command may take to be reaped before it is left behind (a process stuck
/// in the kernel cannot die at once; it is logged, never waited for).
const REAP_WAIT: Duration = Duration::from_secs(2);

/// What every command of a call runs under: at most `timeout` each, and given up at once when
/// `stop` is set (the daemon is stopping: its teardown must not wait behind a hung apply).
#[derive(Debug, Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub stop: Arc<AtomicBool>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            timeout: COMMAND_TIMEOUT,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    /// `legacy`: the xtables binaries (`iptables-legacy-restore`), else the default ones.
    Iptables {
        legacy: bool,
    },
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Nftables => "nftables",
            Backend::Iptables { legacy: false } => "iptables",
            Backend::Iptables { legacy: true } => "iptables-legacy",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("{program} not found: install it, or choose another firewall.mode")]
    Missing { program: String },
    #[error("{program} failed: {stderr}")]
    Failed { program: String, stderr: String },
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} did not finish within {} s and was killed", .timeout.as_secs_f64())]
    TimedOut { program: String, timeout: Duration },
    #[error("{program} was killed: the daemon is stopping")]
    Stopped { program: String },
}

/// Why a command was given up before it finished.
enum GaveUp {
    Timeout,
    Stopped,
    Io(std::io::Error),
}

/// What a finished command left.
struct Finished {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

fn run(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
    limits: &Limits,
) -> Result<String, FirewallError> {
    if limits.stop.load(Ordering::Relaxed) {
        return Err(FirewallError::Stopped {
            program: program.into(),
        });
    }
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    // A group of its own: a timeout kills what it started too (a wrapper script's children),
    // which would otherwise hold its pipes open.
    cmd.process_group(0);
    // No real-time class for what the daemon runs, whatever its packet readers may have.
    crate::shell::priority::no_realtime_for(&mut cmd);
    let mut child = cmd.spawn().map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            FirewallError::Missing {
                program: program.into(),
            }
        } else {
            FirewallError::Spawn {
                program: program.into(),
                source,
            }
        }
    })?;
    let deadline = crate::shell::clock::now() + limits.timeout;
    let out = match exchange(
        &mut child,
        stdin.unwrap_or_default().as_bytes(),
        deadline,
        &limits.stop,
    ) {
        Ok(out) => out,
        Err(gave_up) => {
            kill_and_reap(program, &mut child);
            return Err(match gave_up {
                GaveUp::Timeout => FirewallError::TimedOut {
                    program: program.into(),
                    timeout: limits.timeout,
                },
                GaveUp::Stopped => FirewallError::Stopped {
                    program: program.into(),
                },
                GaveUp::Io(source) => FirewallError::Spawn {
                    program: program.into(),
                    source,
                },
            });
        }
    };
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(FirewallError::Failed {
            program: program.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Feeds `input` to the child's stdin while reading its stdout and stderr (none may block the
/// others: a program that writes a lot before it reads would otherwise deadlock with us), then
/// waits for it to exit; gives up at `deadline` or when `stop` is set.
fn exchange(
    child: &mut Child,
    mut input: &[u8],
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Finished, GaveUp> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut stdin = child.stdin.take();
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let fds = [
        stdin.as_ref().map(|p| p.as_raw_fd()),
        stdout.as_ref().map(|p| p.as_raw_fd()),
        stderr.as_ref().map(|p| p.as_raw_fd()),
    ];
    for fd in fds.into_iter().flatten() {
        use nix::fcntl::{fcntl, FcntlArg, OFlag};
        fcntl(fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
            .map_err(|e| GaveUp::Io(std::io::Error::from(e)))?;
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while stdin.is_some() || stdout.is_some() || stderr.is_some() {
        let wait = time_left(deadline, stop)?;
        {
            let mut polled = Vec::with_capacity(3);
            if let Some(p) = &stdin {
                polled.push(PollFd::new(p.as_fd(), PollFlags::POLLOUT));
            }
            if let Some(p) = &stdout {
                polled.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
            }
            if let Some(p) = &stderr {
                polled.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
            }
            let timeout = PollTimeout::try_from(wait.min(STOP_CHECK)).unwrap_or(PollTimeout::MAX);
            match poll(&mut polled, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(GaveUp::Io(e.into())),
            }
        }
        // Each pipe is tried whether or not it was reported ready: a pipe that is not just
        // answers WouldBlock.
        if let Some(pipe) = &mut stdin {
            match pipe.write(input) {
                Ok(n) => input = &input[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // A program that exits early (a parse error) closes its stdin: its exit status
                // and stderr say why; EPIPE would only hide that.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => input = &[],
                Err(e) => return Err(GaveUp::Io(e)),
            }
            if input.is_empty() {
                // Closing it is the end of the input.
                stdin = None;
            }
        }
        read_available(&mut stdout, &mut out)?;
        read_available(&mut stderr, &mut err)?;
    }
    // Both pipes closed: it is exiting.
    let mut nap = Duration::from_micros(100);
    loop {
        if let Some(status) = child.try_wait().map_err(GaveUp::Io)? {
            return Ok(Finished {
                status,
                stdout: out,
                stderr: err,
            });
        }
        let wait = time_left(deadline, stop)?;
        std::thread::sleep(nap.min(wait));
        nap = (nap * 2).min(Duration::from_millis(10));
    }
}

/// Reads what a non-blocking pipe has now; drops it at its end.
fn read_available(pipe: &mut Option<impl Read>, into: &mut Vec<u8>) -> Result<(), GaveUp> {
    let Some(p) = pipe else {
        return Ok(());
    };
    let mut buf = [0u8; 16 * 1024];
    loop {
        match p.read(&mut buf) {
            Ok(0) => {
                *pipe = None;
                return Ok(());
            }
            Ok(n) => into.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(GaveUp::Io(e)),
        }
    }
}

/// How long a command may still run, or why it must not.
fn time_left(deadline: Instant, stop: &AtomicBool) -> Result<Duration, GaveUp> {
    if stop.load(Ordering::Relaxed) {
        return Err(GaveUp::Stopped);
    }
    let left = deadline.saturating_duration_since(crate::shell::clock::now());
    if left.is_zero() {
        return Err(GaveUp::Timeout);
    }
    Ok(left)
}

/// Kills the command's process group and reaps it (waiting at most [`REAP_WAIT`]), so no
/// zombie and no orphaned child of a wrapper is left behind.
fn kill_and_reap(program: &str, child: &mut Child) {
    use nix::sys::signal::{killpg, Signal};
    if let Ok(pgid) = i32::try_from(child.id()) {
        let _ = killpg(nix::unistd::Pid::from_raw(pgid), Signal::SIGKILL);
    }
    let _ = child.kill();
    let deadline = crate::shell::clock::now() + REAP_WAIT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if crate::shell::clock::now() >= deadline => {
                tracing::warn!(
                    program,
                    pid = child.id(),
                    "A killed command has not exited yet; leaving it behind"
                );
                return;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn exists(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(program).is_file()))
}

/// The binaries of a backend.
fn restore_bin(family: Family, legacy: bool) -> &'static str {
    match (family, legacy) {
        (Family::V4, false) => "iptables-restore",
        (Family::V6, false) => "ip6tables-restore",
        (Family::V4, true) => "iptables-legacy-restore",
        (Family::V6, true) => "ip6tables-legacy-restore",
    }
}

fn save_bin(family: Family, legacy: bool) -> &'static str {
    match (family, legacy) {
        (Family::V4, false) => "iptables-save",
        (Family::V6, false) => "ip6tables-save",
        (Family::V4, true) => "iptables-legacy-save",
        (Family::V6, true) => "ip6tables-legacy-save",
    }
}

/// Whether the daemon will use iptables-legacy: the same choice its executor makes on the
/// first apply ([`choose`]), made before the privileges are dropped, while the legacy tools can
/// still be read (without `CAP_NET_RAW`, `iptables-legacy-save` fails and `auto` would never
/// see legacy rules). No firewall tools, or an error: not legacy.
pub fn uses_legacy_iptables(mode: FirewallMode) -> bool {
    mode != FirewallMode::Nftables && matches!(choose(mode), Ok(Backend::Iptables { legacy: true }))
}

/// Picks the backend. `auto` follows the host: legacy xtables rules present -> iptables-legacy
/// (an nftables table beside them would be evaluated separately and confuse operators);
/// otherwise nftables if `nft` exists (iptables-nft rules live in nftables too); else iptables.
/// `TUNNELGATE_IPTABLES=legacy|nft` chooses the iptables flavour in `iptables` mode.
pub fn choose(mode: FirewallMode) -> Result<Backend, FirewallError> {
    choose_within(mode, &Limits::default())
}

/// [`choose`], with the commands it runs under `limits`.
pub fn choose_within(mode: FirewallMode, limits: &Limits) -> Result<Backend, FirewallError> {
    // A value refused is in the start's warnings (`shell::tuning`); the host decides then.
    let flavour = crate::shell::tuning::iptables_flavour();
    let legacy_rules = || {
        [Family::V4, Family::V6].iter().any(|f| {
            run(save_bin(*f, true), &[], None, limits)
                .is_ok_and(|s| s.lines().any(|l| l.starts_with("-A ")))
        })
    };
    match mode {
        FirewallMode::Nftables => {
            if exists("nft") {
                Ok(Backend::Nftables)
            } else {
                Err(FirewallError::Missing {
                    program: "nft".into(),
                })
            }
        }
        FirewallMode::Iptables => {
            let legacy = match flavour {
                Some(legacy) => legacy,
                None => legacy_rules(),
            };
            let bin = restore_bin(Family::V4, legacy);
            if exists(bin) {
                Ok(Backend::Iptables { legacy })
            } else {
                Err(FirewallError::Missing {
                    program: bin.into(),
                })
            }
        }
        FirewallMode::Auto => {
            if exists("iptables-legacy-save") && legacy_rules() {
                Ok(Backend::Iptables { legacy: true })
            } else if exists("nft") {
                Ok(Backend::Nftables)
            } else if exists("iptables-restore") {
                Ok(Backend::Iptables { legacy: false })
            } else {
                Err(FirewallError::Missing {
                    program: "nft (or iptables-restore)".into(),
                })
            }
        }
    }
}

/// Whether IPv6 is usable here (ip6tables needs it; nftables does not care).
fn ipv6_enabled() -> bool {
    std::path::Path::new("/proc/sys/net/ipv6").exists()
}

impl Backend {
    /// The text that would be applied now, for `check` and logs. For iptables, jumps that
    /// already exist are not repeated, so the text depends on the system's current state.
    pub fn render(&self, set: &RuleSet) -> String {
        match self {
            Backend::Nftables => nft::render(set),
            Backend::Iptables { legacy } => {
                let mut out = String::new();
                for family in [Family::V4, Family::V6] {
                    let jumps = run(save_bin(family, *legacy), &[], None, &Limits::default())
                        .map(|s| iptables::parse_jumps(&set.tunnel, &s))
                        .unwrap_or_default();
                    out.push_str(&format!("# {}\n", restore_bin(family, *legacy)));
                    out.push_str(&iptables::render(set, family, &jumps));
                }
                out
            }
        }
    }

    /// Replaces our rules with `set` atomically (per family for iptables). Nothing is read
    /// back here: that is [`Backend::installed`], which the drift check calls. With nftables and the
    /// set known to be `installed`, a change of map elements only is applied as just that
    /// ([`nft::render_update`]); should that transaction fail (the table was changed or
    /// removed by hand), nothing of it was applied and the full replace runs instead.
    pub fn apply(
        &self,
        set: &RuleSet,
        installed: Option<&RuleSet>,
        limits: &Limits,
    ) -> Result<(), FirewallError> {
        match self {
            Backend::Nftables => {
                let update = installed.and_then(|old| nft::render_update(old, set));
                match update {
                    Some(script) if !nft::has_statements(&script) => {}
                    Some(script) => {
                        tracing::info!("Only map elements differ: changing them in place");
                        if let Err(e) = run("nft", &["-f", "-"], Some(&script), limits) {
                            if matches!(
                                e,
                                FirewallError::TimedOut { .. } | FirewallError::Stopped { .. }
                            ) {
                                // A hung nft would hang again: the core retries later.
                                return Err(e);
                            }
                            tracing::warn!(
                                error = %e,
                                "Changing map elements failed; replacing the whole table"
                            );
                            run("nft", &["-f", "-"], Some(&nft::render(set)), limits)?;
                        }
                    }
                    None => {
                        run("nft", &["-f", "-"], Some(&nft::render(set)), limits)?;
                    }
                }
                Ok(())
            }
            Backend::Iptables { legacy } => {
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    let save = run(save_bin(family, *legacy), &[], None, limits)?;
                    let jumps = iptables::parse_jumps(&set.tunnel, &save);
                    let text = iptables::render(set, family, &jumps);
                    run(
                        restore_bin(family, *legacy),
                        &["--noflush"],
                        Some(&text),
                        limits,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// What the daemon for interface `tunnel` has installed now, normalized (empty when
    /// nothing is). Other tables and chains, another daemon's included, are not part of it.
    pub fn installed(&self, tunnel: &str, limits: &Limits) -> Result<String, FirewallError> {
        match self {
            Backend::Nftables => match run(
                "nft",
                &["list", "table", "inet", &crate::rules::nft_table(tunnel)],
                None,
                limits,
            ) {
                Ok(listing) => Ok(nft::normalize_listing(&listing)),
                Err(FirewallError::Failed { .. }) => Ok(String::new()),
                Err(e) => Err(e),
            },
            Backend::Iptables { legacy } => {
                let mut out = String::new();
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    out.push_str(&iptables::owned_lines(
                        tunnel,
                        &run(save_bin(family, *legacy), &[], None, limits)?,
                    ));
                }
                Ok(out)
            }
        }
    }

    /// Removes every rule and chain of the daemon for interface `tunnel`; leaves everything
    /// else alone, another daemon's table or chains included.
    pub fn remove(&self, tunnel: &str, limits: &Limits) -> Result<(), FirewallError> {
        match self {
            Backend::Nftables => run(
                "nft",
                &["-f", "-"],
                Some(&nft::render_delete(tunnel)),
                limits,
            )
            .map(|_| ()),
            Backend::Iptables { legacy } => {
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    let save = run(save_bin(family, *legacy), &[], None, limits)?;
                    let jumps = iptables::parse_jumps(tunnel, &save);
                    run(
                        restore_bin(family, *legacy),
                        &["--noflush"],
                        Some(&iptables::render_delete(tunnel, &jumps, family)),
                        limits,
                    )?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(ms: u64) -> Limits {
        Limits {
            timeout: Duration::from_millis(ms),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The pids of processes whose command line holds `arg` as a whole argument.
    fn processes_with_arg(arg: &str) -> Vec<u32> {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return vec![];
        };
        let needle = format!("\0{arg}\0");
        procs
            .filter_map(Result::ok)
            .filter_map(|p| {
                let pid: u32 = p.file_name().to_str()?.parse().ok()?;
                let mut cmdline = vec![0];
                cmdline.extend(std::fs::read(p.path().join("cmdline")).ok()?);
                cmdline
                    .windows(needle.len())
                    .any(|w| w == needle.as_bytes())
                    .then_some(pid)
            })
            .collect()
    }

    #[test]
    fn a_command_that_hangs_is_killed_with_its_children_at_the_timeout() {
        let started = crate::shell::clock::now();
        // The shell's child holds stdout open: killing only the shell would leave the pipe open.
        let err = run(
            "sh",
            &["-c", "sleep 31.4159; echo late"],
            None,
            &limits(300),
        )
        .expect_err("timed out");
        let took = crate::shell::clock::since(started);
        assert!(took < Duration::from_secs(3), "gave up after {took:?}");
        assert_eq!(
            err.to_string(),
            "sh did not finish within 0.3 s and was killed"
        );
        assert_eq!(
            processes_with_arg("31.4159"),
            Vec::<u32>::new(),
            "the shell's child was killed with it"
        );
    }

    #[test]
    fn input_the_command_never_reads_does_not_block_past_the_timeout() {
        // Far more than a pipe holds: a blocking write would wait forever.
        let text = "x".repeat(4 << 20);
        let started = crate::shell::clock::now();
        let err = run("sleep", &["30"], Some(&text), &limits(300)).expect_err("timed out");
        assert!(matches!(err, FirewallError::TimedOut { .. }), "{err}");
        assert!(crate::shell::clock::since(started) < Duration::from_secs(3));
    }

    #[test]
    fn a_stop_kills_the_running_command_at_once_and_refuses_the_next() {
        let limits = limits(30_000);
        let stop = limits.stop.clone();
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Relaxed);
        });
        let started = crate::shell::clock::now();
        let err = run("sleep", &["30"], None, &limits).expect_err("stopped");
        assert!(crate::shell::clock::since(started) < Duration::from_secs(3));
        assert_eq!(err.to_string(), "sleep was killed: the daemon is stopping");
        stopper.join().expect("stopper");
        let err = run("true", &[], None, &limits).expect_err("refused");
        assert!(matches!(err, FirewallError::Stopped { .. }), "{err}");
    }

    #[test]
    fn output_input_and_failures_come_through_as_before() {
        // `cat` echoes a large input: stdin and stdout flow at once.
        let text = "0123456789abcdef\n".repeat(200_000);
        let echoed = run("cat", &[], Some(&text), &limits(10_000)).expect("cat");
        assert!(
            echoed == text,
            "{} bytes back of {}",
            echoed.len(),
            text.len()
        );
        let err = run(
            "sh",
            &["-c", "echo bad rule >&2; exit 3"],
            None,
            &limits(10_000),
        )
        .expect_err("fails");
        assert_eq!(err.to_string(), "sh failed: bad rule");
        // It exits without reading its input: its stderr says why, not EPIPE.
        let err = run(
            "sh",
            &["-c", "echo parse error >&2; exit 1"],
            Some(&text),
            &limits(10_000),
        )
        .expect_err("fails");
        assert_eq!(err.to_string(), "sh failed: parse error");
        let err = run("tunnelgate-no-such-tool", &[], None, &limits(10_000)).expect_err("missing");
        assert!(matches!(err, FirewallError::Missing { .. }), "{err}");
    }
}
