//! Off-path verification: JWTs with configured and JWKS keys, API keys by
//! introspection; verdicts into shared data; escalation windows; the
//! verifier breaker.

use zerolayer_core::auth::attribution::{AttributionId, AttributionRecord};
use zerolayer_core::auth::budget::{MAX_THROTTLE_SECS, THROTTLED_KEY};
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
use zerolayer_core::auth::escalation::{ESCALATED_KEY, Escalation, Flip};
use zerolayer_core::auth::exposure::{FINISHED_KEY, decode_count};
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
/// Records the verifier's back-pressure (a 429): no introspection, on the
/// request path or off it, calls it for `retry_after` seconds (1 without
/// one, at most [`MAX_THROTTLE_SECS`]); returns the wait in ms.
pub fn throttle(host: &mut impl Host, retry_after: Option<u64>) -> u64 {
    let wait_ms = retry_after.unwrap_or(1).clamp(1, MAX_THROTTLE_SECS) * 1000;
    let until = host.now_us() / 1000 + wait_ms;
    let _ = host.shared_update_if(THROTTLED_KEY, |current| {
        if decode_count(current) >= until {
            (None, ())
        } else {
            (Some(until.to_string().into_bytes()), ())
        }
    });
    wait_ms
}

/// Whether the verifier asked to be left alone until after `now_ms`.
pub fn throttled(host: &mut impl Host, now_ms: u64) -> Option<u64> {
    let until = decode_count(host.shared_get(THROTTLED_KEY).0.as_deref());
    (until > now_ms).then(|| until - now_ms)
}

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
    /// Lazily admitted credentials found valid since the observer last
    /// took them (kept only when an attribution sink is configured).
    attributions: Vec<AttributionRecord>,
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
            attributions: Vec::new(),
            config: config.clone(),
        })
    }

    /// The attribution rows found since the last call, for the sink.
    pub(crate) fn take_attributions(&mut self) -> Vec<AttributionRecord> {
        std::mem::take(&mut self.attributions)
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
        // A breaker open, or the verifier pushing back: the job goes (its
        // credential stays unknown; its next request is checked then).
        let now_ms = host.now_us() / 1000;
        if !self.breaker.allow(now) || throttled(host, now_ms).is_some() {
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
        if introspection::is_back_pressure(status) {
            // Neither the credential's failure nor the verifier's ill health.
            let retry_after = host.callout_retry_after();
            throttle(host, retry_after);
            self.drop_job(host, counters);
            return;
        }
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
        if verdict.valid && self.config.attribution.is_some() {
            // Every job is a lazy admission's: its requests' records may
            // name the credential, waiting for this.
            self.attributions.push(AttributionRecord {
                credential: AttributionId::of(&TokenHash(job.hash)).render(),
                tenant: verdict.tenant.clone(),
                subject: verdict.subject.clone(),
                at_ms: host.now_ms(),
            });
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use hmac::{Hmac, Mac};
    use serde_json::{Value, json};
    use sha2::Sha256;
    use zerolayer_core::auth::attribution::AttributionId;
    use zerolayer_core::auth::credential::{CredentialKind, SourceKind, TokenHash};
    use zerolayer_core::auth::escalation::{ESCALATED_KEY, EscalatedTenants};
    use zerolayer_core::auth::exposure::{FINISHED_KEY, decode_count};
    use zerolayer_core::auth::verdict::{self, Lookup, Verdict};
    use zerolayer_core::event::{Job, VerifyJob, VerifyOutcome};
    use zerolayer_host::{FakeHost, Host};

    use super::{JWKS_KEY, JWKS_RETRY_SECS, MAX_DEFERRED, VERIFIER_DOWN_KEY};
    use crate::{Observer, ObserverConfig};

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const OTHER_SECRET: &[u8] = b"fedcba9876543210fedcba9876543210";
    const JWT_ONLY: &str =
        r#""credentials":[{"header":"authorization","scheme":"Bearer","kind":"jwt"}]"#;
    const JWKS: &str = r#""jwt":{"jwks":{"cluster":"idp","path":"/jwks.json"}}"#;
    const API_KEYS: &str = r#""api_keys":{"cluster":"keys","path":"/introspect"}"#;

    /// An observer for lazy-auth (JWT credentials) with the `fields` given.
    fn observer(host: &mut FakeHost, fields: &str) -> Observer {
        let json = format!(r#"{{"lazy_auth":{{{JWT_ONLY},{fields}}}}}"#);
        let config = ObserverConfig::from_json(json.as_bytes()).unwrap();
        Observer::configure(host, &config, "observer").unwrap()
    }

    fn b64(bytes: impl AsRef<[u8]>) -> String {
        URL_SAFE_NO_PAD.encode(bytes)
    }

    /// An HS256 key as a JWK.
    fn jwk(secret: &[u8], kid: &str) -> Value {
        json!({"kty": "oct", "k": b64(secret), "kid": kid})
    }

    /// An HS256 JWT for tenant `acme`, subject `u1`, valid for an hour.
    fn token(host: &FakeHost, secret: &[u8], kid: &str) -> Vec<u8> {
        let header = json!({"alg": "HS256", "typ": "JWT", "kid": kid});
        let exp = host.clock.as_secs() + 3600;
        let claims = json!({"sub": "u1", "tenant": "acme", "exp": exp});
        let input = format!("{}.{}", b64(header.to_string()), b64(claims.to_string()));
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
        mac.update(input.as_bytes());
        format!("{input}.{}", b64(mac.finalize().into_bytes())).into_bytes()
    }

    /// Posts a verification job for `credential` (no drain).
    fn post(host: &mut FakeHost, observer: &Observer, kind: CredentialKind, credential: &[u8]) {
        let job = Job::Verify(VerifyJob {
            hash: TokenHash::credential(kind, credential).0,
            kind,
            credential: credential.to_vec(),
            tenant_hint: None,
            enqueued_at_ms: host.now_ms(),
        });
        host.enqueue(observer.queue(), &job.encode()).unwrap();
    }

    /// Posts and drains one verification job.
    fn verify(
        host: &mut FakeHost,
        observer: &mut Observer,
        kind: CredentialKind,
        credential: &[u8],
    ) {
        post(host, observer, kind, credential);
        observer.drain(host);
    }

    /// The verdict stored for `credential` (default slots), as the kind
    /// its shape says (these tests' keys are `sk-…`).
    fn stored(host: &FakeHost, credential: &[u8]) -> Lookup {
        let kind = SourceKind::Auto.classify(credential, true);
        let hash = TokenHash::credential(kind, credential);
        let entry = host.shared_value(&verdict::key(&hash, 65_536));
        verdict::lookup(entry, &hash, host.clock.as_secs())
    }

    fn valid(lookup: Lookup) -> Verdict {
        match lookup {
            Lookup::Valid(v) => v,
            other => panic!("expected a valid verdict, got {other:?}"),
        }
    }

    fn invalid_reason(lookup: Lookup) -> String {
        match lookup {
            Lookup::Invalid(v) => v.reason,
            other => panic!("expected an invalid verdict, got {other:?}"),
        }
    }

    fn finished(host: &FakeHost) -> u64 {
        decode_count(host.shared_value(FINISHED_KEY))
    }

    fn counter(host: &mut FakeHost, observer: &Observer, name: &str) -> i64 {
        observer.flush_counters(host);
        host.metric(name).unwrap()
    }

    /// Answers the last callout with `status` and `body`.
    fn answer(host: &mut FakeHost, observer: &mut Observer, status: Option<u16>, body: &[u8]) {
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(status, body);
        assert!(observer.on_http_call_response(host, token, body.len()));
    }

    fn jwks_body(secret: &[u8], kid: &str) -> Vec<u8> {
        json!({"keys": [jwk(secret, kid)]}).to_string().into_bytes()
    }

    #[test]
    fn a_jwt_signed_with_a_configured_key_gets_a_valid_verdict() {
        let mut host = FakeHost::default();
        let keys = format!(r#""jwt":{{"keys":[{}]}}"#, jwk(SECRET, "k1"));
        let mut observer = observer(&mut host, &keys);
        let jwt = token(&host, SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &jwt);
        let verdict = valid(stored(&host, &jwt));
        assert_eq!(verdict.tenant.as_deref(), Some("acme"));
        assert_eq!(verdict.subject.as_deref(), Some("u1"));
        assert_eq!(finished(&host), 1);
        assert_eq!(
            counter(
                &mut host,
                &observer,
                "zerolayer_auth_verdicts_outcome=valid"
            ),
            1
        );
        assert!(
            host.dispatched.is_empty(),
            "configured keys need no callout"
        );
    }

    #[test]
    fn a_lazily_admitted_credential_found_valid_is_attributed_to_its_tenant() {
        let mut host = FakeHost::default();
        let fields = format!(
            r#""jwt":{{"keys":[{}]}},"attribution":{{"cluster":"clickhouse","path":"/attribution","batch_max":2}}"#,
            jwk(SECRET, "k1")
        );
        let mut observer = observer(&mut host, &fields);
        let jwt = token(&host, SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &jwt);
        // A forged one is never attributed: its requests stay unverified.
        let forged = token(&host, OTHER_SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &forged);
        host.advance(Duration::from_secs(1));
        let valid = token(&host, SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &valid);
        // Two valid ones fill the batch of two: shipped.
        let batch = host.last_dispatched().expect("a batch shipped");
        assert_eq!(batch.cluster, "clickhouse");
        let body = String::from_utf8(batch.body.clone().unwrap()).unwrap();
        let rows: Vec<Value> = body
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2, "{body}");
        let id =
            |t: &[u8]| AttributionId::of(&TokenHash::credential(CredentialKind::Jwt, t)).render();
        assert_eq!(rows[0]["credential"], id(&jwt));
        assert_eq!(rows[1]["credential"], id(&valid));
        assert!(
            rows.iter()
                .all(|r| r["tenant"] == "acme" && r["subject"] == "u1")
        );
    }

    #[test]
    fn a_jwt_with_a_bad_signature_gets_an_invalid_verdict() {
        let mut host = FakeHost::default();
        let keys = format!(r#""jwt":{{"keys":[{}]}}"#, jwk(SECRET, "k1"));
        let mut observer = observer(&mut host, &keys);
        let forged = token(&host, OTHER_SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &forged);
        assert_eq!(invalid_reason(stored(&host, &forged)), "bad_signature");
        assert_eq!(finished(&host), 1);
        let invalid = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verdicts_outcome=invalid",
        );
        assert_eq!(invalid, 1);
    }

    #[test]
    fn with_a_jwks_endpoint_the_first_jwt_waits_for_the_keys() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, JWKS);
        let jwt = token(&host, SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &jwt);
        assert_eq!(stored(&host, &jwt), Lookup::Unknown);
        assert_eq!(finished(&host), 0);
        assert_eq!(host.dispatched.len(), 1);
        let fetch = &host.dispatched[0];
        assert_eq!(fetch.cluster, "idp");
        assert_eq!(fetch.header(":method"), Some("GET"));
        assert_eq!(fetch.header(":path"), Some("/jwks.json"));
        let body = jwks_body(SECRET, "k1");
        answer(&mut host, &mut observer, Some(200), &body);
        assert_eq!(valid(stored(&host, &jwt)).tenant.as_deref(), Some("acme"));
        assert_eq!(finished(&host), 1);
        assert_eq!(host.shared_value(JWKS_KEY), Some(&body[..]));
        let deferred = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verifications_deferred",
        );
        assert_eq!(deferred, 1);
        let fetched = counter(
            &mut host,
            &observer,
            "zerolayer_auth_jwks_fetches_outcome=ok",
        );
        assert_eq!(fetched, 1);
    }

    #[test]
    fn a_failed_jwks_fetch_is_retried_after_jwks_retry_secs() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, JWKS);
        let jwt = token(&host, SECRET, "k1");
        verify(&mut host, &mut observer, CredentialKind::Jwt, &jwt);
        answer(&mut host, &mut observer, Some(503), b"");
        assert_eq!(stored(&host, &jwt), Lookup::Unknown, "no keys, no verdict");
        let failed = counter(
            &mut host,
            &observer,
            "zerolayer_auth_jwks_fetches_outcome=failed",
        );
        assert_eq!(failed, 1);
        host.advance(Duration::from_secs(JWKS_RETRY_SECS - 1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 1, "refetched before JWKS_RETRY_SECS");
        host.advance(Duration::from_secs(1));
        observer.on_tick(&mut host);
        assert_eq!(host.dispatched.len(), 2);
        assert_eq!(host.dispatched[1].cluster, "idp");
        answer(
            &mut host,
            &mut observer,
            Some(200),
            &jwks_body(SECRET, "k1"),
        );
        valid(stored(&host, &jwt));
    }

    #[test]
    fn deferred_jobs_past_max_deferred_are_dropped_and_counted() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, JWKS);
        let jwt = token(&host, SECRET, "k1");
        for _ in 0..=MAX_DEFERRED {
            post(&mut host, &observer, CredentialKind::Jwt, &jwt);
        }
        // The drain budget is 1000 jobs a wake-up.
        observer.drain(&mut host);
        observer.drain(&mut host);
        assert_eq!(
            host.dispatched.len(),
            1,
            "one JWKS fetch for every waiting job"
        );
        let deferred = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verifications_deferred",
        );
        assert_eq!(deferred, MAX_DEFERRED as i64);
        let dropped = counter(&mut host, &observer, "zerolayer_auth_verifications_dropped");
        assert_eq!(dropped, 1);
        assert_eq!(finished(&host), 1, "a dropped job is finished");
        answer(
            &mut host,
            &mut observer,
            Some(200),
            &jwks_body(SECRET, "k1"),
        );
        let verdicts = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verdicts_outcome=valid",
        );
        assert_eq!(verdicts, MAX_DEFERRED as i64);
        assert_eq!(finished(&host), MAX_DEFERRED as u64 + 1);
    }

    #[test]
    fn an_api_key_is_introspected_with_its_header_and_the_answer_decides() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, API_KEYS);
        verify(
            &mut host,
            &mut observer,
            CredentialKind::ApiKey,
            b"sk-live-1",
        );
        let call = host.last_dispatched().unwrap();
        assert_eq!(call.cluster, "keys");
        assert_eq!(call.header(":method"), Some("GET"));
        assert_eq!(call.header(":path"), Some("/introspect"));
        assert_eq!(call.header("x-api-key"), Some("sk-live-1"));
        assert_eq!(stored(&host, b"sk-live-1"), Lookup::Unknown);
        assert_eq!(finished(&host), 0);
        let body = br#"{"active":true,"tenant":"acme","sub":"svc"}"#;
        answer(&mut host, &mut observer, Some(200), body);
        let verdict = valid(stored(&host, b"sk-live-1"));
        assert_eq!(verdict.tenant.as_deref(), Some("acme"));
        assert_eq!(verdict.subject.as_deref(), Some("svc"));
        assert_eq!(finished(&host), 1);
    }

    #[test]
    fn an_inactive_api_key_gets_an_invalid_verdict() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, API_KEYS);
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-old");
        answer(&mut host, &mut observer, Some(200), br#"{"active":false}"#);
        assert_eq!(invalid_reason(stored(&host, b"sk-old")), "inactive");
        assert_eq!(finished(&host), 1);
    }

    #[test]
    fn an_api_key_without_an_introspection_endpoint_is_invalid() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, r#""negative_ttl_secs":60"#);
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-1");
        assert!(host.dispatched.is_empty());
        assert_eq!(
            invalid_reason(stored(&host, b"sk-1")),
            "api_keys_not_configured"
        );
    }

    /// An observer whose verifier breaker opened: two introspections failed.
    fn with_verifier_down(host: &mut FakeHost) -> Observer {
        let fields = format!(r#"{API_KEYS},"breaker":{{"failures":2,"open_secs":10}}"#);
        let mut observer = observer(host, &fields);
        for (key, status) in [(&b"sk-1"[..], Some(503)), (b"sk-2", None)] {
            verify(host, &mut observer, CredentialKind::ApiKey, key);
            answer(host, &mut observer, status, b"");
        }
        observer
    }

    #[test]
    fn a_429_is_back_pressure_not_a_failure_and_holds_calls_until_its_retry_after() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, API_KEYS);
        // More 429s than the breaker's failures: it never opens.
        for n in 0..8 {
            let key = format!("sk-{n}");
            verify(
                &mut host,
                &mut observer,
                CredentialKind::ApiKey,
                key.as_bytes(),
            );
            let token = host.last_dispatched().unwrap().token;
            host.answer_with(Some(429), b"");
            host.answer.retry_after_secs = Some(2);
            assert!(observer.on_http_call_response(&mut host, token, 0));
            assert_eq!(stored(&host, key.as_bytes()), Lookup::Unknown);
            // Let the wait pass before the next call.
            host.advance(std::time::Duration::from_secs(3));
        }
        assert_eq!(host.dispatched.len(), 8);
        assert_ne!(
            host.shared_value(VERIFIER_DOWN_KEY).map(|v| v != b"0"),
            Some(true),
            "the breaker opened on back-pressure"
        );
        // Within a wait, no call: the job is dropped.
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-x");
        let token = host.last_dispatched().unwrap().token;
        host.answer_with(Some(429), b"");
        host.answer.retry_after_secs = Some(30);
        assert!(observer.on_http_call_response(&mut host, token, 0));
        host.advance(std::time::Duration::from_secs(10));
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-y");
        assert_eq!(host.dispatched.len(), 9);
        assert_eq!(finished(&host), 10);
    }

    #[test]
    fn the_verifier_breaker_opens_after_failures_and_publishes_until_when() {
        let mut host = FakeHost::default();
        let until = host.clock.as_secs() + 10;
        let mut observer = with_verifier_down(&mut host);
        assert_eq!(
            host.shared_value(VERIFIER_DOWN_KEY),
            Some(until.to_string().as_bytes())
        );
        let opened = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verifier_breaker_flip=opened",
        );
        assert_eq!(opened, 1);
        // While open no call is made: the job is dropped, its credential unknown.
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-3");
        assert_eq!(host.dispatched.len(), 2);
        assert_eq!(stored(&host, b"sk-3"), Lookup::Unknown);
        let dropped = counter(&mut host, &observer, "zerolayer_auth_verifications_dropped");
        assert_eq!(dropped, 3);
        assert_eq!(finished(&host), 3);
    }

    #[test]
    fn the_verifier_breaker_closes_after_a_trial_success_and_writes_0() {
        let mut host = FakeHost::default();
        let mut observer = with_verifier_down(&mut host);
        host.advance(Duration::from_secs(10));
        verify(&mut host, &mut observer, CredentialKind::ApiKey, b"sk-4");
        assert_eq!(host.dispatched.len(), 3, "the trial call");
        answer(&mut host, &mut observer, Some(200), br#"{"active":true}"#);
        assert_eq!(host.shared_value(VERIFIER_DOWN_KEY), Some(&b"0"[..]));
        let closed = counter(
            &mut host,
            &observer,
            "zerolayer_auth_verifier_breaker_flip=closed",
        );
        assert_eq!(closed, 1);
        valid(stored(&host, b"sk-4"));
    }

    const ESCALATION: &str = r#""escalation":{"failure_ratio":0.5,"window_secs":10,"min_verifications":4,"gateway_failure_ratio":1.0}"#;

    fn outcome(host: &mut FakeHost, observer: &mut Observer, tenant: &str, failed: bool) {
        let job = Job::Outcome(VerifyOutcome {
            tenant: tenant.into(),
            failed,
            at: host.now_secs(),
        });
        host.enqueue(observer.queue(), &job.encode()).unwrap();
        observer.drain(host);
    }

    fn escalated(host: &FakeHost) -> EscalatedTenants {
        EscalatedTenants::decode(host.shared_value(ESCALATED_KEY))
    }

    #[test]
    fn enough_failed_outcomes_escalate_their_tenant() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, ESCALATION);
        outcome(&mut host, &mut observer, "other", true);
        for _ in 0..3 {
            outcome(&mut host, &mut observer, "acme", true);
        }
        assert!(
            !escalated(&host).covers(Some("acme")),
            "3 < min_verifications"
        );
        outcome(&mut host, &mut observer, "acme", true);
        let published = escalated(&host);
        assert_eq!(published.tenants, ["acme"]);
        assert!(!published.gateway && !published.no_tenant);
        let flips = counter(
            &mut host,
            &observer,
            "zerolayer_auth_escalations_flip=escalated",
        );
        assert_eq!(flips, 1);
        assert_eq!(host.metric("zerolayer_auth_escalated_tenants"), Some(1));
    }

    #[test]
    fn an_escalated_tenant_relaxes_once_the_window_slid_past_its_failures() {
        let mut host = FakeHost::default();
        let mut observer = observer(&mut host, ESCALATION);
        for _ in 0..4 {
            outcome(&mut host, &mut observer, "acme", true);
        }
        host.advance(Duration::from_secs(9));
        observer.on_tick(&mut host);
        assert_eq!(
            escalated(&host).tenants,
            ["acme"],
            "still within the window"
        );
        host.advance(Duration::from_secs(1));
        observer.on_tick(&mut host);
        assert!(escalated(&host).tenants.is_empty());
        assert_eq!(
            host.metric("zerolayer_auth_escalations_flip=relaxed"),
            Some(1)
        );
        assert_eq!(host.metric("zerolayer_auth_escalated_tenants"), Some(0));
    }

    #[test]
    fn an_invalid_verdict_counts_in_its_tenant_s_window() {
        let mut host = FakeHost::default();
        let fields = format!(r#"{API_KEYS},{ESCALATION}"#);
        let mut observer = observer(&mut host, &fields);
        for n in 0..4 {
            let key = format!("sk-{n}");
            let job = Job::Verify(VerifyJob {
                hash: TokenHash::credential(CredentialKind::ApiKey, key.as_bytes()).0,
                kind: CredentialKind::ApiKey,
                credential: key.into_bytes(),
                tenant_hint: Some("acme".into()),
                enqueued_at_ms: host.now_ms(),
            });
            host.enqueue(observer.queue(), &job.encode()).unwrap();
            observer.drain(&mut host);
            answer(&mut host, &mut observer, Some(401), b"");
        }
        assert_eq!(escalated(&host).tenants, ["acme"]);
    }
}
