//! `host-sim replay`: recorded traffic through a filter chain.
//!
//! The chain runs in host-sim's loopback proxy ([`crate::serve`]) in front of
//! the backend stub, a real backend, or the responses recorded with the
//! traffic. Requests leave at their recorded arrival offsets (divided by a
//! speed factor, or as fast as the concurrency allows), at most
//! `concurrency` at once. Per request the replay records what the client saw
//! (status, latency, `x-cache`) and what the chain did (the activation
//! decision, the auth outcome, usage, time inside each filter, upstream
//! time); a second pass without the chain gives the baseline latency.
//! Clusters can be pointed elsewhere or answered by an in-process sink that
//! keeps what the observer ships (so the metering sample can be compared
//! with the ground truth).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use host_sim::Profile;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use zerolayer_core::internal;
use zerolayer_stub::{Stub, StubConfig};

use crate::config_file::ChainFile;
use crate::loopback;
use crate::reconcile::{self, SampleRow, TruthRow};
use crate::serve::{ServeOptions, Server, StreamRecord};
use crate::traffic::TrafficRecord;

/// Where requests go after the chain.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// The built-in GPU backend stub, started for the replay.
    Stub(StubConfig),
    /// A running backend.
    Addr(SocketAddr),
    /// The responses recorded with the traffic (`response` of each record).
    Recorded,
}

/// What to replay and how.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The filter chain.
    pub chain: ChainFile,
    /// The requests, in arrival order.
    pub traffic: Vec<TrafficRecord>,
    /// The backend.
    pub upstream: Upstream,
    /// Arrival offsets are divided by this; 0 sends without waiting.
    pub speed: f64,
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Also replay without the chain, for the baseline latency.
    pub baseline: bool,
    /// Envoy or Kong behaviour.
    pub profile: Profile,
    /// Kong: the declared shared queues.
    pub kong_queues: Vec<String>,
    /// Clusters pointed at other addresses than the chain file's.
    pub clusters: Vec<(String, SocketAddr)>,
    /// Clusters answered by an in-process sink (200 to everything) that
    /// keeps what it is sent: the metering sample, audit records, cache writes.
    pub capture: Vec<String>,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// How long to wait after the last request for the observer to ship
    /// what it buffered to a captured sink.
    pub sink_wait: Duration,
}

impl ReplayOptions {
    /// Defaults around a chain and its traffic: the stub, recorded times,
    /// 16 in flight, with a baseline, Envoy, no progress bar.
    pub fn new(chain: ChainFile, traffic: Vec<TrafficRecord>) -> ReplayOptions {
        ReplayOptions {
            chain,
            traffic,
            upstream: Upstream::Stub(StubConfig::default()),
            speed: 1.0,
            concurrency: 16,
            baseline: true,
            profile: Profile::Envoy,
            kong_queues: Vec::new(),
            clusters: Vec::new(),
            capture: Vec::new(),
            progress: false,
            sink_wait: Duration::from_secs(15),
        }
    }
}

/// Time inside one filter for one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FilterTime {
    /// The filter (its plugin name).
    pub filter: String,
    /// Microseconds.
    pub us: f64,
}

/// One replayed request: what the client saw and what the chain did.
#[derive(Debug, Clone, Serialize)]
pub struct RequestResult {
    /// Position in the traffic file (0-based).
    pub seq: usize,
    /// The request id (recorded, or `replay-<seq>` when the record had none).
    pub request_id: String,
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Scheduled send time from the replay's start, ms.
    pub at_ms: f64,
    /// Actual send time from the replay's start, ms.
    pub sent_ms: f64,
    /// Status the client got (0: no response).
    pub status: u16,
    /// Why there was no response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Send to the response's last byte, through the chain, ms.
    pub latency_ms: f64,
    /// The same request without the chain, ms (when a baseline ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_ms: Option<f64>,
    /// From the request leaving the chain to the response's end coming
    /// back, ms; absent when nothing went upstream (a local reply, a hit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_ms: Option<f64>,
    /// Activation's decision: the observers on for this request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<Vec<String>>,
    /// `verified`, `unverified` (admitted, verification off the path),
    /// `public`, `rejected` (a 401/403 the chain sent), `refused <status>`
    /// (another reply of the chain's, e.g. 503 with the verifier down) or
    /// `none` (no identity published).
    pub auth: String,
    /// lazy-auth's identity hand-off, as published.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// The `x-cache` response header.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    /// Metering's usage record for the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<serde_json::Value>,
    /// Time inside each filter, chain order.
    pub wasm: Vec<FilterTime>,
    /// Whether a filter answered the request itself.
    pub local_reply: bool,
    /// Response body bytes the client got.
    pub response_bytes: usize,
}

/// A finished replay.
#[derive(Debug, Clone)]
pub struct Replay {
    /// Per request, in traffic order.
    pub requests: Vec<RequestResult>,
    /// The metering sample the observer shipped to a captured sink.
    pub sample: Vec<SampleRow>,
    /// Requests or rows sent to each captured cluster.
    pub captured: Vec<(String, usize)>,
    /// The chain pass's wall time.
    pub wall: Duration,
    /// Whether a baseline pass ran.
    pub baseline: bool,
    /// Things the reader should know (e.g. records without a stream record).
    pub notes: Vec<String>,
}

/// A request ready to send.
struct Prepared {
    at: Duration,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Bytes,
    request_id: String,
}

/// What the client saw.
#[derive(Debug, Clone, Default)]
struct Seen {
    sent: Duration,
    status: u16,
    error: Option<String>,
    latency: Duration,
    cache: Option<String>,
    bytes: usize,
}

/// The header that tells `--upstream recorded` which record to answer.
const RECORDED_SEQ_HEADER: &str = "x-replay-seq";

/// Runs the replay.
pub fn run(options: ReplayOptions) -> Result<Replay> {
    if options.concurrency == 0 {
        bail!("concurrency: at least 1");
    }
    if !options.speed.is_finite() || options.speed < 0.0 {
        bail!("speed: a factor >= 0 (0 = no waiting)");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut chain = options.chain.clone();
    for (name, addr) in &options.clusters {
        point_cluster(&mut chain, name, *addr).with_context(|| format!("--cluster {name}"))?;
    }
    let mut sinks = Vec::new();
    for name in &options.capture {
        let sink = runtime.block_on(CaptureSink::start())?;
        point_cluster(&mut chain, name, sink.addr).with_context(|| format!("--capture {name}"))?;
        sinks.push((name.clone(), sink));
    }

    let _stub;
    let upstream = match &options.upstream {
        Upstream::Stub(config) => {
            let stub = Stub::start(config.clone()).context("starting the backend stub")?;
            let addr = stub.addr();
            _stub = Some(stub);
            addr
        }
        Upstream::Addr(addr) => *addr,
        Upstream::Recorded => runtime.block_on(start_recorded(&options.traffic))?,
    };

    let prepared = prepare(&options)?;
    let (records_tx, records_rx) = std_mpsc::channel();
    let server = Server::start(ServeOptions {
        chain,
        upstream,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        profile: options.profile,
        echo_logs: false,
        kong_queues: options.kong_queues.clone(),
        kong_body_buffer_bytes: None,
        records: Some(records_tx),
    })?;

    let passes = if options.baseline { 2 } else { 1 };
    let bar = progress_bar(options.progress, (prepared.len() * passes) as u64);
    bar.set_message("through the chain");
    let started = Instant::now();
    let through_chain = runtime.block_on(send_all(
        server.addr(),
        &prepared,
        options.concurrency,
        &bar,
    ));
    let wall = started.elapsed();

    let mut notes = Vec::new();
    let mut streams = collect_records(&records_rx, &through_chain, &prepared, &mut notes);
    if !sinks.is_empty() {
        wait_for_sink(server.admin(), options.sink_wait, &mut notes);
    }

    let baseline = if options.baseline {
        bar.set_message("baseline, without the chain");
        Some(runtime.block_on(send_all(upstream, &prepared, options.concurrency, &bar)))
    } else {
        None
    };
    bar.finish_and_clear();
    drop(server);

    let mut sample = Vec::new();
    let mut captured = Vec::new();
    for (name, sink) in &sinks {
        let bodies = sink.bodies();
        captured.push((name.clone(), bodies.len()));
        for body in bodies {
            for line in String::from_utf8_lossy(&body).lines() {
                // Only the usage sink's rows parse; audit and cache writes don't.
                if let Ok(row) = reconcile::parse_sample_line(line) {
                    sample.push(row);
                }
            }
        }
    }

    let requests = prepared
        .iter()
        .enumerate()
        .map(|(seq, p)| {
            let seen = &through_chain[seq];
            let stream = streams.get_mut(&p.request_id).and_then(VecDeque::pop_front);
            result(seq, p, seen, stream, baseline.as_ref().map(|b| &b[seq]))
        })
        .collect();
    Ok(Replay {
        requests,
        sample,
        captured,
        wall,
        baseline: options.baseline,
        notes,
    })
}

fn point_cluster(chain: &mut ChainFile, name: &str, addr: SocketAddr) -> Result<()> {
    match chain.clusters.iter_mut().find(|(n, _)| n == name) {
        Some(cluster) => {
            cluster.1 = addr;
            Ok(())
        }
        None => {
            let names: Vec<&str> = chain.clusters.iter().map(|(n, _)| n.as_str()).collect();
            bail!(
                "the chain has no cluster {name:?} (it has: {})",
                names.join(", ")
            )
        }
    }
}

fn prepare(options: &ReplayOptions) -> Result<Vec<Prepared>> {
    let speed = options.speed;
    options
        .traffic
        .iter()
        .enumerate()
        .map(|(seq, record)| {
            let mut headers = record.headers.clone();
            let request_id = match record.header("x-request-id") {
                Some(id) => id.to_string(),
                None => {
                    // Deterministic, so metering's hash sample is the same
                    // on every run of the same traffic.
                    let id = format!("replay-{seq:06}");
                    headers.push(("x-request-id".into(), id.clone()));
                    id
                }
            };
            if matches!(options.upstream, Upstream::Recorded) {
                headers.push((RECORDED_SEQ_HEADER.into(), seq.to_string()));
            }
            let at = if speed == 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(record.at_ms / 1000.0 / speed)
            };
            Ok(Prepared {
                at,
                method: record.method.clone(),
                path: record.path.clone(),
                headers,
                body: Bytes::from(
                    record
                        .body_bytes()
                        .with_context(|| format!("record {seq}"))?,
                ),
                request_id,
            })
        })
        .collect()
}

fn progress_bar(enabled: bool, len: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {elapsed} — {msg}")
    {
        bar.set_style(style);
    }
    bar
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// An HTTP connector with Nagle's algorithm off: a body written after its
/// headers must not wait for the peer's delayed ACK.
pub(crate) fn connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector
}

async fn send_all(
    addr: SocketAddr,
    requests: &[Prepared],
    concurrency: usize,
    bar: &ProgressBar,
) -> Vec<Seen> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(connector());
    let limit = Arc::new(Semaphore::new(concurrency));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for request in requests {
        let request_start = start + request.at;
        let mut builder = Request::builder()
            .method(request.method.as_str())
            .uri(format!("http://{addr}{}", request.path));
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let built = builder.body(Full::new(request.body.clone()));
        let (client, limit, bar) = (client.clone(), limit.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(request_start).await;
            let _permit = limit.acquire_owned().await;
            let sent = start.elapsed();
            let began = Instant::now();
            let mut seen = Seen {
                sent,
                ..Seen::default()
            };
            match built {
                Err(err) => seen.error = Some(format!("not a valid request: {err}")),
                Ok(request) => match client.request(request).await {
                    Err(err) => seen.error = Some(format!("no response: {err}")),
                    Ok(response) => {
                        seen.status = response.status().as_u16();
                        seen.cache = response
                            .headers()
                            .get("x-cache")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        match response.into_body().collect().await {
                            Ok(body) => seen.bytes = body.to_bytes().len(),
                            Err(err) => seen.error = Some(format!("response cut: {err}")),
                        }
                    }
                },
            }
            seen.latency = began.elapsed();
            bar.inc(1);
            seen
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.unwrap_or_else(|err| Seen {
            error: Some(format!("replay task failed: {err}")),
            ..Seen::default()
        }));
    }
    out
}

/// Gathers the chain's stream records by request id. Every request that got
/// a response has one once its stream ended; a request still missing one
/// after a grace period is noted, not waited for forever.
fn collect_records(
    records: &std_mpsc::Receiver<StreamRecord>,
    seen: &[Seen],
    prepared: &[Prepared],
    notes: &mut Vec<String>,
) -> HashMap<String, VecDeque<StreamRecord>> {
    let expected = seen.iter().filter(|s| s.status != 0).count();
    let mut by_id: HashMap<String, VecDeque<StreamRecord>> = HashMap::new();
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while got < expected {
        let left = deadline.saturating_duration_since(Instant::now());
        match records.recv_timeout(left) {
            Ok(record) => {
                got += 1;
                by_id
                    .entry(record.request_id.clone())
                    .or_default()
                    .push_back(record);
            }
            Err(_) => break,
        }
    }
    while let Ok(record) = records.try_recv() {
        by_id
            .entry(record.request_id.clone())
            .or_default()
            .push_back(record);
    }
    if got < expected {
        notes.push(format!(
            "{} of {expected} answered requests had no stream record after 5 s \
             (their filter times and hand-offs are missing)",
            expected - got
        ));
    }
    let ids: std::collections::HashSet<&str> =
        prepared.iter().map(|p| p.request_id.as_str()).collect();
    if ids.len() < prepared.len() {
        notes.push(format!(
            "{} requests repeat an earlier x-request-id; their records are matched in order",
            prepared.len() - ids.len()
        ));
    }
    by_id
}

/// Waits until the observer has shipped or dropped every usage record it
/// was handed (its counters, read from the admin endpoint).
fn wait_for_sink(admin: SocketAddr, wait: Duration, notes: &mut Vec<String>) {
    let deadline = Instant::now() + wait;
    let url = format!("http://{admin}/stats/prometheus");
    let mut last = None;
    loop {
        if let Ok(text) = ureq::get(&url)
            .call()
            .and_then(|mut r| r.body_mut().read_to_string())
        {
            let value = |name: &str| prometheus_value(&text, name);
            let jobs = value("zerolayer_observer_jobs{kind=\"usage\"}");
            let done = value("zerolayer_metering_records{outcome=\"shipped\"}")
                + value("zerolayer_metering_records{outcome=\"dropped\"}");
            let buffered = value("zerolayer_metering_records_buffered");
            if jobs <= done && buffered == 0 {
                return;
            }
            last = Some((jobs, done, buffered));
        }
        if Instant::now() >= deadline {
            notes.push(match last {
                Some((jobs, done, buffered)) => format!(
                    "the observer had shipped or dropped {done} of {jobs} usage records \
                     ({buffered} buffered) when the replay stopped waiting: the sample is partial"
                ),
                None => "the admin endpoint did not answer: the sample may be partial".into(),
            });
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The sum of the samples of `name` (with its labels, as written) in a
/// Prometheus text exposition; 0 when absent.
fn prometheus_value(text: &str, name: &str) -> u64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(name))
        .filter_map(|rest| rest.strip_prefix(' '))
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn result(
    seq: usize,
    prepared: &Prepared,
    seen: &Seen,
    stream: Option<StreamRecord>,
    baseline: Option<&Seen>,
) -> RequestResult {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let handoff = |name: &str| -> Option<String> {
        stream.as_ref().and_then(|s| {
            s.handoffs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        })
    };
    let identity = handoff(internal::AUTH_PROPERTY);
    let local_reply = stream.as_ref().is_some_and(|s| s.local_reply);
    let auth = match identity.as_deref() {
        Some(id) if id.starts_with("verified") => "verified".to_string(),
        Some(id) if id.starts_with("unverified") => "unverified".to_string(),
        Some("public") => "public".to_string(),
        _ if local_reply && matches!(seen.status, 401 | 403) => "rejected".to_string(),
        // e.g. lazy-auth's 503 when a check it must make inline cannot be made.
        _ if local_reply => format!("refused {}", seen.status),
        _ => "none".to_string(),
    };
    RequestResult {
        seq,
        request_id: prepared.request_id.clone(),
        method: prepared.method.clone(),
        path: prepared.path.clone(),
        at_ms: ms(prepared.at),
        sent_ms: ms(seen.sent),
        status: seen.status,
        error: seen.error.clone(),
        latency_ms: ms(seen.latency),
        baseline_ms: baseline.filter(|b| b.status != 0).map(|b| ms(b.latency)),
        upstream_ms: stream.as_ref().and_then(|s| s.upstream).map(ms),
        decision: handoff(internal::OBSERVERS_PROPERTY).map(|list| {
            list.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        }),
        auth,
        identity,
        cache: seen.cache.clone(),
        usage: handoff(internal::USAGE_PROPERTY).and_then(|u| serde_json::from_str(&u).ok()),
        wasm: stream
            .as_ref()
            .map(|s| {
                s.wasm
                    .iter()
                    .map(|(filter, spent)| FilterTime {
                        filter: filter.clone(),
                        us: spent.as_secs_f64() * 1e6,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        local_reply,
        response_bytes: seen.bytes,
    }
}

// ---- in-process servers: the captured sinks and the recorded upstream ----

/// A loopback HTTP server that answers 200 to every request and keeps the
/// bodies (a stand-in for ClickHouse, the audit sink, webdis).
struct CaptureSink {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<Bytes>>>,
}

impl CaptureSink {
    async fn start() -> Result<CaptureSink> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let bodies: Arc<Mutex<Vec<Bytes>>> = Arc::default();
        let kept = bodies.clone();
        loopback::serve(listener, move |request: Request<hyper::body::Incoming>| {
            let kept = kept.clone();
            async move {
                let body = request
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                if let Ok(mut bodies) = kept.lock() {
                    bodies.push(body);
                }
                loopback::answer(200, Vec::new(), Bytes::new())
            }
        });
        Ok(CaptureSink { addr, bodies })
    }

    fn bodies(&self) -> Vec<Bytes> {
        self.bodies.lock().map(|b| b.clone()).unwrap_or_default()
    }
}

/// Answers each request with the response recorded for its record.
async fn start_recorded(traffic: &[TrafficRecord]) -> Result<SocketAddr> {
    let mut responses = Vec::with_capacity(traffic.len());
    for (seq, record) in traffic.iter().enumerate() {
        responses.push(match &record.response {
            Some(r) => Some((
                r.status,
                r.headers.clone(),
                Bytes::from(
                    r.body_bytes()
                        .with_context(|| format!("record {seq}: response"))?,
                ),
            )),
            None => None,
        });
    }
    let responses = Arc::new(responses);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    loopback::serve(listener, move |request: Request<hyper::body::Incoming>| {
        let responses = responses.clone();
        async move {
            let seq = request
                .headers()
                .get(RECORDED_SEQ_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            let _ = request.into_body().collect().await;
            match seq.and_then(|seq| responses.get(seq).cloned().flatten()) {
                Some((status, headers, body)) => loopback::answer(status, headers, body),
                None => loopback::answer(
                    502,
                    vec![("content-type".into(), "text/plain".into())],
                    Bytes::from_static(
                        b"host-sim replay: no response was recorded for this request\n",
                    ),
                ),
            }
        }
    });
    Ok(addr)
}

// ---- the summary ----

/// Percentile `p` (0–100) of `values` (nearest rank); 0 when empty.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The metering sample's estimate next to the truth, per tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageComparison {
    /// The tenant.
    pub tenant: String,
    /// Σ input + output tokens over every metered request.
    pub truth_tokens: u64,
    /// Σ sample_weight × (input + output) over the sample.
    pub estimate_tokens: f64,
    /// Requests metered.
    pub truth_requests: u64,
    /// Σ sample_weight over the sample.
    pub estimate_requests: f64,
}

impl Replay {
    /// The ground truth: every request's usage record.
    pub fn truth(&self) -> Vec<TruthRow> {
        self.requests
            .iter()
            .filter_map(|r| r.usage.as_ref())
            .filter_map(|u| reconcile::usage_truth(u).ok())
            .collect()
    }

    /// Per tenant: the truth and the sample's estimate (empty without usage).
    pub fn usage_comparison(&self) -> Vec<UsageComparison> {
        let truth = self.truth();
        if truth.is_empty() {
            return Vec::new();
        }
        let report = reconcile::reconcile(&truth, &self.sample, f64::INFINITY);
        report
            .tenants()
            .into_iter()
            .map(|t| {
                let [requests, input, output, _, _] = t.measures;
                UsageComparison {
                    tenant: t.tenant,
                    truth_tokens: input.0 + output.0,
                    estimate_tokens: input.1 + output.1,
                    truth_requests: requests.0,
                    estimate_requests: requests.1,
                }
            })
            .collect()
    }

    /// Counts of a per-request label, sorted by label.
    pub fn counts(&self, label: impl Fn(&RequestResult) -> String) -> Vec<(String, usize)> {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for request in &self.requests {
            *counts.entry(label(request)).or_default() += 1;
        }
        counts.into_iter().collect()
    }

    /// Per filter, in chain order: every request's time inside it, µs.
    pub fn wasm_times(&self) -> Vec<(String, Vec<f64>)> {
        let mut out: Vec<(String, Vec<f64>)> = Vec::new();
        for request in &self.requests {
            for time in &request.wasm {
                match out.iter_mut().find(|(f, _)| *f == time.filter) {
                    Some((_, times)) => times.push(time.us),
                    None => out.push((time.filter.clone(), vec![time.us])),
                }
            }
        }
        out
    }

    /// Latencies of answered requests, ms: through the chain, and without it.
    pub fn latencies(&self) -> (Vec<f64>, Vec<f64>) {
        let answered = self.requests.iter().filter(|r| r.status != 0);
        let chain = answered.clone().map(|r| r.latency_ms).collect();
        let baseline = answered.filter_map(|r| r.baseline_ms).collect();
        (chain, baseline)
    }

    /// The plain-text summary printed at the end of a replay.
    pub fn summary(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let n = self.requests.len();
        let failed = self.requests.iter().filter(|r| r.status == 0).count();
        let _ = writeln!(
            out,
            "replay: {n} requests in {:.2} s, {failed} without a response",
            self.wall.as_secs_f64()
        );
        let statuses = self.counts(|r| r.status.to_string());
        let _ = writeln!(out, "  status    {}", join_counts(&statuses));
        let (chain, baseline) = self.latencies();
        let _ = writeln!(
            out,
            "  latency   ms          p50      p90      p99      max"
        );
        let row = |values: &[f64]| {
            format!(
                "{:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                percentile(values, 50.0),
                percentile(values, 90.0),
                percentile(values, 99.0),
                percentile(values, 100.0)
            )
        };
        let _ = writeln!(out, "            with chain {}", row(&chain));
        if self.baseline {
            let _ = writeln!(out, "            without    {}", row(&baseline));
        }
        let wasm = self.wasm_times();
        if !wasm.is_empty() {
            let _ = writeln!(
                out,
                "  wasm      µs per request        p50      p99     mean"
            );
            for (filter, times) in &wasm {
                let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
                let _ = writeln!(
                    out,
                    "            {filter:<22} {:>8.1} {:>8.1} {:>8.1}",
                    percentile(times, 50.0),
                    percentile(times, 99.0),
                    mean
                );
            }
        }
        let cache = self.counts(|r| r.cache.clone().unwrap_or_else(|| "-".into()));
        let hits = count_of(&cache, "HIT");
        let misses = count_of(&cache, "MISS");
        if hits + misses > 0 {
            let _ = writeln!(
                out,
                "  cache     {} (hit rate {:.1}% of lookups)",
                join_counts(&cache),
                100.0 * hits as f64 / (hits + misses) as f64
            );
        }
        let _ = writeln!(
            out,
            "  auth      {}",
            join_counts(&self.counts(|r| r.auth.clone()))
        );
        let decisions = self.counts(|r| match &r.decision {
            Some(d) if d.is_empty() => "(none)".into(),
            Some(d) => d.join("+"),
            None => "-".into(),
        });
        let _ = writeln!(out, "  observers {}", join_counts(&decisions));
        let usage = self.usage_comparison();
        if !usage.is_empty() {
            let truth: u64 = usage.iter().map(|u| u.truth_tokens).sum();
            let estimate: f64 = usage.iter().map(|u| u.estimate_tokens).sum();
            let _ = writeln!(
                out,
                "  usage     {truth} tokens metered; the shipped sample ({} rows) estimates {:.0} ({})",
                self.sample.len(),
                estimate,
                deviation(truth as f64, estimate)
            );
        }
        for (cluster, n) in &self.captured {
            let _ = writeln!(out, "  captured  {n} requests to cluster {cluster}");
        }
        for note in &self.notes {
            let _ = writeln!(out, "  note      {note}");
        }
        out
    }
}

/// `+1.2%` / `-0.4%`, or `no truth`.
pub fn deviation(truth: f64, estimate: f64) -> String {
    if truth == 0.0 {
        return "no truth to compare".into();
    }
    format!("{:+.1}% from the truth", 100.0 * (estimate - truth) / truth)
}

fn count_of(counts: &[(String, usize)], label: &str) -> usize {
    counts
        .iter()
        .find(|(l, _)| l == label)
        .map_or(0, |(_, n)| *n)
}

fn join_counts(counts: &[(String, usize)]) -> String {
    counts
        .iter()
        .map(|(label, n)| format!("{label}×{n}"))
        .collect::<Vec<_>>()
        .join("  ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn prometheus_values_match_the_whole_name() {
        let text = "# TYPE zerolayer_metering_records counter\n\
                    zerolayer_metering_records{outcome=\"shipped\"} 12\n\
                    zerolayer_metering_records{outcome=\"dropped\"} 1\n\
                    zerolayer_metering_records_buffered 3\n";
        assert_eq!(
            prometheus_value(text, "zerolayer_metering_records{outcome=\"shipped\"}"),
            12
        );
        assert_eq!(
            prometheus_value(text, "zerolayer_metering_records_buffered"),
            3
        );
        assert_eq!(prometheus_value(text, "zerolayer_metering_records"), 0);
    }
}
