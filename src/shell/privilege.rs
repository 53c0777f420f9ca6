//! Least privilege (issue 15): before the daemon starts its first thread it gives up every
//! capability it will not need, for itself and for the `nft` / `iptables-restore` it runs.
//!
//! Capabilities are per thread in Linux: `capset(2)` and `PR_CAPBSET_DROP` change only the
//! calling thread, and a thread inherits its creator's sets. So the drop happens once, while
//! the process is still single-threaded ([`drop_to`] refuses otherwise), before the tokio
//! workers, the packet threads and the netlink task exist; every later thread and child
//! starts from the reduced sets. Start-up itself (TUN device, sockets, health listener) needs
//! nothing beyond what is kept.
//!
//! What is kept ([`needed`], pure):
//! - `CAP_NET_ADMIN`, always: TUN (`TUNSETIFF`), addresses, routes and policy rules (netlink,
//!   also on every reload), `SO_MARK` and `SO_RCVBUFFORCE` on the WireGuard socket, and the
//!   `nft` / `iptables-nft` it runs. Writing the forwarding sysctls needs no capability for
//!   uid 0 (the files are root's and mode 0644), and neither do the sockets and records under
//!   `/run` (root-owned).
//! - `CAP_NET_RAW`, only when the firewall backend is iptables-legacy: libiptc talks to the
//!   kernel through a raw socket (checked: `iptables-legacy -A` without it fails "Permission
//!   denied (you must be root)"; nft and iptables-nft use netlink only).
//! - `CAP_NET_BIND_SERVICE`, only when the configuration binds a port below 1024 (WireGuard
//!   `listen_port` or the health port), since a reload or `wg set` rebinds the WireGuard socket.
//!
//! Everything else leaves the effective, permitted, inheritable, ambient and bounding sets,
//! and `PR_SET_NO_NEW_PRIVS` is set. A child run as uid 0 gets the bounding set as its
//! permitted set on `execve`, which is exactly the kept set, so `nft` and
//! `iptables-restore` keep working; with no-new-privs nothing can ever gain more.

use std::fmt;

use crate::config::{Config, FirewallMode};
use crate::shell::firewall::{self, Backend};

/// `CAP_NET_BIND_SERVICE` (linux/capability.h).
pub const CAP_NET_BIND_SERVICE: u32 = 10;
/// `CAP_NET_ADMIN`.
pub const CAP_NET_ADMIN: u32 = 12;
/// `CAP_NET_RAW`.
pub const CAP_NET_RAW: u32 = 13;

/// A set of capabilities, bit `n` for capability `n` (the `/proc/<pid>/status` layout).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps(pub u64);

impl Caps {
    pub fn with(self, cap: u32) -> Caps {
        Caps(self.0 | (1u64 << cap))
    }

    pub fn has(self, cap: u32) -> bool {
        cap < 64 && self.0 & (1u64 << cap) != 0
    }

    fn iter(self) -> impl Iterator<Item = u32> {
        (0..64).filter(move |c| self.has(*c))
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.iter().map(cap_name).collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(" "))
        }
    }
}

/// `CAP_NET_ADMIN` and friends by number; others as `cap_<n>`.
pub fn cap_name(cap: u32) -> String {
    match cap {
        CAP_NET_BIND_SERVICE => "CAP_NET_BIND_SERVICE".into(),
        CAP_NET_ADMIN => "CAP_NET_ADMIN".into(),
        CAP_NET_RAW => "CAP_NET_RAW".into(),
        n => format!("cap_{n}"),
    }
}

/// The capabilities the daemon for `config` needs once running (see the module docs);
/// `legacy_iptables`: the firewall backend is iptables-legacy.
pub fn needed(config: &Config, legacy_iptables: bool) -> Caps {
    let mut caps = Caps::default().with(CAP_NET_ADMIN);
    if legacy_iptables {
        caps = caps.with(CAP_NET_RAW);
    }
    let low = |p: u16| p != 0 && p < 1024;
    let health_low = config.health.listen.is_some_and(|a| low(a.port()));
    if low(config.interface.listen_port) || health_low {
        caps = caps.with(CAP_NET_BIND_SERVICE);
    }
    caps
}

/// What `tunnelgate userspace` (and `tunnelgate-wg`) needs once running: `CAP_NET_ADMIN` for
/// the TUN device and for `wg set fwmark` (`SO_MARK`), and `CAP_NET_BIND_SERVICE` because
/// `wg set listen-port` may move the socket below 1024 at any time. It runs no firewall tool.
pub fn needed_userspace() -> Caps {
    Caps::default()
        .with(CAP_NET_ADMIN)
        .with(CAP_NET_BIND_SERVICE)
}

/// Whether the daemon will use iptables-legacy: the same choice its executor makes on the
/// first apply ([`firewall::choose`]), made now while the legacy tools can still be read
/// (without `CAP_NET_RAW`, `iptables-legacy-save` fails and `auto` would never see legacy
/// rules). No firewall tools, or an error: not legacy.
pub fn uses_legacy_iptables(mode: FirewallMode) -> bool {
    mode != FirewallMode::Nftables
        && matches!(
            firewall::choose(mode),
            Ok(Backend::Iptables { legacy: true })
        )
}

/// Why the privileges could not be dropped.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("the process already runs {0} threads: capabilities are per thread, so the drop must come before the first one")]
    Threads(usize),
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        source: std::io::Error,
    },
}

/// What [`drop_to`] left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Effective and permitted now.
    pub kept: Caps,
    /// Capabilities that stayed in the bounding set because `CAP_SETPCAP` was missing (the
    /// service manager already limited it, e.g. systemd's `CapabilityBoundingSet`).
    pub bounding_kept: Caps,
}

/// Reduces this process to `keep` (intersected with what it has): bounding set, ambient and
/// inheritable sets cleared of the rest, no-new-privs set, then effective = permitted =
/// `keep`. Must run while the process has one thread.
pub fn drop_to(keep: Caps) -> Result<Dropped, PrivilegeError> {
    let threads = thread_count();
    if threads > 1 {
        return Err(PrivilegeError::Threads(threads));
    }
    let last = last_cap();
    // The bounding set first: dropping from it needs CAP_SETPCAP, which goes with the capset.
    let mut bounding_kept = Caps::default();
    for cap in 0..=last {
        if keep.has(cap) || !matches!(sys::prctl(libc::PR_CAPBSET_READ, cap.into(), 0), Ok(1)) {
            continue;
        }
        if sys::prctl(libc::PR_CAPBSET_DROP, cap.into(), 0).is_err() {
            bounding_kept = bounding_kept.with(cap);
        }
    }
    // Ambient capabilities would survive execve; ignore EINVAL on kernels without them.
    let _ = sys::prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
        0,
    );
    sys::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0).map_err(|source| PrivilegeError::Sys {
        what: "PR_SET_NO_NEW_PRIVS",
        source,
    })?;
    let now = sys::capget().map_err(|source| PrivilegeError::Sys {
        what: "capget",
        source,
    })?;
    let kept = Caps(now.permitted & keep.0);
    sys::capset(sys::CapState {
        effective: kept.0,
        permitted: kept.0,
        inheritable: 0,
    })
    .map_err(|source| PrivilegeError::Sys {
        what: "capset",
        source,
    })?;
    Ok(Dropped {
        kept,
        bounding_kept,
    })
}

/// Drops to what `config` needs and logs the result; the daemon calls this before it builds
/// its runtime.
pub fn drop_for(config: &Config) -> Result<Dropped, PrivilegeError> {
    let keep = needed(config, uses_legacy_iptables(config.firewall.mode));
    let dropped = drop_to(keep)?;
    tracing::info!(kept = %dropped.kept, "Capabilities dropped to what the daemon needs");
    if dropped.bounding_kept != Caps::default() {
        tracing::warn!(
            bounding = %dropped.bounding_kept,
            "Without CAP_SETPCAP these stay in the bounding set (no-new-privs still keeps children from gaining them)"
        );
    }
    Ok(dropped)
}

/// [`drop_to`] [`needed_userspace`], logged like [`drop_for`].
pub fn drop_for_userspace() -> Result<Dropped, PrivilegeError> {
    let dropped = drop_to(needed_userspace())?;
    tracing::info!(kept = %dropped.kept, "Capabilities dropped to what the interface needs");
    Ok(dropped)
}

/// `Threads:` of /proc/self/status (1 if unreadable: the check is a guard, not a gate).
fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(1)
}

/// The highest capability number this kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
        .min(63)
}

/// The three system calls, each behind a safe function.
mod sys {
    /// One process's sets as 64-bit masks.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct CapState {
        pub effective: u64,
        pub permitted: u64,
        pub inheritable: u64,
    }

    /// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
    const VERSION_3: u32 = 0x2008_0522;

    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }

    /// `prctl(option, arg2, arg3, 0, 0)`: its non-negative result, or the errno.
    pub(super) fn prctl(
        option: libc::c_int,
        arg2: libc::c_ulong,
        arg3: libc::c_ulong,
    ) -> std::io::Result<libc::c_int> {
        #[allow(unsafe_code)]
        // SAFETY: the options used here (PR_CAPBSET_READ/DROP, PR_CAP_AMBIENT, PR_SET_NO_NEW_PRIVS)
        // take integers only and no pointers; nothing is read or written through the arguments.
        let r = unsafe { libc::prctl(option, arg2, arg3, 0 as libc::c_ulong, 0 as libc::c_ulong) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// The calling thread's sets.
    pub(super) fn capget() -> std::io::Result<CapState> {
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        #[allow(unsafe_code)]
        // SAFETY: `header` and `data` are live, properly aligned #[repr(C)] values of the
        // layout capget(2) expects for version 3 (one header, two data structs).
        let r = unsafe {
            libc::syscall(
                libc::SYS_capget,
                &mut header as *mut Header,
                data.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
        Ok(CapState {
            effective: join(data[0].effective, data[1].effective),
            permitted: join(data[0].permitted, data[1].permitted),
            inheritable: join(data[0].inheritable, data[1].inheritable),
        })
    }

    /// Sets the calling thread's sets (only ever to fewer capabilities).
    pub(super) fn capset(state: CapState) -> std::io::Result<()> {
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let split = |v: u64| ((v & 0xffff_ffff) as u32, (v >> 32) as u32);
        let (e0, e1) = split(state.effective);
        let (p0, p1) = split(state.permitted);
        let (i0, i1) = split(state.inheritable);
        let data = [
            Data {
                effective: e0,
                permitted: p0,
                inheritable: i0,
            },
            Data {
                effective: e1,
                permitted: p1,
                inheritable: i1,
            },
        ];
        #[allow(unsafe_code)]
        // SAFETY: as in `capget`; capset(2) only reads `data`.
        let r =
            unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    struct NoFiles;

    impl crate::config::SecretFiles for NoFiles {
        fn read_secret(&self, _: &Path) -> Result<String, String> {
            Err("no files".into())
        }
    }

    fn config(body: &str) -> Config {
        let text = format!(
            "[interface]\nprivate_key = \"yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\"\n\
             addresses = [\"100.64.0.1/32\"]\n{body}"
        );
        Config::parse(&text, Path::new("/"), &NoFiles).expect("valid config")
    }

    #[test]
    fn userspace_keeps_net_admin_and_net_bind_service_only() {
        let kept = needed_userspace();
        assert_eq!(kept.to_string(), "CAP_NET_BIND_SERVICE CAP_NET_ADMIN");
        assert!(!kept.has(CAP_NET_RAW));
    }

    #[test]
    fn keeps_net_admin_and_only_what_the_config_needs_besides() {
        let admin = Caps::default().with(CAP_NET_ADMIN);
        assert_eq!(needed(&config("listen_port = 51820\n"), false), admin);
        assert_eq!(
            needed(&config(""), false),
            admin,
            "random port, health 9002"
        );
        assert_eq!(
            needed(&config("listen_port = 51820\n"), true),
            admin.with(CAP_NET_RAW)
        );
        let low_wg = config("listen_port = 500\n");
        assert_eq!(needed(&low_wg, false), admin.with(CAP_NET_BIND_SERVICE));
        let low_health = config("[health]\nlisten = \"0.0.0.0:80\"\n");
        assert_eq!(needed(&low_health, false), admin.with(CAP_NET_BIND_SERVICE));
        assert_eq!(
            admin.with(CAP_NET_RAW).to_string(),
            "CAP_NET_ADMIN CAP_NET_RAW"
        );
        assert_eq!(Caps::default().to_string(), "none");
        assert_eq!(Caps(1 << 21).to_string(), "cap_21");
    }
}
