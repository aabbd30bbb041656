//! An incremental Server-Sent Events parser (WHATWG HTML §9.2.6): bytes go in
//! as the proxy sees them, in chunks split anywhere, and whole events come
//! out. Lines end with CRLF, LF or CR; `:` starts a comment; `data` lines
//! join with LF; a blank line dispatches. Only `event` and `data` matter to
//! the filters (`id` and `retry` are skipped).

/// One dispatched event, borrowed from the parser until the next push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseEvent<'a> {
    /// The `event` field (`message` when absent, as browsers do).
    pub event: &'a [u8],
    /// The `data` lines joined with LF.
    pub data: &'a [u8],
}

/// Longest line kept while waiting for its end: a stream sending more without
/// a line break is not SSE, and the parser must not grow without bound.
pub const MAX_LINE: usize = 1 << 20;

/// Parser state carried between chunks.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The current line so far (a line split across chunks).
    line: Vec<u8>,
    /// The chunk ended with CR: an LF starting the next one belongs to it.
    after_cr: bool,
    event: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    /// A line went over [`MAX_LINE`]: the stream is not SSE.
    overflowed: bool,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// Whether a line exceeded [`MAX_LINE`] (its bytes were dropped).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Feeds `chunk`, calling `on_event` for every event it completes.
    pub fn push(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent<'_>)) {
        self.push_framed(chunk, |event, _| {
            on_event(event);
            true
        });
    }

    /// [`SseParser::push`], telling `on_event` also where in `chunk` the
    /// event ends (just past its blank line's line ending: the bytes before
    /// it hold whole events only, so a stream cut there is never cut inside
    /// one). `on_event` returns whether to go on: with `false` the rest of
    /// `chunk` is not parsed (the parser is then left mid-stream, for a
    /// caller that stops reading there).
    pub fn push_framed(
        &mut self,
        chunk: &[u8],
        mut on_event: impl FnMut(SseEvent<'_>, usize) -> bool,
    ) {
        if chunk.is_empty() {
            // Keep a pending CR for the next non-empty chunk.
            return;
        }
        let mut rest = chunk;
        if self.after_cr {
            self.after_cr = false;
            if let Some(stripped) = rest.strip_prefix(b"\n") {
                rest = stripped;
            }
        }
        while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
            let (head, tail) = rest.split_at(end);
            let is_cr = tail.first() == Some(&b'\r');
            rest = tail.get(1..).unwrap_or_default();
            if is_cr {
                match rest.first() {
                    Some(b'\n') => rest = rest.get(1..).unwrap_or_default(),
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            let at = chunk.len() - rest.len();
            let go_on = if self.line.is_empty() {
                self.line_done(head, &mut |e| on_event(e, at))
            } else {
                let mut line = std::mem::take(&mut self.line);
                self.extend_line(&mut line, head);
                let go_on = self.line_done(&line, &mut |e| on_event(e, at));
                line.clear();
                self.line = line;
                go_on
            };
            if !go_on {
                return;
            }
        }
        let mut line = std::mem::take(&mut self.line);
        self.extend_line(&mut line, rest);
        self.line = line;
    }

    fn extend_line(&mut self, line: &mut Vec<u8>, bytes: &[u8]) {
        if line.len() + bytes.len() > MAX_LINE {
            self.overflowed = true;
            return;
        }
        line.extend_from_slice(bytes);
    }

    /// One line done; returns whether to go on (`on_event`'s answer).
    fn line_done(&mut self, line: &[u8], on_event: &mut impl FnMut(SseEvent<'_>) -> bool) -> bool {
        if line.is_empty() {
            let mut go_on = true;
            if self.has_data {
                let event: &[u8] = if self.event.is_empty() {
                    b"message"
                } else {
                    &self.event
                };
                go_on = on_event(SseEvent {
                    event,
                    data: &self.data,
                });
            }
            self.event.clear();
            self.data.clear();
            self.has_data = false;
            return go_on;
        }
        if line.first() == Some(&b':') {
            return true;
        }
        let (field, value) = field_and_value(line);
        match field {
            b"event" => {
                self.event.clear();
                self.event.extend_from_slice(value);
            }
            b"data" => {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            _ => {}
        }
        true
    }
}

/// Whether a `content-type` value is `text/event-stream`: the media type
/// before any `;` parameters, without surrounding whitespace, compared
/// without regard to case (RFC 9110 §8.3.1: `Text/Event-Stream` is a stream).
pub fn is_event_stream(content_type: &[u8]) -> bool {
    let media = content_type
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    media.eq_ignore_ascii_case(b"text/event-stream")
}

/// A non-comment line's field and value: split at the first `:`, one
/// leading space of the value dropped; a line without `:` is all field.
pub(crate) fn field_and_value(line: &[u8]) -> (&[u8], &[u8]) {
    match line.iter().position(|&b| b == b':') {
        Some(colon) => {
            let value = line.get(colon + 1..).unwrap_or_default();
            (
                line.get(..colon).unwrap_or_default(),
                value.strip_prefix(b" ").unwrap_or(value),
            )
        }
        None => (line, &b""[..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<(String, String)> {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.push(chunk, |e| {
                out.push((
                    String::from_utf8_lossy(e.event).into_owned(),
                    String::from_utf8_lossy(e.data).into_owned(),
                ))
            });
        }
        out
    }

    fn pair(event: &str, data: &str) -> (String, String) {
        (event.to_string(), data.to_string())
    }

    #[test]
    fn whole_events_with_every_line_ending() {
        for stream in [
            &b"event: a\ndata: 1\n\ndata: 2\n\n"[..],
            b"event: a\r\ndata: 1\r\n\r\ndata: 2\r\n\r\n",
            b"event: a\rdata: 1\r\rdata: 2\r\r",
        ] {
            assert_eq!(
                events(&[stream]),
                [pair("a", "1"), pair("message", "2")],
                "{:?}",
                String::from_utf8_lossy(stream)
            );
        }
    }

    #[test]
    fn multi_line_data_comments_and_no_space_after_colon() {
        assert_eq!(
            events(&[b": keep-alive\n\ndata:x\ndata: y\nid: 7\nretry: 10\n\n"]),
            [pair("message", "x\ny")]
        );
        // An event without data is not dispatched.
        assert_eq!(events(&[b"event: ping\n\n"]), []);
        // An unterminated event is not dispatched either.
        assert_eq!(events(&[b"data: partial\n"]), []);
    }

    #[test]
    fn crlf_split_across_chunks_is_one_line_ending() {
        assert_eq!(
            events(&[b"data: 1\r", b"\n\r", b"\ndata: 2\r\n\r\n"]),
            [pair("message", "1"), pair("message", "2")]
        );
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let stream: &[u8] =
            b"event: message_start\r\ndata: {\"a\":1}\r\n\r\n: c\n\nevent: message_stop\ndata: {}\n\ndata: [DONE]\r\r";
        let whole = events(&[stream]);
        assert_eq!(whole.len(), 3);
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let (a, rest) = stream.split_at(i);
                let (b, c) = rest.split_at(j - i);
                assert_eq!(events(&[a, b, c]), whole, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn event_stream_media_type_ignores_case_parameters_and_whitespace() {
        for yes in [
            "text/event-stream",
            "Text/Event-Stream",
            "TEXT/EVENT-STREAM; charset=utf-8",
            " text/event-stream ",
            "text/event-stream;",
        ] {
            assert!(is_event_stream(yes.as_bytes()), "{yes:?}");
        }
        for no in [
            "",
            "application/json",
            "text/event-streamx",
            "text/event-stream-x; a=b",
            "text/event",
            "x-text/event-stream",
        ] {
            assert!(!is_event_stream(no.as_bytes()), "{no:?}");
        }
    }

    #[test]
    fn an_endless_line_is_bounded() {
        let mut parser = SseParser::new();
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..20 {
            parser.push(&chunk, |_| {});
        }
        assert!(parser.overflowed());
        assert!(parser.line.len() <= MAX_LINE);
    }
}
