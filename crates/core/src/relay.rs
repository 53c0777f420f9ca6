//! What a packet reader hands to its relay partners (`shell::dataplane::relay`), decided
//! without I/O: which reads are worth a partner, and which receive batches may be opened at
//! the same time without leaving the replay window.
//!
//! Receive batches opened on several threads finish out of order: a later batch's counters may
//! be recorded before an earlier one's. A session refuses a counter more than
//! [`REPLAY_WINDOW`] below the highest it has recorded, so the batches being opened at one time
//! (the partners' and the reader's own) must hold fewer datagrams together than that, with room
//! left for what the path lost between them.

/// boringtun's replay window (`crates/boringtun/src/noise/session.rs`, `N_BITS`): a counter
/// more than this far below the highest recorded is refused as a replay.
pub const REPLAY_WINDOW: usize = 1024;

/// A read of fewer packets (a TUN read's segments, a receive batch's datagrams) never leaves
/// its reader: pings, ACKs and requests, where latency matters more than the cores.
pub const MIN_PACKETS: usize = 8;

/// The datagrams one reader's receive batches may hold while they are opened at once: half the
/// replay window. Batches opened out of order are then at most this far apart, plus what the
/// path lost between them, for which the other half is left.
pub const IN_FLIGHT_DATAGRAMS: usize = REPLAY_WINDOW / 2;

/// Most partners beside one packet reader. Each partner is a thread asleep when idle and a set
/// of buffers (a 64 KB read or a receive batch in the pool; a send batch, or a coalescer and a
/// reply batch, made at its first job); 32 readers of a 16-core gateway would otherwise start
/// 480 of them. Three give one peer's direction four threads, past which the reader's own share
/// of each read (the read or receive itself, the lookup, the counters, the hand-off) bounds it.
/// Not measured past 2 CPUs: the bound is a choice.
pub const MAX_PARTNERS: usize = 3;

/// How many partners each packet reader gets: one per other CPU the workers may use (a partner
/// without a CPU only takes it from the thread whose turn it is), at most [`MAX_PARTNERS`], and
/// none with one worker, so `workers = 1` runs exactly the single-threaded path.
pub fn partners(workers: usize, cpus: usize) -> usize {
    workers.min(cpus).saturating_sub(1).min(MAX_PARTNERS)
}

/// At most how many partners per reader: what was asked (`TUNNELGATE_RELAY_PARTNERS`, 0 turns
/// the relay off), or, when nothing was, [`MAX_PARTNERS`]: the relay is on by default, and
/// [`partners`] gives a reader as many as the CPUs allow. On by default because, with partners
/// at normal priority that a waiting real-time reader boosts, it keeps the 2 ms latency promise
/// even on two vCPUs where the readers, the partners, the kernel and the application share
/// every core, and a many-core gateway's one big peer should not need a knob to use its cores.
/// It is not free there: the run files of the default build (`ffa4686`, `benches/latency` and
/// `benches/iperf` results) give a loaded ping p99 of 1.33 ms with the relay against 0.93 ms
/// with one worker, one stream 0.99x of one worker's, and 2.33 against 2.23 CPU s/GB
/// (docs/performance.md, "The relay in the daemon").
pub fn allowed(asked: Option<usize>) -> usize {
    asked.unwrap_or(MAX_PARTNERS)
}

/// Whether a TUN read of `segments` is worth an idle partner.
pub fn hands_off_read(segments: usize) -> bool {
    segments >= MIN_PACKETS
}

/// Whether a receive batch of `datagrams` may go to an idle partner while batches of
/// `in_flight` datagrams are being opened by the others.
pub fn hands_off_batch(in_flight: usize, datagrams: usize) -> bool {
    datagrams >= MIN_PACKETS && in_flight + datagrams <= IN_FLIGHT_DATAGRAMS
}

/// Whether the reader, about to open a batch of `datagrams` itself, must first let the batches
/// in flight (`in_flight` datagrams, all received before it) finish: opened beside them, its
/// counters would run further ahead of theirs than [`IN_FLIGHT_DATAGRAMS`].
pub fn opens_after_in_flight(in_flight: usize, datagrams: usize) -> bool {
    in_flight > 0 && in_flight + datagrams > IN_FLIGHT_DATAGRAMS
}

#[cfg(test)]
mod tests;
