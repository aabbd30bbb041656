//! The filter's metrics: gathered in Wasm memory per request, reported to
//! the host from the root's tick (`zerolayer_host::Counters`).
//!
//! Names (Prometheus form with the `stats_tags` in `envoy/*.yaml`):
//! - `zerolayer_activation_requests`: requests evaluated;
//! - `zerolayer_activation_forged_headers`: client-sent internal headers removed;
//! - `zerolayer_activation_rule_matches{rule=…}`: requests each rule matched;
//! - `zerolayer_activation_observer_on{observer=…}`: requests each observer ran for.

use zerolayer_core::activation::{Decision, RuleSet};
use zerolayer_host::{Counter, Host};

/// The activation counters.
pub(crate) struct Counters {
    requests: Counter,
    forged_headers: Counter,
    /// By rule index (the rules come from the configuration).
    rule_matches: zerolayer_host::Counters,
    /// By observer index.
    observer_on: zerolayer_host::Counters,
}

impl Counters {
    /// Defines one host counter per name.
    pub(crate) fn define(host: &mut impl Host, rules: &RuleSet) -> Self {
        const WHO: &str = "activation";
        let observers: Vec<&str> = rules.observers().all().map(|(_, o)| o).collect();
        Counters {
            requests: Counter::define(host, WHO, "zerolayer_activation_requests"),
            forged_headers: Counter::define(host, WHO, "zerolayer_activation_forged_headers"),
            rule_matches: zerolayer_host::Counters::labelled(
                host,
                WHO,
                "zerolayer_activation_rule_matches",
                "rule",
                rules.rule_names(),
            ),
            observer_on: zerolayer_host::Counters::labelled(
                host,
                WHO,
                "zerolayer_activation_observer_on",
                "observer",
                &observers,
            ),
        }
    }

    /// Counts one evaluated request.
    pub(crate) fn decision(&self, decision: &Decision) {
        self.requests.add(1);
        for rule in decision.matched.iter() {
            self.rule_matches.add(rule, 1);
        }
        for observer in decision.observers.iter() {
            self.observer_on.add(observer.index(), 1);
        }
    }

    /// Counts one removed client-sent internal header.
    pub(crate) fn forged_header(&self) {
        self.forged_headers.add(1);
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.requests.flush(host);
        self.forged_headers.flush(host);
        self.rule_matches.flush(host);
        self.observer_on.flush(host);
    }
}
