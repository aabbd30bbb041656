//! Streamed completions through the chain, in real Envoy and in
//! `host-sim serve`: from the GPU backend stub (exact framing, latency
//! profile) and from the real llama.cpp model server.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use zerolayer_e2e::differential::Pair;
use zerolayer_e2e::sse::{self, SseReply};
use zerolayer_e2e::{EnvoyConfig, ModelServer, paths};
use zerolayer_stub::{Stub, StubConfig};

fn ok(reply: SseReply, base: &str) -> Result<SseReply> {
    if reply.status != 200 {
        bail!("{base}: {}: {}", reply.status, reply.error_body);
    }
    Ok(reply)
}

fn activation_pair(backend: std::net::SocketAddr) -> Result<Pair> {
    paths::wasm("activation")?;
    Pair::start_in_front_of(EnvoyConfig::shipped("activation.yaml")?, Some(backend))
}

#[test]
fn stub_streams_pass_through_envoy_and_host_sim_event_by_event() -> Result<()> {
    const TOKENS: u32 = 12;
    const ITL: Duration = Duration::from_millis(25);
    let stub = Stub::start(
        StubConfig::default()
            .ttft(Duration::from_millis(100))
            .itl(ITL)
            .output_tokens(TOKENS),
    )?;
    let pair = activation_pair(stub.addr())?;
    let (envoy, sim) = pair.bases();
    let anthropic = r#"{"model":"claude-demo","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"count to twelve"}]}"#;
    let openai = r#"{"model":"gpt-demo","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"count to twelve"}]}"#;
    for base in [&envoy, &sim] {
        let a = ok(
            sse::post(&format!("{base}/v1/messages"), &[], anthropic)?,
            base,
        )?;
        assert!(
            a.content_type.starts_with("text/event-stream"),
            "{base}: {}",
            a.content_type
        );
        let mut want = vec!["message_start", "content_block_start", "ping"];
        want.extend(std::iter::repeat_n("content_block_delta", TOKENS as usize));
        want.extend(["content_block_stop", "message_delta", "message_stop"]);
        assert_eq!(a.names(), want, "{base}");
        let delta = a
            .events
            .iter()
            .find(|e| e.name.as_deref() == Some("message_delta"))
            .context("message_delta")?;
        assert_eq!(delta.json()?["usage"]["output_tokens"], TOKENS, "{base}");
        // Event by event: the stream spans (TOKENS - 1) inter-token gaps at
        // the stub; a proxy that buffered it would deliver it all at once.
        let spread = a.spread();
        assert!(
            spread >= ITL * (TOKENS - 1) / 2,
            "{base}: all events within {spread:?}"
        );

        let o = ok(
            sse::post(&format!("{base}/v1/chat/completions"), &[], openai)?,
            base,
        )?;
        let chunks = &o.events;
        assert_eq!(
            chunks.last().map(|e| e.data.as_str()),
            Some("[DONE]"),
            "{base}"
        );
        assert_eq!(
            chunks[chunks.len() - 2].json()?["usage"]["completion_tokens"],
            TOKENS,
            "{base}"
        );
    }
    assert_eq!(stub.served("/v1/messages"), 2);
    assert_eq!(stub.served("/v1/chat/completions"), 2);
    Ok(())
}

#[test]
fn a_real_model_completion_streams_through_envoy_and_host_sim() -> Result<()> {
    let model = ModelServer::shared()?;
    let pair = activation_pair(model.addr())?;
    let (envoy, sim) = pair.bases();
    let request = r#"{"model":"smollm2","max_tokens":8,"temperature":0,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}"#;
    let mut texts = vec![];
    for base in [&envoy, &sim] {
        let r = ok(
            sse::post(&format!("{base}/v1/chat/completions"), &[], request)?,
            base,
        )?;
        if r.events.last().map(|e| e.data.as_str()) != Some("[DONE]") {
            bail!("{base}: stream did not end with [DONE]: {:?}", r.events);
        }
        let mut text = String::new();
        let mut usage = None;
        for event in &r.events[..r.events.len() - 1] {
            let chunk = event.json()?;
            if let Some(t) = chunk["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if chunk["usage"].is_object() {
                usage = Some(chunk["usage"].clone());
            }
        }
        let usage = usage.with_context(|| format!("{base}: no usage chunk"))?;
        let completion = usage["completion_tokens"].as_u64().unwrap_or(0);
        assert!((1..=8).contains(&completion), "{base}: {usage}");
        assert!(
            usage["prompt_tokens"].as_u64().unwrap_or(0) > 0,
            "{base}: {usage}"
        );
        assert!(!text.is_empty(), "{base}: empty completion");
        texts.push(text);
    }
    // Greedy decoding of the same prompt: both paths carried the same answer.
    assert_eq!(texts[0], texts[1]);
    Ok(())
}
