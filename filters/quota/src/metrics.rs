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
//! `zerolayer_quota_max_tokens_injected` and `_max_tokens_not_injected`
//! (`inject_max_tokens`: bodies given the reserved cap, and those that
//! could not be given it), `zerolayer_quota_unbounded_refused` (request
//! bodies whose size could not be bounded: a coding other than gzip and
//! deflate, or one decoding past 16 MiB).

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

/// The counters, and what of the table's counts they already carry.
pub(crate) struct Metrics {
    per_policy: Vec<Counters>,
    store_errors: Counter,
    unreachable: Counter,
    dropped: Counter,
    /// `[injected, not injected]`.
    caps: [Counter; 2],
    unbounded: Counter,
    exported: Vec<PolicyStats>,
    exported_errors: u64,
    exported_unreachable: u64,
    exported_dropped: u64,
    exported_caps: [u64; 2],
    exported_unbounded: u64,
}

impl Metrics {
    pub(crate) fn define(host: &mut impl Host, policies: &[PolicySpec]) -> Metrics {
        let names: Vec<&str> = policies.iter().map(|p| p.name.as_str()).collect();
        Metrics {
            per_policy: PER_POLICY
                .iter()
                .map(|(metric, _)| Counters::labelled(host, WHO, metric, "policy", &names))
                .collect(),
            store_errors: Counter::define(host, WHO, "zerolayer_quota_store_errors"),
            unreachable: Counter::define(host, WHO, "zerolayer_quota_store_unreachable"),
            dropped: Counter::define(host, WHO, "zerolayer_quota_deltas_dropped"),
            caps: [
                Counter::define(host, WHO, "zerolayer_quota_max_tokens_injected"),
                Counter::define(host, WHO, "zerolayer_quota_max_tokens_not_injected"),
            ],
            unbounded: Counter::define(host, WHO, "zerolayer_quota_unbounded_refused"),
            exported: vec![PolicyStats::default(); policies.len()],
            exported_errors: 0,
            exported_unreachable: 0,
            exported_dropped: 0,
            exported_caps: [0; 2],
            exported_unbounded: 0,
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
        let errors = quota.store_errors();
        self.store_errors
            .add(errors.saturating_sub(self.exported_errors));
        self.exported_errors = errors;
        let unreachable = quota.store_unreachable();
        self.unreachable
            .add(unreachable.saturating_sub(self.exported_unreachable));
        self.exported_unreachable = unreachable;
        let (dropped, _) = quota.orphans().dropped();
        self.dropped
            .add(dropped.saturating_sub(self.exported_dropped));
        self.exported_dropped = dropped;
        let caps = quota.caps();
        for ((counter, now), exported) in self.caps.iter().zip(caps).zip(&mut self.exported_caps) {
            counter.add(now.saturating_sub(*exported));
            *exported = now;
        }
        let unbounded = quota.unbounded();
        self.unbounded
            .add(unbounded.saturating_sub(self.exported_unbounded));
        self.exported_unbounded = unbounded;
        for counters in &self.per_policy {
            counters.flush(host);
        }
        self.unbounded.flush(host);
        self.store_errors.flush(host);
        self.unreachable.flush(host);
        self.dropped.flush(host);
        for counter in &self.caps {
            counter.flush(host);
        }
    }
}
