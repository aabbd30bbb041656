//! zerolayer metering: every LLM response's token usage, read from its JSON
//! body or SSE stream as it passes (constant memory, nothing buffered),
//! counted per tenant and model in metrics, written to the access log for
//! every request (ground truth), and shipped as a full record for a
//! consistent hash sample of requests (`xxh3(x-request-id) mod 10000 <
//! rate`) through the observer to a JSON-lines sink such as ClickHouse.
//!
//! Lifecycle, top to bottom: configuration → request headers (an LLM call?
//! start time) → request body (only when `openai_include_usage` rewrites
//! it) → response headers (status, stream or JSON) → response body (usage
//! extraction, usage-chunk stripping) → end of response (record, metrics,
//! access log, sample) → log (a response that never ended) → tick
//! (metrics, the embedded observer in tick mode).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod meters;
mod stream;

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use zerolayer_core::config::ObserverMode;
use zerolayer_core::metering::MeteringConfig;
use zerolayer_core::metering::config::SamplingPlan;
use zerolayer_observer::{Observer, ObserverConfig};
use zerolayer_proxy::ObserverQueue;

use meters::Meters;
use stream::MeteredStream;

/// The module's entry point (`_initialize`): registers the root context.
#[cfg(not(feature = "stage"))]
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(MeteringRoot::default()) });
    }}
}

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: MeteringConfig,
    pub sampling: SamplingPlan,
    pub meters: Meters,
    /// The observer's job queue (full records).
    pub queue: ObserverQueue,
}

/// The plugin's root context.
#[derive(Default)]
pub struct MeteringRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode (shipping records).
    observer: Option<Observer>,
}

impl Context for MeteringRoot {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let Some(observer) = &mut self.observer {
            observer.on_http_call_response(token, body_size);
        }
    }

    fn on_done(&mut self) -> bool {
        if let Some(plan) = &self.plan {
            plan.meters.flush();
        }
        if let Some(observer) = &self.observer {
            observer.flush_counters();
        }
        true
    }
}

impl RootContext for MeteringRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = zerolayer_proxy::load_config("metering", MeteringConfig::from_json)
        else {
            return false;
        };
        let sampling = match config.sampling_plan() {
            Ok(plan) => plan,
            Err(err) => {
                log::error!("metering: invalid configuration: {err}");
                return false;
            }
        };
        log::info!(
            "metering: configured (environment {}, {} bp sampled by default, {} tenant rates, records {})",
            config.environment,
            sampling.rate("").basis_points(),
            config.sampling.tenants.len(),
            match &config.sink {
                Some(sink) => format!("shipped to cluster {}", sink.endpoint.cluster),
                None => "not shipped (no sink)".into(),
            }
        );
        if config.sink.is_some() && config.observer.mode == ObserverMode::Tick {
            let observer = ObserverConfig::for_metering(config.clone());
            match Observer::configure(&observer, "metering") {
                Ok(observer) => self.observer = Some(observer),
                Err(err) => {
                    log::error!("metering: invalid configuration: observer: {err}");
                    return false;
                }
            }
        }
        self.plan = Some(Rc::new(Plan {
            sampling,
            meters: Meters::define(config.labels),
            queue: ObserverQueue::new(
                config.observer.clone(),
                self.observer.as_ref().map(Observer::queue),
                "metering",
            ),
            config,
        }));
        if let Err(status) = zerolayer_proxy::fused::set_tick_period(Duration::from_millis(200)) {
            log::warn!("metering: no tick ({status:?}); metrics are reported at shutdown only");
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(plan) = &self.plan {
            plan.meters.flush();
        }
        if let Some(observer) = &mut self.observer {
            observer.on_tick();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(MeteredStream::new(self.plan.clone())))
    }
}
