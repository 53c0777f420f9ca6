//! The packet readers' scheduling priority as it runs: each reader's (and each relay partner's)
//! guard (`core::priority`) fed with its CPU clock, the switches it asks for carried out on the
//! thread itself, and what status and metrics show of it (each thread's class now, its CPU time
//! at real-time priority, its step-downs, the first refusal and why).

use super::Inner;
use crate::core::liveness::PacketThread;
use crate::core::priority::{self, Priority, PriorityGuard, StepDown, Switch, Work};
use crate::shell::{clock, priority as apply};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// What one reader shows: written by the reader (on a switch, and once per batch at real-time
/// priority), read by status and metrics.
#[derive(Debug, Default)]
pub(super) struct ReaderState {
    realtime: AtomicBool,
    realtime_cpu_ns: AtomicU64,
    unauthenticated_cpu_ns: AtomicU64,
    step_downs: [AtomicU64; StepDown::ALL.len()],
}

/// Every reader's state: slot `2 i` is worker `i`'s TUN reader, `2 i + 1` its UDP reader; after
/// them, each reader's relay partners in the same order.
#[derive(Debug)]
pub(super) struct ReaderStates {
    slots: Vec<ReaderState>,
    /// Relay partners per reader.
    partners: usize,
    /// Why real-time priority was refused, the first time it was.
    refused: Mutex<Option<String>>,
}

/// A copy of what the readers show.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadersView {
    /// Readers running now, with their relay partners (which run under the same guard).
    pub count: u32,
    /// Of them, at real-time priority now.
    pub realtime: u32,
    /// CPU time all readers spent at real-time priority, in nanoseconds.
    pub realtime_cpu_ns: u64,
    /// Of it, on work that did not authenticate.
    pub unauthenticated_cpu_ns: u64,
    /// Step-downs from real-time priority, by reason ([`StepDown::ALL`] order).
    pub step_downs: [u64; StepDown::ALL.len()],
    /// Why real-time priority was refused, if it was.
    pub refused: Option<String>,
}

impl ReaderStates {
    /// The states of `workers` workers' readers with `partners` relay partners each.
    pub(super) fn new(workers: usize, partners: usize) -> ReaderStates {
        ReaderStates {
            slots: (0..workers * 2 * (1 + partners))
                .map(|_| ReaderState::default())
                .collect(),
            partners,
            refused: Mutex::new(None),
        }
    }

    fn reader_index(thread: PacketThread) -> Option<usize> {
        match thread {
            PacketThread::TunReader(i) => Some(2 * i),
            PacketThread::UdpReader(i) => Some(2 * i + 1),
            PacketThread::Timers => None,
        }
    }

    /// The state of `who` (none for the timer thread, or beyond the threads counted at start).
    fn slot(&self, who: Guarded) -> Option<&ReaderState> {
        let readers = self.slots.len() / (1 + self.partners);
        let (thread, partner) = match who {
            Guarded::Reader(thread) => (thread, None),
            Guarded::Partner(thread, me) => (thread, Some(me)),
        };
        let reader = Self::reader_index(thread).filter(|&i| i < readers)?;
        let index = match partner {
            None => reader,
            Some(me) if me < self.partners => readers + reader * self.partners + me,
            Some(_) => return None,
        };
        self.slots.get(index)
    }

    pub(super) fn view(&self) -> ReadersView {
        let mut view = ReadersView {
            count: u32::try_from(self.slots.len()).unwrap_or(u32::MAX),
            refused: self.refused.lock().clone(),
            ..ReadersView::default()
        };
        for slot in &self.slots {
            view.realtime += u32::from(slot.realtime.load(Ordering::Relaxed));
            view.realtime_cpu_ns += slot.realtime_cpu_ns.load(Ordering::Relaxed);
            view.unauthenticated_cpu_ns += slot.unauthenticated_cpu_ns.load(Ordering::Relaxed);
            for (sum, n) in view.step_downs.iter_mut().zip(&slot.step_downs) {
                *sum += n.load(Ordering::Relaxed);
            }
        }
        view
    }
}

/// A thread under a priority guard: a packet reader, or relay partner `me` of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Guarded {
    Reader(PacketThread),
    Partner(PacketThread, usize),
}

/// A packet reader's (or relay partner's) scheduling priority: real-time while it stays within
/// its budget of CPU time and keeps batching, normal otherwise (`core::priority`). The loop
/// tells it what it handled ([`ThreadPriority::handled`], [`ThreadPriority::unauthenticated`])
/// and when its queue drained or is still busy. Switches only when the guard says so; reads the
/// thread's CPU clock once per call, and only at real-time priority.
///
/// A partner runs at its reader's priority and pays from the same process budget: once it has
/// started a read, the reader's next emission waits for that read's turn, and a partner at
/// normal priority kept off a CPU by the application for a time slice made the real-time
/// reader's packets wait as long (loaded ping p99 2.72 ms on the 2-vCPU VM; at real-time 0.64).
pub(super) struct ThreadPriority<'a> {
    guard: PriorityGuard,
    realtime_priority: i32,
    inner: &'a Inner,
    who: Guarded,
    /// Packets handled, and of them not authenticated, since the guard last heard.
    packets: u64,
    unauthenticated: u64,
}

impl<'a> ThreadPriority<'a> {
    pub(super) fn new(inner: &'a Inner, who: Guarded) -> ThreadPriority<'a> {
        let tuning = &inner.threads.tuning;
        let allowed = inner.threads.access.allows_realtime();
        let realtime_priority = tuning.rt_priority.filter(|_| allowed);
        let budget = tuning.rt_budget.shared_by(1 + inner.readers.partners);
        ThreadPriority {
            guard: PriorityGuard::new(realtime_priority.is_some(), budget),
            realtime_priority: realtime_priority.unwrap_or(0),
            inner,
            who,
            packets: 0,
            unauthenticated: 0,
        }
    }

    /// The thread handled `packets` (datagrams, or segments read from the TUN device).
    #[inline]
    pub(super) fn handled(&mut self, packets: u64) {
        self.packets += packets;
    }

    /// Of what it handled, `packets` did not authenticate (dropped before or in decryption,
    /// answered with a cookie, read from the TUN device for nowhere).
    #[inline]
    pub(super) fn unauthenticated(&mut self, packets: u64) {
        self.unauthenticated += packets;
    }

    /// What the thread did since the guard last heard, with its CPU clock where it is needed.
    fn work(&mut self) -> Work {
        Work {
            cpu: self.guard.wants_cpu_clock().then(clock::thread_cpu),
            packets: std::mem::take(&mut self.packets),
            unauthenticated: std::mem::take(&mut self.unauthenticated),
        }
    }

    /// The queue is empty: the thread is about to block.
    #[inline]
    pub(super) fn drained(&mut self, now: Instant) {
        let work = self.work();
        let switch = self
            .guard
            .on_drained(now, work, &self.inner.realtime_budget);
        self.after(switch);
    }

    /// The thread took work and more is queued.
    #[inline]
    pub(super) fn busy(&mut self, now: Instant) {
        let work = self.work();
        let switch = self.guard.on_busy(now, work, &self.inner.realtime_budget);
        self.after(switch);
    }

    #[inline]
    fn after(&mut self, switch: Option<Switch>) {
        let Some(state) = self.inner.readers.slot(self.who) else {
            return;
        };
        if self.guard.current() == Priority::Realtime || switch.is_some() {
            let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            state
                .realtime_cpu_ns
                .store(ns(self.guard.realtime_cpu()), Ordering::Relaxed);
            state
                .unauthenticated_cpu_ns
                .store(ns(self.guard.unauthenticated_cpu()), Ordering::Relaxed);
        }
        match switch {
            None => {}
            Some(Switch::Up) => {
                match apply::set_current_thread(Priority::Realtime, self.realtime_priority) {
                    Ok(()) => {
                        self.guard.realtime_from(clock::thread_cpu());
                        state.realtime.store(true, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.guard.on_refused();
                        self.refused(&e);
                    }
                }
            }
            Some(Switch::Down(why)) => {
                // Back to normal priority needs no privilege.
                let _ = apply::set_current_thread(Priority::Normal, 0);
                state.realtime.store(false, Ordering::Relaxed);
                if let Some(i) = StepDown::ALL.iter().position(|w| *w == why) {
                    state.step_downs[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Records and logs (once per process) why real-time priority was refused.
    fn refused(&self, error: &std::io::Error) {
        let why = priority::access::refused(&self.inner.threads.access, &error.to_string());
        let first = {
            let mut refused = self.inner.readers.refused.lock();
            let first = refused.is_none();
            if first {
                *refused = Some(why.clone());
            }
            first
        };
        if first {
            tracing::warn!(
                reason = %why,
                "Packet readers stay at normal priority: under load, packets then wait for a CPU behind other work"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every reader and every partner of each has a state of its own, counted by the view;
    /// the timer thread and a partner beyond those counted at start have none.
    #[test]
    fn each_reader_and_each_of_its_partners_has_its_own_state() {
        let (workers, partners) = (3, 2);
        let states = ReaderStates::new(workers, partners);
        let mut threads = Vec::new();
        for w in 0..workers {
            for reader in [PacketThread::TunReader(w), PacketThread::UdpReader(w)] {
                threads.push(Guarded::Reader(reader));
                threads.extend((0..partners).map(|me| Guarded::Partner(reader, me)));
            }
        }
        let slots: Vec<*const ReaderState> = threads
            .iter()
            .map(|&who| std::ptr::from_ref(states.slot(who).expect("a state")))
            .collect();
        let distinct: std::collections::BTreeSet<_> = slots.iter().collect();
        assert_eq!(distinct.len(), workers * 2 * (1 + partners));
        assert!(states.slot(Guarded::Reader(PacketThread::Timers)).is_none());
        let beyond = Guarded::Partner(PacketThread::UdpReader(0), partners);
        assert!(states.slot(beyond).is_none());
        assert!(states
            .slot(Guarded::Reader(PacketThread::TunReader(workers)))
            .is_none());

        // What one partner shows is in the view, beside what its reader shows.
        let partner = Guarded::Partner(PacketThread::UdpReader(2), 1);
        let state = states.slot(partner).expect("a state");
        state.realtime.store(true, Ordering::Relaxed);
        state.realtime_cpu_ns.store(7, Ordering::Relaxed);
        let view = states.view();
        assert_eq!(view.count, 18);
        assert_eq!((view.realtime, view.realtime_cpu_ns), (1, 7));
    }

    /// Without partners, the readers alone (as before the relay).
    #[test]
    fn without_partners_the_view_counts_the_readers() {
        let states = ReaderStates::new(2, 0);
        assert_eq!(states.view().count, 4);
        assert!(states
            .slot(Guarded::Partner(PacketThread::TunReader(0), 0))
            .is_none());
    }
}
