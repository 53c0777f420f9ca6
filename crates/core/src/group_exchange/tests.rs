use super::*;
use crate::test_util::now;

const T: u64 = 1_800_000_000_000;

fn entries(n: usize) -> Vec<Entry> {
    (0..n)
        .map(|i| Entry {
            peer: PublicKey([i as u8; 32]),
            endpoint: if i % 2 == 0 {
                SocketAddr::from(([192, 0, 2, i as u8], 51820 + i as u16))
            } else {
                SocketAddr::new("2001:db8::7".parse().expect("v6"), 4000 + i as u16)
            },
        })
        .collect()
}

fn pair() -> (Exchange, Exchange) {
    let key = SecretKey([3u8; 32]);
    (Exchange::new(&key, 1), Exchange::new(&key, 2))
}

#[test]
fn a_replica_of_the_same_identity_reads_what_another_told_once() {
    let (mut a, mut b) = pair();
    let told = entries(ENTRIES_PER_DATAGRAM + 3);
    let datagrams = a.seal(Kind::News, &told, T);
    assert_eq!(datagrams.len(), 2, "split to fit");
    assert!(datagrams.iter().all(|d| d.len() <= MAX_DATAGRAM));
    let t = now();
    let mut got = Vec::new();
    for d in &datagrams {
        let m = b.open(d, T + 500, t).expect("opens");
        assert_eq!((m.sender, m.kind), (1, Kind::News));
        got.extend(m.entries);
    }
    assert_eq!(got, told);
    // A replay of either, at once or later: refused.
    for d in &datagrams {
        assert_eq!(b.open(d, T + 900, t), Err(Refusal::Replayed));
    }
    let hello = a.seal(Kind::Hello, &[], T);
    assert_eq!(hello.len(), 1);
    let m = b.open(&hello[0], T, t).expect("a hello");
    assert_eq!((m.kind, m.entries.len()), (Kind::Hello, 0));
}

/// Anyone else on the pod network: without the identity's private key, nothing it sends is
/// taken, whatever it forges; and what it captured is taken at most once, within MAX_AGE.
#[test]
fn a_stranger_can_neither_inject_nor_replay() {
    let (mut a, mut b) = pair();
    let t = now();
    let mut stranger = Exchange::new(&SecretKey([4u8; 32]), 9);
    let forged = stranger.seal(Kind::News, &entries(1), T);
    assert_eq!(b.open(&forged[0], T, t), Err(Refusal::Forged));
    // A genuine message with one bit flipped anywhere: refused as forged or malformed.
    let genuine = a.seal(Kind::News, &entries(2), T).remove(0);
    for i in 0..genuine.len() {
        let mut flipped = genuine.clone();
        flipped[i] ^= 0x10;
        let r = b.open(&flipped, T, t);
        assert!(
            matches!(
                r,
                Err(Refusal::Forged | Refusal::Malformed | Refusal::Stale | Refusal::Own)
            ),
            "byte {i}: {r:?}"
        );
    }
    assert!(b.open(&genuine, T, t).is_ok(), "the genuine one, once");
    // A captured message replayed after MAX_AGE is stale, even to a replica that never saw it.
    let late = a.seal(Kind::News, &entries(1), T).remove(0);
    let (_, mut fresh) = pair();
    assert_eq!(
        fresh.open(&late, T + MAX_AGE.as_millis() as u64 + 1, t),
        Err(Refusal::Stale)
    );
    // Its own messages, back through the group's name, are not news.
    let own = b.seal(Kind::News, &entries(1), T).remove(0);
    assert_eq!(b.open(&own, T, t), Err(Refusal::Own));
    for garbage in [
        &[][..],
        b"TGX1",
        &[0u8; 1300][..],
        &genuine[..genuine.len() - 1],
    ] {
        assert_eq!(b.open(garbage, T, t), Err(Refusal::Malformed));
    }
}

#[test]
fn messages_reordered_within_the_window_are_taken_once_each() {
    let (mut a, mut b) = pair();
    let t = now();
    let sent: Vec<Vec<u8>> = (0..70)
        .map(|_| a.seal(Kind::News, &entries(1), T).remove(0))
        .collect();
    // The newest first, then the 63 before it in any order: taken; older ones are refused.
    assert!(b.open(&sent[69], T, t).is_ok());
    for d in sent[6..69].iter().rev() {
        assert!(b.open(d, T, t).is_ok());
    }
    assert_eq!(
        b.open(&sent[5], T, t),
        Err(Refusal::Replayed),
        "past the window"
    );
    assert_eq!(b.open(&sent[40], T, t), Err(Refusal::Replayed), "twice");
}

#[test]
fn a_hello_is_answered_at_most_every_dump_every() {
    let (_, mut b) = pair();
    let t = now();
    assert!(b.dump_due(7, t));
    assert!(!b.dump_due(7, t + DUMP_EVERY - Duration::from_millis(1)));
    assert!(b.dump_due(8, t), "another replica's own");
    assert!(b.dump_due(7, t + DUMP_EVERY));
}

proptest::proptest! {
    #[test]
    fn any_datagram_is_refused_or_opened_never_a_panic(bytes in proptest::collection::vec(0u8..=255, 0..1300)) {
        let (_, mut b) = pair();
        let r = b.open(&bytes, T, now());
        // Nothing random opens: only the key seals.
        proptest::prop_assert!(r.is_err());
    }
}
