//! What each stage may hold in shared data, as numbers: every key a stage
//! writes lives under one prefix per purpose, in a key space its
//! configuration fixes (hash-chosen sets of a few ways), and every value
//! has a largest size. The native store gives each purpose exactly this
//! much (one purpose can never take another's room), and the Wasm forms
//! log the same numbers at load: the memory bound of shared data in both.

use crate::auth::budget::{BUCKET_SLOTS, BUDGET_PREFIX, VERIFY_PREFIX};
use crate::auth::config::LazyAuthConfig;
use crate::auth::exposure::UNVERIFIED_PREFIX;
use crate::auth::verdict::{MAX_VERDICT_BYTES, VERDICT_PREFIX};
use crate::cache::config::PostCacheConfig;
use crate::cache::lease::MAX_LEASES_PER_SET;
use crate::cache::store::{CACHE_PREFIX, Layout, MAX_SLOT_OVERHEAD_BYTES, WAYS};

/// Longest key a stage writes (prefix and a set number), bytes.
const MAX_KEY_BYTES: u64 = 40;

/// The keys of one purpose: at most `keys` keys under `prefix`, holding at
/// most `bytes` of keys and values together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpace {
    /// What the keys are for (a metric label: `verdicts`, `cache`, …).
    pub purpose: &'static str,
    /// Every key of the purpose starts with it.
    pub prefix: &'static str,
    /// Keys at most.
    pub keys: u64,
    /// Bytes of keys and values at most.
    pub bytes: u64,
}

impl KeySpace {
    fn new(purpose: &'static str, prefix: &'static str, keys: u64, value_bytes: u64) -> KeySpace {
        KeySpace {
            purpose,
            prefix,
            keys,
            bytes: keys.saturating_mul(value_bytes + MAX_KEY_BYTES),
        }
    }
}

/// The few single keys every configuration may write besides its key
/// spaces (JWKS, escalation, verifier state, job counters, queue
/// backlogs): their own purpose, `other`.
pub const OTHER: KeySpace = KeySpace {
    purpose: "other",
    prefix: "",
    keys: 256,
    bytes: 8 << 20,
};

impl LazyAuthConfig {
    /// Verdict sets, per-credential counter sets and lazy-admission buckets.
    pub fn key_spaces(&self) -> Vec<KeySpace> {
        let slots = u64::from(self.verdict_slots);
        let ways = u64::from(self.verdict_ways);
        vec![
            KeySpace::new(
                "verdicts",
                VERDICT_PREFIX,
                slots,
                1 + ways * (2 + MAX_VERDICT_BYTES as u64),
            ),
            KeySpace::new(
                "unverified_counts",
                UNVERIFIED_PREFIX,
                slots,
                crate::auth::exposure::max_set_bytes(self.verdict_ways) as u64,
            ),
            KeySpace::new(
                "lazy_budget",
                BUDGET_PREFIX,
                2 * BUCKET_SLOTS + 2,
                crate::auth::budget::BUCKET_BYTES as u64,
            ),
            KeySpace::new(
                "verify_budget",
                VERIFY_PREFIX,
                BUCKET_SLOTS + 1,
                crate::auth::budget::BUCKET_BYTES as u64,
            ),
        ]
    }
}

impl PostCacheConfig {
    /// The cache's sets: an index, two body slots and a lease table each.
    pub fn key_spaces(&self) -> Vec<KeySpace> {
        let sets = u64::from(Layout::new(self.max_entries).sets());
        let slot = u64::from(self.max_entry_bytes) + MAX_SLOT_OVERHEAD_BYTES as u64;
        // An index (`WAYS` records of ~60 bytes) and a lease table
        // (`MAX_LEASES_PER_SET` leases of ~45 bytes) per set.
        let small = 64 * WAYS as u64 + 64 * MAX_LEASES_PER_SET as u64;
        let per_set = (WAYS as u64) * (slot + MAX_KEY_BYTES) + 2 * (small + MAX_KEY_BYTES);
        vec![KeySpace {
            purpose: "cache",
            prefix: CACHE_PREFIX,
            keys: sets * (WAYS as u64 + 2),
            bytes: sets.saturating_mul(per_set),
        }]
    }
}

/// The sum of `spaces` and [`OTHER`]: (keys, bytes).
pub fn total(spaces: &[KeySpace]) -> (u64, u64) {
    spaces
        .iter()
        .chain(std::iter::once(&OTHER))
        .fold((0, 0), |(k, b), s| {
            (k.saturating_add(s.keys), b.saturating_add(s.bytes))
        })
}

/// One line for the log: each purpose's keys and MiB, and the total.
pub fn describe(spaces: &[KeySpace]) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let parts: Vec<String> = spaces
        .iter()
        .map(|s| format!("{} {} keys {:.1} MiB", s.purpose, s.keys, mib(s.bytes)))
        .collect();
    let (keys, bytes) = total(spaces);
    format!(
        "shared data at most {keys} keys, {:.1} MiB ({})",
        mib(bytes),
        parts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_defaults_as_numbers() {
        let auth = LazyAuthConfig::from_json(
            br#"{"credentials":[{"header":"authorization","scheme":"Bearer","kind":"jwt"}]}"#,
        )
        .unwrap();
        let spaces = auth.key_spaces();
        assert_eq!(spaces[0].keys, 65_536);
        assert_eq!(spaces[1].keys, 65_536);
        assert_eq!(spaces[2].keys, 8194);
        let cache = PostCacheConfig::from_json(br#"{"secret_env":"S","namespace":"shared"}"#)
            .unwrap()
            .key_spaces();
        assert_eq!(cache[0].keys, 512 * 4);
        let all: Vec<KeySpace> = spaces.into_iter().chain(cache).collect();
        let line = describe(&all);
        eprintln!("{line}");
        assert!(line.starts_with("shared data at most"), "{line}");
        let (_, bytes) = total(&all);
        // Worst case, every claim at its limit and every entry full.
        assert!(bytes < 600 << 20, "{line}");
    }
}
