//! What the stub's HTTP tests share: a plain HTTP client (ureq), request
//! bodies with hand-counted tokens, and an independent SSE parser
//! (`eventsource-stream`) fed the raw body bytes as they arrive.
#![allow(dead_code)] // each test binary uses a different part

use std::io::Read;
use std::time::{Duration, Instant};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures_util::StreamExt;
use serde_json::{Value, json};
use ureq::Agent;
use ureq::http::Response;

/// Input tokens of [`anthropic`]/[`openai`] conversations, counted by hand:
/// "You are a terse assistant." (5) + "What is the capital of France?" (6)
/// + "Paris, mostly." (2, in a content-block array) + `question` words.
pub const CONVERSATION_TOKENS: u64 = 13;

/// A client that reports HTTP errors as responses and ignores proxy settings.
pub fn agent() -> Agent {
    Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into()
}

/// Like [`agent`], but giving up on any read that waits longer than `timeout`.
pub fn impatient_agent(timeout: Duration) -> Agent {
    Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_per_read(Some(timeout))
        .build()
        .into()
}

/// POSTs `body` as JSON with extra `headers`.
pub fn post(
    agent: &Agent,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Response<ureq::Body>, ureq::Error> {
    let mut request = agent.post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send(body)
}

/// A response header as text ("" when absent).
pub fn header<'a>(response: &'a Response<ureq::Body>, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Reads a whole JSON body.
pub fn json_body(response: Response<ureq::Body>) -> Value {
    let text = response.into_body().read_to_string().unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// An Anthropic Messages request: the shared conversation ending with `question`.
pub fn anthropic(question: &str, max_tokens: u32, stream: bool) -> String {
    json!({
        "model": "claude-stub-1",
        "max_tokens": max_tokens,
        "stream": stream,
        "system": "You are a terse assistant.",
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Paris, mostly."}]},
            {"role": "user", "content": question},
        ],
    })
    .to_string()
}

/// An OpenAI Chat Completions request: the same conversation, with extra
/// top-level fields from `extra` (an object).
pub fn openai(question: &str, extra: Value) -> String {
    let mut body = json!({
        "model": "gpt-stub-1",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Paris, mostly."}]},
            {"role": "user", "content": question},
        ],
    });
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    body.to_string()
}

/// One parsed SSE event and when it was parsed, relative to the request.
#[derive(Debug)]
pub struct Timed {
    pub at: Duration,
    pub event: Event,
}

/// A parsed event stream, and the transport error that ended it, if any.
#[derive(Debug, Default)]
pub struct Streamed {
    pub events: Vec<Timed>,
    pub error: Option<String>,
}

impl Streamed {
    /// The event names, in order (`message` for unnamed events).
    pub fn names(&self) -> Vec<&str> {
        self.events.iter().map(|t| t.event.event.as_str()).collect()
    }

    /// Each event's `data` parsed as JSON (`[DONE]` becomes the string "[DONE]").
    pub fn data(&self) -> Vec<Value> {
        self.events
            .iter()
            .map(|t| match t.event.data.as_str() {
                "[DONE]" => Value::from("[DONE]"),
                data => serde_json::from_str(data)
                    .unwrap_or_else(|e| panic!("event data is not JSON ({e}): {data}")),
            })
            .collect()
    }

    /// The events whose name is `name`.
    pub fn named(&self, name: &str) -> Vec<&Timed> {
        self.events
            .iter()
            .filter(|t| t.event.event == name)
            .collect()
    }
}

/// Parses a response body with `eventsource-stream` while it arrives: a
/// thread reads the socket and hands each chunk to the parser, which stamps
/// every event with the time since `started`.
pub fn read_stream(response: Response<ureq::Body>, started: Instant) -> Streamed {
    let (chunks, mut received) = tokio::sync::mpsc::unbounded_channel::<Result<Vec<u8>, String>>();
    let mut reader = response.into_body().into_reader();
    let reading = std::thread::spawn(move || {
        let mut buffer = vec![0; 16 * 1024];
        loop {
            let chunk = match reader.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => Ok(buffer[..n].to_vec()),
                Err(e) => Err(e.to_string()),
            };
            let failed = chunk.is_err();
            if chunks.send(chunk).is_err() || failed {
                break;
            }
        }
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let streamed = runtime.block_on(async move {
        let mut events =
            futures_util::stream::poll_fn(move |cx| received.poll_recv(cx)).eventsource();
        let mut streamed = Streamed::default();
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => streamed.events.push(Timed {
                    at: started.elapsed(),
                    event,
                }),
                Err(EventStreamError::Transport(error)) => {
                    streamed.error = Some(error);
                    break;
                }
                Err(error) => panic!("not a valid event stream: {error}"),
            }
        }
        streamed
    });
    reading.join().unwrap();
    streamed
}
