//! Both APIs, streamed and not, over real HTTP: status, headers, body shape,
//! the exact event sequence and usage that matches the tokens sent; then the
//! provider-shaped 400/404/405 answers.

mod support;

use std::time::Instant;

use serde_json::{Value, json};
use support::{
    CONVERSATION_TOKENS, agent, anthropic, header, json_body, openai, post, read_stream,
};
use zerolayer_stub::{Stub, StubConfig};

const QUESTION: &str = "Are you sure?"; // 3 tokens
const INPUT_TOKENS: u64 = CONVERSATION_TOKENS + 3;

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

#[test]
fn anthropic_message_has_the_provider_shape() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let response = post(&agent(), &url, &[], &anthropic(QUESTION, 1024, false)).unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "content-type"), "application/json");
    assert!(header(&response, "request-id").starts_with("msg_"));
    let body = json_body(response);
    assert_eq!(
        keys(&body),
        [
            "content",
            "id",
            "model",
            "role",
            "stop_reason",
            "stop_sequence",
            "type",
            "usage"
        ]
    );
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "claude-stub-1");
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(body["stop_sequence"], Value::Null);
    let content = body["content"].as_array().unwrap();
    assert_eq!(content.len(), 1);
    assert_eq!(content[0]["type"], "text");
    let text = content[0]["text"].as_str().unwrap();
    assert!((8..=40).contains(&words(text)), "{text}");
    assert_eq!(
        body["usage"],
        json!({"input_tokens": INPUT_TOKENS, "output_tokens": words(text)})
    );
}

#[test]
fn anthropic_stream_has_the_exact_event_sequence_and_usage() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let whole = json_body(post(&agent(), &url, &[], &anthropic(QUESTION, 1024, false)).unwrap());

    let response = post(&agent(), &url, &[], &anthropic(QUESTION, 1024, true)).unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "content-type"), "text/event-stream");
    let streamed = read_stream(response, Instant::now());
    assert_eq!(streamed.error, None);

    let deltas = streamed.named("content_block_delta").len();
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(std::iter::repeat_n("content_block_delta", deltas));
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(streamed.names(), expected);

    let data = streamed.data();
    for (name, data) in streamed.names().iter().zip(&data) {
        assert_eq!(data["type"], *name, "data type matches the event name");
    }
    let start = &data[0]["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(
        start["usage"],
        json!({"input_tokens": INPUT_TOKENS, "output_tokens": 1})
    );
    assert_eq!(
        data[1],
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    assert_eq!(data[2], json!({"type": "ping"}));

    let text: String = data[3..3 + deltas]
        .iter()
        .map(|d| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(words(&text), deltas as u64, "one word per delta");
    assert_eq!(
        text, whole["content"][0]["text"],
        "same text as non-streamed"
    );

    let [stop, delta, message_stop] = &data[3 + deltas..] else {
        panic!("three terminal events");
    };
    assert_eq!(*stop, json!({"type": "content_block_stop", "index": 0}));
    assert_eq!(
        *delta,
        json!({
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"output_tokens": deltas},
        })
    );
    assert_eq!(*message_stop, json!({"type": "message_stop"}));
}

#[test]
fn openai_completion_has_the_provider_shape() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let response = post(&agent(), &url, &[], &openai(QUESTION, json!({}))).unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "content-type"), "application/json");
    assert!(header(&response, "x-request-id").starts_with("chatcmpl-"));
    let body = json_body(response);
    assert_eq!(
        keys(&body),
        ["choices", "created", "id", "model", "object", "usage"]
    );
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(body["model"], "gpt-stub-1");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["finish_reason"], "stop");
    assert_eq!(choices[0]["message"]["role"], "assistant");
    let text = choices[0]["message"]["content"].as_str().unwrap();
    let output = words(text);
    assert!((8..=40).contains(&output), "{text}");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": INPUT_TOKENS, "completion_tokens": output, "total_tokens": INPUT_TOKENS + output})
    );
}

/// Checks an OpenAI stream up to the finish chunk; returns the chunks after it.
fn check_openai_chunks(data: &[Value], include_usage: bool) -> (String, usize, &[Value]) {
    let finish = data
        .iter()
        .position(|d| d["choices"][0]["finish_reason"].is_string())
        .expect("a chunk with a finish_reason");
    for chunk in &data[..=finish] {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], data[0]["id"]);
        assert_eq!(chunk["model"], "gpt-stub-1");
        assert_eq!(chunk["choices"].as_array().unwrap().len(), 1);
        let usage = chunk.get("usage");
        if include_usage {
            assert_eq!(
                usage,
                Some(&Value::Null),
                "usage: null before the usage chunk"
            );
        } else {
            assert_eq!(usage, None, "no usage key without include_usage");
        }
    }
    assert_eq!(
        data[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let tokens = &data[1..finish];
    let text: String = tokens
        .iter()
        .map(|chunk| {
            let choice = &chunk["choices"][0];
            assert_eq!(choice["finish_reason"], Value::Null);
            assert_eq!(keys(&choice["delta"]), ["content"]);
            choice["delta"]["content"].as_str().unwrap()
        })
        .collect();
    assert_eq!(words(&text), tokens.len() as u64, "one word per chunk");
    assert_eq!(data[finish]["choices"][0]["delta"], json!({}));
    assert_eq!(data[finish]["choices"][0]["finish_reason"], "stop");
    (text, tokens.len(), &data[finish + 1..])
}

#[test]
fn openai_stream_without_include_usage_has_no_usage_chunk() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let whole = json_body(post(&agent(), &url, &[], &openai(QUESTION, json!({}))).unwrap());

    let body = openai(QUESTION, json!({"stream": true}));
    let response = post(&agent(), &url, &[], &body).unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "content-type"), "text/event-stream");
    let streamed = read_stream(response, Instant::now());
    assert_eq!(streamed.error, None);
    assert!(streamed.names().iter().all(|name| *name == "message"));

    let data = streamed.data();
    let (text, _, rest) = check_openai_chunks(&data, false);
    assert_eq!(text, whole["choices"][0]["message"]["content"]);
    assert_eq!(
        rest,
        [json!("[DONE]")],
        "[DONE] right after the finish chunk"
    );
}

#[test]
fn openai_stream_with_include_usage_ends_with_the_usage_chunk() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let body = openai(
        QUESTION,
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let streamed = read_stream(post(&agent(), &url, &[], &body).unwrap(), Instant::now());
    assert_eq!(streamed.error, None);

    let data = streamed.data();
    let (_, tokens, rest) = check_openai_chunks(&data, true);
    let [usage, done] = rest else {
        panic!("a usage chunk then [DONE], got {rest:?}");
    };
    assert_eq!(usage["object"], "chat.completion.chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": INPUT_TOKENS, "completion_tokens": tokens, "total_tokens": INPUT_TOKENS + tokens as u64})
    );
    assert_eq!(*done, json!("[DONE]"));
}

#[test]
fn malformed_anthropic_requests_get_400_with_the_error_shape() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let messages = r#""messages":[{"role":"user","content":"hi"}]"#;
    let table = [
        (
            r#"{"model":"m","max_tokens":5}"#.to_owned(),
            "messages: Field required",
        ),
        (
            format!(r#"{{"max_tokens":5,{messages}}}"#),
            "model: Field required",
        ),
        (
            format!(r#"{{"model":"m",{messages}}}"#),
            "max_tokens: Field required",
        ),
        (
            format!(r#"{{"model":"m","max_tokens":"lots",{messages}}}"#),
            "max_tokens: Input should be a valid integer",
        ),
        (
            r#"{"model":"m","max_tokens":5,"messages":{"role":"user"}}"#.to_owned(),
            "messages: Input should be a valid list",
        ),
        (
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":7}]}"#.to_owned(),
            "messages.0.content: Input should be a valid string or a valid list",
        ),
    ];
    for (body, message) in table {
        let response = post(&agent(), &url, &[], &body).unwrap();
        assert_eq!(response.status(), 400, "{body}");
        assert_eq!(header(&response, "content-type"), "application/json");
        assert_eq!(
            json_body(response),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}),
            "{body}"
        );
    }

    let response = post(&agent(), &url, &[], "{not json").unwrap();
    assert_eq!(response.status(), 400);
    let body = json_body(response);
    assert_eq!(keys(&body), ["error", "type"]);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("parsing the body")
    );
}

#[test]
fn malformed_openai_requests_get_400_with_the_error_shape() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let table = [
        (
            r#"{"messages":[{"role":"user","content":"hi"}]}"#,
            "Missing required parameter: 'model'.",
        ),
        (
            r#"{"model":"m"}"#,
            "Missing required parameter: 'messages'.",
        ),
        (
            r#"{"model":"m","messages":"hi"}"#,
            "Invalid type for 'messages': expected an array, but got a string instead.",
        ),
        (
            r#"{"model":"m","max_tokens":"9","messages":[{"role":"user","content":"hi"}]}"#,
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
        ),
        (
            r#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"hi"}]}"#,
            "Invalid type for 'stream': expected a boolean, but got a string instead.",
        ),
    ];
    for (body, message) in table {
        let response = post(&agent(), &url, &[], body).unwrap();
        assert_eq!(response.status(), 400, "{body}");
        assert_eq!(
            json_body(response),
            json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}}),
            "{body}"
        );
    }

    let response = post(&agent(), &url, &[], "[1,").unwrap();
    assert_eq!(response.status(), 400);
    let body = json_body(response);
    assert_eq!(keys(&body["error"]), ["code", "message", "param", "type"]);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("We could not parse the JSON body of your request.")
    );
}

#[test]
fn unknown_paths_get_404_in_the_clients_dialect() {
    let stub = Stub::start(StubConfig::default()).unwrap();

    let response = post(
        &agent(),
        &format!("{}/v1/embeddings", stub.url()),
        &[],
        "{}",
    )
    .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(
        json_body(response),
        json!({"error": {"message": "Invalid URL (POST /v1/embeddings)", "type": "invalid_request_error", "param": null, "code": null}})
    );

    let response = post(
        &agent(),
        &format!("{}/v1/complete", stub.url()),
        &[("anthropic-version", "2023-06-01")],
        "{}",
    )
    .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(
        json_body(response),
        json!({"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}})
    );
}

#[test]
fn get_on_a_route_is_405() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let response = agent()
        .get(format!("{}/v1/messages", stub.url()))
        .call()
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(header(&response, "allow"), "POST");
    let body = json_body(response);
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

#[test]
fn a_bad_override_header_is_400_naming_it() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let body = anthropic(QUESTION, 64, false);
    let response = post(&agent(), &url, &[("x-stub-ttft-ms", "soon")], &body).unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(
        json_body(response),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "x-stub-ttft-ms: expected a non-negative integer, got \"soon\""}})
    );
}
