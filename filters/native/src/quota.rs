//! The quota stage natively: one lease holder per process. A Proxy-Wasm
//! root syncs its own table on its tick; a dynamic module's worker has no
//! timer of its own (its roots tick only inside a request's hooks), and a
//! lease must be refilled, and given back when idle, whether requests come
//! or not. So the process holds one table for the chain configuration
//! ([`Leases`]), every worker's quota root spends it
//! ([`QuotaRoot::sharing`]: no tick, no store call of its own), and the
//! stage's own root syncs it on a thread of the module's own
//! ([`QuotaRoot::syncing`] on [`QuotaSyncer`]'s thread): each
//! `sync_interval_ms` it sends the refills, returns and deltas due to the
//! store over HTTP/1.1 (webdis's `POST`, the Wasm forms' encoding, on
//! pooled keep-alive connections to `native.upstreams[store.cluster]`), and
//! applies each answer to the table as it comes.
//!
//! A request whose lease is empty still waits for its grant through a
//! callout of its own stream (Envoy's cluster `store.cluster`), answered in
//! its own hook, as in Wasm. Workers and the syncing thread share the table
//! behind a lock held only for the table's own steps (a reservation, a
//! settlement, planning a sync, applying an answer: no I/O under it).
//!
//! `store.expected_gateways` counts Envoy processes natively (each is one
//! holder, whatever its number of workers), not gateways × workers.

use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc, watch};
use zerolayer_host::{CalloutAnswer, Chain, Host, MetricKind, PipelineRoots, Platform, Status};
use zerolayer_quota::{Leases, MAX_IN_FLIGHT, QuotaRoot};

use crate::host::EnvoyProxy;
use crate::observer::upstream::Upstreams;
use crate::process::Process;

/// The hosts the syncing root runs on: [`SyncHost`] beneath the chain's
/// root host (the root makes no stream there).
type Syncing = Chain<SyncHost, EnvoyProxy>;

/// Store calls on the wire at once at most: the others wait (within their
/// own timeout) for one to finish, so a sync of many leases opens at most
/// this many connections to the store.
pub const MAX_CONCURRENT_CALLS: usize = 8;

/// How long the configuration's end waits past the store's timeout for the
/// answers of the last returns (they are sent whatever comes back).
const LAST_ANSWERS_GRACE: Duration = Duration::from_millis(100);

/// How long `config_new` waits for the thread's root to be configured.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A store call's answer, back on the syncing thread.
struct Answer {
    token: u32,
    answer: CalloutAnswer,
}

/// The thread syncing the process's lease table, until [`QuotaSyncer::stop`].
pub struct QuotaSyncer {
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl QuotaSyncer {
    /// Starts the thread syncing `leases` with the store at `store` (the
    /// address of `cluster`), its root configured from `section` (the quota
    /// section the workers' roots are configured from), and waits until it
    /// is; `Err` is the line saying why not.
    pub fn start(
        section: Vec<u8>,
        leases: Arc<Leases>,
        cluster: String,
        store: SocketAddr,
        process: Arc<Process>,
    ) -> Result<QuotaSyncer, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| format!("quota: its thread's runtime: {e}"))?;
        let (stop, stopped) = watch::channel(false);
        let (ready_tx, ready) = std::sync::mpsc::sync_channel::<bool>(1);
        let thread = std::thread::Builder::new()
            .name("zerolayer-quota".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let (answers_tx, answers) = mpsc::channel(MAX_IN_FLIGHT);
                    let mut host = PipelineRoots::new(SyncHost {
                        process,
                        cluster,
                        store,
                        pool: Upstreams::single_write(),
                        permits: Arc::new(Semaphore::new(MAX_CONCURRENT_CALLS)),
                        answers: answers_tx,
                        next_token: 1,
                        answer: None,
                        longest: Duration::ZERO,
                    });
                    let mut root = QuotaRoot::syncing(leases);
                    // Inside the runtime: the first sync sends its calls now.
                    let configured = catch_unwind(AssertUnwindSafe(|| {
                        zerolayer_host::RootStage::<Syncing>::configure(
                            &mut root, &mut host, &section,
                        )
                    }));
                    let tick = match (configured, host.take_tick()) {
                        (Ok(true), Some(tick)) => tick,
                        _ => {
                            let _ = ready_tx.send(false);
                            return;
                        }
                    };
                    let _ = ready_tx.send(true);
                    run(root, host, answers, tick, stopped).await;
                });
            })
            .map_err(|e| format!("quota: its thread: {e}"))?;
        let mut syncer = QuotaSyncer {
            stop,
            thread: Some(thread),
        };
        match ready.recv_timeout(START_TIMEOUT) {
            Ok(true) => Ok(syncer),
            Ok(false) => {
                syncer.stop();
                Err("quota: refused on its syncing thread (see the line above)".into())
            }
            Err(_) => {
                // Not joined: a thread that never configured may never end.
                let _ = syncer.stop.send(true);
                syncer.thread = None;
                Err("quota: its syncing thread did not start".into())
            }
        }
    }

    /// Stops the thread and waits for it: idle leases give back what they
    /// hold, and the answers are awaited for the store's timeout (plus
    /// [`LAST_ANSWERS_GRACE`]) at most.
    pub fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error!("zerolayer-native: the quota thread panicked");
        }
    }
}

impl Drop for QuotaSyncer {
    fn drop(&mut self) {
        self.stop();
    }
}

enum Step {
    Tick,
    Answer(Answer),
    Stop,
}

/// The syncing root's loop: its tick, a store call's answer or the stop,
/// whichever comes first. A panic in the stage's code ends the thread,
/// logged, never the process (requests go on, spending what their leases
/// hold, then refused as their leases expire).
async fn run(
    mut root: QuotaRoot,
    mut host: PipelineRoots<SyncHost>,
    mut answers: mpsc::Receiver<Answer>,
    tick: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let step = tokio::select! {
            _ = ticker.tick() => Step::Tick,
            Some(answer) = answers.recv() => Step::Answer(answer),
            _ = stopped.changed() => Step::Stop,
        };
        let stop = matches!(step, Step::Stop);
        let ran = catch_unwind(AssertUnwindSafe(|| match step {
            Step::Tick => zerolayer_host::RootStage::<Syncing>::tick(&mut root, &mut host),
            Step::Answer(answer) => deliver(&mut root, &mut host, answer),
            Step::Stop => zerolayer_host::RootStage::<Syncing>::done(&mut root, &mut host),
        }));
        if ran.is_err() {
            log::error!("zerolayer-native: the quota thread panicked; leases are no longer synced");
            return;
        }
        if stop {
            break;
        }
    }
    // The returns `done` sent: their answers, for as long as a call may take.
    let deadline = Instant::now() + host.proxy().longest + LAST_ANSWERS_GRACE;
    while root.calls_in_flight() > 0 {
        let next =
            tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), answers.recv()).await;
        let Ok(Some(answer)) = next else {
            break;
        };
        let ran = catch_unwind(AssertUnwindSafe(|| {
            deliver(&mut root, &mut host, answer);
        }));
        if ran.is_err() {
            return;
        }
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        zerolayer_host::RootStage::<Syncing>::flush(&mut root, &mut host);
    }));
}

/// Hands `answer` to the root as its callout's answer.
fn deliver(root: &mut QuotaRoot, host: &mut PipelineRoots<SyncHost>, answer: Answer) {
    let size = answer.answer.body.len();
    host.proxy().answer = Some(answer.answer);
    zerolayer_host::RootStage::<Syncing>::call_answered(root, host, answer.token, size);
    host.proxy().answer = None;
}

/// The host the syncing root sees on its thread: the clock, callouts to the
/// store's address, the process's metrics. It has no queue, and no stream.
pub(crate) struct SyncHost {
    process: Arc<Process>,
    /// The store's cluster, and its address.
    cluster: String,
    store: SocketAddr,
    /// Keep-alive connections to the store.
    pool: Upstreams,
    /// [`MAX_CONCURRENT_CALLS`].
    permits: Arc<Semaphore>,
    /// Bounded by [`MAX_IN_FLIGHT`]: the table has no more calls in flight.
    answers: mpsc::Sender<Answer>,
    next_token: u32,
    /// The answer being delivered.
    answer: Option<CalloutAnswer>,
    /// The longest timeout a call was given (how long the last answers
    /// are awaited at the end).
    longest: Duration,
}

impl Host for SyncHost {
    fn now(&mut self) -> Duration {
        crate::host::unix_now()
    }

    fn platform(&mut self) -> Platform {
        Platform::Envoy
    }

    fn fused(&self) -> bool {
        true
    }

    fn set_tick_period(&mut self, _period: Duration) -> Result<(), Status> {
        // The root host above records the period (the loop's ticker).
        Err(Status::BadArgument)
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.process.data.get(key)
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        self.process.data.set(key, value, cas)
    }

    fn register_queue(&mut self, _name: &str) -> Result<u32, Status> {
        Err(Status::BadArgument)
    }

    fn resolve_queue(&mut self, _vm_id: &str, _name: &str) -> Option<u32> {
        None
    }

    fn enqueue(&mut self, _queue: u32, _bytes: &[u8]) -> Result<(), Status> {
        Err(Status::NotFound)
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
        if cluster != self.cluster {
            // The quota stage calls its store only (checked at load).
            return Err(Status::BadArgument);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Only the thread's runtime runs the root: never the case.
            return Err(Status::InternalFailure);
        };
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        self.longest = self.longest.max(timeout);
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let body = body.map(<[u8]>::to_vec).unwrap_or_default();
        let (pool, permits, answers, addr) = (
            self.pool.clone(),
            self.permits.clone(),
            self.answers.clone(),
            self.store,
        );
        runtime.spawn(async move {
            let started = Instant::now();
            // The timeout covers the wait for a connection's turn too.
            let answer = match tokio::time::timeout(timeout, permits.acquire_owned()).await {
                Ok(Ok(_permit)) => {
                    let left = timeout.saturating_sub(started.elapsed());
                    pool.call(addr, &headers, body, left)
                        .await
                        .unwrap_or_else(|why| {
                            log::debug!("zerolayer-native: quota store call {token} failed: {why}");
                            CalloutAnswer::default()
                        })
                }
                _ => CalloutAnswer::default(),
            };
            // Gone only when the loop ended (its table with it).
            let _ = answers.send(Answer { token, answer }).await;
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

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::{Value, json};
    use zerolayer_core::quota::store::{Command, ModelStore, Reply};
    use zerolayer_core::quota::{Identity, RequestBound, Settlement, TokenCounts};

    use super::*;
    use crate::abi::BodyKind;
    use crate::chain::ChainConfig;
    use crate::envoy::StreamEnvoy;
    use crate::envoy::recording::RecordingEnvoy;
    use crate::stream::Verdict;

    fn now_ms() -> u64 {
        crate::host::unix_now().as_millis() as u64
    }

    /// webdis in front of the Rust model of Redis, on loopback: each
    /// `POST`'s body decoded into its command, answered as webdis encodes
    /// the model's reply.
    struct FakeWebdis {
        addr: SocketAddr,
        store: Arc<Mutex<ModelStore>>,
        calls: Arc<AtomicUsize>,
    }

    impl FakeWebdis {
        fn start() -> FakeWebdis {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let store = Arc::new(Mutex::new(ModelStore::new()));
            let calls = Arc::new(AtomicUsize::new(0));
            let (model, count) = (store.clone(), calls.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { return };
                    let (model, count) = (model.clone(), count.clone());
                    std::thread::spawn(move || serve(stream, &model, &count));
                }
            });
            FakeWebdis { addr, store, calls }
        }

        /// The answer webdis gives to `command`: a `POST`'s body, or a
        /// `GET`'s path after its first `/` (the stage's own calls).
        fn answer(store: &Mutex<ModelStore>, command: &[u8]) -> Vec<u8> {
            let command = Command::new(command.split(|&b| b == b'/').map(percent_decode));
            let reply = store.lock().unwrap().execute(&command, now_ms());
            let mut answer = serde_json::Map::new();
            answer.insert(command.verb(), json_of(&reply));
            Value::Object(answer).to_string().into_bytes()
        }

        /// What the store's counters hold, together.
        fn total(&self) -> i64 {
            self.store.lock().unwrap().counters().map(|(_, n)| n).sum()
        }
    }

    fn serve(stream: TcpStream, store: &Mutex<ModelStore>, calls: &AtomicUsize) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut stream = stream;
        loop {
            let mut length = 0usize;
            let mut get = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                if let Some(target) = line.strip_prefix("GET ") {
                    let path = target.split(' ').next().unwrap_or_default();
                    get = Some(path.trim_start_matches('/').as_bytes().to_vec());
                }
                let line = line.trim_end().to_ascii_lowercase();
                if line.is_empty() {
                    break;
                }
                if let Some(value) = line.strip_prefix("content-length:") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            calls.fetch_add(1, Ordering::SeqCst);
            let answer = FakeWebdis::answer(store, get.as_deref().unwrap_or(&body));
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                answer.len()
            );
            if stream
                .write_all(&[head.as_bytes(), &answer].concat())
                .is_err()
            {
                return;
            }
        }
    }

    fn percent_decode(part: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(part.len());
        let mut i = 0;
        while i < part.len() {
            let hex = part
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match (part[i], hex) {
                (b'%', Some(byte)) => {
                    out.push(byte);
                    i += 3;
                }
                (byte, _) => {
                    out.push(byte);
                    i += 1;
                }
            }
        }
        out
    }

    fn json_of(reply: &Reply) -> Value {
        match reply {
            Reply::Integer(n) => json!(n),
            Reply::Bulk(Some(bytes)) => json!(String::from_utf8_lossy(bytes)),
            Reply::Bulk(None) | Reply::Array(None) => Value::Null,
            Reply::Status(status) => json!([true, status]),
            Reply::Error(message) => json!([false, message]),
            Reply::Array(Some(items)) => Value::Array(items.iter().map(json_of).collect()),
        }
    }

    /// A chain whose quota section limits verified requests (one key for
    /// all) and unverified ones to 100 requests a day each, its store
    /// `webdis`.
    fn chain(webdis: &FakeWebdis) -> Arc<ChainConfig> {
        let budget = json!({"budget": {"amount": 100, "window": "day"}});
        let config = json!({
            "quota": {
                "store": {"cluster": "webdis", "path": "/", "timeout_ms": 500,
                          "sync_interval_ms": 50, "lease_ttl_ms": 200, "idle_return_ms": 300,
                          "expected_gateways": 1},
                "policies": [{"name": "all", "unit": "requests", "limit": budget}],
                "unverified": {"unit": "requests", "limit": budget},
            },
            "native": {"upstreams": {"webdis": webdis.addr.to_string()}},
        });
        // SAFETY: a null handle: nothing reaches Envoy's configuration.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) };
        chain.unwrap_or_else(|why| panic!("{why}"))
    }

    fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(value) = f() {
                return value;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn the_quota_thread_fills_a_lease_and_gives_back_what_is_unspent_with_no_request_to_carry_it() {
        let webdis = FakeWebdis::start();
        let chain = chain(&webdis);
        let leases = chain.leases().expect("the process's lease table").clone();
        let who = Identity {
            verified: true,
            ..Identity::default()
        };
        let bound = RequestBound::new(10, Some(10));
        // The first reservation finds the lease empty: its grant is asked
        // for by the quota thread, on its tick, as no worker ticks here.
        assert!(
            leases
                .quota()
                .reserve(&who, &bound, false, now_ms())
                .is_err()
        );
        let ticket = wait_for("a grant", || {
            leases.quota().reserve(&who, &bound, false, now_ms()).ok()
        });
        leases.quota().settle(
            ticket,
            None,
            Settlement::Usage(TokenCounts::default()),
            now_ms(),
        );
        // Idle, the lease gives back what it holds: the store counts the
        // one request spent.
        wait_for("the store to count what was spent", || {
            (webdis.total() == 1).then_some(())
        });
        let calls = webdis.calls.load(Ordering::SeqCst);
        drop(chain);
        assert!(calls >= 2, "a grant and a return: {calls} calls");
    }

    #[test]
    fn a_request_whose_lease_is_empty_waits_for_its_own_callout_and_the_thread_settles_what_it_spent()
     {
        let webdis = FakeWebdis::start();
        let chain = chain(&webdis);
        let envoy = RecordingEnvoy::with_request(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gateway"),
            ("content-type", "application/json"),
            ("x-request-id", "req-1"),
        ]);
        let mut stream = chain.stream(StreamEnvoy::Recording(envoy.clone()));
        // The headers wait for the body (its bound).
        assert_eq!(stream.request_headers(false).finish(&envoy), Verdict::Pause);
        let body = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
        envoy
            .0
            .borrow_mut()
            .bodies
            .push((BodyKind::ReceivedRequest, body.to_vec()));
        // The lease is empty: the request asks for its grant itself, on
        // Envoy's cluster, and waits.
        assert_eq!(stream.request_body(true).finish(&envoy), Verdict::Pause);
        let callouts = envoy.0.borrow().callouts.clone();
        assert!(!callouts.is_empty(), "no callout of the request's own");
        assert!(callouts.iter().all(|(cluster, _, _)| cluster == b"webdis"));
        assert!(envoy.0.borrow().sent.is_empty(), "no 429 while it waits");
        for (i, (_, path, body)) in callouts.iter().enumerate() {
            // The stage's own calls are `GET <path>/<command>`.
            let command = if body.is_empty() {
                path.trim_start_matches('/').as_bytes()
            } else {
                body.as_slice()
            };
            let answer = CalloutAnswer {
                status: Some(200),
                body: FakeWebdis::answer(&webdis.store, command),
                retry_after_secs: None,
            };
            let _ = stream.callout_done(i as u32 + 1, answer).finish(&envoy);
        }
        assert_eq!(envoy.0.borrow().continued, 1, "resumed once granted");
        assert!(
            envoy.0.borrow().sent.is_empty(),
            "{:?}",
            envoy.0.borrow().sent
        );
        envoy.0.borrow_mut().response_headers = vec![
            (":status".into(), b"200".to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
        ];
        assert_eq!(
            stream.response_headers(true).finish(&envoy),
            Verdict::Continue
        );
        assert!(
            envoy
                .0
                .borrow()
                .response_headers
                .iter()
                .any(|(name, _)| name.starts_with("x-ratelimit-")),
            "{:?}",
            envoy.0.borrow().response_headers
        );
        stream.complete();
        drop(stream);
        // The worker's settlement is in the process's table, which the
        // quota thread syncs: the idle lease's surplus goes back.
        wait_for("the store to count the request", || {
            (webdis.total() == 1).then_some(())
        });
    }
}
