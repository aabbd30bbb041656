//! Audit records: buffered (bounded) and shipped in batches as JSON lines
//! to the configured sink, retried while the sink is down; records beyond
//! the buffer are dropped and counted, never silently.

use std::collections::VecDeque;

use zerolayer_core::auth::config::SinkConfig;
use zerolayer_core::breaker::{Breaker, BreakerConfig};
use zerolayer_core::event::AuditRecord;

use crate::calls::{CallKind, Calls};
use crate::{ObserverMetrics, counter};

pub(crate) struct AuditShipper {
    config: SinkConfig,
    buffer: VecDeque<AuditRecord>,
    last_flush_ms: u64,
    breaker: Breaker,
}

impl AuditShipper {
    pub(crate) fn new(config: SinkConfig) -> Self {
        AuditShipper {
            config,
            buffer: VecDeque::new(),
            last_flush_ms: 0,
            breaker: Breaker::new(BreakerConfig::default()),
        }
    }

    pub(crate) fn push(&mut self, record: AuditRecord, counters: &ObserverMetrics) {
        if self.buffer.len() >= self.config.buffer_max {
            counters.add(counter::AUDIT_DROPPED, 1);
            return;
        }
        self.buffer.push_back(record);
    }

    /// Ships a batch when it is full or old enough (one batch in flight).
    pub(crate) fn maybe_flush(
        &mut self,
        now_ms: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let due = self.buffer.len() >= self.config.batch_max
            || (!self.buffer.is_empty() && now_ms >= self.last_flush_ms + self.config.flush_ms);
        if !due || calls.audit_in_flight() || !self.breaker.allow(now_ms / 1000) {
            return;
        }
        self.last_flush_ms = now_ms;
        let n = self.buffer.len().min(self.config.batch_max);
        let batch: Vec<AuditRecord> = self.buffer.drain(..n).collect();
        let body: String = batch
            .iter()
            .map(|r| {
                let mut line = serde_json::json!({
                    "at_ms": r.at_ms, "credential": r.hash_prefix, "tenant": r.tenant,
                    "verified": r.verified, "decision": r.decision, "reason": r.reason,
                    "latency_us": r.latency_us, "request_id": r.request_id,
                })
                .to_string();
                line.push('\n');
                line
            })
            .collect();
        let headers = [("content-type", &b"application/x-ndjson"[..])];
        if let Err(CallKind::Audit(batch)) = calls.dispatch(
            &self.config.endpoint,
            "POST",
            &headers,
            Some(body.as_bytes()),
            CallKind::Audit(batch),
        ) {
            self.requeue(batch, counters);
            let _ = self.breaker.failure(now_ms / 1000);
        }
    }

    /// The sink answered a batch.
    pub(crate) fn answered(
        &mut self,
        batch: Vec<AuditRecord>,
        status: Option<u16>,
        counters: &ObserverMetrics,
    ) {
        match status {
            Some(200..=299) => {
                let _ = self.breaker.success();
                counters.add(counter::AUDIT_SHIPPED, batch.len() as u64);
            }
            _ => {
                counters.add(counter::AUDIT_FAILED_BATCHES, 1);
                let _ = self.breaker.failure(zerolayer_proxy::now_secs());
                self.requeue(batch, counters);
            }
        }
    }

    /// Puts a failed batch back in front, within the buffer bound.
    fn requeue(&mut self, batch: Vec<AuditRecord>, counters: &ObserverMetrics) {
        for record in batch.into_iter().rev() {
            if self.buffer.len() >= self.config.buffer_max {
                counters.add(counter::AUDIT_DROPPED, 1);
                continue;
            }
            self.buffer.push_front(record);
        }
    }
}
