//! The forwarding sysctls and the records that let several tunnelgates share them: one file per
//! interface, `<run dir>/<iface>.forwarding` (the run dir is `/var/run/tunnelgate`, or
//! `$TUNNELGATE_RUN_DIR`), written atomically (temporary file + rename), read and changed only
//! under an exclusive lock on the run directory itself (`flock` of the directory: no lock file
//! is left behind), so a start and a stop never interleave. A record whose writer or network
//! namespace is gone is said so in the log when it is read; one whose namespace is gone is
//! removed. Reads, writes and liveness checks only: [`crate::core::forwarding`] decides.

use crate::core::forwarding::{self, ForwardingRecord, OtherRecord, Standing, Writer};
use crate::rules::Family;
use crate::telemetry::status::DEFAULT_RUN_DIR;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

const SUFFIX: &str = ".forwarding";

/// The shared forwarding state of the daemon for one interface.
pub struct SharedForwarding {
    dir: PathBuf,
    interface: String,
    /// What this run last wrote, in case the file cannot be read back at stop.
    written: Option<ForwardingRecord>,
}

impl SharedForwarding {
    pub fn new(interface: &str) -> SharedForwarding {
        let dir = crate::shell::tuning::run_dir().unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR));
        SharedForwarding {
            dir,
            interface: interface.to_string(),
            written: None,
        }
    }

    /// Turns forwarding on for each of `families` unless it already is, and records that this
    /// daemon needs them. `Err` holds each family that is still off, with the error of the
    /// write (the core decides what that means for readiness, and logs it).
    pub fn enable(&mut self, families: &BTreeSet<Family>) -> Result<(), BTreeMap<Family, String>> {
        let lock = self.lock();
        let mut changed = BTreeSet::new();
        let mut off = BTreeMap::new();
        for family in families {
            match enable_sysctl(*family) {
                Ok(true) => {
                    tracing::info!(%family, "Enabled IP forwarding");
                    changed.insert(*family);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(%family, error = %e, "Cannot enable IP forwarding");
                    off.insert(*family, e.to_string());
                }
            }
        }
        match me() {
            Ok(me) => {
                // Every record is read once at start, so one of a namespace that is gone
                // does not wait for the next stop to be found.
                let others: Vec<String> = self
                    .interfaces()
                    .into_iter()
                    .filter(|name| *name != self.interface)
                    .collect();
                for name in others {
                    let _ = self.read_other(&me, &name);
                }
                let previous = self.read_other(&me, &self.interface);
                let record = forwarding::on_enable(&me, previous.as_ref(), families, &changed);
                self.write(&self.interface, &record);
                self.written = Some(record);
            }
            Err(e) => {
                tracing::warn!(error = %e, "Cannot identify this process; forwarding not recorded")
            }
        }
        drop(lock);
        if off.is_empty() {
            Ok(())
        } else {
            Err(off)
        }
    }

    /// Gives up `families` (at stop: every family; on a reload: those the new configuration no
    /// longer needs): puts back each of them tunnelgate changed that no other running daemon of
    /// this namespace needs, and updates the records ([`forwarding::on_release`] decides).
    pub fn release(&mut self, families: &BTreeSet<Family>) {
        let lock = self.lock();
        let own = self.read_own().or_else(|| self.written.clone());
        let Some(own) = own else {
            return;
        };
        let others: Vec<OtherRecord> = self
            .interfaces()
            .into_iter()
            .filter(|name| *name != self.interface)
            .filter_map(|name| self.read_other(&own.writer, &name))
            .collect();
        let plan = forwarding::on_release(&own, families, &others);
        for family in &plan.restore {
            match disable_sysctl(*family) {
                Ok(()) => tracing::info!(%family, "Put IP forwarding back to off"),
                Err(e) => {
                    tracing::warn!(%family, error = %e, "Could not restore the forwarding sysctl")
                }
            }
        }
        let kept: Vec<String> = Family::ALL
            .iter()
            .filter(|f| families.contains(f) && own.needed.contains(f) && !plan.restore.contains(f))
            .map(|f| f.to_string())
            .collect();
        if !kept.is_empty() {
            tracing::info!(
                families = kept.join(","),
                "IP forwarding left as it is: not changed by tunnelgate, or still needed by another"
            );
        }
        match &plan.own {
            Some(record) => self.write(&self.interface, record),
            None => self.remove(&self.interface),
        }
        self.written = plan.own;
        for (name, record) in &plan.others {
            match record {
                Some(r) => self.write(name, r),
                None => self.remove(name),
            }
        }
        drop(lock);
    }

    fn path(&self, interface: &str) -> PathBuf {
        self.dir.join(format!("{interface}{SUFFIX}"))
    }

    /// The exclusive lock on the run directory, held until the value is dropped; `None`
    /// (logged) when the run directory cannot be used: the records then cannot be shared either.
    fn lock(&self) -> Option<File> {
        let open = || -> std::io::Result<File> {
            std::fs::create_dir_all(&self.dir)?;
            let dir = File::open(&self.dir)?;
            dir.lock()?;
            Ok(dir)
        };
        open()
            .inspect_err(|e| {
                tracing::warn!(dir = %self.dir.display(), error = %e, "Cannot lock the forwarding records")
            })
            .ok()
    }

    /// Interfaces that have a record.
    fn interfaces(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(SUFFIX)
                    .map(str::to_string)
            })
            .collect();
        names.sort();
        names
    }

    /// This daemon's own record as last written, read back as it stands.
    fn read_own(&self) -> Option<ForwardingRecord> {
        let text = std::fs::read_to_string(self.path(&self.interface)).ok()?;
        forwarding::parse(&text).ok()
    }

    /// The record of `interface` and whether its writer still runs, as `me` takes it
    /// ([`forwarding::standing`]); `None` when there is none, when it cannot be read (logged,
    /// and left alone), or when its network namespace is gone (logged, and removed).
    fn read_other(&self, me: &Writer, interface: &str) -> Option<OtherRecord> {
        let path = self.path(interface);
        let text = std::fs::read_to_string(&path).ok()?;
        let record = match forwarding::parse(&text) {
            Ok(record) => record,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "Ignoring an unreadable forwarding record");
                return None;
            }
        };
        let alive = is_alive(&record.writer);
        let w = &record.writer;
        match forwarding::standing(me, &record, alive) {
            Standing::Live => {}
            Standing::WriterGone => {
                if w.same_namespace(me) {
                    tracing::info!(
                        path = %path.display(),
                        pid = w.pid,
                        "A forwarding record's daemon is gone (killed, or not yet reaped): its \
                         needs no longer count, and what it turned on is put back once no running \
                         daemon needs it"
                    );
                }
            }
            Standing::NamespaceGone => {
                tracing::info!(
                    path = %path.display(),
                    pid = w.pid,
                    netns = %w.netns,
                    "Ignoring and removing a forwarding record whose network namespace is gone \
                     (its inode number now names another namespace); its sysctls went with it"
                );
                self.remove(interface);
                return None;
            }
        }
        Some(OtherRecord {
            interface: interface.to_string(),
            alive,
            record,
        })
    }

    fn write(&self, interface: &str, record: &ForwardingRecord) {
        let path = self.path(interface);
        let tmp = self
            .dir
            .join(format!(".{interface}{SUFFIX}.{}", std::process::id()));
        let result = std::fs::write(&tmp, forwarding::render(record))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "Cannot write the forwarding record");
        }
    }

    fn remove(&self, interface: &str) {
        let path = self.path(interface);
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "Cannot remove the forwarding record");
            }
        }
    }
}

/// This process as a record's writer.
fn me() -> std::io::Result<Writer> {
    let pid = std::process::id();
    Ok(Writer {
        pid,
        start_ticks: start_ticks(pid)?,
        netns: std::fs::read_link("/proc/self/ns/net")?
            .to_string_lossy()
            .into_owned(),
        netns_cookie: netns_cookie(),
    })
}

/// `SO_NETNS_COOKIE` (Linux 5.14), which the libc crate does not export: 71 as in
/// asm-generic, which all but sparc follow.
const SO_NETNS_COOKIE: libc::c_int = if cfg!(any(target_arch = "sparc", target_arch = "sparc64")) {
    0x50
} else {
    71
};

/// The cookie of this process's network namespace: a number the kernel never gives another
/// namespace while it runs (the inode number it does reuse). `None` before Linux 5.14.
#[allow(unsafe_code)]
fn netns_cookie() -> Option<u64> {
    use std::os::fd::AsRawFd;
    // Any socket carries its namespace; an unbound Unix one needs no address or network.
    let socket = std::os::unix::net::UnixDatagram::unbound().ok()?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the socket is open for the whole call; `cookie` and `len` are live locals, and
    // `len` says how many bytes `cookie` holds, which the kernel writes at most.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            std::ptr::addr_of_mut!(cookie).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize == std::mem::size_of::<u64>()).then_some(cookie)
}

/// Whether the process that wrote a record still runs: the same pid with the same start time
/// (a pid reused by another process has another start time), and not a zombie (a daemon
/// killed with -9 whose parent has not reaped it yet still has its `/proc` entry, but will
/// never put a sysctl back).
fn is_alive(writer: &Writer) -> bool {
    proc_stat(writer.pid)
        .is_ok_and(|(state, start)| start == writer.start_ticks && !is_dead_state(state))
}

/// Field 3 of `/proc/PID/stat`: `Z` (zombie), `X` (dead) and `x` (dead, old kernels) are
/// processes that have exited.
fn is_dead_state(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// Field 22 of `/proc/PID/stat`, the start time in clock ticks after boot.
fn start_ticks(pid: u32) -> std::io::Result<u64> {
    proc_stat(pid).map(|(_, start)| start)
}

/// Fields 3 (the state) and 22 (the start time) of `/proc/PID/stat`. The command name
/// (field 2) is in parentheses and may hold spaces, so fields are counted after the last `)`.
fn proc_stat(pid: u32) -> std::io::Result<(char, u64)> {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat"))?;
    parse_stat(&stat).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected /proc/PID/stat")
    })
}

fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = stat.rsplit_once(')')?.1;
    // After `)`: field 3 (state) is the first; field 22 is the 20th.
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// The forwarding sysctl of a family.
fn sysctl_path(family: Family) -> &'static str {
    match family {
        Family::V4 => "/proc/sys/net/ipv4/ip_forward",
        Family::V6 => "/proc/sys/net/ipv6/conf/all/forwarding",
    }
}

/// Turns forwarding on for `family` unless it already is; whether it changed it.
fn enable_sysctl(family: Family) -> std::io::Result<bool> {
    let path = sysctl_path(family);
    if std::fs::read_to_string(path)?.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(path, "1")?;
    Ok(true)
}

fn disable_sysctl(family: Family) -> std::io::Result<()> {
    std::fs::write(sysctl_path(family), "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_changed_start_time_is_not() {
        let me = me().expect("this process in /proc");
        assert!(is_alive(&me));
        let reused = Writer {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!is_alive(&reused));
    }

    /// The cookie is read, and names this namespace: the same on a second read.
    #[test]
    fn this_namespace_has_a_cookie() {
        let cookie = netns_cookie().expect("SO_NETNS_COOKIE (Linux 5.14)");
        assert_eq!(netns_cookie(), Some(cookie));
    }

    #[test]
    fn a_command_name_with_spaces_and_parentheses_is_skipped() {
        let stat = "4242 (tg (x) y) Z 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 0 0";
        assert_eq!(parse_stat(stat), Some(('Z', 98765)));
        assert_eq!(parse_stat("4242 (tg) S 1"), None, "cut short");
    }

    /// Issue 27: a daemon killed with -9 and not yet reaped by its parent is a zombie: its
    /// `/proc` entry (same pid, same start time) stays, but it is dead.
    #[test]
    fn an_unreaped_child_that_exited_is_dead() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let start = start_ticks(pid).expect("the child in /proc");
        let writer = Writer {
            pid,
            start_ticks: start,
            netns: String::new(),
            netns_cookie: None,
        };
        assert!(is_alive(&writer), "a running child is alive");
        // Killed with -9 and not reaped: wait until the kernel shows it as a zombie.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill");
        let deadline = crate::shell::clock::now() + std::time::Duration::from_secs(5);
        while proc_stat(pid).is_ok_and(|(state, _)| state != 'Z') {
            assert!(
                crate::shell::clock::now() < deadline,
                "never became a zombie"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(proc_stat(pid).map(|(s, _)| s).ok(), Some('Z'));
        assert!(!is_alive(&writer), "a zombie is dead");
        child.wait().expect("reap");
        assert!(!is_alive(&writer), "a reaped process is dead");
    }
}
