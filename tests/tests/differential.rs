//! Fidelity: the same scenarios through real Envoy (V8) and through
//! `host-sim serve`, both running the same Envoy config file in front of the
//! same echo upstream. Every scenario must look the same to the client and
//! to the upstream, and metrics must agree.
//!
//! Scenarios:
//! - activation (`envoy/activation.yaml` with the test rules): defaults,
//!   tenant rule, method+path rule, higher priority switching observers off,
//!   regex user agent, consistent percent on fixed request ids, forged
//!   internal headers, upstream-sent internal response header, debug header,
//!   counters per rule and observer.
//! - probe (`host-sim/probe/envoy.yaml`: a singleton service and the probe
//!   filter): shared data increments and a stale CAS, enqueue to the
//!   singleton and its drain, local responses (alone and after other
//!   actions), a callout pausing and resuming the request, body buffering
//!   behind paused headers (3000 bytes and none; 1 MiB, and one byte past
//!   Envoy's buffer limit: 413), properties
//!   (`request.path`, `.method`, `.url_path`, `.id`, `response.code`,
//!   `plugin_name`), filter state read back, response body replacement,
//!   unknown actions; metrics per action, queue items; ticks in both.

use std::time::Duration;

use anyhow::Result;
use zerolayer_e2e::differential::{Pair, Scenario};
use zerolayer_e2e::{EnvoyConfig, paths, wait};

const RULES: &str = include_str!("../fixtures/activation-rules.json");

#[test]
fn activation_behaves_the_same_in_envoy_and_host_sim() -> Result<()> {
    paths::wasm("activation")?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?;
    let mut rules: serde_json::Value = serde_json::from_str(RULES)?;
    rules["debug_response_header"] = serde_json::Value::Bool(true);
    config.set_wasm_filter_config("zerolayer.activation", &rules.to_string())?;
    config.add_route_request_header(
        "x-test-observers",
        "%FILTER_STATE(wasm.wasmx.zerolayer_observers:PLAIN)%",
    )?;
    let pair = Pair::start(config)?;

    let scenarios = vec![
        Scenario::get("defaults", "/v1/models").header("x-request-id", "fixed-1"),
        Scenario::get("tenant", "/v1/models")
            .header("x-tenant-id", "acme")
            .header("x-request-id", "fixed-2"),
        Scenario::post("llm", "/v1/messages?beta=1", r#"{"model":"m"}"#)
            .header("x-request-id", "fixed-3"),
        Scenario::post("quiet", "/v1/messages", "{}")
            .header("x-quiet", "1")
            .header("x-request-id", "fixed-4"),
        Scenario::get("sdk", "/")
            .header("user-agent", "AsyncAnthropic/Python 2.16.0")
            .header("x-request-id", "fixed-5"),
        Scenario::get("forged", "/")
            .header("x-zerolayer-observers", "cache,shadow")
            .header("x-request-id", "fixed-6"),
        Scenario::get("upstream_sets_internal", "/")
            .header("x-echo-set-header", "x-zerolayer-debug=forged")
            .header("x-request-id", "fixed-7"),
    ];
    let mut canary_ids = 0;
    for i in 0..40 {
        let id = format!("canary-{i}");
        let (envoy, sim) =
            pair.run(&Scenario::get(&format!("canary-{i}"), "/").header("x-request-id", &id))?;
        assert_eq!(envoy, sim, "canary-{i}");
        canary_ids += 1;
    }
    for scenario in &scenarios {
        let (envoy, sim) = pair.run(scenario)?;
        assert_eq!(envoy, sim, "scenario {}", scenario.name);
        assert!(
            envoy.upstream.is_some(),
            "{} never reached the upstream",
            scenario.name
        );
    }
    let total = (scenarios.len() + canary_ids) as f64;
    pair.wait_metric_agree("zerolayer_activation_requests", total)?;
    let (envoy, sim) = pair.metrics(&["zerolayer_activation_"])?;
    assert_eq!(envoy, sim);
    assert_eq!(
        envoy.get(r#"zerolayer_activation_rule_matches{rule="premium"}"#),
        Some(&1.0)
    );
    Ok(())
}

/// The probe filter (`host-sim/probe`) makes host features visible; its
/// Envoy config runs a singleton service and the filter.
fn probe_pair() -> Result<Pair> {
    paths::wasm("probe")?;
    Pair::start(EnvoyConfig::load(
        &paths::root().join("host-sim/probe/envoy.yaml"),
    )?)
}

fn probe(name: &str, actions: &str) -> Scenario {
    Scenario::get(name, "/probe").header("x-probe-action", actions)
}

#[test]
fn probe_host_features_behave_the_same_in_envoy_and_host_sim() -> Result<()> {
    let pair = probe_pair()?;
    let scenarios = vec![
        // Shared data with CAS: each host counts its own requests.
        probe("incr-1", "shared-incr"),
        probe("incr-2", "shared-incr"),
        probe("cas", "cas-stale"),
        // Queues to the singleton service.
        probe("enqueue-1", "enqueue"),
        probe("enqueue-2", "enqueue"),
        // Local responses stop the request and skip the upstream.
        probe("local", "local-403"),
        probe("local-after-incr", "shared-incr,local-429"),
        // Callouts pause the request and resume it.
        probe("callout", "callout"),
        probe("callout-and-more", "shared-incr,callout,set-state"),
        // Body buffering with headers paused (StopIteration semantics).
        Scenario::post("body", "/probe", &"x".repeat(3000)).header("x-probe-action", "body-size"),
        // A filter buffering a request body past Envoy's buffer limit
        // (1 MiB): 413 from Envoy, through the filter's response callbacks.
        Scenario::post("body at the buffer limit", "/probe", &"x".repeat(1024 * 1024))
            .header("x-probe-action", "body-size"),
        Scenario::post("body past the buffer limit", "/probe", &"x".repeat(1024 * 1024 + 1))
            .header("x-probe-action", "body-size"),
        Scenario::post("callout-with-body", "/probe", &"y".repeat(5000)).header("x-probe-action", "callout"),
        probe("body-empty", "body-size"),
        // Properties and filter state.
        probe(
            "properties",
            "property-request.path,property-request.method,property-request.url_path,property-plugin_name,property-request.id,property-response.code",
        )
        .header("x-request-id", "fixed-id"),
        probe("state", "set-state"),
        // Response body replaced after buffering.
        probe("replace", "replace-body"),
                probe("unknown", "no-such-action"),
        // A filter's request headers are gone in the response phase once it
        // let them through; a filter that paused them keeps them.
        probe("late-headers", "late-headers"),
        probe("late-headers-after-callout", "callout,late-headers"),
    ];
    for scenario in &scenarios {
        let (envoy, sim) = pair.run(scenario)?;
        assert_eq!(envoy, sim, "scenario {}", scenario.name);
        if scenario.name == "body past the buffer limit" {
            assert_eq!(envoy.status, 413, "{envoy:?}");
            assert_eq!(envoy.client_body, "Payload Too Large");
        }
    }
    // The singleton drained both enqueued items in each host.
    pair.wait_metric_agree("probe_queue_items", 2.0)?;
    // Metrics agree (tick counters excepted: they follow wall time).
    let (envoy, sim) = pair.metrics(&["probe_requests", "probe_actions", "probe_queue_items"])?;
    assert_eq!(envoy, sim);
    assert_eq!(envoy.get(r#"probe_actions{action="enqueue"}"#), Some(&2.0));
    // Ticks fire in both (the singleton ticks every 500 ms; the scenarios
    // may all be done before the first one).
    let ticking =
        |m: &std::collections::BTreeMap<String, f64>| !m.is_empty() && m.values().all(|v| *v > 0.0);
    wait::until(
        "the singleton ticking in both hosts",
        Duration::from_secs(5),
        || {
            let (e, s) = pair.metrics(&["probe_singleton_ticks"])?;
            Ok((ticking(&e) && ticking(&s)).then_some(()))
        },
    )?;
    Ok(())
}

#[test]
fn paused_headers_stop_all_iteration_by_default_in_both_hosts() -> Result<()> {
    // Without `allow_on_headers_stop_iteration`, a filter that pauses its
    // headers (here for a callout) sees no body until it resumes; the body
    // waits and then flows whole, in Envoy and in host-sim alike.
    paths::wasm("probe")?;
    let mut config = EnvoyConfig::load(&paths::root().join("host-sim/probe/envoy.yaml"))?;
    config.set_wasm_filter_option("probe", "allow_on_headers_stop_iteration", None)?;
    let pair = Pair::start(config)?;
    for scenario in [
        Scenario::post("callout-with-body", "/probe", &"z".repeat(20_000))
            .header("x-probe-action", "callout"),
        Scenario::post("callout-then-state", "/probe", "small")
            .header("x-probe-action", "callout,set-state"),
        probe("body-empty", "body-size"),
    ] {
        let (envoy, sim) = pair.run(&scenario)?;
        assert_eq!(envoy, sim, "scenario {}", scenario.name);
        let upstream = envoy.upstream.as_ref().map(|u| u.body.len());
        assert_eq!(
            upstream,
            Some(scenario.body.len()),
            "{}: body reached the upstream whole",
            scenario.name
        );
    }
    Ok(())
}
