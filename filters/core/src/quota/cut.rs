//! A `stream: hard` response as it passes: its output counted event by
//! event, each count drawn from the lease ([`super::GatewayQuota::draw`]),
//! and, when a draw is not covered, the stream ended cleanly right after
//! that event in the provider's own format.
//!
//! **What is counted.** An event's output is the UTF-8 bytes of the text it
//! delivers (OpenAI `delta.content`, `refusal`, `reasoning_content`,
//! `reasoning`, tool and function call deltas; Anthropic `text`,
//! `thinking`, `partial_json`, a block's opening text): a byte-level BPE
//! token covers at least one byte, so the bytes bound the tokens. When an
//! event carries the provider's own cumulative count (an OpenAI chunk with
//! `usage`, as some backends send on every chunk; Anthropic's
//! `message_start` and `message_delta` usage) that count replaces the bound,
//! and the bytes delivered after it are added to it. The count is what the
//! client is billed for a cut stream.
//!
//! **Where it is cut.** Only at an event's end (the SSE parser reports where
//! each event ends in the chunk): the event whose draw was not covered is
//! delivered (it was charged), then [`StreamCut::end`] writes the provider's
//! end, and nothing after reaches the client. OpenAI: a chunk with
//! `finish_reason: "length"` per open choice, the usage chunk when the
//! client asked `include_usage`, `data: [DONE]`. Anthropic:
//! `content_block_stop` for an open block, `message_delta` with
//! `stop_reason: "max_tokens"` and the usage billed, `message_stop`. A
//! stream that already finished (a `finish_reason` for every choice, an
//! Anthropic `stop_reason`) draws nothing more and is never cut.
//!
//! Memory: the SSE parser's current event and, once, the OpenAI stream's
//! `id` and `model`; no event is held back (bytes before an event's end go
//! on as they come, since only its end decides).

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::cache::key::Provider;
use crate::sse::{SseEvent, SseParser};
use crate::usage::extract::{AnthropicUsage, OpenAiUsage};
use crate::usage::{PartialUsage, Usage};

/// Choices of an OpenAI stream told apart (indexes past it are choice 63's).
const MAX_CHOICES: u64 = 64;

/// A hard stream's response as it passes; see the module documentation.
#[derive(Debug)]
pub struct StreamCut {
    parser: SseParser,
    state: State,
}

#[derive(Debug)]
struct State {
    provider: Provider,
    /// OpenAI: the client itself asked for the usage chunk.
    client_usage: bool,
    /// The provider's last cumulative output count, if any.
    reported: Option<u64>,
    /// Text bytes delivered since that count.
    since: u64,
    /// The count last drawn.
    drawn: u64,
    /// Input counts the stream reported (Anthropic `message_start`).
    usage: PartialUsage,
    /// The stream finished by itself: nothing more is drawn or cut.
    finished: bool,
    /// Cut: the end was (to be) written; nothing more is read.
    cut: bool,
    /// OpenAI: the stream's `id`, `created` and `model` (from its first
    /// chunk naming them), the choices seen and those finished (bits).
    id: String,
    created: u64,
    model: String,
    choices: u64,
    choices_finished: u64,
    /// Anthropic: the content block started and not stopped.
    open_block: Option<u64>,
}

impl StreamCut {
    /// A cut for a `provider` event stream; `client_asked_usage`: the
    /// (OpenAI) request set `stream_options.include_usage` itself, so the
    /// end carries a usage chunk.
    pub fn new(provider: Provider, client_asked_usage: bool) -> StreamCut {
        StreamCut {
            parser: SseParser::new(),
            state: State {
                provider,
                client_usage: client_asked_usage && provider == Provider::OpenAi,
                reported: None,
                since: 0,
                drawn: 0,
                usage: PartialUsage::default(),
                finished: false,
                cut: false,
                id: String::new(),
                created: 0,
                model: String::new(),
                choices: 0,
                choices_finished: 0,
                open_block: None,
            },
        }
    }

    /// Feeds the next chunk of the body. `draw(output)` is called with the
    /// stream's output so far each time an event raises it, and answers
    /// whether to cut (the lease could not cover it). Returns where `chunk`
    /// is cut (the client gets its bytes before that offset, then
    /// [`StreamCut::end`]), or `None`. Once cut, every later chunk is cut at
    /// 0.
    pub fn push(&mut self, chunk: &[u8], mut draw: impl FnMut(u64) -> bool) -> Option<usize> {
        let state = &mut self.state;
        if state.cut {
            return Some(0);
        }
        let mut at = None;
        self.parser.push_framed(chunk, |event, end| {
            if state.event(event, &mut draw) {
                state.cut = true;
                at = Some(end);
                return false;
            }
            true
        });
        at
    }

    /// Whether the stream was cut.
    pub fn is_cut(&self) -> bool {
        self.state.cut
    }

    /// Whether the stream finished by itself.
    pub fn finished(&self) -> bool {
        self.state.finished
    }

    /// The output delivered so far (counted, or bounded by its bytes).
    pub fn output(&self) -> u64 {
        self.state.output()
    }

    /// The input the stream reported (`None`: not reported yet).
    pub fn reported_input(&self) -> Option<u64> {
        self.state.usage.input_tokens
    }

    /// What the client is billed for the stream so far: the input it
    /// reported (else `input_bound`, the request's bound) and the output
    /// delivered, in the provider's meaning of the fields (see [`Usage`]).
    pub fn billed(&self, input_bound: u64) -> Usage {
        let u = &self.state.usage;
        Usage {
            input_tokens: u.input_tokens.unwrap_or(input_bound),
            output_tokens: self.output(),
            cache_read_tokens: u.cache_read_tokens.unwrap_or(0),
            cache_creation_tokens: u.cache_creation_tokens.unwrap_or(0),
        }
    }

    /// Appends the stream's end, in its provider's format, to `out`, with
    /// the usage [`StreamCut::billed`] says.
    pub fn end(&self, input_bound: u64, out: &mut Vec<u8>) {
        let s = &self.state;
        let billed = self.billed(input_bound);
        match s.provider {
            Provider::OpenAi => {
                let head = format!(
                    r#"data: {{"id":{},"object":"chat.completion.chunk","created":{},"model":{}"#,
                    json_string(&s.id),
                    s.created,
                    json_string(&s.model)
                );
                let usage_null = if s.client_usage {
                    r#","usage":null"#
                } else {
                    ""
                };
                let open = match s.choices & !s.choices_finished {
                    0 if s.choices == 0 => 1,
                    open => open,
                };
                for index in (0..MAX_CHOICES).filter(|i| open & (1 << i) != 0) {
                    out.extend_from_slice(head.as_bytes());
                    out.extend_from_slice(
                        format!(
                            r#","choices":[{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":"length"}}]{usage_null}}}"#
                        )
                        .as_bytes(),
                    );
                    out.extend_from_slice(b"\n\n");
                }
                if s.client_usage {
                    let details = match s.usage.cache_read_tokens {
                        Some(cached) => {
                            format!(r#","prompt_tokens_details":{{"cached_tokens":{cached}}}"#)
                        }
                        None => String::new(),
                    };
                    out.extend_from_slice(head.as_bytes());
                    out.extend_from_slice(
                        format!(
                            r#","choices":[],"usage":{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{}{details}}}}}"#,
                            billed.input_tokens,
                            billed.output_tokens,
                            billed.input_tokens.saturating_add(billed.output_tokens),
                        )
                        .as_bytes(),
                    );
                    out.extend_from_slice(b"\n\n");
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            Provider::Anthropic => {
                if let Some(index) = s.open_block {
                    out.extend_from_slice(
                        format!(
                            "event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":{index}}}\n\n"
                        )
                        .as_bytes(),
                    );
                }
                let mut usage = format!(r#""input_tokens":{}"#, billed.input_tokens);
                if let Some(n) = s.usage.cache_creation_tokens {
                    usage.push_str(&format!(r#","cache_creation_input_tokens":{n}"#));
                }
                if let Some(n) = s.usage.cache_read_tokens {
                    usage.push_str(&format!(r#","cache_read_input_tokens":{n}"#));
                }
                out.extend_from_slice(
                    format!(
                        "event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null}},\"usage\":{{{usage},\"output_tokens\":{}}}}}\n\n",
                        billed.output_tokens
                    )
                    .as_bytes(),
                );
                out.extend_from_slice(
                    b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
                );
            }
        }
    }
}

impl State {
    fn output(&self) -> u64 {
        self.reported.unwrap_or(0).saturating_add(self.since)
    }

    /// One event: counts it; returns whether to cut right after it.
    fn event(&mut self, event: SseEvent<'_>, draw: &mut impl FnMut(u64) -> bool) -> bool {
        match self.provider {
            Provider::OpenAi => self.openai(event.data),
            Provider::Anthropic => self.anthropic(event),
        }
        let output = self.output();
        if self.finished || output <= self.drawn {
            return false;
        }
        self.drawn = output;
        draw(output)
    }

    fn report(&mut self, output: Option<u64>) {
        if let Some(n) = output {
            self.reported = Some(n);
            self.since = 0;
        }
    }

    fn openai(&mut self, data: &[u8]) {
        if data == b"[DONE]" {
            self.finished = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<OpenAiChunk<'_>>(data) else {
            // Not a chunk (an error event): it delivers no text.
            return;
        };
        if self.id.is_empty()
            && let Some(id) = chunk.id.as_deref()
        {
            self.id.push_str(id);
            self.created = chunk.created.unwrap_or(0);
        }
        if self.model.is_empty()
            && let Some(model) = chunk.model.as_deref()
        {
            self.model.push_str(model);
        }
        if let Some(choices) = chunk.choices {
            self.since = self.since.saturating_add(choices.text);
            self.choices |= choices.seen;
            self.choices_finished |= choices.finished;
            if self.choices != 0 && self.choices_finished == self.choices {
                self.finished = true;
            }
        }
        if let Some(usage) = chunk.usage {
            let usage = PartialUsage::from(usage);
            self.report(usage.output_tokens);
            // Each usage object is a whole, cumulative report.
            self.usage = PartialUsage {
                output_tokens: None,
                ..usage
            };
        }
    }

    fn anthropic(&mut self, event: SseEvent<'_>) {
        let Ok(parsed) = serde_json::from_slice::<AnthropicEvent<'_>>(event.data) else {
            return;
        };
        let kind: &[u8] = match event.event {
            b"message" => parsed.kind.as_deref().map_or(b"", str::as_bytes),
            name => name,
        };
        match kind {
            b"message_start" => {
                if let Some(usage) = parsed.message.and_then(|m| m.usage) {
                    self.anthropic_usage(usage);
                }
            }
            b"content_block_start" => {
                self.open_block = Some(parsed.index.unwrap_or(0));
                if let Some(block) = parsed.content_block {
                    self.since = self.since.saturating_add(block.0);
                }
            }
            b"content_block_delta" => {
                if let Some(delta) = parsed.delta {
                    self.since = self.since.saturating_add(delta.text());
                }
            }
            b"content_block_stop" => self.open_block = None,
            b"message_delta" => {
                if let Some(usage) = parsed.usage {
                    self.anthropic_usage(usage);
                }
                if parsed.delta.is_some_and(|d| d.stop_reason.is_some()) {
                    self.finished = true;
                }
            }
            b"message_stop" => self.finished = true,
            _ => {}
        }
    }

    fn anthropic_usage(&mut self, usage: AnthropicUsage) {
        let usage = PartialUsage::from(usage);
        self.report(usage.output_tokens);
        self.usage.merge(PartialUsage {
            output_tokens: None,
            ..usage
        });
    }
}

/// `usage` as [`crate::internal::CUT_USAGE_PROPERTY`] carries it.
pub fn encode_billed(usage: &Usage) -> String {
    format!(
        "{} {} {} {}",
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_read_tokens,
        usage.cache_creation_tokens
    )
}

/// The usage [`encode_billed`] wrote (`None`: not four decimal counts).
pub fn parse_billed(value: &[u8]) -> Option<Usage> {
    let text = std::str::from_utf8(value).ok()?;
    let mut n = text.split(' ').map(|p| p.parse::<u64>().ok());
    let usage = Usage {
        input_tokens: n.next()??,
        output_tokens: n.next()??,
        cache_read_tokens: n.next()??,
        cache_creation_tokens: n.next()??,
    };
    n.next().is_none().then_some(usage)
}

/// A JSON string literal of `s`.
fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The UTF-8 bytes of the text in a JSON value: a string's length, the sum
/// of an array's elements' or an object's values' (keys are not output),
/// 0 for anything else; read without keeping the text.
#[derive(Debug, Default, Clone, Copy)]
struct TextLen(u64);

impl<'de> Deserialize<'de> for TextLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TextLen, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextLen;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, v: &str) -> Result<TextLen, E> {
                Ok(TextLen(v.len() as u64))
            }
            fn visit_bool<E>(self, _: bool) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_i64<E>(self, _: i64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_u64<E>(self, _: u64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_f64<E>(self, _: f64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_unit<E>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_none<E>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextLen, A::Error> {
                let mut n = 0u64;
                while let Some(TextLen(m)) = seq.next_element()? {
                    n = n.saturating_add(m);
                }
                Ok(TextLen(n))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextLen, A::Error> {
                let mut n = 0u64;
                while let Some((IgnoredAny, TextLen(m))) = map.next_entry()? {
                    n = n.saturating_add(m);
                }
                Ok(TextLen(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// An OpenAI chunk's members that matter here.
#[derive(Deserialize)]
struct OpenAiChunk<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    created: Option<u64>,
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    choices: Option<Choices>,
    usage: Option<OpenAiUsage>,
}

/// A chunk's `choices`, folded as they are read (no vector).
#[derive(Default)]
struct Choices {
    text: u64,
    seen: u64,
    finished: u64,
}

#[derive(Deserialize)]
struct Choice {
    index: Option<u64>,
    delta: Option<OpenAiDelta>,
    finish_reason: Option<IgnoredAny>,
}

/// The members of a delta that carry generated text.
#[derive(Deserialize)]
struct OpenAiDelta {
    content: Option<TextLen>,
    refusal: Option<TextLen>,
    reasoning_content: Option<TextLen>,
    reasoning: Option<TextLen>,
    tool_calls: Option<TextLen>,
    function_call: Option<TextLen>,
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Choices, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Choices;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
                let mut choices = Choices::default();
                while let Some(choice) = seq.next_element::<Choice>()? {
                    let bit = 1u64 << choice.index.unwrap_or(0).min(MAX_CHOICES - 1);
                    choices.seen |= bit;
                    if choice.finish_reason.is_some() {
                        choices.finished |= bit;
                    }
                    if let Some(d) = choice.delta {
                        let text = [
                            d.content,
                            d.refusal,
                            d.reasoning_content,
                            d.reasoning,
                            d.tool_calls,
                            d.function_call,
                        ]
                        .iter()
                        .flatten()
                        .fold(0u64, |n, t| n.saturating_add(t.0));
                        choices.text = choices.text.saturating_add(text);
                    }
                }
                Ok(choices)
            }
        }
        d.deserialize_seq(V)
    }
}

/// An Anthropic stream event's members that matter here.
#[derive(Deserialize)]
struct AnthropicEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    index: Option<u64>,
    message: Option<AnthropicMessage>,
    /// A block's opening content (`text`, `thinking`, a tool's `name` and
    /// `input`): all of its text counts.
    content_block: Option<BlockText>,
    delta: Option<AnthropicDelta>,
    usage: Option<AnthropicUsage>,
}

#[derive(Deserialize)]
struct AnthropicMessage {
    usage: Option<AnthropicUsage>,
}

/// A content block's text, its `type` and `id` left out.
#[derive(Default)]
struct BlockText(u64);

impl<'de> Deserialize<'de> for BlockText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<BlockText, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BlockText;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content block")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BlockText, A::Error> {
                let mut n = 0u64;
                while let Some(key) = map.next_key::<BlockKey>()? {
                    let TextLen(m) = map.next_value()?;
                    if key == BlockKey::Other {
                        n = n.saturating_add(m);
                    }
                }
                Ok(BlockText(n))
            }
        }
        d.deserialize_map(V)
    }
}

/// A content block's keys that are not its text.
#[derive(Deserialize, PartialEq, Eq)]
#[serde(field_identifier, rename_all = "lowercase")]
enum BlockKey {
    Type,
    Id,
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct AnthropicDelta {
    text: Option<TextLen>,
    thinking: Option<TextLen>,
    partial_json: Option<TextLen>,
    stop_reason: Option<IgnoredAny>,
}

impl AnthropicDelta {
    fn text(&self) -> u64 {
        [self.text, self.thinking, self.partial_json]
            .iter()
            .flatten()
            .fold(0u64, |n, t| n.saturating_add(t.0))
    }
}
