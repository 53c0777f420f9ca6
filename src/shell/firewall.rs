//! Runs the rendered rule text: one `nft -f -` transaction on our table, or one
//! `iptables-restore --noflush` per family on our chains (both named after the tunnel
//! interface, so another daemon's are never read or touched); reads what is installed back for
//! drift checks; removes it all on shutdown. No rule decisions here (the forwarding sysctls are in
//! [`super::forwarding`]).

use crate::config::FirewallMode;
use crate::rules::{iptables, nft, Family, RuleSet};
use std::io::Write;
use std::process::{Command, Stdio};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    /// `legacy`: the xtables binaries (`iptables-legacy-restore`), else the default ones.
    Iptables {
        legacy: bool,
    },
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Nftables => "nftables",
            Backend::Iptables { legacy: false } => "iptables",
            Backend::Iptables { legacy: true } => "iptables-legacy",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("{program} not found: install it, or choose another firewall.mode")]
    Missing { program: String },
    #[error("{program} failed: {stderr}")]
    Failed { program: String, stderr: String },
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, FirewallError> {
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn().map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            FirewallError::Missing {
                program: program.into(),
            }
        } else {
            FirewallError::Spawn {
                program: program.into(),
                source,
            }
        }
    })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A program that exits early (a parse error) closes its stdin: its exit status and
        // stderr, read below, say why; EPIPE would only hide that. Any other write error
        // still reaps the child, so no zombie is left behind.
        if let Err(source) = pipe.write_all(text.as_bytes()) {
            if source.kind() != std::io::ErrorKind::BrokenPipe {
                let _ = child.kill();
                let _ = child.wait();
                return Err(FirewallError::Spawn {
                    program: program.into(),
                    source,
                });
            }
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|source| FirewallError::Spawn {
            program: program.into(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(FirewallError::Failed {
            program: program.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn exists(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(program).is_file()))
}

/// The binaries of a backend.
fn restore_bin(family: Family, legacy: bool) -> &'static str {
    match (family, legacy) {
        (Family::V4, false) => "iptables-restore",
        (Family::V6, false) => "ip6tables-restore",
        (Family::V4, true) => "iptables-legacy-restore",
        (Family::V6, true) => "ip6tables-legacy-restore",
    }
}

fn save_bin(family: Family, legacy: bool) -> &'static str {
    match (family, legacy) {
        (Family::V4, false) => "iptables-save",
        (Family::V6, false) => "ip6tables-save",
        (Family::V4, true) => "iptables-legacy-save",
        (Family::V6, true) => "ip6tables-legacy-save",
    }
}

/// Picks the backend. `auto` follows the host: legacy xtables rules present -> iptables-legacy
/// (an nftables table beside them would be evaluated separately and confuse operators);
/// otherwise nftables if `nft` exists (iptables-nft rules live in nftables too); else iptables.
/// `TUNNELGATE_IPTABLES=legacy|nft` chooses the iptables flavour in `iptables` mode.
pub fn choose(mode: FirewallMode) -> Result<Backend, FirewallError> {
    let flavour = match iptables_flavour(std::env::var_os("TUNNELGATE_IPTABLES").as_deref()) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("{e}; choosing by the rules on the host");
            None
        }
    };
    let legacy_rules = || {
        [Family::V4, Family::V6].iter().any(|f| {
            run(save_bin(*f, true), &[], None)
                .is_ok_and(|s| s.lines().any(|l| l.starts_with("-A ")))
        })
    };
    match mode {
        FirewallMode::Nftables => {
            if exists("nft") {
                Ok(Backend::Nftables)
            } else {
                Err(FirewallError::Missing {
                    program: "nft".into(),
                })
            }
        }
        FirewallMode::Iptables => {
            let legacy = match flavour {
                Some(legacy) => legacy,
                None => legacy_rules(),
            };
            let bin = restore_bin(Family::V4, legacy);
            if exists(bin) {
                Ok(Backend::Iptables { legacy })
            } else {
                Err(FirewallError::Missing {
                    program: bin.into(),
                })
            }
        }
        FirewallMode::Auto => {
            if exists("iptables-legacy-save") && legacy_rules() {
                Ok(Backend::Iptables { legacy: true })
            } else if exists("nft") {
                Ok(Backend::Nftables)
            } else if exists("iptables-restore") {
                Ok(Backend::Iptables { legacy: false })
            } else {
                Err(FirewallError::Missing {
                    program: "nft (or iptables-restore)".into(),
                })
            }
        }
    }
}

/// The iptables flavour `TUNNELGATE_IPTABLES` names: `Some(true)` for `legacy`, `Some(false)`
/// for `nft`, `None` when unset or empty (follow the host). Anything else, a typo or bytes that
/// are not UTF-8, is named (shortened) in the error, so the fallback is not silent.
pub fn iptables_flavour(value: Option<&std::ffi::OsStr>) -> Result<Option<bool>, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match value.to_str() {
        Some("legacy") => Ok(Some(true)),
        Some("nft") => Ok(Some(false)),
        _ => {
            let shown: String = value.to_string_lossy().chars().take(32).collect();
            Err(format!(
                "TUNNELGATE_IPTABLES={shown:?}: expected \"legacy\" or \"nft\""
            ))
        }
    }
}

/// Whether IPv6 is usable here (ip6tables needs it; nftables does not care).
fn ipv6_enabled() -> bool {
    std::path::Path::new("/proc/sys/net/ipv6").exists()
}

impl Backend {
    /// The text that would be applied now, for `check` and logs. For iptables, jumps that
    /// already exist are not repeated, so the text depends on the system's current state.
    pub fn render(&self, set: &RuleSet) -> String {
        match self {
            Backend::Nftables => nft::render(set),
            Backend::Iptables { legacy } => {
                let mut out = String::new();
                for family in [Family::V4, Family::V6] {
                    let jumps = run(save_bin(family, *legacy), &[], None)
                        .map(|s| iptables::parse_jumps(&set.tunnel, &s))
                        .unwrap_or_default();
                    out.push_str(&format!("# {}\n", restore_bin(family, *legacy)));
                    out.push_str(&iptables::render(set, family, &jumps));
                }
                out
            }
        }
    }

    /// Replaces our rules with `set` atomically (per family for iptables). Nothing is read
    /// back here: that is [`Backend::installed`], which the drift check calls. With nftables and the
    /// set known to be `installed`, a change of map elements only is applied as just that
    /// ([`nft::render_update`]); should that transaction fail (the table was changed or
    /// removed by hand), nothing of it was applied and the full replace runs instead.
    pub fn apply(&self, set: &RuleSet, installed: Option<&RuleSet>) -> Result<(), FirewallError> {
        match self {
            Backend::Nftables => {
                let update = installed.and_then(|old| nft::render_update(old, set));
                match update {
                    Some(script) if !nft::has_statements(&script) => {}
                    Some(script) => {
                        tracing::info!("Only map elements differ: changing them in place");
                        if let Err(e) = run("nft", &["-f", "-"], Some(&script)) {
                            tracing::warn!(
                                error = %e,
                                "Changing map elements failed; replacing the whole table"
                            );
                            run("nft", &["-f", "-"], Some(&nft::render(set)))?;
                        }
                    }
                    None => {
                        run("nft", &["-f", "-"], Some(&nft::render(set)))?;
                    }
                }
                Ok(())
            }
            Backend::Iptables { legacy } => {
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    let save = run(save_bin(family, *legacy), &[], None)?;
                    let jumps = iptables::parse_jumps(&set.tunnel, &save);
                    let text = iptables::render(set, family, &jumps);
                    run(restore_bin(family, *legacy), &["--noflush"], Some(&text))?;
                }
                Ok(())
            }
        }
    }

    /// What the daemon for interface `tunnel` has installed now, normalized (empty when
    /// nothing is). Other tables and chains, another daemon's included, are not part of it.
    pub fn installed(&self, tunnel: &str) -> Result<String, FirewallError> {
        match self {
            Backend::Nftables => match run(
                "nft",
                &["list", "table", "inet", &crate::rules::nft_table(tunnel)],
                None,
            ) {
                Ok(listing) => Ok(nft::normalize_listing(&listing)),
                Err(FirewallError::Failed { .. }) => Ok(String::new()),
                Err(e) => Err(e),
            },
            Backend::Iptables { legacy } => {
                let mut out = String::new();
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    out.push_str(&iptables::owned_lines(
                        tunnel,
                        &run(save_bin(family, *legacy), &[], None)?,
                    ));
                }
                Ok(out)
            }
        }
    }

    /// Removes every rule and chain of the daemon for interface `tunnel`; leaves everything
    /// else alone, another daemon's table or chains included.
    pub fn remove(&self, tunnel: &str) -> Result<(), FirewallError> {
        match self {
            Backend::Nftables => {
                run("nft", &["-f", "-"], Some(&nft::render_delete(tunnel))).map(|_| ())
            }
            Backend::Iptables { legacy } => {
                for family in [Family::V4, Family::V6] {
                    if family == Family::V6 && !ipv6_enabled() {
                        continue;
                    }
                    let save = run(save_bin(family, *legacy), &[], None)?;
                    let jumps = iptables::parse_jumps(tunnel, &save);
                    run(
                        restore_bin(family, *legacy),
                        &["--noflush"],
                        Some(&iptables::render_delete(tunnel, &jumps, family)),
                    )?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_iptables_flavour_variable_names_what_it_cannot_use() {
        use std::os::unix::ffi::OsStrExt as _;
        let os = |b: &[u8]| std::ffi::OsStr::from_bytes(b).to_owned();
        assert_eq!(iptables_flavour(None), Ok(None));
        assert_eq!(iptables_flavour(Some(&os(b""))), Ok(None));
        assert_eq!(iptables_flavour(Some(&os(b"legacy"))), Ok(Some(true)));
        assert_eq!(iptables_flavour(Some(&os(b"nft"))), Ok(Some(false)));
        let err = iptables_flavour(Some(&os(b"legcy"))).expect_err("typo");
        assert!(err.contains("TUNNELGATE_IPTABLES=\"legcy\""), "{err}");
        let err = iptables_flavour(Some(&os(b"leg\xffacy"))).expect_err("not UTF-8");
        assert!(err.contains("expected \"legacy\" or \"nft\""), "{err}");
        // A huge value is shortened, not echoed whole into the log.
        let err = iptables_flavour(Some(&os(&[b'x'; 1 << 20]))).expect_err("huge");
        assert!(err.len() < 120, "{} bytes", err.len());
    }
}
