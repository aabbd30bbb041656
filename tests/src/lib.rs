//! End-to-end harness shared by the tests and the demo: real Envoy started
//! from the project's own configs, loopback upstreams, an HTTP client, and
//! headless Chromium for the project's pages.
//!
//! Everything binds to 127.0.0.1 on ports the kernel picks, so tests run in
//! parallel; every process started here is stopped by PID when dropped.

pub mod bench;
pub mod chain;
pub mod clickhouse;
pub mod client;
pub mod differential;
pub mod envoy;
pub mod fleet;
pub mod kong_chain;
pub mod litellm;
pub mod mock;
pub mod model;
pub mod ngx;
pub mod paths;
pub mod probes;
pub mod sim;
pub mod sse;
pub mod tokens;
pub mod upstream;
pub mod wait;
pub mod wrk;

pub use client::{Client, Reply};
pub use envoy::{Envoy, EnvoyConfig};
pub use mock::MockServer;
pub use model::ModelServer;
pub use upstream::{EchoUpstream, SeenRequest};
