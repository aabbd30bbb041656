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

/// Room for the longest header value written: a `u64` (20 digits), a
/// duration of `u64` milliseconds (`5124095576030h25m52s`, 20), an RFC
/// 3339 time (20 until the year 9999; 25 at `u64::MAX` ms).
const MAX_VALUE: usize = 32;

/// The rate-limit headers of one response, formatted in place: written on
/// every response a policy scopes, so no allocation per header.
#[derive(Clone, Copy)]
pub struct RateLimitHeaders {
    headers: [FormattedHeader; 6],
    count: usize,
}

impl RateLimitHeaders {
    /// Appends header `name` with the value `write` formats (cut at
    /// [`MAX_VALUE`] bytes, which no value reaches).
    fn push(&mut self, name: &'static str, write: impl FnOnce(&mut FormattedHeader)) {
        if let Some(header) = self.headers.get_mut(self.count) {
            header.name = name;
            write(header);
            self.count += 1;
        }
    }

    /// The headers, in order: name and value.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> + '_ {
        self.headers
            .iter()
            .take(self.count)
            .map(|h| (h.name, h.as_str()))
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are none (no policy of a unit scopes the request).
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The value of header `name`, if written.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

impl std::fmt::Debug for RateLimitHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl PartialEq for RateLimitHeaders {
    fn eq(&self, other: &RateLimitHeaders) -> bool {
        self.iter().eq(other.iter())
    }
}

/// One header, its value formatted on the stack.
#[derive(Clone, Copy)]
struct FormattedHeader {
    name: &'static str,
    bytes: [u8; MAX_VALUE],
    len: usize,
}

impl FormattedHeader {
    /// Header `name`, its value not written yet.
    fn new(name: &'static str) -> FormattedHeader {
        FormattedHeader {
            name,
            bytes: [0; MAX_VALUE],
            len: 0,
        }
    }

    /// The value written.
    fn as_str(&self) -> &str {
        // Only ASCII is written.
        std::str::from_utf8(self.bytes.get(..self.len).unwrap_or_default()).unwrap_or_default()
    }
}

impl std::fmt::Write for FormattedHeader {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        let slot = self.bytes.get_mut(self.len..end).ok_or(std::fmt::Error)?;
        slot.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// The rate-limit headers for `shown` in `provider`'s naming (`None`: any
/// other path, OpenAI's).
pub fn rate_limit_headers(
    provider: Option<Provider>,
    shown: &Shown,
    now_ms: u64,
) -> RateLimitHeaders {
    let mut out = RateLimitHeaders {
        headers: [FormattedHeader::new(""); 6],
        count: 0,
    };
    write_rate_limit_headers(provider, shown, now_ms, |name, value| {
        out.push(name, |b| {
            let _ = b.write_str(value);
        });
    });
    out
}

/// Hands each of [`rate_limit_headers`] to `set` as it is formatted, in
/// one buffer on the stack: what a response pays per header is its digits.
pub fn write_rate_limit_headers(
    provider: Option<Provider>,
    shown: &Shown,
    now_ms: u64,
    mut set: impl FnMut(&'static str, &str),
) {
    let anthropic = provider == Some(Provider::Anthropic);
    let mut number = itoa::Buffer::new();
    for (state, tokens) in [(shown.requests, false), (shown.tokens, true)] {
        let Some(state) = state else {
            continue;
        };
        let [limit, remaining, reset] = match (anthropic, tokens) {
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
        set(limit, number.format(state.limit));
        set(remaining, number.format(state.remaining));
        let mut value = FormattedHeader::new(reset);
        let _ = if anthropic {
            write_rfc3339(&mut value, state.reset_at_ms / 1000)
        } else {
            write_duration(&mut value, state.reset_at_ms.saturating_sub(now_ms))
        };
        set(reset, value.as_str());
    }
}

/// `ms` as OpenAI writes a reset (Go's duration style, whole seconds):
/// `20ms`, `1s`, `6m0s`, `1h2m3s`.
pub fn duration(ms: u64) -> String {
    let mut out = String::new();
    let _ = write_duration(&mut out, ms);
    out
}

// Written with `itoa` and fixed-width digits rather than `write!`: these
// run on every response a policy scopes (`core::fmt` was most of their cost).
fn write_duration(out: &mut impl std::fmt::Write, ms: u64) -> std::fmt::Result {
    let mut number = itoa::Buffer::new();
    if ms < 1000 {
        out.write_str(number.format(ms))?;
        return out.write_str("ms");
    }
    let secs = ms.div_ceil(1000);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        out.write_str(number.format(h))?;
        out.write_str("h")?;
        out.write_str(number.format(m))?;
        out.write_str("m")?;
    } else if m > 0 {
        out.write_str(number.format(m))?;
        out.write_str("m")?;
    }
    out.write_str(number.format(s))?;
    out.write_str("s")
}

/// Unix seconds as an RFC 3339 UTC time (`2026-12-03T16:00:00Z`).
pub fn rfc3339(unix_secs: u64) -> String {
    let mut out = String::new();
    let _ = write_rfc3339(&mut out, unix_secs);
    out
}

fn write_rfc3339(out: &mut impl std::fmt::Write, unix_secs: u64) -> std::fmt::Result {
    let secs = i64::try_from(unix_secs).unwrap_or(i64::MAX / 2);
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    let mut text = *b"0000-00-00T00:00:00Z";
    let fields = [
        (0..4, y),
        (5..7, i64::from(mo)),
        (8..10, i64::from(d)),
        (11..13, t / 3600),
        (14..16, t / 60 % 60),
        (17..19, t % 60),
    ];
    // Past year 9999 (from `u64::MAX` ms) the year is written as long as
    // it is, and the template from its first `-`.
    let four_digit_year = (0..10_000).contains(&y);
    if !four_digit_year {
        out.write_str(itoa::Buffer::new().format(y))?;
    }
    for (at, value) in fields {
        let mut rest = value.unsigned_abs();
        for slot in text.get_mut(at).unwrap_or_default().iter_mut().rev() {
            *slot = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
    }
    let from = if four_digit_year { 0 } else { 4 };
    // Only ASCII digits and separators were written.
    let text = text.get(from..).unwrap_or_default();
    out.write_str(std::str::from_utf8(text).unwrap_or_default())
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
