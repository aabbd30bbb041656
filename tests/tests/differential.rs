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

use anyhow::Result;
use zerolayer_e2e::differential::{Pair, Scenario};
use zerolayer_e2e::{EnvoyConfig, paths};

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
            .header("user-agent", "anthropic-python/0.40")
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
