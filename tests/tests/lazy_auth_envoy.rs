//! lazy-auth in real Envoy with the observer as a singleton service, a JWKS
//! endpoint, an API key introspection endpoint and an echo upstream.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_core::auth::identity::ParsedIdentity;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Client, EchoUpstream, Envoy, EnvoyConfig, MockServer, paths, wait};

struct Gateway {
    upstream: EchoUpstream,
    keys: MockServer,
    _idp: MockServer,
    envoy: Envoy,
    client: Client,
}

/// The identity lazy-auth published, as the route copied it upstream.
fn identity(request: &zerolayer_e2e::SeenRequest) -> Option<ParsedIdentity> {
    ParsedIdentity::parse(request.header("x-test-auth")?.as_bytes())
}

fn gateway() -> Result<Gateway> {
    paths::wasm("lazy_auth")?;
    paths::wasm("observer_service")?;
    let upstream = EchoUpstream::start()?;
    let jwks = issuer().jwks().to_string();
    let idp = MockServer::start(move |_| (200, jwks.clone()))?;
    let keys = MockServer::start(|req| match req.header("x-api-key") {
        Some("sk-good") => (
            200,
            r#"{"active":true,"tenant":"globex","sub":"svc"}"#.into(),
        ),
        _ => (200, r#"{"active":false}"#.into()),
    })?;
    let mut lazy: Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/lazy-auth/example.json"),
    )?)?;
    lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
    lazy["audit"] = Value::Null;
    let mut config = EnvoyConfig::shipped("lazy-auth.yaml")?
        .for_run(upstream.addr())?
        .point_cluster("idp", idp.addr())?
        .point_cluster("api_keys", keys.addr())?;
    config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
    config.set_service_config(
        "zerolayer.observer",
        &json!({"lazy_auth": lazy, "tick_ms": 100}).to_string(),
    )?;
    config.add_route_request_header(
        "x-test-auth",
        "%FILTER_STATE(wasm.wasmx.zerolayer_auth:PLAIN)%",
    )?;
    let envoy = Envoy::start(&config)?;
    // Ready once the observer holds the issuer's keys: before that, a token
    // past its unverified allowance cannot be verified inline and gets 503.
    envoy.wait_metric(r#"zerolayer_auth_jwks_fetches{outcome="ok"}"#, 1.0)?;
    Ok(Gateway {
        upstream,
        keys,
        _idp: idp,
        envoy,
        client: Client::new(),
    })
}

impl Gateway {
    fn send(&self, case: &str, headers: &[(&str, &str)]) -> Result<u16> {
        let mut all = headers.to_vec();
        all.push(("x-test-case", case));
        Ok(self
            .client
            .send("POST", &self.envoy.url("/v1/messages"), &all, "{}")?
            .status)
    }

    fn bearer(&self, case: &str, token: &str) -> Result<u16> {
        self.send(case, &[("authorization", &format!("Bearer {token}"))])
    }

    /// Sends until `want` comes back (the observer verifies asynchronously).
    fn until(&self, case: &str, token: &str, want: u16) -> Result<()> {
        wait::until(&format!("{case}: {want}"), Duration::from_secs(10), || {
            Ok((self.bearer(case, token)? == want).then_some(()))
        })
        .with_context(|| self.envoy.log())
    }

    /// The identity the upstream saw on the latest request of `case`.
    fn latest_identity(&self, case: &str) -> Option<ParsedIdentity> {
        self.upstream
            .seen()
            .into_iter()
            .rev()
            .find(|r| r.header("x-test-case") == Some(case))
            .and_then(|r| identity(&r))
    }
}

#[test]
fn valid_invalid_expired_forged_and_missing_credentials() -> Result<()> {
    let gw = gateway()?;
    let t = tokens::now();
    let es = issuer().es256(&tokens::claims("u1", "acme", t, 3600));
    let rs = issuer().rs256(&tokens::claims("u2", "acme", t, 3600));
    for (case, token) in [("es256", &es), ("rs256", &rs)] {
        assert_eq!(gw.bearer(case, token)?, 200, "{case}");
        // Verified off the path: later requests carry the verified tenant.
        let id = wait::until(&format!("{case} verified"), Duration::from_secs(10), || {
            assert_eq!(gw.bearer(case, token)?, 200, "{case}");
            Ok(gw.latest_identity(case).filter(|id| id.state == "verified"))
        })?;
        assert_eq!(id.verified_tenant(), Some("acme"));
    }
    let forged = issuer().forged(&tokens::claims("x", "acme", t, 3600), 1);
    let expired = issuer().es256(&tokens::claims("x", "acme", t - 7200, 3600));
    let mut wrong_aud = tokens::claims("x", "acme", t, 3600);
    wrong_aud["aud"] = json!("other");
    let wrong_aud = issuer().es256(&wrong_aud);
    for (case, token) in [
        ("forged", &forged),
        ("expired", &expired),
        ("wrong_aud", &wrong_aud),
    ] {
        gw.until(case, token, 401)?;
        // Once refused, refused for good.
        for _ in 0..3 {
            assert_eq!(gw.bearer(case, token)?, 401, "{case}");
        }
        let reached = gw
            .upstream
            .seen()
            .iter()
            .filter(|r| r.header("x-test-case") == Some(case))
            .count();
        assert!(
            reached <= 1,
            "{case}: {reached} requests reached the upstream"
        );
    }
    let reply = gw
        .client
        .send("POST", &gw.envoy.url("/v1/messages"), &[], "{}")?;
    assert_eq!(reply.status, 401);
    let body: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(reply.header("content-type"), Some("application/json"));
    Ok(())
}

#[test]
fn an_attack_of_a_thousand_forged_tokens_gets_at_most_one_request_per_token() -> Result<()> {
    let gw = gateway()?;
    let t = tokens::now();
    let tokens: Vec<String> = (0..1000u64)
        .map(|n| {
            issuer().forged(
                &tokens::claims(&format!("attacker-{n}"), "mallory", t, 3600),
                n,
            )
        })
        .collect();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for (n, token) in tokens.iter().enumerate() {
        for attempt in 0..2 {
            let status = gw.bearer(&format!("attack-{n}-{attempt}"), token)?;
            *statuses.entry(status).or_default() += 1;
        }
    }
    // Per token: at most one request ever reached the upstream.
    let mut per_token: HashMap<String, usize> = HashMap::new();
    for r in gw.upstream.seen() {
        if let Some(case) = r
            .header("x-test-case")
            .and_then(|c| c.strip_prefix("attack-"))
        {
            let token = case
                .rsplit_once('-')
                .map(|(n, _)| n.to_string())
                .unwrap_or_default();
            *per_token.entry(token).or_default() += 1;
        }
    }
    let worst = per_token.values().copied().max().unwrap_or(0);
    assert!(worst <= 1, "a forged token got {worst} requests through");
    let through: usize = per_token.values().sum();
    assert!(through <= 1000, "{through}");
    // Every token's verdict arrives: afterwards all of them are refused.
    for (n, token) in tokens.iter().enumerate().step_by(97) {
        gw.until(&format!("after-{n}"), token, 401)?;
    }
    eprintln!("attack: {statuses:?}, {through} of 2000 requests reached the upstream");
    Ok(())
}

#[test]
fn api_keys_are_verified_by_introspection_and_an_outage_is_refused_not_opened() -> Result<()> {
    let gw = gateway()?;
    assert_eq!(gw.send("good-1", &[("x-api-key", "sk-good")])?, 200);
    wait::until("sk-good verified", Duration::from_secs(10), || {
        assert_eq!(gw.send("good-n", &[("x-api-key", "sk-good")])?, 200);
        Ok(gw
            .latest_identity("good-n")
            .filter(|id| id.verified_tenant() == Some("globex"))
            .map(|_| ()))
    })?;
    // An unknown key is refused once the endpoint says so.
    wait::until("sk-bad refused", Duration::from_secs(10), || {
        Ok((gw.send("bad", &[("x-api-key", "sk-bad")])? == 401).then_some(()))
    })?;
    // The introspection service goes down: new keys get at most their
    // lazy request, then 503 (never unchecked access).
    gw.keys.set_handler(|_| (503, "down".into()));
    let first = gw.send("outage-1", &[("x-api-key", "sk-unknown")])?;
    let second = gw.send("outage-2", &[("x-api-key", "sk-unknown")])?;
    let third = gw.send("outage-3", &[("x-api-key", "sk-unknown")])?;
    assert_eq!(
        first, 200,
        "the first request of an unknown key is admitted lazily"
    );
    assert_eq!((second, third), (503, 503));
    // Verified keys keep working through the outage (their verdict's TTL).
    assert_eq!(
        gw.send("good-during-outage", &[("x-api-key", "sk-good")])?,
        200
    );
    Ok(())
}

#[test]
fn the_shipped_config_embeds_the_documented_example_in_filter_and_observer() -> Result<()> {
    let example: Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/lazy-auth/example.json"),
    )?)?;
    let config = EnvoyConfig::shipped("lazy-auth.yaml")?;
    let filter: Value = serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
    assert_eq!(
        filter, example,
        "envoy/lazy-auth.yaml's filter drifted from filters/lazy-auth/example.json"
    );
    let text = std::fs::read_to_string(paths::root().join("envoy/lazy-auth.yaml"))?;
    let doc: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let service =
        doc["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_default();
    let service: Value = serde_json::from_str(&service)?;
    assert_eq!(service["lazy_auth"], example, "the observer's copy drifted");
    Ok(())
}
