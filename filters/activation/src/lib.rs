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
use zerolayer_core::auth::identity::{Published, billing_tenant};
use zerolayer_core::internal;
use zerolayer_host::{Action, Callback, Headers, Host, Hosts, RootStage, StreamHost, StreamStage};

use counters::Counters;
use request::HostRequest;

/// How often pending counters reach the host's metrics.
const COUNTER_FLUSH_PERIOD: Duration = Duration::from_secs(1);

/// What every request of this plugin shares: the compiled rules and counters.
struct Plan {
    rules: RuleSet,
    counters: Counters,
    /// A rule matches the tenant: read lazy-auth's identity (known at load,
    /// so no request walks the rules to find out).
    needs_tenant: bool,
    /// A rule reads the clock (`hours`, `weekdays`).
    needs_clock: bool,
}

/// The stage's root: owns the configuration.
#[derive(Default)]
pub struct ActivationRoot {
    plan: Option<Rc<Plan>>,
}

impl<H: Hosts> RootStage<H> for ActivationRoot {
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool {
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
        self.plan = Some(Rc::new(Plan {
            needs_tenant: rules.needs_tenant(),
            needs_clock: rules.needs_clock(),
            rules,
            counters,
        }));
        true
    }

    fn tick(&mut self, host: &mut H::Root) {
        RootStage::<H>::flush(self, host);
    }

    fn flush(&mut self, host: &mut H::Root) {
        if let Some(plan) = &self.plan {
            plan.counters.flush(host);
        }
    }

    fn done(&mut self, host: &mut H::Root) {
        // Report what the last tick did not, before the VM goes away.
        if let Some(plan) = &self.plan {
            plan.counters.flush(host);
        }
    }

    fn stream(&self, _context_id: u32) -> Box<dyn StreamStage<H::Stream>> {
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

impl<H: StreamHost> StreamStage<H> for ActivationStream {
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
            .needs_tenant
            .then(|| {
                host.with_identity(|published| {
                    (*published != Published::Nothing)
                        .then(|| billing_tenant(published, None, None))
                })
            })
            .flatten();
        // Only rules with `hours`/`weekdays` read the clock.
        let now = plan.needs_clock.then(|| host.now_secs() as i64);
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
        host.remove_reserved_response_headers(|name| internal::is_internal_header(name));
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

/// The stage on the recording fake: what it publishes, removes and adds.
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerolayer_core::internal;
    use zerolayer_host::{Action, Callback, FakeHost, RootStage, StreamStage};

    use super::ActivationRoot;

    /// Audit by default; LLM calls cached; health checks observed by nobody.
    const RULES: &str = r#"{
        "defaults": ["audit"],
        "tenant_header": "x-tenant-id",
        "rules": [
            {"name": "health_checks", "priority": 100,
             "when": {"path": {"prefix": "/healthz"}},
             "deactivate": ["audit", "metering", "cache"]},
            {"name": "llm_calls", "priority": 10,
             "when": {"all": [{"method": {"in": ["POST"]}},
                              {"path": {"matches": "^/v1/messages$"}}]},
             "activate": ["cache"]}
        ]
    }"#;

    /// Metering for premium tenants, audit for unverified requests.
    const TENANTS: &str = r#"{
        "tenant_header": "x-tenant-id",
        "rules": [
            {"name": "premium", "when": {"tenant": {"in": ["acme"]}}, "activate": ["metering"]},
            {"name": "unverified", "when": {"tenant": {"in": ["unverified"]}}, "activate": ["audit"]}
        ]
    }"#;

    fn configured(host: &mut FakeHost, config: &str) -> ActivationRoot {
        let mut root = ActivationRoot::default();
        assert!(
            RootStage::<FakeHost>::configure(&mut root, host, config.as_bytes()),
            "configuration refused: {config}"
        );
        root
    }

    /// Runs the request headers of a new stream on `headers`.
    fn request(
        root: &ActivationRoot,
        host: &mut FakeHost,
        headers: &[(&str, &str)],
    ) -> Box<dyn StreamStage<FakeHost>> {
        host.request_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let mut stream = RootStage::<FakeHost>::stream(root, 1);
        assert_eq!(stream.request_headers(host, true), Action::Continue);
        stream
    }

    /// The observers the stage published.
    fn observers(host: &FakeHost) -> Option<String> {
        host.properties
            .get(internal::OBSERVERS_PROPERTY)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    fn counter(root: &mut ActivationRoot, host: &mut FakeHost, name: &str) -> i64 {
        RootStage::<FakeHost>::tick(root, host);
        host.metric(name)
            .unwrap_or_else(|| panic!("metric {name} not defined"))
    }

    const LLM_CALL: &[(&str, &str)] = &[(":method", "POST"), (":path", "/v1/messages")];

    #[test]
    fn rules_decide_the_observers_and_the_decision_is_published() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        request(&root, &mut host, LLM_CALL);
        assert_eq!(observers(&host).as_deref(), Some("audit,cache"));
    }

    #[test]
    fn a_rule_can_turn_every_observer_off() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        request(
            &root,
            &mut host,
            &[(":method", "GET"), (":path", "/healthz")],
        );
        assert_eq!(observers(&host).as_deref(), Some(""));
    }

    #[test]
    fn no_matching_rule_leaves_the_defaults() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        request(
            &root,
            &mut host,
            &[(":method", "GET"), (":path", "/v1/models")],
        );
        assert_eq!(observers(&host).as_deref(), Some("audit"));
    }

    #[test]
    fn decisions_are_counted_per_rule_and_observer() {
        let mut host = FakeHost::default();
        let mut root = configured(&mut host, RULES);
        request(&root, &mut host, LLM_CALL);
        request(
            &root,
            &mut host,
            &[(":method", "GET"), (":path", "/healthz")],
        );
        assert_eq!(
            counter(&mut root, &mut host, "zerolayer_activation_requests"),
            2
        );
        assert_eq!(
            host.metric("zerolayer_activation_rule_matches_rule=llm_calls"),
            Some(1)
        );
        assert_eq!(
            host.metric("zerolayer_activation_rule_matches_rule=health_checks"),
            Some(1)
        );
        assert_eq!(
            host.metric("zerolayer_activation_observer_on_observer=cache"),
            Some(1)
        );
        assert_eq!(
            host.metric("zerolayer_activation_observer_on_observer=audit"),
            Some(1)
        );
    }

    #[test]
    fn client_sent_internal_headers_are_removed_and_counted() {
        let mut host = FakeHost::default();
        let mut root = configured(&mut host, RULES);
        request(
            &root,
            &mut host,
            &[
                (":method", "GET"),
                (":path", "/healthz"),
                ("x-zerolayer-observers", "audit,metering"),
                ("X-Zerolayer-Debug", "1"),
                ("x-request-id", "req-1"),
            ],
        );
        assert_eq!(host.request_header_value("x-zerolayer-observers"), None);
        assert_eq!(host.request_header_value("x-zerolayer-debug"), None);
        assert_eq!(
            host.request_header_value("x-request-id").as_deref(),
            Some("req-1")
        );
        // The forged choice changed nothing: health checks stay unobserved.
        assert_eq!(observers(&host).as_deref(), Some(""));
        assert_eq!(
            counter(&mut root, &mut host, "zerolayer_activation_forged_headers"),
            2
        );
    }

    #[test]
    fn reserved_response_headers_from_the_upstream_are_removed() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        let mut stream = request(&root, &mut host, LLM_CALL);
        host.respond_with(&[
            (":status", "200"),
            ("x-zerolayer-debug", "observers=none"),
            ("x-zerolayer-cache", "hit"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(stream.response_headers(&mut host, false), Action::Continue);
        assert_eq!(host.response_header_value("x-zerolayer-debug"), None);
        assert_eq!(host.response_header_value("x-zerolayer-cache"), None);
        assert_eq!(
            host.response_header_value("content-type").as_deref(),
            Some("application/json")
        );
    }

    #[test]
    fn the_debug_response_header_names_the_decision_when_enabled() {
        let mut host = FakeHost::default();
        let config = RULES.replacen('{', r#"{"debug_response_header": true,"#, 1);
        let root = configured(&mut host, &config);
        let mut stream = request(&root, &mut host, LLM_CALL);
        host.respond_with(&[(":status", "200"), ("x-zerolayer-debug", "forged")]);
        stream.response_headers(&mut host, false);
        let values: Vec<_> = host
            .response_headers
            .iter()
            .filter(|(n, _)| n == internal::DEBUG_RESPONSE_HEADER)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect();
        assert_eq!(values, ["observers=audit,cache; rules=llm_calls"]);
    }

    #[test]
    fn there_is_no_debug_response_header_by_default() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        let mut stream = request(&root, &mut host, LLM_CALL);
        host.respond_with(&[(":status", "200")]);
        stream.response_headers(&mut host, false);
        assert_eq!(
            host.response_header_value(internal::DEBUG_RESPONSE_HEADER),
            None
        );
    }

    fn authenticated(host: &mut FakeHost, identity: &str) {
        host.properties
            .insert(internal::AUTH_PROPERTY.into(), identity.as_bytes().to_vec());
    }

    #[test]
    fn tenant_rules_match_the_verified_tenant_not_the_header() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, TENANTS);
        authenticated(&mut host, "verified tenant=acme subject=user-1");
        request(
            &root,
            &mut host,
            &[(":path", "/v1/messages"), ("x-tenant-id", "globex")],
        );
        assert_eq!(observers(&host).as_deref(), Some("metering"));
    }

    #[test]
    fn a_verified_tenant_outranks_a_claimed_premium_header() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, TENANTS);
        authenticated(&mut host, "verified tenant=globex");
        request(
            &root,
            &mut host,
            &[(":path", "/v1/messages"), ("x-tenant-id", "acme")],
        );
        assert_eq!(observers(&host).as_deref(), Some(""));
    }

    #[test]
    fn an_unverified_request_matches_as_unverified_whatever_it_claims() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, TENANTS);
        authenticated(&mut host, "unverified tenant=acme");
        request(
            &root,
            &mut host,
            &[(":path", "/v1/messages"), ("x-tenant-id", "acme")],
        );
        assert_eq!(observers(&host).as_deref(), Some("audit"));
    }

    #[test]
    fn without_lazy_auth_the_tenant_header_counts() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, TENANTS);
        request(
            &root,
            &mut host,
            &[(":path", "/v1/messages"), ("x-tenant-id", "acme")],
        );
        assert_eq!(observers(&host).as_deref(), Some("metering"));
    }

    /// 1_700_000_000 (the fake's clock) is Tuesday 2023-11-14, 22:13:20 UTC.
    const NIGHT_SHIFT: &str = r#"{
        "utc_offset": "+00:00",
        "rules": [
            {"name": "late", "when": {"hours": {"from": 22, "to": 23}}, "activate": ["metering"]},
            {"name": "tuesday", "when": {"weekdays": {"from": "tue", "to": "tue"}}, "activate": ["audit"]}
        ]
    }"#;

    #[test]
    fn hours_and_weekdays_rules_read_the_host_clock() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, NIGHT_SHIFT);
        request(&root, &mut host, &[(":path", "/")]);
        assert_eq!(observers(&host).as_deref(), Some("audit,metering"));
    }

    #[test]
    fn an_hour_later_the_hours_rule_no_longer_matches() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, NIGHT_SHIFT);
        host.advance(Duration::from_secs(3600));
        request(&root, &mut host, &[(":path", "/")]);
        assert_eq!(observers(&host).as_deref(), Some("audit"));
    }

    #[test]
    fn a_day_later_the_weekday_rule_no_longer_matches() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, NIGHT_SHIFT);
        host.advance(Duration::from_secs(24 * 3600));
        request(&root, &mut host, &[(":path", "/")]);
        assert_eq!(observers(&host).as_deref(), Some("metering"));
    }

    #[test]
    fn a_refused_configuration_returns_false() {
        let mut host = FakeHost::default();
        let mut root = ActivationRoot::default();
        for config in [
            r#"{"rules": [{"name": "x", "activate": ["no_such_observer"]}]}"#,
            r#"{"rules": [{"name": "x", "when": {"header": {"name": "x-zerolayer-debug", "exists": true}}}]}"#,
            "not json",
        ] {
            assert!(
                !RootStage::<FakeHost>::configure(&mut root, &mut host, config.as_bytes()),
                "{config}"
            );
        }
        assert_eq!(host.tick, None);
    }

    #[test]
    fn an_unconfigured_stream_passes_through_without_a_decision() {
        let mut host = FakeHost::default();
        let root = ActivationRoot::default();
        request(
            &root,
            &mut host,
            &[(":path", "/"), ("x-zerolayer-observers", "audit")],
        );
        assert_eq!(observers(&host), None);
    }

    #[test]
    fn the_stage_is_done_with_both_body_callbacks() {
        let mut host = FakeHost::default();
        let root = configured(&mut host, RULES);
        request(&root, &mut host, LLM_CALL);
        assert_eq!(
            host.done_with,
            [Callback::RequestBody, Callback::ResponseBody]
        );
    }

    #[test]
    fn a_valid_configuration_asks_for_the_counter_tick() {
        let mut host = FakeHost::default();
        configured(&mut host, RULES);
        assert_eq!(host.tick, Some(Duration::from_secs(1)));
    }
}
