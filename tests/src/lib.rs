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
pub mod foreign;
pub mod kong_chain;
pub mod litellm;
pub mod mock;
pub mod model;
pub mod ngx;
pub mod paths;
pub mod probes;
pub mod sdk;
pub mod sim;
pub mod sse;
pub mod tokens;
pub mod upstream;
pub mod wait;
pub mod wrk;

pub use client::{Client, Reply, is_connection_reset};
pub use envoy::{Envoy, EnvoyConfig};
pub use mock::MockServer;
pub use model::ModelServer;
pub use upstream::{EchoUpstream, SeenRequest};

/// One test per form of the chain for each `scenario(form: Form) ->
/// Result<()>` named: `<scenario>::separate`, `::fused` and `::native`
/// (see [`chain::Form`]).
#[macro_export]
macro_rules! in_every_form {
    ($($scenario:ident),* $(,)?) => {
        $($crate::form_tests!($scenario [separate: Separate, fused: Fused, native: Native]);)*
    };
}

/// [`in_every_form`] for scenarios only the Wasm forms have (the observer
/// as a separate Envoy service that can be left out).
#[macro_export]
macro_rules! in_wasm_forms {
    ($($scenario:ident),* $(,)?) => {
        $($crate::form_tests!($scenario [separate: Separate, fused: Fused]);)*
    };
}

/// The tests of one scenario: a module named after it, a test per form.
#[doc(hidden)]
#[macro_export]
macro_rules! form_tests {
    ($scenario:ident [$($test:ident: $form:ident),*]) => {
        mod $scenario {
            $(
                #[test]
                fn $test() -> anyhow::Result<()> {
                    super::$scenario($crate::chain::Form::$form)
                }
            )*
        }
    };
}
