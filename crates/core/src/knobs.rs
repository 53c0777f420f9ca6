//! How a `TUNNELGATE_*` environment variable's value is read: strictly, the same way for every
//! knob. A number is ASCII digits only (no sign, no spaces, no unit), within the knob's range; a
//! word is one of the knob's named words; a flag is `1`/`0` or `true`/`false`. Anything else,
//! an empty value included, is refused with one warning of one form, naming the variable, a
//! short escaped excerpt of the value and what was expected. Pure: the shell's `tuning` reads
//! the environment and passes the bytes in.

use std::ops::RangeInclusive;

/// The longest excerpt of a refused value a warning shows, in characters.
const SHOWN_CHARS: usize = 32;

/// The warning for a value of `name` that is not `expected`: `NAME="excerpt": expected ...`.
pub fn refused(name: &str, value: &[u8], expected: &str) -> String {
    let shown: String = String::from_utf8_lossy(value)
        .chars()
        .take(SHOWN_CHARS)
        .collect();
    format!("{name}={shown:?}: expected {expected}")
}

/// `value` of `name` as a number in `range`: `Ok(None)` when unset; `Err` (the warning) for
/// anything but ASCII digits in range, an empty value, a sign or a space included.
pub fn number(
    name: &str,
    value: Option<&[u8]>,
    range: &RangeInclusive<u64>,
) -> Result<Option<u64>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let expected = || format!("a number from {} to {}", range.start(), range.end());
    // `u64::from_str` takes a leading `+`: only digits are a number here.
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return Err(refused(name, value, &expected()));
    }
    match std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(refused(name, value, &expected())),
    }
}

/// `value` of `name` as one of `words` (its index): `Ok(None)` when unset; `Err` (the warning)
/// for anything else, an empty value, another case or spaces included.
pub fn word(name: &str, value: Option<&[u8]>, words: &[&str]) -> Result<Option<usize>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    match words.iter().position(|w| w.as_bytes() == value) {
        Some(i) => Ok(Some(i)),
        None => {
            let quoted: Vec<String> = words.iter().map(|w| format!("{w:?}")).collect();
            Err(refused(
                name,
                value,
                &format!("one of {}", quoted.join(", ")),
            ))
        }
    }
}

/// `value` of `name` as a flag: `1` or `true` is on, `0` or `false` off; `Ok(None)` when
/// unset; `Err` (the warning) for anything else, an empty value included.
pub fn flag(name: &str, value: Option<&[u8]>) -> Result<Option<bool>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    match value {
        b"1" | b"true" => Ok(Some(true)),
        b"0" | b"false" => Ok(Some(false)),
        _ => Err(refused(name, value, "1, 0, true or false")),
    }
}

/// A path: any non-empty value is taken (what it names is checked where it is used); an empty
/// value gets the warning.
pub fn path(name: &str, value: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
    match value {
        None => Ok(None),
        Some([]) => Err(refused(name, b"", "a path")),
        Some(v) => Ok(Some(v.to_vec())),
    }
}

/// Why a reader gets fewer relay partners than `TUNNELGATE_RELAY_PARTNERS` asked (`asked`), with
/// `workers` workers on `cpus` CPUs (`relay::partners`): `None` when it gets what was asked,
/// or nothing was.
pub fn relay_lowered(asked: Option<usize>, workers: usize, cpus: usize) -> Option<String> {
    let asked = asked?;
    let given = crate::relay::partners(workers, cpus).min(asked);
    if given >= asked {
        return None;
    }
    let reason = if workers <= 1 {
        "one worker".to_string()
    } else if cpus <= workers {
        format!("one partner per other CPU, {cpus} CPUs")
    } else {
        format!("one partner per other worker, {workers} workers")
    };
    Some(format!(
        "TUNNELGATE_RELAY_PARTNERS={asked} lowered to {given}: {reason}"
    ))
}

#[cfg(test)]
mod tests;
