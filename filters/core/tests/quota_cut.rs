//! `stream: hard` responses through `StreamCut`: the output counted per
//! event (text bytes, or the provider's own counts), the cut right after
//! the event whose draw was not covered whatever the chunking, and the end
//! in each provider's format, well formed.

use proptest::prelude::*;
use serde_json::Value;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::quota::StreamCut;
use zerolayer_core::quota::cut::{encode_billed, parse_billed};
use zerolayer_core::sse::SseParser;
use zerolayer_core::usage::Usage;

fn openai_chunk(content: &str, usage_null: bool) -> String {
    let usage = if usage_null { r#","usage":null"# } else { "" };
    format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"gpt-test\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}]{usage}}}\n\n",
        serde_json::to_string(content).unwrap()
    )
}

/// An OpenAI stream of `words`, finished, with the usage chunk if asked.
fn openai_stream(words: &[&str], include_usage: bool) -> Vec<u8> {
    let mut s = String::new();
    s.push_str(&format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"gpt-test\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]{}}}\n\n",
        if include_usage { r#","usage":null"# } else { "" }
    ));
    for w in words {
        s.push_str(&openai_chunk(w, include_usage));
    }
    s.push_str(&format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"gpt-test\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]{}}}\n\n",
        if include_usage { r#","usage":null"# } else { "" }
    ));
    if include_usage {
        s.push_str("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"gpt-test\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":5,\"total_tokens\":14}}\n\n");
    }
    s.push_str("data: [DONE]\n\n");
    s.into_bytes()
}

fn anthropic_stream(words: &[&str]) -> Vec<u8> {
    let mut s = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-test\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":4,\"cache_read_input_tokens\":2,\"output_tokens\":1}}}\n\n\
         event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
         event: ping\ndata: {\"type\":\"ping\"}\n\n",
    );
    for w in words {
        s.push_str(&format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":{}}}}}\n\n",
            serde_json::to_string(w).unwrap()
        ));
    }
    s.push_str(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
         event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":5}}\n\n\
         event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    s.into_bytes()
}

const WORDS: &[&str] = &["Hello", " wörld", ",", " how", " are", " you", "?"];

/// Runs `stream` in `chunks` through a cut whose lease covers `covered`
/// output; returns what the client got, the draws seen and the cut.
fn run(
    provider: Provider,
    asked_usage: bool,
    chunks: &[&[u8]],
    covered: u64,
) -> (Vec<u8>, Vec<u64>, StreamCut) {
    let mut cut = StreamCut::new(provider, asked_usage);
    let mut client = Vec::new();
    let mut draws = Vec::new();
    let mut ended = false;
    for chunk in chunks {
        let at = cut.push(chunk, |output| {
            draws.push(output);
            output > covered
        });
        match at {
            None => client.extend_from_slice(chunk),
            Some(at) if !ended => {
                client.extend_from_slice(&chunk[..at]);
                cut.end(100, &mut client);
                ended = true;
            }
            Some(_) => {}
        }
    }
    (client, draws, cut)
}

/// The events of `bytes` as (event, data).
fn events(bytes: &[u8]) -> Vec<(String, String)> {
    let mut parser = SseParser::new();
    let mut out = Vec::new();
    parser.push(bytes, |e| {
        out.push((
            String::from_utf8_lossy(e.event).into_owned(),
            String::from_utf8_lossy(e.data).into_owned(),
        ))
    });
    out
}

fn json(data: &str) -> Value {
    serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"))
}

#[test]
fn an_openai_stream_is_cut_right_after_the_event_the_lease_could_not_cover() {
    let stream = openai_stream(WORDS, false);
    // Text bytes so far after each word: 5, 12 ("ö" is 2), 13, 17, 21, 25, 26.
    let (client, draws, cut) = run(Provider::OpenAi, false, &[&stream], 14);
    assert_eq!(draws, [5, 12, 13, 17], "one draw per event that adds text");
    assert!(cut.is_cut());
    assert_eq!(cut.output(), 17);
    let events = events(&client);
    let texts: Vec<String> = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .filter_map(|(_, d)| {
            json(d)["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    // The uncovered event (" how") was delivered and charged; nothing after.
    assert_eq!(texts.concat(), "Hello wörld, how");
    let last = json(&events[events.len() - 2].1);
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["id"], "chatcmpl-1");
    assert_eq!(last["model"], "gpt-test");
    assert_eq!(last["created"], 7);
    assert_eq!(last["object"], "chat.completion.chunk");
    assert!(last.get("usage").is_none(), "the client asked no usage");
    assert_eq!(events.last().unwrap().1, "[DONE]");
    assert_eq!(events.len(), 1 + 4 + 1 + 1);
    // Billed: the input bound (the stream reported none yet) and 17.
    assert_eq!(
        cut.billed(100),
        Usage {
            input_tokens: 100,
            output_tokens: 17,
            ..Usage::default()
        }
    );
}

#[test]
fn an_openai_client_that_asked_for_usage_gets_the_billed_usage_chunk() {
    let stream = openai_stream(WORDS, true);
    let (client, _, cut) = run(Provider::OpenAi, true, &[&stream], 0);
    assert_eq!(cut.output(), 5);
    let events = events(&client);
    let n = events.len();
    let finish = json(&events[n - 3].1);
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(finish["usage"].is_null());
    let usage = json(&events[n - 2].1);
    assert_eq!(usage["choices"], Value::Array(vec![]));
    assert_eq!(usage["usage"]["prompt_tokens"], 100);
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["usage"]["total_tokens"], 105);
    assert_eq!(events[n - 1].1, "[DONE]");
}

#[test]
fn an_anthropic_stream_ends_with_its_block_stopped_max_tokens_and_the_usage_billed() {
    let stream = anthropic_stream(WORDS);
    // message_start reports 1 output token; then 1 + bytes.
    let (client, draws, cut) = run(Provider::Anthropic, false, &[&stream], 10);
    assert_eq!(draws, [1, 6, 13]);
    assert_eq!(cut.output(), 13);
    let events = events(&client);
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let delta = json(&events[6].1);
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 13);
    assert_eq!(delta["usage"]["input_tokens"], 4, "the reported input");
    assert_eq!(delta["usage"]["cache_read_input_tokens"], 2);
    assert_eq!(json(&events[5].1)["index"], 0);
    assert_eq!(
        cut.billed(100),
        Usage {
            input_tokens: 4,
            output_tokens: 13,
            cache_read_tokens: 2,
            cache_creation_tokens: 0,
        }
    );
}

#[test]
fn a_stream_that_finishes_within_its_lease_is_untouched_and_never_cut_after() {
    for (provider, stream) in [
        (Provider::OpenAi, openai_stream(WORDS, true)),
        (Provider::Anthropic, anthropic_stream(WORDS)),
    ] {
        let (client, _, cut) = run(provider, true, &[&stream], 1000);
        assert!(!cut.is_cut());
        assert!(cut.finished());
        assert_eq!(client, stream);
    }
    // Anthropic's final count (5) replaces the bytes' bound.
    let mut cut = StreamCut::new(Provider::Anthropic, false);
    assert_eq!(cut.push(&anthropic_stream(WORDS), |_| false), None);
    assert_eq!(cut.output(), 5);
    // A usage chunk after the finish draws nothing: no cut after `stop`.
    let mut cut = StreamCut::new(Provider::OpenAi, true);
    let mut stream = openai_stream(&["a"], false);
    stream.truncate(stream.len() - b"data: [DONE]\n\n".len());
    stream.extend_from_slice(
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":900}}\n\n",
    );
    let mut draws = Vec::new();
    let at = cut.push(&stream, |o| {
        draws.push(o);
        o > 1
    });
    assert_eq!((at, draws), (None, vec![1]));
    assert_eq!(cut.output(), 900, "the provider's count is what it used");
}

#[test]
fn every_chunking_gives_the_client_the_same_bytes_and_never_cuts_inside_an_event() {
    for (provider, stream, covered) in [
        (Provider::OpenAi, openai_stream(&["ab", "c", "de"], true), 2),
        (Provider::Anthropic, anthropic_stream(&["ab", "c", "de"]), 3),
    ] {
        let crlf = String::from_utf8(stream.clone())
            .unwrap()
            .replace('\n', "\r\n")
            .into_bytes();
        for stream in [stream, crlf] {
            let (whole, _, cut) = run(provider, true, &[&stream], covered);
            assert!(cut.is_cut());
            for i in 0..=stream.len() {
                for j in (i..=stream.len()).step_by(7) {
                    let (a, rest) = stream.split_at(i);
                    let (b, c) = rest.split_at(j - i);
                    let (client, _, _) = run(provider, true, &[a, b, c], covered);
                    if stream.contains(&b'\r') {
                        // A CRLF split after its CR is cut at the CR: the
                        // same events (a CR ends a line on its own).
                        assert_eq!(events(&client), events(&whole), "split at {i},{j}");
                    } else {
                        assert_eq!(
                            String::from_utf8_lossy(&client),
                            String::from_utf8_lossy(&whole),
                            "{provider:?} split at {i},{j}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn provider_counts_on_every_chunk_replace_the_bytes_bound() {
    // A backend reporting usage on every chunk (vLLM's continuous stats).
    let mut stream = String::new();
    for (i, word) in ["aaaa", "bbbb", "cccc"].iter().enumerate() {
        stream.push_str(&format!(
            "data: {{\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}}}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":{}}}}}\n\n",
            i + 1
        ));
    }
    let (client, draws, cut) = run(Provider::OpenAi, false, &[stream.as_bytes()], 1);
    assert_eq!(draws, [1, 2]);
    assert_eq!(cut.reported_input(), Some(3));
    assert_eq!(cut.billed(100).input_tokens, 3);
    assert_eq!(cut.billed(100).output_tokens, 2);
    assert!(String::from_utf8_lossy(&client).contains("\"finish_reason\":\"length\""));
}

#[test]
fn tool_calls_reasoning_and_several_choices_count_and_end_each_choice() {
    let stream = concat!(
        "data: {\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[",
        "{\"index\":0,\"delta\":{\"reasoning_content\":\"hmm\"}},",
        "{\"index\":1,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\":1}\"}}]}}]}\n\n",
        "data: {\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\"yy\"}}]}\n\n",
    );
    let (client, draws, _) = run(Provider::OpenAi, false, &[stream.as_bytes()], 5);
    // 3 + 7 ({"a":1}) = 10 > 5: cut after the first event.
    assert_eq!(draws, [10]);
    let ends: Vec<Value> = events(&client)
        .into_iter()
        .filter(|(_, d)| d.contains("\"length\""))
        .map(|(_, d)| json(&d))
        .collect();
    let indexes: Vec<&Value> = ends.iter().map(|e| &e["choices"][0]["index"]).collect();
    assert_eq!(indexes, [&Value::from(0), &Value::from(1)]);
}

#[test]
fn an_anthropic_tool_use_block_counts_its_name_and_json() {
    let stream = concat!(
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01\",\"name\":\"get\",\"input\":{}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"q\\\"\"}}\n\n",
    );
    let (client, draws, _) = run(Provider::Anthropic, false, &[stream.as_bytes()], 3);
    assert_eq!(draws, [3, 7]);
    let events = events(&client);
    assert_eq!(events[2].0, "content_block_stop");
    assert_eq!(json(&events[2].1)["index"], 1);
}

#[test]
fn the_billed_hand_off_round_trips_and_refuses_anything_else() {
    let usage = Usage {
        input_tokens: 1,
        output_tokens: 22,
        cache_read_tokens: 333,
        cache_creation_tokens: 4444,
    };
    assert_eq!(parse_billed(encode_billed(&usage).as_bytes()), Some(usage));
    for bad in ["", "1 2 3", "1 2 3 4 5", "1 2 x 4", "-1 2 3 4", "1  2 3 4"] {
        assert_eq!(parse_billed(bad.as_bytes()), None, "{bad:?}");
    }
}

#[test]
fn sse_event_ends_are_where_the_bytes_before_hold_whole_events() {
    let stream: &[u8] = b"data: a\r\n\r\nevent: x\ndata: b\n\n: c\n\ndata: c\r\r";
    let mut ends = Vec::new();
    SseParser::new().push_framed(stream, |_, end| {
        ends.push(end);
        true
    });
    assert_eq!(ends, [11, 29, 43]);
    // Stopping leaves the rest unread.
    let mut seen = 0;
    SseParser::new().push_framed(stream, |_, _| {
        seen += 1;
        false
    });
    assert_eq!(seen, 1);
}

proptest! {
    #[test]
    fn no_input_panics_and_a_cut_is_at_an_offset_within_the_chunk(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8),
        openai in any::<bool>(),
        covered in 0u64..64,
    ) {
        let provider = if openai { Provider::OpenAi } else { Provider::Anthropic };
        let mut cut = StreamCut::new(provider, true);
        for chunk in &chunks {
            if let Some(at) = cut.push(chunk, |o| o > covered) {
                prop_assert!(at <= chunk.len());
            }
        }
        let mut out = Vec::new();
        cut.end(7, &mut out);
        prop_assert!(!out.is_empty());
    }

    #[test]
    fn streams_of_random_words_cut_after_the_first_draw_past_the_lease(
        words in prop::collection::vec("[a-zé ]{0,6}", 1..20),
        covered in 0u64..40,
        split in 1usize..50,
    ) {
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let stream = openai_stream(&words, false);
        let chunks: Vec<&[u8]> = stream.chunks(split).collect();
        let (client, draws, cut) = run(Provider::OpenAi, false, &chunks, covered);
        let total: u64 = words.iter().map(|w| w.len() as u64).sum();
        prop_assert_eq!(cut.is_cut(), total > covered);
        // Only the last draw is past the lease; it is what was delivered.
        prop_assert!(draws.iter().rev().skip(1).all(|&d| d <= covered));
        let texts: String = events(&client)
            .iter()
            .filter(|(_, d)| d != "[DONE]")
            .filter_map(|(_, d)| json(d)["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect();
        prop_assert_eq!(texts.len() as u64, cut.output());
        prop_assert!(client.ends_with(b"data: [DONE]\n\n"));
    }
}
