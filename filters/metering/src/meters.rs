//! The filter's metrics. Per (tenant, model) series, defined on first use
//! within the label bounds: `zerolayer_metering_requests{tenant,model}` and
//! `zerolayer_metering_tokens{tenant,model,kind=input|output|cache_read|cache_creation}`.
//! Fixed counters: `zerolayer_metering_usage{result=found|missing}`,
//! `zerolayer_metering_records{outcome=queued|lost}` (lost: the observer's
//! queue refused it), `zerolayer_metering_include_usage_injected`,
//! `zerolayer_metering_encoded_responses{result=decoded|unreadable}` (a
//! backend compressed although asked for `identity`).
//! Every count is batched once: in Wasm memory, reported from the root's
//! tick, or natively in the module's own batch (see `zerolayer_host::Counters`).

use std::cell::RefCell;

use zerolayer_core::metering::{LabelLimits, SeriesTable, UsageRecord};
use zerolayer_core::metrics::MetricName;
use zerolayer_core::usage::SkipReason;
use zerolayer_host::{Counter, Counters, Family, Host};

/// Token kinds, in series order (after the request count).
const KINDS: [&str; 4] = ["input", "output", "cache_read", "cache_creation"];
/// Values per series: requests, then one per token kind.
const PER_SERIES: usize = 1 + KINDS.len();

zerolayer_core::labels! {
    /// Whether a response carried its usage.
    enum UsageResult {
        /// Read from the body or stream.
        Found => "found",
        /// Not in it (or unreadable): the record says `usage_missing`.
        Missing => "missing",
    }
}

zerolayer_core::labels! {
    /// What became of a full record meant for the sink.
    enum RecordOutcome {
        /// On the observer's queue.
        Queued => "queued",
        /// The queue refused it.
        Lost => "lost",
    }
}

zerolayer_core::labels! {
    /// A compressed response's usage.
    enum Decoding {
        /// Decoded and read.
        Decoded => "decoded",
        /// A coding or bytes the decoder cannot read.
        Unreadable => "unreadable",
    }
}

pub(crate) struct Meters {
    usage: Family<UsageResult>,
    records: Family<RecordOutcome>,
    injected: Counter,
    skipped: Family<SkipReason>,
    encoded: Family<Decoding>,
    table: RefCell<SeriesTable>,
    /// By series index: requests, then one counter per token kind.
    series: RefCell<Vec<Counters>>,
}

impl Meters {
    pub(crate) fn define(host: &mut impl Host, limits: LabelLimits) -> Meters {
        const WHO: &str = "metering";
        Meters {
            usage: Family::define(host, WHO, "zerolayer_metering_usage", "result"),
            records: Family::define(host, WHO, "zerolayer_metering_records", "outcome"),
            injected: Counter::define(host, WHO, "zerolayer_metering_include_usage_injected"),
            skipped: Family::define(
                host,
                WHO,
                "zerolayer_metering_include_usage_skipped",
                "reason",
            ),
            encoded: Family::define(host, WHO, "zerolayer_metering_encoded_responses", "result"),
            table: RefCell::new(SeriesTable::new(limits)),
            series: RefCell::new(Vec::new()),
        }
    }

    /// Counts one request's usage under its tenant and model.
    pub(crate) fn count(&self, host: &mut impl Host, record: &UsageRecord) {
        self.usage.add(if record.usage_missing {
            UsageResult::Missing
        } else {
            UsageResult::Found
        });
        let Ok(mut table) = self.table.try_borrow_mut() else {
            return;
        };
        let Ok(mut series) = self.series.try_borrow_mut() else {
            return;
        };
        let found = table.series(&record.tenant, &record.model);
        if found.new {
            let (tenant, model) = table.labels(found.index).unwrap_or(("other", "other"));
            series.push(define_series(host, tenant, model));
        }
        if let Some(s) = series.get(found.index) {
            let values = [
                1,
                record.input_tokens,
                record.output_tokens,
                record.cache_read_tokens,
                record.cache_creation_tokens,
            ];
            for (index, value) in values.into_iter().enumerate() {
                s.add(index, value);
            }
        }
    }

    /// A full record was queued for the observer (or the queue refused it).
    pub(crate) fn record_posted(&self, queued: bool) {
        self.records.add(if queued {
            RecordOutcome::Queued
        } else {
            RecordOutcome::Lost
        });
    }

    /// `include_usage` was added to a streamed OpenAI request.
    pub(crate) fn injected(&self) {
        self.injected.add(1);
    }

    /// A streamed OpenAI request whose `include_usage` could not be added.
    pub(crate) fn skipped(&self, reason: SkipReason) {
        self.skipped.add(reason);
    }

    /// A compressed response: its usage decoded, or unreadable (a coding
    /// or bytes the decoder cannot read).
    pub(crate) fn encoded(&self, decoded: bool) {
        self.encoded.add(if decoded {
            Decoding::Decoded
        } else {
            Decoding::Unreadable
        });
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.usage.flush(host);
        self.records.flush(host);
        self.injected.flush(host);
        self.skipped.flush(host);
        self.encoded.flush(host);
        let Ok(series) = self.series.try_borrow() else {
            return;
        };
        for s in series.iter() {
            s.flush(host);
        }
    }
}

/// Defines a new series' counters, in [`Meters::count`]'s order. Label
/// order puts `kind` last: its values contain `_`, which Envoy's tag
/// regexes for the other labels stop at.
fn define_series(host: &mut impl Host, tenant: &str, model: &str) -> Counters {
    let requests = [("tenant", tenant), ("model", model)];
    let tokens: Vec<[(&str, &str); 3]> = KINDS
        .iter()
        .map(|&kind| [("tenant", tenant), ("model", model), ("kind", kind)])
        .collect();
    let mut names = Vec::with_capacity(PER_SERIES);
    names.push(MetricName::new("zerolayer_metering_requests", &requests));
    names.extend(
        tokens
            .iter()
            .map(|labels| MetricName::new("zerolayer_metering_tokens", labels)),
    );
    Counters::define(host, "metering", &names)
}

#[cfg(test)]
mod tests {
    use zerolayer_core::metering::{LabelLimits, UsageRecord};
    use zerolayer_host::FakeHost;

    use super::Meters;

    fn record(tenant: &str, model: &str, input: u64, output: u64) -> UsageRecord {
        UsageRecord {
            at_ms: 1_700_000_000_000,
            request_id: "r".into(),
            tenant: tenant.into(),
            model: model.into(),
            input_tokens: input,
            output_tokens: output,
            cache_read_tokens: 1,
            cache_creation_tokens: 0,
            usage_missing: false,
            status: 200,
            latency_ms: 5,
            streamed: false,
            rate_bp: 0,
            in_sample: false,
            credential: None,
        }
    }

    #[test]
    fn a_series_is_defined_on_first_use_and_reported_on_flush() {
        let mut host = FakeHost::default();
        let meters = Meters::define(&mut host, LabelLimits::default());
        let requests = "zerolayer_metering_requests_tenant=acme_model=m1";
        assert_eq!(host.metric(requests), None, "not before first use");
        meters.count(&mut host, &record("acme", "m1", 10, 3));
        meters.count(&mut host, &record("acme", "m1", 5, 2));
        meters.count(&mut host, &record("acme", "m2", 7, 7));
        assert_eq!(host.metric(requests), Some(0), "counted in memory");
        meters.flush(&mut host);
        assert_eq!(host.metric(requests), Some(2));
        let tokens = "zerolayer_metering_tokens_tenant=acme_model=m1_kind=";
        assert_eq!(host.metric(&format!("{tokens}input")), Some(15));
        assert_eq!(host.metric(&format!("{tokens}output")), Some(5));
        assert_eq!(host.metric(&format!("{tokens}cache_read")), Some(2));
        assert_eq!(host.metric(&format!("{tokens}cache_creation")), Some(0));
        assert_eq!(
            host.metric("zerolayer_metering_requests_tenant=acme_model=m2"),
            Some(1)
        );
        // A second flush adds nothing twice.
        meters.flush(&mut host);
        assert_eq!(host.metric(requests), Some(2));
    }

    #[test]
    fn tenants_past_the_label_bound_count_as_other() {
        let mut host = FakeHost::default();
        let limits = LabelLimits {
            max_tenants: 1,
            max_models: 20,
        };
        let meters = Meters::define(&mut host, limits);
        meters.count(&mut host, &record("acme", "m", 1, 1));
        meters.count(&mut host, &record("globex", "m", 1, 1));
        meters.count(&mut host, &record("initech", "m", 1, 1));
        meters.flush(&mut host);
        assert_eq!(
            host.metric("zerolayer_metering_requests_tenant=acme_model=m"),
            Some(1)
        );
        assert_eq!(
            host.metric("zerolayer_metering_requests_tenant=other_model=m"),
            Some(2)
        );
        assert_eq!(
            host.metric("zerolayer_metering_requests_tenant=globex_model=m"),
            None
        );
    }

    #[test]
    fn missing_usage_is_counted_apart_from_found_usage() {
        let mut host = FakeHost::default();
        let meters = Meters::define(&mut host, LabelLimits::default());
        meters.count(&mut host, &record("acme", "m", 1, 1));
        let mut missing = record("acme", "unknown", 0, 0);
        missing.usage_missing = true;
        meters.count(&mut host, &missing);
        meters.count(&mut host, &missing);
        meters.flush(&mut host);
        assert_eq!(
            host.metric("zerolayer_metering_usage_result=found"),
            Some(1)
        );
        assert_eq!(
            host.metric("zerolayer_metering_usage_result=missing"),
            Some(2)
        );
    }

    #[test]
    fn fixed_counters_are_reported_on_flush() {
        let mut host = FakeHost::default();
        let meters = Meters::define(&mut host, LabelLimits::default());
        meters.record_posted(true);
        meters.record_posted(false);
        meters.record_posted(false);
        meters.injected();
        meters.encoded(true);
        meters.encoded(false);
        assert_eq!(
            host.metric("zerolayer_metering_records_outcome=lost"),
            Some(0)
        );
        meters.flush(&mut host);
        for (name, value) in [
            ("zerolayer_metering_records_outcome=queued", 1),
            ("zerolayer_metering_records_outcome=lost", 2),
            ("zerolayer_metering_include_usage_injected", 1),
            ("zerolayer_metering_encoded_responses_result=decoded", 1),
            ("zerolayer_metering_encoded_responses_result=unreadable", 1),
        ] {
            assert_eq!(host.metric(name), Some(value), "{name}");
        }
    }
}
