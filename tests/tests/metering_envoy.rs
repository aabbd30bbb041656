//! metering in real Envoy (the shipped `envoy/metering.yaml`: the filter and
//! the observer singleton) against the GPU backend stub, a real ClickHouse
//! and the real model server: sampled rows land, the access log holds every
//! request's usage and reconciles the sample to it exactly, a sink that is
//! down for a while costs no request and no record.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim_tools::reconcile::{self, Measure};
use serde_json::{Value, json};
use zerolayer_e2e::chain::reported_usage;
use zerolayer_e2e::clickhouse::ClickHouse;
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, ModelServer, paths, wait};
use zerolayer_stub::{Stub, StubConfig};

/// Envoy from the shipped config, in front of `backend`, shipping to
/// `clickhouse`, with `change` applied to the metering configuration (the
/// filter's and the observer's copy alike).
fn gateway(
    backend: std::net::SocketAddr,
    clickhouse: std::net::SocketAddr,
    change: impl FnOnce(&mut Value),
) -> Result<Envoy> {
    paths::wasm("metering")?;
    let mut config = EnvoyConfig::shipped("metering.yaml")?
        .for_run(backend)?
        .point_cluster("clickhouse", clickhouse)?;
    let mut metering: Value =
        serde_json::from_str(&config.wasm_filter_config("zerolayer.metering")?)?;
    change(&mut metering);
    config.set_wasm_filter_config("zerolayer.metering", &metering.to_string())?;
    config.set_service_config(
        "zerolayer.observer",
        &json!({"metering": metering, "tick_ms": 100}).to_string(),
    )?;
    Envoy::start(&config)
}

fn sampling(percent: f64) -> impl FnOnce(&mut Value) {
    move |m: &mut Value| {
        m["sampling"] = json!({"percent": percent});
        m["sink"]["flush_ms"] = json!(200);
        m["sink"]["breaker"] = json!({"failures": 3, "open_secs": 1});
        m["sink"]["max_backoff_ms"] = json!(1000);
    }
}

/// Sends a mix of requests for `tenant`: both providers, streamed and not.
/// Returns the usage each response reported to its client (ground truth
/// seen from outside the gateway), summed.
fn traffic(envoy: &Envoy, tenant: &str, n: usize) -> Result<(u64, u64)> {
    let client = Client::new();
    let (mut input, mut output) = (0, 0);
    for i in 0..n {
        let prompt = format!("{tenant} request {i}: {}", "word ".repeat(i % 7));
        let (path, body) = match i % 4 {
            0 => (
                "/v1/messages",
                json!({"model": "claude-test", "max_tokens": 8 + i % 5, "messages": [{"role": "user", "content": prompt}]}),
            ),
            1 => (
                "/v1/messages",
                json!({"model": "claude-test", "max_tokens": 8, "stream": true, "messages": [{"role": "user", "content": prompt}]}),
            ),
            2 => (
                "/v1/chat/completions",
                json!({"model": "gpt-test", "max_tokens": 6, "messages": [{"role": "user", "content": prompt}]}),
            ),
            _ => (
                "/v1/chat/completions",
                json!({"model": "gpt-test", "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": prompt}]}),
            ),
        };
        let reply = client
            .send(
                "POST",
                &envoy.url(path),
                &[
                    ("content-type", "application/json"),
                    ("x-tenant-id", tenant),
                ],
                &body.to_string(),
            )
            .with_context(|| format!("Envoy's log:\n{}", tail(&envoy.log(), 30)))?;
        if reply.status != 200 {
            bail!("{path}: status {} {}", reply.status, reply.body);
        }
        let (i, o) = reported_usage(&reply.body)?;
        input += i;
        output += o;
    }
    Ok((input, output))
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Waits until ClickHouse holds `n` rows.
fn wait_rows(clickhouse: &ClickHouse, n: usize, envoy: &Envoy) -> Result<Vec<Value>> {
    clickhouse
        .wait_rows(n, Duration::from_secs(20))
        .with_context(|| {
            format!(
                "{}\n{}",
                envoy.prometheus().unwrap_or_default(),
                envoy.log()
            )
        })
}

/// Waits until the access log has `n` lines with usage.
fn access_log(envoy: &Envoy, n: usize) -> Result<reconcile::AccessLog> {
    wait::until(
        &format!("{n} usage lines in the access log"),
        Duration::from_secs(10),
        || {
            let log = reconcile::read_access_log(envoy.access_log().as_bytes())?;
            Ok((log.rows.len() >= n).then_some(log))
        },
    )
}

#[test]
fn sampled_rows_land_and_reconcile_to_the_access_log_exactly() -> Result<()> {
    let stub = Stub::start(StubConfig::default())?;
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let envoy = gateway(stub.addr(), clickhouse.addr(), sampling(25.0))?;
    let acme = traffic(&envoy, "acme", 60)?;
    let globex = traffic(&envoy, "globex", 40)?;

    let log = access_log(&envoy, 100)?;
    assert_eq!(
        log.rows.len(),
        100,
        "every request's usage is in the access log"
    );
    let mut truth: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for row in &log.rows {
        let t = truth.entry(row.tenant.as_str()).or_default();
        t.0 += row.tokens.input;
        t.1 += row.tokens.output;
    }
    assert_eq!(
        truth.get("acme"),
        Some(&acme),
        "the log's usage is what the clients were told"
    );
    assert_eq!(truth.get("globex"), Some(&globex));

    // The sample: exactly the requests whose id hashes under the rate.
    let expected: Vec<&str> = log
        .rows
        .iter()
        .map(|r| r.request_id.as_str())
        .filter(|id| zerolayer_core::sampling::bucket(id.as_bytes()) < 2500)
        .collect();
    assert!(!expected.is_empty());
    let rows = wait_rows(&clickhouse, expected.len(), &envoy)?;
    let mut shipped: Vec<&str> = rows
        .iter()
        .filter_map(|r| r["request_id"].as_str())
        .collect();
    let mut want = expected.clone();
    shipped.sort_unstable();
    want.sort_unstable();
    assert_eq!(shipped, want, "ClickHouse holds the hash sample");
    assert!(
        rows.iter()
            .all(|r| r["sample_weight"].as_f64() == Some(4.0))
    );

    // Reconciliation against ClickHouse: threshold 0 bills the truth exactly.
    let sample = reconcile::fetch_sample(&clickhouse.url(), "zerolayer_usage")?;
    let report = reconcile::reconcile(&log.rows, &sample, 0.0);
    for tenant in ["acme", "globex"] {
        let billed = |m: Measure| report.billed(tenant, m);
        let (input, output) = truth[tenant];
        assert_eq!(
            billed(Measure::InputTokens),
            input as f64,
            "{tenant}\n{}",
            report.summary()
        );
        assert_eq!(billed(Measure::OutputTokens), output as f64, "{tenant}");
    }
    envoy.wait_metric(
        r#"zerolayer_metering_records{outcome="shipped"}"#,
        expected.len() as f64,
    )?;
    envoy.wait_metric(
        r#"zerolayer_metering_requests{tenant="acme",model="claude-test"}"#,
        30.0,
    )?;
    envoy.wait_metric(
        r#"zerolayer_metering_tokens{tenant="globex",model="gpt-test",kind="output"}"#,
        1.0,
    )?;
    Ok(())
}

#[test]
fn a_sink_down_for_a_while_costs_no_request_and_no_record() -> Result<()> {
    let stub = Stub::start(StubConfig::default())?;
    let mut clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let envoy = gateway(stub.addr(), clickhouse.addr(), sampling(100.0))?;
    traffic(&envoy, "acme", 8)?;
    wait_rows(&clickhouse, 8, &envoy)?;

    clickhouse.stop();
    // Every request still succeeds (traffic fails on any non-200).
    traffic(&envoy, "acme", 24)?;
    // Down long enough for the breaker to open (3 failed batches).
    envoy.wait_metric("zerolayer_metering_batches_failed", 3.0)?;
    clickhouse.restart()?;

    let rows = wait_rows(&clickhouse, 32, &envoy)?;
    assert_eq!(
        rows.len(),
        32,
        "every record delivered once the sink is back"
    );
    let log = access_log(&envoy, 32)?;
    let report = reconcile::reconcile(
        &log.rows,
        &reconcile::fetch_sample(&clickhouse.url(), "zerolayer_usage")?,
        0.0,
    );
    assert!(
        report.corrections.is_empty(),
        "a full sample needs no correction:\n{}",
        report.summary()
    );
    assert_eq!(
        envoy
            .metric(r#"zerolayer_metering_records{outcome="dropped"}"#)?
            .unwrap_or(0.0),
        0.0
    );
    Ok(())
}

#[test]
fn include_usage_is_injected_and_its_chunk_hidden_in_envoy() -> Result<()> {
    let stub = Stub::start(StubConfig::default())?;
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let envoy = gateway(stub.addr(), clickhouse.addr(), sampling(100.0))?;
    let body = json!({"model": "gpt-test", "max_tokens": 6, "stream": true,
                      "messages": [{"role": "user", "content": "count to three"}]});
    let reply = Client::new().send(
        "POST",
        &envoy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        &body.to_string(),
    )?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        !reply.body.contains("\"usage\":{"),
        "the client did not ask for usage: {}",
        reply.body
    );
    assert!(reply.body.ends_with("data: [DONE]\n\n"), "{}", reply.body);
    let upstream: Value =
        serde_json::from_slice(&stub.requests().last().context("no upstream request")?.body)?;
    assert_eq!(upstream["stream_options"]["include_usage"], true);
    let log = access_log(&envoy, 1)?;
    let row = log.rows.first().context("no usage in the access log")?;
    assert!(row.tokens.output > 0 && row.tokens.input > 0, "{row:?}");
    Ok(())
}

#[test]
fn usage_from_the_real_model_server_in_both_apis() -> Result<()> {
    let model = ModelServer::shared()?;
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let envoy = gateway(model.addr(), clickhouse.addr(), sampling(100.0))?;
    let client = Client::new();
    let mut told = Vec::new();
    for (path, stream) in [
        ("/v1/messages", false),
        ("/v1/messages", true),
        ("/v1/chat/completions", false),
        ("/v1/chat/completions", true),
    ] {
        let body = json!({"model": model.model(), "max_tokens": 8, "temperature": 0, "stream": stream,
                          "messages": [{"role": "user", "content": "Say hi."}]});
        let reply = client.send(
            "POST",
            &envoy.url(path),
            &[
                ("content-type", "application/json"),
                ("x-tenant-id", "acme"),
            ],
            &body.to_string(),
        )?;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        told.push(reported_usage(&reply.body)?);
    }
    let log = access_log(&envoy, 4)?;
    assert_eq!(log.rows.len(), 4);
    for (i, row) in log.rows.iter().enumerate() {
        assert!(
            row.tokens.output > 0 && row.tokens.input > 0,
            "request {i}: {row:?}"
        );
        // The OpenAI stream's usage was injected: its client saw none.
        if i != 3 {
            assert_eq!(
                (row.tokens.input, row.tokens.output),
                told[i],
                "request {i}"
            );
        }
    }
    wait_rows(&clickhouse, 4, &envoy)?;
    Ok(())
}

#[test]
fn the_shipped_configs_embed_the_documented_example() -> Result<()> {
    let example: Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/metering/example.json"),
    )?)?;
    zerolayer_core::metering::MeteringConfig::from_json(example.to_string().as_bytes())
        .map_err(|e| anyhow::anyhow!("filters/metering/example.json: {e}"))?;
    for name in ["metering.yaml", "zerolayer.yaml"] {
        let config = EnvoyConfig::shipped(name)?;
        let filter: Value =
            serde_json::from_str(&config.wasm_filter_config("zerolayer.metering")?)?;
        assert_eq!(
            filter, example,
            "envoy/{name} drifted from filters/metering/example.json"
        );
        let service = config.service_config("zerolayer.observer")?;
        let observer: Value = serde_json::from_str(&service)?;
        assert_eq!(
            observer["metering"], example,
            "envoy/{name}: the observer's metering section drifted"
        );
    }
    Ok(())
}
