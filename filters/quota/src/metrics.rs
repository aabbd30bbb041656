//! The stage's counters, per policy (`policy` label, the policy's name;
//! `unverified` for the unverified budget), exported on tick from the lease
//! table's own counts: the request path adds nothing for metrics.
//!
//! `zerolayer_quota_admitted`, `_refused`, `_shadow_refused` (requests),
//! `_reserved`, `_settled`, `_refunded`, `_overshoot` (in the policy's
//! unit; overshoot: settled above the reservation), `_refills` (grants
//! asked), `_cuts` (streams ended), and without a label
//! `zerolayer_quota_store_errors` (answers that were errors),
//! `zerolayer_quota_store_unreachable` (calls that found no store: no
//! answer in time, webdis failing), `zerolayer_quota_deltas_dropped`,
//! `zerolayer_quota_returns_not_sent` (amounts a lease gave back, not sent
//! for a full delta buffer: their counters count them, over, never under),
//! `zerolayer_quota_max_tokens_injected` and `_max_tokens_not_injected`
//! (`inject_max_tokens`: bodies given the reserved cap, and those that
//! could not be given it), `zerolayer_quota_unbounded_refused` (request
//! bodies whose size could not be bounded: a coding other than gzip and
//! deflate, or one decoding past 16 MiB), `zerolayer_quota_late_verified`
//! and `_late_unverified` (requests admitted before verification, charged
//! to the tenant verification found too, or left to `unverified` alone),
//! `_late_expired` (of those, left because their verdict did not come in
//! time), `_late_handed_off` (of those, stored in the store's hand-off hash
//! for `host-sim quota-reconcile`) and `_late_lost` (not stored: a queue
//! or the store's hash full).

use zerolayer_core::quota::GatewayQuota;
use zerolayer_core::quota::gateway::{PolicySpec, PolicyStats};
use zerolayer_host::{Counter, Counters, Host};

const WHO: &str = "quota";

/// How one of a policy's counts is read from its stats.
type Read = fn(&PolicyStats) -> u64;

/// Each per-policy count: its metric name and how it is read.
const PER_POLICY: [(&str, Read); 9] = [
    ("zerolayer_quota_admitted", |s| s.admitted),
    ("zerolayer_quota_refused", |s| s.refused),
    ("zerolayer_quota_shadow_refused", |s| s.shadow_refused),
    ("zerolayer_quota_reserved", |s| s.reserved),
    ("zerolayer_quota_settled", |s| s.settled),
    ("zerolayer_quota_refunded", |s| s.refunded),
    ("zerolayer_quota_overshoot", |s| s.overshoot),
    ("zerolayer_quota_refills", |s| s.refills),
    ("zerolayer_quota_cuts", |s| s.cuts),
];

/// How a count without a label is read from the table.
type ReadTotal = fn(&GatewayQuota) -> u64;

/// Each count without a label: its metric name and how it is read.
const TOTALS: [(&str, ReadTotal); 12] = [
    ("zerolayer_quota_store_errors", GatewayQuota::store_errors),
    (
        "zerolayer_quota_store_unreachable",
        GatewayQuota::store_unreachable,
    ),
    ("zerolayer_quota_deltas_dropped", |q| {
        q.orphans().dropped().0
    }),
    ("zerolayer_quota_returns_not_sent", |q| {
        q.orphans().returns_not_sent()
    }),
    ("zerolayer_quota_max_tokens_injected", |q| q.caps()[0]),
    ("zerolayer_quota_max_tokens_not_injected", |q| q.caps()[1]),
    ("zerolayer_quota_unbounded_refused", GatewayQuota::unbounded),
    ("zerolayer_quota_late_verified", |q| {
        q.late().counts().verified
    }),
    ("zerolayer_quota_late_unverified", |q| {
        q.late().counts().unverified
    }),
    ("zerolayer_quota_late_expired", |q| {
        q.late().counts().expired
    }),
    ("zerolayer_quota_late_handed_off", |q| {
        q.late().counts().handed_off
    }),
    ("zerolayer_quota_late_lost", |q| q.late().counts().lost),
];

/// The counters, and what of the table's counts they already carry.
pub(crate) struct Metrics {
    per_policy: Vec<Counters>,
    exported: Vec<PolicyStats>,
    /// Each of [`TOTALS`]: its counter and the count it already carries.
    totals: Vec<(Counter, u64)>,
}

impl Metrics {
    pub(crate) fn define(host: &mut impl Host, policies: &[PolicySpec]) -> Metrics {
        let names: Vec<&str> = policies.iter().map(|p| p.name.as_str()).collect();
        Metrics {
            per_policy: PER_POLICY
                .iter()
                .map(|(metric, _)| Counters::labelled(host, WHO, metric, "policy", &names))
                .collect(),
            exported: vec![PolicyStats::default(); policies.len()],
            totals: TOTALS
                .iter()
                .map(|(metric, _)| (Counter::define(host, WHO, metric), 0))
                .collect(),
        }
    }

    /// Adds what the table counted since the last export, and reports it.
    pub(crate) fn export(&mut self, host: &mut impl Host, quota: &GatewayQuota) {
        for (index, exported) in self.exported.iter_mut().enumerate() {
            let now = quota.stats(index);
            for ((_, read), counters) in PER_POLICY.iter().zip(&self.per_policy) {
                let delta = read(&now).saturating_sub(read(exported));
                if delta > 0 {
                    counters.add(index, delta);
                }
            }
            *exported = now;
        }
        for ((_, read), (counter, exported)) in TOTALS.iter().zip(&mut self.totals) {
            let now = read(quota);
            counter.add(now.saturating_sub(*exported));
            *exported = now;
        }
        for counters in &self.per_policy {
            counters.flush(host);
        }
        for (counter, _) in &self.totals {
            counter.flush(host);
        }
    }
}
