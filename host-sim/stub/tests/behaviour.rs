//! Determinism, `max_tokens` truncation, the latency profile, `Cache-Control`
//! and the request log, over real HTTP.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{agent, anthropic, header, json_body, openai, post, read_stream};
use zerolayer_stub::{Stub, StubConfig};

fn anthropic_text(stub: &Stub, body: &str) -> Value {
    let url = format!("{}/v1/messages", stub.url());
    json_body(post(&agent(), &url, &[], body).unwrap())
}

fn openai_text(stub: &Stub, body: &str) -> Value {
    let url = format!("{}/v1/chat/completions", stub.url());
    json_body(post(&agent(), &url, &[], body).unwrap())
}

#[test]
fn same_request_same_text_different_messages_different_text() {
    let stub = Stub::start(StubConfig::default()).unwrap();

    let first = anthropic_text(&stub, &anthropic("Are you sure?", 1024, false));
    let again = anthropic_text(&stub, &anthropic("Are you sure?", 1024, false));
    let other = anthropic_text(&stub, &anthropic("Really sure?", 1024, false));
    assert_eq!(first["content"], again["content"]);
    assert_eq!(first["usage"], again["usage"]);
    assert_ne!(first["id"], again["id"], "ids are per response");
    assert_ne!(first["content"], other["content"]);

    let first = openai_text(&stub, &openai("Are you sure?", json!({})));
    let again = openai_text(&stub, &openai("Are you sure?", json!({})));
    let other = openai_text(&stub, &openai("Really sure?", json!({})));
    assert_eq!(first["choices"], again["choices"]);
    assert_ne!(first["choices"], other["choices"]);
}

#[test]
fn max_tokens_truncation_sets_the_stop_reason() {
    let stub = Stub::start(StubConfig::default()).unwrap();

    let body = anthropic_text(&stub, &anthropic("Are you sure?", 3, false));
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(body["usage"]["output_tokens"], 3);

    let url = format!("{}/v1/messages", stub.url());
    let response = post(&agent(), &url, &[], &anthropic("Are you sure?", 3, true)).unwrap();
    let streamed = read_stream(response, Instant::now());
    assert_eq!(streamed.named("content_block_delta").len(), 3);
    let data = streamed.data();
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 3);

    let body = openai_text(&stub, &openai("Are you sure?", json!({"max_tokens": 3})));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 3);

    let url = format!("{}/v1/chat/completions", stub.url());
    let request = openai(
        "Are you sure?",
        json!({"max_completion_tokens": 2, "stream": true}),
    );
    let streamed = read_stream(post(&agent(), &url, &[], &request).unwrap(), Instant::now());
    let reasons: Vec<Value> = streamed
        .data()
        .iter()
        .filter_map(|d| d["choices"][0].get("finish_reason").cloned())
        .collect();
    assert_eq!(
        reasons,
        [Value::Null, Value::Null, Value::Null, json!("length")]
    );
}

#[test]
fn a_fixed_output_length_ends_the_turn_when_max_tokens_allows() {
    let stub = Stub::start(StubConfig::default().output_tokens(12)).unwrap();
    let body = anthropic_text(&stub, &anthropic("Are you sure?", 12, false));
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(body["usage"]["output_tokens"], 12);

    let url = format!("{}/v1/messages", stub.url());
    let request = anthropic("Are you sure?", 100, false);
    let body = json_body(post(&agent(), &url, &[("x-stub-output-tokens", "5")], &request).unwrap());
    assert_eq!(body["usage"]["output_tokens"], 5);
}

/// The first delta no earlier than the TTFT, the last no earlier than
/// TTFT + (n-1)·ITL after the request, and the deltas arriving spread out,
/// which a buffered (unflushed) stream could not do. Lower bounds only.
fn assert_profile(
    streamed: &support::Streamed,
    is_token: impl Fn(&Value) -> bool,
    ttft: Duration,
    itl: Duration,
) {
    let times: Vec<Duration> = streamed
        .events
        .iter()
        .zip(streamed.data())
        .filter(|(_, data)| is_token(data))
        .map(|(timed, _)| timed.at)
        .collect();
    let n = u32::try_from(times.len()).unwrap();
    assert!(n >= 8, "{n} tokens");
    let (first, last) = (times[0], times[times.len() - 1]);
    assert!(first >= ttft, "first token after {first:?}, TTFT {ttft:?}");
    assert!(last >= ttft + itl * (n - 1), "last token after {last:?}");
    // Arrival jitter can shave a little off the spread; half of it still
    // rules out a stream that was buffered and sent at the end.
    let spread = last - first;
    assert!(spread >= itl * (n - 1) / 2, "tokens spread over {spread:?}");
}

#[test]
fn streams_follow_the_configured_gpu_profile() {
    let (ttft, itl) = (Duration::from_millis(150), Duration::from_millis(20));
    let stub = Stub::start(StubConfig::default().ttft(ttft).itl(itl)).unwrap();
    let url = format!("{}/v1/messages", stub.url());

    let started = Instant::now();
    let response = post(&agent(), &url, &[], &anthropic("Are you sure?", 1024, true)).unwrap();
    let streamed = read_stream(response, started);
    assert_profile(&streamed, |d| d["type"] == "content_block_delta", ttft, itl);
}

#[test]
fn headers_override_the_profile_per_request() {
    let (ttft, itl) = (Duration::from_millis(150), Duration::from_millis(20));
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let profile = [("x-stub-ttft-ms", "150"), ("x-stub-itl-ms", "20")];

    let started = Instant::now();
    let request = openai("Are you sure?", json!({"stream": true}));
    let streamed = read_stream(post(&agent(), &url, &profile, &request).unwrap(), started);
    let is_token = |d: &Value| {
        d["choices"][0]["delta"]
            .get("content")
            .is_some_and(|c| c != "")
    };
    assert_profile(&streamed, is_token, ttft, itl);

    // Non-streamed: the whole answer waits for the last token.
    let started = Instant::now();
    let body = json_body(
        post(
            &agent(),
            &url,
            &profile,
            &openai("Are you sure?", json!({})),
        )
        .unwrap(),
    );
    let n = u32::try_from(body["usage"]["completion_tokens"].as_u64().unwrap()).unwrap();
    assert!(started.elapsed() >= ttft + itl * (n - 1));
}

#[test]
fn cache_control_default_override_and_empty() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let body = anthropic("Are you sure?", 64, false);
    let cache_control = |headers: &[(&str, &str)]| {
        let response = post(&agent(), &url, headers, &body).unwrap();
        assert_eq!(response.status(), 200);
        response
            .headers()
            .get("cache-control")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(cache_control(&[]).as_deref(), Some("no-cache"));
    assert_eq!(
        cache_control(&[("x-stub-cache-control", "private, max-age=60")]).as_deref(),
        Some("private, max-age=60")
    );
    assert_eq!(cache_control(&[("x-stub-cache-control", "")]), None);

    let stub = Stub::start(StubConfig::default().cache_control("")).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let response = post(
        &agent(),
        &url,
        &[],
        &openai("Are you sure?", json!({"stream": true})),
    )
    .unwrap();
    assert_eq!(header(&response, "cache-control"), "");
    drop(read_stream(response, Instant::now()));

    let stub = Stub::start(StubConfig::default().cache_control("max-age=300")).unwrap();
    let url = format!("{}/v1/chat/completions", stub.url());
    let response = post(&agent(), &url, &[], &openai("Are you sure?", json!({}))).unwrap();
    assert_eq!(header(&response, "cache-control"), "max-age=300");
}

#[test]
fn an_invalid_configured_cache_control_is_refused_at_start() {
    let err = Stub::start(StubConfig::default().cache_control("bad\nvalue")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cache_control \"bad\\nvalue\" is not a valid header value"
    );
}

#[test]
fn the_stub_logs_and_counts_what_it_received() {
    let stub = Stub::start(StubConfig::default()).unwrap();
    let messages = format!("{}/v1/messages", stub.url());
    let chat = format!("{}/v1/chat/completions", stub.url());
    let body = anthropic("Are you sure?", 64, false);
    post(&agent(), &messages, &[("x-tenant", "acme")], &body).unwrap();
    post(&agent(), &messages, &[], "{}").unwrap();
    post(&agent(), &chat, &[], &openai("Are you sure?", json!({}))).unwrap();
    post(&agent(), &format!("{}/nowhere", stub.url()), &[], "").unwrap();

    assert_eq!(stub.served("/v1/messages"), 2);
    assert_eq!(stub.served("/v1/chat/completions"), 1);
    assert_eq!(stub.served("/nowhere"), 1);
    assert_eq!(stub.served("/v1/embeddings"), 0);

    let log = stub.requests();
    assert_eq!(log.len(), 4);
    assert_eq!(log[0].method, "POST");
    assert_eq!(log[0].path, "/v1/messages");
    assert_eq!(log[0].header("X-Tenant"), Some("acme"));
    assert_eq!(log[0].header("content-type"), Some("application/json"));
    assert_eq!(log[0].body, body.as_bytes());
    assert_eq!(log[1].body, b"{}");
    assert_eq!(log[3].path, "/nowhere");
}

#[test]
fn concurrent_identical_requests_are_each_served() {
    let stub = Stub::start(StubConfig::default().ttft(Duration::from_millis(50))).unwrap();
    let url = format!("{}/v1/messages", stub.url());
    let body = anthropic("Are you sure?", 64, true);
    let texts: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..50)
            .map(|_| {
                scope.spawn(|| {
                    let response = post(&agent(), &url, &[], &body).unwrap();
                    let streamed = read_stream(response, Instant::now());
                    streamed
                        .data()
                        .iter()
                        .filter_map(|d| d["delta"]["text"].as_str().map(str::to_owned))
                        .collect::<String>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(texts.iter().all(|t| *t == texts[0] && !t.is_empty()));
    assert_eq!(stub.served("/v1/messages"), 50);
    assert_eq!(stub.requests().len(), 50);
}

#[test]
fn serve_blocking_serves_on_the_given_address() {
    // Take a free port, then hand it to the server (the CLI's `--listen`).
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    std::thread::spawn(move || zerolayer_stub::serve_blocking(addr, StubConfig::default()));
    let url = format!("http://{addr}/v1/messages");
    let body = anthropic("Are you sure?", 64, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    let response = loop {
        match post(&agent(), &url, &[], &body) {
            Ok(response) => break response,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("the server never came up: {e}"),
        }
    };
    assert_eq!(response.status(), 200);
}

#[test]
fn serve_blocking_reports_an_address_in_use() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let err = zerolayer_stub::serve_blocking(addr, StubConfig::default()).unwrap_err();
    assert!(
        err.to_string().starts_with(&format!("binding {addr}")),
        "{err}"
    );
}
