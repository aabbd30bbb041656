//! Time spent inside the filters' request-headers callback per request, in
//! host-sim (wasmtime, Cranelift), host calls included: lazy-auth on a known
//! token (the hot path), activation with ten rules, and a trivial filter
//! (the probe without actions) as the floor every filter pays; metering's
//! whole per-request cost (every callback) for a JSON and an SSE response;
//! post-cache's for a hit and for a miss that is then stored.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use host_sim::{CallResponse, ChainId, ClusterTarget, Host, PluginSpec};
use serde_json::json;
use zerolayer_e2e::paths;
use zerolayer_e2e::tokens::{self, issuer};

const NOW: u64 = 1_795_953_600;

fn wasm(name: &str) -> std::path::PathBuf {
    match paths::wasm(name) {
        Ok(p) => p,
        Err(e) => panic!("{e:#}"),
    }
}

/// Runs `n` streams with `headers` and returns the time spent in
/// `filter`'s `on_request_headers`.
fn time_in(
    host: &mut Host,
    chain: ChainId,
    filter: &str,
    headers: &[(&str, &str)],
    n: u64,
) -> Duration {
    host.reset_callback_times();
    for _ in 0..n {
        let Ok(mut s) = host.stream(chain) else {
            continue;
        };
        s.request_headers(headers, true);
        s.response_headers(&[(":status", "200")], true);
    }
    host.callback_times()
        .into_iter()
        .find(|(name, cb, _, _)| name == filter && *cb == "on_request_headers")
        .map(|(_, _, _, t)| t)
        .unwrap_or_default()
}

fn lazy_auth(c: &mut Criterion) {
    let config = json!({
        "credentials": [
            {"header": "authorization", "scheme": "Bearer", "kind": "jwt"},
            {"header": "x-api-key", "kind": "api_key"}
        ],
        "jwt": {"keys": issuer().jwks()["keys"], "issuers": ["https://idp.test"], "audiences": ["zerolayer"]},
        "api_keys": {"cluster": "keys", "path": "/introspect"},
    });
    let mut host = Host::new().unwrap_or_else(|e| panic!("{e:#}"));
    host.set_cluster(
        "keys",
        ClusterTarget::Handler(Box::new(|_| {
            CallResponse::new(200, r#"{"active":true,"tenant":"acme","sub":"svc"}"#)
        })),
    );
    host.add_singleton(
        PluginSpec::new("observer", wasm("observer_service"))
            .vm_id("zerolayer")
            .configuration(json!({"lazy_auth": config}).to_string()),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let chain = host
        .add_chain(vec![
            PluginSpec::new("lazy-auth", wasm("lazy_auth"))
                .vm_id("zerolayer")
                .configuration(config.to_string()),
        ])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut group = c.benchmark_group("hot_path");
    for (name, token) in [
        (
            "lazy_auth_known_es256",
            issuer().es256(&tokens::claims("u", "acme", NOW, 3600)),
        ),
        (
            "lazy_auth_known_rs256",
            issuer().rs256(&tokens::claims("u", "acme", NOW, 3600)),
        ),
    ] {
        let bearer = format!("Bearer {token}");
        let headers = [
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("authorization", bearer.as_str()),
        ];
        // First request admits and verifies; from then on it is a verdict hit.
        time_in(&mut host, chain, "lazy-auth", &headers, 2);
        group.bench_function(name, |b| {
            b.iter_custom(|n| time_in(&mut host, chain, "lazy-auth", &headers, n))
        });
    }
    let headers = [
        (":method", "POST"),
        (":path", "/v1/messages"),
        (":authority", "gw"),
        ("x-api-key", "sk-live-0123456789abcdef0123456789abcdef"),
    ];
    time_in(&mut host, chain, "lazy-auth", &headers, 2);
    group.bench_function("lazy_auth_known_api_key", |b| {
        b.iter_custom(|n| time_in(&mut host, chain, "lazy-auth", &headers, n))
    });
    group.finish();
}

fn baselines(c: &mut Criterion) {
    let mut host = Host::new().unwrap_or_else(|e| panic!("{e:#}"));
    let rules = include_str!("../../filters/core/benches/ten_rules.json");
    let chain = host
        .add_chain(vec![
            PluginSpec::new("probe", wasm("probe")).configuration(r#"{"role":"filter"}"#),
            PluginSpec::new("activation", wasm("activation")).configuration(rules),
        ])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let headers = [
        (":method", "POST"),
        (":path", "/v1/messages?beta=true"),
        (":authority", "gw"),
        ("x-tier", "silver"),
        ("user-agent", "anthropic-python/0.40.0"),
        ("x-tenant-id", "globex"),
        ("x-request-id", "0d9d1e52-5bd2-4f3c-9d1b-2f0d7b6f1c11"),
    ];
    let mut group = c.benchmark_group("hot_path");
    group.bench_function("trivial_filter", |b| {
        b.iter_custom(|n| time_in(&mut host, chain, "probe", &headers, n))
    });
    group.bench_function("activation_10_rules", |b| {
        b.iter_custom(|n| time_in(&mut host, chain, "activation", &headers, n))
    });
    group.finish();
}

/// Runs `n` streams (request, then `response` chunks) and returns the time
/// spent in all of `filter`'s callbacks.
fn time_in_all(
    host: &mut Host,
    chain: ChainId,
    filter: &str,
    request: (&[(&str, &str)], &str),
    response: (&[(&str, &str)], &[&str]),
    n: u64,
) -> Duration {
    host.reset_callback_times();
    for _ in 0..n {
        let Ok(mut s) = host.stream(chain) else {
            continue;
        };
        s.request_headers(request.0, false);
        s.request_body(request.1.as_bytes(), true);
        s.response_headers(response.0, false);
        for (i, chunk) in response.1.iter().enumerate() {
            s.response_body(chunk.as_bytes(), i + 1 == response.1.len());
        }
    }
    host.callback_times()
        .into_iter()
        .filter(|(name, _, _, _)| name == filter)
        .map(|(_, _, _, t)| t)
        .sum()
}

fn metering(c: &mut Criterion) {
    let mut host = Host::new().unwrap_or_else(|e| panic!("{e:#}"));
    let config = json!({"tenant_header": "x-tenant-id", "sampling": {"percent": 1}});
    let chain = host
        .add_chain(vec![
            PluginSpec::new("metering", wasm("metering")).configuration(config.to_string()),
        ])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let request = [
        (":method", "POST"),
        (":path", "/v1/messages"),
        (":authority", "gw"),
        ("content-type", "application/json"),
        ("x-tenant-id", "acme"),
        ("x-request-id", "0d9d1e52-5bd2-4f3c-9d1b-2f0d7b6f1c11"),
    ];
    let body =
        r#"{"model":"claude-bench","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    let json_reply = r#"{"id":"msg_1","type":"message","model":"claude-bench","content":[{"type":"text","text":"hello there, how can I help you today?"}],"usage":{"input_tokens":11,"output_tokens":64}}"#;
    let mut sse = vec![
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-bench\",\"usage\":{\"input_tokens\":11,\"output_tokens\":1}}}\n\n".to_string(),
    ];
    for i in 0..64 {
        sse.push(format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"token{i} \"}}}}\n\n"));
    }
    sse.push("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":64}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_string());
    let sse: Vec<&str> = sse.iter().map(String::as_str).collect();
    let json_headers = [(":status", "200"), ("content-type", "application/json")];
    let sse_headers = [(":status", "200"), ("content-type", "text/event-stream")];
    let mut group = c.benchmark_group("hot_path");
    group.bench_function("metering_json_response", |b| {
        b.iter_custom(|n| {
            time_in_all(
                &mut host,
                chain,
                "metering",
                (&request, body),
                (&json_headers, &[json_reply]),
                n,
            )
        })
    });
    group.bench_function("metering_sse_66_chunks", |b| {
        b.iter_custom(|n| {
            time_in_all(
                &mut host,
                chain,
                "metering",
                (&request, body),
                (&sse_headers, &sse),
                n,
            )
        })
    });
    group.finish();
}

/// Time in all of post-cache's callbacks for `n` requests with bodies from
/// `body(i)`: a hit is answered from the request body callback; a miss goes
/// upstream and is stored after the response.
fn time_in_post_cache(
    host: &mut Host,
    chain: ChainId,
    body: &dyn Fn(u64) -> String,
    start: u64,
    n: u64,
) -> Duration {
    let request = [
        (":method", "POST"),
        (":path", "/v1/messages"),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ];
    let reply = r#"{"id":"msg_1","type":"message","model":"claude-bench","content":[{"type":"text","text":"hello there, how can I help you today?"}],"usage":{"input_tokens":11,"output_tokens":64}}"#;
    host.reset_callback_times();
    for i in start..start + n {
        let text = body(i);
        let Ok(mut s) = host.stream(chain) else {
            continue;
        };
        s.request_headers(&request, false);
        s.request_body(text.as_bytes(), true);
        if s.upstream().complete {
            s.response_headers(
                &[(":status", "200"), ("content-type", "application/json")],
                false,
            );
            s.response_body(reply.as_bytes(), true);
        }
    }
    host.callback_times()
        .into_iter()
        .filter(|(name, _, _, _)| name == "post-cache")
        .map(|(_, _, _, t)| t)
        .sum()
}

fn post_cache(c: &mut Criterion) {
    let mut host = Host::new().unwrap_or_else(|e| panic!("{e:#}"));
    let config = json!({
        "secret_env": "ZEROLAYER_CACHE_SECRET",
        "namespace": "shared",
        "max_entries": 1024,
        "ttl": {"default_ttl_secs": 3600},
    });
    let chain = host
        .add_chain(vec![
            PluginSpec::new("post-cache", wasm("post_cache"))
                .configuration(config.to_string())
                .env(
                    "ZEROLAYER_CACHE_SECRET",
                    "zerolayer-bench-cache-secret-0123456789abcdef",
                )
                .allow_on_headers_stop_iteration(true),
        ])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let body = |i: u64| {
        format!(
            r#"{{"model":"claude-bench","max_tokens":64,"temperature":0,"messages":[{{"role":"user","content":"Say hello to the gateway, number {i}."}}]}}"#
        )
    };
    let same = |_: u64| body(0);
    // The entry the hits are served from.
    time_in_post_cache(&mut host, chain, &same, 0, 1);
    let mut group = c.benchmark_group("hot_path");
    group.bench_function("post_cache_hit", |b| {
        b.iter_custom(|n| time_in_post_cache(&mut host, chain, &same, 0, n))
    });
    let mut next = 1;
    group.bench_function("post_cache_miss_then_store", |b| {
        b.iter_custom(|n| {
            let t = time_in_post_cache(&mut host, chain, &body, next, n);
            next += n;
            t
        })
    });
    group.finish();
}

criterion_group!(benches, lazy_auth, baselines, metering, post_cache);
criterion_main!(benches);
