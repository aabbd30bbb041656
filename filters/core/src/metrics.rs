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
            labelled("zerolayer_activation_rule_matches", "rule", "vip"),
            "zerolayer_activation_rule_matches_rule=vip"
        );
    }
}
