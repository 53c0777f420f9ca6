//! What `tunnelgate check` prints: the routes, policy rules, sysctls and firewall rules a
//! configuration would install. Pure: the same functions the daemon applies from.

use crate::config::Config;
use crate::routes;
use std::fmt::Write;

/// `firewall` is the rendered rule text for the chosen backend (None: no rules needed).
pub fn render_plan(config: &Config, firewall: Option<(&str, &str)>) -> String {
    let mut out = String::new();
    let iface = &config.interface;
    let _ = writeln!(
        out,
        "# interface {} (mtu {}), public key {}",
        iface.name,
        iface.mtu,
        iface.private_key.public_key()
    );
    for a in &iface.addresses {
        let _ = writeln!(out, "ip address add {a} dev {}", iface.name);
    }
    let nets: Vec<_> = config
        .peers
        .iter()
        .flat_map(|p| p.allowed_ips.iter().copied())
        .collect();
    let plan = routes::plan(&nets, iface.fwmark);
    let _ = writeln!(out, "\n# routes");
    for r in &plan.routes {
        let table = if r.table == routes::MAIN_TABLE {
            String::new()
        } else {
            format!(" table {}", r.table)
        };
        let _ = writeln!(out, "ip route add {} dev {}{table}", r.net, iface.name);
    }
    for r in &plan.rules {
        let fam = if r.v6 { "-6" } else { "-4" };
        let _ = match r.kind {
            routes::RuleKind::SuppressDefault => writeln!(
                out,
                "ip {fam} rule add pref {} table main suppress_prefixlength 0",
                r.priority
            ),
            routes::RuleKind::NotFwmark(m) => writeln!(
                out,
                "ip {fam} rule add pref {} not fwmark {m:#x} table {}",
                r.priority, r.table
            ),
        };
    }
    let _ = writeln!(out, "\n# sysctls");
    let mut families = std::collections::BTreeSet::new();
    for f in config.ingress.iter().chain(&config.egress) {
        match &f.target {
            crate::config::Target::Ip(ip) => {
                families.insert(if ip.is_ipv6() { 6 } else { 4 });
            }
            crate::config::Target::Fqdn(_) => {
                families.extend(config.interface.addresses.iter().map(|a| {
                    if a.addr().is_ipv6() {
                        6
                    } else {
                        4
                    }
                }));
            }
        }
    }
    families.extend(config.router.advertise_routes.iter().map(|n| {
        if n.addr().is_ipv6() {
            6
        } else {
            4
        }
    }));
    if config.router.exit_node {
        families.extend([4, 6]);
    }
    for f in families {
        let key = if f == 4 {
            "net.ipv4.ip_forward"
        } else {
            "net.ipv6.conf.all.forwarding"
        };
        let _ = writeln!(out, "{key} = 1   (only if not already on)");
    }
    if plan.rules.iter().any(|r| !r.v6) {
        let _ = writeln!(out, "net.ipv4.conf.all.src_valid_mark = 1");
    }
    let names = config.fqdn_targets();
    if !names.is_empty() {
        let _ = writeln!(
            out,
            "\n# resolved at run time (rules for them appear once resolved): {}",
            names.join(", ")
        );
    }
    match firewall {
        Some((backend, text)) => {
            let _ = writeln!(out, "\n# firewall ({backend}), applied in one transaction");
            out.push_str(text);
        }
        None => {
            let _ = writeln!(out, "\n# firewall: none (nothing is forwarded)");
        }
    }
    if !config.peers.is_empty() {
        client_side(config, &mut out);
    }
    out
}

/// The `[Peer]` section a peer's wg-quick config needs for this host: the public key, the
/// endpoint peers reach it at (`interface.public_endpoint`, e.g. a group's load balancer; said
/// as a comment when the config does not know it) and what to route here; then each peer's own
/// addresses, for its `[Interface] Address`.
fn client_side(config: &Config, out: &mut String) {
    let iface = &config.interface;
    let _ = writeln!(
        out,
        "\n# client side: the [Peer] section for this host in each peer's wg-quick config"
    );
    let _ = writeln!(out, "[Peer]");
    let _ = writeln!(out, "PublicKey = {}", iface.private_key.public_key());
    let _ = match (&iface.public_endpoint, iface.listen_port) {
        (Some(endpoint), _) => writeln!(out, "Endpoint = {endpoint}"),
        (None, 0) => writeln!(
            out,
            "# Endpoint: none to give (interface.listen_port is chosen at random); set interface.public_endpoint"
        ),
        (None, port) => writeln!(
            out,
            "# Endpoint = <this host's address>:{port} (interface.public_endpoint prints it here)"
        ),
    };
    let allowed: Vec<String> = client_allowed_ips(config)
        .iter()
        .map(ToString::to_string)
        .collect();
    let _ = writeln!(out, "AllowedIPs = {}", allowed.join(", "));
    let _ = writeln!(
        out,
        "# each peer's own addresses (its [Interface] Address), as its allowed_ips here:"
    );
    for (i, peer) in config.peers.iter().enumerate() {
        let here: Vec<String> = peer.allowed_ips.iter().map(ToString::to_string).collect();
        let _ = writeln!(out, "# peer[{i}] {}: {}", peer.public_key, here.join(", "));
    }
}

/// What a peer must route through the tunnel to this host: every address and network this
/// host serves. An exit node serves everything (0.0.0.0/0, ::/0); otherwise the tunnel
/// addresses (as /32 and /128) and the advertised routes (subnet router).
pub fn client_allowed_ips(config: &Config) -> Vec<crate::config::IpNet> {
    use crate::config::IpNet;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    if config.router.exit_node {
        return vec![
            IpNet::new_assert(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            IpNet::new_assert(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
        ];
    }
    let mut out: Vec<IpNet> = Vec::new();
    let own = config
        .interface
        .addresses
        .iter()
        .map(|a| IpNet::from(a.addr()));
    for net in own.chain(config.router.advertise_routes.iter().copied()) {
        if !out.contains(&net) {
            out.push(net);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{decode_key, SecretFiles};
    use std::path::Path;

    struct NoFiles;
    impl SecretFiles for NoFiles {
        fn read_secret(&self, path: &Path) -> Result<String, String> {
            Err(format!("no file {}", path.display()))
        }
    }

    const KEY: &str = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
    const PEER: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

    fn client_side_of(interface_extra: &str) -> String {
        let text = format!(
            "[interface]\nprivate_key = \"{KEY}\"\naddresses = [\"100.64.1.1/32\"]\n{interface_extra}\n\
             [[peer]]\npublic_key = \"{PEER}\"\nallowed_ips = [\"100.64.0.2/32\"]\n"
        );
        let config = Config::parse(&text, Path::new("/etc/tg"), &NoFiles).expect("valid");
        let plan = render_plan(&config, None);
        let (_, section) = plan
            .split_once("# client side: ")
            .unwrap_or_else(|| panic!("no client side in:\n{plan}"));
        section.to_string()
    }

    /// The section a peer pastes: this host's key, the endpoint the config names (a group's
    /// balancer), what to route here, then each peer's own addresses as comments.
    #[test]
    fn the_client_side_names_the_public_endpoint_and_this_hosts_key() {
        let own = crate::config::SecretKey(decode_key(KEY).expect("key")).public_key();
        let section =
            client_side_of("listen_port = 51820\npublic_endpoint = \"[2001:db8::10]:51820\"");
        let lines: Vec<&str> = section.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                "[Peer]".to_string(),
                format!("PublicKey = {own}"),
                "Endpoint = [2001:db8::10]:51820".to_string(),
                "AllowedIPs = 100.64.1.1/32".to_string(),
                "# each peer's own addresses (its [Interface] Address), as its allowed_ips here:"
                    .to_string(),
                format!("# peer[0] {PEER}: 100.64.0.2/32"),
            ]
        );
    }

    /// Without `public_endpoint` no Endpoint line a peer could paste: a comment says how to
    /// get one (with a fixed port) or why there is none (a random port).
    #[test]
    fn without_a_public_endpoint_the_endpoint_is_only_a_comment() {
        let fixed = client_side_of("listen_port = 51820");
        assert!(!fixed.contains("\nEndpoint ="), "{fixed}");
        assert!(
            fixed.contains("# Endpoint = <this host's address>:51820 (interface.public_endpoint"),
            "{fixed}"
        );
        let random = client_side_of("");
        assert!(!random.contains("\nEndpoint ="), "{random}");
        assert!(random.contains("chosen at random"), "{random}");
    }
}
