//! L3 ingress and egress through a real tunnel (issue 3) and the honesty of `/readyz` about rules
//! (issue 7), each test run once per firewall backend: nftables, iptables-nft, iptables-legacy.
//!
//! Topology (fresh namespaces per test):
//!
//! ```text
//!  client ──veth 192.168.60.0/24── proxy ──veth 10.96.0.0/24, fd96::/64── cluster
//!  wireguard-go                    tunnelgate                              backends .10 / ::10
//!  100.64.0.2, fd7a::2             100.64.0.1, fd7a::1
//!                                    └──veth 10.244.0.0/24, fd44::/64── pod (egress clients)
//! ```
//!
//! Run as root: `cargo test --test netns_forwarding -- --ignored --test-threads=1`
//! (one backend: append `nftables::`, `iptables_nft::` or `iptables_legacy::`).

#[path = "../common/mod.rs"]
mod common;

use common::*;
use serde_json::Value;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tunnelgate::shell::clock;

const MB: u64 = 1024 * 1024;
const TG_PORT: u16 = 51820;
const WG_GO_PORT: u16 = 51821;
const HEALTH: &str = "[::]:9002";
const HEALTH_PORT: u16 = 9002;
const CLIENT_UNDERLAY: &str = "192.168.60.1";
const PROXY_UNDERLAY: &str = "192.168.60.2";
const TG_V4: &str = "100.64.0.1";
const TG_V6: &str = "fd7a::1";
const PEER_V4: &str = "100.64.0.2";
const PEER_V6: &str = "fd7a::2";
const PROXY_CLUSTER_V4: &str = "10.96.0.1";
const PROXY_CLUSTER_V6: &str = "fd96::1";
const BACKEND_V4: &str = "10.96.0.10";
const BACKEND_V6: &str = "fd96::10";
const PROXY_POD_V4: &str = "10.244.0.1";
const PROXY_POD_V6: &str = "fd44::1";
/// How long a connection that must not be forwarded is given before it counts as blocked.
const BLOCKED: Duration = Duration::from_millis(1500);

// ---------------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------------

/// The `[firewall]` section selecting `backend`.
fn firewall_toml(backend: Backend, repair_interval: &str) -> String {
    format!(
        "[firewall]\nmode = \"{}\"\nmss_clamp = true\nrepair_interval = \"{repair_interval}\"\n",
        backend.mode()
    )
}

per_backend!(
    ingress_all_ports,
    ingress_mapped_ports,
    egress_listed_ports,
    egress_all_ports_spares_daemon_ports,
    rules_idempotent_repaired_and_removed,
    mtu_mismatch_large_transfers,
    readiness_follows_rule_failures,
    tunnel_reaches_no_local_listener,
);

mod input_guard;
mod lifecycle;
mod ports;
mod readiness;
mod rules;
mod snippets;
mod topo;

use input_guard::*;
use lifecycle::*;
use ports::*;
use readiness::*;
use rules::*;
use snippets::*;
use topo::*;
