//! What clients see: rate-limit headers in OpenAI's and Anthropic's naming,
//! and the refusals in each provider's error format with the retry hints
//! the official SDKs obey.

use serde_json::{Value, json};
use zerolayer_core::cache::key::Provider;
use zerolayer_core::quota::gateway::{LimitState, Refusal, RefusalKind};
use zerolayer_core::quota::headers::{Shown, duration, rate_limit_headers, refusal_reply, rfc3339};
use zerolayer_core::reply::ErrorReply;

const NOW_MS: u64 = 1_796_315_634_000; // 2026-12-03T16:33:54Z

fn header<'a>(headers: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

fn shown() -> Shown {
    let mut s = Shown::default();
    s.add(LimitState {
        limit: 100,
        remaining: 40,
        reset_at_ms: NOW_MS + 6_000,
        counts_tokens: false,
    });
    s.add(LimitState {
        limit: 100_000,
        remaining: 90_000,
        reset_at_ms: NOW_MS + 360_000,
        counts_tokens: true,
    });
    // Tighter (10 % left): shown instead.
    s.add(LimitState {
        limit: 10_000,
        remaining: 1_000,
        reset_at_ms: NOW_MS + 26_000_000,
        counts_tokens: true,
    });
    s.add(LimitState {
        limit: 50,
        remaining: 49,
        reset_at_ms: NOW_MS,
        counts_tokens: false,
    });
    s
}

#[test]
fn openai_names_and_durations() {
    let h = rate_limit_headers(Some(Provider::OpenAi), &shown(), NOW_MS);
    assert_eq!(h.get("x-ratelimit-limit-requests"), Some("100"));
    assert_eq!(h.get("x-ratelimit-remaining-requests"), Some("40"));
    assert_eq!(h.get("x-ratelimit-reset-requests"), Some("6s"));
    assert_eq!(h.get("x-ratelimit-limit-tokens"), Some("10000"));
    assert_eq!(h.get("x-ratelimit-remaining-tokens"), Some("1000"));
    assert_eq!(h.get("x-ratelimit-reset-tokens"), Some("7h13m20s"));
    assert_eq!(h.len(), 6);
    assert_eq!(
        rate_limit_headers(None, &shown(), NOW_MS),
        h,
        "any other path: OpenAI's"
    );
    for (ms, text) in [
        (0, "0ms"),
        (20, "20ms"),
        (999, "999ms"),
        (1000, "1s"),
        (60_000, "1m0s"),
        (61_500, "1m2s"),
        (3_600_000, "1h0m0s"),
    ] {
        assert_eq!(duration(ms), text);
    }
}

#[test]
fn anthropic_names_and_times() {
    let h = rate_limit_headers(Some(Provider::Anthropic), &shown(), NOW_MS);
    assert_eq!(h.get("anthropic-ratelimit-requests-limit"), Some("100"));
    assert_eq!(h.get("anthropic-ratelimit-requests-remaining"), Some("40"));
    assert_eq!(
        h.get("anthropic-ratelimit-requests-reset"),
        Some("2026-12-03T16:34:00Z")
    );
    assert_eq!(h.get("anthropic-ratelimit-tokens-limit"), Some("10000"));
    assert_eq!(
        h.get("anthropic-ratelimit-tokens-reset"),
        Some("2026-12-03T23:47:14Z")
    );
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert!(rate_limit_headers(Some(Provider::Anthropic), &Shown::default(), NOW_MS).is_empty());
}

#[test]
fn the_largest_values_are_written_whole() {
    for provider in [Provider::OpenAi, Provider::Anthropic] {
        let mut s = Shown::default();
        for counts_tokens in [false, true] {
            s.add(LimitState {
                limit: u64::MAX,
                remaining: u64::MAX,
                reset_at_ms: u64::MAX,
                counts_tokens,
            });
        }
        let h = rate_limit_headers(Some(provider), &s, 0);
        assert_eq!(h.len(), 6);
        let reset = if provider == Provider::Anthropic {
            rfc3339(u64::MAX / 1000)
        } else {
            duration(u64::MAX)
        };
        for (name, value) in h.iter() {
            let expected = if name.ends_with("reset") || name.contains("-reset-") {
                reset.clone()
            } else {
                u64::MAX.to_string()
            };
            assert_eq!(value, expected, "{name}");
        }
    }
}

/// The RFC 3339 time of `unix_secs` as httpdate writes the same instant
/// (`Thu, 03 Dec 2026 16:33:54 GMT`, years 1970–9999).
fn rfc3339_by_httpdate(unix_secs: u64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_secs);
    let http = httpdate::fmt_http_date(at);
    let parts: Vec<&str> = http.split([' ', ',']).filter(|p| !p.is_empty()).collect();
    let [_, day, month, year, time, _] = parts[..] else {
        panic!("httpdate wrote {http}");
    };
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = months.iter().position(|m| *m == month).unwrap() + 1;
    format!("{year}-{month:02}-{day}T{time}Z")
}

proptest::proptest! {
    /// The headers' times and durations, written digit by digit on the
    /// response path, are the calendar's and Go's duration style.
    #[test]
    fn reset_times_and_durations_are_written_as_the_references_write_them(
        secs in 0u64..253_402_300_800,
        ms in proptest::prelude::any::<u64>(),
    ) {
        proptest::prop_assert_eq!(rfc3339(secs), rfc3339_by_httpdate(secs));
        let expected = if ms < 1000 {
            format!("{ms}ms")
        } else {
            let s = ms.div_ceil(1000);
            match (s / 3600, s / 60 % 60, s % 60) {
                (0, 0, sec) => format!("{sec}s"),
                (0, m, sec) => format!("{m}m{sec}s"),
                (h, m, sec) => format!("{h}h{m}m{sec}s"),
            }
        };
        proptest::prop_assert_eq!(duration(ms), expected);
    }
}

fn body(reply: &ErrorReply) -> Value {
    serde_json::from_slice(&reply.body).unwrap()
}

#[test]
fn a_rate_limit_is_a_429_to_retry_after_the_refill() {
    let refusal = Refusal {
        policy: 0,
        kind: RefusalKind::RateLimited {
            retry_after_secs: 7,
        },
    };
    let extra = vec![("x-ratelimit-remaining-tokens", "0".to_string())];
    let openai = refusal_reply(
        Some(Provider::OpenAi),
        &refusal,
        "tpm",
        true,
        Some("r-1"),
        extra.clone(),
    );
    assert_eq!(openai.status, 429);
    assert_eq!(
        body(&openai),
        json!({"error": {"message": "Rate limit of policy \"tpm\" reached; retry in 7s.", "type": "tokens",
                         "param": null, "code": "rate_limit_exceeded"}})
    );
    assert_eq!(header(&openai.headers, "retry-after"), Some("7"));
    assert_eq!(header(&openai.headers, "x-should-retry"), Some("true"));
    assert_eq!(header(&openai.headers, "x-request-id"), Some("r-1"));
    assert_eq!(
        header(&openai.headers, "x-ratelimit-remaining-tokens"),
        Some("0")
    );
    let anthropic = refusal_reply(
        Some(Provider::Anthropic),
        &refusal,
        "tpm",
        true,
        Some("r-2"),
        vec![],
    );
    assert_eq!(body(&anthropic)["type"], "error");
    assert_eq!(body(&anthropic)["error"]["type"], "rate_limit_error");
    assert_eq!(header(&anthropic.headers, "request-id"), Some("r-2"));
    // A lease being refilled reads the same to a client: retry shortly.
    let refilling = Refusal {
        policy: 0,
        kind: RefusalKind::Refilling {
            retry_after_secs: 1,
        },
    };
    let r = refusal_reply(None, &refilling, "rpm", false, None, vec![]);
    assert_eq!(
        (r.status, body(&r)["error"]["type"].as_str()),
        (429, Some("requests"))
    );
    assert_eq!(header(&r.headers, "retry-after"), Some("1"));
}

#[test]
fn an_exhausted_budget_is_a_429_not_to_retry() {
    let refusal = Refusal {
        policy: 0,
        kind: RefusalKind::BudgetExhausted {
            reset_at: 1_796_342_400,
            remaining: 0,
            amount: 1_300,
        },
    };
    let openai = refusal_reply(
        Some(Provider::OpenAi),
        &refusal,
        "monthly",
        true,
        None,
        vec![],
    );
    assert_eq!(openai.status, 429);
    assert_eq!(
        body(&openai),
        json!({"error": {"message": "Budget of policy \"monthly\" is exhausted until 2026-12-04T00:00:00Z.",
                         "type": "insufficient_quota", "param": null, "code": "insufficient_quota"}})
    );
    assert_eq!(header(&openai.headers, "x-should-retry"), Some("false"));
    assert_eq!(header(&openai.headers, "retry-after"), None);
    let anthropic = refusal_reply(
        Some(Provider::Anthropic),
        &refusal,
        "monthly",
        true,
        None,
        vec![],
    );
    assert_eq!(body(&anthropic)["error"]["type"], "rate_limit_error");
    assert_eq!(header(&anthropic.headers, "x-should-retry"), Some("false"));
    // Some of it left, less than this request may cost: both are said.
    let short = Refusal {
        policy: 0,
        kind: RefusalKind::BudgetExhausted {
            reset_at: 1_796_342_400,
            remaining: 217,
            amount: 1_300,
        },
    };
    let r = refusal_reply(
        Some(Provider::OpenAi),
        &short,
        "monthly",
        true,
        None,
        vec![],
    );
    assert_eq!(
        body(&r)["error"]["message"],
        "Budget of policy \"monthly\" has 217 left until 2026-12-04T00:00:00Z; this request may cost 1300: lower max_tokens or the input."
    );
    assert_eq!(
        (r.status, header(&r.headers, "x-should-retry")),
        (429, Some("false"))
    );
    let too_large = Refusal {
        policy: 0,
        kind: RefusalKind::TooLarge {
            amount: 10_100,
            limit: 400,
        },
    };
    let r = refusal_reply(None, &too_large, "d", true, None, vec![]);
    assert_eq!(
        (r.status, header(&r.headers, "x-should-retry")),
        (429, Some("false"))
    );
    // fail_closed while the store is gone: a 503 to retry.
    let down = Refusal {
        policy: 0,
        kind: RefusalKind::Unavailable {
            retry_after_secs: 1,
        },
    };
    let r = refusal_reply(None, &down, "d", true, None, vec![]);
    assert_eq!(
        (r.status, header(&r.headers, "x-should-retry")),
        (503, Some("true"))
    );
    assert_eq!(body(&r)["error"]["type"], "api_error");
}
