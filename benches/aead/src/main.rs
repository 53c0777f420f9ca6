//! ChaCha20-Poly1305 seal and open, single thread, for ring, aws-lc-rs and OpenSSL 3 (the
//! `openssl` crate over the system's libssl3), each through the interface the data plane would
//! use: a key object made once per session (ring, aws-lc-rs) or a cipher context reused per
//! thread and given the session key and the packet's nonce on every call (OpenSSL, "openssl": a
//! shared session seals with `&self` from several threads, so the context cannot live in the
//! session), plus OpenSSL with the key set once per context ("openssl-ctx-per-session", the
//! best OpenSSL could do with a context per session and thread). Every call seals or opens one packet in place in a buffer allocated once, with
//! WireGuard's nonce (4 zero bytes, the 64-bit counter) and no additional data.
//!
//! Run: `cargo run --release --manifest-path benches/aead/Cargo.toml -- [--seconds S] [--json FILE]`
//! Each (library, operation, size) point runs for S seconds (default 1); the order of the
//! libraries rotates between sizes so none always runs first.

// A stopwatch is what a benchmark is; this crate is its own workspace, without tunnelgate's
// `shell::clock` that the repository's clippy.toml points to.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

const SIZES: [usize; 4] = [64, 512, 1420, 65535];
const TAG: usize = 16;
const KEY: [u8; 32] = [7u8; 32];

fn nonce(counter: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    n
}

/// One candidate: seal `buf[..len]` in place (tag into `buf[len..len + 16]`), and open it back.
trait Aead {
    fn name(&self) -> &'static str;
    fn seal(&mut self, counter: u64, buf: &mut [u8], len: usize);
    fn open(&mut self, counter: u64, buf: &mut [u8], len: usize) -> bool;
}

/// ring and aws-lc-rs share one API (aws-lc-rs keeps ring's): one key object per session.
macro_rules! ring_like {
    ($name:ident, $krate:ident, $label:literal) => {
        struct $name($krate::aead::LessSafeKey);

        impl Aead for $name {
            fn name(&self) -> &'static str {
                $label
            }
            fn seal(&mut self, counter: u64, buf: &mut [u8], len: usize) {
                let (data, tag) = buf.split_at_mut(len);
                let t = self
                    .0
                    .seal_in_place_separate_tag(
                        $krate::aead::Nonce::assume_unique_for_key(nonce(counter)),
                        $krate::aead::Aad::empty(),
                        data,
                    )
                    .expect("seal");
                tag[..TAG].copy_from_slice(t.as_ref());
            }
            fn open(&mut self, counter: u64, buf: &mut [u8], len: usize) -> bool {
                self.0
                    .open_in_place(
                        $krate::aead::Nonce::assume_unique_for_key(nonce(counter)),
                        $krate::aead::Aad::empty(),
                        &mut buf[..len + TAG],
                    )
                    .is_ok()
            }
        }
    };
}

ring_like!(Ring, ring, "ring");
ring_like!(AwsLc, aws_lc_rs, "aws-lc-rs");

/// OpenSSL 3 through the `openssl` crate, the cipher fetched once (no implicit fetch per call).
/// `keyed_per_call`: one context per thread, given the session's key and the packet's nonce on
/// every call (what a session shared by several threads needs: the daemon's interface).
/// Otherwise the key is set once and each call sets only the nonce (a context per session and
/// thread: an upper bound for OpenSSL, at the price of a context cache per thread).
struct OpenSsl {
    keyed_per_call: bool,
    ctx: openssl::cipher_ctx::CipherCtx,
}

impl OpenSsl {
    fn new(keyed_per_call: bool) -> OpenSsl {
        let cipher =
            openssl::cipher::Cipher::fetch(None, "ChaCha20-Poly1305", None).expect("fetch");
        let mut ctx = openssl::cipher_ctx::CipherCtx::new().expect("ctx");
        ctx.encrypt_init(Some(&cipher), Some(&KEY), None)
            .expect("init");
        OpenSsl {
            keyed_per_call,
            ctx,
        }
    }

    fn key(&self) -> Option<&'static [u8]> {
        self.keyed_per_call.then_some(&KEY[..])
    }
}

impl Aead for OpenSsl {
    fn name(&self) -> &'static str {
        if self.keyed_per_call {
            "openssl"
        } else {
            "openssl-ctx-per-session"
        }
    }
    fn seal(&mut self, counter: u64, buf: &mut [u8], len: usize) {
        let key = self.key();
        let ctx = &mut self.ctx;
        ctx.encrypt_init(None, key, Some(&nonce(counter)))
            .expect("init");
        let (data, tag) = buf.split_at_mut(len);
        ctx.cipher_update_inplace(data, len).expect("update");
        ctx.cipher_final(&mut []).expect("final");
        ctx.tag(&mut tag[..TAG]).expect("tag");
    }
    fn open(&mut self, counter: u64, buf: &mut [u8], len: usize) -> bool {
        let key = self.key();
        let ctx = &mut self.ctx;
        ctx.decrypt_init(None, key, Some(&nonce(counter)))
            .expect("init");
        let (data, tag) = buf.split_at_mut(len);
        if ctx.set_tag(&tag[..TAG]).is_err() {
            return false;
        }
        ctx.cipher_update_inplace(data, len).is_ok() && ctx.cipher_final(&mut []).is_ok()
    }
}

fn candidates() -> Vec<Box<dyn Aead>> {
    vec![
        Box::new(Ring(ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, &KEY).expect("key"),
        ))),
        Box::new(AwsLc(aws_lc_rs::aead::LessSafeKey::new(
            aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::CHACHA20_POLY1305, &KEY)
                .expect("key"),
        ))),
        Box::new(OpenSsl::new(true)),
        Box::new(OpenSsl::new(false)),
    ]
}

/// Each library must open what every other sealed, and reject a flipped bit.
fn cross_check(all: &mut [Box<dyn Aead>]) {
    for len in SIZES {
        for s in 0..all.len() {
            let plain: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut sealed = plain.clone();
            sealed.resize(len + TAG, 0);
            all[s].seal(42, &mut sealed, len);
            for o in 0..all.len() {
                let mut buf = sealed.clone();
                assert!(
                    all[o].open(42, &mut buf, len),
                    "{} opens {}",
                    all[o].name(),
                    all[s].name()
                );
                assert_eq!(
                    buf[..len],
                    plain[..],
                    "{} after {}",
                    all[o].name(),
                    all[s].name()
                );
                let mut bad = sealed.clone();
                bad[len / 2] ^= 1;
                assert!(
                    !all[o].open(42, &mut bad, len),
                    "{} took a forgery",
                    all[o].name()
                );
            }
        }
    }
}

/// Bytes of plaintext per second.
fn rate(aead: &mut dyn Aead, open: bool, len: usize, time: Duration) -> f64 {
    let mut buf = vec![0x5au8; len + TAG];
    let mut counter = 0u64;
    aead.seal(counter, &mut buf, len);
    let sealed = buf.clone();
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < time {
        for _ in 0..64 {
            if open {
                buf.copy_from_slice(&sealed);
                assert!(aead.open(0, &mut buf, len));
            } else {
                counter += 1;
                aead.seal(counter, &mut buf, len);
            }
        }
        done += 64;
    }
    let secs = started.elapsed().as_secs_f64();
    // Opening restores the sealed buffer each time (a copy the daemon does not make); take
    // the copy's own time out so open and seal compare.
    let copy = if open { copy_time(len, done) } else { 0.0 };
    (done as f64 * len as f64) / (secs - copy).max(secs * 0.5)
}

fn copy_time(len: usize, n: u64) -> f64 {
    let src = vec![1u8; len + TAG];
    let mut dst = vec![0u8; len + TAG];
    let started = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    started.elapsed().as_secs_f64()
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = arg(&args, "--seconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let time = Duration::from_secs_f64(seconds);
    let mut all = candidates();
    cross_check(&mut all);
    let load_start = loadavg();
    println!(
        "ChaCha20-Poly1305, one thread, {} ({}), {} s per point, OpenSSL {}",
        cpu_model(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        seconds,
        openssl::version::version()
    );
    println!(
        "{:>24} {:>5} {:>6} {:>8} {:>8}",
        "library", "op", "bytes", "MB/s", "vs ring"
    );
    let mut rows = Vec::new();
    for (round, len) in SIZES.into_iter().enumerate() {
        for op in ["seal", "open"] {
            let mut figures = vec![0.0; all.len()];
            for k in 0..all.len() {
                let i = (k + round) % all.len();
                figures[i] = rate(all[i].as_mut(), op == "open", len, time) / 1e6;
            }
            for (i, a) in all.iter().enumerate() {
                let ratio = figures[i] / figures[0];
                println!(
                    "{:>24} {op:>5} {len:>6} {:>8.0} {ratio:>7.2}x",
                    a.name(),
                    figures[i]
                );
                rows.push(format!(
                    "{{\"library\": \"{}\", \"op\": \"{op}\", \"bytes\": {len}, \"mb_per_s\": {:.1}, \"vs_ring\": {ratio:.3}}}",
                    a.name(),
                    figures[i]
                ));
            }
        }
    }
    let load_end = loadavg();
    println!("load average {load_start} -> {load_end}");
    if let Some(path) = arg(&args, "--json") {
        let json = format!(
            "{{\"cpu\": \"{}\", \"cpus\": {}, \"openssl\": \"{}\", \"seconds_per_point\": {seconds}, \"loadavg_start\": \"{load_start}\", \"loadavg_end\": \"{load_end}\", \"points\": [\n  {}\n]}}\n",
            cpu_model(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            openssl::version::version(),
            rows.join(",\n  ")
        );
        std::fs::write(&path, json).expect("write the JSON results");
    }
}
