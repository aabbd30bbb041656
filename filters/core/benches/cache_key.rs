//! Cost of the cache key for a realistic Anthropic request of ~4 KB and
//! ~64 KB (a multi-turn conversation with long text turns and a tool), next
//! to a bare SHA-256 of the same body as a same-run baseline. The canonical
//! form alone and a bare serde_json parse show where the time goes.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use zerolayer_core::cache::key::{CanonicalRequest, Provider, canonical_json};

const WORDS: [&str; 16] = [
    "the",
    "gateway",
    "caches",
    "responses",
    "when",
    "requests",
    "are",
    "identical,",
    "otherwise",
    "it",
    "forwards",
    "them",
    "upstream",
    "and",
    "stores",
    "results.",
];

/// Prose of about `len` bytes, deterministic.
fn prose(seed: u64, len: usize) -> String {
    let mut state = seed;
    let mut out = String::with_capacity(len + 16);
    while out.len() < len {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.push_str(WORDS[(state >> 60) as usize]);
        out.push(if state & 0x3f == 0 { '\n' } else { ' ' });
    }
    out
}

/// A conversation body of roughly `size` bytes.
fn body(size: usize) -> Vec<u8> {
    let turn = (size / 10).max(200);
    let mut messages = Vec::new();
    let mut i = 0;
    loop {
        let request = json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 4096,
            "temperature": 0.0,
            "system": "You are a careful assistant for an LLM gateway's operators.",
            "metadata": {"user_id": "u-0d9d1e52"},
            "tools": [{
                "name": "lookup_route",
                "description": "Finds the upstream route for a request path.",
                "input_schema": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "limit": {"type": "integer", "maximum": 10}},
                    "required": ["path"]
                }
            }],
            "messages": messages,
        });
        let bytes = serde_json::to_vec_pretty(&request).unwrap_or_default();
        if bytes.len() >= size {
            return bytes;
        }
        let message: Value = if i % 2 == 0 {
            json!({"role": "user", "content": prose(i, turn)})
        } else {
            json!({"role": "assistant", "content": [{"type": "text", "text": prose(i, turn)}]})
        };
        messages.push(message);
        i += 1;
    }
}

fn cache_key(c: &mut Criterion) {
    let secret = [0x5a_u8; 32];
    let mut group = c.benchmark_group("cache_key");
    for (label, size) in [("4KB", 4 * 1024), ("64KB", 64 * 1024)] {
        let body = body(size);
        eprintln!(
            "{label}: {} bytes, canonical {} bytes",
            body.len(),
            canonical_json(Provider::Anthropic, &body)
                .map(|c| c.len())
                .unwrap_or(0)
        );
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("key", label), &body, |b, body| {
            b.iter(|| {
                CanonicalRequest::of(Provider::Anthropic, black_box(body), Some("acme"), &secret)
            })
        });
        group.bench_with_input(
            BenchmarkId::new("canonical_json", label),
            &body,
            |b, body| b.iter(|| canonical_json(Provider::Anthropic, black_box(body))),
        );
        group.bench_with_input(BenchmarkId::new("parse", label), &body, |b, body| {
            b.iter(|| serde_json::from_slice::<Value>(black_box(body)).map(drop))
        });
        group.bench_with_input(BenchmarkId::new("sha256", label), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(body)))
        });
    }
    group.finish();
}

criterion_group!(benches, cache_key);
criterion_main!(benches);
