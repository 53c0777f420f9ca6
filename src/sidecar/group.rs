//! Proxy groups, the pure part: which Services belong to a group, a replica's ordinal and tunnel
//! addresses, and one replica's Secret data rendered from every Service of its group. A Service
//! that cannot be served (a bad annotation, a port another Service already claims) is left out
//! and named in [`GroupRendered::refused`]; the others are still served. Only a problem of the
//! replica itself (base config, key, address pool) refuses the whole rendering. Also the
//! group's shared identity: which key and addresses every replica runs with, and what a group
//! identity Secret found in the API must hold to be used. No I/O, no clock.

use super::{
    config_text, config_text_with_rules, daemon_check, data_size, finish, forwards, prepare,
    rendered_check, stored_config, tunnel_families, Prepared, Rejected, Rendered, Rule, Rules,
    ServiceInfo, KEY_CONFIG, KEY_PRIVATE, KEY_PUBLIC, SECRET_MAX_BYTES,
};
use crate::config::{decode_key, Config, IpNet, Proto, SecretKey};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

/// `tunnelgate.dev/proxy-group: NAME`: the Service is served by every replica of group NAME.
pub const ANNOTATION_PROXY_GROUP: &str = "tunnelgate.dev/proxy-group";
/// `tunnelgate.dev/proxy-group-balancer: NAME`: the Service is the UDP load balancer in front of
/// group NAME (shared identity): its address is where peers reach the group.
pub const ANNOTATION_GROUP_BALANCER: &str = "tunnelgate.dev/proxy-group-balancer";

/// What one replica of a group is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    pub group: String,
    /// The StatefulSet ordinal (`tgp-1` is 1).
    pub ordinal: u32,
    /// With pools, the replica's tunnel addresses are host `ordinal + 1` of each (host 1 with a
    /// shared identity); without, the base configuration's `interface.addresses`.
    pub pools: Vec<IpNet>,
    /// Whether the replica has a key and addresses of its own, or the group's.
    pub identity: Identity,
    /// Where peers reach the group (its balancer's address and port, [`balancer_endpoint`]):
    /// the rendered `interface.public_endpoint`, unless the base config names one.
    pub endpoint: Option<String>,
}

impl Replica {
    /// The ordinal whose host of each pool this replica takes: its own, or with a shared
    /// identity replica 0's, so that every replica has the same tunnel addresses.
    pub fn address_ordinal(&self) -> u32 {
        match self.identity {
            Identity::PerReplica => self.ordinal,
            Identity::Shared => 0,
        }
    }
}

/// How the replicas of a group are known to their peers (`--identity`,
/// `TUNNELGATE_GROUP_IDENTITY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Identity {
    /// Each replica is a peer of its own: its own key (in its own Secret) and its own addresses.
    #[default]
    PerReplica,
    /// Every replica is the same peer: the group's key (Secret `<group>-identity`) and the same
    /// addresses, so a peer configures one peer behind one load balancer address.
    Shared,
}

impl Identity {
    pub const PER_REPLICA: &'static str = "per-replica";
    pub const SHARED: &'static str = "shared";

    /// The flag's value: exactly `per-replica` or `shared`.
    pub fn parse(text: &str) -> Result<Identity, String> {
        match text {
            Self::PER_REPLICA => Ok(Identity::PerReplica),
            Self::SHARED => Ok(Identity::Shared),
            _ => Err(format!(
                "expected \"{}\" or \"{}\"",
                Self::PER_REPLICA,
                Self::SHARED
            )),
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Identity::PerReplica => Self::PER_REPLICA,
            Identity::Shared => Self::SHARED,
        })
    }
}

/// The longest name the API server accepts for a Secret (a DNS subdomain).
pub const SECRET_NAME_MAX: usize = 253;

/// The group's identity Secret, in the replicas' namespace: `<group>-identity`.
pub fn identity_secret_name(group: &str) -> Result<String, String> {
    let name = format!("{group}-identity");
    if name.len() > SECRET_NAME_MAX {
        return Err(format!(
            "proxy group name \"{group}\" is {} characters: with a shared identity its Secret {group}-identity must fit {SECRET_NAME_MAX}, expected at most {} characters",
            group.len(),
            SECRET_NAME_MAX - "-identity".len()
        ));
    }
    Ok(name)
}

/// The data of a new identity Secret for `key`: `private.key` and `public_key`, as `wg` writes
/// them.
pub fn identity_data(key: &SecretKey) -> BTreeMap<String, Vec<u8>> {
    BTreeMap::from([
        (KEY_PRIVATE.to_string(), key.expose_base64().into_bytes()),
        (
            KEY_PUBLIC.to_string(),
            key.public_key().to_base64().into_bytes(),
        ),
    ])
}

/// The group's key from its identity Secret's data (`None`: the Secret does not exist, so this
/// replica creates it). A Secret that is not one (no `private.key`, a key that is not a
/// 32-byte base64 WireGuard key, a `public_key` that does not belong to it) is refused, never
/// overwritten: `secret` names it in the reason.
pub fn group_key(
    secret: &str,
    data: Option<&BTreeMap<String, Vec<u8>>>,
) -> Result<Option<SecretKey>, String> {
    let Some(data) = data else {
        return Ok(None);
    };
    let fix = "(it is never overwritten: the replicas keep the key they run until it holds a valid one, which they all take at once)";
    let Some(private) = data.get(KEY_PRIVATE) else {
        let mut keys: Vec<&str> = data.keys().map(String::as_str).take(8).collect();
        if data.len() > keys.len() {
            keys.push("...");
        }
        return Err(format!(
            "group identity Secret {secret} has no {KEY_PRIVATE} (keys: {}): expected {KEY_PRIVATE} and {KEY_PUBLIC} {fix}",
            if keys.is_empty() { "none".to_string() } else { keys.join(", ") }
        ));
    };
    let key = std::str::from_utf8(private)
        .map_err(|_| "is not UTF-8: expected a 44-character WireGuard key".to_string())
        .and_then(decode_key)
        .map(SecretKey)
        .map_err(|e| format!("group identity Secret {secret}: {KEY_PRIVATE} {e} {fix}"))?;
    if let Some(public) = data.get(KEY_PUBLIC) {
        let ours = key.public_key().to_base64();
        if std::str::from_utf8(public).map(str::trim) != Ok(ours.as_str()) {
            return Err(format!(
                "group identity Secret {secret}: {KEY_PUBLIC} does not belong to its {KEY_PRIVATE}: expected {ours} {fix}"
            ));
        }
    }
    Ok(Some(key))
}

/// How long a replica that runs the group's key waits, once it finds the identity Secret
/// gone, before it creates it again with that key: an operator who rotates the key by deleting
/// the Secret and creating it with a new key (two commands, seconds apart) gets the new key
/// taken, not a 409 because a replica put the old key back in between. Meanwhile the replicas
/// keep running the key they have, so a Secret deleted by mistake breaks no peer.
pub const IDENTITY_RECREATE_AFTER: Duration = Duration::from_secs(30);

/// What a replica does about the group's identity, given what its Secret holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityStep {
    /// Run the key the Secret holds.
    Use(SecretKey),
    /// The Secret is gone and this replica runs `key`: keep running it, and look again in
    /// `remaining` (someone may be creating it with a new key: a rotation).
    Wait { key: SecretKey, remaining: Duration },
    /// Create the Secret with `key` (the one this replica runs when `recreated`, else a new one),
    /// then run it, unless another replica's create came first.
    Create { key: SecretKey, recreated: bool },
}

/// The step for identity Secret `secret`, from its data (`None`: it does not exist), the key
/// this replica runs (if any) and how long the Secret has been seen missing. A malformed Secret
/// is refused as [`group_key`] refuses it: the caller keeps the key it runs. `new_key` is called
/// only when there is no key at all.
pub fn identity_step(
    secret: &str,
    found: Option<&BTreeMap<String, Vec<u8>>>,
    running: Option<&SecretKey>,
    missing_for: Duration,
    new_key: impl FnOnce() -> SecretKey,
) -> Result<IdentityStep, String> {
    if let Some(key) = group_key(secret, found)? {
        return Ok(IdentityStep::Use(key));
    }
    Ok(match running {
        None => IdentityStep::Create {
            key: new_key(),
            recreated: false,
        },
        Some(key) => match IDENTITY_RECREATE_AFTER.checked_sub(missing_for) {
            Some(remaining) if !remaining.is_zero() => IdentityStep::Wait {
                key: key.clone(),
                remaining,
            },
            _ => IdentityStep::Create {
                key: key.clone(),
                recreated: true,
            },
        },
    })
}

/// A replica's Secret data as rendering reads it, with the group's key in place of its own:
/// every replica renders the same key. The rendering of a shared identity keeps no copy of it
/// in the replica's Secret ([`render_group`]): the key is kept in the identity Secret alone,
/// and reaches the proxy container through the pod's in-memory volume.
pub fn with_group_key(
    current: &BTreeMap<String, Vec<u8>>,
    key: &SecretKey,
) -> BTreeMap<String, Vec<u8>> {
    let mut data = current.clone();
    data.insert(KEY_PRIVATE.to_string(), key.expose_base64().into_bytes());
    data
}

/// A Service of the group that this replica does not serve, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

/// One replica's Secret data, and what it left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRendered {
    pub rendered: Rendered,
    /// `NS/NAME` of every Service the configuration serves, oldest first.
    pub served: Vec<String>,
    pub refused: Vec<Refusal>,
    /// When not every Service fits the Secret's size limit: how many were left out for it
    /// (each is also in `refused`), said once on the replica's pod.
    pub over_limit: Option<String>,
    /// The `target_fqdn` names each served Service's rules use (`NS/NAME` -> names, as the
    /// daemon resolves them), for the check that warns on a Service whose name does not resolve.
    pub names: BTreeMap<String, Vec<String>>,
    /// `dns.nameservers` of the rendered config: the check asks what the daemon asks.
    pub nameservers: Vec<std::net::SocketAddr>,
    /// `dns.reresolve_interval`: the check runs again as often as the daemon resolves.
    pub reresolve_interval: std::time::Duration,
}

/// Whether `svc` is annotated as a member of `group`.
pub fn is_member(svc: &ServiceInfo, group: &str) -> bool {
    svc.annotations
        .get(ANNOTATION_PROXY_GROUP)
        .is_some_and(|g| g.trim() == group)
}

/// Whether `svc` is the load balancer of `group` ([`ANNOTATION_GROUP_BALANCER`]).
pub fn is_balancer(svc: &ServiceInfo, group: &str) -> bool {
    svc.annotations
        .get(ANNOTATION_GROUP_BALANCER)
        .is_some_and(|g| g.trim() == group)
}

/// Where peers reach `group`, from its balancer among `services` (others are ignored): the
/// first address of the balancer's `status.loadBalancer.ingress`, with its UDP port.
/// `Ok(None)`: no balancer, or it has no address yet (the cloud assigns it later). Several
/// balancers: the oldest counts, and the others are named in the error beside it. A balancer
/// with no UDP port or several, or an address that is not one, is an error naming the Service;
/// it never refuses the rendering (the group serves the same without an endpoint printed).
pub fn balancer_endpoint<'a>(
    services: impl IntoIterator<Item = &'a ServiceInfo>,
    group: &str,
) -> (Option<String>, Vec<String>) {
    let mut balancers: Vec<&ServiceInfo> = services
        .into_iter()
        .filter(|s| is_balancer(s, group))
        .collect();
    balancers.sort_by(|a, b| {
        (a.created, &a.namespace, &a.name).cmp(&(b.created, &b.namespace, &b.name))
    });
    let Some(balancer) = balancers.first() else {
        return (None, Vec::new());
    };
    let name = format!("{}/{}", balancer.namespace, balancer.name);
    let mut problems: Vec<String> = balancers[1..]
        .iter()
        .map(|other| {
            format!(
                "Service {}/{} is annotated {ANNOTATION_GROUP_BALANCER}: {group} too; the older {name} is the group's balancer",
                other.namespace, other.name
            )
        })
        .collect();
    let udp: Vec<i32> = balancer
        .ports
        .iter()
        .filter(|p| p.protocol.as_deref() == Some("UDP"))
        .map(|p| p.port)
        .collect();
    let port = match udp.as_slice() {
        [port] => *port,
        [] => {
            problems.push(format!(
                "balancer Service {name} has no UDP port: expected one, the WireGuard port peers dial"
            ));
            return (None, problems);
        }
        _ => {
            problems.push(format!(
                "balancer Service {name} has {} UDP ports: expected one, the WireGuard port peers dial",
                udp.len()
            ));
            return (None, problems);
        }
    };
    let Some(address) = balancer.load_balancer_ingress.first() else {
        return (None, problems);
    };
    let text = match address.parse::<IpAddr>() {
        Ok(ip) => match u16::try_from(port) {
            Ok(p) => std::net::SocketAddr::new(ip, p).to_string(),
            Err(_) => format!("{address}:{port}"),
        },
        Err(_) => format!("{address}:{port}"),
    };
    match crate::config::Endpoint::parse(&text) {
        Ok(endpoint) => (Some(endpoint.to_string()), problems),
        Err(e) => {
            problems.push(format!(
                "balancer Service {name}'s address is not an endpoint peers can dial: {e}"
            ));
            (None, problems)
        }
    }
}

/// The ordinal of a StatefulSet pod: the number after its last `-`.
pub fn ordinal_of(pod_name: &str) -> Result<u32, String> {
    pod_name
        .rsplit_once('-')
        .and_then(|(_, n)| {
            (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .then(|| n.parse().ok())
                .flatten()
        })
        .ok_or_else(|| {
            format!(
                "pod name \"{pod_name}\" has no ordinal suffix: expected a StatefulSet pod name like \"tgp-0\""
            )
        })
}

/// Host `ordinal + 1` of `pool`, as a single-address network (`/32` or `/128`).
pub fn pool_address(pool: &IpNet, ordinal: u32) -> Result<IpNet, String> {
    if pool.trunc() != *pool {
        return Err(format!(
            "address pool {pool} has host bits set: expected the network address {}",
            pool.trunc()
        ));
    }
    let host = u128::from(ordinal) + 1;
    let (base, bits, reserved_top) = match pool.network() {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32, pool.prefix_len() < 31),
        IpAddr::V6(a) => (u128::from(a), 128, false),
    };
    let host_bits = bits - u32::from(pool.prefix_len());
    // Hosts 1 ..= last; an IPv4 pool keeps its broadcast address free.
    let size = if host_bits >= 128 {
        u128::MAX
    } else {
        1u128 << host_bits
    };
    let last = size.saturating_sub(if reserved_top { 2 } else { 1 });
    if host > last {
        return Err(format!(
            "address pool {pool} has {last} host addresses: replica {ordinal} needs host {host}; expected a larger pool"
        ));
    }
    let addr = base + host;
    let ip = match pool.network() {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::from(
            u32::try_from(addr).map_err(|_| format!("address pool {pool}: overflow"))?,
        )),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::from(addr)),
    };
    IpNet::new(ip, if ip.is_ipv4() { 32 } else { 128 }).map_err(|e| e.to_string())
}

/// Renders replica `replica`'s Secret data from the base configuration and `services` (any
/// Services: those not of the group are ignored). `new_key` is called only when the Secret has no
/// `private.key` yet. The Secret never passes the API server's limit, [`SECRET_MAX_BYTES`].
/// With a shared identity, `current` carries the group's key ([`with_group_key`]) and the data
/// has no `private.key`: the replica's Secret keeps no copy of the group's key.
pub fn render_group<'a>(
    replica: &Replica,
    services: impl IntoIterator<Item = &'a ServiceInfo>,
    base: &str,
    current: &BTreeMap<String, Vec<u8>>,
    new_key: impl FnOnce() -> SecretKey,
) -> Result<GroupRendered, Rejected> {
    render_group_within(replica, services, base, current, new_key, SECRET_MAX_BYTES)
}

/// [`render_group`] with a Secret size limit of `max_bytes`: the configuration is stored plain
/// when it fits, gzip-compressed when only that fits, and when not even that does, the oldest
/// Services are served up to the limit and each newer one is left out (in `refused`).
/// `services` by reference: the sidecar's own copy of 10,000 Services is not copied again.
pub fn render_group_within<'a>(
    replica: &Replica,
    services: impl IntoIterator<Item = &'a ServiceInfo>,
    base: &str,
    current: &BTreeMap<String, Vec<u8>>,
    new_key: impl FnOnce() -> SecretKey,
    max_bytes: usize,
) -> Result<GroupRendered, Rejected> {
    let (base, mut notes) = Base::checked(replica, base, current, new_key, max_bytes)?;
    let members = members_oldest_first(services, &replica.group);
    let mut refused = Vec::new();
    let candidates = base.claim_ports(members, &mut refused, &mut notes);
    let (served, text, checked) = base.valid_services(&candidates, &mut refused)?;
    let (rendered, config) = base.finish_data(text, notes.clone(), checked)?;
    let mut draft = Draft {
        rendered,
        config,
        served,
    };
    let over_limit = base.fit_secret(&candidates, &mut draft, notes, &mut refused)?;
    Ok(group_rendered(draft, refused, over_limit))
}

/// A member Service the replica may serve, with the rules it asks for.
type Candidate<'s> = (&'s ServiceInfo, Rules);

/// What every step of one replica's rendering reads: the replica, its base configuration with
/// the replica's own settings (checked), its key, and the Secret's current data and size limit.
struct Base<'a> {
    replica: &'a Replica,
    current: &'a BTreeMap<String, Vec<u8>>,
    max_bytes: usize,
    /// The base configuration with the replica's settings.
    table: toml::Table,
    /// `table` rendered without any Service, with every check of the daemon passed.
    text: String,
    /// The key; its `table` is taken (it is [`Base::table`]).
    prepared: Prepared,
}

/// The rendering so far: the Secret data, the configuration it holds, and the Services it
/// serves (oldest first).
struct Draft<'s> {
    rendered: Rendered,
    config: Config,
    served: Vec<&'s ServiceInfo>,
}

impl<'a> Base<'a> {
    /// The base configuration with the replica's settings (its pool addresses, per-service
    /// readiness, group-readable key files) and the notes on what they replaced. A problem here
    /// is the replica's own and refuses the whole rendering. The base alone gets every check,
    /// unknown keys included; the texts with the Services' rules (keys the sidecar writes) all
    /// but that one, which at 10,000 Services would cost a generic copy of every rule (see
    /// `rendered_check`).
    fn checked(
        replica: &'a Replica,
        base: &str,
        current: &'a BTreeMap<String, Vec<u8>>,
        new_key: impl FnOnce() -> SecretKey,
        max_bytes: usize,
    ) -> Result<(Self, Vec<String>), Rejected> {
        let mut prepared = prepare(base, current, new_key);
        let mut notes = Vec::new();
        if let Some(table) = &mut prepared.table {
            set_pool_addresses(table, replica, &mut prepared.problems);
            set_public_endpoint(table, replica, &mut notes);
            set_per_service_readiness(table, &mut notes);
            set_key_files_readable_by_group(table);
        }
        let Some(table) = prepared.table.take() else {
            return Err(Rejected(prepared.problems));
        };
        if !prepared.problems.is_empty() {
            return Err(Rejected(prepared.problems));
        }
        let text = config_text(&table, [], &header(replica, &[]))?;
        if let Err(e) = daemon_check(&text, &prepared.key) {
            return Err(Rejected(
                e.iter()
                    .map(|e| format!("base config is invalid: {e}"))
                    .collect(),
            ));
        }
        let base = Base {
            replica,
            current,
            max_bytes,
            table,
            text,
            prepared,
        };
        Ok((base, notes))
    }

    /// The Secret data for `text` ([`finish`]). With a shared identity, without `private.key`:
    /// the group's key is kept in its identity Secret only, never copied into each replica's
    /// Secret (the shell hands it to the proxy container with the rest). Taken out here, before
    /// the size is counted, so the Secret holds exactly what was counted.
    fn finish_data(
        &self,
        text: String,
        notes: Vec<String>,
        checked: Option<Config>,
    ) -> Result<(Rendered, Config), Rejected> {
        let (mut rendered, config) = finish(text, &self.prepared, self.current, notes, checked)?;
        if self.replica.identity == Identity::Shared {
            rendered.data.remove(KEY_PRIVATE);
        }
        Ok((rendered, config))
    }

    /// The members (oldest first) the replica can serve, each with its rules. A Service that
    /// asks for nothing usable ([`service_rules`]), or for a port and protocol an older member
    /// already takes on the same side (tunnel addresses for ingress, the pod address for
    /// egress), is refused; the notes of the others go to `notes`.
    fn claim_ports<'s>(
        &self,
        members: Vec<&'s ServiceInfo>,
        refused: &mut Vec<Refusal>,
        notes: &mut Vec<String>,
    ) -> Vec<Candidate<'s>> {
        let families = tunnel_families(&self.table);
        let group = &self.replica.group;
        let mut candidates: Vec<Candidate<'s>> = Vec::new();
        // (listen port, protocol) -> the Service that claimed it, per direction.
        let mut ingress_claims: BTreeMap<(u16, Proto), &ServiceInfo> = BTreeMap::new();
        let mut egress_claims: BTreeMap<(u16, Proto), &ServiceInfo> = BTreeMap::new();
        for svc in members {
            let mut svc_notes = Vec::new();
            let rules = match service_rules(svc, group, &families, &mut svc_notes) {
                Ok(rules) => rules,
                Err(reason) => {
                    refused.push(refusal(svc, reason));
                    continue;
                }
            };
            let ingress = claims(&rules.ingress);
            let egress = claims(&rules.egress);
            let clash = ingress
                .iter()
                .find_map(|c| {
                    ingress_claims
                        .get(c)
                        .map(|o| (c, o, "the tunnel addresses"))
                })
                .or_else(|| {
                    egress
                        .iter()
                        .find_map(|c| egress_claims.get(c).map(|o| (c, o, "the pod address")))
                });
            if let Some(((port, proto), owner, place)) = clash {
                let who = format!("{}/{}", svc.namespace, svc.name);
                refused.push(refusal(svc, format!(
                    "Service {who} left out of proxy group {group}: port {port}/{proto} on {place} is already served by Service {}/{}; expected a port no other Service of the group uses",
                    owner.namespace, owner.name
                )));
                continue;
            }
            for c in ingress {
                ingress_claims.insert(c, svc);
            }
            for c in egress {
                egress_claims.insert(c, svc);
            }
            notes.extend(svc_notes);
            candidates.push((svc, rules));
        }
        candidates
    }

    /// Every candidate together, as the daemon would load them: the served Services, the text,
    /// and its Config when the check that passed already parsed it (the happy path checks the
    /// text once). When that fails (a clash with the base config's own rules, say), the
    /// Services the errors name are left out ([`Base::leave_out_pinned`]), then the rest is
    /// added one by one ([`Base::add_one_by_one`]).
    fn valid_services<'s>(
        &self,
        candidates: &[Candidate<'s>],
        refused: &mut Vec<Refusal>,
    ) -> Result<(Vec<&'s ServiceInfo>, String, Option<Config>), Rejected> {
        let all: Vec<&ServiceInfo> = candidates.iter().map(|(s, _)| *s).collect();
        let rules = candidates.iter().map(|(_, r)| r);
        let text = config_text_with_rules(&self.table, rules, &header(self.replica, &all))?;
        if let Ok(config) = rendered_check(&self.text, &text, &self.prepared.key) {
            return Ok((all, text.text, Some(config)));
        }
        let (pool, pool_ok) = self.leave_out_pinned(candidates, refused)?;
        let (kept, rest) = if pool_ok {
            (pool, Vec::new())
        } else {
            (Vec::new(), pool)
        };
        let kept = self.add_one_by_one(kept, rest, refused)?;
        let served: Vec<&ServiceInfo> = kept.iter().map(|(s, _)| *s).collect();
        let rules = kept.iter().map(|(_, r)| r);
        let text = config_text(&self.table, rules, &header(self.replica, &served))?;
        Ok((served, text, None))
    }

    /// Up to [`PINNING_ROUNDS`] times, leaves out the Services whose rules the check's errors
    /// name (`ingress[12].ports`): the candidates still in, and whether they pass together.
    /// Only what cannot be pinned on a rule is left to [`Base::add_one_by_one`], which takes
    /// one check per Service (minutes at 10,000 Services).
    fn leave_out_pinned<'c, 's>(
        &self,
        candidates: &'c [Candidate<'s>],
        refused: &mut Vec<Refusal>,
    ) -> Result<(Vec<&'c Candidate<'s>>, bool), Rejected> {
        let section_len = |k: &str| {
            self.table
                .get(k)
                .and_then(|v| v.as_array())
                .map_or(0, Vec::len)
        };
        let base_rules = (section_len("ingress"), section_len("egress"));
        let mut pool: Vec<&Candidate<'s>> = candidates.iter().collect();
        for _ in 0..PINNING_ROUNDS {
            let rules = pool.iter().map(|(_, r)| r);
            let text = config_text_with_rules(&self.table, rules, &header(self.replica, &[]))?;
            let Err(errors) = rendered_check(&self.text, &text, &self.prepared.key) else {
                return Ok((pool, true));
            };
            let bad = errors_by_candidate(&pool, &errors, base_rules);
            if bad.is_empty() {
                break;
            }
            for (i, errors) in bad.iter().rev() {
                let c = pool.remove(*i);
                refused.push(self.invalid_with(c.0, errors));
            }
        }
        Ok((pool, false))
    }

    /// `kept` (which pass together) and each Service of `rest` in turn that still passes with
    /// them; each one with which the configuration is invalid is refused.
    fn add_one_by_one<'c, 's>(
        &self,
        mut kept: Vec<&'c Candidate<'s>>,
        rest: Vec<&'c Candidate<'s>>,
        refused: &mut Vec<Refusal>,
    ) -> Result<Vec<&'c Candidate<'s>>, Rejected> {
        for c in rest {
            let trial = config_text_with_rules(
                &self.table,
                kept.iter().map(|(_, r)| r).chain([&c.1]),
                &header(self.replica, &[]),
            )?;
            match rendered_check(&self.text, &trial, &self.prepared.key) {
                Ok(_) => kept.push(c),
                Err(e) => refused.push(self.invalid_with(c.0, &e)),
            }
        }
        Ok(kept)
    }

    /// The refusal of `svc`: with it the configuration is invalid, for `errors`.
    fn invalid_with(&self, svc: &ServiceInfo, errors: &[String]) -> Refusal {
        refusal(
            svc,
            format!(
                "Service {}/{} left out of proxy group {}: with it the configuration is invalid: {}",
                svc.namespace,
                svc.name,
                self.replica.group,
                errors.join("; ")
            ),
        )
    }

    /// How the configuration is stored in the Secret: plain when it fits, gzip-compressed when
    /// only that fits. When not even that does, only the oldest Services that fit are served
    /// ([`Base::serve_oldest_that_fit`]), and the note that says so is returned.
    fn fit_secret(
        &self,
        candidates: &[Candidate<'_>],
        draft: &mut Draft<'_>,
        notes: Vec<String>,
        refused: &mut Vec<Refusal>,
    ) -> Result<Option<String>, Rejected> {
        let max_bytes = self.max_bytes;
        let data = &draft.rendered.data;
        let others = data_size(data) - KEY_CONFIG.len() - data.get(KEY_CONFIG).map_or(0, Vec::len);
        let mut over_limit = None;
        let text = data.get(KEY_CONFIG).map_or(&[][..], Vec::as_slice);
        let stored = match stored_config(text, others, max_bytes) {
            Ok(stored) => stored,
            Err(needed) => {
                over_limit = Some(
                    self.serve_oldest_that_fit(candidates, draft, needed, others, notes, refused)?,
                );
                let text = draft.rendered.data.get(KEY_CONFIG);
                let text = text.map_or(&[][..], Vec::as_slice);
                stored_config(text, others, max_bytes).map_err(|bytes| {
                    Rejected(vec![format!(
                        "the config Secret needs {bytes} bytes: expected at most {max_bytes}"
                    )])
                })?
            }
        };
        if stored.0 != KEY_CONFIG {
            draft.rendered.data.remove(KEY_CONFIG);
            draft.rendered.data.insert(stored.0.to_string(), stored.1);
        }
        Ok(over_limit)
    }

    /// Not every served Service fits the Secret (all need `needed` bytes compressed, besides
    /// `others` of other data): the longest prefix of them that fits (oldest first) is served,
    /// each newer one refused, and `draft` rendered again from that prefix. A subset of a
    /// valid configuration is valid, so only the final one is checked again. Returns the note
    /// for the replica's pod; when not even the base config fits, refuses the whole rendering.
    fn serve_oldest_that_fit(
        &self,
        candidates: &[Candidate<'_>],
        draft: &mut Draft<'_>,
        needed: usize,
        others: usize,
        notes: Vec<String>,
        refused: &mut Vec<Refusal>,
    ) -> Result<String, Rejected> {
        let (max_bytes, group) = (self.max_bytes, &self.replica.group);
        let rules_of: BTreeMap<(&str, &str), &Rules> = candidates
            .iter()
            .map(|(s, r)| ((s.namespace.as_str(), s.name.as_str()), r))
            .collect();
        let served = &draft.served;
        let prefix_text = |k: usize| {
            let rules = served[..k]
                .iter()
                .filter_map(|s| rules_of.get(&(s.namespace.as_str(), s.name.as_str())))
                .copied();
            config_text_with_rules(&self.table, rules, &header(self.replica, &served[..k]))
        };
        let fits = |k: usize| -> Result<bool, Rejected> {
            Ok(stored_config(prefix_text(k)?.text.as_bytes(), others, max_bytes).is_ok())
        };
        if !fits(0)? {
            return Err(Rejected(vec![format!(
                "the base config alone does not fit the config Secret's limit of {max_bytes} bytes, even gzip-compressed"
            )]));
        }
        let low = longest_fitting(served.len(), fits)?;
        let total = served.len();
        for s in &served[low..] {
            refused.push(refusal(s, format!(
                "Service {}/{} left out of proxy group {group}: the config Secret would pass the API server's limit of {max_bytes} bytes (all {total} Services need {needed} bytes gzip-compressed); the {low} oldest Services are served; expected fewer Services in the group (or a second group)",
                s.namespace, s.name
            )));
        }
        let over_limit = format!(
            "proxy group {group} has more Services than its config Secret can hold: the {low} oldest of {total} are served, {} newer ones are left out (each has a Warning Event); all of them need {needed} bytes gzip-compressed, the limit is {max_bytes}",
            total - low
        );
        let text = prefix_text(low)?;
        draft.served.truncate(low);
        let checked = rendered_check(&self.text, &text, &self.prepared.key).map_err(|e| {
            Rejected(
                e.iter()
                    .map(|e| format!("rendered {KEY_CONFIG} is invalid: {e}"))
                    .collect(),
            )
        })?;
        (draft.rendered, draft.config) = self.finish_data(text.text, notes, Some(checked))?;
        Ok(over_limit)
    }
}

/// The members of `group` among `services`, oldest first: a new Service never takes a port
/// from one that is already served.
fn members_oldest_first<'a>(
    services: impl IntoIterator<Item = &'a ServiceInfo>,
    group: &str,
) -> Vec<&'a ServiceInfo> {
    let mut members: Vec<&ServiceInfo> = services
        .into_iter()
        .filter(|s| is_member(s, group))
        .collect();
    members.sort_by(|a, b| {
        (a.created, &a.namespace, &a.name).cmp(&(b.created, &b.namespace, &b.name))
    });
    members
}

/// The rules member `svc` of `group` asks for, or why it cannot be served: a bad annotation,
/// nothing asked for, or no ports (in a proxy group every Service claims its own ports).
fn service_rules(
    svc: &ServiceInfo,
    group: &str,
    families: &(bool, bool),
    notes: &mut Vec<String>,
) -> Result<Rules, String> {
    let who = format!("{}/{}", svc.namespace, svc.name);
    let mut problems = Vec::new();
    let rules = forwards(svc, families, &mut problems, notes);
    if rules.ingress.is_empty() && rules.egress.is_empty() && problems.is_empty() {
        problems.push(format!(
            "Service {who} is in proxy group {group} but asks for nothing: expected tunnelgate.dev/expose: \"true\", tunnelgate.dev/tunnel-ip or tunnelgate.dev/tunnel-fqdn"
        ));
    }
    if svc.ports.is_empty() && problems.is_empty() {
        problems.push(format!(
            "Service {who} has no ports: expected at least one (in a proxy group every Service claims its own ports)"
        ));
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    Ok(rules)
}

/// The comment heading the rendered configuration: the replica, its group, and the Services
/// it serves.
fn header(replica: &Replica, served: &[&ServiceInfo]) -> String {
    let mut names = String::new();
    for (i, s) in served.iter().enumerate() {
        let comma = if i == 0 { "" } else { ", " };
        let _ = write!(names, "{comma}{}/{}", s.namespace, s.name);
    }
    format!(
        "# Rendered by tunnelgate-sidecar for replica {} of proxy group {} from the base config and\n# Services: {}.\n# Do not edit: the next change of any of them replaces this file.\n",
        replica.ordinal,
        replica.group,
        if names.is_empty() { "none" } else { &names }
    )
}

/// Which candidates of `pool` the check's `errors` are about: pool index -> its errors. The
/// Services' rules follow the base config's own (`base_rules`: how many ingress and egress
/// rules it has); an error about one of those, or about no rule, is nobody's.
fn errors_by_candidate(
    pool: &[&Candidate<'_>],
    errors: &[String],
    (base_ingress, base_egress): (usize, usize),
) -> BTreeMap<usize, Vec<String>> {
    let (mut owner_ingress, mut owner_egress) = (Vec::new(), Vec::new());
    for (i, (_, r)) in pool.iter().enumerate() {
        owner_ingress.extend(std::iter::repeat_n(i, r.ingress.len()));
        owner_egress.extend(std::iter::repeat_n(i, r.egress.len()));
    }
    let mut bad: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for e in errors {
        let owner = rule_of_error(e).and_then(|(section, n)| match section {
            "ingress" => owner_ingress.get(n.checked_sub(base_ingress)?),
            _ => owner_egress.get(n.checked_sub(base_egress)?),
        });
        if let Some(&i) = owner {
            bad.entry(i).or_default().push(e.clone());
        }
    }
    bad
}

/// The largest `k` in `0..len` with `fits(k)`, by bisection, given `fits(0)` and that
/// `fits` holds for a prefix of `0..=len` only. Invariant: fits(low), !fits(high).
fn longest_fitting(
    len: usize,
    fits: impl Fn(usize) -> Result<bool, Rejected>,
) -> Result<usize, Rejected> {
    let (mut low, mut high) = (0, len);
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        if fits(mid)? {
            low = mid;
        } else {
            high = mid;
        }
    }
    Ok(low)
}

/// The result: the Secret data and what it serves and leaves out, with the names each served
/// Service's rules use. Only the Services' own rules: a name of the base config is the
/// replica's problem, and the daemon's readiness reports that one.
fn group_rendered(
    draft: Draft<'_>,
    refused: Vec<Refusal>,
    over_limit: Option<String>,
) -> GroupRendered {
    let Draft {
        rendered,
        config,
        served,
    } = draft;
    let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, users) in config.fqdn_users() {
        for service in users.services {
            names.entry(service).or_default().push(name.clone());
        }
    }
    GroupRendered {
        rendered,
        served: served
            .iter()
            .map(|s| format!("{}/{}", s.namespace, s.name))
            .collect(),
        refused,
        over_limit,
        names,
        nameservers: config.dns.nameservers,
        reresolve_interval: config.dns.reresolve_interval,
    }
}

/// `svc` left out, for `reason`.
fn refusal(svc: &ServiceInfo, reason: String) -> Refusal {
    Refusal {
        namespace: svc.namespace.clone(),
        name: svc.name.clone(),
        reason,
    }
}

/// How often the Services that errors name are left out before the rest is checked one by one.
const PINNING_ROUNDS: usize = 4;

/// The rule a configuration error is about, from its key: `ingress[12].ports: ...` is
/// `("ingress", 12)`.
fn rule_of_error(error: &str) -> Option<(&'static str, usize)> {
    let (section, rest) = if let Some(rest) = error.strip_prefix("ingress[") {
        ("ingress", rest)
    } else {
        ("egress", error.strip_prefix("egress[")?)
    };
    let (n, _) = rest.split_once(']')?;
    Some((section, n.parse().ok()?))
}

/// The served Services whose names do not resolve, each with its names and their errors, from
/// the answers of one check (`name` -> Ok, or why not). A name without an answer is skipped.
pub fn unresolved_services(
    names: &BTreeMap<String, Vec<String>>,
    answers: &BTreeMap<String, Result<(), String>>,
) -> BTreeMap<String, Vec<(String, String)>> {
    names
        .iter()
        .filter_map(|(service, names)| {
            let failed: Vec<(String, String)> = names
                .iter()
                .filter_map(|n| match answers.get(n)? {
                    Ok(()) => None,
                    Err(e) => Some((n.clone(), e.clone())),
                })
                .collect();
            (!failed.is_empty()).then(|| (service.clone(), failed))
        })
        .collect()
}

/// `health.readiness = "per-service"`: a replica serves many Services, and one whose name does
/// not resolve must not take the others off it (the contract's group readiness). The base
/// config cannot opt out: a different value is replaced, with a note saying so.
fn set_per_service_readiness(table: &mut toml::Table, notes: &mut Vec<String>) {
    const PER_SERVICE: &str = "per-service";
    let health = table
        .entry("health")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    // Not a table: the daemon's check of the rendering names the problem.
    let Some(health) = health.as_table_mut() else {
        return;
    };
    let old = health.insert("readiness".into(), toml::Value::String(PER_SERVICE.into()));
    if let Some(old) = old.filter(|v| v.as_str() != Some(PER_SERVICE)) {
        notes.push(format!(
            "base config: health.readiness = {old} replaced by \"{PER_SERVICE}\": in a proxy group one Service's unresolved name must not make the replica NotReady"
        ));
    }
}

/// `interface.key_files_readable_by_group = true`: the sidecar hands the key to the proxy
/// container through a volume only the pod's containers share ([`super::config_dir`]), as a file
/// of the sidecar's user that the proxy reads through its group; the proxy runs as root without
/// `CAP_DAC_OVERRIDE`, so an owner-only file would be unreadable to it.
fn set_key_files_readable_by_group(table: &mut toml::Table) {
    if let Some(iface) = table
        .get_mut("interface")
        .and_then(toml::Value::as_table_mut)
    {
        iface.insert(
            "key_files_readable_by_group".into(),
            toml::Value::Boolean(true),
        );
    }
}

/// With pools, `interface.addresses` is this replica's host of each pool (host 1 with a shared
/// identity).
fn set_pool_addresses(table: &mut toml::Table, replica: &Replica, problems: &mut Vec<String>) {
    if replica.pools.is_empty() {
        return;
    }
    let mut addrs = Vec::new();
    for pool in &replica.pools {
        match pool_address(pool, replica.address_ordinal()) {
            Ok(a) => addrs.push(toml::Value::String(a.to_string())),
            Err(e) => problems.push(e),
        }
    }
    if let Some(iface) = table.get_mut("interface").and_then(|i| i.as_table_mut()) {
        iface.insert("addresses".into(), toml::Value::Array(addrs));
    }
}

/// `interface.public_endpoint` is the group balancer's address, unless the base config names
/// one (the operator's word stands; a note says so when they differ).
fn set_public_endpoint(table: &mut toml::Table, replica: &Replica, notes: &mut Vec<String>) {
    let Some(endpoint) = &replica.endpoint else {
        return;
    };
    let Some(iface) = table.get_mut("interface").and_then(|i| i.as_table_mut()) else {
        return;
    };
    match iface.get("public_endpoint").and_then(toml::Value::as_str) {
        Some(own) if own != endpoint => notes.push(format!(
            "interface.public_endpoint {own:?} of the base config stands; the group's balancer is at {endpoint}"
        )),
        Some(_) => {}
        None => {
            iface.insert(
                "public_endpoint".into(),
                toml::Value::String(endpoint.clone()),
            );
        }
    }
}

/// The (listen port, protocol) pairs a set of rules takes.
fn claims(rules: &[Rule]) -> Vec<(u16, Proto)> {
    let mut out: Vec<(u16, Proto)> = rules
        .iter()
        .flat_map(|r| &r.ports)
        .map(|p| (p.listen, p.proto))
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
