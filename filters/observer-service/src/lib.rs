//! The observer as a singleton service: an Envoy bootstrap extension
//! (`envoy.bootstrap.wasm`, `singleton: true`) running
//! [`zerolayer_observer::Observer`] on the main thread, woken by
//! `on_queue_ready` when workers enqueue, and by its tick.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

use std::time::Duration;

use proxy_wasm::traits::{Context, RootContext};
use proxy_wasm::types::LogLevel;
use zerolayer_host::Host;
use zerolayer_host::WasmHost;
use zerolayer_observer::{Observer, ObserverConfig};

/// The module's entry point (`_initialize`): registers the root context.
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(ObserverService::default()) });
    }}
}

/// The service's root context.
#[derive(Default)]
struct ObserverService {
    observer: Option<Observer>,
}

impl Context for ObserverService {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let Some(observer) = &mut self.observer {
            observer.on_http_call_response(&mut WasmHost, token, body_size);
        }
    }

    fn on_done(&mut self) -> bool {
        if let Some(observer) = &self.observer {
            observer.flush_counters(&mut WasmHost);
        }
        true
    }
}

impl RootContext for ObserverService {
    fn on_configure(&mut self, _size: usize) -> bool {
        let mut host = WasmHost;
        let configuration = host.plugin_configuration();
        let Some(config) =
            zerolayer_host::load_config("observer", &configuration, ObserverConfig::from_json)
        else {
            return false;
        };
        match Observer::configure(&mut host, &config, "observer") {
            Ok(observer) => self.observer = Some(observer),
            Err(err) => {
                log::error!("observer: invalid configuration: {err}");
                return false;
            }
        }
        let tick = Duration::from_millis(config.tick_ms.max(10));
        if let Err(status) = host.set_tick_period(tick) {
            log::warn!(
                "observer: no tick ({status:?}): JWKS refresh and sink flushes wait for queue wake-ups"
            );
        }
        true
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        if let Some(observer) = &mut self.observer {
            observer.drain(&mut WasmHost);
        }
    }

    fn on_tick(&mut self) {
        if let Some(observer) = &mut self.observer {
            observer.on_tick(&mut WasmHost);
        }
    }
}
