use super::*;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn a_thread_goes_up_when_it_first_drains_its_queue_and_stays_up_while_it_keeps_draining() {
    let mut guard = PriorityGuard::new(true);
    let t0 = crate::test_util::now();
    assert_eq!(guard.current(), Priority::Normal);
    assert_eq!(guard.on_drained(t0, 1), Some(Priority::Realtime));
    // Bursts shorter than the limit, each drained: no switch at all (no system call).
    for k in 0..100u32 {
        let start = t0 + MS * (k * 20);
        assert_eq!(guard.on_busy(start), None);
        assert_eq!(guard.on_busy(start + BUSY_LIMIT - MS), None);
        assert_eq!(guard.on_drained(start + BUSY_LIMIT - MS, 1), None);
    }
    assert_eq!(guard.current(), Priority::Realtime);
}

#[test]
fn a_thread_busy_for_the_limit_steps_down_and_waits_out_the_cool_down() {
    let mut guard = PriorityGuard::new(true);
    let t0 = crate::test_util::now();
    guard.on_drained(t0, 1);
    assert_eq!(guard.on_busy(t0), None);
    assert_eq!(guard.on_busy(t0 + BUSY_LIMIT - MS), None);
    assert_eq!(guard.on_busy(t0 + BUSY_LIMIT), Some(Priority::Normal));
    // Still busy: it stays down, no switch asked again.
    assert_eq!(guard.on_busy(t0 + BUSY_LIMIT * 3), None);
    // Drained during the cool-down: still down.
    let down = t0 + BUSY_LIMIT;
    assert_eq!(guard.on_drained(down + COOL_DOWN - MS, 1), None);
    assert_eq!(guard.current(), Priority::Normal);
    // Drained after it: up again.
    assert_eq!(
        guard.on_drained(down + COOL_DOWN, 1),
        Some(Priority::Realtime)
    );
}

#[test]
fn a_disabled_or_refused_guard_never_asks_for_realtime() {
    let t0 = crate::test_util::now();
    let mut off = PriorityGuard::new(false);
    let mut refused = PriorityGuard::new(true);
    assert_eq!(refused.on_drained(t0, 1), Some(Priority::Realtime));
    refused.on_refused();
    for k in 0..50u32 {
        let now = t0 + COOL_DOWN * k;
        for guard in [&mut off, &mut refused] {
            assert_eq!(guard.on_drained(now, 1), None);
            assert_eq!(guard.on_busy(now + BUSY_LIMIT * 2), None);
            assert_eq!(guard.current(), Priority::Normal);
        }
    }
}

#[test]
fn a_thread_woken_for_every_packet_steps_down_and_batches_again() {
    let mut guard = PriorityGuard::new(true);
    let t0 = crate::test_util::now();
    assert_eq!(guard.on_drained(t0, 0), Some(Priority::Realtime));
    // A UDP sender slower than the thread: a wake-up and one packet every 20 us.
    let step = Duration::from_micros(20);
    let mut switched = None;
    for k in 1..PING_PONG_DRAINS * 2 {
        if let Some(to) = guard.on_drained(t0 + step * k, 1) {
            switched = Some((k, to));
        }
    }
    // The first window (the drain at t0 was its first) ends at drain 64: down, and down it stays.
    assert_eq!(switched, Some((PING_PONG_DRAINS - 1, Priority::Normal)));
    // Back up only after the cool-down.
    let later = t0 + step * (PING_PONG_DRAINS * 2);
    assert_eq!(guard.on_drained(later + COOL_DOWN / 2, 1), None);
    assert_eq!(
        guard.on_drained(later + COOL_DOWN, 50),
        Some(Priority::Realtime)
    );
}

#[test]
fn bulk_reads_and_sparse_wake_ups_keep_realtime() {
    let t0 = crate::test_util::now();
    // A TCP stream: as many wake-ups, but each read a super-packet of 40 segments.
    let mut bulk = PriorityGuard::new(true);
    bulk.on_drained(t0, 0);
    // Pings: one packet a wake-up, 1,000 wake-ups a second.
    let mut sparse = PriorityGuard::new(true);
    sparse.on_drained(t0, 0);
    for k in 1..10_000u32 {
        assert_eq!(
            bulk.on_drained(t0 + Duration::from_micros(20) * k, 40),
            None
        );
        assert_eq!(sparse.on_drained(t0 + MS * k, 1), None);
    }
    assert_eq!(bulk.current(), Priority::Realtime);
    assert_eq!(sparse.current(), Priority::Realtime);
}

proptest! {
    /// Under any pattern of work, a thread is never at real-time priority for more than the
    /// busy limit without draining its queue, and after stepping down it never goes up within
    /// the cool-down: other work gets its share of the CPU.
    #[test]
    fn realtime_never_outlasts_the_busy_limit_and_the_cool_down_holds(
        events in proptest::collection::vec((any::<bool>(), 0u64..30_000), 1..400),
    ) {
        let mut guard = PriorityGuard::new(true);
        let mut now = crate::test_util::now();
        let mut busy_since: Option<Instant> = None;
        let mut stepped_down: Option<Instant> = None;
        for (drained, step_us) in events {
            let switch = if drained {
                busy_since = None;
                guard.on_drained(now, 100)
            } else {
                busy_since.get_or_insert(now);
                guard.on_busy(now)
            };
            match switch {
                Some(Priority::Normal) => stepped_down = Some(now),
                Some(Priority::Realtime) => {
                    if let Some(at) = stepped_down {
                        prop_assert!(now >= at + COOL_DOWN);
                    }
                }
                None => {}
            }
            if guard.current() == Priority::Realtime {
                if let Some(since) = busy_since {
                    prop_assert!(now.saturating_duration_since(since) < BUSY_LIMIT);
                }
            }
            now += Duration::from_micros(step_us);
        }
    }
}
