//! Reads of `/proc` for the `process_*` metrics (parsed by `telemetry::process`), and the
//! allocator's tuning: the process-level I/O the telemetry needs.

use crate::telemetry::process::{parse_btime, parse_max_fds, parse_stat, stats_from, ProcessStats};

/// A positive `sysconf(name)`.
#[allow(unsafe_code)]
fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf takes a plain integer and touches no memory of ours.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|v| *v > 0)
}

/// Large buffers (above 128 KiB) come from their own mappings, given back to the kernel when
/// freed. glibc otherwise raises that threshold after each large free, so a pass that builds a
/// few MB of text (the proxy-group sidecar's rendered config, its gzip, the API bodies) leaves
/// them on the heap, where the next pass's allocations fragment them: 65 MiB peak at 20,000
/// Services against 61 with the fixed threshold (`group_at_20000_services_*`).
#[allow(unsafe_code)]
pub fn return_large_buffers_to_the_kernel() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes two integers and only changes the allocator's tuning; it is called
    // before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Peers a change or a listing must have named before the heap is given back after it
/// ([`give_back_free_heap`]): below it, there is little to give.
pub const MANY_PEERS: usize = 1000;

/// Gives the heap's free pages back to the kernel (glibc's `malloc_trim`, every arena). A
/// concentrator's big passes (a config of 100,000 peers parsed, a `wg setconf` of them, a
/// `wg show` of them) are millions of small allocations freed at once, scattered over the
/// heap where no threshold returns them: without this the daemon kept 470 MiB after a start,
/// a scrape and a `wg show dump` of 100,000 peers. A few milliseconds; called after such
/// passes only, from a thread that is not a packet thread.
#[allow(unsafe_code)]
pub fn give_back_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes an integer (the pad to keep) and only releases free pages of
    // the allocator's own arenas; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Reads this process's stats; `None` where `/proc` is not mounted.
pub fn read() -> Option<ProcessStats> {
    let stat = parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
    let btime = parse_btime(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    let ticks = sysconf(libc::_SC_CLK_TCK).unwrap_or(100);
    let page = sysconf(libc::_SC_PAGESIZE).unwrap_or(4096);
    Some(stats_from(
        stat,
        btime,
        ticks,
        page,
        open_fds,
        parse_max_fds(&limits),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let s = read().expect("/proc is mounted");
        assert!(s.resident_memory_bytes > 0 && s.open_fds > 0, "{s:?}");
        let now = crate::shell::clock::wall_now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        assert!(
            s.start_time_seconds > now - 3600.0 && s.start_time_seconds <= now + 1.0,
            "{s:?}"
        );
    }
}
