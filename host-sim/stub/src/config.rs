//! The stub's knobs: the GPU latency profile, the `Cache-Control` it sends and
//! the fault it injects, each overridable per request by an `x-stub-*` header.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How a [`Stub`](crate::Stub) behaves when a request does not say otherwise.
///
/// Every knob has a per-request header override (see the crate README).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StubConfig {
    /// Time to first token: from the request's arrival to the first body byte.
    pub ttft: Duration,
    /// Inter-token latency: the gap between two generated tokens.
    pub itl: Duration,
    /// `Cache-Control` value sent on every response; empty means no header.
    pub cache_control: String,
    /// The fault injected into every request, if any.
    pub fault: Option<Fault>,
    /// A fixed completion length in tokens instead of the per-request 8..=40.
    pub output_tokens: Option<u32>,
    /// Seconds advertised in `Retry-After` on 429 and 503 faults.
    pub retry_after_secs: u32,
    /// Whether successful responses are gzip-compressed.
    pub compression: Compression,
}

/// How the stub compresses successful responses (`content-encoding: gzip`;
/// streams flushed per event, as compressing servers do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Compression {
    /// Never (the default).
    #[default]
    Off,
    /// When the request's `accept-encoding` accepts gzip, as a compressing
    /// backend behind a gateway does.
    Negotiated,
    /// Always, whatever the request accepts (a misbehaving backend).
    Always,
}

impl Default for StubConfig {
    fn default() -> Self {
        Self {
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            cache_control: "no-cache".to_owned(),
            fault: None,
            output_tokens: None,
            retry_after_secs: 1,
            compression: Compression::Off,
        }
    }
}

impl StubConfig {
    /// Sets the time to first token.
    #[must_use]
    pub fn ttft(mut self, ttft: Duration) -> Self {
        self.ttft = ttft;
        self
    }

    /// Sets the inter-token latency.
    #[must_use]
    pub fn itl(mut self, itl: Duration) -> Self {
        self.itl = itl;
        self
    }

    /// Sets the `Cache-Control` value; an empty string sends no header.
    #[must_use]
    pub fn cache_control(mut self, value: impl Into<String>) -> Self {
        self.cache_control = value.into();
        self
    }

    /// Sets the fault injected into every request (`None` for none).
    #[must_use]
    pub fn fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    /// Fixes every completion's natural length to `tokens` (at least 1).
    #[must_use]
    pub fn output_tokens(mut self, tokens: u32) -> Self {
        self.output_tokens = Some(tokens);
        self
    }

    /// Sets how successful responses are compressed.
    #[must_use]
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Sets the seconds advertised in `Retry-After` on 429 and 503 faults.
    #[must_use]
    pub fn retry_after_secs(mut self, secs: u32) -> Self {
        self.retry_after_secs = secs;
        self
    }
}

/// A failure the stub produces on demand (`x-stub-fault` header or config).
///
/// The text form, parsed by [`FromStr`] and printed by [`Display`](fmt::Display),
/// is `429`, `500`, `503`, `disconnect-after:<n>` or `stall-after:<n>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `429`: rate limited, with `Retry-After`.
    RateLimited,
    /// `500`: internal server error.
    Internal,
    /// `503`: overloaded, with `Retry-After`.
    Unavailable,
    /// `disconnect-after:<n>`: send `n` tokens, then drop the connection.
    DisconnectAfter(u32),
    /// `stall-after:<n>`: send `n` tokens, then nothing more while the client waits.
    StallAfter(u32),
}

impl Fault {
    /// The number of tokens sent before a mid-stream fault, if this is one.
    pub(crate) fn cut_after(self) -> Option<u32> {
        match self {
            Self::DisconnectAfter(n) | Self::StallAfter(n) => Some(n),
            Self::RateLimited | Self::Internal | Self::Unavailable => None,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RateLimited => f.write_str("429"),
            Self::Internal => f.write_str("500"),
            Self::Unavailable => f.write_str("503"),
            Self::DisconnectAfter(n) => write!(f, "disconnect-after:{n}"),
            Self::StallAfter(n) => write!(f, "stall-after:{n}"),
        }
    }
}

/// A fault specification that is not one of the documented forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "fault {input:?}: expected 429, 500, 503, disconnect-after:<n> or stall-after:<n> (n a token count)"
)]
pub struct FaultParseError {
    /// The text that failed to parse.
    pub input: String,
}

impl FromStr for Fault {
    type Err = FaultParseError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let error = || FaultParseError {
            input: input.to_owned(),
        };
        let count = |n: &str| n.trim().parse::<u32>().map_err(|_| error());
        match input.trim() {
            "429" => Ok(Self::RateLimited),
            "500" => Ok(Self::Internal),
            "503" => Ok(Self::Unavailable),
            other => match other.split_once(':') {
                Some(("disconnect-after", n)) => count(n).map(Self::DisconnectAfter),
                Some(("stall-after", n)) => count(n).map(Self::StallAfter),
                _ => Err(error()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_text_round_trips() {
        let table = [
            ("429", Fault::RateLimited),
            ("500", Fault::Internal),
            ("503", Fault::Unavailable),
            ("disconnect-after:3", Fault::DisconnectAfter(3)),
            ("stall-after:0", Fault::StallAfter(0)),
        ];
        for (text, fault) in table {
            assert_eq!(text.parse::<Fault>(), Ok(fault), "{text}");
            assert_eq!(fault.to_string(), text);
        }
    }

    #[test]
    fn bad_fault_text_names_the_input() {
        for text in ["", "404", "disconnect-after", "stall-after:x", "drop:1"] {
            let err = text.parse::<Fault>().unwrap_err();
            assert_eq!(err.input, text);
            assert!(err.to_string().contains("disconnect-after:<n>"), "{err}");
        }
    }

    #[test]
    fn defaults_match_providers() {
        let config = StubConfig::default();
        assert_eq!(config.ttft, Duration::ZERO);
        assert_eq!(config.itl, Duration::ZERO);
        assert_eq!(config.cache_control, "no-cache");
        assert_eq!(config.fault, None);
    }
}
