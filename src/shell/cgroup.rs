//! Reads what bounds this process's CPU: its affinity mask, its cgroup's CPU quota (v2
//! `cpu.max`, v1 `cpu.cfs_quota_us`) and, on cgroup v1 with real-time group scheduling, the
//! real-time runtime its cgroup may use. The parsing is `core::cgroup`'s.
#![allow(unsafe_code)]

use crate::core::cgroup;
use crate::core::priority::Budget;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// `cpu.rt_period_us` beside it: the cgroup's real-time threads may run `rt_runtime_us` of
    /// every `rt_period_us` on each CPU, and are frozen until the period ends past that.
    pub rt_period_us: Option<i64>,
}

impl Default for Cpus {
    /// One CPU, no quota: what tests that build a data plane by hand assume.
    fn default() -> Cpus {
        Cpus {
            affinity: 1,
            quota_milli: None,
            rt_runtime_us: None,
            rt_period_us: None,
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
        let rt = |file| {
            paths
                .cpu_v1
                .as_deref()
                .and_then(|p| read_in(&v1_dir, p, file))
                .and_then(|text| text.trim().parse().ok())
        };
        Cpus {
            affinity: affinity(),
            quota_milli: match (v2, v1) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            rt_runtime_us: rt("cpu.rt_runtime_us"),
            rt_period_us: rt("cpu.rt_period_us"),
        }
    }

    /// What the cgroup lets real-time threads run, as a budget no larger than `budget`: at
    /// most its share of each period (in whole percent) and at most its runtime in one go, so
    /// the readers step down before the kernel freezes them. `budget` where there is no such
    /// limit (or it gives none: the readers then stay at normal priority anyway).
    pub fn cap_realtime(&self, budget: Budget) -> Budget {
        let (Some(runtime), Some(period)) = (self.rt_runtime_us, self.rt_period_us) else {
            return budget;
        };
        let (Ok(runtime), Ok(period)) = (u64::try_from(runtime), u64::try_from(period)) else {
            return budget; // -1: no limit
        };
        if runtime == 0 || period == 0 {
            return budget;
        }
        let percent = u32::try_from(runtime.saturating_mul(100) / period).unwrap_or(u32::MAX);
        let percent = percent.max(1);
        Budget {
            share_percent: budget.share_percent.min(percent),
            unauthenticated_percent: budget.unauthenticated_percent.min(percent),
            burst: budget.burst.min(Duration::from_micros(runtime)),
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
    fn the_cgroups_realtime_runtime_caps_the_budget() {
        let budget = Budget::default();
        let limited = |runtime, period| Cpus {
            rt_runtime_us: Some(runtime),
            rt_period_us: Some(period),
            ..Cpus::default()
        };
        assert_eq!(Cpus::default().cap_realtime(budget), budget);
        // The host's root group: 950 ms of every second, more than the budget.
        assert_eq!(limited(950_000, 1_000_000).cap_realtime(budget), budget);
        // A container given 4.7 ms of every 10: at most 47 %, bursts of 4.7 ms.
        assert_eq!(
            limited(4_700, 10_000).cap_realtime(budget),
            Budget {
                share_percent: 47,
                unauthenticated_percent: 25,
                burst: Duration::from_micros(4_700)
            }
        );
        assert_eq!(
            limited(1_000, 10_000)
                .cap_realtime(budget)
                .unauthenticated_percent,
            10
        );
        // No limit (-1) or none given (0, where access says why real-time is unavailable).
        assert_eq!(limited(-1, 1_000_000).cap_realtime(budget), budget);
        assert_eq!(limited(0, 1_000_000).cap_realtime(budget), budget);
    }

    #[test]
    fn reads_this_processs_cpus() {
        let cpus = Cpus::read();
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        // std's count is the affinity mask bounded by the quota, rounded down.
        assert!(cpus.affinity >= available, "{cpus:?} against {available}");
    }
}
