//! The relay's order, exactly-once and bounds, with partners finishing in random order after
//! random delays, and its stop.

use super::*;
use std::sync::Arc;

/// A small deterministic generator per thread (xorshift), for delays and choices.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// Some work of a random length: up to about 50 microseconds, sometimes a sleep.
    fn delay(&mut self) {
        match self.roll(10) {
            0 => std::thread::sleep(Duration::from_micros(self.roll(300))),
            _ => {
                for _ in 0..self.roll(20_000) {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// What was emitted, in emission order, how many reads partners did and how many the reader
/// took back.
#[derive(Default)]
struct Log {
    emitted: Mutex<Vec<u64>>,
    by_partners: AtomicUsize,
    taken_back: AtomicUsize,
}

/// `reads` reads through a reader and `partners` partners: each read is handed off when a
/// partner is idle, else done by the reader; the reader also emits a batch of its own before
/// some hand-offs (its pending `out`), as the TUN reader does; with `take_back`, the reader's
/// turns take back what no partner started. Returns the log.
fn run(partners: usize, reads: u64, seed: u64, take_back: bool) -> Arc<Log> {
    let relay = Arc::new(Relay::new(
        partners,
        Arc::new(Cores::new(partners + 1)),
        || 0u64,
    ));
    let log = Arc::new(Log::default());
    let threads: Vec<_> = (0..partners)
        .map(|me| {
            let (relay, log) = (relay.clone(), log.clone());
            std::thread::spawn(move || {
                let mut dice = Dice(seed ^ ((me as u64 + 1) * 0x9e37_79b9));
                relay.serve(me, |read, turn| {
                    log.by_partners.fetch_add(1, Ordering::Relaxed);
                    dice.delay();
                    turn.hold();
                    log.emitted.lock().push(*read);
                });
            })
        })
        .collect();
    let taking_back = |read: &mut u64, turn: &mut Turn<'_, u64>| {
        log.taken_back.fetch_add(1, Ordering::Relaxed);
        turn.hold();
        log.emitted.lock().push(*read);
    };
    let issue = || match take_back {
        true => relay.issue_taking_back(&taking_back),
        false => relay.issue(),
    };
    let mut dice = Dice(seed);
    // The reader's pending emission (reads it did itself, not yet emitted).
    let mut pending: Vec<u64> = Vec::new();
    let emit_pending = |pending: &mut Vec<u64>| {
        if !pending.is_empty() {
            let mut turn = issue();
            turn.hold();
            log.emitted.lock().append(pending);
        }
    };
    for read in 0..reads {
        dice.delay();
        match relay.claim() {
            Some(mut claim) if dice.roll(4) != 0 => {
                // The reader's pending emission goes first: its turn before the job's.
                let mut turn = (!pending.is_empty()).then(issue);
                *claim.job() = read;
                claim.post(1);
                if let Some(turn) = turn.as_mut() {
                    turn.hold();
                    log.emitted.lock().append(&mut pending);
                }
            }
            // A claim given back unused leaves the partner idle.
            _ => {
                pending.push(read);
                if pending.len() >= 3 || dice.roll(3) == 0 {
                    emit_pending(&mut pending);
                }
            }
        }
    }
    emit_pending(&mut pending);
    // Every turn issued is passed once the last is emitted.
    let last = issue();
    drop(last);
    assert_eq!(relay.in_flight(), 0, "every job finished");
    assert_eq!(
        relay.taken_back(),
        log.taken_back.load(Ordering::Relaxed) as u64
    );
    relay.stop();
    for t in threads {
        t.join().expect("partner");
    }
    log
}

/// [`run`] with 2,000 reads, checked to have emitted each once, in read order.
fn run_in_read_order(partners: usize, seed: u64, take_back: bool) -> Arc<Log> {
    let log = run(partners, 2_000, seed, take_back);
    assert_eq!(
        *log.emitted.lock(),
        (0..2_000).collect::<Vec<_>>(),
        "{partners} partners, seed {seed}, take-back {take_back}"
    );
    log
}

#[test]
fn every_read_is_emitted_once_in_read_order_whoever_finishes_first() {
    for (partners, seed) in [(1, 1), (2, 7), (3, 42), (3, 99), (5, 1234)] {
        let log = run_in_read_order(partners, seed, false);
        let by_partners = log.by_partners.load(Ordering::Relaxed);
        assert!(
            by_partners > 0 && by_partners < 2_000,
            "{by_partners} of 2000 reads by partners: both sides must have emitted"
        );
    }
}

#[test]
fn every_read_is_emitted_once_in_read_order_when_the_reader_takes_reads_back() {
    for (partners, seed) in [(1, 3), (2, 11), (3, 42), (5, 77)] {
        let log = run_in_read_order(partners, seed, true);
        assert!(
            log.by_partners.load(Ordering::Relaxed) > 0,
            "partners must have emitted"
        );
    }
}

/// A relay whose partners are idle (as if waiting) but never run: the scheduler gave them no
/// CPU.
fn relay_of_partners_that_never_run(partners: usize) -> Relay<u64> {
    let relay = Relay::new(partners, Arc::new(Cores::new(partners + 1)), || 0u64);
    for mailbox in relay.mailboxes.iter() {
        mailbox.idle.store(true, Ordering::SeqCst);
    }
    relay
}

#[test]
fn reads_no_partner_started_are_done_by_the_reader_in_read_order_before_its_own() {
    let relay = relay_of_partners_that_never_run(2);
    for read in [10, 11] {
        let mut claim = relay.claim().expect("an idle partner");
        *claim.job() = read;
        claim.post(3);
    }
    let emitted = Mutex::new(Vec::new());
    let work = |read: &mut u64, turn: &mut Turn<'_, u64>| {
        turn.hold();
        emitted.lock().push(*read);
    };
    let mut own = relay.issue_taking_back(&work);
    own.hold();
    emitted.lock().push(12);
    drop(own);
    assert_eq!(*emitted.lock(), [10, 11, 12]);
    assert_eq!(relay.taken_back(), 2);
    assert_eq!(relay.in_flight(), 0, "taken back, finished");
    // Both partners are idle again, each with a free buffer.
    let (a, b) = (relay.claim(), relay.claim());
    assert!(a.is_some() && b.is_some());
}

#[test]
fn a_turn_takes_back_only_reads_before_it() {
    let relay = relay_of_partners_that_never_run(1);
    let work = |_: &mut u64, _: &mut Turn<'_, u64>| panic!("a later read was taken back");
    // The reader's pending emission is issued before the read it hands off, as the TUN
    // reader's is: holding it must not do (and wait for) the later read.
    let mut pending = relay.issue_taking_back(&work);
    let mut claim = relay.claim().expect("an idle partner");
    *claim.job() = 1;
    claim.post(1);
    pending.hold();
    drop(pending);
    assert_eq!(relay.taken_back(), 0);
    assert_eq!(relay.in_flight(), 1, "still posted to its partner");
}

#[test]
fn no_more_reads_are_in_flight_than_partners() {
    let relay = Relay::new(2, Arc::new(Cores::new(3)), || ());
    let first = relay.claim();
    assert!(first.is_none(), "partners are idle only once they wait");
    for mailbox in relay.mailboxes.iter() {
        mailbox.idle.store(true, Ordering::SeqCst);
    }
    let a = relay.claim().expect("an idle partner");
    let b = relay.claim().expect("another idle partner");
    assert!(relay.claim().is_none(), "two partners, two claims");
    assert!(relay.free.lock().is_empty(), "one buffer per partner");
    a.post(5);
    assert_eq!(relay.in_flight(), 5);
    assert!(relay.claim().is_none(), "the posted partner is busy");
    // A claim dropped unposted frees its partner and buffer.
    drop(b);
    assert!(relay.claim().is_some());
}

#[test]
fn a_stop_wakes_idle_partners_and_waiters_for_a_turn() {
    let relay = Arc::new(Relay::new(2, Arc::new(Cores::new(3)), || ()));
    let partners: Vec<_> = (0..2)
        .map(|me| {
            let relay = relay.clone();
            std::thread::spawn(move || relay.serve(me, |_, turn| turn.hold()))
        })
        .collect();
    // A turn that never comes: turn 0 is issued and never held or passed.
    let never = relay.issue();
    let waiter = {
        let relay = relay.clone();
        std::thread::spawn(move || {
            let mut turn = relay.issue();
            turn.hold();
        })
    };
    // Long enough for every thread to be past its spinning and asleep.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!waiter.is_finished(), "turn 1 waits for turn 0");
    let t = crate::shell::clock::now();
    relay.stop();
    waiter.join().expect("waiter");
    for p in partners {
        p.join().expect("partner");
    }
    assert!(
        crate::shell::clock::since(t) < Duration::from_secs(1),
        "{:?}",
        crate::shell::clock::since(t)
    );
    drop(never);
}

#[test]
fn no_read_goes_to_a_partner_while_every_cpu_is_busy() {
    let cores = Arc::new(Cores::new(2));
    let relay = Relay::new(1, cores.clone(), || ());
    relay.mailboxes[0].idle.store(true, Ordering::SeqCst);
    let mut reader = Busy::new(Some(&cores));
    reader.set(true);
    let mut other_reader = Busy::new(Some(&cores));
    other_reader.set(true);
    assert!(relay.claim().is_none(), "two busy readers on two CPUs");
    // Marks count once, however often they are set.
    other_reader.set(false);
    other_reader.set(false);
    assert!(relay.claim().is_some(), "a CPU is free again");
    drop(reader);
    assert_eq!(
        cores.busy.load(Ordering::SeqCst),
        0,
        "a dropped mark leaves"
    );
}

/// A reader that must wait for the turn of a read its partner is working on blocks on the
/// partner's priority-inheriting lock (so the partner runs at the reader's priority) and
/// counts the time as lent, for its priority guard to pay.
#[test]
fn a_reader_waiting_for_a_partners_turn_lends_it_its_priority_and_counts_the_time() {
    let relay = Arc::new(Relay::new(1, Arc::new(Cores::new(2)), || 0u64));
    let started = Arc::new(AtomicBool::new(false));
    let partner = {
        let (relay, started) = (relay.clone(), started.clone());
        std::thread::spawn(move || {
            relay.serve(0, |_, turn| {
                started.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
                turn.hold();
            })
        })
    };
    let mut claim = loop {
        if let Some(claim) = relay.claim() {
            break claim;
        }
        std::thread::yield_now();
    };
    *claim.job() = 1;
    claim.post(1);
    while !started.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    let nothing_to_take_back = |_: &mut u64, _: &mut Turn<'_, u64>| {};
    let mut turn = relay.issue_taking_back(&nothing_to_take_back);
    let t = crate::shell::clock::now();
    turn.hold();
    let waited = crate::shell::clock::since(t);
    drop(turn);
    let lent = Duration::from_nanos(relay.lent().load(Ordering::Relaxed));
    assert!(
        lent >= Duration::from_millis(50) && lent <= waited,
        "lent {lent:?} of a {waited:?} wait"
    );
    assert_eq!(relay.taken_back(), 0, "the partner had started it");
    relay.stop();
    partner.join().expect("partner");
}
