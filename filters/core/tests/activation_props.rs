//! Property tests: the compiled engine agrees with a plain reference
//! interpreter of the configuration on random rules and requests, and
//! `percent` splits traffic within statistical bounds.

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{Value, json};
use support::{Facts, Request};
use zerolayer_core::activation::{ActivationConfig, Condition, RuleSet};

const OBSERVERS: [&str; 4] = ["audit", "metering", "cache", "shadow"];
const HEADERS: [&str; 3] = ["x-a", "x-b", "x-tier"];
const VALUES: [&str; 4] = ["", "gold", "silver", "GOLD"];
const PATTERNS: [&str; 4] = ["^g", "ld$", "^$", "s.l"];
const PREFIXES: [&str; 4] = ["/", "/v1", "/v1/messages", "/v2"];
const PATH_PATTERNS: [&str; 3] = ["^/v1/", "messages$", "chat"];
const PATHS: [&str; 4] = [
    "/",
    "/v1/messages",
    "/v1/chat/completions?x=1",
    "/v2/messages?q=/v1",
];
const METHODS: [&str; 3] = ["GET", "POST", "post"];
const TENANTS: [&str; 2] = ["acme", "globex"];
const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];
const PERCENTS: [f64; 6] = [0.0, 0.01, 12.5, 50.0, 99.99, 100.0];

fn pick<T: Clone + std::fmt::Debug + 'static>(items: &'static [T]) -> impl Strategy<Value = T> {
    (0..items.len()).prop_map(move |i| items[i].clone())
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        (pick(&HEADERS), any::<bool>())
            .prop_map(|(n, e)| json!({"header": {"name": n, "exists": e}})),
        (pick(&HEADERS), pick(&VALUES))
            .prop_map(|(n, v)| json!({"header": {"name": n, "equals": v}})),
        (pick(&HEADERS), prop::collection::vec(pick(&VALUES), 1..3))
            .prop_map(|(n, v)| json!({"header": {"name": n, "in": v}})),
        (pick(&HEADERS), pick(&PATTERNS))
            .prop_map(|(n, p)| json!({"header": {"name": n, "matches": p}})),
        prop::collection::vec(pick(&TENANTS), 1..3).prop_map(|t| json!({"tenant": {"in": t}})),
        pick(&PREFIXES).prop_map(|p| json!({"path": {"prefix": p}})),
        pick(&PATH_PATTERNS).prop_map(|p| json!({"path": {"matches": p}})),
        prop::collection::vec(pick(&METHODS), 1..3).prop_map(|m| json!({"method": {"in": m}})),
        (0u8..24, 1u8..=24)
            .prop_filter("empty range", |(f, t)| f != t)
            .prop_map(|(f, t)| json!({"hours": {"from": f, "to": t}})),
        (pick(&DAYS), pick(&DAYS)).prop_map(|(f, t)| json!({"weekdays": {"from": f, "to": t}})),
        pick(&PERCENTS).prop_map(|p| json!({"percent": p})),
    ]
}

fn condition() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 16, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| json!({"all": v})),
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| json!({"any": v})),
            inner.prop_map(|c| json!({"not": c})),
        ]
    })
}

/// Disjoint activate / deactivate lists.
fn switches() -> impl Strategy<Value = (Vec<&'static str>, Vec<&'static str>)> {
    prop::collection::vec(0u8..3, OBSERVERS.len()).prop_map(|choice| {
        let mut on = vec![];
        let mut off = vec![];
        for (i, c) in choice.into_iter().enumerate() {
            match c {
                1 => on.push(OBSERVERS[i]),
                2 => off.push(OBSERVERS[i]),
                _ => {}
            }
        }
        (on, off)
    })
}

fn config() -> impl Strategy<Value = Value> {
    let rule = (-2i32..=2, prop::option::of(condition()), switches());
    (
        prop::collection::vec(rule, 0..7),
        prop::sample::subsequence(OBSERVERS.to_vec(), 0..=4),
        prop::sample::select(vec!["+00:00", "+05:30", "-08:00", "+14:00"]),
    )
        .prop_map(|(rules, defaults, offset)| {
            let rules: Vec<Value> = rules
                .into_iter()
                .enumerate()
                .map(|(i, (priority, when, (on, off)))| {
                    let mut r = json!({"name": format!("r{i}"), "priority": priority,
                                       "activate": on, "deactivate": off});
                    if let Some(w) = when {
                        r["when"] = w;
                    }
                    r
                })
                .collect();
            json!({"custom_observers": ["shadow"], "defaults": defaults,
                   "utc_offset": offset, "rules": rules})
        })
}

fn request() -> impl Strategy<Value = Request> {
    (
        prop::collection::vec((pick(&HEADERS), pick(&VALUES)), 0..3),
        prop::option::of(pick(&TENANTS)),
        pick(&PATHS),
        pick(&METHODS),
        prop::option::of("[a-z0-9-]{1,12}"),
        0i64..4_000_000_000,
    )
        .prop_map(|(headers, tenant, path, method, id, t)| {
            let mut r = Request::get(path).method(method).at(t);
            for (n, v) in headers {
                if r.lookup(n).is_none() {
                    r = r.header(n, v);
                }
            }
            if let Some(t) = tenant {
                r = r.header("x-tenant-id", t);
            }
            r.request_id = id;
            r
        })
}

// ---- the reference interpreter: direct, slow, obviously right ----

fn offset_seconds(text: &str) -> i64 {
    let sign = if text.starts_with('-') { -1 } else { 1 };
    let h: i64 = text[1..3].parse().unwrap();
    let m: i64 = text[4..6].parse().unwrap();
    sign * (h * 3600 + m * 60)
}

fn reference_holds(c: &Condition, req: &Request, offset: i64) -> bool {
    let local = req.unix_seconds + offset;
    let path = req.path.split('?').next().unwrap();
    match c {
        Condition::Header(h) => {
            let v = req
                .lookup(&h.name)
                .map(|v| String::from_utf8(v.to_vec()).unwrap());
            if let Some(e) = h.exists {
                v.is_some() == e
            } else if let Some(eq) = &h.equals {
                v.as_deref() == Some(eq.as_str())
            } else if let Some(list) = &h.one_of {
                v.is_some_and(|v| list.contains(&v))
            } else {
                let re = regex::Regex::new(h.matches.as_ref().unwrap()).unwrap();
                v.is_some_and(|v| re.is_match(&v))
            }
        }
        Condition::Tenant(l) => req
            .lookup("x-tenant-id")
            .is_some_and(|t| l.values.iter().any(|x| x.as_bytes() == t)),
        Condition::Path(p) => match (&p.prefix, &p.matches) {
            (Some(prefix), _) => path.starts_with(prefix.as_str()),
            (_, Some(re)) => regex::Regex::new(re).unwrap().is_match(path),
            _ => unreachable!(),
        },
        Condition::Method(l) => l
            .values
            .iter()
            .any(|m| m.to_uppercase() == req.method.to_uppercase()),
        Condition::Hours(h) => {
            let hour = (local.rem_euclid(86_400) / 3600) as u8;
            // Count up from `from` to `to`, going past midnight when needed.
            let end = if h.to > h.from { h.to } else { h.to + 24 };
            (h.from..end).any(|x| x % 24 == hour)
        }
        Condition::Weekdays(w) => {
            // Count days from a known Monday (1970-01-05 00:00 local).
            let day = ((local - 4 * 86_400).div_euclid(86_400)).rem_euclid(7) as u8;
            let (from, to) = (w.from.index(), w.to.index());
            (0..7u8)
                .map(|k| (from + k) % 7)
                .position(|x| x == to)
                .map(|n| (0..=n as u8).any(|k| (from + k) % 7 == day))
                == Some(true)
        }
        Condition::Percent(p) => req.request_id.as_ref().is_some_and(|id| {
            let bucket = xxhash_rust::xxh3::xxh3_64(id.as_bytes()) % 10_000;
            (bucket as f64) < (p * 100.0).round()
        }),
        Condition::All(cs) => cs.iter().all(|c| reference_holds(c, req, offset)),
        Condition::Any(cs) => cs.iter().any(|c| reference_holds(c, req, offset)),
        Condition::Not(c) => !reference_holds(c, req, offset),
    }
}

/// Apply matching rules from the weakest to the strongest, later writes
/// winning: lowest priority first and, within a priority, the rule listed
/// last first. Also returns, per observer, the position of the rule that
/// wrote it last (the one that decided it), if any did.
fn reference_decide(
    cfg: &ActivationConfig,
    req: &Request,
) -> (
    Vec<String>,
    Vec<String>,
    BTreeMap<&'static str, Option<usize>>,
) {
    let offset = offset_seconds(cfg.utc_offset.as_deref().unwrap_or("+00:00"));
    let mut state: BTreeMap<&str, bool> = OBSERVERS.iter().map(|o| (*o, false)).collect();
    let mut decider: BTreeMap<&'static str, Option<usize>> =
        OBSERVERS.iter().map(|o| (*o, None)).collect();
    for d in &cfg.defaults {
        state.insert(d, true);
    }
    let mut matching: Vec<(usize, &zerolayer_core::activation::RuleConfig)> = cfg
        .rules
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            r.when
                .as_ref()
                .is_none_or(|w| reference_holds(w, req, offset))
        })
        .collect();
    let matched = matching.iter().map(|(_, r)| r.name.clone()).collect();
    matching.sort_by_key(|(i, r)| (r.priority, std::cmp::Reverse(*i)));
    for (position, r) in matching {
        for (list, on) in [(&r.activate, true), (&r.deactivate, false)] {
            for o in list {
                state.insert(o, on);
                if let Some(name) = OBSERVERS.iter().find(|n| **n == o.as_str()) {
                    decider.insert(name, Some(position));
                }
            }
        }
    }
    let on = OBSERVERS
        .iter()
        .filter(|o| state[*o])
        .map(|o| o.to_string())
        .collect();
    (on, matched, decider)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn compiled_engine_agrees_with_reference(cfg in config(), reqs in prop::collection::vec(request(), 1..8)) {
        let text = cfg.to_string();
        let parsed: ActivationConfig = serde_json::from_str(&text).unwrap();
        let compiled = RuleSet::from_json(text.as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        for req in &reqs {
            let decision = compiled.evaluate(&Facts { rules: &compiled, request: req });
            let mut on: Vec<String> = OBSERVERS.iter()
                .filter(|o| decision.observers.contains(compiled.observers().lookup(o).unwrap()))
                .map(|o| o.to_string()).collect();
            on.sort();
            let matched: Vec<String> = decision.matched.iter().map(|i| compiled.rule_names()[i].to_string()).collect();
            let (mut want_on, want_matched, want_decider) = reference_decide(&parsed, req);
            want_on.sort();
            prop_assert_eq!(&on, &want_on, "observers for {:?}", req);
            prop_assert_eq!(&matched, &want_matched, "matched rules for {:?}", req);
            for (observer, want) in &want_decider {
                let id = compiled.observers().lookup(observer).unwrap();
                prop_assert_eq!(compiled.decided_by(decision.matched, id), *want, "deciding rule of {} for {:?}", observer, req);
            }
        }
        let mut order: Vec<usize> = (0..parsed.rules.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(parsed.rules[*i].priority));
        prop_assert_eq!(compiled.decision_order().collect::<Vec<_>>(), order);
    }
}

#[test]
fn percent_splits_within_binomial_bounds() {
    let n = 40_000u32;
    for percent in [1.0, 10.0, 33.33, 50.0, 90.0] {
        let rules = RuleSet::from_json(
            format!(r#"{{"rules":[{{"name":"p","when":{{"percent":{percent}}}}}]}}"#).as_bytes(),
        )
        .unwrap();
        let hits = (0..n)
            .filter(|i| {
                let req =
                    Request::get("/").id(&format!("{i:08x}-{}", i.wrapping_mul(2_654_435_761)));
                rules
                    .evaluate(&Facts {
                        rules: &rules,
                        request: &req,
                    })
                    .matched
                    .bits()
                    != 0
            })
            .count() as f64;
        let p = percent / 100.0;
        let mean = p * f64::from(n);
        let sigma = (f64::from(n) * p * (1.0 - p)).sqrt();
        // Five standard deviations: a false alarm about once in 3.5 million runs.
        assert!(
            (hits - mean).abs() <= 5.0 * sigma,
            "{percent}%: {hits} hits, expected {mean} ± {}",
            5.0 * sigma
        );
    }
}
