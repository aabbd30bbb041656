//! zerolayer fused: the whole chain — lazy-auth → activation → post-cache →
//! metering — in one filter instance, so a request pays the host's
//! per-filter cost once instead of four times. The stages are the separate
//! filters' own root and stream contexts, composed, not copied: the same
//! configuration schemas (one object with a section per stage), the same
//! metrics, the same behaviour (`tests/tests/fused_envoy.rs` and
//! `fused_host_sim.rs` compare them). What the stages would each ask the
//! host again (request and response headers, hand-off values, the current
//! callback's body) they share through their host, `zerolayer_host::PipelineHost`,
//! and a stage done with a body callback (`StreamHost::done_with`) is no longer
//! called for it. The module crate beside it (`module/`) registers
//! [`FusedRoot`] as `zerolayer_fused.wasm`.
//!
//! Lifecycle, top to bottom: configuration (each stage configured from its
//! section; sections left out are stages left out) → request headers, body
//! and callout answers through the [`Pipeline`] → response back through the
//! stages that saw the request → log → tick (each stage at its own period;
//! streams a stage resumed from its root continue through the stages after
//! it).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod pipeline;
#[cfg(feature = "wasm")]
mod root;
mod roots;

use zerolayer_host::{Hosts, RootStage};

pub use pipeline::{Column, Pipeline, StageStream};
#[cfg(feature = "wasm")]
pub use root::FusedRoot;
pub use roots::StageRoots;

/// A stage of the chain ([`Stage::ALL`] gives the order requests meet them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `lazy_auth`.
    LazyAuth,
    /// `activation`.
    Activation,
    /// `post_cache`.
    PostCache,
    /// `metering`.
    Metering,
}

impl Stage {
    /// Every stage, in the order requests meet them.
    pub const ALL: [Stage; 4] = [
        Stage::LazyAuth,
        Stage::Activation,
        Stage::PostCache,
        Stage::Metering,
    ];

    /// The stage's section in the configuration.
    pub fn section(self) -> &'static str {
        match self {
            Stage::Activation => "activation",
            Stage::LazyAuth => "lazy_auth",
            Stage::PostCache => "post_cache",
            Stage::Metering => "metering",
        }
    }

    /// The stage's timing labels, by [`Column`].
    pub fn labels(self) -> &'static [&'static str; 6] {
        macro_rules! labels {
            ($stage:literal) => {
                &[
                    concat!($stage, ".request_headers"),
                    concat!($stage, ".request_body"),
                    concat!($stage, ".response_headers"),
                    concat!($stage, ".response_body"),
                    concat!($stage, ".log"),
                    concat!($stage, ".call_response"),
                ]
            };
        }
        match self {
            Stage::Activation => labels!("activation"),
            Stage::LazyAuth => labels!("lazy_auth"),
            Stage::PostCache => labels!("post_cache"),
            Stage::Metering => labels!("metering"),
        }
    }

    /// A new root of the stage, on hosts `H` (a `Chain`: the fused
    /// filter's, the native module's).
    pub fn root<H: Hosts>(self) -> Box<dyn RootStage<H>> {
        match self {
            Stage::Activation => Box::new(zerolayer_activation::ActivationRoot::default()),
            Stage::LazyAuth => Box::new(zerolayer_lazy_auth::AuthRoot::default()),
            Stage::PostCache => Box::new(zerolayer_post_cache::CacheRoot::default()),
            Stage::Metering => Box::new(zerolayer_metering::MeteringRoot::default()),
        }
    }

    /// Whether the separate filter runs with Envoy's default for a pause on
    /// request headers (the body withheld too); post-cache and metering are
    /// configured with `allow_on_headers_stop_iteration: true`.
    pub fn headers_pause_withholds_body(self) -> bool {
        matches!(self, Stage::Activation | Stage::LazyAuth)
    }
}

/// The stages' sections of the configuration, in chain order; unknown
/// sections are an error naming them.
pub fn sections(config: &[u8]) -> Result<Vec<(Stage, Vec<u8>)>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(config).map_err(|e| format!("not JSON: {e}"))?;
    let object = value
        .as_object()
        .ok_or("expected an object with a section per stage")?;
    if let Some(unknown) = object
        .keys()
        .find(|k| !Stage::ALL.iter().any(|s| s.section() == k.as_str()))
    {
        return Err(format!(
            "{unknown}: unknown stage (expected activation, lazy_auth, post_cache, metering)"
        ));
    }
    let stages: Vec<(Stage, Vec<u8>)> = Stage::ALL
        .iter()
        .filter_map(|s| {
            object
                .get(s.section())
                .map(|v| (*s, v.to_string().into_bytes()))
        })
        .collect();
    if stages.is_empty() {
        return Err(
            "no stage configured (sections: activation, lazy_auth, post_cache, metering)".into(),
        );
    }
    Ok(stages)
}
