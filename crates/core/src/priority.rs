//! When a packet thread runs at real-time priority and when it steps down: the guard that lets
//! the data path preempt ordinary work the way the kernel's own network processing (softirq)
//! does, without ever letting a flood take a CPU from everything else. Pure: `now` and the
//! thread's CPU clock are arguments; the shell applies the priority the guard asks for.
//!
//! Why: on a busy host a packet thread at normal priority waits for a CPU behind whatever else
//! runs there (on the benchmark's two vCPUs, both iperf3 ends), and every packet queued behind
//! it waits too; that wait, not the tunnel's buffers, was most of the latency under load. At
//! `SCHED_FIFO` a thread runs as soon as its queue has work, and blocks again as soon as it is
//! drained.
//!
//! The bound is CPU time ([`budget`]): the thread reads its own CPU clock once per batch while
//! at real-time priority and pays for it from its buckets and the process's; when one is
//! empty it steps down to normal priority, and it goes back up once its buckets hold half their
//! burst again and the process's is not empty. The part of a batch's CPU time that went to
//! packets that did not authenticate (by count) also pays from a second, smaller bucket: a
//! peer is trusted to send packets, anyone else on the network is not, so a flood of
//! unauthenticated datagrams gets real-time priority for a quarter of the time at most, where a
//! peer's saturating stream keeps it. Counting drains (the first guard) did not bound it: a
//! flood of small batches drains every time and kept a reader at real-time priority most of the
//! time.
//!
//! The other way real-time priority goes wrong is ping-pong: a producer (an application writing
//! unsegmented UDP to the TUN device, a peer sending small datagrams) that is slower than the
//! thread wakes it for every packet, so each packet costs a wake-up, a poll and a send of its
//! own instead of sharing them with a batch (measured: 4x the CPU per byte, and the producer
//! and consumer starved). So a thread that drains its queue [`PING_PONG_DRAINS`] times within
//! [`PING_PONG_SPAN`] (over 10,000 wake-ups a second) having handled fewer than
//! [`PING_PONG_WORK`] packets per wake-up steps down for [`COOL_DOWN`]: at normal priority the
//! packets queue up and are taken in batches again. A bulk TCP stream (offload super-packets of
//! dozens of segments per read) and sparse traffic (a few wake-ups a millisecond) keep
//! real-time priority.

pub mod access;
pub mod budget;

pub use access::{Access, Facts};
pub use budget::{Bucket, Budget, SharedBudget};

use std::time::{Duration, Instant};

/// How long a thread in a ping-pong stays at normal priority before it may go back.
pub const COOL_DOWN: Duration = Duration::from_millis(100);

/// Ping-pong detection: this many drains ...
pub const PING_PONG_DRAINS: u32 = 64;
/// ... within this span (10,000 wake-ups a second) ...
pub const PING_PONG_SPAN: Duration = Duration::from_micros(6_400);
/// ... with fewer packets than this per wake-up, on average.
pub const PING_PONG_WORK: u64 = 4;

/// The scheduling class a packet thread should be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// `SCHED_FIFO` at the daemon's packet priority.
    Realtime,
    /// The ordinary time-shared class.
    Normal,
}

/// Why a thread stepped down from real-time priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDown {
    /// It spent its own budget (CPU time at real-time priority).
    Budget,
    /// It spent its budget for work that does not authenticate.
    Unauthenticated,
    /// The readers together spent the process's budget.
    ProcessBudget,
    /// It was woken for nearly every packet.
    PingPong,
}

impl StepDown {
    /// Every reason, in the order `/metrics` lists them.
    pub const ALL: [StepDown; 4] = [
        StepDown::Budget,
        StepDown::Unauthenticated,
        StepDown::ProcessBudget,
        StepDown::PingPong,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            StepDown::Budget => "budget",
            StepDown::Unauthenticated => "unauthenticated",
            StepDown::ProcessBudget => "process_budget",
            StepDown::PingPong => "ping_pong",
        }
    }
}

/// What a thread did since it last told its guard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Its CPU clock, needed at real-time priority (see [`PriorityGuard::wants_cpu_clock`]).
    pub cpu: Option<Duration>,
    /// Packets (datagrams, or segments read from the TUN device) it handled.
    pub packets: u64,
    /// Of them, those that did not authenticate: dropped before or in decryption, answered with
    /// a cookie, or read from the TUN device for nowhere.
    pub unauthenticated: u64,
}

/// What the guard asks of the thread after one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// Go (back) up to real-time priority; then tell the guard the CPU clock
    /// ([`PriorityGuard::realtime_from`]).
    Up,
    /// Step down to normal priority, for this reason.
    Down(StepDown),
}

/// One packet thread's guard. Tell it when the thread drained its queue and when it is still
/// busy, with its CPU clock while it is at real-time priority; it answers with the switch to
/// make, if any.
#[derive(Debug, Clone)]
pub struct PriorityGuard {
    enabled: bool,
    current: Priority,
    bucket: Bucket,
    /// The smaller bucket for work that does not authenticate.
    unauthenticated: Bucket,
    /// The thread's CPU clock when it was last charged (at real-time priority only).
    charged_to: Option<Duration>,
    /// CPU time spent at real-time priority, all told, and of it on unauthenticated work.
    realtime_cpu: Duration,
    unauthenticated_cpu: Duration,
    /// Packets handled since the queue was last drained (the ping-pong rule's measure).
    since_drain: u64,
    /// A thread stepped down for ping-pong stays down until then.
    down_until: Option<Instant>,
    /// The current ping-pong window: when it started, its drains and the packets handled.
    window_start: Option<Instant>,
    window_drains: u32,
    window_work: u64,
}

impl PriorityGuard {
    /// A thread starts at normal priority; with `enabled` false it never leaves it.
    pub fn new(enabled: bool, budget: Budget) -> PriorityGuard {
        PriorityGuard {
            enabled,
            current: Priority::Normal,
            bucket: Bucket::new(budget.share_percent, budget.burst),
            unauthenticated: Bucket::new(budget.unauthenticated_percent, budget.burst),
            charged_to: None,
            realtime_cpu: Duration::ZERO,
            unauthenticated_cpu: Duration::ZERO,
            since_drain: 0,
            down_until: None,
            window_start: None,
            window_drains: 0,
            window_work: 0,
        }
    }

    /// The priority the thread is in, as far as the guard knows.
    pub fn current(&self) -> Priority {
        self.current
    }

    /// Whether the next call needs the thread's CPU clock (it is at real-time priority).
    pub fn wants_cpu_clock(&self) -> bool {
        self.current == Priority::Realtime
    }

    /// CPU time the thread has spent at real-time priority.
    pub fn realtime_cpu(&self) -> Duration {
        self.realtime_cpu
    }

    /// Of it, the CPU time spent on work that did not authenticate.
    pub fn unauthenticated_cpu(&self) -> Duration {
        self.unauthenticated_cpu
    }

    /// The thread is now at real-time priority (after [`Switch::Up`]); its CPU clock reads
    /// `cpu`, from which its time there is charged.
    pub fn realtime_from(&mut self, cpu: Duration) {
        self.charged_to = Some(cpu);
    }

    /// The thread found its queue empty (it is about to block), having done `work` since it
    /// last told the guard.
    pub fn on_drained(
        &mut self,
        now: Instant,
        work: Work,
        process: &SharedBudget,
    ) -> Option<Switch> {
        self.account(now, work, process);
        let handled = std::mem::take(&mut self.since_drain);
        let ping_pong = self.ping_pong(now, handled);
        if self.current == Priority::Realtime {
            if ping_pong {
                self.down_until = Some(now + COOL_DOWN);
                return Some(self.step_down(StepDown::PingPong));
            }
            return self.over_budget(process).map(|why| self.step_down(why));
        }
        let cooled = self.down_until.is_none_or(|until| now >= until);
        let recovered = self.bucket.recovered() && self.unauthenticated.recovered();
        if self.enabled && cooled && recovered && !process.spent() {
            self.down_until = None;
            self.current = Priority::Realtime;
            return Some(Switch::Up);
        }
        None
    }

    /// The thread did `work` and more is queued.
    pub fn on_busy(&mut self, now: Instant, work: Work, process: &SharedBudget) -> Option<Switch> {
        self.account(now, work, process);
        if self.current != Priority::Realtime {
            return None;
        }
        self.over_budget(process).map(|why| self.step_down(why))
    }

    /// Refills the buckets and charges the CPU time since the last charge: all of it to the
    /// thread's and the process's buckets, the unauthenticated packets' part of it (by count)
    /// to the smaller one.
    fn account(&mut self, now: Instant, work: Work, process: &SharedBudget) {
        self.since_drain = self.since_drain.saturating_add(work.packets);
        self.bucket.refill(now);
        self.unauthenticated.refill(now);
        process.refill(now);
        if self.current != Priority::Realtime {
            return;
        }
        if let Some(cpu) = work.cpu {
            let spent = self
                .charged_to
                .map_or(Duration::ZERO, |from| cpu.saturating_sub(from));
            self.charged_to = Some(cpu);
            let unauthenticated = if work.packets == 0 {
                Duration::ZERO
            } else {
                let nanos = spent.as_nanos() * u128::from(work.unauthenticated.min(work.packets))
                    / u128::from(work.packets);
                Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
            };
            self.realtime_cpu += spent;
            self.unauthenticated_cpu += unauthenticated;
            self.bucket.charge(spent);
            self.unauthenticated.charge(unauthenticated);
            process.charge(spent);
        }
    }

    fn over_budget(&self, process: &SharedBudget) -> Option<StepDown> {
        if self.bucket.spent() {
            Some(StepDown::Budget)
        } else if self.unauthenticated.spent() {
            Some(StepDown::Unauthenticated)
        } else if process.spent() {
            Some(StepDown::ProcessBudget)
        } else {
            None
        }
    }

    fn step_down(&mut self, why: StepDown) -> Switch {
        self.current = Priority::Normal;
        self.charged_to = None;
        Switch::Down(why)
    }

    /// Counts one drain into the window; true when a full window was a ping-pong.
    fn ping_pong(&mut self, now: Instant, work: u64) -> bool {
        let start = *self.window_start.get_or_insert(now);
        self.window_drains += 1;
        self.window_work = self.window_work.saturating_add(work);
        if self.window_drains < PING_PONG_DRAINS {
            return false;
        }
        let fast = now.saturating_duration_since(start) < PING_PONG_SPAN;
        let small = self.window_work < PING_PONG_WORK * u64::from(PING_PONG_DRAINS);
        self.window_start = None;
        self.window_drains = 0;
        self.window_work = 0;
        fast && small
    }

    /// The system refused the switch the guard just asked for (no `CAP_SYS_NICE` or
    /// `RLIMIT_RTPRIO`, a container's or a unit's restriction): the thread stayed where it was,
    /// and the guard asks no more.
    pub fn on_refused(&mut self) {
        self.enabled = false;
        self.charged_to = None;
        self.current = match self.current {
            Priority::Realtime => Priority::Normal,
            Priority::Normal => Priority::Realtime,
        };
    }
}

#[cfg(test)]
mod tests;
