//! The one surface between zerolayer's stages and the proxy. A stage gets
//! its host explicitly in every callback: its [`RootStage`] a [`RootHost`],
//! each [`StreamStage`] a [`StreamHost`] (both a [`Host`]); which host that is decides
//! whether it runs as its own filter ([`WasmHost`], registered by a module
//! crate with [`standalone`]), inside a chain in one filter ([`PipelineHost`]
//! and [`PipelineRoots`]: the fused filter's, the native module's over
//! Envoy's ABI), or
//! in a native test ([`FakeHost`], feature `fake`).
//!
//! Logic stays in `zerolayer-core`; what this crate adds is composed the
//! same way for every stage: configuration loading with one clear log
//! line, counters batched in memory ([`Counters`]), shared data with CAS,
//! the observer's queue ([`ObserverQueue`]), JSON error responses.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

#[cfg(feature = "fake")]
mod fake;
#[cfg(feature = "wasm")]
mod fused;
mod host;
mod metrics;
mod pipeline;
mod queue;
#[cfg(feature = "wasm")]
mod raw;
mod stage;
pub mod timing;
#[cfg(feature = "wasm")]
mod wasm;

#[cfg(feature = "fake")]
pub use fake::{Dispatched, FakeHost, FakeMetric, Sent};
#[cfg(feature = "wasm")]
pub use fused::{Fused, FusedHost, FusedRoots};
pub use host::{
    Action, Body, Callback, CalloutAnswer, Headers, Host, MetricKind, Platform, Respond, RootHost,
    Status, StreamHost,
};
pub use metrics::{Counter, Counters, Family, Metric, MetricId};
pub use pipeline::{Chain, LocalResponse, PipelineHost, PipelineRoots, Proxy, Wake};
pub use queue::{ObserverQueue, release_backlog};
#[cfg(feature = "wasm")]
pub use stage::standalone;
pub use stage::{DoneWith, Hosts, RootStage, StageHost, StreamStage};
#[cfg(feature = "wasm")]
pub use wasm::WasmHost;
pub use zerolayer_core::metrics::{MetricName, SharedCounter};

use zerolayer_core::ConfigError;

// The README's examples compile and run as doc tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

/// Parses `configuration` with `parse`; on error logs one line naming the
/// field (`<filter>: invalid configuration: <path>: <problem>`) and
/// returns `None`, so `configure` can refuse.
pub fn load_config<T>(
    filter: &str,
    configuration: &[u8],
    parse: impl FnOnce(&[u8]) -> Result<T, ConfigError>,
) -> Option<T> {
    match parse(configuration) {
        Ok(config) => Some(config),
        Err(err) => {
            log::error!("{filter}: invalid configuration: {err}");
            None
        }
    }
}

/// A map by stream (context) id: ids are the host's small integers, not
/// attacker input, so a multiplicative hash replaces SipHash's cost.
pub type StreamMap<V> =
    std::collections::HashMap<u32, V, std::hash::BuildHasherDefault<StreamIdHasher>>;

/// Fibonacci hashing of a context id (see [`StreamMap`]).
#[derive(Default)]
pub struct StreamIdHasher(u64);

impl std::hash::Hasher for StreamIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
