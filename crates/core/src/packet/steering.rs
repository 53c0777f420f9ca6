//! Which packet worker receives a datagram: every datagram of a session goes to the worker
//! that owns its peer, so one peer's datagrams stay in order, and the peers are shared out
//! evenly over the workers.
//!
//! The owner is read from one byte of the receiver index (the low byte of the peer's index,
//! a keyed hash: `core::session_index`). Taken modulo the worker count alone, two peers land
//! on one worker as often as not when there are two workers, and a gateway with a few big
//! peers then decrypts them all on one core. So the byte values that peers hold are shared
//! out by how many peers each holds ([`Steering::balanced`]); the few values moved off their
//! plain owner (`byte % workers`) are listed, and the shell's reuse-port program in the kernel
//! checks that list before the modulo.

use crate::cbpf::{
    Instruction, BPF_A, BPF_ABS, BPF_ALU, BPF_B, BPF_JA, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_MOD,
    BPF_RET,
};

/// The message type of a handshake initiation.
pub const INITIATION_TYPE: u8 = 1;
/// An initiation's sender index is the peer's random number: its low byte spreads them.
pub const INITIATION_SPREAD_BYTE: usize = 4;
/// Our session index (the receiver index of responses, cookies and data; little-endian at 4..8)
/// is the peer's table index shifted left by 8 (`core::wg`): its second byte is the low byte
/// of the peer's index.
pub const PEER_INDEX_BYTE: usize = 5;
/// At most this many byte values are moved off their plain owner: the kernel compares a
/// datagram's byte with each of them in turn, so the list is kept short. Enough to even out
/// any peer list where evening out matters (a few peers per worker); with thousands of
/// peers the plain modulo is already close to even.
pub const MAX_MOVED: usize = 64;

/// Which worker owns each value of the steering byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Steering {
    workers: usize,
    /// Byte values whose owner is not `byte % workers`, with their owner, in byte order.
    moved: Vec<(u8, usize)>,
}

impl Steering {
    /// The plain modulo: what a group with no peers yet (or one worker) uses.
    pub fn plain(workers: usize) -> Steering {
        Steering {
            workers: workers.max(1),
            moved: Vec::new(),
        }
    }

    /// Owners for the byte values of `peer_indices` that leave each worker with as close to
    /// the same number of peers as whole byte values allow. Starts from the plain modulo and
    /// moves one byte value at a time from the fullest worker to the emptiest while that
    /// narrows the gap, so most values keep their plain owner (and the list stays short).
    /// Deterministic: the same peers give the same owners, whatever their order.
    pub fn balanced(peer_indices: impl IntoIterator<Item = u32>, workers: usize) -> Steering {
        let mut peers_of_byte = [0usize; 256];
        let mut tallied = 0;
        for index in peer_indices {
            peers_of_byte[(index & 0xff) as usize] += 1;
            tallied += 1;
        }
        crate::cost::charge(tallied);
        Steering::balanced_tally(&peers_of_byte, workers)
    }

    /// [`Steering::balanced`] from the peers already counted per byte value (the peer table
    /// keeps the count as peers come and go): its cost does not depend on how many peers
    /// there are (at most [`MAX_MOVED`] passes over the 256 values).
    pub fn balanced_tally(peers_of_byte: &[usize; 256], workers: usize) -> Steering {
        let workers = workers.max(1);
        let mut owner: Vec<usize> = (0..256).map(|b| b % workers).collect();
        let mut load = vec![0usize; workers];
        for (byte, &n) in peers_of_byte.iter().enumerate() {
            load[owner[byte]] += n;
        }
        let mut moved = 0;
        while moved < MAX_MOVED {
            // Fullest and emptiest, the lowest-numbered on ties (deterministic).
            let fullest = (0..workers).max_by_key(|&w| (load[w], usize::MAX - w));
            let emptiest = (0..workers).min_by_key(|&w| (load[w], w));
            let (Some(from), Some(to)) = (fullest, emptiest) else {
                break;
            };
            let gap = load[from] - load[to];
            // The biggest byte value that still narrows the gap: moving n peers leaves
            // |gap - 2n| < gap exactly when 0 < n < gap.
            let candidate = (0..256)
                .filter(|&b| owner[b] == from && peers_of_byte[b] > 0 && peers_of_byte[b] < gap)
                .max_by_key(|&b| (peers_of_byte[b], usize::MAX - b));
            let Some(byte) = candidate else { break };
            owner[byte] = to;
            load[from] -= peers_of_byte[byte];
            load[to] += peers_of_byte[byte];
            moved += 1;
        }
        let moved = (0..256usize)
            .filter(|&b| owner[b] != b % workers)
            .map(|b| (b as u8, owner[b]))
            .collect();
        Steering { workers, moved }
    }

    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The byte values moved off their plain owner, with their owner, in byte order.
    pub fn moved(&self) -> &[(u8, usize)] {
        &self.moved
    }

    /// The worker that owns steering byte `byte`.
    pub fn owner_of_byte(&self, byte: u8) -> usize {
        self.moved
            .binary_search_by_key(&byte, |&(b, _)| b)
            .map_or(usize::from(byte) % self.workers, |i| self.moved[i].1)
    }

    /// The worker that owns the peer with table index `peer_index`: where its datagrams arrive.
    pub fn worker_of_peer(&self, peer_index: u32) -> usize {
        self.owner_of_byte((peer_index & 0xff) as u8)
    }

    /// The worker whose socket receives `datagram` (what the shell's reuse-port steering
    /// program decides in the kernel): the owner of the peer whose session it names, any
    /// worker for an initiation (spread by its sender's number). A datagram too short to say
    /// goes to worker 0.
    pub fn owning_worker(&self, datagram: &[u8]) -> usize {
        match datagram.first() {
            Some(&INITIATION_TYPE) => datagram
                .get(INITIATION_SPREAD_BYTE)
                .map_or(0, |b| usize::from(*b) % self.workers),
            Some(_) => datagram
                .get(PEER_INDEX_BYTE)
                .map_or(0, |b| self.owner_of_byte(*b)),
            None => 0,
        }
    }
}

const LD_B_ABS: u16 = BPF_LD | BPF_B | BPF_ABS;
const JEQ_K: u16 = BPF_JMP | BPF_JEQ | BPF_K;
const JA: u16 = BPF_JMP | BPF_JA;
const MOD_K: u16 = BPF_ALU | BPF_MOD | BPF_K;
const RET_A: u16 = BPF_RET | BPF_A;
const RET_K: u16 = BPF_RET | BPF_K;

impl Steering {
    /// The classic BPF program of a reuse-port group that makes the choice of
    /// [`Steering::owning_worker`] in the kernel: it returns the index of the socket that gets
    /// a datagram, run on the UDP payload. A load past the end of a short datagram ends the
    /// program with 0: worker 0, as `owning_worker` says.
    pub fn program(&self) -> Vec<Instruction> {
        let op = Instruction::new;
        let moved = u32::try_from(self.moved.len()).unwrap_or(u32::MAX);
        let mut program = vec![
            op(LD_B_ABS, 0, 0, 0),                       // A = message type
            op(JEQ_K, 0, 2, u32::from(INITIATION_TYPE)), // an initiation names no session of ours
            op(LD_B_ABS, 0, 0, INITIATION_SPREAD_BYTE as u32),
            op(JA, 0, 0, 1 + 2 * moved), // past the moved values, to the modulo
            op(LD_B_ABS, 0, 0, PEER_INDEX_BYTE as u32),
        ];
        for &(byte, owner) in &self.moved {
            program.push(op(JEQ_K, 0, 1, u32::from(byte)));
            program.push(op(RET_K, 0, 0, owner as u32));
        }
        program.push(op(MOD_K, 0, 0, self.workers as u32));
        program.push(op(RET_A, 0, 0, 0));
        program
    }
}

#[cfg(test)]
mod tests;
