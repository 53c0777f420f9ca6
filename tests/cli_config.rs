//! The command line without a running tunnel (no root needed): `genkey`/`pubkey`, and every bad
//! configuration input of issue 2 through both `tunnelgate check` and `tunnelgate run` — exit
//! code 2, a message naming the key, the bad value (never a secret) and what is expected, and
//! nothing changed on the system. `check` on the shipped example prints the plan and changes
//! nothing.
//!
//! These run as plain `#[test]`s; CI runs them as root too, which is why `run` is always given a
//! unique interface name and a deadline, and the tests check that no interface or socket appeared.

mod common;

use common::{tunnelgate_bin, unique_name, wg_socket, CmdOutput, Proc, TempDir};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// RFC 7748 section 6.1: Alice's X25519 private key and its public key, base64.
const RFC7748_PRIVATE: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
const RFC7748_PUBLIC: &str = "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=";

/// Two fixed peer public keys (any 32 bytes are a valid public key).
const PUB_B: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const PUB_C: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

/// Where the daemon puts its status socket (the harness does not override it).
const STATUS_DIR: &str = "/var/run/tunnelgate";

fn cli(args: &[&str], stdin: Option<&str>) -> CmdOutput {
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(args);
    common::output_of(cmd, stdin)
}

fn genkey() -> String {
    let out = cli(&["genkey"], None);
    assert!(out.success(), "genkey failed: {out:?}");
    out.stdout.trim().to_string()
}

fn pubkey(private: &str) -> CmdOutput {
    cli(&["pubkey"], Some(private))
}

fn have_wg() -> bool {
    Command::new("wg")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn decodes_to_32_bytes(b64: &str) -> bool {
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
        eprintln!("wg is not installed: skipping the comparison with `wg pubkey`");
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

// ---------------------------------------------------------------------------------------------
// Bad configuration input
// ---------------------------------------------------------------------------------------------

/// A valid configuration (one change away from each bad case), written to its own directory
/// with a 0600 key file and a 0600 preshared-key file.
struct Case {
    dir: TempDir,
    name: String,
    private: String,
}

impl Case {
    fn new() -> Case {
        let name = unique_name("tgt");
        let dir = TempDir::new(&name);
        let private = genkey();
        dir.write_secret("private.key", &format!("{private}\n"));
        dir.write_secret("psk", &format!("{}\n", genkey()));
        Case { dir, name, private }
    }

    /// The valid base text. Health is disabled so that nothing would bind even if it ran.
    fn base(&self) -> String {
        format!(
            r#"[interface]
name = "{name}"
private_key_file = "private.key"
listen_port = 51820
addresses = ["100.64.0.1/32", "fd7a::1/128"]

[[peer]]
public_key = "{PUB_B}"
preshared_key_file = "psk"
endpoint = "192.0.2.7:51820"
allowed_ips = ["100.64.0.2/32"]

[[peer]]
public_key = "{PUB_C}"
allowed_ips = ["100.64.0.3/32", "10.0.0.0/24"]
persistent_keepalive = 25

[firewall]
repair_interval = "30s"

[dns]
reresolve_interval = "10m"

[health]
listen = ""
"#,
            name = self.name
        )
    }

    /// The base with `from` replaced by `to` (which must change it) written as the config file.
    fn write(&self, from: &str, to: &str) -> PathBuf {
        let base = self.base();
        assert!(base.contains(from), "{from:?} is not in the base config");
        let text = base.replacen(from, to, 1);
        self.dir.write("tunnelgate.toml", &text)
    }
}

/// What a bad case must produce: an error line for `key` that contains every needle; nothing in
/// stderr or stdout may contain a `secret`.
struct Expect<'a> {
    key: &'a str,
    needles: &'a [&'a str],
    secrets: &'a [&'a str],
}

/// Runs `tunnelgate run --config path` with a deadline: a valid config would start a daemon
/// (as root), which must not happen here.
fn run_expecting_refusal(path: &Path, dir: &TempDir) -> CmdOutput {
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(["run", "--config", &path.display().to_string()]);
    let mut p = Proc::spawn(cmd, "run", dir.path());
    let status = p.wait_timeout(Duration::from_secs(10));
    if status.is_none() {
        let _ = p.sigterm(Duration::from_secs(10));
        panic!(
            "`tunnelgate run` accepted {} and kept running; stderr:\n{}",
            path.display(),
            p.stderr()
        );
    }
    CmdOutput {
        code: status.and_then(|s| s.code()),
        stdout: p.stdout(),
        stderr: p.stderr(),
    }
}

/// The interfaces of this (root) namespace.
fn net_devices() -> BTreeSet<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// No interface named `name` and none of its sockets exist. (Only what this configuration
/// names is checked: other processes on the host may add interfaces meanwhile.)
fn assert_untouched(name: &str) {
    assert!(
        !net_devices().contains(name),
        "interface {name} was created"
    );
    assert!(
        !wg_socket(name).exists(),
        "UAPI socket of {name} was created"
    );
    let status = Path::new(STATUS_DIR).join(format!("{name}.sock"));
    assert!(!status.exists(), "{} was created", status.display());
}

/// Checks one bad config through `check` and `run`.
fn assert_rejected(case: &Case, path: &Path, what: &str, expect: &Expect) {
    let check = cli(&["check", "--config", &path.display().to_string()], None);
    let run = run_expecting_refusal(path, &case.dir);
    for (cmd, out) in [("check", &check), ("run", &run)] {
        let ctx = format!(
            "{what}: `tunnelgate {cmd}`\nconfig:\n{}\nstdout:\n{}\nstderr:\n{}",
            case.dir.read("tunnelgate.toml"),
            out.stdout,
            out.stderr
        );
        assert_eq!(out.code, Some(2), "exit code 2 for {ctx}");
        let prefix = format!("{}: ", expect.key);
        let line = out
            .stderr
            .lines()
            .find(|l| l.trim_start().starts_with(&prefix))
            .unwrap_or_else(|| panic!("no error line for key {} in {ctx}", expect.key));
        for n in expect.needles {
            assert!(line.contains(n), "{n:?} missing from {line:?} in {ctx}");
        }
        assert!(
            line.contains("expected"),
            "the error says what is expected: {line:?} in {ctx}"
        );
        for s in expect.secrets.iter().chain([&case.private.as_str()]) {
            assert!(
                !out.stderr.contains(s) && !out.stdout.contains(s),
                "a secret value leaked in {ctx}"
            );
        }
        assert!(
            !out.stdout.contains("ip route add"),
            "no plan for an invalid config: {ctx}"
        );
    }
    assert_untouched(&case.name);
}

#[test]
fn the_base_config_of_the_bad_cases_is_valid() {
    let case = Case::new();
    let path = case.write("listen_port = 51820", "listen_port = 51820");
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "base config must be valid: {out:?}");
    assert!(
        out.stdout
            .contains(&format!("ip route add 100.64.0.2/32 dev {}", case.name)),
        "{}",
        out.stdout
    );
}

/// (description, from, to, expected key, needles in that key's line, secrets that must not show)
type BadCase = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
);

const SECRET_INLINE: &str = "c2VjcmV0LXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==";
const SECRET_PSK: &str = "cHNrLXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==";

const BAD_CASES: &[BadCase] = &[
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

// ---------------------------------------------------------------------------------------------
// check on the example
// ---------------------------------------------------------------------------------------------

#[test]
fn check_on_the_example_prints_the_plan_and_changes_nothing() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/example.toml");
    let text = std::fs::read_to_string(&example).expect("config/example.toml");
    let dir = TempDir::new("example");
    let private = genkey();
    dir.write_secret("private.key", &format!("{private}\n"));
    dir.write_secret("psk", &format!("{}\n", genkey()));
    let path = dir.write("tunnelgate.toml", &text);
    let name = "tg0"; // interface.name of the example
    let existed = net_devices().contains(name);
    let socket_existed = wg_socket(name).exists();

    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "check of the example: {out:?}");
    let plan = &out.stdout;
    let public = pubkey(&private).stdout.trim().to_string();
    assert!(
        plan.contains(&public),
        "the plan shows the public key: {plan}"
    );
    for line in [
        "ip address add 100.64.0.1/32 dev tg0",
        "ip address add fd7a:115c:a1e0::1/128 dev tg0",
        "ip route add 100.64.0.2/32 dev tg0",
        "ip route add fd7a:115c:a1e0::2/128 dev tg0",
        "ip route add 10.0.0.0/24 dev tg0",
    ] {
        assert!(
            plan.lines().any(|l| l.trim() == line),
            "{line:?} missing from the plan:\n{plan}"
        );
    }
    assert!(
        plan.contains("ip_forward"),
        "the plan names the sysctls: {plan}"
    );
    // The firewall text of whichever backend was chosen.
    let (_, firewall) = plan
        .split_once("# firewall (")
        .unwrap_or_else(|| panic!("no firewall section in the plan:\n{plan}"));
    let nft = firewall.starts_with("nftables");
    let ipt = firewall.starts_with("iptables");
    assert!(nft || ipt, "unknown backend in the plan: {firewall}");
    if nft {
        // The table is named after the interface, so daemons for other interfaces coexist.
        assert!(
            firewall.contains("table inet tunnelgate_tg0 {"),
            "{firewall}"
        );
        // Forwarded ports are map elements, read by one rule per family and protocol.
        assert!(
            firewall.contains(" . 443 comment \"ingress[0]\" : 10.96.0.10 . 8443"),
            "{firewall}"
        );
        assert!(
            firewall.contains("8080 comment \"egress[0]\" : 100.64.0.2 . 80"),
            "{firewall}"
        );
        assert!(
            firewall.contains("dnat ip to ip daddr . tcp dport map @in4_tcp_dnat"),
            "{firewall}"
        );
    } else {
        assert!(firewall.contains("*nat"), "{firewall}");
        assert!(firewall.contains(":TG-tg0-PRE - [0:0]"), "{firewall}");
        assert!(firewall.contains("COMMIT"), "{firewall}");
        assert!(firewall.contains("10.96.0.10"), "{firewall}");
    }
    assert!(
        firewall.contains("tg0"),
        "rules are scoped to the tunnel: {firewall}"
    );

    // Nothing changed: no interface, no socket.
    assert_eq!(
        net_devices().contains(name),
        existed,
        "check created the interface"
    );
    assert_eq!(
        wg_socket(name).exists(),
        socket_existed,
        "check created a UAPI socket"
    );
}

#[test]
fn check_of_a_config_without_rules_prints_no_firewall() {
    let case = Case::new();
    let path = case.write("listen_port = 51820", "listen_port = 51820");
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        !out.stdout.contains("table inet tunnelgate_") && !out.stdout.contains("*nat"),
        "a plain tunnel installs no firewall rules:\n{}",
        out.stdout
    );
    assert!(out
        .stdout
        .contains(&format!("ip route add 10.0.0.0/24 dev {}", case.name)));
}

/// Issue 27: `check` warns (exit 0, never refuses) about an ingress to loopback, which can
/// never work, and to the gateway's own health endpoint, which would hand `/metrics` to the
/// tunnel; a sound ingress gets no such word.
#[test]
fn check_warns_about_an_ingress_to_loopback_or_to_its_own_health_port() {
    let case = Case::new();
    let cases = [
        (
            "[[ingress]]\ntarget = \"127.0.0.1\"\nports = [\"8080\"]\n",
            "listen = \"\"",
            "ingress[0].target: 127.0.0.1 is a loopback address",
        ),
        (
            "[[ingress]]\ntarget = \"192.0.2.50\"\nports = [\"80:9102\"]\n",
            "listen = \"192.0.2.50:9102\"",
            "this gateway's own health endpoint",
        ),
    ];
    for (ingress, health, warning) in cases {
        let text = format!(
            "{}\n{ingress}",
            case.base().replace("listen = \"\"", health)
        );
        let path = case.dir.write("tunnelgate.toml", &text);
        let out = cli(&["check", "--config", &path.display().to_string()], None);
        assert_eq!(out.code, Some(0), "a warning, not an error: {out:?}");
        assert!(
            out.stderr.contains("warning:") && out.stderr.contains(warning),
            "{ingress}: {}",
            out.stderr
        );
    }
    let text = format!(
        "{}\n[[ingress]]\ntarget = \"192.0.2.60\"\nports = [\"80\"]\n",
        case.base()
    );
    let path = case.dir.write("tunnelgate.toml", &text);
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stderr.contains("ingress[0]"), "{}", out.stderr);
}

/// `--log-format` belongs to the subcommands that log: `run` takes it; the others refuse it as
/// a usage error instead of silently ignoring it.
#[test]
fn log_format_is_only_on_run() {
    let help = cli(&["run", "--help"], None);
    assert_eq!(help.code, Some(0), "{help:?}");
    assert!(help.stdout.contains("--log-format"), "{}", help.stdout);
    for sub in ["check", "status", "reload", "genkey"] {
        let out = cli(&[sub, "--log-format", "json"], None);
        assert_eq!(out.code, Some(2), "{sub} --log-format: {out:?}");
        let help = cli(&[sub, "--help"], None);
        assert!(
            !help.stdout.contains("--log-format"),
            "{sub}: {}",
            help.stdout
        );
    }
}

/// Every file in `config/` passes `tunnelgate check` once the steps in its header comment are
/// done: each key file it names is created by one of them (`tunnelgate genkey > .../NAME`).
/// The placeholder peer keys they ship with are a warning, not an error.
#[test]
fn every_shipped_config_passes_check() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("config/")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read");
        let tmp = TempDir::new("shipped");
        let created: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with('#'))
            .filter_map(|l| l.split_once("> /etc/tunnelgate/"))
            .filter_map(|(_, rest)| rest.split([';', ' ']).next())
            .collect();
        for name in &created {
            tmp.write_secret(name, &genkey());
        }
        let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o600);
        let out = cli(&["check", "--config", &cfg.display().to_string()], None);
        assert_eq!(
            out.code,
            Some(0),
            "{} after its header steps (created {created:?}): {}",
            file.display(),
            out.stderr
        );
        assert!(
            out.stderr.contains("looks like a placeholder"),
            "{}: its placeholder keys are pointed out: {}",
            file.display(),
            out.stderr
        );
    }
}

/// A secret written inline in a file others can read is a warning (the daemon still starts).
#[test]
fn inline_private_key_in_a_readable_file_is_a_warning() {
    let tmp = TempDir::new("inline");
    let text = format!(
        "[interface]\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o644);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("warning: interface.private_key: a secret written inline")
            && out.stderr.contains("0644"),
        "{}",
        out.stderr
    );
    let cfg = tmp.write_mode("tunnelgate.toml", &text, 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert!(!out.stderr.contains("inline"), "{}", out.stderr);
}

#[test]
fn help_of_help_exits_0() {
    for args in [
        &["help", "--help"][..],
        &["help"],
        &["help", "reload"],
        &["--help"],
    ] {
        let out = cli(args, None);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
    assert_eq!(cli(&["help", "nosuch"], None).code, Some(2));
}

fn gzip(text: &str) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut encoder, text.as_bytes()).expect("gzip");
    encoder.finish().expect("gzip")
}

fn write_bytes_mode(dir: &TempDir, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

/// A `.gz` config is read whole (every member, as `cat a.gz b.gz` makes) or refused: nothing
/// after the last member is dropped silently.
#[test]
fn a_gz_config_is_read_whole_or_refused() {
    let tmp = TempDir::new("gz-whole");
    let interface = format!(
        "[interface]\nname = \"tggz0\"\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let peer = format!("[[peer]]\npublic_key = \"{PUB_B}\"\nallowed_ips = [\"10.77.0.0/16\"]\n");
    let two = [gzip(&interface), gzip(&peer)].concat();
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &two, 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains("10.77.0.0/16"),
        "the second member: {}",
        out.stdout
    );

    // The same, with bytes after the last member: refused with exit 2, saying so.
    let cfg = write_bytes_mode(
        &tmp,
        "garbage.toml.gz",
        &[&two[..], b"oops"].concat(),
        0o600,
    );
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr
            .contains("4 bytes of trailing data after gzip member 2"),
        "{}",
        out.stderr
    );
    // A second member cut short is refused too, not read as far as it goes.
    let cfg = write_bytes_mode(&tmp, "cut.toml.gz", &two[..two.len() - 4], 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("gzip member 2"), "{}", out.stderr);
}

/// The inline-secret warning holds for a `.gz` config as for a plain one.
#[test]
fn inline_private_key_in_a_readable_gz_is_a_warning() {
    let tmp = TempDir::new("inline-gz");
    let text = format!(
        "[interface]\nprivate_key = \"{}\"\naddresses = [\"100.64.0.1/32\"]\n",
        genkey()
    );
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &gzip(&text), 0o644);
    // Named directly, and found as the `.gz` twin of the plain name.
    for named in [cfg.clone(), tmp.path().join("tunnelgate.toml")] {
        let out = cli(&["check", "--config", &named.display().to_string()], None);
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        assert!(
            out.stderr
                .contains("warning: interface.private_key: a secret written inline")
                && out.stderr.contains("0644"),
            "{}: {}",
            named.display(),
            out.stderr
        );
    }
    let cfg = write_bytes_mode(&tmp, "tunnelgate.toml.gz", &gzip(&text), 0o600);
    let out = cli(&["check", "--config", &cfg.display().to_string()], None);
    assert!(!out.stderr.contains("inline"), "{}", out.stderr);
}

/// Hostile environment values (not UTF-8, huge, garbage) in what systemd, journald and the
/// operator set: a clear error naming the variable, or the documented ignore; never a panic.
#[test]
fn hostile_environment_values_get_an_error_or_are_ignored_never_a_panic() {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::process::CommandExt as _;
    let bytes = |b: &[u8]| std::ffi::OsStr::from_bytes(b).to_owned();
    let case = Case::new();
    let path = case.write("listen_port = 51820", "listen_port = 51820");

    // Ignored by `check` (and harmless to the daemon): notify and watchdog targets, the
    // journal's stream, the GRO switch, a typo'd iptables flavour, RUST_LOG.
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.args(["check", "--config", &path.display().to_string()])
        .env("NOTIFY_SOCKET", bytes(b"@garbage\xff"))
        .env("WATCHDOG_USEC", "18446744073709551616")
        .env("WATCHDOG_PID", "-1")
        .env("JOURNAL_STREAM", "garbage:\u{1b}[2J")
        .env("TUNNELGATE_NO_UDP_GRO", bytes(b"\xff"))
        .env("TUNNELGATE_IPTABLES", "x".repeat(100_000))
        .env("RUST_LOG", bytes(b"\xff"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(0), "{out:?}");

    // A config path that is not UTF-8 is a path like any other: named, not found.
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.arg("check")
        .env("TUNNELGATE_CONFIG", bytes(b"/nonexistent-ts/\xff.toml"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("/nonexistent-ts/"), "{out:?}");

    // `tunnelgate-wg` reads its seccomp policy from the environment only: a value that is
    // not UTF-8 stops it before anything else (not the default policy taken in silence).
    let mut cmd = Command::new(tunnelgate_bin());
    cmd.arg0("tunnelgate-wg")
        .arg("ts/bad")
        .env("WG_PROCESS_FOREGROUND", "1")
        .env("TUNNELGATE_SECCOMP", bytes(b"of\xff"));
    let out = common::output_of(cmd, None);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("TUNNELGATE_SECCOMP") && out.stderr.contains("not UTF-8"),
        "{out:?}"
    );
}
