//! zerolayer activation filter: per request, rules decide which optional
//! observers (`audit`, `metering`, `cache`, operator-defined) run, and the
//! decision is published to later filters of the same request.
//!
//! Lifecycle, top to bottom: configuration (compile the rules once) →
//! request headers (strip client-sent internal headers, evaluate, publish) →
//! response headers (debug header, if enabled) → tick (flush counters).
//! The rule logic lives in `zerolayer_core::activation`; this crate only
//! moves bytes between the host (any `zerolayer_host::Host`) and it; the
//! module crate beside it (`module/`) registers it as its own `.wasm`.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod counters;
mod request;

use std::rc::Rc;
use std::time::Duration;

use zerolayer_core::activation::{Decision, RuleSet};
use zerolayer_core::internal;
use zerolayer_host::{Action, Callback, Headers, Host, RootStage, StreamStage};

use counters::Counters;
use request::HostRequest;

/// How often pending counters reach the host's metrics.
const COUNTER_FLUSH_PERIOD: Duration = Duration::from_secs(1);

/// What every request of this plugin shares: the compiled rules and counters.
struct Plan {
    rules: RuleSet,
    counters: Counters,
}

/// The stage's root: owns the configuration.
#[derive(Default)]
pub struct ActivationRoot {
    plan: Option<Rc<Plan>>,
}

impl<H: Host> RootStage<H> for ActivationRoot {
    fn configure(&mut self, host: &mut H, configuration: &[u8]) -> bool {
        let rules = match RuleSet::from_json(configuration) {
            Ok(rules) => rules,
            Err(err) => {
                // One line naming the field; returning false makes the host
                // refuse the filter (Envoy fails to load the listener).
                log::error!("activation: invalid configuration: {err}");
                return false;
            }
        };
        let counters = Counters::define(host, &rules);
        log::info!(
            "activation: configured {} rules, {} observers, defaults [{}]",
            rules.rule_names().len(),
            rules.observers().all().count(),
            render(&rules, rules.defaults()),
        );
        if let Err(status) = host.set_tick_period(COUNTER_FLUSH_PERIOD) {
            log::warn!("activation: no tick ({status:?}); counters flush at shutdown only");
        }
        self.plan = Some(Rc::new(Plan { rules, counters }));
        true
    }

    fn tick(&mut self, host: &mut H) {
        if let Some(plan) = &self.plan {
            plan.counters.flush(host);
        }
    }

    fn done(&mut self, host: &mut H) {
        // Report what the last tick did not, before the VM goes away.
        if let Some(plan) = &self.plan {
            plan.counters.flush(host);
        }
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H>> {
        // Without a plan (the host ran us despite a refused configuration)
        // the stream passes through and later filters see no decision,
        // i.e. their defaults.
        Box::new(ActivationStream {
            plan: self.plan.clone(),
            decision: None,
        })
    }
}

/// One request passing through the stage.
struct ActivationStream {
    plan: Option<Rc<Plan>>,
    decision: Option<Decision>,
}

impl<H: Host> StreamStage<H> for ActivationStream {
    fn request_headers(&mut self, host: &mut H, _end_of_stream: bool) -> Action {
        // Activation reads headers only: no body callback of its is needed.
        host.done_with(Callback::RequestBody);
        host.done_with(Callback::ResponseBody);
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        // Tenant rules match the verified identity when lazy-auth ran
        // before (`unverified` for an unverified request, never its claim
        // or the header); the header only in a chain without it. One
        // property read, only when a rule needs the tenant.
        let verified_tenant = plan
            .rules
            .needs_tenant()
            .then(|| host.property(internal::AUTH_PROPERTY))
            .flatten()
            .map(|identity| {
                zerolayer_core::auth::identity::billing_tenant(Some(&identity), None, None)
            });
        // Only rules with `hours`/`weekdays` read the clock.
        let now = plan.rules.needs_clock().then(|| host.now_secs() as i64);
        // The rules read the headers where they are (no copy); no rule
        // reads an internal header (refused at load), so removing the
        // forged ones afterwards changes no decision.
        let (decision, forged) = host.with_headers(Headers::Request, |headers| {
            let mut request = HostRequest::new(headers, &plan.rules);
            if let Some(tenant) = &verified_tenant {
                request.set_tenant(tenant.as_bytes());
            }
            if let Some(now) = now {
                request.set_now(now);
            }
            let forged: Vec<String> = request.forbidden_headers().map(str::to_string).collect();
            (plan.rules.evaluate(&request), forged)
        });

        // A client must never choose its own observers: drop every internal
        // header it sent before a later filter reads the request.
        for name in &forged {
            if host.remove_header(Headers::Request, name) {
                plan.counters.forged_header();
            }
        }

        let published = render(&plan.rules, decision.observers);
        host.publish(internal::OBSERVERS_PROPERTY, published.as_bytes());
        plan.counters.decision(&decision);
        self.decision = Some(decision);
        Action::Continue
    }

    fn response_headers(&mut self, host: &mut H, _end_of_stream: bool) -> Action {
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        // Whatever the upstream sent under a reserved name never reaches
        // the client, which would read it as the gateway's (no stage but
        // this one sets a reserved response header, so none of ours is lost
        // whatever order the host runs the stages' response callbacks in).
        host.remove_reserved_response_headers(internal::is_internal_header);
        if plan.rules.debug_response_header()
            && let Some(decision) = &self.decision
        {
            let value = debug_value(&plan.rules, decision);
            host.add_header(
                Headers::Response,
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
