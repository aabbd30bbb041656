//! Escalation: when too many credentials of a tenant fail verification
//! within a sliding window, its unknown credentials are verified
//! synchronously until the failure rate falls back. Credentials that claim
//! no tenant (every API key before its introspection) have a window of
//! their own, and so has the gateway as a whole (every outcome, with its
//! own ratio): a spray of forged credentials each claiming a fresh tenant,
//! or none, escalates those.
//!
//! The observer keeps the windows (it sees every verification outcome) and
//! publishes what is escalated in one shared-data key the filters read.

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
/// Version 2: tenants, "no tenant" and the gateway.
const VERSION: u8 = 2;

/// When a tenant is escalated.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
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
    /// Share of all the gateway's verifications failing above which every
    /// unknown credential verifies synchronously (1: never).
    #[serde(default = "default_gateway_ratio")]
    pub gateway_failure_ratio: f64,
}

fn default_gateway_ratio() -> f64 {
    0.5
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
            gateway_failure_ratio: default_gateway_ratio(),
        }
    }
}

/// What escalates: a tenant, the credentials claiming none, or the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    /// A (claimed or verified) tenant.
    Tenant(String),
    /// Credentials without a tenant.
    NoTenant,
    /// Every credential of the gateway.
    Gateway,
}

impl Scope {
    /// The scope of an outcome's tenant (empty: none).
    pub fn of(tenant: Option<&str>) -> Scope {
        match tenant {
            Some(t) if !t.is_empty() => Scope::Tenant(t.to_string()),
            _ => Scope::NoTenant,
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Tenant(t) => write!(f, "tenant {t}"),
            Scope::NoTenant => f.write_str("credentials without a tenant"),
            Scope::Gateway => f.write_str("the gateway"),
        }
    }
}

/// A flip of a scope's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flip {
    /// It now verifies synchronously.
    Escalated(Scope),
    /// It is back to lazy verification.
    Relaxed(Scope),
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

/// Windows of every scope seen recently, and what is escalated.
#[derive(Debug, Clone)]
pub struct Escalation {
    config: EscalationConfig,
    windows: HashMap<Scope, Window>,
    escalated: Vec<Scope>,
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

    /// Records one verification outcome at `now` for `tenant` (`None` or
    /// empty: no tenant) and for the gateway: the flips it caused.
    pub fn record(&mut self, tenant: Option<&str>, failed: bool, now: u64) -> Vec<Flip> {
        let bucket = self.bucket(now);
        let mut flips = Vec::new();
        for scope in [Scope::of(tenant), Scope::Gateway] {
            if !self.windows.contains_key(&scope) && self.windows.len() >= MAX_TRACKED {
                self.evict_oldest();
            }
            let window = self.windows.entry(scope.clone()).or_default();
            window.record(bucket, failed);
            window.last_seen = now;
            flips.extend(self.evaluate(&scope, bucket));
        }
        flips
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

    fn evaluate(&mut self, scope: &Scope, bucket: u64) -> Option<Flip> {
        let (verifications, failures) =
            self.windows.get(scope).map_or((0, 0), |w| w.totals(bucket));
        let ratio = match scope {
            Scope::Gateway => self.config.gateway_failure_ratio,
            _ => self.config.failure_ratio,
        };
        let over = verifications >= self.config.min_verifications
            && (failures as f64) > ratio * verifications as f64;
        let is = self.escalated.contains(scope);
        let room = !matches!(scope, Scope::Tenant(_)) || self.escalated.len() < MAX_ESCALATED;
        match (over, is) {
            (true, false) if room => {
                self.escalated.push(scope.clone());
                Some(Flip::Escalated(scope.clone()))
            }
            (false, true) => {
                self.escalated.retain(|s| s != scope);
                Some(Flip::Relaxed(scope.clone()))
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

    /// Currently escalated scopes.
    pub fn escalated(&self) -> &[Scope] {
        &self.escalated
    }

    /// What the filters read.
    pub fn published(&self) -> EscalatedTenants {
        let mut list = EscalatedTenants::default();
        for scope in &self.escalated {
            match scope {
                Scope::Tenant(t) => list.tenants.push(t.clone()),
                Scope::NoTenant => list.no_tenant = true,
                Scope::Gateway => list.gateway = true,
            }
        }
        list
    }
}

/// The published escalations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscalatedTenants {
    /// Escalated tenants.
    pub tenants: Vec<String>,
    /// Credentials without a tenant are escalated.
    pub no_tenant: bool,
    /// The whole gateway is escalated.
    pub gateway: bool,
}

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

    /// Whether an unknown credential claiming `tenant` (`None` or empty:
    /// none) must verify synchronously.
    pub fn covers(&self, tenant: Option<&str>) -> bool {
        self.gateway
            || match tenant {
                Some(t) if !t.is_empty() => self.tenants.iter().any(|e| e == t),
                _ => self.no_tenant,
            }
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
            gateway_failure_ratio: 1.0,
        }
    }

    fn acme() -> Scope {
        Scope::Tenant("acme".into())
    }

    #[test]
    fn escalates_above_the_ratio_and_relaxes_when_the_window_slides() {
        let mut e = Escalation::new(config());
        // 19 verifications, 10 failures: below the minimum count.
        for i in 0..19 {
            assert_eq!(e.record(Some("acme"), i % 2 == 0, 0), vec![]);
        }
        // The 20th makes the ratio count: 10/20 > 5%.
        assert_eq!(
            e.record(Some("acme"), false, 0),
            vec![Flip::Escalated(acme())]
        );
        assert_eq!(e.escalated(), [acme()]);
        // Other tenants are unaffected.
        assert_eq!(e.record(Some("globex"), true, 0), vec![]);
        // Five minutes later the failures have left the window.
        assert_eq!(e.slide(301), vec![Flip::Relaxed(acme())]);
        assert!(e.escalated().is_empty());
    }

    #[test]
    fn a_low_failure_rate_does_not_escalate() {
        let mut e = Escalation::new(config());
        for i in 0..100 {
            // 1 in 25 fails: 4% < 5%.
            assert_eq!(e.record(Some("acme"), i % 25 == 24, i), vec![]);
        }
    }

    #[test]
    fn credentials_without_a_tenant_and_the_gateway_escalate_too() {
        let mut e = Escalation::new(EscalationConfig {
            gateway_failure_ratio: 0.5,
            ..config()
        });
        // A spray: every forged credential claims a fresh tenant, or none.
        let mut flips = vec![];
        for i in 0..20u64 {
            let tenant = format!("fresh-{i}");
            flips.extend(e.record(Some(&tenant), true, i));
            flips.extend(e.record(None, true, i));
        }
        // No single tenant reaches the minimum; "no tenant" and the gateway do.
        assert_eq!(
            flips,
            vec![
                Flip::Escalated(Scope::Gateway),
                Flip::Escalated(Scope::NoTenant)
            ]
        );
        let published = e.published();
        assert!(published.gateway && published.no_tenant && published.tenants.is_empty());
        // An empty claimed tenant is no tenant.
        assert_eq!(Scope::of(Some("")), Scope::NoTenant);
        let only_none = EscalatedTenants {
            no_tenant: true,
            ..EscalatedTenants::default()
        };
        assert!(only_none.covers(None) && only_none.covers(Some("")));
        assert!(!only_none.covers(Some("acme")));
        assert!(published.covers(Some("acme")));
    }

    #[test]
    fn published_list_round_trips() {
        let list = EscalatedTenants {
            tenants: vec!["a".into(), "b".into()],
            ..EscalatedTenants::default()
        };
        let decoded = EscalatedTenants::decode(Some(&list.encode()));
        assert!(decoded.covers(Some("b")) && !decoded.covers(Some("c")) && !decoded.covers(None));
        assert_eq!(EscalatedTenants::decode(None), EscalatedTenants::default());
        assert_eq!(
            EscalatedTenants::decode(Some(b"zz")),
            EscalatedTenants::default()
        );
    }
}
