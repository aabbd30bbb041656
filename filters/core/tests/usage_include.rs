//! Asking OpenAI streams for usage on the client's behalf: the request
//! rewrite (a table of bodies and decisions) and the stripper that hides the
//! extra usage chunk from the client again.

mod usage_support;

use std::path::Path;

use serde_json::{Value, json};
use usage_support::strip;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::usage::{
    Injection, MAX_HELD_EVENT, Missing, ResponseFormat, UsageChunkStripper, UsageExtractor,
    inject_include_usage,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/usage")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn rewritten(body: &str) -> String {
    match inject_include_usage(Provider::OpenAi, body.as_bytes()) {
        Injection::Rewritten(bytes) => String::from_utf8(bytes).unwrap(),
        other => panic!("{body}: {other:?}"),
    }
}

#[test]
fn include_usage_is_added_with_every_other_byte_kept() {
    let cases = [
        (
            r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"}"}],"temperature":1.0e0}"#,
            r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"}"}],"temperature":1.0e0,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "{\n  \"stream\": true,\n  \"n\": 12345678901234567890123\n}\n",
            "{\n  \"stream\": true,\n  \"n\": 12345678901234567890123\n,\"stream_options\":{\"include_usage\":true}}\n",
        ),
        (
            r#"{"stream_options":null,"stream":true}"#,
            r#"{"stream_options":{"include_usage":true},"stream":true}"#,
        ),
        (
            r#"{"stream":true,"stream_options":{"include_usage":false},"x":1}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true},"x":1}"#,
        ),
        (
            r#"{"stream":true, "stream_options" : { "include_obfuscation": false } }"#,
            r#"{"stream":true, "stream_options" : {"include_obfuscation":false,"include_usage":true} }"#,
        ),
        (
            r#"{"stream":true,"stream_options":{"include_usage":"yes"}}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
    ];
    for (body, expected) in cases {
        let got = rewritten(body);
        assert_eq!(got, expected);
        let value: Value = serde_json::from_str(&got).unwrap();
        assert_eq!(
            value["stream_options"]["include_usage"],
            json!(true),
            "{got}"
        );
    }
    assert!(inject_include_usage(Provider::OpenAi, br#"{"stream":true}"#).strip_usage_chunk());
}

/// Issue 21 item 5: a duplicated `stream` or `stream_options` streamed
/// without the injected `include_usage` (the filter left the body alone and
/// the backend read the last member).
#[test]
fn requests_that_could_stream_without_usage_are_refused() {
    let dup = |name: &str| {
        Injection::Refused(format!(
            "request body names the member `{name}` twice in one object"
        ))
    };
    let cases: &[(&str, Injection)] = &[
        (r#"{"stream":false,"stream":true}"#, dup("stream")),
        (r#"{"stream":true,"stream":true}"#, dup("stream")),
        (r#"{"stream":true,"str\u0065am":false}"#, dup("stream")),
        (
            r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":null}"#,
            dup("stream_options"),
        ),
        (
            r#"{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}"#,
            dup("include_usage"),
        ),
        // Anywhere, streamed or not: post-cache refuses the same bodies.
        (
            r#"{"stream":false,"messages":[{"role":"user","content":"a","content":"b"}]}"#,
            dup("content"),
        ),
        (
            r#"{"stream":"true"}"#,
            Injection::Refused("request body field `stream` is not a boolean".into()),
        ),
        (
            r#"{"stream":1}"#,
            Injection::Refused("request body field `stream` is not a boolean".into()),
        ),
        (
            r#"{"stream":true,"stream_options":[]}"#,
            Injection::Refused("request body field `stream_options` is not an object".into()),
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(
            &inject_include_usage(Provider::OpenAi, body.as_bytes()),
            expected,
            "{body}"
        );
    }
}

#[test]
fn a_member_named_with_escapes_is_rewritten_in_place() {
    let body = br#"{"stream":true,"stream_\u006fptions":{"x":1}}"#;
    let Injection::Rewritten(rewritten) = inject_include_usage(Provider::OpenAi, body) else {
        panic!("not rewritten");
    };
    assert_eq!(
        std::str::from_utf8(&rewritten).unwrap(),
        r#"{"stream":true,"stream_\u006fptions":{"include_usage":true,"x":1}}"#
    );
}

#[test]
fn other_requests_are_left_alone() {
    let cases: &[(Provider, &str, Injection)] = &[
        (
            Provider::OpenAi,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            Injection::ClientAsked,
        ),
        (
            Provider::OpenAi,
            r#"{"stream":false}"#,
            Injection::NotApplicable,
        ),
        (
            Provider::OpenAi,
            r#"{"model":"gpt-4o"}"#,
            Injection::NotApplicable,
        ),
        (Provider::OpenAi, r#"[true,null]"#, Injection::NotApplicable),
        (
            Provider::OpenAi,
            r#"{"stream":true"#,
            Injection::NotApplicable,
        ),
        (
            Provider::OpenAi,
            r#"{"stream":true} trailing"#,
            Injection::NotApplicable,
        ),
        (Provider::OpenAi, "", Injection::NotApplicable),
        (
            Provider::OpenAi,
            "\u{feff}{\"stream\":true}",
            Injection::NotApplicable,
        ),
        // Anthropic streams always report usage.
        (
            Provider::Anthropic,
            r#"{"stream":true}"#,
            Injection::NotApplicable,
        ),
    ];
    for (provider, body, expected) in cases {
        let got = inject_include_usage(*provider, body.as_bytes());
        assert_eq!(&got, expected, "{body}");
        assert!(!got.strip_usage_chunk());
    }
}

/// The usage-only event of `openai_stream_usage.sse`, blank line included.
fn usage_event(stream: &str) -> &str {
    let start = stream.find("data: {\"id\":\"chatcmpl-AbC123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[],").unwrap();
    let end = stream[start..].find("data: [DONE]").unwrap();
    &stream[start..start + end]
}

#[test]
fn the_usage_chunk_is_removed_and_nothing_else() {
    for name in ["openai_stream_usage.sse", "openai_stream_usage_crlf.sse"] {
        let stream = String::from_utf8(fixture(name)).unwrap();
        let expected = stream.replace(usage_event(&stream), "");
        assert_ne!(expected, stream);
        let (out, removed) = strip(&[stream.as_bytes()]);
        assert_eq!(String::from_utf8(out.clone()).unwrap(), expected, "{name}");
        assert_eq!(removed, 1);
        // The client's stream has no usage; the original still has it.
        let mut extractor = UsageExtractor::new(Provider::OpenAi, ResponseFormat::EventStream);
        extractor.push(&out);
        assert_eq!(extractor.finish().usage, Err(Missing::NotReported));
    }

    // A comment inside the removed event stays.
    let stream = String::from_utf8(fixture("openai_stream_comments.sse")).unwrap();
    let start = stream.find(": keep-alive").unwrap();
    let end = stream.find("data: [DONE]").unwrap();
    let expected = format!(
        "{}: keep-alive inside the usage event\n{}",
        &stream[..start],
        &stream[end..]
    );
    assert_eq!(strip(&[stream.as_bytes()]), (expected.into_bytes(), 1));

    // Chunks with choices keep their usage; only the usage-only one goes.
    let stream = String::from_utf8(fixture("openai_stream_continuous_usage.sse")).unwrap();
    let start = stream.find("\"choices\":[],").unwrap();
    let start = stream[..start].rfind("data: ").unwrap();
    let end = stream.find("data: [DONE]").unwrap();
    let expected = format!("{}{}", &stream[..start], &stream[end..]);
    assert_eq!(strip(&[stream.as_bytes()]), (expected.into_bytes(), 1));

    // Streams without such a chunk pass unchanged.
    for name in [
        "openai_stream_no_usage.sse",
        "anthropic_stream.sse",
        "anthropic_stream_cache_cr.sse",
        "anthropic_stream_delta_input.sse",
    ] {
        let stream = fixture(name);
        assert_eq!(strip(&[&stream]), (stream.clone(), 0), "{name}");
    }
}

#[test]
fn near_misses_are_forwarded() {
    for event in [
        // choices not empty, usage null, choices absent, not JSON.
        "data: {\"choices\":[{}],\"usage\":{\"prompt_tokens\":1}}\n\n",
        "data: {\"choices\":[],\"usage\":null}\n\n",
        "data: {\"usage\":{\"prompt_tokens\":1}}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}\n\n",
        // Unterminated at the end of the stream: never dispatched, forwarded.
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n",
    ] {
        assert_eq!(
            strip(&[event.as_bytes()]),
            (event.as_bytes().to_vec(), 0),
            "{event}"
        );
    }
    // Data split over two lines is joined as SSE does.
    let event = "data: {\"choices\":[],\ndata: \"usage\":{\"prompt_tokens\":1}}\n\n";
    assert_eq!(strip(&[event.as_bytes()]), (Vec::new(), 1));
}

#[test]
fn held_bytes_are_bounded() {
    let mut stripper = UsageChunkStripper::new();
    let mut out = Vec::new();
    let big = format!(
        "data: {{\"choices\":[],\"usage\":{{\"x\":\"{}\"}}}}",
        "a".repeat(40_000)
    );
    for piece in big.as_bytes().chunks(1000) {
        stripper.push(piece, &mut out);
        assert!(stripper.held() <= MAX_HELD_EVENT);
    }
    stripper.push(b"\n\n", &mut out);
    // Too long to be the usage chunk: forwarded whole.
    assert_eq!(out, format!("{big}\n\n").into_bytes());
    assert_eq!(stripper.removed(), 0);
    assert_eq!(stripper.held(), 0);
}

#[test]
fn the_size_bound_does_not_depend_on_chunking() {
    // Usage-only events padded to just under, at and just over the bound,
    // with every line ending: each is removed or forwarded the same way
    // wherever the stream is cut.
    for eol in ["\n", "\r\n", "\r"] {
        for extra in 0..4 {
            let head = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}";
            // The event's size (its blank line aside) is MAX_HELD_EVENT - 1 + extra.
            let pad = MAX_HELD_EVENT - 1 + extra - head.len() - 1 - eol.len();
            let stream = format!(
                "{head}{}}}{eol}{eol}data: [DONE]{eol}{eol}",
                " ".repeat(pad)
            );
            let bytes = stream.as_bytes();
            let whole = strip(&[bytes]);
            assert_eq!(whole.1, usize::from(extra <= 1), "{eol:?} {extra}");
            let event_end = MAX_HELD_EVENT - 1 + extra + eol.len();
            let cuts = (0..64).chain(event_end - 64..bytes.len());
            for cut in cuts {
                let (a, b) = bytes.split_at(cut);
                assert_eq!(strip(&[a, b]), whole, "{eol:?} {extra} cut at {cut}");
            }
        }
    }
}
