//! wg-quick users, end to end (issue 23): the README's wg-quick example imported with
//! `tunnelgate import wg-quick`, checked, run, and pinged over IPv4 and IPv6 by a wireguard-go
//! peer configured with `wg setconf`; and `tunnelgate status` scoped to its network namespace
//! like `wg show` (`--all`: every namespace, each named), with `reload` picking from this
//! namespace only.
//!
//! ```text
//!  tg ns: tunnelgate (imported wg0.conf) 100.64.0.2 ──veth 192.168.231.0/24── wg ns: wireguard-go 100.64.0.1:51820
//! ```
//!
//! Run as root: `cargo test --test netns_wgquick -- --ignored --test-threads=1`

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

const TG_UNDERLAY: &str = "192.168.231.1";
const WG_UNDERLAY: &str = "192.168.231.2";

/// The peer's `wg0.conf` from the README's "Connecting a standard WireGuard peer" section.
fn readme_wg_quick_example() -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let fence = "```ini\n";
    let start = readme
        .find(&format!("{fence}[Interface]"))
        .expect("the README has a wg-quick example")
        + fence.len();
    let len = readme[start..]
        .find("```")
        .expect("the example's fence ends");
    readme[start..start + len].to_string()
}

/// Replaces `placeholder` in `text`, insisting that it is there (the README must not drift).
fn fill(text: &str, placeholder: &str, value: &str) -> String {
    assert!(
        text.contains(placeholder),
        "the README example no longer has {placeholder:?}:\n{text}"
    );
    text.replace(placeholder, value)
}

#[test]
#[ignore = "needs root: network namespaces, TUN"]
fn the_readme_wg_quick_example_imports_checks_runs_and_pings() {
    let (tg_ns, wg_ns, _veth) = lan_pair(TG_UNDERLAY, "fd31::1", WG_UNDERLAY, "fd31::2");

    // The "tunnelgate host" of the README: wireguard-go, configured by `wg setconf`.
    let server = Keypair::generate();
    let peer = Keypair::generate();
    let wg_name = unique_name("tgw");
    let dir = TempDir::new(&wg_name);
    let mut cmd = wg_ns.command(&["wireguard-go", "-f", &wg_name]);
    cmd.env("WG_PROCESS_FOREGROUND", "1");
    let mut wg_proc = Proc::spawn(cmd, &wg_name, dir.path());
    wait_until(
        Duration::from_secs(10),
        "wireguard-go's UAPI socket",
        || wg_socket(&wg_name).exists() || !wg_proc.is_running(),
    );
    let setconf = dir.write_secret(
        "server.conf",
        &format!(
            "[Interface]\nPrivateKey = {}\nListenPort = 51820\n\n[Peer]\nPublicKey = {}\n\
             AllowedIPs = 100.64.0.2/32, fd7a:115c:a1e0::2/128\n",
            server.private, peer.public
        ),
    );
    wg_ns.exec(&["wg", "setconf", &wg_name, &setconf.display().to_string()]);
    add_addr(&wg_ns, &wg_name, "100.64.0.1/32");
    add_addr(&wg_ns, &wg_name, "fd7a:115c:a1e0::1/128");
    wg_ns.exec(&["ip", "link", "set", &wg_name, "up"]);
    wg_ns.exec(&["ip", "route", "add", "100.64.0.2/32", "dev", &wg_name]);
    wg_ns.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "fd7a:115c:a1e0::2/128",
        "dev",
        &wg_name,
    ]);

    // The README's peer file, with real keys and this test's endpoint, named for a unique
    // interface (wg-quick names it after the file).
    let ini = readme_wg_quick_example();
    let ini = fill(&ini, "<contents of peer.key>", &peer.private);
    let ini = fill(&ini, "SERVER_PUB", &server.public);
    let ini = fill(
        &ini,
        "tunnelgate.example.net:51820",
        &format!("{WG_UNDERLAY}:51820"),
    );
    let tg_name = unique_name("tgd");
    let work = TempDir::new(&tg_name);
    let conf = work.write_secret(&format!("{tg_name}.conf"), &ini);

    let imported = tunnelgate_cli(&["import", "wg-quick", &conf.display().to_string()], None);
    assert_eq!(imported.code, Some(0), "{imported:?}");
    let toml = work.write("tunnelgate.toml", &imported.stdout);
    let check = tunnelgate_cli(&["check", "--config", &toml.display().to_string()], None);
    assert_eq!(check.code, Some(0), "{check:?}\n{}", imported.stdout);

    let mut run = tg_ns.command(&[
        tunnelgate_bin(),
        "run",
        "--config",
        &toml.display().to_string(),
    ]);
    run.env("RUST_BACKTRACE", "1");
    let mut daemon = Proc::spawn(run, "tunnelgate", work.path());

    for (from, to) in [
        (&wg_ns, "100.64.0.2"),
        (&wg_ns, "fd7a:115c:a1e0::2"),
        (&tg_ns, "100.64.0.1"),
        (&tg_ns, "fd7a:115c:a1e0::1"),
    ] {
        assert!(
            ping_until(from, to, Duration::from_secs(20)),
            "no ping to {to}\n--- imported\n{}\n--- tunnelgate stderr\n{}",
            imported.stdout,
            daemon.stderr()
        );
    }
    // The peer saw the key the import wrote, and the endpoint it named.
    let dump = wg_dump(&wg_name);
    let seen = dump.peer(&peer.public).expect("the imported peer");
    assert!(seen.latest_handshake > 0, "{dump:?}");

    let status = daemon.sigterm(Duration::from_secs(10));
    assert!(status.success(), "{status:?}: {}", daemon.stderr());
    assert!(
        !tg_ns.link_exists(&tg_name),
        "the TUN device is left behind"
    );
    let _ = wg_proc.sigterm(Duration::from_secs(5));
}

fn status_in(ns: &Netns, args: &[&str]) -> CmdOutput {
    let mut all = vec![tunnelgate_bin(), "status"];
    all.extend_from_slice(args);
    ns.output(&all)
}

/// The daemons of a `status --json` answer: (interface name, netns).
fn json_daemons(out: &CmdOutput) -> Vec<(String, String)> {
    let value: serde_json::Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {}", out.stdout))
        .iter()
        .map(|d| {
            (
                d["interface"]["name"].as_str().unwrap_or("").to_string(),
                d["netns"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs root: network namespaces, TUN"]
fn status_shows_this_namespace_and_all_shows_every_one_by_name() {
    let a = Netns::new();
    let b = Netns::new();
    let empty = Netns::new();
    let tg_a = Tunnelgate::start(&a, TgConfig::new(0, &["100.64.0.1/32"]));
    let tg_b = Tunnelgate::start(&b, TgConfig::new(0, &["100.64.0.1/32"]));
    let (name_a, name_b) = (tg_a.name().to_string(), tg_b.name().to_string());

    // Plain `status`: this namespace's daemon only, like `wg show`.
    let here = status_in(&a, &[]);
    assert_eq!(here.code, Some(0), "{here:?}");
    assert!(
        here.stdout.contains(&format!("interface: {name_a}\n")),
        "{}",
        here.stdout
    );
    assert!(!here.stdout.contains(&name_b), "{}", here.stdout);
    let here_json = json_daemons(&status_in(&a, &["--json"]));
    assert_eq!(here_json, [(name_a.clone(), a.name().to_string())]);

    // `--all`: both, each naming its namespace (other daemons of the host may show too).
    let all = status_in(&a, &["--all"]);
    assert_eq!(all.code, Some(0), "{all:?}");
    for (iface, ns) in [(&name_a, a.name()), (&name_b, b.name())] {
        let want = format!("interface: {iface}\n  netns: {ns}\n");
        assert!(
            all.stdout.contains(&want),
            "{want:?} missing:\n{}",
            all.stdout
        );
    }
    let all_json = json_daemons(&status_in(&b, &["--all", "--json"]));
    for want in [
        (name_a.clone(), a.name().to_string()),
        (name_b.clone(), b.name().to_string()),
    ] {
        assert!(all_json.contains(&want), "{want:?} missing: {all_json:?}");
    }

    // A namespace without a daemon: says so, exit 0; JSON is an empty array.
    let none = status_in(&empty, &[]);
    assert_eq!(none.code, Some(0), "{none:?}");
    assert!(
        none.stdout
            .contains("no tunnelgate daemon is running in this network namespace"),
        "{}",
        none.stdout
    );
    assert!(json_daemons(&status_in(&empty, &["--json"])).is_empty());

    // `reload` without flags picks this namespace's only daemon, though another one runs.
    let reload = a.output(&[tunnelgate_bin(), "reload"]);
    assert_eq!(reload.code, Some(0), "{reload:?}");
    assert!(reload.stdout.contains(&name_a), "{}", reload.stdout);
    let nothing = empty.output(&[tunnelgate_bin(), "reload"]);
    assert_eq!(nothing.code, Some(1), "{nothing:?}");
    assert!(
        nothing.stderr.contains("in this network namespace"),
        "{}",
        nothing.stderr
    );
}
