//! How a bad configuration is run and judged: cases, what is expected, refusal without touching the host.

use super::*;

/// A valid configuration (one change away from each bad case), written to its own directory
/// with a 0600 key file and a 0600 preshared-key file.
pub(crate) struct Case {
    pub(crate) dir: TempDir,
    pub(crate) name: String,
    pub(crate) private: String,
}

impl Case {
    pub(crate) fn new() -> Case {
        let name = unique_name("tgt");
        let dir = TempDir::new(&name);
        let private = genkey();
        dir.write_secret("private.key", &format!("{private}\n"));
        dir.write_secret("psk", &format!("{}\n", genkey()));
        Case { dir, name, private }
    }

    /// The valid base text. Health is disabled so that nothing would bind even if it ran.
    pub(crate) fn base(&self) -> String {
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
    pub(crate) fn write(&self, from: &str, to: &str) -> PathBuf {
        let base = self.base();
        assert!(base.contains(from), "{from:?} is not in the base config");
        let text = base.replacen(from, to, 1);
        self.dir.write("tunnelgate.toml", &text)
    }
}

/// What a bad case must produce: an error line for `key` that contains every needle; nothing in
/// stderr or stdout may contain a `secret`.
pub(crate) struct Expect<'a> {
    pub(crate) key: &'a str,
    pub(crate) needles: &'a [&'a str],
    pub(crate) secrets: &'a [&'a str],
}

/// Runs `tunnelgate run --config path` with a deadline: a valid config would start a daemon
/// (as root), which must not happen here.
pub(crate) fn run_expecting_refusal(path: &Path, dir: &TempDir) -> CmdOutput {
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
pub(crate) fn net_devices() -> BTreeSet<String> {
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
pub(crate) fn assert_untouched(name: &str) {
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
pub(crate) fn assert_rejected(case: &Case, path: &Path, what: &str, expect: &Expect) {
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
pub(crate) type BadCase = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
);
