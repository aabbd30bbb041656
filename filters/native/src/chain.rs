//! The native chain (`filter_name: zerolayer`): the fused filter's stages —
//! lazy-auth → activation → post-cache → metering — run through the same
//! [`Pipeline`] on a [`NativeHost`], configured by the fused filter's
//! configuration object (a section per stage, the same schemas and errors)
//! and one section of its own, `native`.
//!
//! Threads: Envoy calls a filter's hooks on its worker. Each worker has its
//! own stage roots ([`Worker`]), as each worker has its own Wasm VM, made on
//! its first request from the configuration the main thread checked; shared
//! data is the process's; the observer runs on a thread of its own
//! ([`crate::observer`]). A root's tick runs inside a hook on its worker:
//! when one is due at a request's hooks, and for paused streams (a follower
//! waiting on a cached answer) through their scheduled events, which the
//! module's ticker thread commits while they wait.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{Endpoint, ObserverMode};
use zerolayer_core::footprint::{self, KeySpace};
use zerolayer_core::metering::MeteringConfig;
use zerolayer_fused::{Pipeline, Stage, StageStream};
use zerolayer_host::{
    Action, Body, CalloutAnswer, Headers, Host, MetricKind, RootStage, StageHost, StreamMap,
};
use zerolayer_observer::ObserverConfig;

use crate::abi::{self, ConfigEnvoy, FilterEnvoy};
use crate::host::{LocalResponse, NativeHost, Woken};
use crate::metrics::Metrics;
use crate::observer::ObserverThread;
use crate::store::{JobQueue, SharedData};
use crate::ticker::{self, Ticking};

/// The `native` section: what only the native form needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NativeSection {
    /// Where the observer's thread reaches each cluster the configuration
    /// names for off-path work (JWKS, introspection, sinks, the fleet
    /// tier): `"cluster": "host:port"`. Envoy's cluster manager serves
    /// only its own threads; callouts a stream makes still use Envoy's
    /// clusters.
    #[serde(default)]
    pub upstreams: BTreeMap<String, String>,
    /// Shared data's keys at most, if the operator caps them: refused at
    /// load when the stages' configurations may need more (by default the
    /// store holds exactly what they declare, each purpose its own quota).
    #[serde(default)]
    pub shared_max_entries: Option<u64>,
    /// Shared data's bytes of keys and values at most, if the operator caps
    /// them (as `shared_max_entries`).
    #[serde(default)]
    pub shared_max_bytes: Option<u64>,
    /// Jobs waiting for the observer at most (a full queue refuses jobs,
    /// counted by the stage that posts).
    #[serde(default = "default_queue")]
    pub queue_capacity: usize,
}

fn default_queue() -> usize {
    65_536
}

impl Default for NativeSection {
    fn default() -> Self {
        NativeSection {
            upstreams: BTreeMap::new(),
            shared_max_entries: None,
            shared_max_bytes: None,
            queue_capacity: default_queue(),
        }
    }
}

/// What the process holds for one chain configuration, across threads.
pub struct Process {
    /// Shared data.
    pub data: SharedData,
    /// The observer's job queue (none when no stage needs an observer).
    pub queue: Option<JobQueue>,
    /// Metrics, defined when Envoy loaded the configuration.
    pub metrics: Metrics,
    /// `zerolayer_native_shared_refused`: shared-data writes refused at
    /// a purpose's quota, and how many were reported. (Each failed write
    /// is also logged by the host, at most one line a minute.)
    refused: Option<u32>,
    refused_reported: AtomicU64,
}

impl Process {
    /// Reports shared-data refusals since the last report.
    fn report_refused(&self) {
        let Some(id) = self.refused else {
            return;
        };
        let now = self.data.refused();
        let before = self.refused_reported.swap(now, Ordering::Relaxed);
        if now > before {
            self.metrics.add(id, (now - before) as i64);
        }
    }
}

/// What the configured stages may hold in shared data, by purpose (a
/// section that does not parse declares nothing: its stage refuses it).
fn key_spaces(sections: &[(Stage, Vec<u8>)]) -> Vec<KeySpace> {
    sections
        .iter()
        .flat_map(|(stage, section)| match stage {
            Stage::LazyAuth => LazyAuthConfig::from_json(section)
                .map(|c| c.key_spaces())
                .unwrap_or_default(),
            Stage::PostCache => PostCacheConfig::from_json(section)
                .map(|c| c.key_spaces())
                .unwrap_or_default(),
            Stage::Activation | Stage::Metering => Vec::new(),
        })
        .collect()
}

/// One chain configuration (`envoy_dynamic_module_on_http_filter_config_new`).
pub struct ChainConfig {
    sections: Vec<(Stage, Vec<u8>)>,
    process: Arc<Process>,
    observer: Option<ObserverThread>,
    reporter: Option<Reporter>,
    /// The shortest tick a stage asked for.
    tick: Duration,
}

/// The thread asking Envoy's main thread to report the metrics, every
/// [`crate::metrics::REPORT_EVERY`] while they change.
struct Reporter {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Reporter {
    fn start(process: &Arc<Process>) -> Option<Reporter> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let process = Arc::downgrade(process);
        let stopping = stop.clone();
        let started = std::thread::Builder::new()
            .name("zerolayer-metrics".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    std::thread::sleep(crate::metrics::REPORT_EVERY);
                    match process.upgrade() {
                        Some(process) => process.metrics.commit_if_changed(),
                        None => return,
                    }
                }
            });
        match started {
            Ok(thread) => Some(Reporter { stop, thread }),
            Err(e) => {
                log::error!("zerolayer-native: no metrics thread ({e}); metrics are not reported");
                None
            }
        }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        if self.thread.join().is_err() {
            log::error!("zerolayer-native: the metrics thread panicked");
        }
    }
}

/// A stage's root on one worker, and its tick.
struct StageRoot {
    root: Box<dyn RootStage<NativeHost>>,
    tick: Option<Duration>,
    next_tick_ms: u64,
}

/// A stream as its worker's roots reach it.
struct Slot {
    /// What the roots did to it, for its next scheduled event.
    woken: RefCell<Vec<Woken>>,
    /// Its scheduled events, once it waited.
    ticking: RefCell<Option<Ticking>>,
}

/// One worker's part of a chain configuration: the stage roots.
struct Worker {
    config: std::sync::Weak<ChainConfig>,
    roots: Vec<StageRoot>,
    host: NativeHost,
    streams: StreamMap<Weak<Slot>>,
    next_id: u32,
    next_tick_ms: u64,
}

thread_local! {
    /// This worker's roots, by configuration.
    static WORKERS: RefCell<Vec<Rc<RefCell<Worker>>>> = const { RefCell::new(Vec::new()) };
}

impl ChainConfig {
    /// Checks `config` (every field, as the fused filter does), defines the
    /// metrics with Envoy and starts the observer; `Err` is the one line
    /// naming the field.
    ///
    /// # Safety
    /// `config_envoy` must be null (unit tests) or the handle of the
    /// `config_new` being run.
    pub unsafe fn new(
        config_envoy: ConfigEnvoy,
        config: &[u8],
    ) -> Result<Arc<ChainConfig>, String> {
        let mut value: Value =
            serde_json::from_slice(config).map_err(|e| format!("not JSON: {e}"))?;
        let native = match value.as_object_mut().and_then(|o| o.remove("native")) {
            Some(native) => serde_json::from_value::<NativeSection>(native)
                .map_err(|e| format!("native: {e}"))?,
            None => NativeSection::default(),
        };
        let sections = zerolayer_fused::sections(value.to_string().as_bytes())?;
        let observer_config = observer_config(&value)?;
        let upstreams = upstreams(&native, observer_config.as_ref())?;
        // SAFETY: the caller's contract.
        let metrics = unsafe { Metrics::new(config_envoy) };
        let (queue, jobs) = match &observer_config {
            Some(config) => {
                let (queue, jobs) = JobQueue::new(&config.link().queue, native.queue_capacity);
                (Some(queue), Some(jobs))
            }
            None => (None, None),
        };
        let refused = metrics
            .id(MetricKind::Counter, "zerolayer_native_shared_refused")
            .ok();
        let spaces = key_spaces(&sections);
        let (keys, bytes) = footprint::total(&spaces);
        if let Some(max) = native.shared_max_entries.filter(|&max| max < keys) {
            return Err(format!(
                "native.shared_max_entries: {max} is less than the {keys} keys the stages may hold ({})",
                footprint::describe(&spaces)
            ));
        }
        if let Some(max) = native.shared_max_bytes.filter(|&max| max < bytes) {
            return Err(format!(
                "native.shared_max_bytes: {max} is less than the {bytes} bytes the stages may hold ({})",
                footprint::describe(&spaces)
            ));
        }
        log::info!("zerolayer-native: {}", footprint::describe(&spaces));
        let process = Arc::new(Process {
            data: SharedData::new(&spaces),
            queue,
            metrics,
            refused,
            refused_reported: AtomicU64::new(0),
        });
        // Configured once here for the errors and the metrics (Envoy takes
        // metric definitions only now); each worker configures its own.
        let mut host = NativeHost::roots(process.clone());
        let mut tick = Duration::from_secs(1);
        for (stage, section) in &sections {
            let mut root = stage.root::<NativeHost>();
            if !root.configure(&mut host, section) {
                return Err(format!("{}: refused (see the line above)", stage.section()));
            }
            if let Some(t) = host.take_tick() {
                tick = tick.min(t);
            }
        }
        process.metrics.define_dynamic_families();
        let observer = match (observer_config, jobs, &process.queue) {
            (Some(config), Some(jobs), Some(queue)) => Some(ObserverThread::start(
                config,
                upstreams,
                process.clone(),
                queue.clone(),
                jobs,
            )?),
            _ => None,
        };
        process.metrics.freeze();
        let names: Vec<&str> = sections.iter().map(|(s, _)| s.section()).collect();
        log::info!(
            "zerolayer-native: chain with stages {} (observer {})",
            names.join(" → "),
            if observer.is_some() {
                "on its thread"
            } else {
                "none"
            }
        );
        let reporter = Reporter::start(&process);
        Ok(Arc::new(ChainConfig {
            sections,
            process,
            observer,
            reporter,
            tick,
        }))
    }

    /// The configuration is going away: the observer stops first, then
    /// metrics are no longer reported.
    pub fn shut_down(&mut self) {
        if let Some(observer) = &mut self.observer {
            observer.stop();
        }
        if let Some(reporter) = self.reporter.take() {
            reporter.stop();
        }
        self.process.metrics.stop();
    }

    /// The configuration's scheduled event (Envoy's main thread): reports
    /// the metrics.
    pub fn scheduled(&self) {
        self.process.metrics.report();
    }

    /// A new stream on this worker.
    pub fn stream(self: &Arc<ChainConfig>, filter: FilterEnvoy) -> ChainStream {
        let worker = self.worker();
        let mut w = worker.borrow_mut();
        w.next_id = w.next_id.wrapping_add(1).max(1);
        let id = w.next_id;
        let stages = self
            .sections
            .iter()
            .zip(&w.roots)
            .map(|((stage, _), root)| {
                StageStream::new(
                    root.root.stream(id),
                    stage.headers_pause_withholds_body(),
                    stage.labels(),
                )
            })
            .collect();
        let slot = Rc::new(Slot {
            woken: RefCell::new(Vec::new()),
            ticking: RefCell::new(None),
        });
        w.streams.insert(id, Rc::downgrade(&slot));
        drop(w);
        ChainStream {
            id,
            filter,
            worker,
            slot,
            pipeline: Pipeline::new(stages, NativeHost::stream(self.process.clone(), filter)),
            tick: self.tick,
        }
    }

    /// This worker's roots for this configuration, configured on first use.
    fn worker(self: &Arc<ChainConfig>) -> Rc<RefCell<Worker>> {
        WORKERS.with(|workers| {
            let mut workers = workers.borrow_mut();
            // Configurations Envoy destroyed leave their workers' roots.
            workers.retain(|w| w.try_borrow().map_or(true, |w| w.config.strong_count() > 0));
            let mine = Arc::downgrade(self);
            if let Some(worker) = workers
                .iter()
                .find(|w| w.try_borrow().is_ok_and(|w| w.config.ptr_eq(&mine)))
            {
                return worker.clone();
            }
            let mut host = NativeHost::roots(self.process.clone());
            let mut roots = Vec::with_capacity(self.sections.len());
            for (stage, section) in &self.sections {
                let mut root = stage.root::<NativeHost>();
                // Checked on the main thread already: the same bytes.
                if !root.configure(&mut host, section) {
                    log::error!(
                        "zerolayer-native: {} refused on a worker (see the line above)",
                        stage.section()
                    );
                }
                roots.push(StageRoot {
                    root,
                    tick: host.take_tick(),
                    next_tick_ms: 0,
                });
            }
            let worker = Rc::new(RefCell::new(Worker {
                config: mine,
                roots,
                host,
                streams: StreamMap::default(),
                next_id: 0,
                next_tick_ms: 0,
            }));
            workers.push(worker.clone());
            worker
        })
    }
}

impl Drop for ChainConfig {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// The observer's configuration from the stage sections it works for
/// (none when none of them is there). Natively it always runs on its own
/// thread: a section asking for the tick mode is refused, naming it.
fn observer_config(value: &Value) -> Result<Option<ObserverConfig>, String> {
    let mut sections = serde_json::Map::new();
    for name in ["lazy_auth", "post_cache", "metering"] {
        if let Some(section) = value.get(name) {
            sections.insert(name.into(), section.clone());
        }
    }
    if sections.is_empty() {
        return Ok(None);
    }
    let bytes = Value::Object(sections).to_string();
    let config = ObserverConfig::from_json(bytes.as_bytes()).map_err(|e| e.to_string())?;
    let links = [
        ("lazy_auth", config.lazy_auth.as_ref().map(|c| &c.observer)),
        (
            "post_cache",
            config.post_cache.as_ref().map(|c| &c.observer),
        ),
        ("metering", config.metering.as_ref().map(|c| &c.observer)),
    ];
    for (name, link) in links {
        if let Some(link) = link
            && link.mode != ObserverMode::Singleton
        {
            return Err(format!(
                "{name}.observer.mode: the native module runs its observer on a thread of its own: use \"singleton\""
            ));
        }
    }
    Ok(Some(config))
}

/// The addresses of the clusters the observer calls, every one of them
/// given in `native.upstreams`.
fn upstreams(
    native: &NativeSection,
    config: Option<&ObserverConfig>,
) -> Result<BTreeMap<String, SocketAddr>, String> {
    let mut needed: Vec<(&str, &Endpoint)> = Vec::new();
    if let Some(config) = config {
        if let Some(lazy) = &config.lazy_auth {
            endpoints_of_lazy_auth(lazy, &mut needed);
        }
        if let Some(cache) = &config.post_cache {
            endpoints_of_post_cache(cache, &mut needed);
        }
        if let Some(metering) = &config.metering {
            endpoints_of_metering(metering, &mut needed);
        }
    }
    let mut addresses = BTreeMap::new();
    for (name, address) in &native.upstreams {
        let address: SocketAddr = address
            .parse()
            .map_err(|e| format!("native.upstreams.{name}: {address:?} is not host:port ({e})"))?;
        addresses.insert(name.clone(), address);
    }
    for (field, endpoint) in needed {
        if !addresses.contains_key(&endpoint.cluster) {
            return Err(format!(
                "native.upstreams: no address for cluster {:?} ({field}.cluster): the observer's thread calls it directly",
                endpoint.cluster
            ));
        }
    }
    Ok(addresses)
}

fn endpoints_of_lazy_auth<'a>(c: &'a LazyAuthConfig, out: &mut Vec<(&'static str, &'a Endpoint)>) {
    if let Some(jwks) = &c.jwt.jwks {
        out.push(("lazy_auth.jwt.jwks", &jwks.endpoint));
    }
    if let Some(keys) = &c.api_keys {
        out.push(("lazy_auth.api_keys", &keys.endpoint));
    }
    if let Some(audit) = &c.audit {
        out.push(("lazy_auth.audit", &audit.endpoint));
    }
}

fn endpoints_of_post_cache<'a>(
    c: &'a PostCacheConfig,
    out: &mut Vec<(&'static str, &'a Endpoint)>,
) {
    if let Some(fleet) = &c.fleet {
        out.push(("post_cache.fleet", &fleet.endpoint));
    }
}

fn endpoints_of_metering<'a>(c: &'a MeteringConfig, out: &mut Vec<(&'static str, &'a Endpoint)>) {
    if let Some(sink) = &c.sink {
        out.push(("metering.sink", &sink.endpoint));
    }
}

/// One request through the native chain.
pub struct ChainStream {
    id: u32,
    filter: FilterEnvoy,
    worker: Rc<RefCell<Worker>>,
    slot: Rc<Slot>,
    pipeline: Pipeline<NativeHost>,
    tick: Duration,
}

/// What a hook returns to Envoy after the stages ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on.
    Continue,
    /// Stop (headers) / stop and buffer (body) until resumed.
    Pause,
    /// A local response was sent: stop for good (body: without buffering).
    Answered,
}

/// What a hook carries out once the stream is no longer borrowed: Envoy
/// runs the filter's own response hooks inside `send_response` (and may
/// continue the chain inside `continue_decoding`), so neither is called
/// while a hook still holds the stream.
#[must_use]
pub struct Outcome {
    /// What the hook returns.
    pub verdict: Verdict,
    send: Option<LocalResponse>,
    resume: bool,
}

impl Outcome {
    /// Sends `response` (the stream stops for good).
    fn answer(response: LocalResponse) -> Outcome {
        Outcome {
            verdict: Verdict::Answered,
            send: Some(response),
            resume: false,
        }
    }

    /// Continues the request.
    fn resume() -> Outcome {
        Outcome {
            verdict: Verdict::Continue,
            send: None,
            resume: true,
        }
    }

    fn verdict(verdict: Verdict) -> Outcome {
        Outcome {
            verdict,
            send: None,
            resume: false,
        }
    }

    /// Sends the local response or continues the request, as the stages
    /// asked; returns the hook's verdict.
    ///
    /// # Safety
    /// `filter` must be the handle of the hook being run, and no reference
    /// to the stream may be alive.
    pub unsafe fn finish(self, filter: FilterEnvoy) -> Verdict {
        if let Some(response) = &self.send {
            let headers: Vec<(&str, &str)> = response
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            // SAFETY: the caller's contract.
            unsafe { abi::send_response(filter, response.status, &headers, &response.body) };
        } else if self.resume {
            // SAFETY: the caller's contract.
            unsafe { abi::continue_request(filter) };
        }
        self.verdict
    }
}

impl ChainStream {
    /// Runs the roots' ticks that are due; `flush`: at the end of a
    /// stream, every root also hands over what it keeps to report (so
    /// nothing waits for the next request to be reported).
    fn tick(&mut self, flush: bool) {
        let Ok(mut worker) = self.worker.try_borrow_mut() else {
            return;
        };
        let worker = &mut *worker;
        // The roots' clock is read afresh for each tick.
        worker.host.begin_callback();
        let now = worker.host.now_ms();
        let due = now >= worker.next_tick_ms;
        if !due && !flush {
            return;
        }
        if due {
            worker.next_tick_ms = now + self.tick.as_millis() as u64;
        }
        worker.host.enter(self.filter);
        for root in &mut worker.roots {
            match root.tick {
                Some(tick) if now >= root.next_tick_ms => {
                    root.next_tick_ms = now + tick.as_millis() as u64;
                    root.root.tick(&mut worker.host);
                }
                _ if flush => root.root.flush(&mut worker.host),
                _ => {}
            }
        }
        worker.host.leave();
        worker.host.process().report_refused();
        for (id, woken) in worker.host.take_woken() {
            let Some(slot) = worker.streams.get(&id).and_then(Weak::upgrade) else {
                continue;
            };
            slot.woken.borrow_mut().push(woken);
            if let Some(ticking) = slot.ticking.borrow().as_ref() {
                ticking.wake();
            }
        }
    }

    /// Runs `step` on the pipeline, then says what the stages asked for
    /// meanwhile: a local response, a resume.
    fn step(&mut self, step: impl FnOnce(&mut Pipeline<NativeHost>) -> Action) -> Outcome {
        self.tick(false);
        self.pipeline.host.begin_callback();
        let action = step(&mut self.pipeline);
        self.after_stages(action)
    }

    fn after_stages(&mut self, action: Action) -> Outcome {
        if let Some(response) = self.pipeline.host.take_response() {
            self.stop_waiting();
            return Outcome::answer(response);
        }
        if self.pipeline.host.take_resumed() {
            if self.pipeline.resume() {
                self.stop_waiting();
                return Outcome::resume();
            }
            if let Some(response) = self.pipeline.host.take_response() {
                self.stop_waiting();
                return Outcome::answer(response);
            }
        }
        match action {
            Action::Pause => {
                self.wait();
                Outcome::verdict(Verdict::Pause)
            }
            _ => Outcome::verdict(Verdict::Continue),
        }
    }

    /// The stream waits (a callout, a cached answer): its scheduled events
    /// carry the roots' ticks and wakes to it meanwhile.
    fn wait(&mut self) {
        let mut ticking = self.slot.ticking.borrow_mut();
        if ticking.is_none() {
            // SAFETY: this stream's handle, inside its hook.
            *ticking = unsafe { ticker::start(self.filter, self.tick) };
        }
    }

    fn stop_waiting(&mut self) {
        if let Some(ticking) = self.slot.ticking.borrow_mut().take() {
            ticking.stop();
        }
    }

    /// The request headers.
    pub fn request_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p| {
            p.host.read_headers(Headers::Request);
            p.request_headers(end_of_stream)
        })
    }

    /// A request body chunk.
    pub fn request_body(&mut self, end_of_stream: bool) -> Outcome {
        let outcome = self.step(|p| {
            let size = p.host.body_size(Body::Request);
            p.request_body(size, end_of_stream)
        });
        if outcome.verdict == Verdict::Pause {
            // Envoy keeps this chunk and the next in its buffer for us.
            self.pipeline.host.buffering_request = true;
        }
        outcome
    }

    /// The response headers.
    pub fn response_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p| {
            p.host.read_headers(Headers::Response);
            p.response_headers(end_of_stream)
        })
    }

    /// A response body chunk.
    pub fn response_body(&mut self, end_of_stream: bool) -> Outcome {
        let outcome = self.step(|p| {
            let size = p.host.body_size(Body::Response);
            p.response_body(size, end_of_stream)
        });
        if outcome.verdict == Verdict::Pause {
            self.pipeline.host.buffering_response = true;
        }
        outcome
    }

    /// A callout this stream made has its answer (`status` `None`: it failed).
    pub fn callout_done(&mut self, token: u32, answer: CalloutAnswer) -> Outcome {
        let size = answer.body.len();
        self.pipeline.host.set_answer(Some(answer));
        let outcome = self.step(|p| {
            p.call_answered(token, size);
            Action::Continue
        });
        self.pipeline.host.set_answer(None);
        Outcome {
            // Nothing to return from this hook; a pause stays a pause.
            verdict: Verdict::Continue,
            ..outcome
        }
    }

    /// A scheduled event: the roots' tick, and what they did to this stream.
    pub fn scheduled(&mut self) -> Outcome {
        self.tick(false);
        let woken: Vec<Woken> = std::mem::take(&mut *self.slot.woken.borrow_mut());
        for woken in woken {
            match woken {
                Woken::Answer(response) => {
                    self.pipeline.host.mark_answered();
                    self.stop_waiting();
                    return Outcome::answer(response);
                }
                Woken::Resume => {
                    self.pipeline.host.begin_callback();
                    if self.pipeline.resume() {
                        self.stop_waiting();
                        return Outcome::resume();
                    }
                    if let Some(response) = self.pipeline.host.take_response() {
                        self.stop_waiting();
                        return Outcome::answer(response);
                    }
                }
            }
        }
        Outcome::verdict(Verdict::Continue)
    }

    /// The request is over: the stages' log step, then the roots hand over
    /// what they keep to report.
    pub fn complete(&mut self) {
        self.pipeline.host.begin_callback();
        self.pipeline.log();
        self.tick(true);
    }
}

impl Drop for ChainStream {
    fn drop(&mut self) {
        self.stop_waiting();
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.streams.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn refused(config: Value) -> String {
        // SAFETY: a null handle: nothing reaches Envoy.
        match unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) } {
            Ok(_) => String::from("accepted"),
            Err(why) => why,
        }
    }

    fn lazy_auth(mode: &str) -> Value {
        json!({
            "credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}],
            "jwt": {
                "issuers": ["https://idp.test"],
                "jwks": {"cluster": "idp", "path": "/jwks", "timeout_ms": 500},
            },
            "observer": {"vm_id": "zerolayer", "queue": "zerolayer.jobs", "mode": mode},
        })
    }

    #[test]
    fn a_stage_section_is_checked_as_the_fused_filter_checks_it() {
        let why = refused(
            json!({"activation": {"rules": [{"name": "r", "when": {"path": {"matches": "("}}}]}}),
        );
        assert!(why.starts_with("activation: refused"), "{why}");
    }

    #[test]
    fn the_observer_runs_on_its_own_thread_so_tick_mode_is_refused_naming_the_field() {
        let why = refused(json!({
            "lazy_auth": lazy_auth("tick"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        }));
        assert!(why.starts_with("lazy_auth.observer.mode:"), "{why}");
    }

    #[test]
    fn a_cap_below_what_the_stages_may_hold_is_refused_naming_the_field() {
        let why = refused(json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}, "shared_max_entries": 1000},
        }));
        assert!(
            why.starts_with("native.shared_max_entries: 1000 is less than the 143619 keys"),
            "{why}"
        );
        assert!(why.contains("verdicts 65536 keys"), "{why}");
    }

    #[test]
    fn every_cluster_the_observer_calls_needs_an_upstream_address() {
        let why = refused(json!({"lazy_auth": lazy_auth("singleton")}));
        assert!(
            why.starts_with(
                "native.upstreams: no address for cluster \"idp\" (lazy_auth.jwt.jwks.cluster)"
            ),
            "{why}"
        );
        let why = refused(json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "localhost"}},
        }));
        assert!(
            why.starts_with("native.upstreams.idp: \"localhost\" is not host:port"),
            "{why}"
        );
    }

    #[test]
    fn a_chain_without_observer_work_starts_no_observer() {
        // SAFETY: a null handle: nothing reaches Envoy.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), br#"{"activation":{"rules":[]}}"#) };
        let chain = chain.unwrap_or_else(|why| panic!("{why}"));
        assert!(chain.observer.is_none());
        assert!(chain.process.queue.is_none());
    }

    #[test]
    fn the_observer_thread_starts_with_the_chain_and_stops_with_it() {
        let config = json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        });
        // SAFETY: a null handle: nothing reaches Envoy.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) };
        let chain = chain.unwrap_or_else(|why| panic!("{why}"));
        assert!(chain.observer.is_some());
        let queue = chain.process.queue.clone().expect("the observer's queue");
        assert_eq!(queue.name(), "zerolayer.jobs");
        assert!(queue.post(b"not a job").is_ok());
        // Joins the thread: a hang here is a thread that does not stop.
        drop(chain);
        assert!(
            queue.post(b"after").is_err(),
            "the observer stopped draining"
        );
    }
}
