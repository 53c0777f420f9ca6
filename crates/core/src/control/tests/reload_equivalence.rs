//! Reload equals a fresh start (issue 23): for generated pairs of valid configurations A and
//! B, a daemon started with A and reloaded to B leaves the simulated system exactly as a daemon
//! started with B: rules, addresses, routes, policy rules, peers, the forwarding families it
//! holds, and readiness. B may need fewer families than A, or no rule at all.

use super::*;
use proptest::prelude::*;

/// Everything a reload must leave as a fresh start would.
#[derive(Debug, PartialEq)]
struct Observed {
    rules: Option<RuleSet>,
    addresses: BTreeSet<IpNet>,
    routes: BTreeSet<routes::Route>,
    policy_rules: BTreeSet<routes::PolicyRule>,
    peers: BTreeMap<PublicKey, PeerSpec>,
    forwarding: BTreeSet<Family>,
    readiness: Result<(), String>,
    rules_needed: bool,
    rules_current: bool,
    /// Where the health endpoint listens.
    health: Option<SocketAddr>,
}

impl Sim {
    fn observe(&self) -> Observed {
        let view = self.control.view();
        Observed {
            rules: self.rules.clone(),
            addresses: self.addresses.clone(),
            routes: self.routes.clone(),
            policy_rules: self.policy_rules.clone(),
            peers: self
                .sessions
                .iter()
                .map(|(k, (spec, _))| (*k, spec.clone()))
                .collect(),
            forwarding: self.forwarding.clone(),
            readiness: self.control.readiness(),
            rules_needed: view.rules.needed,
            rules_current: view.rules.current,
            health: self.health,
        }
    }
}

/// The parts a generated configuration is made of. Ports differ between the pool's entries
/// so that no pair of chosen rules overlaps.
const ADDRESSES_V4: [&str; 2] = ["100.64.0.1/32", "100.64.0.9/32"];
const ADDRESS_V6: &str = "fd7a::1/128";
const INGRESS: [(&str, &str); 4] = [
    ("10.96.0.10", r#"["80"]"#),
    ("10.96.0.11", r#"["443:8443", "53/udp"]"#),
    ("fd96::10", r#"["80"]"#),
    ("fd96::11", r#"["8443:443"]"#),
];
const EGRESS: [(&str, &str); 2] = [("100.64.0.2", r#"["5432"]"#), ("fd7a::2", r#"["8080:80"]"#)];
const ALLOWED: [&str; 6] = [
    "100.64.0.2/32",
    "100.64.0.3/32",
    "10.0.0.0/24",
    "fd7a::2/128",
    "0.0.0.0/0",
    "::/0",
];
const ADVERTISED: [&str; 2] = ["10.40.0.0/14", "fd40::/48"];

/// One generated configuration, before it is written as TOML.
#[derive(Debug, Clone)]
struct Shape {
    addresses_v4: Vec<&'static str>,
    with_v6: bool,
    mtu: u16,
    listen_port: u16,
    fwmark: Option<u32>,
    /// The owner of each of [`ALLOWED`]: 1 peer B, 2 peer C, else neither (an allowed IP of
    /// two peers is an error).
    owners: Vec<u8>,
    ingress: Vec<(&'static str, &'static str)>,
    egress: Vec<(&'static str, &'static str)>,
    advertised: Vec<&'static str>,
    exit_node: bool,
    /// A plain tunnel: none of the ingress, egress and router above. Chosen often, since a
    /// reload to (or from) no rule at all is the case issue 23 is about.
    plain: bool,
    /// `0.0.0.0:9002`: beyond loopback, so a guard rule is needed even without forwarding.
    public_health: bool,
}

fn subset(pool: &[&'static str], min: usize) -> BoxedStrategy<Vec<&'static str>> {
    proptest::sample::subsequence(pool.to_vec(), min..=pool.len()).boxed()
}

fn rules(
    pool: &[(&'static str, &'static str)],
) -> BoxedStrategy<Vec<(&'static str, &'static str)>> {
    proptest::sample::subsequence(pool.to_vec(), 0..=pool.len()).boxed()
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        (subset(&ADDRESSES_V4, 1), any::<bool>()),
        (
            prop_oneof![Just(1420u16), Just(1380u16)],
            prop_oneof![Just(51820u16), Just(51999u16)],
            proptest::option::of(Just(4242u32)),
        ),
        proptest::collection::vec(0..3u8, ALLOWED.len()),
        (rules(&INGRESS), rules(&EGRESS)),
        (
            subset(&ADVERTISED, 0),
            proptest::bool::weighted(0.15),
            proptest::bool::weighted(0.4),
            proptest::bool::weighted(0.3),
        ),
    )
        .prop_map(
            |(
                (addresses_v4, with_v6),
                (mtu, listen_port, fwmark),
                owners,
                (ingress, egress),
                (advertised, exit_node, plain, public_health),
            )| Shape {
                addresses_v4,
                with_v6,
                mtu,
                listen_port,
                fwmark,
                owners,
                ingress,
                egress,
                advertised,
                exit_node,
                plain,
                public_health,
            },
        )
}

impl Shape {
    /// The TOML after the `[interface]` header the tests' `config` writes. An IPv6 target is
    /// left out when the tunnel has no IPv6 address (that is an error, not a config to compare).
    fn render(&self) -> String {
        let list = |v: &[&str]| {
            v.iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let family_ok = |target: &str| !self.plain && (self.with_v6 || !target.contains(':'));
        let owned = |owner: u8| -> Vec<&str> {
            ALLOWED
                .iter()
                .zip(&self.owners)
                .filter(|(_, o)| **o == owner)
                .map(|(a, _)| *a)
                .collect()
        };
        let mut addresses = self.addresses_v4.clone();
        if self.with_v6 {
            addresses.push(ADDRESS_V6);
        }
        let mut t = format!(
            "listen_port = {}\nmtu = {}\naddresses = [{}]\n",
            self.listen_port,
            self.mtu,
            list(&addresses)
        );
        if let Some(mark) = self.fwmark {
            t += &format!("fwmark = {mark}\n");
        }
        for (key, owner) in [(PEER_B, 1), (PEER_C, 2)] {
            t += &format!(
                "[[peer]]\npublic_key = \"{key}\"\nallowed_ips = [{}]\n",
                list(&owned(owner))
            );
        }
        for (target, ports) in self.ingress.iter().filter(|(t, _)| family_ok(t)) {
            t += &format!("[[ingress]]\ntarget = \"{target}\"\nports = {ports}\n");
        }
        for (target, ports) in self.egress.iter().filter(|(t, _)| family_ok(t)) {
            t += &format!("[[egress]]\ntarget = \"{target}\"\nports = {ports}\n");
        }
        if !self.plain {
            t += &format!(
                "[router]\nadvertise_routes = [{}]\nexit_node = {}\n",
                list(&self.advertised),
                self.exit_node
            );
        }
        let health = if self.public_health {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        t + &format!("[health]\nlisten = \"{health}:9002\"\n")
    }
}

fn config_text() -> impl Strategy<Value = String> {
    shape().prop_map(|s| s.render())
}

/// The configuration, or `None` when the generated text is not a valid one (the generator
/// avoids the errors it knows of; a rare other one is skipped, not compared).
fn valid(text: &str) -> Option<Config> {
    let full = format!("[interface]\nname = \"tgsim\"\nprivate_key = \"{KEY}\"\n{text}");
    Config::parse(&full, Path::new("/etc/tg"), &NoFiles).ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn a_reload_leaves_what_a_fresh_start_leaves(a in config_text(), b in config_text()) {
        let (Some(config_a), Some(config_b)) = (valid(&a), valid(&b)) else {
            return Err(TestCaseError::reject("not a valid configuration"));
        };
        let mut reloaded = Sim::with_config(config_a);
        prop_assert!(reloaded.control.poll_action().is_none());
        reloaded
            .control
            .handle_config_loaded(config_b.clone(), reloaded.now)
            .map_err(|e| TestCaseError::fail(format!("reload refused: {e}")))?;
        reloaded.drive();
        let fresh = Sim::with_config(config_b);
        prop_assert_eq!(reloaded.observe(), fresh.observe(), "A:\n{}\nB:\n{}", a, b);
        // And a stop undoes the same on both sides.
        prop_assert_eq!(
            reloaded.control.teardown().contains(&Action::RemoveRules),
            fresh.rules.is_some()
        );
    }
}
