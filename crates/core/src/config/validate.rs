//! Raw TOML values -> typed [`Config`]. Collects every error, each naming its key, the bad value
//! and what was expected.

use super::keys::decode_key;
#[cfg(test)]
use super::ports::overlap;
use super::raw::{RawConfig, RawForward};
use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, key: impl Into<String>, problem: impl Into<String>) {
        self.0.push(ConfigError {
            key: key.into(),
            problem: problem.into(),
        });
    }
}

pub(super) fn validate(
    raw: RawConfig,
    base_dir: &Path,
    files: &dyn SecretFiles,
) -> Result<Config, ConfigErrors> {
    let mut errs = Errors(Vec::new());
    let readable_by_group = raw
        .interface
        .as_ref()
        .and_then(|i| i.key_files_readable_by_group)
        .unwrap_or(false);
    let group_files = ReadableByGroup(files);
    let files: &dyn SecretFiles = if readable_by_group {
        &group_files
    } else {
        files
    };
    let interface = interface(
        raw.interface.unwrap_or_default(),
        base_dir,
        files,
        &mut errs,
    );
    let peers = peers(raw.peer, &interface, base_dir, files, &mut errs);
    let firewall = firewall(raw.firewall.unwrap_or_default(), &mut errs);
    let ingress = forwards("ingress", raw.ingress, &interface, &mut errs);
    let egress = forwards("egress", raw.egress, &interface, &mut errs);
    let router = router(raw.router.unwrap_or_default(), &interface, &mut errs);
    let dns = dns(raw.dns.unwrap_or_default(), &mut errs);
    let health = health(raw.health.unwrap_or_default(), &mut errs);
    let takeover = takeover(raw.takeover.unwrap_or_default(), base_dir, &mut errs);
    check_egress_ports(&egress, &interface, &health, &takeover, &mut errs);
    if errs.0.is_empty() {
        Ok(Config {
            interface,
            peers,
            firewall,
            ingress,
            egress,
            router,
            dns,
            health,
            takeover,
        })
    } else {
        Err(ConfigErrors(errs.0))
    }
}

/// The configuration of a device that only has a name (`tunnelgate userspace IFNAME`): every
/// section at its default, no address, no peer, no rule, no health endpoint, and no key (the
/// `private_key` field holds zeros that nothing reads: in `Mode::Userspace` the core and the
/// data plane start without a key, as wireguard-go does). Only the name can be wrong.
pub(super) fn device_only(name: &str) -> Result<Config, ConfigError> {
    if !valid_ifname(name) {
        return Err(ConfigError {
            key: "interface.name".into(),
            problem: format!("\"{name}\" is not a valid interface name: expected 1-15 characters of letters, digits, '-', '_' or '.'"),
        });
    }
    let mut errs = Errors(Vec::new());
    let interface = Interface {
        name: name.to_string(),
        private_key: SecretKey([0; 32]),
        listen_port: 0,
        addresses: Vec::new(),
        mtu: DEFAULT_MTU,
        fwmark: None,
        workers: None,
        public_endpoint: None,
    };
    let router = router(super::raw::RawRouter::default(), &interface, &mut errs);
    let config = Config {
        peers: Vec::new(),
        firewall: firewall(super::raw::RawFirewall::default(), &mut errs),
        ingress: Vec::new(),
        egress: Vec::new(),
        router,
        dns: dns(super::raw::RawDns::default(), &mut errs),
        health: Health {
            listen: None,
            ..health(super::raw::RawHealth::default(), &mut errs)
        },
        takeover: Takeover::default(),
        interface,
    };
    // Defaults are valid by construction (the config tests parse an empty file's sections).
    debug_assert!(errs.0.is_empty(), "{:?}", errs.0);
    Ok(config)
}

fn interface(
    raw: super::raw::RawInterface,
    base_dir: &Path,
    files: &dyn SecretFiles,
    errs: &mut Errors,
) -> Interface {
    let name = raw.name.unwrap_or_else(|| "tg0".into());
    if !valid_ifname(&name) {
        errs.push(
            "interface.name",
            format!("\"{name}\" is not a valid interface name: expected 1-15 characters of letters, digits, '-', '_' or '.'"),
        );
    }
    let private_key = secret(
        "interface.private_key",
        raw.private_key,
        raw.private_key_file,
        true,
        base_dir,
        files,
        errs,
    )
    .unwrap_or(SecretKey([0; 32]));
    let listen_port = int_in("interface.listen_port", raw.listen_port, 0, 65535, 0, errs) as u16;
    let mut addresses = Vec::new();
    for (i, text) in raw.addresses.iter().enumerate() {
        match text.parse::<IpNet>() {
            Ok(net) => addresses.push(net),
            Err(_) => errs.push(
                format!("interface.addresses[{i}]"),
                format!("\"{text}\" is not an address with prefix: expected like \"100.64.0.1/32\" or \"fd7a:115c:a1e0::1/128\""),
            ),
        }
    }
    if raw.addresses.is_empty() {
        errs.push(
            "interface.addresses",
            "is empty: expected at least one tunnel address",
        );
    }
    let min_mtu = if addresses.iter().any(|a| a.addr().is_ipv6()) {
        1280
    } else {
        576
    };
    let mtu = int_in(
        "interface.mtu",
        raw.mtu,
        min_mtu,
        65535,
        DEFAULT_MTU.into(),
        errs,
    ) as u16;
    let fwmark = match int_in("interface.fwmark", raw.fwmark, 0, u32::MAX.into(), 0, errs) {
        0 => None,
        m => Some(m as u32),
    };
    let workers = match int_in(
        "interface.workers",
        raw.workers,
        0,
        MAX_WORKERS.into(),
        0,
        errs,
    ) {
        0 => None,
        n => Some(n as u16),
    };
    let public_endpoint =
        raw.public_endpoint
            .as_deref()
            .and_then(|text| match parse_endpoint(text) {
                Ok(e) => Some(e),
                Err(problem) => {
                    errs.push("interface.public_endpoint", problem);
                    None
                }
            });
    Interface {
        name,
        private_key,
        listen_port,
        addresses,
        mtu,
        fwmark,
        workers,
        public_endpoint,
    }
}

fn peers(
    raws: Vec<super::raw::RawPeer>,
    interface: &Interface,
    base_dir: &Path,
    files: &dyn SecretFiles,
    errs: &mut Errors,
) -> Vec<Peer> {
    let own_public = interface.private_key.public_key();
    let mut seen_keys: BTreeMap<PublicKey, usize> = BTreeMap::new();
    let mut seen_nets: BTreeMap<IpNet, usize> = BTreeMap::new();
    let mut seen_names: BTreeMap<String, usize> = BTreeMap::new();
    let mut peers = Vec::new();
    for (i, raw) in raws.into_iter().enumerate() {
        let key = format!("peer[{i}]");
        let public_key = match raw
            .public_key
            .as_deref()
            .map(|text| decode_key(text).map_err(|e| format!("\"{text}\" {e}")))
        {
            None => {
                errs.push(
                    format!("{key}.public_key"),
                    "is missing: expected a base64 key",
                );
                PublicKey([0; 32])
            }
            Some(Err(e)) => {
                errs.push(format!("{key}.public_key"), e);
                PublicKey([0; 32])
            }
            Some(Ok(k)) => {
                let pk = PublicKey(k);
                if let Some(first) = seen_keys.insert(pk, i) {
                    errs.push(
                        format!("{key}.public_key"),
                        format!("\"{pk}\" is already peer[{first}]: expected each peer once"),
                    );
                }
                if pk == own_public {
                    errs.push(
                        format!("{key}.public_key"),
                        "is this interface's own public key: expected another host's key",
                    );
                }
                pk
            }
        };
        let preshared_key = secret(
            &format!("{key}.preshared_key"),
            raw.preshared_key,
            raw.preshared_key_file,
            false,
            base_dir,
            files,
            errs,
        );
        let endpoint = raw
            .endpoint
            .as_deref()
            .and_then(|e| match parse_endpoint(e) {
                Ok(ep) => Some(ep),
                Err(problem) => {
                    errs.push(format!("{key}.endpoint"), problem);
                    None
                }
            });
        let mut allowed_ips = Vec::new();
        for (j, text) in raw.allowed_ips.iter().enumerate() {
            let k = format!("{key}.allowed_ips[{j}]");
            if let Some(net) = network(&k, text, errs) {
                if let Some(other) = seen_nets.insert(net, i) {
                    errs.push(
                        k,
                        format!("\"{net}\" is also an allowed IP of peer[{other}]: expected each network on one peer"),
                    );
                } else {
                    allowed_ips.push(net);
                }
            }
        }
        let keepalive = int_in(
            &format!("{key}.persistent_keepalive"),
            raw.persistent_keepalive,
            0,
            65535,
            0,
            errs,
        ) as u16;
        let name = raw.name.and_then(|n| match peer_name_problem(&n) {
            None => {
                if let Some(first) = seen_names.insert(n.clone(), i) {
                    errs.push(
                        format!("{key}.name"),
                        format!(
                            "{n:?} is already the name of peer[{first}]: expected unique names"
                        ),
                    );
                }
                Some(n)
            }
            Some(problem) => {
                errs.push(format!("{key}.name"), format!("{n:?} {problem}"));
                None
            }
        });
        // Pushed Vecs keep room for more; a concentrator's config lives as long as the daemon.
        allowed_ips.shrink_to_fit();
        peers.push(Peer {
            name,
            public_key,
            preshared_key,
            endpoint,
            allowed_ips,
            persistent_keepalive: (keepalive > 0).then_some(keepalive),
        });
    }
    peers.shrink_to_fit();
    peers
}

/// The longest `peer[].name`, in characters (it is a metric label and a status column).
pub(super) const PEER_NAME_MAX: usize = 32;

/// The longest `service` label of a rule, in characters: room for any Kubernetes
/// `NAMESPACE/NAME` (63 + 1 + 63) and for a label of one's own.
pub(super) const SERVICE_LABEL_MAX: usize = 253;

/// What is wrong with a peer name, if anything: it must be 1 to [`PEER_NAME_MAX`] printable
/// characters, without leading or trailing spaces.
pub(super) fn peer_name_problem(name: &str) -> Option<String> {
    label_problem(name, PEER_NAME_MAX)
}

/// What is wrong with a label shown in status and as a metric label (a peer's name, a rule's
/// service), if anything: 1 to `max` printable characters, without leading or trailing spaces.
fn label_problem(name: &str, max: usize) -> Option<String> {
    let chars = name.chars().count();
    if chars == 0 || chars > max {
        return Some(format!("has {chars} characters: expected 1 to {max}"));
    }
    if name.chars().any(char::is_control) {
        return Some("contains a control character: expected printable text".into());
    }
    if name.trim() != name {
        return Some("starts or ends with a space: expected none".into());
    }
    None
}

fn firewall(raw: super::raw::RawFirewall, errs: &mut Errors) -> Firewall {
    let mode = match raw.mode.as_deref() {
        None | Some("auto") => FirewallMode::Auto,
        Some("nftables") => FirewallMode::Nftables,
        Some("iptables") => FirewallMode::Iptables,
        Some(other) => {
            errs.push(
                "firewall.mode",
                format!("\"{other}\" is not a firewall mode: expected auto, nftables or iptables"),
            );
            FirewallMode::Auto
        }
    };
    let repair_interval = match raw.repair_interval.as_deref() {
        None => Some(DEFAULT_REPAIR_INTERVAL),
        Some(text) => match parse_duration(text) {
            Ok(d) if d.is_zero() => None,
            Ok(d) => Some(d),
            Err(e) => {
                errs.push("firewall.repair_interval", e);
                None
            }
        },
    };
    Firewall {
        mode,
        mss_clamp: raw.mss_clamp.unwrap_or(true),
        repair_interval,
    }
}

fn forwards(
    section: &str,
    raws: Vec<RawForward>,
    interface: &Interface,
    errs: &mut Errors,
) -> Vec<Forward> {
    let mut out: Vec<(usize, Forward)> = Vec::new();
    let mut claims = PortClaims::default();
    for (i, raw) in raws.into_iter().enumerate() {
        let key = format!("{section}[{i}]");
        let target = match (raw.target, raw.target_fqdn) {
            (Some(ip), None) => match ip.parse::<IpAddr>() {
                Ok(ip) => {
                    if interface.addresses.iter().any(|a| a.addr() == ip) {
                        errs.push(
                            format!("{key}.target"),
                            format!("\"{ip}\" is one of this interface's own tunnel addresses: expected another host"),
                        );
                    }
                    Target::Ip(ip)
                }
                Err(_) => {
                    errs.push(
                        format!("{key}.target"),
                        format!("\"{ip}\" is not an IP address: expected like \"10.96.0.10\" or \"fd96::10\" (use target_fqdn for a name)"),
                    );
                    continue;
                }
            },
            (None, Some(name)) => match normalize_dns_name(&name) {
                Ok(n) => Target::Fqdn(n),
                Err(e) => {
                    errs.push(format!("{key}.target_fqdn"), format!("\"{name}\" {e}"));
                    continue;
                }
            },
            (Some(_), Some(_)) => {
                errs.push(
                    &key,
                    "has both target and target_fqdn: expected exactly one",
                );
                continue;
            }
            (None, None) => {
                errs.push(
                    &key,
                    "has no target: expected target = \"IP\" or target_fqdn = \"name\"",
                );
                continue;
            }
        };
        if let Target::Ip(ip) = target {
            if !interface
                .addresses
                .iter()
                .any(|a| a.addr().is_ipv6() == ip.is_ipv6())
            {
                errs.push(
                    format!("{key}.target"),
                    format!("\"{ip}\" is IPv{}, but interface.addresses has no IPv{} address to forward from", family(ip), family(ip)),
                );
            }
        }
        let mut ports = Vec::new();
        // (protocol, listen port) seen so far in this rule: one lookup per port, not a scan of
        // the earlier ones (a rule can list 50,000 ports).
        let mut listening = std::collections::HashSet::new();
        for (j, text) in raw.ports.iter().flatten().enumerate() {
            match text.parse::<PortMap>() {
                Ok(p) => {
                    if !listening.insert((p.proto, p.listen)) {
                        errs.push(
                            format!("{key}.ports[{j}]"),
                            format!("\"{text}\" repeats a listen port of this rule"),
                        );
                    }
                    ports.push(p);
                }
                Err(e) => errs.push(format!("{key}.ports[{j}]"), format!("\"{text}\": {e}")),
            }
        }
        if raw.ports.as_ref().is_some_and(Vec::is_empty) {
            errs.push(
                format!("{key}.ports"),
                "is empty: expected at least one port, or no ports key for every port",
            );
        }
        let service =
            raw.service
                .and_then(|label| match label_problem(&label, SERVICE_LABEL_MAX) {
                    None => Some(label),
                    Some(problem) => {
                        errs.push(
                            format!("{key}.service"),
                            format!(
                                "{label:?} {problem} (like \"apps/web\", the Service it serves)"
                            ),
                        );
                        None
                    }
                });
        let fwd = Forward {
            target,
            ports,
            service,
        };
        for j in claims.overlapping(&fwd) {
            // `out` is in rule order: the earlier rule is found without a scan.
            let at = out
                .binary_search_by_key(&j, |(k, _)| *k)
                .ok()
                .map(|at| overlap_place(section, &fwd, &out[at].1, interface));
            errs.push(
                format!("{key}.ports"),
                format!("overlap with {section}[{j}]{}: expected each port in one rule (a rule without ports owns every port)", at.unwrap_or_default()),
            );
        }
        claims.insert(i, &fwd);
        out.push((i, fwd));
    }
    out.into_iter().map(|(_, f)| f).collect()
}

/// Where two overlapping rules meet, for the error: the listen port (or every port) and the
/// address it is taken on, e.g. ` on port 80/tcp of 100.64.0.1`. Ingress listens on the
/// tunnel address of the family, egress on this host's own (non-tunnel) addresses.
fn overlap_place(
    section: &str,
    rule: &Forward,
    earlier: &Forward,
    interface: &Interface,
) -> String {
    let listen = |p: &PortMap| format!("port {}/{}", p.listen, p.proto);
    let port = match (rule.ports.first(), earlier.ports.first()) {
        (None, None) => "every port".to_string(),
        (Some(p), None) | (None, Some(p)) => listen(p),
        (Some(_), Some(_)) => rule
            .ports
            .iter()
            .find(|p| {
                earlier
                    .ports
                    .iter()
                    .any(|q| q.proto == p.proto && q.listen == p.listen)
            })
            .map(listen)
            .unwrap_or_else(|| "the same port".to_string()),
    };
    let shared = PortClaims::families(&rule.target)
        .iter()
        .find(|f| PortClaims::families(&earlier.target).contains(f));
    let v6 = shared == Some(&1);
    let address = if section == "ingress" {
        let tunnel: Vec<String> = interface
            .addresses
            .iter()
            .filter(|a| a.addr().is_ipv6() == v6)
            .map(|a| a.addr().to_string())
            .collect();
        if tunnel.is_empty() {
            format!("the IPv{} tunnel address", if v6 { 6 } else { 4 })
        } else {
            tunnel.join(", ")
        }
    } else {
        format!("this host's IPv{} addresses", if v6 { 6 } else { 4 })
    };
    format!(" on {port} of {address}")
}

/// Egress captures traffic to this host: it must never take the WireGuard or health port.
fn check_egress_ports(
    egress: &[Forward],
    interface: &Interface,
    health: &Health,
    takeover: &Takeover,
    errs: &mut Errors,
) {
    for (i, fwd) in egress.iter().enumerate() {
        for (j, p) in fwd.ports.iter().enumerate() {
            let wg = p.proto == Proto::Udp
                && interface.listen_port != 0
                && p.listen == interface.listen_port;
            let hp = p.proto == Proto::Tcp && health.listen.is_some_and(|h| h.port() == p.listen);
            let group = p.proto == Proto::Udp
                && takeover
                    .group
                    .as_ref()
                    .is_some_and(|g| g.listen.port() == p.listen);
            let own = if wg {
                "WireGuard listen"
            } else if hp {
                "health"
            } else if group {
                "group exchange (takeover.group_listen)"
            } else {
                continue;
            };
            errs.push(
                format!("egress[{i}].ports[{j}]"),
                format!(
                    "\"{p}\" is the {own} port: expected a port the daemon does not use itself"
                ),
            );
        }
    }
}

fn router(raw: super::raw::RawRouter, interface: &Interface, errs: &mut Errors) -> Router {
    let mut routes = Vec::new();
    for (i, text) in raw.advertise_routes.iter().enumerate() {
        let key = format!("router.advertise_routes[{i}]");
        if let Some(net) = network(&key, text, errs) {
            if let Some(a) = interface.addresses.iter().find(|a| net.contains(&a.addr())) {
                errs.push(key, format!("\"{net}\" contains the tunnel address {}: expected a network behind this host", a.addr()));
            } else {
                routes.push(net);
            }
        }
    }
    let exit_node = raw.exit_node.unwrap_or(false);
    if raw.exit_node_lan == Some(false) && !exit_node {
        errs.push(
            "router.exit_node_lan",
            "false without router.exit_node = true: expected it only on an exit node (a subnet router forwards to its advertised routes only)".to_string(),
        );
    }
    Router {
        advertise_routes: routes,
        exit_node,
        exit_node_lan: raw.exit_node_lan.unwrap_or(true),
        snat: raw.snat.unwrap_or(true),
    }
}

fn dns(raw: super::raw::RawDns, errs: &mut Errors) -> Dns {
    let reresolve_interval = match raw.reresolve_interval.as_deref().map(parse_duration) {
        None => DEFAULT_RERESOLVE_INTERVAL,
        Some(Ok(d)) if d >= std::time::Duration::from_secs(1) => d,
        Some(Ok(_)) => {
            errs.push(
                "dns.reresolve_interval",
                "is shorter than 1s: expected at least \"1s\"",
            );
            DEFAULT_RERESOLVE_INTERVAL
        }
        Some(Err(e)) => {
            errs.push("dns.reresolve_interval", e);
            DEFAULT_RERESOLVE_INTERVAL
        }
    };
    let mut nameservers = Vec::new();
    for (i, text) in raw.nameservers.iter().enumerate() {
        match text.parse::<SocketAddr>().or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53))) {
            Ok(a) => nameservers.push(a),
            Err(_) => errs.push(
                format!("dns.nameservers[{i}]"),
                format!("\"{text}\" is not a name server address: expected IP or IP:port, like \"10.96.0.10\" or \"[fd00::53]:53\""),
            ),
        }
    }
    Dns {
        reresolve_interval,
        nameservers,
    }
}

fn health(raw: super::raw::RawHealth, errs: &mut Errors) -> Health {
    let listen = match raw.listen.as_deref() {
        None => DEFAULT_HEALTH_LISTEN.parse().ok(),
        Some("") => None,
        Some(text) => match text.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                errs.push("health.listen", format!("\"{text}\" is not an address: expected IP:port like \"127.0.0.1:9002\", or \"\" to disable"));
                None
            }
        },
    };
    let readiness = match raw.readiness.as_deref() {
        None | Some("all") => Readiness::All,
        Some("per-service") => Readiness::PerService,
        Some(other) => {
            errs.push(
                "health.readiness",
                format!("\"{other}\" is not a readiness policy: expected \"all\" (every name must resolve) or \"per-service\" (a name only rules with a service label use does not hold /readyz back)"),
            );
            Readiness::All
        }
    };
    let metrics_peers = int_in(
        "health.metrics_peers",
        raw.metrics_peers,
        0,
        MAX_METRICS_PEERS as i64,
        DEFAULT_METRICS_PEERS as i64,
        errs,
    ) as usize;
    Health {
        listen,
        allow_from_tunnel: raw.allow_from_tunnel.unwrap_or(false),
        readiness,
        metrics_peers,
    }
}

fn takeover(raw: super::raw::RawTakeover, base_dir: &Path, errs: &mut Errors) -> Takeover {
    let answer = match raw.answer_any_source {
        Some(true) => crate::takeover::Answer::AnySource,
        _ => crate::takeover::Answer::KnownEndpoints,
    };
    let state_file = match raw.state_file.as_deref() {
        None => StateFile::Default,
        Some("") => StateFile::Off,
        Some(path) if path.contains('\0') || path.ends_with('/') => {
            errs.push(
                "takeover.state_file",
                format!("{:?} is not a file path: expected a path like \"/var/lib/tunnelgate/tg0.endpoints\", or \"\" to keep no endpoints across a restart", short(path)),
            );
            StateFile::Default
        }
        Some(path) => StateFile::Path(base_dir.join(path)),
    };
    let listen = raw.group_listen.as_deref().map(|text| {
        text.parse::<SocketAddr>().map_err(|_| {
            errs.push(
                "takeover.group_listen",
                format!(
                    "{:?} is not an address: expected IP:port like \"[::]:51821\"",
                    short(text)
                ),
            )
        })
    });
    let replicas = raw
        .group_replicas
        .as_deref()
        .map(|text| parse_endpoint(text).map_err(|why| errs.push("takeover.group_replicas", why)));
    let group = match (listen, replicas) {
        (Some(Ok(listen)), Some(Ok(replicas))) => Some(GroupExchange { listen, replicas }),
        (None, None) => None,
        (Some(_), None) => {
            errs.push("takeover.group_replicas", "missing: takeover.group_listen needs the replicas' host:port (the group's headless Service name), or neither key".to_string());
            None
        }
        (None, Some(_)) => {
            errs.push("takeover.group_listen", "missing: takeover.group_replicas needs the address the exchange listens on, like \"[::]:51821\", or neither key".to_string());
            None
        }
        _ => None,
    };
    Takeover {
        answer,
        state_file,
        group,
    }
}

/// At most 80 characters of `text`, for an error message.
fn short(text: &str) -> String {
    text.chars().take(80).collect()
}

/// The key files of a configuration that lets their group read them.
struct ReadableByGroup<'a>(&'a dyn SecretFiles);

impl SecretFiles for ReadableByGroup<'_> {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0.read_secret_readable_by_group(path)
    }
}

/// Reads a key given inline or as a file; exactly one of the two may be set.
fn secret(
    key: &str,
    inline: Option<String>,
    file: Option<String>,
    required: bool,
    base_dir: &Path,
    files: &dyn SecretFiles,
    errs: &mut Errors,
) -> Option<SecretKey> {
    let (text, name) = match (inline, file) {
        (Some(_), Some(_)) => {
            errs.push(
                key,
                format!("and {key}_file are both set: expected one of them"),
            );
            return None;
        }
        (Some(t), None) => (t, key.to_string()),
        (None, Some(f)) => {
            let path: PathBuf = base_dir.join(&f);
            match files.read_secret(&path) {
                Ok(t) => (t, format!("{key}_file")),
                Err(e) => {
                    errs.push(
                        format!("{key}_file"),
                        format!("\"{}\": {e}", path.display()),
                    );
                    return None;
                }
            }
        }
        (None, None) => {
            if required {
                errs.push(
                    key,
                    format!("is missing: expected {key} = \"<base64>\" or {key}_file = \"path\""),
                );
            }
            return None;
        }
    };
    match decode_key(&text) {
        Ok(k) => Some(SecretKey(k)),
        Err(e) => {
            // Never echo the text: it is meant to be a secret.
            errs.push(name, e);
            None
        }
    }
}

fn network(key: &str, text: &str, errs: &mut Errors) -> Option<IpNet> {
    match text.parse::<IpNet>() {
        Ok(net) if net.trunc() == net => Some(net),
        Ok(net) => {
            errs.push(
                key,
                format!(
                    "\"{text}\" has host bits set: expected the network \"{}\"",
                    net.trunc()
                ),
            );
            None
        }
        Err(_) => match text.parse::<IpAddr>() {
            Ok(ip) => Some(IpNet::from(ip)),
            Err(_) => {
                errs.push(key, format!("\"{text}\" is not a network: expected CIDR like \"10.0.0.0/24\" or \"fd00::/64\""));
                None
            }
        },
    }
}

/// `health.metrics_peers` by default: every peer of most gateways has its series, and a
/// concentrator's scrape stays about 1.5 MB whatever its peer count (about 1.5 KB a peer).
pub const DEFAULT_METRICS_PEERS: usize = 1000;
/// The most `health.metrics_peers` may be: past this the body passes its 4 MiB bound anyway.
const MAX_METRICS_PEERS: usize = 100_000;

/// Most packet workers a configuration may ask for: more than any node has cores to spare.
const MAX_WORKERS: u16 = 256;

fn int_in(
    key: &str,
    value: Option<i64>,
    min: i64,
    max: i64,
    default: i64,
    errs: &mut Errors,
) -> i64 {
    match value {
        None => default,
        Some(v) if (min..=max).contains(&v) => v,
        Some(v) => {
            errs.push(key, format!("{v} is out of range: expected {min} to {max}"));
            default
        }
    }
}

pub(super) fn parse_endpoint(text: &str) -> Result<Endpoint, String> {
    let expected = "expected host:port like \"198.51.100.7:51820\", \"[2001:db8::1]:51820\" or \"vpn.example.com:51820\"";
    if let Ok(addr) = text.parse::<SocketAddr>() {
        // Nothing listens on port 0: a datagram to it is refused by the sender's own kernel.
        if addr.port() == 0 {
            return Err(format!("\"{text}\" has no valid port: {expected}"));
        }
        return Ok(Endpoint::Addr(addr));
    }
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("\"{text}\" has no port: {expected}"))?;
    let port = match port.parse::<u16>() {
        Ok(p) if p > 0 => p,
        _ => return Err(format!("\"{text}\" has no valid port: {expected}")),
    };
    let host = normalize_dns_name(host).map_err(|e| format!("\"{text}\": the host {e}"))?;
    Ok(Endpoint::Host { host, port })
}

/// Lower-cases and checks a DNS name (RFC 1123 labels), dropping one trailing dot.
pub(super) fn normalize_dns_name(name: &str) -> Result<String, String> {
    let n = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let bad = "is not a valid DNS name: expected labels of letters, digits and '-' separated by dots, like \"db.example.internal\"";
    if n.is_empty() || n.len() > 253 || n.parse::<IpAddr>().is_ok() {
        return Err(bad.into());
    }
    for label in n.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(bad.into());
        }
    }
    Ok(n)
}

/// "500ms", "30s", "10m", "1h", "1h30m".
pub(super) fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let expected =
        || format!("\"{text}\" is not a duration: expected like \"30s\", \"10m\" or \"1h\"");
    let mut total_ms: u64 = 0;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(expected());
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(expected());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| expected())?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit_ms = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(expected()),
        };
        rest = &rest[unit_len..];
        total_ms = n
            .checked_mul(unit_ms)
            .and_then(|v| total_ms.checked_add(v))
            .ok_or_else(expected)?;
    }
    Ok(std::time::Duration::from_millis(total_ms))
}

fn valid_ifname(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

fn family(ip: IpAddr) -> u8 {
    if ip.is_ipv6() {
        6
    } else {
        4
    }
}

/// Whether two targets can share an address family (a name can resolve to either).
/// The ports the rules so far claim, indexed so that checking one more rule costs its own ports,
/// not every rule before it (a proxy group renders 20,000 rules). The same answer as comparing
/// it with each earlier rule (`families_meet` and `overlap`, which its property test compares
/// it with).
#[derive(Default)]
struct PortClaims {
    /// (family, protocol, listen port) -> the rules listening there.
    ports: std::collections::HashMap<(u8, Proto, u16), Vec<usize>>,
    /// Per family (IPv4, IPv6): the rules without ports (they own every port).
    every_port: [Vec<usize>; 2],
    /// Per family: every rule.
    all: [Vec<usize>; 2],
}

impl PortClaims {
    /// The families a target's traffic can be of: an IP its own, a name either.
    fn families(target: &Target) -> &'static [u8] {
        match target {
            Target::Ip(ip) if ip.is_ipv6() => &[1],
            Target::Ip(_) => &[0],
            Target::Fqdn(_) => &[0, 1],
        }
    }

    /// The earlier rules `fwd` overlaps, in order.
    fn overlapping(&self, fwd: &Forward) -> std::collections::BTreeSet<usize> {
        let mut found = std::collections::BTreeSet::new();
        for &f in Self::families(&fwd.target) {
            let f_index = usize::from(f);
            if fwd.ports.is_empty() {
                found.extend(&self.all[f_index]);
                continue;
            }
            found.extend(&self.every_port[f_index]);
            for p in &fwd.ports {
                found.extend(
                    self.ports
                        .get(&(f, p.proto, p.listen))
                        .into_iter()
                        .flatten(),
                );
            }
        }
        found
    }

    fn insert(&mut self, i: usize, fwd: &Forward) {
        for &f in Self::families(&fwd.target) {
            let f_index = usize::from(f);
            self.all[f_index].push(i);
            if fwd.ports.is_empty() {
                self.every_port[f_index].push(i);
            }
            for p in &fwd.ports {
                let rules = self.ports.entry((f, p.proto, p.listen)).or_default();
                if rules.last() != Some(&i) {
                    rules.push(i);
                }
            }
        }
    }
}

/// Warnings (never errors) about `[[ingress]]` targets that cannot be what the user meant:
/// a loopback address (the kernel drops a packet DNATed there from another interface, so the
/// rule never works), or this host's own health endpoint (the rule would hand `/metrics` to
/// every tunnel peer). `host_addrs` are the addresses of this host's interfaces, as the shell
/// found them (empty when unknown): with the endpoint on `0.0.0.0` or `::`, any of them
/// reaches it.
pub fn ingress_warnings(config: &Config, host_addrs: &BTreeSet<IpAddr>) -> Vec<String> {
    let mut out = Vec::new();
    for (i, fwd) in config.ingress.iter().enumerate() {
        let Target::Ip(ip) = fwd.target else { continue };
        let ip = ip.to_canonical();
        if ip.is_loopback() {
            out.push(format!(
                "ingress[{i}].target: {ip} is a loopback address: the kernel drops packets from the tunnel forwarded to loopback, so this rule can never work; expected an address of another host or of a local service reachable on a non-loopback address"
            ));
            continue;
        }
        let Some(health) = config.health.listen else {
            continue;
        };
        if !reaches_health(ip, health, config, host_addrs) {
            continue;
        }
        let port_hits = fwd.ports.is_empty()
            || fwd
                .ports
                .iter()
                .any(|p| p.proto == Proto::Tcp && p.target == health.port());
        if port_hits {
            out.push(format!(
                "ingress[{i}].target: {ip} port {} is this gateway's own health endpoint (health.listen = \"{health}\"): the rule exposes /healthz, /readyz and /metrics to every tunnel peer; expected another target, or another port",
                health.port()
            ));
        }
    }
    out
}

/// Whether a connection to `ip` on the health port reaches the health endpoint on `health`.
fn reaches_health(
    ip: IpAddr,
    health: SocketAddr,
    config: &Config,
    host_addrs: &BTreeSet<IpAddr>,
) -> bool {
    let listen = health.ip().to_canonical();
    if ip == listen {
        return true;
    }
    if !listen.is_unspecified() {
        return false;
    }
    // `0.0.0.0` answers on every IPv4 address of the host; `::` on every address (dual stack).
    let family_ok = ip.is_ipv4() || listen.is_ipv6();
    let own = host_addrs.contains(&ip) || config.interface.addresses.iter().any(|n| n.addr() == ip);
    family_ok && own
}

#[cfg(test)]
fn families_meet(a: &Target, b: &Target) -> bool {
    match (a, b) {
        (Target::Ip(x), Target::Ip(y)) => x.is_ipv6() == y.is_ipv6(),
        _ => true,
    }
}

#[cfg(test)]
mod port_claims_tests {
    use super::*;
    use proptest::prelude::*;

    fn rule(v6: Option<bool>, ports: &[(u16, bool)]) -> Forward {
        Forward {
            target: match v6 {
                Some(true) => Target::Ip("fd00::1".parse().expect("ip")),
                Some(false) => Target::Ip("10.0.0.1".parse().expect("ip")),
                None => Target::Fqdn("db.example".into()),
            },
            ports: ports
                .iter()
                .map(|&(listen, udp)| PortMap {
                    listen,
                    target: listen,
                    proto: if udp { Proto::Udp } else { Proto::Tcp },
                })
                .collect(),
            service: None,
        }
    }

    proptest! {
        /// The index finds exactly the rules the pairwise comparison finds.
        #[test]
        fn the_index_agrees_with_comparing_every_pair(
            rules in proptest::collection::vec(
                (proptest::option::of(any::<bool>()),
                 proptest::collection::vec((1u16..6, any::<bool>()), 0..3)),
                0..12,
            )
        ) {
            let rules: Vec<Forward> = rules.iter().map(|(f, p)| rule(*f, p)).collect();
            let mut claims = PortClaims::default();
            for (i, fwd) in rules.iter().enumerate() {
                let pairwise: std::collections::BTreeSet<usize> = rules[..i]
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| families_meet(&fwd.target, &o.target) && overlap(&fwd.ports, &o.ports))
                    .map(|(j, _)| j)
                    .collect();
                prop_assert_eq!(claims.overlapping(fwd), pairwise);
                claims.insert(i, fwd);
            }
        }
    }
}
