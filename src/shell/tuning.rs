//! The queue and scheduling knobs (`TUNNELGATE_SOCKET_BUFFER`, `TUNNELGATE_TUN_TXQUEUELEN`,
//! `TUNNELGATE_AQM_TARGET_US`, `TUNNELGATE_RT_PRIORITY`): a number in a range, read from the
//! environment once. A value that is not one is named in a warning and the default stays,
//! as for `TUNNELGATE_IPTABLES`.

use std::ffi::OsStr;
use std::ops::RangeInclusive;
use std::time::Duration;

/// `value` of variable `name` as a number in `range`: `Ok(None)` when unset or empty, `Err`
/// (naming the variable, an escaped excerpt of at most 32 characters and the range) otherwise.
pub fn bounded(
    name: &str,
    value: Option<&OsStr>,
    range: &RangeInclusive<u64>,
) -> Result<Option<u64>, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match value.to_str().and_then(|v| v.parse::<u64>().ok()) {
        Some(n) if range.contains(&n) => Ok(Some(n)),
        _ => {
            let shown: String = value.to_string_lossy().chars().take(32).collect();
            Err(format!(
                "{name}={shown:?}: expected a number from {} to {}",
                range.start(),
                range.end()
            ))
        }
    }
}

/// Variable `name` from the environment ([`bounded`]), or `default` (with a warning when it is
/// set to something else).
pub fn from_env(name: &str, range: &RangeInclusive<u64>, default: u64) -> u64 {
    match bounded(name, std::env::var_os(name).as_deref(), range) {
        Ok(value) => value.unwrap_or(default),
        Err(e) => {
            tracing::warn!("{e}; using the default {default}");
            default
        }
    }
}

/// The variable that sets the receive queue's AQM target, and its range in microseconds.
const AQM_TARGET_VAR: &str = "TUNNELGATE_AQM_TARGET_US";
const AQM_TARGET_RANGE: RangeInclusive<u64> = 0..=100_000;

/// The receive queue's AQM target (`core::aqm`): `TUNNELGATE_AQM_TARGET_US` microseconds (0
/// turns AQM off, for the benchmarks that compare; at most 100 ms), else 1 ms. Read once; a bad
/// value is warned about and the default stays.
pub fn aqm_target() -> Option<Duration> {
    static TARGET: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *TARGET.get_or_init(|| {
        aqm_target_from(std::env::var_os(AQM_TARGET_VAR).as_deref()).unwrap_or_else(|e| {
            tracing::warn!(
                "{e}; using the default {:?}",
                crate::core::aqm::DEFAULT_TARGET
            );
            Some(crate::core::aqm::DEFAULT_TARGET)
        })
    })
}

/// The variable that sets the packet threads' real-time priority, and its range: 0 keeps them at
/// normal priority; at most 49, below the kernel's interrupt threads (50).
const RT_PRIORITY_VAR: &str = "TUNNELGATE_RT_PRIORITY";
const RT_PRIORITY_RANGE: RangeInclusive<u64> = 0..=49;
/// The default: the lowest real-time priority, above every ordinary thread and below every other
/// real-time one.
const DEFAULT_RT_PRIORITY: i32 = 1;

/// The packet threads' `SCHED_FIFO` priority (`core::priority`): `TUNNELGATE_RT_PRIORITY`, else
/// 1; `None` when 0 (normal priority only). Read once; a bad value is warned about and the
/// default stays.
pub fn rt_priority() -> Option<i32> {
    static PRIORITY: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    *PRIORITY.get_or_init(|| {
        rt_priority_from(std::env::var_os(RT_PRIORITY_VAR).as_deref()).unwrap_or_else(|e| {
            tracing::warn!("{e}; using the default {DEFAULT_RT_PRIORITY}");
            Some(DEFAULT_RT_PRIORITY)
        })
    })
}

/// [`rt_priority`] for a given value of its variable.
fn rt_priority_from(value: Option<&OsStr>) -> Result<Option<i32>, String> {
    Ok(match bounded(RT_PRIORITY_VAR, value, &RT_PRIORITY_RANGE)? {
        None => Some(DEFAULT_RT_PRIORITY),
        Some(0) => None,
        Some(p) => i32::try_from(p).ok(),
    })
}

/// [`aqm_target`] for a given value of its variable.
fn aqm_target_from(value: Option<&OsStr>) -> Result<Option<Duration>, String> {
    Ok(match bounded(AQM_TARGET_VAR, value, &AQM_TARGET_RANGE)? {
        None => Some(crate::core::aqm::DEFAULT_TARGET),
        Some(0) => None,
        Some(micros) => Some(Duration::from_micros(micros)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt as _;

    const RANGE: RangeInclusive<u64> = 16..=65536;

    fn parse(raw: &[u8]) -> Result<Option<u64>, String> {
        bounded("TUNNELGATE_X", Some(OsStr::from_bytes(raw)), &RANGE)
    }

    #[test]
    fn unset_or_empty_means_the_default_and_a_number_in_range_is_taken() {
        assert_eq!(bounded("TUNNELGATE_X", None, &RANGE), Ok(None));
        assert_eq!(parse(b""), Ok(None));
        assert_eq!(parse(b"16"), Ok(Some(16)));
        assert_eq!(parse(b"65536"), Ok(Some(65536)));
    }

    #[test]
    fn garbage_out_of_range_huge_and_not_utf8_values_are_named_short() {
        for raw in [
            &b"15"[..],
            b"65537",
            b"-1",
            b"4k",
            b" 512",
            b"99999999999999999999999999",
            b"\xff\xfe",
            &[b'7'; 100_000],
        ] {
            let e = parse(raw).expect_err("refused");
            assert!(e.starts_with("TUNNELGATE_X=\""), "{e}");
            assert!(e.ends_with("expected a number from 16 to 65536"), "{e}");
            assert!(e.len() < 160, "{e}");
        }
    }

    #[test]
    fn the_aqm_target_is_microseconds_zero_is_off_and_garbage_is_named() {
        let target = |raw: &[u8]| aqm_target_from(Some(OsStr::from_bytes(raw)));
        let default = Some(crate::core::aqm::DEFAULT_TARGET);
        assert_eq!(aqm_target_from(None), Ok(default));
        assert_eq!(target(b""), Ok(default));
        assert_eq!(target(b"0"), Ok(None));
        assert_eq!(target(b"500"), Ok(Some(Duration::from_micros(500))));
        assert_eq!(target(b"100000"), Ok(Some(Duration::from_millis(100))));
        for bad in [&b"100001"[..], b"-1", b"1ms", b"\xff", &[b'9'; 100_000]] {
            let e = target(bad).expect_err("refused");
            assert!(
                e.starts_with("TUNNELGATE_AQM_TARGET_US=") && e.len() < 120,
                "{e}"
            );
        }
    }

    #[test]
    fn the_rt_priority_is_1_to_49_zero_is_off_and_garbage_is_named() {
        let priority = |raw: &[u8]| rt_priority_from(Some(OsStr::from_bytes(raw)));
        assert_eq!(rt_priority_from(None), Ok(Some(DEFAULT_RT_PRIORITY)));
        assert_eq!(priority(b""), Ok(Some(DEFAULT_RT_PRIORITY)));
        assert_eq!(priority(b"0"), Ok(None));
        assert_eq!(priority(b"49"), Ok(Some(49)));
        for bad in [&b"50"[..], b"99", b"-1", b"fifo", b"\xff", &[b'1'; 100_000]] {
            let e = priority(bad).expect_err("refused");
            assert!(
                e.starts_with("TUNNELGATE_RT_PRIORITY=") && e.len() < 120,
                "{e}"
            );
        }
    }
}
