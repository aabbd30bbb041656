//! The gateway's own answers (a refusal, a 503 "retry later", a 504 for
//! `only-if-cached`…), in the error format of the API the request called and
//! with the retry hints the official SDKs obey: `x-should-retry` decides
//! whether `openai` and `anthropic` retry (they otherwise retry 408, 409,
//! 429 and every 5xx twice), `retry-after` how long they wait, and the
//! request-id header each reads into `_request_id`.

use crate::cache::key::Provider;

/// The request-id response header an Anthropic client reads.
pub const ANTHROPIC_REQUEST_ID: &str = "request-id";

/// The request-id response header an OpenAI client reads (and Envoy's own).
pub const OPENAI_REQUEST_ID: &str = "x-request-id";

/// Whether a client should send the same request again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryHint {
    /// Never: the same request gets the same answer (`x-should-retry: false`).
    Never,
    /// After this many seconds (`retry-after`, `x-should-retry: true`).
    After(u32),
}

impl RetryHint {
    /// The hint an answer of `status` carries: a 429 or 503 from the
    /// gateway is worth retrying a second later, nothing else it answers is
    /// (a refused credential, a body it refuses, a 504 for `only-if-cached`).
    pub fn for_status(status: u16) -> RetryHint {
        match status {
            429 | 503 => RetryHint::After(1),
            _ => RetryHint::Never,
        }
    }
}

/// Seconds a `retry-after` value asks for (delta-seconds; an HTTP date or
/// anything else: `None`), at most an hour.
pub fn retry_after_secs(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?.trim();
    text.parse::<u64>().ok().map(|s| s.min(3600))
}

/// The request-id header a client of `provider`'s API reads.
pub fn request_id_header(provider: Option<Provider>) -> &'static str {
    match provider {
        Some(Provider::Anthropic) => ANTHROPIC_REQUEST_ID,
        Some(Provider::OpenAi) | None => OPENAI_REQUEST_ID,
    }
}

/// An error answer, ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// The status.
    pub status: u16,
    /// `content-type`, the retry hints and the request id.
    pub headers: Vec<(&'static str, String)>,
    /// The provider's error object.
    pub body: Vec<u8>,
}

/// The error answer to a request of `provider`'s API (`None`: any other
/// path, answered in OpenAI's format, the common one): Anthropic's
/// `{"type":"error","error":{"type","message"}}`, OpenAI's
/// `{"error":{"message","type","param","code"}}`; `kind` is the error
/// type (`authentication_error`, `invalid_request_error`, …).
pub fn error(
    provider: Option<Provider>,
    status: u16,
    kind: &str,
    message: &str,
    retry: RetryHint,
    request_id: Option<&str>,
) -> ErrorReply {
    error_with_code(provider, status, kind, None, message, retry, request_id)
}

/// [`error`] with OpenAI's `error.code` set (`rate_limit_exceeded`,
/// `insufficient_quota`: what OpenAI's own 429s carry); Anthropic's
/// error object has no code, so `code` is left out of it.
pub fn error_with_code(
    provider: Option<Provider>,
    status: u16,
    kind: &str,
    code: Option<&str>,
    message: &str,
    retry: RetryHint,
    request_id: Option<&str>,
) -> ErrorReply {
    let body = match provider {
        Some(Provider::Anthropic) => serde_json::json!({
            "type": "error",
            "error": {"type": kind, "message": message},
        }),
        Some(Provider::OpenAi) | None => serde_json::json!({
            "error": {"message": message, "type": kind, "param": null, "code": code},
        }),
    };
    let mut headers = vec![("content-type", "application/json".to_string())];
    match retry {
        RetryHint::Never => headers.push(("x-should-retry", "false".into())),
        RetryHint::After(secs) => {
            headers.push(("x-should-retry", "true".into()));
            headers.push(("retry-after", secs.to_string()));
        }
    }
    if let Some(id) = request_id.filter(|id| !id.is_empty()) {
        headers.push((request_id_header(provider), id.to_string()));
    }
    ErrorReply {
        status,
        headers,
        body: body.to_string().into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn header<'a>(reply: &'a ErrorReply, name: &str) -> Option<&'a str> {
        reply
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn each_provider_gets_its_own_error_object() {
        let anthropic = error(
            Some(Provider::Anthropic),
            401,
            "authentication_error",
            "invalid credential",
            RetryHint::Never,
            Some("r-1"),
        );
        let body: Value = serde_json::from_slice(&anthropic.body).unwrap();
        assert_eq!(
            body,
            json!({"type":"error","error":{"type":"authentication_error","message":"invalid credential"}})
        );
        assert_eq!(header(&anthropic, "request-id"), Some("r-1"));
        assert_eq!(header(&anthropic, "x-request-id"), None);

        let openai = error(
            Some(Provider::OpenAi),
            400,
            "invalid_request_error",
            "bad",
            RetryHint::Never,
            Some("r-2"),
        );
        let body: Value = serde_json::from_slice(&openai.body).unwrap();
        assert_eq!(
            body,
            json!({"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}})
        );
        assert_eq!(header(&openai, "x-request-id"), Some("r-2"));
        // Any other path: OpenAI's shape, which has `error.type` and `.message` too.
        let other = error(
            None,
            401,
            "authentication_error",
            "m",
            RetryHint::Never,
            None,
        );
        assert_eq!(other.body, openai_body("m", "authentication_error"));
        assert_eq!(header(&other, "x-request-id"), None);
    }

    fn openai_body(message: &str, kind: &str) -> Vec<u8> {
        json!({"error":{"message":message,"type":kind,"param":null,"code":null}})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn retry_hints_say_what_the_sdks_should_do() {
        for status in [400, 401, 403, 413, 431, 500, 504] {
            assert_eq!(RetryHint::for_status(status), RetryHint::Never, "{status}");
        }
        for status in [429, 503] {
            assert_eq!(
                RetryHint::for_status(status),
                RetryHint::After(1),
                "{status}"
            );
        }
        let never = error(None, 504, "cache_miss", "m", RetryHint::Never, None);
        assert_eq!(header(&never, "x-should-retry"), Some("false"));
        assert_eq!(header(&never, "retry-after"), None);
        let later = error(None, 503, "api_error", "m", RetryHint::After(2), None);
        assert_eq!(header(&later, "x-should-retry"), Some("true"));
        assert_eq!(header(&later, "retry-after"), Some("2"));
        assert_eq!(header(&later, "content-type"), Some("application/json"));
    }
}
