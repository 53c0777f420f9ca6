use super::*;
use crate::test_util::now;

fn key(b: u8) -> PublicKey {
    PublicKey([b; 32])
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

#[test]
fn what_is_written_reads_back() {
    let (a, b) = (addr("[2001:db8::1]:4000"), addr("198.51.100.7:1"));
    let text = render(&key(1), [(&key(2), &a), (&key(3), &b)]);
    let restored = parse(&text, &key(1)).expect("ours");
    assert_eq!(restored.skipped, 0);
    assert_eq!(restored.peers.len(), 2);
    assert_eq!(restored.peers[&key(2)], a);
    assert_eq!(restored.peers[&key(3)], b);
}

/// Endpoints proven to another key are no proof for this one: a file written by another
/// identity (another interface of the same name in another namespace, a key rotated since) is
/// ignored whole.
#[test]
fn a_file_of_another_identity_or_no_file_at_all_is_refused_whole() {
    let text = render(&key(1), [(&key(2), &addr("192.0.2.1:1"))]);
    assert!(matches!(
        parse(&text, &key(9)),
        Err(Refused::AnotherIdentity(_))
    ));
    assert_eq!(parse("", &key(1)), Err(Refused::NotAnEndpointsFile));
    assert_eq!(
        parse("[interface]\nname = \"tg0\"\n", &key(1)),
        Err(Refused::NotAnEndpointsFile)
    );
    assert_eq!(parse(HEADER, &key(1)), Err(Refused::NoIdentity));
    assert_eq!(
        parse(
            &format!("{HEADER}\nidentity \u{1b}[2J not a key\n"),
            &key(1)
        ),
        Err(Refused::AnotherIdentity("\\u{1b}[2J not a key".into())),
        "what it quotes is escaped"
    );
}

#[test]
fn bad_lines_are_skipped_and_counted_and_the_bounds_hold() {
    let good = key(2);
    let text = format!(
        "{HEADER}\nidentity {}\n\
         {good} 192.0.2.1:1\n\
         {good} 203.0.113.1:1\n\
         not-a-key 192.0.2.1:1\n\
         {} not-an-address\n\
         {}\n\
         \n\
         {} 192.0.2.1:99999\n\
         {} 192.0.2.1:0\n\
         {} 192.0.2.1:1 192.0.2.2:2\n",
        key(1),
        key(3),
        key(4),
        key(5),
        key(6),
        key(7)
    );
    let restored = parse(&text, &key(1)).expect("ours");
    assert_eq!(restored.peers.len(), 1);
    assert_eq!(
        restored.peers[&good],
        addr("192.0.2.1:1"),
        "the first line of a peer"
    );
    // A repeated peer, a bad key, a bad address, a peer without one, an empty line, a port out
    // of range, port 0, two endpoints.
    assert_eq!(restored.skipped, 8);
}

proptest::proptest! {
    #[test]
    fn any_text_is_refused_or_read_never_a_panic(text in "\\PC*") {
        let _ = parse(&text, &key(1));
        let with_header = format!("{HEADER}\nidentity {}\n{text}", key(1));
        let restored = parse(&with_header, &key(1));
        proptest::prop_assert!(restored.is_ok());
    }
}

#[test]
fn writes_wait_for_a_change_and_come_at_most_every_few_seconds() {
    let t0 = now();
    let mut schedule = WriteSchedule::default();
    assert!(!schedule.due(t0), "nothing changed");
    schedule.changed();
    assert!(schedule.due(t0), "the first change is written at once");
    schedule.written(t0);
    assert!(!schedule.is_dirty());
    schedule.changed();
    assert!(!schedule.due(t0 + WRITE_EVERY - Duration::from_millis(1)));
    assert!(schedule.due(t0 + WRITE_EVERY));
    assert!(schedule.is_dirty(), "a stop writes what waits");
}
