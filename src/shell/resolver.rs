//! The one resolver of the daemon, for `target_fqdn` names and peer endpoints alike: hickory
//! (A and AAAA), with no cache so every scheduled lookup asks the name server, and the deadline
//! the control core gives each lookup so a dead server cannot stall anything.
//!
//! Without `dns.nameservers` it resolves like the system's getaddrinfo: `/etc/hosts` first,
//! then resolv.conf's name servers with its `search` domains and `ndots` (so `db.prod.svc`
//! resolves inside a Kubernetes pod). With explicit `dns.nameservers` every name is absolute
//! and the hosts file is not read. The resolv.conf path can be moved with
//! [`RESOLV_CONF_ENV`], for tests that cannot touch the host's file.

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
    ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::shell::clock;

/// Overrides `/etc/resolv.conf` (tests; documented in docs/operations.md).
pub const RESOLV_CONF_ENV: &str = crate::shell::tuning::RESOLV_CONF;

pub struct Resolver {
    inner: TokioResolver,
    /// Names are looked up as given, fully qualified (explicit name servers).
    absolute: bool,
}

/// What a lookup asks the resolver for: `name.` when names are absolute, else `name` as the
/// user wrote it, for the search list and ndots to apply.
pub fn query_name(name: &str, absolute: bool) -> String {
    if absolute && !name.ends_with('.') {
        format!("{name}.")
    } else {
        name.to_string()
    }
}

impl Resolver {
    /// Uses `nameservers`, or the system's resolv.conf when empty. hickory's default config
    /// has no servers at all, so one of the two is always given explicitly.
    pub fn new(nameservers: &[SocketAddr]) -> Result<Resolver, String> {
        let absolute = !nameservers.is_empty();
        let (config, mut opts) = if nameservers.is_empty() {
            let path =
                crate::shell::tuning::resolv_conf().unwrap_or_else(|| "/etc/resolv.conf".into());
            let text =
                std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            hickory_resolver::system_conf::parse_resolv_conf(text)
                .map_err(|e| format!("cannot use {}: {e}", path.display()))?
        } else {
            let servers = nameservers
                .iter()
                .map(|s| {
                    let mut udp = ConnectionConfig::udp();
                    udp.port = s.port();
                    let mut tcp = ConnectionConfig::tcp();
                    tcp.port = s.port();
                    NameServerConfig::new(s.ip(), true, vec![udp, tcp])
                })
                .collect();
            (
                ResolverConfig::from_name_servers(servers),
                ResolverOpts::default(),
            )
        };
        opts.cache_size = 0;
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        opts.timeout = Duration::from_secs(2);
        opts.attempts = 2;
        opts.use_hosts_file = if absolute {
            ResolveHosts::Never
        } else {
            ResolveHosts::Always
        };
        let resolver = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
            .with_options(opts)
            .build()
            .map_err(|e| format!("cannot build the resolver: {e}"))?;
        Ok(Resolver {
            inner: resolver,
            absolute,
        })
    }

    /// Every A and AAAA address of `name` (see the module doc for search domains), or an
    /// error once `deadline` passes.
    pub async fn resolve(&self, name: &str, deadline: Instant) -> Result<Vec<IpAddr>, String> {
        let query = query_name(name, self.absolute);
        let started = clock::now();
        match tokio::time::timeout_at(deadline.into(), self.inner.lookup_ip(query.as_str())).await {
            Ok(Ok(lookup)) => Ok(lookup.iter().collect()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "timed out after {:.1}s",
                clock::since(started).as_secs_f64()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_absolute_only_with_explicit_servers() {
        assert_eq!(
            query_name("db.example.internal", true),
            "db.example.internal."
        );
        assert_eq!(
            query_name("db.example.internal.", true),
            "db.example.internal."
        );
        assert_eq!(query_name("db.prod.svc", false), "db.prod.svc");
        assert_eq!(query_name("db.", false), "db.");
    }
}
