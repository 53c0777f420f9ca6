//! RuleSet -> `iptables-restore --noflush` / `ip6tables-restore --noflush` input, and the
//! parsers for `iptables-save` output that tell which of our jumps exist and what our chains
//! hold. Pure. The daemon for interface `tg0` owns only the chains `TG-tg0-PRE`, `-POST`,
//! `-FWD`, `-MSS` and `-IN` ([`chain_name`]) and one jump to each from its built-in chain; every other
//! chain and rule, another tunnelgate's chains for another interface included, is left as it is.

use super::model::{lower, Chain, Match, Rule, Verdict};
use super::{Family, Proto, RuleSet};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

/// What every chain of ours starts with; the tunnel interface name and a suffix follow.
pub const CHAIN_PREFIX: &str = "TG-";

/// The longest chain name iptables accepts (`XT_EXTENSION_MAXNAMELEN` minus the NUL). Ours
/// are at most 3 + 15 + 5 = 23 characters for a valid interface name.
pub const MAX_CHAIN_NAME_CHARS: usize = 28;

/// One chain we own: its table, the built-in chain that jumps to it, and the suffix of its
/// name after `TG-<iface>-`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnedChain {
    pub chain: Chain,
    pub table: &'static str,
    pub builtin: &'static str,
    pub suffix: &'static str,
}

/// Every chain we own, in the order they are rendered.
pub const OWNED_CHAINS: [OwnedChain; 5] = [
    OwnedChain {
        chain: Chain::Prerouting,
        table: "nat",
        builtin: "PREROUTING",
        suffix: "PRE",
    },
    OwnedChain {
        chain: Chain::Postrouting,
        table: "nat",
        builtin: "POSTROUTING",
        suffix: "POST",
    },
    OwnedChain {
        chain: Chain::Forward,
        table: "filter",
        builtin: "FORWARD",
        suffix: "FWD",
    },
    OwnedChain {
        chain: Chain::Mss,
        table: "mangle",
        builtin: "FORWARD",
        suffix: "MSS",
    },
    OwnedChain {
        chain: Chain::Input,
        table: "filter",
        builtin: "INPUT",
        suffix: "IN",
    },
];

/// The name of our `chain` for the daemon of interface `tunnel`: `TG-<tunnel>-PRE`, `-POST`,
/// `-FWD`, `-MSS` or `-IN`. The interface name is used as it is (iptables takes its characters), so
/// two interfaces never share a chain.
pub fn chain_name(tunnel: &str, chain: Chain) -> String {
    let suffix = OWNED_CHAINS
        .iter()
        .find(|c| c.chain == chain)
        .map_or("", |c| c.suffix);
    format!("{CHAIN_PREFIX}{tunnel}-{suffix}")
}

impl OwnedChain {
    fn name(&self, tunnel: &str) -> String {
        chain_name(tunnel, self.chain)
    }
}

const TABLES: [&str; 3] = ["nat", "filter", "mangle"];

/// Which of our chains exist and how often each built-in chain jumps to ours, as read from
/// `iptables-save` by [`parse_jumps`]. `Default` is a system with nothing of ours.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JumpState {
    jumps: BTreeMap<Chain, usize>,
    chains: BTreeSet<Chain>,
}

impl JumpState {
    /// How many plain `-j TG-<iface>-*` jumps the built-in chain has to our `chain`.
    pub fn jumps(&self, chain: Chain) -> usize {
        self.jumps.get(&chain).copied().unwrap_or(0)
    }

    /// Whether our `chain` exists.
    pub fn has_chain(&self, chain: Chain) -> bool {
        self.chains.contains(&chain)
    }

    /// Every chain exists with exactly one jump to it: what a successful apply leaves.
    pub fn is_complete(&self) -> bool {
        Chain::ALL
            .iter()
            .all(|c| self.has_chain(*c) && self.jumps(*c) == 1)
    }

    /// Records `n` jumps to `chain` (for callers that know the state without parsing).
    pub fn with_jumps(mut self, chain: Chain, n: usize) -> JumpState {
        self.jumps.insert(chain, n);
        self.chains.insert(chain);
        self
    }
}

/// Input for `iptables-restore --noflush` (`family` V4) or `ip6tables-restore --noflush` (V6).
/// Declaring `:TG-<iface>-X - [0:0]` creates the chain or flushes it, so our chains end up
/// holding exactly these rules; a jump is inserted only where `existing` has none, and extra
/// copies are deleted. Each table block commits atomically. A family with nothing to forward
/// still gets its chains flushed and the drop of tunnel traffic, so stale rules go away.
pub fn render(set: &RuleSet, family: Family, existing: &JumpState) -> String {
    let rules = lower(set);
    let tunnel = set.tunnel.as_str();
    let mut out = header(family, "rules");
    for table in TABLES {
        let owned: Vec<&OwnedChain> = OWNED_CHAINS.iter().filter(|c| c.table == table).collect();
        let _ = writeln!(out, "*{table}");
        for c in &owned {
            let _ = writeln!(out, ":{} - [0:0]", c.name(tunnel));
        }
        for c in &owned {
            for rule in rules.iter().filter(|r| r.chain == c.chain) {
                if rule.family.is_none_or(|f| f == family) {
                    rule_lines(&mut out, &c.name(tunnel), rule, family);
                }
            }
        }
        for c in &owned {
            let name = c.name(tunnel);
            match existing.jumps(c.chain) {
                0 => {
                    let _ = writeln!(out, "-I {} 1 -j {name}", c.builtin);
                }
                n => {
                    for _ in 1..n {
                        let _ = writeln!(out, "-D {} -j {name}", c.builtin);
                    }
                }
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Input for `iptables-restore --noflush` that removes every jump to the chains of the daemon
/// for `tunnel` and the chains themselves. Declaring a chain before `-X` makes it work whether
/// or not the chain exists; `existing` (parsed for the same `tunnel`) says how many jumps to
/// delete, since deleting a missing rule fails the restore.
pub fn render_delete(tunnel: &str, existing: &JumpState, family: Family) -> String {
    let mut out = header(family, "removal");
    for table in TABLES {
        let owned: Vec<&OwnedChain> = OWNED_CHAINS.iter().filter(|c| c.table == table).collect();
        let _ = writeln!(out, "*{table}");
        for c in &owned {
            let _ = writeln!(out, ":{} - [0:0]", c.name(tunnel));
        }
        for c in &owned {
            for _ in 0..existing.jumps(c.chain) {
                let _ = writeln!(out, "-D {} -j {}", c.builtin, c.name(tunnel));
            }
        }
        for c in &owned {
            let _ = writeln!(out, "-X {}", c.name(tunnel));
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Reads `iptables-save` (or `ip6tables-save`) output: which chains of the daemon for
/// `tunnel` exist and how many jumps lead to each from its built-in chain. Chains and jumps of
/// other interfaces are not counted. Counters (`-c`) are ignored.
pub fn parse_jumps(tunnel: &str, save_output: &str) -> JumpState {
    let mut state = JumpState::default();
    let mut table = "";
    for line in save_output.lines().map(strip_counters) {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
            continue;
        }
        for c in OWNED_CHAINS.iter().filter(|c| c.table == table) {
            if chain_decl(line) == Some(c.name(tunnel).as_str()) {
                state.chains.insert(c.chain);
            }
            if is_jump(line, c, tunnel) {
                *state.jumps.entry(c.chain).or_insert(0) += 1;
            }
        }
    }
    state
}

/// How many rules [`owned_lines`] holds, as `iptables -S` counts them: its `-A` lines (the jumps
/// from the built-in chains are rules too), not the table and chain declarations.
pub fn count_rules(owned: &str) -> usize {
    owned.lines().filter(|l| l.starts_with("-A ")).count()
}

/// Only the part of `iptables-save` output that the daemon for `tunnel` owns: per table, its
/// chain declarations (counters zeroed), the jumps to them and their rules, in saved order.
/// Another interface's chains are left out, so they never count as drift. Equal outputs mean
/// equal installed rules; compare the value taken right after an apply with a later one.
pub fn owned_lines(tunnel: &str, save_output: &str) -> String {
    let mut out = String::new();
    let mut table = "";
    let mut printed_table = "";
    for line in save_output.lines().map(strip_counters) {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
            continue;
        }
        let owned = OWNED_CHAINS.iter().filter(|c| c.table == table);
        let mut keep = None;
        for c in owned {
            let name = c.name(tunnel);
            if chain_decl(line) == Some(name.as_str()) {
                keep = Some(format!(":{name} - [0:0]"));
            } else if is_jump(line, c, tunnel) || line.starts_with(&format!("-A {name} ")) {
                keep = Some(line.to_string());
            }
        }
        if let Some(l) = keep {
            if printed_table != table {
                let _ = writeln!(out, "*{table}");
                printed_table = table;
            }
            let _ = writeln!(out, "{l}");
        }
    }
    out
}

fn header(family: Family, what: &str) -> String {
    let tool = match family {
        Family::V4 => "iptables-restore",
        Family::V6 => "ip6tables-restore",
    };
    format!("# tunnelgate: {family} {what} for {tool} --noflush\n")
}

/// `[1:2] -A X ...` (from `iptables-save -c`) -> `-A X ...`, trailing space removed.
fn strip_counters(line: &str) -> &str {
    let line = line.trim_end();
    match (line.starts_with('['), line.find("] ")) {
        (true, Some(i)) => &line[i + 2..],
        _ => line,
    }
}

fn chain_decl(line: &str) -> Option<&str> {
    line.strip_prefix(':')?.split_whitespace().next()
}

fn is_jump(line: &str, c: &OwnedChain, tunnel: &str) -> bool {
    line == format!("-A {} -j {}", c.builtin, c.name(tunnel))
}

/// Appends the iptables lines of one rule. Sets of addresses become one line each (the
/// cross product); DNAT to several targets becomes the nth-counter cascade: with N targets,
/// the line for target i (i = N..2) takes every i-th of the connections that reach it, and
/// the last line takes the rest, so each target gets 1/N of the new connections.
fn rule_lines(out: &mut String, chain: &str, rule: &Rule, family: Family) {
    let mut daddrs: Vec<Option<String>> = vec![None];
    let mut orig: Vec<Option<IpAddr>> = vec![None];
    let (mut iface, mut l4, mut modules) = (Vec::new(), None, Vec::new());
    let (mut ct, mut orig_port) = (None, None);
    for m in &rule.matches {
        match m {
            Match::InIface { name, negate } => iface.push(format!("{}-i {name}", neg(*negate))),
            Match::OutIface { name, negate } => iface.push(format!("{}-o {name}", neg(*negate))),
            Match::Daddr(nets) => daddrs = nets.iter().map(|n| Some(n.to_string())).collect(),
            Match::LocalDaddrOnInIface => {
                modules.push("-m addrtype --dst-type LOCAL --limit-iface-in".to_string())
            }
            Match::Dport(proto, port) => l4 = Some(format!("-p {proto} -m {proto} --dport {port}")),
            Match::TcpSyn => {
                l4 = Some(format!(
                    "-p {p} -m {p} --tcp-flags SYN,RST SYN",
                    p = Proto::Tcp
                ))
            }
            Match::CtDnat {
                orig_daddr,
                orig_dport,
            } => {
                ct = Some("DNAT");
                if !orig_daddr.is_empty() {
                    orig = orig_daddr.iter().map(|a| Some(*a)).collect();
                }
                orig_port = *orig_dport;
            }
            Match::CtEstablished => ct = Some("RELATED,ESTABLISHED"),
            Match::L4(proto) => l4 = Some(format!("-p {proto}")),
            Match::Icmp => {
                l4 = Some(match family {
                    Family::V6 => "-p ipv6-icmp".to_string(),
                    Family::V4 => "-p icmp".to_string(),
                })
            }
            // Only `lower_mapped` (nftables) makes map lookups; `lower` spells every port
            // as a rule of its own, so iptables never sees one.
            Match::InSet(_) => {}
        }
    }
    let comment = format!("-m comment --comment \"{}\"", rule.comment);
    for d in &daddrs {
        for o in &orig {
            let mut parts: Vec<String> = Vec::new();
            parts.extend(d.iter().map(|d| format!("-d {d}")));
            parts.extend(iface.iter().cloned());
            parts.extend(l4.iter().cloned());
            parts.extend(modules.iter().cloned());
            if let Some(state) = ct {
                let mut c = format!("-m conntrack --ctstate {state}");
                if let Some(o) = o {
                    let _ = write!(c, " --ctorigdst {o}");
                }
                if let Some(p) = orig_port {
                    let _ = write!(c, " --ctorigdstport {p}");
                }
                parts.push(c);
            }
            for (stat, target) in targets(&rule.verdict, family) {
                let mut line = parts.clone();
                line.extend(
                    stat.map(|n| format!("-m statistic --mode nth --every {n} --packet 0")),
                );
                line.push(comment.clone());
                let _ = writeln!(out, "-A {chain} {} -j {target}", line.join(" "));
            }
        }
    }
}

/// The `-j` part of each line of a rule of `family`, with the nth divisor for the DNAT cascade.
/// Spelled as `iptables-save` prints it back (drift is a textual comparison).
fn targets(v: &Verdict, family: Family) -> Vec<(Option<usize>, String)> {
    let one = |t: &str| vec![(None, t.to_string())];
    match v {
        Verdict::Accept => one("ACCEPT"),
        Verdict::Drop => one("DROP"),
        Verdict::Reject { tcp_reset: true } => one("REJECT --reject-with tcp-reset"),
        Verdict::Reject { tcp_reset: false } => one(match family {
            Family::V4 => "REJECT --reject-with icmp-port-unreachable",
            Family::V6 => "REJECT --reject-with icmp6-port-unreachable",
        }),
        Verdict::Return => one("RETURN"),
        Verdict::Masquerade => one("MASQUERADE"),
        Verdict::ClampMssToPmtu => one("TCPMSS --clamp-mss-to-pmtu"),
        Verdict::Snat(ip) => one(&format!("SNAT --to-source {ip}")),
        // nftables only (see `Match::InSet` above): no line.
        Verdict::DnatMap(_) | Verdict::SnatMap(_) => Vec::new(),
        Verdict::Dnat { targets, port } => {
            let to: Vec<String> = targets
                .iter()
                .map(|ip| match (ip, port) {
                    (IpAddr::V6(v6), Some(p)) => format!("DNAT --to-destination [{v6}]:{p}"),
                    (ip, Some(p)) => format!("DNAT --to-destination {ip}:{p}"),
                    (ip, None) => format!("DNAT --to-destination {ip}"),
                })
                .collect();
            to.into_iter()
                .enumerate()
                .rev()
                .map(|(i, t)| ((i > 0).then_some(i + 1), t))
                .collect()
        }
    }
}

fn neg(negate: bool) -> &'static str {
    if negate {
        "! "
    } else {
        ""
    }
}
