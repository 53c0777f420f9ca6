//! The CLI helpers, `genkey` and `pubkey` against `wg`, and bad usage.

use super::*;

pub(crate) fn cli(args: &[&str], stdin: Option<&str>) -> CmdOutput {
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(args);
    common::output_of(cmd, stdin)
}

pub(crate) fn genkey() -> String {
    let out = cli(&["genkey"], None);
    assert!(out.success(), "genkey failed: {out:?}");
    out.stdout.trim().to_string()
}

pub(crate) fn pubkey(private: &str) -> CmdOutput {
    cli(&["pubkey"], Some(private))
}

pub(crate) fn have_wg() -> bool {
    Command::new("wg")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

pub(crate) fn decodes_to_32_bytes(b64: &str) -> bool {
    // Standard base64 of 32 bytes: 43 significant characters and one '='.
    b64.len() == 44
        && b64.ends_with('=')
        && !b64.ends_with("==")
        && b64[..43]
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'+' || c == b'/')
}

#[test]
fn genkey_and_pubkey_work_like_wg() {
    let a = genkey();
    let b = genkey();
    assert!(decodes_to_32_bytes(&a), "genkey printed {a:?}");
    assert_ne!(a, b, "two genkeys must differ");

    let known = pubkey(RFC7748_PRIVATE);
    assert!(known.success(), "pubkey failed: {known:?}");
    assert_eq!(known.stdout.trim(), RFC7748_PUBLIC, "RFC 7748 test vector");
    // A trailing newline (what `genkey |` produces) is fine, as with wg.
    assert_eq!(
        pubkey(&format!("{RFC7748_PRIVATE}\n")).stdout.trim(),
        RFC7748_PUBLIC
    );

    let ours = pubkey(&format!("{a}\n"));
    assert!(ours.success(), "pubkey of genkey failed: {ours:?}");
    let public = ours.stdout.trim();
    assert!(decodes_to_32_bytes(public), "pubkey printed {public:?}");
    if have_wg() {
        let mut wg = Command::new("wg");
        wg.arg("pubkey");
        let theirs = common::output_of(wg, Some(&format!("{a}\n")));
        assert!(theirs.success(), "wg pubkey failed: {theirs:?}");
        assert_eq!(public, theirs.stdout.trim(), "tunnelgate and wg disagree");
        // And the other way round: a key made by wg.
        let wg_key = common::run(&["wg", "genkey"]).trim().to_string();
        let mut wg = Command::new("wg");
        wg.arg("pubkey");
        assert_eq!(
            pubkey(&wg_key).stdout.trim(),
            common::output_of(wg, Some(&wg_key)).stdout.trim()
        );
    } else {
        common::skip(
            "wg is not installed, so tunnelgate's keys are not compared with `wg pubkey` \
             (apt-get install --no-install-recommends wireguard-tools)",
        );
    }
}

#[test]
fn pubkey_refuses_garbage_with_exit_2() {
    for garbage in [
        "",
        "not a key at all",
        "AAAA",
        "c2hvcnQ=",
        "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!=",
    ] {
        let out = pubkey(garbage);
        assert_eq!(out.code, Some(2), "pubkey of {garbage:?}: {out:?}");
        assert!(out.stdout.trim().is_empty(), "no key printed: {out:?}");
        assert!(
            out.stderr.contains("key"),
            "says what is wrong: {}",
            out.stderr
        );
    }
}

/// `pubkey < /dev/zero` (or any endless input) stops at a bound instead of reading until the
/// memory runs out.
#[test]
fn pubkey_of_an_endless_input_stops_at_a_bound() {
    let out = Command::new(tunnelgate_bin())
        .arg("pubkey")
        .stdin(std::fs::File::open("/dev/zero").expect("/dev/zero"))
        .output()
        .expect("tunnelgate pubkey");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("more than 4096 bytes"), "{stderr}");
}

#[test]
fn bad_usage_exits_2() {
    for args in [
        &["frobnicate"][..],
        &["check", "--no-such-flag"],
        &["run", "--config"],
    ] {
        let out = cli(args, None);
        assert_eq!(out.code, Some(2), "tunnelgate {args:?}: {out:?}");
        assert!(!out.stderr.trim().is_empty());
    }
    let missing = "/nonexistent/tunnelgate-test/tunnelgate.toml";
    for cmd in ["check", "run"] {
        let out = cli(&[cmd, "--config", missing], None);
        assert_eq!(out.code, Some(2), "{cmd} with a missing file: {out:?}");
        assert!(
            out.stderr.contains(missing),
            "names the file: {}",
            out.stderr
        );
    }
}
