//! Foreign filters for host-sim: Proxy-Wasm filters written the way a filter
//! author who never saw zerolayer writes them, in the shape of the
//! proxy-wasm Rust SDK's own examples (`examples/*` in
//! proxy-wasm/proxy-wasm-rust-sdk): each one a module of its own, the SDK's
//! traits used directly, `unwrap()` where the SDK examples use it.
//!
//! They are this crate's examples (`examples/<name>.rs`, each a `cdylib`),
//! built by `cargo xtask build-wasm` into
//! `target/wasm32-wasip1/wasm/examples/<name>.wasm`; `envoy/<name>.yaml`
//! beside them runs each in Envoy. The differential suite
//! (`tests/tests/foreign_filters.rs`) runs them in real Envoy and in real
//! ngx_wasm_module, and in host-sim's two profiles, and compares what each
//! client, upstream and callout target saw, request by request.
//!
//! The library itself is empty: it only names the filters.

/// The foreign filters, by module name (`examples/<name>.rs`).
pub const FILTERS: [&str; 5] = [
    "hello_world",
    "http_headers",
    "http_body",
    "http_config",
    "http_auth_random",
];
