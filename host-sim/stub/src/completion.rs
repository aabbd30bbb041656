//! Deterministic completions: which words a request gets back, and why they
//! stop.
//!
//! The seed is the xxh3 of the canonical JSON (keys sorted, no whitespace) of
//! `{"max_tokens", "messages", "model", "system"}`, so the same conversation
//! always gets the same words whatever the key order or formatting on the
//! wire, and any change to it gets different ones.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use xxhash_rust::xxh3::xxh3_64;

/// The shortest and longest natural completion, in tokens.
const NATURAL_LENGTHS: std::ops::RangeInclusive<u64> = 8..=40;

/// The words completions are made of: GPU small talk.
const VOCABULARY: [&str; 32] = [
    "tensor",
    "kernel",
    "warp",
    "cache",
    "token",
    "batch",
    "prefill",
    "decode",
    "shard",
    "layer",
    "attention",
    "matrix",
    "stream",
    "memory",
    "block",
    "thread",
    "vector",
    "weight",
    "gradient",
    "pipeline",
    "queue",
    "latency",
    "throughput",
    "scheduler",
    "register",
    "sample",
    "logit",
    "context",
    "window",
    "embedding",
    "head",
    "fabric",
];

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The completion reached its natural length.
    EndTurn,
    /// The request's `max_tokens` cut it short.
    MaxTokens,
}

/// The generated answer, one piece per output token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Completion {
    /// Token texts; concatenated they are the answer (pieces after the first
    /// carry their leading space, as streamed deltas do).
    pub pieces: Vec<String>,
    /// Why generation stopped.
    pub stop: Stop,
}

impl Completion {
    /// Generates the completion for `seed`: a natural length of
    /// `fixed_length` (at least 1) or else 8..=40 from the seed, cut to
    /// `max_tokens` when that is smaller.
    pub(crate) fn generate(seed: u64, max_tokens: Option<u32>, fixed_length: Option<u32>) -> Self {
        let natural = fixed_length.map_or_else(
            || {
                let span = NATURAL_LENGTHS.end() - NATURAL_LENGTHS.start() + 1;
                NATURAL_LENGTHS.start() + seed % span
            },
            |n| u64::from(n.max(1)),
        );
        let limit = max_tokens.map_or(u64::MAX, u64::from);
        let (length, stop) = if limit < natural {
            (limit, Stop::MaxTokens)
        } else {
            (natural, Stop::EndTurn)
        };
        let mut words = SplitMix64(seed);
        let pieces = (0..length)
            .map(|i| {
                let word = VOCABULARY[words.below(VOCABULARY.len())];
                let mut piece = if i == 0 {
                    capitalized(word)
                } else {
                    format!(" {word}")
                };
                if i + 1 == natural {
                    piece.push('.');
                }
                piece
            })
            .collect();
        Self { pieces, stop }
    }

    /// The whole answer text.
    pub(crate) fn text(&self) -> String {
        self.pieces.concat()
    }

    /// The number of output tokens.
    pub(crate) fn tokens(&self) -> u32 {
        u32::try_from(self.pieces.len()).unwrap_or(u32::MAX)
    }
}

/// The completion seed of a request (see the module documentation).
pub(crate) fn seed(
    model: &str,
    system: Option<&Value>,
    messages: &[Value],
    max_tokens: Option<u32>,
) -> u64 {
    let mut key = Map::new();
    key.insert(
        "max_tokens".into(),
        max_tokens.map_or(Value::Null, Value::from),
    );
    key.insert("messages".into(), Value::Array(messages.to_vec()));
    key.insert("model".into(), Value::from(model));
    key.insert("system".into(), system.cloned().unwrap_or(Value::Null));
    let mut canonical = String::new();
    write_canonical(&Value::Object(key), &mut canonical);
    xxh3_64(canonical.as_bytes())
}

/// Writes `value` as compact JSON with object keys sorted, whatever map
/// order `serde_json` was built with.
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}:", Value::from(key.as_str()));
                write_canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => {
            let _ = write!(out, "{scalar}");
        }
    }
}

fn capitalized(word: &str) -> String {
    let mut chars = word.chars();
    chars.next().map_or_else(String::new, |first| {
        first.to_uppercase().chain(chars).collect()
    })
}

/// A tiny, well-mixed PRNG: the stub needs determinism, not quality.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (`bound` > 0).
    fn below(&mut self, bound: usize) -> usize {
        let bound = u64::try_from(bound).unwrap_or(u64::MAX).max(1);
        usize::try_from(self.next() % bound).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer;
    use serde_json::json;

    fn conversation(text: &str) -> Vec<Value> {
        vec![json!({"role": "user", "content": text})]
    }

    #[test]
    fn seed_ignores_key_order_and_formatting() {
        let a: Value = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        let b: Value =
            serde_json::from_str("{ \"content\" : \"hi\",\n \"role\" : \"user\" }").unwrap();
        assert_eq!(
            seed("m", None, &[a], Some(9)),
            seed("m", None, &[b], Some(9))
        );
    }

    #[test]
    fn seed_covers_model_system_messages_and_max_tokens() {
        let base = seed("m", None, &conversation("hi"), Some(9));
        assert_ne!(base, seed("n", None, &conversation("hi"), Some(9)));
        assert_ne!(
            base,
            seed("m", Some(&json!("sys")), &conversation("hi"), Some(9))
        );
        assert_ne!(base, seed("m", None, &conversation("hello"), Some(9)));
        assert_ne!(base, seed("m", None, &conversation("hi"), Some(10)));
        assert_ne!(base, seed("m", None, &conversation("hi"), None));
    }

    #[test]
    fn natural_length_is_8_to_40_and_ends_the_turn() {
        for s in 0..500 {
            let completion = Completion::generate(s, None, None);
            assert!((8..=40).contains(&completion.tokens()), "seed {s}");
            assert_eq!(completion.stop, Stop::EndTurn);
            assert!(completion.text().ends_with('.'));
        }
    }

    #[test]
    fn max_tokens_truncates_only_when_smaller() {
        let natural = Completion::generate(7, None, Some(12));
        assert_eq!(natural.tokens(), 12);

        let cut = Completion::generate(7, Some(5), Some(12));
        assert_eq!((cut.tokens(), cut.stop), (5, Stop::MaxTokens));
        assert_eq!(cut.pieces[..], natural.pieces[..5]);

        let exact = Completion::generate(7, Some(12), Some(12));
        assert_eq!(exact, natural);
    }

    #[test]
    fn fixed_length_is_at_least_one() {
        assert_eq!(Completion::generate(1, None, Some(0)).tokens(), 1);
    }

    #[test]
    fn pieces_are_exactly_the_tokenizer_words() {
        for s in 0..100 {
            let completion = Completion::generate(s, Some(20), None);
            assert_eq!(tokenizer::count(&completion.text()), completion.tokens());
            assert!(completion.pieces[1..].iter().all(|p| p.starts_with(' ')));
        }
    }

    #[test]
    fn same_seed_same_words() {
        assert_eq!(
            Completion::generate(42, None, None),
            Completion::generate(42, None, None)
        );
        assert_ne!(
            Completion::generate(42, None, None).text(),
            Completion::generate(43, None, None).text()
        );
    }
}
