//! zerolayer fused: the whole chain — lazy-auth → activation → quota →
//! post-cache → metering — in one filter instance, so a request pays the
//! host's per-filter cost once instead of once per stage. The stages are the separate
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

use std::collections::BTreeMap;

use serde_json::error::Category;
use serde_json::value::RawValue;
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
    /// `quota`: after lazy-auth (it scopes by the verified identity), before
    /// post-cache (a cache hit is a request it counts) and metering (which
    /// sees the response first and hands it the usage).
    Quota,
    /// `post_cache`.
    PostCache,
    /// `metering`.
    Metering,
}

impl Stage {
    /// Every stage, in the order requests meet them.
    pub const ALL: [Stage; 5] = [
        Stage::LazyAuth,
        Stage::Activation,
        Stage::Quota,
        Stage::PostCache,
        Stage::Metering,
    ];

    /// The stage's section in the configuration.
    pub fn section(self) -> &'static str {
        match self {
            Stage::Activation => "activation",
            Stage::LazyAuth => "lazy_auth",
            Stage::Quota => "quota",
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
            Stage::Quota => labels!("quota"),
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
            Stage::Quota => Box::new(zerolayer_quota::QuotaRoot::default()),
            Stage::PostCache => Box::new(zerolayer_post_cache::CacheRoot::default()),
            Stage::Metering => Box::new(zerolayer_metering::MeteringRoot::default()),
        }
    }

    /// Whether the separate filter runs with Envoy's default for a pause on
    /// request headers (the body withheld too); quota, post-cache and
    /// metering are configured with `allow_on_headers_stop_iteration: true`.
    pub fn headers_pause_withholds_body(self) -> bool {
        matches!(self, Stage::Activation | Stage::LazyAuth)
    }
}

/// The configuration document's top level: each member's value kept as
/// its own bytes in the document, read once (to find where each ends) and
/// never re-serialised; a stage parses its section itself, from those bytes.
#[derive(Debug)]
pub struct Document<'a> {
    /// The members by name (a name given twice: the last one, as a parsed
    /// object would keep).
    members: BTreeMap<String, &'a RawValue>,
}

impl<'a> Document<'a> {
    /// Reads the top level of `config`, which must be a JSON object.
    pub fn parse(config: &'a [u8]) -> Result<Document<'a>, String> {
        let members = serde_json::from_slice(config).map_err(|e| match e.classify() {
            // Valid JSON, but not an object.
            Category::Data => "expected an object with a section per stage".to_string(),
            Category::Io | Category::Syntax | Category::Eof => format!("not JSON: {e}"),
        })?;
        Ok(Document { members })
    }

    /// Takes member `name` out of the document (a section of a form's own,
    /// such as the native module's `native`), if it is there.
    pub fn take(&mut self, name: &str) -> Option<&'a RawValue> {
        self.members.remove(name)
    }

    /// The stages' sections, in chain order, each as its bytes in the
    /// document; a member that names no stage is an error naming it.
    pub fn sections(self) -> Result<Vec<(Stage, &'a [u8])>, String> {
        if let Some(unknown) = self
            .members
            .keys()
            .find(|k| !Stage::ALL.iter().any(|s| s.section() == k.as_str()))
        {
            return Err(format!(
                "{unknown}: unknown stage (expected activation, lazy_auth, quota, post_cache, metering)"
            ));
        }
        let stages: Vec<(Stage, &'a [u8])> = Stage::ALL
            .iter()
            .filter_map(|s| {
                self.members
                    .get(s.section())
                    .map(|v| (*s, v.get().as_bytes()))
            })
            .collect();
        if stages.is_empty() {
            return Err(
                "no stage configured (sections: activation, lazy_auth, quota, post_cache, metering)"
                    .into(),
            );
        }
        Ok(stages)
    }
}

/// The stages' sections of the configuration, in chain order, each as its
/// bytes in `config` ([`Document::sections`]); unknown sections are an
/// error naming them.
pub fn sections(config: &[u8]) -> Result<Vec<(Stage, &[u8])>, String> {
    Document::parse(config)?.sections()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `part` lies within `whole` (is a slice of it, not a copy).
    fn within(part: &[u8], whole: &[u8]) -> bool {
        let range = whole.as_ptr_range();
        range.start <= part.as_ptr() && part.as_ptr_range().end <= range.end
    }

    #[test]
    fn each_section_is_its_own_bytes_in_the_document_in_chain_order() {
        let config = br#"{ "metering": {"environment": "prod"},
            "activation": { "rules": [] },
            "lazy_auth": {"unknown": "lazy"} }"#;
        let sections = sections(config).unwrap_or_default();
        let names: Vec<&str> = sections.iter().map(|(s, _)| s.section()).collect();
        assert_eq!(names, ["lazy_auth", "activation", "metering"]);
        let texts: Vec<&[u8]> = sections.iter().map(|(_, b)| *b).collect();
        assert_eq!(
            texts,
            [
                &br#"{"unknown": "lazy"}"#[..],
                br#"{ "rules": [] }"#,
                br#"{"environment": "prod"}"#,
            ]
        );
        // Not re-serialised: every section points into the document.
        assert!(sections.iter().all(|(_, b)| within(b, config)));
    }

    #[test]
    fn a_document_is_refused_naming_what_is_wrong() {
        let refused = |config: &str| sections(config.as_bytes()).err().unwrap_or_default();
        for (config, want) in [
            ("", "not JSON: EOF while parsing a value at line 1 column 0"),
            (
                r#"{"activation": {"rules": [}}"#,
                "not JSON: expected value at line 1 column 27",
            ),
            (
                r#"{"activation": {}} x"#,
                "not JSON: trailing characters at line 1 column 20",
            ),
            ("[1]", "expected an object with a section per stage"),
            (
                "\"activation\"",
                "expected an object with a section per stage",
            ),
            (
                "{}",
                "no stage configured (sections: activation, lazy_auth, quota, post_cache, metering)",
            ),
            (
                r#"{"activation": {}, "shadow": {}, "cache": {}}"#,
                "cache: unknown stage (expected activation, lazy_auth, quota, post_cache, metering)",
            ),
        ] {
            assert_eq!(refused(config), want, "{config}");
        }
    }

    #[test]
    fn a_form_takes_its_own_section_out_before_the_stages_are_read() {
        let config = br#"{"activation": {}, "native": {"queue_capacity": 8}}"#;
        let mut document = Document::parse(config).unwrap_or_else(|e| panic!("{e}"));
        let native = document.take("native").map(RawValue::get);
        assert_eq!(native, Some(r#"{"queue_capacity": 8}"#));
        let sections = document.sections().unwrap_or_default();
        assert_eq!(sections, [(Stage::Activation, &b"{}"[..])]);
    }

    #[test]
    fn a_section_named_twice_is_the_last_one_as_in_a_parsed_object() {
        let config = br#"{"activation": {"rules": 1}, "activation": {"rules": []}}"#;
        assert_eq!(
            sections(config).unwrap_or_default(),
            [(Stage::Activation, &br#"{"rules": []}"#[..])]
        );
    }
}
