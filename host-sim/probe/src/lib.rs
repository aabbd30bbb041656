//! zerolayer probe: a test-only Proxy-Wasm plugin for host-sim's
//! differential suite. The same scenarios run through Envoy and through
//! host-sim; the probe makes host features observable as HTTP headers,
//! bodies and metrics, driven entirely by the request header
//! `x-probe-action` (a comma-separated list of actions, run in order).
//!
//! One module, three roles chosen by the configuration (see `config`):
//! - `singleton` (a bootstrap service): registers a shared queue and drains
//!   it on `on_queue_ready` and on every tick (see `singleton`);
//! - `filter` (an HTTP filter): runs the actions;
//! - `trivial` (an HTTP filter): adds two request headers, nothing else —
//!   the floor the benchmarks compare the filters with;
//! - `chain` (an HTTP filter): the host calls the zerolayer chain needs,
//!   no logic — the floor of what the chain must ask its host (see
//!   `chain`).
//!
//! Lifecycle of the filter, top to bottom: configuration → request headers
//! (run the actions) → request body (`body-size`) → callout response
//! (`callout`) → response headers (report) → response body (`replace-body`).
//!
//! The request is held (headers return `Pause`) while a callout is pending
//! or `body-size` waits for the end of the body; whichever finishes last
//! releases it: the body callback by returning `Continue`, the callout
//! callback by `resume_http_request`. This assumes `Pause` from the headers
//! callback means StopIteration (the body callbacks still run): in Envoy
//! that takes `allow_on_headers_stop_iteration: true` in the plugin config
//! (see `envoy.yaml`); by default Envoy stops everything instead, and
//! `body-size` on a request with a body then waits for the idle timeout.
//!
//! Shared data and queues are scoped by vm_id in Envoy: `queue-total`
//! (the singleton's `probe_queue_total`) reads `absent` from a filter in
//! another VM.
// A probe of the host itself, not stage code: it makes the raw host calls
// on purpose (clippy.toml keeps them out of the stages).
#![allow(clippy::disallowed_methods)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod actions;
mod chain;
mod config;
mod metrics;
mod singleton;

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use actions::Step;
use config::{Config, Role};
use metrics::FilterMetrics;
use singleton::Singleton;

/// The request header listing the actions.
const ACTION_HEADER: &str = "x-probe-action";
/// The filter state property `set-state` writes and response headers read.
const STATE_PROPERTY: &str = "wasmx.probe_state";
/// How long a callout may take.
const CALLOUT_TIMEOUT: Duration = Duration::from_secs(5);

/// The module's entry point (`_initialize`): registers the root context.
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(ProbeRoot::default()) });
    }}
}

/// What every request of a filter-role plugin shares.
struct FilterPlan {
    queue_vm_id: String,
    queue_name: String,
    cluster: String,
    metrics: FilterMetrics,
}

/// What the configuration made of this plugin instance.
enum Configured {
    Filter(Rc<FilterPlan>),
    Singleton(Singleton),
    Trivial,
    Chain,
}

/// The plugin's root context: owns the configuration.
#[derive(Default)]
struct ProbeRoot {
    role: Option<Configured>,
}

impl Context for ProbeRoot {}

impl RootContext for ProbeRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            _ => Vec::new(),
        };
        let config = match Config::from_json(&bytes) {
            Ok(config) => config,
            Err(err) => {
                log::error!("probe: invalid configuration: {err}");
                return false;
            }
        };
        let role = match config.role {
            Role::Singleton => match Singleton::register(&config.queue_name) {
                Ok(singleton) => Configured::Singleton(singleton),
                Err(err) => {
                    log::error!("probe: field `queue_name`: {err}");
                    return false;
                }
            },
            Role::Filter => Configured::Filter(Rc::new(FilterPlan {
                metrics: FilterMetrics::define(),
                queue_vm_id: config.queue_vm_id,
                queue_name: config.queue_name,
                cluster: config.cluster,
            })),
            Role::Trivial => Configured::Trivial,
            Role::Chain => Configured::Chain,
        };
        if config.tick_ms > 0
            && let Err(status) =
                hostcalls::set_tick_period(Duration::from_millis(u64::from(config.tick_ms)))
        {
            log::warn!("probe: no tick ({status:?})");
        }
        log::info!(
            "probe: configured as {:?}, tick {} ms",
            config.role,
            config.tick_ms
        );
        self.role = Some(role);
        true
    }

    fn on_tick(&mut self) {
        match &self.role {
            Some(Configured::Filter(plan)) => plan.metrics.tick(),
            Some(Configured::Singleton(singleton)) => singleton.tick(),
            Some(Configured::Trivial | Configured::Chain) | None => {}
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(Configured::Singleton(singleton)) = &self.role {
            singleton.queue_ready(queue_id);
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        // One module serves both roles; a singleton is never asked for a
        // stream context, so declaring HTTP for both is harmless.
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always a context (the SDK panics on None). Without a filter plan
        // (refused configuration, or a singleton configured as a filter)
        // the stream passes through untouched.
        let plan = match &self.role {
            Some(Configured::Filter(plan)) => Some(plan.clone()),
            Some(Configured::Trivial) => return Some(Box::new(TrivialStream)),
            Some(Configured::Chain) => return Some(Box::new(chain::ChainStream::default())),
            _ => None,
        };
        Some(Box::new(ProbeStream {
            plan,
            ..ProbeStream::default()
        }))
    }
}

/// A stream of the trivial role: two request headers added, nothing else —
/// what the issue's floor measurement ran ("a filter that only adds two
/// headers").
struct TrivialStream;

impl Context for TrivialStream {}

impl HttpContext for TrivialStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let _ = hostcalls::add_map_value(MapType::HttpRequestHeaders, "x-trivial-1", "1");
        let _ = hostcalls::add_map_value(MapType::HttpRequestHeaders, "x-trivial-2", "2");
        Action::Continue
    }
}

/// A response header an action asked for, in action order.
enum Note {
    /// A header whose value is known at request time.
    Header(&'static str, String),
    /// `x-probe-state`: the `set-state` property, read at response time.
    State,
    /// `x-probe-late-request-headers`: how many request headers the filter
    /// still sees in the response phase (Envoy drops a filter's request
    /// headers once it let them through).
    LateHeaders,
}

/// One request passing through the filter.
#[derive(Default)]
struct ProbeStream {
    plan: Option<Rc<FilterPlan>>,
    notes: Vec<Note>,
    /// Tokens of callouts not answered yet.
    callouts: Vec<u32>,
    /// `body-size` waits for the end of the request body.
    awaiting_body: bool,
    /// The request body size last seen (for a body ended by trailers).
    body_seen: usize,
    /// `local-<status>` answered the request: nothing else may resume it.
    local_sent: bool,
    /// `replace-body` asked for.
    replace_body: bool,
}

impl ProbeStream {
    /// Whether the request must stay held.
    fn held(&self) -> bool {
        self.awaiting_body || !self.callouts.is_empty()
    }

    /// What the request callbacks return once their own work is done.
    fn request_action(&self) -> Action {
        if self.held() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Runs one action; `false` stops the list (a local response was sent).
    fn run(&mut self, plan: &FilterPlan, step: Step<'_>, end_of_stream: bool) -> bool {
        match step {
            Step::SharedIncr => self
                .notes
                .push(Note::Header("x-probe-counter", actions::shared_incr())),
            Step::CasStale => self
                .notes
                .push(Note::Header("x-probe-cas", actions::cas_stale())),
            Step::Enqueue => self.notes.push(Note::Header(
                "x-probe-enqueued",
                actions::enqueue(&plan.queue_vm_id, &plan.queue_name),
            )),
            Step::QueueTotal => self
                .notes
                .push(Note::Header("x-probe-queue-total", actions::queue_total())),
            Step::Local(status) => {
                let body = format!("probe local {status}\n");
                if let Err(status) = hostcalls::send_http_response(
                    status,
                    vec![("x-probe-local", "yes"), ("content-type", "text/plain")],
                    Some(body.as_bytes()),
                ) {
                    log::warn!("probe: local response failed: {status:?}");
                }
                self.local_sent = true;
                return false;
            }
            Step::Callout => self.dispatch_callout(&plan.cluster),
            Step::BodySize => {
                if end_of_stream {
                    add_request_header("x-probe-body-size", "0");
                } else {
                    self.awaiting_body = true;
                }
            }
            Step::Property(path) => {
                let value = actions::property(path);
                add_request_header(&actions::property_header(path), &value);
            }
            Step::SetState => {
                if let Err(status) =
                    hostcalls::set_property(vec![STATE_PROPERTY], Some(b"probe-value"))
                {
                    log::warn!("probe: set {STATE_PROPERTY} failed: {status:?}");
                }
                self.notes.push(Note::State);
            }
            Step::ReplaceBody => self.replace_body = true,
            Step::LateHeaders => self.notes.push(Note::LateHeaders),
        }
        true
    }

    /// `callout`: a GET to the configured cluster; the request waits for
    /// the answer unless the dispatch itself fails.
    fn dispatch_callout(&mut self, cluster: &str) {
        match hostcalls::dispatch_http_call(
            cluster,
            vec![
                (":method", "GET"),
                (":path", "/probe-callout"),
                (":authority", "probe"),
                ("x-probe-callout", "1"),
            ],
            None,
            vec![],
            CALLOUT_TIMEOUT,
        ) {
            Ok(token) => self.callouts.push(token),
            Err(status) => {
                log::warn!("probe: callout to {cluster} failed: {status:?}");
                add_request_header("x-probe-callout-status", "dispatch-error");
            }
        }
    }

    /// Ends `body-size`: the size goes upstream as a request header.
    fn body_done(&mut self, body_size: usize) {
        self.awaiting_body = false;
        add_request_header("x-probe-body-size", &body_size.to_string());
    }
}

impl Context for ProbeStream {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(index) = self.callouts.iter().position(|t| *t == token_id) else {
            return;
        };
        self.callouts.swap_remove(index);
        if self.local_sent {
            return;
        }
        // A failed callout (reset, timeout) arrives without headers.
        let status =
            match hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status") {
                Ok(Some(status)) => actions::render_value(&status),
                _ => "failed".to_string(),
            };
        add_request_header("x-probe-callout-status", &status);
        add_request_header("x-probe-callout-body-bytes", &body_size.to_string());
        if !self.held()
            && let Err(status) = hostcalls::resume_http_request()
        {
            log::warn!("probe: resume after callout failed: {status:?}");
        }
    }
}

impl HttpContext for ProbeStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        plan.metrics.request();
        let list = match hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ACTION_HEADER)
        {
            Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
            _ => String::new(),
        };
        for action in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let Some(step) = Step::parse(action) else {
                log::warn!("probe: unknown action {action:?} ignored");
                plan.metrics.action(actions::Kind::Unknown);
                continue;
            };
            plan.metrics.action(step.kind());
            if !self.run(&plan, step, end_of_stream) {
                return Action::Pause;
            }
        }
        self.request_action()
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.awaiting_body {
            if !end_of_stream {
                // Pause buffers the body: the next call sees all of it.
                self.body_seen = body_size;
                return Action::Pause;
            }
            self.body_done(body_size);
        }
        // Returning Continue here would also release held headers.
        self.request_action()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.awaiting_body {
            self.body_done(self.body_seen);
        }
        self.request_action()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.plan.is_none() {
            return Action::Continue;
        }
        let status = match hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, ":status") {
            Ok(Some(status)) => actions::render_value(&status),
            _ => "absent".to_string(),
        };
        add_response_header("x-probe-upstream-status", &status);
        for note in &self.notes {
            match note {
                Note::Header(name, value) => add_response_header(name, value),
                Note::State => {
                    let value = match hostcalls::get_property(vec![STATE_PROPERTY]) {
                        Ok(Some(value)) => actions::render_value(&value),
                        Ok(None) => "absent".to_string(),
                        Err(status) => actions::error(status),
                    };
                    add_response_header("x-probe-state", &value);
                }
                Note::LateHeaders => {
                    let value = match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
                        Ok(pairs) => pairs.len().to_string(),
                        Err(status) => actions::error(status),
                    };
                    add_response_header("x-probe-late-request-headers", &value);
                }
            }
        }
        if self.replace_body && !end_of_stream {
            // The replacement has another length.
            let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, "content-length");
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.replace_body {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.replace_body = false;
        let replacement = format!("probe replaced {body_size}");
        if let Err(status) = hostcalls::set_buffer(
            BufferType::HttpResponseBody,
            0,
            body_size,
            replacement.as_bytes(),
        ) {
            log::warn!("probe: replace response body failed: {status:?}");
        }
        Action::Continue
    }
}

fn add_request_header(name: &str, value: &str) {
    if let Err(status) = hostcalls::add_map_value(MapType::HttpRequestHeaders, name, value) {
        log::warn!("probe: request header {name} not added: {status:?}");
    }
}

fn add_response_header(name: &str, value: &str) {
    if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
        log::warn!("probe: response header {name} not added: {status:?}");
    }
}
