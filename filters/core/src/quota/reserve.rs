//! What a request costs, in a policy's unit: its upper bound before it runs
//! (what it reserves) and its exact cost after (what it settles).
//!
//! **The input bound.** A byte-level BPE token (the tokenizers of GPT,
//! Claude, Llama, …) stands for at least one byte of the text it encodes,
//! so a prompt of `b` bytes is at most `b` tokens, and the request body,
//! which holds the prompt and more (JSON framing, the model name, …), is a
//! bound on its input tokens: `input_tokens ≤ body_bytes`. The bound is
//! loose (about 4 bytes a token for English) and the difference is
//! refunded at settlement. It does not cover input the body only points
//! to (an image URL, a file id): such requests settle above their bound,
//! which the lease records as debt.
//!
//! **The output bound.** The largest of `max_tokens`,
//! `max_completion_tokens` and `max_output_tokens` in the body
//! ([`crate::usage::RequestScan::max_output_tokens`]: numbers, strings of
//! numbers, escaped names, as a backend reads them); when the request
//! names none, or one no backend reads as a bound (`null`, `-1`), the
//! policy's `default_max_output_tokens` too, so leaving the cap out (or
//! writing it so the scan misses it) cannot dodge the reservation. A
//! client cap above the default is reserved at its own value.

use std::collections::HashMap;

use super::config::{Rates, Unit};
use crate::cache::key::Provider;
use crate::usage::{RequestScan, Usage};

/// What the request itself says about its size: read once per request and
/// shared by every policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestBound {
    /// Bytes of the request body (its `content-length`, or the bytes counted).
    pub body_bytes: u64,
    /// The output cap the body names, if any.
    pub max_output_tokens: Option<u64>,
    /// Whether the backend's own default may apply as well (a cap member
    /// no backend reads as a bound beside a readable one).
    pub default_applies: bool,
}

impl RequestBound {
    /// The bound of a body of `body_bytes` asking for `max_output_tokens`.
    pub fn new(body_bytes: u64, max_output_tokens: Option<u64>) -> RequestBound {
        RequestBound {
            body_bytes,
            max_output_tokens,
            default_applies: max_output_tokens.is_none(),
        }
    }

    /// The bound of a body of `body_bytes` as `scan` read it.
    pub fn scanned(body_bytes: u64, scan: &RequestScan) -> RequestBound {
        RequestBound {
            body_bytes,
            max_output_tokens: scan.max_output_tokens(),
            default_applies: scan.backend_default_applies(),
        }
    }

    /// The most input tokens the body can hold (one token covers ≥ 1 byte).
    pub fn input_tokens(&self) -> u64 {
        self.body_bytes
    }

    /// The most output tokens: the body's cap, or `default_cap` where the
    /// backend's default may apply (the larger, when both may).
    pub fn output_tokens(&self, default_cap: u64) -> u64 {
        match (self.max_output_tokens, self.default_applies) {
            (Some(cap), false) => cap,
            (Some(cap), true) => cap.max(default_cap),
            (None, _) => default_cap,
        }
    }
}

/// `body` (a JSON object whose root closes at offset `root_end`, naming no
/// output cap) with `provider`'s cap member set to `cap`, appended before
/// the closing brace: `max_completion_tokens` for OpenAI Chat Completions
/// (the name every current OpenAI model, vLLM and llama.cpp read),
/// `max_tokens` for Anthropic Messages. Every other byte is kept. `None`
/// when `root_end` is not the body's closing brace.
pub fn with_output_cap(
    provider: Provider,
    body: &[u8],
    root_end: usize,
    cap: u64,
) -> Option<Vec<u8>> {
    if body.get(root_end) != Some(&b'}') {
        return None;
    }
    let before = body.get(..root_end)?;
    let empty = before.trim_ascii_end().ends_with(b"{");
    let name = match provider {
        Provider::OpenAi => "max_completion_tokens",
        Provider::Anthropic => "max_tokens",
    };
    let member = format!("{}\"{name}\":{cap}", if empty { "" } else { "," });
    splice(body, root_end..root_end, member.as_bytes())
}

/// `body` with the value at `span` (its only cap member's, asking for no
/// bound: [`RequestScan::open_output_cap`]) replaced by `cap`; `None` when
/// `span` is not in `body`.
pub fn with_output_cap_at(body: &[u8], span: std::ops::Range<usize>, cap: u64) -> Option<Vec<u8>> {
    splice(body, span, cap.to_string().as_bytes())
}

/// `body` with `span` replaced by `bytes` (`None` when `span` is not in it).
fn splice(body: &[u8], span: std::ops::Range<usize>, bytes: &[u8]) -> Option<Vec<u8>> {
    let (before, after) = (body.get(..span.start)?, body.get(span.end..)?);
    let mut out = Vec::with_capacity(before.len() + bytes.len() + after.len());
    out.extend_from_slice(before);
    out.extend_from_slice(bytes);
    out.extend_from_slice(after);
    Some(out)
}

/// Tokens of one response by kind, counted the same for every provider:
/// `input` excludes what the prompt cache served or stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct TokenCounts {
    /// Uncached input tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write: u64,
}

impl TokenCounts {
    /// The counts of metering's [`Usage`] from `provider`'s response:
    /// OpenAI's `prompt_tokens` include the cached ones, Anthropic's
    /// `input_tokens` do not.
    pub fn from_usage(usage: &Usage, provider: Provider) -> TokenCounts {
        let input = match provider {
            Provider::OpenAi => usage.input_tokens.saturating_sub(usage.cache_read_tokens),
            Provider::Anthropic => usage.input_tokens,
        };
        TokenCounts {
            input,
            output: usage.output_tokens,
            cache_read: usage.cache_read_tokens,
            cache_write: usage.cache_creation_tokens,
        }
    }

    /// Only output tokens (what a stream draws as it goes).
    pub fn output(output: u64) -> TokenCounts {
        TokenCounts {
            output,
            ..TokenCounts::default()
        }
    }
}

/// A policy's unit, compiled: how counts become an amount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostModel {
    /// Each request costs 1, tokens nothing.
    Requests,
    /// One per token.
    Tokens,
    /// `ceil(Σ tokens × rate / divisor)`, the rates chosen by model.
    Table {
        /// Rates by model.
        models: HashMap<String, Rates>,
        /// Rates of any other model.
        default: Rates,
        /// 1000 for weights (thousandths), 1,000,000 for prices (per million).
        divisor: u64,
    },
}

impl CostModel {
    /// The model of a configured unit.
    pub fn new(unit: &Unit) -> CostModel {
        match unit {
            Unit::Requests => CostModel::Requests,
            Unit::Tokens => CostModel::Tokens,
            Unit::WeightedTokens(t) => CostModel::Table {
                models: t.models.clone().into_iter().collect(),
                default: t.default,
                divisor: 1000,
            },
            Unit::Currency(t) => CostModel::Table {
                models: t.models.clone().into_iter().collect(),
                default: t.default,
                divisor: 1_000_000,
            },
        }
    }

    /// Whether tokens cost anything (a requests policy ignores them: a
    /// stream draws nothing from it).
    pub fn counts_tokens(&self) -> bool {
        !matches!(self, CostModel::Requests)
    }

    /// The exact cost of one request's `counts` for `model`; `request`:
    /// whether the request itself is counted (1 in a requests policy).
    pub fn cost(&self, model: Option<&str>, counts: &TokenCounts, request: bool) -> u64 {
        match self {
            CostModel::Requests => u64::from(request),
            CostModel::Tokens => counts
                .input
                .saturating_add(counts.output)
                .saturating_add(counts.cache_read)
                .saturating_add(counts.cache_write),
            CostModel::Table {
                models,
                default,
                divisor,
            } => {
                let r = model.and_then(|m| models.get(m)).unwrap_or(default);
                let cache_write = r.cache_write.unwrap_or(r.input);
                weighted(
                    &[
                        (counts.input, r.input),
                        (counts.output, r.output),
                        (counts.cache_read, r.cache_read),
                        (counts.cache_write, cache_write),
                    ],
                    *divisor,
                )
            }
        }
    }

    /// The upper bound of a request of `input` and `output` tokens: every
    /// input token at the dearest input rate (uncached, cache read or cache
    /// write: which one the provider applies is known only after).
    pub fn bound(&self, model: Option<&str>, input: u64, output: u64) -> u64 {
        match self {
            CostModel::Requests => 1,
            CostModel::Tokens => input.saturating_add(output),
            CostModel::Table {
                models,
                default,
                divisor,
            } => {
                let r = model.and_then(|m| models.get(m)).unwrap_or(default);
                let dearest = r
                    .input
                    .max(r.cache_read)
                    .max(r.cache_write.unwrap_or(r.input));
                weighted(&[(input, dearest), (output, r.output)], *divisor)
            }
        }
    }
}

/// `ceil(Σ tokens × rate / divisor)` in u128 (tokens < 2^64 times rates
/// < 2^40 cannot overflow), rounded up once: the ledger never undercounts.
fn weighted(terms: &[(u64, u64)], divisor: u64) -> u64 {
    let sum: u128 = terms
        .iter()
        .map(|&(tokens, rate)| u128::from(tokens) * u128::from(rate))
        .sum();
    u64::try_from(sum.div_ceil(u128::from(divisor.max(1)))).unwrap_or(u64::MAX)
}
