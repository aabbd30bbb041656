//! Request bodies of any size the backend accepts, in every Envoy form:
//! long-context and multimodal requests are megabytes of JSON (a base64 PDF,
//! a few images). The chain never holds more than a stage may buffer: a
//! larger body streams to the backend byte for byte (the cache bypasses it,
//! counted), metering still reads its usage, and an OpenAI stream that did
//! not ask for usage gets `include_usage` appended as its body passes.

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use zerolayer_e2e::chain::{Chain, ChainOptions, Form, logged_usage};
use zerolayer_e2e::{Reply, in_every_form};

const MIB: usize = 1024 * 1024;

/// A JSON request body of about `size` bytes: one user message whose
/// content is base64-like text (what a PDF or an image is on the wire).
fn body(path: &str, size: usize, stream: bool) -> Vec<u8> {
    let content: String = (0..size)
        .map(|i| {
            char::from(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[i % 64])
        })
        .collect();
    let request = if path == "/v1/messages" {
        json!({"max_tokens": 8, "messages": [{"role": "user", "content": content}],
               "model": "claude-large", "stream": stream})
    } else {
        json!({"messages": [{"role": "user", "content": content}], "model": "gpt-large",
               "stream": stream})
    };
    request.to_string().into_bytes()
}

fn large_bodies_reach_the_backend_byte_for_byte(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("alice", "acme")?;
    let url = |path: &str| chain.envoy.url(path);
    // (id, path, size, stream, chunked upload)
    let cases = [
        ("big-anthropic", "/v1/messages", 32 * MIB, false, false),
        ("big-anthropic-stream", "/v1/messages", 3 * MIB, true, true),
        ("big-openai", "/v1/chat/completions", 32 * MIB, false, false),
        (
            "big-openai-stream",
            "/v1/chat/completions",
            32 * MIB,
            true,
            false,
        ),
        (
            "big-openai-stream-chunked",
            "/v1/chat/completions",
            3 * MIB,
            true,
            true,
        ),
        // Under the stages' 1 MiB: held, keyed, rewritten in place.
        (
            "small-openai-stream",
            "/v1/chat/completions",
            100 * 1024,
            true,
            false,
        ),
    ];
    for (id, path, size, stream, chunked) in cases {
        let sent = body(path, size, stream);
        let headers = [
            ("authorization", bearer.as_str()),
            ("x-request-id", id),
            ("content-type", "application/json"),
        ];
        let reply: Reply = if chunked {
            chain.client.post_chunked(&url(path), &headers, &sent)?
        } else {
            chain.client.send(
                "POST",
                &url(path),
                &headers,
                std::str::from_utf8(&sent).context("ASCII")?,
            )?
        };
        ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
        let seen = chain
            .stub
            .requests()
            .into_iter()
            .find(|r| r.header("x-request-id") == Some(id))
            .with_context(|| format!("{id}: never reached the backend"))?;
        let openai_stream = path == "/v1/chat/completions" && stream;
        if openai_stream {
            // Asked for usage on the client's behalf: the same body with
            // one member more.
            let got: Value = serde_json::from_slice(&seen.body)
                .with_context(|| format!("{id}: the backend got no JSON"))?;
            let mut want: Value = serde_json::from_slice(&sent)?;
            want["stream_options"] = json!({"include_usage": true});
            ensure!(got == want, "{id}: the backend got another body");
            // …and the client never sees the usage chunk it did not ask for.
            ensure!(
                !reply.body.contains("\"choices\":[]"),
                "{id}: the usage chunk reached the client"
            );
        } else {
            ensure!(
                seen.body == sent,
                "{id}: the backend got {} bytes, not the {} sent",
                seen.body.len(),
                sent.len()
            );
        }
        ensure!(
            reply.header("x-cache") == Some("BYPASS") || size < MIB,
            "{id}: x-cache {:?}",
            reply.header("x-cache")
        );
    }
    let ids: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let log = chain.wait_access_log_for(&ids)?;
    for id in ids {
        let usage = logged_usage(&log, id)?;
        ensure!(usage["usage_missing"] == 0, "{id}: usage missing: {usage}");
        ensure!(
            usage["input_tokens"].as_u64() > Some(0),
            "{id}: no input tokens: {usage}"
        );
        ensure!(usage["model"] != "unknown", "{id}: {usage}");
    }
    chain
        .envoy
        .wait_metric(r#"zerolayer_cache_bypass{reason="too_large"}"#, 5.0)?;
    Ok(())
}

in_every_form!(large_bodies_reach_the_backend_byte_for_byte);
