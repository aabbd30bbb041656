//! What the Envoy load benchmarks share: a minimal bootstrap around the
//! filters under test, starting it, and percentiles.
#![allow(dead_code)]

use std::time::Duration;

use anyhow::{Context, Result};
use zerolayer_e2e::{Envoy, EnvoyConfig};

/// A bootstrap with one listener whose HTTP filters are `filters` (YAML list
/// items, indented for `http_filters`) before the router, and one cluster
/// `backend` (pointed at the upstream by [`start`]).
pub fn hcm(filters: &str) -> String {
    format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}}}
static_resources:
  listeners:
  - address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: backend}}
          http_filters:
{filters}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: backend
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 1}}}}}}
"#
    )
}

/// Writes `yaml` into `dir` and starts Envoy on it in front of `upstream`,
/// with `env` in Envoy's environment.
pub fn start(
    yaml: &str,
    upstream: std::net::SocketAddr,
    dir: &std::path::Path,
    name: &str,
    env: &[(&str, &str)],
) -> Result<Envoy> {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml)?;
    let mut config = EnvoyConfig::load(&path)?.for_run(upstream)?;
    for (k, v) in env {
        config = config.env(k, v);
    }
    Envoy::start(&config).with_context(|| format!("starting {name}"))
}

/// The `p` quantile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// quota with eight policies, every one scoping each bench request, none
/// ever refusing one (limits far above what a run spends): what holding,
/// reserving and settling eight leases per request costs, leases granted by
/// Redis through webdis in the background.
pub fn quota_section() -> serde_json::Value {
    let budget = |window: &str| serde_json::json!({"budget": {"amount": 1_000_000_000_000u64, "window": window}});
    let rate = serde_json::json!({"rate": {"amount": 10_000_000_000u64, "per": "minute"}});
    let weights = serde_json::json!({"weighted_tokens": {"default": {"input": 1000, "output": 4000, "cache_read": 100}}});
    let prices = serde_json::json!({"currency": {"default": {"input": 3_000_000, "output": 15_000_000, "cache_read": 300_000}}});
    serde_json::json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 1, "key_prefix": "zl:bench:"},
        "policies": [
            {"name": "tenant-day", "scope": ["tenant"], "unit": "tokens", "limit": budget("day")},
            {"name": "tenant-minute", "scope": ["tenant"], "unit": "tokens", "limit": rate},
            {"name": "tenant-requests", "scope": ["tenant"], "unit": "requests", "limit": rate},
            {"name": "subject-month", "scope": ["subject"], "unit": "tokens", "limit": budget("month")},
            {"name": "model-hour", "scope": ["model"], "unit": "tokens", "limit": budget("hour")},
            {"name": "tenant-model", "scope": ["tenant", "model"], "unit": weights, "limit": budget("day")},
            {"name": "tenant-spend", "scope": ["tenant"], "unit": prices, "limit": budget("month")},
            {"name": "fleet", "scope": [], "unit": "tokens", "limit": rate},
        ],
    })
}
