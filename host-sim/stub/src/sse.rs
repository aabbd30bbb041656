//! Server-sent events framing, exactly as the providers frame them: one event
//! per frame, fields `event:` (Anthropic only) and `data:` (one line of compact
//! JSON), each event closed by a blank line.

use bytes::Bytes;
use serde::Serialize;

/// OpenAI's end-of-stream sentinel event.
pub(crate) const DONE: &str = "data: [DONE]\n\n";

/// Frames a named event (Anthropic style): `event: <name>\ndata: <data>\n\n`.
pub(crate) fn event(name: &str, data: &str) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// Frames an unnamed event (OpenAI style): `data: <data>\n\n`.
pub(crate) fn data(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Compact JSON for a response value; it has no raw newline, so it fits on
/// one `data:` line.
pub(crate) fn json<T: Serialize>(value: &T) -> String {
    // The stub's response types are plain strings, numbers, options and
    // vectors, which always serialize; the fallback only keeps this total.
    serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_closed_by_a_blank_line() {
        assert_eq!(
            event("ping", r#"{"type":"ping"}"#),
            Bytes::from_static(b"event: ping\ndata: {\"type\":\"ping\"}\n\n")
        );
        assert_eq!(data("{}"), Bytes::from_static(b"data: {}\n\n"));
        assert_eq!(DONE, "data: [DONE]\n\n");
    }

    #[test]
    fn json_escapes_newlines_onto_one_line() {
        let line = json(&serde_json::json!({"text": "two\nlines"}));
        assert_eq!(line, r#"{"text":"two\nlines"}"#);
        assert!(!line.contains('\n'));
    }
}
