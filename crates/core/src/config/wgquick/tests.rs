//! Tests of the wg-quick reader and its mapping to tunnelgate's TOML.

use super::*;
use crate::config::{Config, SecretFiles};
use std::path::Path;

const KEY_A: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
const PUB_B: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const PUB_C: &str = "3p7bfXt9wbTTW2HC7OQ1Nz+DQ8hbeGdNrfx+FG+IK08=";
const PSK: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

/// Every secret file reads as KEY_A or PSK, so the imported TOML can be validated.
struct Secrets;
impl SecretFiles for Secrets {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        Ok(if path.to_string_lossy().ends_with(".psk") {
            PSK
        } else {
            KEY_A
        }
        .to_string())
    }
}

fn psk_file(i: usize) -> String {
    format!("/keys/wg0.peer{i}.psk")
}

fn run_import(text: &str) -> Result<Imported, Vec<ImportError>> {
    let ini = parse_ini(text).expect("a wg-quick file");
    import(
        &ini,
        "wg0",
        "/etc/wireguard/wg0.conf",
        &KeyFiles {
            private_key: "/keys/wg0.key",
            preshared_key: &psk_file,
        },
    )
}

fn parse_toml(toml: &str) -> Config {
    Config::parse(toml, Path::new("/"), &Secrets)
        .unwrap_or_else(|e| panic!("imported TOML is invalid: {e}\n{toml}"))
}

#[test]
fn comments_case_and_whitespace_are_read_as_wg_does() {
    let text = format!(
        "# a comment\n\n  [interface]   # trailing\nPRIVATEKEY={KEY_A}\n  address = 10.0.0.1/24 # mine\n\
         [PEER]\npublickey = {PUB_B}\nAllowedIps = 10.0.0.2/32 , fd00::2/128\n"
    );
    let ini = parse_ini(&text).expect("parses");
    assert_eq!(ini.sections.len(), 2);
    assert_eq!(ini.sections[0].kind, SectionKind::Interface);
    assert_eq!(ini.sections[0].line, 3);
    assert_eq!(
        ini.sections[0].entries[1],
        IniEntry {
            line: 5,
            key: "address".into(),
            value: "10.0.0.1/24".into()
        }
    );
    assert_eq!(ini.sections[1].kind, SectionKind::Peer);
    assert_eq!(ini.sections[1].entries[1].value, "10.0.0.2/32,fd00::2/128");
}

#[test]
fn what_is_not_a_wg_quick_file_is_refused_with_its_line() {
    let cases: [(&str, Option<usize>, &str); 6] = [
        ("", None, "no [Interface]"),
        (
            "[interface]\nname = \"tg0\"\n[[peer]]\n",
            Some(3),
            "unknown section",
        ),
        (
            "PrivateKey = x\n[Interface]\n",
            Some(1),
            "before any section",
        ),
        ("[Interface]\njust words\n", Some(2), "Key = Value"),
        ("[Peer]\nPublicKey = x\n", None, "no [Interface]"),
        ("[Interface]\n[Interface]\n", Some(2), "second [Interface]"),
    ];
    for (text, line, needle) in cases {
        let err = parse_ini(text).expect_err(text);
        assert_eq!(err.line, line, "{text:?}: {err}");
        assert!(err.to_string().contains(needle), "{text:?}: {err}");
    }
}

#[test]
fn every_mapped_key_reaches_the_toml_and_the_toml_is_valid() {
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 100.64.0.1/32, fd7a:115c:a1e0::1/128\n\
         Address = 10.9.0.1\nListenPort = 51820\nMTU = 1380\nFwMark = 0xca6c\n\n\
         [Peer]\nPublicKey = {PUB_B}\nPresharedKey = {PSK}\nEndpoint = 192.0.2.7:51820\n\
         AllowedIPs = 100.64.0.2/32\nAllowedIPs = fd7a:115c:a1e0::2/128\nPersistentKeepalive = 25\n\n\
         [Peer]\nPublicKey = {PUB_C}\nEndpoint = [2001:db8::7]:51821\nAllowedIPs = 10.20.0.0/16\n\
         PersistentKeepalive = off\n"
    );
    let imported = run_import(&text).expect("imports");
    assert!(imported.unmapped.is_empty(), "{:?}", imported.unmapped);
    assert_eq!(imported.private_key.expose_base64(), KEY_A);
    assert_eq!(imported.preshared_keys.len(), 1);
    assert_eq!(imported.preshared_keys[0].0, 0);
    assert_eq!(imported.preshared_keys[0].1.expose_base64(), PSK);
    // No secret is written into the TOML itself.
    assert!(!imported.toml.contains(KEY_A) && !imported.toml.contains(PSK));

    let config = parse_toml(&imported.toml);
    let i = &config.interface;
    assert_eq!(i.name, "wg0");
    assert_eq!(i.listen_port, 51820);
    assert_eq!(i.mtu, 1380);
    assert_eq!(i.fwmark, Some(0xca6c));
    let addresses: Vec<String> = i.addresses.iter().map(ToString::to_string).collect();
    assert_eq!(
        addresses,
        ["100.64.0.1/32", "fd7a:115c:a1e0::1/128", "10.9.0.1/32"]
    );
    assert_eq!(config.peers.len(), 2);
    let p0 = &config.peers[0];
    assert_eq!(p0.public_key.to_base64(), PUB_B);
    assert_eq!(
        p0.preshared_key.as_ref().map(SecretKey::expose_base64),
        Some(PSK.to_string())
    );
    assert_eq!(
        p0.endpoint,
        Some(crate::config::Endpoint::Addr(
            "192.0.2.7:51820".parse().expect("address")
        ))
    );
    let allowed: Vec<String> = p0.allowed_ips.iter().map(ToString::to_string).collect();
    assert_eq!(allowed, ["100.64.0.2/32", "fd7a:115c:a1e0::2/128"]);
    assert_eq!(p0.persistent_keepalive, Some(25));
    let p1 = &config.peers[1];
    assert_eq!(p1.preshared_key, None);
    assert_eq!(p1.persistent_keepalive, None);
    assert_eq!(
        p1.endpoint,
        Some(crate::config::Endpoint::Addr(
            "[2001:db8::7]:51821".parse().expect("address")
        ))
    );
    assert!(imported.toml.contains("/keys/wg0.key"));
    assert!(imported.toml.contains(&psk_file(0)));
    assert!(!imported.toml.contains(&psk_file(1)));
}

#[test]
fn keys_it_cannot_map_are_named_with_their_line() {
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\nDNS = 1.1.1.1\nTable = off\n\
         PostUp = iptables -A FORWARD -i %i -j ACCEPT\nPostDown = true\nPreUp = true\nPreDown = true\n\
         SaveConfig = true\nColour = blue\n[Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 10.0.0.2/32\nFoo = 1\n"
    );
    let imported = run_import(&text).expect("imports");
    let named: Vec<(usize, &str)> = imported
        .unmapped
        .iter()
        .map(|u| (u.line, u.key.as_str()))
        .collect();
    assert_eq!(
        named,
        [
            (4, "DNS"),
            (5, "Table"),
            (6, "PostUp"),
            (7, "PostDown"),
            (8, "PreUp"),
            (9, "PreDown"),
            (10, "SaveConfig"),
            (11, "Colour"),
            (15, "Foo"),
        ]
    );
    assert!(imported.unmapped[0]
        .to_string()
        .starts_with("line 4: DNS: not imported: "));
    assert!(imported.unmapped[7].why.contains("not a wg-quick"));
    parse_toml(&imported.toml);
}

#[test]
fn bad_values_are_all_reported_with_their_lines() {
    let text = "[Interface]\nPrivateKey = nope\nAddress = 10.0.0.300/24\nListenPort = 70000\n\
                MTU = big\nFwMark = 12abc\n[Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 1.2.3\n\
                PersistentKeepalive = -1\n[Peer]\nAllowedIPs = 10.0.0.0/8\n";
    let errors = match run_import(&text.replace("{PUB_B}", PUB_B)) {
        Err(e) => e,
        Ok(_) => panic!("bad values imported"),
    };
    let at: Vec<(usize, &str)> = errors.iter().map(|e| (e.line, e.key.as_str())).collect();
    assert_eq!(
        at,
        [
            (2, "PrivateKey"),
            (3, "Address"),
            (4, "ListenPort"),
            (5, "MTU"),
            (6, "FwMark"),
            (9, "AllowedIPs"),
            (10, "PersistentKeepalive"),
            (11, "[Peer]"),
        ]
    );
    // A secret is never echoed back.
    assert!(!errors.iter().any(|e| e.problem.contains("nope")));
    assert!(errors[2].to_string().contains("70000"));
}

#[test]
fn a_missing_private_key_is_an_error() {
    let errors = match run_import("[Interface]\nAddress = 10.0.0.1/24\n") {
        Err(e) => e,
        Ok(_) => panic!("imported without a key"),
    };
    assert_eq!(errors.len(), 1);
    assert!(errors[0].problem.contains("PrivateKey"), "{}", errors[0]);
}

#[test]
fn allowed_ips_with_host_bits_are_cleared_like_wg_and_noted() {
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\n[Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 10.0.0.7/24, 10.1.0.1\n"
    );
    let imported = run_import(&text).expect("imports");
    assert!(
        imported
            .toml
            .contains(r#"allowed_ips = ["10.0.0.0/24", "10.1.0.1/32"]"#),
        "{}",
        imported.toml
    );
    // The interface address keeps its host part: it is this host's address.
    assert!(imported.toml.contains(r#"addresses = ["10.0.0.1/24"]"#));
    assert_eq!(imported.notes.len(), 1, "{:?}", imported.notes);
    assert!(imported.notes[0].contains("line 6"));
    parse_toml(&imported.toml);
}

#[test]
fn detects_wg_quick_text_but_not_tunnelgate_toml() {
    assert!(looks_like_wg_quick(&format!(
        "[Interface]\nPrivateKey = {KEY_A}\n"
    )));
    assert!(looks_like_wg_quick(
        "[peer]\nallowedips = 10.0.0.0/8\n[interface]\n"
    ));
    assert!(!looks_like_wg_quick(
        "[interface]\nname = \"tg0\"\nprivate_key_file = \"k\"\naddresses = [\"10.0.0.1/32\"]\n"
    ));
    // A wg-style key in valid TOML is a typo in a tunnelgate file, reported as unknown.
    assert!(!looks_like_wg_quick(
        "[interface]\nname = \"tg0\"\nPersistentKeepalive = 25\n"
    ));
    // A stray wg key without a section header is a TOML typo, not a wg-quick file.
    assert!(!looks_like_wg_quick("Address = 1\n"));
}

#[test]
fn interface_names_follow_wg_quick_rules() {
    assert_eq!(interface_name_from_stem("wg0").as_deref(), Some("wg0"));
    assert_eq!(
        interface_name_from_stem("office-vpn.1").as_deref(),
        Some("office-vpn.1")
    );
    assert_eq!(interface_name_from_stem("a-name-that-is-too-long"), None);
    assert_eq!(interface_name_from_stem("with space"), None);
    assert_eq!(interface_name_from_stem(""), None);
}

fn import_errors(text: &str) -> Vec<ImportError> {
    match run_import(text) {
        Err(e) => e,
        Ok(i) => panic!("imported:\n{}", i.toml),
    }
}

#[test]
fn endpoints_check_refuses_are_refused_on_their_line() {
    for endpoint in [
        "-oProxyCommand=x:1",
        "host:0",
        "bad\u{1}host:51820",
        "vpn.example.com",
    ] {
        let text = format!(
            "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\n[Peer]\nPublicKey = {PUB_B}\n\
             Endpoint = {endpoint}\nAllowedIPs = 10.0.0.2/32\n"
        );
        let errors = import_errors(&text);
        assert_eq!(errors.len(), 1, "{endpoint}: {errors:?}");
        assert_eq!((errors[0].line, errors[0].key.as_str()), (6, "Endpoint"));
        let shown = errors[0].to_string();
        assert!(shown.contains("not a host and port"), "{shown}");
        assert!(
            !shown.contains('\u{1}'),
            "a control character echoed: {shown:?}"
        );
    }
}

#[test]
fn duplicate_peers_and_the_interfaces_own_key_are_refused_as_check_refuses_them() {
    let own = SecretKey(decode_key(KEY_A).expect("key"))
        .public_key()
        .to_base64();
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\n\
         [Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 10.0.0.2/32\n\
         [Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 10.0.0.3/32\n\
         [Peer]\nPublicKey = {own}\nAllowedIPs = 10.0.0.4/32\n"
    );
    let errors = import_errors(&text);
    let at: Vec<(usize, &str)> = errors.iter().map(|e| (e.line, e.key.as_str())).collect();
    assert_eq!(at, [(8, "PublicKey"), (11, "PublicKey")], "{errors:?}");
    assert!(
        errors[0].problem.contains("already peer[0]"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].problem.contains("own public key"),
        "{}",
        errors[1]
    );
}

#[test]
fn what_check_refuses_in_the_toml_is_reported_on_the_wg_quick_line() {
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\nMTU = 100\n\
         [Peer]\nPublicKey = {PUB_B}\nAllowedIPs = 10.1.0.0/16\n\
         [Peer]\nPublicKey = {PUB_C}\nAllowedIPs = 10.2.0.0/16, 10.1.0.0/16\n"
    );
    let errors = import_errors(&text);
    let at: Vec<(usize, &str)> = errors.iter().map(|e| (e.line, e.key.as_str())).collect();
    assert_eq!(at, [(4, "MTU"), (10, "AllowedIPs")], "{errors:?}");
    assert!(errors[1].problem.contains("also an allowed IP of peer[0]"));
    // No address at all: check refuses that too, on the [Interface] line.
    let errors = import_errors(&format!("[Interface]\nPrivateKey = {KEY_A}\n"));
    assert_eq!((errors[0].line, errors[0].key.as_str()), (1, "Address"));
}

#[test]
fn errors_quote_a_short_escaped_excerpt_of_a_long_line() {
    let long = "x".repeat(100_000);
    let cases = [
        format!("[Interface]\n{long}\n"),
        format!("[{long}]\n"),
        format!("[Interface]\nPrivateKey = {KEY_A}\nListenPort = {long}\n"),
        format!("[Interface]\nPrivateKey = {KEY_A}\nAddress = {long}\n"),
        format!("[Interface]\nPrivateKey = {KEY_A}\nFwMark = \u{1b}[31m{long}\n"),
    ];
    for text in &cases {
        let shown = match parse_ini(text) {
            Err(e) => e.to_string(),
            Ok(ini) => match import(
                &ini,
                "wg0",
                "/etc/wireguard/wg0.conf",
                &KeyFiles {
                    private_key: "/keys/wg0.key",
                    preshared_key: &psk_file,
                },
            ) {
                Err(errors) => errors[0].to_string(),
                Ok(_) => panic!("imported a {}-byte line", long.len()),
            },
        };
        assert!(
            shown.len() < 300,
            "{} bytes: {}",
            shown.len(),
            &shown[..300]
        );
        assert!(shown.contains("bytes)"), "says how long it was: {shown}");
        assert!(!shown.contains('\u{1b}'), "{shown:?}");
    }
}

#[test]
fn the_header_comment_is_one_line_whatever_the_path_holds() {
    let text = format!("[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\n");
    let ini = parse_ini(&text).expect("parses");
    let source = "/tmp/x\n[health]\nlisten = \"0.0.0.0:9002\"\r\n#\u{1b}/wg0.conf";
    let imported = import(
        &ini,
        "wg0",
        source,
        &KeyFiles {
            private_key: "/keys/wg0.key",
            preshared_key: &psk_file,
        },
    )
    .unwrap_or_else(|e| panic!("{e:?}"));
    let first = imported.toml.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("# Imported from /tmp/x\\n[health]"),
        "{first}"
    );
    assert_eq!(imported.toml.lines().nth(1), Some(""), "{}", imported.toml);
    assert!(!imported.toml.contains('\u{1b}') && !imported.toml.contains('\r'));
    // The injected `[health] listen = "0.0.0.0:9002"` is no table: the default stays.
    let listen = parse_toml(&imported.toml).health.listen;
    assert!(
        listen.is_none_or(|a| !a.ip().is_unspecified()),
        "{listen:?}"
    );
}

#[test]
fn fwmark_stays_in_the_base_it_was_written_in() {
    for (written, toml) in [
        ("0xca6c", "fwmark = 0xca6c"),
        ("0XCA6C", "fwmark = 0xca6c"),
        ("51820", "fwmark = 51820"),
    ] {
        let text = format!(
            "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\nFwMark = {written}\n"
        );
        let imported = run_import(&text).expect("imports");
        assert!(imported.toml.contains(toml), "{written}: {}", imported.toml);
        assert!(parse_toml(&imported.toml).interface.fwmark.is_some());
    }
    // A sign is no digit, in either base.
    for written in ["0x+ca6c", "+5"] {
        let text = format!("[Interface]\nPrivateKey = {KEY_A}\nFwMark = {written}\n");
        let errors = import_errors(&text);
        assert_eq!(errors[0].key, "FwMark", "{written}: {errors:?}");
    }
}

#[test]
fn the_post_down_hint_names_exec_stop_post() {
    let text = format!(
        "[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\nPostDown = true\nPreDown = true\nPostUp = true\n"
    );
    let imported = run_import(&text).expect("imports");
    assert!(imported.unmapped[0].why.contains("ExecStopPost="));
    assert!(imported.unmapped[1].why.contains("ExecStopPost="));
    assert!(imported.unmapped[2].why.contains("ExecStartPost="));
}

proptest::proptest! {
    /// Whatever the input's path holds, the TOML has the same tables and keys as for a plain
    /// path: the header comment carries nothing into it.
    #[test]
    fn no_source_path_reaches_the_toml_as_anything_but_a_comment(source in "\\PC*|[\\x00-\\x7f]{0,60}") {
        let text = format!("[Interface]\nPrivateKey = {KEY_A}\nAddress = 10.0.0.1/24\n");
        let ini = parse_ini(&text).expect("parses");
        let files = KeyFiles { private_key: "/keys/wg0.key", preshared_key: &psk_file };
        let plain = import(&ini, "wg0", "/etc/wireguard/wg0.conf", &files).expect("imports");
        let odd = import(&ini, "wg0", &source, &files).expect("imports");
        let table = |t: &str| t.parse::<toml::Table>().expect("TOML");
        proptest::prop_assert_eq!(table(&plain.toml), table(&odd.toml));
    }

    /// Every error of the INI reader quotes at most a short excerpt, whatever the line.
    #[test]
    fn parse_errors_stay_short(line in "[^\n#]{0,2000}") {
        if let Err(e) = parse_ini(&format!("[Interface]\n{line}\n")) {
            proptest::prop_assert!(e.to_string().len() < 400, "{}", e);
        }
    }
}
