//! A request's usage record, as the observer ships it to the sink (a sampled
//! full record with its weight) and as the access log keeps it for every
//! request (the ground truth `host-sim reconcile` checks the sample against).

use serde::{Deserialize, Serialize};

use crate::sampling::BUCKETS;

/// One request's usage. Token counts are zero when `usage_missing`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Unix ms when the response ended (also the reconciliation hour).
    pub at_ms: u64,
    /// `x-request-id`.
    pub request_id: String,
    /// Tenant (lazy-auth's, else the tenant header's, else `unknown`).
    pub tenant: String,
    /// Model the response names (`unknown` without one).
    pub model: String,
    /// Input tokens (see `zerolayer_core::usage` for each provider's meaning).
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the provider's prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the provider's prompt cache.
    pub cache_creation_tokens: u64,
    /// The response carried no usage (error, interrupted stream, an OpenAI
    /// stream without its usage chunk): never read as zero.
    pub usage_missing: bool,
    /// Response status.
    pub status: u16,
    /// From request headers to the response's end, ms.
    pub latency_ms: u32,
    /// Whether the response was an SSE stream.
    pub streamed: bool,
    /// The sampling rate that applied, basis points.
    pub rate_bp: u16,
    /// Whether the request is in the hash sample (a record forced by
    /// activation's `metering` observer may not be: it weighs 0).
    pub in_sample: bool,
    /// For a request admitted before its credential was verified, and
    /// whose verdict was still pending when its response ended (`tenant`
    /// is then `unverified`): the credential's attribution id, which an
    /// attribution record names once the credential proves valid
    /// (`crate::auth::attribution`).
    pub credential: Option<String>,
}

/// The sink's row (ClickHouse `JSONEachRow`: flags as 0/1) and, without
/// latency and weight, the access log's entry.
#[derive(Serialize)]
struct Row<'a> {
    at_ms: u64,
    request_id: &'a str,
    tenant: &'a str,
    model: &'a str,
    input_tokens: u64,
    output_tokens: u64,
    cache_read_tokens: u64,
    cache_creation_tokens: u64,
    usage_missing: u8,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms: Option<u32>,
    streamed: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    sample_weight: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    credential: Option<&'a str>,
}

impl UsageRecord {
    /// How many requests this record stands for in the estimate: the
    /// inverse of the rate inside the sample, 0 outside it.
    pub fn sample_weight(&self) -> f64 {
        if !self.in_sample || self.rate_bp == 0 {
            return 0.0;
        }
        f64::from(BUCKETS) / f64::from(self.rate_bp)
    }

    /// The sink's JSON line (with its trailing newline) appended to `out`.
    pub fn write_sink_row(&self, out: &mut Vec<u8>) {
        let row = self.row(Some(self.latency_ms), Some(self.sample_weight()));
        if serde_json::to_writer(&mut *out, &row).is_ok() {
            out.push(b'\n');
        }
    }

    /// The access log's JSON object (one line, no newline).
    pub fn log_entry(&self) -> Vec<u8> {
        // Sized for a typical entry (~230 bytes): one allocation, not six.
        let mut out = Vec::with_capacity(256);
        match serde_json::to_writer(&mut out, &self.row(None, None)) {
            Ok(()) => out,
            Err(_) => Vec::new(),
        }
    }

    fn row(&self, latency_ms: Option<u32>, sample_weight: Option<f64>) -> Row<'_> {
        Row {
            at_ms: self.at_ms,
            request_id: &self.request_id,
            tenant: &self.tenant,
            model: &self.model,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cache_read_tokens: self.cache_read_tokens,
            cache_creation_tokens: self.cache_creation_tokens,
            usage_missing: u8::from(self.usage_missing),
            status: self.status,
            latency_ms,
            streamed: u8::from(self.streamed),
            sample_weight,
            credential: self.credential.as_deref(),
        }
    }
}

/// The usage a request's access-log entry ([`UsageRecord::log_entry`],
/// metering's hand-off to later filters) reports, or `None` when metering
/// found none (or the entry is not one).
pub fn logged_usage(entry: &[u8]) -> Option<crate::usage::Usage> {
    #[derive(Deserialize)]
    struct Logged {
        input_tokens: u64,
        output_tokens: u64,
        cache_read_tokens: u64,
        cache_creation_tokens: u64,
        usage_missing: u8,
    }
    let logged: Logged = serde_json::from_slice(entry).ok()?;
    (logged.usage_missing == 0).then_some(crate::usage::Usage {
        input_tokens: logged.input_tokens,
        output_tokens: logged.output_tokens,
        cache_read_tokens: logged.cache_read_tokens,
        cache_creation_tokens: logged.cache_creation_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_entry_gives_its_usage_back() {
        let entry = record().log_entry();
        let usage = logged_usage(&entry).expect("usage");
        assert_eq!((usage.input_tokens, usage.output_tokens), (12, 34));
        let missing = UsageRecord {
            usage_missing: true,
            ..record()
        };
        assert_eq!(logged_usage(&missing.log_entry()), None);
        assert_eq!(logged_usage(b"not json"), None);
    }

    fn record() -> UsageRecord {
        UsageRecord {
            at_ms: 1_764_430_000_123,
            request_id: "r-\"1".into(),
            tenant: "acme".into(),
            model: "m".into(),
            input_tokens: 12,
            output_tokens: 34,
            cache_read_tokens: 5,
            cache_creation_tokens: 0,
            usage_missing: false,
            status: 200,
            latency_ms: 15,
            streamed: true,
            rate_bp: 100,
            in_sample: true,
            credential: None,
        }
    }

    #[test]
    fn sink_row_and_log_entry() {
        let mut out = Vec::new();
        record().write_sink_row(&mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            concat!(
                r#"{"at_ms":1764430000123,"request_id":"r-\"1","tenant":"acme","model":"m","#,
                r#""input_tokens":12,"output_tokens":34,"cache_read_tokens":5,"cache_creation_tokens":0,"#,
                r#""usage_missing":0,"status":200,"latency_ms":15,"streamed":1,"sample_weight":100.0}"#,
                "\n"
            )
        );
        let entry: serde_json::Value = serde_json::from_slice(&record().log_entry()).unwrap();
        assert_eq!(entry["output_tokens"], 34);
        assert_eq!(entry["request_id"], "r-\"1");
        assert!(entry.get("sample_weight").is_none());
    }

    #[test]
    fn weights() {
        let mut r = record();
        assert_eq!(r.sample_weight(), 100.0);
        r.rate_bp = 3;
        assert!((r.sample_weight() - 3333.333).abs() < 0.001);
        r.in_sample = false;
        assert_eq!(r.sample_weight(), 0.0);
        r.in_sample = true;
        r.rate_bp = 0;
        assert_eq!(r.sample_weight(), 0.0);
    }
}
