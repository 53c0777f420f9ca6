use super::*;
use proptest::prelude::*;

const TARGET: Duration = Duration::from_millis(1);
const INTERVAL: Duration = Duration::from_millis(10);
const BATCH_EVERY: Duration = Duration::from_micros(100);
const SETTINGS: Settings = Settings {
    target: TARGET,
    interval: INTERVAL,
};

/// Runs `codel` over batches every [`BATCH_EVERY`] from `start` for `span`, each batch's oldest
/// datagram having waited `sojourn`; returns the times of the drops.
fn run(codel: &mut Codel, start: Instant, span: Duration, sojourn: Duration) -> Vec<Instant> {
    let mut drops = Vec::new();
    let mut now = start;
    while now < start + span {
        for _ in 0..codel.on_dequeue(sojourn, now) {
            drops.push(now);
        }
        now += BATCH_EVERY;
    }
    drops
}

#[test]
fn a_queue_below_target_is_never_dropped_from() {
    let mut codel = Codel::new(SETTINGS);
    let drops = run(
        &mut codel,
        crate::test_util::now(),
        Duration::from_secs(2),
        TARGET / 2,
    );
    assert!(drops.is_empty());
    assert!(!codel.dropping());
}

#[test]
fn a_burst_shorter_than_the_interval_is_let_through() {
    let mut codel = Codel::new(SETTINGS);
    let start = crate::test_util::now();
    // 9 ms above target, then the queue drains: no drop.
    assert!(run(
        &mut codel,
        start,
        INTERVAL - Duration::from_millis(1),
        TARGET * 5
    )
    .is_empty());
    let later = start + INTERVAL;
    assert!(run(&mut codel, later, INTERVAL * 3, Duration::ZERO).is_empty());
    // Above target again: the interval starts anew, not from the first burst.
    let again = later + INTERVAL * 3;
    assert!(run(&mut codel, again, INTERVAL - BATCH_EVERY, TARGET * 5).is_empty());
}

#[test]
fn a_standing_queue_is_dropped_from_after_one_interval_then_ever_more_often() {
    let mut codel = Codel::new(SETTINGS);
    let start = crate::test_util::now();
    let drops = run(&mut codel, start, Duration::from_millis(200), TARGET * 3);
    // The first drop one interval after the queue went above target (the first batch).
    assert_eq!(drops[0], start + INTERVAL);
    assert!(codel.dropping());
    // Then at interval / sqrt(count): 10, 7.07, 5.77, 5 ms... apart, each gap no longer than
    // the one before (within one batch of rounding).
    let gaps: Vec<Duration> = drops.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps[0] >= INTERVAL && gaps[0] <= INTERVAL + BATCH_EVERY,
        "{gaps:?}"
    );
    for w in gaps.windows(2) {
        assert!(w[1] <= w[0] + BATCH_EVERY, "gaps grew: {gaps:?}");
    }
    // 190 ms of the control law from count 1: the sum of 10/sqrt(n) ms over n = 1..N is about
    // 10 * (2 sqrt(N) - 1.46), which reaches 190 at N = 105; plus the first drop.
    assert!((100..=110).contains(&drops.len()), "{} drops", drops.len());
}

#[test]
fn once_the_queue_drains_below_target_the_drops_stop() {
    let mut codel = Codel::new(SETTINGS);
    let start = crate::test_util::now();
    assert!(!run(&mut codel, start, INTERVAL * 5, TARGET * 3).is_empty());
    assert_eq!(codel.on_dequeue(TARGET / 2, start + INTERVAL * 5), 0);
    assert!(!codel.dropping());
    assert!(run(&mut codel, start + INTERVAL * 6, INTERVAL * 20, TARGET / 2).is_empty());
}

#[test]
fn a_queue_that_comes_back_soon_resumes_near_the_old_drop_rate() {
    let mut codel = Codel::new(SETTINGS);
    let start = crate::test_util::now();
    let first = run(&mut codel, start, Duration::from_millis(100), TARGET * 3);
    assert!(codel.on_dequeue(Duration::ZERO, start + Duration::from_millis(100)) == 0);
    // Back within 16 intervals: after the interval the drops come at the old episode's pace.
    let back = start + Duration::from_millis(110);
    let second = run(&mut codel, back, Duration::from_millis(40), TARGET * 3);
    let first_gap = first[first.len() - 1] - first[first.len() - 2];
    let second_gap = second[1] - second[0];
    assert!(
        second_gap < INTERVAL / 2,
        "resumed at {second_gap:?}, left at {first_gap:?}"
    );
}

#[test]
fn a_late_batch_owes_at_most_a_few_drops() {
    let mut codel = Codel::new(SETTINGS);
    let start = crate::test_util::now();
    assert_eq!(codel.on_dequeue(TARGET * 3, start), 0);
    assert_eq!(codel.on_dequeue(TARGET * 3, start + INTERVAL), 1);
    // The thread was off the CPU for a second: the schedule owes ~30 drops; a batch takes 4.
    assert_eq!(
        codel.on_dequeue(TARGET * 3, start + Duration::from_secs(1)),
        MAX_DROPS_PER_DEQUEUE
    );
}

#[test]
fn only_full_size_data_messages_may_be_dropped() {
    let mut data = vec![0u8; 1452];
    data[0] = 4;
    assert!(droppable(&data));
    assert!(droppable(&data[..MIN_DROPPABLE_LEN]));
    // A ping, an ACK, a keepalive (32 bytes): small data messages stay.
    assert!(!droppable(&data[..MIN_DROPPABLE_LEN - 1]));
    assert!(!droppable(&data[..32]));
    // Handshake initiation, response and cookie reply, whatever their length.
    for kind in 1..=3 {
        data[0] = kind;
        assert!(!droppable(&data));
    }
    assert!(!droppable(&[]));
}

#[test]
fn a_longer_interval_waits_longer_for_the_first_drop_and_spaces_the_next() {
    let wan = Settings {
        target: TARGET,
        interval: Duration::from_millis(100),
    };
    let mut codel = Codel::new(wan);
    let start = crate::test_util::now();
    let drops = run(&mut codel, start, Duration::from_millis(400), TARGET * 3);
    assert_eq!(drops[0], start + wan.interval);
    assert!(drops[1] - drops[0] >= wan.interval, "{drops:?}");
    // 300 ms of the control law at a 100 ms interval: 10/sqrt(n) summed reaches 3 at n = 4.
    assert!((3..=6).contains(&drops.len()), "{} drops", drops.len());
}

proptest! {
    /// Whatever came before, a batch whose oldest datagram waited less than the target is
    /// never dropped from, and ends the dropping state.
    #[test]
    fn below_target_never_drops(
        history in proptest::collection::vec((0u64..20_000, 0u64..2_000), 0..200),
        short in 0u64..1_000,
    ) {
        let mut codel = Codel::new(SETTINGS);
        let mut now = crate::test_util::now();
        for (sojourn_us, step_us) in history {
            codel.on_dequeue(Duration::from_micros(sojourn_us), now);
            now += Duration::from_micros(step_us);
        }
        prop_assert_eq!(codel.on_dequeue(Duration::from_micros(short), now), 0);
        prop_assert!(!codel.dropping());
    }

    /// No schedule drops more than the cap in one batch, and the first drop of an episode
    /// never comes before the queue has stood above target for one interval.
    #[test]
    fn drops_are_bounded_and_never_early(
        steps in proptest::collection::vec((0u64..5_000, 1u64..3_000), 1..300),
    ) {
        let mut codel = Codel::new(SETTINGS);
        let mut now = crate::test_util::now();
        let mut above_since: Option<Instant> = None;
        for (sojourn_us, step_us) in steps {
            let sojourn = Duration::from_micros(sojourn_us);
            if sojourn < TARGET {
                above_since = None;
            } else if above_since.is_none() {
                above_since = Some(now);
            }
            let drops = codel.on_dequeue(sojourn, now);
            prop_assert!(drops <= MAX_DROPS_PER_DEQUEUE);
            if drops > 0 {
                let since = above_since.expect("a drop while below target");
                prop_assert!(now >= since + INTERVAL);
            }
            now += Duration::from_micros(step_us);
        }
    }
}

fn data_message(len: usize) -> Vec<u8> {
    let mut d = vec![0u8; len];
    d[0] = 4;
    d
}

#[test]
fn a_receive_queue_takes_its_drops_from_full_size_data_only_and_owes_at_most_a_few() {
    let mut queue = ReceiveQueue::new(Some(SETTINGS));
    assert!(queue.is_on());
    let start = crate::test_util::now();
    queue.on_batch(Some(TARGET * 3), start);
    let ping = data_message(128);
    let bulk = data_message(1452);
    assert!(
        !queue.take_drop(&bulk),
        "no drop before one interval above target"
    );
    queue.on_batch(Some(TARGET * 3), start + INTERVAL);
    // The drop owed is not taken from a ping, but from the next full-size message.
    assert!(!queue.take_drop(&ping));
    assert!(queue.take_drop(&bulk));
    assert!(!queue.take_drop(&bulk), "one drop owed, one taken");
    // Batches of small packets only: the drops owed pile up to a cap, not without end.
    for k in 1..=100u32 {
        queue.on_batch(
            Some(TARGET * 3),
            start + INTERVAL + Duration::from_millis(u64::from(k)),
        );
    }
    let taken = (0..100).filter(|_| queue.take_drop(&bulk)).count();
    assert_eq!(taken, MAX_OWED_DROPS as usize);
}

#[test]
fn a_drained_receive_queue_owes_nothing() {
    let mut queue = ReceiveQueue::new(Some(SETTINGS));
    let start = crate::test_util::now();
    queue.on_batch(Some(TARGET * 3), start);
    queue.on_batch(Some(TARGET * 3), start + INTERVAL);
    queue.on_batch(Some(Duration::ZERO), start + INTERVAL + BATCH_EVERY);
    assert!(!queue.take_drop(&data_message(1452)));
}

#[test]
fn a_receive_queue_without_target_or_timestamps_never_drops() {
    let bulk = data_message(1452);
    let mut off = ReceiveQueue::new(None);
    assert!(!off.is_on());
    let mut blind = ReceiveQueue::new(Some(SETTINGS));
    let start = crate::test_util::now();
    for k in 0..1000u32 {
        let now = start + BATCH_EVERY * k;
        off.on_batch(Some(TARGET * 10), now);
        blind.on_batch(None, now);
        assert!(!off.take_drop(&bulk) && !blind.take_drop(&bulk));
    }
}

#[test]
fn drops_lent_to_another_thread_are_taken_there_once_and_what_is_left_comes_back() {
    let mut queue = ReceiveQueue::new(Some(SETTINGS));
    let start = crate::test_util::now();
    // A standing queue, long enough to owe a few drops.
    for k in 0..=10u32 {
        queue.on_batch(
            Some(TARGET * 3),
            start + INTERVAL * k + Duration::from_millis(u64::from(k)),
        );
    }
    let bulk = data_message(1452);
    let ping = data_message(128);
    let mut lent = queue.lend();
    assert!(lent > 0, "a standing queue owes drops");
    assert!(!queue.take_drop(&bulk), "lent drops are not owed twice");
    // Taken on the other thread from full-size data only, one per drop lent.
    assert!(!take_owed_drop(&mut lent, &ping));
    assert!(take_owed_drop(&mut lent, &bulk));
    let left = lent;
    // What the batch did not take is owed again, up to the cap.
    queue.repay(left);
    let taken = (0..10).filter(|_| queue.take_drop(&bulk)).count();
    assert_eq!(taken, left as usize);
    queue.repay(100);
    let taken = (0..100).filter(|_| queue.take_drop(&bulk)).count();
    assert_eq!(taken, MAX_OWED_DROPS as usize, "repaid, never past the cap");
}
