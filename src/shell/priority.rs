//! Applies the scheduling priority `core::priority` asks a packet thread to be in: `SCHED_FIFO`
//! at the packet priority, or back to `SCHED_OTHER`, always for the calling thread only; and
//! makes room for it (`RLIMIT_RTPRIO`) before the daemon drops its capabilities.
#![allow(unsafe_code)]

use crate::core::priority::Priority;
use crate::shell::privilege::Realtime;
use std::io;

/// Makes room for the packet threads' real-time priority (`TUNNELGATE_RT_PRIORITY`) while the
/// capabilities to do so are still held, and says how they will get it: a raised
/// `RLIMIT_RTPRIO`, else `CAP_SYS_NICE` kept (where the process has it). Called before the
/// capabilities drop.
pub fn prepare_realtime() -> Realtime {
    match crate::shell::tuning::rt_priority() {
        None => Realtime::Off,
        Some(priority) if allow_realtime(priority) => Realtime::ByLimit,
        Some(_) => Realtime::ByCapability,
    }
}

/// Raises `RLIMIT_RTPRIO` to `priority` (if lower), so the packet threads may enter
/// `SCHED_FIFO` after the capabilities are gone (an unprivileged thread may, up to that
/// limit). Called before the capabilities drop: raising the hard limit needs
/// `CAP_SYS_RESOURCE`. Returns whether the limit now allows `priority`; where it does not, the
/// daemon keeps `CAP_SYS_NICE` if it has it ([`crate::shell::privilege`]), else the threads
/// stay at normal priority (said once, when they try).
fn allow_realtime(priority: i32) -> bool {
    let want = libc::rlim_t::try_from(priority).unwrap_or(0);
    // SAFETY: getrlimit/setrlimit with a pointer to a local rlimit that outlives the call.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_RTPRIO, &mut limit) != 0 {
            return false;
        }
        if limit.rlim_cur >= want {
            return true;
        }
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: limit.rlim_max.max(want),
        };
        if libc::setrlimit(libc::RLIMIT_RTPRIO, &raised) != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "RLIMIT_RTPRIO not raised");
            return false;
        }
        true
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
