//! Configuration parsing shared by every filter: JSON through serde with
//! unknown fields refused, and errors that name the field path and the bad
//! value, so one log line tells an operator what to fix.

use serde::Deserialize;
use serde::de::DeserializeOwned;

/// A configuration error: the dotted field path (`rules[2].when.path.matches`)
/// and what is wrong with the value found there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    path: String,
    message: String,
}

impl ConfigError {
    /// Creates an error for the field at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }

    /// The dotted path of the offending field (`configuration` for the whole document).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong with the value at [`ConfigError::path`].
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Name used in errors about the configuration document as a whole.
pub const ROOT: &str = "configuration";

/// Parses a JSON configuration document into `T`, refusing unknown fields
/// (when `T` says so) and reporting the path of the first bad field.
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ConfigError::new(
            ROOT,
            "empty; expected a JSON object (use {} for the defaults)",
        ));
    }
    // serde also accepts structs written as arrays; a configuration is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ConfigError::new(ROOT, "expected a JSON object"));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        // serde_path_to_error shows the document as "." and a member named
        // "" as nothing: keep every error's path visible (found by fuzzing:
        // fuzz/regressions/rules_config).
        let path = match path.as_str() {
            "." | "" => ROOT.to_string(),
            p if p.ends_with('.') => format!("{p}\"\""),
            _ => path,
        };
        ConfigError::new(path, err.into_inner().to_string())
    })?;
    de.end()
        .map_err(|err| ConfigError::new(ROOT, err.to_string()))?;
    Ok(value)
}

/// `invalid regex "<pattern>": <reason>`, the reason being the one-line
/// cause from the regex crate's multi-line message (a log line needs only that).
pub fn invalid_regex(pattern: &str, err: &regex::Error) -> String {
    let text = err.to_string();
    let reason = text
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("error: "))
        .map(str::to_string)
        .unwrap_or_else(|| text.lines().last().unwrap_or("").trim().to_string());
    format!("invalid regex {}: {reason}", quoted(pattern))
}

/// Whether `b` may appear in an HTTP field name (RFC 9110 `tchar`).
pub fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whether `name` is a header name as HTTP/2 and Envoy carry it: non-empty,
/// token characters, no upper case.
pub fn is_lowercase_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| is_token_byte(b) && !b.is_ascii_uppercase())
}

/// Quotes a value for an error message the way JSON would, so empty strings
/// and whitespace stay visible.
pub fn quoted(value: &str) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| format!("{value:?}"))
}

/// Where filters reach the observer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct ObserverLink {
    /// `vm_id` of the observer (and of the shared data verdicts live in).
    #[serde(default = "default_vm_id")]
    pub vm_id: String,
    /// Name of the job queue.
    #[serde(default = "default_queue")]
    pub queue: String,
    /// Who owns and drains the job queue.
    #[serde(default)]
    pub mode: ObserverMode,
    /// Tick mode: bytes of jobs that may wait in the queue (at least 64 KiB;
    /// each counted
    /// with a 4-byte prefix); a job past it is refused and counted as lost.
    /// Keep it below the queue's declared size (Kong's `shm_queue`), whose
    /// overflow traps the filter.
    #[serde(default = "default_max_queued_bytes")]
    pub max_queued_bytes: u64,
}

impl ObserverLink {
    /// The queue's name: the configured one for the singleton, which every
    /// filter shares; `<queue>.<filter>` in tick mode, where each filter's
    /// own observer owns one.
    pub fn queue_name(&self, filter: &str) -> String {
        match self.mode {
            ObserverMode::Singleton => self.queue.clone(),
            ObserverMode::Tick => format!("{}.{filter}", self.queue),
        }
    }

    /// The shared-data key producers and the drain keep `filter`'s queue
    /// backlog under, in tick mode (where the host's queue may be a
    /// fixed-size ring, see [`crate::queue`]); `None` for the singleton.
    pub fn backlog_key(&self, filter: &str) -> Option<String> {
        (self.mode == ObserverMode::Tick)
            .then(|| crate::queue::backlog_key(&self.queue_name(filter)))
    }

    /// Checks what serde cannot (fields named as `observer.*`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.queue.is_empty() {
            return Err(ConfigError::new("observer.queue", "must not be empty"));
        }
        if self.max_queued_bytes < MIN_QUEUED_BYTES {
            return Err(ConfigError::new(
                "observer.max_queued_bytes",
                format!("must be at least {MIN_QUEUED_BYTES}"),
            ));
        }
        Ok(())
    }
}

/// The smallest queue bound accepted (a few large jobs).
pub const MIN_QUEUED_BYTES: u64 = 64 * 1024;

fn default_max_queued_bytes() -> u64 {
    // Half the smallest queue `kong/kong.conf` declares (4 MiB).
    2 * 1024 * 1024
}

/// How the observer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum ObserverMode {
    /// An Envoy bootstrap service (singleton) owns the queue; filters
    /// resolve it.
    #[default]
    Singleton,
    /// Each filter's root context owns a queue of its own and drains it on
    /// tick (Kong, which has neither singletons nor queue notifications).
    Tick,
}

fn default_vm_id() -> String {
    "zerolayer".into()
}

fn default_queue() -> String {
    "zerolayer.jobs".into()
}

impl Default for ObserverLink {
    fn default() -> Self {
        ObserverLink {
            vm_id: default_vm_id(),
            queue: default_queue(),
            mode: ObserverMode::default(),
            max_queued_bytes: default_max_queued_bytes(),
        }
    }
}

/// A cluster endpoint reached with `dispatch_http_call`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// Envoy cluster name.
    pub cluster: String,
    /// Request path.
    pub path: String,
    /// `:authority` to send (defaults to the cluster name).
    #[serde(default)]
    pub authority: Option<String>,
    /// Timeout, ms.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u32,
}

fn default_timeout_ms() -> u32 {
    1000
}

impl Endpoint {
    /// The `:authority` header value.
    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(&self.cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        #[allow(dead_code)]
        items: Vec<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[allow(dead_code)]
        size: u8,
    }

    #[test]
    fn errors_name_the_field_path() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"items":[{"size":1},{"size":300}]}"#,
                "items[1].size: invalid value: integer `300`, expected u8 at line 1 column 32",
            ),
            (
                r#"{"items":[{"sise":1}]}"#,
                "items[0].sise: unknown field `sise`, expected `size` at line 1 column 17",
            ),
            (
                r#"{"items":[], "extra": true}"#,
                "extra: unknown field `extra`, expected `items` at line 1 column 20",
            ),
            (
                "",
                "configuration: empty; expected a JSON object (use {} for the defaults)",
            ),
            ("[1]", "configuration: expected a JSON object"),
            (
                r#"{"items":[]} trailing"#,
                "configuration: trailing characters at line 1 column 14",
            ),
        ];
        for (input, expected) in cases {
            let err = from_json::<Outer>(input.as_bytes()).unwrap_err();
            assert_eq!(err.to_string(), *expected, "input: {input}");
        }
    }
}
