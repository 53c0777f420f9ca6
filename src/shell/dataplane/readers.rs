//! The packet readers' scheduling priority as it runs: each reader's guard (`core::priority`)
//! fed with its CPU clock, the switches it asks for carried out on the thread itself, and what
//! status and metrics show of it (each reader's class now, its CPU time at real-time priority,
//! its step-downs, the first refusal and why).

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

/// Every reader's state: slot `2 i` is worker `i`'s TUN reader, `2 i + 1` its UDP reader.
#[derive(Debug)]
pub(super) struct ReaderStates {
    slots: Vec<ReaderState>,
    /// Why real-time priority was refused, the first time it was.
    refused: Mutex<Option<String>>,
}

/// A copy of what the readers show.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadersView {
    /// Readers running now.
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
    pub(super) fn new(workers: usize) -> ReaderStates {
        ReaderStates {
            slots: (0..workers * 2).map(|_| ReaderState::default()).collect(),
            refused: Mutex::new(None),
        }
    }

    fn slot(&self, thread: PacketThread) -> Option<&ReaderState> {
        let index = match thread {
            PacketThread::TunReader(i) => 2 * i,
            PacketThread::UdpReader(i) => 2 * i + 1,
            PacketThread::Timers | PacketThread::Handshakes(_) => return None,
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

/// A packet reader's scheduling priority: real-time while it stays within its budget of CPU
/// time and keeps batching, normal otherwise (`core::priority`). The loop tells it what it
/// handled ([`ThreadPriority::handled`], [`ThreadPriority::unauthenticated`]) and when its
/// queue drained or is still busy. Switches only when the guard says so; reads the thread's CPU
/// clock once per call, and only at real-time priority.
pub(super) struct ThreadPriority<'a> {
    guard: PriorityGuard,
    realtime_priority: i32,
    inner: &'a Inner,
    thread: PacketThread,
    /// Packets handled, and of them not authenticated, since the guard last heard.
    packets: u64,
    unauthenticated: u64,
    /// Nanoseconds the reader lent its priority to relay partners it waited for
    /// (`relay::Relay::lent`): CPU time at its priority, counted as its own.
    lent: Option<&'a AtomicU64>,
}

impl<'a> ThreadPriority<'a> {
    pub(super) fn new(inner: &'a Inner, thread: PacketThread) -> ThreadPriority<'a> {
        let tuning = &inner.threads.tuning;
        let allowed = inner.threads.access.allows_realtime();
        let realtime_priority = tuning.rt_priority.filter(|_| allowed);
        ThreadPriority {
            guard: PriorityGuard::new(realtime_priority.is_some(), tuning.rt_budget),
            realtime_priority: realtime_priority.unwrap_or(0),
            inner,
            thread,
            packets: 0,
            unauthenticated: 0,
            lent: None,
        }
    }

    /// The reader also pays for the time it lends its priority to its relay partners
    /// (`relay::Relay::lent`): a partner it waits for runs at its priority meanwhile.
    pub(super) fn lending(mut self, lent: Option<&'a AtomicU64>) -> ThreadPriority<'a> {
        self.lent = lent;
        self
    }

    /// The CPU time the guard charges: the thread's own, and the time it lent.
    fn cpu_clock(&self) -> std::time::Duration {
        let lent = self.lent.map_or(0, |l| l.load(Ordering::Relaxed));
        clock::thread_cpu() + std::time::Duration::from_nanos(lent)
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
            cpu: self.guard.wants_cpu_clock().then(|| self.cpu_clock()),
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
        let Some(state) = self.inner.readers.slot(self.thread) else {
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
                        self.guard.realtime_from(self.cpu_clock());
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
