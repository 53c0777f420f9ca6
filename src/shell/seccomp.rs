//! Installs the packet threads' seccomp filter: the list and its program are
//! `core::seccomp`'s; this file holds the process-wide policy and makes the system calls.

// Blocking signals, prctl and seccomp(2) have no safe wrapper in our dependencies.
#![allow(unsafe_code)]

use crate::core::seccomp::{packet_thread_filter, Instruction, Policy};
use std::io;
use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable behind `--seccomp` (and the only way to set it for
/// `tunnelgate-wg`, whose command line is wireguard-go's): read by `shell::tuning`.
pub const POLICY_ENV: &str = "TUNNELGATE_SECCOMP";

/// The policy for packet threads started from now on (set once at start-up from `--seccomp`).
static POLICY: AtomicU8 = AtomicU8::new(0);

fn encode(p: Policy) -> u8 {
    match p {
        Policy::Enforce => 0,
        Policy::Log => 1,
        Policy::Off => 2,
    }
}

pub fn set_policy(policy: Policy) {
    POLICY.store(encode(policy), Ordering::Relaxed);
}

pub fn policy() -> Policy {
    match POLICY.load(Ordering::Relaxed) {
        1 => Policy::Log,
        2 => Policy::Off,
        _ => Policy::Enforce,
    }
}

/// What [`confine_current_thread`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confinement {
    /// The filter is installed, with this policy for calls outside the list.
    Filtered(Policy),
    /// The policy is off.
    Off,
    /// No list was written for this architecture.
    Unsupported,
}

/// Confines the calling thread to the packet threads' list, under the process-wide policy.
/// Its signals are blocked first, so a signal handler (SIGHUP, SIGTERM) always runs on an
/// unconfined thread. Other threads are not affected.
pub fn confine_current_thread() -> io::Result<Confinement> {
    let policy = policy();
    if policy == Policy::Off {
        return Ok(Confinement::Off);
    }
    let Some(program) = packet_thread_filter(policy) else {
        return Ok(Confinement::Unsupported);
    };
    install(&program)?;
    Ok(Confinement::Filtered(policy))
}

/// Blocks every signal of the calling thread, sets no-new-privs (which an unprivileged filter
/// needs; the daemon has it already) and installs `program`. Allocates nothing, so it is safe
/// in a forked child.
fn install(program: &[Instruction]) -> io::Result<()> {
    let len = u16::try_from(program.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    // SAFETY: `set` is initialised by sigfillset before it is read; a null old set is allowed.
    let r = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let fprog = libc::sock_fprog {
        len,
        // The kernel copies the program and never writes through this pointer.
        filter: program.as_ptr().cast::<libc::sock_filter>().cast_mut(),
    };
    // SPEC_ALLOW: the filter must not switch on speculative-store-bypass mitigation for the
    // thread (the default before Linux 5.16), which would cost the packet path throughput and
    // protects nothing here: the packet threads share their address space with the rest.
    let mut flags = libc::SECCOMP_FILTER_FLAG_SPEC_ALLOW;
    loop {
        // SAFETY: `fprog` points at `len` instructions laid out as `struct sock_filter`
        // (`Instruction` is repr(C) with the same fields), alive for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                flags,
                &fprog as *const libc::sock_fprog,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        // Kernels before 4.17 do not know the flag.
        if e.raw_os_error() == Some(libc::EINVAL) && flags != 0 {
            flags = 0;
            continue;
        }
        return Err(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How a forked child ended.
    #[derive(Debug, PartialEq, Eq)]
    enum End {
        Exited(i32),
        Signalled(i32),
    }

    /// Runs `body` in a forked child confined by `program` and says how the child ended.
    /// The child allocates nothing and ends with `_exit`, as a forked child of a
    /// multi-threaded test process must.
    fn confined_child(program: &[Instruction], body: fn() -> i32) -> End {
        // SAFETY: the child runs only async-signal-safe calls (see above) and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let code = match install(program) {
                Ok(()) => body(),
                Err(_) => 99,
            };
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid, "waitpid: {}", io::Error::last_os_error());
        if libc::WIFSIGNALED(status) {
            End::Signalled(libc::WTERMSIG(status))
        } else {
            End::Exited(libc::WEXITSTATUS(status))
        }
    }

    fn program(policy: Policy) -> Vec<Instruction> {
        packet_thread_filter(policy).expect("a list for this architecture")
    }

    /// 0 when `/` opens, else the errno.
    fn open_root() -> i32 {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(c"/".as_ptr(), libc::O_RDONLY) };
        if fd >= 0 {
            0
        } else {
            io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        }
    }

    fn exec_true() -> i32 {
        let argv = [c"/bin/true".as_ptr(), std::ptr::null()];
        // SAFETY: a NUL-terminated path and a null-terminated argv.
        unsafe { libc::execv(argv[0], argv.as_ptr()) };
        1
    }

    fn map(prot: libc::c_int) -> i32 {
        // SAFETY: an anonymous private mapping, unmapped again.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return 1;
            }
            libc::munmap(p, 4096);
        }
        0
    }

    fn write_sleep_and_draw_randomness() -> i32 {
        // SAFETY: a zero-byte write to stderr changes nothing and proves `write` is allowed;
        // the buffers outlive the calls that fill them.
        unsafe {
            if libc::write(2, [0u8; 0].as_ptr().cast(), 0) != 0 {
                return 1;
            }
            libc::sched_yield();
            let mut b = [0u8; 16];
            if libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) != 16 {
                return 2;
            }
            let t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 1_000_000,
            };
            libc::nanosleep(&t, std::ptr::null_mut());
        }
        0
    }

    #[test]
    fn the_kernel_kills_a_confined_thread_that_runs_a_program() {
        assert_eq!(
            confined_child(&program(Policy::Enforce), exec_true),
            End::Signalled(libc::SIGSYS)
        );
    }

    #[test]
    fn a_confined_thread_cannot_open_a_file() {
        assert_eq!(
            confined_child(&program(Policy::Enforce), open_root),
            End::Exited(libc::EACCES)
        );
    }

    #[test]
    fn the_kernel_kills_a_confined_thread_that_maps_executable_memory() {
        let p = program(Policy::Enforce);
        assert_eq!(
            confined_child(&p, || map(libc::PROT_READ | libc::PROT_WRITE)),
            End::Exited(0)
        );
        assert_eq!(
            confined_child(&p, || map(libc::PROT_READ | libc::PROT_EXEC)),
            End::Signalled(libc::SIGSYS)
        );
    }

    #[test]
    fn a_confined_thread_still_writes_sleeps_and_draws_randomness() {
        assert_eq!(
            confined_child(&program(Policy::Enforce), write_sleep_and_draw_randomness),
            End::Exited(0)
        );
    }

    #[test]
    fn log_mode_lets_the_call_through() {
        assert_eq!(
            confined_child(&program(Policy::Log), open_root),
            End::Exited(0)
        );
    }
}
