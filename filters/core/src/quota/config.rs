//! quota's configuration: policies (who is limited, in what unit, by a
//! rate or a calendar budget), the fleet store (Redis through webdis), what
//! happens when the store is gone, and the budget unverified requests draw
//! from. Parsed with unknown fields refused, then checked
//! ([`QuotaConfig::check`]) with errors naming the field path
//! (`policies[2].limit.budget.amount: must be > 0`).

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

use super::window::{MAX_EXACT, MAX_UTC_OFFSET_MINUTES, Period, Window};
use crate::config::{ConfigError, Endpoint, is_lowercase_header_name, quoted};

/// Most policies one gateway enforces: a request's reservations are kept
/// inline (no allocation), one per policy.
pub const MAX_POLICIES: usize = 16;
/// Most fields in one policy's scope.
pub const MAX_SCOPE_FIELDS: usize = 8;
/// Longest policy name (it is part of every store key).
pub const MAX_POLICY_NAME: usize = 64;
/// The name the `unverified` budget's policy has; no policy may take it.
pub const UNVERIFIED_POLICY: &str = "unverified";
/// Largest per-token weight, thousandths (a weight of 1000×).
pub const MAX_WEIGHT: u32 = 1_000_000;
/// Largest price, micro-units per million tokens (a million currency units
/// per million tokens).
pub const MAX_PRICE: u64 = 1_000_000_000_000;
/// Most models one policy counts one by one (`policies[].models`).
pub const MAX_POLICY_MODELS: usize = 256;
/// Longest model name a policy lists (longer names are no model a
/// provider serves).
pub const MAX_MODEL_NAME: usize = 128;

/// quota's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// The policies, each enforced on every request it scopes (at most 16).
    #[serde(default)]
    pub policies: Vec<Policy>,
    /// Request headers a scope may name (`{"header": "x-team"}`): only
    /// headers the operator's own proxy sets and clients cannot, since a
    /// client choosing its scope chooses whose budget it spends.
    #[serde(default)]
    pub trusted_headers: Vec<String>,
    /// The fleet-wide counters: Redis, reached through webdis.
    pub store: StoreConfig,
    /// What a gateway does once the store has been unreachable past a
    /// lease's expiry.
    #[serde(default)]
    pub fallback: Fallback,
    /// The one budget every unverified request draws from (lazy-auth
    /// admitted it before verification): it never spends the tenant it
    /// claims; once verified valid, the usage is charged to the tenant too.
    /// None: such requests are neither limited nor counted by quota (logged
    /// at load): a fresh credential's first request passes uncounted.
    #[serde(default)]
    pub unverified: Option<UnverifiedBudget>,
    /// Values a policy takes when it does not set its own.
    #[serde(default)]
    pub defaults: PolicyDefaults,
    /// Adds the output cap reserved (`max_completion_tokens` for OpenAI,
    /// `max_tokens` for Anthropic: the smallest `default_max_output_tokens`
    /// of the enforcing token policies that scope it) to a request body
    /// that names none, or puts it in place of its only cap's `null` or
    /// negative value, so a backend whose own default is larger stops
    /// within the reservation. Off: such a response may settle above its
    /// bound (as debt).
    #[serde(default)]
    pub inject_max_tokens: bool,
    /// Whether an admitted response carries the rate-limit headers (limit,
    /// remaining, reset of its tightest requests and token policies, in the
    /// provider's naming). Off, as peers offer (Kong's
    /// `hide_client_headers`): each of the six costs a response about 2,550
    /// instructions in the native module, 6,460 in the fused Wasm filter
    /// (Envoy's share most of it); the backend's own such headers, if any,
    /// pass. A refusal keeps its `retry-after` and error body.
    #[serde(default = "default_rate_limit_headers")]
    pub rate_limit_headers: bool,
}

fn default_rate_limit_headers() -> bool {
    true
}

/// A policy's fields that may be set once for all (`defaults`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct PolicyDefaults {
    /// `enforce` (refuse past the limit) or `shadow` (count and report
    /// what would have been refused, refuse nothing).
    #[serde(default)]
    pub mode: Mode,
    /// What a cache hit costs.
    #[serde(default)]
    pub cache_hit: CacheHitCharge,
    /// Output tokens reserved for a request that names no `max_tokens`
    /// (`max_completion_tokens`, `max_output_tokens`), or one no backend
    /// reads as a bound (`null`, `-1`): a missing bound does not dodge the
    /// reservation. A client's larger `max_tokens` is reserved at its own
    /// value. With `inject_max_tokens`, also the cap such a body is given.
    #[serde(default = "default_max_output_tokens")]
    pub default_max_output_tokens: u32,
    /// How a stream is limited.
    #[serde(default)]
    pub stream: StreamMode,
}

fn default_max_output_tokens() -> u32 {
    4096
}

impl Default for PolicyDefaults {
    fn default() -> Self {
        PolicyDefaults {
            mode: Mode::default(),
            cache_hit: CacheHitCharge::default(),
            default_max_output_tokens: default_max_output_tokens(),
            stream: StreamMode::default(),
        }
    }
}

/// One policy: a limit on what each scope key may use.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Unique name (letters, digits, `_`, `-`, `.`; at most 64 bytes): it
    /// names the policy's store keys, metrics and refusals.
    pub name: String,
    /// What a scope key is made of, from verified identity only (`tenant`,
    /// `subject`, `credential`, `model`, `route`, or `{"header": name}` for
    /// a header listed in `trusted_headers`); empty: one key for all.
    #[serde(default)]
    pub scope: Vec<ScopeField>,
    /// The models counted one by one when the scope has `model` (required
    /// then, at most 256): a request naming any other model, or none,
    /// counts under one key they all share, so a client naming a made-up
    /// model gets no budget (and no lease) of its own.
    #[serde(default)]
    pub models: Vec<String>,
    /// What is counted.
    pub unit: Unit,
    /// The limit on each scope key.
    pub limit: Limit,
    /// Overrides `defaults.mode`.
    #[serde(default)]
    pub mode: Option<Mode>,
    /// Overrides `defaults.cache_hit`.
    #[serde(default)]
    pub cache_hit: Option<CacheHitCharge>,
    /// Overrides `defaults.default_max_output_tokens`.
    #[serde(default)]
    pub default_max_output_tokens: Option<u32>,
    /// Overrides `defaults.stream`.
    #[serde(default)]
    pub stream: Option<StreamMode>,
}

/// One part of a scope key: `"tenant"`, `"subject"`, `"credential"`,
/// `"model"`, `"route"`, or `{"header": name}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum ScopeField {
    /// The verified tenant.
    Tenant,
    /// The verified subject (a JWT's `sub`, an API key's owner).
    Subject,
    /// The credential itself (by its hash).
    Credential,
    /// The model the request names.
    Model,
    /// The route the gateway matched.
    Route,
    /// A trusted request header's value (listed in `trusted_headers`).
    Header(String),
}

impl ScopeField {
    /// The field's name in keys and messages.
    pub fn name(&self) -> &str {
        match self {
            ScopeField::Tenant => "tenant",
            ScopeField::Subject => "subject",
            ScopeField::Credential => "credential",
            ScopeField::Model => "model",
            ScopeField::Route => "route",
            ScopeField::Header(name) => name,
        }
    }
}

/// What a policy counts: `"requests"`, `"tokens"`, or one of the members
/// below. Amounts are integers in the unit's ledger: no float is ever
/// added to a counter.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    /// Requests: each costs 1, whatever its size.
    Requests,
    /// Tokens, input (cached or not) plus output.
    Tokens,
    /// Tokens weighted per model and kind, in thousandths (1000 = one
    /// token); a request costs `ceil(Σ tokens × weight / 1000)`.
    WeightedTokens(WeightTable),
    /// Money: per-model prices in integer micro-units of a currency per
    /// million tokens; amounts (limits, counters) are micro-units, a
    /// request costs `ceil(Σ tokens × price / 1,000,000)`.
    Currency(PriceTable),
}

/// Per-model token weights.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct WeightTable {
    /// Weights by exact model name.
    #[serde(default)]
    pub models: BTreeMap<String, Rates>,
    /// Weights of any other model (default: 1000 each, plain tokens).
    #[serde(default = "unit_weights")]
    pub default: Rates,
}

fn unit_weights() -> Rates {
    Rates {
        input: 1000,
        output: 1000,
        cache_read: 1000,
        cache_write: None,
    }
}

/// Per-model prices.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct PriceTable {
    /// Prices by exact model name.
    #[serde(default)]
    pub models: BTreeMap<String, Rates>,
    /// Prices of any other model (required: a model without a price must
    /// still cost something).
    pub default: Rates,
}

/// What one token of each kind costs: thousandths of a token for weighted
/// tokens, micro-units per million tokens for a currency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// Uncached input tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
    /// Input tokens read from the provider's prompt cache.
    pub cache_read: u64,
    /// Input tokens written to the provider's prompt cache (default: `input`).
    #[serde(default)]
    pub cache_write: Option<u64>,
}

/// A policy's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// A rate: `amount` per `per`, refilled continuously (GCRA); at most
    /// one period's amount at once.
    Rate(RateLimit),
    /// A budget: `amount` per calendar window, reset at the window's start.
    Budget(BudgetLimit),
}

/// `{"rate": {"amount": 100000, "per": "minute"}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Units per period (> 0; `amount × period in ms` at most 2^53).
    pub amount: u64,
    /// The period.
    pub per: Period,
}

/// `{"budget": {"amount": 5000000, "window": "month", "utc_offset_minutes": 60}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct BudgetLimit {
    /// Units per window (> 0, at most 2^53).
    pub amount: u64,
    /// The calendar window.
    pub window: Window,
    /// Where the window's calendar is read, minutes east of UTC (−840…840).
    #[serde(default)]
    pub utc_offset_minutes: i32,
}

impl Limit {
    /// The limit's amount.
    pub fn amount(&self) -> u64 {
        match self {
            Limit::Rate(r) => r.amount,
            Limit::Budget(b) => b.amount,
        }
    }
}

/// Whether a policy refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Refuse what is past the limit.
    #[default]
    Enforce,
    /// Count, and report what would have been refused; refuse nothing.
    Shadow,
}

/// How a streamed response is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    /// A stream reserves its whole upper bound, like any request, and is
    /// never cut.
    #[default]
    Soft,
    /// A stream reserves its input bound and draws output as it arrives;
    /// when the lease cannot cover a chunk the stream is ended cleanly
    /// (the client is billed for what it received).
    Hard,
}

/// What a response served from the gateway's cache costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum CacheHitCharge {
    /// One request and no tokens.
    #[default]
    Request,
    /// Nothing.
    Free,
    /// What the stored response's usage says, as if it had been a miss.
    Usage,
}

/// The budget of unverified requests.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct UnverifiedBudget {
    /// What is counted.
    pub unit: Unit,
    /// The limit, fleet-wide, on all unverified requests together.
    pub limit: Limit,
    /// `enforce` or `shadow`.
    #[serde(default)]
    pub mode: Mode,
}

/// The fleet store: Redis through webdis (`POST` of a command), or any
/// client that speaks RESP to the same keys.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// The webdis endpoint (`path` is where commands are posted, usually `/`).
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// Redis key prefix (letters, digits and `:_-.`; at most 64 bytes).
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// How often the observer refills leases and sends deltas, ms (50–60000).
    #[serde(default = "default_sync_interval_ms")]
    pub sync_interval_ms: u32,
    /// How long a lease may be spent without the store confirming it, ms
    /// (at least twice `sync_interval_ms`); past it the fallback applies.
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u32,
    /// A lease unused this long gives back what it holds, ms (at least
    /// `lease_ttl_ms`): the store's counter then equals what was spent.
    /// Shorter returns sooner, at the price of a refill (the next request
    /// waits for one) when the scope is used again.
    #[serde(default = "default_idle_return_ms")]
    pub idle_return_ms: u32,
    /// Lease holders expected in the fleet (gateways × lease tables each):
    /// sizes leases and the `local_share` fallback (at least 1).
    #[serde(default = "default_expected_gateways")]
    pub expected_gateways: u32,
    /// How large a lease is.
    #[serde(default)]
    pub lease: LeaseSizing,
    /// β: how far, in each policy's unit, a lease may be overdrawn by
    /// reservations before the store grants more. It adds `N × β` to the
    /// overshoot bound (0: a reservation never exceeds what was granted).
    #[serde(default)]
    pub max_debt: u64,
    /// Deltas kept while the store is unreachable (at least 1); past it
    /// returns are given up first, then the oldest are dropped (both
    /// counted).
    #[serde(default = "default_max_buffered_deltas")]
    pub max_buffered_deltas: u32,
    /// Leases one table holds (16–1048576): a bound on memory however many
    /// scopes are active.
    #[serde(default = "default_max_leases")]
    pub max_leases: u32,
}

/// Lease sizes: `min(max, remaining / (2 × expected_gateways))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct LeaseSizing {
    /// The largest lease, percent of the policy's limit (1–100).
    #[serde(default = "default_max_percent")]
    pub max_percent: u8,
    /// A lease is refilled when what is left of it falls below this
    /// percentage of its size (0–99).
    #[serde(default = "default_low_watermark_percent")]
    pub low_watermark_percent: u8,
}

fn default_max_percent() -> u8 {
    5
}
fn default_low_watermark_percent() -> u8 {
    25
}

impl Default for LeaseSizing {
    fn default() -> Self {
        LeaseSizing {
            max_percent: default_max_percent(),
            low_watermark_percent: default_low_watermark_percent(),
        }
    }
}

fn default_key_prefix() -> String {
    "zl:quota:".into()
}
fn default_sync_interval_ms() -> u32 {
    500
}
fn default_lease_ttl_ms() -> u32 {
    5000
}
fn default_idle_return_ms() -> u32 {
    60_000
}
fn default_expected_gateways() -> u32 {
    4
}
fn default_max_buffered_deltas() -> u32 {
    1024
}
fn default_max_leases() -> u32 {
    4096
}

/// What a lease does once the store has been unreachable past its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Spend `1 / expected_gateways` of the last known remainder (of the
    /// rate, for a rate), locally; reported to the store when it is back.
    #[default]
    LocalShare,
    /// Admit everything; reported to the store when it is back.
    FailOpen,
    /// Refuse everything the policy scopes.
    FailClosed,
}

impl QuotaConfig {
    /// Parses and checks a JSON configuration.
    pub fn from_json(bytes: &[u8]) -> Result<QuotaConfig, ConfigError> {
        let config: QuotaConfig = crate::config::from_json(bytes)?;
        config.check()?;
        Ok(config)
    }

    /// Checks what serde cannot, naming the field.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (i, name) in self.trusted_headers.iter().enumerate() {
            if !is_lowercase_header_name(name) {
                return Err(ConfigError::new(
                    format!("trusted_headers[{i}]"),
                    format!("not a lowercase header name: {}", quoted(name)),
                ));
            }
        }
        if self.policies.len() > MAX_POLICIES {
            return Err(ConfigError::new(
                "policies",
                format!("{} policies; at most {MAX_POLICIES}", self.policies.len()),
            ));
        }
        check_output_cap(
            "defaults.default_max_output_tokens",
            self.defaults.default_max_output_tokens,
        )?;
        let mut names = BTreeSet::new();
        for (i, policy) in self.policies.iter().enumerate() {
            let at = format!("policies[{i}]");
            policy.check(&at, &self.trusted_headers)?;
            if !names.insert(policy.name.as_str()) {
                return Err(ConfigError::new(
                    format!("{at}.name"),
                    format!("{} names an earlier policy too", quoted(&policy.name)),
                ));
            }
        }
        if let Some(unverified) = &self.unverified {
            check_unit("unverified.unit", &unverified.unit)?;
            check_limit("unverified.limit", &unverified.limit)?;
        }
        self.store.check("store")
    }
}

fn check_output_cap(at: &str, cap: u32) -> Result<(), ConfigError> {
    if cap == 0 {
        return Err(ConfigError::new(at, "must be > 0"));
    }
    Ok(())
}

impl Policy {
    /// Checks the policy found at `at` (`policies[2]`).
    pub fn check(&self, at: &str, trusted_headers: &[String]) -> Result<(), ConfigError> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= MAX_POLICY_NAME
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !name_ok {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!(
                    "{} must be 1 to {MAX_POLICY_NAME} letters, digits, `_`, `-` or `.`",
                    quoted(&self.name)
                ),
            ));
        }
        if self.name == UNVERIFIED_POLICY {
            return Err(ConfigError::new(
                format!("{at}.name"),
                "\"unverified\" is the unverified budget's; choose another name",
            ));
        }
        if self.scope.len() > MAX_SCOPE_FIELDS {
            return Err(ConfigError::new(
                format!("{at}.scope"),
                format!("{} fields; at most {MAX_SCOPE_FIELDS}", self.scope.len()),
            ));
        }
        let mut seen = BTreeSet::new();
        for (j, field) in self.scope.iter().enumerate() {
            if let ScopeField::Header(header) = field
                && !trusted_headers.iter().any(|t| t == header)
            {
                return Err(ConfigError::new(
                    format!("{at}.scope[{j}].header"),
                    format!(
                        "{} is not in trusted_headers: a header a client can set would let it choose whose budget it spends",
                        quoted(header)
                    ),
                ));
            }
            if !seen.insert(field) {
                return Err(ConfigError::new(
                    format!("{at}.scope[{j}]"),
                    format!("{} is named twice", quoted(field.name())),
                ));
            }
        }
        self.check_models(at)?;
        check_unit(&format!("{at}.unit"), &self.unit)?;
        check_limit(&format!("{at}.limit"), &self.limit)?;
        if let Some(cap) = self.default_max_output_tokens {
            check_output_cap(&format!("{at}.default_max_output_tokens"), cap)?;
        }
        Ok(())
    }

    /// `models` is required with `model` in the scope and refused without
    /// it: the request names its model, so an open set of names would let
    /// a client mint a counter per request.
    fn check_models(&self, at: &str) -> Result<(), ConfigError> {
        let at = format!("{at}.models");
        let by_model = self.scope.contains(&ScopeField::Model);
        if by_model && self.models.is_empty() {
            return Err(ConfigError::new(
                at,
                "required with \"model\" in the scope: list the models counted one by one (any other shares one key); a client names the model, so without a list each made-up name would get a budget of its own",
            ));
        }
        if !by_model && !self.models.is_empty() {
            return Err(ConfigError::new(at, "only with \"model\" in the scope"));
        }
        if self.models.len() > MAX_POLICY_MODELS {
            return Err(ConfigError::new(
                at,
                format!("{} models; at most {MAX_POLICY_MODELS}", self.models.len()),
            ));
        }
        let mut seen = BTreeSet::new();
        for (j, model) in self.models.iter().enumerate() {
            if model.is_empty() || model.len() > MAX_MODEL_NAME {
                return Err(ConfigError::new(
                    format!("{at}[{j}]"),
                    format!("{} must be 1 to {MAX_MODEL_NAME} bytes", quoted(model)),
                ));
            }
            if !seen.insert(model) {
                return Err(ConfigError::new(
                    format!("{at}[{j}]"),
                    format!("{} is listed twice", quoted(model)),
                ));
            }
        }
        Ok(())
    }
}

fn check_unit(at: &str, unit: &Unit) -> Result<(), ConfigError> {
    let (kind, table, default, max) = match unit {
        Unit::Requests | Unit::Tokens => return Ok(()),
        Unit::WeightedTokens(t) => (
            "weighted_tokens",
            &t.models,
            &t.default,
            u64::from(MAX_WEIGHT),
        ),
        Unit::Currency(t) => ("currency", &t.models, &t.default, MAX_PRICE),
    };
    check_rates(&format!("{at}.{kind}.default"), default, max)?;
    for (model, rates) in table {
        if model.is_empty() {
            return Err(ConfigError::new(
                format!("{at}.{kind}.models"),
                "a model name must not be empty",
            ));
        }
        check_rates(&format!("{at}.{kind}.models.{model}"), rates, max)?;
    }
    Ok(())
}

fn check_rates(at: &str, rates: &Rates, max: u64) -> Result<(), ConfigError> {
    let fields = [
        ("input", Some(rates.input)),
        ("output", Some(rates.output)),
        ("cache_read", Some(rates.cache_read)),
        ("cache_write", rates.cache_write),
    ];
    for (name, value) in fields {
        if let Some(v) = value
            && v > max
        {
            return Err(ConfigError::new(
                format!("{at}.{name}"),
                format!("{v} is more than {max}"),
            ));
        }
    }
    Ok(())
}

fn check_limit(at: &str, limit: &Limit) -> Result<(), ConfigError> {
    match limit {
        Limit::Rate(rate) => {
            let at = format!("{at}.rate.amount");
            check_amount(&at, rate.amount)?;
            let max = MAX_EXACT / rate.per.millis();
            if rate.amount > max {
                return Err(ConfigError::new(
                    at,
                    format!(
                        "{} is more than {max} per {} (the store computes in doubles: amount × period in ms must stay within 2^53)",
                        rate.amount,
                        rate.per.name()
                    ),
                ));
            }
        }
        Limit::Budget(budget) => {
            check_amount(&format!("{at}.budget.amount"), budget.amount)?;
            if budget.utc_offset_minutes.unsigned_abs() > MAX_UTC_OFFSET_MINUTES.unsigned_abs() {
                return Err(ConfigError::new(
                    format!("{at}.budget.utc_offset_minutes"),
                    format!(
                        "{} is outside -{MAX_UTC_OFFSET_MINUTES}..={MAX_UTC_OFFSET_MINUTES}",
                        budget.utc_offset_minutes
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn check_amount(at: &str, amount: u64) -> Result<(), ConfigError> {
    if amount == 0 {
        return Err(ConfigError::new(at, "must be > 0"));
    }
    if amount > MAX_EXACT {
        return Err(ConfigError::new(
            at,
            format!("{amount} is more than 2^53 (the store computes in doubles)"),
        ));
    }
    Ok(())
}

impl StoreConfig {
    /// Checks the store's fields; `at` is its path (`store`).
    pub fn check(&self, at: &str) -> Result<(), ConfigError> {
        if self.endpoint.cluster.is_empty() {
            return Err(ConfigError::new(
                format!("{at}.cluster"),
                "must not be empty",
            ));
        }
        if !self.endpoint.path.starts_with('/') {
            return Err(ConfigError::new(
                format!("{at}.path"),
                format!("{} must start with /", quoted(&self.endpoint.path)),
            ));
        }
        let prefix_ok = self.key_prefix.len() <= 64
            && self
                .key_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b":_-.".contains(&b));
        if !prefix_ok {
            return Err(ConfigError::new(
                format!("{at}.key_prefix"),
                format!(
                    "{} must be at most 64 letters, digits or `:_-.`",
                    quoted(&self.key_prefix)
                ),
            ));
        }
        if !(50..=60_000).contains(&self.sync_interval_ms) {
            return Err(ConfigError::new(
                format!("{at}.sync_interval_ms"),
                format!("{} is outside 50..=60000", self.sync_interval_ms),
            ));
        }
        if u64::from(self.lease_ttl_ms) < 2 * u64::from(self.sync_interval_ms) {
            return Err(ConfigError::new(
                format!("{at}.lease_ttl_ms"),
                format!(
                    "{} must be at least twice sync_interval_ms ({})",
                    self.lease_ttl_ms, self.sync_interval_ms
                ),
            ));
        }
        if self.idle_return_ms < self.lease_ttl_ms {
            return Err(ConfigError::new(
                format!("{at}.idle_return_ms"),
                format!(
                    "{} must be at least lease_ttl_ms ({})",
                    self.idle_return_ms, self.lease_ttl_ms
                ),
            ));
        }
        if self.expected_gateways == 0 {
            return Err(ConfigError::new(
                format!("{at}.expected_gateways"),
                "must be at least 1",
            ));
        }
        if !(1..=100).contains(&self.lease.max_percent) {
            return Err(ConfigError::new(
                format!("{at}.lease.max_percent"),
                format!("{} is outside 1..=100", self.lease.max_percent),
            ));
        }
        if self.lease.low_watermark_percent > 99 {
            return Err(ConfigError::new(
                format!("{at}.lease.low_watermark_percent"),
                format!("{} is outside 0..=99", self.lease.low_watermark_percent),
            ));
        }
        if self.max_debt > MAX_EXACT {
            return Err(ConfigError::new(
                format!("{at}.max_debt"),
                format!("{} is more than 2^53", self.max_debt),
            ));
        }
        if self.max_buffered_deltas == 0 {
            return Err(ConfigError::new(
                format!("{at}.max_buffered_deltas"),
                "must be at least 1",
            ));
        }
        if !(16..=1 << 20).contains(&self.max_leases) {
            return Err(ConfigError::new(
                format!("{at}.max_leases"),
                format!("{} is outside 16..=1048576", self.max_leases),
            ));
        }
        Ok(())
    }
}
