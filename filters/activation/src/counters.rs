//! The filter's metrics: gathered in Wasm memory per request, reported to
//! the host from the root's tick (`zerolayer_host::Counters`).
//!
//! Names (Prometheus form with the `stats_tags` in `envoy/*.yaml`):
//! - `zerolayer_activation_requests`: requests evaluated;
//! - `zerolayer_activation_forged_headers`: client-sent internal headers removed;
//! - `zerolayer_activation_rule_matches{rule=…}`: requests each rule matched;
//! - `zerolayer_activation_observer_on{observer=…}`: requests each observer ran for.

use zerolayer_core::activation::{Decision, RuleSet};
use zerolayer_core::metrics::labelled;
use zerolayer_host::Host;

const REQUESTS: usize = 0;
const FORGED_HEADERS: usize = 1;
const FIRST_RULE: usize = 2;

/// The activation counters.
pub(crate) struct Counters {
    inner: zerolayer_host::Counters,
    first_observer: usize,
}

impl Counters {
    /// Defines one host counter per name.
    pub(crate) fn define(host: &mut impl Host, rules: &RuleSet) -> Self {
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
        Counters {
            inner: zerolayer_host::Counters::define(host, "activation", &names),
            first_observer,
        }
    }

    /// Counts one evaluated request.
    pub(crate) fn decision(&self, decision: &Decision) {
        self.inner.add(REQUESTS, 1);
        for rule in decision.matched.iter() {
            self.inner.add(FIRST_RULE + rule, 1);
        }
        for observer in decision.observers.iter() {
            self.inner.add(self.first_observer + observer.index(), 1);
        }
    }

    /// Counts one removed client-sent internal header.
    pub(crate) fn forged_header(&self) {
        self.inner.add(FORGED_HEADERS, 1);
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.inner.flush(host);
    }
}
