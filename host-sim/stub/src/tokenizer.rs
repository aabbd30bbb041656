//! The stub's one tokenizer: a token is a whitespace-separated word.
//!
//! Input tokens are the words of the system prompt plus the words of every
//! message's text (a string `content`, or the `text` of each `"type": "text"`
//! block/part of an array `content`). Roles, names, images and tool blocks
//! count zero. Output tokens are the generated words, one per stream delta.
//! The rule is crude on purpose: a test can count tokens by eye.

use serde_json::Value;

/// Counts the tokens (whitespace-separated words) of `text`.
pub fn count(text: &str) -> u32 {
    u32::try_from(text.split_whitespace().count()).unwrap_or(u32::MAX)
}

/// Counts the tokens of a `system`/`content` value: a string, or an array of
/// blocks whose `"type": "text"` members contribute their `text`.
///
/// Anything else (null, images, tool calls) counts zero; request validation
/// has already rejected ill-typed values.
pub fn count_content(content: &Value) -> u32 {
    match content {
        Value::String(text) => count(text),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|block| block.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|block| block.get("text").and_then(Value::as_str))
            .map(count)
            .fold(0, u32::saturating_add),
        _ => 0,
    }
}

/// Counts a request's input tokens from its system prompt (if any) and the
/// `content` of each message.
pub fn count_input(system: Option<&Value>, messages: &[Value]) -> u32 {
    let system = system.map_or(0, count_content);
    messages
        .iter()
        .filter_map(|message| message.get("content"))
        .map(count_content)
        .fold(system, u32::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn words_are_whitespace_separated() {
        let table = [
            ("", 0),
            ("   ", 0),
            ("hello", 1),
            ("hello world", 2),
            ("  hello\n\tworld  again ", 3),
            ("don't split-on punctuation.", 3),
        ];
        for (text, tokens) in table {
            assert_eq!(count(text), tokens, "{text:?}");
        }
    }

    #[test]
    fn content_counts_strings_and_text_blocks_only() {
        let table = [
            (json!("one two three"), 3),
            (
                json!([{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}]),
                3,
            ),
            (
                json!([{"type": "image", "source": {}}, {"type": "text", "text": "a b"}]),
                2,
            ),
            (json!([{"type": "tool_use", "text": "not counted"}]), 0),
            (json!(null), 0),
        ];
        for (content, tokens) in table {
            assert_eq!(count_content(&content), tokens, "{content}");
        }
    }

    #[test]
    fn input_adds_system_and_every_message() {
        let messages = [
            json!({"role": "user", "content": "what is a GPU"}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "a chip"}]}),
            json!({"role": "user", "content": "thanks"}),
        ];
        assert_eq!(count_input(None, &messages), 7);
        assert_eq!(count_input(Some(&json!("be brief")), &messages), 9);
        assert_eq!(
            count_input(Some(&json!([{"type": "text", "text": "be"}])), &messages),
            8
        );
    }
}
