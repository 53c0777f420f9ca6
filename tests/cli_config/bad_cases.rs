//! The bad configuration cases, refused by `check` and `run` with exit 2, and bad key files.

use super::*;

pub(crate) const SECRET_INLINE: &str = "c2VjcmV0LXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==";
pub(crate) const SECRET_PSK: &str = "cHNrLXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==";

pub(crate) const BAD_CASES: &[BadCase] = &[
    // Keys
    (
        "inline private key of the wrong length",
        "private_key_file = \"private.key\"",
        "private_key = \"c2VjcmV0LXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==\"",
        "interface.private_key",
        &["32-byte"],
        &[SECRET_INLINE],
    ),
    (
        "inline private key that is not base64",
        "private_key_file = \"private.key\"",
        "private_key = \"this is my secret passphrase!\"",
        "interface.private_key",
        &["base64"],
        &["my secret passphrase"],
    ),
    (
        "inline preshared key of the wrong length",
        "preshared_key_file = \"psk\"",
        "preshared_key = \"cHNrLXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==\"",
        "peer[0].preshared_key",
        &["32-byte"],
        &[SECRET_PSK],
    ),
    (
        "public key that is not base64",
        "public_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"",
        "public_key = \"not-a-key\"",
        "peer[1].public_key",
        &["\"not-a-key\"", "base64"],
        &[],
    ),
    (
        "public key of the wrong length",
        "public_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"",
        "public_key = \"AAAA\"",
        "peer[1].public_key",
        &["\"AAAA\"", "32-byte"],
        &[],
    ),
    (
        "peer without a public key",
        "public_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"\n",
        "",
        "peer[1].public_key",
        &["missing"],
        &[],
    ),
    // Addresses
    (
        "tunnel address with a prefix too long",
        "\"100.64.0.1/32\", \"fd7a::1/128\"",
        "\"100.64.0.1/33\", \"fd7a::1/128\"",
        "interface.addresses[0]",
        &["\"100.64.0.1/33\""],
        &[],
    ),
    (
        "tunnel address that is not an address",
        "\"100.64.0.1/32\", \"fd7a::1/128\"",
        "\"100.64.0.1/32\", \"fd7a::zz/128\"",
        "interface.addresses[1]",
        &["\"fd7a::zz/128\""],
        &[],
    ),
    (
        "endpoint without a port",
        "endpoint = \"192.0.2.7:51820\"",
        "endpoint = \"192.0.2.7\"",
        "peer[0].endpoint",
        &["\"192.0.2.7\"", "host:port"],
        &[],
    ),
    (
        "health address that is not an address",
        "listen = \"\"",
        "listen = \"localhost\"",
        "health.listen",
        &["\"localhost\"", "IP:port"],
        &[],
    ),
    // CIDRs
    (
        "allowed IP that is not a CIDR",
        "\"100.64.0.3/32\", \"10.0.0.0/24\"",
        "\"10.0.0.0/33\", \"10.0.0.0/24\"",
        "peer[1].allowed_ips[0]",
        &["\"10.0.0.0/33\"", "CIDR"],
        &[],
    ),
    (
        "allowed IP with host bits",
        "\"100.64.0.3/32\", \"10.0.0.0/24\"",
        "\"100.64.0.3/32\", \"10.0.0.1/24\"",
        "peer[1].allowed_ips[1]",
        &["\"10.0.0.1/24\"", "10.0.0.0/24"],
        &[],
    ),
    (
        "advertised route that is not a CIDR",
        "[dns]",
        "[router]\nadvertise_routes = [\"10.40.0.0/99\"]\n\n[dns]",
        "router.advertise_routes[0]",
        &["\"10.40.0.0/99\""],
        &[],
    ),
    // Ports
    (
        "listen port out of range",
        "listen_port = 51820",
        "listen_port = 70000",
        "interface.listen_port",
        &["70000", "65535"],
        &[],
    ),
    (
        "negative listen port",
        "listen_port = 51820",
        "listen_port = -1",
        "interface.listen_port",
        &["-1", "65535"],
        &[],
    ),
    (
        "listen port of the wrong type",
        "listen_port = 51820",
        "listen_port = \"fifty\"",
        "interface.listen_port",
        &["\"fifty\""],
        &[],
    ),
    (
        "endpoint port out of range",
        "endpoint = \"192.0.2.7:51820\"",
        "endpoint = \"192.0.2.7:70000\"",
        "peer[0].endpoint",
        &["\"192.0.2.7:70000\""],
        &[],
    ),
    (
        "forwarding port out of range",
        "[dns]",
        "[[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"80:99999\"]\n\n[dns]",
        "ingress[0].ports[0]",
        &["\"80:99999\""],
        &[],
    ),
    (
        "health port out of range",
        "listen = \"\"",
        "listen = \"127.0.0.1:70000\"",
        "health.listen",
        &["\"127.0.0.1:70000\""],
        &[],
    ),
    // Durations
    (
        "repair interval that is not a duration",
        "repair_interval = \"30s\"",
        "repair_interval = \"5 parsecs\"",
        "firewall.repair_interval",
        &["\"5 parsecs\"", "30s"],
        &[],
    ),
    (
        "re-resolve interval with an unknown unit",
        "reresolve_interval = \"10m\"",
        "reresolve_interval = \"10x\"",
        "dns.reresolve_interval",
        &["\"10x\""],
        &[],
    ),
    (
        "re-resolve interval of the wrong type",
        "reresolve_interval = \"10m\"",
        "reresolve_interval = 600",
        "dns.reresolve_interval",
        &["600"],
        &[],
    ),
    // Duplicates
    (
        "the same peer twice",
        "public_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"",
        "public_key = \"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"",
        "peer[1].public_key",
        &[
            "\"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"",
            "peer[0]",
        ],
        &[],
    ),
    (
        "the same allowed IP on two peers",
        "\"100.64.0.3/32\", \"10.0.0.0/24\"",
        "\"100.64.0.2/32\", \"10.0.0.0/24\"",
        "peer[1].allowed_ips[0]",
        &["\"100.64.0.2/32\"", "peer[0]"],
        &[],
    ),
    // Unknown keys
    (
        "unknown key in a table",
        "listen_port = 51820",
        "listen_port = 51820\ncolour = \"blue\"",
        "interface.colour",
        &["unknown field", "colour"],
        &[],
    ),
    (
        "unknown key in a peer",
        "persistent_keepalive = 25",
        "persistent_keepalive = 25\nallowed_ip = \"10.9.0.0/16\"",
        "peer[1].allowed_ip",
        &["unknown field", "allowed_ip"],
        &[],
    ),
    (
        "unknown table",
        "[dns]",
        "[tunnel]\nmtu = 1420\n\n[dns]",
        "tunnel",
        &["unknown field", "tunnel"],
        &[],
    ),
    // Other values
    (
        "MTU too small for IPv6",
        "listen_port = 51820",
        "listen_port = 51820\nmtu = 1000",
        "interface.mtu",
        &["1000", "1280"],
        &[],
    ),
    (
        "keepalive out of range",
        "persistent_keepalive = 25",
        "persistent_keepalive = 70000",
        "peer[1].persistent_keepalive",
        &["70000", "65535"],
        &[],
    ),
    (
        "interface name too long",
        "[interface]\nname = \"",
        "[interface]\nname = \"much-too-long-for-linux-",
        "interface.name",
        &["much-too-long-for-linux-", "15"],
        &[],
    ),
];

#[test]
fn every_bad_input_is_refused_by_check_and_run_with_exit_2() {
    for (what, from, to, key, needles, secrets) in BAD_CASES {
        let case = Case::new();
        let path = case.write(from, to);
        assert_rejected(
            &case,
            &path,
            what,
            &Expect {
                key,
                needles,
                secrets,
            },
        );
    }
}

#[test]
fn a_key_file_others_can_read_is_refused() {
    for (file, mode, key) in [
        ("private.key", 0o644, "interface.private_key_file"),
        ("private.key", 0o640, "interface.private_key_file"),
        ("psk", 0o604, "peer[0].preshared_key_file"),
    ] {
        let case = Case::new();
        let secret = case.dir.read(file).trim().to_string();
        case.dir.write_mode(file, &format!("{secret}\n"), mode);
        let path = case.write("listen_port = 51820", "listen_port = 51820");
        let mode_text = format!("{mode:04o}");
        let file_path = case.dir.path().join(file).display().to_string();
        assert_rejected(
            &case,
            &path,
            &format!("{file} with mode {mode_text}"),
            &Expect {
                key,
                needles: &[&file_path, &mode_text, "0600"],
                secrets: &[&secret],
            },
        );
    }
}

#[test]
fn a_key_file_with_garbage_is_refused_without_echoing_it() {
    let case = Case::new();
    let garbage = "hunter2-is-not-a-wireguard-key";
    case.dir.write_secret("private.key", garbage);
    let path = case.write("listen_port = 51820", "listen_port = 51820");
    assert_rejected(
        &case,
        &path,
        "garbage in private.key",
        &Expect {
            key: "interface.private_key_file",
            needles: &["base64"],
            secrets: &[garbage],
        },
    );
}

#[test]
fn every_error_is_reported_at_once() {
    let case = Case::new();
    let path = case.write(
        "listen_port = 51820",
        "listen_port = 70000\nmtu = 100\naddresses = [\"nope\"]",
    );
    // `addresses` now appears twice, a parse error: drop the original line.
    let text = case
        .dir
        .read("tunnelgate.toml")
        .replace("addresses = [\"100.64.0.1/32\", \"fd7a::1/128\"]\n", "");
    case.dir.write("tunnelgate.toml", &text);
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    for key in [
        "interface.listen_port: ",
        "interface.mtu: ",
        "interface.addresses[0]: ",
    ] {
        assert!(out.stderr.contains(key), "{key} missing: {}", out.stderr);
    }
}
