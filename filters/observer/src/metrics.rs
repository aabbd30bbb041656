//! The observer's metrics: counters batched once (in memory and flushed
//! on tick, or natively straight into the module's batch), gauges and a
//! histogram recorded as they change (all off the request path). Names, with the `stats_tags` of the shipped Envoy configs:
//! `zerolayer_observer_jobs{kind}`, `zerolayer_auth_verdicts{outcome}`,
//! `zerolayer_auth_verifications_deferred`, `…_dropped`,
//! `zerolayer_auth_escalations{flip}`, `zerolayer_auth_verifier_breaker{flip}`,
//! `zerolayer_audit_records{outcome}`, `zerolayer_audit_batches_failed`,
//! `zerolayer_auth_jwks_fetches{outcome}`, `zerolayer_cache_fleet_writes{outcome}`,
//! `zerolayer_metering_records{outcome}`, `zerolayer_metering_batches_failed`,
//! `zerolayer_attribution_records{outcome}`, `zerolayer_attribution_batches_failed`;
//! `zerolayer_observer_queue_depth`, `zerolayer_auth_verify_latency_ms`
//! (histograms), `zerolayer_auth_escalated_tenants`,
//! `zerolayer_metering_records_buffered` (gauges).

use zerolayer_host::{Counter, Family, Host, Metric};

use crate::shipper::Sink;

zerolayer_core::labels! {
    /// A job's kind, as drained.
    pub(crate) enum JobKind {
        /// A credential to verify.
        Verify => "verify",
        /// Audit records.
        Audit => "audit",
        /// Bytes that decode to no job.
        Unreadable => "unreadable",
        /// A cache entry for the fleet tier.
        CacheWrite => "cache_write",
        /// A usage record.
        Usage => "usage",
    }
}

zerolayer_core::labels! {
    /// A verdict the observer wrote.
    pub(crate) enum VerdictOutcome {
        /// The credential is valid.
        Valid => "valid",
        /// It is not.
        Invalid => "invalid",
    }
}

zerolayer_core::labels! {
    /// A change of a tenant's escalation.
    pub(crate) enum EscalationFlip {
        /// Its unknown credentials now verify synchronously.
        Escalated => "escalated",
        /// Back to lazy verification.
        Relaxed => "relaxed",
    }
}

zerolayer_core::labels! {
    /// A change of the verifier breaker.
    pub(crate) enum BreakerFlip {
        /// No calls for a while.
        Opened => "opened",
        /// The verifier answers again.
        Closed => "closed",
    }
}

zerolayer_core::labels! {
    /// What became of a record meant for a sink.
    pub(crate) enum RecordOutcome {
        /// In a batch the sink took.
        Shipped => "shipped",
        /// Past the buffer, or no sink configured.
        Dropped => "dropped",
    }
}

zerolayer_core::labels! {
    /// A JWKS fetch's end.
    pub(crate) enum FetchOutcome {
        /// Keys fetched.
        Ok => "ok",
        /// No keys (no answer, an error status, an unreadable document).
        Failed => "failed",
    }
}

zerolayer_core::labels! {
    /// A fleet-tier write's end.
    pub(crate) enum WriteOutcome {
        /// webdis took it.
        Ok => "ok",
        /// Refused or failed.
        Failed => "failed",
        /// Past the writes in flight, or no fleet tier configured.
        Dropped => "dropped",
    }
}

/// One sink's counters.
pub(crate) struct SinkMetrics {
    /// Records shipped or dropped.
    pub records: Family<RecordOutcome>,
    /// Batches that failed (each retried within the buffer bound).
    pub failed_batches: Counter,
}

impl SinkMetrics {
    fn define(host: &mut impl Host, who: &str, prefix: &str) -> SinkMetrics {
        SinkMetrics {
            records: Family::define(host, who, &format!("{prefix}_records"), "outcome"),
            failed_batches: Counter::define(host, who, &format!("{prefix}_batches_failed")),
        }
    }

    fn flush(&self, host: &mut impl Host) {
        self.records.flush(host);
        self.failed_batches.flush(host);
    }
}

/// The observer's metrics.
pub(crate) struct ObserverMetrics {
    /// Jobs drained, by kind.
    pub(crate) jobs: Family<JobKind>,
    /// Verdicts written.
    pub(crate) verdicts: Family<VerdictOutcome>,
    /// Jobs waiting for keys.
    pub(crate) deferred: Counter,
    /// Jobs that could not be verified (no verdict written).
    pub(crate) verify_dropped: Counter,
    /// Escalation changes.
    pub(crate) escalations: Family<EscalationFlip>,
    /// Verifier breaker changes.
    pub(crate) breaker: Family<BreakerFlip>,
    /// JWKS fetches.
    pub(crate) jwks: Family<FetchOutcome>,
    /// Fleet-tier writes.
    pub(crate) fleet_writes: Family<WriteOutcome>,
    /// The audit sink's records and batches.
    pub(crate) audit: SinkMetrics,
    /// The usage sink's records and batches.
    pub(crate) usage: SinkMetrics,
    /// The attribution sink's records and batches.
    pub(crate) attribution: SinkMetrics,
    /// Queue depth at each wake-up (jobs drained, up to the budget): a
    /// histogram, since a gauge would stick at the last wake-up's value.
    pub(crate) queue_depth: Metric,
    /// Tenants escalated right now.
    escalated: Metric,
    /// From a request's admission to its verdict, ms.
    verify_latency_ms: Metric,
    /// Usage records waiting for the sink.
    pub(crate) usage_buffered: Metric,
}

impl ObserverMetrics {
    /// Defines them with the host (`who` names the observer in log lines).
    pub(crate) fn define(host: &mut impl Host, who: &str) -> Self {
        ObserverMetrics {
            jobs: Family::define(host, who, "zerolayer_observer_jobs", "kind"),
            verdicts: Family::define(host, who, "zerolayer_auth_verdicts", "outcome"),
            deferred: Counter::define(host, who, "zerolayer_auth_verifications_deferred"),
            verify_dropped: Counter::define(host, who, "zerolayer_auth_verifications_dropped"),
            escalations: Family::define(host, who, "zerolayer_auth_escalations", "flip"),
            breaker: Family::define(host, who, "zerolayer_auth_verifier_breaker", "flip"),
            jwks: Family::define(host, who, "zerolayer_auth_jwks_fetches", "outcome"),
            fleet_writes: Family::define(host, who, "zerolayer_cache_fleet_writes", "outcome"),
            audit: SinkMetrics::define(host, who, "zerolayer_audit"),
            usage: SinkMetrics::define(host, who, "zerolayer_metering"),
            attribution: SinkMetrics::define(host, who, "zerolayer_attribution"),
            queue_depth: Metric::histogram(host, "zerolayer_observer_queue_depth"),
            escalated: Metric::gauge(host, "zerolayer_auth_escalated_tenants"),
            verify_latency_ms: Metric::histogram(host, "zerolayer_auth_verify_latency_ms"),
            usage_buffered: Metric::gauge(host, "zerolayer_metering_records_buffered"),
        }
    }

    /// `sink`'s counters.
    pub(crate) fn sink(&self, sink: Sink) -> &SinkMetrics {
        match sink {
            Sink::Audit => &self.audit,
            Sink::Usage => &self.usage,
            Sink::Attribution => &self.attribution,
        }
    }

    /// Records how long a credential waited for its verdict.
    pub(crate) fn verify_latency(&self, host: &mut impl Host, ms: u64) {
        self.verify_latency_ms.record(host, ms);
    }

    /// Records how many tenants are escalated.
    pub(crate) fn escalated(&self, host: &mut impl Host, n: usize) {
        self.escalated.record(host, n as u64);
    }

    /// Reports pending counter increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.jobs.flush(host);
        self.verdicts.flush(host);
        self.deferred.flush(host);
        self.verify_dropped.flush(host);
        self.escalations.flush(host);
        self.breaker.flush(host);
        self.jwks.flush(host);
        self.fleet_writes.flush(host);
        self.audit.flush(host);
        self.usage.flush(host);
        self.attribution.flush(host);
    }
}
