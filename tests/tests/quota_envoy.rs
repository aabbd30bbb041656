//! quota in real Envoy, in both Wasm forms: the shipped separate chain
//! (`envoy/zerolayer.yaml`) with `zerolayer_quota.wasm` after lazy-auth,
//! and the shipped fused filter (`envoy/zerolayer-fused.yaml`) with a
//! `quota` section; its leases filled from a real
//! Redis through webdis, against the GPU backend stub. What a client sees
//! (200s with the rate-limit headers, then the 429 of an exhausted budget in
//! its provider's format), and that Redis ends up holding exactly the
//! tokens the responses reported.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_e2e::chain::{CACHE_SECRET, Form, anthropic, openai, reported_usage};
use zerolayer_e2e::fleet::RedisFleet;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, MockServer, paths, wait};
use zerolayer_stub::{Stub, StubConfig};

const PREFIX: &str = "zl:e2e:";

/// Envoy with quota (policies `policies`) in front of `backend`, its store
/// `webdis`; JWTs verified synchronously with the test issuer's keys.
struct Gateway {
    envoy: Envoy,
    _idp: MockServer,
    client: Client,
}

fn gateway(
    form: Form,
    backend: std::net::SocketAddr,
    webdis: std::net::SocketAddr,
    policies: Value,
) -> Result<Gateway> {
    gateway_of(form, backend, webdis, policies, 1)
}

/// [`gateway`], one of `expected` sharing the store.
fn gateway_of(
    form: Form,
    backend: std::net::SocketAddr,
    webdis: std::net::SocketAddr,
    policies: Value,
    expected: u32,
) -> Result<Gateway> {
    let jwks = issuer().jwks().to_string();
    let idp = MockServer::start(move |_| (200, jwks.clone()))?;
    let mut config = EnvoyConfig::shipped(form.file())?
        .for_run(backend)?
        .point_cluster("idp", idp.addr())?
        .add_cluster("webdis", webdis)?
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    let quota = json!({
        "store": {"cluster": "webdis", "path": "/", "timeout_ms": 500, "key_prefix": PREFIX,
                  "sync_interval_ms": 100, "lease_ttl_ms": 200, "idle_return_ms": 300,
                  "expected_gateways": expected},
        "policies": policies,
    });
    let verify = |lazy: &mut Value| {
        lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
        lazy["jwt"]["keys"] = issuer().jwks()["keys"].clone();
        lazy["unknown"] = json!("sync");
        lazy["audit"] = Value::Null;
    };
    let lazy = match form {
        Form::Separate => {
            paths::wasm("quota")?;
            let mut lazy: Value =
                serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
            verify(&mut lazy);
            config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
            config.insert_wasm_filter_after(
                "zerolayer.lazy_auth",
                "zerolayer.quota",
                "quota",
                "zerolayer.quota",
                &quota.to_string(),
            )?;
            lazy
        }
        Form::Fused => {
            let mut sections = config.wasm_filter_json("zerolayer")?;
            verify(&mut sections["lazy_auth"]);
            sections["quota"] = quota;
            config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
            sections["lazy_auth"].clone()
        }
        Form::Native => anyhow::bail!("quota is not in the native module yet"),
    };
    let service = json!({"lazy_auth": lazy, "tick_ms": 100});
    config.set_service_config("zerolayer.observer", &service.to_string())?;
    let envoy = Envoy::start(&config)?;
    Ok(Gateway {
        envoy,
        _idp: idp,
        client: Client::new(),
    })
}

/// The Wasm forms quota runs in.
const FORMS: [Form; 2] = [Form::Separate, Form::Fused];

impl Gateway {
    fn post(&self, bearer: &str, path: &str, body: &str) -> Result<zerolayer_e2e::Reply> {
        self.client.send(
            "POST",
            &self.envoy.url(path),
            &[
                ("authorization", bearer),
                ("content-type", "application/json"),
            ],
            body,
        )
    }
}

fn bearer(subject: &str, tenant: &str) -> String {
    let token = issuer().es256(&tokens::claims(subject, tenant, tokens::now(), 3600));
    format!("Bearer {token}")
}

/// One daily token budget of `amount` per tenant.
fn daily_tokens(amount: u64) -> Value {
    json!([{"name": "daily", "scope": ["tenant"], "unit": "tokens",
            "limit": {"budget": {"amount": amount, "window": "day"}}}])
}

#[test]
fn a_tenant_spends_its_budget_then_gets_insufficient_quota_and_redis_holds_what_was_used()
-> Result<()> {
    for form in FORMS {
        spends_its_budget(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn spends_its_budget(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(600))?;
    let acme = bearer("alice", "acme");
    let (mut used, mut admitted, mut last_remaining) = (0i64, 0, u64::MAX);
    let mut refusal = None;
    for i in 0..60 {
        let (path, body) = if i % 2 == 0 {
            let mut body: Value =
                serde_json::from_str(&openai(&format!("question {i}"), i % 4 == 0))?;
            if i % 4 == 0 {
                // The client asks for usage itself, so it sees what is billed.
                body["stream_options"] = json!({"include_usage": true});
            }
            ("/v1/chat/completions", body.to_string())
        } else {
            (
                "/v1/messages",
                anthropic(&format!("question {i}"), i % 3 == 0),
            )
        };
        let reply = gw.post(&acme, path, &body)?;
        if reply.status == 429 {
            refusal = Some((path, reply));
            break;
        }
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        admitted += 1;
        let (input, output) = reported_usage(&reply.body)?;
        used += (input + output) as i64;
        let remaining = if path == "/v1/messages" {
            reply.header("anthropic-ratelimit-tokens-remaining")
        } else {
            reply.header("x-ratelimit-remaining-tokens")
        }
        .with_context(|| format!("{path}: no remaining header: {:?}", reply.headers))?
        .parse::<u64>()?;
        assert!(
            remaining < last_remaining,
            "remaining only goes down: {remaining} after {last_remaining}"
        );
        last_remaining = remaining;
    }
    let (path, refused) = refusal.context("60 requests never exhausted a 600-token budget")?;
    assert!(admitted >= 3, "only {admitted} requests admitted");
    let error: Value = serde_json::from_str(&refused.body)?;
    if path == "/v1/messages" {
        assert_eq!(error["type"], "error", "{}", refused.body);
        assert_eq!(error["error"]["type"], "rate_limit_error");
    } else {
        assert_eq!(
            error["error"]["code"], "insufficient_quota",
            "{}",
            refused.body
        );
    }
    assert_eq!(refused.header("x-should-retry"), Some("false"));
    // The backend never saw the refused request.
    assert_eq!(
        stub.requests().len(),
        admitted,
        "every admitted request reached the backend, no refused one"
    );
    // Settled exactly, and the idle lease gave back what it held: Redis
    // holds what the responses reported, no more.
    wait::until("Redis to hold what was used", Duration::from_secs(10), || {
        let total = fleet.budget_total(PREFIX)?;
        Ok((total == used).then_some(()))
    })
    .with_context(|| {
        let stats = gw.envoy.prometheus().unwrap_or_default();
        let quota: Vec<&str> = stats.lines().filter(|l| l.contains("quota")).collect();
        format!(
            "Redis holds {:?}, the responses reported {used} ({admitted} admitted); Envoy's quota metrics:\n{}\nlog:\n{}",
            fleet.budget_total(PREFIX),
            quota.join("\n"),
            gw.envoy.log_tail(30)
        )
    })?;
    Ok(())
}

#[test]
fn a_forged_token_claiming_a_tenant_spends_none_of_its_budget() -> Result<()> {
    for form in FORMS {
        forged_tokens(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn forged_tokens(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(100_000))?;
    let reply = gw.post(
        &bearer("alice", "acme"),
        "/v1/messages",
        &anthropic("hi", false),
    )?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let (input, output) = reported_usage(&reply.body)?;
    // Forged tokens (signed with a key the gateway does not trust, a fresh
    // one each time) claiming acme.
    for i in 0..20 {
        let forged = issuer().hs256(&tokens::claims(
            &format!("mallory-{i}"),
            "acme",
            tokens::now(),
            3600,
        ));
        let reply = gw.post(
            &format!("Bearer {forged}"),
            "/v1/messages",
            &anthropic("hi", false),
        )?;
        assert_eq!(reply.status, 401, "{}", reply.body);
    }
    wait::until(
        "Redis to hold acme's one request",
        Duration::from_secs(10),
        || Ok((fleet.budget_total(PREFIX)? == (input + output) as i64).then_some(())),
    )
    .with_context(|| format!("Redis holds {:?}", fleet.budget_total(PREFIX)))?;
    Ok(())
}

#[test]
fn the_official_sdks_spend_a_budget_and_do_not_retry_its_exhaustion() -> Result<()> {
    for form in FORMS {
        sdks(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn sdks(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(600))?;
    let strip = |b: String| b.trim_start_matches("Bearer ").to_string();
    let report = zerolayer_e2e::sdk::run_client(
        "quota_client.py",
        &[
            "--gateway",
            &gw.envoy.url(""),
            "--openai-jwt",
            &strip(bearer("alice", "acme")),
            "--anthropic-jwt",
            &strip(bearer("bob", "globex")),
        ],
    )?;
    for (sdk, error, kind) in [
        ("openai", "RateLimitError", "insufficient_quota"),
        ("anthropic", "RateLimitError", "rate_limit_error"),
    ] {
        let seen = &report[sdk];
        let ok = seen["ok"].as_u64().context("ok")?;
        // The first request of each tenant waited for its lease: no 429.
        assert!(
            ok >= 2,
            "{sdk}: only {ok} requests before the refusal: {seen}"
        );
        assert_eq!(seen["error"], error, "{sdk}: {seen}");
        assert_eq!(seen["status"], 429, "{sdk}: {seen}");
        assert_eq!(seen["type"], kind, "{sdk}: {seen}");
        assert_eq!(seen["should_retry"], "false", "{sdk}: {seen}");
        assert_eq!(
            seen["refused_attempts"].as_u64(),
            Some(1),
            "{sdk}: the exhausted budget was retried: {seen}"
        );
    }
    Ok(())
}

#[test]
fn three_envoys_on_one_redis_settle_at_most_the_budget_and_redis_counts_it_once() -> Result<()> {
    for form in FORMS {
        three_envoys(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn three_envoys(form: Form) -> Result<()> {
    const BUDGET: i64 = 100_000;
    const STREAMS: usize = 200;
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig {
        output_tokens: Some(2_000),
        ttft: Duration::ZERO,
        itl: Duration::ZERO,
        ..StubConfig::default()
    })?;
    // Three gateways starting together on an empty key.
    let gateways = (0..3)
        .map(|_| {
            gateway_of(
                form,
                stub.addr(),
                fleet.webdis(),
                daily_tokens(BUDGET as u64),
                3,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let acme = bearer("alice", "acme");
    let body = |i: usize| {
        json!({
            "model": "gpt-test", "max_tokens": 2_000, "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": format!("stream {i}")}],
        })
        .to_string()
    };
    let results = zerolayer_e2e::chain::concurrently(STREAMS, |i| {
        let reply = gateways[i % 3].post(&acme, "/v1/chat/completions", &body(i))?;
        match reply.status {
            200 => {
                let (input, output) = reported_usage(&reply.body)?;
                Ok(Some((input + output) as i64))
            }
            429 => Ok(None),
            status => anyhow::bail!("stream {i}: {status} {}", reply.body),
        }
    });
    let mut used = 0;
    let mut admitted = 0;
    for result in results {
        if let Some(tokens) = result? {
            used += tokens;
            admitted += 1;
        }
    }
    eprintln!(
        "{form:?}: 3 gateways, {STREAMS} concurrent ~2,000-token streams: {admitted} admitted, {used} tokens settled of {BUDGET}"
    );
    assert!(admitted > 0, "nothing admitted");
    assert!(used <= BUDGET, "settled {used}, over the budget {BUDGET}");
    wait::until(
        "Redis to hold what was used",
        Duration::from_secs(10),
        || Ok((fleet.budget_total(PREFIX)? == used).then_some(())),
    )
    .with_context(|| {
        format!(
            "Redis holds {:?}, the streams reported {used}",
            fleet.budget_total(PREFIX)
        )
    })?;
    Ok(())
}

#[test]
fn the_native_module_refuses_a_quota_section_naming_it() -> Result<()> {
    paths::native_module()?;
    let mut config = EnvoyConfig::shipped(Form::Native.file())?
        .for_run(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?;
    let mut sections: Value = serde_json::from_str(&config.native_filter_config("zerolayer")?)?;
    sections["quota"] = json!({"store": {"cluster": "webdis", "path": "/"}});
    config.set_native_filter_config("zerolayer", &sections.to_string())?;
    let validation = Envoy::validate(&config)?;
    anyhow::ensure!(!validation.ok, "Envoy accepted it");
    let want = "quota: not supported by the native module yet";
    anyhow::ensure!(validation.output.contains(want), "{}", validation.output);
    Ok(())
}

/// [`gateway`] with one daily token budget of `amount` per tenant under
/// `stream: hard`, its lease as large as the fleet allows
/// (`lease.max_percent: 100`, so a stream is cut at the budget rather than
/// where a 5 % lease runs dry between two refills). The setup is
/// [`gateway_of`]'s, with the store's lease sized.
fn hard_gateway(
    form: Form,
    backend: std::net::SocketAddr,
    webdis: std::net::SocketAddr,
    amount: u64,
) -> Result<Gateway> {
    let jwks = issuer().jwks().to_string();
    let idp = MockServer::start(move |_| (200, jwks.clone()))?;
    let mut config = EnvoyConfig::shipped(form.file())?
        .for_run(backend)?
        .point_cluster("idp", idp.addr())?
        .add_cluster("webdis", webdis)?
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    let quota = json!({
        "store": {"cluster": "webdis", "path": "/", "timeout_ms": 500, "key_prefix": PREFIX,
                  "sync_interval_ms": 100, "lease_ttl_ms": 200, "idle_return_ms": 300,
                  "expected_gateways": 1, "lease": {"max_percent": 100}},
        "policies": [{"name": "daily", "scope": ["tenant"], "unit": "tokens", "stream": "hard",
                      "limit": {"budget": {"amount": amount, "window": "day"}}}],
    });
    let verify = |lazy: &mut Value| {
        lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
        lazy["jwt"]["keys"] = issuer().jwks()["keys"].clone();
        lazy["unknown"] = json!("sync");
        lazy["audit"] = Value::Null;
    };
    let lazy = match form {
        Form::Separate => {
            paths::wasm("quota")?;
            let mut lazy: Value =
                serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
            verify(&mut lazy);
            config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
            config.insert_wasm_filter_after(
                "zerolayer.lazy_auth",
                "zerolayer.quota",
                "quota",
                "zerolayer.quota",
                &quota.to_string(),
            )?;
            lazy
        }
        Form::Fused => {
            let mut sections = config.wasm_filter_json("zerolayer")?;
            verify(&mut sections["lazy_auth"]);
            sections["quota"] = quota;
            config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
            sections["lazy_auth"].clone()
        }
        Form::Native => anyhow::bail!("quota is not in the native module yet"),
    };
    let service = json!({"lazy_auth": lazy, "tick_ms": 100});
    config.set_service_config("zerolayer.observer", &service.to_string())?;
    let envoy = Envoy::start(&config)?;
    Ok(Gateway {
        envoy,
        _idp: idp,
        client: Client::new(),
    })
}

/// A hard budget's tokens.
const HARD_BUDGET: u64 = 400;

/// The stub streaming 2,000 words per answer, a word every 200 µs.
fn long_streams() -> Result<Stub> {
    Ok(Stub::start(StubConfig {
        output_tokens: Some(2_000),
        ttft: Duration::ZERO,
        itl: Duration::from_micros(200),
        ..StubConfig::default()
    })?)
}

/// The events of an SSE body: (event name, data).
fn sse_events(body: &str) -> Vec<(String, String)> {
    let mut events = Vec::new();
    zerolayer_core::sse::SseParser::new().push(body.as_bytes(), |e| {
        events.push((
            String::from_utf8_lossy(e.event).into_owned(),
            String::from_utf8_lossy(e.data).into_owned(),
        ));
    });
    events
}

#[test]
fn a_hard_budget_cuts_a_long_stream_cleanly_and_redis_holds_what_was_delivered() -> Result<()> {
    for form in FORMS {
        hard_cut(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn hard_cut(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = long_streams()?;
    let gw = hard_gateway(form, stub.addr(), fleet.webdis(), HARD_BUDGET)?;
    let openai_body = json!({
        "model": "gpt-test", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "write a long story"}],
    })
    .to_string();
    let anthropic_body = json!({
        "model": "claude-test", "stream": true, "max_tokens": 4_000,
        "messages": [{"role": "user", "content": "write a long story"}],
    })
    .to_string();
    let mut billed = 0;
    for (tenant, path, body) in [
        ("acme", "/v1/chat/completions", &openai_body),
        ("globex", "/v1/messages", &anthropic_body),
    ] {
        let reply = gw.post(&bearer("alice", tenant), path, body)?;
        anyhow::ensure!(
            reply.status == 200,
            "{path}: {} {}",
            reply.status,
            reply.body
        );
        let events = sse_events(&reply.body);
        // The text delivered, its largest event (g), and the end.
        let (mut text, mut g, mut start_output) = (0u64, 0u64, 0u64);
        for (_, data) in &events {
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let piece = v
                .pointer("/choices/0/delta/content")
                .or_else(|| v.pointer("/delta/text"))
                .and_then(Value::as_str)
                .map_or(0, |s| s.len() as u64);
            text += piece;
            g = g.max(piece);
            if let Some(n) = v
                .pointer("/message/usage/output_tokens")
                .and_then(Value::as_u64)
            {
                start_output = n;
            }
        }
        let (input, output) = reported_usage(&reply.body)?;
        let tail: Vec<&str> = events
            .iter()
            .rev()
            .take(3)
            .rev()
            .map(|(e, d)| {
                if path == "/v1/messages" {
                    e.as_str()
                } else {
                    d.as_str()
                }
            })
            .collect();
        if path == "/v1/messages" {
            assert_eq!(
                tail,
                ["content_block_stop", "message_delta", "message_stop"]
            );
            let delta: Value = serde_json::from_str(&events[events.len() - 2].1)?;
            assert_eq!(delta["delta"]["stop_reason"], "max_tokens", "{delta}");
            assert_eq!(output, start_output + text, "billed what it delivered");
            assert_eq!(input, 4, "the input the stream reported");
        } else {
            let finish: Value = serde_json::from_str(tail[0])?;
            assert_eq!(finish["choices"][0]["finish_reason"], "length", "{finish}");
            let usage: Value = serde_json::from_str(tail[1])?;
            assert_eq!(usage["choices"], json!([]), "{usage}");
            assert_eq!(tail[2], "[DONE]");
            assert_eq!(output, text, "billed what it delivered");
            assert_eq!(
                input,
                body.len() as u64,
                "the input bound: none reported yet"
            );
        }
        let finished = events
            .iter()
            .filter(|(e, d)| d.contains("\"stop\"") || d.contains("end_turn") || e == "error")
            .count();
        assert_eq!(
            finished, 0,
            "{path}: nothing of the backend's end reached the client"
        );
        eprintln!(
            "{form:?} {path}: cut after {text} bytes of text; billed {input} + {output} of {HARD_BUDGET} (g = {g})"
        );
        assert!(text > 0 && text < 2_000, "{path}: {text} bytes delivered");
        assert!(
            input + output <= HARD_BUDGET + g,
            "{path}: billed {input} + {output} over {HARD_BUDGET} + {g}"
        );
        billed += (input + output) as i64;
    }
    wait::until(
        "Redis to hold what was delivered",
        Duration::from_secs(10),
        || Ok((fleet.budget_total(PREFIX)? == billed).then_some(())),
    )
    .with_context(|| {
        format!(
            "Redis holds {:?}, the clients were billed {billed}; log:\n{}",
            fleet.budget_total(PREFIX),
            gw.envoy.log_tail(30)
        )
    })?;
    Ok(())
}

#[test]
fn the_official_sdks_read_a_hard_cut_stream_as_a_length_finish() -> Result<()> {
    for form in FORMS {
        hard_sdks(form).with_context(|| format!("{form:?}"))?;
    }
    Ok(())
}

fn hard_sdks(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = long_streams()?;
    let gw = hard_gateway(form, stub.addr(), fleet.webdis(), HARD_BUDGET)?;
    let strip = |b: String| b.trim_start_matches("Bearer ").to_string();
    let report = zerolayer_e2e::sdk::run_client(
        "quota_hard_client.py",
        &[
            "--gateway",
            &gw.envoy.url(""),
            "--openai-jwt",
            &strip(bearer("alice", "acme")),
            "--anthropic-jwt",
            &strip(bearer("bob", "globex")),
        ],
    )?;
    eprintln!("{form:?}: {report}");
    let mut billed = 0;
    for (sdk, reason, start_output) in [("openai", "length", 0), ("anthropic", "max_tokens", 1)] {
        let seen = &report[sdk];
        assert!(seen.get("error").is_none(), "{sdk}: {seen}");
        assert_eq!(seen["reason"], reason, "{sdk}: {seen}");
        let text = seen["text_bytes"].as_u64().context("text_bytes")?;
        let input = seen["usage"]["input"].as_u64().context("input")?;
        let output = seen["usage"]["output"].as_u64().context("output")?;
        assert!(text > 0, "{sdk}: {seen}");
        assert_eq!(
            output,
            start_output + text,
            "{sdk}: billed what it read: {seen}"
        );
        assert!(
            input + output <= HARD_BUDGET + 32,
            "{sdk}: billed {input} + {output}: {seen}"
        );
        billed += (input + output) as i64;
    }
    wait::until(
        "Redis to hold what the SDKs were billed",
        Duration::from_secs(10),
        || Ok((fleet.budget_total(PREFIX)? == billed).then_some(())),
    )
    .with_context(|| {
        format!(
            "Redis holds {:?}, billed {billed}",
            fleet.budget_total(PREFIX)
        )
    })?;
    Ok(())
}
