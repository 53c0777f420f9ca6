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
