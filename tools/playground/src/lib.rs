//! The rule playground: the activation rule engine of `zerolayer-core`,
//! compiled to WebAssembly with wasm-bindgen, behind a static page where an
//! operator pastes a rules configuration and a request and sees the
//! decision (`tools/playground/www/`).
//!
//! There is no second implementation: the configuration goes through
//! [`RuleSet::compile`] (so a bad one fails with core's own field-naming
//! error, verbatim), the decision is [`RuleSet::evaluate`]'s and the
//! deciding rules are [`RuleSet::decided_by`]'s. This crate only converts
//! JSON in and JSON out.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod request;
mod time;

use serde_json::{Value, json};
use wasm_bindgen::prelude::wasm_bindgen;
use zerolayer_core::ConfigError;
use zerolayer_core::activation::{ActivationConfig, RuleSet, local_hour, local_weekday};
use zerolayer_core::config::{ROOT, from_json};

pub use request::PlaygroundRequest;
pub use time::{format_utc, parse_rfc3339};

/// The example configuration the page starts with (the activation filter's
/// `example.json`, the one `envoy/activation.yaml` carries).
pub const EXAMPLE_CONFIG: &str = include_str!("../../../filters/activation/example.json");

/// The sample request the page starts with: an SDK's LLM call from a
/// premium tenant on a Sunday, inside `sdk_canary`'s 10 %.
pub const EXAMPLE_REQUEST: &str = r#"{
  "method": "POST",
  "path": "/v1/messages?beta=true",
  "headers": {
    "user-agent": "Anthropic/Python 2.16.0",
    "x-tenant-id": "acme",
    "x-request-id": "req-13",
    "content-type": "application/json"
  },
  "time": "2026-11-29T12:00:00Z"
}"#;

/// Why the playground could not evaluate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaygroundError {
    /// The configuration was refused: core's error, verbatim.
    #[error("{0}")]
    Config(ConfigError),
    /// The request JSON was refused; the path is relative to the request.
    #[error("request{}: {}", request_path(.0), .0.message())]
    Request(ConfigError),
}

/// `.headers.x-a` for a field of the request, nothing for the whole of it.
fn request_path(err: &ConfigError) -> String {
    match err.path() {
        ROOT => String::new(),
        path => format!(".{path}"),
    }
}

impl PlaygroundError {
    /// The error as the page shows it: `{"ok": false, "error": {...}}`.
    pub fn to_json(&self) -> Value {
        let (kind, path) = match self {
            PlaygroundError::Config(err) => ("config", err.path().to_string()),
            PlaygroundError::Request(err) => ("request", format!("request{}", request_path(err))),
        };
        let message = match self {
            PlaygroundError::Config(err) | PlaygroundError::Request(err) => err.message(),
        };
        json!({
            "ok": false,
            "error": {"kind": kind, "path": path, "message": message, "text": self.to_string()},
        })
    }
}

/// Evaluates `request_json` against `config_json` and returns the JSON the
/// page renders: `{"ok": true, ...}` with the decision (see [`evaluate_at`])
/// or `{"ok": false, "error": {"kind", "path", "message", "text"}}`. A
/// request without `time` is evaluated at the current time.
#[wasm_bindgen]
pub fn evaluate(config_json: &str, request_json: &str) -> String {
    let report = match evaluate_at(config_json, request_json, now()) {
        Ok(report) => report,
        Err(err) => err.to_json(),
    };
    serde_json::to_string(&report).unwrap_or_else(|_| {
        r#"{"ok":false,"error":{"kind":"internal","path":"","message":"could not render the result","text":"could not render the result"}}"#.to_string()
    })
}

/// The example configuration (see [`EXAMPLE_CONFIG`]).
#[wasm_bindgen]
pub fn example_config() -> String {
    EXAMPLE_CONFIG.to_string()
}

/// The sample request (see [`EXAMPLE_REQUEST`]).
#[wasm_bindgen]
pub fn example_request() -> String {
    EXAMPLE_REQUEST.to_string()
}

/// Evaluates with `now` (Unix seconds) standing in for a missing `time`.
///
/// The report: `observers` (every observer the configuration knows, in id
/// order: `name`, `on`, `default`, `decided_by` — the deciding rule's name
/// or null when it kept its default), `published` (the comma list later
/// filters read), `matched` (rule names in configuration order), `rules` (in
/// decision order: `name`, `position`, `priority`, `matched`, `activate`,
/// `deactivate`, `decides`), `request` (`tenant`, `request_id`, and the time
/// as `unix`, `utc`, `time_given`, `local_hour`, `local_weekday`).
pub fn evaluate_at(
    config_json: &str,
    request_json: &str,
    now: i64,
) -> Result<Value, PlaygroundError> {
    let config: ActivationConfig =
        from_json(config_json.as_bytes()).map_err(PlaygroundError::Config)?;
    let rules = RuleSet::compile(&config).map_err(PlaygroundError::Config)?;
    let request =
        PlaygroundRequest::from_json(request_json, now).map_err(PlaygroundError::Request)?;
    let facts = request.facts(&rules);
    let decision = rules.evaluate(&facts);

    let rule_name = |position: usize| rules.rule_names().get(position).map(|n| n.to_string());
    let observers: Vec<Value> = rules
        .observers()
        .all()
        .map(|(id, name)| {
            json!({
                "name": name,
                "on": decision.observers.contains(id),
                "default": rules.defaults().contains(id),
                "decided_by": rules.decided_by(decision.matched, id).and_then(rule_name),
            })
        })
        .collect();
    let rule_rows: Vec<Value> = rules
        .decision_order()
        .filter_map(|position| {
            let rule = config.rules.get(position)?;
            let decides: Vec<&str> = rules
                .observers()
                .all()
                .filter(|(id, _)| rules.decided_by(decision.matched, *id) == Some(position))
                .map(|(_, name)| name)
                .collect();
            Some(json!({
                "name": rule.name,
                "position": position,
                "priority": rule.priority,
                "matched": decision.matched.contains(position),
                "activate": rule.activate,
                "deactivate": rule.deactivate,
                "decides": decides,
            }))
        })
        .collect();
    let matched: Vec<String> = decision.matched.iter().filter_map(rule_name).collect();
    let mut published = String::new();
    rules.observers().render(decision.observers, &mut published);
    let offset = rules.utc_offset_seconds();
    let unix = request.unix_seconds;
    Ok(json!({
        "ok": true,
        "observers": observers,
        "published": published,
        "matched": matched,
        "rules": rule_rows,
        "request": {
            "tenant": facts.tenant_str(),
            "request_id": zerolayer_core::activation::RequestFacts::request_id(&facts)
                .map(String::from_utf8_lossy),
            "time": {
                "unix": unix,
                "utc": format_utc(unix),
                "time_given": request.time_given,
                "utc_offset": config.utc_offset.as_deref().unwrap_or("+00:00"),
                "local_hour": local_hour(unix, offset),
                "local_weekday": WEEKDAYS.get(usize::from(local_weekday(unix, offset))),
            },
        },
    }))
}

/// Weekday names as the configuration spells them, Monday first (core's
/// [`local_weekday`] numbering).
const WEEKDAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// The current time in Unix seconds: the browser's clock in WebAssembly
/// (where `std::time` has none), the system clock natively.
fn now() -> i64 {
    #[cfg(target_arch = "wasm32")]
    {
        (js_clock::date_now() / 1000.0).floor() as i64
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
    }
}

#[cfg(target_arch = "wasm32")]
mod js_clock {
    use wasm_bindgen::prelude::wasm_bindgen;

    #[wasm_bindgen]
    extern "C" {
        /// `Date.now()`: milliseconds since the Unix epoch.
        #[wasm_bindgen(js_namespace = Date, js_name = now)]
        pub fn date_now() -> f64;
    }
}

#[cfg(test)]
mod tests;
