//! Exponential backoff, the one retry policy of the daemon and the sidecar: `first`, doubling
//! per consecutive failure up to `cap`, back to `first` after a success. Pure: it counts
//! failures and returns delays; the caller owns the clock.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Backoff {
        Backoff {
            first,
            cap,
            failures: 0,
        }
    }

    /// Records one more failure and returns how long to wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.current()
    }

    /// The delay the last failure asked for (zero before any failure).
    pub fn current(&self) -> Duration {
        if self.failures == 0 {
            return Duration::ZERO;
        }
        let exp = (self.failures - 1).min(30);
        self.first.saturating_mul(1u32 << exp).min(self.cap)
    }

    /// Consecutive failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// After a success: the next failure waits `first` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// A new cap (e.g. a changed re-resolve interval); the failure count is kept.
    pub fn set_cap(&mut self, cap: Duration) {
        self.cap = cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(20));
        assert_eq!(b.current(), Duration::ZERO);
        let delays: Vec<u64> = (0..7).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 20, 20]);
        assert_eq!(b.failures(), 7);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_secs(1));
    }

    #[test]
    fn never_overflows() {
        let mut b = Backoff::new(Duration::from_millis(200), Duration::from_secs(600));
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.current(), Duration::from_secs(600));
    }
}
