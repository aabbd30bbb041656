//! [`PipelineHost`], the host of the fused filter and of the native module,
//! over the recording fake: what it keeps for the stages of a stream (header
//! maps, the callback's body, hand-offs, a request body held for ngx_wasm_module)
//! and what the stages' roots did to streams.

use std::time::Duration;

use zerolayer_host::{
    Body, Callback, FakeHost, Headers, Host, LocalResponse, PipelineHost, PipelineRoots, Platform,
    Respond, RootHost, StageHost, Status, StreamHost, Wake,
};

fn stream(fake: FakeHost) -> PipelineHost<FakeHost> {
    PipelineHost::stream(fake)
}

fn request() -> FakeHost {
    FakeHost::with_request(&[
        (":path", "/v1/chat/completions"),
        ("authorization", "Bearer k"),
    ])
}

#[test]
fn a_header_map_is_read_once_for_every_stage_and_sees_their_changes() {
    let mut host = stream(request());
    host.read_headers(Headers::Request);
    assert_eq!(host.proxy_ref().map_reads, 1);
    for _ in 0..3 {
        assert_eq!(
            host.request_header(":path").as_deref(),
            Some(&b"/v1/chat/completions"[..])
        );
        host.with_headers(Headers::Request, |h| assert_eq!(h.iter().count(), 2));
    }
    assert_eq!(host.proxy_ref().map_reads, 1, "served from the copy");

    host.set_request_header("x-tenant", b"acme");
    assert_eq!(
        host.request_header("x-tenant").as_deref(),
        Some(&b"acme"[..])
    );
    assert_eq!(
        host.proxy_ref().request_header_value("x-tenant").as_deref(),
        Some("acme"),
        "and the proxy has it"
    );
    assert!(host.remove_header(Headers::Request, "authorization"));
    assert_eq!(host.request_header("authorization"), None);
    assert_eq!(host.proxy_ref().request_header_value("authorization"), None);
    assert!(
        !host.remove_header(Headers::Request, "absent"),
        "nothing to remove: the copy says so without asking the proxy"
    );
}

#[test]
fn the_clock_is_read_once_per_callback_and_afresh_after() {
    let mut host = stream(request());
    let start = host.now_ms();
    host.proxy().advance(Duration::from_millis(40));
    assert_eq!(host.now_ms(), start, "one reading serves the callback");
    assert_eq!(host.now_us(), start * 1000);
    host.begin_callback();
    assert_eq!(host.now_ms(), start + 40, "a new callback reads it again");
    host.proxy().advance(Duration::from_millis(250));
    host.refresh_clock();
    assert_eq!(
        host.now_ms(),
        start + 290,
        "so do stages a root resumes outside the stream's callbacks"
    );
}

#[test]
fn without_a_copy_header_reads_go_to_the_proxy() {
    let mut host = stream(request());
    assert_eq!(
        host.request_header("authorization").as_deref(),
        Some(&b"Bearer k"[..])
    );
    assert_eq!(host.proxy_ref().map_reads, 0);
    assert_eq!(host.response_header("content-type"), None);
}

#[test]
fn a_callbacks_body_is_read_once_until_the_next_callback_or_a_change() {
    let mut fake = request();
    fake.request_body = b"{\"model\":\"m\"}".to_vec();
    let mut host = stream(fake);
    let size = 13;
    for _ in 0..3 {
        let first = host.with_body(Body::Request, size, |b| b.first().copied());
        assert_eq!(first, Some(b'{'));
    }
    assert_eq!(host.proxy_ref().body_reads, 1);
    assert_eq!(host.with_body(Body::Request, 4, <[u8]>::to_vec), b"{\"mo");

    host.begin_callback();
    host.proxy().request_body = b"{\"model\":\"n\"}".to_vec();
    let now = host.with_body(Body::Request, size, <[u8]>::to_vec);
    assert_eq!(
        now, b"{\"model\":\"n\"}",
        "a new callback reads the new chunk"
    );
    assert_eq!(host.proxy_ref().body_reads, 2);

    assert_eq!(host.set_body(Body::Request, size, b"{}"), Ok(()));
    assert_eq!(host.with_body(Body::Request, 2, <[u8]>::to_vec), b"{}");
    assert_eq!(
        host.proxy_ref().body_reads,
        3,
        "a changed body is read again"
    );
}

#[test]
fn hand_offs_are_served_to_the_stages_after_and_reach_the_proxy() {
    let mut host = stream(request());
    host.publish("wasmx.zerolayer_auth", b"tenant=acme");
    host.publish("wasmx.zerolayer_auth", b"tenant=globex");
    assert_eq!(
        host.property("wasmx.zerolayer_auth").as_deref(),
        Some(&b"tenant=globex"[..])
    );
    assert_eq!(
        host.proxy_ref()
            .properties
            .get("wasmx.zerolayer_auth")
            .map(Vec::as_slice),
        Some(&b"tenant=globex"[..])
    );
}

#[test]
fn ngx_wasm_keeps_a_paused_request_body_for_the_stages_after_the_callout() {
    let mut fake = request();
    fake.platform = Platform::NgxWasm;
    fake.request_body = b"{\"model\":\"m\"}".to_vec();
    let mut host = stream(fake);
    host.hold_request_body(13);
    // From a callout's answer the host hands no body over.
    host.proxy().request_body.clear();
    host.begin_callback();
    assert_eq!(
        host.with_body(Body::Request, 13, <[u8]>::to_vec),
        b"{\"model\":\"m\"}"
    );
    assert_eq!(
        host.set_body(Body::Request, 13, b"{}"),
        Err(Status::BadArgument)
    );

    let mut fake = request();
    fake.request_body = b"abc".to_vec();
    let mut envoy = stream(fake);
    envoy.hold_request_body(3);
    envoy.proxy().request_body = b"xyz".to_vec();
    envoy.begin_callback();
    assert_eq!(
        envoy.with_body(Body::Request, 3, <[u8]>::to_vec),
        b"xyz",
        "Envoy hands the body over anywhere: nothing is held"
    );
}

#[test]
fn a_stream_records_resumes_answers_and_what_a_stage_is_done_with() {
    let mut host = stream(request());
    assert!(!host.answered());
    host.resume();
    assert!(host.take_resumed());
    assert!(!host.take_resumed(), "taken once");
    assert!(
        host.proxy_ref().resumes.is_empty(),
        "no stage continues the stream itself"
    );

    host.done_with(Callback::ResponseBody);
    let done = host.take_done();
    assert!(done.contains(Callback::ResponseBody));
    assert!(!done.contains(Callback::RequestBody));
    assert!(!host.take_done().contains(Callback::ResponseBody));

    assert_eq!(
        host.send_local_response(401, &[("x-a", "b")], b"no"),
        Ok(())
    );
    assert!(host.answered());
    assert_eq!(host.proxy_ref().sent.len(), 1, "sent through the proxy");
    assert_eq!(
        host.set_tick_period(Duration::from_secs(1)),
        Err(Status::BadArgument)
    );
    assert!(host.fused());
}

#[test]
fn roots_record_what_they_did_to_each_stream_in_order() {
    let mut host = PipelineRoots::new(FakeHost::default());
    assert_eq!(
        host.send_local_response(200, &[], b""),
        Err(Status::NotFound)
    );
    host.resume();
    assert!(
        host.take_woken().is_empty(),
        "no stream made effective: nothing to wake"
    );

    assert_eq!(host.set_effective_context(7), Ok(()));
    host.resume();
    assert_eq!(host.set_effective_context(9), Ok(()));
    assert_eq!(
        host.send_local_response(200, &[("x-cache", "HIT")], b"{}"),
        Ok(())
    );
    assert!(
        host.proxy().sent.is_empty(),
        "answered through the chain's root"
    );
    assert_eq!(
        host.take_woken(),
        vec![
            (7, Wake::Resume),
            (
                9,
                Wake::Answer(LocalResponse::new(200, &[("x-cache", "HIT")], b"{}"))
            ),
        ]
    );
    assert!(host.take_woken().is_empty());

    host.leave_stream();
    host.resume();
    assert!(host.take_woken().is_empty(), "left: no stream is effective");

    assert_eq!(host.set_tick_period(Duration::from_millis(200)), Ok(()));
    assert_eq!(host.take_tick(), Some(Duration::from_millis(200)));
    assert_eq!(host.take_tick(), None);
}

#[test]
fn a_replaced_body_is_handed_to_the_next_stage_at_its_new_length() {
    let mut fake = request();
    fake.response_body = Vec::new();
    let mut host = stream(fake);
    host.begin_callback();
    // The last chunk of a stream, empty: a stage releases what it held.
    assert_eq!(host.body_size_after(Body::Response, 0), 0);
    assert_eq!(
        host.set_body(Body::Response, 0, b"data: [DONE]\n\n"),
        Ok(())
    );
    let size = host.body_size_after(Body::Response, 0);
    assert_eq!(size, 14, "the next stage reads what was put there");
    assert_eq!(
        host.with_body(Body::Response, size, <[u8]>::to_vec),
        b"data: [DONE]\n\n"
    );
    assert_eq!(
        host.body_size_after(Body::Request, 7),
        7,
        "the other body is as it came"
    );
    host.begin_callback();
    assert_eq!(host.body_size_after(Body::Response, 3), 3, "a new chunk");
}

#[test]
fn the_requests_api_is_worked_out_once_until_its_path_changes() {
    use zerolayer_core::cache::key::Provider;
    let mut host = stream(request());
    assert_eq!(host.provider(), Some(Provider::OpenAi));
    // Changed behind the chain's back: still the one worked out.
    host.proxy().request_headers = vec![(":path".into(), b"/v1/messages".to_vec())];
    assert_eq!(host.provider(), Some(Provider::OpenAi), "worked out once");
    // A stage that sets the path, or a new header map, is seen.
    host.set_request_header(":path", b"/v1/messages");
    assert_eq!(host.provider(), Some(Provider::Anthropic));
    host.proxy().request_headers = vec![(":path".into(), b"/healthz".to_vec())];
    host.read_headers(Headers::Request);
    assert_eq!(host.provider(), None);
}

#[test]
fn the_published_identity_is_parsed_once_until_it_is_published_again() {
    use zerolayer_core::auth::identity::Published;
    let tenant = |host: &mut PipelineHost<FakeHost>| {
        host.with_identity(|p| p.identity().and_then(|id| id.tenant.clone()))
    };
    let mut host = stream(request());
    assert!(host.with_identity(|p| *p == Published::Nothing));
    // Set beneath the chain without it knowing: the parse it kept stands
    // (the stages of one stream read it once).
    host.proxy().properties.insert(
        "wasmx.zerolayer_auth".into(),
        b"verified tenant=acme".to_vec(),
    );
    assert_eq!(tenant(&mut host), None, "kept: parsed once");

    host.publish("wasmx.zerolayer_auth", b"verified tenant=acme");
    assert_eq!(tenant(&mut host).as_deref(), Some("acme"));
    host.publish("wasmx.zerolayer_auth", b"unverified tenant=globex");
    assert_eq!(
        tenant(&mut host).as_deref(),
        Some("globex"),
        "published again: parsed again"
    );
    assert!(host.with_identity(|p| p.identity().is_some_and(|id| id.state == "unverified")));
    host.publish("wasmx.zerolayer_auth", b"garbage");
    assert!(host.with_identity(|p| *p == Published::Malformed));

    let mut host = stream(request());
    assert!(host.with_identity(|p| *p == Published::Nothing));
    assert!(
        host.set_property("wasmx.zerolayer_auth", b"public").is_ok()
            && host.with_identity(|p| p.identity().is_some_and(|id| id.state == "public")),
        "set as a property: parsed again"
    );
}
