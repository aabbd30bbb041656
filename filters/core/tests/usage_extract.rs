//! Usage extraction: every fixture (recorded-style provider responses, named
//! by provider and case) against its expected result, then the edge cases a
//! metering filter meets: missing, partial, malformed and oversized usage.

mod usage_support;

use std::path::Path;

use usage_support::extract;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::usage::{
    Extracted, MAX_USAGE_JSON, Missing, PartialUsage, ResponseFormat, Usage,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/usage")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Provider and framing from a fixture's name (`anthropic_*.sse`, ...).
fn kind(name: &str) -> (Provider, ResponseFormat) {
    let provider = if name.starts_with("anthropic") {
        Provider::Anthropic
    } else {
        Provider::OpenAi
    };
    let format = if name.ends_with(".sse") {
        ResponseFormat::EventStream
    } else {
        ResponseFormat::Json
    };
    (provider, format)
}

fn usage(input: u64, output: u64, cache_read: u64, cache_creation: u64) -> Result<Usage, Missing> {
    Ok(Usage {
        input_tokens: input,
        output_tokens: output,
        cache_read_tokens: cache_read,
        cache_creation_tokens: cache_creation,
    })
}

/// One table row: provider, body, expected usage and model.
type Case = (
    Provider,
    &'static str,
    Result<Usage, Missing>,
    Option<&'static str>,
);

fn found(usage: Result<Usage, Missing>, model: Option<&str>) -> Extracted {
    Extracted {
        usage,
        model: model.map(String::from),
    }
}

#[test]
fn every_fixture_gives_its_usage() {
    let cases: &[(&str, Result<Usage, Missing>, Option<&str>)] = &[
        (
            "anthropic_stream.sse",
            usage(25, 15, 0, 0),
            Some("claude-sonnet-4-5-20250929"),
        ),
        (
            "anthropic_stream_crlf.sse",
            usage(25, 15, 0, 0),
            Some("claude-sonnet-4-5-20250929"),
        ),
        (
            "anthropic_stream_tool_use.sse",
            usage(472, 89, 0, 0),
            Some("claude-opus-4-1-20250805"),
        ),
        // input_tokens in message_delta overrides message_start's 0.
        (
            "anthropic_stream_delta_input.sse",
            usage(312, 4, 0, 0),
            Some("qwen3-coder"),
        ),
        (
            "anthropic_stream_cache.sse",
            usage(12, 57, 8192, 2048),
            Some("claude-sonnet-4-5-20250929"),
        ),
        (
            "anthropic_stream_cache_cr.sse",
            usage(12, 57, 8192, 2048),
            Some("claude-sonnet-4-5-20250929"),
        ),
        (
            "anthropic_stream_unnamed.sse",
            usage(88, 6, 0, 0),
            Some("glm-4.6"),
        ),
        // Cut by an error event before message_delta: what was seen, flagged.
        (
            "anthropic_stream_truncated.sse",
            Err(Missing::Incomplete(PartialUsage {
                input_tokens: Some(40),
                output_tokens: Some(1),
                cache_read_tokens: None,
                cache_creation_tokens: None,
            })),
            Some("claude-haiku-4-5"),
        ),
        (
            "openai_stream_usage.sse",
            usage(1117, 46, 1024, 0),
            Some("gpt-4o-mini-2024-07-18"),
        ),
        (
            "openai_stream_usage_crlf.sse",
            usage(1117, 46, 1024, 0),
            Some("gpt-4o-mini-2024-07-18"),
        ),
        (
            "openai_stream_no_usage.sse",
            Err(Missing::NotReported),
            Some("gpt-4o-2024-08-06"),
        ),
        (
            "openai_stream_comments.sse",
            usage(20, 2, 0, 0),
            Some("meta-llama/llama-3.1-8b-instruct"),
        ),
        // Cumulative usage on every chunk: the last report wins.
        (
            "openai_stream_continuous_usage.sse",
            usage(14, 2, 0, 0),
            Some("Qwen/Qwen2.5-7B-Instruct"),
        ),
        (
            "anthropic_message.json",
            usage(2095, 503, 1800, 0),
            Some("claude-sonnet-4-5-20250929"),
        ),
        (
            "openai_completion.json",
            usage(1117, 46, 0, 0),
            Some("gpt-4o-2024-08-06"),
        ),
        (
            "openai_completion_usage_first.json",
            usage(31, 9, 16, 0),
            Some("llama-3.1-8b-instruct"),
        ),
        ("anthropic_error.json", Err(Missing::NotReported), None),
    ];
    for (name, expected, model) in cases {
        let (provider, format) = kind(name);
        let body = fixture(name);
        assert_eq!(
            extract(provider, format, &[&body]),
            found(*expected, *model),
            "{name}"
        );
    }
    // Every fixture in the folder is in the table.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/usage");
    let mut listed: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    let mut named: Vec<String> = cases.iter().map(|(name, ..)| name.to_string()).collect();
    named.sort();
    assert_eq!(listed, named);
}

#[test]
fn json_usage_edge_cases() {
    let a = Provider::Anthropic;
    let o = Provider::OpenAi;
    let json = ResponseFormat::Json;
    let partial = |input, output| {
        Err(Missing::Incomplete(PartialUsage {
            input_tokens: input,
            output_tokens: output,
            ..PartialUsage::default()
        }))
    };
    let cases: &[Case] = &[
        (
            a,
            r#"{"usage":{"input_tokens":1,"output_tokens":2}}"#,
            usage(1, 2, 0, 0),
            None,
        ),
        (
            a,
            r#"{"usage":null,"model":"m"}"#,
            Err(Missing::NotReported),
            Some("m"),
        ),
        (
            a,
            r#"{"usage":{"input_tokens":3}}"#,
            partial(Some(3), None),
            None,
        ),
        (a, r#"{"usage":{}}"#, Err(Missing::NotReported), None),
        (
            a,
            r#"{"usage":{"input_tokens":-1,"output_tokens":2}}"#,
            Err(Missing::Malformed),
            None,
        ),
        (
            a,
            r#"{"usage":{"input_tokens":1.5,"output_tokens":2}}"#,
            Err(Missing::Malformed),
            None,
        ),
        (a, r#"{"usage":"lots"}"#, Err(Missing::Malformed), None),
        (
            a,
            r#"{"usage":{"input_tokens":1,"output_tokens":2"#,
            Err(Missing::NotReported),
            None,
        ),
        // OpenAI names are not Anthropic's, and the other way round.
        (
            a,
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            Err(Missing::NotReported),
            None,
        ),
        (
            o,
            r#"{"usage":{"input_tokens":1,"output_tokens":2}}"#,
            Err(Missing::NotReported),
            None,
        ),
        (
            o,
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":null}}"#,
            usage(1, 2, 0, 0),
            None,
        ),
        // A later duplicate replaces the earlier report (as serde_json does).
        (
            o,
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
            usage(3, 4, 0, 0),
            None,
        ),
        // Nested "usage" and "model" keys never count.
        (
            o,
            r#"{"a":{"usage":{"prompt_tokens":1,"completion_tokens":2},"model":"x"}}"#,
            Err(Missing::NotReported),
            None,
        ),
        (
            o,
            r#"[{"usage":{"prompt_tokens":1,"completion_tokens":2}}]"#,
            Err(Missing::NotReported),
            None,
        ),
        (o, r#"{"model":7}"#, Err(Missing::NotReported), None),
        (o, "", Err(Missing::NotReported), None),
        (
            o,
            "<html>bad gateway</html>",
            Err(Missing::NotReported),
            None,
        ),
    ];
    for (provider, body, expected, model) in cases {
        assert_eq!(
            extract(*provider, json, &[body.as_bytes()]),
            found(*expected, *model),
            "{body}"
        );
    }
}

#[test]
fn oversized_usage_and_model_are_not_kept() {
    let padding = " ".repeat(MAX_USAGE_JSON);
    let body = format!(r#"{{"usage":{{"prompt_tokens":1,{padding}"completion_tokens":2}}}}"#);
    let got = extract(Provider::OpenAi, ResponseFormat::Json, &[body.as_bytes()]);
    assert_eq!(got, found(Err(Missing::Oversized), None));

    let long = "m".repeat(129);
    for body in [
        format!(r#"{{"model":"{long}","usage":{{"input_tokens":1,"output_tokens":2}}}}"#),
        format!(
            "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"model\":\"{long}\"}}}}\n\n"
        ),
    ] {
        let format = if body.starts_with('{') {
            ResponseFormat::Json
        } else {
            ResponseFormat::EventStream
        };
        assert_eq!(
            extract(Provider::Anthropic, format, &[body.as_bytes()]).model,
            None
        );
    }
    let exact = "m".repeat(128);
    let body = format!(r#"{{"model":"{exact}"}}"#);
    let got = extract(
        Provider::Anthropic,
        ResponseFormat::Json,
        &[body.as_bytes()],
    );
    assert_eq!(got.model.as_deref(), Some(exact.as_str()));
}

#[test]
fn stream_edge_cases() {
    let sse = ResponseFormat::EventStream;
    // A usage event that is not valid JSON is reported as such...
    let got = extract(
        Provider::OpenAi,
        sse,
        &[b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1\n\ndata: [DONE]\n\n"],
    );
    assert_eq!(got.usage, Err(Missing::Malformed));
    let got = extract(
        Provider::Anthropic,
        sse,
        &[b"event: message_delta\ndata: {\"usage\":{\"output_tokens\":\"9\"}}\n\n"],
    );
    assert_eq!(got.usage, Err(Missing::Malformed));
    // ...but the counts that were seen still win over it.
    let got = extract(
        Provider::Anthropic,
        sse,
        &[
            b"event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
            b"event: message_delta\ndata: not json\n\n",
        ],
    );
    assert!(matches!(got.usage, Err(Missing::Incomplete(_))), "{got:?}");
    // message_delta without usage does not complete anything.
    let got = extract(
        Provider::Anthropic,
        sse,
        &[b"event: message_delta\ndata: {\"delta\":{}}\n\n"],
    );
    assert_eq!(got.usage, Err(Missing::NotReported));
    // An event without its blank line was never dispatched.
    let got = extract(
        Provider::OpenAi,
        sse,
        &[b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n"],
    );
    assert_eq!(got.usage, Err(Missing::NotReported));
    // A JSON body fed as a stream, and the other way round, reports nothing.
    let json = fixture("openai_completion.json");
    assert_eq!(
        extract(Provider::OpenAi, sse, &[&json]).usage,
        Err(Missing::NotReported)
    );
    let stream = fixture("openai_stream_usage.sse");
    assert_eq!(
        extract(Provider::OpenAi, ResponseFormat::Json, &[&stream]).usage,
        Err(Missing::NotReported)
    );
    // Another provider's stream reports nothing either.
    let anthropic = fixture("anthropic_stream.sse");
    assert_eq!(
        extract(Provider::OpenAi, sse, &[&anthropic]).usage,
        Err(Missing::NotReported)
    );
    assert_eq!(
        extract(Provider::Anthropic, sse, &[&stream]).usage,
        Err(Missing::NotReported)
    );
    // A line longer than the SSE parser keeps is reported as oversized.
    let long = vec![b'x'; zerolayer_core::sse::MAX_LINE + 1];
    let got = extract(Provider::OpenAi, sse, &[b"data: ", &long, b"\n\n"]);
    assert_eq!(got.usage, Err(Missing::Oversized));
}

#[test]
fn missing_usage_explains_itself() {
    let partial = Missing::Incomplete(PartialUsage {
        input_tokens: Some(40),
        ..PartialUsage::default()
    });
    assert_eq!(
        partial.to_string(),
        "the response's usage is incomplete (input Some(40), output None)"
    );
    assert_eq!(
        Missing::NotReported.to_string(),
        "the response reported no usage"
    );
}
