//! `host-sim serve`: a loopback HTTP/1.1 proxy that runs a filter chain in
//! host-sim, so curl and real SDK clients can go through it, and so the
//! differential suite can send the very same requests to it and to Envoy.
//!
//! One thread owns the [`Host`] (Wasm is single-threaded, as one Envoy
//! worker is); a tokio runtime does the networking. They talk through
//! channels: the network side feeds request and response data in, the Wasm
//! thread sends back what left each end of the chain. Streaming responses
//! pass through chunk by chunk as they arrive. Time is the real clock; ticks
//! and callout timeouts fire on it. Callouts to clusters run on the runtime.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use zerolayer_core::internal;

use host_sim::abi::Headers;
use host_sim::{
    CallResponse, Callout, ChainId, ClusterTarget, Host, HostOptions, LocalResponse, Profile,
    StreamId, StreamInfo,
};

use crate::config_file::{ChainFile, Route, RouteAction};

/// What `serve` runs and where.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Filters, singletons and clusters.
    pub chain: ChainFile,
    /// Where requests go after the chain.
    pub upstream: SocketAddr,
    /// Listener (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Admin listener for `/stats/prometheus`, `/ready`, `/logs` (port 0 picks one).
    pub admin: SocketAddr,
    /// Envoy or Kong behaviour.
    pub profile: Profile,
    /// Print module logs to stderr.
    pub echo_logs: bool,
    /// Kong: the declared shared queues (`shm_queue`).
    pub kong_queues: Vec<String>,
    /// Kong: nginx's `client_body_buffer_size` (see
    /// `HostOptions::kong_body_buffer_bytes`).
    pub kong_body_buffer_bytes: Option<usize>,
    /// Where to send a [`StreamRecord`] for each stream that ends (replay).
    pub records: Option<std_mpsc::Sender<StreamRecord>>,
}

/// What the chain did with one stream, sent when the stream ends.
#[derive(Debug, Clone)]
pub struct StreamRecord {
    /// The request's `x-request-id` as it entered the chain.
    pub request_id: String,
    /// Time inside each filter for this stream, chain order.
    pub wasm: Vec<(String, Duration)>,
    /// From the request leaving the chain to the upstream response's end
    /// reaching it; `None` when no request went upstream.
    pub upstream: Option<Duration>,
    /// Whether a filter answered the request itself.
    pub local_reply: bool,
    /// The hand-off values the filters published (observers, auth, usage),
    /// by property name (`wasmx.zerolayer_…`).
    pub handoffs: Vec<(String, Vec<u8>)>,
}

/// Hand-off properties copied into a [`StreamRecord`].
const RECORDED_HANDOFFS: [&str; 3] = [
    internal::OBSERVERS_PROPERTY,
    internal::AUTH_PROPERTY,
    internal::USAGE_PROPERTY,
];

/// Events from the Wasm thread to one stream's network task.
#[derive(Debug)]
enum StreamEvent {
    UpstreamHeaders(Headers, bool),
    UpstreamData(Vec<u8>, bool),
    ClientHeaders(Headers, bool),
    ClientData(Vec<u8>, bool),
    Reset,
}

/// Commands to the Wasm thread.
enum Command {
    Open {
        info: StreamInfo,
        headers: Headers,
        end: bool,
        /// Answered before any filter sees it (Envoy's 400 and 426): the
        /// filters get only `on_log`.
        refuse: Option<LocalResponse>,
        events: mpsc::UnboundedSender<StreamEvent>,
        reply: oneshot::Sender<StreamId>,
    },
    RequestData(StreamId, Vec<u8>, bool),
    ResponseHeaders(StreamId, Headers, bool),
    ResponseData(StreamId, Vec<u8>, bool),
    Reset(StreamId),
    CalloutDone(u32, CallResponse),
    Admin(String, oneshot::Sender<(u16, String)>),
    Shutdown,
}

/// A running `serve`; stops when dropped.
pub struct Server {
    addr: SocketAddr,
    admin: SocketAddr,
    commands: std_mpsc::Sender<Command>,
    runtime: Option<tokio::runtime::Runtime>,
    wasm: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Loads the chain (failing like Envoy does on a refused configuration)
    /// and starts listening.
    pub fn start(options: ServeOptions) -> Result<Server> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (commands, inbox) = std_mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<()>>();
        let handle = runtime.handle().clone();
        let callout_commands = commands.clone();
        let wasm_options = options.clone();
        let wasm = std::thread::Builder::new()
            .name("host-sim-wasm".into())
            .spawn(move || wasm_thread(wasm_options, inbox, callout_commands, handle, ready_tx))?;
        ready_rx
            .recv()
            .map_err(|_| anyhow!("the Wasm thread stopped during start-up"))??;

        let listener = runtime
            .block_on(TcpListener::bind(options.listen))
            .context("binding the listener")?;
        let admin_listener = runtime
            .block_on(TcpListener::bind(options.admin))
            .context("binding the admin listener")?;
        let addr = listener.local_addr()?;
        let admin = admin_listener.local_addr()?;
        let client: Client<HttpConnector, Body> =
            Client::builder(TokioExecutor::new()).build(crate::replay::connector());
        let proxy = Proxy {
            commands: commands.clone(),
            profile: options.profile,
            upstream: options.upstream,
            client,
            listener: addr,
        };
        runtime.spawn(accept(listener, proxy));
        runtime.spawn(accept_admin(admin_listener, commands.clone()));
        Ok(Server {
            addr,
            admin,
            commands,
            runtime: Some(runtime),
            wasm: Some(wasm),
        })
    }

    /// The listener address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin address.
    pub fn admin(&self) -> SocketAddr {
        self.admin
    }

    /// Blocks until the process is killed.
    pub fn wait(mut self) {
        if let Some(wasm) = self.wasm.take() {
            let _ = wasm.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(wasm) = self.wasm.take() {
            let _ = wasm.join();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

// ---- the Wasm thread ----

#[derive(Default)]
struct Emitted {
    up_headers: bool,
    up_body: usize,
    up_end: bool,
    client_headers: bool,
    client_body: usize,
    client_end: bool,
}

struct Open {
    events: mpsc::UnboundedSender<StreamEvent>,
    emitted: Emitted,
    request_id: String,
    /// When the request headers left the chain for the upstream.
    upstream_sent: Option<Instant>,
    /// When the upstream response's end reached the chain.
    upstream_done: Option<Instant>,
    /// The router answered the request itself (a direct response, or no
    /// route): nothing goes upstream.
    answered: bool,
}

fn wasm_thread(
    options: ServeOptions,
    inbox: std_mpsc::Receiver<Command>,
    commands: std_mpsc::Sender<Command>,
    runtime: tokio::runtime::Handle,
    ready: std_mpsc::Sender<Result<()>>,
) {
    let setup = || -> Result<(Host, ChainId, HashMap<String, SocketAddr>)> {
        let mut host = Host::with_options(HostOptions {
            profile: options.profile,
            workers: 1,
            virtual_start_ns: None,
            echo_logs: options.echo_logs,
            kong_queues: options.kong_queues.clone(),
            kong_body_buffer_bytes: options.kong_body_buffer_bytes,
            kong_gateway: false,
            ..HostOptions::default()
        })?;
        let mut clusters = HashMap::new();
        for (name, addr) in &options.chain.clusters {
            // Callouts are performed on the runtime, not on this thread.
            host.set_cluster(name, ClusterTarget::Manual);
            clusters.insert(name.clone(), *addr);
        }
        for name in &options.chain.unresolved_clusters {
            // Known to Envoy, with no host: `start_callouts` answers.
            host.set_cluster(name, ClusterTarget::Manual);
        }
        for singleton in &options.chain.singletons {
            host.add_singleton(singleton.clone())?;
        }
        let chain = host.add_chain(options.chain.filters.clone())?;
        Ok((host, chain, clusters))
    };
    let (mut host, chain, clusters) = match setup() {
        Ok(x) => {
            let _ = ready.send(Ok(()));
            x
        }
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    let mut open: HashMap<StreamId, Open> = HashMap::new();
    let mut started_callouts: std::collections::HashSet<u32> = std::collections::HashSet::new();
    loop {
        let wait = Duration::from_millis(5);
        match inbox.recv_timeout(wait) {
            Ok(Command::Shutdown) | Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                host.shutdown();
                return;
            }
            Ok(Command::Open {
                info,
                headers,
                end,
                refuse,
                events,
                reply,
            }) => match host.open_stream(chain, info) {
                Ok(id) => {
                    let _ = reply.send(id);
                    let request_id = headers
                        .iter()
                        .find(|(k, _)| k == "x-request-id")
                        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                        .unwrap_or_default();
                    open.insert(
                        id,
                        Open {
                            events,
                            emitted: Emitted::default(),
                            request_id,
                            upstream_sent: None,
                            upstream_done: None,
                            answered: false,
                        },
                    );
                    match refuse {
                        Some(local) => host.refuse(id, local),
                        None => host.deliver_headers(id, false, headers, end),
                    }
                }
                Err(err) => {
                    eprintln!("host-sim: cannot open a stream: {err:#}");
                }
            },
            Ok(Command::RequestData(id, data, end)) => host.deliver_data(id, false, data, end),
            Ok(Command::ResponseHeaders(id, headers, end)) => {
                if end {
                    upstream_done(&mut open, id);
                }
                host.deliver_headers(id, true, headers, end)
            }
            Ok(Command::ResponseData(id, data, end)) => {
                if end {
                    upstream_done(&mut open, id);
                }
                host.deliver_data(id, true, data, end)
            }
            Ok(Command::Reset(id)) => host.reset(id),
            Ok(Command::CalloutDone(token, response)) => {
                started_callouts.remove(&token);
                host.deliver_callout(token, response);
            }
            Ok(Command::Admin(path, reply)) => {
                let answer = match path.as_str() {
                    "/stats/prometheus" => (200, host.prometheus()),
                    "/ready" => (200, "LIVE\n".to_string()),
                    "/logs" => (
                        200,
                        host.logs()
                            .iter()
                            .map(|l| format!("[{}] {}: {}\n", l.level.name(), l.plugin, l.message))
                            .collect(),
                    ),
                    _ => (404, "unknown admin path\n".to_string()),
                };
                let _ = reply.send(answer);
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
        }
        host.fire_due(host.now_ns());
        start_callouts(
            &host,
            &clusters,
            options.profile,
            &mut started_callouts,
            &commands,
            &runtime,
        );
        sync_streams(
            &mut host,
            &mut open,
            &options.chain,
            options.profile,
            options.records.as_ref(),
        );
    }
}

fn upstream_done(open: &mut HashMap<StreamId, Open>, id: StreamId) {
    if let Some(stream) = open.get_mut(&id) {
        stream.upstream_done.get_or_insert_with(Instant::now);
    }
}

/// The record of a stream that ended, read before its bookkeeping goes.
fn stream_record(host: &Host, id: StreamId, stream: &Open) -> StreamRecord {
    let handoffs = RECORDED_HANDOFFS
        .iter()
        .filter_map(|path| Some((path.to_string(), host.published(id, path)?)))
        .collect();
    StreamRecord {
        request_id: stream.request_id.clone(),
        wasm: host.stream_wasm_times(id),
        upstream: match (stream.upstream_sent, stream.upstream_done) {
            (Some(sent), Some(done)) => Some(done.saturating_duration_since(sent)),
            _ => None,
        },
        local_reply: host.local_of(id).is_some(),
        handoffs,
    }
}

fn start_callouts(
    host: &Host,
    clusters: &HashMap<String, SocketAddr>,
    profile: Profile,
    started: &mut std::collections::HashSet<u32>,
    commands: &std_mpsc::Sender<Command>,
    runtime: &tokio::runtime::Handle,
) {
    for callout in host.callouts() {
        if !started.insert(callout.token) {
            continue;
        }
        let commands = commands.clone();
        // A cluster's address; under Kong any `IP:port` the module names
        // (ngx_wasm_module connects to it).
        let addr = clusters.get(&callout.cluster).copied().or_else(|| {
            (profile == Profile::Kong)
                .then(|| callout.cluster.parse::<SocketAddr>().ok())
                .flatten()
        });
        match addr {
            Some(addr) => {
                runtime.spawn_blocking(move || {
                    let response = blocking(addr, &callout, profile);
                    let _ = commands.send(Command::CalloutDone(callout.token, response));
                });
            }
            None => {
                let response = match profile {
                    // A cluster whose name did not resolve: no healthy host.
                    Profile::Envoy => CallResponse::new(503, NO_HEALTHY_UPSTREAM)
                        .header("content-length", &NO_HEALTHY_UPSTREAM.len().to_string())
                        .header("content-type", "text/plain"),
                    // ngx_wasm_module resolves any other name (none here).
                    Profile::Kong => CallResponse::failed("resolver failure"),
                };
                let _ = commands.send(Command::CalloutDone(callout.token, response));
            }
        }
    }
}

/// Envoy's answer for a cluster without a healthy host.
const NO_HEALTHY_UPSTREAM: &str = "no healthy upstream";

fn blocking(addr: SocketAddr, callout: &Callout, profile: Profile) -> CallResponse {
    host_sim::callout::blocking_http(addr, callout, profile)
}

/// Sends each open stream's news (what newly left either end of the chain)
/// to its network task, and forgets finished streams.
fn sync_streams(
    host: &mut Host,
    open: &mut HashMap<StreamId, Open>,
    chain: &ChainFile,
    profile: Profile,
    records: Option<&std_mpsc::Sender<StreamRecord>>,
) {
    let mut done = vec![];
    // Requests the router answers itself: (stream, status, body).
    let mut answers: Vec<(StreamId, u16, Vec<u8>)> = vec![];
    for (id, stream) in open.iter_mut() {
        let e = &mut stream.emitted;
        if let Some(up) = host.upstream_output(*id) {
            if let (false, Some(headers)) = (e.up_headers, &up.headers) {
                e.up_headers = true;
                let path = headers
                    .iter()
                    .find(|(k, _)| k == ":path")
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                match chain.route_for(&path) {
                    None => {
                        // Envoy's router: no route, 404.
                        stream.answered = true;
                        answers.push((*id, 404, Vec::new()));
                    }
                    Some(Route {
                        action: RouteAction::Direct { status, body },
                        ..
                    }) => {
                        stream.answered = true;
                        answers.push((*id, status, body));
                    }
                    Some(Route {
                        action: RouteAction::Proxy { timeout_ms },
                        request_headers,
                        ..
                    }) => {
                        stream.upstream_sent = Some(Instant::now());
                        let end = up.complete && up.body.is_empty();
                        e.up_end = end;
                        // Envoy's router adds the route's headers after the
                        // filters, then announces the route's timeout.
                        let mut headers = headers.clone();
                        for (name, format) in &request_headers {
                            let value = crate::config_file::expand_format(format, |key| {
                                host.filter_state(*id, key)
                            });
                            headers.retain(|(k, _)| k != name);
                            headers.push((name.clone(), value.into_bytes()));
                        }
                        if profile == Profile::Envoy && timeout_ms > 0 {
                            headers.retain(|(k, _)| k != "x-envoy-expected-rq-timeout-ms");
                            headers.push((
                                "x-envoy-expected-rq-timeout-ms".into(),
                                timeout_ms.to_string().into_bytes(),
                            ));
                        }
                        let _ = stream
                            .events
                            .send(StreamEvent::UpstreamHeaders(headers, end));
                    }
                }
            }
            if e.up_headers
                && !stream.answered
                && !e.up_end
                && (up.body.len() > e.up_body || up.complete)
            {
                let chunk = up.body[e.up_body..].to_vec();
                e.up_body = up.body.len();
                e.up_end = up.complete;
                let _ = stream
                    .events
                    .send(StreamEvent::UpstreamData(chunk, up.complete));
            }
        }
        if let Some(client) = host.client_output(*id) {
            if let (false, Some(headers)) = (e.client_headers, &client.headers) {
                e.client_headers = true;
                let end = client.complete && client.body.is_empty();
                e.client_end = end;
                let _ = stream
                    .events
                    .send(StreamEvent::ClientHeaders(headers.clone(), end));
            }
            if e.client_headers
                && !e.client_end
                && (client.body.len() > e.client_body || client.complete)
            {
                let chunk = client.body[e.client_body..].to_vec();
                e.client_body = client.body.len();
                e.client_end = client.complete;
                let _ = stream
                    .events
                    .send(StreamEvent::ClientData(chunk, client.complete));
            }
        }
        if host.is_reset(*id) && !e.client_end {
            let _ = stream.events.send(StreamEvent::Reset);
            e.client_end = true;
        }
        if host.is_finished(*id) && e.client_end {
            done.push(*id);
        }
    }
    for (id, status, body) in answers {
        // The router's own answer goes back through the filters, as an
        // upstream's would.
        upstream_done(open, id);
        let mut headers: Headers = vec![
            (":status".into(), status.to_string().into_bytes()),
            ("content-length".into(), body.len().to_string().into_bytes()),
        ];
        if !body.is_empty() {
            headers.push(("content-type".into(), b"text/plain".to_vec()));
        }
        let end = body.is_empty();
        host.deliver_headers(id, true, headers, end);
        if !end {
            host.deliver_data(id, true, body, true);
        }
    }
    for id in done {
        if let Some(stream) = open.remove(&id)
            && let Some(records) = records
        {
            let _ = records.send(stream_record(host, id, &stream));
        }
        host.drop_stream(id);
    }
}

// ---- the network side ----

#[derive(Clone)]
struct Proxy {
    commands: std_mpsc::Sender<Command>,
    profile: Profile,
    upstream: SocketAddr,
    client: Client<HttpConnector, Body>,
    listener: SocketAddr,
}

/// A body that can break off: a stream reset after its headers left ends
/// the body with an error, so the peer sees the connection cut (as from
/// Envoy), not a complete message.
type Body = BoxBody<Bytes, BodyError>;
type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// What a cut body ends with.
fn reset_error() -> BodyError {
    "the stream was reset".into()
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A body fed by a channel of chunks (an `Err` cuts it).
fn channel_body() -> (mpsc::UnboundedSender<Result<Bytes, BodyError>>, Body) {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Bytes, BodyError>>();
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk.map(Frame::data), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

async fn accept(listener: TcpListener, proxy: Proxy) {
    loop {
        let Ok((socket, peer)) = listener.accept().await else {
            continue;
        };
        // Without it, a request whose body follows its headers in a second
        // write waits for a delayed ACK (~40 ms on Linux), as Envoy never does.
        let _ = socket.set_nodelay(true);
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(proxy.handle(req, peer).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(socket), service)
                .await;
        });
    }
}

async fn accept_admin(listener: TcpListener, commands: std_mpsc::Sender<Command>) {
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        let commands = commands.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let commands = commands.clone();
                async move {
                    let (tx, rx) = oneshot::channel();
                    let _ = commands.send(Command::Admin(req.uri().path().to_string(), tx));
                    let (status, body) = rx.await.unwrap_or((503, "stopped\n".into()));
                    let mut response = Response::new(full(body));
                    *response.status_mut() =
                        hyper::StatusCode::from_u16(status).unwrap_or_default();
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(socket), service)
                .await;
        });
    }
}

/// Hop-by-hop headers a proxy never forwards.
pub(crate) const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
];

fn request_id() -> String {
    // Unique per process run; the format of Envoy's (a UUID v4 string).
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let a = t ^ n.rotate_left(32);
    format!(
        "{:08x}-{:04x}-4{:03x}-a{:03x}-{:012x}",
        (a >> 32) as u32,
        (a >> 16) as u16,
        (a & 0xfff) as u16,
        (n & 0xfff) as u16,
        n.wrapping_mul(0x9e37_79b9_7f4a_7c15) & 0xffff_ffff_ffff
    )
}

impl Proxy {
    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        match self.run(req, peer).await {
            Ok(response) => response,
            Err(err) => {
                let mut response = Response::new(full(format!("host-sim: {err:#}\n")));
                *response.status_mut() = hyper::StatusCode::BAD_GATEWAY;
                response
            }
        }
    }

    async fn run(&self, req: Request<Incoming>, peer: SocketAddr) -> Result<Response<Body>> {
        let (parts, body) = req.into_parts();
        // What the real host answers before any filter runs.
        let no_host =
            parts.version == hyper::Version::HTTP_11 && !parts.headers.contains_key("host");
        let refuse = match self.profile {
            // Envoy's connection manager: HTTP/1.0 is not accepted, and an
            // HTTP/1.1 request needs a Host; the filters see only `on_log`.
            Profile::Envoy if parts.version == hyper::Version::HTTP_10 => Some(LocalResponse {
                status: 426,
                details: "low_version".into(),
                headers: vec![],
                body: b"Upgrade Required".to_vec(),
                grpc_status: None,
            }),
            Profile::Envoy if no_host => Some(LocalResponse {
                status: 400,
                details: "missing_host_header".into(),
                headers: vec![],
                body: Vec::new(),
                grpc_status: None,
            }),
            // nginx refuses an HTTP/1.1 request without Host itself: no
            // filter runs at all.
            Profile::Kong if no_host => return Ok(nginx_bad_request()),
            _ => None,
        };
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or("/".into())
            .into_bytes();
        let method = parts.method.as_str().as_bytes().to_vec();
        let mut headers: Headers = match self.profile {
            // The request as Envoy's filters see it: pseudo-headers first,
            // lower-case names, hop-by-hop headers gone, x-forwarded-proto
            // and x-request-id added.
            Profile::Envoy => {
                let authority = parts
                    .headers
                    .get("host")
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
                    .unwrap_or_else(|| self.listener.to_string());
                vec![
                    (":authority".into(), authority.into_bytes()),
                    (":path".into(), path),
                    (":method".into(), method),
                    (":scheme".into(), b"http".to_vec()),
                ]
            }
            // As ngx_wasm_module presents it: `:path`, `:method`,
            // `:scheme`, then `:authority`, which is the server's name (the
            // machine's host name here) and port, not the client's `Host`;
            // the client's headers as they came, `Host` among them; nothing
            // added, none taken away (`Connection` too). (Names are
            // lower-case here; nginx keeps the client's case.)
            Profile::Kong => vec![
                (":path".into(), path),
                (":method".into(), method),
                (":scheme".into(), b"http".to_vec()),
                (
                    ":authority".into(),
                    format!("{}:{}", host_name(), self.listener.port()).into_bytes(),
                ),
            ],
        };
        for (name, value) in &parts.headers {
            let name = name.as_str().to_ascii_lowercase();
            let envoy = self.profile == Profile::Envoy;
            if envoy && (name == "host" || HOP_BY_HOP.contains(&name.as_str())) {
                continue;
            }
            headers.push((name, value.as_bytes().to_vec()));
        }
        if self.profile == Profile::Envoy {
            headers.push(("x-forwarded-proto".into(), b"http".to_vec()));
            if !headers.iter().any(|(k, _)| k == "x-request-id") {
                headers.push(("x-request-id".into(), request_id().into_bytes()));
            }
        }
        let client_close = parts
            .headers
            .get("connection")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        let end = hyper::body::Body::is_end_stream(&body);
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let (reply_tx, reply_rx) = oneshot::channel();
        let info = StreamInfo {
            source: peer,
            destination: self.listener,
            ..StreamInfo::default()
        };
        let refused = refuse.clone();
        self.commands
            .send(Command::Open {
                info,
                headers,
                end,
                refuse,
                events: events_tx,
                reply: reply_tx,
            })
            .map_err(|_| anyhow!("the Wasm thread is gone"))?;
        let id = reply_rx
            .await
            .map_err(|_| anyhow!("the chain could not open a stream"))?;
        if let Some(local) = refused {
            // Envoy answers and closes the connection.
            let mut response = Response::new(full(local.body.clone()));
            *response.status_mut() = hyper::StatusCode::from_u16(local.status)?;
            let headers = response.headers_mut();
            if !local.body.is_empty() {
                headers.insert("content-type", "text/plain".parse()?);
            }
            headers.insert("connection", "close".parse()?);
            return Ok(response);
        }
        if !end {
            let commands = self.commands.clone();
            tokio::spawn(forward_request_body(id, body, commands));
        }

        let mut upstream_body: Option<mpsc::UnboundedSender<Result<Bytes, BodyError>>> = None;
        let mut response: Option<Response<Body>> = None;
        while let Some(event) = events.recv().await {
            match event {
                StreamEvent::UpstreamHeaders(headers, end) => {
                    let (tx, body) = if end {
                        (None, full(Bytes::new()))
                    } else {
                        let (tx, body) = channel_body();
                        (Some(tx), body)
                    };
                    upstream_body = tx;
                    self.spawn_upstream(id, headers, body, client_close);
                }
                StreamEvent::UpstreamData(data, end) => {
                    if let Some(tx) = &upstream_body
                        && !data.is_empty()
                    {
                        let _ = tx.send(Ok(Bytes::from(data)));
                    }
                    if end {
                        upstream_body = None;
                    }
                }
                StreamEvent::ClientHeaders(headers, end) => {
                    let (tx, body) = if end {
                        (None, full(Bytes::new()))
                    } else {
                        let (tx, body) = channel_body();
                        (Some(tx), body)
                    };
                    response = Some(client_response(&headers, body)?);
                    // Headers go to the client now; the body (and any rest of
                    // the request body) follows as it comes.
                    let remaining = ForwardClient {
                        events,
                        client_body: tx,
                        upstream_body: upstream_body.take(),
                    };
                    tokio::spawn(remaining.run());
                    break;
                }
                StreamEvent::ClientData(..) => {}
                StreamEvent::Reset => break,
            }
        }
        response.ok_or_else(|| anyhow!("the stream was reset before a response"))
    }

    fn spawn_upstream(&self, id: StreamId, headers: Headers, body: Body, client_close: bool) {
        let client = self.client.clone();
        let commands = self.commands.clone();
        let upstream = self.upstream;
        let profile = self.profile;
        tokio::spawn(async move {
            let sent = Instant::now();
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            };
            let path = get(":path").unwrap_or_else(|| "/".into());
            let method = get(":method").unwrap_or_else(|| "GET".into());
            let mut builder = Request::builder()
                .method(method.as_str())
                .uri(format!("http://{upstream}{path}"));
            // The map's own `host` (Kong keeps the client's), else `:authority`.
            if let Some(authority) = get(":authority")
                && get("host").is_none()
            {
                builder = builder.header("host", authority);
            }
            for (name, value) in &headers {
                // A proxy never forwards hop-by-hop headers (under Kong the
                // filters' map has the client's).
                if !name.starts_with(':') && !HOP_BY_HOP.contains(&name.as_str()) {
                    builder = builder.header(name.as_str(), value.as_slice());
                }
            }
            let Ok(request) = builder.body(body) else {
                let _ = commands.send(Command::Reset(id));
                return;
            };
            match client.request(request).await {
                Ok(response) => {
                    let (parts, mut body) = response.into_parts();
                    let mut headers: Headers = vec![(
                        ":status".into(),
                        parts.status.as_u16().to_string().into_bytes(),
                    )];
                    if profile == Profile::Kong {
                        kong_response_shims(&mut headers, &parts.headers, client_close);
                    }
                    for (name, value) in &parts.headers {
                        let name = name.as_str().to_ascii_lowercase();
                        if HOP_BY_HOP.contains(&name.as_str()) {
                            continue;
                        }
                        if profile == Profile::Kong
                            && matches!(
                                name.as_str(),
                                "content-type" | "content-length" | "server" | "date"
                            )
                        {
                            continue;
                        }
                        headers.push((name, value.as_bytes().to_vec()));
                    }
                    if profile == Profile::Kong {
                        // nginx's own, after the upstream's (its proxy
                        // hides the upstream's `Server` and `Date`).
                        headers.push(("server".into(), host_sim::NGINX_SERVER.as_bytes().to_vec()));
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_nanos() as u64)
                            .unwrap_or(0);
                        headers.push(("date".into(), host_sim::http_date(now).into_bytes()));
                    }
                    if profile == Profile::Envoy {
                        // Envoy's router says how long the upstream took,
                        // before the filters see the response.
                        headers.push((
                            "x-envoy-upstream-service-time".into(),
                            sent.elapsed().as_millis().to_string().into_bytes(),
                        ));
                    }
                    let end = hyper::body::Body::is_end_stream(&body);
                    let _ = commands.send(Command::ResponseHeaders(id, headers, end));
                    if end {
                        return;
                    }
                    loop {
                        match body.frame().await {
                            Some(Ok(frame)) => {
                                if let Ok(data) = frame.into_data() {
                                    let _ = commands.send(Command::ResponseData(
                                        id,
                                        data.to_vec(),
                                        false,
                                    ));
                                }
                            }
                            Some(Err(_)) => {
                                let _ = commands.send(Command::Reset(id));
                                return;
                            }
                            None => {
                                let _ = commands.send(Command::ResponseData(id, Vec::new(), true));
                                return;
                            }
                        }
                    }
                }
                Err(_) => {
                    // What Envoy's router answers when the upstream is unreachable.
                    let body = host_sim::callout::ENVOY_CONNECT_FAILURE.as_bytes().to_vec();
                    let headers = vec![
                        (":status".into(), b"503".to_vec()),
                        ("content-length".into(), body.len().to_string().into_bytes()),
                        ("content-type".into(), b"text/plain".to_vec()),
                    ];
                    let _ = commands.send(Command::ResponseHeaders(id, headers, false));
                    let _ = commands.send(Command::ResponseData(id, body, true));
                }
            }
        });
    }
}

/// Forwards the rest of a stream after the client's response headers left.
struct ForwardClient {
    events: mpsc::UnboundedReceiver<StreamEvent>,
    client_body: Option<mpsc::UnboundedSender<Result<Bytes, BodyError>>>,
    upstream_body: Option<mpsc::UnboundedSender<Result<Bytes, BodyError>>>,
}

impl ForwardClient {
    async fn run(mut self) {
        while let Some(event) = self.events.recv().await {
            match event {
                StreamEvent::ClientData(data, end) => {
                    if let Some(tx) = &self.client_body
                        && !data.is_empty()
                    {
                        let _ = tx.send(Ok(Bytes::from(data)));
                    }
                    if end {
                        self.client_body = None;
                    }
                }
                StreamEvent::UpstreamData(data, end) => {
                    if let Some(tx) = &self.upstream_body
                        && !data.is_empty()
                    {
                        let _ = tx.send(Ok(Bytes::from(data)));
                    }
                    if end {
                        self.upstream_body = None;
                    }
                }
                StreamEvent::Reset => {
                    // Cut both bodies: the peers see the connection broken.
                    for tx in [&self.client_body, &self.upstream_body]
                        .into_iter()
                        .flatten()
                    {
                        let _ = tx.send(Err(reset_error()));
                    }
                    return;
                }
                StreamEvent::UpstreamHeaders(..) | StreamEvent::ClientHeaders(..) => {}
            }
            if self.client_body.is_none() && self.upstream_body.is_none() {
                return;
            }
        }
    }
}

async fn forward_request_body(
    id: StreamId,
    mut body: Incoming,
    commands: std_mpsc::Sender<Command>,
) {
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let end = hyper::body::Body::is_end_stream(&body);
                    let _ = commands.send(Command::RequestData(id, data.to_vec(), end));
                    if end {
                        return;
                    }
                }
            }
            Some(Err(_)) => {
                let _ = commands.send(Command::Reset(id));
                return;
            }
            None => {
                let _ = commands.send(Command::RequestData(id, Vec::new(), true));
                return;
            }
        }
    }
}

/// ngx_wasm_module's "shim" response headers, which come first in the map
/// the filters see: `Content-Type`, `Content-Length` (or `Transfer-Encoding:
/// chunked`) and `Connection` as nginx will send them.
fn kong_response_shims(headers: &mut Headers, upstream: &hyper::HeaderMap, client_close: bool) {
    if let Some(value) = upstream.get("content-type") {
        headers.push(("content-type".into(), value.as_bytes().to_vec()));
    }
    match upstream.get("content-length") {
        Some(value) => headers.push(("content-length".into(), value.as_bytes().to_vec())),
        None => headers.push(("transfer-encoding".into(), b"chunked".to_vec())),
    }
    let connection: &[u8] = if client_close {
        b"close"
    } else {
        b"keep-alive"
    };
    headers.push(("connection".into(), connection.to_vec()));
}

/// The machine's host name, as nginx names a server without
/// `server_name` (`gethostname`).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// nginx 1.27.4's answer to an HTTP/1.1 request without `Host`.
fn nginx_bad_request() -> Response<Body> {
    const PAGE: &str = "<html>\r\n<head><title>400 Bad Request</title></head>\r\n<body>\r\n\
<center><h1>400 Bad Request</h1></center>\r\n<hr><center>nginx/1.27.4</center>\r\n</body>\r\n</html>\r\n";
    let mut response = Response::new(full(PAGE));
    *response.status_mut() = hyper::StatusCode::BAD_REQUEST;
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        hyper::header::HeaderValue::from_static("text/html"),
    );
    headers.insert(
        "connection",
        hyper::header::HeaderValue::from_static("close"),
    );
    response
}

fn client_response(headers: &Headers, body: Body) -> Result<Response<Body>> {
    let status = headers
        .iter()
        .find(|(k, _)| k == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
        .unwrap_or(502);
    let mut builder = Response::builder().status(status);
    for (name, value) in headers {
        if !name.starts_with(':') && !HOP_BY_HOP.contains(&name.as_str()) {
            builder = builder.header(name.as_str(), value.as_slice());
        }
    }
    builder.body(body).context("building the client response")
}

/// Waits until `addr` accepts connections (for callers that start a server
/// and immediately use it).
pub fn wait_listening(addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(anyhow!(
        "{addr} did not accept connections within {timeout:?}"
    ))
}
