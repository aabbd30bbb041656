//! What the chain's own code costs per request natively, and what quota adds
//! to it, in one run: the stages the native module runs (activation,
//! post-cache and metering with the shipped sections; lazy-auth's verdict
//! given as the hand-off it publishes) through the [`Pipeline`] on
//! `PipelineHost<FakeHost>`, hook by hook as `filters/native/src/stream.rs`
//! drives them, without and with the eight policies of envoy_load's
//! `c-native-quota` row. Issue 30's target is ≤ 2 µs added per request
//! natively; envoy_load's rows include Envoy's own work (and its noise), this
//! is the module's share of it.
//!
//! `cargo bench -p zerolayer-fused --bench chain_native`
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use serde_json::{Value, json};
use zerolayer_core::internal;
use zerolayer_core::quota::store::ModelStore;
use zerolayer_fused::{Pipeline, Stage, StageRoots};
use zerolayer_host::{Dispatched, FakeHost, Headers, PipelineHost, PipelineRoots, StageHost};

#[path = "../../quota/benches/replies/mod.rs"]
mod replies;
use replies::openai_sse;

/// 2026-12-03T00:00:00Z.
const T0_MS: u64 = 1_796_256_000_000;

/// What lazy-auth publishes for a verified JWT.
const IDENTITY: &str = "verified tenant=acme subject=u1";
/// Both answers' usage as metering's record writes it.
const USAGE_11_64: &str = r#""input_tokens":11,"output_tokens":64"#;
/// An Anthropic message (the JSON case asks `/v1/messages`).
const JSON_REPLY: &str = r#"{"id":"msg_1","type":"message","model":"claude-test","content":[{"type":"text","text":"hello there, how can I help you today?"}],"usage":{"input_tokens":11,"output_tokens":64}}"#;

/// The shipped sections (envoy/zerolayer.yaml's filters) envoy_load's native
/// rows run, and the quota section of its `-quota` rows.
fn sections(quota: bool) -> Vec<(Stage, Value)> {
    let shipped = include_str!("../../../envoy/zerolayer.yaml");
    let section = |filter: &str| -> Value {
        // The filter's configuration is the line after its name's.
        let at = shipped
            .find(&format!("name: {filter}\n"))
            .unwrap_or_else(|| panic!("envoy/zerolayer.yaml: no filter {filter}"));
        let value = shipped[at..]
            .lines()
            .find_map(|l| l.trim().strip_prefix("value: '"))
            .and_then(|v| v.strip_suffix('\''))
            .unwrap_or_else(|| panic!("envoy/zerolayer.yaml: {filter} has no value"));
        serde_json::from_str(value).unwrap_or_else(|e| panic!("{filter}: {e}"))
    };
    let mut post_cache = section("zerolayer.post_cache");
    post_cache["ttl"]["default_ttl_secs"] = json!(3600);
    // A secret cargo sets for the bench (the shipped one comes from Envoy's
    // environment).
    post_cache["secret_env"] = json!("CARGO_PKG_DESCRIPTION");
    let mut stages = vec![(Stage::Activation, section("zerolayer.activation"))];
    if quota {
        let eight: Value =
            serde_json::from_str(include_str!("../../quota/benches/eight_policies.json"))
                .unwrap_or_else(|e| panic!("eight_policies.json: {e}"));
        stages.push((Stage::Quota, eight));
    }
    stages.push((Stage::PostCache, post_cache));
    stages.push((Stage::Metering, section("zerolayer.metering")));
    stages
}

/// One request: its path, body and the backend's answer.
struct Case {
    path: &'static str,
    body: &'static str,
    content_type: &'static str,
    response: Vec<String>,
    /// What the body the backend gets must hold.
    forwarded: &'static str,
    /// What metering's record must hold: the usage and the model.
    usage: &'static str,
    model: &'static str,
}

/// The native module's worker: the stages' roots on the fake host, the
/// store (quota's leases) answered by the Rust model of Redis behind webdis.
struct Worker {
    roots: StageRoots<FakeHost, FakeHost>,
    host: PipelineRoots<FakeHost>,
    store: ModelStore,
    next_id: u32,
}

impl Worker {
    fn new(quota: bool) -> Worker {
        let mut proxy = FakeHost::default();
        proxy.clock = Duration::from_millis(T0_MS);
        let mut host = PipelineRoots::new(proxy);
        let mut roots = StageRoots::default();
        for (stage, section) in sections(quota) {
            let section = section.to_string();
            assert!(
                roots.add(stage, section.as_bytes(), &mut host),
                "{}: configuration refused",
                stage.section()
            );
        }
        Worker {
            roots,
            host,
            store: ModelStore::new(),
            next_id: 1,
        }
    }

    /// The roots' ticks and their store calls answered, outside the
    /// timing: leases refilled as the background does.
    fn background(&mut self) {
        let proxy = self.host.proxy();
        proxy.advance(Duration::from_millis(100));
        for metric in &mut proxy.metrics {
            metric.samples.clear();
        }
        for q in &mut proxy.queues {
            q.1.clear();
        }
        for _ in 0..6 {
            let now = self.host.proxy().clock.as_millis() as u64;
            self.roots.tick(&mut self.host, now, true);
            let calls = std::mem::take(&mut self.host.proxy().dispatched);
            if calls.is_empty() {
                break;
            }
            for call in calls {
                let body = store_answer(&mut self.store, &call, now);
                self.host.proxy().answer_with(Some(200), &body);
                self.roots
                    .call_answered(&mut self.host, call.token, body.len());
            }
        }
        self.host.take_woken();
    }

    /// A request's stream host, made outside the timing (the native module
    /// wraps Envoy's handles, it makes no map).
    fn request(&mut self, case: &Case) -> PipelineHost<FakeHost> {
        let length = case.body.len().to_string();
        let mut proxy = FakeHost::with_request(&[
            (":method", "POST"),
            (":path", case.path),
            (":authority", "gateway"),
            ("authorization", "Bearer eyJhbGciOiJFUzI1NiJ9.bench.sig"),
            ("cache-control", "no-store"),
            ("content-type", "application/json"),
            ("content-length", &length),
            ("user-agent", "OpenAI/Python 2.8.1"),
            ("x-request-id", "bench-request"),
        ]);
        proxy.clock = self.host.proxy().clock;
        proxy.fused = true;
        proxy.properties = BTreeMap::from([(
            internal::AUTH_PROPERTY.to_string(),
            IDENTITY.as_bytes().to_vec(),
        )]);
        proxy.request_body = case.body.as_bytes().to_vec();
        PipelineHost::stream(proxy)
    }

    /// `n` requests of `case`; the time spent in the stages' hooks.
    fn run(&mut self, n: u64, case: &Case) -> Duration {
        let mut spent = Duration::ZERO;
        for i in 0..n {
            if i % 200 == 0 {
                self.background();
            }
            spent += self.serve(case);
        }
        spent
    }

    /// A request whose lease was empty waits for its grant through its
    /// own callouts: answered (by the model of Redis, untimed) and handed
    /// to the chain as Envoy would.
    fn answer_waiting(
        &mut self,
        pipeline: &mut Pipeline<PipelineHost<FakeHost>>,
        host: &mut PipelineHost<FakeHost>,
        spent: &mut Duration,
    ) {
        for _ in 0..6 {
            let calls = std::mem::take(&mut host.proxy().dispatched);
            if calls.is_empty() {
                break;
            }
            for call in calls {
                let now = host.proxy().clock.as_millis() as u64;
                let body = store_answer(&mut self.store, &call, now);
                host.proxy().answer_with(Some(200), &body);
                timed(spent, || {
                    host.begin_callback();
                    pipeline.call_answered(host, call.token, body.len());
                    if host.take_resumed() {
                        pipeline.resume(host);
                    }
                });
            }
        }
    }

    /// One request of `case` through the chain; the time spent in the
    /// stages' hooks (each in [`timed`]).
    fn serve(&mut self, case: &Case) -> Duration {
        let mut spent = Duration::ZERO;
        let mut host = self.request(case);
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);

        let roots = &mut self.roots;
        let mut pipeline = timed(&mut spent, || {
            let mut pipeline = Pipeline::new(roots.streams(id));
            host.begin_callback();
            host.read_headers(Headers::Request);
            let _ = pipeline.request_headers(&mut host, false);
            host.begin_callback();
            let _ = pipeline.request_body(&mut host, case.body.len(), true);
            pipeline
        });
        self.answer_waiting(&mut pipeline, &mut host, &mut spent);

        host.proxy()
            .respond_with(&[(":status", "200"), ("content-type", case.content_type)]);
        timed(&mut spent, || {
            host.begin_callback();
            host.read_headers(Headers::Response);
            let _ = pipeline.response_headers(&mut host, false);
        });
        for (k, chunk) in case.response.iter().enumerate() {
            host.proxy().response_body = chunk.as_bytes().to_vec();
            let end = k + 1 == case.response.len();
            timed(&mut spent, || {
                host.begin_callback();
                let _ = pipeline.response_body(&mut host, chunk.len(), end);
            });
        }
        timed(&mut spent, || {
            host.begin_callback();
            pipeline.log(&mut host);
            drop(pipeline);
        });
        let proxy = host.proxy_ref();
        assert!(
            proxy.sent.is_empty(),
            "a bench request was answered locally: {}",
            proxy.sent[0].text()
        );
        // A row is cheaper only by doing the same work: the backend got the
        // body as metering rewrote it, and metering recorded the response's
        // usage and model.
        let forwarded = String::from_utf8_lossy(&proxy.request_body);
        assert!(
            forwarded.contains(case.forwarded),
            "the backend's body lacks {}: {forwarded}",
            case.forwarded
        );
        let entry = proxy
            .properties
            .get(internal::USAGE_PROPERTY)
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .unwrap_or_default();
        assert!(
            entry.contains(case.usage) && entry.contains(case.model),
            "metering's record lacks {} or {}: {entry}",
            case.usage,
            case.model
        );
        spent
    }
}

/// What webdis in front of `store` answers `call` (a `GET` of the command;
/// any other cluster's call gets an empty body).
fn store_answer(store: &mut ModelStore, call: &Dispatched, now_ms: u64) -> Vec<u8> {
    if call.cluster != "webdis" {
        return Vec::new();
    }
    let path = call.header(":path").unwrap_or("/");
    store.answer_webdis(path.trim_start_matches('/').as_bytes(), now_ms)
}

/// Runs `hook` (the chain's own work), adding its time to `spent`. Never
/// inlined: the instruction count's mode collects exactly these calls
/// (`--toggle-collect=chain_native::timed*`), what criterion times.
#[inline(never)]
fn timed<T>(spent: &mut Duration, hook: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = hook();
    *spent += started.elapsed();
    out
}

/// The two requests: a JSON answer and an OpenAI stream of 66 chunks.
fn cases() -> [(&'static str, Case); 2] {
    [
        (
            "json",
            Case {
                path: "/v1/messages",
                body: r#"{"model":"claude-test","max_tokens":256,"messages":[{"role":"user","content":"bench quota: how long is a piece of string?"}]}"#,
                content_type: "application/json",
                response: vec![JSON_REPLY.to_string()],
                forwarded: r#""max_tokens":256"#,
                usage: USAGE_11_64,
                model: r#""claude-test""#,
            },
        ),
        (
            "openai_sse_66_chunks",
            Case {
                path: "/v1/chat/completions",
                body: r#"{"model":"gpt-test","max_tokens":256,"stream":true,"messages":[{"role":"user","content":"bench quota stream: how long is a piece of string?"}]}"#,
                content_type: "text/event-stream",
                response: openai_sse(64),
                // Metering asks for the usage chunk.
                forwarded: r#""include_usage":true"#,
                usage: USAGE_11_64,
                model: r#""gpt-test""#,
            },
        ),
    ]
}

/// A worker past the first request of each scope (which waits for its grant).
fn warm_worker(quota: bool, case: &Case) -> Worker {
    let mut worker = Worker::new(quota);
    worker.run(2, case);
    worker.run(2, case);
    worker
}

fn chain_native(c: &mut Criterion) {
    let cases = cases();
    let mut group = c.benchmark_group("chain_native");
    for (name, case) in &cases {
        for (form, quota) in [("chain", false), ("chain_quota", true)] {
            let mut worker = warm_worker(quota, case);
            group.bench_function(format!("{name}/{form}"), |b| {
                b.iter_custom(|n| worker.run(n, case))
            });
        }
    }
    group.finish();
}

/// `CHAIN_NATIVE_REQUESTS=<n> CHAIN_NATIVE_ROW=<case>/<form>`: that row's
/// `n` requests once, untimed, for an instruction count (`cargo xtask
/// bench-instructions` runs it under callgrind, collecting
/// [`timed`]): deterministic where this VM's timings move by more
/// than quota's share.
fn count_mode(n: u64, row: &str) -> Result<(), String> {
    for (name, case) in &cases() {
        for (form, quota) in [("chain", false), ("chain_quota", true)] {
            if row == format!("{name}/{form}") {
                warm_worker(quota, case).run(n, case);
                println!("chain_native/{row}: {n} requests");
                return Ok(());
            }
        }
    }
    Err(format!("CHAIN_NATIVE_ROW: no row {row}"))
}

criterion_group!(benches, chain_native);

fn main() {
    if let Some(n) = std::env::var("CHAIN_NATIVE_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        let row = std::env::var("CHAIN_NATIVE_ROW").unwrap_or_default();
        if let Err(why) = count_mode(n, &row) {
            eprintln!("{why}");
            std::process::exit(2);
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
