//! The chain against the gateway an operator would pick instead: LiteLLM's
//! proxy (Python, PyPI, the most used open-source LLM gateway), both in
//! front of the same GPU backend stub instance (zero delay), measured in one
//! run with interleaved rounds, by the method of `envoy_load` and
//! `kong_load`.
//!
//! - zerolayer: `envoy/zerolayer-fused.yaml` in real Envoy (one worker), the
//!   fused filter with every stage on — a verified bearer JWT of a premium
//!   tenant (lazy-auth's cached verdict; activation audits every request and
//!   turns metering on), post-cache, metering — with the observer, its JWKS,
//!   audit and usage sinks on loopback.
//! - LiteLLM: `litellm --config … --num_workers 1` from `.venv-peers`, at the
//!   version `tools/requirements-peers.txt` pins, with master-key auth (no
//!   database: the master key is the only key it can check) and its
//!   in-memory response cache, routing the model to the stub as an
//!   OpenAI-compatible backend.
//!
//! Both get the same OpenAI Chat Completions request (`/v1/chat/completions`,
//! temperature 0), as JSON and streamed (`stream_options.include_usage`, so
//! both streams end with the usage), each as a cache hit and sent to the
//! backend: for zerolayer with `cache-control: no-store`, for LiteLLM with
//! its per-request control `"cache": {"no-cache": true, "no-store": true}`.
//! The same requests straight to the stub are the baseline of the added
//! latency.
//!
//! Each proxy runs pinned to CPU 0; wrk and the stub run on CPU 1. Per
//! round, each configuration gets a loaded phase (`wrk -t1 -c16`:
//! requests/s, and the proxy's CPU per request from `/proc/<pid>/stat`, all
//! its processes and threads) and a one-connection phase (`wrk -t1 -c1`:
//! p50/p99 without queueing); the table shows medians over rounds.
//!
//! Asserted on the way, before and during the measurement: a cache hit is a
//! real hit (the stub receives no request, in the checks and over every hit
//! phase), every request meant for the backend reaches it, both proxies
//! reject a bad key and a missing one and pass neither to the backend, and
//! both return the stub's usage (JSON and stream). Any non-2xx answer or
//! socket error under load fails the run.
//!
//! LiteLLM is not installed by the bench: a missing or other version fails
//! it with the command that installs it (`cargo xtask setup-peers`; `cargo
//! xtask bench` runs it first). `cargo bench -p zerolayer-e2e --bench
//! peers` prints the table and the same-run ratios and writes
//! `target/bench/peers.json`; `ZEROLAYER_LOAD_ROUNDS` and
//! `ZEROLAYER_LOAD_SECS` shorten it.
//!
//! LiteLLM runs twice, on uvicorn's uvloop (its own choice) and on asyncio's
//! loop: on this project's Python (CPython 3.11) LiteLLM on uvloop dies of a
//! segmentation fault within seconds of serving streamed cache hits, so that
//! row is measured on asyncio's loop, and the JSON cache hit on both shows
//! what the loop changes. `ZEROLAYER_PEERS_UVLOOP_STREAM_HIT=1` adds the
//! streamed hit on uvloop, to see the crash.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use serde_json::{Value as Json, json};
use zerolayer_e2e::bench::{
    command_output, cpus, load_average, median, pin_self, pin_tree, tree_cpu_secs,
};
use zerolayer_e2e::chain::{AuthServices, CACHE_SECRET, Chain, reported_usage};
use zerolayer_e2e::litellm::{self, EventLoop, LiteLlm};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, MockServer, Reply, paths, wait, wrk};
use zerolayer_stub::{Stub, StubConfig};

/// Where the proxies run; wrk and the stub get the other CPU.
const PROXY_CPU: u32 = 0;
const CLIENT_CPU: u32 = 1;
/// Connections of the loaded phase.
const CONNECTIONS: u32 = 16;
/// Interleaved rounds over all configurations.
const ROUNDS: u64 = 3;
/// Seconds of each loaded phase (LiteLLM serves a few hundred requests in it).
const LOADED_SECS: u64 = 8;
/// Seconds of each one-connection phase.
const SINGLE_SECS: u64 = 4;
/// Seconds of load per configuration before the first round.
const WARM_UP_SECS: u64 = 2;
const PATH: &str = "/v1/chat/completions";
const PROMPT: &str = "Say hello to the gateway.";
/// Set (to anything): LiteLLM's streamed cache hits on uvloop are measured
/// too — the configuration that crashes it here.
const UVLOOP_STREAM_HIT: &str = "ZEROLAYER_PEERS_UVLOOP_STREAM_HIT";
/// zerolayer's tenant: a premium one (activation turns metering on for it).
const TENANT: &str = "acme";

/// Which server a configuration sends to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Proxy {
    /// The stub itself: the baseline.
    Direct,
    Zerolayer,
    /// LiteLLM as it runs itself (uvicorn on uvloop).
    LiteLlm,
    /// The same configuration with uvicorn on asyncio's loop: on this
    /// Python (3.11) LiteLLM on uvloop segfaults serving streamed cache
    /// hits (`litellm::EventLoop::Asyncio`).
    LiteLlmAsyncio,
}

impl Proxy {
    fn is_litellm(self) -> bool {
        matches!(self, Proxy::LiteLlm | Proxy::LiteLlmAsyncio)
    }

    fn name(self) -> &'static str {
        match self {
            Proxy::Direct => "the stub",
            Proxy::Zerolayer => "zerolayer",
            Proxy::LiteLlm => "LiteLLM",
            Proxy::LiteLlmAsyncio => "LiteLLM (asyncio loop)",
        }
    }
}

/// The answer's form.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    Json,
    Stream,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Json => "JSON",
            Shape::Stream => "stream",
        }
    }
}

/// Where the answer comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    /// The proxy's cache: the backend sees nothing.
    Cache,
    /// The backend, through the proxy (or directly).
    Backend,
}

/// One configuration under test.
#[derive(Clone, Copy, Debug)]
struct Variant {
    key: &'static str,
    label: &'static str,
    proxy: Proxy,
    shape: Shape,
    source: Source,
}

const fn v(
    key: &'static str,
    label: &'static str,
    proxy: Proxy,
    shape: Shape,
    source: Source,
) -> Variant {
    Variant {
        key,
        label,
        proxy,
        shape,
        source,
    }
}

const VARIANTS: [Variant; 11] = {
    use Proxy::{Direct, LiteLlm, LiteLlmAsyncio, Zerolayer};
    use Shape::{Json, Stream};
    use Source::{Backend, Cache as Hit};
    [
        v("direct-json", "direct to the stub", Direct, Json, Backend),
        v(
            "zl-json",
            "zerolayer, no-store (to the backend)",
            Zerolayer,
            Json,
            Backend,
        ),
        v(
            "litellm-json",
            "LiteLLM, cache off (to the backend)",
            LiteLlm,
            Json,
            Backend,
        ),
        v("zl-json-hit", "zerolayer, cache hit", Zerolayer, Json, Hit),
        v("litellm-json-hit", "LiteLLM, cache hit", LiteLlm, Json, Hit),
        v(
            "litellm-json-hit-asyncio",
            "LiteLLM, cache hit, asyncio loop",
            LiteLlmAsyncio,
            Json,
            Hit,
        ),
        v("direct-sse", "direct to the stub", Direct, Stream, Backend),
        v(
            "zl-sse",
            "zerolayer, no-store (to the backend)",
            Zerolayer,
            Stream,
            Backend,
        ),
        v(
            "litellm-sse",
            "LiteLLM, cache off (to the backend)",
            LiteLlm,
            Stream,
            Backend,
        ),
        v("zl-sse-hit", "zerolayer, cache hit", Zerolayer, Stream, Hit),
        v(
            "litellm-sse-hit-asyncio",
            "LiteLLM, cache hit, asyncio loop (1)",
            LiteLlmAsyncio,
            Stream,
            Hit,
        ),
    ]
};

/// The request body for `shape`; `litellm_no_cache` adds LiteLLM's
/// per-request cache control.
fn body(shape: Shape, litellm_no_cache: bool) -> String {
    let mut body = json!({
        "model": litellm::MODEL,
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}],
    });
    if shape == Shape::Stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    if litellm_no_cache {
        body["cache"] = json!({"no-cache": true, "no-store": true});
    }
    body.to_string()
}

impl Variant {
    fn body(&self) -> String {
        body(
            self.shape,
            self.proxy.is_litellm() && self.source == Source::Backend,
        )
    }

    /// Headers besides `content-type`.
    fn headers(&self, bearer: &str) -> Vec<(&'static str, String)> {
        match self.proxy {
            Proxy::Direct => vec![],
            Proxy::Zerolayer => {
                let mut h = vec![("authorization", bearer.to_string())];
                if self.source == Source::Backend {
                    h.push(("cache-control", "no-store".to_string()));
                }
                h
            }
            Proxy::LiteLlm | Proxy::LiteLlmAsyncio => {
                vec![("authorization", format!("Bearer {}", litellm::MASTER_KEY))]
            }
        }
    }
}

/// One wrk phase, with the proxy's CPU time and the backend's requests
/// over it.
#[derive(Clone, Debug, serde::Serialize)]
struct Phase {
    #[serde(flatten)]
    wrk: wrk::Report,
    /// The proxy's user + system CPU seconds (`None`: no proxy).
    cpu_secs: Option<f64>,
    /// Requests the stub received during the phase.
    backend_requests: usize,
}

/// A configuration's medians over rounds, and the rounds.
#[derive(Clone, Debug, serde::Serialize)]
struct Summary {
    key: &'static str,
    label: &'static str,
    shape: &'static str,
    /// Loaded phase: requests/s.
    rps: f64,
    /// Loaded phase: the proxy's CPU µs per request.
    cpu_us_per_request: Option<f64>,
    /// Loaded phase: the proxy's CPU time / wall time (1.0: its core busy).
    core_busy: Option<f64>,
    /// One connection: latency.
    p50_us: f64,
    p99_us: f64,
    /// One connection: p50 over the direct p50 of the same shape.
    added_p50_us: f64,
    loaded: Vec<Phase>,
    single: Vec<Phase>,
}

/// What the run checked before measuring, for the report.
#[derive(Default, serde::Serialize)]
struct Checks {
    zerolayer: serde_json::Map<String, Json>,
    litellm: serde_json::Map<String, Json>,
}

/// The running servers, and how to reach each.
struct Servers {
    stub: Stub,
    envoy: Envoy,
    litellm: LiteLlm,
    litellm_asyncio: LiteLlm,
    /// Kept alive: the observer's JWKS, introspection, audit and usage sinks.
    services: AuthServices,
    usage: MockServer,
}

impl Servers {
    fn url(&self, proxy: Proxy) -> String {
        match proxy {
            Proxy::Direct => format!("{}{PATH}", self.stub.url()),
            Proxy::Zerolayer => self.envoy.url(PATH),
            Proxy::LiteLlm => self.litellm.url(PATH),
            Proxy::LiteLlmAsyncio => self.litellm_asyncio.url(PATH),
        }
    }

    fn pid(&self, proxy: Proxy) -> Option<u32> {
        match proxy {
            Proxy::Direct => None,
            Proxy::Zerolayer => Some(self.envoy.pid()),
            Proxy::LiteLlm => Some(self.litellm.pid()),
            Proxy::LiteLlmAsyncio => Some(self.litellm_asyncio.pid()),
        }
    }

    /// What to say when `proxy` failed under load.
    fn post_mortem(&self, proxy: Proxy) -> String {
        let litellm = match proxy {
            Proxy::LiteLlm => &self.litellm,
            Proxy::LiteLlmAsyncio => &self.litellm_asyncio,
            _ => return String::new(),
        };
        if !litellm.exited() {
            return String::new();
        }
        format!(
            "\nLiteLLM exited; its log's tail:\n{}",
            litellm.log_tail(30)
        )
    }

    /// Requests the stub has received on the bench's path.
    fn backend_requests(&self) -> usize {
        self.stub.served(PATH)
    }

    /// Waits until the stub has received nothing for 250 ms: requests a
    /// proxy still had in flight when wrk stopped are not counted in (or
    /// against) the next phase.
    fn quiet(&self) -> Result<()> {
        let mut last = (self.backend_requests(), Instant::now());
        wait::until(
            "the backend quiet for 250 ms",
            Duration::from_secs(20),
            || {
                let now = self.backend_requests();
                if now != last.0 {
                    last = (now, Instant::now());
                }
                Ok((last.1.elapsed() >= Duration::from_millis(250)).then_some(()))
            },
        )
    }
}

/// How long a run measures.
struct Plan {
    rounds: u64,
    loaded_secs: u64,
    single_secs: u64,
}

impl Plan {
    fn from_env() -> Result<Self> {
        let number = |name: &str, default: u64| -> Result<u64> {
            std::env::var(name)
                .ok()
                .map(|v| v.parse().with_context(|| format!("{name}={v:?}")))
                .transpose()
                .map(|v| v.unwrap_or(default))
        };
        let loaded_secs = number("ZEROLAYER_LOAD_SECS", LOADED_SECS)?;
        Ok(Plan {
            rounds: number("ZEROLAYER_LOAD_ROUNDS", ROUNDS)?,
            loaded_secs,
            single_secs: (loaded_secs / 2).clamp(1, SINGLE_SECS),
        })
    }

    /// The run BENCHMARKS.md reports, not a shortened one.
    fn complete(&self) -> bool {
        self.rounds == ROUNDS && self.loaded_secs == LOADED_SECS
    }
}

fn main() -> Result<()> {
    // criterion-style arguments from `cargo bench` are ignored.
    let plan = Plan::from_env()?;
    let wrk = wrk::binary()?;
    let envoy_binary = paths::envoy_binary()?;
    paths::wasm("fused")?;
    paths::wasm("observer_service")?;
    litellm::binary()?;
    let versions = versions(&envoy_binary);
    // Children (the stub's threads, wrk) inherit this process's CPU.
    let pinned = pin_self(CLIENT_CPU);
    if !pinned {
        eprintln!("note: not pinned to CPUs (needs 2 CPUs and taskset); numbers are noisier");
    }

    let stub = Stub::start(StubConfig::default()).context("starting the backend stub")?;
    let services = AuthServices::start(|_| (200, r#"{"active":false}"#.to_string()))?;
    let usage = MockServer::start(|_| (200, String::new()))?;
    eprintln!("starting Envoy with the fused chain and LiteLLM's proxy");
    let envoy = start_zerolayer(&stub, &services, &usage)?;
    let litellm = LiteLlm::start(stub.addr(), true, EventLoop::Uvloop)?;
    let litellm_asyncio = LiteLlm::start(stub.addr(), true, EventLoop::Asyncio)?;
    let servers = Servers {
        stub,
        envoy,
        litellm,
        litellm_asyncio,
        services,
        usage,
    };
    for proxy in [Proxy::Zerolayer, Proxy::LiteLlm, Proxy::LiteLlmAsyncio] {
        if let (true, Some(pid)) = (pinned, servers.pid(proxy)) {
            ensure!(
                pin_tree(pid, PROXY_CPU),
                "could not pin {proxy:?} ({pid}) to CPU {PROXY_CPU}"
            );
        }
    }

    let bearer = Chain::bearer("bench", TENANT);
    let mut variants = VARIANTS.to_vec();
    if std::env::var_os(UVLOOP_STREAM_HIT).is_some() {
        // What the asyncio row stands in for; expect the run to fail with
        // LiteLLM's "Fatal Python error: Segmentation fault".
        variants.push(Variant {
            key: "litellm-sse-hit",
            label: "LiteLLM, cache hit (uvloop)",
            proxy: Proxy::LiteLlm,
            shape: Shape::Stream,
            source: Source::Cache,
        });
    }
    let checks = check(&servers, &variants, &bearer)?;
    let dir = tempfile::tempdir()?;
    let scripts = variants
        .iter()
        .map(|v| write_script(dir.path(), v, &bearer))
        .collect::<Result<Vec<_>>>()?;
    eprintln!("warming up: {WARM_UP_SECS} s at {CONNECTIONS} connections each");
    for (v, script) in variants.iter().zip(&scripts) {
        measure(&servers, &wrk, v, script, CONNECTIONS, WARM_UP_SECS)
            .with_context(|| format!("warming up {}", v.key))?;
    }

    let load_before = load_average();
    eprintln!(
        "measuring: {} rounds × {} configurations × ({} s at {CONNECTIONS} connections + {} s at 1); load average {load_before}",
        plan.rounds,
        variants.len(),
        plan.loaded_secs,
        plan.single_secs
    );
    let mut loaded: Vec<Vec<Phase>> = vec![Vec::new(); variants.len()];
    let mut single: Vec<Vec<Phase>> = vec![Vec::new(); variants.len()];
    for round in 0..plan.rounds {
        // Rotate the order so no configuration always runs first.
        let n = variants.len();
        let shift = usize::try_from(round)?;
        for i in (0..n).map(|i| (i + shift) % n) {
            let (v, script) = (&variants[i], &scripts[i]);
            let phase = measure(&servers, &wrk, v, script, CONNECTIONS, plan.loaded_secs)
                .with_context(|| format!("loading {}", v.key))?;
            loaded[i].push(phase);
            let phase = measure(&servers, &wrk, v, script, 1, plan.single_secs)
                .with_context(|| format!("one connection to {}", v.key))?;
            single[i].push(phase);
        }
        eprintln!("round {} of {} done", round + 1, plan.rounds);
    }
    let load_after = load_average();
    let shipped = shipped(&servers);

    let summaries = summarize(&variants, loaded, single);
    print_table(&summaries, &plan, &versions, pinned);
    let ratios = ratios(&summaries);
    for line in &ratios {
        println!("{line}");
    }
    println!(
        "(load average {load_before} before, {load_after} after; the observer shipped {} audit records and {} sampled usage records)",
        shipped["audit_records"], shipped["usage_records"]
    );
    let report = json!({
        "versions": versions,
        "method": {
            "pinned": pinned,
            "proxy_cpu": PROXY_CPU,
            "client_cpu": CLIENT_CPU,
            "wrk": format!(
                "wrk -t1 -c{CONNECTIONS} -d{}s --latency, then wrk -t1 -c1 -d{}s --latency",
                plan.loaded_secs, plan.single_secs
            ),
            "rounds": plan.rounds,
            "warm_up_secs": WARM_UP_SECS,
            "path": PATH,
            "json_body": body(Shape::Json, false),
            "stream_body": body(Shape::Stream, false),
            "zerolayer": "envoy/zerolayer-fused.yaml, Envoy --concurrency 1, bearer ES256 JWT of a premium tenant; to the backend: cache-control: no-store",
            "litellm": "litellm --num_workers 1, master_key, cache: local (in-memory, ttl 3600), uvicorn on uvloop (LiteLLM's choice) and, a second instance, on asyncio's loop; to the backend: \"cache\": {\"no-cache\": true, \"no-store\": true}",
            "backend": "zerolayer-stub, zero delay, in the bench process",
            "load_average_before": load_before,
            "load_average_after": load_after,
            "sinks": shipped,
            "complete": plan.complete(),
        },
        "checks": checks,
        "results": summaries,
        "ratios": ratios,
    });
    let out = paths::root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    let path = out.join("peers.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", path.display());
    if !plan.complete() {
        println!("(a shortened run: not the one BENCHMARKS.md reports)");
    }
    Ok(())
}

/// Envoy with `envoy/zerolayer-fused.yaml` in front of the stub, its
/// clusters pointed at the loopback services, the test issuer trusted, and
/// verdicts and cache entries kept for the run (an hour); returns once the
/// observer holds the issuer's keys.
fn start_zerolayer(stub: &Stub, services: &AuthServices, usage: &MockServer) -> Result<Envoy> {
    let mut config = services
        .point(EnvoyConfig::shipped("zerolayer-fused.yaml")?.for_run(stub.addr())?)?
        .point_cluster("clickhouse", usage.addr())?
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    let mut sections = config.wasm_filter_json("zerolayer")?;
    sections["lazy_auth"]["jwt"]["issuers"] = json!(["https://idp.test"]);
    sections["lazy_auth"]["verdict_max_ttl_secs"] = json!(3600);
    sections["post_cache"]["ttl"]["default_ttl_secs"] = json!(3600);
    config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
    let mut service: Json = serde_json::from_str(&config.service_config("zerolayer.observer")?)?;
    service["lazy_auth"] = sections["lazy_auth"].clone();
    config.set_service_config("zerolayer.observer", &service.to_string())?;
    let envoy = Envoy::start(&config).context("starting Envoy with the fused chain")?;
    envoy.wait_metric(r#"zerolayer_auth_jwks_fetches{outcome="ok"}"#, 1.0)?;
    Ok(envoy)
}

/// The correctness the comparison rests on, for both proxies and both
/// shapes; leaves each proxy's cache holding the bench's requests.
fn check(servers: &Servers, variants: &[Variant], bearer: &str) -> Result<Checks> {
    let client = Client::new();
    let send = |proxy: Proxy, headers: &[(&str, String)], body: &str| -> Result<(Reply, usize)> {
        servers.quiet()?;
        let before = servers.backend_requests();
        let mut all: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        all.push(("content-type", "application/json"));
        let reply = client.send("POST", &servers.url(proxy), &all, body)?;
        servers.quiet()?;
        Ok((reply, servers.backend_requests() - before))
    };
    let mut checks = Checks::default();

    // zerolayer verifies a new token in the background; until then its
    // tenant is unverified and post-cache bypasses the request.
    let mut n = 0;
    let auth = [("authorization", bearer.to_string())];
    wait::until("the bench token verified", Duration::from_secs(20), || {
        n += 1;
        let probe = body(Shape::Json, false).replace(PROMPT, &format!("warm-up {n}"));
        let (reply, _) = send(Proxy::Zerolayer, &auth, &probe)?;
        ensure!(
            reply.status == 200,
            "zerolayer warm-up: {} {}",
            reply.status,
            reply.body
        );
        Ok(matches!(reply.header("x-cache"), Some("MISS" | "HIT")).then_some(()))
    })?;

    // What each measured configuration relies on, checked on it.
    for shape in [Shape::Json, Shape::Stream] {
        let (direct, _) = send(Proxy::Direct, &[], &body(shape, false))?;
        ensure!(direct.status == 200, "the stub answered {}", direct.status);
        let want = reported_usage(&direct.body)?;
        ensure!(
            want.0 > 0 && want.1 > 0,
            "the stub's {} answer has no usage: {}",
            shape.name(),
            direct.body
        );
        for v in variants
            .iter()
            .filter(|v| v.shape == shape && v.proxy != Proxy::Direct)
        {
            let who = v.proxy.name();
            let is_hit = |reply: &Reply| match v.proxy {
                Proxy::Zerolayer => reply.header("x-cache") == Some("HIT"),
                _ => reply.header("x-litellm-cache-key").is_some(),
            };
            let headers = v.headers(bearer);
            if v.source == Source::Cache {
                // Stored by the first request that may store, then hits.
                wait::until(
                    &format!("a {who} cache hit ({})", shape.name()),
                    Duration::from_secs(20),
                    || {
                        let (reply, _) = send(v.proxy, &headers, &v.body())?;
                        ensure!(
                            reply.status == 200,
                            "{who}: {} {}",
                            reply.status,
                            reply.body
                        );
                        Ok(is_hit(&reply).then_some(()))
                    },
                )?;
            }
            let (reply, asked) = send(v.proxy, &headers, &v.body())?;
            let expected = usize::from(v.source == Source::Backend);
            ensure!(
                reply.status == 200
                    && is_hit(&reply) == (v.source == Source::Cache)
                    && asked == expected,
                "{}: {} (a cache hit: {}), {asked} backend requests (want {expected}):\n{}",
                v.key,
                reply.status,
                is_hit(&reply),
                reply.body
            );
            let got = reported_usage(&reply.body)?;
            ensure!(
                got == want,
                "{}: usage {got:?}, the stub's is {want:?}:\n{}",
                v.key,
                reply.body
            );
            let record = match v.proxy {
                Proxy::Zerolayer => &mut checks.zerolayer,
                _ => &mut checks.litellm,
            };
            record.insert(
                v.key.to_string(),
                json!({"status": reply.status, "cache_hit": is_hit(&reply),
                       "backend_requests": asked,
                       "usage": {"input": got.0, "output": got.1},
                       "stub_usage": {"input": want.0, "output": want.1}}),
            );
        }
    }

    // A bad key and none at all.
    let json_body = body(Shape::Json, false);
    let rejected = |proxy: Proxy,
                    who: &str,
                    what: &str,
                    headers: &[(&str, String)]|
     -> Result<Json> {
        let (reply, asked) = send(proxy, headers, &json_body)?;
        ensure!(
            !(200..300).contains(&reply.status) && asked == 0,
            "{who} {what}: {} with {asked} backend requests: {}",
            reply.status,
            reply.body
        );
        Ok(
            json!({"status": reply.status, "body": reply.body.chars().take(120).collect::<String>()}),
        )
    };
    let wrong = [("authorization", "Bearer sk-wrong-key".to_string())];
    checks.litellm.insert(
        "wrong_key".into(),
        rejected(Proxy::LiteLlm, "LiteLLM", "a wrong key", &wrong)?,
    );
    checks.litellm.insert(
        "missing_key".into(),
        rejected(Proxy::LiteLlm, "LiteLLM", "no key", &[])?,
    );
    checks.zerolayer.insert(
        "missing_key".into(),
        rejected(Proxy::Zerolayer, "zerolayer", "no credential", &[])?,
    );
    // A JWT with a signature nobody made, and a bearer that is no JWT:
    // lazy-auth admits an unknown credential's first request unverified
    // (`max_unverified_per_token` 1, the shipped default; no verified
    // tenant, so never cached) while the observer verifies it, and refuses
    // every later one.
    let forged = format!(
        "Bearer {}",
        issuer().forged(&tokens::claims("mallory", TENANT, tokens::now(), 3600), 7)
    );
    const INVALID: &str = r#"zerolayer_auth_verdicts{outcome="invalid"}"#;
    for (key, what, credential) in [
        ("forged_jwt", "a forged JWT", forged),
        (
            "wrong_key",
            "a wrong bearer key",
            "Bearer sk-wrong-key".to_string(),
        ),
    ] {
        let headers = [("authorization", credential)];
        let verdicts = servers.envoy.metric(INVALID)?.unwrap_or(0.0);
        let (first, asked) = send(Proxy::Zerolayer, &headers, &json_body)?;
        servers.envoy.wait_metric(INVALID, verdicts + 1.0)?;
        checks.zerolayer.insert(
            format!("{key}_first"),
            json!({"status": first.status, "backend_requests": asked}),
        );
        checks.zerolayer.insert(
            key.to_string(),
            rejected(Proxy::Zerolayer, "zerolayer", what, &headers)?,
        );
    }
    for (who, map) in [
        ("zerolayer", &checks.zerolayer),
        ("LiteLLM", &checks.litellm),
    ] {
        let statuses: Vec<String> = map
            .iter()
            .filter(|(k, _)| k.ends_with("_key") || k.contains("jwt"))
            .filter_map(|(k, v)| Some(format!("{k} {}", v.get("status")?)))
            .collect();
        eprintln!("{who}, bad credentials: {}", statuses.join(", "));
    }
    Ok(checks)
}

/// Writes the wrk script for `variant`: wrk formats the request once and
/// sends the same bytes every time.
fn write_script(dir: &Path, variant: &Variant, bearer: &str) -> Result<PathBuf> {
    let mut lua = String::new();
    writeln!(lua, "wrk.method = \"POST\"")?;
    writeln!(lua, "wrk.path = \"{PATH}\"")?;
    writeln!(lua, "wrk.body = [==[{}]==]", variant.body())?;
    writeln!(lua, "wrk.headers[\"content-type\"] = \"application/json\"")?;
    for (name, value) in variant.headers(bearer) {
        writeln!(lua, "wrk.headers[\"{name}\"] = \"{value}\"")?;
    }
    let path = dir.join(format!("{}.lua", variant.key));
    std::fs::write(&path, lua)?;
    Ok(path)
}

/// One wrk phase against `variant`, with the proxy's CPU time and the
/// backend's requests over it; fails on any non-2xx answer, socket error,
/// backend request during a hit phase, or response that did not come from
/// the backend where one should have.
fn measure(
    servers: &Servers,
    wrk_binary: &Path,
    variant: &Variant,
    script: &Path,
    connections: u32,
    secs: u64,
) -> Result<Phase> {
    servers.quiet()?;
    let pid = servers.pid(variant.proxy);
    let backend_before = servers.backend_requests();
    let cpu_before = pid.map(tree_cpu_secs).transpose()?;
    let report = wrk::run(
        wrk_binary,
        &servers.url(variant.proxy),
        script,
        connections,
        secs,
    )
    .map_err(|e| anyhow!("{e:#}{}", servers.post_mortem(variant.proxy)))?;
    let cpu_after = pid.map(tree_cpu_secs).transpose()?;
    let backend_requests = servers.backend_requests() - backend_before;
    ensure!(
        report.non_2xx == 0 && report.socket_errors == 0,
        "{} answers were not 2xx, {} socket errors{}",
        report.non_2xx,
        report.socket_errors,
        servers.post_mortem(variant.proxy)
    );
    match variant.source {
        Source::Cache => ensure!(
            backend_requests == 0,
            "{} backend requests during {} cache hits: not all were hits",
            backend_requests,
            report.requests
        ),
        Source::Backend => ensure!(
            u64::try_from(backend_requests)? >= report.requests,
            "{} answers but only {backend_requests} backend requests",
            report.requests
        ),
    }
    Ok(Phase {
        wrk: report,
        cpu_secs: cpu_before.zip(cpu_after).map(|(b, a)| a - b),
        backend_requests,
    })
}

/// Each number is the median over rounds; the rounds are kept in the JSON.
fn summarize(
    variants: &[Variant],
    loaded: Vec<Vec<Phase>>,
    single: Vec<Vec<Phase>>,
) -> Vec<Summary> {
    let over = |phases: &[Phase], f: &dyn Fn(&Phase) -> Option<f64>| -> Option<f64> {
        let values: Option<Vec<f64>> = phases.iter().map(f).collect();
        values.map(median)
    };
    let mut rows: Vec<Summary> = variants
        .iter()
        .zip(loaded.into_iter().zip(single))
        .map(|(v, (loaded, single))| Summary {
            key: v.key,
            label: v.label,
            shape: v.shape.name(),
            rps: over(&loaded, &|p| Some(p.wrk.rps)).unwrap_or(f64::NAN),
            cpu_us_per_request: over(&loaded, &|p| {
                Some(p.cpu_secs? * 1e6 / p.wrk.requests.max(1) as f64)
            }),
            core_busy: over(&loaded, &|p| Some(p.cpu_secs? / p.wrk.seconds.max(1e-9))),
            p50_us: over(&single, &|p| Some(p.wrk.p50_us)).unwrap_or(f64::NAN),
            p99_us: over(&single, &|p| Some(p.wrk.p99_us)).unwrap_or(f64::NAN),
            added_p50_us: 0.0,
            loaded,
            single,
        })
        .collect();
    let direct: Vec<(&'static str, f64)> = variants
        .iter()
        .zip(&rows)
        .filter(|(v, _)| v.proxy == Proxy::Direct)
        .map(|(v, r)| (v.shape.name(), r.p50_us))
        .collect();
    for row in &mut rows {
        if let Some((_, base)) = direct.iter().find(|(shape, _)| *shape == row.shape) {
            row.added_p50_us = row.p50_us - base;
        }
    }
    rows
}

fn print_table(rows: &[Summary], plan: &Plan, versions: &Json, pinned: bool) {
    println!();
    println!(
        "zerolayer (fused chain, Envoy {}, 1 worker) and LiteLLM {} (proxy, 1 worker, Python {}) in front of the same GPU backend stub (zero delay), same run",
        versions["envoy"].as_str().unwrap_or("?"),
        versions["litellm"].as_str().unwrap_or("?"),
        versions["python"].as_str().unwrap_or("?"),
    );
    println!(
        "proxies on CPU {PROXY_CPU}, wrk and the stub on CPU {CLIENT_CPU}{}; wrk -t1 -c{CONNECTIONS} {} s and -c1 {} s × {} rounds, interleaved; medians",
        if pinned { "" } else { " (not pinned: noisier)" },
        plan.loaded_secs,
        plan.single_secs,
        plan.rounds
    );
    println!(
        "{:<6} {:<38} │ {:>9} {:>11} {:>5} │ {:>9} {:>9} {:>10}",
        "", "configuration", "req/s 16c", "CPU µs/req", "busy", "p50 1c", "p99 1c", "+p50 µs"
    );
    let mut shape = "";
    for r in rows {
        if r.shape != shape && !shape.is_empty() {
            println!("{:-<6} {:-<38} ┼{:-<28}┼{:-<31}", "", "", "", "");
        }
        shape = r.shape;
        let cpu = r
            .cpu_us_per_request
            .map_or_else(|| "—".to_string(), |c| format!("{c:.1}"));
        let busy = r
            .core_busy
            .map_or_else(|| "—".to_string(), |b| format!("{:.0}%", b * 100.0));
        println!(
            "{:<6} {:<38} │ {:>9.0} {:>11} {:>5} │ {:>7.0}µs {:>7.0}µs {:>+10.0}",
            r.shape, r.label, r.rps, cpu, busy, r.p50_us, r.p99_us, r.added_p50_us
        );
    }
    println!(
        "(1) on uvloop, LiteLLM's own choice, LiteLLM dies of a segmentation fault (in CPython 3.11's libpython) within seconds of serving streamed cache hits"
    );
    println!();
}

/// zerolayer / LiteLLM per shape and path, within this run.
fn ratios(rows: &[Summary]) -> Vec<String> {
    let get = |key: &str| rows.iter().find(|r| r.key == key);
    let mut lines = Vec::new();
    for (shape, zl, lite, what) in [
        ("JSON", "zl-json", "litellm-json", "to the backend"),
        ("JSON", "zl-json-hit", "litellm-json-hit", "cache hit"),
        (
            "JSON",
            "zl-json-hit",
            "litellm-json-hit-asyncio",
            "cache hit, LiteLLM on asyncio's loop",
        ),
        ("stream", "zl-sse", "litellm-sse", "to the backend"),
        (
            "stream",
            "zl-sse-hit",
            "litellm-sse-hit-asyncio",
            "cache hit, LiteLLM on asyncio's loop",
        ),
    ] {
        let (Some(zl), Some(lite)) = (get(zl), get(lite)) else {
            continue;
        };
        let (Some(zl_cpu), Some(lite_cpu)) = (zl.cpu_us_per_request, lite.cpu_us_per_request)
        else {
            continue;
        };
        lines.push(format!(
            "zerolayer / LiteLLM, {shape}, {what}: req/s {:.0}×, CPU per request {:.4} (1/{:.0}), added p50 {:.3} (1/{:.0})",
            zl.rps / lite.rps,
            zl_cpu / lite_cpu,
            lite_cpu / zl_cpu,
            zl.added_p50_us / lite.added_p50_us,
            lite.added_p50_us / zl.added_p50_us,
        ));
    }
    lines
}

/// What the observer shipped (audit of every request, sampled usage).
fn shipped(servers: &Servers) -> Json {
    let records =
        |m: &MockServer| -> usize { m.seen().iter().map(|r| r.body.lines().count()).sum() };
    json!({
        "audit_records": records(&servers.services.audit),
        "usage_records": records(&servers.usage),
    })
}

/// What was measured, at which versions, on what.
fn versions(envoy: &Path) -> Json {
    let envoy = Command::new(envoy)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.split_whitespace()
                .find(|w| w.contains("/1."))
                .and_then(|w| w.split('/').nth(1).map(str::to_string))
        })
        .unwrap_or_else(|| "?".into());
    let python = litellm::venv().join("bin/python");
    let python = command_output(&python.to_string_lossy(), &["--version"])
        .and_then(|v| v.strip_prefix("Python ").map(str::to_string))
        .unwrap_or_else(|| "?".into());
    let wrk = wrk::binary()
        .ok()
        .and_then(|w| Command::new(w).arg("-v").output().ok())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default();
    let cpu = command_output("lscpu", &[])
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("Model name:").map(|m| m.trim().to_string()))
        })
        .unwrap_or_else(|| "?".into());
    json!({
        "envoy": envoy,
        "litellm": litellm::installed_version().unwrap_or_else(|_| "?".into()),
        "python": python,
        "wrk": wrk,
        "cpu": format!("{} × {cpu}", cpus()),
        "kernel": command_output("uname", &["-r"]).unwrap_or_default(),
    })
}
