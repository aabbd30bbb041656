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

#[cfg(test)]
mod tests {
    use zerolayer_core::event::{CacheWrite, Job};
    use zerolayer_host::{FakeHost, Host};

    use super::MAX_IN_FLIGHT;
    use crate::{Observer, ObserverConfig};

    /// An observer writing post-cache entries to webdis on cluster `webdis`.
    fn observer(host: &mut FakeHost) -> Observer {
        let config = ObserverConfig::from_json(
            br#"{"post_cache":{"secret_env":"S","fleet":{"cluster":"webdis","path":"/"}}}"#,
        )
        .unwrap();
        Observer::configure(host, &config, "observer").unwrap()
    }

    /// Posts and drains a write of entry `n` (digest `[n; 32]`).
    fn write(host: &mut FakeHost, observer: &mut Observer, n: u8, ttl_secs: u32) {
        let job = Job::CacheWrite(CacheWrite {
            digest: [n; 32],
            ttl_secs,
            entry: format!("entry {n}").into_bytes(),
        });
        host.enqueue(observer.queue(), &job.encode()).unwrap();
        observer.drain(host);
    }

    fn answer(host: &mut FakeHost, observer: &mut Observer, index: usize, status: Option<u16>) {
        let token = host.dispatched[index].token;
        host.answer_with(status, b"");
        assert!(observer.on_http_call_response(host, token, 0));
    }

    fn counter(host: &mut FakeHost, observer: &Observer, outcome: &str) -> i64 {
        observer.flush_counters(host);
        let name = format!("zerolayer_cache_fleet_writes_outcome={outcome}");
        host.metric(&name).unwrap()
    }

    #[test]
    fn a_cache_write_is_a_put_to_webdis_setex_with_the_entry_as_body() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host);
        write(&mut host, &mut observer, 7, 60);
        assert_eq!(host.dispatched.len(), 1);
        let call = &host.dispatched[0];
        assert_eq!(call.cluster, "webdis");
        assert_eq!(call.header(":method"), Some("PUT"));
        let path = format!("/SETEX/zl:cache:{}/60", "07".repeat(32));
        assert_eq!(call.header(":path"), Some(path.as_str()));
        assert_eq!(
            call.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(call.body.as_deref(), Some(&b"entry 7"[..]));
    }

    #[test]
    fn an_entry_without_a_ttl_is_written_for_one_second() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host);
        write(&mut host, &mut observer, 1, 0);
        let path = host.dispatched[0].header(":path").unwrap();
        assert!(path.ends_with("/1"), "{path}");
    }

    #[test]
    fn writes_past_max_in_flight_are_dropped_and_counted() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host);
        for n in 0..=MAX_IN_FLIGHT {
            write(&mut host, &mut observer, n as u8, 60);
        }
        assert_eq!(host.dispatched.len(), MAX_IN_FLIGHT);
        assert_eq!(counter(&mut host, &observer, "dropped"), 1);
        answer(&mut host, &mut observer, 0, Some(200));
        write(&mut host, &mut observer, 200, 60);
        assert_eq!(
            host.dispatched.len(),
            MAX_IN_FLIGHT + 1,
            "an answer frees a place"
        );
    }

    #[test]
    fn only_a_200_answer_counts_as_written() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host);
        for n in 0..3 {
            write(&mut host, &mut observer, n, 60);
        }
        answer(&mut host, &mut observer, 0, Some(200));
        answer(&mut host, &mut observer, 1, Some(500));
        answer(&mut host, &mut observer, 2, None);
        assert_eq!(counter(&mut host, &observer, "ok"), 1);
        assert_eq!(counter(&mut host, &observer, "failed"), 2);
    }

    #[test]
    fn a_refused_write_counts_a_failure_and_takes_no_place() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host);
        host.refuse_dispatch = true;
        write(&mut host, &mut observer, 0, 60);
        assert_eq!(counter(&mut host, &observer, "failed"), 1);
        host.refuse_dispatch = false;
        for n in 0..MAX_IN_FLIGHT {
            write(&mut host, &mut observer, n as u8, 60);
        }
        assert_eq!(host.dispatched.len(), MAX_IN_FLIGHT);
        assert_eq!(counter(&mut host, &observer, "dropped"), 0);
    }
}
