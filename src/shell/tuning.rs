//! Every `TUNNELGATE_*` environment variable the process reads, read here and nowhere else
//! (`tests/architecture.rs` holds every other file to it; the test hooks' variable is the one
//! exception, in `shell::test_hooks` under the `test-hooks` feature, never in a user's build;
//! options that clap also takes from the environment, `#[arg(env = ...)]`, are command-line
//! options and clap parses them). The queue and scheduling knobs (`TUNNELGATE_SOCKET_BUFFER`,
//! `TUNNELGATE_TUN_TXQUEUELEN`, `TUNNELGATE_AQM_TARGET_US`, `TUNNELGATE_AQM_INTERVAL_US`,
//! `TUNNELGATE_RT_PRIORITY`, `TUNNELGATE_RT_SHARE_PERCENT`, `TUNNELGATE_RELAY_PARTNERS`,
//! `TUNNELGATE_NO_UDP_GRO`, `TUNNELGATE_NO_UDP_GSO`), the firewall's `TUNNELGATE_IPTABLES`, the
//! packet threads' `TUNNELGATE_SECCOMP` and the CPUs the process may use are read once by the
//! composition root (`shell::process::main`) into one [`Tuning`] and passed down: the data
//! plane, the sockets and the TUN device take their values from it, and `check` and `status`
//! show it. The paths (`TUNNELGATE_RUN_DIR`, `TUNNELGATE_RESOLV_CONF`) and the log format are
//! read where they are needed, through the functions below. Each value is parsed strictly
//! (`core::knobs`): a value that is not a number in range, one of its words or a flag is named
//! in a warning and the default stays.

use crate::core::aqm;
use crate::core::knobs;
use crate::core::priority::Budget;
use crate::core::seccomp::Policy;
use std::ffi::OsString;
use std::ops::RangeInclusive;
use std::os::unix::ffi::OsStrExt as _;
use std::path::PathBuf;
use std::time::Duration;

/// Kernel socket buffer size. The default ~208 KB drops packets at a few hundred Mbit/s;
/// wireguard-go upstream settled on 7 MB.
pub const DEFAULT_SOCKET_BUFFER_BYTES: usize = 7 << 20;

/// Packets the kernel queues for us before dropping (Linux's TUN default is 500). A 1 Gbit/s
/// burst of small UDP packets outruns the reader for a moment while it shares the CPU; 500
/// lost up to 10 % of iperf3's datagrams at 1 Gbit/s offered, 4096 none in the same runs.
/// Senders' socket buffers still bound what can pile up here.
pub const DEFAULT_TUN_TXQUEUELEN: u32 = 4096;

/// The default real-time priority: the lowest, above every ordinary thread and below every
/// other real-time one.
pub const DEFAULT_RT_PRIORITY: i32 = 1;

/// The knobs in force. Made once at start ([`Tuning::from_env`]); nothing reads the
/// environment for them afterwards.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    /// The packet readers' `SCHED_FIFO` priority; `None`: normal priority only.
    pub rt_priority: Option<i32>,
    /// How much CPU time the readers may spend at real-time priority.
    pub rt_budget: Budget,
    /// CoDel on each receive queue; `None`: off.
    pub aqm: Option<aqm::Settings>,
    /// Each WireGuard socket's send and receive buffer.
    pub socket_buffer_bytes: usize,
    /// The TUN device's transmit queue, in packets.
    pub tun_txqueuelen: u32,
    /// UDP generic receive offload on the WireGuard sockets (off: `TUNNELGATE_NO_UDP_GRO`).
    pub udp_gro: bool,
    /// UDP segmentation offload on the WireGuard sockets (off: `TUNNELGATE_NO_UDP_GSO`).
    pub udp_gso: bool,
    /// At most this many relay partners per packet reader (`TUNNELGATE_RELAY_PARTNERS`, 0-3;
    /// 0: the relay is off). `None`, the default: as many as the CPUs allow
    /// (`core::relay::allowed`, `core::relay::partners`).
    pub relay_partners: Option<usize>,
    /// The CPUs the process may use: its affinity, and its cgroup's quota.
    pub cpus: crate::shell::cgroup::Cpus,
    /// The packet threads' seccomp policy `TUNNELGATE_SECCOMP` names (`--seccomp` is the same
    /// option); `None`: unset.
    pub seccomp: Option<Policy>,
    /// The iptables flavour `TUNNELGATE_IPTABLES` names: `Some(true)` for `legacy`,
    /// `Some(false)` for `nft`; `None`: follow the host.
    pub iptables_legacy: Option<bool>,
    /// Every `TUNNELGATE_*` variable set, as `NAME="value"` (shortened), for `check`.
    pub environment: Vec<String>,
    /// Values not taken, each naming its variable, for the start's log and `check`.
    pub warnings: Vec<String>,
}

const SECCOMP: &str = crate::shell::seccomp::POLICY_ENV;
const IPTABLES: &str = "TUNNELGATE_IPTABLES";
const RUN_DIR: &str = crate::telemetry::status::RUN_DIR_ENV;
/// The resolver's configuration file, for tests (`shell::resolver`).
pub const RESOLV_CONF: &str = "TUNNELGATE_RESOLV_CONF";
/// Where the endpoints this identity authenticated are kept across a restart
/// (`shell::endpoints`), unless `takeover.state_file` says.
pub const STATE_DIR: &str = "TUNNELGATE_STATE_DIR";
/// The state directory systemd gives a unit with `StateDirectory=` (its first path).
const SYSTEMD_STATE_DIRECTORY: &str = "STATE_DIRECTORY";
const LOG_FORMAT: &str = crate::shell::logging::LOG_FORMAT_ENV;

/// Every variable a user may set, as `check` lists them.
pub const KNOBS: [&str; 15] = [
    "TUNNELGATE_SOCKET_BUFFER",
    "TUNNELGATE_TUN_TXQUEUELEN",
    "TUNNELGATE_AQM_TARGET_US",
    "TUNNELGATE_AQM_INTERVAL_US",
    "TUNNELGATE_RT_PRIORITY",
    "TUNNELGATE_RT_SHARE_PERCENT",
    "TUNNELGATE_RELAY_PARTNERS",
    "TUNNELGATE_NO_UDP_GRO",
    "TUNNELGATE_NO_UDP_GSO",
    SECCOMP,
    IPTABLES,
    RUN_DIR,
    RESOLV_CONF,
    STATE_DIR,
    LOG_FORMAT,
];

impl Default for Tuning {
    /// The defaults, with the CPUs of the machine (no quota): for tests and benches that build
    /// a data plane without the composition root.
    fn default() -> Tuning {
        Tuning::from_vars(|_| None, crate::shell::cgroup::Cpus::default())
    }
}

impl Tuning {
    /// Reads the knobs from this process's environment and the CPUs from its affinity and
    /// cgroup. Called once, by the composition root.
    pub fn from_env() -> Tuning {
        Tuning::from_vars(
            |name| std::env::var_os(name),
            crate::shell::cgroup::Cpus::read(),
        )
    }

    /// The knobs from `var` (a variable's value, `None` when unset), with `cpus`.
    pub fn from_vars(
        var: impl Fn(&str) -> Option<OsString>,
        cpus: crate::shell::cgroup::Cpus,
    ) -> Tuning {
        let mut warnings = Vec::new();
        let mut environment = Vec::new();
        let raw = |name: &str| var(name).map(|v| v.as_bytes().to_vec());
        let mut number = |name: &str, range: RangeInclusive<u64>, default: u64| -> u64 {
            match knobs::number(name, raw(name).as_deref(), &range) {
                Ok(value) => value.unwrap_or(default),
                Err(e) => {
                    warnings.push(format!("{e}; using the default {default}"));
                    default
                }
            }
        };
        let socket_buffer_bytes = number(
            "TUNNELGATE_SOCKET_BUFFER",
            64 << 10..=64 << 20,
            DEFAULT_SOCKET_BUFFER_BYTES as u64,
        );
        let tun_txqueuelen = number(
            "TUNNELGATE_TUN_TXQUEUELEN",
            16..=65536,
            u64::from(DEFAULT_TUN_TXQUEUELEN),
        );
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let aqm_target = number(
            "TUNNELGATE_AQM_TARGET_US",
            0..=100_000,
            micros(aqm::DEFAULT_TARGET),
        );
        let aqm_interval = number(
            "TUNNELGATE_AQM_INTERVAL_US",
            1_000..=1_000_000,
            micros(aqm::DEFAULT_INTERVAL),
        );
        // 0 keeps the readers at normal priority; at most 49, below the kernel's interrupt
        // threads (50).
        let rt_priority = number("TUNNELGATE_RT_PRIORITY", 0..=49, DEFAULT_RT_PRIORITY as u64);
        // At most 95 %: the kernel's own limit for all real-time threads together.
        let share = number(
            "TUNNELGATE_RT_SHARE_PERCENT",
            5..=95,
            u64::from(crate::core::priority::budget::DEFAULT_SHARE_PERCENT),
        );
        // Unset: as many as the CPUs allow (`core::relay::allowed`).
        let relay_partners = match knobs::number(
            "TUNNELGATE_RELAY_PARTNERS",
            raw("TUNNELGATE_RELAY_PARTNERS").as_deref(),
            &(0..=crate::core::relay::MAX_PARTNERS as u64),
        ) {
            Ok(asked) => asked,
            Err(e) => {
                warnings.push(format!(
                    "{e}; using the default (as many as the CPUs allow)"
                ));
                None
            }
        };
        // A flag: 1 or true turns the offload off, 0 or false leaves it on.
        let mut off = |name: &str| match knobs::flag(name, raw(name).as_deref()) {
            Ok(off) => off.unwrap_or(false),
            Err(e) => {
                warnings.push(format!("{e}; leaving the offload on"));
                false
            }
        };
        let (no_gro, no_gso) = (off("TUNNELGATE_NO_UDP_GRO"), off("TUNNELGATE_NO_UDP_GSO"));
        let seccomp = match seccomp_policy_from(raw(SECCOMP).as_deref()) {
            Ok(policy) => policy,
            Err(e) => {
                warnings.push(format!("{e}; using {}", Policy::default()));
                None
            }
        };
        let iptables_legacy = match iptables_flavour_from(raw(IPTABLES).as_deref()) {
            Ok(flavour) => flavour,
            Err(e) => {
                warnings.push(format!("{e}; choosing by the rules on the host"));
                None
            }
        };
        // Parsed by clap for `run` (`--log-format`'s fallback); named here too, so `check` and
        // `tunnelgate-wg` warn of it like of any other.
        if let Err(e) = knobs::word(
            LOG_FORMAT,
            raw(LOG_FORMAT).as_deref(),
            &["human", "text", "json", "journal"],
        ) {
            warnings.push(format!("{e}; using human"));
        }
        for name in [RUN_DIR, RESOLV_CONF, STATE_DIR] {
            if let Err(e) = knobs::path(name, raw(name).as_deref()) {
                warnings.push(format!("{e}; using the default"));
            }
        }
        for name in KNOBS {
            if let Some(value) = raw(name) {
                let shown: String = String::from_utf8_lossy(&value).chars().take(32).collect();
                environment.push(format!("{name}={shown:?}"));
            }
        }
        Tuning {
            seccomp,
            iptables_legacy,
            environment,
            relay_partners: relay_partners.and_then(|n| usize::try_from(n).ok()),
            rt_priority: i32::try_from(rt_priority).ok().filter(|p| *p > 0),
            // Within what the cgroup lets real-time threads run, if it limits them.
            rt_budget: cpus.cap_realtime(Budget {
                share_percent: u32::try_from(share).unwrap_or(50),
                ..Budget::default()
            }),
            aqm: (aqm_target > 0).then(|| aqm::Settings {
                target: Duration::from_micros(aqm_target),
                interval: Duration::from_micros(aqm_interval),
            }),
            socket_buffer_bytes: usize::try_from(socket_buffer_bytes)
                .unwrap_or(DEFAULT_SOCKET_BUFFER_BYTES),
            tun_txqueuelen: u32::try_from(tun_txqueuelen).unwrap_or(DEFAULT_TUN_TXQUEUELEN),
            udp_gro: !no_gro,
            udp_gso: !no_gso,
            cpus,
            warnings,
        }
    }

    /// The thousandths of a CPU all packet readers together may use (affinity or quota,
    /// whichever is lower): the base of the process's real-time budget.
    pub fn usable_cpus_milli(&self) -> u64 {
        crate::core::cgroup::usable_milli(self.cpus.affinity, self.cpus.quota_milli)
    }

    /// What the WireGuard sockets are made with.
    pub fn socket_options(&self) -> crate::shell::udp::SocketOptions {
        crate::shell::udp::SocketOptions {
            buffer_bytes: self.socket_buffer_bytes,
            gro: self.udp_gro,
            gso: self.udp_gso,
            timestamps: self.aqm.is_some(),
        }
    }
}

/// The policy `value` of `TUNNELGATE_SECCOMP` names: `Ok(None)` when unset, the warning for
/// anything but `enforce`, `log` or `off`.
fn seccomp_policy_from(value: Option<&[u8]>) -> Result<Option<Policy>, String> {
    let words = Policy::NAMES;
    Ok(knobs::word(SECCOMP, value, &words)?.and_then(|i| words[i].parse().ok()))
}

/// The iptables flavour `value` of `TUNNELGATE_IPTABLES` names (`Some(true)`: legacy).
fn iptables_flavour_from(value: Option<&[u8]>) -> Result<Option<bool>, String> {
    Ok(knobs::word(IPTABLES, value, &["legacy", "nft"])?.map(|i| i == 0))
}

fn env_bytes(name: &str) -> Option<Vec<u8>> {
    std::env::var_os(name).map(|v| v.as_bytes().to_vec())
}

/// `TUNNELGATE_SECCOMP` for `tunnelgate-wg`, whose command line (wireguard-go's) has no room
/// for `--seccomp`: the default when unset, the warning otherwise.
pub fn seccomp_policy() -> Result<Policy, String> {
    Ok(seccomp_policy_from(env_bytes(SECCOMP).as_deref())?.unwrap_or_default())
}

/// `TUNNELGATE_IPTABLES`, as the firewall chooses its backend: a refused value follows the
/// host (the warning is [`Tuning::warnings`]', logged at start and shown by `check`).
pub fn iptables_flavour() -> Option<bool> {
    iptables_flavour_from(env_bytes(IPTABLES).as_deref())
        .ok()
        .flatten()
}

/// The path a variable names, `None` when unset or refused (empty).
fn path_var(name: &str) -> Option<PathBuf> {
    knobs::path(name, env_bytes(name).as_deref())
        .ok()
        .flatten()
        .map(|p| PathBuf::from(std::ffi::OsStr::from_bytes(&p)))
}

/// `TUNNELGATE_RUN_DIR`: where the status and UAPI sockets and shared records live.
pub fn run_dir() -> Option<PathBuf> {
    path_var(RUN_DIR)
}

/// `TUNNELGATE_RESOLV_CONF`: the resolver's configuration file, for tests.
pub fn resolv_conf() -> Option<PathBuf> {
    path_var(RESOLV_CONF)
}

/// The folder of the endpoints file: `TUNNELGATE_STATE_DIR`, else the first of systemd's
/// `STATE_DIRECTORY` (colon-separated), else `None` (the caller's default).
pub fn state_dir() -> Option<PathBuf> {
    path_var(STATE_DIR).or_else(|| {
        let given = std::env::var_os(SYSTEMD_STATE_DIRECTORY)?;
        let first = given.as_bytes().split(|b| *b == b':').next()?;
        (!first.is_empty()).then(|| PathBuf::from(std::ffi::OsStr::from_bytes(first)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::ffi::OsStr;

    fn tuning(vars: &[(&str, &[u8])]) -> Tuning {
        let vars: BTreeMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsStr::from_bytes(v).to_os_string()))
            .collect();
        Tuning::from_vars(|name| vars.get(name).cloned(), Default::default())
    }

    #[test]
    fn the_defaults_with_nothing_set() {
        let t = tuning(&[]);
        assert_eq!(t.rt_priority, Some(DEFAULT_RT_PRIORITY));
        assert_eq!(t.rt_budget, Budget::default());
        assert_eq!(t.aqm, Some(aqm::Settings::default()));
        assert_eq!(t.socket_buffer_bytes, DEFAULT_SOCKET_BUFFER_BYTES);
        assert_eq!(t.tun_txqueuelen, DEFAULT_TUN_TXQUEUELEN);
        assert!(t.udp_gro && t.udp_gso);
        assert_eq!(t.relay_partners, None, "the CPUs decide");
        assert_eq!((t.seccomp, t.iptables_legacy), (None, None));
        assert!(t.warnings.is_empty());
        assert!(t.environment.is_empty());
    }

    #[test]
    fn each_knob_is_taken_and_zero_turns_aqm_and_realtime_off() {
        let t = tuning(&[
            ("TUNNELGATE_AQM_TARGET_US", b"500"),
            ("TUNNELGATE_AQM_INTERVAL_US", b"100000"),
            ("TUNNELGATE_RT_PRIORITY", b"49"),
            ("TUNNELGATE_RT_SHARE_PERCENT", b"80"),
            ("TUNNELGATE_SOCKET_BUFFER", b"262144"),
            ("TUNNELGATE_TUN_TXQUEUELEN", b"512"),
            ("TUNNELGATE_NO_UDP_GRO", b"1"),
            ("TUNNELGATE_NO_UDP_GSO", b"false"),
            ("TUNNELGATE_RELAY_PARTNERS", b"3"),
            ("TUNNELGATE_SECCOMP", b"log"),
            ("TUNNELGATE_IPTABLES", b"legacy"),
        ]);
        assert_eq!(t.relay_partners, Some(3));
        let off = tuning(&[("TUNNELGATE_RELAY_PARTNERS", b"0")]);
        assert_eq!(off.relay_partners, Some(0));
        assert_eq!(
            t.aqm,
            Some(aqm::Settings {
                target: Duration::from_micros(500),
                interval: Duration::from_millis(100)
            })
        );
        assert_eq!(t.rt_priority, Some(49));
        assert_eq!(t.rt_budget.share_percent, 80);
        assert_eq!((t.socket_buffer_bytes, t.tun_txqueuelen), (262_144, 512));
        assert!(!t.udp_gro && t.udp_gso);
        assert_eq!(
            (t.seccomp, t.iptables_legacy),
            (Some(Policy::Log), Some(true))
        );
        assert!(t.warnings.is_empty(), "{:?}", t.warnings);
        assert_eq!(t.environment.len(), 11, "{:?}", t.environment);
        assert!(t
            .environment
            .contains(&"TUNNELGATE_NO_UDP_GRO=\"1\"".to_string()));
        let off = tuning(&[
            ("TUNNELGATE_AQM_TARGET_US", b"0"),
            ("TUNNELGATE_RT_PRIORITY", b"0"),
        ]);
        assert_eq!((off.aqm, off.rt_priority), (None, None));
        assert!(!off.socket_options().timestamps);
    }

    /// A flag is not a presence flag: 0 and false leave the offload on.
    #[test]
    fn an_offload_flag_of_zero_or_false_leaves_the_offload_on() {
        for value in [&b"0"[..], b"false"] {
            let t = tuning(&[
                ("TUNNELGATE_NO_UDP_GRO", value),
                ("TUNNELGATE_NO_UDP_GSO", value),
            ]);
            assert!(t.udp_gro && t.udp_gso, "{value:?}");
            assert!(t.warnings.is_empty(), "{:?}", t.warnings);
        }
        let t = tuning(&[
            ("TUNNELGATE_NO_UDP_GRO", b"true"),
            ("TUNNELGATE_NO_UDP_GSO", b"1"),
        ]);
        assert!(!t.udp_gro && !t.udp_gso);
    }

    #[test]
    fn every_bad_value_is_named_once_and_its_default_stays() {
        let long = [b'9'; 100_000];
        let t = tuning(&[
            ("TUNNELGATE_AQM_TARGET_US", b"1ms"),
            ("TUNNELGATE_AQM_INTERVAL_US", b"999"),
            ("TUNNELGATE_RT_PRIORITY", b"+2"),
            ("TUNNELGATE_RT_SHARE_PERCENT", b"100"),
            ("TUNNELGATE_SOCKET_BUFFER", &long),
            ("TUNNELGATE_TUN_TXQUEUELEN", b"\xff"),
            ("TUNNELGATE_RELAY_PARTNERS", b"4"),
            ("TUNNELGATE_NO_UDP_GRO", b""),
            ("TUNNELGATE_NO_UDP_GSO", b"yes"),
            ("TUNNELGATE_SECCOMP", b"bogus"),
            ("TUNNELGATE_IPTABLES", b"bogus"),
            ("TUNNELGATE_RUN_DIR", b""),
            ("TUNNELGATE_RESOLV_CONF", b""),
            ("TUNNELGATE_LOG_FORMAT", b"JSON"),
        ]);
        assert_eq!(
            t,
            Tuning {
                warnings: t.warnings.clone(),
                environment: t.environment.clone(),
                ..tuning(&[])
            }
        );
        assert_eq!(t.warnings.len(), 14, "{:?}", t.warnings);
        for (w, name) in t.warnings.iter().zip([
            "TUNNELGATE_SOCKET_BUFFER=",
            "TUNNELGATE_TUN_TXQUEUELEN=",
            "TUNNELGATE_AQM_TARGET_US=",
            "TUNNELGATE_AQM_INTERVAL_US=",
            "TUNNELGATE_RT_PRIORITY=\"+2\"",
            "TUNNELGATE_RT_SHARE_PERCENT=",
            "TUNNELGATE_RELAY_PARTNERS=",
            "TUNNELGATE_NO_UDP_GRO=\"\"",
            "TUNNELGATE_NO_UDP_GSO=",
            "TUNNELGATE_SECCOMP=\"bogus\"",
            "TUNNELGATE_IPTABLES=\"bogus\"",
            "TUNNELGATE_LOG_FORMAT=\"JSON\"",
            "TUNNELGATE_RUN_DIR=\"\"",
            "TUNNELGATE_RESOLV_CONF=\"\"",
        ]) {
            assert!(
                w.starts_with(name) && w.contains(": expected ") && w.len() < 200,
                "{w}"
            );
        }
    }
}
