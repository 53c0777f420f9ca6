//! Applies the scheduling priority `core::priority` asks a packet thread to be in: `SCHED_FIFO`
//! at the packet priority, or back to `SCHED_OTHER`, always for the calling thread only. Before
//! the daemon drops its capabilities it finds out how the readers can get there
//! ([`prepare_realtime`]: a raised `RLIMIT_RTPRIO`, else `CAP_SYS_NICE`), and where it is the
//! capability, [`ReaderSpawner`] keeps it to the packet readers alone.
#![allow(unsafe_code)]

use crate::core::priority::{self, Access, Facts, Priority};
use crate::shell::fatal::{panic_message, Fatals, Part};
use crate::shell::privilege::{self, Caps};
use crate::shell::tuning::Tuning;
use caps::Capability;
use std::io;
use std::sync::mpsc;
use std::thread::JoinHandle;

/// Finds out how the packet readers can reach `tuning.rt_priority` and makes room for it while
/// the capabilities to do so are still held: raises `RLIMIT_RTPRIO` where the limit is the way
/// (then no capability is needed). Called by the composition root before the capabilities drop.
pub fn prepare_realtime(tuning: &Tuning) -> Access {
    let facts = facts(tuning);
    let access = priority::access::access(tuning.rt_priority, &facts);
    match (access, tuning.rt_priority) {
        (Access::Limit, Some(want)) if priority::access::raise_rtprio(want, &facts) => {
            match raise_rtprio(want) {
                Ok(()) => Access::Limit,
                Err(e) => {
                    tracing::debug!(error = %e, "RLIMIT_RTPRIO not raised");
                    // Without the limit, the capability is the other way in.
                    let no_limit = Facts {
                        rtprio: (facts.rtprio.0, facts.rtprio.0),
                        sys_resource: false,
                        ..facts
                    };
                    priority::access::access(tuning.rt_priority, &no_limit)
                }
            }
        }
        (access, _) => access,
    }
}

/// What [`prepare_realtime`] decides from, read from this process (nothing changed): for
/// `check`, which shows what a start would get.
pub fn facts(tuning: &Tuning) -> Facts {
    let permitted = privilege::permitted_now();
    let (soft, hard) = rtprio_limit().unwrap_or((0, 0));
    Facts {
        // SAFETY: geteuid cannot fail and touches no memory of ours.
        uid: unsafe { libc::geteuid() },
        sys_nice: permitted.has(Capability::CAP_SYS_NICE),
        sys_resource: permitted.has(Capability::CAP_SYS_RESOURCE),
        rtprio: (soft, hard),
        cgroup_rt_runtime_us: tuning.cpus.rt_runtime_us,
    }
}

/// `RLIMIT_RTPRIO` (soft, hard); `u64::MAX` is unlimited.
fn rtprio_limit() -> io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a pointer to a local rlimit that outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_RTPRIO, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((limit.rlim_cur, limit.rlim_max))
}

/// Raises `RLIMIT_RTPRIO` to `priority` (its hard limit too, if lower: that needs
/// `CAP_SYS_RESOURCE`), so the packet threads may enter `SCHED_FIFO` with no capability.
fn raise_rtprio(priority: i32) -> io::Result<()> {
    let want = libc::rlim_t::try_from(priority).unwrap_or(0);
    let (_, hard) = rtprio_limit()?;
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: hard.max(want),
    };
    // SAFETY: setrlimit with a pointer to a local rlimit that outlives the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_RTPRIO, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What the daemon keeps of `CAP_SYS_NICE` beyond what it needs otherwise: the capability, for
/// the packet readers, when that is how they reach real-time priority.
pub fn keeps(access: &Access) -> Caps {
    match access {
        Access::Capability => Caps::default().with(Capability::CAP_SYS_NICE),
        _ => Caps::default(),
    }
}

/// Moves the calling thread to `priority` (`SCHED_FIFO` at `realtime_priority`, or
/// `SCHED_OTHER`). `SCHED_RESET_ON_FORK`: nothing the thread might start inherits it.
pub fn set_current_thread(priority: Priority, realtime_priority: i32) -> io::Result<()> {
    let (policy, level) = match priority {
        Priority::Realtime => (libc::SCHED_FIFO, realtime_priority),
        Priority::Normal => (libc::SCHED_OTHER, 0),
    };
    let param = libc::sched_param {
        sched_priority: level,
    };
    // SAFETY: pid 0 is the calling thread; `param` outlives the call.
    let r = unsafe { libc::sched_setscheduler(0, policy | libc::SCHED_RESET_ON_FORK, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A thread start handed to the spawner.
type Start = Box<dyn FnOnce() + Send>;

/// Starts the packet readers. Where they reach real-time priority by `CAP_SYS_NICE` only they
/// may hold it, and capabilities are per thread, inherited from the thread that starts one: so
/// the readers are started by one thread kept for that (`tg-spawner`, which holds the
/// capability and does nothing else), while the main thread gives it up before any other
/// thread exists ([`ReaderSpawner::start`]). The runtime, the timer thread and every child
/// (`nft`, `iptables-restore`) then never have it. Elsewhere the readers start like any thread.
#[derive(Clone, Default)]
pub struct ReaderSpawner {
    starts: Option<mpsc::Sender<Start>>,
}

impl ReaderSpawner {
    /// For `access` [`Access::Capability`]: starts the spawner thread, then drops
    /// `CAP_SYS_NICE` from the calling (main) thread. Otherwise a spawner that starts threads
    /// directly. Call once, after the capabilities drop, before the runtime starts.
    /// The spawner thread's handle, if one was started, is the caller's to join
    /// ([`SpawnerThread::join`]) once every spawner is dropped. Its panic is recorded in
    /// `fatals` as its death: the process stops (exit 1) rather than find, at the next socket
    /// rebind, that no reader can be started.
    pub fn start(access: &Access, fatals: &Fatals) -> io::Result<(ReaderSpawner, SpawnerThread)> {
        if *access != Access::Capability {
            return Ok((ReaderSpawner::default(), SpawnerThread(None)));
        }
        let (starts, queue) = mpsc::channel::<Start>();
        let fatals = fatals.clone();
        let thread = std::thread::Builder::new()
            .name("tg-spawner".into())
            .spawn(move || {
                let served =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_starts(&queue)));
                if let Err(panic) = served {
                    fatals.died(format!(
                        "{} panicked: {}",
                        Part::Spawner.name(),
                        panic_message(panic.as_ref())
                    ));
                }
            })?;
        privilege::give_up(Capability::CAP_SYS_NICE).map_err(io::Error::other)?;
        Ok((
            ReaderSpawner {
                starts: Some(starts),
            },
            SpawnerThread(Some(thread)),
        ))
    }

    /// Starts a packet reader named `name` running `body`.
    pub fn spawn(
        &self,
        name: String,
        body: impl FnOnce() + Send + 'static,
    ) -> io::Result<JoinHandle<()>> {
        let Some(starts) = &self.starts else {
            return std::thread::Builder::new().name(name).spawn(body);
        };
        let (reply, started) = mpsc::sync_channel(1);
        starts
            .send(Box::new(move || {
                let _ = reply.send(std::thread::Builder::new().name(name).spawn(body));
            }))
            .map_err(|_| io::Error::other("the reader spawner thread is gone"))?;
        started
            .recv()
            .map_err(|_| io::Error::other("the reader spawner thread is gone"))?
    }
}

/// The spawner thread's work: each start handed to it, until the last sender is gone (the data
/// plane stopped).
fn serve_starts(queue: &mpsc::Receiver<Start>) {
    #[cfg(not(feature = "test-hooks"))]
    while let Ok(start) = queue.recv() {
        start();
    }
    // The test hook needs a look now and then: a wake every 20 ms, in test builds only.
    #[cfg(feature = "test-hooks")]
    loop {
        crate::shell::test_hooks::panic_point(Part::Spawner);
        match queue.recv_timeout(std::time::Duration::from_millis(20)) {
            Ok(start) => start(),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The `tg-spawner` thread, owned by the composition root, which joins it at exit.
pub struct SpawnerThread(Option<JoinHandle<()>>);

impl SpawnerThread {
    /// Joins the thread: it ends once every [`ReaderSpawner`] is dropped (the data plane
    /// stopped and gone). Waits at most `wait`; a thread still running then (a spawner kept
    /// somewhere) is named in the log and left to the process's exit.
    pub fn join(self, wait: std::time::Duration) {
        let Some(thread) = self.0 else {
            return;
        };
        let started = crate::shell::clock::now();
        while !thread.is_finished() {
            if crate::shell::clock::since(started) > wait {
                tracing::warn!("The reader spawner thread did not end within {wait:?}");
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if thread.join().is_err() {
            tracing::warn!("The reader spawner thread panicked");
        }
    }
}

/// Says once, at start, how the packet readers reach real-time priority, or why they do not.
pub fn log_access(access: &Access, priority: Option<i32>) {
    match (access, priority) {
        (Access::Limit | Access::Capability, Some(p)) => tracing::info!(
            priority = p,
            how = %access,
            "Packet readers may run at real-time priority (SCHED_FIFO)"
        ),
        (Access::Unavailable(why), _) => tracing::warn!(
            reason = %why,
            "Packet readers stay at normal priority: under load, packets then wait for a CPU behind other work"
        ),
        _ => tracing::info!("Packet readers run at normal priority (TUNNELGATE_RT_PRIORITY=0)"),
    }
}

/// Makes `command`'s process unable to enter a real-time class, whatever thread starts it and
/// whenever: between fork and exec it drops `CAP_SYS_NICE` from its sets (and, where it may, from
/// its bounding set), sets no-new-privs so the exec cannot give it back, and sets
/// `RLIMIT_RTPRIO` to 0 (the daemon may have raised it for its readers, and limits are
/// inherited). The firewall tools are run so: also the probe for iptables-legacy, which runs
/// before the daemon drops its capabilities.
pub fn no_realtime_for(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook makes only system calls (prctl, capget, capset, setrlimit), all
    // async-signal-safe, on local values; it allocates nothing, as a pre-exec hook must.
    unsafe {
        command.pre_exec(|| {
            // Best effort: without CAP_SETPCAP (systemd's bounding set) no-new-privs below is
            // what keeps the exec from giving the capability back.
            libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_NICE_NUMBER, 0, 0, 0);
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            drop_sys_nice_raw()?;
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::setrlimit(libc::RLIMIT_RTPRIO, &none) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `CAP_SYS_NICE`'s number (linux/capability.h).
const CAP_SYS_NICE_NUMBER: libc::c_ulong = 23;
/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Clears `CAP_SYS_NICE` from the calling thread's effective, permitted and inheritable sets
/// with the raw system calls (the `caps` crate allocates, which a pre-exec hook must not).
///
/// # Safety
/// Only system calls on local values; safe to call between fork and exec.
unsafe fn drop_sys_nice_raw() -> io::Result<()> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) != 0 {
        return Err(io::Error::last_os_error());
    }
    let bit = 1u32 << CAP_SYS_NICE_NUMBER;
    data[0].effective &= !bit;
    data[0].permitted &= !bit;
    data[0].inheritable &= !bit;
    if libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
