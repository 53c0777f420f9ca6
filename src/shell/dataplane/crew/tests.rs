//! The crew with real threads and real sessions: every job runs exactly once whoever takes it,
//! helpers are woken only while a core is free of busy readers, a read sealed by the crew is in
//! counter order and opens exactly once, and a rekey in the middle of a parallel batch loses
//! nothing.

use super::*;
use crate::config::SecretKey;
use crate::core::wg::{Limiter, Outcome, Tunnel};
use rand_core::OsRng;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::AtomicUsize;

/// Enough work per job that helpers get to claim some while the reader is busy.
fn busy(units: usize) -> u64 {
    (0..units as u64 * 2000).fold(0u64, |a, x| std::hint::black_box(a.wrapping_add(x * x)))
}

#[test]
fn every_job_runs_exactly_once_whoever_takes_it() {
    let crew = Crew::new(3, 4);
    let _helpers = crew
        .spawn_helpers(|i| format!("test-helper-{i}"), || {})
        .expect("helpers");
    let seat = crew.seat();
    assert!(seat.has_helpers());
    let runs: Vec<AtomicUsize> = (0..40).map(|_| AtomicUsize::new(0)).collect();
    let by_helper = AtomicUsize::new(0);
    let me = std::thread::current().id();
    for round in 0..300 {
        let jobs = 1 + round % 40;
        seat.run(jobs, &|j| {
            busy(1 + j % 3);
            runs[j].fetch_add(1, Ordering::Relaxed);
            if std::thread::current().id() != me {
                by_helper.fetch_add(1, Ordering::Relaxed);
            }
        });
        for (j, n) in runs.iter().enumerate() {
            let expected = usize::from(j < jobs);
            assert_eq!(n.swap(0, Ordering::Relaxed), expected, "job {j} of {jobs}");
        }
    }
    // Not a timing claim: with three helpers asleep and woken for 300 reads, the crew is seen
    // to take part (on a loaded machine the reader may do nearly all of it, never all).
    assert!(
        by_helper.load(Ordering::Relaxed) > 0,
        "no helper ever ran a job"
    );
    crew.stop();
    for h in _helpers {
        h.join().expect("helper ends on stop");
    }
}

#[test]
fn without_helpers_or_a_free_seat_the_reader_does_everything() {
    let none = Crew::new(0, 4);
    let seat = none.seat();
    assert!(!seat.has_helpers());
    let crew = Crew::new(1, 1);
    let first = crew.seat();
    let second = crew.seat();
    assert!(
        first.has_helpers() && !second.has_helpers(),
        "one seat only"
    );
    let me = std::thread::current().id();
    for seat in [&seat, &second] {
        let ran = AtomicUsize::new(0);
        seat.run(10, &|_| {
            assert_eq!(std::thread::current().id(), me);
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 10);
    }
    // A seat given back is free again.
    drop(first);
    assert!(crew.seat().has_helpers());
}

#[test]
fn helpers_are_woken_only_while_a_core_is_free_of_busy_readers() {
    // Two helpers and a reader: three threads, three cores' worth.
    let crew = Crew::new(2, 4);
    let seats: Vec<Seat> = (0..4).map(|_| crew.seat()).collect();
    assert_eq!(
        seats[0].helpers_to_wake(2, 6),
        2,
        "nobody busy: every idle helper"
    );
    assert_eq!(
        seats[0].helpers_to_wake(2, 2),
        1,
        "no more than the jobs past the reader's"
    );
    assert_eq!(seats[0].helpers_to_wake(0, 6), 0, "none asleep");
    seats[0].set_busy(true);
    seats[1].set_busy(true);
    seats[1].set_busy(true); // counted once
    assert_eq!(
        seats[0].helpers_to_wake(2, 6),
        2,
        "two busy readers of three cores"
    );
    seats[2].set_busy(true);
    assert_eq!(
        seats[0].helpers_to_wake(2, 6),
        0,
        "every core taken by a reader"
    );
    seats[2].set_busy(false);
    assert_eq!(seats[0].helpers_to_wake(2, 6), 2);
    // A seat given back stops counting.
    drop(seats);
    assert_eq!(crew.shared.busy.load(Ordering::Relaxed), 0);
}

/// Two tunnels with a completed handshake: `a` sends, `b` receives.
fn established() -> (Tunnel, Tunnel, (Limiter, Limiter)) {
    let (ka, kb) = (SecretKey::generate(), SecretKey::generate());
    let la = Limiter::new(&ka.public_key(), &mut OsRng);
    let lb = Limiter::new(&kb.public_key(), &mut OsRng);
    let mut a = Tunnel::new(&ka, &kb.public_key(), None, None, 1, &la, Box::new(OsRng));
    let mut b = Tunnel::new(&kb, &ka.public_key(), None, None, 2, &lb, Box::new(OsRng));
    handshake(&mut a, &mut b);
    (a, b, (la, lb))
}

fn handshake(a: &mut Tunnel, b: &mut Tunnel) {
    let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (mut m1, mut m2, mut m3) = ([0u8; 256], [0u8; 256], [0u8; 256]);
    let Outcome::Network(init) = a.initiate(&mut m1) else {
        panic!("no initiation");
    };
    let Outcome::Network(response) = b.decapsulate(ip, init, &mut m2) else {
        panic!("no response");
    };
    let _ = a.decapsulate(ip, response, &mut m3);
}

/// An IPv4 packet of `len` bytes that says which segment it is.
fn make(i: usize, len: usize, dst: &mut [u8]) -> usize {
    dst[..len].fill(i as u8);
    dst[0] = 0x45;
    dst[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    len
}

/// Reserves `lens.len()` datagrams back to back in a buffer, as the send batch does.
fn layout(lens: &[usize]) -> (Vec<u8>, Vec<Sealing>) {
    let mut at = 0;
    let sealings = lens
        .iter()
        .enumerate()
        .map(|(message, len)| {
            let range = at..at + len + wg::OVERHEAD;
            at = range.end;
            Sealing { at: range, message }
        })
        .collect();
    (vec![0u8; at], sealings)
}

fn counter_of(datagram: &[u8]) -> u64 {
    u64::from_le_bytes(datagram[8..16].try_into().expect("8 bytes"))
}

/// Seals `sealings` on the crew, then opens them on `b` on the crew as they lie: returns the
/// counters in buffer order and how many opened.
fn seal_then_open(
    seat: &Seat,
    batch: &SealBatch,
    b: &Tunnel,
    buffer: &mut [u8],
    sealings: &mut [Sealing],
) -> (Vec<u64>, usize) {
    let lens: Vec<usize> = sealings.iter().map(|s| s.at.len() - wg::OVERHEAD).collect();
    seal_all(seat, batch, buffer, sealings, |i, dst| {
        make(i, lens[i], dst)
    });
    let counters = sealings
        .iter()
        .map(|s| counter_of(&buffer[s.at.clone()]))
        .collect();
    let mut openings: Vec<Opening<usize>> = sealings
        .iter()
        .map(|s| Opening {
            at: s.at.clone(),
            key: b.receiving(&buffer[s.at.clone()]),
            outcome: None,
            tag: s.message,
        })
        .collect();
    open_all(seat, buffer, &mut openings);
    let mut opened = 0;
    for o in &openings {
        let Some(Ok(done)) = &o.outcome else { continue };
        let plaintext = &buffer[o.at.start + wg::DATA_OFFSET..][..done.len];
        let mut expected = vec![0u8; lens[o.tag]];
        make(o.tag, lens[o.tag], &mut expected);
        assert_eq!(plaintext, &expected[..], "segment {}", o.tag);
        opened += 1;
    }
    (counters, opened)
}

#[test]
fn a_read_sealed_by_the_crew_is_in_counter_order_and_opens_exactly_once() {
    let crew = Crew::new(2, 2);
    let helpers = crew
        .spawn_helpers(|i| format!("t-{i}"), || {})
        .expect("helpers");
    let seat = crew.seat();
    let (mut a, b, _limiters) = established();
    for round in 0..50 {
        // A TSO read's shape: equal segments and a shorter last one.
        let mut lens = vec![1400; 45];
        lens.push(100 + round);
        let batch = a
            .reserve_send(lens.len(), lens.iter().sum())
            .expect("a session");
        let (mut buffer, mut sealings) = layout(&lens);
        let (counters, opened) = seal_then_open(&seat, &batch, &b, &mut buffer, &mut sealings);
        let first = batch.counter(0);
        let expected: Vec<u64> = (first..first + lens.len() as u64).collect();
        assert_eq!(counters, expected, "the wire order is the counter order");
        assert_eq!(opened, lens.len(), "every datagram opens");
        // Opened once: the same datagrams again are replays, whoever opens them.
        let mut openings: Vec<Opening<()>> = sealings
            .iter()
            .map(|s| Opening {
                at: s.at.clone(),
                key: b.receiving(&buffer[s.at.clone()]),
                outcome: None,
                tag: (),
            })
            .collect();
        open_all(&seat, &mut buffer, &mut openings);
        assert!(openings
            .iter()
            .all(|o| matches!(o.outcome, Some(Err(_)) | None)));
    }
    crew.stop();
    for h in helpers {
        h.join().expect("helper");
    }
}

#[test]
fn a_rekey_in_the_middle_of_a_parallel_batch_loses_nothing() {
    let crew = Crew::new(2, 2);
    let helpers = crew
        .spawn_helpers(|i| format!("t-{i}"), || {})
        .expect("helpers");
    let seat = crew.seat();
    let (mut a, mut b, _limiters) = established();
    let lens = vec![1200; 30];
    // Counters reserved on the old session, then a new handshake completes before the
    // batch is sealed: it is sealed with the session it was numbered on, and the receiver,
    // which keeps the previous session, opens all of it.
    let old = a.reserve_send(lens.len(), 0).expect("a session");
    handshake(&mut a, &mut b);
    let new = a.reserve_send(lens.len(), 0).expect("the new session");
    let mut sessions = Vec::new();
    for batch in [&old, &new] {
        let (mut buffer, mut sealings) = layout(&lens);
        let (counters, opened) = seal_then_open(&seat, batch, &b, &mut buffer, &mut sealings);
        assert_eq!(opened, lens.len());
        assert!(counters.windows(2).all(|w| w[1] == w[0] + 1));
        // The receiver's index the datagrams name: which session sealed them.
        sessions.push(u32::from_le_bytes(
            buffer[4..8].try_into().expect("4 bytes"),
        ));
    }
    assert_ne!(sessions[0], sessions[1], "the handshake made a new session");
    crew.stop();
    for h in helpers {
        h.join().expect("helper");
    }
}

#[test]
fn overlapping_or_unordered_ranges_are_refused() {
    let crew = Crew::new(0, 1);
    let seat = crew.seat();
    let mut buffer = vec![0u8; 100];
    let mut openings: Vec<Opening<()>> = [0..50, 40..90]
        .into_iter()
        .map(|at| Opening {
            at,
            key: None,
            outcome: None,
            tag: (),
        })
        .collect();
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        open_all(&seat, &mut buffer, &mut openings)
    }));
    assert!(refused.is_err());
}
