//! Several daemons on one host: every table and chain name carries the interface name, names of
//! different interfaces never meet, and reading `iptables-save` back sees only our own chains
//! and jumps, whatever another instance has installed beside them.

use super::super::iptables::{self, chain_name, JumpState, MAX_CHAIN_NAME_CHARS};
use super::super::model::Chain;
use super::super::{nft, nft_table, Family, RuleSet};
use super::{fake_save, rules_for};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// Every name the daemon for `tunnel` owns: its nft table and its four iptables chains.
fn owned_names(tunnel: &str) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = Chain::ALL.iter().map(|c| chain_name(tunnel, *c)).collect();
    names.insert(nft_table(tunnel));
    names
}

/// A rule set with ingress, egress, router and MSS rules for interface `tunnel`.
fn full_set(tunnel: &str) -> RuleSet {
    let mut set = rules_for(
        "[[ingress]]\ntarget = \"10.96.0.10\"\nports = [\"80\"]\n\
         [[egress]]\ntarget = \"100.64.0.2\"\n[router]\nadvertise_routes = [\"10.40.0.0/16\"]\n",
        &[],
    );
    set.tunnel = tunnel.into();
    set.mss_clamp = true;
    set
}

/// What `iptables-save` shows with both rule sets installed: one block per table, the lines
/// of `first` then `second` in each (as two `--noflush` restores leave them).
fn save_of_both(first: &str, second: &str) -> String {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for save in [first, second] {
        let mut table = String::new();
        for line in save.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t.to_string();
            } else if line != "COMMIT" && !line.starts_with('#') {
                tables
                    .entry(table.clone())
                    .or_default()
                    .push(line.to_string());
            }
        }
    }
    let mut out = String::new();
    for (table, lines) in tables {
        out += &format!("*{table}\n{}\nCOMMIT\n", lines.join("\n"));
    }
    out
}

#[test]
fn names_carry_the_interface_name_as_it_is() {
    assert_eq!(nft_table("tg0"), "tunnelgate_tg0");
    assert_eq!(nft_table("wg-a.1"), "tunnelgate_wg-a.1");
    assert_ne!(nft_table("tg-0"), nft_table("tg_0"), "no two names collide");
    assert_eq!(chain_name("tg0", Chain::Prerouting), "TG-tg0-PRE");
    assert_eq!(chain_name("tg0", Chain::Postrouting), "TG-tg0-POST");
    assert_eq!(chain_name("tg0", Chain::Forward), "TG-tg0-FWD");
    assert_eq!(chain_name("tg0", Chain::Mss), "TG-tg0-MSS");
    let longest = "abcdefghijklmno";
    for c in Chain::ALL {
        assert!(chain_name(longest, c).len() <= MAX_CHAIN_NAME_CHARS);
    }
}

#[test]
fn rendered_text_names_only_our_table_and_chains() {
    let set = full_set("tg-a");
    let text = nft::render(&set) + &nft::render_delete("tg-a");
    let tables: Vec<&str> = text.lines().filter(|l| l.contains("table inet ")).collect();
    assert!(!tables.is_empty(), "the text names a table:\n{text}");
    for line in tables {
        assert!(line.contains("table inet tunnelgate_tg-a"), "{line}");
    }
    let ours = owned_names("tg-a");
    for family in Family::ALL {
        let text = iptables::render(&set, family, &JumpState::default())
            + &iptables::render_delete(
                "tg-a",
                &JumpState::default().with_jumps(Chain::Mss, 1),
                family,
            );
        let chains: Vec<&str> = text
            .split_whitespace()
            .filter(|w| w.starts_with("TG-"))
            .collect();
        assert!(
            !chains.is_empty(),
            "the {family:?} text names chains:\n{text}"
        );
        for word in chains {
            assert!(ours.contains(word), "{word} in {text}");
        }
    }
}

fn ifname() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_.-]{1,15}".prop_filter("not . or ..", |n| n != "." && n != "..")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn two_interfaces_never_share_a_name(a in ifname(), b in ifname()) {
        prop_assume!(a != b);
        prop_assert!(owned_names(&a).is_disjoint(&owned_names(&b)));
    }

    /// With another instance's chains and jumps installed beside ours (in either order), we
    /// count the same jumps and read back the same lines as when ours are alone, and our
    /// removal script names nothing of theirs.
    #[test]
    fn another_instance_is_invisible_to_our_readback(
        a in ifname(), b in ifname(), extra in 0..2usize, ours_first in any::<bool>()
    ) {
        prop_assume!(a != b);
        let (set_a, set_b) = (full_set(&a), full_set(&b));
        for family in Family::ALL {
            let ours = fake_save(&iptables::render(&set_a, family, &JumpState::default()), extra);
            let alone = save_of_both(&ours, "");
            let other = fake_save(&iptables::render(&set_b, family, &JumpState::default()), 0);
            let both = if ours_first {
                save_of_both(&ours, &other)
            } else {
                save_of_both(&other, &ours)
            };
            let state = iptables::parse_jumps(&a, &both);
            prop_assert_eq!(&state, &iptables::parse_jumps(&a, &alone));
            prop_assert_eq!(iptables::owned_lines(&a, &both), iptables::owned_lines(&a, &alone));
            prop_assert!(iptables::parse_jumps(&b, &both).is_complete());
            let delete = iptables::render_delete(&a, &state, family);
            let theirs = owned_names(&b);
            prop_assert!(delete.split_whitespace().all(|w| !theirs.contains(w)), "{}", delete);
        }
    }
}
