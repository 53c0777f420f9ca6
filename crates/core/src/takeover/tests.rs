use super::*;
use crate::test_util::now;

fn path(port: u16) -> PeerPath {
    PeerPath::to(std::net::SocketAddr::from(([192, 0, 2, 7], port)))
}

fn data(len: usize) -> Vec<u8> {
    let mut d = vec![0u8; len];
    d[0] = DATA_TYPE;
    d
}

#[test]
fn the_bucket_allows_its_rate_and_refills() {
    let t0 = now();
    let mut bucket = TokenBucket::new(10);
    let burst = (0..100).filter(|_| bucket.take(t0)).count();
    assert_eq!(burst, 10, "a full bucket is one second's worth");
    assert!(!bucket.take(t0 + Duration::from_millis(50)));
    assert!(bucket.take(t0 + Duration::from_millis(150)));
    // Over ten seconds of constant asking, about ten per second get through.
    let mut allowed = 0;
    for ms in (200..10_200).step_by(1) {
        if bucket.take(t0 + Duration::from_millis(ms)) {
            allowed += 1;
        }
    }
    assert!((99..=101).contains(&allowed), "{allowed}");
    assert!(!TokenBucket::new(0).take(t0));
}

#[test]
fn only_a_data_message_from_a_source_without_a_live_session_wants_a_takeover() {
    let from = path(1000);
    let fresh = Some(Duration::from_secs(3));
    assert!(
        wants_takeover(&data(32), from, None, None),
        "no session at all"
    );
    assert!(
        wants_takeover(&data(32), from, Some(path(2000)), fresh),
        "another source"
    );
    assert!(
        wants_takeover(&data(32), from, Some(from), Some(SESSION_LIFETIME)),
        "an expired session"
    );
    assert!(
        !wants_takeover(&data(32), from, Some(from), fresh),
        "a stale message"
    );
    assert!(!wants_takeover(&data(31), from, None, None), "too short");
    let mut response = data(92);
    response[0] = 2;
    assert!(!wants_takeover(&response, from, None, None), "not data");
}

#[test]
fn a_request_starts_once_then_completes_or_fails() {
    let t0 = now();
    let mut bucket = TokenBucket::new(GLOBAL_PER_SECOND);
    let mut state = TakeoverState::default();
    assert!(state.request(path(1)));
    assert!(!state.request(path(2)), "one wake per takeover");
    assert_eq!(
        state.due(t0, None, None, &mut bucket),
        TakeoverStep::Initiate(path(1)),
        "to the first source"
    );
    assert!(!state.request(path(3)), "started: nothing more to ask");
    let later = t0 + Duration::from_millis(250);
    assert_eq!(
        state.due(later, Some(t0), None, &mut bucket),
        TakeoverStep::Nothing
    );
    assert_eq!(
        state.due(
            later,
            Some(t0),
            Some(t0 + Duration::from_millis(200)),
            &mut bucket
        ),
        TakeoverStep::Completed {
            to: path(1),
            after: Duration::from_millis(200)
        }
    );
    assert_eq!(state, TakeoverState::Idle);

    // A handshake older than the initiation does not complete it; REKEY_TIMEOUT fails it.
    assert!(state.request(path(1)));
    let t1 = t0 + REKEY_TIMEOUT;
    assert_eq!(
        state.due(t1, Some(t0), None, &mut bucket),
        TakeoverStep::Initiate(path(1))
    );
    let old = Some(t0);
    assert_eq!(
        state.due(t1 + Duration::from_secs(1), Some(t1), old, &mut bucket),
        TakeoverStep::Nothing
    );
    assert_eq!(
        state.due(t1 + REKEY_TIMEOUT, Some(t1), old, &mut bucket),
        TakeoverStep::Failed(path(1))
    );
}

#[test]
fn one_takeover_per_peer_per_rekey_timeout_and_the_global_cap() {
    let t0 = now();
    let mut bucket = TokenBucket::new(GLOBAL_PER_SECOND);
    let mut state = TakeoverState::default();
    state.request(path(1));
    let soon = t0 + Duration::from_secs(1);
    assert_eq!(
        state.due(soon, Some(t0), None, &mut bucket),
        TakeoverStep::Nothing,
        "the previous one started a second ago"
    );
    assert!(
        matches!(state, TakeoverState::Requested(_)),
        "kept for later"
    );
    assert_eq!(
        state.due(t0 + REKEY_TIMEOUT, Some(t0), None, &mut bucket),
        TakeoverStep::Initiate(path(1))
    );

    // Many peers asking at once: no more than the cap leave in any second.
    let mut peers = vec![TakeoverState::default(); 1000];
    for p in &mut peers {
        p.request(path(9));
    }
    let mut bucket = TokenBucket::new(GLOBAL_PER_SECOND);
    let mut sent = 0;
    for tick in 0..10u64 {
        let at = t0 + Duration::from_millis(100 * tick);
        for p in &mut peers {
            if let TakeoverStep::Initiate(_) = p.due(at, None, None, &mut bucket) {
                sent += 1;
            }
        }
    }
    let cap = GLOBAL_PER_SECOND as usize;
    assert!(
        sent <= 2 * cap,
        "{sent} in one second (burst {cap} + refill {cap})"
    );
    assert!(sent >= cap, "the cap is used: {sent}");
}
