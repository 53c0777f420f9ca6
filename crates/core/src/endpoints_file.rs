//! The endpoints file: where this identity saw its peers authenticate, kept across a restart so
//! that a restarted daemon's takeover can go to a proven endpoint (`crate::takeover`). What it
//! holds and how it is read back are decided here (render, parse, when to write); the shell
//! reads and writes the file (`shell::endpoints`).
//!
//! The text, one peer a line, with the newest endpoint it authenticated from:
//!
//! ```text
//! # tunnelgate endpoints v1: where peers of this identity authenticated (written by tunnelgate)
//! identity <this interface's public key, base64>
//! <peer public key, base64> <ip:port>
//! ```
//!
//! A file of another identity is not ours and is ignored whole (its peers' endpoints were proven
//! to another key). A line that is not a peer and its endpoint is skipped and counted; so are
//! peers past [`MAX_PEERS`].

use crate::config::{decode_key, PublicKey};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The first line; a file that does not start with it is not an endpoints file.
pub const HEADER: &str =
    "# tunnelgate endpoints v1: where peers of this identity authenticated (written by tunnelgate)";
/// The largest file read: 2^20 peers (the kernel's limit) with an IPv6 endpoint each is about
/// 100 MB. Past it the file is refused unread.
pub const MAX_BYTES: u64 = 128 << 20;
/// Peers taken from one file at most: the kernel's limit.
pub const MAX_PEERS: usize = 1 << 20;
/// The file is written at most this often (and at a stop), when a learned endpoint changed.
pub const WRITE_EVERY: Duration = Duration::from_secs(10);

/// The text of the file for `identity` and its peers' newest learned endpoints.
pub fn render<'a>(
    identity: &PublicKey,
    peers: impl IntoIterator<Item = (&'a PublicKey, &'a SocketAddr)>,
) -> String {
    let mut out = format!("{HEADER}\nidentity {identity}\n");
    for (peer, endpoint) in peers {
        out.push_str(&format!("{peer} {endpoint}\n"));
    }
    out
}

/// What a file gave back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Restored {
    pub peers: BTreeMap<PublicKey, SocketAddr>,
    /// Lines that were not taken.
    pub skipped: usize,
}

/// Why a whole file was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("it is not an endpoints file (its first line is not tunnelgate's header)")]
    NotAnEndpointsFile,
    #[error("it holds no identity line")]
    NoIdentity,
    #[error("it was written for another identity ({0}): its endpoints were proven to another key")]
    AnotherIdentity(String),
}

/// Reads `text` for `identity`.
pub fn parse(text: &str, identity: &PublicKey) -> Result<Restored, Refused> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(Refused::NotAnEndpointsFile);
    }
    let written_for = lines
        .next()
        .and_then(|l| l.strip_prefix("identity "))
        .ok_or(Refused::NoIdentity)?;
    if decode_key(written_for).map(PublicKey).ok() != Some(*identity) {
        let shown: String = written_for.chars().take(44).collect();
        return Err(Refused::AnotherIdentity(shown.escape_debug().to_string()));
    }
    let mut restored = Restored::default();
    for line in lines {
        let mut words = line.split(' ');
        let peer = words.next().and_then(|w| decode_key(w).ok()).map(PublicKey);
        let endpoint = words.next().and_then(|w| w.parse::<SocketAddr>().ok());
        match (peer, endpoint, words.next()) {
            (Some(peer), Some(endpoint), None)
                if endpoint.port() != 0
                    && restored.peers.len() < MAX_PEERS
                    && !restored.peers.contains_key(&peer) =>
            {
                restored.peers.insert(peer, endpoint);
            }
            _ => restored.skipped += 1,
        }
    }
    Ok(restored)
}

/// When the file is written: at most every [`WRITE_EVERY`] while learned endpoints change.
#[derive(Debug, Default, Clone, Copy)]
pub struct WriteSchedule {
    dirty: bool,
    last: Option<Instant>,
}

impl WriteSchedule {
    /// A learned endpoint changed.
    pub fn changed(&mut self) {
        self.dirty = true;
    }

    /// Whether to write at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.dirty
            && self
                .last
                .is_none_or(|last| now.saturating_duration_since(last) >= WRITE_EVERY)
    }

    /// Whether anything is unwritten (a stop writes it).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// The file was written at `now` with everything known then.
    pub fn written(&mut self, now: Instant) {
        self.dirty = false;
        self.last = Some(now);
    }
}

#[cfg(test)]
mod tests;
