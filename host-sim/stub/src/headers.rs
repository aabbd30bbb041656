//! Request headers that override the [`StubConfig`] for one request.
//!
//! A malformed override is answered with 400 in the provider's error shape,
//! naming the header.

use std::time::Duration;

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use crate::config::{Fault, StubConfig};

/// Time to first token in milliseconds (overrides [`StubConfig::ttft`]).
pub const TTFT_MS: &str = "x-stub-ttft-ms";
/// Inter-token latency in milliseconds (overrides [`StubConfig::itl`]).
pub const ITL_MS: &str = "x-stub-itl-ms";
/// The response's `Cache-Control`; empty for none (overrides [`StubConfig::cache_control`]).
pub const CACHE_CONTROL: &str = "x-stub-cache-control";
/// A [`Fault`] in its text form, or `none` (overrides [`StubConfig::fault`]).
pub const FAULT: &str = "x-stub-fault";
/// A fixed natural completion length (overrides [`StubConfig::output_tokens`]).
pub const OUTPUT_TOKENS: &str = "x-stub-output-tokens";

/// `name=value`: a header added to the response (repeatable), so tests can
/// play a backend that sends headers only the gateway may set.
pub const RESPONSE_HEADER: &str = "x-stub-response-header";

/// The configuration in force for one request: config defaults, then headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestOptions {
    pub ttft: Duration,
    pub itl: Duration,
    pub cache_control: Option<HeaderValue>,
    pub fault: Option<Fault>,
    pub output_tokens: Option<u32>,
    pub response_headers: Vec<(HeaderName, HeaderValue)>,
}

impl RequestOptions {
    /// Applies `headers` over `config`, whose `Cache-Control` was validated
    /// at start as `cache_control`. The error names the bad header.
    pub(crate) fn resolve(
        config: &StubConfig,
        cache_control: Option<&HeaderValue>,
        headers: &HeaderMap,
    ) -> Result<Self, String> {
        let millis = |name| number(headers, name).map(|ms| ms.map(Duration::from_millis));
        let fault = match text(headers, FAULT)? {
            None => config.fault,
            Some("none") => None,
            Some(fault) => Some(
                fault
                    .parse::<Fault>()
                    .map_err(|e| format!("{FAULT}: {e}"))?,
            ),
        };
        let cache_control = match headers.get(CACHE_CONTROL) {
            None => cache_control.cloned(),
            Some(value) if value.is_empty() => None,
            Some(value) => Some(value.clone()),
        };
        let output_tokens = match number(headers, OUTPUT_TOKENS)? {
            Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            None => config.output_tokens,
        };
        let mut response_headers = Vec::new();
        for value in headers.get_all(RESPONSE_HEADER) {
            let pair = value
                .to_str()
                .ok()
                .and_then(|v| v.split_once('='))
                .and_then(|(name, value)| {
                    Some((
                        HeaderName::from_bytes(name.trim().as_bytes()).ok()?,
                        HeaderValue::from_str(value.trim()).ok()?,
                    ))
                })
                .ok_or_else(|| format!("{RESPONSE_HEADER}: expected name=value"))?;
            response_headers.push(pair);
        }
        Ok(Self {
            ttft: millis(TTFT_MS)?.unwrap_or(config.ttft),
            itl: millis(ITL_MS)?.unwrap_or(config.itl),
            cache_control,
            fault,
            output_tokens,
            response_headers,
        })
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, String> {
    headers
        .get(name)
        .map(|value| {
            value
                .to_str()
                .map(str::trim)
                .map_err(|_| format!("{name}: expected visible ASCII text"))
        })
        .transpose()
}

fn number(headers: &HeaderMap, name: &str) -> Result<Option<u64>, String> {
    text(headers, name)?
        .map(|value| {
            value
                .parse::<u64>()
                .map_err(|_| format!("{name}: expected a non-negative integer, got {value:?}"))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(pairs: &[(&'static str, &'static str)]) -> Result<RequestOptions, String> {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_static(value));
        }
        let config = StubConfig::default()
            .ttft(Duration::from_millis(5))
            .fault(Some(Fault::Internal));
        let cache_control = HeaderValue::from_static("no-cache");
        RequestOptions::resolve(&config, Some(&cache_control), &headers)
    }

    #[test]
    fn config_applies_without_headers() {
        let options = resolve(&[]).unwrap();
        assert_eq!(options.ttft, Duration::from_millis(5));
        assert_eq!(options.itl, Duration::ZERO);
        assert_eq!(options.cache_control.unwrap(), "no-cache");
        assert_eq!(options.fault, Some(Fault::Internal));
        assert_eq!(options.output_tokens, None);
    }

    #[test]
    fn headers_override_config() {
        let options = resolve(&[
            (TTFT_MS, "150"),
            (ITL_MS, " 20 "),
            (CACHE_CONTROL, "max-age=60"),
            (FAULT, "stall-after:2"),
            (OUTPUT_TOKENS, "12"),
        ])
        .unwrap();
        assert_eq!(options.ttft, Duration::from_millis(150));
        assert_eq!(options.itl, Duration::from_millis(20));
        assert_eq!(options.cache_control.unwrap(), "max-age=60");
        assert_eq!(options.fault, Some(Fault::StallAfter(2)));
        assert_eq!(options.output_tokens, Some(12));
    }

    #[test]
    fn empty_cache_control_and_fault_none_switch_off() {
        let options = resolve(&[(CACHE_CONTROL, ""), (FAULT, "none")]).unwrap();
        assert_eq!(options.cache_control, None);
        assert_eq!(options.fault, None);
    }

    #[test]
    fn bad_values_name_the_header() {
        let table = [
            (
                (TTFT_MS, "soon"),
                "x-stub-ttft-ms: expected a non-negative integer, got \"soon\"",
            ),
            (
                (ITL_MS, "-1"),
                "x-stub-itl-ms: expected a non-negative integer, got \"-1\"",
            ),
            ((FAULT, "418"), "x-stub-fault: fault \"418\": expected 429"),
        ];
        for (header, message) in table {
            let err = resolve(&[header]).unwrap_err();
            assert!(err.starts_with(message), "{err}");
        }
    }
}
