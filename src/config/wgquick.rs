//! wg-quick's INI file (`/etc/wireguard/wg0.conf`) read as wg-quick and `wg setconf` read it,
//! and mapped to tunnelgate's TOML for `tunnelgate import wg-quick`. Pure: the caller reads the
//! file, names the key files and writes them.

use std::fmt::{self, Write as _};
use std::net::IpAddr;

use super::keys::{decode_key, SecretKey};
use super::IpNet;

/// Which section a line belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionKind {
    Interface,
    Peer,
}

/// One `Key = Value` line. `key` is as written (wg-quick and `wg` compare keys without case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IniEntry {
    /// 1-based line number in the file.
    pub line: usize,
    pub key: String,
    pub value: String,
}

/// One `[Interface]` or `[Peer]` section with its lines, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IniSection {
    pub kind: SectionKind,
    /// The line of the section header.
    pub line: usize,
    pub entries: Vec<IniEntry>,
}

/// A wg-quick file: its sections in file order. Exactly one is the interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IniFile {
    pub sections: Vec<IniSection>,
}

/// Why a text is not a wg-quick config at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotWgQuick {
    /// The offending line, when one is to blame.
    pub line: Option<usize>,
    pub reason: String,
}

impl fmt::Display for NotWgQuick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(n) => write!(f, "line {n}: {}", self.reason),
            None => f.write_str(&self.reason),
        }
    }
}

/// Parses `text` as `wg setconf` does: `#` starts a comment anywhere, whitespace is not
/// significant, section names and keys compare without case, every line outside a comment is
/// a section header or `Key = Value` inside a section.
pub fn parse_ini(text: &str) -> Result<IniFile, NotWgQuick> {
    let mut sections: Vec<IniSection> = Vec::new();
    for (index, raw_line) in text.lines().enumerate() {
        let line = index + 1;
        let without_comment = raw_line.split('#').next().unwrap_or("");
        // `wg` drops every whitespace character of a line before reading it.
        let stripped: String = without_comment
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if stripped.is_empty() {
            continue;
        }
        if stripped.starts_with('[') {
            let kind = if stripped.eq_ignore_ascii_case("[Interface]") {
                SectionKind::Interface
            } else if stripped.eq_ignore_ascii_case("[Peer]") {
                SectionKind::Peer
            } else {
                return Err(NotWgQuick {
                    line: Some(line),
                    reason: format!("unknown section {stripped:?}: expected [Interface] or [Peer]"),
                });
            };
            if kind == SectionKind::Interface
                && sections.iter().any(|s| s.kind == SectionKind::Interface)
            {
                return Err(NotWgQuick {
                    line: Some(line),
                    reason: "a second [Interface] section: expected one per file".into(),
                });
            }
            sections.push(IniSection {
                kind,
                line,
                entries: Vec::new(),
            });
            continue;
        }
        let Some((key, value)) = without_comment.split_once('=') else {
            return Err(NotWgQuick {
                line: Some(line),
                reason: format!(
                    "{:?} is neither a section header nor a `Key = Value` line",
                    without_comment.trim()
                ),
            });
        };
        let Some(section) = sections.last_mut() else {
            return Err(NotWgQuick {
                line: Some(line),
                reason: "a `Key = Value` line before any section: expected [Interface] first"
                    .into(),
            });
        };
        // Whitespace inside a value is dropped too (`wg` does), so `a, b` is `a,b`.
        section.entries.push(IniEntry {
            line,
            key: key.trim().to_string(),
            value: value.chars().filter(|c| !c.is_whitespace()).collect(),
        });
    }
    if !sections.iter().any(|s| s.kind == SectionKind::Interface) {
        return Err(NotWgQuick {
            line: None,
            reason:
                "no [Interface] section: expected a wg-quick config like /etc/wireguard/wg0.conf"
                    .into(),
        });
    }
    Ok(IniFile { sections })
}

/// True when `text` is written for wg-quick rather than for tunnelgate: it has an
/// `[Interface]` or `[Peer]` header and a key only wg-quick spells that way (`PrivateKey`,
/// `AllowedIPs`, ...), and it is not TOML (wg-quick's unquoted keys and addresses never are).
/// tunnelgate's own TOML with a misspelt key stays a TOML file with an unknown key.
pub fn looks_like_wg_quick(text: &str) -> bool {
    const WG_ONLY_KEYS: [&str; 7] = [
        "privatekey",
        "publickey",
        "allowedips",
        "address",
        "listenport",
        "persistentkeepalive",
        "presharedkey",
    ];
    let mut header = false;
    let mut wg_key = false;
    for line in text.lines() {
        let t = line.split('#').next().unwrap_or("").trim();
        if t.eq_ignore_ascii_case("[interface]") || t.eq_ignore_ascii_case("[peer]") {
            header = true;
        } else if let Some((key, _)) = t.split_once('=') {
            let key = key.trim().to_ascii_lowercase();
            wg_key |= WG_ONLY_KEYS.contains(&key.as_str());
        }
    }
    header && wg_key && text.parse::<toml::Table>().is_err()
}

/// The error for a configuration file (`file`) that [`looks_like_wg_quick`]: it says how to
/// convert it instead of a bare TOML syntax error.
pub fn not_toml_error(file: &str) -> super::ConfigError {
    super::ConfigError {
        key: "(file)".into(),
        problem: format!(
            "is a wg-quick INI file ([Interface]/[Peer] with PrivateKey, AllowedIPs, ...), not \
             tunnelgate's TOML: convert it with `tunnelgate import wg-quick {file} > tunnelgate.toml`"
        ),
    }
}

/// A key the import left out, with why; printed on stderr so nothing is dropped silently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unmapped {
    pub line: usize,
    pub key: String,
    pub why: &'static str,
}

impl fmt::Display for Unmapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}: {}: not imported: {}",
            self.line, self.key, self.why
        )
    }
}

/// A value the import cannot take (a bad key, address or number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportError {
    pub line: usize,
    pub key: String,
    pub problem: String,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}: {}", self.line, self.key, self.problem)
    }
}

/// Where the imported TOML says the secrets are; the caller writes them there.
pub struct KeyFiles<'a> {
    pub private_key: &'a str,
    /// The preshared key file of the peer with this index (0-based, file order).
    pub preshared_key: &'a dyn Fn(usize) -> String,
}

/// The result of an import: the TOML text, the secrets to write, and what was left out or
/// changed on the way.
pub struct Imported {
    pub toml: String,
    pub private_key: SecretKey,
    /// (peer index, its preshared key); each goes to `KeyFiles::preshared_key(index)`.
    pub preshared_keys: Vec<(usize, SecretKey)>,
    pub unmapped: Vec<Unmapped>,
    /// Values imported in a different spelling than written (e.g. host bits cleared).
    pub notes: Vec<String>,
}

/// The interface name wg-quick derives from a file name (`wg0.conf` -> `wg0`), if the stem is
/// one wg-quick accepts (1-15 of `a-zA-Z0-9_=+.-`).
pub fn interface_name_from_stem(stem: &str) -> Option<String> {
    let ok = (1..=15).contains(&stem.len())
        && stem
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_=+.-".contains(&b));
    ok.then(|| stem.to_string())
}

/// Why each wg-quick-only interface key has no tunnelgate equivalent.
fn unmapped_interface_key(lower: &str) -> Option<&'static str> {
    Some(match lower {
        "dns" => "tunnelgate sets no resolver; configure DNS on the host (e.g. resolvectl)",
        "table" => {
            "tunnelgate routes every peer's allowed IPs in the main table (a default route \
             through the tunnel gets a policy rule, as wg-quick's Table = auto does)"
        }
        "preup" | "postup" | "predown" | "postdown" => {
            "tunnelgate runs no hook commands; use [[ingress]]/[[egress]]/[router] for \
             forwarding, or an ExecStartPost= in a systemd drop-in"
        }
        "saveconfig" => "tunnelgate never writes its configuration back",
        _ => return None,
    })
}

/// Maps a parsed wg-quick file to tunnelgate's TOML. `source` names the file in the header
/// comment. Every bad value is reported, with its line; nothing is returned half-done.
pub fn import(
    ini: &IniFile,
    name: &str,
    source: &str,
    files: &KeyFiles<'_>,
) -> Result<Imported, Vec<ImportError>> {
    let mut errors = Vec::new();
    let mut unmapped = Vec::new();
    let mut notes = Vec::new();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Imported from {source} by `tunnelgate import wg-quick`.\n"
    );

    let mut private_key = None;
    // A PrivateKey line with a bad value is its own error; only a missing one is reported so.
    let mut private_key_written = false;
    let mut iface_lines: Vec<String> = vec![format!("name = {}", quote(name))];
    let mut addresses: Vec<String> = Vec::new();
    let (mut listen_port, mut mtu, mut fwmark) = (None, None, None);
    let mut peers: Vec<String> = Vec::new();
    let mut preshared_keys = Vec::new();

    for section in &ini.sections {
        let mut err = |e: &IniEntry, problem: String| {
            errors.push(ImportError {
                line: e.line,
                key: e.key.clone(),
                problem,
            })
        };
        match section.kind {
            SectionKind::Interface => {
                for e in &section.entries {
                    let lower = e.key.to_ascii_lowercase();
                    match lower.as_str() {
                        "privatekey" => {
                            private_key_written = true;
                            match decode_key(&e.value) {
                                Ok(k) => private_key = Some(SecretKey(k)),
                                Err(why) => err(e, format!("the private key {why}")),
                            }
                        }
                        "address" => {
                            for a in comma_list(&e.value) {
                                match address(a, false) {
                                    Ok((net, _)) => addresses.push(net.to_string()),
                                    Err(why) => err(e, why),
                                }
                            }
                        }
                        "listenport" => match e.value.parse::<u16>() {
                            Ok(p) => listen_port = Some(p),
                            Err(_) => err(e, format!("{:?}: expected a UDP port 0-65535", e.value)),
                        },
                        "mtu" => match e.value.parse::<u16>() {
                            Ok(m) => mtu = Some(m),
                            Err(_) => err(e, format!("{:?}: expected a number", e.value)),
                        },
                        "fwmark" => match parse_fwmark(&e.value) {
                            Ok(m) => fwmark = m,
                            Err(why) => err(e, why),
                        },
                        other => unmapped.push(Unmapped {
                            line: e.line,
                            key: e.key.clone(),
                            why: unmapped_interface_key(other)
                                .unwrap_or("not a wg-quick [Interface] key"),
                        }),
                    }
                }
            }
            SectionKind::Peer => {
                let index = peers.len();
                let mut public_key = None;
                let mut lines: Vec<String> = Vec::new();
                let mut allowed: Vec<String> = Vec::new();
                for e in &section.entries {
                    match e.key.to_ascii_lowercase().as_str() {
                        "publickey" => match decode_key(&e.value) {
                            Ok(k) => public_key = Some(super::PublicKey(k)),
                            Err(why) => err(e, format!("the public key {why}")),
                        },
                        "presharedkey" => match decode_key(&e.value) {
                            Ok(k) => {
                                preshared_keys.retain(|(i, _)| *i != index);
                                preshared_keys.push((index, SecretKey(k)));
                            }
                            Err(why) => err(e, format!("the preshared key {why}")),
                        },
                        "endpoint" => {
                            lines.retain(|l| !l.starts_with("endpoint ="));
                            lines.push(format!("endpoint = {}", quote(&e.value)));
                        }
                        "allowedips" => {
                            for a in comma_list(&e.value) {
                                match address(a, true) {
                                    Ok((net, changed)) => {
                                        if changed {
                                            notes.push(format!(
                                                "line {}: AllowedIPs {a} imported as {net} (host bits cleared, as wg does)",
                                                e.line
                                            ));
                                        }
                                        allowed.push(net.to_string());
                                    }
                                    Err(why) => err(e, why),
                                }
                            }
                        }
                        "persistentkeepalive" => match parse_keepalive(&e.value) {
                            Ok(k) => {
                                lines.retain(|l| !l.starts_with("persistent_keepalive ="));
                                if let Some(k) = k {
                                    lines.push(format!("persistent_keepalive = {k}"));
                                }
                            }
                            Err(why) => err(e, why),
                        },
                        _ => unmapped.push(Unmapped {
                            line: e.line,
                            key: e.key.clone(),
                            why: "not a wg-quick [Peer] key",
                        }),
                    }
                }
                let Some(public_key) = public_key else {
                    errors.push(ImportError {
                        line: section.line,
                        key: "[Peer]".into(),
                        problem: "has no PublicKey: expected the peer's public key".into(),
                    });
                    peers.push(String::new());
                    continue;
                };
                let mut text = format!(
                    "[[peer]]\npublic_key = {}\n",
                    quote(&public_key.to_base64())
                );
                if preshared_keys.iter().any(|(i, _)| *i == index) {
                    let _ = writeln!(
                        text,
                        "preshared_key_file = {}",
                        quote(&(files.preshared_key)(index))
                    );
                }
                for l in &lines {
                    let _ = writeln!(text, "{l}");
                }
                let _ = writeln!(text, "allowed_ips = {}", list(&allowed));
                peers.push(text);
            }
        }
    }

    let Some(private_key) = private_key else {
        if private_key_written {
            return Err(errors);
        }
        let line = ini
            .sections
            .iter()
            .find(|s| s.kind == SectionKind::Interface)
            .map_or(0, |s| s.line);
        errors.push(ImportError {
            line,
            key: "[Interface]".into(),
            problem: "has no PrivateKey: tunnelgate needs the interface's private key".into(),
        });
        return Err(errors);
    };
    if !errors.is_empty() {
        return Err(errors);
    }
    iface_lines.push(format!("private_key_file = {}", quote(files.private_key)));
    if let Some(p) = listen_port {
        iface_lines.push(format!("listen_port = {p}"));
    }
    iface_lines.push(format!("addresses = {}", list(&addresses)));
    if let Some(m) = mtu {
        iface_lines.push(format!("mtu = {m}"));
    }
    if let Some(m) = fwmark {
        iface_lines.push(format!("fwmark = {m}"));
    }
    let _ = writeln!(out, "[interface]\n{}", iface_lines.join("\n"));
    for p in &peers {
        let _ = write!(out, "\n{p}");
    }
    Ok(Imported {
        toml: out,
        private_key,
        preshared_keys,
        unmapped,
        notes,
    })
}

/// A comma-separated list (wg-quick and `wg` both split on commas); empty items are skipped.
fn comma_list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// An address with or without a prefix (none: the whole address, /32 or /128, as `ip` and
/// `wg` take it). With `network`, host bits are cleared as `wg` does for allowed IPs; the
/// flag says whether that changed it.
fn address(text: &str, network: bool) -> Result<(IpNet, bool), String> {
    let net = match text.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => match text.parse::<IpAddr>() {
            Ok(a) => IpNet::from(a),
            Err(_) => {
                return Err(format!(
                    "{text:?} is not an address: expected like 10.0.0.1/24 or fd00::1/64"
                ))
            }
        },
    };
    if network && net.trunc() != net {
        return Ok((net.trunc(), true));
    }
    Ok((net, false))
}

/// `FwMark`: `off`, `0` (none) or a number, decimal or `0x` hex as `wg` reads it.
fn parse_fwmark(value: &str) -> Result<Option<u32>, String> {
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let parsed = match value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
    {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => value.parse::<u32>(),
    };
    match parsed {
        Ok(0) => Ok(None),
        Ok(m) => Ok(Some(m)),
        Err(_) => Err(format!(
            "{value:?}: expected off or a 32-bit number (decimal or 0x hex)"
        )),
    }
}

/// `PersistentKeepalive`: `off`, `0` (none) or seconds 1-65535.
fn parse_keepalive(value: &str) -> Result<Option<u16>, String> {
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    match value.parse::<u16>() {
        Ok(0) => Ok(None),
        Ok(s) => Ok(Some(s)),
        Err(_) => Err(format!("{value:?}: expected off or seconds 1-65535")),
    }
}

/// A TOML basic string.
fn quote(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| quote(s)).collect();
    format!("[{}]", quoted.join(", "))
}

#[cfg(test)]
mod tests;
