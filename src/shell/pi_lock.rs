//! A priority-inheriting lock on a Linux PI futex: a thread that blocks on it lends the holder
//! its scheduling priority (a real-time waiter makes a normal-priority holder real-time) until
//! the holder unlocks. The relay's partners hold theirs while they work on a read, so a
//! real-time reader that must wait for a partner's turn makes that partner run at once instead
//! of after whatever the scheduler prefers (`shell::dataplane::relay`).
//!
//! The protocol is the kernel's (futex(2), "Priority-inheritance futexes"): the word holds the
//! owner's thread id; an uncontended lock or unlock is one compare-and-swap; a contended lock
//! is `FUTEX_LOCK_PI`, which queues the caller, boosts the owner and marks the word; an unlock
//! whose word was marked is `FUTEX_UNLOCK_PI`, which hands the lock to the first waiter.
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

/// `FUTEX_LOCK_PI` (with `until`, an absolute `CLOCK_REALTIME` time: the kernel's clock for
/// this operation) or `FUTEX_UNLOCK_PI` on `word`.
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

/// `CLOCK_REALTIME` plus `after`, as `FUTEX_LOCK_PI`'s timeout wants it.
fn realtime_in(after: Duration) -> libc::timespec {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a live timespec; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let nanos = now.tv_nsec + i64::from(after.subsec_nanos());
    libc::timespec {
        tv_sec: now.tv_sec
            + libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX / 2)
            + libc::time_t::from(nanos >= 1_000_000_000),
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
            let until = stop.map(|_| realtime_in(every));
            match futex(&self.word, libc::FUTEX_LOCK_PI, until.as_ref()) {
                Ok(()) => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => continue,
                // EAGAIN: the owner is exiting; try again.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::yield_now(),
                Err(e) => return Err(std::io::Error::new(e.kind(), format!("FUTEX_LOCK_PI: {e}"))),
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
    use std::sync::Arc;
    use std::time::Duration;

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
        let lock = Arc::new(PiLock::new());
        let stop = Arc::new(AtomicBool::new(false));
        lock.lock().expect("lock");
        let waiter = {
            let (lock, stop) = (lock.clone(), stop.clone());
            std::thread::spawn(move || {
                let took = lock
                    .lock_until_stopped(&stop, Duration::from_millis(5))
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
