//! The filter's counters (batched, flushed on tick). Prometheus, with the
//! `stats_tags` of the shipped Envoy configs:
//! `zerolayer_auth_decisions{outcome=…}`, `zerolayer_auth_sync{reason=…}`,
//! `zerolayer_auth_jobs_enqueued`, `zerolayer_auth_jobs_lost`.

use zerolayer_host::{Counters, Host};

/// Decision outcomes, in counter order.
pub(crate) const OUTCOMES: [&str; 10] = [
    "public",
    "missing",
    "valid_cached",
    "invalid_cached",
    "lazy",
    "sync_valid",
    "sync_invalid",
    "unavailable",
    "unconfigured",
    "too_long",
];

/// Synchronous verification reasons, in counter order.
pub(crate) const SYNC_REASONS: [&str; 6] = [
    "policy",
    "escalated",
    "trusted_client",
    "exposure_bound",
    "pending_bound",
    "lazy_budget",
];

const ENQUEUED: usize = OUTCOMES.len() + SYNC_REASONS.len();
const LOST: usize = ENQUEUED + 1;

pub(crate) struct Metrics(Counters);

impl Metrics {
    pub(crate) fn define(host: &mut impl Host) -> Metrics {
        let mut names: Vec<String> = OUTCOMES
            .iter()
            .map(|o| format!("zerolayer_auth_decisions_outcome={o}"))
            .collect();
        names.extend(
            SYNC_REASONS
                .iter()
                .map(|r| format!("zerolayer_auth_sync_reason={r}")),
        );
        names.push("zerolayer_auth_jobs_enqueued".into());
        names.push("zerolayer_auth_jobs_lost".into());
        Metrics(Counters::define(host, "lazy-auth", &names))
    }

    pub(crate) fn outcome(&self, outcome: &str) {
        if let Some(i) = OUTCOMES.iter().position(|o| *o == outcome) {
            self.0.add(i, 1);
        }
    }

    pub(crate) fn sync(&self, reason: &str) {
        if let Some(i) = SYNC_REASONS.iter().position(|r| *r == reason) {
            self.0.add(OUTCOMES.len() + i, 1);
        }
    }

    pub(crate) fn enqueued(&self) {
        self.0.add(ENQUEUED, 1);
    }

    pub(crate) fn lost(&self) {
        self.0.add(LOST, 1);
    }

    pub(crate) fn lost_n(&self, n: u64) {
        self.0.add(LOST, n);
    }

    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.0.flush(host);
    }
}
