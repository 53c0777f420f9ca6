//! The bodies of the fuzz targets: bytes in, every pure parser and packet decision exercised.
//!
//! Not an API, and not in the daemon's build: compiled only with the `fuzzing` feature, which the
//! fuzz crate (`fuzz/`) and `--all-features` turn on. Each `fuzz/fuzz_targets/*.rs` is one line
//! around a function here, and
//! `tests/fuzz_smoke.rs` feeds the same functions a seeded, mutated corpus on stable Rust, so
//! CI runs the same bodies with or without cargo-fuzz. A body panics only on a bug: every
//! input, however malformed, must be answered with an error or a result.

use crate::config::{Config, PortMap, PublicKey, SecretFiles, SecretKey, Target};
use crate::core::allowed_ips::AllowedIps;
use crate::core::offload::{self, Coalescer, VNET_HDR_LEN};
use crate::core::packet::{self, PeerLookup, Sender};
use crate::core::wg::{self, Limiter, Outcome, Randomness, Tunnel, MIN_OUTPUT};
use crate::rules::desired::{desired, RuntimeFacts};
use crate::rules::{iptables, nft, Family};
use crate::uapi::{
    format_get, format_set, parse_get_response, parse_request, DeviceSnapshot, PeerSnapshot,
    Request,
};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::OnceLock;

/// The daemon's key in every receive-path input; the known peer's key.
const OWN_KEY: [u8; 32] = [0x11; 32];
const PEER_KEY: [u8; 32] = [0x22; 32];
const PEER_INDEX: u32 = 5;

/// Key files: any path reads as one fixed key, so a config naming a file validates.
struct OneKeyFile;

impl SecretFiles for OneKeyFile {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Ok(SecretKey(OWN_KEY).expose_base64())
    }
}

/// Config text -> `Config::parse`; a valid config also goes through the rule model and both
/// renderers, with two answers for every DNS-named target.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::parse(text, Path::new("/etc/tunnelgate"), &OneKeyFile) else {
        return;
    };
    let resolved: BTreeMap<String, Vec<IpAddr>> = config
        .ingress
        .iter()
        .chain(&config.egress)
        .filter_map(|f| match &f.target {
            Target::Fqdn(name) => Some((
                name.clone(),
                vec![
                    IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10)),
                    IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 10)),
                ],
            )),
            Target::Ip(_) => None,
        })
        .collect();
    let facts = RuntimeFacts::fresh_start(&config, config.interface.listen_port);
    let set = desired(&config, &facts, &resolved);
    let _ = nft::render(&set);
    for family in [Family::V4, Family::V6] {
        let _ = iptables::render(&set, family, &Default::default());
    }
}

/// The key files of a fuzzed wg-quick import, read back from what the import returned.
struct ImportedKeys(BTreeMap<String, String>);

impl SecretFiles for ImportedKeys {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&*path.to_string_lossy())
            .cloned()
            .ok_or_else(|| "not written by the import".to_string())
    }
}

/// The longest error line a wg-quick import may print: values are quoted as short excerpts.
const MAX_IMPORT_ERROR_BYTES: usize = 1024;

/// wg-quick INI text -> `parse_ini` and `import`, its first line also the source path named in
/// the header comment. An import that succeeds is a config `Config::parse` accepts with the
/// keys it returned, whose only comment is its one header line; every error is short.
pub fn wg_quick(data: &[u8]) {
    use crate::config::wgquick::{import, parse_ini, KeyFiles};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let ini = match parse_ini(text) {
        Ok(ini) => ini,
        Err(e) => {
            let shown = e.to_string();
            assert!(shown.len() < MAX_IMPORT_ERROR_BYTES, "{shown}");
            return;
        }
    };
    let psk = |i: usize| format!("/etc/wireguard/wg0.peer{i}.psk");
    let files = KeyFiles {
        private_key: "/etc/wireguard/wg0.key",
        preshared_key: &psk,
    };
    let source = text.lines().next().unwrap_or_default();
    match import(&ini, "wg0", source, &files) {
        Ok(imported) => {
            for u in &imported.unmapped {
                let shown = u.to_string();
                assert!(shown.len() < MAX_IMPORT_ERROR_BYTES, "{shown}");
            }
            let mut keys = BTreeMap::from([(
                files.private_key.to_string(),
                imported.private_key.expose_base64(),
            )]);
            for (i, k) in &imported.preshared_keys {
                keys.insert(psk(*i), k.expose_base64());
            }
            if let Err(e) = Config::parse(&imported.toml, Path::new("/"), &ImportedKeys(keys)) {
                panic!(
                    "the import wrote a config check refuses: {e}\n{}",
                    imported.toml
                );
            }
            let comments = imported
                .toml
                .lines()
                .filter(|l| l.trim_start().starts_with('#'))
                .count();
            assert_eq!(comments, 1, "{}", imported.toml);
        }
        Err(errors) => {
            for e in errors {
                let shown = e.to_string();
                assert!(shown.len() < MAX_IMPORT_ERROR_BYTES, "{shown}");
            }
        }
    }
}

/// The device a fuzzed `set` is applied to: a key, a port, a mark and two peers (keys
/// `22..22` and `33..33` in hex, as in `fuzz/corpus/uapi/`) holding allowed IPs, so `remove`,
/// `update_only`, `replace_peers` and `replace_allowed_ips` have something to act on.
fn uapi_device() -> DeviceSnapshot {
    let peer = |key: [u8; 32], nets: &[&str]| {
        let mut p = PeerSnapshot::new(PublicKey(key));
        p.allowed_ips = nets.iter().filter_map(|n| n.parse().ok()).collect();
        p.endpoint = Some(SocketAddr::from(([192, 0, 2, 1], 51820)));
        p
    };
    DeviceSnapshot {
        private_key: Some(SecretKey(OWN_KEY)),
        listen_port: 51820,
        fwmark: Some(51820),
        peers: vec![
            peer(PEER_KEY, &["10.9.0.2/32", "fd00::2/128"]),
            peer([0x33; 32], &["10.9.1.0/24", "::/0"]),
        ],
    }
}

/// A UAPI request -> `uapi::parse_request`; a `set` is applied to the device model
/// (`DeviceSnapshot::apply`) and must:
/// - print as the request `wg set` would send (`format_set`), which parses back to itself;
/// - read back through `get` (`format_get`, then `parse_get_response`) as the device it made;
/// - leave the device's own keys as set, each peer's last section in effect (a removed peer
///   gone; a created or updated one holding the endpoint, keepalive and preshared key it was
///   given), no peer with the device's own public key, and no prefix routed to two peers.
pub fn uapi(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(Request::Set(update)) = parse_request(text) else {
        return;
    };
    let again = parse_request(&format_set(&update));
    assert_eq!(again.as_ref().ok(), Some(&Request::Set(update.clone())));
    let mut device = uapi_device();
    device.apply(&update);
    let read = parse_get_response(&format_get(&device));
    assert_eq!(
        read.as_ref().ok(),
        Some(&device),
        "get does not read back the set"
    );
    if let Some(key) = &update.private_key {
        assert_eq!(&device.private_key, key);
    }
    if let Some(port) = update.listen_port {
        assert_eq!(device.listen_port, port);
    }
    if let Some(mark) = update.fwmark {
        assert_eq!(device.fwmark, mark);
    }
    let own = device.private_key.as_ref().map(SecretKey::public_key);
    for (i, change) in update.peers.iter().enumerate() {
        let later = update.peers[i + 1..].iter();
        if Some(change.public_key) == own
            || later.clone().any(|c| c.public_key == change.public_key)
        {
            continue;
        }
        let found = device
            .peers
            .iter()
            .find(|p| p.public_key == change.public_key);
        if change.remove {
            assert!(found.is_none(), "a removed peer is still there");
            continue;
        }
        let Some(peer) = found else {
            assert!(
                change.update_only,
                "a peer set without update_only is missing"
            );
            continue;
        };
        if let Some(endpoint) = change.endpoint {
            assert_eq!(peer.endpoint, Some(endpoint));
        }
        if let Some(secs) = change.persistent_keepalive {
            assert_eq!(peer.persistent_keepalive, (secs != 0).then_some(secs));
        }
        if let Some(psk) = &change.preshared_key {
            assert_eq!(&peer.preshared_key, psk);
        }
    }
    let mut routed = std::collections::BTreeSet::new();
    for peer in &device.peers {
        assert_ne!(
            Some(peer.public_key),
            own,
            "a peer has the device's own key"
        );
        for net in &peer.allowed_ips {
            assert!(routed.insert(*net), "{net} is routed to two peers");
        }
    }
}

/// A port spec -> `PortMap`; a parsed spec must print as text that parses back to itself.
pub fn ports(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(map) = text.parse::<PortMap>() {
        let again: Result<PortMap, _> = map.to_string().parse();
        assert_eq!(again, Ok(map), "{text:?} does not survive a round trip");
    }
}

/// One known peer, as the shell's peer table would answer.
struct OnePeer {
    key: PublicKey,
    routes: AllowedIps<usize>,
}

impl PeerLookup for OnePeer {
    type Peer = usize;
    fn by_key(&self, key: &PublicKey) -> Option<&usize> {
        (*key == self.key).then_some(&0)
    }
    fn by_index(&self, index: u32) -> Option<&usize> {
        (index == PEER_INDEX).then_some(&0)
    }
    fn by_address(&self, addr: IpAddr) -> Option<&usize> {
        self.routes.lookup(addr)
    }
    fn same(a: &usize, b: &usize) -> bool {
        a == b
    }
}

/// A handshake initiation from the known peer to the daemon (valid mac1), made once.
fn valid_initiation() -> &'static [u8] {
    static INIT: OnceLock<Vec<u8>> = OnceLock::new();
    INIT.get_or_init(|| {
        let peer = SecretKey(PEER_KEY);
        let own_public = SecretKey(OWN_KEY).public_key();
        let limiter = Limiter::new(&peer.public_key(), &mut FuzzRng(1));
        let mut tunnel = Tunnel::new(
            &peer,
            &own_public,
            None,
            None,
            9,
            &limiter,
            FuzzRng::boxed(2),
        );
        let mut buf = vec![0u8; MIN_OUTPUT];
        match tunnel.initiate(&mut buf) {
            Outcome::Network(m) => m.to_vec(),
            _ => Vec::new(),
        }
    })
}

/// A datagram from the network -> `packet::identify` (`wg::classify`) and, for the known peer,
/// `packet::decapsulate` on a fresh session. The first byte picks the datagram: odd = the
/// bytes after it; even = a valid handshake initiation with the rest XOR-ed in as
/// (offset, value) pairs, truncated when bit 1 is set, so the fuzzer gets past mac1.
pub fn receive(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let datagram = if mode & 1 == 1 {
        rest.to_vec()
    } else {
        let mut d = valid_initiation().to_vec();
        if d.is_empty() {
            return;
        }
        for pair in rest.chunks_exact(2) {
            let at = usize::from(pair[0]) % d.len();
            d[at] ^= pair[1];
        }
        if mode & 2 != 0 {
            d.truncate(rest.len() % (d.len() + 1));
        }
        d
    };
    let own_private = SecretKey(OWN_KEY);
    let own_public = own_private.public_key();
    let peer_public = SecretKey(PEER_KEY).public_key();
    let limiter = Limiter::new(&own_public, &mut FuzzRng(3));
    let mut routes = AllowedIps::default();
    if let Ok(net) = "10.9.0.2/32".parse() {
        routes.insert(net, 0);
    }
    let peers = OnePeer {
        key: peer_public,
        routes,
    };
    let from = SocketAddr::from(([192, 0, 2, 1], 51820));
    let mut cookie = [0u8; MIN_OUTPUT];
    match packet::identify(
        &peers,
        &limiter,
        &own_private,
        &own_public,
        from,
        &datagram,
        &mut cookie,
    ) {
        Ok(Sender::Peer(_)) => {}
        Ok(Sender::Cookie(len)) => {
            assert!(len <= cookie.len());
            return;
        }
        Err(_) => return,
    }
    let mut tunnel = Tunnel::new(
        &own_private,
        &peer_public,
        None,
        None,
        PEER_INDEX,
        &limiter,
        FuzzRng::boxed(4),
    );
    let mut landing = vec![0u8; datagram.len().max(MIN_OUTPUT)];
    let received = packet::decapsulate(&peers, &0, &mut tunnel, from, &datagram, &mut landing);
    if let packet::Inbound::Deliver(len) | packet::Inbound::Reply(len) = received.action {
        assert!(len <= landing.len());
    }
}

/// A deterministic stand-in for the OS's generator (splitmix64), so that an input replays
/// exactly: handshakes draw their ephemeral keys and rate limiters their cookie secrets from
/// it. Predictable: for fuzz bodies only, never for a real session.
struct FuzzRng(u64);

impl FuzzRng {
    fn boxed(seed: u64) -> Randomness {
        Box::new(FuzzRng(seed))
    }
}

impl rand_core::RngCore for FuzzRng {
    fn next_u32(&mut self) -> u32 {
        self.next_u64() as u32
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for chunk in dest.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand_core::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

impl rand_core::CryptoRng for FuzzRng {}

/// At most this many operations of a `session` input, and handshakes among them (each costs
/// a few Diffie-Hellmans).
const SESSION_OPS: usize = 256;
const SESSION_REKEYS: usize = 12;
/// boringtun's replay window (counters this far behind the newest still accepted once) and
/// the sessions a tunnel keeps (a ring of 8, indexed by our session index).
const REPLAY_WINDOW: u64 = 1024;
const KEPT_SESSIONS: usize = 8;

/// One data message the remote peer sent: the handshake (session) it was sealed on, its
/// counter and its plaintext.
struct Sent {
    session: usize,
    counter: u64,
    message: Vec<u8>,
    plaintext: Vec<u8>,
}

/// The local side's view of the remote's sessions: per handshake, the counters it accepted
/// and the next counter its window expects.
#[derive(Default)]
struct Accepted {
    seen: std::collections::HashSet<(usize, u64)>,
    next: Vec<u64>,
}

/// Transport sessions under hostile delivery, through the daemon's data path (`wg::Tunnel`'s
/// `reserve_send`/`SealBatch`, `receiving`/`OpenKey`, `packet::opened`). The remote seals data
/// messages for the local side; the input is a list of two-byte operations `[op, arg]`
/// (`op % 6`; `op / 8` is a second argument):
/// - 0: the remote reserves a batch of `1 + arg % 8` counters and seals it in a rotated order
///   (as parallel workers might finish);
/// - 1: the same, with a rekey (a whole handshake) after the first half is sealed: the rest
///   is sealed on the old session;
/// - 2: deliver sent message `arg` (again: a replay; late: reordered), opened by copy or in
///   place (`op / 8` odd);
/// - 3: deliver it with its counter moved by `1 + op / 8` (outside what was sealed);
/// - 4: deliver it with one bit flipped (`arg` and `op / 8` pick where);
/// - 5: a rekey; after eight, the oldest session is retired and its messages find none.
///
/// Checks: a message is delivered only if it is genuine, its session is still kept, and its
/// counter was not delivered before; then its plaintext is what was sealed; and a genuine,
/// undelivered message of the newest session within the replay window is delivered.
pub fn session(data: &[u8]) {
    let remote_private = SecretKey(PEER_KEY);
    let own_private = SecretKey(OWN_KEY);
    let own_public = own_private.public_key();
    let peer_public = remote_private.public_key();
    let mut routes = AllowedIps::default();
    if let Ok(net) = "10.9.0.0/24".parse() {
        routes.insert(net, 0);
    }
    let peers = OnePeer {
        key: peer_public,
        routes,
    };
    let (local_limiter, remote_limiter) = (
        Limiter::new(&own_public, &mut FuzzRng(5)),
        Limiter::new(&peer_public, &mut FuzzRng(6)),
    );
    let mut local = Tunnel::new(
        &own_private,
        &peer_public,
        None,
        None,
        PEER_INDEX,
        &local_limiter,
        FuzzRng::boxed(7),
    );
    let mut remote = Tunnel::new(
        &remote_private,
        &own_public,
        None,
        None,
        9,
        &remote_limiter,
        FuzzRng::boxed(8),
    );
    let mut accepted = Accepted::default();
    let mut sessions = 0usize;
    rekey(
        &mut remote,
        &mut local,
        &peers,
        &mut sessions,
        &mut accepted,
    );
    let mut sent: Vec<Sent> = Vec::new();
    for op in data.chunks_exact(2).take(SESSION_OPS) {
        let (kind, arg, high) = (op[0] % 6, usize::from(op[1]), usize::from(op[0] / 8));
        match kind {
            0 | 1 => {
                let n = 1 + arg % 8;
                let rekey_after = (kind == 1 && sessions <= SESSION_REKEYS).then_some(n / 2);
                seal_batch(
                    &mut remote,
                    &mut local,
                    &peers,
                    n,
                    arg,
                    rekey_after,
                    &mut sessions,
                    &mut accepted,
                    &mut sent,
                );
            }
            5 if sessions <= SESSION_REKEYS => rekey(
                &mut remote,
                &mut local,
                &peers,
                &mut sessions,
                &mut accepted,
            ),
            5 => {}
            _ => {
                let Some(which) = (!sent.is_empty()).then(|| arg % sent.len()) else {
                    continue;
                };
                let entry = &sent[which];
                let mut message = entry.message.clone();
                let genuine = match kind {
                    2 => true,
                    3 => {
                        let counter = entry.counter.wrapping_add(1 + high as u64);
                        message[8..16].copy_from_slice(&counter.to_le_bytes());
                        false
                    }
                    _ => {
                        let bit = (arg * 31 + high) % (message.len() * 8);
                        message[bit / 8] ^= 1 << (bit % 8);
                        false
                    }
                };
                let delivered = deliver(&mut local, &peers, &message, high % 2 == 1);
                let (session, counter) = (entry.session, entry.counter);
                let kept = sessions - session <= KEPT_SESSIONS;
                let next = accepted.next.get(session).copied().unwrap_or(0);
                let fresh = !accepted.seen.contains(&(session, counter));
                match delivered {
                    Some(plaintext) => {
                        assert!(genuine, "a forged or altered message was delivered");
                        assert!(kept, "a message of a retired session was delivered");
                        assert!(
                            fresh,
                            "counter {counter} of session {session} delivered twice"
                        );
                        assert_eq!(
                            plaintext, entry.plaintext,
                            "delivered, but not what was sealed"
                        );
                        accepted.seen.insert((session, counter));
                        if let Some(n) = accepted.next.get_mut(session) {
                            *n = (*n).max(counter + 1);
                        }
                    }
                    None => assert!(
                        !(genuine
                            && fresh
                            && session == sessions
                            && counter + REPLAY_WINDOW >= next),
                        "counter {counter} of the newest session (next {next}) was refused"
                    ),
                }
            }
        }
    }
}

/// A whole handshake the remote starts, and its first keepalive, delivered: session
/// `sessions + 1` is then both sides' newest.
fn rekey(
    remote: &mut Tunnel,
    local: &mut Tunnel,
    peers: &OnePeer,
    sessions: &mut usize,
    accepted: &mut Accepted,
) {
    let from = SocketAddr::from(([192, 0, 2, 1], 51820));
    let mut buf = vec![0u8; 2048];
    let mut landing = vec![0u8; 2048];
    let init = match remote.initiate(&mut buf) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("the remote did not initiate: {other:?}"),
    };
    let received = packet::decapsulate(peers, &0, local, from, &init, &mut landing);
    let packet::Inbound::Reply(len) = received.action else {
        panic!("the local side did not answer: {:?}", received.action);
    };
    let keepalive = match remote.decapsulate(from.ip(), &landing[..len], &mut buf) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("the remote did not confirm: {other:?}"),
    };
    *sessions += 1;
    accepted.next.resize(*sessions + 1, 0);
    assert_eq!(
        deliver(local, peers, &keepalive, false),
        None,
        "a keepalive delivers nothing"
    );
    accepted.next[*sessions] = 1;
    accepted.seen.insert((*sessions, 0));
}

/// The remote seals `n` messages on one reservation, in a rotated order, with a rekey after
/// `rekey_after` of them.
#[allow(clippy::too_many_arguments)]
fn seal_batch(
    remote: &mut Tunnel,
    local: &mut Tunnel,
    peers: &OnePeer,
    n: usize,
    arg: usize,
    rekey_after: Option<usize>,
    sessions: &mut usize,
    accepted: &mut Accepted,
    sent: &mut Vec<Sent>,
) {
    let plaintexts: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            let mut p = vec![0u8; 20 + (arg * 7 + i * 13) % 200];
            let len = p.len() as u16;
            p[0] = 0x45;
            p[2..4].copy_from_slice(&len.to_be_bytes());
            p[9] = 17;
            p[12..16].copy_from_slice(&[10, 9, 0, 2]);
            p[16..20].copy_from_slice(&[10, 9, 0, 1]);
            for (k, b) in p[20..].iter_mut().enumerate() {
                *b = (k + i + sent.len()) as u8;
            }
            p
        })
        .collect();
    let bytes = plaintexts.iter().map(Vec::len).sum();
    let Some(batch) = remote.reserve_send(n, bytes) else {
        panic!("the remote has a session");
    };
    let session = *sessions;
    let mut sealed: Vec<Option<Vec<u8>>> = vec![None; n];
    for k in 0..n {
        if rekey_after == Some(k) {
            rekey(remote, local, peers, sessions, accepted);
        }
        let i = (k + arg / 8) % n;
        let mut message = vec![0u8; plaintexts[i].len() + wg::OVERHEAD];
        message[wg::DATA_OFFSET..wg::DATA_OFFSET + plaintexts[i].len()]
            .copy_from_slice(&plaintexts[i]);
        let len = batch.seal_in_place(i, &mut message, plaintexts[i].len());
        assert_eq!(len, message.len());
        sealed[i] = Some(message);
    }
    for (i, (message, plaintext)) in sealed.into_iter().zip(plaintexts).enumerate() {
        if let Some(message) = message {
            sent.push(Sent {
                session,
                counter: batch.counter(i),
                message,
                plaintext,
            });
        }
    }
}

/// One datagram into the local side as the daemon's receive path takes it: a data message of a
/// kept session is opened outside the peer (by copy or in place) and then recorded; anything
/// else goes through the peer whole. Returns the delivered packet.
fn deliver(local: &mut Tunnel, peers: &OnePeer, message: &[u8], in_place: bool) -> Option<Vec<u8>> {
    let from = SocketAddr::from(([192, 0, 2, 1], 51820));
    let mut landing = vec![0u8; message.len().max(MIN_OUTPUT)];
    let Some(key) = local.receiving(message) else {
        let received = packet::decapsulate(peers, &0, local, from, message, &mut landing);
        return match received.action {
            packet::Inbound::Deliver(len) => Some(landing[..len].to_vec()),
            _ => None,
        };
    };
    let (opened, plaintext) = if in_place {
        landing[..message.len()].copy_from_slice(message);
        let opened = key.open_in_place(&mut landing[..message.len()]).ok()?;
        (opened, &landing[wg::DATA_OFFSET..])
    } else {
        let opened = key.open(message, &mut landing).ok()?;
        (opened, &landing[..])
    };
    assert!(
        opened.len + wg::OVERHEAD == message.len(),
        "the plaintext is the message's"
    );
    let received = packet::opened(peers, &0, local, &opened, plaintext);
    match received.action {
        packet::Inbound::Deliver(len) => Some(plaintext[..len].to_vec()),
        _ => None,
    }
}

/// Offload: the first byte picks split (even) or coalesce (odd).
///
/// Split: the rest is one TUN read (virtio header, then a packet): every planned segment must
/// lie inside the read. Coalesce: the rest is a list of `[len_hi, len_lo, flags, bytes..]`
/// packets landed as decrypted datagrams (each fixed up, as boringtun guarantees, so its IP
/// length field matches its length); every drained super-packet must split back.
pub fn offload(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let mut read = rest.to_vec();
        split_all(&mut read);
    } else {
        coalesce(mode & 2 != 0, rest);
    }
}

fn split_all(read: &mut [u8]) -> usize {
    let Ok(plan) = offload::plan_split(read) else {
        return 0;
    };
    let count = plan.count();
    for i in 0..count {
        let range = plan.segment(read, i);
        assert!(range.start <= range.end && range.end <= read.len());
    }
    count
}

/// Sets the length fields boringtun checks on a decrypted packet; `false` for what it drops.
fn fix_ip_length(packet: &mut [u8]) -> bool {
    let len = packet.len();
    match packet.first().map(|b| b >> 4) {
        Some(4) if len >= 20 => {
            packet[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            true
        }
        Some(6) if len >= 40 => {
            packet[4..6].copy_from_slice(&((len - 40) as u16).to_be_bytes());
            true
        }
        _ => false,
    }
}

fn coalesce(udp: bool, mut rest: &[u8]) {
    let mut coalescer = Coalescer::new(3, udp);
    let mut written = 0usize;
    let mut check = |super_packet: &[u8]| {
        let mut read = super_packet.to_vec();
        assert!(read.len() >= VNET_HDR_LEN);
        assert!(
            split_all(&mut read) >= 1,
            "a drained super-packet must split"
        );
        written += 1;
    };
    while rest.len() >= 3 {
        let want = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let flags = rest[2];
        rest = &rest[3..];
        let len = want.min(rest.len()).min(u16::MAX as usize);
        let (bytes, tail) = rest.split_at(len);
        rest = tail;
        if coalescer.needs_drain() {
            coalescer.drain(&mut check);
        }
        // A datagram is the packet plus WireGuard's 32 bytes of overhead.
        let landing = coalescer.landing(len + 32);
        if landing.len() < len {
            coalescer.abandon();
            continue;
        }
        landing[..len].copy_from_slice(bytes);
        if flags & 1 == 0 && fix_ip_length(&mut landing[..len]) {
            coalescer.commit(len);
        } else {
            coalescer.abandon();
        }
    }
    coalescer.drain(&mut check);
}

/// The sidecar's renderer: the input is lines `type`, `cluster IPs` (comma-separated),
/// `annotations` (`k=v;k=v`), `ports` (`name,port,target,proto;..`, a non-numeric target is a
/// named port), then the base config text. A rendered config must be one the daemon accepts.
#[cfg(feature = "sidecar")]
pub fn sidecar(data: &[u8]) {
    use crate::sidecar::{render, ServiceInfo, ServicePort, TargetPort, KEY_CONFIG};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.splitn(5, '\n');
    let mut next = || lines.next().unwrap_or("");
    let type_ = Some(next().to_string()).filter(|t| !t.is_empty());
    let cluster_ips = next()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let annotations = next()
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let ports = next()
        .split(';')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut f = p.split(',');
            let name = f.next().filter(|s| !s.is_empty()).map(String::from);
            let port = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
            let target_port = f.next().filter(|s| !s.is_empty()).map(|t| match t.parse() {
                Ok(n) => TargetPort::Number(n),
                Err(_) => TargetPort::Name(t.to_string()),
            });
            let protocol = f.next().filter(|s| !s.is_empty()).map(String::from);
            ServicePort {
                name,
                port,
                target_port,
                protocol,
            }
        })
        .collect();
    let base = next();
    let svc = ServiceInfo {
        namespace: "default".into(),
        name: "web".into(),
        type_,
        cluster_ips,
        external_name: Some("web.example.com".into()),
        load_balancer_class: None,
        annotations,
        ports,
        load_balancer_ingress: Vec::new(),
        created: None,
    };
    let Ok(rendered) = render(&svc, base, &BTreeMap::new(), || SecretKey(OWN_KEY)) else {
        return;
    };
    let config = rendered
        .data
        .get(KEY_CONFIG)
        .map(|c| String::from_utf8_lossy(c));
    if let Some(config) = config {
        if let Err(e) = Config::parse(&config, Path::new("/etc/tunnelgate"), &OneKeyFile) {
            panic!("the sidecar rendered a config the daemon rejects: {e}\n{config}");
        }
    }
}
