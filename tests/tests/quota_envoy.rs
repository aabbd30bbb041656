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
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, MockServer, in_every_form, paths, wait};
use zerolayer_stub::{Stub, StubConfig};

const PREFIX: &str = "zl:e2e:";

// Each scenario runs in every Envoy form: a module named after it, a test
// per form (`a_cache_hit_costs_a_request_and_no_tokens::native`).
in_every_form!(
    a_tenant_spends_its_budget_then_gets_insufficient_quota_and_redis_holds_what_was_used,
    a_forged_token_claiming_a_tenant_spends_none_of_its_budget,
    the_official_sdks_spend_a_budget_and_do_not_retry_its_exhaustion,
    three_envoys_on_one_redis_settle_at_most_the_budget_and_redis_counts_it_once,
    a_blackholed_redis_adds_no_error_and_its_counter_catches_up_once_back,
    a_top_up_in_redis_reaches_every_gateway_within_a_sync_interval,
    a_request_cannot_dodge_its_reservation_nor_choose_its_scope,
    a_made_up_model_name_gets_no_budget_of_its_own,
    lazily_admitted_requests_spend_the_unverified_budget_and_a_valid_ones_usage_is_its_tenants_too,
    a_hard_budget_cuts_a_long_stream_cleanly_and_redis_holds_what_was_delivered,
    the_official_sdks_read_a_hard_cut_stream_as_a_length_finish,
    a_hard_stream_longer_than_its_lease_refills_as_it_goes_and_is_not_cut,
    a_cache_hit_costs_a_request_and_no_tokens,
    a_body_without_a_cap_reaches_the_backend_with_the_reserved_one,
    with_rate_limit_headers_off_responses_carry_none_and_the_budget_still_holds,
);

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
    let setup = Setup {
        expected,
        ..Setup::default()
    };
    gateway_with(form, backend, webdis, policies, &setup)
}

/// How a test's gateway differs from the others'.
struct Setup {
    /// Lease holders sharing the store (`store.expected_gateways`).
    expected: u32,
    /// lazy-auth as shipped (unknown credentials admitted, then verified
    /// off the path) rather than verifying every new one inline.
    lazy: bool,
    /// Members set on the quota section (`unverified`, `store.lease`, …),
    /// objects merged member by member.
    quota: Value,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            expected: 1,
            lazy: false,
            quota: json!({}),
        }
    }
}

/// Sets `patch`'s members on `value`, objects member by member.
fn merge(value: &mut Value, patch: &Value) {
    match (value, patch) {
        (Value::Object(value), Value::Object(patch)) => {
            for (member, patch) in patch {
                merge(value.entry(member.clone()).or_insert(Value::Null), patch);
            }
        }
        (value, patch) => *value = patch.clone(),
    }
}

/// [`gateway`] as `setup` says.
fn gateway_with(
    form: Form,
    backend: std::net::SocketAddr,
    webdis: std::net::SocketAddr,
    policies: Value,
    setup: &Setup,
) -> Result<Gateway> {
    let expected = setup.expected;
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
    let mut quota = quota;
    merge(&mut quota, &setup.quota);
    let verify = |lazy: &mut Value| {
        lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
        lazy["jwt"]["keys"] = issuer().jwks()["keys"].clone();
        if !setup.lazy {
            lazy["unknown"] = json!("sync");
        }
        lazy["audit"] = Value::Null;
    };
    let lazy = match form {
        Form::Separate => {
            paths::wasm("quota")?;
            let mut lazy: Value =
                serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
            verify(&mut lazy);
            config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
            // vm_id "zerolayer", lazy-auth's: its verdicts are in that
            // vm_id's shared data (a lazily admitted request's settlement
            // reads its credential's).
            config.insert_wasm_filter_after(
                "zerolayer.lazy_auth",
                "zerolayer.quota",
                "quota",
                "zerolayer",
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

    /// [`Gateway::post`], again while the answer is a refill's 429
    /// (`x-should-retry: true`): the answer the budget gives, admitted or
    /// exhausted.
    fn post_past_refills(
        &self,
        bearer: &str,
        path: &str,
        body: &str,
    ) -> Result<zerolayer_e2e::Reply> {
        wait::until(
            &format!("{path}: past refills"),
            Duration::from_secs(10),
            || {
                let reply = self.post(bearer, path, body)?;
                let refilling =
                    reply.status == 429 && reply.header("x-should-retry") == Some("true");
                Ok((!refilling).then_some(reply))
            },
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

fn a_tenant_spends_its_budget_then_gets_insufficient_quota_and_redis_holds_what_was_used(
    form: Form,
) -> Result<()> {
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
    // Every refusal is audited in the access log, with its policy.
    let logged = wait::until(
        "the refusal in the access log",
        Duration::from_secs(10),
        || {
            Ok(gw
                .envoy
                .access_log()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["status"] == 429 || v["status"] == "429")
                .map(|v| v["quota"].clone()))
        },
    )?;
    assert_eq!(logged, "refused policy=daily reason=budget_exhausted");
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

fn a_forged_token_claiming_a_tenant_spends_none_of_its_budget(form: Form) -> Result<()> {
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

fn the_official_sdks_spend_a_budget_and_do_not_retry_its_exhaustion(form: Form) -> Result<()> {
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

fn three_envoys_on_one_redis_settle_at_most_the_budget_and_redis_counts_it_once(
    form: Form,
) -> Result<()> {
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
    redis_holds(
        &fleet,
        used,
        "Redis to hold what was used",
        Duration::from_secs(10),
    )
    .with_context(|| {
        format!(
            "{}\nRedis:\n{}",
            quota_counters(&gateways),
            fleet.dump(PREFIX)
        )
    })?;
    // No drift: Redis holds exactly what the gateways' access logs (metering's
    // exact per-request usage, the reconciliation's truth) bill acme.
    wait::until(
        "every admitted stream in the access logs",
        Duration::from_secs(10),
        || {
            let logged = access_log_tokens(&gateways, "acme")?;
            Ok((logged.0 == admitted).then_some(logged.1))
        },
    )
    .and_then(|logged| {
        anyhow::ensure!(
            logged == used,
            "the access logs bill acme {logged}, Redis holds {used}"
        );
        Ok(())
    })?;
    // The peers' way in the same run, same backend, same streams: check the
    // counter, let the request run, charge it at its end.
    let (postpaid_admitted, postpaid) = post_paid(&stub, &fleet, STREAMS, BUDGET, &body)?;
    eprintln!(
        "{form:?}: post-paid baseline (check, then charge): {postpaid_admitted} admitted, {postpaid} tokens settled of {BUDGET} ({:.2}x); lease and settle: {used} ({:.2}x)",
        postpaid as f64 / BUDGET as f64,
        used as f64 / BUDGET as f64
    );
    anyhow::ensure!(
        postpaid > BUDGET,
        "the post-paid baseline settled {postpaid}, within the budget: the test shows no overshoot to prevent"
    );
    Ok(())
}

/// Requests billed to `tenant` in the gateways' access logs, and their
/// input + output tokens.
fn access_log_tokens(gateways: &[Gateway], tenant: &str) -> Result<(usize, i64)> {
    let (mut requests, mut tokens) = (0, 0i64);
    for gw in gateways {
        let log = host_sim_tools::reconcile::read_access_log(gw.envoy.access_log().as_bytes())?;
        // Refused requests are logged too, with no usage.
        for row in log.rows.iter().filter(|r| r.tenant == tenant) {
            let used = (row.tokens.input + row.tokens.output) as i64;
            if used > 0 {
                requests += 1;
                tokens += used;
            }
        }
    }
    Ok((requests, tokens))
}

/// Check-then-charge, as Higress, Kong, LiteLLM and Envoy AI Gateway admit:
/// `streams` concurrent requests each read the counter and, under
/// `budget`, run against `stub`, then add what they used. Returns how many
/// ran and the counter's total.
fn post_paid(
    stub: &Stub,
    fleet: &RedisFleet,
    streams: usize,
    budget: i64,
    body: &(dyn Fn(usize) -> String + Sync),
) -> Result<(usize, i64)> {
    use zerolayer_core::quota::store::Reply;
    let key = "zl:postpaid:acme";
    // All streams in flight together, as in the lease-and-settle run.
    let checked = std::sync::Barrier::new(streams);
    let url = format!("http://{}/v1/chat/completions", stub.addr());
    let results = zerolayer_e2e::chain::concurrently(streams, |i| {
        let spent = match fleet.command(&["GET", key])? {
            Reply::Bulk(Some(v)) => String::from_utf8_lossy(&v).parse::<i64>()?,
            _ => 0,
        };
        checked.wait();
        if spent >= budget {
            return Ok(None);
        }
        let reply = zerolayer_e2e::Client::new().send(
            "POST",
            &url,
            &[("content-type", "application/json")],
            &body(i),
        )?;
        anyhow::ensure!(reply.status == 200, "post-paid {i}: {}", reply.status);
        let (input, output) = reported_usage(&reply.body)?;
        let tokens = (input + output) as i64;
        fleet.command(&["INCRBY", key, &tokens.to_string()])?;
        Ok(Some(tokens))
    });
    let mut admitted = 0;
    for result in results {
        if result?.is_some() {
            admitted += 1;
        }
    }
    let total = match fleet.command(&["GET", key])? {
        Reply::Bulk(Some(v)) => String::from_utf8_lossy(&v).parse::<i64>()?,
        _ => 0,
    };
    Ok((admitted, total))
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

/// Waits (at most `timeout`) until the budget counters in Redis add up to
/// `want`: settled, and idle leases returned.
fn redis_holds(fleet: &RedisFleet, want: i64, what: &str, timeout: Duration) -> Result<()> {
    wait::until(what, timeout, || {
        Ok((fleet.budget_total(PREFIX)? == want).then_some(()))
    })
    .with_context(|| format!("Redis holds {:?}, want {want}", fleet.budget_total(PREFIX)))
}

/// Each gateway's quota counters (store errors, unreachable calls,
/// refills, overshoot…), for the message of a wait that ran out.
fn quota_counters(gateways: &[Gateway]) -> String {
    gateways
        .iter()
        .enumerate()
        .map(|(g, gw)| {
            let counters = match gw.envoy.prometheus() {
                Ok(text) => text
                    .lines()
                    .filter(|l| !l.starts_with('#') && l.contains("zerolayer_quota"))
                    .collect::<Vec<_>>()
                    .join("; "),
                Err(e) => format!("(no stats: {e:#})"),
            };
            format!("gateway {g}'s quota counters: {counters}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The budget counters of policy `policy` in Redis, summed.
fn policy_total(fleet: &RedisFleet, policy: &str) -> Result<i64> {
    fleet.budget_total(&format!("{PREFIX}{{{policy}:"))
}

/// The p99 of `latencies` (the largest when fewer than 100).
fn p99(latencies: &mut [Duration]) -> Duration {
    latencies.sort();
    let i = (latencies.len() * 99).div_ceil(100).saturating_sub(1);
    latencies.get(i).copied().unwrap_or_default()
}

fn a_blackholed_redis_adds_no_error_and_its_counter_catches_up_once_back(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(1_000_000))?;
    let acme = bearer("alice", "acme");
    let mut used = 0i64;
    let mut send = |i: usize| -> Result<Duration> {
        let started = std::time::Instant::now();
        let reply = gw.post(
            &acme,
            "/v1/chat/completions",
            &openai(&format!("q{i}"), false),
        )?;
        let took = started.elapsed();
        anyhow::ensure!(
            reply.status == 200,
            "request {i}: {} {}",
            reply.status,
            reply.body
        );
        let (input, output) = reported_usage(&reply.body)?;
        used += (input + output) as i64;
        Ok(took)
    };
    let mut before = Vec::new();
    for i in 0..50 {
        before.push(send(i)?);
    }
    // Blackholed, not refused: webdis accepts connections and never answers.
    fleet.pause_webdis()?;
    let paused = std::time::Instant::now();
    let mut during = Vec::new();
    let mut i = 50;
    // Past the lease's expiry (200 ms without a confirmation) and the store
    // counting as down (two sync intervals): held leases, then the
    // `local_share` fallback, admit; no request waits for the store.
    while paused.elapsed() < Duration::from_millis(1_500) {
        during.push(send(i).context("while Redis was blackholed")?);
        i += 1;
    }
    eprintln!(
        "{form:?}: Redis blackholed for 1.5 s: {} requests, all 200; p99 {:?} before, {:?} during",
        during.len(),
        p99(&mut before),
        p99(&mut during),
    );
    // The calls that found no answer were counted (exported on tick).
    let errors = wait::until(
        "unanswered store calls counted",
        Duration::from_secs(5),
        || {
            let n = gw
                .envoy
                .metric("zerolayer_quota_store_unreachable")?
                .unwrap_or_default();
            Ok((n > 0.0).then_some(n))
        },
    )
    .with_context(|| gw.envoy.prometheus().unwrap_or_default())?;
    eprintln!("{form:?}: {errors} store calls found no answer while blackholed");
    fleet.resume_webdis()?;
    // What was spent without the store reaches it once, exactly.
    redis_holds(
        &fleet,
        used,
        "Redis to catch up with what was used",
        Duration::from_secs(15),
    )?;
    Ok(())
}

fn a_top_up_in_redis_reaches_every_gateway_within_a_sync_interval(form: Form) -> Result<()> {
    const SYNC_MS: u64 = 100;
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gateways = (0..3)
        .map(|_| gateway_of(form, stub.addr(), fleet.webdis(), daily_tokens(600), 3))
        .collect::<Result<Vec<_>>>()?;
    let acme = bearer("alice", "acme");
    // A new prompt each time (the same one would be a free cache hit).
    let sent = std::cell::Cell::new(0);
    let body = || {
        sent.set(sent.get() + 1);
        anthropic(&format!("top me up {}", sent.get()), false)
    };
    // Every gateway spends until the budget refuses it.
    for (g, gw) in gateways.iter().enumerate() {
        let refused = (0..60).try_fold(false, |refused, _| -> Result<bool> {
            if refused {
                return Ok(true);
            }
            let reply = gw.post(&acme, "/v1/messages", &body())?;
            anyhow::ensure!(
                matches!(reply.status, 200 | 429),
                "gateway {g}: {} {}",
                reply.status,
                reply.body
            );
            Ok(reply.status == 429)
        })?;
        anyhow::ensure!(
            refused,
            "gateway {g}: 60 requests never exhausted 600 tokens"
        );
    }
    // The operator tops acme up for today: the window's counter goes down
    // (`DECRBY`), as a refund or a larger allowance would.
    let zerolayer_core::quota::store::Reply::Array(Some(keys)) =
        fleet.command(&["KEYS", &format!("{PREFIX}{{daily:*")])?
    else {
        anyhow::bail!("no daily counter in Redis");
    };
    let counter = keys
        .iter()
        .find_map(|k| match k {
            zerolayer_core::quota::store::Reply::Bulk(Some(k))
                if !k.windows(3).any(|w| w == b":i:") =>
            {
                Some(String::from_utf8_lossy(k).into_owned())
            }
            _ => None,
        })
        .context("no daily counter among the keys")?;
    fleet.command(&["DECRBY", &counter, "100000"])?;
    let topped = std::time::Instant::now();
    let mut seen = Vec::new();
    for (g, gw) in gateways.iter().enumerate() {
        let admitted = wait::until(
            "the gateway to admit acme again",
            Duration::from_secs(5),
            || {
                let reply = gw.post(&acme, "/v1/messages", &body())?;
                Ok((reply.status == 200).then(|| topped.elapsed()))
            },
        )
        .with_context(|| format!("gateway {g} still refuses acme after the top-up"))?;
        seen.push(admitted);
    }
    eprintln!(
        "{form:?}: a top-up seen by the 3 gateways after {seen:?} (sync every {SYNC_MS} ms, store timeout 500 ms)"
    );
    Ok(())
}

fn a_request_cannot_dodge_its_reservation_nor_choose_its_scope(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    // 3,000 tokens a day: less than the 4,096 output tokens a request that
    // names no `max_tokens` is reserved at (`default_max_output_tokens`).
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(3_000))?;
    let acme = bearer("alice", "acme");
    let uncapped = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]});
    let reply = gw
        .post(&acme, "/v1/chat/completions", &uncapped.to_string())
        .context("the request without max_tokens")?;
    assert_eq!(reply.status, 429, "{}", reply.body);
    let error: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(
        error["error"]["code"], "insufficient_quota",
        "{}",
        reply.body
    );
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("max_tokens"), "{message}");
    assert_eq!(reply.header("x-should-retry"), Some("false"));
    assert!(
        stub.requests().is_empty(),
        "the backend saw the refused request"
    );
    // Compressed, the body is read through its coding: a gzip body hiding
    // a 20,000-token cap (and sent chunked) is reserved at it, and a
    // coding quota cannot read is refused, since its size cannot be bounded.
    let mut hidden = uncapped.clone();
    hidden["max_tokens"] = json!(20_000);
    let packed = gzip(hidden.to_string().as_bytes());
    let url = gw.envoy.url("/v1/chat/completions");
    let headers = [
        ("authorization", acme.as_str()),
        ("content-type", "application/json"),
        ("content-encoding", "gzip"),
    ];
    let reply = gw.client.post_chunked(&url, &headers, &packed)?;
    assert_eq!(reply.status, 429, "{}", reply.body);
    let headers = [
        ("authorization", acme.as_str()),
        ("content-type", "application/json"),
        ("content-encoding", "br"),
    ];
    let reply = gw
        .client
        .post_chunked(&url, &headers, b"\x0b\x02\x80{}\x03")?;
    assert_eq!(reply.status, 415, "{}", reply.body);
    let error: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(
        error["error"]["type"], "invalid_request_error",
        "{}",
        reply.body
    );
    assert!(
        stub.requests().is_empty(),
        "the backend saw a refused compressed request"
    );
    // The same request with a cap it can afford.
    let mut capped = uncapped.clone();
    capped["max_tokens"] = json!(16);
    let reply = gw
        .post(&acme, "/v1/chat/completions", &capped.to_string())
        .context("the request with max_tokens")?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // A client naming another tenant in any header still spends its own
    // verified tenant's budget: its scope is not the request's to choose.
    // (Another prompt: the same one would be a cache hit, no tokens.)
    let mut other = capped.clone();
    other["messages"][0]["content"] = json!("hello from globex, honestly");
    let spoofed = gw
        .client
        .send(
            "POST",
            &gw.envoy.url("/v1/chat/completions"),
            &[
                ("authorization", acme.as_str()),
                ("content-type", "application/json"),
                ("x-tenant", "globex"),
                ("x-zerolayer-tenant", "globex"),
                ("x-zerolayer-identity", "verified tenant=globex"),
            ],
            &other.to_string(),
        )
        .context("the request naming another tenant")?;
    assert_eq!(spoofed.status, 200, "{}", spoofed.body);
    let used: i64 = [&reply, &spoofed]
        .iter()
        .map(|r| reported_usage(&r.body).map(|(i, o)| (i + o) as i64))
        .sum::<Result<i64>>()?;
    // One scope (acme's) and both requests in it: no counter for globex.
    wait::until(
        "acme's two requests in Redis",
        Duration::from_secs(10),
        || Ok((fleet_scopes(&fleet)? == 1 && fleet.budget_total(PREFIX)? == used).then_some(())),
    )
    .with_context(|| {
        format!(
            "scopes {:?}, Redis {:?}, used {used}",
            fleet_scopes(&fleet),
            fleet.budget_total(PREFIX)
        )
    })?;
    Ok(())
}

/// A policy per tenant and model counts the models it lists one by one and
/// every other name under one shared key: a client naming a fresh model per
/// request (the stub, like llama.cpp's server, serves any name) spends one
/// budget, not one each.
fn a_made_up_model_name_gets_no_budget_of_its_own(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let policies = json!([{"name": "per-model", "scope": ["tenant", "model"],
                           "models": ["gpt-test"], "unit": "requests",
                           "limit": {"budget": {"amount": 3, "window": "day"}}}]);
    let gw = gateway(form, stub.addr(), fleet.webdis(), policies)?;
    let acme = bearer("alice", "acme");
    let send = |model: &str, i: usize| -> Result<u16> {
        let body = json!({"model": model, "max_tokens": 16,
                          "messages": [{"role": "user", "content": format!("question {i}")}]});
        let reply = gw
            .post_past_refills(&acme, "/v1/chat/completions", &body.to_string())
            .with_context(|| model.to_string())?;
        if reply.status == 429 {
            let error: Value = serde_json::from_str(&reply.body)?;
            assert_eq!(
                error["error"]["code"], "insufficient_quota",
                "{}",
                reply.body
            );
        }
        Ok(reply.status)
    };
    let made_up: Vec<u16> = (0..8)
        .map(|i| send(&format!("made-up-{i}"), i))
        .collect::<Result<_>>()?;
    assert_eq!(
        made_up,
        [200, 200, 200, 429, 429, 429, 429, 429],
        "8 made-up model names share one budget of 3"
    );
    let listed: Vec<u16> = (8..12)
        .map(|i| send("gpt-test", i))
        .collect::<Result<_>>()?;
    assert_eq!(listed, [200, 200, 200, 429], "a listed model has its own");
    assert_eq!(
        stub.requests().len(),
        6,
        "the backend saw a refused request"
    );
    wait::until(
        "two counters of 3 in Redis",
        Duration::from_secs(10),
        || Ok((fleet_scopes(&fleet)? == 2 && fleet.budget_total(PREFIX)? == 6).then_some(())),
    )
    .with_context(|| {
        format!(
            "scopes {:?}, Redis {:?}",
            fleet_scopes(&fleet),
            fleet.budget_total(PREFIX)
        )
    })?;
    Ok(())
}

/// `rate_limit_headers: false` (the operator's choice, saving Envoy six
/// header writes a response): admitted responses carry no rate-limit
/// header of either provider's naming, and the budget refuses as before.
fn with_rate_limit_headers_off_responses_carry_none_and_the_budget_still_holds(
    form: Form,
) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let policies = json!([{"name": "two", "scope": ["tenant"], "unit": "requests",
                           "limit": {"budget": {"amount": 2, "window": "day"}}}]);
    let setup = Setup {
        quota: json!({"rate_limit_headers": false}),
        ..Setup::default()
    };
    let gw = gateway_with(form, stub.addr(), fleet.webdis(), policies, &setup)?;
    let acme = bearer("alice", "acme");
    let mut statuses = Vec::new();
    for (i, (path, body)) in [
        ("/v1/chat/completions", openai("one", false)),
        ("/v1/messages", anthropic("two", false)),
        ("/v1/chat/completions", openai("three", false)),
    ]
    .into_iter()
    .enumerate()
    {
        let reply = gw.post_past_refills(&acme, path, &body)?;
        let shown: Vec<&String> = reply
            .headers
            .iter()
            .map(|(name, _)| name)
            .filter(|name| name.contains("ratelimit"))
            .collect();
        assert!(shown.is_empty(), "request {i}: {shown:?}");
        statuses.push(reply.status);
    }
    assert_eq!(statuses, [200, 200, 429], "a budget of two requests");
    assert_eq!(stub.requests().len(), 2, "the backend saw the refused one");
    Ok(())
}

/// `inject_max_tokens`: the backend (the stub, answering 2,000 tokens when
/// nothing stops it) gets the cap the request was reserved at, so the
/// response stays within the reservation; an escaped cap name is read as
/// the backend reads it (reserved at its value: here more than the budget).
fn a_body_without_a_cap_reaches_the_backend_with_the_reserved_one(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig {
        output_tokens: Some(2_000),
        ..StubConfig::default()
    })?;
    let policies = json!([{"name": "daily", "scope": ["tenant"], "unit": "tokens",
                           "default_max_output_tokens": 40,
                           "limit": {"budget": {"amount": 10_000, "window": "day"}}}]);
    let setup = Setup {
        quota: json!({"inject_max_tokens": true}),
        ..Setup::default()
    };
    let gw = gateway_with(form, stub.addr(), fleet.webdis(), policies, &setup)?;
    let acme = bearer("alice", "acme");
    let openai = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go on"}]});
    let reply = gw.post(&acme, "/v1/chat/completions", &openai.to_string())?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let answer: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(answer["usage"]["completion_tokens"], 40, "{}", reply.body);
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let anthropic =
        json!({"model": "claude-test", "messages": [{"role": "user", "content": "go on"}]});
    let reply = gw.post(&acme, "/v1/messages", &anthropic.to_string())?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let answer: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(answer["usage"]["output_tokens"], 40, "{}", reply.body);
    let seen: Vec<Value> = stub
        .requests()
        .iter()
        .map(|r| serde_json::from_slice(&r.body))
        .collect::<Result<_, _>>()?;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0]["max_completion_tokens"], 40, "{}", seen[0]);
    assert_eq!(seen[0]["messages"], openai["messages"]);
    assert_eq!(seen[1]["max_tokens"], 40, "{}", seen[1]);
    // An explicit `None` in the OpenAI SDKs is sent as `null`: no bound to
    // the backend. Its value is replaced.
    let mut null_cap = openai.clone();
    null_cap["max_tokens"] = Value::Null;
    null_cap["messages"][0]["content"] = json!("go on, please");
    let reply = gw.post(&acme, "/v1/chat/completions", &null_cap.to_string())?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let answer: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(answer["usage"]["completion_tokens"], 40, "{}", reply.body);
    let last: Value = serde_json::from_slice(&stub.requests().last().context("seen")?.body)?;
    assert_eq!(last["max_tokens"], 40, "{last}");
    // Written with an escape, the cap is still read: 20,000 tokens is more
    // than the budget, refused before the backend sees it.
    let escaped = r#"{"model":"gpt-test","max_t\u006fkens":20000,"messages":[{"role":"user","content":"x"}]}"#;
    let reply = gw.post(&acme, "/v1/chat/completions", escaped)?;
    assert_eq!(reply.status, 429, "{}", reply.body);
    assert_eq!(
        stub.requests().len(),
        3,
        "the backend saw the refused request"
    );
    Ok(())
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).expect("in memory");
    e.finish().expect("in memory")
}

#[test]
fn a_scope_read_from_an_untrusted_header_is_refused_at_load() -> Result<()> {
    // A client choosing its scope chooses whose budget it spends: only a
    // header listed in `trusted_headers` may be a scope.
    let mut config = EnvoyConfig::shipped(Form::Fused.file())?
        .for_run(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?
        .add_cluster("webdis", std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    let mut sections = config.wasm_filter_json("zerolayer")?;
    sections["quota"] = json!({
        "store": {"cluster": "webdis", "path": "/"},
        "policies": [{"name": "team", "scope": [{"header": "x-team"}], "unit": "requests",
                      "limit": {"rate": {"amount": 10, "per": "second"}}}],
    });
    config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
    let validation = Envoy::validate(&config)?;
    anyhow::ensure!(
        !validation.ok,
        "Envoy accepted a scope from an untrusted header"
    );
    anyhow::ensure!(
        validation.output.contains("policies[0].scope"),
        "{}",
        validation.output
    );
    Ok(())
}

/// The distinct scopes (counters, not idempotency records) in Redis.
fn fleet_scopes(fleet: &RedisFleet) -> Result<usize> {
    use zerolayer_core::quota::store::Reply;
    let Reply::Array(Some(keys)) = fleet.command(&["KEYS", &format!("{PREFIX}*")])? else {
        anyhow::bail!("KEYS did not answer an array");
    };
    Ok(keys
        .iter()
        .filter(|k| matches!(k, Reply::Bulk(Some(k)) if !k.windows(3).any(|w| w == b":i:")))
        .count())
}

fn lazily_admitted_requests_spend_the_unverified_budget_and_a_valid_ones_usage_is_its_tenants_too(
    form: Form,
) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    // lazy-auth as shipped: a credential's first request is admitted before
    // the observer verifies it; quota bills such requests to `unverified`.
    let setup = Setup {
        lazy: true,
        quota: json!({"unverified": {"unit": "tokens",
                                     "limit": {"budget": {"amount": 100_000, "window": "day"}}}}),
        ..Setup::default()
    };
    let gw = gateway_with(
        form,
        stub.addr(),
        fleet.webdis(),
        daily_tokens(100_000),
        &setup,
    )?;
    let acme = bearer("alice", "acme");
    let usage = |reply: &zerolayer_e2e::Reply| -> Result<i64> {
        let (input, output) = reported_usage(&reply.body)?;
        Ok((input + output) as i64)
    };
    // acme's first request: admitted before verification, so it reserves
    // from `unverified`, which keeps it (it bounds what passes before
    // verification); once its credential is found valid, its usage is
    // acme's too (at its response's end, or at the next sync).
    let first = gw.post(&acme, "/v1/messages", &anthropic("first", false))?;
    assert_eq!(first.status, 200, "{}", first.body);
    let mut unverified = usage(&first)?;
    gw.envoy
        .wait_metric(r#"zerolayer_auth_verdicts{outcome="valid"}"#, 1.0)
        .or_else(|_| {
            gw.envoy
                .wait_metric("zerolayer_auth_verdicts_outcome_valid", 1.0)
        })?;
    let second = gw.post(&acme, "/v1/messages", &anthropic("second", false))?;
    assert_eq!(second.status, 200, "{}", second.body);
    let acme_used = usage(&first)? + usage(&second)?;
    // A spray of forged tokens claiming acme, a fresh one per request.
    let now = tokens::now();
    let mut admitted = 0;
    for n in 0..20 {
        let forged = issuer().forged(&tokens::claims("mallory", "acme", now, 3600), n);
        let reply = gw.post(
            &format!("Bearer {forged}"),
            "/v1/messages",
            &anthropic(&format!("forged {n}"), false),
        )?;
        match reply.status {
            200 => {
                admitted += 1;
                unverified += usage(&reply)?;
            }
            401 | 429 | 503 => {}
            status => anyhow::bail!("forged {n}: {status} {}", reply.body),
        }
    }
    eprintln!("{form:?}: {admitted} of 20 forged tokens admitted before verification");
    // Forged tokens' verdicts say invalid: theirs stay `unverified`.
    wait::until(
        "Redis to hold acme's and the unverified totals",
        Duration::from_secs(20),
        || {
            Ok((policy_total(&fleet, "daily")? == acme_used
                && policy_total(&fleet, "unverified")? == unverified)
                .then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "acme: Redis {:?}, used {acme_used}; unverified: Redis {:?}, used {unverified}",
            policy_total(&fleet, "daily"),
            policy_total(&fleet, "unverified")
        )
    })?;
    Ok(())
}

/// [`gateway`] with one daily token budget of `amount` per tenant under
/// `stream: hard`, its lease as large as the fleet allows
/// (`lease.max_percent: 100`, so a stream is cut at the budget rather than
/// where a 5 % lease runs dry between two refills).
fn hard_gateway(
    form: Form,
    backend: std::net::SocketAddr,
    webdis: std::net::SocketAddr,
    amount: u64,
) -> Result<Gateway> {
    let policies = json!([{"name": "daily", "scope": ["tenant"], "unit": "tokens", "stream": "hard",
                           "limit": {"budget": {"amount": amount, "window": "day"}}}]);
    let setup = Setup {
        quota: json!({"store": {"lease": {"max_percent": 100}}}),
        ..Setup::default()
    };
    gateway_with(form, backend, webdis, policies, &setup)
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

fn a_hard_budget_cuts_a_long_stream_cleanly_and_redis_holds_what_was_delivered(
    form: Form,
) -> Result<()> {
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
    redis_holds(
        &fleet,
        billed,
        "Redis to hold what was delivered",
        Duration::from_secs(10),
    )?;
    Ok(())
}

fn a_hard_stream_longer_than_its_lease_refills_as_it_goes_and_is_not_cut(form: Form) -> Result<()> {
    // A 100,000-token budget, leases of the default 5 % (5,000), and no
    // tick during the stream (a 5 s sync interval): a stream of ~12,000
    // bytes of text must have its lease refilled from the response itself
    // (before, it was cut where its first lease ran dry).
    let fleet = RedisFleet::start_for_quota()?;
    let stub = long_streams()?;
    let policies = json!([{"name": "daily", "scope": ["tenant"], "unit": "tokens", "stream": "hard",
                           "limit": {"budget": {"amount": 100_000, "window": "day"}}}]);
    let setup = Setup {
        quota: json!({"store": {"sync_interval_ms": 5_000, "lease_ttl_ms": 10_000,
                                "idle_return_ms": 10_000}}),
        ..Setup::default()
    };
    let gw = gateway_with(form, stub.addr(), fleet.webdis(), policies, &setup)?;
    let body = json!({
        "model": "gpt-test", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "write a long story"}],
    })
    .to_string();
    let reply = gw.post(&bearer("alice", "acme"), "/v1/chat/completions", &body)?;
    anyhow::ensure!(reply.status == 200, "{} {}", reply.status, reply.body);
    let (finish, text) = zerolayer_e2e::chain::openai_stream_end(&reply.body);
    let (_, output) = reported_usage(&reply.body)?;
    eprintln!("{form:?}: {text} bytes of text, {output} tokens, finish {finish:?}");
    assert_eq!(finish, ["stop"], "the backend's own end, not a cut");
    assert_eq!(output, 2_000, "the whole stream");
    assert!(text > 2 * 5_000, "{text} bytes: several leases' worth");
    // Every byte drawn was debited from the fleet's counter before it was
    // delivered: Redis holds at least the text (the surplus returns when
    // the lease goes idle).
    let held = policy_total(&fleet, "daily")?;
    assert!(
        held >= text as i64,
        "Redis holds {held}, the stream drew {text}"
    );
    Ok(())
}

fn the_official_sdks_read_a_hard_cut_stream_as_a_length_finish(form: Form) -> Result<()> {
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
    redis_holds(
        &fleet,
        billed,
        "Redis to hold what the SDKs were billed",
        Duration::from_secs(10),
    )?;
    Ok(())
}

fn a_cache_hit_costs_a_request_and_no_tokens(form: Form) -> Result<()> {
    let fleet = RedisFleet::start_for_quota()?;
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(form, stub.addr(), fleet.webdis(), daily_tokens(100_000))?;
    let acme = bearer("alice", "acme");
    let body = anthropic("the same question twice", false);
    let first = gw.post(&acme, "/v1/messages", &body)?;
    assert_eq!(first.status, 200, "{}", first.body);
    let (input, output) = reported_usage(&first.body)?;
    // post-cache stores the first after it completed; the second is a hit.
    let hit = wait::until("a cache hit", Duration::from_secs(10), || {
        let reply = gw.post(&acme, "/v1/messages", &body)?;
        Ok((reply.header("x-cache") == Some("HIT")).then_some(reply))
    })?;
    assert_eq!(hit.status, 200);
    assert_eq!(stub.requests().len(), 1, "the hit reached the backend");
    // The default `cache_hit: request`: one request, no tokens; the idle
    // lease gives back what it held.
    redis_holds(
        &fleet,
        (input + output) as i64,
        "Redis to hold the miss's tokens only",
        Duration::from_secs(10),
    )?;
    Ok(())
}
