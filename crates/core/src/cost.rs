//! A work meter for the control paths: the steps that scale with a table's size (entries
//! visited, copied or recomputed) charge it, so tests can count what one change costs instead
//! of timing it. One counter per thread; a charge is one add to a thread-local, and nothing on
//! the packet path charges it (lookups never do).

use std::cell::Cell;

std::thread_local! {
    static WORK: Cell<u64> = const { Cell::new(0) };
}

/// Charges `units` of work (entries visited, copied or tallied) to this thread's meter.
#[inline]
pub fn charge(units: usize) {
    WORK.with(|w| w.set(w.get().saturating_add(units as u64)));
}

/// The work charged on this thread since the last call, and the meter back to zero.
pub fn take() -> u64 {
    WORK.with(|w| w.replace(0))
}

/// The work `f` charged on this thread (the meter's earlier count is kept).
pub fn of<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = take();
    let out = f();
    let spent = take();
    WORK.with(|w| w.set(before.saturating_add(spent)));
    (out, spent)
}
