//! lazy-auth's configuration, shared by the filter (hot path, synchronous
//! checks) and the observer (off-path verification): one schema, one parser.

use serde::Deserialize;

use super::budget::{LazyBudget, VerifyBudget};
use super::credential::{CredentialSource, SourceKind};
use super::escalation::EscalationConfig;
use super::policy::{Policy, UnknownPolicy, VerifierDown};
use crate::breaker::BreakerConfig;
use crate::config::{ConfigError, Endpoint, ObserverLink, invalid_regex, is_token_byte, quoted};

/// JWT verification settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// Accepted issuers (empty: any).
    #[serde(default)]
    pub issuers: Vec<String>,
    /// Accepted audiences (empty: any).
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Clock skew allowed for `exp`/`nbf`, seconds.
    #[serde(default = "default_leeway")]
    pub leeway_secs: u64,
    /// Public keys as JWKs (RSA, EC P-256). Public keys are not secrets.
    #[serde(default)]
    pub keys: Vec<serde_json::Value>,
    /// Environment variable of the VM holding an HS256 secret (at least 32
    /// bytes). Envoy passes
    /// it with `vm_config.environment_variables.host_env_keys`, so the secret
    /// is neither in the plugin configuration nor in `/config_dump`.
    #[serde(default)]
    pub hs256_secret_env: Option<String>,
    /// A JWKS endpoint the observer fetches and refreshes.
    #[serde(default)]
    pub jwks: Option<JwksConfig>,
    /// Claim holding the tenant.
    #[serde(default = "default_tenant_claim")]
    pub tenant_claim: String,
}

fn default_leeway() -> u64 {
    60
}

fn default_tenant_claim() -> String {
    "tenant".into()
}

impl Default for JwtConfig {
    fn default() -> Self {
        JwtConfig {
            issuers: vec![],
            audiences: vec![],
            leeway_secs: default_leeway(),
            keys: vec![],
            hs256_secret_env: None,
            jwks: None,
            tenant_claim: default_tenant_claim(),
        }
    }
}

/// The JWKS endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct JwksConfig {
    /// Where to fetch it.
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// Seconds between refreshes.
    #[serde(default = "default_refresh")]
    pub refresh_secs: u64,
}

fn default_refresh() -> u64 {
    300
}

/// API keys, verified by an HTTP introspection endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct IntrospectionConfig {
    /// Where to ask.
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// Request header the key is sent in.
    #[serde(default = "default_key_header")]
    pub key_header: String,
    /// Where the answer's fields are (JSON pointers).
    #[serde(default)]
    pub response: IntrospectionMapping,
}

fn default_key_header() -> String {
    "x-api-key".into()
}

/// JSON pointers into the introspection answer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct IntrospectionMapping {
    /// Boolean: the key is valid.
    #[serde(default = "default_active")]
    pub active: String,
    /// The tenant.
    #[serde(default = "default_tenant_ptr")]
    pub tenant: String,
    /// The subject.
    #[serde(default = "default_subject_ptr")]
    pub subject: String,
    /// Unix seconds the key expires at (optional in answers).
    #[serde(default = "default_exp_ptr")]
    pub expires_at: String,
}

fn default_active() -> String {
    "/active".into()
}
fn default_tenant_ptr() -> String {
    "/tenant".into()
}
fn default_subject_ptr() -> String {
    "/sub".into()
}
fn default_exp_ptr() -> String {
    "/exp".into()
}

impl Default for IntrospectionMapping {
    fn default() -> Self {
        IntrospectionMapping {
            active: default_active(),
            tenant: default_tenant_ptr(),
            subject: default_subject_ptr(),
            expires_at: default_exp_ptr(),
        }
    }
}

/// A client whose JWTs are verified inline with cached keys (no lazy step).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct TrustedClient {
    /// Regular expression on `user-agent`.
    pub user_agent: String,
}

/// The audit sink (the observer batches records to it as JSON lines).
pub use crate::sink::SinkConfig;

/// lazy-auth's configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct LazyAuthConfig {
    /// Where credentials are read from, in order; the first present wins.
    #[serde(default = "default_sources")]
    pub credentials: Vec<CredentialSource>,
    /// Paths that need no credential (operator config only), each with the
    /// paths under it, matched on the request path's normal form segment by
    /// segment (`/healthz` makes `/healthz/live` public, not
    /// `/healthzv1/messages` nor `/healthz/../v1/messages`; a path with
    /// `%2F`/`%5C` is never public); each must be a normal path itself.
    #[serde(default)]
    pub public_paths: Vec<String>,
    /// Treatment of credentials nobody has verified yet.
    #[serde(default)]
    pub unknown: UnknownPolicy,
    /// Requests a credential may make unverified before it is verified
    /// synchronously (0: never lazy).
    #[serde(default = "default_max_unverified")]
    pub max_unverified_per_token: u32,
    /// Verifications pending at once before new credentials go synchronous.
    #[serde(default = "default_max_pending")]
    pub max_pending: u64,
    /// Longest a valid verdict is trusted, seconds (a revoked key stops
    /// working within this).
    #[serde(default = "default_max_ttl")]
    pub verdict_max_ttl_secs: u64,
    /// How long an invalid verdict is kept, seconds.
    #[serde(default = "default_negative_ttl")]
    pub negative_ttl_secs: u64,
    /// How long a credential's count of unverified requests outlives its
    /// last request, seconds: a colliding newcomer cannot take its place
    /// before, so a credential refused once gets no unverified request
    /// again until it has been silent this long (at least
    /// `negative_ttl_secs`; at most 30 days).
    #[serde(default = "default_unverified_memory")]
    pub unverified_memory_secs: u64,
    /// Shared-data keys (sets) for verdicts and counters (bounds memory; at
    /// least 1).
    #[serde(default = "default_slots")]
    pub verdict_slots: u32,
    /// Verdicts (and per-credential counters) each set holds: credentials
    /// landing in one set keep their own entries; 1–16. Memory is at most
    /// `verdict_slots × verdict_ways` verdicts.
    #[serde(default = "default_ways")]
    pub verdict_ways: u32,
    /// Longest credential accepted, bytes: a longer one is refused (431)
    /// before any hashing, admission or callout; 64–65536.
    #[serde(default = "default_max_credential_bytes")]
    pub max_credential_bytes: u32,
    /// Gateway-wide bounds on lazy admissions (token buckets): past an
    /// empty one, unknown credentials verify synchronously.
    #[serde(default)]
    pub lazy_budget: LazyBudget,
    /// What synchronous introspection may spend (token buckets per client
    /// address and for the gateway, with a reserve for clients that have
    /// not spent theirs): past one, 429 without calling the verifier.
    #[serde(default)]
    pub verify_budget: VerifyBudget,
    /// JWT settings.
    #[serde(default)]
    pub jwt: JwtConfig,
    /// API key introspection (required if a source has kind `api_key`).
    #[serde(default)]
    pub api_keys: Option<IntrospectionConfig>,
    /// Escalation to synchronous verification: per tenant and for "no
    /// tenant" at `failure_ratio`, the whole gateway at
    /// `gateway_failure_ratio`.
    #[serde(default)]
    pub escalation: EscalationConfig,
    /// Clients whose JWTs are verified inline, never lazily.
    #[serde(default)]
    pub trusted_clients: Vec<TrustedClient>,
    /// Unknown credentials while the verifier is down.
    #[serde(default)]
    pub on_verifier_down: VerifierDown,
    /// Breaker on the verifier endpoints.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// Where the observer is.
    #[serde(default)]
    pub observer: ObserverLink,
    /// Audit sink (JSON lines): records for requests activation marks
    /// `audit` and for every request this filter refuses (a security event;
    /// in the shipped chains activation comes after lazy-auth and never sees
    /// a refused request).
    #[serde(default)]
    pub audit: Option<SinkConfig>,
    /// Attribution sink (JSON lines `{"credential","tenant","subject","at_ms"}`):
    /// one row each time the observer finds a lazily admitted credential
    /// valid, so reconciliation bills requests whose record names the
    /// credential (their verdict was still pending at their response's end)
    /// to its verified tenant. Without one they stay `unverified` in the bill.
    #[serde(default)]
    pub attribution: Option<SinkConfig>,
}

fn default_sources() -> Vec<CredentialSource> {
    vec![
        CredentialSource {
            header: "authorization".into(),
            scheme: Some("Bearer".into()),
            kind: SourceKind::Auto,
        },
        CredentialSource {
            header: "x-api-key".into(),
            scheme: None,
            kind: SourceKind::ApiKey,
        },
    ]
}
fn default_max_unverified() -> u32 {
    1
}
fn default_max_pending() -> u64 {
    1000
}
fn default_max_ttl() -> u64 {
    300
}
fn default_negative_ttl() -> u64 {
    60
}
fn default_unverified_memory() -> u64 {
    3600
}
fn default_slots() -> u32 {
    65_536
}
fn default_ways() -> u32 {
    4
}
fn default_max_credential_bytes() -> u32 {
    4096
}

impl LazyAuthConfig {
    /// Parses and checks a JSON configuration.
    pub fn from_json(bytes: &[u8]) -> Result<LazyAuthConfig, ConfigError> {
        let config: LazyAuthConfig = crate::config::from_json(bytes)?;
        config.check()?;
        Ok(config)
    }

    /// The routing policy this configuration sets.
    pub fn policy(&self) -> Policy {
        Policy {
            unknown: self.unknown,
            max_unverified_per_token: self.max_unverified_per_token,
            max_pending: self.max_pending,
            on_verifier_down: self.on_verifier_down,
        }
    }

    /// Checks what serde cannot: references between fields, ranges, regexes.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.credentials.is_empty() {
            return Err(ConfigError::new(
                "credentials",
                "at least one source is required",
            ));
        }
        for (i, source) in self.credentials.iter().enumerate() {
            let valid_name = !source.header.is_empty() && source.header.bytes().all(is_token_byte);
            if !valid_name {
                return Err(ConfigError::new(
                    format!("credentials[{i}].header"),
                    format!("invalid header name {}", quoted(&source.header)),
                ));
            }
            if source.kind == SourceKind::ApiKey && self.api_keys.is_none() {
                return Err(ConfigError::new(
                    format!("credentials[{i}].kind"),
                    "api_key credentials need an `api_keys` introspection endpoint",
                ));
            }
        }
        for (i, path) in self.public_paths.iter().enumerate() {
            if !path.starts_with('/') {
                return Err(ConfigError::new(
                    format!("public_paths[{i}]"),
                    format!("must start with \"/\" (got {})", quoted(path)),
                ));
            }
            // Requests are matched in normal form: a prefix in another form
            // would never match.
            if crate::path::normalize(path.as_bytes()).ok().as_deref() != Some(path.as_bytes()) {
                return Err(ConfigError::new(
                    format!("public_paths[{i}]"),
                    format!(
                        "must be a normal path (no query, empty, `.` or `..` segment, `%` or `\\`; got {})",
                        quoted(path)
                    ),
                ));
            }
        }
        if self.verdict_slots == 0 {
            return Err(ConfigError::new("verdict_slots", "must be at least 1"));
        }
        if !(1..=16).contains(&self.verdict_ways) {
            return Err(ConfigError::new(
                "verdict_ways",
                format!("{} must be between 1 and 16", self.verdict_ways),
            ));
        }
        if !(64..=65_536).contains(&self.max_credential_bytes) {
            return Err(ConfigError::new(
                "max_credential_bytes",
                format!("{} must be between 64 and 65536", self.max_credential_bytes),
            ));
        }
        self.lazy_budget.check("lazy_budget")?;
        self.verify_budget.check("verify_budget")?;
        if self.unverified_memory_secs < self.negative_ttl_secs.max(1)
            || self.unverified_memory_secs > 30 * 86_400
        {
            return Err(ConfigError::new(
                "unverified_memory_secs",
                format!(
                    "{} must be between negative_ttl_secs ({}) and 2592000 (30 days)",
                    self.unverified_memory_secs,
                    self.negative_ttl_secs.max(1)
                ),
            ));
        }
        if self.verdict_max_ttl_secs == 0 {
            return Err(ConfigError::new(
                "verdict_max_ttl_secs",
                "must be at least 1",
            ));
        }
        for (field, ratio) in [
            ("escalation.failure_ratio", self.escalation.failure_ratio),
            (
                "escalation.gateway_failure_ratio",
                self.escalation.gateway_failure_ratio,
            ),
        ] {
            if !(0.0..=1.0).contains(&ratio) || ratio.is_nan() {
                return Err(ConfigError::new(
                    field,
                    format!("{ratio} is not a ratio in 0..=1"),
                ));
            }
        }
        if self.escalation.window_secs < 10 {
            return Err(ConfigError::new(
                "escalation.window_secs",
                format!("{} is too short (at least 10)", self.escalation.window_secs),
            ));
        }
        if self.breaker.failures == 0 {
            return Err(ConfigError::new("breaker.failures", "must be at least 1"));
        }
        for (i, client) in self.trusted_clients.iter().enumerate() {
            if let Err(err) = regex::bytes::Regex::new(&client.user_agent) {
                return Err(ConfigError::new(
                    format!("trusted_clients[{i}].user_agent"),
                    invalid_regex(&client.user_agent, &err),
                ));
            }
        }
        self.observer.validate()?;
        if let Some(attribution) = &self.attribution {
            attribution.check("attribution")?;
        }
        if let Some(audit) = &self.audit {
            audit.check("audit")?;
        }
        Ok(())
    }

    /// How long a per-credential exposure count is kept against colliding
    /// newcomers after the last write of its way: `unverified_memory_secs`
    /// plus the longest a refused request may leave it unwritten
    /// ([`Self::exposure_touch_secs`]), so that it is kept for
    /// `unverified_memory_secs` after the credential's last request.
    pub fn exposure_retention_secs(&self) -> u64 {
        let memory = self
            .unverified_memory_secs
            .max(self.negative_ttl_secs)
            .max(1);
        memory.saturating_add(self.exposure_touch_secs())
    }

    /// How often a refused credential's way is refreshed at most, seconds
    /// (an eighth of the memory: a shared-data write per refused
    /// credential that rare).
    pub fn exposure_touch_secs(&self) -> u64 {
        (self.unverified_memory_secs / 8).max(1)
    }

    /// Whether `path` (query excluded) is public: its normal form (see
    /// [`crate::path`]) is a public path or under one, whole segments
    /// compared (`/healthz` makes `/healthz/live` public, not `/healthzv1`
    /// nor `/healthz/../v1/messages`). A path without a normal form is not.
    pub fn is_public(&self, path: &[u8]) -> bool {
        let Ok(path) = crate::path::normalize(path) else {
            return false;
        };
        self.public_paths
            .iter()
            .any(|p| crate::path::under(&path, p.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let c = LazyAuthConfig::from_json(
            b"{\"api_keys\":{\"cluster\":\"keys\",\"path\":\"/introspect\"}}",
        )
        .unwrap();
        assert_eq!(c.credentials.len(), 2);
        assert_eq!(c.max_unverified_per_token, 1);
        assert_eq!(c.observer.vm_id, "zerolayer");
        assert_eq!(c.api_keys.as_ref().unwrap().endpoint.authority(), "keys");
        assert!(!c.is_public(b"/v1/messages"));
    }

    #[test]
    fn errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                "{}",
                "credentials[1].kind: api_key credentials need an `api_keys` introspection endpoint",
            ),
            (
                r#"{"credentials":[{"header":"x key","kind":"jwt"}]}"#,
                r#"credentials[0].header: invalid header name "x key""#,
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"public_paths":["healthz"]}"#,
                r#"public_paths[0]: must start with "/" (got "healthz")"#,
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"trusted_clients":[{"user_agent":"("}]}"#,
                r#"trusted_clients[0].user_agent: invalid regex "(": unclosed group"#,
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"escalation":{"failure_ratio":1.5}}"#,
                "escalation.failure_ratio: 1.5 is not a ratio in 0..=1",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"unknown":"maybe"}"#,
                "unknown: unknown variant `maybe`, expected `lazy` or `sync` at line 1 column 74",
            ),
            (
                r#"{"credentials":[],"verdict_slots":0}"#,
                "credentials: at least one source is required",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"verdict_ways":0}"#,
                "verdict_ways: 0 must be between 1 and 16",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"max_credential_bytes":10}"#,
                "max_credential_bytes: 10 must be between 64 and 65536",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"lazy_budget":{"gateway":{"per_sec":1,"burst":0}}}"#,
                "lazy_budget.gateway.burst: must be at least 1 (`unknown: sync` turns lazy admission off)",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"lazy_budget":{"per_client":{"per_sec":1}}}"#,
                "lazy_budget.per_client: missing field `burst` at line 1 column 98",
            ),
            (
                r#"{"credentials":[{"header":"authorization","kind":"jwt"}],"escalation":{"gateway_failure_ratio":-1}}"#,
                "escalation.gateway_failure_ratio: -1 is not a ratio in 0..=1",
            ),
        ];
        for (input, want) in cases {
            let err = LazyAuthConfig::from_json(input.as_bytes()).unwrap_err();
            assert_eq!(err.to_string(), *want, "{input}");
        }
    }

    #[test]
    fn public_paths_ignore_the_query() {
        let c = LazyAuthConfig::from_json(
            br#"{"credentials":[{"header":"authorization","kind":"jwt"}],"public_paths":["/healthz"]}"#,
        )
        .unwrap();
        assert!(c.is_public(b"/healthz?probe=1"));
        assert!(!c.is_public(b"/v1/healthz"));
    }

    /// Issue 21 item 8: a raw byte-prefix match made both of these public.
    #[test]
    fn public_paths_match_normal_path_segments() {
        let c = LazyAuthConfig::from_json(
            br#"{"credentials":[{"header":"authorization","kind":"jwt"}],"public_paths":["/healthz","/docs/"]}"#,
        )
        .unwrap();
        for public in [
            "/healthz",
            "/healthz/live",
            "//healthz",
            "/x/../healthz",
            "/docs/a",
        ] {
            assert!(c.is_public(public.as_bytes()), "{public}");
        }
        for private in [
            "/healthzv1/messages",
            "/healthz/../v1/messages",
            "/healthz/%2e%2e/v1/messages",
            "/healthz%2F..%2Fv1/messages",
            "/docs",
            "/v1/messages",
        ] {
            assert!(!c.is_public(private.as_bytes()), "{private}");
        }
        let err = LazyAuthConfig::from_json(
            br#"{"credentials":[{"header":"authorization","kind":"jwt"}],"public_paths":["/a/../b"]}"#,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("public_paths[0]: must be a normal path"),
            "{err}"
        );
    }
}
