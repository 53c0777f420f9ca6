//! The sequencer against arbitrary completion orders and drops: every number released exactly
//! once, in order, with its own result, and never more in flight than the bound.

use super::*;
use proptest::prelude::*;

#[test]
fn results_finished_out_of_order_leave_in_order_and_a_gap_does_not_block() {
    let mut s = Sequencer::new(4);
    assert_eq!(s.reserve(3), Some(0));
    s.complete(2, Some("c")).expect("in flight");
    assert_eq!(s.release(), None, "0 is still being worked on");
    s.complete(0, Some("a")).expect("in flight");
    s.complete(1, None).expect("in flight"); // dropped: will never be filled
    assert_eq!(s.release(), Some((0, Some("a"))));
    assert_eq!(s.release(), Some((1, None)));
    assert_eq!(s.release(), Some((2, Some("c"))));
    assert_eq!(s.release(), None);
    assert_eq!(s.in_flight(), 0);
}

#[test]
fn a_full_sequencer_refuses_and_twice_or_unknown_numbers_are_errors() {
    let mut s: Sequencer<u8> = Sequencer::new(3);
    assert_eq!(s.reserve(2), Some(0));
    assert_eq!(s.reserve(2), None, "4 in flight would pass the bound of 3");
    assert_eq!(s.in_flight(), 2, "a refusal reserves nothing");
    assert_eq!(s.reserve(1), Some(2));
    assert_eq!(s.complete(3, Some(1)), Err(SequenceError::NotInFlight(3)));
    s.complete(0, Some(1)).expect("in flight");
    assert_eq!(
        s.complete(0, Some(1)),
        Err(SequenceError::AlreadyComplete(0))
    );
    assert_eq!(s.release(), Some((0, Some(1))));
    assert_eq!(s.complete(0, Some(1)), Err(SequenceError::NotInFlight(0)));
    assert_eq!(s.reserve(1), Some(3), "room again once 0 left");
}

/// What a worker does next: reserve a batch, finish one in-flight number (with or without a
/// result), or release what is ready.
#[derive(Debug, Clone)]
enum Step {
    Reserve(usize),
    Finish { pick: usize, drop: bool },
    Release,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (1usize..10).prop_map(Step::Reserve),
        3 => (any::<usize>(), proptest::bool::weighted(0.2))
            .prop_map(|(pick, drop)| Step::Finish { pick, drop }),
        1 => Just(Step::Release),
    ]
}

proptest! {
    #[test]
    fn every_number_is_released_once_in_order_within_the_bound(
        bound in 1usize..40,
        steps in proptest::collection::vec(step(), 0..400),
    ) {
        let mut s = Sequencer::new(bound);
        let mut reserved = 0u64;
        let mut pending: Vec<u64> = Vec::new();
        let mut results: std::collections::HashMap<u64, Option<u64>> = Default::default();
        let mut released: Vec<(u64, Option<u64>)> = Vec::new();
        let release_all = |s: &mut Sequencer<u64>, released: &mut Vec<(u64, Option<u64>)>| {
            while let Some(r) = s.release() {
                released.push(r);
            }
        };
        for step in steps {
            match step {
                Step::Reserve(n) => {
                    let fits = s.in_flight() + n <= bound;
                    match s.reserve(n) {
                        Some(first) => {
                            prop_assert!(fits);
                            prop_assert_eq!(first, reserved);
                            pending.extend(first..first + n as u64);
                            reserved += n as u64;
                        }
                        None => prop_assert!(!fits, "refused with room"),
                    }
                }
                Step::Finish { pick, drop } if !pending.is_empty() => {
                    let n = pending.swap_remove(pick % pending.len());
                    let result = (!drop).then_some(n * 7 + 1);
                    s.complete(n, result).expect("in flight");
                    results.insert(n, result);
                    prop_assert_eq!(s.complete(n, result), Err(SequenceError::AlreadyComplete(n)));
                }
                Step::Finish { .. } => {}
                Step::Release => release_all(&mut s, &mut released),
            }
            prop_assert!(s.in_flight() <= bound);
        }
        // Whatever is still out finishes (in reverse, the worst order), and all of it leaves.
        pending.sort_unstable();
        for n in pending.into_iter().rev() {
            s.complete(n, Some(n * 7 + 1)).expect("in flight");
            results.insert(n, Some(n * 7 + 1));
        }
        release_all(&mut s, &mut released);
        prop_assert_eq!(released.len() as u64, reserved, "each number released once");
        for (i, (n, result)) in released.into_iter().enumerate() {
            prop_assert_eq!(n, i as u64, "in order");
            prop_assert_eq!(Some(result), results.get(&n).copied(), "its own result");
        }
        prop_assert_eq!(s.in_flight(), 0);
    }
}
