// Copyright (c) 2019 Cloudflare, Inc. All rights reserved.
// SPDX-License-Identifier: BSD-3-Clause

//! A transport session: the two keys a handshake derived, the sending counter and the
//! receiving replay window. Everything takes `&self`: the session is shared (`Arc`) by the
//! threads that seal and open one peer's messages, outside `Tunn`'s `&mut self`. Sealing and
//! opening work in place (tunnelgate's fork; FORK.md).

use super::aead::{TransportKey, TAG_LEN};
use crate::noise::errors::WireGuardError;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A transport session (one handshake's keys, counters and replay window).
pub struct Session {
    pub(crate) receiving_index: u32,
    /// The order in which its `Tunn` established it (1, 2, 3 ...): a session of a higher
    /// generation is newer, whatever the indices (which cycle and start at random).
    generation: u64,
    sending_index: u32,
    receiver: TransportKey,
    sender: TransportKey,
    sending_key_counter: AtomicU64,
    receiving_key_counter: Mutex<ReceivingKeyCounterValidator>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "Session: {}<- ->{}",
            self.receiving_index, self.sending_index
        )
    }
}

/// Where encrypted data resides in a data packet
pub const DATA_OFFSET: usize = 16;
/// The overhead of the AEAD
const AEAD_SIZE: usize = TAG_LEN;

/// After this many messages sent on one session, a new handshake is due (the WireGuard paper's
/// Rekey-After-Messages, 2^60).
pub const REKEY_AFTER_MESSAGES: u64 = 1 << 60;
/// No message is sent or accepted with a counter at or past this (Reject-After-Messages,
/// 2^64 - 2^13 - 1).
pub const REJECT_AFTER_MESSAGES: u64 = u64::MAX - (1 << 13);

/// What opening a data message found: the plaintext's length (at `DATA_OFFSET` for
/// [`Session::open_in_place`], at 0 for [`Session::open`]) and the message's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub len: usize,
    pub counter: u64,
}

// Receiving buffer constants
const WORD_SIZE: u64 = 64;
const N_WORDS: u64 = 16; // Suffice to reorder 64*16 = 1024 packets; can be increased at will
const N_BITS: u64 = WORD_SIZE * N_WORDS;

#[derive(Debug, Clone, Default)]
struct ReceivingKeyCounterValidator {
    /// In order to avoid replays while allowing for some reordering of the packets, we keep a
    /// bitmap of received packets, and the value of the highest counter
    next: u64,
    /// Used to estimate packet loss
    receive_cnt: u64,
    bitmap: [u64; N_WORDS as usize],
}

impl ReceivingKeyCounterValidator {
    #[inline(always)]
    fn set_bit(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        self.bitmap[word] |= 1 << bit;
    }

    #[inline(always)]
    fn clear_bit(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        self.bitmap[word] &= !(1u64 << bit);
    }

    /// Clear the word that contains idx
    #[inline(always)]
    fn clear_word(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        self.bitmap[word] = 0;
    }

    /// Returns true if bit is set, false otherwise
    #[inline(always)]
    fn check_bit(&self, idx: u64) -> bool {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        ((self.bitmap[word] >> bit) & 1) == 1
    }

    /// Returns true if the counter was not yet received, and is not too far back
    #[inline(always)]
    fn will_accept(&self, counter: u64) -> Result<(), WireGuardError> {
        if counter >= self.next {
            // As long as the counter is growing no replay took place for sure
            return Ok(());
        }
        if counter + N_BITS < self.next {
            // Drop if too far back
            return Err(WireGuardError::InvalidCounter);
        }
        if !self.check_bit(counter) {
            Ok(())
        } else {
            Err(WireGuardError::DuplicateCounter)
        }
    }

    /// Marks the counter as received, and returns true if it is still good (in case during
    /// decryption something changed)
    #[inline(always)]
    fn mark_did_receive(&mut self, counter: u64) -> Result<(), WireGuardError> {
        if counter + N_BITS < self.next {
            // Drop if too far back
            return Err(WireGuardError::InvalidCounter);
        }
        if counter == self.next {
            // Usually the packets arrive in order, in that case we simply mark the bit and
            // increment the counter
            self.set_bit(counter);
            self.next += 1;
            return Ok(());
        }
        if counter < self.next {
            // A packet arrived out of order, check if it is valid, and mark
            if self.check_bit(counter) {
                return Err(WireGuardError::InvalidCounter);
            }
            self.set_bit(counter);
            return Ok(());
        }
        // Packets where dropped, or maybe reordered, skip them and mark unused
        if counter - self.next >= N_BITS {
            // Too far ahead, clear all the bits
            for c in self.bitmap.iter_mut() {
                *c = 0;
            }
        } else {
            let mut i = self.next;
            while !i.is_multiple_of(WORD_SIZE) && i < counter {
                // Clear until i aligned to word size
                self.clear_bit(i);
                i += 1;
            }
            while i + WORD_SIZE < counter {
                // Clear whole word at a time
                self.clear_word(i);
                i = (i + WORD_SIZE) & 0u64.wrapping_sub(WORD_SIZE);
            }
            while i < counter {
                // Clear any remaining bits
                self.clear_bit(i);
                i += 1;
            }
        }
        self.set_bit(counter);
        self.next = counter + 1;
        Ok(())
    }
}

impl Session {
    pub(super) fn new(
        local_index: u32,
        peer_index: u32,
        receiving_key: [u8; 32],
        sending_key: [u8; 32],
    ) -> Session {
        Session {
            receiving_index: local_index,
            generation: 0,
            sending_index: peer_index,
            receiver: TransportKey::new(&receiving_key),
            sender: TransportKey::new(&sending_key),
            sending_key_counter: AtomicU64::new(0),
            receiving_key_counter: Mutex::new(Default::default()),
        }
    }

    pub(super) fn local_index(&self) -> usize {
        self.receiving_index as usize
    }

    /// Our index for this session: the receiver index of every data message the peer sends.
    pub fn receiving_index(&self) -> u32 {
        self.receiving_index
    }

    /// The order in which its tunnel established it: higher is newer.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Numbers the session as its tunnel's `generation`-th.
    pub(crate) fn with_generation(mut self, generation: u64) -> Session {
        self.generation = generation;
        self
    }

    /// The peer's index for this session, written into every data message we send.
    pub fn sending_index(&self) -> u32 {
        self.sending_index
    }

    /// The next counter to be reserved: how many messages this session has numbered.
    pub fn sending_counter(&self) -> u64 {
        self.sending_key_counter.load(Ordering::Relaxed)
    }

    /// Reserves `n` consecutive counters for `n` messages and returns the first; `None` when
    /// the last would reach [`REJECT_AFTER_MESSAGES`] (the session is worn out: a new
    /// handshake must replace it). A counter is handed out once whatever the threads do.
    #[inline]
    pub fn reserve(&self, n: u64) -> Option<u64> {
        // fetch_add with a bound: a plain fetch_add past the limit would, called often
        // enough, wrap to counters already used (a reused nonce).
        self.sending_key_counter
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                c.checked_add(n).filter(|end| *end <= REJECT_AFTER_MESSAGES)
            })
            .ok()
    }

    /// Returns true if receiving counter is good to use
    fn receiving_counter_quick_check(&self, counter: u64) -> Result<(), WireGuardError> {
        if counter >= REJECT_AFTER_MESSAGES {
            return Err(WireGuardError::InvalidCounter);
        }
        let counter_validator = self.receiving_key_counter.lock();
        counter_validator.will_accept(counter)
    }

    /// Returns true if receiving counter is good to use, and marks it as used {
    fn receiving_counter_mark(&self, counter: u64) -> Result<(), WireGuardError> {
        let mut counter_validator = self.receiving_key_counter.lock();
        let ret = counter_validator.mark_did_receive(counter);
        if ret.is_ok() {
            counter_validator.receive_cnt += 1;
        }
        ret
    }

    /// Seals, in place, the data message numbered `counter` (a counter from
    /// [`Session::reserve`], used once): `message[DATA_OFFSET..DATA_OFFSET + len]` holds the
    /// plaintext; the header goes before it and the tag after. Returns the message's length,
    /// `len + 32`.
    ///
    /// # Panics
    /// If `message` is shorter than `len + 32`: a caller's mistake, not a network's.
    #[inline]
    pub fn seal_in_place(&self, counter: u64, message: &mut [u8], len: usize) -> usize {
        let total = DATA_OFFSET + len + AEAD_SIZE;
        assert!(
            message.len() >= total,
            "The destination buffer is too small"
        );
        let (header, rest) = message.split_at_mut(DATA_OFFSET);
        header[0..4].copy_from_slice(&super::DATA.to_le_bytes());
        header[4..8].copy_from_slice(&self.sending_index.to_le_bytes());
        header[8..16].copy_from_slice(&counter.to_le_bytes());
        // TODO (upstream): the spec pads to 16 bytes; every implementation accepts this.
        let (data, tag) = rest.split_at_mut(len);
        tag[..AEAD_SIZE].copy_from_slice(&self.sender.seal_in_place(counter, data));
        total
    }

    /// [`Session::seal_in_place`] for a plaintext that is elsewhere: copies `src` behind the
    /// header first.
    #[inline]
    pub fn seal(&self, counter: u64, src: &[u8], message: &mut [u8]) -> usize {
        assert!(
            message.len() >= src.len() + super::DATA_OVERHEAD_SZ,
            "The destination buffer is too small"
        );
        message[DATA_OFFSET..DATA_OFFSET + src.len()].copy_from_slice(src);
        self.seal_in_place(counter, message, src.len())
    }

    /// Opens, in place, a data message of this session: checks its receiver index and counter
    /// (against the replay window before and after decryption), decrypts, and marks the counter
    /// received. The plaintext is `message[DATA_OFFSET..DATA_OFFSET + len]`.
    #[inline]
    pub fn open_in_place(&self, message: &mut [u8]) -> Result<Opened, WireGuardError> {
        let counter = self.check_header(message)?;
        let len = message.len() - DATA_OFFSET - AEAD_SIZE;
        self.receiver
            .open_in_place(counter, &mut message[DATA_OFFSET..])
            .map_err(|_| WireGuardError::InvalidAeadTag)?;
        // After decryption is done, check counter again, and mark as received
        self.receiving_counter_mark(counter)?;
        Ok(Opened { len, counter })
    }

    /// [`Session::open_in_place`] for a message that must not be written: its ciphertext is
    /// copied into `dst` and opened there; the plaintext is `dst[..len]`.
    ///
    /// # Panics
    /// If `dst` is shorter than the message's ciphertext and tag.
    #[inline]
    pub fn open(&self, message: &[u8], dst: &mut [u8]) -> Result<Opened, WireGuardError> {
        let counter = self.check_header(message)?;
        let sealed = &message[DATA_OFFSET..];
        // This is a very incorrect use of the library, therefore panic and not error
        assert!(
            dst.len() >= sealed.len(),
            "The destination buffer is too small"
        );
        let dst = &mut dst[..sealed.len()];
        dst.copy_from_slice(sealed);
        self.receiver
            .open_in_place(counter, dst)
            .map_err(|_| WireGuardError::InvalidAeadTag)?;
        self.receiving_counter_mark(counter)?;
        Ok(Opened {
            len: sealed.len() - AEAD_SIZE,
            counter,
        })
    }

    /// A data message's counter, if the message is one of this session's and its counter may
    /// still be accepted. Don't reuse counters, in case this is a replay attack we want to
    /// quickly check the counter without running expensive decryption.
    fn check_header(&self, message: &[u8]) -> Result<u64, WireGuardError> {
        let header = data_header(message)?;
        if header.receiver_idx != self.receiving_index {
            return Err(WireGuardError::WrongIndex);
        }
        self.receiving_counter_quick_check(header.counter)?;
        Ok(header.counter)
    }

    /// Returns the estimated downstream packet loss for this session
    pub(super) fn current_packet_cnt(&self) -> (u64, u64) {
        let counter_validator = self.receiving_key_counter.lock();
        (counter_validator.next, counter_validator.receive_cnt)
    }
}

/// The receiver index and counter of a data message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub receiver_idx: u32,
    pub counter: u64,
}

/// Reads a data message's header: type 4 with zero reserved bytes, at least a header and tag.
#[inline]
pub fn data_header(message: &[u8]) -> Result<DataHeader, WireGuardError> {
    if message.len() < super::DATA_OVERHEAD_SZ {
        return Err(WireGuardError::InvalidPacket);
    }
    let mut word = [0u8; 4];
    word.copy_from_slice(&message[0..4]);
    if u32::from_le_bytes(word) != super::DATA {
        return Err(WireGuardError::WrongPacketType);
    }
    word.copy_from_slice(&message[4..8]);
    let receiver_idx = u32::from_le_bytes(word);
    let mut counter = [0u8; 8];
    counter.copy_from_slice(&message[8..16]);
    Ok(DataHeader {
        receiver_idx,
        counter: u64::from_le_bytes(counter),
    })
}

#[cfg(test)]
impl Session {
    /// A session whose keys are `a` (receiving) and `b` (sending), and its peer's mirror image.
    pub(crate) fn pair_for_test(a: [u8; 32], b: [u8; 32]) -> (Session, Session) {
        (Session::new(1, 2, a, b), Session::new(2, 1, b, a))
    }

    pub(crate) fn set_sending_counter_for_test(&self, counter: u64) {
        self.sending_key_counter.store(counter, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_in_place_opens_in_place_and_by_copy_once() {
        let (ours, theirs) = Session::pair_for_test([1; 32], [2; 32]);
        let plain: Vec<u8> = (0..100u8).collect();
        let first = ours.reserve(2).expect("fresh counters");
        assert_eq!(first, 0);
        let mut message = vec![0u8; 100 + 32];
        message[DATA_OFFSET..DATA_OFFSET + 100].copy_from_slice(&plain);
        assert_eq!(ours.seal_in_place(first + 1, &mut message, 100), 132);
        assert_eq!(
            data_header(&message),
            Ok(DataHeader {
                receiver_idx: 2,
                counter: 1
            })
        );
        let mut copy = vec![0u8; 200];
        let opened = theirs.open(&message, &mut copy).expect("authentic");
        assert_eq!((opened.len, opened.counter), (100, 1));
        assert_eq!(copy[..100], plain[..]);
        // The same message again is a replay, whichever way it is opened.
        let mut again = message.clone();
        assert_eq!(
            theirs.open_in_place(&mut again),
            Err(WireGuardError::DuplicateCounter)
        );
        // Counter 0, sealed after 1, still opens (reordering within the window), in place.
        let mut earlier = vec![0u8; 100 + 32];
        assert_eq!(ours.seal(first, &plain, &mut earlier), 132);
        let opened = theirs.open_in_place(&mut earlier).expect("authentic");
        assert_eq!(opened.counter, 0);
        assert_eq!(earlier[DATA_OFFSET..DATA_OFFSET + 100], plain[..]);
    }

    #[test]
    fn a_flipped_bit_or_a_foreign_index_is_refused_and_burns_no_counter() {
        let (ours, theirs) = Session::pair_for_test([1; 32], [2; 32]);
        let mut message = vec![0u8; 64 + 32];
        ours.seal(ours.reserve(1).expect("counter"), &[7u8; 64], &mut message);
        let mut forged = message.clone();
        forged[40] ^= 1;
        assert_eq!(
            theirs.open_in_place(&mut forged),
            Err(WireGuardError::InvalidAeadTag)
        );
        let mut elsewhere = message.clone();
        elsewhere[4] = 9;
        assert_eq!(
            theirs.open_in_place(&mut elsewhere),
            Err(WireGuardError::WrongIndex)
        );
        // The genuine message still opens: the forgery did not mark its counter.
        assert!(theirs.open_in_place(&mut message).is_ok());
    }

    #[test]
    fn counters_stop_before_reject_after_messages_on_both_sides() {
        let (ours, theirs) = Session::pair_for_test([1; 32], [2; 32]);
        ours.set_sending_counter_for_test(REJECT_AFTER_MESSAGES - 3);
        assert_eq!(ours.reserve(4), None, "the last would be at the limit");
        assert_eq!(ours.reserve(3), Some(REJECT_AFTER_MESSAGES - 3));
        for _ in 0..10_000 {
            assert_eq!(ours.reserve(1), None, "spent: it never wraps to 0");
        }
        // A message numbered at the limit is refused before decryption.
        let mut message = vec![0u8; 32];
        ours.seal_in_place(REJECT_AFTER_MESSAGES, &mut message, 0);
        assert_eq!(
            theirs.open_in_place(&mut message),
            Err(WireGuardError::InvalidCounter)
        );
    }

    #[test]
    fn threads_reserving_at_once_never_share_a_counter() {
        let (ours, _) = Session::pair_for_test([1; 32], [2; 32]);
        let ours = std::sync::Arc::new(ours);
        let firsts: Vec<Vec<u64>> = (0..4)
            .map(|_| {
                let s = ours.clone();
                std::thread::spawn(move || (0..1000).filter_map(|_| s.reserve(3)).collect())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        let mut all: Vec<u64> = firsts.into_iter().flatten().collect();
        all.sort_unstable();
        assert_eq!(all, (0..4000).map(|i| i * 3).collect::<Vec<_>>());
    }
    #[test]
    fn test_replay_counter() {
        let mut c: ReceivingKeyCounterValidator = Default::default();

        assert!(c.mark_did_receive(0).is_ok());
        assert!(c.mark_did_receive(0).is_err());
        assert!(c.mark_did_receive(1).is_ok());
        assert!(c.mark_did_receive(1).is_err());
        assert!(c.mark_did_receive(63).is_ok());
        assert!(c.mark_did_receive(63).is_err());
        assert!(c.mark_did_receive(15).is_ok());
        assert!(c.mark_did_receive(15).is_err());

        for i in 64..N_BITS + 128 {
            assert!(c.mark_did_receive(i).is_ok());
            assert!(c.mark_did_receive(i).is_err());
        }

        assert!(c.mark_did_receive(N_BITS * 3).is_ok());
        for i in 0..=N_BITS * 2 {
            assert!(matches!(
                c.will_accept(i),
                Err(WireGuardError::InvalidCounter)
            ));
            assert!(c.mark_did_receive(i).is_err());
        }
        for i in N_BITS * 2 + 1..N_BITS * 3 {
            assert!(c.will_accept(i).is_ok());
        }
        assert!(matches!(
            c.will_accept(N_BITS * 3),
            Err(WireGuardError::DuplicateCounter)
        ));

        for i in (N_BITS * 2 + 1..N_BITS * 3).rev() {
            assert!(c.mark_did_receive(i).is_ok());
            assert!(c.mark_did_receive(i).is_err());
        }

        assert!(c.mark_did_receive(N_BITS * 3 + 70).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 71).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 72).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 72 + 125).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 63).is_ok());

        assert!(c.mark_did_receive(N_BITS * 3 + 70).is_err());
        assert!(c.mark_did_receive(N_BITS * 3 + 71).is_err());
        assert!(c.mark_did_receive(N_BITS * 3 + 72).is_err());
    }
}
