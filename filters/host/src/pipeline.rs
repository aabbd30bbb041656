//! [`PipelineHost`] and [`PipelineRoots`]: the hosts as the stages of a
//! chain that runs in one filter see them (the fused Wasm filter, the
//! native module): a stream's over the proxy beneath it ([`Proxy`]: the
//! plain Proxy-Wasm host, Envoy's dynamic-module ABI, the recording fake in
//! tests), and the stages' roots' over what the proxy gives a root ([`Host`]).
//!
//! One filter instance runs every stage, so a stage must not continue the
//! stream itself (later stages would never see the request), and a stage's
//! tick period is the chain's root to honour. What the stages of one stream
//! would each ask the proxy for again is kept here: the request and response
//! headers (read once per stream), the hand-off values one stage publishes
//! for the next, and the body of the current callback (read by the first
//! stage that asks). The roots record what they did to streams ([`Wake`])
//! for the chain's root to carry on through the stages after them.

use std::time::Duration;

use zerolayer_core::auth::identity::Published;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;
use zerolayer_core::usage::{Missing, Usage};

use std::marker::PhantomData;

use crate::host::{
    Body, Callback, Headers, Host, Platform, Respond, RootHost, Status, StreamHost,
    provider_of_path,
};
use crate::stage::DoneWith;
use crate::stage::Hosts;
use crate::stage::StageHost;

/// What a [`PipelineHost`] needs of the proxy beneath it besides [`StreamHost`].
pub trait Proxy: StreamHost {
    /// The whole of `map` (`None`: unreadable; the stages then ask header
    /// by header).
    fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock>;

    /// The first `size` bytes of `body` as the current callback has it (or
    /// more: the stages read the first `size`), copied once.
    fn read_body(&mut self, body: Body, size: usize) -> Vec<u8> {
        self.with_body(body, size, <[u8]>::to_vec)
    }

    /// A new host callback begins: what the proxy kept for the last one
    /// (a clock reading) is stale.
    fn begin_callback(&mut self) {}
}

/// A local response a stage asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// `:status`.
    pub status: u32,
    /// Headers besides `:status`.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl LocalResponse {
    /// The response as [`Respond::send_local_response`] was given it.
    pub fn new(status: u32, headers: &[(&str, &str)], body: &[u8]) -> LocalResponse {
        LocalResponse {
            status,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
        }
    }

    /// The headers as [`Respond::send_local_response`] takes them.
    pub fn header_pairs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

/// What a stage's root did to a stream it made effective, for the chain's
/// root to carry out on that stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// Resumed it: the stages after the one that paused run next.
    Resume,
    /// Answered it with this local response: nothing is left for the stages.
    Answer(LocalResponse),
}

/// The host of one stream's stages in a chain that runs in one filter:
/// what they would each ask the proxy again is kept here once.
pub struct PipelineHost<P> {
    proxy: P,
    /// The request headers, once read.
    request_headers: Option<HeaderBlock>,
    /// The response headers, once read.
    response_headers: Option<HeaderBlock>,
    /// Hand-off values (`wasmx.*` paths) the stages published.
    handoffs: Vec<(String, Vec<u8>)>,
    /// The body the current callback's stages read.
    body: Option<(Body, Vec<u8>)>,
    /// A stage replaced the callback's body: which, and its new length
    /// (the stages after read that much, not the callback's size).
    replaced: Option<(Body, usize)>,
    /// The request body kept past a pause in the body step, for the stages
    /// that run from a callout's answer (ngx_wasm_module).
    held_request: Option<Vec<u8>>,
    /// A stage (or a root) answered the request (a local response).
    answered: bool,
    /// A stage resumed the request (from a callout's answer).
    resumed: bool,
    /// What the stage running now said it is done with.
    done: DoneWith,
    /// The response's usage as the stage that reads it (metering) last
    /// shared it: the stages after it need not parse the body again.
    usage: Option<Result<Usage, Missing>>,
    /// The model the request body names, as the stage that read the body
    /// whole (quota) shared it.
    request_model: Option<Option<String>>,
    /// The response body bytes every stage passed, and whether the last did.
    response_passed: (u64, bool),
    /// The request's API, once a stage asked (every stage asks; `:path`
    /// set again forgets it).
    provider: Option<Option<Provider>>,
    /// Lazy-auth's published identity, parsed once a stage asked (four
    /// stages read it; publishing it again forgets it).
    identity: Option<Published>,
    /// The clock, read once per callback: the stages of one callback run
    /// within microseconds of each other, and each reading is a host call
    /// (~0.3 µs in V8); a wait spans callbacks, so it is still measured.
    clock: Option<Duration>,
}

impl<P: Proxy> PipelineHost<P> {
    /// The host for one stream's stages, over `proxy`.
    pub fn stream(proxy: P) -> PipelineHost<P> {
        PipelineHost {
            proxy,
            request_headers: None,
            response_headers: None,
            handoffs: Vec::new(),
            body: None,
            replaced: None,
            held_request: None,
            answered: false,
            resumed: false,
            done: DoneWith::default(),
            usage: None,
            request_model: None,
            response_passed: (0, false),
            provider: None,
            identity: None,
            clock: None,
        }
    }

    /// The stages run again outside a host callback of this stream (a root
    /// resumed it from its own callback): the clock is read afresh.
    pub fn refresh_clock(&mut self) {
        self.clock = None;
    }

    /// The proxy beneath (the chain's own calls).
    pub fn proxy(&mut self) -> &mut P {
        &mut self.proxy
    }

    /// The proxy beneath, to read.
    pub fn proxy_ref(&self) -> &P {
        &self.proxy
    }

    /// Reads `map` once, for every stage's header reads (unreadable: the
    /// stages ask the proxy header by header instead).
    pub fn read_headers(&mut self, map: Headers) {
        self.forget_derived(map, ":path");
        *self.headers(map) = self.proxy.read_headers(map);
    }

    /// A stage's root answered the request from a tick.
    pub fn mark_answered(&mut self) {
        self.answered = true;
    }

    /// Header `name` of `map` changes: what was derived from it is read again.
    fn forget_derived(&mut self, map: Headers, name: &str) {
        if map == Headers::Request && name.eq_ignore_ascii_case(":path") {
            self.provider = None;
        }
    }

    fn headers(&mut self, map: Headers) -> &mut Option<HeaderBlock> {
        match map {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        }
    }
}

/// The host of the stages' roots in a chain that runs in one filter, over
/// what the proxy gives a root: what they do to streams is recorded for the
/// chain's root ([`PipelineRoots::take_woken`]), the tick periods they ask
/// for for its scheduler.
pub struct PipelineRoots<P> {
    proxy: P,
    /// The stream calls act on, once a stage made one effective.
    effective: Option<u32>,
    /// What the stages did to streams, in order.
    woken: Vec<(u32, Wake)>,
    /// The tick period the stage being configured asked for.
    tick: Option<Duration>,
}

impl<P: Host> PipelineRoots<P> {
    /// The host for the stages' roots, over `proxy`.
    pub fn new(proxy: P) -> PipelineRoots<P> {
        PipelineRoots {
            proxy,
            effective: None,
            woken: Vec::new(),
            tick: None,
        }
    }

    /// The proxy beneath (the chain's own calls).
    pub fn proxy(&mut self) -> &mut P {
        &mut self.proxy
    }

    /// What the stages did to streams since the last call.
    pub fn take_woken(&mut self) -> Vec<(u32, Wake)> {
        std::mem::take(&mut self.woken)
    }

    /// The tick period the stage just configured asked for.
    pub fn take_tick(&mut self) -> Option<Duration> {
        self.tick.take()
    }

    /// Calls act on no stream until a stage makes one effective.
    pub fn leave_stream(&mut self) {
        self.effective = None;
    }
}

/// A chain in one filter as its stages see it: roots over `R`, each
/// stream over `S` (the fused filter: both the Proxy-Wasm host; the native
/// module: a worker's roots and a stream's Envoy).
pub struct Chain<R, S>(PhantomData<(R, S)>);

impl<R: Host + 'static, S: Proxy + 'static> Hosts for Chain<R, S> {
    type Root = PipelineRoots<R>;
    type Stream = PipelineHost<S>;
}

impl<P: Proxy> StageHost for PipelineHost<P> {
    fn body_size_after(&mut self, body: Body, size: usize) -> usize {
        match self.replaced {
            Some((replaced, len)) if replaced == body => len,
            _ => size,
        }
    }

    fn begin_callback(&mut self) {
        // The body read in the last callback may have changed (a new
        // chunk, more buffered).
        self.body = None;
        self.replaced = None;
        self.clock = None;
        self.proxy.begin_callback();
    }

    fn answered(&self) -> bool {
        self.answered
    }

    fn take_done(&mut self) -> DoneWith {
        std::mem::take(&mut self.done)
    }

    fn take_resumed(&mut self) -> bool {
        std::mem::take(&mut self.resumed)
    }

    fn hold_request_body(&mut self, size: usize) {
        // ngx_wasm_module hands a request body over only in the body step
        // and `on_log` (from a callout's answer the call traps); Envoy
        // anywhere in the stream.
        if self.held_request.is_none() && self.proxy.platform() == Platform::NgxWasm {
            self.held_request = Some(self.proxy.read_body(Body::Request, size));
        }
    }

    fn note_response_passed(&mut self, size: usize, end_of_stream: bool) {
        let (bytes, _) = self.response_passed;
        self.response_passed = (bytes + size as u64, end_of_stream);
    }
}

/// [`Host`] methods a wrapping host passes to the host in its field `$to`
/// as they are, by group: `clock` (`now`, `platform`), `shared_data`,
/// `queues`, `callouts` (`dispatch` and the answer's reads), `metrics`.
/// For use inside an `impl Host for …` block: `forward_host!(proxy: clock,
/// metrics);` (the pipeline hosts, the native stream's `EnvoyProxy`).
#[macro_export]
macro_rules! forward_host {
    ($to:ident: $($group:ident),+ $(,)?) => {
        $($crate::forward_host!(@$group $to);)+
    };
    (@clock $to:ident) => {
        fn now(&mut self) -> ::std::time::Duration {
            self.$to.now()
        }

        fn platform(&mut self) -> $crate::Platform {
            self.$to.platform()
        }
    };
    (@shared_data $to:ident) => {
        fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.$to.shared_get(key)
        }

        fn shared_set(
            &mut self,
            key: &str,
            value: &[u8],
            cas: Option<u32>,
        ) -> Result<(), $crate::Status> {
            self.$to.shared_set(key, value, cas)
        }
    };
    (@queues $to:ident) => {
        fn register_queue(&mut self, name: &str) -> Result<u32, $crate::Status> {
            self.$to.register_queue(name)
        }

        fn resolve_queue(&mut self, vm_id: &str, name: &str) -> Option<u32> {
            self.$to.resolve_queue(vm_id, name)
        }

        fn enqueue(&mut self, queue: u32, bytes: &[u8]) -> Result<(), $crate::Status> {
            self.$to.enqueue(queue, bytes)
        }

        fn dequeue(&mut self, queue: u32) -> Result<Option<Vec<u8>>, $crate::Status> {
            self.$to.dequeue(queue)
        }
    };
    (@callouts $to:ident) => {
        fn dispatch(
            &mut self,
            cluster: &str,
            headers: &[(&str, &str)],
            body: Option<&[u8]>,
            timeout: ::std::time::Duration,
        ) -> Result<u32, $crate::Status> {
            self.$to.dispatch(cluster, headers, body, timeout)
        }

        fn callout_status(&mut self) -> Option<u16> {
            self.$to.callout_status()
        }

        fn callout_body(&mut self, size: usize) -> Vec<u8> {
            self.$to.callout_body(size)
        }

        fn callout_retry_after(&mut self) -> Option<u64> {
            self.$to.callout_retry_after()
        }
    };
    (@metrics $to:ident) => {
        fn define_metric(
            &mut self,
            kind: $crate::MetricKind,
            name: $crate::MetricName<'_>,
        ) -> Result<$crate::MetricId, $crate::Status> {
            self.$to.define_metric(kind, name)
        }

        fn increment_metric(&mut self, id: u32, delta: i64) {
            self.$to.increment_metric(id, delta);
        }

        fn record_metric(&mut self, id: u32, value: u64) {
            self.$to.record_metric(id, value);
        }
    };
}

impl<P: Proxy> Host for PipelineHost<P> {
    crate::forward_host!(proxy: shared_data, queues, callouts, metrics);

    fn now(&mut self) -> Duration {
        *self.clock.get_or_insert_with(|| self.proxy.now())
    }

    fn platform(&mut self) -> Platform {
        self.proxy.platform()
    }

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, _period: Duration) -> Result<(), Status> {
        // Ticks are the roots'.
        Err(Status::BadArgument)
    }
}

impl<P: Proxy> Respond for PipelineHost<P> {
    fn resume(&mut self) {
        self.resumed = true;
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        self.answered = true;
        self.proxy.send_local_response(status, headers, body)
    }
}

impl<P: Proxy> StreamHost for PipelineHost<P> {
    fn with_header<T>(
        &mut self,
        map: Headers,
        name: &str,
        f: impl FnOnce(Option<&[u8]>) -> T,
    ) -> T {
        match self.headers(map) {
            Some(headers) => f(headers.get(name)),
            None => self.proxy.with_header(map, name, f),
        }
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        match self.headers(map) {
            Some(headers) => f(headers),
            None => self.proxy.with_headers(map, f),
        }
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        self.forget_derived(map, name);
        self.proxy.set_header(map, name, value);
        if let Some(headers) = self.headers(map) {
            headers.set(name, value);
        }
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        // The copy keeps one value per name and no stage reads an added
        // header back (activation's debug header): it stays as it is.
        self.proxy.add_header(map, name, value);
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        self.forget_derived(map, name);
        if let Some(headers) = self.headers(map) {
            if headers.get(name).is_none() {
                return false;
            }
            headers.remove(name);
        }
        self.proxy.remove_header(map, name)
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        if let (Body::Request, Some(held)) = (body, &self.held_request) {
            return f(held.get(..size).unwrap_or(held));
        }
        if !matches!(&self.body, Some((kept, _)) if *kept == body) {
            let bytes = self.proxy.read_body(body, size);
            self.body = Some((body, bytes));
        }
        let bytes = self.body.as_ref().map_or(&[][..], |(_, b)| b.as_slice());
        f(bytes.get(..size).unwrap_or(bytes))
    }

    fn set_body(&mut self, body: Body, size: usize, bytes: &[u8]) -> Result<(), Status> {
        if body == Body::Request && self.held_request.is_some() {
            // From a callout's answer the host takes no body back.
            return Err(Status::BadArgument);
        }
        // The stages after this one read the proxy's new body, of its new
        // length: `[0, size)` replaced (a stage replaces the whole chunk).
        let old_len = match self.body.take() {
            Some((kept, bytes)) if kept == body => bytes.len(),
            _ => size,
        };
        self.proxy.set_body(body, size, bytes)?;
        self.replaced = Some((body, bytes.len() + old_len.saturating_sub(size)));
        Ok(())
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        if let Some((_, value)) = self.handoffs.iter().find(|(p, _)| p == path) {
            return Some(value.clone());
        }
        self.proxy.property(path)
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        if path == internal::AUTH_PROPERTY {
            self.identity = None;
        }
        if path.starts_with(internal::HANDOFF_PREFIX) {
            match self.handoffs.iter_mut().find(|(p, _)| p == path) {
                Some(entry) => entry.1 = value.to_vec(),
                None => self.handoffs.push((path.to_string(), value.to_vec())),
            }
        }
        self.proxy.publish(path, value);
    }

    fn set_property(&mut self, path: &str, value: &[u8]) -> Result<(), Status> {
        if path == internal::AUTH_PROPERTY {
            self.identity = None;
        }
        self.proxy.set_property(path, value)
    }

    fn with_identity<T>(&mut self, f: impl FnOnce(&Published) -> T) -> T {
        let identity = match self.identity.take() {
            Some(kept) => kept,
            None => Published::parse(self.property(internal::AUTH_PROPERTY).as_deref()),
        };
        f(self.identity.insert(identity))
    }

    fn done_with(&mut self, callback: Callback) {
        self.done.insert(callback);
    }

    fn share_usage(&mut self, usage: Result<Usage, Missing>) {
        self.usage = Some(usage);
    }

    fn shared_usage(&mut self) -> Option<Result<Usage, Missing>> {
        self.usage
    }

    fn share_request_model(&mut self, model: Option<&str>) {
        self.request_model = Some(model.map(str::to_string));
    }

    fn shared_request_model(&mut self) -> Option<Option<&str>> {
        self.request_model.as_ref().map(Option::as_deref)
    }

    fn provider(&mut self) -> Option<Provider> {
        if let Some(provider) = self.provider {
            return provider;
        }
        let provider = self.with_header(Headers::Request, ":path", provider_of_path);
        self.provider = Some(provider);
        provider
    }

    fn response_passed(&mut self) -> Option<(u64, bool)> {
        Some(self.response_passed)
    }
}

impl<P: Host> Host for PipelineRoots<P> {
    crate::forward_host!(proxy: clock, shared_data, queues, callouts, metrics);

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        // The chain's root ticks the stage this often.
        self.tick = Some(period);
        Ok(())
    }
}

impl<P: Host> Respond for PipelineRoots<P> {
    fn resume(&mut self) {
        if let Some(id) = self.effective {
            self.woken.push((id, Wake::Resume));
        }
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        // A root answers a stream through the chain's root, on that stream
        // (natively: inside its own hook, on its worker).
        let id = self.effective.ok_or(Status::NotFound)?;
        let response = LocalResponse::new(status, headers, body);
        self.woken.push((id, Wake::Answer(response)));
        Ok(())
    }
}

impl<P: Host> RootHost for PipelineRoots<P> {
    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status> {
        // The chain's root makes it effective on the proxy when it carries
        // out what the stages did ([`PipelineRoots::take_woken`]).
        self.effective = Some(context_id);
        Ok(())
    }
}
