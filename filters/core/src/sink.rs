//! An HTTP JSON-lines sink the observer ships records to in batches (audit
//! records, usage records): where it is, how records are batched and
//! buffered, and how a failing sink is retried.

use serde::Deserialize;

use crate::breaker::BreakerConfig;
use crate::config::ConfigError;
use crate::config::Endpoint;

/// Most batches a sink may have in flight (each holds its records in
/// memory until answered).
pub const MAX_IN_FLIGHT: usize = 64;

/// A sink: batches by size and age, a bounded buffer while it is down,
/// exponential backoff between failed batches and a breaker in front.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Where to post (for ClickHouse: `/?query=INSERT…FORMAT JSONEachRow`).
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// Records per batch at most.
    #[serde(default = "default_batch")]
    pub batch_max: usize,
    /// Longest a record waits, ms.
    #[serde(default = "default_flush")]
    pub flush_ms: u64,
    /// Batches posted at once. In tick mode batches leave only on tick, so
    /// this × `batch_max` per tick is the most the sink can take.
    #[serde(default = "default_in_flight")]
    pub max_in_flight: usize,
    /// Records kept while the sink is down; beyond, drops are counted.
    #[serde(default = "default_buffer")]
    pub buffer_max: usize,
    /// Wait after the first failed batch, ms; doubles per consecutive
    /// failure up to `max_backoff_ms`.
    #[serde(default = "default_backoff")]
    pub backoff_ms: u64,
    /// Longest wait between retries, ms.
    #[serde(default = "default_max_backoff")]
    pub max_backoff_ms: u64,
    /// Consecutive failures before the sink is considered down.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

fn default_batch() -> usize {
    100
}
fn default_flush() -> u64 {
    1000
}
fn default_in_flight() -> usize {
    4
}
fn default_buffer() -> usize {
    10_000
}
fn default_backoff() -> u64 {
    250
}
fn default_max_backoff() -> u64 {
    10_000
}

impl SinkConfig {
    /// Checks what serde cannot; `at` is the sink's field path.
    pub fn check(&self, at: &str) -> Result<(), ConfigError> {
        if self.batch_max == 0 {
            return Err(ConfigError::new(
                format!("{at}.batch_max"),
                "must be at least 1",
            ));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return Err(ConfigError::new(
                format!("{at}.max_in_flight"),
                format!(
                    "{} is not between 1 and {MAX_IN_FLIGHT}",
                    self.max_in_flight
                ),
            ));
        }
        if self.buffer_max < self.batch_max {
            return Err(ConfigError::new(
                format!("{at}.buffer_max"),
                format!(
                    "{} is smaller than batch_max ({})",
                    self.buffer_max, self.batch_max
                ),
            ));
        }
        if self.flush_ms == 0 {
            return Err(ConfigError::new(
                format!("{at}.flush_ms"),
                "must be at least 1",
            ));
        }
        if self.backoff_ms == 0 || self.max_backoff_ms < self.backoff_ms {
            return Err(ConfigError::new(
                format!("{at}.backoff_ms"),
                format!(
                    "{} must be at least 1 and at most max_backoff_ms ({})",
                    self.backoff_ms, self.max_backoff_ms
                ),
            ));
        }
        if self.breaker.failures == 0 {
            return Err(ConfigError::new(
                format!("{at}.breaker.failures"),
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// The wait before retrying after `failures` consecutive failed batches.
    pub fn backoff(&self, failures: u32) -> u64 {
        let doublings = failures.saturating_sub(1).min(32);
        self.backoff_ms
            .saturating_mul(1u64 << doublings)
            .min(self.max_backoff_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(extra: &str) -> Result<SinkConfig, ConfigError> {
        let json = format!(r#"{{"cluster":"sink","path":"/"{extra}}}"#);
        let config: SinkConfig = crate::config::from_json(json.as_bytes())?;
        config.check("sink")?;
        Ok(config)
    }

    #[test]
    fn defaults_and_backoff() {
        let config = sink("").unwrap();
        assert_eq!(
            (
                config.batch_max,
                config.flush_ms,
                config.buffer_max,
                config.max_in_flight
            ),
            (100, 1000, 10_000, 4)
        );
        let backoffs: Vec<u64> = (1..=8).map(|n| config.backoff(n)).collect();
        assert_eq!(backoffs, [250, 500, 1000, 2000, 4000, 8000, 10_000, 10_000]);
        assert_eq!(config.backoff(u32::MAX), 10_000);
    }

    #[test]
    fn bad_values_name_their_field() {
        let err = |extra: &str| sink(extra).unwrap_err().to_string();
        assert!(err(r#","batch_max":0"#).starts_with("sink.batch_max:"));
        assert!(err(r#","buffer_max":5,"batch_max":10"#).starts_with("sink.buffer_max:"));
        assert!(err(r#","backoff_ms":0"#).starts_with("sink.backoff_ms:"));
        assert!(err(r#","breaker":{"failures":0}"#).starts_with("sink.breaker.failures:"));
        assert!(err(r#","flush_ms":0"#).starts_with("sink.flush_ms:"));
        assert!(err(r#","max_in_flight":0"#).starts_with("sink.max_in_flight:"));
        assert!(err(r#","max_in_flight":65"#).starts_with("sink.max_in_flight:"));
    }
}
