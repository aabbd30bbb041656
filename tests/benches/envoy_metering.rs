//! metering in real Envoy, same run: the added per-request latency. Envoy
//! without filters in front of the GPU backend stub (answering with no
//! delay, so the ratio is an upper bound on the relative cost), and Envoy
//! with metering and the observer shipping to a real ClickHouse, sampling
//! 1% (a production rate) and 100% (every request posts a record). JSON and
//! SSE responses (64 output tokens). Sequential keep-alive requests,
//! interleaved rounds; p50/p99 and ratios to plain Envoy.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::json;
use zerolayer_e2e::clickhouse::ClickHouse;
use zerolayer_e2e::{Envoy, EnvoyConfig, paths};
use zerolayer_stub::{Stub, StubConfig};

const ROUNDS: usize = 5;
const PER_ROUND: usize = 200;

/// The bench config: metering in the chain, the observer singleton, a
/// `clickhouse` cluster (pointed at the real one after `for_run`).
fn metering(percent: f64) -> String {
    let wasm = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_metering.wasm");
    let service = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_observer_service.wasm");
    let config = json!({
        "sampling": {"percent": percent},
        "sink": {"cluster": "clickhouse", "timeout_ms": 2000, "batch_max": 500, "flush_ms": 500,
                 "path": "/?query=INSERT%20INTO%20zerolayer_usage%20FORMAT%20JSONEachRow"},
    });
    let filter = format!(
        r#"          - name: metering
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: metering
                vm_config:
                  vm_id: metering
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: {}}}}}
                configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{}'}}"#,
        wasm.display(),
        config
    );
    let extra = format!(
        r#"bootstrap_extensions:
- name: envoy.bootstrap.wasm
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.wasm.v3.WasmService
    singleton: true
    config:
      name: observer
      vm_config:
        vm_id: zerolayer
        runtime: envoy.wasm.runtime.v8
        code: {{local: {{filename: {}}}}}
      configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{}'}}
"#,
        service.display(),
        json!({"metering": config, "tick_ms": 200})
    );
    let cluster = r#"  - name: clickhouse
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: clickhouse
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 1}}}}]}]
"#;
    format!("{}{cluster}{extra}", common::hcm(&filter))
}

fn start_metering(
    percent: f64,
    stub: std::net::SocketAddr,
    clickhouse: std::net::SocketAddr,
    dir: &std::path::Path,
) -> Result<Envoy> {
    let path = dir.join(format!("metering-{percent}.yaml"));
    std::fs::write(&path, metering(percent))?;
    let config = EnvoyConfig::load(&path)?
        .for_run(stub)?
        .point_cluster("clickhouse", clickhouse)?;
    Envoy::start(&config)
}

fn body(prompt: &str, stream: bool) -> String {
    json!({
        "model": "claude-bench",
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

fn main() -> Result<()> {
    paths::wasm("metering")?;
    paths::wasm("observer_service")?;
    let stub = Stub::start(
        StubConfig::default()
            .ttft(Duration::ZERO)
            .itl(Duration::ZERO),
    )?;
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let dir = tempfile::tempdir()?;
    let plain = common::start(&common::hcm(""), stub.addr(), dir.path(), "plain", &[])?;
    let sampled = start_metering(1.0, stub.addr(), clickhouse.addr(), dir.path())?;
    let every = start_metering(100.0, stub.addr(), clickhouse.addr(), dir.path())?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let send = |url: &str, body: &str| -> Result<Duration> {
        let started = Instant::now();
        let mut r = agent
            .post(url)
            .header("content-type", "application/json")
            .send(body)?;
        let status = r.status();
        let _ = r.body_mut().read_to_vec()?;
        ensure!(status == 200, "{url} answered {status}");
        Ok(started.elapsed())
    };
    let gateways = [
        ("plain Envoy", plain.url("/v1/messages")),
        ("metering 1%", sampled.url("/v1/messages")),
        ("metering 100%", every.url("/v1/messages")),
    ];
    let mut n = 0;
    for (_, url) in &gateways {
        for stream in [false, true] {
            for _ in 0..100 {
                n += 1;
                send(url, &body(&format!("warm-up {n}"), stream))?;
            }
        }
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); gateways.len() * 2];
    for _ in 0..ROUNDS {
        for (g, (_, url)) in gateways.iter().enumerate() {
            for (s, stream) in [false, true].into_iter().enumerate() {
                for _ in 0..PER_ROUND {
                    n += 1;
                    samples[g * 2 + s].push(send(url, &body(&format!("question {n}"), stream))?);
                }
            }
        }
    }
    println!(
        "{:<16} {:<7} {:>9} {:>9} {:>10} {:>14}",
        "gateway", "body", "p50", "p99", "p50 ratio", "p50 added"
    );
    for (s, kind) in ["JSON", "SSE"].into_iter().enumerate() {
        let mut base = Duration::ZERO;
        for (g, (name, _)) in gateways.iter().enumerate() {
            let mut v = samples[g * 2 + s].clone();
            v.sort();
            let (p50, p99) = (common::percentile(&v, 0.5), common::percentile(&v, 0.99));
            if g == 0 {
                base = p50;
            }
            println!(
                "{name:<16} {kind:<7} {:>7.0}µs {:>7.0}µs {:>9.2}× {:>12.0}µs",
                p50.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                p50.as_secs_f64() / base.as_secs_f64().max(1e-9),
                (p50.as_secs_f64() - base.as_secs_f64()) * 1e6
            );
        }
    }
    // Every queued record shipped: the observers have caught up.
    for envoy in [&sampled, &every] {
        // This bootstrap has no `stats_tags`: the label stays in the name.
        let queued = envoy.wait_metric("zerolayer_metering_records_outcome_queued", 1.0)?;
        envoy.wait_metric("zerolayer_metering_records_outcome_shipped", queued)?;
    }
    println!(
        "(ClickHouse holds {} sampled records; backend: the GPU stub answering at once)",
        clickhouse.rows()?.len()
    );
    Ok(())
}
