//! The one way a test skips a check it cannot make here (a tool missing, no package built):
//! [`skip`] says so on a developer's machine and fails under `CI=true`, so CI never reports ok
//! for a check it did not make. `tests/skips.rs` holds every test to it.

use std::fmt::Display;

/// Whether this run is CI's: `.ci/run` runs `scripts/test.sh` with `CI=true`, and that script
/// installs what every check needs.
fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// The calling test cannot make its check here, because of `why` (say what is missing and how
/// to get it). On a developer's machine this prints `SKIPPED <test>: <why>` on stderr and the
/// caller returns; under `CI=true` it panics, so the test fails instead of passing unchecked.
///
/// A helper that may skip is named `..._or_skip` and returns `None` (or `false`) after calling
/// this, so every test that can skip shows it where it calls the helper.
#[track_caller]
pub fn skip(why: impl Display) {
    // libtest runs each test on a thread named after it.
    let current = std::thread::current();
    let test = current.name().unwrap_or("this test");
    if in_ci() {
        panic!("CI=true, and {test} cannot make its check: {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
}

/// `Ok(value)`, or `None` after [`skip`] with the error: for a prerequisite found as a `Result`.
#[track_caller]
pub fn ok_or_skip<T, E: Display>(found: Result<T, E>) -> Option<T> {
    match found {
        Ok(value) => Some(value),
        Err(why) => {
            skip(why);
            None
        }
    }
}
