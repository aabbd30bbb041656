//! Security, second round (issue 28), in real Envoy with the chain as
//! shipped, in every form: the bounds the threat model states hold for
//! ever — after a verdict expires, against colliding credentials, against a
//! client spending the verifier, against a full store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;

use zerolayer_e2e::chain::{Chain, ChainOptions, Form, anthropic};
use zerolayer_e2e::mock::MockReply;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::wait;

const INVALID: &str = r#"zerolayer_auth_verdicts{outcome="invalid"}"#;

/// Issue 28, item 2. A forged JWT and a revoked API key, each lazily
/// admitted once and refused, are silent past their negative verdict's TTL;
/// four colliding credentials are sent into their set (one set holds every
/// credential here); after a second silence past the TTL both come back:
/// neither reaches the backend again, because their counts outlive the
/// verdict for `unverified_memory_secs` after their last request (before:
/// the colliders took their stale ways and each got a second unverified
/// request). Scaled down: TTL 2 s, memory 8 s (shipped: 60 s and 3600 s).
fn a_refused_credential_stays_refused_after_its_verdict_expires(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        lazy_auth: json!({
            "negative_ttl_secs": 2,
            "unverified_memory_secs": 8,
            "verdict_slots": 1,
            "verdict_ways": 4,
        }),
        ..ChainOptions::default()
    })?;
    let t = tokens::now();
    let forged = format!(
        "Bearer {}",
        issuer().forged(&json!({"sub": "mallory", "exp": t + 3600}), 7)
    );
    let revoked = "sk-revoked-round-two";
    let send = |header: (&str, &str), id: &str| -> Result<u16> {
        let reply = chain.post(
            "/v1/messages",
            &[header, ("x-request-id", id)],
            &anthropic(id, false),
        )?;
        Ok(reply.status)
    };
    let forged_header = ("authorization", forged.as_str());
    let revoked_header = ("x-api-key", revoked);
    // Each gets its one unverified request, then its negative verdict.
    assert_eq!(send(forged_header, "forged-1")?, 200);
    assert_eq!(send(revoked_header, "revoked-1")?, 200);
    chain.envoy.wait_metric(INVALID, 2.0)?;
    assert_eq!(send(forged_header, "forged-2")?, 401);
    assert_eq!(send(revoked_header, "revoked-2")?, 401);
    // Past the negative verdicts' TTL, colliders fill the set. (Waiting
    // out a TTL in Envoy's own clock: time is the condition here.)
    std::thread::sleep(Duration::from_secs(3));
    for n in 0..4u64 {
        let collider = format!(
            "Bearer {}",
            issuer().forged(&json!({"sub": format!("c{n}"), "exp": t + 3600}), 100 + n)
        );
        let status = send(("authorization", &collider), &format!("collider-{n}"))?;
        assert!([200, 401].contains(&status), "collider {n}: {status}");
    }
    // Past the colliders' own TTL too: the old retention let everyone's
    // way be taken here.
    std::thread::sleep(Duration::from_secs(3));
    let again = (
        send(forged_header, "forged-3")?,
        send(revoked_header, "revoked-3")?,
    );
    let through = (
        chain.backend_requests("forged-"),
        chain.backend_requests("revoked-"),
    );
    eprintln!("{form:?}: statuses after the silences {again:?}, backend requests {through:?}");
    assert_eq!(again, (401, 401), "a refused credential was admitted again");
    assert_eq!(
        through,
        (1, 1),
        "each reached the backend once, within its unverified allowance, never again"
    );
    Ok(())
}

/// Issue 28, item 4. One tenant (acme) mints valid tokens, one request
/// each, far more than the verdict sets hold (here 16 sets × 4 ways: 120
/// new verdicts between two requests of a key, 7 or 8 per set), while
/// another tenant (globex) brings 4 new API keys: every globex key is
/// introspected once and then served from its stored verdict, whatever
/// acme mints between its requests (acme replaces its own verdicts once it
/// holds half a set: before, a newcomer evicted the verdict expiring
/// soonest, globex's); a new prompt is still cached; natively no
/// shared-data write is refused (the store gives each purpose the room its
/// configuration declares; it refused new keys for good past ~92,000).
fn a_tenant_minting_credentials_cannot_fill_what_others_need(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        lazy_auth: json!({"verdict_slots": 16, "verdict_ways": 4}),
        ..ChainOptions::default()
    })?;
    let mut minted = 0u32;
    let mut mint = |n: u32| -> Result<()> {
        for _ in 0..n {
            minted += 1;
            let bearer = Chain::bearer(&format!("mint-{minted}"), "acme");
            let id = format!("mint-{minted}");
            let reply = chain.post(
                "/v1/messages",
                &[("authorization", &bearer), ("x-request-id", &id)],
                &anthropic("minted", false),
            )?;
            anyhow::ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
        }
        Ok(())
    };
    mint(300)?;
    let keys: Vec<String> = (0..4)
        .map(|i| format!("{}round-two-{i}", zerolayer_e2e::chain::ROTATING_KEY_PREFIX))
        .collect();
    for key in &keys {
        for attempt in 0..3 {
            let id = format!("globex-{key}-{attempt}");
            let reply = chain.post(
                "/v1/messages",
                &[("x-api-key", key), ("x-request-id", &id)],
                &anthropic("globex's prompt", false),
            )?;
            anyhow::ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
            if attempt == 0 {
                // The key has been introspected (off the path, or on it)
                // before acme mints more.
                wait::until(
                    &format!("{key} introspected"),
                    Duration::from_secs(5),
                    || {
                        let seen = chain.services.api_keys.seen();
                        Ok(seen
                            .iter()
                            .any(|r| r.header("x-api-key") == Some(key.as_str()))
                            .then_some(()))
                    },
                )?;
            }
            mint(120)?;
        }
    }
    let seen = chain.services.api_keys.seen();
    let introspected: Vec<usize> = keys
        .iter()
        .map(|k| {
            seen.iter()
                .filter(|r| r.header("x-api-key") == Some(k.as_str()))
                .count()
        })
        .collect();
    let fresh = |prompt: &str| -> Result<Option<String>> {
        let reply = chain.post(
            "/v1/messages",
            &[("x-api-key", &keys[0])],
            &anthropic(prompt, false),
        )?;
        Ok(reply.header("x-cache").map(str::to_string))
    };
    let cached = (fresh("a new prompt")?, fresh("a new prompt")?);
    let refused = chain.envoy.metric("zerolayer_native_shared_refused")?;
    eprintln!(
        "{form:?}: {minted} minted tokens; introspections per globex key {introspected:?}; new prompt {cached:?}; native refusals {refused:?}"
    );
    assert!(
        introspected.iter().all(|&n| n == 1),
        "each new key must be introspected once, then served from its verdict: {introspected:?}"
    );
    assert_eq!(
        cached,
        (Some("MISS".to_string()), Some("HIT".to_string())),
        "a new prompt is cached"
    );
    assert!(
        refused.unwrap_or(0.0) == 0.0,
        "shared-data writes refused: {refused:?}"
    );
    Ok(())
}

/// The API keys the introspection endpoint of [`a_client_spraying_keys_cannot_spend_the_verifier`]
/// knows as active.
const LEGIT_KEY_PREFIX: &str = "sk-legit-";

/// Issue 28, item 3. An introspection endpoint that allows 40 calls a
/// second and answers 429 (`retry-after: 1`) beyond; one client (one
/// address, behind the one load balancer the gateway trusts) sprays random
/// API keys as fast as it can while 16 new legitimate keys arrive, each
/// from its own address. Every legitimate key's first request is served;
/// the endpoint never has to push back; and the calls the sprayer causes
/// stay within its budgets: lazily admitted keys verified off the path
/// (`lazy_budget.per_client`: 20 + 5/s) plus synchronous checks
/// (`verify_budget.per_client`: 5 + 1/s). Before: 1.01 calls per sprayed
/// key, the endpoint answered 429 and new keys got 503.
fn a_client_spraying_keys_cannot_spend_the_verifier(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        sample_percent: 0.0,
        connection_manager: json!({"use_remote_address": true, "xff_num_trusted_hops": 1}),
        ..ChainOptions::default()
    })?;
    // 40 calls a second, then 429.
    let bucket = Arc::new(Mutex::new((40.0f64, Instant::now())));
    let limited = bucket.clone();
    chain.services.api_keys.set_handler(move |request| {
        let mut state = limited
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        state.0 = (state.0 + now.duration_since(state.1).as_secs_f64() * 40.0).min(40.0);
        state.1 = now;
        if state.0 < 1.0 {
            return MockReply {
                status: 429,
                headers: vec![("retry-after".into(), "1".into())],
                body: r#"{"error":"slow down"}"#.into(),
            };
        }
        state.0 -= 1.0;
        let active = request
            .header("x-api-key")
            .is_some_and(|k| k.starts_with(LEGIT_KEY_PREFIX));
        let body = if active {
            r#"{"active":true,"tenant":"globex","sub":"new"}"#
        } else {
            r#"{"active":false}"#
        };
        MockReply {
            status: 200,
            headers: vec![],
            body: body.into(),
        }
    });
    let started = Instant::now();
    let mut legit = Vec::new();
    let mut spray_statuses: HashMap<u16, usize> = HashMap::new();
    for n in 0..1600u32 {
        let key = format!("sk-spray-{n}");
        let id = format!("spray-{n}");
        let reply = chain.post(
            "/v1/messages",
            &[
                ("x-api-key", &key),
                ("x-request-id", &id),
                ("x-forwarded-for", "203.0.113.9"),
            ],
            &anthropic("spray", false),
        )?;
        *spray_statuses.entry(reply.status).or_default() += 1;
        if n % 100 == 50 {
            let i = legit.len();
            let key = format!("{LEGIT_KEY_PREFIX}{i}");
            let address = format!("198.51.100.{}", i + 1);
            let reply = chain.post(
                "/v1/messages",
                &[("x-api-key", &key), ("x-forwarded-for", &address)],
                &anthropic("a new customer", false),
            )?;
            legit.push((
                reply.status,
                reply.header("retry-after").map(str::to_string),
            ));
        }
    }
    let secs = started.elapsed().as_secs_f64().ceil();
    let seen = chain.services.api_keys.seen();
    let spray_calls = seen
        .iter()
        .filter(|r| {
            r.header("x-api-key")
                .is_some_and(|k| k.starts_with("sk-spray-"))
        })
        .count();
    let bound = (20.0 + 5.0 * secs) + (5.0 + 1.0 * secs);
    let pushed_back = chain
        .envoy
        .metric(r#"zerolayer_auth_decisions{outcome="verifier_throttled"}"#)?;
    eprintln!(
        "{form:?}: {secs} s; legit {legit:?}; spray statuses {spray_statuses:?}; the sprayer caused {spray_calls} introspection calls (bound {bound}); throttled answers {pushed_back:?}"
    );
    assert!(
        legit.iter().all(|(status, _)| *status == 200),
        "a new legitimate key was refused during the spray: {legit:?}"
    );
    assert!(
        (spray_calls as f64) <= bound,
        "the sprayer caused {spray_calls} verifier calls in {secs} s (bound {bound})"
    );
    assert!(
        spray_statuses.keys().all(|s| [200, 401, 429].contains(s)),
        "the sprayer got {spray_statuses:?}"
    );
    Ok(())
}

zerolayer_e2e::in_every_form!(
    a_refused_credential_stays_refused_after_its_verdict_expires,
    a_tenant_minting_credentials_cannot_fill_what_others_need,
    a_client_spraying_keys_cannot_spend_the_verifier,
);
