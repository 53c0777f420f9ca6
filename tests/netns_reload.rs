//! Issue 6: the daemon follows its config in a directory laid out like a mounted Kubernetes Secret
//! (`..<timestamp>/` dirs, a `..data` symlink to the current one, user-visible symlinks through
//! it) and changed the way the kubelet changes it (a new timestamped dir, then an atomic rename of
//! `..data_tmp` over `..data`). While an iperf3 TCP stream runs over an unchanged peer, a reload
//! adds a peer and an ingress rule: both take effect, and the stream neither stalls nor
//! re-handshakes. A broken config swapped in the same way is refused and the running one stays.
//!
//!
//! Issue 23, once per firewall backend (nftables, iptables-nft, iptables-legacy): a reload to a
//! config without its last `[[ingress]]` removes our table or chains, the peer no longer
//! reaches the target, `ip_forward` goes back to its value before the start, and `/readyz`
//! stays 200; a reload back to the ingress serves it again.
//!
//! Run as root: `cargo test --test netns_reload -- --ignored --test-threads=1`.

mod common;

use common::*;
use std::net::SocketAddr;
use std::os::unix::fs::{symlink, DirBuilderExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tunnelgate::shell::clock;

const A_LAN4: &str = "192.168.63.1";
const B_LAN4: &str = "192.168.63.2";
/// tunnelgate (`a`), its wireguard-go peer (`b`), a peer added by the reload (`c`).
const A_TUN4: &str = "100.66.0.1";
const B_TUN4: &str = "100.66.0.2";
const C_TUN4: &str = "100.66.0.3";
const TG_PORT: u16 = 51820;
const WG_PORT: u16 = 51821;
const IPERF_PORT: u16 = 5201;
const IPERF_SECS: u64 = 15;
/// The ingress port the reload adds: tunnel traffic for A_TUN4:8080 goes to b's echo server.
const INGRESS_PORT: u16 = 8080;
const ECHO_PORT: u16 = 9090;

/// A directory with the layout of a Secret volume (what the kubelet's atomic writer makes).
struct SecretMount {
    dir: TempDir,
    current: Option<PathBuf>,
    generation: u32,
}

impl SecretMount {
    fn new(tag: &str, files: &[(&str, &str)]) -> SecretMount {
        let mut m = SecretMount {
            dir: TempDir::new(tag),
            current: None,
            generation: 0,
        };
        m.swap(files);
        for (name, _) in files {
            symlink(Path::new("..data").join(name), m.dir.path().join(name)).expect("symlink");
        }
        m
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `files` into a new timestamped dir (mode 0400, as `defaultMode: 0400` makes them),
    /// points `..data` at it with one atomic rename, and removes the old dir.
    fn swap(&mut self, files: &[(&str, &str)]) {
        self.generation += 1;
        let name = format!(
            "..2026_11_22_10_00_{:02}.{}",
            self.generation,
            std::process::id()
        );
        let new = self.dir.path().join(&name);
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(&new)
            .expect("timestamped dir");
        for (file, contents) in files {
            self.dir
                .write_mode(&format!("{name}/{file}"), contents, 0o400);
        }
        let tmp = self.dir.path().join("..data_tmp");
        symlink(&name, &tmp).expect("..data_tmp");
        std::fs::rename(&tmp, self.dir.path().join("..data")).expect("rename over ..data");
        if let Some(old) = self.current.replace(new) {
            std::fs::remove_dir_all(old).expect("remove the old dir");
        }
    }
}

fn cidr(ip: &str) -> String {
    format!("{ip}/32")
}

/// Waits until the daemon's TUN device is up, its UAPI socket exists and `/readyz` says 200.
fn wait_ready(ns: &Netns, cfg: &TgConfig, proc: &mut Proc) {
    let health = cfg.health_addr().expect("health enabled");
    let ok = poll_until(Duration::from_secs(10), || {
        ns.link_is_up(&cfg.name)
            && wg_socket(&cfg.name).exists()
            && matches!(
                http_get_in(ns.name(), health, "/readyz", Duration::from_secs(1)),
                Ok((200, _))
            )
    });
    assert!(
        ok && proc.is_running(),
        "tunnelgate not ready; stderr:\n{}",
        proc.stderr()
    );
}

fn handshake(iface: &str, peer: &str) -> u64 {
    wg_dump(iface).peer(peer).map_or(0, |p| p.latest_handshake)
}

#[test]
#[ignore = "needs root"]
fn secret_style_symlink_swap_reloads_without_disturbing_a_running_stream() {
    let (a, b, _) = lan_pair_v4(A_LAN4, B_LAN4);
    let wg = WgGo::start(&b, WG_PORT, &[&format!("{B_TUN4}/24")]);
    let key = Keypair::generate();
    let mut cfg = TgConfig::new(TG_PORT, &[&cidr(A_TUN4)]).peer(
        Peer::new(wg.public_key(), &[&cidr(B_TUN4)]).endpoint(&format!("{B_LAN4}:{WG_PORT}")),
    );
    cfg.key = key.clone();
    wg.add_peer(&Peer::new(&key.public, &[&cidr(A_TUN4)]).endpoint(&format!("{A_LAN4}:{TG_PORT}")));

    let private = format!("{}\n", key.private);
    // The stream goes to iperf3 on this host's own tunnel address. Once the reload adds an
    // ingress rule, the input guard would refuse that (issue 15): allow it on purpose.
    let render = |c: &TgConfig| {
        c.render("private.key")
            .replace("[health]\n", "[health]\nallow_from_tunnel = true\n")
    };
    let mut mount = SecretMount::new(
        &cfg.name,
        &[
            ("tunnelgate.toml", &render(&cfg)),
            ("private.key", &private),
        ],
    );
    let config_path = mount.path("tunnelgate.toml").display().to_string();
    let mut daemon = Proc::spawn(
        a.command(&[tunnelgate_bin(), "run", "--config", &config_path]),
        "tunnelgate",
        mount.dir.path(),
    );
    wait_ready(&a, &cfg, &mut daemon);
    assert!(
        ping_until(&b, A_TUN4, Duration::from_secs(10)),
        "tunnel up; stderr:\n{}",
        daemon.stderr()
    );
    let hs_before = handshake(&cfg.name, wg.public_key());
    assert!(hs_before > 0, "handshake with the wireguard-go peer");

    // The ingress target: an echo server behind b's underlay address, not yet forwarded to.
    let echo = TcpEcho::start(&b, format!("{B_LAN4}:{ECHO_PORT}").parse().expect("addr"));
    let ingress: SocketAddr = format!("{A_TUN4}:{INGRESS_PORT}").parse().expect("addr");
    assert!(
        tcp_roundtrip(&b, ingress, b"before", Duration::from_secs(2)).is_err(),
        "no ingress rule yet"
    );

    // iperf3 from b to a, over the tunnel.
    let mut server = a.spawn(&[
        "iperf3",
        "-s",
        "-1",
        "-B",
        A_TUN4,
        "-p",
        &IPERF_PORT.to_string(),
    ]);
    wait_until(Duration::from_secs(5), "iperf3 server listening", || {
        a.try_sh(&format!("ss -ltn 'sport = :{IPERF_PORT}' | grep -q LISTEN"))
            .is_ok()
    });
    let started = clock::now();
    let mut client = b.spawn(&[
        "iperf3",
        "-c",
        A_TUN4,
        "-p",
        &IPERF_PORT.to_string(),
        "-t",
        &IPERF_SECS.to_string(),
        "-i",
        "1",
        "-J",
    ]);
    std::thread::sleep(Duration::from_secs(4));

    // The reload: a second peer and an ingress rule, the first peer unchanged.
    let c_key = Keypair::generate();
    let mut cfg2 = cfg.clone().peer(Peer::new(&c_key.public, &[&cidr(C_TUN4)]));
    cfg2.extra =
        format!("[[ingress]]\ntarget = \"{B_LAN4}\"\nports = [\"{INGRESS_PORT}:{ECHO_PORT}\"]\n");
    mount.swap(&[
        ("tunnelgate.toml", &render(&cfg2)),
        ("private.key", &private),
    ]);
    wait_until(Duration::from_secs(8), "the new peer in wg show", || {
        try_wg_dump(&cfg.name).is_ok_and(|d| d.peer(&c_key.public).is_some())
    });
    wait_until(Duration::from_secs(8), "the ingress rule working", || {
        tcp_roundtrip(&b, ingress, b"after", Duration::from_secs(1)).as_deref()
            == Ok(b"after".as_slice())
    });
    assert!(!echo.seen().is_empty());
    assert!(
        tunnelgate::shell::clock::since(started) < Duration::from_secs(IPERF_SECS),
        "the reload finished while the stream was still running"
    );

    // The stream: finished, no interval without traffic.
    let status = client.wait_timeout(Duration::from_secs(IPERF_SECS + 20));
    assert!(
        status.is_some_and(|s| s.success()),
        "iperf3 client: {status:?}\n{}\n{}",
        client.stdout(),
        client.stderr()
    );
    let report: serde_json::Value =
        serde_json::from_str(&client.stdout()).expect("iperf3 JSON report");
    assert!(report["error"].is_null(), "{}", report["error"]);
    let intervals = report["intervals"].as_array().expect("intervals");
    assert!(
        intervals.len() as u64 >= IPERF_SECS - 1,
        "{}",
        intervals.len()
    );
    for (i, iv) in intervals.iter().enumerate() {
        let secs = iv["sum"]["seconds"].as_f64().unwrap_or(0.0);
        let bps = iv["sum"]["bits_per_second"].as_f64().unwrap_or(0.0);
        assert!(
            secs < 0.5 || bps > 0.0,
            "interval {i} carried nothing: {}",
            iv["sum"]
        );
    }
    let received = report["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    assert!(received > 0, "iperf3 received nothing");
    let _ = server.wait_timeout(Duration::from_secs(5));

    // No new handshake with the unchanged peer: its session survived the reload.
    assert_eq!(
        handshake(&cfg.name, wg.public_key()),
        hs_before,
        "the unchanged peer re-handshook"
    );
    assert!(daemon.is_running(), "the daemon was not restarted");
    assert!(
        daemon.stderr().contains("Config file changed"),
        "{}",
        daemon.stderr()
    );

    // A broken config arrives the same way: refused, the running one stays.
    mount.swap(&[
        (
            "tunnelgate.toml",
            "[interface]\naddresses = [\"not an address\"]\n",
        ),
        ("private.key", &private),
    ]);
    wait_until(Duration::from_secs(8), "the invalid config refused", || {
        daemon.stderr().contains("invalid")
    });
    assert!(daemon.is_running());
    let d = wg_dump(&cfg.name);
    assert!(d.peer(&c_key.public).is_some() && d.peer(wg.public_key()).is_some());
    assert!(ping(&b, A_TUN4), "the tunnel still carries traffic");
    assert_eq!(
        tcp_roundtrip(&b, ingress, b"still", Duration::from_secs(2)).as_deref(),
        Ok(b"still".as_slice())
    );
    let status = daemon.sigterm(Duration::from_secs(10));
    assert!(status.success(), "{status:?}\n{}", daemon.stderr());
}

// ---------------------------------------------------------------------------------------------
// Issue 23: a reload to a config with no forwarding rules removes the old ones
// ---------------------------------------------------------------------------------------------

/// Underlay between the wireguard-go client and the proxy, and the proxy's cluster link.
const RZ_CLIENT_LAN: &str = "192.168.65.1";
const RZ_PROXY_LAN: &str = "192.168.65.2";
const RZ_PROXY_CLUSTER: &str = "10.97.0.1";
const RZ_TARGET: &str = "10.97.0.10";
const RZ_TG_TUN: &str = "100.67.0.1";
const RZ_PEER_TUN: &str = "100.67.0.2";
const IP_FORWARD: &str = "net.ipv4.ip_forward";

/// The `[firewall]` section selecting `backend`.
fn firewall_toml(backend: Backend) -> String {
    format!("[firewall]\nmode = \"{}\"\n", backend.mode())
}

/// Everything of the daemon for `iface` the backend shows: its nft table, or the lines of
/// both families' `iptables-save` that name its `TG-<iface>-` chains ("" when none).
fn ours(backend: Backend, ns: &Netns, iface: &str) -> String {
    let saves: &[&str] = match backend {
        Backend::Nftables => {
            let ruleset = ns.exec(&["nft", "list", "ruleset"]);
            let table = format!("tunnelgate_{iface}");
            return if ruleset.contains(&table) {
                ruleset
            } else {
                String::new()
            };
        }
        Backend::IptablesNft => &["iptables-save", "ip6tables-save"],
        Backend::IptablesLegacy => &["iptables-legacy-save", "ip6tables-legacy-save"],
    };
    let chain = format!("TG-{iface}-");
    saves
        .iter()
        .flat_map(|save| {
            ns.exec(&[save])
                .lines()
                .filter(|l| l.contains(&chain))
                .map(|l| format!("{save}: {l}\n"))
                .collect::<Vec<_>>()
        })
        .collect()
}

per_backend!(reload_without_the_last_ingress_removes_its_rules);

/// `tunnelgate reload --interface NAME`, run in the daemon's namespace; it must exit 0.
fn reload_cli(ns: &Netns, iface: &str, tg: &Tunnelgate) {
    let out = ns.output(&[tunnelgate_bin(), "reload", "--interface", iface]);
    assert!(
        out.success(),
        "tunnelgate reload: {:?}\n{}{}\ndaemon:\n{}",
        out.code,
        out.stdout,
        out.stderr,
        tg.stderr()
    );
}

fn readyz(tg: &Tunnelgate) -> Result<(u16, String), String> {
    tg.health_get("/readyz")
}

fn reload_without_the_last_ingress_removes_its_rules(backend: Backend) {
    let Lab3 {
        client,
        proxy,
        cluster,
    } = Lab3::new(
        &[&format!("{RZ_CLIENT_LAN}/24")],
        &[&format!("{RZ_PROXY_LAN}/24")],
        &[&format!("{RZ_PROXY_CLUSTER}/24")],
        &[&format!("{RZ_TARGET}/24")],
    );
    let forward_before = proxy.sysctl_get(IP_FORWARD);
    assert_eq!(forward_before, "0", "a fresh namespace does not forward");
    let echo = TcpEcho::start(
        &cluster,
        format!("{RZ_TARGET}:{ECHO_PORT}").parse().expect("addr"),
    );
    let wg = WgGo::start(&client, WG_PORT, &[&cidr(RZ_PEER_TUN)]);

    let plain = {
        let mut c = TgConfig::new(TG_PORT, &[&cidr(RZ_TG_TUN)]).peer(
            Peer::new(wg.public_key(), &[&cidr(RZ_PEER_TUN)])
                .endpoint(&format!("{RZ_CLIENT_LAN}:{WG_PORT}")),
        );
        c.extra = firewall_toml(backend);
        c
    };
    let mut with_ingress = plain.clone();
    with_ingress.extra += &format!(
        "[[ingress]]\ntarget = \"{RZ_TARGET}\"\nports = [\"{INGRESS_PORT}:{ECHO_PORT}\"]\n"
    );
    let iface = plain.name.clone();
    let mut tg = Tunnelgate::spawn_env(&proxy, with_ingress.clone(), &backend.env());
    if let Err(e) = tg.wait_ready(Duration::from_secs(15)) {
        panic!("{e}");
    }
    wg.add_peer(
        &Peer::new(tg.public_key(), &[&cidr(RZ_TG_TUN)])
            .endpoint(&format!("{RZ_PROXY_LAN}:{TG_PORT}")),
    );
    assert!(
        ping_until(&client, RZ_TG_TUN, Duration::from_secs(10)),
        "tunnel up; stderr:\n{}",
        tg.stderr()
    );
    let ingress: SocketAddr = format!("{RZ_TG_TUN}:{INGRESS_PORT}").parse().expect("addr");
    let reaches = |what: &[u8]| {
        tcp_roundtrip(&client, ingress, what, Duration::from_secs(2)).as_deref() == Ok(what)
    };
    wait_until(
        Duration::from_secs(8),
        "the peer reaching the target",
        || reaches(b"before"),
    );
    assert!(!ours(backend, &proxy, &iface).is_empty(), "rules installed");
    assert_eq!(
        proxy.sysctl_get(IP_FORWARD),
        "1",
        "turned on for the ingress"
    );

    // The last ingress leaves the file.
    tg.write_config(plain);
    reload_cli(&proxy, &iface, &tg);
    let left = ours(backend, &proxy, &iface);
    assert!(
        left.is_empty(),
        "rules left after the reload:\n{left}\ndaemon:\n{}",
        tg.stderr()
    );
    let blocked = tcp_roundtrip(&client, ingress, b"after", Duration::from_millis(1500));
    assert!(blocked.is_err(), "still forwarded: {blocked:?}");
    assert_eq!(
        proxy.sysctl_get(IP_FORWARD),
        forward_before,
        "ip_forward back to its value before the start; daemon:\n{}",
        tg.stderr()
    );
    let ready = readyz(&tg);
    assert!(matches!(ready, Ok((200, _))), "/readyz: {ready:?}");
    let status = tg.status_json().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status["rules"]["needed"], false, "{status}");
    assert_eq!(status["rules"]["rule_count"], 0, "{status}");
    let metrics = tg.metrics().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        metrics.contains("\ntunnelgate_rules_needed{"),
        "no rules_needed metric:\n{metrics}"
    );
    assert_eq!(metric_sum(&metrics, "tunnelgate_rules_needed"), 0.0);
    assert_eq!(
        metric_sum(&metrics, "tunnelgate_rules_applied"),
        1.0,
        "nothing needed, nothing left: not a failure"
    );
    assert!(ping(&client, RZ_TG_TUN), "the tunnel itself still works");

    // And back: the ingress works again, forwarding is on again.
    tg.write_config(with_ingress);
    reload_cli(&proxy, &iface, &tg);
    wait_until(
        Duration::from_secs(8),
        "the peer reaching the target again",
        || reaches(b"again"),
    );
    assert_eq!(proxy.sysctl_get(IP_FORWARD), "1");
    assert!(!echo.seen().is_empty());

    let status = tg.sigterm();
    assert!(status.success(), "{status:?}\n{}", tg.stderr());
    assert!(
        ours(backend, &proxy, &iface).is_empty(),
        "rules left at stop"
    );
    assert_eq!(proxy.sysctl_get(IP_FORWARD), forward_before);
}
