//! post-cache's configuration, shared by the filter and the observer (which
//! writes the fleet tier): one schema, one parser.

use serde::Deserialize;

use super::control::TtlPolicy;
use super::key::CacheKey;
use crate::config::{ConfigError, is_lowercase_header_name, quoted};
use crate::config::{Endpoint, ObserverLink};

/// Whose cache a request reads and fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Namespace {
    /// One cache per verified tenant (lazy-auth's identity): a request
    /// without a verified tenant bypasses the cache.
    #[default]
    Tenant,
    /// One cache for everyone: only for deployments where every tenant may
    /// see every other's responses.
    Shared,
}

/// What followers of a leased key do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum StampedeMode {
    /// Wait (bounded) for the lease holder's response, then fall through.
    #[default]
    Wait,
    /// Go upstream at once (no waiting; the lease only keeps the count of
    /// identical requests visible).
    PassThrough,
}

/// Stampede protection.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct StampedeConfig {
    /// What followers do.
    #[serde(default)]
    pub mode: StampedeMode,
    /// How long a lease holds without a response (a dead holder's lease
    /// expires after this), ms.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// Longest a follower waits before going upstream itself, ms.
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
    /// How often waiting followers look for the response, ms.
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
}

fn default_lease_ms() -> u64 {
    60_000
}
fn default_max_wait_ms() -> u64 {
    30_000
}
fn default_poll_ms() -> u64 {
    50
}

impl Default for StampedeConfig {
    fn default() -> Self {
        StampedeConfig {
            mode: StampedeMode::default(),
            lease_ms: default_lease_ms(),
            max_wait_ms: default_max_wait_ms(),
            poll_ms: default_poll_ms(),
        }
    }
}

/// The fleet tier: Redis reached over HTTP through webdis.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// The webdis endpoint (`path` is its base, usually `/`).
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// Whether a local miss asks Redis before going upstream (the request
    /// waits for the answer, at most `timeout_ms`).
    #[serde(default = "default_true")]
    pub read_remote: bool,
    /// Redis key prefix (one deployment's entries; the secret already keeps
    /// deployments apart). Letters, digits and `:_-.` only: it is a URL
    /// path segment.
    #[serde(default = "default_redis_prefix")]
    pub key_prefix: String,
}

impl FleetConfig {
    /// The webdis path reading `key`'s entry (`.txt`: the raw bytes, 404
    /// when absent).
    pub fn get_path(&self, key: &CacheKey) -> String {
        format!("{}GET/{}{}.txt", self.base(), self.key_prefix, key.hex())
    }

    /// The webdis path writing `key`'s entry for `ttl_secs` (the entry is
    /// the PUT body, binary-safe).
    pub fn setex_path(&self, key: &CacheKey, ttl_secs: u32) -> String {
        format!(
            "{}SETEX/{}{}/{ttl_secs}",
            self.base(),
            self.key_prefix,
            key.hex()
        )
    }

    /// `path` with exactly one trailing slash.
    fn base(&self) -> String {
        format!("{}/", self.endpoint.path.trim_end_matches('/'))
    }
}

fn default_true() -> bool {
    true
}
fn default_redis_prefix() -> String {
    "zl:cache:".into()
}

/// post-cache's configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct PostCacheConfig {
    /// Environment variable holding the per-deployment secret that keys
    /// the hash (at least 32 bytes): never in the config itself.
    pub secret_env: String,
    /// Whose cache a request uses.
    #[serde(default)]
    pub namespace: Namespace,
    /// Store/serve policy and TTLs.
    #[serde(default)]
    pub ttl: TtlPolicy,
    /// Entries held at most (shared data has no delete: the index is fixed;
    /// at least 1).
    #[serde(default = "default_max_entries")]
    pub max_entries: u32,
    /// Largest response stored, bytes (at least 1024).
    #[serde(default = "default_max_entry_bytes")]
    pub max_entry_bytes: u32,
    /// Largest request body keyed, bytes: a larger one bypasses the cache
    /// (reason `too_large`) and is never held, so it streams to the
    /// backend (one whose `content-length` says so is not even held for
    /// its first byte). Keep it below the proxy's request buffer limit.
    #[serde(default = "default_max_request_bytes")]
    pub max_request_bytes: u32,
    /// Response headers stored and replayed (lowercase), besides `content-type`.
    #[serde(default)]
    pub stored_headers: Vec<String>,
    /// Stampede protection.
    #[serde(default)]
    pub stampede: StampedeConfig,
    /// Fleet tier (none: local only).
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// Where the observer is (fleet writes go through it).
    #[serde(default)]
    pub observer: ObserverLink,
}

fn default_max_entries() -> u32 {
    1024
}
fn default_max_entry_bytes() -> u32 {
    256 * 1024
}
fn default_max_request_bytes() -> u32 {
    1024 * 1024
}

/// The smallest secret accepted, bytes (HMAC-SHA256 key strength).
pub const MIN_SECRET_BYTES: usize = 32;

impl PostCacheConfig {
    /// Parses and checks a JSON configuration.
    pub fn from_json(bytes: &[u8]) -> Result<PostCacheConfig, ConfigError> {
        let config: PostCacheConfig = crate::config::from_json(bytes)?;
        config.check()?;
        Ok(config)
    }

    /// Checks what serde cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.secret_env.is_empty() {
            return Err(ConfigError::new(
                "secret_env",
                "must name an environment variable",
            ));
        }
        self.ttl.validate_in("ttl")?;
        if self.max_entries == 0 {
            return Err(ConfigError::new("max_entries", "must be at least 1"));
        }
        if self.max_entry_bytes < 1024 {
            return Err(ConfigError::new(
                "max_entry_bytes",
                format!("{} is too small (at least 1024)", self.max_entry_bytes),
            ));
        }
        if self.max_request_bytes == 0 {
            return Err(ConfigError::new("max_request_bytes", "must be at least 1"));
        }
        for (i, name) in self.stored_headers.iter().enumerate() {
            if !is_lowercase_header_name(name) {
                return Err(ConfigError::new(
                    format!("stored_headers[{i}]"),
                    format!("not a lowercase header name: {}", quoted(name)),
                ));
            }
        }
        let s = &self.stampede;
        if s.lease_ms == 0 {
            return Err(ConfigError::new("stampede.lease_ms", "must be at least 1"));
        }
        if s.poll_ms == 0 || s.poll_ms > s.max_wait_ms.max(1) {
            return Err(ConfigError::new(
                "stampede.poll_ms",
                format!(
                    "{} must be between 1 and max_wait_ms ({})",
                    s.poll_ms, s.max_wait_ms
                ),
            ));
        }
        if let Some(fleet) = &self.fleet
            && !fleet
                .key_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b":_-.".contains(&b))
        {
            return Err(ConfigError::new(
                "fleet.key_prefix",
                format!(
                    "only letters, digits and \":_-.\" (got {})",
                    quoted(&fleet.key_prefix)
                ),
            ));
        }
        self.observer.validate()?;
        // A fleet write carries a whole entry: it must fit the queue bound.
        if self.fleet.is_some()
            && self.observer.max_queued_bytes < u64::from(self.max_entry_bytes) + 4096
        {
            return Err(ConfigError::new(
                "observer.max_queued_bytes",
                format!(
                    "must hold one fleet write: at least max_entry_bytes + 4096 ({})",
                    u64::from(self.max_entry_bytes) + 4096
                ),
            ));
        }
        if let Some(fleet) = &self.fleet
            && !fleet.endpoint.path.starts_with('/')
        {
            return Err(ConfigError::new(
                "fleet.path",
                format!(
                    "must start with \"/\" (got {})",
                    quoted(&fleet.endpoint.path)
                ),
            ));
        }
        Ok(())
    }

    /// Memory the local tier can hold at most, bytes (bodies only; the
    /// index adds under 200 bytes per set).
    pub fn memory_bound(&self) -> u64 {
        super::store::Layout::new(self.max_entries).capacity() * u64::from(self.max_entry_bytes)
    }

    /// Checks the secret read from `secret_env`.
    pub fn check_secret(&self, secret: Option<&[u8]>) -> Result<(), ConfigError> {
        match secret {
            None => Err(ConfigError::new(
                "secret_env",
                format!(
                    "environment variable {} is not set",
                    quoted(&self.secret_env)
                ),
            )),
            Some(s) if s.len() < MIN_SECRET_BYTES => Err(ConfigError::new(
                "secret_env",
                format!(
                    "the secret in {} has {} bytes; at least {MIN_SECRET_BYTES} are required",
                    quoted(&self.secret_env),
                    s.len()
                ),
            )),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<PostCacheConfig, ConfigError> {
        PostCacheConfig::from_json(json.as_bytes())
    }

    fn error(json: &str) -> String {
        match parse(json) {
            Ok(_) => String::from("accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_need_only_the_secret_env() -> Result<(), ConfigError> {
        let config = parse(r#"{"secret_env":"ZEROLAYER_CACHE_SECRET"}"#)?;
        assert_eq!(config.namespace, Namespace::Tenant);
        let fleet = parse(r#"{"secret_env":"S","fleet":{"cluster":"webdis","path":"/"}}"#)?
            .fleet
            .ok_or_else(|| ConfigError::new("fleet", "missing"))?;
        let key = CacheKey([0xab; 32]);
        let hex = "ab".repeat(32);
        assert_eq!(fleet.get_path(&key), format!("/GET/zl:cache:{hex}.txt"));
        assert_eq!(
            fleet.setex_path(&key, 60),
            format!("/SETEX/zl:cache:{hex}/60")
        );
        assert_eq!(config.max_entries, 1024);
        assert_eq!(config.stampede, StampedeConfig::default());
        assert_eq!(config.fleet, None);
        assert_eq!(config.memory_bound(), 1024 * 256 * 1024);
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        for (json, want) in [
            (r#"{}"#, "missing field `secret_env`"),
            (r#"{"secret_env":""}"#, "secret_env"),
            (
                r#"{"secret_env":"S","ttl":{"max_temperature":-1}}"#,
                "ttl.max_temperature",
            ),
            (
                r#"{"secret_env":"S","ttl":{"default_ttl_secs":10,"max_ttl_secs":5}}"#,
                "ttl.default_ttl_secs",
            ),
            (r#"{"secret_env":"S","max_entries":0}"#, "max_entries"),
            (
                r#"{"secret_env":"S","max_entry_bytes":10}"#,
                "max_entry_bytes",
            ),
            (
                r#"{"secret_env":"S","stored_headers":["Content-Type"]}"#,
                "stored_headers[0]",
            ),
            (
                r#"{"secret_env":"S","stampede":{"poll_ms":0}}"#,
                "stampede.poll_ms",
            ),
            (
                r#"{"secret_env":"S","stampede":{"lease_ms":0}}"#,
                "stampede.lease_ms",
            ),
            (r#"{"secret_env":"S","namespace":"global"}"#, "namespace"),
            (
                r#"{"secret_env":"S","fleet":{"cluster":"webdis","path":"x"}}"#,
                "fleet.path",
            ),
            (r#"{"secret_env":"S","ttl":{"default_ttl":5}}"#, "ttl"),
        ] {
            let got = error(json);
            assert!(got.contains(want), "{json}: {got}");
        }
    }

    #[test]
    fn the_secret_must_be_set_and_long_enough() -> Result<(), ConfigError> {
        let config = parse(r#"{"secret_env":"ZEROLAYER_CACHE_SECRET"}"#)?;
        assert!(config.check_secret(None).is_err());
        let short = config
            .check_secret(Some(b"short"))
            .err()
            .map(|e| e.to_string());
        assert!(
            short
                .as_deref()
                .is_some_and(|m| m.contains("5 bytes") && !m.contains("short\"")),
            "{short:?}"
        );
        assert!(config.check_secret(Some(&[7u8; 32])).is_ok());
        Ok(())
    }
}
