//! Security end to end in real Envoy with the whole chain as shipped: tenant
//! isolation of the cache (also against forged identities and internal
//! headers), bad tokens under concurrent load, and hostile sizes and bodies.

use std::collections::HashMap;

use anyhow::{Context, Result};
use serde_json::json;
use std::time::Duration;

use zerolayer_e2e::chain::{self, Chain, ChainOptions, Form, anthropic, openai};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::wait;
use zerolayer_stub::{Compression, StubConfig};

/// Headers a client might send to pass as another tenant or switch
/// observers on; the chain must ignore and strip every one.
const FORGED_INTERNAL: [(&str, &str); 4] = [
    ("x-zerolayer-tenant", "acme"),
    ("x-zerolayer-auth", "verified;tenant=acme;sub=alice"),
    ("x-zerolayer-observers", "cache,metering,auth_audit"),
    ("x-zerolayer-debug", "1"),
];

fn a_tenant_never_receives_another_tenants_cache_entry(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let alice = chain.verified_bearer("alice", "acme")?;
    let bob = chain.verified_bearer("bob", "globex")?;
    let body = anthropic("the same question from two tenants", false);
    let send = |id: &str, extra: &[(&str, &str)]| {
        let mut headers = vec![("x-request-id", id)];
        headers.extend_from_slice(extra);
        chain.post("/v1/messages", &headers, &body)
    };
    assert_eq!(
        send("acme-0", &[("authorization", &alice)])?.header("x-cache"),
        Some("MISS")
    );
    chain.envoy.wait_metric("zerolayer_cache_stored", 1.0)?;
    assert_eq!(
        send("acme-1", &[("authorization", &alice)])?.header("x-cache"),
        Some("HIT")
    );
    // Bob sends the same request with every internal header claiming acme:
    // a miss of his own, from the backend; then his own entry is a hit.
    let mut bob_forging = vec![("authorization", bob.as_str())];
    bob_forging.extend_from_slice(&FORGED_INTERNAL);
    let reply = send("globex-0", &bob_forging)?;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-cache"),
        Some("MISS"),
        "acme's entry served to globex"
    );
    assert_eq!(reply.header("x-zerolayer-debug"), None);
    assert_eq!(chain.backend_requests("globex-0"), 1);
    chain.envoy.wait_metric("zerolayer_cache_stored", 2.0)?;
    let reply = send("globex-1", &[("authorization", &bob)])?;
    assert_eq!(reply.header("x-cache"), Some("HIT"));
    assert_eq!(chain.backend_requests("acme-"), 1);
    // A forged token claiming acme is never served acme's entry: its one
    // lazily admitted request bypasses the cache, then it is refused.
    let forged = issuer().forged(&tokens::claims("mallory", "acme", tokens::now(), 3600), 7);
    let forged = format!("Bearer {forged}");
    let first = send("forged-0", &[("authorization", &forged)])?;
    assert_ne!(first.header("x-cache"), Some("HIT"), "{}", first.body);
    zerolayer_e2e::wait::until(
        "the forged token refused",
        std::time::Duration::from_secs(10),
        || Ok((send("forged-n", &[("authorization", &forged)])?.status == 401).then_some(())),
    )?;
    // No internal header ever reached the backend.
    for request in chain.stub.requests() {
        let leaked: Vec<_> = request
            .headers
            .iter()
            .filter(|(name, _)| name.starts_with("x-zerolayer-"))
            .collect();
        assert!(leaked.is_empty(), "leaked to the backend: {leaked:?}");
    }
    Ok(())
}

fn forged_expired_and_wrong_audience_tokens_under_concurrent_load(form: Form) -> Result<()> {
    const THREADS: usize = 4;
    const BAD_PER_THREAD: usize = 25;
    const ROUNDS: usize = 3;
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        ..ChainOptions::default()
    })?;
    let valid = chain.verified_bearer("alice", "acme")?;
    let t = tokens::now();
    // Per thread: forged, expired and wrong-audience tokens, each sent
    // ROUNDS times, interleaved with a valid token's requests.
    let bad: Vec<Vec<(String, String)>> = (0..THREADS)
        .map(|thread| {
            (0..BAD_PER_THREAD)
                .map(|n| {
                    let id = format!("bad-{thread}-{n}");
                    let claims = tokens::claims(&id, "acme", t, 3600);
                    let token = match n % 3 {
                        0 => issuer().forged(&claims, (thread * 1000 + n) as u64),
                        1 => issuer().es256(&tokens::claims(&id, "acme", t - 7200, 3600)),
                        _ => {
                            let mut claims = claims;
                            claims["aud"] = json!("another-service");
                            issuer().es256(&claims)
                        }
                    };
                    (id, format!("Bearer {token}"))
                })
                .collect()
        })
        .collect();
    let statuses = zerolayer_e2e::chain::concurrently(THREADS, |thread| {
        let mut bad_statuses: HashMap<u16, usize> = HashMap::new();
        let mut valid_ok = 0;
        for round in 0..ROUNDS {
            for (id, bearer) in &bad[thread] {
                let request_id = format!("{id}-{round}");
                let reply = chain.post(
                    "/v1/messages",
                    &[("authorization", bearer), ("x-request-id", &request_id)],
                    &anthropic(&request_id, false),
                )?;
                *bad_statuses.entry(reply.status).or_insert(0) += 1;
                let reply = chain.post(
                    "/v1/messages",
                    &[("authorization", &valid)],
                    &anthropic(&format!("valid {thread} {round} {id}"), false),
                )?;
                anyhow::ensure!(reply.status == 200, "valid token: {}", reply.body);
                valid_ok += 1;
            }
        }
        Ok((bad_statuses, valid_ok))
    });
    let mut bad_statuses: HashMap<u16, usize> = HashMap::new();
    let mut valid_ok = 0;
    for result in statuses {
        let (statuses, ok) = result?;
        valid_ok += ok;
        for (status, n) in statuses {
            *bad_statuses.entry(status).or_insert(0) += n;
        }
    }
    assert_eq!(valid_ok, THREADS * BAD_PER_THREAD * ROUNDS);
    // Each bad token: at most its one lazily admitted request reached the
    // backend; every other was refused.
    for (id, _) in bad.iter().flatten() {
        let reached = chain.backend_requests(&format!("{id}-"));
        assert!(reached <= 1, "{id}: {reached} requests reached the backend");
    }
    let admitted = bad_statuses.get(&200).copied().unwrap_or(0);
    assert!(
        admitted <= THREADS * BAD_PER_THREAD,
        "bad tokens admitted {admitted} times: {bad_statuses:?}"
    );
    let other: usize = bad_statuses
        .iter()
        .filter(|(s, _)| **s != 200 && **s != 401)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(other, 0, "unexpected statuses: {bad_statuses:?}");
    eprintln!("bad tokens: {bad_statuses:?}; valid requests: {valid_ok} all 200");
    Ok(())
}

fn oversized_and_malformed_requests_get_clear_errors_and_harm_nothing(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("alice", "acme")?;
    // Headers past Envoy's limit (60 KiB): refused before any filter runs.
    let huge = "a".repeat(100 * 1024);
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer), ("x-padding", &huge)],
        &anthropic("huge header", false),
    )?;
    assert_eq!(reply.status, 431, "{}", reply.body);
    // A body past the stages' limit (1 MiB): never held, so neither
    // buffered without bound nor refused: it streams to the backend, the
    // cache bypasses it (tests/bodies_envoy.rs: 32 MiB, byte for byte).
    let big = anthropic(&"x".repeat(2 * 1024 * 1024), false);
    let reply = chain.post("/v1/messages", &[("authorization", &bearer)], &big)?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-cache"), Some("BYPASS"));
    // Malformed JSON: not cached, passed to the backend, whose 400 the
    // client sees; metered as usage missing.
    for (id, body) in [
        (
            "malformed-0",
            "{\"model\": \"claude-test\", \"messages\": [".to_string(),
        ),
        ("malformed-1", "not json at all".to_string()),
        (
            "malformed-2",
            "{\"model\": 7, \"messages\": {}}".to_string(),
        ),
    ] {
        let reply = chain.post(
            "/v1/messages",
            &[("authorization", &bearer), ("x-request-id", id)],
            &body,
        )?;
        assert_eq!(reply.status, 400, "{id}: {}", reply.body);
        assert_eq!(reply.header("x-cache"), Some("BYPASS"), "{id}");
    }
    // Nothing of this hurt the VMs: a normal request is served and cached.
    for want in ["MISS", "HIT"] {
        let reply = chain.post(
            "/v1/messages",
            &[("authorization", &bearer)],
            &anthropic("after the hostile requests", false),
        )?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-cache"), Some(want));
        if want == "MISS" {
            chain.envoy.wait_metric("zerolayer_cache_stored", 1.0)?;
        }
    }
    let log = chain.envoy.log();
    assert!(
        !log.contains("panicked") && !log.contains("Wasm VM failed"),
        "a VM failed:\n{}",
        chain.envoy.log_tail(40)
    );
    let _ = chain.wait_access_log(7).context("access log")?;
    Ok(())
}

/// The issue's spray against the shipped chain: 150 forged JWTs without a
/// tenant, 150 each claiming a fresh tenant, 150 random API keys, one
/// client sending them one after the other. Without a valid credential at
/// most the client's lazy-admission bucket (`lazy_budget.per_client`,
/// shipped default 20 at once + 5/s) reaches the backend, and the failures
/// escalate "no tenant" and the gateway, after which every unknown
/// credential is verified before it goes anywhere. A valid token still
/// works afterwards.
fn a_spray_of_fresh_credentials_is_bounded_by_the_lazy_budget(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        ..ChainOptions::default()
    })?;
    let t = tokens::now();
    let started = std::time::Instant::now();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for n in 0..450u64 {
        let id = format!("spray-{n}");
        let header = match n % 3 {
            0 => (
                "authorization",
                format!(
                    "Bearer {}",
                    issuer().forged(&json!({"sub": id, "exp": t + 3600}), n)
                ),
            ),
            1 => (
                "authorization",
                format!(
                    "Bearer {}",
                    issuer().forged(&tokens::claims(&id, &format!("fresh-{n}"), t, 3600), n)
                ),
            ),
            _ => ("x-api-key", format!("sk-random-{n}")),
        };
        let reply = chain.post(
            "/v1/messages",
            &[(header.0, &header.1), ("x-request-id", &id)],
            &anthropic(&id, false),
        )?;
        *statuses.entry(reply.status).or_default() += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let through = chain.backend_requests("spray-");
    let bound = 20.0 + 5.0 * secs.ceil();
    eprintln!(
        "spray: {through} of 450 reached the backend in {secs:.1} s (bound {bound}); statuses {statuses:?}"
    );
    assert!(
        (through as f64) <= bound,
        "{through} requests without a valid credential reached the backend in {secs:.1} s"
    );
    let other: usize = statuses
        .iter()
        // 429: past its synchronous-verification budget (no verifier call).
        .filter(|(s, _)| ![200, 401, 429].contains(*s))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(other, 0, "unexpected statuses: {statuses:?}");
    let escalated = r#"zerolayer_auth_escalations{flip="escalated"}"#;
    chain.envoy.wait_metric(escalated, 2.0)?;
    // A valid token still works (verified inline: no lazy step left).
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &Chain::bearer("alice", "acme"))],
        &anthropic("after the spray", false),
    )?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    Ok(())
}

/// Issue 21 items 5, 8 and 9 against the shipped chain in real Envoy:
/// paths that escaped the chain (`//v1/messages` forwarded unbilled and
/// uncached; `/healthz/../v1/messages` and `/healthzv1/messages` public),
/// bodies naming a member twice, `16.0` hitting the entry for `16`, and
/// backend headers only the gateway may set reaching the client.
fn paths_bodies_numbers_and_gateway_headers_are_read_as_the_backend_reads_them(
    form: Form,
) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("alice", "acme")?;

    // Item 8: no credential, no path trick makes a request public.
    for (path, status) in [
        ("/healthz/../v1/messages", 401),
        ("/healthz/./../v1/messages", 401),
        ("/healthzv1/messages", 401),
        ("/healthz%2F..%2Fv1/messages", 400),
    ] {
        let reply = chain.post(
            path,
            &[("x-request-id", "anon-path")],
            &anthropic("p", false),
        )?;
        assert_eq!(reply.status, status, "{path}: {}", reply.body);
    }
    assert_eq!(
        chain.backend_requests("anon-path"),
        0,
        "a path trick reached the backend"
    );
    // `//v1/messages` is the API: cached and metered like `/v1/messages`.
    let body = anthropic("merged slashes", false);
    let reply = chain.post(
        "//v1//messages",
        &[("authorization", &bearer), ("x-request-id", "slashes-0")],
        &body,
    )?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-cache"), Some("MISS"));
    chain.envoy.wait_metric("zerolayer_cache_stored", 1.0)?;
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer), ("x-request-id", "slashes-1")],
        &body,
    )?;
    assert_eq!(reply.header("x-cache"), Some("HIT"));

    // Item 5: a body naming `stream` twice is refused before the backend.
    for (id, path, body) in [
        (
            "dup-0",
            "/v1/messages",
            r#"{"model":"claude-test","max_tokens":8,"stream":false,"stream":true,"messages":[{"role":"user","content":"d"}]}"#,
        ),
        (
            "dup-1",
            "/v1/chat/completions",
            r#"{"model":"gpt-test","stream":true,"stream_options":{"include_usage":true},"stream_options":{},"messages":[{"role":"user","content":"d"}]}"#,
        ),
    ] {
        let reply = chain.post(
            path,
            &[("authorization", &bearer), ("x-request-id", id)],
            body,
        )?;
        assert_eq!(reply.status, 400, "{id}: {}", reply.body);
        let error: serde_json::Value = serde_json::from_str(&reply.body)?;
        assert_eq!(error["error"]["type"], "invalid_request_error", "{id}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("twice")),
            "{id}: {}",
            reply.body
        );
    }
    assert_eq!(chain.backend_requests("dup-"), 0);

    // Item 9: `16.0` is not `16`.
    let numbers = |max_tokens: &str| {
        format!(
            r#"{{"model":"claude-test","max_tokens":{max_tokens},"temperature":0,"messages":[{{"role":"user","content":"numbers"}}]}}"#
        )
    };
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer)],
        &numbers("16"),
    )?;
    assert_eq!(reply.header("x-cache"), Some("MISS"));
    chain.envoy.wait_metric("zerolayer_cache_stored", 2.0)?;
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer)],
        &numbers("16"),
    )?;
    assert_eq!(reply.header("x-cache"), Some("HIT"));
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer)],
        &numbers("16.0"),
    )?;
    assert_eq!(
        reply.header("x-cache"),
        Some("MISS"),
        "16.0 hit the entry for 16"
    );

    // Item 9: the backend's `x-zerolayer-*` and `x-cache` never reach the client.
    for (id, path) in [("forge-0", "/v1/messages"), ("forge-1", "/v1/models")] {
        let reply = chain.post(
            path,
            &[
                ("authorization", &bearer),
                ("x-request-id", id),
                (
                    "x-stub-response-header",
                    "x-zerolayer-auth=verified tenant=globex",
                ),
                ("x-stub-response-header", "x-zerolayer-debug=forged"),
                ("x-stub-response-header", "x-cache=HIT"),
            ],
            &anthropic(&format!("forged headers {id}"), false),
        )?;
        assert_eq!(chain.backend_requests(id), 1, "{id}");
        assert_eq!(reply.header("x-zerolayer-auth"), None, "{id}");
        assert_eq!(reply.header("x-zerolayer-debug"), None, "{id}");
        let expected = (path == "/v1/messages").then_some("MISS");
        assert_eq!(
            reply.header("x-cache"),
            expected,
            "{id}: the backend's x-cache"
        );
    }

    let log = chain.wait_access_log_for(&["slashes-0"])?;
    let metered = log
        .get("slashes-0")
        .context("slashes-0 not in the access log")?;
    let usage: serde_json::Value =
        serde_json::from_str(metered["usage"].as_str().context("no usage")?)?;
    assert_eq!(
        usage["usage_missing"], 0,
        "//v1//messages was not metered: {usage}"
    );
    Ok(())
}

/// Issue 21 item 6, a backend that compresses when asked (as most do):
/// the stages ask it for `identity`, so usage is read and entries are
/// plain; Envoy's compressor (ahead of the chain) gzips JSON for clients
/// that accept it, hits included, and nobody gets a coding they did not
/// ask for. Before: 0 tokens billed and gzip bytes served, unlabelled, to
/// clients that never accepted gzip.
#[test]
fn a_compressing_backend_is_asked_for_identity_and_clients_get_what_they_accept() -> Result<()> {
    for form in Form::ALL {
        let chain = Chain::start(ChainOptions {
            stub: StubConfig::default().compression(Compression::Negotiated),
            form,
            ..ChainOptions::default()
        })?;
        let bearer = chain.verified_bearer("alice", "acme")?;
        let gzip = ("accept-encoding", "gzip, deflate, br");
        for (id, stream) in [("gz-json", false), ("gz-sse", true)] {
            let body = anthropic(id, stream);
            let miss = chain.post(
                "/v1/messages",
                &[("authorization", &bearer), ("x-request-id", id), gzip],
                &body,
            )?;
            assert_eq!(miss.status, 200, "{id}: {}", miss.body);
            assert_eq!(miss.header("x-cache"), Some("MISS"), "{id}");
            let seen = chain
                .stub
                .requests()
                .into_iter()
                .find(|r| r.header("x-request-id") == Some(id))
                .context("not at the backend")?;
            assert_eq!(seen.header("accept-encoding"), Some("identity"), "{id}");
            // JSON is gzipped by Envoy for this client; streams are not.
            let want = (!stream).then_some("gzip");
            assert_eq!(miss.header("content-encoding"), want, "{id}");
            let plain = String::from_utf8(miss.decoded()?)?;
            let (input, output) = chain::reported_usage(&plain)?;
            assert!(output > 0, "{id}: no usage in {plain}");
            wait::until(
                &format!("{id} in the access log"),
                Duration::from_secs(10),
                || Ok(chain.access_log_by_id().contains_key(id).then_some(())),
            )?;
            let usage = chain::logged_usage(&chain.access_log_by_id(), id)?;
            assert_eq!(usage["usage_missing"], 0, "{id}: {usage}");
            assert_eq!(
                (
                    usage["input_tokens"].as_u64(),
                    usage["output_tokens"].as_u64()
                ),
                (Some(input), Some(output)),
                "{id}: billed what the client was told"
            );
            // A hit for a client that accepts no coding: plain bytes, equal.
            wait::until(&format!("{id} stored"), Duration::from_secs(10), || {
                let hit = chain.post("/v1/messages", &[("authorization", &bearer)], &body)?;
                Ok((hit.header("x-cache") == Some("HIT")).then_some(hit))
            })
            .and_then(|hit| {
                anyhow::ensure!(
                    hit.header("content-encoding").is_none(),
                    "{id}: {:?}",
                    hit.headers
                );
                anyhow::ensure!(hit.body == plain, "{id}: the hit differs from the miss");
                Ok(())
            })?;
            // And for one that accepts gzip: gzipped by Envoy, the same bytes.
            let hit = chain.post("/v1/messages", &[("authorization", &bearer), gzip], &body)?;
            assert_eq!(hit.header("x-cache"), Some("HIT"), "{id}");
            assert_eq!(hit.header("content-encoding"), want, "{id}");
            assert_eq!(String::from_utf8(hit.decoded()?)?, plain, "{id}");
        }
    }
    Ok(())
}

/// Issue 21 item 6, a backend that gzips whatever it is asked: metering
/// decodes it and bills exactly, post-cache stores nothing (an entry would
/// reach clients that never accepted gzip), and the client gets the
/// backend's bytes with their `content-encoding`.
fn a_backend_that_always_compresses_is_metered_exactly_and_never_cached(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        stub: StubConfig::default().compression(Compression::Always),
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("alice", "acme")?;
    for (id, path, body) in [
        ("always-json", "/v1/messages", anthropic("always", false)),
        ("always-sse", "/v1/messages", anthropic("always", true)),
        (
            "always-openai",
            "/v1/chat/completions",
            openai("always", true),
        ),
    ] {
        for round in 0..2 {
            let rid = format!("{id}-{round}");
            let reply = chain.post(
                path,
                &[("authorization", &bearer), ("x-request-id", &rid)],
                &body,
            )?;
            assert_eq!(reply.status, 200, "{rid}: {}", reply.body);
            assert_eq!(
                reply.header("x-cache"),
                Some("MISS"),
                "{rid}: stored compressed"
            );
            assert_eq!(reply.header("content-encoding"), Some("gzip"), "{rid}");
            let plain = String::from_utf8(reply.decoded()?)?;
            let (input, output) = chain::reported_usage(&plain)?;
            wait::until(
                &format!("{rid} in the access log"),
                Duration::from_secs(10),
                || Ok(chain.access_log_by_id().contains_key(&rid).then_some(())),
            )?;
            let usage = chain::logged_usage(&chain.access_log_by_id(), &rid)?;
            assert_eq!(usage["usage_missing"], 0, "{rid}: {usage}");
            assert_eq!(
                usage["output_tokens"].as_u64(),
                Some(output),
                "{rid}: {usage}"
            );
            if input > 0 {
                assert_eq!(
                    usage["input_tokens"].as_u64(),
                    Some(input),
                    "{rid}: {usage}"
                );
            }
        }
    }
    chain
        .envoy
        .wait_metric(r#"zerolayer_cache_bypass{reason="encoded"}"#, 6.0)?;
    chain.envoy.wait_metric(
        r#"zerolayer_metering_encoded_responses{result="decoded"}"#,
        6.0,
    )?;
    Ok(())
}

/// Issue 21 item 4 in the shipped order (lazy-auth → activation): a
/// forged token claiming acme, sent with `x-tenant-id: acme`, is matched by
/// activation's tenant rules as `unverified`, never as acme (with activation
/// first it matched the claim, and a tenant rule could switch an observer
/// such as audit on or off for a client that names the tenant); its
/// refusal, which activation never sees, is still audited. Both forms.
#[test]
fn tenant_rules_match_only_the_verified_tenant_and_refusals_are_audited() -> Result<()> {
    const PREMIUM: &str = r#"zerolayer_activation_rule_matches{rule="premium_tenants"}"#;
    for form in Form::ALL {
        let chain = Chain::start(ChainOptions {
            form,
            ..ChainOptions::default()
        })?;
        let claims = tokens::claims("mallory", "acme", tokens::now(), 3600);
        let forged = format!("Bearer {}", issuer().forged(&claims, 11));
        let send = |id: &str| {
            chain.post(
                "/v1/messages",
                &[
                    ("authorization", &forged),
                    ("x-tenant-id", "acme"),
                    ("x-request-id", id),
                    ("cache-control", "no-store"),
                ],
                &anthropic("claimed", false),
            )
        };
        // Its one lazily admitted request: activation sees `unverified`.
        let first = send("claimed-0")?;
        assert_eq!(first.status, 200, "{}", first.body);
        let refused = wait::until("the forged token refused", Duration::from_secs(10), || {
            let reply = send("claimed-n")?;
            Ok((reply.status == 401).then_some(reply))
        })?;
        assert_eq!(refused.status, 401);
        let matched = chain.envoy.metric(PREMIUM)?.unwrap_or(0.0);
        assert_eq!(matched, 0.0, "a claimed tenant matched the premium rule");
        // A verified acme token does match it.
        let bearer = chain.verified_bearer("alice", "acme")?;
        let reply = chain.post(
            "/v1/messages",
            &[("authorization", &bearer), ("cache-control", "no-store")],
            &anthropic("verified", false),
        )?;
        assert_eq!(reply.status, 200);
        chain.envoy.wait_metric(PREMIUM, 1.0)?;
        // The refusal reached the audit sink though activation never ran.
        wait::until(
            "the refusal's audit record",
            Duration::from_secs(10),
            || {
                let audited = chain.services.audit.seen().iter().any(|r| {
                    r.body.lines().any(|line| {
                        line.contains("\"request_id\":\"claimed-n\"")
                            && line.contains("\"decision\":\"")
                    })
                });
                Ok(audited.then_some(()))
            },
        )?;
    }
    Ok(())
}

zerolayer_e2e::in_every_form!(
    a_tenant_never_receives_another_tenants_cache_entry,
    forged_expired_and_wrong_audience_tokens_under_concurrent_load,
    oversized_and_malformed_requests_get_clear_errors_and_harm_nothing,
    a_spray_of_fresh_credentials_is_bounded_by_the_lazy_budget,
    paths_bodies_numbers_and_gateway_headers_are_read_as_the_backend_reads_them,
    a_backend_that_always_compresses_is_metered_exactly_and_never_cached,
);

/// Issue 28 item 1: the per-client lazy-admission bucket is keyed by the
/// client address the operator's Envoy configuration resolves (the HTTP
/// connection manager's `use_remote_address` / `xff_num_trusted_hops`),
/// the same in every form, never by a header the client writes. One client
/// sending a fresh forged token with a fresh `x-forwarded-for` every 10 ms
/// gets at most `20 + 5 × ⌈s⌉` requests to the backend (the shipped
/// `per_client`; the native form, which read Envoy's XFF-derived address
/// under the old defaults, let every one through). Then, configured behind
/// one load balancer (`xff_num_trusted_hops: 1`), two clients that differ
/// only in the entry the balancer appends get a bucket each, whatever they
/// write to its left (the Wasm forms, which read no address, shared one).
/// Escalation is off and the tenant and gateway buckets are wide open, so
/// only the per-client bucket decides.
fn the_client_address_is_the_one_the_operator_trusts(form: Form) -> Result<()> {
    const SECS: f64 = 4.0;
    let lazy_auth = json!({
        "escalation": {"failure_ratio": 1.0, "gateway_failure_ratio": 1.0},
        "lazy_budget": {
            "gateway": {"per_sec": 1_000_000, "burst": 1_000_000},
            "per_tenant": {"per_sec": 1_000_000, "burst": 1_000_000},
            "per_client": {"per_sec": 5, "burst": 20},
        },
    });
    let t = tokens::now();
    let forged = |id: &str, n: u64| {
        let claims = tokens::claims(id, &format!("tenant-{id}"), t, 3600);
        format!("Bearer {}", issuer().forged(&claims, n))
    };
    let send = |chain: &Chain, id: &str, n: u64, xff: &str| -> Result<u16> {
        let bearer = forged(id, n);
        let headers = [
            ("authorization", bearer.as_str()),
            ("x-request-id", id),
            ("x-forwarded-for", xff),
        ];
        Ok(chain
            .post("/v1/messages", &headers, &anthropic(id, false))?
            .status)
    };

    // As shipped: a rotating `x-forwarded-for` is not a new client.
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        lazy_auth: lazy_auth.clone(),
        ..ChainOptions::default()
    })?;
    let started = std::time::Instant::now();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut n = 0u64;
    while started.elapsed().as_secs_f64() < SECS {
        let xff = format!("203.0.113.{}", n % 254 + 1);
        *statuses
            .entry(send(&chain, &format!("rotating-{n}"), n, &xff)?)
            .or_default() += 1;
        n += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let secs = started.elapsed().as_secs_f64();
    let through = chain.backend_requests("rotating-");
    let bound = 20 + 5 * secs.ceil() as usize;
    eprintln!(
        "{form:?}, shipped: {through} of {n} forged tokens with a fresh x-forwarded-for each \
         reached the backend in {secs:.1} s (bound {bound}); statuses {statuses:?}"
    );
    assert!(
        through <= bound,
        "{form:?}: {through} of {n} reached the backend in {secs:.1} s, bound {bound}"
    );
    assert!(through >= 20, "{form:?}: not even the burst ({through})");
    assert_eq!(
        statuses.keys().filter(|s| ![200, 401].contains(*s)).count(),
        0,
        "{statuses:?}"
    );
    drop(chain);

    // Behind one load balancer: the entry it appends is the client.
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        lazy_auth,
        connection_manager: json!({"use_remote_address": true, "xff_num_trusted_hops": 1}),
        ..ChainOptions::default()
    })?;
    let started = std::time::Instant::now();
    for n in 0..30u64 {
        // Client a writes a fresh address of its own to the left.
        let a = format!("203.0.113.{}, 198.51.100.1", n + 1);
        send(&chain, &format!("client-a-{n}"), 1000 + n, &a)?;
        send(&chain, &format!("client-b-{n}"), 2000 + n, "198.51.100.2")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let bound = 20 + 5 * secs.ceil() as usize;
    let (a, b) = (
        chain.backend_requests("client-a-"),
        chain.backend_requests("client-b-"),
    );
    eprintln!(
        "{form:?}, one trusted hop: client a {a} of 30, client b {b} of 30 in {secs:.1} s \
         (each its own bucket: 20 to {bound})"
    );
    for (name, got) in [("a", a), ("b", b)] {
        assert!(
            (20..=bound).contains(&got),
            "{form:?}: client {name} got {got} lazy admissions, not its own bucket's 20 to {bound}"
        );
    }
    Ok(())
}

zerolayer_e2e::in_every_form!(the_client_address_is_the_one_the_operator_trusts);
