//! The filter's counters (batched, flushed on tick). Prometheus, with the
//! `stats_tags` of the shipped Envoy configs:
//! `zerolayer_cache_lookups{result=hit|miss|bypass}`,
//! `zerolayer_cache_bypass{reason=…}` (request side and not-stored reasons),
//! `zerolayer_cache_stored`, `zerolayer_cache_evicted`,
//! `zerolayer_cache_lease_waits{outcome=hit|upstream|timeout}`,
//! `zerolayer_cache_write_failed`,
//! `zerolayer_cache_fleet_reads{result=hit|miss|error}`,
//! `zerolayer_cache_fleet_writes_queued`, `zerolayer_cache_fleet_writes_lost`.

use zerolayer_core::cache::control::Bypass;
use zerolayer_host::{Counters, Host};

/// Lookup results, in counter order.
const RESULTS: [&str; 3] = ["hit", "miss", "bypass"];
/// What a follower's wait ended in, in counter order.
const WAITS: [&str; 3] = ["hit", "upstream", "timeout"];

const BYPASS: usize = RESULTS.len();
const STORED: usize = BYPASS + Bypass::ALL.len();
const EVICTED: usize = STORED + 1;
const WAIT: usize = EVICTED + 1;
const WRITE_FAILED: usize = WAIT + WAITS.len();
/// Fleet-tier reads, in counter order.
const FLEET_READS: [&str; 3] = ["hit", "miss", "error"];
const FLEET_READ: usize = WRITE_FAILED + 1;
const FLEET_QUEUED: usize = FLEET_READ + FLEET_READS.len();
const FLEET_LOST: usize = FLEET_QUEUED + 1;

/// A fleet-tier read's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FleetRead {
    Hit,
    Miss,
    /// No answer, an error status, or an entry that does not belong to the request.
    Error,
}

/// A lookup's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    Hit,
    Miss,
    Bypass,
}

/// How a follower's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// The holder's response arrived and was served from the cache.
    Hit,
    /// The lease went away without an entry: the follower went upstream.
    Upstream,
    /// `max_wait_ms` passed: the follower went upstream.
    Timeout,
}

pub(crate) struct Metrics(Counters);

impl Metrics {
    pub(crate) fn define(host: &mut impl Host) -> Metrics {
        let mut names: Vec<String> = RESULTS
            .iter()
            .map(|r| format!("zerolayer_cache_lookups_result={r}"))
            .collect();
        names.extend(
            Bypass::ALL
                .iter()
                .map(|b| format!("zerolayer_cache_bypass_reason={}", b.name())),
        );
        names.push("zerolayer_cache_stored".into());
        names.push("zerolayer_cache_evicted".into());
        names.extend(
            WAITS
                .iter()
                .map(|w| format!("zerolayer_cache_lease_waits_outcome={w}")),
        );
        names.push("zerolayer_cache_write_failed".into());
        names.extend(
            FLEET_READS
                .iter()
                .map(|r| format!("zerolayer_cache_fleet_reads_result={r}")),
        );
        names.push("zerolayer_cache_fleet_writes_queued".into());
        names.push("zerolayer_cache_fleet_writes_lost".into());
        Metrics(Counters::define(host, "post-cache", &names))
    }

    pub(crate) fn lookup(&self, result: Lookup) {
        self.0.add(result as usize, 1);
    }

    pub(crate) fn bypass(&self, reason: Bypass) {
        if let Some(i) = Bypass::ALL.iter().position(|b| *b == reason) {
            self.0.add(BYPASS + i, 1);
        }
    }

    pub(crate) fn stored(&self, evicted: bool) {
        self.0.add(STORED, 1);
        if evicted {
            self.0.add(EVICTED, 1);
        }
    }

    pub(crate) fn wait_ended(&self, end: WaitEnd) {
        self.0.add(WAIT + end as usize, 1);
    }

    pub(crate) fn write_failed(&self) {
        self.0.add(WRITE_FAILED, 1);
    }

    pub(crate) fn fleet_read(&self, result: FleetRead) {
        self.0.add(FLEET_READ + result as usize, 1);
    }

    /// A fleet write handed to the observer (or lost: no observer queue).
    pub(crate) fn fleet_write(&self, queued: bool) {
        self.0
            .add(if queued { FLEET_QUEUED } else { FLEET_LOST }, 1);
    }

    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.0.flush(host);
    }
}
