//! Metrics as the stages keep them: counters added in Wasm memory on the
//! request path and reported from the root's tick (`flush`), gauges and
//! histograms recorded directly (off the request path). A fixed family is a
//! [`Family`] of a [`Label`] enum, a lone counter a [`Counter`]; [`Counters`]
//! is for families whose values come from the configuration (rule names).
//!
//! A host that batches counters for its own reports (the native module)
//! gives each counter a [`SharedCounter`] when it is defined: increments
//! go there directly and `flush` has nothing to hand over, so a count is
//! batched once, by the host.

use std::marker::PhantomData;

use zerolayer_core::metrics::{Label, MetricName, PendingCounters, SharedCounter};

use crate::host::{Host, MetricKind};

/// What [`Host::define_metric`] gives: the id updates name and, for a
/// counter the host batches itself, the cell increments are added to.
#[derive(Debug, Clone, Default)]
pub struct MetricId {
    /// The id [`Host::increment_metric`] and [`Host::record_metric`] take.
    pub id: u32,
    /// The host's own pending count for a counter (`None`: the stage
    /// batches and reports by id).
    pub shared: Option<SharedCounter>,
}

impl MetricId {
    /// A metric reported by id (the Proxy-Wasm hosts).
    pub fn reported(id: u32) -> MetricId {
        MetricId { id, shared: None }
    }
}

/// One counter per value of `L`: `<metric>_<key>=<value>` on a Proxy-Wasm
/// host, which the shipped Envoy configs' `stats_tags` turn into
/// `metric{key="value"}`.
pub struct Family<L: Label> {
    counters: Counters,
    label: PhantomData<L>,
}

impl<L: Label> Family<L> {
    /// Defines `metric`'s counters, one per value of label `key`.
    pub fn define(host: &mut impl Host, filter: &str, metric: &str, key: &str) -> Family<L> {
        let values: Vec<&str> = L::ALL.iter().map(|value| value.label()).collect();
        Family {
            counters: Counters::labelled(host, filter, metric, key, &values),
            label: PhantomData,
        }
    }

    /// Counts one for `value`.
    pub fn add(&self, value: L) {
        self.counters.add(value.index(), 1);
    }

    /// Counts `n` for `value`.
    pub fn add_n(&self, value: L, n: u64) {
        self.counters.add(value.index(), n);
    }

    /// Reports pending increments to the host.
    pub fn flush(&self, host: &mut impl Host) {
        self.counters.flush(host);
    }
}

/// A counter without labels.
pub struct Counter(Counters);

impl Counter {
    /// Defines counter `name`.
    pub fn define(host: &mut impl Host, filter: &str, name: &str) -> Counter {
        Counter(Counters::define(host, filter, &[MetricName::plain(name)]))
    }

    /// Counts `n`.
    pub fn add(&self, n: u64) {
        self.0.add(0, n);
    }

    /// Reports pending increments to the host.
    pub fn flush(&self, host: &mut impl Host) {
        self.0.flush(host);
    }
}

/// Where one counter's increments go.
enum Slot {
    /// The host refused it: not counted.
    Unavailable,
    /// Batched here (in [`Counters::pending`]), reported by id on flush.
    Batched(u32),
    /// Added to the host's own batch.
    Shared(SharedCounter),
}

/// Counters by index, for families whose values come from the
/// configuration (activation's rules and observers).
pub struct Counters {
    slots: Box<[Slot]>,
    pending: PendingCounters,
    /// Whether any slot is batched here (natively none: flush is a no-op).
    batched: bool,
}

impl Counters {
    /// Defines one counter per name (a host without metrics leaves them
    /// uncounted, said once per name).
    pub fn define(host: &mut impl Host, filter: &str, names: &[MetricName<'_>]) -> Counters {
        let slots: Box<[Slot]> = names
            .iter()
            .map(
                |&name| match host.define_metric(MetricKind::Counter, name) {
                    Ok(MetricId {
                        shared: Some(cell), ..
                    }) => Slot::Shared(cell),
                    Ok(MetricId { id, shared: None }) => Slot::Batched(id),
                    Err(status) => {
                        log::warn!("{filter}: metric {name} unavailable: {status:?}");
                        Slot::Unavailable
                    }
                },
            )
            .collect();
        Counters {
            batched: slots.iter().any(|s| matches!(s, Slot::Batched(_))),
            pending: PendingCounters::new(slots.len()),
            slots,
        }
    }

    /// Defines `metric`'s counters, one per value of label `key` (values
    /// from the configuration, in index order).
    pub fn labelled<S: AsRef<str>>(
        host: &mut impl Host,
        filter: &str,
        metric: &str,
        key: &str,
        values: &[S],
    ) -> Counters {
        let labels: Vec<[(&str, &str); 1]> = values.iter().map(|v| [(key, v.as_ref())]).collect();
        let names: Vec<MetricName<'_>> = labels
            .iter()
            .map(|labels| MetricName::new(metric, labels))
            .collect();
        Counters::define(host, filter, &names)
    }

    /// Adds `n` to counter `index` (in memory).
    #[inline]
    pub fn add(&self, index: usize, n: u64) {
        match self.slots.get(index) {
            Some(Slot::Shared(cell)) => cell.add(n),
            Some(Slot::Batched(_)) => self.pending.add(index, n),
            Some(Slot::Unavailable) | None => {}
        }
    }

    /// Reports pending increments to the host.
    pub fn flush(&self, host: &mut impl Host) {
        if !self.batched {
            return;
        }
        self.pending.drain(|index, delta| {
            if let Some(Slot::Batched(id)) = self.slots.get(index) {
                host.increment_metric(*id, i64::try_from(delta).unwrap_or(i64::MAX));
            }
        });
    }
}

/// A gauge or histogram recorded directly (off the request path).
pub struct Metric(Option<u32>);

impl Metric {
    /// Defines a gauge.
    pub fn gauge(host: &mut impl Host, name: &str) -> Metric {
        Metric::define(host, MetricKind::Gauge, name)
    }

    /// Defines a histogram.
    pub fn histogram(host: &mut impl Host, name: &str) -> Metric {
        Metric::define(host, MetricKind::Histogram, name)
    }

    fn define(host: &mut impl Host, kind: MetricKind, name: &str) -> Metric {
        Metric(
            host.define_metric(kind, MetricName::plain(name))
                .ok()
                .map(|m| m.id),
        )
    }

    /// Sets the gauge / records a histogram sample.
    pub fn record(&self, host: &mut impl Host, value: u64) {
        if let Some(id) = self.0 {
            host.record_metric(id, value);
        }
    }
}

#[cfg(all(test, feature = "fake"))]
mod tests {
    use super::*;
    use crate::FakeHost;

    zerolayer_core::labels! {
        /// A test family.
        enum Outcome {
            /// First.
            Hit => "hit",
            /// Second.
            Miss => "miss",
        }
    }

    #[test]
    fn a_proxy_wasm_host_gets_flattened_names_and_counts_on_flush_only() {
        let mut host = FakeHost::default();
        let family = Family::<Outcome>::define(&mut host, "t", "zerolayer_cache_lookups", "result");
        let rules = Counters::labelled(&mut host, "t", "zerolayer_rule", "rule", &["vip", "free"]);
        family.add(Outcome::Miss);
        family.add_n(Outcome::Miss, 2);
        rules.add(1, 4);
        rules.add(9, 1);
        assert_eq!(host.metric("zerolayer_cache_lookups_result=miss"), Some(0));
        family.flush(&mut host);
        rules.flush(&mut host);
        assert_eq!(host.metric("zerolayer_cache_lookups_result=miss"), Some(3));
        assert_eq!(host.metric("zerolayer_cache_lookups_result=hit"), Some(0));
        assert_eq!(
            host.labelled("zerolayer_cache_lookups", &[("result", "miss")]),
            Some(3)
        );
        assert_eq!(host.metric("zerolayer_rule_rule=free"), Some(4));
        assert_eq!(host.labelled("zerolayer_rule", &[("rule", "vip")]), Some(0));
        family.flush(&mut host);
        assert_eq!(host.metric("zerolayer_cache_lookups_result=miss"), Some(3));
    }

    #[test]
    fn a_host_that_batches_itself_gets_each_increment_once_without_a_flush() {
        let mut host = FakeHost::default();
        host.shared_counters = true;
        let family = Family::<Outcome>::define(&mut host, "t", "zerolayer_cache_lookups", "result");
        let counter = Counter::define(&mut host, "t", "zerolayer_cache_stored");
        let gauge = Metric::gauge(&mut host, "zerolayer_depth");
        family.add(Outcome::Hit);
        family.add_n(Outcome::Hit, 2);
        counter.add(5);
        family.flush(&mut host);
        counter.flush(&mut host);
        assert_eq!(
            host.labelled("zerolayer_cache_lookups", &[("result", "hit")]),
            Some(0),
            "a flush hands nothing over: the host's batch has it"
        );
        host.report_shared();
        assert_eq!(
            host.labelled("zerolayer_cache_lookups", &[("result", "hit")]),
            Some(3)
        );
        assert_eq!(host.metric("zerolayer_cache_stored"), Some(5));
        host.report_shared();
        assert_eq!(host.metric("zerolayer_cache_stored"), Some(5), "once");
        gauge.record(&mut host, 9);
        assert_eq!(host.metric("zerolayer_depth"), Some(9));
    }
}
