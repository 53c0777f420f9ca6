use super::*;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);
const US: Duration = Duration::from_micros(1);

/// A process budget that never binds (a thousand CPUs), for the single-thread tests.
fn roomy(epoch: Instant) -> SharedBudget {
    SharedBudget::new(Budget::default(), 1_000_000, epoch)
}

/// A simulated reader: its wall clock, its CPU clock and its guard.
struct Reader {
    guard: PriorityGuard,
    now: Instant,
    cpu: Duration,
}

impl Reader {
    fn new(t0: Instant) -> Reader {
        Reader {
            guard: PriorityGuard::new(true, Budget::default()),
            now: t0,
            cpu: Duration::ZERO,
        }
    }

    /// Applies a switch the way the shell does (tells the guard the CPU clock after going up).
    fn apply(&mut self, switch: Option<Switch>) -> Option<Switch> {
        if switch == Some(Switch::Up) {
            self.guard.realtime_from(self.cpu);
        }
        switch
    }

    /// `wall` passes, of which the thread ran `cpu` (at most `wall`) on `packets`, of which
    /// `unauthenticated` did not authenticate; the CPU clock is read as the shell reads it.
    fn work(&mut self, wall: Duration, cpu: Duration, packets: u64, unauthenticated: u64) -> Work {
        self.now += wall;
        self.cpu += cpu.min(wall);
        Work {
            cpu: self.guard.wants_cpu_clock().then_some(self.cpu),
            packets,
            unauthenticated,
        }
    }

    /// [`Reader::work`], then the queue is empty.
    fn drains_with(
        &mut self,
        wall: Duration,
        cpu: Duration,
        packets: u64,
        unauthenticated: u64,
        p: &SharedBudget,
    ) -> Option<Switch> {
        let work = self.work(wall, cpu, packets, unauthenticated);
        let s = self.guard.on_drained(self.now, work, p);
        self.apply(s)
    }

    /// [`Reader::work`] on authenticated packets, then the queue is empty.
    fn drains(
        &mut self,
        wall: Duration,
        cpu: Duration,
        packets: u64,
        p: &SharedBudget,
    ) -> Option<Switch> {
        self.drains_with(wall, cpu, packets, 0, p)
    }

    /// [`Reader::work`] on one authenticated packet, and more is queued.
    fn busy(&mut self, wall: Duration, cpu: Duration, p: &SharedBudget) -> Option<Switch> {
        let work = self.work(wall, cpu, 1, 0);
        let s = self.guard.on_busy(self.now, work, p);
        self.apply(s)
    }
}

#[test]
fn a_thread_goes_up_when_it_first_drains_and_stays_up_while_it_uses_less_than_its_share() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    let mut r = Reader::new(t0);
    assert_eq!(r.guard.current(), Priority::Normal);
    assert_eq!(r.drains(US, Duration::ZERO, 1, &process), Some(Switch::Up));
    // A stream that keeps it busy 40 % of the time, in bursts of 2 ms: no switch at all.
    for _ in 0..1_000 {
        assert_eq!(r.busy(MS, MS, &process), None);
        assert_eq!(r.drains(MS * 4, MS, 40, &process), None);
    }
    assert_eq!(r.guard.current(), Priority::Realtime);
    assert_eq!(r.guard.realtime_cpu(), MS * 2_000);
}

#[test]
fn a_thread_that_uses_more_than_its_share_steps_down_then_comes_back() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    let mut r = Reader::new(t0);
    r.drains(US, Duration::ZERO, 1, &process);
    // Busy all the time, checked every 100 us: each step costs 100 us and earns 90, so the burst
    // (10 ms) lasts about 100 ms; the first step earns nothing (the bucket starts full), so the
    // bucket is empty after 1 + 990 steps.
    let mut down_at = None;
    for k in 1..=2_000u32 {
        if let Some(s) = r.busy(US * 100, US * 100, &process) {
            assert_eq!(s, Switch::Down(StepDown::Budget));
            down_at = Some(k);
            break;
        }
    }
    assert_eq!(down_at, Some(991), "down after 99.1 ms of CPU");
    // It drains soon after, but its bucket holds less than half the burst: it stays down ...
    assert_eq!(r.drains(MS, MS, 10, &process), None);
    assert_eq!(r.guard.current(), Priority::Normal);
    // ... and goes up once half the burst has come back (5 ms at 90 % of the wall time).
    assert_eq!(
        r.drains(US * 5_600, Duration::ZERO, 10, &process),
        Some(Switch::Up)
    );
}

#[test]
fn a_flood_that_does_not_authenticate_gets_a_quarter_of_the_time_where_a_peer_keeps_its_stream() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    // Both readers busy 60 % of the time, in batches of 64 datagrams that drain every 1 ms.
    let mut peer = Reader::new(t0);
    let mut flood = Reader::new(t0);
    peer.drains(US, Duration::ZERO, 1, &process);
    flood.drains(US, Duration::ZERO, 1, &process);
    let mut flood_down = None;
    for k in 1..=1_000u32 {
        assert_eq!(peer.drains(MS, US * 600, 64, &process), None);
        let s = flood.drains_with(MS, US * 600, 64, 64, &process);
        if s.is_some() && flood_down.is_none() {
            flood_down = Some((k, s));
        }
    }
    // The peer's stream keeps real-time priority throughout.
    assert_eq!(peer.guard.current(), Priority::Realtime);
    assert_eq!(peer.guard.realtime_cpu(), US * 600 * 1_000);
    assert_eq!(peer.guard.unauthenticated_cpu(), Duration::ZERO);
    // The flood steps down once its 10 ms burst is spent, at 60 - 25 = 35 % of each ms (the
    // first millisecond earns nothing: the bucket starts full).
    assert_eq!(
        flood_down,
        Some((28, Some(Switch::Down(StepDown::Unauthenticated))))
    );
    // Over the second, at most a quarter of it (plus the burst) at real-time.
    let spent = flood.guard.realtime_cpu();
    assert!(spent <= MS * 250 + MS * 10, "{spent:?}");
    // A mixed batch pays by count: 16 of 64 datagrams unauthenticated is a quarter of its time.
    let mut mixed = Reader::new(t0);
    mixed.drains(US, Duration::ZERO, 1, &process);
    mixed.drains_with(MS, US * 400, 64, 16, &process);
    assert_eq!(mixed.guard.unauthenticated_cpu(), US * 100);
}

#[test]
fn the_process_budget_binds_readers_that_each_stay_within_their_own() {
    let t0 = crate::test_util::now();
    // One CPU to share, 90 % of it at real-time for all readers together.
    let process = SharedBudget::new(Budget::default(), 1000, t0);
    assert_eq!(process.rate_milli(), 900);
    let mut readers: Vec<Reader> = (0..4).map(|_| Reader::new(t0)).collect();
    for r in &mut readers {
        r.drains(US, Duration::ZERO, 1, &process);
    }
    // Each busy 40 % (within its own share), 160 % together: the process budget steps some down.
    let mut process_downs = 0;
    for _ in 0..200 {
        for r in &mut readers {
            if r.busy(MS, US * 400, &process) == Some(Switch::Down(StepDown::ProcessBudget)) {
                process_downs += 1;
            }
            if r.drains(Duration::ZERO, Duration::ZERO, 40, &process)
                == Some(Switch::Down(StepDown::ProcessBudget))
            {
                process_downs += 1;
            }
        }
    }
    assert!(process_downs > 0);
    let total: Duration = readers.iter().map(|r| r.guard.realtime_cpu()).sum();
    assert!(total <= MS * 200 * 9 / 10 + MS * 10 + MS * 4, "{total:?}");
}

#[test]
fn a_disabled_or_refused_guard_never_asks_for_realtime() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    let mut off = Reader::new(t0);
    off.guard = PriorityGuard::new(false, Budget::default());
    let mut refused = Reader::new(t0);
    assert_eq!(
        refused.guard.on_drained(t0, Work::default(), &process),
        Some(Switch::Up)
    );
    refused.guard.on_refused();
    for _ in 0..50 {
        for r in [&mut off, &mut refused] {
            assert_eq!(r.drains(COOL_DOWN, Duration::ZERO, 1, &process), None);
            assert_eq!(r.busy(MS * 50, MS * 50, &process), None);
            assert_eq!(r.guard.current(), Priority::Normal);
        }
    }
}

#[test]
fn a_thread_woken_for_every_packet_steps_down_and_batches_again() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    let mut r = Reader::new(t0);
    assert_eq!(
        r.drains(Duration::ZERO, Duration::ZERO, 0, &process),
        Some(Switch::Up)
    );
    // A UDP sender slower than the thread: a wake-up and one packet every 20 us.
    let step = US * 20;
    let mut switched = None;
    for k in 1..PING_PONG_DRAINS * 2 {
        if let Some(to) = r.drains(step, US * 5, 1, &process) {
            switched = Some((k, to));
        }
    }
    // The first window (the drain at t0 was its first) ends at drain 64: down, and down it stays.
    assert_eq!(
        switched,
        Some((PING_PONG_DRAINS - 1, Switch::Down(StepDown::PingPong)))
    );
    // Back up only after the cool-down.
    assert_eq!(r.drains(COOL_DOWN / 2, Duration::ZERO, 1, &process), None);
    assert_eq!(
        r.drains(COOL_DOWN / 2, Duration::ZERO, 50, &process),
        Some(Switch::Up)
    );
}

#[test]
fn bulk_reads_and_sparse_wake_ups_keep_realtime() {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    // A TCP stream: a wake-up every 20 us, each read a super-packet of 40 segments taking 8 us.
    let mut bulk = Reader::new(t0);
    bulk.drains(Duration::ZERO, Duration::ZERO, 0, &process);
    // Pings: one packet a wake-up, 1,000 wake-ups a second.
    let mut sparse = Reader::new(t0);
    sparse.drains(Duration::ZERO, Duration::ZERO, 0, &process);
    for _ in 1..10_000u32 {
        assert_eq!(bulk.drains(US * 20, US * 8, 40, &process), None);
        assert_eq!(sparse.drains(MS, US * 5, 1, &process), None);
    }
    assert_eq!(bulk.guard.current(), Priority::Realtime);
    assert_eq!(sparse.guard.current(), Priority::Realtime);
}

/// The longest one batch may run between two charges in the property tests: a receive batch
/// is 64 messages of up to 64 GRO segments each ([`MAX_BATCH_PACKETS`]), a few milliseconds
/// of opening; 20 ms leaves room over that (docs/security.md, the real-time bound).
const MAX_BATCH_US: u64 = 20_000;

/// The most packets one batch holds: 64 messages of up to 64 datagrams each with UDP GRO.
const MAX_BATCH_PACKETS: u64 = 64 * 64;

/// One step of a reader in the property tests: wall time passed, CPU time used in it (capped at
/// the wall time), drained or still busy, packets handled and how many of them did not
/// authenticate.
type Step = (u64, u64, bool, u64, u64);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        (
            0u64..MAX_BATCH_US,
            0u64..MAX_BATCH_US,
            any::<bool>(),
            0u64..=MAX_BATCH_PACKETS,
            0u64..=MAX_BATCH_PACKETS,
        ),
        1..600,
    )
}

/// Runs one step on `r`.
fn step(r: &mut Reader, event: Step, p: &SharedBudget) {
    let (wall_us, cpu_us, drained, packets, unauthenticated) = event;
    let work = r.work(
        US * wall_us as u32,
        US * cpu_us as u32,
        packets,
        unauthenticated,
    );
    let s = if drained {
        r.guard.on_drained(r.now, work, p)
    } else {
        r.guard.on_busy(r.now, work, p)
    };
    r.apply(s);
}

/// For every pair of charge points: the CPU time spent at real-time priority between them is at
/// most `rate_percent` of the wall time between them plus `slack`.
fn within_budget(
    timeline: &[(Instant, Duration)],
    rate_percent: u32,
    slack: Duration,
) -> Result<(), TestCaseError> {
    for (i, (from, rt_from)) in timeline.iter().enumerate() {
        for (to, rt_to) in &timeline[i..] {
            let spent = *rt_to - *rt_from;
            let allowed = to.saturating_duration_since(*from) * rate_percent / 100 + slack;
            prop_assert!(
                spent <= allowed,
                "{spent:?} at real-time in {:?}, allowed {allowed:?}",
                to.saturating_duration_since(*from)
            );
        }
    }
    Ok(())
}

/// The property of `realtime_cpu_never_exceeds_the_share_plus_one_burst_in_any_window` for one
/// sequence of steps.
fn one_reader_within_its_share(events: Vec<Step>) -> Result<(), TestCaseError> {
    let t0 = crate::test_util::now();
    let process = roomy(t0);
    let mut r = Reader::new(t0);
    // (when, real-time CPU so far) at every call: all of it, and the unauthenticated part.
    let mut all = vec![(t0, Duration::ZERO)];
    let mut unauthenticated = vec![(t0, Duration::ZERO)];
    // The charge comes after a batch: the bound is the share, one burst and one batch, the
    // largest of this sequence (not the largest any sequence may have: that would hide an
    // overrun of a sequence of short batches).
    let largest = events.iter().map(|e| e.1).max().unwrap_or(0);
    for event in events {
        step(&mut r, event, &process);
        all.push((r.now, r.guard.realtime_cpu()));
        unauthenticated.push((r.now, r.guard.unauthenticated_cpu()));
    }
    let budget = Budget::default();
    let slack = budget.burst + US * largest as u32;
    within_budget(&all, budget.share_percent, slack)?;
    within_budget(&unauthenticated, budget.unauthenticated_percent, slack)
}

/// The case proptest once shrank to (saved as a seed when a step was four numbers: a seed
/// replays nothing once the strategy changes, so the case is spelt out here): one drained step,
/// then a reader busy on every CPU microsecond of 26 steps with no packet. The fifth number
/// (unauthenticated packets), added since, is 0.
#[test]
fn the_saved_case_of_a_reader_busy_without_packets_stays_within_its_share() {
    let shrunk: [(u64, u64, bool, u64); 27] = [
        (0, 0, true, 0),
        (847, 847, false, 0),
        (1341, 1341, false, 0),
        (1307, 1307, false, 0),
        (1228, 1228, false, 0),
        (857, 857, false, 0),
        (811, 811, false, 0),
        (1562, 1562, false, 0),
        (1418, 1418, false, 0),
        (709, 709, false, 0),
        (954, 954, false, 0),
        (65, 65, false, 0),
        (973, 973, false, 0),
        (1112, 1112, false, 0),
        (330, 330, false, 0),
        (321, 321, false, 0),
        (979, 979, false, 0),
        (621, 621, false, 0),
        (1477, 1477, false, 0),
        (1234, 1234, false, 0),
        (840, 840, false, 0),
        (635, 635, false, 0),
        (1501, 1501, false, 0),
        (834, 834, false, 0),
        (61, 61, false, 0),
        (1117, 1117, false, 0),
        (867, 867, false, 0),
    ];
    let events = shrunk
        .iter()
        .map(|&(wall, cpu, drained, packets)| (wall, cpu, drained, packets, 0))
        .collect();
    if let Err(e) = one_reader_within_its_share(events) {
        panic!("{e}");
    }
}

proptest! {
    /// Whatever the arrival pattern (a flood of small batches that drain every time, a
    /// saturating stream, idle gaps, any mix of authenticated and unauthenticated packets), a
    /// reader's CPU time at real-time priority over any stretch never exceeds its share of that
    /// stretch plus its burst, and its time on unauthenticated packets never exceeds their
    /// share plus the burst, plus one batch each (the charge comes after the batch it pays for).
    #[test]
    fn realtime_cpu_never_exceeds_the_share_plus_one_burst_in_any_window(events in steps()) {
        one_reader_within_its_share(events)?;
    }

    /// Readers that share one process budget (a quota of one CPU) spend together, over any
    /// stretch, at most the process's rate of it plus its depth, plus one batch each.
    #[test]
    fn all_readers_together_stay_within_the_process_budget(
        a in steps(), b in steps(), c in steps(),
    ) {
        let t0 = crate::test_util::now();
        let budget = Budget::default();
        let process = SharedBudget::new(budget, 1000, t0);
        let mut readers = [Reader::new(t0), Reader::new(t0), Reader::new(t0)];
        let mut timeline = vec![(t0, Duration::ZERO)];
        // The readers run side by side: one step of each in turn, on one shared wall clock.
        let longest = a.len().max(b.len()).max(c.len());
        let mut now = t0;
        for k in 0..longest {
            let mut step_wall = Duration::ZERO;
            for (r, events) in readers.iter_mut().zip([&a, &b, &c]) {
                let Some(&event) = events.get(k) else { continue };
                step_wall = step_wall.max(US * event.0 as u32);
                r.now = now;
                step(r, event, &process);
            }
            now += step_wall;
            let total: Duration = readers.iter().map(|r| r.guard.realtime_cpu()).sum();
            timeline.push((now, total));
        }
        // The process's rate is the share of one CPU (1000 thousandths).
        let slack = budget.burst + US * (3 * MAX_BATCH_US) as u32;
        within_budget(&timeline, budget.share_percent, slack)?;
    }
}
