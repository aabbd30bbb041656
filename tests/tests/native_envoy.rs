//! zerolayer's native form, the Envoy dynamic module (`filters/native`), in
//! the pinned Envoy: it loads and serves, refuses a
//! filter it does not know (the shipped module the floor probes too), and
//! the probes' build's floor probes (feature `probes`) do in Envoy what the
//! Wasm probe's `trivial` and `chain` roles do, request for request (the
//! `envoy_load` bench measures both forms against each other).

use anyhow::{Result, ensure};
use serde_yaml::Value;
use zerolayer_e2e::{Client, EchoUpstream, Envoy, EnvoyConfig, paths, probes};

/// A probe in one of its two forms.
#[derive(Debug, Clone, Copy)]
enum Form {
    Wasm,
    Native,
}

impl Form {
    /// The HTTP filter running probe `role` (`trivial` or `chain`) in this form.
    fn filter(self, role: &str) -> Result<Value> {
        match self {
            Form::Native => probes::native(&format!("probe_{role}")),
            Form::Wasm => probes::wasm(&format!("probe.{role}"), role),
        }
    }
}

/// Envoy with the probe in `role` alone, in `form`, in front of an echo
/// upstream (the native probes from the probes' build).
fn gateway(form: Form, role: &str) -> Result<(EchoUpstream, Envoy)> {
    let probes = paths::native_probe_modules()?;
    let upstream = EchoUpstream::start()?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?
        .for_run(upstream.addr())?
        .env(
            "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
            &probes.display().to_string(),
        );
    config.replace_http_filters(&[form.filter(role)?])?;
    let envoy = Envoy::start(&config)?;
    Ok((upstream, envoy))
}

#[test]
fn the_pinned_envoy_loads_the_module_and_serves_through_it() -> Result<()> {
    // (Envoy 1.40 logs the ABI version match, `v0.2.0`, at debug level
    // only; the string is checked by the module's unit tests.)
    let (upstream, envoy) = gateway(Form::Native, "trivial")?;
    let reply = Client::new().get(&envoy.url("/v1/models"), &[("x-request-id", "load-0")])?;
    ensure!(reply.status == 200, "through the module: {reply:?}");
    ensure!(
        upstream.find("x-request-id", "load-0").is_some(),
        "the upstream saw no request"
    );
    Ok(())
}

#[test]
fn a_filter_the_module_does_not_know_is_refused_at_load() -> Result<()> {
    paths::native_module()?;
    let upstream = EchoUpstream::start()?;
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(upstream.addr())?;
    let mut filter = Form::Native.filter("trivial")?;
    filter["typed_config"]["filter_name"] = Value::from("zerolayer_unknown");
    config.replace_http_filters(&[filter])?;
    ensure!(
        Envoy::start(&config).is_err(),
        "Envoy started with a filter_name the module refuses"
    );
    Ok(())
}

#[test]
fn the_shipped_module_refuses_the_floor_probes_naming_the_field() -> Result<()> {
    // The default search path: the shipped build (`cargo xtask build-native`).
    paths::native_module()?;
    for name in ["probe_trivial", "probe_chain"] {
        let mut config = EnvoyConfig::shipped("activation.yaml")?
            .for_run(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))?;
        config.replace_http_filters(&[probes::native(name)?])?;
        let validation = Envoy::validate(&config)?;
        ensure!(!validation.ok, "{name}: Envoy accepted it");
        let want = format!(
            "zerolayer-native: invalid configuration: filter_name: unknown filter \"{name}\" (expected zerolayer; probe_trivial and probe_chain exist only in a build with feature `probes`"
        );
        ensure!(
            validation.output.contains(&want),
            "{name}: {}",
            validation.output
        );
    }
    Ok(())
}

#[test]
fn the_trivial_probe_adds_two_request_headers_in_both_forms() -> Result<()> {
    for form in [Form::Wasm, Form::Native] {
        let (upstream, envoy) = gateway(form, "trivial")?;
        let reply = Client::new().send(
            "POST",
            &envoy.url("/v1/messages"),
            &[("x-request-id", "trivial-0")],
            r#"{"model":"m"}"#,
        )?;
        ensure!(reply.status == 200, "{form:?}: {reply:?}");
        let seen = upstream
            .find("x-request-id", "trivial-0")
            .ok_or_else(|| anyhow::anyhow!("{form:?}: the upstream saw no request"))?;
        ensure!(
            seen.header("x-trivial-1") == Some("1") && seen.header("x-trivial-2") == Some("2"),
            "{form:?}: the upstream saw {:?}",
            seen.headers
        );
    }
    Ok(())
}

#[test]
fn the_chain_probe_reads_and_writes_the_same_in_both_forms() -> Result<()> {
    let body = format!(r#"{{"model":"m","messages":"{}"}}"#, "x".repeat(100));
    let mut seen_by_form = Vec::new();
    for form in [Form::Wasm, Form::Native] {
        let (upstream, envoy) = gateway(form, "chain")?;
        let reply = Client::new().send(
            "POST",
            &envoy.url("/v1/messages"),
            &[("x-request-id", "chain-0"), ("authorization", "Bearer t")],
            &body,
        )?;
        ensure!(reply.status == 200, "{form:?}: {reply:?}");
        // The probe says what it read: every request header, the whole body.
        let said = reply
            .header("x-zerolayer-probe")
            .unwrap_or_default()
            .to_string();
        let (headers, read) = said
            .strip_prefix("headers=")
            .and_then(|rest| rest.split_once(";body="))
            .ok_or_else(|| anyhow::anyhow!("{form:?}: x-zerolayer-probe {said:?}"))?;
        ensure!(
            read == body.len().to_string(),
            "{form:?}: the probe read a {read} byte body, not {}",
            body.len()
        );
        let headers: usize = headers.parse()?;
        ensure!(
            headers >= 6,
            "{form:?}: the probe read {headers} request headers"
        );
        ensure!(
            reply.body.contains("\"upstream\":\"echo\""),
            "{form:?}: the response body did not come through: {}",
            reply.body
        );
        let seen = upstream
            .find("x-request-id", "chain-0")
            .ok_or_else(|| anyhow::anyhow!("{form:?}: the upstream saw no request"))?;
        ensure!(
            seen.body == body,
            "{form:?}: the body reached the upstream as {:?}",
            seen.body
        );
        seen_by_form.push(headers);
    }
    ensure!(
        seen_by_form[0] == seen_by_form[1],
        "the forms read different request headers: Wasm {}, native {}",
        seen_by_form[0],
        seen_by_form[1]
    );
    Ok(())
}

/// The native chain (`envoy/zerolayer-native.yaml`) end to end in the pinned
/// Envoy: a verified JWT reaches the backend and its answer is cached, the
/// second identical request is a hit, a missing credential is refused, the
/// access log carries identity and usage, and the counters reach
/// `/stats/prometheus` under the Wasm forms' names. (The differential
/// suite, `fused_envoy.rs`, compares it with the other forms in full.)
#[test]
fn the_native_chain_authenticates_caches_meters_and_counts() -> Result<()> {
    use zerolayer_e2e::chain::{Chain, ChainOptions, Form, anthropic};
    let chain = Chain::start(ChainOptions {
        form: Form::Native,
        ..ChainOptions::default()
    })?;
    let alice = chain.verified_bearer("alice", "acme")?;
    let body = anthropic("native smoke", false);
    let first = chain.post(
        "/v1/messages",
        &[("authorization", &alice), ("x-request-id", "native-0")],
        &body,
    )?;
    ensure!(first.status == 200, "first: {first:?}");
    ensure!(first.header("x-cache") == Some("MISS"), "first: {first:?}");
    chain.envoy.wait_metric("zerolayer_cache_stored", 1.0)?;
    let second = chain.post(
        "/v1/messages",
        &[("authorization", &alice), ("x-request-id", "native-1")],
        &body,
    )?;
    ensure!(second.status == 200, "second: {second:?}");
    ensure!(
        second.header("x-cache") == Some("HIT"),
        "second: {second:?}"
    );
    ensure!(second.body == first.body, "the hit's body differs");
    let missing = chain.post("/v1/messages", &[("x-request-id", "native-2")], &body)?;
    ensure!(missing.status == 401, "missing: {missing:?}");
    let log = chain.wait_access_log_for(&["native-0", "native-1", "native-2"])?;
    ensure!(
        log["native-0"]["auth"]
            .as_str()
            .is_some_and(|a| a.starts_with("verified tenant=acme")),
        "native-0: {}",
        log["native-0"]
    );
    ensure!(
        log["native-0"]["usage"]
            .as_str()
            .is_some_and(|u| u.contains("input_tokens")),
        "native-0: {}",
        log["native-0"]
    );
    zerolayer_e2e::wait::until("the counters", std::time::Duration::from_secs(10), || {
        let hits = chain
            .envoy
            .metric(r#"zerolayer_cache_lookups{result="hit"}"#)?;
        let missing = chain
            .envoy
            .metric(r#"zerolayer_auth_decisions{outcome="missing"}"#)?;
        Ok((hits >= Some(1.0) && missing >= Some(1.0)).then_some(()))
    })?;
    Ok(())
}

/// The native chain on two Envoy workers, each with its own stage roots and
/// the process's shared data: concurrent clients on both see one cache (an
/// entry stored by one worker is a hit on the other), one set of verdicts
/// (a token verified once is known to both), and the counters add up
/// across workers.
#[test]
fn the_native_chain_on_two_workers_shares_one_cache_and_one_set_of_verdicts() -> Result<()> {
    use zerolayer_e2e::chain::{Chain, ChainOptions, Form, anthropic, concurrently};
    let chain = Chain::start(ChainOptions {
        form: Form::Native,
        workers: 2,
        ..ChainOptions::default()
    })?;
    let alice = chain.verified_bearer("alice", "acme")?;
    // Four prompts, stored once each (sequentially, so each is one miss).
    let prompts: Vec<String> = (0..4)
        .map(|i| anthropic(&format!("two workers {i}"), false))
        .collect();
    for (i, body) in prompts.iter().enumerate() {
        let id = format!("store-{i}");
        let reply = chain.post(
            "/v1/messages",
            &[("authorization", &alice), ("x-request-id", &id)],
            body,
        )?;
        ensure!(
            reply.status == 200 && reply.header("x-cache") == Some("MISS"),
            "{id}: {reply:?}"
        );
        chain
            .envoy
            .wait_metric("zerolayer_cache_stored", (i + 1) as f64)?;
    }
    // Then 8 clients × 10 requests on fresh connections, spread over both
    // workers: every one a hit, whichever worker stored the entry.
    let replies = concurrently(8, |client| {
        let mut statuses = Vec::new();
        for n in 0..10 {
            let id = format!("spread-{client}-{n}");
            let reply = zerolayer_e2e::Client::new().send(
                "POST",
                &chain.envoy.url("/v1/messages"),
                &[
                    ("authorization", alice.as_str()),
                    ("x-request-id", &id),
                    ("content-type", "application/json"),
                    ("connection", "close"),
                ],
                &prompts[(client + n) % prompts.len()],
            )?;
            statuses.push((
                reply.status,
                reply.header("x-cache").unwrap_or("-").to_string(),
            ));
        }
        Ok(statuses)
    });
    let mut hits = 0;
    for statuses in replies {
        for (status, cache) in statuses? {
            ensure!(status == 200, "a spread request answered {status}");
            ensure!(cache == "HIT", "a spread request was a {cache}, not a hit");
            hits += 1;
        }
    }
    ensure!(hits == 80, "{hits} hits");
    // Both workers took connections (Envoy's per-worker listener stats).
    let stats = zerolayer_e2e::Client::new().get(&chain.envoy.admin_url("/stats"), &[])?;
    for worker in ["worker_0", "worker_1"] {
        let accepted: u64 = stats
            .body
            .lines()
            .filter(|l| {
                l.starts_with("listener.")
                    && l.contains(&format!(".{worker}.downstream_cx_total: "))
            })
            .filter_map(|l| l.rsplit_once(" ")?.1.parse::<u64>().ok())
            .sum();
        ensure!(
            accepted > 0,
            "{worker} took no connection: the test ran on one worker"
        );
    }
    ensure!(
        chain.backend_requests("spread-") == 0,
        "a spread request reached the backend"
    );
    let counted = zerolayer_e2e::wait::settled(
        "the counters of both workers",
        std::time::Duration::from_secs(10),
        || {
            Ok((
                chain
                    .envoy
                    .metric(r#"zerolayer_cache_lookups{result="hit"}"#)?,
                chain
                    .envoy
                    .metric(r#"zerolayer_auth_decisions{outcome="valid_cached"}"#)?,
            ))
        },
    )?;
    ensure!(
        counted == (Some(80.0), Some(84.0)),
        "hits and cached verdicts counted: {counted:?}"
    );
    Ok(())
}
