//! Usage for OpenAI streams whose client did not ask for it. A streamed Chat
//! Completions response reports usage only when the request set
//! `stream_options.include_usage`; the filter sets it
//! ([`inject_include_usage`]) and removes the extra usage-only chunk before
//! the response reaches a client that never asked for it
//! ([`UsageChunkStripper`]), so the client sees the stream it would have had.
//!
//! Both fail open: a body they cannot read is forwarded unchanged, since
//! metering must never break a request.

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

use crate::cache::key::Provider;
use crate::json::{BodyError, check_unique_members};

use super::extract::carries_usage;
use super::needle::find_either;
use super::scan::{TopLevelScanner, Wanted};

/// What [`inject_include_usage`] decided for a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Injection {
    /// Forward the body unchanged: not a streamed OpenAI request, not a JSON
    /// object, or a `stream_options` that is not an object.
    NotApplicable,
    /// Forward the body unchanged: the client set `include_usage` itself and
    /// expects the usage chunk.
    ClientAsked,
    /// Forward this body instead, and strip the usage chunk from the response.
    Rewritten(Vec<u8>),
    /// Answer 400 with this message: a streamed request whose reading is
    /// ambiguous (a member named twice, see [`crate::json`]) or that could
    /// stream without the usage chunk (`stream` not a boolean, which lenient
    /// backends read as one; `stream_options` not an object, or written so
    /// that it cannot be rewritten in place).
    Refused(String),
}

impl Injection {
    /// Whether the response's usage-only chunk must be removed for the client.
    pub fn strip_usage_chunk(&self) -> bool {
        matches!(self, Injection::Rewritten(_))
    }
}

/// The two members that decide; serde skips every other one (a body naming
/// any member twice was refused before).
#[derive(Deserialize)]
struct StreamRequest {
    stream: Option<Value>,
    stream_options: Option<Value>,
}

const STREAM_OPTIONS: &[Wanted] = &[Wanted {
    key: b"stream_options",
    // Only the span is needed, never the bytes.
    limit: 0,
}];

/// Makes a streamed OpenAI request ask for usage: with `"stream": true` and
/// `stream_options.include_usage` not `true`, returns the body with
/// `include_usage: true` set (other `stream_options` members kept, every
/// other byte of the body unchanged). An OpenAI body naming a member twice
/// anywhere is [`Injection::Refused`], whatever its `stream`, as post-cache
/// refuses it: every stage that reads a body agrees.
pub fn inject_include_usage(provider: Provider, body: &[u8]) -> Injection {
    if provider != Provider::OpenAi || !body.trim_ascii_start().starts_with(b"{") {
        // serde would read an array as a struct's fields in order.
        return Injection::NotApplicable;
    }
    match check_unique_members(body) {
        Ok(()) => {}
        Err(BodyError::Duplicate(duplicate)) => return Injection::Refused(duplicate.to_string()),
        // Not JSON: the backend refuses it; that is the client's error to see.
        Err(_) => return Injection::NotApplicable,
    }
    let Ok(request) = serde_json::from_slice::<StreamRequest>(body) else {
        return Injection::NotApplicable;
    };
    match request.stream {
        Some(Value::Bool(true)) => {}
        None | Some(Value::Null | Value::Bool(false)) => return Injection::NotApplicable,
        // A lenient backend reads `"true"` or `1` as true and streams.
        Some(_) => {
            return Injection::Refused("request body field `stream` is not a boolean".into());
        }
    }
    let written = request.stream_options.is_some();
    let options = match request.stream_options {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(options)) => options,
        Some(_) => {
            return Injection::Refused(
                "request body field `stream_options` is not an object".into(),
            );
        }
    };
    if options.get("include_usage") == Some(&Value::Bool(true)) {
        return Injection::ClientAsked;
    }
    let mut options = options;
    options.insert("include_usage".into(), Value::Bool(true));
    let Ok(options) = serde_json::to_vec(&options) else {
        return Injection::NotApplicable;
    };
    // The body is valid JSON (serde read it), so the scanner sees its
    // structure exactly: splice rather than re-serialise, which would reorder
    // members and rewrite numbers.
    let mut scanner = TopLevelScanner::new(STREAM_OPTIONS);
    let mut span = None;
    scanner.push(body, |value| span = Some(value.span));
    if written && span.is_none() {
        // The scanner decodes escaped names as serde does, so it found the
        // member serde read; should they ever disagree, appending a second
        // `stream_options` would make the body ambiguous.
        return Injection::Refused(
            "request body field `stream_options` cannot be rewritten (escaped name)".into(),
        );
    }
    let mut rewritten = Vec::with_capacity(body.len() + options.len() + 20);
    match (span, scanner.root_end()) {
        (Some(span), _) => {
            rewritten.extend_from_slice(body.get(..span.start).unwrap_or_default());
            rewritten.extend_from_slice(&options);
            rewritten.extend_from_slice(body.get(span.end..).unwrap_or_default());
        }
        // `"stream": true` is a member, so the object is not empty.
        (None, Some(end)) => {
            rewritten.extend_from_slice(body.get(..end).unwrap_or_default());
            rewritten.extend_from_slice(b",\"stream_options\":");
            rewritten.extend_from_slice(&options);
            rewritten.extend_from_slice(body.get(end..).unwrap_or_default());
        }
        (None, None) => return Injection::NotApplicable,
    }
    Injection::Rewritten(rewritten)
}

/// Longest event held back while waiting for its end: a usage chunk is a few
/// hundred bytes, so a longer event is forwarded without waiting.
pub const MAX_HELD_EVENT: usize = 16 * 1024;

/// What happens to an LF that starts a chunk after a CR ended the last one
/// (together they are one line ending).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PendingLf {
    None,
    /// The CR ended a line of the current event.
    InEvent,
    /// The CR ended an event that was forwarded.
    Forward,
    /// The CR ended an event that was removed.
    Drop,
}

/// Removes the usage-only chunk (`"choices": []`, `usage` not null) from an
/// OpenAI event stream, forwarding every other byte as is.
///
/// Only a partial event is held back at a chunk's end (and at most
/// [`MAX_HELD_EVENT`] bytes of it), so the output of all pushes, then
/// [`finish`](UsageChunkStripper::finish), is the input minus the removed
/// events' bytes whatever the chunking. Comment lines inside a removed event
/// are kept.
#[derive(Debug)]
pub struct UsageChunkStripper {
    /// The current event's bytes from earlier chunks.
    held: Vec<u8>,
    /// The current event went over [`MAX_HELD_EVENT`] and is being forwarded.
    passthrough: bool,
    /// Bytes of the current line from earlier chunks (only emptiness matters).
    line_len: usize,
    pending_lf: PendingLf,
    /// Data lines joined, for the rare event that may be the usage chunk.
    scratch: Vec<u8>,
    removed: usize,
}

impl Default for UsageChunkStripper {
    fn default() -> Self {
        UsageChunkStripper::new()
    }
}

impl UsageChunkStripper {
    /// A stripper at the start of a stream.
    pub fn new() -> UsageChunkStripper {
        UsageChunkStripper {
            held: Vec::new(),
            passthrough: false,
            line_len: 0,
            pending_lf: PendingLf::None,
            scratch: Vec::new(),
            removed: 0,
        }
    }

    /// Bytes held back, awaiting the end of their event.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// How many events were removed so far.
    pub fn removed(&self) -> usize {
        self.removed
    }

    /// Feeds the next chunk, appending the bytes to forward to `out`.
    pub fn push(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        if chunk.is_empty() {
            return;
        }
        let mut i = 0;
        let pending = std::mem::replace(&mut self.pending_lf, PendingLf::None);
        if chunk.first() == Some(&b'\n') {
            i = 1;
            match pending {
                PendingLf::None => i = 0,
                PendingLf::InEvent if !self.passthrough => self.held.push(b'\n'),
                PendingLf::InEvent | PendingLf::Forward => out.push(b'\n'),
                PendingLf::Drop => {}
            }
        }
        // Start of the current event's bytes in this chunk.
        let mut event_start = i;
        while let Some(rest) = chunk.get(i..) {
            let Some(at) = find_either(rest, b'\n', b'\r') else {
                self.line_len += rest.len();
                break;
            };
            let blank = self.line_len == 0 && at == 0;
            let end = i + at;
            let (term_end, cr_at_chunk_end) = match (chunk.get(end), chunk.get(end + 1)) {
                (Some(b'\r'), Some(b'\n')) => (end + 2, false),
                (Some(b'\r'), None) => (end + 1, true),
                _ => (end + 1, false),
            };
            self.line_len = 0;
            i = term_end;
            if !blank {
                if cr_at_chunk_end {
                    self.pending_lf = PendingLf::InEvent;
                }
                continue;
            }
            let event = chunk.get(event_start..term_end).unwrap_or_default();
            let fate = self.event_done(event, term_end - end, out);
            event_start = term_end;
            if cr_at_chunk_end {
                self.pending_lf = fate;
            }
        }
        let tail = chunk.get(event_start..).unwrap_or_default();
        if self.passthrough {
            out.extend_from_slice(tail);
        } else if self.held.len() + tail.len() > MAX_HELD_EVENT {
            self.passthrough = true;
            out.append(&mut self.held);
            out.extend_from_slice(tail);
        } else {
            self.held.extend_from_slice(tail);
        }
    }

    /// Ends the stream: an unterminated last event was never dispatched to
    /// the client, so it is forwarded as it came.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.held);
        self.passthrough = false;
        self.line_len = 0;
        self.pending_lf = PendingLf::None;
    }

    /// An event ended with `tail` (this chunk's part of it, blank line
    /// included, `blank_len` bytes of line ending): forward or remove it.
    fn event_done(&mut self, tail: &[u8], blank_len: usize, out: &mut Vec<u8>) -> PendingLf {
        if std::mem::take(&mut self.passthrough) {
            out.extend_from_slice(tail);
            return PendingLf::Forward;
        }
        // The blank line's own ending is left out of the size, as it may be
        // CR now and CRLF in another chunking.
        let size = self.held.len() + tail.len() - blank_len;
        let event: &[u8] = if self.held.is_empty() {
            tail
        } else {
            self.held.extend_from_slice(tail);
            &self.held
        };
        let fate = if size <= MAX_HELD_EVENT && is_usage_only(event, &mut self.scratch) {
            self.removed += 1;
            for (line, full) in Lines(event) {
                if line.first() == Some(&b':') {
                    out.extend_from_slice(full);
                }
            }
            PendingLf::Drop
        } else {
            out.extend_from_slice(event);
            PendingLf::Forward
        };
        self.held.clear();
        fate
    }
}

/// An OpenAI chunk's `choices` and `usage`, every other member skipped.
#[derive(Deserialize)]
struct ChunkShape {
    choices: Option<Vec<IgnoredAny>>,
    usage: Option<IgnoredAny>,
}

/// Whether the raw `event` is a chunk carrying only usage.
fn is_usage_only(event: &[u8], scratch: &mut Vec<u8>) -> bool {
    // Almost every event fails this byte search and is never parsed.
    if !carries_usage(event) {
        return false;
    }
    scratch.clear();
    let mut any = false;
    for (line, _) in Lines(event) {
        let (field, value) = crate::sse::field_and_value(line);
        if field == b"data" {
            if any {
                scratch.push(b'\n');
            }
            scratch.extend_from_slice(value);
            any = true;
        }
    }
    match serde_json::from_slice::<ChunkShape>(scratch) {
        // Exactly OpenAI's documented shape: a chunk without `choices` is not
        // this one, and is left for the client.
        Ok(chunk) => chunk.usage.is_some() && chunk.choices.is_some_and(|c| c.is_empty()),
        Err(_) => false,
    }
}

/// The lines of a complete event: (line, line with its ending), endings
/// being CRLF, LF or CR as in SSE.
struct Lines<'a>(&'a [u8]);

impl<'a> Iterator for Lines<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let rest = self.0;
        let Some(at) = find_either(rest, b'\n', b'\r') else {
            self.0 = &[];
            return Some((rest, rest));
        };
        let end = match (rest.get(at), rest.get(at + 1)) {
            (Some(b'\r'), Some(b'\n')) => at + 2,
            _ => at + 1,
        };
        self.0 = rest.get(end..).unwrap_or_default();
        Some((
            rest.get(..at).unwrap_or_default(),
            rest.get(..end).unwrap_or_default(),
        ))
    }
}
