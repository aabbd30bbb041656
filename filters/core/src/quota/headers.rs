//! What a client sees of its quota: the rate-limit headers in each
//! provider's naming, on every response a policy scopes, and the 429 (or
//! 503) the gateway answers a refused request with, in the provider's
//! error format ([`crate::reply`]) with the retry hint the official SDKs
//! obey.
//!
//! - OpenAI: `x-ratelimit-limit-{requests,tokens}`,
//!   `x-ratelimit-remaining-…`, `x-ratelimit-reset-…` (a duration such as
//!   `1s`, `6m0s`, `20ms`).
//! - Anthropic: `anthropic-ratelimit-{requests,tokens}-limit`, `-remaining`,
//!   `-reset` (an RFC 3339 time).
//!
//! A rate limit is `429` with `retry-after` = seconds until enough has
//! refilled (`x-should-retry: true`); an exhausted budget is `429` with
//! OpenAI's `insufficient_quota` and `x-should-retry: false` (the same
//! request gets the same answer until the window resets).

use std::fmt::Write as _;

use super::gateway::{LimitState, Refusal, RefusalKind};
use super::window::civil_from_days;
use crate::cache::key::Provider;
use crate::reply::{ErrorReply, RetryHint, error_with_code};

/// The state shown in the headers: the most constrained requests policy
/// and the most constrained token policy of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shown {
    /// The requests policy with the least left, if any.
    pub requests: Option<LimitState>,
    /// The token policy with the least left, if any.
    pub tokens: Option<LimitState>,
}

impl Shown {
    /// Adds one policy's state, keeping the one with the smallest share left.
    pub fn add(&mut self, state: LimitState) {
        let slot = if state.counts_tokens {
            &mut self.tokens
        } else {
            &mut self.requests
        };
        let tighter = |a: &LimitState, b: &LimitState| {
            u128::from(a.remaining) * u128::from(b.limit.max(1))
                < u128::from(b.remaining) * u128::from(a.limit.max(1))
        };
        match slot {
            Some(current) if !tighter(&state, current) => {}
            _ => *slot = Some(state),
        }
    }
}

/// The rate-limit headers for `shown` in `provider`'s naming (`None`: any
/// other path, OpenAI's).
pub fn rate_limit_headers(
    provider: Option<Provider>,
    shown: &Shown,
    now_ms: u64,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::with_capacity(6);
    let anthropic = provider == Some(Provider::Anthropic);
    for (state, tokens) in [(shown.requests, false), (shown.tokens, true)] {
        let Some(state) = state else {
            continue;
        };
        let names: [&'static str; 3] = match (anthropic, tokens) {
            (true, false) => [
                "anthropic-ratelimit-requests-limit",
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
            ],
            (true, true) => [
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-reset",
            ],
            (false, false) => [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            (false, true) => [
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
            ],
        };
        let reset = if anthropic {
            rfc3339(state.reset_at_ms / 1000)
        } else {
            duration(state.reset_at_ms.saturating_sub(now_ms))
        };
        out.push((names[0], state.limit.to_string()));
        out.push((names[1], state.remaining.to_string()));
        out.push((names[2], reset));
    }
    out
}

/// `ms` as OpenAI writes a reset (Go's duration style, whole seconds):
/// `20ms`, `1s`, `6m0s`, `1h2m3s`.
pub fn duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms.div_ceil(1000);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        let _ = write!(out, "{h}h{m}m");
    } else if m > 0 {
        let _ = write!(out, "{m}m");
    }
    let _ = write!(out, "{s}s");
    out
}

/// Unix seconds as an RFC 3339 UTC time (`2026-12-03T16:00:00Z`).
pub fn rfc3339(unix_secs: u64) -> String {
    let secs = i64::try_from(unix_secs).unwrap_or(i64::MAX / 2);
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

/// The answer to a request `refusal` refused, `policy` naming the policy,
/// with `headers` (the rate-limit headers) added.
pub fn refusal_reply(
    provider: Option<Provider>,
    refusal: &Refusal,
    policy: &str,
    tokens: bool,
    request_id: Option<&str>,
    headers: Vec<(&'static str, String)>,
) -> ErrorReply {
    let anthropic = provider == Some(Provider::Anthropic);
    let limited = if anthropic {
        "rate_limit_error"
    } else if tokens {
        "tokens"
    } else {
        "requests"
    };
    // Anthropic has no `insufficient_quota` type: its clients read the
    // status and `x-should-retry`.
    let exhausted = if anthropic {
        "rate_limit_error"
    } else {
        "insufficient_quota"
    };
    let (status, kind, code, message, retry) = match refusal.kind {
        RefusalKind::RateLimited { retry_after_secs } => (
            429,
            limited,
            Some("rate_limit_exceeded"),
            format!("Rate limit of policy {policy:?} reached; retry in {retry_after_secs}s."),
            RetryHint::After(secs(retry_after_secs)),
        ),
        RefusalKind::Refilling { retry_after_secs }
        | RefusalKind::TableFull { retry_after_secs } => (
            429,
            limited,
            Some("rate_limit_exceeded"),
            format!("Quota of policy {policy:?} is being refilled; retry in {retry_after_secs}s."),
            RetryHint::After(secs(retry_after_secs)),
        ),
        RefusalKind::BudgetExhausted {
            reset_at,
            remaining,
            amount,
        } => {
            let until = rfc3339(u64::try_from(reset_at).unwrap_or(0));
            // With some of it left, a smaller request may still fit: say
            // how much, and what this one may cost.
            let message = if remaining == 0 {
                format!("Budget of policy {policy:?} is exhausted until {until}.")
            } else {
                format!(
                    "Budget of policy {policy:?} has {remaining} left until {until}; this request may cost {amount}: lower max_tokens or the input."
                )
            };
            (
                429,
                exhausted,
                Some("insufficient_quota"),
                message,
                RetryHint::Never,
            )
        }
        RefusalKind::TooLarge { amount, limit } => (
            429,
            exhausted,
            Some("insufficient_quota"),
            format!(
                "Request may cost {amount}, more than policy {policy:?} allows ({limit}); lower max_tokens or the input."
            ),
            RetryHint::Never,
        ),
        RefusalKind::Unavailable { retry_after_secs } => (
            503,
            "api_error",
            None,
            format!("Quota of policy {policy:?} cannot be checked right now."),
            RetryHint::After(secs(retry_after_secs)),
        ),
    };
    let mut reply = error_with_code(provider, status, kind, code, &message, retry, request_id);
    reply.headers.extend(headers);
    reply
}

fn secs(s: u64) -> u32 {
    u32::try_from(s.clamp(1, 3600)).unwrap_or(3600)
}
