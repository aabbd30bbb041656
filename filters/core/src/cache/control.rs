//! `Cache-Control` parsing and the response cache's policy: whether a request
//! may be answered from cache or stored, and how long a response is kept.
//!
//! Parsing borrows from the header value and never allocates (it runs on
//! every request in the VM). Where RFC 9111 leaves a choice the reading taken
//! is the conservative one: when in doubt, do not serve and do not store.

use serde::Deserialize;

use super::key::Provider;
use crate::config::ConfigError;

/// Largest delta-seconds value kept: RFC 9111 §1.2.2 lets a cache saturate
/// larger values at the greatest integer it can conveniently represent.
const MAX_DELTA: u64 = u32::MAX as u64;

/// Temperature assumed for a request that sets none: both providers'
/// documented default.
const DEFAULT_TEMPERATURE: f64 = 1.0;

/// The request header a client opts in with (value `sampled`) to being
/// served a stored sample when the operator's `sampled` is `opt_in`. Not
/// under `x-zerolayer-`: activation removes those from requests (they are
/// the gateway's own decisions, which a client must not forge).
pub const SAMPLED_OPT_IN_HEADER: &str = "zerolayer-cache";

/// Directives of a request's Cache-Control that the cache honours.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestDirectives {
    /// `no-store`: neither store the response nor keep anything of the request.
    pub no_store: bool,
    /// `no-cache`: do not answer from cache without going upstream.
    pub no_cache: bool,
    /// `max-age`: the oldest stored response the client accepts, seconds
    /// (None when absent or invalid).
    pub max_age: Option<u64>,
    /// `max-age` was present but not valid delta-seconds, or given twice with
    /// different values.
    pub invalid_max_age: bool,
    /// `only-if-cached`: answer from cache or with 504, never upstream.
    pub only_if_cached: bool,
}

impl RequestDirectives {
    /// Parses a request's Cache-Control value (several header lines joined
    /// with commas); unknown directives are ignored.
    pub fn parse(value: &str) -> Self {
        let mut out = RequestDirectives::default();
        let mut max_age = AgeDirective::default();
        for (name, arg) in directives(value) {
            if name.eq_ignore_ascii_case("no-store") {
                out.no_store = true;
            } else if name.eq_ignore_ascii_case("no-cache") {
                out.no_cache = true;
            } else if name.eq_ignore_ascii_case("max-age") {
                max_age.record(arg);
            } else if name.eq_ignore_ascii_case("only-if-cached") {
                out.only_if_cached = true;
            }
        }
        out.max_age = max_age.value();
        out.invalid_max_age = max_age.invalid;
        out
    }
}

/// Directives of a response's Cache-Control that decide storing and TTL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResponseDirectives {
    /// `no-store`: the response must not be stored.
    pub no_store: bool,
    /// `no-cache` (with or without a field list): not to be reused without
    /// revalidation, which this cache cannot do.
    pub no_cache: bool,
    /// `private` (with or without a field list): meant for a single user.
    pub private: bool,
    /// `public`: parsed for logs only; the cache is keyed per tenant, so an
    /// `Authorization` header never needs `public` to allow storing.
    pub public: bool,
    /// `max-age`, seconds (None when absent or invalid).
    pub max_age: Option<u64>,
    /// `s-maxage`, seconds (None when absent or invalid).
    pub s_maxage: Option<u64>,
    /// `max-age` or `s-maxage` was present but not valid delta-seconds, or
    /// given twice with different values.
    pub invalid_age: bool,
}

impl ResponseDirectives {
    /// Parses a response's Cache-Control value (several header lines joined
    /// with commas); unknown directives are ignored.
    pub fn parse(value: &str) -> Self {
        let mut out = ResponseDirectives::default();
        let mut max_age = AgeDirective::default();
        let mut s_maxage = AgeDirective::default();
        for (name, arg) in directives(value) {
            if name.eq_ignore_ascii_case("no-store") {
                out.no_store = true;
            } else if name.eq_ignore_ascii_case("no-cache") {
                out.no_cache = true;
            } else if name.eq_ignore_ascii_case("private") {
                out.private = true;
            } else if name.eq_ignore_ascii_case("public") {
                out.public = true;
            } else if name.eq_ignore_ascii_case("max-age") {
                max_age.record(arg);
            } else if name.eq_ignore_ascii_case("s-maxage") {
                s_maxage.record(arg);
            }
        }
        out.max_age = max_age.value();
        out.s_maxage = s_maxage.value();
        // Either one invalid refuses storing, even when the other is valid:
        // a sender that gets one wrong may mean something else by the other.
        out.invalid_age = max_age.invalid || s_maxage.invalid;
        out
    }
}

/// The operator's TTL policy (part of post-cache's config).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub struct TtlPolicy {
    /// TTL when neither side says anything, seconds.
    pub default_ttl_secs: u64,
    /// Upper bound on any TTL, seconds.
    pub max_ttl_secs: u64,
    /// Whether an upstream `no-cache` prevents storing (off by default:
    /// providers send `no-cache` on everything, so by default it is ignored
    /// and the response's `max-age` or the default TTL applies).
    pub honour_upstream_no_cache: bool,
    /// Whether upstream `private` responses may be stored (the cache is per
    /// tenant, not per user).
    pub store_private: bool,
    /// Requests with a temperature above this are *sampled*: `sampled`
    /// decides whether they are cached. A request without one samples at
    /// `missing_temperature`. With the default 0.0 only deterministic
    /// requests are cached unless `sampled` says otherwise.
    pub max_temperature: f64,
    /// What a request without `temperature` samples at, per API (the
    /// providers' documented default, 1.0, for both; set it to what your
    /// backend does when it differs). The Anthropic SDK's typed calls never
    /// send one.
    pub missing_temperature: MissingTemperature,
    /// Whether sampled requests (above `max_temperature`) are cached.
    pub sampled: SampledPolicy,
}

/// The temperature a request without one samples at, per API.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub struct MissingTemperature {
    /// `/v1/messages`.
    pub anthropic: f64,
    /// `/v1/chat/completions`.
    pub openai: f64,
}

impl Default for MissingTemperature {
    fn default() -> Self {
        MissingTemperature {
            anthropic: DEFAULT_TEMPERATURE,
            openai: DEFAULT_TEMPERATURE,
        }
    }
}

/// What the cache does with sampled requests (temperature above
/// `max_temperature`, or none and a `missing_temperature` above it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum SampledPolicy {
    /// Never cached (`x-cache: BYPASS`, reason `temperature`).
    #[default]
    Bypass,
    /// Cached when the request asks with `zerolayer-cache: sampled`;
    /// others bypass (and never read what an opted-in request stored).
    OptIn,
    /// Cached like deterministic requests: every hit replays the one stored
    /// sample for as long as it is fresh.
    Cache,
}

/// What a request's sampling means to the cache: its API, its own
/// `temperature` and whether it opted in to a stored sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// The API it calls (its `missing_temperature`).
    pub provider: Provider,
    /// Its `temperature`, if it sets one.
    pub temperature: Option<f64>,
    /// It sent `zerolayer-cache: sampled`.
    pub opted_in: bool,
}

impl From<Option<f64>> for Sampling {
    /// An Anthropic request with this temperature that did not opt in.
    fn from(temperature: Option<f64>) -> Sampling {
        Sampling {
            provider: Provider::Anthropic,
            temperature,
            opted_in: false,
        }
    }
}

impl TtlPolicy {
    /// Whether a request sampling as `sampling` says may be cached.
    pub fn caches(&self, sampling: Sampling) -> bool {
        let missing = match sampling.provider {
            Provider::Anthropic => self.missing_temperature.anthropic,
            Provider::OpenAi => self.missing_temperature.openai,
        };
        let t = sampling.temperature.unwrap_or(missing);
        if !t.is_nan() && t <= self.max_temperature {
            return true;
        }
        match self.sampled {
            SampledPolicy::Bypass => false,
            SampledPolicy::OptIn => sampling.opted_in,
            // A NaN is no temperature any backend samples at: never cached.
            SampledPolicy::Cache => !t.is_nan(),
        }
    }
}

/// Whether a request's `zerolayer-cache` value opts in to a stored sample.
pub fn opts_in_to_sampled(value: Option<&[u8]>) -> bool {
    value.is_some_and(|v| v.trim_ascii().eq_ignore_ascii_case(b"sampled"))
}

impl Default for TtlPolicy {
    fn default() -> Self {
        TtlPolicy {
            default_ttl_secs: 60,
            max_ttl_secs: 3600,
            honour_upstream_no_cache: false,
            store_private: false,
            max_temperature: 0.0,
            missing_temperature: MissingTemperature::default(),
            sampled: SampledPolicy::Bypass,
        }
    }
}

impl TtlPolicy {
    /// Checks what serde cannot, naming the offending field by its own name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_in("")
    }

    /// Like [`TtlPolicy::validate`], naming fields under `section`
    /// (`cache.ttl`) when the policy is nested in a larger configuration.
    pub fn validate_in(&self, section: &str) -> Result<(), ConfigError> {
        let at = |field: &str| {
            if section.is_empty() {
                field.to_string()
            } else {
                format!("{section}.{field}")
            }
        };
        for (field, t) in [
            ("max_temperature", self.max_temperature),
            (
                "missing_temperature.anthropic",
                self.missing_temperature.anthropic,
            ),
            (
                "missing_temperature.openai",
                self.missing_temperature.openai,
            ),
        ] {
            if !t.is_finite() || t < 0.0 {
                return Err(ConfigError::new(
                    at(field),
                    format!("{t} is not a temperature (a finite number >= 0)"),
                ));
            }
        }
        if self.default_ttl_secs > self.max_ttl_secs {
            return Err(ConfigError::new(
                at("default_ttl_secs"),
                format!(
                    "{} exceeds max_ttl_secs ({})",
                    self.default_ttl_secs, self.max_ttl_secs
                ),
            ));
        }
        Ok(())
    }
}

crate::labels! {
    /// Why the cache stays out of a request or response (the label of
    /// `zerolayer_cache_bypass{reason=…}`).
    pub enum Bypass {
        /// The request said `no-store`.
        RequestNoStore => "request_no_store",
        /// The request samples above [`TtlPolicy::max_temperature`] (or its
        /// temperature is NaN) and [`TtlPolicy::sampled`] does not cache it.
        Temperature => "temperature",
        /// Not a POST: LLM APIs are POST, other methods on their paths pass through.
        NotCacheableMethod => "not_cacheable_method",
        /// The upstream status is not 200.
        Status => "status",
        /// The response said `no-store`.
        ResponseNoStore => "response_no_store",
        /// The response must not be reused: `no-cache` (when honoured), or a TTL of 0.
        ResponseNoCache => "response_no_cache",
        /// The response said `private` and the policy does not store those.
        Private => "private",
        /// The response's `max-age` or `s-maxage` is invalid.
        InvalidMaxAge => "invalid_max_age",
        /// The response did not complete (stream not terminated).
        Incomplete => "incomplete",
        /// The request or the response exceeds its size limit.
        TooLarge => "too_large",
        /// Activation did not turn the `cache` observer on for this request.
        NotActivated => "not_activated",
        /// The namespace is per tenant and the request has no verified tenant
        /// (an unverified claim must never read another tenant's entries).
        NoVerifiedTenant => "no_verified_tenant",
        /// The body is not a request the cache can key (not JSON, no model, …).
        Unkeyable => "unkeyable",
        /// The response is compressed (the backend ignored `accept-encoding:
        /// identity`): not stored, so no client gets a coding it did not accept.
        Encoded => "encoded",
    }
}

/// What to do with a request before it goes upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestPlan {
    /// Neither look up nor store (`x-cache: BYPASS`).
    Bypass(Bypass),
    /// Look up; serve an entry no older than `max_age` (None: any unexpired
    /// entry); store the response on a miss when `store`.
    Lookup {
        /// The request's `max-age`, seconds.
        max_age: Option<u64>,
        /// Whether a miss's response may be stored.
        store: bool,
        /// `only-if-cached`: the filter answers a miss with 504 instead of
        /// going upstream (and then has nothing to store).
        only_if_cached: bool,
    },
    /// Do not serve from cache (client `no-cache` / `max-age=0` / invalid
    /// max-age), but store the fresh response.
    Refresh,
    /// `only-if-cached` with a directive that forbids serving from cache
    /// (`no-cache`, `max-age=0`, invalid max-age): no stored response can
    /// satisfy it, so the filter answers 504 without a lookup (RFC 9111 §5.2.1.7).
    Unsatisfiable,
}

/// Plans a request: `method`, its Cache-Control (None if absent), its
/// sampling (a bare `Option<f64>` is an Anthropic request's temperature,
/// not opted in; see [`TtlPolicy::caches`]).
///
/// Requests the cache never handles (not POST, `no-store`, sampled where
/// the policy does not cache that) pass through as [`RequestPlan::Bypass`]
/// even with `only-if-cached`: for them the cache is not there at all.
pub fn plan_request(
    method: &str,
    cache_control: Option<&str>,
    sampling: impl Into<Sampling>,
    policy: &TtlPolicy,
) -> RequestPlan {
    // Methods are case-sensitive (RFC 9110 §9.1): `post` is not POST.
    if method != "POST" {
        return RequestPlan::Bypass(Bypass::NotCacheableMethod);
    }
    let cc = cache_control
        .map(RequestDirectives::parse)
        .unwrap_or_default();
    if cc.no_store {
        return RequestPlan::Bypass(Bypass::RequestNoStore);
    }
    if !policy.caches(sampling.into()) {
        return RequestPlan::Bypass(Bypass::Temperature);
    }
    // An invalid max-age is read as 0 (RFC 9111 §4.2.1 lets a cache treat
    // it as stale): nothing stored may be served, a fresh answer may be.
    if cc.no_cache || cc.invalid_max_age || cc.max_age == Some(0) {
        return if cc.only_if_cached {
            RequestPlan::Unsatisfiable
        } else {
            RequestPlan::Refresh
        };
    }
    RequestPlan::Lookup {
        max_age: cc.max_age,
        store: true,
        only_if_cached: cc.only_if_cached,
    }
}

/// How long a completed response may be stored, or why not. `status` is the
/// upstream status; only 200 is stored.
pub fn response_ttl(
    status: u16,
    cache_control: Option<&str>,
    policy: &TtlPolicy,
) -> Result<u64, Bypass> {
    if status != 200 {
        return Err(Bypass::Status);
    }
    let cc = cache_control
        .map(ResponseDirectives::parse)
        .unwrap_or_default();
    if cc.no_store {
        return Err(Bypass::ResponseNoStore);
    }
    if cc.private && !policy.store_private {
        return Err(Bypass::Private);
    }
    if cc.no_cache && policy.honour_upstream_no_cache {
        return Err(Bypass::ResponseNoCache);
    }
    // An invalid age could mean anything from "stale now" to "keep for
    // ever"; not storing is the only reading that cannot serve stale data.
    if cc.invalid_age {
        return Err(Bypass::InvalidMaxAge);
    }
    // s-maxage first: the gateway is a shared cache (RFC 9111 §5.2.2.10).
    let ttl = cc
        .s_maxage
        .or(cc.max_age)
        .unwrap_or(policy.default_ttl_secs)
        .min(policy.max_ttl_secs);
    // Explicit `max-age=0` is stale on arrival, and a policy capping TTLs
    // at 0 stores nothing: either way the entry could never be served.
    if ttl == 0 {
        return Err(Bypass::ResponseNoCache);
    }
    Ok(ttl)
}

/// The `Age` header value for an entry stored at `stored_at` seen at `now`
/// (seconds; never negative).
pub fn age(stored_at: u64, now: u64) -> u64 {
    // Clocks of different workers may disagree by a little: an entry from
    // "the future" is just new.
    now.saturating_sub(stored_at)
}

/// Whether an entry stored at `stored_at` with `expires_at` may be served at
/// `now` under the request's `max_age`.
///
/// An entry is fresh while `now < expires_at`, and fresh enough while also
/// `age <= max_age` (RFC 9111 §5.2.1.1). One that expires no later than it
/// was stored is corrupt and never served.
pub fn fresh_enough(stored_at: u64, expires_at: u64, now: u64, max_age: Option<u64>) -> bool {
    stored_at < expires_at
        && now < expires_at
        && max_age.is_none_or(|max| age(stored_at, now) <= max)
}

/// A `max-age` or `s-maxage` directive seen so far.
#[derive(Default)]
struct AgeDirective {
    value: Option<u64>,
    invalid: bool,
}

impl AgeDirective {
    /// Records one occurrence. RFC 9111 §4.2.1 allows either using the first
    /// of several values or considering the response stale; conflicting
    /// duplicates are read as invalid (stale), equal ones as one.
    fn record(&mut self, arg: Option<&str>) {
        if self.invalid {
            return;
        }
        match (delta_seconds(arg), self.value) {
            (None, _) => self.invalid = true,
            (Some(new), Some(old)) if new != old => self.invalid = true,
            (Some(new), _) => self.value = Some(new),
        }
    }

    /// The value, if present and valid.
    fn value(&self) -> Option<u64> {
        if self.invalid { None } else { self.value }
    }
}

/// delta-seconds (RFC 9111 §1.2.2): one or more ASCII digits, saturated at
/// [`MAX_DELTA`]. A sign, a fraction, an empty or missing value are invalid.
fn delta_seconds(arg: Option<&str>) -> Option<u64> {
    let digits = arg?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Saturating at every step keeps `n * 10 + 9` far from u64 overflow.
    Some(
        digits
            .bytes()
            .fold(0, |n: u64, b| (n * 10 + u64::from(b - b'0')).min(MAX_DELTA)),
    )
}

/// The directives of a Cache-Control value as `(name, argument)` pairs.
fn directives(value: &str) -> Directives<'_> {
    Directives { rest: value }
}

/// Iterator over comma-separated directives, skipping empty elements and
/// commas inside quoted strings (`no-cache="a, b"` is one directive).
struct Directives<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Directives<'a> {
    type Item = (&'a str, Option<&'a str>);

    fn next(&mut self) -> Option<Self::Item> {
        while !self.rest.is_empty() {
            let end = element_end(self.rest.as_bytes());
            // `end` is at an ASCII comma or the end, so both are char boundaries.
            let element = self.rest.get(..end).unwrap_or("");
            self.rest = self.rest.get(end + 1..).unwrap_or("");
            let element = element.trim_ascii();
            if element.is_empty() {
                continue;
            }
            return Some(match element.split_once('=') {
                None => (element, None),
                Some((name, arg)) => (name.trim_ascii(), Some(unquote(arg.trim_ascii()))),
            });
        }
        None
    }
}

/// Index of the first comma outside a quoted string, or the length. An
/// unterminated quote runs to the end, so the rest is one (invalid) element.
fn element_end(bytes: &[u8]) -> usize {
    let mut quoted = false;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate() {
        if escaped {
            escaped = false;
        } else if quoted {
            match b {
                b'\\' => escaped = true,
                b'"' => quoted = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => quoted = true,
                b',' => return i,
                _ => {}
            }
        }
    }
    bytes.len()
}

/// The contents of a quoted-string argument (`"60"` → `60`); anything else,
/// including an unterminated quote, is returned unchanged. Escapes are left
/// in place: no argument this module reads as a number can contain one.
fn unquote(arg: &str) -> &str {
    arg.strip_prefix('"')
        .and_then(|inner| inner.strip_suffix('"'))
        .unwrap_or(arg)
}
