//! No secret anywhere: logs (trace, human and JSON), metrics, health bodies, status and `check` output.

use super::*;

/// The ways a 32-byte key could leak as text: base64 without padding (a prefix of the padded
/// form, so it covers that too), URL-safe base64, hex in both cases (the UAPI form), and
/// Rust's `Debug` of the bytes.
pub(crate) fn secret_forms(b64: &str) -> Vec<String> {
    let raw = STANDARD.decode(b64).expect("a base64 key");
    assert_eq!(raw.len(), 32);
    vec![
        STANDARD_NO_PAD.encode(&raw),
        URL_SAFE_NO_PAD.encode(&raw),
        hex::encode(&raw),
        hex::encode_upper(&raw),
        format!("{raw:?}"),
    ]
}

/// The hex form of a base64 key.
pub(crate) fn hex_of(b64: &str) -> String {
    hex::encode(STANDARD.decode(b64).expect("a base64 key"))
}

/// Panics naming the source and the secret if any form of any secret is in any source.
pub(crate) fn assert_no_secrets(sources: &[(String, String)], secrets: &[(&str, &str)]) {
    for (what, text) in sources {
        for (secret_name, b64) in secrets {
            for form in secret_forms(b64) {
                if let Some(at) = text.find(&form) {
                    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                    let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
                    panic!(
                        "{secret_name} leaks into {what} (as {form:?}) in the line:\n{}",
                        &text[start..end]
                    );
                }
            }
        }
    }
}

/// Output (stdout and stderr) of `tunnelgate ARGS`, which must succeed.
pub(crate) fn cli_ok(args: &[&str]) -> String {
    let out = tunnelgate_cli(args, None);
    assert!(
        out.success(),
        "tunnelgate {} failed ({:?}): {}",
        args.join(" "),
        out.code,
        out.stderr
    );
    format!("{}{}", out.stdout, out.stderr)
}

/// (what it is, its text): everything a run showed.
pub(crate) type Sources = Vec<(String, String)>;
/// (which secret, base64): every secret a run involved.
pub(crate) type Secrets = Vec<(&'static str, String)>;

/// One daemon run for [`no_secrets_anywhere`]: trace logs (human or JSON), a preshared key, a
/// handshake and traffic, a SIGHUP reload adding a peer (with its own preshared key), a
/// rejected reload of a file that names a key wrongly, and a `wg set` that sets the same
/// private key again and adds a peer with a third preshared key. Returns everything the daemon
/// and its tools showed, and every secret involved.
pub(crate) fn secrets_scenario(json: bool) -> (Sources, Secrets) {
    let tag = if json { "json" } else { "human" };
    let (a, b) = lan();
    let psk1 = wg_genpsk();
    let psk2 = wg_genpsk();
    let psk3 = wg_genpsk();
    let wg = WgGo::start(&b, WG_PORT, &[&cidr(B_TUN4), &cidr(B_TUN6)]);
    let cfg = tg_config(wg.public_key(), Some(&psk1));
    let private = cfg.key.private.clone();
    let args: &[&str] = if json { &["--log-format", "json"] } else { &[] };
    let mut tg = start_tg(&a, cfg.clone(), args, &[("RUST_LOG", "trace")]);
    let iface = tg.name().to_string();
    add_tg_to_wggo(&wg, tg.public_key(), Some(&psk1));

    // A handshake (with the preshared key) and traffic both ways.
    must_ping(&b, A_TUN4, tag);
    must_ping(&a, B_TUN6, tag);
    wait_handshake(&iface, wg.public_key(), SHORT);
    tcp_transfer(&a, &b, ip_of(B_TUN4), 0, MB, SHORT).unwrap_or_else(|e| panic!("{tag}: {e}"));
    tcp_transfer(&b, &a, ip_of(A_TUN4), 0, MB, SHORT).unwrap_or_else(|e| panic!("{tag}: {e}"));

    let peer_count = |tg: &Tunnelgate| {
        tg.status_json()
            .ok()
            .and_then(|s| s["peers"].as_array().map(Vec::len))
            .unwrap_or(0)
    };
    let reloads = |tg: &Tunnelgate, key: &str| {
        tg.status_json()
            .ok()
            .and_then(|s| s[key].as_u64())
            .unwrap_or(0)
    };

    // SIGHUP reload: a second peer with its own preshared key.
    let peer2 = Keypair::generate();
    let cfg2 = cfg
        .clone()
        .peer(Peer::new(&peer2.public, &["100.64.0.20/32"]).preshared_key(&psk2));
    tg.write_config(cfg2.clone());
    tg.sighup();
    wait_until(SHORT, "the reload adds the second peer", || {
        peer_count(&tg) == 2 && reloads(&tg, "reloads") >= 1
    });

    // A reload that must be refused: the preshared key's name misspelt (an unknown key).
    let bad = cfg2
        .render("private.key")
        .replace("preshared_key =", "presharedkey =");
    assert!(bad.contains("presharedkey ="));
    tg.write_config_text(&bad);
    tg.sighup();
    wait_until(SHORT, "the bad reload is refused", || {
        reloads(&tg, "reload_failures") >= 1
    });
    tg.write_config(cfg2);

    // `wg set`: the same private key again (the session survives), and a third peer.
    let keys = TempDir::new("ops-keys");
    let key_file = keys.write_secret("private", &private);
    let psk_file = keys.write_secret("psk3", &psk3);
    let peer3 = Keypair::generate();
    run(&[
        "wg",
        "set",
        &iface,
        "private-key",
        &key_file.display().to_string(),
        "peer",
        &peer3.public,
        "preshared-key",
        &psk_file.display().to_string(),
        "allowed-ips",
        "100.64.0.30/32",
    ]);
    wait_until(SHORT, "wg set adds the third peer", || peer_count(&tg) == 3);
    must_ping(&a, B_TUN4, &format!("{tag}: after the changes"));
    tcp_transfer(&b, &a, ip_of(A_TUN6), 0, MB, SHORT).unwrap_or_else(|e| panic!("{tag}: {e}"));

    // Everything an operator (or a scraper) can see.
    let mut seen: Sources = Vec::new();
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (code, body) = tg
            .health_get(path)
            .unwrap_or_else(|e| panic!("{tag}: GET {path}: {e}"));
        assert_eq!(code, 200, "{tag}: GET {path}: {body}");
        seen.push((format!("{tag}: GET {path}"), body));
    }
    let config_path = tg.config_path().display().to_string();
    for args in [
        vec!["status", "--interface", &iface],
        vec!["status", "--json", "--interface", &iface],
        vec!["status", "--config", &config_path],
        vec!["check", "--config", &config_path],
    ] {
        seen.push((
            format!("{tag}: tunnelgate {}", args.join(" ")),
            cli_ok(&args),
        ));
    }
    // `check` of a config with the key inline, valid and with an error elsewhere.
    let dir = TempDir::new("ops-check");
    let inline = cfg.render("private.key").replace(
        "private_key_file = \"private.key\"",
        &format!("private_key = {private:?}"),
    );
    assert!(inline.contains(&private));
    let good = dir.write("inline.toml", &inline);
    seen.push((
        format!("{tag}: tunnelgate check (inline key)"),
        cli_ok(&["check", "--config", &good.display().to_string()]),
    ));
    // Broken configs whose error is on the very line that holds a secret.
    let key_line = format!("private_key = {private:?}");
    let psk_line = format!("preshared_key = {psk1:?}");
    for (i, (why, text)) in [
        (
            "another key misspelt",
            inline.replace("listen_port =", "listen_prt ="),
        ),
        (
            "the key's name misspelt",
            inline.replace("private_key =", "private_kee ="),
        ),
        (
            "an unterminated string",
            inline.replace(&key_line, &key_line[..key_line.len() - 1]),
        ),
        (
            "the preshared key as a number",
            inline.replace(&psk_line, &format!("preshared_key = 0x{}", hex_of(&psk1))),
        ),
        (
            "a one-character typo in the key",
            inline.replace(&private, &format!("{}!", &private[..private.len() - 1])),
        ),
        (
            "the preshared key twice",
            inline.replace(&psk_line, &format!("{psk_line}\n{psk_line}")),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        assert_ne!(text, inline, "{why}: the replacement did nothing");
        let broken = dir.write(&format!("broken-{i}.toml"), &text);
        let out = tunnelgate_cli(&["check", "--config", &broken.display().to_string()], None);
        assert_eq!(out.code, Some(2), "{tag}: check with {why}: {out:?}");
        seen.push((
            format!("{tag}: tunnelgate check (broken config: {why})"),
            format!("{}{}", out.stdout, out.stderr),
        ));
    }

    // The metrics never show the peer's endpoint.
    let metrics = &seen[0].1;
    for endpoint in [format!("{B_LAN4}:{WG_PORT}"), B_LAN4.to_string()] {
        assert!(
            !metrics.contains(&endpoint),
            "{tag}: /metrics shows the endpoint {endpoint}:\n{metrics}"
        );
    }
    // ... while status does (it is root-only, like `wg show`): the scan above is not vacuous.
    assert!(
        seen[4].1.contains(&format!("{B_LAN4}:{WG_PORT}")),
        "{}",
        seen[4].1
    );

    let status = tg.sigterm();
    assert_eq!(status.code(), Some(0), "{tag}: exit status {status:?}");
    let log = format!("{}{}", tg.stderr(), tg.stdout());
    // The log did record the events (the scan is not vacuous), at trace level.
    for event in [
        "Handshake completed",
        "Peers applied",
        "Reload rejected",
        "UAPI set applied",
        "Shutting down",
    ] {
        assert!(
            log.contains(event),
            "{tag}: no {event:?} in the log:\n{log}"
        );
    }
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "{tag}: RUST_LOG=trace logged nothing below info"
    );
    if json {
        for line in log.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{tag}: log line is not JSON ({e}): {line}"));
            assert!(v["level"].is_string(), "{tag}: no level in {line}");
        }
    }
    seen.push((format!("{tag}: daemon log"), log));

    let secrets = vec![
        ("the private key", private),
        ("the preshared key of the first peer", psk1),
        ("the preshared key added by reload", psk2),
        ("the preshared key added by wg set", psk3),
    ];
    (seen, secrets)
}

/// With RUST_LOG=trace, human and JSON (`--log-format json`) logs, no private or preshared
/// key appears (base64, base64 without padding, URL-safe base64, hex, byte list) in the daemon's
/// log, `/metrics`, `/healthz`, `/readyz`, `tunnelgate status` (text, JSON, by config) or
/// `tunnelgate check` output (also of a config holding the key inline: valid, or broken on
/// the very line of a secret); `/metrics` never shows the peer's endpoint.
#[test]
#[ignore = "needs root"]
fn no_secrets_anywhere() {
    for json in [false, true] {
        let (seen, secrets) = secrets_scenario(json);
        let secrets: Vec<(&str, &str)> = secrets.iter().map(|(n, k)| (*n, k.as_str())).collect();
        assert_no_secrets(&seen, &secrets);
        let total: usize = seen.iter().map(|(_, t)| t.len()).sum();
        eprintln!(
            "{}: scanned {} sources, {total} bytes",
            if json { "json" } else { "human" },
            seen.len()
        );
    }
}

#[test]
fn the_secret_scan_finds_every_form() {
    let key = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
    let raw = STANDARD.decode(key).expect("base64");
    for leak in [
        key.to_string(),
        key.trim_end_matches('=').to_string(),
        URL_SAFE_NO_PAD.encode(&raw),
        hex::encode(&raw),
        hex::encode_upper(&raw),
        format!("{raw:?}"),
    ] {
        let sources = vec![("text".to_string(), format!("a\nkey: {leak}\nb"))];
        let found = std::panic::catch_unwind(|| assert_no_secrets(&sources, &[("k", key)]));
        assert!(found.is_err(), "{leak} not found");
    }
    assert_no_secrets(&[("text".into(), "nothing here".into())], &[("k", key)]);
}
