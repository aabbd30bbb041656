//! The observer on a thread of the module's own: the same
//! `zerolayer_observer::Observer` the Wasm forms run (verification, JWKS,
//! audit and usage shipping with batches, backoff, breakers and bounded
//! buffers, fleet cache writes), driven by a tokio runtime instead of a
//! Proxy-Wasm root. The request path posts jobs on a bounded queue and never
//! waits; the thread wakes on a job, a callout's answer or its tick. Its
//! callouts go out over pooled keep-alive connections (`upstream.rs`) to
//! the addresses the configuration's `native.upstreams` gives each cluster
//! (Envoy's cluster manager is not reachable from a thread of the module's
//! own: see the crate's README, "Why `native.upstreams`").

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use zerolayer_host::{CalloutAnswer, Host, MetricKind, Platform, Status};
use zerolayer_observer::{Observer, ObserverConfig};

use crate::process::Process;
use crate::store::JobQueue;

pub(crate) mod upstream;

use upstream::Upstreams;

/// A callout's answer, back on the observer's thread.
struct Answer {
    token: u32,
    answer: CalloutAnswer,
}

/// The observer thread, running until [`ObserverThread::stop`].
pub struct ObserverThread {
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl ObserverThread {
    /// Configures the observer for `config` (refused: the line saying why)
    /// and starts its thread, draining `jobs`.
    pub fn start(
        config: ObserverConfig,
        upstreams: BTreeMap<String, SocketAddr>,
        process: Arc<Process>,
        queue: JobQueue,
        jobs: mpsc::Receiver<Vec<u8>>,
    ) -> Result<ObserverThread, String> {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        let mut host = ObserverHost {
            process,
            queue,
            jobs,
            upstreams,
            pool: Upstreams::new(),
            answers: answers_tx,
            next_token: 1,
            answer: None,
            tick: None,
        };
        let observer = Observer::configure(&mut host, &config, "zerolayer-native")?;
        let tick = Duration::from_millis(config.tick_ms.clamp(10, 60_000));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| format!("observer runtime: {e}"))?;
        let (stop, stopped) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("zerolayer-observer".into())
            .spawn(move || {
                runtime.block_on(run(observer, host, answers, tick, stopped));
            })
            .map_err(|e| format!("observer thread: {e}"))?;
        Ok(ObserverThread {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread (its last tick reports the counters) and waits.
    pub fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error!("zerolayer-native: the observer thread panicked");
        }
    }
}

impl Drop for ObserverThread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How often the observer drains its queue: jobs are taken in bursts, so
/// a request's post never wakes the thread (a wake per job cost more than
/// the job).
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// Drains (of the observer's budget each) per wake at most.
const DRAINS_PER_WAKE: usize = 64;

/// The observer's loop: the drain, an answer, the tick or the stop,
/// whichever comes first. A panic in the observer's code ends the thread,
/// logged, never the process.
async fn run(
    mut observer: Observer,
    mut host: ObserverHost,
    mut answers: mpsc::UnboundedReceiver<Answer>,
    tick: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain = tokio::time::interval(DRAIN_EVERY);
    drain.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let step = tokio::select! {
            _ = drain.tick() => Step::Drain,
            Some(answer) = answers.recv() => Step::Answer(answer),
            _ = ticker.tick() => Step::Tick,
            _ = stopped.changed() => Step::Stop,
        };
        let stop = matches!(step, Step::Stop);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match step {
            Step::Drain => {
                // A budget per drain keeps each step short; a burst
                // larger than one gets several.
                for _ in 0..DRAINS_PER_WAKE {
                    observer.drain(&mut host);
                    if host.jobs.is_empty() {
                        break;
                    }
                }
            }
            Step::Answer(Answer { token, answer }) => {
                let size = answer.body.len();
                host.answer = Some(answer);
                observer.on_http_call_response(&mut host, token, size);
                host.answer = None;
            }
            Step::Tick | Step::Stop => observer.on_tick(&mut host),
        }));
        if ran.is_err() {
            log::error!("zerolayer-native: the observer panicked; it stops (requests go on)");
            return;
        }
        if stop {
            return;
        }
    }
}

enum Step {
    Drain,
    Answer(Answer),
    Tick,
    Stop,
}

/// The host the observer sees on its thread: process shared data, the job
/// queue, callouts on pooled connections, metrics handed to the workers to
/// report.
struct ObserverHost {
    process: Arc<Process>,
    queue: JobQueue,
    jobs: mpsc::Receiver<Vec<u8>>,
    upstreams: BTreeMap<String, SocketAddr>,
    /// The connections to those upstreams, kept alive between callouts.
    pool: Upstreams,
    answers: mpsc::UnboundedSender<Answer>,
    next_token: u32,
    /// The answer being handled.
    answer: Option<CalloutAnswer>,
    tick: Option<Duration>,
}

impl Host for ObserverHost {
    fn now(&mut self) -> Duration {
        crate::host::unix_now()
    }

    fn platform(&mut self) -> Platform {
        Platform::Envoy
    }

    fn fused(&self) -> bool {
        false
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        self.tick = Some(period);
        Ok(())
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.process.data.get(key)
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        self.process.data.set(key, value, cas)
    }

    fn register_queue(&mut self, name: &str) -> Result<u32, Status> {
        if name == self.queue.name() {
            Ok(1)
        } else {
            Err(Status::BadArgument)
        }
    }

    fn resolve_queue(&mut self, _vm_id: &str, name: &str) -> Option<u32> {
        (name == self.queue.name()).then_some(1)
    }

    fn enqueue(&mut self, _queue: u32, bytes: &[u8]) -> Result<(), Status> {
        self.queue.post(bytes)
    }

    fn dequeue(&mut self, _queue: u32) -> Result<Option<Vec<u8>>, Status> {
        match self.jobs.try_recv() {
            Ok(job) => Ok(Some(job)),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Ok(None),
        }
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        let Some(&addr) = self.upstreams.get(cluster) else {
            // Checked at load for every cluster the configuration names.
            log::warn!("zerolayer-native: no upstream for cluster {cluster}");
            return Err(Status::BadArgument);
        };
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let body = body.map(<[u8]>::to_vec).unwrap_or_default();
        let answers = self.answers.clone();
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let answer = match pool.call(addr, &headers, body, timeout).await {
                Ok(answer) => answer,
                Err(why) => {
                    log::debug!("zerolayer-native: callout {token} failed: {why}");
                    CalloutAnswer::default()
                }
            };
            let _ = answers.send(Answer { token, answer });
        });
        Ok(token)
    }

    fn callout_status(&mut self) -> Option<u16> {
        self.answer.as_ref().and_then(|a| a.status)
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        self.answer
            .as_ref()
            .map(|a| a.body[..size.min(a.body.len())].to_vec())
            .unwrap_or_default()
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        self.answer.as_ref().and_then(|a| a.retry_after_secs)
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
