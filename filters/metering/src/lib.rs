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

use zerolayer_core::metering::MeteringConfig;
use zerolayer_core::metering::config::SamplingPlan;
use zerolayer_host::{Host, Hosts, ObserverQueue, RootStage, StreamStage};
use zerolayer_observer::{EmbeddedObserver, ObserverConfig};

use meters::Meters;
use stream::MeteredStream;

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: MeteringConfig,
    pub sampling: SamplingPlan,
    pub meters: Meters,
    /// The observer's job queue (full records).
    pub queue: ObserverQueue,
}

/// The stage's root.
#[derive(Default)]
pub struct MeteringRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode (shipping records).
    observer: EmbeddedObserver,
}

impl<H: Hosts> RootStage<H> for MeteringRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
        let Some(config) =
            zerolayer_host::load_config("metering", configuration, MeteringConfig::from_json)
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
        let Some(observer) = EmbeddedObserver::configure(
            host,
            &config.observer,
            config.sink.is_some(),
            || ObserverConfig::for_metering(config.clone()),
            "metering",
        ) else {
            return false;
        };
        self.observer = observer;
        self.plan = Some(Rc::new(Plan {
            sampling,
            meters: Meters::define(host, config.labels),
            queue: self.observer.queue(&config.observer, "metering"),
            config,
        }));
        if let Err(status) = host.set_tick_period(Duration::from_millis(200)) {
            log::warn!("metering: no tick ({status:?}); metrics are reported at shutdown only");
        }
        true
    }

    fn tick(&mut self, host: &mut H::Root) {
        RootStage::<H>::flush(self, host);
        self.observer.tick(host);
    }

    fn flush(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.meters.flush(host);
        }
    }

    fn call_answered(&mut self, host: &mut H::Root, token: u32, body_size: usize) {
        self.observer.call_answered(host, token, body_size);
    }

    fn done(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.meters.flush(host);
        }
        self.observer.done(host);
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H::Stream>> {
        Box::new(MeteredStream::new(self.plan.clone()))
    }
}
