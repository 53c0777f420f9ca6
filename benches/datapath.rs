//! Criterion micro-benchmarks of the per-packet path: encapsulate and decapsulate one packet
//! through `core::wg`, and the allowed-IP longest-prefix match with 1, 100 and 10,000 prefixes.

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use rand_core::OsRng;
use std::hint::black_box;
use std::net::IpAddr;
use tunnelgate::config::{IpNet, SecretKey};
use tunnelgate::core::allowed_ips::AllowedIps;
use tunnelgate::core::wg::{classify, Limiter, Outcome, Tunnel};
use tunnelgate::shell::keys::GenerateKey as _;

/// Two tunnels with an established session: a's initiation, b's response, a's first data.
fn session() -> (Tunnel, Tunnel) {
    let (ka, kb) = (SecretKey::generate(), SecretKey::generate());
    let (la, lb) = (
        Limiter::new(&ka.public_key(), &mut OsRng),
        Limiter::new(&kb.public_key(), &mut OsRng),
    );
    let mut a = Tunnel::new(&ka, &kb.public_key(), None, None, 1, &la, Box::new(OsRng));
    let mut b = Tunnel::new(&kb, &ka.public_key(), None, None, 2, &lb, Box::new(OsRng));
    let src: IpAddr = "192.0.2.1".parse().expect("ip");
    let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
    let init = match a.initiate(&mut buf) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("no initiation: {other:?}"),
    };
    let resp = match b.decapsulate(src, &init, &mut out) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("no response: {other:?}"),
    };
    let _ = a.decapsulate(src, &resp, &mut out);
    // b confirms the session when it sees a's first data message (a keepalive).
    let keepalive = match a.encapsulate(&[], &mut buf) {
        Outcome::Network(m) => m.to_vec(),
        other => panic!("no keepalive: {other:?}"),
    };
    let _ = b.decapsulate(src, &keepalive, &mut out);
    (a, b)
}

fn ipv4_packet(len: usize) -> Vec<u8> {
    let mut p = vec![0x42u8; len];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[12..16].copy_from_slice(&[100, 64, 0, 1]);
    p[16..20].copy_from_slice(&[100, 64, 0, 2]);
    p
}

fn crypto(c: &mut Criterion) {
    let (mut a, mut b) = session();
    let src: IpAddr = "192.0.2.1".parse().expect("ip");
    let mut group = c.benchmark_group("packet");
    for len in [64usize, 1420] {
        let packet = ipv4_packet(len);
        let mut out = vec![0u8; len + 64];
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_with_input(BenchmarkId::new("encapsulate", len), &len, |bench, _| {
            bench.iter(|| match a.encapsulate(black_box(&packet), &mut out) {
                Outcome::Network(m) => m.len(),
                _ => 0,
            })
        });
        // Every decapsulation needs a fresh counter (a replay is rejected early, and would
        // measure nothing): encrypt outside the timed part.
        let mut plain = vec![0u8; len + 64];
        group.bench_with_input(BenchmarkId::new("decapsulate", len), &len, |bench, _| {
            bench.iter_batched_ref(
                || match a.encapsulate(&packet, &mut out) {
                    Outcome::Network(m) => m.to_vec(),
                    other => panic!("{other:?}"),
                },
                |message| match b.decapsulate(src, black_box(message), &mut plain) {
                    Outcome::Tunnel(p, _) => p.len(),
                    other => panic!("decapsulate failed: {other:?}"),
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// `classify` of a data message: the check every received datagram passes before any
/// decryption.
fn classify_data_message(c: &mut Criterion) {
    let src: IpAddr = "192.0.2.1".parse().expect("ip");
    let key = SecretKey::generate();
    let limiter = Limiter::new(&key.public_key(), &mut OsRng);
    let data = {
        let (mut a, _) = session();
        let mut out = vec![0u8; 2048];
        match a.encapsulate(&ipv4_packet(1420), &mut out) {
            Outcome::Network(m) => m.to_vec(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(data[0], 4, "the classify benchmark needs a data message");
    let mut cookie = [0u8; 64];
    let public = key.public_key();
    c.bench_function("classify data message", |bench| {
        bench.iter(|| classify(&limiter, &key, &public, src, black_box(&data), &mut cookie))
    });
}

fn lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("allowed_ips lookup");
    for n in [1u32, 100, 10_000] {
        let mut table = AllowedIps::default();
        // A realistic mix: one /32 per peer plus a /24 each, in 10.0.0.0/8 and fd00::/8.
        for i in 0..n {
            let b = i.to_be_bytes();
            let host: IpNet = format!("100.{}.{}.{}/32", b[1], b[2], b[3])
                .parse()
                .expect("net");
            let net: IpNet = format!("10.{}.{}.0/24", b[2], b[3]).parse().expect("net");
            table.insert(host, i);
            table.insert(net, i);
        }
        let probes: Vec<IpAddr> = (0..1024u32)
            .map(|i| {
                let x = (i * 7919) % n.max(1);
                let b = x.to_be_bytes();
                format!("10.{}.{}.77", b[2], b[3]).parse().expect("ip")
            })
            .collect();
        let mut k = 0;
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| {
                k = (k + 1) % probes.len();
                table.lookup(black_box(probes[k])).copied()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, crypto, classify_data_message, lookup);
criterion_main!(benches);
