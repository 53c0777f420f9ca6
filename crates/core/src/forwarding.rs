//! Shared ownership of the forwarding sysctls (`net.ipv4.ip_forward`,
//! `net.ipv6.conf.all.forwarding`) between every tunnelgate in one network namespace. Pure: the
//! shell reads and writes the records (one file per interface under the run directory, see
//! [`ForwardingRecord`]), checks which processes are alive, and writes the sysctls; this module
//! only parses, renders and decides.
//!
//! The rules (CONTRACT.md, "Meaning of the forwarding rules"): a daemon turns a family on only
//! if it is not on already; at exit it puts back only a value that tunnelgate changed (itself,
//! an earlier run killed with -9, or a daemon that stopped while this one still needed the
//! value), and only when no other running tunnelgate in the namespace still needs it. A daemon
//! that stops while another still needs a value it changed leaves that change recorded, so the
//! last one to stop puts it back. A record whose writer is gone counts for nothing but its
//! changes; one whose namespace is gone is ignored ([`standing`]).

use crate::rules::Family;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Which running process wrote a record: enough to tell it from a later process with the same
/// pid, and to tell namespaces apart (the run directory is shared by every namespace, the
/// sysctls are not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    pub pid: u32,
    /// The process start time, in clock ticks after boot (`/proc/PID/stat` field 22).
    pub start_ticks: u64,
    /// The network namespace, as `readlink /proc/self/ns/net` shows it (`net:[4026531840]`).
    /// The kernel gives a new namespace the inode number of one that is gone, so this alone
    /// names a namespace only while it exists.
    pub netns: String,
    /// The namespace's cookie (`SO_NETNS_COOKIE`), never reused while the system runs: it tells
    /// a namespace from a later one with the same inode number. `None` in a record of an older
    /// version, or where the kernel (before 5.14) has no cookie.
    pub netns_cookie: Option<u64>,
}

impl Writer {
    /// Whether both wrote in the same network namespace: the same inode number, and the same
    /// cookie where both have one.
    pub fn same_namespace(&self, other: &Writer) -> bool {
        self.netns == other.netns
            && match (self.netns_cookie, other.netns_cookie) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

/// What a daemon makes of another record it reads (its own interface's included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Its writer runs: its needs count, in its namespace.
    Live,
    /// Its writer is gone (killed, or a zombie) but its namespace may still be there: its needs
    /// no longer count, and what it changed is put back by the next daemon of that namespace
    /// that gives something up (or the next run of its interface).
    WriterGone,
    /// Its namespace is gone: this daemon's namespace has the record's inode number but
    /// another cookie, so the namespace that wrote it ended (and its sysctls with it). The
    /// record describes nothing: it is ignored and removed, never inherited.
    NamespaceGone,
}

/// How `me` takes a record whose writer is `alive` or not. Decided before any other use of the
/// record: a [`Standing::NamespaceGone`] record never reaches [`on_enable`] or [`on_release`].
pub fn standing(me: &Writer, record: &ForwardingRecord, alive: bool) -> Standing {
    let w = &record.writer;
    if w.netns == me.netns && !w.same_namespace(me) {
        Standing::NamespaceGone
    } else if alive {
        Standing::Live
    } else {
        Standing::WriterGone
    }
}

/// What one daemon (one interface) records about the forwarding sysctls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardingRecord {
    pub writer: Writer,
    /// Families the daemon forwards, so the sysctl must stay on while it runs.
    pub needed: BTreeSet<Family>,
    /// Families tunnelgate turned on (found off) that nobody has put back yet.
    pub changed: BTreeSet<Family>,
}

/// Another daemon's record as the shell found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherRecord {
    /// The interface the record belongs to (its file name).
    pub interface: String,
    pub record: ForwardingRecord,
    /// Whether the writer process still runs (same pid and start time).
    pub alive: bool,
}

/// What a stopping daemon (or one giving up some families, [`on_release`]) does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopPlan {
    /// Families to put back to off.
    pub restore: BTreeSet<Family>,
    /// Our record after the stop: `None` removes the file; `Some` keeps changes that another
    /// running daemon still needs, for the last one to put back.
    pub own: Option<ForwardingRecord>,
    /// Other records to rewrite (`Some`) or remove (`None`), by interface: dead daemons' records
    /// whose changes were just put back or that record nothing any more.
    pub others: BTreeMap<String, Option<ForwardingRecord>>,
}

/// The record a daemon writes after turning forwarding on. `needed` and `changed_now` are this
/// run's; `previous` is whatever the file for this interface held. The changes of an earlier
/// run in the same namespace that did not stop cleanly (killed with -9) are kept, so that this
/// run puts them back; a record of a live process is this run's own and is extended.
pub fn on_enable(
    me: &Writer,
    previous: Option<&OtherRecord>,
    needed: &BTreeSet<Family>,
    changed_now: &BTreeSet<Family>,
) -> ForwardingRecord {
    let mut record = ForwardingRecord {
        writer: me.clone(),
        needed: needed.clone(),
        changed: changed_now.clone(),
    };
    if let Some(prev) = previous.filter(|p| p.record.writer.same_namespace(me)) {
        let ours = prev.record.writer == *me;
        if ours || !prev.alive {
            record.changed.extend(prev.record.changed.iter().copied());
        }
        if ours {
            record.needed.extend(prev.record.needed.iter().copied());
        }
    }
    record
}

/// Whether a stopping daemon puts `family` back to off: tunnelgate changed it (per `own` or any
/// other record of this namespace) and no other running daemon of this namespace needs it.
pub fn restore_family(family: Family, own: &ForwardingRecord, others: &[OtherRecord]) -> bool {
    let here = |o: &&OtherRecord| o.record.writer.same_namespace(&own.writer);
    let still_needed = others
        .iter()
        .filter(here)
        .any(|o| o.alive && o.record.needed.contains(&family));
    let changed = own.changed.contains(&family)
        || others
            .iter()
            .filter(here)
            .any(|o| o.record.changed.contains(&family));
    changed && !still_needed
}

/// What the daemon whose record is `own` does when it stops, given every other record: it
/// gives up every family. Records of other namespaces are left alone.
pub fn on_stop(own: &ForwardingRecord, others: &[OtherRecord]) -> StopPlan {
    on_release(own, &Family::ALL.into(), others)
}

/// What the daemon whose record is `own` does when it no longer needs the families in
/// `released` but keeps running (a reload to a config with fewer or no forwarding rules): the
/// same as a stop for those families, so a reload leaves the sysctls as a fresh start of the new
/// configuration would. Families it still needs are neither put back nor dropped from its
/// record. Changes left in dead daemons' records that no running daemon needs go back too.
/// Records of other namespaces are left alone.
pub fn on_release(
    own: &ForwardingRecord,
    released: &BTreeSet<Family>,
    others: &[OtherRecord],
) -> StopPlan {
    let still_needed: BTreeSet<Family> = own.needed.difference(released).copied().collect();
    // A dead daemon's change is put back by whoever next gives something up, not only by the
    // daemon that gives up that family: the run that inherited the job may never have needed
    // the family (a -9 between a stop that left the change for it and its restart with
    // another config), and once its record is gone nobody else would look.
    let orphaned = others
        .iter()
        .filter(|o| o.record.writer.same_namespace(&own.writer) && !o.alive)
        .flat_map(|o| o.record.changed.iter().copied());
    let restore: BTreeSet<Family> = released
        .iter()
        .copied()
        .chain(orphaned)
        .filter(|f| !still_needed.contains(f) && restore_family(*f, own, others))
        .collect();
    let kept: BTreeSet<Family> = own.changed.difference(&restore).copied().collect();
    let own_after = (!kept.is_empty() || !still_needed.is_empty()).then(|| ForwardingRecord {
        writer: own.writer.clone(),
        needed: still_needed,
        changed: kept,
    });
    let mut rewrite = BTreeMap::new();
    for other in others {
        let rec = &other.record;
        // A live daemon's record is its own to change; so is another namespace's.
        if !rec.writer.same_namespace(&own.writer) || (other.alive && !rec.needed.is_empty()) {
            continue;
        }
        let changed: BTreeSet<Family> = rec.changed.difference(&restore).copied().collect();
        if changed.is_empty() {
            rewrite.insert(other.interface.clone(), None);
        } else if changed != rec.changed {
            let mut left = rec.clone();
            left.changed = changed;
            rewrite.insert(other.interface.clone(), Some(left));
        }
    }
    StopPlan {
        restore,
        own: own_after,
        others: rewrite,
    }
}

/// The sysctl that holds a family's forwarding switch.
pub fn sysctl_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "net.ipv4.ip_forward",
        Family::V6 => "net.ipv6.conf.all.forwarding",
    }
}

/// Why the daemon is not ready when forwarding that its rules need is off and it could not turn
/// it on (`missing`: each family with the error of the write, such as "Read-only file system"
/// in a container), and how to fix it. `/readyz`, `tunnelgate status` and the log say this.
/// The daemon keeps reading the sysctls, so turning them on from outside is enough.
pub fn unavailable_reason(missing: &BTreeMap<Family, String>, retry_cap_secs: u64) -> String {
    let what: Vec<String> = missing
        .iter()
        .map(|(family, error)| {
            format!(
                "{} is off and cannot be turned on ({error})",
                sysctl_name(*family)
            )
        })
        .collect();
    let commands: Vec<String> = missing
        .keys()
        .map(|family| format!("sysctl -w {}=1", sysctl_name(*family)))
        .collect();
    format!(
        "{}; the forwarding rules need it. Turn it on before tunnelgate starts: in Kubernetes \
         with the pod's privileged init container (`sysctls` in containers/k8s) or the pod's \
         spec.securityContext.sysctls (the kubelet must allow them: --allowed-unsafe-sysctls); \
         elsewhere `{}` in the daemon's network namespace. tunnelgate checks again at least \
         every {retry_cap_secs} s",
        what.join("; "),
        commands.join(" && "),
    )
}

/// The file text: `key=value` lines, families as `ipv4`/`ipv6` with their flags.
///
/// ```text
/// # tunnelgate forwarding sysctls of one interface (written atomically)
/// pid=4242
/// start=123456
/// netns=net:[4026531840]
/// netns_cookie=4096
/// ipv4=needed,changed
/// ipv6=needed
/// ```
pub fn render(record: &ForwardingRecord) -> String {
    let w = &record.writer;
    let mut out = format!(
        "# tunnelgate forwarding sysctls of one interface (written atomically)\n\
         pid={}\nstart={}\nnetns={}\n",
        w.pid, w.start_ticks, w.netns
    );
    if let Some(cookie) = w.netns_cookie {
        let _ = writeln!(out, "netns_cookie={cookie}");
    }
    for family in Family::ALL {
        let mut flags = Vec::new();
        if record.needed.contains(&family) {
            flags.push("needed");
        }
        if record.changed.contains(&family) {
            flags.push("changed");
        }
        let _ = writeln!(out, "{family}={}", flags.join(","));
    }
    out
}

/// Reads [`render`]'s text back; an error names the line that is wrong.
pub fn parse(text: &str) -> Result<ForwardingRecord, String> {
    let (mut pid, mut start, mut netns, mut netns_cookie) = (None, None, None, None);
    let (mut needed, mut changed) = (BTreeSet::new(), BTreeSet::new());
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("{line:?} is not key=value"))?;
        let number = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{line:?}: not a number"))
        };
        match key {
            "pid" => {
                let n = number(value)?;
                pid = Some(u32::try_from(n).map_err(|_| format!("{line:?}: pid out of range"))?);
            }
            "start" => start = Some(number(value)?),
            "netns" => netns = Some(value.to_string()),
            "netns_cookie" => netns_cookie = Some(number(value)?),
            "ipv4" | "ipv6" => {
                let family = if key == "ipv4" {
                    Family::V4
                } else {
                    Family::V6
                };
                for flag in value.split(',').filter(|f| !f.is_empty()) {
                    match flag {
                        "needed" => needed.insert(family),
                        "changed" => changed.insert(family),
                        _ => return Err(format!("{line:?}: unknown flag {flag:?}")),
                    };
                }
            }
            _ => return Err(format!("{line:?}: unknown key")),
        }
    }
    match (pid, start, netns) {
        (Some(pid), Some(start_ticks), Some(netns)) => Ok(ForwardingRecord {
            writer: Writer {
                pid,
                start_ticks,
                netns,
                netns_cookie,
            },
            needed,
            changed,
        }),
        _ => Err("pid, start and netns are required".into()),
    }
}

#[cfg(test)]
mod tests;
