//! The statistics the simulator reports: a fixed-size log-linear histogram (round-trip and
//! handshake times, in microseconds, within 1/32 of the value), the per-interval counters
//! every worker keeps, and the small JSON writer of its output lines. Pure, and no allocation
//! on the recording path.

use std::fmt::Write;

/// Sub-buckets per power of two: values are kept within 1/32 (about 3 %).
const SUB_BITS: u32 = 5;
const SUB: usize = 1 << SUB_BITS;
/// Powers of two above the exact range: up to 2^37 us (38 hours).
const OCTAVES: usize = 32;
pub const BUCKETS: usize = SUB + OCTAVES * SUB;

/// A histogram of microsecond values.
#[derive(Clone)]
pub struct Histogram {
    counts: [u32; BUCKETS],
    total: u64,
    max: u64,
    sum: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: [0; BUCKETS],
            total: 0,
            max: 0,
            sum: 0,
        }
    }
}

/// The bucket of value `v`: exact below [`SUB`], then [`SUB`] buckets per power of two.
fn bucket(v: u64) -> usize {
    if v < SUB as u64 {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let shift = e - SUB_BITS;
    let mantissa = (v >> shift) as usize; // in [SUB, 2 SUB)
    let idx = SUB + shift as usize * SUB + (mantissa - SUB);
    idx.min(BUCKETS - 1)
}

/// The largest value bucket `idx` holds.
fn bucket_high(idx: usize) -> u64 {
    if idx < SUB {
        return idx as u64;
    }
    let shift = ((idx - SUB) / SUB) as u32;
    let mantissa = ((idx - SUB) % SUB + SUB) as u64;
    ((mantissa + 1) << shift) - 1
}

impl Histogram {
    pub fn record(&mut self, us: u64) {
        self.counts[bucket(us)] += 1;
        self.total += 1;
        self.max = self.max.max(us);
        self.sum = self.sum.saturating_add(us);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += *b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
        self.sum = self.sum.saturating_add(other.sum);
    }

    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.total
    }

    #[cfg(test)]
    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn mean(&self) -> Option<f64> {
        (self.total > 0).then(|| self.sum as f64 / self.total as f64)
    }

    /// The `q`-quantile (0 < q <= 1): the smallest bucket bound below which at least
    /// ceil(q * count) values lie, never above the largest value recorded. `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (idx, &c) in self.counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return Some(bucket_high(idx).min(self.max));
            }
        }
        Some(self.max)
    }

    /// `{"n":..,"p50":..,"p90":..,"p99":..,"max":..,"mean":..}` in milliseconds.
    pub fn json_ms(&self) -> String {
        let mut o = Obj::new();
        o.u64("n", self.total);
        for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
            o.opt_f64(name, self.quantile(q).map(|v| v as f64 / 1000.0), 3);
        }
        o.opt_f64("max", (self.total > 0).then(|| self.max as f64 / 1000.0), 3);
        o.opt_f64("mean", self.mean().map(|v| v / 1000.0), 3);
        o.finish()
    }
}

/// Exact quantiles of a small set of values (per-peer times), same rule as
/// [`Histogram::quantile`]; `values` is sorted here.
pub fn exact_quantile(values: &mut [u64], q: f64) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

/// Error kinds counted by name: the fork's `WireGuardError`s (snake case) and the sockets'.
pub const ERROR_NAMES: [&str; 20] = [
    "destination_buffer_too_small",
    "incorrect_packet_length",
    "unexpected_packet",
    "wrong_packet_type",
    "wrong_index",
    "wrong_key",
    "invalid_tai64n_timestamp",
    "wrong_tai64n_timestamp",
    "invalid_mac",
    "invalid_aead_tag",
    "invalid_counter",
    "duplicate_counter",
    "invalid_packet",
    "no_current_session",
    "lock_failed",
    "connection_expired",
    "under_load",
    "send_refused",
    "send_other",
    "recv_refused",
];

/// What one worker counted in one interval (or a window), all summed when merged.
#[derive(Clone, Default)]
pub struct Counters {
    /// Handshake initiations sent (first tries and retries).
    pub init_sent: u64,
    /// Handshakes completed as initiator (a response arrived and checked).
    pub hs_done: u64,
    /// Initiations from the gateway answered (the gateway took the session over).
    pub hs_answered: u64,
    pub cookies: u64,
    pub pings_sent: u64,
    /// Pings not sent: no session to send them on (a handshake is under way instead).
    pub pings_unsent: u64,
    pub replies: u64,
    pub keepalives_sent: u64,
    pub keepalives_received: u64,
    pub datagrams_received: u64,
    pub errors: [u64; ERROR_NAMES.len()],
}

impl Counters {
    pub fn merge(&mut self, o: &Counters) {
        self.init_sent += o.init_sent;
        self.hs_done += o.hs_done;
        self.hs_answered += o.hs_answered;
        self.cookies += o.cookies;
        self.pings_sent += o.pings_sent;
        self.pings_unsent += o.pings_unsent;
        self.replies += o.replies;
        self.keepalives_sent += o.keepalives_sent;
        self.keepalives_received += o.keepalives_received;
        self.datagrams_received += o.datagrams_received;
        for (a, b) in self.errors.iter_mut().zip(o.errors.iter()) {
            *a += *b;
        }
    }

    pub fn error(&mut self, name: &str) {
        if let Some(i) = ERROR_NAMES.iter().position(|n| *n == name) {
            self.errors[i] += 1;
        }
    }

    /// The counters as JSON fields of `o` (errors only those seen).
    pub fn write(&self, o: &mut Obj) {
        o.u64("init_sent", self.init_sent);
        o.u64("hs_done", self.hs_done);
        o.u64("hs_answered", self.hs_answered);
        o.u64("cookies", self.cookies);
        o.u64("pings", self.pings_sent);
        o.u64("pings_unsent", self.pings_unsent);
        o.u64("replies", self.replies);
        o.u64("keepalives_sent", self.keepalives_sent);
        o.u64("keepalives_received", self.keepalives_received);
        o.u64("datagrams_received", self.datagrams_received);
        let mut e = Obj::new();
        for (name, &n) in ERROR_NAMES.iter().zip(self.errors.iter()) {
            if n > 0 {
                e.u64(name, n);
            }
        }
        o.raw("errors", &e.finish());
    }
}

/// A JSON object written field by field (numbers, strings, nested raw JSON).
pub struct Obj {
    buf: String,
}

impl Default for Obj {
    fn default() -> Self {
        Obj::new()
    }
}

impl Obj {
    pub fn new() -> Obj {
        Obj {
            buf: String::from("{"),
        }
    }

    fn key(&mut self, k: &str) {
        if self.buf.len() > 1 {
            self.buf.push(',');
        }
        push_str(&mut self.buf, k);
        self.buf.push(':');
    }

    pub fn u64(&mut self, k: &str, v: u64) -> &mut Obj {
        self.key(k);
        let _ = write!(self.buf, "{v}");
        self
    }

    /// A float with `digits` decimals; null for NaN or infinity.
    pub fn f64(&mut self, k: &str, v: f64, digits: usize) -> &mut Obj {
        self.key(k);
        if v.is_finite() {
            let _ = write!(self.buf, "{v:.digits$}");
        } else {
            self.buf.push_str("null");
        }
        self
    }

    pub fn opt_f64(&mut self, k: &str, v: Option<f64>, digits: usize) -> &mut Obj {
        match v {
            Some(v) => self.f64(k, v, digits),
            None => {
                self.key(k);
                self.buf.push_str("null");
                self
            }
        }
    }

    pub fn str(&mut self, k: &str, v: &str) -> &mut Obj {
        self.key(k);
        push_str(&mut self.buf, v);
        self
    }

    pub fn bool(&mut self, k: &str, v: bool) -> &mut Obj {
        self.key(k);
        self.buf.push_str(if v { "true" } else { "false" });
        self
    }

    /// `v` must be valid JSON.
    pub fn raw(&mut self, k: &str, v: &str) -> &mut Obj {
        self.key(k);
        self.buf.push_str(v);
        self
    }

    pub fn finish(&mut self) -> String {
        let mut s = std::mem::take(&mut self.buf);
        s.push('}');
        self.buf.push('{');
        s
    }
}

/// `s` as a JSON string.
fn push_str(buf: &mut String, s: &str) {
    buf.push('"');
    for c in s.chars() {
        match c {
            '"' => buf.push_str("\\\""),
            '\\' => buf.push_str("\\\\"),
            '\n' => buf.push_str("\\n"),
            '\r' => buf.push_str("\\r"),
            '\t' => buf.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(buf, "\\u{:04x}", c as u32);
            }
            c => buf.push(c),
        }
    }
    buf.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..200_000u64).chain([1 << 30, 1 << 36, u64::MAX / 2]) {
            let b = bucket(v);
            assert!(b >= last, "bucket of {v} went down");
            last = b;
            if b < BUCKETS - 1 {
                let high = bucket_high(b);
                assert!(high >= v, "{v} above its bucket's bound {high}");
                // within 1/32 of the value
                assert!(high - v <= v / 32 + 1, "{v}: bound {high} too loose");
                if b > 0 {
                    assert!(bucket_high(b - 1) < v, "{v} belongs to an earlier bucket");
                }
            }
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_known_set() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        for v in 1..=1000u64 {
            h.record(v * 100); // 100 us .. 100 ms
        }
        assert_eq!(h.count(), 1000);
        assert_eq!(h.max(), 100_000);
        let p50 = h.quantile(0.5).unwrap();
        assert!((50_000..=50_000 + 50_000 / 32 + 1).contains(&p50), "{p50}");
        let p99 = h.quantile(0.99).unwrap();
        assert!((99_000..=99_000 + 99_000 / 32 + 1).contains(&p99), "{p99}");
        assert_eq!(h.quantile(1.0), Some(100_000));
        assert!((h.mean().unwrap() - 50_050.0).abs() < 1e-6);
    }

    #[test]
    fn merge_equals_recording_into_one() {
        let (mut a, mut b, mut all) = (
            Histogram::default(),
            Histogram::default(),
            Histogram::default(),
        );
        for v in 0..5000u64 {
            let x = v * v % 77_777;
            if v % 3 == 0 {
                a.record(x)
            } else {
                b.record(x)
            }
            all.record(x);
        }
        a.merge(&b);
        assert_eq!(a.count(), all.count());
        assert_eq!(a.max(), all.max());
        for q in [0.1, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(a.quantile(q), all.quantile(q));
        }
    }

    #[test]
    fn exact_quantiles() {
        let mut v = vec![5, 1, 4, 2, 3];
        assert_eq!(exact_quantile(&mut v, 0.5), Some(3));
        assert_eq!(exact_quantile(&mut v, 1.0), Some(5));
        assert_eq!(exact_quantile(&mut v, 0.01), Some(1));
        assert_eq!(exact_quantile(&mut [], 0.5), None);
    }

    #[test]
    fn counters_merge_and_errors() {
        let mut a = Counters {
            replies: 2,
            ..Counters::default()
        };
        a.error("invalid_mac");
        a.error("no_such_error");
        let mut b = Counters {
            replies: 3,
            ..Counters::default()
        };
        b.error("invalid_mac");
        a.merge(&b);
        assert_eq!(a.replies, 5);
        assert_eq!(a.errors[8], 2);
        let mut o = Obj::new();
        a.write(&mut o);
        let s = o.finish();
        assert!(s.contains("\"replies\":5"));
        assert!(s.contains("\"errors\":{\"invalid_mac\":2}"));
    }

    #[test]
    fn json_objects() {
        let mut o = Obj::new();
        o.u64("a", 1)
            .f64("b", 1.23456, 2)
            .str("c", "x\"y\\z\n\u{1}")
            .bool("d", true);
        o.opt_f64("e", None, 1)
            .f64("f", f64::NAN, 1)
            .raw("g", "[1]");
        assert_eq!(
            o.finish(),
            r#"{"a":1,"b":1.23,"c":"x\"y\\z\n\u0001","d":true,"e":null,"f":null,"g":[1]}"#
        );
        assert_eq!(Obj::new().finish(), "{}");
        let mut h = Histogram::default();
        assert_eq!(
            h.json_ms(),
            r#"{"n":0,"p50":null,"p90":null,"p99":null,"max":null,"mean":null}"#
        );
        h.record(1500);
        assert_eq!(
            h.json_ms(),
            r#"{"n":1,"p50":1.500,"p90":1.500,"p99":1.500,"max":1.500,"mean":1.500}"#
        );
    }
}
