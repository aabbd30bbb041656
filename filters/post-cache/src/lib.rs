//! zerolayer post-cache: LLM responses served from shared data on a hit,
//! written only after they complete (status 200, streams that reached their
//! terminal event), keyed by a keyed digest of the canonical request, with a
//! lease so identical concurrent misses reach the GPU once.
//!
//! With a fleet tier, a local miss asks Redis (through webdis) before going
//! upstream, and stored entries are handed to the observer, which writes
//! them to Redis off the request path.
//!
//! Lifecycle, top to bottom: configuration → request headers (is this a
//! cacheable request?) → request body (key, lookup, lease) → fleet answer
//! → response headers (`x-cache`, status) → response body (capture, stream
//! completion) → log (store, release, fleet write) → tick (waiting
//! followers, counters, the embedded observer in tick mode).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod metrics;
mod shelf;
mod stream;
#[cfg(test)]
mod testing;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::cache::key::{CacheKey, Provider};
use zerolayer_host::{Host, Hosts, ObserverQueue, RootHost, RootStage, StreamStage};
use zerolayer_observer::{EmbeddedObserver, ObserverConfig};

use metrics::{Metrics, WaitEnd};
use shelf::{Shelf, serve};
use stream::CacheStream;

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: PostCacheConfig,
    /// The per-deployment secret keying the digest (from `secret_env`).
    pub secret: Vec<u8>,
    pub shelf: Shelf,
    pub metrics: Metrics,
    /// The observer's job queue (fleet writes).
    pub queue: ObserverQueue,
    /// Followers waiting for a lease holder's response.
    pub waiters: RefCell<Vec<Waiter>>,
    /// Whether the host's inability to wake followers was logged (once).
    pub said_no_waiting: Cell<bool>,
}

impl Plan {
    /// Whether a follower may wait for the lease holder here: only where a
    /// root context can answer or resume it on tick. Elsewhere (ngx_wasm_module)
    /// followers go to the backend, as in `pass_through` mode, said once.
    pub fn followers_can_wait(&self, host: &mut impl Host) -> bool {
        if host.can_resume_from_tick() {
            return true;
        }
        if !self.said_no_waiting.replace(true) {
            log::warn!(
                "post-cache: stampede.mode wait needs a host that can resume a request from a \
                 timer; ngx_wasm_module cannot (its proxy_set_effective_context does nothing), \
                 so identical concurrent misses go to the backend (as pass_through)"
            );
        }
        false
    }
}

/// A paused request waiting for another request's response.
pub(crate) struct Waiter {
    pub context_id: u32,
    /// The API it called (its hit answers with that API's request-id header).
    pub provider: Provider,
    /// Its request id, for the hit's answer.
    pub request_id: Option<Vec<u8>>,
    pub key: CacheKey,
    pub max_age: Option<u64>,
    pub deadline_ms: u64,
    /// Shared with the stream; the root tells it how the wait ended. When
    /// only the root holds it, the stream is gone (client left).
    pub outcome: Rc<Cell<Option<WaitEnd>>>,
}

/// The stage's root.
#[derive(Default)]
pub struct CacheRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode (fleet writes).
    observer: EmbeddedObserver,
}

impl<H: Hosts> RootStage<H> for CacheRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
        let Some(config) =
            zerolayer_host::load_config("post-cache", configuration, PostCacheConfig::from_json)
        else {
            return false;
        };
        // The secret comes from the environment the host gives the VM: it is
        // neither in the configuration nor in config dumps.
        let secret = std::env::var(&config.secret_env)
            .ok()
            .map(String::into_bytes);
        if let Err(err) = config.check_secret(secret.as_deref()) {
            log::error!("post-cache: invalid configuration: {err}");
            return false;
        }
        log::info!(
            "post-cache: configured (namespace {:?}, {} entries of at most {} bytes: {} MiB bound, stampede {:?})",
            config.namespace,
            config.max_entries,
            config.max_entry_bytes,
            config.memory_bound() / (1024 * 1024),
            config.stampede.mode,
        );
        log::info!(
            "post-cache: {}",
            zerolayer_core::footprint::describe(&config.key_spaces())
        );
        let Some(observer) = EmbeddedObserver::configure(
            host,
            &config.observer,
            config.fleet.is_some(),
            || ObserverConfig::for_post_cache(config.clone()),
            "post-cache",
        ) else {
            return false;
        };
        self.observer = observer;
        let tick = Duration::from_millis(config.stampede.poll_ms.clamp(1, 1000));
        self.plan = Some(Rc::new(Plan {
            shelf: Shelf::new(config.max_entries, config.max_entry_bytes),
            secret: secret.unwrap_or_default(),
            metrics: Metrics::define(host),
            queue: self.observer.queue(&config.observer, "post-cache"),
            waiters: RefCell::new(Vec::new()),
            said_no_waiting: Cell::new(false),
            config,
        }));
        if let Err(status) = host.set_tick_period(tick) {
            log::warn!(
                "post-cache: no tick ({status:?}); waiting followers fall back to their lease expiry"
            );
        }
        true
    }

    fn tick(&mut self, host: &mut H::Root) {
        let Some(plan) = &self.plan else {
            return;
        };
        wake_followers(host, plan);
        RootStage::<H>::flush(self, host);
        self.observer.tick(host);
    }

    fn flush(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.metrics.flush(host);
        }
    }

    fn call_answered(&mut self, host: &mut H::Root, token: u32, body_size: usize) {
        self.observer.call_answered(host, token, body_size);
    }

    fn done(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.metrics.flush(host);
        }
        self.observer.done(host);
    }

    fn stream(&self, context_id: u32) -> Box<dyn StreamStage<H::Stream>> {
        Box::new(CacheStream::new(self.plan.clone(), context_id))
    }
}

/// Serves followers whose response is now cached; sends upstream those whose
/// lease is gone or whose wait ran out.
fn wake_followers(host: &mut impl RootHost, plan: &Plan) {
    let mut waiters = plan.waiters.borrow_mut();
    if waiters.is_empty() {
        return;
    }
    let now_ms = host.now_ms();
    let now = now_ms / 1000;
    waiters.retain(|w| {
        if Rc::strong_count(&w.outcome) == 1 {
            return false;
        }
        let end = if let Some(hit) = plan.shelf.lookup(host, &w.key, now, w.max_age) {
            if host.set_effective_context(w.context_id).is_ok() {
                serve(host, &hit, w.provider, w.request_id.as_deref());
            }
            WaitEnd::Hit
        } else if !plan.shelf.lease_held(host, &w.key, now_ms) {
            WaitEnd::Upstream
        } else if now_ms >= w.deadline_ms {
            WaitEnd::Timeout
        } else {
            return true;
        };
        if end != WaitEnd::Hit && host.set_effective_context(w.context_id).is_ok() {
            host.resume();
        }
        w.outcome.set(Some(end));
        plan.metrics.wait_ended(end);
        false
    });
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerolayer_host::{Action, FakeHost, RootStage, StreamStage};

    use super::CacheRoot;
    use crate::testing::{
        ANSWER, BODY, JSON_200, SECRET_ENV, complete, configured, counted, post, shared_cache,
        stored_bodies,
    };

    /// A lease holder (stream 1) and an identical request waiting behind it
    /// (stream 2).
    fn holder_and_follower(
        root: &CacheRoot,
        host: &mut FakeHost,
    ) -> (
        Box<dyn StreamStage<FakeHost>>,
        Box<dyn StreamStage<FakeHost>>,
    ) {
        let holder = post(root, host, 1, BODY);
        assert_eq!(holder.body, Action::Continue);
        let follower = post(root, host, 2, BODY);
        assert_eq!(follower.body, Action::Pause);
        (holder.stream, follower.stream)
    }

    fn waiting(root: &CacheRoot) -> usize {
        root.plan
            .as_ref()
            .expect("configured")
            .waiters
            .borrow()
            .len()
    }

    #[test]
    fn a_follower_is_served_on_tick_once_the_holder_stored_its_response() {
        let (mut host, mut root) = shared_cache();
        let (mut holder, mut follower) = holder_and_follower(&root, &mut host);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(host.sent.is_empty(), "nothing to serve yet");
        assert_eq!(waiting(&root), 1);

        complete(&mut holder, &mut host, JSON_200, &ANSWER);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert_eq!(host.sent.len(), 1);
        let served = &host.sent[0];
        assert_eq!(served.effective, Some(2));
        assert_eq!(served.header("x-cache"), Some("HIT"));
        assert_eq!(served.body, ANSWER.concat());
        assert!(host.resumes.is_empty());
        assert_eq!(waiting(&root), 0);
        let outcome = "zerolayer_cache_lease_waits_outcome=hit";
        assert_eq!(counted(&mut root, &mut host, outcome), 1);

        // The follower's own response is the gateway's: its x-cache stays.
        host.respond_with(&[(":status", "200"), ("x-cache", "HIT")]);
        let _ = follower.response_headers(&mut host, true);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("HIT")
        );
    }

    #[test]
    fn a_follower_goes_upstream_when_the_lease_ends_without_an_entry() {
        let (mut host, mut root) = shared_cache();
        let (mut holder, mut follower) = holder_and_follower(&root, &mut host);
        complete(
            &mut holder,
            &mut host,
            &[(":status", "502")],
            &[b"bad gateway"],
        );
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(host.sent.is_empty());
        assert_eq!(host.resumes, [Some(2)]);
        let outcome = "zerolayer_cache_lease_waits_outcome=upstream";
        assert_eq!(counted(&mut root, &mut host, outcome), 1);
        // Upstream now: a miss whose response is stored.
        complete(&mut follower, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("MISS")
        );
        assert_eq!(stored_bodies(&host), 1);
    }

    #[test]
    fn a_follower_goes_upstream_after_max_wait() {
        let (mut host, mut root) = configured(&format!(
            r#"{{"secret_env":"{SECRET_ENV}","namespace":"shared","stampede":{{"max_wait_ms":1000}}}}"#
        ));
        let (_holder, _follower) = holder_and_follower(&root, &mut host);
        host.advance(Duration::from_millis(999));
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(host.resumes.is_empty());
        host.advance(Duration::from_millis(1));
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert_eq!(host.resumes, [Some(2)]);
        assert_eq!(waiting(&root), 0);
        let outcome = "zerolayer_cache_lease_waits_outcome=timeout";
        assert_eq!(counted(&mut root, &mut host, outcome), 1);
    }

    #[test]
    fn a_follower_whose_client_left_is_forgotten() {
        let (mut host, mut root) = shared_cache();
        let (mut holder, follower) = holder_and_follower(&root, &mut host);
        drop(follower);
        complete(&mut holder, &mut host, JSON_200, &ANSWER);
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert!(host.sent.is_empty());
        assert!(host.resumes.is_empty());
        assert_eq!(waiting(&root), 0);
    }

    #[test]
    fn counters_reach_the_host_on_tick() {
        let (mut host, mut root) = shared_cache();
        let _ = post(&root, &mut host, 1, BODY);
        let miss = "zerolayer_cache_lookups_result=miss";
        assert_eq!(host.metric(miss), Some(0), "defined, not yet flushed");
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        assert_eq!(host.metric(miss), Some(1));
    }

    #[test]
    fn a_secret_that_is_not_set_is_refused() {
        let mut host = FakeHost::default();
        let mut root = CacheRoot::default();
        let config = br#"{"secret_env":"ZEROLAYER_TEST_SECRET_THAT_IS_NEVER_SET"}"#;
        assert!(!RootStage::<FakeHost>::configure(
            &mut root, &mut host, config
        ));
        assert!(root.plan.is_none());
        // Requests then pass untouched.
        let asked = post(&root, &mut host, 1, BODY);
        assert_eq!(
            (asked.headers, asked.body),
            (Action::Continue, Action::Continue)
        );
    }
}
