//! quota in real Envoy, in every form: the shipped separate chain
//! (`envoy/zerolayer.yaml`) with `zerolayer_quota.wasm` after lazy-auth,
//! the shipped fused filter (`envoy/zerolayer-fused.yaml`) and the native
//! module (`envoy/zerolayer-native.yaml`) with a `quota` section; its
//! leases filled from a real
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
        Form::Native => {
            paths::native_module()?;
            let mut sections: Value =
                serde_json::from_str(&config.native_filter_config("zerolayer")?)?;
            verify(&mut sections["lazy_auth"]);
            sections["quota"] = quota;
            // The module's quota thread syncs the leases with webdis
            // directly; a request waiting for its grant uses the cluster.
            sections["native"]["upstreams"]["idp"] = json!(idp.addr().to_string());
            sections["native"]["upstreams"]["webdis"] = json!(webdis.to_string());
            config.set_native_filter_config("zerolayer", &sections.to_string())?;
            sections["lazy_auth"].clone()
        }
    };
    if form != Form::Native {
        let service = json!({"lazy_auth": lazy, "tick_ms": 100});
        config.set_service_config("zerolayer.observer", &service.to_string())?;
    }
    let envoy = Envoy::start(&config)?;
    Ok(Gateway {
        envoy,
        _idp: idp,
        client: Client::new(),
    })
}

/// The forms quota runs in.
const FORMS: [Form; 3] = [Form::Separate, Form::Fused, Form::Native];

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
fn the_native_module_refuses_a_quota_store_its_thread_cannot_reach_naming_the_field() -> Result<()>
{
    paths::native_module()?;
    let mut config = EnvoyConfig::shipped(Form::Native.file())?
        .for_run(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?
        .add_cluster("webdis", std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    let mut sections: Value = serde_json::from_str(&config.native_filter_config("zerolayer")?)?;
    sections["quota"] = json!({"store": {"cluster": "webdis", "path": "/"}});
    config.set_native_filter_config("zerolayer", &sections.to_string())?;
    let validation = Envoy::validate(&config)?;
    anyhow::ensure!(!validation.ok, "Envoy accepted it");
    let want = "native.upstreams: no address for cluster \"webdis\" (quota.store.cluster)";
    anyhow::ensure!(validation.output.contains(want), "{}", validation.output);
    // With the address, the module takes the section.
    sections["native"]["upstreams"]["webdis"] = json!("127.0.0.1:9");
    config.set_native_filter_config("zerolayer", &sections.to_string())?;
    let validation = Envoy::validate(&config)?;
    anyhow::ensure!(validation.ok, "{}", validation.output);
    Ok(())
}
