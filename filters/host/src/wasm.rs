//! [`WasmHost`]: the plain Proxy-Wasm host, each method one host call
//! (through the SDK's `hostcalls`, or [`crate::raw`] where the SDK would
//! copy per header or panic on a refusal).
// The one place the raw host calls are made (see clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::cell::Cell;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal;

use crate::host::{Body, Headers, Host, MetricKind, Platform, Respond, RootHost, StreamHost};
use crate::raw;
use crate::stage::Hosts;

/// The Proxy-Wasm host a filter runs in, as its own filter.
#[derive(Debug, Default, Clone, Copy)]
pub struct WasmHost;

thread_local! {
    /// The platform, learned once per VM (see [`WasmHost::platform`]).
    static PLATFORM: Cell<Option<Platform>> = const { Cell::new(None) };
    /// Whether hand-offs live under `kong.ctx.shared.*` (Kong Gateway),
    /// learned once per VM.
    static KONG_HANDOFFS: Cell<Option<bool>> = const { Cell::new(None) };
}

impl WasmHost {
    /// The plugin configuration as the host gives it (empty if none).
    pub fn plugin_configuration(&mut self) -> Vec<u8> {
        match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            _ => Vec::new(),
        }
    }

    /// Asks the host to continue the current request, whatever the
    /// platform (the fused filter, once every stage let it through).
    pub fn continue_request(&mut self) {
        if self.resumes_after_callouts() {
            // The host continues the request itself once the answer returns.
            return;
        }
        let _ = hostcalls::resume_http_request();
    }

    /// `path` as this host names it: hand-off properties move to
    /// `kong.ctx.shared.*` in Kong Gateway, everything else stays.
    fn host_path(path: &str) -> std::borrow::Cow<'_, str> {
        if path.starts_with(internal::HANDOFF_PREFIX)
            && kong_handoffs()
            && let Some(kong) = internal::kong_handoff_path(path)
        {
            return std::borrow::Cow::Owned(kong);
        }
        std::borrow::Cow::Borrowed(path)
    }

    /// Header map `map` of the current stream, read with one host call.
    pub fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock> {
        raw::read(map_type(map)).ok()
    }
}

/// The roots of the host attributes a stage reads (`source.address`).
const ATTRIBUTE_ROOTS: [&str; 6] = [
    "source",
    "destination",
    "request",
    "response",
    "connection",
    "upstream",
];

/// `path` as the segments `proxy_get_property` takes. An attribute goes
/// segment by segment (`source`, `address`): Envoy reads a single
/// `source.address` as a filter state name, finds none, and the stage got
/// no client address at all (every client in one lazy-admission bucket).
/// ngx_wasm_module joins segments with dots, so both hosts read the same.
/// Anything else (filter state, hand-offs, `ngx.*`, `kong.*`) stays whole.
fn property_segments(path: &str) -> Vec<&str> {
    match path.split_once('.') {
        Some((root, _)) if ATTRIBUTE_ROOTS.contains(&root) => path.split('.').collect(),
        _ => vec![path],
    }
}

/// Whether the host is Kong Gateway (only it has `kong.version`).
fn kong_handoffs() -> bool {
    KONG_HANDOFFS.with(|k| {
        if let Some(known) = k.get() {
            return known;
        }
        let kong = matches!(
            hostcalls::get_property(vec![internal::KONG_VERSION_PROPERTY]),
            Ok(Some(_))
        );
        k.set(Some(kong));
        kong
    })
}

/// The SDK's map type for `map`.
pub(crate) fn map_type(map: Headers) -> MapType {
    match map {
        Headers::Request => MapType::HttpRequestHeaders,
        Headers::Response => MapType::HttpResponseHeaders,
    }
}

/// The SDK's buffer type for `body`.
fn buffer_type(body: Body) -> BufferType {
    match body {
        Body::Request => BufferType::HttpRequestBody,
        Body::Response => BufferType::HttpResponseBody,
    }
}

impl Host for WasmHost {
    fn now(&mut self) -> Duration {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default()
    }

    fn platform(&mut self) -> Platform {
        PLATFORM.with(|p| {
            if let Some(known) = p.get() {
                return known;
            }
            // Recognised by an nginx variable; asked from a request context
            // only (asking from a root context is not safe there).
            let ngx = matches!(
                hostcalls::get_property(vec![internal::NGX_VERSION_PROPERTY]),
                Ok(Some(_))
            );
            let platform = if ngx {
                Platform::NgxWasm
            } else {
                Platform::Envoy
            };
            p.set(Some(platform));
            platform
        })
    }

    fn fused(&self) -> bool {
        false
    }

    fn set_tick_period(&mut self, period: Duration) -> Result<(), Status> {
        hostcalls::set_tick_period(period)
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        hostcalls::set_shared_data(key, Some(value), cas)
    }

    fn register_queue(&mut self, name: &str) -> Result<u32, Status> {
        hostcalls::register_shared_queue(name)
    }

    fn resolve_queue(&mut self, vm_id: &str, name: &str) -> Option<u32> {
        hostcalls::resolve_shared_queue(vm_id, name).ok().flatten()
    }

    fn enqueue(&mut self, queue: u32, bytes: &[u8]) -> Result<(), Status> {
        hostcalls::enqueue_shared_queue(queue, Some(bytes))
    }

    fn dequeue(&mut self, queue: u32) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::dequeue_shared_queue(queue)
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), body, vec![], timeout)
    }

    fn callout_status(&mut self) -> Option<u16> {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
    }

    fn callout_retry_after(&mut self) -> Option<u64> {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, "retry-after")
            .ok()
            .flatten()
            .and_then(|v| zerolayer_core::reply::retry_after_secs(&v))
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Proxy-Wasm names only: the labels go into the name (flattened as
    /// the shipped configs' `stats_tags` expect); counters are batched by
    /// the stage and reported by id.
    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: zerolayer_core::metrics::MetricName<'_>,
    ) -> Result<crate::MetricId, Status> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, &name.to_string()).map(crate::MetricId::reported)
    }

    fn increment_metric(&mut self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

/// A stage as its own filter (or in a test) has one host for its root and
/// its streams.
impl Hosts for WasmHost {
    type Root = WasmHost;
    type Stream = WasmHost;
}

impl Respond for WasmHost {
    fn resume(&mut self) {
        self.continue_request();
    }

    fn send_local_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Status> {
        hostcalls::send_http_response(status, headers.to_vec(), Some(body))
    }
}

impl RootHost for WasmHost {
    fn set_effective_context(&mut self, context_id: u32) -> Result<(), Status> {
        hostcalls::set_effective_context(context_id)
    }
}

impl StreamHost for WasmHost {
    fn with_header<T>(
        &mut self,
        map: Headers,
        name: &str,
        f: impl FnOnce(Option<&[u8]>) -> T,
    ) -> T {
        // One host call; the value is the host's copy, borrowed by `f`.
        let value = hostcalls::get_map_value_bytes(map_type(map), name)
            .ok()
            .flatten();
        f(value.as_deref())
    }

    fn with_headers<T>(&mut self, map: Headers, f: impl FnOnce(&HeaderBlock) -> T) -> T {
        f(&self.read_headers(map).unwrap_or_default())
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        let _ = hostcalls::set_map_value_bytes(map_type(map), name, Some(value));
    }

    fn add_header(&mut self, map: Headers, name: &str, value: &[u8]) {
        let _ = hostcalls::add_map_value_bytes(map_type(map), name, value);
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> bool {
        hostcalls::remove_map_value(map_type(map), name).is_ok()
    }

    fn with_body<T>(&mut self, body: Body, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        let bytes = hostcalls::get_buffer(buffer_type(body), 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        f(&bytes)
    }

    fn set_body(&mut self, body: Body, size: usize, bytes: &[u8]) -> Result<(), Status> {
        // Envoy replaces the range `[0, size)` and accepts any size covering
        // the buffer; ngx_wasm_module truncates `bytes` to `size`, so a body
        // that grew (metering's `include_usage`) would reach the upstream cut
        // short under its new content-length. The larger of the two suits both.
        hostcalls::set_buffer(buffer_type(body), 0, size.max(bytes.len()), bytes)
    }

    fn property(&mut self, path: &str) -> Option<Vec<u8>> {
        let path = WasmHost::host_path(path);
        hostcalls::get_property(property_segments(&path))
            .ok()
            .flatten()
    }

    fn publish(&mut self, path: &str, value: &[u8]) {
        let path = WasmHost::host_path(path);
        // Not through the SDK's `set_property`, which panics (killing the
        // VM) on a host's refusal instead of returning it.
        if let Err(status) = raw::set_property(&path, value) {
            log::warn!("could not publish {path}: {status:?}");
        }
    }

    fn set_property(&mut self, path: &str, value: &[u8]) -> Result<(), Status> {
        raw::set_property(path, value)
    }
}

#[cfg(test)]
mod tests {
    use super::property_segments;

    #[test]
    fn attributes_go_segment_by_segment_and_names_stay_whole() {
        assert_eq!(property_segments("source.address"), ["source", "address"]);
        assert_eq!(
            property_segments("request.headers.x-a"),
            ["request", "headers", "x-a"]
        );
        for whole in [
            "wasmx.zerolayer_auth",
            "kong.ctx.shared.zerolayer_auth",
            "ngx.request_id",
            "plugin_name",
            "sources.x",
        ] {
            assert_eq!(property_segments(whole), [whole]);
        }
    }
}
