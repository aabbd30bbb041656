//! Rule evaluation cost: ten rules with mixed conditions (`ten_rules.json`),
//! evaluated against a request whose facts are already at hand, as the
//! filter provides them; then each rule alone, to see where time goes.
#![allow(missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use zerolayer_core::activation::{HeaderSlot, RequestFacts, RuleSet};

/// Headers (exists/equals/in/regex), tenant, path prefix/regex, method,
/// hours, weekdays, percent and nested combinators.
const TEN_RULES: &str = include_str!("ten_rules.json");

struct Facts {
    headers: Vec<Option<&'static [u8]>>,
}

impl Facts {
    fn for_rules(rules: &RuleSet) -> Self {
        let headers = rules
            .header_names()
            .iter()
            .map(|name| match &**name {
                "x-tier" => Some(&b"silver"[..]),
                "user-agent" => Some(&b"Anthropic/Python 2.16.0"[..]),
                _ => None,
            })
            .collect();
        Facts { headers }
    }
}

impl RequestFacts for Facts {
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]> {
        self.headers.get(slot).copied().flatten()
    }
    fn path(&self) -> &[u8] {
        b"/v1/messages?beta=true"
    }
    fn method(&self) -> &[u8] {
        b"POST"
    }
    fn tenant(&self) -> Option<&[u8]> {
        Some(b"globex")
    }
    fn request_id(&self) -> Option<&[u8]> {
        Some(b"0d9d1e52-5bd2-4f3c-9d1b-2f0d7b6f1c11")
    }
    fn unix_seconds(&self) -> i64 {
        1_795_953_600
    }
}

fn ten_rules(c: &mut Criterion) {
    let rules = RuleSet::from_json(TEN_RULES.as_bytes()).expect("bench config compiles");
    let facts = Facts::for_rules(&rules);
    c.bench_function("activation/evaluate_10_rules", |b| {
        b.iter(|| black_box(rules.evaluate(black_box(&facts))))
    });
}

fn each_rule_alone(c: &mut Criterion) {
    let full: serde_json::Value = serde_json::from_str(TEN_RULES).expect("bench config is JSON");
    let mut group = c.benchmark_group("activation/one_rule");
    for rule in full["rules"].as_array().into_iter().flatten() {
        let mut one = full.clone();
        one["rules"] = serde_json::json!([rule]);
        let rules = RuleSet::from_json(one.to_string().as_bytes()).expect("rule compiles");
        let facts = Facts::for_rules(&rules);
        let name = rule["name"].as_str().unwrap_or("?");
        group.bench_function(name, |b| {
            b.iter(|| black_box(rules.evaluate(black_box(&facts))))
        });
    }
    group.finish();
}

criterion_group!(benches, ten_rules, each_rule_alone);
criterion_main!(benches);
