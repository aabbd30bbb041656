//! Test helpers: a root configured on the recording fake, and one request
//! driven through its stream callback by callback (one host for every
//! request, so shared data carries over as it does in a VM).

use zerolayer_core::cache::key::{CacheKey, CanonicalRequest, Provider};
use zerolayer_host::{Action, FakeHost, Host, RootStage, StreamStage};

use crate::CacheRoot;

/// The variable `secret_env` names in tests. Setting one is `unsafe` in
/// edition 2024 (and the workspace denies unsafe code), so the tests use one
/// cargo sets for every test process it runs: this crate's description,
/// far longer than the 32 bytes `check_secret` asks for (`CARGO_PKG_NAME`,
/// 20 bytes, would be refused as too short; `PATH` has no length promise).
pub(crate) const SECRET_ENV: &str = "CARGO_PKG_DESCRIPTION";

/// The singleton observer's queue (default `observer` link).
pub(crate) const JOBS: &str = "zerolayer.jobs";

pub(crate) const OPENAI: &str = "/v1/chat/completions";

/// A deterministic OpenAI request (temperature 0: cacheable by default).
pub(crate) const BODY: &[u8] =
    br#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}"#;

/// The same request asking something else.
pub(crate) const OTHER_BODY: &[u8] =
    br#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"bye"}]}"#;

/// A 200 JSON answer, in two chunks.
pub(crate) const ANSWER: [&[u8]; 2] = [
    br#"{"id":"c1","model":"m","choices":[{"index":0,"#,
    br#""message":{"role":"assistant","content":"hello"}}]}"#,
];

pub(crate) const JSON_200: &[(&str, &str)] =
    &[(":status", "200"), ("content-type", "application/json")];

/// A root configured with `config` (refusal fails the test).
pub(crate) fn configured(config: &str) -> (FakeHost, CacheRoot) {
    let mut host = FakeHost::default();
    let mut root = CacheRoot::default();
    assert!(
        RootStage::<FakeHost>::configure(&mut root, &mut host, config.as_bytes()),
        "configuration refused: {config}"
    );
    (host, root)
}

/// One cache for everyone, defaults otherwise.
pub(crate) fn shared_cache() -> (FakeHost, CacheRoot) {
    configured(&format!(
        r#"{{"secret_env":"{SECRET_ENV}","namespace":"shared"}}"#
    ))
}

/// The key the filter computes for an OpenAI `body` in `tenant`'s namespace.
pub(crate) fn key_of(body: &[u8], tenant: Option<&str>) -> CacheKey {
    let secret = std::env::var(SECRET_ENV).expect("cargo sets CARGO_PKG_DESCRIPTION for tests");
    CanonicalRequest::of(Provider::OpenAi, body, tenant, secret.as_bytes())
        .expect("a keyable body")
        .key
}

pub(crate) type Stream = Box<dyn StreamStage<FakeHost>>;

/// A request after its headers and (if any) its whole body.
pub(crate) struct Asked {
    pub stream: Stream,
    /// What `request_headers` returned.
    pub headers: Action,
    /// What `request_body` returned (`Continue` when there was no body).
    pub body: Action,
}

/// Stream `id`: `method` on `path` with `extra` headers, then `body` in one
/// piece (`None`: the headers end the request).
pub(crate) fn ask(
    root: &CacheRoot,
    host: &mut FakeHost,
    id: u32,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Asked {
    host.request_headers = [(":method", method), (":path", path)]
        .iter()
        .chain(extra)
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    host.response_headers.clear();
    host.response_body.clear();
    let mut stream = RootStage::<FakeHost>::stream(root, id);
    let headers = stream.request_headers(host, body.is_none());
    let body = match body {
        Some(body) => {
            host.request_body = body.to_vec();
            stream.request_body(host, body.len(), true)
        }
        None => Action::Continue,
    };
    Asked {
        stream,
        headers,
        body,
    }
}

/// A POST of `body` to the OpenAI path.
pub(crate) fn post(root: &CacheRoot, host: &mut FakeHost, id: u32, body: &[u8]) -> Asked {
    ask(root, host, id, "POST", OPENAI, &[], Some(body))
}

/// The upstream's response: `headers`, then `chunks` (the last one ends it;
/// none: the headers do).
pub(crate) fn respond(
    stream: &mut Stream,
    host: &mut FakeHost,
    headers: &[(&str, &str)],
    chunks: &[&[u8]],
) {
    host.respond_with(headers);
    let _ = stream.response_headers(host, chunks.is_empty());
    for (i, chunk) in chunks.iter().enumerate() {
        host.response_body = chunk.to_vec();
        let _ = stream.response_body(host, chunk.len(), i + 1 == chunks.len());
    }
}

/// [`respond`], then the access log.
pub(crate) fn complete(
    stream: &mut Stream,
    host: &mut FakeHost,
    headers: &[(&str, &str)],
    chunks: &[&[u8]],
) {
    respond(stream, host, headers, chunks);
    stream.log(host);
}

/// Counter `name` after a tick flushed the pending increments.
pub(crate) fn counted(root: &mut CacheRoot, host: &mut FakeHost, name: &str) -> i64 {
    RootStage::<FakeHost>::tick(root, host);
    host.metric(name)
        .unwrap_or_else(|| panic!("metric {name} is not defined"))
}

/// Response bodies held in the local tier.
pub(crate) fn stored_bodies(host: &FakeHost) -> usize {
    host.shared
        .keys()
        .filter(|k| k.starts_with("zl:cache:b:"))
        .count()
}

/// Registers the singleton observer's queue, as the observer service would.
pub(crate) fn observer_queue(host: &mut FakeHost) {
    host.register_queue(JOBS)
        .expect("the fake registers queues");
}
