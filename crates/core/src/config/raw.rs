//! The TOML file as written: serde structs with every field optional or a string, so that
//! validation (not serde) decides what is wrong and can name the key. Unknown keys are ignored
//! here and all reported by `unknown_keys`, which reads the field lists off these structs.

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawConfig {
    pub interface: Option<RawInterface>,
    #[serde(default)]
    pub peer: Vec<RawPeer>,
    pub firewall: Option<RawFirewall>,
    #[serde(default)]
    pub ingress: Vec<RawForward>,
    #[serde(default)]
    pub egress: Vec<RawForward>,
    pub router: Option<RawRouter>,
    pub dns: Option<RawDns>,
    pub health: Option<RawHealth>,
    pub takeover: Option<RawTakeover>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawInterface {
    /// TUN device name; also names the UAPI socket.
    pub name: Option<String>,
    /// Base64 private key, inline.
    pub private_key: Option<String>,
    /// Path to a file holding the base64 private key (relative to the config file).
    pub private_key_file: Option<String>,
    /// UDP port; 0 or absent picks a random one.
    pub listen_port: Option<i64>,
    /// Tunnel addresses with prefix length.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// TUN MTU, default 1420.
    pub mtu: Option<i64>,
    /// Firewall mark set on the WireGuard socket (like wg-quick's FwMark); 0 = automatic.
    pub fwmark: Option<i64>,
    /// Packet workers; 0 or absent = the CPUs this process may use.
    pub workers: Option<i64>,
    /// Key files may be readable (not writable) by their group; never by others.
    pub key_files_readable_by_group: Option<bool>,
    /// host:port at which peers reach this host (a load balancer's or a moving address):
    /// printed in the client's `[Peer]` section, never dialled.
    pub public_endpoint: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawPeer {
    pub name: Option<String>,
    pub public_key: Option<String>,
    pub preshared_key: Option<String>,
    pub preshared_key_file: Option<String>,
    pub endpoint: Option<String>,
    #[serde(default)]
    pub allowed_ips: Vec<String>,
    pub persistent_keepalive: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawFirewall {
    pub mode: Option<String>,
    pub mss_clamp: Option<bool>,
    /// How often the installed rules are compared with the desired ones and repaired ("0s" = never).
    pub repair_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawForward {
    pub target: Option<String>,
    pub target_fqdn: Option<String>,
    pub ports: Option<Vec<String>>,
    /// What the rule serves, e.g. a Kubernetes Service `NAMESPACE/NAME`.
    pub service: Option<String>,
}

/// Only the rules of a configuration, a part of one: see `Config::parse_known_keys_with_rules`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawRules {
    #[serde(default)]
    pub ingress: Vec<RawForward>,
    #[serde(default)]
    pub egress: Vec<RawForward>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawRouter {
    #[serde(default)]
    pub advertise_routes: Vec<String>,
    pub exit_node: Option<bool>,
    pub exit_node_lan: Option<bool>,
    pub snat: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawDns {
    pub reresolve_interval: Option<String>,
    #[serde(default)]
    pub nameservers: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawHealth {
    /// host:port, or "" to disable the endpoint.
    pub listen: Option<String>,
    /// true: tunnel peers may reach this host's listeners (no input guard).
    pub allow_from_tunnel: Option<bool>,
    /// "all" (default) or "per-service".
    pub readiness: Option<String>,
    /// The most peers `/metrics` gives series of their own (the busiest).
    pub metrics_peers: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawTakeover {
    /// true: a takeover may answer any source, proven or not (closed networks only).
    pub answer_any_source: Option<bool>,
    /// Where the endpoints this identity authenticated are kept across a restart; "" = nowhere.
    pub state_file: Option<String>,
    /// UDP address the group's endpoint exchange listens on (replicas of one identity).
    pub group_listen: Option<String>,
    /// host:port of the other replicas: every address the name resolves to is one.
    pub group_replicas: Option<String>,
}
