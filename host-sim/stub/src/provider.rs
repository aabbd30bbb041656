//! What the two APIs have in common: a validated chat request, the reply the
//! stub generates for it, and the provider-neutral error kinds. Each
//! provider's module owns its wire format.

use bytes::Bytes;
use hyper::StatusCode;
use xxhash_rust::xxh3::xxh3_128;

use crate::completion::Completion;
use crate::{anthropic, openai};

/// The API a request speaks, which decides every byte of the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Provider {
    /// Anthropic Messages (`/v1/messages`).
    Anthropic,
    /// OpenAI Chat Completions (`/v1/chat/completions`).
    OpenAi,
}

/// A request the stub answers: the fields every later step needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChatRequest {
    /// The requested model, echoed back.
    pub model: String,
    /// Input tokens by the [tokenizer](crate::tokenizer) rule.
    pub input_tokens: u32,
    /// The request's output limit, if it has one.
    pub max_tokens: Option<u32>,
    /// Whether the client asked for a server-sent events stream.
    pub stream: bool,
    /// OpenAI `stream_options.include_usage`: add the usage chunk.
    pub include_usage: bool,
    /// The completion seed (see [`crate::completion`]).
    pub seed: u64,
}

/// Everything a response carries, in either format.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    /// `msg_…` or `chatcmpl-…`, unique per served request.
    pub id: String,
    /// The requested model.
    pub model: String,
    /// Unix seconds (OpenAI's `created`).
    pub created: u64,
    /// Input tokens.
    pub input_tokens: u32,
    /// The generated answer.
    pub completion: Completion,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
}

/// A stream's events, split where the latency profile applies: `lead` goes
/// out with the first token, one `tokens` event per generated token (the
/// inter-token interval between them), then `tail` right after the last.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamPlan {
    /// Events before the first token event.
    pub lead: Vec<Bytes>,
    /// One event per output token.
    pub tokens: Vec<Bytes>,
    /// Terminal events.
    pub tail: Vec<Bytes>,
}

/// Errors the stub answers with, mapped to each provider's status and type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// 400: the request failed validation.
    InvalidRequest,
    /// 404: no such route.
    NotFound,
    /// 405: a known route with a method other than POST.
    MethodNotAllowed,
    /// 413: the body exceeds the stub's limit.
    TooLarge,
    /// 429: injected rate limit.
    RateLimited,
    /// 500: injected server error.
    Internal,
    /// 503: injected overload.
    Unavailable,
}

impl ErrorKind {
    /// The HTTP status of this error.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Self::InvalidRequest => StatusCode::BAD_REQUEST,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Whether the response advertises `Retry-After`.
    pub(crate) fn retries_after(self) -> bool {
        matches!(self, Self::RateLimited | Self::Unavailable)
    }
}

impl Provider {
    /// The provider serving `path`, if it is one of the two routes.
    pub(crate) fn for_path(path: &str) -> Option<Self> {
        match path {
            "/v1/messages" => Some(Self::Anthropic),
            "/v1/chat/completions" => Some(Self::OpenAi),
            _ => None,
        }
    }

    /// The error dialect for an unknown route: Anthropic's when the client
    /// looks like an Anthropic client, OpenAI's otherwise.
    pub(crate) fn guess(path: &str, has_anthropic_version: bool) -> Self {
        if has_anthropic_version || path.starts_with("/v1/messages") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }

    /// Validates a request body.
    pub(crate) fn parse(self, body: &[u8]) -> Result<ChatRequest, String> {
        match self {
            Self::Anthropic => anthropic::parse(body),
            Self::OpenAi => openai::parse(body),
        }
    }

    /// The header that carries the request id back to the client.
    pub(crate) fn request_id_header(self) -> &'static str {
        match self {
            Self::Anthropic => "request-id",
            Self::OpenAi => "x-request-id",
        }
    }

    /// A response id in the provider's style, unique per `sequence`.
    pub(crate) fn response_id(self, seed: u64, sequence: u64) -> String {
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..].copy_from_slice(&sequence.to_le_bytes());
        let entropy = xxh3_128(&key);
        match self {
            Self::Anthropic => format!("msg_{}", base62(entropy, 24)),
            Self::OpenAi => format!("chatcmpl-{}", base62(entropy, 21)),
        }
    }

    /// The non-streamed response body.
    pub(crate) fn body(self, reply: &Reply) -> Bytes {
        match self {
            Self::Anthropic => anthropic::message(reply),
            Self::OpenAi => openai::completion(reply),
        }
    }

    /// The streamed response's events.
    pub(crate) fn stream(self, reply: &Reply) -> StreamPlan {
        match self {
            Self::Anthropic => anthropic::stream(reply),
            Self::OpenAi => openai::stream(reply),
        }
    }

    /// The provider's error body.
    pub(crate) fn error(self, kind: ErrorKind, message: &str) -> Bytes {
        match self {
            Self::Anthropic => anthropic::error(kind, message),
            Self::OpenAi => openai::error(kind, message),
        }
    }
}

/// `len` base62 digits of `value` (ids only need to look the part).
fn base62(mut value: u128, len: usize) -> String {
    const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    (0..len)
        .map(|_| {
            let digit = DIGITS[usize::try_from(value % 62).unwrap_or(0)];
            value /= 62;
            char::from(digit)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_and_dialects() {
        assert_eq!(
            Provider::for_path("/v1/messages"),
            Some(Provider::Anthropic)
        );
        assert_eq!(
            Provider::for_path("/v1/chat/completions"),
            Some(Provider::OpenAi)
        );
        assert_eq!(Provider::for_path("/v1/messages/batches"), None);
        assert_eq!(
            Provider::guess("/v1/messages/count", false),
            Provider::Anthropic
        );
        assert_eq!(Provider::guess("/v2/anything", true), Provider::Anthropic);
        assert_eq!(Provider::guess("/v1/embeddings", false), Provider::OpenAi);
    }

    #[test]
    fn ids_look_like_the_providers_and_differ_per_request() {
        let a = Provider::Anthropic.response_id(1, 1);
        assert!(a.starts_with("msg_") && a.len() == 28, "{a}");
        assert_ne!(a, Provider::Anthropic.response_id(1, 2));
        let o = Provider::OpenAi.response_id(1, 1);
        assert!(o.starts_with("chatcmpl-") && o.len() == 30, "{o}");
    }
}
