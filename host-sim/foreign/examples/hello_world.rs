//! hello_world: a root context alone (no HTTP contexts), as the SDK's
//! `hello_world` example: it greets from `on_vm_start`, then logs on every
//! tick. Envoy runs it as a singleton service; the tick period is 5 s, or
//! the plugin configuration's number of milliseconds. It is set once, in
//! `on_configure`: ngx_wasm_module traps a second non-zero
//! `set_tick_period` ("tick_period already set").
// The SDK's entry-point macro defines an undocumented `_initialize`.
#![allow(missing_docs)]

use std::time::Duration;

use log::info;
use proxy_wasm::traits::{Context, RootContext};
use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(HelloWorld { ticks: 0 }) });
}}

struct HelloWorld {
    ticks: u64,
}

impl Context for HelloWorld {}

impl RootContext for HelloWorld {
    fn on_vm_start(&mut self, _: usize) -> bool {
        info!("Hello, World!");
        true
    }

    fn on_configure(&mut self, _: usize) -> bool {
        let period = match self.get_plugin_configuration() {
            Some(config) => {
                Duration::from_millis(String::from_utf8(config).unwrap().trim().parse().unwrap())
            }
            None => Duration::from_secs(5),
        };
        self.set_tick_period(period);
        true
    }

    fn on_tick(&mut self) {
        self.ticks += 1;
        info!("It's tick {}, there is no lucky number.", self.ticks);
    }
}
