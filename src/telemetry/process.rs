//! The `process_*` metrics every Prometheus client exports (resident memory, CPU seconds, open
//! file descriptors, start time), parsed from `/proc/self` (pure; `shell::procfs` reads it).

use serde::{Deserialize, Serialize};

/// What `/proc` says about this process, in the units of the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessStats {
    pub resident_memory_bytes: u64,
    pub virtual_memory_bytes: u64,
    /// User plus system CPU time.
    pub cpu_seconds: f64,
    pub open_fds: u64,
    /// The soft limit on open files (0 when unlimited or unknown).
    pub max_fds: u64,
    /// Unix time the process started.
    pub start_time_seconds: f64,
}

/// The fields of `/proc/self/stat` the metrics need, in clock ticks and pages:
/// `(utime, stime, starttime, vsize_bytes, rss_pages)`.
pub fn parse_stat(stat: &str) -> Option<(u64, u64, u64, u64, u64)> {
    // The command name (field 2) may contain spaces and parentheses: fields start after the
    // last ')'. Field n (1-based) is then at index n - 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some((num(11)?, num(12)?, num(19)?, num(20)?, num(21)?))
}

/// `btime` (boot time, Unix seconds) from `/proc/stat`.
pub fn parse_btime(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft "Max open files" limit from `/proc/self/limits` (`None` when unlimited).
pub fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Combines the parsed files: `ticks` per second, `page` bytes.
pub fn stats_from(
    stat: (u64, u64, u64, u64, u64),
    btime: u64,
    ticks: u64,
    page: u64,
    open_fds: u64,
    max_fds: Option<u64>,
) -> ProcessStats {
    let (utime, stime, start, vsize, rss) = stat;
    let ticks = ticks.max(1) as f64;
    ProcessStats {
        resident_memory_bytes: rss.saturating_mul(page),
        virtual_memory_bytes: vsize,
        cpu_seconds: (utime + stime) as f64 / ticks,
        open_fds,
        max_fds: max_fds.unwrap_or(0),
        start_time_seconds: btime as f64 + start as f64 / ticks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (tg (odd) name) S 1 4242 4242 0 -1 4194560 1200 0 0 0 250 50 0 0 20 0 5 0 123400 104857600 2560 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";

    #[test]
    fn parses_proc_files() {
        assert_eq!(parse_stat(STAT), Some((250, 50, 123400, 104_857_600, 2560)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(
            parse_btime("cpu  1 2 3\nbtime 1763900000\nprocesses 5\n"),
            Some(1_763_900_000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_fds(limits), Some(1024));
        assert_eq!(
            parse_max_fds(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn combines_into_metric_units() {
        let s = stats_from(
            (250, 50, 123400, 104_857_600, 2560),
            1_763_900_000,
            100,
            4096,
            12,
            Some(1024),
        );
        assert_eq!(s.resident_memory_bytes, 2560 * 4096);
        assert_eq!(s.virtual_memory_bytes, 104_857_600);
        assert!((s.cpu_seconds - 3.0).abs() < 1e-9);
        assert!((s.start_time_seconds - 1_763_901_234.0).abs() < 1e-6);
        assert_eq!((s.open_fds, s.max_fds), (12, 1024));
    }
}
