//! Metrics as the stages keep them: counters added in Wasm memory on the
//! request path and reported from the root's tick ([`Counters::flush`]),
//! gauges and histograms recorded directly (off the request path).

use zerolayer_core::metrics::PendingCounters;

use crate::host::{Host, MetricKind};

/// Counters defined with the host, incremented in memory, flushed on tick.
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
