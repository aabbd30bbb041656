//! The Proxy-Wasm side every zerolayer filter shares. Logic stays in
//! `zerolayer-core`; this crate only wraps host calls the same way for every
//! filter: configuration loading with one clear log line, counters batched
//! in Wasm memory and flushed on tick, shared data with CAS, properties, and
//! the JSON error responses clients get.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

use std::cell::Cell;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use zerolayer_core::ConfigError;
use zerolayer_core::config::ObserverLink;
use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;
use zerolayer_core::metrics::PendingCounters;

pub mod fused;
mod host_map;
pub mod timing;
use zerolayer_core::queue;

/// Reads the plugin configuration and parses it with `parse`; on error logs
/// one line naming the field (`<filter>: invalid configuration: <path>:
/// <problem>`) and returns `None`, so `on_configure` can refuse.
pub fn load_config<T>(
    filter: &str,
    parse: impl FnOnce(&[u8]) -> Result<T, ConfigError>,
) -> Option<T> {
    match parse(&fused::plugin_configuration()) {
        Ok(config) => Some(config),
        Err(err) => {
            log::error!("{filter}: invalid configuration: {err}");
            None
        }
    }
}

/// Host time, Unix seconds (0 if the host cannot tell).
pub fn now_secs() -> u64 {
    now().as_secs()
}

/// Host time, Unix milliseconds.
pub fn now_ms() -> u64 {
    now().as_millis() as u64
}

/// Host time, Unix microseconds.
pub fn now_us() -> u64 {
    now().as_micros() as u64
}

fn now() -> Duration {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default()
}

/// Header `name` of `map`: from the fused filter's copy when there is one.
fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    if let Some(value) = fused::with_headers(map, |headers| headers.get(name).map(<[u8]>::to_vec)) {
        return value;
    }
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

/// Sets (replacing) header `name` of `map`, and the fused filter's copy.
fn set_header(map: MapType, name: &str, value: &[u8]) {
    let _ = hostcalls::set_map_value_bytes(map, name, Some(value));
    fused::with_headers(map, |headers| headers.set(name, value));
}

/// A request header's value.
pub fn request_header(name: &str) -> Option<Vec<u8>> {
    header(MapType::HttpRequestHeaders, name)
}

/// Runs `f` on the request headers: the fused filter's copy when there is
/// one (not copied again), else one read from the host (an empty map if
/// the host has none to give). `f` must not change headers or publish (do
/// that after it returns).
pub fn with_request_headers<T>(f: impl FnOnce(&HeaderBlock) -> T) -> T {
    match fused::with_headers_or(MapType::HttpRequestHeaders, |headers| f(headers)) {
        Ok(out) => out,
        Err(f) => f(&mut host_map::read(MapType::HttpRequestHeaders).unwrap_or_default()),
    }
}

/// Sets (replacing) a request header.
pub fn set_request_header(name: &str, value: &[u8]) {
    set_header(MapType::HttpRequestHeaders, name, value);
}

/// Asks the backend for an uncompressed response (`accept-encoding:
/// identity`) unless the request already does: a stage that reads the
/// response body (usage, the cache entry) needs the bytes as sent. In
/// Envoy a compressor before the chain can still compress towards the
/// client (`envoy/zerolayer.yaml`).
pub fn ask_identity_encoding() {
    let accept = request_header("accept-encoding");
    if !zerolayer_core::encoding::asks_identity(accept.as_deref()) {
        set_request_header("accept-encoding", zerolayer_core::encoding::IDENTITY);
    }
}

/// Removes header `name` of `map`; returns whether the host removed it.
/// When the fused filter's copy shows it absent, the host is not asked.
fn remove_header(map: MapType, name: &str) -> bool {
    if fused::with_headers(map, |headers| headers.get(name).is_none()) == Some(true) {
        return false;
    }
    let removed = hostcalls::remove_map_value(map, name).is_ok();
    fused::with_headers(map, |headers| headers.remove(name));
    removed
}

/// Removes a request header; returns whether the host removed it.
pub fn remove_request_header(name: &str) -> bool {
    remove_header(MapType::HttpRequestHeaders, name)
}

/// Removes a response header; returns whether the host removed it.
pub fn remove_response_header(name: &str) -> bool {
    remove_header(MapType::HttpResponseHeaders, name)
}

/// Removes every response header whose name `reserved` accepts (names the
/// upstream must not set, since the client would read them as the
/// gateway's); returns how many names were removed. One read of the map
/// (the fused filter's copy when there is one); nothing is copied unless a
/// name matches.
pub fn remove_reserved_response_headers(reserved: impl Fn(&str) -> bool) -> usize {
    let matching = |headers: &HeaderBlock| -> Vec<String> {
        headers
            .iter()
            .filter_map(|(name, _)| std::str::from_utf8(name).ok())
            .filter(|name| reserved(name))
            .map(str::to_string)
            .collect()
    };
    let names = match fused::with_headers_or(MapType::HttpResponseHeaders, |h| matching(h)) {
        Ok(names) => names,
        Err(_) => host_map::read(MapType::HttpResponseHeaders)
            .map(|headers| matching(&headers))
            .unwrap_or_default(),
    };
    for name in &names {
        remove_response_header(name);
    }
    names.len()
}

/// A response header's value, as text (`None` if absent or not UTF-8).
pub fn response_header(name: &str) -> Option<String> {
    // The SDK's text getter panics on non-UTF-8 values: read bytes.
    header(MapType::HttpResponseHeaders, name).and_then(|v| String::from_utf8(v).ok())
}

/// Sets (replacing) a response header.
pub fn set_response_header(name: &str, value: &str) {
    set_header(MapType::HttpResponseHeaders, name, value.as_bytes());
}

/// Runs `f` on the first `size` bytes of body `buffer` (the request body
/// buffered so far, or the response chunk), as the current callback has it.
/// In the fused filter the stages of a callback share one read.
pub fn with_body<T>(buffer: BufferType, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
    fused::with_body(buffer, size, f)
}

/// Replaces the first `size` bytes of body `buffer` (all of it, as the
/// callback has it) with `bytes` (the fused filter's stages after this one
/// then see the new body).
pub fn set_body(buffer: BufferType, size: usize, bytes: &[u8]) -> Result<(), Status> {
    // Envoy replaces the range `[0, size)` and accepts any size covering the
    // buffer; ngx_wasm_module truncates `bytes` to `size`, so a body that
    // grew (metering's `include_usage`) would reach the upstream cut short
    // under its new content-length. The larger of the two suits both.
    let result = hostcalls::set_buffer(buffer, 0, size.max(bytes.len()), bytes);
    fused::body_replaced();
    result
}

/// Which kind of Proxy-Wasm host runs this VM, learned once per VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostKind {
    /// Not asked yet.
    Unknown,
    /// Envoy (and host-sim's Envoy profile).
    Envoy,
    /// ngx_wasm_module: Kong Gateway's host, or nginx with the module.
    NgxWasm,
}

thread_local! {
    static HOST_KIND: Cell<HostKind> = const { Cell::new(HostKind::Unknown) };
}

/// Whether this VM runs in ngx_wasm_module, recognised by an nginx
/// variable. Call from a request context: only a request has variables
/// (asking from a root context is not safe there).
fn in_ngx_wasm() -> bool {
    HOST_KIND.with(|kind| {
        if kind.get() == HostKind::Unknown {
            let ngx = matches!(
                hostcalls::get_property(vec![internal::NGX_VERSION_PROPERTY]),
                Ok(Some(_))
            );
            kind.set(if ngx {
                HostKind::NgxWasm
            } else {
                HostKind::Envoy
            });
        }
        kind.get() == HostKind::NgxWasm
    })
}

/// Whether a filter may return `Pause` from the request headers to wait for
/// the body. Envoy resumes it when the body arrives; ngx_wasm_module never
/// does (it reads the body only after every filter let the headers
/// through, in the content phase, and hands it to each filter once, whole),
/// so there a body-dependent decision is made in the body callback, with
/// the headers already passed on. Call from a request context.
pub fn can_hold_headers_for_body() -> bool {
    !in_ngx_wasm()
}

/// Whether a root context can act on a paused request (answer or resume
/// it from `on_tick` after `set_effective_context`). ngx_wasm_module's
/// `proxy_set_effective_context` does nothing, and a local response sent
/// from a tick crashes its worker: there a request is only ever resumed
/// from its own callbacks. Call from a request context.
pub fn can_resume_from_tick() -> bool {
    !in_ngx_wasm()
}

/// Whether the host continues a request by itself once the callouts its
/// callbacks made have answered (ngx_wasm_module: it resumes the paused
/// step after the last one). There a `proxy_continue_stream` from the
/// answer is one continue too many: now and then the request was never
/// finalized and its keep-alive connection hung. Call from a request
/// context.
pub fn resumes_after_callouts() -> bool {
    in_ngx_wasm()
}

/// Sets nginx variable `path` (`ngx.<name>`) where the host is
/// ngx_wasm_module and the operator declared it; elsewhere, or undeclared,
/// nothing happens. Call from a request context.
pub fn set_ngx_variable(path: &str, value: &[u8]) {
    if in_ngx_wasm() {
        // An undeclared variable is refused (NotFound): the operator chose
        // not to log it. Not through the SDK, which panics on a refusal.
        let _ = host_map::set_property(path, value);
    }
}

/// Whether later filters of the chain see a response before this one:
/// ngx_wasm_module runs every phase in chain order, Envoy runs response
/// phases in reverse (and the fused filter runs its stages so everywhere).
/// Call from a request context (see [`can_hold_headers_for_body`]).
pub fn responses_in_chain_order() -> bool {
    in_ngx_wasm() && !fused::is_fused()
}

/// Answers the request from the gateway with exactly `body`. ngx_wasm_module
/// appends a line feed to every local response body; a body that ends in
/// one is sent there without it, so the client still gets these bytes (every
/// SSE stream does; a JSON body without a final line feed gets one there).
pub fn send_response(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> Result<(), Status> {
    let body = match body.strip_suffix(b"\n") {
        Some(trimmed) if in_ngx_wasm() => trimmed,
        _ => body,
    };
    let sent = hostcalls::send_http_response(status, headers, Some(body));
    fused::answered();
    sent
}

/// Where the host keeps the values filters hand to later filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handoff {
    /// Not asked yet.
    Unknown,
    /// `wasmx.*`: Envoy (filter state) and ngx_wasm_module's default.
    Wasmx,
    /// `kong.ctx.shared.*`: Kong Gateway's build of ngx_wasm_module.
    KongShared,
}

thread_local! {
    static HANDOFF: Cell<Handoff> = const { Cell::new(Handoff::Unknown) };
}

/// The host's hand-off namespace, learned once per VM from whether
/// `kong.version` answers (only Kong Gateway has it).
fn handoff() -> Handoff {
    HANDOFF.with(|h| {
        if h.get() == Handoff::Unknown {
            let kong = matches!(
                hostcalls::get_property(vec![internal::KONG_VERSION_PROPERTY]),
                Ok(Some(_))
            );
            h.set(if kong {
                Handoff::KongShared
            } else {
                Handoff::Wasmx
            });
        }
        h.get()
    })
}

/// `path` as this host names it: hand-off properties move to
/// `kong.ctx.shared.*` in Kong Gateway, everything else stays.
fn host_path(path: &str) -> std::borrow::Cow<'_, str> {
    if path.starts_with(internal::HANDOFF_PREFIX)
        && handoff() == Handoff::KongShared
        && let Some(kong) = internal::kong_handoff_path(path)
    {
        return std::borrow::Cow::Owned(kong);
    }
    std::borrow::Cow::Borrowed(path)
}

/// Reads a property (filter state or an Envoy attribute).
pub fn property(path: &str) -> Option<Vec<u8>> {
    if let Some(value) = fused::handoff(path) {
        return Some(value);
    }
    hostcalls::get_property(vec![&host_path(path)])
        .ok()
        .flatten()
}

/// Publishes a value to later filters of the same request, as a one-segment
/// property (see `zerolayer_core::internal`).
pub fn publish(path: &str, value: &[u8]) {
    fused::remember_handoff(path, value);
    let path = host_path(path);
    // Not through the SDK's `set_property`, which panics (killing the VM)
    // on a host's refusal instead of returning it.
    if let Err(status) = host_map::set_property(&path, value) {
        log::warn!("could not publish {path}: {status:?}");
    }
}

/// The observer's job queue as a filter reaches it: owned (tick mode, the
/// filter's root registered it) or resolved on first use (singleton mode:
/// the observer service may configure after the filters).
/// In tick mode, posts are bounded by `observer.max_queued_bytes` (see
/// `zerolayer_core::queue`): the host's queue may be a fixed-size ring that
/// traps when full (Kong).
pub struct ObserverQueue {
    link: ObserverLink,
    id: Cell<Option<u32>>,
    /// The backlog counter's shared-data key (tick mode).
    backlog: Option<String>,
}

impl ObserverQueue {
    /// The queue `filter` reaches through `link`; `owned` when this VM
    /// registered it.
    pub fn new(link: ObserverLink, owned: Option<u32>, filter: &str) -> ObserverQueue {
        let backlog = link.backlog_key(filter);
        ObserverQueue {
            link,
            id: Cell::new(owned),
            backlog,
        }
    }

    /// The queue id, resolving it if needed (`None` while the observer is
    /// not there).
    pub fn get(&self) -> Option<u32> {
        if let Some(id) = self.id.get() {
            return Some(id);
        }
        match hostcalls::resolve_shared_queue(&self.link.vm_id, &self.link.queue) {
            Ok(Some(id)) => {
                self.id.set(Some(id));
                Some(id)
            }
            _ => None,
        }
    }

    /// Posts `job`; returns whether it was queued (not: no observer, or
    /// the queue is at its bound).
    pub fn post(&self, job: &[u8]) -> bool {
        let Some(q) = self.get() else {
            return false;
        };
        if let Some(key) = &self.backlog
            && !reserve_backlog(key, job.len(), self.link.max_queued_bytes)
        {
            return false;
        }
        if hostcalls::enqueue_shared_queue(q, Some(job)).is_ok() {
            return true;
        }
        if let Some(key) = &self.backlog {
            release_backlog(key, queue::queued_size(job.len()));
        }
        false
    }
}

/// Counts a job of `len` bytes into the backlog at `key` unless it would
/// pass `max_bytes`; returns whether it was counted.
fn reserve_backlog(key: &str, len: usize, max_bytes: u64) -> bool {
    shared_update_if(key, |current| {
        match queue::admit(queue::decode_backlog(current), len, max_bytes) {
            Some(next) => (Some(queue::encode_backlog(next).to_vec()), true),
            None => (None, false),
        }
    })
    .unwrap_or(false)
}

/// Takes `bytes` off the backlog at `key` (the observer drained them).
pub fn release_backlog(key: &str, bytes: u64) {
    let _ = shared_update(key, |current| {
        let left = queue::decode_backlog(current).saturating_sub(bytes);
        (queue::encode_backlog(left).to_vec(), ())
    });
}

/// Answers the request with `{"error":{"type":…,"message":…}}`.
pub fn send_json_error(status: u32, kind: &str, message: &str) {
    json_error(status, kind, message, false);
}

/// [`send_json_error`] from a callout's answer, before the host read the
/// request body. ngx_wasm_module reads the body only after the request
/// headers went on, and a body left unread there was now and then parsed
/// as the next request on the keep-alive connection (a 400 for it): there
/// the response closes the connection.
pub fn send_json_error_before_body(status: u32, kind: &str, message: &str) {
    json_error(status, kind, message, in_ngx_wasm());
}

fn json_error(status: u32, kind: &str, message: &str, close: bool) {
    let body = serde_json::json!({"error": {"type": kind, "message": message}}).to_string();
    let mut headers = vec![("content-type", "application/json")];
    if close {
        headers.push(("connection", "close"));
    }
    if let Err(err) = send_response(status, headers, body.as_bytes()) {
        log::error!("could not send a {status} response: {err:?}");
    }
}

/// Shared data `key`: value and CAS.
pub fn shared_get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    hostcalls::get_shared_data(key).unwrap_or((None, None))
}

/// Writes shared data `key` unconditionally (Envoy) or with the current CAS
/// where a host requires it to overwrite (Kong).
pub fn shared_put(key: &str, value: &[u8]) -> bool {
    for _ in 0..4 {
        let (_, cas) = shared_get(key);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => return true,
            Err(Status::CasMismatch) => continue,
            Err(status) => {
                log::warn!("shared data {key}: {status:?}");
                return false;
            }
        }
    }
    false
}

/// Read-modify-write of shared data `key` with compare-and-swap, retried a
/// few times under contention: `update` gets the current value and returns
/// the new one. Returns the value written, or `None` if it lost every race.
pub fn shared_update<T>(
    key: &str,
    mut update: impl FnMut(Option<&[u8]>) -> (Vec<u8>, T),
) -> Option<T> {
    shared_update_if(key, |current| {
        let (next, result) = update(current);
        (Some(next), result)
    })
}

/// [`shared_update`] where `update` may leave the value as it is (`None`:
/// nothing is written, its result is returned at once).
pub fn shared_update_if<T>(
    key: &str,
    mut update: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Option<T> {
    for _ in 0..8 {
        let (current, cas) = shared_get(key);
        let (next, result) = update(current.as_deref());
        let Some(next) = next else {
            return Some(result);
        };
        match hostcalls::set_shared_data(key, Some(&next), cas) {
            Ok(()) => return Some(result),
            Err(Status::CasMismatch) => continue,
            Err(status) => {
                log::warn!("shared data {key}: {status:?}");
                return None;
            }
        }
    }
    None
}

/// Counters defined with the host, incremented in Wasm memory on the request
/// path and reported from the root context's tick ([`Counters::flush`]).
pub struct Counters {
    ids: Vec<Option<u32>>,
    pending: PendingCounters,
}

impl Counters {
    /// Defines one counter per name (a host without metrics leaves them uncounted).
    pub fn define(filter: &str, names: &[String]) -> Counters {
        let ids = names
            .iter()
            .map(
                |name| match hostcalls::define_metric(MetricType::Counter, name) {
                    Ok(id) => Some(id),
                    Err(status) => {
                        log::warn!("{filter}: metric {name} unavailable: {status:?}");
                        None
                    }
                },
            )
            .collect();
        Counters {
            ids,
            pending: PendingCounters::new(names.len()),
        }
    }

    /// Adds `n` to counter `index`.
    pub fn add(&self, index: usize, n: u64) {
        self.pending.add(index, n);
    }

    /// Reports pending increments to the host.
    pub fn flush(&self) {
        self.pending.drain(|index, delta| {
            if let Some(Some(id)) = self.ids.get(index) {
                let _ = hostcalls::increment_metric(*id, i64::try_from(delta).unwrap_or(i64::MAX));
            }
        });
    }
}

/// A gauge or histogram recorded directly (off the request path).
pub struct Metric(Option<u32>);

impl Metric {
    /// Defines a gauge.
    pub fn gauge(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Gauge, name).ok())
    }

    /// Defines a histogram.
    pub fn histogram(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Histogram, name).ok())
    }

    /// Sets the gauge / records a histogram sample.
    pub fn record(&self, value: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
