//! Request bodies of any size the backend accepts, in every Envoy form:
//! long-context and multimodal requests are megabytes of JSON (a base64 PDF,
//! a few images). The chain never holds more than a stage may buffer: a
//! larger body streams to the backend byte for byte (the cache bypasses it,
//! counted), metering still reads its usage, and an OpenAI stream that did
//! not ask for usage gets `include_usage` appended as its body passes.

use anyhow::{Context, Result, ensure};

use zerolayer_e2e::chain::{
    BodyCase, Chain, ChainOptions, Form, LARGE_BODIES, MIB, large_request, large_request_arrived,
    logged_usage,
};
use zerolayer_e2e::{Reply, in_every_form};

fn large_bodies_reach_the_backend_byte_for_byte(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("alice", "acme")?;
    let url = |path: &str| chain.envoy.url(path);
    for &BodyCase {
        id,
        path,
        size,
        stream,
        chunked,
    } in LARGE_BODIES
    {
        let sent = large_request(path, size, stream);
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
        let usage_added = path == "/v1/chat/completions" && stream;
        large_request_arrived(&chain.stub, id, usage_added, &sent, &reply)?;
        ensure!(
            reply.header("x-cache") == Some("BYPASS") || size < MIB,
            "{id}: x-cache {:?}",
            reply.header("x-cache")
        );
    }
    let ids: Vec<&str> = LARGE_BODIES.iter().map(|c| c.id).collect();
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
