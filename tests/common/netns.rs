//! Network namespaces ([`Netns`]), entering them from a thread, and the veth pairs that join them.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::*;

fn ns_pids(ns: &str) -> Vec<i32> {
    try_run(&["ip", "netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| *p as u32 != std::process::id())
        .collect()
}

/// SIGTERM to every process in `ns`, up to 2 s for them to go, then SIGKILL.
pub(super) fn kill_ns_processes(ns: &str) {
    let pids = ns_pids(ns);
    if pids.is_empty() {
        return;
    }
    for p in &pids {
        let _ = kill(Pid::from_raw(*p), Signal::SIGTERM);
    }
    if !poll_until(Duration::from_secs(2), || ns_pids(ns).is_empty()) {
        for p in ns_pids(ns) {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        poll_until(Duration::from_secs(2), || ns_pids(ns).is_empty());
    }
}

/// A network namespace with `lo` up, deleted on drop after every process still inside it is
/// stopped. It owns a [`TempDir`] for the logs and files of what runs in it.
#[derive(Debug)]
pub struct Netns {
    pub(super) name: String,
    dir: TempDir,
}

impl Netns {
    pub fn new() -> Netns {
        require_root();
        sweep_stale();
        let name = unique_name("tgn");
        run(&["ip", "netns", "add", &name]);
        let ns = Netns {
            dir: TempDir::new(&name),
            name,
        };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's scratch directory (logs, configs).
    pub fn dir(&self) -> &TempDir {
        &self.dir
    }

    /// A `Command` for `ip netns exec NAME args...`: the process is `args[0]` itself (no shell, no
    /// fork), so its pid is the one to signal.
    ///
    /// A tunnelgate started so keeps its endpoints file (`TUNNELGATE_STATE_DIR`) in this
    /// namespace's directory: a restart in the same namespace reads it back, another namespace
    /// (another host) has its own, and nothing outlives the test.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd.env("TUNNELGATE_STATE_DIR", self.state_dir());
        cmd
    }

    /// Gives the processes of this namespace `/etc/hosts` lines of their own (`ip netns exec`
    /// mounts `/etc/netns/NAME/hosts` over `/etc/hosts`): a name that resolves to several
    /// addresses, as a Kubernetes headless Service's does. Removed with the namespace.
    pub fn hosts(&self, lines: &str) {
        let dir = Path::new("/etc/netns").join(&self.name);
        fs::create_dir_all(&dir).expect("create /etc/netns/NAME");
        fs::write(
            dir.join("hosts"),
            format!("127.0.0.1 localhost\n::1 localhost\n{lines}\n"),
        )
        .expect("write /etc/netns/NAME/hosts");
    }

    /// Where the daemons of this namespace keep their endpoints files.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Runs `args` in the namespace to completion, whatever its exit code.
    pub fn output(&self, args: &[&str]) -> CmdOutput {
        output_of(self.command(args), None)
    }

    /// Runs `args` in the namespace; `Ok(stdout)` on exit 0, else `Err` naming command and stderr.
    pub fn try_exec(&self, args: &[&str]) -> Result<String, String> {
        self.try_exec_with(args, None)
    }

    /// [`Netns::try_exec`] with `stdin` written to the command's standard input (e.g. a rule
    /// set for `nft -f -`).
    pub fn try_exec_stdin(&self, args: &[&str], stdin: &str) -> Result<String, String> {
        self.try_exec_with(args, Some(stdin))
    }

    /// [`Netns::try_exec_stdin`] that panics, showing the input, if the command fails.
    pub fn exec_stdin(&self, args: &[&str], stdin: &str) -> String {
        self.try_exec_stdin(args, stdin)
            .unwrap_or_else(|e| panic!("{e}\n--- stdin\n{stdin}"))
    }

    fn try_exec_with(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let out = output_of(self.command(args), stdin);
        if out.success() {
            Ok(out.stdout)
        } else {
            Err(format!(
                "`ip netns exec {} {}` failed ({:?}): {}",
                self.name,
                args.join(" "),
                out.code,
                out.stderr.trim()
            ))
        }
    }

    /// Runs `args` in the namespace and returns stdout; panics if it fails.
    pub fn exec(&self, args: &[&str]) -> String {
        self.try_exec(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `sh -c script` in the namespace and returns stdout; panics if it fails. A background
    /// job in `script` must redirect its output (`>/dev/null 2>&1 &`), or this waits for it.
    pub fn sh(&self, script: &str) -> String {
        self.exec(&["sh", "-c", script])
    }

    pub fn try_sh(&self, script: &str) -> Result<String, String> {
        self.try_exec(&["sh", "-c", script])
    }

    /// Starts `args` in the namespace; logs go to `dir()/<args[0]>-<n>.out|.err`. The guard kills
    /// the process on drop (and dropping the namespace kills anything left inside).
    pub fn spawn(&self, args: &[&str]) -> Proc {
        let base = Path::new(args[0])
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "proc".into());
        let label = format!("{base}-{}", COUNTER.fetch_add(1, Ordering::Relaxed));
        Proc::spawn(self.command(args), &label, self.dir.path())
    }

    /// Runs `f` on a thread that has entered this namespace (`setns(2)`) and returns its result.
    /// Sockets `f` creates live in the namespace. A panic in `f` propagates.
    pub fn in_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = self.ns_path();
        std::thread::scope(|s| {
            let h = s.spawn(move || {
                enter_ns(&path);
                f()
            });
            match h.join() {
                Ok(v) => v,
                Err(p) => std::panic::resume_unwind(p),
            }
        })
    }

    /// Starts a thread inside this namespace (for servers that outlive one call).
    pub fn thread<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        let path = self.ns_path();
        std::thread::spawn(move || {
            enter_ns(&path);
            f()
        })
    }

    fn ns_path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.name))
    }

    /// Whether `dev` exists in the namespace.
    pub fn link_exists(&self, dev: &str) -> bool {
        self.try_exec(&["ip", "link", "show", "dev", dev]).is_ok()
    }

    /// Whether `dev` exists and is administratively up.
    pub fn link_is_up(&self, dev: &str) -> bool {
        self.try_exec(&["ip", "-o", "link", "show", "dev", dev])
            .map(|s| {
                s.split_once('<')
                    .and_then(|(_, r)| r.split_once('>'))
                    .is_some_and(|(flags, _)| flags.split(',').any(|f| f == "UP"))
            })
            .unwrap_or(false)
    }

    /// `ip route show` (v4) and `ip -6 route show` of the namespace, concatenated.
    pub fn routes(&self) -> String {
        let mut s = self.exec(&["ip", "route", "show", "table", "all"]);
        s.push_str(&self.exec(&["ip", "-6", "route", "show", "table", "all"]));
        s
    }

    /// Sets a sysctl in the namespace (e.g. `net.ipv4.ip_forward`).
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec(&["sysctl", "-q", "-w", &format!("{key}={value}")]);
    }

    /// Reads a sysctl in the namespace.
    pub fn sysctl_get(&self, key: &str) -> String {
        self.exec(&["sysctl", "-n", key]).trim().to_string()
    }

    /// The process ids inside the namespace.
    pub fn pids(&self) -> Vec<i32> {
        ns_pids(&self.name)
    }
}

impl Default for Netns {
    fn default() -> Self {
        Netns::new()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The interfaces this process made here, while their daemons still hold them: a daemon
        // killed below (also while a test panics) cannot remove its sockets.
        let interfaces: Vec<String> = try_run(&["ip", "-n", &self.name, "-o", "link", "show"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|n| n.trim().split('@').next().unwrap_or_default().to_string())
            .filter(|n| made_here(n))
            .collect();
        kill_ns_processes(&self.name);
        let _ = fs::remove_dir_all(Path::new("/etc/netns").join(&self.name));
        for name in &interfaces {
            let _ = fs::remove_file(status_socket(name));
            let _ = fs::remove_file(wg_socket(name));
        }
        // A daemon killed in it left its forwarding record: the namespace's sysctls end here.
        if let Some(id) = netns_id(&self.name) {
            remove_records_of(&id);
        }
        if let Err(e) = try_run(&["ip", "netns", "del", &self.name]) {
            eprintln!("harness: {e}");
        }
    }
}

/// Moves the calling thread into the network namespace mounted at `path`.
pub(super) fn enter_ns(path: &Path) {
    let f = fs::File::open(path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns({}) failed: {e}", path.display()));
}

/// Whether the namespace `name` is still listed by `ip netns list`.
pub fn netns_exists(name: &str) -> bool {
    run(&["ip", "netns", "list"])
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

/// Deletes the conntrack entries of UDP flows to `port` in namespace `netns` (what kube-proxy
/// does when an endpoint leaves), so that the flow's next datagram is translated anew. Panics
/// when `conntrack` did not run: a missing tool must fail the test that needs it, not leave the
/// old flow in place (a test on a machine without it once failed as "no reply after the move").
pub fn forget_udp_flows(netns: &str, port: u16) {
    let mut cmd = Command::new("ip");
    cmd.args([
        "netns",
        "exec",
        netns,
        "conntrack",
        "-D",
        "-p",
        "udp",
        "--orig-port-dst",
    ])
    .arg(port.to_string());
    let out = output_of(cmd, None);
    // It exits 1 when it deleted nothing, as `ip netns exec` does for a missing program, so
    // its count line is what says it ran.
    assert!(
        out.stderr.contains("flow entries have been deleted"),
        "conntrack did not run in {netns} (apt-get install conntrack): {out:?}"
    );
}

/// The UAPI socket path of interface `name`.
pub fn wg_socket(name: &str) -> PathBuf {
    Path::new(WG_SOCKET_DIR).join(format!("{name}.sock"))
}

/// A veth pair: `a_name` in namespace `a`, `b_name` in `b`. It goes away with either namespace.
#[derive(Debug, Clone)]
pub struct Veth {
    pub a_name: String,
    pub b_name: String,
}

/// Joins `a` and `b` with a veth pair, gives each end its addresses (CIDR, v4 or v6; v6 with
/// `nodad`, so usable at once) and brings both ends up.
pub fn veth(a: &Netns, a_addrs: &[&str], b: &Netns, b_addrs: &[&str]) -> Veth {
    let a_name = unique_name("tgv");
    let b_name = unique_name("tgv");
    run(&[
        "ip", "link", "add", &a_name, "netns", &a.name, "type", "veth", "peer", "name", &b_name,
        "netns", &b.name,
    ]);
    for (ns, dev, addrs) in [(a, &a_name, a_addrs), (b, &b_name, b_addrs)] {
        for addr in addrs {
            add_addr(ns, dev, addr);
        }
        ns.exec(&["ip", "link", "set", dev, "up"]);
    }
    Veth { a_name, b_name }
}

/// Two fresh namespaces joined by a veth pair: `a` gets `a4/24` and `a6/64`, `b` gets `b4/24` and
/// `b6/64` (the underlay most suites need).
pub fn lan_pair(a4: &str, a6: &str, b4: &str, b6: &str) -> (Netns, Netns, Veth) {
    let a = Netns::new();
    let b = Netns::new();
    let v = veth(
        &a,
        &[&format!("{a4}/24"), &format!("{a6}/64")],
        &b,
        &[&format!("{b4}/24"), &format!("{b6}/64")],
    );
    (a, b, v)
}

/// Two fresh namespaces joined by a veth pair with IPv4 only: `a` gets `a4/24`, `b` gets `b4/24`.
pub fn lan_pair_v4(a4: &str, b4: &str) -> (Netns, Netns, Veth) {
    let a = Netns::new();
    let b = Netns::new();
    let v = veth(&a, &[&format!("{a4}/24")], &b, &[&format!("{b4}/24")]);
    (a, b, v)
}

/// The three-namespace lab most forwarding suites use: a client, a proxy and a cluster
/// namespace, fresh (root is required), the client and the proxy on one veth pair, the proxy
/// and the cluster on another. Addresses are CIDRs (`192.168.74.1/24`).
pub struct Lab3 {
    pub client: Netns,
    pub proxy: Netns,
    pub cluster: Netns,
}

impl Lab3 {
    pub fn new(
        client: &[&str],
        proxy_lan: &[&str],
        proxy_cluster: &[&str],
        cluster: &[&str],
    ) -> Lab3 {
        require_root();
        let lab = Lab3 {
            client: Netns::new(),
            proxy: Netns::new(),
            cluster: Netns::new(),
        };
        veth(&lab.client, client, &lab.proxy, proxy_lan);
        veth(&lab.proxy, proxy_cluster, &lab.cluster, cluster);
        lab
    }
}

/// `ip addr add ADDR dev DEV` (with `nodad` for IPv6).
pub fn add_addr(ns: &Netns, dev: &str, addr: &str) {
    if addr.contains(':') {
        ns.exec(&["ip", "-6", "addr", "add", addr, "dev", dev, "nodad"]);
    } else {
        ns.exec(&["ip", "addr", "add", addr, "dev", dev]);
    }
}

/// The address part of a CIDR ("10.0.0.1/24" -> 10.0.0.1).
pub fn ip_of(cidr: &str) -> IpAddr {
    cidr.split('/')
        .next()
        .unwrap_or(cidr)
        .parse()
        .unwrap_or_else(|e| panic!("{cidr:?} is not an address: {e}"))
}
