//! lazy-auth in host-sim with the observer singleton: every path of the
//! hot path and of off-path verification, with virtual time.

use std::time::Duration;

use anyhow::{Context, Result};
use host_sim::{CallResponse, ChainId, ClusterTarget, Host, HostOptions, PluginSpec, Profile};
use serde_json::{Value, json};
use zerolayer_core::auth::identity::ParsedIdentity;
use zerolayer_e2e::tokens::{self, HS_SECRET, issuer};
use zerolayer_e2e::{paths, sim};

/// host-sim's fixed virtual start (2026-11-29 12:00:00 UTC), seconds.
const NOW: u64 = 1_795_953_600;
const VM_ID: &str = "zerolayer";

fn base_config() -> Value {
    json!({
        "public_paths": ["/healthz"],
        "credentials": [
            {"header": "authorization", "scheme": "Bearer", "kind": "jwt"},
            {"header": "x-api-key", "kind": "api_key"}
        ],
        "jwt": {"keys": issuer().jwks()["keys"], "issuers": ["https://idp.test"], "audiences": ["zerolayer"],
                "hs256_secret_env": "ZEROLAYER_HS256_SECRET"},
        "api_keys": {"cluster": "keys", "path": "/introspect", "timeout_ms": 500},
        // The gateway-wide window is off here (1: never) so tenant
        // escalation is seen alone; the spray tests turn it on.
        "escalation": {"failure_ratio": 0.05, "window_secs": 300, "min_verifications": 5,
                       "gateway_failure_ratio": 1.0},
        "breaker": {"failures": 3, "open_secs": 30},
        "verdict_max_ttl_secs": 300,
    })
}

struct Gateway {
    host: Host,
    chain: ChainId,
}

fn gateway_with(mut config: Value, profile: Profile) -> Result<Gateway> {
    let mut host = Host::with_options(HostOptions {
        profile,
        ..sim::options()?
    })?;
    host.set_cluster("keys", ClusterTarget::Manual);
    host.set_cluster("audit", ClusterTarget::Manual);
    if profile == Profile::Kong {
        config["observer"]["mode"] = json!("tick");
    }
    let text = config.to_string();
    if profile == Profile::Envoy {
        host.add_singleton(
            PluginSpec::new("observer", paths::wasm("observer_service")?)
                .vm_id(VM_ID)
                .configuration(json!({"lazy_auth": config, "tick_ms": 200}).to_string())
                .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
        )?;
    }
    let chain = host.add_chain(vec![
        PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
            .vm_id(VM_ID)
            .configuration(text)
            .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
    ])?;
    Ok(Gateway { host, chain })
}

/// A gateway for this run's profile (`ZEROLAYER_HOST_PROFILE`).
fn gateway_for(config: Value) -> Result<Gateway> {
    gateway_with(config, sim::profile()?)
}

fn gateway() -> Result<Gateway> {
    gateway_for(base_config())
}

/// What a client saw.
#[derive(Debug)]
struct Seen {
    status: Option<u16>,
    upstream: bool,
    body: String,
    auth: Option<String>,
    tenant: Option<String>,
}

impl Gateway {
    fn request(&mut self, headers: &[(&str, &str)]) -> Result<Seen> {
        self.request_to("/v1/messages", headers)
    }

    fn request_to(&mut self, path: &str, headers: &[(&str, &str)]) -> Result<Seen> {
        self.request_from(path, headers, ([127, 0, 0, 1], 40000).into())
    }

    fn request_from(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        source: std::net::SocketAddr,
    ) -> Result<Seen> {
        let mut all = vec![(":method", "POST"), (":path", path), (":authority", "gw")];
        all.extend_from_slice(headers);
        let mut s = self.host.stream_from(self.chain, source)?;
        s.request_headers(&all, true);
        let upstream = s.upstream().complete;
        if upstream {
            s.response_headers(&[(":status", "200")], true);
        }
        // Envoy keys filter state "wasm.<path>"; Kong keeps "wasmx.*" as is.
        let text =
            |k: &str| sim::published(&s, k).map(|v| String::from_utf8_lossy(&v).into_owned());
        let identity =
            text("wasmx.zerolayer_auth").and_then(|t| ParsedIdentity::parse(t.as_bytes()));
        Ok(Seen {
            status: s.client().status(),
            upstream,
            body: s.client().text(),
            auth: identity.as_ref().map(|i| i.state.to_string()),
            tenant: identity.and_then(|i| i.verified_tenant().map(str::to_string)),
        })
    }

    fn bearer(&mut self, token: &str) -> Result<Seen> {
        self.request(&[("authorization", &format!("Bearer {token}"))])
    }

    fn counter(&self, name: &str) -> u64 {
        self.host.metric(name).unwrap_or(0)
    }

    /// Answers every pending introspection callout with `status`.
    fn answer_introspections(&mut self, status: u16) -> Result<()> {
        for call in self.host.callouts() {
            if call.cluster == "keys" {
                self.host
                    .respond(call.token, CallResponse::new(status, ""))?;
            }
        }
        Ok(())
    }
}

/// A distinct client address per `n` (10.x.y.z).
fn address(n: u64) -> std::net::SocketAddr {
    let n = n as u32 + 1;
    (
        [10, (n >> 16) as u8, (n >> 8) as u8, n as u8],
        40000 + (n % 1000) as u16,
    )
        .into()
}

fn good(sub: &str, tenant: &str) -> Value {
    tokens::claims(sub, tenant, NOW, 3600)
}

#[test]
fn a_valid_token_is_admitted_once_then_served_from_its_verdict() -> Result<()> {
    let mut gw = gateway()?;
    for token in [
        issuer().es256(&good("u1", "acme")),
        issuer().rs256(&good("u2", "acme")),
        issuer().hs256(&good("u3", "acme")),
    ] {
        let first = gw.bearer(&token)?;
        assert!(first.upstream, "{first:?}");
        assert_eq!(first.auth.as_deref(), Some("unverified"));
        sim::settle(&mut gw.host);
        // The observer verified it off the path; the next request is a cache hit.
        let second = gw.bearer(&token)?;
        assert!(second.upstream, "{second:?}");
        assert_eq!(second.auth.as_deref(), Some("verified"));
        assert_eq!(second.tenant.as_deref(), Some("acme"));
    }
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_auth_decisions_outcome=lazy"), 3);
    assert_eq!(
        gw.counter("zerolayer_auth_decisions_outcome=valid_cached"),
        3
    );
    assert_eq!(gw.counter("zerolayer_auth_verdicts_outcome=valid"), 3);
    Ok(())
}

#[test]
fn forged_expired_and_wrong_audience_tokens_get_at_most_one_request() -> Result<()> {
    let mut gw = gateway()?;
    let mut wrong_aud = good("u", "acme");
    wrong_aud["aud"] = json!("someone-else");
    let cases = [
        ("forged", issuer().forged(&good("u", "acme"), 1)),
        (
            "expired",
            issuer().es256(&tokens::claims("u", "acme", NOW - 7200, 3600)),
        ),
        ("wrong audience", issuer().es256(&wrong_aud)),
    ];
    for (what, token) in cases {
        let first = gw.bearer(&token)?;
        assert!(
            first.upstream,
            "{what}: the first request is admitted lazily: {first:?}"
        );
        sim::settle(&mut gw.host);
        for _ in 0..3 {
            let next = gw.bearer(&token)?;
            assert_eq!(next.status, Some(401), "{what}: {next:?}");
            assert!(!next.upstream, "{what}");
            let body: Value = serde_json::from_str(&next.body)?;
            assert_eq!(body["error"]["type"], "authentication_error", "{what}");
        }
    }
    Ok(())
}

#[test]
fn missing_credentials_are_refused_and_public_paths_need_none() -> Result<()> {
    let mut gw = gateway()?;
    let none = gw.request(&[])?;
    assert_eq!(none.status, Some(401));
    assert_eq!(
        serde_json::from_str::<Value>(&none.body)?,
        json!({"type": "error", "error": {"type": "authentication_error", "message": "missing credential"}})
    );
    let wrong_scheme = gw.request(&[("authorization", "Basic dXNlcjpwdw==")])?;
    assert_eq!(wrong_scheme.status, Some(401));
    let public = gw.request_to("/healthz?probe=1", &[])?;
    assert!(public.upstream);
    assert_eq!(public.auth.as_deref(), Some("public"));
    Ok(())
}

#[test]
fn verdicts_expire_after_their_ttl_and_are_rechecked() -> Result<()> {
    let mut config = base_config();
    config["verdict_max_ttl_secs"] = json!(60);
    let mut gw = gateway_for(config)?;
    let token = issuer().es256(&good("u", "acme"));
    gw.bearer(&token)?;
    sim::settle(&mut gw.host);
    assert_eq!(gw.bearer(&token)?.auth.as_deref(), Some("verified"));
    gw.host.advance(Duration::from_secs(61));
    // The verdict expired: the credential is unknown again; its exposure
    // count is used up, so it verifies inline (the key is at hand).
    let again = gw.bearer(&token)?;
    assert!(again.upstream);
    assert_eq!(again.auth.as_deref(), Some("verified"));
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_auth_sync_reason=exposure_bound"), 1);
    Ok(())
}

#[test]
fn api_keys_are_verified_by_introspection_off_path_then_synchronously() -> Result<()> {
    let mut gw = gateway()?;
    // First request: admitted lazily; the observer asks the endpoint.
    let first = gw.request(&[("x-api-key", "sk-live-1")])?;
    assert!(first.upstream);
    sim::settle(&mut gw.host);
    let calls = gw.host.callouts();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].cluster, "keys");
    assert_eq!(calls[0].header("x-api-key"), Some("sk-live-1"));
    // Second request before the answer: over the bound, verified
    // synchronously: the request waits for its own introspection.
    let mut s = gw.host.stream(gw.chain)?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("x-api-key", "sk-live-1"),
        ],
        true,
    );
    assert!(!s.upstream().complete, "went on before the check");
    let sync_token = s
        .host()
        .callouts()
        .iter()
        .map(|c| c.token)
        .max()
        .context("sync callout")?;
    s.host().respond(
        sync_token,
        CallResponse::new(200, r#"{"active":true,"tenant":"globex","sub":"svc-1"}"#),
    )?;
    assert!(s.upstream().complete);
    let identity =
        sim::published(&s, "wasmx.zerolayer_auth").and_then(|v| ParsedIdentity::parse(&v));
    assert_eq!(
        identity
            .and_then(|i| i.verified_tenant().map(str::to_string))
            .as_deref(),
        Some("globex")
    );
    // A revoked key: the observer learns it, the next request is refused.
    gw.request(&[("x-api-key", "sk-revoked")])?;
    sim::settle(&mut gw.host);
    let token = gw
        .host
        .callouts()
        .iter()
        .map(|c| c.token)
        .max()
        .context("callout")?;
    gw.host
        .respond(token, CallResponse::new(200, r#"{"active":false}"#))?;
    assert_eq!(
        gw.request(&[("x-api-key", "sk-revoked")])?.status,
        Some(401)
    );
    Ok(())
}

#[test]
fn a_dead_verifier_opens_the_breaker_and_unknown_keys_are_bounded_then_refused() -> Result<()> {
    let mut gw = gateway()?;
    // Three keys whose introspection fails: the breaker opens.
    for i in 0..3 {
        gw.request(&[("x-api-key", &format!("sk-{i}"))])?;
        sim::settle(&mut gw.host);
        let token = gw
            .host
            .callouts()
            .iter()
            .map(|c| c.token)
            .max()
            .context("callout")?;
        gw.host.respond(token, CallResponse::new(503, "down"))?;
    }
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_auth_verifier_breaker_flip=opened"), 1);
    // A new key: still admitted once (allow_lazy within the bound), no call made.
    let calls_before = gw.host.callouts().len();
    assert!(gw.request(&[("x-api-key", "sk-new")])?.upstream);
    assert_eq!(
        gw.host.callouts().len(),
        calls_before,
        "the breaker lets no call through"
    );
    // Its second request is refused with a 503 rather than checked against a dead endpoint.
    assert_eq!(gw.request(&[("x-api-key", "sk-new")])?.status, Some(503));
    // A valid JWT keeps working: it verifies inline, no endpoint needed.
    let jwt = issuer().es256(&good("u", "acme"));
    assert!(gw.bearer(&jwt)?.upstream);
    assert!(gw.bearer(&jwt)?.upstream);
    Ok(())
}

#[test]
fn a_tenant_with_failing_credentials_escalates_to_synchronous_checks() -> Result<()> {
    let mut gw = gateway()?;
    // Five forged tokens claiming tenant "mallory": all fail verification.
    for n in 0..5 {
        gw.bearer(&issuer().forged(&good("x", "mallory"), n))?;
    }
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_auth_escalations_flip=escalated"), 1);
    assert!(gw.host.logs_containing("tenant mallory escalated").len() == 1);
    // Now a new forged token for mallory is refused on its first request.
    let next = gw.bearer(&issuer().forged(&good("x", "mallory"), 99))?;
    assert_eq!(next.status, Some(401));
    // Other tenants are still admitted lazily.
    assert_eq!(
        gw.bearer(&issuer().es256(&good("u", "acme")))?
            .auth
            .as_deref(),
        Some("unverified")
    );
    // Valid tokens of the escalated tenant verify inline and pass.
    let ok = gw.bearer(&issuer().es256(&good("u", "mallory")))?;
    assert_eq!(ok.auth.as_deref(), Some("verified"));
    // After the window the tenant relaxes.
    gw.host.advance(Duration::from_secs(301));
    assert_eq!(gw.counter("zerolayer_auth_escalations_flip=relaxed"), 1);
    Ok(())
}

#[test]
fn trusted_clients_verify_inline_and_never_go_lazy() -> Result<()> {
    let mut config = base_config();
    config["trusted_clients"] = json!([{"user_agent": "^internal-batch/"}]);
    let mut gw = gateway_for(config)?;
    let forged = issuer().forged(&good("x", "acme"), 7);
    let seen = gw.request(&[
        ("authorization", &format!("Bearer {forged}")),
        ("user-agent", "internal-batch/2.1"),
    ])?;
    assert_eq!(
        seen.status,
        Some(401),
        "a trusted client's forged token never passes"
    );
    let valid = issuer().es256(&good("u", "acme"));
    let seen = gw.request(&[
        ("authorization", &format!("Bearer {valid}")),
        ("user-agent", "internal-batch/2.1"),
    ])?;
    assert_eq!(seen.auth.as_deref(), Some("verified"));
    Ok(())
}

#[test]
fn an_attack_of_a_thousand_forged_tokens_gets_at_most_one_request_each() -> Result<()> {
    let mut gw = gateway()?;
    let mut admitted = 0;
    for n in 0..1000u64 {
        let token = issuer().forged(&good(&format!("attacker-{n}"), &format!("t{}", n % 50)), n);
        for attempt in 0..2 {
            let seen = gw.bearer(&token)?;
            if seen.upstream {
                admitted += 1;
                assert_eq!(attempt, 0, "token {n} got through twice");
                assert_eq!(
                    seen.auth.as_deref(),
                    Some("unverified"),
                    "never a verified verdict"
                );
            }
        }
    }
    assert!(admitted <= 1000, "{admitted}");
    Ok(())
}

#[test]
fn kong_profile_runs_the_observer_on_the_filters_tick() -> Result<()> {
    let mut config = base_config();
    config["observer"] = json!({"mode": "tick"});
    let mut gw = gateway_with(config, Profile::Kong)?;
    let token = issuer().es256(&good("u", "acme"));
    assert_eq!(gw.bearer(&token)?.auth.as_deref(), Some("unverified"));
    // No on_queue_ready in Kong: the verdict arrives with the next tick.
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.bearer(&token)?.auth.as_deref(), Some("verified"));
    Ok(())
}

#[test]
fn audit_records_reach_the_sink_when_activation_asks_and_never_carry_the_credential() -> Result<()>
{
    use std::cell::RefCell;
    use std::rc::Rc;
    let mut config = base_config();
    config["audit"] =
        json!({"cluster": "audit", "path": "/audit", "batch_max": 10, "flush_ms": 100});
    let mut host = Host::new()?;
    let shipped: Rc<RefCell<Vec<String>>> = Rc::default();
    let sink = shipped.clone();
    host.set_cluster("keys", ClusterTarget::Manual);
    host.set_cluster(
        "audit",
        ClusterTarget::Handler(Box::new(move |call| {
            sink.borrow_mut()
                .push(String::from_utf8_lossy(&call.body).into_owned());
            CallResponse::new(204, "")
        })),
    );
    host.add_singleton(
        PluginSpec::new("observer", paths::wasm("observer_service")?)
            .vm_id(VM_ID)
            .configuration(json!({"lazy_auth": config, "tick_ms": 100}).to_string())
            .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
    )?;
    let chain = host.add_chain(vec![
        // Audit for everyone except requests marked x-quiet.
        PluginSpec::new("activation", paths::wasm("activation")?).configuration(
            r#"{"defaults":["audit"],"rules":[{"name":"quiet","when":{"header":{"name":"x-quiet","exists":true}},"deactivate":["audit"]}]}"#,
        ),
        PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
            .vm_id(VM_ID)
            .configuration(config.to_string())
            .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
    ])?;
    let mut gw = Gateway { host, chain };
    let token = issuer().es256(&good("u", "acme"));
    gw.bearer(&token)?;
    gw.bearer(&token)?;
    gw.request(&[])?;
    gw.request(&[("x-quiet", "1")])?;
    // lazy-auth enqueues its audit records together on its tick (200 ms);
    // the observer ships them on its flush.
    gw.host.advance(Duration::from_millis(300));
    let lines: Vec<Value> = shipped
        .borrow()
        .iter()
        .flat_map(|batch| batch.lines().map(str::to_string).collect::<Vec<_>>())
        .map(|l| serde_json::from_str(&l))
        .collect::<Result<_, _>>()?;
    let decisions: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["decision"].as_str())
        .collect();
    // The refusal marked x-quiet is audited too: every refusal is.
    assert_eq!(
        decisions,
        ["lazy", "valid_cached", "missing", "missing"],
        "{lines:?}"
    );
    assert_eq!(lines[1]["tenant"], "acme");
    assert_eq!(lines[1]["verified"], true);
    assert_eq!(lines[1]["credential"].as_str().map(str::len), Some(16));
    for batch in shipped.borrow().iter() {
        assert!(
            !batch.contains(&token[..20]),
            "the credential leaked into an audit record"
        );
    }
    // The observer reports its counters on its next tick.
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_audit_records_outcome=shipped"), 4);
    Ok(())
}

/// The issue's spray (150 forged JWTs without a tenant, 150 each claiming a
/// fresh tenant, 150 random API keys), each from its own address, one
/// request every 100 ms: what reaches the upstream without a valid
/// credential is bounded by the gateway's bucket (`burst + per_sec × s`),
/// whatever the number of credentials, tenants and addresses.
#[test]
fn a_spray_of_fresh_credentials_gets_at_most_the_gateway_budget() -> Result<()> {
    let mut config = base_config();
    // Only the gateway bucket binds (the others wide open, escalation off):
    // the test proves the gateway-wide number.
    config["escalation"]["failure_ratio"] = json!(1.0);
    config["lazy_budget"] = json!({
        "gateway": {"per_sec": 2, "burst": 10},
        "per_tenant": {"per_sec": 1000, "burst": 1000},
        "per_client": {"per_sec": 1000, "burst": 1000},
    });
    let mut gw = gateway_for(config)?;
    let mut upstream = 0u64;
    let started = gw.host.now_ns();
    for n in 0..450u64 {
        let token = match n % 3 {
            0 => issuer().forged(&json!({"sub": "x", "exp": NOW + 3600}), n),
            1 => issuer().forged(&good("x", &format!("fresh-{n}")), n),
            _ => format!("sk-random-{n}"),
        };
        let header = if n % 3 == 2 {
            ("x-api-key", token.clone())
        } else {
            ("authorization", format!("Bearer {token}"))
        };
        let seen = gw.request_from("/v1/messages", &[(header.0, &header.1)], address(n))?;
        if seen.upstream {
            upstream += 1;
            assert_eq!(seen.auth.as_deref(), Some("unverified"), "{n}");
        }
        gw.answer_introspections(401)?;
        gw.host.advance(Duration::from_millis(100));
        gw.answer_introspections(401)?;
    }
    let secs = (gw.host.now_ns() - started) / 1_000_000_000;
    let bound = 10 + 2 * secs;
    eprintln!("spray: {upstream} of 450 reached the upstream in {secs} s (bound {bound})");
    assert!(
        upstream <= bound,
        "{upstream} requests without a valid credential reached the upstream in {secs} s (bound {bound})"
    );
    // The bucket is what stopped them: it granted about its rate.
    assert!(upstream >= bound - 5, "{upstream} of {bound}");
    gw.host.advance(Duration::from_millis(200));
    assert!(gw.counter("zerolayer_auth_sync_reason=lazy_budget") >= 450 - bound);
    Ok(())
}

/// With the shipped defaults, one client spraying fresh credentials: its
/// own bucket (burst 20) binds first, and the failures escalate "no
/// tenant" and the gateway, after which nothing unknown is admitted lazily.
#[test]
fn with_the_defaults_a_spray_escalates_no_tenant_and_the_gateway() -> Result<()> {
    let mut config = base_config();
    config["escalation"] = json!({"min_verifications": 5});
    let mut gw = gateway_for(config)?;
    let mut upstream = 0;
    for n in 0..150u64 {
        let no_tenant = issuer().forged(&json!({"sub": "x", "exp": NOW + 3600}), n);
        if gw.bearer(&no_tenant)?.upstream {
            upstream += 1;
        }
        let key = format!("sk-random-{n}");
        if gw.request(&[("x-api-key", &key)])?.upstream {
            upstream += 1;
        }
        gw.answer_introspections(401)?;
        gw.host.advance(Duration::from_millis(30));
        gw.answer_introspections(401)?;
    }
    eprintln!("spray with the defaults: {upstream} of 300 reached the upstream");
    assert!(upstream <= 20, "{upstream} of 300 reached the upstream");
    assert_eq!(
        gw.host.logs_containing("the gateway escalated").len(),
        1,
        "gateway escalation"
    );
    assert_eq!(
        gw.host
            .logs_containing("credentials without a tenant escalated")
            .len(),
        1
    );
    // A valid credential still works: verified inline, no lazy step.
    let ok = gw.bearer(&issuer().es256(&good("u", "acme")))?;
    assert!(ok.upstream);
    assert_eq!(ok.auth.as_deref(), Some("verified"));
    Ok(())
}

/// The issue's collision attack: forged credentials sharing one verdict
/// slot (here every credential does: one slot), sent alternately with the
/// observer verifying in between. Each gets at most its one unverified
/// request; a revoked API key stays refused beside another key.
#[test]
fn colliding_credentials_cannot_reset_each_others_bound() -> Result<()> {
    let mut config = base_config();
    config["verdict_slots"] = json!(1);
    let mut gw = gateway_for(config)?;
    let a = issuer().forged(&good("x", "acme"), 1);
    let b = issuer().forged(&good("x", "acme"), 2);
    let mut upstream = [0; 2];
    for _ in 0..8 {
        for (i, token) in [&a, &b].into_iter().enumerate() {
            if gw.bearer(token)?.upstream {
                upstream[i] += 1;
            }
            gw.host.advance(Duration::from_millis(200));
        }
    }
    assert_eq!(upstream, [1, 1], "forged JWTs in one slot");
    // A revoked key and another key in the same slot, alternately.
    gw.request(&[("x-api-key", "sk-revoked")])?;
    sim::settle(&mut gw.host);
    for call in gw.host.callouts() {
        gw.host
            .respond(call.token, CallResponse::new(200, r#"{"active":false}"#))?;
    }
    let mut revoked_upstream = 0;
    for n in 0..6 {
        if gw.request(&[("x-api-key", "sk-revoked")])?.upstream {
            revoked_upstream += 1;
        }
        gw.request(&[("x-api-key", &format!("sk-other-{n}"))])?;
        gw.answer_introspections(401)?;
        gw.host.advance(Duration::from_millis(200));
        gw.answer_introspections(401)?;
    }
    assert_eq!(revoked_upstream, 0, "the revoked key came back");
    Ok(())
}

/// A client cannot open the verifier's breaker: oversized keys are refused
/// (431) before any callout, keys the endpoint refuses as malformed (400)
/// are those keys' failures, and a valid new key keeps working.
#[test]
fn a_client_cannot_open_the_verifier_breaker() -> Result<()> {
    let mut gw = gateway()?;
    let huge = "k".repeat(9 * 1024);
    for _ in 0..5 {
        let seen = gw.request(&[("x-api-key", &huge)])?;
        assert_eq!(seen.status, Some(431));
        assert!(!seen.upstream);
        assert!(
            seen.body.contains("credential longer than 4096 bytes"),
            "{}",
            seen.body
        );
        sim::settle(&mut gw.host);
    }
    assert!(
        gw.host.callouts().is_empty(),
        "an oversized key reached the verifier"
    );
    // Keys the endpoint answers 400 for (malformed): lazily admitted once
    // each, then invalid; the breaker (3 failures here) stays closed.
    for n in 0..5 {
        gw.request(&[("x-api-key", &format!("sk-malformed-{n}"))])?;
        sim::settle(&mut gw.host);
        gw.answer_introspections(400)?;
        assert_eq!(
            gw.request(&[("x-api-key", &format!("sk-malformed-{n}"))])?
                .status,
            Some(401)
        );
    }
    gw.host.advance(Duration::from_millis(200));
    assert_eq!(gw.counter("zerolayer_auth_verifier_breaker_flip=opened"), 0);
    // A valid new key works: the failures escalated "no tenant" (5 here),
    // so it is introspected before it goes on, and the verifier answers.
    let mut s = gw.host.stream(gw.chain)?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("x-api-key", "sk-good"),
        ],
        true,
    );
    for call in s.host().callouts() {
        s.host().respond(
            call.token,
            CallResponse::new(200, r#"{"active":true,"tenant":"acme"}"#),
        )?;
    }
    sim::settle(s.host());
    for call in s.host().callouts() {
        s.host().respond(
            call.token,
            CallResponse::new(200, r#"{"active":true,"tenant":"acme"}"#),
        )?;
    }
    assert!(s.upstream().complete, "a valid new key was not let through");
    sim::settle(&mut gw.host);
    let again = gw.request(&[("x-api-key", "sk-good")])?;
    assert!(again.upstream);
    assert_eq!(again.tenant.as_deref(), Some("acme"));
    Ok(())
}

/// Billing uses only verified identity: behind lazy-auth, metering bills an
/// unverified request as `unverified` and a verified one without a tenant
/// as `unknown` (no default configured), never as the tenant a client
/// names in `x-tenant-id` or claims in a forged token; a spray of made-up
/// claims cannot push a real tenant into `other`.
#[test]
fn billing_and_labels_use_only_the_verified_identity() -> Result<()> {
    let config = base_config();
    let mut host = sim::host()?;
    host.set_cluster("keys", ClusterTarget::Manual);
    let mut lazy = config.clone();
    sim::observer(
        &mut host,
        "lazy_auth",
        &mut lazy,
        &[("ZEROLAYER_HS256_SECRET", HS_SECRET)],
    )?;
    let mut metering = json!({
        "environment": "test",
        "tenant_header": "x-tenant-id",
        "sampling": {"percent": 100},
        "labels": {"max_tenants": 3, "max_models": 5},
    });
    sim::observer_mode(&mut metering);
    let chain = host.add_chain(vec![
        PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
            .vm_id(VM_ID)
            .configuration(lazy.to_string())
            .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
        PluginSpec::new("metering", paths::wasm("metering")?)
            .configuration(metering.to_string())
            .allow_on_headers_stop_iteration(true),
    ])?;
    let billed = |host: &mut Host, credential: (&str, &str), named: &str| -> Result<String> {
        let body = r#"{"model":"claude-test","max_tokens":8,"messages":[]}"#;
        let mut s = host.stream(chain)?;
        s.request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/messages"),
                (":authority", "gw"),
                ("content-type", "application/json"),
                ("content-length", &body.len().to_string()),
                ("x-tenant-id", named),
                credential,
            ],
            false,
        );
        s.request_body(body.as_bytes(), true);
        if !s.upstream().complete {
            return Ok("(not admitted)".into());
        }
        s.response_headers(
            &[(":status", "200"), ("content-type", "application/json")],
            false,
        );
        s.response_body(
            br#"{"model":"claude-test","usage":{"input_tokens":3,"output_tokens":2}}"#,
            true,
        );
        let usage: Value = serde_json::from_slice(
            &sim::published(&s, "wasmx.zerolayer_usage").context("no usage entry")?,
        )?;
        Ok(usage["tenant"].as_str().unwrap_or_default().to_string())
    };
    let settle = |host: &mut Host| host.advance(Duration::from_millis(250));
    // A forged token claiming acme, the header naming globex: unverified.
    let forged = format!("Bearer {}", issuer().forged(&good("x", "acme"), 1));
    assert_eq!(
        billed(&mut host, ("authorization", &forged), "globex")?,
        "unverified"
    );
    // A valid token without a tenant claim: unverified first, then unknown.
    let mut no_tenant = good("svc", "x");
    no_tenant.as_object_mut().map(|c| c.remove("tenant"));
    let jwt = format!("Bearer {}", issuer().es256(&no_tenant));
    assert_eq!(
        billed(&mut host, ("authorization", &jwt), "globex")?,
        "unverified"
    );
    settle(&mut host);
    assert_eq!(
        billed(&mut host, ("authorization", &jwt), "globex")?,
        "unknown"
    );
    // A verified API key whose introspection names no tenant: unknown.
    billed(&mut host, ("x-api-key", "sk-no-tenant"), "globex")?;
    settle(&mut host);
    for call in host.callouts() {
        host.respond(call.token, CallResponse::new(200, r#"{"active":true}"#))?;
    }
    assert_eq!(
        billed(&mut host, ("x-api-key", "sk-no-tenant"), "globex")?,
        "unknown"
    );
    // Forged tokens claiming fresh tenants, each naming another in the
    // header: all billed `unverified`, one label.
    for n in 0..10u64 {
        let t = format!(
            "Bearer {}",
            issuer().forged(&good("x", &format!("t{n}")), 100 + n)
        );
        let tenant = billed(&mut host, ("authorization", &t), &format!("h{n}"))?;
        assert!(
            ["unverified", "(not admitted)"].contains(&tenant.as_str()),
            "{tenant}"
        );
    }
    // A real tenant arriving afterwards still gets its own label.
    let acme = format!("Bearer {}", issuer().es256(&good("u", "acme")));
    billed(&mut host, ("authorization", &acme), "globex")?;
    settle(&mut host);
    assert_eq!(
        billed(&mut host, ("authorization", &acme), "globex")?,
        "acme"
    );
    host.advance(Duration::from_millis(250));
    assert!(
        host.metric("zerolayer_metering_requests_tenant=acme_model=claude-test")
            .unwrap_or(0)
            >= 1
    );
    assert_eq!(
        host.metric("zerolayer_metering_requests_tenant=other_model=claude-test"),
        None,
        "a real tenant was pushed into `other`"
    );
    Ok(())
}

/// Activation's tenant rules behind lazy-auth match only the verified
/// tenant: a forged token claiming acme, with `x-tenant-id: acme`, is
/// matched as `unverified`; acme's verified token matches.
#[test]
fn activation_behind_lazy_auth_matches_only_the_verified_tenant() -> Result<()> {
    let mut host = sim::host()?;
    host.set_cluster("keys", ClusterTarget::Manual);
    let mut lazy = base_config();
    sim::observer(
        &mut host,
        "lazy_auth",
        &mut lazy,
        &[("ZEROLAYER_HS256_SECRET", HS_SECRET)],
    )?;
    let chain = host.add_chain(vec![
        PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
            .vm_id(VM_ID)
            .configuration(lazy.to_string())
            .env("ZEROLAYER_HS256_SECRET", HS_SECRET),
        PluginSpec::new("activation", paths::wasm("activation")?).configuration(
            r#"{"rules":[{"name":"acme","when":{"tenant":{"in":["acme"]}},"activate":["metering"]},
                         {"name":"unverified","when":{"tenant":{"in":["unverified"]}},"activate":["audit"]}]}"#,
        ),
    ])?;
    let mut observers = |bearer: &str| -> Result<String> {
        let mut s = host.stream(chain)?;
        s.request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/messages"),
                (":authority", "gw"),
                ("x-tenant-id", "acme"),
                ("authorization", bearer),
            ],
            true,
        );
        let list = sim::published(&s, "wasmx.zerolayer_observers").unwrap_or_default();
        host.advance(Duration::from_millis(250));
        Ok(String::from_utf8_lossy(&list).into_owned())
    };
    let forged = format!("Bearer {}", issuer().forged(&good("x", "acme"), 3));
    assert_eq!(observers(&forged)?, "audit");
    let acme = format!("Bearer {}", issuer().es256(&good("u", "acme")));
    // Its first request is unverified (lazy), the next verified.
    assert_eq!(observers(&acme)?, "audit");
    assert_eq!(observers(&acme)?, "metering");
    Ok(())
}
