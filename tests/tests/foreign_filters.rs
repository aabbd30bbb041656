//! host-sim for anyone's filters: the foreign filters (`host-sim/foreign`,
//! in the shape of the proxy-wasm Rust SDK's examples, nothing of
//! zerolayer's) in real Envoy 1.40 next to `host-sim serve` under the Envoy
//! profile, and in real ngx_wasm_module next to it under the Kong profile.
//! The same requests go to both hosts of a pair and must look the same to
//! the client (status, body, the headers the filters touch, framing), to
//! the upstream (method, path, body, every header) and to the callout
//! target (every header); what the filters logged (the headers they saw,
//! the callout answers, which callbacks ran) must be the same too.
//!
//! Scenarios, by filter (host-sim/README.md, "Differential scenarios"):
//! - http_headers: a proxied request, `/hello` answered by the filter (also
//!   for a gRPC client), a POST; HTTP/1.1 without `Host` and HTTP/1.0.
//! - http_body: a response mentioning "secret" replaced after buffering, one
//!   not, bodies at Envoy's buffer limit, past it, and a 3 MiB POST answered
//!   with 3 MiB.
//! - http_config: the configured header on a proxied response and on the
//!   router's direct response.
//! - http_auth_random: granted, refused (also for a gRPC client), a 2 MiB
//!   POST held during the callout; the callout as the target sees it; an
//!   unknown callout target (Envoy: the VM fails; a gRPC client gets
//!   `grpc-status: 14`); a callout target that refuses connections.
//! - hello_world: `on_vm_start` per root context, ticks; under Kong, the
//!   module on a path that is requested (it has no HTTP context: traps).

use std::time::Instant;

use anyhow::{Context, Result, ensure};
use zerolayer_e2e::differential::{Observed, Scenario};
use zerolayer_e2e::foreign::{ForeignPair, Side, raw_request};

const MIB: usize = 1024 * 1024;

/// Runs every scenario through both hosts of `pair` and checks they agree;
/// returns what the real host did, in order.
fn agree(pair: &ForeignPair, scenarios: &[Scenario]) -> Result<Vec<Observed>> {
    let mut seen = Vec::new();
    for scenario in scenarios {
        let (real, sim) = pair.run(scenario)?;
        ensure!(
            real == sim,
            "scenario {}: the real host and host-sim differ\nreal: {real:#?}\nsim:  {sim:#?}\nreal log tail:\n{}",
            scenario.name,
            pair.real_log_tail(20)
        );
        seen.push(real);
    }
    Ok(seen)
}

/// Both hosts' filter logs, once each has `count` lines matching `pred`,
/// must be the same, line by line.
fn same_logs(pair: &ForeignPair, pred: impl Fn(&str) -> bool, count: usize) -> Result<usize> {
    let (real, sim) = pair.logs_settled(&pred, count)?;
    let real: Vec<&String> = real
        .iter()
        .filter(|l| !l.starts_with("It's tick"))
        .collect();
    let sim: Vec<&String> = sim.iter().filter(|l| !l.starts_with("It's tick")).collect();
    for (i, (r, s)) in real.iter().zip(&sim).enumerate() {
        ensure!(
            r == s,
            "filter log line {i} differs:\nreal: {r}\nsim:  {s}\nreal: {real:#?}\nsim: {sim:#?}"
        );
    }
    ensure!(
        real.len() == sim.len(),
        "the real host logged {} lines, host-sim {}:\nreal: {real:#?}\nsim: {sim:#?}",
        real.len(),
        sim.len()
    );
    Ok(real.len())
}

fn grpc(scenario: Scenario) -> Scenario {
    scenario.header("content-type", "application/grpc")
}

#[test]
fn http_headers_in_envoy_and_host_sim() -> Result<()> {
    let started = Instant::now();
    let pair = ForeignPair::envoy("http_headers", Ok)?.compare_headers(&[
        "powered-by",
        "hello",
        "content-length",
        "transfer-encoding",
        "grpc-status",
        "grpc-message",
    ]);
    let seen = agree(
        &pair,
        &[
            Scenario::get("proxied", "/headers?x=1").header("x-custom", "Value"),
            Scenario::get("answered by the filter", "/hello"),
            grpc(Scenario::get("answered to a gRPC client", "/hello")),
            Scenario::post("post", "/upload", "a body"),
        ],
    )?;
    ensure!(seen[0].upstream.is_some() && seen[1].upstream.is_none());
    // A gRPC client gets Envoy's gRPC form of the filter's local response.
    ensure!(seen[2].status == 200, "{:?}", seen[2]);
    ensure!(
        seen[2]
            .client_headers
            .get("grpc-status")
            .map(String::as_str)
            == Some("2")
    );
    ensure!(
        seen[2]
            .client_headers
            .get("grpc-message")
            .map(String::as_str)
            == Some("Hello, World!%0A")
    );
    // Requests Envoy's connection manager refuses before any filter runs:
    // the filters see only on_log ("completed.").
    for (name, request, status) in [
        (
            "HTTP/1.1 without Host",
            "GET /no-host HTTP/1.1\r\n\r\n",
            400,
        ),
        (
            "HTTP/1.0",
            "GET /old HTTP/1.0\r\nHost: example\r\n\r\n",
            426,
        ),
    ] {
        let real = raw_request(pair.listener(Side::Real), request)?;
        let sim = raw_request(pair.listener(Side::Sim), request)?;
        ensure!(real.status == status, "{name}: Envoy answered {real:?}");
        let framing = |r: &zerolayer_e2e::foreign::RawReply| {
            (
                r.status,
                r.headers.get("content-length").cloned(),
                r.headers.get("content-type").cloned(),
                r.headers.get("connection").cloned(),
                r.body.clone(),
            )
        };
        ensure!(
            framing(&real) == framing(&sim),
            "{name}: Envoy {real:?}, host-sim {sim:?}"
        );
    }
    let lines = same_logs(&pair, |l| l == "# completed.", 6)?;
    eprintln!(
        "http_headers (Envoy): 6 requests and {lines} log lines compared in {:?}",
        started.elapsed()
    );
    Ok(())
}

#[test]
fn http_body_in_envoy_and_host_sim_with_envoys_buffer_limit() -> Result<()> {
    let started = Instant::now();
    let pair = ForeignPair::envoy("http_body", Ok)?
        .compare_headers(&["content-length", "transfer-encoding"]);
    let bytes =
        |name: &str, n: usize| Scenario::get(name, "/bytes").header("x-test-bytes", &n.to_string());
    let seen = agree(
        &pair,
        &[
            Scenario::get("secret", "/s").header("x-test-body", "the secret is out"),
            Scenario::get("no secret", "/n").header("x-test-body", "nothing to hide"),
            bytes("at the limit", MIB),
            bytes("one byte past the limit", MIB + 1),
            bytes("2 MiB", 2 * MIB),
            Scenario::post(
                "3 MiB POST answered with 3 MiB",
                "/echo",
                &"p".repeat(3 * MIB),
            )
            .header("x-test-bytes", &(3 * MIB).to_string()),
        ],
    )?;
    ensure!(
        seen[0].client_body == "Original message body (17 bytes) redacted.\n",
        "{:?}",
        seen[0]
    );
    ensure!(seen[2].client_body.len() == MIB, "at the limit: whole");
    for cut in &seen[3..] {
        // Envoy sent the headers, then closed the connection: no body.
        ensure!(
            cut.status == 200 && cut.client_body == "[cut after 0 bytes]",
            "{cut:?}"
        );
    }
    ensure!(
        seen[5].upstream.as_ref().map(|u| u.body.len()) == Some(3 * MIB),
        "the 3 MiB request body streams through"
    );
    eprintln!(
        "http_body (Envoy): 6 requests compared in {:?}",
        started.elapsed()
    );
    Ok(())
}

#[test]
fn http_config_in_envoy_and_host_sim_on_proxied_and_direct_responses() -> Result<()> {
    let pair = ForeignPair::envoy("http_config", Ok)?.compare_headers(&[
        "custom-header",
        "content-length",
        "transfer-encoding",
    ]);
    let seen = agree(
        &pair,
        &[
            Scenario::get("proxied", "/x"),
            Scenario::get("direct response", "/direct"),
            Scenario::post("direct response to a POST", "/direct/p", "body"),
        ],
    )?;
    let header = "The secret to life is meaningless unless you discover it yourself";
    for s in &seen {
        ensure!(
            s.client_headers.get("custom-header").map(String::as_str) == Some(header),
            "{s:?}"
        );
    }
    ensure!(
        seen[1].upstream.is_none()
            && seen[1].client_body == "Inspect the HTTP header: custom-header.\n"
    );
    Ok(())
}

#[test]
fn http_auth_random_in_envoy_and_host_sim() -> Result<()> {
    let started = Instant::now();
    let pair = ForeignPair::envoy("http_auth_random", Ok)?.compare_headers(&[
        "powered-by",
        "content-length",
        "grpc-status",
        "grpc-message",
    ]);
    let mut requests = 0;
    for (byte, scenarios) in [
        (
            b'0',
            vec![
                Scenario::get("granted", "/granted"),
                Scenario::post(
                    "2 MiB POST held during the callout",
                    "/big",
                    &"b".repeat(2 * MIB),
                ),
            ],
        ),
        (
            b'1',
            vec![
                Scenario::get("refused", "/refused"),
                grpc(Scenario::get("refused, gRPC client", "/refused-grpc")),
            ],
        ),
    ] {
        pair.backend.set_byte(byte);
        let seen = agree(&pair, &scenarios)?;
        requests += seen.len();
        if byte == b'0' {
            ensure!(seen.iter().all(|s| s.status == 200 && s.upstream.is_some()));
            ensure!(seen[1].upstream.as_ref().map(|u| u.body.len()) == Some(2 * MIB));
        } else {
            ensure!(
                seen[0].status == 403 && seen[0].upstream.is_none(),
                "{:?}",
                seen[0]
            );
            ensure!(
                seen[1].status == 200
                    && seen[1]
                        .client_headers
                        .get("grpc-status")
                        .map(String::as_str)
                        == Some("7"),
                "{:?}",
                seen[1]
            );
        }
    }
    // Every callout as the target saw it: Envoy's headers, in both.
    let callouts = pair.callouts();
    ensure!(callouts.len() == 2 * requests, "{callouts:#?}");
    for pair_of in callouts.chunks(2) {
        ensure!(
            pair_of[0] == pair_of[1],
            "the callout differs:\nreal: {:?}\nsim:  {:?}",
            pair_of[0],
            pair_of[1]
        );
    }
    ensure!(
        callouts[0].2.get("x-envoy-internal").map(String::as_str) == Some("true")
            && !callouts[0].2.contains_key("user-agent"),
        "{:?}",
        callouts[0]
    );
    // What the filter saw of each answer, and of each request.
    let lines = same_logs(&pair, |l| l.starts_with("Access"), requests)?;
    eprintln!(
        "http_auth_random (Envoy): {requests} requests, {} callouts and {lines} log lines compared in {:?}",
        callouts.len(),
        started.elapsed()
    );
    Ok(())
}

#[test]
fn http_auth_random_failing_in_envoy_and_host_sim() -> Result<()> {
    // A callout to a cluster Envoy does not have: `dispatch_http_call`
    // fails, the SDK example's unwrap() panics and the VM fails; every
    // request from then on is refused, in gRPC form for a gRPC client.
    let pair = ForeignPair::envoy("http_auth_random", |mut config| {
        config.set_wasm_filter_option(
            "envoy.filters.http.wasm",
            "configuration",
            Some(serde_yaml::from_str(
                r#"{"@type": "type.googleapis.com/google.protobuf.StringValue", value: nowhere}"#,
            )?),
        )?;
        Ok(config)
    })
    .context("http_auth_random with an unknown cluster")?
    .compare_headers(&["content-length", "grpc-status", "grpc-message"]);
    let seen = agree(
        &pair,
        &[
            grpc(Scenario::get("gRPC client, the VM fails", "/a")),
            grpc(Scenario::get("gRPC client, the VM failed", "/b")),
            Scenario::get("plain client, the VM failed", "/c"),
        ],
    )?;
    ensure!(
        seen[..2].iter().all(|s| s.status == 200
            && s.client_headers.get("grpc-status").map(String::as_str) == Some("14")),
        "{seen:#?}"
    );
    ensure!(seen[2].status == 503, "{:?}", seen[2]);

    // A callout target that refuses connections: Envoy answers the callout
    // itself (503, its text); the filter refuses the request.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let pair = ForeignPair::envoy("http_auth_random", |config| {
        config.point_cluster("httpbin", closed)
    })?
    .compare_headers(&["content-length"]);
    let seen = agree(&pair, &[Scenario::get("target down", "/down")])?;
    ensure!(seen[0].status == 403, "{:?}", seen[0]);
    same_logs(&pair, |l| l.starts_with("Access"), 1)?;
    Ok(())
}

#[test]
fn hello_world_in_envoy_and_host_sim() -> Result<()> {
    let pair = ForeignPair::envoy("hello_world", Ok)?;
    // The singleton ticks every 200 ms in both.
    let (real, sim) = pair
        .logs_settled(|l| l.starts_with("It's tick 3,"), 1)
        .with_context(|| {
            format!(
                "real: {:?}\nsim: {:?}",
                pair.logs(Side::Real),
                pair.logs(Side::Sim)
            )
        })?;
    let hello = |log: &[String]| log.iter().filter(|l| *l == "Hello, World!").count();
    // Envoy starts the service's root context twice: in its configuration
    // canary, then on the main thread.
    ensure!(hello(&real) == 2, "Envoy: {real:?}");
    ensure!(hello(&sim) == hello(&real), "host-sim: {sim:?}");
    // The listener's direct response, with no filter in the chain.
    let seen = agree(&pair, &[Scenario::get("direct", "/")])?;
    ensure!(seen[0].client_body == "hello\n");
    Ok(())
}
