//! Time spent inside the filters' request-headers callback per request, in
//! host-sim (wasmtime, Cranelift), host calls included: lazy-auth on a known
//! token (the hot path), activation with ten rules, and a trivial filter
//! (the probe without actions) as the floor every filter pays; metering's
//! whole per-request cost (every callback) for a JSON and an SSE response;
//! post-cache's for a hit and for a miss that is then stored; and the whole
//! chain (`chain/…`), as four separate filters and as the fused filter, with
//! the shipped configurations: every callback of every stage per request.
#![allow(missing_docs)]

mod common;
#[path = "../../filters/quota/benches/replies/mod.rs"]
mod replies;

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use host_sim::{CallResponse, ChainId, ClusterTarget, Host, PluginSpec};
use serde_json::{Value, json};
use zerolayer_core::quota::store::ModelStore;
use zerolayer_e2e::chain::{CACHE_SECRET, anthropic, openai};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{EnvoyConfig, paths};

use replies::openai_sse;

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
        ("user-agent", "Anthropic/Python 2.16.0"),
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

/// The shipped stage configurations (`envoy/zerolayer.yaml`) for host-sim:
/// the test issuer, the audit sink and ClickHouse answered by handlers.
fn chain_stages() -> Value {
    let shipped = EnvoyConfig::shipped("zerolayer.yaml").unwrap_or_else(|e| panic!("{e:#}"));
    let section = |name: &str| {
        shipped
            .wasm_filter_json(name)
            .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let mut lazy = section("zerolayer.lazy_auth");
    lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
    json!({
        "activation": section("zerolayer.activation"),
        "lazy_auth": lazy,
        "post_cache": section("zerolayer.post_cache"),
        "metering": section("zerolayer.metering"),
    })
}

/// A webdis in front of the model of quota's Redis scripts: the store
/// quota's leases come from, answered in host-sim.
fn model_webdis() -> ClusterTarget {
    let mut store = ModelStore::new();
    let started = std::time::Instant::now();
    ClusterTarget::Handler(Box::new(move |call| {
        let path = call
            .headers
            .iter()
            .find(|(name, _)| name == ":path")
            .map_or(&b"/"[..], |(_, value)| value.as_slice());
        let now_ms = NOW * 1000 + started.elapsed().as_millis() as u64;
        let answer = store.answer_webdis(path.strip_prefix(b"/").unwrap_or(path), now_ms);
        CallResponse::new(200, String::from_utf8_lossy(&answer).into_owned())
    }))
}

/// The chain as four filters (`fused: false`) or one, with the observer
/// singleton and its clusters; JWKS fetched. `quota` adds the fused
/// filter's `quota` section with eight policies (envoy_load's
/// `c-fused-quota`), its store answered by [`model_webdis`].
fn chain_gateway(fused: bool, quota: bool) -> (Host, ChainId) {
    let mut stages = chain_stages();
    if quota {
        stages["quota"] = common::quota_section();
    }
    let mut host = Host::new().unwrap_or_else(|e| panic!("{e:#}"));
    let jwks = issuer().jwks().to_string();
    host.set_cluster(
        "idp",
        ClusterTarget::Handler(Box::new(move |_| CallResponse::new(200, jwks.clone()))),
    );
    host.set_cluster("webdis", model_webdis());
    for sink in ["audit", "clickhouse", "api_keys"] {
        host.set_cluster(
            sink,
            ClusterTarget::Handler(Box::new(|_| CallResponse::new(200, ""))),
        );
    }
    host.add_singleton(
        PluginSpec::new("observer", wasm("observer_service"))
            .vm_id("zerolayer")
            .configuration(
                json!({"lazy_auth": stages["lazy_auth"], "metering": stages["metering"], "tick_ms": 200})
                    .to_string(),
            ),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let specs = if fused {
        vec![
            PluginSpec::new("zerolayer", wasm("fused"))
                .vm_id("zerolayer")
                .configuration(stages.to_string())
                .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET)
                .allow_on_headers_stop_iteration(true),
        ]
    } else {
        vec![
            PluginSpec::new("activation", wasm("activation"))
                .vm_id("zerolayer.activation")
                .configuration(stages["activation"].to_string()),
            PluginSpec::new("lazy-auth", wasm("lazy_auth"))
                .vm_id("zerolayer")
                .configuration(stages["lazy_auth"].to_string()),
            PluginSpec::new("post-cache", wasm("post_cache"))
                .vm_id("zerolayer.cache")
                .configuration(stages["post_cache"].to_string())
                .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET)
                .allow_on_headers_stop_iteration(true),
            PluginSpec::new("metering", wasm("metering"))
                .vm_id("zerolayer.metering")
                .configuration(stages["metering"].to_string())
                .allow_on_headers_stop_iteration(true),
        ]
    };
    let chain = host.add_chain(specs).unwrap_or_else(|e| panic!("{e:#}"));
    // The observer's first tick fetches the JWKS.
    host.advance(Duration::from_millis(300));
    (host, chain)
}

/// One request shape through the chain.
struct ChainCase {
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    /// The request body of the `i`th request.
    body: fn(u64) -> String,
    response_headers: [(&'static str, &'static str); 2],
    response: Vec<String>,
}

/// Runs requests `start..start + n` of `case` and returns the time spent in
/// all callbacks of the chain's filters (the observer's excluded).
fn time_in_chain(
    host: &mut Host,
    chain: ChainId,
    case: &ChainCase,
    start: u64,
    n: u64,
) -> Duration {
    let mut headers: Vec<(&str, &str)> = vec![
        (":method", "POST"),
        (":path", case.path),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ];
    headers.extend(case.headers.iter().map(|(k, v)| (*k, v.as_str())));
    host.reset_callback_times();
    for i in start..start + n {
        let body = (case.body)(i);
        let Ok(mut s) = host.stream(chain) else {
            continue;
        };
        s.request_headers(&headers, false);
        s.request_body(body.as_bytes(), true);
        if s.upstream().complete {
            s.response_headers(&case.response_headers, false);
            for (j, chunk) in case.response.iter().enumerate() {
                s.response_body(chunk.as_bytes(), j + 1 == case.response.len());
            }
        }
    }
    host.callback_times()
        .into_iter()
        .filter(|(name, _, _, _)| name != "observer")
        .map(|(_, _, _, t)| t)
        .sum()
}

/// Host calls per request of `case` (the observer's excluded), the most
/// frequent first: what a real host charges for, counted in host-sim.
fn host_calls_per_request(
    host: &mut Host,
    chain: ChainId,
    case: &ChainCase,
    start: u64,
    n: u64,
) -> String {
    host.count_host_calls(true);
    time_in_chain(host, chain, case, start, n);
    let mut by_function: std::collections::BTreeMap<&str, u64> = Default::default();
    for (plugin, function, calls) in host.host_calls() {
        if plugin != "observer" {
            *by_function.entry(function).or_default() += calls;
        }
    }
    host.count_host_calls(false);
    let total: u64 = by_function.values().sum();
    let mut rows: Vec<_> = by_function.into_iter().collect();
    rows.sort_by_key(|row| std::cmp::Reverse(row.1));
    let rows: Vec<String> = rows
        .iter()
        .map(|(f, c)| {
            format!(
                "{} {:.1}",
                f.trim_start_matches("proxy_"),
                *c as f64 / n as f64
            )
        })
        .collect();
    format!(
        "{:.1} host calls per request ({})",
        total as f64 / n as f64,
        rows.join(", ")
    )
}

/// An Anthropic stream of `tokens` text deltas.
fn anthropic_sse(tokens: usize) -> Vec<String> {
    let mut sse = vec![
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-test\",\"usage\":{\"input_tokens\":11,\"output_tokens\":1}}}\n\n".to_string(),
    ];
    for i in 0..tokens {
        sse.push(format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"token{i} \"}}}}\n\n"));
    }
    sse.push(format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{tokens}}}}}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"));
    sse
}

/// A verified JWT (alice of acme) as the chain benches send it.
fn alice_bearer() -> String {
    format!(
        "Bearer {}",
        issuer().es256(&tokens::claims("alice", "acme", NOW, 3600))
    )
}

/// The chain benches' JSON answer (Anthropic, with its usage).
const JSON_REPLY: &str = r#"{"id":"msg_1","type":"message","model":"claude-test","content":[{"type":"text","text":"hello there, how can I help you today?"}],"usage":{"input_tokens":11,"output_tokens":64}}"#;
/// The response headers of a JSON answer and of a stream.
const JSON_HEADERS: [(&str, &str); 2] = [(":status", "200"), ("content-type", "application/json")];
const SSE_HEADERS: [(&str, &str); 2] = [(":status", "200"), ("content-type", "text/event-stream")];

/// The whole chain per request, separate and fused, in one run: a miss
/// that is stored (JSON), a hit, an OpenAI stream that metering rewrites
/// and post-cache keys, and a `no-store` stream post-cache stays out of.
fn chain(c: &mut Criterion) {
    let bearer = alice_bearer();
    let auth = || vec![("authorization", bearer.clone())];
    let cases = [
        (
            "json_miss_stored",
            ChainCase {
                path: "/v1/messages",
                headers: auth(),
                body: |i| anthropic(&format!("bench miss {i}"), false),
                response_headers: JSON_HEADERS,
                response: vec![JSON_REPLY.to_string()],
            },
        ),
        (
            "json_hit",
            ChainCase {
                path: "/v1/messages",
                headers: auth(),
                body: |_| anthropic("bench hit", false),
                response_headers: JSON_HEADERS,
                response: vec![JSON_REPLY.to_string()],
            },
        ),
        (
            "openai_sse_66_chunks_miss",
            ChainCase {
                path: "/v1/chat/completions",
                headers: auth(),
                body: |i| openai(&format!("bench stream {i}"), true),
                response_headers: SSE_HEADERS,
                response: openai_sse(64),
            },
        ),
        (
            "no_store_sse_66_chunks",
            ChainCase {
                path: "/v1/messages",
                headers: {
                    let mut h = auth();
                    h.push(("cache-control", "no-store".to_string()));
                    h
                },
                body: |i| anthropic(&format!("bench no-store {i}"), true),
                response_headers: SSE_HEADERS,
                response: anthropic_sse(64),
            },
        ),
    ];
    let mut gateways = [
        (false, chain_gateway(false, false)),
        (true, chain_gateway(true, false)),
    ];
    let mut group = c.benchmark_group("chain");
    for (name, case) in &cases {
        for (fused, (host, chain)) in &mut gateways {
            // The first request admits the token and stores the hit's entry.
            time_in_chain(host, *chain, case, 0, 2);
            let form = if *fused { "fused" } else { "separate" };
            eprintln!(
                "chain/{name}/{form}: {}",
                host_calls_per_request(host, *chain, case, 2, 100)
            );
            let mut next = 102;
            group.bench_function(format!("{name}/{form}"), |b| {
                b.iter_custom(|n| {
                    let t = time_in_chain(host, *chain, case, next, n);
                    next += n;
                    t
                })
            });
        }
    }
    group.finish();
}

/// Time per request in each callback of the chain's filters (the
/// observer's excluded), µs, the largest first: where a stage's cost lands.
fn callback_profile(
    host: &mut Host,
    chain: ChainId,
    case: &ChainCase,
    start: u64,
    n: u64,
) -> String {
    time_in_chain(host, chain, case, start, n);
    let mut rows: Vec<(String, f64)> = host
        .callback_times()
        .into_iter()
        .filter(|(name, _, _, _)| name != "observer")
        .map(|(_, callback, _, t)| {
            (
                callback.trim_start_matches("proxy_on_").to_string(),
                t.as_secs_f64() * 1e6 / n as f64,
            )
        })
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    rows.iter()
        .map(|(callback, us)| format!("{callback} {us:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What quota (eight policies, every one scoping each request) adds to the
/// fused filter per request, in one run: a JSON answer and an OpenAI stream,
/// both kept out of the cache (`no-store`) so every request reserves and
/// settles; per callback and per host function, printed, to say where it goes.
fn chain_quota(c: &mut Criterion) {
    let bearer = alice_bearer();
    let headers = || {
        vec![
            ("authorization", bearer.clone()),
            ("cache-control", "no-store".to_string()),
        ]
    };
    let cases = [
        (
            "json",
            ChainCase {
                path: "/v1/messages",
                headers: headers(),
                body: |i| anthropic(&format!("bench quota {i}"), false),
                response_headers: JSON_HEADERS,
                response: vec![JSON_REPLY.to_string()],
            },
        ),
        (
            "openai_sse_66_chunks",
            ChainCase {
                path: "/v1/chat/completions",
                headers: headers(),
                body: |i| openai(&format!("bench quota stream {i}"), true),
                response_headers: SSE_HEADERS,
                response: openai_sse(64),
            },
        ),
    ];
    let mut gateways = [
        ("fused", chain_gateway(true, false)),
        ("fused_quota", chain_gateway(true, true)),
    ];
    let mut group = c.benchmark_group("chain_quota");
    for (name, case) in &cases {
        for (form, (host, chain)) in &mut gateways {
            // The token admitted and verified, quota's first grants answered.
            time_in_chain(host, *chain, case, 0, 2);
            host.advance(Duration::from_millis(300));
            eprintln!(
                "chain_quota/{name}/{form}: {}",
                host_calls_per_request(host, *chain, case, 2, 100)
            );
            eprintln!(
                "chain_quota/{name}/{form}: µs per request by callback: {}",
                callback_profile(host, *chain, case, 102, 200)
            );
            let mut next = 302;
            group.bench_function(format!("{name}/{form}"), |b| {
                b.iter_custom(|n| {
                    // Leases refill on the root's ticks, outside the timing.
                    host.advance(Duration::from_millis(200));
                    let t = time_in_chain(host, *chain, case, next, n);
                    next += n;
                    t
                })
            });
        }
    }
    group.finish();
}

criterion_group!(
    benches,
    lazy_auth,
    baselines,
    metering,
    post_cache,
    chain,
    chain_quota
);
criterion_main!(benches);
