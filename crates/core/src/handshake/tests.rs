//! Tests of the handshake path's decisions: under load from the queue's depth, held a second;
//! the per-source limit's burst, rate, /64 grouping and bounded memory; a reader's decisions
//! under load (proven sources charged, the others answered from the cookie budgets).

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

/// A message's macs, as a test hands them to [`Gate::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Macs {
    /// mac1 and mac2 valid: the source proved its address.
    Proven,
    /// mac1 valid, no cookie: what a new peer sends first, and what anyone can make from the
    /// interface's public key, from any source address it spoofs.
    Mac1Only,
    /// mac1 wrong: garbage.
    BadMac1,
}

fn admit(gate: &mut Gate, shared: &Shared, source: IpAddr, macs: Macs, at: Instant) -> Admit {
    gate.admit(
        shared,
        source,
        at,
        || macs == Macs::Proven,
        || macs != Macs::BadMac1,
    )
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// A victim's address spoofed at any rate, with garbage or with a valid mac1, costs the victim
/// nothing of its share: its proven messages then get the whole burst at once, as a source
/// that never sent anything would. (The design this replaced charged every handshake message
/// to its source before any mac: the victim's share was empty.)
#[test]
fn an_unproven_source_is_never_charged() {
    let now = t0();
    let shared = Shared::new(now);
    let mut gate = Gate::new();
    let victim = v4(192, 0, 2, 1);
    let mut answers = Vec::new();
    for i in 0..10_000u64 {
        let at = now + Duration::from_micros(i * 100);
        for macs in [Macs::Mac1Only, Macs::BadMac1] {
            answers.push(admit(&mut gate, &shared, victim, macs, at));
        }
    }
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Admit::Cookie | Admit::Limited | Admit::Invalid)),
        "nothing unproven is queued"
    );
    assert!(answers.contains(&Admit::Invalid) && answers.contains(&Admit::Cookie));
    assert_eq!(gate.charged_sources(), 0, "no source was charged");
    let at = now + Duration::from_secs(1);
    let queued = (0..50)
        .filter(|_| admit(&mut gate, &shared, victim, Macs::Proven, at) == Admit::Queue)
        .count();
    assert_eq!(
        queued, PER_SOURCE_BURST as usize,
        "the victim's whole burst"
    );
}

proptest! {
    /// Whatever a spoofer sends from a victim's address (garbage, valid mac1s, at any times,
    /// mixed with other sources), the victim is never worse off than in the design without
    /// reserves: each time that design would queue the victim's message or answer it with a
    /// cookie, this one does too. (Its reserve is drawn only once the budget every source
    /// shares is spent, and a draw takes nothing from that budget.)
    #[test]
    fn a_spoofer_cannot_make_a_source_worse_off_than_the_global_budget(
        events in proptest::collection::vec((0u64..3_000, 0u8..4, 0u8..3), 1..3_000)
    ) {
        let start = t0();
        let (with, without) = (Shared::new(start), Shared::new(start));
        let (mut gate, mut plain) = (Gate::new(), Gate::without_reserves());
        let victim = v4(192, 0, 2, 1);
        let mut at = start;
        for (gap, who, kind) in events {
            at += Duration::from_micros(gap);
            let macs = [Macs::Mac1Only, Macs::BadMac1, Macs::Proven][usize::from(kind)];
            // who 0: the victim itself; 1: a spoofer of its address (never proven); 2, 3:
            // other sources.
            let (source, macs) = match who {
                0 => (victim, macs),
                1 => (victim, if macs == Macs::Proven { Macs::Mac1Only } else { macs }),
                n => (v4(198, 51, 100, n), macs),
            };
            let a = admit(&mut gate, &with, source, macs, at);
            let b = admit(&mut plain, &without, source, macs, at);
            if who == 0 && b != Admit::Limited {
                prop_assert_eq!(a, b, "the victim at {:?}", at.duration_since(start));
            }
        }
    }

    /// However many sources a flood names (spoofed at random: any number), the cookie replies
    /// are bounded by the two budgets, and the tables keep their size. (Without a budget over
    /// the reserves, each new source's reserve would be a reply more.)
    #[test]
    fn spoofed_sources_get_no_more_cookie_replies_than_the_budgets(
        sources in proptest::collection::vec(any::<u32>(), 1..20_000)
    ) {
        let start = t0();
        let shared = Shared::new(start);
        let mut gate = Gate::new();
        let mut cookies = 0u64;
        let mut at = start;
        for s in &sources {
            at += Duration::from_micros(10);
            if admit(&mut gate, &shared, IpAddr::V4(Ipv4Addr::from(*s)), Macs::Mac1Only, at) == Admit::Cookie {
                cookies += 1;
            }
        }
        let secs = at.duration_since(start).as_secs_f64();
        let bound = COOKIE_REPLIES_BURST as f64 + COOKIE_REPLIES_PER_SECOND as f64 * secs
            + RESERVES_PER_SECOND as f64 * (1.0 + secs);
        prop_assert!(cookies as f64 <= bound + 1.0, "{} > {}", cookies, bound);
        prop_assert_eq!(gate.charged_sources(), 0);
    }

    /// The interface's budget: its burst at once, then its rate, never more over any run.
    #[test]
    fn a_shared_bucket_gives_its_burst_then_its_rate(
        gaps in proptest::collection::vec(0u64..2_000, 1..2_000)
    ) {
        let start = t0();
        let bucket = SharedBucket::new(start, 1_000, 10);
        prop_assert_eq!((0..50).filter(|_| bucket.take(start)).count(), 10);
        let mut at = start;
        let mut taken = 10u64;
        for gap in gaps {
            at += Duration::from_micros(gap);
            let available = bucket.available(at);
            let took = bucket.take(at);
            prop_assert_eq!(available, took, "available says what take does");
            taken += u64::from(took);
        }
        let bound = 10.0 + 1_000.0 * at.duration_since(start).as_secs_f64();
        prop_assert!(taken as f64 <= bound + 1e-9, "{} > {}", taken, bound);
    }
}

/// Sixty-four sources flooding initiations with a valid mac1 at 10,000 a second each spend the
/// interface's budget of cookie replies; a new peer among them still gets a cookie reply for
/// its first initiation (from its reserve), and its retry with mac2 5 s later is queued.
#[test]
fn flooding_sources_leave_a_newcomer_its_cookie_and_its_retry() {
    let now = t0();
    let shared = Shared::new(now);
    let mut gate = Gate::new();
    let flooders: Vec<IpAddr> = (0..64).map(|i| v4(198, 51, 100, i)).collect();
    let newcomer = v4(203, 0, 113, 7);
    let mut cookies = 0u64;
    let mut newcomer_got = Vec::new();
    // 10 s, every 100 us each flooder sends one.
    for tick in 0..100_000u64 {
        let at = now + Duration::from_micros(tick * 100);
        for f in &flooders {
            cookies +=
                u64::from(admit(&mut gate, &shared, *f, Macs::Mac1Only, at) == Admit::Cookie);
        }
        match tick {
            15_000 => newcomer_got.push(admit(&mut gate, &shared, newcomer, Macs::Mac1Only, at)),
            65_000 => newcomer_got.push(admit(&mut gate, &shared, newcomer, Macs::Proven, at)),
            _ => {}
        }
    }
    assert_eq!(newcomer_got, [Admit::Cookie, Admit::Queue]);
    // The flooders: the budget and their reserves, no more.
    let bound = COOKIE_REPLIES_BURST
        + 10 * COOKIE_REPLIES_PER_SECOND
        + 64 * (u64::from(RESERVE_BURST) + 10 * u64::from(RESERVE_PER_SECOND));
    assert!(cookies <= bound, "{cookies} > {bound}");
    assert_eq!(
        gate.charged_sources(),
        1,
        "the newcomer alone, once it proved itself"
    );
}

/// A burst makes the queue deep: under load. Then a flood that is refused, answered with
/// cookies or dropped as garbage, however long, keeps nothing in the queue, and the interface
/// is no longer under load once the hold after the last deep look is over. (The design this
/// replaced counted each refusal as a full queue: a flood at any rate kept it on, and with it
/// the refusals.)
#[test]
fn under_load_ends_after_the_queue_drains_whatever_the_refusals() {
    let now = t0();
    let shared = Shared::new(now);
    let mut load = UnderLoad::default();
    let mut gate = Gate::new();
    shared.queued(QUEUE_CAPACITY / 8);
    assert!(
        shared.under_load(),
        "a reader that pushed it deep says so at once"
    );
    assert!(shared.observe(&mut load, QUEUE_CAPACITY / 8, now));
    let victim = v4(192, 0, 2, 1);
    let mut refused = 0;
    let mut under_load_until = now;
    // 5 s: every millisecond forty messages spoofed from one address (20,000 a second with a
    // valid mac1, past the cookie budget; all refused or answered, none queued), and every
    // 10 ms the handshake thread's look at an empty queue.
    for ms in 1..5_000u64 {
        let at = now + Duration::from_millis(ms);
        for i in 0..40 {
            let macs = if i % 2 == 0 {
                Macs::Mac1Only
            } else {
                Macs::BadMac1
            };
            let a = admit(&mut gate, &shared, victim, macs, at);
            assert_ne!(a, Admit::Queue);
            refused += u32::from(a == Admit::Limited);
        }
        if ms % 10 == 0 && shared.observe(&mut load, 0, at) {
            under_load_until = at;
        }
    }
    assert!(refused > 40_000, "the flood was refused: {refused}");
    assert!(
        under_load_until < now + UNDER_LOAD_HOLD,
        "under load until {:?}",
        under_load_until.duration_since(now)
    );
    assert!(!shared.under_load());
}

/// A GRO train is decided once its source is found with nothing to give at the batch's instant:
/// its next messages cost neither a MAC nor the tables. That never refuses what the tables
/// would give: a proven message from a source with a share left is still queued, at the same
/// instant, and once time moves the budget answers again.
#[test]
fn a_train_with_nothing_left_is_refused_at_once_but_never_its_proof() {
    let now = t0();
    let shared = Shared::new(now);
    let mut gate = Gate::new();
    while shared.cookies.take(now) {}
    let source = v4(192, 0, 2, 1);
    let mut answers = Vec::new();
    for _ in 0..(RESERVE_BURST + 5) {
        answers.push(admit(&mut gate, &shared, source, Macs::Mac1Only, now));
    }
    assert_eq!(
        answers.iter().filter(|a| **a == Admit::Cookie).count(),
        RESERVE_BURST as usize
    );
    let refused = gate.admit(
        &shared,
        source,
        now,
        || false,
        || panic!("mac1 with nothing to give"),
    );
    assert_eq!(refused, Admit::Limited);
    assert_eq!(
        admit(&mut gate, &shared, source, Macs::Proven, now),
        Admit::Queue,
        "its proof"
    );
    assert_eq!(
        admit(&mut gate, &shared, source, Macs::Mac1Only, now),
        Admit::Limited
    );
    let later = now + Duration::from_millis(1);
    assert_eq!(
        admit(&mut gate, &shared, source, Macs::Mac1Only, later),
        Admit::Cookie,
        "the budget refilled"
    );
}

#[test]
fn shares_count_an_ipv6_64_as_one_source_and_mapped_v4_as_v4() {
    let now = t0();
    let shared = Shared::new(now);
    let mut gate = Gate::new();
    let host = |n: u16| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, n));
    // Hosts of one /64 share one bucket: the burst, then nothing at the same instant.
    let queued = (0..100)
        .filter(|n| admit(&mut gate, &shared, host(*n), Macs::Proven, now) == Admit::Queue)
        .count();
    assert_eq!(queued, PER_SOURCE_BURST as usize);
    // Another /64 is its own source.
    let other = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 1));
    assert_eq!(
        admit(&mut gate, &shared, other, Macs::Proven, now),
        Admit::Queue
    );
    // A v4-mapped address is its IPv4 source.
    let v4 = v4(192, 0, 2, 9);
    let mapped = IpAddr::V6(Ipv4Addr::new(192, 0, 2, 9).to_ipv6_mapped());
    let taken = (0..PER_SOURCE_BURST)
        .filter(|_| admit(&mut gate, &shared, v4, Macs::Proven, now) == Admit::Queue)
        .count();
    assert_eq!(taken, PER_SOURCE_BURST as usize);
    assert_ne!(
        admit(&mut gate, &shared, mapped, Macs::Proven, now),
        Admit::Queue,
        "the same source, out of tokens"
    );
}

/// mac2 is checked only when the message could be queued, and mac1 only before something is
/// given or charged: a source past its share costs no MAC, and once both cookie budgets are
/// spent neither does a message without a cookie.
#[test]
fn macs_are_checked_only_when_the_answer_matters() {
    let now = t0();
    let shared = Shared::new(now);
    let mut gate = Gate::new();
    let source = v4(192, 0, 2, 1);
    for _ in 0..PER_SOURCE_BURST {
        assert_eq!(
            admit(&mut gate, &shared, source, Macs::Proven, now),
            Admit::Queue
        );
    }
    let spent = gate.admit(
        &shared,
        source,
        now,
        || panic!("mac2 past the share"),
        || true,
    );
    assert_eq!(spent, Admit::Cookie, "treated as without a cookie");
    while shared.cookies.take(now) {}
    while shared.reserves.take(now) {}
    let other = v4(192, 0, 2, 2);
    let none = gate.admit(
        &shared,
        other,
        now,
        || false,
        || panic!("mac1 with nothing to give"),
    );
    assert_eq!(none, Admit::Limited);
    let garbage = gate.admit(&shared, other, now, || true, || false);
    assert_eq!(
        garbage,
        Admit::Invalid,
        "a valid mac2 with a bad mac1 charges no one"
    );
    assert_eq!(gate.charged_sources(), 1);
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
