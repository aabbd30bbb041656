//! Test support for the stage's native tests: configurations, a configured
//! root on the recording [`FakeHost`], requests, jobs, signed JWTs.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::SigningKey;
use p256::ecdsa::signature::Signer as _;
use serde_json::{Value, json};
use zerolayer_core::event::Job;
use zerolayer_core::internal;
use zerolayer_host::{Action, FakeHost, Host, RootStage, StreamStage};

use crate::AuthRoot;

/// The singleton observer's queue (the configuration's default).
pub(crate) const JOBS: &str = "zerolayer.jobs";

/// The fake's clock at start (`FakeHost::default`), Unix seconds.
pub(crate) const NOW: u64 = 1_700_000_000;

/// API keys only, introspected at cluster `keys`, plus `extra` fields.
pub(crate) fn api_keys(extra: Value) -> String {
    merged(
        json!({
            "credentials": [{"header": "x-api-key", "kind": "api_key"}],
            "api_keys": {"cluster": "keys", "path": "/introspect"},
        }),
        extra,
    )
}

/// Bearer JWTs only, plus `extra` fields.
pub(crate) fn jwts(extra: Value) -> String {
    merged(
        json!({"credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}]}),
        extra,
    )
}

fn merged(mut base: Value, extra: Value) -> String {
    if let (Some(base), Value::Object(extra)) = (base.as_object_mut(), extra) {
        base.extend(extra);
    }
    base.to_string()
}

/// A host where the observer service registered its queue.
pub(crate) fn host_with_observer() -> FakeHost {
    let mut host = FakeHost::default();
    host.register_queue(JOBS).unwrap();
    host
}

/// A root configured with `config` (which must be accepted).
pub(crate) fn configured(host: &mut FakeHost, config: &str) -> AuthRoot {
    let mut root = AuthRoot::default();
    assert!(
        RootStage::<FakeHost>::configure(&mut root, host, config.as_bytes()),
        "configuration refused: {config}"
    );
    root
}

/// A new stream of `root` given `headers` (and `:path /v1/messages`
/// unless they set one): the stream and its request-headers action.
pub(crate) fn request(
    root: &AuthRoot,
    host: &mut FakeHost,
    headers: &[(&str, &str)],
) -> (Box<dyn StreamStage<FakeHost>>, Action) {
    host.request_headers = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    if !headers.iter().any(|(n, _)| *n == ":path") {
        host.request_headers
            .push((":path".into(), b"/v1/messages".to_vec()));
    }
    let mut stream = RootStage::<FakeHost>::stream(root, 1);
    let action = stream.request_headers(host, true);
    (stream, action)
}

/// The identity lazy-auth published, as text.
pub(crate) fn identity(host: &FakeHost) -> Option<String> {
    host.properties
        .get(internal::AUTH_PROPERTY)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The jobs waiting in the observer's queue, decoded.
pub(crate) fn jobs(host: &FakeHost) -> Vec<Job> {
    host.queued(JOBS)
        .iter()
        .map(|bytes| Job::decode(bytes).expect("a job"))
        .collect()
}

/// Counter `name` after the root's tick flushed the counters.
pub(crate) fn counter(root: &mut AuthRoot, host: &mut FakeHost, name: &str) -> i64 {
    RootStage::<FakeHost>::tick(root, host);
    host.metric(name)
        .unwrap_or_else(|| panic!("metric {name} not defined"))
}

/// A P-256 signing key (the same for the same `seed`).
pub(crate) fn ec_key(seed: u8) -> SigningKey {
    SigningKey::from_slice(&[seed; 32]).unwrap()
}

/// `key`'s public half as a JWK with `kid`.
pub(crate) fn jwk(key: &SigningKey, kid: &str) -> Value {
    let point = key.verifying_key().to_encoded_point(false);
    json!({
        "kty": "EC", "crv": "P-256", "kid": kid,
        "x": URL_SAFE_NO_PAD.encode(point.x().unwrap()),
        "y": URL_SAFE_NO_PAD.encode(point.y().unwrap()),
    })
}

/// An ES256 JWT of `claims` signed by `key` under `kid`.
pub(crate) fn jwt(key: &SigningKey, kid: &str, claims: Value) -> String {
    let header = json!({"alg": "ES256", "typ": "JWT", "kid": kid});
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let signature: p256::ecdsa::Signature = key.sign(input.as_bytes());
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()))
}

/// Claims valid for an hour from [`NOW`], for `tenant`.
pub(crate) fn claims(tenant: &str) -> Value {
    json!({"sub": "user-1", "tenant": tenant, "exp": NOW + 3600, "iat": NOW - 10})
}
