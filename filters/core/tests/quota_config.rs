//! quota's configuration: a full document parses to what it says, and each
//! bad field is refused with an error naming it (table-driven, exact text).

use zerolayer_core::quota::config::{
    CacheHitCharge, Fallback, Limit, Mode, QuotaConfig, ScopeField, StreamMode, Unit,
};
use zerolayer_core::quota::window::{Period, Window};

/// A valid document with `policy` as its only policy and `extra` members
/// at the top level (each starting with a comma).
fn doc(policy: &str, extra: &str) -> String {
    format!(r#"{{"store":{{"cluster":"webdis","path":"/"}},"policies":[{policy}]{extra}}}"#)
}

const TOKENS_DAY: &str = r#"{"name":"daily","scope":["tenant"],"unit":"tokens","limit":{"budget":{"amount":1000,"window":"day"}}}"#;

fn error(json: &str) -> String {
    match QuotaConfig::from_json(json.as_bytes()) {
        Ok(_) => "accepted".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_full_configuration_parses_to_what_it_says() {
    let json = r#"{
        "trusted_headers": ["x-team"],
        "store": {"cluster": "webdis", "path": "/", "key_prefix": "q:", "sync_interval_ms": 250,
                  "lease_ttl_ms": 2000, "expected_gateways": 3, "max_debt": 10,
                  "lease": {"max_percent": 10, "low_watermark_percent": 50}},
        "fallback": "fail_closed",
        "unverified": {"unit": "requests", "limit": {"rate": {"amount": 20, "per": "second"}}},
        "defaults": {"default_max_output_tokens": 1024, "stream": "hard"},
        "policies": [
            {"name": "team-rate", "scope": [{"header": "x-team"}, "model"], "models": ["gpt-4o"], "unit": "tokens",
             "limit": {"rate": {"amount": 100000, "per": "minute"}}, "mode": "shadow"},
            {"name": "spend", "scope": ["tenant"],
             "unit": {"currency": {"models": {"gpt-4o": {"input": 2500000, "output": 10000000, "cache_read": 1250000}},
                                   "default": {"input": 1000000, "output": 1000000, "cache_read": 1000000}}},
             "limit": {"budget": {"amount": 5000000, "window": "month", "utc_offset_minutes": 60}},
             "cache_hit": "free", "default_max_output_tokens": 512, "stream": "soft"},
            {"name": "weighted", "scope": ["subject", "credential", "route"],
             "unit": {"weighted_tokens": {"models": {"big": {"input": 3000, "output": 15000, "cache_read": 300, "cache_write": 3750}}}},
             "limit": {"budget": {"amount": 1000000, "window": "hour"}}}
        ]
    }"#;
    let c = QuotaConfig::from_json(json.as_bytes()).unwrap();
    assert_eq!(c.fallback, Fallback::FailClosed);
    assert_eq!(c.store.sync_interval_ms, 250);
    assert_eq!(c.store.idle_return_ms, 60_000);
    assert_eq!(c.store.max_leases, 4096);
    assert_eq!(c.store.max_buffered_deltas, 1024);
    assert_eq!(c.defaults.stream, StreamMode::Hard);
    assert_eq!(c.defaults.mode, Mode::Enforce);
    assert_eq!(c.defaults.cache_hit, CacheHitCharge::Request);
    let [rate, spend, weighted] = &c.policies[..] else {
        panic!("three policies");
    };
    assert_eq!(
        rate.scope,
        [ScopeField::Header("x-team".into()), ScopeField::Model]
    );
    assert!(matches!(rate.limit, Limit::Rate(r) if r.amount == 100_000 && r.per == Period::Minute));
    assert_eq!(rate.mode, Some(Mode::Shadow));
    let Unit::Currency(prices) = &spend.unit else {
        panic!("currency")
    };
    assert_eq!(prices.models["gpt-4o"].output, 10_000_000);
    assert!(
        matches!(spend.limit, Limit::Budget(b) if b.window == Window::Month && b.utc_offset_minutes == 60)
    );
    let Unit::WeightedTokens(weights) = &weighted.unit else {
        panic!("weighted")
    };
    assert_eq!(weights.default.input, 1000, "plain tokens by default");
    assert_eq!(weights.models["big"].cache_write, Some(3750));
    // The defaults alone.
    let minimal = QuotaConfig::from_json(br#"{"store":{"cluster":"webdis","path":"/"}}"#).unwrap();
    assert_eq!(minimal.fallback, Fallback::LocalShare);
    assert_eq!(minimal.store.sync_interval_ms, 500);
    assert_eq!(minimal.store.max_debt, 0);
    assert_eq!(minimal.store.key_prefix, "zl:quota:");
    assert_eq!(minimal.defaults.default_max_output_tokens, 4096);
    assert!(minimal.policies.is_empty() && minimal.unverified.is_none());
}

#[test]
fn each_bad_field_is_named() {
    let policy = |patch: &str| TOKENS_DAY.replacen('{', &format!("{{{patch},"), 1);
    let with_store =
        |store: &str| format!(r#"{{"store":{{"cluster":"webdis","path":"/",{store}}}}}"#);
    let cases: Vec<(String, &str)> = vec![
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"budget":{"amount":0,"window":"day"}}}"#, ""),
            "policies[0].limit.budget.amount: must be > 0",
        ),
        (
            doc(&format!(r#"{TOKENS_DAY},{{"name":"r","unit":"requests","limit":{{"rate":{{"amount":0,"per":"second"}}}}}}"#), ""),
            "policies[1].limit.rate.amount: must be > 0",
        ),
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"rate":{"amount":3000000000,"per":"hour"}}}"#, ""),
            "policies[0].limit.rate.amount: 3000000000 is more than 2501999792 per hour (the store computes in doubles: amount × period in ms must stay within 2^53)",
        ),
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"budget":{"amount":9007199254740993,"window":"day"}}}"#, ""),
            "policies[0].limit.budget.amount: 9007199254740993 is more than 2^53 (the store computes in doubles)",
        ),
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"budget":{"amount":1,"window":"day","utc_offset_minutes":900}}}"#, ""),
            "policies[0].limit.budget.utc_offset_minutes: 900 is outside -840..=840",
        ),
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"budget":{"amount":1,"window":"week"}}}"#, ""),
            "policies[0].limit.budget.window: unknown variant `week`, expected one of `hour`, `day`, `month` at line 1 column 126",
        ),
        (
            doc(r#"{"name":"p","unit":"tokens","limit":{"window":{"amount":1}}}"#, ""),
            "policies[0].limit: unknown variant `window`, expected `rate` or `budget` at line 1 column 98",
        ),
        (
            doc(&format!("{TOKENS_DAY},{TOKENS_DAY}"), ""),
            "policies[1].name: \"daily\" names an earlier policy too",
        ),
        (
            doc(&policy(r#""name":"has space""#).replacen(r#","name":"daily""#, "", 1), ""),
            "policies[0].name: \"has space\" must be 1 to 64 letters, digits, `_`, `-` or `.`",
        ),
        (
            doc(&TOKENS_DAY.replace("daily", "unverified"), ""),
            "policies[0].name: \"unverified\" is the unverified budget's; choose another name",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["tenant",{"header":"x-team"}]"#), ""),
            "policies[0].scope[1].header: \"x-team\" is not in trusted_headers: a header a client can set would let it choose whose budget it spends",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["tenant","model","tenant"]"#), ""),
            "policies[0].scope[2]: \"tenant\" is named twice",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["team"]"#), ""),
            "policies[0].scope[0]: unknown variant `team`, expected one of `tenant`, `subject`, `credential`, `model`, `route`, `header` at line 1 column 84",
        ),
        (
            doc(&TOKENS_DAY.replace(r#""tokens""#, r#"{"currency":{"models":{}}}"#), ""),
            "policies[0].unit.currency: missing field `default` at line 1 column 120",
        ),
        (
            doc(&TOKENS_DAY.replace(r#""tokens""#, r#"{"weighted_tokens":{"models":{"m":{"input":2000000,"output":1,"cache_read":1}}}}"#), ""),
            "policies[0].unit.weighted_tokens.models.m.input: 2000000 is more than 1000000",
        ),
        (
            doc(&TOKENS_DAY.replace(r#""tokens""#, r#"{"weighted_tokens":{"models":{"":{"input":1,"output":1,"cache_read":1}}}}"#), ""),
            "policies[0].unit.weighted_tokens.models: a model name must not be empty",
        ),
        (
            doc(&policy(r#""default_max_output_tokens":0"#), ""),
            "policies[0].default_max_output_tokens: must be > 0",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["tenant","model"]"#), ""),
            "policies[0].models: required with \"model\" in the scope: list the models counted one by one (any other shares one key); a client names the model, so without a list each made-up name would get a budget of its own",
        ),
        (
            doc(&policy(r#""models":["gpt-4o"]"#), ""),
            "policies[0].models: only with \"model\" in the scope",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["model"],"models":["gpt-4o",""]"#), ""),
            "policies[0].models[1]: \"\" must be 1 to 128 bytes",
        ),
        (
            doc(&TOKENS_DAY.replace(r#"["tenant"]"#, r#"["model"],"models":["gpt-4o","o3","gpt-4o"]"#), ""),
            "policies[0].models[2]: \"gpt-4o\" is listed twice",
        ),
        (
            doc(&policy(r#""stream":"strict""#), ""),
            "policies[0].stream: unknown variant `strict`, expected `soft` or `hard` at line 1 column 71",
        ),
        (
            doc(&policy(r#""mode":"dry_run""#), ""),
            "policies[0].mode: unknown variant `dry_run`, expected `enforce` or `shadow` at line 1 column 70",
        ),
        (
            doc(&policy(r#""limits":1"#), ""),
            "policies[0].limits: unknown field `limits`, expected one of `name`, `scope`, `models`, `unit`, `limit`, `mode`, `cache_hit`, `default_max_output_tokens`, `stream` at line 1 column 62",
        ),
        (
            doc(TOKENS_DAY, r#","trusted_headers":["X-Team"]"#),
            "trusted_headers[0]: not a lowercase header name: \"X-Team\"",
        ),
        (
            doc(TOKENS_DAY, r#","defaults":{"default_max_output_tokens":0}"#),
            "defaults.default_max_output_tokens: must be > 0",
        ),
        (
            doc(TOKENS_DAY, r#","fallback":"fail_soft""#),
            "fallback: unknown variant `fail_soft`, expected one of `local_share`, `fail_open`, `fail_closed` at line 1 column 178",
        ),
        (
            doc(TOKENS_DAY, r#","unverified":{"unit":"requests","limit":{"rate":{"amount":0,"per":"second"}}}"#),
            "unverified.limit.rate.amount: must be > 0",
        ),
        (
            with_store(r#""sync_interval_ms":10"#),
            "store.sync_interval_ms: 10 is outside 50..=60000",
        ),
        (
            with_store(r#""lease_ttl_ms":600"#),
            "store.lease_ttl_ms: 600 must be at least twice sync_interval_ms (500)",
        ),
        (
            with_store(r#""idle_return_ms":1000"#),
            "store.idle_return_ms: 1000 must be at least lease_ttl_ms (5000)",
        ),
        (
            with_store(r#""expected_gateways":0"#),
            "store.expected_gateways: must be at least 1",
        ),
        (
            with_store(r#""lease":{"max_percent":0}"#),
            "store.lease.max_percent: 0 is outside 1..=100",
        ),
        (
            with_store(r#""lease":{"low_watermark_percent":100}"#),
            "store.lease.low_watermark_percent: 100 is outside 0..=99",
        ),
        (
            with_store(r#""key_prefix":"a b""#),
            "store.key_prefix: \"a b\" must be at most 64 letters, digits or `:_-.`",
        ),
        (
            with_store(r#""max_buffered_deltas":0"#),
            "store.max_buffered_deltas: must be at least 1",
        ),
        (
            with_store(r#""max_leases":8"#),
            "store.max_leases: 8 is outside 16..=1048576",
        ),
        (
            r#"{"store":{"cluster":"","path":"/"}}"#.into(),
            "store.cluster: must not be empty",
        ),
        (
            r#"{"store":{"cluster":"webdis","path":"x"}}"#.into(),
            "store.path: \"x\" must start with /",
        ),
        (
            r#"{"policies":[]}"#.into(),
            "configuration: missing field `store` at line 1 column 15",
        ),
    ];
    let mut failures = Vec::new();
    for (json, expected) in &cases {
        let got = error(json);
        if got != *expected {
            failures.push(format!("input: {json}\n  want: {expected}\n  got:  {got}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn at_most_sixteen_policies_eight_scope_fields_and_256_models() {
    let many: Vec<String> = (0..17)
        .map(|i| TOKENS_DAY.replace("daily", &format!("p{i}")))
        .collect();
    assert_eq!(
        error(&doc(&many.join(","), "")),
        "policies: 17 policies; at most 16"
    );
    let headers: Vec<String> = (0..9).map(|i| format!("\"h{i}\"")).collect();
    let scope: Vec<String> = (0..9).map(|i| format!(r#"{{"header":"h{i}"}}"#)).collect();
    let json = doc(
        &TOKENS_DAY.replace(r#"["tenant"]"#, &format!("[{}]", scope.join(","))),
        &format!(r#","trusted_headers":[{}]"#, headers.join(",")),
    );
    assert_eq!(error(&json), "policies[0].scope: 9 fields; at most 8");
    let models: Vec<String> = (0..257).map(|i| format!("\"m{i}\"")).collect();
    let json = doc(
        &TOKENS_DAY.replace(
            r#"["tenant"]"#,
            &format!(r#"["model"],"models":[{}]"#, models.join(",")),
        ),
        "",
    );
    assert_eq!(error(&json), "policies[0].models: 257 models; at most 256");
    let long = "m".repeat(129);
    let json = doc(
        &TOKENS_DAY.replace(
            r#"["tenant"]"#,
            &format!(r#"["model"],"models":["{long}"]"#),
        ),
        "",
    );
    assert_eq!(
        error(&json),
        format!("policies[0].models[0]: \"{long}\" must be 1 to 128 bytes")
    );
}
