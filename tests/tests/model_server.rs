//! The real LLM server (llama.cpp's, serving SmolLM2-135M-Instruct) answers
//! both provider APIs, streamed and not, with usage counts: what the
//! metering and cache filters will see behind the gateway. One server is
//! shared by the tests of this binary ([`ModelServer::shared`]).
//!
//! # Where this server differs from the hosted providers
//!
//! Checked against xllamacpp 2026.10.11549; the filters must parse these.
//!
//! Both APIs:
//! - Any `model` is served; replies always name the server's alias
//!   (`smollm2`), not the model the request asked for.
//! - The prompt cache is implicit (no `cache_control` needed): a request
//!   sharing a prefix with the previous one on the slot reports most of its
//!   prompt as cached (below).
//! - Errors have one shape for both APIs:
//!   `{"error":{"code":400,"message":"…","type":"invalid_request_error"}}`
//!   (Anthropic's is `{"type":"error","error":{"type":…,"message":…}}`).
//! - Stream responses are `text/event-stream`, chunked, with `X-Accel-Buffering: no`
//!   and an empty `Access-Control-Allow-Origin` header; `Server: llama.cpp`.
//!
//! OpenAI `/v1/chat/completions`:
//! - `id` is `chatcmpl-` + 32 letters; `system_fingerprint` is `b0-unknown`;
//!   no `service_tier`, no `logprobs: null`, no `refusal`.
//! - Streams start with a `delta: {"role":"assistant","content":null}` chunk
//!   (OpenAI sends `"content":""`), then one chunk per generated token, then a
//!   chunk with `finish_reason` and an empty `delta`.
//! - With `stream_options.include_usage` the usage chunk has `choices: []` as
//!   OpenAI's does, but the other chunks carry no `"usage": null`.
//! - `usage` has `prompt_tokens_details.cached_tokens` but no
//!   `completion_tokens_details`; `prompt_tokens` counts cached tokens too.
//! - Every final reply/usage chunk carries an extra llama.cpp `timings`
//!   object (`cache_n`, `prompt_n`, `predicted_n`, `*_ms`, …). Without
//!   `include_usage` a stream has no `usage` at all, but its
//!   `finish_reason` chunk still has `timings.predicted_n` (tokens generated)
//!   and `timings.prompt_n + timings.cache_n` (prompt tokens).
//! - An empty `messages` list is accepted (OpenAI answers 400).
//!
//! Anthropic `/v1/messages`:
//! - `id` is `chatcmpl-…` (Anthropic: `msg_…`); no `anthropic-version` header
//!   needed; `max_tokens` is optional (Anthropic: required, 400 without it).
//! - `usage.input_tokens` counts only the prompt tokens not read from the
//!   prompt cache (as Anthropic's does); `cache_read_input_tokens` is always
//!   present, `cache_creation_input_tokens` never is. So input tokens are
//!   `input_tokens + cache_read_input_tokens` (e.g. 1 + 32 on a repeat).
//! - Streams: `message_start` (usage with the input counts and
//!   `output_tokens: 0`), `content_block_start`, one `content_block_delta`
//!   (`text_delta`) per token, `content_block_stop`, `message_delta` (usage
//!   with `output_tokens` only, no input counts), `message_stop`. No `ping`
//!   events. Every event has both the `event:` line and `type` in its data.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::{Value, json};
use zerolayer_e2e::sse::{self, SseEvent};
use zerolayer_e2e::{Client, ModelServer};

/// Small, so tests stay fast on two busy cores.
const MAX_TOKENS: u64 = 8;

fn server() -> Result<Arc<ModelServer>> {
    let server = ModelServer::shared()?;
    eprintln!(
        "model server on {} (healthy {} ms after spawn)",
        server.url(),
        server.ready_after().as_millis()
    );
    Ok(server)
}

/// POSTs `body` and reads the SSE stream event by event as it arrives.
fn stream(url: &str, headers: &[(&str, &str)], body: &Value) -> Result<Vec<SseEvent>> {
    let reply = sse::post(url, headers, &body.to_string())?;
    if reply.status != 200 {
        bail!("POST {url}: {}: {}", reply.status, reply.error_body);
    }
    ensure!(
        reply.content_type.starts_with("text/event-stream"),
        "content-type {:?}",
        reply.content_type
    );
    Ok(reply.events)
}

fn post_json(url: &str, body: &Value) -> Result<Value> {
    let reply = Client::new().send(
        "POST",
        url,
        &[("content-type", "application/json")],
        &body.to_string(),
    )?;
    ensure!(
        reply.status == 200,
        "POST {url}: {}: {}",
        reply.status,
        reply.body
    );
    serde_json::from_str(&reply.body).with_context(|| format!("reply {:?}", reply.body))
}

fn u64_at(value: &Value, pointer: &str) -> Result<u64> {
    value
        .pointer(pointer)
        .and_then(Value::as_u64)
        .ok_or_else(|| anyhow!("no integer at {pointer} in {value}"))
}

fn messages() -> Value {
    json!([{"role": "user", "content": "Say hello in five words."}])
}

#[test]
fn openai_stream_carries_tokens_then_usage_then_done() -> Result<()> {
    let server = server()?;
    let body = json!({
        "model": server.model(),
        "messages": messages(),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let events = stream(&server.url_of("/v1/chat/completions"), &[], &body)?;
    let (last, chunks) = events.split_last().context("empty stream")?;
    ensure!(last.data == "[DONE]", "last event is {:?}", last.data);
    ensure!(
        events.iter().all(|e| e.name.is_none()),
        "OpenAI events are unnamed"
    );

    let chunks = chunks
        .iter()
        .map(|e| Ok((e, e.json()?)))
        .collect::<Result<Vec<_>>>()?;
    let mut text = String::new();
    let mut content_chunks = 0;
    let mut first_token = None;
    for (event, chunk) in &chunks {
        ensure!(chunk["object"] == "chat.completion.chunk", "{chunk}");
        ensure!(chunk["model"] == server.model(), "{chunk}");
        if let Some(piece) = chunk
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            text.push_str(piece);
            content_chunks += 1;
            first_token.get_or_insert(event.at);
        }
    }
    let first_token = first_token.context("no chunk with content")?;
    eprintln!(
        "openai stream: first token after {} ms, {} chunks in {} ms: {text:?}",
        first_token.as_millis(),
        events.len(),
        last.at.as_millis()
    );

    let with_usage: Vec<&Value> = chunks
        .iter()
        .map(|(_, c)| c)
        .filter(|c| c.get("usage").is_some())
        .collect();
    ensure!(with_usage.len() == 1, "usage chunks: {with_usage:?}");
    let usage_chunk = with_usage[0];
    ensure!(
        std::ptr::eq(usage_chunk, &chunks[chunks.len() - 1].1),
        "usage is not the last chunk before [DONE]"
    );
    ensure!(usage_chunk["choices"] == json!([]), "{usage_chunk}");
    let prompt = u64_at(usage_chunk, "/usage/prompt_tokens")?;
    let completion = u64_at(usage_chunk, "/usage/completion_tokens")?;
    ensure!(prompt > 0, "{usage_chunk}");
    ensure!((1..=MAX_TOKENS).contains(&completion), "{usage_chunk}");
    ensure!(u64_at(usage_chunk, "/usage/total_tokens")? == prompt + completion);
    ensure!(
        content_chunks <= completion,
        "{content_chunks} content chunks for {completion} tokens"
    );
    let finish = chunks
        .iter()
        .find_map(|(_, c)| c.pointer("/choices/0/finish_reason")?.as_str())
        .context("no finish_reason")?;
    ensure!(
        ["stop", "length"].contains(&finish),
        "finish_reason {finish}"
    );
    Ok(())
}

#[test]
fn openai_stream_without_include_usage_has_no_usage_but_timings() -> Result<()> {
    let server = server()?;
    let body = json!({
        "model": "gpt-4o-mini",
        "messages": messages(),
        "max_tokens": 4,
        "temperature": 0,
        "stream": true,
    });
    let events = stream(&server.url_of("/v1/chat/completions"), &[], &body)?;
    let (last, chunks) = events.split_last().context("empty stream")?;
    ensure!(last.data == "[DONE]");
    let chunks = chunks
        .iter()
        .map(SseEvent::json)
        .collect::<Result<Vec<_>>>()?;
    ensure!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "a usage chunk without include_usage"
    );
    // The requested name is not echoed: the server reports its alias.
    ensure!(chunks.iter().all(|c| c["model"] == server.model()));
    // llama.cpp's own counters ride on the finish_reason chunk.
    let end = chunks.last().context("no chunks")?;
    ensure!(
        end.pointer("/choices/0/finish_reason")
            .is_some_and(Value::is_string)
    );
    let predicted = u64_at(end, "/timings/predicted_n")?;
    ensure!((1..=4).contains(&predicted), "{end}");
    ensure!(u64_at(end, "/timings/prompt_n")? + u64_at(end, "/timings/cache_n")? > 0);
    Ok(())
}

#[test]
fn anthropic_stream_has_the_message_event_sequence_with_usage() -> Result<()> {
    let server = server()?;
    let body = json!({
        "model": "claude-haiku-4-5",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": true,
        "messages": messages(),
    });
    let events = stream(
        &server.url_of("/v1/messages"),
        &[("anthropic-version", "2023-06-01")],
        &body,
    )?;
    let mut names = vec![];
    let mut datas = vec![];
    for event in &events {
        let data = event.json()?;
        let name = event.name.clone().context("unnamed Anthropic event")?;
        ensure!(data["type"] == name.as_str(), "event {name} with {data}");
        names.push(name);
        datas.push(data);
    }
    // message_start, content_block_start, content_block_delta+,
    // content_block_stop, message_delta, message_stop.
    let deltas = names.iter().filter(|n| *n == "content_block_delta").count();
    ensure!(deltas >= 1, "events: {names:?}");
    let mut want = vec!["message_start", "content_block_start"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    ensure!(names == want, "events: {names:?}");
    let first_token = events[2].at;
    eprintln!(
        "anthropic stream: first token after {} ms, {} events in {} ms",
        first_token.as_millis(),
        events.len(),
        events[events.len() - 1].at.as_millis()
    );

    let start = &datas[0];
    ensure!(start["message"]["model"] == server.model(), "{start}");
    let input = u64_at(start, "/message/usage/input_tokens")?
        + u64_at(start, "/message/usage/cache_read_input_tokens")?;
    ensure!(input > 0, "{start}");
    ensure!(
        u64_at(start, "/message/usage/output_tokens")? == 0,
        "{start}"
    );
    ensure!(datas[2]["delta"]["type"] == "text_delta", "{}", datas[2]);
    let delta = &datas[datas.len() - 2];
    let output = u64_at(delta, "/usage/output_tokens")?;
    ensure!((1..=MAX_TOKENS).contains(&output), "{delta}");
    ensure!(
        deltas as u64 <= output,
        "{deltas} deltas for {output} tokens"
    );
    let stop = delta["delta"]["stop_reason"].as_str().unwrap_or_default();
    ensure!(["end_turn", "max_tokens"].contains(&stop), "{delta}");
    Ok(())
}

#[test]
fn non_streamed_replies_of_both_apis_carry_usage() -> Result<()> {
    let server = server()?;

    let openai = post_json(
        &server.url_of("/v1/chat/completions"),
        &json!({
            "model": server.model(),
            "messages": messages(),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }),
    )?;
    ensure!(openai["object"] == "chat.completion", "{openai}");
    ensure!(
        openai["choices"][0]["message"]["role"] == "assistant",
        "{openai}"
    );
    let content = openai["choices"][0]["message"]["content"].as_str();
    ensure!(content.is_some_and(|c| !c.is_empty()), "{openai}");
    let prompt = u64_at(&openai, "/usage/prompt_tokens")?;
    let completion = u64_at(&openai, "/usage/completion_tokens")?;
    ensure!(prompt > 0, "{openai}");
    ensure!((1..=MAX_TOKENS).contains(&completion), "{openai}");
    ensure!(u64_at(&openai, "/usage/total_tokens")? == prompt + completion);
    ensure!(u64_at(&openai, "/usage/prompt_tokens_details/cached_tokens")? <= prompt);

    let anthropic = post_json(
        &server.url_of("/v1/messages"),
        &json!({
            "model": "claude-haiku-4-5",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": messages(),
        }),
    )?;
    ensure!(anthropic["type"] == "message", "{anthropic}");
    ensure!(anthropic["role"] == "assistant", "{anthropic}");
    ensure!(anthropic["content"][0]["type"] == "text", "{anthropic}");
    let text = anthropic["content"][0]["text"].as_str();
    ensure!(text.is_some_and(|t| !t.is_empty()), "{anthropic}");
    let input = u64_at(&anthropic, "/usage/input_tokens")?
        + u64_at(&anthropic, "/usage/cache_read_input_tokens")?;
    ensure!(input > 0, "{anthropic}");
    let output = u64_at(&anthropic, "/usage/output_tokens")?;
    ensure!((1..=MAX_TOKENS).contains(&output), "{anthropic}");
    ensure!(anthropic["stop_reason"].is_string(), "{anthropic}");
    Ok(())
}

#[test]
fn errors_have_one_json_shape_for_both_apis() -> Result<()> {
    let server = server()?;
    for path in ["/v1/chat/completions", "/v1/messages"] {
        let reply = Client::new().send(
            "POST",
            &server.url_of(path),
            &[("content-type", "application/json")],
            "{not json",
        )?;
        ensure!(
            reply.status == 400,
            "{path}: {} {}",
            reply.status,
            reply.body
        );
        let doc: Value = serde_json::from_str(&reply.body)?;
        ensure!(doc["error"]["code"] == 400, "{path}: {doc}");
        ensure!(
            doc["error"]["type"] == "invalid_request_error",
            "{path}: {doc}"
        );
        ensure!(doc["error"]["message"].is_string(), "{path}: {doc}");
    }
    Ok(())
}
