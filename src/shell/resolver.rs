//! The one resolver of the daemon, for `target_fqdn` names and peer endpoints alike: hickory
//! (A and AAAA), with no cache so every scheduled lookup asks the name server, and the deadline
//! the control core gives each lookup so a dead server cannot stall anything.

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
    ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

pub struct Resolver(TokioResolver);

impl Resolver {
    /// Uses `nameservers`, or the system's resolv.conf when empty. hickory's default config
    /// has no servers at all, so one of the two is always given explicitly.
    pub fn new(nameservers: &[SocketAddr]) -> Result<Resolver, String> {
        let (config, mut opts) = if nameservers.is_empty() {
            hickory_resolver::system_conf::read_system_conf()
                .map_err(|e| format!("cannot read /etc/resolv.conf: {e}"))?
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
        opts.use_hosts_file = ResolveHosts::Never;
        let resolver = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
            .with_options(opts)
            .build()
            .map_err(|e| format!("cannot build the resolver: {e}"))?;
        Ok(Resolver(resolver))
    }

    /// Every A and AAAA address of `name` (fully qualified: no search domains), or an error
    /// once `deadline` passes.
    pub async fn resolve(&self, name: &str, deadline: Instant) -> Result<Vec<IpAddr>, String> {
        let fqdn = format!("{name}.");
        let started = Instant::now();
        match tokio::time::timeout_at(deadline.into(), self.0.lookup_ip(fqdn.as_str())).await {
            Ok(Ok(lookup)) => Ok(lookup.iter().collect()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "timed out after {:.1}s",
                started.elapsed().as_secs_f64()
            )),
        }
    }
}
