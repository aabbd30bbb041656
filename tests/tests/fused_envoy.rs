//! The fused filter (`envoy/zerolayer-fused.yaml`) and the native module
//! (`envoy/zerolayer-native.yaml`) against the separate chain
//! (`envoy/zerolayer.yaml`) in real Envoy: the same scenario through all
//! three, compared request by request — what the client got, what reached
//! the backend, what the access log says about identity and usage — and by
//! the counters every form reports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use zerolayer_e2e::chain::{self, Chain, ChainOptions, Form, anthropic, openai};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{EnvoyConfig, wait};

/// What one request looked like from the outside.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    status: u16,
    x_cache: Option<String>,
    content_type: Option<String>,
    /// The JSON body's `usage`, or the SSE event names in order.
    shape: String,
    /// Whether the backend got it, and the body it got.
    backend_body: Option<String>,
    /// The access log's identity and token counts.
    auth: String,
    tokens: String,
}

/// An API key whose first introspection (the observer's, off the path)
/// fails: no verdict, so its second request, past its one unverified
/// request, is checked on the request path (a paused callout, resumed when
/// it answers), and that check succeeds.
const FLAKY_KEY: &str = "sk-flaky-globex";

/// The introspection endpoint: [`FLAKY_KEY`] fails once, then is active.
fn introspection() -> impl Fn(&zerolayer_e2e::SeenRequest) -> (u16, String) + Send + Sync + 'static
{
    let calls = AtomicUsize::new(0);
    move |request| {
        if request.header("x-api-key") != Some(FLAKY_KEY) {
            return chain::introspect(request);
        }
        if calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return (503, "verifier overloaded".into());
        }
        (
            200,
            r#"{"active":true,"tenant":"globex","sub":"flaky"}"#.into(),
        )
    }
}

fn shape(body: &str, content_type: Option<&str>) -> String {
    if content_type.is_some_and(|c| c.starts_with("text/event-stream")) {
        return body
            .lines()
            .filter_map(|l| {
                l.strip_prefix("event: ")
                    .or_else(|| l.strip_prefix("data: ").filter(|d| *d == "[DONE]"))
            })
            .collect::<Vec<_>>()
            .join(",");
    }
    serde_json::from_str::<Value>(body)
        .map(|v| {
            let usage = &v["usage"];
            if usage.is_null() {
                v["error"]["type"].to_string()
            } else {
                usage.to_string()
            }
        })
        .unwrap_or_else(|_| body.chars().take(60).collect())
}

/// The scenario: every path through the chain, in an order that makes each
/// step's outcome independent of timing.
fn scenario(chain: &Chain) -> Result<BTreeMap<String, Observed>> {
    chain.services.api_keys.set_handler(introspection());
    let alice = chain.verified_bearer("alice", "acme")?;
    let t = tokens::now();
    let forged = format!(
        "Bearer {}",
        issuer().forged(&tokens::claims("mallory", "acme", t, 3600), 3)
    );
    let mut ids = Vec::new();
    let mut send = |id: &str, path: &str, headers: &[(&str, &str)], body: &str| -> Result<()> {
        let mut all = vec![("x-request-id", id)];
        all.extend_from_slice(headers);
        let reply = chain.post(path, &all, body)?;
        ensure!(reply.status != 0);
        ids.push((id.to_string(), reply));
        Ok(())
    };
    let bearer = [("authorization", alice.as_str())];
    // Cache: plain and streamed, both providers; misses, then hits.
    for round in 0..2 {
        send(
            &format!("anthropic-{round}"),
            "/v1/messages",
            &bearer,
            &anthropic("fused plain", false),
        )?;
        chain.envoy.wait_metric("zerolayer_cache_stored", 1.0)?;
        send(
            &format!("openai-sse-{round}"),
            "/v1/chat/completions",
            &bearer,
            &openai("fused stream", true),
        )?;
        chain.envoy.wait_metric("zerolayer_cache_stored", 2.0)?;
        send(
            &format!("anthropic-sse-{round}"),
            "/v1/messages",
            &bearer,
            &anthropic("fused sse", true),
        )?;
        chain.envoy.wait_metric("zerolayer_cache_stored", 3.0)?;
    }
    // What is never cached: no-store, an error, a high temperature.
    let mut no_store = bearer.to_vec();
    no_store.push(("cache-control", "no-store"));
    send(
        "no-store",
        "/v1/messages",
        &no_store,
        &anthropic("fused no-store", false),
    )?;
    let mut failing = bearer.to_vec();
    failing.push(("x-stub-fault", "429"));
    send(
        "backend-429",
        "/v1/messages",
        &failing,
        &anthropic("fused 429", false),
    )?;
    let hot = json!({"model": "claude-test", "max_tokens": 8, "temperature": 1.0,
                     "messages": [{"role": "user", "content": "hot"}]})
    .to_string();
    send("hot", "/v1/messages", &bearer, &hot)?;
    // Credentials: missing, forged (its one lazy request, then refused),
    // an API key verified on the request path.
    send(
        "missing",
        "/v1/messages",
        &[],
        &anthropic("fused missing", false),
    )?;
    send(
        "forged-0",
        "/v1/messages",
        &[("authorization", &forged)],
        &anthropic("fused forged", false),
    )?;
    wait::until(
        "the forged token's verdict",
        Duration::from_secs(10),
        || {
            Ok((chain
                .envoy
                .metric(r#"zerolayer_auth_verdicts{outcome="invalid"}"#)?
                >= Some(1.0))
            .then_some(()))
        },
    )?;
    send(
        "forged-1",
        "/v1/messages",
        &[("authorization", &forged)],
        &anthropic("fused forged", false),
    )?;
    let flaky = [("x-api-key", FLAKY_KEY)];
    send(
        "flaky-key-0",
        "/v1/messages",
        &flaky,
        &anthropic("fused flaky 0", false),
    )?;
    wait::until(
        "the observer's (failing) introspection of the flaky key",
        Duration::from_secs(10),
        || {
            Ok(chain
                .services
                .api_keys
                .find("x-api-key", FLAKY_KEY)
                .map(|_| ()))
        },
    )?;
    send(
        "flaky-key-1",
        "/v1/messages",
        &flaky,
        &anthropic("fused flaky 1", false),
    )?;
    send(
        "flaky-key-2",
        "/v1/messages",
        &flaky,
        &anthropic("fused flaky 1", false),
    )?;
    send("health", "/healthz", &[], "{}")?;
    // Stampede: five identical requests at once, a slow backend. One goes
    // upstream; the others wait on its lease and are answered from the
    // cache by the root's tick. When the holder's answer is an error, the
    // root resumes them upstream instead: a resume that must run the stages
    // after post-cache (metering).
    let mut stampedes = Vec::new();
    for (name, fault) in [("stampede", "none"), ("stampede-429", "429")] {
        let body = anthropic(name, false);
        let replies = chain::concurrently(5, |n| {
            let id = format!("{name}-{n}");
            chain.post(
                "/v1/messages",
                &[
                    ("authorization", &alice),
                    ("x-stub-ttft-ms", "300"),
                    ("x-stub-fault", fault),
                    ("x-request-id", &id),
                ],
                &body,
            )
        });
        let mut outcomes = Vec::new();
        for reply in replies {
            let reply = reply?;
            outcomes.push(format!(
                "{} {}",
                reply.status,
                reply.header("x-cache").unwrap_or("-")
            ));
        }
        outcomes.sort();
        let upstream = chain.backend_requests(&format!("{name}-"));
        stampedes.push((name, outcomes.join(","), upstream));
    }

    let log = chain.wait_access_log(ids.len() + 11)?;
    let mut seen = BTreeMap::new();
    for (name, outcomes, upstream) in stampedes {
        seen.insert(
            name.to_string(),
            Observed {
                status: 0,
                x_cache: Some(outcomes),
                content_type: None,
                shape: String::new(),
                backend_body: Some(format!("{upstream} upstream")),
                auth: String::new(),
                tokens: String::new(),
            },
        );
    }
    for (id, reply) in ids {
        let line = log
            .get(&id)
            .with_context(|| format!("{id}: not in the access log"))?;
        let usage: Value = line["usage"]
            .as_str()
            .and_then(|u| serde_json::from_str(u).ok())
            .unwrap_or(Value::Null);
        let backend = chain
            .stub
            .requests()
            .into_iter()
            .find(|r| r.header("x-request-id") == Some(id.as_str()));
        seen.insert(
            id.clone(),
            Observed {
                status: reply.status,
                x_cache: reply.header("x-cache").map(str::to_string),
                content_type: reply.header("content-type").map(str::to_string),
                shape: shape(&reply.body, reply.header("content-type")),
                backend_body: backend.map(|r| String::from_utf8_lossy(&r.body).into_owned()),
                auth: line["auth"].as_str().unwrap_or("-").to_string(),
                tokens: format!(
                    "{}/{}/{}",
                    usage["input_tokens"], usage["output_tokens"], usage["usage_missing"]
                ),
            },
        );
    }
    Ok(seen)
}

/// The counters both forms must agree on.
const COUNTERS: &[&str] = &[
    "zerolayer_activation_requests",
    r#"zerolayer_cache_lookups{result="hit"}"#,
    r#"zerolayer_cache_lookups{result="miss"}"#,
    "zerolayer_cache_stored",
    r#"zerolayer_auth_decisions{outcome="valid"}"#,
    r#"zerolayer_auth_decisions{outcome="lazy"}"#,
    r#"zerolayer_auth_decisions{outcome="invalid"}"#,
    r#"zerolayer_auth_decisions{outcome="missing"}"#,
    r#"zerolayer_auth_sync{reason="exposure_bound"}"#,
    r#"zerolayer_metering_usage{result="found"}"#,
    r#"zerolayer_metering_usage{result="missing"}"#,
    r#"zerolayer_metering_requests{tenant="acme",model="claude-test"}"#,
    r#"zerolayer_metering_requests{tenant="globex",model="claude-test"}"#,
];

/// A request admitted before its credential was verified is counted under
/// the verified tenant when its verdict came before its response's end,
/// else under `unverified` (and attributed later): which one depends on
/// timing, not on the form, so the two are compared together.
const ACME: &str = r#"zerolayer_metering_requests{tenant="acme",model="claude-test"}"#;
const PENDING: &str = r#"zerolayer_metering_requests{tenant="unverified",model="claude-test"}"#;

fn counters(chain: &Chain) -> Result<BTreeMap<&'static str, f64>> {
    // Counters reach the host on the filters' ticks.
    let mut counters = wait::settled("the counters", Duration::from_secs(10), || {
        COUNTERS
            .iter()
            .chain([&PENDING])
            .map(|c| Ok((*c, chain.envoy.metric(c)?.unwrap_or(0.0))))
            .collect::<Result<BTreeMap<_, _>>>()
    })?;
    let pending = counters.remove(PENDING).unwrap_or(0.0);
    if let Some(acme) = counters.get_mut(ACME) {
        *acme += pending;
    }
    Ok(counters)
}

/// Runs the scenario through `options`' form and compares it with the
/// separate chain's; returns the chain for form-specific checks.
fn agrees(
    form: &str,
    options: ChainOptions,
    expected: &BTreeMap<String, Observed>,
    expected_counters: &BTreeMap<&'static str, f64>,
) -> Result<Chain> {
    let chain = Chain::start(options)?;
    let got = scenario(&chain)?;
    let got_counters = counters(&chain)?;
    for (id, want) in expected {
        assert_eq!(got.get(id), Some(want), "{form}: {id}");
    }
    assert_eq!(got.len(), expected.len(), "{form}");
    assert_eq!(&got_counters, expected_counters, "{form}: counters");
    Ok(chain)
}

#[test]
fn the_fused_filter_and_the_native_module_behave_as_the_separate_chain() -> Result<()> {
    let separate = Chain::start(ChainOptions::default())?;
    let expected = scenario(&separate)?;
    let expected_counters = counters(&separate)?;
    drop(separate);
    let native = agrees(
        "native",
        ChainOptions {
            form: Form::Native,
            ..ChainOptions::default()
        },
        &expected,
        &expected_counters,
    )?;
    let log = native.envoy.log();
    assert!(
        log.contains(
            "zerolayer-native: chain with stages lazy_auth → activation → post_cache → metering (observer on its thread)"
        ),
        "{}",
        native.envoy.log_tail(30)
    );
    drop(native);
    let fused = agrees(
        "fused",
        ChainOptions {
            form: Form::Fused,
            ..ChainOptions::default()
        },
        &expected,
        &expected_counters,
    )?;
    // The scenario did what it says: hits, a path-side introspection.
    assert_eq!(expected["anthropic-1"].x_cache.as_deref(), Some("HIT"));
    assert_eq!(expected["openai-sse-1"].x_cache.as_deref(), Some("HIT"));
    assert_eq!(expected["forged-1"].status, 401);
    assert_eq!(expected["missing"].status, 401);
    // Verified on the request path: paused, resumed, through the later stages.
    assert_eq!(
        expected["flaky-key-1"].status, 200,
        "{:?}",
        expected["flaky-key-1"]
    );
    assert_eq!(
        expected["flaky-key-1"].auth,
        "verified tenant=globex subject=flaky"
    );
    assert_eq!(expected["flaky-key-1"].x_cache.as_deref(), Some("MISS"));
    assert_eq!(
        expected["stampede"].x_cache.as_deref(),
        Some("200 HIT,200 HIT,200 HIT,200 HIT,200 MISS"),
        "{:?}",
        expected["stampede"]
    );
    assert_eq!(
        expected["stampede"].backend_body.as_deref(),
        Some("1 upstream")
    );
    assert!(expected_counters[r#"zerolayer_auth_sync{reason="exposure_bound"}"#] >= 1.0);
    let log = fused.envoy.log();
    assert!(
        log.contains(
            "zerolayer: fused filter with stages lazy_auth → activation → post_cache → metering"
        ),
        "{}",
        fused.envoy.log_tail(30)
    );
    Ok(())
}

#[test]
fn the_fused_config_embeds_the_separate_filters_configs() -> Result<()> {
    let separate = EnvoyConfig::shipped("zerolayer.yaml")?;
    let fused = EnvoyConfig::shipped("zerolayer-fused.yaml")?;
    let sections = fused.wasm_filter_json("zerolayer")?;
    for (section, filter) in [
        ("activation", "zerolayer.activation"),
        ("lazy_auth", "zerolayer.lazy_auth"),
        ("post_cache", "zerolayer.post_cache"),
        ("metering", "zerolayer.metering"),
    ] {
        assert_eq!(
            sections[section],
            separate.wasm_filter_json(filter)?,
            "envoy/zerolayer-fused.yaml's {section} drifted from envoy/zerolayer.yaml"
        );
    }
    assert_eq!(
        fused.service_config("zerolayer.observer")?,
        separate.service_config("zerolayer.observer")?
    );
    let native = EnvoyConfig::shipped("zerolayer-native.yaml")?;
    let mut native_sections: Value =
        serde_json::from_str(&native.native_filter_config("zerolayer")?)?;
    let upstreams = native_sections
        .as_object_mut()
        .and_then(|s| s.remove("native"))
        .expect("the native section");
    assert_eq!(
        native_sections, sections,
        "envoy/zerolayer-native.yaml's sections drifted from envoy/zerolayer-fused.yaml's"
    );
    // The observer's thread reaches the same services as the singleton's clusters.
    for cluster in ["idp", "api_keys", "audit", "clickhouse"] {
        assert!(
            upstreams["upstreams"][cluster].is_string(),
            "no upstream for {cluster}"
        );
    }
    zerolayer_e2e::paths::native_module()?;
    for file in ["zerolayer-fused.yaml", "zerolayer-native.yaml"] {
        let validation = zerolayer_e2e::Envoy::validate_file_with_env(
            &zerolayer_e2e::paths::envoy_config(file),
            &[("ZEROLAYER_CACHE_SECRET".into(), chain::CACHE_SECRET.into())],
        )?;
        assert!(validation.ok, "{file}: {}", validation.output);
    }
    Ok(())
}

#[test]
fn a_bad_section_is_refused_naming_the_stage_and_the_field() -> Result<()> {
    zerolayer_e2e::paths::native_module()?;
    // What the fused filter says, and what the native module says.
    for (config, fused, native) in [
        (
            json!({"lazy_auth": {}, "cache": {}}),
            "zerolayer: invalid configuration: cache: unknown stage",
            "zerolayer-native: invalid configuration: zerolayer: cache: unknown stage",
        ),
        (
            json!({}),
            "zerolayer: invalid configuration: no stage configured",
            "zerolayer-native: invalid configuration: zerolayer: no stage configured",
        ),
        (
            json!({"activation": {"rules": [{"name": "ok"}, {"name": "broken", "when": {"path": {"matches": "("}}}]}}),
            "activation: invalid configuration: rules[1].when.path.matches",
            "activation: invalid configuration: rules[1].when.path.matches",
        ),
        (
            json!({"activation": {}, "native": {"queue": 1}}),
            "zerolayer: invalid configuration: native: unknown stage",
            "zerolayer-native: invalid configuration: zerolayer: native.queue: unknown field `queue`",
        ),
    ] {
        for (file, want) in [
            ("zerolayer-fused.yaml", fused),
            ("zerolayer-native.yaml", native),
        ] {
            let mut envoy = EnvoyConfig::shipped(file)?
                .for_run(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?
                .env("ZEROLAYER_CACHE_SECRET", chain::CACHE_SECRET);
            if file == "zerolayer-native.yaml" {
                envoy.set_native_filter_config("zerolayer", &config.to_string())?;
            } else {
                envoy.set_wasm_filter_config("zerolayer", &config.to_string())?;
            }
            let validation = zerolayer_e2e::Envoy::validate(&envoy)?;
            assert!(!validation.ok, "{file}: {config}: Envoy accepted it");
            assert!(
                validation.output.contains(want),
                "{file}: {config}: {}",
                validation.output
            );
        }
    }
    Ok(())
}
