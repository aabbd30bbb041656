//! The request as an operator writes it in the playground (JSON), and its
//! view as [`RequestFacts`] for core's engine, mirroring how the activation
//! filter reads a request: headers by name (any case), `:path` and
//! `:method`, the tenant from the configured tenant header, the request id
//! from `x-request-id`.

use std::collections::BTreeMap;

use serde::Deserialize;
use zerolayer_core::ConfigError;
use zerolayer_core::activation::{HeaderSlot, RequestFacts, RuleSet};
use zerolayer_core::config::{ROOT, from_json, quoted};

use crate::time::parse_rfc3339;

/// The request JSON.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestInput {
    /// `:method`.
    method: String,
    /// `:path`, query string included.
    path: String,
    /// Request headers, name → value.
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// RFC 3339 text or Unix seconds; the current time when absent.
    #[serde(default)]
    time: Option<serde_json::Value>,
    /// The tenant lazy-auth verified, which replaces the tenant header's.
    #[serde(default)]
    tenant: Option<String>,
}

/// A request ready for evaluation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaygroundRequest {
    method: String,
    path: String,
    /// (name, value), sorted by name.
    headers: Vec<(String, String)>,
    /// Unix seconds.
    pub(crate) unix_seconds: i64,
    /// Whether `unix_seconds` came from the request (else it is "now").
    pub(crate) time_given: bool,
    verified_tenant: Option<String>,
}

impl PlaygroundRequest {
    /// Parses the request JSON; `now` (Unix seconds) stands in for a
    /// missing `time`. Errors name the field, like configuration errors.
    pub fn from_json(text: &str, now: i64) -> Result<PlaygroundRequest, ConfigError> {
        if text.trim().is_empty() {
            return Err(ConfigError::new(
                ROOT,
                r#"empty; expected a JSON object like {"method": "GET", "path": "/"}"#,
            ));
        }
        let input: RequestInput = from_json(text.as_bytes())?;
        if input.method.is_empty() {
            return Err(ConfigError::new("method", "must not be empty"));
        }
        if !input.path.starts_with('/') {
            return Err(ConfigError::new(
                "path",
                format!("must start with \"/\" (got {})", quoted(&input.path)),
            ));
        }
        let mut headers: Vec<(String, String)> = Vec::with_capacity(input.headers.len());
        for (name, value) in input.headers {
            if name.is_empty() {
                return Err(ConfigError::new("headers", "a header name is empty"));
            }
            if let Some(field) = ["path", "method"].into_iter().find(|f| {
                name.strip_prefix(':')
                    .is_some_and(|n| n.eq_ignore_ascii_case(f))
            }) {
                return Err(ConfigError::new(
                    format!("headers.{name}"),
                    format!("give it as the request's \"{field}\" field"),
                ));
            }
            if let Some((earlier, _)) = headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(&name))
            {
                return Err(ConfigError::new(
                    format!("headers.{name}"),
                    format!(
                        "same header as {} (names are case-insensitive)",
                        quoted(earlier)
                    ),
                ));
            }
            headers.push((name, value));
        }
        let (unix_seconds, time_given) = match input.time {
            None | Some(serde_json::Value::Null) => (now, false),
            Some(value) => (unix_seconds(&value)?, true),
        };
        Ok(PlaygroundRequest {
            method: input.method,
            path: input.path,
            headers,
            unix_seconds,
            time_given,
            verified_tenant: input.tenant,
        })
    }

    /// The value of header `name` (any case).
    fn lookup(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The request as `rules` see it.
    pub fn facts<'a>(&'a self, rules: &'a RuleSet) -> Facts<'a> {
        Facts {
            request: self,
            rules,
        }
    }
}

/// `time` as Unix seconds: an integer, or RFC 3339 text.
fn unix_seconds(value: &serde_json::Value) -> Result<i64, ConfigError> {
    match value {
        serde_json::Value::Number(n) => n.as_i64().ok_or_else(|| {
            ConfigError::new("time", format!("{n} is not a whole number of Unix seconds"))
        }),
        serde_json::Value::String(text) => parse_rfc3339(text).ok_or_else(|| {
            ConfigError::new(
                "time",
                format!(
                    "{} is not an RFC 3339 time such as \"2026-11-29T12:00:00Z\"",
                    quoted(text)
                ),
            )
        }),
        other => Err(ConfigError::new(
            "time",
            format!("expected RFC 3339 text or Unix seconds, got {other}"),
        )),
    }
}

/// A [`PlaygroundRequest`] under one rule set (header slots → names).
pub struct Facts<'a> {
    request: &'a PlaygroundRequest,
    rules: &'a RuleSet,
}

impl Facts<'_> {
    /// The tenant the rules see: the verified one, else the tenant header's.
    pub fn tenant_str(&self) -> Option<&str> {
        match &self.request.verified_tenant {
            Some(tenant) => Some(tenant),
            None => self.request.lookup(self.rules.tenant_header()),
        }
    }
}

impl RequestFacts for Facts<'_> {
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]> {
        let name = self.rules.header_names().get(slot)?;
        match &**name {
            ":path" => Some(self.request.path.as_bytes()),
            ":method" => Some(self.request.method.as_bytes()),
            name => self.request.lookup(name).map(str::as_bytes),
        }
    }

    fn path(&self) -> &[u8] {
        self.request.path.as_bytes()
    }

    fn method(&self) -> &[u8] {
        self.request.method.as_bytes()
    }

    fn tenant(&self) -> Option<&[u8]> {
        self.tenant_str().map(str::as_bytes)
    }

    fn request_id(&self) -> Option<&[u8]> {
        self.request.lookup("x-request-id").map(str::as_bytes)
    }

    fn unix_seconds(&self) -> i64 {
        self.request.unix_seconds
    }
}
