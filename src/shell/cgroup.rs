//! Reads what bounds this process's CPU: its affinity mask, its cgroup's CPU quota (v2
//! `cpu.max`, v1 `cpu.cfs_quota_us`) and, on cgroup v1 with real-time group scheduling, the
//! real-time runtime its cgroup may use. The parsing is `core::cgroup`'s.
#![allow(unsafe_code)]

use crate::core::cgroup;
use std::path::{Path, PathBuf};

/// Where the cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The CPUs this process may use, as read at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpus {
    /// CPUs in the affinity mask.
    pub affinity: usize,
    /// The cgroup's CPU quota in thousandths of a CPU (`None`: no quota).
    pub quota_milli: Option<u64>,
    /// `cpu.rt_runtime_us` of the cgroup where real-time group scheduling is on (cgroup v1).
    pub rt_runtime_us: Option<i64>,
}

impl Default for Cpus {
    /// One CPU, no quota: what tests that build a data plane by hand assume.
    fn default() -> Cpus {
        Cpus {
            affinity: 1,
            quota_milli: None,
            rt_runtime_us: None,
        }
    }
}

impl Cpus {
    /// Reads the affinity mask and this process's cgroup files (missing files: no limit).
    pub fn read() -> Cpus {
        let paths = std::fs::read_to_string("/proc/self/cgroup")
            .map(|text| cgroup::paths(&text))
            .unwrap_or_default();
        // cgroup v2 is mounted at the root, or beside v1 at `unified` (hybrid hosts, where the
        // cpu controller is v1's and there is no `cpu.max`).
        let v2 = paths
            .unified
            .as_deref()
            .and_then(|p| read_in(Path::new(CGROUP_ROOT), p, "cpu.max"))
            .and_then(|text| cgroup::quota_from_cpu_max(&text));
        let v1_dir = Path::new(CGROUP_ROOT).join("cpu");
        let v1 = paths.cpu_v1.as_deref().and_then(|p| {
            let quota = read_in(&v1_dir, p, "cpu.cfs_quota_us")?;
            let period = read_in(&v1_dir, p, "cpu.cfs_period_us")?;
            cgroup::quota_from_cfs(&quota, &period)
        });
        let rt_runtime_us = paths
            .cpu_v1
            .as_deref()
            .and_then(|p| read_in(&v1_dir, p, "cpu.rt_runtime_us"))
            .and_then(|text| text.trim().parse().ok());
        Cpus {
            affinity: affinity(),
            quota_milli: match (v2, v1) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            rt_runtime_us,
        }
    }
}

/// `file` of the cgroup at `path` under the hierarchy mounted at `mount`; inside a container
/// whose cgroup is mounted as the hierarchy's root (the path names the host's view), the file
/// at the mount itself.
fn read_in(mount: &Path, path: &str, file: &str) -> Option<String> {
    let nested: PathBuf = mount.join(path.trim_start_matches('/')).join(file);
    std::fs::read_to_string(nested)
        .or_else(|_| std::fs::read_to_string(mount.join(file)))
        .ok()
}

/// CPUs in this thread's affinity mask (1 if it cannot be read).
fn affinity() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return 1;
        }
        usize::try_from(libc::CPU_COUNT(&set)).unwrap_or(1).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_processs_cpus() {
        let cpus = Cpus::read();
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        // std's count is the affinity mask bounded by the quota, rounded down.
        assert!(cpus.affinity >= available, "{cpus:?} against {available}");
    }
}
