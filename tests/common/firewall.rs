//! The firewall backends (nftables, iptables-nft, iptables-legacy) and `per_backend!`, for suites that run one body per backend.

use super::*;

/// The firewall backends a daemon can use (each suite writes its own `[firewall]` section with
/// [`Backend::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    IptablesNft,
    IptablesLegacy,
}

impl Backend {
    /// `firewall.mode` selecting this backend (the iptables flavour comes from [`Backend::env`]).
    pub fn mode(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            _ => "iptables",
        }
    }

    /// The daemon's environment for this backend.
    pub fn env(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Backend::Nftables => vec![],
            Backend::IptablesNft => vec![("TUNNELGATE_IPTABLES", "nft")],
            Backend::IptablesLegacy => vec![("TUNNELGATE_IPTABLES", "legacy")],
        }
    }

    /// The `backend` label of the rule metrics.
    pub fn label(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            Backend::IptablesNft => "iptables",
            Backend::IptablesLegacy => "iptables-legacy",
        }
    }

    pub fn is_iptables(self) -> bool {
        self != Backend::Nftables
    }

    /// `iptables` / `ip6tables` of this flavour.
    pub fn iptables(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy",
            (_, false) => "iptables",
            (_, true) => "ip6tables",
        }
    }

    pub fn iptables_save(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Backend::IptablesLegacy, false) => "iptables-legacy-save",
            (Backend::IptablesLegacy, true) => "ip6tables-legacy-save",
            (_, false) => "iptables-save",
            (_, true) => "ip6tables-save",
        }
    }

    /// The programs the daemon runs to change rules (what a failing backend means).
    pub fn apply_programs(self) -> &'static [&'static str] {
        match self {
            Backend::Nftables => &["nft"],
            Backend::IptablesNft => &["iptables-restore", "ip6tables-restore"],
            Backend::IptablesLegacy => &["iptables-legacy-restore", "ip6tables-legacy-restore"],
        }
    }

    /// Checks that this machine's tools are what the backend's name promises.
    pub fn check_tools(self) {
        if self == Backend::IptablesNft {
            let v = run(&["iptables", "--version"]);
            assert!(
                v.contains("nf_tables"),
                "`iptables` is not iptables-nft here: {v}"
            );
        }
    }
}

/// Makes one `#[test]` per backend for each named test body `fn NAME(Backend)` of the suite.
#[allow(unused_macros)] // every suite compiles the harness; only some run per backend
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod nftables {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::Nftables) })*
        }
        mod iptables_nft {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesNft) })*
        }
        mod iptables_legacy {
            $(#[test] #[ignore = "needs root"] fn $name() { super::$name(super::Backend::IptablesLegacy) })*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_backend;
