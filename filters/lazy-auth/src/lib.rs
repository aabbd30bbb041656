//! zerolayer lazy-auth: the hot path hashes the credential and reads its
//! verdict from shared data; verification happens off the path, in the
//! observer. Unknown credentials are admitted only within the exposure
//! bounds; escalated tenants, trusted clients and exhausted bounds verify
//! synchronously (inline for JWTs, by a paused callout for API keys).
//!
//! Lifecycle, top to bottom: configuration → request headers (decide) →
//! callout answer (synchronous API key check) → log (audit record) → tick
//! (counters; the embedded observer in tick mode).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod decide;
mod inline;
mod metrics;

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::credential::RecentCredentials;
use zerolayer_core::auth::jwt::Validation;
use zerolayer_core::auth::policy::Policy;
use zerolayer_core::config::ObserverMode;
use zerolayer_observer::{Observer, ObserverConfig};
use zerolayer_proxy::ObserverQueue;
use zerolayer_proxy::fused::{self, Callback};

use decide::Stream;
use inline::InlineKeys;
use metrics::Metrics;

/// Tick period: counters (and the embedded observer in tick mode).
const TICK: Duration = Duration::from_millis(200);

/// The module's entry point (`_initialize`): registers the root context.
#[cfg(not(feature = "stage"))]
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(AuthRoot::default()) });
    }}
}

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: LazyAuthConfig,
    pub policy: Policy,
    pub validation: Validation,
    pub trusted: Vec<regex::bytes::Regex>,
    pub keys: InlineKeys,
    /// The observer's job queue.
    pub queue: ObserverQueue,
    pub metrics: Metrics,
    /// Audit records of this VM's requests, enqueued together on tick or
    /// when [`AUDIT_BATCH`] are waiting: an enqueue (and the observer's
    /// wake-up) per request cost as much as the rest of the filter.
    pub audit_batch: std::cell::RefCell<Vec<zerolayer_core::event::AuditRecord>>,
    /// The hashes of this VM's recent credentials (clients resend theirs).
    pub recent: std::cell::RefCell<RecentCredentials>,
}

/// Credentials whose hash a VM remembers.
const RECENT_CREDENTIALS: usize = 64;

/// Audit records enqueued together at most.
pub(crate) const AUDIT_BATCH: usize = 64;

impl Plan {
    /// Enqueues the waiting audit records as one job (counted as lost,
    /// each, if the observer cannot take it).
    pub(crate) fn flush_audit(&self) {
        let records = std::mem::take(&mut *self.audit_batch.borrow_mut());
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        if !self
            .queue
            .post(&zerolayer_core::event::Job::AuditBatch(records).encode())
        {
            self.metrics.lost_n(n);
        }
    }
}

/// The plugin's root context.
#[derive(Default)]
pub struct AuthRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode.
    observer: Option<Observer>,
}

impl Context for AuthRoot {
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
            plan.flush_audit();
            plan.metrics.flush();
        }
        if let Some(observer) = &self.observer {
            observer.flush_counters();
        }
        true
    }
}

impl RootContext for AuthRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = zerolayer_proxy::load_config("lazy-auth", LazyAuthConfig::from_json)
        else {
            return false;
        };
        let keys = match InlineKeys::new(&config) {
            Ok(keys) => keys,
            Err(err) => {
                log::error!("lazy-auth: invalid configuration: {err}");
                return false;
            }
        };
        let trusted = config
            .trusted_clients
            .iter()
            .filter_map(|c| regex::bytes::Regex::new(&c.user_agent).ok())
            .collect();
        if config.observer.mode == ObserverMode::Tick {
            match Observer::configure(&ObserverConfig::for_lazy_auth(config.clone()), "lazy-auth") {
                Ok(observer) => self.observer = Some(observer),
                Err(err) => {
                    log::error!("lazy-auth: invalid configuration: observer: {err}");
                    return false;
                }
            }
        }
        let plan = Plan {
            policy: config.policy(),
            validation: zerolayer_observer::auth::validation(&config),
            trusted,
            keys,
            queue: ObserverQueue::new(
                config.observer.clone(),
                self.observer.as_ref().map(Observer::queue),
                "lazy-auth",
            ),
            metrics: Metrics::define(),
            audit_batch: std::cell::RefCell::new(Vec::new()),
            recent: std::cell::RefCell::new(RecentCredentials::new(RECENT_CREDENTIALS)),
            config,
        };
        log::info!(
            "lazy-auth: configured ({} credential sources, unknown credentials {:?}, at most {} unverified requests each, observer {:?})",
            plan.config.credentials.len(),
            plan.config.unknown,
            plan.config.max_unverified_per_token,
            plan.config.observer.mode,
        );
        self.plan = Some(Rc::new(plan));
        if let Err(status) = zerolayer_proxy::fused::set_tick_period(TICK) {
            log::warn!("lazy-auth: no tick ({status:?}); counters flush at shutdown only");
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(plan) = &self.plan {
            plan.flush_audit();
            plan.metrics.flush();
        }
        if let Some(observer) = &mut self.observer {
            observer.on_tick();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(AuthStream {
            stream: self.plan.clone().map(Stream::new),
        }))
    }
}

/// One request.
struct AuthStream {
    /// `None` when the plugin has no configuration (the host ran it despite
    /// a refusal): requests are refused, never let through unauthenticated.
    stream: Option<Stream>,
}

impl Context for AuthStream {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let Some(stream) = &mut self.stream {
            stream.introspection_answered(token, body_size);
        }
    }
}

impl HttpContext for AuthStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // lazy-auth decides on headers: no body callback of its is needed.
        fused::done_with(Callback::RequestBody);
        fused::done_with(Callback::ResponseBody);
        match &mut self.stream {
            Some(stream) => stream.on_request_headers(),
            None => {
                // Lazy must never mean open: no configuration, no entry.
                zerolayer_proxy::send_json_error(
                    500,
                    "api_error",
                    "authentication is not configured",
                );
                Action::Pause
            }
        }
    }

    fn on_log(&mut self) {
        if let Some(stream) = &self.stream {
            stream.on_log();
        }
    }
}
