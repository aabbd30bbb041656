//! Faults on demand, over real HTTP: provider-shaped 429/500/503 with
//! `Retry-After`, streams cut after n tokens, and streams that stall.

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{agent, anthropic, header, impatient_agent, json_body, openai, post, read_stream};
use zerolayer_stub::{Fault, Stub, StubConfig};

const QUESTION: &str = "Are you sure?";

#[test]
fn status_faults_use_each_providers_error_shape() {
    let stub = Stub::start(StubConfig::default().retry_after_secs(7)).unwrap();
    let messages = format!("{}/v1/messages", stub.url());
    let chat = format!("{}/v1/chat/completions", stub.url());
    let table = [
        (
            "429",
            429,
            "7",
            "rate_limit_error",
            "requests",
            json!("rate_limit_exceeded"),
        ),
        ("500", 500, "", "api_error", "server_error", json!(null)),
        (
            "503",
            503,
            "7",
            "overloaded_error",
            "server_error",
            json!(null),
        ),
    ];
    for (fault, status, retry_after, anthropic_type, openai_type, openai_code) in table {
        let headers = [("x-stub-fault", fault)];
        let response = post(
            &agent(),
            &messages,
            &headers,
            &anthropic(QUESTION, 64, true),
        )
        .unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(header(&response, "retry-after"), retry_after, "{fault}");
        assert_eq!(header(&response, "content-type"), "application/json");
        let body = json_body(response);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], anthropic_type);
        assert!(body["error"]["message"].as_str().unwrap().contains(fault));

        let response = post(&agent(), &chat, &headers, &openai(QUESTION, json!({}))).unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(header(&response, "retry-after"), retry_after, "{fault}");
        let body = json_body(response);
        assert_eq!(body["error"]["type"], openai_type);
        assert_eq!(body["error"]["param"], json!(null));
        assert_eq!(body["error"]["code"], openai_code);
    }
    assert_eq!(
        stub.served("/v1/messages"),
        3,
        "faults still count as served"
    );
}

#[test]
fn a_configured_fault_applies_unless_the_request_says_none() {
    let stub = Stub::start(StubConfig::default().fault(Some(Fault::Unavailable))).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let body = anthropic(QUESTION, 64, false);

    let response = post(&agent(), &url, &[], &body).unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(header(&response, "retry-after"), "1");

    let response = post(&agent(), &url, &[("x-stub-fault", "none")], &body).unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn an_unknown_fault_is_400() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let headers = [("x-stub-fault", "explode")];
    let response = post(&agent(), &url, &headers, &openai(QUESTION, json!({}))).unwrap();
    assert_eq!(response.status(), 400);
    let message = json_body(response)["error"]["message"].clone();
    assert!(
        message
            .as_str()
            .unwrap()
            .starts_with("x-stub-fault: fault \"explode\"")
    );
}

#[test]
fn disconnect_after_3_cuts_an_anthropic_stream_after_3_deltas() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let headers = [("x-stub-fault", "disconnect-after:3")];
    let response = post(&agent(), &url, &headers, &anthropic(QUESTION, 1024, true)).unwrap();
    assert_eq!(response.status(), 200);
    let streamed = read_stream(response, Instant::now());

    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(["content_block_delta"; 3]);
    assert_eq!(streamed.names(), expected, "no terminal events");
    // The chunked body ends without its terminating chunk: the client sees
    // the connection drop, not a complete stream.
    assert!(streamed.error.is_some(), "the client sees the cut");
}

#[test]
fn disconnect_after_3_cuts_an_openai_stream_before_done() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let headers = [("x-stub-fault", "disconnect-after:3")];
    let body = openai(
        QUESTION,
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let streamed = read_stream(
        post(&agent(), &url, &headers, &body).unwrap(),
        Instant::now(),
    );

    let data = streamed.data();
    assert_eq!(data.len(), 4, "the role chunk and 3 tokens: {data:?}");
    assert!(
        data.iter()
            .all(|d| d["choices"][0]["finish_reason"].is_null())
    );
    assert!(!streamed.events.iter().any(|t| t.event.data == "[DONE]"));
    assert!(streamed.error.is_some(), "the client sees the cut");
}

#[test]
fn disconnect_after_on_a_non_streamed_request_drops_without_a_response() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let headers = [("x-stub-fault", "disconnect-after:3")];
    let result = post(&agent(), &url, &headers, &anthropic(QUESTION, 1024, false));
    assert!(result.is_err(), "no response: {result:?}");
}

#[test]
fn stall_after_2_keeps_the_stream_open_until_the_client_gives_up() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let patience = Duration::from_millis(400);
    let headers = [("x-stub-fault", "stall-after:2")];
    let started = Instant::now();
    let response = post(
        &impatient_agent(patience),
        &url,
        &headers,
        &anthropic(QUESTION, 1024, true),
    )
    .unwrap();
    let streamed = read_stream(response, started);

    assert_eq!(streamed.named("content_block_delta").len(), 2);
    assert!(streamed.named("message_stop").is_empty());
    let error = streamed.error.expect("the read timed out");
    let error = error.to_lowercase();
    assert!(
        error.contains("timeout") || error.contains("timed out"),
        "{error}"
    );
    assert!(started.elapsed() >= patience);

    // The stub is still serving others meanwhile, and after.
    let response = post(&agent(), &url, &[], &anthropic(QUESTION, 64, false)).unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn stall_after_on_a_non_streamed_request_never_answers() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let headers = [("x-stub-fault", "stall-after:0")];
    let result = post(
        &impatient_agent(Duration::from_millis(300)),
        &url,
        &headers,
        &openai(QUESTION, json!({})),
    );
    assert!(result.is_err(), "no response: {result:?}");
}

#[test]
fn dropping_the_stub_ends_a_stalled_stream() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let headers = [("x-stub-fault", "stall-after:1")];
    let response = post(&agent(), &url, &headers, &anthropic(QUESTION, 64, true)).unwrap();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(stub);
    });
    // No client timeout: only the stub stopping can end this read.
    let streamed = read_stream(response, Instant::now());
    stopper.join().unwrap();
    assert_eq!(streamed.named("content_block_delta").len(), 1);
    assert!(streamed.named("message_stop").is_empty());
}
