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
use zerolayer_host::{Counter, Family, Host};

zerolayer_core::labels! {
    /// A fleet-tier read's result.
    pub(crate) enum FleetRead {
        /// A usable entry.
        Hit => "hit",
        /// Not there.
        Miss => "miss",
        /// No answer, an error status, or an entry that does not belong to the request.
        Error => "error",
    }
}

zerolayer_core::labels! {
    /// A lookup's result.
    pub(crate) enum Lookup {
        /// Served from the cache.
        Hit => "hit",
        /// Went upstream.
        Miss => "miss",
        /// Neither looked up nor stored.
        Bypass => "bypass",
    }
}

zerolayer_core::labels! {
    /// How a follower's wait ended.
    pub(crate) enum WaitEnd {
        /// The holder's response arrived and was served from the cache.
        Hit => "hit",
        /// The lease went away without an entry: the follower went upstream.
        Upstream => "upstream",
        /// `max_wait_ms` passed: the follower went upstream.
        Timeout => "timeout",
    }
}

/// The counters.
pub(crate) struct Metrics {
    lookups: Family<Lookup>,
    bypass: Family<Bypass>,
    stored: Counter,
    evicted: Counter,
    waits: Family<WaitEnd>,
    write_failed: Counter,
    fleet_reads: Family<FleetRead>,
    fleet_queued: Counter,
    fleet_lost: Counter,
}

impl Metrics {
    pub(crate) fn define(host: &mut impl Host) -> Metrics {
        const WHO: &str = "post-cache";
        Metrics {
            lookups: Family::define(host, WHO, "zerolayer_cache_lookups", "result"),
            bypass: Family::define(host, WHO, "zerolayer_cache_bypass", "reason"),
            stored: Counter::define(host, WHO, "zerolayer_cache_stored"),
            evicted: Counter::define(host, WHO, "zerolayer_cache_evicted"),
            waits: Family::define(host, WHO, "zerolayer_cache_lease_waits", "outcome"),
            write_failed: Counter::define(host, WHO, "zerolayer_cache_write_failed"),
            fleet_reads: Family::define(host, WHO, "zerolayer_cache_fleet_reads", "result"),
            fleet_queued: Counter::define(host, WHO, "zerolayer_cache_fleet_writes_queued"),
            fleet_lost: Counter::define(host, WHO, "zerolayer_cache_fleet_writes_lost"),
        }
    }

    /// A lookup's result.
    pub(crate) fn lookup(&self, result: Lookup) {
        self.lookups.add(result);
    }

    /// Why the cache stayed out (or did not store).
    pub(crate) fn bypass(&self, reason: Bypass) {
        self.bypass.add(reason);
    }

    /// An entry stored (`evicted`: in the place of a fresh one).
    pub(crate) fn stored(&self, evicted: bool) {
        self.stored.add(1);
        if evicted {
            self.evicted.add(1);
        }
    }

    /// How a follower's wait ended.
    pub(crate) fn wait_ended(&self, end: WaitEnd) {
        self.waits.add(end);
    }

    /// A store that failed (shared data refused it).
    pub(crate) fn write_failed(&self) {
        self.write_failed.add(1);
    }

    /// A fleet-tier read's result.
    pub(crate) fn fleet_read(&self, result: FleetRead) {
        self.fleet_reads.add(result);
    }

    /// A fleet write handed to the observer (or lost: no observer queue).
    pub(crate) fn fleet_write(&self, queued: bool) {
        if queued {
            self.fleet_queued.add(1);
        } else {
            self.fleet_lost.add(1);
        }
    }

    /// Reports pending increments to the host.
    pub(crate) fn flush(&self, host: &mut impl Host) {
        self.lookups.flush(host);
        self.bypass.flush(host);
        self.stored.flush(host);
        self.evicted.flush(host);
        self.waits.flush(host);
        self.write_failed.flush(host);
        self.fleet_reads.flush(host);
        self.fleet_queued.flush(host);
        self.fleet_lost.flush(host);
    }
}
