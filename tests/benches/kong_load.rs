//! The chain under load in Kong's real Proxy-Wasm host, ngx_wasm_module,
//! against plain nginx proxying to the same upstream, with the method of
//! `envoy_load`: one nginx worker pinned to CPU 0, wrk and the upstream on
//! CPU 1, `wrk -t1 -c16` loaded phases (requests/s and nginx's CPU per
//! request from `/proc/<pid>/stat`, master and workers) and `-c1` phases
//! (latency), configurations interleaved over rounds, ratios against plain
//! nginx measured in the same run.
//!
//! Configurations: plain nginx (the same generated `nginx.conf`, no filter
//! in the location), `kong/kong.yml` (four filters: quota left out) and
//! `kong/kong-fused.yml` (one, without its quota section), each for a verified JWT with `cache-control: no-store` (the
//! request goes to the backend: activation, the cached verdict, post-cache's
//! bypass, metering of the JSON body) and for a cache hit.
//!
//! `cargo bench -p zerolayer-e2e --bench kong_load` prints the table;
//! `ZEROLAYER_LOAD_SECS` / `ZEROLAYER_LOAD_ROUNDS` shorten it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::json;
use zerolayer_e2e::bench::{median, pin_self, pin_tree, tree_cpu_secs};
use zerolayer_e2e::chain::{AuthServices, CACHE_SECRET, Chain};
use zerolayer_e2e::ngx::{KongConfig, NgxWasm};
use zerolayer_e2e::{MockServer, wait, wrk};
use zerolayer_stub::{Stub, StubConfig};

const NGINX_CPU: u32 = 0;
const CLIENT_CPU: u32 = 1;
const CONNECTIONS: u32 = 16;
const ROUNDS: u64 = 3;
const LOADED_SECS: u64 = 8;
const SINGLE_SECS: u64 = 4;
const PATH: &str = "/v1/messages";
const BODY: &str = r#"{"model":"claude-test","max_tokens":16,"temperature":0,"messages":[{"role":"user","content":"a benchmark request"}]}"#;

/// One configuration: which chain, which request.
#[derive(Clone, Copy)]
struct Variant {
    key: &'static str,
    label: &'static str,
    /// `None`: plain nginx.
    file: Option<&'static str>,
    no_store: bool,
}

const VARIANTS: [Variant; 5] = [
    Variant {
        key: "plain",
        label: "plain nginx proxy",
        file: None,
        no_store: true,
    },
    Variant {
        key: "separate",
        label: "kong.yml, 4 filters, to the backend",
        file: Some("kong.yml"),
        no_store: true,
    },
    Variant {
        key: "fused",
        label: "kong-fused.yml, 1 filter, to the backend",
        file: Some("kong-fused.yml"),
        no_store: true,
    },
    Variant {
        key: "separate-hit",
        label: "kong.yml, cache hit",
        file: Some("kong.yml"),
        no_store: false,
    },
    Variant {
        key: "fused-hit",
        label: "kong-fused.yml, cache hit",
        file: Some("kong-fused.yml"),
        no_store: false,
    },
];

/// One wrk phase and nginx's CPU time over it.
#[derive(Clone, Copy, Default)]
struct Phase {
    requests: u64,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    socket_errors: u64,
    cpu_secs: f64,
}

fn main() -> Result<()> {
    // criterion-style arguments from `cargo bench` are ignored.
    let secs = |name: &str, default: u64| -> Result<u64> {
        std::env::var(name)
            .ok()
            .map(|v| v.parse().with_context(|| format!("{name}={v:?}")))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let rounds = secs("ZEROLAYER_LOAD_ROUNDS", ROUNDS)?;
    let loaded = secs("ZEROLAYER_LOAD_SECS", LOADED_SECS)?;
    let single = (loaded / 2).clamp(1, SINGLE_SECS);
    let wrk = wrk::binary()?;
    let pinned = pin_self(CLIENT_CPU);
    let dir = tempfile::tempdir()?;
    let stub = Stub::start(StubConfig::default()).context("starting the backend stub")?;
    let services = AuthServices::start(|_| (200, r#"{"active":false}"#.to_string()))?;
    let usage = MockServer::start(|_| (200, String::new()))?;
    let bearer = Chain::bearer("bench", "acme");
    let mut results: Vec<(Variant, Vec<Phase>, Vec<Phase>)> = VARIANTS
        .iter()
        .map(|v| (*v, Vec::new(), Vec::new()))
        .collect();
    for round in 0..rounds {
        for (variant, loaded_phases, single_phases) in &mut results {
            let ngx = start(variant, &services, &usage, stub.addr())?;
            if pinned {
                let _ = pin_tree(ngx.pid(), NGINX_CPU);
            }
            let script = write_script(dir.path(), variant.no_store, &bearer)?;
            let url = ngx.url(PATH);
            // Warm-up: the token verified, the hit stored, the JIT warm.
            warm_up(&ngx, &bearer, variant.no_store)?;
            run_wrk(&wrk, &url, &script, CONNECTIONS, 1, ngx.pid())?;
            loaded_phases.push(run_wrk(
                &wrk,
                &url,
                &script,
                CONNECTIONS,
                loaded,
                ngx.pid(),
            )?);
            single_phases.push(run_wrk(&wrk, &url, &script, 1, single, ngx.pid())?);
            eprintln!(
                "round {}/{rounds} {}: {:.0} req/s",
                round + 1,
                variant.key,
                loaded_phases.last().map_or(0.0, |p| p.rps)
            );
        }
    }
    let summary: Vec<(Variant, f64, f64, f64, f64, u64)> = results
        .iter()
        .map(|(v, loaded, single)| {
            let rps = median(loaded.iter().map(|p| p.rps).collect());
            let cpu = median(
                loaded
                    .iter()
                    .map(|p| p.cpu_secs * 1e6 / p.requests.max(1) as f64)
                    .collect(),
            );
            let p50 = median(single.iter().map(|p| p.p50_us).collect());
            let loaded_p99 = median(loaded.iter().map(|p| p.p99_us).collect());
            let errors = loaded.iter().chain(single).map(|p| p.socket_errors).sum();
            (*v, rps, cpu, p50, loaded_p99, errors)
        })
        .collect();
    let (_, plain_rps, plain_cpu, plain_p50, _, _) = summary[0];
    println!();
    println!(
        "ngx_wasm_module (nginx 1.27.4, wasmtime 26), one worker on CPU {NGINX_CPU}; wrk -t1 -c{CONNECTIONS} {loaded} s and -c1 {single} s × {rounds} rounds on CPU {CLIENT_CPU}{}",
        if pinned { "" } else { " (not pinned: noisier)" }
    );
    println!(
        "{:<42} {:>9} {:>8} {:>12} {:>11} {:>9} {:>9} {:>12} {:>8}",
        "configuration",
        "req/s",
        "vs plain",
        "CPU µs/req",
        "over plain",
        "p50 µs",
        "+p50 µs",
        "loaded p99",
        "sock err"
    );
    for (v, rps, cpu, p50, p99, errors) in &summary {
        println!(
            "{:<42} {:>9.0} {:>7.2}× {:>12.1} {:>+11.1} {:>9.0} {:>+9.0} {:>10.0}µs {:>8}",
            v.label,
            rps,
            rps / plain_rps,
            cpu,
            cpu - plain_cpu,
            p50,
            p50 - plain_p50,
            p99,
            errors
        );
    }
    let by = |key: &str| {
        summary
            .iter()
            .find(|s| s.0.key == key)
            .map(|s| s.2 - plain_cpu)
    };
    if let (Some(separate), Some(fused)) = (by("separate"), by("fused")) {
        println!(
            "fused / separate overhead over plain (CPU per request): {:.2}",
            fused / separate
        );
    }
    let out = zerolayer_e2e::paths::root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    let report: Vec<_> = summary
        .iter()
        .map(|(v, rps, cpu, p50, p99, errors)| {
            json!({"key": v.key, "label": v.label, "rps": rps, "cpu_us_per_request": cpu,
                   "p50_us": p50, "loaded_p99_us": p99, "socket_errors": errors})
        })
        .collect();
    std::fs::write(
        out.join("kong_load.json"),
        serde_json::to_string_pretty(
            &json!({"rounds": rounds, "loaded_secs": loaded, "results": report}),
        )?,
    )?;
    Ok(())
}

/// nginx for `variant`, its callouts pointed at the loopback services.
fn start(
    variant: &Variant,
    services: &AuthServices,
    usage: &MockServer,
    upstream: std::net::SocketAddr,
) -> Result<NgxWasm> {
    let mut config = KongConfig::shipped(variant.file.unwrap_or("kong.yml"))?
        .retarget("127.0.0.1:18091", services.idp.addr())
        .retarget("127.0.0.1:18092", services.api_keys.addr())
        .retarget("127.0.0.1:18093", services.audit.addr())
        .retarget("127.0.0.1:8123", usage.addr())
        .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
    if variant.file.is_none() {
        // The same nginx, the same generated configuration, no filter.
        config.filters.clear();
    }
    // quota is left out (the chain as measured before it shipped): it needs
    // a Redis + webdis store, and its daily budget would run out under load.
    config.filters.retain(|f| f.name != "zerolayer_quota");
    for filter in &mut config.filters {
        let mut value: serde_json::Value = serde_json::from_str(&filter.config)?;
        if let Some(sections) = value.as_object_mut() {
            sections.remove("quota");
        }
        let lazy = if value.get("lazy_auth").is_some() {
            &mut value["lazy_auth"]
        } else {
            &mut value
        };
        if lazy.get("jwt").is_some() {
            lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
        }
        filter.config = value.to_string();
    }
    let ngx = NgxWasm::start(&config, upstream)?;
    if variant.file.is_some() {
        // Until the observer holds the issuer's keys, a JWT past its
        // unverified allowance cannot be verified inline (503).
        wait::until("the observer's JWKS fetch", Duration::from_secs(20), || {
            Ok(ngx.log().contains("observer: JWKS fetched").then_some(()))
        })?;
    }
    Ok(ngx)
}

/// Requests until the token is verified (a cacheable probe stops being
/// bypassed for want of a verified tenant) and, for the hit variants, the
/// benchmark's entry is stored.
fn warm_up(ngx: &NgxWasm, bearer: &str, no_store: bool) -> Result<()> {
    let client = zerolayer_e2e::Client::new();
    let json = ("content-type", "application/json");
    let mut n = 0;
    wait::until("the token verified", Duration::from_secs(20), || {
        n += 1;
        let probe = BODY.replace("a benchmark request", &format!("warm-up {n}"));
        let reply = client.send(
            "POST",
            &ngx.url(PATH),
            &[("authorization", bearer), json],
            &probe,
        )?;
        ensure!(
            reply.status == 200,
            "warm-up: {} {}",
            reply.status,
            reply.body
        );
        // Plain nginx has no cache: nothing to wait for.
        Ok(matches!(reply.header("x-cache"), None | Some("MISS" | "HIT")).then_some(()))
    })?;
    if no_store {
        return Ok(());
    }
    wait::until(
        "the benchmark's entry stored",
        Duration::from_secs(20),
        || {
            let reply = client.send(
                "POST",
                &ngx.url(PATH),
                &[("authorization", bearer), json],
                BODY,
            )?;
            ensure!(
                reply.status == 200,
                "warm-up: {} {}",
                reply.status,
                reply.body
            );
            Ok((reply.header("x-cache") == Some("HIT")).then_some(()))
        },
    )
}

/// The wrk script: the same POST every time.
fn write_script(dir: &Path, no_store: bool, bearer: &str) -> Result<PathBuf> {
    let mut lua = String::new();
    writeln!(lua, "wrk.method = \"POST\"")?;
    writeln!(lua, "wrk.path = \"{PATH}\"")?;
    writeln!(lua, "wrk.body = [==[{BODY}]==]")?;
    writeln!(lua, "wrk.headers[\"content-type\"] = \"application/json\"")?;
    writeln!(lua, "wrk.headers[\"authorization\"] = \"{bearer}\"")?;
    if no_store {
        writeln!(lua, "wrk.headers[\"cache-control\"] = \"no-store\"")?;
    }
    let path = dir.join(if no_store { "no-store.lua" } else { "hit.lua" });
    std::fs::write(&path, lua)?;
    Ok(path)
}

/// Runs wrk; fails on any non-2xx answer (socket errors are counted).
fn run_wrk(
    wrk: &Path,
    url: &str,
    script: &Path,
    connections: u32,
    secs: u64,
    nginx: u32,
) -> Result<Phase> {
    let before = tree_cpu_secs(nginx)?;
    let report = wrk::run(wrk, url, script, connections, secs)?;
    let cpu_secs = tree_cpu_secs(nginx)? - before;
    ensure!(
        report.non_2xx == 0,
        "wrk saw {} answers that were not 2xx",
        report.non_2xx
    );
    // Socket errors are reported, not fatal: ngx_wasm_module drops
    // connections under load here (BENCHMARKS.md), which is what to measure.
    Ok(Phase {
        requests: report.requests,
        rps: report.rps,
        p50_us: report.p50_us,
        p99_us: report.p99_us,
        socket_errors: report.socket_errors,
        cpu_secs,
    })
}
