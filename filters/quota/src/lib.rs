//! zerolayer quota: token, request and spend limits enforced with no
//! network call on the request path. Each root holds a lease table
//! ([`GatewayQuota`]): a request reserves its upper bound from the leases
//! that scope it and is refused with 429 when they cannot cover it; once
//! the response is done its exact usage settles the reservation; the root
//! refills and returns leases through Redis (webdis) on its tick.
//!
//! Lifecycle, top to bottom: configuration → request headers (an LLM call?
//! who is it?) → request body (the bound, the reservation or the 429) →
//! response headers (the rate-limit headers) → response body (usage as it
//! passes) → log (settlement) → tick (store calls, metrics) → answers.
//!
//! Every Wasm worker (and the native module's process) is one lease holder:
//! `store.expected_gateways` counts holders, gateways × workers.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod metrics;
mod stream;

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::quota::config::{QuotaConfig, StreamMode};
use zerolayer_core::quota::{CallTarget, GatewayQuota, StoreCall};
use zerolayer_host::{Host, Hosts, RootStage, StreamMap, StreamStage};

use metrics::Metrics;
use stream::QuotaStream;

/// Largest request body the stage holds (with its headers) to read the
/// bound before anything reaches the backend; a larger one streams through
/// and is reserved at its last chunk, which is not forwarded when refused.
/// Envoy's default buffer limit is 1 MiB.
pub const MAX_HELD_BODY: usize = 1024 * 1024;

/// How long a request whose lease is empty (the first of its scope on this
/// holder, or a burst faster than refills) waits for the grant, at most
/// (less when `store.timeout_ms` is shorter); past it, it is refused with
/// `retry-after`. Only such requests wait: one store round trip.
pub const GRANT_WAIT_MS: u32 = 250;

/// Store calls in flight at most (a sync emits at most
/// `zerolayer_core::quota::gateway::MAX_CALLS_PER_SYNC`).
const MAX_IN_FLIGHT: usize = 1024;

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: QuotaConfig,
    /// The lease table and its policies (one holder: this root).
    pub quota: RefCell<GatewayQuota>,
    /// Whether a policy's scope names the credential (hashed per request
    /// only then) or the route.
    pub needs_credential: bool,
    pub needs_route: bool,
    /// The last host time a stream saw, for a stream dropped without its
    /// log callback (its reservation is then settled as unknown).
    pub last_ms: Cell<u64>,
    /// The store calls in flight (from the root or a waiting stream).
    pub in_flight: RefCell<HashSet<CallTarget>>,
    /// How long a request whose lease is empty waits for its grant, at most.
    pub grant_wait: Duration,
}

/// The stage's root.
#[derive(Default)]
pub struct QuotaRoot {
    plan: Option<Rc<Plan>>,
    metrics: Option<Metrics>,
    /// The root's store calls in flight, by token.
    calls: StreamMap<StoreCall>,
}

impl Plan {
    /// Sends the store calls due now; returns them with their tokens in
    /// `sent`. The root sends each at most once at a time (a call in flight
    /// is not sent again: its answer is awaited); a waiting request
    /// (`again`) sends one in flight again, since only its own calls'
    /// answers reach it (the copy carries the same sequence number: the
    /// store applies it once and answers both alike).
    pub(crate) fn send_due(
        &self,
        host: &mut impl Host,
        timeout: Duration,
        again: bool,
        sent: &mut Vec<(u32, StoreCall)>,
    ) {
        let now = host.now_ms();
        self.last_ms.set(now);
        let mut due = Vec::new();
        let mut quota = self.quota.borrow_mut();
        if again {
            quota.sync_waiting(now, &mut due);
        } else {
            quota.sync(now, &mut due);
        }
        let mut in_flight = self.in_flight.borrow_mut();
        let store = &self.config.store.endpoint;
        for call in due {
            if !again && in_flight.contains(&call.target) {
                continue;
            }
            if in_flight.len() >= MAX_IN_FLIGHT {
                // Asked again at the next sync (the lease still waits for it).
                quota.on_webdis_response(&call, None, b"", now);
                continue;
            }
            // `GET <path>/<command>`: the command in the request line, no
            // body. ngx_wasm_module writes a call's head and body with two
            // `send`s, and webdis 0.1.9 now and then never answers a POST
            // whose body comes in a later TCP segment than its head (in
            // ngx_wasm_module most calls timed out); webdis reads a GET's
            // path exactly as a POST's body (the scripts' `EVAL` and
            // `SCRIPT LOAD` make paths of about 3 KB, which it takes).
            let path = webdis_path(&store.path, &call.command.webdis_body());
            let headers = [
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", store.authority()),
            ];
            match host.dispatch(&store.cluster, &headers, None, timeout) {
                Ok(token) => {
                    in_flight.insert(call.target);
                    sent.push((token, call));
                }
                Err(status) => {
                    log::warn!(
                        "quota: cannot call the store's cluster {} ({status:?})",
                        store.cluster
                    );
                    quota.on_webdis_response(&call, None, b"", now);
                }
            }
        }
    }

    /// The store's answer to `call` (`status` `None`: none came).
    pub(crate) fn answered(&self, call: &StoreCall, status: Option<u16>, body: &[u8], now: u64) {
        self.in_flight.borrow_mut().remove(&call.target);
        self.quota
            .borrow_mut()
            .on_webdis_response(call, status, body, now);
    }
}

impl QuotaRoot {
    /// The lease table, for tests and the fused chain's own reports.
    pub fn quota(&self) -> Option<std::cell::Ref<'_, GatewayQuota>> {
        self.plan.as_ref().map(|p| p.quota.borrow())
    }

    /// Sends the store calls due now.
    fn sync(&mut self, host: &mut impl Host) {
        let Some(plan) = self.plan.clone() else {
            return;
        };
        let timeout = Duration::from_millis(u64::from(plan.config.store.endpoint.timeout_ms));
        let mut sent = Vec::new();
        plan.send_due(host, timeout, false, &mut sent);
        self.calls.extend(sent);
    }
}

impl<H: Hosts> RootStage<H> for QuotaRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
        let Some(config) =
            zerolayer_host::load_config("quota", configuration, QuotaConfig::from_json)
        else {
            return false;
        };
        if let Some(i) = config
            .policies
            .iter()
            .position(|p| p.stream.unwrap_or(config.defaults.stream) == StreamMode::Hard)
        {
            // The cut itself is not built yet: refusing beats a limit that
            // silently behaves as `soft`.
            log::error!(
                "quota: invalid configuration: policies[{i}].stream: \"hard\" is not supported by this version (use \"soft\")"
            );
            return false;
        }
        let (instance, seed) = (random_u64(host), random_u64(host));
        let quota = match GatewayQuota::new(&config, instance, seed) {
            Ok(quota) => quota,
            Err(err) => {
                log::error!("quota: invalid configuration: {err}");
                return false;
            }
        };
        use zerolayer_core::quota::config::ScopeField;
        let names = |field: &ScopeField| {
            config
                .policies
                .iter()
                .any(|p| p.scope.iter().any(|s| s == field))
        };
        let (needs_credential, needs_route) =
            (names(&ScopeField::Credential), names(&ScopeField::Route));
        let period = Duration::from_millis(u64::from(config.store.sync_interval_ms));
        if let Err(status) = host.set_tick_period(period) {
            log::error!("quota: no tick ({status:?}): leases could never be filled");
            return false;
        }
        log::info!(
            "quota: configured ({} policies{}, store cluster {}, sync every {} ms, {} leases at most)",
            config.policies.len(),
            if config.unverified.is_some() {
                " and the unverified budget"
            } else {
                ""
            },
            config.store.endpoint.cluster,
            config.store.sync_interval_ms,
            config.store.max_leases,
        );
        self.metrics = Some(Metrics::define(host, quota.policies()));
        self.plan = Some(Rc::new(Plan {
            quota: RefCell::new(quota),
            needs_credential,
            needs_route,
            last_ms: Cell::new(host.now_ms()),
            in_flight: RefCell::new(HashSet::new()),
            grant_wait: Duration::from_millis(u64::from(
                config.store.endpoint.timeout_ms.min(GRANT_WAIT_MS),
            )),
            config,
        }));
        // No store call from here: ngx_wasm_module traps a callout from
        // `on_configure` (the worker exits and is not respawned). The
        // scripts are loaded from the first tick; a request before it waits
        // for its grant, sent as `EVAL`, as any first request does.
        true
    }

    fn tick(&mut self, host: &mut H::Root) {
        self.sync(host);
        RootStage::<H>::flush(self, host);
    }

    fn flush(&mut self, host: &mut H::Root) {
        if let (Some(plan), Some(metrics)) = (&self.plan, &mut self.metrics) {
            metrics.export(host, &plan.quota.borrow());
        }
    }

    fn call_answered(&mut self, host: &mut H::Root, token: u32, body_size: usize) {
        let (Some(plan), Some(call)) = (&self.plan, self.calls.remove(&token)) else {
            return;
        };
        let status = host.callout_status();
        let body = host.callout_body(body_size);
        let now = host.now_ms();
        plan.answered(&call, status, &body, now);
    }

    fn done(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            // What idle leases hold goes back with the next sync (if the
            // host still answers); otherwise it expires with the window.
            plan.quota.borrow_mut().retire(host.now_ms());
        }
        self.sync(host);
        RootStage::<H>::flush(self, host);
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H::Stream>> {
        Box::new(QuotaStream::new(self.plan.clone()))
    }
}

/// The path of a webdis `GET` running `command` (its webdis encoding:
/// percent-encoded arguments joined by `/`) under the store's `base` path.
pub(crate) fn webdis_path(base: &str, command: &[u8]) -> String {
    let mut path = String::with_capacity(base.len() + 1 + command.len());
    path.push_str(base);
    if !path.ends_with('/') {
        path.push('/');
    }
    // Percent-encoded: ASCII only.
    path.push_str(&String::from_utf8_lossy(command));
    path
}

/// A random u64 from the host's WASI `random_get` (or the OS natively);
/// without one, the clock's microseconds (never a constant two holders
/// would share).
fn random_u64(host: &mut impl Host) -> u64 {
    let mut bytes = [0u8; 8];
    if getrandom::getrandom(&mut bytes).is_err() {
        return host.now_us() ^ 0x9e37_79b9_7f4a_7c15;
    }
    u64::from_le_bytes(bytes)
}

#[cfg(test)]
mod tests;
