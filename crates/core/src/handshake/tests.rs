//! Tests of the handshake path's decisions: under load from the queue's depth, held a second;
//! the per-source limit's burst, rate, /64 grouping and bounded memory.

use super::*;
use proptest::prelude::*;
use std::net::{Ipv4Addr, Ipv6Addr};

fn t0() -> Instant {
    crate::test_util::now()
}

#[test]
fn under_load_from_an_eighth_of_the_queue_and_held_a_second() {
    let now = t0();
    let mut load = UnderLoad::default();
    assert!(!load.observe(QUEUE_CAPACITY / 8 - 1, QUEUE_CAPACITY, now));
    assert!(load.observe(QUEUE_CAPACITY / 8, QUEUE_CAPACITY, now));
    // The queue drains: still under load for the hold, then not.
    let later = now + Duration::from_millis(999);
    assert!(load.observe(0, QUEUE_CAPACITY, later));
    assert!(!load.observe(0, QUEUE_CAPACITY, now + UNDER_LOAD_HOLD));
}

#[test]
fn a_source_gets_its_burst_then_its_rate() {
    let now = t0();
    let mut limiter = SourceLimiter::new();
    let source = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let allowed = (0..100).filter(|_| limiter.allow(source, now)).count();
    assert_eq!(allowed, PER_SOURCE_BURST as usize);
    // Over one more second at 1,000 tries a second: the rate, no more.
    let allowed = (1..=1000)
        .filter(|ms| limiter.allow(source, now + Duration::from_millis(*ms)))
        .count();
    assert_eq!(allowed, PER_SOURCE_PER_SECOND as usize);
}

#[test]
fn one_flooding_source_does_not_limit_another() {
    let now = t0();
    let mut limiter = SourceLimiter::new();
    let flooder = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let other = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2));
    for _ in 0..1000 {
        limiter.allow(flooder, now);
    }
    assert!(limiter.allow(other, now));
}

#[test]
fn ipv6_sources_count_per_64_and_mapped_v4_as_v4() {
    let now = t0();
    let mut limiter = SourceLimiter::new();
    let a: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap_or(Ipv6Addr::LOCALHOST);
    let b: Ipv6Addr = "2001:db8:1:2:ffff::9"
        .parse()
        .unwrap_or(Ipv6Addr::LOCALHOST);
    let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap_or(Ipv6Addr::LOCALHOST);
    for _ in 0..PER_SOURCE_BURST {
        assert!(limiter.allow(IpAddr::V6(a), now));
    }
    // Same /64: the bucket is shared and empty.
    assert!(!limiter.allow(IpAddr::V6(b), now));
    // Another /64: its own bucket.
    assert!(limiter.allow(IpAddr::V6(c), now));
    assert_eq!(
        SourceKey::of(IpAddr::V6(Ipv4Addr::new(192, 0, 2, 7).to_ipv6_mapped())),
        SourceKey::of(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)))
    );
}

#[test]
fn refilled_sources_are_forgotten() {
    let now = t0();
    let mut limiter = SourceLimiter::new();
    for i in 0..100u8 {
        limiter.allow(IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)), now);
    }
    assert_eq!(limiter.sources(), 100);
    // Long after: every bucket is full again, and the next call sweeps them.
    limiter.allow(
        IpAddr::V4(Ipv4Addr::new(10, 0, 1, 1)),
        now + Duration::from_secs(5),
    );
    assert_eq!(limiter.sources(), 1);
}

#[test]
fn memory_is_bounded_and_known_sources_keep_working() {
    let now = t0();
    let mut limiter = SourceLimiter::new();
    let known = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
    assert!(limiter.allow(known, now));
    for i in 0..(MAX_SOURCES as u32 + 10) {
        limiter.allow(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)), now);
    }
    assert!(limiter.sources() <= MAX_SOURCES);
    assert!(limiter.allow(known, now));
}

proptest! {
    /// Whatever the pattern of tries, a source never gets more than its burst plus the rate
    /// over the time that passed.
    #[test]
    fn never_more_than_burst_plus_rate(gaps in proptest::collection::vec(0u64..200_000, 1..500)) {
        let start = t0();
        let mut limiter = SourceLimiter::new();
        let source = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9));
        let mut now = start;
        let mut allowed = 0u64;
        for gap in gaps {
            now += Duration::from_micros(gap);
            if limiter.allow(source, now) {
                allowed += 1;
            }
        }
        let elapsed = now.duration_since(start).as_secs_f64();
        let bound = f64::from(PER_SOURCE_BURST) + f64::from(PER_SOURCE_PER_SECOND) * elapsed;
        prop_assert!(allowed as f64 <= bound + 1e-9, "{} > {}", allowed, bound);
    }
}

/// Sixty-four sources flooding at 10,000 messages a second each get their share and no more,
/// and a newcomer among them gets its first message in, and its retry 5 s later: the two a
/// new peer needs (an initiation answered with a cookie, then the retry with mac2).
#[test]
fn flooding_sources_get_their_share_and_a_newcomer_its_initiation_and_retry() {
    let now = t0();
    let mut admission = Admission::new();
    let flooders: Vec<IpAddr> = (0..64)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 51, 100, i)))
        .collect();
    let newcomer = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));
    let mut admitted = 0usize;
    let mut newcomer_in = Vec::new();
    // 10 s, every 100 µs each flooder sends one.
    for tick in 0..100_000u64 {
        let at = now + Duration::from_micros(tick * 100);
        for f in &flooders {
            admitted += usize::from(admission.admit(*f, at));
        }
        if tick % 50_000 == 15_000 {
            newcomer_in.push(admission.admit(newcomer, at));
        }
    }
    // Each flooder: its burst and 20 a second for 10 s, and not one more.
    let share = 64 * (PER_SOURCE_BURST as usize + 10 * PER_SOURCE_PER_SECOND as usize);
    assert!(admitted <= share, "{admitted} > {share}");
    assert!(admitted >= share - 64, "{admitted}: the share is given");
    assert_eq!(newcomer_in, [true, true], "the initiation and its retry");
}

#[test]
fn admission_counts_an_ipv6_64_as_one_source_and_forgets_nothing_it_needs() {
    let now = t0();
    let mut admission = Admission::new();
    let host = |n: u16| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, n));
    // Hosts of one /64 share one bucket: the burst, then nothing at the same instant.
    let admitted = (0..100).filter(|n| admission.admit(host(*n), now)).count();
    assert_eq!(admitted, PER_SOURCE_BURST as usize);
    // Another /64 is its own source.
    let other = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 1));
    assert!(admission.admit(other, now));
    // A v4-mapped address is its IPv4 source.
    let v4 = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));
    let mapped = IpAddr::V6(Ipv4Addr::new(192, 0, 2, 9).to_ipv6_mapped());
    let taken = (0..PER_SOURCE_BURST)
        .filter(|_| admission.admit(v4, now))
        .count();
    assert_eq!(taken, PER_SOURCE_BURST as usize);
    assert!(
        !admission.admit(mapped, now),
        "the same source, out of tokens"
    );
}

proptest! {
    /// However many sources (spoofed ones: any number), the table stays its fixed size and a
    /// source admitted in a burst never gets more than its burst at one instant.
    #[test]
    fn admission_is_bounded_whatever_the_sources(sources in proptest::collection::vec(any::<u32>(), 1..5000)) {
        let now = t0();
        let mut admission = Admission::new();
        for s in &sources {
            admission.admit(IpAddr::V4(Ipv4Addr::from(*s)), now);
        }
        prop_assert!(admission.sources() <= ADMISSION_SLOTS);
        let one = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let burst = (0..50).filter(|_| admission.admit(one, now)).count();
        prop_assert!(burst <= PER_SOURCE_BURST as usize);
    }
}

#[test]
fn a_reader_naps_only_after_a_drained_batch_of_nothing_but_a_flood_under_load() {
    assert_eq!(flood_nap(true, true, 64, 64), Some(FLOOD_NAP));
    assert_eq!(flood_nap(false, true, 64, 64), None, "not under load");
    assert_eq!(
        flood_nap(true, false, 64, 64),
        None,
        "the socket has more waiting"
    );
    assert_eq!(
        flood_nap(true, true, 64, 63),
        None,
        "one datagram authenticated"
    );
    assert_eq!(flood_nap(true, true, 0, 0), None, "an empty batch");
}
