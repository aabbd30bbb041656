//! Recorded traffic for `host-sim replay`: one JSON object per line.
//!
//! ```json
//! {"at_ms": 0, "method": "POST", "path": "/v1/messages",
//!  "headers": [["x-api-key", "k"], ["content-type", "application/json"]],
//!  "body": "{\"model\": \"m\", ...}",
//!  "response": {"status": 200, "headers": [["content-type", "application/json"]], "body": "..."}}
//! ```
//!
//! Headers are `[name, value]` pairs (lower-case names, order and repeats
//! kept). `at_ms` is the arrival offset from the recording's start; `body` is UTF-8
//! text (`body_base64` for other bytes); `response` is optional and lets
//! `--upstream recorded` answer without a backend. Importers turn Envoy's
//! JSON access log and HAR files into this format.

use std::io::BufRead;

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// One recorded request (and, optionally, the response it got).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficRecord {
    /// Arrival offset from the recording's start, milliseconds.
    #[serde(default)]
    pub at_ms: f64,
    /// HTTP method.
    pub method: String,
    /// Path with query string.
    pub path: String,
    /// Request headers (lower-case names; no pseudo-headers, no `host`).
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Request body as UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// Request body, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    /// The response recorded with the request, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<RecordedResponse>,
}

/// A response recorded with its request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedResponse {
    /// Status code.
    pub status: u16,
    /// Response headers.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Body as UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// Body, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

impl TrafficRecord {
    /// The request body's bytes.
    pub fn body_bytes(&self) -> Result<Vec<u8>> {
        body_bytes(self.body.as_deref(), self.body_base64.as_deref())
    }

    /// The value of header `name` (lower case), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl RecordedResponse {
    /// The response body's bytes.
    pub fn body_bytes(&self) -> Result<Vec<u8>> {
        body_bytes(self.body.as_deref(), self.body_base64.as_deref())
    }
}

fn body_bytes(text: Option<&str>, base64: Option<&str>) -> Result<Vec<u8>> {
    match (text, base64) {
        (Some(_), Some(_)) => bail!("give one of body and body_base64"),
        (Some(text), None) => Ok(text.as_bytes().to_vec()),
        (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|err| anyhow::anyhow!("body_base64 is not base64: {err}")),
        (None, None) => Ok(Vec::new()),
    }
}

/// Headers a replay must not copy besides the hop-by-hop ones: the
/// connection's own, and the ones the client recomputes for the body it sends.
const NOT_REPLAYED: [&str; 4] = ["host", "trailer", "content-length", "expect"];

/// Whether a recorded header is replayed as it is.
pub fn replayable_header(name: &str) -> bool {
    !name.starts_with(':')
        && !NOT_REPLAYED.contains(&name)
        && !crate::serve::HOP_BY_HOP.contains(&name)
}

/// Reads a traffic file, checking each line; errors name the line.
pub fn read(reader: impl BufRead) -> Result<Vec<TrafficRecord>> {
    let mut out = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let record: TrafficRecord = serde_json::from_str(&line)
            .with_context(|| format!("line {}: not a traffic record", index + 1))?;
        check(&record).with_context(|| format!("line {}", index + 1))?;
        out.push(record);
    }
    Ok(out)
}

fn check(record: &TrafficRecord) -> Result<()> {
    if !record.at_ms.is_finite() || record.at_ms < 0.0 {
        bail!("at_ms: a number of milliseconds >= 0, not {}", record.at_ms);
    }
    if record.method.is_empty() || !record.method.bytes().all(|b| b.is_ascii_alphabetic()) {
        bail!("method: not an HTTP method: {:?}", record.method);
    }
    if !record.path.starts_with('/') {
        bail!("path: must start with '/': {:?}", record.path);
    }
    for (name, _) in &record.headers {
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_uppercase() || b <= b' ') {
            bail!("headers: names are lower-case tokens, not {name:?}");
        }
    }
    record.body_bytes()?;
    if let Some(response) = &record.response {
        response.body_bytes().context("response")?;
    }
    Ok(())
}

/// Writes records as JSON Lines.
pub fn write(records: &[TrafficRecord]) -> Result<String> {
    let mut out = String::new();
    for record in records {
        out.push_str(&serde_json::to_string(record)?);
        out.push('\n');
    }
    Ok(out)
}

/// Sorts by arrival and makes the first arrival offset 0.
fn rebase(mut records: Vec<(Option<i128>, TrafficRecord)>) -> Vec<TrafficRecord> {
    let start = records.iter().filter_map(|(t, _)| *t).min();
    for (t, record) in &mut records {
        // Differences in integer nanoseconds: an f64 of nanoseconds since
        // the epoch would round away the sub-millisecond part.
        record.at_ms = match (t, start) {
            (Some(t), Some(start)) => (*t - start) as f64 / 1e6,
            _ => 0.0,
        };
    }
    // Stable: records with the same time (or none) keep their order.
    records.sort_by(|a, b| a.1.at_ms.total_cmp(&b.1.at_ms));
    records.into_iter().map(|(_, r)| r).collect()
}

fn unix_ns(text: &str) -> Result<i128> {
    let time = OffsetDateTime::parse(text, &Rfc3339)
        .with_context(|| format!("not an RFC 3339 time: {text:?}"))?;
    Ok(time.unix_timestamp_nanos())
}

/// Imports Envoy's JSON access log (`json_format`). Read keys: `method`,
/// `path`, `start_time` (`%START_TIME%`, RFC 3339), `request_id`,
/// `authority`, `headers` (an object of request headers, e.g.
/// `{"x-tenant-id": "%REQ(X-TENANT-ID)%"}`), `request_body`, and `status` as
/// the recorded response's status. Other keys are ignored; null and `-`
/// values count as absent. Returns the records and how many had no body.
pub fn import_envoy_access_log(reader: impl BufRead) -> Result<(Vec<TrafficRecord>, usize)> {
    let mut records = Vec::new();
    let mut without_body = 0;
    for (index, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let context = || format!("access log line {}", index + 1);
        let entry: Value = serde_json::from_str(&line).with_context(context)?;
        let field = |name: &str| -> Option<String> {
            match entry.get(name) {
                Some(Value::String(s)) if s != "-" && !s.is_empty() => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            }
        };
        let method = field("method").with_context(|| format!("{}: no method", context()))?;
        let path = field("path").with_context(|| format!("{}: no path", context()))?;
        let mut headers = Vec::new();
        if let Some(Value::Object(map)) = entry.get("headers") {
            for (name, value) in map {
                let name = name.to_ascii_lowercase();
                if let Value::String(value) = value
                    && value != "-"
                    && replayable_header(&name)
                {
                    headers.push((name, value.clone()));
                }
            }
        }
        if let Some(authority) = field("authority") {
            headers.retain(|(k, _)| k != ":authority");
            headers.push(("x-forwarded-host".into(), authority));
        }
        if let Some(id) = field("request_id") {
            headers.retain(|(k, _)| k != "x-request-id");
            headers.push(("x-request-id".into(), id));
        }
        let body = field("request_body");
        if body.is_none() && method != "GET" && method != "HEAD" {
            without_body += 1;
        }
        let at = field("start_time")
            .map(|t| unix_ns(&t))
            .transpose()
            .with_context(context)?;
        let response = field("status")
            .and_then(|s| s.parse::<u16>().ok())
            .map(|status| RecordedResponse {
                status,
                headers: Vec::new(),
                body: None,
                body_base64: None,
            });
        let record = TrafficRecord {
            at_ms: 0.0,
            method,
            path,
            headers,
            body,
            body_base64: None,
            response,
        };
        check(&record).with_context(context)?;
        records.push((at, record));
    }
    Ok((rebase(records), without_body))
}

#[derive(Deserialize)]
struct Har {
    log: HarLog,
}

#[derive(Deserialize)]
struct HarLog {
    entries: Vec<HarEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HarEntry {
    started_date_time: String,
    request: HarRequest,
    response: Option<HarResponse>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HarRequest {
    method: String,
    url: String,
    #[serde(default)]
    headers: Vec<HarHeader>,
    post_data: Option<HarPostData>,
}

#[derive(Deserialize)]
struct HarHeader {
    name: String,
    value: String,
}

#[derive(Deserialize)]
struct HarPostData {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct HarResponse {
    status: i64,
    #[serde(default)]
    headers: Vec<HarHeader>,
    content: Option<HarContent>,
}

#[derive(Deserialize)]
struct HarContent {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    encoding: Option<String>,
}

fn har_headers(headers: &[HarHeader]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.clone()))
        .filter(|(name, _)| replayable_header(name))
        .collect()
}

/// Imports a HAR 1.2 file (browser dev tools, proxies): every entry's
/// method, path, headers, text body and arrival time, and its response
/// (status, headers, text or base64 content) as the recorded response.
pub fn import_har(text: &str) -> Result<Vec<TrafficRecord>> {
    let har: Har = serde_json::from_str(text).context("not a HAR file (log.entries)")?;
    let mut records = Vec::new();
    for (index, entry) in har.log.entries.into_iter().enumerate() {
        let context = || format!("HAR entry {index}");
        let path = path_of_url(&entry.request.url)
            .with_context(|| format!("{}: url {:?}", context(), entry.request.url))?;
        let response = match entry.response {
            // Browsers record requests that never got an answer as status 0.
            Some(r) if (100..=999).contains(&r.status) => {
                let (body, body_base64) = match r.content {
                    Some(HarContent {
                        text: Some(text),
                        encoding: Some(encoding),
                    }) if encoding == "base64" => (None, Some(text)),
                    Some(HarContent { text, .. }) => (text, None),
                    None => (None, None),
                };
                Some(RecordedResponse {
                    status: r.status as u16,
                    headers: har_headers(&r.headers),
                    body,
                    body_base64,
                })
            }
            _ => None,
        };
        let record = TrafficRecord {
            at_ms: 0.0,
            method: entry.request.method.to_ascii_uppercase(),
            path,
            headers: har_headers(&entry.request.headers),
            body: entry.request.post_data.and_then(|p| p.text),
            body_base64: None,
            response,
        };
        check(&record).with_context(context)?;
        let at = unix_ns(&entry.started_date_time).with_context(context)?;
        records.push((Some(at), record));
    }
    Ok(rebase(records))
}

/// `http://host:port/p?q` → `/p?q`.
fn path_of_url(url: &str) -> Option<String> {
    let rest = url.split_once("://").map(|(_, rest)| rest)?;
    let path = match rest.find('/') {
        Some(at) => &rest[at..],
        None => "/",
    };
    // A fragment never reaches the server.
    Some(path.split('#').next().unwrap_or(path).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_lines_name_their_line() {
        let record = TrafficRecord {
            at_ms: 12.5,
            method: "POST".into(),
            path: "/v1/messages".into(),
            headers: vec![("x-api-key".into(), "k".into())],
            body: Some("{}".into()),
            body_base64: None,
            response: None,
        };
        let text = write(std::slice::from_ref(&record)).unwrap();
        assert_eq!(read(text.as_bytes()).unwrap(), vec![record]);

        let bad = "{\"method\":\"GET\",\"path\":\"/\"}\n{\"method\":\"GET\",\"path\":\"nope\"}\n";
        let err = format!("{:#}", read(bad.as_bytes()).unwrap_err());
        assert!(err.contains("line 2") && err.contains("path"), "{err}");
        let err = format!(
            "{:#}",
            read("{\"method\":\"GET\",\"path\":\"/\",\"extra\":1}".as_bytes()).unwrap_err()
        );
        assert!(err.contains("line 1") && err.contains("extra"), "{err}");
        let err = format!(
            "{:#}",
            read("{\"method\":\"GET\",\"path\":\"/\",\"headers\":[[\"X-A\",\"1\"]]}".as_bytes())
                .unwrap_err()
        );
        assert!(err.contains("lower-case"), "{err}");
    }

    #[test]
    fn envoy_access_log_import_keeps_order_ids_headers_and_gaps() {
        let log = concat!(
            r#"{"start_time":"2026-11-29T12:00:01.500Z","method":"POST","path":"/v1/messages","request_id":"r2","status":"200","headers":{"x-tenant-id":"acme","authorization":"-"},"request_body":"{}"}"#,
            "\n",
            r#"{"start_time":"2026-11-29T12:00:00.250Z","method":"GET","path":"/healthz","request_id":"r1","status":200,"usage":null}"#,
            "\n",
            r#"{"start_time":"2026-11-29T12:00:02.250Z","method":"POST","path":"/v1/messages","request_id":null}"#,
            "\n",
        );
        let (records, without_body) = import_envoy_access_log(log.as_bytes()).unwrap();
        assert_eq!(without_body, 1);
        let ids: Vec<_> = records.iter().map(|r| r.header("x-request-id")).collect();
        assert_eq!(ids, vec![Some("r1"), Some("r2"), None]);
        let at: Vec<_> = records.iter().map(|r| r.at_ms).collect();
        assert_eq!(at, vec![0.0, 1250.0, 2000.0]);
        assert_eq!(records[1].header("x-tenant-id"), Some("acme"));
        assert_eq!(records[1].header("authorization"), None);
        assert_eq!(records[1].body.as_deref(), Some("{}"));
        assert_eq!(records[0].response.as_ref().map(|r| r.status), Some(200));

        let err = import_envoy_access_log("{\"path\":\"/\"}".as_bytes()).unwrap_err();
        assert!(format!("{err:#}").contains("line 1: no method"), "{err:#}");
    }

    #[test]
    fn har_import_reads_requests_responses_and_times() {
        let har = r#"{"log":{"version":"1.2","entries":[
          {"startedDateTime":"2026-11-29T13:00:00.100+01:00",
           "request":{"method":"post","url":"https://api.example/v1/chat/completions?x=1#frag",
             "headers":[{"name":":authority","value":"api.example"},{"name":"Authorization","value":"Bearer t"},{"name":"Content-Length","value":"2"}],
             "postData":{"mimeType":"application/json","text":"{}"}},
           "response":{"status":200,"headers":[{"name":"Content-Type","value":"application/json"}],
             "content":{"size":2,"text":"e30=","encoding":"base64"}}},
          {"startedDateTime":"2026-11-29T12:00:00.000Z",
           "request":{"method":"GET","url":"http://h/healthz","headers":[]},
           "response":{"status":0,"headers":[],"content":{"size":0}}}]}}"#;
        let records = import_har(har).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].path, "/healthz");
        assert_eq!(records[0].response, None);
        let chat = &records[1];
        assert_eq!(chat.at_ms, 100.0);
        assert_eq!(chat.method, "POST");
        assert_eq!(chat.path, "/v1/chat/completions?x=1");
        assert_eq!(
            chat.headers,
            vec![("authorization".into(), "Bearer t".into())]
        );
        let response = chat.response.as_ref().unwrap();
        assert_eq!(response.body_bytes().unwrap(), b"{}");
        assert_eq!(response.headers[0].0, "content-type");
        assert!(import_har("{}").is_err());
    }
}
