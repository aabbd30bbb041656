//! Streamed completions through the chain, in real Envoy and in
//! `host-sim serve`: from the GPU backend stub (exact framing, latency
//! profile) and from the real llama.cpp model server.

use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use zerolayer_e2e::differential::Pair;
use zerolayer_e2e::{EnvoyConfig, ModelServer, paths};
use zerolayer_stub::{Stub, StubConfig};

/// A streamed response read as it arrives: the bytes and when each read returned.
struct Arrival {
    status: u16,
    content_type: String,
    body: String,
    first_chunk: Duration,
    last_chunk: Duration,
}

fn stream(url: &str, body: &str) -> Result<Arrival> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let started = Instant::now();
    let response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .with_context(|| format!("POST {url}"))?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut reader = response.into_body().into_reader();
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    let (mut first, mut last) = (None, Duration::ZERO);
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        let at = started.elapsed();
        first.get_or_insert(at);
        last = at;
        bytes.extend_from_slice(&buf[..n]);
    }
    Ok(Arrival {
        status,
        content_type,
        body: String::from_utf8(bytes)?,
        first_chunk: first.unwrap_or_default(),
        last_chunk: last,
    })
}

/// SSE events as (event name or "", data), split on blank lines.
fn events(body: &str) -> Vec<(String, String)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = String::new();
            for line in e.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = v.to_string();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = v.to_string();
                }
            }
            (name, data)
        })
        .collect()
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
        let a = stream(&format!("{base}/v1/messages"), anthropic)?;
        assert_eq!(a.status, 200, "{base}: {}", a.body);
        assert!(
            a.content_type.starts_with("text/event-stream"),
            "{base}: {}",
            a.content_type
        );
        let names: Vec<String> = events(&a.body).into_iter().map(|(n, _)| n).collect();
        let mut want = vec!["message_start", "content_block_start", "ping"];
        want.extend(std::iter::repeat_n("content_block_delta", TOKENS as usize));
        want.extend(["content_block_stop", "message_delta", "message_stop"]);
        assert_eq!(names, want, "{base}");
        let delta = events(&a.body)
            .into_iter()
            .find(|(n, _)| n == "message_delta")
            .context("message_delta")?;
        let usage: serde_json::Value = serde_json::from_str(&delta.1)?;
        assert_eq!(usage["usage"]["output_tokens"], TOKENS, "{base}");
        // Event by event: the stream spans (TOKENS - 1) inter-token gaps at
        // the stub; a proxy that buffered it would deliver it all at once.
        let spread = a.last_chunk - a.first_chunk;
        assert!(
            spread >= ITL * (TOKENS - 1) / 2,
            "{base}: all chunks within {spread:?}"
        );

        let o = stream(&format!("{base}/v1/chat/completions"), openai)?;
        assert_eq!(o.status, 200, "{base}: {}", o.body);
        let chunks = events(&o.body);
        assert_eq!(
            chunks.last().map(|(_, d)| d.as_str()),
            Some("[DONE]"),
            "{base}"
        );
        let usage: serde_json::Value = serde_json::from_str(&chunks[chunks.len() - 2].1)?;
        assert_eq!(usage["usage"]["completion_tokens"], TOKENS, "{base}");
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
        let r = stream(&format!("{base}/v1/chat/completions"), request)?;
        assert_eq!(r.status, 200, "{base}: {}", r.body);
        let chunks = events(&r.body);
        if chunks.last().map(|(_, d)| d.as_str()) != Some("[DONE]") {
            bail!("{base}: stream did not end with [DONE]:\n{}", r.body);
        }
        let mut text = String::new();
        let mut usage = None;
        for (_, data) in &chunks[..chunks.len() - 1] {
            let chunk: serde_json::Value = serde_json::from_str(data)?;
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
