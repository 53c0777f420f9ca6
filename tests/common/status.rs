//! What a running daemon reports: `status --json`, Prometheus metrics parsing, and its installed nftables rules.

use std::collections::BTreeMap;

use super::*;

/// `tunnelgate status --json --interface IFACE` of a running daemon, parsed.
pub fn tunnelgate_status_json(iface: &str) -> Result<serde_json::Value, String> {
    let out = tunnelgate_cli(&["status", "--json", "--interface", iface], None);
    if !out.success() {
        return Err(format!(
            "tunnelgate status --interface {iface} failed ({:?}): {}",
            out.code,
            out.stderr.trim()
        ));
    }
    serde_json::from_str(&out.stdout).map_err(|e| format!("status JSON: {e}: {}", out.stdout))
}

/// One Prometheus sample line, parsed.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

// The one Prometheus text parser of the suites: `metric`/`metric_sum` read samples with it, and
// `netns_ops` builds its strict whole-exposition check (families, types, order) on it.

pub fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A sample value: a Go-style float (`1`, `-2.5e3`, `+Inf`, `-Inf`, `NaN`).
fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        // Rust also accepts "inf", "infinity" and "nan" in any case: the format does not.
        _ if v
            .chars()
            .any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E') =>
        {
            Err(format!("bad value {v:?}"))
        }
        _ => v.parse().map_err(|_| format!("bad value {v:?}")),
    }
}

/// `name{k="v",...} value [timestamp]`.
pub fn parse_sample_line(line: &str) -> Result<Sample, String> {
    let end = line.find(['{', ' ']).ok_or("no value")?;
    let (name, mut rest) = line.split_at(end);
    if !valid_metric_name(name) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.chars();
        loop {
            let remaining = chars.as_str();
            if let Some(after) = remaining.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = remaining.find('=').ok_or("label without =")?;
            let key = &remaining[..eq];
            if !valid_label_name(key) {
                return Err(format!("bad label name {key:?}"));
            }
            chars = remaining[eq + 1..]
                .strip_prefix('"')
                .ok_or_else(|| format!("label {key} is not quoted"))?
                .chars();
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")? {
                    '"' => break,
                    '\\' => match chars.next().ok_or("dangling escape")? {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        c => return Err(format!("bad escape \\{c}")),
                    },
                    '\n' => return Err("raw newline in a label value".into()),
                    c => value.push(c),
                }
            }
            if labels.insert(key.to_string(), value).is_some() {
                return Err(format!("label {key} given twice"));
            }
            let after = chars.as_str();
            if let Some(more) = after.strip_prefix(',') {
                chars = more.chars();
            } else if !after.starts_with('}') {
                return Err("expected , or } after a label".into());
            }
        }
    }
    let rest = rest
        .strip_prefix(' ')
        .ok_or("no single space before the value")?;
    let mut fields = rest.split(' ');
    let value = parse_value(fields.next().unwrap_or(""))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("bad timestamp {ts:?}"))?;
    }
    if fields.next().is_some() {
        return Err("trailing fields".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The samples of an exposition, comments and lines that do not parse skipped.
fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| parse_sample_line(l).ok())
}

/// The value of one Prometheus sample: `name` with exactly `labels` as the daemon writes them
/// (e.g. `name="a.b"`; "" for none) in exposition text.
/// (Every series also has the daemon's `interface="..."` label first; `labels` leaves it out.)
pub fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    let want = parse_sample_line(&format!("x{{{labels}}} 0"))
        .unwrap_or_else(|e| panic!("bad label text {labels:?}: {e}"))
        .labels;
    samples(text)
        .find(|s| {
            let mut have = s.labels.clone();
            have.remove("interface");
            s.name == name && have == want
        })
        .map(|s| s.value)
}

/// The sum of every sample of `name`, whatever its labels (0 when there is none).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    samples(text)
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

impl Tunnelgate {
    /// `tunnelgate status --json` of this daemon.
    pub fn status_json(&self) -> Result<serde_json::Value, String> {
        tunnelgate_status_json(&self.cfg.name)
    }

    /// The `names[]` entry for `name` in the status, if the daemon lists it.
    pub fn name_status(&self, name: &str) -> Option<serde_json::Value> {
        let s = self.status_json().ok()?;
        s["names"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == name)
            .cloned()
    }

    /// The addresses the status shows for `name` (sorted; empty if not listed).
    pub fn name_addresses(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .name_status(name)
            .and_then(|n| {
                n["addresses"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// `GET /metrics`.
    pub fn metrics(&self) -> Result<String, String> {
        match self.health_get("/metrics")? {
            (200, body) => Ok(body),
            (code, body) => Err(format!("/metrics answered {code}: {body}")),
        }
    }
}

impl Netns {
    /// `nft list table inet tunnelgate_<iface>` for every tunnelgate table in the namespace,
    /// concatenated ("" when there is none). One daemon per namespace: its table.
    pub fn nft_tunnelgate_table(&self) -> String {
        self.nft_tunnelgate_tables()
            .iter()
            .map(|t| {
                self.try_exec(&["nft", "list", "table", "inet", t])
                    .unwrap_or_default()
            })
            .collect()
    }

    /// The names of the `inet` tables of tunnelgate daemons in the namespace
    /// (`tunnelgate_<iface>`), sorted.
    pub fn nft_tunnelgate_tables(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .try_exec(&["nft", "list", "tables", "inet"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("table inet "))
            .filter(|n| n.starts_with("tunnelgate_"))
            .map(str::to_string)
            .collect();
        names.sort();
        names
    }

    /// `nft list table inet tunnelgate_<iface>`: the table of the daemon for `iface` ("" when
    /// it does not exist).
    pub fn nft_table_of(&self, iface: &str) -> String {
        self.try_exec(&[
            "nft",
            "list",
            "table",
            "inet",
            &format!("tunnelgate_{iface}"),
        ])
        .unwrap_or_default()
    }
}

/// Whether an nftables listing of our table forwards `port`: a rule matching `dport PORT`, or
/// an element of a DNAT map keyed on that port (`... . PORT comment "..." : target . port`),
/// the form port rules take since they became map elements.
pub fn nft_forwards_port(listing: &str, port: u16) -> bool {
    if listing.contains(&format!("dport {port} ")) {
        return true;
    }
    let key = format!(". {port} ");
    listing.match_indices(&key).any(|(at, _)| {
        let rest = &listing[at + key.len()..];
        let rest = match rest.strip_prefix("comment \"") {
            Some(commented) => commented.split_once('"').map_or("", |(_, after)| after),
            None => rest,
        };
        rest.trim_start().starts_with(':')
    })
}
