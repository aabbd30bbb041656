//! Reading a server-sent-event stream as it arrives, with arrival times, for
//! tests that check framing, usage and that proxies pass events on one by
//! one.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub name: Option<String>,
    /// The `data:` field (lines joined with `\n`).
    pub data: String,
    /// When it had fully arrived, since the request was sent.
    pub at: Duration,
}

impl SseEvent {
    /// The data parsed as JSON.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.data).with_context(|| format!("event data {:?}", self.data))
    }
}

/// A response read event by event.
#[derive(Debug, Clone)]
pub struct SseReply {
    /// HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: String,
    /// The events (empty when the status is not 200).
    pub events: Vec<SseEvent>,
    /// The body, when the status is not 200.
    pub error_body: String,
}

impl SseReply {
    /// Time between the first and the last event's arrival.
    pub fn spread(&self) -> Duration {
        match (self.events.first(), self.events.last()) {
            (Some(a), Some(b)) => b.at.saturating_sub(a.at),
            _ => Duration::ZERO,
        }
    }

    /// Names of the events, `""` for unnamed ones.
    pub fn names(&self) -> Vec<String> {
        self.events
            .iter()
            .map(|e| e.name.clone().unwrap_or_default())
            .collect()
    }
}

/// POSTs `body` (JSON) and reads the reply's SSE stream as it arrives.
pub fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Result<SseReply> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let mut request = agent.post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let sent = Instant::now();
    let response = request
        .send(body.to_string())
        .with_context(|| format!("POST {url}"))?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut reader = BufReader::new(response.into_body().into_reader());
    if status != 200 {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut reader, &mut text)?;
        return Ok(SseReply {
            status,
            content_type,
            events: vec![],
            error_body: text,
        });
    }
    let (mut events, mut name, mut data) = (vec![], None, Vec::<String>::new());
    let mut line = String::new();
    loop {
        line.clear();
        let eof = reader.read_line(&mut line)? == 0;
        let text = line.trim_end_matches(['\r', '\n']);
        if eof || text.is_empty() {
            if !data.is_empty() {
                events.push(SseEvent {
                    name: name.take(),
                    data: data.join("\n"),
                    at: sent.elapsed(),
                });
                data.clear();
            }
            if eof {
                return Ok(SseReply {
                    status,
                    content_type,
                    events,
                    error_body: String::new(),
                });
            }
        } else if let Some(v) = text.strip_prefix("data:") {
            data.push(v.trim_start().to_string());
        } else if let Some(v) = text.strip_prefix("event:") {
            name = Some(v.trim_start().to_string());
        } else if !text.starts_with(':') {
            bail!("unexpected SSE line {text:?}");
        }
    }
}
