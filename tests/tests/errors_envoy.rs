//! The gateway's own answers, in every Envoy form: each in the error format
//! of the API the request called (Anthropic's `{"type":"error","error":…}`,
//! OpenAI's `{"error":{"message","type","param","code"}}`), with the retry
//! hint the official SDKs obey (`x-should-retry`, `retry-after`) and the
//! request-id header each reads. The README's error contract table is this
//! test's list; the 503 "retry later" is `reliability_envoy.rs`'s
//! `an_introspection_outage…`.

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use zerolayer_e2e::chain::{Chain, ChainOptions, Form, anthropic, openai};
use zerolayer_e2e::{Reply, in_every_form};

/// Checks `reply` is the gateway's `status` in `path`'s format, final.
fn final_error(reply: &Reply, path: &str, status: u16, kind: &str, id: &str) -> Result<Value> {
    ensure!(
        reply.status == status,
        "{id}: {} {}",
        reply.status,
        reply.body
    );
    let body: Value = serde_json::from_str(&reply.body)
        .with_context(|| format!("{id}: not JSON: {}", reply.body))?;
    ensure!(
        reply.header("x-should-retry") == Some("false"),
        "{id}: x-should-retry {:?}",
        reply.header("x-should-retry")
    );
    ensure!(reply.header("retry-after").is_none(), "{id}: a retry-after");
    ensure!(
        reply.header("content-type") == Some("application/json"),
        "{id}: {:?}",
        reply.header("content-type")
    );
    if path == "/v1/messages" {
        ensure!(body["type"] == "error", "{id}: {body}");
        ensure!(body["error"]["type"] == kind, "{id}: {body}");
        ensure!(reply.header("request-id") == Some(id), "{id}: request-id");
    } else {
        ensure!(
            body["error"]["type"] == kind
                && body["error"]["param"].is_null()
                && body["error"]["code"].is_null(),
            "{id}: {body}"
        );
        ensure!(
            reply.header("x-request-id") == Some(id),
            "{id}: x-request-id"
        );
    }
    ensure!(body["error"]["message"].is_string(), "{id}: {body}");
    Ok(body)
}

fn the_gateways_own_answers_follow_the_error_contract(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        ..ChainOptions::default()
    })?;
    let bearer = chain.verified_bearer("errors", "acme")?;
    for (path, body) in [
        ("/v1/messages", anthropic("no credential", false)),
        ("/v1/chat/completions", openai("no credential", false)),
    ] {
        let id = format!("missing{}", path.replace('/', "-"));
        let reply = chain.post(path, &[("x-request-id", &id)], &body)?;
        final_error(&reply, path, 401, "authentication_error", &id)?;
    }
    let long = "k".repeat(5000);
    let reply = chain.post(
        "/v1/messages",
        &[("x-api-key", &long), ("x-request-id", "too-long")],
        &anthropic("too long", false),
    )?;
    final_error(
        &reply,
        "/v1/messages",
        431,
        "authentication_error",
        "too-long",
    )?;
    let reply = chain.post(
        "/v1/chat/completions",
        &[
            ("authorization", &bearer),
            ("x-request-id", "only-if-cached"),
            ("cache-control", "only-if-cached"),
        ],
        &openai("never stored", false),
    )?;
    final_error(
        &reply,
        "/v1/chat/completions",
        504,
        "cache_miss",
        "only-if-cached",
    )?;
    let duplicate = json!({"model": "claude-test", "max_tokens": 8,
        "messages": [{"role": "user", "content": "twice"}]})
    .to_string()
    .replacen('{', r#"{"temperature":0,"temperature":1,"#, 1);
    let reply = chain.post(
        "/v1/messages",
        &[("authorization", &bearer), ("x-request-id", "duplicate")],
        &duplicate,
    )?;
    final_error(
        &reply,
        "/v1/messages",
        400,
        "invalid_request_error",
        "duplicate",
    )?;
    // None of them reached the backend.
    for id in ["too-long", "only-if-cached", "duplicate"] {
        ensure!(chain.backend_requests(id) == 0, "{id} reached the backend");
    }
    Ok(())
}

in_every_form!(the_gateways_own_answers_follow_the_error_contract);
