//! Pure logic shared by the zerolayer filters, with no Proxy-Wasm dependency so
//! it builds and tests natively: configuration parsing, the activation rule
//! engine, request-id sampling, lazy-auth's verification, post-cache's keys
//! and policy, quota's leases and store protocol, SSE parsing and the
//! internal names filters agree on.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod activation;
pub mod auth;
pub mod breaker;
pub mod cache;
pub mod config;
pub mod encoding;
pub mod event;
pub mod footprint;
pub mod headers;
pub mod internal;
pub mod json;
pub mod metering;
pub mod metrics;
pub mod native;
pub mod observers;
pub mod path;
pub mod queue;
pub mod quota;
pub mod reply;
pub mod sampling;
pub mod sink;
pub mod sse;
pub mod usage;

pub use config::ConfigError;
pub use observers::{ObserverId, ObserverNames, ObserverSet};
