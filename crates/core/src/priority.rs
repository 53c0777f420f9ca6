//! When a packet thread runs at real-time priority and when it steps down: the guard that lets
//! the data path preempt ordinary work the way the kernel's own network processing (softirq)
//! does, without ever letting a flood take a CPU from everything else. Pure: `now` is an
//! argument; the shell applies the priority the guard asks for.
//!
//! Why: on a busy host a packet thread at normal priority waits for a CPU behind whatever else
//! runs there (on the benchmark's two vCPUs, both iperf3 ends), and every packet queued behind
//! it waits too; that wait, not the tunnel's buffers, was most of the latency under load. At
//! `SCHED_FIFO` priority 1 a thread runs as soon as its queue has work, and blocks again as soon
//! as it is drained. The guard: a thread that has not drained its queue for [`BUSY_LIMIT`]
//! (a flood, or more traffic than the CPU can carry) steps down to normal priority for
//! [`COOL_DOWN`], so other work keeps at least COOL_DOWN / (BUSY_LIMIT + COOL_DOWN) of the CPU.
//!
//! The other way real-time priority goes wrong is ping-pong: a producer (an application writing
//! unsegmented UDP to the TUN device, a peer sending small datagrams) that is slower than the
//! thread wakes it for every packet, so each packet costs a wake-up, a poll and a send of its
//! own instead of sharing them with a batch (measured: 4x the CPU per byte, and the producer
//! and consumer starved). So a thread that drains its queue [`PING_PONG_DRAINS`] times within
//! [`PING_PONG_SPAN`] (over 10,000 wake-ups a second) having handled fewer than
//! [`PING_PONG_WORK`] packets per wake-up steps down too, for the same cool-down: at normal
//! priority the packets queue up and are taken in batches again. A bulk TCP stream (offload
//! super-packets of dozens of segments per read) and sparse traffic (a few wake-ups a
//! millisecond) keep real-time priority.

use std::time::{Duration, Instant};

/// The longest a packet thread runs at real-time priority without once draining its queue
/// (the kernel hands softirq work to a normal-priority thread after 2 ms; a few of those).
pub const BUSY_LIMIT: Duration = Duration::from_millis(10);

/// How long a thread that hit [`BUSY_LIMIT`] stays at normal priority before it may go back:
/// under a flood, other work keeps at least 10/11 of the CPU.
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

/// One packet thread's guard. Tell it when the thread drained its queue and when it is still
/// busy; it answers with the priority to switch to, if any.
#[derive(Debug, Clone)]
pub struct PriorityGuard {
    enabled: bool,
    current: Priority,
    /// When the thread last went from drained to busy (`None` while drained).
    busy_since: Option<Instant>,
    /// A thread stepped down stays down until then.
    down_until: Option<Instant>,
    /// The current ping-pong window: when it started, its drains and the packets handled.
    window_start: Option<Instant>,
    window_drains: u32,
    window_work: u64,
}

impl PriorityGuard {
    /// A thread starts at normal priority; with `enabled` false it never leaves it.
    pub fn new(enabled: bool) -> PriorityGuard {
        PriorityGuard {
            enabled,
            current: Priority::Normal,
            busy_since: None,
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

    /// The thread found its queue empty (it is about to block), having handled `work` packets
    /// since it last did. Returns `Realtime` when it should go (back) up, `Normal` when it is
    /// in a ping-pong with its producer and should step down.
    pub fn on_drained(&mut self, now: Instant, work: u64) -> Option<Priority> {
        self.busy_since = None;
        if self.ping_pong(now, work) && self.current == Priority::Realtime {
            return Some(self.step_down(now));
        }
        let cooled = self.down_until.is_none_or(|until| now >= until);
        if self.enabled && self.current == Priority::Normal && cooled {
            self.down_until = None;
            self.current = Priority::Realtime;
            return Some(Priority::Realtime);
        }
        None
    }

    /// The thread took work and more is queued. Returns `Normal` when it has been busy for
    /// [`BUSY_LIMIT`] at real-time priority and must step down.
    pub fn on_busy(&mut self, now: Instant) -> Option<Priority> {
        let since = *self.busy_since.get_or_insert(now);
        if self.current == Priority::Realtime && now.saturating_duration_since(since) >= BUSY_LIMIT
        {
            return Some(self.step_down(now));
        }
        None
    }

    fn step_down(&mut self, now: Instant) -> Priority {
        self.current = Priority::Normal;
        self.down_until = Some(now + COOL_DOWN);
        Priority::Normal
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
        self.current = match self.current {
            Priority::Realtime => Priority::Normal,
            Priority::Normal => Priority::Realtime,
        };
    }
}

#[cfg(test)]
mod tests;
