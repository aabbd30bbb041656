//! The probe's metrics, incremented on the host directly (no batching, so
//! a scrape right after a request sees it).
//!
//! Names (Prometheus form with the `stats_tags` in `envoy.yaml`):
//! - filter: `probe_requests`, `probe_actions{action=…}`, `probe_ticks`;
//! - singleton: `probe_queue_items`, `probe_singleton_ticks`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::actions::Kind;

/// A host counter; `None` when the host refused to define it (the probe
/// keeps working, uncounted).
#[derive(Clone, Copy)]
pub(crate) struct Counter(Option<u32>);

impl Counter {
    /// Defines the counter `name`.
    pub(crate) fn define(name: &str) -> Self {
        match hostcalls::define_metric(MetricType::Counter, name) {
            Ok(id) => Counter(Some(id)),
            Err(status) => {
                log::warn!("probe: metric {name} unavailable: {status:?}");
                Counter(None)
            }
        }
    }

    /// Adds `delta`.
    pub(crate) fn add(self, delta: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::increment_metric(id, i64::try_from(delta).unwrap_or(i64::MAX));
        }
    }
}

/// The filter role's counters.
pub(crate) struct FilterMetrics {
    requests: Counter,
    actions: [Counter; Kind::ALL.len()],
    ticks: Counter,
}

impl FilterMetrics {
    /// Defines every filter counter, one per action kind included.
    pub(crate) fn define() -> Self {
        FilterMetrics {
            requests: Counter::define("probe_requests"),
            actions: Kind::ALL
                .map(|kind| Counter::define(&format!("probe_actions_action={}", kind.name()))),
            ticks: Counter::define("probe_ticks"),
        }
    }

    /// Counts one request.
    pub(crate) fn request(&self) {
        self.requests.add(1);
    }

    /// Counts one action of `kind`.
    pub(crate) fn action(&self, kind: Kind) {
        if let Some(counter) = self.actions.get(kind as usize) {
            counter.add(1);
        }
    }

    /// Counts one tick.
    pub(crate) fn tick(&self) {
        self.ticks.add(1);
    }
}
