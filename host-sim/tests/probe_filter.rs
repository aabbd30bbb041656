//! host-sim's test API on the probe filter: explicit callout completion,
//! virtual time, singleton queues, iteration rules. (The probe is built by
//! `cargo xtask build-wasm`.)

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim::{CallResponse, ClusterTarget, Host, HostOptions, PluginSpec, Profile};

fn probe_wasm() -> Result<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/wasm32-wasip1/wasm/zerolayer_probe.wasm");
    if !path.is_file() {
        bail!(
            "{} is missing: run `cargo xtask build-wasm`",
            path.display()
        );
    }
    Ok(path)
}

fn filter(config: &str) -> Result<PluginSpec> {
    Ok(PluginSpec::new("probe", probe_wasm()?)
        .vm_id("probe.filter")
        .configuration(config))
}

fn singleton(tick_ms: u32) -> Result<PluginSpec> {
    Ok(PluginSpec::new("probe.singleton", probe_wasm()?)
        .vm_id("probe.singleton")
        .configuration(format!(r#"{{"role":"singleton","tick_ms":{tick_ms}}}"#)))
}

const GET: [(&str, &str); 3] = [
    (":method", "GET"),
    (":path", "/probe"),
    (":authority", "gw"),
];

fn with_action(action: &str) -> Vec<(&str, &str)> {
    let mut h = GET.to_vec();
    h.push(("x-probe-action", action));
    h
}

#[test]
fn a_callout_holds_the_request_until_the_test_answers_it() -> Result<()> {
    let mut host = Host::new()?;
    host.set_cluster("probe_upstream", ClusterTarget::Manual);
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    let mut s = host.stream(chain)?;
    s.request_headers(&with_action("callout"), true);
    assert!(
        s.upstream().headers.is_none(),
        "request went on before the callout returned"
    );
    let callouts = s.host().callouts();
    assert_eq!(callouts.len(), 1);
    assert_eq!(callouts[0].cluster, "probe_upstream");
    assert_eq!(callouts[0].header(":path"), Some("/probe-callout"));
    s.host()
        .respond(callouts[0].token, CallResponse::new(201, "hello"))?;
    let upstream = s.upstream();
    assert!(upstream.complete);
    assert_eq!(upstream.header("x-probe-callout-status"), Some("201"));
    assert_eq!(upstream.header("x-probe-callout-body-bytes"), Some("5"));
    Ok(())
}

#[test]
fn a_callout_times_out_on_virtual_time() -> Result<()> {
    let mut host = Host::new()?;
    host.set_cluster("probe_upstream", ClusterTarget::Manual);
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    let id = {
        let mut s = host.stream(chain)?;
        s.request_headers(&with_action("callout"), true);
        s.id()
    };
    host.advance(Duration::from_millis(4999));
    assert_eq!(host.callouts().len(), 1, "timed out early");
    host.advance(Duration::from_millis(1));
    assert!(host.callouts().is_empty());
    let _ = id;
    Ok(())
}

#[test]
fn paused_headers_hold_the_body_until_the_filter_resumes() -> Result<()> {
    let mut host = Host::new()?;
    host.set_cluster("probe_upstream", ClusterTarget::Manual);
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    let mut s = host.stream(chain)?;
    let mut headers = with_action("callout");
    headers[0] = (":method", "POST");
    s.request_headers(&headers, false);
    s.request_body(&[b'a'; 1000], false);
    s.request_body(&[b'b'; 500], true);
    assert!(s.upstream().headers.is_none());
    let token = s.host().callouts().first().context("callout")?.token;
    s.host().respond(token, CallResponse::new(200, ""))?;
    let upstream = s.upstream();
    assert!(upstream.complete, "{upstream:?}");
    assert_eq!(upstream.body.len(), 1500);
    Ok(())
}

#[test]
fn the_singleton_drains_its_queue_under_envoy_and_resolving_it_kills_the_vm_under_kong()
-> Result<()> {
    for profile in [Profile::Envoy, Profile::Kong] {
        let mut host = Host::with_options(HostOptions {
            profile,
            kong_queues: vec!["probe-jobs".into()],
            ..Default::default()
        })?;
        host.add_singleton(singleton(500)?)?;
        let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
        let mut s = host.stream(chain)?;
        s.request_headers(&with_action("enqueue"), true);
        s.response_headers(&[(":status", "200")], true);
        match profile {
            Profile::Envoy => {
                assert_eq!(s.client().header("x-probe-enqueued"), Some("ok"));
                // Delivered by on_queue_ready, right after the enqueue.
                assert_eq!(host.metric("probe_queue_items"), Some(1));
            }
            Profile::Kong => {
                // ngx_wasm_module has no resolve_shared_queue; the SDK panics
                // on its status and the instance traps: nginx's 500 (the
                // next request gets a fresh instance). This is why
                // zerolayer's observer is reached through a queue the filter
                // registers itself and drained on tick where Kong runs it.
                assert_eq!(s.client().status(), Some(500));
                assert_eq!(host.failed_vms().len(), 1);
            }
        }
    }
    Ok(())
}

#[test]
fn ticks_follow_virtual_time() -> Result<()> {
    let mut host = Host::new()?;
    host.add_singleton(singleton(500)?)?;
    host.advance(Duration::from_millis(2100));
    assert_eq!(host.metric("probe_singleton_ticks"), Some(4));
    Ok(())
}

#[test]
fn shared_data_cas_is_observable() -> Result<()> {
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    for want in ["1", "2"] {
        let mut s = host.stream(chain)?;
        s.request_headers(&with_action("shared-incr,cas-stale"), true);
        s.response_headers(&[(":status", "200")], true);
        assert_eq!(s.client().header("x-probe-counter"), Some(want));
        assert_eq!(s.client().header("x-probe-cas"), Some("ok,mismatch"));
    }
    let (value, _) = host
        .shared_data("probe.filter", "probe_counter")
        .context("counter")?;
    assert_eq!(value, b"2");
    Ok(())
}

#[test]
fn host_calls_are_counted_by_plugin_and_function_while_counting_is_on() -> Result<()> {
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    let calls =
        |host: &mut Host, action: Option<&str>| -> Result<Vec<(String, &'static str, u64)>> {
            host.count_host_calls(true);
            let mut s = host.stream(chain)?;
            let headers = action.map_or_else(|| GET.to_vec(), with_action);
            s.request_headers(&headers, true);
            s.response_headers(&[(":status", "200")], true);
            Ok(host.host_calls())
        };
    let count = |calls: &[(String, &'static str, u64)], name: &str| -> u64 {
        calls
            .iter()
            .filter(|(plugin, f, _)| plugin == "probe" && *f == name)
            .map(|(_, _, n)| n)
            .sum()
    };
    let plain = calls(&mut host, None)?;
    // The probe reads its action header on request and response headers.
    assert_eq!(count(&plain, "proxy_get_header_map_value"), 2, "{plain:?}");
    assert_eq!(count(&plain, "proxy_increment_metric"), 1, "{plain:?}");
    assert_eq!(count(&plain, "proxy_get_shared_data"), 0, "{plain:?}");
    let shared = calls(&mut host, Some("shared-incr"))?;
    assert_eq!(
        count(&shared, "proxy_get_header_map_value"),
        2,
        "{shared:?}"
    );
    assert!(count(&shared, "proxy_get_shared_data") >= 1, "{shared:?}");
    assert!(count(&shared, "proxy_set_shared_data") >= 1, "{shared:?}");
    // Off: nothing is counted, and what was is gone.
    host.count_host_calls(false);
    let mut s = host.stream(chain)?;
    s.request_headers(&GET, true);
    assert!(host.host_calls().is_empty());
    Ok(())
}

#[test]
fn the_trivial_role_adds_two_request_headers_and_nothing_else() -> Result<()> {
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![
        PluginSpec::new("trivial", probe_wasm()?).configuration(r#"{"role":"trivial"}"#),
    ])?;
    host.count_host_calls(true);
    let mut s = host.stream(chain)?;
    s.request_headers(&with_action("shared-incr"), true);
    s.response_headers(&[(":status", "200")], true);
    let upstream = s.upstream();
    assert_eq!(upstream.header("x-trivial-1"), Some("1"));
    assert_eq!(upstream.header("x-trivial-2"), Some("2"));
    // No action runs (the header is ignored), nothing reaches the client.
    assert_eq!(s.client().header("x-probe-counter"), None);
    assert_eq!(s.client().header("x-probe-upstream-status"), None);
    let calls: Vec<(&str, u64)> = host
        .host_calls()
        .iter()
        .filter(|(plugin, _, _)| plugin == "trivial")
        .map(|(_, f, n)| (*f, *n))
        .collect();
    assert_eq!(calls, [("proxy_add_header_map_value", 2)]);
    Ok(())
}

#[test]
fn a_body_buffered_past_envoys_limit_gets_413_unless_the_limit_is_off() -> Result<()> {
    for (limit, past_limit) in [
        (Some(host_sim::ENVOY_BUFFER_LIMIT), Some(413)),
        (None, Some(200)),
    ] {
        let mut host = Host::with_options(HostOptions {
            buffer_limit_bytes: limit,
            ..Default::default()
        })?;
        let chain = host.add_chain(vec![
            filter(r#"{"role":"filter"}"#)?.allow_on_headers_stop_iteration(true),
        ])?;
        for (size, status) in [
            (host_sim::ENVOY_BUFFER_LIMIT, Some(200)),
            (host_sim::ENVOY_BUFFER_LIMIT + 1, past_limit),
        ] {
            let mut s = host.stream(chain)?;
            s.request_headers(&with_action("body-size"), false);
            // In two pieces: the filter buffers the first (`Pause`).
            let body = vec![b'x'; size];
            s.request_body(&body[..size / 2], false);
            s.request_body(&body[size / 2..], true);
            if s.upstream().complete {
                s.response_headers(&[(":status", "200")], true);
            }
            assert_eq!(s.client().status(), status, "limit {limit:?}, {size} bytes");
        }
    }
    Ok(())
}

#[test]
fn a_grpc_client_gets_envoys_grpc_form_of_a_local_response() -> Result<()> {
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![filter(r#"{"role":"filter"}"#)?])?;
    let mut s = host.stream(chain)?;
    let mut headers = with_action("local-403");
    headers.push(("content-type", "application/grpc"));
    s.request_headers(&headers, true);
    let client = s.client();
    assert_eq!(client.status(), Some(200));
    assert_eq!(client.header("grpc-status"), Some("7"));
    assert_eq!(client.header("content-type"), Some("application/grpc"));
    assert!(client.body.is_empty());
    Ok(())
}
