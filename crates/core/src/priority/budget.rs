//! How much CPU time the packet readers may spend at real-time priority: a token bucket per
//! reader and one shared by every reader of the process, both counted in CPU time (each
//! reader's own `CLOCK_THREAD_CPUTIME_ID`, read by the shell once per batch) against wall time.
//! Pure: times are arguments.
//!
//! The bound they give, over any interval of length `T`: one reader runs at real-time for at
//! most `share * T + burst` of CPU time, of which at most `unauthenticated * T + burst` on
//! datagrams that do not authenticate (anyone on the network can send those); all readers
//! together for at most `rate * T + burst * cpus` (the rate is the share of the CPUs the process
//! may use, or of its cgroup's CPU quota when that is lower); plus one batch each: the charge
//! comes after the batch it pays for. A receive batch is 64 messages of up to 64 datagrams each
//! with UDP GRO (4,096 datagrams, milliseconds of opening, not a fraction of one). A reader past its budget runs on at normal priority, where
//! the scheduler treats it like any other thread.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The readers' real-time budget, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Percent of wall time one reader may spend on a CPU at real-time priority.
    pub share_percent: u32,
    /// Of it, the percent it may spend on work that does not authenticate: datagrams of
    /// unknown senders or that fail decryption, cookie replies, and reads of the TUN device
    /// that go nowhere.
    pub unauthenticated_percent: u32,
    /// CPU time a reader may spend at real-time in one go beyond its share: the bucket's depth,
    /// and so the longest a normal-priority thread on its CPU waits for it.
    pub burst: Duration,
}

/// The default share: 90 % of any stretch of time (the kernel's own limit for all real-time
/// threads together is 95 %). Measured: a reader that carries one saturating TCP stream on
/// this project's VM uses 55-65 % of a CPU on average, in bursts; at a 50 % share its p99 under
/// load was 7-8 ms, at 75 % 3-4 ms, at 90 % under 1 ms (docs/performance.md).
pub const DEFAULT_SHARE_PERCENT: u32 = 90;

/// The default share for work that does not authenticate: anyone on the network can make a
/// reader do it (a flood of initiations with a valid mac1, of unknown session indices, of
/// cookie replies), so real-time priority for it is held to a quarter of the time, and a
/// normal-priority thread on the reader's CPU keeps at least three quarters from it.
pub const DEFAULT_UNAUTHENTICATED_PERCENT: u32 = 25;

/// The default burst: what the kernel lets softirq run before it hands network work to a
/// normal-priority thread is 2 ms; a few of those.
pub const DEFAULT_BURST: Duration = Duration::from_millis(10);

impl Default for Budget {
    fn default() -> Budget {
        Budget {
            share_percent: DEFAULT_SHARE_PERCENT,
            unauthenticated_percent: DEFAULT_UNAUTHENTICATED_PERCENT,
            burst: DEFAULT_BURST,
        }
    }
}

impl Budget {
    /// The CPU time all readers of a process may spend at real-time, in thousandths of a CPU:
    /// the share of `cpus` thousandths of a CPU (the CPUs the process may use, or its cgroup's
    /// quota when that is lower).
    pub fn process_rate(self, cpus_milli: u64) -> u64 {
        cpus_milli.saturating_mul(u64::from(self.share_percent)) / 100
    }
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// One reader's bucket: tokens are nanoseconds of CPU time at real-time priority, added at
/// `percent` of the wall time that passes, at most `burst` of them.
#[derive(Debug, Clone)]
pub struct Bucket {
    tokens: i64,
    depth: i64,
    share_percent: i64,
    refilled: Option<Instant>,
}

impl Bucket {
    /// A full bucket that earns `percent` of wall time, at most `burst` of it.
    pub fn new(percent: u32, burst: Duration) -> Bucket {
        let depth = nanos(burst);
        Bucket {
            tokens: depth,
            depth,
            share_percent: i64::from(percent.min(100)),
            refilled: None,
        }
    }

    /// Adds what the wall time since the last refill earned.
    pub fn refill(&mut self, now: Instant) {
        let since = self
            .refilled
            .replace(now)
            .map_or(Duration::ZERO, |last| now.saturating_duration_since(last));
        let earned = nanos(since).saturating_mul(self.share_percent) / 100;
        self.tokens = self.tokens.saturating_add(earned).min(self.depth);
    }

    /// Takes `cpu` of CPU time spent at real-time priority.
    pub fn charge(&mut self, cpu: Duration) {
        self.tokens = self.tokens.saturating_sub(nanos(cpu));
    }

    /// Whether the reader has spent its budget.
    pub fn spent(&self) -> bool {
        self.tokens <= 0
    }

    /// Whether the bucket holds at least half its depth again: the reader may go back up.
    pub fn recovered(&self) -> bool {
        self.tokens >= self.depth / 2
    }
}

/// The bucket every reader of a process shares, safe to charge from any thread: two atomics,
/// touched once per batch at real-time priority.
#[derive(Debug)]
pub struct SharedBudget {
    /// Nanoseconds of CPU time at real-time priority still allowed.
    tokens: AtomicI64,
    /// Nanoseconds since `epoch` of the last refill.
    refilled_ns: AtomicU64,
    epoch: Instant,
    depth: i64,
    /// Thousandths of a CPU earned per unit of wall time.
    rate_milli: i64,
}

impl SharedBudget {
    /// A full shared bucket for readers that may spend `budget` each, in a process that may use
    /// `cpus_milli` thousandths of a CPU (see [`Budget::process_rate`]). `epoch`: any instant
    /// before the first call.
    pub fn new(budget: Budget, cpus_milli: u64, epoch: Instant) -> SharedBudget {
        let rate_milli = i64::try_from(budget.process_rate(cpus_milli)).unwrap_or(i64::MAX);
        // One burst per CPU the process may use (at least one).
        let cpus = i64::try_from(cpus_milli.div_ceil(1000).max(1)).unwrap_or(i64::MAX);
        let depth = nanos(budget.burst).saturating_mul(cpus);
        SharedBudget {
            tokens: AtomicI64::new(depth),
            refilled_ns: AtomicU64::new(0),
            epoch,
            depth,
            rate_milli,
        }
    }

    /// Adds what the wall time since the last refill earned. Whichever thread moves the refill
    /// time forward adds the tokens for that stretch, so no stretch is counted twice.
    pub fn refill(&self, now: Instant) {
        let now_ns =
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        let last = self.refilled_ns.load(Ordering::Relaxed);
        if now_ns <= last
            || self
                .refilled_ns
                .compare_exchange(last, now_ns, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return; // no time passed, or another thread refilled this stretch
        }
        let since = i64::try_from(now_ns - last).unwrap_or(i64::MAX);
        let earned = since.saturating_mul(self.rate_milli) / 1000;
        let depth = self.depth;
        let _ = self
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |t| {
                Some(t.saturating_add(earned).min(depth))
            });
    }

    /// Takes `cpu` of CPU time a reader spent at real-time priority.
    pub fn charge(&self, cpu: Duration) {
        self.tokens.fetch_sub(nanos(cpu), Ordering::AcqRel);
    }

    /// Whether the readers together have spent the process's budget.
    pub fn spent(&self) -> bool {
        self.tokens.load(Ordering::Acquire) <= 0
    }

    /// The process's rate, in thousandths of a CPU.
    pub fn rate_milli(&self) -> u64 {
        u64::try_from(self.rate_milli).unwrap_or(0)
    }
}
