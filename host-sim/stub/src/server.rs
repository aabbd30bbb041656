//! The HTTP side: accept loop, request log, routing, the latency schedule and
//! the fault injection, over hyper's HTTP/1.1 server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use flate2::write::GzEncoder;
use futures_util::stream;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, sleep_until};

use crate::StubError;
use crate::completion::Completion;
use crate::config::{Compression, Fault, StubConfig};
use crate::headers::RequestOptions;
use crate::provider::{ErrorKind, Provider, Reply, StreamPlan};

/// Request bodies above this size get 413, as a provider answers one over
/// its own limit (Anthropic's is 32 MB); long-context and multimodal
/// requests below it are served.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// How long a disconnect waits after the last event left the channel, so
/// that hyper has flushed it before the connection is torn down.
const FLUSH_GRACE: Duration = Duration::from_millis(20);

/// A request as the stub received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// The method, e.g. `POST`.
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// Every header, names lowercase, values decoded lossily as UTF-8, in
    /// arrival order.
    pub headers: Vec<(String, String)>,
    /// The body bytes (empty when it exceeded the stub's size limit).
    pub body: Vec<u8>,
}

impl RecordedRequest {
    /// The first value of header `name` (case-insensitive), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// State shared by every connection of one stub.
#[derive(Debug)]
pub(crate) struct Shared {
    config: StubConfig,
    cache_control: Option<HeaderValue>,
    log: Mutex<Vec<RecordedRequest>>,
    served: Mutex<HashMap<String, usize>>,
    sequence: AtomicU64,
}

impl Shared {
    pub(crate) fn new(config: StubConfig) -> Result<Self, StubError> {
        let cache_control =
            match config.cache_control.as_str() {
                "" => None,
                value => Some(HeaderValue::from_str(value).map_err(|_| {
                    StubError::InvalidCacheControl {
                        value: value.to_owned(),
                    }
                })?),
            };
        Ok(Self {
            config,
            cache_control,
            log: Mutex::default(),
            served: Mutex::default(),
            sequence: AtomicU64::new(0),
        })
    }

    pub(crate) fn requests(&self) -> Vec<RecordedRequest> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn served(&self, path: &str) -> usize {
        self.served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    fn record(&self, request: RecordedRequest) {
        *self
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(request.path.clone())
            .or_default() += 1;
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(request);
    }
}

/// Accepts connections on `listener` forever, one task per connection.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of descriptors or a connection reset before accept: back
            // off briefly rather than spin or stop serving.
            Err(_) => {
                sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Tokens are tiny writes: without this, Nagle holds them back.
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let service = service_fn(move |request| handle(Arc::clone(&shared), request));
            // A connection error is the client's business (or a fault).
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Body = UnsyncBoxBody<Bytes, Dropped>;

/// The stub dropped the connection on purpose (`disconnect-after`), or the
/// client went away while sending its request.
#[derive(Debug, thiserror::Error)]
#[error("connection dropped: {0}")]
pub(crate) struct Dropped(&'static str);

async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Dropped> {
    let arrived = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Some(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => None,
        Err(_) => return Err(Dropped("the client went away mid-request")),
    };
    let path = parts.uri.path().to_owned();
    shared.record(RecordedRequest {
        method: parts.method.to_string(),
        path: path.clone(),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
            .collect(),
        body: body.as_ref().map(|b| b.to_vec()).unwrap_or_default(),
    });

    let route = Provider::for_path(&path);
    let provider = route
        .unwrap_or_else(|| Provider::guess(&path, parts.headers.contains_key("anthropic-version")));
    let mut answer = Answer {
        provider,
        cache_control: shared.cache_control.clone(),
        retry_after_secs: shared.config.retry_after_secs,
        extra_headers: Vec::new(),
        request_id: parts.headers.get("x-request-id").cloned(),
    };
    let options = match RequestOptions::resolve(
        &shared.config,
        shared.cache_control.as_ref(),
        &parts.headers,
    ) {
        Ok(options) => options,
        Err(message) => return Ok(answer.error(ErrorKind::InvalidRequest, &message)),
    };
    answer.cache_control.clone_from(&options.cache_control);
    answer.extra_headers.clone_from(&options.response_headers);

    if route.is_none() {
        let message = match provider {
            Provider::Anthropic => "Not Found".to_owned(),
            Provider::OpenAi => format!("Invalid URL ({} {path})", parts.method),
        };
        return Ok(answer.error(ErrorKind::NotFound, &message));
    }
    if parts.method != Method::POST {
        let message = format!("Method {} not allowed on {path}; use POST", parts.method);
        let mut response = answer.error(ErrorKind::MethodNotAllowed, &message);
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Ok(response);
    }
    let Some(body) = body else {
        let message = format!("request body exceeds the stub's {MAX_BODY_BYTES} byte limit");
        return Ok(answer.error(ErrorKind::TooLarge, &message));
    };
    let refusal = match options.fault {
        Some(Fault::RateLimited) => Some(ErrorKind::RateLimited),
        Some(Fault::Internal) => Some(ErrorKind::Internal),
        Some(Fault::Unavailable) => Some(ErrorKind::Unavailable),
        Some(Fault::DisconnectAfter(_) | Fault::StallAfter(_)) | None => None,
    };
    if let Some(kind) = refusal {
        return Ok(answer.error(kind, fault_message(provider, kind)));
    }
    let request = match provider.parse(&body) {
        Ok(request) => request,
        Err(message) => return Ok(answer.error(ErrorKind::InvalidRequest, &message)),
    };

    let sequence = shared.sequence.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        id: provider.response_id(request.seed, sequence),
        model: request.model,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        input_tokens: request.input_tokens,
        completion: Completion::generate(request.seed, request.max_tokens, options.output_tokens),
        include_usage: request.include_usage,
    };
    let schedule = Schedule {
        arrived,
        ttft: options.ttft,
        itl: options.itl,
    };
    let gzip = match shared.config.compression {
        Compression::Off => false,
        Compression::Always => true,
        Compression::Negotiated => accepts_gzip(&parts.headers),
    };
    if gzip {
        answer
            .extra_headers
            .push((header::CONTENT_ENCODING, HeaderValue::from_static("gzip")));
    }
    if request.stream {
        let plan = provider.stream(&reply);
        let body = event_stream(plan, schedule, options.fault, gzip);
        Ok(answer.success(&reply.id, "text/event-stream", body))
    } else {
        let tokens = reply.completion.pieces.len();
        match options.fault {
            Some(fault @ (Fault::DisconnectAfter(n) | Fault::StallAfter(n))) => {
                let sent = usize::try_from(n).unwrap_or(usize::MAX).min(tokens);
                wait_until(schedule.after_tokens(sent)).await;
                if let Fault::StallAfter(_) = fault {
                    std::future::pending::<()>().await;
                }
                Err(Dropped("x-stub-fault disconnect-after"))
            }
            _ => {
                wait_until(schedule.after_tokens(tokens)).await;
                let mut bytes = provider.body(&reply);
                if gzip {
                    let mut encoder = Gzip::new();
                    let mut out = encoder.push(&bytes);
                    out.extend_from_slice(&encoder.finish());
                    bytes = Bytes::from(out);
                }
                let body = Full::new(bytes)
                    .map_err(|never: Infallible| match never {})
                    .boxed_unsync();
                Ok(answer.success(&reply.id, "application/json", body))
            }
        }
    }
}

/// The message of an injected 429, 500 or 503, in the provider's words.
fn fault_message(provider: Provider, kind: ErrorKind) -> &'static str {
    match (provider, kind) {
        (Provider::Anthropic, ErrorKind::RateLimited) => {
            "Number of requests has exceeded your rate limit (stub fault 429)."
        }
        (Provider::Anthropic, ErrorKind::Unavailable) => "Overloaded (stub fault 503).",
        (Provider::Anthropic, _) => "Internal server error (stub fault 500).",
        (Provider::OpenAi, ErrorKind::RateLimited) => {
            "Rate limit reached for requests (stub fault 429)."
        }
        (Provider::OpenAi, ErrorKind::Unavailable) => {
            "The engine is currently overloaded, please try again later. (stub fault 503)"
        }
        (Provider::OpenAi, _) => {
            "The server had an error while processing your request. Sorry about that! \
             (stub fault 500)"
        }
    }
}

/// When each token leaves: the first `ttft` after arrival, then one per `itl`.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    arrived: Instant,
    ttft: Duration,
    itl: Duration,
}

impl Schedule {
    /// When token `index` (0-based) is due.
    fn token(&self, index: usize) -> Instant {
        let gaps = u32::try_from(index).unwrap_or(u32::MAX);
        self.arrived + self.ttft + self.itl.saturating_mul(gaps)
    }

    /// When `count` tokens have been generated (`ttft` for none).
    fn after_tokens(&self, count: usize) -> Instant {
        self.token(count.saturating_sub(1))
    }
}

/// Whether an `accept-encoding` header accepts gzip (`gzip` or `*`, not
/// at `q=0`).
fn accepts_gzip(headers: &hyper::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let mut parts = coding.split(';').map(str::trim);
            let name = parts.next().unwrap_or_default();
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !refused
        })
}

/// A gzip stream flushed per push, so each event can be decoded on arrival.
struct Gzip(GzEncoder<Vec<u8>>);

impl Gzip {
    fn new() -> Gzip {
        Gzip(GzEncoder::new(Vec::new(), flate2::Compression::default()))
    }

    /// Compresses `data` and returns what can be sent now.
    fn push(&mut self, data: &[u8]) -> Vec<u8> {
        // Writing to a Vec cannot fail.
        let _ = self.0.write_all(data).and_then(|()| self.0.flush());
        std::mem::take(self.0.get_mut())
    }

    /// The stream's end (the last block and the gzip trailer).
    fn finish(self) -> Vec<u8> {
        self.0.finish().unwrap_or_default()
    }
}

/// A streaming body fed by a task that follows the schedule, one body frame
/// per event, so each event is flushed as it is produced.
fn event_stream(plan: StreamPlan, schedule: Schedule, fault: Option<Fault>, gzip: bool) -> Body {
    let capacity = plan.lead.len() + plan.tokens.len() + plan.tail.len() + 2;
    let (events, mut frames) = mpsc::channel(capacity);
    let encoder = gzip.then(Gzip::new);
    tokio::spawn(produce(events, plan, schedule, fault, encoder));
    StreamBody::new(stream::poll_fn(move |cx| frames.poll_recv(cx))).boxed_unsync()
}

type FrameSender = mpsc::Sender<Result<Frame<Bytes>, Dropped>>;

/// Waits until `deadline`, without touching tokio's timer when it has
/// already passed: the timer's millisecond granularity would otherwise add
/// ~1 ms to every zero-delay answer.
async fn wait_until(deadline: Instant) {
    if Instant::now() < deadline {
        sleep_until(deadline).await;
    }
}

async fn produce(
    events: FrameSender,
    plan: StreamPlan,
    schedule: Schedule,
    fault: Option<Fault>,
    mut gzip: Option<Gzip>,
) {
    let cut = fault
        .and_then(Fault::cut_after)
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    // An event as it goes on the wire (compressed and flushed with gzip).
    let mut frame = |event: Bytes| match &mut gzip {
        Some(encoder) => Frame::data(Bytes::from(encoder.push(&event))),
        None => Frame::data(event),
    };
    wait_until(schedule.token(0)).await;
    for event in plan.lead {
        if events.send(Ok(frame(event))).await.is_err() {
            return; // the client went away
        }
    }
    for (index, event) in plan.tokens.into_iter().enumerate() {
        if cut == Some(index) {
            break;
        }
        wait_until(schedule.token(index)).await;
        if events.send(Ok(frame(event))).await.is_err() {
            return;
        }
    }
    match fault {
        Some(Fault::DisconnectAfter(_)) => {
            // hyper drops buffered bytes when a body fails: let it take and
            // flush every event before failing the body.
            while events.capacity() < events.max_capacity() && !events.is_closed() {
                sleep(Duration::from_millis(1)).await;
            }
            sleep(FLUSH_GRACE).await;
            let _ = events
                .send(Err(Dropped("x-stub-fault disconnect-after")))
                .await;
        }
        // Hold the connection open, silent, until the client gives up (or
        // the stub stops and drops this task).
        Some(Fault::StallAfter(_)) => events.closed().await,
        _ => {
            for event in plan.tail {
                if events.send(Ok(frame(event))).await.is_err() {
                    return;
                }
            }
            if let Some(encoder) = gzip.take() {
                let _ = events
                    .send(Ok(Frame::data(Bytes::from(encoder.finish()))))
                    .await;
            }
        }
    }
}

/// Builds responses in one provider's dialect with the request's headers.
struct Answer {
    provider: Provider,
    cache_control: Option<HeaderValue>,
    retry_after_secs: u32,
    /// Added to every response (`x-stub-response-header`).
    extra_headers: Vec<(HeaderName, HeaderValue)>,
    /// The request's `x-request-id`: answered as the provider's request-id
    /// header on every response, as vLLM does with
    /// `--enable-request-id-headers` (the client then reads the id the
    /// gateway logged).
    request_id: Option<HeaderValue>,
}

impl Answer {
    fn success(&self, id: &str, content_type: &'static str, body: Body) -> Response<Body> {
        let mut response = self.response(StatusCode::OK, content_type, body);
        if self.request_id.is_none()
            && let Ok(id) = HeaderValue::from_str(id)
        {
            response.headers_mut().insert(
                HeaderName::from_static(self.provider.request_id_header()),
                id,
            );
        }
        response
    }

    fn error(&self, kind: ErrorKind, message: &str) -> Response<Body> {
        let body = Full::new(self.provider.error(kind, message))
            .map_err(|never: Infallible| match never {})
            .boxed_unsync();
        let mut response = self.response(kind.status(), "application/json", body);
        if kind.retries_after() {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(self.retry_after_secs),
            );
        }
        response
    }

    fn response(
        &self,
        status: StatusCode,
        content_type: &'static str,
        body: Body,
    ) -> Response<Body> {
        let mut response = Response::new(body);
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        if let Some(value) = &self.cache_control {
            headers.insert(header::CACHE_CONTROL, value.clone());
        }
        for (name, value) in &self.extra_headers {
            headers.append(name.clone(), value.clone());
        }
        if let Some(id) = &self.request_id {
            headers.insert(
                HeaderName::from_static(self.provider.request_id_header()),
                id.clone(),
            );
        }
        response
    }
}
