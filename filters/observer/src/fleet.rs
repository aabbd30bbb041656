//! Writes post-cache entries to the fleet tier: Redis, through webdis
//! (`PUT /SETEX/<key>/<ttl>` with the entry as the body), off the request
//! path. Writes in flight are bounded; beyond the bound they are dropped and
//! counted (the local tier still has the entry; a fleet miss only costs a
//! backend call).

use zerolayer_core::cache::config::FleetConfig;
use zerolayer_core::cache::key::CacheKey;
use zerolayer_core::event::CacheWrite;

use zerolayer_host::Host;

use crate::calls::{CallKind, Calls, Request};
use crate::metrics::{ObserverMetrics, WriteOutcome};

/// Writes in flight at most.
const MAX_IN_FLIGHT: usize = 64;

/// The fleet-tier writer.
pub(crate) struct FleetWriter {
    config: FleetConfig,
    in_flight: usize,
}

impl FleetWriter {
    pub(crate) fn new(config: FleetConfig) -> FleetWriter {
        FleetWriter {
            config,
            in_flight: 0,
        }
    }

    /// The webdis cluster (for the configuration log line).
    pub(crate) fn cluster(&self) -> &str {
        &self.config.endpoint.cluster
    }

    /// Sends one entry to Redis.
    pub(crate) fn write(
        &mut self,
        host: &mut impl Host,
        job: CacheWrite,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        if self.in_flight >= MAX_IN_FLIGHT {
            counters.fleet_writes.add(WriteOutcome::Dropped);
            return;
        }
        let path = self
            .config
            .setex_path(&CacheKey(job.digest), job.ttl_secs.max(1));
        let request = Request {
            path: Some(&path),
            headers: &[("content-type", b"application/octet-stream")],
            body: Some(&job.entry),
            ..Request::to(&self.config.endpoint, "PUT")
        };
        match calls.dispatch(host, request, CallKind::CacheWrite) {
            Ok(()) => self.in_flight += 1,
            Err(_) => counters.fleet_writes.add(WriteOutcome::Failed),
        }
    }

    /// webdis answered a write (or the call failed: no status).
    pub(crate) fn answered(&mut self, status: Option<u16>, counters: &ObserverMetrics) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if status == Some(200) {
            counters.fleet_writes.add(WriteOutcome::Ok);
        } else {
            log::warn!("observer: a cache fleet write failed ({status:?})");
            counters.fleet_writes.add(WriteOutcome::Failed);
        }
    }
}
