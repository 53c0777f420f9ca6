//! Unknown keys, every one of them: the TOML table is walked against the fields of the raw
//! structs (read off their `Deserialize` impls, so the two cannot drift apart), and each key
//! no struct has is named with its path (`peer[1].allowd_ips`) and, when one is close, the key
//! that was probably meant. serde's `deny_unknown_fields` would stop at the first.

use serde::de::{self, Deserialize, Deserializer, Visitor};

use super::raw::{
    RawConfig, RawDns, RawFirewall, RawForward, RawHealth, RawInterface, RawPeer, RawRouter,
    RawTakeover,
};
use super::ConfigError;

/// The field names a struct's `Deserialize` impl asks for (empty for anything else).
pub(super) fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    /// A deserializer that only records the fields of the struct it is asked for.
    struct Capture<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Capture<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields captured"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Capture(&mut fields));
    fields
}

/// The fields of the table under top-level key `section`, and whether it is an array of
/// tables (`[[peer]]`). `None`: not a section (an unknown top-level key).
fn section_fields(section: &str) -> Option<(&'static [&'static str], bool)> {
    Some(match section {
        "interface" => (field_names::<RawInterface>(), false),
        "peer" => (field_names::<RawPeer>(), true),
        "firewall" => (field_names::<RawFirewall>(), false),
        "ingress" | "egress" => (field_names::<RawForward>(), true),
        "router" => (field_names::<RawRouter>(), false),
        "dns" => (field_names::<RawDns>(), false),
        "health" => (field_names::<RawHealth>(), false),
        "takeover" => (field_names::<RawTakeover>(), false),
        _ => return None,
    })
}

/// Every key of `table` that the configuration does not have, sorted by path. Values of the wrong type (a section that is not a table) are left to the parser.
pub(super) fn unknown_keys(table: &toml::Table) -> Vec<ConfigError> {
    let mut out = Vec::new();
    let top = field_names::<RawConfig>();
    for (key, value) in table {
        if !top.contains(&key.as_str()) {
            out.push(unknown(key.clone(), key, top));
            continue;
        }
        let Some((fields, array)) = section_fields(key) else {
            continue;
        };
        match (value, array) {
            (toml::Value::Table(t), false) => check_table(&mut out, key, t, fields),
            (toml::Value::Array(items), true) => {
                for (i, item) in items.iter().enumerate() {
                    if let toml::Value::Table(t) = item {
                        check_table(&mut out, &format!("{key}[{i}]"), t, fields);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

fn check_table(out: &mut Vec<ConfigError>, path: &str, table: &toml::Table, fields: &[&str]) {
    for key in table.keys() {
        if !fields.contains(&key.as_str()) {
            out.push(unknown(format!("{path}.{key}"), key, fields));
        }
    }
}

/// The error for `key` at `path`, with the closest of `known` when one is near.
fn unknown(path: String, key: &str, known: &[&str]) -> ConfigError {
    let expected = known
        .iter()
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let problem = match closest(key, known) {
        Some(k) => format!("unknown field `{key}`: did you mean `{k}`? expected one of {expected}"),
        None => format!("unknown field `{key}`: expected one of {expected}"),
    };
    ConfigError { key: path, problem }
}

/// The key of `known` that `key` most likely meant: the same once case, `-` and `_` are
/// ignored (`AllowedIPs`, `allowed-ips`), else within a small edit distance (`allowd_ips`).
pub(super) fn closest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    let squash = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let wanted = squash(key);
    if let Some(k) = known.iter().find(|k| squash(k) == wanted) {
        return Some(k);
    }
    let limit = (key.chars().count() / 4).clamp(1, 3);
    known
        .iter()
        .map(|k| (edit_distance(&key.to_ascii_lowercase(), k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance with adjacent transpositions counted as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_of_the_config_is_walked() {
        let top = field_names::<RawConfig>();
        assert!(top.len() >= 8, "{top:?}");
        for section in top {
            let (fields, _) = section_fields(section)
                .unwrap_or_else(|| panic!("section {section} is not checked for unknown keys"));
            assert!(!fields.is_empty(), "{section}");
        }
        assert!(field_names::<RawPeer>().contains(&"allowed_ips"));
    }

    #[test]
    fn suggestions() {
        let peer = field_names::<RawPeer>();
        assert_eq!(closest("allowd_ips", peer), Some("allowed_ips"));
        assert_eq!(closest("AllowedIPs", peer), Some("allowed_ips"));
        assert_eq!(closest("allowed-ips", peer), Some("allowed_ips"));
        assert_eq!(closest("PublicKey", peer), Some("public_key"));
        assert_eq!(closest("endpiont", peer), Some("endpoint"));
        assert_eq!(closest("colour", peer), None);
        assert_eq!(edit_distance("abc", "abc"), 0);
        assert_eq!(edit_distance("ab", "ba"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn every_unknown_key_is_named_with_its_path() {
        let table: toml::Table = toml::from_str(
            "colour = 1\n[interface]\nname = \"tg0\"\nlisten_prot = 1\n\
             [[peer]]\npublic_key = \"x\"\n[[peer]]\nallowd_ips = []\nzzz = 1\n\
             [[ingress]]\ntraget = \"x\"\n",
        )
        .expect("toml");
        let errors = unknown_keys(&table);
        let keys: Vec<&str> = errors.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "colour",
                "ingress[0].traget",
                "interface.listen_prot",
                "peer[1].allowd_ips",
                "peer[1].zzz",
            ]
        );
        assert!(
            errors[2].problem.contains("did you mean `listen_port`"),
            "{}",
            errors[2]
        );
        assert!(
            errors[1].problem.contains("did you mean `target`"),
            "{}",
            errors[1]
        );
        assert!(
            errors[4].problem.contains("expected one of `name`"),
            "{}",
            errors[4]
        );
    }
}
