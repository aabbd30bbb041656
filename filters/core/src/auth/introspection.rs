//! Reading an API key introspection answer into a verdict: one place for
//! the observer (off-path) and the filter (synchronous checks).

use serde_json::Value;

use super::config::LazyAuthConfig;
use super::credential::TokenHash;
use super::verdict::Verdict;

/// Whether an answer is the verifier pushing back (429): not the
/// credential's failure and not the verifier's ill health, but a request
/// to slow down: nothing is stored, the breaker does not count it, and no
/// synchronous check calls the verifier again before its `retry-after`
/// ([`super::budget::THROTTLED_KEY`]).
pub fn is_back_pressure(status: Option<u16>) -> bool {
    status == Some(429)
}

/// The verdict an introspection answer gives, or `None` when the endpoint
/// did not really answer (no status, 5xx, 408, 429, anything unexpected):
/// then the caller must neither admit nor store anything, and the failure
/// is the verifier's (its breaker counts it). Any other 4xx is the
/// credential's own failure (an oversized or malformed key the endpoint
/// refuses): an invalid verdict, and the verifier answered — so no client
/// can open the breaker by sending keys the endpoint rejects.
pub fn verdict(
    config: &LazyAuthConfig,
    hash: &TokenHash,
    now: u64,
    status: Option<u16>,
    body: &[u8],
) -> Option<Verdict> {
    let api = config.api_keys.as_ref()?;
    let invalid = |reason: &str| {
        Some(Verdict::invalid(
            hash,
            now,
            config.negative_ttl_secs,
            reason,
        ))
    };
    match status {
        Some(200) => {
            let answer: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let m = &api.response;
            if !answer
                .pointer(&m.active)
                .and_then(Value::as_bool)
                .unwrap_or(false)
            {
                return invalid("inactive");
            }
            let text = |p: &str| {
                answer
                    .pointer(p)
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            Some(Verdict::verified(
                hash,
                now,
                answer.pointer(&m.expires_at).and_then(Value::as_u64),
                (config.verdict_max_ttl_secs, config.negative_ttl_secs),
                text(&m.tenant),
                text(&m.subject),
            ))
        }
        Some(401 | 403 | 404) => invalid("rejected"),
        Some(408 | 429) => None,
        Some(400..=499) => invalid("malformed"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LazyAuthConfig {
        LazyAuthConfig::from_json(
            br#"{"api_keys":{"cluster":"k","path":"/i"},"verdict_max_ttl_secs":300}"#,
        )
        .unwrap()
    }

    #[test]
    fn answers() {
        let c = config();
        let h = TokenHash::of(b"sk");
        let v = verdict(
            &c,
            &h,
            1000,
            Some(200),
            br#"{"active":true,"tenant":"acme","sub":"s","exp":1100}"#,
        )
        .unwrap();
        assert!(v.valid);
        assert_eq!(
            (v.tenant.as_deref(), v.subject.as_deref(), v.expires_at),
            (Some("acme"), Some("s"), 1100)
        );
        let v = verdict(&c, &h, 1000, Some(200), br#"{"active":true}"#).unwrap();
        assert_eq!(v.expires_at, 1300);
        for body in [&br#"{"active":false}"#[..], b"not json", b"{}"] {
            let v = verdict(&c, &h, 1000, Some(200), body).unwrap();
            assert!(!v.valid);
            assert_eq!(v.reason, "inactive");
        }
        assert_eq!(
            verdict(&c, &h, 1000, Some(403), b"").map(|v| v.reason),
            Some("rejected".into())
        );
        for status in [400, 413, 414, 422, 431] {
            assert_eq!(
                verdict(&c, &h, 1000, Some(status), b"").map(|v| (v.valid, v.reason)),
                Some((false, "malformed".into())),
                "{status}"
            );
        }
        for status in [408, 429, 500, 503, 302, 204] {
            assert_eq!(verdict(&c, &h, 1000, Some(status), b""), None, "{status}");
        }
        assert_eq!(verdict(&c, &h, 1000, None, b""), None);
    }
}
