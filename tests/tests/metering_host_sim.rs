//! metering in host-sim: usage from JSON bodies and SSE streams of both
//! providers, counted per tenant and model within label bounds, written for
//! the access log on every request, full records for the hash sample (or
//! when activation asks), `include_usage` injected and its chunk stripped,
//! and the observer's shipping: batches by size and age, retry with backoff,
//! the breaker, a bounded buffer with counted drops.

use std::time::Duration;

use anyhow::{Context, Result};
use host_sim::{CallResponse, ChainId, ClusterTarget, Host, PluginSpec};
use serde_json::{Value, json};
use zerolayer_e2e::{paths, sim};

const ANTHROPIC_JSON: &str = r#"{"id":"msg_1","type":"message","model":"claude-test","content":[{"type":"text","text":"a \"usage\": {} trap"}],"usage":{"input_tokens":11,"output_tokens":7,"cache_read_input_tokens":3,"cache_creation_input_tokens":2}}"#;

const ANTHROPIC_SSE: &str = concat!(
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"model\":\"claude-test\",\"usage\":{\"input_tokens\":20,\"output_tokens\":1}}}\n\n",
    "event: ping\ndata: {\"type\":\"ping\"}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
);

const OPENAI_CONTENT: &str = "data: {\"id\":\"c\",\"model\":\"gpt-test\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n";
const OPENAI_USAGE: &str = "data: {\"id\":\"c\",\"model\":\"gpt-test\",\"choices\":[],\"usage\":{\"prompt_tokens\":13,\"completion_tokens\":4,\"total_tokens\":17}}\n\n";
const OPENAI_DONE: &str = "data: [DONE]\n\n";

fn metering_config(changes: Value) -> Value {
    let mut config = json!({
        "environment": "test",
        "tenant_header": "x-tenant-id",
        "sampling": {"percent": 100},
    });
    if let (Some(base), Some(extra)) = (config.as_object_mut(), changes.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    config
}

fn metering_spec(config: &Value) -> Result<PluginSpec> {
    Ok(PluginSpec::new("metering", paths::wasm("metering")?)
        .configuration(config.to_string())
        .allow_on_headers_stop_iteration(true))
}

/// A gateway: metering (optionally behind activation) and, with a sink, the
/// observer singleton shipping to the `sink` cluster.
struct Gateway {
    host: Host,
    chain: ChainId,
}

fn gateway(config: Value) -> Result<Gateway> {
    gateway_with(config, None, ClusterTarget::Manual)
}

fn gateway_with(
    mut config: Value,
    activation: Option<Value>,
    sink: ClusterTarget,
) -> Result<Gateway> {
    let mut host = sim::host()?;
    host.set_cluster("sink", sink);
    if config.get("sink").is_some() {
        sim::observer(&mut host, "metering", &mut config, &[])?;
    }
    let mut chain = Vec::new();
    if let Some(rules) = activation {
        chain.push(
            PluginSpec::new("activation", paths::wasm("activation")?)
                .configuration(rules.to_string()),
        );
    }
    chain.push(metering_spec(&config)?);
    let chain = host.add_chain(chain)?;
    Ok(Gateway { host, chain })
}

/// How the upstream answers.
enum Reply<'a> {
    Json(u16, &'a str),
    /// SSE, sent in the given chunks.
    Sse(&'a [&'a str]),
    /// The first chunks of a stream, then a reset.
    Cut(&'a [&'a str]),
}

/// What one request left behind.
#[derive(Debug)]
struct Seen {
    /// The body the upstream got.
    upstream_body: String,
    /// What the client got.
    client_body: String,
    /// The access log's usage entry.
    usage: Option<Value>,
}

impl Gateway {
    fn send(
        &mut self,
        path: &str,
        tenant: &str,
        request_id: &str,
        body: &str,
        reply: Reply<'_>,
    ) -> Result<Seen> {
        let mut s = self.host.stream(self.chain)?;
        s.request_headers(
            &[
                (":method", "POST"),
                (":path", path),
                (":authority", "gw"),
                ("content-type", "application/json"),
                ("content-length", &body.len().to_string()),
                ("x-tenant-id", tenant),
                ("x-request-id", request_id),
            ],
            false,
        );
        s.request_body(body.as_bytes(), true);
        let upstream_body = String::from_utf8_lossy(&s.upstream().body).into_owned();
        match reply {
            Reply::Json(status, text) => {
                let status = status.to_string();
                s.response_headers(
                    &[
                        (":status", status.as_str()),
                        ("content-type", "application/json"),
                    ],
                    false,
                );
                s.response_body(text.as_bytes(), true);
            }
            Reply::Sse(chunks) | Reply::Cut(chunks) => {
                s.response_headers(
                    &[(":status", "200"), ("content-type", "text/event-stream")],
                    false,
                );
                let cut = matches!(reply, Reply::Cut(_));
                for (i, chunk) in chunks.iter().enumerate() {
                    s.response_body(chunk.as_bytes(), !cut && i + 1 == chunks.len());
                }
                if cut {
                    s.reset();
                }
            }
        }
        let client_body = s.client().text();
        let usage = sim::published(&s, "wasmx.zerolayer_usage")
            .map(|v| serde_json::from_slice(&v))
            .transpose()?;
        Ok(Seen {
            upstream_body,
            client_body,
            usage,
        })
    }

    /// A plain Anthropic request answered with [`ANTHROPIC_JSON`].
    fn plain(&mut self, tenant: &str, request_id: &str) -> Result<Seen> {
        self.send(
            "/v1/messages",
            tenant,
            request_id,
            &anthropic(false),
            Reply::Json(200, ANTHROPIC_JSON),
        )
    }

    fn counter(&self, name: &str) -> u64 {
        self.host.metric(name).unwrap_or(0)
    }

    /// Reports the filters' batched counters.
    fn flush(&mut self) {
        self.host.advance(Duration::from_millis(250));
    }
}

fn anthropic(stream: bool) -> String {
    json!({"model": "claude-test", "max_tokens": 16, "stream": stream,
           "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

fn openai(stream: bool, include_usage: Option<bool>) -> String {
    let mut body = json!({"model": "gpt-test", "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]});
    if let Some(include) = include_usage {
        body["stream_options"] = json!({"include_usage": include});
    }
    body.to_string()
}

/// `s` cut into pieces of `n` bytes (chunk boundaries anywhere, even
/// inside a line ending or a JSON string).
fn pieces(s: &str, n: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let mut at = n.min(rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        let (head, tail) = rest.split_at(at);
        out.push(head);
        rest = tail;
    }
    out
}

#[test]
fn usage_from_json_and_streams_of_both_providers() -> Result<()> {
    let mut gw = gateway(metering_config(json!({})))?;
    let json_reply = gw.plain("acme", "r-1")?;
    let usage = json_reply.usage.context("no usage entry")?;
    assert_eq!(
        (
            &usage["input_tokens"],
            &usage["output_tokens"],
            &usage["cache_read_tokens"],
            &usage["cache_creation_tokens"]
        ),
        (&json!(11), &json!(7), &json!(3), &json!(2))
    );
    assert_eq!(usage["model"], "claude-test");
    assert_eq!(usage["tenant"], "acme");
    assert_eq!(usage["request_id"], "r-1");
    assert_eq!(usage["usage_missing"], 0);
    assert_eq!(usage["streamed"], 0);
    assert_eq!(
        json_reply.client_body, ANTHROPIC_JSON,
        "the body passes unchanged"
    );

    for size in [1, 7, 64, ANTHROPIC_SSE.len()] {
        let seen = gw.send(
            "/v1/messages",
            "acme",
            "r-2",
            &anthropic(true),
            Reply::Sse(&pieces(ANTHROPIC_SSE, size)),
        )?;
        let usage = seen.usage.context("no usage entry")?;
        assert_eq!(
            (&usage["input_tokens"], &usage["output_tokens"]),
            (&json!(20), &json!(9)),
            "chunks of {size}"
        );
        assert_eq!(usage["streamed"], 1);
        assert_eq!(seen.client_body, ANTHROPIC_SSE);
    }
    let stream = [OPENAI_CONTENT, OPENAI_USAGE, OPENAI_DONE].concat();
    let seen = gw.send(
        "/v1/chat/completions",
        "globex",
        "r-3",
        &openai(true, Some(true)),
        Reply::Sse(&pieces(&stream, 5)),
    )?;
    let usage = seen.usage.context("no usage entry")?;
    assert_eq!(
        (&usage["input_tokens"], &usage["output_tokens"]),
        (&json!(13), &json!(4))
    );
    assert_eq!(usage["model"], "gpt-test");
    assert_eq!(
        seen.client_body, stream,
        "the client asked for the usage chunk"
    );

    gw.flush();
    let tokens = |tenant: &str, model: &str, kind: &str| {
        gw.counter(&format!(
            "zerolayer_metering_tokens_tenant={tenant}_model={model}_kind={kind}"
        ))
    };
    assert_eq!(tokens("acme", "claude-test", "input"), 11 + 4 * 20);
    assert_eq!(tokens("acme", "claude-test", "output"), 7 + 4 * 9);
    assert_eq!(tokens("acme", "claude-test", "cache_read"), 3);
    assert_eq!(tokens("acme", "claude-test", "cache_creation"), 2);
    assert_eq!(tokens("globex", "gpt-test", "output"), 4);
    assert_eq!(
        gw.counter("zerolayer_metering_requests_tenant=acme_model=claude-test"),
        5
    );
    assert_eq!(gw.counter("zerolayer_metering_usage_result=found"), 6);
    Ok(())
}

#[test]
fn missing_usage_is_recorded_as_missing_never_as_zero() -> Result<()> {
    let mut gw = gateway(metering_config(json!({})))?;
    // An OpenAI stream without the usage chunk.
    let stream = [OPENAI_CONTENT, OPENAI_DONE].concat();
    let seen = gw.send(
        "/v1/chat/completions",
        "acme",
        "r-1",
        &openai(true, None),
        Reply::Sse(&[&stream]),
    )?;
    assert_eq!(
        seen.usage.as_ref().map(|u| &u["usage_missing"]),
        Some(&json!(1))
    );
    // An error body, a stream cut before its usage, garbage.
    let error = r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#;
    let seen = gw.send(
        "/v1/messages",
        "acme",
        "r-2",
        &anthropic(false),
        Reply::Json(529, error),
    )?;
    let usage = seen.usage.context("no usage entry for an error")?;
    assert_eq!(
        (&usage["usage_missing"], &usage["status"]),
        (&json!(1), &json!(529))
    );
    let first = &ANTHROPIC_SSE[..ANTHROPIC_SSE.find("event: message_delta").unwrap_or(0)];
    let seen = gw.send(
        "/v1/messages",
        "acme",
        "r-3",
        &anthropic(true),
        Reply::Cut(&[first]),
    )?;
    assert_eq!(
        seen.usage.as_ref().map(|u| &u["usage_missing"]),
        Some(&json!(1)),
        "{seen:?}"
    );
    gw.send(
        "/v1/messages",
        "acme",
        "r-4",
        &anthropic(false),
        Reply::Json(200, "{\"usage\": {\"input_tokens\": \"x\"\u{0}\u{7f}"),
    )?;
    gw.flush();
    assert_eq!(gw.counter("zerolayer_metering_usage_result=missing"), 4);
    assert_eq!(gw.counter("zerolayer_metering_usage_result=found"), 0);
    assert!(
        gw.host.failed_vms().is_empty(),
        "{:?}",
        gw.host.failed_vms()
    );
    Ok(())
}

#[test]
fn include_usage_is_added_for_metering_and_its_chunk_hidden_from_the_client() -> Result<()> {
    let mut gw = gateway(metering_config(json!({"openai_include_usage": true})))?;
    let stream = [OPENAI_CONTENT, OPENAI_USAGE, OPENAI_DONE].concat();
    let seen = gw.send(
        "/v1/chat/completions",
        "acme",
        "r-1",
        &openai(true, None),
        Reply::Sse(&pieces(&stream, 9)),
    )?;
    let sent: Value = serde_json::from_str(&seen.upstream_body)?;
    assert_eq!(
        sent["stream_options"]["include_usage"], true,
        "{}",
        seen.upstream_body
    );
    assert_eq!(
        seen.client_body,
        [OPENAI_CONTENT, OPENAI_DONE].concat(),
        "the client did not ask for usage"
    );
    assert_eq!(
        seen.usage.as_ref().map(|u| &u["output_tokens"]),
        Some(&json!(4))
    );
    // A client that asked keeps its chunk; a non-streamed request is untouched.
    let seen = gw.send(
        "/v1/chat/completions",
        "acme",
        "r-2",
        &openai(true, Some(true)),
        Reply::Sse(&[&stream]),
    )?;
    assert_eq!(seen.client_body, stream);
    let plain = openai(false, None);
    let reply =
        r#"{"model":"gpt-test","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}"#;
    let seen = gw.send(
        "/v1/chat/completions",
        "acme",
        "r-3",
        &plain,
        Reply::Json(200, reply),
    )?;
    assert_eq!(seen.upstream_body, plain);
    assert_eq!(
        seen.usage.as_ref().map(|u| &u["output_tokens"]),
        Some(&json!(3))
    );
    gw.flush();
    assert_eq!(gw.counter("zerolayer_metering_include_usage_injected"), 1);
    Ok(())
}

#[test]
fn label_values_past_the_bound_count_as_other() -> Result<()> {
    let mut gw = gateway(metering_config(
        json!({"labels": {"max_tenants": 2, "max_models": 5}}),
    ))?;
    for (i, tenant) in ["a", "b", "c", "d"].iter().enumerate() {
        gw.plain(tenant, &format!("r-{i}"))?;
    }
    gw.flush();
    let requests = |tenant: &str| {
        gw.counter(&format!(
            "zerolayer_metering_requests_tenant={tenant}_model=claude-test"
        ))
    };
    assert_eq!((requests("a"), requests("b"), requests("other")), (1, 1, 2));
    assert_eq!(
        gw.host
            .metric("zerolayer_metering_requests_tenant=c_model=claude-test"),
        None
    );
    Ok(())
}

/// Decoded usage rows the sink received, in order.
fn rows(body: &[u8]) -> Result<Vec<Value>> {
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| Ok(serde_json::from_slice(l)?))
        .collect()
}

fn sink(extra: Value) -> Value {
    let mut sink = json!({"cluster": "sink", "path": "/?query=INSERT%20INTO%20zerolayer_usage%20FORMAT%20JSONEachRow",
                          "batch_max": 3, "flush_ms": 1000, "buffer_max": 100, "max_in_flight": 1});
    if let (Some(base), Some(extra)) = (sink.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    sink
}

/// Answers sink callout `token` with 200. In tick mode (the `kong`
/// profile) the observer ships what waits on its next tick, never from the
/// answer (ngx_wasm_module crashes on a callout made there): one tick later.
fn sink_answers(gw: &mut Gateway, token: u32) -> Result<()> {
    gw.host.respond(token, CallResponse::new(200, ""))?;
    if sim::kong() {
        gw.host.advance(Duration::from_millis(250));
    }
    Ok(())
}

#[test]
fn records_ship_in_batches_by_size_and_by_age() -> Result<()> {
    let mut gw = gateway(metering_config(json!({"sink": sink(json!({}))})))?;
    for i in 0..7 {
        gw.plain("acme", &format!("r-{i}"))?;
    }
    sim::settle(&mut gw.host);
    // Two full batches left at once; the seventh record waits for its age.
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 1, "one batch in flight at a time");
    let first = rows(&calls[0].body)?;
    assert_eq!(first.len(), 3);
    assert_eq!(first[0]["request_id"], "r-0");
    assert_eq!(first[0]["sample_weight"], 100.0 / 100.0);
    assert_eq!(first[0]["output_tokens"], 7);
    assert_eq!(
        calls[0]
            .headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
        Some("/?query=INSERT%20INTO%20zerolayer_usage%20FORMAT%20JSONEachRow".to_string())
    );
    sink_answers(&mut gw, calls[0].token)?;
    let calls = gw.host.callouts();
    assert_eq!(
        calls.len(),
        1,
        "the next full batch goes when the first is answered"
    );
    assert_eq!(rows(&calls[0].body)?.len(), 3);
    gw.host
        .respond(calls[0].token, CallResponse::new(200, ""))?;
    assert!(
        gw.host.callouts().is_empty(),
        "one record is not a batch yet"
    );
    gw.host.advance(Duration::from_millis(1100));
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 1, "the last record goes when it is old enough");
    assert_eq!(rows(&calls[0].body)?[0]["request_id"], "r-6");
    gw.host
        .respond(calls[0].token, CallResponse::new(200, ""))?;
    gw.flush();
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=shipped"), 7);
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=queued"), 7);
    Ok(())
}

#[test]
fn a_failing_sink_is_retried_with_backoff_behind_a_breaker_and_nothing_is_lost() -> Result<()> {
    let sink = sink(
        json!({"batch_max": 2, "backoff_ms": 500, "max_backoff_ms": 2000,
                           "breaker": {"failures": 3, "open_secs": 10}}),
    );
    let mut gw = gateway(metering_config(json!({"sink": sink})))?;
    for i in 0..2 {
        gw.plain("acme", &format!("r-{i}"))?;
    }
    sim::settle(&mut gw.host);
    let mut attempts = Vec::new();
    // Three failures: after 500 ms, then 1000 ms; then the breaker opens.
    for _ in 0..3 {
        let calls = gw.host.callouts();
        assert_eq!(calls.len(), 1, "attempt {}", attempts.len() + 1);
        attempts.push(gw.host.now_ns() / 1_000_000);
        gw.host
            .respond(calls[0].token, CallResponse::new(503, "down"))?;
        let mut waited = 0;
        while gw.host.callouts().is_empty() && waited < 20_000 {
            gw.host.advance(Duration::from_millis(100));
            waited += 100;
        }
    }
    let gaps: Vec<u64> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
    assert!((500..=700).contains(&gaps[0]), "first backoff {gaps:?}");
    assert!((1000..=1200).contains(&gaps[1]), "second backoff {gaps:?}");
    let trial_at = gw.host.now_ns() / 1_000_000;
    assert!(
        trial_at - attempts[2] >= 9_000,
        "the breaker held the sink off for its open time: {}",
        trial_at - attempts[2]
    );
    // Records posted while the sink is down wait in the buffer.
    gw.plain("acme", "r-late")?;
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 1, "the breaker's one trial");
    gw.host
        .respond(calls[0].token, CallResponse::new(200, ""))?;
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 0, "r-late waits for its age");
    gw.host.advance(Duration::from_millis(1300));
    let calls = gw.host.callouts();
    assert_eq!(rows(&calls[0].body)?[0]["request_id"], "r-late");
    gw.host
        .respond(calls[0].token, CallResponse::new(200, ""))?;
    gw.flush();
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=shipped"), 3);
    assert_eq!(gw.counter("zerolayer_metering_batches_failed"), 3);
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=dropped"), 0);
    assert!(
        !gw.host
            .logs_containing("usage sink sink down after 3 failed batches")
            .is_empty()
    );
    assert!(
        !gw.host
            .logs_containing("usage sink sink answers again")
            .is_empty()
    );
    Ok(())
}

#[test]
fn up_to_max_in_flight_batches_leave_at_once() -> Result<()> {
    let mut gw = gateway(metering_config(
        json!({"sink": sink(json!({"max_in_flight": 2}))}),
    ))?;
    for i in 0..9 {
        gw.plain("acme", &format!("r-{i}"))?;
    }
    sim::settle(&mut gw.host);
    // Three full batches: two leave, the third waits for an answer.
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 2, "two batches in flight");
    sink_answers(&mut gw, calls[0].token)?;
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 2, "the third left on the answer");
    let ids: Vec<Value> = rows(&calls[1].body)?
        .iter()
        .map(|r| r["request_id"].clone())
        .collect();
    assert_eq!(ids, ["r-6", "r-7", "r-8"]);
    Ok(())
}

#[test]
fn past_the_buffer_bound_records_are_dropped_counted_and_logged() -> Result<()> {
    let sink = sink(json!({"batch_max": 2, "buffer_max": 4}));
    let mut gw = gateway(metering_config(json!({"sink": sink})))?;
    for i in 0..10 {
        gw.plain("acme", &format!("r-{i}"))?;
    }
    // One batch of 2 in flight, 4 buffered, 4 dropped.
    gw.flush();
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=dropped"), 4);
    assert!(
        !gw.host
            .logs_containing("usage sink sink: dropped 4 records")
            .is_empty(),
        "{:?}",
        gw.host.logs()
    );
    // Every request still got its access-log entry and its metrics.
    assert_eq!(
        gw.counter("zerolayer_metering_requests_tenant=acme_model=claude-test"),
        10
    );
    Ok(())
}

#[test]
fn the_sample_is_the_same_requests_everywhere_and_activation_can_force_a_record() -> Result<()> {
    let config = metering_config(
        json!({"sampling": {"percent": 10}, "sink": sink(json!({"batch_max": 1000, "buffer_max": 1000}))}),
    );
    let activation = json!({"rules": [{"name": "vip", "when": {"tenant": {"in": ["vip"]}}, "activate": ["metering"]}],
                            "tenant_header": "x-tenant-id"});
    let mut gw = gateway_with(config, Some(activation), ClusterTarget::Manual)?;
    let ids: Vec<String> = (0..400).map(|i| format!("req-{i}")).collect();
    for id in &ids {
        gw.plain("acme", id)?;
    }
    gw.plain("vip", "vip-request")?;
    gw.host.advance(Duration::from_millis(1500));
    let calls = gw.host.callouts();
    let shipped = rows(&calls.first().context("no batch")?.body)?;
    let expected: Vec<&String> = ids
        .iter()
        .filter(|id| zerolayer_core::sampling::bucket(id.as_bytes()) < 1000)
        .collect();
    let sampled: Vec<&str> = shipped
        .iter()
        .filter_map(|r| r["request_id"].as_str())
        .filter(|id| *id != "vip-request")
        .collect();
    assert_eq!(
        sampled, expected,
        "the sample is xxh3(x-request-id) mod 10000 < 1000"
    );
    assert!(
        (20..=60).contains(&sampled.len()),
        "{} of 400 at 10%",
        sampled.len()
    );
    assert!(
        shipped
            .iter()
            .all(|r| r["request_id"] == "vip-request" || r["sample_weight"] == 10.0)
    );
    let vip = shipped.iter().find(|r| r["request_id"] == "vip-request");
    let in_sample = zerolayer_core::sampling::bucket(b"vip-request") < 1000;
    let vip = vip.context("activation's metering observer forces a record")?;
    assert_eq!(vip["sample_weight"], if in_sample { 10.0 } else { 0.0 });
    Ok(())
}

#[test]
fn bad_configuration_is_refused_with_one_line_naming_the_field() -> Result<()> {
    let mut host = sim::host()?;
    let spec = metering_spec(&json!({"sampling": {"environments": {"prod": 250}}}))?;
    assert!(host.add_chain(vec![spec]).is_err());
    let logs = host.logs_containing("metering: invalid configuration");
    assert_eq!(logs.len(), 1, "{logs:?}");
    assert!(
        logs[0].contains("sampling.environments.prod: 250 is not a percentage"),
        "{logs:?}"
    );
    Ok(())
}

#[test]
fn kong_profile_ships_records_from_the_filters_tick() -> Result<()> {
    use host_sim::{HostOptions, Profile};
    let mut config = metering_config(json!({"sink": sink(json!({"batch_max": 2}))}));
    config["observer"] = json!({"mode": "tick"});
    let mut host = Host::with_options(HostOptions {
        profile: Profile::Kong,
        kong_queues: vec!["zerolayer.jobs.metering".into()],
        ..Default::default()
    })?;
    host.set_cluster("sink", ClusterTarget::Manual);
    let chain = host.add_chain(vec![metering_spec(&config)?])?;
    let mut gw = Gateway { host, chain };
    for i in 0..2 {
        gw.plain("acme", &format!("k-{i}"))?;
    }
    // No queue notifications in Kong, and no callouts from response
    // phases: the records wait for the root's tick.
    assert!(gw.host.callouts().is_empty());
    gw.host.advance(Duration::from_millis(250));
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 1, "{:?}", gw.host.logs());
    let ids: Vec<Value> = rows(&calls[0].body)?
        .iter()
        .map(|r| r["request_id"].clone())
        .collect();
    assert_eq!(ids, [json!("k-0"), json!("k-1")]);
    Ok(())
}

/// More usage records (~50 bytes each) than 64 KiB hold.
const BURST: usize = 1500;

/// Kong with its queue declared at `queue_bytes` and metering's observer
/// on tick, bounded at `max_queued_bytes`; the sink never answers.
fn kong_gateway(queue_bytes: usize, max_queued_bytes: u64) -> Result<Gateway> {
    use host_sim::{HostOptions, Profile};
    let mut config =
        metering_config(json!({"sink": sink(json!({"batch_max": 100000, "buffer_max": 100000}))}));
    config["observer"] = json!({"mode": "tick", "max_queued_bytes": max_queued_bytes});
    let mut host = Host::with_options(HostOptions {
        profile: Profile::Kong,
        kong_queues: vec!["zerolayer.jobs.metering".into()],
        kong_queue_bytes: queue_bytes,
        ..Default::default()
    })?;
    host.set_cluster("sink", ClusterTarget::Manual);
    let chain = host.add_chain(vec![metering_spec(&config)?])?;
    Ok(Gateway { host, chain })
}

#[test]
fn a_full_kong_queue_refuses_records_counted_as_lost_instead_of_trapping() -> Result<()> {
    const BOUND: u64 = 64 * 1024;
    // Declared a little above the bound, as kong/kong.conf advises.
    let mut gw = kong_gateway(80 * 1024, BOUND)?;
    // Between two ticks, more records than the bound holds.
    for i in 0..BURST {
        gw.plain("acme", &format!("burst-{i}"))?;
    }
    assert!(
        gw.host.failed_vms().is_empty(),
        "the queue overflowed: {:?}",
        gw.host.failed_vms()
    );
    gw.flush();
    let queued = gw.counter("zerolayer_metering_records_outcome=queued");
    let lost = gw.counter("zerolayer_metering_records_outcome=lost");
    assert_eq!(queued + lost, BURST as u64);
    assert!(lost > 0 && queued > 100, "queued {queued}, lost {lost}");
    assert_eq!(
        gw.counter("zerolayer_metering_requests_tenant=acme_model=claude-test"),
        BURST as u64,
        "every request metered"
    );
    // The tick drained the queue: records are accepted again.
    for i in 0..10 {
        gw.plain("acme", &format!("after-{i}"))?;
    }
    gw.flush();
    assert_eq!(
        gw.counter("zerolayer_metering_records_outcome=queued"),
        queued + 10
    );
    assert_eq!(gw.counter("zerolayer_metering_records_outcome=lost"), lost);
    Ok(())
}

#[test]
fn without_the_bound_a_full_kong_queue_traps_which_is_why_it_exists() -> Result<()> {
    // The bound set above the declared size: the host's limit is reached
    // first, and ngx_wasm_module traps the filter.
    let mut gw = kong_gateway(16 * 1024, 1024 * 1024)?;
    for i in 0..BURST {
        gw.plain("acme", &format!("burst-{i}"))?;
    }
    let failed = gw.host.failed_vms();
    assert!(
        failed.iter().any(|f| f.contains("queue is full")),
        "host-sim's Kong queue never filled: {failed:?}"
    );
    Ok(())
}

/// Issue 21 item 5: an OpenAI body with a duplicated `stream` or
/// `stream_options` streamed to the client without the injected
/// `include_usage` (metered as usage missing, 0 tokens). Now every body that
/// could stream without the usage chunk is refused with 400 before the
/// backend sees it; item 8: `//v1/chat/completions` is metered like the API.
#[test]
fn bodies_that_could_stream_without_usage_are_refused_and_merged_slashes_are_metered() -> Result<()>
{
    let mut gw = gateway(metering_config(json!({"openai_include_usage": true})))?;
    let m = r#""model":"gpt-test","messages":[{"role":"user","content":"hi"}]"#;
    for (body, message) in [
        (
            format!(r#"{{{m},"stream":false,"stream":true}}"#),
            "request body names the member `stream` twice in one object",
        ),
        (
            format!(
                r#"{{{m},"stream":true,"stream_options":{{"include_usage":true}},"stream_options":{{}}}}"#
            ),
            "request body names the member `stream_options` twice in one object",
        ),
        (
            format!(r#"{{{m},"stream":"true"}}"#),
            "request body field `stream` is not a boolean",
        ),
    ] {
        let mut s = gw.host.stream(gw.chain)?;
        s.request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                (":authority", "gw"),
                ("content-type", "application/json"),
                ("content-length", &body.len().to_string()),
            ],
            false,
        );
        s.request_body(body.as_bytes(), true);
        assert!(!s.upstream().complete, "{body} reached the backend");
        let client = s.client();
        assert_eq!(client.status(), Some(400), "{body}");
        let error: Value = serde_json::from_str(&client.text())?;
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert_eq!(error["error"]["message"], message);
    }
    let stream = [OPENAI_CONTENT, OPENAI_USAGE, OPENAI_DONE].concat();
    let seen = gw.send(
        "//v1//chat/completions",
        "acme",
        "r-slashes",
        &openai(true, None),
        Reply::Sse(&[&stream]),
    )?;
    let sent: Value = serde_json::from_str(&seen.upstream_body)?;
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(
        seen.usage.as_ref().map(|u| &u["output_tokens"]),
        Some(&json!(4)),
        "//v1/chat/completions was not metered"
    );
    Ok(())
}
