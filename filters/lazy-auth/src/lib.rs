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
#[cfg(test)]
mod testkit;

use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::auth::budget;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::credential::RecentCredentials;
use zerolayer_core::auth::jwt::Validation;
use zerolayer_core::auth::policy::Policy;
use zerolayer_host::{
    Action, Callback, Host, Hosts, ObserverQueue, RootStage, StreamHost, StreamStage,
};
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
    /// The JWKS fetches this VM's requests have in flight.
    pub jwks_fetches: inline::RequestJwksFetches,
    /// The observer's job queue.
    pub queue: ObserverQueue,
    pub metrics: Metrics,
    /// Audit records of this VM's requests, enqueued together on tick or
    /// when [`AUDIT_BATCH`] are waiting: an enqueue (and the observer's
    /// wake-up) per request cost as much as the rest of the filter.
    pub audit_batch: std::cell::RefCell<Vec<zerolayer_core::event::AuditRecord>>,
    /// The hashes of this VM's recent credentials (clients resend theirs).
    pub recent: std::cell::RefCell<RecentCredentials>,
    /// The gateway's bucket seed once read ([`budget::SEED_KEY`]).
    pub bucket_seed: std::cell::Cell<Option<u64>>,
}

/// Credentials whose hash a VM remembers.
const RECENT_CREDENTIALS: usize = 64;

/// Audit records enqueued together at most.
pub(crate) const AUDIT_BATCH: usize = 64;

impl Plan {
    /// The seed keying the choice of bucket, the same in every worker: read
    /// once from shared data, written there by the first worker that needs
    /// it (random bytes from the host's WASI `random_get`, or the OS).
    pub(crate) fn bucket_seed(&self, host: &mut impl Host) -> u64 {
        if let Some(seed) = self.bucket_seed.get() {
            return seed;
        }
        let mut fresh = [0u8; 8];
        if getrandom::getrandom(&mut fresh).is_err() {
            // No randomness from the host: the clock's nanoseconds, never
            // a constant every gateway shares.
            fresh = host.now_us().to_le_bytes();
        }
        match host.shared_update_if(budget::SEED_KEY, |current| {
            let (seed, write) = budget::seed(current, fresh);
            (write, seed)
        }) {
            Some(seed) => {
                self.bucket_seed.set(Some(seed));
                seed
            }
            // Not stored: this request uses its own, the next one tries again.
            None => u64::from_le_bytes(fresh),
        }
    }

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

impl<H: Hosts> RootStage<H> for AuthRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
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
        let Some(observer) = EmbeddedObserver::configure(
            host,
            &config.observer,
            true,
            || ObserverConfig::for_lazy_auth(config.clone()),
            "lazy-auth",
        ) else {
            return false;
        };
        self.observer = observer;
        let plan = Plan {
            policy: config.policy(),
            validation: zerolayer_observer::auth::validation(&config),
            trusted,
            keys,
            jwks_fetches: inline::RequestJwksFetches::default(),
            queue: self.observer.queue(&config.observer, "lazy-auth"),
            metrics: Metrics::define(host),
            audit_batch: std::cell::RefCell::new(Vec::new()),
            recent: std::cell::RefCell::new(RecentCredentials::new(RECENT_CREDENTIALS)),
            bucket_seed: std::cell::Cell::new(None),
            config,
        };
        log::info!(
            "lazy-auth: configured ({} credential sources, unknown credentials {:?}, at most {} unverified requests each, observer {:?})",
            plan.config.credentials.len(),
            plan.config.unknown,
            plan.config.max_unverified_per_token,
            plan.config.observer.mode,
        );
        log::info!(
            "lazy-auth: {}",
            zerolayer_core::footprint::describe(&plan.config.key_spaces())
        );
        self.plan = Some(Rc::new(plan));
        if let Err(status) = host.set_tick_period(TICK) {
            log::warn!("lazy-auth: no tick ({status:?}); counters flush at shutdown only");
        }
        true
    }

    fn tick(&mut self, host: &mut H::Root) {
        RootStage::<H>::flush(self, host);
        self.observer.tick(host);
    }

    fn flush(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.flush_audit(host);
            plan.metrics.flush(host);
        }
    }

    fn call_answered(&mut self, host: &mut H::Root, token: u32, body_size: usize) {
        self.observer.call_answered(host, token, body_size);
    }

    fn done(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.flush_audit(host);
            plan.metrics.flush(host);
        }
        self.observer.done(host);
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H::Stream>> {
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

impl<H: StreamHost> StreamStage<H> for AuthStream {
    fn request_headers(&mut self, host: &mut H, _end_of_stream: bool) -> Action {
        host.done_with(Callback::ResponseBody);
        let action = match &mut self.stream {
            Some(stream) => stream.on_request_headers(host),
            None => {
                // Lazy must never mean open: no configuration, no entry.
                host.send_json_error(500, "api_error", "authentication is not configured");
                Action::Pause
            }
        };
        // lazy-auth decides on headers: no body callback of its is needed,
        // unless a check waits for it (ngx_wasm_module).
        if !self.stream.as_ref().is_some_and(Stream::awaits_body) {
            host.done_with(Callback::RequestBody);
        }
        action
    }

    fn request_body(&mut self, host: &mut H, _body_size: usize, _end_of_stream: bool) -> Action {
        let action = match &mut self.stream {
            Some(stream) => stream.on_request_body(host),
            None => Action::Continue,
        };
        host.done_with(Callback::RequestBody);
        action
    }

    fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        if let Some(stream) = &mut self.stream {
            stream.callout_answered(host, token, body_size);
        }
    }

    fn log(&mut self, host: &mut H) {
        if let Some(stream) = &self.stream {
            stream.on_log(host);
        }
    }
}

/// Configuration, the unconfigured stream, and audit records on `log`.
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
    use zerolayer_core::auth::verdict::{self, Verdict};
    use zerolayer_core::event::{AuditRecord, Job};
    use zerolayer_core::internal;
    use zerolayer_host::{Action, Callback, FakeHost, Host, RootStage};

    use super::AuthRoot;
    use crate::testkit::{NOW, api_keys, configured, host_with_observer, jobs, request};

    fn audited() -> String {
        api_keys(json!({"audit": {"cluster": "audit", "path": "/audit"}}))
    }

    fn audit_records(host: &FakeHost) -> Vec<AuditRecord> {
        jobs(host)
            .into_iter()
            .flat_map(|job| match job {
                Job::AuditBatch(records) => records,
                Job::Audit(record) => vec![record],
                _ => vec![],
            })
            .collect()
    }

    fn valid_verdict(host: &mut FakeHost, credential: &[u8]) {
        let hash = TokenHash::credential(CredentialKind::ApiKey, credential);
        let v = Verdict::valid(&hash, NOW, None, 300, Some("acme".into()), None);
        assert!(host.shared_put(&verdict::key(&hash, 65_536), &v.encode()));
    }

    #[test]
    fn a_valid_configuration_asks_for_the_tick() {
        let mut host = host_with_observer();
        configured(&mut host, &api_keys(json!({})));
        assert_eq!(host.tick, Some(Duration::from_millis(200)));
    }

    #[test]
    fn an_invalid_configuration_is_refused() {
        let mut host = host_with_observer();
        let mut root = AuthRoot::default();
        // An api_key source (the default sources) without an introspection endpoint.
        assert!(!RootStage::<FakeHost>::configure(
            &mut root, &mut host, b"{}"
        ));
        assert!(!RootStage::<FakeHost>::configure(
            &mut root,
            &mut host,
            b"not json"
        ));
        assert_eq!(host.tick, None);
    }

    #[test]
    fn a_stream_without_configuration_is_refused_500() {
        let mut host = host_with_observer();
        let root = AuthRoot::default();
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 500);
        assert!(host.sent[0].text().contains("not configured"));
        assert_eq!(host.properties.get(internal::AUTH_PROPERTY), None);
    }

    #[test]
    fn a_stream_is_done_with_both_bodies() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &api_keys(json!({})));
        request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert!(host.done_with.contains(&Callback::RequestBody));
        assert!(host.done_with.contains(&Callback::ResponseBody));
    }

    #[test]
    fn a_refusal_is_audited_without_the_audit_observer() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &audited());
        let (mut stream, _) = request(&root, &mut host, &[("x-request-id", "req-1")]);
        stream.log(&mut host);
        // Batched: enqueued on the tick.
        assert!(audit_records(&host).is_empty());
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        let records = audit_records(&host);
        assert_eq!(records.len(), 1);
        let r = &records[0];
        assert_eq!(r.decision, "missing");
        assert_eq!(r.reason, "missing_credential");
        assert!(!r.verified);
        assert_eq!(r.request_id, "req-1");
        assert_eq!(r.at_ms, NOW * 1000);
    }

    #[test]
    fn an_allowed_request_is_not_audited_unless_activation_asks() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &audited());
        valid_verdict(&mut host, b"sk-live-1");
        host.properties.insert(
            internal::OBSERVERS_PROPERTY.into(),
            b"metering,cache".to_vec(),
        );
        let (mut stream, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Continue);
        stream.log(&mut host);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(audit_records(&host).is_empty());
    }

    #[test]
    fn an_allowed_request_is_audited_when_the_observers_list_audit() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &audited());
        valid_verdict(&mut host, b"sk-live-1");
        host.properties.insert(
            internal::OBSERVERS_PROPERTY.into(),
            b"metering,audit".to_vec(),
        );
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        stream.log(&mut host);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        let records = audit_records(&host);
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].decision, "valid_cached");
        assert_eq!(records[0].tenant.as_deref(), Some("acme"));
        assert!(records[0].verified);
        assert_eq!(
            records[0].hash_prefix,
            TokenHash::credential(CredentialKind::ApiKey, b"sk-live-1").prefix()
        );
    }

    #[test]
    fn nothing_is_audited_without_an_audit_sink() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let (mut stream, _) = request(&root, &mut host, &[]);
        stream.log(&mut host);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(audit_records(&host).is_empty());
    }

    #[test]
    fn a_full_audit_batch_is_enqueued_before_the_tick() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &audited());
        for _ in 0..super::AUDIT_BATCH {
            let (mut stream, _) = request(&root, &mut host, &[]);
            stream.log(&mut host);
        }
        let batches = jobs(&host);
        assert_eq!(batches.len(), 1, "one job for the whole batch");
        assert_eq!(audit_records(&host).len(), super::AUDIT_BATCH);
    }

    #[test]
    fn audit_records_the_observer_cannot_take_are_counted_lost() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &audited());
        let (mut stream, _) = request(&root, &mut host, &[]);
        stream.log(&mut host);
        host.refuse_enqueue = true;
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert_eq!(host.metric("zerolayer_auth_jobs_lost"), Some(1));
    }
}
