//! The native module's own section of the configuration, `native`: what
//! only the Envoy dynamic module (`filters/native`) needs beside the
//! stages' sections. Here with the other configuration types, so its
//! README table is generated from it as theirs are (`tests/config_docs.rs`).

use std::collections::BTreeMap;

use serde::Deserialize;

/// The `native` section: what only the native form needs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct NativeSection {
    /// Where the observer's thread reaches each cluster it calls off the
    /// request path, `{"cluster": "host:port"}`: JWKS, introspection, the
    /// audit sink, the usage sink, the fleet tier, and the quota store for
    /// the thread that syncs the leases (plain HTTP/1.1, keep-alive
    /// connections pooled per address: see [The observer's
    /// upstreams](#the-observers-upstreams)). Every cluster those sections
    /// name must be here (refused at load, naming the field, otherwise).
    /// Envoy's cluster manager serves only its own threads: a callout a
    /// request makes (a paused introspection, a wait for a quota grant)
    /// uses Envoy's cluster of that name, as in Wasm.
    #[serde(default)]
    pub upstreams: BTreeMap<String, String>,
    /// An operator's cap on shared data's keys: refused at load, naming the
    /// field and each purpose's need, when the stages' configurations may
    /// hold more (without it the store holds exactly what they declare,
    /// each purpose its own quota).
    #[serde(default)]
    pub shared_max_entries: Option<u64>,
    /// An operator's cap on shared data's bytes of keys and values, as
    /// `shared_max_entries` caps its keys.
    #[serde(default)]
    pub shared_max_bytes: Option<u64>,
    /// Jobs waiting for the observer at most (a full queue refuses jobs,
    /// counted by the stage that posts).
    #[serde(default = "default_queue")]
    pub queue_capacity: usize,
}

fn default_queue() -> usize {
    65_536
}

impl Default for NativeSection {
    fn default() -> Self {
        NativeSection {
            upstreams: BTreeMap::new(),
            shared_max_entries: None,
            shared_max_bytes: None,
            queue_capacity: default_queue(),
        }
    }
}
