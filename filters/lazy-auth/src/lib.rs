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

use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::credential::RecentCredentials;
use zerolayer_core::auth::jwt::Validation;
use zerolayer_core::auth::policy::Policy;
use zerolayer_host::{Action, Callback, Host, ObserverQueue, RootStage, StreamStage};
use zerolayer_observer::{EmbeddedObserver, ObserverConfig};

use decide::Stream;
use inline::InlineKeys;
use metrics::Metrics;

/// Tick period: counters (and the embedded observer in tick mode).
const TICK: Duration = Duration::from_millis(200);

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
    pub(crate) fn flush_audit(&self, host: &mut impl Host) {
        let records = std::mem::take(&mut *self.audit_batch.borrow_mut());
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        let job = zerolayer_core::event::Job::AuditBatch(records).encode();
        if !self.queue.post(host, &job) {
            self.metrics.lost_n(n);
        }
    }
}

/// The stage's root.
#[derive(Default)]
pub struct AuthRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode.
    observer: EmbeddedObserver,
}

impl<H: Host> RootStage<H> for AuthRoot {
    fn configure(&mut self, host: &mut H, configuration: &[u8]) -> bool {
        let Some(config) =
            zerolayer_host::load_config("lazy-auth", configuration, LazyAuthConfig::from_json)
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
        self.observer = match EmbeddedObserver::configure(
            host,
            &config.observer,
            true,
            || ObserverConfig::for_lazy_auth(config.clone()),
            "lazy-auth",
        ) {
            Ok(observer) => observer,
            Err(err) => {
                log::error!("lazy-auth: invalid configuration: observer: {err}");
                return false;
            }
        };
        let plan = Plan {
            policy: config.policy(),
            validation: zerolayer_observer::auth::validation(&config),
            trusted,
            keys,
            queue: self.observer.queue(&config.observer, "lazy-auth"),
            metrics: Metrics::define(host),
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
        if let Err(status) = host.set_tick_period(TICK) {
            log::warn!("lazy-auth: no tick ({status:?}); counters flush at shutdown only");
        }
        true
    }

    fn tick(&mut self, host: &mut H) {
        if let Some(plan) = &self.plan {
            plan.flush_audit(host);
            plan.metrics.flush(host);
        }
        self.observer.tick(host);
    }

    fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        self.observer.call_answered(host, token, body_size);
    }

    fn done(&mut self, host: &mut H) {
        if let Some(plan) = &self.plan {
            plan.flush_audit(host);
            plan.metrics.flush(host);
        }
        self.observer.done(host);
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H>> {
        Box::new(AuthStream {
            stream: self.plan.clone().map(Stream::new),
        })
    }
}

/// One request.
struct AuthStream {
    /// `None` when the plugin has no configuration (the host ran it despite
    /// a refusal): requests are refused, never let through unauthenticated.
    stream: Option<Stream>,
}

impl<H: Host> StreamStage<H> for AuthStream {
    fn request_headers(&mut self, host: &mut H, _end_of_stream: bool) -> Action {
        // lazy-auth decides on headers: no body callback of its is needed.
        host.done_with(Callback::RequestBody);
        host.done_with(Callback::ResponseBody);
        match &mut self.stream {
            Some(stream) => stream.on_request_headers(host),
            None => {
                // Lazy must never mean open: no configuration, no entry.
                host.send_json_error(500, "api_error", "authentication is not configured");
                Action::Pause
            }
        }
    }

    fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        if let Some(stream) = &mut self.stream {
            stream.introspection_answered(host, token, body_size);
        }
    }

    fn log(&mut self, host: &mut H) {
        if let Some(stream) = &self.stream {
            stream.on_log(host);
        }
    }
}
