//! One request's authentication: read the credential, hash it, read its
//! verdict, route by policy, and act (continue, refuse, admit lazily,
//! verify now).

use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::auth::attribution::PendingCredential;
use zerolayer_core::auth::budget::{self, Scope};
use zerolayer_core::auth::credential::{self, CredentialKind, TokenHash};
use zerolayer_core::auth::escalation::{ESCALATED_KEY, EscalatedTenants};
use zerolayer_core::auth::exposure::{
    self, Bump, ENQUEUED_KEY, FINISHED_KEY, decode_count, pending,
};
use zerolayer_core::auth::identity::Identity;
use zerolayer_core::auth::introspection;
use zerolayer_core::auth::jwt;
use zerolayer_core::auth::jwt::KeySet;
use zerolayer_core::auth::policy::{Admission, Route, SyncCheck, SyncReason, Unknown};
use zerolayer_core::auth::verdict::{self, Verdict, VerdictView};
use zerolayer_core::event::{AuditRecord, Job, VerifyJob, VerifyOutcome};
use zerolayer_core::internal;
use zerolayer_core::metrics::Label;
use zerolayer_host::{Action, StreamHost};
use zerolayer_observer::auth::{JWKS_KEY, VERIFIER_DOWN_KEY, throttle, throttled};

use crate::Plan;
use crate::metrics::Outcome;

/// What the configured sources hold.
enum Read {
    Found(Credential),
    Missing,
    /// Longer than `max_credential_bytes`: refused before anything else.
    TooLong,
}

/// The credential of a request.
struct Credential {
    kind: CredentialKind,
    token: Vec<u8>,
    hash: TokenHash,
}

/// Whether the request declares a body that is not empty (a length, or
/// chunks): nginx then reads it, and runs the body step, before it
/// contacts the upstream. A chunked request has no `content-length`; taken
/// for one without a body, it was checked from the request headers and a
/// refusal from the answer left its body unread, and ngx_wasm_module
/// closed that request twice (nginx's "http request count is zero while
/// closing request" alert: kong/README.md, "What is verified and what is
/// not").
fn declares_body(host: &mut impl StreamHost) -> bool {
    host.request_header("content-length")
        .is_some_and(|l| l.trim_ascii() != b"0")
        || host.request_header("transfer-encoding").is_some()
}

/// A synchronous introspection in flight.
#[derive(Clone, Copy)]
struct Introspection {
    /// Its callout.
    callout: u32,
    /// Why it is synchronous.
    reason: SyncReason,
    /// The credential it verifies.
    hash: TokenHash,
}

/// A JWKS fetch a JWT waits for: no key was at hand.
struct JwksWait {
    /// Its callout.
    callout: u32,
    /// Why the JWT is verified now.
    reason: SyncReason,
    /// The JWT.
    credential: Credential,
}

/// One request's state.
pub(crate) struct Stream {
    plan: Rc<Plan>,
    started_us: u64,
    /// The hash of the credential read, for the audit record.
    hash: Option<TokenHash>,
    claimed_tenant: Option<String>,
    /// Outcome and reason, for metrics and the audit record.
    outcome: Option<Outcome>,
    /// This stage answered the request itself (a refusal, a 503).
    answered: bool,
    reason: String,
    tenant: Option<String>,
    verified: bool,
    decided_us: u64,
    introspection: Option<Introspection>,
    /// Deciding in the introspection's answer (the body may be unread).
    in_answer: bool,
    /// A JWKS fetch this request's JWT waits for.
    jwks_wait: Option<JwksWait>,
    /// ngx_wasm_module: a synchronous check of this credential that needs
    /// a callout waits for the body step (see [`Stream::introspect`]).
    deferred: Option<(SyncReason, Credential)>,
}

impl Stream {
    pub(crate) fn new(plan: Rc<Plan>) -> Stream {
        Stream {
            plan,
            started_us: 0,
            hash: None,
            claimed_tenant: None,
            outcome: None,
            answered: false,
            reason: String::new(),
            tenant: None,
            verified: false,
            decided_us: 0,
            introspection: None,
            in_answer: false,
            jwks_wait: None,
            deferred: None,
        }
    }

    pub(crate) fn on_request_headers(&mut self, host: &mut impl StreamHost) -> Action {
        // Every host call counts on this path (~0.3 µs each in V8): one
        // clock read serves the whole decision, and the path is read only
        // when public paths are configured.
        self.started_us = host.now_us();
        let now = self.started_us / 1_000_000;
        let plan = self.plan.clone();
        if !plan.config.public_paths.is_empty() {
            let path = host.request_header(":path").unwrap_or_default();
            if plan.config.is_public(&path) {
                host.publish(internal::AUTH_PROPERTY, &Identity::Public.render());
                return self.done(host, Outcome::Public, "public_path", Action::Continue);
            }
        }
        let credential = match self.read_credential(host) {
            Read::Found(credential) => credential,
            Read::Missing => {
                return self.refuse(
                    host,
                    401,
                    Outcome::Missing,
                    "missing_credential",
                    "missing credential",
                );
            }
            Read::TooLong => {
                // Never hashed, counted, queued or sent to a verifier: a
                // client cannot make the verifier fail with it.
                let message = format!(
                    "credential longer than {} bytes",
                    plan.config.max_credential_bytes
                );
                return self.refuse(host, 431, Outcome::TooLong, "credential_too_long", &message);
            }
        };
        self.hash = Some(credential.hash);
        let key = verdict::key(&credential.hash, plan.config.verdict_slots);
        let entry = host.shared_get(&key).0.unwrap_or_default();
        match verdict::view(&entry, &credential.hash, now) {
            Some(v) if v.valid => {
                // The hot path: one header, one hash, one shared-data read,
                // the verdict read in place.
                self.allow(host, v, Outcome::ValidCached, "cached");
                Action::Continue
            }
            Some(v) => {
                let reason = v.reason.to_string();
                self.touch_exposure(host, &credential.hash, now);
                self.refuse_invalid(host, Outcome::InvalidCached, &reason)
            }
            None => self.unknown(host, credential, now),
        }
    }

    fn read_credential(&self, host: &mut impl StreamHost) -> Read {
        let max = self.plan.config.max_credential_bytes as usize;
        for source in &self.plan.config.credentials {
            let Some(value) = host.request_header(&source.header) else {
                continue;
            };
            if let Some(token) = credential::extract(source, &value) {
                if token.len() > max {
                    return Read::TooLong;
                }
                let kind = source
                    .kind
                    .classify(token, self.plan.config.api_keys.is_some());
                let hash = match self.plan.recent.try_borrow_mut() {
                    Ok(mut recent) => recent.hash(kind, token),
                    Err(_) => TokenHash::credential(kind, token),
                };
                // Keep the token in the header's own buffer (no copy): it is
                // needed only when the verdict is unknown.
                let start = token.as_ptr() as usize - value.as_ptr() as usize;
                let end = start + token.len();
                let mut token = value;
                token.truncate(end);
                token.drain(..start);
                return Read::Found(Credential { kind, hash, token });
            }
        }
        Read::Missing
    }

    /// A credential nobody verified yet (or whose verdict expired).
    fn unknown(&mut self, host: &mut impl StreamHost, credential: Credential, now: u64) -> Action {
        let plan = self.plan.clone();
        let Credential { kind, hash, .. } = credential;
        if kind == CredentialKind::Jwt {
            // Unverified claims: only for escalation and attribution, never trusted.
            self.claimed_tenant = jwt::peek(&credential.token).ok().and_then(|u| {
                u.claims()
                    .get_str(&plan.config.jwt.tenant_claim)
                    .map(str::to_string)
            });
        }
        // A claimed tenant, "no tenant" or the whole gateway may be escalated.
        let escalated = EscalatedTenants::decode(host.shared_get(ESCALATED_KEY).0.as_deref())
            .covers(self.claimed_tenant.as_deref());
        let trusted_client = !plan.trusted.is_empty()
            && host
                .request_header("user-agent")
                .is_some_and(|ua| plan.trusted.iter().any(|r| r.is_match(&ua)));
        // A JWT whose key is at hand is checked inside the filter, whatever
        // the verifier's health.
        let check = if kind == CredentialKind::Jwt && plan.keys.available(host) {
            SyncCheck::Inline
        } else if decode_count(host.shared_get(VERIFIER_DOWN_KEY).0.as_deref()) > now {
            SyncCheck::Unavailable
        } else {
            SyncCheck::Verifier
        };
        let route = plan.policy.route(Unknown {
            escalated,
            trusted_client,
            check,
        });
        let admission = match route {
            Route::Sync(reason) => {
                self.touch_exposure(host, &hash, now);
                Admission::Sync(reason)
            }
            Route::Unavailable => Admission::Unavailable,
            Route::TryLazy => {
                let config = &plan.config;
                let (ways, retention) = (config.verdict_ways, config.exposure_retention_secs());
                let count = host
                    .shared_update_if(&exposure::key(&hash, config.verdict_slots), |current| {
                        match exposure::bump(current, &hash, now, ways, retention) {
                            Bump::Counted(next, count) => (Some(next), count),
                            // Every way held by a recent credential: over the bound.
                            Bump::Full => (None, u32::MAX),
                        }
                    })
                    // Lost every CAS race: count as over the bound (never open).
                    .unwrap_or(u32::MAX);
                let waiting = pending(
                    decode_count(host.shared_get(ENQUEUED_KEY).0.as_deref()),
                    decode_count(host.shared_get(FINISHED_KEY).0.as_deref()),
                );
                let take_budget = || self.take_budget(host);
                plan.policy.admit(count, waiting, check, take_budget)
            }
        };
        match admission {
            Admission::Lazy => self.admit_lazily(host, credential),
            Admission::Sync(reason) => self.verify_now(host, credential, reason, now),
            Admission::Unavailable => self.unavailable(host),
        }
    }

    /// A request of a credential that is not counted (refused from its
    /// cached verdict, or checked now) keeps its count's way fresh, so a
    /// credential that keeps coming never loses it to colliding newcomers.
    /// A read per such request, a write at most every
    /// `exposure_touch_secs`.
    fn touch_exposure(&self, host: &mut impl StreamHost, hash: &TokenHash, now: u64) {
        let config = &self.plan.config;
        let every = config.exposure_touch_secs();
        let _ = host.shared_update_if(&exposure::key(hash, config.verdict_slots), |current| {
            (exposure::touch(current, hash, now, every), ())
        });
    }

    /// One lazy admission from the client's, the claimed tenant's and the
    /// gateway's buckets, narrowest first (false: one is empty; what the
    /// narrower ones gave is not returned, which only errs towards strict).
    fn take_budget(&self, host: &mut impl StreamHost) -> bool {
        let budget = &self.plan.config.lazy_budget;
        let now_ms = self.started_us / 1000;
        let seed = self.plan.bucket_seed(host);
        let address = host.property("source.address").unwrap_or_default();
        [
            (Scope::Client(&address), budget.per_client),
            (
                Scope::Tenant(self.claimed_tenant.as_deref()),
                budget.per_tenant,
            ),
            (Scope::Gateway, budget.gateway),
        ]
        .into_iter()
        .all(|(scope, rate)| {
            take_from(host, &budget::key(scope, seed), |current| {
                budget::take(current, rate, now_ms)
            })
        })
    }

    /// Continue unverified; the observer verifies off the path.
    fn admit_lazily(&mut self, host: &mut impl StreamHost, c: Credential) -> Action {
        let plan = self.plan.clone();
        // Metering bills the request to the tenant verification finds.
        let pending = PendingCredential {
            hash: c.hash,
            slots: plan.config.verdict_slots,
        };
        let job = Job::Verify(VerifyJob {
            hash: c.hash.0,
            kind: c.kind,
            credential: c.token.clone(),
            tenant_hint: self.claimed_tenant.clone(),
            enqueued_at_ms: self.started_us / 1000,
        });
        if !plan.queue.post(host, &job.encode()) {
            // Without an observer the credential would never be verified:
            // verify it now instead of admitting it blind.
            plan.metrics.lost();
            let now = host.now_secs();
            return self.verify_now(host, c, SyncReason::PendingBound, now);
        }
        let _ = host.shared_update(ENQUEUED_KEY, |current| {
            (
                (decode_count(current).saturating_add(1))
                    .to_string()
                    .into_bytes(),
                (),
            )
        });
        plan.metrics.enqueued();
        let identity = Identity::Unverified {
            claimed_tenant: self.claimed_tenant.as_deref(),
        };
        host.publish(internal::AUTH_PROPERTY, &identity.render());
        host.publish(internal::CREDENTIAL_PROPERTY, &pending.render());
        self.tenant = self.claimed_tenant.clone();
        self.done(
            host,
            Outcome::Lazy,
            "unverified_within_bound",
            Action::Continue,
        )
    }

    /// Verifies on the request path: inline for JWTs, by introspection
    /// (request paused) for API keys.
    fn verify_now(
        &mut self,
        host: &mut impl StreamHost,
        c: Credential,
        reason: SyncReason,
        now: u64,
    ) -> Action {
        let plan = self.plan.clone();
        plan.metrics.sync(reason);
        match c.kind {
            CredentialKind::Jwt if !plan.keys.available(host) => {
                if self.defers_callout(host) {
                    self.deferred = Some((reason, c));
                    return Action::Continue;
                }
                self.fetch_keys(host, c, reason)
            }
            CredentialKind::Jwt => self.verify_inline(host, &c, reason, now),
            CredentialKind::ApiKey => self.introspect(host, c, reason),
        }
    }

    /// Verifies a JWT with the keys at hand.
    fn verify_inline(
        &mut self,
        host: &mut impl StreamHost,
        c: &Credential,
        reason: SyncReason,
        now: u64,
    ) -> Action {
        let plan = self.plan.clone();
        let result = plan.keys.with(host, |keys| {
            jwt::verify(&c.token, keys, &plan.validation, now)
        });
        let verdict = verdict::of_jwt(&plan.config, &c.hash, now, result);
        self.concluded(host, verdict, reason)
    }

    /// Whether a check that needs a callout waits for the body step
    /// (ngx_wasm_module, a request with a body: see [`Stream::introspect`]).
    fn defers_callout(&self, host: &mut impl StreamHost) -> bool {
        !host.can_hold_headers_for_body() && declares_body(host)
    }

    /// No key at hand (a restart or reload, before the observer's first
    /// JWKS fetch): this request fetches the JWKS itself and waits for it,
    /// at most `jwt.jwks.timeout_ms`, rather than refusing a JWT that was
    /// valid before; bounded per VM ([`crate::inline::RequestJwksFetches`]).
    fn fetch_keys(
        &mut self,
        host: &mut impl StreamHost,
        c: Credential,
        reason: SyncReason,
    ) -> Action {
        let plan = self.plan.clone();
        let Some(jwks) = &plan.config.jwt.jwks else {
            return self.unavailable(host);
        };
        let now_ms = host.now_ms();
        if !plan.jwks_fetches.start(now_ms) {
            return self.unavailable(host);
        }
        let headers = [
            (":method", "GET"),
            (":path", jwks.endpoint.path.as_str()),
            (":authority", jwks.endpoint.authority()),
        ];
        match host.dispatch(
            &jwks.endpoint.cluster,
            &headers,
            None,
            Duration::from_millis(u64::from(jwks.endpoint.timeout_ms)),
        ) {
            Ok(callout) => {
                self.jwks_wait = Some(JwksWait {
                    callout,
                    reason,
                    credential: c,
                });
                Action::Pause
            }
            Err(_) => {
                plan.jwks_fetches.finished(false, now_ms);
                self.unavailable(host)
            }
        }
    }

    /// A callout of this request answered.
    pub(crate) fn callout_answered(
        &mut self,
        host: &mut impl StreamHost,
        token: u32,
        body_size: usize,
    ) {
        if self.jwks_wait.as_ref().is_some_and(|w| w.callout == token) {
            self.jwks_answered(host, body_size);
        } else {
            self.introspection_answered(host, token, body_size);
        }
    }

    /// The JWKS this request fetched answered: kept for every request (and
    /// the observer, until its own fetch), then the JWT is verified.
    fn jwks_answered(&mut self, host: &mut impl StreamHost, body_size: usize) {
        let Some(wait) = self.jwks_wait.take() else {
            return;
        };
        let plan = self.plan.clone();
        let answer = host.callout_answer(body_size);
        let usable = answer.status == Some(200)
            && KeySet::from_jwks(&answer.body).is_ok_and(|jwks| !jwks.keys.is_empty());
        plan.jwks_fetches.finished(usable, host.now_ms());
        if usable && !plan.keys.available(host) {
            host.shared_put(JWKS_KEY, &answer.body);
            log::info!("lazy-auth: no JWKS yet: fetched it for a request");
        } else if !usable {
            log::warn!(
                "lazy-auth: JWKS fetched for a request unusable (status {:?})",
                answer.status
            );
        }
        self.in_answer = true;
        let action = if plan.keys.available(host) {
            let now = host.now_secs();
            self.verify_inline(host, &wait.credential, wait.reason, now)
        } else {
            self.unavailable(host)
        };
        self.in_answer = false;
        if action == Action::Continue {
            host.resume();
        }
    }

    fn introspect(
        &mut self,
        host: &mut impl StreamHost,
        c: Credential,
        reason: SyncReason,
    ) -> Action {
        // ngx_wasm_module reads a request body only after the request
        // headers step, and a request paused there for a callout and then
        // continued once its body was read was now and then never
        // finalized (its response sent, its log phase never run: no access
        // log line, no usage record). A request that declares a body is
        // checked from the body step instead, which nginx runs before it
        // contacts the upstream; nothing goes on before that. (The fused
        // filter keeps the body for the stages after this one, which run
        // from the callout's answer there.)
        if self.defers_callout(host) {
            self.deferred = Some((reason, c));
            return Action::Continue;
        }
        self.dispatch_introspection(host, &c, reason)
    }

    /// The request body step: a deferred check is made now.
    pub(crate) fn on_request_body(&mut self, host: &mut impl StreamHost) -> Action {
        let action = self.deferred_check(host);
        if action == Action::Pause {
            // Waiting for the check's callout (or answered: then nothing
            // goes upstream anyway).
            host.note_body_wait();
        }
        action
    }

    fn deferred_check(&mut self, host: &mut impl StreamHost) -> Action {
        match self.deferred.take() {
            Some((reason, c)) if c.kind == CredentialKind::Jwt => {
                if self.plan.keys.available(host) {
                    let now = host.now_secs();
                    self.verify_inline(host, &c, reason, now)
                } else {
                    self.fetch_keys(host, c, reason)
                }
            }
            Some((reason, c)) => self.dispatch_introspection(host, &c, reason),
            None => Action::Continue,
        }
    }

    /// Whether a check waits for the body step.
    pub(crate) fn awaits_body(&self) -> bool {
        self.deferred.is_some()
    }

    fn dispatch_introspection(
        &mut self,
        host: &mut impl StreamHost,
        c: &Credential,
        reason: SyncReason,
    ) -> Action {
        let plan = self.plan.clone();
        let Some(api) = &plan.config.api_keys else {
            return self.unavailable(host);
        };
        let now_ms = host.now_us() / 1000;
        // The verifier asked to slow down: nobody calls it before then.
        if let Some(wait_ms) = throttled(host, now_ms) {
            return self.throttled(host, wait_ms);
        }
        if let Err(wait_ms) = self.take_verify_budget(host, now_ms) {
            return self.retry_later(
                host,
                (429, "rate_limit_error"),
                "too many new credentials to verify; retry later",
                wait_ms,
                (Outcome::OverBudget, "verify_budget"),
            );
        }
        let key = String::from_utf8_lossy(&c.token).into_owned();
        let headers = vec![
            (":method", "GET"),
            (":path", api.endpoint.path.as_str()),
            (":authority", api.endpoint.authority()),
            (api.key_header.as_str(), key.as_str()),
        ];
        match host.dispatch(
            &api.endpoint.cluster,
            &headers,
            None,
            Duration::from_millis(u64::from(api.endpoint.timeout_ms)),
        ) {
            Ok(token) => {
                self.introspection = Some(Introspection {
                    callout: token,
                    reason,
                    hash: c.hash,
                });
                Action::Pause
            }
            Err(_) => self.unavailable(host),
        }
    }

    /// The introspection endpoint answered a synchronous check.
    pub(crate) fn introspection_answered(
        &mut self,
        host: &mut impl StreamHost,
        token: u32,
        body_size: usize,
    ) {
        let (reason, hash) = match self.introspection {
            Some(i) if i.callout == token => (i.reason, i.hash),
            _ => return,
        };
        self.introspection = None;
        let plan = self.plan.clone();
        let now = host.now_secs();
        let answer = host.callout_answer(body_size);
        self.in_answer = true;
        let action = if introspection::is_back_pressure(answer.status) {
            // Not the credential's failure nor the verifier's ill health:
            // nobody calls it again before its retry-after.
            let wait_ms = throttle(host, answer.retry_after_secs);
            self.throttled(host, wait_ms)
        } else {
            match introspection::verdict(&plan.config, &hash, now, answer.status, &answer.body) {
                Some(verdict) => self.concluded(host, verdict, reason),
                // The verifier did not answer: refuse rather than admit.
                None => self.unavailable(host),
            }
        };
        self.in_answer = false;
        if action == Action::Continue {
            host.resume();
        }
    }

    /// A synchronous verdict: store it (so the next request is a cache
    /// hit), report the outcome for escalation, and act on it.
    fn concluded(
        &mut self,
        host: &mut impl StreamHost,
        verdict: Verdict,
        reason: SyncReason,
    ) -> Action {
        let plan = self.plan.clone();
        let hash = TokenHash(verdict.hash);
        let ways = plan.config.verdict_ways;
        let now = host.now_secs();
        let _ = host.shared_update(&verdict::key(&hash, plan.config.verdict_slots), |set| {
            (verdict::insert(set, &verdict, now, ways), ())
        });
        // Every outcome counts: for its tenant, for "no tenant" (empty) and
        // for the gateway as a whole.
        let tenant = verdict
            .tenant
            .clone()
            .or_else(|| self.claimed_tenant.clone())
            .unwrap_or_default();
        let outcome = Job::Outcome(VerifyOutcome {
            tenant,
            failed: !verdict.valid,
            at: verdict.verified_at,
        });
        // Feeds the escalation windows only; a lost one is counted.
        if !plan.queue.post(host, &outcome.encode()) {
            plan.metrics.lost();
        }
        if verdict.valid {
            self.allow(host, verdict.view(), Outcome::SyncValid, reason.label());
            Action::Continue
        } else {
            self.refuse_invalid(host, Outcome::SyncInvalid, &verdict.reason)
        }
    }

    /// Continues as a valid verdict's tenant and subject.
    fn allow(
        &mut self,
        host: &mut impl StreamHost,
        verdict: VerdictView,
        outcome: Outcome,
        reason: &str,
    ) {
        let VerdictView {
            tenant, subject, ..
        } = verdict;
        host.publish(
            internal::AUTH_PROPERTY,
            &Identity::Verified { tenant, subject }.render(),
        );
        if self.plan.config.audit.is_some() {
            self.tenant = tenant.map(str::to_string);
        }
        self.verified = true;
        let _ = self.done(host, outcome, reason, Action::Continue);
    }

    fn refuse(
        &mut self,
        host: &mut impl StreamHost,
        status: u32,
        outcome: Outcome,
        reason: &str,
        message: &str,
    ) -> Action {
        self.send_refusal(host, status, message);
        self.done(host, outcome, reason, Action::Pause)
    }

    /// 401 for a credential verified invalid (now or before).
    fn refuse_invalid(
        &mut self,
        host: &mut impl StreamHost,
        outcome: Outcome,
        reason: &str,
    ) -> Action {
        self.refuse(host, 401, outcome, reason, "invalid credential")
    }

    /// Sends a refusal (from an answer: see `send_json_error_before_body`).
    fn send_refusal(&mut self, host: &mut impl StreamHost, status: u32, message: &str) {
        self.answered = true;
        if self.in_answer {
            host.send_json_error_before_body(status, "authentication_error", message);
        } else {
            host.send_json_error(status, "authentication_error", message);
        }
    }

    /// One synchronous introspection from the client's bucket, then the
    /// gateway's (whose `reserve` only a client with a full bucket may
    /// take); `Err`: the wait, ms, before a call could be made.
    fn take_verify_budget(&self, host: &mut impl StreamHost, now_ms: u64) -> Result<(), u64> {
        let budget = self.plan.config.verify_budget;
        let seed = self.plan.bucket_seed(host);
        let address = host.property("source.address").unwrap_or_default();
        let mut fresh = false;
        let own = take_from(host, &budget::verify_key(Some(&address), seed), |current| {
            fresh = budget::is_full(current, budget.per_client, now_ms);
            budget::take(current, budget.per_client, now_ms)
        });
        if !own {
            return Err(budget.per_client.ms_per_token());
        }
        let floor = if fresh { 0 } else { budget.reserve };
        let gateway = take_from(host, &budget::verify_key(None, seed), |current| {
            budget::take_above(current, budget.gateway, now_ms, floor)
        });
        gateway.then_some(()).ok_or(budget.gateway.ms_per_token())
    }

    /// 503 while the verifier pushes back, with what is left of its wait.
    fn throttled(&mut self, host: &mut impl StreamHost, wait_ms: u64) -> Action {
        self.retry_later(
            host,
            (503, "authentication_error"),
            CANNOT_VERIFY_NOW,
            wait_ms,
            (Outcome::Throttled, "verifier_throttled"),
        )
    }

    /// 503: the credential cannot be verified now (retry in a second).
    fn unavailable(&mut self, host: &mut impl StreamHost) -> Action {
        self.retry_later(
            host,
            (503, "authentication_error"),
            CANNOT_VERIFY_NOW,
            1000,
            (Outcome::Unavailable, "verifier_unavailable"),
        )
    }

    /// Answers `status` with an error of `kind` worth retrying after
    /// `wait_ms` (rounded up to seconds), and records the outcome and its
    /// reason.
    fn retry_later(
        &mut self,
        host: &mut impl StreamHost,
        (status, kind): (u32, &str),
        message: &str,
        wait_ms: u64,
        (outcome, reason): (Outcome, &str),
    ) -> Action {
        self.answered = true;
        let secs = wait_ms.div_ceil(1000).max(1);
        host.send_retry_later(status, kind, message, secs, self.in_answer);
        self.done(host, outcome, reason, Action::Pause)
    }

    fn done(
        &mut self,
        host: &mut impl StreamHost,
        outcome: Outcome,
        reason: &str,
        action: Action,
    ) -> Action {
        self.outcome = Some(outcome);
        // Only audit records need the reason and the decision's latency.
        if self.plan.config.audit.is_some() {
            self.reason = reason.to_string();
            self.decided_us = host.now_us();
        }
        self.plan.metrics.outcome(outcome);
        action
    }

    /// After the response: an audit record when activation asked for one.
    pub(crate) fn on_log(&self, host: &mut impl StreamHost) {
        let plan = &self.plan;
        let Some(outcome) = self.outcome else {
            return;
        };
        if plan.config.audit.is_none() {
            return;
        }
        // A refusal is always audited: it is a security event, and in the
        // shipped chains activation comes after this stage, so it never
        // decides for a request refused here. Others when activation asks.
        let audited = self.answered
            || host
                .property(internal::OBSERVERS_PROPERTY)
                .is_some_and(|list| zerolayer_core::observers::listed(&list, "audit"));
        if !audited {
            return;
        }
        let record = AuditRecord {
            at_ms: self.started_us / 1000,
            hash_prefix: self.hash.map(|h| h.prefix()).unwrap_or_default(),
            tenant: self.tenant.clone(),
            verified: self.verified,
            decision: outcome.label().to_string(),
            reason: self.reason.clone(),
            latency_us: self.decided_us.saturating_sub(self.started_us),
            request_id: host
                .request_header("x-request-id")
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_default(),
        };
        let full = {
            let mut batch = plan.audit_batch.borrow_mut();
            batch.push(record);
            batch.len() >= crate::AUDIT_BATCH
        };
        if full {
            plan.flush_audit(host);
        }
    }
}

/// What a 503 says when a credential cannot be verified now.
const CANNOT_VERIFY_NOW: &str = "the credential cannot be verified right now; retry later";

/// Takes one token from the bucket at `key` with `take` (the next entry,
/// or `None`: empty); false when empty, or when every CAS race was lost
/// (as if empty: never open).
fn take_from(
    host: &mut impl StreamHost,
    key: &str,
    mut take: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
) -> bool {
    host.shared_update_if(key, |current| match take(current) {
        Some(next) => (Some(next), true),
        None => (None, false),
    })
    .unwrap_or(false)
}

impl Drop for Stream {
    fn drop(&mut self) {
        // A request gone while its JWKS fetch is out gives its slot back.
        if self.jwks_wait.take().is_some() {
            self.plan.jwks_fetches.finished(true, 0);
        }
    }
}

/// Routing and exposure counting on the recording fake: each test drives
/// one request (or a few) through the configured stage and checks what it
/// did to the host.
#[cfg(test)]
mod tests {
    use serde_json::{Value, json};
    use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
    use zerolayer_core::auth::escalation::{ESCALATED_KEY, EscalatedTenants};
    use zerolayer_core::auth::exposure::ENQUEUED_KEY;
    use zerolayer_core::auth::verdict::{self, Lookup, Verdict};
    use zerolayer_core::event::Job;
    use zerolayer_host::{Action, FakeHost, Host, Platform};
    use zerolayer_observer::auth::VERIFIER_DOWN_KEY;

    use crate::testkit::{
        NOW, api_keys, claims, configured, counter, ec_key, host_with_observer, identity, jobs,
        jwk, jwt, jwts, request,
    };

    /// The default `verdict_slots` and `verdict_ways`.
    const SLOTS: u32 = 65_536;
    const WAYS: u32 = 4;

    fn outcome(name: &str) -> String {
        format!("zerolayer_auth_decisions_outcome={name}")
    }

    fn sync_reason(name: &str) -> String {
        format!("zerolayer_auth_sync_reason={name}")
    }

    /// Stores `verdict` in shared data the way the observer does.
    fn store(host: &mut FakeHost, verdict: &Verdict) {
        let key = verdict::key(&TokenHash(verdict.hash), SLOTS);
        let entry = host.shared_value(&key).map(<[u8]>::to_vec);
        let set = verdict::insert(entry.as_deref(), verdict, NOW, WAYS);
        assert!(host.shared_put(&key, &set));
    }

    /// The verdict stored for `credential`.
    fn stored(host: &FakeHost, credential: &str) -> Lookup {
        let hash = TokenHash::credential(CredentialKind::ApiKey, credential.as_bytes());
        verdict::lookup(host.shared_value(&verdict::key(&hash, SLOTS)), &hash, NOW)
    }

    fn verify_jobs(host: &FakeHost) -> Vec<zerolayer_core::event::VerifyJob> {
        jobs(host)
            .into_iter()
            .filter_map(|job| match job {
                Job::Verify(v) => Some(v),
                _ => None,
            })
            .collect()
    }

    fn json_body(host: &FakeHost) -> Value {
        serde_json::from_slice(&host.sent[0].body).expect("a JSON body")
    }

    #[test]
    fn a_public_path_needs_no_credential_and_publishes_public() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({"public_paths": ["/healthz"]})));
        let (_, action) = request(&root, &mut host, &[(":path", "/healthz/live")]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
        assert_eq!(identity(&host).as_deref(), Some("public"));
        assert_eq!(counter(&mut root, &mut host, &outcome("public")), 1);
    }

    #[test]
    fn a_missing_credential_is_refused_with_a_401_json_error() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let (_, action) = request(&root, &mut host, &[]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(
            host.sent[0].header("content-type"),
            Some("application/json")
        );
        // Anthropic's error object on its path, and no retry: the SDKs
        // would send the same request again otherwise.
        assert_eq!(
            json_body(&host),
            json!({"type": "error", "error": {"type": "authentication_error", "message": "missing credential"}})
        );
        assert_eq!(host.sent[0].header("x-should-retry"), Some("false"));
        assert_eq!(identity(&host), None);
        assert_eq!(counter(&mut root, &mut host, &outcome("missing")), 1);
    }

    #[test]
    fn an_oversized_credential_is_refused_431_before_anything_is_counted_or_queued() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({"max_credential_bytes": 64})));
        let key = "k".repeat(65);
        let (_, action) = request(&root, &mut host, &[("x-api-key", &key)]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 431);
        assert!(host.sent[0].text().contains("longer than 64 bytes"));
        // No exposure count, budget, verdict or job: shared data untouched.
        assert!(host.shared.is_empty(), "{:?}", host.shared.keys());
        assert!(jobs(&host).is_empty());
        assert!(host.dispatched.is_empty());
        assert_eq!(counter(&mut root, &mut host, &outcome("too_long")), 1);
    }

    #[test]
    fn a_credential_of_exactly_the_limit_is_read() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &api_keys(json!({"max_credential_bytes": 64})));
        let key = "k".repeat(64);
        let (_, action) = request(&root, &mut host, &[("x-api-key", &key)]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
        assert_eq!(verify_jobs(&host).len(), 1);
    }

    #[test]
    fn a_cached_valid_verdict_continues_as_its_tenant() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-live-1");
        store(
            &mut host,
            &Verdict::valid(
                &hash,
                NOW,
                None,
                300,
                Some("acme".into()),
                Some("svc-1".into()),
            ),
        );
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
        assert_eq!(
            identity(&host).as_deref(),
            Some("verified tenant=acme subject=svc-1")
        );
        // The hot path: no job, no callout.
        assert!(jobs(&host).is_empty());
        assert!(host.dispatched.is_empty());
        assert_eq!(counter(&mut root, &mut host, &outcome("valid_cached")), 1);
    }

    #[test]
    fn a_cached_invalid_verdict_is_refused_with_401() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-revoked");
        store(&mut host, &Verdict::invalid(&hash, NOW, 60, "revoked"));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-revoked")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(
            json_body(&host)["error"]["message"],
            json!("invalid credential")
        );
        assert_eq!(identity(&host), None);
        assert!(jobs(&host).is_empty());
        assert_eq!(counter(&mut root, &mut host, &outcome("invalid_cached")), 1);
    }

    #[test]
    fn a_cached_verdict_decides_before_escalation_policy_and_verifier_health() {
        let mut host = host_with_observer();
        let config = api_keys(json!({"unknown": "sync", "on_verifier_down": "deny"}));
        let mut root = configured(&mut host, &config);
        let escalated = EscalatedTenants {
            gateway: true,
            ..EscalatedTenants::default()
        };
        assert!(host.shared_put(ESCALATED_KEY, &escalated.encode()));
        verifier_down(&mut host);
        let valid = TokenHash::credential(CredentialKind::ApiKey, b"sk-live-1");
        store(
            &mut host,
            &Verdict::valid(&valid, NOW, None, 300, Some("acme".into()), None),
        );
        let revoked = TokenHash::credential(CredentialKind::ApiKey, b"sk-revoked");
        store(&mut host, &Verdict::invalid(&revoked, NOW, 60, "revoked"));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-revoked")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 401, "not the verifier-down 503");
        assert!(host.dispatched.is_empty());
        assert_eq!(counter(&mut root, &mut host, &outcome("valid_cached")), 1);
        assert_eq!(host.metric(&outcome("invalid_cached")), Some(1));
        assert_eq!(host.metric(&outcome("unavailable")), Some(0));
    }

    #[test]
    fn an_expired_verdict_reads_as_unknown() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &api_keys(json!({})));
        let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-old");
        let mut old = Verdict::valid(&hash, NOW - 400, None, 300, Some("acme".into()), None);
        old.expires_at = NOW;
        store(&mut host, &old);
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-old")]);
        assert_eq!(action, Action::Continue);
        assert_eq!(identity(&host).as_deref(), Some("unverified"));
        assert_eq!(verify_jobs(&host).len(), 1);
    }

    #[test]
    fn an_unknown_credential_is_admitted_lazily_with_a_verify_job() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
        assert!(host.dispatched.is_empty());
        assert_eq!(identity(&host).as_deref(), Some("unverified"));
        let jobs = verify_jobs(&host);
        assert_eq!(jobs.len(), 1);
        assert_eq!(
            jobs[0].hash,
            TokenHash::credential(CredentialKind::ApiKey, b"sk-new").0
        );
        assert_eq!(jobs[0].credential, b"sk-new");
        assert_eq!(jobs[0].enqueued_at_ms, NOW * 1000);
        // The pending count the observer's FINISHED_KEY is compared with.
        assert_eq!(host.shared_value(ENQUEUED_KEY), Some(&b"1"[..]));
        assert_eq!(
            counter(&mut root, &mut host, "zerolayer_auth_jobs_enqueued"),
            1
        );
        assert_eq!(host.metric(&outcome("lazy")), Some(1));
    }

    #[test]
    fn an_unverified_jwt_publishes_its_claimed_tenant_as_unverified() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &jwts(json!({})));
        // Signed by nobody configured: lazily admitted, the claim kept as a claim.
        let token = jwt(&ec_key(9), "nobody", claims("mallory"));
        let bearer = format!("Bearer {token}");
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Continue);
        assert_eq!(
            identity(&host).as_deref(),
            Some("unverified tenant=mallory")
        );
        let jobs = verify_jobs(&host);
        assert_eq!(jobs[0].tenant_hint.as_deref(), Some("mallory"));
        assert_eq!(jobs[0].credential, token.as_bytes());
    }

    #[test]
    fn the_same_unknown_token_past_its_exposure_bound_is_verified_synchronously() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({"max_unverified_per_token": 2})));
        for _ in 0..2 {
            let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-reused")]);
            assert_eq!(action, Action::Continue);
        }
        assert!(host.dispatched.is_empty());
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-reused")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(
            host.dispatched.len(),
            1,
            "the third request is introspected"
        );
        assert_eq!(verify_jobs(&host).len(), 2);
        assert_eq!(
            counter(&mut root, &mut host, &sync_reason("exposure_bound")),
            1
        );
        assert_eq!(host.metric(&outcome("lazy")), Some(2));
    }

    #[test]
    fn fresh_tokens_from_many_addresses_are_bounded_by_the_gateway_budget() {
        let mut host = host_with_observer();
        let big = json!({"per_sec": 0, "burst": 1000});
        let mut root = configured(
            &mut host,
            &api_keys(json!({"lazy_budget": {
                "gateway": {"per_sec": 0, "burst": 3},
                "per_tenant": big,
                "per_client": big,
            }})),
        );
        // The attacker: a new credential per request, each from its own address.
        let mut lazy = 0;
        for i in 0..10 {
            host.properties.insert(
                "source.address".into(),
                format!("10.0.0.{i}:4000").into_bytes(),
            );
            let key = format!("sk-spray-{i}");
            let (_, action) = request(&root, &mut host, &[("x-api-key", &key)]);
            if action == Action::Continue {
                lazy += 1;
            }
        }
        assert_eq!(lazy, 3);
        assert_eq!(verify_jobs(&host).len(), 3);
        assert_eq!(host.dispatched.len(), 7, "the rest wait for introspection");
        assert_eq!(
            counter(&mut root, &mut host, &sync_reason("lazy_budget")),
            7
        );
    }

    #[test]
    fn fresh_tokens_from_one_client_are_bounded_by_the_default_budget() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &api_keys(json!({})));
        host.properties
            .insert("source.address".into(), b"192.0.2.7:5000".to_vec());
        let admitted = (0..100)
            .filter(|i| {
                let key = format!("sk-spray-{i}");
                request(&root, &mut host, &[("x-api-key", &key)]).1 == Action::Continue
            })
            .count();
        // The per-client (and no-tenant) bucket's burst of 20, the clock standing still.
        assert_eq!(admitted, 20);
        assert_eq!(verify_jobs(&host).len(), 20);
    }

    #[test]
    fn too_many_pending_verifications_send_new_tokens_synchronous() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({"max_pending": 2})));
        for key in ["sk-a", "sk-b"] {
            assert_eq!(
                request(&root, &mut host, &[("x-api-key", key)]).1,
                Action::Continue
            );
        }
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-c")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.dispatched.len(), 1);
        assert_eq!(
            counter(&mut root, &mut host, &sync_reason("pending_bound")),
            1
        );
    }

    #[test]
    fn an_escalated_tenant_is_verified_synchronously() {
        let mut host = host_with_observer();
        let key = ec_key(1);
        let mut root = configured(
            &mut host,
            &jwts(json!({"jwt": {"keys": [jwk(&key, "k1")]}})),
        );
        let escalated = EscalatedTenants {
            tenants: vec!["acme".into()],
            ..EscalatedTenants::default()
        };
        assert!(host.shared_put(ESCALATED_KEY, &escalated.encode()));
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("acme")));
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Continue);
        // Verified inline, not admitted unverified: no Verify job, an Outcome.
        assert_eq!(
            identity(&host).as_deref(),
            Some("verified tenant=acme subject=user-1")
        );
        assert!(verify_jobs(&host).is_empty());
        assert!(matches!(
            jobs(&host).as_slice(),
            [Job::Outcome(o)] if o.tenant == "acme" && !o.failed
        ));
        assert_eq!(counter(&mut root, &mut host, &sync_reason("escalated")), 1);
        assert_eq!(host.metric(&outcome("sync_valid")), Some(1));
    }

    #[test]
    fn a_tenant_not_escalated_stays_lazy() {
        let mut host = host_with_observer();
        let key = ec_key(1);
        let root = configured(
            &mut host,
            &jwts(json!({"jwt": {"keys": [jwk(&key, "k1")]}})),
        );
        let escalated = EscalatedTenants {
            tenants: vec!["acme".into()],
            ..EscalatedTenants::default()
        };
        assert!(host.shared_put(ESCALATED_KEY, &escalated.encode()));
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("globex")));
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Continue);
        assert_eq!(identity(&host).as_deref(), Some("unverified tenant=globex"));
        assert_eq!(verify_jobs(&host).len(), 1);
    }

    #[test]
    fn an_escalated_forged_jwt_is_refused_inline() {
        let mut host = host_with_observer();
        let mut root = configured(
            &mut host,
            &jwts(json!({"jwt": {"keys": [jwk(&ec_key(1), "k1")]}})),
        );
        let escalated = EscalatedTenants {
            tenants: vec!["acme".into()],
            ..EscalatedTenants::default()
        };
        assert!(host.shared_put(ESCALATED_KEY, &escalated.encode()));
        // Claims the escalated tenant, signed by another key under the right kid.
        let bearer = format!("Bearer {}", jwt(&ec_key(2), "k1", claims("acme")));
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 401);
        assert!(verify_jobs(&host).is_empty());
        assert!(matches!(
            jobs(&host).as_slice(),
            [Job::Outcome(o)] if o.tenant == "acme" && o.failed
        ));
        assert_eq!(counter(&mut root, &mut host, &outcome("sync_invalid")), 1);
    }

    #[test]
    fn a_trusted_client_is_verified_inline() {
        let mut host = host_with_observer();
        let key = ec_key(1);
        let mut root = configured(
            &mut host,
            &jwts(json!({
                "jwt": {"keys": [jwk(&key, "k1")]},
                "trusted_clients": [{"user_agent": "^batch-runner/"}],
            })),
        );
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("acme")));
        let (_, action) = request(
            &root,
            &mut host,
            &[
                ("authorization", &bearer),
                ("user-agent", "batch-runner/2.1"),
            ],
        );
        assert_eq!(action, Action::Continue);
        assert!(identity(&host).unwrap().starts_with("verified tenant=acme"));
        assert!(verify_jobs(&host).is_empty());
        assert_eq!(
            counter(&mut root, &mut host, &sync_reason("trusted_client")),
            1
        );
    }

    fn verifier_down(host: &mut FakeHost) {
        assert!(host.shared_put(VERIFIER_DOWN_KEY, (NOW + 60).to_string().as_bytes()));
    }

    #[test]
    fn a_down_verifier_refuses_unknown_credentials_503_when_the_policy_denies() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &api_keys(json!({"on_verifier_down": "deny"})));
        verifier_down(&mut host);
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 503);
        assert!(verify_jobs(&host).is_empty());
        assert!(host.dispatched.is_empty());
        assert_eq!(counter(&mut root, &mut host, &outcome("unavailable")), 1);
    }

    #[test]
    fn a_down_verifier_admits_lazily_within_the_bound_then_refuses() {
        let mut host = host_with_observer();
        let root = configured(
            &mut host,
            &api_keys(json!({"on_verifier_down": "allow_lazy"})),
        );
        verifier_down(&mut host);
        let (_, first) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(first, Action::Continue);
        // Past the bound the key would be introspected, but the verifier is down.
        let (_, second) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(second, Action::Pause);
        assert_eq!(host.sent[0].status, 503);
        assert!(host.dispatched.is_empty());
    }

    #[test]
    fn a_verifier_down_mark_in_the_past_is_ignored() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &api_keys(json!({"on_verifier_down": "deny"})));
        assert!(host.shared_put(VERIFIER_DOWN_KEY, NOW.to_string().as_bytes()));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(action, Action::Continue);
        assert!(host.sent.is_empty());
    }

    /// `unknown: sync`: every unknown API key is introspected on the path.
    fn sync_api_keys() -> String {
        api_keys(json!({"unknown": "sync"}))
    }

    #[test]
    fn a_synchronous_api_key_check_dispatches_the_key_and_pauses() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &sync_api_keys());
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Pause);
        assert!(host.sent.is_empty());
        let call = host.last_dispatched().expect("an introspection callout");
        assert_eq!(call.cluster, "keys");
        assert_eq!(call.header(":method"), Some("GET"));
        assert_eq!(call.header(":path"), Some("/introspect"));
        assert_eq!(call.header("x-api-key"), Some("sk-live-1"));
        assert!(verify_jobs(&host).is_empty());
        assert_eq!(counter(&mut root, &mut host, &sync_reason("policy")), 1);
    }

    /// JWTs checked on the path (`unknown: sync`), keys from a JWKS
    /// endpoint the observer has not fetched yet (a restart or reload).
    fn jwks_not_fetched_yet() -> String {
        jwts(json!({"unknown": "sync", "jwt": {"jwks": {"cluster": "idp", "path": "/jwks.json"}}}))
    }

    #[test]
    fn with_no_key_at_hand_a_jwt_waits_for_the_jwks_it_fetches_instead_of_a_503() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &jwks_not_fetched_yet());
        let key = ec_key(3);
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("acme")));
        let (mut stream, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Pause);
        let fetch = host.last_dispatched().expect("a JWKS fetch").clone();
        assert_eq!(fetch.cluster, "idp");
        let jwks = json!({"keys": [jwk(&key, "k1")]}).to_string();
        host.answer_with(Some(200), jwks.as_bytes());
        stream.call_answered(&mut host, fetch.token, jwks.len());
        assert!(host.sent.is_empty(), "not refused: {:?}", host.sent);
        assert_eq!(host.resumes.len(), 1);
        assert_eq!(
            identity(&host).as_deref(),
            Some("verified tenant=acme subject=user-1")
        );
        assert_eq!(counter(&mut root, &mut host, &outcome("sync_valid")), 1);
        // Kept for every request: the next JWT verifies inline, no fetch.
        assert_eq!(
            host.shared_value(zerolayer_observer::auth::JWKS_KEY),
            Some(jwks.as_bytes())
        );
        let other = format!("Bearer {}", jwt(&key, "k1", claims("globex")));
        let (_, action) = request(&root, &mut host, &[("authorization", &other)]);
        assert_eq!(action, Action::Continue);
        assert_eq!(host.dispatched.len(), 1);
    }

    #[test]
    fn request_jwks_fetches_are_bounded_per_vm_and_pause_after_a_failure() {
        use crate::inline::{MAX_REQUEST_JWKS_FETCHES, REQUEST_JWKS_RETRY_MS};
        let mut host = host_with_observer();
        let root = configured(&mut host, &jwks_not_fetched_yet());
        let key = ec_key(3);
        // Fresh JWTs, as a sprayer mints them: only so many fetches at once.
        let mut waiting = Vec::new();
        for n in 0..MAX_REQUEST_JWKS_FETCHES + 3 {
            let bearer = format!("Bearer {}", jwt(&key, "k1", claims(&format!("t{n}"))));
            let (stream, action) = request(&root, &mut host, &[("authorization", &bearer)]);
            waiting.push((stream, action));
        }
        assert_eq!(host.dispatched.len() as u32, MAX_REQUEST_JWKS_FETCHES);
        assert_eq!(host.sent.len(), 3, "the rest refused 503 at once");
        assert!(host.sent.iter().all(|s| s.status == 503));
        // A request gone gives its slot back; a failed answer closes
        // fetching for a while: 503 without a call.
        waiting.truncate(MAX_REQUEST_JWKS_FETCHES as usize);
        let (mut first, _) = waiting.remove(0);
        let token = host.dispatched[0].token;
        host.answer_with(Some(500), b"");
        first.call_answered(&mut host, token, 0);
        assert_eq!(host.sent.len(), 4);
        drop(waiting);
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("late")));
        let _ = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(host.dispatched.len() as u32, MAX_REQUEST_JWKS_FETCHES);
        assert_eq!(host.sent.len(), 5);
        host.advance(std::time::Duration::from_millis(REQUEST_JWKS_RETRY_MS));
        let _ = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(
            host.dispatched.len() as u32,
            MAX_REQUEST_JWKS_FETCHES + 1,
            "open again, every slot free"
        );
    }

    #[test]
    fn a_valid_introspection_answer_resumes_and_stores_the_verdict() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        let token = host.last_dispatched().unwrap().token;
        let body = br#"{"active":true,"tenant":"acme","sub":"svc-1"}"#;
        host.answer_with(Some(200), body);
        stream.call_answered(&mut host, token, body.len());
        assert_eq!(host.resumes.len(), 1);
        assert!(host.sent.is_empty());
        assert_eq!(
            identity(&host).as_deref(),
            Some("verified tenant=acme subject=svc-1")
        );
        match stored(&host, "sk-live-1") {
            Lookup::Valid(v) => assert_eq!(v.tenant.as_deref(), Some("acme")),
            other => panic!("no valid verdict stored: {other:?}"),
        }
        assert_eq!(counter(&mut root, &mut host, &outcome("sync_valid")), 1);
        // The next request is a cache hit: no second callout.
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Continue);
        assert_eq!(host.dispatched.len(), 1);
    }

    #[test]
    fn one_client_spends_its_own_verify_budget_then_gets_429_without_a_call() {
        let mut host = host_with_observer();
        let config = api_keys(json!({
            "unknown": "sync",
            "verify_budget": {"per_client": {"per_sec": 0, "burst": 2}, "gateway": {"per_sec": 0, "burst": 4}, "reserve": 1},
        }));
        let mut root = configured(&mut host, &config);
        let send = |host: &mut FakeHost, key: &str, address: &str| {
            host.properties
                .insert("source.address".into(), address.as_bytes().to_vec());
            let (_, action) = request(&root, host, &[("x-api-key", key)]);
            action
        };
        // The sprayer: its own 2, then 429, no callout.
        assert_eq!(send(&mut host, "sk-1", "10.0.0.9:1"), Action::Pause);
        assert_eq!(send(&mut host, "sk-2", "10.0.0.9:2"), Action::Pause);
        assert_eq!(send(&mut host, "sk-3", "10.0.0.9:3"), Action::Pause);
        assert_eq!(host.dispatched.len(), 2);
        let refusal = host.sent.last().unwrap();
        assert_eq!(refusal.status, 429);
        assert_eq!(refusal.header("retry-after"), Some("60"));
        assert_eq!(refusal.header("x-should-retry"), Some("true"));
        // A second sprayer spends the gateway's bucket down to its reserve
        // after its first call (its bucket was full for that one)...
        assert_eq!(send(&mut host, "sk-4", "10.0.0.8:1"), Action::Pause);
        assert_eq!(send(&mut host, "sk-5", "10.0.0.8:1"), Action::Pause);
        assert_eq!(host.dispatched.len(), 3);
        // ...which a client that has not sprayed still gets.
        assert_eq!(send(&mut host, "sk-6", "10.0.0.7:1"), Action::Pause);
        assert_eq!(host.dispatched.len(), 4);
        assert_eq!(
            counter(&mut root, &mut host, &outcome("over_verify_budget")),
            2
        );
    }

    #[test]
    fn the_verifiers_429_holds_every_synchronous_check_until_its_retry_after() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(Some(429), b"slow down");
        host.answer.retry_after_secs = Some(7);
        stream.call_answered(&mut host, token, 9);
        let reply = &host.sent[0];
        assert_eq!(
            (reply.status, reply.header("retry-after")),
            (503, Some("7"))
        );
        // Nothing stored: the credential is not at fault.
        assert_eq!(stored(&host, "sk-live-1"), Lookup::Unknown);
        // Another key within the wait: 503, the verifier not called.
        host.advance(std::time::Duration::from_secs(3));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-2")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.dispatched.len(), 1);
        assert_eq!(host.sent[1].header("retry-after"), Some("4"));
        assert_eq!(
            counter(&mut root, &mut host, &outcome("verifier_throttled")),
            2
        );
        // After it, the verifier is called again.
        host.advance(std::time::Duration::from_secs(5));
        request(&root, &mut host, &[("x-api-key", "sk-live-3")]);
        assert_eq!(host.dispatched.len(), 2);
    }

    #[test]
    fn ngx_wasm_module_checks_a_request_with_a_body_from_its_body_step() {
        let mut host = host_with_observer();
        host.platform = zerolayer_host::Platform::NgxWasm;
        let root = configured(&mut host, &sync_api_keys());
        let headers = [("x-api-key", "sk-live-1"), ("content-length", "2")];
        let (mut stream, action) = request(&root, &mut host, &headers);
        // Nothing is decided yet, and nothing goes upstream before the
        // body step, which nginx runs before it contacts the upstream.
        assert_eq!(action, Action::Continue);
        assert!(host.dispatched.is_empty());
        assert_eq!(identity(&host), None);
        host.request_body = b"{}".to_vec();
        assert_eq!(stream.request_body(&mut host, 2, true), Action::Pause);
        let token = host
            .last_dispatched()
            .expect("the check, from the body step")
            .token;
        // Said, so the filters after it leave the body as it is (this host
        // would cut one they replaced).
        assert_eq!(
            host.properties
                .get(zerolayer_core::internal::BODY_WAITED_PROPERTY),
            Some(&b"1".to_vec())
        );
        host.answer_with(Some(200), br#"{"active":false}"#);
        stream.call_answered(&mut host, token, 16);
        assert_eq!(host.sent[0].status, 401, "refused from the answer");
    }

    #[test]
    fn ngx_wasm_module_checks_a_chunked_request_from_its_body_step() {
        let mut host = host_with_observer();
        host.platform = zerolayer_host::Platform::NgxWasm;
        let root = configured(&mut host, &sync_api_keys());
        let headers = [("x-api-key", "sk-live-1"), ("transfer-encoding", "chunked")];
        let (mut stream, action) = request(&root, &mut host, &headers);
        // No content-length, but a body: the check waits for the body step.
        assert_eq!(action, Action::Continue);
        assert!(host.dispatched.is_empty());
        host.request_body = b"{}".to_vec();
        assert_eq!(stream.request_body(&mut host, 2, true), Action::Pause);
        assert!(
            host.last_dispatched().is_some(),
            "the check, from the body step"
        );
    }

    #[test]
    fn an_answer_to_another_callout_is_ignored() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(Some(200), br#"{"active":true}"#);
        stream.call_answered(&mut host, token + 1, 15);
        assert!(host.resumes.is_empty());
        assert_eq!(stored(&host, "sk-live-1"), Lookup::Unknown);
        assert_eq!(identity(&host), None);
    }

    #[test]
    fn a_failed_introspection_is_refused_503_and_stores_nothing() {
        let mut host = host_with_observer();
        let mut root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(None, b"");
        stream.call_answered(&mut host, token, 0);
        assert!(host.resumes.is_empty());
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 503);
        assert_eq!(stored(&host, "sk-live-1"), Lookup::Unknown);
        assert_eq!(counter(&mut root, &mut host, &outcome("unavailable")), 1);
    }

    #[test]
    fn an_inactive_key_is_refused_401_and_its_verdict_stored() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-dead")]);
        let token = host.last_dispatched().unwrap().token;
        let body = br#"{"active":false}"#;
        host.answer_with(Some(200), body);
        stream.call_answered(&mut host, token, body.len());
        assert!(host.resumes.is_empty());
        assert_eq!(host.sent[0].status, 401);
        assert!(matches!(stored(&host, "sk-dead"), Lookup::Invalid(v) if v.reason == "inactive"));
    }

    #[test]
    fn in_ngx_wasm_module_a_refusal_from_the_answer_closes_the_connection() {
        let mut host = host_with_observer();
        host.platform = Platform::NgxWasm;
        let root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-dead")]);
        let token = host.last_dispatched().unwrap().token;
        let body = br#"{"active":false}"#;
        host.answer_with(Some(200), body);
        stream.call_answered(&mut host, token, body.len());
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(host.sent[0].header("connection"), Some("close"));
    }

    #[test]
    fn in_envoy_a_refusal_from_the_answer_keeps_the_connection() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &sync_api_keys());
        let (mut stream, _) = request(&root, &mut host, &[("x-api-key", "sk-dead")]);
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(Some(403), b"");
        stream.call_answered(&mut host, token, 0);
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(host.sent[0].header("connection"), None);
    }

    #[test]
    fn in_ngx_wasm_module_a_refusal_on_the_headers_keeps_the_connection() {
        let mut host = host_with_observer();
        host.platform = Platform::NgxWasm;
        let root = configured(&mut host, &api_keys(json!({})));
        request(&root, &mut host, &[]);
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(host.sent[0].header("connection"), None);
    }

    #[test]
    fn an_unreachable_introspection_cluster_is_refused_503() {
        let mut host = host_with_observer();
        host.refuse_dispatch = true;
        let root = configured(&mut host, &sync_api_keys());
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-live-1")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 503);
    }

    #[test]
    fn without_an_observer_queue_an_unknown_key_is_verified_now() {
        // No observer registered the queue.
        let mut host = FakeHost::default();
        let mut root = configured(&mut host, &api_keys(json!({})));
        let (_, action) = request(&root, &mut host, &[("x-api-key", "sk-new")]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.dispatched.len(), 1, "introspected instead of admitted");
        assert_eq!(identity(&host), None);
        assert_eq!(counter(&mut root, &mut host, "zerolayer_auth_jobs_lost"), 1);
        assert_eq!(host.metric(&sync_reason("pending_bound")), Some(1));
        assert_eq!(host.metric(&outcome("lazy")), Some(0));
    }

    #[test]
    fn without_an_observer_queue_a_forged_jwt_is_refused_not_admitted() {
        let mut host = FakeHost::default();
        let root = configured(
            &mut host,
            &jwts(json!({"jwt": {"keys": [jwk(&ec_key(1), "k1")]}})),
        );
        let bearer = format!("Bearer {}", jwt(&ec_key(2), "k1", claims("acme")));
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 401);
        assert_eq!(identity(&host), None);
    }

    #[test]
    fn a_full_observer_queue_verifies_now() {
        let mut host = host_with_observer();
        host.refuse_enqueue = true;
        let key = ec_key(1);
        let root = configured(
            &mut host,
            &jwts(json!({"jwt": {"keys": [jwk(&key, "k1")]}})),
        );
        let bearer = format!("Bearer {}", jwt(&key, "k1", claims("acme")));
        let (_, action) = request(&root, &mut host, &[("authorization", &bearer)]);
        assert_eq!(action, Action::Continue);
        assert!(identity(&host).unwrap().starts_with("verified tenant=acme"));
    }
}
