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
    // One file for every bench that measures quota (filters/quota's too).
    serde_json::from_str(include_str!(
        "../../../filters/quota/benches/eight_policies.json"
    ))
    .expect("eight_policies.json is JSON")
}
