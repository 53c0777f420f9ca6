//! The relay: one packet reader hands whole reads to idle partner threads, goes on reading, and
//! every read leaves (its `sendmmsg`, its TUN writes) in the order it was read, whoever did it.
//!
//! Per reader: its partners' mailboxes (at most one job each), a free pool of job buffers (one
//! per partner: the bound on reads in flight), the turns (the next read to emit) and a stop
//! flag; per data plane, the count of busy packet threads ([`Cores`]): a read goes to a
//! partner only while a CPU is free for it. The reader [`Relay::claim`]s an idle partner (a
//! compare-and-swap on its idle flag; none idle, or no CPU free: the reader does the read
//! itself), swaps its read into the claimed job buffer (buffers move by swap: nothing is
//! allocated per read or per packet) and [`Claim::post`]s it, which gives the job the next
//! turn. Whoever finishes a read emits it while it holds that read's
//! [`Turn`]; the reader's own emissions (what it sealed or opened itself) take turns too, issued
//! with [`Relay::issue`] in read order. Turns are passed in the order they were issued.
//!
//! Waiting for a turn is not a lock in disguise. A turn is held by exactly one thread, for one
//! read's emission (the system calls the reader alone would have made for it, in the same
//! order); a thread holds one turn at a time and waits only for earlier ones, so the waits form
//! no cycle. What a waiter waits for is bounded: at most one read per partner is in flight, and
//! each is computation (sealing or opening one read) and its emission. A stop ends every wait,
//! the reader's on a partner's lock included (it blocks with a timeout and looks at the stop).
//! No mutex guard is alive across a system call: the mailboxes' and the pool's mutexes are held
//! to move one value, the turn's mutex only to sleep on its condition variable (the wait
//! releases it) or to wake the sleepers.
//!
//! Priority: partners run at normal priority, so on a machine with no free core they take no
//! CPU from the application. A real-time reader that would wait for a turn a partner holds
//! blocks instead on that partner's priority-inheriting lock (`shell::pi_lock`), held by the
//! partner for exactly the job it works on: the kernel runs the partner at the reader's
//! priority until it is done (a partner at normal priority kept off a CPU for a slice while
//! the reader waited cost the readers' latency: loaded ping p99 2.72 ms). That lock guards no
//! data and is held across the partner's sends; its only waiter is the reader, which would wait
//! for that job's turn anyway. The time the reader lends is paid from its real-time budget
//! ([`Relay::lent`]). Every wait for a turn the reader makes lends so, those of the jobs it
//! takes back included.
//!
//! Asleep when idle: a partner without a job, and a thread waiting for its turn, watch for a
//! bounded number of spin-loop hints (about the tail of one read: the model in benches/workers
//! measured the hand-off with it), then sleep on a condition variable, a waiter for its turn
//! re-checking every [`SLEEP_BOUND`] and an idle partner every 100 ms; a stop wakes both at
//! once.
//!
//! Liveness: partners stamp no heartbeat of their own. A wedged partner holds its turn, so its
//! reader's next emission waits for it, and the reader, which stamps its heartbeat per read,
//! shows as stalled within the stall limit once traffic comes; without traffic nothing waits
//! on the wedged partner. A partner whose work panics releases what its job held (its turn,
//! its lock, its CPU mark, its weight in flight: [`JobGuard`]) as it unwinds, so its reader
//! goes on; the data plane makes the panic its fatal error (the daemon's `/healthz` fails with
//! it and the daemon exits non-zero).

use crate::shell::clock;
use crate::shell::pi_lock::PiLock;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long (spin-loop hints) a thread watches for its turn, or a partner for a job, before it
/// sleeps: about the tail of one read of sealing (some tens of microseconds to a millisecond),
/// the figure the relay model in benches/workers measured 1.86x with.
const SPINS: u32 = 2_000;

/// How long (spin-loop hints) an idle partner watches its mailbox before it sleeps: short, as
/// a job that does not come soon is not coming from a busy reader, and the watching takes a
/// CPU others on the machine (the application, the other end) need.
const IDLE_SPINS: u32 = 200;

/// A sleeping waiter looks at the stop flag (and its turn, or its mailbox) again at least this
/// often, whatever wakes it.
pub const SLEEP_BOUND: Duration = Duration::from_millis(1);

/// How long a partner without a job sleeps at most before it looks again (a stop also wakes
/// it at once).
const IDLE_SLEEP: Duration = Duration::from_millis(100);

/// The work a partner does on a job, as the reader does it on a job its partner has not
/// started ([`Relay::issue_taking_back`]).
pub type TakeBack<'a, J> = &'a dyn Fn(&mut J, &mut Turn<'_, J>);

/// `working_on` of a partner without a job.
const NOT_WORKING: u64 = u64::MAX;

/// A job posted to a partner: the buffer the reader filled, its turn and its weight.
struct Posted<J> {
    job: J,
    turn: u64,
    weight: usize,
}

/// One partner's mailbox: at most one job, and whether the partner waits for one.
struct Mailbox<J> {
    job: Mutex<Option<Posted<J>>>,
    /// Whether `job` holds one: what a partner watches while it spins, so the watching writes
    /// nothing the reader's next post would wait on.
    full: AtomicBool,
    posted: Condvar,
    idle: AtomicBool,
    /// Held by the partner while it works on a job (turn `working_on`): a reader waiting for
    /// that turn blocks on it and lends the partner its real-time priority.
    working: PiLock,
    working_on: AtomicU64,
}

/// The order reads leave in: the next turn to issue (the reader's) and the next to emit.
struct Turns {
    issued: AtomicU64,
    next: AtomicU64,
    /// Threads asleep waiting for their turn, and where they sleep.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    passed: Condvar,
}

/// The CPUs the packet threads may use, and how many threads are busy on them now (readers
/// with work in hand, partners with a job), shared by every relay of a data plane. A read goes
/// to a partner only while a CPU is free for it: with every CPU taken by a busy reader, a
/// partner would only take a CPU from a reader and then hold its turn (on the 2-vCPU VM, two
/// busy readers each handing reads to a partner moved 0.22x of what they moved alone).
pub struct Cores {
    cpus: usize,
    busy: AtomicUsize,
}

impl Cores {
    pub fn new(cpus: usize) -> Cores {
        Cores {
            cpus,
            busy: AtomicUsize::new(0),
        }
    }

    fn has_free(&self) -> bool {
        self.busy.load(Ordering::Relaxed) < self.cpus
    }

    fn enter(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
    }

    fn leave(&self) {
        self.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A reader's mark among the busy threads of [`Cores`]: set while it has work in hand, cleared
/// before it blocks for more (and when dropped). Two atomic operations per change, none per
/// read while it stays busy.
pub struct Busy<'a> {
    cores: Option<&'a Cores>,
    busy: bool,
}

impl<'a> Busy<'a> {
    /// A mark on `cores` (none: a reader without partners, which counts nothing).
    pub fn new(cores: Option<&'a Cores>) -> Busy<'a> {
        Busy { cores, busy: false }
    }

    #[inline]
    pub fn set(&mut self, busy: bool) {
        if self.busy != busy {
            self.busy = busy;
            if let Some(cores) = self.cores {
                if busy {
                    cores.enter();
                } else {
                    cores.leave();
                }
            }
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// One reader's relay (see the module). `J` is the job buffer: what one read needs to travel
/// to a partner (the read itself, what the reader decided about it).
pub struct Relay<J> {
    mailboxes: Box<[Mailbox<J>]>,
    /// Job buffers no partner holds: as many as partners, made once.
    free: Mutex<Vec<J>>,
    turns: Turns,
    /// The weight of the jobs posted and not yet finished (the caller's unit: datagrams).
    in_flight: AtomicUsize,
    cores: Arc<Cores>,
    /// Jobs the reader took back from a partner that had not started them.
    taken_back: AtomicU64,
    /// Time the reader spent blocked on a partner's lock, lending it its priority.
    lent_ns: AtomicU64,
    /// A partner's lock failed the reader once: it no longer blocks on them.
    lending_failed: AtomicBool,
    stop: AtomicBool,
}

impl<J> Relay<J> {
    /// A relay with `partners` mailboxes and as many job buffers, each made by `job`, whose
    /// partners take a CPU of `cores` only while one is free.
    pub fn new(partners: usize, cores: Arc<Cores>, mut job: impl FnMut() -> J) -> Relay<J> {
        Relay {
            cores,
            mailboxes: (0..partners)
                .map(|_| Mailbox {
                    job: Mutex::new(None),
                    full: AtomicBool::new(false),
                    posted: Condvar::new(),
                    idle: AtomicBool::new(false),
                    working: PiLock::new(),
                    working_on: AtomicU64::new(NOT_WORKING),
                })
                .collect(),
            free: Mutex::new((0..partners).map(|_| job()).collect()),
            turns: Turns {
                issued: AtomicU64::new(0),
                next: AtomicU64::new(0),
                sleepers: AtomicUsize::new(0),
                lock: Mutex::new(()),
                passed: Condvar::new(),
            },
            in_flight: AtomicUsize::new(0),
            taken_back: AtomicU64::new(0),
            lent_ns: AtomicU64::new(0),
            lending_failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        }
    }

    pub fn partners(&self) -> usize {
        self.mailboxes.len()
    }

    /// The CPUs this relay's partners share with every other packet thread.
    pub fn cores(&self) -> &Cores {
        &self.cores
    }

    /// An idle partner and a free job buffer for the next read, or `None` when no partner is
    /// idle (the reader then does the read itself). Dropped without [`Claim::post`], the
    /// partner is idle again and the buffer free.
    pub fn claim(&self) -> Option<Claim<'_, J>> {
        if !self.cores.has_free() {
            return None;
        }
        let partner = self.mailboxes.iter().position(|m| {
            m.idle
                .compare_exchange(true, false, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        // A partner sets its flag only after giving its buffer back, and each busy partner
        // holds at most one: with this one idle, a buffer is free.
        let Some(job) = self.free.lock().pop() else {
            self.mailboxes[partner].idle.store(true, Ordering::Release);
            return None;
        };
        Some(Claim {
            relay: self,
            partner,
            job: Some(job),
        })
    }

    /// The next turn, for an emission of the reader's own (issued in read order, by the reader
    /// only). Hold it ([`Turn::hold`]) before emitting; dropping it passes it on (after
    /// waiting for it, if it was not held).
    pub fn issue(&self) -> Turn<'_, J> {
        Turn {
            relay: Some(self),
            number: self.turns.issued.fetch_add(1, Ordering::Relaxed),
            held: false,
            take_back: None,
            lends: false,
        }
    }

    /// The next turn, as [`Relay::issue`], whose wait does the work of a job posted before it
    /// that no partner has started: `work` is what a partner would do with it. A partner that
    /// was not given a CPU (every CPU taken by others on the machine: the application, the
    /// other end) then costs the reader a swap, not a wait for the scheduler.
    pub fn issue_taking_back<'a>(&'a self, work: TakeBack<'a, J>) -> Turn<'a, J> {
        Turn {
            relay: Some(self),
            number: self.turns.issued.fetch_add(1, Ordering::Relaxed),
            held: false,
            take_back: Some(work),
            lends: true,
        }
    }

    /// How many jobs the reader took back from partners that had not started them.
    pub fn taken_back(&self) -> u64 {
        self.taken_back.load(Ordering::Relaxed)
    }

    /// The time the reader has spent waiting on partners while lending them its priority: CPU
    /// time at that priority, on the partners' cores, that the reader's guard pays for.
    pub fn lent(&self) -> &AtomicU64 {
        &self.lent_ns
    }

    /// The weight of the jobs posted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Ends the partners' loops and every wait for a turn or a job.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for mailbox in self.mailboxes.iter() {
            // Under the mailbox's lock, so a partner between its check and its sleep cannot
            // miss the wake.
            drop(mailbox.job.lock());
            mailbox.posted.notify_all();
        }
        drop(self.turns.lock.lock());
        self.turns.passed.notify_all();
    }

    /// Partner `me`'s loop: waits for a job, runs `work` on it with its turn (the work holds
    /// the turn before it emits; the turn is passed after `work` returns), gives the buffer
    /// back, and waits again; returns once the relay stops. Each job runs under a
    /// [`JobGuard`], so however it ends (a panic in `work` included) its turn is passed and its
    /// lock, its CPU mark and its weight in flight are released. An error: its lock could not
    /// be taken (the relay is stopped, so its reader does not wait on this partner).
    pub fn serve(
        &self,
        me: usize,
        mut work: impl FnMut(&mut J, &mut Turn<'_, J>),
    ) -> std::io::Result<()> {
        let mailbox = &self.mailboxes[me];
        loop {
            mailbox.idle.store(true, Ordering::Release);
            let Some(Posted {
                mut job,
                turn,
                weight,
            }) = self.wait_for_job(mailbox)
            else {
                return Ok(());
            };
            if let Err(e) = mailbox.working.lock() {
                // Its job and its turn are never done: nothing after them may wait.
                self.stop();
                return Err(e);
            }
            mailbox.working_on.store(turn, Ordering::Release);
            self.cores.enter();
            let mut guard = JobGuard {
                relay: self,
                mailbox,
                weight,
                turn: Turn {
                    relay: Some(self),
                    number: turn,
                    held: false,
                    take_back: None,
                    lends: false,
                },
            };
            work(&mut job, &mut guard.turn);
            drop(guard);
            // Only a job that ended well goes back to the pool (a panic drops its buffer with
            // whatever it held; the partner is gone with it and is never claimed again).
            self.free.lock().push(job);
        }
    }

    /// The next job posted to `mailbox`, or `None` once the relay stops.
    fn wait_for_job(&self, mailbox: &Mailbox<J>) -> Option<Posted<J>> {
        let mut spins = 0u32;
        loop {
            if mailbox.full.load(Ordering::Acquire) {
                let job = {
                    let mut slot = mailbox.job.lock();
                    mailbox.full.store(false, Ordering::Relaxed);
                    slot.take()
                };
                if let Some(job) = job {
                    return Some(job);
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            if spins < IDLE_SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let mut slot = mailbox.job.lock();
            if slot.is_none() && !self.stop.load(Ordering::SeqCst) {
                // Releases the lock while asleep.
                mailbox.posted.wait_for(&mut slot, IDLE_SLEEP);
            }
        }
    }

    /// Waits until turn `number` is the next to emit, or the relay stops; with `take_back`,
    /// first does every earlier job no partner has started; with `lends` (the reader), blocks
    /// on the lock of the partner whose turn is next.
    fn wait_turn(&self, number: u64, take_back: Option<TakeBack<'_, J>>, lends: bool) {
        let turns = &self.turns;
        if let Some(work) = take_back {
            while turns.next.load(Ordering::Acquire) != number && self.take_back_one(number, work) {
            }
        }
        let mut spins = 0u32;
        while turns.next.load(Ordering::Acquire) != number {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            // The reader (the one waiter that takes back) waits for the partner whose turn is
            // next by blocking on that partner's lock: the partner runs at the reader's
            // priority until it is done, not after whatever the scheduler prefers (a partner at
            // normal priority kept off a CPU for a slice made the real-time reader's packets
            // wait as long). Only the reader: it posts nothing while it waits, so every job a
            // partner holds is one it must wait for anyway; a partner waiting so could block on
            // a later job of another partner that waits for its own turn.
            if lends && self.wait_for_next_partner() {
                continue;
            }
            // Asleep, so the thread whose turn it is gets the CPU.
            let mut guard = turns.lock.lock();
            turns.sleepers.fetch_add(1, Ordering::SeqCst);
            while turns.next.load(Ordering::SeqCst) != number && !self.stop.load(Ordering::SeqCst) {
                turns.passed.wait_for(&mut guard, SLEEP_BOUND);
            }
            turns.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Blocks until the partner working on the next turn is done, lending it the caller's
    /// priority, and counts the time as lent; false when no partner works on it (a job not
    /// started yet, or done meanwhile).
    fn wait_for_next_partner(&self) -> bool {
        let next = self.turns.next.load(Ordering::Acquire);
        let Some(partner) = self
            .mailboxes
            .iter()
            .find(|m| m.working_on.load(Ordering::Acquire) == next)
        else {
            return false;
        };
        if self.lending_failed.load(Ordering::Relaxed) {
            return false;
        }
        let from = clock::now();
        if let Err(e) = partner.working.wait_for_holder(&self.stop, SLEEP_BOUND) {
            // Said once; the reader then waits for its turns asleep, as a partner does.
            if !self.lending_failed.swap(true, Ordering::Relaxed) {
                tracing::error!(error = %e, "A packet reader cannot lend its priority to its relay partners");
            }
            return false;
        }
        let lent = clock::now().saturating_duration_since(from);
        self.lent_ns.fetch_add(
            u64::try_from(lent.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        true
    }

    /// Takes back the earliest job posted before turn `before` and not yet taken by its
    /// partner, and does it with `work` on its turn (as the partner would have); false when
    /// there is none. (A job posted after `before` waits for it: doing it now would wait for
    /// the turn the caller holds.)
    fn take_back_one(&self, before: u64, work: TakeBack<'_, J>) -> bool {
        // Only the reader posts and takes back, so the untaken jobs can only go (to their
        // partners) while this looks.
        let earliest = self
            .mailboxes
            .iter()
            .enumerate()
            .filter(|(_, m)| m.full.load(Ordering::Acquire))
            .filter_map(|(i, m)| m.job.lock().as_ref().map(|p| (p.turn, i)))
            .filter(|&(turn, _)| turn < before)
            .min();
        let Some((_, partner)) = earliest else {
            return false;
        };
        let mailbox = &self.mailboxes[partner];
        let taken = mailbox.job.lock().take();
        if taken.is_some() {
            // Only this thread posts, and it is here: nothing can fill the slot meanwhile.
            mailbox.full.store(false, Ordering::Relaxed);
        }
        // Its partner took it meanwhile: look again.
        let Some(Posted {
            mut job,
            turn,
            weight,
        }) = taken
        else {
            return true;
        };
        // The reader's: waiting for its turn, it lends its priority as on its own turns.
        let mut turn = Turn {
            relay: Some(self),
            number: turn,
            held: false,
            take_back: None,
            lends: true,
        };
        work(&mut job, &mut turn);
        self.in_flight.fetch_sub(weight, Ordering::AcqRel);
        drop(turn);
        self.taken_back.fetch_add(1, Ordering::Relaxed);
        self.free.lock().push(job);
        // The partner still waits for a job (it was claimed, and found none): idle again.
        mailbox.idle.store(true, Ordering::Release);
        true
    }

    /// Turn `number` is done: the next may emit.
    fn pass_turn(&self, number: u64) {
        let turns = &self.turns;
        turns.next.store(number + 1, Ordering::SeqCst);
        if turns.sleepers.load(Ordering::SeqCst) > 0 {
            drop(turns.lock.lock());
            turns.passed.notify_all();
        }
    }
}

/// A partner's job in progress, released when dropped, by its end or by a panic in the work:
/// the weight leaves the in-flight count before the turn is passed (whoever holds a later turn
/// sees the job finished), then the turn is passed (waiting for it first, if the work never
/// held it), then the lock the reader may be waiting on and the partner's CPU mark go.
struct JobGuard<'a, J> {
    relay: &'a Relay<J>,
    mailbox: &'a Mailbox<J>,
    weight: usize,
    turn: Turn<'a, J>,
}

impl<J> Drop for JobGuard<'_, J> {
    fn drop(&mut self) {
        self.relay
            .in_flight
            .fetch_sub(self.weight, Ordering::AcqRel);
        // Passed here (a later drop of the field would pass it after the lock's release).
        let turn = std::mem::replace(&mut self.turn, Turn::none());
        drop(turn);
        self.mailbox
            .working_on
            .store(NOT_WORKING, Ordering::Release);
        if let Err(e) = self.mailbox.working.unlock() {
            // Not a panic: this may run while a panic unwinds.
            tracing::error!(error = %e, "A relay partner could not release its lock");
        }
        self.relay.cores.leave();
    }
}

/// An idle partner claimed for the next read, with a free job buffer to fill.
pub struct Claim<'a, J> {
    relay: &'a Relay<J>,
    partner: usize,
    job: Option<J>,
}

impl<J> Claim<'_, J> {
    /// The job buffer, to swap the read into.
    pub fn job(&mut self) -> &mut J {
        self.job
            .as_mut()
            .expect("a claim holds its buffer until posted")
    }

    /// Hands the job to the claimed partner with the next turn (after every turn issued so
    /// far) and `weight` (see [`Relay::in_flight`]); wakes the partner.
    pub fn post(mut self, weight: usize) {
        let relay = self.relay;
        let job = self.job.take().expect("a claim is posted once");
        let turn = relay.turns.issued.fetch_add(1, Ordering::Relaxed);
        relay.in_flight.fetch_add(weight, Ordering::AcqRel);
        let mailbox = &relay.mailboxes[self.partner];
        *mailbox.job.lock() = Some(Posted { job, turn, weight });
        // After the job is in: a partner that sees the flag finds it (one that takes the job
        // before the flag is set finds the flag alone later, and an empty slot).
        mailbox.full.store(true, Ordering::Release);
        mailbox.posted.notify_one();
    }
}

impl<J> Drop for Claim<'_, J> {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            self.relay.free.lock().push(job);
            self.relay.mailboxes[self.partner]
                .idle
                .store(true, Ordering::Release);
        }
    }
}

/// One read's place in the order of emission. [`Turn::hold`] waits until every earlier read
/// was emitted; dropping the turn passes it to the next read (waiting for it first, if it was
/// never held, so no turn is skipped). A turn of no relay ([`Turn::none`]) orders nothing: the
/// reader of a worker without partners.
pub struct Turn<'a, J> {
    relay: Option<&'a Relay<J>>,
    number: u64,
    held: bool,
    /// The reader's: what to do with an earlier job no partner has started, rather than wait.
    take_back: Option<TakeBack<'a, J>>,
    /// The reader's (its own emissions' and the jobs it takes back): a wait for a partner's
    /// turn blocks on that partner's lock, lending it the reader's priority.
    lends: bool,
}

impl<'a, J> Turn<'a, J> {
    /// The turn of an emission when `relay` is `None` (no partners: nothing to wait for) or
    /// the next one it issues.
    pub fn of(relay: Option<&'a Relay<J>>) -> Turn<'a, J> {
        match relay {
            Some(relay) => relay.issue(),
            None => Turn::none(),
        }
    }

    /// As [`Turn::of`], a reader's turn that takes back what no partner started
    /// ([`Relay::issue_taking_back`]).
    pub fn of_taking_back(relay: Option<&'a Relay<J>>, work: TakeBack<'a, J>) -> Turn<'a, J> {
        match relay {
            Some(relay) => relay.issue_taking_back(work),
            None => Turn::none(),
        }
    }

    pub fn none() -> Turn<'a, J> {
        Turn {
            relay: None,
            number: 0,
            held: false,
            take_back: None,
            lends: false,
        }
    }

    /// Waits, if it has not yet, until this read may emit (or the relay stops).
    #[inline]
    pub fn hold(&mut self) {
        if !self.held {
            if let Some(relay) = self.relay {
                relay.wait_turn(self.number, self.take_back, self.lends);
            }
            self.held = true;
        }
    }

    pub fn number(&self) -> u64 {
        self.number
    }
}

impl<J> Drop for Turn<'_, J> {
    fn drop(&mut self) {
        self.hold();
        if let Some(relay) = self.relay {
            relay.pass_turn(self.number);
        }
    }
}

/// Stops a relay when dropped: its reader holds one, so however the reader ends (a stop, its
/// socket replaced, its device gone), its partners end with it.
pub struct Stopper<'a, J>(pub Option<&'a Relay<J>>);

impl<J> Drop for Stopper<'_, J> {
    fn drop(&mut self) {
        if let Some(relay) = self.0 {
            relay.stop();
        }
    }
}

#[cfg(test)]
mod tests;
