//! Tests of the steering decision: peers shared out evenly, few values moved, data steered
//! to the owner of its peer.

use super::*;
use proptest::prelude::*;

fn loads(steering: &Steering, peers: &[u32]) -> Vec<usize> {
    let mut load = vec![0; steering.workers()];
    for &p in peers {
        load[steering.worker_of_peer(p)] += 1;
    }
    load
}

#[test]
fn two_peers_whose_bytes_share_a_plain_owner_get_a_worker_each() {
    // 0x04 and 0x06 are both even: the plain modulo puts both on worker 0.
    let peers = [0x1204, 0x3406];
    assert_eq!(Steering::plain(2).worker_of_peer(peers[0]), 0);
    assert_eq!(Steering::plain(2).worker_of_peer(peers[1]), 0);
    let steering = Steering::balanced(peers, 2);
    assert_eq!(loads(&steering, &peers), [1, 1]);
    assert_eq!(steering.moved().len(), 1, "{steering:?}");
}

#[test]
fn peers_already_even_move_nothing() {
    let peers = [0x01, 0x02, 0x103, 0x204];
    assert!(Steering::balanced(peers, 2).moved().is_empty());
    assert_eq!(Steering::balanced(peers, 2), Steering::plain(2));
}

#[test]
fn one_worker_owns_everything() {
    let steering = Steering::balanced([1, 2, 3], 1);
    assert!(steering.moved().is_empty());
    assert!((0..=255).all(|b| steering.owner_of_byte(b) == 0));
    assert_eq!(
        Steering::balanced([1], 0).workers(),
        1,
        "0 workers read as 1"
    );
}

#[test]
fn peers_on_one_byte_value_stay_together() {
    // Three peers on one value cannot be split: a session's datagrams name only the byte.
    let peers = [0x0105, 0x0205, 0x0305];
    let steering = Steering::balanced(peers, 2);
    let load = loads(&steering, &peers);
    assert!(load.contains(&3), "{load:?}");
}

#[test]
fn data_is_steered_to_its_peers_owner_and_initiations_by_their_sender() {
    let steering = Steering::balanced([0x1204, 0x3406], 2);
    let mut data = [0u8; 32];
    data[0] = 4;
    for peer in [0x1204u32, 0x3406] {
        data[4..8].copy_from_slice(&((peer << 8) | 7).to_le_bytes());
        assert_eq!(steering.owning_worker(&data), steering.worker_of_peer(peer));
    }
    let mut initiation = [0u8; 32];
    initiation[0] = INITIATION_TYPE;
    initiation[4] = 0x06;
    assert_eq!(
        steering.owning_worker(&initiation),
        0,
        "0x06 % 2, not moved"
    );
    assert_eq!(steering.owning_worker(&[]), 0, "too short to say: worker 0");
    assert_eq!(
        steering.owning_worker(&[4, 0, 0]),
        0,
        "too short to say: worker 0"
    );
}

/// Runs a classic BPF program the way the kernel does, for the instructions
/// [`Steering::program`] uses; a load past the end ends it with 0.
fn run(program: &[Instruction], packet: &[u8]) -> u32 {
    let (mut a, mut pc) = (0u32, 0usize);
    loop {
        let i = program[pc];
        pc += 1;
        match i.code {
            LD_B_ABS => match packet.get(i.k as usize) {
                Some(&b) => a = u32::from(b),
                None => return 0,
            },
            JEQ_K => pc += usize::from(if a == i.k { i.jt } else { i.jf }),
            JA => pc += i.k as usize,
            MOD_K => a %= i.k,
            RET_A => return a,
            RET_K => return i.k,
            other => panic!("instruction {other:#x} not modelled"),
        }
    }
}

#[test]
fn the_kernel_program_picks_the_same_worker_for_every_datagram() {
    let steerings = [
        Steering::plain(1),
        Steering::plain(3),
        Steering::balanced([0x1204, 0x3406], 2),
        Steering::balanced((0..40).map(|i| i * 8), 5),
    ];
    for steering in steerings {
        let program = steering.program();
        assert!(program.len() <= 4096, "BPF_MAXINSNS");
        for kind in 1..=4u8 {
            for byte in 0..=255u8 {
                let mut datagram = [0u8; 32];
                datagram[0] = kind;
                datagram[INITIATION_SPREAD_BYTE] = byte;
                datagram[PEER_INDEX_BYTE] = byte.wrapping_mul(7);
                assert_eq!(
                    run(&program, &datagram) as usize,
                    steering.owning_worker(&datagram),
                    "{steering:?}, type {kind}, byte {byte}"
                );
            }
        }
        for short in [&[][..], &[4], &[4, 0, 0, 0, 0], &[1, 0, 0]] {
            assert_eq!(run(&program, short) as usize, steering.owning_worker(short));
        }
    }
    assert!(!Steering::balanced((0..40).map(|i| i * 8), 5)
        .moved()
        .is_empty());
}

proptest! {
    /// Whatever the peers, no worker holds more than the emptiest plus the biggest group of
    /// peers on one byte value (the unit that cannot be split); when every peer has a value of
    /// its own, the loads differ by at most one. The list stays within its bound, lists only
    /// values that differ from the plain owner, and does not depend on the peers' order.
    #[test]
    fn peers_are_shared_out_as_evenly_as_their_byte_values_allow(
        peers in proptest::collection::vec(any::<u32>().prop_map(|v| v & 0xff_ffff), 0..600),
        workers in 1usize..9,
    ) {
        let steering = Steering::balanced(peers.iter().copied(), workers);
        let load = loads(&steering, &peers);
        let mut per_byte = [0usize; 256];
        for p in &peers {
            per_byte[(p & 0xff) as usize] += 1;
        }
        let biggest = per_byte.iter().copied().max().unwrap_or(0);
        let max = load.iter().max().copied().unwrap_or(0);
        let min = load.iter().min().copied().unwrap_or(0);
        // Never worse than the plain modulo, whatever happens; as even as the byte values
        // allow unless the bound on moved values stopped the balancing (then it moved the
        // most it may).
        let plain = loads(&Steering::plain(workers), &peers);
        let plain_gap = plain.iter().max().copied().unwrap_or(0)
            - plain.iter().min().copied().unwrap_or(0);
        prop_assert!(max - min <= plain_gap, "{load:?} against plain {plain:?}");
        if max - min > biggest.max(1) {
            prop_assert_eq!(steering.moved().len(), MAX_MOVED, "stopped early: {:?}", load);
        }
        prop_assert!(steering.moved().len() <= MAX_MOVED);
        for &(byte, owner) in steering.moved() {
            prop_assert!(owner != usize::from(byte) % workers && owner < workers);
        }
        let mut reversed = peers.clone();
        reversed.reverse();
        prop_assert_eq!(Steering::balanced(reversed, workers), steering);
    }
}
