//! zerolayer activation filter: per request, rules decide which optional
//! observers (`audit`, `metering`, `cache`, operator-defined) run, and the
//! decision is published to later filters of the same request.
//!
//! Lifecycle, top to bottom: configuration (compile the rules once) →
//! request headers (strip client-sent internal headers, evaluate, publish) →
//! response headers (debug header, if enabled) → tick (flush counters).
//! The rule logic lives in `zerolayer_core::activation`; this crate only
//! moves bytes between the host and it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod counters;
mod request;

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType};
use zerolayer_core::activation::{Decision, RuleSet};
use zerolayer_core::internal;
use zerolayer_proxy::fused::{self, Callback};

use counters::Counters;
use request::HostRequest;

/// How often pending counters reach the host's metrics.
const COUNTER_FLUSH_PERIOD: Duration = Duration::from_secs(1);

/// The module's entry point (`_initialize`): registers the root context.
#[cfg(not(feature = "stage"))]
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(ActivationRoot::default()) });
    }}
}

/// What every request of this plugin shares: the compiled rules and counters.
struct Plan {
    rules: RuleSet,
    counters: Counters,
}

/// The plugin's root context: owns the configuration.
#[derive(Default)]
pub struct ActivationRoot {
    plan: Option<Rc<Plan>>,
}

impl Context for ActivationRoot {
    fn on_done(&mut self) -> bool {
        // Report what the last tick did not, before the VM goes away.
        if let Some(plan) = &self.plan {
            plan.counters.flush();
        }
        true
    }
}

impl RootContext for ActivationRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = zerolayer_proxy::fused::plugin_configuration();
        let rules = match RuleSet::from_json(&config) {
            Ok(rules) => rules,
            Err(err) => {
                // One line naming the field; returning false makes the host
                // refuse the filter (Envoy fails to load the listener).
                log::error!("activation: invalid configuration: {err}");
                return false;
            }
        };
        let counters = Counters::define(&rules);
        log::info!(
            "activation: configured {} rules, {} observers, defaults [{}]",
            rules.rule_names().len(),
            rules.observers().all().count(),
            render(&rules, rules.defaults()),
        );
        if let Err(status) = zerolayer_proxy::fused::set_tick_period(COUNTER_FLUSH_PERIOD) {
            log::warn!("activation: no tick ({status:?}); counters flush at shutdown only");
        }
        self.plan = Some(Rc::new(Plan { rules, counters }));
        true
    }

    fn on_tick(&mut self) {
        if let Some(plan) = &self.plan {
            plan.counters.flush();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always return a context: the SDK panics on None. Without a plan
        // (the host ran us despite a refused configuration) the stream passes
        // through and later filters see no decision, i.e. their defaults.
        Some(Box::new(ActivationStream {
            plan: self.plan.clone(),
            decision: None,
        }))
    }
}

/// One request passing through the filter.
struct ActivationStream {
    plan: Option<Rc<Plan>>,
    decision: Option<Decision>,
}

impl Context for ActivationStream {}

impl HttpContext for ActivationStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Activation reads headers only: no body callback of its is needed.
        fused::done_with(Callback::RequestBody);
        fused::done_with(Callback::ResponseBody);
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        // The rules read the headers where they are (no copy); no rule
        // reads an internal header (refused at load), so removing the
        // forged ones afterwards changes no decision.
        // Tenant rules match the verified identity when lazy-auth ran
        // before (`unverified` for an unverified request, never its claim
        // or the header); the header only in a chain without it. One
        // property read, only when a rule needs the tenant.
        let verified_tenant = plan
            .rules
            .needs_tenant()
            .then(|| zerolayer_proxy::property(zerolayer_core::internal::AUTH_PROPERTY))
            .flatten()
            .map(|identity| {
                zerolayer_core::auth::identity::billing_tenant(Some(&identity), None, None)
            });
        let (decision, forged) = zerolayer_proxy::with_request_headers(|headers| {
            let mut request = HostRequest::new(headers, &plan.rules);
            if let Some(tenant) = &verified_tenant {
                request.set_tenant(tenant.as_bytes());
            }
            let forged: Vec<String> = request.forbidden_headers().map(str::to_string).collect();
            (plan.rules.evaluate(&request), forged)
        });

        // A client must never choose its own observers: drop every internal
        // header it sent before a later filter reads the request.
        for name in &forged {
            if zerolayer_proxy::remove_request_header(name) {
                plan.counters.forged_header();
            }
        }

        let published = render(&plan.rules, decision.observers);
        zerolayer_proxy::publish(internal::OBSERVERS_PROPERTY, published.as_bytes());
        plan.counters.decision(&decision);
        self.decision = Some(decision);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        // Whatever the upstream sent under a reserved name never reaches
        // the client, which would read it as the gateway's (no stage but
        // this one sets a reserved response header, so none of ours is lost
        // whatever order the host runs the stages' response callbacks in).
        zerolayer_proxy::remove_reserved_response_headers(internal::is_internal_header);
        if plan.rules.debug_response_header()
            && let Some(decision) = &self.decision
        {
            let value = debug_value(&plan.rules, decision);
            let _ = hostcalls::add_map_value_bytes(
                MapType::HttpResponseHeaders,
                internal::DEBUG_RESPONSE_HEADER,
                value.as_bytes(),
            );
        }
        Action::Continue
    }
}

/// The published form of a set of observers: `audit,metering`.
fn render(rules: &RuleSet, set: zerolayer_core::ObserverSet) -> String {
    let mut out = String::with_capacity(32);
    rules.observers().render(set, &mut out);
    out
}

/// `observers=audit,metering; rules=vip,canary` for the debug header.
fn debug_value(rules: &RuleSet, decision: &Decision) -> String {
    let mut out = String::with_capacity(64);
    out.push_str("observers=");
    rules.observers().render(decision.observers, &mut out);
    out.push_str("; rules=");
    let mut first = true;
    for index in decision.matched.iter() {
        if let Some(name) = rules.rule_names().get(index) {
            if !first {
                out.push(',');
            }
            out.push_str(name);
            first = false;
        }
    }
    out
}
