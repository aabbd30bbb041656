//! Token usage read from a response body as it passes, chunk by chunk, for
//! metering. Streams keep only the current event (the SSE parser) and parse
//! JSON only for the events that can carry usage; JSON bodies go through the
//! incremental [`TopLevelScanner`], which keeps only the top-level `usage`
//! and `model` values. Memory stays constant whatever the response's length.
//!
//! Where usage comes from:
//! - Anthropic stream: `message_start`'s `message.usage` (input and cache
//!   tokens, an early output count), then `message_delta`'s `usage` (the
//!   final output count). Fields merge: one present in a later event wins,
//!   since some compatible backends report input tokens in `message_delta`.
//! - OpenAI stream: a chunk with a non-null `usage` (sent before
//!   `data: [DONE]` when the request set `stream_options.include_usage`);
//!   the last such chunk wins.
//! - JSON bodies: the top-level `usage` and `model` members.

use std::borrow::Cow;

use serde::Deserialize;

use crate::cache::key::Provider;
use crate::sse::{SseEvent, SseParser};

use super::needle::Needle;
use super::scan::{TopLevelScanner, TopLevelValue, Wanted};

/// Longest model name kept; a longer one is not a model id and is dropped.
pub const MAX_MODEL_LEN: usize = 128;

/// Longest top-level `usage` value read from a JSON body (real ones are a few
/// hundred bytes); a longer one is reported as [`Missing::Oversized`].
pub const MAX_USAGE_JSON: usize = 4096;

/// Token counts of one response.
///
/// The providers count differently and the fields keep each one's meaning:
/// for Anthropic, `input_tokens` excludes the tokens read from or written to
/// the prompt cache (they are `cache_read_tokens` and
/// `cache_creation_tokens`); for OpenAI, `input_tokens` is `prompt_tokens`,
/// which includes the cached ones (`cache_read_tokens`, from
/// `prompt_tokens_details.cached_tokens`), and `cache_creation_tokens` is
/// always 0 (OpenAI reports no cache writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens (Anthropic: uncached only; OpenAI: all, cached included).
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the provider's prompt cache.
    pub cache_read_tokens: u64,
    /// Prompt tokens written to the provider's prompt cache (Anthropic only).
    pub cache_creation_tokens: u64,
}

/// The fields of [`Usage`] seen so far; `None` when not reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PartialUsage {
    /// See [`Usage::input_tokens`].
    pub input_tokens: Option<u64>,
    /// See [`Usage::output_tokens`].
    pub output_tokens: Option<u64>,
    /// See [`Usage::cache_read_tokens`].
    pub cache_read_tokens: Option<u64>,
    /// See [`Usage::cache_creation_tokens`].
    pub cache_creation_tokens: Option<u64>,
}

impl PartialUsage {
    fn is_empty(&self) -> bool {
        *self == PartialUsage::default()
    }

    /// Fields present in `later` replace this one's.
    pub(crate) fn merge(&mut self, later: PartialUsage) {
        self.input_tokens = later.input_tokens.or(self.input_tokens);
        self.output_tokens = later.output_tokens.or(self.output_tokens);
        self.cache_read_tokens = later.cache_read_tokens.or(self.cache_read_tokens);
        self.cache_creation_tokens = later.cache_creation_tokens.or(self.cache_creation_tokens);
    }
}

/// Why a response yields no [`Usage`]: metering must record a gap, never a
/// silent zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Missing {
    /// Nothing in the response carried usage (an OpenAI stream without
    /// `include_usage`, an error body, not JSON).
    #[error("the response reported no usage")]
    NotReported,
    /// Some counts were seen but not the final report (a stream cut before
    /// `message_delta`, or a usage object without input or output tokens).
    #[error(
        "the response's usage is incomplete (input {:?}, output {:?})",
        .0.input_tokens,
        .0.output_tokens
    )]
    Incomplete(PartialUsage),
    /// An event or value that should carry usage is not valid JSON of the
    /// expected shape (a count that is not a non-negative integer, say).
    #[error("the response's usage is not valid JSON of the expected shape")]
    Malformed,
    /// The usage value, or an SSE line, was longer than the bound kept.
    #[error("the response's usage is longer than the bound kept")]
    Oversized,
}

/// What [`UsageExtractor::finish`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extracted {
    /// The response's usage, or why there is none.
    pub usage: Result<Usage, Missing>,
    /// The model the response names (at most [`MAX_MODEL_LEN`] bytes).
    pub model: Option<String>,
}

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    /// Server-Sent Events (`text/event-stream`).
    EventStream,
    /// One JSON document.
    Json,
}

impl ResponseFormat {
    /// The format for a `content-type` header value: event stream for
    /// `text/event-stream` (any case, parameters ignored), JSON otherwise.
    pub fn from_content_type(value: &str) -> ResponseFormat {
        if crate::sse::is_event_stream(value.as_bytes()) {
            ResponseFormat::EventStream
        } else {
            ResponseFormat::Json
        }
    }
}

/// Keys read from JSON bodies, in the order of [`JsonKey`].
const JSON_WANTED: &[Wanted] = &[
    Wanted {
        key: b"usage",
        limit: MAX_USAGE_JSON,
    },
    // Room for a model name written entirely in `\uXXXX` escapes.
    Wanted {
        key: b"model",
        limit: MAX_MODEL_LEN * 6 + 2,
    },
];
const USAGE_KEY: usize = 0;

#[derive(Debug)]
enum Reader {
    Sse {
        parser: SseParser,
        /// OpenAI: the first data event was parsed for its `model`.
        model_tried: bool,
    },
    Json(TopLevelScanner),
}

/// What has been seen so far, whatever the framing.
#[derive(Debug, Default)]
struct Seen {
    usage: PartialUsage,
    /// The report that completes the usage arrived (`message_delta`'s usage,
    /// an OpenAI usage chunk, a JSON body's `usage`).
    final_seen: bool,
    malformed: bool,
    oversized: bool,
    model: Option<String>,
}

impl Seen {
    fn model(&mut self, model: &str) {
        if model.len() > MAX_MODEL_LEN {
            return;
        }
        // Reuse the buffer: OpenAI streams may name the model more than once.
        let slot = self.model.get_or_insert_with(String::new);
        slot.clear();
        slot.push_str(model);
    }
}

/// Reads a response body's token usage as its chunks pass.
#[derive(Debug)]
pub struct UsageExtractor {
    provider: Provider,
    reader: Reader,
    seen: Seen,
}

impl UsageExtractor {
    /// An extractor for a `provider` response framed as `format`.
    pub fn new(provider: Provider, format: ResponseFormat) -> UsageExtractor {
        let reader = match format {
            ResponseFormat::EventStream => Reader::Sse {
                parser: SseParser::new(),
                model_tried: false,
            },
            ResponseFormat::Json => Reader::Json(TopLevelScanner::new(JSON_WANTED)),
        };
        UsageExtractor {
            provider,
            reader,
            seen: Seen::default(),
        }
    }

    /// Feeds the next chunk of the response body.
    pub fn push(&mut self, chunk: &[u8]) {
        let provider = self.provider;
        let seen = &mut self.seen;
        match &mut self.reader {
            Reader::Sse {
                parser,
                model_tried,
            } => {
                parser.push(chunk, |event| match provider {
                    Provider::Anthropic => anthropic_event(event, seen),
                    Provider::OpenAi => openai_event(event, model_tried, seen),
                });
                seen.oversized |= parser.overflowed();
            }
            Reader::Json(scanner) => {
                scanner.push(chunk, |value| json_value(provider, value, seen));
            }
        }
    }

    /// The usage and model found in the chunks fed so far.
    pub fn finish(&self) -> Extracted {
        Extracted {
            usage: self.usage(),
            model: self.seen.model.clone(),
        }
    }

    /// The usage found in the chunks fed so far, or why there is none
    /// ([`finish`](Self::finish) without the model: nothing to allocate).
    pub fn usage(&self) -> Result<Usage, Missing> {
        let seen = &self.seen;
        match seen.usage {
            PartialUsage {
                input_tokens: Some(input_tokens),
                output_tokens: Some(output_tokens),
                cache_read_tokens,
                cache_creation_tokens,
            } if seen.final_seen => Ok(Usage {
                input_tokens,
                output_tokens,
                // Optional in both APIs: absent means none.
                cache_read_tokens: cache_read_tokens.unwrap_or(0),
                cache_creation_tokens: cache_creation_tokens.unwrap_or(0),
            }),
            partial if !partial.is_empty() => Err(Missing::Incomplete(partial)),
            _ if seen.malformed => Err(Missing::Malformed),
            _ if seen.oversized => Err(Missing::Oversized),
            _ => Err(Missing::NotReported),
        }
    }
}

/// Anthropic's `usage` object; `null` counts as absent.
#[derive(Deserialize)]
pub(crate) struct AnthropicUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

impl From<AnthropicUsage> for PartialUsage {
    fn from(usage: AnthropicUsage) -> PartialUsage {
        PartialUsage {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            cache_read_tokens: usage.cache_read_input_tokens,
            cache_creation_tokens: usage.cache_creation_input_tokens,
        }
    }
}

/// OpenAI's `usage` object.
#[derive(Deserialize)]
pub(crate) struct OpenAiUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<u64>,
}

impl From<OpenAiUsage> for PartialUsage {
    fn from(usage: OpenAiUsage) -> PartialUsage {
        PartialUsage {
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            cache_read_tokens: usage.prompt_tokens_details.and_then(|d| d.cached_tokens),
            cache_creation_tokens: None,
        }
    }
}

/// The parts of an Anthropic stream event that matter here; every other
/// member is skipped by serde without allocating.
#[derive(Deserialize)]
struct AnthropicEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    message: Option<AnthropicMessage<'a>>,
    usage: Option<AnthropicUsage>,
}

#[derive(Deserialize)]
struct AnthropicMessage<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    usage: Option<AnthropicUsage>,
}

/// An OpenAI chunk's `model` and `usage`.
#[derive(Deserialize)]
struct OpenAiChunk<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    usage: Option<OpenAiUsage>,
}

fn anthropic_event(event: SseEvent<'_>, seen: &mut Seen) {
    let named = match event.event {
        b"message_start" | b"message_delta" => true,
        // The documented stream names every event; a backend that leaves the
        // names out still says the type in the data.
        b"message" => {
            MESSAGE_START.find(event.data).is_some() || MESSAGE_DELTA.find(event.data).is_some()
        }
        _ => false,
    };
    if !named {
        return;
    }
    let Ok(parsed) = serde_json::from_slice::<AnthropicEvent<'_>>(event.data) else {
        seen.malformed = true;
        return;
    };
    let kind: &[u8] = match event.event {
        b"message" => parsed.kind.as_deref().map_or(b"", str::as_bytes),
        name => name,
    };
    match kind {
        b"message_start" => {
            if let Some(message) = parsed.message {
                if let Some(model) = message.model.as_deref() {
                    seen.model(model);
                }
                if let Some(usage) = message.usage {
                    seen.usage.merge(usage.into());
                }
            }
        }
        b"message_delta" => {
            if let Some(usage) = parsed.usage {
                seen.usage.merge(usage.into());
                seen.final_seen = true;
            }
        }
        _ => {}
    }
}

fn openai_event(event: SseEvent<'_>, model_tried: &mut bool, seen: &mut Seen) {
    if event.data == b"[DONE]" {
        return;
    }
    // Most chunks carry `"usage": null` or nothing: skip them without a parse,
    // except the first, which names the model.
    let carries = carries_usage(event.data);
    if !carries && *model_tried {
        return;
    }
    *model_tried = true;
    let Ok(chunk) = serde_json::from_slice::<OpenAiChunk<'_>>(event.data) else {
        seen.malformed |= carries;
        return;
    };
    if let Some(model) = chunk.model.as_deref() {
        seen.model(model);
    }
    if let Some(usage) = chunk.usage {
        // Each usage chunk is a whole, cumulative report.
        seen.usage = usage.into();
        seen.final_seen = true;
    }
}

fn json_value(provider: Provider, value: TopLevelValue<'_>, seen: &mut Seen) {
    let Some(raw) = value.raw else {
        seen.oversized |= value.index == USAGE_KEY;
        return;
    };
    if value.index != USAGE_KEY {
        if let Ok(model) = serde_json::from_slice::<Cow<'_, str>>(raw) {
            seen.model(&model);
        }
        return;
    }
    let usage = match provider {
        Provider::Anthropic => serde_json::from_slice::<Option<AnthropicUsage>>(raw)
            .map(|usage| usage.map(PartialUsage::from)),
        Provider::OpenAi => serde_json::from_slice::<Option<OpenAiUsage>>(raw)
            .map(|usage| usage.map(PartialUsage::from)),
    };
    match usage {
        Ok(Some(usage)) => {
            seen.usage = usage;
            seen.final_seen = true;
        }
        // `"usage": null` reports nothing.
        Ok(None) => {}
        Err(_) => seen.malformed = true,
    }
}

/// Whether `data` has a `"usage"` member whose value is not `null`. Inside a
/// JSON string a quote is escaped, so the bytes `"usage"` are (almost always)
/// a real key; a rare false positive costs only a parse.
pub(crate) fn carries_usage(data: &[u8]) -> bool {
    let mut rest = data;
    while let Some(at) = USAGE_KEY_BYTES.find(rest) {
        rest = rest.get(at + USAGE_KEY_BYTES.len()..).unwrap_or_default();
        let after = rest.trim_ascii_start();
        if let Some(value) = after.strip_prefix(b":")
            && !value.trim_ascii_start().starts_with(b"null")
        {
            return true;
        }
    }
    false
}

// Searched by a letter rarer than the quote in JSON text.
const USAGE_KEY_BYTES: Needle = Needle::new(b"\"usage\"", 4);
const MESSAGE_START: Needle = Needle::new(b"\"message_start\"", 8);
const MESSAGE_DELTA: Needle = Needle::new(b"\"message_delta\"", 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carries_usage_skips_null_and_string_values() {
        assert!(carries_usage(
            br#"{"choices":[],"usage":{"prompt_tokens":1}}"#
        ));
        assert!(carries_usage(br#"{"usage" : 3}"#));
        assert!(!carries_usage(br#"{"choices":[],"usage":null}"#));
        assert!(!carries_usage(br#"{"usage" :  null}"#));
        assert!(!carries_usage(br#"{"a":"usage"}"#));
        assert!(!carries_usage(br#"{"a":"say \"usage\": 1"}"#));
        assert!(carries_usage(br#"{"usage":null,"x":{"usage":{}}}"#));
        assert!(!carries_usage(b""));
    }

    #[test]
    fn content_type_picks_the_format() {
        for (value, format) in [
            ("text/event-stream", ResponseFormat::EventStream),
            (
                "Text/Event-Stream; charset=utf-8",
                ResponseFormat::EventStream,
            ),
            (" text/event-stream ", ResponseFormat::EventStream),
            ("application/json", ResponseFormat::Json),
            ("", ResponseFormat::Json),
        ] {
            assert_eq!(ResponseFormat::from_content_type(value), format, "{value}");
        }
    }
}
