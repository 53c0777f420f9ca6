//! The fuzz target bodies (`tunnelgate::fuzzing`) on stable Rust: each gets its seeds and then
//! a few thousand seeded mutations of them (bit flips, byte edits, deletions, duplications,
//! splices, parser tokens), so CI catches a panic in a parser even without cargo-fuzz. The seed
//! is fixed, so a failure reproduces; `TUNNELGATE_FUZZ_SEED` and `TUNNELGATE_FUZZ_INPUTS` vary
//! and extend a run. A failing input is printed as hex before the panic is re-raised.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;
use tunnelgate::fuzzing;
use tunnelgate::shell::clock;

/// Each target stops after this many inputs or this long, whichever comes first.
const DEFAULT_INPUTS: usize = 4000;
const TIME_LIMIT: Duration = Duration::from_secs(5);

/// xorshift64*: tiny, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const TOKENS: &[&[u8]] = &[
    b"\n",
    b"=",
    b"\"",
    b"[",
    b"]",
    b",",
    b":",
    b"/",
    b"0",
    b"65535",
    b"65536",
    b"-1",
    b"::",
    b"[[peer]]\n",
    b"[[ingress]]\n",
    b"/udp",
    b"/tcp",
    b"\xff",
    b"set=1\n",
    b"\n\n",
    b"allowed_ip=0.0.0.0/0\n",
    b"public_key=",
    b"255.255.255.255",
    b"ffff::/0",
    b"\"\"\"",
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                input[at] = rng.next() as u8;
            }
            2 => {
                let at = rng.below(len + 1);
                input.insert(at, rng.next() as u8);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = rng.below((len - at).min(16)) + 1;
                input.drain(at..at + n);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = rng.below((len - at).min(32)) + 1;
                let copy = input[at..at + n].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, copy);
            }
            5 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len() + 1);
                let at = rng.below(len + 1);
                input.truncate(at);
                input.extend_from_slice(&other[from..]);
            }
            _ => {
                let token = TOKENS[rng.below(TOKENS.len())];
                let at = rng.below(len + 1);
                input.splice(at..at, token.iter().copied());
            }
        }
    }
}

fn run(name: &str, body: fn(&[u8]), seeds: Vec<Vec<u8>>) {
    let inputs: usize = std::env::var("TUNNELGATE_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_INPUTS);
    let seed: u64 = std::env::var("TUNNELGATE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x7f4a_7c15_9e37_79b9);
    let limit = if std::env::var_os("TUNNELGATE_FUZZ_INPUTS").is_some() {
        Duration::MAX
    } else {
        TIME_LIMIT
    };
    let mut rng = Rng(seed | 1);
    let start = clock::now();
    let mut tried = 0;
    let try_one = |input: &[u8]| {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| body(input))) {
            eprintln!(
                "{name}: crashing input ({} bytes): {}",
                input.len(),
                hex(input)
            );
            resume_unwind(panic);
        }
    };
    for s in &seeds {
        try_one(s);
    }
    while tried < inputs && tunnelgate::shell::clock::since(start) < limit {
        let mut input = seeds[rng.below(seeds.len())].clone();
        mutate(&mut rng, &seeds, &mut input);
        try_one(&input);
        tried += 1;
    }
    eprintln!(
        "{name}: {} seeds, {tried} mutated inputs in {:?}",
        seeds.len(),
        tunnelgate::shell::clock::since(start)
    );
    assert!(tried > 0, "{name}: no mutated input ran");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text_seeds(texts: &[&str]) -> Vec<Vec<u8>> {
    texts.iter().map(|t| t.as_bytes().to_vec()).collect()
}

/// The committed seeds libFuzzer starts from (`fuzz/corpus/<target>/seed-*`), in name order,
/// after `seeds`: the stable run and the fuzzer begin from the same inputs.
fn with_corpus(target: &str, mut seeds: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seed-"))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in {}", dir.display());
    for file in files {
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        seeds.push(bytes);
    }
    seeds
}

const KEY: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

#[test]
fn fuzz_config() {
    let dns = format!(
        "[interface]\nname = \"tg0\"\nprivate_key = \"{KEY}\"\naddresses = [\"100.64.0.1/32\", \"fd00::1/128\"]\n\
         [[peer]]\npublic_key = \"{KEY}\"\nendpoint = \"peer.example:51820\"\nallowed_ips = [\"100.64.0.2/32\"]\n\
         [[ingress]]\ntarget_fqdn = \"db.example\"\nports = [\"5432\", \"53/udp\"]\n\
         [[egress]]\ntarget = \"100.64.0.2\"\n[router]\nexit_node = true\n[dns]\nnameservers = [\"10.0.0.53\"]\n"
    );
    run(
        "config",
        fuzzing::config,
        with_corpus(
            "config",
            text_seeds(&[
                include_str!("../config/minimal.toml"),
                include_str!("../config/example.toml"),
                include_str!("../config/exit-node.toml"),
                include_str!("../config/subnet-router.toml"),
                &dns,
            ]),
        ),
    );
}

#[test]
fn fuzz_uapi() {
    let set = "set=1\nprivate_key=e84b5a6d2717c1003a13b431570353dbaca9146cf150c5f8575680feba52027a\n\
               listen_port=12912\nfwmark=0\nreplace_peers=true\n\
               public_key=b85996fecc9c7f1fc6d2572a76eda11d59bcd20be8e543b15ce4bd85a8e75a33\n\
               preshared_key=188515093e952f5f22e865cef3012e72f8b5f0b598ac0309d5dacce3b70fcf52\n\
               endpoint=[abcd:23::33%2]:51820\nreplace_allowed_ips=true\nallowed_ip=192.168.4.4/32\n\
               persistent_keepalive_interval=25\nprotocol_version=1\n\
               public_key=58402e695ba1772b1cc9309755f043251ea77fdcf10fbe63989ceb7e19321376\n\
               update_only=true\nremove=true\n\n";
    run(
        "uapi",
        fuzzing::uapi,
        with_corpus(
            "uapi",
            text_seeds(&["get=1\n\n", set, "set=1\n\n", "get=1\n"]),
        ),
    );
}

#[test]
fn fuzz_ports() {
    run(
        "ports",
        fuzzing::ports,
        with_corpus(
            "ports",
            text_seeds(&["443", "443:8443/tcp", "53/udp", "1:65535/udp", "80:80"]),
        ),
    );
}

#[test]
fn fuzz_receive() {
    let mut seeds = vec![vec![0u8], vec![2u8, 0, 1, 147, 255], vec![1u8; 149]];
    // A data message header for the known peer's index, and a cookie reply's.
    seeds.push([&[1u8, 4, 0, 0, 0, 5, 0, 0, 0][..], &[0u8; 40][..]].concat());
    seeds.push([&[1u8, 3, 0, 0, 0, 5, 0, 0, 0][..], &[0u8; 56][..]].concat());
    run("receive", fuzzing::receive, with_corpus("receive", seeds));
}

#[test]
fn fuzz_session() {
    // [op, arg] pairs: seal batches, deliver, replay, alter counters, flip bits, rekey.
    let seeds = vec![
        vec![],
        vec![0, 7, 2, 0, 2, 1, 2, 0],
        vec![1, 5, 2, 0, 2, 3, 10, 1, 2, 5, 3, 2, 4, 9],
        [&[0u8, 7][..], &[5, 0].repeat(9), &[2, 0, 2, 3]].concat(),
    ];
    run("session", fuzzing::session, with_corpus("session", seeds));
}

/// An IPv4 TCP packet with `payload` bytes and sequence number `seq`, ACK only.
fn tcp4(seq: u32, payload: usize) -> Vec<u8> {
    let total = 40 + payload;
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&[10, 9, 0, 2]);
    p[16..20].copy_from_slice(&[10, 9, 0, 1]);
    p[20..22].copy_from_slice(&4000u16.to_be_bytes());
    p[22..24].copy_from_slice(&80u16.to_be_bytes());
    p[24..28].copy_from_slice(&seq.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = 0x10;
    p
}

/// An IPv6 UDP packet with `payload` bytes.
fn udp6(payload: usize) -> Vec<u8> {
    let mut p = vec![0u8; 48 + payload];
    p[0] = 0x60;
    p[4..6].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    p[6] = 17;
    p[7] = 64;
    p[8] = 0xfd;
    p[24] = 0xfd;
    p[40..42].copy_from_slice(&5000u16.to_be_bytes());
    p[42..44].copy_from_slice(&53u16.to_be_bytes());
    p
}

#[test]
fn fuzz_offload() {
    // Split: a mode byte, a virtio header (flags, gso type, hdr_len, gso_size, csum start/off).
    let vnet = |flags: u8, gso: u8, size: u16, cstart: u16, coff: u16| {
        let mut h = vec![flags, gso, 0, 40];
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&cstart.to_le_bytes());
        h.extend_from_slice(&coff.to_le_bytes());
        h
    };
    let mut seeds = vec![
        [&[0u8][..], &vnet(1, 1, 100, 20, 16), &tcp4(1, 1000)].concat(),
        [&[0u8][..], &vnet(0, 0, 0, 0, 0), &tcp4(1, 10)].concat(),
        [&[0u8][..], &vnet(1, 5, 1200, 48, 6), &udp6(3000)].concat(),
        [&[0u8][..], &vnet(1, 0, 0, 20, 16), &tcp4(9, 3)].concat(),
    ];
    // Coalesce: a mode byte, then [len_hi, len_lo, flags, packet] entries.
    let mut entries = vec![1u8];
    for (i, p) in [tcp4(1, 100), tcp4(101, 100), tcp4(201, 50), tcp4(7, 10)]
        .iter()
        .enumerate()
    {
        entries.extend_from_slice(&(p.len() as u16).to_be_bytes());
        entries.push(if i == 3 { 1 } else { 0 });
        entries.extend_from_slice(p);
    }
    seeds.push(entries);
    let mut udp = vec![3u8];
    for _ in 0..5 {
        let p = udp6(200);
        udp.extend_from_slice(&(p.len() as u16).to_be_bytes());
        udp.push(0);
        udp.extend_from_slice(&p);
    }
    seeds.push(udp);
    run("offload", fuzzing::offload, with_corpus("offload", seeds));
}

#[test]
fn fuzz_wg_quick() {
    let odd = format!(
        "/tmp/x\n[health]\nlisten = \"0.0.0.0:9002\"\n[Interface]\nPrivateKey = {KEY}\nAddress = 10.0.0.1/24\n\
         [Peer]\nPublicKey = {KEY}\nEndpoint = -oProxyCommand=x:1\nAllowedIPs = 10.0.0.2/32\n"
    );
    run(
        "wg_quick",
        fuzzing::wg_quick,
        with_corpus("wg_quick", text_seeds(&[&odd])),
    );
}

#[cfg(feature = "sidecar")]
#[test]
fn fuzz_sidecar() {
    let base = format!(
        "[interface]\nname = \"tg0\"\nlisten_port = 51820\naddresses = [\"100.64.0.1/32\", \"fd7a:115c:a1e0::1/128\"]\n\
         [[peer]]\npublic_key = \"{KEY}\"\nendpoint = \"198.51.100.7:51820\"\nallowed_ips = [\"100.64.0.2/32\"]\n\
         [health]\nlisten = \"0.0.0.0:9002\"\n"
    );
    let seeds = [
        format!("ClusterIP\n10.96.0.10,fd00::10\ntunnelgate.dev/expose=true\nhttp,80,8080,TCP;dns,53,53,UDP\n{base}"),
        format!("LoadBalancer\n10.96.0.11\n\nweb,443,https,\n{base}"),
        format!("ExternalName\n\ntunnelgate.dev/expose=true;tunnelgate.dev/tunnel-ip=100.64.0.1\n,8080,,SCTP\n{base}"),
        format!("\nNone\n\n,80,80,TCP\n{base}"),
    ];
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    run(
        "sidecar",
        fuzzing::sidecar,
        with_corpus("sidecar", text_seeds(&seeds)),
    );
}

/// A seed the parser refuses stops the fuzzer at the first line, which is what the seeds are
/// there to avoid: each one must get through its target's parser.
#[test]
fn committed_seeds_get_past_the_parsers() {
    use tunnelgate::config::{Config, PortMap, SecretFiles};
    use tunnelgate::uapi::{parse_request, Request};

    struct AnyKeyFile;
    impl SecretFiles for AnyKeyFile {
        fn read_secret(&self, _: &std::path::Path) -> Result<String, String> {
            Ok(KEY.to_string())
        }
    }
    let text = |seed: &[u8]| String::from_utf8(seed.to_vec()).expect("a text seed");
    let mut sets = 0;
    for seed in with_corpus("uapi", Vec::new()) {
        match parse_request(&text(&seed)) {
            Ok(Request::Set(_)) => sets += 1,
            Ok(Request::Get) => {}
            Err(e) => panic!("uapi seed {:?}: {e:?}", text(&seed)),
        }
    }
    assert!(sets >= 5, "{sets} set requests");
    for seed in with_corpus("ports", Vec::new()) {
        let parsed = text(&seed).parse::<PortMap>();
        assert!(parsed.is_ok(), "ports seed {:?}: {parsed:?}", text(&seed));
    }
    for seed in with_corpus("wg_quick", Vec::new()) {
        use tunnelgate::config::wgquick::{import, parse_ini, KeyFiles};
        let text = text(&seed);
        let ini = parse_ini(&text).unwrap_or_else(|e| panic!("wg_quick seed {text}: {e}"));
        let psk = |i: usize| format!("/k/wg0.peer{i}.psk");
        let files = KeyFiles {
            private_key: "/k/wg0.key",
            preshared_key: &psk,
        };
        if let Err(e) = import(&ini, "wg0", "/k/wg0.conf", &files) {
            panic!("wg_quick seed {text}: {e:?}");
        }
    }
    for seed in with_corpus("config", Vec::new()) {
        let parsed = Config::parse(&text(&seed), std::path::Path::new("/"), &AnyKeyFile);
        assert!(
            parsed.is_ok(),
            "config seed {}: {:?}",
            text(&seed),
            parsed.err()
        );
    }
}
