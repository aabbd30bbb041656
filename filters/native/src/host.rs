//! [`NativeHost`] and [`NativeRoots`]: the hosts the stages see inside the
//! native module. A stream's pipeline runs on a [`PipelineHost`] over
//! Envoy's dynamic-module ABI through its stream ([`EnvoyProxy`],
//! [`crate::envoy`]); a worker's stage roots on a [`PipelineRoots`] over the
//! process ([`EnvoyRoots`]: no stream, so no stream methods; their work on
//! streams reaches each stream through its own scheduled event, on its
//! worker, inside its own hook). Shared data and the observer's queue are
//! the process's ([`crate::store`]).
//!
//! Nothing here calls into Envoy in a way that re-enters the module while a
//! pipeline is borrowed: a local response is recorded and sent by the hook
//! once the stages returned (`Outcome` in [`crate::chain`]).

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
    Body, CalloutAnswer, Chain, Headers, Host, LocalResponse, MetricKind, PipelineHost,
    PipelineRoots, Platform, Proxy, Respond, Status, StreamHost,
};

use crate::abi::{BodyKind, HeaderMap};
use crate::envoy::{EnvoyStream, StreamEnvoy};
use crate::process::Process;

/// The native module's host of a stream's stages.
pub type NativeHost = PipelineHost<EnvoyProxy>;

/// The native module's host of a worker's stage roots.
pub type NativeRoots = PipelineRoots<EnvoyProcess>;

/// The native module's hosts, as its stages see them.
pub type Native = Chain<EnvoyProcess, EnvoyProxy>;

/// Envoy beneath a stream's stages, through the stream's handle.
pub struct EnvoyProxy {
    /// The process beneath the stream (clock, shared data, queue, metrics).
    process: EnvoyProcess,
    /// The stream's Envoy.
    envoy: StreamEnvoy,
    /// Whether the filter had Envoy buffer the request / response body
    /// (then the body is the buffered chunks and the one received).
    pub buffering_request: bool,
    /// See `buffering_request`.
    pub buffering_response: bool,
    /// The local response to send once the stages returned.
    pending_response: Option<LocalResponse>,
    /// The answer of the callout being delivered.
    answer: Option<CalloutAnswer>,
}

impl EnvoyProxy {
    /// Envoy through one stream's `envoy`.
    pub fn stream(process: Arc<Process>, envoy: StreamEnvoy) -> EnvoyProxy {
        EnvoyProxy {
            process: EnvoyProcess::new(process),
            envoy,
            buffering_request: false,
            buffering_response: false,
            pending_response: None,
            answer: None,
        }
    }

    /// The process state this host reaches.
    pub fn process(&self) -> &Process {
        &self.process.process
    }

    /// Stream: the size of `body` as the current callback has it (the
    /// chunks Envoy buffered for this filter, and the one received).
    pub fn body_size(&mut self, body: Body) -> usize {
        let envoy = self.envoy();
        self.body_kinds(body)
            .iter()
            .map(|kind| envoy.body_size(*kind))
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

    /// Stream: the local response a stage asked for, to send now.
    pub fn take_response(&mut self) -> Option<LocalResponse> {
        self.pending_response.take()
    }

    /// Stream: a callout's answer is being delivered (`None` after).
    pub fn set_answer(&mut self, answer: Option<CalloutAnswer>) {
        self.answer = answer;
    }

    /// The stream's Envoy.
    pub fn envoy(&self) -> &dyn EnvoyStream {
        self.envoy.get()
    }
}

fn header_map(map: Headers) -> HeaderMap {
    match map {
        Headers::Request => HeaderMap::Request,
        Headers::Response => HeaderMap::Response,
    }
}

impl Proxy for EnvoyProxy {
    fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock> {
        Some(self.envoy().header_block(header_map(map)))
    }

    fn read_body(&mut self, body: Body, size: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(size);
        let envoy = self.envoy();
        for kind in self.body_kinds(body) {
            envoy.append_body(*kind, &mut bytes);
        }
        bytes
    }

    fn begin_callback(&mut self) {
        self.process.begin_callback();
    }
}

/// Envoy as a worker's stage roots reach it: the process's clock, shared
/// data, observer queue and metrics; no stream and no callouts (the roots'
/// background work is the observer thread's).
pub struct EnvoyProcess {
    process: Arc<Process>,
    /// The clock, read once per callback: the stages ask it a dozen times
    /// a request, and one instant serves a callback as Envoy's own
    /// dispatcher time does.
    clock: Option<Duration>,
}

impl EnvoyProcess {
    /// The process as a worker's roots see it.
    pub fn new(process: Arc<Process>) -> EnvoyProcess {
        EnvoyProcess {
            process,
            clock: None,
        }
    }

    /// A new callback begins: the clock reading is stale.
    pub fn begin_callback(&mut self) {
        self.clock = None;
    }

    /// The process state this host reaches.
    pub fn process(&self) -> &Process {
        &self.process
    }
}

impl Host for EnvoyProcess {
    fn now(&mut self) -> Duration {
        *self.clock.get_or_insert_with(unix_now)
    }

    fn platform(&mut self) -> Platform {
        Platform::Envoy
    }

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, _period: Duration) -> Result<(), Status> {
        // The worker ticks its roots (PipelineRoots records the period).
        Err(Status::BadArgument)
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
        // The observer's thread takes the queue's items.
        Err(Status::BadArgument)
    }

    fn dispatch(
        &mut self,
        _cluster: &str,
        _headers: &[(&str, &str)],
        _body: Option<&[u8]>,
        _timeout: Duration,
    ) -> Result<u32, Status> {
        // Callouts go through a stream's handle; the roots' background
        // work is the observer thread's.
        Err(Status::BadArgument)
    }

    fn callout_status(&mut self) -> Option<u16> {
        // No callout of the roots, so none is ever answered.
        None
    }

    fn callout_body(&mut self, _size: usize) -> Vec<u8> {
        Vec::new()
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        None
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

impl Host for EnvoyProxy {
    zerolayer_host::forward_host!(process: clock, shared_data, queues, metrics);

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        self.process.set_tick_period(period)
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        self.envoy().callout(
            cluster.as_bytes(),
            headers,
            body.unwrap_or_default(),
            timeout.as_millis() as u64,
        )
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
}

impl Respond for EnvoyProxy {
    fn resume(&mut self) {
        // PipelineHost records resumes; the hook continues the stream.
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        // Sent by the hook once the stages returned (Envoy runs the
        // filter's own response hooks inside `send_response`).
        self.pending_response = Some(LocalResponse::new(status, headers, body));
        Ok(())
    }
}

impl StreamHost for EnvoyProxy {
    fn with_header<T>(
        &mut self,
        map: Headers,
        name: &str,
        f: impl FnOnce(Option<&[u8]>) -> T,
    ) -> T {
        let headers = self.read_headers(map);
        f(headers.as_ref().and_then(|h| h.get(name)))
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        f(&self.read_headers(map).unwrap_or_default())
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        self.envoy()
            .set_header(header_map(map), name.as_bytes(), Some(value));
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        self.envoy()
            .add_header(header_map(map), name.as_bytes(), value);
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        self.envoy()
            .set_header(header_map(map), name.as_bytes(), None)
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        let bytes = self.read_body(body, size);
        f(bytes.get(..size).unwrap_or(&bytes))
    }

    fn set_body(&mut self, body: Body, _size: usize, bytes: &[u8]) -> Result<(), Status> {
        let kinds = self.body_kinds(body);
        let envoy = self.envoy();
        let Some((last, rest)) = kinds.split_last() else {
            return Err(Status::InternalFailure);
        };
        // The new body goes where the last of it is (the chunk of the hook
        // being run) and the buffer is emptied. Outside a body hook (a
        // callout's answer to a paused request) Envoy has no chunk to
        // append to: it all goes in the buffer.
        if envoy.replace_body(*last, bytes) {
            return rest
                .iter()
                .all(|kind| envoy.replace_body(*kind, &[]))
                .then_some(())
                .ok_or(Status::InternalFailure);
        }
        match rest.last() {
            Some(buffered) if envoy.replace_body(*buffered, bytes) => Ok(()),
            _ => Err(Status::InternalFailure),
        }
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        match path {
            "source.address" => self.envoy().source_address(),
            _ => None,
        }
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        // The access log reads hand-offs as the Wasm forms publish them:
        // `%FILTER_STATE(wasm.wasmx.zerolayer_auth:PLAIN)%`.
        if path.starts_with(internal::HANDOFF_PREFIX) {
            let key = format!("wasm.{path}");
            self.envoy().set_filter_state(key.as_bytes(), value);
        }
    }

    fn set_property(&mut self, _path: &str, _value: &[u8]) -> Result<(), Status> {
        Err(Status::NotFound)
    }
}
