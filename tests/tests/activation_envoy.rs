//! The activation filter inside real Envoy (V8), in front of a loopback
//! upstream: decisions reach later filters, internal headers never cross
//! the gateway, counters reach `/stats/prometheus`, bad configs are refused.

use std::collections::BTreeSet;

use anyhow::{Context, Result, anyhow};
use zerolayer_core::activation::RuleSet;
use zerolayer_core::sampling::Rate;
use zerolayer_e2e::{Client, EchoUpstream, Envoy, EnvoyConfig, paths};

const FILTER: &str = "zerolayer.activation";
const RULES: &str = include_str!("../fixtures/activation-rules.json");
/// The route copies the published decision into this request header, the
/// way any later filter (here Envoy's router) reads it from filter state.
const SEEN_HEADER: &str = "x-test-observers";

struct Gateway {
    upstream: EchoUpstream,
    envoy: Envoy,
    client: Client,
}

fn gateway(rules: &str, expose_decision_upstream: bool) -> Result<Gateway> {
    paths::wasm("activation")?;
    let upstream = EchoUpstream::start()?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(upstream.addr())?;
    config.set_wasm_filter_config(FILTER, rules)?;
    if expose_decision_upstream {
        config.add_route_request_header(
            SEEN_HEADER,
            "%FILTER_STATE(wasm.wasmx.zerolayer_observers:PLAIN)%",
        )?;
    }
    let envoy = Envoy::start(&config)?;
    Ok(Gateway {
        upstream,
        envoy,
        client: Client::new(),
    })
}

fn set(list: &str) -> BTreeSet<String> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn each_rule_case_reaches_the_upstream_as_the_right_decision() -> Result<()> {
    let gw = gateway(RULES, true)?;
    let canary = Rate::from_percent(50.0).context("rate")?;
    // (case, method, path, headers, decision before the 50% canary rule)
    type Case<'a> = (&'a str, &'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        ("defaults", "GET", "/v1/models", &[], "audit"),
        (
            "tenant",
            "GET",
            "/v1/models",
            &[("x-tenant-id", "acme")],
            "audit,metering",
        ),
        (
            "other_tenant",
            "GET",
            "/v1/models",
            &[("x-tenant-id", "initech")],
            "audit",
        ),
        (
            "llm_post",
            "POST",
            "/v1/messages?beta=1",
            &[],
            "audit,cache",
        ),
        ("llm_get", "GET", "/v1/messages", &[], "audit"),
        (
            "quiet_wins",
            "POST",
            "/v1/messages",
            &[("x-quiet", "1")],
            "",
        ),
        (
            "quiet_keeps_metering",
            "POST",
            "/v1/messages",
            &[("x-quiet", "1"), ("x-tenant-id", "acme")],
            "metering",
        ),
        (
            "sdk",
            "GET",
            "/",
            &[("user-agent", "AsyncAnthropic/Python 2.16.0")],
            "audit,shadow",
        ),
        (
            "sdk_regex_anchored",
            "GET",
            "/",
            &[("user-agent", "my-Anthropic/Python 2.16.0")],
            "audit",
        ),
    ];
    for (case, method, path, headers, want) in cases {
        let mut hs: Vec<(&str, &str)> = headers.to_vec();
        hs.push(("x-test-case", case));
        let reply = gw.client.send(method, &gw.envoy.url(path), &hs, "")?;
        assert_eq!(reply.status, 200, "{case}: {reply:?}");
        let seen = gw
            .upstream
            .find("x-test-case", case)
            .ok_or_else(|| anyhow!("{case}: the upstream never saw the request"))?;
        let id = seen
            .header("x-request-id")
            .context("Envoy always sets x-request-id")?;
        let mut want = set(want);
        if canary.includes(id.as_bytes()) {
            want.insert("metering".into());
        }
        let got = set(seen.header(SEEN_HEADER).unwrap_or(""));
        assert_eq!(got, want, "{case} (request id {id})");
    }
    Ok(())
}

#[test]
fn the_wasm_decision_agrees_with_the_native_engine_on_the_percent_split() -> Result<()> {
    // The same request id must land in the same bucket in the filter (Wasm,
    // inside Envoy) and natively: that is what makes sampling consistent.
    let gw = gateway(
        r#"{"rules":[{"name":"half","when":{"percent":50},"activate":["metering"]}]}"#,
        true,
    )?;
    let rules = RuleSet::from_json(
        br#"{"rules":[{"name":"half","when":{"percent":50},"activate":["metering"]}]}"#,
    )?;
    let rate = Rate::from_percent(50.0).context("rate")?;
    let mut on = 0;
    for i in 0..60 {
        let case = format!("split-{i}");
        gw.client
            .get(&gw.envoy.url("/"), &[("x-test-case", &case)])?;
        let seen = gw
            .upstream
            .find("x-test-case", &case)
            .context("upstream saw it")?;
        let id = seen.header("x-request-id").context("request id")?;
        let native = rate.includes(id.as_bytes());
        let wasm = seen.header(SEEN_HEADER) == Some("metering");
        assert_eq!(wasm, native, "request id {id}");
        on += usize::from(wasm);
        assert_eq!(rules.rule_names().len(), 1);
    }
    // Both outcomes happen (a fixed split would pass the check above too).
    assert!((5..=55).contains(&on), "{on} of 60 sampled");
    Ok(())
}

#[test]
fn internal_headers_never_cross_the_gateway_and_forged_ones_are_ignored() -> Result<()> {
    let gw = gateway(RULES, true)?;
    let reply = gw.client.get(
        &gw.envoy.url("/v1/models"),
        &[
            ("x-test-case", "forged"),
            ("x-zerolayer-observers", "metering,cache,shadow"),
            ("X-ZeroLayer-Debug", "observers=cache"),
            ("x-zerolayer-tenant", "acme"),
            // The upstream answers with a header under our name.
            ("x-echo-set-header", "x-zerolayer-debug=from-upstream"),
        ],
    )?;
    assert_eq!(reply.status, 200);
    let seen = gw
        .upstream
        .find("x-test-case", "forged")
        .context("upstream saw it")?;
    let leaked: Vec<_> = seen
        .headers
        .iter()
        .filter(|(n, _)| n.starts_with("x-zerolayer-"))
        .collect();
    assert!(
        leaked.is_empty(),
        "internal headers reached the upstream: {leaked:?}"
    );
    let id = seen.header("x-request-id").context("request id")?;
    let mut want = set("audit");
    if Rate::from_percent(50.0)
        .context("rate")?
        .includes(id.as_bytes())
    {
        want.insert("metering".into());
    }
    assert_eq!(set(seen.header(SEEN_HEADER).unwrap_or("")), want);
    let to_client: Vec<_> = reply
        .headers
        .iter()
        .filter(|(n, _)| n.starts_with("x-zerolayer-"))
        .collect();
    assert!(
        to_client.is_empty(),
        "internal headers reached the client: {to_client:?}"
    );
    gw.envoy
        .wait_metric("zerolayer_activation_forged_headers", 3.0)?;
    Ok(())
}

#[test]
fn debug_response_header_only_when_the_operator_enables_it() -> Result<()> {
    let mut rules: serde_json::Value = serde_json::from_str(RULES)?;
    rules["debug_response_header"] = serde_json::Value::Bool(true);
    let gw = gateway(&rules.to_string(), false)?;
    let reply = gw.client.send(
        "POST",
        &gw.envoy.url("/v1/messages"),
        &[("x-tenant-id", "acme"), ("x-request-id", "debug-case")],
        "{}",
    )?;
    let debug = reply.header("x-zerolayer-debug").context("debug header")?;
    let (observers, matched) = debug
        .strip_prefix("observers=")
        .and_then(|d| d.split_once("; rules="))
        .with_context(|| format!("debug header format: {debug}"))?;
    assert!(
        set(observers).is_superset(&set("audit,metering,cache")),
        "{debug}"
    );
    assert!(set(matched).is_superset(&set("premium,llm")), "{debug}");

    let quiet = gateway(RULES, false)?;
    let reply = quiet.client.get(&quiet.envoy.url("/"), &[])?;
    assert_eq!(reply.header("x-zerolayer-debug"), None);
    Ok(())
}

#[test]
fn per_rule_and_per_observer_counters_reach_prometheus() -> Result<()> {
    let gw = gateway(RULES, false)?;
    for _ in 0..3 {
        gw.client
            .get(&gw.envoy.url("/"), &[("x-tenant-id", "acme")])?;
    }
    for _ in 0..2 {
        gw.client.send(
            "POST",
            &gw.envoy.url("/v1/messages"),
            &[("x-quiet", "1")],
            "{}",
        )?;
    }
    // Counters are flushed from the filter's tick (1 s), off the request path.
    assert_eq!(
        gw.envoy.wait_metric("zerolayer_activation_requests", 5.0)?,
        5.0
    );
    assert_eq!(
        gw.envoy
            .wait_metric(r#"zerolayer_activation_rule_matches{rule="premium"}"#, 3.0)?,
        3.0
    );
    assert_eq!(
        gw.envoy
            .wait_metric(r#"zerolayer_activation_rule_matches{rule="quiet"}"#, 2.0)?,
        2.0
    );
    assert_eq!(
        gw.envoy
            .wait_metric(r#"zerolayer_activation_rule_matches{rule="llm"}"#, 2.0)?,
        2.0
    );
    // audit: on for the 3 tenant requests, switched off by `quiet` for 2.
    assert_eq!(
        gw.envoy
            .wait_metric(r#"zerolayer_activation_observer_on{observer="audit"}"#, 3.0)?,
        3.0
    );
    // metering: the 3 premium requests at least (the canary may add more).
    assert!(
        gw.envoy.wait_metric(
            r#"zerolayer_activation_observer_on{observer="metering"}"#,
            3.0
        )? >= 3.0
    );
    let text = gw.envoy.prometheus()?;
    assert!(
        text.contains("# TYPE zerolayer_activation_rule_matches counter"),
        "{text}"
    );
    Ok(())
}

#[test]
fn a_bad_regex_is_refused_and_the_error_names_the_field() -> Result<()> {
    paths::wasm("activation")?;
    let upstream = EchoUpstream::start()?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(upstream.addr())?;
    config.set_wasm_filter_config(
        FILTER,
        r#"{"rules":[{"name":"ok"},{"name":"broken","when":{"path":{"matches":"("}}}]}"#,
    )?;
    let validation = Envoy::validate(&config)?;
    assert!(
        !validation.ok,
        "Envoy accepted a bad regex:\n{}",
        validation.output
    );
    let line = r#"activation: invalid configuration: rules[1].when.path.matches: invalid regex "(": unclosed group"#;
    assert!(
        validation.output.contains(line),
        "missing {line:?} in:\n{}",
        validation.output
    );
    // Starting for real fails the same way.
    let err = Envoy::start(&config)
        .err()
        .context("Envoy started with a bad regex")?;
    assert!(format!("{err:#}").contains("unclosed group"), "{err:#}");
    Ok(())
}

#[test]
fn unknown_fields_are_refused_at_load() -> Result<()> {
    paths::wasm("activation")?;
    let upstream = EchoUpstream::start()?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(upstream.addr())?;
    config.set_wasm_filter_config(FILTER, r#"{"rules":[],"skip_auth":true}"#)?;
    let validation = Envoy::validate(&config)?;
    assert!(!validation.ok);
    assert!(
        validation
            .output
            .contains("invalid configuration: skip_auth: unknown field `skip_auth`"),
        "{}",
        validation.output
    );
    Ok(())
}

#[test]
fn shipped_envoy_configs_validate_and_embed_the_documented_example() -> Result<()> {
    paths::wasm("activation")?;
    let dir = paths::root().join("envoy");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            // The shipped configs take secrets from Envoy's environment.
            let secrets = [(
                "ZEROLAYER_CACHE_SECRET".to_string(),
                "validation-only-secret-0123456789abcdef".to_string(),
            )];
            let validation = Envoy::validate_file_with_env(&path, &secrets)?;
            assert!(
                validation.ok,
                "{} does not validate:\n{}",
                path.display(),
                validation.output
            );
            checked += 1;
        }
    }
    assert!(checked >= 1, "no Envoy configs in {}", dir.display());

    let embedded: serde_json::Value = serde_json::from_str(
        &EnvoyConfig::shipped("activation.yaml")?.wasm_filter_config(FILTER)?,
    )?;
    let example: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        paths::root().join("filters/activation/example.json"),
    )?)?;
    assert_eq!(
        embedded, example,
        "envoy/activation.yaml drifted from filters/activation/example.json"
    );
    Ok(())
}
