//! metering's configuration, shared by the filter and the observer (which
//! ships the records): one schema, one parser.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use super::labels::LabelLimits;
use crate::config::ObserverLink;
use crate::config::{ConfigError, is_lowercase_header_name, quoted};
use crate::sampling::Rate;
use crate::sink::SinkConfig;

/// Sampling rates, in percent (two decimals at most).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    /// Rate when neither the tenant nor the environment has one (0–100,
    /// two decimals at most).
    #[serde(default = "default_percent")]
    pub percent: f64,
    /// Rate per environment (`{"prod": 1, "staging": 10}`); the gateway's
    /// own environment is `environment`.
    #[serde(default)]
    pub environments: BTreeMap<String, f64>,
    /// Rate per tenant, over the environment's.
    #[serde(default)]
    pub tenants: BTreeMap<String, f64>,
}

fn default_percent() -> f64 {
    1.0
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            percent: default_percent(),
            environments: BTreeMap::new(),
            tenants: BTreeMap::new(),
        }
    }
}

/// metering's configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct MeteringConfig {
    /// This gateway's environment (selects `sampling.environments`).
    #[serde(default = "default_environment")]
    pub environment: String,
    /// Who gets a full record.
    #[serde(default)]
    pub sampling: SamplingConfig,
    /// Header naming the tenant when lazy-auth published no identity (a
    /// chain without lazy-auth, whose own proxy sets the header); with
    /// lazy-auth in the chain it is never read for billing.
    #[serde(default)]
    pub tenant_header: Option<String>,
    /// What verified credentials without a tenant and public paths are
    /// billed as (1–64 bytes); unverified requests are `unverified`.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = crate::metering::labels::UNKNOWN)))]
    pub default_tenant: Option<String>,
    /// Bounds on metric label values.
    #[serde(default)]
    pub labels: LabelLimits,
    /// Add `stream_options.include_usage` to streamed OpenAI requests that
    /// lack it, and strip the extra usage chunk from what the client sees.
    #[serde(default)]
    pub openai_include_usage: bool,
    /// Largest OpenAI request body held whole for the `include_usage`
    /// rewrite, bytes (1 KiB–64 MiB; keep it below the proxy's request
    /// buffer limit). A larger body is never held: it streams through and
    /// `include_usage` is appended where its JSON object closes (with
    /// `content-length` dropped, so the backend gets it chunked).
    #[serde(default = "default_max_request_bytes")]
    pub max_request_bytes: u32,
    /// Where the observer ships full records (none: metrics and access log only).
    #[serde(default)]
    pub sink: Option<SinkConfig>,
    /// Where the observer is (`mode: tick` in Kong).
    #[serde(default)]
    pub observer: ObserverLink,
}

fn default_max_request_bytes() -> u32 {
    1024 * 1024
}

fn default_environment() -> String {
    "default".into()
}

/// The rates that apply to this gateway, resolved once at configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplingPlan {
    default: Rate,
    tenants: HashMap<String, Rate>,
}

impl SamplingPlan {
    /// The rate for a request of `tenant`.
    pub fn rate(&self, tenant: &str) -> Rate {
        self.tenants.get(tenant).copied().unwrap_or(self.default)
    }
}

impl MeteringConfig {
    /// Parses and checks a JSON configuration.
    pub fn from_json(bytes: &[u8]) -> Result<MeteringConfig, ConfigError> {
        let config: MeteringConfig = crate::config::from_json(bytes)?;
        config.check()?;
        Ok(config)
    }

    /// Checks what serde cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.sampling_plan()?;
        self.observer.validate()?;
        if self.environment.is_empty() {
            return Err(ConfigError::new("environment", "must not be empty"));
        }
        if !(1024..=64 * 1024 * 1024).contains(&self.max_request_bytes) {
            return Err(ConfigError::new(
                "max_request_bytes",
                format!(
                    "{} is outside 1024..=67108864 bytes",
                    self.max_request_bytes
                ),
            ));
        }
        if let Some(header) = &self.tenant_header
            && !is_lowercase_header_name(header)
        {
            return Err(ConfigError::new(
                "tenant_header",
                format!("not a lowercase header name: {}", quoted(header)),
            ));
        }
        if let Some(tenant) = &self.default_tenant
            && (tenant.is_empty() || tenant.len() > crate::metering::labels::MAX_LABEL)
        {
            return Err(ConfigError::new(
                "default_tenant",
                format!(
                    "must be 1 to {} bytes (got {})",
                    crate::metering::labels::MAX_LABEL,
                    tenant.len()
                ),
            ));
        }
        self.labels.check("labels")?;
        if let Some(sink) = &self.sink {
            sink.check("sink")?;
        }
        if self.observer.queue.is_empty() {
            return Err(ConfigError::new("observer.queue", "must not be empty"));
        }
        Ok(())
    }

    /// The rates for this gateway's environment.
    pub fn sampling_plan(&self) -> Result<SamplingPlan, ConfigError> {
        let rate = |path: String, percent: f64| {
            Rate::from_percent(percent).ok_or_else(|| {
                ConfigError::new(
                    path,
                    format!(
                        "{percent} is not a percentage between 0 and 100 with at most two decimals"
                    ),
                )
            })
        };
        let mut default = rate("sampling.percent".into(), self.sampling.percent)?;
        for (environment, percent) in &self.sampling.environments {
            let r = rate(format!("sampling.environments.{environment}"), *percent)?;
            if *environment == self.environment {
                default = r;
            }
        }
        let mut tenants = HashMap::new();
        for (tenant, percent) in &self.sampling.tenants {
            tenants.insert(
                tenant.clone(),
                rate(format!("sampling.tenants.{tenant}"), *percent)?,
            );
        }
        Ok(SamplingPlan { default, tenants })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(json: &str) -> String {
        match MeteringConfig::from_json(json.as_bytes()) {
            Ok(_) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn rates_resolve_tenant_then_environment_then_default() {
        let config = MeteringConfig::from_json(
            br#"{"environment":"staging","sampling":{"percent":0.5,"environments":{"prod":1,"staging":10},"tenants":{"acme":100}}}"#,
        )
        .unwrap();
        let plan = config.sampling_plan().unwrap();
        assert_eq!(plan.rate("acme"), Rate::ALL);
        assert_eq!(plan.rate("other").basis_points(), 1000);
        let prod = MeteringConfig::from_json(br#"{"environment":"dev"}"#).unwrap();
        assert_eq!(prod.sampling_plan().unwrap().rate("x").basis_points(), 100);
    }

    #[test]
    fn bad_values_name_their_field() {
        assert_eq!(
            error(r#"{"sampling":{"environments":{"prod":101}}}"#),
            "sampling.environments.prod: 101 is not a percentage between 0 and 100 with at most two decimals"
        );
        assert!(error(r#"{"sampling":{"percent":0.001}}"#).starts_with("sampling.percent:"));
        assert!(error(r#"{"sampling":{"tenants":{"a":-1}}}"#).starts_with("sampling.tenants.a:"));
        assert!(error(r#"{"tenant_header":"X-Tenant"}"#).starts_with("tenant_header:"));
        assert_eq!(
            error(r#"{"default_tenant":""}"#),
            "default_tenant: must be 1 to 64 bytes (got 0)"
        );
        assert!(error(r#"{"labels":{"max_tenants":0}}"#).starts_with("labels.max_tenants:"));
        assert!(
            error(r#"{"sink":{"cluster":"c","path":"/","batch_max":0}}"#)
                .starts_with("sink.batch_max:")
        );
        assert!(error(r#"{"sample":{}}"#).contains("unknown field `sample`"));
        assert_eq!(error("{}"), "accepted");
    }
}
