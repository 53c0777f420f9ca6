//! A priority-inheriting lock on a Linux PI futex: a thread that blocks on it lends the holder
//! its scheduling priority (a real-time waiter makes a normal-priority holder real-time) until
//! the holder unlocks. The relay's partners hold theirs while they work on a read, so a
//! real-time reader that must wait for a partner's turn makes that partner run at once instead
//! of after whatever the scheduler prefers (`shell::dataplane::relay`).
//!
//! The protocol is the kernel's (futex(2), "Priority-inheritance futexes"): the word holds the
//! owner's thread id; an uncontended lock or unlock is one compare-and-swap; a contended lock
//! is `FUTEX_LOCK_PI`, which queues the caller, boosts the owner and marks the word; an unlock
//! whose word was marked is `FUTEX_UNLOCK_PI`, which hands the lock to the first waiter. A wait
//! that looks at a stop times out every so often on `CLOCK_MONOTONIC` (`FUTEX_LOCK_PI2`; on a
//! kernel older than 5.14, `FUTEX_LOCK_PI` on `CLOCK_REALTIME`, said once in the log): both are
//! the one `futex` system call the packet threads' seccomp filter allows.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// The lock. Not reentrant: a holder that locks it again gets `EDEADLK`, an error.
#[derive(Debug, Default)]
pub struct PiLock {
    word: AtomicU32,
}

/// The calling thread's id, as the futex word holds it (read once per thread). An id that
/// cannot be read is an error: 0 in the word means "free", so a lock taken as 0 would lock
/// nothing.
fn my_tid() -> std::io::Result<u32> {
    thread_local! {
        static TID: std::io::Result<u32> = {
            // SAFETY: gettid takes no arguments.
            futex_tid(unsafe { libc::gettid() })
        };
    }
    TID.with(|t| match t {
        Ok(t) => Ok(*t),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    })
}

/// `tid` as a PI futex word holds it: positive and within `FUTEX_TID_MASK`, else an error.
fn futex_tid(tid: libc::pid_t) -> std::io::Result<u32> {
    u32::try_from(tid)
        .ok()
        .filter(|&t| t != 0 && t & !libc::FUTEX_TID_MASK == 0)
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "this thread's id cannot be read (gettid gave {tid}): a PI lock taken as it \
                 would lock nothing"
            ))
        })
}

/// `FUTEX_LOCK_PI2` (linux/futex.h, Linux 5.14): `FUTEX_LOCK_PI` whose timeout is an absolute
/// `CLOCK_MONOTONIC` time (unless `FUTEX_CLOCK_REALTIME` is given, which we never do).
const FUTEX_LOCK_PI2: libc::c_int = 13;

/// `op` (`FUTEX_LOCK_PI`, `FUTEX_LOCK_PI2` or `FUTEX_UNLOCK_PI`) on `word`, with `until` (an
/// absolute time on the operation's clock: [`WaitClock`]) as the lock's timeout.
fn futex(word: &AtomicU32, op: libc::c_int, until: Option<&libc::timespec>) -> std::io::Result<()> {
    let timeout = until.map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, aligned u32 for the whole call, `timeout` null or a live
    // timespec; the PI operations take no value or second word.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            0,
            timeout,
            std::ptr::null::<u32>(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The clock a wait that looks at a stop times out on, with the operation that reads it.
/// `CLOCK_MONOTONIC` (`FUTEX_LOCK_PI2`) unless the kernel lacks that operation: a step of the
/// wall clock (NTP, an operator's `date -s`) then cannot push a deadline hours away and stall
/// the look at the stop. `CLOCK_REALTIME` (`FUTEX_LOCK_PI`, whose timeout is always on it) only
/// on kernels older than 5.14.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WaitClock {
    Monotonic,
    Realtime,
}

/// Set once the kernel said `ENOSYS` to `FUTEX_LOCK_PI2`: every timed wait after that uses
/// `FUTEX_LOCK_PI` on `CLOCK_REALTIME`.
static NO_LOCK_PI2: AtomicBool = AtomicBool::new(false);

impl WaitClock {
    /// The clock this kernel's timed waits use.
    fn of_this_kernel() -> WaitClock {
        if NO_LOCK_PI2.load(Ordering::Relaxed) {
            WaitClock::Realtime
        } else {
            WaitClock::Monotonic
        }
    }

    fn op(self) -> libc::c_int {
        match self {
            WaitClock::Monotonic => FUTEX_LOCK_PI2,
            WaitClock::Realtime => libc::FUTEX_LOCK_PI,
        }
    }

    fn id(self) -> libc::clockid_t {
        match self {
            WaitClock::Monotonic => libc::CLOCK_MONOTONIC,
            WaitClock::Realtime => libc::CLOCK_REALTIME,
        }
    }

    /// The absolute time `after` from now on this clock, as the lock's timeout wants it.
    fn deadline_in(self, after: Duration) -> std::io::Result<libc::timespec> {
        Ok(deadline(clock_now(self.id())?, after))
    }
}

/// Says, once per process, that the kernel has no `FUTEX_LOCK_PI2` and the timed waits fall
/// back to `FUTEX_LOCK_PI` on `CLOCK_REALTIME`.
fn fall_back_to_realtime() {
    if !NO_LOCK_PI2.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "This kernel has no FUTEX_LOCK_PI2 (Linux 5.14): a relay wait looks at a stop on \
             CLOCK_REALTIME, so a step of the wall clock can delay a stop"
        );
    }
}

/// `clock`'s time now; an error (never a time of zero) when the clock cannot be read.
fn clock_now(clock: libc::clockid_t) -> std::io::Result<libc::timespec> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a live timespec for the whole call.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!("clock_gettime({clock}): {e}"),
        ));
    }
    Ok(now)
}

/// `now` plus `after`, the nanoseconds carried; saturates far in the future.
fn deadline(now: libc::timespec, after: Duration) -> libc::timespec {
    let nanos = now.tv_nsec + libc::c_long::from(after.subsec_nanos());
    let secs = libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX);
    let secs = now
        .tv_sec
        .saturating_add(secs)
        .saturating_add(libc::time_t::from(nanos >= 1_000_000_000));
    libc::timespec {
        tv_sec: secs,
        tv_nsec: nanos % 1_000_000_000,
    }
}

impl PiLock {
    pub const fn new() -> PiLock {
        PiLock {
            word: AtomicU32::new(0),
        }
    }

    /// Takes the lock, blocking (and lending the caller's priority to the holder) while
    /// another thread holds it.
    pub fn lock(&self) -> std::io::Result<()> {
        self.lock_unless(None, Duration::ZERO).map(|_| ())
    }

    /// As [`PiLock::lock`], but gives up once `stop` is set, looking at it at least every
    /// `every` while it blocks: true when it took the lock, false when it stopped first.
    pub fn lock_until_stopped(&self, stop: &AtomicBool, every: Duration) -> std::io::Result<bool> {
        self.lock_unless(Some(stop), every)
    }

    fn lock_unless(&self, stop: Option<&AtomicBool>, every: Duration) -> std::io::Result<bool> {
        self.lock_on(stop, every, WaitClock::of_this_kernel)
    }

    /// [`PiLock::lock_unless`] with the timed waits on the clock `clock` gives (the kernel's
    /// choice, or a test's).
    fn lock_on(
        &self,
        stop: Option<&AtomicBool>,
        every: Duration,
        clock: impl Fn() -> WaitClock,
    ) -> std::io::Result<bool> {
        let me = my_tid()?;
        if self
            .word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return Ok(true);
        }
        loop {
            if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                return Ok(false);
            }
            // Untimed: no clock. Timed: a deadline `every` from now on the wait's clock.
            let (op, until) = match stop {
                None => (libc::FUTEX_LOCK_PI, None),
                Some(_) => {
                    let clock = clock();
                    (clock.op(), Some(clock.deadline_in(every)?))
                }
            };
            #[cfg(test)]
            tests::saw_wait(op, until);
            match futex(&self.word, op, until.as_ref()) {
                Ok(()) => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && op == FUTEX_LOCK_PI2 => {
                    fall_back_to_realtime();
                }
                // EAGAIN: the owner is exiting; try again.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::yield_now(),
                Err(e) => {
                    let name = if op == FUTEX_LOCK_PI2 {
                        "FUTEX_LOCK_PI2"
                    } else {
                        "FUTEX_LOCK_PI"
                    };
                    return Err(std::io::Error::new(e.kind(), format!("{name}: {e}")));
                }
            }
        }
    }

    /// Releases the lock, handing it to the first waiter if there is one (and ending the
    /// priority it lent). An error when the caller does not hold it.
    pub fn unlock(&self) -> std::io::Result<()> {
        let me = my_tid()?;
        if self
            .word
            .compare_exchange(me, 0, Ordering::Release, Ordering::Relaxed)
            .is_ok()
        {
            return Ok(());
        }
        futex(&self.word, libc::FUTEX_UNLOCK_PI, None)
            .map_err(|e| std::io::Error::new(e.kind(), format!("FUTEX_UNLOCK_PI: {e}")))
    }

    /// The word (0: free), for tests.
    #[cfg(test)]
    pub fn word_for_tests(&self) -> u32 {
        self.word.load(Ordering::SeqCst)
    }

    /// Waits until the current holder (if any) unlocks, or `stop` is set (looked at least
    /// every `every`): lends the holder the caller's priority meanwhile, and holds the lock
    /// for no longer than the two calls.
    pub fn wait_for_holder(&self, stop: &AtomicBool, every: Duration) -> std::io::Result<()> {
        if self.word.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        if self.lock_until_stopped(stop, every)? {
            self.unlock()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::Arc;
    use std::time::Duration;

    thread_local! {
        /// The operation and deadline of this thread's last timed wait.
        static LAST_WAIT: Cell<Option<(libc::c_int, libc::timespec)>> = const { Cell::new(None) };
    }

    /// Called by [`PiLock::lock_on`] before each wait.
    pub(super) fn saw_wait(op: libc::c_int, until: Option<libc::timespec>) {
        if let Some(until) = until {
            LAST_WAIT.with(|w| w.set(Some((op, until))));
        }
    }

    fn ts(tv_sec: libc::time_t, tv_nsec: libc::c_long) -> libc::timespec {
        libc::timespec { tv_sec, tv_nsec }
    }

    fn nanos(t: libc::timespec) -> i128 {
        i128::from(t.tv_sec) * 1_000_000_000 + i128::from(t.tv_nsec)
    }

    #[test]
    fn a_deadline_carries_its_nanoseconds_and_saturates() {
        let at = |t: libc::timespec| (t.tv_sec, t.tv_nsec);
        assert_eq!(
            at(deadline(ts(5, 0), Duration::from_millis(5))),
            (5, 5_000_000)
        );
        assert_eq!(
            at(deadline(ts(5, 999_999_999), Duration::from_nanos(1))),
            (6, 0)
        );
        assert_eq!(
            at(deadline(ts(1, 500_000_000), Duration::from_millis(1_600))),
            (3, 100_000_000)
        );
        assert_eq!(at(deadline(ts(7, 3), Duration::ZERO)), (7, 3));
        let far = deadline(ts(1_000, 999_999_999), Duration::MAX);
        assert_eq!(far.tv_sec, libc::time_t::MAX, "saturated, not wrapped");
        assert!((0..1_000_000_000).contains(&far.tv_nsec));
    }

    /// A clock that cannot be read is an error, not a deadline counted from 1970 (which would
    /// make every timed wait time out at once: a busy loop).
    #[test]
    fn a_clock_that_cannot_be_read_is_an_error() {
        let e = clock_now(0x7fff).expect_err("no clock 0x7fff");
        assert!(e.to_string().contains("clock_gettime"), "{e}");
        assert!(clock_now(libc::CLOCK_MONOTONIC).expect("monotonic").tv_sec >= 0);
    }

    /// A wait that looks at a stop times out on `CLOCK_MONOTONIC` (`FUTEX_LOCK_PI2`, without
    /// `FUTEX_CLOCK_REALTIME`), its deadline `every` from the monotonic now: a step of the wall
    /// clock cannot move it. (The machine's clock is not stepped here: that needs
    /// `CAP_SYS_TIME` and moves every other process's clock too.)
    #[test]
    fn a_timed_wait_is_on_the_monotonic_clock() {
        if NO_LOCK_PI2.load(Ordering::Relaxed) {
            crate::test_util::skip("this kernel has no FUTEX_LOCK_PI2 (Linux < 5.14)");
            return;
        }
        let lock = Arc::new(PiLock::new());
        let other = lock.clone();
        let holder = std::thread::spawn(move || {
            other.lock().expect("lock");
            std::thread::sleep(Duration::from_millis(100));
            other.unlock().expect("unlock");
        });
        while lock.word_for_tests() == 0 {
            std::thread::yield_now();
        }
        let every = Duration::from_millis(20);
        let before = clock_now(libc::CLOCK_MONOTONIC).expect("monotonic");
        let never = AtomicBool::new(false);
        LAST_WAIT.with(|w| w.set(None));
        let took = lock.lock_until_stopped(&never, every).expect("lock");
        let after = clock_now(libc::CLOCK_MONOTONIC).expect("monotonic");
        lock.unlock().expect("unlock");
        holder.join().expect("holder");
        assert!(took);
        let (op, until) = LAST_WAIT.with(Cell::get).expect("a timed wait");
        if NO_LOCK_PI2.load(Ordering::Relaxed) {
            crate::test_util::skip("this kernel refused FUTEX_LOCK_PI2 (Linux < 5.14)");
            return;
        }
        assert_eq!(
            op, FUTEX_LOCK_PI2,
            "the operation that times out on CLOCK_MONOTONIC"
        );
        assert_eq!(op & libc::FUTEX_CLOCK_REALTIME, 0);
        let every = i128::try_from(every.as_nanos()).expect("small");
        let until = nanos(until);
        assert!(
            until >= nanos(before) + every && until <= nanos(after) + every,
            "the deadline {until} ns is not `every` from the monotonic now ({} ns .. {} ns)",
            nanos(before),
            nanos(after)
        );
    }

    /// Two threads add to a counter under the lock: nothing is lost, and a waiter blocks until
    /// the holder unlocks.
    #[test]
    fn the_lock_excludes_and_hands_over() {
        let lock = Arc::new(PiLock::new());
        let count = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (lock, count) = (lock.clone(), count.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        lock.lock().expect("lock");
                        // Not atomic as a whole: only the lock keeps the increments whole.
                        let n = count.load(Ordering::Relaxed);
                        count.store(n + 1, Ordering::Relaxed);
                        lock.unlock().expect("unlock");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("joined");
        }
        assert_eq!(count.load(Ordering::Relaxed), 80_000);

        lock.lock().expect("lock");
        let (waiter_lock, done) = (lock.clone(), Arc::new(AtomicU32::new(0)));
        let waiter_done = done.clone();
        let waiter = std::thread::spawn(move || {
            let never = AtomicBool::new(false);
            waiter_lock
                .wait_for_holder(&never, Duration::from_millis(1))
                .expect("wait");
            waiter_done.store(1, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            done.load(Ordering::SeqCst),
            0,
            "the waiter went past a held lock"
        );
        lock.unlock().expect("unlock");
        waiter.join().expect("joined");
        assert_eq!(done.load(Ordering::SeqCst), 1);
        // Free again: an uncontended lock.
        lock.lock().expect("lock");
        lock.unlock().expect("unlock");
    }

    /// A waiter blocked in `FUTEX_LOCK_PI` on a lock that is never released returns soon after
    /// a stop, without the lock: a stop ends every wait.
    #[test]
    fn a_stop_ends_a_wait_on_a_contended_lock() {
        a_stop_ends_a_wait_on(WaitClock::of_this_kernel);
    }

    /// The fallback of kernels without `FUTEX_LOCK_PI2` honours a stop the same way.
    #[test]
    fn a_stop_ends_a_wait_on_the_realtime_fallback_too() {
        a_stop_ends_a_wait_on(|| WaitClock::Realtime);
    }

    fn a_stop_ends_a_wait_on(clock: fn() -> WaitClock) {
        let lock = Arc::new(PiLock::new());
        let stop = Arc::new(AtomicBool::new(false));
        lock.lock().expect("lock");
        let waiter = {
            let (lock, stop) = (lock.clone(), stop.clone());
            std::thread::spawn(move || {
                let took = lock
                    .lock_on(Some(&stop), Duration::from_millis(5), clock)
                    .expect("lock");
                (took, crate::shell::clock::now())
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "the waiter went past a held lock");
        let stopped = crate::shell::clock::now();
        stop.store(true, Ordering::SeqCst);
        while !waiter.is_finished() && crate::shell::clock::since(stopped) < Duration::from_secs(2)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let ended = waiter.is_finished();
        // The holder still holds it, and can release it (which also ends a waiter that the
        // stop did not, so a failure is a failure and not a hang).
        lock.unlock().expect("unlock");
        let (took, returned) = waiter.join().expect("waiter");
        assert!(ended, "the waiter still waits 2 s after the stop");
        assert!(!took, "took a lock that was never released");
        let waited = returned.saturating_duration_since(stopped);
        assert!(
            waited < Duration::from_millis(500),
            "returned {waited:?} after the stop"
        );
        // Free again.
        lock.lock().expect("free again");
        lock.unlock().expect("unlock");
    }

    #[test]
    fn a_thread_id_that_cannot_be_read_is_an_error_not_an_empty_lock() {
        assert!(futex_tid(0).is_err(), "0 is the free word");
        assert!(futex_tid(-1).is_err());
        assert!(futex_tid(0x4000_0000).is_err(), "past FUTEX_TID_MASK");
        assert_eq!(futex_tid(1234).expect("a tid"), 1234);
        assert!(my_tid().expect("this thread's id") > 0);
    }

    /// Unlocking a lock the caller does not hold is an error, not a panic.
    #[test]
    fn unlocking_a_lock_held_by_another_is_an_error() {
        let lock = Arc::new(PiLock::new());
        let other = lock.clone();
        std::thread::spawn(move || other.lock().expect("lock"))
            .join()
            .expect("locker");
        assert!(lock.unlock().is_err());
    }

    /// The kernel priority (`/proc/self/task/TID/stat` field 18) of thread `tid`: 20 for a
    /// normal thread at nice 0, negative at real-time priority (-1 - its priority).
    fn kernel_priority(tid: u32) -> i64 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
        let (_, after_name) = stat.rsplit_once(')').expect("a stat line");
        after_name
            .split_whitespace()
            .nth(15)
            .and_then(|p| p.parse().ok())
            .expect("field 18")
    }

    /// A real-time thread blocked on the lock runs the normal-priority holder at its own
    /// priority until the holder unlocks: what the relay's readers rely on.
    #[test]
    #[ignore = "needs root (real-time priority)"]
    fn a_real_time_waiter_lends_the_holder_its_priority_until_it_unlocks() {
        use crate::core::priority::Priority;
        let lock = Arc::new(PiLock::new());
        let holder_tid = Arc::new(AtomicU32::new(0));
        let release = Arc::new(AtomicU32::new(0));
        let holder = {
            let (lock, tid, release) = (lock.clone(), holder_tid.clone(), release.clone());
            std::thread::spawn(move || {
                lock.lock().expect("lock");
                tid.store(my_tid().expect("tid"), Ordering::SeqCst);
                while release.load(Ordering::SeqCst) == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                lock.unlock().expect("unlock");
            })
        };
        while holder_tid.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let tid = holder_tid.load(Ordering::SeqCst);
        assert_eq!(
            kernel_priority(tid),
            20,
            "the holder starts at normal priority"
        );
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                crate::shell::priority::set_current_thread(Priority::Realtime, 1)
                    .expect("SCHED_FIFO 1 (needs CAP_SYS_NICE or RLIMIT_RTPRIO)");
                let never = AtomicBool::new(false);
                lock.wait_for_holder(&never, Duration::from_millis(10))
                    .expect("wait");
            })
        };
        let mut boosted = false;
        for _ in 0..500 {
            if kernel_priority(tid) < 0 {
                boosted = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            boosted,
            "the holder runs at {} while a real-time thread waits",
            kernel_priority(tid)
        );
        release.store(1, Ordering::SeqCst);
        waiter.join().expect("waiter");
        holder.join().expect("holder");
    }
}
