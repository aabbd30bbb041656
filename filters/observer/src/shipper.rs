//! Records shipped to an HTTP JSON-lines sink (audit records, usage
//! records): buffered up to a bound, posted in batches by size and age (up to
//! `max_in_flight` at once), retried with exponential backoff, with a breaker in
//! front; records beyond the buffer are dropped, counted and logged, never
//! silently.

use std::collections::VecDeque;

use zerolayer_core::breaker::{Breaker, Transition};
use zerolayer_core::sink::SinkConfig;

use zerolayer_host::Host;

use crate::calls::{CallKind, Calls, Request};
use crate::metrics::{ObserverMetrics, RecordOutcome};

/// Which sink a batch is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sink {
    /// lazy-auth's audit records.
    Audit,
    /// metering's usage records.
    Usage,
    /// lazy-auth's attribution rows.
    Attribution,
}

impl Sink {
    fn name(self) -> &'static str {
        match self {
            Sink::Audit => "audit",
            Sink::Usage => "usage",
            Sink::Attribution => "attribution",
        }
    }
}

/// One sink's buffer and retry state.
pub(crate) struct Shipper {
    sink: Sink,
    config: SinkConfig,
    /// JSON lines (each with its newline) and when they arrived (ms),
    /// oldest first.
    buffer: VecDeque<(u64, Vec<u8>)>,
    breaker: Breaker,
    /// Consecutive failed batches (backoff exponent).
    failures: u32,
    /// No batch before this time (backoff after a failure).
    retry_at_ms: u64,
    /// Batches posted and not answered yet.
    in_flight: usize,
    /// Drops since the last log line about them.
    unlogged_drops: u64,
}

impl Shipper {
    pub(crate) fn new(sink: Sink, config: SinkConfig) -> Self {
        Shipper {
            sink,
            breaker: Breaker::new(config.breaker),
            config,
            buffer: VecDeque::new(),
            failures: 0,
            retry_at_ms: 0,
            in_flight: 0,
            unlogged_drops: 0,
        }
    }

    /// The sink's cluster (for log lines).
    pub(crate) fn cluster(&self) -> &str {
        &self.config.endpoint.cluster
    }

    /// Buffers one JSON line (ending with a newline); a batch that is now
    /// full leaves at once, before the rest of a burst can overflow the
    /// buffer (batches by age leave on tick).
    pub(crate) fn push(
        &mut self,
        host: &mut impl Host,
        line: Vec<u8>,
        now_ms: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        if self.buffer.len() >= self.config.buffer_max {
            self.dropped(1, counters);
            return;
        }
        self.buffer.push_back((now_ms, line));
        if self.buffer.len() >= self.config.batch_max {
            self.maybe_flush(host, now_ms, calls, counters);
        }
    }

    fn dropped(&mut self, n: u64, counters: &ObserverMetrics) {
        counters
            .sink(self.sink)
            .records
            .add_n(RecordOutcome::Dropped, n);
        self.unlogged_drops += n;
    }

    /// Reports drops since the last call in one log line (called on tick,
    /// so a flood of drops is a line per tick, not a line per record).
    pub(crate) fn report_drops(&mut self) {
        if self.unlogged_drops > 0 {
            log::warn!(
                "observer: {} sink {}: dropped {} records (buffer of {} full: the sink fails, or takes fewer records than arrive)",
                self.sink.name(),
                self.config.endpoint.cluster,
                self.unlogged_drops,
                self.config.buffer_max
            );
            self.unlogged_drops = 0;
        }
    }

    /// Ships batches while one is due (full, or its oldest record waited
    /// `flush_ms`) and fewer than `max_in_flight` are out; none while
    /// backing off or while the breaker is open.
    pub(crate) fn maybe_flush(
        &mut self,
        host: &mut impl Host,
        now_ms: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        while self.in_flight < self.config.max_in_flight
            && self.due(now_ms)
            && now_ms >= self.retry_at_ms
            && self.breaker.allow(now_ms / 1000)
        {
            let n = self.buffer.len().min(self.config.batch_max);
            let batch: Vec<(u64, Vec<u8>)> = self.buffer.drain(..n).collect();
            let body: Vec<u8> = batch
                .iter()
                .flat_map(|(_, line)| line.iter().copied())
                .collect();
            let headers = [("content-type", &b"application/x-ndjson"[..])];
            let request = Request {
                headers: &headers,
                body: Some(&body),
                ..Request::to(&self.config.endpoint, "POST")
            };
            match calls.dispatch(host, request, CallKind::Batch(self.sink, batch)) {
                Ok(()) => self.in_flight += 1,
                Err(CallKind::Batch(_, batch)) => {
                    // Backs off: the loop stops until `retry_at_ms`.
                    self.failed(batch, now_ms, counters);
                    return;
                }
                Err(_) => return,
            }
        }
    }

    /// Whether a batch should leave: a full one waits, or the oldest
    /// record waited `flush_ms`.
    fn due(&self, now_ms: u64) -> bool {
        self.buffer.len() >= self.config.batch_max
            || self
                .buffer
                .front()
                .is_some_and(|(at, _)| now_ms >= at.saturating_add(self.config.flush_ms))
    }

    /// The sink answered a batch (`None`: no answer, e.g. a timeout).
    pub(crate) fn answered(
        &mut self,
        batch: Vec<(u64, Vec<u8>)>,
        status: Option<u16>,
        now_ms: u64,
        counters: &ObserverMetrics,
    ) {
        self.in_flight = self.in_flight.saturating_sub(1);
        match status {
            Some(200..=299) => {
                counters
                    .sink(self.sink)
                    .records
                    .add_n(RecordOutcome::Shipped, batch.len() as u64);
                self.failures = 0;
                self.retry_at_ms = 0;
                if self.breaker.success() == Some(Transition::Closed) {
                    log::info!(
                        "observer: {} sink {} answers again; {} records waiting",
                        self.sink.name(),
                        self.config.endpoint.cluster,
                        self.buffer.len()
                    );
                }
            }
            _ => {
                log::debug!(
                    "observer: {} sink {} failed a batch of {} ({status:?})",
                    self.sink.name(),
                    self.config.endpoint.cluster,
                    batch.len()
                );
                self.failed(batch, now_ms, counters);
            }
        }
    }

    /// A batch failed: back off, maybe open the breaker, and put the batch
    /// back in front within the buffer bound.
    fn failed(&mut self, batch: Vec<(u64, Vec<u8>)>, now_ms: u64, counters: &ObserverMetrics) {
        counters.sink(self.sink).failed_batches.add(1);
        self.failures = self.failures.saturating_add(1);
        self.retry_at_ms = now_ms.saturating_add(self.config.backoff(self.failures));
        if self.breaker.failure(now_ms / 1000) == Some(Transition::Opened) {
            log::warn!(
                "observer: {} sink {} down after {} failed batches; retrying in {} s, buffering up to {} records",
                self.sink.name(),
                self.config.endpoint.cluster,
                self.failures,
                self.config.breaker.open_secs,
                self.config.buffer_max
            );
        }
        let mut dropped = 0;
        for record in batch.into_iter().rev() {
            if self.buffer.len() >= self.config.buffer_max {
                dropped += 1;
                continue;
            }
            self.buffer.push_front(record);
        }
        if dropped > 0 {
            self.dropped(dropped, counters);
        }
    }

    /// Records waiting (not counting batches in flight).
    pub(crate) fn buffered(&self) -> usize {
        self.buffer.len()
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;
    use std::sync::Mutex;
    use std::thread::ThreadId;
    use std::time::Duration;

    use zerolayer_core::event::{AuditRecord, Job};
    use zerolayer_core::metering::UsageRecord;
    use zerolayer_host::{Dispatched, FakeHost, Host};

    use crate::{Observer, ObserverConfig};

    const SHIPPED: &str = "zerolayer_metering_records_outcome=shipped";
    const DROPPED: &str = "zerolayer_metering_records_outcome=dropped";
    const FAILED: &str = "zerolayer_metering_batches_failed";

    /// An observer whose only work is a usage sink (cluster `usage`, path
    /// `/ingest`, plus the `sink` fields given) in `mode`.
    fn observer(host: &mut FakeHost, mode: &str, sink: &str) -> Observer {
        let json = format!(
            r#"{{"metering":{{"observer":{{"mode":"{mode}"}},"sink":{{"cluster":"usage","path":"/ingest"{sink}}}}}}}"#
        );
        let config = ObserverConfig::from_json(json.as_bytes()).unwrap();
        Observer::configure(host, &config, "observer").unwrap()
    }

    fn record(n: usize) -> UsageRecord {
        UsageRecord {
            at_ms: 1_700_000_000_000,
            request_id: format!("r{n}"),
            tenant: "acme".into(),
            model: "m".into(),
            input_tokens: 10,
            output_tokens: 20,
            cache_read_tokens: 0,
            cache_creation_tokens: 0,
            usage_missing: false,
            status: 200,
            latency_ms: 5,
            streamed: false,
            rate_bp: 10_000,
            in_sample: true,
            credential: None,
        }
    }

    /// Record `n`'s sink line, newline included.
    fn line(n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        record(n).write_sink_row(&mut out);
        out
    }

    /// Posts usage records `ns` and lets the observer drain them (one wake-up).
    fn post(host: &mut FakeHost, observer: &mut Observer, ns: Range<usize>) {
        for n in ns {
            let job = Job::Usage(record(n)).encode();
            host.enqueue(observer.queue(), &job).unwrap();
        }
        observer.drain(host);
    }

    /// The request ids a batch carries, in order.
    fn ids(call: &Dispatched) -> Vec<String> {
        let body = call.body.as_deref().unwrap_or_default();
        body.split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let row: serde_json::Value = serde_json::from_slice(l).unwrap();
                row["request_id"].as_str().unwrap().to_string()
            })
            .collect()
    }

    fn names(ns: Range<usize>) -> Vec<String> {
        ns.map(|n| format!("r{n}")).collect()
    }

    /// Answers callout `index` (in dispatch order) with `status`.
    fn answer(host: &mut FakeHost, observer: &mut Observer, index: usize, status: Option<u16>) {
        let token = host.dispatched[index].token;
        host.answer_with(status, b"");
        assert!(observer.on_http_call_response(host, token, 0));
    }

    fn counter(host: &mut FakeHost, observer: &Observer, name: &str) -> i64 {
        observer.flush_counters(host);
        host.metric(name).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    // Warnings logged on the current test's thread (tests run in parallel).
    struct Capture;
    static LOGGER: Capture = Capture;
    static LINES: Mutex<Vec<(ThreadId, String)>> = Mutex::new(Vec::new());

    impl log::Log for Capture {
        fn enabled(&self, metadata: &log::Metadata) -> bool {
            metadata.level() <= log::Level::Warn
        }
        fn log(&self, record: &log::Record) {
            if self.enabled(record.metadata()) {
                let line = (std::thread::current().id(), record.args().to_string());
                LINES.lock().unwrap().push(line);
            }
        }
        fn flush(&self) {}
    }

    fn capture_warnings() {
        let _ = log::set_logger(&LOGGER);
        log::set_max_level(log::LevelFilter::Warn);
    }

    fn warnings() -> Vec<String> {
        let me = std::thread::current().id();
        LINES
            .lock()
            .unwrap()
            .iter()
            .filter(|(thread, _)| *thread == me)
            .map(|(_, line)| line.clone())
            .collect()
    }

    #[test]
    fn a_full_batch_leaves_at_once_as_one_ndjson_post() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, "singleton", r#","batch_max":3"#);
        post(&mut host, &mut observer, 0..2);
        assert!(host.dispatched.is_empty(), "2 records are not a batch of 3");
        post(&mut host, &mut observer, 2..5);
        assert_eq!(host.dispatched.len(), 1);
        let call = &host.dispatched[0];
        assert_eq!(call.cluster, "usage");
        assert_eq!(call.header(":method"), Some("POST"));
        assert_eq!(call.header(":path"), Some("/ingest"));
        assert_eq!(call.header("content-type"), Some("application/x-ndjson"));
        let expected = [line(0), line(1), line(2)].concat();
        assert_eq!(call.body.as_deref(), Some(&expected[..]));
    }

    #[test]
    fn a_partial_batch_leaves_by_age_on_tick() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, "singleton", r#","flush_ms":1000"#);
        post(&mut host, &mut observer, 0..2);
        observer.on_tick(&mut host);
        host.advance(ms(999));
        observer.on_tick(&mut host);
        assert!(host.dispatched.is_empty(), "younger than flush_ms");
        host.advance(ms(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 1);
        assert_eq!(ids(&host.dispatched[0]), names(0..2));
    }

    #[test]
    fn no_more_than_max_in_flight_batches_are_out_at_once() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":1,"max_in_flight":2"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..5);
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2);
        answer(&mut host, &mut observer, 0, Some(200));
        assert_eq!(host.dispatched.len(), 3, "an answer frees one place");
        assert_eq!(ids(&host.dispatched[2]), names(2..3));
    }

    #[test]
    fn a_failed_batch_is_retried_first_after_an_exponential_backoff() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":2,"backoff_ms":100,"max_backoff_ms":1000"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..3);
        assert_eq!(host.dispatched.len(), 1);
        // A 5xx and no answer at all fail alike; the wait doubles each time.
        let failures = [Some(503), None, Some(500)];
        for (attempt, (status, wait)) in failures.into_iter().zip([100, 200, 400]).enumerate() {
            answer(&mut host, &mut observer, attempt, status);
            host.advance(ms(wait - 1));
            observer.on_tick(&mut host);
            assert_eq!(
                host.dispatched.len(),
                attempt + 1,
                "retried before {wait} ms"
            );
            host.advance(ms(1));
            observer.on_tick(&mut host);
            assert_eq!(
                host.dispatched.len(),
                attempt + 2,
                "not retried after {wait} ms"
            );
            assert_eq!(ids(&host.dispatched[attempt + 1]), names(0..2));
        }
        answer(&mut host, &mut observer, 3, Some(200));
        assert_eq!(counter(&mut host, &observer, SHIPPED), 2);
        assert_eq!(counter(&mut host, &observer, FAILED), 3);
        // The record that waited behind the failed batch comes next, by age.
        host.advance(ms(300));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 5);
        assert_eq!(ids(&host.dispatched[4]), names(2..3));
    }

    #[test]
    fn the_breaker_opens_after_consecutive_failures_and_a_trial_success_closes_it() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":1,"backoff_ms":1,"max_backoff_ms":1,"breaker":{"failures":2,"open_secs":10}"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..1);
        answer(&mut host, &mut observer, 0, Some(500));
        host.advance(ms(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2, "one failure does not open it");
        answer(&mut host, &mut observer, 1, Some(500));
        post(&mut host, &mut observer, 1..3);
        host.advance(Duration::from_secs(9));
        observer.on_tick(&mut host);
        assert_eq!(
            host.dispatched.len(),
            2,
            "dispatched while the breaker is open"
        );
        host.advance(Duration::from_secs(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 3, "one trial once open_secs passed");
        assert_eq!(ids(&host.dispatched[2]), names(0..1));
        answer(&mut host, &mut observer, 2, Some(200));
        assert_eq!(host.dispatched.len(), 5, "closed: the rest leaves at once");
        assert_eq!(ids(&host.dispatched[3]), names(1..2));
        assert_eq!(ids(&host.dispatched[4]), names(2..3));
    }

    #[test]
    fn a_trial_that_fails_keeps_the_breaker_open_for_another_open_secs() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":1,"backoff_ms":1,"max_backoff_ms":1,"breaker":{"failures":1,"open_secs":10}"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..1);
        answer(&mut host, &mut observer, 0, Some(500));
        host.advance(Duration::from_secs(10));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2);
        answer(&mut host, &mut observer, 1, Some(502));
        host.advance(Duration::from_secs(9));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2);
        host.advance(Duration::from_secs(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 3);
    }

    #[test]
    fn records_past_buffer_max_are_dropped_counted_and_logged_once_per_tick() {
        capture_warnings();
        let mut host = FakeHost::default();
        let sink = r#","batch_max":2,"max_in_flight":1,"buffer_max":4"#;
        let mut observer = observer(&mut host, "singleton", sink);
        // One batch out (never answered), four records buffered, three too many.
        post(&mut host, &mut observer, 0..9);
        assert_eq!(host.dispatched.len(), 1);
        observer.on_tick(&mut host);
        assert_eq!(host.metric(DROPPED), Some(3));
        assert_eq!(host.metric("zerolayer_metering_records_buffered"), Some(4));
        let drops = |lines: Vec<String>| -> Vec<String> {
            lines
                .into_iter()
                .filter(|l| l.contains("dropped"))
                .collect()
        };
        let logged = drops(warnings());
        assert_eq!(logged.len(), 1, "{logged:?}");
        assert!(logged[0].contains("dropped 3 records"), "{logged:?}");
        observer.on_tick(&mut host);
        assert_eq!(drops(warnings()).len(), 1, "no new drops, no new line");
        post(&mut host, &mut observer, 9..11);
        observer.on_tick(&mut host);
        let logged = drops(warnings());
        assert_eq!(logged.len(), 2, "{logged:?}");
        assert!(logged[1].contains("dropped 2 records"), "{logged:?}");
        assert_eq!(host.metric(DROPPED), Some(5));
    }

    #[test]
    fn a_failed_batch_that_no_longer_fits_the_buffer_is_dropped_and_counted() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":2,"max_in_flight":1,"buffer_max":4,"backoff_ms":100"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..6);
        answer(&mut host, &mut observer, 0, Some(503));
        assert_eq!(counter(&mut host, &observer, DROPPED), 2);
        host.advance(ms(100));
        observer.on_tick(&mut host);
        assert_eq!(ids(&host.dispatched[1]), names(2..4));
    }

    #[test]
    fn a_refused_dispatch_backs_off_like_a_failed_batch() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, "singleton", r#","batch_max":1,"backoff_ms":100"#);
        host.refuse_dispatch = true;
        post(&mut host, &mut observer, 0..1);
        assert_eq!(counter(&mut host, &observer, FAILED), 1);
        host.refuse_dispatch = false;
        host.advance(ms(99));
        observer.on_tick(&mut host);
        assert!(host.dispatched.is_empty(), "retried before the backoff");
        host.advance(ms(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 1);
        assert_eq!(ids(&host.dispatched[0]), names(0..1));
    }

    #[test]
    fn only_records_of_answered_2xx_batches_count_as_shipped() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, "singleton", r#","batch_max":2"#);
        post(&mut host, &mut observer, 0..6);
        answer(&mut host, &mut observer, 0, Some(204));
        answer(&mut host, &mut observer, 1, Some(500));
        assert_eq!(counter(&mut host, &observer, SHIPPED), 2);
        assert_eq!(counter(&mut host, &observer, FAILED), 1);
        answer(&mut host, &mut observer, 2, Some(200));
        assert_eq!(counter(&mut host, &observer, SHIPPED), 4);
    }

    #[test]
    fn in_singleton_mode_the_next_batch_leaves_from_the_answer() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":1,"max_in_flight":1"#;
        let mut observer = observer(&mut host, "singleton", sink);
        post(&mut host, &mut observer, 0..2);
        assert_eq!(host.dispatched.len(), 1);
        answer(&mut host, &mut observer, 0, Some(200));
        assert_eq!(host.dispatched.len(), 2);
    }

    #[test]
    fn in_tick_mode_the_next_batch_waits_for_the_tick_not_the_answer() {
        let mut host = FakeHost::default();
        let sink = r#","batch_max":1,"max_in_flight":1"#;
        let mut observer = observer(&mut host, "tick", sink);
        post(&mut host, &mut observer, 0..2);
        assert_eq!(host.dispatched.len(), 1);
        answer(&mut host, &mut observer, 0, Some(200));
        assert_eq!(host.dispatched.len(), 1, "a callout started from an answer");
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2);
        assert_eq!(ids(&host.dispatched[1]), names(1..2));
    }

    #[test]
    fn audit_records_and_batches_go_to_the_audit_sink() {
        let mut host = FakeHost::default();
        let config = ObserverConfig::from_json(
            br#"{"lazy_auth":{"credentials":[{"header":"authorization","scheme":"Bearer","kind":"jwt"}],
                "audit":{"cluster":"audit","path":"/audit","batch_max":3}}}"#,
        )
        .unwrap();
        let mut observer = Observer::configure(&mut host, &config, "observer").unwrap();
        let audit = |n: u64| AuditRecord {
            at_ms: n,
            hash_prefix: "0123456789abcdef".into(),
            tenant: Some("acme".into()),
            verified: true,
            decision: "allow".into(),
            reason: "cached".into(),
            latency_us: 3,
            request_id: format!("a{n}"),
        };
        let queue = observer.queue();
        host.enqueue(queue, &Job::Audit(audit(0)).encode()).unwrap();
        host.enqueue(queue, &Job::AuditBatch(vec![audit(1), audit(2)]).encode())
            .unwrap();
        observer.drain(&mut host);
        assert_eq!(host.dispatched.len(), 1);
        let call = &host.dispatched[0];
        assert_eq!(call.cluster, "audit");
        assert_eq!(call.header(":path"), Some("/audit"));
        assert_eq!(ids(call), ["a0", "a1", "a2"]);
        answer(&mut host, &mut observer, 0, Some(200));
        let shipped = counter(
            &mut host,
            &observer,
            "zerolayer_audit_records_outcome=shipped",
        );
        assert_eq!(shipped, 3);
    }
}
