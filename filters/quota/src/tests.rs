//! The stage on the recording fake, its store calls answered by a fake
//! webdis in front of the Rust model of Redis: what a client sees (the 429s,
//! the headers), what the store's counter comes to, and what is refused at
//! configuration.

use std::time::Duration;

use serde_json::{Value, json};
use zerolayer_core::internal;
use zerolayer_core::quota::store::ModelStore;
use zerolayer_core::usage::{Missing, PartialUsage, Usage};
use zerolayer_host::{Action, Callback, FakeHost, Host, RootStage, StageHost, StreamStage};

use crate::QuotaRoot;

/// 2026-12-03T00:00:00Z.
const T0_MS: u64 = 1_796_256_000_000;
const OPENAI: &str = "/v1/chat/completions";
const ANTHROPIC: &str = "/v1/messages";

type Stream = Box<dyn StreamStage<FakeHost>>;

/// A daily token budget of `amount` per tenant, a 3-request unverified budget.
fn daily(amount: u64) -> Value {
    json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 1},
        "unverified": {"unit": "requests", "limit": {"budget": {"amount": 3, "window": "day"}}},
        "policies": [{"name": "daily", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": amount, "window": "day"}}}]
    })
}

/// The stage, its host, and the store behind its webdis.
struct Gateway {
    host: FakeHost,
    root: QuotaRoot,
    store: ModelStore,
}

impl Gateway {
    fn new(config: &Value) -> Gateway {
        let mut host = FakeHost::default();
        host.clock = Duration::from_millis(T0_MS);
        let mut root = QuotaRoot::default();
        assert!(
            RootStage::<FakeHost>::configure(&mut root, &mut host, config.to_string().as_bytes()),
            "configuration refused: {config}"
        );
        assert!(
            host.dispatched.is_empty(),
            "no store call from on_configure"
        );
        // The first tick loads the scripts.
        RootStage::<FakeHost>::tick(&mut root, &mut host);
        Gateway {
            host,
            root,
            store: ModelStore::new(),
        }
    }

    /// Answers every store call dispatched so far, as webdis would, to the
    /// root.
    /// [`Gateway::new`] with the scripts loaded and acme's lease filled
    /// (its first request, which waits for the grant and is dropped, then a
    /// sync): the next requests are admitted without waiting.
    fn with_lease(config: &Value) -> Gateway {
        let mut gw = Gateway::new(config);
        gw.answer_store();
        let _ = gw.ask(OPENAI, ACME, CHAT);
        gw.sync();
        gw
    }

    fn answer_store(&mut self) -> usize {
        self.answer_store_to(None)
    }

    /// Answers every store call dispatched so far, as webdis would, to
    /// `stream` (the calls a waiting request made) and the root.
    fn answer_store_to(&mut self, mut stream: Option<&mut Stream>) -> usize {
        let calls = std::mem::take(&mut self.host.dispatched);
        let now = self.host.clock.as_millis() as u64;
        for call in &calls {
            assert_eq!(call.cluster, "webdis");
            // The command in the path, no body (see `Plan::send_due`).
            assert_eq!(call.header(":method"), Some("GET"));
            assert!(call.body.as_deref().is_none_or(<[u8]>::is_empty));
            let path = call.header(":path").expect("a path");
            let body = self
                .store
                .answer_webdis(path.strip_prefix('/').expect("under /").as_bytes(), now);
            self.host.answer_with(Some(200), &body);
            // Each ignores tokens it did not dispatch.
            if let Some(stream) = stream.as_deref_mut() {
                stream.call_answered(&mut self.host, call.token, body.len());
            }
            RootStage::<FakeHost>::call_answered(
                &mut self.root,
                &mut self.host,
                call.token,
                body.len(),
            );
        }
        calls.len()
    }

    /// A tick (the sync), its calls answered, until nothing more is asked.
    fn sync(&mut self) {
        RootStage::<FakeHost>::tick(&mut self.root, &mut self.host);
        for _ in 0..4 {
            if self.answer_store() == 0 {
                break;
            }
            RootStage::<FakeHost>::tick(&mut self.root, &mut self.host);
        }
    }

    /// A new POST to `path` by `identity` (lazy-auth's property) with
    /// `headers` besides: its stream, no callback run yet.
    fn open(&mut self, path: &str, identity: &str, headers: &[(&str, &str)]) -> Stream {
        self.host.request_headers = [(":method", "POST"), (":path", path)]
            .iter()
            .chain(headers)
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        self.host.sent.clear();
        self.host.response_headers.clear();
        self.host
            .properties
            .insert(internal::AUTH_PROPERTY.into(), identity.as_bytes().to_vec());
        RootStage::<FakeHost>::stream(&self.root, 1)
    }

    /// A POST of `body` to `path` by `identity` (lazy-auth's property);
    /// returns the stream and what its request callbacks returned.
    fn ask(&mut self, path: &str, identity: &str, body: &str) -> (Stream, Action) {
        let mut stream = self.open(path, identity, &[]);
        assert_eq!(
            stream.request_headers(&mut self.host, false),
            Action::Pause,
            "Envoy holds the headers until the bound is read"
        );
        self.host.request_body = body.as_bytes().to_vec();
        let action = stream.request_body(&mut self.host, body.len(), true);
        (stream, action)
    }

    /// The backend's JSON answer with `usage`, then the log.
    fn answer(&mut self, stream: &mut Stream, usage: Value) {
        self.host
            .respond_with(&[(":status", "200"), ("content-type", "application/json")]);
        let _ = stream.response_headers(&mut self.host, false);
        let body = json!({"id": "c1", "model": "m", "choices": [], "usage": usage}).to_string();
        self.host.response_body = body.into_bytes();
        let size = self.host.response_body.len();
        let _ = stream.response_body(&mut self.host, size, true);
        stream.log(&mut self.host);
    }

    fn counter(&self, needle: &str) -> i64 {
        self.store
            .counters()
            .filter(|(k, _)| k.contains(needle) && !k.contains(":i:"))
            .map(|(_, v)| v)
            .sum()
    }
}

const ACME: &str = "verified tenant=acme subject=u1";
const CHAT: &str = r#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;

#[test]
fn the_first_request_of_a_scope_waits_one_round_trip_for_its_lease_then_settles_exactly() {
    let mut gw = Gateway::new(&daily(100_000));
    // The scripts are loaded at the first tick, before any request.
    assert_eq!(gw.answer_store(), 2);

    // The lease is empty: the request waits for its grant (one call, from
    // its own context), then goes on; nobody gets a 429 for being first.
    let (mut stream, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Pause);
    assert_eq!(gw.host.dispatched.len(), 1, "one grant");
    assert_eq!(gw.answer_store_to(Some(&mut stream)), 1);
    assert_eq!(gw.host.resumes.len(), 1, "resumed once granted");
    assert!(gw.host.sent.is_empty());
    gw.answer(
        &mut stream,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    let limit = gw.host.response_header_value("x-ratelimit-limit-tokens");
    assert_eq!(limit.as_deref(), Some("100000"));
    let remaining: u64 = gw
        .host
        .response_header_value("x-ratelimit-remaining-tokens")
        .expect("remaining shown")
        .parse()
        .unwrap();
    // What is spent counts, not the reservation in flight.
    assert_eq!(remaining, 100_000);

    // The next request finds the lease filled: no call at all.
    let (mut next, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Continue);
    assert!(
        gw.host.dispatched.is_empty(),
        "no network call on the request path"
    );
    gw.answer(
        &mut next,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );

    // Idle long enough, the lease gives back all it holds: the counter is
    // exactly what was used.
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(gw.counter("daily"), 24);
}

#[test]
fn a_request_waits_for_a_grant_the_root_already_asked_for() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    let (refused, _) = gw.ask(OPENAI, ACME, CHAT);
    drop(refused);
    // The root's tick asks for the grant; its answer is not in yet.
    RootStage::<FakeHost>::tick(&mut gw.root, &mut gw.host);
    let root_call = gw.host.dispatched.pop().expect("the root's grant");
    let (mut stream, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Pause, "it waits, not a 429");
    assert!(gw.host.sent.is_empty());
    // Its own copy of the call (same sequence number) answers it.
    assert!(gw.host.dispatched.iter().any(|c| c.body == root_call.body));
    gw.answer_store_to(Some(&mut stream));
    assert_eq!(gw.host.resumes.len(), 1);
    gw.answer(
        &mut stream,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    // The root's late answer to the same operation changes nothing.
    gw.host.dispatched.push(root_call);
    gw.answer_store();
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(
        gw.counter("daily"),
        12,
        "granted once, used 12, the rest back"
    );
}

/// In a chain that runs in one filter, metering (before quota in the
/// response) shares the usage it reads: quota settles from it and reads no
/// body itself; a stream cut short settles what was shared so far.
#[test]
fn in_a_chain_quota_settles_from_the_usage_metering_shares_without_reading_the_body() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    // The first 40 bytes of a stream: a short one counts what it delivered.
    let body = openai_events(3)[..40].to_vec();
    let cases = [
        (
            true,
            Ok(Usage {
                input_tokens: 7,
                output_tokens: 5,
                ..Usage::default()
            }),
            12,
        ),
        // The client went away after the input was reported: its input,
        // and the output it got (bounded by max_tokens 100).
        (
            false,
            Err(Missing::Incomplete(PartialUsage {
                input_tokens: Some(9),
                output_tokens: Some(1),
                ..PartialUsage::default()
            })),
            9 + 1,
        ),
        // No output count: the bytes delivered bound it.
        (
            false,
            Err(Missing::Incomplete(PartialUsage {
                input_tokens: Some(9),
                ..PartialUsage::default()
            })),
            9 + 40,
        ),
    ];
    // Per chunk (a chain that does not count what passed), then counted by
    // the chain (fused, native): the stage is not called per chunk at all.
    for counted_by_chain in [false, true] {
        for (complete, shared, expected) in cases {
            let before = {
                gw.host.advance(Duration::from_millis(61_000));
                gw.sync();
                gw.counter("daily")
            };
            let (mut stream, action) = gw.ask(OPENAI, ACME, CHAT);
            if action == Action::Pause {
                gw.answer_store_to(Some(&mut stream));
            }
            gw.host.response_passed = counted_by_chain.then_some((0, false));
            gw.host
                .respond_with(&[(":status", "200"), ("content-type", "text/event-stream")]);
            // Metering made its extractor at its response headers.
            gw.host.shared_usage = Some(Err(Missing::NotReported));
            let _ = gw.host.take_done();
            let _ = stream.response_headers(&mut gw.host, false);
            let done = gw.host.take_done().contains(Callback::ResponseBody);
            assert_eq!(done, counted_by_chain, "done with the response body");
            // A body whose own usage would say otherwise: it is not parsed.
            gw.host.response_body = body.clone();
            gw.host.shared_usage = Some(shared);
            let reads = gw.host.body_reads;
            if counted_by_chain {
                gw.host.note_response_passed(body.len(), complete);
            } else {
                let _ = stream.response_body(&mut gw.host, body.len(), complete);
            }
            assert_eq!(gw.host.body_reads, reads, "quota read the body again");
            stream.log(&mut gw.host);
            gw.host.shared_usage = None;
            gw.host.advance(Duration::from_millis(61_000));
            gw.sync();
            assert_eq!(
                gw.counter("daily") - before,
                expected,
                "complete: {complete}, counted by the chain: {counted_by_chain}"
            );
        }
    }
}

#[test]
fn in_a_chain_quota_shares_the_model_it_read_from_the_whole_body() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    gw.host.fused = true;
    let (_stream, _) = gw.ask(OPENAI, ACME, r#"{"model":"gpt-shared","max_tokens":5}"#);
    assert_eq!(
        gw.host.shared_request_model,
        Some(Some("gpt-shared".into()))
    );
    gw.host.shared_request_model = None;
    // A body the scan has not seen the end of shares nothing.
    let mut stream = gw.open(OPENAI, ACME, &[]);
    let _ = stream.request_headers(&mut gw.host, false);
    let part = r#"{"model":"gpt-shared","messages":["#;
    gw.host.request_body = part.as_bytes().to_vec();
    let _ = stream.request_body(&mut gw.host, part.len(), false);
    assert_eq!(gw.host.shared_request_model, None);
}

#[test]
fn a_grant_that_does_not_come_in_time_is_a_429_with_retry_after() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    let (mut stream, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Pause);
    let call = gw.host.dispatched.pop().expect("the grant");
    assert_eq!(call.timeout, Duration::from_millis(250), "bounded wait");
    // The host's timeout: an answer without a status.
    gw.host.answer_with(None, b"");
    stream.call_answered(&mut gw.host, call.token, 0);
    let sent = &gw.host.sent[0];
    assert_eq!(sent.status, 429);
    assert_eq!(sent.header("retry-after"), Some("1"));
    assert!(
        sent.text().contains("rate_limit_exceeded"),
        "{}",
        sent.text()
    );
    assert!(gw.host.resumes.is_empty());
}

#[test]
fn an_exhausted_budget_is_an_insufficient_quota_429_that_says_not_to_retry() {
    let mut gw = Gateway::with_lease(&daily(200));
    // 200 tokens cannot hold two reservations of ~180.
    let (mut first, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Continue);
    let (_second, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Pause);
    gw.answer(
        &mut first,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    gw.sync();
    // Now the lease has its refund; the budget is spent by a large request.
    let big = r#"{"model":"m","max_tokens":150,"messages":[]}"#;
    let (_big, action) = gw.ask(OPENAI, ACME, big);
    assert_eq!(action, Action::Pause);
    let sent = &gw.host.sent[0];
    assert_eq!(sent.status, 429);
    assert_eq!(sent.header("x-should-retry"), Some("false"));
    let body: Value = serde_json::from_str(&sent.text()).unwrap();
    assert_eq!(body["error"]["code"], "insufficient_quota");
    assert_eq!(body["error"]["type"], "insufficient_quota");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("daily"),
        "the policy is named: {body}"
    );
}

#[test]
fn with_rate_limit_headers_off_an_admitted_response_carries_none_and_a_refusal_still_explains() {
    let mut config = daily(200);
    config["rate_limit_headers"] = json!(false);
    let mut gw = Gateway::with_lease(&config);
    let (mut first, action) = gw.ask(OPENAI, ACME, CHAT);
    assert_eq!(action, Action::Continue);
    gw.answer(
        &mut first,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    for name in [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ] {
        assert_eq!(gw.host.response_header_value(name), None, "{name}");
    }
    // Still limited and counted: a request past the budget is refused in
    // the provider's format, and the counter holds what was used.
    let big = r#"{"model":"m","max_tokens":250,"messages":[]}"#;
    let (_big, action) = gw.ask(OPENAI, ACME, big);
    assert_eq!(action, Action::Pause);
    let sent = &gw.host.sent[0];
    assert_eq!(sent.status, 429);
    assert_eq!(sent.header("x-should-retry"), Some("false"));
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(gw.counter("daily"), 12);
}

#[test]
fn anthropic_clients_get_their_own_error_format_and_headers() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    let body = r#"{"model":"claude","max_tokens":64,"messages":[]}"#;
    let (mut refused, _) = gw.ask(ANTHROPIC, ACME, body);
    let call = gw.host.dispatched.pop().expect("the grant");
    gw.host.answer_with(None, b"");
    refused.call_answered(&mut gw.host, call.token, 0);
    let sent = &gw.host.sent[0];
    let parsed: Value = serde_json::from_str(&sent.text()).unwrap();
    assert_eq!(parsed["type"], "error");
    assert_eq!(parsed["error"]["type"], "rate_limit_error");
    drop(refused);
    gw.sync();
    let (mut stream, _) = gw.ask(ANTHROPIC, ACME, body);
    gw.answer(&mut stream, json!({"input_tokens": 3, "output_tokens": 4}));
    assert_eq!(
        gw.host
            .response_header_value("anthropic-ratelimit-tokens-limit")
            .as_deref(),
        Some("100000")
    );
    assert!(
        gw.host
            .response_header_value("x-ratelimit-limit-tokens")
            .is_none()
    );
}

#[test]
fn a_forged_claim_spends_only_the_unverified_budget() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.answer_store();
    let forged = "unverified tenant=acme";
    let _ = gw.ask(OPENAI, forged, CHAT);
    gw.sync();
    let mut admitted = 0;
    for _ in 0..10 {
        // Leases of a 3-request budget hold one request: a sync each.
        gw.host.advance(Duration::from_millis(500));
        gw.sync();
        let (mut stream, action) = gw.ask(OPENAI, forged, CHAT);
        if action == Action::Continue {
            admitted += 1;
            gw.answer(
                &mut stream,
                json!({"prompt_tokens": 7, "completion_tokens": 5}),
            );
        }
    }
    assert_eq!(admitted, 3, "the unverified budget is 3 requests a day");
    assert_eq!(gw.counter("daily"), 0, "acme's budget is untouched");
    // No identity at all (lazy-auth not in the chain) is unverified too.
    gw.host.properties.clear();
    let mut stream = RootStage::<FakeHost>::stream(&gw.root, 2);
    gw.host.request_headers = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), OPENAI.as_bytes().to_vec()),
    ];
    gw.host.sent.clear();
    let _ = stream.request_headers(&mut gw.host, false);
    gw.host.request_body = CHAT.as_bytes().to_vec();
    assert_eq!(
        stream.request_body(&mut gw.host, CHAT.len(), true),
        Action::Pause
    );
    assert_eq!(gw.host.sent[0].status, 429);
}

/// When a lazily admitted request's verdict is written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum VerdictComes {
    BeforeItsLog,
    AfterItsLog,
    Never,
}

/// A request lazy-auth admitted before verifying its credential (claiming
/// mallory), answered 12 tokens, its verdict (valid for acme) written as
/// `comes` says.
fn lazily_admitted(gw: &mut Gateway, key: &[u8], comes: VerdictComes) {
    use zerolayer_core::auth::attribution::PendingCredential;
    use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
    use zerolayer_core::auth::verdict::Verdict;
    let hash = TokenHash::credential(CredentialKind::ApiKey, key);
    let pending = PendingCredential { hash, slots: 16 };
    // A 3-request unverified budget leases one request at a time.
    gw.host.advance(Duration::from_millis(500));
    gw.sync();
    let mut stream = gw.open(OPENAI, "unverified tenant=mallory", &[]);
    gw.host
        .properties
        .insert(internal::CREDENTIAL_PROPERTY.into(), pending.render());
    assert_eq!(stream.request_headers(&mut gw.host, false), Action::Pause);
    gw.host.request_body = CHAT.as_bytes().to_vec();
    if stream.request_body(&mut gw.host, CHAT.len(), true) == Action::Pause {
        // The unverified lease's first request waits for its grant.
        gw.answer_store_to(Some(&mut stream));
    }
    assert!(gw.host.sent.is_empty(), "admitted");
    let now = gw.host.now_secs();
    let verdict = Verdict::valid(&hash, now, None, 300, Some("acme".into()), None);
    if comes == VerdictComes::BeforeItsLog {
        gw.host
            .shared_put(&pending.verdict_key(), &verdict.encode());
    }
    gw.answer(
        &mut stream,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    let late = gw.root.quota().unwrap().late().len();
    let awaits = comes != VerdictComes::BeforeItsLog;
    assert_eq!(late, usize::from(awaits), "awaits its verdict");
    if comes == VerdictComes::AfterItsLog {
        gw.host
            .shared_put(&pending.verdict_key(), &verdict.encode());
    }
    gw.host.properties.remove(internal::CREDENTIAL_PROPERTY);
}

#[test]
fn a_lazily_admitted_request_settles_to_the_tenant_its_credential_turns_out_to_have() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    // Verified by the time its response ended, and verified only at the
    // next tick (a response faster than the verification).
    lazily_admitted(&mut gw, b"sk-one", VerdictComes::BeforeItsLog);
    lazily_admitted(&mut gw, b"sk-two", VerdictComes::AfterItsLog);
    gw.sync();
    let quota = gw.root.quota().unwrap();
    assert!(quota.late().is_empty());
    assert_eq!(quota.late().counts().verified, 2);
    assert_eq!(quota.stats(0).settled, 24, "acme's budget, not mallory's");
    // `unverified` bounds what passes before verification: it keeps them.
    assert_eq!(quota.stats(1).settled, 2, "two requests");
    drop(quota);
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(gw.counter("daily"), 24, "the store holds it too");
    assert_eq!(gw.counter("unverified"), 2);
    let exported = gw.host.metric("zerolayer_quota_late_verified");
    assert_eq!(exported, Some(2));
}

#[test]
fn a_lazily_admitted_request_whose_verdict_never_comes_is_handed_to_the_store_and_counted() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    lazily_admitted(&mut gw, b"sk-lost", VerdictComes::Never);
    gw.sync();
    assert_eq!(gw.root.quota().unwrap().late().len(), 1, "still awaiting");
    gw.host.advance(Duration::from_millis(
        zerolayer_core::quota::late::LATE_HORIZON_MS,
    ));
    gw.sync();
    let quota = gw.root.quota().unwrap();
    assert!(quota.late().is_empty());
    assert_eq!((quota.stats(0).settled, quota.stats(1).settled), (0, 1));
    drop(quota);
    assert_eq!(gw.host.metric("zerolayer_quota_late_expired"), Some(1));
    assert_eq!(gw.host.metric("zerolayer_quota_late_verified"), Some(0));
    // The tenant's charge went to the store's hand-off hash, for
    // reconciliation: one entry naming the credential.
    assert_eq!(gw.host.metric("zerolayer_quota_late_handed_off"), Some(1));
    assert_eq!(gw.host.metric("zerolayer_quota_late_lost"), Some(0));
    let hash = gw
        .store
        .hash(&zerolayer_core::quota::store::hand_off_key("zl:quota:"))
        .expect("the hand-off hash");
    let [value] = hash.values().collect::<Vec<_>>()[..] else {
        panic!("one hand-off: {hash:?}");
    };
    let charge: zerolayer_core::quota::late::UnsettledCharge = serde_json::from_str(value).unwrap();
    use zerolayer_core::auth::attribution::AttributionId;
    use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
    let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-lost");
    assert_eq!(charge.credential, AttributionId::of(&hash).render());
}

#[test]
fn a_request_without_max_tokens_reserves_the_default_cap() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    let body = r#"{"model":"m","messages":[]}"#;
    let (stream, action) = gw.ask(OPENAI, ACME, body);
    assert_eq!(action, Action::Continue);
    drop(stream);
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.stats(0).reserved, body.len() as u64 + 4096);
}

/// `inject_max_tokens`: a body without a cap is given the reserved one
/// (and its new length), one with a cap, however written, is left alone;
/// a body the stage no longer holds whole is counted as not given one.
#[test]
fn a_body_without_a_cap_is_given_the_reserved_one_when_configured() {
    let mut config = daily(100_000);
    config["inject_max_tokens"] = json!(true);
    config["policies"][0]["default_max_output_tokens"] = json!(700);
    let mut gw = Gateway::with_lease(&config);
    for (path, body, want) in [
        (
            OPENAI,
            r#"{"model":"m","messages":[]}"#,
            Some(r#"{"model":"m","messages":[],"max_completion_tokens":700}"#),
        ),
        (
            ANTHROPIC,
            r#"{"model":"m","messages":[]} "#,
            Some(r#"{"model":"m","messages":[],"max_tokens":700} "#),
        ),
        (OPENAI, CHAT, None),
        (OPENAI, r#"{"model":"m","max_t\u006fkens":5}"#, None),
        // Its only cap asks for none (an SDK's explicit `None`): replaced.
        (
            OPENAI,
            r#"{"model":"m","max_completion_tokens":null}"#,
            Some(r#"{"model":"m","max_completion_tokens":700}"#),
        ),
        (
            OPENAI,
            r#"{"model":"m","max_tokens": -1 }"#,
            Some(r#"{"model":"m","max_tokens": 700 }"#),
        ),
        // Two caps: which one the backend reads is its own affair.
        (
            OPENAI,
            r#"{"model":"m","max_tokens":null,"max_completion_tokens":-1}"#,
            None,
        ),
    ] {
        let (stream, action) = gw.ask(path, ACME, body);
        assert_eq!(action, Action::Continue, "{body}");
        let sent = String::from_utf8(gw.host.request_body.clone()).unwrap();
        assert_eq!(sent, want.unwrap_or(body), "{body}");
        let length = gw.host.request_header_value("content-length");
        assert_eq!(length, want.map(|w| w.len().to_string()), "{body}");
        drop(stream);
    }
    // Off (the default): nothing is added.
    let mut gw = Gateway::with_lease(&daily(100_000));
    let body = r#"{"model":"m","messages":[]}"#;
    let _ = gw.ask(OPENAI, ACME, body);
    assert_eq!(gw.host.request_body, body.as_bytes());
}

#[test]
fn a_body_that_went_on_in_pieces_is_counted_as_not_given_a_cap() {
    let mut config = daily(100_000);
    config["inject_max_tokens"] = json!(true);
    let mut gw = Gateway::with_lease(&config);
    // A host that cannot hold the headers (ngx_wasm_module) handed the
    // body over in two pieces: the first went on.
    gw.host.platform = zerolayer_host::Platform::NgxWasm;
    let mut stream = gw.open(OPENAI, ACME, &[]);
    assert_eq!(
        stream.request_headers(&mut gw.host, false),
        Action::Continue
    );
    gw.host.request_body = br#"{"model":"m","#.to_vec();
    assert_eq!(
        stream.request_body(&mut gw.host, 12, false),
        Action::Continue
    );
    gw.host.request_body = br#""messages":[]}"#.to_vec();
    assert_eq!(
        stream.request_body(&mut gw.host, 14, true),
        Action::Continue
    );
    assert_eq!(gw.host.request_body, br#""messages":[]}"#);
    RootStage::<FakeHost>::tick(&mut gw.root, &mut gw.host);
    assert_eq!(
        gw.host.metric("zerolayer_quota_max_tokens_not_injected"),
        Some(1)
    );
    assert_eq!(
        gw.host.metric("zerolayer_quota_max_tokens_injected"),
        Some(0)
    );
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// A POST of `body` (raw bytes) with `content-encoding: coding`.
fn ask_coded(gw: &mut Gateway, coding: &str, body: &[u8]) -> (Stream, Action) {
    let mut stream = gw.open(OPENAI, ACME, &[("content-encoding", coding)]);
    assert_eq!(stream.request_headers(&mut gw.host, false), Action::Pause);
    gw.host.request_body = body.to_vec();
    let action = stream.request_body(&mut gw.host, body.len(), true);
    (stream, action)
}

/// A compressed body is bounded by what it decodes to (a small gzip body
/// can hold a thousand times more prompt) and its members are read
/// through the coding; one whose size cannot be known is refused while a
/// policy counts tokens.
#[test]
fn a_compressed_body_is_bounded_by_what_it_decodes_to() {
    // Large enough that a lease covers the 50 KB prompt.
    let mut config = daily(100_000_000);
    config["inject_max_tokens"] = json!(true);
    let mut gw = Gateway::with_lease(&config);
    let prompt = "a".repeat(50_000);
    let plain =
        json!({"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": prompt}]})
            .to_string();
    let packed = gzip(plain.as_bytes());
    assert!(packed.len() < 1_000);
    let before = gw.root.quota().unwrap().stats(0).reserved;
    let (stream, action) = ask_coded(&mut gw, "gzip", &packed);
    assert_eq!(action, Action::Continue);
    let reserved = gw.root.quota().unwrap().stats(0).reserved - before;
    assert_eq!(
        reserved,
        plain.len() as u64 + 7,
        "decoded bytes and the cap read through gzip"
    );
    assert_eq!(
        gw.host.request_body, packed,
        "a compressed body is never rewritten"
    );
    drop(stream);
    // A coding it cannot read: 415, the backend never sees it.
    let (_, action) = ask_coded(&mut gw, "br", b"\x0b\x02\x80{}\x03");
    assert_eq!(action, Action::Pause);
    let sent = gw.host.sent.last().expect("a local response");
    assert_eq!(sent.status, 415);
    assert!(String::from_utf8_lossy(&sent.body).contains("content-encoding"));
    // A bomb: refused once it decodes past the limit.
    let bomb = gzip(&vec![b' '; 17 << 20]);
    let (_, action) = ask_coded(&mut gw, "gzip", &bomb);
    assert_eq!(action, Action::Pause);
    assert_eq!(gw.host.sent.last().map(|s| s.status), Some(413));
    RootStage::<FakeHost>::tick(&mut gw.root, &mut gw.host);
    assert_eq!(gw.host.metric("zerolayer_quota_unbounded_refused"), Some(2));
    assert_eq!(
        gw.host.metric("zerolayer_quota_max_tokens_not_injected"),
        Some(0)
    );

    // With only a requests policy the body's size does not matter.
    let mut gw = Gateway::with_lease(&json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 1},
        "policies": [{"name": "rpm", "scope": ["tenant"], "unit": "requests",
                      "limit": {"rate": {"amount": 100, "per": "minute"}}}]
    }));
    let (_, action) = ask_coded(&mut gw, "br", b"\x0b\x02\x80{}\x03");
    assert_eq!(action, Action::Continue);
    assert!(gw.host.sent.is_empty());
}

#[test]
fn requests_that_are_not_llm_calls_pass_untouched() {
    let mut gw = Gateway::new(&daily(100_000));
    gw.host.request_headers = vec![
        (":method".into(), b"GET".to_vec()),
        (":path".into(), b"/v1/models".to_vec()),
    ];
    let mut stream = RootStage::<FakeHost>::stream(&gw.root, 1);
    assert_eq!(stream.request_headers(&mut gw.host, true), Action::Continue);
    assert!(gw.host.sent.is_empty());
}

#[test]
fn metrics_per_policy_reach_the_host_on_tick() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    let (mut stream, _) = gw.ask(OPENAI, ACME, CHAT);
    gw.answer(
        &mut stream,
        json!({"prompt_tokens": 7, "completion_tokens": 5}),
    );
    RootStage::<FakeHost>::tick(&mut gw.root, &mut gw.host);
    let policy = [("policy", "daily")];
    assert_eq!(
        gw.host.labelled("zerolayer_quota_admitted", &policy),
        Some(1)
    );
    assert_eq!(
        gw.host.labelled("zerolayer_quota_refused", &policy),
        Some(1)
    );
    assert_eq!(
        gw.host.labelled("zerolayer_quota_settled", &policy),
        Some(12)
    );
    assert!(gw.host.labelled("zerolayer_quota_refills", &policy) >= Some(1));
}

#[test]
fn a_store_that_never_answers_adds_no_wait_and_no_error_while_leases_last() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    // From now on every call is dispatched and never answered.
    for _ in 0..4 {
        gw.host.advance(Duration::from_millis(500));
        RootStage::<FakeHost>::tick(&mut gw.root, &mut gw.host);
        let (mut stream, action) = gw.ask(OPENAI, ACME, CHAT);
        assert_eq!(action, Action::Continue, "the lease still covers it");
        gw.answer(
            &mut stream,
            json!({"prompt_tokens": 7, "completion_tokens": 5}),
        );
    }
}

#[test]
fn a_stream_dropped_without_its_log_gives_its_reservation_back() {
    let mut gw = Gateway::with_lease(&daily(100_000));
    let (stream, _) = gw.ask(OPENAI, ACME, CHAT);
    drop(stream);
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.stats(0).settled, CHAT.len() as u64 + 100);
}

#[test]
fn bad_fields_are_refused_at_configuration_and_hard_streams_accepted() {
    let mut hard = daily(100);
    hard["defaults"] = json!({"stream": "hard"});
    let mut root = QuotaRoot::default();
    assert!(RootStage::<FakeHost>::configure(
        &mut root,
        &mut FakeHost::default(),
        hard.to_string().as_bytes()
    ));
    let mut zero = daily(100);
    zero["policies"][0]["limit"]["budget"]["amount"] = json!(0);
    let mut host = FakeHost::default();
    let mut root = QuotaRoot::default();
    assert!(!RootStage::<FakeHost>::configure(
        &mut root,
        &mut host,
        zero.to_string().as_bytes()
    ));
    assert!(root.quota().is_none());
}

/// [`daily`] with every stream `hard`, one lease the whole budget's half.
fn hard(amount: u64, mode: &str) -> Value {
    let mut config = daily(amount);
    config["defaults"] = json!({"stream": "hard", "mode": mode});
    config["store"]["lease"] = json!({"max_percent": 100});
    config
}

const STREAM_CHAT: &str =
    r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
const STREAM_MESSAGES: &str =
    r#"{"model":"m","stream":true,"max_tokens":4000,"messages":[{"role":"user","content":"hi"}]}"#;

fn openai_events(words: usize) -> Vec<u8> {
    let mut s = String::new();
    for _ in 0..words {
        s.push_str("data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"abcd\"},\"finish_reason\":null}]}\n\n");
    }
    s.push_str("data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

fn anthropic_events(words: usize) -> Vec<u8> {
    let mut s = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"m\",\"usage\":{\"input_tokens\":6,\"output_tokens\":1}}}\n\n\
         event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    );
    for _ in 0..words {
        s.push_str("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"abcd\"}}\n\n");
    }
    s.push_str("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
                event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":99}}\n\n\
                event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    s.into_bytes()
}

impl Gateway {
    /// The first request of acme (it waits for its lease), answered.
    fn warm(&mut self) {
        self.answer_store();
        let (mut first, _) = self.ask(OPENAI, ACME, CHAT);
        self.answer_store_to(Some(&mut first));
        self.answer(
            &mut first,
            json!({"prompt_tokens": 1, "completion_tokens": 1}),
        );
    }

    /// An event stream answered in chunks of `split` bytes; what the client
    /// got. `metering_first`: a usage entry is published before the last
    /// callback, as metering (before quota in the response order) does.
    fn stream(&mut self, stream: &mut Stream, events: &[u8], split: usize) -> Vec<u8> {
        self.host
            .respond_with(&[(":status", "200"), ("content-type", "text/event-stream")]);
        let _ = stream.response_headers(&mut self.host, false);
        let mut client = Vec::new();
        let chunks: Vec<&[u8]> = events.chunks(split).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            self.host.response_body = chunk.to_vec();
            let _ = stream.response_body(&mut self.host, chunk.len(), i + 1 == chunks.len());
            client.extend_from_slice(&self.host.response_body);
        }
        stream.log(&mut self.host);
        client
    }

    /// [`Gateway::stream`] with the store answering, between two chunks,
    /// the calls made so far (the stream's own refills among them).
    fn stream_answered(&mut self, stream: &mut Stream, events: &[u8], split: usize) -> Vec<u8> {
        self.host
            .respond_with(&[(":status", "200"), ("content-type", "text/event-stream")]);
        let _ = stream.response_headers(&mut self.host, false);
        let mut client = Vec::new();
        let chunks: Vec<&[u8]> = events.chunks(split).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            self.host.response_body = chunk.to_vec();
            let _ = stream.response_body(&mut self.host, chunk.len(), i + 1 == chunks.len());
            client.extend_from_slice(&self.host.response_body);
            self.answer_store_to(Some(stream));
        }
        stream.log(&mut self.host);
        client
    }
}

#[test]
fn the_example_configuration_loads_and_loads_its_scripts_at_the_first_tick() {
    // filters/quota/example.json is the README's and the demo's starting point.
    let example = include_str!("../example.json");
    let mut host = FakeHost::default();
    host.clock = Duration::from_millis(T0_MS);
    let mut root = QuotaRoot::default();
    assert!(RootStage::<FakeHost>::configure(
        &mut root,
        &mut host,
        example.as_bytes()
    ));
    let quota = root.quota().unwrap();
    // Two policies and the unverified budget, last.
    assert_eq!(quota.policies().len(), 3);
    drop(quota);
    // Nothing is sent while configuring (ngx_wasm_module traps a callout
    // there); the first tick loads both scripts from the store.
    assert!(host.dispatched.is_empty());
    RootStage::<FakeHost>::tick(&mut root, &mut host);
    assert!(
        host.dispatched.iter().all(|c| c.cluster == "webdis"),
        "{:?}",
        host.dispatched.len()
    );
    assert_eq!(host.dispatched.len(), 2);
}

#[test]
fn a_hard_openai_stream_is_cut_cleanly_and_billed_what_it_delivered() {
    let mut gw = Gateway::new(&hard(400, "enforce"));
    gw.warm();
    let (mut stream, action) = gw.ask(OPENAI, ACME, STREAM_CHAT);
    assert_eq!(action, Action::Continue);
    let input = STREAM_CHAT.len() as u64;
    let quota = gw.root.quota().unwrap();
    let settled_before = quota.stats(0).settled;
    drop(quota);
    // 500 words of 4 bytes, in chunks that split events anywhere.
    let client = gw.stream(&mut stream, &openai_events(500), 37);
    let text = String::from_utf8(client).unwrap();
    assert!(text.ends_with(
        "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n"
    ));
    assert_eq!(text.matches("[DONE]").count(), 1, "nothing after the cut");
    assert!(!text.contains("\"stop\""));
    let delivered = 4 * text.matches("abcd").count() as u64;
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.stats(0).cuts, 1);
    assert_eq!(
        quota.stats(0).settled - settled_before,
        input + delivered,
        "the input bound (OpenAI reports none before its end) and the delivered output"
    );
    // The lease held 200 at most (the budget over 2 × 1 holder), less the
    // first request's 2: the last word went one draw past it.
    assert!(input + delivered <= 200 + 4, "{input} + {delivered}");
    assert_eq!(
        gw.host.properties.get(internal::CUT_USAGE_PROPERTY),
        Some(&format!("{input} {delivered} 0 0").into_bytes()),
        "metering's record is what was billed"
    );
    drop(quota);
    // Gone after its log (the refill it asked for is asked again).
    drop(stream);
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(gw.counter("daily") as u64, 2 + input + delivered);
}

#[test]
fn a_wait_for_the_grant_is_said_where_the_host_would_cut_a_later_filters_new_body() {
    // ngx_wasm_module's separate filters cut a body replaced after
    // another filter paused the body step (metering's `include_usage`
    // after quota's wait): there the wait is published for them.
    for (platform, said) in [
        (zerolayer_host::Platform::Envoy, false),
        (zerolayer_host::Platform::NgxWasm, true),
    ] {
        let mut gw = Gateway::new(&daily(100_000));
        gw.host.platform = platform;
        assert_eq!(gw.answer_store(), 2);
        let mut stream = gw.open(OPENAI, ACME, &[]);
        let _ = stream.request_headers(&mut gw.host, false);
        gw.host.request_body = CHAT.as_bytes().to_vec();
        let action = stream.request_body(&mut gw.host, CHAT.len(), true);
        assert_eq!(action, Action::Pause, "waits for its grant");
        assert_eq!(
            gw.host
                .properties
                .contains_key(internal::BODY_WAITED_PROPERTY),
            said,
            "{platform:?}"
        );
    }
}

#[test]
fn in_ngx_wasm_module_a_cut_streams_later_chunks_become_sse_comments_never_empty() {
    // That host drops an emptied chunk with the response's end (and under
    // buffered proxying spins): each withheld chunk is a comment there.
    let mut gw = Gateway::new(&hard(400, "enforce"));
    gw.warm();
    let (mut stream, _) = gw.ask(OPENAI, ACME, STREAM_CHAT);
    gw.host.platform = zerolayer_host::Platform::NgxWasm;
    let client = gw.stream(&mut stream, &openai_events(500), 37);
    let text = String::from_utf8(client).unwrap();
    let (kept, withheld) = text.split_once("data: [DONE]\n\n").unwrap();
    assert!(kept.contains("\"finish_reason\":\"length\""));
    assert!(!withheld.is_empty(), "chunks followed the cut");
    assert_eq!(
        withheld.replace(":\n\n", ""),
        "",
        "only comments after [DONE]"
    );
}

#[test]
fn a_hard_anthropic_stream_ends_with_max_tokens_and_its_reported_input() {
    let mut gw = Gateway::new(&hard(400, "enforce"));
    gw.warm();
    let (mut stream, _) = gw.ask(ANTHROPIC, ACME, STREAM_MESSAGES);
    let client = gw.stream(&mut stream, &anthropic_events(500), 50);
    let text = String::from_utf8(client).unwrap();
    let delivered = 1 + 4 * text.matches("abcd").count() as u64;
    assert!(
        text.ends_with(&format!(
            "event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":0}}\n\n\
             event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null}},\"usage\":{{\"input_tokens\":6,\"output_tokens\":{delivered}}}}}\n\n\
             event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
        )),
        "{}",
        &text[text.len() - 400..]
    );
    assert_eq!(text.matches("event: message_stop").count(), 1);
    drop(stream);
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    // Billed its reported input, not the body's bound.
    assert_eq!(gw.counter("daily") as u64, 2 + 6 + delivered);
}

#[test]
fn a_shadow_hard_policy_never_cuts_and_a_stream_within_its_lease_is_untouched() {
    for (mode, words) in [("shadow", 500), ("enforce", 10)] {
        let mut gw = Gateway::new(&hard(400, mode));
        gw.warm();
        let (mut stream, _) = gw.ask(OPENAI, ACME, STREAM_CHAT);
        let events = openai_events(words);
        let client = gw.stream(&mut stream, &events, 64);
        assert_eq!(client, events, "{mode}");
        let quota = gw.root.quota().unwrap();
        assert_eq!(quota.stats(0).cuts, 0);
        assert!(
            !gw.host
                .properties
                .contains_key(internal::CUT_USAGE_PROPERTY)
        );
    }
}

#[test]
fn a_non_streamed_response_of_a_hard_policy_is_not_cut() {
    let mut gw = Gateway::new(&hard(400, "enforce"));
    gw.warm();
    let (mut stream, _) = gw.ask(OPENAI, ACME, CHAT);
    gw.answer(
        &mut stream,
        json!({"prompt_tokens": 3, "completion_tokens": 4}),
    );
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.stats(0).cuts, 0);
}

#[test]
fn the_last_callback_metering_already_recorded_is_not_cut() {
    let mut gw = Gateway::new(&hard(400, "enforce"));
    gw.warm();
    let (mut stream, _) = gw.ask(OPENAI, ACME, STREAM_CHAT);
    // The whole response in one callback, which metering recorded first.
    gw.host.properties.insert(
        internal::USAGE_PROPERTY.into(),
        br#"{"input_tokens":5}"#.to_vec(),
    );
    let events = openai_events(500);
    let client = gw.stream(&mut stream, &events, events.len());
    assert_eq!(client, events);
}

#[test]
fn a_hard_stream_refills_its_lease_as_it_goes_and_is_cut_at_the_budget() {
    // Leases of at most 5 % of a 10,000-token budget (500); a stream of
    // 3,000 four-byte words (12,000 bytes of text) with no tick during it.
    let mut config = daily(10_000);
    config["defaults"] = json!({"stream": "hard"});
    let mut gw = Gateway::new(&config);
    gw.warm();
    let (mut stream, _) = gw.ask(OPENAI, ACME, STREAM_CHAT);
    let input = STREAM_CHAT.len() as u64;
    let client = gw.stream_answered(&mut stream, &openai_events(3_000), 64);
    let text = String::from_utf8(client).unwrap();
    let delivered = 4 * text.matches("abcd").count() as u64;
    assert!(text.ends_with("data: [DONE]\n\n"));
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.stats(0).cuts, 1);
    // The stream asked for its refills itself, from the response, and was
    // cut within a lease's last sliver of the budget (2 went to `warm`).
    assert!(quota.stats(0).refills > 5, "{:?}", quota.stats(0));
    let billed = input + delivered;
    assert!(
        (10_000 - 500..=10_000 - 2 + 4).contains(&billed),
        "billed {billed} of 10,000"
    );
    assert_eq!(quota.store_unreachable(), 0);
    drop(quota);

    // Its refills unanswered (a store that answers only ticks), the same
    // stream is cut where its first lease runs dry; a refill still out
    // when the stream goes is asked again, not counted as the store's.
    let mut gw = Gateway::new(&config);
    gw.warm();
    let (mut stream, _) = gw.ask(OPENAI, ACME, STREAM_CHAT);
    let client = gw.stream(&mut stream, &openai_events(3_000), 64);
    let delivered = 4 * String::from_utf8(client).unwrap().matches("abcd").count() as u64;
    assert!(input + delivered <= 500 + 4, "{input} + {delivered}");
    assert!(!gw.host.dispatched.is_empty(), "a refill was asked");
    drop(stream);
    gw.host.dispatched.clear();
    gw.sync();
    let quota = gw.root.quota().unwrap();
    assert_eq!(quota.store_unreachable(), 0);
    drop(quota);
    gw.host.advance(Duration::from_millis(61_000));
    gw.sync();
    assert_eq!(gw.counter("daily") as u64, 2 + input + delivered);
}

mod network;
