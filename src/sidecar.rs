//! The Kubernetes sidecar's pure core: a Service (as [`ServiceInfo`]), the base configuration and
//! the config Secret's current data in; the Secret data the proxy needs out, or every reason it
//! cannot be built. No Kubernetes types, no I/O, no clock: randomness for a new private key comes in
//! as a closure. The I/O (kube client, watch, apply, events, the mounted config folder) lives
//! in [`shell`]; the daemon never calls into any of this.
//!
//! The rendered `tunnelgate.toml` is the base configuration (a TOML table) with
//! `interface.private_key_file = "private.key"` and the `[[ingress]]` / `[[egress]]` rules the
//! Service asks for appended (each labelled `service = "NS/NAME"`), and it is checked with [`Config::parse`] before it is offered for
//! writing, so the sidecar never writes a configuration the daemon would refuse.

pub mod group;
pub mod shell;

pub use shell::{api, config_dir, run, run_group};

use crate::config::{decode_key, Config, PortMap, Proto, SecretFiles, SecretKey, Target};
use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::Path;

/// `"true"`: forward tunnel traffic to the Service (its ClusterIP, or its ExternalName).
pub const ANNOTATION_EXPOSE: &str = "tunnelgate.dev/expose";
/// Egress: forward traffic that reaches the proxy pod across the tunnel to this IP.
pub const ANNOTATION_TUNNEL_IP: &str = "tunnelgate.dev/tunnel-ip";
/// Egress: like [`ANNOTATION_TUNNEL_IP`], to a DNS name the daemon resolves.
pub const ANNOTATION_TUNNEL_FQDN: &str = "tunnelgate.dev/tunnel-fqdn";
/// A `type: LoadBalancer` Service with this `loadBalancerClass` is exposed like `expose: "true"`.
pub const LOAD_BALANCER_CLASS: &str = "tunnelgate";

/// Secret key: the rendered configuration.
pub const KEY_CONFIG: &str = "tunnelgate.toml";
/// Secret key: the rendered configuration gzip-compressed, instead of [`KEY_CONFIG`] when its
/// plain text would not fit [`SECRET_MAX_BYTES`] (the daemon reads either).
pub const KEY_CONFIG_GZ: &str = "tunnelgate.toml.gz";
/// The API server refuses a Secret whose data passes 1 MiB (422 "Too long"). Counted here as
/// every key's name and value, a little stricter than the API server, which counts the values.
pub const SECRET_MAX_BYTES: usize = 1_048_576;
/// Secret key: the WireGuard private key, written once and never rotated unless deleted.
pub const KEY_PRIVATE: &str = "private.key";
/// Secret key: the base64 public key, for the peers' configuration.
pub const KEY_PUBLIC: &str = "public_key";
/// Secret key: JSON array of the tunnel addresses, without prefix length.
pub const KEY_DEVICE_IPS: &str = "device_ips";

/// Where the daemon reads the Secret (mounted as a directory); only used to resolve relative key
/// file names while validating.
pub const MOUNT_DIR: &str = "/etc/tunnelgate";

/// What the sidecar needs to know about the parent Service (converted from the API object by the
/// I/O side, so that this module stays free of Kubernetes types).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    pub namespace: String,
    pub name: String,
    /// `spec.type`: `ClusterIP` (default), `NodePort`, `LoadBalancer` or `ExternalName`.
    pub type_: Option<String>,
    /// `spec.clusterIPs` (or `spec.clusterIP`); `"None"` for a headless Service.
    pub cluster_ips: Vec<String>,
    pub external_name: Option<String>,
    pub load_balancer_class: Option<String>,
    pub annotations: Annotations,
    pub ports: Vec<ServicePort>,
    /// `status.loadBalancer.ingress`: each entry's IP, else its host name (a proxy group's
    /// balancer: the address peers reach the group at).
    pub load_balancer_ingress: Vec<String>,
    /// `metadata.creationTimestamp` in Unix seconds: in a proxy group, the older of two Services
    /// that claim the same port keeps it.
    pub created: Option<i64>,
}

impl ServiceInfo {
    /// Drops what a proxy group never reads of a Service it keeps (one of 20,000): every
    /// annotation but the sidecar's own, the ports' names, and a `type` or `protocol` that only
    /// says the default (`ClusterIP`, `TCP`). Renders exactly as before.
    pub fn keep_what_a_group_reads(&mut self) {
        self.annotations.retain_own();
        if self.type_.as_deref() == Some("ClusterIP") {
            self.type_ = None;
        }
        for p in &mut self.ports {
            p.name = None;
            if p.protocol.as_deref() == Some("TCP") {
                p.protocol = None;
            }
        }
        self.ports.shrink_to_fit();
        self.cluster_ips.shrink_to_fit();
    }
}

/// A Service's annotations as the sidecar keeps them: a sorted list, not a map (a map's node
/// costs hundreds of bytes per Service, for the one to three annotations a member has).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Annotations(Vec<(String, String)>);

impl Annotations {
    /// The prefix of every annotation the sidecar reads.
    pub const PREFIX: &'static str = "tunnelgate.dev/";

    /// Drops every annotation but the sidecar's own: what a proxy group keeps of each of its
    /// 10,000 Services (a `kubectl apply`'s last-applied-configuration alone is the size of
    /// the whole Service).
    pub fn retain_own(&mut self) {
        self.0.retain(|(k, _)| k.starts_with(Self::PREFIX));
        self.0.shrink_to_fit();
    }

    pub fn get(&self, key: &str) -> Option<&String> {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    pub fn insert(&mut self, key: String, value: String) {
        match self.position(&key) {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (key, value)),
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<String> {
        self.position(key).ok().map(|i| self.0.remove(i).1)
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }
}

impl FromIterator<(String, String)> for Annotations {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        let mut out = Annotations::default();
        for (k, v) in iter {
            out.insert(k, v);
        }
        out.0.shrink_to_fit();
        out
    }
}

/// One entry of `spec.ports`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePort {
    pub name: Option<String>,
    pub port: i32,
    pub target_port: Option<TargetPort>,
    /// `TCP` (default), `UDP` or `SCTP`.
    pub protocol: Option<String>,
}

/// `spec.ports[].targetPort`: a number, or the name of a container port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    Number(i32),
    Name(String),
}

/// The Secret data to write, and what the caller should log about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// Every key the sidecar owns, `private.key` included (server-side apply drops a field its
    /// manager stops sending, so the key is always sent, unchanged once it exists); a proxy
    /// group's replica with a shared identity leaves it out ([`group::render_group`]).
    pub data: BTreeMap<String, Vec<u8>>,
    /// Whether `private.key` was absent and a new key was generated.
    pub generated_key: bool,
    /// Things worth a log line that are not errors (a skipped ClusterIP family, ...).
    pub notes: Vec<String>,
}

/// Why no configuration could be rendered: every problem found, each naming its input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected(pub Vec<String>);

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("; "))
    }
}

impl std::error::Error for Rejected {}

/// Renders the Secret data for `svc` from the base configuration text and the Secret's current
/// data. `new_key` is called only when the Secret has no `private.key` yet.
pub fn render(
    svc: &ServiceInfo,
    base: &str,
    current: &BTreeMap<String, Vec<u8>>,
    new_key: impl FnOnce() -> SecretKey,
) -> Result<Rendered, Rejected> {
    let mut prepared = prepare(base, current, new_key);
    let mut notes = Vec::new();
    let families = prepared
        .table
        .as_ref()
        .map(tunnel_families)
        .unwrap_or_default();
    let rules = forwards(svc, &families, &mut prepared.problems, &mut notes);
    let Some(table) = prepared.table.take() else {
        return Err(Rejected(prepared.problems));
    };
    if !prepared.problems.is_empty() {
        return Err(Rejected(prepared.problems));
    }
    let header = format!(
        "# Rendered by tunnelgate-sidecar from the base config and Service {}/{}.\n# Do not edit: the next change of either replaces this file.\n",
        svc.namespace, svc.name
    );
    let text = config_text(&table, [&rules], &header)?;
    let (mut rendered, _) = finish(text, &prepared, current, notes, None)?;
    store_config_within(&mut rendered.data, SECRET_MAX_BYTES).map_err(|bytes| {
        Rejected(vec![format!(
            "rendered {KEY_CONFIG} needs {bytes} bytes even gzip-compressed: expected at most {SECRET_MAX_BYTES} (the API server's Secret limit)"
        )])
    })?;
    Ok(rendered)
}

/// The base configuration parsed, with the sidecar's key file set, and the private key.
struct Prepared {
    /// `None` when the base config does not parse (the reason is in `problems`).
    table: Option<toml::Table>,
    key: SecretKey,
    generated_key: bool,
    problems: Vec<String>,
}

fn prepare(
    base: &str,
    current: &BTreeMap<String, Vec<u8>>,
    new_key: impl FnOnce() -> SecretKey,
) -> Prepared {
    let mut problems = Vec::new();
    let mut table = match base.parse::<toml::Table>() {
        Ok(t) => Some(t),
        Err(e) => {
            problems.push(format!(
                "base config does not parse: {}",
                e.message().trim()
            ));
            None
        }
    };
    if let Some(t) = &mut table {
        set_key_file(t, &mut problems);
    }
    let (key, generated_key) = match current.get(KEY_PRIVATE) {
        Some(bytes) => match std::str::from_utf8(bytes)
            .map_err(|_| "is not UTF-8: expected a 44-character WireGuard key".to_string())
            .and_then(decode_key)
        {
            Ok(k) => (SecretKey(k), false),
            Err(e) => {
                problems.push(format!(
                    "Secret key {KEY_PRIVATE} {e} (delete the key to have a new one generated)"
                ));
                (SecretKey([0; 32]), false)
            }
        },
        None => (new_key(), true),
    };
    Prepared {
        table,
        key,
        generated_key,
        problems,
    }
}

/// The `tunnelgate.toml` text: `header`, then the base table with every set of rules appended.
fn config_text<'a>(
    table: &toml::Table,
    rules: impl IntoIterator<Item = &'a Rules>,
    header: &str,
) -> Result<String, Rejected> {
    Ok(config_text_with_rules(table, rules, header)?.text)
}

/// A rendered `tunnelgate.toml`, and where in it each appended rule is.
struct ConfigText {
    text: String,
    /// The byte range of each appended rule's table (`[[ingress]]` ...), in the text's order.
    rules: Vec<std::ops::Range<usize>>,
}

impl ConfigText {
    /// Each appended rule's text, in order: with the base text, what the daemon would parse.
    fn rule_texts(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| &self.text[r.clone()])
    }
}

/// [`config_text`], with where each rule is in it.
fn config_text_with_rules<'a>(
    table: &toml::Table,
    rules: impl IntoIterator<Item = &'a Rules>,
    header: &str,
) -> Result<ConfigText, Rejected> {
    let rules: Vec<&Rules> = rules.into_iter().collect();
    let mut out = ConfigText {
        text: String::with_capacity(header.len() + 1),
        rules: Vec::new(),
    };
    out.text.push_str(header);
    out.text.push('\n');
    write_toml_with(&mut out, table.clone(), &rules)
        .map_err(|e| Rejected(vec![format!("cannot write TOML: {e}")]))?;
    out.rules.shrink_to_fit();
    Ok(out)
}

/// What the daemon would make of `text` with `key` as its private key.
fn daemon_check(text: &str, key: &SecretKey) -> Result<Config, Vec<String>> {
    Config::parse(text, Path::new(MOUNT_DIR), &MountedKey(key))
        .map_err(|e| e.0.iter().map(ToString::to_string).collect())
}

/// [`daemon_check`] of a text rendered from `base` (the base alone, rendered, which passed it)
/// and rules whose keys the sidecar writes itself: the same checks but the one for unknown keys,
/// which could only find one in the base (and costs a generic copy of every rule). The rules
/// are parsed one by one and added to the base's, as the daemon would read the whole text:
/// 20,000 rules never make one TOML parse tree.
fn rendered_check(base: &str, text: &ConfigText, key: &SecretKey) -> Result<Config, Vec<String>> {
    Config::parse_known_keys_with_rules(
        base,
        text.rule_texts(),
        Path::new(MOUNT_DIR),
        &MountedKey(key),
    )
    .map_err(|e| e.0.iter().map(ToString::to_string).collect())
}

/// The Secret data for a configuration text, once the daemon would accept it, and the
/// configuration as the daemon will load it. `checked`: that configuration, when the caller
/// has just loaded this very text (a check of 10,000 rules is not free).
fn finish(
    text: String,
    prepared: &Prepared,
    current: &BTreeMap<String, Vec<u8>>,
    notes: Vec<String>,
    checked: Option<Config>,
) -> Result<(Rendered, Config), Rejected> {
    let key = &prepared.key;
    let config = match checked {
        Some(config) => config,
        None => daemon_check(&text, key).map_err(|e| {
            Rejected(
                e.iter()
                    .map(|e| format!("rendered {KEY_CONFIG} is invalid: {e}"))
                    .collect(),
            )
        })?,
    };
    let ips: Vec<String> = config
        .interface
        .addresses
        .iter()
        .map(|a| a.addr().to_string())
        .collect();
    let device_ips = serde_json::to_string(&ips).unwrap_or_else(|_| "[]".into());
    let private = match current.get(KEY_PRIVATE) {
        Some(existing) => existing.clone(),
        None => key.expose_base64().into_bytes(),
    };
    let data = BTreeMap::from([
        (KEY_CONFIG.to_string(), text.into_bytes()),
        (KEY_PRIVATE.to_string(), private),
        (
            KEY_PUBLIC.to_string(),
            key.public_key().to_base64().into_bytes(),
        ),
        (KEY_DEVICE_IPS.to_string(), device_ips.into_bytes()),
    ]);
    let rendered = Rendered {
        data,
        generated_key: prepared.generated_key,
        notes,
    };
    Ok((rendered, config))
}

/// The size of Secret data as counted against [`SECRET_MAX_BYTES`]: every key and value.
pub fn data_size(data: &BTreeMap<String, Vec<u8>>) -> usize {
    data.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// How a configuration text is stored in a Secret whose other keys take `others` bytes: plain
/// under [`KEY_CONFIG`] when the Secret then fits `max_bytes`, else gzip-compressed under
/// [`KEY_CONFIG_GZ`]. `Err(bytes)`: not even compressed (to `bytes`) does it fit.
pub fn stored_config(
    text: &[u8],
    others: usize,
    max_bytes: usize,
) -> Result<(&'static str, Vec<u8>), usize> {
    let budget = max_bytes.saturating_sub(others);
    if KEY_CONFIG.len() + text.len() <= budget {
        return Ok((KEY_CONFIG, text.to_vec()));
    }
    let compressed = gzip(text);
    if KEY_CONFIG_GZ.len() + compressed.len() <= budget {
        Ok((KEY_CONFIG_GZ, compressed))
    } else {
        Err(KEY_CONFIG_GZ.len() + compressed.len() + others)
    }
}

/// Replaces the plain [`KEY_CONFIG`] of `data` by its stored form (see [`stored_config`]).
/// `Err(bytes)`: the Secret would take `bytes` even compressed; `data` is left as it was.
pub fn store_config_within(
    data: &mut BTreeMap<String, Vec<u8>>,
    max_bytes: usize,
) -> Result<(), usize> {
    let Some(text) = data.get(KEY_CONFIG) else {
        return Ok(());
    };
    let others = data_size(data) - KEY_CONFIG.len() - text.len();
    let (key, bytes) = stored_config(text, others, max_bytes)?;
    if key != KEY_CONFIG {
        data.remove(KEY_CONFIG);
        data.insert(key.to_string(), bytes);
    }
    Ok(())
}

/// gzip with a fixed header (no file name, mtime 0): the same text always gives the same bytes,
/// so an unchanged configuration is never written again.
pub fn gzip(text: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut encoder = flate2::GzBuilder::new().write(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(text);
    encoder.finish().unwrap_or_default()
}

/// The keys of `desired` whose value is absent from or different in `current`; empty means the
/// Secret is up to date and nothing must be written.
pub fn changed_keys<'a>(
    desired: &'a BTreeMap<String, Vec<u8>>,
    current: &BTreeMap<String, Vec<u8>>,
) -> Vec<&'a str> {
    desired
        .iter()
        .filter(|(k, v)| current.get(*k) != Some(*v))
        .map(|(k, _)| k.as_str())
        .collect()
}

/// The keys the sidecar writes ([`KEY_CONFIG`], [`KEY_CONFIG_GZ`], [`KEY_PRIVATE`],
/// [`KEY_PUBLIC`], [`KEY_DEVICE_IPS`]) that `current` holds and `desired` does not: the plain
/// config after the compressed one (or the other way round), or a `private.key` that a
/// replica with a shared identity must not keep (an older version copied the group's key
/// there). Non-empty means the Secret must be written even when [`changed_keys`] is empty.
pub fn stale_keys(
    desired: &BTreeMap<String, Vec<u8>>,
    current: &BTreeMap<String, Vec<u8>>,
) -> Vec<&'static str> {
    [
        KEY_CONFIG,
        KEY_CONFIG_GZ,
        KEY_PRIVATE,
        KEY_PUBLIC,
        KEY_DEVICE_IPS,
    ]
    .into_iter()
    .filter(|k| current.contains_key(*k) && !desired.contains_key(*k))
    .collect()
}

/// Splits `NS/NAME` (or a bare `NAME`, namespace `None`) and checks both parts are DNS labels or
/// subdomains as Kubernetes requires.
pub fn parse_object_ref(text: &str) -> Result<(Option<String>, String), String> {
    let (ns, name) = match text.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, text),
    };
    let valid = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !s.starts_with(['-', '.'])
            && !s.ends_with(['-', '.'])
    };
    if ns.is_some_and(|n| !valid(n, 63) || n.contains('.')) || !valid(name, 253) {
        return Err(format!(
            "\"{text}\" is not an object reference: expected NAMESPACE/NAME (or NAME) in lower-case letters, digits, '-' and '.'"
        ));
    }
    Ok((ns.map(str::to_string), name.to_string()))
}

/// Retries of API calls back off as the daemon's do.
pub use crate::core::backoff::Backoff;

/// The daemon reads `private.key` from the mounted Secret; here it comes from memory. Any other
/// file in the Secret's directory does not exist (the sidecar writes only its own keys). Key files
/// the base config names elsewhere (a peer's `preshared_key_file` on another mount) are not visible
/// to the sidecar: they pass with a placeholder and the daemon checks them when it loads.
struct MountedKey<'a>(&'a SecretKey);

impl SecretFiles for MountedKey<'_> {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        let mount = Path::new(MOUNT_DIR);
        if path == mount.join(KEY_PRIVATE) {
            Ok(self.0.expose_base64())
        } else if path.parent() == Some(mount) {
            Err(format!(
                "is not a key of the config Secret (it holds {KEY_CONFIG}, {KEY_PRIVATE}, {KEY_PUBLIC}, {KEY_DEVICE_IPS}): expected an absolute path to a file mounted elsewhere"
            ))
        } else {
            Ok(SecretKey([1; 32]).expose_base64())
        }
    }
}

/// The private key is the sidecar's: the base config must not set one.
fn set_key_file(table: &mut toml::Table, problems: &mut Vec<String>) {
    let iface = table
        .entry("interface")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let Some(iface) = iface.as_table_mut() else {
        problems.push("base config: interface is not a table: expected [interface]".into());
        return;
    };
    for key in ["private_key", "private_key_file"] {
        if iface.contains_key(key) {
            problems.push(format!(
                "base config: interface.{key} is set: expected none (the sidecar owns the key, Secret key {KEY_PRIVATE})"
            ));
        }
    }
    iface.insert(
        "private_key_file".into(),
        toml::Value::String(KEY_PRIVATE.into()),
    );
}

/// Which address families the base config has tunnel addresses of: (v4, v6).
fn tunnel_families(table: &toml::Table) -> (bool, bool) {
    let addrs = table
        .get("interface")
        .and_then(|i| i.get("addresses"))
        .and_then(toml::Value::as_array);
    let ips: Vec<IpAddr> = addrs
        .into_iter()
        .flatten()
        .filter_map(toml::Value::as_str)
        .filter_map(|s| s.split('/').next()?.parse().ok())
        .collect();
    (
        ips.iter().any(IpAddr::is_ipv4),
        ips.iter().any(IpAddr::is_ipv6),
    )
}

/// The rules of one Service, compact: a proxy group keeps one of these per Service while it
/// renders (a `toml::Table` per rule took about a kilobyte; this takes a few dozen bytes).
#[derive(Default, Clone)]
struct Rules {
    /// `service = "NS/NAME"` of every rule.
    service: String,
    ingress: Vec<Rule>,
    egress: Vec<Rule>,
}

/// One `[[ingress]]` / `[[egress]]` rule the sidecar writes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    target: Target,
    ports: Vec<PortMap>,
}

impl Rule {
    /// The rule as a TOML table, labelled with the Service (`NS/NAME`) it serves so that the
    /// daemon's status, metrics and per-service readiness can name it. Made only to be written.
    fn to_table(&self, service: &str) -> toml::Table {
        let (key, target) = match &self.target {
            Target::Ip(ip) => ("target", ip.to_string()),
            Target::Fqdn(name) => ("target_fqdn", name.clone()),
        };
        let mut t = toml::Table::new();
        t.insert(key.into(), toml::Value::String(target));
        if !self.ports.is_empty() {
            t.insert(
                "ports".into(),
                toml::Value::Array(
                    self.ports
                        .iter()
                        .map(|p| toml::Value::String(p.to_string()))
                        .collect(),
                ),
            );
        }
        t.insert("service".into(), toml::Value::String(service.into()));
        t
    }
}

/// The ingress and egress rules the Service's type and annotations ask for.
fn forwards(
    svc: &ServiceInfo,
    (v4, v6): &(bool, bool),
    problems: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> Rules {
    let mut rules = Rules {
        service: format!("{}/{}", svc.namespace, svc.name),
        ..Rules::default()
    };
    let who = format!("Service {}", rules.service);
    let rule = |target: Target, ports: &[PortMap]| Rule {
        target,
        ports: ports.to_vec(),
    };
    let annotation = |k: &str| svc.annotations.get(k).map(|v| v.trim());
    let expose_annotation = match annotation(ANNOTATION_EXPOSE) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            problems.push(format!(
                "{who}: annotation {ANNOTATION_EXPOSE} is {}: expected \"true\" or \"false\"",
                quoted(other)
            ));
            false
        }
    };
    let lb_class = svc.type_.as_deref() == Some("LoadBalancer")
        && svc.load_balancer_class.as_deref() == Some(LOAD_BALANCER_CLASS);
    if expose_annotation || lb_class {
        let ports = ingress_ports(svc, &who, problems);
        if svc.type_.as_deref() == Some("ExternalName") {
            match svc.external_name.as_deref().map(str::trim) {
                Some(name) if !name.is_empty() => {
                    rules
                        .ingress
                        .push(rule(Target::Fqdn(name.to_string()), &ports));
                }
                _ => problems.push(format!(
                    "{who} is ExternalName without spec.externalName: expected a DNS name to forward to"
                )),
            }
        } else {
            let ips: Vec<&str> = svc
                .cluster_ips
                .iter()
                .map(|s| s.trim())
                .filter(|s| !s.is_empty() && *s != "None")
                .collect();
            if ips.is_empty() {
                problems.push(format!(
                    "{who} has no ClusterIP (headless, or not allocated yet): expected a ClusterIP to forward tunnel traffic to"
                ));
            }
            let mut usable = 0;
            for text in &ips {
                match text.parse::<IpAddr>() {
                    Ok(ip) if (ip.is_ipv4() && *v4) || (ip.is_ipv6() && *v6) => {
                        usable += 1;
                        rules.ingress.push(rule(Target::Ip(ip), &ports));
                    }
                    Ok(ip) => notes.push(format!(
                        "{who}: ClusterIP {ip} skipped: interface.addresses has no IPv{} tunnel address",
                        if ip.is_ipv6() { 6 } else { 4 }
                    )),
                    Err(_) => problems.push(format!(
                        "{who}: ClusterIP \"{text}\" is not an IP address"
                    )),
                }
            }
            if usable == 0 && !ips.is_empty() && (*v4 || *v6) {
                problems.push(format!(
                    "{who}: no ClusterIP ({}) is of a family that interface.addresses has: expected a tunnel address of the same IP family",
                    ips.join(", ")
                ));
            }
        }
    }
    let tunnel_ip = annotation(ANNOTATION_TUNNEL_IP);
    let tunnel_fqdn = annotation(ANNOTATION_TUNNEL_FQDN);
    match (tunnel_ip, tunnel_fqdn) {
        (Some(_), Some(_)) => problems.push(format!(
            "{who}: annotations {ANNOTATION_TUNNEL_IP} and {ANNOTATION_TUNNEL_FQDN} are both set: expected one of them"
        )),
        (Some(text), None) => match text.parse::<IpAddr>() {
            Ok(ip) => {
                let ports = egress_ports(svc, &who, problems);
                rules.egress.push(rule(Target::Ip(ip), &ports));
            }
            Err(_) => problems.push(format!(
                "{who}: annotation {ANNOTATION_TUNNEL_IP} {} is not an IP address: expected like \"100.64.0.2\" or \"fd7a:115c:a1e0::2\"",
                quoted(text)
            )),
        },
        (None, Some("")) => problems.push(format!(
            "{who}: annotation {ANNOTATION_TUNNEL_FQDN} is empty: expected a DNS name"
        )),
        // Checked here, not only by the config's validation, whose error quotes the whole value:
        // an annotation may hold 256 KiB, and a newline in a log line or Event forges another.
        (None, Some(name)) if name.len() > MAX_DNS_NAME_BYTES || name.chars().any(char::is_control) => {
            problems.push(format!(
                "{who}: annotation {ANNOTATION_TUNNEL_FQDN} {} is not a DNS name: expected at most {MAX_DNS_NAME_BYTES} characters and no control characters",
                quoted(name)
            ));
        }
        (None, Some(name)) => {
            let ports = egress_ports(svc, &who, problems);
            rules
                .egress
                .push(rule(Target::Fqdn(name.to_string()), &ports));
        }
        (None, None) => {}
    }
    rules
}

/// The longest DNS name (RFC 1035, in its text form without the final dot).
const MAX_DNS_NAME_BYTES: usize = 253;

/// An annotation's value as an error quotes it: escaped, so a newline cannot start a line of
/// its own in a log or an Event, and cut at 64 characters (an annotation may hold 256 KiB).
fn quoted(value: &str) -> String {
    const MAX_CHARS: usize = 64;
    let head: String = value.chars().take(MAX_CHARS).collect();
    if head.len() < value.len() {
        format!("{head:?}... ({} bytes)", value.len())
    } else {
        format!("{head:?}")
    }
}

/// Ingress listens where the Service does: `port` on the tunnel address to `port` on the
/// ClusterIP (kube-proxy maps it on to the pods' targetPort).
fn ingress_ports(svc: &ServiceInfo, who: &str, problems: &mut Vec<String>) -> Vec<PortMap> {
    let mut out = Vec::new();
    for (i, p) in svc.ports.iter().enumerate() {
        if let (Some(port), Some(proto)) = (
            port_of(p.port, who, i, "port", problems),
            proto_of(p, who, i, problems),
        ) {
            out.push(PortMap {
                proto,
                listen: port,
                target: port,
            });
        }
    }
    out
}

/// Egress: traffic for the Service reaches the proxy pod on `targetPort` (kube-proxy maps
/// `port` to it) and goes on to `port` on the tunnel target.
fn egress_ports(svc: &ServiceInfo, who: &str, problems: &mut Vec<String>) -> Vec<PortMap> {
    let mut out = Vec::new();
    for (i, p) in svc.ports.iter().enumerate() {
        let target = port_of(p.port, who, i, "port", problems);
        let listen = match &p.target_port {
            None => target,
            Some(TargetPort::Number(n)) => port_of(*n, who, i, "targetPort", problems),
            Some(TargetPort::Name(name)) => {
                problems.push(format!(
                    "{who}: spec.ports[{i}].targetPort is the name \"{name}\": expected a number (the sidecar does not read the pod's named ports)"
                ));
                None
            }
        };
        if let (Some(listen), Some(target), Some(proto)) =
            (listen, target, proto_of(p, who, i, problems))
        {
            out.push(PortMap {
                proto,
                listen,
                target,
            });
        }
    }
    out
}

fn port_of(n: i32, who: &str, i: usize, field: &str, problems: &mut Vec<String>) -> Option<u16> {
    match u16::try_from(n) {
        Ok(p) if p > 0 => Some(p),
        _ => {
            problems.push(format!(
                "{who}: spec.ports[{i}].{field} {n} is out of range: expected 1 to 65535"
            ));
            None
        }
    }
}

fn proto_of(p: &ServicePort, who: &str, i: usize, problems: &mut Vec<String>) -> Option<Proto> {
    match p.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => Some(Proto::Tcp),
        "UDP" => Some(Proto::Udp),
        other => {
            problems.push(format!(
                "{who}: spec.ports[{i}].protocol {other} is not supported: expected TCP or UDP"
            ));
            None
        }
    }
}

/// Appends the table as TOML text to `out`, its sections in the order of the contract's example
/// (a `toml::Table` alone would sort them by name), with `rules` after the base config's own
/// `[[ingress]]` / `[[egress]]` entries, written one rule at a time straight into the text: a
/// proxy group's 10,000 rules never become one TOML document in memory (that took more than
/// the rest of the sidecar together).
fn write_toml_with(
    out: &mut ConfigText,
    mut table: toml::Table,
    rules: &[&Rules],
) -> Result<(), toml::ser::Error> {
    // `takeover` (which endpoints a takeover may go to, the endpoints file, a shared-identity
    // group's endpoint exchange) is the base config's alone: passed through as written, last.
    const ORDER: [&str; 9] = [
        "interface",
        "peer",
        "firewall",
        "ingress",
        "egress",
        "router",
        "dns",
        "health",
        "takeover",
    ];
    let own = ORDER.map(|k| table.remove(k));
    // Anything else first, so a stray top-level key stays top-level (Config::parse refuses it
    // and names it).
    let section = |key: &str, v: toml::Value| {
        toml::to_string(&toml::Table::from_iter([(key.to_string(), v)]))
    };
    // The parts are separated by an empty line; where each starts and ends.
    let mut first = true;
    let mut push = |out: &mut ConfigText, part: &str| {
        if !std::mem::take(&mut first) {
            out.text.push('\n');
        }
        let start = out.text.len();
        out.text.push_str(part);
        start..out.text.len()
    };
    if !table.is_empty() {
        push(out, &toml::to_string(&table)?);
    }
    for (key, own) in ORDER.into_iter().zip(own) {
        if let Some(v) = own {
            push(out, &section(key, v)?);
        }
        for r in rules {
            let appended = match key {
                "ingress" => r.ingress.as_slice(),
                "egress" => r.egress.as_slice(),
                _ => &[],
            };
            for rule in appended {
                let table = rule.to_table(&r.service);
                let range = push(
                    out,
                    &section(key, toml::Value::Array(vec![toml::Value::Table(table)]))?,
                );
                out.rules.push(range);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
