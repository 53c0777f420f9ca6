//! The queue and scheduling knobs (`TUNNELGATE_SOCKET_BUFFER`, `TUNNELGATE_TUN_TXQUEUELEN`,
//! `TUNNELGATE_AQM_TARGET_US`, `TUNNELGATE_AQM_INTERVAL_US`, `TUNNELGATE_RT_PRIORITY`,
//! `TUNNELGATE_RT_SHARE_PERCENT`, `TUNNELGATE_RELAY_PARTNERS`, `TUNNELGATE_NO_UDP_GRO`,
//! `TUNNELGATE_NO_UDP_GSO`) and the CPUs
//! the process may use, read once by the composition root (`shell::process::main`) into one
//! [`Tuning`] and passed down: the data plane, the sockets and the TUN device take their values
//! from it, and `check` and `status` show it. A value that is not a number in range is named in
//! a warning and the default stays, as for `TUNNELGATE_IPTABLES`.

use crate::core::aqm;
use crate::core::priority::Budget;
use std::ffi::{OsStr, OsString};
use std::ops::RangeInclusive;
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
    /// Values not taken, each naming its variable, for the start's log and `check`.
    pub warnings: Vec<String>,
}

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
        let mut number = |name: &str, range: RangeInclusive<u64>, default: u64| -> u64 {
            match bounded(name, var(name).as_deref(), &range) {
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
        let relay_partners = match bounded(
            "TUNNELGATE_RELAY_PARTNERS",
            var("TUNNELGATE_RELAY_PARTNERS").as_deref(),
            &(0..=3),
        ) {
            Ok(asked) => asked,
            Err(e) => {
                warnings.push(format!(
                    "{e}; using the default (as many as the CPUs allow)"
                ));
                None
            }
        };
        Tuning {
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
            udp_gro: var("TUNNELGATE_NO_UDP_GRO").is_none(),
            udp_gso: var("TUNNELGATE_NO_UDP_GSO").is_none(),
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

/// `value` of variable `name` as a number in `range`: `Ok(None)` when unset or empty, `Err`
/// (naming the variable, an escaped excerpt of at most 32 characters and the range) otherwise.
pub fn bounded(
    name: &str,
    value: Option<&OsStr>,
    range: &RangeInclusive<u64>,
) -> Result<Option<u64>, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match value.to_str().and_then(|v| v.parse::<u64>().ok()) {
        Some(n) if range.contains(&n) => Ok(Some(n)),
        _ => {
            let shown: String = value.to_string_lossy().chars().take(32).collect();
            Err(format!(
                "{name}={shown:?}: expected a number from {} to {}",
                range.start(),
                range.end()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::os::unix::ffi::OsStrExt as _;

    const RANGE: RangeInclusive<u64> = 16..=65536;

    fn parse(raw: &[u8]) -> Result<Option<u64>, String> {
        bounded("TUNNELGATE_X", Some(OsStr::from_bytes(raw)), &RANGE)
    }

    fn tuning(vars: &[(&str, &[u8])]) -> Tuning {
        let vars: BTreeMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsStr::from_bytes(v).to_os_string()))
            .collect();
        Tuning::from_vars(|name| vars.get(name).cloned(), Default::default())
    }

    #[test]
    fn unset_or_empty_means_the_default_and_a_number_in_range_is_taken() {
        assert_eq!(bounded("TUNNELGATE_X", None, &RANGE), Ok(None));
        assert_eq!(parse(b""), Ok(None));
        assert_eq!(parse(b"16"), Ok(Some(16)));
        assert_eq!(parse(b"65536"), Ok(Some(65536)));
    }

    #[test]
    fn garbage_out_of_range_huge_and_not_utf8_values_are_named_short() {
        for raw in [
            &b"15"[..],
            b"65537",
            b"-1",
            b"4k",
            b" 512",
            b"99999999999999999999999999",
            b"\xff\xfe",
            &[b'7'; 100_000],
        ] {
            let e = parse(raw).expect_err("refused");
            assert!(e.starts_with("TUNNELGATE_X=\""), "{e}");
            assert!(e.ends_with("expected a number from 16 to 65536"), "{e}");
            assert!(e.len() < 160, "{e}");
        }
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
        assert!(t.warnings.is_empty());
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
            ("TUNNELGATE_RELAY_PARTNERS", b"3"),
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
        assert!(t.warnings.is_empty(), "{:?}", t.warnings);
        let off = tuning(&[
            ("TUNNELGATE_AQM_TARGET_US", b"0"),
            ("TUNNELGATE_RT_PRIORITY", b"0"),
        ]);
        assert_eq!((off.aqm, off.rt_priority), (None, None));
        assert!(!off.socket_options().timestamps);
    }

    #[test]
    fn every_bad_value_is_named_once_and_its_default_stays() {
        let long = [b'9'; 100_000];
        let t = tuning(&[
            ("TUNNELGATE_AQM_TARGET_US", b"1ms"),
            ("TUNNELGATE_AQM_INTERVAL_US", b"999"),
            ("TUNNELGATE_RT_PRIORITY", b"50"),
            ("TUNNELGATE_RT_SHARE_PERCENT", b"100"),
            ("TUNNELGATE_SOCKET_BUFFER", &long),
            ("TUNNELGATE_TUN_TXQUEUELEN", b"\xff"),
            ("TUNNELGATE_RELAY_PARTNERS", b"4"),
        ]);
        assert_eq!(
            t,
            Tuning {
                warnings: t.warnings.clone(),
                ..tuning(&[])
            }
        );
        assert_eq!(t.warnings.len(), 7, "{:?}", t.warnings);
        for (w, name) in t.warnings.iter().zip([
            "TUNNELGATE_SOCKET_BUFFER=",
            "TUNNELGATE_TUN_TXQUEUELEN=",
            "TUNNELGATE_AQM_TARGET_US=",
            "TUNNELGATE_AQM_INTERVAL_US=",
            "TUNNELGATE_RT_PRIORITY=",
            "TUNNELGATE_RT_SHARE_PERCENT=",
            "TUNNELGATE_RELAY_PARTNERS=",
        ]) {
            assert!(
                w.starts_with(name) && w.contains("using the default") && w.len() < 160,
                "{w}"
            );
        }
    }
}
