//! The official `openai` (3.57.0) and `anthropic` (2.16.0) Python SDKs,
//! pinned in the project's `.venv`, against the shipped chain: in real
//! Envoy (separate, fused and native) and in Kong's host, ngx_wasm_module
//! (both forms). What they do is `tests/clients/sdk_suite.py`: sync and
//! async clients, streamed and not, a miss then a hit parsed alike,
//! `include_usage` asked and not, API keys as `Authorization: Bearer` (what
//! `api_key=` sends) and in `x-api-key`, a JWT, bad and missing
//! credentials, a body over 1 MiB, backend errors retried as the SDKs
//! retry, the gateway's own final 504 not retried, 20 concurrent streams.
//! Here, the usage each SDK parsed is checked against the usage the
//! gateway logged for the same request id.

use std::collections::HashMap;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use zerolayer_e2e::chain::{Chain, ChainOptions, Form, GOOD_API_KEY};
use zerolayer_e2e::in_every_form;
use zerolayer_e2e::kong_chain::{KongChain, KongChainOptions, KongGateway};
use zerolayer_e2e::sdk::{self, Credentials, Report};
use zerolayer_stub::StubConfig;

/// The backend asks for no wait before a retry (the SDKs would otherwise
/// honour its `retry-after: 1` twice per failing call).
fn stub() -> StubConfig {
    StubConfig::default().retry_after_secs(0)
}

/// Checks every usage the SDKs parsed against the gateway's log entry for
/// the same request id; a stream whose client did not ask for usage has
/// none for the SDK but its usage is logged all the same.
fn agrees_with_the_log(report: &Report, logged: &HashMap<String, Value>) -> Result<()> {
    ensure!(
        report.seen.len() >= 30,
        "only {} requests",
        report.seen.len()
    );
    for seen in &report.seen {
        let usage = logged.get(&seen.request_id).with_context(|| {
            format!(
                "{}: the SDK read request id {:?}, which the gateway never logged",
                seen.case, seen.request_id
            )
        })?;
        ensure!(usage["usage_missing"] == 0, "{}: {usage}", seen.case);
        if let Some([input, output]) = seen.usage {
            ensure!(
                usage["input_tokens"] == input && usage["output_tokens"] == output,
                "{}: the SDK parsed {input}→{output}, the gateway logged {usage}",
                seen.case
            );
        }
    }
    Ok(())
}

/// Sends requests with `credential` until the gateway knows it as
/// verified (a `MISS`, not the `BYPASS` of a credential nobody verified
/// yet): the suite checks what the SDKs do with a gateway that knows their
/// keys, not lazy-auth's first sight of them (its own suites do that).
fn warm_up(mut send: impl FnMut(&str) -> Result<zerolayer_e2e::Reply>) -> Result<()> {
    let mut n = 0;
    zerolayer_e2e::wait::until(
        "the API key verified",
        std::time::Duration::from_secs(10),
        || {
            n += 1;
            let reply = send(&format!("warm-up-key-{n}"))?;
            ensure!(
                reply.status == 200,
                "warm-up: {} {}",
                reply.status,
                reply.body
            );
            Ok((reply.header("x-cache") == Some("MISS")).then_some(()))
        },
    )
}

/// The usage entries of an Envoy access log, by request id.
fn envoy_usage(chain: &Chain, ids: &[&str]) -> Result<HashMap<String, Value>> {
    let log = chain.wait_access_log_for(ids)?;
    ids.iter()
        .map(|id| {
            Ok((
                id.to_string(),
                zerolayer_e2e::chain::logged_usage(&log, id)?,
            ))
        })
        .collect()
}

fn the_official_sdks_work_through_the_gateway(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        stub: stub(),
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("sdk", "acme")?;
    let jwt = bearer.trim_start_matches("Bearer ");
    let key = format!("Bearer {GOOD_API_KEY}");
    warm_up(|id| {
        chain.post(
            "/v1/messages",
            &[("authorization", &key), ("x-request-id", id)],
            &zerolayer_e2e::chain::anthropic(id, false),
        )
    })?;
    let credentials = Credentials {
        jwt,
        api_key: GOOD_API_KEY,
        bad_key: "sk-nobody-issued-this",
    };
    let url = chain.envoy.url("");
    let report = sdk::run_suite(&url, &credentials, &format!("envoy-{form:?}"))?;
    let ids: Vec<&str> = report.seen.iter().map(|s| s.request_id.as_str()).collect();
    agrees_with_the_log(&report, &envoy_usage(&chain, &ids)?)
}

in_every_form!(the_official_sdks_work_through_the_gateway);

#[test]
fn the_official_sdks_work_through_ngx_wasm_module() -> Result<()> {
    for fused in [false, true] {
        let chain = KongChain::start(KongChainOptions {
            fused,
            stub: stub(),
            ..KongChainOptions::default()
        })?;
        let bearer = chain.verified_bearer("sdk", "acme")?;
        let key = format!("Bearer {GOOD_API_KEY}");
        warm_up(|id| {
            chain.post(
                id,
                "/v1/messages",
                &[("authorization", &key), ("x-request-id", id)],
                &zerolayer_e2e::chain::anthropic(id, false),
            )
        })?;
        let credentials = Credentials {
            jwt: bearer.trim_start_matches("Bearer "),
            api_key: GOOD_API_KEY,
            bad_key: "sk-nobody-issued-this",
        };
        let KongGateway::NgxWasm(ngx) = &chain.gateway else {
            anyhow::bail!("not ngx_wasm_module");
        };
        let report = sdk::run_suite(&ngx.url(""), &credentials, &format!("kong-{fused}"))
            .with_context(|| format!("in {}; log tail:\n{}", chain.form, ngx.log_tail(30)))?;
        // nginx logs each request's usage entry (`$zerolayer_usage`).
        let mut logged = HashMap::new();
        zerolayer_e2e::wait::until(
            "every request the SDKs made in nginx's access log",
            std::time::Duration::from_secs(10),
            || {
                logged = ngx
                    .access_log()
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .filter_map(|v| {
                        let usage: Value = serde_json::from_str(v["usage"].as_str()?).ok()?;
                        Some((v["request_id"].as_str()?.to_string(), usage))
                    })
                    .collect::<HashMap<_, _>>();
                Ok(report
                    .seen
                    .iter()
                    .all(|s| logged.contains_key(&s.request_id))
                    .then_some(()))
            },
        )
        .with_context(|| {
            let missing: Vec<String> = report
                .seen
                .iter()
                .filter(|s| !logged.contains_key(&s.request_id))
                .map(|s| format!("{} ({}, x-cache {:?})", s.case, s.request_id, s.cache))
                .collect();
            let log = ngx.access_log();
            let _ = std::fs::write("/tmp/ngx-access.log", &log);
            let _ = std::fs::write("/tmp/ngx-error.log", ngx.log_tail(100000));
            let lines: Vec<&str> =
                log.lines()
                    .filter(|l| {
                        report.seen.iter().any(|s| {
                            !logged.contains_key(&s.request_id) && l.contains(&s.request_id)
                        })
                    })
                    .collect();
            format!(
                "{}: missing: {missing:?}; their log lines: {lines:#?}",
                chain.form
            )
        })?;
        agrees_with_the_log(&report, &logged).with_context(|| chain.form.clone())?;
    }
    Ok(())
}
