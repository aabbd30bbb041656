//! What metering and quota read of a request body as it streams past, never
//! buffering it: the model the request names (the record of a response that
//! names none, such as a backend's 429 or 503, still carries it), the
//! output cap it asks for (`max_tokens`, `max_completion_tokens`,
//! `max_output_tokens`: quota's reservation bound) and, for a
//! body too large to hold (see [`StreamedInjection`]), whether an OpenAI
//! request streams and asks for usage, so `include_usage` can be appended
//! where the root object closes.

use serde_json::Value;

use super::extract::MAX_MODEL_LEN;
use super::scan::{TopLevelScanner, Wanted};

/// The members read: `model` (its value kept), `stream` and
/// `stream_options` (small values, kept to be read), and the output caps
/// (a `u64` takes 20 bytes; a longer value is read as no bound at all).
const MEMBERS: &[Wanted] = &[
    Wanted {
        key: b"model",
        // Escapes may take six bytes a character.
        limit: MAX_MODEL_LEN * 6 + 2,
    },
    Wanted {
        key: b"stream",
        limit: 16,
    },
    Wanted {
        key: b"stream_options",
        limit: 1024,
    },
    Wanted {
        key: b"max_tokens",
        limit: MAX_CAP_TEXT,
    },
    Wanted {
        key: b"max_completion_tokens",
        limit: MAX_CAP_TEXT,
    },
    Wanted {
        key: b"max_output_tokens",
        limit: MAX_CAP_TEXT,
    },
];

/// Longest cap value read (a number, or a string of one, with room for
/// spaces, a fraction of zeros or an exponent); a longer one names more
/// than any bound covers.
const MAX_CAP_TEXT: usize = 64;

const MODEL: usize = 0;
const STREAM: usize = 1;
const STREAM_OPTIONS: usize = 2;
const MAX_TOKENS: usize = 3;
const MAX_COMPLETION_TOKENS: usize = 4;
const MAX_OUTPUT_TOKENS: usize = 5;

/// The member appended to a streamed OpenAI request that asks for no usage.
pub const INCLUDE_USAGE_MEMBER: &[u8] = br#","stream_options":{"include_usage":true}"#;

/// What became of `include_usage` for a body read as it streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamedInjection {
    /// Not (yet) decided: the root object has not closed.
    Pending,
    /// Not a streamed request (`stream` absent, `false` or `null`), or not a
    /// JSON object: nothing to do.
    NotApplicable,
    /// The client asked for usage itself.
    ClientAsked,
    /// [`INCLUDE_USAGE_MEMBER`] goes before the root's closing brace.
    Append,
    /// It streams but cannot be made to ask for usage without holding the
    /// body: a `stream_options` of its own without `include_usage: true`
    /// (its bytes went on already), a `stream` that is not a boolean, or a
    /// member named twice. Forwarded unchanged; its usage may be missing.
    Skipped(SkipReason),
}

crate::labels! {
    /// Why a streamed body's `include_usage` could not be added (the label of
    /// `zerolayer_metering_include_usage_skipped{reason=…}`).
    pub enum SkipReason {
        /// The body has its own `stream_options` without `include_usage: true`.
        StreamOptions => "stream_options",
        /// `stream` is not a boolean.
        StreamNotBoolean => "stream_not_boolean",
        /// `stream` or `stream_options` is named twice.
        Duplicate => "duplicate",
        /// The host could not hand the body over (ngx_wasm_module cannot
        /// read a body nginx buffered to a file: one over
        /// `client_body_buffer_size`).
        Unreadable => "unreadable",
        /// An earlier filter paused the body step for a callout, after which
        /// this host would cut a replaced body to its old length
        /// (ngx_wasm_module's separate filters).
        AfterAWait => "after_a_wait",
    }
}

/// Scans a request body chunk by chunk; see the module documentation.
#[derive(Debug)]
pub struct RequestScan {
    scanner: TopLevelScanner,
    model: Option<String>,
    stream: Option<Value>,
    stream_options: Option<Option<Value>>,
    /// `stream` or `stream_options` was named twice.
    repeated: bool,
    /// The largest output cap named (any of the three members, any number
    /// of times: the backend reads one of them, the bound must cover it).
    max_output: Option<u64>,
    /// Where the value of the only cap member sits, when there is one and
    /// it asks for no bound (`null`, a negative number): a cap can be put
    /// there. `None` once a second cap member is seen.
    open_cap: Option<std::ops::Range<usize>>,
    /// Cap members seen (saturating).
    cap_members: u8,
    /// Whether a cap member holds a value no backend reads as a bound
    /// (`null`, negative, not a number): the backend's own default may
    /// apply, so the policy's default is reserved too.
    unread_cap: bool,
    /// Offset of the root's closing brace, once seen.
    root_end: Option<usize>,
    /// Bytes pushed so far.
    offset: usize,
}

impl Default for RequestScan {
    fn default() -> Self {
        RequestScan::new()
    }
}

impl RequestScan {
    /// A scan at the start of a body.
    pub fn new() -> RequestScan {
        RequestScan {
            scanner: TopLevelScanner::new(MEMBERS),
            model: None,
            stream: None,
            stream_options: None,
            repeated: false,
            max_output: None,
            open_cap: None,
            cap_members: 0,
            unread_cap: false,
            root_end: None,
            offset: 0,
        }
    }

    /// Feeds the next chunk. Returns where in `chunk` the root object
    /// closed, if it closed in this chunk.
    pub fn push(&mut self, chunk: &[u8]) -> Option<usize> {
        let start = self.offset;
        self.offset += chunk.len();
        if self.scanner.done() {
            return None;
        }
        let (model, stream, options, repeated, max_output, unread_cap) = (
            &mut self.model,
            &mut self.stream,
            &mut self.stream_options,
            &mut self.repeated,
            &mut self.max_output,
            &mut self.unread_cap,
        );
        let (open_cap, cap_members) = (&mut self.open_cap, &mut self.cap_members);
        self.scanner.push(chunk, |value| {
            if matches!(
                value.index,
                MAX_TOKENS | MAX_COMPLETION_TOKENS | MAX_OUTPUT_TOKENS
            ) {
                *cap_members = cap_members.saturating_add(1);
                *open_cap = (*cap_members == 1
                    && value.raw.is_some_and(|raw| {
                        let raw = raw.trim_ascii();
                        raw == b"null" || raw.first() == Some(&b'-')
                    }))
                .then(|| value.span.clone());
                // Read without building a `Value`: this runs on every request.
                let cap = match value.raw {
                    Some(raw) => read_cap(raw),
                    // Too long to read: more than any bound covers.
                    None => Some(u64::MAX),
                };
                match cap {
                    Some(cap) => *max_output = Some(max_output.map_or(cap, |m| m.max(cap))),
                    None => *unread_cap = true,
                }
                // A string is a number only to a lenient parser (pydantic);
                // a strict one refuses it (llama.cpp: 400) or, ignoring it,
                // would apply its own default: that is reserved as well.
                if value.raw.is_some_and(|raw| raw.first() == Some(&b'"')) {
                    *unread_cap = true;
                }
                return;
            }
            let parsed = value
                .raw
                .and_then(|raw| serde_json::from_slice::<Value>(raw).ok());
            match value.index {
                MODEL => {
                    *model = parsed
                        .and_then(|v| v.as_str().map(str::to_string))
                        .filter(|m| m.len() <= MAX_MODEL_LEN);
                }
                STREAM => {
                    if stream.is_some() {
                        *repeated = true;
                    }
                    // Too long to be kept: not a boolean either.
                    *stream = Some(parsed.unwrap_or(Value::String(String::new())));
                }
                STREAM_OPTIONS => {
                    if options.is_some() {
                        *repeated = true;
                    }
                    *options = Some(parsed);
                }
                _ => {}
            }
        });
        let end = self.scanner.root_end()?;
        if self.root_end.is_some() {
            return None;
        }
        self.root_end = Some(end);
        end.checked_sub(start).filter(|at| *at < chunk.len())
    }

    /// The model the request names (a string `model` member), once read.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The output cap the request asks for: the largest value among
    /// `max_tokens`, `max_completion_tokens` and `max_output_tokens` that a
    /// backend may read as a bound (a non-negative integer, or a string of
    /// one, which lenient parsers such as pydantic's coerce; a value too
    /// long to read is `u64::MAX`). `None`: none such.
    pub fn max_output_tokens(&self) -> Option<u64> {
        self.max_output
    }

    /// Whether the backend's own default may bound the output instead of
    /// [`max_output_tokens`](RequestScan::max_output_tokens): no cap
    /// member, or one whose value not every backend reads as a bound
    /// (`null`, `-1` which llama.cpp reads as "until the context is full",
    /// a word, a number in a string, which a parser may ignore).
    pub fn backend_default_applies(&self) -> bool {
        self.max_output.is_none() || self.unread_cap
    }

    /// Whether the body names any of the three cap members (a member of its
    /// own would make an appended one a duplicate).
    pub fn names_output_cap(&self) -> bool {
        self.cap_members > 0
    }

    /// Where, in the whole body, the value of its only cap member sits when
    /// that value asks for no bound (`null`, which the OpenAI SDKs send for
    /// an explicit `None`; a negative number, which llama.cpp reads as "to
    /// the end of the context"): a cap can replace it in place.
    pub fn open_output_cap(&self) -> Option<std::ops::Range<usize>> {
        self.open_cap.clone()
    }

    /// Whether the request asks for a streamed response (`stream: true`;
    /// any other value, or a repeated `stream`, is taken as a stream too:
    /// the bound of a stream is never the smaller one).
    pub fn streams(&self) -> bool {
        self.repeated || !matches!(self.stream, None | Some(Value::Null | Value::Bool(false)))
    }

    /// Offset of the root object's closing brace in the whole body, once
    /// read.
    pub fn root_end(&self) -> Option<usize> {
        self.root_end
    }

    /// Whether the root object closed (every member was read).
    pub fn complete(&self) -> bool {
        self.root_end.is_some()
    }

    /// What to do about `include_usage` for an OpenAI body streamed past.
    pub fn injection(&self) -> StreamedInjection {
        if self.root_end.is_none() {
            return if self.scanner.done() {
                StreamedInjection::NotApplicable
            } else {
                StreamedInjection::Pending
            };
        }
        if self.repeated {
            // Which `stream` or `stream_options` the backend reads is not known.
            return StreamedInjection::Skipped(SkipReason::Duplicate);
        }
        match &self.stream {
            Some(Value::Bool(true)) => {}
            None | Some(Value::Null | Value::Bool(false)) => {
                return StreamedInjection::NotApplicable;
            }
            Some(_) => return StreamedInjection::Skipped(SkipReason::StreamNotBoolean),
        }
        match &self.stream_options {
            None => StreamedInjection::Append,
            Some(Some(Value::Object(options)))
                if options.get("include_usage") == Some(&Value::Bool(true)) =>
            {
                StreamedInjection::ClientAsked
            }
            // Even a `null` one: a second member would be a duplicate.
            Some(_) => StreamedInjection::Skipped(SkipReason::StreamOptions),
        }
    }
}

/// A cap's raw JSON value as a backend may read it: a number (see
/// [`parse_u64`]) or a string holding one (pydantic, vLLM's parser, coerces
/// `"100"` to 100; `_` separators and spaces as Python's `int` allows).
fn read_cap(raw: &[u8]) -> Option<u64> {
    if raw.first() != Some(&b'"') {
        return parse_u64(raw);
    }
    let text: String = serde_json::from_slice::<String>(raw).ok()?;
    let digits: String = text.trim().chars().filter(|c| *c != '_').collect();
    parse_u64(digits.as_bytes())
}

/// A JSON number that is a non-negative integer (`16`, `16.0`, `1e3`
/// too: JSON does not tell them apart and serde_json's backends accept
/// them), as `u64` (one past `u64::MAX` saturates); anything else `None`.
fn parse_u64(raw: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Some(text.parse::<u64>().unwrap_or(u64::MAX));
    }
    if let Ok(n) = text.parse::<u64>() {
        return Some(n);
    }
    match serde_json::from_str::<Value>(text).ok()? {
        Value::Number(n) => n.as_u64().or_else(|| {
            let f = n.as_f64()?;
            // `as` saturates a float past u64::MAX.
            (f >= 0.0 && f.fract() == 0.0).then_some(f as u64)
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `body` cut at every split point in two; checks every cut agrees.
    fn scanned(body: &[u8]) -> (Option<String>, StreamedInjection, Option<usize>) {
        let mut whole = RequestScan::new();
        let end = whole.push(body);
        let expected = (whole.model().map(str::to_string), whole.injection(), end);
        for cut in 0..=body.len() {
            let (a, b) = body.split_at(cut);
            let mut scan = RequestScan::new();
            let first = scan.push(a);
            let second = scan.push(b).map(|at| at + cut);
            assert_eq!(
                (
                    scan.model().map(str::to_string),
                    scan.injection(),
                    first.or(second)
                ),
                expected,
                "cut at {cut}"
            );
        }
        expected
    }

    #[test]
    fn the_model_is_read_wherever_it_is() {
        let body = br#"{"messages":[{"role":"user","content":"\"model\":\"x\"}"}],"model":"gpt-4o","max_tokens":5}"#;
        let (model, injection, end) = scanned(body);
        assert_eq!(model.as_deref(), Some("gpt-4o"));
        assert_eq!(injection, StreamedInjection::NotApplicable);
        assert_eq!(end, Some(body.len() - 1));
        let (model, ..) = scanned(br#"{"model":42,"messages":[]}"#);
        assert_eq!(model, None);
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_LEN + 1));
        assert_eq!(scanned(long.as_bytes()).0, None);
    }

    #[test]
    fn the_output_cap_is_the_largest_named() {
        let cap = |body: &[u8]| {
            let mut whole = RequestScan::new();
            whole.push(body);
            for cut in 0..=body.len() {
                let (a, b) = body.split_at(cut);
                let mut scan = RequestScan::new();
                scan.push(a);
                scan.push(b);
                assert_eq!(
                    scan.max_output_tokens(),
                    whole.max_output_tokens(),
                    "cut {cut}"
                );
            }
            whole.max_output_tokens()
        };
        assert_eq!(cap(br#"{"model":"m","max_tokens":256}"#), Some(256));
        assert_eq!(
            cap(br#"{"max_completion_tokens": 1000 ,"messages":[]}"#),
            Some(1000)
        );
        assert_eq!(cap(br#"{"max_output_tokens":7}"#), Some(7));
        // Named twice or by two names: the bound covers whichever the backend reads.
        assert_eq!(
            cap(br#"{"max_tokens":5,"max_completion_tokens":50,"max_tokens":9}"#),
            Some(50)
        );
        assert_eq!(cap(br#"{"max_tokens":1e3}"#), Some(1000));
        assert_eq!(cap(br#"{"max_tokens":16.0}"#), Some(16));
        // Written so a lenient backend still reads a number: its value.
        assert_eq!(cap(br#"{"max_tokens":"100"}"#), Some(100));
        assert_eq!(cap(br#"{"max_tokens":" 1_000 "}"#), Some(1000));
        assert_eq!(cap(br#"{"max_tokens":"1e4"}"#), Some(10_000));
        assert_eq!(cap(br#"{"max_t\u006fkens":70000}"#), Some(70_000));
        // Past u64, or too long to read: more than any bound covers.
        assert_eq!(
            cap(br#"{"max_tokens":123456789012345678901234567890}"#),
            Some(u64::MAX)
        );
        assert_eq!(
            cap(br#"{"max_tokens":"99999999999999999999999"}"#),
            Some(u64::MAX)
        );
        let long = format!(r#"{{"max_tokens":1000000.{}}}"#, "0".repeat(80));
        assert_eq!(cap(long.as_bytes()), Some(u64::MAX));
        // The only cap, asking for none: its value's place is known.
        for (body, open) in [
            (&br#"{"max_tokens": null ,"m":1}"#[..], Some(15..19)),
            (br#"{"max_completion_tokens":-1}"#, Some(25..27)),
            (br#"{"max_tokens":null,"max_completion_tokens":null}"#, None),
            (br#"{"max_tokens":5}"#, None),
            (br#"{"max_tokens":"x"}"#, None),
        ] {
            let mut scan = RequestScan::new();
            scan.push(body);
            assert_eq!(
                scan.open_output_cap(),
                open,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // Beside a cap no backend reads, the backend's own default may apply.
        let mut scan = RequestScan::new();
        scan.push(br#"{"max_tokens":100,"max_completion_tokens":null}"#);
        assert_eq!(scan.max_output_tokens(), Some(100));
        assert!(scan.backend_default_applies() && scan.names_output_cap());
        let mut scan = RequestScan::new();
        scan.push(br#"{"max_tokens":100}"#);
        assert!(!scan.backend_default_applies());
        let mut scan = RequestScan::new();
        scan.push(br#"{"max_tokens":"100"}"#);
        assert_eq!(scan.max_output_tokens(), Some(100));
        assert!(
            scan.backend_default_applies(),
            "a parser may ignore a string"
        );
        let mut scan = RequestScan::new();
        scan.push(br#"{"model":"m"}"#);
        assert!(scan.backend_default_applies() && !scan.names_output_cap());
        // Not a bound any backend reads: none (the policy's default applies).
        for body in [
            &br#"{"max_tokens":-1}"#[..],
            br#"{"max_tokens":2.5}"#,
            br#"{"max_tokens":"lots"}"#,
            br#"{"max_tokens":null}"#,
            br#"{"messages":[{"max_tokens":10}]}"#,
            br#"{"model":"m"}"#,
        ] {
            assert_eq!(cap(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_streamed_request_without_usage_gets_it_appended_at_the_root_end() {
        let body =
            br#"{"model":"gpt-4o","messages":[{"role":"user","content":"}"}],"stream":true} "#;
        let (_, injection, end) = scanned(body);
        assert_eq!(injection, StreamedInjection::Append);
        let end = end.unwrap();
        let mut rewritten = body[..end].to_vec();
        rewritten.extend_from_slice(INCLUDE_USAGE_MEMBER);
        rewritten.extend_from_slice(&body[end..]);
        let parsed: Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(parsed["stream_options"]["include_usage"], true);
        assert_eq!(parsed["messages"][0]["content"], "}");
    }

    #[test]
    fn what_cannot_be_appended_is_skipped_with_its_reason() {
        let cases: [(&[u8], StreamedInjection); 9] = [
            (br#"{"stream":false}"#, StreamedInjection::NotApplicable),
            (br#"{"stream":null}"#, StreamedInjection::NotApplicable),
            (br#"{"model":"m"}"#, StreamedInjection::NotApplicable),
            (br#"[1,2]"#, StreamedInjection::NotApplicable),
            (
                br#"{"stream":true,"stream_options":{"include_usage":true}}"#,
                StreamedInjection::ClientAsked,
            ),
            (
                br#"{"stream":true,"stream_options":{"include_usage":false}}"#,
                StreamedInjection::Skipped(SkipReason::StreamOptions),
            ),
            (
                br#"{"stream":"true"}"#,
                StreamedInjection::Skipped(SkipReason::StreamNotBoolean),
            ),
            (
                br#"{"stream":true,"stream":false}"#,
                StreamedInjection::Skipped(SkipReason::Duplicate),
            ),
            (
                br#"{"stream":true,"stream_options":null,"stream_options":{}}"#,
                StreamedInjection::Skipped(SkipReason::Duplicate),
            ),
        ];
        for (body, want) in cases {
            assert_eq!(scanned(body).1, want, "{}", String::from_utf8_lossy(body));
        }
        assert_eq!(
            scanned(br#"{"stream":true,"stream_options":null}"#).1,
            StreamedInjection::Skipped(SkipReason::StreamOptions)
        );
        assert_eq!(
            scanned(br#"{"model":"a","model":"b","stream":true}"#).1,
            StreamedInjection::Append,
            "only stream and stream_options decide"
        );
        let mut open = RequestScan::new();
        open.push(br#"{"stream":true,"messages":["#);
        assert_eq!(open.injection(), StreamedInjection::Pending);
        assert!(!open.complete());
    }
}
