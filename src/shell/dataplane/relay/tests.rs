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
                relay
                    .serve(me, |read, turn| {
                        log.by_partners.fetch_add(1, Ordering::Relaxed);
                        dice.delay();
                        turn.hold();
                        log.emitted.lock().push(*read);
                    })
                    .expect("served")
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
        p.join().expect("partner").expect("served");
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
    partner.join().expect("partner").expect("served");
}

/// A partner whose work panics mid-job (before it held its turn) releases what the job held
/// as it unwinds: its turn is passed, its lock is free (a reader that would lend it its
/// priority does not block on a dead thread's lock), its CPU mark is gone and its weight is
/// no longer in flight. The panic itself reaches whoever joins the partner.
#[test]
fn a_partner_that_panics_mid_job_releases_its_turn_lock_cpu_and_weight() {
    let cores = Arc::new(Cores::new(2));
    let relay = Arc::new(Relay::new(1, cores.clone(), || 0u64));
    let partner = {
        let relay = relay.clone();
        std::thread::spawn(move || {
            relay.serve(0, |job, turn| {
                if *job == 1 {
                    std::thread::sleep(Duration::from_millis(50));
                    panic!("a bug in the partner's work");
                }
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
    claim.post(7);
    assert_eq!(relay.in_flight(), 7);
    // The partner has the job before the reader asks for its turn (else, on a loaded machine,
    // the reader takes the job back and the partner never runs it).
    let since = crate::shell::clock::now();
    while relay.mailboxes[0].working_on.load(Ordering::SeqCst) == NOT_WORKING
        && crate::shell::clock::since(since) < Duration::from_secs(5)
    {
        std::thread::yield_now();
    }
    assert_ne!(
        relay.mailboxes[0].working_on.load(Ordering::SeqCst),
        NOT_WORKING,
        "the partner took the job"
    );
    // The reader's next turn waits for the job's, lending (blocking on the partner's lock):
    // it must come back once the partner is gone.
    let reader = {
        let relay = relay.clone();
        std::thread::spawn(move || {
            let nothing_to_take_back = |_: &mut u64, _: &mut Turn<'_, u64>| {};
            let mut turn = relay.issue_taking_back(&nothing_to_take_back);
            turn.hold();
        })
    };
    let since = crate::shell::clock::now();
    while !reader.is_finished() && crate::shell::clock::since(since) < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stuck = !reader.is_finished();
    // Ends the reader's wait either way, so a failure is a failure and not a hang.
    relay.stop();
    reader.join().expect("reader");
    assert!(
        !stuck,
        "the reader still waits for the dead partner's turn after 5 s"
    );
    let panicked = partner.join();
    assert!(panicked.is_err(), "the panic reaches the join");
    assert_eq!(relay.in_flight(), 0, "its weight left the in-flight count");
    assert_eq!(cores.busy.load(Ordering::SeqCst), 0, "its CPU mark left");
    assert_eq!(
        relay.mailboxes[0].working.word_for_tests(),
        0,
        "its lock was released"
    );
    assert_eq!(
        relay.mailboxes[0].working_on.load(Ordering::SeqCst),
        NOT_WORKING
    );
}

/// A job the reader took back waits for an earlier partner's turn by blocking on that
/// partner's lock (lending it its priority, counted as lent), not asleep.
#[test]
fn a_job_taken_back_that_waits_for_a_partner_lends_it_its_priority() {
    // Partner 0 runs and works 100 ms on job 1; partner 1 never runs, so the reader takes its
    // job (2) back; the taken-back job must wait for job 1's turn.
    let relay = Arc::new(Relay::new(2, Arc::new(Cores::new(3)), || 0u64));
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
    let mut first = loop {
        if let Some(claim) = relay.claim() {
            break claim;
        }
        std::thread::yield_now();
    };
    assert_eq!(first.partner, 0, "the running partner is the idle one");
    *first.job() = 1;
    first.post(1);
    while !started.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // Partner 1 waits (idle) but never runs.
    relay.mailboxes[1].idle.store(true, Ordering::SeqCst);
    let mut second = relay.claim().expect("the idle partner");
    *second.job() = 2;
    second.post(1);
    let done = Mutex::new(Vec::new());
    let take_back = |job: &mut u64, turn: &mut Turn<'_, u64>| {
        turn.hold();
        done.lock().push(*job);
    };
    let mut own = relay.issue_taking_back(&take_back);
    own.hold();
    drop(own);
    assert_eq!(*done.lock(), [2], "job 2 taken back");
    let lent = Duration::from_nanos(relay.lent().load(Ordering::Relaxed));
    assert!(
        lent >= Duration::from_millis(50),
        "lent {lent:?}: the taken-back job waited for job 1 without lending"
    );
    relay.stop();
    partner.join().expect("partner").expect("served");
}

/// The UDP reader's receive side (`workers::udp_loop`), driven through this relay and
/// `core::relay`'s rules by a property test: batches with gaps in their counters (datagrams
/// the path lost), opened by real partner threads and by the reader, each after a random time.
mod receive {
    use super::*;
    use crate::core::relay::{
        hands_off_batch, opens_after_in_flight, IN_FLIGHT_DATAGRAMS, REPLAY_WINDOW,
    };
    use proptest::prelude::*;

    /// A receive batch: its place in arrival order, its first counter, its size.
    #[derive(Debug, Clone, Copy, Default)]
    struct Batch {
        number: u64,
        first: u64,
        datagrams: usize,
    }

    /// What the receiving session and the TUN queue saw.
    #[derive(Default)]
    struct Receiver {
        /// boringtun's replay window: the highest counter recorded and every one seen.
        highest: Option<u64>,
        seen: std::collections::HashSet<u64>,
        /// Counters refused as too old: datagrams the relay lost by opening out of order.
        refused: Vec<u64>,
        /// Batches written to the TUN queue, in the order written.
        written: Vec<u64>,
        /// Datagrams being opened now and the batches they belong to; the worst seen.
        opening: usize,
        opening_batches: usize,
        overlaps: Vec<(usize, usize)>,
    }

    impl Receiver {
        /// boringtun's rule (`ReceivingKeyCounterValidator`): a counter more than the window
        /// below the highest recorded is refused.
        fn record(&mut self, counter: u64) {
            if self
                .highest
                .is_some_and(|h| counter + REPLAY_WINDOW as u64 <= h)
                || !self.seen.insert(counter)
            {
                self.refused.push(counter);
                return;
            }
            self.highest = Some(self.highest.map_or(counter, |h| h.max(counter)));
        }
    }

    /// Opens `batch` as a partner or the reader does: its counters recorded one by one, after
    /// some time (`delays` of up to about 50 microseconds), then written on its turn.
    fn open(
        receiver: &Mutex<Receiver>,
        batch: &Batch,
        dice: &mut Dice,
        turn: &mut Turn<'_, Batch>,
    ) {
        {
            let mut r = receiver.lock();
            r.opening += batch.datagrams;
            r.opening_batches += 1;
            if r.opening_batches > 1 && r.opening > IN_FLIGHT_DATAGRAMS {
                let worst = (r.opening, r.opening_batches);
                r.overlaps.push(worst);
            }
        }
        dice.delay();
        for (i, counter) in (batch.first..batch.first + batch.datagrams as u64).enumerate() {
            receiver.lock().record(counter);
            if i % 97 == 0 {
                dice.delay();
            }
        }
        {
            let mut r = receiver.lock();
            r.opening -= batch.datagrams;
            r.opening_batches -= 1;
        }
        turn.hold();
        receiver.lock().written.push(batch.number);
    }

    /// Batch sizes as a reader sees them: single datagrams, small batches, full batches of 64,
    /// GRO-sized ones of thousands; and how many datagrams the path lost before each.
    fn batches() -> impl Strategy<Value = Vec<(usize, u64)>> {
        proptest::collection::vec(
            (
                prop_oneof![
                    1usize..8,
                    8usize..64,
                    Just(64usize),
                    64usize..600,
                    600usize..4096
                ],
                prop_oneof![Just(0u64), 0u64..100],
            ),
            1..40,
        )
    }

    /// Runs `sizes` through a reader and `partners` partners; returns what the receiver saw
    /// and the most datagrams in flight the relay reported.
    fn run(sizes: &[(usize, u64)], partners: usize, seed: u64) -> (Receiver, usize, Vec<u64>) {
        let relay = Arc::new(Relay::new(
            partners,
            Arc::new(Cores::new(partners + 1)),
            Batch::default,
        ));
        let receiver = Arc::new(Mutex::new(Receiver::default()));
        let threads: Vec<_> = (0..partners)
            .map(|me| {
                let (relay, receiver) = (relay.clone(), receiver.clone());
                std::thread::spawn(move || {
                    let mut dice = Dice(seed ^ ((me as u64 + 1) * 0x9e37_79b9) | 1);
                    relay.serve(me, |batch, turn| open(&receiver, batch, &mut dice, turn))
                })
            })
            .collect();
        // Partners are idle only once they wait: let them get there, as a running reader's
        // have by the time traffic comes (a claim that finds none busy is still legal).
        std::thread::sleep(Duration::from_millis(1));
        let reader_dice = Mutex::new(Dice(seed | 1));
        let take_back = |batch: &mut Batch, turn: &mut Turn<'_, Batch>| {
            open(&receiver, batch, &mut reader_dice.lock(), turn);
        };
        let mut most_in_flight = 0;
        let mut next_counter = 0u64;
        let mut lost = Vec::new();
        for (number, &(datagrams, gap)) in sizes.iter().enumerate() {
            lost.extend(next_counter..next_counter + gap);
            let mut batch = Batch {
                number: number as u64,
                first: next_counter + gap,
                datagrams,
            };
            next_counter = batch.first + datagrams as u64;
            // What `udp_loop` does with a receive batch.
            let claim = Some(&*relay)
                .filter(|r| hands_off_batch(r.in_flight(), datagrams))
                .and_then(|r| r.claim());
            if let Some(mut claim) = claim {
                std::mem::swap(claim.job(), &mut batch);
                claim.post(datagrams);
                most_in_flight = most_in_flight.max(relay.in_flight());
                continue;
            }
            let mut turn = Turn::of_taking_back(Some(&*relay), &take_back);
            if opens_after_in_flight(relay.in_flight(), datagrams) {
                turn.hold();
            }
            let mut dice = Dice(reader_dice.lock().roll(u64::MAX) | 1);
            open(&receiver, &batch, &mut dice, &mut turn);
        }
        drop(Turn::of(Some(&*relay)));
        assert_eq!(relay.in_flight(), 0, "every batch finished");
        relay.stop();
        for t in threads {
            t.join().expect("partner").expect("served");
        }
        let receiver = Arc::try_unwrap(receiver)
            .ok()
            .expect("the partners are gone")
            .into_inner();
        (receiver, most_in_flight, lost)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Whatever the sizes, the losses and the times partners and reader take: every
        /// batch is written once, in arrival order; every datagram the path delivered is
        /// inside the replay window when it is recorded (none refused as too old, none twice);
        /// no more than `IN_FLIGHT_DATAGRAMS` are handed to partners at once, and batches are
        /// opened at the same time only while they hold no more than that together.
        #[test]
        fn receive_batches_are_written_in_order_and_none_falls_out_of_the_window(
            sizes in batches(),
            partners in 1usize..4,
            seed in any::<u64>(),
        ) {
            let (receiver, most_in_flight, lost) = run(&sizes, partners, seed);
            prop_assert_eq!(
                &receiver.written,
                &(0..sizes.len() as u64).collect::<Vec<_>>(),
                "written out of order or not once"
            );
            prop_assert!(receiver.refused.is_empty(), "refused as replays: {:?}", receiver.refused);
            let delivered: usize = sizes.iter().map(|&(d, _)| d).sum();
            prop_assert_eq!(receiver.seen.len(), delivered, "a datagram not recorded");
            prop_assert!(lost.iter().all(|c| !receiver.seen.contains(c)));
            prop_assert!(most_in_flight <= IN_FLIGHT_DATAGRAMS, "{} in flight", most_in_flight);
            prop_assert!(receiver.overlaps.is_empty(), "opened at once: {:?}", receiver.overlaps);
        }
    }
}
