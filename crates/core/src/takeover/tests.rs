use super::*;
use crate::test_util::now;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 7], port))
}

fn path(port: u16) -> PeerPath {
    PeerPath::to(addr(port))
}

fn data(len: usize) -> Vec<u8> {
    let mut d = vec![0u8; len];
    d[0] = DATA_TYPE;
    d
}

#[test]
fn only_a_data_message_is_a_cue() {
    assert!(is_data(&data(32)));
    assert!(!is_data(&data(31)), "too short");
    let mut response = data(92);
    response[0] = 2;
    assert!(!is_data(&response), "a response answers our own initiation");
}

/// The attack this guards against: the cue's source is an off-path attacker's address; a
/// fresh initiation sent there would be relayed to the peer, which would move its endpoint to
/// the attacker. The initiation goes to where the peer authenticated, or nowhere.
#[test]
fn a_takeover_goes_to_a_known_endpoint_never_to_an_unproven_source() {
    let attacker = path(6666);
    let mut known = KnownEndpoints::default();
    assert_eq!(
        target(attacker, None, &known, Answer::KnownEndpoints),
        None,
        "nothing known: the peer waits for its own rekey"
    );
    known.set_configured(Some(addr(51820)));
    assert_eq!(
        target(attacker, None, &known, Answer::KnownEndpoints),
        Some(path(51820)),
        "the configured endpoint"
    );
    known.learn(addr(3000), Origin::Authenticated);
    known.learn(addr(4000), Origin::Restored);
    assert_eq!(
        target(attacker, None, &known, Answer::KnownEndpoints),
        Some(path(4000)),
        "the newest learned endpoint before the configured one"
    );
    assert_eq!(
        target(path(3000), None, &known, Answer::KnownEndpoints),
        Some(path(4000)),
        "an endpoint the peer has left is not answered: it may be someone else's now"
    );
    let cue = path(4000);
    assert_eq!(
        target(cue, None, &known, Answer::KnownEndpoints),
        Some(cue),
        "a cue from a known endpoint is answered there"
    );
    assert_eq!(
        target(attacker, None, &known, Answer::AnySource),
        Some(attacker),
        "only the opt-in answers any source"
    );
    // The local address the peer was last reached from goes with its endpoint.
    let reached = PeerPath {
        remote: addr(4000),
        local: Some([198, 51, 100, 1].into()),
    };
    assert_eq!(
        target(attacker, Some(reached), &known, Answer::KnownEndpoints),
        Some(reached)
    );
}

#[test]
fn known_endpoints_keep_the_newest_and_the_closest_origin() {
    let mut known = KnownEndpoints::default();
    assert_eq!(known.newest(), None);
    assert!(known.learn(addr(1), Origin::Group));
    assert!(
        known.learn(addr(2), Origin::Restored),
        "a newer one replaces it"
    );
    assert!(
        !known.contains(addr(1)),
        "an endpoint the peer left is no proof"
    );
    assert!(known.learn(addr(2), Origin::Authenticated), "closer");
    assert!(
        !known.learn(addr(2), Origin::Group),
        "the same, told from further"
    );
    assert_eq!(
        known.newest(),
        Some(Learned {
            addr: addr(2),
            origin: Origin::Authenticated
        })
    );
}

#[test]
fn one_request_per_peer_per_rekey_timeout() {
    let t0 = now();
    let mut state = TakeoverState::default();
    assert!(state.request(path(1), t0, None));
    assert!(
        !state.request(path(2), t0, None),
        "one hand-over per takeover"
    );
    let mut known = KnownEndpoints::configured(Some(addr(1)));
    assert_eq!(
        state.start(t0, None, &known, Answer::KnownEndpoints),
        Start::Initiate { to: path(1) }
    );
    assert!(!state.request(path(3), t0, Some(t0)), "started");
    // Settled, the next request waits out REKEY_TIMEOUT from the last start.
    assert_eq!(
        state.settle(t0 + REKEY_TIMEOUT, None),
        Settle::Failed { to: path(1) }
    );
    let soon = t0 + REKEY_TIMEOUT - Duration::from_millis(1);
    assert!(!state.request(path(1), soon, Some(t0)));
    assert!(state.request(path(1), t0 + REKEY_TIMEOUT, Some(t0)));
    // With nothing known the request ends without a send.
    known = KnownEndpoints::default();
    assert_eq!(
        state.start(t0 + REKEY_TIMEOUT, None, &known, Answer::KnownEndpoints),
        Start::NoKnownEndpoint { cue: path(1) }
    );
    assert_eq!(state, TakeoverState::Idle);
    // A withdrawn request (the hand-off was full) may be asked again at once.
    assert!(state.request(path(1), t0 + REKEY_TIMEOUT, None));
    state.withdraw();
    assert!(state.request(path(1), t0 + REKEY_TIMEOUT, None));
}

#[test]
fn a_started_takeover_completes_on_any_later_handshake_or_fails_after_rekey_timeout() {
    let t0 = now();
    let known = KnownEndpoints::configured(Some(addr(1)));
    let mut state = TakeoverState::default();
    assert_eq!(
        state.settle(t0, Some(t0)),
        Settle::Pending,
        "nothing started"
    );
    state.request(path(1), t0, None);
    state.start(t0, None, &known, Answer::KnownEndpoints);
    let before = t0.checked_sub(Duration::from_secs(1)).expect("clock");
    assert_eq!(
        state.settle(t0 + Duration::from_millis(50), Some(before)),
        Settle::Pending,
        "a handshake older than the takeover is not its completion"
    );
    assert_eq!(
        state.settle(
            t0 + Duration::from_millis(80),
            Some(t0 + Duration::from_millis(37))
        ),
        Settle::Completed {
            to: path(1),
            after: Duration::from_millis(37)
        }
    );
    assert_eq!(state, TakeoverState::Idle);
}
