//! The filter's counters (batched, flushed on tick). Prometheus, with the
//! `stats_tags` of the shipped Envoy configs:
//! `zerolayer_auth_decisions{outcome=…}`, `zerolayer_auth_sync{reason=…}`,
//! `zerolayer_auth_jobs_enqueued`, `zerolayer_auth_jobs_lost`.

use zerolayer_core::auth::policy::SyncReason;
use zerolayer_host::{Counter, Family, Host};

zerolayer_core::labels! {
    /// What lazy-auth decided for a request: the `outcome` label, and the
    /// audit record's `decision`.
    pub(crate) enum Outcome {
        /// A public path: no credential needed.
        Public => "public",
        /// No credential: refused.
        Missing => "missing",
        /// A cached valid verdict.
        ValidCached => "valid_cached",
        /// A cached invalid verdict: refused.
        InvalidCached => "invalid_cached",
        /// Admitted unverified, within the exposure bounds.
        Lazy => "lazy",
        /// Verified on the request path: valid.
        SyncValid => "sync_valid",
        /// Verified on the request path: invalid, refused.
        SyncInvalid => "sync_invalid",
        /// Could not be verified now: 503.
        Unavailable => "unavailable",
        /// Past the synchronous-verification budget (`verify_budget`):
        /// 429, the verifier not called.
        OverBudget => "over_verify_budget",
        /// The verifier asked to slow down (a 429 and its `retry-after`):
        /// 503 until then, the verifier not called.
        Throttled => "verifier_throttled",
        /// A credential longer than `max_credential_bytes`: refused.
        TooLong => "too_long",
    }
}

/// The counters.
pub(crate) struct Metrics {
    decisions: Family<Outcome>,
    sync: Family<SyncReason>,
    enqueued: Counter,
    lost: Counter,
}

impl Metrics {
    pub(crate) fn define(host: &mut impl Host) -> Metrics {
        const WHO: &str = "lazy-auth";
        Metrics {
            decisions: Family::define(host, WHO, "zerolayer_auth_decisions", "outcome"),
            sync: Family::define(host, WHO, "zerolayer_auth_sync", "reason"),
            enqueued: Counter::define(host, WHO, "zerolayer_auth_jobs_enqueued"),
            lost: Counter::define(host, WHO, "zerolayer_auth_jobs_lost"),
        }
    }

    /// A request's decision.
    pub(crate) fn outcome(&self, outcome: Outcome) {
        self.decisions.add(outcome);
    }

    /// Why it was verified on the request path.
    pub(crate) fn sync(&self, reason: SyncReason) {
        self.sync.add(reason);
    }

    /// A verification job queued for the observer.
    pub(crate) fn enqueued(&self) {
        self.enqueued.add(1);
    }

    /// A job the observer's queue refused.
    pub(crate) fn lost(&self) {
        self.lost.add(1);
    }

    /// `n` jobs the observer's queue refused (an audit batch).
    pub(crate) fn lost_n(&self, n: u64) {
        self.lost.add(n);
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.decisions.flush(host);
        self.sync.flush(host);
        self.enqueued.flush(host);
        self.lost.flush(host);
    }
}
