//! One request through the cache: is it cacheable (headers), its key and
//! lookup (body), `x-cache` and what to keep (response), the write (log).

use std::cell::Cell;
use std::rc::Rc;

use std::time::Duration;

use zerolayer_core::cache::config::{Namespace, StampedeMode};
use zerolayer_core::cache::control::{
    Bypass, RequestDirectives, RequestPlan, SAMPLED_OPT_IN_HEADER, SampledPolicy, Sampling, age,
    fresh_enough, opts_in_to_sampled, plan_request, response_ttl,
};
use zerolayer_core::cache::key::{CacheKey, CanonicalRequest, KeyError, Provider};
use zerolayer_core::cache::lease::LeaseOutcome;
use zerolayer_core::cache::store::{FleetEntry, StoredResponse};
use zerolayer_core::cache::stream::{StreamCompletion, is_error_data};
use zerolayer_core::encoding::ContentCoding;
use zerolayer_core::event::{CacheWrite, Job};
use zerolayer_core::internal;
use zerolayer_core::reply;
use zerolayer_core::usage::UsageChunkStripper;
use zerolayer_host::{Action, Body, Callback, Headers, StreamHost, StreamStage};

use crate::metrics::{FleetRead, Lookup, WaitEnd};
use crate::shelf::{Hit, ORIGIN_REQUEST_ID, serve};
use crate::{Plan, Waiter};

/// Where a request stands.
enum Phase {
    /// Not an LLM call the cache knows, or no configuration: untouched.
    Ignored,
    /// Headers held until the body is complete (the key needs it).
    AwaitingBody,
    /// Neither looked up nor stored.
    Bypassed,
    /// Answered by the gateway: a hit, or a 504 for `only-if-cached`.
    Answered,
    /// Paused behind another request's lease.
    Waiting(Rc<Cell<Option<WaitEnd>>>),
    /// Went upstream (a miss, a refresh, or a follower that stopped waiting).
    Upstream,
}

/// The response being kept for the cache.
struct Capture {
    status: u16,
    cache_control: Option<String>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    completion: Option<StreamCompletion>,
    /// Removes the usage chunk metering asked for, where this filter sees
    /// the response before metering does (ngx_wasm_module's chain order),
    /// so the entry holds what the client got.
    usage_hidden: Option<UsageChunkStripper>,
    ended: bool,
}

/// One request's cache state.
pub(crate) struct CacheStream {
    plan: Option<Rc<Plan>>,
    context_id: u32,
    phase: Phase,
    provider: Provider,
    namespace: Option<String>,
    cache_control: Option<String>,
    /// It asked for a stored sample (`zerolayer-cache: sampled`).
    sampled_opt_in: bool,
    key: Option<CacheKey>,
    /// Whether the response is to be stored (a miss or refresh whose plan allows it).
    store: bool,
    holds_lease: bool,
    capture: Option<Capture>,
    /// A fleet-tier read in flight: its callout and the miss it resolves.
    remote: Option<(u32, Miss)>,
}

/// A local miss, waiting to be resolved (fleet tier, lease, upstream).
#[derive(Clone, Copy)]
struct Miss {
    key: CacheKey,
    max_age: Option<u64>,
    store: bool,
    only_if_cached: bool,
}

impl CacheStream {
    pub(crate) fn new(plan: Option<Rc<Plan>>, context_id: u32) -> CacheStream {
        CacheStream {
            plan,
            context_id,
            phase: Phase::Ignored,
            provider: Provider::Anthropic,
            namespace: None,
            cache_control: None,
            sampled_opt_in: false,
            key: None,
            store: false,
            holds_lease: false,
            capture: None,
            remote: None,
        }
    }

    fn bypass(&mut self, reason: Bypass) -> Action {
        if let Some(plan) = &self.plan {
            plan.metrics.lookup(Lookup::Bypass);
            plan.metrics.bypass(reason);
        }
        self.phase = Phase::Bypassed;
        Action::Continue
    }

    /// `only-if-cached` with nothing usable cached: 504, as RFC 9111 asks.
    fn unsatisfiable(&mut self, host: &mut impl StreamHost) -> Action {
        host.send_json_error(
            504,
            "cache_miss",
            "only-if-cached: nothing usable is cached",
        );
        self.phase = Phase::Answered;
        Action::Pause
    }

    /// Header-only checks, so a request the cache will not touch is never
    /// held for its body.
    fn admit(&mut self, host: &mut impl StreamHost, plan: &Plan, end_of_stream: bool) -> Action {
        let Some(provider) = host.provider() else {
            return Action::Continue;
        };
        self.provider = provider;
        if host.request_header(":method").as_deref() != Some(b"POST") {
            return self.bypass(Bypass::NotCacheableMethod);
        }
        self.cache_control = host
            .request_header("cache-control")
            .and_then(|v| String::from_utf8(v).ok());
        if let Some(cc) = &self.cache_control
            && RequestDirectives::parse(cc).no_store
        {
            return self.bypass(Bypass::RequestNoStore);
        }
        if plan.config.ttl.sampled == SampledPolicy::OptIn {
            self.sampled_opt_in =
                opts_in_to_sampled(host.request_header(SAMPLED_OPT_IN_HEADER).as_deref());
        }
        // Without activation in the chain the cache runs for every request;
        // with it, only where a rule turned `cache` on.
        if let Some(list) = host.property(internal::OBSERVERS_PROPERTY)
            && !zerolayer_core::observers::listed(&list, "cache")
        {
            return self.bypass(Bypass::NotActivated);
        }
        if plan.config.namespace == Namespace::Tenant {
            let tenant = host.with_identity(|published| {
                published
                    .identity()
                    .and_then(|id| id.verified_tenant().map(str::to_string))
            });
            match tenant {
                Some(tenant) => self.namespace = Some(tenant),
                None => return self.bypass(Bypass::NoVerifiedTenant),
            }
        }
        if end_of_stream {
            return self.bypass(Bypass::Unkeyable);
        }
        let declared = host
            .request_header("content-length")
            .and_then(|l| std::str::from_utf8(&l).ok()?.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > u64::from(plan.config.max_request_bytes)) {
            // Too large to key: never held, it streams to the backend.
            return self.bypass(Bypass::TooLarge);
        }
        // An entry is the body as the backend sent it: uncompressed, so
        // any client can be served it (a compressed one is not stored).
        host.ask_identity_encoding();
        self.phase = Phase::AwaitingBody;
        // Envoy: hold the headers, so a hit never opens an upstream request.
        // ngx_wasm_module reads the body only after the headers went on (a
        // hold would never end): the body callback decides there, before
        // nginx contacts the upstream.
        if host.can_hold_headers_for_body() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// The whole body is here: key it, look it up, take the lease.
    fn decide(&mut self, host: &mut impl StreamHost, plan: &Plan, body_size: usize) -> Action {
        let keyed = host.with_body(Body::Request, body_size, |body| {
            CanonicalRequest::of(self.provider, body, self.namespace.as_deref(), &plan.secret)
        });
        let request = match keyed {
            Ok(request) => request,
            Err(KeyError::Duplicate(duplicate)) => {
                // Which member the backend reads is not known: refused, as
                // every stage that reads the body refuses it.
                host.send_json_error(400, "invalid_request_error", &duplicate.to_string());
                self.phase = Phase::Answered;
                return Action::Pause;
            }
            Err(err) => {
                log::debug!("post-cache: not keyed: {err}");
                return self.bypass(Bypass::Unkeyable);
            }
        };
        let key = request.key;
        self.key = Some(key);
        let sampling = Sampling {
            provider: self.provider,
            temperature: request.temperature,
            opted_in: self.sampled_opt_in,
        };
        let plan_now = plan_request(
            "POST",
            self.cache_control.as_deref(),
            sampling,
            &plan.config.ttl,
        );
        let (max_age, store, only_if_cached) = match plan_now {
            RequestPlan::Bypass(reason) => return self.bypass(reason),
            RequestPlan::Unsatisfiable => {
                plan.metrics.lookup(Lookup::Miss);
                return self.unsatisfiable(host);
            }
            RequestPlan::Refresh => {
                plan.metrics.lookup(Lookup::Miss);
                self.store = true;
                self.phase = Phase::Upstream;
                return Action::Continue;
            }
            RequestPlan::Lookup {
                max_age,
                store,
                only_if_cached,
            } => (max_age, store, only_if_cached),
        };
        let now_ms = host.now_ms();
        if let Some(hit) = plan.shelf.lookup(host, &key, now_ms / 1000, max_age) {
            plan.metrics.lookup(Lookup::Hit);
            let id = host.request_id();
            serve(host, &hit, self.provider, id.as_deref());
            self.phase = Phase::Answered;
            return Action::Pause;
        }
        let miss = Miss {
            key,
            max_age,
            store,
            only_if_cached,
        };
        if let Some(fleet) = plan.config.fleet.as_ref().filter(|f| f.read_remote) {
            // Ask the fleet tier before the backend; the request waits for
            // the answer (at most the endpoint's timeout).
            let path = fleet.get_path(&key);
            match host.dispatch(
                &fleet.endpoint.cluster,
                &[
                    (":method", "GET"),
                    (":path", &path),
                    (":authority", fleet.endpoint.authority()),
                ],
                None,
                Duration::from_millis(u64::from(fleet.endpoint.timeout_ms)),
            ) {
                Ok(token) => {
                    self.remote = Some((token, miss));
                    return Action::Pause;
                }
                Err(status) => {
                    log::warn!("post-cache: cannot call the fleet tier: {status:?}");
                    plan.metrics.fleet_read(FleetRead::Error);
                }
            }
        }
        self.missed(host, plan, miss, now_ms)
    }

    /// The fleet tier answered a read this request is waiting for.
    fn fleet_answered(
        &mut self,
        host: &mut impl StreamHost,
        plan: &Plan,
        token: u32,
        body_size: usize,
    ) {
        let miss = match self.remote.take() {
            Some((pending, miss)) if pending == token => miss,
            other => {
                self.remote = other;
                return;
            }
        };
        let now_ms = host.now_ms();
        let now = now_ms / 1000;
        let answer = host.callout_answer(body_size);
        let status = answer.status;
        let entry = match status {
            Some(200) => FleetEntry::decode(&answer.body),
            Some(404) => {
                plan.metrics.fleet_read(FleetRead::Miss);
                None
            }
            _ => {
                plan.metrics.fleet_read(FleetRead::Error);
                None
            }
        };
        // The entry must be this request's (full digest, constant time) and
        // fresh enough for it; anything else is a miss.
        let usable = entry.filter(|e| {
            let stored_at = e.response.stored_at_ms / 1000;
            miss.key.matches(&e.response.digest)
                && fresh_enough(stored_at, e.expires_at, now, miss.max_age)
        });
        if let Some(entry) = usable {
            plan.metrics.fleet_read(FleetRead::Hit);
            plan.metrics.lookup(Lookup::Hit);
            let hit = Hit {
                age: age(entry.response.stored_at_ms / 1000, now),
                response: entry.response,
            };
            let id = host.request_id();
            serve(host, &hit, self.provider, id.as_deref());
            self.phase = Phase::Answered;
            // Kept locally too: the next request on this gateway stays local.
            let _ = plan
                .shelf
                .store(host, &miss.key, &hit.response, entry.expires_at, now);
            return;
        }
        if status == Some(200) {
            plan.metrics.fleet_read(FleetRead::Error);
        }
        if self.missed(host, plan, miss, now_ms) == Action::Continue {
            host.resume();
        }
    }

    /// Nothing usable is cached: go upstream, as the lease holder, a
    /// waiting follower, or without a lease.
    fn missed(
        &mut self,
        host: &mut impl StreamHost,
        plan: &Plan,
        miss: Miss,
        now_ms: u64,
    ) -> Action {
        let Miss {
            key,
            max_age,
            store,
            only_if_cached,
        } = miss;
        plan.metrics.lookup(Lookup::Miss);
        if only_if_cached {
            return self.unsatisfiable(host);
        }
        self.store = store;
        self.phase = Phase::Upstream;
        if !store {
            return Action::Continue;
        }
        let stampede = &plan.config.stampede;
        match plan.shelf.take_lease(host, &key, now_ms, stampede.lease_ms) {
            LeaseOutcome::Taken => self.holds_lease = true,
            LeaseOutcome::HeldUntil(_)
                if stampede.mode == StampedeMode::Wait && plan.followers_can_wait(host) =>
            {
                let outcome = Rc::new(Cell::new(None));
                plan.waiters.borrow_mut().push(Waiter {
                    context_id: self.context_id,
                    provider: self.provider,
                    request_id: host.request_id(),
                    key,
                    max_age,
                    deadline_ms: now_ms.saturating_add(stampede.max_wait_ms),
                    outcome: outcome.clone(),
                });
                self.phase = Phase::Waiting(outcome);
                return Action::Pause;
            }
            LeaseOutcome::HeldUntil(_) | LeaseOutcome::Full => {}
        }
        Action::Continue
    }

    /// The response is complete: store it if everything allows.
    fn finish(&mut self, host: &mut impl StreamHost, plan: &Plan) {
        let (Some(key), Some(capture)) = (self.key, self.capture.take()) else {
            return;
        };
        // A stream by its events; a JSON body must not be an error either
        // (some compatible backends answer 200 with one).
        let complete = capture.ended
            && match &capture.completion {
                Some(completion) => completion.complete(),
                None => !is_error_data(&capture.body),
            };
        if !complete {
            plan.metrics.bypass(Bypass::Incomplete);
            return;
        }
        let ttl = match response_ttl(
            capture.status,
            capture.cache_control.as_deref(),
            &plan.config.ttl,
        ) {
            Ok(ttl) => ttl,
            Err(reason) => {
                plan.metrics.bypass(reason);
                return;
            }
        };
        let now = host.now_ms();
        let response = StoredResponse {
            digest: key.0,
            stored_at_ms: now,
            status: capture.status,
            headers: capture.headers,
            body: capture.body,
            streamed: capture.completion.is_some(),
        };
        let expires_at = (now / 1000).saturating_add(ttl);
        match plan
            .shelf
            .store(host, &key, &response, expires_at, now / 1000)
        {
            Some(evicted) => plan.metrics.stored(evicted),
            None => plan.metrics.write_failed(),
        }
        if plan.config.fleet.is_some() {
            // Redis gets it from the observer, off the request path.
            let job = Job::CacheWrite(CacheWrite {
                digest: key.0,
                ttl_secs: u32::try_from(ttl).unwrap_or(u32::MAX),
                entry: FleetEntry {
                    expires_at,
                    response,
                }
                .encode(),
            });
            let queued = plan.queue.post(host, &job.encode());
            plan.metrics.fleet_write(queued);
        }
    }

    /// Resolves a follower's phase once the root ended its wait.
    fn settle_wait(&mut self) {
        if let Phase::Waiting(outcome) = &self.phase {
            self.phase = match outcome.get() {
                Some(WaitEnd::Hit) => Phase::Answered,
                Some(_) => Phase::Upstream,
                None => return,
            };
        }
    }

    /// Says (to the fused filter) that the request body is no longer of
    /// interest unless the key still waits for it.
    fn done_with_request_body_unless_awaited(&self, host: &mut impl StreamHost) {
        if !matches!(self.phase, Phase::AwaitingBody) {
            host.done_with(Callback::RequestBody);
        }
    }

    /// The response headers: `x-cache`, and whether (and what) to keep.
    fn on_response_headers(&mut self, host: &mut impl StreamHost, end_of_stream: bool) -> Action {
        self.settle_wait();
        let label = match self.phase {
            Phase::Bypassed => "BYPASS",
            // Still awaiting the body: the upstream (or another filter)
            // answered before it came; nothing of ours to say.
            Phase::Upstream => "MISS",
            // The gateway's own answer: its `x-cache` stays.
            Phase::Answered => return Action::Continue,
            Phase::Ignored | Phase::AwaitingBody | Phase::Waiting(_) => {
                // An upstream's `x-cache` would read as this cache's verdict.
                if self.plan.is_some() {
                    host.remove_header(Headers::Response, "x-cache");
                }
                return Action::Continue;
            }
        };
        host.set_response_header("x-cache", label);
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        if !self.store {
            return Action::Continue;
        }
        let status = host
            .response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if status != 200 {
            // Not stored: say why once, here.
            plan.metrics.bypass(Bypass::Status);
            self.store = false;
            return Action::Continue;
        }
        if ContentCoding::from_header(
            host.response_header("content-encoding")
                .as_deref()
                .map(str::as_bytes),
        ) != ContentCoding::Identity
        {
            // The backend compressed although asked not to: an entry would
            // reach clients that never accepted the coding.
            plan.metrics.bypass(Bypass::Encoded);
            self.store = false;
            return Action::Continue;
        }
        let content_type = host.response_header("content-type");
        let streamed = content_type
            .as_deref()
            .is_some_and(|ct| zerolayer_core::sse::is_event_stream(ct.as_bytes()));
        let mut headers: Vec<(String, String)> = Vec::new();
        if let Some(ct) = content_type {
            headers.push(("content-type".into(), ct));
        }
        // A hit answers with its own request's id; the id of the request
        // that reached the backend goes with the entry under another name.
        if let Some(origin) = host.response_header(reply::request_id_header(Some(self.provider))) {
            headers.push((ORIGIN_REQUEST_ID.into(), origin));
        }
        for name in &plan.config.stored_headers {
            if let Some(value) = host.response_header(name) {
                headers.push((name.clone(), value));
            }
        }
        let usage_hidden = (streamed
            && host.responses_in_chain_order()
            && host.property(internal::USAGE_HIDDEN_PROPERTY).is_some())
        .then(UsageChunkStripper::new);
        self.capture = Some(Capture {
            status,
            cache_control: host.response_header("cache-control"),
            headers,
            body: Vec::new(),
            completion: streamed.then(|| StreamCompletion::new(self.provider)),
            usage_hidden,
            ended: end_of_stream,
        });
        Action::Continue
    }

    /// A response chunk: kept for the cache while it is to be stored.
    fn on_response_body(
        &mut self,
        host: &mut impl StreamHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        let Some(capture) = &mut self.capture else {
            return Action::Continue;
        };
        if capture.body.len() + body_size > plan.config.max_entry_bytes as usize {
            plan.metrics.bypass(Bypass::TooLarge);
            self.capture = None;
            return Action::Continue;
        }
        if body_size > 0 {
            host.with_body(Body::Response, body_size, |chunk| {
                if let Some(completion) = &mut capture.completion {
                    completion.push(chunk);
                }
                match &mut capture.usage_hidden {
                    Some(stripper) => stripper.push(chunk, &mut capture.body),
                    None => capture.body.extend_from_slice(chunk),
                }
            });
        }
        if end_of_stream && let Some(stripper) = &mut capture.usage_hidden {
            stripper.finish(&mut capture.body);
        }
        capture.ended = end_of_stream;
        Action::Continue
    }
}

impl<H: StreamHost> StreamStage<H> for CacheStream {
    fn request_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let action = match self.plan.clone() {
            Some(plan) => self.admit(host, &plan, end_of_stream),
            None => Action::Continue,
        };
        self.done_with_request_body_unless_awaited(host);
        action
    }

    fn request_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        if !matches!(self.phase, Phase::AwaitingBody) {
            return Action::Continue;
        }
        if body_size > plan.config.max_request_bytes as usize {
            let action = self.bypass(Bypass::TooLarge);
            self.done_with_request_body_unless_awaited(host);
            return action;
        }
        if !end_of_stream {
            // Buffer until the whole body is here.
            return Action::Pause;
        }
        let action = self.decide(host, &plan, body_size);
        self.done_with_request_body_unless_awaited(host);
        action
    }

    fn response_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let action = self.on_response_headers(host, end_of_stream);
        if self.capture.is_none() {
            // Nothing kept for the cache: the body's chunks are not ours.
            host.done_with(Callback::ResponseBody);
        }
        action
    }

    fn response_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        let action = self.on_response_body(host, body_size, end_of_stream);
        if self.capture.is_none() {
            host.done_with(Callback::ResponseBody);
        }
        action
    }

    fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        if let Some(plan) = self.plan.clone() {
            self.fleet_answered(host, &plan, token, body_size);
        }
    }

    fn log(&mut self, host: &mut H) {
        let Some(plan) = self.plan.clone() else {
            return;
        };
        self.settle_wait();
        self.finish(host, &plan);
        if self.holds_lease
            && let Some(key) = &self.key
        {
            // Stored or not, followers stop waiting on this request.
            plan.shelf.release_lease(host, key);
            self.holds_lease = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerolayer_core::cache::store::{FleetEntry, StoredResponse};
    use zerolayer_core::event::Job;
    use zerolayer_core::internal;
    use zerolayer_host::{Action, FakeHost, Platform, RootStage};

    use crate::CacheRoot;
    use crate::testing::{
        ANSWER, BODY, JOBS, JSON_200, OPENAI, OTHER_BODY, SECRET_ENV, ask, complete, configured,
        counted, key_of, observer_queue, post, respond, shared_cache, stored_bodies,
    };

    const SSE_200: &[(&str, &str)] = &[(":status", "200"), ("content-type", "text/event-stream")];
    const SSE_START: [&[u8]; 2] = [
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"hel\"}}]}\n\n",
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
    ];
    const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

    fn lease_held(root: &CacheRoot, host: &mut FakeHost, body: &[u8]) -> bool {
        let plan = root.plan.as_ref().expect("configured");
        let now_ms = host.clock.as_millis() as u64;
        plan.shelf.lease_held(host, &key_of(body, None), now_ms)
    }

    /// Stores `BODY`'s answer in a fresh shared cache.
    fn cached() -> (FakeHost, CacheRoot) {
        let (mut host, root) = shared_cache();
        let mut first = post(&root, &mut host, 1, BODY);
        complete(&mut first.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(stored_bodies(&host), 1);
        (host, root)
    }

    /// After `BODY` got this response (and its log), nothing is stored and
    /// the same request again is a miss.
    fn assert_not_stored(
        host: &mut FakeHost,
        root: &CacheRoot,
        headers: &[(&str, &str)],
        chunks: &[&[u8]],
    ) {
        let mut first = post(root, host, 1, BODY);
        assert_eq!(first.body, Action::Continue);
        complete(&mut first.stream, host, headers, chunks);
        assert_eq!(stored_bodies(host), 0);
        let again = post(root, host, 2, BODY);
        assert_eq!(again.body, Action::Continue);
        assert!(host.sent.is_empty());
    }

    #[test]
    fn a_path_the_cache_does_not_know_is_ignored() {
        let (mut host, mut root) = shared_cache();
        let mut asked = ask(&root, &mut host, 1, "POST", "/v1/models", &[], Some(BODY));
        assert_eq!(asked.headers, Action::Continue);
        assert_eq!(asked.body, Action::Continue);
        assert_eq!(host.request_header_value("accept-encoding"), None);
        let upstream = [(":status", "200"), ("x-cache", "HIT")];
        complete(&mut asked.stream, &mut host, &upstream, &ANSWER);
        // The upstream's verdict is removed, none of ours is added.
        assert_eq!(host.response_header_value("x-cache"), None);
        assert_eq!(stored_bodies(&host), 0);
        for result in ["hit", "miss", "bypass"] {
            let name = format!("zerolayer_cache_lookups_result={result}");
            assert_eq!(counted(&mut root, &mut host, &name), 0, "{name}");
        }
    }

    #[test]
    fn a_body_declared_larger_than_max_request_bytes_is_never_held() {
        let (mut host, mut root) = shared_cache();
        let length = (1024 * 1024 + 1).to_string();
        host.request_headers = [(":method", "POST"), (":path", OPENAI)]
            .iter()
            .chain(&[("content-length", length.as_str())])
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let mut stream = RootStage::<FakeHost>::stream(&root, 1);
        assert_eq!(stream.request_headers(&mut host, false), Action::Continue);
        // Its body is not the cache's: the first chunk goes on at once.
        host.request_body = vec![b'{'; 16 * 1024];
        assert_eq!(
            stream.request_body(&mut host, 16 * 1024, false),
            Action::Continue
        );
        complete(&mut stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("BYPASS")
        );
        assert_eq!(stored_bodies(&host), 0);
        let too_large = "zerolayer_cache_bypass_reason=too_large";
        assert_eq!(counted(&mut root, &mut host, too_large), 1);
    }

    #[test]
    fn a_get_bypasses_the_cache() {
        let (mut host, mut root) = shared_cache();
        let mut asked = ask(&root, &mut host, 1, "GET", OPENAI, &[], None);
        assert_eq!(asked.headers, Action::Continue);
        complete(&mut asked.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("BYPASS")
        );
        assert_eq!(stored_bodies(&host), 0);
        let reason = "zerolayer_cache_bypass_reason=not_cacheable_method";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
        let bypass = "zerolayer_cache_lookups_result=bypass";
        assert_eq!(counted(&mut root, &mut host, bypass), 1);
    }

    #[test]
    fn a_request_no_store_bypasses_without_holding_the_headers() {
        let (mut host, mut root) = shared_cache();
        let no_store = [("cache-control", "no-store")];
        let mut asked = ask(&root, &mut host, 1, "POST", OPENAI, &no_store, Some(BODY));
        assert_eq!(asked.headers, Action::Continue);
        complete(&mut asked.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("BYPASS")
        );
        assert_eq!(stored_bodies(&host), 0);
        let reason = "zerolayer_cache_bypass_reason=request_no_store";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn headers_are_held_for_the_body_in_envoy_only() {
        let (mut host, root) = shared_cache();
        assert_eq!(post(&root, &mut host, 1, BODY).headers, Action::Pause);

        let (mut host, root) = shared_cache();
        host.platform = Platform::NgxWasm;
        let asked = post(&root, &mut host, 1, BODY);
        assert_eq!(asked.headers, Action::Continue);
        // The body callback still decides: a miss here, and the lease taken.
        assert_eq!(asked.body, Action::Continue);
        assert!(lease_held(&root, &mut host, BODY));
    }

    #[test]
    fn ngx_wasm_module_serves_a_hit_from_the_body_callback() {
        let (mut host, root) = shared_cache();
        host.platform = Platform::NgxWasm;
        let mut first = post(&root, &mut host, 1, BODY);
        complete(&mut first.stream, &mut host, JSON_200, &ANSWER);
        let second = post(&root, &mut host, 2, BODY);
        assert_eq!(second.headers, Action::Continue);
        assert_eq!(second.body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].header("x-cache"), Some("HIT"));
    }

    #[test]
    fn an_uncompressed_response_is_asked_for() {
        let (mut host, root) = shared_cache();
        let gzip = [("accept-encoding", "gzip, br")];
        ask(&root, &mut host, 1, "POST", OPENAI, &gzip, Some(BODY));
        assert_eq!(
            host.request_header_value("accept-encoding").as_deref(),
            Some("identity")
        );
    }

    #[test]
    fn a_miss_takes_the_lease_and_goes_upstream() {
        let (mut host, mut root) = shared_cache();
        let mut asked = post(&root, &mut host, 1, BODY);
        assert_eq!(asked.headers, Action::Pause);
        assert_eq!(asked.body, Action::Continue);
        assert!(host.sent.is_empty());
        assert!(lease_held(&root, &mut host, BODY));
        respond(&mut asked.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("MISS")
        );
        let miss = "zerolayer_cache_lookups_result=miss";
        assert_eq!(counted(&mut root, &mut host, miss), 1);
    }

    #[test]
    fn a_complete_response_is_stored_on_log_and_served_as_a_hit() {
        let (mut host, mut root) = shared_cache();
        let mut first = post(&root, &mut host, 1, BODY);
        respond(&mut first.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(stored_bodies(&host), 0, "written only on log");
        first.stream.log(&mut host);
        assert_eq!(stored_bodies(&host), 1);
        assert!(!lease_held(&root, &mut host, BODY), "released on log");

        host.advance(Duration::from_secs(5));
        let second = post(&root, &mut host, 2, BODY);
        assert_eq!(second.body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        let hit = &host.sent[0];
        assert_eq!(hit.status, 200);
        assert_eq!(hit.header("x-cache"), Some("HIT"));
        assert_eq!(hit.header("age"), Some("5"));
        assert_eq!(hit.header("content-type"), Some("application/json"));
        assert_eq!(hit.body, ANSWER.concat());
        assert_eq!(hit.effective, None);
        assert_eq!(
            counted(&mut root, &mut host, "zerolayer_cache_lookups_result=hit"),
            1
        );
        assert_eq!(counted(&mut root, &mut host, "zerolayer_cache_stored"), 1);
    }

    #[test]
    fn a_request_with_another_body_is_a_miss() {
        let (mut host, mut root) = cached();
        let other = post(&root, &mut host, 2, OTHER_BODY);
        assert_eq!(other.body, Action::Continue);
        assert!(host.sent.is_empty());
        let miss = "zerolayer_cache_lookups_result=miss";
        assert_eq!(counted(&mut root, &mut host, miss), 2);
    }

    #[test]
    fn a_non_200_response_is_not_stored() {
        let (mut host, mut root) = shared_cache();
        let error: &[u8] = br#"{"error":{"type":"overloaded"}}"#;
        let status = [(":status", "500"), ("content-type", "application/json")];
        assert_not_stored(&mut host, &root, &status, &[error]);
        let reason = "zerolayer_cache_bypass_reason=status";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_response_no_store_is_not_stored() {
        let (mut host, mut root) = shared_cache();
        let no_store = [
            (":status", "200"),
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        assert_not_stored(&mut host, &root, &no_store, &ANSWER);
        let reason = "zerolayer_cache_bypass_reason=response_no_store";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_compressed_response_is_not_stored() {
        let (mut host, mut root) = shared_cache();
        let gzip = [
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ];
        assert_not_stored(&mut host, &root, &gzip, &[b"\x1f\x8b\x08\x00"]);
        let reason = "zerolayer_cache_bypass_reason=encoded";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_response_over_max_entry_bytes_is_not_stored() {
        let (mut host, mut root) = configured(&format!(
            r#"{{"secret_env":"{SECRET_ENV}","namespace":"shared","max_entry_bytes":1024}}"#
        ));
        let half = vec![b' '; 600];
        assert_not_stored(&mut host, &root, JSON_200, &[&half, &half]);
        let reason = "zerolayer_cache_bypass_reason=too_large";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_response_cut_before_its_end_is_not_stored() {
        let (mut host, mut root) = shared_cache();
        let mut first = post(&root, &mut host, 1, BODY);
        host.respond_with(JSON_200);
        let _ = first.stream.response_headers(&mut host, false);
        host.response_body = ANSWER[0].to_vec();
        let _ = first
            .stream
            .response_body(&mut host, ANSWER[0].len(), false);
        first.stream.log(&mut host);
        assert_eq!(stored_bodies(&host), 0);
        let reason = "zerolayer_cache_bypass_reason=incomplete";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_stream_without_its_terminal_event_is_not_stored() {
        let (mut host, mut root) = shared_cache();
        assert_not_stored(&mut host, &root, SSE_200, &SSE_START);
        let reason = "zerolayer_cache_bypass_reason=incomplete";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    #[test]
    fn a_stream_that_reached_its_terminal_event_is_stored_and_replayed() {
        let (mut host, root) = shared_cache();
        let mut first = post(&root, &mut host, 1, BODY);
        let chunks = [SSE_START[0], SSE_START[1], SSE_DONE];
        complete(&mut first.stream, &mut host, SSE_200, &chunks);
        assert_eq!(stored_bodies(&host), 1);
        let second = post(&root, &mut host, 2, BODY);
        assert_eq!(second.body, Action::Pause);
        assert_eq!(
            host.sent[0].header("content-type"),
            Some("text/event-stream")
        );
        assert_eq!(host.sent[0].body, chunks.concat());
    }

    #[test]
    fn only_if_cached_with_nothing_cached_is_a_504() {
        let (mut host, root) = shared_cache();
        let only = [("cache-control", "only-if-cached")];
        let asked = ask(&root, &mut host, 1, "POST", OPENAI, &only, Some(BODY));
        assert_eq!(asked.body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 504);
        assert!(
            host.sent[0].text().contains("cache_miss"),
            "{}",
            host.sent[0].text()
        );
        assert!(!lease_held(&root, &mut host, BODY));
    }

    #[test]
    fn only_if_cached_is_served_when_cached() {
        let (mut host, root) = cached();
        let only = [("cache-control", "only-if-cached")];
        let asked = ask(&root, &mut host, 2, "POST", OPENAI, &only, Some(BODY));
        assert_eq!(asked.body, Action::Pause);
        assert_eq!(host.sent[0].status, 200);
        assert_eq!(host.sent[0].header("x-cache"), Some("HIT"));
    }

    #[test]
    fn a_body_naming_a_member_twice_is_a_400() {
        let (mut host, root) = shared_cache();
        let twice: &[u8] = br#"{"model":"m","model":"n","temperature":0,"messages":[]}"#;
        let asked = post(&root, &mut host, 1, twice);
        assert_eq!(asked.body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 400);
        assert!(host.sent[0].text().contains("invalid_request_error"));
        assert!(host.shared.keys().all(|k| !k.starts_with("zl:cache:l:")));
    }

    #[test]
    fn an_identical_request_waits_while_the_lease_is_held() {
        let (mut host, root) = shared_cache();
        let _first = post(&root, &mut host, 1, BODY);
        let second = post(&root, &mut host, 2, BODY);
        assert_eq!(second.body, Action::Pause);
        assert!(host.sent.is_empty());
        let plan = root.plan.as_ref().expect("configured");
        let waiters = plan.waiters.borrow();
        assert_eq!(
            waiters.iter().map(|w| w.context_id).collect::<Vec<_>>(),
            [2]
        );
    }

    #[test]
    fn followers_do_not_wait_in_ngx_wasm_module() {
        let (mut host, root) = shared_cache();
        host.platform = Platform::NgxWasm;
        let _first = post(&root, &mut host, 1, BODY);
        let second = post(&root, &mut host, 2, BODY);
        assert_eq!(second.body, Action::Continue);
        assert!(
            root.plan
                .as_ref()
                .expect("configured")
                .waiters
                .borrow()
                .is_empty()
        );
    }

    #[test]
    fn followers_do_not_wait_in_pass_through_mode() {
        let (mut host, root) = configured(&format!(
            r#"{{"secret_env":"{SECRET_ENV}","namespace":"shared","stampede":{{"mode":"pass_through"}}}}"#
        ));
        let _first = post(&root, &mut host, 1, BODY);
        assert_eq!(post(&root, &mut host, 2, BODY).body, Action::Continue);
    }

    #[test]
    fn the_lease_is_released_on_log_even_when_nothing_is_stored() {
        let (mut host, root) = shared_cache();
        let mut first = post(&root, &mut host, 1, BODY);
        let status = [(":status", "503")];
        complete(&mut first.stream, &mut host, &status, &[b"busy"]);
        assert_eq!(stored_bodies(&host), 0);
        assert!(!lease_held(&root, &mut host, BODY));
        // The next identical request takes the lease rather than waiting.
        assert_eq!(post(&root, &mut host, 2, BODY).body, Action::Continue);
        assert!(lease_held(&root, &mut host, BODY));
    }

    fn tenant_cache() -> (FakeHost, CacheRoot) {
        configured(&format!(
            r#"{{"secret_env":"{SECRET_ENV}","namespace":"tenant"}}"#
        ))
    }

    fn identity(host: &mut FakeHost, value: &str) {
        host.properties
            .insert(internal::AUTH_PROPERTY.into(), value.as_bytes().to_vec());
    }

    #[test]
    fn the_tenant_namespace_bypasses_without_a_verified_identity() {
        let (mut host, mut root) = tenant_cache();
        let anonymous = post(&root, &mut host, 1, BODY);
        assert_eq!(anonymous.headers, Action::Continue);
        identity(&mut host, "unverified tenant=acme");
        let mut claimed = post(&root, &mut host, 2, BODY);
        assert_eq!(claimed.headers, Action::Continue);
        complete(&mut claimed.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(
            host.response_header_value("x-cache").as_deref(),
            Some("BYPASS")
        );
        assert_eq!(stored_bodies(&host), 0);
        let reason = "zerolayer_cache_bypass_reason=no_verified_tenant";
        assert_eq!(counted(&mut root, &mut host, reason), 2);
    }

    #[test]
    fn tenants_do_not_share_entries() {
        let (mut host, root) = tenant_cache();
        identity(&mut host, "verified tenant=acme subject=u1");
        let mut acme = post(&root, &mut host, 1, BODY);
        complete(&mut acme.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(stored_bodies(&host), 1);

        identity(&mut host, "verified tenant=globex subject=u2");
        let globex = post(&root, &mut host, 2, BODY);
        assert_eq!(globex.body, Action::Continue);
        assert!(host.sent.is_empty());

        identity(&mut host, "verified tenant=acme subject=u3");
        assert_eq!(post(&root, &mut host, 3, BODY).body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        // The entry is keyed in acme's namespace.
        let plan = root.plan.as_ref().expect("configured");
        let now = host.clock.as_secs();
        let acme_key = key_of(BODY, Some("acme"));
        assert!(plan.shelf.lookup(&mut host, &acme_key, now, None).is_some());
        let shared_key = key_of(BODY, None);
        assert!(
            plan.shelf
                .lookup(&mut host, &shared_key, now, None)
                .is_none()
        );
    }

    #[test]
    fn a_request_activation_left_the_cache_out_of_bypasses() {
        let (mut host, mut root) = shared_cache();
        host.properties.insert(
            internal::OBSERVERS_PROPERTY.into(),
            b"audit,metering".to_vec(),
        );
        assert_eq!(post(&root, &mut host, 1, BODY).headers, Action::Continue);
        let reason = "zerolayer_cache_bypass_reason=not_activated";
        assert_eq!(counted(&mut root, &mut host, reason), 1);
    }

    fn fleet_cache(read_remote: bool) -> (FakeHost, CacheRoot) {
        configured(&format!(
            r#"{{"secret_env":"{SECRET_ENV}","namespace":"shared",
                "fleet":{{"cluster":"webdis","path":"/","read_remote":{read_remote}}}}}"#
        ))
    }

    /// An entry as the fleet tier holds it, stored `age` seconds ago.
    fn fleet_entry(host: &FakeHost, digest: [u8; 32], age: u64) -> Vec<u8> {
        let now = host.clock.as_secs();
        FleetEntry {
            expires_at: now + 60,
            response: StoredResponse {
                digest,
                stored_at_ms: (now - age) * 1000,
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())],
                body: br#"{"from":"fleet"}"#.to_vec(),
                streamed: false,
            },
        }
        .encode()
    }

    #[test]
    fn a_local_miss_asks_the_fleet_tier_and_waits() {
        let (mut host, root) = fleet_cache(true);
        let asked = post(&root, &mut host, 1, BODY);
        assert_eq!(asked.body, Action::Pause);
        assert_eq!(host.dispatched.len(), 1);
        let call = &host.dispatched[0];
        assert_eq!(call.cluster, "webdis");
        assert_eq!(call.header(":method"), Some("GET"));
        let path = format!("/GET/zl:cache:{}.txt", key_of(BODY, None).hex());
        assert_eq!(call.header(":path"), Some(path.as_str()));
        assert!(host.sent.is_empty());
        assert!(host.resumes.is_empty());
    }

    #[test]
    fn a_fleet_entry_for_this_key_is_served_and_kept_locally() {
        let (mut host, mut root) = fleet_cache(true);
        let mut asked = post(&root, &mut host, 1, BODY);
        let token = host.dispatched[0].token;
        let entry = fleet_entry(&host, key_of(BODY, None).0, 3);
        host.answer_with(Some(200), &entry);
        asked.stream.call_answered(&mut host, token, entry.len());
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].header("x-cache"), Some("HIT"));
        assert_eq!(host.sent[0].header("age"), Some("3"));
        assert_eq!(host.sent[0].body, br#"{"from":"fleet"}"#);
        assert!(host.resumes.is_empty());
        let hit = "zerolayer_cache_fleet_reads_result=hit";
        assert_eq!(counted(&mut root, &mut host, hit), 1);
        // The next identical request is a local hit: no second call.
        assert_eq!(post(&root, &mut host, 2, BODY).body, Action::Pause);
        assert_eq!(host.dispatched.len(), 1);
        assert_eq!(host.sent.len(), 2);
    }

    #[test]
    fn a_fleet_entry_for_another_key_is_not_served() {
        let (mut host, mut root) = fleet_cache(true);
        let mut asked = post(&root, &mut host, 1, BODY);
        let token = host.dispatched[0].token;
        let entry = fleet_entry(&host, key_of(OTHER_BODY, None).0, 3);
        host.answer_with(Some(200), &entry);
        asked.stream.call_answered(&mut host, token, entry.len());
        assert!(host.sent.is_empty());
        assert_eq!(host.resumes, [None]);
        let error = "zerolayer_cache_fleet_reads_result=error";
        assert_eq!(counted(&mut root, &mut host, error), 1);
    }

    #[test]
    fn a_fleet_404_goes_upstream_with_the_lease() {
        let (mut host, mut root) = fleet_cache(true);
        let mut asked = post(&root, &mut host, 1, BODY);
        let token = host.dispatched[0].token;
        host.answer_with(Some(404), b"");
        // Another call's answer is not this request's.
        asked.stream.call_answered(&mut host, token + 1, 0);
        assert!(host.resumes.is_empty());
        asked.stream.call_answered(&mut host, token, 0);
        assert_eq!(host.resumes, [None]);
        assert!(host.sent.is_empty());
        assert!(lease_held(&root, &mut host, BODY));
        let miss = "zerolayer_cache_fleet_reads_result=miss";
        assert_eq!(counted(&mut root, &mut host, miss), 1);
    }

    #[test]
    fn a_refused_fleet_call_goes_upstream_at_once() {
        let (mut host, mut root) = fleet_cache(true);
        host.refuse_dispatch = true;
        assert_eq!(post(&root, &mut host, 1, BODY).body, Action::Continue);
        let error = "zerolayer_cache_fleet_reads_result=error";
        assert_eq!(counted(&mut root, &mut host, error), 1);
    }

    #[test]
    fn a_stored_response_is_queued_for_the_fleet_tier() {
        let (mut host, mut root) = fleet_cache(false);
        observer_queue(&mut host);
        let mut asked = post(&root, &mut host, 1, BODY);
        assert!(host.dispatched.is_empty(), "read_remote is off");
        complete(&mut asked.stream, &mut host, JSON_200, &ANSWER);
        let jobs = host.queued(JOBS);
        assert_eq!(jobs.len(), 1);
        let Some(Job::CacheWrite(write)) = Job::decode(&jobs[0]) else {
            panic!("not a cache write");
        };
        assert_eq!(write.digest, key_of(BODY, None).0);
        assert_eq!(write.ttl_secs, 60);
        let entry = FleetEntry::decode(&write.entry).expect("an entry");
        assert_eq!(entry.response.body, ANSWER.concat());
        assert_eq!(entry.expires_at, host.clock.as_secs() + 60);
        let queued = "zerolayer_cache_fleet_writes_queued";
        assert_eq!(counted(&mut root, &mut host, queued), 1);
    }

    #[test]
    fn a_fleet_write_without_an_observer_is_counted_lost() {
        let (mut host, mut root) = fleet_cache(false);
        let mut asked = post(&root, &mut host, 1, BODY);
        complete(&mut asked.stream, &mut host, JSON_200, &ANSWER);
        assert_eq!(stored_bodies(&host), 1, "stored locally all the same");
        let lost = "zerolayer_cache_fleet_writes_lost";
        assert_eq!(counted(&mut root, &mut host, lost), 1);
    }
}
