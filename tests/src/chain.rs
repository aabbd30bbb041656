//! The whole zerolayer chain in real Envoy, as shipped in
//! `envoy/zerolayer.yaml` (lazy-auth → activation → post-cache → metering,
//! the observer singleton), with every service it calls on loopback: the GPU
//! backend stub, the identity provider, the API key introspection endpoint,
//! the audit sink, a usage sink (ClickHouse when the test reads the usage
//! records) and, optionally, Redis + webdis for the fleet cache tier. Reliability tests and the soak start it;
//! each service can be broken and mended while Envoy runs.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_stub::{Stub, StubConfig};

use crate::clickhouse::ClickHouse;
use crate::fleet::RedisFleet;
use crate::tokens::{self, issuer};
use crate::{Client, Envoy, EnvoyConfig, MockServer, Reply};

/// The post-cache secret the chain runs with.
pub const CACHE_SECRET: &str = "zerolayer-e2e-cache-secret-0123456789abcdef";

/// The API key the introspection endpoint knows (tenant `globex`).
pub const GOOD_API_KEY: &str = "sk-chain-globex";

/// The form of zerolayer that runs the chain in Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Four Wasm filters and the observer singleton (`envoy/zerolayer.yaml`).
    Separate,
    /// One fused Wasm filter and the observer singleton
    /// (`envoy/zerolayer-fused.yaml`).
    Fused,
    /// The Envoy dynamic module, its observer on its own thread
    /// (`envoy/zerolayer-native.yaml`).
    Native,
}

impl Form {
    /// Every form, the reference (separate) first.
    pub const ALL: [Form; 3] = [Form::Separate, Form::Fused, Form::Native];

    /// Its shipped Envoy configuration.
    pub fn file(self) -> &'static str {
        match self {
            Form::Separate => "zerolayer.yaml",
            Form::Fused => "zerolayer-fused.yaml",
            Form::Native => "zerolayer-native.yaml",
        }
    }
}

/// How to start the chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// The backend stub's defaults (faults per request via `x-stub-*`).
    pub stub: StubConfig,
    /// Whether the fleet tier (Redis + webdis) is on.
    pub fleet: bool,
    /// Whether metering's records go to a real ClickHouse, for the tests
    /// that read them ([`Chain::clickhouse`]). Off, the `clickhouse` cluster
    /// is a loopback sink answering every insert 200: nothing to retry and
    /// no backoff, without a server's start-up per chain.
    pub clickhouse: bool,
    /// Metering's sample rate, percent.
    pub sample_percent: f64,
    /// The route's upstream timeout (the shipped 300 s when `None`).
    pub route_timeout: Option<Duration>,
    /// Whether the observer singleton runs (off: "the observer is gone").
    pub observer: bool,
    /// Which form runs it; the stage configurations are the same in all.
    pub form: Form,
    /// Envoy's worker threads.
    pub workers: usize,
    /// Members replacing the shipped lazy-auth configuration's (a JSON
    /// object merged one level deep; `Null`: as shipped).
    pub lazy_auth: serde_json::Value,
    /// Members set on every HTTP connection manager (a JSON object, e.g.
    /// `{"use_remote_address": true, "xff_num_trusted_hops": 1}` for a
    /// gateway behind one load balancer; `Null`: as shipped).
    pub connection_manager: serde_json::Value,
}

impl Default for ChainOptions {
    fn default() -> Self {
        ChainOptions {
            stub: StubConfig::default(),
            fleet: false,
            clickhouse: false,
            sample_percent: 100.0,
            route_timeout: None,
            observer: true,
            form: Form::Separate,
            workers: 1,
            lazy_auth: serde_json::Value::Null,
            connection_manager: serde_json::Value::Null,
        }
    }
}

/// The running chain and everything it talks to.
pub struct Chain {
    /// Envoy running `envoy/zerolayer.yaml`.
    pub envoy: Envoy,
    /// The GPU backend stub.
    pub stub: Stub,
    /// The JWKS endpoint, the introspection endpoint, the audit sink.
    pub services: AuthServices,
    /// The usage sink (see [`ChainOptions::clickhouse`]).
    usage: UsageSink,
    /// The fleet cache tier, when on.
    pub fleet: Option<RedisFleet>,
    /// A client for the listener.
    pub client: Client,
    /// The configuration Envoy runs, to start it again.
    config: EnvoyConfig,
}

/// Where metering's records go.
enum UsageSink {
    /// A real server, for the tests that read the records.
    ClickHouse(ClickHouse),
    /// Takes every insert (200) and is never read.
    Accepting(MockServer),
}

impl UsageSink {
    fn start(clickhouse: bool) -> Result<UsageSink> {
        if !clickhouse {
            return Ok(UsageSink::Accepting(MockServer::start(|_| {
                (200, String::new())
            })?));
        }
        let server = ClickHouse::start()?;
        server.create_tables()?;
        Ok(UsageSink::ClickHouse(server))
    }

    fn addr(&self) -> std::net::SocketAddr {
        match self {
            UsageSink::ClickHouse(server) => server.addr(),
            UsageSink::Accepting(mock) => mock.addr(),
        }
    }
}

/// The services lazy-auth and its observer call, as loopback stand-ins: the
/// test issuer's JWKS, an API key introspection endpoint, an audit sink.
pub struct AuthServices {
    /// The JWKS endpoint (cluster `idp`).
    pub idp: MockServer,
    /// The introspection endpoint (cluster `api_keys`).
    pub api_keys: MockServer,
    /// The audit sink (cluster `audit`, answers 204).
    pub audit: MockServer,
}

impl AuthServices {
    /// Starts all three; `introspect` answers the introspection calls.
    pub fn start(
        introspect: impl Fn(&crate::SeenRequest) -> (u16, String) + Send + Sync + 'static,
    ) -> Result<AuthServices> {
        let jwks = issuer().jwks().to_string();
        Ok(AuthServices {
            idp: MockServer::start(move |_| (200, jwks.clone()))?,
            api_keys: MockServer::start(introspect)?,
            audit: MockServer::start(|_| (204, String::new()))?,
        })
    }

    /// Points `config`'s `idp`, `api_keys` and `audit` clusters at them.
    pub fn point(&self, config: EnvoyConfig) -> Result<EnvoyConfig> {
        config
            .point_cluster("idp", self.idp.addr())?
            .point_cluster("api_keys", self.api_keys.addr())?
            .point_cluster("audit", self.audit.addr())
    }
}

/// The prefix of the API keys a tenant that rotates its keys mints: every
/// key with it is active (tenant `globex`, subject `rotating`).
pub const ROTATING_KEY_PREFIX: &str = "sk-rotating-";

/// The introspection endpoint's normal answers: [`GOOD_API_KEY`] and every
/// [`ROTATING_KEY_PREFIX`] key are active.
pub fn introspect(request: &crate::SeenRequest) -> (u16, String) {
    match request.header("x-api-key") {
        Some(GOOD_API_KEY) => (
            200,
            r#"{"active":true,"tenant":"globex","sub":"batch"}"#.into(),
        ),
        Some(key) if key.starts_with(ROTATING_KEY_PREFIX) => (
            200,
            r#"{"active":true,"tenant":"globex","sub":"rotating"}"#.into(),
        ),
        _ => (200, r#"{"active":false}"#.into()),
    }
}

impl Chain {
    /// Starts every service, then Envoy; returns once the observer holds the
    /// issuer's keys (when it runs), so JWTs verify from the first request.
    pub fn start(options: ChainOptions) -> Result<Chain> {
        crate::paths::wasm("post_cache")?;
        let stub = Stub::start(options.stub.clone()).context("starting the backend stub")?;
        let services = AuthServices::start(introspect)?;
        let usage = UsageSink::start(options.clickhouse)?;
        let fleet = options.fleet.then(RedisFleet::start).transpose()?;

        // The stages' configurations come from the separate filters' file;
        // the fused file embeds the same (tests/tests/fused_envoy.rs).
        let separate = EnvoyConfig::shipped("zerolayer.yaml")?;
        match options.form {
            Form::Native => {
                crate::paths::native_module()?;
            }
            Form::Fused => {
                crate::paths::wasm("fused")?;
            }
            Form::Separate => {}
        }
        let file = options.form.file();
        let mut config = services
            .point(EnvoyConfig::shipped(file)?.for_run(stub.addr())?)?
            .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET)
            .workers(options.workers)
            .point_cluster("clickhouse", usage.addr())?;
        if let Some(fleet) = &fleet {
            config = config.add_cluster("webdis", fleet.webdis())?;
        }
        if let Some(timeout) = options.route_timeout {
            config.set_route_timeout(timeout)?;
        }
        if let Some(members) = options.connection_manager.as_object() {
            for (key, value) in members {
                config.set_connection_manager_option(key, serde_yaml::to_value(value)?)?;
            }
        }
        let activation = separate.wasm_filter_json("zerolayer.activation")?;
        let mut lazy = separate.wasm_filter_json("zerolayer.lazy_auth")?;
        lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
        lazy["audit"]["flush_ms"] = json!(200);
        lazy["attribution"]["flush_ms"] = json!(200);
        if let Some(members) = options.lazy_auth.as_object() {
            for (name, value) in members {
                lazy[name] = value.clone();
            }
        }
        let mut post = separate.wasm_filter_json("zerolayer.post_cache")?;
        if fleet.is_some() {
            post["fleet"] = json!({"cluster": "webdis", "path": "/", "timeout_ms": 500});
        }
        let mut metering = separate.wasm_filter_json("zerolayer.metering")?;
        metering["sampling"] = json!({"percent": options.sample_percent});
        metering["sink"]["flush_ms"] = json!(200);
        metering["sink"]["backoff_ms"] = json!(100);
        metering["sink"]["max_backoff_ms"] = json!(1000);
        metering["sink"]["breaker"] = json!({"failures": 5, "open_secs": 1});
        if options.form == Form::Native {
            // The observer's thread calls the services directly.
            let mut upstreams = json!({
                "idp": services.idp.addr().to_string(),
                "api_keys": services.api_keys.addr().to_string(),
                "audit": services.audit.addr().to_string(),
                "clickhouse": usage.addr().to_string(),
            });
            if let Some(fleet) = &fleet {
                upstreams["webdis"] = json!(fleet.webdis().to_string());
            }
            let sections = json!({
                "activation": activation,
                "lazy_auth": lazy,
                "post_cache": post,
                "metering": metering,
                "native": {"upstreams": upstreams},
            });
            config.set_native_filter_config("zerolayer", &sections.to_string())?;
        } else if options.form == Form::Fused {
            let sections = json!({
                "activation": activation,
                "lazy_auth": lazy,
                "post_cache": post,
                "metering": metering,
            });
            config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
        } else {
            config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
            config.set_wasm_filter_config("zerolayer.post_cache", &post.to_string())?;
            config.set_wasm_filter_config("zerolayer.metering", &metering.to_string())?;
        }
        let mut service = json!({"lazy_auth": lazy, "metering": metering, "tick_ms": 100});
        if fleet.is_some() {
            service["post_cache"] = post;
        }
        if options.form != Form::Native {
            config.set_service_config("zerolayer.observer", &service.to_string())?;
        }
        if !options.observer {
            config.remove_services()?;
        }
        let envoy = Envoy::start(&config)?;
        if options.observer {
            envoy.wait_metric(r#"zerolayer_auth_jwks_fetches{outcome="ok"}"#, 1.0)?;
        }
        Ok(Chain {
            envoy,
            stub,
            services,
            usage,
            fleet,
            client: Client::new(),
            config,
        })
    }

    /// Stops Envoy (SIGKILL: what a crash or a plain restart loses, the
    /// process's memory) and starts it again on the same configuration and
    /// ports; returns once its admin answers ready, without waiting for the
    /// observer's first JWKS fetch. Returns how long the start took.
    pub fn restart(&mut self) -> Result<std::time::Duration> {
        let started = std::time::Instant::now();
        // The old process goes first: its listener's port may be the new one's.
        self.envoy.stop();
        self.envoy = Envoy::start(&self.config)?;
        Ok(started.elapsed())
    }

    /// The ClickHouse metering ships to; an error unless the chain was
    /// started with [`ChainOptions::clickhouse`].
    pub fn clickhouse(&self) -> Result<&ClickHouse> {
        match &self.usage {
            UsageSink::ClickHouse(server) => Ok(server),
            UsageSink::Accepting(_) => anyhow::bail!(
                "this chain has no ClickHouse: start it with `ChainOptions {{ clickhouse: true, .. }}`"
            ),
        }
    }

    /// `Bearer <ES256 JWT>` for `subject` of `tenant`, valid for an hour.
    pub fn bearer(subject: &str, tenant: &str) -> String {
        let now = tokens::now();
        format!(
            "Bearer {}",
            issuer().es256(&tokens::claims(subject, tenant, now, 3600))
        )
    }

    /// A [`Chain::bearer`] the observer has verified: one warm-up request
    /// (`x-request-id: warm-up-<subject>`) reaches the backend first, since
    /// post-cache bypasses requests whose tenant is not yet verified.
    pub fn verified_bearer(&self, subject: &str, tenant: &str) -> Result<String> {
        const VALID: &str = r#"zerolayer_auth_verdicts{outcome="valid"}"#;
        let bearer = Self::bearer(subject, tenant);
        let before = self.envoy.metric(VALID)?.unwrap_or(0.0);
        let id = format!("warm-up-{subject}");
        let reply = self.post(
            "/v1/messages",
            &[("authorization", &bearer), ("x-request-id", &id)],
            &anthropic(&id, false),
        )?;
        anyhow::ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
        self.envoy.wait_metric(VALID, before + 1.0)?;
        Ok(bearer)
    }

    /// Backend requests whose `x-request-id` starts with `prefix`.
    pub fn backend_requests(&self, prefix: &str) -> usize {
        backend_requests(&self.stub, prefix)
    }

    /// POSTs `body` to `path` with JSON content type and `headers`.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Result<Reply> {
        let mut all = headers.to_vec();
        all.push(("content-type", "application/json"));
        self.client.send("POST", &self.envoy.url(path), &all, body)
    }

    /// The access log so far, by `x-request-id` (lines without one skipped).
    pub fn access_log_by_id(&self) -> HashMap<String, Value> {
        self.envoy
            .access_log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| Some((v["request_id"].as_str()?.to_string(), v)))
            .collect()
    }

    /// Waits until the access log holds `n` lines (Envoy flushes it every
    /// 200 ms in tests) and returns them by request id.
    pub fn wait_access_log(&self, n: usize) -> Result<HashMap<String, Value>> {
        crate::wait::until(
            &format!("{n} lines in the access log"),
            Duration::from_secs(10),
            || Ok((self.envoy.access_log().lines().count() >= n).then_some(())),
        )?;
        Ok(self.access_log_by_id())
    }

    /// Waits until the access log holds a line for each of `ids` and
    /// returns its lines by request id. Counting lines is not enough when
    /// earlier requests logged too: the lines counted may be theirs, with
    /// the ones asked for still in Envoy's buffer.
    pub fn wait_access_log_for(&self, ids: &[&str]) -> Result<HashMap<String, Value>> {
        crate::wait::until(
            &format!("access log lines for {ids:?}"),
            Duration::from_secs(10),
            || {
                let log = self.access_log_by_id();
                Ok(ids.iter().all(|id| log.contains_key(*id)).then_some(log))
            },
        )
    }
}

/// Requests `stub` received whose `x-request-id` starts with `prefix`.
pub fn backend_requests(stub: &Stub, prefix: &str) -> usize {
    stub.requests()
        .iter()
        .filter(|r| {
            r.header("x-request-id")
                .is_some_and(|i| i.starts_with(prefix))
        })
        .count()
}

/// Runs `client(i)` for `i` in `0..n` on `n` threads at once and returns
/// their results in order (a panicking client is an error, not a panic).
pub fn concurrently<T: Send>(
    n: usize,
    client: impl Fn(usize) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    std::thread::scope(|s| {
        let client = &client;
        let handles: Vec<_> = (0..n).map(|i| s.spawn(move || client(i))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    })
}

/// A mebibyte.
pub const MIB: usize = 1024 * 1024;

/// A request body case of the large-body scenarios.
#[derive(Debug, Clone, Copy)]
pub struct BodyCase {
    /// Its `x-request-id`.
    pub id: &'static str,
    /// The API path.
    pub path: &'static str,
    /// About how many bytes.
    pub size: usize,
    /// Whether it asks for a stream.
    pub stream: bool,
    /// Sent chunked (no `content-length`) rather than with its length.
    pub chunked: bool,
}

/// Large bodies as long-context and multimodal requests send them, each
/// API streamed and not, with and without a declared length; and one under
/// the stages' 1 MiB, held and rewritten in place.
pub const LARGE_BODIES: &[BodyCase] = &[
    BodyCase {
        id: "big-anthropic",
        path: "/v1/messages",
        size: 32 * MIB,
        stream: false,
        chunked: false,
    },
    BodyCase {
        id: "big-anthropic-stream",
        path: "/v1/messages",
        size: 3 * MIB,
        stream: true,
        chunked: true,
    },
    BodyCase {
        id: "big-openai",
        path: "/v1/chat/completions",
        size: 32 * MIB,
        stream: false,
        chunked: false,
    },
    BodyCase {
        id: "big-openai-stream",
        path: "/v1/chat/completions",
        size: 32 * MIB,
        stream: true,
        chunked: false,
    },
    BodyCase {
        id: "big-openai-stream-chunked",
        path: "/v1/chat/completions",
        size: 3 * MIB,
        stream: true,
        chunked: true,
    },
    BodyCase {
        id: "small-openai-stream",
        path: "/v1/chat/completions",
        size: 100 * 1024,
        stream: true,
        chunked: false,
    },
];

/// A JSON request body for `path` of about `size` bytes: one user message
/// whose content is base64-like text (what a PDF or an image is on the
/// wire), the model after the messages as the official SDKs write it.
pub fn large_request(path: &str, size: usize, stream: bool) -> Vec<u8> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let content: String = (0..size).map(|i| char::from(ALPHABET[i % 64])).collect();
    let request = if path == "/v1/messages" {
        json!({"max_tokens": 8, "messages": [{"role": "user", "content": content}],
               "model": "claude-large", "stream": stream})
    } else {
        json!({"messages": [{"role": "user", "content": content}], "model": "gpt-large",
               "stream": stream})
    };
    request.to_string().into_bytes()
}

/// Checks that the backend got `sent` (request `id`) byte for byte, or,
/// where the gateway asked for usage on the client's behalf
/// (`usage_added`), `sent` with `stream_options.include_usage` and the
/// usage chunk kept from the client's `reply`.
pub fn large_request_arrived(
    stub: &Stub,
    id: &str,
    usage_added: bool,
    sent: &[u8],
    reply: &Reply,
) -> Result<()> {
    let seen = stub
        .requests()
        .into_iter()
        .find(|r| r.header("x-request-id") == Some(id))
        .with_context(|| format!("{id}: never reached the backend"))?;
    if usage_added {
        let got: Value = serde_json::from_slice(&seen.body).with_context(|| {
            format!(
                "{id}: the backend got no JSON ({} bytes for {} sent, ending {:?})",
                seen.body.len(),
                sent.len(),
                String::from_utf8_lossy(&seen.body[seen.body.len().saturating_sub(80)..])
            )
        })?;
        let mut want: Value = serde_json::from_slice(sent)?;
        want["stream_options"] = json!({"include_usage": true});
        anyhow::ensure!(
            got == want,
            "{id}: the backend got another body ({} bytes for {} sent, ending {:?})",
            seen.body.len(),
            sent.len(),
            String::from_utf8_lossy(&seen.body[seen.body.len().saturating_sub(80)..])
        );
        anyhow::ensure!(
            !reply.body.contains("\"choices\":[]"),
            "{id}: the usage chunk reached the client"
        );
    } else {
        anyhow::ensure!(
            seen.body == sent,
            "{id}: the backend got {} bytes, not the {} sent",
            seen.body.len(),
            sent.len()
        );
    }
    Ok(())
}

/// An Anthropic Messages body at temperature 0 (cacheable).
pub fn anthropic(prompt: &str, stream: bool) -> String {
    json!({
        "model": "claude-test",
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

/// An OpenAI Chat Completions body at temperature 0 (cacheable).
pub fn openai(prompt: &str, stream: bool) -> String {
    json!({
        "model": "gpt-test",
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

/// The shipped chain (`envoy/zerolayer.yaml`) as host-sim loads it, with
/// [`CACHE_SECRET`] in the filters' environment and metering sampling
/// `sample_percent` of the requests (the shipped 1% samples next to
/// nothing of a short replay).
pub fn host_sim_chain(sample_percent: f64) -> Result<host_sim_tools::config_file::ChainFile> {
    crate::paths::wasm("metering")?;
    let root = crate::paths::root();
    // Envoy's compressor (ahead of the chain) is not a filter host-sim runs:
    // left out on purpose, the clients here ask for no compression.
    let mut chain = host_sim_tools::config_file::ChainFile::load_skipping(
        &root.join("envoy/zerolayer.yaml"),
        &root,
        &["envoy.filters.http.compressor".to_string()],
    )?;
    for filter in &mut chain.filters {
        filter
            .env
            .push(("ZEROLAYER_CACHE_SECRET".into(), CACHE_SECRET.into()));
        if filter.name == "zerolayer.metering" {
            let mut config: Value = serde_json::from_slice(&filter.configuration)?;
            config["sampling"] = json!({"percent": sample_percent});
            filter.configuration = config.to_string().into_bytes();
        }
    }
    Ok(chain)
}

/// A streamed OpenAI answer's finish reasons, in order, and the bytes of
/// text it delivered.
pub fn openai_stream_end(body: &str) -> (Vec<String>, u64) {
    let (mut finishes, mut text) = (Vec::new(), 0u64);
    zerolayer_core::sse::SseParser::new().push(body.as_bytes(), |event| {
        let Ok(v) = serde_json::from_slice::<Value>(event.data) else {
            return;
        };
        if let Some(piece) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            text += piece.len() as u64;
        }
        if let Some(reason) = v
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
        {
            finishes.push(reason.to_string());
        }
    });
    (finishes, text)
}

/// The usage a response body reports (JSON or SSE, either provider).
pub fn reported_usage(body: &str) -> Result<(u64, u64)> {
    let mut extractor_events = Vec::new();
    if body.trim_start().starts_with('{') {
        extractor_events.push(serde_json::from_str::<Value>(body)?);
    } else {
        zerolayer_core::sse::SseParser::new().push(body.as_bytes(), |e| {
            if let Ok(v) = serde_json::from_slice::<Value>(e.data) {
                extractor_events.push(v);
            }
        });
    }
    let (mut input, mut output) = (0, 0);
    for v in extractor_events {
        let usage = v.get("usage").or_else(|| v.pointer("/message/usage"));
        if let Some(u) = usage.filter(|u| u.is_object()) {
            if let Some(n) = u
                .get("input_tokens")
                .or_else(|| u.get("prompt_tokens"))
                .and_then(Value::as_u64)
            {
                input = n;
            }
            if let Some(n) = u
                .get("output_tokens")
                .or_else(|| u.get("completion_tokens"))
                .and_then(Value::as_u64)
            {
                output = n;
            }
        }
    }
    Ok((input, output))
}

/// The usage metering logged for request `id` (the access log's `usage`
/// field, itself JSON).
pub fn logged_usage(log: &HashMap<String, Value>, id: &str) -> Result<Value> {
    let line = log
        .get(id)
        .with_context(|| format!("{id}: not in the access log"))?;
    let text = line["usage"]
        .as_str()
        .with_context(|| format!("{id}: no usage in {line}"))?;
    serde_json::from_str(text).with_context(|| format!("{id}: usage {text:?}"))
}
