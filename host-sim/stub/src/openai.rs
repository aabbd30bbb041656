//! OpenAI Chat Completions (`POST /v1/chat/completions`): request validation,
//! the completion body, the `data:`-only chunk stream ending in `[DONE]`, and
//! the error body, field for field as OpenAI sends them.

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::completion::{self, Completion, Stop};
use crate::provider::{ChatRequest, ErrorKind, Reply, StreamPlan};
use crate::{sse, tokenizer};

const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Validates a Chat Completions request; the error is OpenAI's message text,
/// naming the parameter (`Missing required parameter: 'model'.`).
pub(crate) fn parse(body: &[u8]) -> Result<ChatRequest, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        format!(
            "We could not parse the JSON body of your request. (HINT: This likely means you \
             aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, \
             but what was sent was not valid JSON.) {e}"
        )
    })?;
    let Value::Object(request) = value else {
        return Err(wrong_type("body", "an object", &value));
    };
    let model = match required(&request, "model")? {
        Value::String(model) => model.clone(),
        other => return Err(wrong_type("model", "a string", other)),
    };
    let messages = match required(&request, "messages")? {
        Value::Array(messages) => messages,
        other => return Err(wrong_type("messages", "an array", other)),
    };
    if messages.is_empty() {
        return Err(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, \
                    but got an empty array instead."
                .to_owned(),
        );
    }
    for (i, message) in messages.iter().enumerate() {
        check_message(i, message)?;
    }
    // `max_completion_tokens` supersedes the deprecated `max_tokens`.
    let max_tokens = match limit(&request, "max_completion_tokens")? {
        Some(limit) => Some(limit),
        None => limit(&request, "max_tokens")?,
    };
    let stream = match request.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(other) => return Err(wrong_type("stream", "a boolean", other)),
    };
    let include_usage = match request.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(_) if !stream => {
            return Err(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled."
                    .to_owned(),
            );
        }
        Some(Value::Object(options)) => match options.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(include)) => *include,
            Some(other) => {
                return Err(wrong_type(
                    "stream_options.include_usage",
                    "a boolean",
                    other,
                ));
            }
        },
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    };
    Ok(ChatRequest {
        seed: completion::seed(&model, None, messages, max_tokens),
        input_tokens: tokenizer::count_input(None, messages),
        model,
        max_tokens,
        stream,
        include_usage,
    })
}

fn check_message(i: usize, message: &Value) -> Result<(), String> {
    let field = format!("messages[{i}]");
    let Value::Object(message) = message else {
        return Err(wrong_type(&field, "an object", message));
    };
    let role = match required(message, "role").map_err(|_| missing(&format!("{field}.role")))? {
        Value::String(role) if ROLES.contains(&role.as_str()) => role,
        Value::String(role) => {
            return Err(format!(
                "Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', \
                 'function', 'tool', and 'developer'."
            ));
        }
        other => return Err(wrong_type(&format!("{field}.role"), "a string", other)),
    };
    let field = format!("{field}.content");
    let parts = match message.get("content") {
        // An assistant turn may carry only tool calls.
        None | Some(Value::Null) if role == "assistant" => return Ok(()),
        None => return Err(missing(&field)),
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(wrong_type(
                &field,
                "one of a string or array of objects",
                other,
            ));
        }
    };
    for (j, part) in parts.iter().enumerate() {
        let field = format!("{field}[{j}]");
        let Value::Object(part) = part else {
            return Err(wrong_type(&field, "an object", part));
        };
        match part.get("type") {
            None => return Err(missing(&format!("{field}.type"))),
            Some(Value::String(kind)) if kind == "text" => match part.get("text") {
                None => return Err(missing(&format!("{field}.text"))),
                Some(Value::String(_)) => {}
                Some(other) => return Err(wrong_type(&format!("{field}.text"), "a string", other)),
            },
            Some(Value::String(_)) => {}
            Some(other) => return Err(wrong_type(&format!("{field}.type"), "a string", other)),
        }
    }
    Ok(())
}

/// An optional token limit: null/absent, or an integer ≥ 1.
fn limit(request: &Map<String, Value>, field: &str) -> Result<Option<u32>, String> {
    match request.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n >= 1) => Ok(Some(
            n.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(u32::MAX),
        )),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Err(format!(
            "Invalid '{field}': integer below minimum value. Expected a value >= 1, but got \
             {n} instead."
        )),
        Some(other) => Err(wrong_type(field, "an integer", other)),
    }
}

fn required<'a>(object: &'a Map<String, Value>, field: &str) -> Result<&'a Value, String> {
    object.get(field).ok_or_else(|| missing(field))
}

fn missing(field: &str) -> String {
    format!("Missing required parameter: '{field}'.")
}

fn wrong_type(field: &str, expected: &str, got: &Value) -> String {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    format!("Invalid type for '{field}': expected {expected}, but got {got} instead.")
}

/// The non-streamed `chat.completion` body.
pub(crate) fn completion(reply: &Reply) -> Bytes {
    let text = reply.completion.text();
    Bytes::from(sse::json(&ChatCompletion {
        id: &reply.id,
        object: "chat.completion",
        created: reply.created,
        model: &reply.model,
        choices: [Choice {
            index: 0,
            message: ChoiceMessage {
                role: "assistant",
                content: &text,
            },
            logprobs: None,
            finish_reason: finish_reason(&reply.completion),
        }],
        usage: usage(reply),
    }))
}

/// The stream: a role chunk, one content chunk per token, a chunk with the
/// `finish_reason`, the usage chunk when asked for, then `[DONE]`.
pub(crate) fn stream(reply: &Reply) -> StreamPlan {
    let chunk = |delta: Delta<'_>, finish_reason: Option<&'static str>| {
        sse::data(&sse::json(&ChatCompletionChunk {
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason,
            }],
            // OpenAI sends `"usage": null` on every chunk before the usage
            // chunk, and no `usage` key at all without `include_usage`.
            usage: reply.include_usage.then_some(None),
            ..ChatCompletionChunk::new(reply)
        }))
    };
    let lead = vec![chunk(
        Delta {
            role: Some("assistant"),
            content: Some(""),
        },
        None,
    )];
    let tokens = reply
        .completion
        .pieces
        .iter()
        .map(|piece| {
            chunk(
                Delta {
                    role: None,
                    content: Some(piece),
                },
                None,
            )
        })
        .collect();
    let mut tail = vec![chunk(
        Delta {
            role: None,
            content: None,
        },
        Some(finish_reason(&reply.completion)),
    )];
    if reply.include_usage {
        tail.push(sse::data(&sse::json(&ChatCompletionChunk {
            choices: Vec::new(),
            usage: Some(Some(usage(reply))),
            ..ChatCompletionChunk::new(reply)
        })));
    }
    tail.push(Bytes::from_static(sse::DONE.as_bytes()));
    StreamPlan { lead, tokens, tail }
}

/// `{"error":{"message":…,"type":…,"param":null,"code":…}}`.
pub(crate) fn error(kind: ErrorKind, message: &str) -> Bytes {
    let (kind, code) = match kind {
        ErrorKind::InvalidRequest
        | ErrorKind::NotFound
        | ErrorKind::MethodNotAllowed
        | ErrorKind::TooLarge => ("invalid_request_error", None),
        ErrorKind::RateLimited => ("requests", Some("rate_limit_exceeded")),
        ErrorKind::Internal | ErrorKind::Unavailable => ("server_error", None),
    };
    Bytes::from(sse::json(&ErrorBody {
        error: ErrorDetail {
            message,
            kind,
            param: None,
            code,
        },
    }))
}

fn finish_reason(completion: &Completion) -> &'static str {
    match completion.stop {
        Stop::EndTurn => "stop",
        Stop::MaxTokens => "length",
    }
}

fn usage(reply: &Reply) -> Usage {
    let completion_tokens = reply.completion.tokens();
    Usage {
        prompt_tokens: reply.input_tokens,
        completion_tokens,
        total_tokens: reply.input_tokens.saturating_add(completion_tokens),
    }
}

#[derive(Serialize)]
struct ChatCompletion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    usage: Usage,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: ChoiceMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct ChoiceMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
}

#[derive(Serialize)]
struct ChatCompletionChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice<'a>>,
    /// Absent, `null`, or the usage object (see [`stream`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

impl<'a> ChatCompletionChunk<'a> {
    fn new(reply: &'a Reply) -> Self {
        Self {
            id: &reply.id,
            object: "chat.completion.chunk",
            created: reply.created,
            model: &reply.model,
            choices: Vec::new(),
            usage: None,
        }
    }
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(include_usage: bool) -> Reply {
        Reply {
            id: "chatcmpl-1".into(),
            model: "gpt-test".into(),
            created: 7,
            input_tokens: 3,
            completion: Completion {
                pieces: vec!["Hi".into(), " there.".into()],
                stop: Stop::EndTurn,
            },
            include_usage,
        }
    }

    fn frames(plan: &StreamPlan) -> Vec<String> {
        plan.lead
            .iter()
            .chain(&plan.tokens)
            .chain(&plan.tail)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    #[test]
    fn valid_requests_parse() {
        let request = parse(
            br#"{"model":"gpt-test","max_tokens":9,"stream":true,
                "stream_options":{"include_usage":true},
                "messages":[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hello there"}]},
                {"role":"assistant","content":null,"tool_calls":[]}]}"#,
        )
        .unwrap();
        assert_eq!(request.input_tokens, 4);
        assert_eq!(request.max_tokens, Some(9));
        assert!(request.stream && request.include_usage);

        let newer = parse(
            br#"{"model":"m","max_tokens":9,"max_completion_tokens":4,
                "messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(newer.max_tokens, Some(4));
        assert!(!newer.stream);
    }

    #[test]
    fn invalid_requests_name_the_parameter() {
        let table = [
            ("nope", "We could not parse the JSON body of your request."),
            (
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
                "Missing required parameter: 'model'.",
            ),
            (
                r#"{"model":"m"}"#,
                "Missing required parameter: 'messages'.",
            ),
            (
                r#"{"model":1,"messages":[]}"#,
                "Invalid type for 'model': expected a string, but got an integer instead.",
            ),
            (
                r#"{"model":"m","messages":"x"}"#,
                "Invalid type for 'messages': expected an array, but got a string instead.",
            ),
            (
                r#"{"model":"m","messages":[]}"#,
                "Invalid 'messages': empty array.",
            ),
            (
                r#"{"model":"m","messages":[{"content":"x"}]}"#,
                "Missing required parameter: 'messages[0].role'.",
            ),
            (
                r#"{"model":"m","messages":[{"role":"bot","content":"x"}]}"#,
                "Invalid value: 'bot'.",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                "Invalid type for 'messages[0].content': expected one of a string or array of objects, but got an integer instead.",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "Missing required parameter: 'messages[0].content[0].text'.",
            ),
            (
                r#"{"model":"m","max_tokens":"9","messages":[{"role":"user","content":"x"}]}"#,
                "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
            ),
            (
                r#"{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}"#,
                "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead.",
            ),
            (
                r#"{"model":"m","stream":1,"messages":[{"role":"user","content":"x"}]}"#,
                "Invalid type for 'stream': expected a boolean, but got an integer instead.",
            ),
            (
                r#"{"model":"m","stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}"#,
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ),
        ];
        for (body, message) in table {
            let err = parse(body.as_bytes()).unwrap_err();
            assert!(err.starts_with(message), "{body}: {err}");
        }
    }

    #[test]
    fn completion_body_has_openai_field_order() {
        assert_eq!(
            completion(&reply(false)),
            Bytes::from_static(
                br#"{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"gpt-test","choices":[{"index":0,"message":{"role":"assistant","content":"Hi there."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#
            )
        );
    }

    #[test]
    fn stream_without_usage_has_no_usage_key() {
        let head = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"gpt-test","choices":"#;
        assert_eq!(
            frames(&stream(&reply(false))),
            [
                format!(
                    "{head}[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
                ),
                format!(
                    "{head}[{{\"index\":0,\"delta\":{{\"content\":\"Hi\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
                ),
                format!(
                    "{head}[{{\"index\":0,\"delta\":{{\"content\":\" there.\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
                ),
                format!(
                    "{head}[{{\"index\":0,\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}]}}\n\n"
                ),
                "data: [DONE]\n\n".to_owned(),
            ]
        );
    }

    #[test]
    fn stream_with_usage_ends_with_a_usage_chunk() {
        let frames = frames(&stream(&reply(true)));
        assert_eq!(frames.len(), 6);
        assert!(
            frames[..4]
                .iter()
                .all(|f| f.ends_with(",\"usage\":null}\n\n"))
        );
        assert_eq!(
            frames[4],
            "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"gpt-test\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n"
        );
        assert_eq!(frames[5], "data: [DONE]\n\n");
    }

    #[test]
    fn errors_use_openai_types() {
        assert_eq!(
            error(ErrorKind::InvalidRequest, "bad"),
            Bytes::from_static(
                br#"{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}"#
            )
        );
        assert_eq!(
            error(ErrorKind::RateLimited, "slow"),
            Bytes::from_static(
                br#"{"error":{"message":"slow","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#
            )
        );
    }
}
