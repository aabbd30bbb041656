//! An incremental scanner for a few top-level members of a JSON object: the
//! body goes in as the proxy sees it, in chunks split anywhere, and only the
//! values of the wanted keys are kept (each up to its own bound), so a large
//! response costs constant memory. Strings are skipped whole, so braces,
//! quotes and escapes inside them, and keys of nested objects, never count.
//!
//! The scanner checks structure only as far as it needs to: on bytes that
//! cannot appear where they are (a root that is not an object, a missing
//! colon) it stops, keeping what it found so far. Whoever parses a captured
//! value (serde_json) judges whether it is valid.

use std::ops::Range;

use super::needle::find_either;

/// A top-level key to look for, and the longest raw value kept for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    /// The key as a JSON parser reads it, ASCII: a key written with escapes
    /// is decoded before it is compared (`"max\u005ftokens"` is
    /// `max_tokens`, as the backend reads it), so a client cannot hide a
    /// member from the scan that the backend still reads.
    pub key: &'static [u8],
    /// Values longer than this many bytes are reported without their bytes.
    pub limit: usize,
}

/// A complete value of a wanted top-level key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopLevelValue<'a> {
    /// Index of the key in the scanner's `wanted` list.
    pub index: usize,
    /// The value's raw JSON text, or `None` when it is longer than the limit.
    pub raw: Option<&'a [u8]>,
    /// Where the value sits in the whole body (offsets over all chunks).
    pub span: Range<usize>,
}

/// Keys longer than this never match (the wanted keys are short).
const MAX_KEY: usize = 32;

/// Where the decoding of an escape inside a top-level key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyEscape {
    /// Not in an escape.
    None,
    /// After the backslash.
    Backslash,
    /// In `\uXXXX`, with `digits` hex digits read into `code`.
    Unicode { digits: u8, code: u32 },
}

/// Where the scanner is, relative to the root object's members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the root value.
    Start,
    /// In the root object, expecting a key or its end.
    Key,
    /// Inside a top-level key string.
    InKey,
    /// After a top-level key, expecting `:`.
    Colon,
    /// After `:`, expecting a value.
    Value,
    /// Inside a top-level value (a scalar at depth 1, or a string, or a
    /// nested container while depth > 1).
    InValue,
    /// After a top-level value, expecting `,` or the end of the object.
    Comma,
    /// The root object ended, or the input is not a JSON object.
    Done,
}

/// Incremental scanner state; see the module documentation.
#[derive(Debug)]
pub struct TopLevelScanner {
    wanted: &'static [Wanted],
    state: State,
    /// Nesting: 1 inside the root object, more inside a member's value.
    depth: u32,
    in_string: bool,
    /// The previous byte was a backslash inside a string.
    escape: bool,
    /// An escape being decoded inside a top-level key that may still match.
    key_escape: KeyEscape,
    key: [u8; MAX_KEY],
    /// Bytes of the current top-level key, or `None` once it cannot match.
    key_len: Option<usize>,
    /// The wanted key whose value is being read.
    target: Option<usize>,
    /// Bytes of the target value from earlier chunks.
    capture: Vec<u8>,
    /// The target value went over its limit.
    capture_over: bool,
    value_start: usize,
    /// Bytes consumed by earlier pushes.
    offset: usize,
    root_end: Option<usize>,
}

impl TopLevelScanner {
    /// A scanner at the start of a body, looking for `wanted`.
    pub fn new(wanted: &'static [Wanted]) -> TopLevelScanner {
        TopLevelScanner {
            wanted,
            state: State::Start,
            depth: 0,
            in_string: false,
            escape: false,
            key_escape: KeyEscape::None,
            key: [0; MAX_KEY],
            key_len: None,
            target: None,
            capture: Vec::new(),
            capture_over: false,
            value_start: 0,
            offset: 0,
            root_end: None,
        }
    }

    /// Offset of the root object's closing `}`, once seen.
    pub fn root_end(&self) -> Option<usize> {
        self.root_end
    }

    /// Whether scanning stopped: the root object closed, or the input is not
    /// a JSON object.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Feeds `chunk`, calling `on_value` for every wanted value it completes.
    pub fn push(&mut self, chunk: &[u8], mut on_value: impl FnMut(TopLevelValue<'_>)) {
        // Start, within this chunk, of the target value's bytes not yet in
        // `capture`.
        let mut segment = 0;
        let mut i = 0;
        while i < chunk.len() && self.state != State::Done {
            let rest = chunk.get(i..).unwrap_or_default();
            if self.in_string {
                if self.key_escape != KeyEscape::None {
                    if let Some(&b) = chunk.get(i)
                        && self.key_escape_byte(b)
                    {
                        i += 1;
                    }
                    continue;
                }
                if self.escape {
                    // The escaped byte (`"` or `\` included) is content.
                    self.escape = false;
                    i += 1;
                    continue;
                }
                // Strings are most of a response: skip to their next quote or
                // backslash in one search.
                let found = find_either(rest, b'"', b'\\');
                let text = found.map_or(rest, |at| rest.get(..at).unwrap_or_default());
                if self.state == State::InKey {
                    self.key_bytes(text);
                }
                let Some(at) = found else {
                    break;
                };
                let at = i + at;
                i = at + 1;
                if chunk.get(at) == Some(&b'\\') {
                    // A key that may still match is decoded as it is read;
                    // any other escape is skipped.
                    if self.state == State::InKey && self.key_len.is_some() {
                        self.key_escape = KeyEscape::Backslash;
                    } else {
                        self.escape = true;
                    }
                    continue;
                }
                self.in_string = false;
                if self.depth == 1 {
                    match self.state {
                        State::InKey => {
                            self.target = self.key_match();
                            self.state = State::Colon;
                        }
                        State::InValue => {
                            self.value_end(chunk, segment, i, &mut on_value);
                            self.state = State::Comma;
                        }
                        _ => {}
                    }
                }
                continue;
            }
            if self.depth > 1 {
                // Inside a member's container: only strings and brackets matter.
                let Some(at) = rest
                    .iter()
                    .position(|&b| matches!(b, b'"' | b'{' | b'}' | b'[' | b']'))
                else {
                    break;
                };
                let at = i + at;
                i = at + 1;
                match chunk.get(at) {
                    Some(b'"') => self.in_string = true,
                    Some(b'{' | b'[') => self.depth = self.depth.saturating_add(1),
                    _ => {
                        self.depth -= 1;
                        if self.depth == 1 {
                            self.value_end(chunk, segment, i, &mut on_value);
                            self.state = State::Comma;
                        }
                    }
                }
                continue;
            }
            let Some(&b) = chunk.get(i) else {
                break;
            };
            let space = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
            match self.state {
                State::Start => match b {
                    b'{' => {
                        self.depth = 1;
                        self.state = State::Key;
                    }
                    _ if space => {}
                    _ => self.state = State::Done,
                },
                State::Key => match b {
                    b'"' => {
                        self.in_string = true;
                        self.key_len = Some(0);
                        self.state = State::InKey;
                    }
                    b'}' => self.close_root(i),
                    _ if space => {}
                    _ => self.state = State::Done,
                },
                State::Colon => match b {
                    b':' => self.state = State::Value,
                    _ if space => {}
                    _ => self.state = State::Done,
                },
                State::Value => {
                    if !space {
                        if matches!(b, b'}' | b']' | b',' | b':') {
                            self.state = State::Done;
                        } else {
                            self.state = State::InValue;
                            self.value_start = self.offset + i;
                            self.capture.clear();
                            self.capture_over = false;
                            segment = i;
                            match b {
                                b'"' => self.in_string = true,
                                b'{' | b'[' => self.depth = 2,
                                _ => {}
                            }
                        }
                    }
                }
                // A scalar (number, true, false, null) at depth 1.
                State::InValue => {
                    if space || b == b',' || b == b'}' {
                        self.value_end(chunk, segment, i, &mut on_value);
                        self.state = match b {
                            b',' => State::Key,
                            b'}' => {
                                self.close_root(i);
                                State::Done
                            }
                            _ => State::Comma,
                        };
                    }
                }
                State::Comma => match b {
                    b',' => self.state = State::Key,
                    b'}' => self.close_root(i),
                    _ if space => {}
                    _ => self.state = State::Done,
                },
                State::InKey | State::Done => {}
            }
            i += 1;
        }
        if self.state == State::InValue && self.target.is_some() {
            let tail = chunk.get(segment..).unwrap_or_default();
            self.keep(tail);
        }
        self.offset += chunk.len();
    }

    fn close_root(&mut self, at: usize) {
        self.root_end = Some(self.offset + at);
        self.depth = 0;
        self.state = State::Done;
    }

    fn key_bytes(&mut self, bytes: &[u8]) {
        if let Some(len) = self.key_len {
            let end = len + bytes.len();
            match self.key.get_mut(len..end) {
                Some(slot) => {
                    slot.copy_from_slice(bytes);
                    self.key_len = Some(end);
                }
                None => self.key_len = None,
            }
        }
    }

    /// Decodes byte `b` of an escape in a key; returns whether it was
    /// consumed (a byte that cannot continue `\uXXXX`, in a body that is not
    /// JSON, ends the escape and is read again as string content).
    fn key_escape_byte(&mut self, b: u8) -> bool {
        match self.key_escape {
            KeyEscape::None => false,
            KeyEscape::Backslash => {
                let decoded = match b {
                    b'u' => {
                        self.key_escape = KeyEscape::Unicode { digits: 0, code: 0 };
                        return true;
                    }
                    b'"' | b'\\' | b'/' => Some(b),
                    b'b' => Some(0x08),
                    b'f' => Some(0x0c),
                    b'n' => Some(b'\n'),
                    b'r' => Some(b'\r'),
                    b't' => Some(b'\t'),
                    _ => None,
                };
                self.key_escape = KeyEscape::None;
                match decoded {
                    Some(c) => self.key_bytes(&[c]),
                    None => self.key_len = None,
                }
                true
            }
            KeyEscape::Unicode { digits, code } => {
                let Some(digit) = char::from(b).to_digit(16) else {
                    self.key_escape = KeyEscape::None;
                    self.key_len = None;
                    return false;
                };
                let code = code << 4 | digit;
                if digits < 3 {
                    self.key_escape = KeyEscape::Unicode {
                        digits: digits + 1,
                        code,
                    };
                    return true;
                }
                self.key_escape = KeyEscape::None;
                // The wanted keys are ASCII: any other character (a
                // surrogate half included) means the key is not one.
                match u8::try_from(code).ok().filter(u8::is_ascii) {
                    Some(c) => self.key_bytes(&[c]),
                    None => self.key_len = None,
                }
                true
            }
        }
    }

    fn key_match(&self) -> Option<usize> {
        let key = self.key.get(..self.key_len?)?;
        self.wanted.iter().position(|wanted| wanted.key == key)
    }

    /// Appends value bytes carried over to the next chunk, within the limit.
    fn keep(&mut self, bytes: &[u8]) {
        let Some(wanted) = self.target.and_then(|t| self.wanted.get(t)) else {
            return;
        };
        if self.capture_over || self.capture.len() + bytes.len() > wanted.limit {
            self.capture_over = true;
            self.capture = Vec::new();
        } else {
            self.capture.extend_from_slice(bytes);
        }
    }

    /// The current top-level value ends before `end` in `chunk`.
    fn value_end(
        &mut self,
        chunk: &[u8],
        segment: usize,
        end: usize,
        on_value: &mut impl FnMut(TopLevelValue<'_>),
    ) {
        let Some(index) = self.target.take() else {
            return;
        };
        let tail = chunk.get(segment..end).unwrap_or_default();
        let span = self.value_start..self.offset + end;
        let limit = self.wanted.get(index).map_or(0, |w| w.limit);
        let raw = if self.capture_over || self.capture.len() + tail.len() > limit {
            None
        } else if self.capture.is_empty() {
            // The whole value is in this chunk: no copy.
            Some(tail)
        } else {
            self.capture.extend_from_slice(tail);
            Some(&self.capture[..])
        };
        on_value(TopLevelValue { index, raw, span });
        self.capture.clear();
        self.capture_over = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WANTED: &[Wanted] = &[
        Wanted {
            key: b"usage",
            limit: 64,
        },
        Wanted {
            key: b"model",
            limit: 16,
        },
    ];

    fn scan(chunks: &[&[u8]]) -> Vec<(usize, Option<String>, Range<usize>)> {
        let mut scanner = TopLevelScanner::new(WANTED);
        let mut out = Vec::new();
        for chunk in chunks {
            scanner.push(chunk, |v| {
                out.push((
                    v.index,
                    v.raw.map(|r| String::from_utf8_lossy(r).into_owned()),
                    v.span,
                ))
            });
        }
        out
    }

    #[test]
    fn finds_top_level_values_of_every_kind() {
        let body = br#"{"model":"m-1","x":{"usage":1},"usage":{"a":[1,"}"]}}"#;
        assert_eq!(
            scan(&[body]),
            [
                (1, Some("\"m-1\"".into()), 9..14),
                (0, Some("{\"a\":[1,\"}\"]}".into()), 39..52),
            ]
        );
        assert_eq!(
            scan(&[b"{ \"usage\" : 12 , \"model\":null}"]),
            [
                (0, Some("12".into()), 12..14),
                (1, Some("null".into()), 25..29)
            ]
        );
        assert_eq!(
            scan(&[b"{\"usage\":true}"]),
            [(0, Some("true".into()), 9..13)]
        );
    }

    #[test]
    fn values_over_the_limit_have_no_bytes() {
        let got = scan(&[b"{\"model\":\"0123456789abcdefXYZ\"}"]);
        assert_eq!(got, [(1, None, 9..30)]);
        let got = scan(&[b"{\"model\":\"0123456789", b"abcdefXYZ\"}"]);
        assert_eq!(got, [(1, None, 9..30)]);
    }

    #[test]
    fn string_values_named_like_keys_do_not_count() {
        assert_eq!(scan(&[br#"{"a":"usage","b":"model"}"#]), []);
        assert_eq!(scan(&[br#"{"\"model":2,"model\n":3,"mod\u00e9l":4}"#]), []);
        assert_eq!(scan(&[br#"["usage",{"usage":1}]"#]), []);
    }

    #[test]
    fn escaped_keys_are_read_as_a_parser_reads_them() {
        let body = br#"{"us\u0061ge":1,"m\u006F\u0064el":"x","\u0000":2}"#;
        let want = [
            (0, Some("1".into()), 14..15),
            (1, Some("\"x\"".into()), 34..37),
        ];
        assert_eq!(scan(&[body]), want);
        // Split inside every escape.
        for at in 0..=body.len() {
            let (a, b) = body.split_at(at);
            assert_eq!(scan(&[a, b]), want, "split at {at}");
        }
        // `\/` is `/`: no wanted key has one.
        assert_eq!(scan(&[br#"{"model\/":1,"model\u":2,"model":3}"#]).len(), 1);
    }

    #[test]
    fn root_end_is_reported() {
        let mut scanner = TopLevelScanner::new(WANTED);
        scanner.push(b"{\"a\":[]", |_| {});
        assert_eq!(scanner.root_end(), None);
        scanner.push(b" }", |_| {});
        assert_eq!(scanner.root_end(), Some(8));
        assert!(scanner.done());
    }
}
