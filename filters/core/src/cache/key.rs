//! The cache key of an LLM request: a keyed digest of the request body in a
//! canonical form, so that requests that must get the same answer share a key
//! and requests that may get different answers never do.
//!
//! **What is keyed.** Every top-level field of the body except a short list
//! of fields known not to change the output ([`Provider::ignored_fields`]:
//! `metadata` for both providers, and OpenAI's `user`). Keying on everything
//! but a known-inert list, rather than on a list of fields known to matter,
//! means a field this code does not know (a new sampling parameter) can
//! never produce a wrong hit; at worst it costs a miss. `stream` and
//! `stream_options` are keyed (they change the response's shape), and so is
//! `service_tier`.
//!
//! **What is normalised**, so equivalent requests share a key:
//! - object member order and whitespace (objects are written with their
//!   members sorted by key, compact);
//! - a non-empty string `content` of a message is the single text block
//!   `[{"type":"text","text":...}]`, and so is Anthropic's top-level `system`;
//! - a number written as an integer is that integer, exactly (64 bits); a
//!   number written with a fraction or an exponent is its `f64` value in
//!   shortest round-trip form, always with a `.` or an exponent, so it never
//!   equals an integer: `16.0` is not `16` (a backend may accept one and
//!   refuse the other), `0.50` is `0.5` and `1e2` is `100.0` (every JSON
//!   reader that reads floats as `f64` reads them equal); `-0.0` stays
//!   `-0.0`;
//! - a top-level field set to `null` is the same as the field being absent.
//!
//! Nothing else is: strings compare byte for byte, array order matters, and
//! a field set to its default value is not the same as the field absent.
//!
//! **Not keyed at all** (the request bypasses the cache, see
//! [`crate::json`]): a body naming a member twice in one object (backends
//! disagree on which one counts; post-cache answers 400), and a number
//! beyond 64-bit integers (serde reads it as an `f64`, so distinct integers
//! would share a key).
//!
//! **The digest** is HMAC-SHA256 under a per-deployment secret (a key cannot
//! be computed, or a cached entry probed for, without it) over
//! `"zerolayer-cache-v2\0" || u64be(len(provider)) || provider || namespace
//! || canonical JSON`, where the namespace is `'s'` for the shared namespace
//! and `'t' || u64be(len(tenant)) || tenant` for a tenant: every field is
//! length-prefixed or tagged, so no two (provider, namespace, body) triples
//! encode to the same message.

use std::fmt;

use hmac::{Hmac, Mac};
use serde_json::{Map, Number, Value};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::auth::credential::hex;
use crate::json::{BodyError, DuplicateMember, parse_request};

/// Prefix of every digested message; a new canonical form gets a new version
/// (v2: floats no longer equal integers)
/// so that old entries can never be read as new ones.
const DOMAIN: &[u8] = b"zerolayer-cache-v2\0";

/// The LLM API a request is addressed to, which decides its canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    /// Anthropic Messages API (`POST /v1/messages`).
    Anthropic,
    /// OpenAI Chat Completions API (`POST /v1/chat/completions`).
    OpenAi,
}

impl Provider {
    /// The provider whose API is served at `path` in its normal form (see
    /// [`crate::path`]: `//v1/messages` is `/v1/messages`; a `?query` is
    /// ignored). A path without a normal form is no provider's (Envoy
    /// refuses it before the chain). The method is the caller's to check.
    pub fn for_path(path: &str) -> Option<Provider> {
        match crate::path::normalize(path.as_bytes()).ok()?.as_ref() {
            b"/v1/messages" => Some(Provider::Anthropic),
            b"/v1/chat/completions" => Some(Provider::OpenAi),
            _ => None,
        }
    }

    /// Stable lower-case name (`anthropic`, `openai`), also part of the digest.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Anthropic => "anthropic",
            Provider::OpenAi => "openai",
        }
    }

    /// Top-level fields that do not change the response and are left out of
    /// the key. Anthropic has no `user` field: a body with one is refused
    /// upstream, so it must not hit an entry stored for a body without.
    pub fn ignored_fields(self) -> &'static [&'static str] {
        match self {
            Provider::Anthropic => &["metadata"],
            Provider::OpenAi => &["metadata", "user"],
        }
    }
}

/// Why a request body has no cache key. Messages never echo the body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The body is not valid JSON (serde_json's reason, with its position).
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body is not a JSON object")]
    NotAnObject,
    /// A required top-level field is absent (or `null`).
    #[error("request body has no `{0}` field")]
    Missing(&'static str),
    /// An object names a member twice: which one the backend reads is not
    /// known, so the request is refused (400), never keyed.
    #[error(transparent)]
    Duplicate(#[from] DuplicateMember),
    /// A number beyond 64-bit integers, which cannot be keyed exactly.
    #[error("request body has a number beyond 64-bit integers")]
    NumberOutOfRange,
    /// The secret cannot key HMAC-SHA256. HMAC takes a key of any length
    /// (RFC 2104 §2), so this never happens; the request is then not keyed
    /// rather than the filter panicking.
    #[error("the cache secret cannot key HMAC-SHA256")]
    Secret,
    /// A top-level field has a type the API does not accept.
    #[error("request body field `{field}` is not {expected}")]
    WrongType {
        /// The field's name.
        field: &'static str,
        /// What it should be (`a string`, `an array`, ...).
        expected: &'static str,
    },
}

/// A request's cache identity: the keyed digest of its canonical form.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    /// First 8 bytes as u64 (little endian): picks the slot(s) in the bounded index.
    pub fn slot_hash(&self) -> u64 {
        let [b0, b1, b2, b3, b4, b5, b6, b7, ..] = self.0;
        u64::from_le_bytes([b0, b1, b2, b3, b4, b5, b6, b7])
    }

    /// Lowercase hex of the first 8 bytes, for logs and metrics (never the whole digest).
    pub fn short_hex(&self) -> String {
        hex(&self.0[..8])
    }

    /// Lowercase hex of the whole digest: the entry's name in the fleet
    /// tier (keyed, so it reveals nothing about the request).
    pub fn hex(&self) -> String {
        hex(&self.0)
    }

    /// Whether `stored` is this digest, compared in constant time so that a
    /// stored entry's digest cannot be learnt byte by byte from timings.
    /// A `stored` of the wrong length never matches.
    pub fn matches(&self, stored: &[u8]) -> bool {
        // `subtle` compares the lengths (public) first, then every byte.
        self.0.as_slice().ct_eq(stored).into()
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({}…)", self.short_hex())
    }
}

/// What the cache needs from a request body, computed once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CanonicalRequest {
    /// The request's cache key.
    pub key: CacheKey,
    /// Whether the request asks for a streamed response (`"stream": true`).
    pub stream: bool,
    /// The request's `temperature`, if it sets one.
    pub temperature: Option<f64>,
    /// The API the request is for.
    pub provider: Provider,
}

impl CanonicalRequest {
    /// Parses and canonicalises `body` for `provider`, keyed with `secret` in `namespace` (tenant, or None for a shared namespace).
    pub fn of(
        provider: Provider,
        body: &[u8],
        namespace: Option<&str>,
        secret: &[u8],
    ) -> Result<CanonicalRequest, KeyError> {
        let canonical = canonicalise(provider, body)?;
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| KeyError::Secret)?;
        mac.update(DOMAIN);
        update_prefixed(&mut mac, provider.name().as_bytes());
        match namespace {
            None => mac.update(b"s"),
            Some(tenant) => {
                mac.update(b"t");
                update_prefixed(&mut mac, tenant.as_bytes());
            }
        }
        mac.update(&canonical.json);
        Ok(CanonicalRequest {
            key: CacheKey(mac.finalize().into_bytes().into()),
            stream: canonical.stream,
            temperature: canonical.temperature,
            provider,
        })
    }
}

/// The canonical form of `body` for `provider`: the bytes that are digested
/// into its key (compact JSON, for tests and debugging).
pub fn canonical_json(provider: Provider, body: &[u8]) -> Result<Vec<u8>, KeyError> {
    canonicalise(provider, body).map(|canonical| canonical.json)
}

/// A canonicalised body and the fields read on the way.
struct Canonical {
    json: Vec<u8>,
    stream: bool,
    temperature: Option<f64>,
}

/// Parses `body`, checks the fields the cache relies on and writes the
/// canonical form.
fn canonicalise(provider: Provider, body: &[u8]) -> Result<Canonical, KeyError> {
    // serde_json limits nesting to 128 levels, which bounds the recursion of
    // the writer below as well.
    let value = parse_request(body).map_err(|err| match err {
        BodyError::Duplicate(dup) => KeyError::Duplicate(dup),
        BodyError::NumberOutOfRange => KeyError::NumberOutOfRange,
        BodyError::NotJson(reason) => KeyError::NotJson(reason),
    })?;
    let Value::Object(mut request) = value else {
        return Err(KeyError::NotAnObject);
    };
    let ignored = provider.ignored_fields();
    request.retain(|name, value| !value.is_null() && !ignored.contains(&name.as_str()));

    match request.get("model") {
        None => return Err(KeyError::Missing("model")),
        Some(Value::String(_)) => {}
        Some(_) => return Err(wrong_type("model", "a string")),
    }
    match request.get("messages") {
        None => return Err(KeyError::Missing("messages")),
        Some(Value::Array(_)) => {}
        Some(_) => return Err(wrong_type("messages", "an array")),
    }
    let stream = match request.get("stream") {
        None => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err(wrong_type("stream", "a boolean")),
    };
    let temperature = match request.get("temperature") {
        None => None,
        Some(Value::Number(t)) => t.as_f64(),
        Some(_) => return Err(wrong_type("temperature", "a number")),
    };

    let mut json = Vec::with_capacity(body.len());
    write_object(&mut json, &request, |out, name, value| {
        match (name, value) {
            ("messages", Value::Array(messages)) => write_messages(out, messages),
            ("system", Value::String(text)) if provider == Provider::Anthropic => {
                write_content(out, text)
            }
            _ => write_value(out, value),
        }
    });
    Ok(Canonical {
        json,
        stream,
        temperature,
    })
}

fn wrong_type(field: &'static str, expected: &'static str) -> KeyError {
    KeyError::WrongType { field, expected }
}

/// Feeds `bytes` to `mac` after their length (u64, big endian): a u64 holds
/// any length, so the prefix needs no fallible conversion.
fn update_prefixed(mac: &mut Hmac<Sha256>, bytes: &[u8]) {
    mac.update(&(bytes.len() as u64).to_be_bytes());
    mac.update(bytes);
}

/// Writes the `messages` array, each message's string `content` as text blocks.
fn write_messages(out: &mut Vec<u8>, messages: &[Value]) {
    out.push(b'[');
    for (i, message) in messages.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match message {
            Value::Object(message) => {
                write_object(out, message, |out, name, value| match (name, value) {
                    ("content", Value::String(text)) => write_content(out, text),
                    _ => write_value(out, value),
                })
            }
            // Not a message the API accepts; keyed as it is.
            other => write_value(out, other),
        }
    }
    out.push(b']');
}

/// Writes a string content as what it stands for, `[{"type":"text","text":...}]`
/// (members in key order). An empty string is kept a string: an empty text
/// block is refused by Anthropic where an empty string may not be, so the two
/// are not known to be equivalent.
fn write_content(out: &mut Vec<u8>, text: &str) {
    if text.is_empty() {
        write_str(out, text);
        return;
    }
    out.extend_from_slice(br#"[{"text":"#);
    write_str(out, text);
    out.extend_from_slice(br#","type":"text"}]"#);
}

/// Writes `value` as compact JSON, objects with sorted members and numbers
/// normalised.
fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Value::Object(map) => write_object(out, map, write_value_of),
    }
}

fn write_value_of(out: &mut Vec<u8>, _name: &str, value: &Value) {
    write_value(out, value);
}

/// Writes `map` with its members sorted by key, each value by `member`.
fn write_object(
    out: &mut Vec<u8>,
    map: &Map<String, Value>,
    member: impl Fn(&mut Vec<u8>, &str, &Value),
) {
    out.push(b'{');
    let mut write = |i: usize, name: &str, value: &Value| {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, name);
        out.push(b':');
        member(out, name, value);
    };
    // serde_json's `Map` is a BTreeMap and iterates sorted, unless another
    // crate in the build turns on `preserve_order` (then insertion order):
    // check rather than assume, and sort only when needed.
    let sorted = map.keys().zip(map.keys().skip(1)).all(|(a, b)| a < b);
    if sorted {
        for (i, (name, value)) in map.iter().enumerate() {
            write(i, name, value);
        }
    } else {
        let mut members: Vec<_> = map.iter().collect();
        members.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (i, (name, value)) in members.into_iter().enumerate() {
            write(i, name, value);
        }
    }
    out.push(b'}');
}

/// Writes a number: an integer (serde read it as one: it was written as
/// one and fits 64 bits) as it is; a float in serde_json's shortest
/// round-trip form, which always has a `.` or an exponent (`16.0`, `1e300`),
/// so that no float is written like an integer.
fn write_number(out: &mut Vec<u8>, n: &Number) {
    if let Some(i) = n.as_i64() {
        out.extend_from_slice(i.to_string().as_bytes());
    } else if let Some(u) = n.as_u64() {
        out.extend_from_slice(u.to_string().as_bytes());
    } else if let Some(f) = n.as_f64() {
        // Through `from_f64` rather than `n`'s own Display, which prints
        // the source text if serde_json's `arbitrary_precision` is on.
        let n = Number::from_f64(f).unwrap_or_else(|| n.clone());
        out.extend_from_slice(n.to_string().as_bytes());
    } else {
        out.extend_from_slice(n.to_string().as_bytes());
    }
}

/// Escape of each byte in a JSON string: 0 for none, `u` for `\u00XX`,
/// otherwise the character after the backslash.
static ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = b'u';
        byte += 1;
    }
    table[0x08] = b'b';
    table[0x09] = b't';
    table[0x0a] = b'n';
    table[0x0c] = b'f';
    table[0x0d] = b'r';
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table
};

/// Writes `s` as a JSON string, escaped exactly as serde_json does (`"`,
/// `\`, control characters; nothing else), so the canonical form is also
/// what serde_json itself would write.
fn write_str(out: &mut Vec<u8>, s: &str) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut plain_from = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        // A table rather than a `match`: this loop sees every byte of the body.
        let escape = ESCAPE[usize::from(byte)];
        if escape == 0 {
            continue;
        }
        out.extend_from_slice(bytes.get(plain_from..i).unwrap_or_default());
        if escape == b'u' {
            out.extend_from_slice(b"\\u00");
            out.push(DIGITS[usize::from(byte >> 4)]);
            out.push(DIGITS[usize::from(byte & 0xf)]);
        } else {
            out.extend_from_slice(&[b'\\', escape]);
        }
        plain_from = i + 1;
    }
    out.extend_from_slice(bytes.get(plain_from..).unwrap_or_default());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Digests pinned from RFC 2104 HMAC-SHA256 computed outside this code,
    /// for secrets shorter than a block, a block long and longer (hashed
    /// first): the keys stay those of the hand-written key preparation the
    /// hmac crate's replaced.
    #[test]
    fn secrets_of_every_length_key_as_rfc_2104_does() {
        let body = br#"{"model":"m","messages":[]}"#;
        assert_eq!(
            canonical_json(Provider::Anthropic, body).unwrap(),
            br#"{"messages":[],"model":"m"}"#
        );
        let pinned = [
            (
                0,
                "18475c844cb159bdc9b9cfd5f2198412da1cf8f91a892bd8929308224ce1571e",
            ),
            (
                1,
                "93f5ded781b8f3dd1c9c568bb3e4e8c77d9dd48f79cfe29270af391a6e14dfbd",
            ),
            (
                31,
                "2ac15086cf519d3b04c90f0f970e811f9c143365c9aebc059637cfff1ff2763c",
            ),
            (
                32,
                "ca2518dc68ce686a8fcd08899886eda98295e9dd80c323a329dcfcd1f07cf195",
            ),
            (
                63,
                "e4932ac2e9bb28863a74afedaaf7fa82d9775675c39557d6c9840028119bb22d",
            ),
            (
                64,
                "3c354b8b25892323a071a7b0248484401ac8abc6b78210bc99e11d63693e565b",
            ),
            (
                65,
                "141eb86c06b5c10eacb6213c6d3e732e722645310aeb399bc329695f346a43ef",
            ),
            (
                128,
                "2b10f6d4d6fdd7e71a0158d1fdf18eb920611dbf29a9ffc7877ac0624495c930",
            ),
            (
                200,
                "66bbdf0f71baaf4e38cc771cc6e289daff0a8016dbdabf2345cbe6af516fc5a1",
            ),
        ];
        for (len, digest) in pinned {
            let secret: Vec<u8> = (0..len).map(|i: usize| (i * 7 + 3) as u8).collect();
            let request = CanonicalRequest::of(Provider::Anthropic, body, None, &secret).unwrap();
            assert_eq!(request.key.hex(), digest, "secret of {len} bytes");
        }
    }

    #[test]
    fn strings_are_escaped_like_serde_json() {
        let all_ascii: String = (0u8..0x80).map(char::from).collect();
        for s in ["", "plain", "é ü 日本 \u{2028} 🦀", "\"\\/", &all_ascii] {
            let mut ours = Vec::new();
            write_str(&mut ours, s);
            assert_eq!(ours, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn numbers() {
        let cases = [
            ("0", "0"),
            // serde_json reads `-0` as the float -0.0 (a miss, never a wrong hit).
            ("-0", "-0.0"),
            ("16", "16"),
            ("0.0", "0.0"),
            ("-0.0", "-0.0"),
            ("1.0", "1.0"),
            ("16.0", "16.0"),
            ("1e2", "100.0"),
            ("-3.0", "-3.0"),
            ("0.5", "0.5"),
            ("0.50", "0.5"),
            ("1.5e-7", "1.5e-7"),
            ("9007199254740993", "9007199254740993"),
            ("9007199254740992", "9007199254740992"),
            ("18446744073709551615", "18446744073709551615"),
            ("9223372036854775807", "9223372036854775807"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("-9223372036854775808.0", "-9.223372036854776e+18"),
            ("1e19", "1e+19"),
        ];
        for (input, expected) in cases {
            let Value::Number(n) = serde_json::from_str(input).unwrap() else {
                panic!("{input} is not a number");
            };
            let mut out = Vec::new();
            write_number(&mut out, &n);
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{input}");
        }
    }

    #[test]
    fn key_formatting() {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]);
        bytes[31] = 0xff;
        let key = CacheKey(bytes);
        assert_eq!(key.short_hex(), "0123456789abcdef");
        assert_eq!(format!("{key:?}"), "CacheKey(0123456789abcdef…)");
        assert_eq!(key.slot_hash(), 0xefcd_ab89_6745_2301);
    }
}
