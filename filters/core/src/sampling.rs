//! Consistent request sampling: every gateway hashes the request id the same
//! way, so a 1% canary or a 1% metering sample picks the same requests
//! everywhere.

use xxhash_rust::xxh3::xxh3_64;

/// Number of buckets a request id falls into; rates are in basis points of it.
pub const BUCKETS: u16 = 10_000;

/// The bucket (`0..10000`) of a request id: `xxh3_64(id) mod 10000`.
pub fn bucket(request_id: &[u8]) -> u16 {
    // 2^64 mod 10000 is tiny relative to 2^64: the modulo bias is ~1e-15.
    (xxh3_64(request_id) % u64::from(BUCKETS)) as u16
}

/// A sampling rate in basis points (`0..=10000`, 1 bp = 0.01%).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rate(u16);

impl Rate {
    /// Every request.
    pub const ALL: Rate = Rate(BUCKETS);
    /// No request.
    pub const NONE: Rate = Rate(0);

    /// A rate from a percentage with at most two decimals (`12.5` → 1250 bp).
    /// Returns `None` when the value is outside `0..=100` or finer than 0.01.
    pub fn from_percent(percent: f64) -> Option<Rate> {
        if !percent.is_finite() || !(0.0..=100.0).contains(&percent) {
            return None;
        }
        let bp = (percent * 100.0).round();
        if (bp - percent * 100.0).abs() > 1e-6 {
            return None;
        }
        Some(Rate(bp as u16))
    }

    /// The rate in basis points.
    pub fn basis_points(self) -> u16 {
        self.0
    }

    /// Whether the request with this id falls inside the sample.
    pub fn includes(self, request_id: &[u8]) -> bool {
        bucket(request_id) < self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_parsing() {
        assert_eq!(Rate::from_percent(12.5).map(Rate::basis_points), Some(1250));
        assert_eq!(Rate::from_percent(0.01).map(Rate::basis_points), Some(1));
        assert_eq!(Rate::from_percent(100.0), Some(Rate::ALL));
        assert_eq!(Rate::from_percent(0.0), Some(Rate::NONE));
        assert_eq!(Rate::from_percent(0.001), None);
        assert_eq!(Rate::from_percent(-1.0), None);
        assert_eq!(Rate::from_percent(100.5), None);
        assert_eq!(Rate::from_percent(f64::NAN), None);
    }

    #[test]
    fn bucket_is_stable_across_builds() {
        // Pinned values: every gateway (and every version of this code) must
        // put a request id in the same bucket, or samples stop agreeing.
        assert_eq!(bucket(b""), (xxh3_64(b"") % 10_000) as u16);
        assert_eq!(bucket(b"req-1"), bucket(b"req-1"));
        assert_eq!(bucket(b"0d9d1e52-5bd2-4f3c-9d1b-2f0d7b6f1c11"), 5_704);
    }

    #[test]
    fn buckets_are_uniform() {
        // 200k ids shaped like real ones, in 100 bins of 100 buckets:
        // Pearson's chi-square with 99 degrees of freedom stays under 148.2
        // (p = 0.001) for a uniform hash.
        const IDS: usize = 200_000;
        let mut bins = [0u32; 100];
        for i in 0..IDS {
            let id = format!("0d9d1e52-5bd2-4f3c-9d1b-{i:012x}");
            bins[usize::from(bucket(id.as_bytes()) / 100)] += 1;
        }
        let expected = IDS as f64 / 100.0;
        let chi2: f64 = bins
            .iter()
            .map(|&n| (f64::from(n) - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 148.2, "chi-square {chi2:.1} over 100 bins");
        // And a 1% rate takes 1% of them, within 4 standard errors.
        let rate = Rate::from_percent(1.0).unwrap();
        let taken = (0..IDS)
            .filter(|i| rate.includes(format!("req-{i}").as_bytes()))
            .count() as f64;
        let sd = (IDS as f64 * 0.01 * 0.99).sqrt();
        assert!(
            (taken - IDS as f64 * 0.01).abs() < 4.0 * sd,
            "{taken} of {IDS}"
        );
    }

    #[test]
    fn rate_bounds() {
        assert!(Rate::ALL.includes(b"anything"));
        assert!(!Rate::NONE.includes(b"anything"));
    }
}
