//! Per-tenant escalation: when too many of a tenant's credentials fail
//! verification within a sliding window, its requests are verified
//! synchronously until the failure rate falls back.
//!
//! The observer keeps the windows (it sees every verification outcome) and
//! publishes the escalated tenants in one shared-data key the filters read.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Shared-data key holding the escalated tenants.
pub const ESCALATED_KEY: &str = "zl:auth:escalated";
/// Most tenants escalated at once (the published list stays small).
pub const MAX_ESCALATED: usize = 1024;
/// Most tenants with a live window (least recently seen ones are dropped).
pub const MAX_TRACKED: usize = 10_000;
/// Buckets per window.
const BUCKETS: u64 = 10;
const VERSION: u8 = 1;

/// When a tenant is escalated.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalationConfig {
    /// Share of failed verifications above which a tenant escalates.
    #[serde(default = "default_ratio")]
    pub failure_ratio: f64,
    /// Window length, seconds.
    #[serde(default = "default_window")]
    pub window_secs: u64,
    /// Verifications a window needs before the ratio counts.
    #[serde(default = "default_min")]
    pub min_verifications: u64,
}

fn default_ratio() -> f64 {
    0.05
}

fn default_window() -> u64 {
    300
}

fn default_min() -> u64 {
    20
}

impl Default for EscalationConfig {
    fn default() -> Self {
        EscalationConfig {
            failure_ratio: default_ratio(),
            window_secs: default_window(),
            min_verifications: default_min(),
        }
    }
}

/// A flip of a tenant's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flip {
    /// The tenant now verifies synchronously.
    Escalated(String),
    /// The tenant is back to lazy verification.
    Relaxed(String),
}

#[derive(Debug, Clone, Default)]
struct Window {
    /// (bucket index, verifications, failures)
    buckets: Vec<(u64, u64, u64)>,
    last_seen: u64,
}

impl Window {
    fn totals(&self, now_bucket: u64) -> (u64, u64) {
        self.buckets
            .iter()
            .filter(|(b, _, _)| b + BUCKETS > now_bucket)
            .fold((0, 0), |(v, f), (_, bv, bf)| (v + bv, f + bf))
    }

    fn record(&mut self, bucket: u64, failed: bool) {
        self.buckets.retain(|(b, _, _)| b + BUCKETS > bucket);
        match self.buckets.iter_mut().find(|(b, _, _)| *b == bucket) {
            Some(entry) => {
                entry.1 += 1;
                entry.2 += u64::from(failed);
            }
            None => self.buckets.push((bucket, 1, u64::from(failed))),
        }
    }
}

/// Windows of every tenant seen recently, and who is escalated.
#[derive(Debug, Clone)]
pub struct Escalation {
    config: EscalationConfig,
    windows: HashMap<String, Window>,
    escalated: Vec<String>,
}

impl Escalation {
    /// No tenant escalated.
    pub fn new(config: EscalationConfig) -> Self {
        Escalation {
            config,
            windows: HashMap::new(),
            escalated: Vec::new(),
        }
    }

    fn bucket(&self, now: u64) -> u64 {
        now / (self.config.window_secs / BUCKETS).max(1)
    }

    /// Records one verification outcome for `tenant` at `now`.
    pub fn record(&mut self, tenant: &str, failed: bool, now: u64) -> Option<Flip> {
        let bucket = self.bucket(now);
        if !self.windows.contains_key(tenant) && self.windows.len() >= MAX_TRACKED {
            self.evict_oldest();
        }
        let window = self.windows.entry(tenant.to_string()).or_default();
        window.record(bucket, failed);
        window.last_seen = now;
        self.evaluate(tenant, bucket)
    }

    /// Re-evaluates every tenant at `now` (windows slide even without
    /// traffic): the flips that happened.
    pub fn slide(&mut self, now: u64) -> Vec<Flip> {
        let bucket = self.bucket(now);
        let escalated = self.escalated.clone();
        escalated
            .iter()
            .filter_map(|t| self.evaluate(t, bucket))
            .collect()
    }

    fn evaluate(&mut self, tenant: &str, bucket: u64) -> Option<Flip> {
        let (verifications, failures) = self
            .windows
            .get(tenant)
            .map_or((0, 0), |w| w.totals(bucket));
        let over = verifications >= self.config.min_verifications
            && (failures as f64) > self.config.failure_ratio * verifications as f64;
        let is = self.escalated.iter().any(|t| t == tenant);
        match (over, is) {
            (true, false) if self.escalated.len() < MAX_ESCALATED => {
                self.escalated.push(tenant.to_string());
                Some(Flip::Escalated(tenant.to_string()))
            }
            (false, true) => {
                self.escalated.retain(|t| t != tenant);
                Some(Flip::Relaxed(tenant.to_string()))
            }
            _ => None,
        }
    }

    fn evict_oldest(&mut self) {
        if let Some(oldest) = self
            .windows
            .iter()
            .filter(|(t, _)| !self.escalated.contains(t))
            .min_by_key(|(_, w)| w.last_seen)
            .map(|(t, _)| t.clone())
        {
            self.windows.remove(&oldest);
        }
    }

    /// Currently escalated tenants.
    pub fn escalated(&self) -> &[String] {
        &self.escalated
    }
}

/// The published list of escalated tenants.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscalatedTenants(pub Vec<String>);

impl EscalatedTenants {
    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        if let Ok(body) = postcard::to_allocvec(self) {
            out.extend(body);
        }
        out
    }

    /// Parses the shared-data entry (nothing readable: nobody escalated).
    pub fn decode(bytes: Option<&[u8]>) -> EscalatedTenants {
        match bytes.and_then(|b| b.split_first()) {
            Some((&VERSION, body)) => postcard::from_bytes(body).unwrap_or_default(),
            _ => EscalatedTenants::default(),
        }
    }

    /// Whether `tenant` is escalated.
    pub fn contains(&self, tenant: &str) -> bool {
        self.0.iter().any(|t| t == tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> EscalationConfig {
        EscalationConfig {
            failure_ratio: 0.05,
            window_secs: 300,
            min_verifications: 20,
        }
    }

    #[test]
    fn escalates_above_the_ratio_and_relaxes_when_the_window_slides() {
        let mut e = Escalation::new(config());
        // 19 verifications, 10 failures: below the minimum count.
        for i in 0..19 {
            assert_eq!(e.record("acme", i % 2 == 0, 0), None);
        }
        // The 20th makes the ratio count: 10/20 > 5%.
        assert_eq!(
            e.record("acme", false, 0),
            Some(Flip::Escalated("acme".into()))
        );
        assert_eq!(e.escalated(), ["acme"]);
        // Other tenants are unaffected.
        assert_eq!(e.record("globex", true, 0), None);
        // Five minutes later the failures have left the window.
        assert_eq!(e.slide(301), vec![Flip::Relaxed("acme".into())]);
        assert!(e.escalated().is_empty());
    }

    #[test]
    fn a_low_failure_rate_does_not_escalate() {
        let mut e = Escalation::new(config());
        for i in 0..100 {
            // 1 in 25 fails: 4% < 5%.
            assert_eq!(e.record("acme", i % 25 == 24, i), None);
        }
    }

    #[test]
    fn published_list_round_trips() {
        let list = EscalatedTenants(vec!["a".into(), "b".into()]);
        let decoded = EscalatedTenants::decode(Some(&list.encode()));
        assert!(decoded.contains("b") && !decoded.contains("c"));
        assert_eq!(EscalatedTenants::decode(None), EscalatedTenants::default());
        assert_eq!(
            EscalatedTenants::decode(Some(b"zz")),
            EscalatedTenants::default()
        );
    }
}
