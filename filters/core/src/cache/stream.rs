//! Whether a streamed response completed: only a stream that reached its
//! provider's terminal event (`message_stop`, `data: [DONE]`) without an
//! error event may be cached; an interrupted one never is.
//!
//! An error is an `event: error` (Anthropic), or an event whose data is a
//! JSON object with a non-null top-level `error` member (OpenAI's
//! `data: {"error": …}`) or with `"type": "error"` (Anthropic's payload),
//! however the JSON is spaced or escaped; data that might be one but is not
//! JSON counts as an error too. Any of these anywhere in the stream, before
//! or after the terminal event, means it is not cached.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::sse::SseParser;
use crate::usage::needle::Needle;

use super::key::Provider;

/// Watches a response stream's events as its chunks pass.
#[derive(Debug)]
pub struct StreamCompletion {
    provider: Provider,
    parser: SseParser,
    terminated: bool,
    failed: bool,
}

impl StreamCompletion {
    /// A watcher for a `provider` stream.
    pub fn new(provider: Provider) -> StreamCompletion {
        StreamCompletion {
            provider,
            parser: SseParser::new(),
            terminated: false,
            failed: false,
        }
    }

    /// Feeds the next chunk of the response body.
    pub fn push(&mut self, chunk: &[u8]) {
        let provider = self.provider;
        let (mut terminated, mut failed) = (self.terminated, false);
        self.parser.push(chunk, |event| {
            // An error event, or any event after the terminal one, means the
            // stream is not a clean response.
            if terminated || event.event == b"error" || is_error_data(event.data) {
                failed = true;
            }
            terminated |= match provider {
                Provider::Anthropic => event.event == b"message_stop",
                Provider::OpenAi => event.data == b"[DONE]",
            };
        });
        self.terminated = terminated;
        self.failed |= failed || self.parser.overflowed();
    }

    /// Whether the stream ended cleanly: terminal event seen, no error event.
    pub fn complete(&self) -> bool {
        self.terminated && !self.failed
    }
}

/// The members of an event's data that say it is an error.
#[derive(Deserialize)]
struct ErrorProbe<'a> {
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(default, borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
}

/// Every error payload names `error`, unless the JSON escapes its letters.
const ERROR: Needle = Needle::new(b"error", 0);

/// Whether an event's `data`, or a whole JSON response body, reports a
/// failure (some compatible backends answer 200 with an error body): OpenAI's mid-stream
/// `{"error": …}`, or a payload of `"type": "error"`. Only data that
/// contains `error` or an escape is parsed, so ordinary chunks cost one
/// byte search; of those, data that is not a JSON object (or names a member
/// twice) counts as a failure, since it cannot be told apart from one.
pub fn is_error_data(data: &[u8]) -> bool {
    if ERROR.find(data).is_none() && !data.contains(&b'\\') {
        return false;
    }
    if !data.trim_ascii_start().starts_with(b"{") {
        // A JSON string or array naming `error` is no error object, but no
        // provider sends one either.
        return true;
    }
    match serde_json::from_slice::<ErrorProbe<'_>>(data) {
        Ok(probe) => probe.error.is_some() || probe.kind.as_deref() == Some("error"),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(provider: Provider, chunks: &[&[u8]]) -> bool {
        let mut watch = StreamCompletion::new(provider);
        for chunk in chunks {
            watch.push(chunk);
        }
        watch.complete()
    }

    const ANTHROPIC: &[u8] = b"event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    const OPENAI: &[u8] =
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";

    /// Whether every split of `stream` into two and three chunks gives `expected`.
    fn at_every_split(provider: Provider, stream: &[u8], expected: bool) {
        assert_eq!(complete(provider, &[stream]), expected, "whole");
        for i in 0..=stream.len() {
            let (a, rest) = stream.split_at(i);
            assert_eq!(complete(provider, &[a, rest]), expected, "split at {i}");
            for j in 0..=rest.len() {
                let (b, c) = rest.split_at(j);
                assert_eq!(
                    complete(provider, &[a, b, c]),
                    expected,
                    "split at {i},{}",
                    i + j
                );
            }
        }
    }

    #[test]
    fn every_split_point_gives_the_same_verdict() {
        at_every_split(Provider::Anthropic, ANTHROPIC, true);
        at_every_split(Provider::OpenAi, OPENAI, true);
        at_every_split(Provider::OpenAi, b"data: {\"choices\":[{\"delta\":{\"content\":\"an error\"}}]}\r\n\r\ndata: [DONE]\r\n\r\n", true);
        at_every_split(
            Provider::Anthropic,
            &ANTHROPIC[..ANTHROPIC.len() - 1],
            false,
        );
        at_every_split(Provider::OpenAi, &OPENAI[..OPENAI.len() - 1], false);
        at_every_split(
            Provider::OpenAi,
            b"data: {\"choices\":[]}\n\ndata: { \"error\": {\"message\":\"overloaded\"}}\n\ndata: [DONE]\n\n",
            false,
        );
        at_every_split(
            Provider::Anthropic,
            b"event: message_start\ndata: {}\n\nevent: ping\ndata: {\"type\": \"error\", \"error\": {}}\n\nevent: message_stop\ndata: {}\n\n",
            false,
        );
    }

    #[test]
    fn error_payloads_however_written() {
        for data in [
            &br#"{"error":{"message":"x"}}"#[..],
            br#"{ "error": {"message": "x"}}"#,
            b"{\n  \"error\" : \"x\"\n}",
            br#"{"id":"c1","object":"chat.completion.chunk","error":{"code":500}}"#,
            br#"{"\u0065rror":{"message":"x"}}"#,
            br#"{"type":"error","error":{"type":"overloaded_error"}}"#,
            br#"{"type":"\u0065rror"}"#,
            br#"{"error":null,"error":{"message":"x"}}"#,
            br#"{"error": {"message": "cut"#,
            b"error: not json",
        ] {
            assert!(is_error_data(data), "{}", String::from_utf8_lossy(data));
        }
        for data in [
            &br#"{"choices":[{"delta":{"content":"error"}}]}"#[..],
            br#"{"error":null,"choices":[]}"#,
            br#"{"type":"content_block_delta","delta":{"text":"error"}}"#,
            br#"{"choices":[{"delta":{"content":"a \"quote\""}}]}"#,
            b"[DONE]",
            b"",
        ] {
            assert!(!is_error_data(data), "{}", String::from_utf8_lossy(data));
        }
    }

    #[test]
    fn terminal_events_complete_a_stream() {
        assert!(complete(Provider::Anthropic, &[ANTHROPIC]));
        assert!(complete(Provider::OpenAi, &[OPENAI]));
        let (a, b) = ANTHROPIC.split_at(ANTHROPIC.len() - 5);
        assert!(complete(Provider::Anthropic, &[a, b]));
    }

    #[test]
    fn interrupted_and_failed_streams_are_incomplete() {
        let cut = &ANTHROPIC[..ANTHROPIC.len() - 3];
        assert!(
            !complete(Provider::Anthropic, &[cut]),
            "no blank line after message_stop"
        );
        assert!(!complete(Provider::OpenAi, &[&OPENAI[..40]]));
        assert!(!complete(
            Provider::Anthropic,
            &[b"event: error\ndata: {\"type\":\"error\"}\n\n", ANTHROPIC]
        ));
        assert!(!complete(
            Provider::OpenAi,
            &[
                b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
                OPENAI
            ]
        ));
        // Another provider's terminal event does not count.
        assert!(!complete(Provider::OpenAi, &[ANTHROPIC]));
        assert!(!complete(Provider::Anthropic, &[OPENAI]));
        // Data after the end.
        assert!(!complete(Provider::OpenAi, &[OPENAI, b"data: more\n\n"]));
        let mut joined = OPENAI.to_vec();
        joined.extend_from_slice(b"data: more\n\n");
        assert!(!complete(Provider::OpenAi, &[&joined]));
        assert!(complete(Provider::OpenAi, &[OPENAI, b"\n"]));
    }
}
