//! The fused filter against the separate chain in host-sim, on virtual time
//! (run under both host profiles, like the filters' own suites):
//! the same requests through both (the shipped stage configurations, every
//! unknown credential verified on the request path so API keys take the
//! paused-callout path), compared request by request and by counters.

use std::time::Duration;

use anyhow::Result;
use host_sim::{CallResponse, ChainId, ClusterTarget, Host, PluginSpec};
use serde_json::{Value, json};
use zerolayer_e2e::chain::{CACHE_SECRET, GOOD_API_KEY, anthropic, openai};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{EnvoyConfig, paths, sim};

/// host-sim's fixed virtual start, seconds.
const NOW: u64 = 1_795_953_600;

/// The stage configurations from `envoy/zerolayer.yaml`, for host-sim:
/// test issuer, no lazy admission (so API keys are introspected with the
/// request paused), every usage record shipped.
fn stages() -> Result<Value> {
    let shipped = EnvoyConfig::shipped("zerolayer.yaml")?;
    let mut lazy = shipped.wasm_filter_json("zerolayer.lazy_auth")?;
    lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
    lazy["max_unverified_per_token"] = json!(0);
    lazy["audit"] = Value::Null;
    let mut metering = shipped.wasm_filter_json("zerolayer.metering")?;
    metering["sampling"] = json!({"percent": 100});
    // Kong: no singleton; each stage's observer runs on its tick.
    sim::observer_mode(&mut lazy);
    sim::observer_mode(&mut metering);
    Ok(json!({
        "activation": shipped.wasm_filter_json("zerolayer.activation")?,
        "lazy_auth": lazy,
        "post_cache": shipped.wasm_filter_json("zerolayer.post_cache")?,
        "metering": metering,
    }))
}

fn gateway(fused: bool) -> Result<(Host, ChainId)> {
    let stages = stages()?;
    let mut host = sim::host()?;
    let jwks = issuer().jwks().to_string();
    host.set_cluster(
        "idp",
        ClusterTarget::Handler(Box::new(move |_| CallResponse::new(200, jwks.clone()))),
    );
    host.set_cluster(
        "api_keys",
        ClusterTarget::Handler(Box::new(|call| {
            let key = call
                .headers
                .iter()
                .find(|(k, _)| k == "x-api-key")
                .map(|(_, v)| v.as_slice());
            let body = if key == Some(GOOD_API_KEY.as_bytes()) {
                r#"{"active":true,"tenant":"globex","sub":"batch"}"#
            } else {
                r#"{"active":false}"#
            };
            CallResponse::new(200, body)
        })),
    );
    host.set_cluster(
        "clickhouse",
        ClusterTarget::Handler(Box::new(|_| CallResponse::new(200, ""))),
    );
    if !sim::kong() {
        host.add_singleton(
            PluginSpec::new("observer", paths::wasm("observer_service")?)
                .vm_id("zerolayer")
                .configuration(
                    json!({"lazy_auth": stages["lazy_auth"], "metering": stages["metering"], "tick_ms": 100})
                        .to_string(),
                ),
        )?;
    }
    let specs = if fused {
        vec![
            PluginSpec::new("zerolayer", paths::wasm("fused")?)
                .vm_id("zerolayer")
                .configuration(stages.to_string())
                .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET)
                .allow_on_headers_stop_iteration(true),
        ]
    } else {
        vec![
            PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
                .vm_id("zerolayer")
                .configuration(stages["lazy_auth"].to_string()),
            PluginSpec::new("activation", paths::wasm("activation")?)
                .vm_id("zerolayer.activation")
                .configuration(stages["activation"].to_string()),
            PluginSpec::new("post-cache", paths::wasm("post_cache")?)
                .vm_id("zerolayer.cache")
                .configuration(stages["post_cache"].to_string())
                .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET)
                .allow_on_headers_stop_iteration(true),
            PluginSpec::new("metering", paths::wasm("metering")?)
                .vm_id("zerolayer.metering")
                .configuration(stages["metering"].to_string())
                .allow_on_headers_stop_iteration(true),
        ]
    };
    let chain = host.add_chain(specs)?;
    // The observer's first tick fetches the JWKS.
    host.advance(Duration::from_millis(300));
    Ok((host, chain))
}

const JSON_REPLY: &str = r#"{"id":"msg_1","type":"message","model":"claude-test","content":[{"type":"text","text":"hello"}],"usage":{"input_tokens":5,"output_tokens":1}}"#;

const OPENAI_SSE: &[&str] = &[
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}\n\n",
    "data: [DONE]\n\n",
];

/// Everything one request left visible.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    status: Option<u16>,
    x_cache: Option<String>,
    body: String,
    upstream_body: Option<String>,
    auth: Option<String>,
    usage: Option<String>,
}

fn send(
    host: &mut Host,
    chain: ChainId,
    path: &str,
    extra: &[(&str, &str)],
    body: &str,
) -> Result<Seen> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    let mut s = host.stream(chain)?;
    s.request_headers(&headers, false);
    s.request_body(body.as_bytes(), true);
    let upstream = s.upstream();
    let upstream_body = upstream
        .complete
        .then(|| String::from_utf8_lossy(&upstream.body).into_owned());
    if upstream.complete {
        if path.contains("chat") {
            s.response_headers(
                &[(":status", "200"), ("content-type", "text/event-stream")],
                false,
            );
            for (i, chunk) in OPENAI_SSE.iter().enumerate() {
                s.response_body(chunk.as_bytes(), i + 1 == OPENAI_SSE.len());
            }
        } else {
            s.response_headers(
                &[(":status", "200"), ("content-type", "application/json")],
                false,
            );
            s.response_body(JSON_REPLY.as_bytes(), true);
        }
    }
    let text = |k: &str| sim::published(&s, k).map(|v| String::from_utf8_lossy(&v).into_owned());
    // Latency differs run to run; the rest of the usage entry must not.
    let usage = text("wasmx.zerolayer_usage").map(|u| {
        let mut v: Value = serde_json::from_str(&u).unwrap_or(Value::Null);
        v["latency_ms"] = Value::Null;
        v.to_string()
    });
    let client = s.client();
    Ok(Seen {
        status: client.status(),
        x_cache: client.header("x-cache").map(str::to_string),
        body: client.text(),
        upstream_body,
        auth: text("wasmx.zerolayer_auth"),
        usage,
    })
}

/// What each named request left visible.
type Outcomes = Vec<(String, Seen)>;
/// Counter values by name.
type Counters = Vec<(String, Option<u64>)>;

/// One request: name, path, headers, body.
type Case<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>, String);

fn scenario(fused: bool) -> Result<(Outcomes, Counters)> {
    let (mut host, chain) = gateway(fused)?;
    let alice = format!(
        "Bearer {}",
        issuer().es256(&tokens::claims("alice", "acme", NOW, 3600))
    );
    let forged = format!(
        "Bearer {}",
        issuer().forged(&tokens::claims("mallory", "acme", NOW, 3600), 5)
    );
    let jwt = [("authorization", alice.as_str())];
    let key = [("x-api-key", GOOD_API_KEY)];
    let cases: Vec<Case<'_>> = vec![
        (
            "jwt-miss",
            "/v1/messages",
            jwt.to_vec(),
            anthropic("sim plain", false),
        ),
        (
            "jwt-hit",
            "/v1/messages",
            jwt.to_vec(),
            anthropic("sim plain", false),
        ),
        (
            "sse-miss",
            "/v1/chat/completions",
            jwt.to_vec(),
            openai("sim stream", true),
        ),
        (
            "sse-hit",
            "/v1/chat/completions",
            jwt.to_vec(),
            openai("sim stream", true),
        ),
        (
            "key-first",
            "/v1/messages",
            key.to_vec(),
            anthropic("sim key", false),
        ),
        (
            "key-hit",
            "/v1/messages",
            key.to_vec(),
            anthropic("sim key", false),
        ),
        (
            "bad-key",
            "/v1/messages",
            vec![("x-api-key", "sk-nope")],
            anthropic("sim key", false),
        ),
        (
            "forged",
            "/v1/messages",
            vec![("authorization", forged.as_str())],
            anthropic("sim plain", false),
        ),
        (
            "missing",
            "/v1/messages",
            vec![],
            anthropic("sim plain", false),
        ),
        (
            "no-store",
            "/v1/messages",
            vec![
                ("authorization", alice.as_str()),
                ("cache-control", "no-store"),
            ],
            anthropic("sim plain", false),
        ),
    ];
    let mut seen = Vec::new();
    for (name, path, headers, body) in cases {
        let mut all = headers.clone();
        all.push(("x-request-id", name));
        seen.push((name.to_string(), send(&mut host, chain, path, &all, &body)?));
        host.advance(Duration::from_millis(10));
    }
    host.advance(Duration::from_secs(2));
    let counters = [
        "zerolayer_activation_requests",
        "zerolayer_cache_lookups_result=hit",
        "zerolayer_cache_lookups_result=miss",
        "zerolayer_cache_stored",
        "zerolayer_auth_decisions_outcome=sync_valid",
        "zerolayer_auth_decisions_outcome=valid",
        "zerolayer_auth_decisions_outcome=sync_invalid",
        "zerolayer_auth_decisions_outcome=missing",
        "zerolayer_metering_usage_result=found",
        "zerolayer_metering_records_outcome=queued",
    ]
    .iter()
    .map(|n| (n.to_string(), host.metric(n)))
    .collect();
    assert!(host.failed_vms().is_empty(), "{:?}", host.failed_vms());
    Ok((seen, counters))
}

#[test]
fn the_fused_filter_behaves_as_the_separate_chain_in_host_sim() -> Result<()> {
    let (separate, separate_counters) = scenario(false)?;
    let (fused, fused_counters) = scenario(true)?;
    for ((name, want), (_, got)) in separate.iter().zip(&fused) {
        assert_eq!(got, want, "{name}");
    }
    assert_eq!(fused_counters, separate_counters);
    let counted: Vec<_> = separate_counters
        .iter()
        .filter(|(_, v)| v.unwrap_or(0) > 0)
        .collect();
    assert!(
        counted.len() >= 8,
        "counters mostly absent: {separate_counters:?}"
    );
    // The scenario exercised what it claims.
    let by = |n: &str| &separate.iter().find(|(k, _)| k == n).expect("case").1;
    assert_eq!(by("jwt-hit").x_cache.as_deref(), Some("HIT"));
    assert_eq!(by("sse-hit").x_cache.as_deref(), Some("HIT"));
    assert_eq!(by("key-first").status, Some(200));
    assert!(
        by("key-first")
            .auth
            .as_deref()
            .is_some_and(|a| a.starts_with("verified"))
    );
    assert!(
        by("sse-miss")
            .upstream_body
            .as_deref()
            .is_some_and(|b| b.contains("include_usage"))
    );
    assert_eq!(by("bad-key").status, Some(401));
    assert_eq!(by("forged").status, Some(401));
    assert_eq!(by("missing").status, Some(401));
    Ok(())
}
