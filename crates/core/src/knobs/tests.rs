//! Hostile values for every kind of knob: each refused with the one warning, short, naming the
//! variable.

use super::*;

const RANGE: RangeInclusive<u64> = 16..=65536;

fn hostile() -> Vec<Vec<u8>> {
    vec![
        b"".to_vec(),
        b"+2".to_vec(),
        b"-1".to_vec(),
        b" 512".to_vec(),
        b"512 ".to_vec(),
        b"4k".to_vec(),
        b"0x10".to_vec(),
        b"1e3".to_vec(),
        b"\xff\xfe".to_vec(),
        b"99999999999999999999999999".to_vec(),
        b"TRUE".to_vec(),
        b"yes".to_vec(),
        b"legacy\n".to_vec(),
        vec![b'7'; 100_000],
        b"\0".to_vec(),
    ]
}

fn is_the_warning(e: &str, expected: &str) {
    assert!(e.starts_with("TUNNELGATE_X=\""), "{e}");
    assert!(e.ends_with(&format!("expected {expected}")), "{e}");
    assert!(e.len() < 200, "{e}");
}

#[test]
fn unset_is_the_default_for_every_kind() {
    assert_eq!(number("TUNNELGATE_X", None, &RANGE), Ok(None));
    assert_eq!(word("TUNNELGATE_X", None, &["a"]), Ok(None));
    assert_eq!(flag("TUNNELGATE_X", None), Ok(None));
    assert_eq!(path("TUNNELGATE_X", None), Ok(None));
}

#[test]
fn a_number_is_digits_in_range_and_nothing_else() {
    assert_eq!(number("TUNNELGATE_X", Some(b"16"), &RANGE), Ok(Some(16)));
    assert_eq!(
        number("TUNNELGATE_X", Some(b"65536"), &RANGE),
        Ok(Some(65536))
    );
    assert_eq!(number("TUNNELGATE_X", Some(b"0016"), &RANGE), Ok(Some(16)));
    for raw in hostile()
        .iter()
        .chain([&b"15".to_vec(), &b"65537".to_vec()])
    {
        let e = number("TUNNELGATE_X", Some(raw), &RANGE).expect_err("refused");
        is_the_warning(&e, "a number from 16 to 65536");
    }
}

#[test]
fn a_word_is_one_of_its_words_exactly() {
    let words = ["legacy", "nft"];
    assert_eq!(word("TUNNELGATE_X", Some(b"legacy"), &words), Ok(Some(0)));
    assert_eq!(word("TUNNELGATE_X", Some(b"nft"), &words), Ok(Some(1)));
    for raw in hostile()
        .iter()
        .chain([&b"NFT".to_vec(), &b"legcy".to_vec()])
    {
        let e = word("TUNNELGATE_X", Some(raw), &words).expect_err("refused");
        is_the_warning(&e, "one of \"legacy\", \"nft\"");
    }
}

#[test]
fn a_flag_is_one_zero_true_or_false() {
    assert_eq!(flag("TUNNELGATE_X", Some(b"1")), Ok(Some(true)));
    assert_eq!(flag("TUNNELGATE_X", Some(b"true")), Ok(Some(true)));
    assert_eq!(flag("TUNNELGATE_X", Some(b"0")), Ok(Some(false)));
    assert_eq!(flag("TUNNELGATE_X", Some(b"false")), Ok(Some(false)));
    for raw in hostile().iter().chain([&b"2".to_vec(), &b"on".to_vec()]) {
        let e = flag("TUNNELGATE_X", Some(raw)).expect_err("refused");
        is_the_warning(&e, "1, 0, true or false");
    }
}

#[test]
fn a_path_is_anything_but_empty() {
    assert_eq!(
        path("TUNNELGATE_X", Some(b"/run/x")),
        Ok(Some(b"/run/x".to_vec()))
    );
    is_the_warning(
        &path("TUNNELGATE_X", Some(b"")).expect_err("empty"),
        "a path",
    );
}

#[test]
fn partners_past_the_cpus_are_shown_lowered_with_the_reason() {
    assert_eq!(
        relay_lowered(Some(3), 2, 2).as_deref(),
        Some("TUNNELGATE_RELAY_PARTNERS=3 lowered to 1: one partner per other CPU, 2 CPUs")
    );
    assert_eq!(
        relay_lowered(Some(3), 2, 8).as_deref(),
        Some("TUNNELGATE_RELAY_PARTNERS=3 lowered to 1: one partner per other worker, 2 workers")
    );
    assert_eq!(
        relay_lowered(Some(2), 1, 8).as_deref(),
        Some("TUNNELGATE_RELAY_PARTNERS=2 lowered to 0: one worker")
    );
    assert_eq!(relay_lowered(Some(1), 2, 2), None, "what was asked");
    assert_eq!(relay_lowered(Some(0), 1, 1), None, "off is off");
    assert_eq!(relay_lowered(None, 2, 2), None, "nothing asked");
}
