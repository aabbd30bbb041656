//! quota's logic: token, request and spend limits enforced with no network
//! call on the request path, fleet-wide through Redis, with an overshoot
//! bounded by construction (lease and settle).
//!
//! - [`config`]: policies (scope from verified identity, unit, rate or
//!   calendar budget, enforce or shadow), the store, the fallback.
//! - [`reserve`]: a request's upper bound (input ≤ body bytes, output ≤ its
//!   `max_tokens` or the policy's default cap) and exact cost, in the unit.
//! - [`lease`]: one holder's share of a limit: reserve, draw, settle,
//!   refill, expiry and fallback.
//! - [`table`]: the bounded table of leases, keyed by exact scope key.
//! - [`gateway`]: the functions a stage and an observer call.
//! - [`late`]: requests admitted before verification, settled to the
//!   tenant the verification found.
//! - [`store`]: the Redis protocol as data (scripts, commands, replies,
//!   idempotent deltas) and a Rust model of it.
//! - [`window`]: calendar windows and the continuous refill of rates.
//! - [`headers`]: the rate-limit headers in each provider's naming.
//! - [`cut`]: a `stream: hard` response counted event by event as it
//!   passes, and ended cleanly in its provider's format when a draw is not
//!   covered.
//!
//! **The overshoot bound.** Every unit a holder may admit was debited
//! from the store's counter first (a grant never exceeds `limit − counter`),
//! except three things: a reservation may overdraw its lease by at most β
//! (`store.max_debt`) in total per holder; a stream under `stream: hard`
//! may draw one chunk past its lease before it is cut; and a request whose
//! true cost exceeds its upper bound (input the body only points to, a
//! backend ignoring `max_tokens`) settles as debt. With the bound holding,
//! for one counter of limit `L` shared by `N` holders and `Q` requests in
//! flight, streams drawing chunks of at most `g` units:
//!
//! ```text
//! settled ≤ L + Q·g + N·β
//! ```
//!
//! in every interleaving (`tests/quota_overshoot.rs` checks it against a
//! post-paid baseline, whose overshoot grows with `Q` times the largest
//! request). With the defaults (β = 0, `stream: soft`, so no stream draws
//! past its reservation: `g` = 0) the bound is `L` exactly. While the store
//! has been unreachable for two sync intervals and a lease is past its
//! expiry, `local_share` adds each holder's share `R_g / expected_gateways`
//! of the remainder `R_g` it last knew (at most `R` in total when no more
//! than `expected_gateways` holders share the counter); `fail_open` is
//! unbounded until the store is back; `fail_closed` adds nothing.
//! Requests admitted before their credential was verified settle to the
//! `unverified` budget (limit `L_u`) and, found valid, are charged to their
//! tenant too ([`late`]): a tenant then settles at most
//! `L + L_u + 2·(Q·g + N·β)`.

pub mod config;
pub mod cut;
pub mod gateway;
pub mod headers;
pub mod late;
pub mod lease;
pub mod reserve;
pub mod store;
pub mod table;
pub mod window;

pub use config::QuotaConfig;
pub use cut::StreamCut;
pub use gateway::{
    CallTarget, GatewayQuota, Identity, LimitState, PolicyStats, Refusal, RefusalKind, Settlement,
    StoreCall, StreamVerdict, Ticket,
};
pub use late::{LateCounts, LateScope};
pub use reserve::{RequestBound, TokenCounts};
