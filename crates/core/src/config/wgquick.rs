//! wg-quick's INI file (`/etc/wireguard/wg0.conf`) read as wg-quick and `wg setconf` read it,
//! and mapped to tunnelgate's TOML for `tunnelgate import wg-quick`. Pure: the caller reads the
//! file, names the key files and writes them.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::net::IpAddr;
use std::path::Path;

use super::keys::{decode_key, SecretKey};
use super::{Config, IpNet, SecretFiles};

/// The most of a line or value an error quotes: a line of a megabyte is not echoed whole.
const EXCERPT_CHARS: usize = 80;

/// `text` quoted for an error message: at most [`EXCERPT_CHARS`] characters once control
/// characters and quotes are escaped, and a note of how long it was when it was cut.
pub fn excerpt(text: &str) -> String {
    let mut escaped = String::new();
    let (mut shown_chars, mut shown_bytes) = (0, 0);
    for c in text.chars() {
        let e = c.escape_debug();
        if shown_chars + e.len() > EXCERPT_CHARS {
            break;
        }
        shown_chars += e.len();
        shown_bytes += c.len_utf8();
        escaped.extend(e);
    }
    if shown_bytes < text.len() {
        format!("\"{escaped}...\" ({} bytes)", text.len())
    } else {
        format!("\"{escaped}\"")
    }
}

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
                    reason: format!(
                        "unknown section {}: expected [Interface] or [Peer]",
                        excerpt(&stripped)
                    ),
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
                    "{} is neither a section header nor a `Key = Value` line",
                    excerpt(without_comment.trim())
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

/// A key as written, or its excerpt when it is long or holds control characters (a key is
/// whatever precedes `=` on a line).
fn shown_key(key: &str) -> std::borrow::Cow<'_, str> {
    if key.len() > EXCERPT_CHARS || key.chars().any(char::is_control) {
        excerpt(key).into()
    } else {
        key.into()
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
            self.line,
            shown_key(&self.key),
            self.why
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
        write!(
            f,
            "line {}: {}: {}",
            self.line,
            shown_key(&self.key),
            self.problem
        )
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
        "preup" | "postup" => {
            "tunnelgate runs no hook commands; use [[ingress]]/[[egress]]/[router] for \
             forwarding, or an ExecStartPre=/ExecStartPost= in a systemd drop-in"
        }
        "predown" | "postdown" => {
            "tunnelgate runs no hook commands; the daemon removes its own rules and routes at \
             stop, and anything else goes in an ExecStopPost= in a systemd drop-in"
        }
        "saveconfig" => "tunnelgate never writes its configuration back",
        _ => return None,
    })
}

/// Where each TOML key of an import came from: its line and the wg-quick key, so a problem
/// [`Config::parse`] finds in the TOML is reported on the line the user wrote.
#[derive(Default)]
struct Origins(BTreeMap<String, (usize, String)>);

impl Origins {
    fn set(&mut self, toml_key: String, line: usize, ini_key: &str) {
        self.0.insert(toml_key, (line, ini_key.to_string()));
    }

    /// The origin of `toml_key`, or of the nearest key or section that holds it
    /// (`peer[1].allowed_ips[0]` -> `peer[1].allowed_ips` -> `peer[1]`).
    fn of(&self, toml_key: &str) -> (usize, String) {
        let mut key = toml_key;
        loop {
            if let Some(found) = self.0.get(key) {
                return found.clone();
            }
            match key.rfind(['.', '[']) {
                Some(cut) if cut > 0 => key = &key[..cut],
                _ => return (0, toml_key.to_string()),
            }
        }
    }
}

/// The secrets of an import, by the path the TOML names them with, so the TOML can be
/// validated as `check` would before anything is written.
struct ImportedSecrets(BTreeMap<String, String>);

impl SecretFiles for ImportedSecrets {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&*path.to_string_lossy())
            .cloned()
            .ok_or_else(|| "is not a key file this import writes".to_string())
    }
}

/// `text` on one line, its control characters escaped (`\n`, `\u{1b}`): a file name in the
/// header comment or a message (a newline in a folder name must not become a line of TOML).
pub fn escape_controls(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// Maps a parsed wg-quick file to tunnelgate's TOML. `source` names the file in the header
/// comment. Every bad value is reported, with its line, and the TOML is validated as `check`
/// validates a file (duplicate peers, the interface's own key as a peer, ...); nothing is
/// returned half-done.
pub fn import(
    ini: &IniFile,
    name: &str,
    source: &str,
    files: &KeyFiles<'_>,
) -> Result<Imported, Vec<ImportError>> {
    let mut errors = Vec::new();
    let mut unmapped = Vec::new();
    let mut notes = Vec::new();
    let mut origins = Origins::default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Imported from {} by `tunnelgate import wg-quick`.\n",
        escape_controls(source)
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
                origins.set("interface".into(), section.line, "[Interface]");
                origins.set("interface.addresses".into(), section.line, "Address");
                for e in &section.entries {
                    let lower = e.key.to_ascii_lowercase();
                    match lower.as_str() {
                        "privatekey" => {
                            private_key_written = true;
                            origins.set("interface.private_key".into(), e.line, &e.key);
                            origins.set("interface.private_key_file".into(), e.line, &e.key);
                            match decode_key(&e.value) {
                                Ok(k) => private_key = Some(SecretKey(k)),
                                Err(why) => err(e, format!("the private key {why}")),
                            }
                        }
                        "address" => {
                            for a in comma_list(&e.value) {
                                match address(a, false) {
                                    Ok((net, _)) => {
                                        if addresses.is_empty() {
                                            origins.set(
                                                "interface.addresses".into(),
                                                e.line,
                                                &e.key,
                                            );
                                        }
                                        origins.set(
                                            format!("interface.addresses[{}]", addresses.len()),
                                            e.line,
                                            &e.key,
                                        );
                                        addresses.push(net.to_string());
                                    }
                                    Err(why) => err(e, why),
                                }
                            }
                        }
                        "listenport" => match e.value.parse::<u16>() {
                            Ok(p) => {
                                origins.set("interface.listen_port".into(), e.line, &e.key);
                                listen_port = Some(p);
                            }
                            Err(_) => err(
                                e,
                                format!("{}: expected a UDP port 0-65535", excerpt(&e.value)),
                            ),
                        },
                        "mtu" => match e.value.parse::<u16>() {
                            Ok(m) => {
                                origins.set("interface.mtu".into(), e.line, &e.key);
                                mtu = Some(m);
                            }
                            Err(_) => err(e, format!("{}: expected a number", excerpt(&e.value))),
                        },
                        "fwmark" => match parse_fwmark(&e.value) {
                            Ok(m) => {
                                origins.set("interface.fwmark".into(), e.line, &e.key);
                                fwmark = m;
                            }
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
                let at = format!("peer[{index}]");
                origins.set(at.clone(), section.line, "[Peer]");
                let mut public_key = None;
                let mut lines: Vec<String> = Vec::new();
                let mut allowed: Vec<String> = Vec::new();
                for e in &section.entries {
                    match e.key.to_ascii_lowercase().as_str() {
                        "publickey" => match decode_key(&e.value) {
                            Ok(k) => {
                                origins.set(format!("{at}.public_key"), e.line, &e.key);
                                public_key = Some(super::PublicKey(k));
                            }
                            Err(why) => err(e, format!("the public key {why}")),
                        },
                        "presharedkey" => match decode_key(&e.value) {
                            Ok(k) => {
                                origins.set(format!("{at}.preshared_key_file"), e.line, &e.key);
                                preshared_keys.retain(|(i, _)| *i != index);
                                preshared_keys.push((index, SecretKey(k)));
                            }
                            Err(why) => err(e, format!("the preshared key {why}")),
                        },
                        // `check` refuses what is no host and port (`-oProxyCommand=x:1`,
                        // `host:0`, control characters): so does the import, on its line.
                        "endpoint" => match super::validate::parse_endpoint(&e.value) {
                            Ok(_) => {
                                origins.set(format!("{at}.endpoint"), e.line, &e.key);
                                lines.retain(|l| !l.starts_with("endpoint ="));
                                lines.push(format!("endpoint = {}", quote(&e.value)));
                            }
                            Err(_) => err(
                                e,
                                format!(
                                    "{} is not a host and port: expected like \
                                     198.51.100.7:51820, [2001:db8::1]:51820 or \
                                     vpn.example.com:51820 (port 1-65535)",
                                    excerpt(&e.value)
                                ),
                            ),
                        },
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
                                        origins.set(
                                            format!("{at}.allowed_ips[{}]", allowed.len()),
                                            e.line,
                                            &e.key,
                                        );
                                        allowed.push(net.to_string());
                                    }
                                    Err(why) => err(e, why),
                                }
                            }
                        }
                        "persistentkeepalive" => match parse_keepalive(&e.value) {
                            Ok(k) => {
                                origins.set(format!("{at}.persistent_keepalive"), e.line, &e.key);
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
    let imported = Imported {
        toml: out,
        private_key,
        preshared_keys,
        unmapped,
        notes,
    };
    validate_as_check(&imported, files, &origins)?;
    Ok(imported)
}

/// Reads the imported TOML back with [`Config::parse`], its key files answered from memory:
/// what `check` would refuse is refused now, each problem on the wg-quick line it came from.
fn validate_as_check(
    imported: &Imported,
    files: &KeyFiles<'_>,
    origins: &Origins,
) -> Result<(), Vec<ImportError>> {
    let mut secrets = BTreeMap::from([(
        files.private_key.to_string(),
        imported.private_key.expose_base64(),
    )]);
    for (index, psk) in &imported.preshared_keys {
        secrets.insert((files.preshared_key)(*index), psk.expose_base64());
    }
    match Config::parse(&imported.toml, Path::new("/"), &ImportedSecrets(secrets)) {
        Ok(_) => Ok(()),
        Err(found) => Err(found
            .0
            .into_iter()
            .map(|e| {
                let (line, key) = origins.of(&e.key);
                ImportError {
                    line,
                    key,
                    problem: format!("{} (tunnelgate's {})", e.problem, e.key),
                }
            })
            .collect()),
    }
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
                    "{} is not an address: expected like 10.0.0.1/24 or fd00::1/64",
                    excerpt(text)
                ))
            }
        },
    };
    if network && net.trunc() != net {
        return Ok((net.trunc(), true));
    }
    Ok((net, false))
}

/// `FwMark`: `off`, `0` (none) or a number, decimal or `0x` hex as `wg` reads it. The mark
/// comes back as a TOML integer in the base it was written in (`0xca6c` stays hex: marks are
/// spelt in hex in `ip rule` and nft, and a decimal one would not be found by grep).
fn parse_fwmark(value: &str) -> Result<Option<String>, String> {
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let hex = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"));
    let parsed = match hex {
        // Digits only: from_str_radix would also take a sign.
        Some(digits) if digits.bytes().all(|b| b.is_ascii_hexdigit()) => {
            u32::from_str_radix(digits, 16).ok()
        }
        Some(_) => None,
        None if value.bytes().all(|b| b.is_ascii_digit()) => value.parse::<u32>().ok(),
        None => None,
    };
    match parsed {
        Some(0) => Ok(None),
        Some(m) if hex.is_some() => Ok(Some(format!("{m:#x}"))),
        Some(m) => Ok(Some(m.to_string())),
        None => Err(format!(
            "{}: expected off or a 32-bit number (decimal or 0x hex)",
            excerpt(value)
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
        Err(_) => Err(format!(
            "{}: expected off or seconds 1-65535",
            excerpt(value)
        )),
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
