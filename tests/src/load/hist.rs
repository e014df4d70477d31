//! A load's latency histogram: log-linear buckets of microseconds (64 per power of
//! two, so a bucket is at most 1/64 of its lower bound wide), counted with atomics so
//! every caller records into one histogram without a lock. Memory is fixed whatever the
//! number of calls, which a million-call or a day-long run needs.
//!
//! Pure apart from the atomics: no clock, no I/O. Percentiles are read from a
//! [`Snapshot`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Sub-buckets per power of two, as a shift.
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Values from 2^MAX_EXP µs (about 12.7 days) up share the last bucket.
const MAX_EXP: u32 = 40;
/// Number of buckets: the 128 values below 2 * SUB one each, then SUB per power of two.
pub const BUCKETS: usize = (MAX_EXP - SUB_BITS + 2) as usize * SUB as usize;

/// The bucket of `us` microseconds.
pub fn bucket(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    let exp = 63 - us.leading_zeros();
    if exp > MAX_EXP {
        return BUCKETS - 1;
    }
    let shift = exp - SUB_BITS;
    let sub = (us >> shift) - SUB;
    ((exp - SUB_BITS + 1) as u64 * SUB + sub) as usize
}

/// The values bucket `i` holds: `lo..hi` microseconds.
pub fn bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < 2 * SUB {
        return (i, i + 1);
    }
    let shift = (i / SUB - 1) as u32;
    let lo = (SUB + i % SUB) << shift;
    (lo, lo + (1 << shift))
}

/// A histogram every caller records into.
#[derive(Debug)]
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_us: AtomicU64,
    max_us: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
            max_us: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.buckets[bucket(us)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.max_us.fetch_max(us, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum_us: self.sum_us.load(Ordering::Relaxed),
            max_us: self.max_us.load(Ordering::Relaxed),
        }
    }
}

/// The histogram's figures at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum_us: u64,
    pub max_us: u64,
}

impl Snapshot {
    /// The value (µs) at quantile `q` (0..=1): the upper end of the bucket holding the
    /// `ceil(q * count)`-th smallest value, never above the largest value seen. 0 when
    /// empty.
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return (bounds(i).1 - 1).min(self.max_us);
            }
        }
        self.max_us
    }

    pub fn mean_us(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_us as f64 / self.count as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_lands_in_a_bucket_that_holds_it() {
        let mut v = 0u64;
        while v < 1 << 42 {
            let i = bucket(v);
            assert!(i < BUCKETS, "{v} -> {i}");
            let (lo, hi) = bounds(i);
            if i < BUCKETS - 1 {
                assert!(lo <= v && v < hi, "{v} not in bucket {i} = {lo}..{hi}");
                // At most 1/64 of the value wide.
                assert!((hi - lo) * SUB <= lo.max(SUB), "bucket {i} too wide");
            }
            v = v * 17 / 16 + 1;
        }
    }

    #[test]
    fn buckets_are_contiguous_and_ordered() {
        for i in 0..BUCKETS - 1 {
            assert_eq!(bounds(i).1, bounds(i + 1).0, "gap after bucket {i}");
            assert_eq!(bucket(bounds(i).0), i);
            assert_eq!(bucket(bounds(i).1 - 1), i);
        }
    }

    #[test]
    fn quantiles_of_1_to_1000_ms_are_within_two_percent() {
        let h = Histogram::default();
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 1000);
        assert_eq!(s.max_us, 1_000_000);
        for (q, want) in [(0.5, 500_000u64), (0.9, 900_000), (0.99, 990_000)] {
            let got = s.quantile_us(q);
            assert!(
                got >= want && got <= want + want / 50,
                "q{q}: {got} vs {want}"
            );
        }
        assert_eq!(s.quantile_us(1.0), 1_000_000);
        assert!((s.mean_us() - 500_500.0).abs() < 1.0);
    }

    #[test]
    fn a_quantile_is_never_above_the_max_and_empty_is_zero() {
        assert_eq!(Snapshot::default().quantile_us(0.99), 0);
        let h = Histogram::default();
        h.record(Duration::from_micros(1_000_001));
        let s = h.snapshot();
        assert_eq!(s.quantile_us(0.5), 1_000_001);
        assert_eq!(s.quantile_us(0.0), 1_000_001);
    }

    #[test]
    fn a_huge_value_goes_to_the_last_bucket() {
        let h = Histogram::default();
        h.record(Duration::from_secs(60 * 60 * 24 * 365));
        assert_eq!(h.snapshot().counts[BUCKETS - 1], 1);
    }
}
