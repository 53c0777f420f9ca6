//! The validated configuration: typed values only, every error naming its key. Pure: the one
//! thing it needs from outside (reading key files) comes in through [`SecretFiles`].

mod keys;
mod ports;
mod raw;
mod unknown_keys;
mod validate;
pub mod wgquick;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use ipnet::IpNet;
pub use keys::{decode_key, PublicKey, SecretKey};
pub use ports::{PortMap, Proto};
pub use validate::{ingress_warnings, DEFAULT_METRICS_PEERS};

/// Default TUN MTU: 1500 minus the 80 bytes of IPv6 + UDP + WireGuard overhead.
pub const DEFAULT_MTU: u16 = 1420;
/// Default health endpoint, as in the contract.
pub const DEFAULT_HEALTH_LISTEN: &str = "127.0.0.1:9002";
/// How often DNS-named targets are resolved again unless configured.
pub const DEFAULT_RERESOLVE_INTERVAL: Duration = Duration::from_secs(600);
/// How often installed rules are compared with the desired ones unless configured.
pub const DEFAULT_REPAIR_INTERVAL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub interface: Interface,
    pub peers: Vec<Peer>,
    pub firewall: Firewall,
    pub ingress: Vec<Forward>,
    pub egress: Vec<Forward>,
    pub router: Router,
    pub dns: Dns,
    pub health: Health,
    pub takeover: Takeover,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub private_key: SecretKey,
    /// 0 = let the kernel choose.
    pub listen_port: u16,
    pub addresses: Vec<IpNet>,
    pub mtu: u16,
    /// Mark on the WireGuard socket; `None` = choose one when a default route needs it.
    pub fwmark: Option<u32>,
    /// Packet workers (`interface.workers`); `None` = the CPUs this process may use (its
    /// affinity and cgroup quota). Fixed for the life of the daemon.
    pub workers: Option<u16>,
    /// Where peers reach this host (`interface.public_endpoint`): a load balancer's address in
    /// front of a group of replicas, an HA pair's moving address, a NAT's public side. Only
    /// printed, in the client's `[Peer]` section (`check`); the daemon never dials it.
    pub public_endpoint: Option<Endpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// A short label for status, logs and the `peer_name` metric label.
    pub name: Option<String>,
    pub public_key: PublicKey,
    pub preshared_key: Option<SecretKey>,
    pub endpoint: Option<Endpoint>,
    pub allowed_ips: Vec<IpNet>,
    pub persistent_keepalive: Option<u16>,
}

/// A peer endpoint: an address, or a name resolved when the daemon starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Addr(SocketAddr),
    Host { host: String, port: u16 },
}

impl Endpoint {
    /// `host:port` as the config takes it (`peer.endpoint`, `interface.public_endpoint`): an
    /// address, or a DNS name, with a port other than 0.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        validate::parse_endpoint(text)
    }
}

/// As written in a config or a wg-quick `Endpoint =` line: `198.51.100.7:51820`,
/// `[2001:db8::1]:51820`, `vpn.example.com:51820`.
impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Addr(addr) => write!(f, "{addr}"),
            Endpoint::Host { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirewallMode {
    Auto,
    Nftables,
    Iptables,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Firewall {
    pub mode: FirewallMode,
    pub mss_clamp: bool,
    /// `None` disables drift repair.
    pub repair_interval: Option<Duration>,
}

/// Where an ingress or egress rule sends traffic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Ip(IpAddr),
    /// A validated, lower-case DNS name without the trailing dot.
    Fqdn(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    pub target: Target,
    /// Empty: every port and protocol.
    pub ports: Vec<PortMap>,
    /// `service`: what this rule serves (the sidecar writes the Kubernetes Service's
    /// `NAMESPACE/NAME`), for status, metrics and [`Readiness::PerService`].
    pub service: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Router {
    pub advertise_routes: Vec<IpNet>,
    pub exit_node: bool,
    /// With `exit_node`: whether "anywhere" includes the private networks (the host's LAN,
    /// RFC 1918, link-local, ULA). `false` keeps peers to the advertised routes there.
    pub exit_node_lan: bool,
    pub snat: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dns {
    pub reresolve_interval: Duration,
    /// Empty: the system's resolv.conf.
    pub nameservers: Vec<SocketAddr>,
}

/// `[takeover]`: which endpoints a takeover may send to, where this identity keeps the
/// endpoints it authenticated across a restart, and the exchange of endpoints between the
/// replicas of a group that shares the identity. Fixed for the life of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Takeover {
    /// `answer_any_source`: [`Answer::AnySource`] answers any source, proven or not.
    pub answer: crate::takeover::Answer,
    pub state_file: StateFile,
    /// `group_listen` and `group_replicas`, both or neither.
    pub group: Option<GroupExchange>,
}

/// `takeover.state_file`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StateFile {
    /// Absent: `<name>.endpoints` in the state directory the service manager gives
    /// (`$STATE_DIRECTORY`), else `/var/lib/tunnelgate` (the shell decides).
    #[default]
    Default,
    /// `""`: endpoints are not kept across a restart.
    Off,
    Path(PathBuf),
}

/// `takeover.group_listen` / `group_replicas`: the replicas of one identity tell each other
/// where they saw its peers authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupExchange {
    pub listen: SocketAddr,
    /// Every address this resolves to is a replica (re-resolved); its port is theirs.
    pub replicas: Endpoint,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub listen: Option<SocketAddr>,
    /// Let tunnel peers reach the health endpoint (and every other listener of this host):
    /// no input guard is installed. Default false.
    pub allow_from_tunnel: bool,
    /// What an unresolved `target_fqdn` does to `/readyz`.
    pub readiness: Readiness,
    /// The most peers `/metrics` gives series of their own: the busiest (most bytes moved);
    /// the totals over every peer are always there. Default
    /// [`DEFAULT_METRICS_PEERS`].
    pub metrics_peers: usize,
}

/// `health.readiness`: whose problem a `target_fqdn` that does not resolve is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Readiness {
    /// `"all"` (default): every name must have resolved before `/readyz` answers 200, as must
    /// every rule, address and route. Right for a daemon that serves one thing.
    #[default]
    All,
    /// `"per-service"`: a name that only rules with a `service` label use is that service's
    /// problem: it is reported per service (status, metrics) and never holds `/readyz` back,
    /// so one service's bad name does not take the others off this host (a proxy group).
    /// Names of unlabelled rules, and everything else, still count.
    PerService,
}

impl Readiness {
    /// The key's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Readiness::All => "all",
            Readiness::PerService => "per-service",
        }
    }
}

/// Who needs one `target_fqdn` (see [`Config::fqdn_users`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameUsers {
    /// The `service` labels of the rules that use it, sorted.
    pub services: Vec<String>,
    /// Whether `/readyz` waits for it to resolve.
    pub holds_readiness: bool,
}

/// One problem with the configuration: which key, what it held, what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ConfigError {
    pub key: String,
    pub problem: String,
}

/// Every problem found in one pass, so a user fixes them all at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
pub struct ConfigErrors(pub Vec<ConfigError>);

/// Reads the secret files a configuration names. The daemon's implementation refuses files
/// that group or others can read; tests use an in-memory map.
pub trait SecretFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String>;

    /// [`SecretFiles::read_secret`] for a configuration with
    /// `interface.key_files_readable_by_group`: the daemon's implementation then accepts a file
    /// its group may read (a key that a sidecar writes to a volume only the pod's containers
    /// share), still never one others may read or the group may write.
    fn read_secret_readable_by_group(&self, path: &Path) -> Result<String, String> {
        self.read_secret(path)
    }
}

impl Config {
    /// The configuration of a device that only has a name: what `tunnelgate userspace IFNAME`
    /// runs with (see `Control::userspace`). No file, no key, no address: nothing to validate
    /// but the name.
    pub fn device_only(name: &str) -> Result<Config, ConfigError> {
        validate::device_only(name)
    }

    /// Parses and validates `text`; relative key file paths are resolved against `base_dir`.
    pub fn parse(
        text: &str,
        base_dir: &Path,
        files: &dyn SecretFiles,
    ) -> Result<Config, ConfigErrors> {
        if wgquick::looks_like_wg_quick(text) {
            return Err(ConfigErrors(vec![wgquick::not_toml_error("FILE")]));
        }
        // Every unknown key, then every other problem: one pass shows them all. The generic
        // table goes before the typed parse (at 10,000 rules each is tens of MB).
        let mut errors = {
            let table: toml::Table =
                toml::from_str(text).map_err(|e| ConfigErrors(vec![toml_error(text, &e)]))?;
            let single = single_table_sections(&table);
            if !single.is_empty() {
                // The typed parse would only add "invalid type: map, expected a sequence".
                return Err(ConfigErrors(single));
            }
            unknown_keys::unknown_keys(&table)
        };
        match Config::parse_known_keys(text, base_dir, files) {
            Ok(config) if errors.is_empty() => Ok(config),
            Ok(_) => Err(ConfigErrors(errors)),
            Err(ConfigErrors(more)) => {
                errors.extend(more);
                Err(ConfigErrors(errors))
            }
        }
    }

    /// [`Config::parse`] without its pass for unknown keys (where a key that is no key is
    /// silently ignored): for text a program rendered from keys it knows and a base that
    /// [`Config::parse`] accepted, like a proxy group's 10,000 rules, where that pass's generic
    /// table costs tens of MB.
    pub fn parse_known_keys(
        text: &str,
        base_dir: &Path,
        files: &dyn SecretFiles,
    ) -> Result<Config, ConfigErrors> {
        let raw: raw::RawConfig =
            toml::from_str(text).map_err(|e| ConfigErrors(vec![toml_error(text, &e)]))?;
        validate::validate(raw, base_dir, files)
    }

    /// [`Config::parse_known_keys`] of `base` with `rules` appended, each a text of only
    /// `[[ingress]]` / `[[egress]]` tables: what the text they make together gives when the
    /// base's own rules come first in it (a proxy group's rendering). Each part is parsed on its
    /// own, so 20,000 rules never make one TOML parse tree (that took tens of MB).
    pub fn parse_known_keys_with_rules<'a>(
        base: &str,
        rules: impl IntoIterator<Item = &'a str>,
        base_dir: &Path,
        files: &dyn SecretFiles,
    ) -> Result<Config, ConfigErrors> {
        let mut raw: raw::RawConfig =
            toml::from_str(base).map_err(|e| ConfigErrors(vec![toml_error(base, &e)]))?;
        for text in rules {
            let part: raw::RawRules =
                toml::from_str(text).map_err(|e| ConfigErrors(vec![toml_error(text, &e)]))?;
            raw.ingress.extend(part.ingress);
            raw.egress.extend(part.egress);
        }
        validate::validate(raw, base_dir, files)
    }

    /// The tunnel address of `family` (v4 or v6) that SNAT uses, if any.
    pub fn tunnel_address(&self, v6: bool) -> Option<IpAddr> {
        self.interface
            .addresses
            .iter()
            .map(IpNet::addr)
            .find(|a| a.is_ipv6() == v6)
    }

    /// Every name that must be resolved for the forwarding rules, with who needs it: the
    /// `service` labels of the rules that use it, and whether it holds readiness (an unlabelled
    /// rule uses it, or `health.readiness` is `all`).
    pub fn fqdn_users(&self) -> BTreeMap<String, NameUsers> {
        let mut users: BTreeMap<String, NameUsers> = BTreeMap::new();
        for fwd in self.ingress.iter().chain(&self.egress) {
            let Target::Fqdn(name) = &fwd.target else {
                continue;
            };
            let entry = users.entry(name.clone()).or_default();
            match &fwd.service {
                Some(service) => {
                    if !entry.services.contains(service) {
                        entry.services.push(service.clone());
                    }
                }
                None => entry.holds_readiness = true,
            }
            if self.health.readiness == Readiness::All {
                entry.holds_readiness = true;
            }
        }
        for u in users.values_mut() {
            u.services.sort();
        }
        users
    }

    /// Every name that must be resolved for the forwarding rules.
    pub fn fqdn_targets(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .ingress
            .iter()
            .chain(&self.egress)
            .filter_map(|f| match &f.target {
                Target::Fqdn(n) => Some(n.clone()),
                Target::Ip(_) => None,
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Settings that are valid but probably not what the user wants: printed by `check` and
    /// logged at start, never fatal.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, p) in self.peers.iter().enumerate() {
            let text = p.public_key.to_base64();
            if key_looks_like_placeholder(&p.public_key.0, &text) {
                out.push(format!(
                    "peer[{i}].public_key: \"{text}\" looks like a placeholder: expected the peer's real public key (its `wg pubkey`)"
                ));
            }
        }
        if key_looks_like_placeholder(
            &self.interface.private_key.0,
            &self.interface.private_key.expose_base64(),
        ) {
            out.push(
                "interface.private_key: looks like a placeholder: expected a key from `tunnelgate genkey`"
                    .to_string(),
            );
        }
        if self.router.exit_node && !self.router.snat {
            out.push(
                "router.snat: false with router.exit_node = true: forwarded traffic leaves with \
                 the peers' tunnel addresses as source, so replies come back only if the \
                 upstream network routes the tunnel addresses to this host; expected snat = true \
                 for an exit node"
                    .to_string(),
            );
        }
        out
    }
}

/// `[peer]` (one table) where `[[peer]]` (an array of tables) is meant, and the same for
/// `[ingress]` / `[egress]`: the typed parse's own error, "invalid type: map, expected a
/// sequence", names neither the fix nor the section.
fn single_table_sections(table: &toml::Table) -> Vec<ConfigError> {
    [("peer", "peer"), ("ingress", "rule"), ("egress", "rule")]
        .into_iter()
        .filter(|(section, _)| table.get(*section).is_some_and(toml::Value::is_table))
        .map(|(section, what)| ConfigError {
            key: section.to_string(),
            problem: format!(
                "written as [{section}] (one table): use [[{section}]] (an array of tables), \
                 one [[{section}]] header per {what}"
            ),
        })
        .collect()
}

/// True for keys that are clearly not real: every byte the same (`AAAA...=`, `AQEB...=`), or a
/// base64 text spelling a word like `REPLACE+ME`, `CHANGEME`, `EXAMPLE`, `PLACEHOLDER`.
pub fn key_looks_like_placeholder(bytes: &[u8; 32], base64: &str) -> bool {
    if bytes.iter().all(|b| *b == bytes[0]) {
        return true;
    }
    let lower = base64.to_ascii_lowercase();
    [
        "replace",
        "changeme",
        "example",
        "placeholder",
        "xxxxxx",
        "yourkey",
        "insert",
    ]
    .iter()
    .any(|w| lower.contains(w))
}

/// The warning for secrets written inline in a config file that group or others can read
/// (`mode` is its permission bits), if there is one to give. `text` is the file's TOML.
pub fn inline_secret_warning(text: &str, mode: u32) -> Option<String> {
    if mode & 0o077 == 0 {
        return None;
    }
    let table: toml::Table = toml::from_str(text).ok()?;
    let mut keys = Vec::new();
    if table
        .get("interface")
        .and_then(|i| i.get("private_key"))
        .is_some()
    {
        keys.push("interface.private_key".to_string());
    }
    if let Some(peers) = table.get("peer").and_then(toml::Value::as_array) {
        for (i, p) in peers.iter().enumerate() {
            if p.get("preshared_key").is_some() {
                keys.push(format!("peer[{i}].preshared_key"));
            }
        }
    }
    if keys.is_empty() {
        return None;
    }
    Some(format!(
        "{}: a secret written inline in a file readable by group or others (mode {:04o}): \
         expected mode 0600 (chmod 600), or the key in a 0600 file (private_key_file, \
         preshared_key_file)",
        keys.join(", "),
        mode & 0o777
    ))
}

/// `interface.name` of a config file's text, read leniently: the rest of the file may be
/// invalid (a reload must still find the daemon that runs it). `None` when the TOML itself
/// cannot be read or names no interface.
pub fn interface_name_of(text: &str) -> Option<String> {
    let value: toml::Table = toml::from_str(text).ok()?;
    value
        .get("interface")?
        .get("name")?
        .as_str()
        .map(str::to_string)
}

/// A parse or type error of the TOML text, under the key it is about.
fn toml_error(text: &str, e: &toml::de::Error) -> ConfigError {
    ConfigError {
        // The parser does not say which key a type error is about: read it off the text.
        key: e
            .span()
            .and_then(|s| key_at(text, s.start))
            .unwrap_or_else(|| "(file)".into()),
        problem: e.message().to_string() + &span_hint(text, e.span()),
    }
}

/// The dotted key (`interface.listen_port`, `peer[1].allowed_ips`) on the line of `offset`,
/// under the nearest table header before it; `None` where no key can be read.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let header = |line: &str| -> Option<(String, bool)> {
        let t = line.trim();
        if let Some(r) = t.strip_prefix("[[") {
            return r
                .split_once("]]")
                .map(|(n, _)| (n.trim().to_string(), true));
        }
        let r = t.strip_prefix('[')?;
        r.split_once(']')
            .map(|(n, _)| (n.trim().to_string(), false))
    };
    let mut section: Option<String> = None;
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for line in text[..line_start].lines() {
        if let Some((name, array)) = header(line) {
            section = Some(if array {
                let n = counts.entry(name.clone()).or_insert(0);
                *n += 1;
                format!("{name}[{}]", *n - 1)
            } else {
                name
            });
        }
    }
    let line = text[line_start..].lines().next().unwrap_or("");
    if let Some((name, array)) = header(line) {
        let n = counts.get(&name).copied().unwrap_or(0);
        return Some(if array { format!("{name}[{n}]") } else { name });
    }
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"').to_string())
        .filter(|k| !k.is_empty());
    match (section, key) {
        (Some(s), Some(k)) => Some(format!("{s}.{k}")),
        (None, Some(k)) => Some(k),
        (s, None) => s,
    }
}

fn span_hint(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    match span {
        Some(s) => {
            let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
            format!(" (line {line})")
        }
        None => String::new(),
    }
}

#[cfg(test)]
mod tests;
