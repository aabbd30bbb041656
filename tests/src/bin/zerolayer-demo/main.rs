//! The body of `cargo xtask demo`: the demo's requests through the chain in
//! real Envoy or ngx_wasm_module, printed per request. xtask does the set-up
//! and builds the filters, then runs this binary with the same options; it
//! lives here because it links the harness (and through it wasmtime), which
//! xtask must not, to compile in seconds.

mod demo;
mod demo_kong;
mod demo_quota;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match demo::run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // As when the demo ran inside xtask; xtask adds nothing to it.
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}
