//! Anthropic Messages (`POST /v1/messages`): request validation, the message
//! body, the named-event stream and the error body, field for field as
//! Anthropic sends them.

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::completion::{self, Completion, Stop};
use crate::provider::{ChatRequest, ErrorKind, Reply, StreamPlan};
use crate::{sse, tokenizer};

/// Validates a Messages request; the error is Anthropic's message text,
/// naming the field (`max_tokens: Field required`).
pub(crate) fn parse(body: &[u8]) -> Result<ChatRequest, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("There was an error parsing the body of your request: {e}"))?;
    let Value::Object(request) = value else {
        return Err("body: Input should be a valid dictionary".to_owned());
    };
    let model = match required(&request, "model")? {
        Value::String(model) => model.clone(),
        _ => return Err(invalid("model", "a valid string")),
    };
    let messages = match required(&request, "messages")? {
        Value::Array(messages) => messages,
        _ => return Err(invalid("messages", "a valid list")),
    };
    let max_tokens = match required(&request, "max_tokens")? {
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(n), _) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX),
            (_, Some(_)) | (Some(_), _) => {
                return Err(invalid("max_tokens", "greater than or equal to 1"));
            }
            (None, None) => return Err(invalid("max_tokens", "a valid integer")),
        },
        _ => return Err(invalid("max_tokens", "a valid integer")),
    };
    let stream = match request.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err(invalid("stream", "a valid boolean")),
    };
    let system = match request.get("system") {
        None | Some(Value::Null) => None,
        Some(system) => {
            check_content("system", system)?;
            Some(system)
        }
    };
    if messages.is_empty() {
        return Err("messages: at least one message is required".to_owned());
    }
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(invalid(&format!("messages.{i}"), "a valid dictionary"));
        };
        match message.get("role") {
            None => return Err(format!("messages.{i}.role: Field required")),
            Some(Value::String(role)) if role == "user" || role == "assistant" => {}
            Some(_) => {
                return Err(invalid(
                    &format!("messages.{i}.role"),
                    "'user' or 'assistant'",
                ));
            }
        }
        match message.get("content") {
            None => return Err(format!("messages.{i}.content: Field required")),
            Some(content) => check_content(&format!("messages.{i}.content"), content)?,
        }
    }
    Ok(ChatRequest {
        seed: completion::seed(&model, system, messages, Some(max_tokens)),
        input_tokens: tokenizer::count_input(system, messages),
        model,
        max_tokens: Some(max_tokens),
        stream,
        include_usage: false,
    })
}

fn required<'a>(request: &'a Map<String, Value>, field: &str) -> Result<&'a Value, String> {
    request
        .get(field)
        .ok_or_else(|| format!("{field}: Field required"))
}

fn invalid(field: &str, expected: &str) -> String {
    format!("{field}: Input should be {expected}")
}

/// A `system` or message `content`: a string, or a list of blocks, each with
/// a string `type`, text blocks with a string `text`.
fn check_content(field: &str, content: &Value) -> Result<(), String> {
    let blocks = match content {
        Value::String(_) => return Ok(()),
        Value::Array(blocks) => blocks,
        _ => return Err(invalid(field, "a valid string or a valid list")),
    };
    for (j, block) in blocks.iter().enumerate() {
        let Value::Object(block) = block else {
            return Err(invalid(&format!("{field}.{j}"), "a valid dictionary"));
        };
        match block.get("type") {
            None => return Err(format!("{field}.{j}.type: Field required")),
            Some(Value::String(kind)) if kind == "text" => match block.get("text") {
                None => return Err(format!("{field}.{j}.text: Field required")),
                Some(Value::String(_)) => {}
                Some(_) => return Err(invalid(&format!("{field}.{j}.text"), "a valid string")),
            },
            Some(Value::String(_)) => {}
            Some(_) => return Err(invalid(&format!("{field}.{j}.type"), "a valid string")),
        }
    }
    Ok(())
}

/// The non-streamed message body.
pub(crate) fn message(reply: &Reply) -> Bytes {
    let text = reply.completion.text();
    let message = Message {
        content: vec![TextBlock::new(&text)],
        stop_reason: Some(stop_reason(&reply.completion)),
        usage: Usage {
            input_tokens: reply.input_tokens,
            output_tokens: reply.completion.tokens(),
        },
        ..Message::new(reply)
    };
    Bytes::from(sse::json(&message))
}

/// The stream: `message_start`, `content_block_start`, `ping`, one
/// `content_block_delta` per token, `content_block_stop`, `message_delta`,
/// `message_stop`.
pub(crate) fn stream(reply: &Reply) -> StreamPlan {
    let start = Message {
        usage: Usage {
            input_tokens: reply.input_tokens,
            output_tokens: 1,
        },
        ..Message::new(reply)
    };
    let lead = [
        Event::MessageStart { message: start },
        Event::ContentBlockStart {
            index: 0,
            content_block: TextBlock::new(""),
        },
        Event::Ping,
    ];
    let tokens = reply.completion.pieces.iter().map(|piece| {
        Event::ContentBlockDelta {
            index: 0,
            delta: TextDelta {
                kind: "text_delta",
                text: piece,
            },
        }
        .frame()
    });
    let tail = [
        Event::ContentBlockStop { index: 0 },
        Event::MessageDelta {
            delta: MessageDelta {
                stop_reason: stop_reason(&reply.completion),
                stop_sequence: None,
            },
            usage: OutputUsage {
                output_tokens: reply.completion.tokens(),
            },
        },
        Event::MessageStop,
    ];
    StreamPlan {
        lead: lead.iter().map(Event::frame).collect(),
        tokens: tokens.collect(),
        tail: tail.iter().map(Event::frame).collect(),
    }
}

/// `{"type":"error","error":{"type":…,"message":…}}`.
pub(crate) fn error(kind: ErrorKind, message: &str) -> Bytes {
    let kind = match kind {
        ErrorKind::InvalidRequest | ErrorKind::MethodNotAllowed => "invalid_request_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::TooLarge => "request_too_large",
        ErrorKind::RateLimited => "rate_limit_error",
        ErrorKind::Internal => "api_error",
        ErrorKind::Unavailable => "overloaded_error",
    };
    Bytes::from(sse::json(&ErrorBody {
        kind: "error",
        error: ErrorDetail { kind, message },
    }))
}

fn stop_reason(completion: &Completion) -> &'static str {
    match completion.stop {
        Stop::EndTurn => "end_turn",
        Stop::MaxTokens => "max_tokens",
    }
}

#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<TextBlock<'a>>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<&'static str>,
    usage: Usage,
}

impl<'a> Message<'a> {
    /// The message as `message_start` announces it: no content, no stop yet.
    fn new(reply: &'a Reply) -> Self {
        Self {
            id: &reply.id,
            kind: "message",
            role: "assistant",
            model: &reply.model,
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: Usage {
                input_tokens: reply.input_tokens,
                output_tokens: 0,
            },
        }
    }
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

impl<'a> TextBlock<'a> {
    fn new(text: &'a str) -> Self {
        Self { kind: "text", text }
    }
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u32,
    output_tokens: u32,
}

#[derive(Serialize)]
struct OutputUsage {
    output_tokens: u32,
}

#[derive(Serialize)]
struct TextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
struct MessageDelta {
    stop_reason: &'static str,
    stop_sequence: Option<&'static str>,
}

/// A stream event; its `type` is also its SSE event name.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event<'a> {
    MessageStart {
        message: Message<'a>,
    },
    ContentBlockStart {
        index: u32,
        content_block: TextBlock<'a>,
    },
    Ping,
    ContentBlockDelta {
        index: u32,
        delta: TextDelta<'a>,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: OutputUsage,
    },
    MessageStop,
}

impl Event<'_> {
    fn name(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::Ping => "ping",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop => "message_stop",
        }
    }

    fn frame(&self) -> Bytes {
        sse::event(self.name(), &sse::json(self))
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(pieces: &[&str], stop: Stop) -> Reply {
        Reply {
            id: "msg_1".into(),
            model: "claude-test".into(),
            created: 0,
            input_tokens: 4,
            completion: Completion {
                pieces: pieces.iter().map(|p| (*p).to_owned()).collect(),
                stop,
            },
            include_usage: false,
        }
    }

    #[test]
    fn valid_requests_parse() {
        let request = parse(
            br#"{"model":"claude-test","max_tokens":64,"stream":true,"system":"be brief",
                "messages":[{"role":"user","content":[{"type":"text","text":"hello there"},
                {"type":"image","source":{}}]}]}"#,
        )
        .unwrap();
        assert_eq!(request.model, "claude-test");
        assert_eq!(request.input_tokens, 4);
        assert_eq!(request.max_tokens, Some(64));
        assert!(request.stream);
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let ok_messages = r#""messages":[{"role":"user","content":"hi"}]"#;
        let table = [
            ("{", "There was an error parsing the body of your request: "),
            ("[]", "body: Input should be a valid dictionary"),
            (r#"{"max_tokens":5,"messages":[]}"#, "model: Field required"),
            (
                r#"{"model":"m","max_tokens":5}"#,
                "messages: Field required",
            ),
            (
                &format!(r#"{{"model":"m",{ok_messages}}}"#),
                "max_tokens: Field required",
            ),
            (
                &format!(r#"{{"model":7,"max_tokens":5,{ok_messages}}}"#),
                "model: Input should be a valid string",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":"hi"}"#,
                "messages: Input should be a valid list",
            ),
            (
                &format!(r#"{{"model":"m","max_tokens":"5",{ok_messages}}}"#),
                "max_tokens: Input should be a valid integer",
            ),
            (
                &format!(r#"{{"model":"m","max_tokens":0,{ok_messages}}}"#),
                "max_tokens: Input should be greater than or equal to 1",
            ),
            (
                &format!(r#"{{"model":"m","max_tokens":1.5,{ok_messages}}}"#),
                "max_tokens: Input should be a valid integer",
            ),
            (
                &format!(r#"{{"model":"m","max_tokens":5,"stream":"yes",{ok_messages}}}"#),
                "stream: Input should be a valid boolean",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[]}"#,
                "messages: at least one message is required",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"bot","content":"x"}]}"#,
                "messages.0.role: Input should be 'user' or 'assistant'",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"user"}]}"#,
                "messages.0.content: Field required",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "messages.0.content.0.text: Field required",
            ),
            (
                &format!(r#"{{"model":"m","max_tokens":5,"system":3,{ok_messages}}}"#),
                "system: Input should be a valid string or a valid list",
            ),
        ];
        for (body, message) in table {
            let err = parse(body.as_bytes()).unwrap_err();
            assert!(err.starts_with(message), "{body}: {err}");
        }
    }

    #[test]
    fn message_body_has_anthropic_field_order() {
        let body = message(&reply(&["Hello", " world."], Stop::EndTurn));
        assert_eq!(
            body,
            Bytes::from_static(
                br#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-test","content":[{"type":"text","text":"Hello world."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":4,"output_tokens":2}}"#
            )
        );
    }

    #[test]
    fn stream_frames_every_event() {
        let plan = stream(&reply(&["Hello", " world"], Stop::MaxTokens));
        let text: Vec<String> = plan
            .lead
            .iter()
            .chain(&plan.tokens)
            .chain(&plan.tail)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        assert_eq!(
            text,
            [
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-test\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":4,\"output_tokens\":1}}}\n\n",
                "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
                "event: ping\ndata: {\"type\":\"ping\"}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" world\"}}\n\n",
                "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":2}}\n\n",
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            ]
        );
    }

    #[test]
    fn errors_use_anthropic_types() {
        assert_eq!(
            error(ErrorKind::RateLimited, "slow down"),
            Bytes::from_static(
                br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#
            )
        );
    }
}
