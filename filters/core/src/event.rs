//! Events filters post to the observer through a shared queue: compact
//! (postcard), versioned, and never panicking on bad bytes. One enum, so one
//! observer serves every filter.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::auth::credential::CredentialKind;
use crate::metering::UsageRecord;

const VERSION: u8 = 1;

/// A job for the observer.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Job {
    /// Verify a credential off the request path and store the verdict.
    Verify(VerifyJob),
    /// Ship an auth audit record.
    Audit(AuditRecord),
    /// A verification a filter did itself (synchronously), for the
    /// observer's per-tenant escalation windows.
    Outcome(VerifyOutcome),
    /// A cache entry for the fleet tier (appended last: variant indexes are
    /// the wire format).
    CacheWrite(CacheWrite),
    /// A request's usage record for the metering sink.
    Usage(UsageRecord),
    /// Audit records a filter VM gathered (one enqueue, and one wake-up of
    /// the observer, per batch instead of per request).
    AuditBatch(Vec<AuditRecord>),
}

/// A post-cache entry to write to the fleet tier (Redis), off the request path.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheWrite {
    /// The entry's keyed digest (its Redis key, hex).
    pub digest: [u8; 32],
    /// Seconds it stays fresh.
    pub ttl_secs: u32,
    /// The encoded entry (`zerolayer_core::cache::store::StoredResponse`).
    pub entry: Vec<u8>,
}

impl fmt::Debug for CacheWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheWrite")
            .field("digest", &crate::auth::credential::hex(&self.digest[..8]))
            .field("ttl_secs", &self.ttl_secs)
            .field("entry", &format_args!("<{} bytes>", self.entry.len()))
            .finish()
    }
}

/// The result of a synchronous verification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyOutcome {
    /// The tenant (verified, or claimed when verification failed).
    pub tenant: String,
    /// Whether verification failed.
    pub failed: bool,
    /// Unix seconds.
    pub at: u64,
}

/// A credential to verify. The credential travels only through the queue
/// (process memory) and is never logged: `Debug` shows its hash prefix.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyJob {
    /// SHA-256 of the credential.
    pub hash: [u8; 32],
    /// How to verify it.
    pub kind: CredentialKind,
    /// The credential itself.
    pub credential: Vec<u8>,
    /// Tenant the request claimed (unverified), for escalation statistics.
    pub tenant_hint: Option<String>,
    /// Host time (ms) when the request was admitted.
    pub enqueued_at_ms: u64,
}

impl fmt::Debug for VerifyJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifyJob")
            .field("hash", &crate::auth::credential::hex(&self.hash[..8]))
            .field("kind", &self.kind)
            .field(
                "credential",
                &format_args!("<{} bytes>", self.credential.len()),
            )
            .field("tenant_hint", &self.tenant_hint)
            .finish()
    }
}

/// One authentication decision, for the audit sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Unix ms of the decision.
    pub at_ms: u64,
    /// First 16 hex digits of the credential's SHA-256 (empty without one).
    pub hash_prefix: String,
    /// Tenant (verified, or claimed when `verified` is false).
    pub tenant: Option<String>,
    /// Whether the tenant was verified.
    pub verified: bool,
    /// The decision (`allow`, `deny`, `lazy`, `sync_allow`, …).
    pub decision: String,
    /// Why (`cached`, `expired`, `exposure_bound`, …).
    pub reason: String,
    /// Time spent deciding, µs.
    pub latency_us: u64,
    /// The request id.
    pub request_id: String,
}

/// An audit record as the audit sink's JSON line (keys in name order).
#[derive(Serialize)]
struct AuditRow<'a> {
    at_ms: u64,
    credential: &'a str,
    decision: &'a str,
    latency_us: u64,
    reason: &'a str,
    request_id: &'a str,
    tenant: Option<&'a str>,
    verified: bool,
}

impl AuditRecord {
    /// Appends the record as one JSON line for the audit sink.
    pub fn write_sink_row(&self, out: &mut Vec<u8>) {
        let row = AuditRow {
            at_ms: self.at_ms,
            credential: &self.hash_prefix,
            decision: &self.decision,
            latency_us: self.latency_us,
            reason: &self.reason,
            request_id: &self.request_id,
            tenant: self.tenant.as_deref(),
            verified: self.verified,
        };
        if serde_json::to_writer(&mut *out, &row).is_ok() {
            out.push(b'\n');
        }
    }
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Job::Verify(v) => v.fmt(f),
            Job::Audit(a) => a.fmt(f),
            Job::Outcome(o) => o.fmt(f),
            Job::CacheWrite(w) => w.fmt(f),
            Job::Usage(u) => u.fmt(f),
            Job::AuditBatch(records) => write!(f, "AuditBatch({} records)", records.len()),
        }
    }
}

impl Job {
    /// Serializes for the queue.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        if let Ok(body) = postcard::to_allocvec(self) {
            out.extend(body);
        }
        out
    }

    /// Parses a queue item; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Job> {
        match bytes.split_first() {
            Some((&VERSION, body)) => postcard::from_bytes(body).ok(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_sink_row_is_one_json_line_in_key_order() {
        for tenant in [Some("acme \"x\"".to_string()), None] {
            let record = AuditRecord {
                at_ms: 1_764_430_000_123,
                hash_prefix: "0123456789abcdef".into(),
                tenant: tenant.clone(),
                verified: true,
                decision: "valid_cached".into(),
                reason: "cached".into(),
                latency_us: 7,
                request_id: "r-1".into(),
            };
            let mut out = Vec::new();
            record.write_sink_row(&mut out);
            // What the observer wrote before (a JSON object's sorted keys).
            let before = serde_json::json!({
                "at_ms": record.at_ms, "credential": record.hash_prefix, "tenant": tenant,
                "verified": true, "decision": "valid_cached", "reason": "cached",
                "latency_us": 7, "request_id": "r-1",
            });
            assert_eq!(String::from_utf8(out).unwrap(), format!("{before}\n"));
        }
    }

    #[test]
    fn round_trip_and_redaction() {
        let job = Job::Verify(VerifyJob {
            hash: [7; 32],
            kind: CredentialKind::ApiKey,
            credential: b"sk-secret-value".to_vec(),
            tenant_hint: Some("acme".into()),
            enqueued_at_ms: 5,
        });
        assert_eq!(Job::decode(&job.encode()), Some(job.clone()));
        let shown = format!("{job:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("<15 bytes>"), "{shown}");
        let write = Job::CacheWrite(CacheWrite {
            digest: [1; 32],
            ttl_secs: 60,
            entry: vec![9; 100],
        });
        assert_eq!(Job::decode(&write.encode()), Some(write.clone()));
        assert!(format!("{write:?}").contains("<100 bytes>"));
        let batch = Job::AuditBatch(vec![
            AuditRecord {
                at_ms: 1,
                hash_prefix: "0123456789abcdef".into(),
                tenant: Some("acme".into()),
                verified: true,
                decision: "valid_cached".into(),
                reason: "cached".into(),
                latency_us: 3,
                request_id: "r-1".into(),
            };
            3
        ]);
        assert_eq!(Job::decode(&batch.encode()), Some(batch.clone()));
        assert_eq!(format!("{batch:?}"), "AuditBatch(3 records)");
        assert_eq!(Job::decode(b""), None);
        assert_eq!(Job::decode(&[1, 200, 3]), None);
    }
}
