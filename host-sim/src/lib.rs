//! host-sim: a Proxy-Wasm host on wasmtime that runs the same `.wasm`
//! filters Envoy runs, with Envoy's semantics (or Kong's, [`Profile::Kong`]),
//! so filters can be tested natively: a fresh [`Host`] per test, explicit
//! completion of callouts, virtual time. No product knowledge: zerolayer's
//! tools around it (`host-sim serve`, `replay`, `reconcile`, …) are the
//! `host-sim-tools` crate.
//!
//! ```no_run
//! use host_sim::{Host, PluginSpec};
//! let mut host = Host::new()?;
//! let chain = host.add_chain(vec![
//!     PluginSpec::new("zerolayer.activation", "target/wasm32-wasip1/wasm/zerolayer_activation.wasm")
//!         .configuration(r#"{"defaults":["audit"]}"#),
//! ])?;
//! let mut stream = host.stream(chain)?;
//! stream.request_headers(&[(":method", "GET"), (":path", "/"), (":authority", "x")], true);
//! assert!(stream.upstream().complete);
//! # anyhow::Ok(())
//! ```

// The README's example compiles as a doc test (`cargo test --doc`; not run:
// it needs the built `.wasm`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

pub mod abi;
pub mod callout;
mod host;
mod imports;
pub mod metrics;
mod properties;
mod vm;
pub mod world;

pub use host::{
    ChainId, ClusterTarget, ENVOY_BUFFER_LIMIT, Host, HostOptions, NGINX_500_PAGE, NGINX_SERVER,
    Output, PluginSpec, StreamHandle,
};
pub use imports::IMPLEMENTED;
pub use world::{
    CallResponse, Callout, LocalResponse, LogLine, Profile, StreamId, StreamInfo, http_date,
};
