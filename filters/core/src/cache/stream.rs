//! Whether a streamed response completed: only a stream that reached its
//! provider's terminal event (`message_stop`, `data: [DONE]`) without an
//! error event may be cached; an interrupted one never is.

use crate::sse::SseParser;

use super::key::Provider;

/// Watches a response stream's events as its chunks pass.
#[derive(Debug)]
pub struct StreamCompletion {
    provider: Provider,
    parser: SseParser,
    terminated: bool,
    failed: bool,
}

impl StreamCompletion {
    /// A watcher for a `provider` stream.
    pub fn new(provider: Provider) -> StreamCompletion {
        StreamCompletion {
            provider,
            parser: SseParser::new(),
            terminated: false,
            failed: false,
        }
    }

    /// Feeds the next chunk of the response body.
    pub fn push(&mut self, chunk: &[u8]) {
        let provider = self.provider;
        let (mut terminated, mut failed) = (self.terminated, false);
        self.parser.push(chunk, |event| {
            // An error event, or any event after the terminal one, means the
            // stream is not a clean response.
            if terminated || event.event == b"error" || is_openai_error(event.data) {
                failed = true;
            }
            terminated |= match provider {
                Provider::Anthropic => event.event == b"message_stop",
                Provider::OpenAi => event.data == b"[DONE]",
            };
        });
        self.terminated = terminated;
        self.failed |= failed || self.parser.overflowed();
    }

    /// Whether the stream ended cleanly: terminal event seen, no error event.
    pub fn complete(&self) -> bool {
        self.terminated && !self.failed
    }
}

/// OpenAI reports mid-stream failures as `data: {"error": …}`.
fn is_openai_error(data: &[u8]) -> bool {
    data.starts_with(b"{\"error\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(provider: Provider, chunks: &[&[u8]]) -> bool {
        let mut watch = StreamCompletion::new(provider);
        for chunk in chunks {
            watch.push(chunk);
        }
        watch.complete()
    }

    const ANTHROPIC: &[u8] = b"event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    const OPENAI: &[u8] =
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";

    #[test]
    fn terminal_events_complete_a_stream() {
        assert!(complete(Provider::Anthropic, &[ANTHROPIC]));
        assert!(complete(Provider::OpenAi, &[OPENAI]));
        let (a, b) = ANTHROPIC.split_at(ANTHROPIC.len() - 5);
        assert!(complete(Provider::Anthropic, &[a, b]));
    }

    #[test]
    fn interrupted_and_failed_streams_are_incomplete() {
        let cut = &ANTHROPIC[..ANTHROPIC.len() - 3];
        assert!(
            !complete(Provider::Anthropic, &[cut]),
            "no blank line after message_stop"
        );
        assert!(!complete(Provider::OpenAi, &[&OPENAI[..40]]));
        assert!(!complete(
            Provider::Anthropic,
            &[b"event: error\ndata: {\"type\":\"error\"}\n\n", ANTHROPIC]
        ));
        assert!(!complete(
            Provider::OpenAi,
            &[
                b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
                OPENAI
            ]
        ));
        // Another provider's terminal event does not count.
        assert!(!complete(Provider::OpenAi, &[ANTHROPIC]));
        assert!(!complete(Provider::Anthropic, &[OPENAI]));
        // Data after the end.
        assert!(!complete(Provider::OpenAi, &[OPENAI, b"data: more\n\n"]));
        let mut joined = OPENAI.to_vec();
        joined.extend_from_slice(b"data: more\n\n");
        assert!(!complete(Provider::OpenAi, &[&joined]));
        assert!(complete(Provider::OpenAi, &[OPENAI, b"\n"]));
    }
}
