//! The WireGuard cross-platform userspace API (UAPI) as pure text: parsing `get`/`set`
//! requests into typed values and formatting the replies, exactly as `wg(8)` and wireguard-go
//! speak them (<https://www.wireguard.com/xplatform/>). No I/O here: the daemon's shell owns
//! the socket (`tunnelgate::shell`), and the control core takes the typed values.
//!
//! # Wire format in brief
//!
//! A request is an operation line (`get=1` or `set=1`), then `key=value` lines, then one empty
//! line. Keys are 64 hex characters (written lowercase, read in either case). A `set` reply is
//! `errno=N` and an empty line; a `get` reply is the device's `key=value` lines followed by
//! `errno=0` and an empty line. `wg` opens one connection just to probe that the socket
//! answers, closes it, then opens another for the request.
//!
//! # The sign of `errno`
//!
//! wireguard-go writes the *negated* errno (`errno=-22` for `EINVAL`), and `wg set` relies on it:
//! it reads the number and reports `strerror(-N)`, so a positive number would print
//! "Unknown error -22". [`format_errno`] therefore writes `errno=-22`, while [`Errno`] holds the
//! positive value. `wg show` only accepts `errno=0` in a `get` reply (it cannot parse a sign
//! there), which is all [`format_get`] ever writes.

use crate::config::{IpNet, PublicKey, SecretKey};
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A positive POSIX error number, as carried in a UAPI reply (negated on the wire).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Errno {
    /// I/O failure (wireguard-go: `IpcErrorIO`).
    pub const EIO: Errno = Errno(libc::EIO);
    /// A bad value, an unknown key, a key in the wrong section (wireguard-go: `IpcErrorInvalid`).
    pub const EINVAL: Errno = Errno(libc::EINVAL);
    /// A request too large to accept.
    pub const EMSGSIZE: Errno = Errno(libc::EMSGSIZE);
    /// Framing errors: an unknown operation, a line without `=`, a missing blank line
    /// (wireguard-go: `IpcErrorProtocol`).
    pub const EPROTO: Errno = Errno(libc::EPROTO);
    /// The listen port or fwmark could not be applied (wireguard-go: `IpcErrorPortInUse`).
    pub const EADDRINUSE: Errno = Errno(libc::EADDRINUSE);
    /// wireguard-go's catch-all (`IpcErrorUnknown`, ENOANO).
    pub const ENOANO: Errno = Errno(libc::ENOANO);

    /// The number as the OS knows it.
    pub fn code(self) -> i32 {
        self.0
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Errno({})", self.0)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // "Invalid argument (os error 22)"
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

/// Why a request failed: the errno the client gets, and a reason for the log. The reason never
/// contains key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({errno})")]
pub struct UapiError {
    pub errno: Errno,
    pub reason: String,
}

impl UapiError {
    pub fn new(errno: Errno, reason: impl Into<String>) -> UapiError {
        UapiError {
            errno,
            reason: reason.into(),
        }
    }

    fn invalid(reason: impl Into<String>) -> UapiError {
        UapiError::new(Errno::EINVAL, reason)
    }

    fn proto(reason: impl Into<String>) -> UapiError {
        UapiError::new(Errno::EPROTO, reason)
    }
}

impl From<Errno> for UapiError {
    fn from(errno: Errno) -> UapiError {
        UapiError {
            errno,
            reason: String::new(),
        }
    }
}

/// One parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Get,
    Set(DeviceUpdate),
}

/// A `set=1` request. Apply it in this order, as wireguard-go does: the device keys, then
/// `replace_peers` (remove every peer), then each entry of `peers` in order (the same public key
/// may appear more than once; later entries see the effect of earlier ones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceUpdate {
    /// `Some(None)`: remove the private key (all-zero on the wire).
    pub private_key: Option<Option<SecretKey>>,
    /// `Some(0)`: pick a random port.
    pub listen_port: Option<u16>,
    /// `Some(None)`: remove the mark (0 on the wire).
    pub fwmark: Option<Option<u32>>,
    /// Remove every existing peer before applying `peers`.
    pub replace_peers: bool,
    pub peers: Vec<PeerUpdate>,
}

/// One peer section of a `set=1` request.
///
/// Semantics (those of wireguard-go): if `remove`, remove the peer (if present) and ignore every
/// other field. Otherwise, if the peer does not exist: create it, unless `update_only` (then skip
/// the section). Then set each `Some` field; if `replace_allowed_ips`, drop the peer's existing
/// allowed IPs; then add `allowed_ips`. A section whose key is the device's own public key is
/// ignored by wireguard-go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUpdate {
    pub public_key: PublicKey,
    pub remove: bool,
    pub update_only: bool,
    /// `Some(None)`: remove the preshared key (all-zero on the wire).
    pub preshared_key: Option<Option<SecretKey>>,
    pub endpoint: Option<SocketAddr>,
    /// `Some(0)`: turn persistent keepalive off.
    pub persistent_keepalive: Option<u16>,
    pub replace_allowed_ips: bool,
    /// Host bits are already masked (`10.0.0.1/24` arrives as `10.0.0.0/24`).
    pub allowed_ips: Vec<IpNet>,
}

impl PeerUpdate {
    /// A section that names the peer and changes nothing.
    pub fn new(public_key: PublicKey) -> PeerUpdate {
        PeerUpdate {
            public_key,
            remove: false,
            update_only: false,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: None,
            replace_allowed_ips: false,
            allowed_ips: Vec::new(),
        }
    }
}

/// The device state a `get=1` reply shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceSnapshot {
    pub private_key: Option<SecretKey>,
    /// The port actually bound.
    pub listen_port: u16,
    pub fwmark: Option<u32>,
    pub peers: Vec<PeerSnapshot>,
}

impl DeviceSnapshot {
    /// Applies `update` with wireguard-go's semantics: the reference for implementers of
    /// [`UapiHandler::set`] and the model the tests' fake device uses. As a model it records
    /// `listen_port=0` as 0; a real device binds a random port and reports that one.
    pub fn apply(&mut self, update: &DeviceUpdate) {
        if let Some(key) = &update.private_key {
            self.private_key = key.clone();
            // wireguard-go drops a peer whose key is the device's new public key.
            if let Some(own) = key.as_ref().map(SecretKey::public_key) {
                self.peers.retain(|p| p.public_key != own);
            }
        }
        if let Some(port) = update.listen_port {
            self.listen_port = port;
        }
        if let Some(mark) = update.fwmark {
            self.fwmark = mark;
        }
        if update.replace_peers {
            self.peers.clear();
        }
        let own = self.private_key.as_ref().map(SecretKey::public_key);
        for change in &update.peers {
            if Some(change.public_key) == own {
                continue;
            }
            let found = self
                .peers
                .iter()
                .position(|p| p.public_key == change.public_key);
            if change.remove {
                if let Some(i) = found {
                    self.peers.remove(i);
                }
                continue;
            }
            let i = match found {
                Some(i) => i,
                None if change.update_only => continue,
                None => {
                    self.peers.push(PeerSnapshot::new(change.public_key));
                    self.peers.len() - 1
                }
            };
            let peer = &mut self.peers[i];
            if let Some(psk) = &change.preshared_key {
                peer.preshared_key = psk.clone();
            }
            if let Some(endpoint) = change.endpoint {
                peer.endpoint = Some(endpoint);
            }
            if let Some(secs) = change.persistent_keepalive {
                peer.persistent_keepalive = (secs != 0).then_some(secs);
            }
            if change.replace_allowed_ips {
                peer.allowed_ips.clear();
            }
            if change.allowed_ips.is_empty() {
                continue;
            }
            // A prefix routes to one peer only: adding it to this one takes it from any other
            // (and from earlier in this peer's list: it goes to the end). In one pass per peer,
            // so a section with 100k prefixes is not quadratic.
            let added: std::collections::HashSet<&IpNet> = change.allowed_ips.iter().collect();
            for other in self.peers.iter_mut() {
                other.allowed_ips.retain(|n| !added.contains(n));
            }
            // The order of last appearance, as adding them one by one would give.
            let mut seen = std::collections::HashSet::with_capacity(added.len());
            let mut fresh: Vec<IpNet> = change
                .allowed_ips
                .iter()
                .rev()
                .filter(|n| seen.insert(**n))
                .copied()
                .collect();
            fresh.reverse();
            self.peers[i].allowed_ips.extend(fresh);
        }
    }
}

/// One peer in a `get=1` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSnapshot {
    pub public_key: PublicKey,
    pub preshared_key: Option<SecretKey>,
    /// The current endpoint (after roaming), if any is known.
    pub endpoint: Option<SocketAddr>,
    /// The wall-clock time of the last completed handshake; `None` = never.
    pub last_handshake: Option<SystemTime>,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    /// `None` or `Some(0)`: off.
    pub persistent_keepalive: Option<u16>,
    pub allowed_ips: Vec<IpNet>,
}

impl PeerSnapshot {
    /// A peer with no traffic, no handshake and nothing optional set.
    pub fn new(public_key: PublicKey) -> PeerSnapshot {
        PeerSnapshot {
            public_key,
            preshared_key: None,
            endpoint: None,
            last_handshake: None,
            tx_bytes: 0,
            rx_bytes: 0,
            persistent_keepalive: None,
            allowed_ips: Vec::new(),
        }
    }
}

/// What the daemon implements. Methods are synchronous and may block briefly (the server calls
/// them off the async runtime); the daemon applies a whole update under its own lock, so a
/// request is all-or-nothing unless `set` itself fails half-way.
pub trait UapiHandler: Send + Sync + 'static {
    fn get(&self) -> DeviceSnapshot;
    fn set(&self, update: DeviceUpdate) -> Result<(), UapiError>;

    /// The `get=1` reply in pieces, each handed to `out` as it is made ([`format_get_device`],
    /// [`format_get_peer`], [`GET_END`]); `out` answers false when the client is gone, and the
    /// rest is not made. A handler of many peers makes each piece from a bounded number of
    /// them; this default makes the reply whole.
    fn get_in_pieces(&self, out: &mut dyn FnMut(String) -> bool) {
        out(format_get(&self.get()));
    }
}

/// Parses one complete request: the operation line through the terminating empty line, and
/// nothing after it.
pub fn parse_request(text: &str) -> Result<Request, UapiError> {
    let Some((op, rest)) = text.split_once('\n') else {
        return Err(UapiError::proto(
            "incomplete request: no newline after the operation",
        ));
    };
    match op {
        "get=1" => match rest {
            "\n" => Ok(Request::Get),
            "" => Err(UapiError::proto("get=1 must be followed by an empty line")),
            _ => Err(UapiError::invalid("get=1 takes no arguments")),
        },
        "set=1" => parse_set(rest).map(Request::Set),
        "" => Err(UapiError::proto("empty request")),
        other => Err(UapiError::proto(format!(
            "unknown operation {:?} (expected get=1 or set=1)",
            truncate(other)
        ))),
    }
}

fn parse_set(body: &str) -> Result<DeviceUpdate, UapiError> {
    let mut device = DeviceUpdate::default();
    let mut peer: Option<PeerUpdate> = None;
    let mut lines = body.split_inclusive('\n');
    let mut terminated = false;
    for raw in lines.by_ref() {
        let Some(line) = raw.strip_suffix('\n') else {
            return Err(UapiError::proto(
                "set=1 must end with an empty line (last line has no newline)",
            ));
        };
        if line.is_empty() {
            terminated = true;
            break;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(UapiError::proto(format!(
                "line without '=': {:?}",
                truncate(line)
            )));
        };
        if key == "public_key" {
            device.peers.extend(peer.take());
            let public_key = PublicKey(
                parse_hex_key(value)
                    .map_err(|why| UapiError::invalid(format!("public_key {why}")))?,
            );
            peer = Some(PeerUpdate::new(public_key));
            continue;
        }
        match peer.as_mut() {
            None => device_line(&mut device, key, value)?,
            Some(p) => peer_line(p, key, value)?,
        }
    }
    if !terminated {
        return Err(UapiError::proto("set=1 must end with an empty line"));
    }
    if lines.next().is_some() {
        return Err(UapiError::proto("data after the request's empty line"));
    }
    device.peers.extend(peer);
    Ok(device)
}

fn device_line(device: &mut DeviceUpdate, key: &str, value: &str) -> Result<(), UapiError> {
    match key {
        "private_key" => {
            // Never echo the value: it is the private key.
            let bytes = parse_hex_key(value)
                .map_err(|why| UapiError::invalid(format!("private_key {why}")))?;
            device.private_key = Some(nonzero_secret(bytes));
        }
        "listen_port" => {
            device.listen_port = Some(parse_uint(key, value, u16::MAX.into())? as u16);
        }
        "fwmark" => {
            let mark = parse_uint(key, value, u32::MAX.into())? as u32;
            device.fwmark = Some((mark != 0).then_some(mark));
        }
        "replace_peers" => {
            expect_true(key, value)?;
            device.replace_peers = true;
        }
        _ => {
            return Err(UapiError::invalid(format!(
                "unknown device key {:?} (peer keys must follow a public_key line)",
                truncate(key)
            )))
        }
    }
    Ok(())
}

fn peer_line(peer: &mut PeerUpdate, key: &str, value: &str) -> Result<(), UapiError> {
    match key {
        "remove" => {
            expect_true(key, value)?;
            peer.remove = true;
        }
        "update_only" => {
            expect_true(key, value)?;
            peer.update_only = true;
        }
        "preshared_key" => {
            let bytes = parse_hex_key(value)
                .map_err(|why| UapiError::invalid(format!("preshared_key {why}")))?;
            peer.preshared_key = Some(nonzero_secret(bytes));
        }
        "endpoint" => {
            let endpoint = value.parse::<SocketAddr>().map_err(|_| {
                UapiError::invalid(format!(
                    "endpoint {:?} is not IP:PORT or [IPv6]:PORT",
                    truncate(value)
                ))
            })?;
            peer.endpoint = Some(endpoint);
        }
        "persistent_keepalive_interval" => {
            peer.persistent_keepalive = Some(parse_uint(key, value, u16::MAX.into())? as u16);
        }
        "replace_allowed_ips" => {
            expect_true(key, value)?;
            // Streamed semantics: anything added earlier in this section is replaced too.
            peer.replace_allowed_ips = true;
            peer.allowed_ips.clear();
        }
        "allowed_ip" => {
            let net = value.parse::<IpNet>().map_err(|_| {
                UapiError::invalid(format!(
                    "allowed_ip {:?} is not an IP/PREFIX",
                    truncate(value)
                ))
            })?;
            peer.allowed_ips.push(net.trunc());
        }
        "protocol_version" => {
            if value != "1" {
                return Err(UapiError::invalid(format!(
                    "protocol_version {:?} is not supported (only 1)",
                    truncate(value)
                )));
            }
        }
        _ => {
            return Err(UapiError::invalid(format!(
                "unknown peer key {:?}",
                truncate(key)
            )))
        }
    }
    Ok(())
}

/// Decodes 64 hex characters (either case) into 32 bytes. The error never shows the input.
fn parse_hex_key(value: &str) -> Result<[u8; 32], String> {
    if value.len() != 64 {
        return Err(format!(
            "must be 64 hex characters, got {} characters",
            value.chars().count()
        ));
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(value, &mut out).map_err(|_| "is not valid hex".to_string())?;
    Ok(out)
}

fn nonzero_secret(bytes: [u8; 32]) -> Option<SecretKey> {
    (bytes != [0u8; 32]).then_some(SecretKey(bytes))
}

/// Decimal digits only (Rust's `from_str` would also take a leading `+`, Go's `ParseUint` not).
fn parse_uint(key: &str, value: &str, max: u64) -> Result<u64, UapiError> {
    let bad = || {
        UapiError::invalid(format!(
            "{key} {:?} is not a number from 0 to {max}",
            truncate(value)
        ))
    };
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match value.parse::<u64>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(bad()),
    }
}

fn expect_true(key: &str, value: &str) -> Result<(), UapiError> {
    if value == "true" {
        Ok(())
    } else {
        Err(UapiError::invalid(format!(
            "{key} must be \"true\", got {:?}",
            truncate(value)
        )))
    }
}

/// Keeps log lines short when a client sends something huge.
fn truncate(s: &str) -> &str {
    const MAX: usize = 64;
    if s.len() <= MAX {
        return s;
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The reply to a `set` (or to any failed request): `errno=0` or the negated errno.
pub fn format_errno(result: Result<(), Errno>) -> String {
    match result {
        Ok(()) => "errno=0\n\n".to_string(),
        Err(errno) => format!("errno={}\n\n", -errno.0),
    }
}

/// The complete reply to `get=1`, terminated by `errno=0` and an empty line.
pub fn format_get(device: &DeviceSnapshot) -> String {
    let mut out = String::with_capacity(256 + device.peers.len() * 320);
    format_get_device(
        &mut out,
        device.private_key.as_ref(),
        device.listen_port,
        device.fwmark,
    );
    for peer in &device.peers {
        format_get_peer(&mut out, peer);
    }
    out.push_str(GET_END);
    out
}

/// The end of a `get=1` reply.
pub const GET_END: &str = "errno=0\n\n";

/// The device's lines of a `get=1` reply (what comes before the peers): with
/// [`format_get_peer`] for each peer and [`GET_END`], a reply made piece by piece, so a device
/// of 100,000 peers is never one string.
pub fn format_get_device(
    out: &mut String,
    private_key: Option<&SecretKey>,
    listen_port: u16,
    fwmark: Option<u32>,
) {
    // write! to a String cannot fail.
    if let Some(key) = private_key {
        let _ = writeln!(out, "private_key={}", hex::encode(key.0));
    }
    let _ = writeln!(out, "listen_port={listen_port}");
    if let Some(mark) = fwmark.filter(|m| *m != 0) {
        let _ = writeln!(out, "fwmark={mark}");
    }
}

/// One peer's lines of a `get=1` reply.
pub fn format_get_peer(out: &mut String, peer: &PeerSnapshot) {
    let _ = writeln!(out, "public_key={}", hex::encode(peer.public_key.0));
    if let Some(psk) = &peer.preshared_key {
        let _ = writeln!(out, "preshared_key={}", hex::encode(psk.0));
    }
    out.push_str("protocol_version=1\n");
    if let Some(endpoint) = peer.endpoint {
        let _ = writeln!(out, "endpoint={endpoint}");
    }
    let since_epoch = peer
        .last_handshake
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default();
    let _ = writeln!(out, "last_handshake_time_sec={}", since_epoch.as_secs());
    let _ = writeln!(
        out,
        "last_handshake_time_nsec={}",
        since_epoch.subsec_nanos()
    );
    let _ = writeln!(out, "tx_bytes={}", peer.tx_bytes);
    let _ = writeln!(out, "rx_bytes={}", peer.rx_bytes);
    let _ = writeln!(
        out,
        "persistent_keepalive_interval={}",
        peer.persistent_keepalive.unwrap_or(0)
    );
    for net in &peer.allowed_ips {
        let _ = writeln!(out, "allowed_ip={net}");
    }
}

/// `NAME=<hex>` to set a key, `NAME=<64 zeros>` to clear it, nothing to leave it.
fn write_key(out: &mut String, name: &str, key: &Option<Option<SecretKey>>) {
    match key {
        Some(Some(key)) => {
            let _ = writeln!(out, "{name}={}", hex::encode(key.0));
        }
        Some(None) => {
            let _ = writeln!(out, "{name}={}", "0".repeat(64));
        }
        None => {}
    }
}

/// Formats `update` as the `set=1` request `wg set` would send; [`parse_request`] gives it back.
pub fn format_set(update: &DeviceUpdate) -> String {
    let mut out = String::from("set=1\n");
    write_key(&mut out, "private_key", &update.private_key);
    if let Some(port) = update.listen_port {
        let _ = writeln!(out, "listen_port={port}");
    }
    if let Some(mark) = update.fwmark {
        let _ = writeln!(out, "fwmark={}", mark.unwrap_or(0));
    }
    if update.replace_peers {
        out.push_str("replace_peers=true\n");
    }
    for peer in &update.peers {
        let _ = writeln!(out, "public_key={}", hex::encode(peer.public_key.0));
        if peer.remove {
            out.push_str("remove=true\n");
        }
        if peer.update_only {
            out.push_str("update_only=true\n");
        }
        write_key(&mut out, "preshared_key", &peer.preshared_key);
        if let Some(endpoint) = peer.endpoint {
            let _ = writeln!(out, "endpoint={endpoint}");
        }
        if let Some(secs) = peer.persistent_keepalive {
            let _ = writeln!(out, "persistent_keepalive_interval={secs}");
        }
        if peer.replace_allowed_ips {
            out.push_str("replace_allowed_ips=true\n");
        }
        for net in &peer.allowed_ips {
            let _ = writeln!(out, "allowed_ip={net}");
        }
    }
    out.push('\n');
    out
}

/// Parses a `get=1` reply (what [`format_get`] writes, or wireguard-go's) back into a snapshot.
/// A nonzero `errno` becomes the error; unknown keys are skipped, as `wg` does.
pub fn parse_get_response(text: &str) -> Result<DeviceSnapshot, UapiError> {
    let mut device = DeviceSnapshot::default();
    let mut peer: Option<PeerSnapshot> = None;
    let mut handshake = (0u64, 0u32);
    let mut errno: Option<i64> = None;
    let mut terminated = false;
    for raw in text.split_inclusive('\n') {
        let Some(line) = raw.strip_suffix('\n') else {
            break;
        };
        if line.is_empty() {
            terminated = true;
            break;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(UapiError::proto(format!(
                "line without '=': {:?}",
                truncate(line)
            )));
        };
        let num = |max: u64| parse_uint(key, value, max);
        match (key, peer.as_mut()) {
            ("errno", _) => {
                errno = Some(value.parse::<i64>().map_err(|_| {
                    UapiError::proto(format!("errno {:?} is not a number", truncate(value)))
                })?);
            }
            ("public_key", _) => {
                if let Some(done) = peer.take() {
                    device.peers.push(finish_peer(done, handshake));
                }
                handshake = (0, 0);
                let key = parse_hex_key(value)
                    .map_err(|why| UapiError::invalid(format!("public_key {why}")))?;
                peer = Some(PeerSnapshot::new(PublicKey(key)));
            }
            ("private_key", None) => {
                let bytes = parse_hex_key(value)
                    .map_err(|why| UapiError::invalid(format!("private_key {why}")))?;
                device.private_key = nonzero_secret(bytes);
            }
            ("listen_port", None) => device.listen_port = num(u16::MAX.into())? as u16,
            ("fwmark", None) => {
                let mark = num(u32::MAX.into())? as u32;
                device.fwmark = (mark != 0).then_some(mark);
            }
            ("preshared_key", Some(p)) => {
                let bytes = parse_hex_key(value)
                    .map_err(|why| UapiError::invalid(format!("preshared_key {why}")))?;
                p.preshared_key = nonzero_secret(bytes);
            }
            ("endpoint", Some(p)) => {
                p.endpoint = Some(value.parse().map_err(|_| {
                    UapiError::invalid(format!("endpoint {:?} is not IP:PORT", truncate(value)))
                })?);
            }
            ("last_handshake_time_sec", Some(_)) => handshake.0 = num(u64::MAX)?,
            ("last_handshake_time_nsec", Some(_)) => handshake.1 = num(999_999_999)? as u32,
            ("tx_bytes", Some(p)) => p.tx_bytes = num(u64::MAX)?,
            ("rx_bytes", Some(p)) => p.rx_bytes = num(u64::MAX)?,
            ("persistent_keepalive_interval", Some(p)) => {
                let secs = num(u16::MAX.into())? as u16;
                p.persistent_keepalive = (secs != 0).then_some(secs);
            }
            ("allowed_ip", Some(p)) => {
                let net = value.parse::<IpNet>().map_err(|_| {
                    UapiError::invalid(format!("allowed_ip {:?} is not IP/PREFIX", truncate(value)))
                })?;
                p.allowed_ips.push(net);
            }
            _ => {}
        }
    }
    if let Some(done) = peer.take() {
        device.peers.push(finish_peer(done, handshake));
    }
    match errno {
        _ if !terminated => Err(UapiError::proto("reply does not end with an empty line")),
        None => Err(UapiError::proto("reply has no errno line")),
        Some(0) => Ok(device),
        Some(n) => {
            let code = i32::try_from(n.unsigned_abs()).unwrap_or(Errno::ENOANO.0);
            Err(UapiError::new(Errno(code), "the device reported an error"))
        }
    }
}

fn finish_peer(mut peer: PeerSnapshot, (secs, nsecs): (u64, u32)) -> PeerSnapshot {
    if secs != 0 || nsecs != 0 {
        peer.last_handshake = UNIX_EPOCH.checked_add(Duration::new(secs, nsecs));
    }
    peer
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    fn key(b: u8) -> [u8; 32] {
        [b; 32]
    }
    fn hexkey(b: u8) -> String {
        hex::encode(key(b))
    }
    fn net(s: &str) -> IpNet {
        s.parse().expect("test CIDR")
    }
    fn set(body: &str) -> Result<DeviceUpdate, UapiError> {
        match parse_request(&format!("set=1\n{body}\n"))? {
            Request::Set(u) => Ok(u),
            Request::Get => panic!("expected set"),
        }
    }
    fn set_ok(body: &str) -> DeviceUpdate {
        set(body).unwrap_or_else(|e| panic!("{body:?}: {e}"))
    }
    fn set_err(body: &str) -> Errno {
        match set(body) {
            Ok(u) => panic!("{body:?} parsed as {u:?}"),
            Err(e) => e.errno,
        }
    }
    fn peer_ok(lines: &str) -> PeerUpdate {
        let mut u = set_ok(&format!("public_key={}\n{lines}", hexkey(7)));
        assert_eq!(u.peers.len(), 1);
        u.peers.remove(0)
    }

    #[test]
    fn get() {
        assert_eq!(parse_request("get=1\n\n"), Ok(Request::Get));
    }

    #[test]
    fn get_malformed() {
        assert_eq!(
            parse_request("get=1\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("get=1").expect_err("must be rejected").errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("get=1\nx=1\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EINVAL
        );
    }

    #[test]
    fn unknown_operation_is_eproto() {
        for text in ["get=2\n\n", "set=0\n\n", "hello\n\n", "\n\n", "\n", ""] {
            assert_eq!(
                parse_request(text).expect_err("must be rejected").errno,
                Errno::EPROTO,
                "{text:?}"
            );
        }
    }

    #[test]
    fn empty_set() {
        assert_eq!(set_ok(""), DeviceUpdate::default());
    }

    #[test]
    fn private_key() {
        let u = set_ok(&format!("private_key={}\n", hexkey(0xab)));
        assert_eq!(u.private_key, Some(Some(SecretKey(key(0xab)))));
        // Upper case hex is accepted, as by Go's hex.DecodeString.
        let u = set_ok(&format!("private_key={}\n", hexkey(0xab).to_uppercase()));
        assert_eq!(u.private_key, Some(Some(SecretKey(key(0xab)))));
        let u = set_ok(&format!("private_key={}\n", hexkey(0)));
        assert_eq!(u.private_key, Some(None));
    }

    #[test]
    fn listen_port() {
        assert_eq!(set_ok("listen_port=51820\n").listen_port, Some(51820));
        assert_eq!(set_ok("listen_port=0\n").listen_port, Some(0));
        assert_eq!(set_ok("listen_port=65535\n").listen_port, Some(65535));
    }

    #[test]
    fn fwmark() {
        assert_eq!(set_ok("fwmark=51820\n").fwmark, Some(Some(51820)));
        assert_eq!(set_ok("fwmark=4294967295\n").fwmark, Some(Some(u32::MAX)));
        assert_eq!(set_ok("fwmark=0\n").fwmark, Some(None));
    }

    #[test]
    fn replace_peers() {
        assert!(set_ok("replace_peers=true\n").replace_peers);
        assert_eq!(set_err("replace_peers=false\n"), Errno::EINVAL);
        assert_eq!(set_err("replace_peers=1\n"), Errno::EINVAL);
    }

    #[test]
    fn peer_keys() {
        let p = peer_ok("");
        assert_eq!(p, PeerUpdate::new(PublicKey(key(7))));

        assert!(peer_ok("remove=true\n").remove);
        assert!(peer_ok("update_only=true\n").update_only);
        assert_eq!(
            peer_ok(&format!("preshared_key={}\n", hexkey(9))).preshared_key,
            Some(Some(SecretKey(key(9))))
        );
        assert_eq!(
            peer_ok(&format!("preshared_key={}\n", hexkey(0))).preshared_key,
            Some(None)
        );
        assert_eq!(
            peer_ok("endpoint=1.2.3.4:51820\n").endpoint,
            Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::new(1, 2, 3, 4)),
                51820
            ))
        );
        assert_eq!(
            peer_ok("endpoint=[::1]:51820\n").endpoint,
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 51820))
        );
        assert_eq!(
            peer_ok("persistent_keepalive_interval=25\n").persistent_keepalive,
            Some(25)
        );
        assert_eq!(
            peer_ok("persistent_keepalive_interval=0\n").persistent_keepalive,
            Some(0)
        );
        assert!(peer_ok("replace_allowed_ips=true\n").replace_allowed_ips);
        assert_eq!(
            peer_ok("allowed_ip=10.0.0.0/24\nallowed_ip=fd00::/64\nallowed_ip=0.0.0.0/0\n")
                .allowed_ips,
            vec![net("10.0.0.0/24"), net("fd00::/64"), net("0.0.0.0/0")]
        );
        assert_eq!(
            peer_ok("protocol_version=1\n"),
            PeerUpdate::new(PublicKey(key(7)))
        );
    }

    #[test]
    fn allowed_ip_host_bits_are_masked() {
        assert_eq!(
            peer_ok("allowed_ip=10.1.2.3/8\nallowed_ip=fd00::1/64\nallowed_ip=10.0.0.1/32\n")
                .allowed_ips,
            vec![net("10.0.0.0/8"), net("fd00::/64"), net("10.0.0.1/32")]
        );
    }

    #[test]
    fn replace_allowed_ips_drops_earlier_ones_in_the_section() {
        let p =
            peer_ok("allowed_ip=10.0.0.0/8\nreplace_allowed_ips=true\nallowed_ip=10.1.0.0/16\n");
        assert!(p.replace_allowed_ips);
        assert_eq!(p.allowed_ips, vec![net("10.1.0.0/16")]);
    }

    #[test]
    fn several_peers_in_order() {
        let u = set_ok(&format!(
            "private_key={}\nlisten_port=1\nreplace_peers=true\n\
             public_key={}\nallowed_ip=10.0.0.1/32\n\
             public_key={}\nremove=true\n\
             public_key={}\nendpoint=[fd00::1]:5\n",
            hexkey(1),
            hexkey(2),
            hexkey(3),
            hexkey(2)
        ));
        assert_eq!(u.private_key, Some(Some(SecretKey(key(1)))));
        assert_eq!(u.listen_port, Some(1));
        assert!(u.replace_peers);
        let keys: Vec<_> = u.peers.iter().map(|p| p.public_key).collect();
        assert_eq!(
            keys,
            vec![PublicKey(key(2)), PublicKey(key(3)), PublicKey(key(2))]
        );
        assert_eq!(u.peers[0].allowed_ips, vec![net("10.0.0.1/32")]);
        assert!(u.peers[1].remove);
        assert!(u.peers[2].endpoint.is_some());
    }

    #[test]
    fn bad_hex_and_short_keys() {
        let bad = "zz".repeat(32);
        for k in ["private_key", "public_key"] {
            assert_eq!(set_err(&format!("{k}={bad}\n")), Errno::EINVAL, "{k}");
            assert_eq!(
                set_err(&format!("{k}={}\n", &hexkey(1)[..62])),
                Errno::EINVAL
            );
            assert_eq!(set_err(&format!("{k}={}00\n", hexkey(1))), Errno::EINVAL);
            assert_eq!(set_err(&format!("{k}=\n")), Errno::EINVAL);
            // base64 is what users type, but not what the wire carries.
            assert_eq!(
                set_err(&format!(
                    "{k}=yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\n"
                )),
                Errno::EINVAL
            );
        }
        assert_eq!(
            set_err(&format!("public_key={}\npreshared_key=abc\n", hexkey(1))),
            Errno::EINVAL
        );
        // A multi-byte character must not trip the length check into a panic.
        assert_eq!(
            set_err(&format!("private_key={}é\n", &hexkey(1)[..62])),
            Errno::EINVAL
        );
    }

    #[test]
    fn errors_never_show_secrets() {
        let secret = format!("{}x", &hexkey(0x5a)[..63]);
        let err = set(&format!("private_key={secret}\n")).expect_err("must be rejected");
        assert!(!err.to_string().contains(&secret[..20]), "{err}");
        let err = set(&format!(
            "public_key={}\npreshared_key={secret}\n",
            hexkey(1)
        ))
        .expect_err("must be rejected");
        assert!(!err.to_string().contains(&secret[..20]), "{err}");
    }

    #[test]
    fn bad_numbers() {
        for v in [
            "65536",
            "-1",
            "+1",
            "",
            " 1",
            "1 ",
            "0x10",
            "99999999999999999999999",
        ] {
            assert_eq!(
                set_err(&format!("listen_port={v}\n")),
                Errno::EINVAL,
                "{v:?}"
            );
        }
        assert_eq!(set_err("fwmark=4294967296\n"), Errno::EINVAL);
        assert_eq!(set_err("fwmark=-1\n"), Errno::EINVAL);
        let pk = hexkey(1);
        assert_eq!(
            set_err(&format!(
                "public_key={pk}\npersistent_keepalive_interval=65536\n"
            )),
            Errno::EINVAL
        );
        assert_eq!(
            set_err(&format!(
                "public_key={pk}\npersistent_keepalive_interval=x\n"
            )),
            Errno::EINVAL
        );
    }

    #[test]
    fn bad_values() {
        let pk = hexkey(1);
        for line in [
            "endpoint=1.2.3.4",
            "endpoint=example.com:51820",
            "endpoint=::1:51820",
            "endpoint=1.2.3.4:70000",
            "endpoint=",
            "allowed_ip=10.0.0.0",
            "allowed_ip=10.0.0.0/33",
            "allowed_ip=fd00::/129",
            "allowed_ip=10.0.0/8",
            "allowed_ip=banana/8",
            "allowed_ip=",
            "protocol_version=2",
            "protocol_version=0",
            "protocol_version=",
            "remove=false",
            "update_only=yes",
            "replace_allowed_ips=false",
        ] {
            assert_eq!(
                set_err(&format!("public_key={pk}\n{line}\n")),
                Errno::EINVAL,
                "{line}"
            );
        }
    }

    #[test]
    fn unknown_and_misplaced_keys() {
        let pk = hexkey(1);
        assert_eq!(set_err("bogus=1\n"), Errno::EINVAL);
        // Peer keys before any public_key, device keys after one.
        assert_eq!(set_err("allowed_ip=10.0.0.0/8\n"), Errno::EINVAL);
        assert_eq!(set_err("protocol_version=1\n"), Errno::EINVAL);
        assert_eq!(
            set_err(&format!("public_key={pk}\nlisten_port=1\n")),
            Errno::EINVAL
        );
        assert_eq!(
            set_err(&format!("public_key={pk}\nbogus=1\n")),
            Errno::EINVAL
        );
        // get-only keys are not settable.
        assert_eq!(
            set_err(&format!("public_key={pk}\ntx_bytes=1\n")),
            Errno::EINVAL
        );
        // Keys are case-sensitive.
        assert_eq!(set_err("Listen_Port=1\n"), Errno::EINVAL);
    }

    #[test]
    fn framing_errors() {
        // No '=' on a line.
        assert_eq!(set_err("listen_port\n"), Errno::EPROTO);
        // Missing blank line.
        assert_eq!(
            parse_request("set=1\nlisten_port=1\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("set=1\nlisten_port=1")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("set=1\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        // Anything after the blank line belongs to another request.
        assert_eq!(
            parse_request("set=1\n\nget=1\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("set=1\nlisten_port=1\n\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        // CRLF is not the protocol: "1\r" is not a number.
        assert_eq!(
            parse_request("set=1\r\nlisten_port=1\r\n\r\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_request("set=1\nlisten_port=1\r\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EINVAL
        );
    }

    #[test]
    fn values_may_contain_equals() {
        // Only the first '=' splits: the rest is the value (and here a bad one).
        assert_eq!(set_err("listen_port=1=2\n"), Errno::EINVAL);
    }

    #[test]
    fn errno_reply_is_negated_like_wireguard_go() {
        assert_eq!(format_errno(Ok(())), "errno=0\n\n");
        assert_eq!(format_errno(Err(Errno::EINVAL)), "errno=-22\n\n");
        assert_eq!(format_errno(Err(Errno::EADDRINUSE)), "errno=-98\n\n");
    }

    #[test]
    fn errno_display() {
        assert_eq!(Errno::EINVAL.to_string(), "Invalid argument (os error 22)");
        let e = UapiError::new(Errno::EPROTO, "why");
        assert!(e.to_string().starts_with("why ("), "{e}");
    }

    fn sample_snapshot() -> DeviceSnapshot {
        DeviceSnapshot {
            private_key: Some(SecretKey(key(1))),
            listen_port: 51820,
            fwmark: Some(0x1234),
            peers: vec![
                PeerSnapshot {
                    public_key: PublicKey(key(2)),
                    preshared_key: Some(SecretKey(key(3))),
                    endpoint: Some("198.51.100.7:51820".parse().expect("addr")),
                    last_handshake: Some(UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789)),
                    tx_bytes: 1000,
                    rx_bytes: 2000,
                    persistent_keepalive: Some(25),
                    allowed_ips: vec![net("10.0.0.0/24"), net("fd00::/64")],
                },
                PeerSnapshot::new(PublicKey(key(4))),
            ],
        }
    }

    #[test]
    fn format_get_exact() {
        let text = format_get(&sample_snapshot());
        let expected = format!(
            "private_key={}\nlisten_port=51820\nfwmark=4660\n\
             public_key={}\npreshared_key={}\nprotocol_version=1\nendpoint=198.51.100.7:51820\n\
             last_handshake_time_sec=1700000000\nlast_handshake_time_nsec=123456789\n\
             tx_bytes=1000\nrx_bytes=2000\npersistent_keepalive_interval=25\n\
             allowed_ip=10.0.0.0/24\nallowed_ip=fd00::/64\n\
             public_key={}\nprotocol_version=1\n\
             last_handshake_time_sec=0\nlast_handshake_time_nsec=0\n\
             tx_bytes=0\nrx_bytes=0\npersistent_keepalive_interval=0\n\
             errno=0\n\n",
            hexkey(1),
            hexkey(2),
            hexkey(3),
            hexkey(4)
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn format_get_empty_device() {
        assert_eq!(
            format_get(&DeviceSnapshot::default()),
            "listen_port=0\nerrno=0\n\n"
        );
        let d = DeviceSnapshot {
            fwmark: Some(0),
            ..Default::default()
        };
        assert_eq!(format_get(&d), "listen_port=0\nerrno=0\n\n");
    }

    #[test]
    fn format_get_ipv6_endpoint_and_pre_epoch_handshake() {
        let mut p = PeerSnapshot::new(PublicKey(key(2)));
        p.endpoint = Some("[fd00::1]:51820".parse().expect("addr"));
        p.last_handshake = Some(UNIX_EPOCH - Duration::from_secs(5));
        let text = format_get(&DeviceSnapshot {
            peers: vec![p],
            ..Default::default()
        });
        assert!(text.contains("\nendpoint=[fd00::1]:51820\n"), "{text}");
        assert!(text.contains("\nlast_handshake_time_sec=0\n"), "{text}");
    }

    #[test]
    fn get_round_trip() {
        let snap = sample_snapshot();
        assert_eq!(parse_get_response(&format_get(&snap)), Ok(snap));
    }

    #[test]
    fn get_response_errors() {
        assert_eq!(
            parse_get_response("errno=-22\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EINVAL
        );
        assert_eq!(
            parse_get_response("listen_port=1\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        assert_eq!(
            parse_get_response("listen_port=1\n\n")
                .expect_err("must be rejected")
                .errno,
            Errno::EPROTO
        );
        // Unknown keys (e.g. from a newer implementation) are skipped.
        assert!(parse_get_response("listen_port=1\nfuture_key=x\nerrno=0\n\n").is_ok());
    }

    #[test]
    fn set_round_trip() {
        let mut p1 = PeerUpdate::new(PublicKey(key(2)));
        p1.update_only = true;
        p1.preshared_key = Some(Some(SecretKey(key(3))));
        p1.endpoint = Some("[::1]:5000".parse().expect("addr"));
        p1.persistent_keepalive = Some(0);
        p1.replace_allowed_ips = true;
        p1.allowed_ips = vec![net("10.9.0.0/24"), net("fd00::/64")];
        let mut p2 = PeerUpdate::new(PublicKey(key(4)));
        p2.remove = true;
        let mut p3 = PeerUpdate::new(PublicKey(key(5)));
        p3.preshared_key = Some(None);
        let update = DeviceUpdate {
            private_key: Some(Some(SecretKey(key(1)))),
            listen_port: Some(4444),
            fwmark: Some(None),
            replace_peers: true,
            peers: vec![p1, p2, p3],
        };
        assert_eq!(
            parse_request(&format_set(&update)),
            Ok(Request::Set(update.clone()))
        );
        let cleared = DeviceUpdate {
            private_key: Some(None),
            fwmark: Some(Some(7)),
            ..Default::default()
        };
        assert_eq!(
            parse_request(&format_set(&cleared)),
            Ok(Request::Set(cleared.clone()))
        );
    }

    #[test]
    fn debug_never_shows_secrets() {
        let u = set_ok(&format!(
            "private_key={}\npublic_key={}\npreshared_key={}\n",
            hexkey(0x11),
            hexkey(0x22),
            hexkey(0x33)
        ));
        let dbg = format!("{u:?}");
        let b64 = |b: u8| SecretKey(key(b)).expose_base64();
        assert!(
            !dbg.contains(&hexkey(0x11)) && !dbg.contains(&b64(0x11)),
            "{dbg}"
        );
        assert!(
            !dbg.contains(&hexkey(0x33)) && !dbg.contains(&b64(0x33)),
            "{dbg}"
        );
        let snap = format!("{:?}", sample_snapshot());
        assert!(!snap.contains(&b64(1)) && !snap.contains(&b64(3)), "{snap}");
    }

    #[test]
    fn apply_follows_wireguard_go() {
        let mut dev = DeviceSnapshot::default();
        let own = SecretKey(key(1));
        let own_pub = own.public_key();
        dev.apply(&set_ok(&format!(
            "private_key={}\nlisten_port=4444\nfwmark=7\n\
             public_key={}\nallowed_ip=10.0.0.0/8\npersistent_keepalive_interval=25\n\
             public_key={}\nallowed_ip=10.0.0.0/8\nallowed_ip=fd00::/64\n\
             public_key={}\nallowed_ip=192.0.2.0/24\n\
             public_key={}\nupdate_only=true\nallowed_ip=10.5.0.0/16\n",
            hex::encode(own.0),
            hexkey(2),
            hexkey(3),
            hex::encode(own_pub.0),
            hexkey(4),
        )));
        assert_eq!(dev.private_key, Some(own));
        assert_eq!((dev.listen_port, dev.fwmark), (4444, Some(7)));
        // Own key ignored, update_only for an unknown peer ignored.
        let keys: Vec<_> = dev.peers.iter().map(|p| p.public_key).collect();
        assert_eq!(keys, vec![PublicKey(key(2)), PublicKey(key(3))]);
        // 10.0.0.0/8 moved from peer 2 to peer 3.
        assert!(dev.peers[0].allowed_ips.is_empty());
        assert_eq!(dev.peers[0].persistent_keepalive, Some(25));
        assert_eq!(
            dev.peers[1].allowed_ips,
            vec![net("10.0.0.0/8"), net("fd00::/64")]
        );

        dev.apply(&set_ok(&format!(
            "fwmark=0\npublic_key={}\nremove=true\n\
             public_key={}\nupdate_only=true\nreplace_allowed_ips=true\nallowed_ip=10.1.0.0/16\n\
             persistent_keepalive_interval=0\n",
            hexkey(2),
            hexkey(3),
        )));
        assert_eq!(dev.fwmark, None);
        assert_eq!(dev.peers.len(), 1);
        assert_eq!(dev.peers[0].allowed_ips, vec![net("10.1.0.0/16")]);
        assert_eq!(dev.peers[0].persistent_keepalive, None);

        // A prefix repeated in one section ends up once, where it was last named.
        dev.apply(&set_ok(&format!(
            "public_key={}\nallowed_ip=10.2.0.0/16\nallowed_ip=10.3.0.0/16\nallowed_ip=10.2.0.0/16\n",
            hexkey(3),
        )));
        assert_eq!(
            dev.peers[0].allowed_ips,
            vec![net("10.1.0.0/16"), net("10.3.0.0/16"), net("10.2.0.0/16")]
        );

        dev.apply(&set_ok("replace_peers=true\n"));
        assert!(dev.peers.is_empty());
        dev.apply(&set_ok(&format!("private_key={}\n", hexkey(0))));
        assert_eq!(dev.private_key, None);
    }

    #[test]
    fn never_panics_on_arbitrary_input() {
        use proptest::prelude::*;
        let mut runner = proptest::test_runner::TestRunner::default();
        let line = prop_oneof![
            Just("public_key=".to_string() + &hexkey(1)),
            Just("allowed_ip=10.0.0.1/8".to_string()),
            "[a-z_]{0,12}=[ -~]{0,70}",
            "\\PC{0,20}",
        ];
        let strategy = (
            prop_oneof![Just("set=1"), Just("get=1"), Just("x")],
            proptest::collection::vec(line, 0..6),
            any::<bool>(),
        );
        runner
            .run(&strategy, |(op, lines, terminate)| {
                let mut text = format!("{op}\n{}", lines.join("\n"));
                if terminate {
                    text.push_str("\n\n");
                }
                let _ = parse_request(&text);
                let _ = parse_get_response(&text);
                Ok(())
            })
            .expect("no panic");
    }
}
