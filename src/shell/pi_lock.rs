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

use std::sync::atomic::{AtomicU32, Ordering};

/// The lock. Not reentrant: a holder that locks it again gets `EDEADLK`, which panics.
#[derive(Debug, Default)]
pub struct PiLock {
    word: AtomicU32,
}

/// The calling thread's id, as the futex word holds it (read once per thread).
fn my_tid() -> u32 {
    thread_local! {
        static TID: u32 = {
            // SAFETY: gettid takes no arguments and cannot fail.
            let tid = unsafe { libc::gettid() };
            u32::try_from(tid).unwrap_or(0)
        };
    }
    TID.with(|t| *t)
}

fn futex(word: &AtomicU32, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: `word` is a live, aligned u32 for the whole call; the PI operations take no
    // value, timeout (none: block until acquired) or second word.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            0,
            std::ptr::null::<libc::timespec>(),
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

impl PiLock {
    pub const fn new() -> PiLock {
        PiLock {
            word: AtomicU32::new(0),
        }
    }

    /// Takes the lock, blocking (and lending the caller's priority to the holder) while
    /// another thread holds it.
    pub fn lock(&self) {
        let me = my_tid();
        if self
            .word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        loop {
            match futex(&self.word, libc::FUTEX_LOCK_PI) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // EAGAIN: the owner is exiting; try again.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::yield_now(),
                Err(e) => panic!("FUTEX_LOCK_PI failed: {e}"),
            }
        }
    }

    /// Releases the lock, handing it to the first waiter if there is one (and ending the
    /// priority it lent).
    pub fn unlock(&self) {
        let me = my_tid();
        if self
            .word
            .compare_exchange(me, 0, Ordering::Release, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        if let Err(e) = futex(&self.word, libc::FUTEX_UNLOCK_PI) {
            panic!("FUTEX_UNLOCK_PI failed: {e}");
        }
    }

    /// Waits until the current holder (if any) unlocks: lends it the caller's priority
    /// meanwhile, and holds the lock for no longer than the two calls.
    pub fn wait_for_holder(&self) {
        if self.word.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.lock();
        self.unlock();
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
                        lock.lock();
                        // Not atomic as a whole: only the lock keeps the increments whole.
                        let n = count.load(Ordering::Relaxed);
                        count.store(n + 1, Ordering::Relaxed);
                        lock.unlock();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("joined");
        }
        assert_eq!(count.load(Ordering::Relaxed), 80_000);

        lock.lock();
        let (waiter_lock, done) = (lock.clone(), Arc::new(AtomicU32::new(0)));
        let waiter_done = done.clone();
        let waiter = std::thread::spawn(move || {
            waiter_lock.wait_for_holder();
            waiter_done.store(1, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            done.load(Ordering::SeqCst),
            0,
            "the waiter went past a held lock"
        );
        lock.unlock();
        waiter.join().expect("joined");
        assert_eq!(done.load(Ordering::SeqCst), 1);
        // Free again: an uncontended lock.
        lock.lock();
        lock.unlock();
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
                lock.lock();
                tid.store(my_tid(), Ordering::SeqCst);
                while release.load(Ordering::SeqCst) == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                lock.unlock();
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
                lock.wait_for_holder();
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
