//! A stage of the chain as zerolayer writes it: a root ([`RootStage`]) and
//! a stream per request ([`StreamStage`]), each callback handed its host:
//! the root a [`RootHost`], each stream a [`StreamHost`] ([`Hosts`] names
//! the pair).
//! The same stage runs as its own filter ([`standalone`]: a module crate
//! registers it), inside a chain in one filter (on [`crate::PipelineHost`]: the
//! fused filter, the native module), and in native tests (on [`crate::FakeHost`]).

#[cfg(feature = "wasm")]
use proxy_wasm::traits::{Context, HttpContext, RootContext};
#[cfg(feature = "wasm")]
use proxy_wasm::types::ContextType;

use crate::host::{Action, Body, Callback, RootHost, StreamHost};
#[cfg(feature = "wasm")]
use crate::wasm::WasmHost;

/// The hosts a stage runs on: its root's and its streams' (one type for
/// both in a filter of its own and in tests; two in a chain in one filter).
pub trait Hosts: 'static {
    /// The root's host.
    type Root: RootHost;
    /// Each stream's host.
    type Stream: StreamHost;
}

/// A stage's root: configuration, tick, its own callouts' answers.
pub trait RootStage<H: Hosts> {
    /// Configures the stage from `configuration` (its plugin configuration,
    /// or its section of the fused filter's); `false` refuses it, after one
    /// log line naming the field.
    fn configure(&mut self, host: &mut H::Root, configuration: &[u8]) -> bool;

    /// The tick the stage asked for with `Host::set_tick_period`.
    fn tick(&mut self, _host: &mut H::Root) {}

    /// Hands over now what it keeps in memory to report (counters, batched
    /// audit records), and nothing else of its tick: for a host whose roots
    /// tick only inside requests (the native module, at each stream's end,
    /// so nothing waits for the next request to be reported).
    fn flush(&mut self, _host: &mut H::Root) {}

    /// A callout the root made has an answer (the token may be another's:
    /// the fused root asks every stage).
    fn call_answered(&mut self, _host: &mut H::Root, _token: u32, _body_size: usize) {}

    /// The VM is going away: report what is pending.
    fn done(&mut self, _host: &mut H::Root) {}

    /// The stage's part of a new request (`context_id` is the stream's).
    fn stream(&self, context_id: u32) -> Box<dyn StreamStage<H::Stream>>;
}

/// A stage's part of one request, callback by callback.
pub trait StreamStage<H: StreamHost> {
    /// The request headers.
    fn request_headers(&mut self, _host: &mut H, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// The request body (`body_size`: buffered so far).
    fn request_body(&mut self, _host: &mut H, _body_size: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// The response headers.
    fn response_headers(&mut self, _host: &mut H, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// A response chunk.
    fn response_body(&mut self, _host: &mut H, _body_size: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// A callout this stream made has an answer (or another stage's did).
    fn call_answered(&mut self, _host: &mut H, _token: u32, _body_size: usize) {}

    /// The access log: the request is over.
    fn log(&mut self, _host: &mut H) {}
}

/// The callbacks one stage of one stream is done with.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DoneWith(u8);

impl DoneWith {
    fn bit(callback: Callback) -> u8 {
        match callback {
            Callback::RequestBody => 1,
            Callback::ResponseBody => 2,
        }
    }

    /// Whether the stage said it is done with `callback`.
    pub fn contains(self, callback: Callback) -> bool {
        self.0 & DoneWith::bit(callback) != 0
    }

    /// Adds what `other` holds.
    pub fn add(&mut self, other: DoneWith) {
        self.0 |= other.0;
    }

    /// Adds `callback`.
    pub fn insert(&mut self, callback: Callback) {
        self.0 |= DoneWith::bit(callback);
    }
}

/// What a pipeline of stages sharing one host needs of it besides [`StreamHost`]:
/// the state of the callback being run through them: [`crate::PipelineHost`]
/// in the fused filter and the native module, [`crate::FakeHost`] in the
/// pipeline's own tests.
pub trait StageHost: StreamHost {
    /// A new host callback begins (what was read in the last one is stale).
    fn begin_callback(&mut self);
    /// Whether a stage answered the request (a local response).
    fn answered(&self) -> bool;
    /// What the stage that just ran said it is done with (and forgets it).
    fn take_done(&mut self) -> DoneWith;
    /// Whether a stage resumed the stream since the last call.
    fn take_resumed(&mut self) -> bool;
    /// A stage paused the request in its body step (`size` bytes): the
    /// stages after it run later, from a callout's answer, where a host may
    /// not hand a request body over (ngx_wasm_module traps): keep it for
    /// them. Hosts that can, need not.
    fn hold_request_body(&mut self, _size: usize) {}
    /// The size of `body` for the next stage of this callback: a stage's
    /// replacement's length, else `size` (the callback's).
    fn body_size_after(&mut self, _body: Body, size: usize) -> usize {
        size
    }
    /// A response body callback of `size` bytes went through every stage
    /// (`end_of_stream`: the response's last): what
    /// [`StreamHost::response_passed`] reports.
    fn note_response_passed(&mut self, _size: usize, _end_of_stream: bool) {}
}

/// `stage` as a filter of its own: the root context a module crate
/// registers with `proxy_wasm::set_root_context`.
#[cfg(feature = "wasm")]
pub fn standalone<R: RootStage<WasmHost> + 'static>(stage: R) -> Box<dyn RootContext> {
    Box::new(FilterRoot { stage })
}

/// A stage's root as a Proxy-Wasm root context.
#[cfg(feature = "wasm")]
struct FilterRoot<R> {
    stage: R,
}

#[cfg(feature = "wasm")]
impl<R: RootStage<WasmHost>> Context for FilterRoot<R> {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.stage.call_answered(&mut WasmHost, token, body_size);
    }

    fn on_done(&mut self) -> bool {
        self.stage.done(&mut WasmHost);
        true
    }
}

#[cfg(feature = "wasm")]
impl<R: RootStage<WasmHost>> RootContext for FilterRoot<R> {
    fn on_configure(&mut self, _size: usize) -> bool {
        let mut host = WasmHost;
        let configuration = host.plugin_configuration();
        self.stage.configure(&mut host, &configuration)
    }

    fn on_tick(&mut self) {
        self.stage.tick(&mut WasmHost);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always a context: the SDK panics on `None`.
        Some(Box::new(FilterStream {
            stage: self.stage.stream(context_id),
        }))
    }
}

/// A stage's stream as a Proxy-Wasm HTTP context.
#[cfg(feature = "wasm")]
struct FilterStream {
    stage: Box<dyn StreamStage<WasmHost>>,
}

#[cfg(feature = "wasm")]
impl Context for FilterStream {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.stage.call_answered(&mut WasmHost, token, body_size);
    }
}

#[cfg(feature = "wasm")]
impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        self.stage.request_headers(&mut WasmHost, end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.stage
            .request_body(&mut WasmHost, body_size, end_of_stream)
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        self.stage.response_headers(&mut WasmHost, end_of_stream)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.stage
            .response_body(&mut WasmHost, body_size, end_of_stream)
    }

    fn on_log(&mut self) {
        self.stage.log(&mut WasmHost);
    }
}
