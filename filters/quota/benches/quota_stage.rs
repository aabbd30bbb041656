//! What the quota stage costs per request natively, in one run: the stage's
//! own callbacks (request headers → body → response headers → body → log)
//! on the fake host, with no policy (the floor: the callbacks and the fake
//! host's calls), one policy, and the eight of envoy_load's quota rows
//! (`eight_policies.json`). Issue 30's target is ≤ 2 µs added per request
//! natively; this isolates the stage's share of it from Envoy's.
//!
//! `cargo bench -p zerolayer-quota --bench quota_stage`
#![allow(missing_docs)]

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::Value;
use zerolayer_core::internal;
use zerolayer_core::quota::store::ModelStore;
use zerolayer_host::{FakeHost, RootStage, StreamStage};
use zerolayer_quota::QuotaRoot;

mod replies;
use replies::openai_sse;

/// 2026-12-03T00:00:00Z.
const T0_MS: u64 = 1_796_256_000_000;

const IDENTITY: &str = "verified tenant=acme subject=u1";
const REQUEST: &str = r#"{"model":"gpt-test","max_tokens":256,"stream":false,"messages":[{"role":"user","content":"bench quota: how long is a piece of string?"}]}"#;
const JSON_REPLY: &str = r#"{"id":"c1","object":"chat.completion","model":"gpt-test","choices":[{"index":0,"message":{"role":"assistant","content":"hello there, how can I help you today?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":64,"total_tokens":75}}"#;

/// The stage's root on the fake host, its store answered by the Rust model
/// of Redis behind webdis.
struct Gateway {
    host: FakeHost,
    root: QuotaRoot,
    store: ModelStore,
}

impl Gateway {
    /// `config`: the stage's section; `None`, the root unconfigured (its
    /// streams do nothing: the floor).
    fn new(config: Option<&Value>) -> Gateway {
        let mut host = FakeHost::default();
        host.clock = Duration::from_millis(T0_MS);
        let mut root = QuotaRoot::default();
        if let Some(config) = config {
            assert!(
                RootStage::<FakeHost>::configure(
                    &mut root,
                    &mut host,
                    config.to_string().as_bytes()
                ),
                "configuration refused"
            );
        }
        let mut gateway = Gateway {
            host,
            root,
            store: ModelStore::new(),
        };
        gateway.sync();
        gateway
    }

    /// The root's tick, its store calls answered, until it asks nothing
    /// more: leases refilled outside the timing, as the background does.
    fn sync(&mut self) {
        // The fake keeps every histogram sample: kept from growing.
        for metric in &mut self.host.metrics {
            metric.samples.clear();
        }
        for _ in 0..6 {
            RootStage::<FakeHost>::tick(&mut self.root, &mut self.host);
            let calls = std::mem::take(&mut self.host.dispatched);
            if calls.is_empty() {
                break;
            }
            let now = self.host.clock.as_millis() as u64;
            for call in calls {
                let path = call.header(":path").unwrap_or("/").to_string();
                let body = self
                    .store
                    .answer_webdis(path.trim_start_matches('/').as_bytes(), now);
                self.host.answer_with(Some(200), &body);
                RootStage::<FakeHost>::call_answered(
                    &mut self.root,
                    &mut self.host,
                    call.token,
                    body.len(),
                );
            }
        }
    }

    /// `n` requests answered with `response` (chunks) of `content_type`;
    /// the time spent in the stage's callbacks only.
    fn run(&mut self, n: u64, content_type: &str, response: &[String]) -> Duration {
        let mut spent = Duration::ZERO;
        for i in 0..n {
            if i % 500 == 0 {
                self.host.advance(Duration::from_millis(100));
                self.sync();
            }
            let length = REQUEST.len().to_string();
            self.host.request_headers = [
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("authorization", "Bearer sk-bench-0123456789"),
                ("content-type", "application/json"),
                ("content-length", length.as_str()),
            ]
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
            self.host
                .properties
                .insert(internal::AUTH_PROPERTY.into(), IDENTITY.as_bytes().to_vec());
            self.host.request_body = REQUEST.as_bytes().to_vec();
            self.host.response_headers.clear();

            let started = Instant::now();
            let mut stream: Box<dyn StreamStage<FakeHost>> =
                RootStage::<FakeHost>::stream(&self.root, 1);
            let _ = stream.request_headers(&mut self.host, false);
            let _ = stream.request_body(&mut self.host, REQUEST.len(), true);
            spent += started.elapsed();

            self.host
                .respond_with(&[(":status", "200"), ("content-type", content_type)]);
            let started = Instant::now();
            let _ = stream.response_headers(&mut self.host, false);
            spent += started.elapsed();
            for (k, chunk) in response.iter().enumerate() {
                self.host.response_body = chunk.as_bytes().to_vec();
                let end = k + 1 == response.len();
                let started = Instant::now();
                let _ = stream.response_body(&mut self.host, chunk.len(), end);
                spent += started.elapsed();
            }
            let started = Instant::now();
            stream.log(&mut self.host);
            drop(stream);
            spent += started.elapsed();
            assert!(self.host.sent.is_empty(), "a bench request was refused");
        }
        spent
    }
}

fn quota_stage(c: &mut Criterion) {
    let eight: Value = serde_json::from_str(include_str!("eight_policies.json")).unwrap();
    let mut one = eight.clone();
    one["policies"].as_array_mut().unwrap().truncate(1);
    let json = vec![JSON_REPLY.to_string()];
    let sse = openai_sse(64);
    let cases: [(&str, &str, &[String]); 2] = [
        ("json", "application/json", &json),
        ("openai_sse_66_chunks", "text/event-stream", &sse),
    ];
    let mut group = c.benchmark_group("quota_stage");
    for (case, content_type, response) in cases {
        for (policies, config) in [("none", None), ("one", Some(&one)), ("eight", Some(&eight))] {
            let mut gateway = Gateway::new(config);
            // The first request of each scope waits for its grant: past it.
            gateway.run(2, content_type, response);
            group.bench_function(format!("{case}/{policies}"), |b| {
                b.iter_custom(|n| gateway.run(n, content_type, response))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, quota_stage);
criterion_main!(benches);
