//! The wireguard-go drop-in: `tunnelgate userspace [-f] IFNAME`, or the binary run as
//! `tunnelgate-wg [-f] IFNAME` (a symlink), which is what wg-quick calls through
//! `WG_QUICK_USERSPACE_IMPLEMENTATION`. Creates the TUN device and serves UAPI and the status
//! socket (`tunnelgate status --interface IFNAME`), and `/healthz`, `/readyz`, `/metrics` when
//! asked (`--health ADDR`, or `$TUNNELGATE_HEALTH` for `tunnelgate-wg`), nothing else; goes to
//! the background once they are ready (unless `-f` or `WG_PROCESS_FOREGROUND=1`), and exits when
//! the interface is deleted, its UAPI socket is removed, or on SIGTERM/SIGINT. This file parses
//! the arguments and goes to the background; `shell::process` runs the rest.
#![allow(unsafe_code)]

use crate::shell::logging::{init_logging, LogFormat};
use crate::shell::process::{Launch, OnReady};
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;

/// The name under which the binary behaves as `tunnelgate userspace`.
pub const WG_NAME: &str = crate::core::control::WG_PROGRAM;

/// What wireguard-go reads to stay in the foreground.
const FOREGROUND_ENV: &str = "WG_PROCESS_FOREGROUND";

/// Where `tunnelgate-wg` (whose command line is wireguard-go's) reads a health address from.
pub const HEALTH_ENV: &str = "TUNNELGATE_HEALTH";

/// Where `tunnelgate-wg` reads `--takeover-any-source` from.
pub const TAKEOVER_ANY_SOURCE_ENV: &str = "TUNNELGATE_TAKEOVER_ANY_SOURCE";

/// `tunnelgate-wg` takes wireguard-go's arguments.
#[derive(clap::Parser)]
#[command(
    name = WG_NAME,
    version,
    about = "A userspace WireGuard implementation, command-line compatible with wireguard-go"
)]
struct WgArgs {
    /// Stay in the foreground (also WG_PROCESS_FOREGROUND=1).
    #[arg(short = 'f', long)]
    foreground: bool,
    /// The interface to create.
    interface: String,
    /// Serve /healthz, /readyz and /metrics on this address (e.g. 127.0.0.1:9002).
    #[arg(long, env = HEALTH_ENV, value_name = "ADDR")]
    health: Option<std::net::SocketAddr>,
    #[command(flatten)]
    takeover: TakeoverArgs,
}

/// The takeover opt-in, for both spellings of the drop-in.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct TakeoverArgs {
    /// UNSAFE outside a closed network: answer a data message for a session this process does
    /// not have with a handshake to its source, proven or not. An off-path attacker who saw one
    /// of a peer's data messages can then move the tunnel through itself. Without it, a
    /// takeover goes only to an endpoint where the peer authenticated.
    #[arg(long, env = TAKEOVER_ANY_SOURCE_ENV, value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    pub takeover_any_source: bool,
}

impl TakeoverArgs {
    pub fn answer(self) -> crate::core::takeover::Answer {
        if self.takeover_any_source {
            crate::core::takeover::Answer::AnySource
        } else {
            crate::core::takeover::Answer::KnownEndpoints
        }
    }
}

/// Whether `argv0` (the program name it was run as) asks for wireguard-go's command line.
pub fn is_wg_name(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == WG_NAME)
}

/// The binary's entry point when run as `tunnelgate-wg`.
pub fn wg_main() -> ExitCode {
    match crate::cli::parse_or_exit::<WgArgs>() {
        Ok(args) => run(
            args.foreground,
            &args.interface,
            args.health,
            args.takeover.answer(),
            LogFormat::default(),
        ),
        Err(code) => code,
    }
}

/// Runs the drop-in for interface `name` (with the health endpoint on `health`, if given). In
/// the background (the default), returns in the parent once the child has the interface, the
/// UAPI and status sockets (and the health endpoint) ready (exit 0), or has failed (exit 1, its
/// error printed: a part of it that died before it was ready included). The child runs
/// [`crate::shell::process::main`], which exits 1 when a part of it dies later too (heard by
/// whoever reaps it: systemd for a forking unit), and 0 when its interface is deleted.
pub fn run(
    foreground: bool,
    name: &str,
    health: Option<std::net::SocketAddr>,
    answer: crate::core::takeover::Answer,
    log_format: LogFormat,
) -> ExitCode {
    let foreground = foreground
        || std::env::var(FOREGROUND_ENV)
            .map(|v| v == "1")
            .unwrap_or(false);
    let ready: Option<OnReady> = if foreground {
        None
    } else {
        // Before any thread exists: fork copies only the calling thread.
        match daemonize() {
            Ok(Forked::Parent(code)) => return code,
            Ok(Forked::Child(pipe)) => {
                let ready = Ready(pipe);
                Some(Box::new(move |started: Result<(), String>| match started {
                    Ok(()) => ready.ok(),
                    Err(why) => ready.failed(&why),
                }))
            }
            Err(e) => {
                eprintln!("{WG_NAME}: cannot go to the background: {e}");
                return ExitCode::from(1);
            }
        }
    };
    init_logging(log_format);
    crate::shell::process::main(Launch::Userspace {
        name: name.to_string(),
        health,
        answer,
        ready,
    })
}

enum Forked {
    /// In the parent: the exit code to return.
    Parent(ExitCode),
    /// In the child: the write end of the readiness pipe.
    Child(OwnedFd),
}

/// The child's promise to tell the parent how the start went.
struct Ready(OwnedFd);

impl Ready {
    fn ok(self) {
        let mut f = std::fs::File::from(self.0);
        let _ = f.write_all(b"1");
    }

    fn failed(self, why: &str) {
        let mut f = std::fs::File::from(self.0);
        let _ = f.write_all(format!("0{why}").as_bytes());
    }
}

/// Forks; the child starts a new session with stdio on /dev/null; the parent waits on a pipe
/// for the child's verdict ("1", or "0" and the error) and returns the exit code to use. A
/// child that dies before answering closes the pipe: a failure.
fn daemonize() -> std::io::Result<Forked> {
    let mut fds = [0; 2];
    // SAFETY: a two-element array for pipe2.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: no other thread exists yet (called before the runtime and logging start).
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => {
            drop(read);
            // SAFETY: plain system calls on descriptors this process owns.
            #[cfg(feature = "test-hooks")]
            let keep_stderr = crate::shell::test_hooks::keeps_stderr();
            #[cfg(not(feature = "test-hooks"))]
            let keep_stderr = false;
            unsafe {
                libc::setsid();
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    // stdin, stdout and stderr (stderr kept only by a test hook).
                    for fd in 0..3 {
                        if !(fd == 2 && keep_stderr) {
                            libc::dup2(null, fd);
                        }
                    }
                    if null > 2 {
                        libc::close(null);
                    }
                }
            }
            Ok(Forked::Child(write))
        }
        _child => {
            drop(write);
            let mut verdict = Vec::new();
            let _ = std::fs::File::from(read).read_to_end(&mut verdict);
            match verdict.split_first() {
                Some((b'1', _)) => Ok(Forked::Parent(ExitCode::SUCCESS)),
                Some((_, why)) => {
                    eprintln!("{WG_NAME}: {}", String::from_utf8_lossy(why));
                    Ok(Forked::Parent(ExitCode::from(1)))
                }
                None => {
                    eprintln!("{WG_NAME}: the background process exited before it was ready");
                    Ok(Forked::Parent(ExitCode::from(1)))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_symlink_name_is_recognised_by_its_file_name() {
        assert!(is_wg_name("tunnelgate-wg".as_ref()));
        assert!(is_wg_name("/usr/local/bin/tunnelgate-wg".as_ref()));
        assert!(!is_wg_name("tunnelgate".as_ref()));
        assert!(!is_wg_name("/opt/tunnelgate-wg/tunnelgate".as_ref()));
        assert!(!is_wg_name("tunnelgate-wg2".as_ref()));
    }
}
