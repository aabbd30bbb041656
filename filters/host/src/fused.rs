//! [`FusedHost`]: the host as the stages of the fused `zerolayer.wasm` see
//! it. One filter instance runs every stage, so a stage must not continue
//! the stream itself (later stages would never see the request), and a
//! stage's tick period is the fused root's to honour. What the stages of
//! one stream would each ask the host for again is kept here and served
//! from the VM: the request and response headers (read once per stream),
//! the hand-off values one stage publishes for the next, and the body of
//! the current callback (read by the first stage that asks).
//!
//! A stream's pipeline owns one `FusedHost` ([`FusedHost::stream`]); the
//! fused root owns another ([`FusedHost::root`]) for the stages' roots,
//! which records the streams they resumed or answered from a tick, for the
//! root to carry on through the stages after them.

use std::time::Duration;

use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;

use crate::host::{Body, Callback, Headers, Host, MetricKind, Platform, Status};
use crate::stage::{DoneWith, StageHost, Wake};
use crate::wasm::WasmHost;

/// The fused filter's host: per stream, or for the stages' roots.
#[derive(Default)]
pub struct FusedHost {
    wasm: WasmHost,
    /// Serves one stream (else the stages' roots).
    stream: bool,
    /// Root: the stream calls act on, once a stage made one effective.
    effective: Option<u32>,
    /// Root: streams the stages resumed or answered, in order.
    woken: Vec<(u32, Wake)>,
    /// Root: the tick period the stage being configured asked for.
    tick: Option<Duration>,
    /// Stream: the request headers, once read.
    request_headers: Option<HeaderBlock>,
    /// Stream: the response headers, once read.
    response_headers: Option<HeaderBlock>,
    /// Stream: hand-off values (`wasmx.*` paths) the stages published.
    handoffs: Vec<(String, Vec<u8>)>,
    /// Stream: the body the current callback's stages read.
    body: Option<(Body, Vec<u8>)>,
    /// Stream: the request body kept past a pause in the body step, for
    /// the stages that run from a callout's answer (ngx_wasm_module).
    held_request: Option<Vec<u8>>,
    /// Stream: a stage answered the request (a local response).
    answered: bool,
    /// Stream: a stage resumed the request (from a callout's answer).
    resumed: bool,
    /// Stream: what the stage running now said it is done with.
    done: DoneWith,
}

impl FusedHost {
    /// The host for the stages' roots.
    pub fn root() -> FusedHost {
        FusedHost::default()
    }

    /// The host for one stream's stages.
    pub fn stream() -> FusedHost {
        FusedHost {
            stream: true,
            ..FusedHost::default()
        }
    }

    /// The plain host underneath (the fused filter's own calls).
    pub fn wasm(&mut self) -> &mut WasmHost {
        &mut self.wasm
    }

    /// Stream: reads `map` once, for every stage's header reads (unreadable:
    /// the stages ask the host header by header instead).
    pub fn read_headers(&mut self, map: Headers) {
        let headers = self.wasm.read_headers(map);
        *self.headers(map) = headers;
    }

    /// Stream: a stage's root answered the request from a tick.
    pub fn mark_answered(&mut self) {
        self.answered = true;
    }

    /// Root: the streams the stages resumed or answered since the last call.
    pub fn take_woken(&mut self) -> Vec<(u32, Wake)> {
        std::mem::take(&mut self.woken)
    }

    /// Root: the tick period the stage just configured asked for.
    pub fn take_tick(&mut self) -> Option<Duration> {
        self.tick.take()
    }

    /// Root: calls act on no stream until a stage makes one effective.
    pub fn leave_stream(&mut self) {
        self.effective = None;
    }

    fn headers(&mut self, map: Headers) -> &mut Option<HeaderBlock> {
        match map {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        }
    }
}

impl StageHost for FusedHost {
    fn begin_callback(&mut self) {
        // The body read in the last callback may have changed (a new
        // chunk, more buffered).
        self.body = None;
    }

    fn answered(&self) -> bool {
        self.answered
    }

    fn take_done(&mut self) -> DoneWith {
        std::mem::take(&mut self.done)
    }

    fn hold_request_body(&mut self, size: usize) {
        // ngx_wasm_module hands a request body over only in the body step
        // and `on_log` (from a callout's answer the call traps); Envoy
        // anywhere in the stream.
        if self.stream && self.held_request.is_none() && self.platform() == Platform::NgxWasm {
            self.held_request = Some(self.wasm.with_body(Body::Request, size, <[u8]>::to_vec));
        }
    }

    fn take_resumed(&mut self) -> bool {
        std::mem::take(&mut self.resumed)
    }
}

impl Host for FusedHost {
    fn now(&mut self) -> Duration {
        self.wasm.now()
    }

    fn platform(&mut self) -> Platform {
        self.wasm.platform()
    }

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        // The fused root ticks the stage this often.
        self.tick = Some(period);
        Ok(())
    }

    fn header(&mut self, map: Headers, name: &str) -> Option<Vec<u8>> {
        match self.headers(map) {
            Some(headers) => headers.get(name).map(<[u8]>::to_vec),
            None => self.wasm.header(map, name),
        }
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        match self.headers(map) {
            Some(headers) => f(headers),
            None => self.wasm.with_headers(map, f),
        }
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        self.wasm.set_header(map, name, value);
        if let Some(headers) = self.headers(map) {
            headers.set(name, value);
        }
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        // The copy keeps one value per name and no stage reads an added
        // header back (activation's debug header): it stays as it is.
        self.wasm.add_header(map, name, value);
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        if let Some(headers) = self.headers(map) {
            if headers.get(name).is_none() {
                return false;
            }
            headers.remove(name);
        }
        self.wasm.remove_header(map, name)
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        if !self.stream {
            return self.wasm.with_body(body, size, f);
        }
        if let (Body::Request, Some(held)) = (body, &self.held_request) {
            return f(held.get(..size).unwrap_or(held));
        }
        if !matches!(&self.body, Some((kept, _)) if *kept == body) {
            let bytes = self.wasm.with_body(body, size, <[u8]>::to_vec);
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
        // The stages after this one read the host's new body.
        self.body = None;
        self.wasm.set_body(body, size, bytes)
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        if let Some((_, value)) = self.handoffs.iter().find(|(p, _)| p == path) {
            return Some(value.clone());
        }
        self.wasm.property(path)
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        if self.stream && path.starts_with(internal::HANDOFF_PREFIX) {
            match self.handoffs.iter_mut().find(|(p, _)| p == path) {
                Some(entry) => entry.1 = value.to_vec(),
                None => self.handoffs.push((path.to_string(), value.to_vec())),
            }
        }
        self.wasm.publish(path, value);
    }

    fn set_property(&mut self, path: &str, value: &[u8]) -> Result<(), Status> {
        self.wasm.set_property(path, value)
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.wasm.shared_get(key)
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        self.wasm.shared_set(key, value, cas)
    }

    fn register_queue(&mut self, name: &str) -> Result<u32, Status> {
        self.wasm.register_queue(name)
    }

    fn resolve_queue(&mut self, vm_id: &str, name: &str) -> Option<u32> {
        self.wasm.resolve_queue(vm_id, name)
    }

    fn enqueue(&mut self, queue: u32, bytes: &[u8]) -> Result<(), Status> {
        self.wasm.enqueue(queue, bytes)
    }

    fn dequeue(&mut self, queue: u32) -> Result<Option<Vec<u8>>, Status> {
        self.wasm.dequeue(queue)
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        self.wasm.dispatch(cluster, headers, body, timeout)
    }

    fn callout_status(&mut self) -> Option<u16> {
        self.wasm.callout_status()
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        self.wasm.callout_body(size)
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        self.wasm.callout_retry_after()
    }

    fn resume(&mut self) {
        if self.stream {
            self.resumed = true;
        } else if let Some(id) = self.effective {
            self.woken.push((id, Wake::Resume));
        }
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        let sent = self.wasm.send_local_response(status, headers, body);
        if self.stream {
            self.answered = true;
        } else if let Some(id) = self.effective {
            self.woken.push((id, Wake::Answered));
        }
        sent
    }

    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status> {
        self.effective = Some(context_id);
        self.wasm.set_effective_context(context_id)
    }

    fn done_with(&mut self, callback: Callback) {
        self.done.insert(callback);
    }

    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: zerolayer_core::metrics::MetricName<'_>,
    ) -> Result<crate::MetricId, Status> {
        self.wasm.define_metric(kind, name)
    }

    fn increment_metric(&mut self, id: u32, delta: i64) {
        self.wasm.increment_metric(id, delta);
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        self.wasm.record_metric(id, value);
    }
}
