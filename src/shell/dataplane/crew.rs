//! The crew: helper threads that seal and open part of one read's packets beside the reader
//! that read them, so one peer's traffic uses more than one core, in order.
//!
//! A reader with work that splits (the segments of one TUN read, the data messages of one
//! receive batch) posts it on its [`Seat`] as numbered jobs, wakes idle helpers (only idle ones,
//! and no more than there are jobs for), does the first job itself and then claims the rest
//! one by one, exactly as a helper does. A job nobody claimed by the time the reader gets to it,
//! the reader does itself: where no core is free, the helpers it woke have not run yet and the
//! reader does everything at the cost of one claim per job. It waits only for jobs a helper
//! claimed and is running (pure computation: no system call, no lock), then sends or writes
//! the whole read in order itself. So order needs no sequencer: the read is the unit, its
//! packets sit in their slots in counter (or arrival) order, and nothing leaves before all of
//! them are done.
//!
//! - **Bounded.** One task per seat, a fixed number of seats; jobs are index ranges of the
//!   reader's own buffers. Nothing is allocated per read or per packet.
//! - **Asleep when idle.** Helpers wait on a condition variable (the wait releases the board's
//!   lock). A reader waiting for a job a helper is running watches it end for some tens of
//!   microseconds (the rest of one job), then parks (a helper finishing the last one unparks
//!   it). No idle thread spins.
//! - **Locks.** The board's mutex is held to post, claim or finish a job: a few instructions,
//!   never across the job or any system call (helpers are unparked and woken after it is let
//!   go).
//! - **Priority.** Helpers run at normal priority: their CPU time is not the readers'
//!   real-time budget's to account for.
//!
//! Unsafe code, and why: a posted job is a reference to the reader's closure with its
//! lifetime erased (the reader takes the task off the board before it returns, and only when
//! no helper holds a job of it), and jobs write disjoint parts of the reader's buffers through
//! a raw pointer (each job number is handed out once and names its own range).
#![allow(unsafe_code)]

use crate::core::wg::{self, OpenKey, Opened, SealBatch, TunnelError};
use parking_lot::{Condvar, Mutex};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

/// Segments (or data messages) per job: about 5 microseconds of ChaCha20-Poly1305 at 1420
/// bytes. Small, so the reader's last wait (for the job a helper is in the middle of) is short;
/// on the busy 2-vCPU VM one peer with 2 workers moved 1.2x of 1 worker with 4, 1.13x with 8,
/// 0.95x with 2 and 0.89x with 16 (workers bench, 3 s points, one run each).
pub const JOB_PACKETS: usize = 4;

/// A reader waiting for a helper's job re-checks this often (in case an unpark was missed: it
/// cannot be, but a bounded wait costs nothing).
const WAIT_BOUND: Duration = Duration::from_millis(1);

/// How long (in spin-loop hints, some tens of microseconds) a reader watches a helper's job in
/// progress end before it parks: the rest of one job is shorter than a park and an unpark on a
/// virtual machine. Bounded, and only while a helper is running a job of this reader's read.
const WAIT_SPINS: u32 = 512;

/// How long an idle helper sleeps before it looks at the stop flag again.
const HELPER_IDLE: Duration = Duration::from_secs(1);

/// A pool of helpers and the seats readers post their work on (see the module). Dropping it
/// stops the helpers.
pub struct Crew {
    shared: Arc<Shared>,
}

struct Shared {
    board: Mutex<Board>,
    wake: Condvar,
    stop: AtomicBool,
    helpers: usize,
    /// Per seat, the helpers' jobs in progress (as `Task::helping`, readable without the lock).
    running: Box<[AtomicUsize]>,
    /// Readers with work in hand now ([`Seat::set_busy`]).
    busy: AtomicUsize,
}

struct Board {
    seats: Box<[SeatState]>,
    /// Helpers asleep on `wake`.
    idle: usize,
    /// Where the next helper's scan for work starts (fairness between seats).
    scan_from: usize,
}

#[derive(Default)]
struct SeatState {
    taken: bool,
    owner: Option<Thread>,
    task: Option<Task>,
}

/// A posted job function, its lifetime erased (see [`Task::run`]).
type JobFn = *const (dyn Fn(usize) + Sync);

/// One posted piece of work: jobs `0..jobs` of `run`.
#[derive(Clone, Copy)]
struct Task {
    /// The reader's job function, alive on its stack until the task is taken off the board
    /// (see [`Seat::run`]: the reader removes the task only when no helper holds a job of it).
    run: JobFn,
    next: usize,
    jobs: usize,
    /// Jobs claimed by helpers and not finished yet.
    helping: usize,
}

// SAFETY: `run` points at a `Sync` closure; it is called only while the task is on the board
// (see `Task::run`), and the board is behind a mutex.
unsafe impl Send for Task {}

impl Crew {
    /// A crew of `helpers` threads (started by [`Crew::spawn_helpers`]) with `seats` seats.
    pub fn new(helpers: usize, seats: usize) -> Crew {
        Crew {
            shared: Arc::new(Shared {
                board: Mutex::new(Board {
                    seats: (0..seats).map(|_| SeatState::default()).collect(),
                    idle: 0,
                    scan_from: 0,
                }),
                wake: Condvar::new(),
                stop: AtomicBool::new(false),
                helpers,
                running: (0..seats).map(|_| AtomicUsize::new(0)).collect(),
                busy: AtomicUsize::new(0),
            }),
        }
    }

    pub fn helpers(&self) -> usize {
        self.shared.helpers
    }

    /// Starts the helpers, named by `name(i)`; each calls `setup` first (seccomp).
    pub fn spawn_helpers(
        &self,
        name: impl Fn(usize) -> String,
        setup: impl Fn() + Clone + Send + 'static,
    ) -> std::io::Result<Vec<JoinHandle<()>>> {
        (0..self.shared.helpers)
            .map(|i| {
                let (shared, setup) = (self.shared.clone(), setup.clone());
                std::thread::Builder::new().name(name(i)).spawn(move || {
                    setup();
                    helper_loop(&shared);
                })
            })
            .collect()
    }

    /// A seat for the calling thread (the one that will post on it). Without a free seat (or
    /// helpers) the seat runs every job on the caller.
    pub fn seat(&self) -> Seat {
        let index = if self.shared.helpers == 0 {
            None
        } else {
            let mut board = self.shared.board.lock();
            let free = board.seats.iter().position(|s| !s.taken);
            if let Some(i) = free {
                board.seats[i] = SeatState {
                    taken: true,
                    owner: Some(std::thread::current()),
                    task: None,
                };
            }
            free
        };
        Seat {
            shared: self.shared.clone(),
            index,
            busy: std::cell::Cell::new(false),
        }
    }

    /// Ends the helpers (they finish the job in hand first).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Finds a job for a helper on the board: the seat, the job and the function to run it with.
fn claim(board: &mut Board) -> Option<(usize, usize, JobFn)> {
    let n = board.seats.len();
    for k in 0..n {
        let s = (board.scan_from + k) % n;
        if let Some(task) = board.seats[s].task.as_mut() {
            if task.next < task.jobs {
                let job = task.next;
                task.next += 1;
                task.helping += 1;
                board.scan_from = (s + 1) % n;
                return Some((s, job, task.run));
            }
        }
    }
    None
}

fn helper_loop(shared: &Shared) {
    loop {
        let claimed = {
            let mut board = shared.board.lock();
            loop {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                if let Some(claimed) = claim(&mut board) {
                    shared.running[claimed.0].fetch_add(1, Ordering::Release);
                    break claimed;
                }
                board.idle += 1;
                // Releases the lock while asleep.
                shared.wake.wait_for(&mut board, HELPER_IDLE);
                board.idle -= 1;
            }
        };
        let (seat, job, run) = claimed;
        // SAFETY: the task stays on the board, and its closure alive on the reader's stack,
        // until `helping` is back to 0 (`Seat::run`), which happens only below.
        unsafe { (*run)(job) };
        let owner = finished(&mut shared.board.lock(), seat);
        shared.running[seat].fetch_sub(1, Ordering::Release);
        // After the lock: an unpark is a system call.
        if let Some(owner) = owner {
            owner.unpark();
        }
    }
}

/// A helper finished a job of `seat`'s task: the reader to unpark if it was the last one out.
fn finished(board: &mut Board, seat: usize) -> Option<Thread> {
    let state = &mut board.seats[seat];
    let task = state
        .task
        .as_mut()
        .expect("a task with a job in hand stays posted");
    task.helping -= 1;
    if task.helping == 0 && task.next == task.jobs {
        state.owner.clone()
    } else {
        None
    }
}

/// The reader's next step on its own task: a job nobody claimed, a wait for the helpers'
/// jobs, or done (the task is then off the board).
fn next_for_reader(board: &mut Board, seat: usize) -> Next {
    let state = &mut board.seats[seat];
    let task = state.task.as_mut().expect("own task stays posted");
    if task.next < task.jobs {
        task.next += 1;
        Next::Job(task.next - 1)
    } else if task.helping == 0 {
        state.task = None;
        Next::Done
    } else {
        Next::Wait
    }
}

/// A reader's place on the crew's board, held for the reader's life.
pub struct Seat {
    shared: Arc<Shared>,
    index: Option<usize>,
    /// Whether this seat's reader counts among the busy ones.
    busy: std::cell::Cell<bool>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.set_busy(false);
        if let Some(i) = self.index {
            self.shared.board.lock().seats[i] = SeatState::default();
        }
    }
}

enum Next {
    Job(usize),
    Wait,
    Done,
}

impl Seat {
    /// The reader has work in hand (`true`: from a read that returned data) or is about to
    /// block for more (`false`). While as many readers are busy as the crew has threads (its
    /// helpers and one), every core is taken by a reader: a read's jobs wake no helper then,
    /// since a woken helper would only take a core from a reader, and a job it claimed and
    /// was then descheduled in would hold its read back. Two atomic operations per change.
    pub fn set_busy(&self, busy: bool) {
        if self.index.is_none() || self.busy.replace(busy) == busy {
            return;
        }
        if busy {
            self.shared.busy.fetch_add(1, Ordering::Relaxed);
        } else {
            self.shared.busy.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// How many of `idle` sleeping helpers a read of `jobs` jobs wakes: none while every core
    /// is taken by a busy reader (see [`Seat::set_busy`]), else one per job but the reader's.
    fn helpers_to_wake(&self, idle: usize, jobs: usize) -> usize {
        let cores_free = self.shared.busy.load(Ordering::Relaxed) <= self.shared.helpers;
        if cores_free {
            idle.min(jobs.saturating_sub(1))
        } else {
            0
        }
    }

    /// Whether jobs posted here may go to a helper.
    pub fn has_helpers(&self) -> bool {
        self.index.is_some()
    }

    /// Runs `job(0)` .. `job(jobs - 1)`, each exactly once, on this thread and any idle
    /// helper; returns when all are done. The caller does job 0 and every job no helper
    /// claimed first; it waits only for jobs a helper is running.
    pub fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
        let Some(index) = self.index.filter(|_| jobs > 1) else {
            (0..jobs).for_each(job);
            return;
        };
        // SAFETY: only the lifetime is erased; the task leaves the board before this returns,
        // and no helper calls it after that (see `Task::run`).
        let run: JobFn = unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(job)
        };
        let wake = {
            let mut board = self.shared.board.lock();
            board.seats[index].task = Some(Task {
                run,
                next: 1,
                jobs,
                helping: 0,
            });
            self.helpers_to_wake(board.idle, jobs)
        };
        for _ in 0..wake {
            self.shared.wake.notify_one();
        }
        job(0);
        loop {
            let next = next_for_reader(&mut self.shared.board.lock(), index);
            match next {
                Next::Job(j) => job(j),
                Next::Done => return,
                Next::Wait => {
                    // A helper is in the middle of a job: computation, microseconds.
                    let running = &self.shared.running[index];
                    let mut spins = 0;
                    while running.load(Ordering::Acquire) > 0 && spins < WAIT_SPINS {
                        std::hint::spin_loop();
                        spins += 1;
                    }
                    if running.load(Ordering::Acquire) > 0 {
                        std::thread::park_timeout(WAIT_BOUND);
                    }
                }
            }
        }
    }
}

/// A raw pointer handed to jobs that each touch a part no other job touches.
struct Parts<T>(*mut T);

impl<T> Clone for Parts<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Parts<T> {}

// SAFETY: jobs use disjoint parts only (each caller below says why).
unsafe impl<T: Send> Sync for Parts<T> {}
unsafe impl<T: Send> Send for Parts<T> {}

impl<T> Parts<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Runs `f(first, chunk)` on consecutive chunks of `items` of [`JOB_PACKETS`] each, as jobs
/// of `seat`; `first` is the chunk's index in `items`.
pub fn for_each_chunk<T: Send>(seat: &Seat, items: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    let len = items.len();
    let base = Parts(items.as_mut_ptr());
    seat.run(len.div_ceil(JOB_PACKETS), &|j| {
        let start = j * JOB_PACKETS;
        let end = (start + JOB_PACKETS).min(len);
        // SAFETY: the seat runs each job number once, and job numbers map to disjoint
        // in-bounds ranges of `items`, which is borrowed mutably for the whole call.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(start, chunk);
    });
}

/// One data message of a read to seal: where its datagram lies in the send buffer (header,
/// plaintext, tag: `plaintext + wg::OVERHEAD` bytes) and its number in the [`SealBatch`].
#[derive(Debug, Clone)]
pub struct Sealing {
    pub at: Range<usize>,
    pub message: usize,
}

/// Makes (with `make(message, plaintext_area)`, which returns the plaintext's length) and seals
/// each of `sealings` in place in `buffer`, spread over `seat`'s crew.
///
/// # Panics
/// If a datagram's range is out of `buffer`, if the ranges overlap or are not in increasing
/// order, or if `make` makes a plaintext of another length than its range was reserved for.
pub fn seal_all(
    seat: &Seat,
    batch: &SealBatch,
    buffer: &mut [u8],
    sealings: &mut [Sealing],
    make: impl Fn(usize, &mut [u8]) -> usize + Sync,
) {
    check_increasing(buffer.len(), sealings.iter().map(|s| &s.at));
    let bytes = Parts(buffer.as_mut_ptr());
    for_each_chunk(seat, sealings, |_, chunk| {
        for s in chunk {
            // SAFETY: the ranges are in bounds and disjoint (checked above), and each sealing
            // is in one chunk only.
            let datagram =
                unsafe { std::slice::from_raw_parts_mut(bytes.get().add(s.at.start), s.at.len()) };
            let len = make(s.message, &mut datagram[wg::DATA_OFFSET..]);
            assert_eq!(
                len + wg::OVERHEAD,
                datagram.len(),
                "segment {} made to another length than reserved",
                s.message
            );
            batch.seal_in_place(s.message, datagram, len);
        }
    });
}

/// One received datagram of a read to open in place, with the session found for it under the
/// peer's lock; `outcome` is set by [`open_all`]. `tag` is the caller's (who sent it).
#[derive(Debug)]
pub struct Opening<T> {
    pub at: Range<usize>,
    pub key: Option<OpenKey>,
    pub outcome: Option<Result<Opened, TunnelError>>,
    pub tag: T,
}

/// Opens each of `openings` that has a key where it lies in `buffer` (the plaintext is then at
/// `buffer[at.start + wg::DATA_OFFSET..][..opened.len]`), spread over `seat`'s crew.
///
/// # Panics
/// If a datagram's range is out of `buffer`, or the ranges overlap or are not in increasing
/// order.
pub fn open_all<T: Send>(seat: &Seat, buffer: &mut [u8], openings: &mut [Opening<T>]) {
    check_increasing(buffer.len(), openings.iter().map(|o| &o.at));
    let bytes = Parts(buffer.as_mut_ptr());
    for_each_chunk(seat, openings, |_, chunk| {
        for o in chunk {
            let Some(key) = &o.key else { continue };
            // SAFETY: as in `seal_all`.
            let datagram =
                unsafe { std::slice::from_raw_parts_mut(bytes.get().add(o.at.start), o.at.len()) };
            o.outcome = Some(key.open_in_place(datagram));
        }
    });
}

fn check_increasing<'a>(len: usize, ranges: impl Iterator<Item = &'a Range<usize>>) {
    let mut end = 0;
    for r in ranges {
        assert!(
            r.start >= end && r.start <= r.end && r.end <= len,
            "datagram {r:?} overlaps the one before ({end}) or leaves the buffer ({len})"
        );
        end = r.end;
    }
}

#[cfg(test)]
mod tests;
