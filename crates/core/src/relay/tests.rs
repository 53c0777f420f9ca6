//! The relay's receive-side rule against a model of a reader and its partners: whatever the
//! batch sizes and the order partners finish in, the batches opened at one time hold at most
//! `IN_FLIGHT_DATAGRAMS` datagrams together (or one batch is opened alone), so their counters
//! stay inside the replay window.

use super::*;
use proptest::prelude::*;

#[test]
fn a_reader_gets_a_partner_per_other_cpu_the_workers_use_and_none_alone() {
    // One worker is the single-threaded path, whatever the CPUs.
    assert_eq!(partners(1, 16), 0);
    // A partner per other CPU, not per other worker: past the CPUs they only cost.
    assert_eq!(partners(2, 2), 1);
    assert_eq!(partners(4, 2), 1);
    assert_eq!(partners(16, 1), 0);
    assert_eq!(partners(3, 8), 2);
    // Capped.
    assert_eq!(partners(16, 16), MAX_PARTNERS);
    assert_eq!(partners(0, 4), 0);
}

#[test]
fn the_relay_is_on_unless_turned_off_and_the_cpus_bound_it() {
    // Nothing asked: as many as the CPUs allow.
    assert_eq!(allowed(None), MAX_PARTNERS);
    assert_eq!(partners(2, 2).min(allowed(None)), 1);
    assert_eq!(partners(8, 16).min(allowed(None)), MAX_PARTNERS);
    assert_eq!(partners(1, 16).min(allowed(None)), 0);
    assert_eq!(partners(4, 1).min(allowed(None)), 0);
    // Asked: at most that, 0 turns it off.
    assert_eq!(partners(8, 16).min(allowed(Some(0))), 0);
    assert_eq!(partners(8, 16).min(allowed(Some(2))), 2);
    assert_eq!(partners(2, 2).min(allowed(Some(3))), 1);
}

#[test]
fn small_reads_stay_with_their_reader() {
    assert!(!hands_off_read(1));
    assert!(!hands_off_read(MIN_PACKETS - 1));
    assert!(hands_off_read(MIN_PACKETS));
    assert!(hands_off_read(46));
    assert!(!hands_off_batch(0, MIN_PACKETS - 1));
    assert!(hands_off_batch(0, MIN_PACKETS));
}

#[test]
fn a_batch_goes_to_a_partner_only_within_the_budget_and_a_big_one_waits_for_the_rest() {
    assert!(hands_off_batch(0, IN_FLIGHT_DATAGRAMS));
    assert!(!hands_off_batch(0, IN_FLIGHT_DATAGRAMS + 1));
    assert!(hands_off_batch(200, IN_FLIGHT_DATAGRAMS - 200));
    assert!(!hands_off_batch(200, IN_FLIGHT_DATAGRAMS - 199));
    // Alone, any batch is opened at once: nothing else moves its window.
    assert!(!opens_after_in_flight(0, 3000));
    assert!(!opens_after_in_flight(300, IN_FLIGHT_DATAGRAMS - 300));
    assert!(opens_after_in_flight(300, IN_FLIGHT_DATAGRAMS - 299));
    const { assert!(IN_FLIGHT_DATAGRAMS < REPLAY_WINDOW) };
}

/// One step of the model: a batch of `size` datagrams arrives (and `idle` says whether a
/// partner is free for it), or partner `finish` (of those busy, modulo their number) finishes.
#[derive(Debug, Clone)]
enum Step {
    Batch { size: usize, idle: bool },
    Finish(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        prop_oneof![
            (1usize..3000, any::<bool>()).prop_map(|(size, idle)| Step::Batch { size, idle }),
            (0usize..8).prop_map(Step::Finish),
        ],
        1..200,
    )
}

proptest! {
    #[test]
    fn batches_opened_at_once_stay_inside_the_window(steps in steps(), partners in 1usize..4) {
        // Batches partners are opening: their sizes (their counters follow each other in
        // arrival order; only their sum matters for how far apart two of them can be).
        let mut busy: Vec<usize> = Vec::new();
        for step in steps {
            match step {
                Step::Finish(k) => {
                    if !busy.is_empty() {
                        let k = k % busy.len();
                        busy.remove(k);
                    }
                }
                Step::Batch { size, idle } => {
                    let in_flight: usize = busy.iter().sum();
                    if idle && busy.len() < partners && hands_off_batch(in_flight, size) {
                        busy.push(size);
                        prop_assert!(busy.iter().sum::<usize>() <= IN_FLIGHT_DATAGRAMS);
                        continue;
                    }
                    // The reader opens it: after the ones in flight, or beside them.
                    if opens_after_in_flight(in_flight, size) {
                        busy.clear();
                    }
                    let open_at_once: usize = busy.iter().sum::<usize>() + size;
                    prop_assert!(
                        busy.is_empty() || open_at_once <= IN_FLIGHT_DATAGRAMS,
                        "{open_at_once} datagrams opened at once"
                    );
                }
            }
        }
    }
}
