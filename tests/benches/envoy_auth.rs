//! Added latency of authentication in real Envoy, all configurations in the
//! same run, same tokens, same client: plain proxy, lazy-auth (known token,
//! with the observer), native `jwt_authn` verifying RS256 on every request,
//! and `jwt_authn` with its JWT cache. Sequential keep-alive requests (one
//! in flight), interleaved rounds; reports p50/p99 and the difference to
//! plain. (A loaded run lives with the benchmarks issue.)
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{EchoUpstream, paths};

const ROUNDS: usize = 5;
const PER_ROUND: usize = 400;

fn jwt_authn(cache: bool) -> String {
    let jwks = issuer().jwks().to_string().replace('\'', "''");
    let cache = if cache {
        "\n                  jwt_cache_config: {jwt_cache_size: 1000}"
    } else {
        ""
    };
    format!(
        r#"          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                test:
                  issuer: https://idp.test
                  audiences: [zerolayer]
                  forward: true
                  local_jwks: {{inline_string: '{jwks}'}}{cache}
              rules:
              - match: {{prefix: /}}
                requires: {{provider_name: test}}"#
    )
}

fn lazy_auth(lazy: &serde_json::Value) -> String {
    let wasm = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_lazy_auth.wasm");
    format!(
        r#"          - name: lazy
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: lazy
                vm_config: {{vm_id: zerolayer, runtime: envoy.wasm.runtime.v8, code: {{local: {{filename: {}}}}}}}
                configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{}'}}"#,
        wasm.display(),
        lazy
    )
}

/// A trivial Wasm filter (the probe without actions): the floor any Wasm
/// filter pays in Envoy.
fn trivial() -> String {
    let wasm = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_probe.wasm");
    format!(
        r#"          - name: trivial
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: trivial
                vm_config: {{vm_id: trivial, runtime: envoy.wasm.runtime.v8, code: {{local: {{filename: {}}}}}}}
                configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{{"role":"filter"}}'}}"#,
        wasm.display()
    )
}

fn service(lazy: &serde_json::Value) -> String {
    let wasm = paths::root().join("target/wasm32-wasip1/wasm/zerolayer_observer_service.wasm");
    format!(
        r#"bootstrap_extensions:
- name: envoy.bootstrap.wasm
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.wasm.v3.WasmService
    singleton: true
    config:
      name: observer
      vm_config: {{vm_id: zerolayer, runtime: envoy.wasm.runtime.v8, code: {{local: {{filename: {}}}}}}}
      configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{}'}}
"#,
        wasm.display(),
        json!({"lazy_auth": lazy})
    )
}

fn main() -> Result<()> {
    paths::wasm("lazy_auth")?;
    let upstream = EchoUpstream::start()?;
    let dir = tempfile::tempdir()?;
    let lazy = json!({
        "credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}],
        "jwt": {"keys": issuer().jwks()["keys"], "issuers": ["https://idp.test"], "audiences": ["zerolayer"]},
    });
    let now = tokens::now();
    let token = issuer().rs256(&tokens::claims("bench", "acme", now, 3600));
    let bearer = format!("Bearer {token}");
    let configs = [
        (
            "plain",
            common::start(&common::hcm(""), upstream.addr(), dir.path(), "plain", &[])?,
        ),
        (
            "trivial wasm filter",
            common::start(
                &common::hcm(&trivial()),
                upstream.addr(),
                dir.path(),
                "trivial",
                &[],
            )?,
        ),
        (
            "lazy-auth (known token)",
            common::start(
                &format!("{}{}", service(&lazy), common::hcm(&lazy_auth(&lazy))),
                upstream.addr(),
                dir.path(),
                "lazy",
                &[],
            )?,
        ),
        (
            "jwt_authn RS256",
            common::start(
                &common::hcm(&jwt_authn(false)),
                upstream.addr(),
                dir.path(),
                "jwt",
                &[],
            )?,
        ),
        (
            "jwt_authn RS256 + cache",
            common::start(
                &common::hcm(&jwt_authn(true)),
                upstream.addr(),
                dir.path(),
                "jwtcache",
                &[],
            )?,
        ),
    ];
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); configs.len()];
    // Warm up: lazy-auth verifies the token once; V8 compiles hot paths.
    for (_, envoy) in &configs {
        for _ in 0..200 {
            let r = agent
                .get(envoy.url("/"))
                .header("authorization", &bearer)
                .call()?;
            anyhow::ensure!(
                r.status() == 200,
                "{} answered {}",
                envoy.url("/"),
                r.status()
            );
        }
    }
    for _ in 0..ROUNDS {
        for (i, (_, envoy)) in configs.iter().enumerate() {
            let url = envoy.url("/");
            for _ in 0..PER_ROUND {
                let started = Instant::now();
                let mut r = agent.get(&url).header("authorization", &bearer).call()?;
                let _ = r.body_mut().read_to_vec()?;
                samples[i].push(started.elapsed());
            }
        }
    }
    let mut p50_plain = Duration::ZERO;
    println!(
        "{:<26} {:>10} {:>10} {:>12}",
        "configuration", "p50", "p99", "p50 − plain"
    );
    for (i, (name, _)) in configs.iter().enumerate() {
        let mut s = samples[i].clone();
        s.sort();
        let (p50, p99) = (common::percentile(&s, 0.5), common::percentile(&s, 0.99));
        if i == 0 {
            p50_plain = p50;
        }
        let added = p50.as_secs_f64() * 1e6 - p50_plain.as_secs_f64() * 1e6;
        println!(
            "{name:<26} {:>8.0}µs {:>8.0}µs {:>+10.1}µs",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            added
        );
    }
    Ok(())
}
