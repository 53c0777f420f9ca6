//! "Say why": a user who may not open the daemon's sockets is told so (and `status` exits 1,
//! never "no daemon is running" with 0); a daemon killed with -9 that its parent has not reaped
//! yet (a zombie) is dead to the next start, which says so and puts the forwarding sysctl it
//! left on back when it stops; and a forwarding record of a namespace that ended, found by a
//! new namespace with the same inode number, is ignored, removed and said so, so the admin's
//! forwarding stays on.
//!
//! Run as root: `cargo test --all-features --test netns_say_why -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// An interface name with this suite's `th` prefix, unique to this process.
fn th_name() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "th{}y{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A copy of the binary that an unprivileged user may run (the build tree may not be
/// reachable for them).
struct PublicBinary {
    dir: PathBuf,
    bin: PathBuf,
}

impl PublicBinary {
    fn new() -> PublicBinary {
        let dir = std::env::temp_dir().join(format!("th-bin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let bin = dir.join("tunnelgate");
        std::fs::copy(tunnelgate_bin(), &bin).expect("copy the binary");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        PublicBinary { dir, bin }
    }
}

impl Drop for PublicBinary {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
#[ignore = "needs root and network namespaces"]
fn status_and_reload_without_permission_say_so_and_exit_1() {
    require_root();
    let ns = Netns::new();
    let mut cfg = TgConfig::new(0, &["100.64.94.1/32"]);
    cfg.name = th_name();
    let tg = Tunnelgate::start(&ns, cfg);
    let public = PublicBinary::new();
    let bin = public.bin.display().to_string();
    let socket = format!("/run/tunnelgate/{}.sock", tg.name());
    let as_nobody = |args: &[&str]| -> CmdOutput {
        let mut all = vec![
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            &bin,
        ];
        all.extend_from_slice(args);
        let mut cmd = ns.command(&all);
        cmd.env_remove("TUNNELGATE_CONFIG");
        cmd.env_remove("TUNNELGATE_RUN_DIR");
        output_of(cmd, None)
    };
    let cases: [&[&str]; 5] = [
        &["status"],
        &["status", "--json"],
        &["status", "--interface", tg.name()],
        &["reload"],
        &["reload", "--interface", tg.name()],
    ];
    for args in cases {
        let out = as_nobody(args);
        assert_eq!(out.code, Some(1), "{args:?} as nobody: {out:?}");
        assert!(
            out.stderr.contains("permission denied: run as root"),
            "{args:?} says why: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains(".sock"),
            "{args:?} names the socket: {}",
            out.stderr
        );
        assert!(
            !out.stdout.contains("no tunnelgate daemon"),
            "{args:?}: {}",
            out.stdout
        );
    }
    let out = as_nobody(&["status", "--interface", tg.name()]);
    assert!(out.stderr.contains(&socket), "{}", out.stderr);
    // Root still sees it.
    let out = output_of(
        ns.command(&[tunnelgate_bin(), "status", "--interface", tg.name()]),
        None,
    );
    assert!(out.success(), "{out:?}");
}

/// Whether `pid` is a zombie (exited, not reaped).
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
#[ignore = "needs root and network namespaces"]
fn a_zombie_daemon_is_dead_to_the_next_start() {
    require_root();
    let ns = Netns::new();
    // A new namespace copies IPv4 forwarding from the host's: start from off, as a node would.
    ns.sysctl("net.ipv4.ip_forward", "0");
    // Ingress needs IPv4 forwarding: the first daemon turns it on.
    let ingress = "[[ingress]]\ntarget = \"10.96.94.10\"\nports = [\"80\"]\n";
    let mut first = TgConfig::new(0, &["100.64.94.1/32"]);
    first.name = th_name();
    first.extra = ingress.into();
    let zombie = Tunnelgate::start(&ns, first);
    assert_eq!(ns.sysctl_get("net.ipv4.ip_forward"), "1");
    // Killed with -9 and not reaped: a zombie, whose /proc entry keeps its pid and start time.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(zombie.pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until(Duration::from_secs(5), "the daemon is a zombie", || {
        is_zombie(zombie.pid())
    });

    let mut second = TgConfig::new(0, &["100.64.94.2/32"]);
    second.name = th_name();
    second.extra = ingress.replace("10.96.94.10", "10.96.94.11");
    let mut next = Tunnelgate::start(&ns, second);
    assert!(
        is_zombie(zombie.pid()),
        "still unreaped while the next one runs"
    );
    let status = next.sigterm();
    assert!(status.success(), "{status:?}\n{}", next.stderr());
    assert_eq!(
        ns.sysctl_get("net.ipv4.ip_forward"),
        "0",
        "the last daemon put back what the dead one changed; stderr:\n{}",
        next.stderr()
    );
    assert!(
        next.stderr()
            .contains("A forwarding record's daemon is gone"),
        "says why it takes the dead one's record over:\n{}",
        next.stderr()
    );
    drop(zombie);
}

/// A namespace ends with a daemon's forwarding record left behind (`ipv4=needed,changed`: it
/// was killed), and the kernel gives its inode number to a new namespace, where an admin turns
/// forwarding on and then runs tunnelgate for the same interface. Taken as this namespace's,
/// the record would make the daemon's stop turn the admin's forwarding off. Its namespace
/// cookie is not this namespace's: the daemon ignores it, removes it and says so.
#[test]
#[ignore = "needs root and network namespaces"]
fn a_record_of_a_namespace_that_ended_is_ignored_and_said_so() {
    require_root();
    let ns = Netns::new();
    ns.sysctl("net.ipv4.ip_forward", "1");
    let name = th_name();
    let record = forwarding_record(&name);
    let inode = ns.exec(&["readlink", "/proc/self/ns/net"]);
    let mut gone = std::process::Command::new("true").spawn().expect("true");
    let pid = gone.id();
    gone.wait().expect("reap");
    std::fs::create_dir_all(RUN_DIR).expect("run dir");
    std::fs::write(
        &record,
        format!(
            "pid={pid}\nstart=1\nnetns={}\nnetns_cookie={}\nipv4=needed,changed\nipv6=\n",
            inode.trim(),
            u64::MAX
        ),
    )
    .expect("plant the record");

    let mut cfg = TgConfig::new(0, &["100.64.95.1/32"]);
    cfg.name = name;
    cfg.extra = "[[ingress]]\ntarget = \"10.96.95.10\"\nports = [\"80\"]\n".into();
    let mut tg = Tunnelgate::start(&ns, cfg);
    let status = tg.sigterm();
    assert!(status.success(), "{status:?}\n{}", tg.stderr());
    assert_eq!(
        ns.sysctl_get("net.ipv4.ip_forward"),
        "1",
        "the admin's forwarding stays on; stderr:\n{}",
        tg.stderr()
    );
    assert!(
        tg.stderr()
            .contains("Ignoring and removing a forwarding record whose network namespace is gone"),
        "says why:\n{}",
        tg.stderr()
    );
    assert!(!record.exists(), "{} is left", record.display());
}
