//! WireGuard keys, `wg show dump` parsing, peers, and the userspace WireGuard peer daemon
//! ([`WgGo`]: wireguard-go, or boringtun-cli or gotatun by [`WgImpl`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::*;

/// A WireGuard key pair, base64, made by `wg genkey` / `wg pubkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keypair {
    pub private: String,
    pub public: String,
}

impl Keypair {
    pub fn generate() -> Keypair {
        let private = run(&["wg", "genkey"]).trim().to_string();
        let public = wg_pubkey(&private);
        Keypair { private, public }
    }
}

/// `wg pubkey` of a base64 private key.
pub fn wg_pubkey(private: &str) -> String {
    let mut cmd = Command::new("wg");
    cmd.arg("pubkey");
    let out = output_of(cmd, Some(private));
    assert!(out.success(), "wg pubkey failed: {}", out.stderr);
    out.stdout.trim().to_string()
}

/// `wg genpsk`.
pub fn wg_genpsk() -> String {
    run(&["wg", "genpsk"]).trim().to_string()
}

/// A peer as configured on the other side: its public key and where/what it may send.
#[derive(Debug, Clone, Default)]
pub struct Peer {
    pub public_key: String,
    /// `host:port`, `[v6]:port`.
    pub endpoint: Option<String>,
    /// CIDRs.
    pub allowed_ips: Vec<String>,
    pub keepalive: Option<u16>,
    /// base64
    pub preshared_key: Option<String>,
    /// `peer[].name` (tunnelgate configs only; `wg` has no names).
    pub name: Option<String>,
}

impl Peer {
    pub fn new(public_key: &str, allowed_ips: &[&str]) -> Peer {
        Peer {
            public_key: public_key.to_string(),
            allowed_ips: allowed_ips.iter().map(|s| s.to_string()).collect(),
            ..Peer::default()
        }
    }

    pub fn endpoint(mut self, endpoint: &str) -> Peer {
        self.endpoint = Some(endpoint.to_string());
        self
    }

    pub fn keepalive(mut self, secs: u16) -> Peer {
        self.keepalive = Some(secs);
        self
    }

    pub fn preshared_key(mut self, psk: &str) -> Peer {
        self.preshared_key = Some(psk.to_string());
        self
    }

    pub fn name(mut self, name: &str) -> Peer {
        self.name = Some(name.to_string());
        self
    }
}

/// `wg show NAME dump`, parsed.
#[derive(Debug, Clone, Default)]
pub struct WgDump {
    pub private_key: String,
    pub public_key: String,
    pub listen_port: u16,
    /// "off" or the mark.
    pub fwmark: String,
    pub peers: Vec<WgPeerDump>,
}

/// One peer line of `wg show NAME dump`.
#[derive(Debug, Clone, Default)]
pub struct WgPeerDump {
    pub public_key: String,
    pub preshared_key: Option<String>,
    pub endpoint: Option<String>,
    pub allowed_ips: Vec<String>,
    /// Unix seconds, 0 = never.
    pub latest_handshake: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub persistent_keepalive: Option<u16>,
}

impl WgDump {
    pub fn peer(&self, public_key: &str) -> Option<&WgPeerDump> {
        self.peers.iter().find(|p| p.public_key == public_key)
    }
}

fn none_or(s: &str) -> Option<String> {
    (s != "(none)" && s != "off").then(|| s.to_string())
}

/// Parses the output of `wg show NAME dump`.
pub fn parse_wg_dump(text: &str) -> Result<WgDump, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().ok_or("empty `wg show dump`")?;
    let f: Vec<&str> = first.split('\t').collect();
    if f.len() != 4 {
        return Err(format!("bad interface line {first:?}"));
    }
    let mut dump = WgDump {
        private_key: f[0].into(),
        public_key: f[1].into(),
        listen_port: f[2]
            .parse()
            .map_err(|e| format!("listen port {:?}: {e}", f[2]))?,
        fwmark: f[3].into(),
        peers: vec![],
    };
    for line in lines {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 8 {
            return Err(format!("bad peer line {line:?}"));
        }
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|e| format!("{s:?} in {line:?}: {e}"))
        };
        dump.peers.push(WgPeerDump {
            public_key: f[0].into(),
            preshared_key: none_or(f[1]),
            endpoint: none_or(f[2]),
            allowed_ips: none_or(f[3])
                .map(|s| s.split(',').map(|s| s.to_string()).collect())
                .unwrap_or_default(),
            latest_handshake: num(f[4])?,
            rx_bytes: num(f[5])?,
            tx_bytes: num(f[6])?,
            persistent_keepalive: none_or(f[7]).and_then(|s| s.parse().ok()),
        });
    }
    Ok(dump)
}

/// `wg show NAME dump` against the UAPI socket of `iface` (any daemon), parsed; `Err` if `wg` fails.
pub fn try_wg_dump(iface: &str) -> Result<WgDump, String> {
    parse_wg_dump(&try_run(&["wg", "show", iface, "dump"])?)
}

/// [`try_wg_dump`], panicking on failure.
pub fn wg_dump(iface: &str) -> WgDump {
    try_wg_dump(iface).unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until interface `iface` reports a handshake with `peer_public`.
pub fn wait_handshake(iface: &str, peer_public: &str, timeout: Duration) {
    wait_until(
        timeout,
        &format!("{iface} has a handshake with {peer_public}"),
        || {
            try_wg_dump(iface)
                .ok()
                .and_then(|d| d.peer(peer_public).map(|p| p.latest_handshake > 0))
                .unwrap_or(false)
        },
    );
}

/// `wg set IFACE peer ...` arguments for `peer` (key files written to `dir`).
fn wg_set_peer_args(peer: &Peer, dir: &TempDir) -> Vec<String> {
    let mut a = vec!["peer".to_string(), peer.public_key.clone()];
    if let Some(psk) = &peer.preshared_key {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let f = dir.write_secret(&format!("psk-{n}"), psk);
        a.extend(["preshared-key".into(), f.display().to_string()]);
    }
    if let Some(ep) = &peer.endpoint {
        a.extend(["endpoint".into(), ep.clone()]);
    }
    if let Some(k) = peer.keepalive {
        a.extend(["persistent-keepalive".into(), k.to_string()]);
    }
    a.extend(["allowed-ips".into(), peer.allowed_ips.join(",")]);
    a
}

/// Where the benches and scripts/test.sh `cargo install` the peers that Debian does not package
/// (`${XDG_CACHE_HOME:-$HOME/.cache}/tunnelgate-bench/bin`, as benches/iperf/bench.py does).
pub fn cargo_tool_dir() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        });
    cache.join("tunnelgate-bench").join("bin")
}

/// `command` on PATH, else in [`cargo_tool_dir`].
fn find_tool(command: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(command))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([cargo_tool_dir().join(command)])
        .find(|p| p.is_file())
}

/// The userspace WireGuard implementations a [`WgGo`] peer can run. Each makes a bare TUN
/// interface in the foreground and serves UAPI at `/var/run/wireguard/NAME.sock`, so `wg` and
/// `ip` configure them all the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgImpl {
    /// Debian's `wireguard-go` (PATH).
    WireguardGo,
    /// `boringtun-cli` (crate `boringtun-cli`), on PATH or in [`cargo_tool_dir`].
    Boringtun,
    /// Mullvad's fork of boringtun, `gotatun` (crate `gotatun-cli`), on PATH or in
    /// [`cargo_tool_dir`].
    Gotatun,
    /// This build's `tunnelgate userspace` (the wireguard-go drop-in); `true`: with
    /// `--takeover-any-source`.
    Tunnelgate { any_source: bool },
}

impl WgImpl {
    pub fn label(self) -> &'static str {
        match self {
            WgImpl::WireguardGo => "wireguard-go",
            WgImpl::Boringtun => "boringtun-cli",
            WgImpl::Gotatun => "gotatun",
            WgImpl::Tunnelgate { .. } => "tunnelgate",
        }
    }

    /// How to install it.
    fn install_hint(self) -> String {
        let root = cargo_tool_dir();
        let root = root.parent().unwrap_or(Path::new("")).display();
        match self {
            WgImpl::WireguardGo => "apt-get install --no-install-recommends wireguard-go".into(),
            WgImpl::Boringtun => format!("cargo install boringtun-cli --locked --root {root}"),
            WgImpl::Gotatun => format!("cargo install gotatun-cli --locked --root {root}"),
            WgImpl::Tunnelgate { .. } => "cargo build (this repository)".into(),
        }
    }

    /// Its binary, or why there is none.
    pub fn binary(self) -> Result<PathBuf, String> {
        if let WgImpl::Tunnelgate { .. } = self {
            return Ok(PathBuf::from(tunnelgate_bin()));
        }
        find_tool(self.label()).ok_or_else(|| {
            format!(
                "{} is neither on PATH nor in {} (install it: `{}`; scripts/test.sh does)",
                self.label(),
                cargo_tool_dir().display(),
                self.install_hint()
            )
        })
    }

    /// Whether its binary is there; when it is not, the test [`skip`]s (under `CI=true` it
    /// fails: scripts/test.sh installs all three).
    pub fn available_or_skip(self) -> bool {
        ok_or_skip(self.binary()).is_some()
    }

    /// `ip netns exec NS BINARY ... NAME`, in the foreground, as root.
    fn command(self, ns: &Netns, name: &str) -> Command {
        let binary = self.binary().unwrap_or_else(|e| panic!("{e}"));
        let binary = binary.to_string_lossy();
        match self {
            WgImpl::WireguardGo => {
                let mut cmd = ns.command(&[&binary, "-f", name]);
                cmd.env("WG_PROCESS_FOREGROUND", "1");
                cmd
            }
            WgImpl::Tunnelgate { any_source } => {
                let mut args = vec![binary.as_ref(), "userspace", "-f", name];
                if any_source {
                    args.push("--takeover-any-source");
                }
                ns.command(&args)
            }
            // Both log to stdout in the foreground.
            WgImpl::Boringtun | WgImpl::Gotatun => {
                let mut cmd =
                    ns.command(&[&binary, "--foreground", "--disable-drop-privileges", name]);
                cmd.env("WG_SUDO", "1");
                cmd
            }
        }
    }
}

/// A userspace WireGuard peer running in a namespace (wireguard-go by default, see [`WgImpl`]),
/// configured with `wg`. Dropping it stops the daemon (SIGTERM, then SIGKILL) and removes its
/// socket if left behind.
#[derive(Debug)]
pub struct WgGo {
    ns: String,
    name: String,
    pub key: Keypair,
    proc: Proc,
    dir: TempDir,
}

impl WgGo {
    /// Starts wireguard-go with a fresh key, `listen_port` (0 = random) and tunnel `addresses`
    /// (CIDRs; their prefixes give connected routes), and brings the interface up.
    pub fn start(ns: &Netns, listen_port: u16, addresses: &[&str]) -> WgGo {
        WgGo::start_with_key(ns, Keypair::generate(), listen_port, addresses)
    }

    pub fn start_with_key(ns: &Netns, key: Keypair, listen_port: u16, addresses: &[&str]) -> WgGo {
        WgGo::start_impl(ns, WgImpl::WireguardGo, key, listen_port, addresses)
    }

    /// [`WgGo::start_with_key`] with the implementation `imp` (its binary must be there: see
    /// [`WgImpl::available`]).
    pub fn start_impl(
        ns: &Netns,
        imp: WgImpl,
        key: Keypair,
        listen_port: u16,
        addresses: &[&str],
    ) -> WgGo {
        WgGo::start_named(ns, imp, &unique_name("tgw"), key, listen_port, addresses)
    }

    /// [`WgGo::start_impl`] with the interface named `name`: a restart of an earlier one.
    pub fn start_named(
        ns: &Netns,
        imp: WgImpl,
        name: &str,
        key: Keypair,
        listen_port: u16,
        addresses: &[&str],
    ) -> WgGo {
        let name = name.to_string();
        let dir = TempDir::new(&name);
        let mut proc = Proc::spawn(imp.command(ns, &name), &name, dir.path());
        let sock = wg_socket(&name);
        let up = poll_until(Duration::from_secs(10), || {
            sock.exists() || !proc.is_running()
        });
        if !up || !sock.exists() {
            let _ = proc.kill9();
            panic!(
                "{} {name} did not create {} (exited: {:?}); stdout:\n{}\nstderr:\n{}",
                imp.label(),
                sock.display(),
                proc.try_wait(),
                proc.stdout(),
                proc.stderr()
            );
        }
        let wg = WgGo {
            ns: ns.name.clone(),
            name,
            key,
            proc,
            dir,
        };
        let keyfile = wg.dir.write_secret("private.key", &wg.key.private);
        wg.wg(&[
            "set",
            &wg.name,
            "private-key",
            &keyfile.display().to_string(),
            "listen-port",
            &listen_port.to_string(),
        ]);
        for addr in addresses {
            let v6 = addr.contains(':');
            let mut args = vec!["ip"];
            if v6 {
                args.push("-6");
            }
            args.extend(["addr", "add", addr, "dev", &wg.name]);
            if v6 {
                args.push("nodad");
            }
            wg.ns_exec(&args);
        }
        wg.ns_exec(&["ip", "link", "set", &wg.name, "up"]);
        wg
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn public_key(&self) -> &str {
        &self.key.public
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The actual listen port (useful after starting with 0).
    pub fn listen_port(&self) -> u16 {
        self.dump().listen_port
    }

    fn ns_exec(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).args(args);
        let out = output_of(cmd, None);
        assert!(
            out.success(),
            "`ip netns exec {} {}` failed: {}",
            self.ns,
            args.join(" "),
            out.stderr
        );
        out.stdout
    }

    /// Runs `wg ARGS` (in the daemon's namespace) and returns stdout; panics on failure.
    pub fn wg(&self, args: &[&str]) -> String {
        let mut full = vec!["wg"];
        full.extend_from_slice(args);
        self.ns_exec(&full)
    }

    /// Adds (or updates) a peer with `wg set`, and routes its allowed IPs through the interface
    /// (`ip route replace`; a /0 is skipped: add default routes yourself).
    pub fn add_peer(&self, peer: &Peer) {
        let args = wg_set_peer_args(peer, &self.dir);
        let mut full = vec!["set", self.name.as_str()];
        full.extend(args.iter().map(|s| s.as_str()));
        self.wg(&full);
        for net in &peer.allowed_ips {
            if net.ends_with("/0") {
                continue;
            }
            let fam = if net.contains(':') { "-6" } else { "-4" };
            self.ns_exec(&["ip", fam, "route", "replace", net, "dev", &self.name]);
        }
    }

    /// `wg set NAME peer KEY remove`.
    pub fn remove_peer(&self, public_key: &str) {
        self.wg(&["set", &self.name, "peer", public_key, "remove"]);
    }

    pub fn dump(&self) -> WgDump {
        wg_dump(&self.name)
    }

    /// Daemon output so far (stdout and stderr).
    pub fn logs(&self) -> String {
        format!("{}{}", self.proc.stdout(), self.proc.stderr())
    }

    /// SIGTERM and wait for the exit status.
    pub fn sigterm(&mut self) -> ExitStatus {
        self.proc.sigterm(Duration::from_secs(10))
    }

    /// SIGKILL (leaves the socket file behind, as a crash would).
    pub fn kill9(&mut self) -> ExitStatus {
        self.proc.kill9()
    }
}

impl Drop for WgGo {
    fn drop(&mut self) {
        self.proc.stop_quietly(Duration::from_secs(3));
        let _ = fs::remove_file(wg_socket(&self.name));
    }
}
