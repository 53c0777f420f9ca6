//! Several tunnelgates in ONE network namespace (issue 14), once per firewall backend: two
//! daemons with different interfaces, tunnel subnets and wireguard-go peers each serve their own
//! ingress at the same time, each owns exactly its own table or chains (no drift-repair fight:
//! neither apply counter moves over several repair intervals), stopping either one leaves the
//! other's rules, ingress and `net.ipv4.ip_forward = 1` alone, and the last one to stop puts
//! forwarding back to 0. A daemon killed with -9, restarted and stopped puts it back too.
//!
//! ```text
//!  client ──veth 192.168.70.0/24── proxy ──veth 10.96.0.0/24── cluster
//!  wireguard-go A 100.64.10.2      tunnelgate A 100.64.10.1:80 -> 10.96.0.10:80   echo .10
//!  wireguard-go B 100.64.20.2      tunnelgate B 100.64.20.1:80 -> 10.96.0.11:80   echo .11
//! ```
//!
//! Run as root: `cargo test --all-features --test netns_instances -- --ignored --test-threads=1`

mod common;

use common::*;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

const CLIENT_UNDERLAY: &str = "192.168.70.1";
const PROXY_UNDERLAY: &str = "192.168.70.2";
const PROXY_CLUSTER: &str = "10.96.0.1";
const IP_FORWARD: &str = "net.ipv4.ip_forward";
const V6_FORWARD: &str = "net.ipv6.conf.all.forwarding";
/// Short, so a fight between two daemons would show within a few seconds.
const REPAIR_INTERVAL: &str = "1s";

/// The `[firewall]` section selecting `backend`, with a short repair interval.
fn firewall_toml(backend: Backend) -> String {
    format!(
        "[firewall]\nmode = \"{}\"\nrepair_interval = \"{REPAIR_INTERVAL}\"\n",
        backend.mode()
    )
}

per_backend!(
    two_daemons_share_one_namespace,
    kill9_restart_stop_restores_forwarding
);

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

/// One side: a tunnelgate, its wireguard-go peer on the client, its ingress target.
struct Side {
    cfg: TgConfig,
    wg: WgGo,
    tunnel_ip: &'static str,
    target: &'static str,
    tg_port: u16,
}

struct Lab {
    backend: Backend,
    client: Netns,
    proxy: Netns,
    _cluster: Netns,
    a: Side,
    b: Side,
    echo_a: TcpEcho,
    echo_b: TcpEcho,
}

impl Lab {
    fn new(backend: Backend) -> Lab {
        let Lab3 {
            client,
            proxy,
            cluster,
        } = Lab3::new(
            &[&format!("{CLIENT_UNDERLAY}/24")],
            &[&format!("{PROXY_UNDERLAY}/24")],
            &[&format!("{PROXY_CLUSTER}/24")],
            &["10.96.0.10/24", "10.96.0.11/24"],
        );
        assert_eq!(proxy.sysctl_get(IP_FORWARD), "0", "a fresh namespace");
        let echo_a = TcpEcho::start(&cluster, sa("10.96.0.10", 80));
        let echo_b = TcpEcho::start(&cluster, sa("10.96.0.11", 80));
        let side = |n: u8, target: &'static str, tunnel_ip: &'static str, health: u16| {
            let (tg_port, wg_port) = (51820 + u16::from(n) * 10, 51821 + u16::from(n) * 10);
            let peer_ip = format!("100.64.{}.2/32", 10 * (n + 1));
            let wg = WgGo::start(&client, wg_port, &[&peer_ip]);
            let mut cfg = TgConfig::new(tg_port, &[&format!("{tunnel_ip}/32")]).peer(
                Peer::new(wg.public_key(), &[&peer_ip])
                    .endpoint(&format!("{CLIENT_UNDERLAY}:{wg_port}")),
            );
            cfg.health = Some(format!("127.0.0.1:{health}"));
            cfg.extra = format!(
                "{}\n[[ingress]]\ntarget = \"{target}\"\nports = [\"80\"]\n",
                firewall_toml(backend)
            );
            Side {
                cfg,
                wg,
                tunnel_ip,
                target,
                tg_port,
            }
        };
        let a = side(0, "10.96.0.10", "100.64.10.1", 9002);
        let b = side(1, "10.96.0.11", "100.64.20.1", 9003);
        Lab {
            backend,
            client,
            proxy,
            _cluster: cluster,
            a,
            b,
            echo_a,
            echo_b,
        }
    }

    /// Starts the daemon of `side`, waits for `/readyz` 200 and a ping through its tunnel.
    fn start(&self, side: &Side) -> Tunnelgate {
        let tg = Tunnelgate::spawn_env(&self.proxy, side.cfg.clone(), &self.backend.env());
        if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
            panic!("{e}");
        }
        side.wg.add_peer(
            &Peer::new(tg.public_key(), &[&format!("{}/32", side.tunnel_ip)])
                .endpoint(&format!("{PROXY_UNDERLAY}:{}", side.tg_port)),
        );
        assert!(
            ping_until(&self.client, side.tunnel_ip, Duration::from_secs(20)),
            "no ping through the tunnel to {}; tunnelgate stderr:\n{}",
            side.tunnel_ip,
            tg.stderr()
        );
        tg
    }

    /// A TCP echo through `side`'s ingress reaches `side`'s own target.
    fn ingress_ok(&self, side: &Side, what: &str) {
        let echo = if side.target == self.a.target {
            &self.echo_a
        } else {
            &self.echo_b
        };
        let before = echo.seen().len();
        let to = sa(side.tunnel_ip, 80);
        let payload = format!("instances: {what}");
        let mut last = String::new();
        let ok = poll_until(Duration::from_secs(10), || {
            match tcp_roundtrip(&self.client, to, payload.as_bytes(), Duration::from_secs(3)) {
                Ok(back) if back == payload.as_bytes() => true,
                other => {
                    last = format!("{other:?}");
                    false
                }
            }
        });
        assert!(ok, "{what}: ingress via {to} failed: {last}");
        assert!(
            echo.seen().len() > before,
            "{what}: {to} did not reach {}",
            side.target
        );
    }

    /// What the daemon for `iface` has installed: its nft table, or every iptables-save line
    /// (both families) that names one of its chains.
    fn rules_of(&self, iface: &str) -> String {
        match self.backend {
            Backend::Nftables => self.proxy.nft_table_of(iface),
            _ => {
                let ours: Vec<String> = ["PRE", "POST", "FWD", "MSS", "IN"]
                    .iter()
                    .map(|s| format!("TG-{iface}-{s}"))
                    .collect();
                let mut out = String::new();
                for v6 in [false, true] {
                    for line in self.proxy.exec(&[self.backend.iptables_save(v6)]).lines() {
                        let named = line
                            .split_whitespace()
                            .any(|w| ours.iter().any(|c| c == w.trim_start_matches(':')));
                        if named {
                            out += &format!("{}: {line}\n", if v6 { 6 } else { 4 });
                        }
                    }
                }
                out
            }
        }
    }

    /// Every tunnelgate table or chain in the namespace belongs to one of `ifaces`, and each
    /// of those has its own complete set (for iptables: one jump to each of its chains).
    fn assert_exactly_ours(&self, ifaces: &[&str]) {
        match self.backend {
            Backend::Nftables => {
                let mut want: Vec<String> =
                    ifaces.iter().map(|i| format!("tunnelgate_{i}")).collect();
                want.sort();
                assert_eq!(self.proxy.nft_tunnelgate_tables(), want);
            }
            _ => {
                for v6 in [false, true] {
                    let save = self.proxy.exec(&[self.backend.iptables_save(v6)]);
                    let mut chains: Vec<&str> = save
                        .lines()
                        .filter_map(|l| l.strip_prefix(':'))
                        .filter_map(|l| l.split_whitespace().next())
                        .filter(|c| c.starts_with("TG-"))
                        .collect();
                    chains.sort();
                    let mut want: Vec<String> = ifaces
                        .iter()
                        .flat_map(|i| {
                            ["FWD", "IN", "MSS", "POST", "PRE"].map(|s| format!("TG-{i}-{s}"))
                        })
                        .collect();
                    want.sort();
                    assert_eq!(
                        chains,
                        want,
                        "IPv{} chains:\n{save}",
                        if v6 { 6 } else { 4 }
                    );
                    for c in &want {
                        let jumps = save
                            .lines()
                            .filter(|l| {
                                l.ends_with(&format!(" -j {c}"))
                                    && !l.starts_with(&format!("-A {c} "))
                            })
                            .count();
                        assert_eq!(jumps, 1, "jumps to {c}:\n{save}");
                    }
                }
            }
        }
        for iface in ifaces {
            let text = self.rules_of(iface);
            let (own, other) = if *iface == self.a.cfg.name {
                (&self.a, &self.b)
            } else {
                (&self.b, &self.a)
            };
            assert!(
                text.contains(own.target),
                "{iface} lacks its ingress:\n{text}"
            );
            assert!(
                !text.contains(&other.cfg.name) && !text.contains(other.target),
                "{iface}'s rules mention the other daemon:\n{text}"
            );
        }
    }

    fn applies(&self, tg: &Tunnelgate) -> f64 {
        let m = tg.metrics().unwrap_or_else(|e| panic!("{e}"));
        let labels = format!("backend=\"{}\"", self.backend.label());
        metric(&m, "tunnelgate_rule_applies_total", &labels)
            .unwrap_or_else(|| panic!("no rule_applies in\n{m}"))
    }

    fn ip_forward(&self) -> String {
        self.proxy.sysctl_get(IP_FORWARD)
    }
}

/// `<run dir>/<iface>.forwarding`, the daemon's shared forwarding record.
fn record_path(iface: &str) -> PathBuf {
    PathBuf::from("/var/run/tunnelgate").join(format!("{iface}.forwarding"))
}

/// Stops `tg` with SIGTERM; it must exit 0.
fn stop(tg: &mut Tunnelgate) {
    let status = tg.sigterm();
    assert!(
        status.success(),
        "{} exited {status:?}:\n{}",
        tg.name(),
        tg.stderr()
    );
}

fn two_daemons_share_one_namespace(backend: Backend) {
    let lab = Lab::new(backend);
    let (name_a, name_b) = (lab.a.cfg.name.clone(), lab.b.cfg.name.clone());
    let mut tg_a = lab.start(&lab.a);
    let mut tg_b = lab.start(&lab.b);

    // Both ingresses work at once, each to its own target.
    lab.ingress_ok(&lab.a, "A with B running");
    lab.ingress_ok(&lab.b, "B with A running");
    lab.assert_exactly_ours(&[&name_a, &name_b]);
    assert_eq!(lab.ip_forward(), "1");
    assert_eq!(
        lab.proxy.sysctl_get(V6_FORWARD),
        "0",
        "no IPv6 rule: left alone"
    );
    let record = std::fs::read_to_string(record_path(&name_a)).unwrap_or_default();
    assert!(
        record.contains("ipv4=needed,changed"),
        "A turned ip_forward on:\n{record}"
    );

    // No fight: over several repair intervals neither daemon re-applies, nothing changes.
    let (rules_a, rules_b) = (lab.rules_of(&name_a), lab.rules_of(&name_b));
    let (applies_a, applies_b) = (lab.applies(&tg_a), lab.applies(&tg_b));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        lab.applies(&tg_a),
        applies_a,
        "A re-applied: it saw B's rules as drift"
    );
    assert_eq!(
        lab.applies(&tg_b),
        applies_b,
        "B re-applied: it saw A's rules as drift"
    );
    assert_eq!(lab.rules_of(&name_a), rules_a);
    assert_eq!(lab.rules_of(&name_b), rules_b);
    for tg in [&tg_a, &tg_b] {
        assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(200));
    }

    // Stop A (which turned forwarding on): B keeps its rules, its ingress and forwarding.
    stop(&mut tg_a);
    lab.assert_exactly_ours(&[&name_b]);
    assert_eq!(
        lab.rules_of(&name_b),
        rules_b,
        "stopping A changed B's rules"
    );
    assert_eq!(
        lab.ip_forward(),
        "1",
        "stopping A turned forwarding off under B"
    );
    lab.ingress_ok(&lab.b, "B after A stopped");

    // A again, then stop B first: A keeps everything.
    let mut tg_a = lab.start(&lab.a);
    lab.ingress_ok(&lab.a, "A restarted beside B");
    lab.assert_exactly_ours(&[&name_a, &name_b]);
    let rules_a = lab.rules_of(&name_a);
    stop(&mut tg_b);
    lab.assert_exactly_ours(&[&name_a]);
    assert_eq!(
        lab.rules_of(&name_a),
        rules_a,
        "stopping B changed A's rules"
    );
    assert_eq!(
        lab.ip_forward(),
        "1",
        "stopping B turned forwarding off under A"
    );
    lab.ingress_ok(&lab.a, "A after B stopped");

    // The last one puts forwarding back as the namespace had it, and leaves nothing behind.
    stop(&mut tg_a);
    assert_eq!(
        lab.ip_forward(),
        "0",
        "forwarding stays on after the last daemon stopped"
    );
    lab.assert_exactly_ours(&[]);
    assert_eq!(lab.rules_of(&name_a), "");
    assert_eq!(lab.rules_of(&name_b), "");
    for name in [&name_a, &name_b] {
        assert!(
            !record_path(name).exists(),
            "{name}'s forwarding record is left"
        );
    }
}

fn kill9_restart_stop_restores_forwarding(backend: Backend) {
    let lab = Lab::new(backend);
    let name = lab.a.cfg.name.clone();
    let mut tg = lab.start(&lab.a);
    lab.ingress_ok(&lab.a, "before kill -9");
    assert_eq!(lab.ip_forward(), "1");
    tg.kill9();
    drop(tg);
    assert_eq!(
        lab.ip_forward(),
        "1",
        "a killed daemon cannot put anything back"
    );
    assert!(
        record_path(&name).exists(),
        "the killed run's record is the only trace"
    );

    let mut tg = lab.start(&lab.a);
    lab.ingress_ok(&lab.a, "after restart");
    lab.assert_exactly_ours(&[&name]);
    stop(&mut tg);
    assert_eq!(
        lab.ip_forward(),
        "0",
        "the restarted daemon did not put back what its killed run changed"
    );
    lab.assert_exactly_ours(&[]);
    assert!(!record_path(&name).exists());
}
