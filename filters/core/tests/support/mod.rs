//! A plain request for rule tests.
#![allow(dead_code)]

use zerolayer_core::activation::{HeaderSlot, RequestFacts, RuleSet};

/// A request described by plain values.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub headers: Vec<(String, String)>,
    pub path: String,
    pub method: String,
    pub request_id: Option<String>,
    pub unix_seconds: i64,
}

impl Request {
    pub fn get(path: &str) -> Self {
        Request {
            path: path.into(),
            method: "GET".into(),
            ..Default::default()
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn method(mut self, method: &str) -> Self {
        self.method = method.into();
        self
    }

    pub fn id(mut self, id: &str) -> Self {
        self.request_id = Some(id.into());
        self
    }

    pub fn at(mut self, unix_seconds: i64) -> Self {
        self.unix_seconds = unix_seconds;
        self
    }

    pub fn lookup(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_bytes())
    }
}

/// The request as the engine sees it under one rule set (slots → names).
pub struct Facts<'a> {
    pub rules: &'a RuleSet,
    pub request: &'a Request,
}

impl RequestFacts for Facts<'_> {
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]> {
        self.request.lookup(&self.rules.header_names()[slot])
    }
    fn path(&self) -> &[u8] {
        self.request.path.as_bytes()
    }
    fn method(&self) -> &[u8] {
        self.request.method.as_bytes()
    }
    fn tenant(&self) -> Option<&[u8]> {
        self.request.lookup(self.rules.tenant_header())
    }
    fn request_id(&self) -> Option<&[u8]> {
        self.request.request_id.as_deref().map(str::as_bytes)
    }
    fn unix_seconds(&self) -> i64 {
        self.request.unix_seconds
    }
}

/// Observer names the decision turns on, in id order.
pub fn decide(rules: &RuleSet, request: &Request) -> Vec<String> {
    let decision = rules.evaluate(&Facts { rules, request });
    let mut out = String::new();
    rules.observers().render(decision.observers, &mut out);
    out.split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// Names of the rules that matched, in config order.
pub fn matched(rules: &RuleSet, request: &Request) -> Vec<String> {
    let decision = rules.evaluate(&Facts { rules, request });
    decision
        .matched
        .iter()
        .map(|i| rules.rule_names()[i].to_string())
        .collect()
}
