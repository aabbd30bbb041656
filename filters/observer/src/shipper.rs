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
}

impl Sink {
    fn name(self) -> &'static str {
        match self {
            Sink::Audit => "audit",
            Sink::Usage => "usage",
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
