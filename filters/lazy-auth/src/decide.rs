//! One request's authentication: read the credential, hash it, read its
//! verdict, route by policy, and act (continue, refuse, admit lazily,
//! verify now).

use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::auth::budget::{self, Scope};
use zerolayer_core::auth::credential::{self, CredentialKind, TokenHash};
use zerolayer_core::auth::escalation::{ESCALATED_KEY, EscalatedTenants};
use zerolayer_core::auth::exposure::{
    self, Bump, ENQUEUED_KEY, FINISHED_KEY, decode_count, pending,
};
use zerolayer_core::auth::identity::Identity;
use zerolayer_core::auth::introspection;
use zerolayer_core::auth::jwt;
use zerolayer_core::auth::policy::{Admission, Route, SyncReason};
use zerolayer_core::auth::verdict::{self, Lookup, Verdict};
use zerolayer_core::event::{AuditRecord, Job, VerifyJob, VerifyOutcome};
use zerolayer_core::internal;
use zerolayer_core::metrics::Label;
use zerolayer_host::{Action, Host};
use zerolayer_observer::auth::VERIFIER_DOWN_KEY;

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

/// One request's state.
pub(crate) struct Stream {
    plan: Rc<Plan>,
    started_us: u64,
    credential: Option<Credential>,
    claimed_tenant: Option<String>,
    /// Outcome and reason, for metrics and the audit record.
    outcome: Option<Outcome>,
    /// This stage answered the request itself (a refusal, a 503).
    answered: bool,
    reason: String,
    tenant: Option<String>,
    verified: bool,
    decided_us: u64,
    /// A synchronous introspection in flight: its callout and why it is synchronous.
    introspection: Option<(u32, SyncReason)>,
    /// Deciding in the introspection's answer (the body may be unread).
    in_answer: bool,
}

impl Stream {
    pub(crate) fn new(plan: Rc<Plan>) -> Stream {
        Stream {
            plan,
            started_us: 0,
            credential: None,
            claimed_tenant: None,
            outcome: None,
            answered: false,
            reason: String::new(),
            tenant: None,
            verified: false,
            decided_us: 0,
            introspection: None,
            in_answer: false,
        }
    }

    pub(crate) fn on_request_headers(&mut self, host: &mut impl Host) -> Action {
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
        let key = verdict::key(&credential.hash, plan.config.verdict_slots);
        let entry = host.shared_get(&key).0.unwrap_or_default();
        let found = verdict::view(&entry, &credential.hash, now);
        self.credential = Some(credential);
        match found {
            Some(v) if v.valid => {
                // The hot path: one header, one hash, one shared-data read,
                // the verdict read in place.
                self.allow_view(host, v.tenant, v.subject, Outcome::ValidCached, "cached");
                return Action::Continue;
            }
            Some(v) => {
                let reason = v.reason.to_string();
                return self.refuse(
                    host,
                    401,
                    Outcome::InvalidCached,
                    &reason,
                    "invalid credential",
                );
            }
            None => {}
        }
        self.unknown(host, now)
    }

    fn read_credential(&self, host: &mut impl Host) -> Read {
        let max = self.plan.config.max_credential_bytes as usize;
        for source in &self.plan.config.credentials {
            let Some(value) = host.request_header(&source.header) else {
                continue;
            };
            if let Some(token) = credential::extract(source, &value) {
                if token.len() > max {
                    return Read::TooLong;
                }
                let hash = match self.plan.recent.try_borrow_mut() {
                    Ok(mut recent) => recent.hash(token),
                    Err(_) => TokenHash::of(token),
                };
                // Keep the token in the header's own buffer (no copy): it is
                // needed only when the verdict is unknown.
                let start = token.as_ptr() as usize - value.as_ptr() as usize;
                let end = start + token.len();
                let mut token = value;
                token.truncate(end);
                token.drain(..start);
                return Read::Found(Credential {
                    kind: source.kind,
                    hash,
                    token,
                });
            }
        }
        Read::Missing
    }

    /// A credential nobody verified yet (or whose verdict expired).
    fn unknown(&mut self, host: &mut impl Host, now: u64) -> Action {
        let plan = self.plan.clone();
        let (kind, hash) = match &self.credential {
            Some(c) => (c.kind, c.hash),
            None => {
                return self.refuse(
                    host,
                    401,
                    Outcome::Missing,
                    "missing_credential",
                    "missing credential",
                );
            }
        };
        if kind == CredentialKind::Jwt {
            // Unverified claims: only for escalation and attribution, never trusted.
            self.claimed_tenant = self.credential.as_ref().and_then(|c| {
                jwt::peek(&c.token).ok().and_then(|u| {
                    u.claims()
                        .get_str(&plan.config.jwt.tenant_claim)
                        .map(str::to_string)
                })
            });
        }
        // A claimed tenant, "no tenant" or the whole gateway may be escalated.
        let escalated = EscalatedTenants::decode(host.shared_get(ESCALATED_KEY).0.as_deref())
            .covers(self.claimed_tenant.as_deref());
        let trusted = !plan.trusted.is_empty()
            && host
                .request_header("user-agent")
                .is_some_and(|ua| plan.trusted.iter().any(|r| r.is_match(&ua)));
        let inline_ok = kind == CredentialKind::Jwt && plan.keys.available(host);
        let verifier_down = decode_count(host.shared_get(VERIFIER_DOWN_KEY).0.as_deref()) > now;
        match plan.policy.route(
            &Lookup::Unknown,
            escalated,
            trusted,
            inline_ok,
            verifier_down,
        ) {
            Route::Sync(reason) => self.verify_now(host, reason, now),
            Route::Unavailable => self.unavailable(host),
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
                match plan
                    .policy
                    .admit(count, waiting, inline_ok, verifier_down, take_budget)
                {
                    Admission::Lazy => self.admit_lazily(host),
                    Admission::Sync(reason) => self.verify_now(host, reason, now),
                    Admission::Unavailable => self.unavailable(host),
                }
            }
            // Cached verdicts were handled before.
            Route::Allow(v) => {
                self.allow(host, &v, Outcome::ValidCached, "cached");
                Action::Continue
            }
            Route::Deny(v) => self.refuse(
                host,
                401,
                Outcome::InvalidCached,
                &v.reason,
                "invalid credential",
            ),
        }
    }

    /// One lazy admission from the client's, the claimed tenant's and the
    /// gateway's buckets, narrowest first (false: one is empty; what the
    /// narrower ones gave is not returned, which only errs towards strict).
    fn take_budget(&self, host: &mut impl Host) -> bool {
        let budget = &self.plan.config.lazy_budget;
        let now_ms = self.started_us / 1000;
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
            host.shared_update_if(&budget::key(scope), |current| {
                match budget::take(current, rate, now_ms) {
                    Some(next) => (Some(next), true),
                    None => (None, false),
                }
            })
            // Lost every CAS race: as if empty (never open).
            .unwrap_or(false)
        })
    }

    /// Continue unverified; the observer verifies off the path.
    fn admit_lazily(&mut self, host: &mut impl Host) -> Action {
        let plan = self.plan.clone();
        let Some(c) = &self.credential else {
            return self.refuse(
                host,
                401,
                Outcome::Missing,
                "missing_credential",
                "missing credential",
            );
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
            return self.verify_now(host, SyncReason::PendingBound, now);
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
    fn verify_now(&mut self, host: &mut impl Host, reason: SyncReason, now: u64) -> Action {
        let plan = self.plan.clone();
        plan.metrics.sync(reason);
        let Some(c) = &self.credential else {
            return self.refuse(
                host,
                401,
                Outcome::Missing,
                "missing_credential",
                "missing credential",
            );
        };
        match c.kind {
            CredentialKind::Jwt => {
                if !plan.keys.available(host) {
                    return self.unavailable(host);
                }
                let result = plan.keys.with(host, |keys| {
                    jwt::verify(&c.token, keys, &plan.validation, now)
                });
                let verdict = verdict::of_jwt(&plan.config, &c.hash, now, result);
                self.concluded(host, verdict, reason)
            }
            CredentialKind::ApiKey => self.introspect(host, reason),
        }
    }

    fn introspect(&mut self, host: &mut impl Host, reason: SyncReason) -> Action {
        let plan = self.plan.clone();
        let (Some(api), Some(c)) = (&plan.config.api_keys, &self.credential) else {
            return self.unavailable(host);
        };
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
                self.introspection = Some((token, reason));
                Action::Pause
            }
            Err(_) => self.unavailable(host),
        }
    }

    /// The introspection endpoint answered a synchronous check.
    pub(crate) fn introspection_answered(
        &mut self,
        host: &mut impl Host,
        token: u32,
        body_size: usize,
    ) {
        let reason = match self.introspection {
            Some((pending, reason)) if pending == token => reason,
            _ => return,
        };
        self.introspection = None;
        let plan = self.plan.clone();
        let Some(hash) = self.credential.as_ref().map(|c| c.hash) else {
            return;
        };
        let now = host.now_secs();
        let answer = host.callout_answer(body_size);
        self.in_answer = true;
        let action =
            match introspection::verdict(&plan.config, &hash, now, answer.status, &answer.body) {
                Some(verdict) => self.concluded(host, verdict, reason),
                // The verifier did not answer: refuse rather than admit.
                None => self.unavailable(host),
            };
        self.in_answer = false;
        if action == Action::Continue {
            host.resume();
        }
    }

    /// A synchronous verdict: store it (so the next request is a cache
    /// hit), report the outcome for escalation, and act on it.
    fn concluded(&mut self, host: &mut impl Host, verdict: Verdict, reason: SyncReason) -> Action {
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
            self.allow(host, &verdict, Outcome::SyncValid, reason.label());
            Action::Continue
        } else {
            let why = verdict.reason.clone();
            self.refuse(host, 401, Outcome::SyncInvalid, &why, "invalid credential")
        }
    }

    fn allow(&mut self, host: &mut impl Host, verdict: &Verdict, outcome: Outcome, reason: &str) {
        self.allow_view(
            host,
            verdict.tenant.as_deref(),
            verdict.subject.as_deref(),
            outcome,
            reason,
        );
    }

    fn allow_view(
        &mut self,
        host: &mut impl Host,
        tenant: Option<&str>,
        subject: Option<&str>,
        outcome: Outcome,
        reason: &str,
    ) {
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
        host: &mut impl Host,
        status: u32,
        outcome: Outcome,
        reason: &str,
        message: &str,
    ) -> Action {
        self.send_refusal(host, status, message);
        self.done(host, outcome, reason, Action::Pause)
    }

    /// Sends a refusal (from an answer: see `send_json_error_before_body`).
    fn send_refusal(&mut self, host: &mut impl Host, status: u32, message: &str) {
        self.answered = true;
        if self.in_answer {
            host.send_json_error_before_body(status, "authentication_error", message);
        } else {
            host.send_json_error(status, "authentication_error", message);
        }
    }

    fn unavailable(&mut self, host: &mut impl Host) -> Action {
        self.send_refusal(
            host,
            503,
            "the credential cannot be verified right now; retry later",
        );
        self.done(
            host,
            Outcome::Unavailable,
            "verifier_unavailable",
            Action::Pause,
        )
    }

    fn done(
        &mut self,
        host: &mut impl Host,
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
    pub(crate) fn on_log(&self, host: &mut impl Host) {
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
                .is_some_and(|list| list.split(|b| *b == b',').any(|o| o == b"audit"));
        if !audited {
            return;
        }
        let record = AuditRecord {
            at_ms: self.started_us / 1000,
            hash_prefix: self
                .credential
                .as_ref()
                .map(|c| c.hash.prefix())
                .unwrap_or_default(),
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
