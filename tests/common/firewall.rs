//! The firewall backends (nftables, iptables-nft, iptables-legacy) and `per_backend!`, for suites that
//! run one body per backend; [`PathShim`], a firewall program on `PATH` that fails or hangs on demand.

use super::*;

/// The firewall backends a daemon can use (each suite writes its own `[firewall]` section with
/// [`Backend::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    IptablesNft,
    IptablesLegacy,
}

impl Backend {
    /// `firewall.mode` selecting this backend (the iptables flavour comes from [`Backend::env`]).
    pub fn mode(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            _ => "iptables",
        }
    }

    /// The daemon's environment for this backend.
    pub fn env(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Backend::Nftables => vec![],
            Backend::IptablesNft => vec![("TUNNELGATE_IPTABLES", "nft")],
            Backend::IptablesLegacy => vec![("TUNNELGATE_IPTABLES", "legacy")],
        }
    }

    /// The `backend` label of the rule metrics.
    pub fn label(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            Backend::IptablesNft => "iptables",
            Backend::IptablesLegacy => "iptables-legacy",
        }
    }

    pub fn is_iptables(self) -> bool {
        self != Backend::Nftables
    }

    /// `iptables` / `ip6tables` of this flavour.
    pub fn iptables(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy",
            (_, false) => "iptables",
            (_, true) => "ip6tables",
        }
    }

    pub fn iptables_save(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy-save",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy-save",
            (_, false) => "iptables-save",
            (_, true) => "ip6tables-save",
        }
    }

    /// The programs the daemon runs to change rules (what a failing backend means).
    pub fn apply_programs(self) -> &'static [&'static str] {
        match self {
            Backend::Nftables => &["nft"],
            Backend::IptablesNft => &["iptables-restore", "ip6tables-restore"],
            Backend::IptablesLegacy => &["iptables-legacy-restore", "ip6tables-legacy-restore"],
        }
    }

    /// Checks that this machine's tools are what the backend's name promises.
    pub fn check_tools(self) {
        if self == Backend::IptablesNft {
            let v = run(&["iptables", "--version"]);
            assert!(
                v.contains("nf_tables"),
                "`iptables` is not iptables-nft here: {v}"
            );
        }
    }
}

/// Makes one `#[test]` per backend for each named test body `fn NAME(Backend)` of the suite.
#[allow(unused_macros)] // every suite compiles the harness; only some run per backend
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod nftables {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::Nftables) })*
        }
        mod iptables_nft {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesNft) })*
        }
        mod iptables_legacy {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesLegacy) })*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_backend;

/// What a [`PathShim`]'s program does while its switch is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShimFault {
    /// Prints `<program>: injected failure (fault test)` and exits 1, as a broken backend would.
    Fail,
    /// Runs `sleep <mark>000` (a mark [`PathShim::hanging_sleeps`] finds), as a wedged one would.
    Hang(&'static str),
}

/// A directory to put first on a daemon's `PATH`, with a wrapper for one firewall program
/// (`nft`, ...) that runs the real one, unless its switch is on: then it fails or hangs
/// ([`ShimFault`]). Each call is logged with its time, `ok` or `FAIL`, and its arguments.
pub struct PathShim {
    dir: TempDir,
}

impl PathShim {
    pub fn new(program: &str, fault: ShimFault) -> PathShim {
        let real = run(&["sh", "-c", &format!("command -v {program}")]);
        let dir = TempDir::new("tgshim");
        let log = dir.path().join("calls");
        let flag = dir.path().join("on");
        let faulty = match fault {
            ShimFault::Fail => format!(
                "echo \"$(date +%s.%N) FAIL $*\" >> '{log}'\n\
                 echo '{program}: injected failure (fault test)' >&2\n\
                 exit 1\n",
                log = log.display(),
            ),
            ShimFault::Hang(mark) => format!("sleep {mark}000\nexit 0\n"),
        };
        dir.write_mode(
            program,
            &format!(
                "#!/bin/sh\n\
                 if [ -e '{flag}' ]; then\n\
                 {faulty}\
                 fi\n\
                 echo \"$(date +%s.%N) ok $*\" >> '{log}'\n\
                 exec {real} \"$@\"\n",
                flag = flag.display(),
                log = log.display(),
                real = real.trim(),
            ),
            0o755,
        );
        PathShim { dir }
    }

    /// `PATH` with the shim first.
    pub fn path_env(&self) -> String {
        format!(
            "{}:{}",
            self.dir.path().display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }

    /// Turns the fault on or off.
    pub fn set_faulty(&self, on: bool) {
        if on {
            self.dir.write("on", "");
        } else {
            let _ = std::fs::remove_file(self.dir.path().join("on"));
        }
    }

    /// The times, in seconds, of the failed calls whose arguments start with `args`.
    pub fn failed_calls(&self, args: &str) -> Vec<f64> {
        let needle = format!(" FAIL {args}");
        std::fs::read_to_string(self.dir.path().join("calls"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&needle))
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    }

    /// The pids of the hanging `sleep`s of a [`ShimFault::Hang`] with `mark` (in any namespace:
    /// pids are global here).
    pub fn hanging_sleeps(mark: &str) -> Vec<u32> {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return vec![];
        };
        let mark = format!("sleep\0{mark}000\0");
        procs
            .filter_map(Result::ok)
            .filter_map(|p| {
                let pid: u32 = p.file_name().to_str()?.parse().ok()?;
                let cmdline = std::fs::read(p.path().join("cmdline")).ok()?;
                cmdline
                    .windows(mark.len())
                    .any(|w| w == mark.as_bytes())
                    .then_some(pid)
            })
            .collect()
    }
}
