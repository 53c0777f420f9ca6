//! The firewall rule model: what the daemon wants installed, as a plain, deterministic value.
//! Pure: no I/O here or in the submodules; the shell renders a [`RuleSet`] with [`nft`] or
//! [`iptables`] and feeds the text to the tool's stdin.
//!
//! - [`desired`]: `Config` + runtime facts + DNS answers -> the desired [`RuleSet`].
//! - [`model`]: [`RuleSet`] -> chain-level [`model::Rule`]s, the one place that decides what
//!   each rule kind means; both renderers only spell those rules.
//! - [`nft`]: one `nft -f -` script replacing `table inet tunnelgate_<iface>` atomically.
//! - [`iptables`]: `iptables-restore --noflush` input for our `TG-<iface>-*` chains.
//!
//! Every name a daemon owns in the firewall carries its tunnel interface name ([`nft_table`],
//! [`iptables::chain_name`]), so daemons for different interfaces never touch each other's.

pub mod desired;
pub mod iptables;
pub mod model;
pub mod nft;

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

pub use crate::config::{IpNet, PortMap, Proto};

/// How many rules a read-back of either backend holds (an `nft list table` listing, or the
/// owned `iptables-save` lines), as the tool itself counts them. Each format's rules have a
/// syntax of their own (`-A ...` lines; statements in an nft chain), so the text says which.
pub fn count_installed(installed: &str) -> usize {
    nft::count_rules(installed) + iptables::count_rules(installed)
}

/// What every nftables table of ours starts with; the tunnel interface name follows.
pub const NFT_TABLE_PREFIX: &str = "tunnelgate_";

/// The nftables table (family `inet`) the daemon for interface `tunnel` owns:
/// `tunnelgate_<tunnel>`, e.g. `tunnelgate_tg0`. An interface name is 1-15 letters, digits,
/// `-`, `_` or `.` (checked by the config), and nft takes all of them unquoted after the first
/// character of an identifier (nft 1.0.6 rejects a quoted table name), so the name is used as
/// it is: `tg-0` and `tg_0` get different tables. Any other character (never in a valid
/// config) becomes `_`.
pub fn nft_table(tunnel: &str) -> String {
    let safe: String = tunnel
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{NFT_TABLE_PREFIX}{safe}")
}

/// An address family. Rules of one family never mention addresses of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> Family {
        Family::of(net.addr())
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        })
    }
}

/// Which config section a rule comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Section {
    Ingress,
    Egress,
}

/// The config rule a firewall rule comes from, displayed as its key (`ingress[0]`), which is
/// also the comment on every installed rule that implements it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Origin {
    pub section: Section,
    pub index: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.section {
            Section::Ingress => "ingress",
            Section::Egress => "egress",
        };
        write!(f, "{name}[{}]", self.index)
    }
}

/// Traffic from the tunnel to one of our tunnel addresses, DNATed to `targets` and masqueraded
/// on the way out.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ingress {
    pub origin: Origin,
    pub family: Family,
    /// Every tunnel address of `family` (never empty).
    pub tunnel_addrs: BTreeSet<IpAddr>,
    /// `None`: every port and protocol.
    pub port: Option<PortMap>,
    /// Where new connections go, spread over all of them (never empty, all of `family`).
    pub targets: BTreeSet<IpAddr>,
}

/// Traffic arriving on any other interface for this host's own address there, DNATed to
/// `targets` across the tunnel and SNATed to `snat_to`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Egress {
    pub origin: Origin,
    pub family: Family,
    pub port: Option<PortMap>,
    pub targets: BTreeSet<IpAddr>,
    /// The tunnel address of `family`: a single address, never a prefix.
    pub snat_to: IpAddr,
}

/// Ports egress never captures: the daemon's own sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Exemptions {
    /// The bound WireGuard UDP port.
    pub wg_udp_port: Option<u16>,
    /// The health endpoint's TCP port.
    pub health_tcp_port: Option<u16>,
    /// The group's endpoint exchange's UDP port (`takeover.group_listen`).
    pub group_udp_port: Option<u16>,
}

/// What `[router]` lets through from the tunnel.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouterRules {
    /// Advertised networks of both families.
    pub networks: BTreeSet<IpNet>,
    /// Forward tunnel traffic to anywhere.
    pub exit_node: bool,
    /// With `exit_node`: "anywhere" includes the private networks ([`model::PRIVATE_NETWORKS`])
    /// beyond the advertised ones.
    pub exit_node_lan: bool,
    /// Masquerade forwarded tunnel traffic leaving on another interface.
    pub snat: bool,
}

/// Everything the daemon installs in the firewall. Equal values render to equal text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RuleSet {
    /// The tunnel interface name.
    pub tunnel: String,
    /// In config order, then by family and port.
    pub ingress: Vec<Ingress>,
    pub egress: Vec<Egress>,
    pub exemptions: Exemptions,
    pub router: RouterRules,
    pub mss_clamp: bool,
    /// Drop what the tunnel sends to this host itself, except replies, ICMP and ingress
    /// ([`model::Chain::Input`]).
    pub input_guard: bool,
}

impl RuleSet {
    /// A rule set that installs only the baseline (drop everything forwarded from the tunnel).
    pub fn empty(tunnel: impl Into<String>) -> RuleSet {
        RuleSet {
            tunnel: tunnel.into(),
            ingress: Vec::new(),
            egress: Vec::new(),
            exemptions: Exemptions::default(),
            router: RouterRules::default(),
            mss_clamp: false,
            input_guard: false,
        }
    }
}

#[cfg(test)]
mod tests;
