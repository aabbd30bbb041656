//! The cache key: which requests share one (tables of equivalent and of
//! different requests, then properties on random requests), the digest's
//! layout, errors, and constant-time matching.

use hmac::{Hmac, Mac};
use proptest::prelude::*;
use serde_json::{Value, json};
use sha2::Sha256;
use zerolayer_core::cache::key::{CacheKey, CanonicalRequest, KeyError, Provider, canonical_json};

const SECRET: &[u8] = b"per-deployment secret";

fn key_of(provider: Provider, body: &[u8], namespace: Option<&str>, secret: &[u8]) -> CacheKey {
    match CanonicalRequest::of(provider, body, namespace, secret) {
        Ok(request) => request.key,
        Err(err) => panic!("{err} for {}", String::from_utf8_lossy(body)),
    }
}

fn key(provider: Provider, body: &Value) -> CacheKey {
    key_of(
        provider,
        &serde_json::to_vec(body).unwrap(),
        Some("acme"),
        SECRET,
    )
}

fn edit(base: &Value, change: impl FnOnce(&mut Value)) -> Value {
    let mut value = base.clone();
    change(&mut value);
    value
}

fn remove(value: &mut Value, field: &str) {
    value.as_object_mut().unwrap().remove(field);
}

fn anthropic() -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}]},
            {"role": "user", "content": "Thanks."}
        ],
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["\n\nHuman:"],
        "tools": [{
            "name": "get_weather",
            "description": "Current weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}
        }],
        "tool_choice": {"type": "auto"},
        "stream": false,
        "metadata": {"user_id": "u-42"}
    })
}

fn openai() -> Value {
    json!({
        "model": "gpt-4.1",
        "messages": [
            {"role": "developer", "content": "You are terse."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Let me check."},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}
        ],
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 256,
        "stop": ["END"],
        "response_format": {"type": "json_object"},
        "seed": 7,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "u-42",
        "metadata": {"trace": "abc"}
    })
}

fn assert_equivalent(provider: Provider, cases: &[(&str, Value, Value)]) {
    for (name, a, b) in cases {
        assert_eq!(
            canonical_json(provider, &serde_json::to_vec(a).unwrap()).unwrap(),
            canonical_json(provider, &serde_json::to_vec(b).unwrap()).unwrap(),
            "{provider:?}: {name}"
        );
        assert_eq!(key(provider, a), key(provider, b), "{provider:?}: {name}");
    }
}

/// Each case differs from `base` and from every other case.
fn assert_all_different(provider: Provider, base: &Value, cases: &[(&str, Value)]) {
    let base_key = key(provider, base);
    let keys: Vec<(&str, CacheKey)> = cases
        .iter()
        .map(|(name, body)| (*name, key(provider, body)))
        .collect();
    for (i, (name, k)) in keys.iter().enumerate() {
        assert_ne!(*k, base_key, "{provider:?}: {name} should change the key");
        for (other, k2) in &keys[..i] {
            assert_ne!(k, k2, "{provider:?}: {name} and {other} share a key");
        }
    }
}

#[test]
fn anthropic_equivalent_requests_share_a_key() {
    let base = anthropic();
    assert_equivalent(
        Provider::Anthropic,
        &[
            (
                "content string is a text block",
                base.clone(),
                edit(&base, |v| {
                    v["messages"][0]["content"] =
                        json!([{"type": "text", "text": "What is the weather in Paris?"}]);
                    v["messages"][1]["content"] = json!("Let me check.");
                }),
            ),
            (
                "system string is a text block",
                base.clone(),
                edit(&base, |v| {
                    v["system"] = json!([{"type": "text", "text": "You are terse."}]);
                }),
            ),
            (
                "null top-level field is absent",
                edit(&base, |v| remove(v, "top_k")),
                edit(&base, |v| v["top_k"] = Value::Null),
            ),
            (
                "metadata is ignored",
                base.clone(),
                edit(&base, |v| {
                    v["metadata"] = json!({"user_id": "someone-else"})
                }),
            ),
            (
                "metadata absent",
                base.clone(),
                edit(&base, |v| remove(v, "metadata")),
            ),
        ],
    );
}

#[test]
fn openai_equivalent_requests_share_a_key() {
    let base = openai();
    assert_equivalent(
        Provider::OpenAi,
        &[
            (
                "content string is a text block",
                base.clone(),
                edit(&base, |v| {
                    v["messages"][1]["content"] =
                        json!([{"type": "text", "text": "What is the weather in Paris?"}]);
                    v["messages"][3]["content"] = json!("Thanks.");
                }),
            ),
            (
                "developer message content",
                base.clone(),
                edit(&base, |v| {
                    v["messages"][0]["content"] =
                        json!([{"text": "You are terse.", "type": "text"}]);
                }),
            ),
            (
                "null top-level field is absent",
                edit(&base, |v| remove(v, "seed")),
                edit(&base, |v| v["seed"] = Value::Null),
            ),
            (
                "user and metadata are ignored",
                base.clone(),
                edit(&base, |v| {
                    remove(v, "user");
                    v["metadata"] = json!({"other": 1});
                }),
            ),
        ],
    );
}

#[test]
fn member_order_and_whitespace_do_not_matter() {
    let compact = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5}"#;
    let spaced = b" {\n  \"temperature\" : 0.50,\r\n\t\"messages\":[ { \"content\" :\"h\\u0069\", \"role\":\"user\" } ] ,\"model\":\"m\"} \n";
    for provider in [Provider::Anthropic, Provider::OpenAi] {
        assert_eq!(
            key_of(provider, compact, None, SECRET),
            key_of(provider, spaced, None, SECRET)
        );
    }
}

#[test]
fn anthropic_keyed_fields_change_the_key() {
    let base = anthropic();
    let cases = [
        (
            "model",
            edit(&base, |v| v["model"] = json!("claude-opus-4-1")),
        ),
        (
            "system",
            edit(&base, |v| v["system"] = json!("You are verbose.")),
        ),
        ("system removed", edit(&base, |v| remove(v, "system"))),
        (
            "message content",
            edit(&base, |v| {
                v["messages"][0]["content"] = json!("What is the weather in Lyon?")
            }),
        ),
        (
            "message role",
            edit(&base, |v| v["messages"][2]["role"] = json!("assistant")),
        ),
        (
            "message order",
            edit(&base, |v| {
                v["messages"].as_array_mut().unwrap().swap(0, 2);
            }),
        ),
        (
            "message removed",
            edit(&base, |v| {
                v["messages"].as_array_mut().unwrap().pop();
            }),
        ),
        (
            "tools",
            edit(&base, |v| {
                v["tools"][0]["input_schema"]["properties"]["unit"] = json!({"type": "string"})
            }),
        ),
        (
            "tool_choice",
            edit(&base, |v| v["tool_choice"] = json!({"type": "any"})),
        ),
        (
            "temperature",
            edit(&base, |v| v["temperature"] = json!(0.7)),
        ),
        (
            "temperature removed",
            edit(&base, |v| remove(v, "temperature")),
        ),
        ("top_p", edit(&base, |v| v["top_p"] = json!(0.95))),
        ("top_k", edit(&base, |v| v["top_k"] = json!(41))),
        ("max_tokens", edit(&base, |v| v["max_tokens"] = json!(1025))),
        (
            "stop_sequences",
            edit(&base, |v| {
                v["stop_sequences"] = json!(["\n\nHuman:", "STOP"])
            }),
        ),
        ("stream", edit(&base, |v| v["stream"] = json!(true))),
        // A default value is not normalised away.
        ("stream removed", edit(&base, |v| remove(v, "stream"))),
        (
            "service_tier",
            edit(&base, |v| v["service_tier"] = json!("standard_only")),
        ),
        (
            "unknown field",
            edit(&base, |v| v["new_sampling_knob"] = json!(0.3)),
        ),
        // A backend may refuse `1024.0` where it takes `1024`: never one key.
        (
            "max_tokens as a float",
            edit(&base, |v| v["max_tokens"] = json!(1024.0)),
        ),
        (
            "temperature 0.0 is not 0",
            edit(&base, |v| v["temperature"] = json!(0.0)),
        ),
        (
            "integral float inside tools",
            edit(&base, |v| {
                v["tools"][0]["input_schema"]["maxItems"] = json!(3.0)
            }),
        ),
        // Anthropic has no `user` field: the API refuses it, so it is keyed.
        ("user", edit(&base, |v| v["user"] = json!("u-42"))),
        (
            "nested null is not absent",
            edit(&base, |v| v["tool_choice"]["name"] = Value::Null),
        ),
        (
            "cache_control on a block",
            edit(&base, |v| {
                v["messages"][0]["content"] = json!([{
                    "type": "text",
                    "text": "What is the weather in Paris?",
                    "cache_control": {"type": "ephemeral"}
                }])
            }),
        ),
        (
            "case of a string",
            edit(&base, |v| v["messages"][2]["content"] = json!("thanks.")),
        ),
    ];
    assert_all_different(Provider::Anthropic, &base, &cases);
}

#[test]
fn openai_keyed_fields_change_the_key() {
    let base = openai();
    let cases = [
        ("model", edit(&base, |v| v["model"] = json!("gpt-4.1-mini"))),
        (
            "developer message",
            edit(&base, |v| {
                v["messages"][0]["content"] = json!("You are verbose.")
            }),
        ),
        (
            "message content",
            edit(&base, |v| {
                v["messages"][1]["content"] = json!("What is the weather in Lyon?")
            }),
        ),
        (
            "message role",
            edit(&base, |v| v["messages"][0]["role"] = json!("system")),
        ),
        (
            "message order",
            edit(&base, |v| {
                v["messages"].as_array_mut().unwrap().swap(1, 3);
            }),
        ),
        (
            "tools",
            edit(&base, |v| {
                v["tools"][0]["function"]["name"] = json!("get_forecast")
            }),
        ),
        (
            "tool_choice",
            edit(&base, |v| v["tool_choice"] = json!("none")),
        ),
        (
            "temperature",
            edit(&base, |v| v["temperature"] = json!(0.2)),
        ),
        ("top_p", edit(&base, |v| v["top_p"] = json!(1))),
        ("max_tokens", edit(&base, |v| v["max_tokens"] = json!(255))),
        ("stop", edit(&base, |v| v["stop"] = json!("END"))),
        (
            "response_format",
            edit(&base, |v| v["response_format"] = json!({"type": "text"})),
        ),
        ("seed", edit(&base, |v| v["seed"] = json!(8))),
        ("stream", edit(&base, |v| v["stream"] = json!(false))),
        (
            "stream_options",
            edit(&base, |v| {
                v["stream_options"] = json!({"include_usage": false})
            }),
        ),
        (
            "service_tier",
            edit(&base, |v| v["service_tier"] = json!("flex")),
        ),
        (
            "unknown field",
            edit(&base, |v| v["logit_bias"] = json!({"50256": -100})),
        ),
    ];
    assert_all_different(Provider::OpenAi, &base, &cases);
}

/// A body with `fields` spliced in after `model` and `messages`.
fn with_fields(fields: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{fields}}}"#).into_bytes()
}

#[test]
fn numbers_share_a_key_only_when_every_backend_reads_them_equal() {
    for provider in [Provider::Anthropic, Provider::OpenAi] {
        let k = |fields: &str| key_of(provider, &with_fields(fields), None, SECRET);
        // Issue 21 item 9: `16.0` hit the entry for `16`.
        assert_ne!(k(r#","max_tokens":16"#), k(r#","max_tokens":16.0"#));
        assert_ne!(k(r#","max_tokens":100"#), k(r#","max_tokens":1e2"#));
        assert_ne!(k(r#","temperature":0"#), k(r#","temperature":0.0"#));
        assert_ne!(k(r#","temperature":0.0"#), k(r#","temperature":-0.0"#));
        // Integers beyond 2^53 are compared exactly.
        assert_ne!(
            k(r#","seed":9007199254740993"#),
            k(r#","seed":9007199254740992"#)
        );
        assert_ne!(
            k(r#","seed":18446744073709551615"#),
            k(r#","seed":18446744073709551614"#)
        );
        // Spellings of one f64 are one float to every f64 reader.
        assert_eq!(k(r#","top_p":0.5"#), k(r#","top_p":0.50"#));
        assert_eq!(k(r#","top_p":0.5"#), k(r#","top_p":5e-1"#));
        assert_eq!(k(r#","max_tokens":16.0"#), k(r#","max_tokens":1.6e1"#));
        // Beyond 64 bits serde keeps no exact integer: not keyed at all.
        for fields in [
            r#","seed":18446744073709551616"#,
            r#","seed":-9223372036854775809"#,
            r#","n":[1e300]"#,
        ] {
            assert_eq!(
                CanonicalRequest::of(provider, &with_fields(fields), None, SECRET),
                Err(KeyError::NumberOutOfRange),
                "{fields}"
            );
        }
    }
}

#[test]
fn bodies_naming_a_member_twice_are_never_keyed() {
    use zerolayer_core::json::DuplicateMember;
    for (fields, name) in [
        (r#","stream":false,"stream":true"#, "stream"),
        (r#","stream":true,"str\u0065am":false"#, "stream"),
        (
            r#","stream_options":{"include_usage":true,"include_usage":false}"#,
            "include_usage",
        ),
        (r#","model":"other""#, "model"),
    ] {
        let body = with_fields(fields);
        for provider in [Provider::Anthropic, Provider::OpenAi] {
            let refused = CanonicalRequest::of(provider, &body, None, SECRET);
            assert_eq!(
                refused,
                Err(KeyError::Duplicate(DuplicateMember(name.into()))),
                "{fields}"
            );
            assert_eq!(
                refused.unwrap_err().to_string(),
                format!("request body names the member `{name}` twice in one object")
            );
        }
    }
}

#[test]
fn empty_string_content_is_not_an_empty_text_block() {
    let string = json!({"model": "m", "messages": [{"role": "user", "content": ""}]});
    let block = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]});
    assert_ne!(
        key(Provider::Anthropic, &string),
        key(Provider::Anthropic, &block)
    );
    assert_ne!(
        key(Provider::OpenAi, &string),
        key(Provider::OpenAi, &block)
    );
}

#[test]
fn provider_namespace_and_secret_are_keyed() {
    let body = serde_json::to_vec(&json!({"model": "m", "messages": []})).unwrap();
    let keys = [
        key_of(Provider::Anthropic, &body, Some("acme"), SECRET),
        key_of(Provider::OpenAi, &body, Some("acme"), SECRET),
        key_of(Provider::Anthropic, &body, Some("globex"), SECRET),
        key_of(Provider::Anthropic, &body, Some(""), SECRET),
        key_of(Provider::Anthropic, &body, None, SECRET),
        key_of(Provider::Anthropic, &body, Some("s"), SECRET),
        key_of(Provider::Anthropic, &body, Some("acme"), b"another secret"),
        key_of(Provider::Anthropic, &body, Some("acme"), b""),
    ];
    for (i, a) in keys.iter().enumerate() {
        for (j, b) in keys.iter().enumerate() {
            assert_eq!(a == b, i == j, "keys {i} and {j}");
        }
    }
}

#[test]
fn digest_layout() {
    let body = br#"{ "temperature": 0.0, "model": "m", "metadata": {"user_id": "u"},
        "messages": [ {"content": "hi", "role": "user"} ], "top_p": null }"#;
    let canonical = br#"{"messages":[{"content":[{"text":"hi","type":"text"}],"role":"user"}],"model":"m","temperature":0.0}"#;
    assert_eq!(
        String::from_utf8(canonical_json(Provider::Anthropic, body).unwrap()).unwrap(),
        String::from_utf8(canonical.to_vec()).unwrap()
    );
    let digest = |namespace: &[&[u8]]| {
        let mut mac = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
        mac.update(b"zerolayer-cache-v2\0");
        mac.update(&9u64.to_be_bytes());
        mac.update(b"anthropic");
        for part in namespace {
            mac.update(part);
        }
        mac.update(canonical);
        <[u8; 32]>::from(mac.finalize().into_bytes())
    };
    let tenant = CanonicalRequest::of(Provider::Anthropic, body, Some("acme"), SECRET).unwrap();
    assert_eq!(tenant.key.0, digest(&[b"t", &4u64.to_be_bytes(), b"acme"]));
    let shared = CanonicalRequest::of(Provider::Anthropic, body, None, SECRET).unwrap();
    assert_eq!(shared.key.0, digest(&[b"s"]));
    // The digest is a fixed point of serde_json's own compact writer.
    let reparsed: Value = serde_json::from_slice(canonical).unwrap();
    assert_eq!(serde_json::to_vec(&reparsed).unwrap(), canonical.to_vec());
}

#[test]
fn fields_read_from_the_request() {
    let of =
        |body: &str| CanonicalRequest::of(Provider::OpenAi, body.as_bytes(), None, SECRET).unwrap();
    let plain = of(r#"{"model":"m","messages":[]}"#);
    assert_eq!((plain.stream, plain.temperature), (false, None));
    assert_eq!(plain.provider, Provider::OpenAi);
    let streamed = of(r#"{"model":"m","messages":[],"stream":true,"temperature":0}"#);
    assert_eq!((streamed.stream, streamed.temperature), (true, Some(0.0)));
    let nulls = of(r#"{"model":"m","messages":[],"stream":null,"temperature":null}"#);
    assert_eq!((nulls.stream, nulls.temperature), (false, None));
    assert_eq!(nulls.key, plain.key);
    assert_eq!(
        of(r#"{"model":"m","messages":[],"temperature":0.7}"#).temperature,
        Some(0.7)
    );
}

#[test]
fn errors() {
    let cases: &[(&[u8], KeyError, &str)] = &[
        (
            b"",
            KeyError::NotJson("EOF while parsing a value at line 1 column 0".into()),
            "request body is not valid JSON: EOF while parsing a value at line 1 column 0",
        ),
        (
            br#"{"model":"sk-secret-123", oops}"#,
            KeyError::NotJson("key must be a string at line 1 column 27".into()),
            "request body is not valid JSON: key must be a string at line 1 column 27",
        ),
        (
            br#"{"model":"m","messages":[]} x"#,
            KeyError::NotJson("trailing characters at line 1 column 29".into()),
            "request body is not valid JSON: trailing characters at line 1 column 29",
        ),
        (
            b"[1, 2]",
            KeyError::NotAnObject,
            "request body is not a JSON object",
        ),
        (
            br#""hello""#,
            KeyError::NotAnObject,
            "request body is not a JSON object",
        ),
        (
            br#"{"messages":[]}"#,
            KeyError::Missing("model"),
            "request body has no `model` field",
        ),
        (
            br#"{"model":null,"messages":[]}"#,
            KeyError::Missing("model"),
            "request body has no `model` field",
        ),
        (
            br#"{"model":"m"}"#,
            KeyError::Missing("messages"),
            "request body has no `messages` field",
        ),
        (
            br#"{"model":7,"messages":[]}"#,
            KeyError::WrongType {
                field: "model",
                expected: "a string",
            },
            "request body field `model` is not a string",
        ),
        (
            br#"{"model":"m","messages":{"role":"user"}}"#,
            KeyError::WrongType {
                field: "messages",
                expected: "an array",
            },
            "request body field `messages` is not an array",
        ),
        (
            br#"{"model":"m","messages":[],"stream":"yes"}"#,
            KeyError::WrongType {
                field: "stream",
                expected: "a boolean",
            },
            "request body field `stream` is not a boolean",
        ),
        (
            br#"{"model":"m","messages":[],"temperature":"0"}"#,
            KeyError::WrongType {
                field: "temperature",
                expected: "a number",
            },
            "request body field `temperature` is not a number",
        ),
    ];
    for (body, error, message) in cases {
        for provider in [Provider::Anthropic, Provider::OpenAi] {
            let err = CanonicalRequest::of(provider, body, None, SECRET).unwrap_err();
            assert_eq!(&err, error, "{}", String::from_utf8_lossy(body));
            assert_eq!(err.to_string(), *message);
            assert_eq!(canonical_json(provider, body).unwrap_err(), err);
        }
    }
}

#[test]
fn provider_for_path() {
    let cases = [
        ("/v1/messages", Some(Provider::Anthropic)),
        ("/v1/messages?beta=true", Some(Provider::Anthropic)),
        ("/v1/chat/completions", Some(Provider::OpenAi)),
        ("/v1/chat/completions?", Some(Provider::OpenAi)),
        ("/v1/messages/count_tokens", None),
        ("/v1/messages/", None),
        ("/v2/messages", None),
        ("/v1/completions", None),
        ("?/v1/messages", None),
        ("", None),
        // Issue 21 item 8: the backend serves these as the API.
        ("//v1/messages", Some(Provider::Anthropic)),
        ("/v1//chat//completions", Some(Provider::OpenAi)),
        ("/x/../v1/messages", Some(Provider::Anthropic)),
        ("/v1/./%6Dessages", Some(Provider::Anthropic)),
        ("/v1%2Fmessages", None),
    ];
    for (path, provider) in cases {
        assert_eq!(Provider::for_path(path), provider, "{path}");
    }
    assert_eq!(Provider::Anthropic.name(), "anthropic");
    assert_eq!(Provider::OpenAi.name(), "openai");
}

#[test]
fn matching_a_stored_digest() {
    let body = br#"{"model":"m","messages":[]}"#;
    let key = key_of(Provider::Anthropic, body, None, SECRET);
    assert!(key.matches(&key.0));
    for bit in [0, 7, 100, 255] {
        let mut flipped = key.0;
        flipped[bit / 8] ^= 1 << (bit % 8);
        assert!(!key.matches(&flipped), "bit {bit}");
    }
    assert!(!key.matches(&key.0[..31]));
    assert!(!key.matches(&[key.0.as_slice(), &[0]].concat()));
    assert!(!key.matches(&[]));
    assert_eq!(key.short_hex().len(), 16);
    assert_eq!(
        format!("{key:?}"),
        format!("CacheKey({}…)", key.short_hex())
    );
}

// ---------------------------------------------------------------------------
// Properties on random requests.

/// splitmix64: the choices made while re-writing a request, from one seed.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn whitespace(choices: &mut Choices, out: &mut String) {
    for _ in 0..choices.below(3) {
        out.push([' ', '\n', '\t', '\r'][choices.below(4)]);
    }
}

/// Writes `value` as JSON text with members shuffled, random whitespace
/// between tokens, some characters written as `\u` escapes and integral
/// floats sometimes spelled another way.
fn scramble(value: &Value, choices: &mut Choices, out: &mut String) {
    whitespace(choices, out);
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, choices.below(i + 1));
            }
            out.push('{');
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                whitespace(choices, out);
                scramble_str(name, choices, out);
                whitespace(choices, out);
                out.push(':');
                scramble(member, choices, out);
            }
            whitespace(choices, out);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                scramble(item, choices, out);
            }
            whitespace(choices, out);
            out.push(']');
        }
        Value::String(s) => scramble_str(s, choices, out),
        // Another spelling of the same float (integers have only one).
        Value::Number(n) if n.is_f64() && !n.to_string().contains('e') && choices.coin() => {
            out.push_str(&format!("{n}{}", ["0", "000", "e0"][choices.below(3)]));
        }
        other => out.push_str(&other.to_string()),
    }
    whitespace(choices, out);
}

fn scramble_str(s: &str, choices: &mut Choices, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if choices.coin() => out.push_str("\\/"),
            c if (c as u32) < 0x20 || (c as u32) < 0x10000 && choices.below(4) == 0 => {
                out.push_str(&format!("\\u{:04X}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Writes a message's content, or Anthropic's system, in its other
/// equivalent form (string ↔ single text block) when it has one.
fn flip_content(content: &mut Value) {
    match content {
        Value::String(text) if !text.is_empty() => {
            *content = json!([{"type": "text", "text": text}]);
        }
        Value::Array(blocks) if blocks.len() == 1 => {
            if let Some(Value::String(text)) = blocks[0].get("text")
                && blocks[0].as_object().is_some_and(|b| b.len() == 2)
                && blocks[0]["type"] == "text"
                && !text.is_empty()
            {
                *content = Value::String(text.clone());
            }
        }
        _ => {}
    }
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 ./\"\\\\\n\t\u{7}é日🦀]{1,12}"
}

fn small_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-1000i64..1000).prop_map(Value::from),
        // Multiples of 1/8: exact in binary, some integral.
        (-64i32..64).prop_map(|n| Value::from(f64::from(n) / 8.0)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(Value::String),
        prop::collection::vec(text(), 1..3).prop_map(|texts| {
            Value::Array(
                texts
                    .into_iter()
                    .map(|t| json!({"type": "text", "text": t}))
                    .collect(),
            )
        }),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    (prop_oneof![Just("user"), Just("assistant")], content())
        .prop_map(|(role, content)| json!({"role": role, "content": content}))
}

fn provider() -> impl Strategy<Value = Provider> {
    prop_oneof![Just(Provider::Anthropic), Just(Provider::OpenAi)]
}

fn stop_field(provider: Provider) -> &'static str {
    match provider {
        Provider::Anthropic => "stop_sequences",
        Provider::OpenAi => "stop",
    }
}

fn request() -> impl Strategy<Value = (Provider, Value)> {
    (
        provider(),
        "[a-z0-9.-]{1,10}",
        prop::collection::vec(message(), 1..=4),
        prop::option::of((0u8..=20).prop_map(|t| f64::from(t) / 10.0)),
        prop::option::of((1u8..=10).prop_map(|p| f64::from(p) / 10.0)),
        prop::option::of(1u32..4096),
        prop::option::of(prop::collection::vec(text(), 0..3)),
        prop::option::of(small_json()),
        prop::option::of(text()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(
            |(
                provider,
                model,
                messages,
                temperature,
                top_p,
                max_tokens,
                stop,
                tools,
                system,
                stream,
            )| {
                let mut request = json!({"model": model, "messages": messages});
                let fields = [
                    ("temperature", temperature.map(Value::from)),
                    ("top_p", top_p.map(Value::from)),
                    ("max_tokens", max_tokens.map(Value::from)),
                    (stop_field(provider), stop.map(Value::from)),
                    (
                        "tools",
                        tools.map(|schema| json!([{"name": "tool", "schema": schema}])),
                    ),
                    ("stream", stream.map(Value::from)),
                ];
                for (name, value) in fields {
                    if let Some(value) = value {
                        request[name] = value;
                    }
                }
                if let Some(system) = system {
                    match provider {
                        Provider::Anthropic => request["system"] = Value::String(system),
                        Provider::OpenAi => request["messages"]
                            .as_array_mut()
                            .unwrap()
                            .insert(0, json!({"role": "system", "content": system})),
                    }
                }
                (provider, request)
            },
        )
}

/// Changes one keyed aspect of `request` (which of 14, by `which`), so that
/// its key must change.
fn mutate(provider: Provider, request: &mut Value, which: usize, pick: usize) {
    let fields = request.as_object_mut().unwrap();
    let messages = fields["messages"].as_array_mut().unwrap();
    let m = pick % messages.len();
    match which {
        0 => fields["model"] = json!(format!("{}x", fields["model"].as_str().unwrap())),
        1 => {
            let role = &mut messages[m]["role"];
            *role = json!(if role == "user" { "assistant" } else { "user" });
        }
        2 => match &mut messages[m]["content"] {
            Value::String(text) => text.push('!'),
            Value::Array(blocks) => {
                let text = blocks[0]["text"].as_str().unwrap().to_string();
                blocks[0]["text"] = json!(format!("{text}!"));
            }
            _ => unreachable!(),
        },
        3 => messages.push(json!({"role": "user", "content": "and then?"})),
        4 => {
            if messages.len() > 1 {
                messages.remove(m);
            } else {
                messages.clear();
            }
        }
        5 => {
            let t = fields
                .get("temperature")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            fields.insert("temperature".into(), json!(t + 0.5));
        }
        6 => {
            let p = fields.get("top_p").and_then(Value::as_f64).unwrap_or(0.0);
            fields.insert("top_p".into(), json!(p + 0.25));
        }
        7 => {
            let n = fields
                .get("max_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            fields.insert("max_tokens".into(), json!(n + 1));
        }
        8 => match fields.get_mut(stop_field(provider)) {
            Some(Value::Array(stop)) => stop.push(json!("zz")),
            _ => {
                fields.insert(stop_field(provider).into(), json!(["zz"]));
            }
        },
        9 => match fields.get_mut("tools") {
            Some(Value::Array(tools)) => tools.push(json!({"name": "other"})),
            _ => {
                fields.insert("tools".into(), json!([{"name": "other"}]));
            }
        },
        10 => {
            let stream = fields.get("stream").and_then(Value::as_bool);
            fields.insert("stream".into(), json!(stream != Some(true)));
        }
        11 => {
            let present = ["temperature", "top_p", "max_tokens", "tools", "stream"]
                .into_iter()
                .filter(|f| fields.contains_key(*f))
                .collect::<Vec<_>>();
            if present.is_empty() {
                fields.insert("presence_penalty".into(), json!(0.5));
            } else {
                fields.remove(present[pick % present.len()]);
            }
        }
        12 => {
            fields.insert("new_sampling_knob".into(), json!(pick % 3));
        }
        _ => match provider {
            Provider::Anthropic => {
                let system = fields.get("system").and_then(Value::as_str).unwrap_or("");
                fields.insert("system".into(), json!(format!("{system}?")));
            }
            Provider::OpenAi => {
                messages.insert(0, json!({"role": "developer", "content": "be brief"}));
            }
        },
    }
}

proptest! {
    #[test]
    fn rewriting_a_request_keeps_its_key(
        (provider, request) in request(),
        seed in any::<u64>(),
    ) {
        let plain = serde_json::to_vec(&request).unwrap();
        let mut choices = Choices(seed);
        let mut equivalent = request.clone();
        for message in equivalent["messages"].as_array_mut().unwrap() {
            if choices.coin() {
                flip_content(&mut message["content"]);
            }
        }
        if provider == Provider::Anthropic
            && let Some(system) = equivalent.get_mut("system")
        {
            flip_content(system);
        }
        if choices.coin() {
            equivalent["metadata"] = json!({"user_id": seed.to_string()});
        }
        if choices.coin() {
            equivalent["seed"] = Value::Null;
        }
        let mut text = String::new();
        scramble(&equivalent, &mut choices, &mut text);

        let canonical = canonical_json(provider, &plain).unwrap();
        prop_assert_eq!(
            String::from_utf8(canonical_json(provider, text.as_bytes()).unwrap()).unwrap(),
            String::from_utf8(canonical.clone()).unwrap(),
            "rewritten as {}", text
        );
        prop_assert_eq!(
            key_of(provider, &plain, Some("t"), SECRET),
            key_of(provider, text.as_bytes(), Some("t"), SECRET)
        );
        // The canonical form is what serde_json itself writes for it.
        let reparsed: Value = serde_json::from_slice(&canonical).unwrap();
        prop_assert_eq!(serde_json::to_vec(&reparsed).unwrap(), canonical);
    }

    #[test]
    fn changing_a_keyed_field_changes_the_key(
        (provider, request) in request(),
        which in 0usize..14,
        pick in any::<usize>(),
    ) {
        let mut changed = request.clone();
        mutate(provider, &mut changed, which, pick);
        prop_assert_ne!(
            key(provider, &request),
            key(provider, &changed),
            "{} did not change the key", serde_json::to_string(&changed).unwrap()
        );
    }
}
