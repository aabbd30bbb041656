//! [`NativeHost`]: the `Host` the stages see inside the native module, over
//! Envoy's dynamic-module ABI ([`crate::abi`]). Like the fused Wasm filter's
//! host, one serves each stream's pipeline (headers read once, hand-offs and
//! the callback's body kept for the stages after the first that asks) and
//! another a worker's stage roots. Shared data and the observer's queue are
//! the process's ([`crate::store`]).
//!
//! Nothing here calls into Envoy in a way that re-enters the module while a
//! pipeline is borrowed: a local response and a resume are recorded and
//! carried out by the hook once the stages returned ([`Deferred`]), and what
//! a root does to a stream reaches that stream through its own scheduled
//! event, on its worker, inside its own hook.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The wall clock since the Unix epoch (zero before it), as `Host::now`
/// reads it in the module's hosts.
pub(crate) fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;
use zerolayer_host::{
    Body, Callback, CalloutAnswer, DoneWith, Headers, Host, MetricKind, Platform, StageHost, Status,
};

use crate::abi::{self, BodyKind, FilterEnvoy, HeaderMap};
use crate::chain::Process;

/// A local response a stage asked for, sent once the stages returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// `:status`.
    pub status: u32,
    /// Headers besides `:status`.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// What a root did to one of its worker's streams (carried to it by its
/// scheduled event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Woken {
    /// Resume it through the stages after the one that paused.
    Resume,
    /// Answer it.
    Answer(LocalResponse),
}

/// The native module's host: a stream's, or a worker's roots'.
pub struct NativeHost {
    process: Arc<Process>,
    /// The stream's Envoy handle (null for the roots' host outside a hook).
    filter: FilterEnvoy,
    /// Serves one stream (else a worker's roots).
    stream: bool,
    /// Roots: the stream later calls act on, once a stage made one effective.
    effective: Option<u32>,
    /// Roots: what the stages did to streams, in order.
    woken: Vec<(u32, Woken)>,
    /// Roots: the tick period the stage being configured asked for.
    tick: Option<Duration>,
    request_headers: Option<HeaderBlock>,
    response_headers: Option<HeaderBlock>,
    handoffs: Vec<(String, Vec<u8>)>,
    body: Option<(Body, Vec<u8>)>,
    /// Whether the filter had Envoy buffer the request / response body
    /// (then the body is the buffered chunks and the one received).
    pub buffering_request: bool,
    /// See `buffering_request`.
    pub buffering_response: bool,
    answered: bool,
    resumed: bool,
    done: DoneWith,
    /// The local response to send once the stages returned.
    pending_response: Option<LocalResponse>,
    answer: Option<CalloutAnswer>,
    /// The clock, read once per callback: the stages ask it a dozen times
    /// a request, and one instant serves a callback as Envoy's own
    /// dispatcher time does.
    clock: Option<Duration>,
}

impl NativeHost {
    /// The host for one stream's stages.
    pub fn stream(process: Arc<Process>, filter: FilterEnvoy) -> NativeHost {
        NativeHost {
            stream: true,
            ..NativeHost::roots(process)
        }
        .with_filter(filter)
    }

    /// The host for a worker's stage roots.
    pub fn roots(process: Arc<Process>) -> NativeHost {
        NativeHost {
            process,
            filter: std::ptr::null_mut(),
            stream: false,
            effective: None,
            woken: Vec::new(),
            tick: None,
            request_headers: None,
            response_headers: None,
            handoffs: Vec::new(),
            body: None,
            buffering_request: false,
            buffering_response: false,
            answered: false,
            resumed: false,
            done: DoneWith::default(),
            pending_response: None,
            answer: None,
            clock: None,
        }
    }

    /// The process state this host reaches.
    pub fn process(&self) -> &Process {
        &self.process
    }

    fn with_filter(mut self, filter: FilterEnvoy) -> NativeHost {
        self.filter = filter;
        self
    }

    /// Roots: calls that need a stream handle (metrics) use `filter`'s
    /// for the hook being run.
    pub fn enter(&mut self, filter: FilterEnvoy) {
        self.filter = filter;
    }

    /// Roots: the hook is over; no handle is valid any more.
    pub fn leave(&mut self) {
        self.filter = std::ptr::null_mut();
        self.effective = None;
        self.clock = None;
    }

    /// Stream: reads `map` once, for every stage's header reads.
    pub fn read_headers(&mut self, map: Headers) {
        if !self.live() {
            // The roots see no stream's headers (a hook's handle is
            // another stream's than the one a root made effective).
            return;
        }
        // SAFETY: the handle of the hook being run.
        let block = unsafe { abi::header_block(self.filter, header_map(map)) };
        *self.headers(map) = Some(block);
    }

    /// Stream: the size of `body` as the current callback has it (the
    /// chunks Envoy buffered for this filter, and the one received).
    pub fn body_size(&mut self, body: Body) -> usize {
        if self.filter.is_null() {
            return 0;
        }
        self.body_kinds(body)
            .iter()
            // SAFETY: the handle of the hook being run.
            .map(|kind| unsafe { abi::body_size(self.filter, *kind) })
            .sum()
    }

    fn body_kinds(&self, body: Body) -> &'static [BodyKind] {
        match (body, self.buffering_request, self.buffering_response) {
            (Body::Request, true, _) => &[BodyKind::BufferedRequest, BodyKind::ReceivedRequest],
            (Body::Request, false, _) => &[BodyKind::ReceivedRequest],
            (Body::Response, _, true) => &[BodyKind::BufferedResponse, BodyKind::ReceivedResponse],
            (Body::Response, _, false) => &[BodyKind::ReceivedResponse],
        }
    }

    /// Stream: a root answered the request (its response was sent).
    pub fn mark_answered(&mut self) {
        self.answered = true;
    }

    /// Stream: the local response a stage asked for, to send now.
    pub fn take_response(&mut self) -> Option<LocalResponse> {
        self.pending_response.take()
    }

    /// Stream: a callout's answer is being delivered (`None` after).
    pub fn set_answer(&mut self, answer: Option<CalloutAnswer>) {
        self.answer = answer;
    }

    /// Roots: what the stages did to streams since the last call.
    pub fn take_woken(&mut self) -> Vec<(u32, Woken)> {
        std::mem::take(&mut self.woken)
    }

    /// Roots: the tick period the stage just configured asked for.
    pub fn take_tick(&mut self) -> Option<Duration> {
        self.tick.take()
    }

    fn headers(&mut self, map: Headers) -> &mut Option<HeaderBlock> {
        match map {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        }
    }

    /// Whether calls on the stream's handle may be made now.
    fn live(&self) -> bool {
        self.stream && !self.filter.is_null()
    }
}

fn header_map(map: Headers) -> HeaderMap {
    match map {
        Headers::Request => HeaderMap::Request,
        Headers::Response => HeaderMap::Response,
    }
}

impl StageHost for NativeHost {
    fn begin_callback(&mut self) {
        self.body = None;
        self.clock = None;
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
}

impl Host for NativeHost {
    fn now(&mut self) -> Duration {
        *self.clock.get_or_insert_with(unix_now)
    }

    fn platform(&mut self) -> Platform {
        Platform::Envoy
    }

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        self.tick = Some(period);
        Ok(())
    }

    fn header(&mut self, map: Headers, name: &str) -> Option<Vec<u8>> {
        if self.headers(map).is_none() {
            self.read_headers(map);
        }
        self.headers(map)
            .as_ref()
            .and_then(|h| h.get(name))
            .map(<[u8]>::to_vec)
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        if self.headers(map).is_none() {
            self.read_headers(map);
        }
        match self.headers(map) {
            Some(headers) => f(headers),
            None => f(&HeaderBlock::default()),
        }
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        if !self.live() {
            return;
        }
        // SAFETY: the handle of the hook being run.
        unsafe { abi::set_header(self.filter, header_map(map), name.as_bytes(), Some(value)) };
        if let Some(headers) = self.headers(map) {
            headers.set(name, value);
        }
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        if !self.live() {
            return;
        }
        // SAFETY: the handle of the hook being run.
        unsafe { abi::add_header(self.filter, header_map(map), name.as_bytes(), value) };
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        if !self.live() {
            return false;
        }
        if let Some(headers) = self.headers(map) {
            if headers.get(name).is_none() {
                return false;
            }
            headers.remove(name);
        }
        // SAFETY: the handle of the hook being run.
        unsafe { abi::set_header(self.filter, header_map(map), name.as_bytes(), None) }
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        if !self.live() {
            return f(&[]);
        }
        if !matches!(&self.body, Some((kept, _)) if *kept == body) {
            let mut bytes = Vec::with_capacity(size);
            for kind in self.body_kinds(body) {
                // SAFETY: the handle of the hook being run.
                unsafe { abi::append_body(self.filter, *kind, &mut bytes) };
            }
            self.body = Some((body, bytes));
        }
        let bytes = self.body.as_ref().map_or(&[][..], |(_, b)| b.as_slice());
        f(bytes.get(..size).unwrap_or(bytes))
    }

    fn set_body(&mut self, body: Body, _size: usize, bytes: &[u8]) -> Result<(), Status> {
        if !self.live() {
            return Err(Status::BadArgument);
        }
        self.body = None;
        let kinds = self.body_kinds(body);
        // The new body goes where the last of it is; the rest is emptied.
        for (i, kind) in kinds.iter().enumerate() {
            let replacement = if i + 1 == kinds.len() { bytes } else { &[] };
            // SAFETY: the handle of the hook being run.
            if !unsafe { abi::replace_body(self.filter, *kind, replacement) } {
                return Err(Status::InternalFailure);
            }
        }
        Ok(())
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        if let Some((_, value)) = self.handoffs.iter().find(|(p, _)| p == path) {
            return Some(value.clone());
        }
        if !self.live() {
            return None;
        }
        match path {
            // SAFETY: the handle of the hook being run.
            "source.address" => unsafe { abi::source_address(self.filter) },
            _ => None,
        }
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        if !self.stream {
            return;
        }
        match self.handoffs.iter_mut().find(|(p, _)| p == path) {
            Some(entry) => entry.1 = value.to_vec(),
            None => self.handoffs.push((path.to_string(), value.to_vec())),
        }
        // The access log reads hand-offs as the Wasm forms publish them:
        // `%FILTER_STATE(wasm.wasmx.zerolayer_auth:PLAIN)%`.
        if self.live() && path.starts_with(internal::HANDOFF_PREFIX) {
            let key = format!("wasm.{path}");
            // SAFETY: the handle of the hook being run.
            unsafe { abi::set_filter_state(self.filter, key.as_bytes(), value) };
        }
    }

    fn set_property(&mut self, _path: &str, _value: &[u8]) -> Result<(), Status> {
        Err(Status::NotFound)
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.process.data.get(key)
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        self.process.data.set(key, value, cas)
    }

    fn register_queue(&mut self, _name: &str) -> Result<u32, Status> {
        // The observer's thread owns the one queue.
        Err(Status::BadArgument)
    }

    fn resolve_queue(&mut self, _vm_id: &str, name: &str) -> Option<u32> {
        let queue = self.process.queue.as_ref()?;
        (queue.name() == name).then_some(1)
    }

    fn enqueue(&mut self, _queue: u32, bytes: &[u8]) -> Result<(), Status> {
        match &self.process.queue {
            Some(queue) => queue.post(bytes),
            None => Err(Status::NotFound),
        }
    }

    fn dequeue(&mut self, _queue: u32) -> Result<Option<Vec<u8>>, Status> {
        Err(Status::BadArgument)
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        if !self.live() {
            // The roots have no callouts natively: their work is the
            // observer thread's.
            return Err(Status::BadArgument);
        }
        // SAFETY: the handle of the hook being run.
        unsafe {
            abi::callout(
                self.filter,
                cluster.as_bytes(),
                headers,
                body.unwrap_or_default(),
                timeout.as_millis() as u64,
            )
        }
    }

    fn callout_status(&mut self) -> Option<u16> {
        self.answer.as_ref().and_then(|a| a.status)
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        self.answer.as_ref().and_then(|a| a.retry_after_secs)
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        self.answer
            .as_ref()
            .map(|a| a.body[..size.min(a.body.len())].to_vec())
            .unwrap_or_default()
    }

    fn resume(&mut self) {
        if self.stream {
            self.resumed = true;
        } else if let Some(id) = self.effective {
            self.woken.push((id, Woken::Resume));
        }
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        let response = LocalResponse {
            status,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
        };
        if self.stream {
            self.answered = true;
            self.pending_response = Some(response);
            Ok(())
        } else if let Some(id) = self.effective {
            self.woken.push((id, Woken::Answer(response)));
            Ok(())
        } else {
            Err(Status::NotFound)
        }
    }

    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status> {
        self.effective = Some(context_id);
        Ok(())
    }

    fn done_with(&mut self, callback: Callback) {
        self.done.insert(callback);
    }

    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: zerolayer_core::metrics::MetricName<'_>,
    ) -> Result<zerolayer_host::MetricId, Status> {
        self.process.metrics.define(kind, name)
    }

    fn increment_metric(&mut self, id: u32, delta: i64) {
        self.process.metrics.add(id, delta);
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        self.process.metrics.record(id, value);
    }
}
