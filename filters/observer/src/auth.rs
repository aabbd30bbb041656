//! Off-path verification: JWTs with configured and JWKS keys, API keys by
//! introspection; verdicts into shared data; escalation windows; the
//! verifier breaker.

use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
use zerolayer_core::auth::escalation::{ESCALATED_KEY, Escalation, Flip};
use zerolayer_core::auth::exposure::FINISHED_KEY;
use zerolayer_core::auth::introspection;
use zerolayer_core::auth::jwt::{self, KeySet, Validation, VerifyingKey};
use zerolayer_core::auth::verdict::{self, Verdict};
use zerolayer_core::breaker::{Breaker, Transition};
use zerolayer_core::event::{VerifyJob, VerifyOutcome};
use zerolayer_host::Host;

use crate::calls::{CallKind, Calls, Request};
use crate::metrics::{BreakerFlip, EscalationFlip, FetchOutcome, ObserverMetrics, VerdictOutcome};

/// Shared-data key with the JWKS document last fetched (filters verify
/// inline with it).
pub const JWKS_KEY: &str = "zl:auth:jwks";
/// Shared-data key: Unix second until which the verifier is considered
/// down (`0`: up). Written by the observer's breaker.
pub const VERIFIER_DOWN_KEY: &str = "zl:auth:verifier_down_until";
/// Jobs waiting for keys at most; more are dropped (and counted).
const MAX_DEFERRED: usize = 1000;
/// Seconds before a failed JWKS fetch is retried.
const JWKS_RETRY_SECS: u64 = 5;
/// Least seconds between refetches triggered by an unknown `kid`.
const JWKS_MIN_REFETCH_SECS: u64 = 30;

/// Builds the key set a configuration names (JWKs, and an HS256 secret
/// from the VM's environment). Shared with the filter's inline checks.
pub fn configured_keys(config: &LazyAuthConfig) -> Result<KeySet, String> {
    let mut keys = KeySet::new();
    for (i, jwk) in config.jwt.keys.iter().enumerate() {
        let key = VerifyingKey::from_jwk(jwk).map_err(|e| format!("jwt.keys[{i}]: {e}"))?;
        keys.insert(key);
    }
    if let Some(var) = &config.jwt.hs256_secret_env {
        // The secret comes from the environment Envoy gives the VM; it is
        // never logged (VerifyingKey's Debug redacts it).
        let secret = std::env::var(var)
            .map_err(|_| format!("jwt.hs256_secret_env: environment variable {var} is not set"))?;
        let key = VerifyingKey::from_secret(secret.as_bytes())
            .map_err(|e| format!("jwt.hs256_secret_env: {e}"))?;
        keys.insert(key);
    }
    Ok(keys)
}

/// The validation a configuration asks for.
pub fn validation(config: &LazyAuthConfig) -> Validation {
    Validation {
        issuers: config.jwt.issuers.clone(),
        audiences: config.jwt.audiences.clone(),
        leeway_secs: config.jwt.leeway_secs,
        ..Validation::default()
    }
}

pub(crate) struct AuthWorker {
    config: LazyAuthConfig,
    validation: Validation,
    configured: KeySet,
    keys: KeySet,
    jwks_next: u64,
    jwks_fetched_at: Option<u64>,
    deferred: Vec<VerifyJob>,
    breaker: Breaker,
    escalation: Escalation,
}

impl AuthWorker {
    pub(crate) fn new(config: &LazyAuthConfig) -> Result<AuthWorker, String> {
        let configured = configured_keys(config)?;
        Ok(AuthWorker {
            validation: validation(config),
            keys: configured.clone(),
            configured,
            jwks_next: 0,
            jwks_fetched_at: None,
            deferred: Vec::new(),
            breaker: Breaker::new(config.breaker),
            escalation: Escalation::new(config.escalation),
            config: config.clone(),
        })
    }

    pub(crate) fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Verifies one credential (or starts to: introspection answers later).
    pub(crate) fn verify(
        &mut self,
        host: &mut impl Host,
        job: VerifyJob,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let now = host.now_secs();
        match job.kind {
            CredentialKind::Jwt => self.verify_jwt(host, job, now, calls, counters),
            CredentialKind::ApiKey => self.introspect(host, job, now, calls, counters),
        }
    }

    fn verify_jwt(
        &mut self,
        host: &mut impl Host,
        job: VerifyJob,
        now: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let jwks = self.config.jwt.jwks.is_some();
        if jwks && self.jwks_fetched_at.is_none() {
            // Keys are on their way: verify when they arrive.
            self.defer(host, job, counters);
            self.fetch_jwks(host, now, calls, counters);
            return;
        }
        match jwt::verify(&job.credential, &self.keys, &self.validation, now) {
            Err(jwt::JwtError::UnknownKey(_))
                if jwks
                    && self
                        .jwks_fetched_at
                        .is_some_and(|at| now >= at + JWKS_MIN_REFETCH_SECS) =>
            {
                // Perhaps a key rotation: refetch once, then decide.
                self.defer(host, job, counters);
                self.jwks_next = now;
                self.fetch_jwks(host, now, calls, counters);
            }
            result => {
                let verdict = verdict::of_jwt(&self.config, &TokenHash(job.hash), now, result);
                self.conclude(host, &job, verdict, counters);
            }
        }
    }

    fn invalid(&self, job: &VerifyJob, now: u64, reason: &str) -> Verdict {
        Verdict::invalid(
            &TokenHash(job.hash),
            now,
            self.config.negative_ttl_secs,
            reason,
        )
    }

    fn defer(&mut self, host: &mut impl Host, job: VerifyJob, counters: &ObserverMetrics) {
        if self.deferred.len() < MAX_DEFERRED {
            counters.deferred.add(1);
            self.deferred.push(job);
        } else {
            self.drop_job(host, counters);
        }
    }

    /// A job that cannot be verified now (verifier down, too many waiting):
    /// no verdict is written, the credential stays unknown (its next
    /// requests are bounded by the exposure limits), and it is counted.
    fn drop_job(&self, host: &mut impl Host, counters: &ObserverMetrics) {
        counters.verify_dropped.add(1);
        finish_job(host);
    }

    fn introspect(
        &mut self,
        host: &mut impl Host,
        job: VerifyJob,
        now: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let Some(api) = self.config.api_keys.clone() else {
            let verdict = self.invalid(&job, now, "api_keys_not_configured");
            self.conclude(host, &job, verdict, counters);
            return;
        };
        if !self.breaker.allow(now) {
            self.drop_job(host, counters);
            return;
        }
        let key = job.credential.clone();
        let headers = [(api.key_header.as_str(), key.as_slice())];
        if calls
            .dispatch(
                host,
                Request {
                    headers: &headers,
                    ..Request::to(&api.endpoint, "GET")
                },
                CallKind::Introspect(job),
            )
            .is_err()
        {
            self.failure(host, now, counters);
            self.drop_job(host, counters);
        }
    }

    /// A callout answered (`status` `None`: it failed or timed out).
    pub(crate) fn answered(
        &mut self,
        host: &mut impl Host,
        kind: CallKind,
        status: Option<u16>,
        body: &[u8],
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let now = host.now_secs();
        match kind {
            CallKind::Jwks => self.jwks_answer(host, now, status, body, calls, counters),
            CallKind::Introspect(job) => {
                self.introspection_answer(host, job, now, status, body, counters)
            }
            CallKind::Batch(..) | CallKind::CacheWrite => {}
        }
    }

    fn introspection_answer(
        &mut self,
        host: &mut impl Host,
        job: VerifyJob,
        now: u64,
        status: Option<u16>,
        body: &[u8],
        counters: &ObserverMetrics,
    ) {
        match introspection::verdict(&self.config, &TokenHash(job.hash), now, status, body) {
            Some(verdict) => {
                self.success(host, counters);
                self.conclude(host, &job, verdict, counters);
            }
            None => {
                self.failure(host, now, counters);
                self.drop_job(host, counters);
            }
        }
    }

    fn jwks_answer(
        &mut self,
        host: &mut impl Host,
        now: u64,
        status: Option<u16>,
        body: &[u8],
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let refresh = self
            .config
            .jwt
            .jwks
            .as_ref()
            .map_or(300, |j| j.refresh_secs);
        let parsed = match status {
            Some(200) => KeySet::from_jwks(body).map_err(|e| e.to_string()),
            Some(s) => Err(format!("status {s}")),
            None => Err("no answer".to_string()),
        };
        match parsed {
            Ok(jwks) => {
                for skipped in &jwks.skipped {
                    log::warn!("observer: JWKS entry skipped: {skipped}");
                }
                let mut keys = self.configured.clone();
                keys.merge(jwks.keys);
                if self.jwks_fetched_at.is_none() {
                    // Once: from here on JWTs verify inline.
                    log::info!("observer: JWKS fetched ({} keys)", keys.len());
                }
                self.keys = keys;
                self.jwks_fetched_at = Some(now);
                self.jwks_next = now + refresh;
                counters.jwks.add(FetchOutcome::Ok);
                self.success(host, counters);
                host.shared_put(JWKS_KEY, body);
                for job in std::mem::take(&mut self.deferred) {
                    self.verify_jwt(host, job, now, calls, counters);
                }
            }
            Err(why) => {
                log::warn!("observer: JWKS fetch failed: {why}");
                counters.jwks.add(FetchOutcome::Failed);
                self.failure(host, now, counters);
                self.jwks_next = now + JWKS_RETRY_SECS;
                if self.jwks_fetched_at.is_some() {
                    // Keys from the last good fetch still decide the waiting jobs.
                    for job in std::mem::take(&mut self.deferred) {
                        self.conclude_with_current_keys(host, job, now, counters);
                    }
                }
            }
        }
    }

    fn conclude_with_current_keys(
        &mut self,
        host: &mut impl Host,
        job: VerifyJob,
        now: u64,
        counters: &ObserverMetrics,
    ) {
        let result = jwt::verify(&job.credential, &self.keys, &self.validation, now);
        let verdict = verdict::of_jwt(&self.config, &TokenHash(job.hash), now, result);
        self.conclude(host, &job, verdict, counters);
    }

    fn fetch_jwks(
        &mut self,
        host: &mut impl Host,
        now: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        let Some(jwks) = self.config.jwt.jwks.clone() else {
            return;
        };
        if calls.jwks_in_flight() || now < self.jwks_next && self.jwks_fetched_at.is_some() {
            return;
        }
        if !self.breaker.allow(now) {
            return;
        }
        if calls
            .dispatch(host, Request::to(&jwks.endpoint, "GET"), CallKind::Jwks)
            .is_err()
        {
            counters.jwks.add(FetchOutcome::Failed);
            self.failure(host, now, counters);
            self.jwks_next = now + JWKS_RETRY_SECS;
        }
    }

    /// Writes the verdict, counts it, and feeds the escalation window.
    fn conclude(
        &mut self,
        host: &mut impl Host,
        job: &VerifyJob,
        verdict: Verdict,
        counters: &ObserverMetrics,
    ) {
        let waited = host.now_ms().saturating_sub(job.enqueued_at_ms);
        counters.verify_latency(host, waited);
        let key = verdict::key(&TokenHash(job.hash), self.config.verdict_slots);
        let (now, ways) = (host.now_secs(), self.config.verdict_ways);
        let _ = host.shared_update(&key, |set| (verdict::insert(set, &verdict, now, ways), ()));
        counters.verdicts.add(if verdict.valid {
            VerdictOutcome::Valid
        } else {
            VerdictOutcome::Invalid
        });
        let tenant = verdict.tenant.clone().or_else(|| job.tenant_hint.clone());
        self.record(
            host,
            tenant.as_deref(),
            !verdict.valid,
            verdict.verified_at,
            counters,
        );
        finish_job(host);
    }

    /// A verification a filter did itself.
    pub(crate) fn record_outcome(
        &mut self,
        host: &mut impl Host,
        outcome: &VerifyOutcome,
        counters: &ObserverMetrics,
    ) {
        // An empty tenant is none.
        self.record(
            host,
            Some(&outcome.tenant),
            outcome.failed,
            outcome.at,
            counters,
        );
    }

    fn record(
        &mut self,
        host: &mut impl Host,
        tenant: Option<&str>,
        failed: bool,
        now: u64,
        counters: &ObserverMetrics,
    ) {
        let flips = self.escalation.record(tenant, failed, now);
        self.flipped(host, &flips, counters);
    }

    fn flipped(&self, host: &mut impl Host, flips: &[Flip], counters: &ObserverMetrics) {
        for flip in flips {
            match flip {
                Flip::Escalated(scope) => {
                    log::warn!(
                        "observer: {scope} escalated: its unknown credentials now verify synchronously"
                    );
                    counters.escalations.add(EscalationFlip::Escalated);
                }
                Flip::Relaxed(scope) => {
                    log::info!("observer: {scope} relaxed: back to lazy verification");
                    counters.escalations.add(EscalationFlip::Relaxed);
                }
            }
        }
        if !flips.is_empty() {
            counters.escalated(host, self.escalation.escalated().len());
            host.shared_put(ESCALATED_KEY, &self.escalation.published().encode());
        }
    }

    fn success(&mut self, host: &mut impl Host, counters: &ObserverMetrics) {
        if self.breaker.success() == Some(Transition::Closed) {
            log::info!("observer: verifier breaker closed: the verifier answers again");
            counters.breaker.add(BreakerFlip::Closed);
            host.shared_put(VERIFIER_DOWN_KEY, b"0");
        }
    }

    fn failure(&mut self, host: &mut impl Host, now: u64, counters: &ObserverMetrics) {
        if self.breaker.failure(now) == Some(Transition::Opened) {
            log::warn!(
                "observer: verifier breaker opened after {} failures: no calls for {} s",
                self.config.breaker.failures,
                self.config.breaker.open_secs
            );
            counters.breaker.add(BreakerFlip::Opened);
        }
        if let zerolayer_core::breaker::State::Open { until } = self.breaker.state() {
            host.shared_put(VERIFIER_DOWN_KEY, until.to_string().as_bytes());
        }
    }

    /// Periodic work.
    pub(crate) fn maintain(
        &mut self,
        host: &mut impl Host,
        now: u64,
        calls: &mut Calls,
        counters: &ObserverMetrics,
    ) {
        if self.config.jwt.jwks.is_some() && now >= self.jwks_next {
            self.fetch_jwks(host, now, calls, counters);
        }
        let flips = self.escalation.slide(now);
        self.flipped(host, &flips, counters);
    }
}

/// One verification job less pending (filters compare this with the jobs
/// enqueued to bound what is pending).
fn finish_job(host: &mut impl Host) {
    let _ = host.shared_update(FINISHED_KEY, |current| {
        let next = zerolayer_core::auth::exposure::decode_count(current).saturating_add(1);
        (next.to_string().into_bytes(), ())
    });
}
