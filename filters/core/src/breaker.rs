//! A circuit breaker: after `failures` consecutive failures a dependency is
//! considered down for `open_secs`; then one trial call decides. Stops the
//! observer from hammering a dead endpoint (verifier, sink).

use serde::Deserialize;

/// Breaker thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    #[serde(default = "default_failures")]
    pub failures: u32,
    /// Seconds the breaker stays open before a trial.
    #[serde(default = "default_open_secs")]
    pub open_secs: u64,
}

fn default_failures() -> u32 {
    5
}

fn default_open_secs() -> u64 {
    30
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: default_failures(),
            open_secs: default_open_secs(),
        }
    }
}

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Calls go through.
    Closed,
    /// Calls are refused until the given unix second.
    Open {
        /// When a trial is allowed.
        until: u64,
    },
    /// One trial call is out; its result closes or reopens the breaker.
    HalfOpen,
}

/// A breaker.
#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: State,
    consecutive: u32,
}

/// A state change worth a log line and a counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The dependency is considered down.
    Opened,
    /// It works again.
    Closed,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Breaker {
            config,
            state: State::Closed,
            consecutive: 0,
        }
    }

    /// Whether a call may be made at `now`; an expired open state lets one
    /// trial through (half-open).
    pub fn allow(&mut self, now: u64) -> bool {
        match self.state {
            State::Closed => true,
            State::Open { until } if now >= until => {
                self.state = State::HalfOpen;
                true
            }
            State::Open { .. } | State::HalfOpen => false,
        }
    }

    /// Whether the dependency is currently considered down.
    pub fn is_open(&self, now: u64) -> bool {
        match self.state {
            State::Closed => false,
            State::Open { until } => now < until,
            State::HalfOpen => true,
        }
    }

    /// Records a successful call.
    pub fn success(&mut self) -> Option<Transition> {
        self.consecutive = 0;
        let was_open = self.state != State::Closed;
        self.state = State::Closed;
        was_open.then_some(Transition::Closed)
    }

    /// Records a failed call at `now`.
    pub fn failure(&mut self, now: u64) -> Option<Transition> {
        self.consecutive = self.consecutive.saturating_add(1);
        let reopen = self.state == State::HalfOpen;
        if reopen || (self.state == State::Closed && self.consecutive >= self.config.failures) {
            self.state = State::Open {
                until: now.saturating_add(self.config.open_secs),
            };
            return (!reopen).then_some(Transition::Opened);
        }
        None
    }

    /// Current state.
    pub fn state(&self) -> State {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_n_failures_and_tries_again_after_the_pause() {
        let mut b = Breaker::new(BreakerConfig {
            failures: 3,
            open_secs: 30,
        });
        assert!(b.allow(0));
        assert_eq!(b.failure(0), None);
        assert_eq!(b.failure(1), None);
        assert_eq!(b.failure(2), Some(Transition::Opened));
        assert!(!b.allow(10));
        assert!(b.is_open(10));
        // After the pause: one trial.
        assert!(b.allow(32));
        assert!(!b.allow(32));
        // The trial fails: open again, no second "opened" event.
        assert_eq!(b.failure(32), None);
        assert!(!b.allow(40));
        assert!(b.allow(62));
        assert_eq!(b.success(), Some(Transition::Closed));
        assert!(b.allow(63));
        assert_eq!(b.success(), None);
        // A success resets the count.
        b.failure(70);
        b.failure(71);
        b.success();
        assert_eq!(b.failure(72), None);
    }
}
