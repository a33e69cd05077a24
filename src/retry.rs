//! Exponential backoff with jitter between reconnect attempts.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
    pub attempts: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(10));
        Backoff {
            min,
            max: max.max(min),
            next: min,
            attempts: 0,
        }
    }

    /// The delay before the next attempt: doubles each time up to `max`, with the lower half
    /// randomised so that many workers do not reconnect in step; never below `min`.
    pub fn next_delay(&mut self) -> Duration {
        self.attempts += 1;
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let fraction = 0.5 + f64::from(nanos % 1000) / 2000.0;
        base.mul_f64(fraction).max(self.min)
    }

    /// After a run that went well for a while, start again from `min`.
    pub fn reset(&mut self) {
        self.next = self.min;
        self.attempts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_max_with_jitter() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        let bases = [1, 2, 4, 8, 8, 8];
        for (d, base) in delays.iter().zip(bases) {
            let base = Duration::from_secs(base);
            assert!(
                *d >= (base / 2).max(Duration::from_secs(1)) && *d <= base,
                "{d:?} vs {base:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_secs(1));
    }
}
