//! The filter's metrics: gathered in Wasm memory per request, reported to
//! the host from the root context's tick (see `zerolayer_core::metrics`).
//!
//! Names (Prometheus form with the `stats_tags` in `envoy/*.yaml`):
//! - `zerolayer_activation_requests`: requests evaluated;
//! - `zerolayer_activation_forged_headers`: client-sent internal headers removed;
//! - `zerolayer_activation_rule_matches{rule=…}`: requests each rule matched;
//! - `zerolayer_activation_observer_on{observer=…}`: requests each observer ran for.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use zerolayer_core::activation::{Decision, RuleSet};
use zerolayer_core::metrics::{PendingCounters, labelled};

const REQUESTS: usize = 0;
const FORGED_HEADERS: usize = 1;
const FIRST_RULE: usize = 2;

/// The host metric ids and the increments waiting for the next flush.
pub(crate) struct Counters {
    ids: Vec<Option<u32>>,
    pending: PendingCounters,
    first_observer: usize,
}

impl Counters {
    /// Defines one host counter per name; a host without metrics leaves the
    /// filter working, uncounted.
    pub(crate) fn define(rules: &RuleSet) -> Self {
        let mut names = vec![
            "zerolayer_activation_requests".to_string(),
            "zerolayer_activation_forged_headers".to_string(),
        ];
        names.extend(
            rules
                .rule_names()
                .iter()
                .map(|r| labelled("zerolayer_activation_rule_matches", "rule", r)),
        );
        let first_observer = names.len();
        names.extend(
            rules
                .observers()
                .all()
                .map(|(_, o)| labelled("zerolayer_activation_observer_on", "observer", o)),
        );
        let ids = names
            .iter()
            .map(
                |name| match hostcalls::define_metric(MetricType::Counter, name) {
                    Ok(id) => Some(id),
                    Err(status) => {
                        log::warn!("activation: metric {name} unavailable: {status:?}");
                        None
                    }
                },
            )
            .collect();
        Counters {
            pending: PendingCounters::new(names.len()),
            ids,
            first_observer,
        }
    }

    /// Counts one evaluated request.
    pub(crate) fn decision(&self, decision: &Decision) {
        self.pending.add(REQUESTS, 1);
        for rule in decision.matched.iter() {
            self.pending.add(FIRST_RULE + rule, 1);
        }
        for observer in decision.observers.iter() {
            self.pending.add(self.first_observer + observer.index(), 1);
        }
    }

    /// Counts one removed client-sent internal header.
    pub(crate) fn forged_header(&self) {
        self.pending.add(FORGED_HEADERS, 1);
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self) {
        self.pending.drain(|index, delta| {
            if let Some(Some(id)) = self.ids.get(index) {
                let _ = hostcalls::increment_metric(*id, i64::try_from(delta).unwrap_or(i64::MAX));
            }
        });
    }
}
