//! post-cache in real Envoy (the shipped `envoy/zerolayer.yaml`: activation,
//! lazy-auth, post-cache, metering, the observer singleton) against the GPU
//! backend stub and the real model server.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, MockServer, ModelServer, paths, wait};
use zerolayer_stub::{Stub, StubConfig};

use zerolayer_e2e::chain::{CACHE_SECRET as SECRET, anthropic, openai};

/// Envoy from the shipped config in front of `backend`, with JWTs verified
/// synchronously with the test issuer's keys (so the first request already
/// has a verified tenant).
struct Gateway {
    envoy: Envoy,
    _idp: MockServer,
    client: Client,
    bearer: String,
}

fn gateway(backend: std::net::SocketAddr, cache: impl FnOnce(&mut Value)) -> Result<Gateway> {
    gateway_with(backend, cache, None)
}

/// Like [`gateway`]; with `webdis`, the fleet tier is on (filter and observer).
fn gateway_with(
    backend: std::net::SocketAddr,
    cache: impl FnOnce(&mut Value),
    webdis: Option<std::net::SocketAddr>,
) -> Result<Gateway> {
    paths::wasm("post_cache")?;
    let jwks = issuer().jwks().to_string();
    let idp = MockServer::start(move |_| (200, jwks.clone()))?;
    let mut config = EnvoyConfig::shipped("zerolayer.yaml")?
        .for_run(backend)?
        .point_cluster("idp", idp.addr())?
        .env("ZEROLAYER_CACHE_SECRET", SECRET);
    if let Some(webdis) = webdis {
        config = config.add_cluster("webdis", webdis)?;
    }
    let mut lazy: Value = serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
    lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
    lazy["jwt"]["keys"] = issuer().jwks()["keys"].clone();
    lazy["unknown"] = json!("sync");
    lazy["audit"] = Value::Null;
    config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
    let mut post: Value =
        serde_json::from_str(&config.wasm_filter_config("zerolayer.post_cache")?)?;
    if webdis.is_some() {
        post["fleet"] = json!({"cluster": "webdis", "path": "/", "timeout_ms": 500});
    }
    cache(&mut post);
    config.set_wasm_filter_config("zerolayer.post_cache", &post.to_string())?;
    // One observer for both filters: verification and fleet writes.
    let mut service = json!({"lazy_auth": lazy, "tick_ms": 100});
    if webdis.is_some() {
        service["post_cache"] = post.clone();
    }
    config.set_service_config("zerolayer.observer", &service.to_string())?;
    let envoy = Envoy::start(&config)?;
    let token = issuer().es256(&tokens::claims("alice", "acme", tokens::now(), 3600));
    Ok(Gateway {
        envoy,
        _idp: idp,
        client: Client::new(),
        bearer: format!("Bearer {token}"),
    })
}

impl Gateway {
    fn post(&self, path: &str, body: &str) -> Result<zerolayer_e2e::Reply> {
        self.client.send(
            "POST",
            &self.envoy.url(path),
            &[
                ("authorization", &self.bearer),
                ("content-type", "application/json"),
            ],
            body,
        )
    }
}

#[test]
fn plain_and_streamed_responses_are_hits_the_second_time() -> Result<()> {
    let stub = Stub::start(StubConfig::default())?;
    let gw = gateway(stub.addr(), |_| {})?;
    for (path, body) in [
        ("/v1/messages", anthropic("plain", false)),
        ("/v1/messages", anthropic("streamed", true)),
        ("/v1/chat/completions", openai("plain", false)),
        ("/v1/chat/completions", openai("streamed", true)),
    ] {
        let first = gw.post(path, &body)?;
        assert_eq!(first.status, 200, "{path}: {}", first.body);
        assert_eq!(first.header("x-cache"), Some("MISS"), "{path} {body}");
        let served_before = stub.requests().len();
        let second = gw.post(path, &body)?;
        assert_eq!(second.status, 200);
        assert_eq!(second.header("x-cache"), Some("HIT"), "{path} {body}");
        assert!(second.header("age").is_some());
        assert_eq!(second.body, first.body, "{path}: the replay differs");
        assert_eq!(second.header("content-type"), first.header("content-type"));
        assert_eq!(
            stub.requests().len(),
            served_before,
            "{path}: a hit reached the backend"
        );
    }
    gw.envoy
        .wait_metric(r#"zerolayer_cache_lookups{result="hit"}"#, 4.0)?;
    gw.envoy.wait_metric("zerolayer_cache_stored", 4.0)?;
    Ok(())
}

#[test]
fn identical_concurrent_requests_reach_the_backend_once() -> Result<()> {
    // A slow first token, so the followers arrive while the holder waits.
    let stub = Stub::start(StubConfig::default().ttft(Duration::from_millis(800)))?;
    let gw = gateway(stub.addr(), |_| {})?;
    let body = anthropic("stampede", false);
    let replies = zerolayer_e2e::chain::concurrently(20, |_| gw.post("/v1/messages", &body));
    let mut labels = Vec::new();
    let mut bodies = std::collections::BTreeSet::new();
    for reply in replies {
        let reply = reply?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        labels.push(reply.header("x-cache").unwrap_or("-").to_string());
        bodies.insert(reply.body);
    }
    let llm_calls = stub
        .requests()
        .iter()
        .filter(|r| r.path == "/v1/messages")
        .count();
    assert_eq!(llm_calls, 1, "x-cache: {labels:?}");
    assert_eq!(
        labels.iter().filter(|l| *l == "MISS").count(),
        1,
        "{labels:?}"
    );
    assert_eq!(bodies.len(), 1, "followers got different bodies");
    gw.envoy
        .wait_metric(r#"zerolayer_cache_lease_waits{outcome="hit"}"#, 19.0)?;
    Ok(())
}

#[test]
fn interrupted_streams_are_not_cached() -> Result<()> {
    // The stub cuts every stream after 3 events.
    let stub = Stub::start(StubConfig::default().fault(Some("disconnect-after:3".parse()?)))?;
    let gw = gateway(stub.addr(), |_| {})?;
    let body = anthropic("cut short", true);
    for _ in 0..2 {
        let reply = gw.post("/v1/messages", &body);
        // The client sees a truncated stream (or a reset): either way not a HIT.
        if let Ok(reply) = reply {
            assert_ne!(reply.header("x-cache"), Some("HIT"));
        }
    }
    wait::until(
        "the second request at the backend",
        Duration::from_secs(5),
        || Ok((stub.requests().len() >= 2).then_some(())),
    )?;
    gw.envoy
        .wait_metric(r#"zerolayer_cache_bypass{reason="incomplete"}"#, 2.0)?;
    Ok(())
}

#[test]
fn the_real_model_server_is_cached_at_temperature_zero() -> Result<()> {
    let model = ModelServer::start()?;
    let gw = gateway(model.addr(), |_| {})?;
    let body = openai("Name a colour.", false);
    let first = gw.post("/v1/chat/completions", &body)?;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-cache"), Some("MISS"));
    let started = Instant::now();
    let second = gw.post("/v1/chat/completions", &body)?;
    let hit_time = started.elapsed();
    assert_eq!(second.header("x-cache"), Some("HIT"));
    assert_eq!(second.body, first.body);
    eprintln!("model server: hit answered in {hit_time:?}");
    // A sampled request (temperature 0.8) is not cached by default.
    let sampled = json!({"model": "m", "max_tokens": 8, "temperature": 0.8,
                         "messages": [{"role": "user", "content": "Name a colour."}]})
    .to_string();
    let reply = gw.post("/v1/chat/completions", &sampled)?;
    assert_eq!(reply.header("x-cache"), Some("BYPASS"));
    Ok(())
}

#[test]
fn the_shipped_config_embeds_the_documented_example() -> Result<()> {
    let example: Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/post-cache/example.json"),
    )?)?;
    let config = EnvoyConfig::shipped("zerolayer.yaml")?;
    let filter: Value = serde_json::from_str(&config.wasm_filter_config("zerolayer.post_cache")?)?;
    assert_eq!(
        filter, example,
        "envoy/zerolayer.yaml drifted from filters/post-cache/example.json"
    );
    let mut lazy: Value = serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
    let lazy_example: Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/lazy-auth/example.json"),
    )?)?;
    // The whole chain adds one section to lazy-auth's own example: its
    // attribution rows go to the chain's ClickHouse, next to the usage.
    let attribution = lazy
        .as_object_mut()
        .and_then(|l| l.remove("attribution"))
        .expect("the chain ships attribution rows");
    assert_eq!(attribution["cluster"], "clickhouse");
    assert!(
        attribution["path"]
            .as_str()
            .is_some_and(|p| p.contains("zerolayer_attribution")),
        "{attribution}"
    );
    assert_eq!(
        lazy, lazy_example,
        "envoy/zerolayer.yaml's lazy-auth drifted"
    );
    Ok(())
}

#[test]
fn without_its_secret_envoy_refuses_the_filter_naming_the_field() -> Result<()> {
    paths::wasm("post_cache")?;
    let validation = Envoy::validate_file(&paths::envoy_config("zerolayer.yaml"))?;
    assert!(!validation.ok, "accepted without ZEROLAYER_CACHE_SECRET");
    assert!(
        validation.output.contains(
            "post-cache: invalid configuration: secret_env: environment variable \"ZEROLAYER_CACHE_SECRET\" is not set"
        ),
        "{}",
        validation.output
    );
    Ok(())
}

#[test]
fn two_gateways_share_responses_through_redis() -> Result<()> {
    let fleet = zerolayer_e2e::fleet::RedisFleet::start()?;
    let stub = Stub::start(StubConfig::default())?;
    let a = gateway_with(stub.addr(), |_| {}, Some(fleet.webdis()))?;
    let b = gateway_with(stub.addr(), |_| {}, Some(fleet.webdis()))?;
    for (path, body) in [
        ("/v1/messages", anthropic("fleet plain", false)),
        ("/v1/chat/completions", openai("fleet streamed", true)),
    ] {
        let keys_before = fleet.keys()?;
        let first = a.post(path, &body)?;
        assert_eq!(first.header("x-cache"), Some("MISS"), "{path}");
        // The observer writes to Redis after the response, off the path.
        wait::until("a new key in Redis", Duration::from_secs(5), || {
            Ok((fleet.keys()? != keys_before).then_some(()))
        })
        .with_context(|| a.envoy.log())?;
        let served = stub.requests().len();
        let second = b.post(path, &body)?;
        assert_eq!(
            second.header("x-cache"),
            Some("HIT"),
            "{path}: {}",
            b.envoy.log()
        );
        assert_eq!(second.body, first.body, "{path}: the replay differs");
        assert_eq!(
            stub.requests().len(),
            served,
            "{path}: gateway b reached the backend"
        );
    }
    b.envoy
        .wait_metric(r#"zerolayer_cache_fleet_reads{result="hit"}"#, 2.0)?;
    a.envoy
        .wait_metric(r#"zerolayer_cache_fleet_writes{outcome="ok"}"#, 2.0)?;
    Ok(())
}
