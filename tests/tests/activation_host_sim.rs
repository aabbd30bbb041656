//! The activation filter in host-sim: the very `.wasm` Envoy loads, driven
//! step by step with virtual time.

use std::time::Duration;

use anyhow::{Context, Result};
use host_sim::{ChainId, Host, PluginSpec};
use zerolayer_e2e::{paths, sim};

const RULES: &str = include_str!("../fixtures/activation-rules.json");
const OBSERVERS: &str = "wasmx.zerolayer_observers";

fn host_with(rules: &str) -> Result<(Host, ChainId)> {
    let mut host = sim::host()?;
    let chain = host.add_chain(vec![
        PluginSpec::new("zerolayer.activation", paths::wasm("activation")?).configuration(rules),
    ])?;
    Ok((host, chain))
}

fn observers(state: Option<Vec<u8>>) -> String {
    String::from_utf8(state.unwrap_or_default()).unwrap_or_default()
}

#[test]
fn decision_is_published_as_filter_state_and_forged_headers_are_removed() -> Result<()> {
    let (mut host, chain) = host_with(RULES)?;
    let mut s = host.stream(chain)?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("x-tenant-id", "acme"),
            ("x-request-id", "r-1"),
            ("x-zerolayer-observers", "shadow"),
        ],
        true,
    );
    let upstream = s.upstream();
    assert!(upstream.complete);
    assert_eq!(upstream.header("x-zerolayer-observers"), None);
    assert_eq!(
        observers(sim::published(&s, OBSERVERS)),
        "audit,metering,cache"
    );
    // Issue 21 item 9: `x-zerolayer-auth` from the backend reached the
    // client, which reads it as the gateway's.
    s.response_headers(
        &[
            (":status", "200"),
            ("x-zerolayer-debug", "from upstream"),
            ("x-zerolayer-auth", "verified tenant=acme"),
            ("X-ZeroLayer-Anything", "forged"),
            ("x-request-id", "kept"),
        ],
        true,
    );
    let client = s.client();
    for name in [
        "x-zerolayer-debug",
        "x-zerolayer-auth",
        "x-zerolayer-anything",
    ] {
        assert_eq!(client.header(name), None, "{name} reached the client");
    }
    assert_eq!(client.header("x-request-id"), Some("kept"));
    assert!(s.finished());
    Ok(())
}

#[test]
fn counters_reach_the_host_on_the_tick_not_on_the_request_path() -> Result<()> {
    let (mut host, chain) = host_with(RULES)?;
    for _ in 0..3 {
        host.stream(chain)?.request_headers(
            &[
                (":method", "GET"),
                (":path", "/"),
                (":authority", "gw"),
                ("x-tenant-id", "acme"),
            ],
            true,
        );
    }
    // Nothing reported yet: the filter batches counters in Wasm memory.
    assert_eq!(host.metric("zerolayer_activation_requests"), Some(0));
    host.advance(Duration::from_millis(1000));
    assert_eq!(host.metric("zerolayer_activation_requests"), Some(3));
    assert_eq!(
        host.metric("zerolayer_activation_rule_matches_rule=premium"),
        Some(3)
    );
    let text = host.prometheus();
    assert!(
        text.contains(r#"zerolayer_activation_rule_matches{rule="premium"} 3"#),
        "{text}"
    );
    Ok(())
}

#[test]
fn shutdown_flushes_what_the_last_tick_did_not() -> Result<()> {
    let (mut host, chain) = host_with(RULES)?;
    host.stream(chain)?.request_headers(
        &[(":method", "GET"), (":path", "/"), (":authority", "gw")],
        true,
    );
    host.shutdown();
    assert_eq!(host.metric("zerolayer_activation_requests"), Some(1));
    Ok(())
}

#[test]
fn a_bad_configuration_is_refused_with_the_field_in_the_log() -> Result<()> {
    let mut host = sim::host()?;
    let err = host
        .add_chain(vec![
            PluginSpec::new("zerolayer.activation", paths::wasm("activation")?)
                .configuration(r#"{"rules":[{"name":"x","when":{"path":{"matches":"("}}}]}"#),
        ])
        .err()
        .context("the chain loaded despite a bad regex")?;
    assert!(
        format!("{err:#}").contains("refused its configuration"),
        "{err:#}"
    );
    let logs = host.logs_containing("invalid configuration");
    assert_eq!(
        logs,
        [
            r#"activation: invalid configuration: rules[0].when.path.matches: invalid regex "(": unclosed group"#
        ]
    );
    Ok(())
}

#[test]
fn two_workers_have_their_own_vms_and_share_metrics() -> Result<()> {
    let mut host = Host::with_options(host_sim::HostOptions {
        workers: 2,
        ..sim::options()?
    })?;
    let chain = host.add_chain(vec![
        PluginSpec::new("zerolayer.activation", paths::wasm("activation")?).configuration(RULES),
    ])?;
    for _ in 0..4 {
        host.stream(chain)?.request_headers(
            &[(":method", "GET"), (":path", "/"), (":authority", "gw")],
            true,
        );
    }
    host.advance(Duration::from_secs(1));
    assert_eq!(host.metric("zerolayer_activation_requests"), Some(4));
    // One configuration log line per worker VM, and under Envoy one more
    // from its configuration canary.
    let canary = usize::from(!sim::kong());
    assert_eq!(host.logs_containing("configured 5 rules").len(), 2 + canary);
    Ok(())
}
