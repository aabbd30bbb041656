//! Throughput of usage extraction, which runs in wasm on every response byte:
//! a ~1 MB Anthropic stream of `content_block_delta` events, a ~1 MB OpenAI
//! stream with `include_usage` (every chunk carries `"usage":null`), and a
//! ~1 MB JSON body, all fed in 16 KiB chunks as a proxy sees them. Baselines
//! in the same run: the SSE parser alone on the same stream bytes (what any
//! stream-aware filter pays), and a whole-body `serde_json` pass over the
//! JSON body (what a buffering filter would pay).
//!
//! The request side: metering reads every LLM request body as it passes
//! for its `model` (and a large OpenAI stream's `stream` members), with
//! `RequestScan`: a typical SDK chat request (~2 KiB, the model after the
//! messages) and a 1 MiB long-context one, in 16 KiB chunks; baseline: a
//! whole-body `serde_json` pass (what reading the model by parsing costs).
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde::de::IgnoredAny;
use serde_json::json;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::sse::SseParser;
use zerolayer_core::usage::{
    Missing, RequestScan, ResponseFormat, Usage, UsageChunkStripper, UsageExtractor,
};

const TARGET: usize = 1 << 20;
const CHUNK: usize = 16 * 1024;

const WORDS: [&str; 16] = [
    "the",
    "gateway",
    "meters",
    "tokens",
    "when",
    "responses",
    "stream",
    "back,",
    "\"quoted\"",
    "{braces}",
    "and",
    "newlines\n",
    "so",
    "escapes",
    "are",
    "exercised.",
];

/// A deterministic text delta of a few words.
fn words(state: &mut u64, count: usize) -> String {
    let mut out = String::new();
    for _ in 0..count {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.push_str(WORDS[(*state >> 60) as usize]);
        out.push(' ');
    }
    out
}

fn anthropic_stream() -> Vec<u8> {
    let mut out = String::new();
    out.push_str("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01XFDUDYJgAACzvnptvVoYEL\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5-20250929\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":2095,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":1800,\"output_tokens\":1}}}\n\n");
    out.push_str("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n");
    let mut state = 7;
    let mut events = 0;
    while out.len() < TARGET {
        let delta = json!({
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": words(&mut state, 4)},
        });
        out.push_str(&format!("event: content_block_delta\ndata: {delta}\n\n"));
        events += 1;
        if events % 200 == 0 {
            out.push_str("event: ping\ndata: {\"type\": \"ping\"}\n\n");
        }
    }
    out.push_str(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    );
    out.push_str(&format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\",\"stop_sequence\":null}},\"usage\":{{\"output_tokens\":{events}}}}}\n\n"));
    out.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    out.into_bytes()
}

fn openai_stream() -> Vec<u8> {
    let mut out = String::new();
    let mut state = 11;
    let mut chunks = 0;
    while out.len() < TARGET {
        let chunk = json!({
            "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
            "object": "chat.completion.chunk",
            "created": 1_741_570_283,
            "model": "gpt-4o-mini-2024-07-18",
            "system_fingerprint": "fp_44709d6fcb",
            "choices": [{"index": 0, "delta": {"content": words(&mut state, 4)}, "logprobs": null, "finish_reason": null}],
            "usage": null,
        });
        out.push_str(&format!("data: {chunk}\n\n"));
        chunks += 1;
    }
    out.push_str(&format!("data: {{\"id\":\"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG\",\"object\":\"chat.completion.chunk\",\"created\":1741570283,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[],\"usage\":{{\"prompt_tokens\":1117,\"completion_tokens\":{chunks},\"total_tokens\":0,\"prompt_tokens_details\":{{\"cached_tokens\":1024}}}}}}\n\n"));
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

fn json_body() -> Vec<u8> {
    let mut state = 13;
    let mut text = String::new();
    while text.len() < TARGET {
        text.push_str(&words(&mut state, 64));
    }
    serde_json::to_vec(&json!({
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [
            {"type": "text", "text": text},
            {"type": "tool_use", "id": "toolu_01", "name": "record", "input": {"usage": {"input_tokens": 1}, "rows": [[1, 2, 3], {"a": "b"}]}},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": 2095, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1800, "output_tokens": 503},
    }))
    .unwrap_or_default()
}

fn extract(provider: Provider, format: ResponseFormat, body: &[u8]) -> Result<Usage, Missing> {
    let mut extractor = UsageExtractor::new(provider, format);
    for chunk in body.chunks(CHUNK) {
        extractor.push(chunk);
    }
    extractor.finish().usage
}

fn sse_events(body: &[u8]) -> usize {
    let mut parser = SseParser::new();
    let mut events = 0;
    for chunk in body.chunks(CHUNK) {
        parser.push(chunk, |event| {
            black_box(event);
            events += 1;
        });
    }
    events
}

fn bench(c: &mut Criterion) {
    let anthropic = anthropic_stream();
    let openai = openai_stream();
    let json = json_body();
    // Sanity: the benches measure a successful extraction.
    assert!(extract(Provider::Anthropic, ResponseFormat::EventStream, &anthropic).is_ok());
    assert!(extract(Provider::OpenAi, ResponseFormat::EventStream, &openai).is_ok());
    assert!(extract(Provider::Anthropic, ResponseFormat::Json, &json).is_ok());

    let mut group = c.benchmark_group("usage/anthropic_stream");
    group.throughput(Throughput::Bytes(anthropic.len() as u64));
    group.bench_function("extractor", |b| {
        b.iter(|| {
            extract(
                Provider::Anthropic,
                ResponseFormat::EventStream,
                black_box(&anthropic),
            )
        })
    });
    group.bench_function("sse_parser_baseline", |b| {
        b.iter(|| sse_events(black_box(&anthropic)))
    });
    group.finish();

    let mut group = c.benchmark_group("usage/openai_stream");
    group.throughput(Throughput::Bytes(openai.len() as u64));
    group.bench_function("extractor", |b| {
        b.iter(|| {
            extract(
                Provider::OpenAi,
                ResponseFormat::EventStream,
                black_box(&openai),
            )
        })
    });
    group.bench_function("stripper", |b| {
        let mut out = Vec::with_capacity(openai.len());
        b.iter(|| {
            out.clear();
            let mut stripper = UsageChunkStripper::new();
            for chunk in black_box(&openai).chunks(CHUNK) {
                stripper.push(chunk, &mut out);
            }
            stripper.finish(&mut out);
            out.len()
        })
    });
    group.bench_function("sse_parser_baseline", |b| {
        b.iter(|| sse_events(black_box(&openai)))
    });
    group.finish();

    let mut group = c.benchmark_group("usage/json_body");
    group.throughput(Throughput::Bytes(json.len() as u64));
    group.bench_function("extractor", |b| {
        b.iter(|| extract(Provider::Anthropic, ResponseFormat::Json, black_box(&json)))
    });
    group.bench_function("serde_json_whole_body_baseline", |b| {
        b.iter(|| serde_json::from_slice::<IgnoredAny>(black_box(&json)).is_ok())
    });
    group.finish();
}

/// A chat request as the official SDKs write it: messages first, the model
/// after them; about `size` bytes of conversation.
fn chat_request(size: usize) -> Vec<u8> {
    let mut state = 17;
    let mut messages = Vec::new();
    let mut len = 0;
    while len < size {
        let content = words(&mut state, 48);
        len += content.len() + 40;
        let role = if messages.len().is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        messages.push(json!({"role": role, "content": content}));
    }
    serde_json::to_vec(&json!({
        "messages": messages,
        "model": "gpt-4o-mini-2024-07-18",
        "max_tokens": 256,
        "stream": true,
    }))
    .unwrap_or_default()
}

fn scan(body: &[u8]) -> bool {
    let mut scan = RequestScan::new();
    for chunk in body.chunks(CHUNK) {
        scan.push(chunk);
    }
    scan.model().is_some()
}

fn request_bench(c: &mut Criterion) {
    for (name, size) in [("usage/request_2k", 2 * 1024), ("usage/request_1m", TARGET)] {
        let body = chat_request(size);
        assert!(scan(&body), "the model is found");
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function("request_scan", |b| b.iter(|| scan(black_box(&body))));
        group.bench_function("serde_json_whole_body_baseline", |b| {
            b.iter(|| serde_json::from_slice::<IgnoredAny>(black_box(&body)).is_ok())
        });
        group.finish();
    }
}

criterion_group!(benches, bench, request_bench);
criterion_main!(benches);
