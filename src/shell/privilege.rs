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
//! - `CAP_SYS_NICE`, only when the packet threads' real-time priority is on
//!   (`TUNNELGATE_RT_PRIORITY`, default 1), `RLIMIT_RTPRIO` could not be raised to it (no
//!   `CAP_SYS_RESOURCE`: the systemd units, containers) and the process has it: a packet
//!   reader moves itself between `SCHED_FIFO` and normal priority (`core::priority`), and its
//!   seccomp filter lets it do so for itself only. It is kept in the permitted set but never in
//!   the bounding set, and only the packet readers keep it: `shell::priority::ReaderSpawner`
//!   starts them from a thread of its own and the main thread gives it up ([`give_up`]) before
//!   the runtime's threads exist.
//!
//! Everything else leaves the effective, permitted, inheritable, ambient and bounding sets,
//! and `PR_SET_NO_NEW_PRIVS` is set. A child run as uid 0 gets the bounding set as its
//! permitted set on `execve`, which is exactly the kept set less `CAP_SYS_NICE`, so `nft` and
//! `iptables-restore` keep working and never get a real-time class; with no-new-privs nothing
//! can ever gain more.

use std::fmt;

use caps::{CapSet, Capability, CapsHashSet};

use crate::config::Config;

/// A set of capabilities, bit `n` for capability `n` (the `/proc/<pid>/status` layout). Ours
/// rather than `caps::CapsHashSet`: it compares and prints in a fixed order, and it can hold a
/// capability newer than the `caps` crate knows (as the kernel reports it in `CapBnd`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps(pub u64);

impl Caps {
    pub fn with(self, cap: Capability) -> Caps {
        Caps(self.0 | cap.bitmask())
    }

    pub fn union(self, other: Caps) -> Caps {
        Caps(self.0 | other.0)
    }

    pub fn has(self, cap: Capability) -> bool {
        self.0 & cap.bitmask() != 0
    }

    /// The capabilities of the set that the `caps` crate can name (all of them on kernels up
    /// to at least 6.x: `CAP_CHECKPOINT_RESTORE`, 40, is the last).
    fn known(self) -> CapsHashSet {
        caps::all().into_iter().filter(|c| self.has(*c)).collect()
    }

    fn from_known(set: &CapsHashSet) -> Caps {
        Caps(set.iter().fold(0, |bits, c| bits | c.bitmask()))
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut known: Vec<Capability> = self.known().into_iter().collect();
        known.sort_by_key(Capability::index);
        let mut names: Vec<String> = known.iter().map(Capability::to_string).collect();
        let unknown = self.0 & !Caps::from_known(&self.known()).0;
        names.extend(
            (0..64)
                .filter(|n| unknown & (1u64 << n) != 0)
                .map(|n| format!("cap_{n}")),
        );
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(" "))
        }
    }
}

/// The capabilities the daemon for `config` needs once running (see the module docs);
/// `legacy_iptables`: the firewall backend is iptables-legacy.
pub fn needed(config: &Config, legacy_iptables: bool) -> Caps {
    let mut caps = Caps::default().with(Capability::CAP_NET_ADMIN);
    if legacy_iptables {
        caps = caps.with(Capability::CAP_NET_RAW);
    }
    let low = |p: u16| p != 0 && p < 1024;
    let health_low = config.health.listen.is_some_and(|a| low(a.port()));
    if low(config.interface.listen_port) || health_low {
        caps = caps.with(Capability::CAP_NET_BIND_SERVICE);
    }
    caps
}

/// What `tunnelgate userspace` (and `tunnelgate-wg`) needs once running: `CAP_NET_ADMIN` for
/// the TUN device and for `wg set fwmark` (`SO_MARK`), and `CAP_NET_BIND_SERVICE` because
/// `wg set listen-port` may move the socket below 1024 at any time. It runs no firewall tool.
pub fn needed_userspace() -> Caps {
    Caps::default()
        .with(Capability::CAP_NET_ADMIN)
        .with(Capability::CAP_NET_BIND_SERVICE)
}

/// The one line `tunnelgate run` stops with when this process has no `CAP_NET_ADMIN` in
/// `permitted` (not root, no file or ambient capability): everything it does needs it, and
/// without this check the first failure is a bare "Permission denied" from deep in the start.
pub fn run_refusal(permitted: Caps) -> Option<&'static str> {
    (!permitted.has(Capability::CAP_NET_ADMIN)).then_some(
        "tunnelgate run needs root or CAP_NET_ADMIN (it creates a TUN device, routes and \
         firewall rules): run it with sudo, or as the systemd unit (systemctl start tunnelgate); \
         `tunnelgate check` needs neither",
    )
}

/// This process's permitted capabilities (none when they cannot be read).
pub fn permitted_now() -> Caps {
    caps::read(None, CapSet::Permitted)
        .map(|set| Caps::from_known(&set))
        .unwrap_or_default()
}

/// Why the privileges could not be dropped.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("the process already runs {0} threads: capabilities are per thread, so the drop must come before the first one")]
    Threads(usize),
    #[error("{what}: {source}")]
    Caps {
        what: &'static str,
        source: caps::errors::CapsError,
    },
    #[error("PR_SET_NO_NEW_PRIVS: {0}")]
    NoNewPrivs(#[source] nix::Error),
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

/// Reduces this process to `keep` (intersected with what it has): the bounding set to `bound`
/// (what children may ever get; a subset of `keep`), ambient and inheritable sets cleared, no-new-privs
/// set, then effective = permitted = `keep`. Must run while the process has one thread.
pub fn drop_to(keep: Caps, bound: Caps) -> Result<Dropped, PrivilegeError> {
    let threads = thread_count();
    if threads > 1 {
        return Err(PrivilegeError::Threads(threads));
    }
    let failed = |what| move |source| PrivilegeError::Caps { what, source };
    // The bounding set first: dropping from it needs CAP_SETPCAP, which goes with the capset.
    // A drop the kernel refuses shows in `bounding_kept` below.
    let bounding = caps::read(None, CapSet::Bounding).map_err(failed("read the bounding set"))?;
    for cap in bounding.into_iter().filter(|c| !bound.has(*c)) {
        let _ = caps::drop(None, CapSet::Bounding, cap);
    }
    // Ambient capabilities would survive execve; kernels before 4.3 have none (EINVAL).
    let _ = caps::clear(None, CapSet::Ambient);
    nix::sys::prctl::set_no_new_privs().map_err(PrivilegeError::NoNewPrivs)?;
    let permitted = caps::read(None, CapSet::Permitted).map_err(failed("capget"))?;
    let kept = Caps(Caps::from_known(&permitted).0 & keep.0);
    // Effective before permitted: the kernel wants effective within permitted at every step.
    caps::clear(None, CapSet::Inheritable).map_err(failed("capset inheritable"))?;
    caps::set(None, CapSet::Effective, &kept.known()).map_err(failed("capset effective"))?;
    caps::set(None, CapSet::Permitted, &kept.known()).map_err(failed("capset permitted"))?;
    let bounding_kept = Caps(bounding_now().0 & !bound.0);
    Ok(Dropped {
        kept,
        bounding_kept,
    })
}

/// Drops to what `config` needs with its firewall backend (`legacy_iptables`:
/// `shell::firewall::uses_legacy_iptables`, which the composition root asks) plus
/// `CAP_SYS_NICE` for the packet readers when `realtime` says so (never in the bounding set),
/// and logs the result; the daemon calls this before it builds its runtime.
pub fn drop_for(
    config: &Config,
    legacy_iptables: bool,
    realtime: Caps,
) -> Result<Dropped, PrivilegeError> {
    let keep = needed(config, legacy_iptables);
    let dropped = drop_to(keep.union(realtime), keep)?;
    log_dropped(&dropped, "Capabilities dropped to what the daemon needs");
    Ok(dropped)
}

/// [`drop_to`] [`needed_userspace`] (plus `realtime`, as for [`drop_for`]), logged like it.
pub fn drop_for_userspace(realtime: Caps) -> Result<Dropped, PrivilegeError> {
    let keep = needed_userspace();
    let dropped = drop_to(keep.union(realtime), keep)?;
    log_dropped(&dropped, "Capabilities dropped to what the interface needs");
    Ok(dropped)
}

fn log_dropped(dropped: &Dropped, what: &str) {
    tracing::info!(kept = %dropped.kept, "{what}");
    if dropped.bounding_kept != Caps::default() {
        // Information, not a warning: the shipped unit and pod grant CAP_NET_RAW (for
        // iptables-legacy) and CAP_NET_BIND_SERVICE (for a low port) whatever the backend and
        // ports, and neither the daemon nor a child can use what it dropped: it is gone from
        // every set that grants it, and no-new-privs keeps an execve from giving it back.
        tracing::info!(
            bounding = %dropped.bounding_kept,
            "Not needed, so dropped; without CAP_SETPCAP they stay in the bounding set, which grants nothing under no-new-privs"
        );
    }
}

/// Drops `cap` from the calling thread's effective and permitted sets, for good: the thread,
/// and every thread and child it starts from now on, never has it again.
pub fn give_up(cap: Capability) -> Result<(), PrivilegeError> {
    let failed = |what| move |source| PrivilegeError::Caps { what, source };
    caps::drop(None, CapSet::Effective, cap).map_err(failed("capset effective"))?;
    caps::drop(None, CapSet::Permitted, cap).map_err(failed("capset permitted"))
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

/// The bounding set as the kernel reports it (`CapBnd:` of /proc/self/status), so a capability
/// newer than the `caps` crate still shows; the crate's reading when /proc is unreadable.
fn bounding_now() -> Caps {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapBnd:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .map(Caps)
        .unwrap_or_else(|| {
            caps::read(None, CapSet::Bounding)
                .map(|set| Caps::from_known(&set))
                .unwrap_or_default()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const CAP_NET_ADMIN: Capability = Capability::CAP_NET_ADMIN;
    const CAP_NET_RAW: Capability = Capability::CAP_NET_RAW;
    const CAP_NET_BIND_SERVICE: Capability = Capability::CAP_NET_BIND_SERVICE;

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
    fn run_without_net_admin_gets_one_hint() {
        let hint = run_refusal(Caps::default()).expect("refused without capabilities");
        assert!(hint.contains("needs root or CAP_NET_ADMIN"), "{hint}");
        assert!(run_refusal(Caps::default().with(CAP_NET_RAW)).is_some());
        assert_eq!(run_refusal(Caps::default().with(CAP_NET_ADMIN)), None);
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
        assert_eq!(Caps(1 << 21).to_string(), "CAP_SYS_ADMIN");
        // A capability newer than the `caps` crate still prints, by number.
        assert_eq!(
            Caps((1 << 63) | (1 << 12)).to_string(),
            "CAP_NET_ADMIN cap_63"
        );
    }

    /// The bits are the kernel's (`/proc/<pid>/status`, linux/capability.h), which the netns
    /// suites compare against.
    #[test]
    fn bits_are_the_kernels_capability_numbers() {
        assert_eq!(Caps::default().with(CAP_NET_BIND_SERVICE).0, 1 << 10);
        assert_eq!(Caps::default().with(CAP_NET_ADMIN).0, 1 << 12);
        assert_eq!(Caps::default().with(CAP_NET_RAW).0, 1 << 13);
        let set = needed_userspace().known();
        assert_eq!(Caps::from_known(&set), needed_userspace());
    }
}
