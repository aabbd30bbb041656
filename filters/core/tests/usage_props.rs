//! Properties of the usage code over chunking and hostile input: a body
//! split anywhere (every single split of every fixture, then random
//! multi-splits) gives the same extraction, the same stripped stream and the
//! same scanned values; the JSON scanner agrees with serde_json on random
//! objects; the stripper removes exactly the usage-only events of random
//! streams; and no input makes any of them panic.

mod usage_support;

use std::ops::Range;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Map, Value, json};
use usage_support::{extract, strip};
use zerolayer_core::cache::key::Provider;
use zerolayer_core::usage::{
    Injection, Missing, ResponseFormat, TopLevelScanner, Wanted, inject_include_usage,
};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/usage")
}

/// Every fixture: name, provider, framing, bytes.
fn fixtures() -> Vec<(String, Provider, ResponseFormat, Vec<u8>)> {
    let mut all: Vec<_> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_string();
            let provider = if name.starts_with("anthropic") {
                Provider::Anthropic
            } else {
                Provider::OpenAi
            };
            let format = if name.ends_with(".sse") {
                ResponseFormat::EventStream
            } else {
                ResponseFormat::Json
            };
            (name, provider, format, std::fs::read(&path).unwrap())
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(all.len() >= 10, "fixtures missing");
    all
}

/// `body` cut at `points` (taken modulo its length, in order).
fn split<'a>(body: &'a [u8], points: &[Index]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = points.iter().map(|p| p.index(body.len() + 1)).collect();
    cuts.sort_unstable();
    let mut chunks = Vec::new();
    let mut from = 0;
    for cut in cuts {
        chunks.push(&body[from..cut]);
        from = cut;
    }
    chunks.push(&body[from..]);
    chunks
}

const WANTED: &[Wanted] = &[
    Wanted {
        key: b"usage",
        limit: 1 << 20,
    },
    Wanted {
        key: b"model",
        limit: 1 << 20,
    },
    Wanted {
        key: b"tiny",
        limit: 3,
    },
];

type Scanned = Vec<(usize, Option<Vec<u8>>, Range<usize>)>;

fn scan(chunks: &[&[u8]]) -> (Scanned, Option<usize>) {
    let mut scanner = TopLevelScanner::new(WANTED);
    let mut out = Vec::new();
    for chunk in chunks {
        scanner.push(chunk, |v| {
            out.push((v.index, v.raw.map(<[u8]>::to_vec), v.span))
        });
    }
    (out, scanner.root_end())
}

/// The same stream with every line ending (CRLF, LF or CR) replaced by `eol`.
fn with_line_endings(body: &[u8], eol: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + body.len() / 8);
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'\r' if body.get(i + 1) == Some(&b'\n') => {
                out.extend_from_slice(eol);
                i += 2;
                continue;
            }
            b'\r' | b'\n' => out.extend_from_slice(eol),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

#[test]
fn every_single_split_of_every_fixture_gives_the_same_result() {
    for (name, provider, format, body) in fixtures() {
        let whole = extract(provider, format, &[&body]);
        assert_ne!(whole.usage, Err(Missing::Malformed), "{name}");
        let stripped = strip(&[&body]);
        let scanned = scan(&[&body]);
        for i in 0..=body.len() {
            let (a, b) = body.split_at(i);
            assert_eq!(
                extract(provider, format, &[a, b]),
                whole,
                "{name} split at {i}"
            );
            assert_eq!(strip(&[a, b]), stripped, "{name} stripped, split at {i}");
            assert_eq!(scan(&[a, b]), scanned, "{name} scanned, split at {i}");
        }
    }
}

#[test]
fn byte_at_a_time_gives_the_same_result() {
    for (name, provider, format, body) in fixtures() {
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(
            extract(provider, format, &bytes),
            extract(provider, format, &[&body]),
            "{name}"
        );
        assert_eq!(strip(&bytes), strip(&[&body]), "{name}");
        assert_eq!(scan(&bytes), scan(&[&body]), "{name}");
    }
}

#[test]
fn every_line_ending_gives_the_same_usage() {
    for (name, provider, format, body) in fixtures() {
        if format != ResponseFormat::EventStream {
            continue;
        }
        let whole = extract(provider, format, &[&body]);
        for eol in [&b"\n"[..], b"\r\n", b"\r"] {
            let converted = with_line_endings(&body, eol);
            assert_eq!(
                extract(provider, format, &[&converted]),
                whole,
                "{name} {eol:?}"
            );
            let (out, removed) = strip(&[&converted]);
            let (lf_out, lf_removed) = strip(&[&with_line_endings(&body, b"\n")]);
            assert_eq!(removed, lf_removed, "{name} {eol:?}");
            assert_eq!(with_line_endings(&out, b"\n"), lf_out, "{name} {eol:?}");
        }
    }
}

/// A byte string rich in the characters the parsers care about.
fn hostile_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    let interesting = prop::sample::select(
        b"{}[]\":,\\ \r\nnull0123456789datausagemodelchoicesevent[DONE]".to_vec(),
    );
    prop::collection::vec(prop_oneof![3 => interesting, 1 => any::<u8>()], 0..max)
}

fn json_string() -> impl Strategy<Value = String> {
    "[ -~\t\n\u{e9}\u{2028}\u{1F600}]{0,12}"
}

fn json_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("usage".to_string()),
        Just("model".to_string()),
        Just("tiny".to_string()),
        Just("us\"age".to_string()),
        Just("usage ".to_string()),
        json_string(),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        // Exactly representable, so they read back equal without float_roundtrip.
        (-1_000_000i32..1_000_000).prop_map(|n| json!(f64::from(n) / 64.0)),
        json_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(json_key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn json_object() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::btree_map(json_key(), json_value(), 0..8)
        .prop_map(|m| m.into_iter().collect())
}

/// An OpenAI-like event stream as (bytes, bytes the stripper must forward),
/// with the usage of its last usage chunk.
fn openai_stream() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, Option<(u64, u64)>)> {
    let piece = prop_oneof![
        4 => json_string().prop_map(|text| (0u8, text, 0u64, 0u64)),
        1 => (any::<u32>(), any::<u32>()).prop_map(|(p, c)| (1, String::new(), p as u64, c as u64)),
        1 => (any::<u32>(), any::<u32>()).prop_map(|(p, c)| (2, String::new(), p as u64, c as u64)),
        1 => (any::<u32>(), any::<u32>()).prop_map(|(p, c)| (3, String::new(), p as u64, c as u64)),
        1 => Just((4, String::new(), 0, 0)),
        1 => Just((5, String::new(), 0, 0)),
        1 => Just((6, String::new(), 0, 0)),
    ];
    let eol = prop::sample::select(vec!["\n", "\r\n", "\r"]);
    (prop::collection::vec(piece, 0..12), eol).prop_map(|(pieces, eol)| {
        let (mut all, mut kept, mut last) = (String::new(), String::new(), None);
        for (kind, text, p, c) in pieces {
            let usage = format!(r#""usage":{{"prompt_tokens":{p},"completion_tokens":{c}}}"#);
            let (event, keep): (String, String) = match kind {
                0 => {
                    let content = serde_json::to_string(&text).unwrap();
                    let event = format!(
                        r#"data: {{"id":"c","choices":[{{"index":0,"delta":{{"content":{content}}}}}],"usage":null}}{eol}{eol}"#
                    );
                    (event.clone(), event)
                }
                1 => (format!(r#"data: {{"id":"c","choices":[],{usage}}}{eol}{eol}"#), String::new()),
                2 => (
                    format!(": ka{eol}event: message{eol}data: {{\"choices\":[],{eol}data: {usage}}}{eol}{eol}"),
                    format!(": ka{eol}"),
                ),
                // Usage alongside a choice: a report the client keeps.
                3 => {
                    let event = format!(r#"data: {{"choices":[{{"index":0}}],{usage}}}{eol}{eol}"#);
                    (event.clone(), event)
                }
                4 => (format!(": ping{eol}{eol}"), format!(": ping{eol}{eol}")),
                5 => (eol.to_string(), eol.to_string()),
                _ => (format!("data: [DONE]{eol}{eol}"), format!("data: [DONE]{eol}{eol}")),
            };
            if (1..=3).contains(&kind) {
                last = Some((p, c));
            }
            all.push_str(&event);
            kept.push_str(&keep);
        }
        (all.into_bytes(), kept.into_bytes(), last)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_splits_of_fixtures_give_the_same_result(
        which in any::<Index>(),
        points in prop::collection::vec(any::<Index>(), 0..12),
        eol in prop::sample::select(vec![&b"\n"[..], b"\r\n", b"\r"]),
    ) {
        let all = fixtures();
        let (name, provider, format, body) = which.get(&all);
        let body = if *format == ResponseFormat::EventStream {
            with_line_endings(body, eol)
        } else {
            body.clone()
        };
        let chunks = split(&body, &points);
        prop_assert_eq!(
            extract(*provider, *format, &chunks),
            extract(*provider, *format, &[&body]),
            "{}", name
        );
        prop_assert_eq!(strip(&chunks), strip(&[&body]), "{}", name);
        prop_assert_eq!(scan(&chunks), scan(&[&body]), "{}", name);
    }

    #[test]
    fn the_scanner_agrees_with_serde_json(
        object in json_object(),
        pretty in any::<bool>(),
        points in prop::collection::vec(any::<Index>(), 0..6),
    ) {
        let body = if pretty {
            serde_json::to_vec_pretty(&object).unwrap()
        } else {
            serde_json::to_vec(&object).unwrap()
        };
        let chunks = split(&body, &points);
        let (values, root_end) = scan(&chunks);
        prop_assert_eq!(root_end, Some(body.len() - 1));
        let mut expected = Vec::new();
        for (index, wanted) in WANTED.iter().enumerate() {
            let key = std::str::from_utf8(wanted.key).unwrap();
            if let Some(value) = object.get(key) {
                expected.push((index, value.clone()));
            }
        }
        prop_assert_eq!(values.len(), expected.len());
        for (index, raw, span) in values {
            let value = &expected.iter().find(|(i, _)| *i == index).unwrap().1;
            let text = &body[span.clone()];
            prop_assert_eq!(&serde_json::from_slice::<Value>(text).unwrap(), value);
            match raw {
                Some(raw) => prop_assert_eq!(&raw[..], text),
                None => prop_assert!(text.len() > WANTED[index].limit),
            }
        }
        // Any other root is not an object: nothing found.
        for root in [Value::Array(vec![Value::Object(object.clone())]), json!("usage")] {
            let body = serde_json::to_vec(&root).unwrap();
            prop_assert_eq!(scan(&split(&body, &points)), (Vec::new(), None));
        }
    }

    #[test]
    fn the_scanner_reads_escaped_keys_as_serde_json_does(
        object in json_object(),
        escapes in prop::collection::vec(0u8..4, 64),
        points in prop::collection::vec(any::<Index>(), 0..6),
    ) {
        // Every key written with some of its characters escaped (`\uXXXX`
        // lower or upper case, or their short form); values as serde writes them.
        let mut body = b"{".to_vec();
        let mut n = 0;
        for (i, (key, value)) in object.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.push(b'"');
            for c in key.chars() {
                let how = escapes[n % escapes.len()];
                n += 1;
                let mut units = [0u16; 2];
                match (how, c) {
                    (1, _) => {
                        for unit in c.encode_utf16(&mut units) {
                            body.extend_from_slice(format!("\\u{unit:04x}").as_bytes());
                        }
                    }
                    (2, _) => {
                        for unit in c.encode_utf16(&mut units) {
                            body.extend_from_slice(format!("\\u{unit:04X}").as_bytes());
                        }
                    }
                    (3, '"' | '\\' | '/') => body.extend_from_slice(format!("\\{c}").as_bytes()),
                    (3, '\n') => body.extend_from_slice(b"\\n"),
                    (3, '\t') => body.extend_from_slice(b"\\t"),
                    _ => {
                        let quoted = serde_json::to_string(&c.to_string()).unwrap();
                        body.extend_from_slice(&quoted.as_bytes()[1..quoted.len() - 1]);
                    }
                }
            }
            body.extend_from_slice(b"\":");
            body.extend_from_slice(&serde_json::to_vec(value).unwrap());
        }
        body.push(b'}');
        prop_assert_eq!(&serde_json::from_slice::<Map<String, Value>>(&body).unwrap(), &object);
        let (values, root_end) = scan(&split(&body, &points));
        prop_assert_eq!(root_end, Some(body.len() - 1));
        let found: Vec<usize> = values.iter().map(|v| v.0).collect();
        let expected: Vec<usize> = (0..WANTED.len())
            .filter(|&i| object.contains_key(std::str::from_utf8(WANTED[i].key).unwrap()))
            .collect();
        let mut sorted = found.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, expected);
        for (index, _, span) in values {
            let key = std::str::from_utf8(WANTED[index].key).unwrap();
            prop_assert_eq!(&serde_json::from_slice::<Value>(&body[span]).unwrap(), &object[key]);
        }
    }

    #[test]
    fn usage_in_a_random_json_body_is_found(
        mut object in json_object(),
        input in any::<u32>(),
        output in any::<u32>(),
        cached in any::<u32>(),
        points in prop::collection::vec(any::<Index>(), 0..6),
    ) {
        object.insert("usage".into(), json!({
            "prompt_tokens": input,
            "completion_tokens": output,
            "prompt_tokens_details": {"cached_tokens": cached},
        }));
        object.insert("model".into(), json!("gpt-{}"));
        let body = serde_json::to_vec(&object).unwrap();
        let got = extract(Provider::OpenAi, ResponseFormat::Json, &split(&body, &points));
        prop_assert_eq!(got.model.as_deref(), Some("gpt-{}"));
        let usage = got.usage.unwrap();
        prop_assert_eq!(
            (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens),
            (input as u64, output as u64, cached as u64)
        );
    }

    #[test]
    fn the_stripper_removes_exactly_the_usage_only_events(
        (stream, kept, last) in openai_stream(),
        points in prop::collection::vec(any::<Index>(), 0..10),
    ) {
        let chunks = split(&stream, &points);
        let (out, _) = strip(&chunks);
        prop_assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&kept));
        // The extractor, fed the original bytes, still finds the usage.
        let got = extract(Provider::OpenAi, ResponseFormat::EventStream, &chunks);
        match last {
            Some((p, c)) => {
                let usage = got.usage.unwrap();
                prop_assert_eq!((usage.input_tokens, usage.output_tokens), (p, c));
            }
            None => prop_assert_eq!(got.usage, Err(Missing::NotReported)),
        }
    }

    #[test]
    fn hostile_bytes_never_panic_and_split_the_same(
        body in hostile_bytes(600),
        points in prop::collection::vec(any::<Index>(), 0..8),
    ) {
        let chunks = split(&body, &points);
        for provider in [Provider::Anthropic, Provider::OpenAi] {
            for format in [ResponseFormat::EventStream, ResponseFormat::Json] {
                prop_assert_eq!(
                    extract(provider, format, &chunks),
                    extract(provider, format, &[&body])
                );
            }
            let _ = inject_include_usage(provider, &body);
        }
        let (out, removed) = strip(&chunks);
        prop_assert_eq!(&(out.clone(), removed), &strip(&[&body]));
        if removed == 0 {
            prop_assert_eq!(out, body.clone());
        }
        prop_assert_eq!(scan(&chunks), scan(&[&body]));
    }

    #[test]
    fn truncated_fixtures_never_panic(which in any::<Index>(), cut in any::<Index>()) {
        let all = fixtures();
        let (_, provider, format, body) = which.get(&all);
        let body = &body[..cut.index(body.len() + 1)];
        let _ = extract(*provider, *format, &[body]);
        let _ = strip(&[body]);
        let _ = scan(&[body]);
    }

    #[test]
    fn injection_agrees_with_a_reference(
        mut object in json_object(),
        stream in prop_oneof![Just(None), Just(Some(json!(true))), Just(Some(json!(false)))],
        options in prop_oneof![
            Just(None),
            Just(Some(Value::Null)),
            Just(Some(json!({}))),
            Just(Some(json!({"include_usage": true}))),
            Just(Some(json!({"include_usage": false, "other": [1, "}"]}))),
            Just(Some(json!([]))),
        ],
        pretty in any::<bool>(),
    ) {
        object.remove("stream");
        object.remove("stream_options");
        if let Some(stream) = stream.clone() {
            object.insert("stream".into(), stream);
        }
        if let Some(options) = options.clone() {
            object.insert("stream_options".into(), options);
        }
        let body = if pretty {
            serde_json::to_vec_pretty(&object).unwrap()
        } else {
            serde_json::to_vec(&object).unwrap()
        };
        let got = inject_include_usage(Provider::OpenAi, &body);
        let asked = options.as_ref().and_then(|o| o.get("include_usage")) == Some(&json!(true));
        match got {
            Injection::Rewritten(bytes) => {
                prop_assert_eq!(&stream, &Some(json!(true)));
                prop_assert!(!asked);
                let value: Value = serde_json::from_slice(&bytes).unwrap();
                let mut expected = object.clone();
                let mut new_options = match options {
                    Some(Value::Object(map)) => map,
                    _ => Map::new(),
                };
                new_options.insert("include_usage".into(), json!(true));
                expected.insert("stream_options".into(), Value::Object(new_options));
                prop_assert_eq!(value, Value::Object(expected));
            }
            Injection::ClientAsked => prop_assert!(asked && stream == Some(json!(true))),
            Injection::NotApplicable => prop_assert!(stream != Some(json!(true))),
            // A streamed request that would go without usage is refused.
            Injection::Refused(_) => prop_assert!(
                stream == Some(json!(true)) && options == Some(json!([]))
            ),
        }
    }
}
