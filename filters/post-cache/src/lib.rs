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

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::cache::key::CacheKey;
use zerolayer_core::config::ObserverMode;
use zerolayer_observer::{Observer, ObserverConfig};
use zerolayer_proxy::ObserverQueue;

use metrics::{Metrics, WaitEnd};
use shelf::{Shelf, serve};
use stream::CacheStream;

/// The module's entry point (`_initialize`): registers the root context.
#[cfg(not(feature = "stage"))]
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(CacheRoot::default()) });
    }}
}

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
    pub fn followers_can_wait(&self) -> bool {
        if zerolayer_proxy::can_resume_from_tick() {
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
    pub key: CacheKey,
    pub max_age: Option<u64>,
    pub deadline_ms: u64,
    /// Shared with the stream; the root tells it how the wait ended. When
    /// only the root holds it, the stream is gone (client left).
    pub outcome: Rc<Cell<Option<WaitEnd>>>,
}

/// The plugin's root context.
#[derive(Default)]
pub struct CacheRoot {
    plan: Option<Rc<Plan>>,
    /// The observer, embedded in tick mode (fleet writes).
    observer: Option<Observer>,
}

impl Context for CacheRoot {
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
            plan.metrics.flush();
        }
        if let Some(observer) = &self.observer {
            observer.flush_counters();
        }
        true
    }
}

impl RootContext for CacheRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = zerolayer_proxy::load_config("post-cache", PostCacheConfig::from_json)
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
        if config.fleet.is_some() && config.observer.mode == ObserverMode::Tick {
            let observer = ObserverConfig::for_post_cache(config.clone());
            match Observer::configure(&observer, "post-cache") {
                Ok(observer) => self.observer = Some(observer),
                Err(err) => {
                    log::error!("post-cache: invalid configuration: observer: {err}");
                    return false;
                }
            }
        }
        let tick = Duration::from_millis(config.stampede.poll_ms.clamp(1, 1000));
        self.plan = Some(Rc::new(Plan {
            shelf: Shelf::new(config.max_entries),
            secret: secret.unwrap_or_default(),
            metrics: Metrics::define(),
            queue: ObserverQueue::new(
                config.observer.clone(),
                self.observer.as_ref().map(Observer::queue),
                "post-cache",
            ),
            waiters: RefCell::new(Vec::new()),
            said_no_waiting: Cell::new(false),
            config,
        }));
        if let Err(status) = zerolayer_proxy::fused::set_tick_period(tick) {
            log::warn!(
                "post-cache: no tick ({status:?}); waiting followers fall back to their lease expiry"
            );
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(plan) = &self.plan else {
            return;
        };
        wake_followers(plan);
        plan.metrics.flush();
        if let Some(observer) = &mut self.observer {
            observer.on_tick();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(CacheStream::new(self.plan.clone(), context_id)))
    }
}

/// Serves followers whose response is now cached; sends upstream those whose
/// lease is gone or whose wait ran out.
fn wake_followers(plan: &Plan) {
    let mut waiters = plan.waiters.borrow_mut();
    if waiters.is_empty() {
        return;
    }
    let now_ms = zerolayer_proxy::now_ms();
    let now = now_ms / 1000;
    waiters.retain(|w| {
        if Rc::strong_count(&w.outcome) == 1 {
            return false;
        }
        let end = if let Some(hit) = plan.shelf.lookup(&w.key, now, w.max_age) {
            if zerolayer_proxy::fused::set_effective_context(w.context_id).is_ok() {
                serve(&hit);
            }
            WaitEnd::Hit
        } else if !plan.shelf.lease_held(&w.key, now_ms) {
            WaitEnd::Upstream
        } else if now_ms >= w.deadline_ms {
            WaitEnd::Timeout
        } else {
            return true;
        };
        if end != WaitEnd::Hit
            && zerolayer_proxy::fused::set_effective_context(w.context_id).is_ok()
        {
            let _ = zerolayer_proxy::fused::resume_request();
        }
        w.outcome.set(Some(end));
        plan.metrics.wait_ended(end);
        false
    });
}
