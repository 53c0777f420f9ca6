//! The packet threads' seccomp allow-list and the classic-BPF program that enforces it (pure:
//! the shell installs the program; nothing here makes a system call).
//!
//! The three packet threads parse every datagram the network sends, so they are where a memory
//! bug would be reached first. After their setup (the TUN descriptor made non-blocking, the
//! socket's receive timeout), each confines itself: it may move packets (`read`/`write` on the
//! TUN device, `recvmmsg`/`sendmmsg`/`sendmsg` on the WireGuard socket), wait (`poll`,
//! `futex`, sleeps), allocate (`mmap`/`mprotect` never executable), draw randomness for a
//! handshake, close a replaced socket and end. Opening a file fails with `EACCES` (see
//! [`REFUSED`] for why it is not fatal). Everything else is fatal: `exec*`, `socket`,
//! `connect`, `bind`, `ioctl`, `setsockopt`, `ptrace`, `mount`, `bpf`, `clone`, `kill`, ...
//! Setup that needs more happens before the filter is installed.
//!
//! The list was taken from `strace -f -Y` of the netns suites (handshakes, rekeys, roaming,
//! cookie replies under a flood, socket replacement, TUN deletion, shutdown) and is exercised
//! by all of them in CI: a missing entry kills the daemon there.
//!
//! Why a hand-written program and not a crate: it is about forty instructions, and a tiny
//! evaluator in the tests checks it instruction by instruction. `seccompiler` (rust-vmm,
//! Firecracker's) was weighed in issue 23 and not taken, because it cannot say what this program
//! says: a `SeccompFilter` has one action on a match and one otherwise, so "allow these, refuse
//! opens with `EACCES`, kill the rest" would take two stacked filters (the suites check there is
//! one); its architecture check always kills, also under `--seccomp log`; and its
//! `apply_filter` passes no flags, so the installer (`SPEC_ALLOW`, signals blocked first) would
//! stay ours. What it would replace is `build` (about forty lines), while the evaluator would
//! grow to model the jumps and masks it emits.
//!
//! Cost: only `mmap`, `mprotect` and `fcntl` (`F_GETFD` only, for debug builds' std) look at
//! an argument. Every other entry's answer depends on
//! the system call number alone, so the kernel (5.11+) caches it per thread and skips the
//! program on the hot path (`read`, `write`, `recvmmsg`, `sendmmsg`, `poll`).

pub use crate::cbpf::Instruction;

/// What the packet threads do about seccomp (`tunnelgate run --seccomp`,
/// `$TUNNELGATE_SECCOMP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// A system call outside the list kills the process (`SIGSYS`); the kernel logs it with
    /// the thread's name and the call's number (audit type 1326).
    #[default]
    Enforce,
    /// A system call outside the list is allowed and logged by the kernel: for finding what a
    /// new kernel, libc or code path needs without losing the daemon.
    Log,
    /// No filter.
    Off,
}

impl Policy {
    pub const NAMES: [&'static str; 3] = ["enforce", "log", "off"];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Enforce => "enforce",
            Policy::Log => "log",
            Policy::Off => "off",
        }
    }

    /// The kernel's return value for a call outside the list, or `None` for no filter.
    pub fn deny_action(self) -> Option<u32> {
        match self {
            Policy::Enforce => Some(RET_KILL_PROCESS),
            Policy::Log => Some(RET_LOG),
            Policy::Off => None,
        }
    }

    /// The kernel's return value for a call in [`REFUSED`].
    fn refuse_action(self) -> Option<u32> {
        match self {
            Policy::Enforce => Some(RET_ERRNO | libc::EACCES as u32),
            Policy::Log => Some(RET_LOG),
            Policy::Off => None,
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "enforce" => Ok(Policy::Enforce),
            "log" => Ok(Policy::Log),
            "off" => Ok(Policy::Off),
            other => Err(format!(
                "seccomp policy {other:?} is not one of {}",
                Policy::NAMES.join(", ")
            )),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

use crate::cbpf::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};

// linux/seccomp.h.
pub const RET_KILL_PROCESS: u32 = 0x8000_0000;
pub const RET_ERRNO: u32 = 0x0005_0000;
pub const RET_LOG: u32 = 0x7ffc_0000;
pub const RET_ALLOW: u32 = 0x7fff_0000;

/// `struct seccomp_data` offsets: `nr`, `arch`, then six 64-bit `args` from byte 16.
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
const fn offset_arg_low(i: u32) -> u32 {
    let start = 16 + 8 * i;
    if cfg!(target_endian = "little") {
        start
    } else {
        start + 4
    }
}

/// `PROT_EXEC` (asm-generic/mman-common.h).
const PROT_EXEC: u32 = 0x4;

/// This build's `AUDIT_ARCH_*` (linux/audit.h), or `None` where no list was written.
pub fn audit_arch() -> Option<u32> {
    if cfg!(target_arch = "x86_64") {
        Some(0xc000_003e)
    } else if cfg!(target_arch = "aarch64") {
        Some(0xc000_00b7)
    } else {
        None
    }
}

/// x86-64's x32 ABI shares `AUDIT_ARCH_X86_64` and marks its numbers with this bit: without a
/// check, an x32 call would pass as the 64-bit call of the same number.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Calls allowed whatever their arguments, with the reason each is there.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const ALLOWED: &[(&str, libc::c_long)] = &[
    // Packets: TUN reads and writes, the WireGuard socket's batches and single sends (a
    // handshake, a keepalive, a reply retried without its source address).
    ("read", libc::SYS_read),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    // Waiting: the idle TUN wait, locks (parking_lot spins, then parks), the timer tick.
    #[cfg(target_arch = "x86_64")]
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("futex", libc::SYS_futex),
    ("sched_yield", libc::SYS_sched_yield),
    ("nanosleep", libc::SYS_nanosleep),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    // The vDSO answers these without a system call, unless the clock source cannot.
    ("clock_gettime", libc::SYS_clock_gettime),
    ("gettimeofday", libc::SYS_gettimeofday),
    // Handshakes: ephemeral keys and cookie secrets.
    ("getrandom", libc::SYS_getrandom),
    // Freeing: malloc returns memory; a replaced socket's last reference may drop here.
    ("munmap", libc::SYS_munmap),
    ("madvise", libc::SYS_madvise),
    ("mremap", libc::SYS_mremap),
    ("brk", libc::SYS_brk),
    ("close", libc::SYS_close),
    // Ending: glibc blocks signals, Rust removes its alternate signal stack, the thread exits.
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("gettid", libc::SYS_gettid),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ALLOWED: &[(&str, libc::c_long)] = &[];

/// Calls that fail with `EACCES` instead of killing the process. glibc opens files on its own,
/// once per process, for facts it has a fallback for, and takes a failed open as "no": the
/// first heap shrink of a thread's malloc arena reads `/proc/sys/vm/overcommit_memory` (seen
/// killing a UDP reader that freed its buffers on its way out), and arena setup reads
/// `/sys/devices/system/cpu/online`. A refused open gives an attacker no more than a fatal one.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const REFUSED: &[(&str, libc::c_long)] = &[
    #[cfg(target_arch = "x86_64")]
    ("open", libc::SYS_open),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const REFUSED: &[(&str, libc::c_long)] = &[];

/// Calls allowed only when their protection argument (the third) lacks `PROT_EXEC`: memory
/// for buffers, never new code.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const ALLOWED_NOT_EXECUTABLE: &[(&str, libc::c_long)] =
    &[("mmap", libc::SYS_mmap), ("mprotect", libc::SYS_mprotect)];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ALLOWED_NOT_EXECUTABLE: &[(&str, libc::c_long)] = &[];

/// `fcntl`, allowed only as `F_GETFD`: with debug assertions (every `cargo test` build), std
/// checks that a descriptor is open before it closes one (`OwnedFd`'s drop), and a packet
/// thread may drop the last handle of a replaced socket. Release builds never call it; reading
/// a descriptor's close-on-exec flag gives nothing away.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const ALLOWED_FCNTL_GETFD: Option<(&str, libc::c_long)> = Some(("fcntl", libc::SYS_fcntl));

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ALLOWED_FCNTL_GETFD: Option<(&str, libc::c_long)> = None;

/// `sched_setscheduler`, allowed only on the calling thread (pid 0): a packet thread moves
/// itself between real-time and normal priority (`core::priority`); it may not move another
/// process.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const ALLOWED_SCHED_SELF: Option<(&str, libc::c_long)> =
    Some(("sched_setscheduler", libc::SYS_sched_setscheduler));

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ALLOWED_SCHED_SELF: Option<(&str, libc::c_long)> = None;

/// The names on the list, for the log line and the docs.
pub fn allowed_names() -> Vec<&'static str> {
    ALLOWED
        .iter()
        .chain(ALLOWED_NOT_EXECUTABLE)
        .chain(ALLOWED_FCNTL_GETFD.iter())
        .chain(ALLOWED_SCHED_SELF.iter())
        .map(|(name, _)| *name)
        .collect()
}

fn stmt(code: u16, k: u32) -> Instruction {
    Instruction {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Instruction {
    Instruction { code, jt, jf, k }
}

/// The packet threads' program for `policy`: `None` for [`Policy::Off`] or an architecture
/// without a list. A call of another architecture is always denied.
pub fn packet_thread_filter(policy: Policy) -> Option<Vec<Instruction>> {
    let deny = policy.deny_action()?;
    let refuse = policy.refuse_action()?;
    let arch = audit_arch()?;
    build(arch, deny, refuse)
}

fn build(arch: u32, deny: u32, refuse: u32) -> Option<Vec<Instruction>> {
    let nr = |n: libc::c_long| u32::try_from(n).ok();
    let mut p = vec![
        stmt(BPF_LD | BPF_W | BPF_ABS, OFFSET_ARCH),
        jump(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0),
        stmt(BPF_RET | BPF_K, deny),
        stmt(BPF_LD | BPF_W | BPF_ABS, OFFSET_NR),
    ];
    if cfg!(target_arch = "x86_64") {
        p.push(jump(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 1));
        p.push(stmt(BPF_RET | BPF_K, deny));
    }
    for (list, action) in [(ALLOWED, RET_ALLOW), (REFUSED, refuse)] {
        for (_, n) in list {
            // Not this call: skip the return.
            p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(*n)?, 0, 1));
            p.push(stmt(BPF_RET | BPF_K, action));
        }
    }
    for (_, n) in ALLOWED_NOT_EXECUTABLE {
        // Not this call: skip the four instructions of its check (the accumulator still
        // holds the number for the next comparison).
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(*n)?, 0, 4));
        p.push(stmt(BPF_LD | BPF_W | BPF_ABS, offset_arg_low(2)));
        p.push(jump(BPF_JMP | BPF_JSET | BPF_K, PROT_EXEC, 0, 1));
        p.push(stmt(BPF_RET | BPF_K, deny));
        p.push(stmt(BPF_RET | BPF_K, RET_ALLOW));
    }
    if let Some((_, n)) = ALLOWED_FCNTL_GETFD {
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(n)?, 0, 4));
        p.push(stmt(BPF_LD | BPF_W | BPF_ABS, offset_arg_low(1)));
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::F_GETFD as u32, 1, 0));
        p.push(stmt(BPF_RET | BPF_K, deny));
        p.push(stmt(BPF_RET | BPF_K, RET_ALLOW));
    }
    if let Some((_, n)) = ALLOWED_SCHED_SELF {
        // The pid is an int: its low word is the whole of it.
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(n)?, 0, 4));
        p.push(stmt(BPF_LD | BPF_W | BPF_ABS, offset_arg_low(0)));
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, 0));
        p.push(stmt(BPF_RET | BPF_K, deny));
        p.push(stmt(BPF_RET | BPF_K, RET_ALLOW));
    }
    p.push(stmt(BPF_RET | BPF_K, deny));
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's view of one call: `struct seccomp_data`.
    struct Call {
        nr: u32,
        arch: u32,
        args: [u64; 6],
    }

    impl Call {
        fn new(nr: libc::c_long) -> Call {
            Call {
                nr: u32::try_from(nr).expect("a small syscall number"),
                arch: audit_arch().expect("a listed architecture"),
                args: [0; 6],
            }
        }

        fn bytes(&self) -> Vec<u8> {
            let mut b = Vec::new();
            b.extend_from_slice(&self.nr.to_ne_bytes());
            b.extend_from_slice(&self.arch.to_ne_bytes());
            b.extend_from_slice(&0u64.to_ne_bytes()); // instruction_pointer
            for a in self.args {
                b.extend_from_slice(&a.to_ne_bytes());
            }
            b
        }
    }

    /// Classic BPF as the kernel runs a seccomp filter, for the instructions the builder uses;
    /// anything else fails the test. Jumps are forward only, so this terminates.
    fn run(program: &[Instruction], call: &Call) -> u32 {
        let data = call.bytes();
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = program.get(pc).expect("the program ran off its end");
            pc += 1;
            match i.code {
                c if c == BPF_LD | BPF_W | BPF_ABS => {
                    let at = i.k as usize;
                    let word: [u8; 4] = data[at..at + 4].try_into().expect("4 bytes");
                    acc = u32::from_ne_bytes(word);
                }
                c if c == BPF_RET | BPF_K => return i.k,
                c if c & 0x07 == BPF_JMP => {
                    let taken = match c & 0xf0 {
                        BPF_JEQ => acc == i.k,
                        BPF_JGE => acc >= i.k,
                        BPF_JSET => acc & i.k != 0,
                        other => panic!("jump kind {other:#x} not modelled"),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                other => panic!("instruction {other:#x} not modelled"),
            }
        }
    }

    fn enforce() -> Vec<Instruction> {
        packet_thread_filter(Policy::Enforce).expect("a list for this architecture")
    }

    #[test]
    fn every_listed_call_is_allowed_and_the_program_fits_the_kernel_limit() {
        let p = enforce();
        assert!(p.len() <= 4096, "{} instructions", p.len());
        for (name, nr) in ALLOWED {
            assert_eq!(run(&p, &Call::new(*nr)), RET_ALLOW, "{name}");
        }
    }

    #[test]
    fn what_a_compromised_thread_would_want_kills_the_process() {
        let p = enforce();
        let refused = vec![
            ("execve", libc::SYS_execve),
            ("execveat", libc::SYS_execveat),
            ("socket", libc::SYS_socket),
            ("connect", libc::SYS_connect),
            ("bind", libc::SYS_bind),
            ("ioctl", libc::SYS_ioctl),
            ("setsockopt", libc::SYS_setsockopt),
            ("ptrace", libc::SYS_ptrace),
            ("clone", libc::SYS_clone),
            ("clone3", libc::SYS_clone3),
            ("kill", libc::SYS_kill),
            ("mount", libc::SYS_mount),
            ("bpf", libc::SYS_bpf),
            ("unshare", libc::SYS_unshare),
            ("setns", libc::SYS_setns),
            ("prctl", libc::SYS_prctl),
            ("seccomp", libc::SYS_seccomp),
            ("process_vm_writev", libc::SYS_process_vm_writev),
            ("memfd_create", libc::SYS_memfd_create),
        ];
        for (name, nr) in refused {
            assert_eq!(run(&p, &Call::new(nr)), RET_KILL_PROCESS, "{name}");
        }
    }

    #[test]
    fn opening_a_file_fails_with_eacces_rather_than_killing() {
        let p = enforce();
        let mut opens = vec![libc::SYS_openat, libc::SYS_openat2];
        #[cfg(target_arch = "x86_64")]
        opens.push(libc::SYS_open);
        for nr in opens {
            assert_eq!(
                run(&p, &Call::new(nr)),
                RET_ERRNO | libc::EACCES as u32,
                "{nr}"
            );
        }
    }

    #[test]
    fn memory_may_be_mapped_and_protected_but_never_executable() {
        let p = enforce();
        for (name, nr) in ALLOWED_NOT_EXECUTABLE {
            let mut call = Call::new(*nr);
            call.args[2] = (libc::PROT_READ | libc::PROT_WRITE) as u64;
            assert_eq!(run(&p, &call), RET_ALLOW, "{name} read-write");
            call.args[2] = libc::PROT_NONE as u64;
            assert_eq!(run(&p, &call), RET_ALLOW, "{name} none (guard pages)");
            call.args[2] = (libc::PROT_READ | libc::PROT_EXEC) as u64;
            assert_eq!(run(&p, &call), RET_KILL_PROCESS, "{name} executable");
            // The high half of the argument does not hide the bit.
            call.args[2] = (1u64 << 40) | libc::PROT_EXEC as u64;
            assert_eq!(
                run(&p, &call),
                RET_KILL_PROCESS,
                "{name} executable, high bits"
            );
        }
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    fn a_thread_may_set_its_own_scheduling_policy_and_no_one_elses() {
        let p = enforce();
        let (_, nr) = ALLOWED_SCHED_SELF.expect("listed on this architecture");
        let mut call = Call::new(nr);
        call.args[0] = 0;
        assert_eq!(run(&p, &call), RET_ALLOW, "the calling thread");
        for pid in [1u64, 4242, u64::from(u32::MAX)] {
            call.args[0] = pid;
            assert_eq!(run(&p, &call), RET_KILL_PROCESS, "pid {pid}");
        }
        // sched_setattr and sched_setparam are not on the list at all.
        for other in [libc::SYS_sched_setattr, libc::SYS_sched_setparam] {
            assert_eq!(run(&p, &Call::new(other)), RET_KILL_PROCESS, "{other}");
        }
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    fn fcntl_may_only_read_the_close_on_exec_flag() {
        let p = enforce();
        let (_, nr) = ALLOWED_FCNTL_GETFD.expect("listed on this architecture");
        let mut call = Call::new(nr);
        call.args[1] = libc::F_GETFD as u64;
        assert_eq!(run(&p, &call), RET_ALLOW, "F_GETFD");
        for cmd in [libc::F_SETFD, libc::F_SETFL, libc::F_DUPFD, libc::F_SETOWN] {
            call.args[1] = cmd as u64;
            assert_eq!(run(&p, &call), RET_KILL_PROCESS, "fcntl command {cmd}");
        }
        // The high half of the argument does not make another command pass.
        call.args[1] = (1u64 << 40) | libc::F_GETFD as u64;
        assert_eq!(run(&p, &call), RET_ALLOW, "the kernel reads an int");
    }

    #[test]
    fn another_architecture_or_the_x32_abi_is_refused_even_for_listed_numbers() {
        let p = enforce();
        let mut call = Call::new(libc::SYS_read);
        call.arch = 0x4000_0003; // AUDIT_ARCH_I386
        assert_eq!(run(&p, &call), RET_KILL_PROCESS);
        if cfg!(target_arch = "x86_64") {
            let mut call = Call::new(libc::SYS_read);
            call.nr |= X32_SYSCALL_BIT;
            assert_eq!(run(&p, &call), RET_KILL_PROCESS);
        }
    }

    #[test]
    fn log_mode_logs_instead_of_killing_and_off_builds_nothing() {
        let p = packet_thread_filter(Policy::Log).expect("a list");
        assert_eq!(run(&p, &Call::new(libc::SYS_openat)), RET_LOG);
        assert_eq!(run(&p, &Call::new(libc::SYS_read)), RET_ALLOW);
        assert!(packet_thread_filter(Policy::Off).is_none());
    }

    #[test]
    fn the_list_has_no_duplicates_and_policies_parse_by_name() {
        let mut names = allowed_names();
        names.extend(REFUSED.iter().map(|(name, _)| *name));
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "{names:?}");
        for name in Policy::NAMES {
            let p: Policy = name.parse().expect("a policy name");
            assert_eq!(p.name(), name);
        }
        let e = "kill".parse::<Policy>().expect_err("not a policy");
        assert!(
            e.contains("\"kill\"") && e.contains("enforce, log, off"),
            "{e}"
        );
    }
}
