//! [`FakeHost`]: a recording host for native tests of stage code. It holds
//! what a test sets up (headers, bodies, properties, shared data, the
//! clock, a callout's answer) and records what the stage did (headers set,
//! hand-offs, callouts dispatched, resumes, local responses, metrics), so a
//! stage's decisions are asserted beside its code without building Wasm.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::metrics::{MetricName, SharedCounter};
use zerolayer_core::usage::{Missing, Usage};

use crate::host::{
    Body, Callback, CalloutAnswer, Headers, Host, MetricKind, Platform, Respond, RootHost, Status,
    StreamHost,
};
use crate::pipeline::Proxy;
use crate::stage::{DoneWith, Hosts, StageHost};

/// A callout a stage dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    /// The token its answer carries.
    pub token: u32,
    /// The cluster called.
    pub cluster: String,
    /// Its headers, pseudo-headers included.
    pub headers: Vec<(String, String)>,
    /// Its body.
    pub body: Option<Vec<u8>>,
    /// Its timeout.
    pub timeout: Duration,
}

impl Dispatched {
    /// Header `name`'s value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A local response a stage sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// Its status.
    pub status: u32,
    /// Its headers.
    pub headers: Vec<(String, String)>,
    /// Its body.
    pub body: Vec<u8>,
    /// The stream it went to when sent from a root (`set_effective_context`).
    pub effective: Option<u32>,
}

impl Sent {
    /// Header `name`'s value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A defined metric and its value (counters: the sum of increments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeMetric {
    /// Its name as a Proxy-Wasm host sees it (`<metric>_<key>=<value>…`).
    pub name: String,
    /// The metric the stage named, without labels.
    pub metric: String,
    /// The labels the stage gave, in order.
    pub labels: Vec<(String, String)>,
    /// Its kind.
    pub kind: MetricKind,
    /// Counter: sum of increments; gauge: last value; histogram: last sample.
    pub value: i64,
    /// Histogram: every sample.
    pub samples: Vec<u64>,
}

/// The recording host (see the module docs). Fields are public: a test
/// sets up and inspects them directly.
#[derive(Debug)]
pub struct FakeHost {
    /// The clock.
    pub clock: Duration,
    /// The platform the stage believes it runs on.
    pub platform: Platform,
    /// Whether the stage runs in the fused filter.
    pub fused: bool,
    /// The tick period asked for.
    pub tick: Option<Duration>,
    /// The request headers, in order.
    pub request_headers: Vec<(String, Vec<u8>)>,
    /// The response headers, in order.
    pub response_headers: Vec<(String, Vec<u8>)>,
    /// The request body.
    pub request_body: Vec<u8>,
    /// The current response chunk.
    pub response_body: Vec<u8>,
    /// Properties and hand-offs, by path.
    pub properties: BTreeMap<String, Vec<u8>>,
    /// Shared data: value and CAS, by key.
    pub shared: BTreeMap<String, (Vec<u8>, u32)>,
    /// Queues: name and items, id = index + 1.
    pub queues: Vec<(String, VecDeque<Vec<u8>>)>,
    /// Whether enqueues are refused (a full queue).
    pub refuse_enqueue: bool,
    /// Callouts dispatched, in order.
    pub dispatched: Vec<Dispatched>,
    /// Whether dispatches are refused (unknown cluster).
    pub refuse_dispatch: bool,
    /// The answer of the callout being answered.
    pub answer: CalloutAnswer,
    /// Resumes asked for, with the effective stream (roots).
    pub resumes: Vec<Option<u32>>,
    /// Local responses sent.
    pub sent: Vec<Sent>,
    /// The stream made effective last.
    pub effective: Option<u32>,
    /// Callbacks the stage said it is done with.
    pub done_with: Vec<Callback>,
    /// Metrics, id = index.
    pub metrics: Vec<FakeMetric>,
    /// Whole header maps read ([`Proxy::read_headers`], as a chain's
    /// host reads them).
    pub map_reads: usize,
    /// Body reads (`with_body`, [`Proxy::read_body`]).
    pub body_reads: usize,
    /// Whether counters are handed out as [`SharedCounter`]s, as the
    /// native module does: the stage adds to them directly and
    /// [`FakeHost::report_shared`] takes them into `metrics`.
    pub shared_counters: bool,
    /// The usage an earlier stage shared, as a chain's host keeps it
    /// (`Some` makes this host one that shares, as the fused chain does).
    pub shared_usage: Option<Result<Usage, Missing>>,
    /// The request's model an earlier stage shared (kept only where the
    /// host is `fused`, as a chain's host keeps it).
    pub shared_request_model: Option<Option<String>>,
    /// What [`StreamHost::response_passed`] reports (`Some` as a chain's
    /// host counts; [`StageHost::note_response_passed`] adds to it then).
    pub response_passed: Option<(u64, bool)>,
    /// The counters handed out as cells, by metric id.
    cells: Vec<(u32, SharedCounter)>,
    /// `done_with` calls not yet taken by a pipeline ([`StageHost`]).
    done_pending: DoneWith,
    /// Resumes a pipeline already took ([`StageHost`]).
    resumes_taken: usize,
    next_token: u32,
    next_cas: u32,
}

impl Default for FakeHost {
    fn default() -> Self {
        FakeHost {
            clock: Duration::from_secs(1_700_000_000),
            platform: Platform::Envoy,
            fused: false,
            tick: None,
            request_headers: Vec::new(),
            response_headers: Vec::new(),
            request_body: Vec::new(),
            response_body: Vec::new(),
            properties: BTreeMap::new(),
            shared: BTreeMap::new(),
            queues: Vec::new(),
            refuse_enqueue: false,
            dispatched: Vec::new(),
            refuse_dispatch: false,
            answer: CalloutAnswer::default(),
            resumes: Vec::new(),
            sent: Vec::new(),
            effective: None,
            done_with: Vec::new(),
            metrics: Vec::new(),
            map_reads: 0,
            body_reads: 0,
            shared_counters: false,
            cells: Vec::new(),
            shared_usage: None,
            shared_request_model: None,
            response_passed: None,
            done_pending: DoneWith::default(),
            resumes_taken: 0,
            next_token: 1,
            next_cas: 1,
        }
    }
}

impl FakeHost {
    /// A host with `headers` as the request headers.
    pub fn with_request(headers: &[(&str, &str)]) -> FakeHost {
        FakeHost {
            request_headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
            ..FakeHost::default()
        }
    }

    /// Sets the response headers.
    pub fn respond_with(&mut self, headers: &[(&str, &str)]) {
        self.response_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
    }

    /// Makes `status` and `body` the answer of the callout being answered
    /// (`None`: the call failed, no status).
    pub fn answer_with(&mut self, status: Option<u16>, body: &[u8]) {
        self.answer = CalloutAnswer {
            status,
            body: body.to_vec(),
            retry_after_secs: None,
        };
    }

    /// Advances the clock.
    pub fn advance(&mut self, by: Duration) {
        self.clock += by;
    }

    /// A counter's value by name (0 if never incremented; `None` if never defined).
    pub fn metric(&self, name: &str) -> Option<i64> {
        self.metrics
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.value)
    }

    /// A counter's value by metric and labels, as the stage defined it
    /// (`None` if never defined with exactly these labels, in this order).
    pub fn labelled(&self, metric: &str, labels: &[(&str, &str)]) -> Option<i64> {
        self.metrics
            .iter()
            .find(|m| {
                m.metric == metric
                    && m.labels.len() == labels.len()
                    && m.labels
                        .iter()
                        .zip(labels)
                        .all(|((k, v), (key, value))| k == key && v == value)
            })
            .map(|m| m.value)
    }

    /// Takes what the stages added to their shared counters into
    /// `metrics`, as the native module's report does.
    pub fn report_shared(&mut self) {
        for (id, cell) in &self.cells {
            if let Some(m) = self.metrics.get_mut(*id as usize) {
                let delta = i64::try_from(cell.take()).unwrap_or(i64::MAX);
                m.value = m.value.saturating_add(delta);
            }
        }
    }

    /// Shared data `key`'s value.
    pub fn shared_value(&self, key: &str) -> Option<&[u8]> {
        self.shared.get(key).map(|(v, _)| v.as_slice())
    }

    /// Items waiting in queue `name`.
    pub fn queued(&self, name: &str) -> Vec<Vec<u8>> {
        self.queues
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, q)| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The last callout dispatched.
    pub fn last_dispatched(&self) -> Option<&Dispatched> {
        self.dispatched.last()
    }

    /// A response header's value, as set by the stage.
    pub fn response_header_value(&self, name: &str) -> Option<String> {
        find(&self.response_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// A request header's value, as set by the stage.
    pub fn request_header_value(&self, name: &str) -> Option<String> {
        find(&self.request_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    fn map(&mut self, map: Headers) -> &mut Vec<(String, Vec<u8>)> {
        match map {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        }
    }

    fn body(&mut self, body: Body) -> &mut Vec<u8> {
        match body {
            Body::Request => &mut self.request_body,
            Body::Response => &mut self.response_body,
        }
    }
}

fn find<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

fn owned(headers: &[(&str, &str)]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

impl Host for FakeHost {
    fn now(&mut self) -> Duration {
        self.clock
    }

    fn platform(&mut self) -> Platform {
        self.platform
    }

    fn fused(&self) -> bool {
        self.fused
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        self.tick = Some(period);
        Ok(())
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        if let (Some(expected), Some((_, current))) = (cas, self.shared.get(key))
            && expected != *current
        {
            return Err(Status::CasMismatch);
        }
        self.next_cas += 1;
        self.shared
            .insert(key.to_string(), (value.to_vec(), self.next_cas));
        Ok(())
    }

    fn register_queue(&mut self, name: &str) -> Result<u32, Status> {
        if let Some(i) = self.queues.iter().position(|(n, _)| n == name) {
            return Ok(i as u32 + 1);
        }
        self.queues.push((name.to_string(), VecDeque::new()));
        Ok(self.queues.len() as u32)
    }

    fn resolve_queue(&mut self, _vm_id: &str, name: &str) -> Option<u32> {
        self.queues
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| i as u32 + 1)
    }

    fn enqueue(&mut self, queue: u32, bytes: &[u8]) -> Result<(), Status> {
        if self.refuse_enqueue {
            return Err(Status::InternalFailure);
        }
        let (_, items) = self
            .queues
            .get_mut((queue as usize).wrapping_sub(1))
            .ok_or(Status::NotFound)?;
        items.push_back(bytes.to_vec());
        Ok(())
    }

    fn dequeue(&mut self, queue: u32) -> Result<Option<Vec<u8>>, Status> {
        let (_, items) = self
            .queues
            .get_mut((queue as usize).wrapping_sub(1))
            .ok_or(Status::NotFound)?;
        Ok(items.pop_front())
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        if self.refuse_dispatch {
            return Err(Status::BadArgument);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.dispatched.push(Dispatched {
            token,
            cluster: cluster.to_string(),
            headers: owned(headers),
            body: body.map(<[u8]>::to_vec),
            timeout,
        });
        Ok(token)
    }

    fn callout_status(&mut self) -> Option<u16> {
        self.answer.status
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        self.answer.retry_after_secs
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        let body = &self.answer.body;
        body.get(..size).unwrap_or(body).to_vec()
    }

    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: MetricName<'_>,
    ) -> Result<crate::MetricId, Status> {
        let flat = name.to_string();
        let id = match self.metrics.iter().position(|m| m.name == flat) {
            Some(i) => i as u32,
            None => {
                self.metrics.push(FakeMetric {
                    name: flat,
                    metric: name.metric.to_string(),
                    labels: name
                        .labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    kind,
                    value: 0,
                    samples: Vec::new(),
                });
                self.metrics.len() as u32 - 1
            }
        };
        let shared = (self.shared_counters && kind == MetricKind::Counter).then(|| {
            match self.cells.iter().find(|(i, _)| *i == id) {
                Some((_, cell)) => cell.clone(),
                None => {
                    let cell = SharedCounter::default();
                    self.cells.push((id, cell.clone()));
                    cell
                }
            }
        });
        Ok(crate::MetricId { id, shared })
    }

    fn increment_metric(&mut self, id: u32, delta: i64) {
        if let Some(m) = self.metrics.get_mut(id as usize) {
            m.value = m.value.saturating_add(delta);
        }
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        if let Some(m) = self.metrics.get_mut(id as usize) {
            m.value = i64::try_from(value).unwrap_or(i64::MAX);
            m.samples.push(value);
        }
    }
}

/// A stage as its own filter (or in a test) has one host for its root and
/// its streams.
impl Hosts for FakeHost {
    type Root = FakeHost;
    type Stream = FakeHost;
}

impl Respond for FakeHost {
    fn resume(&mut self) {
        self.resumes.push(self.effective);
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        self.sent.push(Sent {
            status,
            headers: owned(headers),
            body: body.to_vec(),
            effective: self.effective,
        });
        Ok(())
    }
}

impl RootHost for FakeHost {
    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status> {
        self.effective = Some(context_id);
        Ok(())
    }
}

impl StreamHost for FakeHost {
    fn with_header<T>(
        &mut self,
        map: Headers,
        name: &str,
        f: impl FnOnce(Option<&[u8]>) -> T,
    ) -> T {
        f(find(self.map(map), name))
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        let pairs = self
            .map(map)
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()));
        let block = HeaderBlock::parse(HeaderBlock::serialize(pairs)).unwrap_or_default();
        f(&block)
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        let headers = self.map(map);
        headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        headers.push((name.to_string(), value.to_vec()));
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        self.map(map).push((name.to_string(), value.to_vec()));
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        let headers = self.map(map);
        let before = headers.len();
        headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        headers.len() != before
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        self.body_reads += 1;
        let bytes = self.body(body);
        f(bytes.get(..size).unwrap_or(bytes))
    }

    fn set_body(&mut self, body: Body, size: usize, bytes: &[u8]) -> Result<(), Status> {
        let current = self.body(body);
        let size = size.min(current.len());
        current.splice(..size, bytes.iter().copied());
        Ok(())
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        self.properties.get(path).cloned()
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        self.properties.insert(path.to_string(), value.to_vec());
    }

    fn set_property(&mut self, path: &str, value: &[u8]) -> Result<(), Status> {
        self.properties.insert(path.to_string(), value.to_vec());
        Ok(())
    }

    fn share_usage(&mut self, usage: Result<Usage, Missing>) {
        if self.fused {
            self.shared_usage = Some(usage);
        }
    }

    fn shared_usage(&mut self) -> Option<Result<Usage, Missing>> {
        self.shared_usage
    }

    fn share_request_model(&mut self, model: Option<&str>) {
        if self.fused {
            self.shared_request_model = Some(model.map(str::to_string));
        }
    }

    fn shared_request_model(&mut self) -> Option<Option<&str>> {
        self.shared_request_model.as_ref().map(Option::as_deref)
    }

    fn response_passed(&mut self) -> Option<(u64, bool)> {
        self.response_passed
    }

    fn done_with(&mut self, callback: Callback) {
        self.done_pending.insert(callback);
        if !self.done_with.contains(&callback) {
            self.done_with.push(callback);
        }
    }
}

/// The fake as a pipeline's host: a local response answers the request,
/// `done_with` and resumes are taken as a pipeline takes them.
/// The fake as the proxy beneath a [`crate::PipelineHost`], for the
/// chain hosts' own tests.
impl Proxy for FakeHost {
    fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock> {
        self.map_reads += 1;
        let pairs = self
            .map(map)
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()));
        HeaderBlock::parse(HeaderBlock::serialize(pairs)).ok()
    }
}

impl StageHost for FakeHost {
    fn begin_callback(&mut self) {}

    fn answered(&self) -> bool {
        !self.sent.is_empty()
    }

    fn take_done(&mut self) -> DoneWith {
        std::mem::take(&mut self.done_pending)
    }

    fn take_resumed(&mut self) -> bool {
        let resumed = self.resumes.len() > self.resumes_taken;
        self.resumes_taken = self.resumes.len();
        resumed
    }

    fn note_response_passed(&mut self, size: usize, end_of_stream: bool) {
        if let Some((bytes, _)) = self.response_passed {
            self.response_passed = Some((bytes + size as u64, end_of_stream));
        }
    }
}
