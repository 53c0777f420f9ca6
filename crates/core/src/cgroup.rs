//! What a process's cgroup says about its CPU: where its cgroup is (`/proc/self/cgroup`), its
//! CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) and, on v1 with
//! real-time group scheduling, the real-time runtime it may use. Pure parsers; the shell reads
//! the files.

/// Where the process's cgroups are, from `/proc/self/cgroup`: the v2 (unified) path and the v1
/// `cpu` controller's path, each relative to its hierarchy's mount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paths {
    pub unified: Option<String>,
    pub cpu_v1: Option<String>,
}

/// Parses `/proc/self/cgroup` (`ID:CONTROLLERS:PATH` lines).
pub fn paths(proc_self_cgroup: &str) -> Paths {
    let mut paths = Paths::default();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            paths.unified = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "cpu") {
            paths.cpu_v1 = Some(path.to_string());
        }
    }
    paths
}

/// The quota in thousandths of a CPU from cgroup v2's `cpu.max` (`max 100000` or
/// `150000 100000`): `None` when unlimited or unreadable.
pub fn quota_from_cpu_max(cpu_max: &str) -> Option<u64> {
    let mut words = cpu_max.split_whitespace();
    let quota = words.next()?;
    let period = words
        .next()
        .map_or(Some(100_000), |p| p.parse::<u64>().ok())?;
    if quota == "max" {
        return None;
    }
    milli(quota.parse().ok()?, period)
}

/// The quota in thousandths of a CPU from cgroup v1's `cpu.cfs_quota_us` (-1: unlimited) and
/// `cpu.cfs_period_us`.
pub fn quota_from_cfs(quota_us: &str, period_us: &str) -> Option<u64> {
    let quota: i64 = quota_us.trim().parse().ok()?;
    let period: u64 = period_us.trim().parse().ok()?;
    milli(u64::try_from(quota).ok()?, period)
}

fn milli(quota: u64, period: u64) -> Option<u64> {
    if period == 0 {
        return None;
    }
    Some(quota.saturating_mul(1000) / period)
}

/// The thousandths of a CPU a process may use: its CPUs (affinity), or its quota when lower.
pub fn usable_milli(cpus: usize, quota_milli: Option<u64>) -> u64 {
    let cpus = u64::try_from(cpus).unwrap_or(u64::MAX).saturating_mul(1000);
    quota_milli.map_or(cpus, |q| q.min(cpus)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_unified_and_the_v1_cpu_paths() {
        let hybrid = "12:cpu,cpuacct:/kubepods/pod1/c1\n4:memory:/x\n0::/system.slice/t.service\n";
        assert_eq!(
            paths(hybrid),
            Paths {
                unified: Some("/system.slice/t.service".into()),
                cpu_v1: Some("/kubepods/pod1/c1".into())
            }
        );
        assert_eq!(
            paths("0::/\n"),
            Paths {
                unified: Some("/".into()),
                cpu_v1: None
            }
        );
        // A controller named like cpu but not it, garbage lines.
        assert_eq!(paths("3:cpuset:/a\nnonsense\n::\n"), Paths::default());
    }

    #[test]
    fn quotas_in_thousandths_of_a_cpu() {
        assert_eq!(quota_from_cpu_max("max 100000\n"), None);
        assert_eq!(quota_from_cpu_max("200000 100000\n"), Some(2000));
        assert_eq!(quota_from_cpu_max("150000 100000"), Some(1500));
        assert_eq!(quota_from_cpu_max("50000"), Some(500));
        assert_eq!(quota_from_cpu_max("garbage 1"), None);
        assert_eq!(quota_from_cpu_max("100 0"), None);
        assert_eq!(quota_from_cfs("-1\n", "100000\n"), None);
        assert_eq!(quota_from_cfs("100000\n", "100000\n"), Some(1000));
        assert_eq!(quota_from_cfs("x", "100000"), None);
    }

    #[test]
    fn the_usable_cpus_are_the_lower_of_affinity_and_quota() {
        assert_eq!(usable_milli(2, None), 2000);
        assert_eq!(usable_milli(2, Some(1000)), 1000);
        assert_eq!(usable_milli(2, Some(4000)), 2000);
        assert_eq!(usable_milli(0, Some(0)), 1);
    }
}
