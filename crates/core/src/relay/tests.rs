//! The relay's rules, case by case. The property that they keep every batch's counters inside
//! the replay window is tested where they are used, against the relay's own hand-off and turns
//! with real partner threads (`src/shell/dataplane/relay/tests.rs`, `receive`).

use super::*;

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
