//! Metric names as structure, and counters gathered on the request path.
//!
//! A host call costs far more than an add in Wasm memory (~270 ns in V8), and
//! a request may bump several counters. Filters add to [`PendingCounters`] and
//! flush from the root context's tick, off the request path; a host that
//! batches for its own reports (the native module) hands out a
//! [`SharedCounter`] instead, so an increment is batched once.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// The values of one label of a counter family (`outcome` of
/// `zerolayer_auth_decisions`): a counter per value, and the same value in
/// logs and audit records. Defined with [`crate::labels!`], so a name is
/// written once and a count is a variant, never an index or a string.
pub trait Label: Copy + Eq + 'static {
    /// Every value, in the order their counters are defined.
    const ALL: &'static [Self];
    /// The label value (`lazy`).
    fn label(self) -> &'static str;
    /// The value's place in [`Label::ALL`].
    fn index(self) -> usize;
}

/// Defines an enum whose variants are a [`Label`]'s values:
/// `labels! { pub enum Outcome { Hit => "hit", Miss => "miss" } }`.
#[macro_export]
macro_rules! labels {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $label:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $crate::metrics::Label for $name {
            const ALL: &'static [Self] = &[$($name::$variant),+];

            fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }

            fn index(self) -> usize {
                self as usize
            }
        }
    };
}

/// A metric and its labels, as a stage names a series: the native module
/// takes them as they are; a Proxy-Wasm host, which knows only names, takes
/// the flattened form ([`fmt::Display`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricName<'a> {
    /// The metric (`zerolayer_auth_decisions`).
    pub metric: &'a str,
    /// Label names and values, in order (`[("outcome", "valid")]`).
    pub labels: &'a [(&'a str, &'a str)],
}

impl<'a> MetricName<'a> {
    /// `metric` with `labels`.
    pub const fn new(metric: &'a str, labels: &'a [(&'a str, &'a str)]) -> Self {
        MetricName { metric, labels }
    }

    /// `metric` without labels.
    pub const fn plain(metric: &'a str) -> Self {
        MetricName {
            metric,
            labels: &[],
        }
    }
}

impl<'a> From<&'a str> for MetricName<'a> {
    fn from(metric: &'a str) -> Self {
        MetricName::plain(metric)
    }
}

/// The Proxy-Wasm name, `<metric>_<key>=<value>…`: the form Envoy's
/// `stats_tags` regexes (`envoy/*.yaml`) turn back into Prometheus labels,
/// so `/stats/prometheus` names must not change.
impl fmt::Display for MetricName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.metric)?;
        for (key, value) in self.labels {
            write!(f, "_{key}={value}")?;
        }
        Ok(())
    }
}

/// A counter's increments not yet reported, kept by a host that reports on
/// its own schedule and from its own thread (the native module); the
/// stages add to it directly instead of batching a second time. Adds
/// from every thread are exact: the reporter takes what has accrued.
#[derive(Debug, Clone, Default)]
pub struct SharedCounter(Arc<AtomicU64>);

impl SharedCounter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether increments are waiting to be reported.
    pub fn pending(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }

    /// The increments since the last take (and zero from now).
    pub fn take(&self) -> u64 {
        self.0.swap(0, Ordering::Relaxed)
    }
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

    crate::labels! {
        /// A test family.
        enum Result {
            /// First.
            Hit => "hit",
            /// Second.
            Miss => "miss",
        }
    }

    #[test]
    fn labels_are_defined_once_in_order() {
        assert_eq!(Result::ALL, [Result::Hit, Result::Miss]);
        assert_eq!(Result::Miss.label(), "miss");
        assert_eq!(Result::Miss.index(), 1);
        for (i, value) in Result::ALL.iter().enumerate() {
            assert_eq!(value.index(), i);
        }
    }

    #[test]
    fn label_form() {
        assert_eq!(
            MetricName::new("zerolayer_activation_rule_matches", &[("rule", "vip")]).to_string(),
            "zerolayer_activation_rule_matches_rule=vip"
        );
        assert_eq!(
            MetricName::new(
                "zerolayer_metering_tokens",
                &[("tenant", "acme"), ("model", "m1"), ("kind", "cache_read")]
            )
            .to_string(),
            "zerolayer_metering_tokens_tenant=acme_model=m1_kind=cache_read"
        );
        assert_eq!(
            MetricName::from("zerolayer_cache_stored").to_string(),
            "zerolayer_cache_stored"
        );
    }

    #[test]
    fn a_shared_counter_hands_over_each_increment_once_across_threads() {
        let counter = SharedCounter::default();
        assert!(!counter.pending());
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let counter = counter.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| counter.add(1)))
            })
            .collect();
        let mut taken = 0;
        while adders.iter().any(|a| !a.is_finished()) {
            taken += counter.take();
        }
        for adder in adders {
            adder.join().unwrap();
        }
        taken += counter.take();
        assert_eq!(taken, 4000);
        assert!(!counter.pending());
        assert_eq!(counter.take(), 0);
    }
}
