//! The observer: everything zerolayer does off the request path. Filters
//! post compact [`Job`]s on a shared queue; the observer drains it, verifies
//! credentials and stores verdicts, keeps per-tenant escalation windows,
//! fetches JWKS, ships audit and usage records in batches, and writes cache
//! entries to the fleet tier, with breakers in front of every endpoint.
//!
//! It runs in one of two places (`observer.mode` in the filters' configs):
//! - **singleton** (Envoy): a bootstrap service (`envoy.bootstrap.wasm`,
//!   `singleton: true`) owns the queue; `on_queue_ready` wakes it when a
//!   worker enqueues, and its tick does the periodic work;
//! - **tick** (Kong, no singletons nor queue notifications): each filter
//!   root context embeds an [`Observer`], owns its own queue and drains it
//!   on tick.
//!
//! Lifecycle: configuration ([`Observer::configure`]) → jobs
//! ([`Observer::drain`]) → callout answers ([`Observer::on_http_call_response`])
//! → periodic work ([`Observer::on_tick`]).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod auth;
mod calls;
mod fleet;
mod metrics;
mod shipper;

use serde::Deserialize;
use zerolayer_core::ConfigError;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{ObserverLink, ObserverMode};
use zerolayer_core::event::{AuditRecord, Job};
use zerolayer_core::metering::MeteringConfig;
use zerolayer_host::{Host, ObserverQueue};

use auth::AuthWorker;
use calls::{CallKind, Calls};
use fleet::FleetWriter;
use metrics::{JobKind, ObserverMetrics, RecordOutcome, WriteOutcome};
use shipper::{Shipper, Sink};

/// Jobs handled per wake-up at most: a burst never blocks the thread long.
const DRAIN_BUDGET: usize = 1000;

/// The observer's configuration (the singleton's plugin configuration):
/// the configurations of the filters it works for, as those filters get them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObserverConfig {
    /// lazy-auth's configuration: verification, JWKS, escalation, audit.
    #[serde(default)]
    pub lazy_auth: Option<LazyAuthConfig>,
    /// post-cache's configuration: fleet-tier writes.
    #[serde(default)]
    pub post_cache: Option<PostCacheConfig>,
    /// metering's configuration: the usage sink.
    #[serde(default)]
    pub metering: Option<MeteringConfig>,
    /// Tick period, ms (JWKS refresh, audit flushes, escalation windows,
    /// and draining where the host has no queue notifications).
    #[serde(default = "default_tick")]
    pub tick_ms: u64,
}

fn default_tick() -> u64 {
    200
}

impl ObserverConfig {
    /// Parses and checks the configuration.
    pub fn from_json(bytes: &[u8]) -> Result<ObserverConfig, ConfigError> {
        ObserverConfig::checked(zerolayer_core::config::from_json(bytes)?)
    }

    /// The configuration of the observer working for the sections given,
    /// each parsed already (the native module parses each section once),
    /// checked as [`ObserverConfig::from_json`] checks it; the tick period
    /// is the default.
    pub fn from_sections(
        lazy_auth: Option<LazyAuthConfig>,
        post_cache: Option<PostCacheConfig>,
        metering: Option<MeteringConfig>,
    ) -> Result<ObserverConfig, ConfigError> {
        ObserverConfig::checked(ObserverConfig {
            lazy_auth,
            post_cache,
            metering,
            tick_ms: default_tick(),
        })
    }

    /// `config` if its sections check and agree on one observer, else the
    /// error naming the field.
    fn checked(config: ObserverConfig) -> Result<ObserverConfig, ConfigError> {
        let within = |section: &str, e: ConfigError| {
            ConfigError::new(format!("{section}.{}", e.path()), e.message())
        };
        if let Some(lazy) = &config.lazy_auth {
            lazy.check().map_err(|e| within("lazy_auth", e))?;
        }
        if let Some(cache) = &config.post_cache {
            cache.check().map_err(|e| within("post_cache", e))?;
        }
        if let Some(metering) = &config.metering {
            metering.check().map_err(|e| within("metering", e))?;
        }
        let links = [
            ("lazy_auth", config.lazy_auth.as_ref().map(|c| &c.observer)),
            (
                "post_cache",
                config.post_cache.as_ref().map(|c| &c.observer),
            ),
            ("metering", config.metering.as_ref().map(|c| &c.observer)),
        ];
        let mut present = links
            .iter()
            .filter_map(|(name, link)| link.map(|link| (*name, link)));
        let Some((first, link)) = present.next() else {
            return Err(ConfigError::new(
                "lazy_auth",
                "the observer needs at least one of lazy_auth, post_cache, metering",
            ));
        };
        if let Some((other, _)) = present.find(|(_, l)| *l != link) {
            return Err(ConfigError::new(
                format!("{other}.observer"),
                format!(
                    "must name the same vm_id, queue and mode as {first}.observer (one observer, one queue)"
                ),
            ));
        }
        Ok(config)
    }

    /// The observer for lazy-auth alone (its tick mode embeds one).
    pub fn for_lazy_auth(config: LazyAuthConfig) -> ObserverConfig {
        ObserverConfig {
            lazy_auth: Some(config),
            ..ObserverConfig::empty()
        }
    }

    /// The observer for post-cache alone (its tick mode embeds one).
    pub fn for_post_cache(config: PostCacheConfig) -> ObserverConfig {
        ObserverConfig {
            post_cache: Some(config),
            ..ObserverConfig::empty()
        }
    }

    /// The observer for metering alone (its tick mode embeds one).
    pub fn for_metering(config: MeteringConfig) -> ObserverConfig {
        ObserverConfig {
            metering: Some(config),
            ..ObserverConfig::empty()
        }
    }

    fn empty() -> ObserverConfig {
        ObserverConfig {
            lazy_auth: None,
            post_cache: None,
            metering: None,
            tick_ms: default_tick(),
        }
    }

    /// Where the filters reach this observer.
    pub fn link(&self) -> ObserverLink {
        let lazy = self.lazy_auth.as_ref().map(|c| &c.observer);
        let cache = self.post_cache.as_ref().map(|c| &c.observer);
        let metering = self.metering.as_ref().map(|c| &c.observer);
        lazy.or(cache).or(metering).cloned().unwrap_or_default()
    }
}

/// The observer's state.
pub struct Observer {
    queue: u32,
    /// Tick mode: the key of the queue's backlog count, which producers
    /// raise and the drain lowers (`zerolayer_core::queue`); `None` in
    /// singleton mode.
    backlog: Option<String>,
    auth: Option<AuthWorker>,
    audit: Option<Shipper>,
    usage: Option<Shipper>,
    attribution: Option<Shipper>,
    fleet: Option<FleetWriter>,
    calls: Calls,
    counters: ObserverMetrics,
}

impl Observer {
    /// Builds the observer for the filters `config` names and registers
    /// (owns) the job queue. `who` names it in log lines.
    pub fn configure(
        host: &mut impl Host,
        config: &ObserverConfig,
        who: &str,
    ) -> Result<Observer, String> {
        let link = config.link();
        // In tick mode every filter embeds its own observer, configured for
        // that filter only: each owns its own queue, or one filter's
        // observer would drain (and drop) another's jobs. Kong shares queues
        // by name across the whole gateway, so the name says whose it is.
        let queue_name = link.queue_name(who);
        let queue = host
            .register_queue(&queue_name)
            .map_err(|s| format!("cannot register queue {queue_name}: {s:?}"))?;
        let auth = config.lazy_auth.as_ref().map(AuthWorker::new).transpose()?;
        let fleet = config
            .post_cache
            .as_ref()
            .and_then(|c| c.fleet.clone())
            .map(FleetWriter::new);
        let mut work = Vec::new();
        if let (Some(auth), Some(lazy)) = (&auth, &config.lazy_auth) {
            work.push(format!("{} verification keys", auth.key_count()));
            if lazy.jwt.jwks.is_some() {
                work.push("JWKS endpoint".into());
            }
            if lazy.api_keys.is_some() {
                work.push("API key introspection".into());
            }
            if lazy.audit.is_some() {
                work.push("audit sink".into());
            }
            if lazy.attribution.is_some() {
                work.push("attribution sink".into());
            }
        }
        if let Some(fleet) = &fleet {
            work.push(format!("cache fleet tier on cluster {}", fleet.cluster()));
        }
        let usage = config
            .metering
            .as_ref()
            .and_then(|m| m.sink.clone())
            .map(|sink| Shipper::new(Sink::Usage, sink));
        if let Some(usage) = &usage {
            work.push(format!("usage sink on cluster {}", usage.cluster()));
        }
        log::info!(
            "{who}: observer on queue {queue_name} ({})",
            work.join(", ")
        );
        Ok(Observer {
            queue,
            backlog: link.backlog_key(who),
            audit: config
                .lazy_auth
                .as_ref()
                .and_then(|l| l.audit.clone())
                .map(|sink| Shipper::new(Sink::Audit, sink)),
            attribution: config
                .lazy_auth
                .as_ref()
                .and_then(|l| l.attribution.clone())
                .map(|sink| Shipper::new(Sink::Attribution, sink)),
            usage,
            auth,
            fleet,
            calls: Calls::default(),
            counters: ObserverMetrics::define(host, who),
        })
    }

    /// Handles the jobs waiting in the queue (up to a budget).
    pub fn drain(&mut self, host: &mut impl Host) {
        // One clock read per wake-up: the jobs of a burst arrive together.
        let now = host.now_ms();
        let mut drained = 0u64;
        let mut drained_bytes = 0u64;
        let mut emptied = false;
        for _ in 0..DRAIN_BUDGET {
            let item = match host.dequeue(self.queue) {
                Ok(Some(item)) => item,
                Ok(None) => {
                    emptied = true;
                    break;
                }
                Err(status) => {
                    log::warn!("observer: dequeue failed: {status:?}");
                    break;
                }
            };
            drained_bytes += zerolayer_core::queue::queued_size(item.len());
            match Job::decode(&item) {
                Some(Job::Verify(job)) => {
                    self.counters.jobs.add(JobKind::Verify);
                    match &mut self.auth {
                        Some(auth) => auth.verify(host, job, &mut self.calls, &self.counters),
                        None => self.counters.verify_dropped.add(1),
                    }
                }
                // One record (filters before batching) or a VM's batch.
                Some(Job::Audit(record)) => self.audit(host, std::slice::from_ref(&record), now),
                Some(Job::AuditBatch(records)) => self.audit(host, &records, now),
                Some(Job::Usage(record)) => {
                    self.counters.jobs.add(JobKind::Usage);
                    match &mut self.usage {
                        Some(usage) => {
                            let mut line = Vec::with_capacity(256);
                            record.write_sink_row(&mut line);
                            usage.push(host, line, now, &mut self.calls, &self.counters);
                        }
                        None => self.counters.usage.records.add(RecordOutcome::Dropped),
                    }
                }
                Some(Job::Outcome(outcome)) => {
                    if let Some(auth) = &mut self.auth {
                        auth.record_outcome(host, &outcome, &self.counters);
                    }
                }
                Some(Job::CacheWrite(write)) => {
                    self.counters.jobs.add(JobKind::CacheWrite);
                    match &mut self.fleet {
                        Some(fleet) => fleet.write(host, write, &mut self.calls, &self.counters),
                        None => self.counters.fleet_writes.add(WriteOutcome::Dropped),
                    }
                }
                None => self.counters.jobs.add(JobKind::Unreadable),
            }
            drained += 1;
        }
        self.ship_attributions(host, now);
        if drained > 0 {
            self.counters.queue_depth.record(host, drained);
            if let Some(key) = &self.backlog {
                if emptied {
                    // Exact again: what producers counted but had not yet
                    // enqueued is forgotten (bounded by one job each).
                    host.shared_put(key, &zerolayer_core::queue::encode_backlog(0));
                } else {
                    zerolayer_host::release_backlog(host, key, drained_bytes);
                }
            }
        }
    }

    /// Hands what the auth worker found valid to the attribution sink.
    fn ship_attributions(&mut self, host: &mut impl Host, now: u64) {
        let (Some(auth), Some(sink)) = (&mut self.auth, &mut self.attribution) else {
            return;
        };
        for record in auth.take_attributions() {
            let mut line = Vec::with_capacity(128);
            record.write_sink_row(&mut line);
            sink.push(host, line, now, &mut self.calls, &self.counters);
        }
    }

    /// Hands audit records to the audit sink (dropped, counted, without one).
    fn audit(&mut self, host: &mut impl Host, records: &[AuditRecord], now: u64) {
        let n = records.len() as u64;
        self.counters.jobs.add_n(JobKind::Audit, n);
        let Some(audit) = &mut self.audit else {
            self.counters.audit.records.add_n(RecordOutcome::Dropped, n);
            return;
        };
        for record in records {
            let mut line = Vec::with_capacity(256);
            record.write_sink_row(&mut line);
            audit.push(host, line, now, &mut self.calls, &self.counters);
        }
    }

    /// Ships the sinks' batches that are due.
    fn flush_sinks(&mut self, host: &mut impl Host) {
        let now_ms = host.now_ms();
        for shipper in [&mut self.audit, &mut self.usage, &mut self.attribution]
            .into_iter()
            .flatten()
        {
            shipper.maybe_flush(host, now_ms, &mut self.calls, &self.counters);
        }
        if let Some(usage) = &self.usage {
            self.counters
                .usage_buffered
                .record(host, usage.buffered() as u64);
        }
    }

    /// Periodic work: drain (hosts without queue notifications), JWKS
    /// refresh, audit flush, escalation windows, counters.
    pub fn on_tick(&mut self, host: &mut impl Host) {
        self.drain(host);
        let now = host.now_secs();
        if let Some(auth) = &mut self.auth {
            auth.maintain(host, now, &mut self.calls, &self.counters);
        }
        let now_ms = host.now_ms();
        self.ship_attributions(host, now_ms);
        self.flush_sinks(host);
        for shipper in [&mut self.audit, &mut self.usage, &mut self.attribution]
            .into_iter()
            .flatten()
        {
            shipper.report_drops();
        }
        self.counters.flush(host);
    }

    /// A callout this observer made has an answer (or failed: no `:status`).
    /// Returns whether the token was ours.
    pub fn on_http_call_response(
        &mut self,
        host: &mut impl Host,
        token: u32,
        body_size: usize,
    ) -> bool {
        let Some(kind) = self.calls.take(token) else {
            return false;
        };
        let answer = host.callout_answer(body_size);
        let status = answer.status;
        match kind {
            CallKind::Batch(sink, batch) => {
                let shipper = match sink {
                    Sink::Audit => &mut self.audit,
                    Sink::Usage => &mut self.usage,
                    Sink::Attribution => &mut self.attribution,
                };
                if let Some(shipper) = shipper {
                    let now_ms = host.now_ms();
                    shipper.answered(batch, status, now_ms, &self.counters);
                }
                // The sink is back: ship what waits without waiting a tick,
                // except in tick mode. ngx_wasm_module gives a callout
                // started in a callout's answer the answered call's fake
                // request, freed when the answer returns: the new call
                // then connects on freed memory and the worker crashes
                // (signal 11, under load). The next tick ships it.
                if self.backlog.is_none() {
                    self.flush_sinks(host);
                }
            }
            CallKind::CacheWrite => {
                if let Some(fleet) = &mut self.fleet {
                    fleet.answered(status, &self.counters);
                }
            }
            other => {
                if let Some(auth) = &mut self.auth {
                    auth.answered(
                        host,
                        other,
                        status,
                        &answer.body,
                        &mut self.calls,
                        &self.counters,
                    );
                }
            }
        }
        true
    }

    /// The job queue this observer owns.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// Reports counters (at shutdown, too).
    pub fn flush_counters(&self, host: &mut impl Host) {
        self.counters.flush(host);
    }
}

/// The observer a filter's root embeds in tick mode (hosts without
/// singletons or queue notifications: Kong), or none in singleton mode.
/// The three filters that post jobs embed it the same way.
#[derive(Default)]
pub struct EmbeddedObserver(Option<Observer>);

impl EmbeddedObserver {
    /// In tick mode, when the filter has work for an observer (`needed`),
    /// the observer `config` describes, owning its queue; otherwise none.
    /// `None`: refused, said in one line (`<who>: invalid configuration:
    /// observer: …`), so the filter's configuration is refused too.
    pub fn configure(
        host: &mut impl Host,
        link: &ObserverLink,
        needed: bool,
        config: impl FnOnce() -> ObserverConfig,
        who: &str,
    ) -> Option<EmbeddedObserver> {
        if !needed || link.mode != ObserverMode::Tick {
            return Some(EmbeddedObserver(None));
        }
        match Observer::configure(host, &config(), who) {
            Ok(observer) => Some(EmbeddedObserver(Some(observer))),
            Err(err) => {
                log::error!("{who}: invalid configuration: observer: {err}");
                None
            }
        }
    }

    /// The queue the filter posts to: the embedded observer's, or the
    /// singleton's `link` names.
    pub fn queue(&self, link: &ObserverLink, who: &str) -> ObserverQueue {
        ObserverQueue::new(link.clone(), self.0.as_ref().map(Observer::queue), who)
    }

    /// The root's tick: the embedded observer's periodic work.
    pub fn tick(&mut self, host: &mut impl Host) {
        if let Some(observer) = &mut self.0 {
            observer.on_tick(host);
        }
    }

    /// A callout answered at the root: the embedded observer's, if its own.
    pub fn call_answered(&mut self, host: &mut impl Host, token: u32, body_size: usize) {
        if let Some(observer) = &mut self.0 {
            observer.on_http_call_response(host, token, body_size);
        }
    }

    /// The VM is going away: report the observer's counters.
    pub fn done(&mut self, host: &mut impl Host) {
        if let Some(observer) = &self.0 {
            observer.flush_counters(host);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(json: &str) -> String {
        match ObserverConfig::from_json(json.as_bytes()) {
            Ok(_) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn either_filter_or_both_with_one_queue() {
        let cache = r#"{"secret_env":"S"}"#;
        let lazy = r#"{"credentials":[{"header":"authorization","scheme":"Bearer","kind":"jwt"}]}"#;
        assert!(
            ObserverConfig::from_json(format!(r#"{{"post_cache":{cache}}}"#).as_bytes()).is_ok()
        );
        assert!(ObserverConfig::from_json(format!(r#"{{"lazy_auth":{lazy}}}"#).as_bytes()).is_ok());
        assert!(error("{}").contains("lazy_auth: the observer needs at least one of"));
        let other_queue = r#"{"secret_env":"S","observer":{"queue":"other"}}"#;
        assert!(
            error(&format!(
                r#"{{"lazy_auth":{lazy},"post_cache":{other_queue}}}"#
            ))
            .contains("post_cache.observer: must name the same"),
        );
        assert!(
            error(r#"{"post_cache":{"secret_env":"S","max_entries":0}}"#)
                .contains("post_cache.max_entries")
        );
        assert!(error(r#"{"lazy_auth":{"credentials":[]}}"#).contains("lazy_auth.credentials"));
        assert!(ObserverConfig::from_json(br#"{"metering":{}}"#).is_ok());
        assert!(
            error(&format!(
                r#"{{"lazy_auth":{lazy},"metering":{{"observer":{{"vm_id":"elsewhere"}}}}}}"#
            ))
            .starts_with(
                "metering.observer: must name the same vm_id, queue and mode as lazy_auth.observer"
            ),
        );
        assert!(
            error(r#"{"metering":{"sink":{"cluster":"c","path":"/","backoff_ms":0}}}"#)
                .starts_with("metering.sink.backoff_ms:")
        );
        let both = ObserverConfig::from_json(
            format!(r#"{{"lazy_auth":{lazy},"post_cache":{cache}}}"#).as_bytes(),
        );
        assert_eq!(
            both.map(|c| c.link().queue).ok().as_deref(),
            Some("zerolayer.jobs")
        );
    }

    use zerolayer_core::event::{CacheWrite, VerifyJob, VerifyOutcome};
    use zerolayer_core::metering::UsageRecord;
    use zerolayer_host::FakeHost;

    /// An observer for `json`, named `observer`.
    fn observer(host: &mut FakeHost, json: &str) -> Observer {
        let config = ObserverConfig::from_json(json.as_bytes()).unwrap();
        Observer::configure(host, &config, "observer").unwrap()
    }

    /// A metering observer with a usage sink in `mode`.
    fn metering(host: &mut FakeHost, mode: &str) -> Observer {
        let json = format!(
            r#"{{"metering":{{"observer":{{"mode":"{mode}"}},"sink":{{"cluster":"usage","path":"/"}}}}}}"#
        );
        observer(host, &json)
    }

    fn usage() -> Job {
        Job::Usage(UsageRecord {
            at_ms: 0,
            request_id: "r".into(),
            tenant: "acme".into(),
            model: "m".into(),
            input_tokens: 1,
            output_tokens: 1,
            cache_read_tokens: 0,
            cache_creation_tokens: 0,
            usage_missing: false,
            status: 200,
            latency_ms: 1,
            streamed: false,
            rate_bp: 10_000,
            in_sample: true,
            credential: None,
        })
    }

    fn counter(host: &mut FakeHost, observer: &Observer, name: &str) -> i64 {
        observer.flush_counters(host);
        host.metric(name).unwrap()
    }

    fn backlog(host: &FakeHost, key: &str) -> u64 {
        zerolayer_core::queue::decode_backlog(host.shared_value(key))
    }

    const TICK_QUEUE: &str = "zerolayer.jobs.observer";

    #[test]
    fn unreadable_jobs_are_counted_and_skipped() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "singleton");
        let queue = observer.queue();
        for item in [&b""[..], b"\x09not a job", b"\x01\xff\xff\xff"] {
            host.enqueue(queue, item).unwrap();
        }
        host.enqueue(queue, &usage().encode()).unwrap();
        observer.drain(&mut host);
        let unreadable = counter(
            &mut host,
            &observer,
            "zerolayer_observer_jobs_kind=unreadable",
        );
        assert_eq!(unreadable, 3);
        assert_eq!(
            counter(&mut host, &observer, "zerolayer_observer_jobs_kind=usage"),
            1
        );
    }

    #[test]
    fn in_tick_mode_the_backlog_is_reset_to_zero_when_the_queue_empties() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "tick");
        let key = zerolayer_core::queue::backlog_key(TICK_QUEUE);
        // Producers counted more than they enqueued (one died in between).
        host.shared_put(&key, &zerolayer_core::queue::encode_backlog(10_000));
        host.enqueue(observer.queue(), &usage().encode()).unwrap();
        observer.drain(&mut host);
        assert_eq!(host.shared_value(&key), Some(&[0u8; 8][..]));
    }

    #[test]
    fn in_tick_mode_a_drain_cut_short_by_its_budget_takes_off_what_it_drained() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "tick");
        let key = zerolayer_core::queue::backlog_key(TICK_QUEUE);
        let job = usage().encode();
        let size = zerolayer_core::queue::queued_size(job.len());
        for _ in 0..=DRAIN_BUDGET {
            host.enqueue(observer.queue(), &job).unwrap();
        }
        let counted = size * (DRAIN_BUDGET as u64 + 1) + 7;
        host.shared_put(&key, &zerolayer_core::queue::encode_backlog(counted));
        observer.drain(&mut host);
        assert_eq!(
            host.queued(TICK_QUEUE).len(),
            1,
            "one job past the budget waits"
        );
        assert_eq!(backlog(&host, &key), size + 7);
        observer.drain(&mut host);
        assert_eq!(backlog(&host, &key), 0);
    }

    #[test]
    fn in_singleton_mode_no_backlog_is_kept() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "singleton");
        host.enqueue(observer.queue(), &usage().encode()).unwrap();
        observer.drain(&mut host);
        assert!(host.shared.keys().all(|k| !k.starts_with("zl:queue:")));
    }

    #[test]
    fn jobs_for_a_worker_that_is_not_configured_are_dropped_and_counted() {
        let mut host = FakeHost::default();
        // Metering without a sink: no auth worker, audit sink, fleet or usage sink.
        let mut observer = observer(&mut host, r#"{"metering":{}}"#);
        let audit = AuditRecord {
            at_ms: 0,
            hash_prefix: String::new(),
            tenant: None,
            verified: false,
            decision: "deny".into(),
            reason: "missing".into(),
            latency_us: 0,
            request_id: "a".into(),
        };
        let jobs = [
            Job::Verify(VerifyJob {
                hash: [0; 32],
                kind: zerolayer_core::auth::credential::CredentialKind::Jwt,
                credential: b"t".to_vec(),
                tenant_hint: None,
                enqueued_at_ms: 0,
            }),
            Job::Audit(audit.clone()),
            Job::AuditBatch(vec![audit.clone(), audit]),
            Job::CacheWrite(CacheWrite {
                digest: [0; 32],
                ttl_secs: 1,
                entry: vec![],
            }),
            Job::Usage(match usage() {
                Job::Usage(record) => record,
                _ => unreachable!(),
            }),
            Job::Outcome(VerifyOutcome {
                tenant: "acme".into(),
                failed: true,
                at: 0,
            }),
        ];
        for job in &jobs {
            host.enqueue(observer.queue(), &job.encode()).unwrap();
        }
        observer.drain(&mut host);
        assert!(host.dispatched.is_empty());
        for (name, n) in [
            ("zerolayer_auth_verifications_dropped", 1),
            ("zerolayer_audit_records_outcome=dropped", 3),
            ("zerolayer_cache_fleet_writes_outcome=dropped", 1),
            ("zerolayer_metering_records_outcome=dropped", 1),
        ] {
            assert_eq!(counter(&mut host, &observer, name), n, "{name}");
        }
        assert!(host.queued("zerolayer.jobs").is_empty());
    }

    #[test]
    fn each_wake_up_records_how_many_jobs_it_drained() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "singleton");
        for _ in 0..3 {
            host.enqueue(observer.queue(), &usage().encode()).unwrap();
        }
        observer.drain(&mut host);
        observer.drain(&mut host);
        let depth = host
            .metrics
            .iter()
            .find(|m| m.name == "zerolayer_observer_queue_depth")
            .unwrap();
        assert_eq!(depth.samples, [3], "an empty wake-up records nothing");
    }

    #[test]
    fn an_answer_to_a_token_that_is_not_ours_is_left_alone() {
        let mut host = FakeHost::default();
        let mut observer = metering(&mut host, "singleton");
        assert!(!observer.on_http_call_response(&mut host, 42, 0));
    }
}
