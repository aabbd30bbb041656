//! host-sim: a Proxy-Wasm host on wasmtime that runs the same `.wasm`
//! filters Envoy runs, with Envoy's semantics, so filters can be tested
//! natively: a fresh [`Host`] per test, explicit completion of callouts,
//! virtual time.
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

pub mod abi;
mod callout;
pub mod config_file;
mod host;
mod imports;
mod loopback;
pub mod metrics;
pub mod playground;
mod properties;
pub mod reconcile;
pub mod replay;
pub mod report;
pub mod serve;
pub mod traffic;
mod vm;
pub mod world;

pub use host::{ChainId, ClusterTarget, Host, HostOptions, Output, PluginSpec, StreamHandle};
pub use imports::IMPLEMENTED;
pub use world::{CallResponse, Callout, LocalResponse, LogLine, Profile, StreamId, StreamInfo};
