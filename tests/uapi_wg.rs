//! End-to-end tests of the UAPI socket: the real `wg(8)` against a fake in-memory device
//! (root, ignored by default), and raw protocol over a tokio `UnixStream` (no root).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tunnelgate::config::{IpNet, SecretKey};
use tunnelgate::shell::clock;
use tunnelgate::shell::serve::local_socket::ClaimError;
use tunnelgate::shell::serve::uapi::{ServerError, UapiServer, DEFAULT_SOCKET_DIR};
use tunnelgate::uapi::{DeviceSnapshot, DeviceUpdate, Errno, PeerSnapshot, UapiError, UapiHandler};

const WG: &str = "/usr/bin/wg";

/// A device that lives in memory and records every update it is given.
#[derive(Default)]
struct FakeDevice {
    state: Mutex<DeviceSnapshot>,
    updates: Mutex<Vec<DeviceUpdate>>,
    refuse: Mutex<Option<Errno>>,
}

impl FakeDevice {
    fn take_updates(&self) -> Vec<DeviceUpdate> {
        std::mem::take(&mut *self.updates.lock().expect("lock"))
    }
}

impl UapiHandler for FakeDevice {
    fn get(&self) -> DeviceSnapshot {
        self.state.lock().expect("lock").clone()
    }

    fn set(&self, update: DeviceUpdate) -> Result<(), UapiError> {
        let refused = *self.refuse.lock().expect("lock");
        if let Some(errno) = refused {
            return Err(UapiError::new(errno, "refused by the test"));
        }
        self.state.lock().expect("lock").apply(&update);
        self.updates.lock().expect("lock").push(update);
        Ok(())
    }
}

struct Served {
    path: PathBuf,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
}

fn serve(server: UapiServer, device: Arc<FakeDevice>) -> Served {
    let path = server.socket_path().to_path_buf();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(device, async move {
        let _ = stopped.await;
    }));
    Served { path, stop, task }
}

impl Served {
    async fn shutdown(self) {
        let _ = self.stop.send(());
        self.task
            .await
            .expect("server task")
            .expect("server stopped cleanly");
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR")
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).expect("stat").permissions().mode() & 0o777
}

async fn exchange(stream: &mut UnixStream, request: &[u8]) -> String {
    stream.write_all(request).await.expect("write");
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    // Read up to and including the first empty line.
    while !(reply.ends_with(b"\n\n") || reply == b"\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte))
            .await
            .expect("reply in time")
            .expect("read");
        assert_eq!(n, 1, "connection closed early; got {reply:?}");
        reply.push(byte[0]);
    }
    String::from_utf8(reply).expect("utf8 reply")
}

/// No root needed: a private directory stands in for /var/run/wireguard.
#[tokio::test]
async fn garbage_gets_einval_and_the_server_keeps_answering() {
    let dir = std::env::temp_dir().join(format!("tg-uapi-it-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let device = Arc::new(FakeDevice::default());
    device.state.lock().expect("lock").listen_port = 51820;
    let served = serve(
        UapiServer::bind_in(&dir, "tgtest0").expect("bind"),
        device.clone(),
    );
    assert_eq!(mode(&served.path), 0o600);

    let mut stream = UnixStream::connect(&served.path).await.expect("connect");
    // wireguard-go's reply to a bad request: the negated errno, -EINVAL.
    assert_eq!(
        exchange(&mut stream, b"set=1\nbogus=1\n\n").await,
        "errno=-22\n\n"
    );
    assert_eq!(
        exchange(&mut stream, b"get=1\n\n").await,
        "listen_port=51820\nerrno=0\n\n"
    );
    // A new connection works too, and nothing was applied.
    let mut second = UnixStream::connect(&served.path).await.expect("connect");
    assert_eq!(
        exchange(&mut second, b"set=1\nlisten_port=x\n\n").await,
        "errno=-22\n\n"
    );
    assert!(device.take_updates().is_empty());

    let path = served.path.clone();
    served.shutdown().await;
    assert!(!path.exists(), "socket removed on shutdown");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `wg` with `args`; returns (success, stdout, stderr).
async fn wg(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(WG)
        .args(args)
        .output()
        .await
        .expect("run wg");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn wg_ok(args: &[&str]) -> String {
    let (ok, stdout, stderr) = wg(args).await;
    assert!(ok, "wg {args:?} failed: {stderr}");
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and wg"]
async fn real_wg_show_showconf_and_set() {
    // Root, to use /var/run/wireguard.
    common::require_root();
    if !Path::new(WG).exists() {
        common::skip(format!(
            "{WG} is not installed (apt-get install --no-install-recommends wireguard-tools)"
        ));
        return;
    }
    let name = format!("tgu{}", std::process::id());
    let name = &name[..name.len().min(15)];

    let private = SecretKey([0x11; 32]);
    let peer_a_psk = SecretKey([0x22; 32]);
    let peer_a = SecretKey([0x33; 32]).public_key();
    let peer_b = SecretKey([0x44; 32]).public_key();
    let handshake = clock::wall_now() - Duration::from_secs(30);
    let device = Arc::new(FakeDevice::default());
    *device.state.lock().expect("lock") = DeviceSnapshot {
        private_key: Some(private.clone()),
        listen_port: 51820,
        fwmark: Some(0x51),
        peers: vec![PeerSnapshot {
            public_key: peer_a,
            preshared_key: Some(peer_a_psk.clone()),
            endpoint: Some("198.51.100.7:51820".parse().expect("addr")),
            last_handshake: Some(handshake),
            tx_bytes: 123_456,
            rx_bytes: 654_321,
            persistent_keepalive: Some(25),
            allowed_ips: vec![net("10.0.0.0/24"), net("fd00::/64")],
        }],
    };

    let server = UapiServer::bind(name).expect("bind /var/run/wireguard");
    let path = server.socket_path().to_path_buf();
    assert_eq!(
        path,
        Path::new(DEFAULT_SOCKET_DIR).join(format!("{name}.sock"))
    );
    assert_eq!(mode(&path), 0o600);
    // A second daemon for the same name is refused while the first one lives.
    let refused = UapiServer::bind(name).expect_err("a second daemon for the same name");
    assert!(
        matches!(&refused, ServerError::Claim(c) if matches!(c.error, ClaimError::InUse { .. })),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("another network namespace"),
        "{refused}"
    );
    let served = serve(server, device.clone());

    // wg lists userspace interfaces by their socket.
    let interfaces = wg_ok(&["show", "interfaces"]).await;
    assert!(
        interfaces.split_whitespace().any(|i| i == name),
        "{interfaces}"
    );

    // `wg show <name> dump`: the interface line, then one tab-separated line per peer.
    let dump = wg_ok(&["show", name, "dump"]).await;
    let lines: Vec<Vec<&str>> = dump.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(lines.len(), 2, "{dump}");
    assert_eq!(
        lines[0],
        vec![
            private.expose_base64().as_str(),
            private.public_key().to_base64().as_str(),
            "51820",
            "0x51"
        ]
    );
    let handshake_secs = handshake
        .duration_since(UNIX_EPOCH)
        .expect("after epoch")
        .as_secs()
        .to_string();
    assert_eq!(
        lines[1],
        vec![
            peer_a.to_base64().as_str(),
            peer_a_psk.expose_base64().as_str(),
            "198.51.100.7:51820",
            "10.0.0.0/24,fd00::/64",
            handshake_secs.as_str(),
            "654321",
            "123456",
            "25"
        ]
    );

    // The human-readable view.
    let show = wg_ok(&["show", name]).await;
    for expected in [
        format!("interface: {name}"),
        format!("public key: {}", private.public_key()),
        "private key: (hidden)".to_string(),
        "listening port: 51820".to_string(),
        "fwmark: 0x51".to_string(),
        format!("peer: {peer_a}"),
        "preshared key: (hidden)".to_string(),
        "endpoint: 198.51.100.7:51820".to_string(),
        "allowed ips: 10.0.0.0/24, fd00::/64".to_string(),
        "latest handshake: 3".to_string(), // "30 seconds ago" or a second more
        "transfer: 638.99 KiB received, 120.56 KiB sent".to_string(),
        "persistent keepalive: every 25 seconds".to_string(),
    ] {
        assert!(show.contains(&expected), "missing {expected:?} in:\n{show}");
    }

    let conf = wg_ok(&["showconf", name]).await;
    for expected in [
        format!("PrivateKey = {}", private.expose_base64()),
        "ListenPort = 51820".to_string(),
        "FwMark = 0x51".to_string(),
        format!("PublicKey = {peer_a}"),
        format!("PresharedKey = {}", peer_a_psk.expose_base64()),
        "AllowedIPs = 10.0.0.0/24, fd00::/64".to_string(),
        "Endpoint = 198.51.100.7:51820".to_string(),
        "PersistentKeepalive = 25".to_string(),
    ] {
        assert!(conf.contains(&expected), "missing {expected:?} in:\n{conf}");
    }
    assert!(
        device.take_updates().is_empty(),
        "show and showconf only read"
    );

    // Add a peer.
    let b = peer_b.to_base64();
    wg_ok(&[
        "set",
        name,
        "peer",
        &b,
        "allowed-ips",
        "10.9.0.0/24,fd00::/64",
        "endpoint",
        "127.0.0.1:5000",
        "persistent-keepalive",
        "25",
    ])
    .await;
    let updates = device.take_updates();
    assert_eq!(updates.len(), 1, "{updates:?}");
    let update = &updates[0];
    assert_eq!(
        (
            &update.private_key,
            update.listen_port,
            update.fwmark,
            update.replace_peers
        ),
        (&None, None, None, false)
    );
    assert_eq!(update.peers.len(), 1);
    let p = &update.peers[0];
    assert_eq!(p.public_key, peer_b);
    assert!(!p.remove && !p.update_only);
    assert_eq!(p.endpoint, Some("127.0.0.1:5000".parse().expect("addr")));
    assert_eq!(p.persistent_keepalive, Some(25));
    // `wg set ... allowed-ips` replaces the list rather than adding to it.
    assert!(p.replace_allowed_ips);
    assert_eq!(p.allowed_ips, vec![net("10.9.0.0/24"), net("fd00::/64")]);
    assert_eq!(p.preshared_key, None);
    // fd00::/64 moved from peer A to peer B, as in WireGuard's routing table.
    let dump = wg_ok(&["show", name, "allowed-ips"]).await;
    assert!(dump.contains(&format!("{peer_a}\t10.0.0.0/24\n")), "{dump}");
    assert!(
        dump.contains(&format!("{b}\t10.9.0.0/24 fd00::/64\n")),
        "{dump}"
    );

    // Change the private key and the port.
    let key_dir = std::env::temp_dir().join(format!("tg-uapi-wg-{}", std::process::id()));
    std::fs::create_dir_all(&key_dir).expect("key dir");
    let key_file = key_dir.join("private.key");
    let new_private = SecretKey([0x55; 32]);
    std::fs::write(&key_file, format!("{}\n", new_private.expose_base64())).expect("key file");
    wg_ok(&[
        "set",
        name,
        "private-key",
        key_file.to_str().expect("utf8 path"),
        "listen-port",
        "4444",
    ])
    .await;
    let _ = std::fs::remove_dir_all(&key_dir);
    let updates = device.take_updates();
    assert_eq!(updates.len(), 1);
    assert_eq!(updates[0].private_key, Some(Some(new_private.clone())));
    assert_eq!(updates[0].listen_port, Some(4444));
    assert!(updates[0].peers.is_empty());
    let listen = wg_ok(&["show", name, "listen-port"]).await;
    assert_eq!(listen.trim(), "4444");
    let public = wg_ok(&["show", name, "public-key"]).await;
    assert_eq!(public.trim(), new_private.public_key().to_base64());

    // Remove the peer.
    wg_ok(&["set", name, "peer", &b, "remove"]).await;
    let updates = device.take_updates();
    assert_eq!(updates.len(), 1);
    assert_eq!(updates[0].peers.len(), 1);
    assert_eq!(updates[0].peers[0].public_key, peer_b);
    assert!(updates[0].peers[0].remove);
    let peers = wg_ok(&["show", name, "peers"]).await;
    assert_eq!(peers.trim(), peer_a.to_base64());

    // A refusal reaches the user with the right message: this is why errno is negated.
    *device.refuse.lock().expect("lock") = Some(Errno::EADDRINUSE);
    let (ok, _, stderr) = wg(&["set", name, "listen-port", "1"]).await;
    assert!(!ok);
    assert!(stderr.contains("Address already in use"), "{stderr}");
    *device.refuse.lock().expect("lock") = None;

    served.shutdown().await;
    assert!(!path.exists(), "socket removed on shutdown");
    let (ok, _, _) = wg(&["show", name]).await;
    assert!(!ok, "wg no longer finds {name}");
}
