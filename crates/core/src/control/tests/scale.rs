//! The control core at many peers: UAPI `set` agrees with wireguard-go's model
//! ([`DeviceSnapshot::apply`]) whatever the sequence, and what one change costs is counted
//! ([`crate::cost`], no timer): one peer's change among 20,000 costs what it costs among 2,000,
//! and a `set` that names every peer and changes nothing queues no work at all.

use super::*;
use crate::uapi::DeviceSnapshot;
use proptest::prelude::*;

/// A public key for peer `i` (any 32 bytes do for the core).
fn peer_key(i: u64) -> PublicKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&crate::pmap::mix64(i + 1).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_be_bytes());
    PublicKey(k)
}

fn peer_net(i: u64) -> IpNet {
    net(&format!(
        "10.{}.{}.{}/32",
        64 + (i >> 16),
        (i >> 8) & 0xff,
        i & 0xff
    ))
}

/// The section `wg setconf` sends for peer `i` with its one /32.
fn section(i: u64, nets: Vec<IpNet>) -> PeerUpdate {
    let mut p = PeerUpdate::new(peer_key(i));
    p.replace_allowed_ips = true;
    p.allowed_ips = nets;
    p
}

fn set(peers: Vec<PeerUpdate>) -> DeviceUpdate {
    DeviceUpdate {
        peers,
        ..DeviceUpdate::default()
    }
}

/// A daemon with `n` peers (set over UAPI, one /32 each), every action run.
fn daemon_with(n: u64) -> Sim {
    let mut sim = Sim::new(BASE);
    sim.drive();
    let base = sim.routes.len() as u64;
    let all = set((0..n).map(|i| section(i, vec![peer_net(i)])).collect());
    sim.control
        .handle_device_update(&all, sim.now)
        .expect("setconf");
    sim.drive();
    assert_eq!(sim.routes.len() as u64, n + base, "a route per allowed IP");
    sim
}

/// The work (`core::cost`) and the actions of one `wg set` of one peer's allowed IPs among `n`.
fn one_peer_set(n: u64) -> (u64, Vec<Action>) {
    let mut sim = daemon_with(n);
    let update = set(vec![section(
        n / 2,
        vec![peer_net(n / 2), net("10.250.0.1/32")],
    )]);
    let before = sim.log.len();
    let ((), spent) = crate::cost::of(|| {
        sim.control
            .handle_device_update(&update, sim.now)
            .expect("set");
        sim.drive();
    });
    (spent, sim.log[before..].to_vec())
}

/// A counting test: the one-peer `wg set` costs the same at 2,000 and 20,000 peers, and asks
/// the shell for one peer's change and one route. A route plan recomputed from every peer,
/// or a full peer diff, per change charges at least the peer count.
#[test]
fn one_peer_set_among_many_costs_what_it_costs_among_few() {
    let (small, actions) = one_peer_set(2_000);
    let (large, _) = one_peer_set(20_000);
    let bound = 200;
    assert!(small <= bound, "2,000 peers: {small} units > {bound}");
    assert!(large <= bound, "20,000 peers: {large} units > {bound}");
    let upserts: Vec<usize> = actions
        .iter()
        .filter_map(|a| match a {
            Action::UpdatePeers(c) => Some(c.upsert.len() + c.remove.len()),
            _ => None,
        })
        .collect();
    assert_eq!(upserts, vec![1], "one peer changed: {actions:?}");
    let routes: Vec<&routes::PlanDiff> = actions
        .iter()
        .filter_map(|a| match a {
            Action::ApplyRoutes(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0].add_routes.len(), 1);
    assert!(routes[0].remove_routes.is_empty());
}

/// `wg syncconf` of the running configuration: every peer named with what it has. Linear in
/// the peers named, and no peer, route or rule work at all.
#[test]
fn a_set_that_changes_nothing_queues_nothing() {
    for n in [2_000u64, 20_000] {
        let mut sim = daemon_with(n);
        let same = set((0..n).map(|i| section(i, vec![peer_net(i)])).collect());
        let before = sim.log.len();
        let ((), spent) = crate::cost::of(|| {
            sim.control
                .handle_device_update(&same, sim.now)
                .expect("syncconf");
            sim.drive();
        });
        assert_eq!(&sim.log[before..], &[], "{n} peers: nothing to do");
        assert!(spent <= 8 * n, "{n} peers: {spent} units for {n} sections");
    }
}

/// A reload of a file in which one peer of many changed: the peer table and the routes hear
/// of that peer alone (the file itself is read whole, as it must be).
#[test]
fn a_reload_that_changes_one_peer_changes_one_peer() {
    let n = 3_000u64;
    let text = |moved: &str| {
        let mut t = String::from(BASE);
        for i in 0..n {
            let nets = if i == 7 {
                moved.to_string()
            } else {
                format!("\"{}\"", peer_net(i))
            };
            t.push_str(&format!(
                "\n[[peer]]\npublic_key = \"{}\"\nallowed_ips = [{nets}]\n",
                peer_key(i).to_base64()
            ));
        }
        t
    };
    let mut sim = Sim::new(&text(&format!("\"{}\"", peer_net(7))));
    sim.drive();
    let before = sim.log.len();
    sim.reload(&text("\"10.250.0.7/32\"")).expect("reload");
    let work: Vec<String> = sim.log[before..]
        .iter()
        .filter_map(|a| match a {
            Action::UpdatePeers(c) => Some(format!("peers {}+{}", c.upsert.len(), c.remove.len())),
            Action::ApplyRoutes(d) => Some(format!(
                "routes +{} -{}",
                d.add_routes.len(),
                d.remove_routes.len()
            )),
            _ => None,
        })
        .collect();
    assert_eq!(work, vec!["peers 1+0", "routes +1 -1"]);
}

/// Each peer's preshared key, keepalive and allowed IPs (in order).
type Seen = BTreeMap<PublicKey, (Option<SecretKey>, Option<u16>, Vec<IpNet>)>;

/// The core's peers as a `get` shows them (no counters or endpoints: the data plane's).
fn core_peers(control: &Control) -> Seen {
    control
        .peers
        .iter()
        .map(|(k, s)| {
            (
                *k,
                (
                    s.preshared_key.clone(),
                    s.persistent_keepalive,
                    s.allowed_ips.clone(),
                ),
            )
        })
        .collect()
}

fn model_peers(model: &DeviceSnapshot) -> Seen {
    model
        .peers
        .iter()
        .map(|p| {
            (
                p.public_key,
                (
                    p.preshared_key.clone(),
                    p.persistent_keepalive,
                    p.allowed_ips.clone(),
                ),
            )
        })
        .collect()
}

/// The secret of peer key `i` of the small pool the property test draws from.
fn pool_secret(i: u8) -> SecretKey {
    SecretKey([i + 1; 32])
}

fn pool_key(i: u8) -> PublicKey {
    pool_secret(i).public_key()
}

fn arb_section() -> impl Strategy<Value = PeerUpdate> {
    (
        0u8..5,
        0u8..10,
        prop::option::of(prop::option::of(1u8..3)),
        prop::option::of(0u16..3),
        any::<bool>(),
        prop::collection::vec(0u8..8, 0..4),
    )
        .prop_map(|(k, flags, psk, keepalive, replace, nets)| {
            let mut p = PeerUpdate::new(pool_key(k));
            p.remove = flags == 0;
            p.update_only = flags == 1;
            p.preshared_key = psk.map(|o| o.map(|b| SecretKey([b; 32])));
            p.persistent_keepalive = keepalive;
            p.replace_allowed_ips = replace;
            p.allowed_ips = nets
                .into_iter()
                .map(|n| net(&format!("10.9.{n}.0/24")))
                .collect();
            p
        })
}

fn arb_update() -> impl Strategy<Value = DeviceUpdate> {
    (
        prop::option::of(prop::option::of(0u8..6)),
        any::<u8>(),
        prop::collection::vec(arb_section(), 0..6),
    )
        .prop_map(|(key, replace, peers)| DeviceUpdate {
            // Now and then the device's key is a peer's: that peer goes, as in wireguard-go.
            private_key: key.map(|k| k.map(pool_secret)),
            replace_peers: replace % 5 == 0,
            peers,
            ..DeviceUpdate::default()
        })
}

proptest! {
    /// Any sequence of UAPI sets leaves the core's peers (keys, preshared keys, keepalives,
    /// allowed IPs in order) as wireguard-go's semantics, modelled by `DeviceSnapshot::apply`.
    #[test]
    fn uapi_sets_agree_with_wireguard_gos_model(updates in prop::collection::vec(arb_update(), 1..8)) {
        let mut control = Control::userspace("tgmodel", 51820, None, crate::test_util::now())
            .expect("core");
        let mut model = DeviceSnapshot::default();
        for update in &updates {
            control.handle_device_update(update, crate::test_util::now()).expect("set");
            while control.poll_action().is_some() {}
            model.apply(update);
            prop_assert_eq!(core_peers(&control), model_peers(&model));
            // Each prefix is one peer's, as the index of owners says.
            let owned: BTreeMap<IpNet, PublicKey> = control
                .peers
                .iter()
                .flat_map(|(k, s)| s.allowed_ips.iter().map(move |n| (*n, *k)))
                .collect();
            prop_assert_eq!(&owned, &control.owners);
        }
    }
}
