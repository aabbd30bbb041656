//! Counters gathered on the request path and handed to the host later.
//!
//! A host call costs far more than an add in Wasm memory (~270 ns in V8), and
//! a request may bump several counters. Filters add to [`PendingCounters`] and
//! flush from the root context's tick, off the request path.

use std::cell::Cell;

/// Per-counter increments not yet reported to the host.
#[derive(Debug)]
pub struct PendingCounters {
    pending: Box<[Cell<u64>]>,
}

impl PendingCounters {
    /// `count` counters, all at zero.
    pub fn new(count: usize) -> Self {
        Self {
            pending: (0..count).map(|_| Cell::new(0)).collect(),
        }
    }

    /// Adds `n` to counter `index` (ignored when out of range: counting must
    /// never fail a request).
    #[inline]
    pub fn add(&self, index: usize, n: u64) {
        if let Some(cell) = self.pending.get(index) {
            cell.set(cell.get().saturating_add(n));
        }
    }

    /// Calls `report(index, delta)` for every counter with pending
    /// increments and clears them.
    pub fn drain(&self, mut report: impl FnMut(usize, u64)) {
        for (index, cell) in self.pending.iter().enumerate() {
            let delta = cell.replace(0);
            if delta > 0 {
                report(index, delta);
            }
        }
    }
}

/// A metric name carrying one label in the `_key=value` form that Envoy's
/// `stats_tags` regexes turn into a Prometheus label (see `envoy/*.yaml`).
pub fn labelled(name: &str, key: &str, value: &str) -> String {
    format!("{name}_{key}={value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drains_only_pending_counters_once() {
        let counters = PendingCounters::new(3);
        counters.add(0, 1);
        counters.add(2, 5);
        counters.add(2, 1);
        counters.add(7, 1);
        let mut seen = vec![];
        counters.drain(|i, n| seen.push((i, n)));
        assert_eq!(seen, [(0, 1), (2, 6)]);
        counters.drain(|i, n| panic!("nothing pending, got {i} += {n}"));
    }

    #[test]
    fn label_form() {
        assert_eq!(
            labelled("zerolayer_activation_rule_matches", "rule", "vip"),
            "zerolayer_activation_rule_matches_rule=vip"
        );
    }
}
