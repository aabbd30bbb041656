//! `host-sim replay`: recorded traffic through the shipped chain
//! (`envoy/zerolayer.yaml`) against the backend stub, with the identity
//! services on loopback and the usage sink captured; per-request results,
//! the summary, and the HTML report.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Result;
use host_sim_tools::config_file::ChainFile;
use host_sim_tools::replay::{self, ReplayOptions, Upstream};
use host_sim_tools::traffic::TrafficRecord;
use zerolayer_core::sampling;
use zerolayer_e2e::chain::{
    AuthServices, GOOD_API_KEY, anthropic, host_sim_chain, introspect, openai,
};

/// The shipped chain with the test's cache secret and a 50% usage sample.
fn chain() -> Result<ChainFile> {
    host_sim_chain(50.0)
}

fn request(
    at_ms: f64,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> TrafficRecord {
    let mut all: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if body.is_some() {
        all.push(("content-type".into(), "application/json".into()));
    }
    TrafficRecord {
        at_ms,
        method: if body.is_some() { "POST" } else { "GET" }.into(),
        path: path.into(),
        headers: all,
        body,
        body_base64: None,
        response: None,
    }
}

/// 60 requests over about 1.2 s: one repeated Anthropic prompt (cache
/// hits), distinct OpenAI streams, two tenants' keys, an unknown key, no
/// credentials, and the public health path.
fn traffic() -> Vec<TrafficRecord> {
    let mut out = Vec::new();
    for i in 0..60 {
        let at = f64::from(i) * 20.0;
        let key = [("x-api-key", GOOD_API_KEY)];
        out.push(match i % 6 {
            0 | 1 => request(
                at,
                "/v1/messages",
                &key,
                Some(anthropic("the same question", false)),
            ),
            2 => request(
                at,
                "/v1/chat/completions",
                &key,
                Some(openai(&format!("stream {i}"), true)),
            ),
            3 => request(
                at,
                "/v1/messages",
                &[("x-api-key", "sk-unknown")],
                Some(anthropic(&format!("probe {i}"), false)),
            ),
            4 => request(at, "/v1/messages", &[], Some(anthropic("anonymous", false))),
            _ => request(at, "/healthz", &[], None),
        });
    }
    out
}

#[test]
fn replay_reports_decisions_auth_cache_usage_and_filter_times() -> Result<()> {
    let services = AuthServices::start(introspect)?;
    let mut options = ReplayOptions::new(chain()?, traffic());
    options.upstream = Upstream::Stub(Default::default());
    options.concurrency = 8;
    options.clusters = vec![
        ("idp".into(), services.idp.addr()),
        ("api_keys".into(), services.api_keys.addr()),
    ];
    options.capture = vec!["clickhouse".into(), "audit".into()];
    options.sink_wait = Duration::from_secs(20);
    let replay = replay::run(options)?;
    let requests = &replay.requests;
    assert_eq!(requests.len(), 60);
    assert!(replay.notes.is_empty(), "{:?}", replay.notes);
    let of = |kind: usize| requests.iter().filter(move |r| r.seq % 6 == kind);

    // Good key: admitted at once (unverified: no tenant, no cache) until its
    // verdict lands, then verified as globex's. A cache hit never reaches
    // metering (post-cache answers before it): no tokens were spent.
    for r in of(0).chain(of(1)).chain(of(2)) {
        assert_eq!(r.status, 200, "{r:?}");
        if r.cache.as_deref() == Some("HIT") {
            assert!(r.usage.is_none(), "{r:?}");
            continue;
        }
        let Some(usage) = r.usage.as_ref() else {
            panic!("not metered: {r:?}");
        };
        match r.auth.as_str() {
            "verified" => assert_eq!(usage["tenant"], "globex", "{r:?}"),
            "unverified" => assert_eq!(r.cache.as_deref(), Some("BYPASS"), "{r:?}"),
            other => panic!("auth {other}: {r:?}"),
        }
    }
    // The repeated prompt, once verified: the backend answers it once, the
    // cache the rest.
    let repeated: Vec<_> = of(0)
        .chain(of(1))
        .filter(|r| r.auth == "verified")
        .collect();
    assert!(repeated.len() >= 16, "{} verified of 20", repeated.len());
    let hits = repeated
        .iter()
        .filter(|r| r.cache.as_deref() == Some("HIT"))
        .count();
    assert!(
        hits >= repeated.len() - 2,
        "{hits} hits of {}",
        repeated.len()
    );
    for r in &repeated {
        match r.cache.as_deref() {
            Some("HIT") => assert_eq!(r.upstream_ms, None, "a hit never goes upstream: {r:?}"),
            Some("MISS") => assert!(r.upstream_ms.is_some(), "{r:?}"),
            other => panic!("cache {other:?}: {r:?}"),
        }
    }
    // The unknown key: one request admitted lazily, refused once verified.
    let unknown: Vec<_> = of(3).collect();
    assert!(unknown.iter().filter(|r| r.status == 401).count() >= unknown.len() - 1);
    assert!(
        unknown
            .iter()
            .filter(|r| r.status == 401)
            .all(|r| r.auth == "rejected")
    );
    for r in of(4) {
        assert_eq!(
            (r.status, r.auth.as_str(), r.local_reply),
            (401, "rejected", true),
            "{r:?}"
        );
        assert!(r.wasm.len() == 4 && r.upstream_ms.is_none(), "{r:?}");
    }
    for r in of(5) {
        assert_eq!(r.auth, "public", "{r:?}");
    }
    // Every request timed and baselined; activation (after lazy-auth)
    // decided every request lazy-auth let through, and only those.
    let filters: Vec<&str> = requests[0].wasm.iter().map(|w| w.filter.as_str()).collect();
    assert_eq!(
        filters,
        [
            "zerolayer.lazy_auth",
            "zerolayer.activation",
            "zerolayer.post_cache",
            "zerolayer.metering"
        ]
    );
    for r in requests {
        let refused = r.auth == "rejected" && r.local_reply;
        assert_eq!(r.decision.is_some(), !refused, "{r:?}");
        assert!(r.wasm.first().is_some_and(|w| w.us > 0.0), "{r:?}");
        if !refused {
            assert!(r.wasm.iter().all(|w| w.us > 0.0), "{r:?}");
        }
        assert!(r.baseline_ms.is_some() && r.latency_ms > 0.0, "{r:?}");
    }
    // The arrival schedule was kept: request 59 left about 1.18 s in.
    assert!(requests[59].sent_ms >= 1180.0, "{}", requests[59].sent_ms);

    // The shipped records are exactly the hash sample of the metered
    // requests plus the premium tenants' (the shipped rule `premium_tenants`
    // turns activation's `metering` observer on for acme and globex once
    // lazy-auth verified them: full records weighing 0 in the estimate),
    // and the estimate is what the weights say.
    let metered: Vec<_> = requests.iter().filter(|r| r.usage.is_some()).collect();
    let premium = |r: &&_| {
        let r: &host_sim_tools::replay::RequestResult = r;
        r.usage
            .as_ref()
            .and_then(|u| u["tenant"].as_str())
            .is_some_and(|t| matches!(t, "acme" | "globex"))
    };
    let expected: HashSet<&str> = metered
        .iter()
        .filter(|r| sampling::bucket(r.request_id.as_bytes()) < 5000 || premium(r))
        .map(|r| r.request_id.as_str())
        .collect();
    let shipped: HashSet<&str> = replay
        .sample
        .iter()
        .map(|s| s.request_id.as_str())
        .collect();
    assert_eq!(shipped, expected);
    assert!(!expected.is_empty() && expected.len() < metered.len());
    let comparison = replay.usage_comparison();
    let truth: u64 = comparison.iter().map(|c| c.truth_tokens).sum();
    let from_results: u64 = metered
        .iter()
        .map(|r| {
            let u = r.usage.as_ref().unwrap();
            u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()
        })
        .sum();
    assert_eq!(truth, from_results);
    let estimate: f64 = comparison.iter().map(|c| c.estimate_tokens).sum();
    let weighted: f64 = replay
        .sample
        .iter()
        .map(|s| s.sample_weight * (s.tokens.input + s.tokens.output) as f64)
        .sum();
    assert_eq!(estimate, weighted);
    // In the 50 % sample a record weighs 2; a forced one outside it 0.
    for s in &replay.sample {
        let want = if sampling::bucket(s.request_id.as_bytes()) < 5000 {
            2.0
        } else {
            0.0
        };
        assert_eq!(s.sample_weight, want, "{}", s.request_id);
    }

    let summary = replay.summary();
    for needle in [
        "replay: 60 requests",
        "with chain",
        "without",
        "zerolayer.metering",
        "hit rate",
        "usage",
    ] {
        assert!(
            summary.contains(needle),
            "{needle:?} missing from:\n{summary}"
        );
    }
    Ok(())
}

#[test]
fn recorded_responses_replay_without_a_backend_and_bad_input_is_refused() -> Result<()> {
    let mut records = traffic();
    records.truncate(6);
    for (i, record) in records.iter_mut().enumerate() {
        record.response = Some(host_sim_tools::traffic::RecordedResponse {
            status: 200 + i as u16,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: Some(format!("recorded {i}")),
            body_base64: None,
        });
    }
    records[5].response = None;
    let mut options = ReplayOptions::new(chain()?, records);
    options.upstream = Upstream::Recorded;
    options.speed = 0.0;
    options.baseline = true;
    let replay = replay::run(options)?;
    // The public path reaches the recorded upstream, which has nothing for it.
    assert_eq!(replay.requests[5].status, 502);
    // Without a credential, the chain answers before the upstream.
    assert_eq!(replay.requests[4].status, 401);
    assert!(replay.requests[4].baseline_ms.is_some());
    // The recorded upstream answers the baseline with record 4's response.
    let direct = replay
        .requests
        .iter()
        .filter(|r| r.baseline_ms.is_some())
        .count();
    assert_eq!(direct, 6);

    let mut bad = ReplayOptions::new(chain()?, traffic());
    bad.capture = vec!["no-such-cluster".into()];
    let err = format!("{:#}", replay::run(bad).unwrap_err());
    assert!(
        err.contains("no-such-cluster") && err.contains("llm_backend"),
        "{err}"
    );
    Ok(())
}

#[test]
fn replay_against_the_real_model_server() -> Result<()> {
    let model = zerolayer_e2e::ModelServer::shared()?;
    let services = AuthServices::start(introspect)?;
    let key = [("x-api-key", GOOD_API_KEY)];
    // The first request of a new key is admitted unverified; the rest wait
    // for nothing (verified by then, or inline).
    let records = vec![
        request(0.0, "/v1/messages", &key, Some(anthropic("Say hi.", false))),
        request(
            300.0,
            "/v1/chat/completions",
            &key,
            Some(openai("Count to three.", true)),
        ),
        request(
            600.0,
            "/v1/messages",
            &key,
            Some(anthropic("Name a colour.", true)),
        ),
    ];
    let mut options = ReplayOptions::new(chain()?, records);
    options.upstream = Upstream::Addr(model.addr());
    options.clusters = vec![
        ("idp".into(), services.idp.addr()),
        ("api_keys".into(), services.api_keys.addr()),
    ];
    options.baseline = false;
    let replay = replay::run(options)?;
    for r in &replay.requests {
        assert_eq!(r.status, 200, "{r:?}\n{}", model.log());
        let usage = r.usage.as_ref().expect("metered");
        assert!(
            usage["output_tokens"].as_u64().is_some_and(|n| n > 0),
            "{r:?}"
        );
        assert!(r.upstream_ms.is_some_and(|ms| ms > 0.0), "{r:?}");
        assert_eq!(r.baseline_ms, None);
    }
    Ok(())
}
