//! Criterion benchmark of rule planning and rendering for 1,000 ingress and egress port rules,
//! for both backends.

use criterion::{criterion_group, criterion_main, Criterion};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::Path;
use tunnelgate::config::{Config, SecretFiles};
use tunnelgate::rules::desired::{desired, RuntimeFacts};
use tunnelgate::rules::{iptables, nft, Family};

struct NoFiles;
impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("no files in benchmarks".into())
    }
}

/// 500 ingress and 500 egress rules, each on its own port, both families.
fn thousand_rules() -> Config {
    let mut text = String::from(
        "[interface]\nprivate_key = \"yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\"\naddresses = [\"100.64.0.1/32\", \"fd7a::1/128\"]\n",
    );
    for i in 0..500u32 {
        text.push_str(&format!(
            "[[ingress]]\ntarget = \"10.96.{}.{}\"\nports = [\"{}:{}\"]\n",
            i / 250,
            i % 250 + 1,
            10000 + i,
            8000 + i
        ));
        text.push_str(&format!(
            "[[egress]]\ntarget = \"fd7a::{:x}\"\nports = [\"{}\"]\n",
            i + 2,
            20000 + i
        ));
    }
    match Config::parse(&text, Path::new("/"), &NoFiles) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

fn render(c: &mut Criterion) {
    let config = thousand_rules();
    let facts = RuntimeFacts {
        wg_port: 51820,
        health_port: Some(9002),
        health_beyond_loopback: tunnelgate::rules::desired::health_beyond_loopback(&config),
    };
    let resolved = BTreeMap::new();
    let set = desired(&config, &facts, &resolved);
    c.bench_function("plan 1000 rules", |b| {
        b.iter(|| desired(black_box(&config), &facts, &resolved))
    });
    c.bench_function("render nft 1000 rules", |b| {
        b.iter(|| nft::render(black_box(&set)))
    });
    c.bench_function("render iptables 1000 rules (v4+v6)", |b| {
        b.iter(|| {
            let v4 = iptables::render(black_box(&set), Family::V4, &Default::default());
            let v6 = iptables::render(black_box(&set), Family::V6, &Default::default());
            v4.len() + v6.len()
        })
    });
}

criterion_group!(benches, render);
criterion_main!(benches);
