//! The plugin configuration (JSON):
//!
//! ```json
//! {"role": "filter" | "singleton" | "trivial" | "chain", "queue_vm_id": "probe.singleton",
//!  "queue_name": "probe-jobs", "cluster": "probe_upstream", "tick_ms": 0}
//! ```
//!
//! Only `role` is required. Every error names the field it is about.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

/// Which half of the probe this plugin instance is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Role {
    /// An HTTP filter: runs the actions of `x-probe-action`.
    Filter,
    /// A bootstrap singleton service: owns the shared queue and drains it.
    Singleton,
    /// The benchmarks' floor: adds two request headers and does nothing
    /// else (no header reads, no metrics, no actions).
    Trivial,
    /// The chain's floor: the host calls the zerolayer chain needs and no
    /// logic (zerolayer-native's `probe_chain` does the same natively).
    Chain,
}

/// The parsed configuration.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    #[serde(deserialize_with = "role")]
    pub(crate) role: Role,
    /// The vm_id of the singleton that registered the queue (filter role).
    #[serde(default = "default_queue_vm_id", deserialize_with = "queue_vm_id")]
    pub(crate) queue_vm_id: String,
    /// The shared queue's name (both roles).
    #[serde(default = "default_queue_name", deserialize_with = "queue_name")]
    pub(crate) queue_name: String,
    /// The cluster `callout` dispatches to (filter role).
    #[serde(default = "default_cluster", deserialize_with = "cluster")]
    pub(crate) cluster: String,
    /// Tick period in milliseconds; 0 means no tick.
    #[serde(default, deserialize_with = "tick_ms")]
    pub(crate) tick_ms: u32,
}

impl Config {
    /// Parses the plugin configuration; the error is one line naming the
    /// offending field.
    pub(crate) fn from_json(bytes: &[u8]) -> Result<Self, String> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err("configuration is empty; field `role` is required".to_string());
        }
        serde_json::from_slice(bytes).map_err(|err| err.to_string())
    }
}

fn default_queue_vm_id() -> String {
    "probe.singleton".to_string()
}

fn default_queue_name() -> String {
    "probe-jobs".to_string()
}

fn default_cluster() -> String {
    "probe_upstream".to_string()
}

/// Deserializes one field, prefixing any error with the field's name
/// (serde's own type errors do not say which field they are about).
fn field<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
    deserializer: D,
    name: &str,
) -> Result<T, D::Error> {
    T::deserialize(deserializer)
        .map_err(|err| D::Error::custom(format_args!("field `{name}`: {err}")))
}

/// A string field that must not be empty.
fn text<'de, D: Deserializer<'de>>(deserializer: D, name: &str) -> Result<String, D::Error> {
    let value: String = field(deserializer, name)?;
    if value.is_empty() {
        return Err(D::Error::custom(format_args!(
            "field `{name}`: must not be empty"
        )));
    }
    Ok(value)
}

fn role<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Role, D::Error> {
    field(deserializer, "role")
}

fn queue_vm_id<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    text(deserializer, "queue_vm_id")
}

fn queue_name<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    text(deserializer, "queue_name")
}

fn cluster<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    text(deserializer, "cluster")
}

/// Milliseconds as the ABI carries them (u32): a larger value is an error
/// rather than silently truncated by the SDK.
fn tick_ms<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    field(deserializer, "tick_ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(json: &str) -> String {
        match Config::from_json(json.as_bytes()) {
            Ok(config) => panic!("accepted: {config:?}"),
            Err(err) => err,
        }
    }

    #[test]
    fn defaults() {
        let config = Config::from_json(br#"{"role":"filter"}"#).unwrap();
        assert_eq!(config.role, Role::Filter);
        let config = Config::from_json(br#"{"role":"trivial"}"#).unwrap();
        assert_eq!(config.role, Role::Trivial);
        assert_eq!(config.queue_vm_id, "probe.singleton");
        assert_eq!(config.queue_name, "probe-jobs");
        assert_eq!(config.cluster, "probe_upstream");
        assert_eq!(config.tick_ms, 0);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(error("").contains("`role`"));
        assert!(error("{}").contains("`role`"));
        assert!(error(r#"{"role":"router"}"#).contains("`role`"));
        assert!(error(r#"{"role":"filter","tick":1}"#).contains("`tick`"));
        assert!(error(r#"{"role":"filter","tick_ms":"5"}"#).contains("`tick_ms`"));
        assert!(error(r#"{"role":"filter","tick_ms":-1}"#).contains("`tick_ms`"));
        assert!(error(r#"{"role":"filter","tick_ms":4294967296}"#).contains("`tick_ms`"));
        assert!(error(r#"{"role":"filter","cluster":""}"#).contains("`cluster`"));
        assert!(error(r#"{"role":"singleton","queue_name":7}"#).contains("`queue_name`"));
    }
}
