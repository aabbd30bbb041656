//! The conversion, natively: JSON in, core's decision and errors out.

use serde_json::{Value, json};
use zerolayer_core::activation::RuleSet;

use super::*;

/// 2026-11-29 (a Sunday) 12:00:00 UTC.
const SUNDAY_NOON: i64 = 1_795_953_600;

const METERED: &str = r#"{"defaults":["audit"],"rules":[
    {"name":"metered","when":{"header":{"name":"X-Meter","exists":true}},"activate":["metering"]}]}"#;

fn ok(config: &str, request: &str) -> Value {
    match evaluate_at(config, request, SUNDAY_NOON) {
        Ok(report) => report,
        Err(err) => panic!("{err}"),
    }
}

fn err(config: &str, request: &str) -> PlaygroundError {
    match evaluate_at(config, request, SUNDAY_NOON) {
        Ok(report) => panic!("expected an error, got {report}"),
        Err(err) => err,
    }
}

fn observer<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["observers"]
        .as_array()
        .and_then(|all| all.iter().find(|o| o["name"] == name))
        .unwrap_or_else(|| panic!("no observer {name} in {report}"))
}

#[test]
fn a_header_rule_turns_metering_on_only_for_requests_carrying_the_header() {
    let with = ok(
        METERED,
        r#"{"method":"GET","path":"/","headers":{"x-meter":"1"}}"#,
    );
    assert_eq!(with["ok"], true);
    assert_eq!(
        observer(&with, "metering"),
        &json!({"name":"metering","on":true,"default":false,"decided_by":"metered"})
    );
    assert_eq!(
        observer(&with, "audit"),
        &json!({"name":"audit","on":true,"default":true,"decided_by":null})
    );
    assert_eq!(with["matched"], json!(["metered"]));
    assert_eq!(with["published"], "audit,metering");

    let without = ok(METERED, r#"{"method":"GET","path":"/"}"#);
    assert_eq!(
        observer(&without, "metering"),
        &json!({"name":"metering","on":false,"default":false,"decided_by":null})
    );
    assert_eq!(without["matched"], json!([]));
    assert_eq!(without["published"], "audit");
    assert_eq!(without["rules"][0]["matched"], false);
}

#[test]
fn the_example_decides_as_the_engine_does() {
    let report = ok(EXAMPLE_CONFIG, EXAMPLE_REQUEST);
    // Cross-check with core directly, through the same request view.
    let rules = RuleSet::from_json(EXAMPLE_CONFIG.as_bytes()).unwrap();
    let request = PlaygroundRequest::from_json(EXAMPLE_REQUEST, 0).unwrap();
    let decision = rules.evaluate(&request.facts(&rules));
    let mut published = String::new();
    rules.observers().render(decision.observers, &mut published);
    assert_eq!(report["published"], published.as_str());

    // What the page's first view promises: audit by default, metering for a
    // premium tenant, cache for an LLM call, shadow by the canary (which
    // outranks weekend_batch on a Sunday).
    assert_eq!(published, "audit,metering,cache,shadow");
    assert_eq!(
        report["matched"],
        json!([
            "premium_tenants",
            "llm_calls",
            "sdk_canary",
            "weekend_batch"
        ])
    );
    assert_eq!(observer(&report, "shadow")["decided_by"], "sdk_canary");
    assert_eq!(observer(&report, "cache")["decided_by"], "llm_calls");
    assert_eq!(observer(&report, "audit")["decided_by"], Value::Null);
    // Rules in decision order, with what each decided.
    let order: Vec<&str> = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        [
            "health_checks",
            "client_no_store",
            "premium_tenants",
            "llm_calls",
            "sdk_canary",
            "weekend_batch"
        ]
    );
    assert_eq!(
        report["rules"][5],
        json!({"name":"weekend_batch","position":5,"priority":1,"matched":true,
               "activate":[],"deactivate":["shadow"],"decides":[]})
    );
    assert_eq!(report["rules"][4]["decides"], json!(["shadow"]));
    assert_eq!(
        report["request"],
        json!({"tenant":"acme","request_id":"req-13","time":{
            "unix":SUNDAY_NOON,"utc":"2026-11-29T12:00:00Z","time_given":true,
            "utc_offset":"+00:00","local_hour":12,"local_weekday":"sun"}})
    );
}

#[test]
fn priorities_order_the_rules_and_decide_conflicts() {
    let config = r#"{"defaults":["cache"],"utc_offset":"+14:00","rules":[
        {"name":"low","priority":1,"activate":["metering"],"deactivate":["cache"]},
        {"name":"high","priority":10,"activate":["cache"],"deactivate":["metering"]}]}"#;
    let report = ok(config, r#"{"method":"GET","path":"/","time":0}"#);
    assert_eq!(report["rules"][0]["name"], "high");
    assert_eq!(report["rules"][0]["decides"], json!(["metering", "cache"]));
    assert_eq!(report["rules"][1]["decides"], json!([]));
    assert_eq!(observer(&report, "cache")["on"], true);
    assert_eq!(observer(&report, "metering")["on"], false);
    assert_eq!(observer(&report, "metering")["decided_by"], "high");
    // The clock the rules saw: 14 hours east of the epoch.
    assert_eq!(report["request"]["time"]["local_hour"], 14);
    assert_eq!(report["request"]["time"]["local_weekday"], "thu");
    assert_eq!(report["request"]["time"]["utc"], "1970-01-01T00:00:00Z");
}

#[test]
fn config_errors_are_cores_verbatim() {
    for config in [
        r#"{"rules":[{"name":"api","when":{"path":{"matches":"("}},"activate":["cache"]}]}"#,
        r#"{"rules":[{"name":"a"},{"name":"b","when":{"header":{"name":"x","matches":"[z-a]"}}}]}"#,
        r#"{"rules":[{"name":"a","activate":["nope"]}]}"#,
        r#"{"rules":[{"name":"a","when":{"hours":{"from":3,"to":3}}}]}"#,
        r#"{"rules":[{"name":"a","priority":"high"}]}"#,
        r#"{"rulez":[]}"#,
        r#"{"custom_observers":["auth_skip"]}"#,
        "[]",
        "",
        "{",
        "{} {}",
    ] {
        let want = RuleSet::from_json(config.as_bytes()).unwrap_err();
        let got = err(config, r#"{"method":"GET","path":"/"}"#);
        assert_eq!(got, PlaygroundError::Config(want.clone()), "{config}");
        assert_eq!(got.to_string(), want.to_string());
        let shown = got.to_json();
        assert_eq!(shown["ok"], false);
        assert_eq!(shown["error"]["kind"], "config");
        assert_eq!(shown["error"]["path"], want.path());
        assert_eq!(shown["error"]["text"], want.to_string());
    }
    let regex = err(
        r#"{"rules":[{"name":"api","when":{"path":{"matches":"("}}}]}"#,
        "{}",
    );
    assert!(
        regex
            .to_string()
            .starts_with(r#"rules[0].when.path.matches: invalid regex "(": "#),
        "{regex}"
    );
}

#[test]
fn request_errors_name_the_field() {
    let cases = [
        ("", "request: empty; expected a JSON object"),
        ("  ", "request: empty; expected a JSON object"),
        ("[]", "request: expected a JSON object"),
        (r#"{"path":"/"}"#, "request: missing field `method`"),
        (r#"{"method":"GET"}"#, "request: missing field `path`"),
        (
            r#"{"method":"","path":"/"}"#,
            "request.method: must not be empty",
        ),
        (
            r#"{"method":"GET","path":"v1"}"#,
            r#"request.path: must start with "/" (got "v1")"#,
        ),
        (
            r#"{"method":"GET","path":"/","header":{}}"#,
            "request.header: unknown field `header`, expected one of `method`, `path`,",
        ),
        (
            r#"{"method":"GET","path":"/","headers":{"x-a":1}}"#,
            "request.headers.x-a: invalid type: integer `1`, expected a string",
        ),
        (
            r#"{"method":"GET","path":"/","headers":["x-a"]}"#,
            "request.headers: invalid type: sequence, expected a map",
        ),
        (
            r#"{"method":"GET","path":"/","headers":{"X-A":"1","x-a":"2"}}"#,
            r#"request.headers.x-a: same header as "X-A" (names are case-insensitive)"#,
        ),
        (
            r#"{"method":"GET","path":"/","headers":{":PATH":"/x"}}"#,
            r#"request.headers.:PATH: give it as the request's "path" field"#,
        ),
        (
            r#"{"method":"GET","path":"/","headers":{"":"x"}}"#,
            "request.headers: a header name is empty",
        ),
        (
            r#"{"method":"GET","path":"/","time":"yesterday"}"#,
            r#"request.time: "yesterday" is not an RFC 3339 time such as "2026-11-29T12:00:00Z""#,
        ),
        (
            r#"{"method":"GET","path":"/","time":1.5}"#,
            "request.time: 1.5 is not a whole number of Unix seconds",
        ),
        (
            r#"{"method":"GET","path":"/","time":1e300}"#,
            "request.time: 1e+300 is not a whole number of Unix seconds",
        ),
        (
            r#"{"method":"GET","path":"/","time":true}"#,
            "request.time: expected RFC 3339 text or Unix seconds, got true",
        ),
        (
            r#"{"method":"GET","path":"/"} x"#,
            "request: trailing characters at line 1 column 29",
        ),
    ];
    for (request, want) in cases {
        let got = err("{}", request);
        assert!(matches!(got, PlaygroundError::Request(_)), "{request}");
        let text = got.to_string();
        assert!(text.starts_with(want), "{request}: {text}");
        let shown = got.to_json();
        assert_eq!(shown["error"]["kind"], "request");
        assert_eq!(shown["error"]["text"], text.as_str());
        assert!(
            text.starts_with(shown["error"]["path"].as_str().unwrap()),
            "{shown}"
        );
    }
    // A bad configuration is reported before a bad request.
    assert!(matches!(err("[]", ""), PlaygroundError::Config(_)));
}

#[test]
fn request_facts_follow_the_filter() {
    let config = r#"{"tenant_header":"x-org","rules":[
        {"name":"acme","when":{"tenant":{"in":["acme"]}},"activate":["metering"]},
        {"name":"posts","when":{"method":{"in":["POST"]}},"activate":["cache"]},
        {"name":"v1","when":{"path":{"matches":"^/v1/messages$"}},"activate":["audit"]},
        {"name":"all","when":{"header":{"name":":method","equals":"post"}},"deactivate":["cache"],"priority":5},
        {"name":"half","when":{"percent":50}}]}"#;
    // Tenant from the configured header (any case), method case-insensitive,
    // the path without its query, pseudo-headers from method and path.
    let report = ok(
        config,
        r#"{"method":"post","path":"/v1/messages?x=1","headers":{"X-Org":"acme"}}"#,
    );
    assert_eq!(report["published"], "audit,metering");
    assert_eq!(report["request"]["tenant"], "acme");
    assert_eq!(report["request"]["request_id"], Value::Null);
    // `posts` turns cache on, but `all` outranks it and turns it off.
    assert_eq!(observer(&report, "cache")["decided_by"], "all");
    assert_eq!(
        report["matched"],
        json!(["acme", "posts", "v1", "all"]),
        "percent without a request id never matches; `all` sees :method as sent"
    );
    // The verified tenant replaces the header's.
    let verified = ok(
        config,
        r#"{"method":"GET","path":"/","headers":{"x-org":"acme"},"tenant":"globex"}"#,
    );
    assert_eq!(verified["request"]["tenant"], "globex");
    assert_eq!(observer(&verified, "metering")["on"], false);
    // Without `time`, now: the caller's clock.
    let now = ok(config, r#"{"method":"GET","path":"/","time":null}"#);
    assert_eq!(now["request"]["time"]["unix"], SUNDAY_NOON);
    assert_eq!(now["request"]["time"]["time_given"], false);
}

#[test]
fn the_exported_function_always_returns_json() {
    let deep = "[".repeat(100_000);
    let long_regex = format!(
        r#"{{"rules":[{{"name":"a","when":{{"path":{{"matches":"{}"}}}}}}]}}"#,
        "a{1000}".repeat(50)
    );
    let inputs: Vec<(String, String)> = vec![
        (EXAMPLE_CONFIG.into(), EXAMPLE_REQUEST.into()),
        (
            EXAMPLE_CONFIG.into(),
            r#"{"method":"GET","path":"/"}"#.into(),
        ),
        ("{}".into(), deep.clone()),
        (deep.clone(), "{}".into()),
        ("\u{0}\u{ffff}".into(), "\u{feff}{}".into()),
        (long_regex, "{}".into()),
        (
            "{}".into(),
            r#"{"method":"GET","path":"/","time":-9223372036854775808}"#.into(),
        ),
        (
            "{}".into(),
            r#"{"method":"GET","path":"/","time":9223372036854775807}"#.into(),
        ),
    ];
    for (config, request) in inputs {
        let out = evaluate(&config, &request);
        let value: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert!(value["ok"].is_boolean(), "{out}");
        if value["ok"] == false {
            assert!(!value["error"]["text"].as_str().unwrap().is_empty());
        }
    }
    assert_eq!(example_config(), EXAMPLE_CONFIG);
    assert!(
        serde_json::from_str::<Value>(&example_request()).is_ok(),
        "the sample request is JSON"
    );
}
