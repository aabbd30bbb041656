//! The activation configuration as operators write it (JSON). Parsing only;
//! [`super::RuleSet::compile`] checks meaning and builds the fast form.

use serde::Deserialize;

/// The activation filter's configuration.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct ActivationConfig {
    /// Operator-defined observer names, in addition to `audit`, `metering`,
    /// `cache`: at most 61, each `[A-Za-z0-9_-]`, 1–64 bytes, not starting
    /// with `auth`.
    #[serde(default)]
    pub custom_observers: Vec<String>,
    /// Observers on when no matching rule decides them.
    #[serde(default)]
    pub defaults: Vec<String>,
    /// Request header `tenant` conditions read the tenant from in a chain
    /// where lazy-auth has not run yet: a
    /// client-chosen value unless the operator's proxy sets it. The shipped
    /// chains (`envoy/zerolayer.yaml`, `envoy/zerolayer-fused.yaml`,
    /// `kong/`) run lazy-auth first, so there `tenant` conditions see only
    /// its identity: the verified tenant, `unverified` for an unverified
    /// request (never its claim or the header), `unknown` for a verified
    /// credential without a tenant or a public path.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = super::DEFAULT_TENANT_HEADER)))]
    pub tenant_header: Option<String>,
    /// UTC offset for `hours` and `weekdays`, as `+HH:MM` or `-HH:MM`
    /// within ±14:00.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = "+00:00")))]
    pub utc_offset: Option<String>,
    /// Add `x-zerolayer-debug: observers=…; rules=…` (the decision and the
    /// matched rules) to responses.
    #[serde(default)]
    pub debug_response_header: bool,
    /// The rules (at most 64), see [`RuleConfig`].
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
}

/// One rule: when `when` matches, turn `activate` on and `deactivate` off.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Unique name, used in metrics (`[A-Za-z0-9_-]`, at most 64 bytes).
    pub name: String,
    /// Higher priority decides first; ties go to the rule listed first.
    #[serde(default)]
    pub priority: i32,
    /// Condition; a rule without one always matches.
    #[serde(default)]
    pub when: Option<Condition>,
    /// Observers this rule turns on.
    #[serde(default)]
    pub activate: Vec<String>,
    /// Observers this rule turns off (none of them also in `activate`).
    #[serde(default)]
    pub deactivate: Vec<String>,
}

/// A condition on the request.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Condition {
    /// Test one request header.
    Header(HeaderCondition),
    /// The tenant is one of the listed values.
    Tenant(InList),
    /// Test the request path (without its query string).
    Path(PathCondition),
    /// The method is one of the listed values (case-insensitive).
    Method(InList),
    /// Hour of day in `[from, to)`, in the configured UTC offset; wraps past midnight.
    Hours(HoursRange),
    /// Weekday in `from..=to`, in the configured UTC offset; wraps past Sunday.
    Weekdays(WeekdayRange),
    /// A consistent share of requests, by `xxh3(x-request-id)`; 0–100, two decimals.
    Percent(f64),
    /// Every sub-condition holds (true when empty).
    All(Vec<Condition>),
    /// At least one sub-condition holds (false when empty).
    Any(Vec<Condition>),
    /// The sub-condition does not hold.
    Not(Box<Condition>),
}

/// `{"name": …}` plus exactly one of `exists`, `equals`, `in`, `matches`.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct HeaderCondition {
    /// Header name (case-insensitive).
    pub name: String,
    /// `true`: present; `false`: absent.
    #[serde(default)]
    pub exists: Option<bool>,
    /// The value equals this exactly.
    #[serde(default)]
    pub equals: Option<String>,
    /// The value is one of these exactly.
    #[serde(default, rename = "in")]
    pub one_of: Option<Vec<String>>,
    /// The value matches this regular expression (Rust `regex` syntax, unanchored).
    #[serde(default)]
    pub matches: Option<String>,
}

/// `{"in": [...]}`.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct InList {
    /// The accepted values.
    #[serde(rename = "in")]
    pub values: Vec<String>,
}

/// Exactly one of `prefix`, `matches`.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct PathCondition {
    /// The path starts with this.
    #[serde(default)]
    pub prefix: Option<String>,
    /// The path matches this regular expression (unanchored).
    #[serde(default)]
    pub matches: Option<String>,
}

/// Hours `[from, to)`, 0–24.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct HoursRange {
    /// First hour inside the range (0–23).
    pub from: u8,
    /// First hour after the range (1–24).
    pub to: u8,
}

/// Weekdays `from..=to`.
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct WeekdayRange {
    /// First day inside the range.
    pub from: Weekday,
    /// Last day inside the range.
    pub to: Weekday,
}

/// A day of the week, Monday first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "lowercase")]
#[allow(missing_docs)]
pub enum Weekday {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

impl Weekday {
    /// 0 for Monday … 6 for Sunday.
    pub fn index(self) -> u8 {
        self as u8
    }
}
