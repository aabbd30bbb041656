//! Activation semantics: evaluation order, conflict resolution and every
//! condition kind, as documented in `zerolayer_core::activation`.

mod support;

use support::{Request, decide, matched};
use zerolayer_core::activation::RuleSet;

fn rules(json: &str) -> RuleSet {
    RuleSet::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{json}: {e}"))
}

/// 2026-11-29 (a Sunday) 12:00:00 UTC.
const SUNDAY_NOON: i64 = 1_795_953_600;
const HOUR: i64 = 3600;
const DAY: i64 = 86_400;

#[test]
fn defaults_apply_when_no_rule_matches() {
    let r = rules(
        r#"{"defaults":["audit","cache"],
            "rules":[{"name":"never","when":{"any":[]},"deactivate":["audit"],"activate":["metering"]}]}"#,
    );
    assert_eq!(decide(&r, &Request::get("/")), ["audit", "cache"]);
    assert!(matched(&r, &Request::get("/")).is_empty());
}

#[test]
fn higher_priority_decides_conflicts() {
    let r = rules(
        r#"{"defaults":["cache"],"rules":[
            {"name":"low","priority":1,"activate":["metering"],"deactivate":["cache"]},
            {"name":"high","priority":10,"activate":["cache"],"deactivate":["metering"]}]}"#,
    );
    // Both match; `high` decides cache and metering.
    assert_eq!(decide(&r, &Request::get("/")), ["cache"]);
    assert_eq!(matched(&r, &Request::get("/")), ["low", "high"]);
}

#[test]
fn equal_priority_goes_to_the_rule_listed_first() {
    let r = rules(
        r#"{"rules":[
            {"name":"first","activate":["metering"]},
            {"name":"second","deactivate":["metering"],"activate":["audit"]}]}"#,
    );
    assert_eq!(decide(&r, &Request::get("/")), ["audit", "metering"]);
    let swapped = rules(
        r#"{"rules":[
            {"name":"second","deactivate":["metering"],"activate":["audit"]},
            {"name":"first","activate":["metering"]}]}"#,
    );
    assert_eq!(decide(&swapped, &Request::get("/")), ["audit"]);
}

#[test]
fn unmentioned_observers_keep_their_default_and_rules_can_switch_defaults_off() {
    let r = rules(
        r#"{"custom_observers":["shadow"],"defaults":["audit","shadow"],"rules":[
            {"name":"internal","when":{"header":{"name":"x-internal","exists":true}},"deactivate":["shadow"]}]}"#,
    );
    assert_eq!(decide(&r, &Request::get("/")), ["audit", "shadow"]);
    assert_eq!(
        decide(&r, &Request::get("/").header("X-Internal", "1")),
        ["audit"]
    );
}

#[test]
fn lower_priority_still_decides_what_higher_rules_leave_open() {
    let r = rules(
        r#"{"rules":[
            {"name":"a","priority":5,"activate":["cache"]},
            {"name":"b","priority":1,"activate":["metering"],"deactivate":["cache"]}]}"#,
    );
    assert_eq!(decide(&r, &Request::get("/")), ["metering", "cache"]);
}

#[test]
fn header_conditions() {
    let r = rules(
        r#"{"rules":[
            {"name":"exists","when":{"header":{"name":"x-a","exists":true}}},
            {"name":"absent","when":{"header":{"name":"x-a","exists":false}}},
            {"name":"equals","when":{"header":{"name":"X-Tier","equals":"gold"}}},
            {"name":"in","when":{"header":{"name":"x-tier","in":["silver","bronze"]}}},
            {"name":"matches","when":{"header":{"name":"user-agent","matches":"^curl/[0-9]+"}}}]}"#,
    );
    assert_eq!(matched(&r, &Request::get("/")), ["absent"]);
    assert_eq!(
        matched(&r, &Request::get("/").header("x-a", "")),
        ["exists"]
    );
    assert_eq!(
        matched(&r, &Request::get("/").header("x-tier", "gold")),
        ["absent", "equals"]
    );
    // Values compare exactly.
    assert_eq!(
        matched(&r, &Request::get("/").header("x-tier", "Gold")),
        ["absent"]
    );
    assert_eq!(
        matched(&r, &Request::get("/").header("x-tier", "bronze")),
        ["absent", "in"]
    );
    assert_eq!(
        matched(&r, &Request::get("/").header("user-agent", "curl/8.5.0")),
        ["absent", "matches"]
    );
    assert_eq!(
        matched(&r, &Request::get("/").header("user-agent", "python curl/8")),
        ["absent"]
    );
}

#[test]
fn tenant_comes_from_the_configured_header() {
    let r = rules(
        r#"{"tenant_header":"x-org","rules":[{"name":"vip","when":{"tenant":{"in":["acme","globex"]}},"activate":["metering"]}]}"#,
    );
    assert_eq!(
        decide(&r, &Request::get("/").header("x-org", "acme")),
        ["metering"]
    );
    assert!(decide(&r, &Request::get("/").header("x-tenant-id", "acme")).is_empty());
    assert!(decide(&r, &Request::get("/").header("x-org", "initech")).is_empty());
}

#[test]
fn path_conditions_ignore_the_query_string() {
    let r = rules(
        r#"{"rules":[
            {"name":"prefix","when":{"path":{"prefix":"/v1/messages"}}},
            {"name":"regex","when":{"path":{"matches":"^/v1/(chat/)?completions$"}}}]}"#,
    );
    assert_eq!(
        matched(&r, &Request::get("/v1/messages?beta=1")),
        ["prefix"]
    );
    assert_eq!(
        matched(&r, &Request::get("/v1/completions?x=/v1/messages")),
        ["regex"]
    );
    assert_eq!(
        matched(&r, &Request::get("/v1/chat/completions")),
        ["regex"]
    );
    assert!(matched(&r, &Request::get("/v2/messages")).is_empty());
}

#[test]
fn method_is_case_insensitive() {
    let r = rules(r#"{"rules":[{"name":"writes","when":{"method":{"in":["POST","put"]}}}]}"#);
    assert_eq!(matched(&r, &Request::get("/").method("POST")), ["writes"]);
    assert_eq!(matched(&r, &Request::get("/").method("PUT")), ["writes"]);
    assert!(matched(&r, &Request::get("/").method("GET")).is_empty());
}

#[test]
fn hours_are_half_open_wrap_and_follow_the_offset() {
    let r = rules(
        r#"{"utc_offset":"+02:00","rules":[
            {"name":"office","when":{"hours":{"from":9,"to":17}}},
            {"name":"night","when":{"hours":{"from":22,"to":6}}},
            {"name":"to_midnight","when":{"hours":{"from":20,"to":24}}}]}"#,
    );
    // 12:00 UTC is 14:00 at +02:00.
    assert_eq!(matched(&r, &Request::get("/").at(SUNDAY_NOON)), ["office"]);
    // 15:00 UTC = 17:00 local: outside [9, 17).
    assert!(matched(&r, &Request::get("/").at(SUNDAY_NOON + 3 * HOUR)).is_empty());
    // 21:00 UTC = 23:00 local.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON + 9 * HOUR)),
        ["night", "to_midnight"]
    );
    // 03:59:59 UTC next day = 05:59:59 local.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON + 16 * HOUR - 1)),
        ["night"]
    );
    assert!(matched(&r, &Request::get("/").at(SUNDAY_NOON + 16 * HOUR)).is_empty());
}

#[test]
fn weekdays_are_inclusive_and_wrap() {
    let r = rules(
        r#"{"utc_offset":"-05:00","rules":[
            {"name":"workweek","when":{"weekdays":{"from":"mon","to":"fri"}}},
            {"name":"long_weekend","when":{"weekdays":{"from":"fri","to":"mon"}}}]}"#,
    );
    // Sunday 07:00 local.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON)),
        ["long_weekend"]
    );
    // Monday 07:00 local.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON + DAY)),
        ["workweek", "long_weekend"]
    );
    // Wednesday.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON + 3 * DAY)),
        ["workweek"]
    );
    // Monday 03:00 UTC is still Sunday 22:00 at -05:00.
    assert_eq!(
        matched(&r, &Request::get("/").at(SUNDAY_NOON + 15 * HOUR)),
        ["long_weekend"]
    );
}

#[test]
fn percent_is_consistent_per_request_id_and_false_without_one() {
    let r = rules(r#"{"rules":[{"name":"canary","when":{"percent":50}}]}"#);
    let mut hits = 0;
    for i in 0..1000 {
        let id = format!("req-{i}");
        let first = matched(&r, &Request::get("/").id(&id));
        // Same id, same decision, whatever else differs.
        let again = matched(&r, &Request::get("/other").method("POST").id(&id));
        assert_eq!(first, again);
        hits += first.len();
    }
    assert!((400..=600).contains(&hits), "{hits}");
    assert!(matched(&r, &Request::get("/")).is_empty());
    let all = rules(r#"{"rules":[{"name":"all","when":{"percent":100}}]}"#);
    assert_eq!(matched(&all, &Request::get("/").id("x")), ["all"]);
    let none = rules(r#"{"rules":[{"name":"none","when":{"percent":0}}]}"#);
    assert!(matched(&none, &Request::get("/").id("x")).is_empty());
}

#[test]
fn boolean_combinators() {
    let r = rules(
        r#"{"rules":[
            {"name":"empty_all","when":{"all":[]}},
            {"name":"empty_any","when":{"any":[]}},
            {"name":"both","when":{"all":[{"method":{"in":["POST"]}},{"path":{"prefix":"/v1"}}]}},
            {"name":"either","when":{"any":[{"method":{"in":["POST"]}},{"path":{"prefix":"/v1"}}]}},
            {"name":"neither","when":{"not":{"any":[{"method":{"in":["POST"]}},{"path":{"prefix":"/v1"}}]}}}]}"#,
    );
    assert_eq!(
        matched(&r, &Request::get("/v1/x").method("POST")),
        ["empty_all", "both", "either"]
    );
    assert_eq!(matched(&r, &Request::get("/v1/x")), ["empty_all", "either"]);
    assert_eq!(matched(&r, &Request::get("/x")), ["empty_all", "neither"]);
}
