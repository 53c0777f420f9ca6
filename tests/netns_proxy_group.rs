//! A two-replica proxy group on real namespaces: each replica runs `tunnelgate run` with the
//! configuration the sidecar's renderer gives it (its own key and pool address), from a config
//! volume laid out as the sidecar hands it over (`..data` swap, mode 0440 files), behind an nft
//! "kube-proxy" that spreads connections to an egress Service over both replicas with
//! `numgen inc mod 2`. Connections reach the target through both; after one replica is killed,
//! its share fails until it is removed from the balancer, and then every new connection goes
//! through the other.
//!
//! ```text
//!   node (client + nft DNAT 10.96.0.50:80 -> numgen {pod0, pod1}:15432)
//!    ├─veth 10.10.1.0/24─ pod0: tunnelgate replica 0 (100.64.1.1) ─┐
//!    ├─veth 10.10.2.0/24─ pod1: tunnelgate replica 1 (100.64.1.2) ─┼─ WireGuard over the node
//!    └─veth 10.10.3.0/24─ peer: wireguard-go 100.64.0.100, whoami on :80
//! ```
//!
//! Run as root: `cargo test --features sidecar --test netns_proxy_group -- --ignored --test-threads=1`

mod common;

use common::*;
use serde_json::json;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;
use tunnelgate::config::SecretKey;
use tunnelgate::shell::keys::GenerateKey as _;
use tunnelgate::sidecar::config_dir::{volume_files, ConfigDir};
use tunnelgate::sidecar::group::{render_group, Replica};
use tunnelgate::sidecar::{api::service_info, KEY_CONFIG, KEY_DEVICE_IPS};

const SERVICE_IP: &str = "10.96.0.50";
const TARGET: &str = "100.64.0.100";
const PEER_PORT: u16 = 51820;

/// The egress Service of the group as the API server returns it, and one of another group on the
/// same port (which the replicas must ignore).
fn services() -> Vec<tunnelgate::sidecar::ServiceInfo> {
    let svc = |name: &str, group: &str, target: &str, target_port: u16| {
        let v = json!({
            "metadata": {
                "name": name, "namespace": "shop",
                "creationTimestamp": "2025-01-01T00:00:00Z",
                "annotations": {
                    "tunnelgate.dev/proxy-group": group,
                    "tunnelgate.dev/tunnel-ip": target,
                },
            },
            "spec": {
                "type": "ClusterIP", "clusterIP": SERVICE_IP,
                "selector": {"app": "tgp"},
                "ports": [{"port": 80, "targetPort": target_port, "protocol": "TCP"}],
            },
        });
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(v).expect("Service");
        service_info(&svc)
    };
    vec![
        svc("db", "tgp", TARGET, 15432),
        svc("elsewhere", "another", "100.64.0.200", 15433),
    ]
}

/// A running replica: its pod namespace, its daemon, and what the sidecar rendered for it.
struct Pod {
    _ns: Netns,
    ip: String,
    iface: String,
    address: String,
    public_key: String,
    daemon: Proc,
    _dir: TempDir,
}

impl Drop for Pod {
    /// The replica stops as a pod's container would, and what a replica killed by the test
    /// could not remove goes: its UAPI and status sockets (its forwarding record goes with its
    /// namespace, [`Netns`]'s drop).
    fn drop(&mut self) {
        self.daemon.signal(nix::sys::signal::Signal::SIGTERM);
        if self.daemon.wait_timeout(Duration::from_secs(5)).is_none() {
            let _ = self.daemon.kill9();
        }
        let _ = std::fs::remove_file(wg_socket(&self.iface));
        let _ = std::fs::remove_file(status_socket(&self.iface));
    }
}

fn start_replica(node: &Netns, ordinal: u32, peer: &WgGo) -> Pod {
    let ns = Netns::new();
    ns.exec(&["ip", "link", "set", "lo", "up"]);
    let (node_ip, ip) = (
        format!("10.10.{}.1", ordinal + 1),
        format!("10.10.{}.2", ordinal + 1),
    );
    veth(
        node,
        &[&format!("{node_ip}/24")],
        &ns,
        &[&format!("{ip}/24")],
    );
    ns.exec(&["ip", "route", "add", "default", "via", &node_ip]);
    // The base config all replicas share (but for the interface name: /var/run/wireguard is
    // shared by every namespace of this host).
    let iface = unique_name("tgd");
    let base = format!(
        "[interface]\nname = \"{iface}\"\nlisten_port = 51820\naddresses = [\"100.64.9.9/32\"]\n\n\
         [[peer]]\npublic_key = \"{}\"\nendpoint = \"10.10.3.2:{PEER_PORT}\"\nallowed_ips = [\"{TARGET}/32\"]\n\n\
         [health]\nlisten = \"0.0.0.0:9002\"\n",
        peer.public_key()
    );
    let replica = Replica {
        group: "tgp".into(),
        ordinal,
        pools: vec!["100.64.1.0/24".parse().expect("pool")],
        identity: tunnelgate::sidecar::group::Identity::PerReplica,
        endpoint: None,
    };
    let out = render_group(
        &replica,
        &services(),
        &base,
        &Default::default(),
        SecretKey::generate,
    )
    .expect("the sidecar renders the replica's config");
    assert_eq!(
        out.served,
        ["shop/db"],
        "the other group's Service is ignored"
    );
    let text = |k: &str| String::from_utf8(out.rendered.data[k].clone()).expect("utf-8");
    let address =
        serde_json::from_str::<Vec<String>>(&text(KEY_DEVICE_IPS)).expect("device_ips")[0].clone();
    assert_eq!(address, format!("100.64.1.{}", ordinal + 1));
    let public_key = String::from_utf8(out.rendered.data["public_key"].clone()).expect("utf-8");

    // The pod's config volume as the sidecar hands it over (files of mode 0440 behind the
    // `..data` symlink), which the proxy container runs.
    let dir = TempDir::new(&iface);
    ConfigDir::open(dir.path().to_path_buf())
        .update(volume_files(&out.rendered.data, None).expect("volume files"))
        .expect("hand over");
    let config = dir.path().join(KEY_CONFIG);
    assert_eq!(
        std::fs::read_link(&config).expect("a symlink into ..data"),
        std::path::Path::new("..data").join(KEY_CONFIG)
    );
    let daemon = Proc::spawn(
        ns.command(&[
            tunnelgate_bin(),
            "run",
            "--config",
            &config.display().to_string(),
        ]),
        "tunnelgate",
        dir.path(),
    );
    let health: SocketAddr = format!("{ip}:9002").parse().expect("addr");
    let ready = poll_until(Duration::from_secs(15), || {
        wg_socket(&iface).exists() && matches!(http_get_ns(&ns, health, "/readyz"), Ok((200, _)))
    });
    assert!(
        ready,
        "replica {ordinal} not ready; stderr:\n{}",
        daemon.stderr()
    );
    Pod {
        _ns: ns,
        ip,
        iface,
        address,
        public_key,
        daemon,
        _dir: dir,
    }
}

/// The kube-proxy stand-in: connections to the Service IP go to `targetPort` on one of the pods,
/// round-robin.
fn balance(node: &Netns, pods: &[&str]) {
    let map: Vec<String> = pods
        .iter()
        .enumerate()
        .map(|(i, ip)| format!("{i} : {ip}"))
        .collect();
    let table = format!(
        "table ip tgkubeproxy {{\n  chain out {{\n    type nat hook output priority -100; policy accept;\n    \
         ip daddr {SERVICE_IP} tcp dport 80 dnat to numgen inc mod {} map {{ {} }} : 15432\n  }}\n}}\n",
        pods.len(),
        map.join(", ")
    );
    let _ = node.output(&["nft", "delete", "table", "ip", "tgkubeproxy"]);
    let out = output_of(node.command(&["nft", "-f", "-"]), Some(&table));
    assert!(out.success(), "nft: {}\n{table}", out.stderr);
}

/// `n` new connections to the Service: the tunnel source the target saw for each, or the error.
fn connect(node: &Netns, n: usize, timeout: Duration) -> Vec<Result<String, String>> {
    let to: SocketAddr = format!("{SERVICE_IP}:80").parse().expect("addr");
    (0..n)
        .map(|_| whoami(node, to, timeout).map(|(_, seen)| seen.ip().to_string()))
        .collect()
}

#[test]
#[ignore = "needs root"]
fn egress_spreads_over_two_replicas_and_survives_losing_one() {
    require_root();
    let node = Netns::new();
    node.exec(&["ip", "link", "set", "lo", "up"]);
    node.sysctl("net.ipv4.ip_forward", "1");
    let peer_ns = Netns::new();
    peer_ns.exec(&["ip", "link", "set", "lo", "up"]);
    veth(&node, &["10.10.3.1/24"], &peer_ns, &["10.10.3.2/24"]);
    peer_ns.exec(&["ip", "route", "add", "default", "via", "10.10.3.1"]);
    let peer = WgGo::start(&peer_ns, PEER_PORT, &[&format!("{TARGET}/32")]);
    let whoami_server = TcpWhoami::start(&peer_ns, format!("{TARGET}:80").parse().expect("addr"));

    let mut pods = [
        start_replica(&node, 0, &peer),
        start_replica(&node, 1, &peer),
    ];
    assert_ne!(pods[0].public_key, pods[1].public_key);
    // The target's side lists each replica as a peer with its own tunnel address.
    for p in &pods {
        peer.add_peer(&Peer::new(&p.public_key, &[&format!("{}/32", p.address)]));
    }
    // A route for the Service IP, so that local connections get as far as the nat hook.
    node.exec(&["ip", "route", "add", "10.96.0.0/16", "via", &pods[0].ip]);
    balance(&node, &[&pods[0].ip, &pods[1].ip]);

    // Both replicas carry connections: the target sees both tunnel addresses.
    let first = connect(&node, 8, Duration::from_secs(5));
    let seen: BTreeSet<String> = first
        .iter()
        .map(|r| {
            r.clone()
                .unwrap_or_else(|e| panic!("connection failed: {e}; {first:?}"))
        })
        .collect();
    assert_eq!(
        seen,
        BTreeSet::from(["100.64.1.1".to_string(), "100.64.1.2".to_string()]),
        "{first:?}"
    );
    assert_eq!(whoami_server.seen().len(), 8);

    // Replica 1 dies. While the balancer still sends to it, its share of new connections fails.
    let status = pods[1].daemon.kill9();
    assert!(!status.success());
    let _ = std::fs::remove_file(wg_socket(&pods[1].iface));
    let during = connect(&node, 4, Duration::from_secs(1));
    let failed = during.iter().filter(|r| r.is_err()).count();
    assert_eq!(
        failed, 2,
        "every other connection goes to the dead replica: {during:?}"
    );
    assert!(
        during.iter().flatten().all(|src| src == "100.64.1.1"),
        "{during:?}"
    );

    // Removed from the balancer (its readiness probe fails; kube-proxy drops the endpoint): every
    // new connection succeeds through replica 0.
    balance(&node, &[&pods[0].ip]);
    let after = connect(&node, 8, Duration::from_secs(5));
    assert!(
        after.iter().all(|r| r.as_deref() == Ok("100.64.1.1")),
        "{after:?}"
    );
    assert!(pods[0].daemon.is_running(), "{}", pods[0].daemon.stderr());
}
