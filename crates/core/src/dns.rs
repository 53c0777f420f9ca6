//! When to resolve each DNS-named target, and what a result changes. Pure: time is an argument.
//!
//! Every name is resolved at start, then every `interval`. A failure (timeout, SERVFAIL,
//! NXDOMAIN, an empty answer) keeps the last good addresses and retries with exponential
//! backoff from 1 s, capped at the interval. At most [`MAX_CONCURRENT_RESOLUTIONS`] run at
//! once, each with its own [`RESOLVE_TIMEOUT`]: 100 dead names cost one timeout per 16, not
//! one after another.

use crate::backoff::Backoff;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// First retry delay after a failed resolution; doubles per consecutive failure.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
/// Lookups (target names and peer endpoints together) running at the same time: enough to
/// resolve a large config in a few round trips, few enough not to flood a resolver.
pub const MAX_CONCURRENT_RESOLUTIONS: usize = 16;
/// Longest one resolution (all its attempts) may take before it counts as a failure.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameState {
    /// The last good answer (sorted, deduplicated); empty until the first success.
    pub addresses: Vec<IpAddr>,
    pub next_at: Instant,
    /// A lookup for this name is running: it is not started again until its result is in.
    pub in_flight: bool,
    /// Consecutive failures since the last success.
    pub failures: u32,
    pub ever_resolved: bool,
    pub last_error: Option<String>,
}

/// What one result did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The address set changed from `old` to `new`: rules must be re-rendered.
    Changed {
        old: Vec<IpAddr>,
        new: Vec<IpAddr>,
    },
    Unchanged,
    /// Kept the last good addresses; retry after `retry_in`.
    Failed {
        retry_in: Duration,
    },
}

#[derive(Debug, Clone)]
pub struct Schedule {
    interval: Duration,
    names: BTreeMap<String, NameState>,
}

impl Schedule {
    pub fn new(interval: Duration) -> Schedule {
        Schedule {
            interval,
            names: BTreeMap::new(),
        }
    }

    /// A new re-resolve interval, used from each name's next result on.
    pub fn set_interval(&mut self, interval: Duration) {
        self.interval = interval;
    }

    /// Tracks exactly `names` (new ones are due now; others keep their state).
    pub fn set_names(&mut self, names: &[String], now: Instant) {
        let wanted: BTreeSet<&String> = names.iter().collect();
        self.names.retain(|n, _| wanted.contains(n));
        for n in names {
            self.names.entry(n.clone()).or_insert(NameState {
                addresses: Vec::new(),
                next_at: now,
                in_flight: false,
                failures: 0,
                ever_resolved: false,
                last_error: None,
            });
        }
    }

    /// Names whose resolution is due at `now` and not running.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, s)| s.next_at <= now && !s.in_flight)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Marks up to `limit` due names as running and returns them, earliest due first.
    pub fn start_due(&mut self, now: Instant, limit: usize) -> Vec<String> {
        let mut due: Vec<(Instant, String)> = self
            .names
            .iter()
            .filter(|(_, s)| s.next_at <= now && !s.in_flight)
            .map(|(n, s)| (s.next_at, n.clone()))
            .collect();
        due.sort();
        due.truncate(limit);
        for (_, name) in &due {
            if let Some(state) = self.names.get_mut(name) {
                state.in_flight = true;
            }
        }
        due.into_iter().map(|(_, n)| n).collect()
    }

    /// How many lookups are running.
    pub fn in_flight(&self) -> usize {
        self.names.values().filter(|s| s.in_flight).count()
    }

    /// When the next resolution is due, if any name is tracked and not running.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.names
            .values()
            .filter(|s| !s.in_flight)
            .map(|s| s.next_at)
            .min()
    }

    pub fn get(&self, name: &str) -> Option<&NameState> {
        self.names.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &NameState)> {
        self.names.iter()
    }

    /// The current good addresses of every name.
    pub fn resolved(&self) -> BTreeMap<String, Vec<IpAddr>> {
        self.names
            .iter()
            .map(|(n, s)| (n.clone(), s.addresses.clone()))
            .collect()
    }

    /// Records a resolution result; an empty answer counts as a failure.
    pub fn on_result(
        &mut self,
        name: &str,
        result: Result<Vec<IpAddr>, String>,
        now: Instant,
    ) -> Outcome {
        let interval = self.interval;
        let Some(state) = self.names.get_mut(name) else {
            return Outcome::Unchanged;
        };
        state.in_flight = false;
        let result = result.and_then(|a| {
            if a.is_empty() {
                Err("no addresses in the answer".to_string())
            } else {
                Ok(a)
            }
        });
        match result {
            Ok(mut addrs) => {
                addrs.sort();
                addrs.dedup();
                state.failures = 0;
                state.ever_resolved = true;
                state.last_error = None;
                state.next_at = now + interval;
                if addrs == state.addresses {
                    Outcome::Unchanged
                } else {
                    let old = std::mem::replace(&mut state.addresses, addrs.clone());
                    Outcome::Changed { old, new: addrs }
                }
            }
            Err(e) => {
                state.failures = state.failures.saturating_add(1);
                state.last_error = Some(e);
                let retry_in = backoff(state.failures, interval);
                state.next_at = now + retry_in;
                Outcome::Failed { retry_in }
            }
        }
    }
}

/// Delay before retry number `failures` (1-based): 1 s, 2 s, 4 s, ... capped at `cap`.
pub fn backoff(failures: u32, cap: Duration) -> Duration {
    let mut b = Backoff::new(FIRST_RETRY, cap);
    for _ in 1..failures.min(40) {
        b.next_delay();
    }
    b.next_delay()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn resolves_at_start_then_every_interval() {
        let t0 = crate::test_util::now();
        let mut s = Schedule::new(Duration::from_secs(600));
        s.set_names(&["db.example".into()], t0);
        assert_eq!(s.due(t0), vec!["db.example".to_string()]);
        let out = s.on_result(
            "db.example",
            Ok(vec![ip("10.0.0.2"), ip("10.0.0.1"), ip("10.0.0.1")]),
            t0,
        );
        assert_eq!(
            out,
            Outcome::Changed {
                old: vec![],
                new: vec![ip("10.0.0.1"), ip("10.0.0.2")]
            }
        );
        assert!(s.due(t0 + Duration::from_secs(599)).is_empty());
        assert_eq!(s.next_deadline(), Some(t0 + Duration::from_secs(600)));
        let t1 = t0 + Duration::from_secs(600);
        assert_eq!(s.due(t1).len(), 1);
        assert_eq!(
            s.on_result("db.example", Ok(vec![ip("10.0.0.2"), ip("10.0.0.1")]), t1),
            Outcome::Unchanged
        );
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_interval_and_keep_last_good() {
        let t0 = crate::test_util::now();
        let interval = Duration::from_secs(20);
        let mut s = Schedule::new(interval);
        s.set_names(&["n".into()], t0);
        s.on_result("n", Ok(vec![ip("10.0.0.1")]), t0);
        let mut now = t0 + interval;
        let mut delays = Vec::new();
        for _ in 0..7 {
            match s.on_result("n", Err("SERVFAIL".into()), now) {
                Outcome::Failed { retry_in } => {
                    delays.push(retry_in.as_secs());
                    now += retry_in;
                }
                other => panic!("expected failure, got {other:?}"),
            }
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 20, 20]);
        let st = s.get("n").expect("tracked");
        assert_eq!(st.addresses, vec![ip("10.0.0.1")], "last good answer kept");
        assert_eq!(st.last_error.as_deref(), Some("SERVFAIL"));
        // Recovery resets the backoff and the error.
        assert_eq!(
            s.on_result("n", Ok(vec![ip("10.0.0.9")]), now),
            Outcome::Changed {
                old: vec![ip("10.0.0.1")],
                new: vec![ip("10.0.0.9")]
            }
        );
        assert_eq!(s.get("n").expect("tracked").failures, 0);
        assert_eq!(s.next_deadline(), Some(now + interval));
    }

    #[test]
    fn empty_answer_is_a_failure_and_never_resolved_is_visible() {
        let t0 = crate::test_util::now();
        let mut s = Schedule::new(Duration::from_secs(600));
        s.set_names(&["gone".into()], t0);
        assert!(matches!(
            s.on_result("gone", Ok(vec![]), t0),
            Outcome::Failed { .. }
        ));
        assert!(!s.get("gone").expect("tracked").ever_resolved);
        assert_eq!(backoff(1, Duration::from_secs(600)), Duration::from_secs(1));
        assert_eq!(
            backoff(40, Duration::from_secs(600)),
            Duration::from_secs(600)
        );
    }

    #[test]
    fn set_names_keeps_state_of_remaining_names() {
        let t0 = crate::test_util::now();
        let i = Duration::from_secs(60);
        let mut s = Schedule::new(i);
        s.set_names(&["a".into(), "b".into()], t0);
        s.on_result("a", Ok(vec![ip("10.0.0.1")]), t0);
        s.set_names(&["a".into(), "c".into()], t0);
        assert!(s.get("b").is_none());
        assert_eq!(s.get("a").expect("a").addresses, vec![ip("10.0.0.1")]);
        assert_eq!(s.due(t0), vec!["c".to_string()]);
    }
}
