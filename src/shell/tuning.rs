//! The queue-size knobs the benchmarks turn (`TUNNELGATE_SOCKET_BUFFER`,
//! `TUNNELGATE_TUN_TXQUEUELEN`): a number in a range, read from the environment once. A value
//! that is not one is named in a warning and the default stays, as for `TUNNELGATE_IPTABLES`.

use std::ffi::OsStr;
use std::ops::RangeInclusive;

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
}
