//! Subnet router and exit node (`[router]`, issue 5) end to end, and what `tunnelgate check`
//! says about them.
//!
//! Topology (every part in its own network namespace):
//!
//! ```text
//!  client (wireguard-go)  --veth 192.168.81.0/24--  router (tunnelgate)  --veth 10.40.0.0/24, fd40::/64--  lan   (10.40.0.10, fd40::10)
//!  tunnel 100.81.0.2,                               tunnel 100.81.0.1,    --veth 10.41.0.0/24, fd41::/64--  other (10.41.0.10, fd41::10; never advertised)
//!         fd81::2                                          fd81::1        --veth 198.51.100.0/24,
//!                                                                            2001:db8:ff::/64 (default route)-- inet (203.0.113.10, 2001:db8:1::10)
//! ```
//!
//! Every host behind the router runs a whoami server on port 7000 that answers with the source
//! address it saw. The client routes every test network into the tunnel, so whatever is not
//! reached was refused by the router, not by the client.
//!
//! Run as root: `cargo test --test netns_router -- --ignored --test-threads=1`. The `check_*`
//! tests need no root.

mod common;

use common::*;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

const PORT: u16 = 7000;
const LAN_V4: &str = "10.40.0.10";
const LAN_V6: &str = "fd40::10";
const OTHER_V4: &str = "10.41.0.10";
const OTHER_V6: &str = "fd41::10";
const INET_V4: &str = "203.0.113.10";
const INET_V6: &str = "2001:db8:1::10";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

struct Lab {
    client: Netns,
    router: Netns,
    lan: Netns,
    /// Kept alive: the unadvertised network.
    _other: Netns,
    inet: Netns,
    wg: WgGo,
    lan_server: TcpWhoami,
    other_server: TcpWhoami,
    inet_server: TcpWhoami,
}

impl Lab {
    fn new() -> Lab {
        let client = Netns::new();
        let router = Netns::new();
        let lan = Netns::new();
        let other = Netns::new();
        let inet = Netns::new();
        veth(&router, &["192.168.81.1/24"], &client, &["192.168.81.2/24"]);
        veth(
            &router,
            &["10.40.0.1/24", "fd40::1/64"],
            &lan,
            &["10.40.0.10/24", "fd40::10/64"],
        );
        veth(
            &router,
            &["10.41.0.1/24", "fd41::1/64"],
            &other,
            &["10.41.0.10/24", "fd41::10/64"],
        );
        // The unadvertised network knows the way back: only the router can refuse.
        other.exec(&["ip", "route", "add", "100.81.0.0/24", "via", "10.41.0.1"]);
        other.exec(&["ip", "-6", "route", "add", "fd81::/64", "via", "fd41::1"]);
        veth(
            &router,
            &["198.51.100.2/24", "2001:db8:ff::2/64"],
            &inet,
            &["198.51.100.1/24", "2001:db8:ff::1/64"],
        );
        inet.exec(&["ip", "addr", "add", "203.0.113.10/32", "dev", "lo"]);
        inet.exec(&["ip", "-6", "addr", "add", "2001:db8:1::10/128", "dev", "lo"]);
        router.exec(&["ip", "route", "add", "default", "via", "198.51.100.1"]);
        router.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "2001:db8:ff::1",
        ]);
        let any = SocketAddr::new(ip("::"), PORT);
        let lan_server = TcpWhoami::start(&lan, any);
        let other_server = TcpWhoami::start(&other, any);
        let inet_server = TcpWhoami::start(&inet, any);
        let wg = WgGo::start(&client, 0, &["100.81.0.2/32", "fd81::2/128"]);
        // Sanity: the router itself reaches every network (its own traffic is not filtered).
        for a in [LAN_V4, LAN_V6, OTHER_V4, OTHER_V6, INET_V4, INET_V6] {
            assert!(
                ping_until(&router, a, Duration::from_secs(5)),
                "router cannot reach {a}"
            );
        }
        Lab {
            client,
            router,
            lan,
            _other: other,
            inet,
            wg,
            lan_server,
            other_server,
            inet_server,
        }
    }

    /// The router's config with `router` as the `[router]` section body.
    fn config(&self, router: &str) -> TgConfig {
        let mut cfg = TgConfig::new(51820, &["100.81.0.1/32", "fd81::1/128"]).peer(Peer::new(
            self.wg.public_key(),
            &["100.81.0.2/32", "fd81::2/128"],
        ));
        cfg.extra = format!("[router]\n{router}\n");
        cfg
    }

    /// Points the client at the router, routing `allowed` (CIDRs; /0 gets a default route)
    /// through the tunnel, and waits for the handshake.
    fn connect(&self, tg: &Tunnelgate, allowed: &[&str]) {
        self.wg.add_peer(
            &Peer::new(tg.public_key(), allowed)
                .endpoint("192.168.81.1:51820")
                .keepalive(1),
        );
        for net in allowed.iter().filter(|n| n.ends_with("/0")) {
            let fam = if net.contains(':') { "-6" } else { "-4" };
            self.client
                .exec(&["ip", fam, "route", "add", "default", "dev", self.wg.name()]);
        }
        wait_handshake(self.wg.name(), tg.public_key(), Duration::from_secs(10));
    }

    /// The source address the whoami server at `to` saw for one new connection from the client.
    fn seen_from_client(&self, to: &str) -> Result<IpAddr, String> {
        whoami(
            &self.client,
            SocketAddr::new(ip(to), PORT),
            Duration::from_secs(3),
        )
        .map(|(_, peer)| peer.ip())
    }

    /// Asserts that the client reaches neither address of the unadvertised network.
    fn assert_other_unreachable(&self) {
        for a in [OTHER_V4, OTHER_V6] {
            assert!(!ping(&self.client, a), "client pinged unadvertised {a}");
            let r = self.seen_from_client(a);
            assert!(r.is_err(), "client reached unadvertised {a}: {r:?}");
        }
        assert!(
            self.other_server.seen().is_empty(),
            "the unadvertised host saw connections: {:?}",
            self.other_server.seen()
        );
    }
}

/// Every test network, routed into the tunnel by the client.
const ALL_TEST_NETS: [&str; 8] = [
    "100.81.0.1/32",
    "fd81::1/128",
    "10.40.0.0/24",
    "fd40::/64",
    "10.41.0.0/24",
    "fd41::/64",
    "203.0.113.0/24",
    "2001:db8:1::/64",
];

#[test]
#[ignore = "needs root"]
fn subnet_router_with_snat_reaches_the_lan_as_the_router() {
    let lab = Lab::new();
    let tg = Tunnelgate::start(
        &lab.router,
        lab.config("advertise_routes = [\"10.40.0.0/24\", \"fd40::/64\"]"),
    );
    lab.connect(&tg, &ALL_TEST_NETS);
    assert!(ping_until(&lab.client, LAN_V4, Duration::from_secs(5)));
    assert!(ping_until(&lab.client, LAN_V6, Duration::from_secs(5)));
    // The LAN has no route to the tunnel: masquerading is what makes replies come back.
    assert_eq!(lab.seen_from_client(LAN_V4), Ok(ip("10.40.0.1")));
    assert_eq!(lab.seen_from_client(LAN_V6), Ok(ip("fd40::1")));
    assert_eq!(lab.lan_server.seen().len(), 2);
    // (b) not advertised: refused by the router.
    lab.assert_other_unreachable();
    // Not an exit node: the internet is refused too.
    assert!(lab.seen_from_client(INET_V4).is_err());
    assert!(lab.seen_from_client(INET_V6).is_err());
    assert!(lab.inet_server.seen().is_empty());
    // Forwarding was turned on for both families, by the daemon.
    assert_eq!(lab.router.sysctl_get("net.ipv4.ip_forward"), "1");
    assert_eq!(lab.router.sysctl_get("net.ipv6.conf.all.forwarding"), "1");
    let _ = (&lab.lan, &lab.inet);
}

#[test]
#[ignore = "needs root"]
fn subnet_router_without_snat_shows_the_client_address() {
    let lab = Lab::new();
    lab.lan
        .exec(&["ip", "route", "add", "100.81.0.0/24", "via", "10.40.0.1"]);
    lab.lan
        .exec(&["ip", "-6", "route", "add", "fd81::/64", "via", "fd40::1"]);
    let tg = Tunnelgate::start(
        &lab.router,
        lab.config("advertise_routes = [\"10.40.0.0/24\", \"fd40::/64\"]\nsnat = false"),
    );
    lab.connect(&tg, &ALL_TEST_NETS);
    assert!(ping_until(&lab.client, LAN_V4, Duration::from_secs(5)));
    assert!(ping_until(&lab.client, LAN_V6, Duration::from_secs(5)));
    assert_eq!(lab.seen_from_client(LAN_V4), Ok(ip("100.81.0.2")));
    assert_eq!(lab.seen_from_client(LAN_V6), Ok(ip("fd81::2")));
    lab.assert_other_unreachable();
    let table = lab.router.nft_tunnelgate_table();
    assert!(!table.contains("masquerade"), "{table}");
}

#[test]
#[ignore = "needs root"]
fn exit_node_carries_the_default_route_to_the_internet() {
    let lab = Lab::new();
    let tg = Tunnelgate::start(&lab.router, lab.config("exit_node = true"));
    lab.connect(&tg, &["100.81.0.1/32", "fd81::1/128", "0.0.0.0/0", "::/0"]);
    // The client's default routes go through the tunnel (the endpoint stays on the link).
    let routes = lab.client.routes();
    assert!(
        routes.contains(&format!("default dev {}", lab.wg.name())),
        "{routes}"
    );
    assert!(ping_until(&lab.client, INET_V4, Duration::from_secs(5)));
    assert!(ping_until(&lab.client, INET_V6, Duration::from_secs(5)));
    // The internet host has no route to the tunnel: it sees the router's upstream address.
    assert_eq!(lab.seen_from_client(INET_V4), Ok(ip("198.51.100.2")));
    assert_eq!(lab.seen_from_client(INET_V6), Ok(ip("2001:db8:ff::2")));
    assert_eq!(lab.inet_server.seen().len(), 2);
    // A bulk transfer through the default route arrives intact.
    let stats = tcp_transfer(
        &lab.client,
        &lab.inet,
        ip(INET_V4),
        0,
        4 * 1024 * 1024,
        Duration::from_secs(30),
    )
    .expect("transfer to the internet host");
    assert_eq!(stats.bytes, 4 * 1024 * 1024);
}

/// `exit_node_lan = false`: the exit node still carries the internet and its advertised LAN,
/// but no other private network behind it. A reload back to the default opens them: the
/// refused connections were real ones.
#[test]
#[ignore = "needs root"]
fn exit_node_kept_off_the_private_networks_it_does_not_advertise() {
    let lab = Lab::new();
    let mut tg = Tunnelgate::start(
        &lab.router,
        lab.config(
            "exit_node = true\nexit_node_lan = false\nadvertise_routes = [\"10.40.0.0/24\", \"fd40::/64\"]",
        ),
    );
    lab.connect(&tg, &["100.81.0.1/32", "fd81::1/128", "0.0.0.0/0", "::/0"]);
    assert!(ping_until(&lab.client, INET_V4, Duration::from_secs(5)));
    assert_eq!(lab.seen_from_client(INET_V4), Ok(ip("198.51.100.2")));
    assert_eq!(lab.seen_from_client(INET_V6), Ok(ip("2001:db8:ff::2")));
    assert_eq!(lab.seen_from_client(LAN_V4), Ok(ip("10.40.0.1")));
    assert_eq!(lab.seen_from_client(LAN_V6), Ok(ip("fd40::1")));
    lab.assert_other_unreachable();

    let mut cfg = tg.cfg.clone();
    cfg.extra = "[router]\nexit_node = true\n".into();
    tg.write_config(cfg);
    tg.sighup();
    let opened = poll_until(Duration::from_secs(10), || {
        lab.seen_from_client(OTHER_V4).is_ok()
    });
    assert!(opened, "the default exit node reaches {OTHER_V4}");
    assert_eq!(lab.seen_from_client(OTHER_V6), Ok(ip("fd41::1")));
}

#[test]
#[ignore = "needs root"]
fn exit_node_without_snat_warns_at_start() {
    let ns = Netns::new();
    let cfg = TgConfig::new(51820, &["100.81.0.1/32"]);
    let mut cfg = cfg.peer(Peer::new(&Keypair::generate().public, &["100.81.0.2/32"]));
    cfg.extra = "[router]\nexit_node = true\nsnat = false\n".into();
    let mut tg = Tunnelgate::start(&ns, cfg);
    let stderr = tg.stderr();
    assert!(
        stderr.contains("router.snat") && stderr.contains("exit_node"),
        "no warning at start:\n{stderr}"
    );
    assert!(tg.sigterm().success());
}

// ---------------------------------------------------------------------------------------------
// tunnelgate check: client side AllowedIPs, warnings, bad input (no root needed)
// ---------------------------------------------------------------------------------------------

/// Real-looking keys: keys with every byte the same are warned about as placeholders.
const PEER_A: &str = "CAUmPlG1riVwD8jHdCMMTdDgMvOKE9pSjJ32IWZ8Clc=";
const PEER_B: &str = "E9wSGc7zAKeERRadtLAUf7lveHG76oKtTaLQEEiNVAs=";

/// `tunnelgate check` of a config with two peers and the given `[router]` body.
fn check_router(router: &str) -> CmdOutput {
    let dir = TempDir::new("check-router");
    let key = tunnelgate_cli(&["genkey"], None).stdout;
    dir.write_secret("private.key", &key);
    let cfg = format!(
        "[interface]\nname = \"tg0\"\nprivate_key_file = \"private.key\"\n\
         addresses = [\"100.81.0.1/24\", \"fd81::1/64\"]\n\n\
         [[peer]]\npublic_key = \"{PEER_A}\"\nallowed_ips = [\"100.81.0.2/32\", \"fd81::2/128\"]\n\n\
         [[peer]]\npublic_key = \"{PEER_B}\"\nallowed_ips = [\"100.81.0.3/32\"]\n\n\
         [firewall]\nmode = \"nftables\"\n\n[router]\n{router}\n"
    );
    let path = dir.write("tunnelgate.toml", &cfg);
    tunnelgate_cli(&["check", "--config", &path.display().to_string()], None)
}

/// The client side of `tunnelgate check`: the `AllowedIPs` of the one `[Peer]` section, and
/// the comment line naming each peer, in order.
fn client_allowed_ips(out: &str) -> (String, Vec<String>) {
    let section = out
        .split_once("# client side: the [Peer] section for this host")
        .map(|(_, rest)| rest)
        .unwrap_or_else(|| panic!("no client side section in:\n{out}"));
    let allowed = section
        .lines()
        .find_map(|l| l.strip_prefix("AllowedIPs = "))
        .unwrap_or_else(|| panic!("no AllowedIPs line in:\n{section}"))
        .to_string();
    let peers = section
        .lines()
        .filter(|l| l.starts_with("# peer["))
        .map(str::to_string)
        .collect();
    (allowed, peers)
}

#[test]
fn check_prints_client_allowed_ips_for_a_subnet_router() {
    let out = check_router("advertise_routes = [\"10.40.0.0/24\", \"fd40::/64\"]");
    assert!(out.success(), "{}", out.stderr);
    let (allowed, peers) = client_allowed_ips(&out.stdout);
    assert_eq!(
        peers,
        [
            format!("# peer[0] {PEER_A}: 100.81.0.2/32, fd81::2/128"),
            format!("# peer[1] {PEER_B}: 100.81.0.3/32")
        ],
        "{}",
        out.stdout
    );
    assert_eq!(
        allowed,
        "100.81.0.1/32, fd81::1/128, 10.40.0.0/24, fd40::/64"
    );
    assert!(out.stdout.contains("net.ipv4.ip_forward = 1"));
    assert!(out.stdout.contains("net.ipv6.conf.all.forwarding = 1"));
    assert!(!out.stderr.contains("warning"), "{}", out.stderr);
}

#[test]
fn check_prints_default_routes_for_an_exit_node() {
    let out = check_router("exit_node = true");
    assert!(out.success(), "{}", out.stderr);
    let (allowed, peers) = client_allowed_ips(&out.stdout);
    assert_eq!(peers.len(), 2, "{}", out.stdout);
    assert_eq!(allowed, "0.0.0.0/0, ::/0");
    assert!(!out.stderr.contains("warning"), "{}", out.stderr);
}

#[test]
fn check_warns_about_an_exit_node_without_snat() {
    let out = check_router("exit_node = true\nsnat = false");
    assert!(out.success(), "a warning, not an error: {}", out.stderr);
    assert!(
        out.stderr.contains("warning") && out.stderr.contains("router.snat"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.contains("# firewall (nftables)"), "plan printed");
}

#[test]
fn check_rejects_a_route_over_a_tunnel_address_and_a_host_cidr() {
    let out = check_router("advertise_routes = [\"100.81.0.0/16\"]");
    assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("router.advertise_routes[0]")
            && out.stderr.contains("100.81.0.0/16")
            && out.stderr.contains("tunnel address"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "nothing planned: {}", out.stdout);

    let out = check_router("advertise_routes = [\"10.40.0.0/24\", \"10.0.0.1/8\"]");
    assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("router.advertise_routes[1]")
            && out.stderr.contains("10.0.0.1/8")
            && out.stderr.contains("10.0.0.0/8"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "nothing planned: {}", out.stdout);
}
