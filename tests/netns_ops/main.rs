//! Issue 7, operations, end to end in network namespaces against a real wireguard-go peer:
//! `/metrics` moves with the traffic and parses as Prometheus text; no private or preshared key
//! shows up in logs (at trace level, human and JSON), metrics, health bodies, status or `check`
//! output; `tunnelgate status --json` agrees with `wg show dump`; a handshake is logged once,
//! packets never are, and SIGTERM under load exits 0 within 3 s; status and `/metrics` count
//! rules as nft and iptables do.
//!
//! (`/readyz` going to 503 when rules fail is covered per backend in `netns_forwarding.rs`.)
//!
//! Run as root: `cargo test --test netns_ops -- --ignored --test-threads=1`.

#[path = "../common/mod.rs"]
mod common;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use common::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tunnelgate::shell::clock;

const MB: u64 = 1024 * 1024;

/// The underlay (veth) addresses: tunnelgate in `a`, wireguard-go in `b`.
const A_LAN4: &str = "192.168.70.1";
const B_LAN4: &str = "192.168.70.2";
const A_LAN6: &str = "fd70::1";
const B_LAN6: &str = "fd70::2";

/// Tunnel addresses of tunnelgate (`a`) and wireguard-go (`b`).
const A_TUN4: &str = "100.64.0.1";
const A_TUN6: &str = "fd7a::1";
const B_TUN4: &str = "100.64.0.2";
const B_TUN6: &str = "fd7a::2";

const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;

const SHORT: Duration = Duration::from_secs(10);

mod cli;
mod exposition;
mod metrics;
mod rule_count;
mod secrets;
mod setup;
mod shutdown;
mod status;

use exposition::*;
use metrics::*;
use setup::*;
