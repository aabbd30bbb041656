//! Load against real Envoy (V8), every configuration in the same run with the
//! same load tool: plain Envoy; each zerolayer filter alone; the full chain
//! of `envoy/zerolayer.yaml` with the observer; Envoy's native `jwt_authn` in
//! place of lazy-auth; and one and four trivial Wasm filters, the floor any
//! Wasm filter pays. All configurations share the shipped listener (its JSON
//! access log included) and differ only in their HTTP filters and observer.
//!
//! The backend is the GPU backend stub's answer to the bench request,
//! replayed by an upstream Envoy (`direct_response`): until 2026-11-29 the
//! stub waited on tokio's millisecond timer even with zero delays, which
//! bounded every configuration alike; it no longer does, and both are
//! measured alone first, same run, so the next change can switch to it.
//!
//! Envoy runs with one worker thread (`--concurrency 1`) pinned to CPU 0;
//! wrk, the upstream and the loopback sinks run on CPU 1. Per round, each
//! configuration gets a loaded phase (`wrk -t1 -c16`: requests/s and Envoy's
//! CPU per request, from `/proc/<pid>/stat`) and a one-connection phase
//! (`wrk -t1 -c1`: latency without queueing); rounds are interleaved. The
//! run fails on a missing wrk or Envoy, any answer that is not 2xx (or not a
//! cache hit where one is meant), connections that were not reused, and
//! lazy-auth off its cached-verdict path: then it would measure something
//! else.
//!
//! Prints a table with ratios to plain Envoy and writes
//! `target/bench/envoy_load.{json,svg}`; a complete run copies the chart to
//! `docs/envoy_load.svg`, which BENCHMARKS.md shows. `ZEROLAYER_LOAD_ROUNDS`
//! and `ZEROLAYER_LOAD_SECS` shorten a development run, `ZEROLAYER_LOAD_ONLY`
//! (comma-separated keys) narrows it, and `ZEROLAYER_LOAD_BASELINE_WASM=<dir>`
//! adds each configuration again (`<key>-base`) with the filter modules of
//! another build (its `.wasm` files, and its `libzerolayer_native.so` for
//! the native rows) — before and after a change in one run (none of these
//! runs is copied).
#![allow(missing_docs)]

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use serde_json::{Value as Json, json};
use serde_yaml::Value as Yaml;
use zerolayer_e2e::bench::{
    command_output, cpus, load_average, median, pin, pin_self, tree_cpu_secs,
};
use zerolayer_e2e::chain::AuthServices;
use zerolayer_e2e::fleet::RedisFleet;
use zerolayer_e2e::probes;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Envoy, EnvoyConfig, MockServer, paths, wait, wrk};
use zerolayer_stub::{Stub, StubConfig};

/// Interleaved rounds over all configurations.
const ROUNDS: usize = 3;
/// Seconds of each loaded phase (`-c16`).
const LOADED_SECS: u64 = 5;
/// The fused filter's sections, in chain order.
const FUSED_STAGES: [&str; 4] = ["lazy_auth", "activation", "post_cache", "metering"];
/// Seconds of each one-connection phase (`-c1`).
const SINGLE_SECS: u64 = 2;
/// Connections of the loaded phase.
const CONNECTIONS: u32 = 16;
/// Seconds of load before the first round (V8 tiers up, verdicts and cache
/// entries are in place).
const WARM_UP_SECS: u64 = 2;
/// How long a started Envoy may take to verify the bench token and answer.
const CHECK_PATIENCE: Duration = Duration::from_secs(10);
const CACHE_SECRET: &str = "zerolayer-bench-cache-secret-0123456789abcdef";
/// Not in activation's premium tenants: metering samples it at the
/// configured 1% instead of recording every request.
const TENANT: &str = "initech";
const PATH: &str = "/v1/messages";
/// One fixed request (wrk sends the same bytes every time): temperature 0,
/// so post-cache may store and replay it.
const BODY: &str = r#"{"model":"claude-bench","max_tokens":64,"temperature":0,"messages":[{"role":"user","content":"Say hello to the gateway."}]}"#;
/// Where Envoy's worker runs; the load generator and upstreams get the other.
const ENVOY_CPU: u32 = 0;
const CLIENT_CPU: u32 = 1;

/// What a configuration's answers must look like before it is measured.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    /// 200 from the backend (no cache hit).
    Backend,
    /// 200 replayed by post-cache (`x-cache: HIT`).
    CacheHit,
}

/// The request variants.
#[derive(Clone, Copy, PartialEq)]
enum Request {
    /// The fixed request.
    Plain,
    /// The same with `cache-control: no-store` (activation turns the cache
    /// off: every filter runs and the request reaches the backend).
    NoStore,
}

/// One configuration under test.
#[derive(Clone)]
struct Variant {
    key: &'static str,
    label: &'static str,
    /// Bar colour in the chart.
    group: Group,
    /// HTTP filters before the router.
    filters: Vec<Yaml>,
    /// The observer singleton's configuration, when it runs.
    observer: Option<Json>,
    /// The native chain's sections, when filter `zerolayer` is the native
    /// module (its observer's upstreams are filled in at start).
    native: Option<Json>,
    /// Where Envoy finds the native module, if not this build's.
    native_modules: Option<PathBuf>,
    request: Request,
    expect: Expect,
}

impl Variant {
    /// A variant sending the fixed request to the backend, no observer.
    fn new(key: &'static str, label: &'static str, group: Group, filters: Vec<Yaml>) -> Self {
        Variant {
            key,
            label,
            group,
            filters,
            observer: None,
            native: None,
            native_modules: None,
            request: Request::Plain,
            expect: Expect::Backend,
        }
    }

    fn observer(mut self, config: Json) -> Self {
        self.observer = Some(config);
        self
    }

    /// The native module with `sections` (its only filter).
    fn native(mut self, sections: Json) -> Self {
        self.native = Some(sections);
        self
    }

    /// Envoy finds the native module in `dir` (the probes' build for the
    /// native probes: the shipped module has none).
    fn native_modules(mut self, dir: PathBuf) -> Self {
        self.native_modules = Some(dir);
        self
    }

    fn request(mut self, request: Request) -> Self {
        self.request = request;
        self
    }

    fn expect(mut self, expect: Expect) -> Self {
        self.expect = expect;
        self
    }

    /// The same configuration with the HTTP filters' modules taken from
    /// `dir` (another build's `target/wasm32-wasip1/wasm`, and its
    /// `libzerolayer_native.so` for the native chain), keyed `<key>-base`;
    /// `None` when none of its modules is there.
    fn with_modules_from(&self, dir: &Path) -> Option<Variant> {
        fn swap(value: &mut Yaml, dir: &Path, swapped: &mut bool) {
            match value {
                Yaml::String(path) if path.ends_with(".wasm") => {
                    let name = Path::new(path.as_str()).file_name().unwrap_or_default();
                    let other = dir.join(name);
                    if other.is_file() {
                        *path = other.display().to_string();
                        *swapped = true;
                    }
                }
                Yaml::Sequence(items) => items.iter_mut().for_each(|v| swap(v, dir, swapped)),
                Yaml::Mapping(map) => map.values_mut().for_each(|v| swap(v, dir, swapped)),
                _ => {}
            }
        }
        let mut variant = self.clone();
        let mut swapped = false;
        for filter in &mut variant.filters {
            swap(filter, dir, &mut swapped);
        }
        if variant.native.is_some() && dir.join("libzerolayer_native.so").is_file() {
            variant.native_modules = Some(dir.to_path_buf());
            swapped = true;
        }
        // Keys and labels are 'static for the table and chart; a run makes
        // a handful of these.
        variant.key = Box::leak(format!("{}-base", self.key).into_boxed_str());
        variant.label = Box::leak(format!("{} [baseline modules]", self.label).into_boxed_str());
        swapped.then_some(variant)
    }
}

#[derive(Clone, Copy)]
enum Group {
    Baseline,
    Filter,
    Chain,
    Native,
}

impl Group {
    fn colour(self) -> &'static str {
        match self {
            Group::Baseline => "#9aa5b1",
            Group::Filter => "#3b82c4",
            Group::Chain => "#1d3f72",
            Group::Native => "#d9822b",
        }
    }
}

/// One wrk run, with Envoy's CPU time over it.
#[derive(Clone, Debug, serde::Serialize)]
struct Phase {
    connections: u32,
    requests: u64,
    seconds: f64,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    envoy_cpu_secs: f64,
}

/// A configuration's numbers: medians over rounds, and the rounds.
#[derive(Clone, Debug, serde::Serialize)]
struct Summary {
    key: String,
    label: String,
    /// Loaded phase: requests/s.
    rps: f64,
    /// Loaded phase: Envoy CPU per request, in µs.
    cpu_us_per_request: f64,
    /// Loaded phase: Envoy CPU time / wall time (1.0 = its core busy).
    envoy_core_busy: f64,
    /// Loaded phase latency (mostly queueing at 16 connections).
    loaded_p50_us: f64,
    loaded_p99_us: f64,
    /// One connection: latency without queueing.
    p50_us: f64,
    p99_us: f64,
    /// One connection: Envoy CPU µs per request.
    single_cpu_us_per_request: f64,
    /// Envoy's connection and request counters over the whole run, and
    /// lazy-auth's decisions where it runs.
    counters: Json,
    loaded: Vec<Phase>,
    single: Vec<Phase>,
}

/// How long a run measures.
struct Plan {
    rounds: usize,
    loaded_secs: u64,
    single_secs: u64,
    /// Only these configurations (`ZEROLAYER_LOAD_ONLY=a,e,c-fused`).
    only: Option<Vec<String>>,
    /// Each configuration again with the filter modules of another build
    /// (`ZEROLAYER_LOAD_BASELINE_WASM=<dir>`): before and after a change in
    /// one run, where run-to-run drift would hide it.
    baseline_wasm: Option<PathBuf>,
    /// Count instructions instead of timing (`ZEROLAYER_LOAD_CALLGRIND=<n>`):
    /// each Envoy under callgrind, `n` requests one at a time.
    callgrind_requests: Option<u64>,
}

impl Plan {
    fn from_env() -> Result<Self> {
        let secs = |default| env_number("ZEROLAYER_LOAD_SECS", default);
        Ok(Plan {
            rounds: usize::try_from(env_number("ZEROLAYER_LOAD_ROUNDS", ROUNDS as u64)?)?,
            loaded_secs: secs(LOADED_SECS)?,
            single_secs: secs(SINGLE_SECS)?,
            only: std::env::var("ZEROLAYER_LOAD_ONLY")
                .ok()
                .map(|keys| keys.split(',').map(|k| k.trim().to_string()).collect()),
            baseline_wasm: std::env::var_os("ZEROLAYER_LOAD_BASELINE_WASM").map(PathBuf::from),
            callgrind_requests: match std::env::var("ZEROLAYER_LOAD_CALLGRIND") {
                Err(_) => None,
                Ok(n) => Some(n.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    anyhow!("ZEROLAYER_LOAD_CALLGRIND={n}: not a number of requests")
                })?),
            },
        })
    }

    /// The run BENCHMARKS.md reports, not a shortened one.
    fn complete(&self) -> bool {
        self.rounds == ROUNDS
            && self.loaded_secs == LOADED_SECS
            && self.single_secs == SINGLE_SECS
            && self.only.is_none()
            && self.baseline_wasm.is_none()
            && self.callgrind_requests.is_none()
    }
}

/// The loopback services the filters' observer talks to.
struct Services {
    /// JWKS, introspection (every key inactive), audit sink.
    auth: AuthServices,
    usage: MockServer,
    /// The HTTP authorization service `ext_authz` asks on every request
    /// (what lazy-auth's cached verdict replaces): allows everything.
    authz: MockServer,
    /// Redis behind webdis: quota's leases, granted in the background.
    fleet: RedisFleet,
}

impl Services {
    fn start() -> Result<Self> {
        Ok(Services {
            auth: AuthServices::start(|_| (200, r#"{"active":false}"#.to_string()))?,
            usage: MockServer::start(|_| (200, String::new()))?,
            authz: MockServer::start(|_| (200, String::new()))?,
            fleet: RedisFleet::start_for_quota()?,
        })
    }

    /// Where the native module's observer thread reaches them
    /// (`native.upstreams`).
    fn upstreams(&self) -> Json {
        json!({
            "idp": self.auth.idp.addr().to_string(),
            "api_keys": self.auth.api_keys.addr().to_string(),
            "audit": self.auth.audit.addr().to_string(),
            "clickhouse": self.usage.addr().to_string(),
            "webdis": self.fleet.webdis().to_string(),
        })
    }

    fn point(&self, config: EnvoyConfig) -> Result<EnvoyConfig> {
        self.auth
            .point(config)?
            .point_cluster("clickhouse", self.usage.addr())?
            .add_cluster("ext_authz", self.authz.addr())?
            .add_cluster("webdis", self.fleet.webdis())
    }

    /// What the sinks received: the observer's background work happened.
    fn shipped(&self) -> Json {
        let count = |m: &MockServer| {
            let seen = m.seen();
            let records: usize = seen.iter().map(|r| r.body.lines().count()).sum();
            json!({"batches": seen.len(), "records": records})
        };
        json!({"audit": count(&self.auth.audit), "usage": count(&self.usage)})
    }
}

fn main() -> Result<()> {
    let plan = Plan::from_env()?;
    let wrk = wrk::binary()?;
    let envoy_binary = paths::envoy_binary()?;
    for name in [
        "activation",
        "lazy_auth",
        "post_cache",
        "metering",
        "observer_service",
        "probe",
        "fused",
    ] {
        paths::wasm(name)?;
    }
    let machine = machine(&envoy_binary);
    // Children (the upstream, wrk, Envoy until re-pinned) inherit this
    // process's CPU.
    let pinned = pin_self(CLIENT_CPU);
    if !pinned {
        eprintln!("note: not pinned to CPUs (needs 2 CPUs and taskset); numbers are noisier");
    }

    let dir = tempfile::tempdir()?;
    let shipped = Shipped::load(dir.path())?;
    let mut variants = shipped.variants()?;
    if let Some(only) = &plan.only {
        variants.retain(|v| only.iter().any(|k| k == v.key));
        ensure!(
            !variants.is_empty(),
            "ZEROLAYER_LOAD_ONLY={only:?} names no configuration"
        );
    }
    if let Some(dir) = &plan.baseline_wasm {
        ensure!(
            dir.is_dir(),
            "ZEROLAYER_LOAD_BASELINE_WASM={}: not a directory",
            dir.display()
        );
        // Each baseline right after its configuration: Envoys started later
        // measured a few µs cheaper with the very same module.
        let mut paired = Vec::with_capacity(variants.len() * 2);
        for v in variants {
            let baseline = v.with_modules_from(dir);
            paired.push(v);
            paired.extend(baseline);
        }
        variants = paired;
        eprintln!(
            "baseline modules from {}: {}",
            dir.display(),
            variants
                .iter()
                .map(|v| v.key)
                .filter(|k| k.ends_with("-base"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let now = tokens::now();
    let bearer = format!(
        "Bearer {}",
        issuer().rs256(&tokens::claims("bench", TENANT, now, 3600))
    );
    let scripts = [Request::Plain, Request::NoStore]
        .map(|r| write_script(dir.path(), r, &bearer))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let script = |r: Request| &scripts[usize::from(r == Request::NoStore)];
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();

    // The stub answers the bench request once; an upstream Envoy replays
    // that answer under load (see the top of this file).
    let stub = Stub::start(
        StubConfig::default()
            .ttft(Duration::ZERO)
            .itl(Duration::ZERO),
    )?;
    let answer = StubAnswer::capture(&agent, &stub)?;
    let replay = EnvoyConfig::load(&answer.replay_config(dir.path())?)?.for_run(stub.addr())?;
    let replay =
        Envoy::start(&replay).context("starting the upstream Envoy replaying the stub's answer")?;
    let mut upstreams = Vec::new();
    for (name, url) in [
        (
            "GPU backend stub (no delay)",
            format!("http://{}{PATH}", stub.addr()),
        ),
        ("upstream Envoy replaying its answer", replay.url(PATH)),
    ] {
        let loaded = run_wrk(
            &wrk,
            &url,
            script(Request::Plain),
            CONNECTIONS,
            WARM_UP_SECS,
        )?;
        let single = run_wrk(&wrk, &url, script(Request::Plain), 1, WARM_UP_SECS)?;
        eprintln!(
            "{name}, directly: p50 {:.0} µs at 1 connection, {:.0} requests/s at {CONNECTIONS}",
            single.p50_us, loaded.rps
        );
        upstreams.push(json!({"upstream": name, "loaded": loaded, "single": single}));
    }

    let services = Services::start()?;
    let envoy_config = |v: &Variant| -> Result<EnvoyConfig> {
        let config = EnvoyConfig::load(&shipped.write_variant(v)?)?.for_run(replay.listener())?;
        let mut config = services
            .point(config)?
            .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
        if let Some(sections) = &v.native {
            let mut sections = sections.clone();
            sections["native"] = json!({"upstreams": services.upstreams()});
            config.set_native_filter_config("zerolayer", &sections.to_string())?;
        }
        if let Some(dir) = &v.native_modules {
            config = config.env(
                "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
                &dir.display().to_string(),
            );
        }
        Ok(config)
    };
    if let Some(requests) = plan.callgrind_requests {
        return count_instructions(&variants, envoy_config, &agent, &bearer, requests);
    }
    eprintln!("starting {} Envoys (one worker each)", variants.len());
    let mut running = Vec::new();
    for v in &variants {
        let envoy =
            Envoy::start(&envoy_config(v)?).with_context(|| format!("starting {}", v.label))?;
        let pid = envoy.pid();
        ensure!(
            !pinned || pin(pid, ENVOY_CPU),
            "could not pin Envoy {pid} to CPU {ENVOY_CPU}"
        );
        check(&agent, &envoy, v, &bearer, CHECK_PATIENCE)
            .with_context(|| format!("checking {}", v.label))?;
        run_wrk(
            &wrk,
            &envoy.url(PATH),
            script(v.request),
            CONNECTIONS,
            WARM_UP_SECS,
        )
        .with_context(|| format!("warming up {}", v.label))?;
        running.push((envoy, pid));
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
        for i in (0..variants.len()).map(|i| (i + round) % variants.len()) {
            let (v, (envoy, pid)) = (&variants[i], &running[i]);
            for (connections, secs, out) in [
                (CONNECTIONS, plan.loaded_secs, &mut loaded[i]),
                (1, plan.single_secs, &mut single[i]),
            ] {
                let cpu = tree_cpu_secs(*pid)?;
                let mut phase =
                    run_wrk(&wrk, &envoy.url(PATH), script(v.request), connections, secs)
                        .with_context(|| format!("loading {}", v.label))?;
                phase.envoy_cpu_secs = tree_cpu_secs(*pid)? - cpu;
                out.push(phase);
            }
        }
        eprintln!("round {} of {} done", round + 1, plan.rounds);
    }
    let load_after = load_average();
    let sinks = services.shipped();
    // Counters reach Envoy's stats on the filters' tick: read them once
    // they stopped moving.
    wait::settled("the filters' counters", Duration::from_secs(15), || {
        running
            .iter()
            .map(|(envoy, _)| auth_decisions(envoy))
            .collect::<Result<Vec<Json>>>()
    })?;
    let mut counters = Vec::new();
    for (v, (envoy, _)) in variants.iter().zip(&running) {
        let mut c = connection_reuse(&agent, envoy, v).with_context(|| v.label)?;
        c["auth_decisions"] = auth_decisions(envoy).with_context(|| v.label)?;
        counters.push(c);
    }

    let summaries: Vec<Summary> = variants
        .iter()
        .zip(loaded.into_iter().zip(single))
        .zip(counters)
        .map(|((v, (l, s)), counters)| summarize(v, l, s, counters))
        .collect();
    print_table(&summaries);
    let targets = targets(&summaries);
    for line in &targets {
        println!("{line}");
    }
    println!(
        "(Envoy {}, one worker on CPU {ENVOY_CPU}; wrk -t1 -c{CONNECTIONS} {} s and -c1 {} s × {} rounds on CPU {CLIENT_CPU}; load average {load_before} before, {load_after} after)",
        machine["envoy"].as_str().unwrap_or("?"),
        plan.loaded_secs,
        plan.single_secs,
        plan.rounds
    );
    println!(
        "(the observers shipped {} audit records in {} batches and {} sampled usage records in {} batches)",
        sinks["audit"]["records"],
        sinks["audit"]["batches"],
        sinks["usage"]["records"],
        sinks["usage"]["batches"]
    );

    let report = json!({
        "machine": machine,
        "method": {
            "envoy_concurrency": 1,
            "pinned": pinned,
            "envoy_cpu": ENVOY_CPU,
            "client_cpu": CLIENT_CPU,
            "wrk": format!(
                "wrk -t1 -c{CONNECTIONS} -d{}s --latency, then wrk -t1 -c1 -d{}s --latency",
                plan.loaded_secs, plan.single_secs
            ),
            "rounds": plan.rounds,
            "warm_up_secs": WARM_UP_SECS,
            "request": {"method": "POST", "path": PATH, "body": BODY, "tenant": TENANT, "credential": "Bearer JWT (RS256)"},
            "backend": "the answer of zerolayer-stub (no delay) to the request, replayed by an upstream Envoy (direct_response)",
            "upstreams_alone": upstreams,
            "sinks": sinks,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "complete": plan.complete(),
        },
        "results": summaries,
        "targets": targets,
    });
    let out_dir = paths::root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let json_path = out_dir.join("envoy_load.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    let svg_path = out_dir.join("envoy_load.svg");
    let svg = chart(&variants, &summaries, &machine, &load_before);
    std::fs::write(&svg_path, svg)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    if plan.complete() {
        let docs = paths::root().join("docs/envoy_load.svg");
        std::fs::create_dir_all(paths::root().join("docs"))?;
        std::fs::copy(&svg_path, &docs)?;
        println!("copied the chart to {}", docs.display());
    } else {
        println!("(a shortened run: docs/envoy_load.svg left as it was)");
    }
    Ok(())
}

/// The design targets as ratios within this run (Envoy CPU per request
/// above plain Envoy's = a configuration's overhead).
fn targets(summaries: &[Summary]) -> Vec<String> {
    let get = |key: &str| summaries.iter().find(|s| s.key == key);
    let (Some(plain), Some(trivial1), Some(trivial4)) = (get("a"), get("e"), get("f")) else {
        return vec!["targets: baselines missing".into()];
    };
    let overhead = |s: &Summary| s.cpu_us_per_request - plain.cpu_us_per_request;
    let mut lines = Vec::new();
    let mut check = |what: &str, value: f64, want: &str, ok: bool| {
        lines.push(format!(
            "target {what}: {value:.2} (want {want}) {}",
            if ok { "met" } else { "MISSED" }
        ));
    };
    if let Some(fused) = get("c-fused") {
        let r = overhead(fused) / overhead(trivial1);
        check("fused overhead / 1 trivial filter's", r, "≤ 2", r <= 2.0);
        let r = fused.rps / plain.rps;
        check("fused throughput / plain Envoy's", r, "≥ 0.80", r >= 0.80);
        if let Some(chain) = get("c") {
            let r = overhead(fused) / overhead(chain);
            check("fused overhead / separate chain's", r, "< 1", r < 1.0);
        }
    }
    if let (Some(fused), Some(probe)) = (get("c-fused"), get("p")) {
        // The probe makes the host calls the chain needs, with no logic:
        // the floor of what the chain must ask its host.
        let r = overhead(fused) / overhead(probe);
        check(
            "fused overhead / Wasm chain-like probe's",
            r,
            "≤ 1.5",
            r <= 1.5,
        );
    }
    if let Some(native) = get("c-native") {
        let r = native.rps / plain.rps;
        check(
            "native chain throughput / plain Envoy's",
            r,
            "≥ 0.85",
            r >= 0.85,
        );
        let r = native.cpu_us_per_request / plain.cpu_us_per_request;
        check(
            "native chain CPU per request / plain Envoy's",
            r,
            "≤ 1.15",
            r <= 1.15,
        );
        if let Some(probe) = get("p-native") {
            let r = overhead(native) / overhead(probe);
            check(
                "native chain overhead / native chain-like probe's",
                r,
                "≤ 2",
                r <= 2.0,
            );
        }
    }
    if let Some(hit) = get("c-native-hit") {
        let r = hit.cpu_us_per_request / plain.cpu_us_per_request;
        check(
            "native hit CPU per request / plain proxying's",
            r,
            "< 1",
            r < 1.0,
        );
    }
    // quota's eight policies: reserve, settle, eight leases per request
    // (issue 30's targets).
    for (with_key, without_key, want) in [
        ("c-fused-quota", "c-fused", 10.0),
        ("c-native-quota", "c-native", 2.0),
    ] {
        if let (Some(with), Some(without)) = (get(with_key), get(without_key)) {
            let added = with.cpu_us_per_request - without.cpu_us_per_request;
            check(
                &format!(
                    "quota (8 policies) CPU added per request, {with_key} - {without_key}, µs"
                ),
                added,
                &format!("≤ {want}"),
                added <= want,
            );
        }
    }
    let mut notes = Vec::new();
    if let (Some(native), Some(wasm)) = (get("p-native"), get("p")) {
        notes.push(format!(
            "measured: the chain's host calls (chain-like probe), native / Wasm overhead: {:.2} ({:.1} / {:.1} µs CPU per request)",
            overhead(native) / overhead(wasm),
            overhead(native),
            overhead(wasm)
        ));
    }
    if let Some(chain) = get("c") {
        let r = overhead(chain) / overhead(trivial4);
        check(
            "separate chain overhead / 4 trivial filters'",
            r,
            "≤ 1.25",
            r <= 1.25,
        );
    }
    if let (Some(lazy), Some(authz)) = (get("b2"), get("g")) {
        let r = overhead(authz) / overhead(lazy);
        check(
            "ext_authz overhead / lazy-auth known token's",
            r,
            "≥ 5",
            r >= 5.0,
        );
    }
    if let (Some(lazy), Some(jwt)) = (get("b2"), get("d")) {
        let r = overhead(jwt) / overhead(lazy);
        check(
            "jwt_authn overhead / lazy-auth known token's",
            r,
            "> 1",
            r > 1.0,
        );
    }
    // What each stage adds inside the fused filter, over the one before.
    let steps = ["e", "c-fused-1", "c-fused-2", "c-fused-3", "c-fused"];
    let found: Vec<_> = steps.iter().filter_map(|k| get(k)).collect();
    if found.len() == steps.len() {
        let parts: Vec<String> = found
            .windows(2)
            .zip(["lazy-auth", "+ activation", "+ post-cache", "+ metering"])
            .map(|(w, stage)| format!("{stage} {:+.1} µs", overhead(w[1]) - overhead(w[0])))
            .collect();
        lines.push(format!(
            "measured: inside the fused filter, over one trivial filter: {}",
            parts.join(", ")
        ));
    }
    if let (Some(one_vm), Some(chain)) = (get("c-one-vm"), get("c")) {
        lines.push(format!(
            "measured: separate chain in one VM / in four VMs, overhead {:.2}",
            overhead(one_vm) / overhead(chain)
        ));
    }
    lines.extend(notes);
    lines
}

/// The stub's answer to the bench request.
struct StubAnswer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl StubAnswer {
    fn capture(agent: &ureq::Agent, stub: &Stub) -> Result<Self> {
        let mut reply = agent
            .post(format!("http://{}{PATH}", stub.addr()))
            .header("content-type", "application/json")
            .send(BODY)?;
        let status = reply.status().as_u16();
        ensure!(
            status == 200,
            "the stub answered the bench request with {status}"
        );
        let headers = ["content-type", "cache-control"]
            .into_iter()
            .filter_map(|name| {
                let value = reply.headers().get(name)?.to_str().ok()?;
                Some((name.to_string(), value.to_string()))
            })
            .collect();
        let body = reply.body_mut().read_to_string()?;
        ensure!(
            body.contains("\"usage\""),
            "the stub's answer has no usage: {body}"
        );
        Ok(StubAnswer {
            status,
            headers,
            body,
        })
    }

    /// An Envoy bootstrap answering every request with this answer.
    fn replay_config(&self, dir: &Path) -> Result<PathBuf> {
        let headers: Vec<Json> = self
            .headers
            .iter()
            .map(|(k, v)| {
                json!({"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
            })
            .collect();
        let doc = json!({
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {
                "listeners": [{
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{"filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "replay",
                            "route_config": {"virtual_hosts": [{
                                "name": "all",
                                "domains": ["*"],
                                "routes": [{
                                    "match": {"prefix": "/"},
                                    "direct_response": {"status": self.status, "body": {"inline_string": self.body}},
                                    "response_headers_to_add": headers,
                                }],
                            }]},
                            // The answer leaves once the request body is
                            // in: answering earlier makes Envoy close the
                            // connection, and every request would pay a
                            // new upstream connection.
                            "http_filters": [{
                                "name": "envoy.filters.http.buffer",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                                    "max_request_bytes": 1_048_576,
                                },
                            }, {
                                "name": "envoy.filters.http.router",
                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                            }],
                        },
                    }]}],
                }],
                "clusters": [],
            },
        });
        let path = dir.join("replay.yaml");
        std::fs::write(&path, serde_yaml::to_string(&doc)?)?;
        Ok(path)
    }
}

/// The shipped bootstrap, adapted once for the run, from which every
/// variant takes its listener, clusters and filters.
struct Shipped {
    doc: Yaml,
    dir: PathBuf,
    activation: Json,
    lazy_auth: Json,
    post_cache: Json,
    metering: Json,
}

impl Shipped {
    fn load(dir: &Path) -> Result<Self> {
        let mut config = EnvoyConfig::shipped("zerolayer.yaml")?;
        // The test identity provider's issuer; verdicts and cache entries
        // that outlive the run (no expiry, so no re-verification, mid-run).
        let mut lazy_auth: Json =
            serde_json::from_str(&config.wasm_filter_config("zerolayer.lazy_auth")?)?;
        lazy_auth["jwt"]["issuers"] = json!(["https://idp.test"]);
        lazy_auth["verdict_max_ttl_secs"] = json!(3600);
        config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy_auth.to_string())?;
        let mut post_cache: Json =
            serde_json::from_str(&config.wasm_filter_config("zerolayer.post_cache")?)?;
        post_cache["ttl"]["default_ttl_secs"] = json!(3600);
        config.set_wasm_filter_config("zerolayer.post_cache", &post_cache.to_string())?;
        let metering: Json =
            serde_json::from_str(&config.wasm_filter_config("zerolayer.metering")?)?;
        let activation: Json =
            serde_json::from_str(&config.wasm_filter_config("zerolayer.activation")?)?;
        let path = config.write(dir)?;
        let doc = serde_yaml::from_str(&std::fs::read_to_string(&path)?)?;
        Ok(Shipped {
            doc,
            dir: dir.to_path_buf(),
            activation,
            lazy_auth,
            post_cache,
            metering,
        })
    }

    fn http_filters(doc: &mut Yaml) -> Result<&mut Vec<Yaml>> {
        doc.get_mut("static_resources")
            .and_then(|v| v.get_mut("listeners"))
            .and_then(|v| v.get_mut(0))
            .and_then(|v| v.get_mut("filter_chains"))
            .and_then(|v| v.get_mut(0))
            .and_then(|v| v.get_mut("filters"))
            .and_then(|v| v.get_mut(0))
            .and_then(|v| v.get_mut("typed_config"))
            .and_then(|v| v.get_mut("http_filters"))
            .and_then(Yaml::as_sequence_mut)
            .ok_or_else(|| anyhow!("envoy/zerolayer.yaml: no http_filters in the first listener"))
    }

    /// The shipped filter `name`, optionally with another configuration.
    fn filter(&self, name: &str, config: Option<&Json>) -> Result<Yaml> {
        let mut doc = self.doc.clone();
        let mut filter = Self::http_filters(&mut doc)?
            .iter()
            .find(|f| f.get("name").and_then(Yaml::as_str) == Some(name))
            .cloned()
            .ok_or_else(|| anyhow!("envoy/zerolayer.yaml: no HTTP filter {name}"))?;
        if let Some(config) = config {
            let value = filter
                .get_mut("typed_config")
                .and_then(|v| v.get_mut("config"))
                .and_then(|v| v.get_mut("configuration"))
                .and_then(|v| v.get_mut("value"))
                .ok_or_else(|| anyhow!("{name}: no configuration value"))?;
            *value = Yaml::from(config.to_string());
        }
        Ok(filter)
    }

    /// The fused filter with the same stage configurations as the chain:
    /// lazy-auth's filter entry (the observer's VM) carrying the fused
    /// module, every section, and post-cache's settings.
    fn fused(&self) -> Result<Yaml> {
        self.fused_stages(FUSED_STAGES.len())
    }

    /// The fused filter with `quota` as its `quota` section (eight
    /// policies: [`common::quota_section`]) after the shipped four.
    fn fused_with(&self, quota: Json) -> Result<Yaml> {
        let mut filter = self.fused()?;
        let value = filter
            .get_mut("typed_config")
            .and_then(|v| v.get_mut("config"))
            .and_then(|v| v.get_mut("configuration"))
            .and_then(|v| v.get_mut("value"))
            .ok_or_else(|| anyhow!("fused: no configuration value"))?;
        let mut sections: Json = serde_json::from_str(value.as_str().unwrap_or("{}"))?;
        sections["quota"] = quota;
        *value = Yaml::from(sections.to_string());
        Ok(filter)
    }

    /// The four stages' sections, as the fused filter and the native module
    /// take them.
    fn sections(&self) -> Json {
        json!({
            "lazy_auth": self.lazy_auth,
            "activation": self.activation,
            "post_cache": self.post_cache,
            "metering": self.metering,
        })
    }

    /// [`Shipped::sections`] with `quota` as the `quota` section.
    fn sections_with(&self, quota: Json) -> Json {
        let mut sections = self.sections();
        sections["quota"] = quota;
        sections
    }

    /// [`Shipped::sections`] with activation's default `audit` off.
    fn sections_without_audit(&self) -> Json {
        let mut sections = self.sections();
        sections["activation"]["defaults"] = json!([]);
        sections
    }

    /// The native module's chain (`filter_name: zerolayer`); its sections
    /// come with the variant ([`Variant::native`]).
    fn native_chain(&self) -> Result<Yaml> {
        paths::native_module()?;
        Ok(serde_yaml::to_value(json!({
            "name": "zerolayer",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                "dynamic_module_config": {"name": "zerolayer_native", "do_not_close": true},
                "filter_name": "zerolayer",
                "filter_config": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": "{}",
                },
            },
        }))?)
    }

    /// The fused filter with only the first `n` stages (sections left out
    /// are stages left out): what each stage adds inside one instance.
    fn fused_stages(&self, n: usize) -> Result<Yaml> {
        let mut filter = self.filter("zerolayer.lazy_auth", None)?;
        let config = filter
            .get_mut("typed_config")
            .and_then(|v| v.get_mut("config"))
            .ok_or_else(|| anyhow!("lazy-auth: no Wasm config"))?;
        let all = [
            &self.lazy_auth,
            &self.activation,
            &self.post_cache,
            &self.metering,
        ];
        let sections: serde_json::Map<String, Json> = FUSED_STAGES
            .iter()
            .zip(all)
            .take(n)
            .map(|(name, config)| (name.to_string(), config.clone()))
            .collect();
        let sections = Json::Object(sections);
        let wasm = paths::wasm("fused")?.display().to_string();
        let patch: Yaml = serde_yaml::to_value(json!({
            "name": "zerolayer",
            "root_id": "zerolayer",
            "allow_on_headers_stop_iteration": true,
            "vm_config": {
                "vm_id": "zerolayer",
                "runtime": "envoy.wasm.runtime.v8",
                "environment_variables": {"host_env_keys": ["ZEROLAYER_CACHE_SECRET"]},
                "code": {"local": {"filename": wasm}},
            },
            "configuration": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": sections.to_string(),
            },
        }))?;
        *config = patch;
        if let Some(map) = filter.as_mapping_mut() {
            map.insert(Yaml::from("name"), Yaml::from("zerolayer"));
        }
        Ok(filter)
    }

    fn observer(&self, lazy_auth: bool, metering: bool) -> Json {
        let mut config = json!({"tick_ms": 200});
        if lazy_auth {
            config["lazy_auth"] = self.lazy_auth.clone();
        }
        if metering {
            config["metering"] = self.metering.clone();
        }
        config
    }

    fn variants(&self) -> Result<Vec<Variant>> {
        use Group::{Baseline, Chain, Filter, Native};
        let chain = [
            "zerolayer.lazy_auth",
            "zerolayer.activation",
            "zerolayer.post_cache",
            "zerolayer.metering",
        ]
        .into_iter()
        .map(|name| self.filter(name, None))
        .collect::<Result<Vec<_>>>()?;
        // The shipped chain audits every request (activation's defaults):
        // the same chain without, to show what that costs.
        let mut no_audit = self.activation.clone();
        no_audit["defaults"] = json!([]);
        let mut chain_no_audit = chain.clone();
        chain_no_audit[1] = self.filter("zerolayer.activation", Some(&no_audit))?;
        // Alone, post-cache has no verified tenant to key by: the shared
        // namespace, so it serves hits (its hit path is what is measured).
        let mut shared = self.post_cache.clone();
        shared["namespace"] = json!("shared");
        let one = |name| self.filter(name, None).map(|f| vec![f]);
        // The same four filters sharing the observer's VM.
        let chain_one_vm = chain
            .iter()
            .cloned()
            .map(|mut f| {
                let vm_id = f
                    .get_mut("typed_config")
                    .and_then(|v| v.get_mut("config"))
                    .and_then(|v| v.get_mut("vm_config"))
                    .and_then(|v| v.get_mut("vm_id"))
                    .ok_or_else(|| anyhow!("a chain filter without vm_config.vm_id"))?;
                *vm_id = Yaml::from("zerolayer");
                Ok(f)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(vec![
            Variant::new("a", "plain Envoy (no HTTP filters)", Baseline, vec![]),
            Variant::new(
                "b1",
                "activation alone",
                Filter,
                one("zerolayer.activation")?,
            ),
            Variant::new(
                "b2",
                "lazy-auth alone (known RS256 JWT) + observer",
                Filter,
                one("zerolayer.lazy_auth")?,
            )
            .observer(self.observer(true, false)),
            Variant::new(
                "b3",
                "post-cache alone (hit)",
                Filter,
                vec![self.filter("zerolayer.post_cache", Some(&shared))?],
            )
            .expect(Expect::CacheHit),
            Variant::new(
                "b4",
                "metering alone (1% sampled) + observer",
                Filter,
                one("zerolayer.metering")?,
            )
            .observer(self.observer(false, true)),
            Variant::new(
                "c",
                "full chain + observer, to the backend (no-store)",
                Chain,
                chain.clone(),
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            Variant::new(
                "c-no-audit",
                "full chain + observer, audit off, to the backend",
                Chain,
                chain_no_audit,
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            Variant::new("c-hit", "full chain + observer, cache hit", Chain, chain)
                .observer(self.observer(true, true))
                .expect(Expect::CacheHit),
            Variant::new(
                "d",
                "jwt_authn RS256 (native, every request)",
                Native,
                vec![jwt_authn(false)?],
            ),
            Variant::new(
                "d-cache",
                "jwt_authn RS256 + its JWT cache (native)",
                Native,
                vec![jwt_authn(true)?],
            ),
            Variant::new(
                "g",
                "ext_authz calling an HTTP API-key service (native)",
                Native,
                vec![ext_authz()?],
            ),
            Variant::new(
                "c-fused",
                "fused filter + observer, to the backend (no-store)",
                Chain,
                vec![self.fused()?],
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            Variant::new(
                "c-fused-quota",
                "fused filter + quota (8 policies) + observer, to the backend",
                Chain,
                vec![self.fused_with(common::quota_section())?],
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            Variant::new(
                "c-fused-quota-no-headers",
                "fused filter + quota (8 policies, rate_limit_headers off) + observer",
                Chain,
                vec![self.fused_with(quota_without_headers())?],
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            // The fused filter stage by stage (what each adds inside one
            // instance): lazy-auth; + activation; + post-cache (bypassed:
            // no-store). All four is c-fused.
            Variant::new(
                "c-fused-1",
                "fused filter, lazy-auth only, + observer",
                Chain,
                vec![self.fused_stages(1)?],
            )
            .observer(self.observer(true, false))
            .request(Request::NoStore),
            Variant::new(
                "c-fused-2",
                "fused filter, lazy-auth + activation, + observer",
                Chain,
                vec![self.fused_stages(2)?],
            )
            .observer(self.observer(true, false))
            .request(Request::NoStore),
            Variant::new(
                "c-fused-3",
                "fused filter, + post-cache (bypassed), + observer",
                Chain,
                vec![self.fused_stages(3)?],
            )
            .observer(self.observer(true, false))
            .request(Request::NoStore),
            Variant::new(
                "c-fused-hit",
                "fused filter + observer, cache hit",
                Chain,
                vec![self.fused()?],
            )
            .observer(self.observer(true, true))
            .expect(Expect::CacheHit),
            Variant::new(
                "c-native",
                "native chain (dynamic module), to the backend (no-store)",
                Chain,
                vec![self.native_chain()?],
            )
            .native(self.sections())
            .request(Request::NoStore),
            Variant::new(
                "c-native-quota",
                "native chain + quota (8 policies), to the backend",
                Chain,
                vec![self.native_chain()?],
            )
            .native(self.sections_with(common::quota_section()))
            .request(Request::NoStore),
            Variant::new(
                "c-native-quota-no-headers",
                "native chain + quota (8 policies, rate_limit_headers off)",
                Chain,
                vec![self.native_chain()?],
            )
            .native(self.sections_with(quota_without_headers()))
            .request(Request::NoStore),
            Variant::new(
                "c-native-no-audit",
                "native chain, audit off, to the backend",
                Chain,
                vec![self.native_chain()?],
            )
            .native(self.sections_without_audit())
            .request(Request::NoStore),
            Variant::new(
                "c-native-hit",
                "native chain (dynamic module), cache hit",
                Chain,
                vec![self.native_chain()?],
            )
            .native(self.sections())
            .expect(Expect::CacheHit),
            Variant::new(
                "c-one-vm",
                "full chain, the four filters in one VM (vm_id), to the backend",
                Chain,
                chain_one_vm,
            )
            .observer(self.observer(true, true))
            .request(Request::NoStore),
            Variant::new("e", "1 trivial Wasm filter", Baseline, vec![trivial(1)?]),
            Variant::new(
                "e-native",
                "1 trivial native filter (dynamic module)",
                Baseline,
                vec![probes::native("probe_trivial")?],
            )
            .native_modules(paths::native_probe_modules()?),
            Variant::new(
                "p",
                "chain-like probe, Wasm (the chain's host calls, no logic)",
                Baseline,
                vec![probes::wasm("probe.chain", "chain")?],
            ),
            Variant::new(
                "p-native",
                "chain-like probe, native (dynamic module)",
                Baseline,
                vec![probes::native("probe_chain")?],
            )
            .native_modules(paths::native_probe_modules()?),
            Variant::new(
                "f",
                "4 trivial Wasm filters (4 VMs)",
                Baseline,
                (1..=4).map(trivial).collect::<Result<_>>()?,
            ),
        ])
    }

    /// Writes `variant`'s bootstrap: the shipped one with its filters before
    /// the router and its observer (or none).
    fn write_variant(&self, variant: &Variant) -> Result<PathBuf> {
        let mut doc = self.doc.clone();
        let filters = Self::http_filters(&mut doc)?;
        let router = filters
            .last()
            .cloned()
            .ok_or_else(|| anyhow!("envoy/zerolayer.yaml: no router"))?;
        *filters = variant.filters.clone();
        filters.push(router);
        let map = doc
            .as_mapping_mut()
            .ok_or_else(|| anyhow!("envoy/zerolayer.yaml is not a map"))?;
        match &variant.observer {
            None => {
                map.remove("bootstrap_extensions");
            }
            Some(config) => {
                let value = map
                    .get_mut("bootstrap_extensions")
                    .and_then(|v| v.get_mut(0))
                    .and_then(|v| v.get_mut("typed_config"))
                    .and_then(|v| v.get_mut("config"))
                    .and_then(|v| v.get_mut("configuration"))
                    .and_then(|v| v.get_mut("value"))
                    .ok_or_else(|| anyhow!("envoy/zerolayer.yaml: no observer service"))?;
                *value = Yaml::from(config.to_string());
            }
        }
        let path = self.dir.join(format!("load-{}.yaml", variant.key));
        std::fs::write(&path, serde_yaml::to_string(&doc)?)?;
        Ok(path)
    }
}

/// Envoy's `jwt_authn` verifying the test issuer's RS256 tokens against its
/// JWKS inline (as in the `envoy_auth` bench); `cache` turns on its JWT cache.
fn jwt_authn(cache: bool) -> Result<Yaml> {
    let mut provider = json!({
        "issuer": "https://idp.test",
        "audiences": ["zerolayer"],
        "forward": true,
        "local_jwks": {"inline_string": issuer().jwks().to_string()},
    });
    if cache {
        provider["jwt_cache_config"] = json!({"jwt_cache_size": 1000});
    }
    let filter = json!({
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"test": provider},
            "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "test"}}],
        },
    });
    Ok(serde_yaml::to_value(filter)?)
}

/// Envoy's `ext_authz` asking the `ext_authz` cluster over HTTP on every
/// request, forwarding the credential headers.
fn ext_authz() -> Result<Yaml> {
    let filter = json!({
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "transport_api_version": "V3",
            "http_service": {
                "server_uri": {"uri": "http://ext-authz", "cluster": "ext_authz", "timeout": "1s"},
                "authorization_request": {"allowed_headers": {"patterns": [
                    {"exact": "authorization"}, {"exact": "x-api-key"}
                ]}},
            },
        },
    });
    Ok(serde_yaml::to_value(filter)?)
}

/// The eight policies with `rate_limit_headers` off: what quota costs
/// without the six header writes.
fn quota_without_headers() -> Json {
    let mut quota = common::quota_section();
    quota["rate_limit_headers"] = json!(false);
    quota
}

/// Trivial Wasm filter number `n` (the probe's `trivial` role: adds two
/// request headers, nothing else, as in the issue's floor measurement), in
/// its own VM as each zerolayer filter is.
fn trivial(n: usize) -> Result<Yaml> {
    probes::wasm(&format!("trivial{n}"), "trivial")
}

/// Checks that `variant` answers the bench request with 200 (and a cache hit
/// where one is expected), after letting lazy-auth verify the token once.
fn check(
    agent: &ureq::Agent,
    envoy: &Envoy,
    variant: &Variant,
    bearer: &str,
    patience: Duration,
) -> Result<()> {
    let send = || -> Result<(u16, String)> {
        let mut reply = send_bench_request(agent, envoy, variant, bearer)?;
        let mut label = reply
            .headers()
            .get("x-cache")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        if variant.key.contains("quota")
            && [
                "x-ratelimit-remaining-tokens",
                "anthropic-ratelimit-tokens-remaining",
            ]
            .iter()
            .any(|name| reply.headers().contains_key(*name))
        {
            // quota admitted it from its leases, and says what is left.
            label.push_str(" quota");
        }
        let status = reply.status().as_u16();
        let _ = reply.body_mut().read_to_vec()?;
        Ok((status, label))
    };
    let (status, _) = send()?;
    ensure!(status == 200, "the first request answered {status}");
    // The observer verifies the token in the background; post-cache stores
    // the response once it completed.
    let expected = if variant.expect == Expect::CacheHit {
        "x-cache: HIT"
    } else {
        "no cache hit"
    };
    wait::until(expected, patience, || {
        let (status, label) = send()?;
        if status == 503 {
            // "Retry later": lazy-auth's verification still pending while
            // the token's exposure budget is spent (25 Envoys starting on
            // two cores delay the observers' first callouts).
            return Ok(None);
        }
        ensure!(status == 200, "answered {status}");
        // Once the token is verified (before, lazily admitted, it is
        // nobody's: no policy scopes it), quota reserves every request and
        // answers with the rate-limit headers.
        // (Without the headers, nothing shows it: the warm-up that follows
        // outlasts the verification.)
        let quota = !variant.key.contains("quota")
            || variant.key.ends_with("-no-headers")
            || label.ends_with(" quota");
        Ok(match variant.expect {
            Expect::CacheHit => label == "HIT",
            Expect::Backend => !label.starts_with("HIT") && quota,
        }
        .then_some(()))
    })
}

/// Sends the bench request to `envoy` as `variant` wants it (the body not
/// read yet).
fn send_bench_request(
    agent: &ureq::Agent,
    envoy: &Envoy,
    variant: &Variant,
    bearer: &str,
) -> Result<ureq::http::Response<ureq::Body>> {
    let mut request = agent
        .post(envoy.url(PATH))
        .header("content-type", "application/json")
        .header("authorization", bearer)
        .header("x-tenant-id", TENANT);
    if variant.request == Request::NoStore {
        request = request.header("cache-control", "no-store");
    }
    Ok(request.send(BODY)?)
}

/// Requests before callgrind starts counting: caches, leases and pools warm.
const CALLGRIND_WARM_UP: u64 = 200;

/// `ZEROLAYER_LOAD_CALLGRIND=<n>`: each configuration's Envoy in turn under
/// callgrind, counting only `n` bench requests sent one at a time after a
/// warm-up: instructions per request, every thread and the busiest one (the
/// worker, where the request path runs). Instructions do not move between
/// runs as CPU time on a shared VM does (by several µs per request), so two
/// configurations differ by what their filters make Envoy do.
fn count_instructions(
    variants: &[Variant],
    envoy_config: impl Fn(&Variant) -> Result<EnvoyConfig>,
    agent: &ureq::Agent,
    bearer: &str,
    requests: u64,
) -> Result<()> {
    let callgrind_control = |args: &[&str]| -> Result<()> {
        let output = Command::new("callgrind_control")
            .args(args)
            .output()
            .context("running callgrind_control (valgrind, installed by `cargo xtask setup`)")?;
        ensure!(
            output.status.success() && output.stdout.ends_with(b"OK.\n"),
            "callgrind_control {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    };
    let mut rows: Vec<(&Variant, Threads)> = Vec::new();
    for v in variants {
        let dir = paths::root().join("target/tmp/callgrind-envoy").join(v.key);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let out_file = format!("--callgrind-out-file={}/callgrind.out", dir.display());
        let config = envoy_config(v)?.wrapped(
            "valgrind",
            &[
                "--tool=callgrind",
                // `.venv/bin/envoy` is the wheel's launcher, which execs Envoy.
                "--trace-children=yes",
                "--instr-atstart=no",
                "--separate-threads=yes",
                &out_file,
            ],
        );
        eprintln!("{}: starting Envoy under callgrind", v.key);
        let envoy = Envoy::start(&config).with_context(|| format!("starting {}", v.label))?;
        check(agent, &envoy, v, bearer, Duration::from_secs(180))
            .with_context(|| format!("checking {}", v.label))?;
        let send_all = |n: u64| -> Result<()> {
            for _ in 0..n {
                let mut reply = send_bench_request(agent, &envoy, v, bearer)?;
                let status = reply.status().as_u16();
                reply.body_mut().read_to_vec()?;
                ensure!(status == 200, "{} answered {status}", v.key);
            }
            Ok(())
        };
        send_all(CALLGRIND_WARM_UP)?;
        let pid = envoy.pid().to_string();
        callgrind_control(&["--instr=on", &pid])?;
        send_all(requests)?;
        callgrind_control(&["--dump", &pid])?;
        let threads = wait::until("callgrind's dump", Duration::from_secs(60), || {
            Ok(Threads::read(&dir).ok())
        })?;
        eprintln!(
            "{}: {:.0} instructions per request ({:.0} on the worker)",
            v.key,
            threads.total as f64 / requests as f64,
            threads.busiest as f64 / requests as f64
        );
        rows.push((v, threads));
    }
    println!(
        "{:<16} {:>14} {:>14} {:>10}  configuration",
        "key", "instr/request", "worker", "threads"
    );
    for (v, t) in &rows {
        println!(
            "{:<16} {:>14.0} {:>14.0} {:>10}  {}",
            v.key,
            t.total as f64 / requests as f64,
            t.busiest as f64 / requests as f64,
            t.count,
            v.label
        );
    }
    for (with_key, without_key) in [
        ("c-fused-quota", "c-fused"),
        ("c-fused-quota-no-headers", "c-fused"),
        ("c-native-quota", "c-native"),
        ("c-native-quota-no-headers", "c-native"),
    ] {
        let per = |key: &str| {
            rows.iter().find(|(v, _)| v.key == key).map(|(_, t)| {
                (
                    t.total as f64 / requests as f64,
                    t.busiest as f64 / requests as f64,
                )
            })
        };
        if let (Some(with), Some(without)) = (per(with_key), per(without_key)) {
            println!(
                "quota (8 policies) adds {:.0} instructions per request ({:.0} on the worker): {with_key} - {without_key}",
                with.0 - without.0,
                with.1 - without.1
            );
        }
    }
    println!(
        "({requests} requests one at a time after {CALLGRIND_WARM_UP} not counted; callgrind's files in target/tmp/callgrind-envoy/<key>/, for callgrind_annotate)"
    );
    Ok(())
}

/// Instructions callgrind counted in one dump, over the process's threads.
struct Threads {
    total: u64,
    busiest: u64,
    count: usize,
}

impl Threads {
    /// Reads the `totals:` line of each thread's file of the first dump
    /// (`callgrind.out.1-NN`).
    fn read(dir: &Path) -> Result<Self> {
        let mut counts = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            if !name.is_some_and(|n| n.starts_with("callgrind.out.1-")) {
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            let total = text
                .lines()
                .find_map(|l| {
                    l.strip_prefix("totals:")
                        .or_else(|| l.strip_prefix("summary:"))
                })
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .ok_or_else(|| anyhow!("{}: no totals line", path.display()))?;
            counts.push(total);
        }
        ensure!(
            !counts.is_empty(),
            "callgrind dumped nothing in {}",
            dir.display()
        );
        Ok(Threads {
            total: counts.iter().sum(),
            busiest: counts.iter().copied().max().unwrap_or(0),
            count: counts.len(),
        })
    }
}

/// Envoy's downstream and upstream connection and request counters; fails
/// when connections were not reused (each request paying a new connection
/// would measure TCP set-up, not the filters).
fn connection_reuse(agent: &ureq::Agent, envoy: &Envoy, variant: &Variant) -> Result<Json> {
    let text = agent
        .get(envoy.admin_url("/stats"))
        .call()?
        .body_mut()
        .read_to_string()?;
    let counter = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    let reuse = json!({
        "downstream_connections": counter("http.llm_gateway.downstream_cx_total"),
        "downstream_requests": counter("http.llm_gateway.downstream_rq_total"),
        "upstream_connections": counter("cluster.llm_backend.upstream_cx_total"),
        "upstream_requests": counter("cluster.llm_backend.upstream_rq_total"),
    });
    let mut pairs = vec![(
        "downstream",
        "downstream_connections",
        "downstream_requests",
    )];
    if variant.expect == Expect::Backend {
        pairs.push(("upstream", "upstream_connections", "upstream_requests"));
    }
    for (side, connections, requests) in pairs {
        let (cx, rq) = (
            reuse[connections].as_u64().unwrap_or(0),
            reuse[requests].as_u64().unwrap_or(0),
        );
        ensure!(
            rq >= 100 * cx.max(1),
            "{side} connections were not reused: {rq} requests over {cx} connections"
        );
    }
    Ok(reuse)
}

/// lazy-auth's decisions by outcome (`null` where it does not run); fails
/// unless nearly all came from the cached verdict (the known-token path
/// this run means to measure).
fn auth_decisions(envoy: &Envoy) -> Result<Json> {
    let text = envoy.prometheus()?;
    let mut outcomes = serde_json::Map::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("zerolayer_auth_decisions{outcome=\"") else {
            continue;
        };
        if let Some((outcome, value)) = rest.split_once("\"} ")
            && let Ok(value) = value.trim().parse::<f64>()
        {
            outcomes.insert(outcome.to_string(), json!(value));
        }
    }
    if outcomes.is_empty() {
        return Ok(Json::Null);
    }
    let total: f64 = outcomes.values().filter_map(Json::as_f64).sum();
    let cached = outcomes
        .get("valid_cached")
        .and_then(Json::as_f64)
        .unwrap_or(0.0);
    ensure!(
        cached >= 0.99 * total,
        "lazy-auth decided {cached} of {total} requests from a cached verdict: {outcomes:?}"
    );
    Ok(Json::Object(outcomes))
}

/// Writes the wrk script for `request` (POST, JSON body, the bearer token,
/// the tenant header): wrk formats it once and sends the same bytes.
fn write_script(dir: &Path, request: Request, bearer: &str) -> Result<PathBuf> {
    let mut lua = String::new();
    writeln!(lua, "wrk.method = \"POST\"")?;
    writeln!(lua, "wrk.path = \"{PATH}\"")?;
    writeln!(lua, "wrk.body = [==[{BODY}]==]")?;
    writeln!(lua, "wrk.headers[\"content-type\"] = \"application/json\"")?;
    writeln!(lua, "wrk.headers[\"authorization\"] = \"{bearer}\"")?;
    writeln!(lua, "wrk.headers[\"x-tenant-id\"] = \"{TENANT}\"")?;
    if request == Request::NoStore {
        writeln!(lua, "wrk.headers[\"cache-control\"] = \"no-store\"")?;
    }
    let name = match request {
        Request::Plain => "request.lua",
        Request::NoStore => "request-no-store.lua",
    };
    let path = dir.join(name);
    std::fs::write(&path, lua)?;
    Ok(path)
}

/// Runs wrk against `url` and parses its report; fails on any non-2xx/3xx
/// answer or socket error.
fn run_wrk(wrk: &Path, url: &str, script: &Path, connections: u32, secs: u64) -> Result<Phase> {
    let report = wrk::run(wrk, url, script, connections, secs)?;
    ensure!(
        report.non_2xx == 0,
        "{} answers were not 2xx/3xx",
        report.non_2xx
    );
    ensure!(
        report.socket_errors == 0,
        "{} socket errors",
        report.socket_errors
    );
    Ok(Phase {
        connections,
        requests: report.requests,
        seconds: report.seconds,
        rps: report.rps,
        p50_us: report.p50_us,
        p99_us: report.p99_us,
        envoy_cpu_secs: 0.0,
    })
}

/// Each number is the median over rounds (one disturbed round does not
/// move it); the rounds themselves are kept in the JSON.
fn summarize(variant: &Variant, loaded: Vec<Phase>, single: Vec<Phase>, counters: Json) -> Summary {
    let over = |phases: &[Phase], f: fn(&Phase) -> f64| median(phases.iter().map(f).collect());
    let cpu_per_request = |p: &Phase| p.envoy_cpu_secs * 1e6 / p.requests.max(1) as f64;
    Summary {
        key: variant.key.to_string(),
        label: variant.label.to_string(),
        rps: over(&loaded, |p| p.rps),
        cpu_us_per_request: over(&loaded, cpu_per_request),
        envoy_core_busy: over(&loaded, |p| p.envoy_cpu_secs / p.seconds.max(1e-9)),
        loaded_p50_us: over(&loaded, |p| p.p50_us),
        loaded_p99_us: over(&loaded, |p| p.p99_us),
        p50_us: over(&single, |p| p.p50_us),
        p99_us: over(&single, |p| p.p99_us),
        single_cpu_us_per_request: over(&single, cpu_per_request),
        counters,
        loaded,
        single,
    }
}

fn print_table(rows: &[Summary]) {
    let Some(base) = rows.first() else { return };
    println!();
    println!(
        "{:<11} {:<49} │ {:>8} {:>8} {:>8} │ {:>8} {:>6} {:>9} {:>6} {:>5} │ {:>8} {:>8}",
        "",
        "configuration",
        "p50 (1c)",
        "p99 (1c)",
        "+p50",
        "req/s",
        "×(a)",
        "CPU µs/rq",
        "×(a)",
        "busy",
        "p50 16c",
        "p99 16c"
    );
    for r in rows {
        println!(
            "{:<11} {:<49} │ {:>6.0}µs {:>6.0}µs {:>+6.0}µs │ {:>8.0} {:>6.2} {:>9.1} {:>6.2} {:>4.0}% │ {:>6.0}µs {:>6.0}µs",
            r.key,
            r.label,
            r.p50_us,
            r.p99_us,
            r.p50_us - base.p50_us,
            r.rps,
            r.rps / base.rps,
            r.cpu_us_per_request,
            r.cpu_us_per_request / base.cpu_us_per_request,
            r.envoy_core_busy * 100.0,
            r.loaded_p50_us,
            r.loaded_p99_us
        );
    }
}

/// A number the chart shows per configuration.
type Metric = fn(&Summary) -> f64;

/// A horizontal bar chart: Envoy CPU µs per request (loaded) and p50 latency
/// (one connection) per configuration, with plain Envoy's value marked.
fn chart(variants: &[Variant], rows: &[Summary], machine: &Json, load: &str) -> String {
    let (label_w, panel_w, gap, row_h, top) = (390.0, 300.0, 60.0, 24.0, 70.0);
    let width = label_w + 2.0 * panel_w + gap + 40.0;
    let height = top + rows.len() as f64 * row_h + 60.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r##"<rect width="100%" height="100%" fill="#ffffff"/><text x="10" y="22" font-size="15" font-weight="bold">zerolayer in real Envoy (V8): cost per configuration, same run</text>"##
    );
    let _ = writeln!(
        svg,
        r##"<text x="10" y="40" fill="#444">{}; Envoy {} (1 worker); wrk -t1 -c{CONNECTIONS} for CPU, -c1 for p50; load average {}</text>"##,
        escape(machine["cpu"].as_str().unwrap_or("?")),
        escape(machine["envoy"].as_str().unwrap_or("?")),
        escape(load)
    );
    let panels: [(&str, Metric); 2] = [
        ("Envoy CPU µs per request (16 connections)", |r| {
            r.cpu_us_per_request
        }),
        ("p50 latency µs (1 connection)", |r| r.p50_us),
    ];
    for (p, (title, value)) in panels.iter().enumerate() {
        let x0 = label_w + p as f64 * (panel_w + gap);
        let max = rows.iter().map(value).fold(1.0_f64, f64::max) * 1.15;
        let scale = panel_w / max;
        let _ = writeln!(
            svg,
            r#"<text x="{x0}" y="{}" font-weight="bold">{}</text>"#,
            top - 12.0,
            escape(title)
        );
        for (i, r) in rows.iter().enumerate() {
            let y = top + i as f64 * row_h;
            let v = value(r);
            let colour = variants.get(i).map_or("#888888", |v| v.group.colour());
            let _ = writeln!(
                svg,
                r#"<rect x="{x0}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{colour}"/><text x="{:.1}" y="{:.1}">{v:.1}</text>"#,
                y + 3.0,
                (v * scale).max(0.5),
                row_h - 6.0,
                x0 + v * scale + 4.0,
                y + row_h / 2.0 + 4.0
            );
        }
        if let Some(base) = rows.first() {
            let x = x0 + value(base) * scale;
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333" stroke-dasharray="4 3"/>"##,
                top - 4.0,
                top + rows.len() as f64 * row_h
            );
        }
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as f64 * row_h + row_h / 2.0 + 4.0;
        let _ = writeln!(
            svg,
            r#"<text x="10" y="{y:.1}">({}) {}</text>"#,
            escape(&r.key),
            escape(&r.label)
        );
    }
    let legend_y = top + rows.len() as f64 * row_h + 30.0;
    let mut x = 10.0;
    for (name, group) in [
        ("baselines", Group::Baseline),
        ("zerolayer filter alone", Group::Filter),
        ("full chain", Group::Chain),
        ("Envoy native jwt_authn", Group::Native),
    ] {
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{legend_y}">{name}</text>"#,
            legend_y - 10.0,
            group.colour(),
            x + 16.0
        );
        x += 190.0;
    }
    let _ = writeln!(
        svg,
        r##"<text x="{x}" y="{legend_y}" fill="#444">dashed: plain Envoy (a)</text>"##
    );
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// What the numbers were measured on.
fn machine(envoy: &Path) -> Json {
    let cpu = command_output("lscpu", &[])
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("Model name:").map(|m| m.trim().to_string()))
        })
        .unwrap_or_else(|| "?".into());
    let version = Command::new(envoy)
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
    json!({
        "cpus": cpus(),
        "cpu": format!("{} × {cpu}", cpus()),
        "kernel": command_output("uname", &["-r"]).unwrap_or_default(),
        "envoy": version,
        "wrk": wrk_version(),
    })
}

/// wrk's first `-v` line (wrk exits with 1 after printing it).
fn wrk_version() -> String {
    wrk::binary()
        .ok()
        .and_then(|wrk| Command::new(wrk).arg("-v").output().ok())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default()
}

fn env_number(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{name}={v:?} is not a number")),
        Err(_) => Ok(default),
    }
}
