//! Metrics as the stages keep them: counters added in Wasm memory on the
//! request path and reported from the root's tick (`flush`), gauges and
//! histograms recorded directly (off the request path). A fixed family is a
//! [`Family`] of a [`Label`] enum, a lone counter a [`Counter`]; [`Counters`]
//! is for families whose values come from the configuration (rule names).

use std::marker::PhantomData;

use zerolayer_core::metrics::{Label, PendingCounters, labelled};

use crate::host::{Host, MetricKind};

/// One counter per value of `L`: `<metric>_<key>=<value>`, which the
/// shipped Envoy configs' `stats_tags` turn into `metric{key="value"}`.
pub struct Family<L: Label> {
    counters: Counters,
    label: PhantomData<L>,
}

impl<L: Label> Family<L> {
    /// Defines `metric`'s counters, one per value of label `key`.
    pub fn define(host: &mut impl Host, filter: &str, metric: &str, key: &str) -> Family<L> {
        let names: Vec<String> = L::ALL
            .iter()
            .map(|value| labelled(metric, key, value.label()))
            .collect();
        Family {
            counters: Counters::define(host, filter, &names),
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
        Counter(Counters::define(host, filter, &[name]))
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

/// Counters by index, for families whose values come from the
/// configuration (activation's rules and observers).
pub struct Counters {
    ids: Vec<Option<u32>>,
    pending: PendingCounters,
}

impl Counters {
    /// Defines one counter per name (a host without metrics leaves them
    /// uncounted, said once per name).
    pub fn define<S: AsRef<str>>(host: &mut impl Host, filter: &str, names: &[S]) -> Counters {
        let ids = names
            .iter()
            .map(|name| {
                let name = name.as_ref();
                match host.define_metric(MetricKind::Counter, name) {
                    Ok(id) => Some(id),
                    Err(status) => {
                        log::warn!("{filter}: metric {name} unavailable: {status:?}");
                        None
                    }
                }
            })
            .collect();
        Counters {
            ids,
            pending: PendingCounters::new(names.len()),
        }
    }

    /// Adds `n` to counter `index` (in memory).
    pub fn add(&self, index: usize, n: u64) {
        self.pending.add(index, n);
    }

    /// Reports pending increments to the host.
    pub fn flush(&self, host: &mut impl Host) {
        self.pending.drain(|index, delta| {
            if let Some(Some(id)) = self.ids.get(index) {
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
        Metric(host.define_metric(MetricKind::Gauge, name).ok())
    }

    /// Defines a histogram.
    pub fn histogram(host: &mut impl Host, name: &str) -> Metric {
        Metric(host.define_metric(MetricKind::Histogram, name).ok())
    }

    /// Sets the gauge / records a histogram sample.
    pub fn record(&self, host: &mut impl Host, value: u64) {
        if let Some(id) = self.0 {
            host.record_metric(id, value);
        }
    }
}
