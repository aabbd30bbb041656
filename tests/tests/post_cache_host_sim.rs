//! post-cache in host-sim: plain and streamed hits, what is never stored,
//! TTLs on virtual time, tenant isolation through lazy-auth's identity, the
//! stampede lease, bounded memory.

use std::time::Duration;

use anyhow::{Result, bail};
use host_sim::{ChainId, Host, PluginSpec, StreamId};
use serde_json::{Value, json};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{paths, sim};

const VM_ID: &str = "zerolayer.cache";
const SECRET: &str = "zerolayer-test-cache-secret-0123456789abcdef";
/// host-sim's fixed virtual start, seconds.
const NOW: u64 = 1_795_953_600;

fn config(changes: Value) -> Value {
    let mut config = json!({
        "secret_env": "ZEROLAYER_CACHE_SECRET",
        "namespace": "shared",
        "stampede": {"mode": "wait", "lease_ms": 10000, "max_wait_ms": 5000, "poll_ms": 50},
    });
    if let (Some(base), Some(extra)) = (config.as_object_mut(), changes.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    config
}

fn cache_spec(config: &Value) -> Result<PluginSpec> {
    Ok(PluginSpec::new("post-cache", paths::wasm("post_cache")?)
        .vm_id(VM_ID)
        .configuration(config.to_string())
        .env("ZEROLAYER_CACHE_SECRET", SECRET)
        .allow_on_headers_stop_iteration(true))
}

struct Gateway {
    host: Host,
    chain: ChainId,
}

fn gateway(config: Value) -> Result<Gateway> {
    let mut host = sim::host()?;
    let chain = host.add_chain(vec![cache_spec(&config)?])?;
    Ok(Gateway { host, chain })
}

/// An Anthropic request body (temperature 0: cacheable by default).
fn body(prompt: &str, stream: bool) -> String {
    json!({
        "model": "claude-test",
        "max_tokens": 32,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

const JSON_REPLY: &str = r#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"hello"}],"usage":{"input_tokens":5,"output_tokens":1}}"#;

const SSE_REPLY: &[&str] = &[
    "event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hel\"}}\n\nevent: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"lo\"}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// What the client got, and whether the upstream saw the request.
#[derive(Debug)]
struct Seen {
    status: Option<u16>,
    x_cache: Option<String>,
    age: Option<String>,
    content_type: Option<String>,
    body: String,
    upstream: bool,
}

/// How the upstream answers a request that reaches it.
enum Reply<'a> {
    Json(u16, &'a [(&'a str, &'a str)], &'a str),
    Sse(&'a [&'a str]),
    /// Sends the first `n` SSE chunks, then the connection resets.
    SseCut(&'a [&'a str], usize),
    /// 200 with exactly these headers (`:status` added), then the chunks.
    Raw(&'a [(&'a str, &'a str)], &'a [&'a str]),
}

impl Gateway {
    fn send(&mut self, request: &[(&str, &str)], body: &str, reply: Reply<'_>) -> Result<Seen> {
        let path = request
            .iter()
            .find(|(name, _)| *name == ":path")
            .map_or("/v1/messages", |(_, path)| *path);
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", "gw"),
            ("content-type", "application/json"),
        ];
        headers.extend(request.iter().filter(|(name, _)| *name != ":path"));
        let mut s = self.host.stream(self.chain)?;
        s.request_headers(&headers, false);
        s.request_body(body.as_bytes(), true);
        let upstream = s.upstream().complete;
        if upstream {
            match reply {
                Reply::Json(status, extra, text) => {
                    let status = status.to_string();
                    let mut h = vec![
                        (":status", status.as_str()),
                        ("content-type", "application/json"),
                    ];
                    h.extend_from_slice(extra);
                    s.response_headers(&h, false);
                    s.response_body(text.as_bytes(), true);
                }
                Reply::Sse(chunks) => {
                    s.response_headers(
                        &[(":status", "200"), ("content-type", "text/event-stream")],
                        false,
                    );
                    for (i, chunk) in chunks.iter().enumerate() {
                        s.response_body(chunk.as_bytes(), i + 1 == chunks.len());
                    }
                }
                Reply::Raw(extra, chunks) => {
                    let mut h = vec![(":status", "200")];
                    h.extend_from_slice(extra);
                    s.response_headers(&h, false);
                    for (i, chunk) in chunks.iter().enumerate() {
                        s.response_body(chunk.as_bytes(), i + 1 == chunks.len());
                    }
                }
                Reply::SseCut(chunks, n) => {
                    s.response_headers(
                        &[(":status", "200"), ("content-type", "text/event-stream")],
                        false,
                    );
                    for chunk in chunks.iter().take(n) {
                        s.response_body(chunk.as_bytes(), false);
                    }
                    s.reset();
                }
            }
        }
        let client = s.client();
        Ok(Seen {
            status: client.status(),
            x_cache: client.header("x-cache").map(str::to_string),
            age: client.header("age").map(str::to_string),
            content_type: client.header("content-type").map(str::to_string),
            body: client.text(),
            upstream,
        })
    }

    fn json(&mut self, body: &str) -> Result<Seen> {
        self.send(&[], body, Reply::Json(200, &[], JSON_REPLY))
    }

    fn counter(&self, name: &str) -> u64 {
        self.host.metric(name).unwrap_or(0)
    }
}

#[test]
fn a_plain_response_is_a_hit_for_the_same_request_in_any_key_order() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let first = gw.json(&body("hi", false))?;
    assert!(first.upstream);
    assert_eq!(first.x_cache.as_deref(), Some("MISS"));
    gw.host.advance(Duration::from_secs(3));
    // Same request: other key order, other whitespace, content as a block
    // (`0.0` would be another key: a float never equals an integer).
    let reordered = r#"{ "messages": [{"content": [{"type":"text","text":"hi"}], "role":"user"}],
        "stream": false, "temperature": 0, "max_tokens": 32, "model": "claude-test" }"#;
    let hit = gw.json(reordered)?;
    assert!(!hit.upstream, "a hit must not reach the upstream");
    assert_eq!(hit.status, Some(200));
    assert_eq!(hit.x_cache.as_deref(), Some("HIT"));
    assert_eq!(hit.age.as_deref(), Some("3"));
    assert_eq!(hit.content_type.as_deref(), Some("application/json"));
    assert_eq!(hit.body, sim::local_body(JSON_REPLY));
    // Any keyed change is a miss.
    let other = gw.json(&body("hi!", false))?;
    assert!(other.upstream);
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_lookups_result=hit"), 1);
    assert_eq!(gw.counter("zerolayer_cache_lookups_result=miss"), 2);
    assert_eq!(gw.counter("zerolayer_cache_stored"), 2);
    Ok(())
}

#[test]
fn a_completed_stream_is_replayed_with_its_framing() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let first = gw.send(&[], &body("stream me", true), Reply::Sse(SSE_REPLY))?;
    assert!(first.upstream);
    let hit = gw.send(&[], &body("stream me", true), Reply::Sse(SSE_REPLY))?;
    assert!(!hit.upstream);
    assert_eq!(hit.x_cache.as_deref(), Some("HIT"));
    assert_eq!(hit.content_type.as_deref(), Some("text/event-stream"));
    assert_eq!(hit.body, SSE_REPLY.concat());
    let mut names = Vec::new();
    zerolayer_core::sse::SseParser::new().push(hit.body.as_bytes(), |e| {
        names.push(String::from_utf8_lossy(e.event).into_owned())
    });
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_delta",
            "content_block_delta",
            "message_stop"
        ]
    );
    // A plain request for the same prompt is another key (another shape).
    let plain = gw.json(&body("stream me", false))?;
    assert!(plain.upstream);
    Ok(())
}

#[test]
fn interrupted_and_unterminated_streams_are_never_cached() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let cut = gw.send(&[], &body("cut", true), Reply::SseCut(SSE_REPLY, 3))?;
    assert!(cut.upstream);
    let again = gw.send(&[], &body("cut", true), Reply::Sse(&SSE_REPLY[..3]))?;
    assert!(
        again.upstream,
        "an interrupted stream was served from cache"
    );
    // Ended cleanly but without message_stop: still incomplete.
    let third = gw.send(&[], &body("cut", true), Reply::Sse(SSE_REPLY))?;
    assert!(
        third.upstream,
        "an unterminated stream was served from cache"
    );
    let hit = gw.send(&[], &body("cut", true), Reply::Sse(SSE_REPLY))?;
    assert!(!hit.upstream);
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_bypass_reason=incomplete"), 2);
    Ok(())
}

#[test]
fn no_store_errors_and_sampled_requests_are_not_stored() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let b = body("policy", false);
    let bypass = gw.send(
        &[("cache-control", "no-store")],
        &b,
        Reply::Json(200, &[], JSON_REPLY),
    )?;
    assert_eq!(bypass.x_cache.as_deref(), Some("BYPASS"));
    assert!(gw.json(&b)?.upstream, "request no-store was stored");
    // That one was stored: a client no-cache refreshes instead of hitting.
    let refreshed = gw.send(
        &[("cache-control", "no-cache")],
        &b,
        Reply::Json(200, &[], JSON_REPLY),
    )?;
    assert!(refreshed.upstream);
    assert_eq!(refreshed.x_cache.as_deref(), Some("MISS"));
    // Upstream no-store and non-200 are never stored.
    let c = body("upstream says no", false);
    gw.send(
        &[],
        &c,
        Reply::Json(200, &[("cache-control", "no-store")], JSON_REPLY),
    )?;
    assert!(
        gw.send(&[], &c, Reply::Json(500, &[], r#"{"error":{}}"#))?
            .upstream
    );
    assert!(gw.json(&c)?.upstream, "a 500 was stored");
    // Temperature above the policy's bound: bypassed.
    let hot = json!({"model": "m", "max_tokens": 5, "temperature": 0.7,
                     "messages": [{"role": "user", "content": "x"}]})
    .to_string();
    assert_eq!(gw.json(&hot)?.x_cache.as_deref(), Some("BYPASS"));
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(
        gw.counter("zerolayer_cache_bypass_reason=request_no_store"),
        1
    );
    assert_eq!(
        gw.counter("zerolayer_cache_bypass_reason=response_no_store"),
        1
    );
    assert_eq!(gw.counter("zerolayer_cache_bypass_reason=status"), 1);
    assert_eq!(gw.counter("zerolayer_cache_bypass_reason=temperature"), 1);
    Ok(())
}

#[test]
fn entries_expire_with_their_ttl_on_virtual_time() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let b = body("ttl", false);
    gw.send(
        &[],
        &b,
        Reply::Json(200, &[("cache-control", "public, max-age=30")], JSON_REPLY),
    )?;
    gw.host.advance(Duration::from_secs(29));
    let hit = gw.json(&b)?;
    assert_eq!(hit.x_cache.as_deref(), Some("HIT"));
    assert_eq!(hit.age.as_deref(), Some("29"));
    // A client's max-age shorter than the entry's age: not served.
    let strict = gw.send(
        &[("cache-control", "max-age=10")],
        &b,
        Reply::Json(200, &[], JSON_REPLY),
    )?;
    assert!(strict.upstream);
    gw.host.advance(Duration::from_secs(31));
    // The strict request stored a fresh copy at +29 s with the default 60 s TTL.
    assert_eq!(gw.json(&b)?.x_cache.as_deref(), Some("HIT"));
    gw.host.advance(Duration::from_secs(30));
    assert!(gw.json(&b)?.upstream, "served after its TTL");
    Ok(())
}

#[test]
fn tenants_never_see_each_others_entries_and_unverified_requests_bypass() -> Result<()> {
    let mut lazy = json!({
        "credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}],
        "jwt": {"keys": issuer().jwks()["keys"], "issuers": ["https://idp.test"], "audiences": ["zerolayer"]},
        "unknown": "sync",
    });
    sim::observer_mode(&mut lazy);
    let mut host = sim::host()?;
    let chain = host.add_chain(vec![
        PluginSpec::new("lazy-auth", paths::wasm("lazy_auth")?)
            .vm_id("zerolayer")
            .configuration(lazy.to_string()),
        cache_spec(&config(json!({"namespace": "tenant"})))?,
    ])?;
    let mut gw = Gateway { host, chain };
    let acme = format!(
        "Bearer {}",
        issuer().es256(&tokens::claims("u1", "acme", NOW, 3600))
    );
    let acme2 = format!(
        "Bearer {}",
        issuer().es256(&tokens::claims("u2", "acme", NOW, 3600))
    );
    let globex = format!(
        "Bearer {}",
        issuer().es256(&tokens::claims("u3", "globex", NOW, 3600))
    );
    let b = body("tenant", false);
    let as_ = |who: &str| vec![("authorization", who.to_string())];
    let send = |gw: &mut Gateway, who: &str| -> Result<Seen> {
        let h = as_(who);
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        gw.send(&h, &b, Reply::Json(200, &[], JSON_REPLY))
    };
    assert_eq!(send(&mut gw, &acme)?.x_cache.as_deref(), Some("MISS"));
    assert_eq!(send(&mut gw, &globex)?.x_cache.as_deref(), Some("MISS"));
    // Another user of the same tenant shares the tenant's cache.
    assert_eq!(send(&mut gw, &acme2)?.x_cache.as_deref(), Some("HIT"));
    assert_eq!(send(&mut gw, &globex)?.x_cache.as_deref(), Some("HIT"));

    // Without lazy-auth's verified identity, a per-tenant cache stays out.
    let mut alone = gateway(config(json!({"namespace": "tenant"})))?;
    assert_eq!(alone.json(&b)?.x_cache.as_deref(), Some("BYPASS"));
    assert_eq!(alone.json(&b)?.x_cache.as_deref(), Some("BYPASS"));
    alone.host.advance(Duration::from_secs(1));
    assert_eq!(
        alone.counter("zerolayer_cache_bypass_reason=no_verified_tenant"),
        2
    );
    Ok(())
}

/// Opens a stream and sends one request (headers and body), returning its id.
fn open(host: &mut Host, chain: ChainId, body: &str) -> Result<StreamId> {
    let mut s = host.stream(chain)?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("content-type", "application/json"),
        ],
        false,
    );
    s.request_body(body.as_bytes(), true);
    Ok(s.id())
}

#[test]
fn fifty_identical_concurrent_requests_reach_the_upstream_once() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let b = body("stampede", false);
    let ids: Vec<StreamId> = (0..50)
        .map(|_| open(&mut gw.host, gw.chain, &b))
        .collect::<Result<_>>()?;
    let upstream: Vec<StreamId> = ids
        .iter()
        .copied()
        .filter(|id| {
            gw.host
                .stream_by_id(*id)
                .map(|s| s.upstream().complete)
                .unwrap_or(false)
        })
        .collect();
    if sim::kong() {
        // ngx_wasm_module cannot wake a waiting follower (kong/README.md,
        // "stampede"): every one goes upstream, and the filter says why.
        assert_eq!(upstream.len(), 50, "in Kong no follower may wait");
        assert!(
            !gw.host
                .logs_containing("stampede.mode wait needs a host")
                .is_empty()
        );
        return Ok(());
    }
    assert_eq!(upstream.len(), 1, "lease holders: {upstream:?}");
    let holder = upstream[0];
    // The holder's response completes; followers find it on their next poll.
    {
        let mut s = gw.host.stream_by_id(holder)?;
        s.response_headers(
            &[(":status", "200"), ("content-type", "application/json")],
            false,
        );
        s.response_body(JSON_REPLY.as_bytes(), true);
    }
    gw.host.advance(Duration::from_millis(60));
    let mut hits = 0;
    for id in ids.iter().filter(|id| **id != holder) {
        let s = gw.host.stream_by_id(*id)?;
        let client = s.client();
        if client.header("x-cache") == Some("HIT") && client.text() == JSON_REPLY {
            hits += 1;
        }
        if s.upstream().headers.is_some() {
            bail!("follower {id} reached the upstream");
        }
    }
    assert_eq!(hits, 49);
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_lease_waits_outcome=hit"), 49);
    Ok(())
}

#[test]
fn followers_go_upstream_when_the_holder_fails_or_the_wait_runs_out() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    // Holder dies (connection reset): its lease is released at once.
    let b = body("holder dies", false);
    let holder = open(&mut gw.host, gw.chain, &b)?;
    let follower = open(&mut gw.host, gw.chain, &b)?;
    if sim::kong() {
        // No waiting in ngx_wasm_module (see above): straight upstream.
        assert!(gw.host.stream_by_id(follower)?.upstream().complete);
        return Ok(());
    }
    assert!(!gw.host.stream_by_id(follower)?.upstream().complete);
    gw.host.stream_by_id(holder)?.reset();
    gw.host.advance(Duration::from_millis(60));
    assert!(
        gw.host.stream_by_id(follower)?.upstream().complete,
        "the follower still waits for a dead holder"
    );
    // Holder alive but slow: the follower stops waiting after max_wait_ms.
    let c = body("slow holder", false);
    let _slow = open(&mut gw.host, gw.chain, &c)?;
    let patient = open(&mut gw.host, gw.chain, &c)?;
    gw.host.advance(Duration::from_millis(4900));
    assert!(!gw.host.stream_by_id(patient)?.upstream().complete);
    gw.host.advance(Duration::from_millis(200));
    assert!(gw.host.stream_by_id(patient)?.upstream().complete);
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(
        gw.counter("zerolayer_cache_lease_waits_outcome=upstream"),
        1
    );
    assert_eq!(gw.counter("zerolayer_cache_lease_waits_outcome=timeout"), 1);
    Ok(())
}

#[test]
fn memory_stays_bounded_under_a_soak_of_distinct_requests() -> Result<()> {
    let mut gw = gateway(config(json!({"max_entries": 16, "max_entry_bytes": 4096})))?;
    let mut high_water = 0;
    for i in 0..2000 {
        let seen = gw.json(&body(&format!("request {i}"), false))?;
        assert!(seen.upstream);
        if i % 100 == 99 {
            high_water = high_water.max(gw.host.shared_data_bytes(VM_ID));
        }
    }
    // 8 sets × (index + 2 bodies + leases) keys, each bounded in size.
    let keys = gw.host.shared_data_len(VM_ID);
    assert!(keys <= 8 * 4, "{keys} shared-data keys");
    assert!(high_water <= 16 * 4096 + 8 * 512, "{high_water} bytes");
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_stored"), 2000);
    assert!(gw.counter("zerolayer_cache_evicted") > 1900);
    // Recent entries are still served.
    assert_eq!(
        gw.json(&body("request 1999", false))?.x_cache.as_deref(),
        Some("HIT")
    );
    Ok(())
}

#[test]
fn a_missing_or_short_secret_refuses_the_configuration() -> Result<()> {
    for (env, want) in [
        (
            None,
            "environment variable \"ZEROLAYER_CACHE_SECRET\" is not set",
        ),
        (Some("too-short"), "at least 32 are required"),
    ] {
        let mut host = sim::host()?;
        let mut spec = PluginSpec::new("post-cache", paths::wasm("post_cache")?)
            .vm_id(VM_ID)
            .configuration(config(json!({})).to_string());
        if let Some(value) = env {
            spec = spec.env("ZEROLAYER_CACHE_SECRET", value);
        }
        let refused = host.add_chain(vec![spec]).is_err();
        let logs = host.logs_containing("post-cache: invalid configuration: secret_env");
        assert!(refused, "configuration accepted with secret {env:?}");
        assert!(
            logs.iter().any(|l| l.contains(want)),
            "{want:?} not in {logs:?}"
        );
        if let Some(value) = env {
            assert!(
                logs.iter().all(|l| !l.contains(value)),
                "the secret was logged"
            );
        }
    }
    Ok(())
}

#[test]
fn bodies_that_are_not_llm_requests_pass_through_untouched() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let seen = gw.json("not json")?;
    assert!(seen.upstream);
    assert_eq!(seen.x_cache.as_deref(), Some("BYPASS"));
    // Other paths are not the cache's business: no header at all.
    let mut s = gw.host.stream(gw.chain)?;
    s.request_headers(
        &[
            (":method", "GET"),
            (":path", "/v1/models"),
            (":authority", "gw"),
        ],
        true,
    );
    assert!(s.upstream().complete);
    s.response_headers(&[(":status", "200")], true);
    assert_eq!(s.client().header("x-cache"), None);

    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_bypass_reason=unkeyable"), 1);
    Ok(())
}

#[test]
fn only_if_cached_answers_504_on_a_miss_and_the_entry_on_a_hit() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let b = body("only if cached", false);
    let only = [("cache-control", "only-if-cached")];
    let miss = gw.send(&only, &b, Reply::Json(200, &[], JSON_REPLY))?;
    assert!(!miss.upstream, "only-if-cached went upstream");
    assert_eq!(miss.status, Some(504));
    assert!(miss.body.contains("only-if-cached"), "{}", miss.body);
    gw.json(&b)?;
    let hit = gw.send(&only, &b, Reply::Json(200, &[], JSON_REPLY))?;
    assert_eq!(hit.x_cache.as_deref(), Some("HIT"));
    assert_eq!(hit.body, sim::local_body(JSON_REPLY));
    Ok(())
}

/// A gateway with the fleet tier: post-cache plus the observer singleton
/// writing to a real Redis through webdis.
fn fleet_gateway(webdis: std::net::SocketAddr) -> Result<Gateway> {
    let mut cache = config(json!({
        "fleet": {"cluster": "webdis", "path": "/", "timeout_ms": 500},
    }));
    let mut host = sim::host()?;
    host.set_cluster("webdis", host_sim::ClusterTarget::Http(webdis));
    sim::observer(
        &mut host,
        "post_cache",
        &mut cache,
        &[("ZEROLAYER_CACHE_SECRET", SECRET)],
    )?;
    let chain = host.add_chain(vec![cache_spec(&cache)?])?;
    Ok(Gateway { host, chain })
}

#[test]
fn a_response_cached_by_one_gateway_is_a_hit_on_another_through_redis() -> Result<()> {
    let fleet = zerolayer_e2e::fleet::RedisFleet::start()?;
    let mut a = fleet_gateway(fleet.webdis())?;
    let mut b = fleet_gateway(fleet.webdis())?;
    let plain = body("shared across the fleet", false);
    let streamed = body("streamed across the fleet", true);
    assert_eq!(a.json(&plain)?.x_cache.as_deref(), Some("MISS"));
    assert!(a.send(&[], &streamed, Reply::Sse(SSE_REPLY))?.upstream);
    // The observer writes off the request path.
    a.host.advance(Duration::from_millis(200));
    assert_eq!(fleet.keys()?, 2, "{}", a.host.prometheus());
    let hit = b.json(&plain)?;
    assert!(!hit.upstream, "gateway b went upstream");
    assert_eq!(hit.x_cache.as_deref(), Some("HIT"));
    assert_eq!(hit.body, sim::local_body(JSON_REPLY));
    let replay = b.send(&[], &streamed, Reply::Sse(SSE_REPLY))?;
    assert_eq!(replay.x_cache.as_deref(), Some("HIT"));
    assert_eq!(replay.body, SSE_REPLY.concat());
    assert_eq!(replay.content_type.as_deref(), Some("text/event-stream"));
    // b keeps a local copy: no fleet read the second time.
    assert_eq!(b.json(&plain)?.x_cache.as_deref(), Some("HIT"));
    b.host.advance(Duration::from_secs(1));
    a.host.advance(Duration::from_secs(1));
    assert_eq!(b.counter("zerolayer_cache_fleet_reads_result=hit"), 2);
    assert_eq!(a.counter("zerolayer_cache_fleet_reads_result=miss"), 2);
    assert_eq!(a.counter("zerolayer_cache_fleet_writes_outcome=ok"), 2);
    // Another tenant's namespace or another secret never reads these
    // entries: the Redis key is the keyed digest.
    let other = b.json(&body("not cached anywhere", false))?;
    assert_eq!(other.x_cache.as_deref(), Some("MISS"));
    Ok(())
}

#[test]
fn a_dead_fleet_tier_costs_a_miss_never_an_error() -> Result<()> {
    // Nothing listens there: reads fail fast, the request goes upstream.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut gw = fleet_gateway(nowhere)?;
    let seen = gw.json(&body("fleet down", false))?;
    assert!(seen.upstream);
    assert_eq!(seen.status, Some(200));
    assert_eq!(seen.x_cache.as_deref(), Some("MISS"));
    // The local tier still works.
    assert_eq!(
        gw.json(&body("fleet down", false))?.x_cache.as_deref(),
        Some("HIT")
    );
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_fleet_reads_result=error"), 1);
    assert_eq!(gw.counter("zerolayer_cache_fleet_writes_outcome=failed"), 1);
    Ok(())
}

/// Issue 21 item 7: a stream typed `Text/Event-Stream` (media types are
/// case-insensitive) without its terminal event, and an OpenAI stream with
/// an error chunk written `data: { "error": …}` then `[DONE]`, were stored
/// and served as hits.
#[test]
fn streams_are_recognised_in_any_case_and_error_chunks_are_never_cached() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let typed = &[("content-type", "Text/Event-Stream; charset=utf-8")][..];
    let unterminated = &SSE_REPLY[..3];
    for _ in 0..2 {
        let seen = gw.send(&[], &body("case", true), Reply::Raw(typed, unterminated))?;
        assert!(
            seen.upstream,
            "an unterminated Text/Event-Stream was served from cache"
        );
    }
    let openai = json!({"model": "gpt-test", "temperature": 0, "stream": true,
                        "messages": [{"role": "user", "content": "fail"}]})
    .to_string();
    let failed = &[
        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: { \"error\": {\"message\": \"overloaded\"}}\n\n",
        "data: [DONE]\n\n",
    ][..];
    let sse = &[("content-type", "text/event-stream")][..];
    let path = &[(":path", "/v1/chat/completions")][..];
    for _ in 0..2 {
        let seen = gw.send(path, &openai, Reply::Raw(sse, failed))?;
        assert!(
            seen.upstream,
            "a stream with an error chunk was served from cache"
        );
    }
    // A 200 JSON body that is an error is not an answer to cache either.
    let json = &[("content-type", "application/json")][..];
    let error = r#"{"type": "error", "error": {"type": "overloaded_error"}}"#;
    for _ in 0..2 {
        let seen = gw.send(&[], &body("json error", false), Reply::Raw(json, &[error]))?;
        assert!(seen.upstream, "a 200 error body was served from cache");
    }
    // The same stream without the error is cached: the test can tell.
    let clean = [failed[0], failed[2]];
    assert!(gw.send(path, &openai, Reply::Raw(sse, &clean))?.upstream);
    assert!(!gw.send(path, &openai, Reply::Raw(sse, &clean))?.upstream);
    gw.host.advance(Duration::from_secs(1));
    assert_eq!(gw.counter("zerolayer_cache_bypass_reason=incomplete"), 6);
    Ok(())
}

/// Issue 21 item 9: the backend's `x-cache` reached the client (a backend
/// could forge the gateway's verdict), and `max_tokens: 16.0` hit the entry
/// for `16` although a backend may refuse `16.0`; integers beyond 2^53 are
/// keyed exactly.
#[test]
fn the_backends_x_cache_never_reaches_the_client_and_keys_keep_numbers_apart() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let forged = &[("content-type", "application/json"), ("x-cache", "HIT")][..];
    let seen = gw.send(
        &[],
        &body("forged", false),
        Reply::Raw(forged, &[JSON_REPLY]),
    )?;
    assert_eq!(seen.x_cache.as_deref(), Some("MISS"));
    let other_path = &[(":path", "/v1/models")][..];
    let seen = gw.send(other_path, "{}", Reply::Raw(forged, &[JSON_REPLY]))?;
    assert!(seen.upstream);
    assert_eq!(
        seen.x_cache, None,
        "the backend's x-cache reached the client"
    );

    let with = |fields: &str| {
        format!(
            r#"{{"model":"claude-test","temperature":0,"messages":[{{"role":"user","content":"n"}}]{fields}}}"#
        )
    };
    assert!(gw.json(&with(r#","max_tokens":16"#))?.upstream);
    assert!(!gw.json(&with(r#","max_tokens":16"#))?.upstream);
    assert!(
        gw.json(&with(r#","max_tokens":16.0"#))?.upstream,
        "16.0 hit the entry for 16"
    );
    assert!(gw.json(&with(r#","seed":9007199254740993"#))?.upstream);
    assert!(
        gw.json(&with(r#","seed":9007199254740992"#))?.upstream,
        "2^53 hit the entry for 2^53 + 1"
    );
    // Beyond 64 bits no exact key exists: bypassed, never a shared entry.
    let huge = gw.json(&with(r#","seed":18446744073709551616"#))?;
    assert_eq!(huge.x_cache.as_deref(), Some("BYPASS"));
    Ok(())
}

/// Issue 21 items 5 and 8: a body naming a member twice is refused with a
/// clear 400 (which member the backend reads is not known), and
/// `//v1/messages` is the API, cached like `/v1/messages`.
#[test]
fn duplicate_members_are_refused_and_merged_slashes_are_the_api() -> Result<()> {
    let mut gw = gateway(config(json!({})))?;
    let dup =
        r#"{"model":"claude-test","temperature":0,"stream":false,"stream":true,"messages":[]}"#;
    let seen = gw.json(dup)?;
    assert!(!seen.upstream, "a duplicated `stream` reached the backend");
    assert_eq!(seen.status, Some(400));
    let error: Value = serde_json::from_str(&seen.body)?;
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert_eq!(
        error["error"]["message"],
        "request body names the member `stream` twice in one object"
    );
    let slashes = &[(":path", "//v1//messages")][..];
    let first = gw.send(
        slashes,
        &body("slashes", false),
        Reply::Json(200, &[], JSON_REPLY),
    )?;
    assert_eq!(first.x_cache.as_deref(), Some("MISS"));
    let hit = gw.json(&body("slashes", false))?;
    assert!(!hit.upstream, "//v1//messages and /v1/messages are one API");
    Ok(())
}
