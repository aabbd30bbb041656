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
//! Every Wasm worker is one lease holder (its root's table), and so is the
//! native module's process: there every worker's root shares one table
//! ([`Leases`], [`QuotaRoot::sharing`]) that a root on a thread of the
//! module's own syncs ([`QuotaRoot::syncing`]). `store.expected_gateways`
//! counts holders: gateways × workers (Wasm), gateways (native).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod metrics;
mod stream;

use std::cell::Cell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use zerolayer_core::quota::config::QuotaConfig;
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

/// Store calls in flight at most, per lease table (a sync emits at most
/// `zerolayer_core::quota::gateway::MAX_CALLS_PER_SYNC`): past it a call
/// is asked again at the next sync.
pub const MAX_IN_FLIGHT: usize = 1024;

/// One lease holder's table and the store calls in flight for it, as the
/// roots that spend and sync it share it: a Wasm root's own, or (natively)
/// the process's, shared by every worker's root and the root that syncs it
/// on a thread of the module's own.
///
/// Both locks are held only for the table's own work (a reservation, a
/// settlement, a sync's plan, an answer: no I/O, no host call), so a
/// worker waits at most for one such step of another thread.
pub struct Leases {
    /// The table and its policies.
    quota: Mutex<GatewayQuota>,
    /// The store calls in flight (from the syncing root or a waiting
    /// stream): a root does not send one again while its answer is awaited.
    in_flight: Mutex<HashSet<CallTarget>>,
}

impl Leases {
    /// The lease table `configuration` (the stage's section) describes, for
    /// roots to share ([`QuotaRoot::sharing`], [`QuotaRoot::syncing`]);
    /// `None` refuses it, after one log line naming the field.
    pub fn configure(host: &mut impl Host, configuration: &[u8]) -> Option<Arc<Leases>> {
        let config = load(configuration)?;
        Leases::of(&config, host)
    }

    fn of(config: &QuotaConfig, host: &mut impl Host) -> Option<Arc<Leases>> {
        let (instance, seed) = (random_u64(host), random_u64(host));
        match GatewayQuota::new(config, instance, seed) {
            Ok(quota) => Some(Arc::new(Leases {
                quota: Mutex::new(quota),
                in_flight: Mutex::new(HashSet::new()),
            })),
            Err(err) => {
                log::error!("quota: invalid configuration: {err}");
                None
            }
        }
    }

    /// The table. A panic while another holder held it (caught by the
    /// host) leaves it as that step left it: still a valid table.
    pub fn quota(&self) -> MutexGuard<'_, GatewayQuota> {
        self.quota.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn in_flight(&self) -> MutexGuard<'_, HashSet<CallTarget>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The stage's configuration, checked; `None` after one log line naming
/// the field.
fn load(configuration: &[u8]) -> Option<QuotaConfig> {
    zerolayer_host::load_config("quota", configuration, QuotaConfig::from_json)
}

/// What every request of this plugin shares.
pub(crate) struct Plan {
    pub config: QuotaConfig,
    /// The lease table (this root's own, or the process's natively).
    pub leases: Arc<Leases>,
    /// Whether a policy's scope names the credential (hashed per request
    /// only then) or the route.
    pub needs_credential: bool,
    pub needs_route: bool,
    /// The last host time a stream saw, for a stream dropped without its
    /// log callback (its reservation is then settled as unknown).
    pub last_ms: Cell<u64>,
    /// How long a request whose lease is empty waits for its grant, at most.
    pub grant_wait: Duration,
    /// Whether an enforcing policy counts tokens (a body that cannot be
    /// bounded is then refused).
    pub bounds_input: bool,
}

/// The stage's root. By default it holds its own lease table and syncs it
/// on its tick (each Wasm VM); natively, every worker's root shares the
/// process's ([`QuotaRoot::sharing`]) and one root on a thread of the
/// module's own syncs it ([`QuotaRoot::syncing`]).
pub struct QuotaRoot {
    plan: Option<Rc<Plan>>,
    metrics: Option<Metrics>,
    /// The root's store calls in flight, by token.
    calls: StreamMap<StoreCall>,
    /// The table to use instead of making one.
    given: Option<Arc<Leases>>,
    /// Whether this root syncs the table on its tick and exports its counts.
    syncs: bool,
}

impl Default for QuotaRoot {
    fn default() -> QuotaRoot {
        QuotaRoot {
            plan: None,
            metrics: None,
            calls: StreamMap::default(),
            given: None,
            syncs: true,
        }
    }
}

impl Plan {
    /// The lease table.
    pub(crate) fn quota(&self) -> MutexGuard<'_, GatewayQuota> {
        self.leases.quota()
    }

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
        {
            let mut quota = self.quota();
            if again {
                quota.sync_waiting(now, &mut due);
            } else {
                quota.sync(now, &mut due);
            }
        }
        // Claimed before they are sent and the locks released meanwhile:
        // another holder of the table (natively, a worker or the syncing
        // thread) neither sends them again nor waits for the host.
        let mut to_send = Vec::with_capacity(due.len());
        let mut unsent = Vec::new();
        {
            let mut in_flight = self.leases.in_flight();
            for call in due {
                if !again && in_flight.contains(&call.target) {
                    continue;
                }
                if in_flight.len() >= MAX_IN_FLIGHT {
                    // Asked again at the next sync (the lease still waits for it).
                    unsent.push(call);
                    continue;
                }
                in_flight.insert(call.target);
                to_send.push(call);
            }
        }
        if !unsent.is_empty() {
            let mut quota = self.quota();
            for call in &unsent {
                quota.on_webdis_response(call, None, b"", now);
            }
        }
        let store = &self.config.store.endpoint;
        for call in to_send {
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
                Ok(token) => sent.push((token, call)),
                Err(status) => {
                    log::warn!(
                        "quota: cannot call the store's cluster {} ({status:?})",
                        store.cluster
                    );
                    self.answered(&call, None, b"", now);
                }
            }
        }
    }

    /// The store's answer to `call` (`status` `None`: none came).
    pub(crate) fn answered(&self, call: &StoreCall, status: Option<u16>, body: &[u8], now: u64) {
        self.leases.in_flight().remove(&call.target);
        self.quota().on_webdis_response(call, status, body, now);
    }

    /// `call` went with the stream that sent it (the host cancels a
    /// stream's callouts with it): asked again, not counted as a failure.
    pub(crate) fn withdrawn(&self, call: &StoreCall) {
        self.leases.in_flight().remove(&call.target);
        self.quota().withdrawn(&call.target);
    }
}

impl QuotaRoot {
    /// A root spending `leases`, a table other roots share, that another
    /// root syncs: it has no tick, sends no store call and exports no
    /// counts (it defines the metrics, as every root does: natively Envoy
    /// takes definitions only while it loads the configuration). Its
    /// requests still wait for their own grant, through their own callouts.
    /// `leases` must be of the same configuration as the root's.
    pub fn sharing(leases: Arc<Leases>) -> QuotaRoot {
        QuotaRoot {
            given: Some(leases),
            syncs: false,
            ..QuotaRoot::default()
        }
    }

    /// A root syncing `leases`, a table other roots share, on its tick (and
    /// exporting its counts), as a root syncs its own.
    pub fn syncing(leases: Arc<Leases>) -> QuotaRoot {
        QuotaRoot {
            given: Some(leases),
            ..QuotaRoot::default()
        }
    }

    /// The lease table, for tests and the fused chain's own reports.
    pub fn quota(&self) -> Option<MutexGuard<'_, GatewayQuota>> {
        self.plan.as_ref().map(|p| p.quota())
    }

    /// The table this root spends (once configured), to share.
    pub fn leases(&self) -> Option<Arc<Leases>> {
        self.plan.as_ref().map(|p| p.leases.clone())
    }

    /// The store calls this root sent whose answers it awaits.
    pub fn calls_in_flight(&self) -> usize {
        self.calls.len()
    }

    /// Sends the store calls due now (a root that syncs).
    fn sync(&mut self, host: &mut impl Host) {
        let Some(plan) = self.plan.clone().filter(|_| self.syncs) else {
            return;
        };
        // Requests admitted before verification whose verdict had not
        // come by their response's end: read again (the root that syncs a
        // shared table reads the process's verdicts too).
        let now = host.now_ms();
        let mut quota = plan.quota();
        let expired = if quota.late().is_empty() {
            0
        } else {
            quota.settle_late(now, |key| host.shared_get(key).0)
        };
        drop(quota);
        if expired > 0 {
            // One line a sync at most, however many.
            log::warn!(
                "quota: {expired} lazily admitted request(s) not charged to their tenant: \
                 their credential's verdict did not come within {} ms (lazy-auth's verifier \
                 down? in separate Envoy filters quota must share lazy-auth's vm_id); handed \
                 to the store for `host-sim quota-reconcile`",
                zerolayer_core::quota::late::LATE_HORIZON_MS
            );
        }
        let timeout = Duration::from_millis(u64::from(plan.config.store.endpoint.timeout_ms));
        let mut sent = Vec::new();
        plan.send_due(host, timeout, false, &mut sent);
        self.calls.extend(sent);
    }
}

impl<H: Hosts> RootStage<H> for QuotaRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
        let Some(config) = load(configuration) else {
            return false;
        };
        let leases = match &self.given {
            Some(leases) => leases.clone(),
            None => match Leases::of(&config, host) {
                Some(leases) => leases,
                None => return false,
            },
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
        if self.syncs
            && let Err(status) = host.set_tick_period(period)
        {
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
        let bounds_input = leases.quota().bounds_input();
        if config.unverified.is_none() && bounds_input {
            // Not an error: a chain without lazy admission has no such
            // requests. With it, each fresh credential's first request
            // would pass uncounted, whatever its tenant has left.
            log::warn!(
                "quota: no `unverified` budget: requests lazy-auth admits before verifying \
                 their credential hold no reservation and are not counted"
            );
        }
        self.metrics = Some(Metrics::define(host, leases.quota().policies()));
        self.plan = Some(Rc::new(Plan {
            bounds_input,
            leases,
            needs_credential,
            needs_route,
            last_ms: Cell::new(host.now_ms()),
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
        // Only the root that syncs a shared table exports its counts (each
        // sharer would add them again).
        if !self.syncs {
            return;
        }
        if let (Some(plan), Some(metrics)) = (&self.plan, &mut self.metrics) {
            metrics.export(host, &plan.quota());
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
        if let Some(plan) = self.plan.as_ref().filter(|_| self.syncs) {
            // What idle leases hold goes back with the next sync (if the
            // host still answers); otherwise it expires with the window.
            plan.quota().retire(host.now_ms());
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
