//! Whether the packet readers can have real-time priority, how, and when not, why, in words that
//! fit the case: from the facts the shell reads before it drops its capabilities (uid,
//! capabilities, `RLIMIT_RTPRIO`, the cgroup's real-time runtime). Pure.

use std::fmt;

/// What the process knows about itself before it drops its capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    pub uid: u32,
    /// `CAP_SYS_NICE` in the permitted set: a thread may enter any real-time priority.
    pub sys_nice: bool,
    /// `CAP_SYS_RESOURCE` in the permitted set: the process may raise `RLIMIT_RTPRIO`'s hard limit.
    pub sys_resource: bool,
    /// `RLIMIT_RTPRIO` (soft, hard); `u64::MAX` is unlimited.
    pub rtprio: (u64, u64),
    /// The cgroup's `cpu.rt_runtime_us` where real-time group scheduling is on (cgroup v1 with
    /// `CONFIG_RT_GROUP_SCHED`); `None` where there is no such limit.
    pub cgroup_rt_runtime_us: Option<i64>,
}

/// How the packet readers get real-time priority, or why they do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// `TUNNELGATE_RT_PRIORITY=0`.
    Off,
    /// `RLIMIT_RTPRIO` allows the priority (raised by the daemon if it could): no capability.
    Limit,
    /// `CAP_SYS_NICE`, kept by the packet readers alone.
    Capability,
    /// Not possible here; why, and what would allow it.
    Unavailable(String),
}

impl Access {
    /// A short name for status, metrics and JSON.
    pub fn label(&self) -> &'static str {
        match self {
            Access::Off => "off",
            Access::Limit => "rlimit",
            Access::Capability => "capability",
            Access::Unavailable(_) => "unavailable",
        }
    }

    /// Whether the readers may try to enter real-time priority.
    pub fn allows_realtime(&self) -> bool {
        matches!(self, Access::Limit | Access::Capability)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Access::Off => f.write_str("off (TUNNELGATE_RT_PRIORITY=0)"),
            Access::Limit => f.write_str("by RLIMIT_RTPRIO, no capability"),
            Access::Capability => f.write_str("by CAP_SYS_NICE, held by the packet readers alone"),
            Access::Unavailable(why) => f.write_str(why),
        }
    }
}

/// How the readers can reach `priority` (`None`: real-time is off) given `facts`; whether the
/// daemon should raise `RLIMIT_RTPRIO` first is [`raise_rtprio`].
pub fn access(priority: Option<i32>, facts: &Facts) -> Access {
    let Some(priority) = priority else {
        return Access::Off;
    };
    let want = u64::try_from(priority).unwrap_or(0);
    if let Some(0) = facts.cgroup_rt_runtime_us {
        return Access::Unavailable(
            "the cgroup gives real-time threads no time (cpu.rt_runtime_us is 0: cgroup v1 with \
             real-time group scheduling): the runtime or the parent cgroups must give it some \
             (podman: --cpu-rt-runtime)"
                .into(),
        );
    }
    let (soft, hard) = facts.rtprio;
    if soft >= want || hard >= want || facts.sys_resource {
        return Access::Limit;
    }
    if facts.sys_nice {
        return Access::Capability;
    }
    let allow = format!(
        "add CAP_SYS_NICE (systemd: CapabilityBoundingSet= and AmbientCapabilities=; \
         Kubernetes: securityContext.capabilities.add: [SYS_NICE]) or allow priority {priority} \
         (systemd: LimitRTPRIO={priority}; a shell: ulimit -r {priority})"
    );
    if facts.uid == 0 {
        Access::Unavailable(format!(
            "running as root, but without CAP_SYS_NICE (the service manager or the container \
             dropped it) and with RLIMIT_RTPRIO {soft}: {allow}"
        ))
    } else {
        Access::Unavailable(format!(
            "running as uid {}, without CAP_SYS_NICE and with RLIMIT_RTPRIO {soft} (hard {}): {allow}",
            facts.uid,
            if hard == u64::MAX { "unlimited".to_string() } else { hard.to_string() },
        ))
    }
}

/// Whether the daemon should raise `RLIMIT_RTPRIO` to `priority` before it drops its
/// capabilities: the limit does not allow it yet, and raising it is allowed (within the hard
/// limit, or with `CAP_SYS_RESOURCE`).
pub fn raise_rtprio(priority: i32, facts: &Facts) -> bool {
    let want = u64::try_from(priority).unwrap_or(0);
    facts.rtprio.0 < want && (facts.rtprio.1 >= want || facts.sys_resource)
}

/// Why a switch to real-time priority that `access` allowed was refused with `error` anyway:
/// something the facts could not show forbids it.
pub fn refused(access: &Access, error: &str) -> String {
    match access {
        Access::Capability | Access::Limit => format!(
            "real-time scheduling was refused ({error}) although it is allowed {}: a seccomp \
             filter forbids it (systemd: RestrictRealtime=yes; a container's profile) or the \
             cgroup gives real-time threads no time",
            if *access == Access::Capability {
                "by CAP_SYS_NICE"
            } else {
                "by RLIMIT_RTPRIO"
            }
        ),
        Access::Off | Access::Unavailable(_) => {
            format!("real-time scheduling was refused ({error})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: Facts = Facts {
        uid: 0,
        sys_nice: true,
        sys_resource: true,
        rtprio: (0, 0),
        cgroup_rt_runtime_us: None,
    };

    #[test]
    fn root_raises_the_limit_and_needs_no_capability() {
        assert_eq!(access(Some(1), &ROOT), Access::Limit);
        assert!(raise_rtprio(1, &ROOT));
        assert_eq!(access(None, &ROOT), Access::Off);
    }

    #[test]
    fn a_limit_that_allows_the_priority_needs_nothing_else() {
        let user = Facts {
            uid: 1000,
            sys_nice: false,
            sys_resource: false,
            rtprio: (0, 5),
            ..ROOT
        };
        assert_eq!(access(Some(1), &user), Access::Limit);
        assert!(
            raise_rtprio(1, &user),
            "the soft limit goes up to the hard one"
        );
        let set = Facts {
            rtprio: (1, 1),
            ..user
        };
        assert_eq!(access(Some(1), &set), Access::Limit);
        assert!(!raise_rtprio(1, &set));
    }

    #[test]
    fn without_cap_sys_resource_the_capability_is_kept_instead() {
        // This project's sandbox and the shipped unit: root, CAP_SYS_NICE, no CAP_SYS_RESOURCE.
        let unit = Facts {
            sys_resource: false,
            ..ROOT
        };
        assert_eq!(access(Some(1), &unit), Access::Capability);
        assert!(!raise_rtprio(1, &unit));
    }

    #[test]
    fn the_reason_fits_the_case() {
        let root_without = Facts {
            sys_nice: false,
            sys_resource: false,
            ..ROOT
        };
        let Access::Unavailable(why) = access(Some(1), &root_without) else {
            panic!()
        };
        assert!(
            why.starts_with("running as root, but without CAP_SYS_NICE"),
            "{why}"
        );
        assert!(!why.contains("needs root"), "{why}");
        assert!(
            why.contains("LimitRTPRIO=1") && why.contains("SYS_NICE"),
            "{why}"
        );

        let user = Facts {
            uid: 1000,
            ..root_without
        };
        let Access::Unavailable(why) = access(Some(3), &user) else {
            panic!()
        };
        assert!(
            why.starts_with("running as uid 1000, without CAP_SYS_NICE"),
            "{why}"
        );
        assert!(
            why.contains("hard 0") && why.contains("ulimit -r 3"),
            "{why}"
        );

        let container = Facts {
            cgroup_rt_runtime_us: Some(0),
            ..ROOT
        };
        let Access::Unavailable(why) = access(Some(1), &container) else {
            panic!()
        };
        assert!(why.contains("cpu.rt_runtime_us is 0"), "{why}");
        let given = Facts {
            cgroup_rt_runtime_us: Some(950_000),
            sys_resource: false,
            ..ROOT
        };
        assert_eq!(access(Some(1), &given), Access::Capability);

        let refused = refused(&Access::Capability, "Operation not permitted");
        assert!(refused.contains("RestrictRealtime=yes"), "{refused}");
    }
}
