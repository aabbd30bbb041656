//! The activation rule engine: per request, decide which optional observers
//! (`audit`, `metering`, `cache`, operator-defined ones) run.
//!
//! Semantics, stated once and tested in `tests/activation_rules.rs`:
//! - Start from `defaults`.
//! - Evaluate every rule's `when` (a rule without `when` always matches).
//! - Order the matching rules by `priority` (higher first); equal priorities
//!   keep their order in the configuration.
//! - For each observer, the first matching rule in that order that lists it in
//!   `activate` or `deactivate` decides it. A rule may not list an observer in
//!   both. Observers no matching rule mentions keep their default.
//! - `percent` is consistent: `xxh3(x-request-id) mod 10000 < percent × 100`,
//!   false when the request has no id. `hours` is `[from, to)` and `weekdays`
//!   is `from..=to`, both in `utc_offset`, both wrapping. `path` conditions
//!   see the path without its query string. `method` compares ASCII
//!   case-insensitively; header and tenant values compare exactly.
//!
//! Activation never decides whether a request is authenticated: observers
//! are optional work, and no name starting with `auth` can be defined.

mod compile;
mod engine;
mod pattern;
mod schema;

pub use compile::{DEFAULT_TENANT_HEADER, MAX_DEPTH, MAX_RULES};
pub use engine::{
    Decision, HeaderSlot, RequestFacts, RuleMask, RuleSet, local_hour, local_weekday,
    path_without_query,
};
pub use schema::{
    ActivationConfig, Condition, HeaderCondition, HoursRange, InList, PathCondition, RuleConfig,
    Weekday, WeekdayRange,
};
