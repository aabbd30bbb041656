//! The [`Host`] trait: everything a stage asks of the proxy, in one place.
//! Its implementations are the plain Proxy-Wasm host ([`crate::WasmHost`]),
//! the fused filter's ([`crate::FusedHost`]) and a recording fake for
//! native tests ([`crate::FakeHost`], feature `fake`).
//!
//! The required methods are the host's primitives; the provided ones
//! compose them the same way for every stage and host (JSON errors, CAS
//! updates, callout answers, what a platform can do).

use std::time::Duration;

use zerolayer_core::auth::identity::Published;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;
use zerolayer_core::reply::{self, RetryHint};
use zerolayer_core::usage::{Missing, Usage};

#[cfg(feature = "wasm")]
pub use proxy_wasm::types::{Action, Status};

/// What a callback tells the host (proxy-wasm's own type in Wasm builds,
/// the same variants without it).
#[cfg(not(feature = "wasm"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Go on.
    Continue,
    /// Stop until resumed.
    Pause,
}

/// A host call's failure (proxy-wasm's own type in Wasm builds, the same
/// variants without it).
#[cfg(not(feature = "wasm"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Status {
    Ok,
    NotFound,
    BadArgument,
    SerializationFailure,
    ParseFailure,
    Empty,
    CasMismatch,
    InternalFailure,
    Unimplemented,
}

/// A header map of the current stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    /// The request headers.
    Request,
    /// The response headers.
    Response,
}

/// A body of the current stream (as the current callback has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// The request body buffered so far.
    Request,
    /// The response chunk.
    Response,
}

/// Body callbacks a stage can be done with before its stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callback {
    /// `on_http_request_body`.
    RequestBody,
    /// `on_http_response_body`.
    ResponseBody,
}

/// Which Proxy-Wasm host runs the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// Envoy (and host-sim's Envoy profile).
    Envoy,
    /// ngx_wasm_module: Kong Gateway's host, or nginx with the module.
    NgxWasm,
}

/// A metric's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only ever incremented.
    Counter,
    /// Set to a value.
    Gauge,
    /// Samples.
    Histogram,
}

/// A callout's answer as a stage reads it: `status` is `None` when the
/// call failed (timeout, reset: no `:status`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CalloutAnswer {
    /// The answer's `:status`.
    pub status: Option<u16>,
    /// The answer's body.
    pub body: Vec<u8>,
    /// Seconds its `retry-after` asks for (a 429's back-pressure).
    pub retry_after_secs: Option<u64>,
}

/// What every context of a stage has of the proxy: the clock, shared data,
/// queues, callouts and metrics. Stage code takes `&mut impl Host` (or a
/// wider [`Respond`], [`RootHost`], [`StreamHost`]) and never calls
/// `proxy_wasm::hostcalls` itself (clippy's `disallowed-methods` keeps it so).
pub trait Host {
    // --- clock, platform ---------------------------------------------------

    /// Host time since the Unix epoch (zero if the host cannot tell).
    fn now(&mut self) -> Duration;

    /// Which host runs the filter. Call from a request context: only a
    /// request has the variable that tells ngx_wasm_module apart.
    fn platform(&mut self) -> Platform;

    /// Whether the stage runs inside the fused filter (one filter instance
    /// for the whole chain) rather than as its own filter.
    fn fused(&self) -> bool;

    /// Asks for the root's tick every `period`.
    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status>;

    // --- shared data -----------------------------------------------------------

    /// Shared data `key`: value and CAS.
    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>);

    /// Writes shared data `key` if its CAS is still `cas` (`None`: any).
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status>;

    // --- queues ----------------------------------------------------------------

    /// Registers (owns) queue `name`; returns its id.
    fn register_queue(&mut self, name: &str) -> Result<u32, Status>;

    /// The id of queue `name` of VM `vm_id`, if it is registered.
    fn resolve_queue(&mut self, vm_id: &str, name: &str) -> Option<u32>;

    /// Adds `bytes` to queue `queue`.
    fn enqueue(&mut self, queue: u32, bytes: &[u8]) -> Result<(), Status>;

    /// Takes the oldest item of queue `queue`.
    fn dequeue(&mut self, queue: u32) -> Result<Option<Vec<u8>>, Status>;

    // --- callouts ----------------------------------------------------------------

    /// Sends a request to `cluster`; returns the token its answer will carry.
    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status>;

    /// The `:status` of the callout being answered (in its answer only).
    fn callout_status(&mut self) -> Option<u16>;

    /// The first `size` bytes of the body of the callout being answered.
    fn callout_body(&mut self, size: usize) -> Vec<u8>;

    /// Seconds the `retry-after` of the callout being answered asks for.
    fn callout_retry_after(&mut self) -> Option<u64>;
    // --- metrics ---------------------------------------------------------------------

    /// Defines a metric: its id and, for a counter the host batches
    /// itself, where increments go without a host call.
    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: zerolayer_core::metrics::MetricName<'_>,
    ) -> Result<crate::MetricId, Status>;

    /// Adds `delta` to counter `id`.
    fn increment_metric(&mut self, id: u32, delta: i64);

    /// Sets gauge `id` / records a histogram sample.
    fn record_metric(&mut self, id: u32, value: u64);

    // === provided ===================================================================

    /// Host time, Unix seconds.
    fn now_secs(&mut self) -> u64 {
        self.now().as_secs()
    }

    /// Host time, Unix milliseconds.
    fn now_ms(&mut self) -> u64 {
        self.now().as_millis() as u64
    }

    /// Host time, Unix microseconds.
    fn now_us(&mut self) -> u64 {
        self.now().as_micros() as u64
    }
    /// Whether a stage may return `Pause` from the request headers to wait
    /// for the body. Envoy resumes it when the body arrives;
    /// ngx_wasm_module never does (it reads the body only after every
    /// filter let the headers through), so there a body-dependent decision
    /// is made in the body callback. Call from a request context.
    fn can_hold_headers_for_body(&mut self) -> bool {
        self.platform() != Platform::NgxWasm
    }

    /// Whether a root context can act on a paused request (answer or resume
    /// it from `on_tick` after `set_effective_context`): not in
    /// ngx_wasm_module, whose `proxy_set_effective_context` does nothing.
    fn can_resume_from_tick(&mut self) -> bool {
        self.platform() != Platform::NgxWasm
    }

    /// Whether the host continues a request by itself once the callouts its
    /// callbacks made have answered (ngx_wasm_module): a resume from the
    /// answer would be one too many there.
    fn resumes_after_callouts(&mut self) -> bool {
        self.platform() == Platform::NgxWasm
    }

    /// Whether a request's body may be read and replaced from a callout's
    /// answer while the request waits: not in ngx_wasm_module, which
    /// traps a body read outside `on_request_body` (the instance dies).
    fn can_rewrite_request_body_from_callout(&mut self) -> bool {
        self.platform() != Platform::NgxWasm
    }

    /// Whether a request body replaced in the body step reaches the
    /// upstream whole after another filter paused that step for a callout:
    /// not in ngx_wasm_module's separate filters, where it arrived cut to
    /// its old length under its old `content-length` (the backend answered
    /// 400). The fused filter never replaces a body after its own pause.
    fn keeps_bodies_replaced_after_a_wait(&mut self) -> bool {
        self.fused() || self.platform() != Platform::NgxWasm
    }

    /// Whether a stage may make a callout from a response phase: not in
    /// ngx_wasm_module, which refuses `proxy_dispatch_http_call` in its
    /// header and body filter phases.
    fn can_call_out_from_response(&mut self) -> bool {
        self.platform() != Platform::NgxWasm
    }

    /// Whether a response chunk may be replaced with nothing: not in
    /// ngx_wasm_module, which drops an emptied chunk's buffers and its end
    /// of stream, so the worker spins in `ngx_event_pipe` and the response
    /// never ends. There a withheld chunk becomes an SSE comment line.
    fn can_empty_response_chunks(&mut self) -> bool {
        self.platform() != Platform::NgxWasm
    }

    /// Whether later filters of the chain see a response before this one:
    /// ngx_wasm_module runs every phase in chain order, Envoy runs response
    /// phases in reverse (and the fused filter runs its stages so everywhere).
    fn responses_in_chain_order(&mut self) -> bool {
        !self.fused() && self.platform() == Platform::NgxWasm
    }
    /// The answer of the callout being answered: its status and body.
    fn callout_answer(&mut self, body_size: usize) -> CalloutAnswer {
        CalloutAnswer {
            status: self.callout_status(),
            body: self.callout_body(body_size),
            retry_after_secs: self.callout_retry_after(),
        }
    }

    /// Writes shared data `key` unconditionally (Envoy) or with the current
    /// CAS where a host requires it to overwrite (Kong).
    fn shared_put(&mut self, key: &str, value: &[u8]) -> bool {
        for _ in 0..4 {
            let (_, cas) = self.shared_get(key);
            match self.shared_set(key, value, cas) {
                Ok(()) => return true,
                Err(Status::CasMismatch) => continue,
                Err(status) => {
                    warn_shared_failure(self, key, status);
                    return false;
                }
            }
        }
        false
    }

    /// Read-modify-write of shared data `key` with compare-and-swap, retried
    /// a few times under contention: `update` gets the current value and
    /// returns the new one. Returns `update`'s result, or `None` if it lost
    /// every race.
    fn shared_update<T>(
        &mut self,
        key: &str,
        mut update: impl FnMut(Option<&[u8]>) -> (Vec<u8>, T),
    ) -> Option<T> {
        self.shared_update_if(key, |current| {
            let (next, result) = update(current);
            (Some(next), result)
        })
    }

    /// [`Host::shared_update`] where `update` may leave the value as it is
    /// (`None`: nothing is written, its result is returned at once).
    fn shared_update_if<T>(
        &mut self,
        key: &str,
        mut update: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
    ) -> Option<T> {
        for _ in 0..8 {
            let (current, cas) = self.shared_get(key);
            let (next, result) = update(current.as_deref());
            let Some(next) = next else {
                return Some(result);
            };
            match self.shared_set(key, &next, cas) {
                Ok(()) => return Some(result),
                Err(Status::CasMismatch) => continue,
                Err(status) => {
                    warn_shared_failure(self, key, status);
                    return None;
                }
            }
        }
        None
    }
}

/// A context that can act on a stream: a stream's own, or a root's once it
/// made one effective ([`RootHost::set_effective_context`]).
pub trait Respond: Host {
    /// Lets the current stream continue after a pause (in the fused
    /// filter: through the stages after this one first).
    fn resume(&mut self);

    /// Answers the current stream from the gateway with exactly this
    /// status, headers and body.
    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status>;

    // === provided ===================================================================

    /// Answers the request with exactly `body`. ngx_wasm_module appends a
    /// line feed to every local response body; a body that ends in one is
    /// sent there without it, so the client still gets these bytes.
    fn send_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        let body = match body.strip_suffix(b"\n") {
            Some(trimmed) if self.platform() == Platform::NgxWasm => trimmed,
            _ => body,
        };
        self.send_local_response(status, headers, body)
    }
}

/// A root context: it acts on a stream (resumes or answers a request it
/// held) after making that stream the effective one.
pub trait RootHost: Respond {
    /// Makes stream `context_id` the one later calls act on (from a root).
    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status>;
}

/// The API a request's `:path` value names ([`StreamHost::provider`]).
pub(crate) fn provider_of_path(path: Option<&[u8]>) -> Option<Provider> {
    Provider::for_path(std::str::from_utf8(path?).ok()?)
}

/// A stream's own context: its headers, bodies and properties.
pub trait StreamHost: Respond {
    // --- headers -------------------------------------------------------------

    /// Header `name` of `map`, copied (see [`StreamHost::with_header`] to
    /// read it where it is).
    fn header(&mut self, map: Headers, name: &str) -> Option<Vec<u8>> {
        self.with_header(map, name, |value| value.map(<[u8]>::to_vec))
    }

    /// Runs `f` on header `name` of `map`, borrowed where the host keeps
    /// the map (the chain's host: no copy per stage), else one host call.
    fn with_header<T>(&mut self, map: Headers, name: &str, f: impl FnOnce(Option<&[u8]>) -> T)
    -> T;

    /// Runs `f` on the whole of `map` (an empty map if the host has none
    /// to give). `f` cannot reach the host: change headers after it returns.
    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T;

    /// Sets (replacing) header `name` of `map`.
    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]);

    /// Adds a value for header `name` of `map` (keeping any other).
    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]);

    /// Removes header `name` of `map`; returns whether the host removed one.
    fn remove_header(&mut self, map: Headers, name: &str) -> bool;

    // --- bodies --------------------------------------------------------------

    /// Runs `f` on the first `size` bytes of `body`, as the current
    /// callback has it.
    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T;

    /// Replaces the first `size` bytes of `body` (all of it, as the callback
    /// has it) with `bytes`.
    fn set_body(&mut self, body: Body, size: usize, bytes: &[u8]) -> Result<(), Status>;

    // --- properties and hand-offs ---------------------------------------------

    /// Reads a property (filter state, a hand-off, an Envoy attribute).
    fn property(&mut self, path: &str) -> Option<Vec<u8>>;

    /// Publishes `value` to later filters of the same request under
    /// hand-off `path` (see `zerolayer_core::internal`).
    fn publish(&mut self, path: &str, value: &[u8]);

    /// Notes that this stage paused the request's body step for a
    /// callout, where the host would then cut a body a later filter
    /// replaces ([`Host::keeps_bodies_replaced_after_a_wait`]).
    fn note_body_wait(&mut self) {
        if !self.keeps_bodies_replaced_after_a_wait() {
            self.publish(internal::BODY_WAITED_PROPERTY, b"1");
        }
    }

    /// Whether the request body may be replaced now: not where an earlier
    /// filter paused its body step and the host would cut the replacement.
    fn may_replace_request_body(&mut self) -> bool {
        self.keeps_bodies_replaced_after_a_wait()
            || self.property(internal::BODY_WAITED_PROPERTY).is_none()
    }

    /// Calls `f` with the identity lazy-auth published for this request,
    /// parsed (a chain that runs in one filter parses it once per stream).
    fn with_identity<T>(&mut self, f: impl FnOnce(&Published) -> T) -> T {
        let value = self.property(internal::AUTH_PROPERTY);
        f(&Published::parse(value.as_deref()))
    }

    /// Sets property `path` as it is named; the host's refusal is a status.
    fn set_property(&mut self, path: &str, value: &[u8]) -> Result<(), Status>;
    /// The current stream's stage will do nothing in `callback` from now
    /// on: in the fused filter it is no longer called for it.
    fn done_with(&mut self, _callback: Callback) {}

    /// Shares the usage this stage read from the response so far with the
    /// stages that see the response after it, where the chain runs in one
    /// filter (fused, native); separate filters keep nothing (each reads
    /// the body itself).
    fn share_usage(&mut self, _usage: Result<Usage, Missing>) {}

    /// The usage an earlier stage of this chain shared for this response
    /// ([`share_usage`](Self::share_usage)); `None`: read it yourself.
    fn shared_usage(&mut self) -> Option<Result<Usage, Missing>> {
        None
    }

    /// The response body bytes the chain passed on so far and whether the
    /// last of them did, where the chain runs in one filter (a stage that
    /// only counts them need not be called per chunk); `None`: count them
    /// yourself.
    fn response_passed(&mut self) -> Option<(u64, bool)> {
        None
    }

    /// Shares the model the request body names, read whole by this stage,
    /// with the stages after it on the request where the chain runs in one
    /// filter: they need not scan the same bytes again.
    fn share_request_model(&mut self, _model: Option<&str>) {}

    /// The model an earlier stage of this chain read from the whole request
    /// body ([`share_request_model`](Self::share_request_model); `Some(None)`:
    /// it names none); `None`: read it yourself.
    fn shared_request_model(&mut self) -> Option<Option<&str>> {
        None
    }
    // === provided ===================================================================

    /// A request header's value.
    fn request_header(&mut self, name: &str) -> Option<Vec<u8>> {
        self.header(Headers::Request, name)
    }

    /// A response header's value, as text (`None` if absent or not UTF-8).
    fn response_header(&mut self, name: &str) -> Option<String> {
        self.header(Headers::Response, name)
            .and_then(|v| String::from_utf8(v).ok())
    }

    /// Sets (replacing) a request header.
    fn set_request_header(&mut self, name: &str, value: &[u8]) {
        self.set_header(Headers::Request, name, value);
    }

    /// Sets (replacing) a response header.
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.set_header(Headers::Response, name, value.as_bytes());
    }

    /// Removes every response header whose name `reserved` accepts (names
    /// the upstream must not set: the client would read them as the
    /// gateway's); returns how many were removed. Nothing is copied unless
    /// a name matches.
    fn remove_reserved_response_headers(&mut self, reserved: impl Fn(&[u8]) -> bool) -> usize {
        let names: Vec<String> = self.with_headers(Headers::Response, |headers| {
            headers
                .iter()
                .filter(|(name, _)| reserved(name))
                .filter_map(|(name, _)| std::str::from_utf8(name).ok())
                .map(str::to_string)
                .collect()
        });
        for name in &names {
            self.remove_header(Headers::Response, name);
        }
        names.len()
    }

    /// Asks the backend for an uncompressed response (`accept-encoding:
    /// identity`) unless the request already does: a stage that reads the
    /// response body (usage, the cache entry) needs the bytes as sent.
    fn ask_identity_encoding(&mut self) {
        let asks = self.with_header(
            Headers::Request,
            "accept-encoding",
            zerolayer_core::encoding::asks_identity,
        );
        if !asks {
            self.set_request_header("accept-encoding", zerolayer_core::encoding::IDENTITY);
        }
    }
    /// Sets nginx variable `path` (`ngx.<name>`) where the host is
    /// ngx_wasm_module and the operator declared it; elsewhere nothing.
    fn set_ngx_variable(&mut self, path: &str, value: &[u8]) {
        if self.platform() == Platform::NgxWasm {
            // An undeclared variable is refused: the operator chose not to log it.
            let _ = self.set_property(path, value);
        }
    }
    /// This request's id (`x-request-id`). Envoy sets one on every request;
    /// ngx_wasm_module does not, so there the first stage to ask sets the
    /// request header from nginx's `$request_id` (random, 32 hex digits):
    /// sampling, records and the backend then all see one id.
    fn request_id(&mut self) -> Option<Vec<u8>> {
        if let Some(id) = self.request_header("x-request-id") {
            return Some(id);
        }
        if self.platform() != Platform::NgxWasm {
            return None;
        }
        let id = self.property("ngx.request_id")?;
        self.set_request_header("x-request-id", &id);
        Some(id)
    }

    /// The API of this request's path (`None`: not an LLM API the stages know).
    fn provider(&mut self) -> Option<Provider> {
        self.with_header(Headers::Request, ":path", provider_of_path)
    }

    /// Answers the request with an error in the format of its API
    /// (`zerolayer_core::reply`), with the retry hints its status calls for
    /// and the request id its client reads.
    fn send_json_error(&mut self, status: u32, kind: &str, message: &str) {
        let retry = RetryHint::for_status(u16::try_from(status).unwrap_or(500));
        json_error(self, status, kind, message, retry, false);
    }

    /// A 429 or 503 whose wait is known (`retry-after: secs`, at least 1),
    /// sent as [`StreamHost::send_json_error`] or, `from_answer`, as
    /// [`StreamHost::send_json_error_before_body`].
    fn send_retry_later(
        &mut self,
        status: u32,
        kind: &str,
        message: &str,
        secs: u64,
        from_answer: bool,
    ) {
        let retry = RetryHint::After(u32::try_from(secs.max(1)).unwrap_or(u32::MAX));
        let close = from_answer && self.platform() == Platform::NgxWasm;
        json_error(self, status, kind, message, retry, close);
    }

    /// [`StreamHost::send_json_error`] from a callout's answer, before the host
    /// read the request body. ngx_wasm_module reads the body only after the
    /// request headers went on, and a body left unread there was now and
    /// then parsed as the next request on the keep-alive connection: there
    /// the response closes the connection.
    fn send_json_error_before_body(&mut self, status: u32, kind: &str, message: &str) {
        let close = self.platform() == Platform::NgxWasm;
        let retry = RetryHint::for_status(u16::try_from(status).unwrap_or(500));
        json_error(self, status, kind, message, retry, close);
    }
}

/// A failed shared-data write, logged at most once a minute per process
/// (or VM) with the number of failures since the last line: a churn
/// refused thousands of times a second must not flood the log.
fn warn_shared_failure<H: Host + ?Sized>(host: &mut H, key: &str, status: Status) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static LOGGED_AT_S: AtomicU64 = AtomicU64::new(0);
    static SINCE: AtomicU64 = AtomicU64::new(0);
    let now = (host.now_us() / 1_000_000).max(1);
    let last = LOGGED_AT_S.load(Relaxed);
    let due = last == 0 || now >= last.saturating_add(60);
    if !due
        || LOGGED_AT_S
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_err()
    {
        SINCE.fetch_add(1, Relaxed);
        return;
    }
    let more = SINCE.swap(0, Relaxed);
    log::warn!(
        "shared data {key}: {status:?} ({more} more failed writes since the last such line; one line a minute at most)"
    );
}

fn json_error<H: StreamHost + ?Sized>(
    host: &mut H,
    status: u32,
    kind: &str,
    message: &str,
    retry: RetryHint,
    close: bool,
) {
    let provider = host.provider();
    let id = host.request_id();
    let code = u16::try_from(status).unwrap_or(500);
    let reply = reply::error(
        provider,
        code,
        kind,
        message,
        retry,
        id.as_deref().and_then(|id| std::str::from_utf8(id).ok()),
    );
    let mut headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    if close {
        headers.push(("connection", "close"));
    }
    if let Err(err) = host.send_response(status, &headers, &reply.body) {
        log::error!("could not send a {status} response: {err:?}");
    }
}
