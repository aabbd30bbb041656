//! post-cache in real Envoy, same run: a hit against going to the backend.
//! Envoy without the cache in front of the GPU backend stub (set to answer
//! with no delay: the cheapest backend there is, so the ratio is a lower
//! bound on what a hit saves against a real GPU), post-cache on a miss
//! (every request new: key, lookup, lease, store), and post-cache on a hit.
//! Sequential keep-alive requests, interleaved rounds; p50/p99 and ratios.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::json;
use zerolayer_e2e::paths;
use zerolayer_stub::{Stub, StubConfig};

const ROUNDS: usize = 5;
const PER_ROUND: usize = 300;
const SECRET: &str = "zerolayer-bench-cache-secret-0123456789abcdef";

fn post_cache() -> String {
    let wasm = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_post_cache.wasm");
    let config = json!({
        "secret_env": "ZEROLAYER_CACHE_SECRET",
        "namespace": "shared",
        "max_entries": 65536,
    });
    format!(
        r#"          - name: cache
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: cache
                allow_on_headers_stop_iteration: true
                vm_config:
                  vm_id: cache
                  runtime: envoy.wasm.runtime.v8
                  environment_variables: {{host_env_keys: [ZEROLAYER_CACHE_SECRET]}}
                  code: {{local: {{filename: {}}}}}
                configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{}'}}"#,
        wasm.display(),
        config
    )
}

fn body(prompt: &str) -> String {
    json!({
        "model": "claude-bench",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

fn main() -> Result<()> {
    paths::wasm("post_cache")?;
    let stub = Stub::start(
        StubConfig::default()
            .ttft(Duration::ZERO)
            .itl(Duration::ZERO),
    )?;
    let dir = tempfile::tempdir()?;
    let plain = common::start(&common::hcm(""), stub.addr(), dir.path(), "plain", &[])?;
    let cached = common::start(
        &common::hcm(&post_cache()),
        stub.addr(),
        dir.path(),
        "cache",
        &[("ZEROLAYER_CACHE_SECRET", SECRET)],
    )?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let send = |url: &str, body: &str| -> Result<(Duration, String)> {
        let started = Instant::now();
        let mut r = agent
            .post(url)
            .header("content-type", "application/json")
            .send(body)?;
        let status = r.status();
        let label = r
            .headers()
            .get("x-cache")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let _ = r.body_mut().read_to_vec()?;
        ensure!(status == 200, "{url} answered {status}");
        Ok((started.elapsed(), label))
    };
    let hot = body("the same question every time");
    let (plain_url, cache_url) = (plain.url("/v1/messages"), cached.url("/v1/messages"));
    // Warm up; the first cached request stores the hot entry.
    for i in 0..200 {
        send(&plain_url, &hot)?;
        send(&cache_url, &body(&format!("warm-up {i}")))?;
    }
    send(&cache_url, &hot)?;
    let names = ["backend via Envoy", "post-cache miss", "post-cache hit"];
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    let mut n = 0;
    for _ in 0..ROUNDS {
        for _ in 0..PER_ROUND {
            samples[0].push(send(&plain_url, &hot)?.0);
        }
        for _ in 0..PER_ROUND {
            n += 1;
            let (t, label) = send(&cache_url, &body(&format!("fresh question {n}")))?;
            ensure!(label == "MISS", "a fresh question was a {label}");
            samples[1].push(t);
        }
        for _ in 0..PER_ROUND {
            let (t, label) = send(&cache_url, &hot)?;
            ensure!(label == "HIT", "the hot question was a {label}");
            samples[2].push(t);
        }
    }
    println!(
        "{:<20} {:>10} {:>10} {:>16}",
        "path", "p50", "p99", "p50 / backend"
    );
    let mut backend = Duration::ZERO;
    for (i, name) in names.iter().enumerate() {
        let mut s = samples[i].clone();
        s.sort();
        let (p50, p99) = (common::percentile(&s, 0.5), common::percentile(&s, 0.99));
        if i == 0 {
            backend = p50;
        }
        println!(
            "{name:<20} {:>8.0}µs {:>8.0}µs {:>15.2}×",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            p50.as_secs_f64() / backend.as_secs_f64().max(1e-9)
        );
    }
    println!(
        "(backend: the GPU stub answering at once; a real model's time to first token is 100 ms or more)"
    );
    Ok(())
}
